"""Quota limiter against a real Redis: races between processes, reconciliation and refunds."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import redis.asyncio as aioredis

from service.config.redis import RedisSettings
from service.state import connect_redis
from tenancy.models import Quotas
from tenancy.quota import QuotaLimiter, Reservation
from tenancy.usage import UsageRecorder
from tests.tenancy.conftest import RedisTarget

BURST = 37
QUOTAS = Quotas(requests_per_min=0.001, request_burst=BURST)  # refills ~nothing during the test


def _hammer(target: RedisTarget, start: mp.synchronize.Event, attempts: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    async def run() -> int:
        # the gateway's own client: one Redis's blocking pool, or the bounded Redis Cluster client
        client = connect_redis(RedisSettings(url=target.url, cluster=target.kind == "cluster"))
        limiter = QuotaLimiter(client, "race:")
        granted = 0
        start.wait()
        for _ in range(attempts):
            if (await limiter.reserve("shared", QUOTAS, 1)).allowed:
                granted += 1
        await client.aclose()
        return granted

    out.put(asyncio.run(run()))


def test_eight_processes_race_one_bucket_and_get_exactly_the_burst(
    redis_target: RedisTarget, redis_client: aioredis.Redis
) -> None:
    """On one Redis and on a Redis Cluster (the tenant's keys in one slot, on one of three nodes)."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(redis_target, start, 20, out)) for _ in range(8)]
    for p in procs:
        p.start()
    start.set()
    granted = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sum(granted) == BURST  # 160 attempts, exactly the burst admitted
    assert sum(1 for g in granted if g > 0) > 1  # the race really was a race


async def test_reconcile_refunds_unused_and_charges_overrun(redis_client: aioredis.Redis) -> None:
    limiter = QuotaLimiter(redis_client, "r:")
    quotas = Quotas(tokens_per_min=0.001, token_burst=1000)
    assert (await limiter.reserve("t", quotas, 600)).allowed  # 400 left
    reservation = Reservation("t", quotas, 1, 600)
    await limiter.reconcile(reservation, used_tokens=250)  # refund 350 -> 750
    decision = await limiter.reserve("t", quotas, 750)
    assert decision.allowed and decision.remaining["tokens"] == pytest.approx(0, abs=0.01)
    await limiter.reconcile(Reservation("t", quotas, 1, 750), used_tokens=800)  # overrun of 50
    levels = await limiter.adjust("t", quotas, tokens=0.0001)
    assert levels["tokens"] == pytest.approx(-50, abs=0.01)


async def test_refund_gives_back_request_and_tokens(redis_client: aioredis.Redis) -> None:
    limiter = QuotaLimiter(redis_client, "f:")
    quotas = Quotas(requests_per_min=0.001, request_burst=1, tokens_per_min=0.001, token_burst=100)
    assert (await limiter.reserve("t", quotas, 100)).allowed
    assert not (await limiter.reserve("t", quotas, 1)).allowed
    await limiter.refund(Reservation("t", quotas, 1, 100))
    assert (await limiter.reserve("t", quotas, 100)).allowed


async def test_buckets_expire_once_full_again(redis_client: aioredis.Redis) -> None:
    limiter = QuotaLimiter(redis_client, "e:")
    quotas = Quotas(requests_per_min=600, request_burst=10)
    await limiter.reserve("t", quotas, 0)
    ttl_ms = await redis_client.pttl(limiter.bucket_key("t", "requests"))
    assert 0 < ttl_ms <= 2 * 10 * 60_000 / 600 + 1000


async def test_settle_is_reconcile_or_refund_and_usage_in_one_call(redis_client: aioredis.Redis) -> None:
    limiter, usage = QuotaLimiter(redis_client, "s:"), UsageRecorder(redis_client, "s:")
    quotas = Quotas(requests_per_min=0.001, request_burst=5, tokens_per_min=0.001, token_burst=1000)
    assert (await limiter.reserve("t", quotas, 600)).allowed  # requests 4, tokens 400
    served = {"requests": 1, "errors": 0, "prompt_tokens": 200, "completion_tokens": 50}
    assert await limiter.settle(Reservation("t", quotas, 1, 600), 250, served)  # refund 350 -> 750
    assert (await limiter.reserve("t", quotas, 100)).allowed  # requests 3, tokens 650
    assert await limiter.settle(Reservation("t", quotas, 1, 100), None, {"errors": 1})  # all back
    assert (await limiter.reserve("t", quotas, 700)).allowed  # requests 3, tokens 50
    assert await limiter.settle(Reservation("t", quotas, 1, 700), 760, {"requests": 1})  # overrun 60
    levels = await limiter.adjust("t", quotas, requests=0.0001, tokens=0.0001)
    assert levels["requests"] == pytest.approx(3, abs=0.01)
    assert levels["tokens"] == pytest.approx(-10, abs=0.01)
    counted = await usage.get("t")
    assert (counted.requests, counted.errors, counted.prompt_tokens, counted.completion_tokens) == (
        2,
        1,
        200,
        50,
    )
    assert await limiter.settle(Reservation("t", quotas, 1, 5), 5, {"errors": 0})  # nothing to write
    with pytest.raises(ValueError, match="unknown usage fields"):
        await limiter.settle(Reservation("t", quotas, 1, 5), 5, {"bogus": 1})


OLD = Quotas(requests_per_min=6000)  # 100 requests/s, burst 6000
NEW = Quotas(requests_per_min=3)  # burst 3, one request every 20 s


async def test_settle_after_lowered_quota_does_not_refill_at_the_old_rate(
    redis_client: aioredis.Redis,
) -> None:
    """A settle carries the quotas its request was reserved under; the bucket's own (written by its
    latest take) win, so a quota lowered meanwhile is not refilled at the old rate nor to the old burst."""
    limiter = QuotaLimiter(redis_client, "low:")
    t0 = 1_000_000.0
    assert (await limiter.reserve("t", OLD, 10, now_ms=t0)).allowed  # in flight when the quota drops
    in_flight = Reservation("t", OLD, 1, 10)
    admitted = sum([(await limiter.reserve("t", NEW, 10, now_ms=t0 + 1)).allowed for _ in range(5)])
    assert admitted == 3  # the new burst
    # 5 s later the in-flight request fails upstream: its one request goes back
    await limiter.settle(in_flight, None, {}, now_ms=t0 + 5000)
    # under the new quota the bucket holds about 1 + 5 s x 0.05/s: one request passes, not three
    admitted = sum([(await limiter.reserve("t", NEW, 10, now_ms=t0 + 5001)).allowed for _ in range(5)])
    assert admitted == 1
