"""Fused MoE on NVIDIA: two grouped GEMMs (SiLU-and-mul in the first's epilogue) and one combine kernel.

Two schedules, picked from the batch size (a Python int, so fixed per
captured CUDA graph):

- direct (T * top_k <= DEEPINFER_MOE_DIRECT_MAX_PAIRS, default 64): no
  alignment kernel; each expert's pairs are gathered by the GEMM program
  itself, and the shared experts can ride along as extra experts; the last
  program of each down-GEMM column does the combine (given `counters`). At
  batch 1 the experts are two launches: gate_up (+SiLU) and down (+combine).
- aligned (larger batches): moe_align's expert-sorted, block-padded layout,
  tuned for prefill / large decode; the shared MLP runs densely outside and
  only its add is fused into the combine, or (quantized experts with the
  shared ones stacked after them, `stacked_shared`) the shared experts take
  every token's last slots and run in the grouped GEMMs too.

Quantized experts (QuantizedExperts schemes) run through the same schedules; under "fp8_w8a8" the direct
GEMMs quantize their few rows as they load them, and the aligned path quantizes x once (fp8_act_quant.py)
and passes the SiLU-and-mul output between its GEMMs as e4m3 + per-128 scales. At prefill sizes it can split the
gate_up instead (`split_gate_up`: one GEMM over both halves at 128-row tiles, then a SiLU-and-mul + quant kernel).

The combine sums a token's weighted slots in fp32, rounds to the activation
dtype, adds the shared experts' output if given and rounds again: the native
op's `out.sum(1).to(dtype)` then the model's `out + shared`, in one kernel.
In the aligned schedule the down GEMM stores each slot's product rounded to
the activation dtype, unweighted, and the combine multiplies it by its routing
weight in fp32 as it sums (the native op's values, from half the slot bytes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from deepinfer import envs
from deepinfer.backends.nvidia.fused_moe_config import FP8_ACT, interpreting
from deepinfer.backends.nvidia.fused_moe_gemm import aligned_gemm, direct_gemm
from deepinfer.backends.nvidia.moe_routing import moe_align
from deepinfer.backends.nvidia.quant import int4_cuda
from deepinfer.errors import BackendError

DIRECT_MAX_PAIRS = 64


def direct_max_pairs() -> int:
    """Largest T * top_k run in direct mode (DEEPINFER_MOE_DIRECT_MAX_PAIRS overrides; 0 turns it off).

    Both schedules read each touched expert once per 16+-row tile; direct skips
    the alignment kernel (~6 us at batch 1) and, with shared experts folded in,
    the shared MLP's three launches and the combine. Its costs grow with the
    pair count: a grid of pairs x column blocks in which every pair but an
    expert's first exits at once, and a [BLOCK_M, next_pow2(pairs)] scan per
    program. At 64 pairs (V2-Lite k=6: batches 1..10, graph buckets 1-8; V3
    k=8: 1..8) both are small; the aligned path stays tuned for the rest.
    benchmarks/kernels.py times the other schedule at 1, 4 and 16 tokens.
    Direct mode never takes more than 64 tokens (BLOCK_M >= T).
    """
    value = envs.MOE_DIRECT_MAX_PAIRS.get()  # BackendError on a non-integer
    return DIRECT_MAX_PAIRS if value is None else value


def fused_combine() -> bool:
    """Direct mode sums the slots in the down GEMM's last program per column (a self-resetting counter per
    column, no combine launch); DEEPINFER_MOE_FUSED_COMBINE=0 runs the combine kernel instead (A/B runs)."""
    return envs.MOE_FUSED_COMBINE.get()


def counters_for(hidden_size: int, device) -> torch.Tensor:
    """The zeroed per-column counters the fused combine needs (one per 16 output features: the smallest tile)."""
    return torch.zeros(triton.cdiv(hidden_size, 16), dtype=torch.int32, device=device)


DIRECT_MAX_TOKENS = 64  # a direct program holds all of one expert's tokens in one BLOCK_M tile


def use_direct(num_tokens: int, top_k: int) -> bool:
    return 0 < num_tokens <= DIRECT_MAX_TOKENS and num_tokens * top_k <= direct_max_pairs()


@triton.jit
def _combine_kernel(y_ptr, s_ptr, out_ptr, w_ptr, D, stride_y, stride_s, stride_o,
                    SLOTS: tl.constexpr, HAS_SHARED: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(SLOTS):  # slot order, as the native sum over k
        y = tl.load(y_ptr + t * stride_y + j * D + offs, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:  # the slot's routing weight, in fp32 (the down GEMM stored its rounded product unweighted)
            y = y * tl.load(w_ptr + t * SLOTS + j)
        acc += y
    ty = out_ptr.dtype.element_ty
    if HAS_SHARED:
        acc = acc.to(ty).to(tl.float32) + tl.load(s_ptr + t * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, acc.to(ty), mask=mask)


def combine(y: torch.Tensor, shared: torch.Tensor | None, dtype: torch.dtype,
            weights: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, S, D] fp32 weighted slots -> sum over S (fp32) -> dtype (+ shared [T, D], then dtype again). weights
    [T, S] fp32: y holds the slots unweighted (the down GEMM's product rounded to the compute dtype, stored in it),
    and each is multiplied by its weight in fp32 here: the same products and sums as weighted fp32 slots, from half
    the bytes (the aligned schedule's slot buffer: 805 MB a layer at 16,384 tokens of V2-Lite in fp32)."""
    T, slots, D = y.shape
    if shared is not None and (tuple(shared.shape) != (T, D) or shared.stride(-1) != 1):
        raise BackendError(f"MoE combine: shared output has shape {tuple(shared.shape)}, expected {(T, D)}")
    if weights is not None and (tuple(weights.shape) != (T, slots) or weights.dtype != torch.float32
                                or not weights.is_contiguous()):
        raise BackendError(f"MoE combine: weights {tuple(weights.shape)} {weights.dtype}, expected contiguous fp32 "
                           f"{(T, slots)}")
    out = torch.empty((T, D), dtype=dtype, device=y.device)
    if T == 0:
        return out
    block = 128 if interpreting() else 1024
    _combine_kernel[(T, triton.cdiv(D, block))](
        y, shared if shared is not None else y, out, weights if weights is not None else y, D, y.stride(0),
        shared.stride(0) if shared is not None else 0, out.stride(0), SLOTS=slots, HAS_SHARED=shared is not None,
        WEIGHTED=weights is not None, BLOCK=block, num_warps=4,
    )
    return out


# bf16 experts take 128-row tiles above this many routed pairs per expert (prefill): on the H200 (2026-12-04,
# benchmarks/moe_tile_sweep.py at 16384 tokens, 1536 pairs an expert) gate_up 2585 -> 2102 us and down 1607 ->
# 1190 us a layer against BLOCK_M 64. Sizes between 64 and this were not swept with 128: they keep 64.
BF16_BLOCK_M_128_MIN_PAIRS = 512
# fp8 W8A8 experts: the gate_up takes 128-row tiles above this many routed pairs per expert, the down GEMM keeps 64
# over the same alignment (w8a8_down_block_m). Since the K loop's promotion is one FMA an element (one weight
# scale a tile, fused_moe_mainloop._fp8_b_scale) the dual gate_up program fits 128 rows (255 registers, 24 bytes of
# stack at 8 warps); on an H100 (2026-12-05, benchmarks/moe_tile_sweep.py at 16384 tokens) gate_up 1,885 -> 1,486
# us a layer against BLOCK_M 64, while the down GEMM ran 1,446 us at 64 rows and 1,528 at 128 (its best tiles).
W8A8_BLOCK_M_128_MIN_PAIRS = 512


def pick_block_m(num_pairs: int, num_experts: int, scheme: str | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> int:
    """Rows per aligned tile: an expert with more routed pairs than this re-reads its weights per tile.
    16-bit experts (scheme None, bf16 / fp16) and fp8 W8A8 ones (its gate_up; the down GEMM: w8a8_down_block_m) go
    to 128 at prefill sizes (fp32 tiles of that size would not fit shared memory); the weight-only quantized schemes
    stay at 64 there (not swept at 128).
    DEEPINFER_MOE_BLOCK_M (16, 32, 64 or 128) overrides it for A/B runs on skewed routing."""
    if interpreting():
        return 16
    block_m = envs.MOE_BLOCK_M.get()  # BackendError unless 16, 32, 64 or 128
    if block_m is not None:
        return block_m
    per_expert = num_pairs / max(1, num_experts)
    if scheme is None and dtype in (torch.bfloat16, torch.float16) and per_expert > BF16_BLOCK_M_128_MIN_PAIRS:
        return 128
    if scheme in FP8_ACT and per_expert > W8A8_BLOCK_M_128_MIN_PAIRS:
        return 128
    return 16 if per_expert <= 16 else (32 if per_expert <= 64 else 64)


# the split W8A8 gate_up's rows per tile (the down GEMM keeps 64: W8A8's down at 4 warps, its best in the H200
# sweep of 2026-12-04 at 16384 tokens); the interpreter's: 32 and 16
SPLIT_GATE_UP_BLOCK_M = 128


def subdivided_ids(expert_ids: torch.Tensor, block_m: int, tile_m: int) -> torch.Tensor:
    """The expert id of each tile_m-row tile of an alignment made at block_m rows (tile_m divides block_m): each
    block's id repeated block_m / tile_m times (expert_ids itself when the tiles are the blocks)."""
    return expert_ids.repeat_interleave(block_m // tile_m) if tile_m != block_m else expert_ids


def w8a8_down_block_m(block_m: int) -> int:
    """Rows per tile of the W8A8 down GEMM over an alignment made at block_m: 64 under 128-row gate_up tiles
    (W8A8_BLOCK_M_128_MIN_PAIRS; each 128-row block's expert id is repeated for its two halves), else block_m.
    DEEPINFER_MOE_BLOCK_M keeps both GEMMs at the rows it sets."""
    return 64 if block_m == 128 and envs.MOE_BLOCK_M.get() is None else block_m


def split_gate_up(num_pairs: int, num_experts: int, scheme: str | None, inter: int) -> bool:
    """Whether the aligned W8A8 experts run gate_up as one GEMM over both halves (2I columns, one fp32 accumulator
    at 128-row tiles) and a separate SiLU-and-mul + quant kernel, instead of the dual GEMM that quantizes in its
    epilogue. Why it was built: the dual program holds two accumulators, so at 128 rows it spilled (sm_90 compile:
    312 bytes at 8 warps) and ran at 64 rows, where the W8A8 GEMMs reached about bf16's rate at prefill sizes
    (2,323 us a layer at 16384 tokens, H200 2026-12-04); one accumulator at 128 rows does not spill, at the cost of
    the [pairs, 2I] intermediate's round trip. Since the promotion is one FMA an element
    (fused_moe_mainloop._fp8_b_scale) the dual program itself runs 128 rows at prefill sizes
    (W8A8_BLOCK_M_128_MIN_PAIRS). Above DEEPINFER_MOE_W8A8_SPLIT_GATE_UP_MIN_PAIRS routed pairs per expert (0:
    never, the default: on an H100, 2026-12-05, the whole fused_moe ran 2-4% slower split at 4,096 and 16,384
    tokens, docs/perf-log/2026-12-05-session20-h100.md), and only where I is whole 128-blocks (the gate's and the
    up's weight-scale rows then follow one another, so one GEMM reads both halves' scales by row // 128)."""
    limit = envs.MOE_W8A8_SPLIT_GATE_UP_MIN_PAIRS.get()
    return (scheme in FP8_ACT and limit > 0 and inter % 128 == 0
            and num_pairs / max(1, num_experts) > limit)


def _split_block_m() -> tuple[int, int]:
    """(gate_up, down) rows per aligned tile of the split W8A8 path; DEEPINFER_MOE_BLOCK_M sets both."""
    forced = envs.MOE_BLOCK_M.get()
    if forced is not None:
        return forced, forced
    return (32, 16) if interpreting() else (SPLIT_GATE_UP_BLOCK_M, 64)


def _w8a8_split_gemms(xq, xs, w13, w2, y, sorted_ids, expert_ids, num_padded, n, k, block_m, down_block_m,
                      act_dtype, q13, q2, skipping: bool) -> None:
    """The split W8A8 path (`split_gate_up`): gate_up over both halves in the compute dtype (the values the dual
    epilogue rounds to), SiLU-and-mul + e4m3 quant per 128 channels, then the down GEMM at down_block_m rows (its
    tiles subdivide the gate_up's: each 128-row block's expert id repeated). skipping: some pairs are another
    rank's, never written by gate_up; their rows start zeroed so the quant reads no stale memory (the down GEMM
    skips them either way)."""
    from deepinfer.backends.nvidia.fused_moe_config import split_gate_up_config
    from deepinfer.backends.nvidia.quant.fp8_act_quant import silu_mul_quant_fp8

    make = torch.zeros if skipping else torch.empty
    inter = make((n, w13.shape[1]), dtype=act_dtype, device=xq.device)
    aligned_gemm(xq, w13, inter, sorted_ids, expert_ids, num_padded, n, k, block_m, a_scale=xs, act_dtype=act_dtype,
                 cfg=split_gate_up_config(block_m), **q13)
    act, act_s = silu_mul_quant_fp8(inter)
    aligned_gemm(act, w2, y, sorted_ids, subdivided_ids(expert_ids, block_m, down_block_m), num_padded, n, 1,
                 down_block_m, a_scale=act_s, act_dtype=act_dtype, **q2)


def align_skipping(align: Callable, topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """`align`'s layout with the -1 pairs left out: they go to an extra bucket E whose blocks are marked -1
    (the aligned kernel skips a block of expert -1), so any align with moe_align's signature (the Triton /
    torch one, the CUDA C++ one) serves expert parallelism unchanged. Sizes still depend on T only."""
    ids = torch.where(topk_ids >= 0, topk_ids, num_experts)
    sorted_ids, expert_ids, num_padded = align(ids, num_experts + 1, block_m)
    expert_ids = torch.where(expert_ids == num_experts, torch.full_like(expert_ids, -1), expert_ids)
    return sorted_ids, expert_ids, num_padded


def with_shared_slots(topk_ids: torch.Tensor, weights: torch.Tensor, first: int,
                      count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing with `count` shared experts (stacked as experts first..first+count-1) appended to every token's
    slots at weight 1.0: the aligned schedule then runs them as routed experts, and the combine sums their slots in
    fp32 with the routed ones (as the direct schedule's folded shared experts are summed)."""
    t = topk_ids.shape[0]
    extra = torch.arange(first, first + count, dtype=topk_ids.dtype, device=topk_ids.device).expand(t, count)
    return torch.cat([topk_ids, extra], 1), torch.cat([weights, weights.new_ones(t, count)], 1)


def _check_x_quant(x_quant, x: torch.Tensor, scheme: str | None, direct: bool) -> None:
    """x_quant is the W8A8 aligned schedule's input only: e4m3 rows (at least x's: padding past them is not read,
    the kernels index rows by pair) with fp32 scales per 128 channels, row-major."""
    if scheme not in FP8_ACT or direct:
        raise BackendError(f"fused_moe: x_quant is the fp8 W8A8 aligned schedule's input, not "
                           f"{scheme or 'dense'} weights{' in direct mode' if direct else ''}")
    q, s = x_quant
    t, d = x.shape
    if q.dtype != torch.float8_e4m3fn or q.shape[0] < t or q.shape[1] != d or q.stride(1) != 1 \
            or s.dtype != torch.float32 or s.shape[0] != q.shape[0] or s.shape[1] != triton.cdiv(d, 128) \
            or s.stride(1) != 1:
        raise BackendError(f"fused_moe: x_quant {tuple(q.shape)} {q.dtype} / {tuple(s.shape)} {s.dtype} strides "
                           f"{s.stride()}: expected e4m3 [>= {t}, {d}] and row-major fp32 "
                           f"[rows, {triton.cdiv(d, 128)}]")


def _slot_buffer(rows: int, d: int, device, zeroed: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [pairs, D] slot buffer (fp32 weighted slots, or the aligned schedule's unweighted ones in the compute
    dtype); zeroed when some pairs are skipped (the combine sums every slot), else left uninitialized (every row is
    written)."""
    if zeroed:
        return torch.zeros((rows, d), dtype=dtype, device=device)
    return torch.empty((rows, d), dtype=dtype, device=device)


def fused_moe(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2I, D]
    w2: torch.Tensor,  # [E, D, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int64
    align=moe_align,
    shared_out: torch.Tensor | None = None,  # [T, D]: the shared experts' output, added in the combine
    shared_w: tuple[torch.Tensor, torch.Tensor] | None = None,  # (gate_up [2SI, D], down [D, SI]): direct mode only
    direct: bool | None = None,  # None: use_direct(T, k)
    counters: torch.Tensor | None = None,  # int32 zeros >= cdiv(D, 16): direct mode fuses the combine (see below)
    before_combine: Callable[[], None] | None = None,  # called just before shared_out is read (a stream join)
    skip_unrouted: bool = False,  # topk_ids may hold -1 (another rank's expert): those pairs add nothing
    scheme: str | None = None,  # "fp8_block" / "fp8_w8a8" / "fp4" / "int4_*": w13 / w2 as QuantizedExperts holds them
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_zeros: torch.Tensor | None = None,  # int4: uint8 zero points laid out as the scales
    w2_zeros: torch.Tensor | None = None,
    group_size: int = 128,  # int4: input channels per scale / zero point
    w13_g_idx: torch.Tensor | None = None,  # int4 GPTQ act-order: int32 [E, D], the gate / up inputs' groups
    w13_perm: torch.Tensor | None = None,  # or act-order w13 with its columns sorted by group: int32 [E, D], each
    # column's input channel (quant/act_order.py); the GEMMs gather x's columns through it
    stacked_shared: int = 0,  # quantized experts: this many shared experts after the routed ones (every token, 1.0)
    x_quant: tuple[torch.Tensor, torch.Tensor] | None = None,  # W8A8 aligned: x's (e4m3 [>=T, D], scales [>=T, G])
) -> torch.Tensor:  # [T, D] in x's dtype
    T, D = x.shape
    E, two_i, _ = w13.shape
    E -= stacked_shared
    if scheme is not None and shared_w is not None:
        raise BackendError("fused_moe: shared-expert weights fold in only with dense routed experts")
    q13 = {"scale": w13_scale, "scheme": scheme, "zeros": w13_zeros, "group_size": group_size}
    if w13_g_idx is not None:  # (the down projection's act-order was resolved at load: QuantizedExperts)
        q13["g_idx"] = w13_g_idx
    if w13_perm is not None:
        q13["perm"] = w13_perm
    q2 = {"scale": w2_scale, "scheme": scheme, "zeros": w2_zeros, "group_size": group_size}
    k = topk_ids.shape[1]
    if T == 0:
        return torch.zeros_like(x)
    if direct is None:
        direct = use_direct(T, k)
    if direct and T > DIRECT_MAX_TOKENS:
        raise BackendError(f"fused_moe: direct mode takes at most {DIRECT_MAX_TOKENS} tokens, got {T}")
    if shared_w is not None and (not direct or shared_out is not None):
        raise BackendError("fused_moe: shared-expert weights fold in only in direct mode, and not with shared_out")
    if stacked_shared and shared_out is not None:
        raise BackendError("fused_moe: stacked shared experts and shared_out both add the shared experts")
    if stacked_shared and (scheme is None or shared_w is not None):
        raise BackendError("fused_moe: stacked shared experts are quantized routed experts' extra slots")
    if x_quant is not None:
        _check_x_quant(x_quant, x, scheme, direct)
    x = x.contiguous()
    weights = topk_weights.float().contiguous()
    if direct:
        ids = topk_ids.contiguous()
        n_shared = shared_w[1].shape[1] // (two_i // 2) if shared_w is not None else stacked_shared
        if w13_g_idx is None and int4_cuda.use_moe(x, w13, w2, w13_scale, w2_scale, scheme, k + n_shared, group_size,
                                                   skip_unrouted, shared_out):  # (act-order: its sorted layout only)
            return int4_cuda.moe(x, w13, w2, w13_scale, w2_scale, w13_zeros, w2_zeros, ids, weights, n_shared,
                                 w13_perm)
        q13["stacked_shared"] = q2["stacked_shared"] = bool(stacked_shared)
        slots = k + n_shared
        act = torch.empty((T * slots, two_i // 2), dtype=x.dtype, device=x.device)
        direct_gemm(x, w13, shared_w[0] if shared_w else None, act, ids, None, n_shared, slots, dual=True, **q13)
        y = _slot_buffer(T * slots, D, x.device, skip_unrouted)
        if counters is not None and fused_combine():
            out = torch.empty((T, D), dtype=x.dtype, device=x.device)
            direct_gemm(act, w2, shared_w[1] if shared_w else None, y, ids, weights, n_shared, 1, dual=False,
                        combine_into=(out, shared_out, counters), **q2)
            return out
        direct_gemm(act, w2, shared_w[1] if shared_w else None, y, ids, weights, n_shared, 1, dual=False, **q2)
        return combine(y.view(T, slots, D), shared_out, x.dtype)
    if stacked_shared:  # every token takes the shared experts as its last slots (weight 1.0), aligned like the rest
        topk_ids, weights = with_shared_slots(topk_ids, weights, E, stacked_shared)
        k += stacked_shared
        E += stacked_shared
    n = T * k
    split = split_gate_up(n, E, scheme, two_i // 2)
    block_m, down_block_m = _split_block_m() if split else (pick_block_m(n, E, scheme, x.dtype),) * 2
    if skip_unrouted:
        sorted_ids, expert_ids, num_padded = align_skipping(align, topk_ids, E, block_m)
    else:
        sorted_ids, expert_ids, num_padded = align(topk_ids, E, block_m)
    # the down GEMMs store each slot's product rounded to the compute dtype, unweighted; the combine weights and sums
    # them in fp32 (the native op's arithmetic; half the bytes of fp32 weighted slots)
    y = _slot_buffer(n, D, x.device, skip_unrouted, x.dtype)
    if scheme in FP8_ACT:  # W8A8: x quantized once
        from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8

        xq, xs = x_quant if x_quant is not None else quantize_act_fp8(x)
        if split:
            _w8a8_split_gemms(xq, xs, w13, w2, y, sorted_ids, expert_ids, num_padded, n, k, block_m, down_block_m,
                              x.dtype, q13, q2, skip_unrouted)
        else:  # gate_up writes e4m3 + scales, which down reads as they are
            act = torch.empty((n, two_i // 2), dtype=torch.float8_e4m3fn, device=x.device)
            act_s = torch.empty((n, triton.cdiv(two_i // 2, 128)), dtype=torch.float32, device=x.device)
            aligned_gemm(xq, w13, act, sorted_ids, expert_ids, num_padded, n, k, block_m, dual=True, a_scale=xs,
                         out_scale=act_s, act_dtype=x.dtype, **q13)
            down_m = w8a8_down_block_m(block_m)
            aligned_gemm(act, w2, y, sorted_ids, subdivided_ids(expert_ids, block_m, down_m), num_padded, n, 1,
                         down_m, a_scale=act_s, act_dtype=x.dtype, **q2)
    else:
        act = torch.empty((n, two_i // 2), dtype=x.dtype, device=x.device)
        aligned_gemm(x, w13, act, sorted_ids, expert_ids, num_padded, n, k, block_m, dual=True, **q13)
        aligned_gemm(act, w2, y, sorted_ids, expert_ids, num_padded, n, 1, block_m, **q2)
    if before_combine is not None:
        before_combine()
    return combine(y.view(T, k, D), shared_out, x.dtype, weights)
