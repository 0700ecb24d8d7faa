"""fp4 (e2m1) routed-expert weights as DeepSeek-V4 checkpoints store them, in torch: the oracle of every fp4 kernel.

The format (transformers 5.24 `integrations/finegrained_fp8.py`, `FP8Experts` with `expert_dtype="fp4"` and its
`_unpack_fp4` / `_dequantize_one`; the same layout in ports of DeepSeek-V4's inference `kernel.py` `fp4_gemm`):

- weight [out, in / 2], one byte per two e2m1 values along `in`: the low nibble is column 2j, the high nibble
  column 2j + 1. Stored as int8 (DeepSeek's release), uint8 or torch.float4_e2m1fn_x2; kept here as uint8.
- a nibble is sign (bit 3), exponent (bits 2..1), mantissa (bit 0): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives.
- scale [out, in / 32]: one per row per 32 input channels, float8_e8m0fnu (`scale_fmt: ue8m0`, a power of two
  2^(byte - 127)) or fp32 (`scale_fmt: float`). An e8m0 scale is kept as its uint8 byte (1 byte per 32 weights).
- W[o, i] = e2m1(nibble[o, i]) * scale[o, i // 32].

A checkpoint names the scale `<linear>.scale` (DeepSeek) / `<linear>.weight_scale_inv` (transformers); the
V4 model maps the first to the second.
"""

from __future__ import annotations

import torch

from deepinfer.errors import ModelLoadError

FP4_GROUP = 32
FP4_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_PACKED_DTYPES = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def as_packed_fp4(name: str, t: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """A stored fp4 weight as uint8 [out, in / 2] (a view: no copy), checked; ModelLoadError naming the tensor."""
    if t.dtype not in _PACKED_DTYPES:
        raise ModelLoadError(f"{name}.weight has dtype {t.dtype}; fp4 experts are packed two e2m1 per byte "
                             "(int8, uint8 or float4_e2m1fn_x2)")
    if in_features % FP4_GROUP:
        raise ModelLoadError(f"{name}: in_features {in_features} is not a multiple of the fp4 scale group "
                             f"{FP4_GROUP}")
    if tuple(t.shape) != (out_features, in_features // 2):
        raise ModelLoadError(f"{name}.weight has shape {tuple(t.shape)}, expected {(out_features, in_features // 2)} "
                             f"(fp4: two values per byte along the {in_features} input channels)")
    return t.view(torch.uint8)


def as_fp4_scale(name: str, t: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """A stored fp4 scale: ue8m0 -> its uint8 byte [out, in / 32]; fp32 / bf16 / fp16 -> fp32. Checked."""
    expect = (out_features, in_features // FP4_GROUP)
    if tuple(t.shape) != expect:
        raise ModelLoadError(f"{name}.weight_scale_inv has shape {tuple(t.shape)}, expected {expect} (fp4: one scale "
                             f"per row per {FP4_GROUP} input channels)")
    if _E8M0 is not None and t.dtype == _E8M0:
        return t.view(torch.uint8)
    if t.dtype == torch.uint8:  # e8m0 bytes stored raw (as transformers reads MXFP scales)
        return t
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return t.float()
    raise ModelLoadError(f"{name}.weight_scale_inv has dtype {t.dtype}; fp4 scales are float8_e8m0fnu (ue8m0), "
                         "uint8 e8m0 bytes or float32")


def fp4_scale_values(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales from the kept form: a uint8 tensor is e8m0 bytes (2^(b - 127)), anything else is a float."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n / 2] -> fp32 [..., n]: low nibble first."""
    u = packed.view(torch.uint8)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=u.device)
    vals = torch.stack([lut[(u & 0xF).long()], lut[(u >> 4).long()]], dim=-1)
    return vals.reshape(*u.shape[:-1], 2 * u.shape[-1])


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """fp32 [..., out, in] = e2m1(packed) * scale[..., o, i // group]."""
    vals = unpack_fp4(packed)
    return vals * fp4_scale_values(scale).repeat_interleave(group, dim=-1)[..., : vals.shape[-1]]


def quantize_fp4(w: torch.Tensor, group: int = FP4_GROUP, e8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (uint8 [out, in / 2], scale [out, in / group]): the test checkpoints' writer (a faithful round
    trip of the format, not a tuned quantizer). scale = amax / 6 per group, rounded up to a power of two when e8m0
    (then returned as its uint8 byte), values rounded to the nearest e2m1."""
    out_f, in_f = w.shape
    if in_f % group or in_f % 2:
        raise ValueError(f"quantize_fp4: in_features {in_f} must be a multiple of {group}")
    blocks = w.float().reshape(out_f, in_f // group, group)
    amax = blocks.abs().amax(dim=-1).clamp(min=2.0 ** -120)
    scale = amax / FP4_MAX
    if e8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[..., None]).clamp(-FP4_MAX, FP4_MAX).reshape(out_f, in_f)
    mags = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    code = (q.abs()[..., None] - mags).abs().argmin(dim=-1).to(torch.uint8)  # nearest magnitude (ties: smaller)
    code = code | ((q < 0).to(torch.uint8) << 3)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).contiguous()
    if e8m0:
        return packed, (torch.log2(scale).round() + 127).to(torch.uint8)
    return packed, scale.contiguous()
