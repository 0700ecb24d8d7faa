"""Triton norm / RoPE / SiLU / KV-write kernels against their torch-native twins."""

from __future__ import annotations

import pytest
import torch
from nvidia_testutil import DEVICE, DTYPES, ON_GPU, backend, rel_err, tol  # noqa: I001  (sets TRITON_INTERPRET)

from deepinfer.backend.native import NativeOps, rope_cos_sin_cache

NATIVE = NativeOps()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [48, 64])
def test_rms_norm_and_add_rms_norm(dtype, dim):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, dim, generator=g).to(DEVICE, dtype)
    r = torch.randn(7, dim, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE, dtype)
    be = backend()
    out = be.rms_norm(x, w, 1e-6)
    ref = NATIVE.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and rel_err(out, ref) < tol(dtype)
    y, s = be.add_rms_norm(x, r, w, 1e-6)
    ry, rs = NATIVE.add_rms_norm(x, r, w, 1e-6)
    if ON_GPU or dtype != torch.bfloat16:
        assert torch.equal(s, rs)
    else:  # the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest even
        assert rel_err(s, rs) < tol(dtype)
    assert rel_err(y, ry) < tol(dtype)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_yarn(interleaved, dtype):
    g = torch.Generator().manual_seed(2)
    yarn = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
    cache = rope_cos_sin_cache(16, 256, 10000.0, yarn).to(DEVICE)
    pos = torch.tensor([0, 5, 17, 255, 3], device=DEVICE)
    full_q = torch.randn(5, 3, 24, generator=g).to(DEVICE, dtype)
    q = full_q[..., 8:]  # a strided slice, as the model passes q_pe
    k = torch.randn(5, 1, 16, generator=g).to(DEVICE, dtype)
    oq, ok = backend().rotary_embedding(pos, q, k, cache, interleaved)
    rq, rk = NATIVE.rotary_embedding(pos, q, k, cache, interleaved)
    assert rel_err(oq, rq) < tol(dtype) and rel_err(ok, rk) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    assert rel_err(backend().silu_and_mul(x), NATIVE.silu_and_mul(x)) < tol(dtype)


def test_silu_and_mul_rejects_odd_width():
    from deepinfer.errors import BackendError

    with pytest.raises(BackendError, match="even"):
        backend().silu_and_mul(torch.randn(2, 5, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_exact(dtype):
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(4, 4, 24, generator=g).to(DEVICE, dtype)
    ref = cache.clone()
    vals = torch.randn(6, 24, generator=g).to(DEVICE, dtype)
    slots = torch.tensor([3, -1, 15, 0, 8, -1], device=DEVICE)
    backend().kv_cache_write(cache, slots, vals)
    NATIVE.kv_cache_write(ref, slots, vals)
    assert torch.equal(cache, ref)
