"""Typed protocol between HTTP and the dispatch pipeline: OpenAI request/response models.

Bodies are screened first by :mod:`service.protocol.fields` (OpenAI fields not served, hints, ``null``
meaning the default); the models here parse what is served. Unknown fields are rejected (400
``Unrecognized request argument supplied``) as OpenAI does.
Accepted extensions: ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos`` (SGLang sampling),
``chat_template_kwargs`` (SGLang / vLLM: variables for the chat template) and ``priority`` (a radixgate
priority class name).

Types are strict (``"5"`` is not a number, ``true`` is not 1) and every number and size is bounded by
:mod:`service.protocol.limits`, so nothing reaches a worker that it cannot take.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictBool, field_validator, model_validator
from pydantic_core import PydanticCustomError

from service.protocol import limits
from service.protocol.features import (
    MAX_TOOLS,
    REQUEST_CONFIG,
    AssistantToolCall,
    FunctionTool,
    ResponseFormat,
    ToolChoice,
)
from service.protocol.template_kwargs import check_template_kwargs


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with the usage."""

    model_config = REQUEST_CONFIG
    include_usage: bool = False


class TextPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` content part (the only kind a text model takes)."""

    model_config = REQUEST_CONFIG
    type: Literal["text"]
    text: str


MESSAGE_FIELD_MISSING = "message_field_missing"
"""Pydantic error type of a message without a field its role needs (``ctx["field"]`` names it)."""
MESSAGE_FIELD_INVALID = "message_field_invalid"
"""Pydantic error type of a message with a field its role may not carry (``ctx["field"]`` names it)."""


def _message_error(kind: str, field: str, role: str, why: str) -> PydanticCustomError:
    verb = "needs" if kind == MESSAGE_FIELD_MISSING else "may not carry"
    article = "an" if role == "assistant" else "a"
    return PydanticCustomError(
        kind,
        "{article} {role} message {verb} '{field}'{why}",
        {"article": article, "field": field, "role": role, "verb": verb, "why": why},
    )


class ChatMessage(BaseModel):
    """One chat message. ``developer`` is treated as ``system``."""

    model_config = REQUEST_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # fail_fast: the first invalid part or message ends validation (a body invalid in 30,000 places gave
    # 30,000 errors, ~0.1 s to list; the answer names one either way)
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None = None
    tool_call_id: str | None = Field(None, max_length=limits.MAX_NAME_CHARS)
    tool_calls: list[AssistantToolCall] | None = Field(None, max_length=MAX_TOOLS)

    @model_validator(mode="after")
    def _shape_of_role(self) -> ChatMessage:
        """OpenAI's per-role message shapes (``ChatCompletion*MessageParam`` of the ``openai`` package):
        system, developer, user and tool messages need ``content``, a tool message its ``tool_call_id``
        (the call it answers), an assistant message ``content`` unless it has ``tool_calls``; only
        assistant messages carry ``tool_calls``. Errors name the field (:data:`MESSAGE_FIELD_MISSING`,
        :data:`MESSAGE_FIELD_INVALID`)."""
        if self.content is None and (self.role != "assistant" or not self.tool_calls):
            why = " unless it has 'tool_calls'" if self.role == "assistant" else ""
            raise _message_error(MESSAGE_FIELD_MISSING, "content", self.role, why)
        if isinstance(self.content, list) and not self.content:  # OpenAI refuses it too
            raise _message_error(MESSAGE_FIELD_INVALID, "content", self.role, " that is an empty array")
        if self.role == "tool" and self.tool_call_id is None:
            raise _message_error(MESSAGE_FIELD_MISSING, "tool_call_id", self.role, ", the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise _message_error(
                MESSAGE_FIELD_INVALID, "tool_calls", self.role, "; only assistant messages do"
            )
        return self

    def text(self) -> str:
        """The message text (parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


def effective_stops(stops: list[str]) -> list[str]:
    """Drop stop sequences that cannot change an answer except to spoil it.

    - ``""`` matches before any text, so SGLang ends the answer at once (issue 8: an empty answer with
      ``finish_reason: "stop"``); OpenAI ignores it. Dropped.
    - Duplicates. Dropped (the first of each is kept, in order).

    A sequence that contains another one is kept: it can still decide where the answer is cut (with
    ``["ab", "b"]``, ``"xab"`` ends after ``"x"``). An all-empty list becomes no stop at all.
    """
    return list(dict.fromkeys(s for s in stops if s))


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = REQUEST_CONFIG

    model: str = Field(..., min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1, description="Also bounded by the context (preparation).")
    temperature: float | None = Field(None, ge=0, le=limits.TEMPERATURE_MAX)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=limits.TOP_K_ALL, description="-1 and 0 mean off.")
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, description="At most api.max_n (checked in service.pipeline.prepare).")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=limits.PENALTY_MIN, le=limits.PENALTY_MAX)
    frequency_penalty: float | None = Field(None, ge=limits.PENALTY_MIN, le=limits.PENALTY_MAX)
    repetition_penalty: float | None = Field(
        None, ge=limits.REPETITION_PENALTY_MIN, le=limits.REPETITION_PENALTY_MAX
    )
    ignore_eos: bool | None = Field(None, description="SGLang/vLLM extension: generate max_tokens.")
    seed: int | None = Field(None, ge=limits.SEED_MIN, le=limits.SEED_MAX)
    user: str | None = Field(None, max_length=limits.MAX_USER_CHARS)
    priority: str | None = Field(None, max_length=64, description="radixgate priority class name.")

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else value or []
        if len(items) > limits.MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {limits.MAX_STOP_SEQUENCES} stop sequences")
        for item in items:
            try:
                size = len(item.encode("utf-8"))
            except UnicodeEncodeError:
                raise ValueError("a stop sequence is not valid Unicode (lone surrogate)") from None
            if size > limits.MAX_STOP_BYTES:
                raise ValueError(f"a stop sequence may have at most {limits.MAX_STOP_BYTES} bytes")
        return value

    def stop_list(self) -> list[str]:
        """The stop sequences that can matter, in the order given (see :func:`effective_stops`)."""
        if self.stop is None:
            return []
        return effective_stops([self.stop] if isinstance(self.stop, str) else self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1, max_length=limits.MAX_MESSAGES, fail_fast=True)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS, fail_fast=True)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="SGLang/vLLM extension: template variables (service.protocol.template_kwargs)."
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_template_kwargs(value)
        return value

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("give max_completion_tokens or max_tokens, not two different values")
        return self

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (newer name) or ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions`` (one text prompt)."""

    prompt: str | Annotated[list[str], Field(fail_fast=True)]
    logprobs: int | None = Field(None, ge=0, le=5, description="Alternatives per token (legacy shape).")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt is served per request")
        if (value if isinstance(value, str) else value[0]) == "":
            raise ValueError("prompt must not be empty")
        return value

    def prompt_text(self) -> str:
        """The single prompt string."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def requested_max_tokens(self) -> int | None:
        """``max_tokens`` of the request."""
        return self.max_tokens


class UsageInfo(BaseModel):
    """OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens`` (prefix-cache hits)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] = Field(default_factory=dict)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        """Build from counts, tokens."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details={"cached_tokens": cached_tokens},
        )


def now_s() -> int:
    """Unix time, whole seconds (OpenAI's ``created``)."""
    return int(time.time())
