"""A served request is always charged: settles that fail on the response path (Redis pool exhausted or
slow) are retried in the background, land once, and are drained at shutdown; what cannot land is counted.

Real Redis throughout: the pool is exhausted by holding its only connection, or by a burst of requests
through a gateway whose pool has one connection.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio as aioredis
import structlog
import structlog.testing
from prometheus_client import CollectorRegistry
from redis.asyncio import BlockingConnectionPool

from service.app import create_app
from service.config.settings import RedisSettings
from service.observability.metrics import GatewayMetrics
from service.pipeline.settlement import Settlement, Settler
from tenancy.layout import KeyLayout
from tenancy.models import Quotas
from tenancy.quota import QuotaLimiter, Reservation
from tenancy.quota_lease import LeasedQuota
from tenancy.usage import UsageRecorder
from tests.conftest import gateway_settings
from tests.service.api.test_api import auth, chat, new_tenant
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

QUOTAS = Quotas(tokens_per_min=0.001, token_burst=1000)  # refills ~nothing during a test
SERVED = {"requests": 1, "prompt_tokens": 7, "completion_tokens": 3}


@pytest.fixture
async def one_connection(redis_client: aioredis.Redis, redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client on a flushed database whose pool has one connection, waited on for at most 50 ms."""
    pool = BlockingConnectionPool.from_url(redis_url, max_connections=1, timeout=0.05, decode_responses=True)
    client = aioredis.Redis.from_pool(pool)
    yield client
    await client.aclose()


def settler_on(client: aioredis.Redis, **settings: float) -> tuple[Settler, QuotaLimiter, GatewayMetrics]:
    quota = QuotaLimiter(client, "s:")
    metrics = GatewayMetrics(CollectorRegistry(), 10)
    cfg = RedisSettings.model_validate({"settle_backoff_s": 0.02, "settle_backoff_max_s": 0.05, **settings})
    return Settler(quota, cfg, metrics), quota, metrics


def value(metrics: GatewayMetrics, name: str) -> float:
    sample = metrics.registry.get_sample_value(name)
    assert sample is not None, name
    return sample


async def test_a_settle_with_the_same_request_id_lands_once(redis_client: aioredis.Redis) -> None:
    quota = QuotaLimiter(redis_client, "once:")
    usage = UsageRecorder(redis_client, "once:")
    assert (await quota.reserve("t", QUOTAS, 600)).allowed  # 400 left
    held = Reservation("t", QUOTAS, 1, 600)
    for _ in range(3):  # a retry after a try that did land changes nothing
        assert await quota.settle(held, 10, SERVED, once=("rid-1", 60))
    got = await usage.get("t")
    assert (got.requests, got.prompt_tokens, got.completion_tokens) == (1, 7, 3)
    levels = await quota.adjust("t", QUOTAS, tokens=0.0001)
    assert levels["tokens"] == pytest.approx(990, abs=0.01)  # 600 - 10 refunded once
    assert 0 < await redis_client.ttl(KeyLayout("once:").settled("t", "rid-1")) <= 60
    assert await quota.settle(held, 10, SERVED, once=("rid-2", 60))  # another request: charged
    assert (await usage.get("t")).requests == 2


async def test_a_settle_that_finds_the_pool_exhausted_lands_in_the_background(
    one_connection: aioredis.Redis,
) -> None:
    settler, _, metrics = settler_on(one_connection)
    conn = await one_connection.connection_pool.get_connection()  # the pool's only connection
    item = Settlement("r1", Reservation("t", QUOTAS, 1, 20), 10, SERVED)
    assert await settler.settle(item) == "deferred"  # the answer is not held back
    assert settler.pending == 1 and value(metrics, "radixgate_settle_deferred_total") == 1
    await asyncio.sleep(0.2)  # retries keep finding the pool exhausted
    await one_connection.connection_pool.release(conn)
    for _ in range(100):
        if not settler.pending:
            break
        await asyncio.sleep(0.02)
    assert settler.pending == 0
    got = await UsageRecorder(one_connection, "s:").get("t")
    assert (got.requests, got.prompt_tokens, got.completion_tokens) == (1, 7, 3)
    assert value(metrics, "radixgate_settle_failures_total") == 0
    assert value(metrics, "radixgate_settle_pending") == 0
    await settler.drain()


async def test_retries_spent_are_counted_lost_and_nothing_lands(one_connection: aioredis.Redis) -> None:
    settler, _, metrics = settler_on(one_connection, settle_retries=2)
    conn = await one_connection.connection_pool.get_connection()
    item = Settlement("r2", Reservation("t", QUOTAS, 1, 20), 10, SERVED)
    assert await settler.settle(item) == "deferred"
    for _ in range(100):
        if not settler.pending:
            break
        await asyncio.sleep(0.02)
    assert settler.pending == 0 and value(metrics, "radixgate_settle_failures_total") == 1
    await one_connection.connection_pool.release(conn)
    assert (await UsageRecorder(one_connection, "s:").get("t")).requests == 0


async def test_retries_go_on_for_the_give_up_time_not_a_count(one_connection: aioredis.Redis) -> None:
    """Against an unavailable Redis each try fails at once: a count of retries with jittered backoffs of
    20-50 ms is spent in a fraction of a second, while the give-up time holds the settle for as long as
    it says (0.6 s here), then counts it lost; within it, Redis back, the settle lands."""
    settler, _, metrics = settler_on(one_connection, settle_give_up_s=0.6)
    conn = await one_connection.connection_pool.get_connection()
    started = asyncio.get_running_loop().time()
    item = Settlement("r-give-up", Reservation("t", QUOTAS, 1, 20), 10, SERVED)
    assert await settler.settle(item) == "deferred"
    await asyncio.sleep(0.3)  # more than 8 retries' worth of backoff: still retrying
    assert settler.pending == 1 and value(metrics, "radixgate_settle_failures_total") == 0
    for _ in range(200):
        if not settler.pending:
            break
        await asyncio.sleep(0.01)
    took = asyncio.get_running_loop().time() - started
    assert settler.pending == 0 and value(metrics, "radixgate_settle_failures_total") == 1
    assert 0.6 <= took < 2.0
    await one_connection.connection_pool.release(conn)
    landing, _, _ = settler_on(one_connection, settle_give_up_s=5)
    held = await one_connection.connection_pool.get_connection()
    assert (
        await landing.settle(Settlement("r-lands", Reservation("t", QUOTAS, 1, 20), 10, SERVED)) == "deferred"
    )
    await asyncio.sleep(0.5)
    await one_connection.connection_pool.release(held)  # Redis "back" within the give-up time
    for _ in range(200):
        if not landing.pending:
            break
        await asyncio.sleep(0.01)
    assert (await UsageRecorder(one_connection, "s:").get("t")).requests == 1
    await landing.drain()
    await settler.drain()


async def test_drain_lands_pending_settles_without_backoff_and_counts_the_rest(
    one_connection: aioredis.Redis,
) -> None:
    # a long backoff: without the drain cutting it short, the retry would come after the test
    settler, _, metrics = settler_on(one_connection, settle_backoff_s=30, settle_backoff_max_s=30)
    conn = await one_connection.connection_pool.get_connection()
    landing = Settlement("r3", Reservation("t", QUOTAS, 1, 20), 10, SERVED)
    assert await settler.settle(landing) == "deferred"
    await one_connection.connection_pool.release(conn)
    await asyncio.wait_for(settler.drain(), 5)
    assert (await UsageRecorder(one_connection, "s:").get("t")).requests == 1
    assert value(metrics, "radixgate_settle_failures_total") == 0
    # once draining, a settle that cannot land now is counted lost at once
    conn = await one_connection.connection_pool.get_connection()
    late = Settlement("r4", Reservation("t", QUOTAS, 1, 20), 10, SERVED)
    assert await settler.settle(late) == "lost"
    assert value(metrics, "radixgate_settle_failures_total") == 1
    await one_connection.connection_pool.release(conn)


async def test_a_started_settle_is_waited_for_by_usage_reads_and_by_the_drain(
    redis_client: aioredis.Redis,
) -> None:
    """A served answer's settle runs in a task of its own (Settler.start): a usage read of its tenant
    (Settler.settled) and the drain at shutdown both wait for it; another tenant's read does not."""
    settler, _, _ = settler_on(redis_client)
    usage = UsageRecorder(redis_client, "s:")

    async def settle_late(rid: str) -> None:  # as a settle slowed by a busy Redis
        await asyncio.sleep(0.3)
        assert await settler.settle(Settlement(rid, Reservation("t", QUOTAS, 1, 20), 10, SERVED)) == "settled"

    settler.start("t", settle_late("r6"))
    await asyncio.wait_for(settler.settled("other"), 0.05)  # nothing started for it: no wait
    await asyncio.wait_for(settler.settled("t"), 5)
    assert (await usage.get("t")).requests == 1  # read after the wait: the settle is counted
    settler.start("t", settle_late("r7"))
    await asyncio.wait_for(settler.drain(), 5)  # the drain waits for it too
    assert (await usage.get("t")).requests == 2


async def test_leased_settles_of_a_tenant_are_summed_into_one_call(redis_client: aioredis.Redis) -> None:
    """Settler.submit sums a tenant's settles of one linger into one script call that gives back and
    records exactly what the requests' own calls would have; a usage read sends the sum at once (no
    linger waited), and the drain sends what is still collecting."""
    settler, quota, _ = settler_on(redis_client, settle_linger_s=1.0)  # a read or the drain sends sooner
    usage = UsageRecorder(redis_client, "s:")
    assert (await quota.reserve("t", QUOTAS, 400)).allowed  # 600 of 1000 left
    assert (await quota.reserve("u", QUOTAS, 100)).allowed
    await quota.settle(Reservation("w", QUOTAS, 1, 20), None, {})  # settle.lua loaded: no NOSCRIPT below
    calls = int((await redis_client.info("commandstats"))["cmdstat_evalsha"]["calls"])
    for i in range(10):  # 10 served answers, 20 tokens reserved each, 12 used: 8 back each
        settler.submit(Settlement(f"a{i}", Reservation("t", QUOTAS, 1, 20, linger=True), 12, SERVED))
    settler.submit(
        Settlement("f", Reservation("t", QUOTAS, 1, 50, linger=True), None, {"errors": 1})
    )  # refunded
    settler.submit(Settlement("o", Reservation("t", QUOTAS, 1, 20, linger=True), 35, SERVED))  # 15 over
    await asyncio.sleep(0.05)
    assert (await usage.get("t")).requests == 0  # still collecting
    await asyncio.wait_for(settler.settled("t"), 1)
    after = int((await redis_client.info("commandstats"))["cmdstat_evalsha"]["calls"])
    assert after - calls == 1  # one call for the 12 settles
    got = await usage.get("t")
    assert (got.requests, got.errors, got.prompt_tokens, got.completion_tokens) == (11, 1, 77, 33)
    level = (await quota.adjust("t", QUOTAS, tokens=0.0001))["tokens"]
    assert level == pytest.approx(600 + 10 * 8 + 50 - 15, abs=0.01)
    settler.submit(Settlement("u1", Reservation("u", QUOTAS, 1, 20, linger=True), 10, SERVED))
    await asyncio.sleep(0.1)
    assert (await usage.get("u")).requests == 0  # collecting for its linger (1 s)...
    await asyncio.wait_for(settler.drain(), 5)  # ...or until the drain
    assert (await usage.get("u")).requests == 1
    settler.submit(Settlement("late", Reservation("u", QUOTAS, 1, 20, linger=True), 10, SERVED))
    await asyncio.wait_for(settler.settled("u"), 1)  # draining: settled on its own at once
    assert (await usage.get("u")).requests == 2


async def test_drain_past_its_bound_counts_what_is_still_pending(one_connection: aioredis.Redis) -> None:
    settler, _, metrics = settler_on(one_connection, settle_drain_s=0.2, settle_retries=1000)
    conn = await one_connection.connection_pool.get_connection()  # held through the drain
    item = Settlement("r5", Reservation("t", QUOTAS, 1, 20), 10, SERVED)
    assert await settler.settle(item) == "deferred"
    await asyncio.wait_for(settler.drain(), 5)
    assert settler.pending == 0 and value(metrics, "radixgate_settle_failures_total") == 1
    await one_connection.connection_pool.release(conn)


async def test_settles_under_equal_quotas_read_apart_are_summed(redis_client: aioredis.Redis) -> None:
    """Settles are summed by the quotas' values, not by the quotas object: with the auth cache off
    (``auth_cache_ttl_s`` 0) each request reads its tenant anew, and each settle was its own call."""
    settler, _, _ = settler_on(redis_client, settle_linger_s=1.0)
    usage = UsageRecorder(redis_client, "s:")
    await settler.settle(Settlement("w", Reservation("w", QUOTAS, 1, 20), 10, SERVED))  # script loaded
    calls = int((await redis_client.info("commandstats"))["cmdstat_evalsha"]["calls"])
    for i in range(6):
        quotas = Quotas.model_validate(QUOTAS.model_dump())  # as read from Redis for each request
        settler.submit(Settlement(f"e{i}", Reservation("t", quotas, 1, 20, linger=True), 10, SERVED))
    other = Quotas(tokens_per_min=0.001, token_burst=999)  # other values: a sum of its own
    settler.submit(Settlement("x", Reservation("t", other, 1, 20, linger=True), 10, SERVED))
    await asyncio.wait_for(settler.settled("t"), 1)
    after = int((await redis_client.info("commandstats"))["cmdstat_evalsha"]["calls"])
    assert after - calls == 2
    assert (await usage.get("t")).requests == 7


async def test_a_reservation_to_redis_goes_after_the_sums_still_collecting(
    redis_client: aioredis.Redis,
) -> None:
    """A reservation of a tenant that its lease cannot cover goes to Redis after that tenant's settles
    still collecting on this replica, in the same write (script_batch's promise: "a reservation sent just
    after a settle of the same replica is never run before it"). Summed settles waited out their linger
    instead, and the reservation was refused for want of the refunds they carried (a 429 on the
    request after two served ones, whose unused tokens would have covered it)."""
    quotas = Quotas(tokens_per_min=6000, token_burst=100000)  # a lease of 5000 tokens; 100 a s refill
    limiter = QuotaLimiter(redis_client, "s:", settle_linger_s=0.3)
    settler = Settler(
        limiter,
        RedisSettings.model_validate({"settle_linger_s": 0.3}),
        GatewayMetrics(CollectorRegistry(), 10),
    )
    leased = LeasedQuota(limiter, 60.0, 0.05, 60.0, before_remote=settler.ahead_of_reservation)
    await limiter.settle(Reservation("w", quotas, 1, 20), None, {})  # settle.lua loaded: no NOSCRIPT below
    await limiter.adjust("t", quotas, tokens=-91000)  # 9000 left
    first = await leased.reserve("t", quotas, 4000)  # 4000 and a lease of 5000: nothing left in Redis
    assert first.allowed and first.leased
    assert (await leased.reserve("t", quotas, 4000)).allowed  # from the lease (1000 left in it)
    for i in range(2):  # both served with 100 tokens: 3900 each to give back
        settler.submit(Settlement(f"q{i}", Reservation("t", quotas, 1, 4000, linger=True), 100, SERVED))
    third = await leased.reserve("t", quotas, 4000)  # the lease cannot: Redis, after the refunds
    assert third.allowed, third
    await asyncio.wait_for(settler.settled("t"), 1)
    assert (await UsageRecorder(redis_client, "s:").get("t")).requests == 2
    await leased.close()


async def test_a_lost_sum_counts_every_request_it_covered(one_connection: aioredis.Redis) -> None:
    """radixgate_settle_failures_total counts requests: a tenant's summed settle that is lost counts each
    request it carried, not 1 (it counted 1 for the sum's 5)."""
    settler, _, metrics = settler_on(one_connection, settle_linger_s=1.0, settle_retries=0)
    for i in range(5):
        settler.submit(Settlement(f"l{i}", Reservation("t", QUOTAS, 1, 20, linger=True), 10, SERVED))
    conn = await one_connection.connection_pool.get_connection()  # Redis unavailable for the sum
    with structlog.testing.capture_logs() as logs:
        await asyncio.wait_for(settler.settled("t"), 5)
    assert value(metrics, "radixgate_settle_failures_total") == 5
    await one_connection.connection_pool.release(conn)
    (lost,) = [e for e in logs if e["event"] == "settle_lost"]
    # the net units it was giving back (5 x (20 reserved - 10 used)), not a reservation it never had
    assert lost["requests_covered"] == 5 and lost["usage_requests"] == 5
    assert lost["given_back_tokens"] == 50 and lost["given_back_requests"] == 0
    assert "reserved_tokens" not in lost


def test_burst_on_a_one_connection_pool_charges_every_served_request(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]
) -> None:
    fake[0].delay_s = 0.1  # answers of 1 to 4 words: 0.1 to 0.4 s
    settings = gateway_settings(redis_url, stub_model_dir, [fake[1]])
    settings.redis.max_connections = 1
    settings.redis.pool_timeout_s = 0.05
    settings.redis.socket_timeout_s = 0.3
    settings.redis.auth_cache_ttl_s = 60  # the key is checked in Redis once, before the burst
    prefix = settings.redis.key_prefix
    with ThreadedServer(create_app(settings)) as gw:
        with httpx.Client(base_url=gw.url, timeout=30) as admin:
            tenant_id, key = new_tenant(admin, quotas={"requests_per_min": 1e9, "tokens_per_min": 1e12})
            warm = admin.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key))
            assert warm.status_code == 200, warm.text

        async def burst() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(base_url=gw.url, timeout=60, limits=limits) as http:
                return await asyncio.gather(
                    *(
                        http.post("/v1/chat/completions", json=chat(max_tokens=1 + i % 4), headers=auth(key))
                        for i in range(60)
                    )
                )

        with redis.Redis.from_url(redis_url) as r:
            # Redis stalls for 0.6 s while the burst's answers come back (as a loaded Redis does): the
            # one connection's holder times out and everyone else finds the pool exhausted. The stall
            # starts once 10 of the burst's requests reached the worker (admitted: their answers and
            # settles are still to come), not after a fixed time: a slow start would stall admission.
            dispatched_before = len(fake[0].received)

            def pause_once_dispatched() -> None:
                deadline = time.monotonic() + 20
                while len(fake[0].received) < dispatched_before + 10 and time.monotonic() < deadline:
                    time.sleep(0.005)
                r.execute_command("CLIENT", "PAUSE", "600")

            pauser = threading.Thread(target=pause_once_dispatched)
            pauser.start()
            answers = asyncio.run(burst())
            pauser.join()
        metrics = httpx.get(f"{gw.url}/metrics", timeout=30).text
    # the gateway stopped: the settles it was still retrying were drained
    statuses = collections.Counter(r.status_code for r in answers)
    assert set(statuses) <= {200, 503}, statuses
    served = [r.json()["usage"] for r in [warm, *answers] if r.status_code == 200]
    deferred = metric(metrics, "radixgate_settle_deferred_total")
    assert deferred > 0 and served, (deferred, statuses)
    assert metric(metrics, "radixgate_settle_failures_total") == 0
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        charged = {k: int(v) for k, v in r.hgetall(KeyLayout(prefix).usage(tenant_id)).items()}
    assert charged.get("requests") == len(served), (charged, statuses, deferred)
    assert charged.get("prompt_tokens") == sum(u["prompt_tokens"] for u in served)
    assert charged.get("completion_tokens") == sum(u["completion_tokens"] for u in served)


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus text."""
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name} "))
