"""A dispatched streamed request whose first token does not come by its first-token deadline
(``scheduler.first_token_deadline_factor`` x its class's goal) is given up: 503 ``first_token_timeout``,
its worker request aborted, nothing charged, when a higher class has work in flight on its worker (what
holds it back); one that meets it, or of a late-serving class, runs on.

nu10 found standard requests on a CPU worker held inside the engine by interactive arrivals and SGLang's
priority preemption, their clients waiting 30-142 s with no answer. Here a fake worker that takes 1 s per
word, its first included, plays that engine."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from structlog.testing import capture_logs

from service.app import create_app
from tests.service.api.test_api import assert_openai_error, auth, chat, new_tenant, usage_of
from tests.support.fake_worker import FakeWorker, served_fake_worker
from tests.support.gateway import fake_worker_settings
from tests.support.servers import ThreadedServer

CLASSES = {
    # the higher class whose work holds the others back
    "top": {"rank": 3, "sglang_priority": 20, "ttft_goal_ms": 10000},
    # goal 200 ms: no first token 600 ms after arrival (3x) and it is given up
    "quick": {"rank": 2, "sglang_priority": 10, "ttft_goal_ms": 200},
    # goal 1 s: deadline 3 s, the 1 s first token meets it
    "roomy": {"rank": 1, "sglang_priority": 5, "ttft_goal_ms": 1000},
    # late answers are useful: it waits for its first token whatever it takes
    "late": {
        "rank": 0,
        "sglang_priority": 0,
        "ttft_goal_ms": 200,
        "serve_late": True,
        "queue_wait_budget_ms": 60000,
    },
}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWorker]:
    with served_fake_worker() as worker:
        worker.delay_s = 1.0  # each word, the first too, after 1 s
        yield worker


@pytest.fixture(scope="module")
def http(redis_url: str, stub_model_dir: Path, fake: FakeWorker) -> Iterator[httpx.Client]:
    settings = fake_worker_settings(
        redis_url, stub_model_dir, fake.url, "ftd:", priority_classes=CLASSES, default_priority_class="roomy"
    )
    with ThreadedServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@contextlib.contextmanager
def higher_class_in_flight(http: httpx.Client) -> Iterator[None]:
    """A stream of the top class runs on the worker (3 words, 3 s) while the block runs."""
    _, key = new_tenant(http, priority_class="top")
    body = chat(stream=True, max_tokens=3)

    def run() -> None:
        with http.stream("POST", "/v1/chat/completions", json=body, headers=auth(key)) as resp:
            resp.read()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(0.2)  # dispatched
    try:
        yield
    finally:
        thread.join(10)


def _settled(http: httpx.Client, tenant: str, field: str, value: int) -> dict[str, int]:
    deadline = time.monotonic() + 3
    while (usage := usage_of(http, tenant))[field] != value and time.monotonic() < deadline:
        time.sleep(0.05)
    return usage


def test_a_stream_with_no_first_token_by_its_deadline_gets_503_and_is_not_charged(
    http: httpx.Client, fake: FakeWorker
) -> None:
    tenant, key = new_tenant(http, priority_class="quick")
    fake.aborted.clear()
    with higher_class_in_flight(http), capture_logs() as logs:
        started = time.monotonic()
        body = chat(stream=True, max_tokens=2)
        with http.stream("POST", "/v1/chat/completions", json=body, headers=auth(key)) as resp:
            resp.read()
        took = time.monotonic() - started
        _settled(http, tenant, "errors", 1)
    error = assert_openai_error(resp, 503, "first_token_timeout")
    assert "3x the 'quick' class's time-to-first-token goal (200 ms)" in error["message"]
    assert int(resp.headers["retry-after"]) >= 1
    assert 0.55 < took < 0.95  # at its deadline, not at the worker's first token (1 s)
    assert len(fake.aborted) == 1  # its worker request was ended (not the top class's)
    usage = _settled(http, tenant, "errors", 1)
    assert usage["requests"] == 0 and usage["prompt_tokens"] == 0 and usage["completion_tokens"] == 0
    # its request line says what it asked for, and that none of it was charged
    (line,) = [x for x in logs if x["event"] == "request" and x["tenant"] == tenant]
    assert line["error"] == "first_token_timeout" and line["charged"] is False
    assert line["prompt_tokens"] > 0 and line["prompt_tokens"] + 2 == line["reserved_tokens"]
    metrics = http.get("/metrics").text
    assert 'outcome="first_token_timeout"' in metrics
    assert "radixgate_in_flight_requests 0.0" in metrics


@pytest.mark.parametrize(
    ("priority_class", "higher"),
    [
        ("roomy", True),  # its first token (1 s) meets its deadline (3 s)
        ("late", True),  # late answers are useful: no deadline
        ("quick", False),  # nothing holds it back: it waits its turn, its prefill not wasted
    ],
)
def test_a_first_token_within_the_deadline_of_a_late_class_or_not_held_back_is_served(
    http: httpx.Client, fake: FakeWorker, priority_class: str, higher: bool
) -> None:
    tenant, key = new_tenant(http, priority_class=priority_class)
    fake.aborted.clear()
    with higher_class_in_flight(http) if higher else contextlib.nullcontext():
        body = chat(stream=True, max_tokens=1)
        with http.stream("POST", "/v1/chat/completions", json=body, headers=auth(key)) as resp:
            text = resp.read().decode()
    assert resp.status_code == 200 and text.rstrip().endswith("data: [DONE]")
    assert fake.aborted == []
    assert _settled(http, tenant, "requests", 1)["completion_tokens"] == 1


def test_a_non_streamed_request_has_no_first_token_deadline(http: httpx.Client, fake: FakeWorker) -> None:
    _, key = new_tenant(http, priority_class="quick")
    with higher_class_in_flight(http):
        resp = http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key))
    assert resp.status_code == 200  # the gateway sees no first token of it: it cannot tell one is late
