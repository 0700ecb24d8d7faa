"""Appends sampled tokens, detokenizes incrementally, applies stop conditions, builds RequestOutputs.

Stop order per new token (as vLLM): EOS (unless ignore_eos) and stop_token_ids
end the sequence with the token kept in token_ids but not in text (unless
include_stop_str_in_output); otherwise the token's text goes through the stop
string checker; then max_tokens and max_model_len end it with "length".
min_tokens holds back every "stop" ending until that many tokens exist.

Text can be deferred (`append_token(..., defer_text=True)`, for a sequence without stop strings): the token id,
its logprobs and every stop condition are applied at once (none of them reads text), and the detokenizer's work
(and the logprobs' decoded text) is queued on the sequence until `flush_text`, in token order. Speculative steps
overlap that work with the next step's device work (spec/pipeline.py, "Overlapped output"). A sequence with stop
strings is never deferred: a stop string can end it, which the next step's schedule must know.

An internal failure in one request's work (sampling its row, its detokenizer or stop checker)
finishes its sequences with finish_reason "error" (`fail`); its RequestOutput.error holds the
first such failure's one-line message (worker/model_runner.py: request_error).
"""

from __future__ import annotations

import time
import weakref

from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.sched.request import Request, SeqStatus, Sequence, length_limit_reached


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        # request -> its error message (requests that failed); weak: it goes with the request
        self._errors: weakref.WeakKeyDictionary[Request, str] = weakref.WeakKeyDictionary()

    def init_seq(self, seq: Sequence) -> None:
        from deepinfer.text.detokenizer import IncrementalDetokenizer
        from deepinfer.text.stop_checker import StopChecker

        p = seq.params
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, skip_special_tokens=p.skip_special_tokens)
        seq.stop_checker = StopChecker(list(p.stop), p.include_stop_str_in_output) if p.stop else None
        seq.logprobs = [] if p.logprobs is not None else None

    def append_token(self, seq: Sequence, token_id: int, logprobs: dict[int, Logprob] | None,
                     defer_text: bool = False) -> None:
        """Add one sampled token to seq and finish it if a stop condition holds. defer_text: queue the token's text
        for `flush_text` where the sequence has no stop strings (module docstring); else text now, after any
        queued text of the sequence."""
        if defer_text and seq.stop_checker is None:
            self._append_id(seq, token_id, logprobs)
            return
        if seq.pending_text:
            self.flush_text(seq)
        p = seq.params
        seq.output_token_ids.append(token_id)
        if seq.logprobs is not None and logprobs is not None:
            self._decode_logprobs(logprobs)
            seq.logprobs.append(logprobs)
        n_out = len(seq.output_token_ids)
        can_stop = n_out >= p.min_tokens

        if can_stop and not p.ignore_eos and token_id in self.eos_token_ids:
            self._finish(seq, "stop", None, stop_token=token_id)
            return
        if can_stop and token_id in p.stop_token_ids:
            self._finish(seq, "stop", token_id, stop_token=token_id)
            return

        delta = seq.detokenizer.add(token_id)
        if seq.stop_checker is not None and can_stop:
            safe, matched = seq.stop_checker.feed(delta)
            seq.text += safe
            if matched is not None:
                self._finish(seq, "stop", matched, flush=False)
                return
        else:  # before min_tokens a stop string is plain text
            seq.text += delta

        # the output ids the host holds (Sequence.ends_by_length also counts a step still in flight)
        if length_limit_reached(p, len(seq.prompt_token_ids), n_out, self.max_model_len):
            self._finish(seq, "length", None)

    def _append_id(self, seq: Sequence, token_id: int, logprobs: dict[int, Logprob] | None) -> None:
        """append_token's stop conditions for a sequence without stop strings, its text queued: EOS and
        stop_token_ids (after min_tokens) end it with "stop", then max_tokens / max_model_len with "length"."""
        p = seq.params
        seq.output_token_ids.append(token_id)
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            eos = not p.ignore_eos and token_id in self.eos_token_ids
            if eos or token_id in p.stop_token_ids:
                seq.pending_text.append((token_id, logprobs, True))
                self._finish(seq, "stop", None if eos else token_id)  # (its text: flush_text's)
                return
        seq.pending_text.append((token_id, logprobs, False))
        if length_limit_reached(p, len(seq.prompt_token_ids), n_out, self.max_model_len):
            self._finish(seq, "length", None)

    def flush_text(self, seq: Sequence) -> None:
        """The queued tokens' text (append_token(defer_text=True)), in order: each token's detokenized delta, a stop
        token's only with include_stop_str_in_output (as `_finish` adds it), and the logprobs' decoded text."""
        pending, seq.pending_text = seq.pending_text, []
        for token_id, logprobs, stop_token in pending:
            if logprobs is not None and seq.logprobs is not None:
                self._decode_logprobs(logprobs)
            if not stop_token or seq.params.include_stop_str_in_output:
                seq.text += seq.detokenizer.add(token_id)

    def _decode_logprobs(self, logprobs: dict[int, Logprob]) -> None:
        token_text = self.tokenizer.token_text
        for lp in logprobs.values():
            if not lp.decoded:
                lp.decoded = token_text(lp.token_id)

    def _finish(self, seq: Sequence, reason: str, stop_reason, stop_token: int | None = None, flush: bool = True) -> None:
        """Held-back text that never became a stop string is emitted; a matched stop string is not."""
        if flush and seq.stop_checker is not None:
            seq.text += seq.stop_checker.flush()
        if stop_token is not None and seq.params.include_stop_str_in_output:
            seq.text += seq.detokenizer.add(stop_token)
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.status = SeqStatus.FINISHED

    def fail(self, seq: Sequence, message: str) -> None:
        """Finish seq with finish_reason "error" (whatever state it was in: the failure may have
        come half-way through appending a token); its request's error is `message` unless an
        earlier failure already set one. Text held back by the stop checker is not flushed (the
        checker may be what failed). The caller frees the sequence's blocks."""
        seq.finish_reason = "error"
        seq.stop_reason = None
        seq.status = SeqStatus.FINISHED
        self._errors.setdefault(seq.request, message)

    def abort(self, seq: Sequence) -> None:
        if not seq.finished:
            if seq.stop_checker is not None:
                seq.text += seq.stop_checker.flush()
            seq.finish_reason = "abort"
            seq.status = SeqStatus.FINISHED

    def make_output(self, req: Request) -> RequestOutput:
        """A snapshot with cumulative text / token_ids / logprobs of every sequence.

        token_ids and logprobs are copies (a consumer on another thread reads them after later
        steps appended more); text is an immutable str; prompt_token_ids is one copy per request,
        shared by its outputs (the engine never changes it), not a new copy every step.
        """
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=s.output_token_ids[:],
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=s.logprobs[:] if s.logprobs is not None else None,
            )
            for s in req.seqs
        ]
        finished = req.finished
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["first_token_time"] = req.first_token_time
        if finished:
            if req.finished_time is None:
                req.finished_time = time.monotonic()
            metrics["finished_time"] = req.finished_time
        if req.output_prompt_token_ids is None:
            req.output_prompt_token_ids = list(req.prompt_token_ids)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.output_prompt_token_ids,
            outputs=outs,
            finished=finished,
            metrics=metrics,
            error=self._errors.get(req),
            num_cached_tokens=req.seqs[0].num_cached_tokens if req.seqs else None,
        )
