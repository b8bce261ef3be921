"""Exhausted pools (Redis, upstream HTTP) and a slow or stopped Redis give 503 + Retry-After, never 500.

Issue 8, item 3: a burst at several times the Redis pool size over 2 replicas sharing Redis; Redis paused
(``CLIENT PAUSE``); Redis stopped and started again; Redis failing while a served request settles; the
gateway's own connection pool to workers exhausted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from structlog.testing import capture_logs

from service.api.cancellation import SendBoundedStreamingResponse
from service.api.errors import FastJSONResponse
from service.app import create_app
from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_api import ADMIN, MODEL, assert_openai_error, auth, chat, new_tenant, usage_of
from tests.support.fake_worker import FakeWorker
from tests.support.metrics import metrics_once_shown
from tests.support.servers import ThreadedServer, free_port, redis_server


def settings_for(redis_url: str, model_dir: Path, worker: str, prefix: str, **sections: Any) -> Settings:
    base: dict[str, Any] = {
        "admin_token": ADMIN_TOKEN,
        # no quota leases: these tests need every request's reservation to reach Redis (a lease admits
        # from memory; tests/tenancy/test_quota_lease.py covers a paused Redis with one)
        "redis": {"url": redis_url, "key_prefix": prefix, "socket_timeout_s": 0.5, "quota_lease_s": 0},
        "engine": {"served_model_name": MODEL},
        "upstream": {"workers": [worker], "health_interval_s": 0.5},
        "api": {"tokenizer_path": str(model_dir)},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return Settings.model_validate(base)


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeWorker, str]]:
    worker = FakeWorker()
    with ThreadedServer(worker.app) as server:
        yield worker, server.url


@pytest.fixture
def worker(fake: tuple[FakeWorker, str]) -> FakeWorker:
    fake[0].mode, fake[0].delay_s = "ok", 0.0
    return fake[0]


HUGE = {"requests_per_min": 1e9, "tokens_per_min": 1e12}
"""Finite quotas that never refuse."""


@contextlib.contextmanager
def gateway_client(settings: Settings) -> Iterator[httpx.Client]:
    """A gateway on ``settings`` and an HTTP client to it."""
    with ThreadedServer(create_app(settings)) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
        yield http


def ask(http: httpx.Client, key: str, max_tokens: int = 1) -> httpx.Response:
    """One non-streamed chat completion."""
    return http.post("/v1/chat/completions", json=chat(max_tokens=max_tokens), headers=auth(key))


def assert_unavailable(resp: httpx.Response, code: str | None = None) -> None:
    """503 in OpenAI's shape with a Retry-After of whole seconds."""
    assert_openai_error(resp, 503, code)
    assert int(resp.headers["retry-after"]) >= 1


# -- a burst at several times the Redis pool, two replicas ------------------------------------------------


def test_burst_over_two_replicas_with_small_pools_gives_no_5xx_but_503(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str], worker: FakeWorker
) -> None:
    worker.delay_s = 0.05
    small = {
        # auth from Redis on every request (no cache): enough round trips to run a pool of 3 dry
        "redis": {"max_connections": 3, "pool_timeout_s": 0.02, "auth_cache_ttl_s": 0},
        "upstream": {"max_connections": 2, "pool_timeout_s": 0.1},
    }
    apps = [create_app(settings_for(redis_url, stub_model_dir, fake[1], "burst:", **small)) for _ in range(2)]
    with ThreadedServer(apps[0]) as g1, ThreadedServer(apps[1]) as g2:
        with httpx.Client(base_url=g1.url, timeout=30) as admin:
            _, key = new_tenant(admin, quotas={"requests_per_min": 6, "request_burst": 20})

        async def client(base: str) -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as http:
                body = chat(max_tokens=2)
                return await asyncio.gather(
                    *(http.post("/v1/chat/completions", json=body, headers=auth(key)) for _ in range(60))
                )

        async def burst() -> list[httpx.Response]:
            # 4 clients x 60 concurrent requests, spread over the two replicas
            per_client = await asyncio.gather(*(client(url) for url in (g1.url, g2.url, g1.url, g2.url)))
            return [r for rs in per_client for r in rs]

        answers = asyncio.run(burst())
        counts = collections.Counter(r.status_code for r in answers)
        assert len(answers) == 240 and set(counts) <= {200, 429, 503}, counts
        for resp in answers:
            if resp.status_code in (429, 503):
                assert_openai_error(resp, resp.status_code)
                assert int(resp.headers["retry-after"]) >= 1
        codes = collections.Counter(r.json()["error"]["code"] for r in answers if r.status_code == 503)
        # the Redis pool really ran dry (the upstream pool may too: its own test below), and the shared
        # buckets never admitted more than the burst
        assert codes["store_unavailable"] > 0 and set(codes) <= {
            "store_unavailable",
            "upstream_pool_exhausted",
        }
        assert 0 < counts[200] <= 21, counts
        # the pool ran dry on one replica or both, whichever the timing picked: each counts its own
        metrics = [httpx.get(f"{g.url}/metrics", timeout=30).text for g in (g1, g2)]
        assert any("radixgate_store_unavailable_total{" in text for text in metrics)


def test_exhausted_upstream_pool_is_503_and_does_not_blame_the_worker(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str], worker: FakeWorker
) -> None:
    worker.delay_s = 0.3
    settings = settings_for(
        redis_url,
        stub_model_dir,
        fake[1],
        "upool:",
        upstream={"max_connections": 1, "pool_timeout_s": 0.1, "breaker_failures": 1},
    )
    with ThreadedServer(create_app(settings)) as gw:
        with httpx.Client(base_url=gw.url, timeout=30) as admin:
            _, key = new_tenant(admin)

        async def three() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
                body = chat(max_tokens=2)
                return await asyncio.gather(
                    *(http.post("/v1/chat/completions", json=body, headers=auth(key)) for _ in range(3))
                )

        answers = asyncio.run(three())
        statuses = sorted(r.status_code for r in answers)
        assert statuses[0] == 200 and statuses[-1] == 503, statuses
        for resp in answers:
            if resp.status_code == 503:
                assert_unavailable(resp, "upstream_pool_exhausted")
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            assert 'state="open"' not in http.get("/metrics").text  # breaker_failures = 1, still closed
            assert (
                http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)).status_code
                == 200
            )


# -- Redis slow, stopped, failing during settle ---------------------------------------------------------


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[str, int, Path]]:
    """A redis-server of this test alone (paused or stopped without disturbing the others)."""
    port = free_port()
    with redis_server(tmp_path, port) as url:
        yield url, port, tmp_path


def test_paused_redis_gives_503_then_service_resumes(
    own_redis: tuple[str, int, Path], stub_model_dir: Path, fake: tuple[FakeWorker, str], worker: FakeWorker
) -> None:
    url = own_redis[0]
    settings = settings_for(url, stub_model_dir, fake[1], "pause:")
    with gateway_client(settings) as http, redis.Redis.from_url(url) as r:
        # with quotas, every request reserves in Redis (a cached key of an unlimited tenant would not
        # touch Redis before its answer for up to redis.auth_cache_ttl_s)
        tenant_id, key = new_tenant(http, quotas=HUGE)
        assert ask(http, key).status_code == 200
        r.execute_command("CLIENT", "PAUSE", "2500")
        paused_until = time.monotonic() + 2.5
        started = time.monotonic()
        assert_unavailable(ask(http, key), "store_unavailable")
        assert time.monotonic() - started < 2.0  # bounded by the socket timeout (0.5 s), not the pause
        assert_unavailable(http.get(f"/admin/tenants/{tenant_id}", headers=ADMIN), "store_unavailable")
        assert http.get("/readyz").status_code == 503
        time.sleep(max(0.0, paused_until - time.monotonic()) + 0.2)
        resp = ask(http, key)
        assert resp.status_code == 200, resp.text
        assert http.get("/readyz").status_code == 200


def test_stopped_redis_gives_503_then_service_resumes(
    tmp_path: Path, stub_model_dir: Path, fake: tuple[FakeWorker, str], worker: FakeWorker
) -> None:
    port = free_port()
    data = tmp_path / "redis"
    data.mkdir()
    stack = contextlib.ExitStack()
    url = stack.enter_context(redis_server(data, port))
    try:
        with gateway_client(settings_for(url, stub_model_dir, fake[1], "stop:")) as http:
            tenant_id, key = new_tenant(http, quotas=HUGE)  # every request reserves in Redis
            assert ask(http, key).status_code == 200
            # the answer's settle runs after it (reading usage waits for it): saved before the stop,
            # not raced by the SAVE below (it was, when the machine was busy: usage 1 instead of 2)
            assert http.get(f"/admin/tenants/{tenant_id}/usage", headers=ADMIN).json()["requests"] == 1
            with redis.Redis.from_url(url) as r:
                r.save()  # keep the tenant and its usage across the restart
            stack.close()  # Redis stopped
            for _ in range(3):
                assert_unavailable(ask(http, key), "store_unavailable")
            admin = http.post("/admin/tenants", json={"id": "new-one", "name": "n"}, headers=ADMIN)
            assert_unavailable(admin, "store_unavailable")
            stack.enter_context(redis_server(data, port))  # started again, same port and data
            resp = ask(http, key)
            assert resp.status_code == 200, resp.text
            assert http.get(f"/admin/tenants/{tenant_id}/usage", headers=ADMIN).json()["requests"] == 2
    finally:
        stack.close()


def test_redis_failing_during_settle_keeps_the_answer_and_charges_it_later(
    own_redis: tuple[str, int, Path], stub_model_dir: Path, fake: tuple[FakeWorker, str], worker: FakeWorker
) -> None:
    url = own_redis[0]
    worker.delay_s = 0.4  # 2 words: the answer takes 0.8 s
    settings = settings_for(url, stub_model_dir, fake[1], "settle:")
    with gateway_client(settings) as http, redis.Redis.from_url(url) as r:
        tenant_id, key = new_tenant(http)
        pauser = threading.Timer(0.4, lambda: r.execute_command("CLIENT", "PAUSE", "2000"))
        pauser.start()  # Redis stalls while the worker generates: the settle step fails
        resp = ask(http, key, max_tokens=2)
        pauser.join()
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == "alpha beta"
        # the answer goes out before its settle (off the latency path), which then waits out the pause
        metrics_once_shown(http, "radixgate_settle_deferred_total 1.0")
        usage = resp.json()["usage"]
        deadline = time.monotonic() + 20
        charged: dict[str, Any] = {}
        while time.monotonic() < deadline:  # the background retry lands once Redis is back
            charged = http.get(f"/admin/tenants/{tenant_id}/usage", headers=ADMIN).json()
            if charged.get("requests"):
                break
            time.sleep(0.2)
        assert charged["requests"] == 1, charged
        assert charged["prompt_tokens"] == usage["prompt_tokens"] and charged["completion_tokens"] == 2
        metrics = http.get("/metrics").text
        assert "radixgate_settle_failures_total 0.0" in metrics
        assert "radixgate_settle_pending 0.0" in metrics


def test_settle_retries_spent_count_the_request_lost(
    own_redis: tuple[str, int, Path], stub_model_dir: Path, fake: tuple[FakeWorker, str], worker: FakeWorker
) -> None:
    url = own_redis[0]
    worker.delay_s = 0.4
    retry = {"settle_retries": 1, "settle_backoff_s": 0.05, "settle_backoff_max_s": 0.05}
    settings = settings_for(url, stub_model_dir, fake[1], "lost:", redis=retry)
    with gateway_client(settings) as http, redis.Redis.from_url(url) as r:
        tenant_id, key = new_tenant(http)
        pauser = threading.Timer(0.4, lambda: r.execute_command("CLIENT", "PAUSE", "3000"))
        pauser.start()  # the first try and its one retry both time out (0.5 s each) inside the pause
        started = time.monotonic()
        resp = ask(http, key, max_tokens=2)
        pauser.join()
        assert resp.status_code == 200, resp.text
        metrics = metrics_once_shown(http, "radixgate_settle_failures_total 1.0")
        assert "radixgate_settle_deferred_total 1.0" in metrics
        time.sleep(max(0.0, started + 3.6 - time.monotonic()))  # past the pause: nothing landed late
        assert http.get(f"/admin/tenants/{tenant_id}/usage", headers=ADMIN).json()["requests"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_served_answer_does_not_wait_for_its_settle(
    own_redis: tuple[str, int, Path],
    stub_model_dir: Path,
    fake: tuple[FakeWorker, str],
    worker: FakeWorker,
    stream: bool,
) -> None:
    """The settle (quota reconcile and usage, a Redis round trip) runs once the answer is sent: with Redis
    stalled from before the answer's end, the answer still comes when the worker's does (before, it
    waited out the stall), and a usage read that follows waits for the settle and shows it counted."""
    url = own_redis[0]
    worker.delay_s = 0.4  # 2 words: the answer takes 0.8 s
    prefix = f"after-{stream}:"
    settings = settings_for(url, stub_model_dir, fake[1], prefix, redis={"socket_timeout_s": 5.0})
    with gateway_client(settings) as http, redis.Redis.from_url(url) as r:
        tenant_id, key = new_tenant(http)
        pauser = threading.Timer(0.4, lambda: r.execute_command("CLIENT", "PAUSE", "2500", "WRITE"))
        started = time.monotonic()
        pauser.start()  # Redis holds writes from 0.4 s to 2.9 s: the settle waits, not the answer
        body = chat(max_tokens=2, stream=stream)
        resp = http.post("/v1/chat/completions", json=body, headers=auth(key))  # the whole body read
        answered_s = time.monotonic() - started
        pauser.join()
        assert resp.status_code == 200, resp.text
        assert resp.text.rstrip().endswith("data: [DONE]") if stream else resp.json()["usage"]
        assert answered_s < 2.0, answered_s  # the worker's 0.8 s, not the stall's 2.9 s
        # a usage read on this replica waits for the settles of answers it sent (read-your-writes)
        usage = http.get(f"/admin/tenants/{tenant_id}/usage", headers=ADMIN).json()
        assert time.monotonic() - started > 2.5  # it waited out the stall with the settle
        assert usage["requests"] == 1 and usage["completion_tokens"] == 2, usage
        metrics = http.get("/metrics").text
        assert "radixgate_settle_deferred_total 0.0" in metrics  # settled once, not retried


def test_redis_at_maxmemory_gives_503_and_the_served_answer_is_charged_once_it_frees(
    own_redis: tuple[str, int, Path], stub_model_dir: Path, fake: tuple[FakeWorker, str], worker: FakeWorker
) -> None:
    """Redis full (``maxmemory`` reached, ``noeviction``) refuses writes with ``OOM``: requests and admin
    writes get 503 ``store_unavailable`` (not 500), and an answer served while it is full is charged by
    the background settle once memory is freed (not counted lost)."""
    url = own_redis[0]
    worker.delay_s = 0.4  # 2 words: the answer takes 0.8 s
    settings = settings_for(url, stub_model_dir, fake[1], "oom:")
    with gateway_client(settings) as http, redis.Redis.from_url(url) as r:
        tenant_id, key = new_tenant(http, quotas=HUGE)  # every request reserves in Redis
        assert ask(http, key).status_code == 200
        # its settle runs off the answer's path: wait for it (a usage read on this replica does), or on a
        # slow machine it lands once Redis is full and is deferred too (CI: deferred 2, not 1)
        assert usage_of(http, tenant_id)["requests"] == 1
        r.config_set("maxmemory-policy", "noeviction")
        try:
            r.config_set("maxmemory", 1)
            assert_unavailable(ask(http, key), "store_unavailable")
            admin = http.post("/admin/tenants", json={"id": "oom-new", "name": "n"}, headers=ADMIN)
            assert_unavailable(admin, "store_unavailable")
            r.config_set("maxmemory", 0)
            filler = threading.Timer(0.4, lambda: r.config_set("maxmemory", 1))
            filler.start()  # Redis fills up while the worker generates: the settle step is refused
            resp = ask(http, key, max_tokens=2)
            filler.join()
            assert resp.status_code == 200, resp.text
            time.sleep(0.5)
        finally:
            r.config_set("maxmemory", 0)
        deadline = time.monotonic() + 20
        charged: dict[str, Any] = {}
        while time.monotonic() < deadline:  # the background retry lands once Redis has room again
            charged = http.get(f"/admin/tenants/{tenant_id}/usage", headers=ADMIN).json()
            if charged.get("requests") == 2:
                break
            time.sleep(0.2)
        assert charged["requests"] == 2, charged
        metrics = http.get("/metrics").text
        assert "radixgate_settle_deferred_total 1.0" in metrics  # refused at first, then retried
        assert "radixgate_settle_failures_total 0.0" in metrics
        assert 'status="500"' not in metrics
        assert ask(http, key).status_code == 200


@pytest.mark.parametrize(
    ("policy", "warned"), [("allkeys-lru", True), ("volatile-ttl", True), ("noeviction", False)]
)
def test_a_redis_that_evicts_keys_is_named_at_startup(
    own_redis: tuple[str, int, Path],
    stub_model_dir: Path,
    fake: tuple[FakeWorker, str],
    worker: FakeWorker,
    policy: str,
    warned: bool,
) -> None:
    """Under a maxmemory policy that evicts keys, a full Redis silently drops tenants, API keys, buckets
    (a quota starts over) or settle markers (a settle retried after its reply was lost lands twice):
    the gateway says so at startup (``redis_evicts_keys``) so the operator can set ``noeviction``, under
    which a full Redis refuses writes (503) and loses nothing."""
    url = own_redis[0]
    with redis.Redis.from_url(url) as r:
        r.config_set("maxmemory-policy", policy)
    app = create_app(settings_for(url, stub_model_dir, fake[1], "evict:"))  # configures the logs
    with capture_logs() as logs, ThreadedServer(app) as gw:
        assert httpx.get(f"{gw.url}/healthz").status_code == 200
    lines = [e for e in logs if e["event"] == "redis_evicts_keys"]
    assert [e["maxmemory_policy"] for e in lines] == ([policy] if warned else [])


@pytest.mark.parametrize("stream", [False, True])
def test_the_refund_lands_before_a_next_request_the_client_sends_at_once(
    redis_url: str,
    stub_model_dir: Path,
    fake: tuple[FakeWorker, str],
    worker: FakeWorker,
    stream: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The settle is off the answer's path, but under way before the answer's last byte: a tenant at its
    token burst that sends its next request as soon as it holds the answer gets the refund of the
    answer's unused reservation (before, the settle started only once the response had ended: the next
    request could be reserved first and get a 429 its quota did not call for; 2 in 10 back-to-back
    streams on the CPU worker). Here the end of each response is slowed, as a loaded loop slows it."""
    for response_class in (SendBoundedStreamingResponse, FastJSONResponse):
        sent = response_class.__call__

        async def slow_end(self: Any, scope: Any, receive: Any, send: Any, sent: Any = sent) -> None:
            await sent(self, scope, receive, send)
            await asyncio.sleep(0.5)  # the client already holds the whole answer

        monkeypatch.setattr(response_class, "__call__", slow_end)
    worker.tokens, worker.finish = ["Hi", " there"], "stop"  # 2 of the 16 tokens reserved
    try:
        settings = settings_for(redis_url, stub_model_dir, fake[1], f"refund-{stream}:")
        with gateway_client(settings) as http:
            body = chat(max_tokens=16, stream=stream)
            probe_id, probe_key = new_tenant(http, quotas=HUGE)
            assert http.post("/v1/chat/completions", json=body, headers=auth(probe_key)).status_code == 200
            time.sleep(0.6)
            probe = http.get(f"/admin/tenants/{probe_id}/usage", headers=ADMIN).json()
            reserved = probe["prompt_tokens"] + 16
            assert probe["completion_tokens"] == 2, probe
            # a burst for one request, plus what the first one leaves unused: the second fits once refunded
            quotas = {"tokens_per_min": 0.001, "token_burst": 2 * reserved - 1}
            _, key = new_tenant(http, quotas=quotas)
            first = http.post("/v1/chat/completions", json=body, headers=auth(key))
            assert first.status_code == 200, first.text
            second = http.post("/v1/chat/completions", json=body, headers=auth(key))
            assert second.status_code == 200, second.text
    finally:
        worker.tokens, worker.finish = FakeWorker().tokens, "length"
