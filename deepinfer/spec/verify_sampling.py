"""Sampling a speculative step's verified positions: one row per position (a sequence's real token and each of
its drafts), drawn by the ordinary sampler, with a failure of one sequence's rows failing that request only; and the
host path's verification of the draw (`verify_on_host`; the one-sync step verifies on the device, spec/one_sync.py).

Isolation, as the non-speculative step does it (worker/model_runner.py: `_sample`): the whole batch is drawn at
once; if that raises, each sequence's rows are drawn alone, the sequences whose rows raise by themselves are left
out (their requests fail with the error, the caller's `_failed`), and the rest are drawn again. A batch that fails
while no sequence's rows fail alone is not one request's failure, and raises. Only host-side exceptions can be
isolated this way (a device fault surfaces later, for everyone).
"""

from __future__ import annotations

import logging

import torch

from deepinfer.sample.sampler import SamplerOutput, SamplingRow
from deepinfer.spec.rejection import greedy_verify
from deepinfer.worker.model_runner import request_error
from deepinfer.worker.transfer import tensor_to

logger = logging.getLogger("deepinfer")


def verified_rows(items, sampling: list[int]) -> list[SamplingRow]:
    """The sampler rows of the sampling items (indices into items, the step's ScheduledSeqs): for each, the target's
    token at positions n .. n + len(draft), the drafts before each position as its context."""
    rows: list[SamplingRow] = []
    append = rows.append
    for i in sampling:  # per sequence its fields once, then a row per position (the sampler reads ~4 per step)
        seq, draft = items[i].seq, items[i].draft
        req = seq.request
        n, params, prompt, outs, seed = seq.num_tokens, req.params, req.prompt_token_ids, seq.output_token_ids, seq.seed
        drawn = n - len(prompt)
        append(SamplingRow(params, prompt, outs, seed, n, drawn))
        host = req.needs_host_tokens
        for j in range(1, len(draft) + 1):
            append(SamplingRow(params, prompt, outs + draft[:j] if host else outs, seed, n + j, drawn + j))
    return rows


def _draw(sampler, logits: torch.Tensor, rows: list[SamplingRow], grammar):
    """The sampler's draw; the mask is passed only when there is one (a sampler without structured output support,
    such as a test double, keeps its two-argument sample())."""
    return sampler.sample(logits, rows) if grammar is None else sampler.sample(logits, rows, grammar)


def sample_isolated(sampler, logits: torch.Tensor, rows: list[SamplingRow], items, sampling: list[int], grammar
                    ) -> tuple[object | None, list[int], dict[int, str]]:
    """(the draw, the sampling indices it covers, failed index -> error). logits / rows / grammar: len(draft) + 1
    rows per sampling item, in order."""
    try:
        return _draw(sampler, logits, rows, grammar), sampling, {}
    except Exception as exc:  # noqa: BLE001 - re-raised below unless one sequence's rows alone reproduce it
        batch_exc = exc
    failed: dict[int, str] = {}
    spans, r = [], 0
    for i in sampling:
        n = len(items[i].draft) + 1
        spans.append((i, r, n))
        try:
            _draw(sampler, logits[r:r + n], rows[r:r + n],
                  grammar.select(list(range(r, r + n))) if grammar is not None else None)
        except Exception as exc:  # this sequence's own failure
            rid = items[i].seq.request.request_id
            logger.exception("request %r: sampling its verified rows raised; the request fails, the others go on",
                             rid)
            failed[i] = request_error(rid, "sampling", exc)
        r += n
    if not failed:
        raise batch_exc
    keep = [j for i, start, n in spans if i not in failed for j in range(start, start + n)]
    kept = [i for i in sampling if i not in failed]
    if not kept:
        return None, [], failed
    sample = _draw(sampler, logits.index_select(0, tensor_to(keep, torch.int64, logits.device)),
                   [rows[j] for j in keep], grammar.select(keep) if grammar is not None else None)
    return sample, kept, failed


def verify_on_host(items, sampling: list[int], out: SamplerOutput) -> tuple[list[int], list[list[int]], int]:
    """The draw read back (out: len(draft) + 1 rows per sampling item, in order) verified by `greedy_verify`:
    (accepted drafts per sampling item, its emitted tokens, the most drafts an item verified)."""
    k = max(len(items[i].draft) for i in sampling)
    if not k:  # no drafts this step (adaptive pause, first steps): one token each, nothing to verify
        return [0] * len(sampling), [[t] for t in out.token_ids], 0
    target_rows, draft_rows, lens_list = [], [], []
    r = 0
    for i in sampling:  # padded host lists, then one tensor each (not two small tensors per sequence)
        d = items[i].draft
        pad = [0] * (k - len(d))
        target_rows.append(out.token_ids[r : r + len(d) + 1] + pad)
        draft_rows.append(list(d) + pad)
        lens_list.append(len(d))
        r += len(d) + 1
    verdict = greedy_verify(torch.tensor(target_rows, dtype=torch.int64), torch.tensor(draft_rows, dtype=torch.int64),
                            torch.tensor(lens_list, dtype=torch.int64))
    num_acc = verdict.num_accepted.tolist()
    return num_acc, [row[: a + 1] for row, a in zip(verdict.tokens.tolist(), num_acc)], k
