"""A one-token forward that writes no KV: a data-parallel replica's share of a step it has no work in.

With expert parallelism over data-parallel replicas (deepinfer/parallel/forward_sync.py) a replica with
nothing scheduled still runs the model, so the collectives of its MoE layers meet those of the replicas
that do have work. Its one token sits at position 0 of a private one-block cache allocated once, so no
block of the real cache is read or written, and no logits are computed.
"""

from __future__ import annotations

import torch

from deepinfer.backend import ForwardBatch, KVCaches, token_slots


class DummyForward:
    def __init__(self, model, block_size: int, device: torch.device, layouts=None):
        self.model = model
        self.device = device
        self.block_size = block_size
        specs = model.kv_cache_specs()
        self.caches = KVCaches.allocate(specs, {s.name: 1 for s in specs}, block_size, 1, device, layouts)
        table = {s.name: torch.zeros((1, 1), dtype=torch.int32, device=device) for s in specs}
        req = torch.zeros(1, dtype=torch.int64)
        pos = torch.zeros(1, dtype=torch.int64)
        slots = {s.name: token_slots(table[s.name].cpu(), req, pos, s.tokens_per_entry, block_size).to(device)
                 for s in specs}
        self.batch = ForwardBatch(
            input_ids=torch.zeros(1, dtype=torch.int64, device=device),
            positions=pos.to(device),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
            seq_lens=torch.ones(1, dtype=torch.int32, device=device),
            context_lens=torch.zeros(1, dtype=torch.int32, device=device),
            block_tables=table,
            slot_mapping=slots,
            logits_indices=torch.zeros(1, dtype=torch.int64, device=device),
            query_lens_cpu=[1], seq_lens_cpu=[1], context_lens_cpu=[0],
            state_slots=torch.zeros(1, dtype=torch.int32, device=device) if self.caches.state else None,
            state_slots_cpu=[0] if self.caches.state else [],
            block_size=block_size,
        )

    @torch.inference_mode()
    def run(self) -> None:
        self.model.forward(self.batch, self.caches)
