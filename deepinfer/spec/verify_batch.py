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

from deepinfer.worker.decode_rows import decode_shaped, decode_shaped_if_graphed  # noqa: F401 (spec's names)


def graph_rows(max_num_seqs: int, num_speculative_tokens: int, token_budget: int) -> int:
    """Rows the decode graphs must cover so that a full verify step replays one: every sequence with k
    drafts, capped by the step's token budget (no step holds more tokens)."""
    return max(1, min(max_num_seqs * (1 + num_speculative_tokens), token_budget))
