"""What the engine accepts as prompts and sampling settings, checked before anything is queued.

Every problem is an InvalidRequestError (PromptTooLongError for length) naming the field, so the
offline API and the streaming API reject the same inputs with the same messages.
"""

from __future__ import annotations

import numbers
from typing import Any

from deepinfer.errors import InvalidRequestError, PromptTooLongError
from deepinfer.sampling_params import SamplingParams

_INT_ONLY = {int}  # the fast path's set of entry types: exactly int (bool, a subclass, is a distinct type)


def is_token_id(t) -> bool:
    """Python and numpy integers (not bools) are token ids."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _check_unicode(text: str, param: str) -> None:
    """InvalidRequestError when text holds a lone surrogate (not valid Unicode: no UTF-8 form)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} is not valid Unicode: lone surrogate {text[exc.start]!r} at character {exc.start}", param=param
        ) from None


def prompt_token_ids(prompt: str | list[int], tokenizer, vocab_size: int, max_model_len: int) -> tuple[str | None, list[int]]:
    """(prompt text or None, its token ids): a string is tokenized, a list of ids is checked against the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty", param="prompt")
        try:
            ids = tokenizer.encode(prompt)
        except (TypeError, ValueError):  # the Rust tokenizer refuses a str with a lone surrogate (TypeError)
            _check_unicode(prompt, "prompt")  # checked only then: no extra pass over a valid prompt
            raise
        text = prompt
    elif isinstance(prompt, (list, tuple)):
        text, ids = None, list(prompt)
        # Fast path for plain ints (what tokenizers and the server give): C-level passes only (map(type) into a
        # set, min, max) instead of a Python loop of isinstance checks, which cost ~12 ms per 2k tokens, a
        # visible share of a prefix hit's TTFT at long contexts (a generator of `type(t) is int` still ran
        # Python per token: ~0.5 ms per 8k). Anything else (bools, numpy ints, a bad entry, an id out of range)
        # takes the loop, which names the first offending position.
        if not (ids and set(map(type, ids)) == _INT_ONLY and min(ids) >= 0 and max(ids) < vocab_size):
            for i, t in enumerate(ids):
                if not is_token_id(t):
                    raise InvalidRequestError(f"prompt token {i} is {t!r}, not an integer id", param="prompt")
                ids[i] = int(t)
                if not 0 <= t < vocab_size:
                    raise InvalidRequestError(
                        f"prompt token {i} has id {t}, outside the vocabulary [0, {vocab_size})", param="prompt"
                    )
    else:
        raise InvalidRequestError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", param="prompt"
        )
    if not ids:
        raise InvalidRequestError("prompt is empty (no tokens)", param="prompt")
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"prompt has {len(ids)} tokens but max_model_len is {max_model_len} "
            "(prompt and generated tokens must fit; at least one token must be generated)",
            param="prompt",
        )
    return text, ids


def prompt_list(prompts) -> list:
    """generate()'s prompts as a list: one string or one list of ids is a single prompt."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and all(is_token_id(t) for t in prompts)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(f"prompts must be a string or a list, got {type(prompts).__name__}", param="prompts")
    return list(prompts)


def params_list(sampling_params, kwargs: dict[str, Any], n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, from a single one, a list of n, or sampling keyword arguments."""
    if sampling_params is not None and kwargs:
        raise InvalidRequestError(
            f"give sampling_params or sampling keyword arguments ({', '.join(kwargs)}), not both",
            param="sampling_params",
        )
    if sampling_params is None:
        try:
            sampling_params = SamplingParams(**kwargs)
        except TypeError as exc:
            raise InvalidRequestError(f"unknown sampling parameter: {exc}", param="sampling_params") from None
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != n:
            raise InvalidRequestError(f"got {len(sampling_params)} SamplingParams for {n} prompts", param="sampling_params")
        for p in sampling_params:
            if not isinstance(p, SamplingParams):
                raise InvalidRequestError(
                    f"sampling_params items must be SamplingParams, got {type(p).__name__}", param="sampling_params"
                )
        return list(sampling_params)
    raise InvalidRequestError(
        f"sampling_params must be SamplingParams or a list of them, got {type(sampling_params).__name__}",
        param="sampling_params",
    )
