"""Structured outputs and ``n`` > 1 on ``/v1/chat/completions`` and ``/v1/completions``, against a fake worker
(issue 11): what reaches ``/generate`` (the grammar, one request per choice), the shapes, the reservation
(prompt + n x max_tokens) and the quota charge (every choice). The real engine is in
``test_engine_openai.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from service.app import create_app
from service.config.settings import Settings
from service.protocol.features import check_schema
from tenancy.layout import KeyLayout
from tests.service.api.test_api import (
    MODEL,
    assert_openai_error,
    auth,
    chat,
    gateway_settings,
    new_tenant,
    usage_of,
)
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

BURST = 100_000


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeWorker, str]]:
    worker = FakeWorker()
    with ThreadedServer(worker.app) as server:
        yield worker, server.url


@pytest.fixture(scope="module")
def settings(redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]) -> Settings:
    return gateway_settings(redis_url, stub_model_dir, [fake[1]], max_body_bytes=65536)


@pytest.fixture(scope="module")
def gateway(settings: Settings) -> Iterator[str]:
    with ThreadedServer(create_app(settings)) as server:
        yield server.url


@pytest.fixture
def worker(fake: tuple[FakeWorker, str]) -> FakeWorker:
    fake[0].received.clear()
    return fake[0]


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


def token_level(settings: Settings, tenant_id: str) -> float:
    key = KeyLayout(settings.redis.key_prefix).bucket(tenant_id, "tokens")
    return float(redis.Redis.from_url(settings.redis.url).hget(key, "level") or 0)


# -- structured outputs -------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize(
    ("fmt", "grammar"),
    [
        ({"type": "json_object"}, {"type": "object"}),
        (
            {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
            SCHEMA,
        ),
        ({"type": "json_schema", "json_schema": {"name": "anything"}}, {"type": "object"}),
        ({"type": "text"}, None),
    ],
    ids=["json_object", "json_schema", "no schema", "text"],
)
def test_response_format_becomes_the_engines_json_schema_grammar(
    http: httpx.Client, worker: FakeWorker, fmt: dict[str, Any], grammar: dict[str, Any] | None
) -> None:
    _, key = new_tenant(http)
    resp = http.post("/v1/chat/completions", json=chat(max_tokens=3, response_format=fmt), headers=auth(key))
    assert resp.status_code == 200, resp.text
    sampling = worker.received[-1]["sampling_params"]
    if grammar is None:
        assert "json_schema" not in sampling
    else:
        assert json.loads(sampling["json_schema"]) == grammar


def _arrays(levels: int) -> dict[str, Any]:
    """Arrays of arrays ``levels`` deep (the meta-schema check recursed past Python's limit at ~125)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}},
         "response_format.json_schema.name"),
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://e.com/s.json"}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": _arrays(300)}},
         "response_format.json_schema.schema"),
    ],
    ids=[
        "bad schema", "no json_schema", "bad name", "unknown type", "ref cycle", "ref dangling", "ref remote",
        "nested 300 deep",
    ],
)  # fmt: skip
def test_a_bad_response_format_gets_400_naming_it_and_costs_nothing(
    http: httpx.Client, worker: FakeWorker, fmt: dict[str, Any], param: str
) -> None:
    tenant_id, key = new_tenant(http)
    resp = http.post("/v1/chat/completions", json=chat(response_format=fmt), headers=auth(key))
    assert assert_openai_error(resp, 400)["param"] == param
    assert worker.received == [] and usage_of(http, tenant_id)["requests"] == 0


# -- n > 1 --------------------------------------------------------------------------------------------
def test_n_choices_each_run_on_the_worker_and_all_are_charged(
    http: httpx.Client, worker: FakeWorker, settings: Settings
) -> None:
    tenant_id, key = new_tenant(http, quotas={"tokens_per_min": 1, "token_burst": BURST})
    resp = http.post("/v1/chat/completions", json=chat(n=3, max_tokens=4, seed=7), headers=auth(key))
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "alpha beta gamma delta" for c in data["choices"])
    rid = resp.headers["x-request-id"]
    assert sorted(b["rid"] for b in worker.received) == [f"{rid}-{i}" for i in range(3)]
    assert sorted(b["sampling_params"]["sampling_seed"] for b in worker.received) == [7, 8, 9]
    prompt = len(worker.received[0]["text"].split())  # what the fake reports
    usage = data["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, 12)  # the prompt once
    assert usage["total_tokens"] == prompt + 12
    assert 0 <= token_level(settings, tenant_id) - (BURST - prompt - 12) < 1  # settled to what was used
    recorded = usage_of(http, tenant_id)
    assert (recorded["requests"], recorded["prompt_tokens"], recorded["completion_tokens"]) == (1, prompt, 12)


def test_n_streamed_interleaves_choices_by_index_and_counts_them_all(
    http: httpx.Client, worker: FakeWorker, settings: Settings
) -> None:
    tenant_id, key = new_tenant(http, quotas={"tokens_per_min": 1, "token_burst": BURST})
    req = {"model": MODEL, "prompt": "one two", "n": 2, "max_tokens": 3, "stream": True}
    req["stream_options"] = {"include_usage": True}
    with http.stream("POST", "/v1/completions", json=req, headers=auth(key)) as resp:
        assert resp.status_code == 200
        lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(ln) for ln in lines[:-1]]
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "alpha beta gamma", 1: "alpha beta gamma"} and finish == {0: "length", 1: "length"}
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] == 2
    assert 0 <= token_level(settings, tenant_id) - (BURST - 8) < 1


def test_the_reservation_is_the_prompt_plus_n_times_max_tokens(
    http: httpx.Client, worker: FakeWorker
) -> None:
    _, key = new_tenant(http, quotas={"tokens_per_min": 1, "token_burst": 10})
    resp = http.post("/v1/chat/completions", json=chat(n=3, max_tokens=40), headers=auth(key))
    message = assert_openai_error(resp, 413, "request_exceeds_burst")["message"]
    found = re.search(r"needs (\d+) tokens \(prompt (\d+) \+ n 3 x max_tokens 40\)", message)
    assert found is not None, message
    needed, prompt = int(found[1]), int(found[2])
    assert needed == prompt + 3 * 40
    _, exact = new_tenant(http, quotas={"tokens_per_min": 1, "token_burst": needed})
    assert (
        http.post("/v1/chat/completions", json=chat(n=3, max_tokens=40), headers=auth(exact)).status_code
        == 200
    )
    _, short = new_tenant(http, quotas={"tokens_per_min": 1, "token_burst": needed - 1})
    resp = http.post("/v1/chat/completions", json=chat(n=3, max_tokens=40), headers=auth(short))
    assert_openai_error(resp, 413, "request_exceeds_burst")


def test_n_above_the_setting_gets_400(http: httpx.Client, worker: FakeWorker, settings: Settings) -> None:
    tenant_id, key = new_tenant(http)
    resp = http.post("/v1/chat/completions", json=chat(n=settings.api.max_n + 1), headers=auth(key))
    assert assert_openai_error(resp, 400, "unsupported_value")["param"] == "n"
    assert worker.received == [] and usage_of(http, tenant_id)["requests"] == 0


def _objects(properties: int) -> dict[str, Any]:
    """An object schema with ``properties`` string properties."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}


def _nested(levels: int) -> dict[str, Any]:
    """Objects nested ``levels`` deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"inner": schema}}
    return schema


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "cycle"),
        ({"$ref": "#/$defs/a",
          "$defs": {"a": {"$ref": "#/$defs/b", "title": "t"}, "b": {"$ref": "#/$defs/a"}}}, "cycle"),
        ({"$ref": "#"}, "cycle"),
        ({"$ref": "#/$defs/nope"}, "does not resolve"),
        ({"$ref": "other.json"}, "only local"),
        ({"$defs": {"n": {"type": "object",
                          "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
          "$ref": "#/$defs/n"}, None),  # recursion through a schema (a tree) compiles
        ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "string"}}}, None),
        (SCHEMA, None),
        (_objects(5000), None),  # OpenAI's limits: 5,000 properties, 10 levels, 1,000 enum values
        (_objects(5001), "5000 object properties"),
        (_nested(10), None),
        (_nested(11), "deeper than 10"),
        (_arrays(63), None),
        (_arrays(64), "deeper than 64"),
        (_arrays(300), "deeper than 64"),
        ({"enum": [_arrays(70)]}, "deeper than 64"),  # enum values are data: only their nesting counts
        ({"enum": [{"properties": {"a": {}}, "enum": list(range(2000))}]}, None),
        ({"not": {"anyOf": [{"not": {}}]}}, None),
        ({"type": "string", "enum": [str(i) for i in range(1000)]}, None),
        ({"type": "object", "properties": {k: {"enum": list(range(501))} for k in "ab"}}, "1000 enum"),
        ({"type": "string", "enum": ["\ud800"]}, "lone surrogate"),  # SGLang's JSON decoder refused it
        ({"type": "object", "properties": {"\udfff": {"type": "string"}}}, "lone surrogate"),
        ({"type": "string", "description": "caf\u00e9 \U0001f600"}, None),
    ],
)  # fmt: skip
def test_schemas_the_grammar_compiler_cannot_take_or_that_exceed_openai_s_limits_are_refused(
    schema: dict[str, Any], problem: str | None
) -> None:
    found = check_schema(schema)
    assert (found is None) if problem is None else (found is not None and problem in found), found
