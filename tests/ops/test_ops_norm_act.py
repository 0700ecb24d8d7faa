"""RMSNorm, add+RMSNorm, SwiGLU and KV-cache writes against HF modules and plain formulas."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf3  # noqa: E402

from deepinfer.backend.native import NativeOps  # noqa: E402
from deepinfer.errors import BackendError  # noqa: E402

OPS = NativeOps()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_bit_exact_with_hf(dtype):
    g = torch.Generator().manual_seed(0)
    norm = hf3.DeepseekV3RMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g))
    x = (torch.randn(9, 48, generator=g) * 3).to(dtype)
    out = OPS.rms_norm(x, norm.weight.detach(), 1e-6)
    assert out.dtype == dtype
    assert torch.equal(out, norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(1)
    norm = hf3.DeepseekV3RMSNorm(32, eps=1e-5).to(dtype)
    x = torch.randn(5, 32, generator=g).to(dtype)
    res = torch.randn(5, 32, generator=g).to(dtype)
    out, summed = OPS.add_rms_norm(x, res, norm.weight.detach(), 1e-5)
    assert torch.equal(summed, res + x)
    assert torch.equal(out, norm(res + x))


def test_silu_and_mul_matches_hf_mlp_activation():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 20, generator=g)
    ref = torch.nn.functional.silu(x[:, :10]) * x[:, 10:]
    assert torch.equal(OPS.silu_and_mul(x), ref)
    with pytest.raises(BackendError, match="odd"):
        OPS.silu_and_mul(torch.zeros(2, 7))


def test_kv_cache_write_scatter_and_skip():
    cache = torch.zeros(3, 4, 5)
    vals = torch.arange(4 * 5, dtype=torch.float32).view(4, 5) + 1
    slots = torch.tensor([5, -1, 0, 11])
    OPS.kv_cache_write(cache, slots, vals)
    flat = cache.view(-1, 5)
    assert torch.equal(flat[5], vals[0]) and torch.equal(flat[0], vals[2]) and torch.equal(flat[11], vals[3])
    assert int((flat.abs().sum(-1) > 0).sum()) == 3  # the -1 row wrote nothing
    with pytest.raises(BackendError, match="outside the cache"):
        OPS.kv_cache_write(cache, torch.tensor([12]), vals[:1])
    with pytest.raises(BackendError, match="do not match"):
        OPS.kv_cache_write(cache, torch.tensor([1]), torch.zeros(1, 4))
