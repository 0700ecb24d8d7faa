"""The step-cost table of the confidence scheduler, profiled once at start-up: seconds of one forward at a
batch token count.

Without decode graphs: eager forwards on throw-away caches with verify-shaped sequences (1 + k tokens each).
With decode graphs, a step of decodes and verify rows replays a graph (spec/verify_batch.py), so a token count
the graphs cover is timed as what the engine runs then: a replay of the decode graph of that many rows
(`GraphRunner.run` on a decode-shaped batch that reads the engine's cache and writes nothing: KV slots -1).
Counts above the largest bucket still run eagerly in the engine, and are profiled eagerly. Timing the eager
forward where the engine replays a graph would overstate every step's cost (about 6x on the H200 for a
verify step), and the scheduler would refuse to draft where drafting pays.
"""

from __future__ import annotations

import time

import torch

from deepinfer.backend import ForwardBatch, GraphRunner
from deepinfer.spec.scheduler import StepCostTable
from deepinfer.worker.profile_run import profile_forward


def profile_counts(max_tokens: int) -> list[int]:
    """1, 2, 4, ... below max_tokens, then max_tokens (at least 2 points)."""
    counts = []
    n = 1
    while n < max_tokens:
        counts.append(n)
        n *= 2
    counts.append(max(max_tokens, 2))
    return counts


def graph_probe_batch(num_rows: int, k: int, group_names: list[str], device: torch.device,
                      block_size: int) -> ForwardBatch:
    """num_rows decode rows shaped like verify rows of 1 + k tokens (positions 0..k, seq_len position + 1) over
    block 0 of every group, writing no KV (slot -1): a graph replay of it reads the cache and changes nothing."""
    pos = torch.arange(num_rows, dtype=torch.int64) % (k + 1)
    dev = {"device": device}
    return ForwardBatch(
        input_ids=torch.zeros(num_rows, dtype=torch.int64, **dev),
        positions=pos.to(device),
        query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32, **dev),
        seq_lens=(pos + 1).to(torch.int32).to(device),
        context_lens=pos.to(torch.int32).to(device),
        block_tables={g: torch.zeros((num_rows, 1), dtype=torch.int32, **dev) for g in group_names},
        slot_mapping={g: torch.full((num_rows,), -1, dtype=torch.int64, **dev) for g in group_names},
        logits_indices=torch.arange(num_rows, dtype=torch.int64, **dev),
        query_lens_cpu=[1] * num_rows,
        seq_lens_cpu=(pos + 1).tolist(),
        context_lens_cpu=pos.tolist(),
        block_size=block_size,
    )


def profile_step_costs(model, backend, block_size: int, k: int, max_tokens: int, repeats: int = 2,
                       layouts=None, graph_runner: GraphRunner | None = None,
                       group_names: list[str] | None = None) -> tuple[StepCostTable, list[bool]]:
    """(the table, per profiled count whether it was a graph replay). Each point is the fastest of `repeats`
    runs (the others' noise is the machine's, not the step's). graph_runner / group_names: the engine's decode
    graphs and its KV groups; counts they can replay are timed as replays (module docstring)."""
    counts = profile_counts(max_tokens)
    seconds, graphed = [], []
    for n in counts:
        probe = None
        if graph_runner is not None:
            probe = graph_probe_batch(n, k, group_names or [], backend.device, block_size)
            if not graph_runner.can_run(probe):
                probe = None
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            if probe is not None:
                model.compute_logits(graph_runner.run(probe)).float()  # the verify step's logits: every row
            else:
                profile_forward(model, block_size, n, k + 1, n, backend.device, layouts)
            backend.synchronize()
            best = min(best, time.perf_counter() - t0)
        seconds.append(max(best, 1e-6))
        graphed.append(probe is not None)
    return StepCostTable(counts, seconds), graphed
