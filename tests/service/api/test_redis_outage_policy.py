"""The Redis outage policy (``redis.on_outage``, issue 31) against a real redis-server that the test stops,
starts again or freezes (SIGSTOP).

Under ``open``: a key this replica authenticated before the outage is served; each replica admits a tenant
from its own buckets, its share of the limit (the limit / the live replicas it last saw: exactly the burst / N
while no unit refills); an unknown key gets 503; once Redis is back the usage counts exactly what was served
and the shared buckets are not charged for it. Under ``closed`` the same outage gives 503. A Redis frozen
for seconds under load charges nothing twice: per tenant, the usage equals what its clients received.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from structlog.testing import capture_logs

from tenancy.layout import KeyLayout
from tests.service.api.test_api import ADMIN, auth, new_tenant, usage_of
from tests.service.api.test_store_unavailable import (
    ask,
    assert_unavailable,
    gateway_client,
    settings_for,
)
from tests.support.fake_worker import FakeWorker
from tests.support.servers import free_port, redis_server

OPEN = {"on_outage": "open"}
REPLICAS = {"heartbeat_s": 0.2, "ttl_s": 120, "share_windows": False}

SLOW = {"requests_per_min": 1, "request_burst": 30, "tokens_per_min": 1e9}
"""30 requests of burst, refilled at 1 a minute: over 3 replicas a share of 10, and one more only after
3 minutes (no test runs that long): what the local bucket admits is exact."""

WIDE = {"requests_per_min": 0.001, "request_burst": 100_000, "tokens_per_min": 0.001, "token_burst": 10**8}
"""Buckets that never refuse here and refill next to nothing (the frozen-Redis test's ledger)."""


@pytest.fixture
def worker(fake: tuple[FakeWorker, str]) -> FakeWorker:
    fake[0].mode, fake[0].delay_s = "ok", 0.0
    return fake[0]


class StoppableRedis:
    """A redis-server of one test that it stops and starts again on the same port and data (``SAVE``d)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self._stack = contextlib.ExitStack()
        self.url = self._stack.enter_context(redis_server(folder, self.port))

    def stop(self) -> None:
        with redis.Redis.from_url(self.url) as r:
            r.save()  # tenants, keys, buckets and usage survive the restart
        self._stack.close()

    def start(self) -> None:
        self._stack.enter_context(redis_server(self.folder, self.port))

    def close(self) -> None:
        self._stack.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[StoppableRedis]:
    server = StoppableRedis(tmp_path)
    try:
        yield server
    finally:
        server.close()


def other_replicas(url: str, prefix: str, count: int) -> None:
    """Heartbeats of ``count`` more live replicas (ids that sort after the gateway's own), as of now."""
    with redis.Redis.from_url(url, decode_responses=True) as r:
        seconds, micros = r.time()
        beat = json.dumps({"t": seconds + micros / 1e6, "d": None})
        r.hset(f"{prefix}replicas", mapping={f"zz-other-{i}": beat for i in range(count)})


def metric(text: str, name: str) -> float:
    """The value of the sample ``name`` (with its labels, as written) in a ``/metrics`` text."""
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for(http: httpx.Client, tenant_id: str, requests: int, timeout_s: float = 20) -> dict[str, Any]:
    """The tenant's usage once it counts ``requests`` (or the last read, after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            usage = usage_of(http, tenant_id)
        except AssertionError:  # 503 while the gateway reconnects
            usage = {"requests": -1}
        if usage["requests"] >= requests or time.monotonic() > deadline:
            return usage
        time.sleep(0.2)


def served(answers: list[httpx.Response]) -> tuple[int, int, int]:
    """(answers with status 200, their prompt tokens, their completion tokens)."""
    ok = [r.json()["usage"] for r in answers if r.status_code == 200]
    return len(ok), sum(u["prompt_tokens"] for u in ok), sum(u["completion_tokens"] for u in ok)


def test_open_serves_known_keys_from_the_replicas_share_and_charges_the_usage_once_redis_is_back(
    own_redis: StoppableRedis, stub_model_dir: Path, fake: tuple[FakeWorker, str], worker: FakeWorker
) -> None:
    prefix = "open:"
    other_replicas(own_redis.url, prefix, 2)  # 3 live replicas: this one's share is a third
    settings = settings_for(own_redis.url, stub_model_dir, fake[1], prefix, redis=OPEN, replicas=REPLICAS)
    with gateway_client(settings) as http, capture_logs() as logs:
        tenant_id, key = new_tenant(http, quotas=SLOW)
        unused = http.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "never-used"}, headers=ADMIN)
        first = ask(http, key, max_tokens=2)  # authenticated from Redis: remembered for the outage
        assert first.status_code == 200, first.text
        time.sleep(0.5)  # a heartbeat that saw the other two replicas
        assert usage_of(http, tenant_id)["requests"] == 1
        own_redis.stop()

        answers = [ask(http, key, max_tokens=2) for _ in range(15)]
        statuses = [r.status_code for r in answers]
        # the share: 30 / 3 = 10 requests, then 429 until a unit refills here (3 minutes)
        assert statuses == [200] * 10 + [429] * 5, statuses
        refused = answers[-1]
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) > 60
        assert refused.headers["x-ratelimit-limit-requests"] == "10"  # this replica's share of the burst
        # a key this replica never authenticated is not admitted blind; a wrong secret is refused
        assert_unavailable(ask(http, unused.json()["api_key"]), "store_unavailable")
        wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
        assert ask(http, wrong).status_code == 401
        assert http.get("/readyz").status_code == 200  # open: still ready, serving from its buckets
        text = http.get("/metrics").text
        assert metric(text, "radixgate_redis_outage_mode") == 1.0
        assert metric(text, 'radixgate_outage_admissions_total{outcome="admitted"}') == 10
        assert metric(text, 'radixgate_outage_admissions_total{outcome="rate_limited"}') == 5
        assert metric(text, 'radixgate_outage_authentications_total{outcome="unknown"}') == 1

        own_redis.start()
        usage = wait_for(http, tenant_id, 11)
        want = served([first, *answers])
        assert want[0] == 11
        assert (usage["requests"], usage["prompt_tokens"], usage["completion_tokens"]) == want
        time.sleep(1.0)  # nothing lands a second time
        assert usage_of(http, tenant_id)["requests"] == 11
        assert metric(http.get("/metrics").text, "radixgate_redis_outage_mode") == 0.0
        # the shared bucket was charged for the answer before the outage only (refilled by ~1/60 a second)
        with redis.Redis.from_url(own_redis.url, decode_responses=True) as r:
            level = float(r.hget(KeyLayout(prefix).bucket(tenant_id, "requests"), "level") or "nan")
        assert 29 <= level < 30, level
        # and the gateway decides in Redis again
        assert ask(http, key).status_code == 200
    events = [e["event"] for e in logs]
    assert events.count("redis_outage_mode_entered") == 1 and events.count("redis_outage_mode_left") == 1
    left = next(e for e in logs if e["event"] == "redis_outage_mode_left")
    assert left["admitted"] == 10 and left["rate_limited"] == 5 and left["served_requests"] == 10


def test_closed_gives_503_for_the_same_outage(
    own_redis: StoppableRedis, stub_model_dir: Path, fake: tuple[FakeWorker, str], worker: FakeWorker
) -> None:
    """The default: a key authenticated a moment ago gets 503 store_unavailable while Redis is down, and
    readiness says not ready; the gateway recovers by itself."""
    settings = settings_for(own_redis.url, stub_model_dir, fake[1], "closed:", replicas=REPLICAS)
    assert settings.redis.on_outage == "closed"
    with gateway_client(settings) as http:
        tenant_id, key = new_tenant(http, quotas=SLOW)
        assert ask(http, key).status_code == 200
        assert usage_of(http, tenant_id)["requests"] == 1
        own_redis.stop()
        for _ in range(3):
            assert_unavailable(ask(http, key), "store_unavailable")
        assert http.get("/readyz").status_code == 503
        assert metric(http.get("/metrics").text, "radixgate_redis_outage_mode") == 0.0
        own_redis.start()
        deadline = time.monotonic() + 10
        while (resp := ask(http, key)).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert resp.status_code == 200, resp.text
        assert wait_for(http, tenant_id, 2)["requests"] == 2


def test_a_revoked_key_stays_refused_during_the_outage(
    own_redis: StoppableRedis, stub_model_dir: Path, fake: tuple[FakeWorker, str], worker: FakeWorker
) -> None:
    settings = settings_for(own_redis.url, stub_model_dir, fake[1], "revoked:", redis=OPEN)
    with gateway_client(settings) as http:
        tenant_id, key = new_tenant(http, quotas=SLOW)
        assert ask(http, key).status_code == 200
        key_id = key.split(".")[0].removeprefix("rg-")
        revoked = http.delete(f"/admin/tenants/{tenant_id}/keys/{key_id}", headers=ADMIN)
        assert revoked.status_code == 200, revoked.text
        assert ask(http, key).status_code == 401
        own_redis.stop()
        assert ask(http, key).status_code == 401  # known revoked: not served from memory


def test_a_frozen_redis_under_load_charges_each_tenant_exactly_what_it_was_served(
    own_redis: StoppableRedis, stub_model_dir: Path, fake: tuple[FakeWorker, str], worker: FakeWorker
) -> None:
    """Redis is frozen (SIGSTOP) for 3 s while 2 tenants x 2 clients send requests: calls in flight time
    out (0.5 s), the replica enters outage mode and serves from its buckets, settles that timed out are
    retried; Redis resumes (SIGCONT) with the calls it had queued. Per tenant the usage equals what its
    clients received: nothing is lost and nothing is charged twice (a settle retried after its first try
    landed late is a no-op under its marker; the outage's sums land once)."""
    worker.delay_s = 0.01
    settings = settings_for(own_redis.url, stub_model_dir, fake[1], "frozen:", redis=OPEN)
    with gateway_client(settings) as http, redis.Redis.from_url(own_redis.url) as r:
        tenants = [new_tenant(http, quotas=WIDE) for _ in range(2)]
        pid = int(r.info("server")["process_id"])
        answers: dict[str, list[httpx.Response]] = {t: [] for t, _ in tenants}
        stop = threading.Event()

        def client(tenant_id: str, key: str) -> None:
            with httpx.Client(base_url=http.base_url, timeout=30) as own:
                while not stop.is_set():
                    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
                    resp = own.post("/v1/chat/completions", json={**body, "max_tokens": 2}, headers=auth(key))
                    answers[tenant_id].append(resp)

        threads = [threading.Thread(target=client, args=t) for t in tenants for _ in range(2)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(1.5)
            os.kill(pid, signal.SIGSTOP)
            time.sleep(3.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(1.5)
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        text = http.get("/metrics").text
        assert metric(text, 'radixgate_outage_admissions_total{outcome="admitted"}') > 0
        for tenant_id, _ in tenants:
            got = answers[tenant_id]
            assert {resp.status_code for resp in got} <= {200, 503}, {resp.status_code for resp in got}
            want = served(got)
            usage = wait_for(http, tenant_id, want[0])
            assert (usage["requests"], usage["prompt_tokens"], usage["completion_tokens"]) == want
        time.sleep(1.0)
        for tenant_id, _ in tenants:
            assert usage_of(http, tenant_id)["requests"] == served(answers[tenant_id])[0]
        assert "radixgate_settle_failures_total 0.0" in http.get("/metrics").text


def test_open_refuses_budgets_and_shares_concurrency_caps(
    own_redis: StoppableRedis, stub_model_dir: Path, fake: tuple[FakeWorker, str], worker: FakeWorker
) -> None:
    """While Redis is down under ``open``: a tenant with a budget is refused (503: its spend cannot be
    checked); a tenant capped at 2 concurrent requests over 3 live replicas has no share here (503); one
    capped at 3 has a share of 1: its second concurrent request gets 429 ``concurrency_limit_exceeded``."""
    prefix = "caps:"
    other_replicas(own_redis.url, prefix, 2)
    settings = settings_for(own_redis.url, stub_model_dir, fake[1], prefix, redis=OPEN, replicas=REPLICAS)
    with gateway_client(settings) as http:
        budgeted, budget_key = new_tenant(http, quotas=SLOW)
        spec = {"period": "day", "hard_limit_usd": 100}
        assert http.put(f"/admin/tenants/{budgeted}/budget", json=spec, headers=ADMIN).status_code == 200
        _, two = new_tenant(http, quotas=SLOW, max_concurrent_requests=2)
        _, three = new_tenant(http, quotas=SLOW, max_concurrent_requests=3)
        for key in (budget_key, two, three):
            assert ask(http, key).status_code == 200
        time.sleep(0.5)  # a heartbeat that saw the other two replicas
        own_redis.stop()
        assert_unavailable(ask(http, budget_key), "store_unavailable")
        assert_unavailable(ask(http, two), "store_unavailable")
        assert ask(http, three).status_code == 200  # one at a time: within the share of 1
        worker.delay_s = 0.3
        slow = threading.Thread(target=ask, args=(http, three, 3))
        slow.start()
        time.sleep(0.3)  # the first is in flight
        second = ask(http, three)
        slow.join()
        assert second.status_code == 429 and second.json()["error"]["code"] == "concurrency_limit_exceeded"
        worker.delay_s = 0.0
        assert ask(http, three).status_code == 200  # its slot came back
        text = http.get("/metrics").text
        assert metric(text, 'radixgate_outage_admissions_total{outcome="refused"}') == 2
