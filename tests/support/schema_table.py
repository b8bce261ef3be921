"""JSON schemas and what xgrammar 0.2.7 (SGLang 0.5.23's grammar backend, strict mode) makes of them.

Each row: a name, the schema, the verdict, a witness and a part of the gateway's message.

- ``ok``: compiles, and ``witness`` is a whole instance the grammar accepts (and may end after).
- ``compile``: xgrammar raises while compiling (SGLang answers 400).
- ``empty``: compiles into a grammar that admits no value: the first token's mask is empty (SGLang then
  answers 500, "Grammar accept_token failed").
- ``endless``: compiles, and ``witness`` is a prefix the grammar accepts that enters a part with no finite
  instance (the model writes until ``max_tokens``).

``tests/engine/test_schema_grammar_xgrammar.py`` checks every row against xgrammar itself; the gateway admits
exactly the ``ok`` rows (``tests/service/protocol/test_schema_grammar.py``), and its message holds ``says``.
"""

from __future__ import annotations

from typing import Any, Literal

Verdict = Literal["ok", "compile", "empty", "endless"]

_LOOP = {"type": "object", "properties": {"y": {"$ref": "#/$defs/L"}}, "required": ["y"]}
"""An object that must hold itself: no finite instance (at ``#/$defs/L``)."""

ROWS: list[tuple[str, Any, Verdict, str | None, str | None]] = [
    # -- the issue's cases and their kin: recursion with no way out
    (
        "issue: allOf/anyOf mutual cycle",
        {
            "$ref": "#/$defs/a",
            "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
        },
        "empty",
        None,
        "#/$defs/a/allOf/0 -> #/$defs/b",
    ),
    (
        "issue: required self through #",
        {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
        "endless",
        '{"x": {"x": {"x": ',
        "# -> #/properties/x -> #",
    ),
    ("direct self-reference", {"$ref": "#"}, "empty", None, "cycle"),
    (
        "plain mutual $ref cycle",
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
        "empty",
        None,
        "cycle",
    ),
    ("allOf of itself", {"allOf": [{"$ref": "#"}]}, "empty", None, "#/allOf/0"),
    ("anyOf of itself only", {"anyOf": [{"$ref": "#"}]}, "empty", None, "#/anyOf/0"),
    (
        "oneOf cycle through $defs",
        {"oneOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"oneOf": [{"$ref": "#"}]}}},
        "empty",
        None,
        "#/$defs/a",
    ),
    (
        "two objects requiring each other",
        {
            "$ref": "#/$defs/A",
            "$defs": {
                "A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
                "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]},
            },
        },
        "endless",
        '{"b": {"a": {"b": ',
        "#/$defs/A/properties/b",
    ),
    (
        "properties imply an object",
        {"properties": {"x": {"$ref": "#"}}, "required": ["x"]},
        "endless",
        '{"x": {"x": ',
        "#/properties/x",
    ),
    (
        "array of itself, minItems 1",
        {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
        "endless",
        "[[[[",
        "#/items",
    ),
    ("items imply an array", {"items": {"$ref": "#"}, "minItems": 1}, "endless", "[[[", "#/items"),
    (
        "prefixItems of itself, minItems 1",
        {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
        "endless",
        "[[[",
        "#/prefixItems/0",
    ),
    (
        "prefixItems, second recurs, minItems 2",
        {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 2},
        "endless",
        '["a", ["b", ',
        "#/prefixItems/1",
    ),
    (
        "additionalProperties of itself, minProperties 1",
        {"type": "object", "additionalProperties": {"$ref": "#"}, "minProperties": 1},
        "endless",
        '{"a": {"b": ',
        "#/additionalProperties",
    ),
    (
        "unevaluatedProperties of itself, minProperties 1",
        {"type": "object", "unevaluatedProperties": {"$ref": "#"}, "minProperties": 1},
        "endless",
        '{"a": {"b": ',
        "#/unevaluatedProperties",
    ),
    (
        "patternProperties of itself, minProperties 1",
        {"type": "object", "patternProperties": {"^a": {"$ref": "#"}}, "minProperties": 1},
        "endless",
        '{"a": {"a": ',
        "#/patternProperties/^a",
    ),
    (
        "both anyOf branches recur",
        {
            "anyOf": [
                {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
            ]
        },
        "endless",
        '{"a": [{"a": ',
        "#/anyOf/0",
    ),
    (
        "required recursion into a property's own path",
        {
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"b": {"$ref": "#/properties/a"}}, "required": ["b"]}
            },
            "required": ["a"],
        },
        "endless",
        '{"a": {"b": {"b": ',
        "#/properties/a",
    ),
    (
        "$ref wins over its siblings",
        {"type": "object", "properties": {"a": {"$ref": "#", "type": "string"}}, "required": ["a"]},
        "endless",
        '{"a": {"a": ',
        "#/properties/a",
    ),
    (
        "recursion through definitions",
        {
            "definitions": {
                "a": {"type": "object", "properties": {"n": {"$ref": "#/definitions/a"}}, "required": ["n"]}
            },
            "$ref": "#/definitions/a",
        },
        "endless",
        '{"n": {"n": ',
        "#/definitions/a",
    ),
    # -- a trap the grammar can walk into, though the root has an instance
    (
        "optional property with no instance",
        {"type": "object", "properties": {"x": {"$ref": "#/$defs/L"}}, "$defs": {"L": _LOOP}},
        "endless",
        '{"x": {"y": {"y": ',
        "#/$defs/L",
    ),
    (
        "anyOf branch with no instance",
        {"anyOf": [{"$ref": "#/$defs/L"}, {"type": "string"}], "$defs": {"L": _LOOP}},
        "endless",
        '{"y": {"y": ',
        "#/$defs/L",
    ),
    (
        "additionalProperties with no instance",
        {"type": "object", "additionalProperties": {"$ref": "#/$defs/L"}, "$defs": {"L": _LOOP}},
        "endless",
        '{"k": {"y": {"y": ',
        "#/$defs/L",
    ),
    (
        "array items with no instance",
        {"type": "array", "items": {"$ref": "#/$defs/L"}, "$defs": {"L": _LOOP}},
        "endless",
        '[{"y": {"y": ',
        "#/$defs/L",
    ),
    # -- recursion with a way out: legitimate recursive schemas
    (
        "optional self property",
        {"type": "object", "properties": {"x": {"$ref": "#"}}},
        "ok",
        '{"x": {}}',
        None,
    ),
    (
        "tree: required array of children",
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                    "required": ["kids"],
                }
            },
            "$ref": "#/$defs/n",
        },
        "ok",
        '{"kids": [{"kids": []}]}',
        None,
    ),
    (
        "tree with a name and optional children",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["name"],
        },
        "ok",
        '{"name": "a", "children": [{"name": "b"}]}',
        None,
    ),
    (
        "anyOf with a branch that does not recur",
        {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
        "ok",
        '"a"',
        None,
    ),
    (
        "oneOf with a branch that does not recur",
        {"oneOf": [{"$ref": "#"}, {"type": "string"}]},
        "ok",
        '"a"',
        None,
    ),
    (
        "required, nullable through anyOf",
        {
            "type": "object",
            "properties": {"n": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["n"],
        },
        "ok",
        '{"n": {"n": null}}',
        None,
    ),
    (
        "required, nullable through a type list",
        {"type": ["object", "null"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
        "ok",
        '{"x": null}',
        None,
    ),
    (
        "type list with a non-recursive type",
        {"type": ["object", "string"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
        "ok",
        '{"x": "a"}',
        None,
    ),
    ("array of itself, may be empty", {"type": "array", "items": {"$ref": "#"}}, "ok", "[[], [[]]]", None),
    (
        "prefixItems of itself, may be empty",
        {"type": "array", "prefixItems": [{"$ref": "#"}]},
        "ok",
        "[[]]",
        None,
    ),
    (
        "minItems within a non-recursive prefix",
        {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 1},
        "ok",
        '["a"]',
        None,
    ),
    (
        "additionalProperties of itself, may be empty",
        {"type": "object", "additionalProperties": {"$ref": "#"}},
        "ok",
        '{"a": {}}',
        None,
    ),
    (
        "minProperties met by a non-recursive property",
        {"type": "object", "properties": {"x": {"$ref": "#"}, "s": {"type": "string"}}, "minProperties": 1},
        "ok",
        '{"s": "a"}',
        None,
    ),
    (
        "maxItems 0 keeps a trap out",
        {"type": "array", "items": {"$ref": "#/$defs/L"}, "maxItems": 0, "$defs": {"L": _LOOP}},
        "ok",
        "[]",
        None,
    ),
    (
        "maxProperties 0 keeps a trap out",
        {
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/L"}},
            "maxProperties": 0,
            "$defs": {"L": _LOOP},
        },
        "ok",
        "{}",
        None,
    ),
    (
        "enum wins over recursion",
        {"enum": [1, 2], "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
        "ok",
        "1",
        None,
    ),
    (
        "allOf of several members is any value",
        {
            "allOf": [
                {"type": "object"},
                {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
            ]
        },
        "ok",
        "1",
        None,
    ),
    (
        "required names outside properties are not enforced",
        {"type": "object", "required": ["x"], "additionalProperties": {"$ref": "#"}},
        "ok",
        "{}",
        None,
    ),
    (
        "a $defs entry nothing uses",
        {"type": "string", "$defs": {"L": _LOOP, "f": False, "e": {"enum": []}}},
        "ok",
        '"a"',
        None,
    ),
    (
        "an anchor reference is any value",
        {
            "$defs": {
                "n": {
                    "$anchor": "N",
                    "type": "object",
                    "properties": {"x": {"$ref": "#N"}},
                    "required": ["x"],
                }
            },
            "$ref": "#N",
        },
        "ok",
        "1",
        None,
    ),
    ("not is ignored by xgrammar", {"not": {"$ref": "#"}}, "ok", "{}", None),
    (
        "a $ref with a trailing slash",
        {"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a/"},
        "ok",
        '"a"',
        None,
    ),
    (
        "weather tool parameters",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "ok",
        '{"city": "Paris", "unit": "celsius"}',
        None,
    ),
    ("no parameters", {"type": "object", "properties": {}}, "ok", "{}", None),
    ("any array", {"type": "array"}, "ok", "[1]", None),
    ("array items true, minItems 2", {"type": "array", "items": True, "minItems": 2}, "ok", "[1, 2]", None),
    ("integer with whole float bounds", {"type": "integer", "minimum": 2, "maximum": 2.0}, "ok", "2", None),
    # -- what xgrammar 0.2.7 cannot compile
    ("false root", False, "compile", None, "must be an object"),
    (
        "optional property false",
        {"type": "object", "properties": {"x": False}},
        "compile",
        None,
        "#/properties/x",
    ),
    ("anyOf branch false", {"anyOf": [False, {"type": "string"}]}, "compile", None, "#/anyOf/0"),
    ("$ref to false", {"$ref": "#/$defs/x", "$defs": {"x": False}}, "compile", None, "#/$defs/x"),
    (
        "prefixItems false",
        {"type": "array", "prefixItems": [False], "maxItems": 0},
        "compile",
        None,
        "prefixItems",
    ),
    (
        "empty enum in an optional property",
        {"type": "object", "properties": {"x": {"enum": []}}},
        "compile",
        None,
        "#/properties/x",
    ),
    (
        "minLength above maxLength",
        {"type": "string", "minLength": 5, "maxLength": 2},
        "compile",
        None,
        "minLength",
    ),
    (
        "number range with no number",
        {"type": "number", "exclusiveMinimum": 2, "maximum": 2},
        "compile",
        None,
        "range",
    ),
    (
        "number minimum above maximum",
        {"type": "number", "minimum": 5, "maximum": 2},
        "compile",
        None,
        "range",
    ),
    ("integer bound not whole", {"type": "integer", "minimum": 1.5}, "compile", None, "whole"),
    (
        "integer range with no integer",
        {"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2},
        "compile",
        None,
        "integer",
    ),
    (
        "minItems above maxItems",
        {"type": "array", "items": True, "minItems": 3, "maxItems": 1},
        "compile",
        None,
        "maxItems",
    ),
    ("minItems with no items allowed", {"type": "array", "minItems": 1}, "compile", None, "minItems"),
    (
        "minItems beyond prefixItems, items false",
        {"type": "array", "prefixItems": [{"type": "string"}], "items": False, "minItems": 2},
        "compile",
        None,
        "minItems",
    ),
    (
        "maxItems below prefixItems",
        {"type": "array", "prefixItems": [{"type": "string"}], "maxItems": 0},
        "compile",
        None,
        "maxItems",
    ),
    (
        "minProperties with no keys allowed",
        {"type": "object", "properties": {"a": {}}, "minProperties": 2},
        "compile",
        None,
        "minProperties",
    ),
    (
        "minProperties above maxProperties",
        {"type": "object", "additionalProperties": True, "minProperties": 3, "maxProperties": 1},
        "compile",
        None,
        "maxProperties",
    ),
    (
        "maxProperties below required",
        {"type": "object", "required": ["a", "b"], "maxProperties": 1},
        "compile",
        None,
        "required",
    ),
    (
        "$ref with an escaped slash",
        {"$defs": {"a/b": {"type": "string"}}, "$ref": "#/$defs/a~1b"},
        "compile",
        None,
        "does not resolve",
    ),
    (
        "$ref through an array index",
        {"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#/prefixItems/0"}]},
        "compile",
        None,
        "does not resolve",
    ),
    (
        "$ref to a non-schema",
        {"type": "object", "required": ["a"], "properties": {"b": {"$ref": "#/required"}}},
        "compile",
        None,
        "not a schema",
    ),
]


__all__ = ["ROWS", "Verdict"]
