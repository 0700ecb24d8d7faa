"""KV cache sizing: how many blocks each KV group gets for a memory budget or a block count.

All groups get blocks for a common token capacity C (see `plan_kv_cache`). Bytes per block come
from the backend's layout of each group (`Backend.kv_cache_layout`): the planner counts blocks
and tokens, it never assumes how an entry sits in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deepinfer.backend import KVCacheSpec, KVLayout
from deepinfer.errors import DeepInferError


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


def window_blocks_per_seq(spec: KVCacheSpec, block_size: int, chunk_tokens: int, rollback_tokens: int = 0) -> int:
    """Worst-case live blocks of one sequence in a sliding group while a chunk of chunk_tokens runs, keeping
    rollback_tokens more behind the window (KVCacheManager.window_rollback_tokens)."""
    live_entries = math.ceil((spec.sliding_window - 1 + rollback_tokens + chunk_tokens) / spec.tokens_per_entry) + 1
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
    layouts: dict[str, KVLayout] | None = None,
    snapshot_bytes_per_block: int = 0,
    window_rollback_tokens: int = 0,
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
    layouts: the backend's layout per group (bytes per entry); None: the single-tensor default.
    snapshot_bytes_per_block: prefix caching on V4 keeps a compressor-state snapshot beside every block of
    the sliding-window group (kv/state_snapshots.py); it is counted as part of that group's block.
    window_rollback_tokens: what each sequence keeps behind its sliding window (KVCacheManager's, the same value).
    A budget that cannot hold the state rows plus one block per sequence in every
    compressed group (max_num_seqs minimal sequences) is refused with a DeepInferError.
    """
    if (budget_bytes is None) == (num_kv_blocks is None):
        raise ValueError("give exactly one of budget_bytes and num_kv_blocks")
    has_state = any(s.state_shape for s in specs)
    state_rows = max_num_seqs if has_state else 0
    state_bytes = max_num_seqs * sum(s.state_bytes_per_seq() for s in specs)
    layouts = layouts or {s.name: KVLayout.single(s) for s in specs}
    block_bytes = {s.name: block_size * layouts[s.name].bytes_per_entry() * len(s.layer_ids) for s in specs}
    if snapshot_bytes_per_block:
        window = next(s.name for s in specs if s.sliding_window is not None)
        block_bytes[window] += snapshot_bytes_per_block
    max_tokens = max_num_seqs * max_model_len

    def blocks(spec: KVCacheSpec, capacity: int) -> int:
        if _is_compressed(spec):
            return _compressed_blocks(spec, block_size, max_num_seqs, max_model_len, capacity)
        n = math.ceil(math.ceil(capacity / spec.tokens_per_entry) / block_size)
        if spec.sliding_window is not None:
            cap = max_num_seqs * window_blocks_per_seq(spec, block_size, 1, window_rollback_tokens)
            cap += window_blocks_per_seq(spec, block_size, max_num_batched_tokens, window_rollback_tokens)
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
