"""Request sub-models of OpenAI's tool calling and structured outputs (issue 11).

Shapes follow OpenAI's chat completions schema (``openai.types.chat``): function tools, ``tool_choice``,
assistant ``tool_calls`` in the history, and ``response_format``. JSON schemas given by the caller (tool
parameters, ``response_format.json_schema.schema``) are checked against the JSON Schema meta-schema
and against what the engine's grammar compiler makes of them (:mod:`service.protocol.schema_grammar`: it
compiles, and every part the grammar can enter has a finite instance) by :func:`check_schema` before
anything reaches a worker, so a malformed or endlessly recursive schema is a 400 naming its field, never a
grammar failure on the engine.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field

from service.protocol.schema_grammar import grammar_problem

REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
"""Request models: unknown fields refused, no type coercion, no NaN or infinity."""

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's rule for function names (also what the formats' grammars can write between quotes)."""

MAX_TOOLS = 128
"""Functions per request (OpenAI's limit)."""

MAX_SCHEMA_PROPERTIES = 5000
MAX_SCHEMA_DEPTH = 10
MAX_SCHEMA_ENUM_VALUES = 1000
"""Size of one JSON schema: object properties in all, nesting of objects, enum values in all (OpenAI's
structured-outputs limits). The engine compiles a grammar from the schema before it decodes a token, and
that cost grows with its size (3,000 properties held a CPU worker for 87 s)."""

MAX_SCHEMA_NESTING = 64
"""Deepest nesting of objects and arrays in one JSON schema document (any keyword: ``items``, ``anyOf``,
``not``, ``$defs``...). The meta-schema check (jsonschema) recurses about ten Python frames per level and
hit Python's recursion limit at ~125 levels of ``items`` (a 500); OpenAI's 10 levels of objects take ~21."""


def check_schema(schema: Any) -> str | None:
    """Why ``schema`` is not a usable JSON schema, or None when it is: within the size bounds, valid against
    the Draft 2020-12 meta-schema, and one the engine's grammar compiler can compile into a grammar whose
    every part has a finite instance (:func:`service.protocol.schema_grammar.grammar_problem`)."""
    if not isinstance(schema, dict):
        return "a JSON schema must be an object"
    problem = _size_problem(schema)  # iterative, first: the meta-schema check recurses per level
    if problem is not None:
        return problem
    try:  # after the nesting bound: the encoder recurses per level too
        json.dumps(schema, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\\ud800"): the engine cannot decode the request (nu11)
        return "the schema is not valid Unicode (lone surrogate)"
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return f"not a valid JSON schema: {exc.message}"
    except RecursionError:  # a second guard: the stack the check runs on is not all its own
        return "the schema nests too deeply to be checked"
    return grammar_problem(schema)  # after the meta-schema: keyword types are right


def _size_problem(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` is larger than :data:`MAX_SCHEMA_PROPERTIES` / ``_DEPTH`` / ``_ENUM_VALUES`` /
    ``_NESTING`` allow (one iterative walk; ``enum`` values are data: only their nesting counts)."""
    properties = enums = 0
    # node, object depth, nesting level, whether it is data inside an enum
    stack: list[tuple[Any, int, int, bool]] = [(schema, 0, 1, False)]
    while stack:
        node, depth, level, data = stack.pop()
        if not isinstance(node, dict | list):
            continue
        if level > MAX_SCHEMA_NESTING:
            return f"objects and arrays nest deeper than {MAX_SCHEMA_NESTING} levels"
        if isinstance(node, list):
            stack.extend((item, depth, level + 1, data) for item in node)
            continue
        if not data:
            props = node.get("properties")
            if isinstance(props, dict):
                properties += len(props)
                depth += 1
                if depth > MAX_SCHEMA_DEPTH:
                    return f"objects nest deeper than {MAX_SCHEMA_DEPTH} levels"
            if isinstance(node.get("enum"), list):
                enums += len(node["enum"])
            if properties > MAX_SCHEMA_PROPERTIES:
                return f"more than {MAX_SCHEMA_PROPERTIES} object properties in all"
            if enums > MAX_SCHEMA_ENUM_VALUES:
                return f"more than {MAX_SCHEMA_ENUM_VALUES} enum values in all"
        stack.extend((value, depth, level + 1, data or key == "enum") for key, value in node.items())
    return None


class FunctionDefinition(BaseModel):
    """``tools[].function``: name, description, parameters (a JSON schema), strict."""

    model_config = REQUEST_CONFIG
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=16_384)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(BaseModel):
    """One entry of ``tools`` (only function tools are served)."""

    model_config = REQUEST_CONFIG
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    """``{"name": ...}`` of a named ``tool_choice``."""

    model_config = REQUEST_CONFIG
    name: str = Field(..., pattern=FUNCTION_NAME)


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: this function must be called."""

    model_config = REQUEST_CONFIG
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    """``function`` of an assistant message's tool call: name and arguments (a JSON text)."""

    model_config = REQUEST_CONFIG
    name: str = Field(..., max_length=64)
    arguments: str


class AssistantToolCall(BaseModel):
    """One of an assistant message's ``tool_calls`` in the history."""

    model_config = REQUEST_CONFIG
    id: str = Field(..., max_length=256)
    type: Literal["function"]
    function: CalledFunction


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: a named schema; ``strict`` is accepted (the grammar always
    enforces the schema)."""

    model_config = REQUEST_CONFIG
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text`` (default), ``json_object`` or ``json_schema``."""

    model_config = REQUEST_CONFIG
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


__all__ = [
    "MAX_TOOLS",
    "REQUEST_CONFIG",
    "AssistantToolCall",
    "CalledFunction",
    "FunctionDefinition",
    "FunctionTool",
    "JsonSchemaFormat",
    "NamedToolChoice",
    "ResponseFormat",
    "ToolChoice",
    "check_schema",
]
