"""Linear methods: unquantized and fp8 e4m3 with 128x128 block scales (partial edge blocks)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backend.native import NativeOps
from deepinfer.errors import BackendError, ModelLoadError

OPS = NativeOps()


def _layer(weight, scale=None, bias=None) -> torch.nn.Module:
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(weight, requires_grad=False)
    m.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
    if scale is not None:
        m.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
    return m


def _reference_dequant(w8: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The plain per-element formula: W[i, j] = q[i, j] * scale_inv[i // 128, j // 128]."""
    wf = w8.float()
    out = torch.empty_like(wf)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            rows, cols = slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128)
            out[rows, cols] = wf[rows, cols] * s[bi, bj]
    return out


@pytest.mark.parametrize("shape", [(256, 128), (200, 300), (130, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_dequant_and_apply(shape, dtype):
    g = torch.Generator().manual_seed(0)
    w8 = (torch.randn(shape, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(-(-shape[0] // 128), -(-shape[1] // 128), generator=g) * 0.01 + 1e-3
    bias = torch.randn(shape[0], generator=g)
    layer = _layer(w8, s, bias)
    method = OPS.linear_method("fp8_block")
    method.process_weights(layer, dtype)
    dense = _reference_dequant(w8, s)
    assert layer.weight.dtype == dtype and getattr(layer, "weight_scale_inv", None) is None
    assert torch.equal(method.dense_weight(layer), dense.to(dtype))
    x = torch.randn(3, shape[1], generator=g).to(dtype)
    ref = torch.nn.functional.linear(x.float(), dense.to(dtype).float(), bias.to(dtype).float())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(method.apply(layer, x).float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_fp8_errors_name_the_problem():
    w8 = torch.zeros(256, 128).to(torch.float8_e4m3fn)
    with pytest.raises(ModelLoadError, match=r"expected \(2, 1\)"):
        OPS.linear_method("fp8_block").process_weights(_layer(w8, torch.ones(1, 1)), torch.float32)
    with pytest.raises(ModelLoadError, match="no weight_scale_inv"):
        OPS.linear_method("fp8_block").process_weights(_layer(w8), torch.float32)
    with pytest.raises(ModelLoadError, match="fp8_block"):
        OPS.linear_method("none").process_weights(_layer(w8, torch.ones(2, 1)), torch.float32)
    with pytest.raises(BackendError, match="int4"):
        OPS.linear_method("int4")


def test_fp8_method_keeps_an_unquantized_layer():
    w = torch.randn(8, 4)
    layer = _layer(w.clone())
    OPS.linear_method("fp8_block").process_weights(layer, torch.bfloat16)
    assert torch.equal(layer.weight, w.bfloat16())


def test_unquantized_linear():
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(6, 5, generator=g), torch.randn(6, generator=g), torch.randn(2, 5, generator=g)
    layer = _layer(w.clone(), bias=b.clone())
    m = OPS.linear_method("none")
    m.process_weights(layer, torch.float32)
    torch.testing.assert_close(m.apply(layer, x), x @ w.T + b)


@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])
def test_fp8_dequant_matches_hf_finegrained_fp8(shape):
    """Hugging Face's own block dequantization (used by its FP8 linear backward) as a second reference."""
    hf_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    g = torch.Generator().manual_seed(2)
    w8 = (torch.randn(shape, generator=g) * 30).to(torch.float8_e4m3fn)
    s = torch.rand(-(-shape[0] // 128), -(-shape[1] // 128), generator=g) + 0.01
    layer = _layer(w8, s)
    OPS.linear_method("fp8_block").process_weights(layer, torch.float32)
    ref = hf_fp8._dequantize_fp8_weight(w8, s, [128, 128], torch.float32)
    assert torch.equal(layer.weight, ref)
