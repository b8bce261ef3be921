"""Request sub-models of OpenAI's tool calling and structured outputs (issue 11).

Shapes follow OpenAI's chat completions schema (``openai.types.chat``): function tools, ``tool_choice``,
assistant ``tool_calls`` in the history, and ``response_format``. JSON schemas given by the caller (tool
parameters, ``response_format.json_schema.schema``) are checked against the JSON Schema meta-schema
(:func:`check_schema`) before anything reaches a worker, so a malformed schema is a 400 naming its field,
never a grammar failure on the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field

REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
"""Request models: unknown fields refused, no type coercion, no NaN or infinity."""

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's rule for function names (also what the formats' grammars can write between quotes)."""

MAX_TOOLS = 128
"""Functions per request (OpenAI's limit)."""


def check_schema(schema: Any) -> str | None:
    """Why ``schema`` is not a usable JSON schema (Draft 2020-12 meta-schema), or None when it is."""
    if not isinstance(schema, dict):
        return "a JSON schema must be an object"
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return f"not a valid JSON schema: {exc.message}"
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
