"""``POST /v1/responses`` (OpenAI's Responses API), stateless: its request, screened and turned into a chat
completion that runs through the same pipeline (quota, priority, routing, failover).

Shapes follow ``openai.types.responses`` (``response_create_params``, ``response_input_param``). What is
served: ``input`` as a string or a list of messages (text parts), ``function_call`` and
``function_call_output`` items (a tool round trip without stored state), ``instructions`` (a system
message first), ``max_output_tokens``, ``temperature``, ``top_p``, function ``tools`` (flat, as the
Responses API writes them), ``tool_choice``, ``parallel_tool_calls``, ``text.format`` (text, json_object,
json_schema), ``stream``. Nothing is stored: ``store: true`` (OpenAI's default when sent), and everything
that needs stored state (``previous_response_id``, ``conversation``, ``background``) gets 400 naming the
field; so do hosted tools and non-text input parts (images, files, audio). Fields in no table are refused
by the model (400 ``Unrecognized request argument``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, StrictBool, Tag, ValidationError, field_validator

from service.errors import InvalidRequest
from service.protocol import limits
from service.protocol.completions import ChatCompletionRequest, ChatMessage, StreamOptions
from service.protocol.errors import invalid_params
from service.protocol.features import (
    FUNCTION_NAME,
    MAX_TOOLS,
    REQUEST_CONFIG,
    AssistantToolCall,
    CalledFunction,
    FunctionDefinition,
    FunctionName,
    FunctionTool,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    check_schema,
)
from service.protocol.fields import (
    METADATA_EXPECTED,
    STREAM_OPTION_FIELDS,
    TEXT_EXPECTED,
    FieldRule,
    _accepted,
    _metadata,
    _null_or_empty,
    _off_only,
    _one_of,
    _prompt_cache_options,
    _served,
    _short_text,
    _typed,
    refuse_stream_options_without_stream,
    screen,
)

STATELESS = "this gateway is stateless (nothing is stored)"

RESPONSES_FIELDS: dict[str, FieldRule] = {
    "model": _served(),
    "input": _served("a string, or messages (text parts), function_call and function_call_output items"),
    "instructions": _served("a system message before the input"),
    "max_output_tokens": _served("as max_tokens"),
    "temperature": _served("0-2"),
    "top_p": _served("(0, 1]"),
    "tools": _served(
        "function tools only (hosted tools get 400)",
        served=lambda v: all(isinstance(t, dict) and t.get("type") == "function" for t in v),
        valid=_typed(list),
    ),
    "tool_choice": _served(
        "none, auto, required, or a function",
        served=lambda v: not isinstance(v, dict) or v.get("type") == "function",
    ),
    "parallel_tool_calls": _served(),
    "text": _served("format: text, json_object, json_schema"),
    "stream": _served("OpenAI's event sequence; no [DONE]"),
    "stream_options": _served("include_obfuscation accepted, no effect"),
    "store": _served(f"false only: {STATELESS}", served=_one_of(False), valid=_typed(bool)),
    "user": _served(f"up to {limits.MAX_USER_CHARS} characters; keys consistent-hash routing"),
    "priority": _served("radixgate: a priority class name, at most the tenant's own"),
    "metadata": _accepted(_typed(dict, check=_metadata), "not stored", METADATA_EXPECTED),
    "safety_identifier": _accepted(_short_text(limits.MAX_USER_CHARS), expect=TEXT_EXPECTED),
    "prompt_cache_key": _accepted(_short_text(limits.MAX_USER_CHARS), expect=TEXT_EXPECTED),
    "prompt_cache_retention": _accepted(_one_of("in_memory", "24h"), expect='"in_memory" or "24h"'),
    "prompt_cache_options": _accepted(
        _prompt_cache_options(
            ("30m", "12h"),
            {"comparison_response_id": _short_text(limits.MAX_USER_CHARS), "prewarm": _one_of(False)},
        ),
        expect='an object with "mode", "ttl", "comparison_response_id" and "prewarm": false',
    ),
    "truncation": _off_only(_one_of("disabled"), _one_of("disabled", "auto"), 'null, "disabled"'),
    "service_tier": _off_only(_one_of("auto", "default"), _typed(str), 'null, "auto", "default"'),
    "include": _off_only(_null_or_empty, _typed(list), "null, []"),
    "reasoning": _off_only(
        lambda v: v is None or (isinstance(v, dict) and v.get("effort") in (None, "none")),
        _typed(dict),
        'null, {"effort": "none"}',
    ),
    "top_logprobs": _off_only(_one_of(0), _typed(int), "null, 0"),
    "max_tool_calls": _off_only(valid=_typed(int)),
    "previous_response_id": _off_only(valid=_typed(str), note=STATELESS),
    "conversation": _off_only(valid=_typed(str, dict), note=STATELESS),
    "background": _off_only(_one_of(False), _typed(bool), "null, false", STATELESS),
    "background_options": _off_only(valid=_typed(dict)),
    "prompt": _off_only(valid=_typed(dict), note="no stored prompts"),
    "context_management": _off_only(_null_or_empty, _typed(list), "null, []"),
    "moderation": _off_only(valid=_typed(dict)),
    "image": _off_only(valid=_typed(dict)),
    "access_programs": _off_only(valid=_typed(dict)),
}
"""Top-level fields of ``POST /v1/responses`` (see :mod:`service.protocol.fields` for the kinds)."""

INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")
TEXT_PART_TYPES = ("input_text", "output_text")
REFUSED_PART_TYPES = ("input_image", "input_file", "input_audio", "refusal")


class TextContent(BaseModel):
    """A text part of an input message (``input_text``; ``output_text`` in an earlier answer)."""

    model_config = REQUEST_CONFIG
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(BaseModel):
    """``{"role", "content"}`` (``type: "message"`` optional): text or text parts."""

    model_config = REQUEST_CONFIG
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[TextContent], Field(fail_fast=True)]  # as a chat message's parts
    id: str | None = Field(None, max_length=256)

    @field_validator("content")
    @classmethod
    def _not_empty(cls, value: str | list[TextContent]) -> str | list[TextContent]:
        if isinstance(value, list) and not value:  # as chat completions (and OpenAI) refuse it
            raise ValueError("an empty array; give a string or at least one content part")
        return value

    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        """The message's text (parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """An earlier answer's call: ``{"type": "function_call", "call_id", "name", "arguments"}``."""

    model_config = REQUEST_CONFIG
    type: Literal["function_call"]
    call_id: str = Field(..., max_length=256)
    name: str = Field(..., max_length=64)
    arguments: str
    id: str | None = Field(None, max_length=256)
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    """The result of a call: ``{"type": "function_call_output", "call_id", "output"}``."""

    model_config = REQUEST_CONFIG
    type: Literal["function_call_output"]
    call_id: str = Field(..., max_length=256)
    output: str | list[TextContent]
    id: str | None = Field(None, max_length=256)
    status: str | None = None

    def text(self) -> str:
        """The output's text (parts joined)."""
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class ResponseFunctionTool(BaseModel):
    """A function tool as the Responses API writes it (flat: no ``function`` object)."""

    model_config = REQUEST_CONFIG
    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=16_384)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseToolChoiceFunction(BaseModel):
    """``tool_choice: {"type": "function", "name"}``."""

    model_config = REQUEST_CONFIG
    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME)


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with ``name``/``schema``/``strict``."""

    model_config = REQUEST_CONFIG
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    """``text``: the output format (``verbosity`` "medium" only)."""

    model_config = REQUEST_CONFIG
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(BaseModel):
    """Body of ``POST /v1/responses`` after screening (see the module docstring)."""

    model_config = REQUEST_CONFIG
    model: str = Field(..., min_length=1, max_length=256)
    input: str | Annotated[list[InputItem], Field(fail_fast=True)] = Field(
        ..., description="At most limits.MAX_MESSAGES items (screened)."
    )
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=limits.TEMPERATURE_MAX)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[ResponseFunctionTool] | None = Field(None, max_length=MAX_TOOLS, fail_fast=True)
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    user: str | None = Field(None, max_length=limits.MAX_USER_CHARS)
    priority: str | None = Field(None, max_length=64)

    def echo(self) -> dict[str, Any]:
        """The request fields a Response object repeats (``instructions``, ``tools``, ``text``, ...)."""
        fmt = self.text.format if self.text and self.text.format else TextFormat(type="text")
        choice = self.tool_choice
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else (choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "store": False,
            "truncation": "disabled",
            "user": self.user,
            "metadata": {},
        }


def screen_responses(body: Mapping[str, Any]) -> dict[str, Any]:
    """Apply :data:`RESPONSES_FIELDS` to a body, and refuse hosted tools and non-text input parts.

    Raises:
        InvalidRequest: 400 naming the field (``store``, ``previous_response_id``, ``tools.0.type``,
            ``input.1.content.0``, ...).
    """
    kept = screen(body, RESPONSES_FIELDS)
    refuse_stream_options_without_stream(kept)
    options = kept.get("stream_options")
    if isinstance(options, dict):
        kept["stream_options"] = screen(options, STREAM_OPTION_FIELDS, "stream_options.")
    items = kept.get("input")
    limits.check_count(kept.get("tools"), MAX_TOOLS, "tools", "tools")
    for i, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind not in INPUT_ITEM_TYPES:
            raise _unsupported(f"input.{i}", f"Input items of type '{kind}' are not served by this gateway.")
        parts = item.get("content") if kind == "message" else item.get("output")
        field = "content" if kind == "message" else "output"
        limits.check_count(parts, limits.MAX_CONTENT_PARTS, f"input.{i}.{field}", "content parts")
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            if isinstance(part, dict) and part.get("type") in REFUSED_PART_TYPES:
                raise _unsupported(
                    f"input.{i}.{field}.{j}",
                    f"Input parts of type '{part['type']}' are not served by this gateway (text only).",
                )
    return kept


def _unsupported(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(message, code="unsupported_parameter", param=param)


def parse_responses(body: Mapping[str, Any]) -> ResponsesRequest:
    """Screen and parse a ``/v1/responses`` body.

    Raises:
        InvalidRequest: 400 in OpenAI's shape naming the field.
    """
    kept = screen_responses(body)
    if kept.get("store") is True:
        raise InvalidRequest(
            f"store: true is not served: {STATELESS}. Send store: false (responses cannot be retrieved "
            "later).",
            code="unsupported_value",
            param="store",
        )
    items = kept.get("input")
    if isinstance(items, list) and len(items) > limits.MAX_MESSAGES:
        raise InvalidRequest(
            f"input has {len(items)} items; at most {limits.MAX_MESSAGES} are served.",
            code="invalid_value",
            param="input",
        )
    try:
        return ResponsesRequest.model_validate(kept)
    except ValidationError as exc:
        raise invalid_params(exc, kept) from exc


def _messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The chat history of a request: instructions first, then each input item (consecutive
    ``function_call`` items become one assistant message with their ``tool_calls``)."""
    out: list[ChatMessage] = []
    if req.instructions:
        out.append(ChatMessage(role="system", content=req.instructions))
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for item in items:
        if isinstance(item, InputMessage):
            out.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = AssistantToolCall(
                id=item.call_id,
                type="function",
                function=CalledFunction(name=item.name, arguments=item.arguments),
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                last.tool_calls.append(call)
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            out.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id))
    return out


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else ResponseFormat(type=fmt.type)
    problem = check_schema(fmt.schema_ if fmt.schema_ is not None else {"type": "object"})
    if problem is not None:
        raise InvalidRequest(
            f"Invalid schema for text.format: {problem}",
            code="invalid_json_schema",
            param="text.format.schema",
        )
    spec = JsonSchemaFormat.model_validate(
        {
            "name": fmt.name or "response",
            "description": fmt.description,
            "schema": fmt.schema_,
            "strict": fmt.strict,
        }
    )
    return ResponseFormat(type="json_schema", json_schema=spec)


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion that serves a Responses request (one answer, ``n`` = 1).

    Raises:
        InvalidRequest: 400 when the input makes no valid chat (e.g. no message at all).
    """
    if isinstance(req.input, list) and not req.input:
        raise InvalidRequest("input must not be empty.", code="invalid_value", param="input")
    tools = [
        FunctionTool(
            type="function",
            function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
            ),
        )
        for t in req.tools or []
    ] or None
    choice = req.tool_choice
    tool_choice = (
        NamedToolChoice(type="function", function=FunctionName(name=choice.name))
        if isinstance(choice, ResponseToolChoiceFunction)
        else choice
    )
    try:
        return ChatCompletionRequest(
            model=req.model,
            messages=_messages(req),
            max_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=req.parallel_tool_calls,
            response_format=_response_format(req),
            stream=req.stream,
            stream_options=StreamOptions(include_usage=True) if req.stream else None,
            user=req.user,
            priority=req.priority,
        )
    except ValidationError as exc:
        raise invalid_params(exc) from exc


CHAT_TO_RESPONSES_PARAMS = (
    ("messages", "input"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema.", "text.format."),
    ("response_format", "text.format"),
    ("tool_choice.function.", "tool_choice."),
)
"""Prefixes of chat parameter names and their Responses API names (for errors raised on the chat form)."""


def responses_param(param: str | None) -> str | None:
    """The Responses API name of a chat request parameter named in an error (``messages.2`` -> ``input``,
    ``max_tokens`` -> ``max_output_tokens``, ``tools.0.function.parameters`` -> ``tools.0.parameters``)."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"  # message indexes differ from input item indexes (instructions, merged calls)
    param = param.replace(".function.", ".", 1) if param.startswith("tools.") else param
    for chat, responses in CHAT_TO_RESPONSES_PARAMS:
        if param.startswith(chat):
            return responses + param[len(chat) :]
    return param


def responses_table() -> str:
    """docs/api.md's table of ``/v1/responses`` parameters (markdown), from :data:`RESPONSES_FIELDS`."""
    lines = ["| parameter | /v1/responses | notes |", "|---|---|---|"]
    for name, rule in RESPONSES_FIELDS.items():
        lines.append(f"| `{name}` | {rule.describe()} | {rule.note} |")
    lines.append("| `input[]` parts `input_image`, `input_file`, `input_audio` | refused | text-only model |")
    lines.append("| `input[]` items other than messages and function calls/outputs | refused | |")
    return "\n".join(lines)


__all__ = [
    "RESPONSES_FIELDS",
    "ResponsesRequest",
    "parse_responses",
    "responses_param",
    "responses_table",
    "screen_responses",
    "to_chat",
]
