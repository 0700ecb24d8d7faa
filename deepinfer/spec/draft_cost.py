"""The drafting-cost table of the confidence scheduler: seconds of one MTP drafting pass (the pass over a step's
verified rows, then the k - 1 chain links) by the number of drafting sequences, profiled once at start-up.

Why a table, not one measured number. The admission charges the drafting time to every step that verifies a
draft (spec/scheduler.py: `speculation_seconds`). That time grows with the sequences drafting (on the cpu backend
with the embedded model: ~26 ms for 1 sequence, ~150 ms for 64 at k = 5), and while adaptive drafting is paused
nothing measures it. A moving average of the last drafting steps' wall time carries whatever load it was last
measured at: measured at 16 sequences, it priced a 64-sequence step's drafting at a quarter of its cost, and the
scheduler would have verified full drafts where static k = 5 loses 40% of throughput. So the drafter itself
(`MTPDrafter.run`, the engine's code) is timed for 1, 2, 4, ... sequences, each with `pass_rows` verified rows (its
real token and the drafts accepted before: 1 + k // 2 by default, about what the embedded model accepts) over no
context, and chains of k drafts: with MTP graphs (backend/mtp_graph_runner.py) the engine's own drafter replaying
them, rows staged as padding so the engine's cache is untouched (`probe`); without, or past the largest bucket, an
eager drafter on a throw-away cache. On the H200 the eager drafter cost ~8 ms of host per k = 3 step against
~1.3 ms for a plain decode step (2026-12-03), so a table of eager timings makes drafting look 10x dearer than the
replays the engine now runs, and the scheduler drafts nothing: every point the graphs cover must be a replay
(`DraftCostTable.shapes` says how each was timed; the start-up log prints it).

Why a chain-length axis. The adaptive scheduler also picks how long the next chain is (spec/slot_policy.py:
`SlotPolicy.chain`): drafting k = 5 for 16 sequences costs ~71 ms on the cpu backend where k = 1 costs ~14 ms, and
a step whose verification pays only for the first slot should not pay for four more links. So the table holds two
profiled rows, chains of 1 and of k, and prices a chain of L in between linearly (each link is one more one-token
forward of the MTP module per sequence: the same work whatever L; the pass over verified rows is in both rows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from deepinfer.backend import KVCaches
from deepinfer.spec.cost_profile import GRAPH, probe_token_ids, profile_counts
from deepinfer.spec.mtp_drafter import MTPDrafter, MTPRows
from deepinfer.spec.scheduler import StepCostTable

EAGER = "eager"


@torch.inference_mode()
def time_drafting(model, backend, block_size: int, num_seqs: int, k: int, pass_rows: int, layouts=None,
                  drafter: MTPDrafter | None = None) -> tuple[float, str]:
    """(seconds of one MTPDrafter.run over num_seqs sequences, pass_rows rows each, chains of k; how it ran:
    GRAPH or EAGER). With the engine's drafter and its MTP graphs covering the step, that drafter itself runs,
    replaying its graphs with every row staged as padding (`probe`: the engine's cache is neither read nor
    written; the launches, the host work and the replays are the engine's). Otherwise a drafter without graphs on
    a throw-away cache (only the MTP layer's KV is read and written): what the engine runs when its graphs do not
    cover the step."""
    ids = probe_token_ids(num_seqs * pass_rows, model.vocab_size, torch.device("cpu")).tolist()
    items = [MTPRows(i * pass_rows, pass_rows, ids[i * pass_rows:(i + 1) * pass_rows], 0, True, i)
             for i in range(num_seqs)]
    width = getattr(model, "mtp_hidden_size", model.config.hidden_size)  # (V4: the residual streams, flat)
    hidden = torch.randn(num_seqs * pass_rows, width, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(device=backend.device, dtype=model.dtype)
    if drafter is not None and drafter.replays(num_seqs * pass_rows, num_seqs):
        backend.synchronize()
        t0 = time.perf_counter()
        drafter.run(hidden, items, [k] * num_seqs, drafter.graphs.tables, probe=True)
        backend.synchronize()
        return time.perf_counter() - t0, GRAPH
    specs = model.kv_cache_specs(include_mtp=True)
    per_seq = {s.name: max(1, -(-s.num_entries(pass_rows + k) // block_size)) for s in specs}
    caches = KVCaches.allocate(specs, {n: b * num_seqs for n, b in per_seq.items()}, block_size, num_seqs,
                               backend.device, layouts)
    tables = {s.name: torch.arange(per_seq[s.name] * num_seqs, dtype=torch.int32).view(num_seqs, per_seq[s.name])
              for s in specs}
    device_tables = {name: t.to(backend.device) for name, t in tables.items()}
    eager = MTPDrafter(model, caches, tables, block_size, specs, backend.device, pick_op=backend.draft_pick)
    backend.synchronize()
    t0 = time.perf_counter()
    eager.run(hidden, items, [k] * num_seqs, device_tables)
    backend.synchronize()
    return time.perf_counter() - t0, EAGER


@dataclass
class DraftCostTable:
    """Drafting seconds by drafting sequences (StepCostTable's piecewise-linear axis) for chains of 1 and of k,
    linear in the chain length between them."""

    k: int
    one: StepCostTable  # chains of 1 draft (the pass only)
    full: StepCostTable  # chains of k drafts
    shapes: list[str] = field(default_factory=list)  # per count: how chains of k were timed (GRAPH / EAGER)

    def __post_init__(self) -> None:
        if self.k < 1 or self.one.tokens != self.full.tokens:
            raise ValueError(f"DraftCostTable needs k >= 1 and both rows over the same counts, got k={self.k}, "
                             f"{self.one.tokens} vs {self.full.tokens}")
        # a longer chain never costs less than a shorter one (timing noise otherwise)
        self.full.seconds = [max(a, b) for a, b in zip(self.one.seconds, self.full.seconds)]

    @property
    def counts(self) -> list[int]:
        return self.one.tokens

    def cost(self, num_seqs: float, chain: int | None = None) -> float:
        """Seconds of drafting chains of `chain` (default k) for num_seqs sequences."""
        chain = self.k if chain is None else chain
        if not 1 <= chain <= self.k:
            raise ValueError(f"chain length {chain} outside 1..{self.k}")
        one = self.one.at(num_seqs)
        if self.k == 1:
            return one
        return one + (self.full.at(num_seqs) - one) * (chain - 1) / (self.k - 1)


def profile_draft_costs(model, backend, block_size: int, k: int, max_seqs: int, pass_rows: int | None = None,
                        repeats: int = 2, layouts=None, drafter: MTPDrafter | None = None) -> DraftCostTable:
    """Drafting seconds by drafting sequences, 1, 2, 4, ... max_seqs (the fastest of `repeats` each), for chains
    of 1 and of k.
    pass_rows: verified rows per sequence in the pass (default 1 + L // 2 for a chain of L). drafter: the engine's
    (with its MTP graphs, what a drafting step replays: `time_drafting`)."""
    counts = profile_counts(max_seqs)

    def row(chain: int) -> tuple[StepCostTable, list[str]]:
        rows = pass_rows if pass_rows is not None else 1 + chain // 2
        seconds, shapes = [], []
        for n in counts:
            runs = [time_drafting(model, backend, block_size, n, chain, rows, layouts, drafter)
                    for _ in range(repeats)]
            seconds.append(max(min(s for s, _ in runs), 1e-6))
            shapes.append(runs[0][1])
        return StepCostTable(counts, seconds), shapes

    one, shapes = row(1)
    if k == 1:
        return DraftCostTable(k, one, StepCostTable(counts, list(one.seconds)), shapes)
    full, shapes = row(k)
    return DraftCostTable(k, one, full, shapes)
