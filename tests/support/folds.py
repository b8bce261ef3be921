"""Streamed answers folded into the object the same answer has when it is not streamed (issue 25).

A client that reads a stream adds its events up: chat and completions chunks by concatenating each
choice's deltas, the Responses API's events by building each output item from ``output_item.added``, the
deltas and ``output_item.done`` (what ``openai``'s stream helpers do). Each fold here does that, checks the
rules the events must keep on the way (sequence numbers, indexes, a ``.done`` that repeats what the deltas
built), and returns the whole object, to be compared with the non-streamed answer with :func:`comparable`
(ids and timestamps left out: each request has its own).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from typing import Any

PER_REQUEST_KEYS = frozenset({"id", "created", "created_at", "call_id", "item_id"})
"""Keys whose values differ from one request to the next (ids derived from the request id, Unix times)."""


def sse_payloads(lines: Iterable[str]) -> list[tuple[str | None, str]]:
    """(event name or None, data) of each server-sent event in ``lines`` (one text line each)."""
    out: list[tuple[str | None, str]] = []
    name: str | None = None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            out.append((name, line[len("data: ") :]))
            name = None
    return out


def chunks_of(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON chunks of a chat or completions stream, checked to end with ``[DONE]`` (once)."""
    payloads = [data for _, data in sse_payloads(lines)]
    assert payloads and payloads[-1] == "[DONE]", payloads[-1:]
    assert "[DONE]" not in payloads[:-1]
    return [json.loads(data) for data in payloads[:-1]]


def events_of(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The events of a Responses stream, checked: each named after its ``type``, numbered from 0, no
    ``[DONE]``."""
    named = sse_payloads(lines)
    events = [json.loads(data) for _, data in named]
    assert [name for name, _ in named] == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _concat_logprobs(into: dict[str, Any] | None, more: dict[str, Any] | None) -> dict[str, Any] | None:
    if more is None:
        return into
    if into is None:
        return copy.deepcopy(more)
    for key, value in more.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
    return into


def fold_chat(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``chat.completion`` built from ``chat.completion.chunk`` objects: per choice, ``content`` joined
    (null when the message has tool calls and no text, as in the whole answer), ``tool_calls`` by
    ``index`` (id and type from their first delta, name and arguments joined), logprobs joined, the last
    ``finish_reason``; ``usage`` from the usage chunk."""
    head = chunks[0]
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        assert (chunk["id"], chunk["object"], chunk["model"]) == (head["id"], head["object"], head["model"])
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        for part in chunk["choices"]:
            choice = choices.setdefault(
                part["index"], {"role": None, "content": "", "calls": {}, "logprobs": None, "finish": None}
            )
            assert choice["finish"] is None, "a delta after the choice's finish_reason"
            delta = part["delta"]
            choice["role"] = delta.get("role") or choice["role"]
            choice["content"] += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                call = choice["calls"].setdefault(
                    piece["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}}
                )
                call["id"] = call["id"] or piece.get("id")
                call["type"] = call["type"] or piece.get("type")
                function = piece.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
            choice["logprobs"] = _concat_logprobs(choice["logprobs"], part.get("logprobs"))
            choice["finish"] = part.get("finish_reason") or choice["finish"]
    out = []
    for index in sorted(choices):
        choice = choices[index]
        message: dict[str, Any] = {"role": choice["role"], "content": choice["content"]}
        if choice["calls"]:
            assert sorted(choice["calls"]) == list(range(len(choice["calls"])))
            message["content"] = choice["content"] or None
            message["tool_calls"] = [choice["calls"][i] for i in sorted(choice["calls"])]
        out.append(
            {
                "index": index,
                "message": message,
                "logprobs": choice["logprobs"],
                "finish_reason": choice["finish"],
            }
        )
    return {**_head(head, "chat.completion"), "choices": out, "usage": usage}


def fold_completion(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``text_completion`` built from its streamed chunks: per choice, ``text`` joined, the legacy
    logprobs' lists joined, the last ``finish_reason``; ``usage`` from the usage chunk."""
    head = chunks[0]
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        for part in chunk["choices"]:
            choice = choices.setdefault(part["index"], {"text": "", "logprobs": None, "finish": None})
            assert choice["finish"] is None, "a chunk after the choice's finish_reason"
            choice["text"] += part["text"]
            choice["logprobs"] = _concat_logprobs(choice["logprobs"], part.get("logprobs"))
            choice["finish"] = part.get("finish_reason") or choice["finish"]
    out = [
        {"index": i, "text": c["text"], "logprobs": c["logprobs"], "finish_reason": c["finish"]}
        for i, c in sorted(choices.items())
    ]
    return {**_head(head, "text_completion"), "choices": out, "usage": usage}


def _head(chunk: dict[str, Any], kind: str) -> dict[str, Any]:
    return {"id": chunk["id"], "object": kind, "created": chunk["created"], "model": chunk["model"]}


RESPONSE_ENDS = ("response.completed", "response.incomplete")


def fold_responses(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The output items a Responses stream builds, and the response its last event carries.

    Items are built as the events say: ``output_item.added`` opens item ``output_index`` (the next one),
    ``content_part.added`` a part of it, ``output_text.delta`` and ``function_call_arguments.delta`` add
    to them; each ``.done`` must repeat what was built, and ``output_item.done`` closes the item (its
    ``status`` taken from it). Raises AssertionError where the events break these rules.
    """
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in RESPONSE_ENDS, events[-1]["type"]
    items: list[dict[str, Any]] = []
    done: set[int] = set()

    def item_at(event: dict[str, Any]) -> dict[str, Any]:
        index = event["output_index"]
        assert 0 <= index < len(items) and index not in done, (event["type"], index)
        item = items[index]
        if "item_id" in event:
            assert event["item_id"] == item["id"]
        return item

    for event in events[2:-1]:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert event["output_index"] == len(items), "items are added in order"
            assert all(i in done for i in range(len(items))), "an item is added while another is open"
            items.append(copy.deepcopy(event["item"]))
        elif kind == "response.content_part.added":
            item = item_at(event)
            assert event["content_index"] == len(item["content"])
            item["content"].append(copy.deepcopy(event["part"]))
        elif kind == "response.output_text.delta":
            item_at(event)["content"][event["content_index"]]["text"] += event["delta"]
        elif kind == "response.output_text.done":
            assert item_at(event)["content"][event["content_index"]]["text"] == event["text"]
        elif kind == "response.content_part.done":
            assert item_at(event)["content"][event["content_index"]] == event["part"]
        elif kind == "response.function_call_arguments.delta":
            item_at(event)["arguments"] += event["delta"]
        elif kind == "response.function_call_arguments.done":
            item = item_at(event)
            assert (item["arguments"], item["name"]) == (event["arguments"], event["name"])
        elif kind == "response.output_item.done":
            item = item_at(event)
            closed = event["item"]
            assert {**item, "status": closed["status"]} == closed, (item, closed)
            items[event["output_index"]] = closed
            done.add(event["output_index"])
        else:
            raise AssertionError(f"unexpected event {kind}")
    assert done == set(range(len(items))), "an item was never done"
    return items, events[-1]["response"]


def comparable(value: Any) -> Any:
    """``value`` without the keys of :data:`PER_REQUEST_KEYS` (at any depth)."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if k not in PER_REQUEST_KEYS}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


__all__ = [
    "chunks_of",
    "comparable",
    "events_of",
    "fold_chat",
    "fold_completion",
    "fold_responses",
    "sse_payloads",
]
