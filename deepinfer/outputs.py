"""What generate() returns and what the streaming API yields."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One candidate token's log-probability (from the distribution after penalties and temperature)."""

    token_id: int
    logprob: float
    decoded: str = ""
    rank: int | None = None  # 1 = most likely


@dataclass
class CompletionOutput:
    """One of the n sequences of a request."""

    index: int
    text: str
    token_ids: list[int]
    # "stop" | "length" | "abort" | "error" (an internal failure: RequestOutput.error says what) | None while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: chosen + top-k

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step; `outputs` holds its n sequences.

    error: None, or, when an internal error in this request's own work failed it, a one-line
    message naming the request id, the stage and the exception, e.g. "internal error in request
    'r1' while sampling: ValueError: ..." (stages: "sampling", "processing its output"). Such a
    request is finished and its failed sequences have finish_reason "error" (all its sequences
    that had not finished yet when it failed); the traceback is in the log ("deepinfer" logger),
    never in the message. Other requests in the same steps are unaffected.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first_token, finished times
    error: str | None = None  # set when an internal error failed this request (see above)
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (None: not admitted yet)

    # Single-sequence conveniences (o.text, o.token_ids, o.finish_reason), as the quickstart uses.
    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None
