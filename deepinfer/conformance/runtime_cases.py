"""Conformance cases of the runtime ops: `decode_rows_meta` (one-token decode rows' table rows, KV slots, lengths
and positions, derived on the device before each forward of a captured MTP graph: backend/native/decode_rows.py) and
`draft_pick` (a draft and its confidence from the drafter's logits: backend/native/draft_pick.py, below).

Why bitwise: integers only (table entries, slots, lengths, positions), nothing to round: a backend's outputs must
equal the native oracle's exactly. The outputs are prefilled with a sentinel, so a row the op should not touch
(past n) must keep it, and every row it should write must be written.

The cases cover what the MTP graphs hand the op: the pass (positions given, every valid row writes its KV), a chain
link (`link` and `lens`: a row past its chain length recomputes its last position and writes nothing), padded rows
(-1: row 0's table, lengths 0, no slot), table entries of -1 (a window block already returned: no slot), a
compressed group (tokens_per_entry 4: only the token completing an entry writes), rows that share a table row (a
sequence's verify rows), and without the optional length / position outputs.
"""

from __future__ import annotations

import torch

from deepinfer.backend import Backend
from deepinfer.backend.native.decode_rows import decode_rows_meta as native_decode_rows_meta
from deepinfer.backend.native.draft_pick import draft_pick as native_draft_pick
from deepinfer.conformance.cases_base import Case, Inputs, randn

OP = "decode_rows_meta"
SENTINEL = -7  # what the outputs hold before the op: rows past n must keep it


def _case(name: str, n: int, table_rows: int, width: int, block_size: int, *, m: int = 1, pad: int = 0,
          link: int | None = None, holes: int = 0, lengths: bool = True) -> Case:
    """n decode rows over a [table_rows, width] table of a group with block_size and tokens_per_entry m; `pad` of
    the rows padding (-1); with `link` a chain link of that index (chain lengths drawn 0..link + 1); `holes` table
    entries -1."""

    def make(g: torch.Generator, dt: torch.dtype) -> Inputs:
        table = torch.randperm(table_rows * width, generator=g).view(table_rows, width).to(torch.int32)
        if holes:
            flat = table.view(-1)
            flat[torch.randperm(flat.numel(), generator=g)[:holes]] = -1
        rows = torch.randint(0, table_rows, (n,), generator=g)
        rows[torch.randperm(n, generator=g)[:pad]] = -1
        reach = width * block_size * m - 1 - (link or 0)  # every position (and link offset) inside the table
        positions = torch.randint(0, reach, (n,), generator=g)
        inputs: Inputs = {"table": table, "rows": rows, "positions": positions, "link": None, "lens": None}
        if link is not None:
            inputs["link"] = torch.tensor([link], dtype=torch.int64)
            inputs["lens"] = torch.randint(0, link + 2, (n,), generator=g)
        return inputs

    def run(o, i: Inputs) -> tuple[torch.Tensor, ...]:
        dev = i["table"].device
        extra = 3  # rows past n: the op must leave them alone
        tables_out = torch.full((n + extra, width), SENTINEL, dtype=torch.int32, device=dev)
        slots_out = torch.full((n + extra,), SENTINEL, dtype=torch.int64, device=dev)
        seq = torch.full((n + extra,), SENTINEL, dtype=torch.int32, device=dev) if lengths else None
        ctx = torch.full((n + extra,), SENTINEL, dtype=torch.int32, device=dev) if lengths else None
        pos = torch.full((n + extra,), SENTINEL, dtype=torch.int64, device=dev) if lengths else None
        # the oracle (NativeOps alone, not a Backend) has no runtime ops: it calls the native op itself
        op = o.decode_rows_meta if isinstance(o, Backend) else native_decode_rows_meta
        op(i["table"], i["rows"], i["positions"], m, block_size, tables_out, slots_out, seq, ctx, pos, i["link"],
           i["lens"])
        return (tables_out, slots_out) + ((seq, ctx, pos) if lengths else ())

    return Case(OP, name, make, run, compare="bitwise", dtypes=(torch.int32,))


def _pick_case(name: str, b: int, width: int, vocab: int, k: int, *, link: int | None, out: bool = True) -> Case:
    """draft_pick over b rows of logits [b, width] (width >= vocab: a padded head) at the run's dtype; with `out`
    into [b + 2, k] buffers at link's column (None: column 0). The draft ids must equal the oracle's exactly (the
    logits are spread far apart: no two within rounding of each other), the confidences within the dtype's
    tolerance; every other entry keeps its sentinel."""

    def make(g: torch.Generator, dt: torch.dtype) -> Inputs:
        logits = randn(g, b, width, scale=4.0)
        logits[:, vocab:] = 100.0  # past the vocabulary: never a draft
        return {"logits": logits.to(dt), "link": None if link is None else torch.tensor([link], dtype=torch.int64)}

    def run(o, i: Inputs) -> tuple[torch.Tensor, ...]:
        dev = i["logits"].device
        ids = torch.full((b + 2,), SENTINEL, dtype=torch.int64, device=dev)
        conf = torch.full((b + 2,), float(SENTINEL), dtype=torch.float32, device=dev)
        out_ids = torch.full((b + 2, k), SENTINEL, dtype=torch.int64, device=dev) if out else None
        out_conf = torch.full((b + 2, k), float(SENTINEL), dtype=torch.float32, device=dev) if out else None
        op = o.draft_pick if isinstance(o, Backend) else native_draft_pick
        op(i["logits"], vocab, ids, conf, out_ids, out_conf, i["link"])
        return (ids, conf) + ((out_ids, out_conf) if out else ())

    return Case("draft_pick", name, make, run, compare="close")


def runtime_cases(shapes: str) -> list[Case]:
    """The decode-rows cases at "tiny" (CPU CI, TRITON_INTERPRET) or "real" (V2-Lite's 4k context, a wide step)."""
    if shapes == "tiny":
        return [
            _case("pass: n=6, 2 padded, table 5 x 4, block 16", 6, 5, 4, 16, pad=2),
            _case("chain link 3: n=4, 1 padded, lengths 0..4", 4, 3, 4, 16, pad=1, link=3),
            _case("n=5, 3 table entries -1 (returned window blocks)", 5, 2, 6, 4, holes=3),
            _case("compressed group (tokens_per_entry 4): n=8", 8, 4, 3, 4, m=4, pad=1),
            _case("n=1, no length or position outputs", 1, 1, 3, 16, lengths=False),
            _case("table wider than a program's column block: width 300", 3, 2, 300, 2, link=1),
            _pick_case("b=3 V=70 (head padded to 80), link 2 of k=4", 3, 80, 70, 4, link=2),
            _pick_case("b=2 V=3000 (three column blocks), link 7 clamped to k-1=3", 2, 3000, 3000, 4, link=7),
            _pick_case("b=4 V=50, no link: column 0", 4, 50, 50, 3, link=None),
            _pick_case("b=1 V=100, ids and confidences only", 1, 100, 100, 1, link=None, out=False),
        ]
    if shapes == "real":
        return [
            _case("pass over a verify step: n=1536 (256 x 6), 200 padded, 257 columns", 1536, 256, 257, 16, pad=200),
            _case("chain link 4: n=256, 16 padded", 256, 256, 257, 16, pad=16, link=4),
            _pick_case("b=64 V=102400 (V2-Lite), link 3 of k=5", 64, 102400, 102400, 5, link=3),
            _pick_case("b=1 V=129280 (V3)", 1, 129280, 129280, 5, link=None),
        ]
    raise ValueError(f"unknown conformance shapes {shapes!r} (choose 'tiny' or 'real')")
