"""One model step's inputs, built by the model runner and read by models and backend ops."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    slot_mapping: dict[str, torch.Tensor]  # group -> [T] int64 slot per token (groups with tokens_per_entry == 1)
    logits_indices: torch.Tensor  # [N] int64 rows of the hidden states that get logits
    # host copies, so control flow never waits on the device
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    context_lens_cpu: list[int] = field(default_factory=list)
    state_slots: torch.Tensor | None = None  # [B] int32 row of each request in per-sequence state pools
    state_slots_cpu: list[int] = field(default_factory=list)
    block_size: int = 16

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
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)
