"""Request and sequence state. A request with n > 1 is n sequences scheduled independently."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from deepinfer.outputs import Logprob
from deepinfer.sampling_params import SamplingParams


def length_limit_reached(params: SamplingParams, num_prompt: int, num_output: int, max_model_len: int) -> bool:
    """The length rule, in one place: a sequence with num_output output tokens ends ("length") once it has
    max_tokens of them or prompt + output fills max_model_len."""
    return (params.max_tokens is not None and num_output >= params.max_tokens) or \
        num_prompt + num_output >= max_model_len


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generated continuation: the unit the scheduler batches and the KV manager pages.

    num_computed_tokens counts tokens whose KV is in the cache. After preemption
    it drops to 0 and the sequence recomputes prompt + generated tokens; it
    samples again only once every token it holds is computed.

    num_pending counts tokens drawn on the device but not yet read by the host (async
    scheduling: the step that draws them is still in flight). They are the placeholders at
    the end of the token list: num_tokens includes them, so the scheduler schedules the next
    decode at the right position, while output_token_ids holds only real ids. The input id of
    a pending token comes from the previous step's device tensor (row pending_row of it).
    """

    seq_id: str
    request: "Request"
    index: int
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    num_preemptions: int = 0
    num_pending: int = 0
    pending_row: int = -1
    # prefix cache: chained keys of this sequence's full blocks (kv/prefix_cache.py), grown as needed; and
    # the prompt tokens its first admission found cached (None until admitted)
    block_keys: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None
    # text state, owned by the output processor
    detokenizer: Any = None
    stop_checker: Any = None
    # tokens appended with their text deferred (OutputProcessor.append_token(defer_text=True)): (token id, its
    # logprobs or None, whether it ended the sequence as a stop token), made into text by OutputProcessor.flush_text
    pending_text: list = field(default_factory=list)
    # structured output: the sequence's grammar state (sample/grammar/matcher_state.py: SeqGrammar), or None
    grammar: Any = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, including those still pending on the device."""
        return len(self.request.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    def ends_by_length(self, max_model_len: int) -> bool:
        """Whether the tokens drawn so far (pending ones included) already reach max_tokens or
        max_model_len, so the sequence finishes when they are read, whatever they are."""
        return length_limit_reached(self.request.params, len(self.request.prompt_token_ids),
                                    len(self.output_token_ids) + self.num_pending, max_model_len)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        prompt = self.request.prompt_token_ids
        p = len(prompt)
        if end <= p:
            return prompt[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return prompt[start:] + self.output_token_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    """What add_request received, plus timing for metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished_time: float | None = None
    output_prompt_token_ids: list[int] | None = None  # the copy every RequestOutput shares (made once)
    # penalties read the ids of the output so far: the next step needs the last token on the host
    needs_host_tokens: bool = False

    @property
    def finished(self) -> bool:
        for s in self.seqs:
            if s.status is not SeqStatus.FINISHED:
                return False
        return True
