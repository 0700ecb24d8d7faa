"""DeepSeek-V4 rotary embedding: interleaved pairs on the trailing slice of a head.

V4 rotates only the last `rope_dim` channels of each head ([nope | rope]),
pairs (2i, 2i+1) share frequency i, and K = V, so the rotated layout is part
of the value vectors: it must be exactly the reference's, not merely a
permutation that leaves q.k unchanged (which is why V3's rope op is not
reused here). The same rotation with -sin undoes it on the attention output.
"""

from __future__ import annotations

import torch

from deepinfer.backend.native.rope import yarn_blend_inv_freq


def v4_inv_freq(
    rope_dim: int,
    theta: float,
    rope_type: str = "default",
    factor: float = 1.0,
    original_max_position_embeddings: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """fp32 [rope_dim // 2] inverse frequencies; YaRN blends interpolated and extrapolated ones.

    The correction range is always truncated to whole dimensions, as the V4
    reference does (its `truncate` lookup never sees the branch's own flag).
    """
    if rope_type == "default":
        return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if rope_type != "yarn":
        raise ValueError(f"unknown V4 rope type {rope_type!r}")
    return yarn_blend_inv_freq(rope_dim, theta, factor, original_max_position_embeddings, beta_fast, beta_slow,
                               truncate=True)


def v4_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0):
    """(cos, sin) fp32 [T, rope_dim // 2] for absolute positions [T]."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(device=positions.device)[None, :]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def apply_v4_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x [T, H, D] (or [T, D]) in fp32.

    cos / sin: [T, R/2]. Pass -sin for the inverse rotation.
    """
    half = cos.shape[-1]
    squeeze = x.dim() == 2
    if squeeze:
        x = x[:, None, :]
    c = cos.repeat_interleave(2, dim=-1)[:, None, :]
    s = sin.repeat_interleave(2, dim=-1)[:, None, :]
    nope, rope = x[..., : -2 * half], x[..., -2 * half :]
    r = rope.float()
    rotated = torch.stack((-r[..., 1::2], r[..., 0::2]), dim=-1).flatten(-2)
    out = torch.cat([nope, (r * c + rotated * s).to(x.dtype)], dim=-1)
    return out[:, 0, :] if squeeze else out
