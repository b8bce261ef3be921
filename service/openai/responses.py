"""The Responses API's objects and stream events (``openai.types.responses``), built from one choice.

A ``response`` object holds ``output`` items in the order the model wrote them (as OpenAI's Responses API
does): a ``message`` with one ``output_text`` part for each run of text, and a ``function_call`` item per
tool call (``call_id`` is the chat completion's call id); text written after a call is a new message after
the call's item. A stream announces the same items in the same order, so its ``response.completed`` holds
what the non-streamed answer holds.
``status`` is ``completed``, or ``incomplete`` with ``incomplete_details.reason = "max_output_tokens"`` when
the answer was cut by the token limit. ``usage`` uses the Responses names (``input_tokens``,
``output_tokens``, ``input_tokens_details.cached_tokens``).

A stream is OpenAI's event sequence, each event an SSE named after its ``type`` with a
``sequence_number``: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``; for text ``response.content_part.added``, ``response.output_text.delta``
..., ``response.output_text.done``, ``response.content_part.done``; for a call
``response.function_call_arguments.delta`` and ``.done``; ``response.output_item.done``; and last
``response.completed`` (or ``response.incomplete``) with the whole response. A failure after the stream
started ends it with ``error`` and ``response.failed``. No ``[DONE]`` (the Responses API sends none).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from service.errors import GatewayError
from service.openai.choices import ChoiceState, ChoiceStep, ToolCall
from service.openai.shapes import named_sse
from service.protocol.completions import UsageInfo


def responses_usage(usage: UsageInfo) -> dict[str, Any]:
    """OpenAI's ``ResponseUsage`` from the chat usage (same counts, the Responses names)."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.get("cached_tokens", 0)},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesShaper:
    """``response`` objects and stream events for one request (a :class:`service.openai.shapes.Shaper`).

    Args:
        rid: request id (``resp_<rid>``; item ids derive from it).
        model: model id.
        created: Unix time, s.
        echo: the request fields the response repeats (:meth:`ResponsesRequest.echo`).
    """

    def __init__(self, rid: str, model: str, created: int, echo: dict[str, Any]) -> None:
        self._rid = rid
        self._head = {"id": f"resp_{rid}", "object": "response", "created_at": created, "model": model}
        self._echo = echo
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # output items so far (streamed)
        self._open: dict[str, Any] | None = None  # the message item being streamed
        self._finish: str | None = None

    # -- objects ---------------------------------------------------------------------------------------
    def _item_id(self, kind: str, index: int) -> str:
        return f"{kind}_" + hashlib.sha256(f"{self._rid}:{index}".encode()).hexdigest()[:32]

    def _call_item(self, call: ToolCall, index: int, status: str = "completed") -> dict[str, Any]:
        return {
            "id": self._item_id("fc", index),
            "type": "function_call",
            "status": status,
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments if status == "completed" else "",
        }

    def _message_item(self, index: int, text: str | None, status: str) -> dict[str, Any]:
        return {
            "id": self._item_id("msg", index),
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [] if text is None else [_text_part(text)],
        }

    def _object(
        self, status: str, output: list[dict[str, Any]], usage: UsageInfo | None, finish: str | None = None
    ) -> dict[str, Any]:
        if status == "completed" and finish == "length":
            status = "incomplete"
        return {
            **self._head,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": output,
            **self._echo,
            "usage": responses_usage(usage) if usage is not None else None,
        }

    def response(self, states: Sequence[ChoiceState], usage: UsageInfo) -> dict[str, Any]:
        """The whole ``response`` object of a non-streamed request (its one choice): its items in the order
        the model wrote them, as a stream of the same answer announces them (:meth:`events`)."""
        (state,) = states
        parts = state.parts()
        output: list[dict[str, Any]] = []
        for i, part in enumerate(parts):
            if isinstance(part, ToolCall):
                output.append(self._call_item(part, len(output)))
                continue
            # cut by the token limit: the last message; one a call closed is whole
            cut = i == len(parts) - 1 and state.finish_reason == "length"
            output.append(self._message_item(len(output), part, "incomplete" if cut else "completed"))
        return self._object("completed", output, usage, state.finish_reason)

    # -- stream ----------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return named_sse(payload)

    def _close_message(self, status: str = "completed") -> list[bytes]:
        item = self._open
        if item is None:
            return []
        self._open = None
        index = len(self._items)
        text = item["content"][0]["text"]
        item["status"] = status
        self._items.append(item)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, part=_text_part(text)),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _text_events(self, text: str) -> list[bytes]:
        """Text the model wrote: added to the message being streamed, or to a new one."""
        out = []
        index = len(self._items)
        if self._open is None:
            self._open = self._message_item(index, "", "in_progress")
            added = {**self._open, "content": []}
            where = {"item_id": self._open["id"], "output_index": index, "content_index": 0}
            out += [
                self._event("response.output_item.added", output_index=index, item=added),
                self._event("response.content_part.added", **where, part=_text_part("")),
            ]
        self._open["content"][0]["text"] += text
        where = {"item_id": self._open["id"], "output_index": index, "content_index": 0}
        out.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
        return out

    def _call_events(self, call: ToolCall) -> list[bytes]:
        """A call the model wrote: the message before it is done, and the call is an item of its own."""
        out = self._close_message()
        index = len(self._items)
        item = self._call_item(call, index)
        where = {"item_id": item["id"], "output_index": index}
        out += [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=self._call_item(call, index, "in_progress"),
            ),
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event(
                "response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
        self._items.append(item)
        return out

    def events(self, state: ChoiceState, step: ChoiceStep, first: bool) -> list[bytes]:
        """Events for what one piece added (``first``: announce the response)."""
        out = []
        if first:
            start = self._object("in_progress", [], None)
            out += [
                self._event("response.created", response=start),
                self._event("response.in_progress", response=start),
            ]
        for part in step.parts:
            out += self._text_events(part) if isinstance(part, str) else self._call_events(part)
        if step.finish_reason is not None:
            self._finish = step.finish_reason
            out += self._close_message("incomplete" if step.finish_reason == "length" else "completed")
        return out

    def end(self, usage: UsageInfo) -> list[bytes]:
        """``response.completed`` (``response.incomplete`` when cut by max_output_tokens)."""
        out = self._close_message()
        whole = self._object("completed", self._items, usage, self._finish)
        kind = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
        return [*out, self._event(kind, response=whole)]

    def error(self, err: GatewayError) -> list[bytes]:
        """``error``, then ``response.failed`` with the error and the output delivered so far (a message cut
        mid-way as ``incomplete``)."""
        output = list(self._items)
        if self._open is not None:
            output.append({**self._open, "status": "incomplete"})
        failed = {
            **self._object("failed", output, None),
            "error": {"code": err.code, "message": err.message},
        }
        return [
            self._event("error", code=err.code, message=err.message, param=err.param),
            self._event("response.failed", response=failed),
        ]


__all__ = ["ResponsesShaper", "responses_usage"]
