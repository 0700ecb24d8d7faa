"""One model step's inputs, built by the model runner and read by models and backend ops."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# `ForwardBatch.memo` key: int64 [T] on the device, each token's request (its row of query_start_loc). The batch
# builder puts it in the memo of batches that are not decode-only, from its one host-to-device copy, so splitting
# a batch into decode rows (worker/decode_rows.py) needs no copy of its own.
TOKEN_REQUESTS = "token_requests"
# `ForwardBatch.memo` key: the int32 fields of the batch as decode rows (query_start_loc 0..T [T + 1], seq_lens
# positions + 1 [T], context_lens positions [T]), on the device. The batch builder puts them in the memo of steps that
# verify drafts (whose forward runs as decode rows), from its one copy, so decode rows need no ops to make them.
DECODE_ROWS = "decode_rows"


@dataclass
class ForwardBatch:
    """The tokens of one step: requests concatenated in batch order.

    Request i owns rows query_start_loc[i] : query_start_loc[i+1] of every
    [T]-shaped tensor. Its cache holds context_lens[i] tokens before the step
    and seq_lens[i] = context_lens[i] + query_lens[i] after it.
    KV-group keyed fields use KVCacheSpec.name as the key.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 (absolute position of each token)
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    context_lens: torch.Tensor  # [B] int32
    block_tables: dict[str, torch.Tensor]  # group -> [B, max_blocks] int32, unused entries -1
    slot_mapping: dict[str, torch.Tensor]  # group -> [T] int64: the slot each token writes (token_slots), -1 none
    logits_indices: torch.Tensor  # [N] int64 rows of the hidden states that get logits
    # host copies, so control flow never waits on the device
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    context_lens_cpu: list[int] = field(default_factory=list)
    state_slots: torch.Tensor | None = None  # [B] int32 row of each request in per-sequence state pools
    state_slots_cpu: list[int] = field(default_factory=list)
    block_size: int = 16
    # Per-step memo of what ops derive from this batch (q-block tables, gather indices, cu_seqlens): the
    # first layer builds it, the other layers reuse it (a 27-layer prefill built its tables 27 times, ~40 ms
    # of host time at 8k tokens). Not an init field: dataclasses.replace gives the copy an empty memo, so a
    # derived value never outlives the fields it came from. Fields must not be mutated after a memo use.
    derived: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def memo(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """build() once per batch and key (the key names the op kind and whatever else the value depends on)."""
        if key not in self.derived:
            self.derived[key] = build()
        return self.derived[key]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens_cpu)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)


def token_slots(table: torch.Tensor, req_idx: torch.Tensor, positions: torch.Tensor, tokens_per_entry: int,
                block_size: int) -> torch.Tensor:
    """int64 [T]: the KV slot (block * block_size + offset) each token writes in one group.

    table: the group's block tables [B, W]; req_idx / positions: each token's request row and
    absolute position. A compressed group (tokens_per_entry m > 1) writes one entry per m tokens:
    the token completing entry e = (pos + 1) // m - 1 gets its slot, the others -1. A table entry
    of -1 (a window block already returned) gives -1 too. The one definition of slot_mapping:
    the runtime builds batches with it (on the host, as `token_slots_host`: the same rule over numpy
    arrays, tested equal) and ops read the result, never recomputing slots.
    """
    m = tokens_per_entry
    entries = positions if m == 1 else torch.clamp((positions + 1) // m - 1, min=0)
    blocks = table[req_idx, entries // block_size].to(torch.int64)
    slots = blocks * block_size + entries % block_size
    valid = blocks >= 0
    if m > 1:
        valid &= (positions + 1) % m == 0
    return torch.where(valid, slots, torch.full_like(slots, -1))


def token_slots_host(table: np.ndarray, rows: np.ndarray, positions: np.ndarray, tokens_per_entry: int,
                     block_size: int) -> np.ndarray:
    """`token_slots` over host arrays (int64 [T]; table: the KV manager's numpy view of a group's tables): the
    same rule, for the batch builder, where the host tables and every index are host data. Numpy because each
    torch op costs a dispatch of a few us on the host: the ~9 ops per group were ~30 us of every step's build on
    this CPU, ~5 us here."""
    m = tokens_per_entry
    entries = positions if m == 1 else np.maximum((positions + 1) // m - 1, 0)
    blocks = table[rows, entries // block_size].astype(np.int64)
    slots = blocks * block_size + entries % block_size
    invalid = blocks < 0
    if m > 1:
        invalid |= (positions + 1) % m != 0
    slots[invalid] = -1
    return slots
