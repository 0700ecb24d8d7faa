"""Scatter per-token KV entries into a paged cache by slot index."""

from __future__ import annotations

import torch

from deepinfer.errors import BackendError


def kv_cache_write(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """cache.view(-1, *entry)[slot] = values[i] for every slot >= 0; slot -1 marks a padding row.

    cache is [num_blocks, block_size, *entry]; slot = block * block_size + offset.
    """
    entry = tuple(cache.shape[2:])
    if tuple(values.shape[1:]) != entry:
        raise BackendError(f"kv_cache_write: value rows {tuple(values.shape[1:])} do not match cache entries {entry}")
    if slot_mapping.shape[0] != values.shape[0]:
        raise BackendError(
            f"kv_cache_write: {slot_mapping.shape[0]} slots for {values.shape[0]} value rows"
        )
    flat = cache.view(-1, *entry)
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, values = slots[keep], values[keep]
    if slots.numel() and int(slots.max()) >= flat.shape[0]:
        raise BackendError(f"kv_cache_write: slot {int(slots.max())} is outside the cache ({flat.shape[0]} slots)")
    flat[slots] = values.to(cache.dtype)
