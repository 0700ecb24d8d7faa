"""MTP-KV catch-up after an adaptive pause: the MTP layer's KV of the positions decoded while drafting was paused.

Why. The MTP module attends over its own KV cache (spec/mtp_drafter.py), written by each step's pass. While the
confidence scheduler pauses drafting (spec/slot_policy.py: no slot pays at this load), no pass runs, so the
positions decoded in the pause would hold no MTP KV: whatever the block held before (zeros, or another sequence's
entries from a reused block). Drafts after the pause attend over those holes; on the embedded model the probe
drafts' first-slot acceptance fell from ~0.85 to 0.14-0.58, so a load that would pay again was judged not to.

How. A step's decode rows that get no MTP pass (a pause, or the sequences a probe does not draft for) have their
final hidden states kept (one copy per step of those rows, `keep`); prompt chunks always get their pass at once (a
prefill's pass is the efficient shape, and a prompt would otherwise be a hole of its whole length). A sequence's
next pass runs over its kept rows followed by its own (`plan`): one MTP forward of those rows as a chunk over the
earlier MTP KV, exactly the positions and inputs the per-step passes would have used, so the cache holds what it
would have without the pause (up to the summation order of a chunk vs one-row forwards).

Bounded: at most `max_rows` rows held (a step's copy is freed once every sequence in it has caught up or lost its
rows); past that the oldest step's rows are dropped and those positions stay holes (counted: num_dropped). A
sequence preempted, recomputed or otherwise not contiguous with its kept rows loses them (its recompute's pass
rebuilds its MTP KV).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from deepinfer.sched.request import SeqStatus, Sequence
from deepinfer.spec.draft_slots import length_cap
from deepinfer.spec.mtp_drafter import MTPRows
from deepinfer.worker.transfer import tensor_to


@dataclass
class _Kept:
    seq: Sequence
    first_position: int
    refs: deque[tuple[int, int]] = field(default_factory=deque)  # (block, row in block) per position from first

    @property
    def next_position(self) -> int:
        return self.first_position + len(self.refs)


class PausedRows:
    """Decode rows that got no MTP pass, by sequence, until that sequence's next pass takes them."""

    def __init__(self, max_rows: int = 4096):
        if max_rows < 1:
            raise ValueError(f"PausedRows needs max_rows >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.blocks: dict[int, torch.Tensor] = {}  # step copies by age (insertion order = age)
        self.live: dict[int, int] = {}  # block -> its rows still kept by some sequence
        self.members: dict[int, list[str]] = {}  # block -> the sequences it holds a row of (one row each)
        self.kept: dict[str, _Kept] = {}
        self.num_rows = 0  # rows allocated in blocks (the cap's measure)
        self.num_caught_up = 0  # rows replayed by passes (engine life)
        self.num_dropped = 0  # rows dropped at the cap (their positions stay holes)
        self._next_block = 0

    def __len__(self) -> int:
        return self.num_rows

    def worth_keeping(self, num_rows: int, steps_left: int) -> bool:
        """Whether a step's num_rows rows could still be held when a pause with steps_left steps (this one included)
        ends: later steps keep as many each, and past max_rows the oldest go. Rows that would be dropped unread are
        not copied: at 256 sequences a pause of 1024 steps keeps only its last 16 steps' rows, and keeping (then
        dropping) every step's cost ~0.25 ms of host time a step on this CPU (2026-12-04), an adaptive pause's
        plain steps ran 0.82x of an off engine's on the H200 (dbb32fd)."""
        return num_rows * max(steps_left, 1) <= self.max_rows

    @staticmethod
    def all_finish_within(seqs, steps: int, max_model_len: int) -> bool:
        """Whether every sequence reaches max_tokens or max_model_len within `steps` more decode steps (one token a
        step, as in a pause): then their rows kept now would be read by no pass once the pause ends, and are not
        copied. On the H200 (2026-12-04, ebe384a) the adaptive engine's paused steps ran 0.79-0.87x of an off
        engine's at 4-16 sequences, ~150 us of host time a step, a part of it copying rows that the benchmark's
        128-token requests never read (their pauses last 32-1024 steps). Where a pause ends early (a fall in load),
        such a sequence drafts over the positions not kept (lower acceptance for its last tokens), as past max_rows."""
        # length_cap: the tokens a sequence may still emit, less one (pending tokens not counted: a longer reach,
        # which only keeps rows)
        return all(length_cap(seq, max_model_len) + 1 <= steps for seq in seqs)

    def keep(self, rows: list[tuple[Sequence, int, int]], hidden: torch.Tensor) -> None:
        """rows: (sequence, row in hidden, position) of a step's rows that get no pass, a sequence's in position
        order. Copies those rows (hidden may be a graph's output buffer, rewritten by the next replay).

        Runs on every paused step, so it is kept lean (an adaptive engine's pause steps paid ~0.1 ms of host time
        per step at 64 sequences here): a step whose rows are hidden's first rows in order (every paused decode
        step) is one slice copy, no index tensor; the per-row work is a dict lookup and an append."""
        if not rows:
            return
        n = len(rows)
        if rows[0][1] == 0 and rows[-1][1] == n - 1 and all(r == j for j, (_, r, _) in enumerate(rows)):
            block = hidden[:n].clone()
        else:
            block = hidden.index_select(0, tensor_to([r for _, r, _ in rows], torch.int64, hidden.device))
        b = self._next_block
        self._next_block += 1
        self.blocks[b], self.live[b] = block, n
        self.num_rows += n
        kept = self.kept
        members = []
        for j, (seq, _, position) in enumerate(rows):
            sid = seq.seq_id
            k = kept.get(sid)
            if k is None or k.seq is not seq or k.first_position + len(k.refs) != position:
                if k is not None:
                    self._release(k.refs)
                k = kept[sid] = _Kept(seq, position)
            k.refs.append((b, j))
            members.append(sid)
        self.members[b] = members
        while self.num_rows > self.max_rows:
            self._drop_oldest()

    def prune(self) -> None:
        """Forget the rows of finished sequences (an abort between steps finishes one outside any step)."""
        for k in [k for k in self.kept.values() if k.seq.status is SeqStatus.FINISHED]:
            self.drop(k.seq)

    def drop(self, seq: Sequence) -> None:
        """Forget a sequence's kept rows."""
        k = self.kept.pop(seq.seq_id, None)
        if k is not None:
            self._release(k.refs)

    def _release(self, refs) -> None:
        for b, _ in refs:
            self._unref(b)

    def _unref(self, b: int) -> None:
        self.live[b] -= 1
        if self.live[b] == 0:
            self.num_rows -= self.blocks.pop(b).shape[0]
            del self.live[b]
            self.members.pop(b, None)

    def _drop_oldest(self) -> None:
        """Drop the oldest step copy: only the sequences it holds a row of lose their first kept position (a
        sequence's refs are in step order and it has one row per step)."""
        oldest = next(iter(self.blocks))
        for sid in self.members.get(oldest, ()):
            k = self.kept.get(sid)
            if k is None or not k.refs or k.refs[0][0] != oldest:
                continue  # its row there was released already (reset or caught up)
            k.refs.popleft()
            k.first_position += 1
            self.num_dropped += 1
            if not k.refs:
                del self.kept[sid]
            self._unref(oldest)
            if oldest not in self.blocks:
                return
        raise AssertionError(f"PausedRows: step copy {oldest} still has {self.live.get(oldest)} rows that no "
                             "sequence's first position holds")  # the invariant above; never loop on it

    def plan(self, rows: list[MTPRows], seqs: list[Sequence], hidden: torch.Tensor) -> tuple[torch.Tensor,
                                                                                            list[MTPRows]]:
        """A pass with every listed sequence's kept rows in front of its own (those rows are then released):
        (hidden rows [T', D] in the new row order, the MTPRows over them). rows[i] belongs to seqs[i]."""
        merge = []
        for item, seq in zip(rows, seqs):
            k = self.kept.get(seq.seq_id)
            ok = k is not None and k.seq is seq and k.next_position == item.context_len and item.count > 0
            merge.append(k if ok else None)
        if not any(m is not None for m in merge):
            return hidden, rows
        offsets, total = {}, 0
        for b, t in self.blocks.items():
            offsets[b] = total
            total += t.shape[0]
        index: list[int] = []
        out: list[MTPRows] = []
        for item, seq, k in zip(rows, seqs, merge):
            start = len(index)
            if k is not None:
                index.extend(offsets[b] + j for b, j in k.refs)
                # the token after each kept position: positions first + 1 .. context_len (the step's first input)
                ahead = seq.token_ids_slice(k.first_position + 1, item.context_len + 1)
                out.append(MTPRows(start, len(k.refs) + item.count, ahead + list(item.next_ids), k.first_position,
                                   item.drafts, item.state_row))
            else:
                out.append(MTPRows(start, item.count, item.next_ids, item.context_len, item.drafts, item.state_row))
            index.extend(range(total + item.start, total + item.start + item.count))
        merged = torch.cat([*self.blocks.values(), hidden]).index_select(0, tensor_to(index, torch.int64,
                                                                                      hidden.device))
        for seq, k in zip(seqs, merge):
            if k is not None:
                self.num_caught_up += len(k.refs)
                self.drop(seq)
        return merged, out
