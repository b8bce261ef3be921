"""The gateway queue end to end over HTTP with a fake worker: strict bands, shedding, expiry, cancellation."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from service.app import create_app
from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_api import MODEL, assert_openai_error, auth, chat, new_tenant, usage_of
from tests.support.fake_worker import FakeWorker, served_fake_worker
from tests.support.gateway import fake_worker_settings
from tests.support.servers import ThreadedServer


def band(rank: int, prio: int, goal_ms: float, max_len: int) -> dict[str, Any]:
    return {"rank": rank, "sglang_priority": prio, "ttft_goal_ms": goal_ms, "max_queue_len": max_len}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWorker]:
    with served_fake_worker() as worker:
        yield worker


@pytest.fixture
def worker(fake: FakeWorker) -> FakeWorker:
    fake.mode, fake.delay_s = "ok", 0.0
    fake.received.clear()
    fake.aborted.clear()
    return fake


@pytest.fixture(scope="module")
def http(redis_url: str, stub_model_dir: Path, fake: FakeWorker) -> Iterator[httpx.Client]:
    settings = fake_worker_settings(
        redis_url,
        stub_model_dir,
        fake.url,
        "sched:",
        # one request at a time on the worker: everything else waits in the gateway's queue
        scheduler={
            "window_initial": 1,
            "window_min": 1,
            "window_max": 1,
            "top_band_headroom": 0,
            "expiry_interval_s": 0.02,
        },
        priority_classes={
            "interactive": band(2, 10, 10_000, 10),
            "standard": band(1, 5, 10_000, 10),
            "batch": band(0, 0, 400, 2),
        },
    )
    with (
        ThreadedServer(create_app(settings)) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        yield client


def in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn(*args)`` in a daemon thread; its result lands in the returned list."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    return thread, out


def post_chat(http: httpx.Client, key: str, **extra: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json=chat(max_tokens=2, **extra), headers=auth(key))


def hold_worker(http: httpx.Client, worker: FakeWorker, key: str, seconds: float) -> threading.Thread:
    """Occupy the single worker slot for about ``seconds``."""
    worker.delay_s = seconds / 2
    thread, _ = in_thread(post_chat, http, key)
    deadline = time.monotonic() + 5
    while not worker.received and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.delay_s = 0.0
    return thread


def test_strict_priority_order_between_bands(http: httpx.Client, worker: FakeWorker) -> None:
    _, key = new_tenant(http, max_priority_class="interactive")
    holder = hold_worker(http, worker, key, 1.5)
    started = [
        in_thread(lambda c=cls: post_chat(http, key, priority=c)) for cls in ("standard", "interactive")
    ]
    time.sleep(0.1)
    started += [in_thread(lambda c=cls: post_chat(http, key, priority=c)) for cls in ("batch", "standard")]
    for t in [holder, *(s[0] for s in started)]:
        t.join(timeout=30)
    # after the holder (standard = 5): interactive first, then standard in arrival order; the batch
    # request waited past its 400 ms budget behind them and was answered 503 without reaching the worker
    assert [b["priority"] for b in worker.received] == [5, 10, 5, 5]
    assert [r[1][0].status_code for r in started] == [200, 200, 503, 200]


def test_full_band_is_shed_and_queued_past_budget_expires(http: httpx.Client, worker: FakeWorker) -> None:
    tenant_id, key = new_tenant(http, priority_class="batch", quotas={"requests_per_min": 100})
    _, holder_key = new_tenant(http)
    holder = hold_worker(http, worker, holder_key, 2.0)
    queued = [in_thread(post_chat, http, key) for _ in range(2)]  # fills the batch band (max 2)
    time.sleep(0.1)
    with capture_logs() as logs:
        shed = post_chat(http, key)
        for thread, _ in queued:
            thread.join(timeout=10)
    assert_openai_error(shed, 503, "overloaded")
    assert int(shed.headers["Retry-After"]) >= 1
    lines = {x["request_id"]: x for x in logs if x["event"] == "request"}
    # its request line says why it was shed (nu10: it said only "overloaded"); no prediction refused it
    line = lines[shed.headers["x-request-id"]]
    assert line["shed_reason"] == "band_full" and line["predicted_ttft_ms"] is None
    for _, out in queued:
        resp = out[0]
        assert_openai_error(resp, 503, "queue_timeout")  # batch budget 400 ms < the 2 s hold
        # its line says how long it waited (nu11: queued_ms was null) and what was predicted
        expired = lines[resp.headers["x-request-id"]]
        assert expired["queued_ms"] >= 390 and expired["predicted_ttft_ms"] is not None
    holder.join(timeout=10)
    assert len(worker.received) == 1  # none of them reached the worker
    usage = usage_of(http, tenant_id)
    assert usage["requests"] == 0 and usage["prompt_tokens"] == 0
    metrics = http.get("/metrics").text
    assert (
        f'radixgate_scheduler_outcomes_total{{band="batch",outcome="shed",tenant="{tenant_id}"}} 1.0'
        in metrics
    )
    assert 'radixgate_shed_total{band="batch",reason="band_full"} 1.0' in metrics
    assert (
        f'radixgate_scheduler_outcomes_total{{band="batch",outcome="expired",tenant="{tenant_id}"}} 2.0'
        in metrics
    )


def test_disconnect_while_queued_leaves_the_queue_and_refunds(http: httpx.Client, worker: FakeWorker) -> None:
    # one request reserves ~all of the token burst; after its client leaves the queue it must be refunded
    tenant_id, key = new_tenant(http, quotas={"tokens_per_min": 1, "token_burst": 40})
    _, holder_key = new_tenant(http)
    holder = hold_worker(http, worker, holder_key, 1.5)
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=chat(max_tokens=20), headers=auth(key), timeout=0.3)
    time.sleep(0.2)
    holder.join(timeout=10)
    resp = http.post("/v1/chat/completions", json=chat(max_tokens=20), headers=auth(key))
    assert resp.status_code == 200, resp.text  # the reservation came back
    assert len(worker.received) == 2  # holder + the retry; the cancelled one never reached the worker
    metrics = http.get("/metrics").text
    assert f'outcome="cancelled",tenant="{tenant_id}"}} 1.0' in metrics


def test_disconnect_while_streaming_aborts_the_upstream_request(
    http: httpx.Client, worker: FakeWorker
) -> None:
    tenant_id, key = new_tenant(http)
    worker.delay_s = 0.3
    with http.stream(
        "POST", "/v1/chat/completions", json=chat(max_tokens=8, stream=True), headers=auth(key)
    ) as r:
        first = next(r.iter_lines())
        assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
    rid = worker.received[-1]["rid"]
    deadline = time.monotonic() + 5
    while rid not in worker.aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rid in worker.aborted
    time.sleep(0.3)
    usage = usage_of(http, tenant_id)
    assert usage["completion_tokens"] <= 2  # charged only what was streamed before the disconnect
    assert http.get("/metrics").text.count("radixgate_in_flight_requests 0.0") == 1


def test_a_request_of_n_choices_takes_n_slots_of_the_window(
    redis_url: str, stub_model_dir: Path, worker: FakeWorker
) -> None:
    """With a window of 2, an n=2 request fills the worker: the next request waits in the gateway's queue
    (the engine would run 3 sequences at once if n counted as one slot)."""
    settings = Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": "sched-n:"},
            "engine": {"served_model_name": MODEL},
            "upstream": {"workers": [worker.url], "health_interval_s": 0.2},
            "api": {"tokenizer_path": str(stub_model_dir)},
            "scheduler": {"window_mode": "fixed", "window_initial": 2, "top_band_headroom": 0},
        }
    )
    with (
        ThreadedServer(create_app(settings)) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        _, key = new_tenant(client, max_priority_class="interactive")
        worker.delay_s = 0.3  # 2 words: 0.6 s per choice
        wide, wide_out = in_thread(lambda: post_chat(client, key, n=2))
        deadline = time.monotonic() + 5
        while len(worker.received) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(worker.received) == 2  # both choices run on the worker
        narrow, narrow_out = in_thread(post_chat, client, key)
        time.sleep(0.2)
        (listed,) = client.get("/admin/workers", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()[
            "data"
        ]
        assert listed["window"] == 2 and listed["queued"] == 1  # waits for the n=2 request's slots
        assert listed["capacity_rps"] is None and listed["prediction_scale"] == {}  # nothing measured yet
        assert len(worker.received) == 2
        wide.join(10)
        narrow.join(10)
        assert wide_out[0].status_code == 200 and len(wide_out[0].json()["choices"]) == 2
        assert narrow_out[0].status_code == 200 and len(worker.received) == 3
