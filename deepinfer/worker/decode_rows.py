"""Decode rows: a step's batch rewritten as one decode row per query token, so the backend's captured decode
graphs can replay steps that are not decode-only.

Why it is the same computation. A sequence with q query tokens over a cached context of c tokens attends
causally: token j sees positions <= c + j. A decode row of position c + j, seq_len c + j + 1, over the
sequence's block table, computes exactly that attention, because the layer writes every row's KV (the step's
slot mapping, unchanged) before any row attends (the decode path's KV write / mla_prep runs before the attention
kernel; backends declare it with `BackendCaps.graph_decode_rows`). So the flattened batch has the same tokens in
the same order (input ids, positions, KV slots and logits rows are untouched); only the per-sequence metadata is
per row: query_start_loc = 0..T, seq_lens = positions + 1, context_lens = positions, block tables repeated per
row. Everything that reads the hidden states (logits, the sampler, the MTP drafter) reads them in the row order
of the original batch, which this keeps.

Who uses it:
- speculative decoding's verify steps (spec/verify_batch.py re-exports these functions; spec/pipeline.py):
  decodes and verify rows replay the decode graphs;
- the model runner's short extends (`ShortExtends`, worker/model_runner.py): a step of decodes and prompt chunks
  of at most `DEEPINFER_DECODE_ROWS_MAX_TOKENS` tokens in all (a prefix hit's suffix, a short prompt) replays the
  decode graphs instead of running eagerly. On a GPU an eager forward of a few tokens is launch-bound (~90 kernel
  launches per 4 layers of V2-Lite): a prefix hit's TTFT was its host time (docs/kv-cache.md).

Numerics: the rows compute the same attention as the prefill path, but through the decode kernels (another
split of the keys, another summation order), so in the default bf16 mode a token's logits may round differently
than in an eager prefill of the same step (as a decode does). Under batch invariance the invariant ops compute a
token the same way in a decode and in a prefill chunk (docs/determinism.md), so nothing changes, bitwise.

Never for models with per-sequence state (V4: the state rows are per request, and a padded decode row would
write into a real one): `decode_shaped` refuses them and the graph runners refuse every batch of theirs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepinfer import envs
from deepinfer.backend import DECODE_ROWS, TOKEN_REQUESTS, ForwardBatch, GraphRunner
from deepinfer.errors import ConfigError
from deepinfer.worker.transfer import tensor_to

logger = logging.getLogger("deepinfer")


def decode_shaped(batch: ForwardBatch) -> ForwardBatch:
    """The batch as decode rows (module docstring): one row per token, rows in the same order."""
    if batch.state_slots is not None:
        raise ValueError("decode_shaped: a batch with per-sequence state rows cannot be split into decode rows")
    qlens = batch.query_lens_cpu
    ctx_rows: list[int] = []
    for i, (q, c, s) in enumerate(zip(qlens, batch.context_lens_cpu, batch.seq_lens_cpu)):
        if s != c + q:
            raise ValueError(f"decode_shaped: request {i} has seq_len {s} != context_len {c} + query_len {q}")
        ctx_rows.extend(range(c, c + q))
    t = len(ctx_rows)
    if t != batch.num_tokens:
        raise ValueError(f"decode_shaped: query lengths sum to {t}, the batch has {batch.num_tokens} tokens")
    dev = batch.input_ids.device
    # each row's request: the batch builder's, from its one copy (TOKEN_REQUESTS), else a copy of our own
    req = batch.memo(TOKEN_REQUESTS, lambda: tensor_to([i for i, q in enumerate(qlens) for _ in range(q)],
                                                       torch.int64, dev))
    positions = batch.positions
    # the rows' int32 fields: the batch builder's for a step that verifies drafts (DECODE_ROWS), else three ops
    qsl, seq_lens, ctx_lens = batch.memo(DECODE_ROWS, lambda: (torch.arange(t + 1, dtype=torch.int32, device=dev),
                                                               (positions + 1).to(torch.int32),
                                                               positions.to(torch.int32)))
    return ForwardBatch(
        input_ids=batch.input_ids,
        positions=positions,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        context_lens=ctx_lens,
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
    """(the batch to run, whether it was flattened for a graph replay): the decode-shaped form when a graph runner
    exists and can replay it, else the batch unchanged (eager, or already decode-only)."""
    if graph_runner is None or batch.is_decode_only or batch.state_slots is not None:
        return batch, False
    flat = decode_shaped(batch)
    if graph_runner.can_run(flat):
        return flat, True
    return batch, False


@dataclass
class ShortExtends:
    """The model runner's rule for steps that are not decode-only: those of at most `max_tokens` tokens replay the
    decode graphs as decode rows where a captured bucket covers them (0: never). Counts the steps it flattened."""

    max_tokens: int = 0
    num_steps: int = 0  # steps run as decode rows through the graphs

    def flatten(self, batch: ForwardBatch, graph_runner: GraphRunner | None) -> ForwardBatch | None:
        """The decode-shaped batch to replay, or None (run the batch as it is)."""
        if not self.max_tokens or batch.num_tokens > self.max_tokens or batch.is_decode_only:
            return None
        flat, ok = decode_shaped_if_graphed(batch, graph_runner)
        if not ok:
            return None
        self.num_steps += 1
        return flat


def short_extend_tokens(caps, graphs: bool, uses_state: bool) -> int:
    """`DEEPINFER_DECODE_ROWS_MAX_TOKENS` resolved at start-up: the most tokens a step with prompt chunks may have
    to replay the decode graphs as decode rows (0: off).

    caps: the backend's BackendCaps; graphs: decode graphs will be captured (graph_capture and not enforce_eager);
    uses_state: the model keeps per-sequence state (V4). Speculative decoding's steps (spec/pipeline.py) apply the
    same rule to their steps with prompt chunks. Where no decode graphs serve steps (no graph capture,
    enforce_eager, V4) it has nothing to replay: 0, logged when it was set. Set
    explicitly where graphs do run but the backend does not declare its decode path exact for several rows of one
    sequence (`BackendCaps.graph_decode_rows`), it is an error naming the variable (unset: quietly 0 there)."""
    var = envs.DECODE_ROWS_MAX_TOKENS
    limit = var.get()
    if not limit:
        return 0
    why = ("decode graphs are off (no graph capture, or enforce_eager)" if not graphs else
           "the model keeps per-sequence state (V4): its steps never run as decode rows" if uses_state else None)
    if why is None and not getattr(caps, "graph_decode_rows", False):
        if var.is_set():
            raise ConfigError(f"{var.name}={limit}: this backend's decode graphs are not declared exact for several "
                              "rows of one sequence (BackendCaps.graph_decode_rows); unset it or set 0")
        return 0
    if why is not None:
        if var.is_set():
            logger.info("%s=%d has no effect: %s", var.name, limit, why)
        return 0
    return limit
