"""Retries, mid-stream resume and circuit breaking over HTTP with two fake workers."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_api import ADMIN, MODEL, assert_openai_error, auth, chat, new_tenant, usage_of
from tests.support.fake_worker import WORDS, FakeWorker
from tests.support.servers import ThreadedServer


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakeWorker, FakeWorker, str, str]]:
    a, b = FakeWorker(), FakeWorker()
    with ThreadedServer(a.app) as sa, ThreadedServer(b.app) as sb:
        yield a, b, sa.url, sb.url


@pytest.fixture
def pair(fakes: tuple[FakeWorker, FakeWorker, str, str]) -> tuple[FakeWorker, FakeWorker]:
    for worker in fakes[:2]:
        worker.mode, worker.delay_s = "ok", 0.0
        worker.poison = None
        worker.received.clear()
        worker.aborted.clear()
    return fakes[0], fakes[1]


@pytest.fixture
def http(
    redis_url: str, stub_model_dir: Path, fakes: tuple[FakeWorker, FakeWorker, str, str]
) -> Iterator[httpx.Client]:
    """A fresh gateway per test (round robin starts at the first worker)."""
    settings = Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": "fo:"},
            "engine": {"served_model_name": MODEL},
            "upstream": {
                "workers": [fakes[2], fakes[3]],
                "health_interval_s": 0.2,
                "max_attempts": 2,
                "breaker_failures": 2,
                "breaker_cooldown_s": 60,
                "retry_backoff_s": 0.01,
                "stream_idle_timeout_s": 1.0,
            },
            "routing": {"policy": "round_robin"},
            "api": {"tokenizer_path": str(stub_model_dir)},
        }
    )
    with ThreadedServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def stream_chat(http: httpx.Client, key: str, max_tokens: int) -> tuple[str, list[dict[str, object]]]:
    req = chat(max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
    with http.stream("POST", "/v1/chat/completions", json=req, headers=auth(key)) as resp:
        assert resp.status_code == 200
        events = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices"))  # type: ignore[index,union-attr]
    return text, events


def test_broken_stream_is_resumed_on_the_other_worker(
    http: httpx.Client, pair: tuple[FakeWorker, FakeWorker]
) -> None:
    a, b = pair
    tenant_id, key = new_tenant(http)
    a.mode = "break_after_2"
    text, events = stream_chat(http, key, max_tokens=6)
    assert not any("error" in e for e in events)
    first = a.received[0]
    resumed = b.received[0]
    # the continuation's prompt is the original prompt plus what was already streamed
    assert resumed["text"] == first["text"] + "alpha beta"
    assert resumed["sampling_params"]["max_new_tokens"] == 4
    assert resumed["rid"] == first["rid"] + "-r1"
    assert text == "alpha beta" + " ".join(WORDS[:4])  # the fake restarts its words: no duplicate chunk
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 6  # type: ignore[index]
    assert usage_of(http, tenant_id)["completion_tokens"] == 6


def test_a_stream_gone_silent_is_resumed_on_the_other_worker(
    http: httpx.Client, pair: tuple[FakeWorker, FakeWorker]
) -> None:
    """A hung engine keeps its connection open and sends nothing more: after stream_idle_timeout_s (1 s
    here) of silence the stream resumes on the other worker, instead of waiting out read_timeout_s
    (300 s)."""
    a, b = pair
    tenant_id, key = new_tenant(http)
    a.mode = "hang_after_2"
    started = time.monotonic()
    text, events = stream_chat(http, key, max_tokens=6)
    assert time.monotonic() - started < 5.0
    assert not any("error" in e for e in events)
    assert b.received[0]["text"] == a.received[0]["text"] + "alpha beta"
    assert text == "alpha beta" + " ".join(WORDS[:4])
    assert usage_of(http, tenant_id)["completion_tokens"] == 6


def test_error_before_the_first_token_is_retried_elsewhere(
    http: httpx.Client, pair: tuple[FakeWorker, FakeWorker]
) -> None:
    a, b = pair
    _, key = new_tenant(http)
    a.mode = "error500"
    resp = http.post("/v1/chat/completions", json=chat(max_tokens=3), headers=auth(key))
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "alpha beta gamma"
    assert len(a.received) == 1 and len(b.received) == 1


def test_failing_worker_trips_its_breaker_and_traffic_moves(
    http: httpx.Client, pair: tuple[FakeWorker, FakeWorker]
) -> None:
    a, b = pair
    _, key = new_tenant(http)
    a.mode = "error500"  # /health_generate too: each 5xx's confirmation probe fails
    for _ in range(6):
        assert (
            http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)).status_code == 200
        )
        settled(http, len(a.received))  # its 5xx's confirmation settles before the next request routes
    assert len(a.received) == 2  # breaker_failures = 2: after that, no request reaches it
    assert len(b.received) == 6
    metrics = http.get("/metrics").text
    assert 'radixgate_breaker_transitions_total{state="open"' in metrics
    assert 'radixgate_retries_total{kind="before_first_token"} 2.0' in metrics
    assert http.get("/readyz").json()["ready"] is True
    assert confirmations(http, "confirmed") == 2


def confirmations(http: httpx.Client, verdict: str) -> float:
    """``radixgate_upstream_5xx_confirmations_total`` with ``verdict``, over all workers."""
    pattern = rf'radixgate_upstream_5xx_confirmations_total{{[^}}]*verdict="{verdict}"[^}}]*}} (\S+)'
    return sum(float(v) for v in re.findall(pattern, http.get("/metrics").text))


def settled(http: httpx.Client, count: int, timeout_s: float = 10.0) -> None:
    """Wait until ``count`` 5xx confirmations have settled (any verdict)."""
    deadline = time.monotonic() + timeout_s
    verdicts = ("confirmed", "cleared", "refused", "no_evidence")
    while sum(confirmations(http, v) for v in verdicts) < count:
        assert time.monotonic() < deadline, "5xx confirmations did not settle"
        time.sleep(0.02)


POISON = "crash-the-grammar-engine"
WORKER_TRACE = (
    "Traceback (most recent call last):\n"
    '  File "/opt/sglang/python/sglang/srt/managers/scheduler.py", line 1234, in event_loop\n'
    "RuntimeError: CUDA-less kernel crashed at 0x7f3a2b1c9d00"
)


def test_poisoned_requests_do_not_eject_healthy_workers(
    http: httpx.Client, pair: tuple[FakeWorker, FakeWorker]
) -> None:
    """Both workers answer 500 to one tenant's poisoned request but are otherwise healthy: each 5xx is
    confirmed by a deep probe, which passes, so no breaker opens and other tenants are served."""
    a, b = pair
    for worker in pair:
        worker.poison, worker.poison_message = POISON, WORKER_TRACE
    probes_before = a.deep_probes + b.deep_probes
    _, bad_key = new_tenant(http)
    for i in range(20):
        body = chat(f"please {POISON} now", max_tokens=2, stream=i % 2 == 1)
        resp = http.post("/v1/chat/completions", json=body, headers=auth(bad_key))
        err = assert_openai_error(resp, 502, "upstream_error")
        assert "Traceback" not in err["message"] and "sglang" not in err["message"]
    assert len(a.received) + len(b.received) == 40  # every request was retried on the other worker
    settled(http, 1)
    deadline = time.monotonic() + 10
    while confirmations(http, "cleared") < 2:  # both workers' last confirmations
        assert time.monotonic() < deadline
        time.sleep(0.02)
    probes = a.deep_probes + b.deep_probes - probes_before
    assert 2 <= probes <= 40 + 10  # at most one per 5xx, plus the probe loop's own deep rounds
    workers = http.get("/admin/workers", headers=ADMIN).json()["data"]
    assert [w["breaker"] for w in workers] == ["closed", "closed"]
    assert 'state="open"' not in http.get("/metrics").text
    assert confirmations(http, "confirmed") == 0
    _, good_key = new_tenant(http)
    for _ in range(4):
        resp = http.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth(good_key))
        assert resp.status_code == 200, resp.text
    served = [sum(POISON not in json.dumps(r) for r in w.received) for w in pair]
    assert served == [2, 2]  # both workers are still in the rotation


@pytest.mark.parametrize("status", [401, 403, 404, 405])
def test_worker_without_generate_or_with_an_api_key_is_its_fault_not_the_tenants(
    http: httpx.Client, pair: tuple[FakeWorker, FakeWorker], status: int
) -> None:
    """A worker answering ``/generate`` with 404/405 (not an SGLang server: a wrong URL or port) or
    401/403 (SGLang started with ``--api-key``) refuses every request whatever its input: the request
    is retried on the other worker and the failures open that worker's breaker, instead of every tenant
    getting 400 ``upstream_rejected`` (its input blamed) from that worker for as long as it is in the pool."""
    a, b = pair
    a.reject, a.reject_status = "Not Found" if status in (404, 405) else "Unauthorized", status
    try:
        _, key = new_tenant(http)
        for _ in range(6):
            resp = http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key))
            assert resp.status_code == 200, resp.text
        assert len(a.received) == 2  # breaker_failures = 2: after that, no request reaches it
        assert len(b.received) == 6
        metrics = http.get("/metrics").text
        assert f'radixgate_upstream_errors_total{{kind="http_{status}"' in metrics
        assert 'radixgate_breaker_transitions_total{state="open"' in metrics
        a.received.clear()
        b.mode = "error500"  # no other worker left: the tenant gets a 5xx, not a 400 blaming its input
        resp = http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key))
        assert resp.status_code in (502, 503), resp.text
    finally:
        a.reject, a.reject_status = None, 400
