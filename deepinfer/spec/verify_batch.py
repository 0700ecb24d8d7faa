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

It is used for steps whose rows are all decodes and verify rows when the decode graphs can replay the
flattened batch (`decode_shaped_if_graphed`); a step with a prompt chunk replays them when it is short (the model
runner's short-extend rule, worker/decode_rows.py: DEEPINFER_DECODE_ROWS_MAX_TOKENS), else runs eagerly in its
varlen form; a batch larger than the largest captured bucket runs eagerly (the cpu backend: as decode rows,
`decode_rows_eager`). Models with per-sequence state (V4) are never flattened (their state rows are per request).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.backend import ForwardBatch
from deepinfer.worker.decode_rows import decode_shaped, decode_shaped_if_graphed  # noqa: F401 (spec's names)


@dataclass
class VerifyShapes:
    """How a speculative engine runs each step's batch (`run_batch`), with counts of the verify steps' forms."""

    decode_rows_eager: bool = False  # verify steps that no graph replays run as decode rows anyway (cpu backend)
    num_graph_verify_steps: int = 0
    num_eager_verify_steps: int = 0
    num_decode_row_eager_steps: int = 0  # eager verify steps run as decode rows

    def run_batch(self, batch: ForwardBatch, scheduled, runner) -> ForwardBatch:
        """The batch to run for a step of `scheduled` items (module docstring); a decode-only step without drafts
        is returned unchanged (the runner replays the decode graph as off would)."""
        run = batch
        chunked = not all(it.num_tokens - len(it.draft) == 1 for it in scheduled)  # a prompt chunk is in it
        if chunked:
            short = runner.short_extends.flatten(batch, runner.graph_runner)
            if short is not None:
                run = short
        if any(it.draft for it in scheduled):
            flat = run is not batch
            if not chunked:
                run, flat = decode_shaped_if_graphed(batch, runner.graph_runner)
                if not flat and self.decode_rows_eager and batch.state_slots is None:
                    run = decode_shaped(batch)
                    self.num_decode_row_eager_steps += 1
            if flat:
                self.num_graph_verify_steps += 1
            else:
                self.num_eager_verify_steps += 1
        return run


def graph_rows(max_num_seqs: int, num_speculative_tokens: int, token_budget: int) -> int:
    """Rows the decode graphs must cover so that a full verify step replays one: every sequence with k
    drafts, capped by the step's token budget (no step holds more tokens)."""
    return max(1, min(max_num_seqs * (1 + num_speculative_tokens), token_budget))
