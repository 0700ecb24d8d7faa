"""int8 W8A8 dynamic linears on ascend: the fake's npu_dynamic_quant / npu_quant_matmul against torch-native
code, and the backend's int8_w8a8 linear over the fake against the native oracle (native/quant_int8.py)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from deepinfer.backend import NativeOps, OpSpec
from deepinfer.backends.ascend.caps import ascend_caps
from deepinfer.conformance.runner import run_conformance
from deepinfer.errors import BackendError, ModelLoadError

OUT, IN = 48, 64


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (OUT, IN), generator=g, dtype=torch.int32).to(torch.int8)
    return w, torch.rand(OUT, 1, generator=g) * 0.01 + 1e-4


def _linear(backend, dtype: torch.dtype, bias: torch.Tensor | None = None, offset: torch.Tensor | None = None):
    w, s = _weights()
    layer = torch.nn.Module()
    layer.weight, layer.weight_scale, layer.bias = w, s, bias
    layer.weight_offset = torch.zeros_like(s) if offset is None else offset
    method = backend.linear_method("int8_w8a8")
    method.process_weights(layer, dtype)
    return method, layer


def test_fake_dynamic_quant_and_quant_matmul_equal_torch(fake_npu):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, IN, generator=g).bfloat16()
    x[2] = 0  # an all-zero token: scale 0, q 0 (no division by zero)
    q, s = fake_npu.npu_dynamic_quant(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (5,)
    xf = x.float()
    want_s = xf.abs().amax(-1) / 127
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)
    assert int(q.abs().max()) == 127 and not q[2].any()
    assert (q.float() * s.unsqueeze(-1) - xf).abs().max() <= want_s.max() / 2 + 1e-6  # round-to-nearest
    w, ws = _weights()
    wt = w.t().contiguous()  # the op's x2 is [k, n]
    bias = torch.randn(OUT, generator=g).bfloat16()
    y = fake_npu.npu_quant_matmul(q, wt, ws.flatten(), pertoken_scale=s, bias=bias, output_dtype=torch.bfloat16)
    acc = torch.zeros(5, OUT, dtype=torch.int64)
    for kk in range(IN):  # the int32 accumulation, spelled out
        acc += q[:, kk:kk + 1].long() * wt[kk].long()
    want = (acc.float() * ws.flatten() * s.unsqueeze(-1) + bias.float()).bfloat16()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want.float(), rtol=0, atol=0)
    with pytest.raises(TypeError):  # a float x1
        fake_npu.npu_quant_matmul(x, wt, ws.flatten(), pertoken_scale=s, output_dtype=torch.bfloat16)
    with pytest.raises(ValueError):  # per-token scale of the wrong length
        fake_npu.npu_quant_matmul(q, wt, ws.flatten(), pertoken_scale=s[:2], output_dtype=torch.bfloat16)
    with pytest.raises(TypeError):  # fp16 output takes an fp32 scale only
        fake_npu.npu_quant_matmul(q, wt, ws.flatten().bfloat16(), pertoken_scale=s, output_dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_linear_on_ascend_equals_native_oracle(ascend, dtype):
    bias = torch.randn(OUT, generator=torch.Generator().manual_seed(3)).to(dtype)
    x = torch.randn(2, 3, IN, generator=torch.Generator().manual_seed(2)).to(dtype)
    m, layer = _linear(ascend, dtype, bias.clone())
    ref_m, ref_layer = _linear(NativeOps(), dtype, bias.clone())
    y, ref = m.apply(layer, x), ref_m.apply(ref_layer, x)
    assert y.shape == (2, 3, OUT) and y.dtype == dtype
    assert layer.weight.dtype == torch.int8  # kept quantized, not densified
    # same activation quantization and exact fp32 dequant on both sides: at most a rounding of the output differs
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
    torch.testing.assert_close(m.dense_weight(layer).float(), ref_m.dense_weight(ref_layer).float(),
                               rtol=tol, atol=tol * ref_layer.weight.abs().max().item())


def test_conformance_int8_case_passes_and_names_the_op(ascend):
    report = run_conformance(ascend, dtypes=(torch.bfloat16,), ops=["linear:int8_w8a8"])
    assert report.ok and any(r.status == "pass" for r in report.rows), report.format_table()
    assert "npu_quant_matmul" in ascend.op_impl(OpSpec("linear:int8_w8a8", torch.bfloat16, None))


def test_int8_refusals_and_caps_per_chip(ascend):
    with pytest.raises(ModelLoadError, match="fp16 / bf16"):
        _linear(ascend, torch.float32)
    with pytest.raises(ModelLoadError, match="weight_offset is nonzero"):
        _linear(ascend, torch.bfloat16, offset=torch.ones(OUT, 1))
    for chip in ("a2", "a3"):
        assert "int8_w8a8" in ascend_caps(chip, on_cpu=True).quant_schemes
    assert "int8_w8a8" not in ascend_caps("950", on_cpu=True).quant_schemes
    on_950 = copy.copy(ascend)
    on_950.runtime = dataclasses.replace(ascend.runtime, chip="950")
    with pytest.raises(BackendError, match="950"):
        on_950.linear_method("int8_w8a8")
