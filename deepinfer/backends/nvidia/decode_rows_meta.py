"""`decode_rows_meta` in one Triton kernel: one-token decode rows' table rows, KV slots, lengths and positions.

The op's contract and its torch oracle are backend/native/decode_rows.py. Why a kernel: a captured MTP graph runs
the op before every forward of the pass and of each chain link; as torch ops it is ~20 launches (index_select,
the slot rule's arithmetic, where, casts), each ~1 us of device time and ~1 us of gap in the graph, on a step whose
device time is the critical path once the host has launched it (a k = 5 step at one sequence: ~360 kernels, about
half of them such bookkeeping). One program per row: it reads the row's table row index, position and (for a chain
link) its chain length and the link's index, writes its slot, lengths and position, and copies its table row.
Integers only: the same values as the oracle, bit for bit (conformance/runtime_cases.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_rows_meta_kernel(table_ptr, rows_ptr, pos_ptr, link_ptr, lens_ptr, tables_out_ptr, slots_out_ptr,
                             seq_out_ptr, ctx_out_ptr, pos_out_ptr, W, stride_t, stride_o,
                             M: tl.constexpr, BS: tl.constexpr, HAS_LINK: tl.constexpr, HAS_SEQ: tl.constexpr,
                             HAS_CTX: tl.constexpr, HAS_POS: tl.constexpr, BLOCK_W: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    valid = row >= 0
    r = tl.maximum(row, 0).to(tl.int64)
    pos = tl.load(pos_ptr + i)
    if HAS_LINK:
        link = tl.load(link_ptr)
        live = valid & (link < tl.load(lens_ptr + i))
        pos = pos + tl.where(live, link, 0)
    else:
        live = valid
    if M == 1:
        entry = pos
    else:
        entry = tl.maximum((pos + 1) // M - 1, 0)
    col = entry // BS
    inside = col < W  # (the oracle raises past the table; a live row never is)
    blk = tl.load(table_ptr + r * stride_t + tl.where(inside, col, 0)).to(tl.int64)
    ok = live & inside & (blk >= 0)
    if M > 1:
        ok = ok & ((pos + 1) % M == 0)
    tl.store(slots_out_ptr + i, tl.where(ok, blk * BS + entry % BS, -1))
    if HAS_SEQ:
        tl.store(seq_out_ptr + i, tl.where(valid, pos + 1, 0).to(tl.int32))
    if HAS_CTX:
        tl.store(ctx_out_ptr + i, tl.where(valid, pos, 0).to(tl.int32))
    if HAS_POS:
        tl.store(pos_out_ptr + i, pos)
    for w0 in range(0, W, BLOCK_W):
        offs = w0 + tl.arange(0, BLOCK_W)
        m = offs < W
        tl.store(tables_out_ptr + i * stride_o + offs, tl.load(table_ptr + r * stride_t + offs, mask=m), mask=m)


def decode_rows_meta(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, tokens_per_entry: int,
                     block_size: int, tables_out: torch.Tensor, slots_out: torch.Tensor,
                     seq_lens_out: torch.Tensor | None = None, context_lens_out: torch.Tensor | None = None,
                     positions_out: torch.Tensor | None = None, link: torch.Tensor | None = None,
                     lens: torch.Tensor | None = None) -> None:
    """Backend.decode_rows_meta (backend/native/decode_rows.py) as one launch of n programs."""
    n = rows.shape[0]
    if n == 0:
        return
    w = table.shape[1]
    if tables_out.shape[1] != w or table.stride(1) != 1 or tables_out.stride(1) != 1:
        raise ValueError(f"decode_rows_meta: tables_out {tuple(tables_out.shape)} must have the table's {w} "
                         "columns, both row-major")
    if (link is None) != (lens is None):
        raise ValueError("decode_rows_meta: link and lens come together (a chain link) or not at all")
    dummy = slots_out  # never read nor written where its flag is off
    _decode_rows_meta_kernel[(n,)](
        table, rows, positions, link if link is not None else dummy, lens if lens is not None else dummy,
        tables_out, slots_out, seq_lens_out if seq_lens_out is not None else dummy,
        context_lens_out if context_lens_out is not None else dummy,
        positions_out if positions_out is not None else dummy, w, table.stride(0), tables_out.stride(0),
        M=tokens_per_entry, BS=block_size, HAS_LINK=link is not None, HAS_SEQ=seq_lens_out is not None,
        HAS_CTX=context_lens_out is not None, HAS_POS=positions_out is not None,
        BLOCK_W=min(256, triton.next_power_of_2(max(w, 1))), num_warps=1)
