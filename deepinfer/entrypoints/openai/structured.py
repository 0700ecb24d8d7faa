"""Request fields -> one StructuredOutputsParams: OpenAI's `response_format`, vLLM's `structured_outputs`
object and its legacy `guided_json` / `guided_regex` / `guided_grammar` / `guided_choice` fields.

At most one of them may ask for a constraint (two are a 400 naming both: which should win is not
the server's guess). The engine compiles the constraint at add_request; its StructuredOutputError
(an unenforceable keyword, a syntax error, the compile timeout or size limit) becomes a 400 whose
`param` is the request field the constraint came from and whose message names the keyword
(`structured_error`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from deepinfer.entrypoints.openai.errors import OpenAIError, bad_request
from deepinfer.errors import InvalidRequestError, StructuredOutputError
from deepinfer.sampling_params import StructuredOutputsParams

GUIDED_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar",
                "guided_choice": "choice"}
# vLLM's structured_outputs options DeepInfer does not implement: refused unless neutral
_SO_NEUTRAL = {"disable_fallback": (None, False), "disable_additional_properties": (None, False),
               "whitespace_pattern": (None,), "structural_tag": (None,), "backend": (None,),
               "_backend": (None,), "_backend_was_auto": (None, False)}


@dataclass(frozen=True)
class StructuredRequest:
    """What the request asked for: the field it came from and the params built from it."""

    field: str  # "response_format", "structured_outputs", "guided_json", ...
    params: StructuredOutputsParams


def _params(field: str, **kwargs) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except StructuredOutputError as exc:
        raise structured_error(exc, field) from None


def _from_response_format(fmt, ws: str) -> StructuredOutputsParams | None:
    if fmt.type == "text":
        if fmt.json_schema is not None:
            raise bad_request("response_format.json_schema is only allowed with type 'json_schema'", "response_format")
        return None
    if fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise bad_request("response_format.json_schema is only allowed with type 'json_schema'", "response_format")
        return _params("response_format", json_object=True, whitespace=ws)
    spec = fmt.json_schema
    if spec is None:
        raise bad_request("response_format.json_schema is required with type 'json_schema'", "response_format",
                          "missing_required_parameter")
    for key, value in (spec.model_extra or {}).items():
        if value is not None:
            raise bad_request(f"response_format.json_schema.{key} is not supported by DeepInfer", "response_format",
                              "unsupported_parameter")
    if spec.schema_ is None:
        raise bad_request("response_format.json_schema.schema is required", "response_format",
                          "missing_required_parameter")
    schema = spec.schema_
    # strict true or not, the schema is enforced (and refused when it cannot be): the grammar is the only mode
    return _params("response_format", json=schema, whitespace=ws)


def _from_structured_outputs(so, ws: str) -> StructuredOutputsParams:
    extra = dict(so.model_extra or {})
    compact = so.disable_any_whitespace
    for key, value in extra.items():
        if key not in _SO_NEUTRAL or not any(value is v or value == v for v in _SO_NEUTRAL[key]):
            raise bad_request(f"structured_outputs.{key} is not supported by DeepInfer", "structured_outputs",
                              "unsupported_parameter")
    kwargs = {"json": so.json_, "regex": so.regex, "grammar": so.grammar, "choice": so.choice}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if so.json_object:
        kwargs["json_object"] = True
    if kwargs.get("json") is not None or so.json_object:
        kwargs["whitespace"] = ws if compact is None else ("compact" if compact else "flexible")
    elif compact:
        raise bad_request("structured_outputs.disable_any_whitespace applies to json / json_object only",
                          "structured_outputs")
    return _params("structured_outputs", **kwargs)


def _from_guided(field: str, value, ws: str) -> StructuredOutputsParams:
    kind = GUIDED_KINDS[field]
    if kind == "json":
        return _params(field, json=value, whitespace=ws)
    return _params(field, **{kind: value})


def structured_request(req, json_whitespace: str = "flexible") -> StructuredRequest | None:
    """The one constraint the request asks for (None: unconstrained); 400 when two fields ask.
    `json_whitespace` ("flexible" | "compact", the server's --json-whitespace): a JSON constraint's
    whitespace unless the request says (structured_outputs.disable_any_whitespace)."""
    ws = json_whitespace
    found: list[StructuredRequest] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        params = _from_response_format(fmt, ws)
        if params is not None:
            found.append(StructuredRequest("response_format", params))
    if req.structured_outputs is not None:
        found.append(StructuredRequest("structured_outputs", _from_structured_outputs(req.structured_outputs, ws)))
    for field in GUIDED_KINDS:
        value = getattr(req, field)
        if value is not None:
            found.append(StructuredRequest(field, _from_guided(field, value, ws)))
    if len(found) > 1:
        names = ", ".join(f.field for f in found)
        raise bad_request(f"{found[1].field}: give one structured-output field, not several (got {names})",
                          found[1].field, "conflicting_parameters")
    return found[0] if found else None


def structured_error(exc: StructuredOutputError, field: str) -> OpenAIError:
    """The engine's refusal of a constraint as a 400: `param` the request field, the keyword named."""
    if exc.keyword:
        where = f" at {exc.path}" if exc.path else ""
        return bad_request(f"{field}: the JSON Schema keyword {exc.keyword!r}{where} is not supported: {exc}", field,
                           "unsupported_parameter")
    return bad_request(f"{field}: {exc}", field)


def rename_structured(exc: InvalidRequestError, field: str | None) -> OpenAIError | None:
    """structured_error for a StructuredOutputError raised by add_request; None for other errors."""
    if isinstance(exc, StructuredOutputError):
        return structured_error(exc, field or "structured_outputs")
    return None


# ---------------------------------------------------------------- constraints inside a Lark grammar

# The keywords a schema the server embeds in a Lark grammar (`%json`: tool parameters, a schema after
# the reasoning) may hold: those the core enforces under llguidance plus annotations (the core's
# schema_keywords.ENFORCED["llguidance"] | ANNOTATIONS, which the entry points may not import;
# tests/server/test_server_structured.py checks the two agree). llguidance's strict mode refuses most
# other keywords itself but passes unknown ones and a few it does not enforce (contentEncoding,
# contentMediaType, contentSchema, additionalItems): all are refused here.
JSON_SCHEMA_KEYWORDS = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "anyOf", "$ref", "$defs", "definitions", "pattern", "minLength", "maxLength",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "oneOf", "allOf", "format", "multipleOf",
    "minProperties", "maxProperties", "patternProperties",
    "title", "description", "$comment", "examples", "default", "deprecated", "readOnly", "writeOnly", "$schema", "$id",
})
_SUB_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
            "unevaluatedProperties", "unevaluatedItems", "additionalItems", "contentSchema")
_SUB_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def check_known_keywords(schema, field: str, path: str = "#") -> None:
    """400 naming the first keyword of `schema` (or a subschema) not in JSON_SCHEMA_KEYWORDS."""
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key not in JSON_SCHEMA_KEYWORDS:
            raise bad_request(f"{field}: the JSON Schema keyword {key!r} at {path} is not supported: the grammar "
                              "would not enforce it", field, "unsupported_parameter")
        if key in _SUB_ONE:
            check_known_keywords(value, field, f"{path}/{key}")
        elif key in _SUB_LIST and isinstance(value, list):
            for i, sub in enumerate(value):
                check_known_keywords(sub, field, f"{path}/{key}/{i}")
        elif key in _SUB_MAP and isinstance(value, dict):
            for name, sub in value.items():
                check_known_keywords(sub, field, f"{path}/{key}/{name}")


def lark_json(schema: dict, field: str, compact: bool = False) -> str:
    """`%json {...}` for a Lark grammar, after the keyword check."""
    check_known_keywords(schema, field)
    if compact:
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def after_prefix(structured: StructuredRequest, prefix: str, think_end: str = "</think>") -> StructuredRequest:
    """The same constraint, applied after `prefix` (a Lark expression: the reasoning section), as a
    Lark grammar. A user's own Lark grammar that names the `think_end` token is taken as it is (it
    writes the reasoning section itself); any other grammar is refused: it cannot be embedded
    without rewriting it."""
    so, field = structured.params, structured.field
    kind = so.kind
    if kind == "grammar":
        if think_end in so.grammar:
            return structured
        raise bad_request(f"{field}: with the server's reasoning parser a grammar must write the reasoning "
                          f"section itself (name the {think_end} token in it); or use json, regex or choice, "
                          "which apply after the reasoning", field, "unsupported_parameter")
    if kind in ("json", "json_object"):
        schema = so.schema() if kind == "json" else {"type": "object"}
        body = lark_json(schema, field, compact=so.whitespace == "compact")
    elif kind == "regex":
        body = "/" + so.regex.replace("\\/", "/").replace("/", "\\/") + "/"
    else:
        body = "(" + " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice) + ")"
    return StructuredRequest(field, _params(field, grammar=f"start: {prefix} {body}\n"))
