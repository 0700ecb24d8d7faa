"""Rounding points of the NVIDIA MLA decode (issue 14, numerics): the fused merge + W_UV keeps the merged
latent in fp32 into the W_UV product, so its only rounding is the final store.

The error is measured against the exact (float64) result from the same low-precision inputs, in units of
the error that rounding the exact result once to the output dtype makes: a path with no other rounding
point than the final one scores ~1 (plus the flash-style P rounding of the split kernel, ~0.3 here).
Rounding the merged latent to the dtype before W_UV (the old fused path; still the unfused path's merge
output, which the batched GEMM for batches > MERGE_UV_MAX_BATCH reads) scores ~1.65 here, over the bound.

On the CPU this runs in fp16: the interpreter's fp32 -> bf16 conversion truncates instead of rounding to
nearest (triton/runtime/interpreter.py, cast_impl passes no rounding mode), which hides a rounding point
behind a doubled final error; fp16 conversions there round to nearest as the GPU does. On the GPU bf16 too.
"""

from __future__ import annotations

import pytest
import torch
from nvidia_testutil import DEVICE, ON_GPU

PAGE = 16
BOUND = 1.5  # fused path here: 1.31-1.37 (three seeds, fp16); latent rounded first: 1.63-1.67


def _case(seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    B, H, L, R, V, nb = 4, 4, 128, 16, 64, 4
    to = dict(device=DEVICE, dtype=dtype)
    cache = torch.randn(B * nb, PAGE, L + R, generator=g).to(**to)
    table = torch.arange(B * nb, dtype=torch.int32).view(B, nb).to(DEVICE)
    seq = torch.tensor([64, 50, 33, 61], dtype=torch.int32, device=DEVICE)
    q = (torch.randn(B, H, L + R, generator=g) / 4).to(**to)
    w_uv_t = (torch.randn(H, L, V, generator=g) / L ** 0.5).to(**to)
    ref = torch.zeros(B, H, V, dtype=torch.float64)
    for b in range(B):
        kv = cache.view(-1, L + R)[torch.arange(int(seq[b]), device=DEVICE) + b * nb * PAGE].double().cpu()
        o_lat = ((q[b].double().cpu() @ kv.T) * 0.1).softmax(-1) @ kv[:, :L]
        ref[b] = torch.einsum("hl,hlv->hv", o_lat, w_uv_t.double().cpu())
    return q, cache, table, seq, L, w_uv_t, ref


def _err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((x.double().cpu() - ref).norm(dim=-1) / ref.norm(dim=-1)).mean())


DTYPES = [torch.float16] + ([torch.bfloat16] if ON_GPU else [])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_merge_uv_rounds_once(dtype):
    from deepinfer.backends.nvidia.mla_decode import MERGE_UV_MAX_BATCH, mla_decode

    kw = dict(num_splits=4, block_n=16, min_split=16)  # several splits, batch 4 <= 8: the fused merge + W_UV
    for seed in range(2):
        q, cache, table, seq, L, w_uv_t, ref = _case(seed, dtype)
        assert q.shape[0] <= MERGE_UV_MAX_BATCH
        unit = _err(ref.to(dtype), ref)  # one rounding of the exact result
        fused = mla_decode(q, cache, table, seq, L, 0.1, w_uv_t=w_uv_t, **kw)
        # the old rounding point, reproduced: merged latent in the dtype, then the same fp32 product
        lat = mla_decode(q, cache, table, seq, L, 0.1, **kw)
        lat_first = torch.einsum("bhl,hlv->bhv", lat.float(), w_uv_t.float()).to(dtype)
        assert _err(fused, ref) < BOUND * unit < _err(lat_first, ref), (seed, _err(fused, ref) / unit,
                                                                          _err(lat_first, ref) / unit)
