"""Tool results name calls made before them, and call ids are not reused (issue 25).

A table of conversations, for chat completions (``messages``) and the Responses API (``input``), sent
to the real gateway in front of the fake worker: the valid ones are served, each broken reference (a
result for an unknown id, a reused call id, a call answered twice, a result before its call or with no
call at all, a call never answered) is a 400 ``invalid_request_error`` naming the field, with OpenAI's
message, that never reaches the worker and charges nothing, streamed or not
(:mod:`service.protocol.conversation`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.service.api.test_api import MODEL, assert_openai_error, auth, new_tenant, usage_of
from tests.service.openai.test_tools_api import WEATHER
from tests.service.protocol.test_responses_api import WEATHER as RESPONSES_WEATHER
from tests.support.fake_worker import FakeWorker

USER = {"role": "user", "content": "Weather in Paris?"}
LATER = {"role": "user", "content": "And in Rome?"}
ANSWER = {"role": "assistant", "content": "21 C."}


def asked(*ids: str) -> dict[str, Any]:
    """An assistant message that calls get_weather once per id."""
    calls = [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        for i in ids
    ]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def result(call: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call, "content": '{"temp_c": 21}'}


def call_item(call: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call, "name": "get_weather", "arguments": '{"city": "Paris"}'}


def output_item(call: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call, "output": '{"temp_c": 21}'}


@dataclass(frozen=True)
class Conversation:
    """A conversation and what the gateway answers: None (served), or the 400's param and a text of its
    message."""

    name: str
    turns: list[dict[str, Any]]
    param: str | None = None
    says: str = ""


CHATS = [
    Conversation("a call and its result", [USER, asked("call_1"), result("call_1")]),
    Conversation(
        "two calls answered in another order",
        [USER, asked("call_1", "call_2"), result("call_2"), result("call_1")],
    ),
    Conversation(
        "two rounds",
        [USER, asked("call_1"), result("call_1"), ANSWER, LATER, asked("call_2"), result("call_2")],
    ),
    Conversation(
        "a result for a call that never happened",
        [USER, asked("call_1"), result("call_9")],
        "messages.2.tool_call_id",
        "'call_9' not found in 'tool_calls'",
    ),
    Conversation(
        "a call id used twice",
        [USER, asked("call_1"), result("call_1"), LATER, asked("call_1"), result("call_1")],
        "messages.4.tool_calls.0.id",
        "Duplicate value for 'id' of 'call_1'",
    ),
    Conversation(
        "two ids alike in one message",
        [USER, asked("call_1", "call_1"), result("call_1")],
        "messages.1.tool_calls.1.id",
        "Duplicate value for 'id' of 'call_1'",
    ),
    Conversation(
        "a call answered twice",
        [USER, asked("call_1"), result("call_1"), result("call_1")],
        "messages.3.tool_call_id",
        "Duplicate value for 'tool_call_id' of 'call_1'",
    ),
    Conversation(
        "a result before its call",
        [USER, result("call_1"), asked("call_1"), result("call_1")],
        "messages.1.role",
        "must be a response to a preceding message with 'tool_calls'",
    ),
    Conversation(
        "a result with no calls at all",
        [USER, result("call_9")],
        "messages.1.role",
        "must be a response to a preceding message with 'tool_calls'",
    ),
    Conversation(
        "a result after the next user message",
        [USER, asked("call_1"), LATER, result("call_1")],
        "messages.1.role",
        "did not have response messages: call_1",
    ),
    Conversation(
        "a call never answered",
        [USER, asked("call_1", "call_2"), result("call_1")],
        "messages.1.role",
        "did not have response messages: call_2",
    ),
]

INPUTS = [
    Conversation("a call and its output", [USER, call_item("call_1"), output_item("call_1")]),
    Conversation(
        "two calls answered in another order",
        [USER, call_item("call_1"), call_item("call_2"), output_item("call_2"), output_item("call_1")],
    ),
    Conversation(
        "two rounds",
        [USER, call_item("call_1"), output_item("call_1"), LATER, call_item("call_2"), output_item("call_2")],
    ),
    Conversation(
        "an output for a call that never happened",  # the case
        [USER, call_item("call_1"), output_item("call_9")],
        "input.2.call_id",
        "No tool call found for function call output with call_id call_9",
    ),
    Conversation(
        "a call id used twice",
        [USER, call_item("call_1"), output_item("call_1"), call_item("call_1"), output_item("call_1")],
        "input.3.call_id",
        "Duplicate 'call_id' call_1",
    ),
    Conversation(
        "a call answered twice",
        [USER, call_item("call_1"), output_item("call_1"), output_item("call_1")],
        "input.3.call_id",
        "Duplicate function call output for call_id call_1",
    ),
    Conversation(
        "an output before its call",
        [USER, output_item("call_1"), call_item("call_1")],
        "input.1.call_id",
        "No tool call found for function call output with call_id call_1",
    ),
    Conversation(
        "an output with no calls at all",
        [USER, output_item("call_9")],
        "input.1.call_id",
        "No tool call found for function call output with call_id call_9",
    ),
    Conversation(
        "a call never answered",
        [USER, call_item("call_1"), call_item("call_2"), output_item("call_1")],
        "input.2.call_id",
        "No tool output found for function call call_2",
    ),
]


@pytest.fixture
def worker(fake: tuple[FakeWorker, str]) -> Iterator[FakeWorker]:
    fake[0].received.clear()
    yield fake[0]


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


def answered(
    http: httpx.Client, worker: FakeWorker, path: str, body: dict[str, Any], case: Conversation
) -> None:
    """Send ``body`` streamed and not; check the answer ``case`` expects (a 400 costs nothing)."""
    tenant_id, key = new_tenant(http)
    for stream in (False, True):
        resp = http.post(path, json={**body, "stream": stream}, headers=auth(key))
        if case.param is None:
            assert resp.status_code == 200, resp.text
            continue
        err = assert_openai_error(resp, 400, "invalid_value")
        assert err["type"] == "invalid_request_error" and err["param"] == case.param, err
        assert case.says in err["message"], err
    if case.param is not None:
        assert worker.received == []
        assert usage_of(http, tenant_id)["requests"] == 0


@pytest.mark.parametrize("case", CHATS, ids=[c.name for c in CHATS])
def test_chat_tool_results_answer_calls_made_before_them(
    http: httpx.Client, worker: FakeWorker, case: Conversation
) -> None:
    body = {"model": MODEL, "messages": case.turns, "tools": [WEATHER], "max_tokens": 3}
    answered(http, worker, "/v1/chat/completions", body, case)


@pytest.mark.parametrize("case", INPUTS, ids=[c.name for c in INPUTS])
def test_responses_function_call_outputs_answer_calls_made_before_them(
    http: httpx.Client, worker: FakeWorker, case: Conversation
) -> None:
    body = {
        "model": MODEL,
        "instructions": "Be brief.",  # not an input item: the indexes are the input's own
        "input": case.turns,
        "tools": [RESPONSES_WEATHER],
        "max_output_tokens": 3,
    }
    answered(http, worker, "/v1/responses", body, case)
