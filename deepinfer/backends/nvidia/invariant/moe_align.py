"""The invariant MoE's expert-aligned layout in one or two Triton launches (a counting sort by expert).

The grouped GEMM (moe_gemm.py) reads the (token, slot) pairs grouped by expert, each expert's run cut into
blocks of BLOCK_M rows. This builds that layout: for every block its expert and its number of valid rows, and
sorted_ids, the pairs of each run in token order. The torch sequence it replaces (scatter_add, two cumsums, a
stable argsort, gathers, a fill, an arange, a searchsorted, wheres: about twenty launches per MoE layer) cost
about 1 ms per decode step at batch 1 on the H200 (docs/perf-log/2026-12-01-session5-h200.md).

Pair p = t * SLOTS + j: slot j < TOP_K is token t's routed expert topk_ids[t, j] (-1: another rank's expert,
left out), slot TOP_K + s is shared expert E + s (every token, weight 1.0). Routed experts come first, in
expert order; the shared experts' runs follow (their layout is known without counting: token order).

- count (only when the routed pairs need more than one program): program c counts its chunk of routed pairs
  per expert (a one-hot of the chunk against the experts, summed), hist [C, EP];
- place: the totals and the count of the chunks before c give every expert's run start (each run padded to a
  whole number of blocks); program c writes its pairs at run start + pairs of the same expert before it (an
  inclusive cumsum of the one-hot: token order, a stable counting sort), the shared pairs of its tokens, and
  the expert and valid rows of its share of the blocks. With one program (small batches) it counts itself.

The grid of the GEMM is cdiv(routed pairs, BLOCK_M) + min(routed pairs, E) + shared x cdiv(T, BLOCK_M) blocks,
a bound on the blocks used that depends on T alone (graph-safe) and, unlike the torch layout's E * (BLOCK_M - 1)
padding, stays small at batch 1: unused blocks carry expert -1 and exit at once. The layout never changes a
row's bits (a pair's row is one fixed-order K loop wherever it sits in its tile); it only orders the work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.errors import BackendError

ONE_HOT = 8192  # elements of a [pairs, experts] one-hot per step (registers)
SINGLE_MAX_PAIRS = 256  # up to this many routed pairs one program does everything (one launch)
MAX_PROGRAMS = 256


@dataclass
class Alignment:
    sorted_ids: torch.Tensor  # [num_blocks * BLOCK_M] int32 pair ids; a block's rows past block_rows are unset
    block_expert: torch.Tensor  # [num_blocks] int32, E + s for shared expert s, -1 for an unused block
    block_rows: torch.Tensor  # [num_blocks] int32 valid rows (0 for an unused block)
    num_blocks: int


@triton.jit
def _chunk_counts(ids_ptr, r_lo, r_hi, E, EP: tl.constexpr, SUB: tl.constexpr):
    """Routed pairs per expert over flat routed ids [r_lo, r_hi) (-1 ids, and ids >= E, count nowhere)."""
    x = tl.arange(0, EP)
    cnt = tl.zeros([EP], dtype=tl.int32)
    for r0 in range(r_lo, r_hi, SUB):
        r = r0 + tl.arange(0, SUB)
        e = tl.load(ids_ptr + r, mask=r < r_hi, other=-1).to(tl.int32)
        e = tl.where(e < E, e, -1)  # an id past the experts (a padded graph row's garbage) is left out
        cnt += tl.sum((e[:, None] == x[None, :]).to(tl.int32), 0)
    return cnt


@triton.jit
def _align_count_kernel(ids_ptr, hist_ptr, n_routed, E, per_prog, EP: tl.constexpr, SUB: tl.constexpr):
    c = tl.program_id(0)
    lo = c * per_prog
    cnt = _chunk_counts(ids_ptr, lo, tl.minimum(lo + per_prog, n_routed), E, EP, SUB)
    tl.store(hist_ptr + c * EP + tl.arange(0, EP), cnt)


@triton.jit
def _align_place_kernel(
    ids_ptr, hist_ptr, sorted_ptr, bexp_ptr, brows_ptr, T, E, C, per_prog, num_blocks,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, NS: tl.constexpr, EP: tl.constexpr, SUB: tl.constexpr,
    RB: tl.constexpr, BB: tl.constexpr, BLOCK_M: tl.constexpr, SINGLE: tl.constexpr,
):
    c = tl.program_id(0)
    x = tl.arange(0, EP)
    n_routed = T * TOP_K
    lo = c * per_prog
    hi = tl.minimum(lo + per_prog, n_routed)
    if SINGLE:
        total = _chunk_counts(ids_ptr, 0, n_routed, E, EP, SUB)
        before = tl.zeros([EP], dtype=tl.int32)
    else:
        total = tl.zeros([EP], dtype=tl.int32)
        before = tl.zeros([EP], dtype=tl.int32)
        for r0 in range(0, C, RB):
            rr = r0 + tl.arange(0, RB)
            h = tl.load(hist_ptr + rr[:, None] * EP + x[None, :], mask=(rr < C)[:, None], other=0)
            total += tl.sum(h, 0)
            before += tl.sum(tl.where((rr < c)[:, None], h, 0), 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    routed_total = tl.sum(padded, 0)
    # this program's routed pairs, each at its run's start + the pairs of its expert before it (token order)
    run = pad_start + before
    for r0 in range(lo, hi, SUB):
        r = r0 + tl.arange(0, SUB)
        e = tl.load(ids_ptr + r, mask=r < hi, other=-1).to(tl.int32)
        e = tl.where(e < E, e, -1)  # an id past the experts (a padded graph row's garbage) is left out
        hot = e[:, None] == x[None, :]
        hot_i = hot.to(tl.int32)
        rank = tl.sum(tl.where(hot, tl.cumsum(hot_i, 0), 0), 1) - 1
        dest = tl.sum(tl.where(hot, run[None, :], 0), 1) + rank
        tl.store(sorted_ptr + dest, ((r // TOP_K) * SLOTS + r % TOP_K).to(tl.int32), mask=e >= 0)
        run += tl.sum(hot_i, 0)
    # the shared experts' pairs of this program's tokens: run s holds every token in order
    shb = tl.cdiv(T, BLOCK_M)
    if NS > 0:
        tpp = tl.cdiv(T, C)
        for t0 in range(c * tpp, tl.minimum(c * tpp + tpp, T), SUB):
            t = t0 + tl.arange(0, SUB)
            tmask = t < tl.minimum(c * tpp + tpp, T)
            for s in tl.static_range(NS):
                tl.store(sorted_ptr + routed_total + s * shb * BLOCK_M + t, t * SLOTS + TOP_K + s, mask=tmask)
    # every block's expert and valid rows (this program's block tiles: c, c + C, ...)
    run_end = pad_start + total
    routed_blocks = routed_total // BLOCK_M
    for b0 in range(c * BB, num_blocks, C * BB):
        b = b0 + tl.arange(0, BB)
        start = b * BLOCK_M
        eb = tl.sum((pad_end[None, :] <= start[:, None]).to(tl.int32), 1)  # the first run ending past start
        rows_r = tl.sum(tl.where(eb[:, None] == x[None, :], run_end[None, :], 0), 1) - start
        sb = b - routed_blocks
        in_shared = (sb >= 0) & (sb < NS * shb)
        routed = b < routed_blocks
        expert = tl.where(routed, eb, tl.where(in_shared, E + sb // shb, -1))
        rows = tl.where(routed, rows_r, tl.where(in_shared, T - (sb % shb) * BLOCK_M, 0))
        bmask = b < num_blocks
        tl.store(bexp_ptr + b, expert, mask=bmask)
        tl.store(brows_ptr + b, tl.minimum(rows, BLOCK_M), mask=bmask)


def num_blocks(num_tokens: int, top_k: int, num_experts: int, num_shared: int, block_m: int) -> int:
    """The layout's block count: a bound on the blocks used, from the token count alone (graph-safe)."""
    n = num_tokens * top_k
    return triton.cdiv(n, block_m) + min(n, num_experts) + num_shared * triton.cdiv(num_tokens, block_m)


def align(topk_ids: torch.Tensor, num_experts: int, num_shared: int, block_m: int,
          programs: int | None = None) -> Alignment:
    """The layout of T tokens' pairs (topk_ids [T, k] int, -1 left out; num_shared experts E.. taken by all).
    programs: how many programs share the work (None: one up to SINGLE_MAX_PAIRS routed pairs, else about one
    per ONE_HOT / experts pairs); the layout is the same for any count (the tests check it)."""
    if topk_ids.dim() != 2:
        raise BackendError(f"invariant MoE align: topk_ids must be [T, k], got {tuple(topk_ids.shape)}")
    T, k = topk_ids.shape
    ids = topk_ids.contiguous()
    dev = ids.device
    nb = num_blocks(T, k, num_experts, num_shared, block_m)
    out = Alignment(torch.empty(nb * block_m, dtype=torch.int32, device=dev),
                    torch.empty(nb, dtype=torch.int32, device=dev),
                    torch.empty(nb, dtype=torch.int32, device=dev), nb)
    if T == 0:
        return out
    ep = triton.next_power_of_2(num_experts)
    n = T * k
    # the one-hot's rows per step: ONE_HOT // ep, or fewer when the pairs are fewer (at batch 1 a 128 x 64 one-hot
    # and its scan for 6 pairs cost ~8 µs a layer); a size of the work, never of the layout
    sub = max(16, min(ONE_HOT // ep, triton.next_power_of_2(n)))
    if programs is None:
        programs = 1 if n <= SINGLE_MAX_PAIRS else min(MAX_PROGRAMS, triton.cdiv(n, sub))
    if programs == 1:
        progs, per_prog = 1, triton.cdiv(n, sub) * sub
    else:
        progs = programs
        per_prog = triton.cdiv(triton.cdiv(n, progs), sub) * sub
        progs = triton.cdiv(n, per_prog)
    single = progs == 1
    hist = out.block_rows if single else torch.empty((progs, ep), dtype=torch.int32, device=dev)
    if not single:
        _align_count_kernel[(progs,)](ids, hist, n, num_experts, per_prog, EP=ep, SUB=sub, num_warps=4)
    _align_place_kernel[(progs,)](
        ids, hist, out.sorted_ids, out.block_expert, out.block_rows, T, num_experts, progs, per_prog, nb,
        TOP_K=k, SLOTS=k + num_shared, NS=num_shared, EP=ep, SUB=sub, RB=max(1, ONE_HOT // ep),
        BB=max(16, min(ONE_HOT // ep, triton.next_power_of_2(nb))), BLOCK_M=block_m, SINGLE=single, num_warps=4,
    )
    return out
