"""Network faults between the gateway and its workers (issue 31), injected by a TCP proxy in front of each
of two fake workers (:class:`tests.support.fault_proxy.FaultProxy`): added latency with jitter, a thin link,
connections reset mid-answer, and a black hole (connections accepted, nothing answered).

For each: what the client gets (the whole answer, a resumed stream), what the breaker does (a slow worker
stays in the pool; an unreachable one is taken out by its probes), and the ledger (the tenant's usage counts
exactly the tokens the client received).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_admin_workers import wait_for, workers
from tests.service.api.test_api import MODEL, auth, chat, new_tenant, usage_of
from tests.support.fake_worker import WORDS, FakeWorker
from tests.support.fault_proxy import FaultProxy
from tests.support.servers import ThreadedServer

Pair = tuple[FakeWorker, FakeWorker, FaultProxy, FaultProxy]


@pytest.fixture(scope="module")
def proxied() -> Iterator[Pair]:
    a, b = FakeWorker(), FakeWorker()
    with (
        ThreadedServer(a.app) as sa,
        ThreadedServer(b.app) as sb,
        FaultProxy(sa.url, seed=1) as pa,
        FaultProxy(sb.url, seed=2) as pb,
    ):
        yield a, b, pa, pb


@pytest.fixture
def pair(proxied: Pair) -> Pair:
    for worker in proxied[:2]:
        worker.mode, worker.delay_s = "ok", 0.02  # a chunk per token on the wire
        worker.received.clear()
    for proxy in proxied[2:]:
        proxy.clear()
    return proxied


@pytest.fixture
def http(redis_url: str, stub_model_dir: Path, pair: Pair) -> Iterator[httpx.Client]:
    """A fresh gateway per test, reaching the two workers through their proxies."""
    settings = Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": "netfault:"},
            "engine": {"served_model_name": MODEL},
            "upstream": {
                "workers": [pair[2].url, pair[3].url],
                "health_interval_s": 0.2,
                "health_timeout_s": 0.5,
                "deep_probe_every": 0,
                "max_attempts": 2,
                "breaker_failures": 2,
                "breaker_cooldown_s": 60,
                "retry_backoff_s": 0.01,
                "read_timeout_s": 2.0,
                "stream_idle_timeout_s": 1.0,
            },
            "routing": {"policy": "round_robin"},
            "api": {"tokenizer_path": str(stub_model_dir)},
        }
    )
    with ThreadedServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def ask(http: httpx.Client, key: str, stream: bool, max_tokens: int = 6) -> tuple[int, str, int]:
    """One chat completion: (status, the answer's text, its completion tokens as the client counts them:
    content deltas of a stream, the usage of a whole answer)."""
    body = chat(max_tokens=max_tokens, stream=stream)
    if not stream:
        resp = http.post("/v1/chat/completions", json=body, headers=auth(key))
        if resp.status_code != 200:
            return resp.status_code, resp.text, 0
        answer: dict[str, Any] = resp.json()
        return 200, answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]
    with http.stream("POST", "/v1/chat/completions", json=body, headers=auth(key)) as resp:
        events = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: {")]
    assert not any("error" in e for e in events), events
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices")]
    return resp.status_code, "".join(deltas), sum(1 for d in deltas if d)


def breaker_states(http: httpx.Client) -> dict[str, object]:
    return {str(w["url"]): w.get("breaker") for w in workers(http)}


def test_a_slow_jittery_link_delays_answers_and_opens_no_breaker(http: httpx.Client, pair: Pair) -> None:
    """300 ms more per chunk, and up to 200 ms of jitter: every answer whole, in order; the probes (0.5 s
    timeout) still pass, so neither worker leaves the pool: a slow worker is not a dead one."""
    a, b, pa, _ = pair
    tenant, key = new_tenant(http)
    pa.latency_s, pa.jitter_s = 0.3, 0.2
    got = [ask(http, key, stream=i % 2 == 0) for i in range(6)]
    assert all(status == 200 for status, _, _ in got)
    assert {text for _, text, _ in got} == {" ".join(WORDS[:6])}
    assert a.received and b.received  # round robin: the slow worker served its share
    time.sleep(1.0)  # five probe rounds through the slow link
    assert set(breaker_states(http).values()) == {"closed"}
    assert usage_of(http, tenant)["completion_tokens"] == sum(n for _, _, n in got) == 36


def test_a_thin_link_streams_every_token(http: httpx.Client, pair: Pair) -> None:
    """2 KB/s towards the gateway: the stream arrives whole, slower."""
    _, _, pa, pb = pair
    tenant, key = new_tenant(http)
    pa.bandwidth_bps = pb.bandwidth_bps = 2048
    got = [ask(http, key, stream=True), ask(http, key, stream=False)]
    assert got == [(200, " ".join(WORDS[:6]), 6)] * 2
    assert usage_of(http, tenant)["completion_tokens"] == 12


def test_a_connection_reset_mid_stream_is_resumed_on_the_other_worker(http: httpx.Client, pair: Pair) -> None:
    """Worker a's connection is reset (RST) a few chunks into each answer: streams resume on b with what
    was already sent, a whole answer that was cut is asked again of b; the client sees whole answers and
    the usage counts exactly the tokens they carried (no token charged twice for the resume)."""
    a, b, pa, _ = pair
    tenant, key = new_tenant(http)
    pa.reset_after_bytes = 700  # the probes' answers are smaller
    got = [ask(http, key, stream=i % 2 == 0) for i in range(4)]
    assert pa.resets >= 2
    assert [(status, n) for status, _, n in got] == [(200, 6)] * 4
    # a resumed answer is what a sent, then b's continuation (the fake restarts its words at "alpha")
    assert all(text.startswith("alpha") and text.count("alpha") <= 2 for _, text, _ in got)
    assert usage_of(http, tenant)["completion_tokens"] == 24
    assert len(b.received) >= 4  # every answer ended on b: its own, and a's resumed or asked again
    assert a.received


def test_a_black_hole_is_taken_out_by_its_probes_and_its_stream_moves(http: httpx.Client, pair: Pair) -> None:
    """Worker a's link goes dark mid-stream (accepted, never answered): the stream resumes on b after
    stream_idle_timeout_s (1 s), a's probes time out (0.5 s) and open its breaker, and later requests go
    to b alone; the answers are whole and the usage counts what the client received."""
    a, b, pa, _ = pair
    tenant, key = new_tenant(http)
    a.delay_s = 0.3  # a's stream is long enough to go dark in the middle
    with http.stream(
        "POST", "/v1/chat/completions", json=chat(max_tokens=6, stream=True), headers=auth(key)
    ) as resp:
        lines = resp.iter_lines()
        events = []
        for line in lines:
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 2 and not pa.black_hole:
                    pa.black_hole = True
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices")]
    assert sum(1 for d in deltas if d) == 6 and len(b.received) == 1, events
    wait_for(lambda: breaker_states(http)[pa.url] == "open", timeout_s=10)
    before = len(a.received)
    got = [ask(http, key, stream=i % 2 == 0) for i in range(4)]
    assert [(status, n) for status, _, n in got] == [(200, 6)] * 4
    assert len(a.received) == before  # nothing more was sent into the black hole
    assert usage_of(http, tenant)["completion_tokens"] == 30
