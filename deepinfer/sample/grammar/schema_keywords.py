"""Fail closed on JSON Schema keywords: every keyword of a schema must be one the engine enforces.

Why our own walk: XGrammar compiles schemas holding uniqueItems, not, contains, an unknown
format or a made-up keyword without a word and simply does not enforce them (checked with
xgrammar 0.2.9); llguidance refuses most such keywords in its strict mode (lenient=false) but
ignores unknown ones (a typo like "maxLenght" would pass). So each engine lists the keywords
it enforces (each one covered by the mask oracle, tests/structured/), annotations are allowed
everywhere, and anything else is a StructuredOutputError naming the keyword and where it is.
llguidance's own strict checks still run after this one (a second net: e.g. an unknown format).
"""

from __future__ import annotations

from typing import Any

from deepinfer.errors import StructuredOutputError

# No constraint on the instance (JSON Schema annotations / identifiers): allowed for every engine.
ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated", "readOnly",
                         "writeOnly", "$schema", "$id"})

_COMMON = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "anyOf", "$ref", "$defs", "definitions", "pattern", "minLength", "maxLength",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
})

# Keywords each engine enforces (each is exercised by tests/structured/schema_cases.py).
ENFORCED: dict[str, frozenset[str]] = {
    "llguidance": _COMMON | {"oneOf", "allOf", "format", "multipleOf", "minProperties", "maxProperties",
                             "patternProperties"},
    "xgrammar": _COMMON,
}

# Keyword pairs an engine accepts alone but not together in one schema: (kept, dropped ones). xgrammar
# 0.2.9 logs "pattern combined with minLength/maxLength is not supported; ignoring minLength/maxLength".
CONFLICTS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "llguidance": (),
    "xgrammar": (("pattern", ("minLength", "maxLength")),),
}

# Keywords whose value holds subschemas, and how: one schema, a list of them, or a name -> schema map.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _refuse(engine: str, keyword: str, path: str, why: str) -> StructuredOutputError:
    return StructuredOutputError(
        "json", f"JSON Schema keyword {keyword!r} at {path} {why} with structured_output_backend={engine!r}; "
        "remove it (or choose another backend): DeepInfer never drops a keyword silently",
        keyword=keyword, path=path)


def check_schema_keywords(schema: Any, engine: str) -> None:
    """Raise StructuredOutputError for the first keyword `engine` would not enforce (depth first)."""
    enforced = ENFORCED[engine]
    _walk(schema, "#", engine, enforced)


def _walk(node: Any, path: str, engine: str, enforced: frozenset[str]) -> None:
    if isinstance(node, bool):  # true / false subschemas (e.g. additionalProperties: false)
        return
    if not isinstance(node, dict):
        raise StructuredOutputError("json", f"the schema at {path} must be an object or a boolean "
                                    f"(got {type(node).__name__})", path=path)
    for kept, dropped in CONFLICTS[engine]:
        if kept in node:
            for key in dropped:
                if key in node:
                    raise _refuse(engine, key, path, f"together with {kept!r} is not enforced")
    for key, value in node.items():
        here = f"{path}/{key}"
        if key in ANNOTATIONS:
            continue
        if key not in enforced:
            known = any(key in e for e in ENFORCED.values()) or key in _ONE or key in _LIST or key in _MAP
            raise _refuse(engine, key, path, "is not enforced" if known else "is not a keyword DeepInfer knows, so it is not enforced")
        if key == "$ref":
            if not isinstance(value, str) or not value.startswith("#"):
                raise _refuse(engine, key, path, f"must be a local reference ('#/...'), got {value!r:.80}; it is not resolved")
        elif key == "items" and isinstance(value, list):
            raise _refuse(engine, key, path, "as a list (draft 4 tuple form; use prefixItems) is not enforced")
        elif key in _ONE:
            _walk(value, here, engine, enforced)
        elif key in _LIST:
            if not isinstance(value, list):
                raise StructuredOutputError("json", f"{here} must be a list of schemas", keyword=key, path=path)
            for i, sub in enumerate(value):
                _walk(sub, f"{here}/{i}", engine, enforced)
        elif key in _MAP:
            if not isinstance(value, dict):
                raise StructuredOutputError("json", f"{here} must be an object of schemas", keyword=key, path=path)
            for name, sub in value.items():
                _walk(sub, f"{here}/{name}", engine, enforced)
