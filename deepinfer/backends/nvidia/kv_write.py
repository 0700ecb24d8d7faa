"""KV-cache write in Triton: scatter one entry per token into its paged slot (slot -1 skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(cache_ptr, slot_ptr, val_ptr, E, stride_v, BLOCK: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < E
        v = tl.load(val_ptr + tok.to(tl.int64) * stride_v + offs, mask=mask)
        tl.store(cache_ptr + slot * E + offs, v.to(cache_ptr.dtype.element_ty), mask=mask)


def kv_cache_write(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """cache.view(-1, *entry)[slot] = values[i] for every slot >= 0."""
    from deepinfer.errors import BackendError

    entry = 1
    for d in cache.shape[2:]:
        entry *= d
    v2 = values.reshape(values.shape[0], -1)
    if v2.shape[1] != entry:
        raise BackendError(f"kv_cache_write: value entry of {v2.shape[1]} elements, cache entry is {entry}")
    if slot_mapping.shape[0] != v2.shape[0]:
        raise BackendError(f"kv_cache_write: {slot_mapping.shape[0]} slots for {v2.shape[0]} values")
    if not cache.is_contiguous():
        raise BackendError("kv_cache_write: cache must be contiguous")
    if v2.stride(-1) != 1:
        v2 = v2.contiguous()
    if v2.shape[0]:
        block = min(1024, triton.next_power_of_2(entry))
        _kv_write_kernel[(v2.shape[0], triton.cdiv(entry, block))](
            cache, slot_mapping, v2, entry, v2.stride(0), BLOCK=block, num_warps=4
        )
