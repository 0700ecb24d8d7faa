"""The sampler: penalties -> grammar mask -> temperature -> top-k -> top-p -> min-p -> a counter-based draw.

Grammar mask (structured output, sample/grammar/): the rows a GrammarMask names get the tokens their
grammar forbids set to -inf by the backend op `apply_token_bitmask` (one fused op per batch), after
the min-tokens mask and the penalties and before temperature, so every later step (truncation, the
draw, the argmax of greedy rows) sees only allowed tokens.

Batch invariance: every step is row-wise (per-row parameters broadcast as [N, 1] tensors), and
the draw is Gumbel-max with uniforms from rng.py keyed by (seed, position, token id):
    token = argmax_i( log p_i - log(-log u_i) ),  u_i = U(seed, position, i)
which picks token i with probability exactly p_i, and uses no generator state, so a seeded row
gets the same token whatever else is in its batch (and after preemption and recompute).

Greedy rows: temperature 0, any temperature below GREEDY_TEMPERATURE (1e-5, where logits / t
could overflow to inf) and top_k = 1 take the argmax (SamplingParams.greedy).

No NaN for valid parameters: the logits after penalties are finite or -inf (penalties.py clamps
what a tiny repetition penalty would blow up), a row always keeps at least one finite logit
(top-k / top-p / min-p keep the best token; the engine refuses a min_tokens ban of the whole
vocabulary), and t >= 1e-5 cannot overflow them; so logprobs are finite or -inf, never NaN.

Logprobs: the log-softmax of the logits after penalties, the grammar mask and temperature (for a
structured request: the MASKED distribution, forbidden tokens at -inf), before top-k / top-p /
min-p (a truncated distribution would give -inf to most candidates). Greedy rows use
temperature 1 for their logprobs. vLLM by default returns the raw model logprobs instead; we
return the distribution the request actually sampled from (modulo truncation), which is what
OpenAI documents for its logprobs and what Logprob's docstring in outputs.py promises.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.errors import DeepInferError
from deepinfer.outputs import Logprob
from deepinfer.sample.penalties import apply_penalties
from deepinfer.sample.rng import row_keys_device, row_keys_tensor, uniform_tensor
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.backend import Backend
    from deepinfer.sample.grammar.bitmask import GrammarMask
from deepinfer.worker.transfer import tensor_to, to_device

# Elements per chunk of the Gumbel draw: on CUDA the fp64 noise stays ~64 MiB whatever the
# batch; on the CPU a chunk stays in cache (the draw is a dozen elementwise passes).
_DRAW_ELEMS_CUDA = 1 << 23
_DRAW_ELEMS_CPU = 1 << 16
# Fixed-point scale of the top-p running mass: 2^35 per unit keeps a 2^17-token vocab's sum
# below 2^53, where int64 -> fp64 is exact; the resolution (3e-11) is far below fp32 softmax error.
_TOP_P_SCALE = float(1 << 35)


@dataclass
class SamplingRow:
    """One token to draw. position = absolute position of that token (len(prompt) + len(output)).

    num_outputs: output tokens drawn before this one, counting any still pending on the device
    (async scheduling); None = len(output_token_ids).
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int
    position: int
    num_outputs: int | None = None

    @property
    def num_drawn(self) -> int:
        return len(self.output_token_ids) if self.num_outputs is None else self.num_outputs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]  # per row: chosen token first, then the top-k


@dataclass
class DeviceSample:
    """A draw still on the device (no host sync yet): `tensors` go to the host in one go, then
    `output(host_tensors)` builds the SamplerOutput."""

    token_ids: torch.Tensor  # int64 [N]
    logprob_rows: list[int]  # rows that asked for logprobs
    logprob_k: list[int]  # top-k asked per such row
    logprob_tensors: list[torch.Tensor]  # chosen logprob [M], rank [M], top values [M, k], top ids [M, k]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.token_ids, *self.logprob_tensors]

    def output(self, host: list[torch.Tensor]) -> SamplerOutput:
        """host: `tensors`, on the host, in the same order."""
        token_ids = host[0].tolist()
        result: list[dict[int, Logprob] | None] = [None] * len(token_ids)
        if self.logprob_rows:
            tok_lp_l, ranks_l, top_vals_l, top_ids_l = (t.tolist() for t in host[1:5])
            for j, i in enumerate(self.logprob_rows):
                tok = token_ids[i]
                entry = {tok: Logprob(tok, tok_lp_l[j], rank=ranks_l[j])}
                for r, (tid, val) in enumerate(zip(top_ids_l[j], top_vals_l[j])):
                    if r >= self.logprob_k[j]:
                        break
                    if tid not in entry:
                        entry[tid] = Logprob(tid, val, rank=r + 1)
                result[i] = entry
        return SamplerOutput(token_ids, result)


def filter_logits(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    use_sort: bool | None = None,
    use_min_p: bool | None = None,
) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p, then min-p remove; per-row parameters [N].

    top_k >= V, top_p >= 1 and min_p <= 0 switch a filter off for that row. Top-k keeps ties at
    the k-th value (as Hugging Face and vLLM do). Top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches p (at least one token). Min-p removes tokens whose
    probability is below min_p times the largest one.

    use_sort / use_min_p: whether any row has top-k / top-p, min-p on, when the caller knows it
    from the host-side parameters (None: read it from the tensors, a device sync each).
    """
    n, vocab = logits.shape
    neg_inf = logits.new_full((), float("-inf"))  # a fill on the device, not a (stream-syncing) copy
    if use_sort is None:
        use_sort = bool((top_k < vocab).any()) or bool((top_p < 1).any())
    if use_min_p is None:
        use_min_p = bool((min_p > 0).any())
    if use_sort:
        sorted_vals, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
        kth = sorted_vals.gather(1, (top_k.clamp(1, vocab) - 1).unsqueeze(1))
        keep = sorted_vals >= kth
        probs = torch.where(keep, sorted_vals, neg_inf).softmax(dim=-1)
        # The running mass is summed in fixed point: integer addition is exact, so the top-p
        # cut does not depend on how the device's scan kernel groups a batch (CUDA's float
        # cumsum gives a row different roundings in batches of different sizes).
        fixed = (probs.to(torch.float64) * _TOP_P_SCALE).floor().to(torch.int64)
        cum = fixed.cumsum(dim=-1)
        limit = top_p.to(torch.float64).unsqueeze(1) * cum[:, -1:].to(torch.float64)
        keep &= ((cum - fixed).to(torch.float64) < limit) | (top_p >= 1).unsqueeze(1)
        keep[:, 0] = True
        keep_orig = torch.empty_like(keep).scatter_(1, sorted_idx, keep)
        logits = torch.where(keep_orig, logits, neg_inf)
    if use_min_p:
        probs = logits.softmax(dim=-1)
        threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = torch.where(probs < threshold, neg_inf, logits)
    return logits


def gumbel_argmax(logits: torch.Tensor, seeds: list[int], positions: list[int],
                  device_positions: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [N]: a draw from softmax(logits) per row, keyed by (seed, position) only. device_positions: the rows'
    positions as an int64 device tensor, used instead of `positions` (their keys hashed on the device, bit-equal
    to row_key's: rng.py)."""
    n, vocab = logits.shape
    if device_positions is None:
        keys = to_device(row_keys_tensor(seeds, positions), logits.device)
    else:
        keys = row_keys_device(seeds, device_positions)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    step = max(1, (_DRAW_ELEMS_CPU if logits.device.type == "cpu" else _DRAW_ELEMS_CUDA) // max(vocab, 1))
    for s in range(0, n, step):
        u = uniform_tensor(keys[s : s + step], vocab)
        gumbel = -torch.log(-torch.log(u))
        out[s : s + step] = (logits[s : s + step].to(torch.float64) + gumbel).argmax(dim=-1)
    return out


class Sampler:
    """Draws one token per row of logits [N, V>=vocab_size]; ids >= vocab_size are never drawn."""

    def __init__(self, vocab_size: int, eos_token_id: int | Iterable[int] | None = None,
                 backend: Backend | None = None):
        self.vocab_size = vocab_size
        self.backend = backend  # runs the grammar bitmask op; None: the torch-native op
        # EOS id(s), masked with stop_token_ids while a row has fewer than min_tokens outputs
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset([eos_token_id])
        else:
            self.eos_token_ids = frozenset(int(t) for t in eos_token_id)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], grammar: GrammarMask | None = None
                 ) -> SamplerOutput:
        """Draw and read the tokens back (waits for the device)."""
        sample = self.sample(logits, rows, grammar)
        return sample.output([t.cpu() for t in sample.tensors])

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], grammar: GrammarMask | None = None,
               positions: torch.Tensor | None = None) -> DeviceSample:
        """Draw on the device without waiting for it: every host value goes up without a stream
        sync (transfer.py), so the host can queue this while earlier steps still run.

        grammar: the constrained rows and their host bitmask (sample/grammar/bitmask.py), or None.
        positions: each row's position as an int64 device tensor, keying the draws instead of the rows' own (a
        speculative step launched before its positions were known on the host: spec/chained_steps.py)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise DeepInferError(
                f"sampler got logits of shape {tuple(logits.shape)} for {len(rows)} rows and vocab_size "
                f"{self.vocab_size}; expected [{len(rows)}, >= {self.vocab_size}]"
            )
        if not rows:
            return DeviceSample(torch.empty(0, dtype=torch.int64, device=logits.device), [], [], [])
        logits = logits[:, : self.vocab_size].float()
        logits = self._mask_min_tokens(logits, rows)
        logits = apply_penalties(logits, rows)
        device = logits.device
        if grammar is not None and grammar.rows:
            logits = self._apply_grammar(logits, grammar)

        temps = [0.0 if r.params.greedy else float(r.params.temperature) for r in rows]
        sampled = [i for i, t in enumerate(temps) if t > 0]
        if not sampled:  # all greedy: one argmax over the batch (lowest index on ties)
            chosen = logits.argmax(dim=-1)
        else:
            vocab = logits.shape[1]
            srows = [rows[i] for i in sampled]
            # top_k >= vocab (validated <= 2**31 - 1) keeps every token: clamped, so the tensor holds it
            top_k_l = [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in srows]
            top_p_l = [float(r.params.top_p) for r in srows]
            min_p_l = [float(r.params.min_p) for r in srows]
            t = tensor_to([temps[i] for i in sampled], torch.float32, device)
            top_k = tensor_to(top_k_l, torch.int64, device)
            top_p = tensor_to(top_p_l, torch.float32, device)
            min_p = tensor_to(min_p_l, torch.float32, device)
            if len(sampled) == len(rows):  # all sampled: no argmax for greedy rows, no gather
                scaled = logits / t.unsqueeze(1)
            else:
                idx = tensor_to(sampled, torch.int64, device)
                scaled = logits.index_select(0, idx) / t.unsqueeze(1)
            use_sort = any(k < vocab for k in top_k_l) or any(p < 1 for p in top_p_l)
            filtered = filter_logits(scaled, top_k, top_p, min_p, use_sort=use_sort, use_min_p=any(m > 0 for m in min_p_l))
            drawn = gumbel_argmax(filtered, [r.seed for r in srows], [r.position for r in srows],
                                  None if positions is None else
                                  positions if len(sampled) == len(rows) else positions.index_select(0, idx))
            if len(sampled) == len(rows):
                chosen = drawn
            else:
                greedy = tensor_to([i for i, t in enumerate(temps) if t <= 0], torch.int64, device)
                chosen = torch.empty(len(rows), dtype=torch.int64, device=device)
                chosen.index_copy_(0, greedy, logits.index_select(0, greedy).argmax(dim=-1))
                chosen.index_copy_(0, idx, drawn)

        return self._logprobs(logits, rows, temps, chosen)

    def apply_grammar(self, logits: torch.Tensor, grammar: GrammarMask) -> torch.Tensor:
        """A grammar mask applied by this sampler's backend op, on a copy of logits (also what speculative
        decoding's drafter masks its drafts with, spec/grammar_drafts.py)."""
        return self._apply_grammar(logits, grammar)

    def _apply_grammar(self, logits: torch.Tensor, grammar: GrammarMask) -> torch.Tensor:
        """The grammar bitmask on the device (a copy of logits: the caller's tensor is left as it is)."""
        device = logits.device
        bitmask = to_device(grammar.bitmask, device)
        rows = None if grammar.rows == list(range(logits.shape[0])) else tensor_to(grammar.rows, torch.int64, device)
        logits = logits.clone()
        if self.backend is None:
            from deepinfer.backend.native.grammar import apply_token_bitmask

            return apply_token_bitmask(logits, bitmask, rows)
        return self.backend.apply_token_bitmask(logits, bitmask, rows)

    def _mask_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Before min_tokens outputs exist, EOS (unless ignore_eos) and stop_token_ids cannot be drawn."""
        pairs = []
        for i, r in enumerate(rows):
            if r.num_drawn < r.params.min_tokens:
                banned = set(r.params.stop_token_ids)
                if not r.params.ignore_eos:
                    banned |= self.eos_token_ids
                pairs.extend((i, t) for t in banned if 0 <= t < logits.shape[1])
        if not pairs:
            return logits
        logits = logits.clone()
        idx = tensor_to(pairs, torch.int64, logits.device)
        logits[idx[:, 0], idx[:, 1]] = float("-inf")
        return logits

    def _logprobs(self, logits: torch.Tensor, rows: list[SamplingRow], temps: list[float],
                  chosen: torch.Tensor) -> DeviceSample:
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return DeviceSample(chosen, [], [], [])
        device = logits.device
        idx = tensor_to(want, torch.int64, device)
        t = tensor_to([temps[i] if temps[i] > 0 else 1.0 for i in want], torch.float32, device)
        lp = torch.log_softmax(logits.index_select(0, idx) / t.unsqueeze(1), dim=-1)
        tok = chosen.index_select(0, idx)
        tok_lp = lp.gather(1, tok.unsqueeze(1))
        ranks = (lp > tok_lp).sum(dim=-1) + 1
        k = min(max(rows[i].params.logprobs for i in want), lp.shape[1])
        top_vals, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
        return DeviceSample(chosen, want, [rows[i].params.logprobs for i in want],
                            [tok_lp.squeeze(1), ranks, top_vals, top_ids])
