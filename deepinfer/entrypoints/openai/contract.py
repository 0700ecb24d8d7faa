"""The server's OpenAPI document (/openapi.json), made to say what the server does.

FastAPI's generated document is corrected and completed here (`openapi_schema`), once per app:

- validation errors are 400 with the OpenAI error body, not FastAPI's 422 `HTTPValidationError`
  (removed, with its component schemas);
- every operation lists the statuses it really answers, each with the `ErrorResponse` schema
  (`route_responses`): 400, 401 (only when an API key is set), 404, 408, 413, 431, 500, 503;
- `/metrics` is `text/plain` (Prometheus' exposition format), streamed completions are
  `text/event-stream`, `HEAD` operations (answered wherever GET is) have no body;
- the request schemas carry the server's real bounds: SamplingParams' ranges, the configured work
  caps (`n`, `stop`, `logprobs`, `max_tokens`), `max_model_len`, the vocabulary (token ids), the
  served model names, the fields accepted only with their neutral value (fail closed:
  request_checks.UNSUPPORTED_FIELDS), and the cross-field rules JSON Schema can say (`top_logprobs`
  needs `logprobs: true`, `stream_options` needs `stream: true`, not both `max_tokens` and
  `max_completion_tokens`, `content` required for system / user messages). What it cannot say is
  in the field descriptions and docs/serving.md: prompt + `max_tokens` within the context,
  `min_tokens` <= `max_tokens`, prompts x `n` and the total length of the stop strings within
  their caps.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from deepinfer.entrypoints.openai.protocol import (
    MAX_N,
    ChatCompletionChunk,
    CompletionChunk,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from deepinfer.entrypoints.openai.structured import JSON_SCHEMA_KEYWORDS
from deepinfer.entrypoints.openai.tools import has_tool_tokens
from deepinfer.sampling_params import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
)

REF = "#/components/schemas/"

ERROR_DESCRIPTIONS = {
    400: "Bad request: a bad type or value, a field naming an unimplemented feature, a work cap or the "
         "context exceeded (`param` names the field)",
    401: "Missing or invalid API key (`Authorization: Bearer <key>`)",
    404: "Unknown model",
    408: "The request line and headers (`--header-timeout`) or the body (`--body-timeout`) did not arrive in time; "
         "the connection is closed",
    413: "The request body exceeds `--max-body-bytes`",
    431: "Too many request headers (`--max-header-count`) or too many bytes of them (`--max-header-bytes`); "
         "the connection is closed",
    500: "Internal error (no details: they are in the server log)",
    503: "Overloaded (waiting queue full, or beyond `--max-connections`) or draining for shutdown; see `Retry-After`",
}

# statuses every operation can answer (the connection limits, an internal error, over capacity)
_ANY = (408, 431, 500, 503)
# ... and those of a POST with a JSON body
_BODY = (400, 404, 408, 413, 431, 500, 503)

def sse(chunk: str) -> dict:
    """The `text/event-stream` content of a streamed completion: each event's `data` is a `chunk` (or,
    after a failure once the stream started, an ErrorResponse), the last one `[DONE]`."""
    data = {"type": "string",
            "if": {"const": "[DONE]"},
            "else": {"contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [{"$ref": REF + chunk}, {"$ref": REF + "ErrorResponse"}]}}}
    return {"text/event-stream": {
        "schema": {"type": "object", "required": ["data"], "properties": {"data": data}},
        "description": f"with `stream: true`: events `data: {{{chunk}}}`, then `data: [DONE]`"}}


def error_responses(*codes: int) -> dict:
    return {code: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[code]} for code in codes}


def route_responses(kind: str, api_key: bool) -> dict:
    """FastAPI `responses=` for a route: "get" (an operational GET), "v1get", "v1get_model", "post"."""
    auth = (401,) if api_key else ()
    codes = {"get": _ANY, "v1get": auth + _ANY, "v1get_model": auth + (404,) + _ANY, "post": auth + _BODY}[kind]
    return error_responses(*sorted(set(codes)))


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _set(props: dict, name: str, schema: dict, description: str | None = None) -> None:
    """Replace a property's schema, keeping its title and default."""
    old = props.get(name, {})
    new = {k: old[k] for k in ("title", "default") if k in old}
    new.update(schema)
    if description:
        new["description"] = description
    props[name] = new


def _sampling(props: dict, state, vocab: int | None, engine_vocab: int | None, limits) -> None:
    """The fields both generation endpoints share (SamplingParams' ranges, the work caps)."""
    names = state.served_model_names
    _set(props, "model", _nullable({"type": "string", "enum": list(names)}),
         "one of the served names (GET /v1/models); absent or null: the first. Another name: 404")
    n_max = min(MAX_N, limits.max_choices_per_request)
    _set(props, "n", {"type": "integer", "minimum": 1, "maximum": n_max},
         f"completions per prompt; prompts x n at most {limits.max_choices_per_request} (--max-choices-per-request)")
    _set(props, "temperature", _nullable({"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE}),
         "below 1e-5: greedy")
    _set(props, "top_p", _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}))
    _set(props, "top_k", _nullable({"type": "integer", "minimum": -1, "maximum": INT32_MAX}), "-1 or 0: off")
    _set(props, "min_p", _nullable({"type": "number", "minimum": 0, "maximum": 1}))
    _set(props, "repetition_penalty",
         _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": MAX_REPETITION_PENALTY}))
    for name in ("presence_penalty", "frequency_penalty"):
        _set(props, name, _nullable({"type": "number", "minimum": -2, "maximum": 2}))
    stop_item = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    _set(props, "stop", {"anyOf": [stop_item,
                                   {"type": "array", "items": stop_item, "maxItems": limits.max_stop_strings},
                                   {"type": "null"}]},
         f"at most {limits.max_stop_strings} strings (--max-stop-strings) of at most {limits.max_stop_chars} "
         "characters in all (--max-stop-chars)")
    token_id = {"type": "integer", "minimum": 0, "maximum": (engine_vocab or INT32_MAX + 1) - 1}
    _set(props, "stop_token_ids", _nullable({"type": "array", "items": token_id}))
    _set(props, "seed", _nullable({"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}))
    _set(props, "min_tokens", {"type": "integer", "minimum": 0, "maximum": _max_tokens(state, limits)["maximum"]},
         "at most the request's max_tokens")
    _set(props, "logit_bias", _nullable({"type": "object", "maxProperties": 0}),
         "not implemented: only {} or null")
    _set(props, "stream_options", _nullable({"$ref": REF + "StreamOptions"}), "only with stream: true")


def completion_default_max_tokens(limits) -> int:
    """What /v1/completions uses when max_tokens is not given: OpenAI's 16, within --max-output-tokens."""
    cap = limits.max_output_tokens
    return 16 if cap is None else min(16, cap)


def _max_tokens(state, limits) -> dict:
    cap = state.max_model_len - 1
    if limits.max_output_tokens is not None:
        cap = min(cap, limits.max_output_tokens)
    return {"type": "integer", "minimum": 1, "maximum": cap}


def _max_tokens_doc(limits) -> str:
    return ("at most max_model_len - 1" + (" and --max-output-tokens" if limits.max_output_tokens else "")
            + "; prompt + max_tokens must fit max_model_len")


def _patch_completion(s: dict, state, vocab, engine_vocab, limits) -> None:
    props = s["properties"]
    _sampling(props, state, vocab, engine_vocab, limits)
    ids = {"type": "array", "minItems": 1, "maxItems": state.max_model_len - 1,
           "items": {"type": "integer", "minimum": 0, "maximum": (vocab or INT32_MAX + 1) - 1}}
    _set(props, "prompt", {"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": limits.max_choices_per_request},
        ids,
        {"type": "array", "items": ids, "minItems": 1, "maxItems": limits.max_choices_per_request},
    ]}, "a text, token ids, or a list of either; each prompt + max_tokens must fit max_model_len "
        "(an empty text is the BOS token alone)")
    _set(props, "max_tokens", _nullable(_max_tokens(state, limits)), _max_tokens_doc(limits) + "; null: up to the "
         "context" + (" (bounded by --max-output-tokens)" if limits.max_output_tokens else ""))
    props["max_tokens"]["default"] = completion_default_max_tokens(limits)
    _set(props, "logprobs", _nullable({"type": "integer", "minimum": 0, "maximum": limits.max_logprobs}))
    _set(props, "echo", {"type": "boolean", "enum": [False]}, "not implemented: only false")
    _set(props, "suffix", _nullable({"type": "string", "maxLength": 0}), "not implemented: only \"\" or null")
    n_max = min(MAX_N, limits.max_choices_per_request)
    _set(props, "best_of", _nullable({"type": "integer", "minimum": 1, "maximum": n_max}),
         "not implemented: only null or the value of n")
    # best_of == n (n absent: 1), said once per value of n
    rules = [{"if": {"not": {"required": ["n"]}},
              "then": {"properties": {"best_of": {"enum": [1, None]}}}}]
    rules += [{"if": {"required": ["n"], "properties": {"n": {"const": k}}},
               "then": {"properties": {"best_of": {"enum": [k, None]}}}} for k in range(1, n_max + 1)]
    # prompts x n within --max-choices-per-request: for each run of n values with the same bound, a list
    # of prompts (an array whose first item is a text or an id list) has at most that many items
    cap, by_bound = limits.max_choices_per_request, {}
    for k in range(2, n_max + 1):
        by_bound.setdefault(cap // k, []).append(k)
    for bound, ks in sorted(by_bound.items(), reverse=True):
        rules.append({"if": {"required": ["n"], "properties": {"n": {"minimum": ks[0], "maximum": ks[-1]}}},
                      "then": {"properties": {"prompt": {
                          "if": {"type": "array", "minItems": 1, "prefixItems": [{"type": ["string", "array"]}]},
                          "then": {"maxItems": bound}}}}})
    s.setdefault("allOf", []).extend(rules)


_TEXT = {"type": "string", "minLength": 1}
_CHOICE = {"type": "array", "minItems": 1, "items": _TEXT}
# identifiers, references and regexes are taken too, but a document cannot say which values compile
_UNSTATED = {"$ref", "$defs", "definitions", "$id", "$schema", "format", "pattern", "patternProperties"}


def _schema_doc() -> dict:
    return {"type": "object", "propertyNames": {"enum": sorted(JSON_SCHEMA_KEYWORDS - _UNSTATED)},
            "description": "a JSON Schema using keywords the engine enforces (docs/structured-output.md; $ref / "
                           "$defs, format, pattern and patternProperties are taken too)"}


def _structured(props: dict) -> None:
    """The structured-output fields of a generation request. Not said here (docs/serving.md says it): a regex,
    grammar or schema the engine cannot compile, a constraint with ignore_eos / min_tokens > 0: 400."""
    _set(props, "guided_json", _nullable(_schema_doc()), "a JSON Schema; keywords the engine does not enforce: 400")
    _set(props, "guided_regex", _nullable(_TEXT), "must compile (400 otherwise)")
    _set(props, "guided_grammar", _nullable(_TEXT), "a Lark grammar (llguidance's syntax); must compile")
    _set(props, "guided_choice", _nullable(_CHOICE))


def _patch_structured_components(components: dict) -> None:
    so = components["StructuredOutputsRequest"]
    so["properties"]["json"] = _nullable(_schema_doc())
    so["properties"]["regex"] = _nullable(_TEXT)
    so["properties"]["grammar"] = _nullable(_TEXT)
    so["properties"]["choice"] = _nullable(_CHOICE)
    for key, values in (("disable_fallback", [False, None]), ("disable_additional_properties", [False, None]),
                        ("whitespace_pattern", [None]), ("structural_tag", [None]), ("backend", [None])):
        so["properties"][key] = {"enum": values, "description": "not implemented: only the neutral value"}
    so["additionalProperties"] = False
    so["description"] = "exactly one of json, regex, grammar, choice, json_object (true)"
    so.setdefault("allOf", []).append({"oneOf": [
        {"required": [k], "properties": {k: {"not": {"type": "null"}}}} for k in ("json", "regex", "grammar",
                                                                                 "choice")] + [
        {"required": ["json_object"], "properties": {"json_object": {"const": True}}}]})
    js = components["JsonSchemaFormat"]
    js["properties"]["schema"] = _schema_doc()
    js["required"] = sorted(set(js.get("required", [])) | {"schema"})
    js["additionalProperties"] = {"type": "null"}


def _patch_chat(s: dict, state, vocab, engine_vocab, limits) -> None:
    props = s["properties"]
    _sampling(props, state, vocab, engine_vocab, limits)
    props["messages"]["minItems"] = 1
    for name in ("max_tokens", "max_completion_tokens"):
        _set(props, name, _nullable(_max_tokens(state, limits)), _max_tokens_doc(limits) + " (give one of the two)")
    _set(props, "top_logprobs", _nullable({"type": "integer", "minimum": 0, "maximum": limits.max_logprobs}),
         "needs logprobs: true")
    if has_tool_tokens(state.tokenizer):
        props["tools"]["description"] = "functions the model may call (DeepSeek's tool-call format)"
        props["tool_choice"]["description"] = ("none | auto (default with tools) | required | a named function; "
                                               "required and named calls are enforced by a grammar")
    else:  # the tokenizer lacks the tool-call tokens: refused (400)
        _set(props, "tools", _nullable({"type": "array", "maxItems": 0}),
             "this model's tokenizer has no tool-call tokens: only [] or null")
        _set(props, "tool_choice", {"type": "null"}, "this model's tokenizer has no tool-call tokens: only null")
    props["response_format"]["description"] = ("text | json_object | json_schema (enforced by the sampler's "
                                               "grammar; an unenforceable keyword is a 400)")
    s["allOf"] = [
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        {"not": {"required": ["max_tokens", "max_completion_tokens"],
                 "properties": {"max_tokens": {"type": "integer"}, "max_completion_tokens": {"type": "integer"}}}},
    ]


def _stream_rule(s: dict) -> None:
    s.setdefault("allOf", []).append(
        {"if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
         "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}})


ROLES = ("system", "developer", "user", "assistant", "tool")


def renderable_roles(tokenizer) -> list[str]:
    """The message roles the model's chat template renders (a template may refuse some, e.g. `tool`:
    /v1/chat/completions answers those 400); found by rendering one message of each role."""
    roles = []
    for role in ROLES:
        try:
            tokenizer.apply_chat_template([{"role": "system" if role == "developer" else role, "content": "x"}],
                                          add_generation_prompt=True)
        except Exception:
            continue
        roles.append(role)
    return roles


def _patch_message(s: dict, roles: list[str]) -> None:
    s["properties"]["role"] = {"type": "string", "enum": roles, "title": "Role",
                               "description": "the roles the model's chat template renders"}
    s["allOf"] = [{"if": {"properties": {"role": {"enum": ["system", "developer", "user", "tool"]}}},
                   "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}},
                  {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
                   "then": {"properties": {"tool_calls": {"anyOf": [{"type": "null"}, {"maxItems": 0}]}}}}]
    s["properties"]["content"]["description"] = "required (not null) for system, developer and user messages"


def _patch_tokenize(components: dict, state, vocab, limits) -> None:
    names = list(state.served_model_names)
    for name in ("TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"):
        _set(components[name]["properties"], "model", _nullable({"type": "string", "enum": names}))
    chat = components["TokenizeChatRequest"]["properties"]
    chat["messages"]["minItems"] = 1
    _set(chat, "continue_final_message", {"type": "boolean", "enum": [False]}, "not implemented: only false")
    _set(chat, "add_special_tokens", {"type": "boolean", "enum": [False]},
         "only false: the chat template writes BOS (as /v1/chat/completions)")
    _set(components["TokenizeCompletionRequest"]["properties"], "prompt", {"type": "string"},
         "refused (400) when it cannot fit max_model_len")
    _set(components["DetokenizeRequest"]["properties"], "tokens",
         {"type": "array", "maxItems": state.max_model_len,
          "items": {"type": "integer", "minimum": 0, "maximum": (vocab or INT32_MAX + 1) - 1}},
         "at most max_model_len ids, each inside the vocabulary")


def _add_models(components: dict, models, mode: str = "validation") -> None:
    _, defs = models_json_schema([(m, mode) for m in models], ref_template=REF + "{model}")
    for name, schema in defs.get("$defs", {}).items():
        components.setdefault(name, schema)


def openapi_schema(app, state, limits, api_key: bool, vocab: int | None, engine_vocab: int | None) -> dict:
    """The corrected document (see the module docstring); built once and cached on the app."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _add_models(components, [TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest])
    _add_models(components, [CompletionChunk, ChatCompletionChunk], "serialization")  # the SSE events
    for name in ("ValidationError", "HTTPValidationError"):
        components.pop(name, None)
    _patch_completion(components["CompletionRequest"], state, vocab, engine_vocab, limits)
    _patch_chat(components["ChatCompletionRequest"], state, vocab, engine_vocab, limits)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        _stream_rule(components[name])
    _patch_message(components["ChatMessage"], renderable_roles(state.tokenizer))
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        _structured(components[name]["properties"])
    _patch_structured_components(components)
    components["ResponseFormat"]["allOf"] = [
        {"if": {"properties": {"type": {"const": "json_schema"}}},
         "then": {"required": ["json_schema"], "properties": {"json_schema": {"not": {"type": "null"}}}},
         "else": {"properties": {"json_schema": {"type": "null"}}}}]
    _patch_tokenize(components, state, vocab, limits)

    bodies = {
        "/tokenize": {"anyOf": [{"$ref": REF + "TokenizeCompletionRequest"}, {"$ref": REF + "TokenizeChatRequest"}]},
        "/detokenize": {"$ref": REF + "DetokenizeRequest"},
    }
    if api_key:
        schema["components"]["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            op.get("responses", {}).pop("422", None)
            if path in bodies:
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": bodies[path]}}}
            if api_key and (path.startswith("/v1/") or path in bodies):
                op["security"] = [{"bearerAuth": []}]
            if method == "head":  # same statuses and headers as GET, never a body
                for response in op.get("responses", {}).values():
                    response.pop("content", None)
    return copy.deepcopy(schema)


def install(app, state, limits, api_key: bool, vocab: int | None, engine_vocab: int | None) -> None:
    """Serve the corrected document at /openapi.json."""
    cache: dict[str, Any] = {}

    def openapi() -> dict:
        if "schema" not in cache:
            cache["schema"] = openapi_schema(app, state, limits, api_key, vocab, engine_vocab)
        return cache["schema"]

    app.openapi = openapi
