"""Schema cases for the mask oracle, JSON-Schema-Test-Suite style: (name, schema, valid, invalid, engines).

`engines`: the engines that must enforce the schema; for the others the schema must be REFUSED at
compile time with a StructuredOutputError naming `refused_keyword` (fail closed). Instances are
Python values; keys are written in schema order. The cases themselves are checked against the
`jsonschema` library (a validator nobody here wrote), so a wrong case cannot pass unnoticed.
"""

from __future__ import annotations

BOTH = ("llguidance", "xgrammar")
LLG = ("llguidance",)

# (name, schema, valid instances, invalid instances, engines that enforce it, keyword the others refuse)
CASES = [
    ("pattern+maxLength", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4},
     ["abc", "abcd", "z"], ["abcde", "ab1", ""], LLG, "maxLength"),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3},
     ["ab", "abc", "a\"c"], ["a", "abcd", ""], BOTH, None),
    ("pattern", {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"}, ["123-45"], ["12-345", "123-456", "abc"],
     BOTH, None),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     [[1, 2], [1, 2, 3], [-7, 0]], [[1], [], [1, 2, 3, 4], [1, "a"]], BOTH, None),
    ("enum", {"enum": ["red", "green", 3, None]}, ["red", "green", 3, None], ["blue", 4, "re", True], BOTH, None),
    ("const", {"const": "x"}, ["x"], ["y", "xx"], BOTH, None),
    ("nested objects", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "integer"}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False},
     [{"a": {"b": 1}}, {"a": {"b": -20}}], [{"a": {}}, {}, {"a": {"b": "1"}}, {"a": {"b": 1, "c": 2}}], BOTH, None),
    ("additionalProperties false", {"type": "object", "properties": {"x": {"type": "integer"}},
                                    "additionalProperties": False},
     [{}, {"x": 1}], [{"y": 1}, {"x": 1, "y": 2}, {"x": "a"}], BOTH, None),
    ("required, extra allowed", {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
     [{"a": True}, {"a": False, "z": 1}], [{"z": 1}, {"a": 1}, {}], BOTH, None),
    ("anyOf", {"anyOf": [{"type": "integer", "minimum": 10}, {"type": "string", "maxLength": 2}]},
     [10, 11, 250, "ab", ""], [9, -1, "abc", None], BOTH, None),
    ("integer bounds", {"type": "integer", "minimum": -5, "maximum": 5}, [-5, 0, 5, 3], [6, -6, 10, 1.5], BOTH, None),
    ("exclusive bounds", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
     [0.5, 0.25], [0, 1, 2, -0.5], BOTH, None),
    ("$ref/$defs", {"$defs": {"p": {"type": "integer", "minimum": 0}}, "type": "array", "items": {"$ref": "#/$defs/p"}},
     [[0, 3], []], [[-1], [1, -2], ["a"]], BOTH, None),
    ("prefixItems, items false", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                                  "items": False},
     [["a", 1], ["a"], []], [["a", 1, 2], [1], ["a", "b"]], BOTH, None),
    ("type list", {"type": ["string", "null"]}, ["a", None], [1, True, []], BOTH, None),
    ("oneOf disjoint", {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
     [1, "a"], [True, "abcd", None], LLG, "oneOf"),
    ("allOf", {"allOf": [{"type": "string", "minLength": 2}, {"maxLength": 3}]}, ["ab", "abc"], ["a", "abcd", 5],
     LLG, "allOf"),
    ("format date", {"type": "string", "format": "date"}, ["2024-01-31"], ["2024-1-31", "x", "2024-13-01"],
     LLG, "format"),
    ("multipleOf", {"type": "integer", "multipleOf": 3}, [0, 3, -6, 12], [4, 1, -5], LLG, "multipleOf"),
    ("min/maxProperties", {"type": "object", "minProperties": 1, "maxProperties": 2},
     [{"a": 1}, {"a": 1, "b": 2}], [{}, {"a": 1, "b": 2, "c": 3}], LLG, "minProperties"),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                           "additionalProperties": False},
     [{"x1": 1}, {}], [{"x1": "a"}, {"y": 1}], LLG, "patternProperties"),
]

# Schemas no engine enforces: (schema, the keyword the error must name), for every engine.
REFUSED = [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "if"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLenght": 3}}}, "maxLenght"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding"),
    ({"type": "array", "items": [{"type": "integer"}]}, "items"),
]
