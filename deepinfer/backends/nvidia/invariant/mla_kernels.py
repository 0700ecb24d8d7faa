"""Triton kernels of the batch-invariant absorbed MLA (mla.py): one reduction order for every token.

A program owns a q-block: up to BLOCK_Q consecutive query tokens of one request times BLOCK_H heads,
always a [BLOCK_Q * BLOCK_H, ...] tile, whether it holds one decode token or BLOCK_Q prefill tokens (mla.py
uses BLOCK_Q = 1 on the GPU: one token's 16 heads, the tile of the default decode kernel, so a decode row
wastes no MMA rows). Each row (token, head) attends the latent cache entries 0..pos (its own position), in
SPLITs of a FIXED number of entries (split s covers positions [s * SPLIT, (s + 1) * SPLIT)), each split an
online softmax over BLOCK_N-entry tiles in order, the splits then folded left to right (`_fold`) from the
empty state. So a row's reduction depends only on its position: not on its q-block mates, on how its prompt
was chunked, or on prefill vs decode. Tiles a row does not see (beyond its position) are exact no-ops: their
scores are -inf, so alpha = exp2(0) = 1, p = 0 and the state is unchanged bit for bit; the same holds for a
split folded in past a row's end. Rows whose q-block reaches further therefore still get their own bits.

Two schedules give the same bits, and the caller may pick either from the batch:
- `_mla_onestage_kernel`: a program runs its splits one after another, folding each as it finishes;
- `_mla_split_kernel`: one program per split writes its (m, l, acc) state in fp32 (exact), and the last of
  a q-block's splits to finish folds them all in split order (parallel over splits: small decode batches;
  the arrival counter picks which program folds, never the order).
UPCAST is the interpreter flag of gemm.mma (products in fp64 there). Both call the same
`_split_state` and `_fold`, and both are launched with `enable_fp_fusion=False`,
so no multiply-add is contracted differently in one kernel than in the other.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.backends.nvidia.invariant.gemm import mma


@triton.jit
def _rows(qb, hb, qb_tok_ptr, qb_len_ptr, qb_req_ptr, qb_pos_ptr, seq_lens_ptr, H,
          BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, DECODE: tl.constexpr):
    """Per row of the q-block tile: (token row, head, valid, position or -1), the request, kv_end.
    The block's tokens sit at positions qb_pos[qb] + 0, 1, ... (consecutive tokens of one request).
    DECODE (a decode-only batch): q-block b is token b of request b at position seq_lens[b] - 1, read from
    seq_lens alone (the qb_* pointers are unused), so the step builds no q-block tables. Only integer
    indexing differs: the rows' floating-point work is the same code either way."""
    r = tl.arange(0, BLOCK_Q * BLOCK_H)
    qi = r // BLOCK_H
    head = hb * BLOCK_H + r % BLOCK_H
    if DECODE:
        tok0 = qb
        n = 1
        req = qb.to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + req)
        pos0 = seq_len - 1
    else:
        tok0 = tl.load(qb_tok_ptr + qb)
        n = tl.load(qb_len_ptr + qb)
        req = tl.load(qb_req_ptr + qb).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + req)
        pos0 = tl.load(qb_pos_ptr + qb)
    valid = (qi < n) & (head < H) & (tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.int32) < seq_len)
    tok = (tok0 + qi).to(tl.int64)
    pos = tl.where(valid, tl.minimum(pos0 + qi, seq_len - 1), -1)
    kv_end = tl.max(pos, 0) + 1  # entries this q-block needs (0: an empty / padded block)
    return tok, head, valid, pos, req, kv_end


@triton.jit
def _load_q(q_ptr, qpe_ptr, tok, head, valid, stride_qt, stride_qh, stride_pt, stride_ph,
            L: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr):
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, BLOCK_R)
    q_lat = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_l[None, :],
                    mask=valid[:, None], other=0.0)
    q_pe = tl.load(qpe_ptr + tok[:, None] * stride_pt + head[:, None] * stride_ph + offs_r[None, :],
                   mask=valid[:, None] & (offs_r < R)[None, :], other=0.0)
    return q_lat, q_pe


@triton.jit
def _split_state(q_lat, q_pe, cache_ptr, trow_ptr, pos, start, stop, scale_log2,
                 L: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr,
                 BM: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                 ROWSUM_MMA: tl.constexpr):
    """(m, l, acc) of an online softmax over entries [start, stop) in BLOCK_N tiles, row r seeing <= pos[r].

    ROWSUM_MMA: a tile's row sum of p is one more MMA (the rounded p times a column of ones, accumulated into
    l * alpha exactly as acc is), not tl.sum: tl.sum's order follows the register layout, which follows the
    tile's rows and warps, while an MMA's K order does not (the H200 probe, tile_choice.py). With it the
    q-block size and the warps may change without changing a row's bits; and l sums the very weights
    (rounded p) that weigh acc."""
    ENTRY: tl.constexpr = L + R
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, BLOCK_R)
    m = tl.full([BM], float("-inf"), dtype=tl.float32)
    lsum = tl.zeros([BM], dtype=tl.float32)
    l16 = tl.zeros([BM, 16], dtype=tl.float32)  # ROWSUM_MMA: 16 equal columns (tl.dot needs N >= 16)
    acc = tl.zeros([BM, L], dtype=tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < stop
        blk = tl.load(trow_ptr + offs_n // PAGE, mask=nmask, other=0)
        slot = blk.to(tl.int64) * PAGE + offs_n % PAGE
        kv = tl.load(cache_ptr + slot[:, None] * ENTRY + offs_l[None, :], mask=nmask[:, None], other=0.0)
        kpe = tl.load(cache_ptr + slot[:, None] * ENTRY + L + offs_r[None, :],
                      mask=nmask[:, None] & (offs_r < R)[None, :], other=0.0)
        qk = mma(q_lat, tl.trans(kv), tl.zeros([BM, BLOCK_N], dtype=tl.float32), UPCAST, PREC)
        qk = mma(q_pe, tl.trans(kpe), qk, UPCAST, PREC)
        seen = nmask[None, :] & (offs_n[None, :] <= pos[:, None])
        s = tl.where(seen, qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        pr = p.to(kv.dtype)
        if ROWSUM_MMA:
            ones = tl.full([BLOCK_N, 16], 1.0, dtype=kv.dtype)
            l16 = mma(pr, ones, l16 * alpha[:, None], UPCAST, PREC)
        else:
            lsum = lsum * alpha + tl.sum(p, 1)
        acc = mma(pr, kv, acc * alpha[:, None], UPCAST, PREC)
        m = m_new
    if ROWSUM_MMA:
        lsum = tl.max(l16, 1)  # the columns are equal: the max picks one, exactly
    return m, lsum, acc


@triton.jit
def _fold(m_r, l_r, acc_r, m_s, l_s, acc_s):
    """Fold split state s into the running state (left to right; an empty split is an exact no-op)."""
    m_new = tl.maximum(m_r, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m_r - m_safe)
    b = tl.exp2(m_s - m_safe)
    return m_new, l_r * a + l_s * b, acc_r * a[:, None] + acc_s * b[:, None]


@triton.jit
def _store_out(out_ptr, tok, head, valid, lsum, acc, stride_ot, stride_oh, L: tl.constexpr):
    out = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]  # an empty row gets zeros
    offs_l = tl.arange(0, L)
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_l[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _mla_onestage_kernel(
    q_ptr, qpe_ptr, cache_ptr, table_ptr, qb_tok_ptr, qb_len_ptr, qb_req_ptr, qb_pos_ptr, seq_lens_ptr, out_ptr,
    H, stride_qt, stride_qh, stride_pt, stride_ph, stride_tb, stride_ot, stride_oh, scale_log2,
    L: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    DECODE: tl.constexpr, ROWSUM_MMA: tl.constexpr,
):
    qb = tl.program_id(0)
    hb = tl.program_id(1)
    BM: tl.constexpr = BLOCK_Q * BLOCK_H
    tok, head, valid, pos, req, kv_end = _rows(qb, hb, qb_tok_ptr, qb_len_ptr, qb_req_ptr, qb_pos_ptr, seq_lens_ptr,
                                               H, BLOCK_Q, BLOCK_H, DECODE)
    q_lat, q_pe = _load_q(q_ptr, qpe_ptr, tok, head, valid, stride_qt, stride_qh, stride_pt, stride_ph,
                          L, R, BLOCK_R, UPCAST)
    trow = table_ptr + req * stride_tb
    m_r = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_r = tl.zeros([BM], dtype=tl.float32)
    acc_r = tl.zeros([BM, L], dtype=tl.float32)
    for start in range(0, kv_end, SPLIT):
        stop = tl.minimum(start + SPLIT, kv_end)
        m_s, l_s, acc_s = _split_state(q_lat, q_pe, cache_ptr, trow, pos, start, stop, scale_log2,
                                       L, R, BLOCK_R, PAGE, BM, BLOCK_N, UPCAST, PREC, ROWSUM_MMA)
        m_r, l_r, acc_r = _fold(m_r, l_r, acc_r, m_s, l_s, acc_s)
    _store_out(out_ptr, tok, head, valid, l_r, acc_r, stride_ot, stride_oh, L)


@triton.jit
def _load_state(part_m_ptr, part_l_ptr, part_acc_ptr, base, BM: tl.constexpr, L: tl.constexpr):
    """A split's (m, l, acc), written by another program of this launch: read through L2 (.cg)."""
    r = tl.arange(0, BM)
    m_s = tl.load(part_m_ptr + base * BM + r, cache_modifier=".cg")
    l_s = tl.load(part_l_ptr + base * BM + r, cache_modifier=".cg")
    acc_s = tl.load(part_acc_ptr + (base * BM + r)[:, None] * L + tl.arange(0, L)[None, :], cache_modifier=".cg")
    return m_s, l_s, acc_s


@triton.jit
def _mla_split_kernel(
    q_ptr, qpe_ptr, cache_ptr, table_ptr, qb_tok_ptr, qb_len_ptr, qb_req_ptr, qb_pos_ptr, seq_lens_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, cnt_ptr, out_ptr,
    H, stride_qt, stride_qh, stride_pt, stride_ph, stride_tb, stride_ot, stride_oh, scale_log2,
    L: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    DECODE: tl.constexpr, ROWSUM_MMA: tl.constexpr,
):
    """Program (q-block, head block, split s) writes split s's (m, l, acc) in fp32 (exact); the q-block's last
    split to finish (an arrival counter: counters.py) folds all of them in split order and writes the output,
    as the one-stage kernel would. An empty q-block (a padded graph row: no valid rows) writes nothing, as in
    the one-stage kernel."""
    qb = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    BM: tl.constexpr = BLOCK_Q * BLOCK_H
    tok, head, valid, pos, req, kv_end = _rows(qb, hb, qb_tok_ptr, qb_len_ptr, qb_req_ptr, qb_pos_ptr, seq_lens_ptr,
                                               H, BLOCK_Q, BLOCK_H, DECODE)
    start = s * SPLIT
    row_base = (qb * tl.num_programs(1) + hb).to(tl.int64) * tl.num_programs(2)
    if start < kv_end:  # a split past the block's end writes nothing; the fold never reads it
        q_lat, q_pe = _load_q(q_ptr, qpe_ptr, tok, head, valid, stride_qt, stride_qh, stride_pt, stride_ph,
                              L, R, BLOCK_R, UPCAST)
        stop = tl.minimum(start + SPLIT, kv_end)
        m_s, l_s, acc_s = _split_state(q_lat, q_pe, cache_ptr, table_ptr + req * stride_tb, pos, start, stop,
                                       scale_log2, L, R, BLOCK_R, PAGE, BM, BLOCK_N, UPCAST, PREC, ROWSUM_MMA)
        base = row_base + s
        r = tl.arange(0, BM)
        tl.store(part_m_ptr + base * BM + r, m_s)
        tl.store(part_l_ptr + base * BM + r, l_s)
        tl.store(part_acc_ptr + (base * BM + r)[:, None] * L + tl.arange(0, L)[None, :], acc_s)
        tl.debug_barrier()  # every thread's partial stores happen before the (acq_rel, gpu-scope) increment
        cnt = cnt_ptr + qb * tl.num_programs(1) + hb
        used = tl.cdiv(kv_end, SPLIT)
        if tl.atomic_add(cnt, 1) == used - 1:
            tl.atomic_xchg(cnt, 0)
            m_r = tl.full([BM], float("-inf"), dtype=tl.float32)
            l_r = tl.zeros([BM], dtype=tl.float32)
            acc_r = tl.zeros([BM, L], dtype=tl.float32)
            for j in range(used):
                m_j, l_j, acc_j = _load_state(part_m_ptr, part_l_ptr, part_acc_ptr, row_base + j, BM, L)
                m_r, l_r, acc_r = _fold(m_r, l_r, acc_r, m_j, l_j, acc_j)
            _store_out(out_ptr, tok, head, valid, l_r, acc_r, stride_ot, stride_oh, L)
