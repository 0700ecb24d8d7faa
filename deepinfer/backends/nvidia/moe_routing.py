"""MoE routing in Triton plus the expert-sorted block layout the grouped GEMM reads.

`route`: one program per token picks top_k experts for every DeepSeek
router: softmax greedy (V2-Lite), softmax group-limited greedy (V2: group
score = max), sigmoid noaux_tc (V3: selection on score + correction bias,
group score = sum of the top two, weights from the unbiased score). Experts
are laid out as a [groups, per_group] tile, so any group size works.

`moe_align`: sorts the (token, slot) pairs by expert and pads every expert's
run to a multiple of BLOCK_M, without a host sync, so it can be captured in
a CUDA graph. The CUDA C++ twin lives in csrc/cuda/moe_align.cu.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import envs
from deepinfer.backends.nvidia.router_gemv_tiles import (  # noqa: F401  (TILED_MIN_PROGRAMS: re-exported)
    TILED_MIN_PROGRAMS,
    _gemv_tile,
    _router_gemv_env,
    _tiled_gemv_tile,
)

# The router codes both the Triton kernel and the CUDA C++ twin (csrc/cuda) take.
SCORING_CODES = {"softmax": 0, "sigmoid": 1}
GROUPING_CODES = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


@triton.jit
def _route_row(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, row, stride_l, PER, scale,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr, TOPK_GROUP: tl.constexpr, SCORING: tl.constexpr, GROUPING: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, CG: tl.constexpr,
):
    """Top-k of one token's logits row (CG: read through L2, the row was written by other programs)."""
    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_P)
    valid = (g[:, None] < G) & (c[None, :] < PER)
    eid = g[:, None] * PER + c[None, :]
    if CG:
        x = tl.load(logits_ptr + row * stride_l + eid, mask=valid, other=float("-inf"), cache_modifier=".cg")
    else:
        x = tl.load(logits_ptr + row * stride_l + eid, mask=valid, other=float("-inf"))
    _route_select(x.to(tl.float32), valid, g, c, eid, bias_ptr, w_ptr, ids_ptr, row, PER, scale, TOP_K, BLOCK_K, G,
                  BLOCK_G, BLOCK_P, TOPK_GROUP, SCORING, GROUPING, HAS_BIAS, NORM)


@triton.jit
def _route_select(
    x, valid, g, c, eid, bias_ptr, w_ptr, ids_ptr, row, PER, scale,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr, TOPK_GROUP: tl.constexpr, SCORING: tl.constexpr, GROUPING: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
):
    """Top-k of one token's fp32 logits tile x [BLOCK_G, BLOCK_P] (expert g * PER + c; -inf where not valid):
    scores, the group limit, the k picks in order, normalisation and scaling; stores row `row` of w / ids."""
    if SCORING == 0:
        mx = tl.max(tl.max(x, 1), 0)
        e = tl.where(valid, tl.exp(x - mx), 0.0)
        score = e / tl.sum(tl.sum(e, 1), 0)
    else:
        score = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    sel = score
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + eid, mask=valid, other=0.0).to(tl.float32)
    sel = tl.where(valid, sel, float("-inf"))
    if GROUPING != 0:
        top1 = tl.max(sel, 1)
        if GROUPING == 1:
            gscore = top1
        else:
            first = tl.argmax(sel, 1)
            rest = tl.where(c[None, :] == first[:, None], float("-inf"), sel)
            gscore = top1 + tl.max(rest, 1)
        gscore = tl.where(g < G, gscore, float("-inf"))
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            gi = tl.argmax(tl.where(keep, float("-inf"), gscore), 0)
            keep = keep | (g == gi)
        sel = tl.where(keep[:, None], sel, float("-inf"))

    flat_sel = tl.reshape(sel, (BLOCK_G * BLOCK_P,))
    flat_score = tl.reshape(score, (BLOCK_G * BLOCK_P,))
    flat_eid = tl.reshape(eid, (BLOCK_G * BLOCK_P,))
    pos = tl.arange(0, BLOCK_G * BLOCK_P)
    kk = tl.arange(0, BLOCK_K)
    wv = tl.zeros([BLOCK_K], dtype=tl.float32)
    iv = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(flat_sel, 0)
        hit = pos == best
        wv = tl.where(kk == j, tl.sum(tl.where(hit, flat_score, 0.0), 0), wv)
        iv = tl.where(kk == j, tl.sum(tl.where(hit, flat_eid, 0), 0).to(tl.int64), iv)
        flat_sel = tl.where(hit, float("-inf"), flat_sel)
    if NORM:
        wv = wv / (tl.sum(wv, 0) + 1e-20)
    wv = wv * scale
    kmask = kk < TOP_K
    tl.store(w_ptr + row * TOP_K + kk, wv, mask=kmask)
    tl.store(ids_ptr + row * TOP_K + kk, iv, mask=kmask)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_l, PER, scale,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr, TOPK_GROUP: tl.constexpr, SCORING: tl.constexpr, GROUPING: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
):
    _route_row(logits_ptr, bias_ptr, w_ptr, ids_ptr, tl.program_id(0).to(tl.int64), stride_l, PER, scale,
               TOP_K, BLOCK_K, G, BLOCK_G, BLOCK_P, TOPK_GROUP, SCORING, GROUPING, HAS_BIAS, NORM, False)


@triton.jit
def _gate_gemv(x_ptr, w_ptr, out_ptr, t, E, D, stride_x, stride_w, stride_o,
               BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t, block of BLOCK_E experts] = x[t] . w[e] with fp32 products and sums."""
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = offs_e < E
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dmask = offs_d + d0 < D
        xv = tl.load(x_ptr + t * stride_x + d0 + offs_d, mask=dmask, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_w + d0 + offs_d[None, :],
                     mask=emask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        acc += wv * xv[None, :]
    tl.store(out_ptr + t * stride_o + offs_e, tl.sum(acc, 1), mask=emask)


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, E, D, stride_x, stride_w, stride_o,
                          BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    _gate_gemv(x_ptr, w_ptr, out_ptr, tl.program_id(1).to(tl.int64), E, D, stride_x, stride_w, stride_o,
               BLOCK_E, BLOCK_D)


@triton.jit
def _router_tile_kernel(x_ptr, w_ptr, out_ptr, T, E, D, stride_x, stride_w, stride_o,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                        NUM_STAGES: tl.constexpr):
    """out[BLOCK_T tokens, BLOCK_E experts] = x . w^T, fp32 products and sums (a broadcast multiply, not a
    tf32 dot: routing must match fp32). Each gate chunk serves BLOCK_T tokens and each x chunk BLOCK_E
    experts; the loop's loads are pipelined NUM_STAGES deep (cp.async), so a program keeps several chunks
    in flight instead of one latency-bound load per step. A [T, E, D-lane] accumulator summed once at the
    end: a fixed order, the same bits every run."""
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    tmask = offs_t < T
    emask = offs_e < E
    x_rows = x_ptr + offs_t[:, None, None].to(tl.int64) * stride_x + offs_d[None, None, :]
    w_rows = w_ptr + offs_e[None, :, None].to(tl.int64) * stride_w + offs_d[None, None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_D], dtype=tl.float32)
    for d0 in tl.range(0, D, BLOCK_D, num_stages=NUM_STAGES):
        dmask = offs_d[None, None, :] + d0 < D
        xv = tl.load(x_rows + d0, mask=tmask[:, None, None] & dmask, other=0.0).to(tl.float32)
        wv = tl.load(w_rows + d0, mask=emask[None, :, None] & dmask, other=0.0).to(tl.float32)
        acc += xv * wv
    out = tl.sum(acc, 2)
    tl.store(out_ptr + offs_t[:, None].to(tl.int64) * stride_o + offs_e[None, :], out,
             mask=tmask[:, None] & emask[None, :])


@triton.jit
def _gate_route_kernel(
    x_ptr, gw_ptr, logits_ptr, cnt_ptr, bias_ptr, w_ptr, ids_ptr, E, D, stride_x, stride_gw, PER, scale,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr, TOPK_GROUP: tl.constexpr, SCORING: tl.constexpr, GROUPING: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
):
    """Router GEMV + top-k in one launch: the last program of a token (per-token counter, reset after)
    picks its experts from the logits row the token's programs wrote."""
    t = tl.program_id(1).to(tl.int64)
    _gate_gemv(x_ptr, gw_ptr, logits_ptr, t, E, D, stride_x, stride_gw, E, BLOCK_E, BLOCK_D)
    tl.debug_barrier()  # all threads' logits stores happen before the (acq_rel, gpu-scope) increment
    if tl.atomic_add(cnt_ptr + t, 1) == tl.num_programs(0) - 1:
        _route_row(logits_ptr, bias_ptr, w_ptr, ids_ptr, t, E, PER, scale,
                   TOP_K, BLOCK_K, G, BLOCK_G, BLOCK_P, TOPK_GROUP, SCORING, GROUPING, HAS_BIAS, NORM, True)
        tl.atomic_xchg(cnt_ptr + t, 0)


ROUTER_GEMV_MAX_TOKENS = 64  # the most tokens gate_route takes (its per-token counters)
# The MoE op's default limit for gate_route (measured end to end up to 16 tokens on the H200). In graph
# replay of the router alone (benchmarks/kernels.py --only router) the token-tiled logits + top-k beat it
# at 4 / 16 tokens (6.0 / 6.3 us vs 8.9 / 9.1), but a run with the limit at 1 (commit b4afae7, together
# with the in-kernel MLA merge at 16 splits) had batch 16 at 8.66 ms/step against 8.00: kept at 16
# until an A/B run separates the two.
FUSED_ROUTER_MAX_TOKENS = 16
# router_logits alone: the GEMV up to 64 tokens, and up to 512 for a gate of at most SMALL_GATE_ELEMENTS (V2-Lite's
# 64 x 2048). On the H200 (2026-12-04, 8734169, benchmarks.kernels --only router --router-tokens 64,128,256,512
# with DEEPINFER_ROUTER_GEMV_MAX_TOKENS=4096) at V2-Lite's gate the token-tiled GEMV took 4.4 / 5.1 / 7.3 / 12.5 us
# at 64 / 128 / 256 / 512 tokens against cuBLAS on x.float() 11.6 / 11.7 / 12.3 / 18.7 us. Not timed at V3's gate
# (256 x 7168, 14x the elements: the tiles re-read x and the gate from L2 T / 8 and E / 4 times, ~0.9 GB at 512
# tokens, where cuBLAS tiles both), so larger gates keep 64. Not yet measured end to end.
ROUTER_LOGITS_GEMV_MAX_TOKENS = 64
ROUTER_LOGITS_GEMV_MAX_TOKENS_SMALL_GATE = 512
SMALL_GATE_ELEMENTS = 64 * 2048


def fused_router_max_tokens() -> int:
    """Largest batch the MoE op routes with gate_route (GEMV + top-k, one launch); above it the GEMV /
    cuBLAS logits then the top-k kernel. DEEPINFER_MOE_FUSED_ROUTER_MAX_TOKENS (<= 64) overrides it for
    A/B runs; DEEPINFER_MOE_FUSED_ROUTER=0 turns the fused router off."""
    if not envs.MOE_FUSED_ROUTER.get():
        return 0
    value = envs.MOE_FUSED_ROUTER_MAX_TOKENS.get()  # BackendError outside [0, ROUTER_GEMV_MAX_TOKENS]
    return FUSED_ROUTER_MAX_TOKENS if value is None else value


def _logits_gemv_max_tokens(gate_elements: int) -> int:
    """The most tokens whose logits take the GEMV kernels for a gate of gate_elements (E x D; the constants above
    say why); DEEPINFER_ROUTER_GEMV_MAX_TOKENS overrides (A/B runs); 0 sends every size to cuBLAS."""
    value = envs.ROUTER_GEMV_MAX_TOKENS.get()  # BackendError on a non-integer
    if value is not None:
        return value
    if gate_elements <= SMALL_GATE_ELEMENTS:
        return ROUTER_LOGITS_GEMV_MAX_TOKENS_SMALL_GATE
    return ROUTER_LOGITS_GEMV_MAX_TOKENS


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits [T, E] of the fp32 router gate without an fp32 copy of x: one launch at decode sizes.

    One token: the per-token GEMV (BLOCK_E experts per program). 2..512 tokens (V2-Lite's gate and smaller;
    2..64 for larger gates): the token-tiled kernel (a BLOCK_T x BLOCK_E tile per program, so the fp32 gate,
    512 KB at V2-Lite, is read T / BLOCK_T times instead of T times, by ~128 programs instead of 2048 short
    latency-bound ones). Above, cuBLAS on x.float() (ROUTER_LOGITS_GEMV_MAX_TOKENS: the measurements). At 64 tokens on the H200 the cuBLAS path
    was a copy kernel plus a SIMT fp32 GEMM on the MoE layer's critical path, and the per-token GEMV 13.7 us
    per layer (a profile of the session that wrote it; not kept in docs/perf-log).
    """
    T, D = x.shape
    E = gate_weight.shape[0]
    if T > _logits_gemv_max_tokens(E * D) or x.stride(-1) != 1 or gate_weight.stride(-1) != 1:
        return torch.nn.functional.linear(x.float(), gate_weight.float())
    w = gate_weight.float()
    out = torch.empty((T, E), dtype=torch.float32, device=x.device)
    if T == 0:
        return out
    tile = _router_gemv_env()
    if T == 1 or (tile is not None and len(tile) == 3):  # a 3-value override: the per-token GEMV (A/B)
        block_e, block_d, warps = _gemv_tile(D, T)
        _router_logits_kernel[(triton.cdiv(E, block_e), T)](
            x, w, out, E, D, x.stride(0), w.stride(0), out.stride(0), BLOCK_E=block_e, BLOCK_D=block_d,
            num_warps=warps,
        )
    else:
        block_t, block_e, block_d, warps, stages = _tiled_gemv_tile(T, E, D, x.element_size())
        _router_tile_kernel[(triton.cdiv(E, block_e), triton.cdiv(T, block_t))](
            x, w, out, T, E, D, x.stride(0), w.stride(0), out.stride(0), BLOCK_T=block_t, BLOCK_E=block_e,
            BLOCK_D=block_d, NUM_STAGES=stages, num_warps=warps, num_stages=stages,
        )
    return out


def _route_params(spec, E: int, correction_bias: torch.Tensor | None) -> dict:
    """The routing kernels' per-spec arguments (PER, scale and the constexprs), after checking the spec."""
    from deepinfer.errors import BackendError

    if spec.scoring_func not in SCORING_CODES:
        raise BackendError(f"triton route: scoring_func {spec.scoring_func!r} not implemented (softmax, sigmoid)")
    if spec.topk_method not in GROUPING_CODES:
        raise BackendError(f"triton route: topk_method {spec.topk_method!r} not implemented")
    if E != spec.num_experts:
        raise BackendError(f"route: logits have {E} experts, spec says {spec.num_experts}")
    grouping = GROUPING_CODES[spec.topk_method]
    groups = spec.n_group if grouping else 1
    if E % groups:
        raise BackendError(f"route: {E} experts do not split into {groups} groups")
    if grouping == 2 and correction_bias is None:
        raise BackendError("route: noaux_tc needs the e_score_correction_bias")
    per = E // groups
    return dict(PER=per, scale=float(spec.routed_scaling_factor),
                TOP_K=spec.top_k, BLOCK_K=triton.next_power_of_2(spec.top_k), G=groups,
                BLOCK_G=triton.next_power_of_2(groups), BLOCK_P=triton.next_power_of_2(per),
                TOPK_GROUP=spec.topk_group if grouping else 0, SCORING=SCORING_CODES[spec.scoring_func],
                GROUPING=grouping, HAS_BIAS=correction_bias is not None, NORM=bool(spec.norm_topk_prob))


def route(router_logits: torch.Tensor, spec, correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] fp32 with normalisation and routed_scaling_factor applied, topk_ids [T, k] int64)."""
    T, E = router_logits.shape
    params = _route_params(spec, E, correction_bias)
    logits = router_logits.float().contiguous()
    weights = torch.empty((T, spec.top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, spec.top_k), dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    bias = correction_bias.float().contiguous() if correction_bias is not None else logits
    _route_kernel[(T,)](logits, bias, weights, ids, logits.stride(0), **params, num_warps=4)
    return weights, ids


def gate_route(x: torch.Tensor, gate_weight: torch.Tensor, spec, correction_bias: torch.Tensor | None,
               counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """route(router_logits(x, gate_weight)) in one launch, for T <= ROUTER_GEMV_MAX_TOKENS (`counters`:
    >= T int32 zeros, left zero)."""
    from deepinfer.errors import BackendError

    T, D = x.shape
    E = gate_weight.shape[0]
    if T > min(ROUTER_GEMV_MAX_TOKENS, counters.numel()) or x.stride(-1) != 1 or counters.dtype != torch.int32:
        raise BackendError(f"gate_route: {T} tokens need <= {ROUTER_GEMV_MAX_TOKENS} and >= T int32 counters")
    params = _route_params(spec, E, correction_bias)
    gw = gate_weight.float().contiguous()
    logits = torch.empty((T, E), dtype=torch.float32, device=x.device)
    weights = torch.empty((T, spec.top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, spec.top_k), dtype=torch.int64, device=x.device)
    if T == 0:
        return weights, ids
    bias = correction_bias.float().contiguous() if correction_bias is not None else logits
    block_e, block_d, warps = _gemv_tile(D, T)
    _gate_route_kernel[(triton.cdiv(E, block_e), T)](
        x, gw, logits, counters, bias, weights, ids, E, D, x.stride(0), gw.stride(0), **params,
        BLOCK_E=block_e, BLOCK_D=block_d, num_warps=warps,
    )
    return weights, ids


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert-sorted, block-padded layout of the T*k (token, slot) pairs.

    Returns sorted_ids [T*k + E*(block_m-1)] (pair index, T*k marks padding),
    expert_ids [that / block_m] (-1 for blocks past the end) and
    num_padded [1] (int32). Sizes depend on T only: graph-capturable.
    """
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    dev = flat.device
    max_padded = n + num_experts * (block_m - 1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    order = torch.argsort(flat, stable=True)
    sorted_exp = flat[order]
    cnt_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=dev) - cnt_start[sorted_exp]
    dest = pad_start[sorted_exp] + rank
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    blocks = torch.arange(max_padded // block_m, device=dev) * block_m
    expert_ids = torch.searchsorted(pad_end, blocks, right=True).to(torch.int32)
    total = pad_end[-1:]
    expert_ids = torch.where(blocks < total, expert_ids, torch.full_like(expert_ids, -1))
    return sorted_ids, expert_ids, total.to(torch.int32)
