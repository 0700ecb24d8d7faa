"""Absorbed MLA decode attention over the paged latent cache, in Triton.

Each query row is one decode token: q = [W_UK-absorbed q_nope (L wide), q_pe
(R wide)] against cache entries [kv_c (L), k_pe (R)]; values are kv_c itself,
so the output is L wide (the model projects it through W_UV afterwards).

Split-KV: stage 1 gives each (sequence, head block, split) program a slice of
the context and writes a partial output plus its log-sum-exp; stage 2 merges
the splits of each row in a fixed order, so results do not depend on timing.
With one split, stage 1 writes the output itself and there is no stage 2. Up
to 4 launched splits stage 2 runs inside stage 1: the last split of a row to
finish (a per-row counter) merges the row, which saves a launch and its
latency per layer (at batch 64 ~8 us of ~60 per layer); the merge order is
fixed, so which program runs it does not change the result.

The launch shape (split count, tile) depends only on host-known sizes (batch
size, heads, the block table's width), never on device values, so it is fixed
for CUDA-graph replay. Inside that shape each sequence sizes its own splits
from its length: ceil(len / splits) rounded up to whole tiles and at least
`min_split` tokens, so a short sequence uses fewer splits (the surplus
programs exit at once, the merge skips them) instead of many tiny ones whose
partial outputs (fp32, L wide per head) would cost more traffic than the
cache slice they cover. The split of a token depends only on its sequence's
length, so the reduction is deterministic.

An fp8 cache (float8_e4m3fn, EngineConfig.kv_cache_dtype="fp8") is read as stored and converted in
registers to q's dtype (exact: e4m3 is a subset of bf16 / fp16 / fp32); its per-layer scale is folded
into the score scale (q . (s k) = s (q . k)) and applied once to each split's output (sum p (s v) =
s sum p v), so the tile products run on the unscaled values and no dequantized copy exists anywhere.

`decode_params` (mla_decode_params.py) holds the launch table; DEEPINFER_MLA_SPLITS /
DEEPINFER_MLA_BLOCK_N / DEEPINFER_MLA_MIN_SPLIT override it for sweeps (benchmarks/kernels_mla.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import envs
from deepinfer.backends.nvidia.mla_decode_params import (  # noqa: F401  (re-exported for callers)
    BLOCK_H,
    DecodeParams,
    decode_params,
    default_num_splits,
    env_overrides,
)

_LOG2E = 1.4426950408889634
MERGE_BLOCK_L = 128  # latent columns per merge program


def _prec(dtype: torch.dtype) -> str | None:
    """fp32 inputs: exact fp32 products ("ieee"), not TF32; other dtypes: Triton's default."""
    return "ieee" if dtype == torch.float32 else None


@triton.jit
def _split_len(seq_len, num_splits, block_n, min_split):
    """Tokens per split of one sequence: ceil(len / splits) in whole tiles, at least min_split."""
    per = tl.cdiv(tl.cdiv(seq_len, num_splits), block_n) * block_n
    return tl.maximum(per, min_split)


@triton.jit
def _mla_decode_split_kernel(
    q_ptr, qpe_ptr, cache_ptr, table_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr, out_ptr, cnt_ptr,
    H, stride_qb, stride_qh, stride_eb, stride_eh, stride_tb, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    stride_ob, stride_oh, scale_log2, min_split, num_splits, kv_scale,
    L: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    PREC: tl.constexpr, DIRECT: tl.constexpr, FUSED_MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
    MERGE_L: tl.constexpr, KV_FP8: tl.constexpr, KV_F16: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    ENTRY: tl.constexpr = L + R
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = _split_len(seq_len, num_splits, BLOCK_N, min_split)
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    offs_l = tl.arange(0, L)
    active = start < seq_len  # an unused split writes nothing: the merge skips it
    if DIRECT:
        active = s == 0  # the only split writes the output, zeros for an empty (padded) row
    if active:
        offs_r = tl.arange(0, BLOCK_R)
        rmask = offs_r < R
        q_base = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
        q_nope = tl.load(q_base + offs_l[None, :], mask=hmask[:, None], other=0.0)
        pe_base = qpe_ptr + b.to(tl.int64) * stride_eb + heads[:, None] * stride_eh
        q_pe = tl.load(pe_base + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
        s_log2 = scale_log2
        if KV_F16:  # bf16 q, e4m3 cache: fp16 dots (DEEPINFER_MLA_FP8_KV_DOT, mla_decode's docstring)
            qf = q_nope.to(tl.float32)
            pf = q_pe.to(tl.float32)
            amax = tl.maximum(tl.max(tl.max(tl.abs(qf), 1), 0), tl.max(tl.max(tl.abs(pf), 1), 0))
            # a power of two 2^e putting amax in [2^14, 2^15): fp16's range, its precision kept for small values;
            # built from its exponent bits (exact), its inverse folded into the scores' scale
            e = tl.where(amax > 0, tl.floor(tl.log2(16384.0 / tl.maximum(amax, 1e-30))), 0.0)
            e = tl.minimum(tl.maximum(e, -126.0), 127.0).to(tl.int32)
            qs = ((e + 127) << 23).to(tl.float32, bitcast=True)
            q_nope = (qf * qs).to(tl.float16)
            q_pe = (pf * qs).to(tl.float16)
            s_log2 = scale_log2 / qs
        elif UPCAST:
            q_nope = q_nope.to(tl.float32)
            q_pe = q_pe.to(tl.float32)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, L], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < end
            blk = tl.load(table_ptr + b.to(tl.int64) * stride_tb + offs_n // PAGE, mask=nmask, other=0)
            slot = blk.to(tl.int64) * PAGE + (offs_n % PAGE)
            kv = tl.load(cache_ptr + slot[:, None] * ENTRY + offs_l[None, :], mask=nmask[:, None], other=0.0)
            kpe = tl.load(cache_ptr + slot[:, None] * ENTRY + L + offs_r[None, :],
                          mask=nmask[:, None] & rmask[None, :], other=0.0)
            if KV_FP8:  # e4m3 -> q's dtype in registers (exact); the scale is in scale_log2 and kv_scale
                kv = kv.to(q_nope.dtype)
                kpe = kpe.to(q_nope.dtype)
            elif UPCAST:
                kv = kv.to(tl.float32)
                kpe = kpe.to(tl.float32)
            qk = tl.dot(q_nope, tl.trans(kv), input_precision=PREC)
            qk += tl.dot(q_pe, tl.trans(kpe), input_precision=PREC)
            qk = tl.where(nmask[None, :], qk * s_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PREC)
            m_i = m_new

        denom = tl.where(l_i > 0, l_i, 1.0)
        out = acc / denom[:, None]
        if KV_FP8:
            out = out * kv_scale  # the values' scale, once per split (the merge is linear in it)
        if DIRECT:  # one split: this is the output
            po = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_l[None, :]
            tl.store(po, out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
        else:
            lse = tl.where(l_i > 0, m_i + tl.log2(denom), float("-inf"))
            po = part_o_ptr + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + s * stride_ps + offs_l[None, :]
            tl.store(po, out, mask=hmask[:, None])
            tl.store(part_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + s, lse, mask=hmask)
            if FUSED_MERGE:  # the row's last split to finish merges all of them (then resets the counter)
                tl.debug_barrier()  # every thread's partial stores happen before the (acq_rel, gpu) increment
                used = tl.cdiv(seq_len, split_len)
                cnt = cnt_ptr + b * tl.num_programs(1) + hb  # one counter per (row, head block)
                if tl.atomic_add(cnt, 1) == used - 1:
                    _merge_row(part_o_ptr, part_lse_ptr, out_ptr, b.to(tl.int64), heads, hmask, used,
                               stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                               L, BLOCK_S, MERGE_L)
                    tl.atomic_xchg(cnt, 0)
    if FUSED_MERGE:
        if (seq_len == 0) & (s == 0):  # an empty (padded) row gets zeros, as the merge kernel gives it
            tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_l[None, :],
                     tl.zeros([BLOCK_H, L], dtype=out_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _merge_row(part_o_ptr, part_lse_ptr, out_ptr, b, heads, hmask, used,
               stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
               L: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_L: tl.constexpr):
    """Merge the `used` splits of row b for a block of heads in split order (deterministic: the same
    result whichever program runs it); partials are read through L2 (written by other programs)."""
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < used
    hs = hmask[:, None] & smask[None, :]
    lse = tl.load(part_lse_ptr + b * stride_lb + heads[:, None] * stride_lh + offs_s[None, :], mask=hs,
                  other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(hs, tl.exp2(lse - m[:, None]), 0.0)
    total = tl.sum(w, 1)
    total = tl.where(total > 0, total, 1.0)
    base = part_o_ptr + b * stride_pb + heads[:, None, None] * stride_ph + offs_s[None, :, None] * stride_ps
    for c in tl.static_range(0, L, MERGE_L):
        offs_l = c + tl.arange(0, MERGE_L)
        o = tl.load(base + offs_l[None, None, :], mask=hs[:, :, None], other=0.0, cache_modifier=".cg")
        acc = tl.sum(w[:, :, None] * o, 1) / total[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_l[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _split_weights(part_lse_ptr, seq_lens_ptr, b, h, stride_lb, stride_lh, min_split, num_splits, block_n,
                   BLOCK_S: tl.constexpr):
    """The merge weights of one (row, head): exp2(lse - max) over the splits this row used (0 for the
    others, never read), their sum (1 where nothing was attended), the split offsets and their mask."""
    seq_len = tl.load(seq_lens_ptr + b)
    used = tl.cdiv(seq_len, _split_len(seq_len, num_splits, block_n, min_split))
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < used
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(smask, tl.exp2(lse - m), 0.0)
    total = tl.sum(w, 0)
    return w, tl.where(total > 0, total, 1.0), offs_s, smask


@triton.jit
def _mla_decode_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, seq_lens_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh, min_split, num_splits, block_n,
    BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """One program per (row, head, BLOCK_L columns): all used splits in one [S, BLOCK_L] tile, summed in a
    fixed tree order (deterministic); unused splits are masked, never read."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.program_id(2)
    w, total, offs_s, smask = _split_weights(part_lse_ptr, seq_lens_ptr, b, h, stride_lb, stride_lh, min_split,
                                             num_splits, block_n, BLOCK_S)
    offs_l = c * BLOCK_L + tl.arange(0, BLOCK_L)
    o = tl.load(part_o_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_l[None, :],
                mask=smask[:, None], other=0.0)
    acc = tl.sum(w[:, None] * o, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_l, (acc / total).to(out_ptr.dtype.element_ty))


@triton.jit
def _mla_decode_merge_uv_kernel(
    part_o_ptr, part_lse_ptr, wuv_ptr, out_ptr, seq_lens_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_wh, stride_wl, stride_ob, stride_oh,
    min_split, num_splits, block_n, V,
    L: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_LC: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Small batches: one program per (row, head, BLOCK_V output columns) merges the splits (as the merge kernel)
    and multiplies by W_UV^T [L, V] (fp32 accumulation), so the merge and the W_UV product are one launch.
    The merged latent stays fp32 into the product (one rounding, at the end): rounding it to bf16 first, as
    the unfused path's merge output must be, added ~40% to the op's error vs fp32 (docs/determinism.md)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    w, total, offs_s, smask = _split_weights(part_lse_ptr, seq_lens_ptr, b, h, stride_lb, stride_lh, min_split,
                                             num_splits, block_n, BLOCK_S)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = offs_v < V
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for c in tl.static_range(0, L, BLOCK_LC):
        offs_l = c + tl.arange(0, BLOCK_LC)
        o = tl.load(part_o_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_l[None, :],
                    mask=smask[:, None], other=0.0)
        lat = tl.sum(w[:, None] * o, 0) / total  # fp32: no rounding before W_UV
        wt = tl.load(wuv_ptr + h * stride_wh + offs_l[:, None] * stride_wl + offs_v[None, :], mask=vmask[None, :],
                     other=0.0)
        acc += tl.sum(lat[:, None] * wt.to(tl.float32), 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_v, acc.to(out_ptr.dtype.element_ty), mask=vmask)


MERGE_UV_MAX_BATCH = 8  # above this the per-(row, head) W_UV reads cost more than a batched GEMM
# The merge + W_UV kernel's default: 32 output columns a program (at batch 1, 64 programs: 16 heads x 4) and the
# latent in chunks as wide as a [splits, chunk] fp32 tile of MERGE_UV_TILE_ELEMENTS allows (the whole 512-wide latent
# at up to 32 launched splits), 8 warps where the tile is that full (64 fp32 a thread). On an H100 (2026-12-06, session 32,
# benchmarks.b1_small_kernels, V2-Lite, context 1033, 19 splits launched so a 32-row tile, split kernel included):
# 11.2 us at (32, 512, 8), 12.0 at (32, 256, 4), 14.2 at (32, 128, 4), 18.3 at (32, 64, 4) (the default before):
# fewer dependent load-then-reduce rounds a program; the batch-1 decode step 0.18 ms shorter than at (32, 64, 4).
# 64 launched splits (a long max_model_len, so the usual serving case) take 256-wide chunks with 8 warps: not timed.
MERGE_UV_BLOCK_V = 32
MERGE_UV_TILE_ELEMENTS = 16384


def merge_uv_tile(L: int, V: int, block_s: int = 32) -> tuple[int, int, int]:
    """The merge + W_UV kernel's (BLOCK_V, BLOCK_LC, num_warps) for block_s split rows (the launched splits, a
    power of two): the default above, or DEEPINFER_MLA_MERGE_UV_TILE (checked: three powers of two, BLOCK_LC
    dividing the latent width L), each block capped at its dimension."""
    from deepinfer.errors import BackendError

    env = envs.MLA_MERGE_UV_TILE.get()
    chunk = min(L, max(64, MERGE_UV_TILE_ELEMENTS // block_s))
    tile = (MERGE_UV_BLOCK_V, chunk, 8 if block_s * chunk >= MERGE_UV_TILE_ELEMENTS else 4)  # <= 64 fp32 a thread
    if env:
        try:
            tile = tuple(int(v) for v in env.split(","))
        except ValueError:
            tile = ()
        if len(tile) != 3 or any(v < 1 or v & (v - 1) for v in tile) or tile[2] > 32 or L % min(tile[1], L):
            raise BackendError(f"DEEPINFER_MLA_MERGE_UV_TILE={env!r}: expected 'BLOCK_V,BLOCK_LC,num_warps', powers "
                               f"of two (num_warps <= 32, BLOCK_LC dividing the latent width {L})")
    block_v, block_lc, warps = tile
    return min(block_v, triton.next_power_of_2(V)), min(block_lc, L), warps


# Per-device merge counters, one per (row, head block), zero between launches (the merging program
# resets its own). Never freed or replaced while smaller: a captured graph holds the pointer. Launches
# that share them run in stream order (one attention stream), as graph replays do.
_MERGE_COUNTERS: dict[str, list[torch.Tensor]] = {}


# The in-kernel merge is one program reading every split of its row (16 heads x 512 x 4 B per split),
# so with many splits that tail is long and serial; the separate merge spreads it over many programs.
# Measured better at 4 splits (batch 64: 52 vs 60 us per layer at 1536); a run with it at 16 splits
# (batch 16) was slower end to end (8.66 vs 8.00 ms/step, with another change in the same run).
FUSED_MERGE_MAX_SPLITS = 4


def fused_merge_enabled(num_splits: int) -> bool:
    """Whether the split kernel's last program per row merges (no merge launch): up to
    FUSED_MERGE_MAX_SPLITS launched splits; DEEPINFER_MLA_FUSED_MERGE=1 / 0 forces it on / off (A/B runs)."""
    forced = envs.MLA_FUSED_MERGE.get()  # None: auto
    if forced is not None:
        return forced
    return num_splits <= FUSED_MERGE_MAX_SPLITS


def merge_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters on `device`; allocated outside graph capture in practice (the
    graph runner's warm-up of the largest batch comes first), grown by allocating a larger buffer."""
    key = str(device)
    bufs = _MERGE_COUNTERS.setdefault(key, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(4096, triton.next_power_of_2(n)), dtype=torch.int32, device=device))
    return bufs[-1]


def mla_decode(
    q: torch.Tensor,  # [B, H, L + R]: absorbed q_nope then q_pe (or [B, H, L] with q_pe given)
    kv_cache: torch.Tensor,  # [num_blocks, page, L + R]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, tokens in the cache (the new one included)
    kv_lora_rank: int,
    softmax_scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    q_pe: torch.Tensor | None = None,  # [B, H, R]: pass the rope part apart to skip a concatenation
    min_split: int | None = None,
    w_uv_t: torch.Tensor | None = None,  # [H, L, V]: also project through W_UV -> [B, H, V]
    kv_scale: float = 1.0,  # a float8_e4m3fn cache's per-layer scale: entries are stored * kv_scale
) -> torch.Tensor:  # [B, H, L], or [B, H, V] with w_uv_t
    """Unset num_splits / block_n / min_split / warps / stages come from decode_params (heuristic + env).

    With w_uv_t the result is o_lat @ W_UV^T per head: merged in the same launch for up to
    MERGE_UV_MAX_BATCH rows (host-known, so graph-safe), else a cuBLAS batched GEMM after the merge.

    An e4m3 cache is converted in registers to q's dtype, per tile. With bf16 q that conversion goes through fp32
    on sm_90 (e4m3 -> fp16 is one cvt per pair of values, -> bf16 is not), and on the H200 (session 12) the fp8
    cache made batch-256 decode slower than the bf16 cache. DEEPINFER_MLA_FP8_KV_DOT=fp16 runs those dots in fp16:
    each program scales its q tile by a power of two into fp16's range (exact), the cache converts exactly, the
    probabilities round to fp16 (finer than bf16); the scale's inverse is folded into the scores. At least as
    accurate as the bf16 dots (tests/quant/test_kv_cache_fp8_triton.py). Timed: b256 +4.7% over the bf16 cache
    against +6.6% with bf16 dots on the H200 (session 13), +10% against +12% on an H100 (session 22); both dots are
    slower than the bf16 cache, and bf16 stays the default (docs/quantization.md, "Not done")."""
    from deepinfer.errors import BackendError

    L = kv_lora_rank
    if q_pe is None:
        q, q_pe = q[..., :L], q[..., L:]
    B, H = q.shape[:2]
    R = q_pe.shape[-1]
    entry = L + R
    if q.shape[-1] != L or q_pe.shape[:2] != q.shape[:2] or q_pe.stride(-1) != 1:
        raise BackendError(f"mla_decode: q {tuple(q.shape)} / q_pe {tuple(q_pe.shape)} do not match L={L}")
    if kv_cache.shape[-1] != entry:
        raise BackendError(f"mla_decode: q width {entry} != cache entry width {kv_cache.shape[-1]}")
    if L & (L - 1) or L < 16:
        raise BackendError(f"mla_decode: kv_lora_rank {L} must be a power of two >= 16")
    if q.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise BackendError("mla_decode: q needs a contiguous last dim and the cache must be contiguous")
    page = kv_cache.shape[1]
    auto = decode_params(B, H, block_table.shape[1] * page)
    num_splits = num_splits or auto.num_splits
    if block_n is None or block_n == auto.block_n:
        num_warps, num_stages = num_warps or auto.num_warps, num_stages or auto.num_stages
    block_n = block_n or auto.block_n
    num_warps, num_stages = num_warps or 4, num_stages or 3
    min_split = triton.cdiv(min_split or auto.min_split, block_n) * block_n
    if num_splits < 1 or block_n < 16 or block_n & (block_n - 1):
        raise BackendError(f"mla_decode: {num_splits} splits / {block_n}-token tiles (need >= 1 / a power of two >= 16)")
    interpret = envs.TRITON_INTERPRET.get() == "1"
    upcast = interpret and q.dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    kv_f16 = kv_fp8 and q.dtype == torch.bfloat16 and envs.MLA_FP8_KV_DOT.get() == "fp16"
    direct = num_splits == 1
    fuse_uv = w_uv_t is not None and not direct and B <= MERGE_UV_MAX_BATCH
    fused_merge = not direct and not fuse_uv and fused_merge_enabled(num_splits)
    if w_uv_t is not None and (w_uv_t.shape[:2] != (H, L) or w_uv_t.stride(-1) != 1 or w_uv_t.dtype != q.dtype):
        raise BackendError(f"mla_decode: W_UV^T {tuple(w_uv_t.shape)} {w_uv_t.dtype} is not [{H}, {L}, V] {q.dtype}")
    out = torch.empty((B, H, L), dtype=q.dtype, device=q.device) if not fuse_uv else None
    if B == 0:
        return torch.empty((0, H, L if w_uv_t is None else w_uv_t.shape[-1]), dtype=q.dtype, device=q.device)
    if direct:  # the split kernel writes `out` itself; the partial buffers are not touched
        part_o, part_lse = out, out
    else:
        part_o = torch.empty((B, H, num_splits, L), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    head_blocks = triton.cdiv(H, BLOCK_H)
    block_s = triton.next_power_of_2(num_splits)
    counters = merge_counters(q.device, B * head_blocks) if fused_merge else seq_lens
    _mla_decode_split_kernel[(B, head_blocks, num_splits)](
        q, q_pe, kv_cache, block_table, seq_lens, part_o, part_lse, out if out is not None else part_o, counters,
        H, q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1), block_table.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2) if not direct else 0, part_lse.stride(0),
        part_lse.stride(1), out.stride(0) if out is not None else 0, out.stride(1) if out is not None else 0,
        softmax_scale * _LOG2E * (kv_scale if kv_fp8 else 1.0), min_split, num_splits, float(kv_scale),
        L=L, R=R, BLOCK_R=max(16, triton.next_power_of_2(R)), PAGE=page, BLOCK_H=BLOCK_H, BLOCK_N=block_n, UPCAST=upcast and not kv_f16, PREC=_prec(q.dtype), DIRECT=direct,
        FUSED_MERGE=fused_merge, BLOCK_S=block_s, MERGE_L=min(L, max(16, 4096 // (BLOCK_H * block_s))),
        KV_FP8=kv_fp8, KV_F16=kv_f16, num_warps=num_warps, num_stages=num_stages,
    )
    if fuse_uv:
        V = w_uv_t.shape[-1]
        res = torch.empty((B, H, V), dtype=q.dtype, device=q.device)
        # many programs: at batch 1 it is latency-bound
        block_v, block_lc, merge_warps = merge_uv_tile(L, V, triton.next_power_of_2(num_splits))
        _mla_decode_merge_uv_kernel[(B, H, triton.cdiv(V, block_v))](
            part_o, part_lse, w_uv_t, res, seq_lens, part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1), w_uv_t.stride(0), w_uv_t.stride(1), res.stride(0), res.stride(1),
            min_split, num_splits, block_n, V, L=L, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_LC=block_lc, BLOCK_V=block_v, num_warps=merge_warps,
        )
        return res
    if not direct and not fused_merge:
        block_l = min(L, MERGE_BLOCK_L)
        _mla_decode_merge_kernel[(B, H, L // block_l)](
            part_o, part_lse, out, seq_lens, part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), min_split, num_splits, block_n,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_L=block_l,
            num_warps=4,
        )
    if w_uv_t is not None:  # [H, B, L] @ [H, L, V] into a [B, H, V] buffer: strided, no copies
        res = torch.empty((B, H, w_uv_t.shape[-1]), dtype=q.dtype, device=q.device)
        torch.bmm(out.transpose(0, 1), w_uv_t, out=res.transpose(0, 1))
        return res
    return out
