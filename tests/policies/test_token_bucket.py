"""Token-bucket arithmetic: one table, checked against the pure policy and the Redis Lua script."""

from __future__ import annotations

import math

import pytest
import redis.asyncio as aioredis

from policies.token_bucket import (
    MAX_WAIT_MS,
    BucketLimit,
    BucketState,
    adjust,
    full_bucket,
    refill,
    try_take,
    wait_ms_for,
)
from tenancy.layout import KeyLayout
from tenancy.models import Quotas
from tenancy.quota import QuotaLimiter, Reservation

# rate 60 tokens/min = 1 token/s, capacity 10.
LIMIT = BucketLimit(rate_per_min=60, capacity=10)

# (now_ms, op, amount, expected_allowed, expected_wait_ms, expected_level_after)
# op "take" debits if allowed; "adjust" adds (refund > 0, charge < 0).
TABLE: list[tuple[float, str, float, bool | None, float, float]] = [
    (0, "take", 4, True, 0, 6),  # new bucket starts full (10)
    (0, "take", 6, True, 0, 0),  # exactly empties it
    (0, "take", 1, False, 1000, 0),  # 1 token short at 1 token/s -> 1000 ms
    (500, "take", 1, False, 500, 0.5),  # half refilled
    (1000, "take", 1, True, 0, 0),  # refilled exactly one
    (3500, "take", 5, False, 2500, 2.5),  # 2.5 there, 2.5 short
    (3500, "adjust", 3, None, 0, 5.5),  # refund of an unused reservation
    (3500, "adjust", -20, None, 0, -10),  # overrun charge floors at -capacity
    (4000, "take", 1, False, 10500, -9.5),  # debt must be repaid first
    (60_000, "take", 10, True, 0, 0),  # long idle: capped at capacity, then emptied
    (60_000, "take", 11, False, math.inf, 0),  # above capacity: never
    (59_000, "take", 1, False, 1000, 0),  # clock going back refills nothing
    (200_000, "adjust", 5, None, 0, 10),  # refund capped at capacity
]


def run_pure() -> list[tuple[bool | None, float, float]]:
    state: BucketState | None = None
    out: list[tuple[bool | None, float, float]] = []
    for now, op, amount, *_ in TABLE:
        state = state or full_bucket(LIMIT, now)
        if op == "take":
            result = try_take(state, LIMIT, amount, now)
            state = result.state
            out.append((result.allowed, result.wait_ms, state.level))
        else:
            state = adjust(state, LIMIT, amount, now)
            out.append((None, 0.0, state.level))
    return out


def test_pure_token_bucket_follows_table() -> None:
    for row, got in zip(TABLE, run_pure(), strict=True):
        _, _, _, allowed, wait, level = row
        assert got[0] == allowed, row
        assert got[1] == wait, row
        assert got[2] == pytest.approx(level), row


async def test_lua_token_bucket_follows_same_table(redis_client: aioredis.Redis) -> None:
    limiter = QuotaLimiter(redis_client, "t:")
    quotas = Quotas(tokens_per_min=LIMIT.rate_per_min, token_burst=LIMIT.capacity)
    for row in TABLE:
        now, op, amount, allowed, wait, level = row
        if op == "take":
            # the request bucket is unlimited here: only the token bucket is exercised
            decision = await limiter.reserve("acme", quotas, int(amount), now_ms=now)
            assert decision.allowed == allowed, row
            assert decision.never == math.isinf(wait), row
            if not decision.never:
                assert decision.retry_after_s * 1000 == wait, row
                assert decision.remaining["tokens"] == pytest.approx(level), row
        else:
            levels = await limiter.adjust("acme", quotas, tokens=amount, now_ms=now)
            assert levels["tokens"] == pytest.approx(level), row


def test_refill_caps_and_ignores_backwards_time() -> None:
    state = BucketState(level=2, updated_ms=1000)
    assert refill(state, LIMIT, 500) == state
    assert refill(state, LIMIT, 1_000_000).level == LIMIT.capacity


async def test_request_and_token_buckets_are_all_or_nothing(redis_client: aioredis.Redis) -> None:
    """A request refused by the token bucket must not consume a request slot, and vice versa."""
    limiter = QuotaLimiter(redis_client, "t:")
    quotas = Quotas(requests_per_min=60, request_burst=5, tokens_per_min=60, token_burst=100)
    assert (await limiter.reserve("a", quotas, 90, now_ms=0)).allowed
    refused = await limiter.reserve("a", quotas, 50, now_ms=0)
    assert not refused.allowed and refused.limiting == "tokens"
    assert refused.remaining["requests"] == pytest.approx(4)  # only the first request was taken
    for _ in range(4):
        assert (await limiter.reserve("a", quotas, 1, now_ms=0)).allowed
    refused = await limiter.reserve("a", quotas, 1, now_ms=0)
    assert not refused.allowed and refused.limiting == "requests"
    assert refused.retry_after_s == pytest.approx(1.0)
    assert refused.remaining["tokens"] == pytest.approx(6)


async def test_lua_settle_adjusts_as_the_same_table(redis_client: aioredis.Redis) -> None:
    """The one-call settle (settle.lua) adds to a bucket with the arithmetic of the table's adjust rows."""
    limiter = QuotaLimiter(redis_client, "ts:")
    quotas = Quotas(tokens_per_min=LIMIT.rate_per_min, token_burst=LIMIT.capacity)
    key = limiter.bucket_key("acme", "tokens")
    for row in TABLE:
        now, op, amount, _, _, level = row
        if op == "take":
            await limiter.reserve("acme", quotas, int(amount), now_ms=now)
        else:  # reserved max(amount, 0), used max(-amount, 0): the bucket gets amount back
            held = Reservation("acme", quotas, 1, int(max(amount, 0)))
            assert await limiter.settle(held, int(max(-amount, 0)), {}, now_ms=now)
            assert float(await redis_client.hget(key, "level")) == pytest.approx(level), row


@pytest.mark.parametrize("rate", [1e-300, 1e-9])
async def test_a_rate_too_slow_to_refill_in_time_refuses_with_a_bounded_wait(
    redis_client: aioredis.Redis, rate: float
) -> None:
    """A quota of 1e-300 tokens/min (the admin API took any rate > 0; it now refuses rates below
    ``MIN_RATE``, but a record written before may hold one) made the Lua PEXPIRE and wait overflow Redis's
    integers: an admitted request got a 500 (ResponseError), a refused one Retry-After 1."""
    limiter = QuotaLimiter(redis_client, "t:")
    quotas = Quotas.model_construct(requests_per_min=rate, tokens_per_min=rate, token_burst=100)
    assert (await limiter.reserve("slow", quotas, 60, now_ms=0)).allowed
    refused = await limiter.reserve("slow", quotas, 60, now_ms=1000)
    assert not refused.allowed and not refused.never
    slowest = max(
        wait_ms_for(0, 1, BucketLimit(rate_per_min=rate, capacity=1)),
        wait_ms_for(40, 60, BucketLimit(rate_per_min=rate, capacity=100)),
    )
    assert slowest <= MAX_WAIT_MS and refused.retry_after_s == pytest.approx(slowest / 1000, rel=1e-6)
    assert (await limiter.adjust("slow", quotas, tokens=10, now_ms=2000))["tokens"] == pytest.approx(50)
    assert 0 < await redis_client.pttl(KeyLayout("t:").bucket("slow", "tokens")) <= MAX_WAIT_MS + 1000
    assert wait_ms_for(0, 60, BucketLimit(rate_per_min=1e-300, capacity=100)) == MAX_WAIT_MS


async def test_a_settle_after_a_quota_raise_keeps_the_raised_level_and_the_key_life(
    redis_client: aioredis.Redis,
) -> None:
    """nu14: a request in flight when an admin raised a tenant's burst settled the bucket back to the old
    burst (settle.lua and the give-back path capped the refilled level at the reservation's capacity),
    so the raise gave 429s for a while. Both paths now refill and cap with the terms of the bucket's
    latest take (nu15), and keep the key's life (a key that expired early would read as a full bucket)."""
    limiter = QuotaLimiter(redis_client, "raise:")
    old = Quotas(tokens_per_min=60, token_burst=10)
    new = Quotas(tokens_per_min=600, token_burst=1000)
    key = limiter.bucket_key("acme", "tokens")
    held = await limiter.reserve("acme", old, 8, now_ms=0)
    assert held.allowed
    assert (await limiter.reserve("acme", new, 100, now_ms=100_000)).allowed  # 2 + 1000 s refill
    level = float(await redis_client.hget(key, "level"))
    ttl = await redis_client.pttl(key)
    assert level == pytest.approx(900)  # capped at the new burst, less 100
    reservation = Reservation("acme", old, 0, 8)
    assert await limiter.settle(reservation, 2, {}, now_ms=100_000)  # 6 unused tokens back
    assert float(await redis_client.hget(key, "level")) == pytest.approx(906)
    assert await redis_client.pttl(key) >= ttl - 1000
    await limiter.adjust("acme", old, tokens=5, now_ms=100_000)  # a lease's give-back
    assert float(await redis_client.hget(key, "level")) == pytest.approx(911)
    await limiter.adjust("acme", old, tokens=-4, now_ms=100_000)  # an overrun charge
    assert float(await redis_client.hget(key, "level")) == pytest.approx(907)


async def test_a_refund_to_a_missing_bucket_leaves_it_missing(redis_client: aioredis.Redis) -> None:
    """A missing bucket reads as full at the tenant's current capacity; writing the reservation's (maybe
    older, smaller) capacity there would cut it."""
    limiter = QuotaLimiter(redis_client, "gone:")
    quotas = Quotas(tokens_per_min=60, token_burst=10)
    assert await limiter.settle(Reservation("acme", quotas, 0, 5), 1, {}, now_ms=0)
    await limiter.adjust("acme", quotas, tokens=3, now_ms=0)
    assert not await redis_client.exists(limiter.bucket_key("acme", "tokens"))
