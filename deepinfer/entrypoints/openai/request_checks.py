"""What a request must pass before any engine work: valid Unicode everywhere, no field naming a
feature the server does not implement (fail closed), the per-request work caps, and a prompt
measured against max_model_len without tokenizing all of a huge one.

Each failure is a 400 with the OpenAI error body whose `param` names the field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from deepinfer.entrypoints.openai.errors import OpenAIError, bad_request

logger = logging.getLogger("deepinfer.server")

# ---------------------------------------------------------------- work caps


@dataclass(frozen=True)
class ServerLimits:
    """Per-request work caps (`deepinfer serve` flags; docs/serving.md lists them)."""

    max_choices_per_request: int = 128  # prompts x n (OpenAI's own n limit is 128)
    max_stop_strings: int = 16  # number of stop strings
    max_stop_chars: int = 1024  # their total length in characters
    max_logprobs: int = 20  # completions `logprobs`, chat `top_logprobs` (OpenAI: 20; vLLM's default)
    max_output_tokens: int | None = None  # max_tokens / max_completion_tokens; None: up to max_model_len

    def __post_init__(self) -> None:
        for name in ("max_choices_per_request", "max_stop_strings", "max_stop_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        if not isinstance(self.max_logprobs, int) or not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs must be an integer in [0, 20] (got {self.max_logprobs!r})")
        cap = self.max_output_tokens
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            raise ValueError(f"max_output_tokens must be an integer >= 1 (got {self.max_output_tokens!r})")


def over_cap(message: str, param: str) -> OpenAIError:
    return bad_request(message, param, "limit_exceeded")


def check_caps(
    limits: ServerLimits,
    max_model_len: int,
    *,
    num_prompts: int,
    n: int,
    stop,
    logprobs: int | None,
    logprobs_param: str,
    max_tokens: int | None,
    max_param: str,
) -> None:
    """400 naming the field when the request asks for more work than the server allows."""
    choices = num_prompts * n
    if choices > limits.max_choices_per_request:
        param = "n" if num_prompts == 1 else "prompt"
        raise over_cap(
            f"{param}: this request asks for {num_prompts} prompt(s) x n={n} = {choices} completions; "
            f"the server allows at most {limits.max_choices_per_request} per request",
            param,
        )
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > limits.max_stop_strings:
        raise over_cap(f"stop: {len(stops)} stop strings; the server allows at most {limits.max_stop_strings}", "stop")
    total = sum(len(s) for s in stops if isinstance(s, str))
    if total > limits.max_stop_chars:
        raise over_cap(
            f"stop: the stop strings hold {total} characters; the server allows at most {limits.max_stop_chars} in all",
            "stop",
        )
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise over_cap(
            f"{logprobs_param} must be at most {limits.max_logprobs} on this server (got {logprobs})", logprobs_param
        )
    if max_tokens is not None:
        cap = limits.max_output_tokens
        if cap is not None and max_tokens > cap:
            raise over_cap(f"{max_param} must be at most {cap} on this server (got {max_tokens})", max_param)
        if max_tokens >= max_model_len:  # the prompt takes at least one token of the context
            raise bad_request(
                f"{max_param} is {max_tokens}, but this model's maximum context length is {max_model_len} tokens "
                f"(prompt included); reduce {max_param}",
                max_param,
                "context_length_exceeded",
            )


# ---------------------------------------------------------------- valid Unicode everywhere


def _bad_position(s: str) -> int | None:
    """Index of the first character that is not valid Unicode (a lone UTF-16 surrogate), or None."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def find_invalid_unicode(fields) -> tuple[str, str, int] | None:
    """(top-level field, path, character index) of the first string (or dict key) holding a lone
    surrogate among `fields` ((name, value) pairs: a pydantic model iterates as such), else None."""
    stack = [(name, name, value) for name, value in reversed(list(fields))]
    while stack:
        top, path, value = stack.pop()
        if isinstance(value, str):
            pos = _bad_position(value)
            if pos is not None:
                return top, path, pos
        elif isinstance(value, (list, tuple)):
            if value and isinstance(value[0], int) and not isinstance(value[0], bool):
                if all(type(v) is int for v in value):  # token ids: nothing to check
                    continue
            stack.extend((top, f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            items = list(value.items())
            for k, _ in items:
                if isinstance(k, str) and _bad_position(k) is not None:
                    return top, f"{path} (a key)", _bad_position(k)
            stack.extend((top, f"{path}.{k}", v) for k, v in reversed(items))
        elif hasattr(value, "__pydantic_fields__"):  # a nested model (messages, content parts)
            stack.extend((top, f"{path}.{k}", v) for k, v in reversed(list(value)))
    return None


def check_unicode(req) -> None:
    """400 naming the field when any string in the request (prompt, messages, model, stop, ...) is not
    valid Unicode: JSON can carry lone UTF-16 surrogates ("\\ud800") that no UTF-8 text holds."""
    found = find_invalid_unicode(req)
    if found is not None:
        top, path, pos = found
        raise bad_request(
            f"{path} is not valid Unicode: it holds a lone UTF-16 surrogate at character {pos}", top, "invalid_unicode"
        )


# ---------------------------------------------------------------- fail closed


def _neutral(*values):
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in values)


_NONE = _neutral(None)
_NONE_EMPTY = _neutral(None, [], {}, "")
_NONE_FALSE = _neutral(None, False)
_NONE_TRUE = _neutral(None, True)

# field -> (does the value change nothing?, why it is refused). A field that is neither here nor declared in
# protocol.py is ignored (logged at debug): e.g. user, metadata, store, service_tier, parallel_tool_calls.
# guided_json / guided_regex / guided_grammar / guided_choice, structured_outputs and response_format are
# declared in protocol.py and handled by structured.py; these options of theirs are not implemented:
_COMMON_UNSUPPORTED = {
    "guided_decoding_backend": (_NONE, "the engine's grammar engine is chosen at start-up (--structured-output-backend)"),
    "guided_whitespace_pattern": (_NONE, "a custom whitespace pattern is not implemented"),
    "prompt_logprobs": (_NONE, "prompt logprobs are not implemented"),
    "logit_bias": (_NONE_EMPTY, ""),
    "allowed_token_ids": (_NONE, ""),
    "bad_words": (_NONE_EMPTY, ""),
    "logits_processors": (_NONE_EMPTY, "custom logits processors are not implemented"),
    "use_beam_search": (_NONE_FALSE, "beam search is not implemented"),
    "truncate_prompt_tokens": (_NONE, "prompt truncation is not implemented"),
    "return_tokens_as_token_ids": (_NONE_FALSE, ""),
    "spaces_between_special_tokens": (_NONE_TRUE, "only the default (true) is implemented"),
}
_COMPLETION_UNSUPPORTED = {
    "echo": (_NONE_FALSE, ""),
    "suffix": (_NONE_EMPTY, ""),
    "add_special_tokens": (_NONE_TRUE, "only the default (true) is implemented"),
    "max_completion_tokens": (_NONE, "on /v1/completions the field is max_tokens"),
}
_CHAT_UNSUPPORTED = {
    "functions": (_NONE_EMPTY, "the legacy function calling is not implemented (use tools)"),
    "function_call": (_NONE, "the legacy function calling is not implemented (use tool_choice)"),
    "audio": (_NONE, "audio output is not implemented"),
    "modalities": (lambda v: v is None or v == ["text"], "only ['text'] is implemented"),
    "web_search_options": (_NONE, "web search is not implemented"),
    "reasoning_effort": (_NONE, ""),
    "chat_template": (_NONE, "the model's own chat template is used"),
    "chat_template_kwargs": (_NONE_EMPTY, ""),
    "add_generation_prompt": (_NONE_TRUE, "only the default (true) is implemented"),
    "continue_final_message": (_NONE_FALSE, ""),
    "documents": (_NONE_EMPTY, ""),
    "mm_processor_kwargs": (_NONE_EMPTY, "multimodal inputs are not implemented"),
    "echo": (_NONE_FALSE, ""),
    "add_special_tokens": (_NONE_FALSE, "only the default (false: the template writes BOS) is implemented"),
}

# /tokenize with messages: the fields that would change how the conversation is rendered
_TOKENIZE_CHAT_UNSUPPORTED = {
    "tools": (_NONE_EMPTY, "/tokenize renders messages without tools"),
} | {
    name: _CHAT_UNSUPPORTED[name]
    for name in ("chat_template", "chat_template_kwargs", "documents", "mm_processor_kwargs",
                 "continue_final_message", "add_special_tokens")
}

UNSUPPORTED_FIELDS = {
    "completions": {**_COMMON_UNSUPPORTED, **_COMPLETION_UNSUPPORTED},
    "chat": {**_COMMON_UNSUPPORTED, **_CHAT_UNSUPPORTED},
    "tokenize_chat": _TOKENIZE_CHAT_UNSUPPORTED,
    "tokenize": {},
    "detokenize": {},
}


def _unsupported(field: str, why: str) -> OpenAIError:
    return bad_request(
        f"{field} is not supported by DeepInfer" + (f": {why}" if why else ""), field, "unsupported_parameter"
    )


def check_unsupported(req, endpoint: str) -> None:
    """Fail closed: 400 naming the first field that asks for a feature this server does not implement.
    Unknown fields that change nothing pass, logged at debug level."""
    table = UNSUPPORTED_FIELDS[endpoint]
    extra = req.model_extra or {}
    for name, (is_neutral, why) in table.items():
        value = getattr(req, name, None) if name in type(req).model_fields else extra.get(name)
        if not is_neutral(value):
            raise _unsupported(name, why)
    options = getattr(req, "stream_options", None)
    if options is not None:
        if req.stream is not True:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        extra_options = options.model_extra or {}
        if not _NONE_FALSE(extra_options.get("continuous_usage_stats")):
            raise bad_request(
                "stream_options.continuous_usage_stats is not supported by DeepInfer", "stream_options",
                "unsupported_parameter",
            )
    ignored = sorted(k for k in extra if k not in table)
    if ignored:
        logger.debug("ignoring request fields the server does not use: %s", ", ".join(ignored))


# ---------------------------------------------------------------- prompts measured before tokenized in full

CHUNK_CHARS = 8192  # one tokenizer call counts at most this many characters (it holds the GIL meanwhile)
DIRECT_CHARS = 16384  # a text this short is tokenized in one call, no counting pass
SOFT_CUT_SLACK = 4  # tokens a cut at a word boundary (non-space -> space) may add to the count
HARD_CUT_SLACK = 32  # tokens a cut inside a run without whitespace may add


class PromptTooLong(Exception):
    """The text has at least `at_least` tokens, which is >= the limit it was measured against."""

    def __init__(self, at_least: int):
        super().__init__(at_least)
        self.at_least = at_least


def _cut(text: str, start: int, end: int) -> tuple[int, bool]:
    """Where to end the chunk text[start:end]: just before a whitespace run that follows a
    non-space character in its second half (a word boundary; True), else at `end` (False)."""
    lo = start + CHUNK_CHARS // 2
    i = max(text.rfind(" ", lo, end), text.rfind("\n", lo, end))
    while i > lo and text[i - 1].isspace():
        i -= 1
    if i > lo:
        return i, True
    return end, False


def encode_within(tokenizer, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
    """tokenizer.encode(text, add_special_tokens), unless the text certainly has >= `limit` tokens: then PromptTooLong,
    after tokenizing only about `limit` tokens' worth of it. Runs on a worker thread.

    A text longer than DIRECT_CHARS is first counted chunk by chunk (CHUNK_CHARS each, cut at a
    word boundary where there is one). A cut changes the count only around it (the tokens of the
    word on either side); with the pre-tokenizers of byte-level BPE tokenizers (DeepSeek's) a cut
    before a whitespace run changes nothing. Each cut is allowed SOFT_CUT_SLACK or HARD_CUT_SLACK
    tokens, so the count minus the slack is a lower bound of the true count: once it reaches
    `limit`, the prompt cannot fit and counting stops. (On the test tokenizer, word-boundary cuts
    changed no count and cuts inside CJK / emoji runs at most one token.) A text not refused so is
    tokenized in one call, giving exactly the ids the engine itself would make; it holds fewer than
    `limit` + slack tokens, so that call is bounded too.

    The `tokenizers` library's plain encode holds the GIL while it runs; DeepInfer's Tokenizer uses
    its batch call (which releases it) for texts over 4096 characters, so the event loop waits at
    most for one short call; the counting pass also bounds the work a prompt that cannot fit costs.
    """
    if len(text) <= DIRECT_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    count, slack, pos, n = 0, 0, 0, len(text)
    while pos < n:
        end = min(pos + CHUNK_CHARS, n)
        soft = True
        if end < n:
            end, soft = _cut(text, pos, end)
            slack += SOFT_CUT_SLACK if soft else HARD_CUT_SLACK
        count += len(tokenizer.encode(text[pos:end], add_special_tokens=False))
        pos = end
        if count - slack >= limit:
            raise PromptTooLong(count - slack)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
