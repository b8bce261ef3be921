"""Ending in-flight requests when their tenant is disabled or deleted or their key is revoked
(service.pipeline.revocation): the registry alone, then end to end over HTTP with a slow fake worker."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config.settings import Settings
from service.errors import GatewayError, PermissionDenied, ShuttingDown
from service.pipeline.revocation import RevocationRegistry
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_api import assert_openai_error, auth, chat, new_tenant, usage_of
from tests.support.fake_worker import FakeWorker, served_fake_worker
from tests.support.gateway import fake_worker_settings
from tests.support.servers import ThreadedServer

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


# -- the registry ------------------------------------------------------------------------------------
class Checks:
    """Tenant and key checks answering from a table (``error`` per id; a missing id still authenticates)."""

    def __init__(self) -> None:
        self.errors: dict[str, GatewayError | Exception] = {}
        self.calls: list[str] = []

    async def check(self, name: str) -> GatewayError | None:
        self.calls.append(name)
        found = self.errors.get(name)
        if isinstance(found, GatewayError) or found is None:
            return found
        raise found


async def _served(registry: RevocationRegistry, rid: str, tenant: str, key: str, work: Awaitable[str]) -> str:
    """A request's await on its worker, as the dispatcher makes it (:meth:`Revocable.guard`)."""
    entry = registry.track(rid, tenant, key)
    try:
        return await entry.guard(work)
    finally:
        registry.untrack(entry)


@pytest.mark.parametrize(
    ("message", "ended"),
    [
        ("tenant:t1", {"a", "b"}),  # both of t1's requests, whatever their key
        ("key:k1", {"a"}),  # only the request of the revoked key
        ("tenant:t2", set()),  # a tenant that still authenticates: nothing ends
        ("key:gone", set()),  # no request of that key in flight: not even checked
        ("tenant:broken", set()),  # the check failed (Redis unavailable): nothing ends
        ("nonsense", set()),
    ],
)
async def test_an_invalidation_ends_the_requests_of_what_no_longer_authenticates(
    message: str, ended: set[str]
) -> None:
    tenants, keys = Checks(), Checks()
    tenants.errors = {"t1": PermissionDenied("disabled", code="tenant_disabled"), "broken": OSError("down")}
    keys.errors = {"k1": PermissionDenied("revoked", code="invalid_api_key"), "gone": PermissionDenied("x")}
    registry = RevocationRegistry(tenants.check, keys.check)
    loop = asyncio.get_running_loop()
    works = {rid: loop.create_future() for rid in ("a", "b", "c", "d")}
    tasks = {
        "a": asyncio.create_task(_served(registry, "a", "t1", "k1", works["a"])),
        "b": asyncio.create_task(_served(registry, "b", "t1", "k2", works["b"])),
        "c": asyncio.create_task(_served(registry, "c", "t2", "k3", works["c"])),
        "d": asyncio.create_task(_served(registry, "d", "broken", "k4", works["d"])),
    }
    await asyncio.sleep(0)
    assert registry.in_flight("tenant", "t1") == 2 and registry.in_flight("key", "k1") == 1
    registry.on_invalidation(message)
    for _ in range(5):
        await asyncio.sleep(0)
    for rid, work in works.items():
        if not work.done():
            work.set_result(rid)
    results = dict(zip(tasks, await asyncio.gather(*tasks.values(), return_exceptions=True), strict=True))
    assert {rid for rid, r in results.items() if isinstance(r, GatewayError)} == ended
    assert all(r == rid for rid, r in results.items() if rid not in ended)
    assert "gone" not in keys.calls
    assert registry.in_flight("tenant", "t1") == 0 and registry.in_flight("key", "k1") == 0


async def test_a_cancellation_from_elsewhere_still_propagates_and_a_disabled_registry_ends_nothing() -> None:
    checks = Checks()
    checks.errors = {"t1": PermissionDenied("disabled")}
    registry = RevocationRegistry(checks.check, checks.check, enabled=False)
    work: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(_served(registry, "a", "t1", "k1", work))
    await asyncio.sleep(0)
    registry.on_invalidation("tenant:t1")
    await asyncio.sleep(0)
    assert checks.calls == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_end_all_ends_every_request_and_those_that_arrive_after_it() -> None:
    """A stopping process's drain deadline (service/runtime/drain.py): every request in flight ends with the
    error,
    whatever its tenant or key, and so does one still between its admission and its first guarded await
    (tracked later): its work is never started."""
    checks = Checks()
    registry = RevocationRegistry(checks.check, checks.check, enabled=False)  # works without revocations
    loop = asyncio.get_running_loop()
    works = {rid: loop.create_future() for rid in ("a", "b")}
    tasks = [
        asyncio.create_task(_served(registry, "a", "t1", "k1", works["a"])),
        asyncio.create_task(_served(registry, "b", "t2", "k2", works["b"])),
    ]
    await asyncio.sleep(0)
    bye = ShuttingDown("bye", retry_after_s=1.0)
    assert registry.end_all(bye) == 2
    started: list[str] = []

    async def late_work() -> str:
        started.append("late")
        return "served"

    late = asyncio.create_task(_served(registry, "c", "t3", "k3", late_work()))
    results = await asyncio.gather(*tasks, late, return_exceptions=True)
    assert results == [bye, bye, bye] and started == []
    assert registry.in_flight("tenant", "t1") == registry.in_flight("tenant", "t3") == 0


# -- end to end --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWorker]:
    with served_fake_worker() as worker:
        yield worker


@pytest.fixture
def worker(fake: FakeWorker) -> Iterator[FakeWorker]:
    fake.mode, fake.delay_s = "ok", 0.25  # 8 words: 2 s per answer
    fake.received.clear()
    fake.aborted.clear()
    yield fake
    fake.delay_s = 0.0


def _settings(redis_url: str, stub_model_dir: Path, fake: FakeWorker, prefix: str, **api: Any) -> Settings:
    return fake_worker_settings(redis_url, stub_model_dir, fake.url, prefix, api=api)


@pytest.fixture(scope="module")
def http(redis_url: str, stub_model_dir: Path, fake: FakeWorker) -> Iterator[httpx.Client]:
    app = create_app(_settings(redis_url, stub_model_dir, fake, "revoke:"))
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def _stream_events(http: httpx.Client, key: str, first: threading.Event, out: list[Any]) -> None:
    """Stream a chat answer; ``first`` is set on its first event; ``out`` gets the status and events."""
    body = chat(stream=True, max_tokens=8, stream_options={"include_usage": True})
    with http.stream("POST", "/v1/chat/completions", json=body, headers=auth(key)) as resp:
        out.append(resp.status_code)
        for line in resp.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                first.set()


def _start_stream(http: httpx.Client, key: str) -> tuple[threading.Thread, list[Any]]:
    first, out = threading.Event(), []
    thread = threading.Thread(target=_stream_events, args=(http, key, first, out), daemon=True)
    thread.start()
    assert first.wait(5)
    return thread, out


@pytest.mark.parametrize(
    ("action", "code"),
    [("disable", "tenant_disabled"), ("delete", "invalid_api_key"), ("revoke", "invalid_api_key")],
)
def test_a_stream_under_way_ends_with_an_error_event_when_revoked(
    http: httpx.Client, worker: FakeWorker, action: str, code: str
) -> None:
    tenant, key = new_tenant(http)
    _, other_key = new_tenant(http)
    thread, out = _start_stream(http, key)
    other, other_out = _start_stream(http, other_key)  # another tenant's stream is left alone
    started = time.monotonic()
    if action == "disable":
        assert http.post(f"/admin/tenants/{tenant}/disable", headers=ADMIN).status_code == 200
    elif action == "delete":
        assert http.delete(f"/admin/tenants/{tenant}", headers=ADMIN).status_code == 204
    else:
        (listed,) = http.get(f"/admin/tenants/{tenant}/keys", headers=ADMIN).json()["data"]
        revoked = http.delete(f"/admin/tenants/{tenant}/keys/{listed['key_id']}", headers=ADMIN)
        assert revoked.status_code == 200
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - started < 1.5  # not the 2 s of the whole answer
    assert out[0] == 200 and out[-1] == "[DONE]"
    error = json.loads(out[-2])["error"]
    assert error["code"] == code
    assert worker.aborted  # its worker request was aborted
    other.join(5)
    chunks = [json.loads(e) for e in other_out[1:-1]]
    words = [c["choices"][0]["delta"].get("content") for c in chunks if c.get("choices")]
    assert sum(1 for w in words if w) == 8  # the other tenant's answer is whole
    if action != "delete":  # what was generated before the end is charged, once
        deadline = time.monotonic() + 3
        while (usage := usage_of(http, tenant))["requests"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert usage["requests"] == 1 and 0 < usage["completion_tokens"] < 8


def test_a_non_streamed_request_under_way_gets_the_error_a_new_request_would(
    http: httpx.Client, worker: FakeWorker
) -> None:
    tenant, key = new_tenant(http)
    out: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: out.append(
            http.post("/v1/chat/completions", json=chat(max_tokens=8), headers=auth(key))
        ),
        daemon=True,
    )
    thread.start()
    deadline = time.monotonic() + 5
    while not worker.received and time.monotonic() < deadline:
        time.sleep(0.01)
    assert http.post(f"/admin/tenants/{tenant}/disable", headers=ADMIN).status_code == 200
    thread.join(5)
    assert_openai_error(out[0], 403, "tenant_disabled")
    fresh = http.post("/v1/chat/completions", json=chat(max_tokens=8), headers=auth(key))
    assert_openai_error(fresh, 403, "tenant_disabled")
    assert worker.aborted  # the worker stopped generating for it
    assert http.get("/metrics").text.count("radixgate_in_flight_requests 0.0") == 1


def test_with_end_revoked_requests_off_a_stream_runs_to_its_end(
    redis_url: str, stub_model_dir: Path, worker: FakeWorker
) -> None:
    app = create_app(_settings(redis_url, stub_model_dir, worker, "revoke-off:", end_revoked_requests=False))
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        tenant, key = new_tenant(client)
        thread, out = _start_stream(client, key)
        assert client.post(f"/admin/tenants/{tenant}/disable", headers=ADMIN).status_code == 200
        thread.join(5)
        assert out[-1] == "[DONE]" and not any('"error"' in e for e in out[1:])
        assert_openai_error(client.post("/v1/chat/completions", json=chat(), headers=auth(key)), 403)


async def test_a_revocation_between_two_awaits_is_kept_for_the_next_one() -> None:
    """A stream's task is not tracked while it hands an event to the client (``entry.task`` None); a
    revocation then must not be lost: the entry keeps its error and the next await ends with it."""
    checks = Checks()
    checks.errors = {"t1": PermissionDenied("disabled", code="tenant_disabled")}
    registry = RevocationRegistry(checks.check, checks.check)
    entry = registry.track("a", "t1", "k1")
    entry.task = None  # between two chunks: the event is being sent
    assert registry.end("tenant", "t1", PermissionDenied("disabled", code="tenant_disabled")) == 1
    assert entry.error is not None and entry.error.code == "tenant_disabled"
    assert entry.take_error() is entry.error  # no cancellation to take back: the error alone
    registry.untrack(entry)


async def test_a_request_already_being_cancelled_is_left_to_finish_its_clean_up() -> None:
    """A request whose client left runs its clean-up (abort at the worker, reading what it computed)
    under the client's cancellation; a revocation then must not cancel it a second time and cut that
    clean-up short."""
    checks = Checks()
    registry = RevocationRegistry(checks.check, checks.check)
    cleaned = asyncio.Event()
    release = asyncio.Event()

    async def request() -> None:
        registry.track("a", "t1", "k1")
        try:
            await asyncio.Event().wait()  # the worker call
        except asyncio.CancelledError:  # the client left: abort at the worker (takes a moment)
            await release.wait()
            cleaned.set()
            raise

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    task.cancel()  # the client's disconnect
    await asyncio.sleep(0)
    assert registry.end("tenant", "t1", PermissionDenied("disabled", code="tenant_disabled")) == 0
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned.is_set()


def test_a_client_that_leaves_on_the_error_event_of_a_revoked_stream_is_still_charged(
    http: httpx.Client, worker: FakeWorker
) -> None:
    # nu21: a stream ended by a revocation aborts its worker request and settles while its body ends, with
    # the disconnect watcher still running; a client that closed the connection on the error event
    # cancelled that part-way (anyio's shield does not stop a task's cancel): nothing was charged, no
    # request line was logged and the reservation stayed held (seen on the CPU worker: usage +0)
    tenant, key = new_tenant(http)
    body = chat(stream=True, max_tokens=8)
    with http.stream("POST", "/v1/chat/completions", json=body, headers=auth(key)) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        (listed,) = http.get(f"/admin/tenants/{tenant}/keys", headers=ADMIN).json()["data"]
        revoked = http.delete(f"/admin/tenants/{tenant}/keys/{listed['key_id']}", headers=ADMIN)
        assert revoked.status_code == 200
        assert "invalid_api_key" in next(line for line in lines if "error" in line)
        resp.close()  # leaves at once
    deadline = time.monotonic() + 3
    while (usage := usage_of(http, tenant))["requests"] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert usage["requests"] == 1 and 0 < usage["completion_tokens"] < 8
