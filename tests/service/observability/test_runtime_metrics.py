"""The process's own health series (service/observability/runtime_metrics.py, issue 28): event-loop lag seen
when the loop is blocked, and each quota-store call's latency per operation against a real redis-server
(an authentication answered from the auth cache makes no Redis call and is not counted)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from service.observability.runtime_metrics import RuntimeMetrics, watch_loop_lag
from tenancy.auth_cache import AuthCache
from tenancy.errors import StoreUnavailable
from tenancy.models import Quotas, TenantCreate
from tenancy.quota import QuotaLimiter, Reservation
from tenancy.store import TenantStore
from tenancy.usage import UsageRecorder


def count(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(f"{name}_count", labels) or 0.0


def bucket(registry: CollectorRegistry, name: str, le: str) -> float:
    return registry.get_sample_value(f"{name}_bucket", {"le": le}) or 0.0


async def test_loop_lag_is_observed_when_the_loop_is_blocked() -> None:
    registry = CollectorRegistry()
    metrics = RuntimeMetrics(registry)
    lag = "radixgate_event_loop_lag_seconds"
    task = asyncio.create_task(watch_loop_lag(metrics.loop_lag, 0.02))
    try:
        for _ in range(500):  # an idle loop: every sleep on time, within a few ms
            if count(registry, lag) >= 5:
                break
            await asyncio.sleep(0.02)
        idle = count(registry, lag)
        assert bucket(registry, lag, "0.25") == idle
        time.sleep(0.3)  # noqa: ASYNC251 (the point) the loop blocked: the sleep that spans it wakes >= 0.28 s late
        before = count(registry, lag)
        for _ in range(500):
            if count(registry, lag) > before:
                break
            await asyncio.sleep(0.005)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    late = count(registry, lag) - bucket(registry, lag, "0.25")
    assert late == 1, "exactly the blocked sleep lands above 0.25 s"
    assert registry.get_sample_value(f"{lag}_sum") >= 0.25  # type: ignore[operator]


def test_the_loops_tasks_are_counted_and_go_down_when_they_end() -> None:
    """On a fresh event loop (the suite's session loop runs other tests' tasks, which come and go)."""
    asyncio.run(_count_tasks())


async def _count_tasks() -> None:
    registry = CollectorRegistry()
    metrics = RuntimeMetrics(registry)

    def tasks() -> float:
        return registry.get_sample_value("radixgate_event_loop_tasks") or 0.0

    async def wait_until(condition: object) -> None:
        for _ in range(500):
            if condition():  # type: ignore[operator]
                return
            await asyncio.sleep(0.01)
        raise AssertionError("not seen in 5 s")

    watcher = asyncio.create_task(watch_loop_lag(metrics.loop_lag, 0.01, tasks=metrics.tasks))
    try:
        await wait_until(lambda: tasks() >= 1)
        base = tasks()
        release = asyncio.Event()
        held = [asyncio.create_task(release.wait()) for _ in range(50)]
        await wait_until(lambda: tasks() == base + 50)
        release.set()
        await asyncio.gather(*held)
        await wait_until(lambda: tasks() == base)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def test_store_calls_are_timed_per_operation(redis_client: aioredis.Redis) -> None:
    registry = CollectorRegistry()
    metrics = RuntimeMetrics(registry)
    observe = metrics.observe_store_call
    store = TenantStore(redis_client, "sc1:", b"pepper", AuthCache(60.0, 100))
    quota, usage = QuotaLimiter(redis_client, "sc1:"), UsageRecorder(redis_client, "sc1:")
    store.observe_call = quota.observe_call = usage.observe_call = observe
    name = "radixgate_store_call_seconds"

    await store.create(TenantCreate(priority_class="standard", id="acme", name="a"))
    issued = await store.issue_key("acme")
    assert count(registry, name, op="TenantStore.create") == 1
    assert await store.authenticate(issued.api_key) is not None  # a miss: Redis read
    assert await store.authenticate(issued.api_key) is not None  # a hit: no Redis call
    assert await store.authenticate("not-a-key") is None  # refused before any read
    assert count(registry, name, op="TenantStore.authenticate") == 1

    limits = Quotas(requests_per_min=100, tokens_per_min=10_000)
    for _ in range(3):
        assert (await quota.reserve("acme", limits, 10)).allowed
    reservation = Reservation("acme", limits, 1, 10)
    await quota.settle(reservation, 8, {"prompt_tokens": 5, "completion_tokens": 3})
    await usage.record("acme", requests=1)
    assert count(registry, name, op="QuotaLimiter.reserve") == 3
    assert count(registry, name, op="QuotaLimiter.settle") == 1
    assert count(registry, name, op="UsageRecorder.record") == 1
    reserve_sum = registry.get_sample_value(f"{name}_sum", {"op": "QuotaLimiter.reserve"})
    assert reserve_sum is not None and 0 < reserve_sum < 1.0

    # a failed call is timed too, and still raises StoreUnavailable
    broken = QuotaLimiter(aioredis.Redis(port=1, retry=Retry(NoBackoff(), 0)), "sc1:")
    broken.observe_call = observe
    with pytest.raises(StoreUnavailable):
        await broken.reserve("acme", limits, 10)
    assert count(registry, name, op="QuotaLimiter.reserve") == 4

    # a tenant with no limits: answered with no Redis call, not counted
    assert (await quota.reserve("acme", Quotas(), 10)).allowed
    assert count(registry, name, op="QuotaLimiter.reserve") == 4
    await quota.refund(reservation)
    assert count(registry, name, op="QuotaLimiter.adjust") == 1

    # a store with no hook set is not timed
    plain = QuotaLimiter(redis_client, "sc1:")
    await plain.reserve("acme", limits, 10)
    assert count(registry, name, op="QuotaLimiter.reserve") == 4
