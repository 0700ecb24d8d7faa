"""A DraftBook that records the MTP-layer KV each draft was made over (tests/spec/test_mtp_catchup.py,
tests/spec/test_spec_async_pauses.py)."""

from __future__ import annotations

import torch

from deepinfer.backend import token_slots
from deepinfer.spec.draft_slots import DraftBook


class MTPSnapshots(DraftBook):
    """A DraftBook that also records, at every put, the sequence's MTP-layer KV of its positions < num_tokens - 1
    (final by then: every later pass rewrites only later positions) and the draft's first confidence."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.seen: dict[tuple[str, int], tuple[torch.Tensor, float]] = {}

    def put(self, seq, tokens, confidence):
        super().put(seq, tokens, confidence)
        if not tokens:
            return
        kv, model = self.engine.scheduler.kv, self.engine.model
        cache = self.engine.runner.caches.get("mla", model.config.num_hidden_layers)
        n = seq.num_tokens - 1
        row = torch.full((n,), kv.state_slot(seq.seq_id), dtype=torch.int64)
        slots = token_slots(kv.block_tables["mla"], row, torch.arange(n), 1, kv.block_size)
        entries = cache.reshape(-1, cache.shape[-1])[slots].clone()
        self.seen[(seq.request.prompt if seq.request.prompt else str(seq.request.prompt_token_ids), n)] = \
            (entries, confidence[0])


def first_after_pause(seen: dict, prompt: str) -> int:
    """The first position a draft of `prompt` was made at (after the pause the run started with)."""
    return min(n for p, n in seen if p == prompt)
