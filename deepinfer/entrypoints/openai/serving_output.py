"""How engine outputs become OpenAI JSON and SSE: output deltas per choice, usage, logprob entries
(a log-probability of -inf is written as LOGPROB_FLOOR: JSON has no -inf), strict serialization
(NaN refused, so a bug is an error, not invalid JSON) and the error bodies / events of a request
the engine failed.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

from deepinfer.entrypoints.openai.async_engine import (
    EngineStepError,
    EngineStoppedError,
    RequestFailedError,
)
from deepinfer.entrypoints.openai.errors import (
    OpenAIError,
    internal_error,
)
from deepinfer.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from deepinfer.outputs import CompletionOutput, Logprob

logger = logging.getLogger("deepinfer.server")


@dataclass
class DeltaTracker:
    """Turns cumulative CompletionOutputs into deltas (text, new token ids, new logprobs)."""

    text_len: int = 0
    num_tokens: int = 0
    num_logprobs: int = 0
    finished: bool = False

    def delta(self, out: CompletionOutput) -> tuple[str, list[int], list[dict[int, Logprob]]]:
        text = out.text[self.text_len :]
        self.text_len = len(out.text)
        tokens = out.token_ids[self.num_tokens :]
        self.num_tokens = len(out.token_ids)
        logprobs = []
        if out.logprobs is not None:
            logprobs = out.logprobs[self.num_logprobs :]
            self.num_logprobs = len(out.logprobs)
        return text, tokens, logprobs


class ChoiceDeltas:
    """Delta tracking for every choice of one stream (shared by chat and completions).

    `delta` returns None when the choice has nothing a client can see yet (e.g. half a UTF-8
    character) or already finished; it counts completion tokens as choices finish.
    """

    def __init__(self, logprobs: bool):
        self.logprobs = logprobs
        self.trackers: dict[int, DeltaTracker] = {}
        self.completion_tokens = 0

    def delta(self, index: int, out: CompletionOutput) -> tuple[str, list[int], list[dict[int, Logprob]]] | None:
        tracker = self.trackers.setdefault(index, DeltaTracker())
        if tracker.finished:
            return None
        text, tokens, entries = tracker.delta(out)
        if not out.finished and not text and (not tokens or not self.logprobs):
            return None
        tracker.finished = out.finished
        if out.finished:
            self.completion_tokens += len(out.token_ids)
        return text, tokens, entries


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
    """OpenAI's usage block; prompt_tokens_details.cached_tokens counts prompt tokens the prefix cache served."""
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def chunk_event(chunk, include_usage: bool) -> str:
    """One SSE event for a streamed chunk; `usage` is in the payload only when the client asked for it."""
    data = chunk.model_dump()
    if not include_usage:
        data.pop("usage")
    return sse(data)


LOGPROB_FLOOR = -9999.0  # what a log-probability of -inf is written as (vLLM's sentinel): JSON has no -inf


def finite_logprob(value: float) -> float:
    """-inf (a token the sampler masked out) -> LOGPROB_FLOOR. NaN is left as is: serialization
    refuses it (allow_nan=False), so such a bug fails loudly instead of writing invalid JSON."""
    return LOGPROB_FLOOR if value == -math.inf else value


def top_entries(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely candidates (the chosen token is added by the sampler when outside the top k)."""
    return sorted(entry.values(), key=lambda lp: -lp.logprob)[:k]


def chosen_logprob(entry: dict[int, Logprob], token_id: int) -> float | None:
    lp = entry.get(token_id)
    return None if lp is None else finite_logprob(lp.logprob)


def dumps(payload) -> str:
    """Compact JSON that is valid JSON: NaN / Infinity raise ValueError instead of being written."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sse(payload) -> str:
    body = payload if isinstance(payload, str) else dumps(payload)
    return f"data: {body}\n\n"


def request_failed(exc: RequestFailedError, response_id: str) -> OpenAIError:
    """The 500 for a request the engine failed alone: names it an internal error and the request,
    never the engine's exception text (that is in the server log)."""
    return internal_error(
        f"Internal error: the server failed while generating request {response_id} and stopped it "
        "(other requests are not affected; the server log has the details)"
    )


def step_failed(response_id: str) -> OpenAIError:
    """The 500 when a whole engine step failed (every request in flight was stopped); the exception
    itself is in the server log, not in the body."""
    return internal_error(
        f"Internal error: an engine step failed while generating request {response_id}; the requests in "
        "flight were stopped (the server log has the details)"
    )


def stream_error_event(exc: BaseException, response_id: str | None = None) -> str:
    """An error that happens after the stream started cannot change the status: send it as an event
    (`data: {"error": {...}}`; the caller then sends `data: [DONE]` and ends the stream)."""
    if isinstance(exc, OpenAIError):
        err = exc
    elif isinstance(exc, RequestFailedError):
        err = request_failed(exc, response_id or exc.request_id)
    elif isinstance(exc, EngineStepError):
        err = step_failed(response_id or "-")
    elif isinstance(exc, EngineStoppedError):
        err = internal_error(str(exc))
    else:
        logger.exception("error while streaming", exc_info=exc)
        err = internal_error()
    return sse(err.body())

