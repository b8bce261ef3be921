"""Tool calling through the gateway, against a fake worker that answers with a recorded call (issue 11).

What the fake sends back is fixed, so these tests check the gateway's side: the prompt it renders
(functions and history for a template without ``tools``), the grammar it sends for ``required`` and named
calls, the OpenAI shapes (``tool_calls`` with ids, ``finish_reason``, streamed ``delta.tool_calls``),
stream == non-stream, quota settlement, and the 400s. The real engine is in ``test_engine_openai.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.protocol.fields import CHAT_FIELDS
from tests.service.api.test_api import (
    MODEL,
    assert_openai_error,
    auth,
    gateway_settings,
    new_tenant,
    usage_of,
)
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL_PIECES = [
    "Let me check.",
    "\n<tool_",
    'call>\n{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}\n',
    "</tool_call>",
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def worker(fake: tuple[FakeWorker, str]) -> Iterator[FakeWorker]:
    fake[0].received.clear()
    fake[0].tokens, fake[0].finish = list(CALL_PIECES), "stop"
    yield fake[0]
    fake[0].tokens, fake[0].finish = list(FakeWorker().tokens), "length"


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 20, **extra}


def streamed(http: httpx.Client, key: str, req: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/v1/chat/completions", json={**req, "stream": True}, headers=auth(key)) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def joined(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed answer put back together the way OpenAI's clients do it."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for part in delta.get("tool_calls") or []:
                call = calls.setdefault(part["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = part.get("id") or call["id"]
                call["name"] += part.get("function", {}).get("name") or ""
                call["arguments"] += part.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def test_a_call_in_the_answer_becomes_tool_calls_with_ids(http: httpx.Client, worker: FakeWorker) -> None:
    tenant_id, key = new_tenant(http)
    resp = http.post("/v1/chat/completions", json=body(), headers=auth(key))
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    sent = worker.received[-1]
    assert "structural_tag" not in sent["sampling_params"]  # auto: the model is free
    # The stub template does not lay out tools: the hermes instructions went into a system message.
    assert sent["text"].startswith("<|im_start|>system\nYou are a function calling AI model.")
    assert json.dumps(WEATHER, ensure_ascii=False) in sent["text"]
    usage = resp.json()["usage"]
    recorded = usage_of(http, tenant_id)
    assert recorded["prompt_tokens"] == usage["prompt_tokens"] and recorded["completion_tokens"] == 5


def test_streamed_tool_calls_equal_the_whole_answer(http: httpx.Client, worker: FakeWorker) -> None:
    _, key = new_tenant(http)
    whole = http.post("/v1/chat/completions", json=body(), headers=auth(key)).json()["choices"][0]
    chunks = streamed(http, key, body())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    call_deltas = [
        c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["choices"][0]["delta"]
    ]
    assert call_deltas == [
        [
            {
                "index": 0,
                "id": call_deltas[0][0]["id"],
                "type": "function",
                "function": whole["message"]["tool_calls"][0]["function"],
            }
        ]
    ]
    got = joined(chunks)
    assert got["content"] == whole["message"]["content"]
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]
    ]
    assert got["finish_reason"] == whole["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("choice", "finish"),
    [
        (None, "tool_calls"),
        ("auto", "tool_calls"),
        ("required", "tool_calls"),
        ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
    ],
    ids=["default", "auto", "required", "named"],
)
def test_an_answer_with_calls_finishes_as_openai_says_for_its_tool_choice(
    http: httpx.Client, worker: FakeWorker, choice: Any, finish: str
) -> None:
    """OpenAI: ``tool_calls`` for auto and required, ``stop`` for a named function (issue 25 item 5; the
    gateway said ``tool_calls`` for all), streamed and not; the Responses API's answer is ``completed``."""
    _, key = new_tenant(http)
    req = body() if choice is None else body(tool_choice=choice)
    whole = http.post("/v1/chat/completions", json=req, headers=auth(key)).json()["choices"][0]
    assert whole["message"]["tool_calls"] and whole["finish_reason"] == finish
    got = joined(streamed(http, key, req))
    assert got["calls"] and got["finish_reason"] == finish
    tools = [{"type": "function", **WEATHER["function"]}]  # type: ignore[dict-item]
    responses = {"model": MODEL, "input": "Weather in Paris?", "tools": tools, "max_output_tokens": 20}
    if choice is not None:
        responses["tool_choice"] = {"type": "function", "name": "get_weather"} if finish == "stop" else choice
    data = http.post("/v1/responses", json=responses, headers=auth(key)).json()
    assert data["status"] == "completed" and data["incomplete_details"] is None
    assert [item["type"] for item in data["output"]][-1] == "function_call"
    rule = CHAT_FIELDS["tool_choice"].note  # the README's parameter table says so
    assert "`tool_calls` for auto and required, `stop` for a named function" in rule


def test_required_and_named_choices_send_a_structural_tag(http: httpx.Client, worker: FakeWorker) -> None:
    _, key = new_tenant(http)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel, stop_after_first in (
        ("required", True, False),
        ("required", False, True),
        (named, True, True),
    ):
        req = body(tool_choice=choice, parallel_tool_calls=parallel)
        assert http.post("/v1/chat/completions", json=req, headers=auth(key)).status_code == 200
        tag = json.loads(worker.received[-1]["sampling_params"]["structural_tag"])
        calls = tag["format"]
        assert calls["type"] == "tags_with_separator" and calls["at_least_one"] is True
        assert calls["stop_after_first"] is stop_after_first
        (one,) = calls["tags"]
        assert one["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
        assert one["content"]["json_schema"] == WEATHER["function"]["parameters"]  # type: ignore[index]


def test_tool_choice_none_leaves_tools_out_and_reads_no_calls(http: httpx.Client, worker: FakeWorker) -> None:
    _, key = new_tenant(http)
    resp = http.post("/v1/chat/completions", json=body(tool_choice="none"), headers=auth(key)).json()
    assert "<tools>" not in worker.received[-1]["text"]
    assert resp["choices"][0]["message"] == {"role": "assistant", "content": "".join(CALL_PIECES)}
    assert resp["choices"][0]["finish_reason"] == "stop"


def test_history_with_calls_and_results_is_rendered(http: httpx.Client, worker: FakeWorker) -> None:
    _, key = new_tenant(http)
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    assert (
        http.post("/v1/chat/completions", json=body(messages=history), headers=auth(key)).status_code == 200
    )
    text = worker.received[-1]["text"]
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>" in text
    )
    assert '<|im_start|>tool\n<tool_response>\n{"celsius": 21}\n</tool_response><|im_end|>' in text


def _arrays(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


BAD_TOOLS: list[tuple[str, dict[str, Any], str]] = [
    (
        "schema not a schema",
        body(tools=[{**WEATHER, "function": {"name": "f", "parameters": {"type": 5}}}]),
        "tools.0.function.parameters",
    ),
    (
        "parameters nested 300 deep (was a 500: the meta-schema check hit the recursion limit)",
        body(tools=[{**WEATHER, "function": {"name": "f", "parameters": _arrays(300)}}]),
        "tools.0.function.parameters",
    ),
    ("required without tools", {"model": MODEL, "messages": ASK, "tool_choice": "required"}, "tool_choice"),
    (
        "named function not declared",
        body(tool_choice={"type": "function", "function": {"name": "nope"}}),
        "tool_choice",
    ),
    ("two functions, one name", body(tools=[WEATHER, WEATHER]), "tools"),
    ("custom tools", body(tools=[{"type": "custom", "custom": {"name": "x"}}]), "tools"),
    ("bad function name", body(tools=[{**WEATHER, "function": {"name": "a b"}}]), "tools.0.function.name"),
    (
        "calls on a user message",
        {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                }
            ],
        },
        "messages.0.tool_calls",
    ),
    (
        "response_format with a forced call",
        body(tool_choice="required", response_format={"type": "json_object"}),
        "response_format",
    ),
]


@pytest.mark.parametrize(("case", "req", "param"), BAD_TOOLS, ids=[c[0] for c in BAD_TOOLS])
def test_bad_tool_requests_get_400_naming_the_field_and_cost_nothing(
    http: httpx.Client, worker: FakeWorker, case: str, req: dict[str, Any], param: str
) -> None:
    tenant_id, key = new_tenant(http)
    err = assert_openai_error(http.post("/v1/chat/completions", json=req, headers=auth(key)), 400)
    assert err["param"] == param, (case, err)
    assert worker.received == []
    assert usage_of(http, tenant_id)["requests"] == 0


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<call>{{ call.function.name }} "
    "{{ call.function.arguments | tojson }}</call>{% endfor %}{% else %}{{ message.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tools_gateway(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory, fake: tuple[FakeWorker, str]
) -> Iterator[str]:
    """A gateway whose model's template lays out ``tools`` and ``tool_calls`` itself (as Qwen's does)."""
    from tests.support.model_stub import write_stub_model

    folder = write_stub_model(tmp_path_factory.mktemp("tools-model"))
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    settings = gateway_settings(redis_url, folder, [fake[1]], max_body_bytes=65536)
    with ThreadedServer(create_app(settings)) as server:
        yield server.url


def test_a_template_with_tools_gets_them_the_hugging_face_way(tools_gateway: str, worker: FakeWorker) -> None:
    with httpx.Client(base_url=tools_gateway, timeout=30) as http:
        _, key = new_tenant(http)
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
        history = [
            *ASK,
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "21"},
        ]
        resp = http.post("/v1/chat/completions", json=body(messages=history), headers=auth(key))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    text = worker.received[-1]["text"]
    assert text.startswith("<|im_start|>system\n# Tools" + json.dumps(WEATHER))  # Hugging Face's tojson
    assert "You are a function calling AI model" not in text  # the template's own layout, nothing added
    # arguments reach the template as an object (Hugging Face's convention), results as tool messages
    assert '<|im_start|>assistant\n<call>get_weather {"city": "Paris"}</call><|im_end|>' in text
    assert "<|im_start|>tool\n21<|im_end|>" in text


def test_history_arguments_nested_too_deep_reach_the_template_as_text(
    tools_gateway: str, worker: FakeWorker
) -> None:
    """Arguments Python's parser cannot read (RecursionError: was a 500) reach the template as text."""
    deep = "[" * 3000 + "]" * 3000
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": deep}}
    history = [
        *ASK,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"},
    ]
    with httpx.Client(base_url=tools_gateway, timeout=30) as http:
        _, key = new_tenant(http)
        resp = http.post("/v1/chat/completions", json=body(messages=history), headers=auth(key))
    assert resp.status_code == 200, resp.text
    assert f"<call>get_weather {json.dumps(deep)}</call>" in worker.received[-1]["text"]
