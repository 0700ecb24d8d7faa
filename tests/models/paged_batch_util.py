"""Builds ForwardBatch + KVCaches by hand for model tests (the engine's model runner is not used here).

Blocks are handed out from a shuffled free list so that a sequence's blocks
are scattered through the pool, as they are in a long-running engine.
"""

from __future__ import annotations

import random

import torch

from deepinfer.backend.forward_batch import ForwardBatch
from deepinfer.backend.kv_caches import KVCaches


class PagedKV:
    def __init__(self, model, num_blocks: int = 64, block_size: int = 16, max_num_seqs: int = 16, seed: int = 0,
                 specs=None):
        self.model = model
        self.block_size = block_size
        self.specs = model.kv_cache_specs() if specs is None else specs
        self.caches = KVCaches.allocate(
            self.specs, {s.name: num_blocks for s in self.specs}, block_size, max_num_seqs, torch.device("cpu")
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run one forward over [(seq_id, new token ids)]; returns fp32 logits for every new token, in order."""
        batch = self.batch(chunks)
        with torch.no_grad():
            hidden = self.model.forward(batch, self.caches)
            return self.model.compute_logits(hidden[batch.logits_indices])

    def batch(self, chunks: list[tuple[int, list[int]]]) -> ForwardBatch:
        """The ForwardBatch for [(seq_id, new token ids)], with blocks taken for the new tokens."""
        bs = self.block_size
        ids, pos, slots, qsl = [], [], [], [0]
        ctx_lens, seq_lens, qlens, tables = [], [], [], []
        for sid, toks in chunks:
            ctx = self.lens.get(sid, 0)
            blocks = self.blocks.setdefault(sid, [])
            need = -(-(ctx + len(toks)) // bs)
            while len(blocks) < need:
                blocks.append(self.free.pop())
            for j, t in enumerate(toks):
                p = ctx + j
                ids.append(t)
                pos.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + len(toks))
            ctx_lens.append(ctx)
            seq_lens.append(ctx + len(toks))
            qlens.append(len(toks))
            tables.append(list(blocks))
            self.lens[sid] = ctx + len(toks)
        width = max(len(t) for t in tables)
        table = torch.full((len(tables), width), -1, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        names = [s.name for s in self.specs]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
            block_tables={n: table for n in names},
            slot_mapping={n: torch.tensor(slots, dtype=torch.int64) for n in names},
            logits_indices=torch.arange(len(ids), dtype=torch.int64),
            query_lens_cpu=qlens,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=ctx_lens,
            block_size=bs,
        )
