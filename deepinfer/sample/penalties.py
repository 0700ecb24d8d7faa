"""Logit penalties, vectorized over the rows that ask for them.

Semantics follow the references users compare against:
- repetition_penalty (CTRL paper, Hugging Face / vLLM): every token seen in the prompt or the
  output so far has its logit divided by the penalty when positive, multiplied when negative;
- frequency_penalty / presence_penalty (OpenAI API, vLLM): subtract `frequency * count` and
  `presence * (count > 0)`, counting the OUTPUT tokens only.
Repetition is applied first, then frequency and presence, as vLLM does.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

import torch

from deepinfer.worker.transfer import tensor_to, to_device

if TYPE_CHECKING:
    from deepinfer.sample.sampler import SamplingRow


# Ceiling of a logit divided by a repetition penalty < 1. Far above any real logit, and low enough
# that dividing by the smallest sampled temperature (1e-5) stays finite in fp32 (max ~3.4e38).
PENALIZED_LOGIT_MAX = 1e30


def _token_matrix(lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """fp32 [len(lists), vocab] counts of each id per row (ids outside [0, vocab) cannot be drawn; skipped)."""
    counts = torch.zeros(len(lists), vocab, dtype=torch.float32, device=device)
    lens = [len(ids) for ids in lists]
    if sum(lens):
        # The ids go to a tensor in C (chain + torch.tensor), not through a Python loop per token:
        # still O(tokens) per step, but ~3x cheaper than building row / token lists in Python.
        t = tensor_to(list(chain.from_iterable(lists)), torch.int64, device)
        r = to_device(torch.repeat_interleave(torch.arange(len(lists)), torch.tensor(lens)), device)
        ok = (t >= 0) & (t < vocab)  # out-of-range ids add 0 (a weight, not a mask: no device sync)
        counts.index_put_((r, t.clamp(0, vocab - 1)), ok.to(torch.float32), accumulate=True)
    return counts


def params_need_penalties(p) -> bool:
    """Whether SamplingParams p sets any penalty (then each draw reads the output ids on the host)."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def needs_penalties(row: SamplingRow) -> bool:
    return params_need_penalties(row.params)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Return logits [N, V] with each row's penalties applied (rows without any are untouched)."""
    idx = [i for i, r in enumerate(rows) if needs_penalties(r)]
    if not idx:
        return logits
    device, vocab = logits.device, logits.shape[1]
    sub_rows = [rows[i] for i in idx]
    index = tensor_to(idx, torch.int64, device)
    sub = logits.index_select(0, index)
    out_counts = _token_matrix([r.output_token_ids for r in sub_rows], vocab, device)

    rep = [float(r.params.repetition_penalty) for r in sub_rows]
    if any(x != 1.0 for x in rep):
        seen = (_token_matrix([r.prompt_token_ids for r in sub_rows], vocab, device) > 0) | (out_counts > 0)
        # A penalty below fp32's smallest normal would round to 0 (or a denormal), and -inf * 0 is
        # NaN: it is raised to that smallest normal. A tiny penalty would still blow a positive logit
        # up to inf, and a row holding inf has a NaN softmax: the quotient is clamped to a finite ceiling.
        rep_t = tensor_to(rep, logits.dtype, device).clamp(min=torch.finfo(logits.dtype).tiny).unsqueeze(1)
        penalized = torch.where(sub > 0, (sub / rep_t).clamp(max=PENALIZED_LOGIT_MAX), sub * rep_t)
        sub = torch.where(seen, penalized, sub)

    freq = tensor_to([float(r.params.frequency_penalty) for r in sub_rows], logits.dtype, device)
    pres = tensor_to([float(r.params.presence_penalty) for r in sub_rows], logits.dtype, device)
    sub = sub - freq.unsqueeze(1) * out_counts - pres.unsqueeze(1) * (out_counts > 0).to(logits.dtype)

    logits = logits.clone()
    logits.index_copy_(0, index, sub)
    return logits
