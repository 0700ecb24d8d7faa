"""Paged KV cache bookkeeping across several KV groups (V3: one group; V4: a hybrid of several).

Each KVCacheSpec group gets its own BlockPool and each sequence a block table
per group. How many blocks a sequence needs follows from the spec alone:
  - full groups: ceil(entries / block_size), entries = tokens // tokens_per_entry
    (tokens_per_entry = 1 for ordinary attention, m for compressed groups);
  - sliding-window groups: the same table, but blocks wholly older than
    first_live_entry() go back to the pool and their table entries become -1;
  - groups with state_shape: one row of a slot pool of max_num_seqs rows per
    sequence (one row index shared by every such group).
Admission needs every group to fit, so accounting never drifts between groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from deepinfer.core.block_pool import BlockPool, SlotPool
from deepinfer.core.kv_spec import KVCacheSpec
from deepinfer.errors import DeepInferError


class KVUser(Protocol):
    """What the manager needs to know about a sequence."""

    seq_id: str
    num_computed_tokens: int


@dataclass
class SeqBlocks:
    tables: dict[str, list[int]]
    trimmed: dict[str, int]  # leading table entries already returned to the pool (sliding groups)
    state_slot: int = -1
    num_tokens: int = 0  # tokens the tables cover
    room: int = 0  # most tokens the tables hold before any group needs another block


@dataclass
class KVPlan:
    """How many blocks each group gets, and what that holds."""

    num_blocks: dict[str, int]
    capacity_tokens: int
    bytes_total: int
    state_rows: int = 0
    notes: list[str] = field(default_factory=list)


def bytes_per_token(specs: list[KVCacheSpec]) -> float:
    """KV bytes that grow with context length, per token, summed over groups (windows excluded)."""
    return sum(s.bytes_per_token() for s in specs)


def fixed_bytes_per_seq(specs: list[KVCacheSpec]) -> int:
    """Bytes a long sequence holds regardless of its length: sliding windows plus per-sequence state."""
    total = 0
    for s in specs:
        if s.sliding_window is not None:
            total += math.ceil(s.sliding_window / s.tokens_per_entry) * s.bytes_per_entry()
        total += s.state_bytes_per_seq()
    return total


def _window_blocks_per_seq(spec: KVCacheSpec, block_size: int, chunk_tokens: int) -> int:
    """Worst-case live blocks of one sequence in a sliding group while a chunk of chunk_tokens runs."""
    live_entries = math.ceil((spec.sliding_window - 1 + chunk_tokens) / spec.tokens_per_entry) + 1
    return math.ceil(live_entries / block_size) + 1


def _compressed_blocks(spec: KVCacheSpec, block_size: int, max_num_seqs: int, max_model_len: int, capacity: int) -> int:
    """Most blocks that up to max_num_seqs sequences holding `capacity` tokens in all can hold in a compressed group.

    A sequence of t tokens holds ceil((t // m) / block_size) blocks: its last block is
    partly empty, and one block covers block_size * m tokens (256 for HCA m=16 at block
    size 16), so sizing by tokens alone (capacity // (m * block_size)) starves the group
    of blocks when many short sequences run. The worst case is each sequence one entry
    past a block boundary: max_num_seqs first blocks, then one block per block_size of
    the remaining entries. Never more than max_num_seqs sequences of max_model_len hold.
    """
    entries = capacity // spec.tokens_per_entry
    worst = max_num_seqs + max(0, entries - max_num_seqs) // block_size
    most = max_num_seqs * math.ceil((max_model_len // spec.tokens_per_entry) / block_size)
    return max(1, min(worst, most))


def _is_compressed(spec: KVCacheSpec) -> bool:
    return spec.tokens_per_entry > 1 and spec.sliding_window is None


def plan_kv_cache(
    specs: list[KVCacheSpec],
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    budget_bytes: int | None = None,
    num_kv_blocks: int | None = None,
) -> KVPlan:
    """Size every group's pool for a common token capacity C.

    num_kv_blocks fixes C = num_kv_blocks * block_size (so a V3 model gets exactly
    that many blocks); otherwise C is the largest capacity whose blocks, plus the
    per-sequence state rows, fit in budget_bytes.
    - full groups (one entry per token): ceil(C / block_size) blocks;
    - sliding groups never need more than max_num_seqs windows (plus one chunk), so
      they are capped there;
    - compressed groups (m tokens per entry) get enough blocks that ANY max_num_seqs
      sequences holding C tokens together fit (see _compressed_blocks): at least
      max_num_seqs blocks (one partly filled block per sequence) plus the blocks of
      the entries beyond those. Their blocks are small (one per block_size * m tokens),
      so this costs little and the compressed groups never limit admission before the
      token capacity does.
    A budget that cannot hold the state rows plus one block per sequence in every
    compressed group (max_num_seqs minimal sequences) is refused with a DeepInferError.
    """
    if (budget_bytes is None) == (num_kv_blocks is None):
        raise ValueError("give exactly one of budget_bytes and num_kv_blocks")
    has_state = any(s.state_shape for s in specs)
    state_rows = max_num_seqs if has_state else 0
    state_bytes = max_num_seqs * sum(s.state_bytes_per_seq() for s in specs)
    block_bytes = {s.name: block_size * s.bytes_per_entry() for s in specs}
    max_tokens = max_num_seqs * max_model_len

    def blocks(spec: KVCacheSpec, capacity: int) -> int:
        if _is_compressed(spec):
            return _compressed_blocks(spec, block_size, max_num_seqs, max_model_len, capacity)
        n = math.ceil(math.ceil(capacity / spec.tokens_per_entry) / block_size)
        if spec.sliding_window is not None:
            cap = max_num_seqs * _window_blocks_per_seq(spec, block_size, 1)
            cap += _window_blocks_per_seq(spec, block_size, max_num_batched_tokens)
            n = min(n, cap)
        return max(n, 1)

    def cost(capacity: int) -> int:
        return sum(blocks(s, capacity) * block_bytes[s.name] for s in specs) + state_bytes

    if num_kv_blocks is not None:
        capacity = num_kv_blocks * block_size
    else:
        if cost(1) > budget_bytes:
            comp = sum(blocks(s, 1) * block_bytes[s.name] for s in specs if _is_compressed(s))
            if comp or state_bytes:
                what = (f"max_num_seqs={max_num_seqs} minimal sequences: they need {cost(1)} bytes (state rows "
                        f"{state_bytes}, one block each in the compressed groups {comp}, one block of every other "
                        f"group {cost(1) - state_bytes - comp}). Lower max_num_seqs or raise")
            else:
                what = f"one block of every KV group ({cost(1)} bytes). Raise"
            raise DeepInferError(f"KV cache budget of {budget_bytes} bytes cannot hold {what} "
                                 "kv_cache_memory_bytes / gpu_memory_utilization")
        lo, hi = 1, max_tokens  # cost(lo) fits
        if cost(hi) <= budget_bytes:
            lo = hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost(mid) <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        capacity = lo
    num_blocks = {s.name: blocks(s, capacity) for s in specs}
    if num_kv_blocks is not None:
        for s in specs:
            if s.tokens_per_entry == 1 and s.sliding_window is None:
                num_blocks[s.name] = num_kv_blocks
    # Report what the full groups really hold (whole blocks), else the planned capacity.
    held = [num_blocks[s.name] * block_size for s in specs if s.tokens_per_entry == 1 and s.sliding_window is None]
    capacity = min(held) if held else min(capacity, max_tokens)
    total = sum(num_blocks[s.name] * block_bytes[s.name] for s in specs) + state_bytes
    return KVPlan(num_blocks=num_blocks, capacity_tokens=capacity, bytes_total=total, state_rows=state_rows)


class KVCacheManager:
    """Block tables and pools for all KV groups of one model.

    Each sequence holding blocks also holds a row (0..max_num_seqs-1): its index into
    the per-sequence state pools and into `tables`, a [max_num_seqs, width] int32 host
    buffer per group mirroring the block tables, so a batch's tables are one gather.
    """

    def __init__(
        self,
        specs: list[KVCacheSpec],
        num_blocks: dict[str, int],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
    ):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise DeepInferError(f"KV group names must be unique, got {names}")
        self.specs = list(specs)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.pools = {s.name: BlockPool(num_blocks[s.name], s.name) for s in specs}
        self.slots = SlotPool(max_num_seqs, "rows")
        self.uses_state = any(s.state_shape for s in specs)
        self._has_windows = any(s.sliding_window is not None for s in specs)
        self.tables = {
            s.name: torch.full((max_num_seqs, max(1, self.table_len(s, max_model_len))), -1, dtype=torch.int32)
            for s in specs
        }
        self._seqs: dict[str, SeqBlocks] = {}

    # ------------------------------------------------------------ sizes

    def table_len(self, spec: KVCacheSpec, num_tokens: int) -> int:
        """Table entries needed once num_tokens tokens are cached."""
        return -(-(num_tokens // spec.tokens_per_entry) // self.block_size)

    def dead_blocks(self, spec: KVCacheSpec, num_tokens: int) -> int:
        """Leading table entries no longer read when the next token is at position num_tokens."""
        if spec.sliding_window is None:
            return 0
        return spec.first_live_entry(num_tokens) // self.block_size

    def fits_alone(self, num_tokens: int, chunk_tokens: int) -> list[str]:
        """Reasons a single sequence of num_tokens (computed in chunks of chunk_tokens) cannot fit."""
        reasons = []
        for s in self.specs:
            if s.sliding_window is None:
                need = self.table_len(s, num_tokens)
            else:
                need = min(self.table_len(s, num_tokens), _window_blocks_per_seq(s, self.block_size, chunk_tokens))
            if need > self.pools[s.name].num_blocks:
                reasons.append(f"group {s.name!r} needs {need} blocks, has {self.pools[s.name].num_blocks}")
        return reasons

    # ------------------------------------------------------------ per sequence

    def _new_blocks(self, sb: SeqBlocks | None, ctx: int, total: int) -> dict[str, int]:
        """Blocks each group must add (new minus window blocks freed first)."""
        out = {}
        for s in self.specs:
            table = sb.tables[s.name] if sb else ()
            new = max(0, self.table_len(s, total) - len(table))
            if s.sliding_window is not None and sb is not None:
                dead = min(self.dead_blocks(s, ctx), len(table))
                new -= sum(1 for b in table[sb.trimmed[s.name] : dead] if b >= 0)
            out[s.name] = new
        return out

    def _needs(self, sb: SeqBlocks | None, ctx: int, total: int) -> dict[str, int] | None:
        """Blocks each group must add; None if some pool (or the row pool) is short."""
        out = self._new_blocks(sb, ctx, total)
        if not self.fits(out) or (sb is None and self.slots.num_free < 1):
            return None
        return out

    def fits(self, need: dict[str, int]) -> bool:
        """Whether every group has `need[group]` free blocks."""
        return all(n <= self.pools[g].num_free for g, n in need.items())

    def blocks_needed(self, seq: KVUser, num_new_tokens: int) -> dict[str, int]:
        """Blocks per group the next num_new_tokens of seq take (net of window blocks it frees);
        {} on the decode fast path. The scheduler sums these to see whether a step must preempt."""
        ctx = seq.num_computed_tokens
        sb = self._seqs.get(seq.seq_id)
        if sb is not None and not self._has_windows and ctx + num_new_tokens <= sb.room:
            return {}
        return self._new_blocks(sb, ctx, ctx + num_new_tokens)

    def can_allocate(self, seq: KVUser, num_new_tokens: int) -> bool:
        """Whether every group (and the row pool) can take this sequence's next tokens."""
        ctx = seq.num_computed_tokens
        return self._needs(self._seqs.get(seq.seq_id), ctx, ctx + num_new_tokens) is not None

    def try_extend(self, seq: KVUser, num_new_tokens: int) -> bool:
        """The decode fast path: cover the next tokens when no group needs a block or frees one.

        True when done (what allocate would do); False when allocate must run (new blocks, a
        window to trim, or a sequence holding nothing yet). Costs O(1), not O(groups).
        """
        if self._has_windows:
            return False
        sb = self._seqs.get(seq.seq_id)
        total = seq.num_computed_tokens + num_new_tokens
        if sb is None or total > sb.room or total > self.max_model_len:
            return False
        if total > sb.num_tokens:
            sb.num_tokens = total
        return True

    def allocate(self, seq: KVUser, num_new_tokens: int) -> None:
        """Grow the tables to cover num_computed_tokens + num_new_tokens; frees dead window blocks first."""
        ctx = seq.num_computed_tokens
        total = ctx + num_new_tokens
        sb = self._seqs.get(seq.seq_id)
        if self._needs(sb, ctx, total) is None:
            raise DeepInferError(f"KV cache cannot take {num_new_tokens} tokens of {seq.seq_id!r}: check can_allocate first")
        if total > self.max_model_len:
            raise DeepInferError(f"{seq.seq_id!r} would hold {total} tokens, beyond max_model_len={self.max_model_len}")
        if sb is None:
            sb = SeqBlocks(tables={s.name: [] for s in self.specs}, trimmed={s.name: 0 for s in self.specs})
            sb.state_slot = self.slots.allocate(1)[0]
            self._seqs[seq.seq_id] = sb
        self._trim(sb, ctx)
        for s in self.specs:
            table = sb.tables[s.name]
            new = self.table_len(s, total) - len(table)
            if new > 0:
                blocks = self.pools[s.name].allocate(new)
                self.tables[s.name][sb.state_slot, len(table) : len(table) + new] = torch.tensor(blocks, dtype=torch.int32)
                table.extend(blocks)
        sb.num_tokens = max(sb.num_tokens, total)
        # table_len(s, t) <= len(table) while t // m <= len(table) * block_size
        sb.room = min(
            (len(sb.tables[s.name]) * self.block_size + 1) * s.tokens_per_entry - 1 for s in self.specs
        )

    def trim(self, seq: KVUser) -> None:
        """Return sliding-window blocks no longer read once num_computed_tokens tokens are cached."""
        if not self._has_windows:
            return
        sb = self._seqs.get(seq.seq_id)
        if sb is not None:
            self._trim(sb, seq.num_computed_tokens)

    def _trim(self, sb: SeqBlocks, num_tokens: int) -> None:
        for s in self.specs:
            if s.sliding_window is None:
                continue
            table = sb.tables[s.name]
            dead = min(self.dead_blocks(s, num_tokens), len(table))
            for i in range(sb.trimmed[s.name], dead):
                if table[i] >= 0:
                    self.pools[s.name].free([table[i]])
                    table[i] = -1
                    self.tables[s.name][sb.state_slot, i] = -1
            sb.trimmed[s.name] = max(sb.trimmed[s.name], dead)

    def free(self, seq: KVUser | str) -> None:
        """Return every block and the row of a sequence (finish, abort or preemption)."""
        seq_id = seq if isinstance(seq, str) else seq.seq_id
        sb = self._seqs.pop(seq_id, None)
        if sb is None:
            return
        for s in self.specs:
            self.pools[s.name].free(sb.tables[s.name])
            self.tables[s.name][sb.state_slot].fill_(-1)
        self.slots.free([sb.state_slot])

    def block_table(self, seq_id: str, group: str) -> list[int]:
        return self._seqs[seq_id].tables[group]

    def state_slot(self, seq_id: str) -> int:
        """The sequence's row: in the state pools and in `tables`; -1 when it holds nothing."""
        sb = self._seqs.get(seq_id)
        return -1 if sb is None else sb.state_slot

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    # ------------------------------------------------------------ accounting

    @property
    def num_blocks_total(self) -> int:
        return sum(p.num_blocks for p in self.pools.values())

    @property
    def num_blocks_used(self) -> int:
        return sum(p.num_used for p in self.pools.values())

    def usage(self) -> float:
        """Fraction used of the fullest group: the one that limits admission."""
        fracs = [p.num_used / p.num_blocks for p in self.pools.values() if p.num_blocks]
        return max(fracs, default=0.0)

    def usage_by_group(self) -> dict[str, tuple[int, int]]:
        return {name: (p.num_used, p.num_blocks) for name, p in self.pools.items()}
