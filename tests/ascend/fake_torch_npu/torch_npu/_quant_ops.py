"""npu_convert_weight_to_int4pack and npu_weight_quant_batchmatmul (W4A16 / W8A16, per-channel or per-group).

Documented semantics (torch_npu docs): y = x @ ((weight + antiquant_offset) * antiquant_scale) (+ bias), the
weight int8 [K, N] or int4 carried in int32 [K, N/8]; antiquant_scale / antiquant_offset [1, N] / [N]
(per-channel) or [ceil(K / antiquant_group_size), N] (per-group), in x's dtype (fp16 / bf16); output in x's
dtype. Computed here in fp32, rounded once.

The real int4pack interleaves the nibbles in an order its docs do not spell out; this fake packs column
8c + j into nibble j of word c. Only the fake's own two operators read that order (the backend never
unpacks the words), so the choice cannot leak into what the tests check.
"""

from __future__ import annotations

import torch

from torch_npu._checks import HALF, dims, dtype_in, unused

_SHIFTS = torch.arange(8, dtype=torch.int64) * 4


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """int32 [k, n] of values in [-8, 7] -> int32 [k, n / 8], eight int4 per word."""
    dtype_in("weight", weight, (torch.int32,))
    dims("weight", weight, 2)
    if not weight.is_contiguous():
        raise ValueError("npu_convert_weight_to_int4pack: weight must be contiguous")
    if weight.shape[-1] % 8:
        raise ValueError(f"npu_convert_weight_to_int4pack: last dim {weight.shape[-1]} is not a multiple of 8")
    if weight.numel() and (int(weight.min()) < -8 or int(weight.max()) > 7):
        raise ValueError("npu_convert_weight_to_int4pack: values must lie in the int4 range [-8, 7]")
    k, n = weight.shape
    nib = (weight.to(torch.int64) & 0xF).view(k, n // 8, 8)
    words = (nib << _SHIFTS).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """int32 [k, n / 8] -> int32 [k, n], sign-extended (the inverse of npu_convert_weight_to_int4pack)."""
    nib = (words.to(torch.int64).unsqueeze(-1) >> _SHIFTS) & 0xF
    return torch.where(nib >= 8, nib - 16, nib).reshape(words.shape[0], -1).to(torch.int32)


def npu_weight_quant_batchmatmul(x: torch.Tensor, weight: torch.Tensor, antiquant_scale: torch.Tensor,
                                 antiquant_offset: torch.Tensor | None = None, quant_scale=None, quant_offset=None,
                                 bias=None, antiquant_group_size: int = 0, inner_precise: int = 0) -> torch.Tensor:
    unused(quant_scale=quant_scale, quant_offset=quant_offset, bias=bias)
    if inner_precise:
        raise NotImplementedError("fake torch_npu: inner_precise != 0 is not emulated")
    dtype_in("x", x, HALF)
    dims("x", x, 2)
    dims("weight", weight, 2)
    if weight.dtype == torch.int32:
        w = _unpack_int4(weight)
    elif weight.dtype == torch.int8:
        w = weight
    else:
        raise TypeError(f"weight: dtype {weight.dtype} is not supported (documented: int8, int32 carrying int4)")
    k, n = w.shape
    if x.shape[1] != k:
        raise ValueError(f"npu_weight_quant_batchmatmul: x {tuple(x.shape)} and weight [K={k}, N={n}] disagree")
    if antiquant_scale.dtype != x.dtype:
        raise TypeError(f"antiquant_scale: dtype {antiquant_scale.dtype} must equal x's {x.dtype}")
    if antiquant_offset is not None and antiquant_offset.dtype != antiquant_scale.dtype:
        raise TypeError("antiquant_offset: dtype must equal antiquant_scale's")
    if antiquant_group_size:
        groups = -(-k // antiquant_group_size)
        want = (groups, n)
    else:
        want = (1, n)
    for name, t in (("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset)):
        if t is not None and tuple(t.reshape(-1, n).shape) != want:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, documented {want} for group size {antiquant_group_size}")
    rows = torch.arange(k) // antiquant_group_size if antiquant_group_size else torch.zeros(k, dtype=torch.long)
    scale = antiquant_scale.reshape(-1, n).float()[rows]
    off = antiquant_offset.reshape(-1, n).float()[rows] if antiquant_offset is not None else 0.0
    return (x.float() @ ((w.float() + off) * scale)).to(x.dtype)
