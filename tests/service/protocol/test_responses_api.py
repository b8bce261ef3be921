"""``POST /v1/responses`` through the gateway, against a fake worker with a fixed answer (issue 11).

Checks the gateway's side: the prompt rendered from ``input``/``instructions`` (a tool round trip without
stored state), what reaches ``/generate`` (token limit, grammar), the Response object and usage, the
streamed event sequence and that it ends with the same response as the non-streamed call, quota
settlement, and the 400s (stateful and unserved fields, hosted tools, image parts) that cost nothing.
The official client against the real engine is in ``test_engine_openai.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import response_create_params

from service.protocol.responses import RESPONSES_FIELDS, responses_table
from tests.service.api.test_api import MODEL, assert_openai_error, auth, new_tenant, usage_of
from tests.service.openai.test_tools_api import CALL_PIECES
from tests.support.fake_worker import FakeWorker
from tests.support.paths import REPO

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture
def worker(fake: tuple[FakeWorker, str]) -> Iterator[FakeWorker]:
    fake[0].received.clear()
    yield fake[0]
    fake[0].tokens, fake[0].finish = list(FakeWorker().tokens), "length"


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


def events_of(http: httpx.Client, key: str, req: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, payload) of a streamed response."""
    with http.stream("POST", "/v1/responses", json={**req, "stream": True}, headers=auth(key)) as resp:
        assert resp.status_code == 200, resp.read()
        lines = list(resp.iter_lines())
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    payloads = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert len(names) == len(payloads) and "[DONE]" not in lines
    assert [p["type"] for p in payloads] == names
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    return list(zip(names, payloads, strict=True))


def test_a_text_answer_is_a_completed_response_with_usage(http: httpx.Client, worker: FakeWorker) -> None:
    tenant_id, key = new_tenant(http)
    req = {"model": MODEL, "input": "hello there", "instructions": "Be brief.", "max_output_tokens": 3}
    resp = http.post("/v1/responses", json=req, headers=auth(key))
    assert resp.status_code == 200, resp.text
    data = resp.json()
    sent = worker.received[-1]
    assert sent["text"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert sent["sampling_params"]["max_new_tokens"] == 3
    assert data["object"] == "response" and data["id"].startswith("resp_") and data["model"] == MODEL
    assert data["status"] == "incomplete" and data["incomplete_details"] == {"reason": "max_output_tokens"}
    (message,) = data["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"] == [
        {"type": "output_text", "text": "alpha beta gamma", "annotations": [], "logprobs": []}
    ]
    assert data["instructions"] == "Be brief." and data["max_output_tokens"] == 3 and data["store"] is False
    usage = data["usage"]
    assert usage["output_tokens"] == 3 and usage["input_tokens"] == len(sent["text"].split())
    assert usage["total_tokens"] == usage["input_tokens"] + 3
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    recorded = usage_of(http, tenant_id)
    assert (recorded["requests"], recorded["completion_tokens"]) == (1, 3)


def test_the_stream_is_openais_event_sequence_ending_with_the_same_response(
    http: httpx.Client, worker: FakeWorker
) -> None:
    _, key = new_tenant(http)
    worker.finish = "stop"
    req = {"model": MODEL, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 20}
    whole = http.post("/v1/responses", json=req, headers=auth(key)).json()
    events = events_of(http, key, req)
    names = [n for n, _ in events]
    deltas = [p["delta"] for n, p in events if n == "response.output_text.delta"]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert len(deltas) == 8 and "".join(deltas) == "".join(worker.tokens)
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    done = events[-1][1]["response"]
    assert done["status"] == "completed"
    for key_ in ("output", "usage", "status", "model", "tools", "text"):
        if key_ == "output":  # item ids are per request
            strip = [{k: v for k, v in item.items() if k != "id"} for item in done["output"]]
            assert strip == [{k: v for k, v in item.items() if k != "id"} for item in whole["output"]]
        else:
            assert done[key_] == whole[key_], key_
    text_done = dict(events)["response.output_text.done"]
    assert text_done["text"] == "".join(deltas) == whole["output"][0]["content"][0]["text"]


def test_a_call_is_a_function_call_item_and_its_result_goes_back_without_state(
    http: httpx.Client, worker: FakeWorker
) -> None:
    tenant_id, key = new_tenant(http)
    worker.tokens, worker.finish = list(CALL_PIECES), "stop"
    req = {"model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER], "max_output_tokens": 20}
    data = http.post("/v1/responses", json=req, headers=auth(key)).json()
    message, call = data["output"]
    assert message["content"][0]["text"] == "Let me check."
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"].startswith("call_")
    assert data["tools"] == [WEATHER] and data["status"] == "completed"
    events = events_of(http, key, req)
    names = [n for n, _ in events]
    assert names[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert dict(events)["response.function_call_arguments.done"]["arguments"] == call["arguments"]
    streamed_call = events[-1][1]["response"]["output"][1]
    assert streamed_call == dict(events)["response.output_item.done"]["item"]
    assert {k: v for k, v in streamed_call.items() if k not in ("id", "call_id")} == {
        k: v for k, v in call.items() if k not in ("id", "call_id")
    }
    # the tool round trip: the call and its output as input items, rendered through the template
    follow = {
        "model": MODEL,
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call["call_id"], "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": call["call_id"], "output": '{"celsius": 21}'},
        ],
        "tools": [WEATHER],
        "tool_choice": "none",
    }  # fmt: skip
    assert http.post("/v1/responses", json=follow, headers=auth(key)).status_code == 200
    text = worker.received[-1]["text"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n" + '{"celsius": 21}' + "\n</tool_response>" in text
    assert usage_of(http, tenant_id)["requests"] == 3


def test_a_long_string_input_is_one_message_and_too_many_items_get_400(
    http: httpx.Client, worker: FakeWorker
) -> None:
    _, key = new_tenant(http)
    words = "w" * 3000  # more characters than the item limit (one token of the stub tokenizer)
    resp = http.post(
        "/v1/responses", json={"model": MODEL, "input": words, "max_output_tokens": 1}, headers=auth(key)
    )
    assert resp.status_code == 200, resp.text
    assert words in worker.received[-1]["text"]
    items = [{"role": "user", "content": "x"}] * 2049
    resp = http.post("/v1/responses", json={"model": MODEL, "input": items}, headers=auth(key))
    assert assert_openai_error(resp, 400, "invalid_value")["param"] == "input"
    resp = http.post("/v1/responses", json={"model": MODEL, "input": "hi " * 600}, headers=auth(key))
    assert assert_openai_error(resp, 400, "context_length_exceeded")["param"] == "input"
    resp = http.post(
        "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 600}, headers=auth(key)
    )
    err = assert_openai_error(resp, 400, "context_length_exceeded")
    assert err["param"] == "max_output_tokens" and "max_output_tokens (600)" in err["message"], err  # nu15


def test_text_format_json_schema_and_a_named_tool_choice_reach_the_engines_grammar(
    http: httpx.Client, worker: FakeWorker
) -> None:
    _, key = new_tenant(http)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    req = {"model": MODEL, "input": "give x", "text": {"format": fmt}}
    data = http.post("/v1/responses", json=req, headers=auth(key)).json()
    assert json.loads(worker.received[-1]["sampling_params"]["json_schema"]) == schema
    assert data["text"] == {"format": fmt}
    named = {"type": "function", "name": "get_weather"}
    req = {"model": MODEL, "input": "weather?", "tools": [WEATHER], "tool_choice": named}
    assert http.post("/v1/responses", json=req, headers=auth(key)).json()["tool_choice"] == named
    assert "structural_tag" in worker.received[-1]["sampling_params"]


UNSUPPORTED = "unsupported_parameter"
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("store true", {"store": True}, "store", "unsupported_value"),
    ("previous response", {"previous_response_id": "resp_1"}, "previous_response_id", UNSUPPORTED),
    ("conversation", {"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ("background", {"background": True}, "background", "unsupported_parameter"),
    ("hosted tool", {"tools": [{"type": "web_search"}]}, "tools", "unsupported_value"),
    ("bad tool schema", {"tools": [{**WEATHER, "parameters": {"type": 5}}]}, "tools.0.parameters",
     "invalid_function_parameters"),
    ("named tool not declared", {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", "invalid_value"),
    ("reasoning", {"reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
    ("include", {"include": ["message.output_text.logprobs"]}, "include", "unsupported_parameter"),
    (
        "image part",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
        "input.0.content.0",
        "unsupported_parameter",
    ),
    ("item reference", {"input": [{"type": "item_reference", "id": "x"}]}, "input.0", UNSUPPORTED),
    ("unknown field", {"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ("empty input", {"input": []}, "input", "invalid_value"),
    # nu12: both were answered 200 here while chat completions refused them
    ("empty content array", {"input": [{"role": "user", "content": []}]}, "input.0.content", "invalid_value"),
    ("stream_options without stream", {"stream_options": {"include_obfuscation": False}}, "stream_options",
     "invalid_value"),
    ("bad schema", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
     "text.format.schema", "invalid_json_schema"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "extra", "param", "code"), REFUSED, ids=[c[0] for c in REFUSED])
def test_unserved_and_stateful_fields_get_400_naming_them_and_cost_nothing(
    http: httpx.Client, worker: FakeWorker, case: str, extra: dict[str, Any], param: str, code: str
) -> None:
    tenant_id, key = new_tenant(http, quotas={"requests_per_min": 1})
    resp = http.post("/v1/responses", json={"model": MODEL, "input": "hi", **extra}, headers=auth(key))
    err = assert_openai_error(resp, 400, code)
    assert err["param"] == param, err
    assert worker.received == []
    assert usage_of(http, tenant_id)["requests"] == 0
    ok = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "store": False}, headers=auth(key))
    assert ok.status_code == 200  # its one request is still there
    if code == "unsupported_value":  # the value as the client wrote it, JSON (nu13: Python's True)
        assert json.dumps(extra[param], separators=(", ", ": "))[:64] in err["message"], err


def test_every_field_of_openais_responses_schema_is_classified_and_the_api_page_table_is_generated() -> None:
    params = response_create_params.ResponseCreateParamsBase
    schema = set(params.__required_keys__ | params.__optional_keys__) | {"stream"}
    assert schema - set(RESPONSES_FIELDS) == set()
    text = (REPO / "docs" / "api.md").read_text()
    start, end = "<!-- responses-table:start -->\n", "\n<!-- responses-table:end -->"
    assert text[text.index(start) + len(start) : text.index(end)] == responses_table(), (
        "regenerate with: python -m service params-table --doc docs/api.md"
    )


def test_a_stream_broken_mid_way_ends_with_error_and_response_failed(
    http: httpx.Client, worker: FakeWorker
) -> None:
    tenant_id, key = new_tenant(http)
    worker.mode = "break_after_2"
    try:
        events = events_of(http, key, {"model": MODEL, "input": "hi", "max_output_tokens": 6})
    finally:
        worker.mode = "ok"
    names = [n for n, _ in events]
    assert names[-2:] == ["error", "response.failed"]
    assert "response.completed" not in names
    error, failed = events[-2][1], events[-1][1]["response"]
    assert error["code"] == "upstream_error" and error["message"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "upstream_error"
    deltas = [p["delta"] for n, p in events if n == "response.output_text.delta"]
    assert "".join(deltas) == "alpha beta"
    # the failed response holds what was delivered, as an incomplete message (nu17: its output was empty)
    (message,) = failed["output"]
    assert message["type"] == "message" and message["status"] == "incomplete"
    assert message["content"][0]["text"] == "alpha beta"
    assert usage_of(http, tenant_id)["completion_tokens"] == 2  # only what was delivered is charged


def test_the_official_clients_stream_helper_accumulates_the_events(
    gateway: str, http: httpx.Client, worker: FakeWorker
) -> None:
    """``client.responses.stream()`` rebuilds the response from the events (it indexes items and parts by
    ``output_index``/``content_index``, so a wrong sequence fails here)."""
    _, key = new_tenant(http)
    worker.tokens, worker.finish = list(CALL_PIECES), "stop"
    api = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)
    request: dict[str, Any] = {
        "model": MODEL,
        "input": "Weather?",
        "tools": [WEATHER],
        "max_output_tokens": 20,
    }
    with api.responses.stream(**request) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    whole = api.responses.create(**request)
    assert final.output_text == "".join(texts) == whole.output_text == "Let me check."
    assert (
        [item.type for item in final.output]
        == [item.type for item in whole.output]
        == ["message", "function_call"]
    )
    call = final.output[1]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    assert final.usage is not None and whole.usage is not None
    assert final.usage.total_tokens == whole.usage.total_tokens


def test_integers_beyond_64_bits_in_a_tool_schema_are_echoed_exactly(
    http: httpx.Client, worker: FakeWorker
) -> None:
    # found by tests/service/api/test_api_fuzz.py: orjson refuses such integers, and rendering the echoed
    # tools was a 500
    tenant_id, key = new_tenant(http)
    big = 2**70 + 1
    tool = {**WEATHER, "parameters": {**WEATHER["parameters"], "maxProperties": big}}
    req = {"model": MODEL, "input": "Weather?", "tools": [tool], "max_output_tokens": 4}
    plain = http.post("/v1/responses", json=req, headers=auth(key))
    assert plain.status_code == 200, plain.text
    assert plain.json()["tools"][0]["parameters"]["maxProperties"] == big
    final = events_of(http, key, req)[-1][1]["response"]  # incomplete: 4 tokens, cut at the limit
    assert final["tools"][0]["parameters"]["maxProperties"] == big
    assert usage_of(http, tenant_id)["requests"] == 2
