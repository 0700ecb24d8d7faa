"""A MoE layer's shared experts in the routed experts' quantized layout, for an op that folds them into its
small-batch expert GEMMs (`MoEOp.fuse_shared_quantized`), as dense ones are folded (`fuse_shared_experts`).

The shared MLP (gate / up [S*I, D], down [D, S*I]) is S experts of width I. Read from the MLP's loaded weights
before its finalize (which hands them to the backend's linear method in a backend-specific form), in the
format the routed experts are kept in:
- "fp8_block" / "fp8_w8a8": the checkpoint's e4m3 weights and 128x128 scales, or under online fp8 the dense
  weights quantized with the same rule as the linears' online quantization: the same values when S * I is whole
  128-blocks (the linear quantizes gate and up as one matrix; V2-Lite: 2 x 1408), else not folded; S > 1 needs
  I to be whole 128-blocks too (each expert's slice of the scale grids);
- "int4_awq" / "int4_gptq": the records repacked as the routed experts' (int4_expert_rows), sliced per expert
  (I a multiple of the group size, as the routed experts' own check requires); act-order g_idx: not folded.
Anything else (a dense shared MLP beside quantized experts, mixed formats): None, and the op runs the MLP.
"""

from __future__ import annotations

import torch

from deepinfer.backend import (
    FP8_EXPERT_SCHEMES,
    INT4_EXPERT_SCHEMES,
    Int4Weight,
    QuantizedExperts,
    int4_expert_rows,
    quantize_weight_fp8_block,
)
from deepinfer.errors import ModelLoadError
from deepinfer.models.layers.quant.settings import active_linear_quant

FP8 = torch.float8_e4m3fn


def _fp8(lin) -> tuple[torch.Tensor, torch.Tensor] | None:
    w = lin.weight
    if isinstance(w, torch.Tensor) and w.dtype == FP8 and lin.weight_scale_inv is not None:
        return w, lin.weight_scale_inv.float()
    if isinstance(w, torch.Tensor) and w.is_floating_point() and w.dtype != FP8 and active_linear_quant().online == "fp8":
        if w.shape[0] % 128:  # the linear quantizes gate and up as one matrix: its blocks must not straddle them
            return None
        return quantize_weight_fp8_block(w)
    return None


def _int4(lin, scheme: str, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    w = lin.weight
    if not isinstance(w, Int4Weight) or w.scheme != scheme or w.group_size != group:
        return None
    try:
        q, z, s = int4_expert_rows(w, lin.name)
    except ModelLoadError:  # act-order g_idx: the layout's groups are contiguous
        return None
    return q, z, s


def shared_as_quantized_experts(mlp, scheme: str, inter: int, group: int = 128) -> QuantizedExperts | None:
    """The GatedMLP `mlp` (before its finalize) as S QuantizedExperts of `scheme`, or None (see the docstring)."""
    if len(mlp.gate_up_proj.parts) != 2:
        return None
    gate, up = mlp.gate_up_proj.parts
    down = mlp.down_proj
    width = gate.out_features
    if width % inter or up.out_features != width or down.in_features != width:
        return None
    n = width // inter
    if scheme in FP8_EXPERT_SCHEMES:
        if n > 1 and inter % 128:
            return None
        parts = [_fp8(lin) for lin in (gate, up, down)]
        if any(p is None for p in parts):
            return None
        (gq, gs), (uq, us), (dq, ds) = parts
        b = -(-inter // 128)
        rows = lambda t, s, blk: t[s * blk:(s + 1) * blk]  # noqa: E731
        w13 = [torch.cat([rows(gq, s, inter), rows(uq, s, inter)]) for s in range(n)]
        s13 = [torch.cat([rows(gs, s, b), rows(us, s, b)]) for s in range(n)]
        w2 = [dq[:, s * inter:(s + 1) * inter] for s in range(n)]
        s2 = [ds[:, s * b:(s + 1) * b] for s in range(n)]
        return QuantizedExperts(scheme, *(torch.stack(v).contiguous() for v in (w13, s13, w2, s2)))
    if scheme in INT4_EXPERT_SCHEMES:
        parts = [_int4(lin, scheme, group) for lin in (gate, up, down)]
        if any(p is None for p in parts) or inter % group:
            return None
        (gq, gz, gs), (uq, uz, us), (dq, dz, ds) = parts
        sl = lambda t, s: t[s * inter:(s + 1) * inter]  # noqa: E731
        cols = lambda t, s, w: t[:, s * w:(s + 1) * w]  # noqa: E731
        st = lambda v: torch.stack(v).contiguous()  # noqa: E731
        g = inter // group
        return QuantizedExperts(
            scheme, st([torch.cat([sl(gq, s), sl(uq, s)]) for s in range(n)]),
            st([torch.cat([sl(gs, s), sl(us, s)]) for s in range(n)]), st([cols(dq, s, inter // 2) for s in range(n)]),
            st([cols(ds, s, g) for s in range(n)]), st([torch.cat([sl(gz, s), sl(uz, s)]) for s in range(n)]),
            st([cols(dz, s, g) for s in range(n)]), group)
    return None
