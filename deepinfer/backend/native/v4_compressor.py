"""DeepSeek-V4 KV compressors (CSA with overlap, HCA without) over a per-sequence ring.

A compressor turns every closed window of m tokens into one entry:
softmax over the window's slots of (gate + position_bias), weighted sum of
the projected kv, RMSNorm, RoPE at position w*m. CSA (and its indexer)
project to two series: Ca (first half) feeds the NEXT window's entry, Cb
(second half) the current one, so entry w mixes 2m slots (window w-1's Ca,
window w's Cb); entry 0 has no predecessor (weight 0).

Per-sequence state is a ring of the raw (kv, gate) projections of the last
`ring_len` positions (2m for CSA, m for HCA): exactly what a later step can
still need (the unfinished window, plus the previous window's Ca for CSA),
whatever the chunk boundaries were.
"""

from __future__ import annotations

import torch

from deepinfer.backend.native.v4_norm import v4_rms_norm
from deepinfer.backend.native.v4_rope import apply_v4_rope, v4_cos_sin


def ring_len(compress_rate: int, overlap: bool) -> int:
    return 2 * compress_rate if overlap else compress_rate


def first_needed_position(context_len: int, compress_rate: int, overlap: bool) -> int:
    """Oldest position whose projection a step starting at context_len may still use."""
    w = context_len // compress_rate - (1 if overlap else 0)
    return max(0, w * compress_rate)


def gather_projections(
    ring: torch.Tensor, context_len: int, new_kv: torch.Tensor, new_gate: torch.Tensor,
    compress_rate: int, overlap: bool,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Projections of positions [base, context_len + L): ring part then this step's rows.

    ring: [ring_len, 2 * width] (kv then gate); new_*: [L, width]. Returns (kv, gate, base).
    """
    width = new_kv.shape[-1]
    base = first_needed_position(context_len, compress_rate, overlap)
    if base < context_len:
        rows = torch.arange(base, context_len, device=ring.device) % ring.shape[0]
        old = ring[rows]
        kv = torch.cat([old[:, :width].to(new_kv.dtype), new_kv], dim=0)
        gate = torch.cat([old[:, width:].to(new_gate.dtype), new_gate], dim=0)
        return kv, gate, base
    return new_kv, new_gate, base


def update_ring(ring: torch.Tensor, context_len: int, new_kv: torch.Tensor, new_gate: torch.Tensor) -> None:
    """Store the projections of the newest min(L, ring_len) positions of this step."""
    n = new_kv.shape[0]
    keep = min(n, ring.shape[0])
    if keep == 0:
        return
    pos = torch.arange(context_len + n - keep, context_len + n, device=ring.device)
    ring[pos % ring.shape[0]] = torch.cat([new_kv[n - keep :], new_gate[n - keep :]], dim=-1).to(ring.dtype)


def compress_windows(
    kv: torch.Tensor,  # [n, C * d] projections of positions [base, base + n)
    gate: torch.Tensor,  # [n, C * d]
    base: int,
    w_begin: int,
    w_end: int,
    compress_rate: int,
    overlap: bool,
    position_bias: torch.Tensor,  # [m, C * d] fp32
    norm_weight: torch.Tensor,  # [d] fp32
    norm_eps: float,
    inv_freq: torch.Tensor,  # compress-branch inverse frequencies
    attention_factor: float,
) -> torch.Tensor:
    """Entries of windows [w_begin, w_end) -> [w_end - w_begin, d] in kv's dtype (normed, roped)."""
    m = compress_rate
    nw = w_end - w_begin
    d = kv.shape[-1] // (2 if overlap else 1)
    if nw <= 0:
        return kv.new_zeros((0, d))
    dev = kv.device
    w = torch.arange(w_begin, w_end, device=dev)
    rows = (w * m - base)[:, None] + torch.arange(m, device=dev)[None, :]  # [nw, m]
    cur_kv = kv[rows]
    cur_gate = gate[rows] + position_bias
    if overlap:
        prev_ok = (w >= 1)[:, None, None]
        prev_rows = (rows - m).clamp(min=0)
        prev_kv = torch.where(prev_ok, kv[prev_rows][..., :d], torch.zeros_like(cur_kv[..., :d]))
        prev_gate = torch.where(
            prev_ok, gate[prev_rows][..., :d] + position_bias[:, :d], torch.full_like(cur_gate[..., :d], float("-inf"))
        )
        slots_kv = torch.cat([prev_kv, cur_kv[..., d:]], dim=1)  # [nw, 2m, d]
        slots_gate = torch.cat([prev_gate, cur_gate[..., d:]], dim=1)
    else:
        slots_kv, slots_gate = cur_kv, cur_gate
    weights = slots_gate.softmax(dim=1, dtype=torch.float32).to(slots_kv.dtype)
    pooled = (slots_kv * weights).sum(dim=1)
    normed = v4_rms_norm(pooled, norm_weight, norm_eps)
    cos, sin = v4_cos_sin(w * m, inv_freq, attention_factor)
    return apply_v4_rope(normed, cos.to(normed.dtype), sin.to(normed.dtype))
