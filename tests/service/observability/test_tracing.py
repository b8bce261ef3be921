"""Tracing against a real gateway, Redis and a fake worker: the span tree and its attributes (streamed and
not), W3C trace context in from the client and out to the worker, no prompt or key in any attribute,
the caller's X-Request-Id kept, exemplars with the trace id, and no provider when tracing is off."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from service.api.request_ids import MAX_CLIENT_ID_CHARS, sanitized
from service.app import create_app
from service.observability.tracing import Tracing
from tests.conftest import gateway_settings
from tests.service.api.test_api import auth, chat, new_tenant
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
PROMPT = "the secret prompt text zebra"


@pytest.fixture(scope="module")
def traced(redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]) -> Iterator[tuple[str, Any]]:
    app = create_app(gateway_settings(redis_url, stub_model_dir, [fake[1]]))
    exporter = InMemorySpanExporter()
    app.state.tracing = Tracing(exporter, "radixgate-test", batch=False)
    with ThreadedServer(app) as server:
        yield server.url, exporter


@pytest.fixture
def http(traced: tuple[str, Any]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=traced[0], timeout=30) as client:
        yield client


def _wait_root(exporter: InMemorySpanExporter, rid: str) -> Any:
    for _ in range(200):
        for span in exporter.get_finished_spans():
            if span.kind == SpanKind.SERVER and span.attributes.get("radixgate.request_id") == rid:
                return span
        time.sleep(0.02)
    raise AssertionError("no request span")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_s_span_tree_attributes_and_propagation(
    http: httpx.Client, traced: tuple[str, Any], fake: tuple[FakeWorker, str], stream: bool
) -> None:
    worker, exporter = fake[0], traced[1]
    worker.mode, worker.delay_s = "ok", 0.0
    worker.received.clear()
    _, key = new_tenant(http)
    parent = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"
    headers = {**auth(key), "traceparent": parent, "x-request-id": "client-42"}
    resp = http.post("/v1/chat/completions", json=chat(PROMPT, max_tokens=4, stream=stream), headers=headers)
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "client-42"
    rid = resp.headers["x-radixgate-request-id"]
    root = _wait_root(exporter, rid)
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE  # a child of the client's span
    assert format(root.parent.span_id, "016x") == "b7ad6b7169203331"
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.usage.output_tokens"] == 4 and a["gen_ai.usage.input_tokens"] > 0
    assert a["radixgate.client_request_id"] == "client-42" and a["http.response.status_code"] == 200
    # the fake worker reports no first_token_latency: a non-streamed answer's TTFT is unknown, left out
    assert ("gen_ai.response.time_to_first_chunk" in a) is stream
    children = [
        s for s in exporter.get_finished_spans() if s.parent and s.parent.span_id == root.context.span_id
    ]
    names = {s.name for s in children}
    assert {"auth", "prepare", "quota", "route", "queue"} <= names
    assert ({"decode", "upstream_connect"} <= names) is stream
    for s in children:
        assert root.start_time <= s.start_time <= s.end_time <= root.end_time + 1000
    # the worker got the trace context: the client's trace id, the request span as parent
    sent = worker.received[-1]["external_trace_header"]["traceparent"]
    assert sent.split("-")[1] == CLIENT_TRACE and sent.split("-")[2] == format(root.context.span_id, "016x")
    everything = json.dumps([dict(s.attributes) for s in [root, *children]])
    assert PROMPT not in everything and key not in everything and "zebra" not in everything


def test_exemplar_carries_the_trace_id(http: httpx.Client, traced: tuple[str, Any]) -> None:
    _, key = new_tenant(http)
    parent = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"
    assert (
        http.post(
            "/v1/chat/completions", json=chat(max_tokens=2), headers={**auth(key), "traceparent": parent}
        ).status_code
        == 200
    )
    accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
    for _ in range(100):  # the request's line and observations come as its settle ends, after its answer
        om = http.get("/metrics", headers=accept)
        if f'trace_id="{CLIENT_TRACE}"' in om.text:
            break
        time.sleep(0.02)
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    exemplars = [line for line in om.text.splitlines() if f'# {{trace_id="{CLIENT_TRACE}"}}' in line]
    assert any(line.startswith("radixgate_request_latency_seconds_bucket") for line in exemplars), exemplars
    assert "trace_id" not in http.get("/metrics").text  # the classic format has no exemplars


@pytest.mark.parametrize(
    ("value", "kept"),
    [
        ("abc-123", "abc-123"),
        ("a" * MAX_CLIENT_ID_CHARS, "a" * MAX_CLIENT_ID_CHARS),
        ("a" * 129, None),
        ("bad id", None),
        ('x"y', None),
        ("x\ty", None),
        ("", None),
        ("é", None),
    ],
)
def test_client_request_id_bounds_and_charset(value: str, kept: str | None) -> None:
    assert sanitized(value.encode()) == kept


def test_a_bad_client_id_is_dropped_and_errors_echo_a_good_one(http: httpx.Client) -> None:
    resp = http.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "a" * 200})
    assert resp.status_code == 401 and len(resp.headers["x-request-id"]) == 32  # the gateway's own
    resp = http.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "mine-1"})
    assert resp.status_code == 401 and resp.headers["x-request-id"] == "mine-1"
    assert len(resp.headers["x-radixgate-request-id"]) == 32


def test_tracing_off_builds_no_provider(redis_url: str, stub_model_dir: Path) -> None:
    app = create_app(gateway_settings(redis_url, stub_model_dir, []))
    assert app.state.tracing is None
