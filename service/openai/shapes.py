"""OpenAI's response objects and stream events for chat and text completions, built from choices.

A shaper is made per request (its id, model and creation time) and turns the choices of
:mod:`service.openai.choices` into a whole response (:meth:`Shaper.response`) or SSE events
(:meth:`Shaper.events`, :meth:`Shaper.end`, :meth:`Shaper.error`). The Responses API has its own
(:mod:`service.openai.responses`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from service.errors import GatewayError
from service.openai.choices import ChoiceState, ChoiceStep
from service.openai.logprobs import chat_logprobs, legacy_logprobs
from service.protocol.compact_json import compact_json
from service.protocol.completions import UsageInfo
from service.protocol.errors import sse_error_event

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One ``data:`` server-sent event (compact JSON; orjson, Python's json for what it refuses)."""
    return b"data: " + compact_json(payload) + b"\n\n"


def named_sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event named after the payload's ``type`` (the Responses API's events)."""
    return f"event: {payload['type']}\n".encode() + sse(payload)


class Shaper(Protocol):
    """Formats one request's answer for its API."""

    def response(self, states: Sequence[ChoiceState], usage: UsageInfo) -> dict[str, Any]:
        """The whole (non-streamed) response object."""
        ...

    def events(self, state: ChoiceState, step: ChoiceStep, first: bool) -> list[bytes]:
        """Stream events for what one piece added to a choice (``first``: the choice's first piece)."""
        ...

    def end(self, usage: UsageInfo) -> list[bytes]:
        """The events that close a stream that finished."""
        ...

    def error(self, err: GatewayError) -> list[bytes]:
        """The events that close a stream that failed after it started."""
        ...


class ChatShaper:
    """``chat.completion`` and ``chat.completion.chunk`` objects.

    Args:
        rid: request id (``chatcmpl-<rid>``).
        model: model id.
        created: Unix time, s.
        include_usage: end a stream with a usage chunk (``stream_options.include_usage``).
    """

    def __init__(self, rid: str, model: str, created: int, include_usage: bool = False) -> None:
        self._id, self._model, self._created, self._include_usage = (
            f"chatcmpl-{rid}",
            model,
            created,
            include_usage,
        )

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self._id, "object": kind, "created": self._created, "model": self._model}

    def response(self, states: Sequence[ChoiceState], usage: UsageInfo) -> dict[str, Any]:
        choices = []
        for state in states:
            message: dict[str, Any] = {"role": "assistant", "content": state.content}
            if state.calls:
                message["content"] = state.content or None
                message["tool_calls"] = [c.openai() for c in state.calls]
            choices.append(
                {
                    "index": state.index,
                    "message": message,
                    "logprobs": chat_logprobs(state.logprobs) if state.logprobs is not None else None,
                    "finish_reason": state.finish_reason,
                }
            )
        return {**self._head("chat.completion"), "choices": choices, "usage": usage.model_dump()}

    def _chunk(self, index: int, delta: dict[str, Any], step: ChoiceStep | None) -> bytes:
        logprobs = None
        if step is not None and step.logprobs is not None:
            logprobs = chat_logprobs(step.logprobs)
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": step.finish_reason if step is not None else None,
        }
        return sse({**self._head("chat.completion.chunk"), "choices": [choice]})

    def events(self, state: ChoiceState, step: ChoiceStep, first: bool) -> list[bytes]:
        out = []
        if first:
            out.append(self._chunk(step.index, {"role": "assistant", "content": ""}, None))
        if not step.empty:
            delta: dict[str, Any] = {}
            if step.text:
                delta["content"] = step.text
            if step.calls:
                delta["tool_calls"] = [c.delta() for c in step.calls]
            out.append(self._chunk(step.index, delta, step))
        return out

    def end(self, usage: UsageInfo) -> list[bytes]:
        if not self._include_usage:
            return [DONE]
        return [
            sse({**self._head("chat.completion.chunk"), "choices": [], "usage": usage.model_dump()}),
            DONE,
        ]

    def error(self, err: GatewayError) -> list[bytes]:
        return [sse_error_event(err), DONE]


class TextShaper:
    """``text_completion`` objects and chunks (``/v1/completions``); logprobs in the legacy shape.

    Args: as :class:`ChatShaper` (``cmpl-<rid>``).
    """

    def __init__(self, rid: str, model: str, created: int, include_usage: bool = False) -> None:
        self._id, self._model, self._created, self._include_usage = (
            f"cmpl-{rid}",
            model,
            created,
            include_usage,
        )

    def _head(self) -> dict[str, Any]:
        return {"id": self._id, "object": "text_completion", "created": self._created, "model": self._model}

    def response(self, states: Sequence[ChoiceState], usage: UsageInfo) -> dict[str, Any]:
        choices = [
            {
                "index": s.index,
                "text": s.content,
                "logprobs": legacy_logprobs(s.logprobs, 0) if s.logprobs is not None else None,
                "finish_reason": s.finish_reason,
            }
            for s in states
        ]
        return {**self._head(), "choices": choices, "usage": usage.model_dump()}

    def events(self, state: ChoiceState, step: ChoiceStep, first: bool) -> list[bytes]:
        if step.empty:
            return []
        logprobs = legacy_logprobs(step.logprobs, step.text_offset) if step.logprobs is not None else None
        choice = {
            "index": step.index,
            "text": step.text,
            "logprobs": logprobs,
            "finish_reason": step.finish_reason,
        }
        return [sse({**self._head(), "choices": [choice]})]

    def end(self, usage: UsageInfo) -> list[bytes]:
        if not self._include_usage:
            return [DONE]
        return [sse({**self._head(), "choices": [], "usage": usage.model_dump()}), DONE]

    def error(self, err: GatewayError) -> list[bytes]:
        return [sse_error_event(err), DONE]


__all__ = ["DONE", "ChatShaper", "Shaper", "TextShaper", "named_sse", "sse"]
