"""The step-cost table of the confidence scheduler, profiled once at start-up: seconds of one forward at a
batch token count.

Without decode graphs: eager forwards on throw-away caches with verify-shaped sequences (1 + k tokens each), in the
form the engine runs them: on a backend whose eager verify steps run as decode rows (the cpu backend,
`VerifyShapes.decode_rows_eager`, spec/verify_batch.py) as the decode-shaped batch (spec/verify_batch.py), else varlen. Timing the
varlen form there times the MLA op's per-request prefill path, which the engine no longer takes for a verify step
(measured 0-45% slower on the cpu backend), and the scheduler would overestimate what a verified token costs.
With decode graphs, a step of decodes and verify rows replays a graph (spec/verify_batch.py), so a token count
the graphs cover is timed as what the engine runs then: a replay of the decode graph of that many rows
(`GraphRunner.run` on a decode-shaped batch that reads the engine's cache and writes nothing: KV slots -1).
Counts above the largest bucket still run eagerly in the engine, and are profiled eagerly; the table has a point
on each side of that edge (`graph_edge`). Timing the eager
forward where the engine replays a graph would overstate every step's cost (about 6x on the H200 for a
verify step), and the scheduler would refuse to draft where drafting pays.

Every profiled batch holds different (seeded random) token ids, not one id repeated: a MoE layer's cost grows with
the distinct experts its tokens reach, and a batch of one repeated id reaches the same top-k experts whatever its
size. On the cpu backend with the embedded model (fp8 experts dequantized per call) the repeated-id table
underpriced 16 tokens 2.5x (14 vs 36 ms; a plain 16-sequence decode step measures 36 ms in the benchmark).
"""

from __future__ import annotations

import time

import torch

from deepinfer.backend import ForwardBatch, GraphRunner
from deepinfer.spec.scheduler import StepCostTable
from deepinfer.spec.verify_batch import decode_shaped
from deepinfer.worker.profile_run import throwaway_prompt_batch

# how a profiled token count was timed (the start-up log prints it; SlotPolicy.cost_shapes keeps it)
GRAPH, DECODE_ROWS, VARLEN = "graph", "decode rows", "varlen"


def profile_counts(max_tokens: int) -> list[int]:
    """1, 2, 4, ... below max_tokens, then max_tokens; at least the two points 1 and 2 (a table needs two: with
    max_num_seqs 1 the drafting table's counts were [2] and an adaptive engine failed at start-up)."""
    counts = []
    n = 1
    while n < max_tokens:
        counts.append(n)
        n *= 2
    counts.append(max_tokens)
    return counts if len(counts) >= 2 else [1, 2]


def probe_token_ids(num_tokens: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Distinct-looking token ids for a profiled batch (seeded, so the table is reproducible). A MoE layer's cost
    grows with the number of distinct experts its tokens route to (every expert hit is read, or on the cpu
    backend dequantized, once per call); one repeated id routes every token to the same top-k experts, so a
    profile of it prices each extra verified token at almost nothing, where a real batch of different tokens
    reaches more experts."""
    gen = torch.Generator().manual_seed(num_tokens)
    return torch.randint(0, vocab_size, (num_tokens,), generator=gen, dtype=torch.int64).to(device)


def graph_probe_batch(num_rows: int, k: int, group_names: list[str], device: torch.device,
                      block_size: int, vocab_size: int) -> ForwardBatch:
    """num_rows decode rows shaped like verify rows of 1 + k tokens (positions 0..k, seq_len position + 1) over
    block 0 of every group, writing no KV (slot -1): a graph replay of it reads the cache and changes nothing."""
    pos = torch.arange(num_rows, dtype=torch.int64) % (k + 1)
    dev = {"device": device}
    return ForwardBatch(
        input_ids=probe_token_ids(num_rows, vocab_size, device),
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


def graph_edge(graph_runner: GraphRunner, k: int, group_names: list[str], device: torch.device, block_size: int,
               vocab_size: int, max_tokens: int) -> int | None:
    """The largest token count up to max_tokens whose verify-shaped decode rows replay a graph (None: not even one
    row does). One more token runs eagerly, several times dearer: profile_step_costs times both sides of this edge,
    or the table interpolates across it. On an H100 (2026-12-07, session 37, max_num_seqs 16, k 5) the graphs
    covered 96 rows and the table's points 64 (graph, 0.32 ms) and 128 (eager, 6.99 ms) priced a 16-sequence chain
    of 5 (96 rows, a graph replay in the engine) at ~3.6 ms: the plan drafted chains of 3 where static k = 5 ran
    1.23x faster. can_run grows no easier with more rows (a bucket holds every count below it), so the edge is
    found by bisection."""
    def replays(n: int) -> bool:
        return graph_runner.can_run(graph_probe_batch(n, k, group_names, device, block_size, vocab_size))

    if not replays(1):
        return None
    lo, hi = 1, max_tokens  # replays(lo); the edge lies in [lo, hi]
    if replays(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if replays(mid) else (lo, mid)
    return lo


@torch.inference_mode()
def verify_forward(model, block_size: int, num_tokens: int, k: int, device: torch.device, layouts=None,
                   decode_rows: bool = False) -> ForwardBatch:
    """One eager forward of num_tokens tokens in verify-shaped sequences of 1 + k (the last one shorter) on a
    throw-away cache, with the logits of every row, in the form the engine runs an eager verify step: varlen, or
    with decode_rows (`VerifyShapes.decode_rows_eager`, spec/verify_batch.py) the batch decode-shaped, one decode row per token
    (spec/verify_batch.py). Token ids from `probe_token_ids`. Returns the batch that ran."""
    q = k + 1
    lens = [min(q, num_tokens - i) for i in range(0, num_tokens, q)]
    batch, caches = throwaway_prompt_batch(model, block_size, lens, probe_token_ids(num_tokens, model.vocab_size,
                                                                                    device),
                                           torch.arange(num_tokens, dtype=torch.int64, device=device), device,
                                           layouts)
    if caches.state and decode_rows:
        raise ValueError("verify_forward: a model with per-sequence state never runs verify steps as decode rows")
    if decode_rows:
        batch = decode_shaped(batch)
    hidden = model.forward(batch, caches)
    model.compute_logits(hidden[batch.logits_indices]).float()
    return batch


def profile_step_costs(model, backend, block_size: int, k: int, max_tokens: int, repeats: int = 2,
                       layouts=None, graph_runner: GraphRunner | None = None,
                       group_names: list[str] | None = None,
                       decode_rows: bool = False) -> tuple[StepCostTable, list[str]]:
    """(the table, per profiled count how it was timed: GRAPH, DECODE_ROWS or VARLEN). Each point is the fastest
    of `repeats` runs (the others' noise is the machine's, not the step's). graph_runner / group_names: the
    engine's decode graphs and its KV groups; counts they can replay are timed as replays. decode_rows: the
    engine runs eager verify steps as decode rows (`VerifyShapes.decode_rows_eager`, spec/verify_batch.py), so counts without a
    graph are timed that way (module docstring)."""
    counts = profile_counts(max_tokens)
    if graph_runner is not None:  # both sides of the graphs' edge, where the price jumps (graph_edge)
        edge = graph_edge(graph_runner, k, group_names or [], backend.device, block_size, model.vocab_size,
                          max_tokens)
        if edge is not None and edge < max_tokens:
            counts = sorted(set(counts) | {edge, edge + 1})
    seconds, shapes = [], []
    for n in counts:
        probe = None
        if graph_runner is not None:
            probe = graph_probe_batch(n, k, group_names or [], backend.device, block_size, model.vocab_size)
            if not graph_runner.can_run(probe):
                probe = None
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            if probe is not None:
                model.compute_logits(graph_runner.run(probe)).float()  # the verify step's logits: every row
            else:
                verify_forward(model, block_size, n, k, backend.device, layouts, decode_rows)
            backend.synchronize()
            best = min(best, time.perf_counter() - t0)
        seconds.append(max(best, 1e-6))
        shapes.append(GRAPH if probe is not None else DECODE_ROWS if decode_rows else VARLEN)
    return StepCostTable(counts, seconds), shapes
