"""The drafting-cost table of the confidence scheduler: seconds of one MTP drafting pass (the pass over a step's
verified rows, then the k - 1 chain links) by the number of drafting sequences, profiled once at start-up.

Why a table, not one measured number. The admission charges the drafting time to every step that verifies a
draft (spec/scheduler.py: `speculation_seconds`). That time grows with the sequences drafting (on the cpu backend
with the embedded model: ~26 ms for 1 sequence, ~150 ms for 64 at k = 5), and while adaptive drafting is paused
nothing measures it. A moving average of the last drafting steps' wall time carries whatever load it was last
measured at: measured at 16 sequences, it priced a 64-sequence step's drafting at a quarter of its cost, and the
scheduler would have verified full drafts where static k = 5 loses 40% of throughput. So the drafter itself
(`MTPDrafter.run`, the engine's code) is timed on a throw-away cache for 1, 2, 4, ... sequences, each with
`pass_rows` verified rows (its real token and the drafts accepted before: 1 + k // 2 by default, about what the
embedded model accepts) over no context, and chains of k drafts.
"""

from __future__ import annotations

import time

import torch

from deepinfer.backend import KVCaches
from deepinfer.spec.cost_profile import probe_token_ids, profile_counts
from deepinfer.spec.mtp_drafter import MTPDrafter, MTPRows
from deepinfer.spec.scheduler import StepCostTable


@torch.inference_mode()
def time_drafting(model, backend, block_size: int, num_seqs: int, k: int, pass_rows: int, layouts=None) -> float:
    """Seconds of one MTPDrafter.run over num_seqs sequences (pass_rows rows each, chains of k) on a throw-away
    cache (only the MTP layer's KV is read and written)."""
    specs = model.kv_cache_specs(include_mtp=True)
    per_seq = {s.name: max(1, -(-s.num_entries(pass_rows + k) // block_size)) for s in specs}
    caches = KVCaches.allocate(specs, {n: b * num_seqs for n, b in per_seq.items()}, block_size, num_seqs,
                               backend.device, layouts)
    tables = {s.name: torch.arange(per_seq[s.name] * num_seqs, dtype=torch.int32).view(num_seqs, per_seq[s.name])
              for s in specs}
    device_tables = {name: t.to(backend.device) for name, t in tables.items()}
    drafter = MTPDrafter(model, caches, tables, block_size, specs, backend.device)
    ids = probe_token_ids(num_seqs * pass_rows, model.vocab_size, torch.device("cpu")).tolist()
    items = [MTPRows(i * pass_rows, pass_rows, ids[i * pass_rows:(i + 1) * pass_rows], 0, True, i)
             for i in range(num_seqs)]
    hidden = torch.randn(num_seqs * pass_rows, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(device=backend.device, dtype=model.dtype)
    backend.synchronize()
    t0 = time.perf_counter()
    drafter.run(hidden, items, [k] * num_seqs, device_tables)
    backend.synchronize()
    return time.perf_counter() - t0


def profile_draft_costs(model, backend, block_size: int, k: int, max_seqs: int, pass_rows: int | None = None,
                        repeats: int = 2, layouts=None) -> StepCostTable:
    """Drafting seconds by drafting sequences, 1, 2, 4, ... max_seqs (the fastest of `repeats` each)."""
    rows = pass_rows if pass_rows is not None else 1 + k // 2
    counts = profile_counts(max_seqs)
    seconds = [max(min(time_drafting(model, backend, block_size, n, k, rows, layouts) for _ in range(repeats)), 1e-6)
               for n in counts]
    return StepCostTable(counts, seconds)
