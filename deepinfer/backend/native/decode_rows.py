"""The native (torch) `decode_rows_meta` op: one-token decode rows' per-row inputs, from a KV group's tables.

What a captured MTP graph runs before each forward (backend/mtp_graph_runner.py): the pass over a step's verify
rows and every link of the draft chain are one-token decode rows whose table rows, positions and KV slots are only
known on the device (staged rows, the verification's accepted counts, the link's index). As ~20 small torch ops a
forward (this file) each is a kernel launch inside the graph: on the H200 (2026-12-05 trace of a k = 5 step at one
sequence) ~360 kernels a step, about half of them such bookkeeping at ~1 us each plus a ~1 us gap. A backend
replaces the whole op with one kernel (`Backend.decode_rows_meta`); this is the oracle the conformance suite
compares it against (conformance/runtime_cases.py), and what a backend without one runs.
"""

from __future__ import annotations

import torch

from deepinfer.backend.forward_batch import token_slots


def decode_rows_meta(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, tokens_per_entry: int,
                     block_size: int, tables_out: torch.Tensor, slots_out: torch.Tensor,
                     seq_lens_out: torch.Tensor | None = None, context_lens_out: torch.Tensor | None = None,
                     positions_out: torch.Tensor | None = None, link: torch.Tensor | None = None,
                     lens: torch.Tensor | None = None) -> None:
    """Fill the first n rows of the outputs for n one-token decode rows (n = rows.shape[0]), in place.

    table: a KV group's block tables [R, W] int32; rows [n] int64: each row's table row, -1 padding (reads and
    writes nothing); positions [n] int64: each row's position. With `link` ([1] int64, a chain link's index) and
    `lens` ([n] int64, each row's chain length), a valid row is live while link < lens: its position is
    positions + link (a row past its chain recomputes positions[i] and writes nothing); else every valid row is
    live at positions[i]. Outputs: tables_out [>= n, W] int32 (the row's table; row 0's for padding),
    slots_out [>= n] int64 (`token_slots` of a live row, else -1), and where given seq_lens_out /
    context_lens_out [>= n] int32 (position + 1 / position, 0 for padding) and positions_out [>= n] int64 (each
    row's position: with `link`, where the forward reads it)."""
    n = rows.shape[0]
    valid = rows >= 0
    r = rows.clamp(min=0)
    if link is not None:
        live = valid & (link < lens)
        pos = positions + torch.where(live, link, 0)
    else:
        live, pos = valid, positions
    torch.index_select(table, 0, r, out=tables_out[:n])
    slots = token_slots(table, r, pos, tokens_per_entry, block_size)
    torch.where(live, slots, torch.full_like(slots, -1), out=slots_out[:n])
    if seq_lens_out is not None:
        seq_lens_out[:n].copy_(torch.where(valid, pos + 1, 0))
    if context_lens_out is not None:
        context_lens_out[:n].copy_(torch.where(valid, pos, 0))
    if positions_out is not None:
        positions_out[:n].copy_(pos)
