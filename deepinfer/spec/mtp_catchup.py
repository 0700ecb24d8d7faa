"""MTP-KV catch-up after an adaptive pause: the MTP layer's KV of the positions decoded while drafting was paused.

Why. The MTP module attends over its own KV cache (spec/mtp_drafter.py), written by each step's pass. While the
confidence scheduler pauses drafting (spec/draft_slots.py: no slot pays at this load), no pass runs, so the
positions decoded in the pause would hold no MTP KV: whatever the block held before (zeros, or another sequence's
entries from a reused block). Drafts after the pause attend over those holes; on the embedded model the probe
drafts' first-slot acceptance fell from ~0.85 to 0.14-0.58, so a load that would pay again was judged not to.

How. During a pause the decode rows' final hidden states are kept (one copy per paused step of the rows that
decoded, `keep`); prompt chunks in a pause still get their MTP pass at once (a prefill's pass is the efficient
shape, and a prompt would otherwise be a hole of its whole length). The first drafting step after the pause runs
its pass over each sequence's kept rows followed by its own (`plan`): one MTP forward of those rows as a chunk over
the earlier MTP KV, exactly the positions and inputs the per-step passes would have used, so the cache holds what
it would have without the pause (up to the summation order of a chunk vs one-row forwards).

Bounded: at most `max_rows` kept rows (their hidden states stay allocated until the catch-up); a pause whose rows
reach it ends early (the caller then drafts again, and the catch-up frees them). A sequence preempted, recomputed
or otherwise not contiguous with its kept rows loses them (its recompute's pass rebuilds its MTP KV).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.sched.request import Sequence
from deepinfer.spec.mtp_drafter import MTPRows
from deepinfer.worker.transfer import tensor_to


@dataclass
class _Kept:
    seq: Sequence
    first_position: int
    refs: list[tuple[int, int]] = field(default_factory=list)  # (block, row in block) per position from first

    @property
    def next_position(self) -> int:
        return self.first_position + len(self.refs)


class PausedRows:
    """The decode rows of paused steps, by sequence, until the next drafting step's pass takes them."""

    def __init__(self, max_rows: int = 4096):
        if max_rows < 1:
            raise ValueError(f"PausedRows needs max_rows >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.blocks: list[torch.Tensor] = []
        self.kept: dict[str, _Kept] = {}
        self.num_rows = 0
        self.num_caught_up = 0  # rows replayed by catch-up passes (engine life)

    def __len__(self) -> int:
        return self.num_rows

    def keep(self, rows: list[tuple[Sequence, int, int]], hidden: torch.Tensor) -> bool:
        """rows: (sequence, row in hidden, position) of a paused step's decodes. Copies those rows (hidden may be
        a graph's output buffer, rewritten by the next replay). False when the kept rows reached max_rows."""
        if rows:
            block = hidden.index_select(0, tensor_to([r for _, r, _ in rows], torch.int64, hidden.device))
            b = len(self.blocks)
            self.blocks.append(block)
            for j, (seq, _, position) in enumerate(rows):
                k = self.kept.get(seq.seq_id)
                if k is None or k.seq is not seq or k.next_position != position:
                    k = self.kept[seq.seq_id] = _Kept(seq, position)
                k.refs.append((b, j))
            self.num_rows += len(rows)
        return self.num_rows < self.max_rows

    def drop(self, seq: Sequence) -> None:
        """Forget a sequence's kept rows (a prompt chunk or recompute: its pass covers its positions)."""
        self.kept.pop(seq.seq_id, None)

    def clear(self) -> None:
        self.blocks, self.kept, self.num_rows = [], {}, 0

    def plan(self, rows: list[MTPRows], seqs: list[Sequence], hidden: torch.Tensor) -> tuple[torch.Tensor,
                                                                                            list[MTPRows]]:
        """The drafting step's pass with every sequence's kept rows in front of its own: (hidden rows [T', D] in
        the new row order, the MTPRows over them). rows[i] belongs to seqs[i]. Clears the kept rows."""
        if not self.kept:  # nothing to replay (none kept, or every kept sequence dropped): free the copies
            self.clear()
            return hidden, rows
        stacked = torch.cat(self.blocks) if len(self.blocks) > 1 else self.blocks[0]
        offsets = [0]
        for b in self.blocks[:-1]:
            offsets.append(offsets[-1] + b.shape[0])
        base = stacked.shape[0]
        index: list[int] = []
        out: list[MTPRows] = []
        for item, seq in zip(rows, seqs):
            k = self.kept.get(seq.seq_id)
            start = len(index)
            if k is not None and k.seq is seq and k.next_position == item.context_len and item.count > 0:
                index.extend(offsets[b] + j for b, j in k.refs)
                # the token after each kept position: positions first + 1 .. context_len (the step's first input)
                ahead = seq.token_ids_slice(k.first_position + 1, item.context_len + 1)
                index.extend(range(base + item.start, base + item.start + item.count))
                out.append(MTPRows(start, len(k.refs) + item.count, ahead + list(item.next_ids), k.first_position,
                                   item.drafts, item.state_row))
                self.num_caught_up += len(k.refs)
            else:
                index.extend(range(base + item.start, base + item.start + item.count))
                out.append(MTPRows(start, item.count, item.next_ids, item.context_len, item.drafts, item.state_row))
        merged = torch.cat([stacked, hidden]).index_select(0, tensor_to(index, torch.int64, hidden.device))
        self.clear()
        return merged, out
