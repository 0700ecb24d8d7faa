"""The invariant MoE's router: exact-product fp32 logits on the tensor cores, then the per-token top-k.

The gate is fp32 and the activations bf16. `split_gate` splits the gate once into three bf16 parts whose sum is
the gate exactly, so x @ gate^T is one bf16 GEMM of 3N columns (gemm.bmm: products exact in fp32, fp32
accumulation, the invariant tile and K split) followed by (hi + mid) + lo. That last sum is done where the
logits are read, in the top-k kernel (`_route_parts_kernel`, one program per token, moe_routing's selection
code), so the router is two launches: no adds of its own. Every step is per row with a fixed order, so a
token's experts and weights do not depend on its batch.

The fp32 FMA path it replaced launched two programs for V2-Lite's 64-expert gate and cost 171 us per layer on
the H200; the split GEMM about 8 (relative error vs fp64 2.1e-6 measured there, 1e-6 on the FMA path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backends.nvidia.invariant.gemm import linear
from deepinfer.backends.nvidia.moe_routing import _route_params, _route_select
from deepinfer.errors import BackendError


def split_gate(gate: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [N, K] -> bf16 [3N, K]: hi, mid and lo parts with hi + mid + lo == gate exactly.

    bf16 keeps fp32's exponent and 8 of its 24 mantissa bits; each part takes the next 8 bits of what the
    previous parts left (a residual of an fp32 minus its bf16 rounding is exact in fp32), so three parts hold
    every bit (fp32 subnormals aside, which bf16 also has)."""
    hi = gate.to(torch.bfloat16)
    r1 = gate - hi.float()
    mid = r1.to(torch.bfloat16)
    lo = (r1 - mid.float()).to(torch.bfloat16)
    return torch.cat([hi, mid, lo], 0).contiguous()


def _check(x: torch.Tensor, gate_split: torch.Tensor) -> int:
    if x.dtype != torch.bfloat16 or gate_split.dtype != torch.bfloat16 or gate_split.shape[0] % 3:
        raise BackendError(f"invariant router: bf16 x and a split bf16 gate [3N, K], got {x.dtype} / "
                           f"{gate_split.dtype} {tuple(gate_split.shape)}")
    return gate_split.shape[0] // 3


def router_parts(x: torch.Tensor, gate_split: torch.Tensor) -> torch.Tensor:
    """bf16 x [T, K] times the split gate -> fp32 [T, 3N]: the hi, mid and lo parts' exact-product dots."""
    _check(x, gate_split)
    return linear(x, gate_split, out_dtype=torch.float32)


def router_linear(x: torch.Tensor, gate_split: torch.Tensor) -> torch.Tensor:
    """The fp32 logits [T, N] = (hi + mid) + lo of router_parts (the sum route_parts does in its kernel)."""
    n = _check(x, gate_split)
    parts = router_parts(x, gate_split)
    return (parts[..., :n] + parts[..., n: 2 * n]) + parts[..., 2 * n:]


@triton.jit
def _route_parts_kernel(
    parts_ptr, bias_ptr, w_ptr, ids_ptr, stride_p, E, PER, scale,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr, TOPK_GROUP: tl.constexpr, SCORING: tl.constexpr, GROUPING: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_P)
    valid = (g[:, None] < G) & (c[None, :] < PER)
    eid = g[:, None] * PER + c[None, :]
    base = parts_ptr + row * stride_p + eid
    hi = tl.load(base, mask=valid, other=0.0)
    mid = tl.load(base + E, mask=valid, other=0.0)
    lo = tl.load(base + 2 * E, mask=valid, other=0.0)
    x = tl.where(valid, (hi + mid) + lo, float("-inf"))
    _route_select(x, valid, g, c, eid, bias_ptr, w_ptr, ids_ptr, row, PER, scale, TOP_K, BLOCK_K, G, BLOCK_G,
                  BLOCK_P, TOPK_GROUP, SCORING, GROUPING, HAS_BIAS, NORM)


def route_parts(parts: torch.Tensor, spec, correction_bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_routing.route on the logits (hi + mid) + lo of router_parts' [T, 3E]: (weights [T, k] fp32, ids
    [T, k] int64), one launch."""
    T, three_e = parts.shape
    if parts.dtype != torch.float32 or three_e % 3 or parts.stride(-1) != 1:
        raise BackendError(f"route_parts: fp32 parts [T, 3E] with contiguous rows, got {parts.dtype} "
                           f"{tuple(parts.shape)}")
    E = three_e // 3
    params = _route_params(spec, E, correction_bias)
    weights = torch.empty((T, spec.top_k), dtype=torch.float32, device=parts.device)
    ids = torch.empty((T, spec.top_k), dtype=torch.int64, device=parts.device)
    if T == 0:
        return weights, ids
    bias = correction_bias.float().contiguous() if correction_bias is not None else parts
    _route_parts_kernel[(T,)](parts, bias, weights, ids, parts.stride(0), E, **params, num_warps=4)
    return weights, ids
