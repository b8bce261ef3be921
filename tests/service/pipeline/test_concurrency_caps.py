"""Concurrency caps end to end (gateway in front of a fake worker, real Redis): a capped tenant or key never
has more requests at the worker than its cap (counted at the worker), a refusal is a 429
``concurrency_limit_exceeded`` with ``Retry-After`` that charges no bucket, and the slot comes back on every
way a request ends: answered, failed upstream, refused by a bucket, expired in the queue, client gone."""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from service.app import create_app
from tenancy.layout import KeyLayout
from tests.service.api.test_api import (
    ADMIN,
    assert_openai_error,
    auth,
    chat,
    new_tenant,
    quota_rejections,
    usage_of,
)
from tests.support.fake_worker import TOKENS, FakeWorker, served_fake_worker
from tests.support.gateway import fake_worker_settings
from tests.support.servers import ThreadedServer

PREFIX = "caps:"
_markers = itertools.count()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWorker]:
    with served_fake_worker() as worker:
        yield worker


@pytest.fixture
def worker(fake: FakeWorker) -> FakeWorker:
    fake.mode, fake.delay_s = "ok", 0.0
    fake.markers.clear()
    fake.in_flight.clear()
    fake.peak_in_flight.clear()
    return fake


@pytest.fixture(scope="module")
def http(redis_url: str, stub_model_dir: Path, fake: FakeWorker) -> Iterator[httpx.Client]:
    settings = fake_worker_settings(
        redis_url,
        stub_model_dir,
        fake.url,
        PREFIX,
        scheduler={"window_initial": 32, "window_max": 64},
        redis={"url": redis_url, "key_prefix": PREFIX, "concurrency_lease_s": 5},
    )
    with (
        ThreadedServer(create_app(settings)) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        yield client


@pytest.fixture
def store(redis_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        yield client


def marker() -> str:
    """A word no other request of the module sends (the worker counts requests by it)."""
    return f"mark{next(_markers)}x"


def stream_all(http: httpx.Client, key: str, content: str) -> tuple[int, dict[str, str], str]:
    """One streamed chat read to its end: status, headers, body."""
    body = chat(content, max_tokens=len(TOKENS), stream=True)
    with http.stream("POST", "/v1/chat/completions", json=body, headers=auth(key)) as resp:
        text = "".join(resp.iter_text())
        return resp.status_code, dict(resp.headers), text


def at_once(n: int, call: Any) -> list[Any]:
    """``call(i)`` for i < n, all started together in threads."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(call, range(n)))


def slots_held(store: redis.Redis, tenant_id: str, key_id: str | None = None) -> int:
    """Live members of a slot set (lease not ended, by the Redis server's clock)."""
    seconds, micros = store.time()
    now_ms = seconds * 1000 + micros / 1000
    layout = KeyLayout(PREFIX)
    name = layout.key_slots(tenant_id, key_id) if key_id else layout.slots(tenant_id)
    return int(store.zcount(name, f"({now_ms}", "+inf"))


def until(check: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.02)


def test_a_tenant_with_cap_3_never_has_more_than_3_in_flight(
    http: httpx.Client, worker: FakeWorker, store: redis.Redis
) -> None:
    burst, token_burst = 100, 100_000  # refilled at 0.001/min: the levels say exactly what was charged
    tenant_id, key = new_tenant(
        http,
        max_concurrent_requests=3,
        quotas={
            "requests_per_min": 0.001,
            "request_burst": burst,
            "tokens_per_min": 0.001,
            "token_burst": token_burst,
        },
    )
    mark = marker()
    worker.markers.append(mark)
    worker.delay_s = 0.15  # 8 words: a stream lasts about 1.2 s
    answers = at_once(20, lambda i: stream_all(http, key, f"{mark} stream {i}"))
    served = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] != 200]
    assert worker.peak_in_flight[mark] == 3  # the cap was reached, never passed
    assert 3 <= len(served) < 20
    assert all("[DONE]" in text for _, _, text in served)
    for status, headers, text in refused:
        assert status == 429, text
        assert '"code":"concurrency_limit_exceeded"' in text.replace(" ", "")
        assert int(headers["retry-after"]) >= 1
    usage = usage_of(http, tenant_id)
    assert usage["requests"] == len(served)
    assert usage["concurrency_rejections"] == len(refused)
    assert usage["quota_rejections"] == 0
    # nothing charged for the refusals: each bucket is down by what the served requests used, exactly
    levels = {
        bucket: float(store.hget(KeyLayout(PREFIX).bucket(tenant_id, bucket), "level") or 0)
        for bucket in ("requests", "tokens")
    }
    assert levels["requests"] == pytest.approx(burst - len(served), abs=0.01)
    assert levels["tokens"] == pytest.approx(token_burst - usage["total_tokens"], abs=0.1)
    assert quota_rejections(http, tenant_id) == {("tenant_concurrency", "concurrency_limit"): len(refused)}
    until(lambda: slots_held(store, tenant_id) == 0)  # every slot back


def test_a_key_cap_below_the_tenants(http: httpx.Client, worker: FakeWorker, store: redis.Redis) -> None:
    tenant_id, capped_key = new_tenant(http, max_concurrent_requests=5)
    issued = http.post(
        f"/admin/tenants/{tenant_id}/keys", json={"max_concurrent_requests": 2}, headers=ADMIN
    ).json()
    assert issued["max_concurrent_requests"] == 2
    capped_key, capped_id = issued["api_key"], issued["key_id"]
    _, open_key = new_tenant_key(http, tenant_id)
    tenant_mark, key_mark = marker(), marker()
    worker.markers += [tenant_mark, key_mark]
    worker.delay_s = 0.15

    def send(i: int) -> int:
        key, words = (capped_key, f"{tenant_mark} {key_mark}") if i % 2 else (open_key, tenant_mark)
        return int(stream_all(http, key, f"{words} {i}")[0])

    # the capped key alone: its own cap refuses it while the tenant has room
    alone = at_once(8, lambda i: send(2 * i + 1))
    assert worker.peak_in_flight[key_mark] == 2
    assert set(alone) == {200, 429}
    assert quota_rejections(http, tenant_id) == {("key_concurrency", "concurrency_limit"): alone.count(429)}
    # both keys: at most 2 of the capped key's and 5 of the tenant's at the worker
    mixed = at_once(16, send)
    assert worker.peak_in_flight[key_mark] == 2
    assert worker.peak_in_flight[tenant_mark] == 5
    rejections = quota_rejections(http, tenant_id)
    assert sum(rejections.values()) == alone.count(429) + mixed.count(429)
    assert rejections[("tenant_concurrency", "concurrency_limit")] >= 1
    until(lambda: slots_held(store, tenant_id) + slots_held(store, tenant_id, capped_id) == 0)
    # a key may not be given a cap above its tenant's
    resp = http.post(f"/admin/tenants/{tenant_id}/keys", json={"max_concurrent_requests": 6}, headers=ADMIN)
    assert_openai_error(resp, 400, "invalid_value")
    assert resp.json()["error"]["param"] == "max_concurrent_requests"


def new_tenant_key(http: httpx.Client, tenant_id: str, **spec: Any) -> tuple[str, str]:
    issued = http.post(f"/admin/tenants/{tenant_id}/keys", json=spec, headers=ADMIN)
    assert issued.status_code == 201, issued.text
    return issued.json()["key_id"], issued.json()["api_key"]


def test_a_keys_cap_is_set_changed_and_cleared_by_its_patch(
    http: httpx.Client, worker: FakeWorker, store: redis.Redis
) -> None:
    """``PATCH /admin/tenants/{id}/keys/{key_id}`` sets a key's ``max_concurrent_requests`` under the rule
    of its issue (at most the tenant's cap, 400 otherwise), and the key's next requests are bound by it."""
    tenant_id, _ = new_tenant(http, max_concurrent_requests=3)
    key_id, key = new_tenant_key(http, tenant_id)
    path = f"/admin/tenants/{tenant_id}/keys/{key_id}"
    above = http.patch(path, json={"max_concurrent_requests": 4}, headers=ADMIN)
    assert_openai_error(above, 400, "invalid_value")
    assert above.json()["error"]["param"] == "max_concurrent_requests"
    assert "above tenant" in above.json()["error"]["message"]
    for bad in (0, 1_000_001, 2.5, "2", True):
        assert_openai_error(http.patch(path, json={"max_concurrent_requests": bad}, headers=ADMIN), 400)
    assert http.get(path, headers=ADMIN).json()["max_concurrent_requests"] is None  # nothing written
    patched = http.patch(path, json={"max_concurrent_requests": 1}, headers=ADMIN)
    assert patched.status_code == 200, patched.text
    assert patched.json()["max_concurrent_requests"] == 1
    assert http.get(path, headers=ADMIN).json()["max_concurrent_requests"] == 1

    def request() -> httpx.Response:
        return http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key))

    worker.delay_s = 0.5  # 8 words: the stream holds its slots for about 4 s
    body = chat("patched cap", max_tokens=len(TOKENS), stream=True)
    with http.stream("POST", "/v1/chat/completions", json=body, headers=auth(key)) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        # the patch reached the replica's cached key (pub/sub): the stream holds the key's one slot
        assert slots_held(store, tenant_id, key_id) == 1
        busy = request()
        assert_openai_error(busy, 429, "concurrency_limit_exceeded")
        assert f"rg-{key_id}" in busy.json()["error"]["message"]
        cleared = http.patch(path, json={"max_concurrent_requests": None}, headers=ADMIN)
        assert cleared.json()["max_concurrent_requests"] is None
        until(lambda: request().status_code == 200)  # only the tenant's cap of 3 binds it now
        assert slots_held(store, tenant_id) == 1  # the stream still runs: it passed beside it
        assert http.patch(path, json={"max_concurrent_requests": 3}, headers=ADMIN).status_code == 200
        tenant_path = f"/admin/tenants/{tenant_id}"
        assert http.patch(tenant_path, json={"max_concurrent_requests": 2}, headers=ADMIN).is_success
        # a cap the tenant's has since gone below does not block a patch of the key's other fields
        renamed = http.patch(path, json={"name": "renamed"}, headers=ADMIN)
        assert renamed.status_code == 200 and renamed.json()["max_concurrent_requests"] == 3
        rest = "".join(lines)
    assert "[DONE]" in rest
    until(lambda: slots_held(store, tenant_id) + slots_held(store, tenant_id, key_id) == 0)


def test_a_client_that_leaves_mid_stream_gives_its_slot_back(
    http: httpx.Client, worker: FakeWorker, store: redis.Redis
) -> None:
    tenant_id, key = new_tenant(http, max_concurrent_requests=1)
    worker.delay_s = 0.3
    body = chat("leaving", max_tokens=len(TOKENS), stream=True)
    with http.stream("POST", "/v1/chat/completions", json=body, headers=auth(key)) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        assert slots_held(store, tenant_id) == 1
        busy = http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key))
        assert_openai_error(busy, 429, "concurrency_limit_exceeded")
    # the connection closed part-way: the slot is released once the gateway sees it, long before the lease
    until(lambda: slots_held(store, tenant_id) == 0, 3.0)
    worker.delay_s = 0.0
    assert http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)).status_code == 200
    # a non-streamed request left part-way too
    worker.delay_s = 0.3
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=chat(max_tokens=8), headers=auth(key), timeout=0.5)
    until(lambda: slots_held(store, tenant_id) == 0, 3.0)


def test_the_slot_comes_back_after_errors_and_bucket_refusals(
    http: httpx.Client, worker: FakeWorker, store: redis.Redis
) -> None:
    tenant_id, key = new_tenant(
        http, max_concurrent_requests=1, quotas={"requests_per_min": 0.001, "request_burst": 2}
    )
    worker.mode = "error500"  # failed upstream, streamed or not: refunded, and the slot released
    for stream in (False, True):
        resp = http.post("/v1/chat/completions", json=chat(max_tokens=1, stream=stream), headers=auth(key))
        assert_openai_error(resp, 502, "upstream_error")
        assert slots_held(store, tenant_id) == 0
    worker.mode = "ok"
    for _ in range(2):  # served one after another: the cap of 1 never refuses them
        assert (
            http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)).status_code == 200
        )
    # the request bucket is empty now: refused by it after the slot was taken, and the slot goes back
    assert_openai_error(
        http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)),
        429,
        "rate_limit_exceeded",
    )
    assert slots_held(store, tenant_id) == 0
    usage = usage_of(http, tenant_id)
    assert (usage["requests"], usage["errors"], usage["quota_rejections"]) == (2, 2, 1)
    assert usage["concurrency_rejections"] == 0


def test_tenant_cap_admin_bounds_and_patch(http: httpx.Client, worker: FakeWorker) -> None:
    for bad in (0, -1, 1_000_001, 2.5, "3", True):
        resp = http.post(
            "/admin/tenants",
            json={"id": "capbad", "name": "x", "max_concurrent_requests": bad},
            headers=ADMIN,
        )
        assert_openai_error(resp, 400)
    tenant_id, key = new_tenant(http, max_concurrent_requests=1_000_000)
    assert (
        http.get(f"/admin/tenants/{tenant_id}", headers=ADMIN).json()["max_concurrent_requests"] == 1_000_000
    )
    patched = http.patch(f"/admin/tenants/{tenant_id}", json={"max_concurrent_requests": 2}, headers=ADMIN)
    assert patched.json()["max_concurrent_requests"] == 2
    cleared = http.patch(f"/admin/tenants/{tenant_id}", json={"max_concurrent_requests": None}, headers=ADMIN)
    assert cleared.json()["max_concurrent_requests"] is None
    assert http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)).status_code == 200


@pytest.fixture(scope="module")
def queued(redis_url: str, stub_model_dir: Path, fake: FakeWorker) -> Iterator[httpx.Client]:
    """A gateway that sends one request at a time to the worker; batch requests expire after 400 ms."""
    band = {"rank": 0, "sglang_priority": 0, "ttft_goal_ms": 400, "max_queue_len": 4}
    settings = fake_worker_settings(
        redis_url,
        stub_model_dir,
        fake.url,
        PREFIX,
        scheduler={"window_initial": 1, "window_min": 1, "window_max": 1, "expiry_interval_s": 0.02},
        priority_classes={
            "standard": {"rank": 1, "sglang_priority": 5, "ttft_goal_ms": 10_000, "max_queue_len": 4},
            "batch": band,
        },
    )
    with (
        ThreadedServer(create_app(settings)) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        yield client


def test_a_request_that_expires_in_the_queue_gives_its_slot_back(
    queued: httpx.Client, worker: FakeWorker, store: redis.Redis
) -> None:
    tenant_id, key = new_tenant(queued, max_concurrent_requests=2, max_priority_class="standard")
    worker.delay_s = 0.4  # 8 words: the first request holds the worker's one place for 3.2 s
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(queued.post, "/v1/chat/completions", json=chat(max_tokens=8), headers=auth(key))
        until(lambda: slots_held(store, tenant_id) == 1)
        late = queued.post(
            "/v1/chat/completions", json=chat(max_tokens=1, priority="batch"), headers=auth(key)
        )
        assert late.status_code == 503, late.text  # expired (or shed) in the queue
        assert slots_held(store, tenant_id) == 1  # only the first one's
        assert first.result().status_code == 200
    until(lambda: slots_held(store, tenant_id) == 0)


@pytest.fixture(scope="module")
def two_workers(
    redis_url: str, stub_model_dir: Path
) -> Iterator[tuple[httpx.Client, FakeWorker, FakeWorker]]:
    """A gateway over two fake workers (round robin: the first request goes to the first), a stream silent
    for 0.5 s resumed on the other."""
    with served_fake_worker() as a, served_fake_worker() as b:
        settings = fake_worker_settings(
            redis_url,
            stub_model_dir,
            a.url,
            PREFIX,
            upstream={"workers": [a.url, b.url], "health_interval_s": 0.2, "stream_idle_timeout_s": 0.5},
            routing={"policy": "round_robin"},
        )
        with (
            ThreadedServer(create_app(settings)) as server,
            httpx.Client(base_url=server.url, timeout=30) as client,
        ):
            yield client, a, b


def test_a_stream_moved_to_another_worker_keeps_its_slot(
    two_workers: tuple[httpx.Client, FakeWorker, FakeWorker], store: redis.Redis
) -> None:
    http, a, b = two_workers
    tenant_id, key = new_tenant(http, max_concurrent_requests=1)
    a.mode, b.delay_s = "hang_after_2", 0.3  # a goes silent after 2 words; b sends the rest slowly
    body = chat("moving", max_tokens=len(TOKENS), stream=True)
    with http.stream("POST", "/v1/chat/completions", json=body, headers=auth(key)) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        until(lambda: next(lines).startswith("data:") and bool(b.received), 10.0)  # resumed on b
        assert slots_held(store, tenant_id) == 1
        busy = http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key))
        assert_openai_error(busy, 429, "concurrency_limit_exceeded")
        rest = "".join(lines)
    assert "[DONE]" in rest and '"error"' not in rest
    until(lambda: slots_held(store, tenant_id) == 0)
