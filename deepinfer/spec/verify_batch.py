"""Decode-shaped verification: a verify step's batch rewritten as one decode row per query token, so the
backend's captured decode graphs can replay it.

Why it is the same computation. A verify row (request i: its real token and d_i drafts, q_i = 1 + d_i query
tokens over a cached context of c_i tokens) attends causally: token j sees positions <= c_i + j. A decode row
of position c_i + j, seq_len c_i + j + 1, over the request's block table, computes exactly that attention,
because the layer writes every row's KV (the step's slot mapping, unchanged) before any row attends (the
decode path's KV write / mla_prep runs before the attention kernel). So the flattened batch has the same
tokens in the same order (input ids, positions, KV slots and logits rows are untouched); only the
per-request metadata is per row: query_start_loc = 0..T, seq_lens = positions + 1, context_lens =
positions, block tables repeated per row. The model, the sampler and the MTP drafter read the hidden
states in the row order of the original batch, which this keeps.

It is used only for steps whose rows are all decodes and verify rows (a step with a prompt chunk runs as it
does with speculation off: eagerly, in its varlen form) and only when the decode graphs can replay the
flattened batch (`decode_shaped_if_graphed`); a batch larger than the largest captured bucket runs eagerly
in its varlen form, as before. Models with per-sequence state (V4) are never flattened (their state rows
are per request).
"""

from __future__ import annotations

import torch

from deepinfer.backend import ForwardBatch, GraphRunner
from deepinfer.worker.transfer import tensor_to


def graph_rows(max_num_seqs: int, num_speculative_tokens: int, token_budget: int) -> int:
    """Rows the decode graphs must cover so that a full verify step replays one: every sequence with k
    drafts, capped by the step's token budget (no step holds more tokens)."""
    return max(1, min(max_num_seqs * (1 + num_speculative_tokens), token_budget))


def decode_shaped(batch: ForwardBatch) -> ForwardBatch:
    """The batch as decode rows (module docstring): one row per token, rows in the same order."""
    if batch.state_slots is not None:
        raise ValueError("decode_shaped: a batch with per-sequence state rows cannot be split into decode rows")
    qlens = batch.query_lens_cpu
    ctx_rows: list[int] = []
    req_rows: list[int] = []
    for i, (q, c, s) in enumerate(zip(qlens, batch.context_lens_cpu, batch.seq_lens_cpu)):
        if s != c + q:
            raise ValueError(f"decode_shaped: request {i} has seq_len {s} != context_len {c} + query_len {q}")
        ctx_rows.extend(range(c, c + q))
        req_rows.extend([i] * q)
    t = len(ctx_rows)
    if t != batch.num_tokens:
        raise ValueError(f"decode_shaped: query lengths sum to {t}, the batch has {batch.num_tokens} tokens")
    dev = batch.input_ids.device
    req = tensor_to(req_rows, torch.int64, dev)
    positions = batch.positions
    return ForwardBatch(
        input_ids=batch.input_ids,
        positions=positions,
        query_start_loc=torch.arange(t + 1, dtype=torch.int32, device=dev),
        seq_lens=(positions + 1).to(torch.int32),
        context_lens=positions.to(torch.int32),
        block_tables={g: tab.index_select(0, req) for g, tab in batch.block_tables.items()},
        slot_mapping=batch.slot_mapping,
        logits_indices=batch.logits_indices,
        query_lens_cpu=[1] * t,
        seq_lens_cpu=[c + 1 for c in ctx_rows],
        context_lens_cpu=ctx_rows,
        state_slots=None,
        state_slots_cpu=[],
        block_size=batch.block_size,
    )


def decode_shaped_if_graphed(batch: ForwardBatch, graph_runner: GraphRunner | None) -> tuple[ForwardBatch, bool]:
    """(the batch to run, whether it is a verify batch flattened for a graph replay): the decode-shaped form
    when a graph runner exists and can replay it, else the batch unchanged (eager, or already decode-only)."""
    if graph_runner is None or batch.is_decode_only or batch.state_slots is not None:
        return batch, False
    flat = decode_shaped(batch)
    if graph_runner.can_run(flat):
        return flat, True
    return batch, False
