"""The memory-profiling forward run before the KV cache is sized (devices that report memory).

The allocator keeps the activation peak reserved afterwards, so the free memory measured next
already excludes it; the cache then takes what is left (engine/startup.py: kv_budget_bytes).
"""

from __future__ import annotations

import torch

from deepinfer.backend import ForwardBatch, KVCaches, token_slots


def throwaway_prompt_batch(model, block_size: int, lens: list[int], input_ids: torch.Tensor,
                           logits_indices: torch.Tensor, device: torch.device, layouts=None
                           ) -> tuple[ForwardBatch, KVCaches]:
    """A batch of fresh sequences of `lens` tokens (positions 0..n-1, no context) on a cache of its own, sized for
    them: what the memory profile and the speculative step-cost profile (spec/cost_profile.py) run."""
    specs = model.kv_cache_specs()
    per_seq = {s.name: max(1, -(-s.num_entries(max(lens)) // block_size)) for s in specs}
    caches = KVCaches.allocate(specs, {name: n * len(lens) for name, n in per_seq.items()}, block_size, len(lens),
                               device, layouts)
    pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    tables, slots = {}, {}
    for s in specs:
        n = per_seq[s.name]
        table = torch.arange(n * len(lens), dtype=torch.int32).view(len(lens), n)
        tables[s.name] = table.to(device)
        slots[s.name] = token_slots(table, req, pos, s.tokens_per_entry, block_size).to(device)
    qsl = torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(torch.int32)
    batch = ForwardBatch(
        input_ids=input_ids,
        positions=pos.to(device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        context_lens=torch.zeros(len(lens), dtype=torch.int32, device=device),
        block_tables=tables,
        slot_mapping=slots,
        logits_indices=logits_indices,
        query_lens_cpu=list(lens),
        seq_lens_cpu=list(lens),
        context_lens_cpu=[0] * len(lens),
        state_slots=torch.arange(len(lens), dtype=torch.int32, device=device) if caches.state else None,
        state_slots_cpu=list(range(len(lens))) if caches.state else [],
        block_size=block_size,
    )
    return batch, caches


@torch.inference_mode()
def profile_forward(
    model, block_size: int, num_tokens: int, max_seq_len: int, num_logits: int, device: torch.device,
    layouts=None,
) -> None:
    """One forward of num_tokens prompt tokens (sequences of at most max_seq_len) and logits for
    num_logits rows, on a throw-away cache.

    layouts: the backend's KV layout per group (None: the single-tensor default).
    """
    lens = [min(max_seq_len, num_tokens - i) for i in range(0, num_tokens, max_seq_len)]
    n_logits = max(1, min(num_logits, num_tokens))
    batch, caches = throwaway_prompt_batch(
        model, block_size, lens, torch.zeros(num_tokens, dtype=torch.int64, device=device),
        torch.arange(num_tokens - n_logits, num_tokens, dtype=torch.int64, device=device), device, layouts)
    hidden = model.forward(batch, caches)
    model.compute_logits(hidden[batch.logits_indices]).float()
    del hidden, caches, batch
