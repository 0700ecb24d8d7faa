"""int4 weight-only linears on ascend: the fake's npu_convert_weight_to_int4pack / npu_weight_quant_batchmatmul
against torch-native code, and the backend's AWQ / GPTQ linears over the fake against the native int4 reference."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from deepinfer.backend import Int4Weight, NativeOps, OpSpec
from deepinfer.backends.ascend.caps import ascend_caps
from deepinfer.conformance.runner import run_conformance
from deepinfer.errors import BackendError, ModelLoadError, UnsupportedOpError

OUT, IN = 48, 256


def _words(g: torch.Generator, r: int, c: int) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, (r, c), generator=g, dtype=torch.int64).to(torch.int32)


def _int4(method: str, seed: int = 0, g_idx: torch.Tensor | None = None) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    scales = (torch.rand(IN // 128, OUT, generator=g) * 0.02 + 1e-3).half()
    if method == "awq":
        return Int4Weight("awq", _words(g, IN, OUT // 8), _words(g, IN // 128, OUT // 8), scales)
    g_idx = torch.arange(IN, dtype=torch.int32) // 128 if g_idx is None else g_idx
    return Int4Weight("gptq", _words(g, IN // 8, OUT), _words(g, IN // 128, OUT // 8), scales, g_idx, zero_offset=1)


def _linear(backend, w: Int4Weight, dtype: torch.dtype, bias: torch.Tensor | None = None):
    layer = torch.nn.Module()
    layer.int4, layer.weight, layer.bias = w, None, bias
    method = backend.linear_method(w.scheme)
    method.process_weights(layer, dtype)
    return method, layer


def test_fake_weight_quant_batchmatmul_equals_torch(fake_npu):
    g = torch.Generator().manual_seed(1)
    k, n, gs = 256, 16, 128
    w = torch.randint(-8, 8, (k, n), generator=g, dtype=torch.int32)
    packed = fake_npu.npu_convert_weight_to_int4pack(w)
    assert packed.shape == (k, n // 8) and packed.dtype == torch.int32
    x = torch.randn(5, k, generator=g).to(torch.float16)
    scale = (torch.rand(k // gs, n, generator=g) + 0.5).half()
    off = torch.randint(-3, 4, (k // gs, n), generator=g).half()
    y = fake_npu.npu_weight_quant_batchmatmul(x, packed, scale, antiquant_offset=off, antiquant_group_size=gs)
    dense = (w.float() + off.float().repeat_interleave(gs, 0)) * scale.float().repeat_interleave(gs, 0)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), (x.float() @ dense).half().float(), rtol=0, atol=0)
    with pytest.raises(ValueError):  # outside the int4 range
        fake_npu.npu_convert_weight_to_int4pack(w + 8)
    with pytest.raises(TypeError):  # scale in a dtype other than x's
        fake_npu.npu_weight_quant_batchmatmul(x, packed, scale.bfloat16(), antiquant_group_size=gs)
    with pytest.raises(ValueError):  # scale of the wrong group count
        fake_npu.npu_weight_quant_batchmatmul(x, packed, scale[:1], antiquant_group_size=gs)


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int4_linear_on_ascend_equals_native_reference(ascend, method, dtype):
    bias = torch.randn(OUT, generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, 3, IN, generator=torch.Generator().manual_seed(2)).to(dtype)
    m, layer = _linear(ascend, _int4(method), dtype, bias.clone())
    ref_m, ref_layer = _linear(NativeOps(), _int4(method), dtype, bias.clone())
    y, ref = m.apply(layer, x), ref_m.apply(ref_layer, x)
    assert y.shape == (2, 3, OUT) and y.dtype == dtype
    # fp16: scales and offsets exact, only the rounding of the dense weight / matmul differs; bf16: scales rounded
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
    torch.testing.assert_close(m.dense_weight(layer).float(), ref_m.dense_weight(ref_layer).float(),
                               rtol=tol, atol=tol * ref_layer.weight.abs().max().item())


def test_conformance_awq_case_passes_and_names_the_op(ascend):
    report = run_conformance(ascend, dtypes=(torch.float16,), ops=["linear:int4_awq"])
    assert report.ok and any(r.status == "pass" for r in report.rows), report.format_table()
    assert "npu_weight_quant_batchmatmul" in ascend.op_impl(OpSpec("linear:int4_awq", torch.float16, None))


def test_act_order_gptq_is_refused_with_the_reason(ascend):
    perm = torch.randperm(IN, generator=torch.Generator().manual_seed(4)).div(128, rounding_mode="floor")
    with pytest.raises(UnsupportedOpError, match="g_idx"):
        _linear(ascend, _int4("gptq", g_idx=perm.to(torch.int32)), torch.float16)
    with pytest.raises(ModelLoadError, match="fp16 / bf16"):
        _linear(ascend, _int4("awq"), torch.float32)


def test_int4_caps_per_chip(ascend):
    for chip in ("a2", "a3"):
        assert {"int4_awq", "int4_gptq"} <= set(ascend_caps(chip, on_cpu=True).quant_schemes)
    assert not {"int4_awq", "int4_gptq"} & set(ascend_caps("950", on_cpu=True).quant_schemes)
    on_950 = copy.copy(ascend)
    on_950.runtime = dataclasses.replace(ascend.runtime, chip="950")
    with pytest.raises(BackendError, match="950"):
        on_950.linear_method("int4_awq")
