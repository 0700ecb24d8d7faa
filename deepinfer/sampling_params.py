"""Per-request sampling settings, validated on construction (and again when a request is queued)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deepinfer.errors import InvalidRequestError, StructuredOutputError

# Below this a temperature counts as greedy (vLLM's _SAMPLING_EPS): logits / t with a smaller t
# can overflow fp32 to inf (and the softmax of a row holding inf is NaN).
GREEDY_TEMPERATURE = 1e-5
# Above this the distribution is already near uniform for any realistic logits (a logit gap of
# 10 becomes 0.1); larger values change nothing useful and only push logits / t toward 0. The
# OpenAI API caps at 2 (recent vLLM too); 100 keeps every value those accept, and more.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0  # a penalty p and 1/p mirror each other; 100 already forces seen tokens out
MAX_N = 128  # sequences per request (the server has its own, lower caps)
MAX_LOGPROBS = 20  # the OpenAI API's top_logprobs limit
INT32_MAX = 2**31 - 1  # top_k, max_tokens, min_tokens, stop_token_ids: what an int32 tensor holds
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seed: what the counter-based RNG keys on (rng.py)


STRUCTURED_KINDS = ("json", "regex", "grammar", "choice", "json_object")
WHITESPACE_MODES = ("flexible", "compact")


@dataclass
class StructuredOutputsParams:
    """A constraint compiled into the sampler (docs/structured-output.md): exactly one kind is set.

    - json: a JSON Schema (a dict, or its JSON text) the output must validate against. Every
      keyword must be one the chosen engine enforces; any other (uniqueItems, not, if/then/else,
      an unknown keyword, ...) is a StructuredOutputError naming it, never silently dropped.
    - regex: the output must fullmatch this regular expression (Rust `regex` syntax under
      llguidance, XGrammar's ECMAScript-like syntax under xgrammar).
    - grammar: a context-free grammar in the engine's own syntax: llguidance's Lark-like syntax
      (`start: ...`, https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md) under the
      default llguidance engine; XGrammar's EBNF (GBNF style, `root ::= ...`) under xgrammar.
    - choice: a non-empty list of non-empty strings; the output is exactly one of them.
    - json_object: True = any JSON object (OpenAI's response_format {"type": "json_object"}).
    - whitespace: "flexible" (default: any JSON whitespace between tokens) or "compact" (none:
      `{"a":1}`); enforced by both engines, meaningful for json / json_object only.

    Validated on construction (types, exactly one kind); what needs the engine (keywords, syntax,
    compile time and size limits) is checked by the engine's add_request.
    """

    json: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool = False
    whitespace: str = "flexible"

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.validate()

    @property
    def kind(self) -> str:
        """The one kind that is set ("json", "regex", "grammar", "choice" or "json_object")."""
        for name in STRUCTURED_KINDS[:-1]:
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def validate(self) -> None:
        """Raise StructuredOutputError (field = the StructuredOutputsParams field) for a bad value."""
        import json as _json

        if not isinstance(self.json_object, bool):
            raise StructuredOutputError("json_object", f"json_object must be a boolean (got {self.json_object!r})")
        given = [n for n in STRUCTURED_KINDS[:-1] if getattr(self, n) is not None] + (
            ["json_object"] if self.json_object else [])
        if len(given) != 1:
            field_name = given[1] if len(given) > 1 else "json"
            raise StructuredOutputError(
                field_name, "structured_outputs needs exactly one of json, regex, grammar, choice, json_object "
                f"(got {', '.join(given) if given else 'none'})")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as exc:
                    raise StructuredOutputError("json", f"json is not valid JSON text: {exc}") from None
            if not isinstance(schema, dict):
                raise StructuredOutputError(
                    "json", f"json must be a JSON Schema object (a dict or its JSON text; got {type(schema).__name__})")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise StructuredOutputError(name, f"{name} must be a non-empty string (got {v!r:.200})")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise StructuredOutputError("choice", f"choice must be a non-empty list of non-empty strings "
                                        f"(got {self.choice!r:.200})")
        if self.whitespace not in WHITESPACE_MODES:
            raise StructuredOutputError("whitespace", f"whitespace must be one of {list(WHITESPACE_MODES)} "
                                        f"(got {self.whitespace!r:.100})")
        if self.whitespace != "flexible" and given[0] not in ("json", "json_object"):
            raise StructuredOutputError("whitespace", f"whitespace applies to json / json_object only, "
                                        f"not to {given[0]}")

    def schema(self) -> dict | None:
        """The JSON Schema as a Python value (json parsed when given as text); None for other kinds."""
        import json as _json

        return _json.loads(self.json) if isinstance(self.json, str) else self.json


def _as_list(value):
    """None -> [], any other iterable (list, tuple, set, ...) -> a list; a non-iterable stays as it is."""
    if value is None:
        return []
    if isinstance(value, list):
        return value
    try:
        return list(value)
    except TypeError:
        return value


@dataclass
class SamplingParams:
    """How to draw tokens for one request (names follow vLLM / the OpenAI API).

    Every value is checked by `validate()` (at construction and again in the engine's
    add_request) so that nothing the sampler cannot represent is ever queued: a bad value is an
    InvalidRequestError whose `param` names the field. Accepted values:

    - n: int in [1, MAX_N = 128].
    - temperature: finite number in [0, MAX_TEMPERATURE = 100]; below GREEDY_TEMPERATURE = 1e-5
      (vLLM's threshold) it is greedy (`greedy`), so logits / t never overflows.
    - top_p: finite number in (0, 1].
    - top_k: int, -1 or 0 (off) or in [1, 2**31 - 1]; a top_k >= the vocabulary size keeps every
      token (the sampler clamps it to the vocabulary).
    - min_p: finite number in [0, 1].
    - repetition_penalty: finite number in (0, MAX_REPETITION_PENALTY = 100] (1 = off). Very small
      penalties divide positive logits by a tiny number: the sampler clamps the result to a
      finite value (sample/penalties.py), so no inf or NaN comes of it.
    - presence_penalty, frequency_penalty: finite numbers in [-2, 2] (the OpenAI API's range).
    - max_tokens: None (up to max_model_len) or int in [1, 2**31 - 1].
    - min_tokens: int in [0, 2**31 - 1], and <= max_tokens.
    - stop: a list of non-empty strings that are valid Unicode (no lone surrogates); a single
      string is taken as a one-element list.
    - stop_token_ids: a list of ints in [0, 2**31 - 1]; the engine's add_request also requires
      each to be < the model's vocabulary size (as vLLM's _validate_stop_token_ids does: an id
      outside the vocabulary can never be drawn, so it is refused rather than ignored).
    - logprobs, prompt_logprobs: None or int in [0, MAX_LOGPROBS = 20] (prompt_logprobs is
      refused by the engine: not built yet).
    - seed: None or int in [-2**63, 2**63 - 1] (int64; the RNG reads a seed modulo 2**64, so a
      wider value would silently alias another seed).
    - ignore_eos, include_stop_str_in_output, skip_special_tokens: bool.
    - structured_outputs: None or a StructuredOutputsParams (a JSON Schema, regex, grammar,
      choice list or json_object compiled into the sampler's token mask); the engine refuses it
      together with ignore_eos or min_tokens > 0 (the grammar decides where the output ends).

    Numbers are Python ints / floats: bool is never a number, and a float is never an int
    (n=1.5 and n=2.0 are both refused).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token + top-k
    prompt_logprobs: int | None = None
    seed: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list(self.stop)
        self.stop_token_ids = _as_list(self.stop_token_ids)
        self.validate()  # what is still not a list (a number, ...) is refused there, naming the field

    def validate(self) -> None:
        """Raise InvalidRequestError (param = the field) for any value outside the documented ranges."""

        def bad(param: str, why: str) -> InvalidRequestError:
            value = repr(getattr(self, param))
            if len(value) > 200:
                value = value[:200] + "..."
            return InvalidRequestError(f"{param} {why} (got {value})", param=param)

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def int_in(v, lo: int, hi: int) -> bool:
            return is_int(v) and lo <= v <= hi

        if not int_in(self.n, 1, MAX_N):
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if not is_num(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be a finite number in [0, {MAX_TEMPERATURE:g}]")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be a finite number in (0, 1]")
        if not is_int(self.top_k) or not (self.top_k in (-1, 0) or 1 <= self.top_k <= INT32_MAX):
            raise bad("top_k", f"must be -1 (off), 0 (off) or an integer in [1, {INT32_MAX}]")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be a finite number in [0, 1]")
        if not is_num(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"must be a finite number in (0, {MAX_REPETITION_PENALTY:g}]")
        if not is_num(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be a finite number in [-2, 2]")
        if not is_num(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be a finite number in [-2, 2]")
        if self.max_tokens is not None and not int_in(self.max_tokens, 1, INT32_MAX):
            raise bad("max_tokens", f"must be an integer in [1, {INT32_MAX}]")
        if not int_in(self.min_tokens, 0, INT32_MAX):
            raise bad("min_tokens", f"must be an integer in [0, {INT32_MAX}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", "must not exceed max_tokens")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a string or a list of non-empty strings")
        for s in self.stop:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise bad("stop", "must be valid Unicode (it holds a lone surrogate)") from None
        if not isinstance(self.stop_token_ids, list) or not all(int_in(t, 0, INT32_MAX) for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be a list of integers in [0, {INT32_MAX}]")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")
        if self.logprobs is not None and not int_in(self.logprobs, 0, MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not int_in(self.prompt_logprobs, 0, MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not int_in(self.seed, INT64_MIN, INT64_MAX):
            raise bad("seed", f"must be an integer in [{INT64_MIN}, {INT64_MAX}] (int64)")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be None or a StructuredOutputsParams")
            self.structured_outputs.validate()
            if self.ignore_eos:
                raise bad("ignore_eos", "cannot be combined with structured_outputs (the grammar ends the output)")
            if self.min_tokens:
                raise bad("min_tokens", "must be 0 with structured_outputs (the grammar decides where the output "
                          "ends; banning EOS could leave no allowed token)")

    @property
    def greedy(self) -> bool:
        """Argmax, no draw: temperature below GREEDY_TEMPERATURE (0 included) or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
