"""Rotary position embedding with DeepSeek's YaRN scaling.

The cos/sin cache and the softmax scale follow Hugging Face transformers
(`modeling_rope_utils._compute_yarn_parameters` and `yarn_apply_mscale` in the
DeepSeek V2/V3 modules) operation by operation, so the fp32 tables are
bit-identical to the reference.

Layout of `rotary_embedding(..., interleaved=True)`: DeepSeek checkpoints
store the rotary dims as pairs (x[2i], x[2i+1]) rotated by frequency i. We
rotate every pair *in place* and keep that interleaved layout on output, as
HF's DeepSeek-V2 complex-multiply form (`apply_rotary_emb`) and DeepSeek's own
inference code do. HF's V3 `apply_rotary_pos_emb_interleave` returns the same
numbers de-interleaved ([all even | all odd]). Attention only sees q . k, which
is invariant to a permutation applied to both, and the model passes q and the
cached k_pe through this same function, so either layout gives identical
attention; ours is the V2 one.
"""

from __future__ import annotations

import math

import torch

from deepinfer.errors import ConfigError


def _rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if kind not in ("default", "yarn"):
        raise ConfigError(f"rope scaling type {kind!r} is not supported (DeepSeek models use 'yarn' or none)")
    return kind


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, scaling: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """inv_freq [dim/2] and the cos/sin magnitude factor (HF `_compute_yarn_parameters`)."""
    factor = scaling.get("factor")
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError("yarn rope scaling needs 'original_max_position_embeddings'")
    if factor is None:  # HF: DeepSeek-V3 style configs may leave it to max/original
        factor = max_position / original
    attention_factor = scaling.get("attention_factor")
    mscale = scaling.get("mscale")
    mscale_all_dim = scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    truncate = scaling.get("truncate", True)
    inv_freq = yarn_blend_inv_freq(dim, base, factor, original, beta_fast, beta_slow, truncate)
    return inv_freq, float(attention_factor)


def yarn_blend_inv_freq(dim: int, base: float, factor: float, original: int, beta_fast: float, beta_slow: float,
                        truncate: bool) -> torch.Tensor:
    """YaRN inv_freq [dim/2] fp32: interpolated (/ factor) and extrapolated frequencies blended by a linear ramp
    over the correction range [beta_fast, beta_slow] rotations (HF `_compute_yarn_parameters`; V4 too)."""

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None, max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [R/2] fp32, cos/sin magnitude factor)."""
    if rotary_dim % 2:
        raise ConfigError(f"rotary dim {rotary_dim} must be even")
    if _rope_type(scaling) == "yarn":
        return _yarn_inv_freq(rotary_dim, base, scaling, max_position)
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    return inv_freq, 1.0


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float, scaling: dict | None) -> torch.Tensor:
    """fp32 [max_position, rotary_dim]: cos in [:R/2], sin in [R/2:], YaRN magnitude applied."""
    inv_freq, attention_factor = rope_inv_freq(rotary_dim, base, scaling, max_position)
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


def mla_softmax_scale(qk_head_dim: int, scaling: dict | None) -> float:
    """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN (HF `yarn_apply_mscale`)."""
    scale = qk_head_dim ** (-0.5)
    if _rope_type(scaling) != "default":
        mscale_all_dim = scaling.get("mscale_all_dim", 0)
        if mscale_all_dim:
            if scaling.get("factor") is None:
                raise ConfigError("yarn rope scaling with mscale_all_dim needs 'factor'")
            mscale = yarn_get_mscale(scaling["factor"], mscale_all_dim)
            scale = scale * mscale * mscale
    return scale


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, H, R]; cos/sin [T, 1, R/2] fp32. Computed in fp32, cast back (as HF V2)."""
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, R] and k [T, Hk, R] at `positions` [T]; returns new tensors."""
    rot = cos_sin_cache.shape[-1]
    if q.shape[-1] != rot or k.shape[-1] != rot:
        raise ConfigError(f"rotary_embedding: q/k last dims {q.shape[-1]}/{k.shape[-1]} != cache width {rot}")
    if q.dim() != 3 or k.dim() != 3 or positions.shape[0] != q.shape[0] or k.shape[0] != q.shape[0]:
        raise ConfigError(
            f"rotary_embedding: expected q [T,H,R], k [T,H,R], positions [T]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(positions.shape)}"
        )
    cs = cos_sin_cache.index_select(0, positions.to(torch.long)).float()
    cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2 :]
    return _rotate(q, cos, sin, interleaved), _rotate(k, cos, sin, interleaved)
