"""MLA attention of one cp rank in a split step (context-parallel prefill, parallel/cp_batch.py).

The rank's own tokens go through the projections as ever (mla.py); then, here:
1. the latent norm and RoPE (q_pe and k_pe) with the backend's small ops, the composition the MLA op's
   default `forward_from_latent` uses (fp32 norm and RoPE, each rounded to the input dtype);
2. the rank's new cache entries (normed kv_c || rotated k_pe, kv_lora_rank + qk_rope_head_dim values a
   token: MLA's small latent, not per-head keys and values) are all-gathered over "cp";
3. every rank writes every entry of the step at its slot (backend.kv_cache_write; padding rows have slot
   -1), so each cache holds the whole step, the same bits on every rank;
4. the MLA op's `forward` attends for the rank's query segments only; its batch has slot_mapping -1, so it
   writes nothing, and each segment's context (earlier segments of other ranks included) is in the cache.

An fp8 KV cache is refused (the op quantizes with its own per-layer scale, which this write does not see).
"""

from __future__ import annotations

import torch

from deepinfer.errors import BackendError
from deepinfer.parallel.cp_batch import ContextParallelBatch


def write_entries(backend, kv_cache, slots: torch.Tensor, entries: torch.Tensor, kv_lora_rank: int) -> None:
    """Gathered [N, L + R] entries at their slots (-1 skipped), into the cache's one tensor or its
    (latent [.., L], rope [.., R]) parts."""
    parts = tuple(kv_cache) if isinstance(kv_cache, (tuple, list)) else (kv_cache,)
    if any(p.element_size() == 1 for p in parts):
        raise BackendError("context parallel: an fp8 KV cache is not supported (the MLA op quantizes with its "
                           "own per-layer scale); run with kv_cache_dtype='auto'")
    if len(parts) == 1:
        backend.kv_cache_write(parts[0], slots, entries.to(parts[0].dtype))
        return
    widths = [p.shape[-1] for p in parts]
    if len(parts) != 2 or widths != [kv_lora_rank, entries.shape[-1] - kv_lora_rank]:
        raise BackendError(f"context parallel: MLA cache parts of widths {widths}, expected latent {kv_lora_rank} "
                           f"+ rope {entries.shape[-1] - kv_lora_rank}")
    backend.kv_cache_write(parts[0], slots, entries[:, :kv_lora_rank].contiguous().to(parts[0].dtype))
    backend.kv_cache_write(parts[1], slots, entries[:, kv_lora_rank:].contiguous().to(parts[1].dtype))


def context_parallel_mla(layer, q: torch.Tensor, kv_a: torch.Tensor, norm_eps: float, positions: torch.Tensor,
                         rope_cache: torch.Tensor, batch: ContextParallelBatch, kv_cache, group: str) -> torch.Tensor:
    """[T, H * v_head_dim] for this rank's tokens; `layer` is the MLAAttention (its spec, backend, norm weight).
    q: [T, H, nope + rope] before RoPE; kv_a: [T, L + R] before the norm and RoPE."""
    ex = batch.exchange
    if ex is None:
        raise BackendError("context parallel: a ContextParallelBatch without its KV exchange")
    s, ops = layer.spec, layer.backend
    t = q.shape[0]
    kv_c, k_pe = kv_a.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
    kv_c = ops.rms_norm(kv_c.contiguous(), layer.kv_a_layernorm, norm_eps)
    q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
    q_pe, k_pe = ops.rotary_embedding(positions, q_pe.contiguous(), k_pe.contiguous().view(t, 1, s.qk_rope_head_dim),
                                      rope_cache, layer.interleaved)
    k_pe = k_pe.reshape(t, s.qk_rope_head_dim)
    q = torch.cat([q_nope, q_pe], dim=-1)
    entries = ex.gather(torch.cat([kv_c, k_pe.to(kv_c.dtype)], dim=-1))
    write_entries(ops, kv_cache, ex.write_slots[group], entries, s.kv_lora_rank)
    return layer.attn.forward(q, kv_c, k_pe, kv_cache, batch, group)
