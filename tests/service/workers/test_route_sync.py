"""Router replica sync (``service/workers/route_sync.py``): every replica's dispatches reach the others'
cache-aware routers through a real redis-server's pub/sub.

The unit part drives two :class:`RouteSync` objects (as two gateway processes would) and measures the
delay from a publish to the other replica's router (printed; ``loadgen.fleet.replicas.ROUTE_SYNC_DELAY_S``
is what the simulation assumes). The end-to-end part runs two gateway apps over two simulated SGLang
workers: a prefix one gateway placed is a cache hit on the other, and with ``share_routes`` off it is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from starlette.types import ASGIApp, Receive, Scope, Send

from loadgen.fleet.replicas import ROUTE_SYNC_DELAY_S
from loadgen.sim.profiles import get_profile
from loadgen.sim.server import SimServer
from service.app import create_app
from service.config.fleet import ReplicaSettings
from service.config.settings import RedisSettings, Settings
from service.state import SUBSCRIBER_KEEPALIVE, connect_side_clients
from service.workers.route_sync import RouteSync, route_sync, routes_channel
from tests.conftest import ADMIN_TOKEN
from tests.support.servers import ThreadedServer, free_port

MODEL = "sim-model"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
_prefixes = itertools.count()

Learned = list[tuple[str, str, str]]


@contextlib.asynccontextmanager
async def replica(  # type: ignore[no-untyped-def]
    url: str,
    prefix: str,
    name: str,
    learned: Learned,
    max_prompt_chars: int,
    on_routes: Callable[[str, int], None] | None = None,
    on_subscribed: Callable[[bool], None] | None = None,
    **kw: int,
):
    """A :class:`RouteSync` named ``name`` following the channel into ``learned``; closed after."""
    client = aioredis.Redis.from_url(url)
    subscriber = aioredis.Redis.from_url(url, decode_responses=True)
    sync = RouteSync(
        client,
        subscriber,
        prefix,
        name,
        max_prompt_chars,
        on_routes=on_routes,
        on_subscribed=on_subscribed,
        **kw,
    )
    follow = asyncio.create_task(sync.follow(lambda m, w, p: learned.append((m, w, p)), retry_s=0.05))
    try:
        yield sync
    finally:
        follow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follow
        await sync.close()
        await client.aclose()
        await subscriber.aclose()


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def subscribed(url: str, channel: str, count: int) -> None:
    """Wait until ``count`` subscribers listen on ``channel`` (a publish before that reaches nobody)."""
    client = aioredis.Redis.from_url(url)
    try:
        for _ in range(500):
            ((_, n),) = await client.pubsub_numsub(channel)
            if n >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{channel}: fewer than {count} subscribers")
    finally:
        await client.aclose()


async def test_a_replicas_routes_reach_the_others_in_one_message_per_turn(redis_url: str) -> None:
    prefix = f"rs{next(_prefixes)}:"
    a_learned: Learned = []
    b_learned: Learned = []
    a_told: list[tuple[str, int]] = []
    b_told: list[tuple[str, int]] = []
    a_up: list[bool] = []
    b_up: list[bool] = []
    async with (
        replica(redis_url, prefix, "a", a_learned, 8, lambda o, n: a_told.append((o, n)), a_up.append) as a,
        replica(redis_url, prefix, "b", b_learned, 8, lambda o, n: b_told.append((o, n)), b_up.append) as b,
    ):
        await subscribed(redis_url, routes_channel(prefix), 2)
        for k in range(3):  # one turn of the event loop: one message
            a.publish("m", f"http://w{k}", f"prompt number {k}")
        await until(lambda: len(b_learned) == 3)
        assert b_learned == [("m", f"http://w{k}", "prompt n") for k in range(3)]  # cut to 8 characters
        assert a.published == 3 and b.learned == 3 and a.learned == 0
        assert a_told == [("published", 3)] and b_told == [("learned", 3)]
        assert a_up == [True] and b_up == [True]
        b.publish("m2", "http://w9", "from b")
        await until(lambda: len(a_learned) == 1)
        assert a_learned == [("m2", "http://w9", "from b")]  # and b's own message is not applied to b
        await asyncio.sleep(0.05)
        assert len(b_learned) == 3


async def test_malformed_messages_are_ignored_and_the_sync_goes_on(redis_url: str) -> None:
    prefix = f"rs{next(_prefixes)}:"
    learned: Learned = []
    async with replica(redis_url, prefix, "b", learned, max_prompt_chars=100) as b:
        await subscribed(redis_url, routes_channel(prefix), 1)
        client = aioredis.Redis.from_url(redis_url)
        for junk in [b"not json", b"[1, 2]", b'{"r": "x"}', b'{"r": "x", "routes": [[1, 2, 3], ["m", "w"]]}']:
            await client.publish(routes_channel(prefix), junk)
        await client.publish(routes_channel(prefix), b'{"r": "x", "routes": [["m", "w", "p"], 7]}')
        await client.aclose()
        await until(lambda: len(learned) == 1)
        assert learned == [("m", "w", "p")] and b.learned == 1


async def test_a_message_that_is_not_utf8_does_not_end_the_sync(redis_url: str) -> None:
    """The gateway's subscriber decodes messages (``decode_responses``, shared with the auth
    invalidations): a non-UTF-8 payload on the channel (any Redis client may publish there) once ended
    the follower task for good, silently, on every replica."""
    prefix = f"rs{next(_prefixes)}:"
    learned: Learned = []
    up: list[bool] = []
    async with replica(redis_url, prefix, "b", learned, 100, on_subscribed=up.append) as b:
        await subscribed(redis_url, routes_channel(prefix), 1)
        client = aioredis.Redis.from_url(redis_url)
        await client.publish(routes_channel(prefix), b"\xff\xfe")
        await until(lambda: up == [True, False, True])  # told it broke, and that it is back
        await subscribed(redis_url, routes_channel(prefix), 1)  # subscribed again
        await client.publish(routes_channel(prefix), b'{"r": "x", "routes": [["m", "w", "p"]]}')
        await client.aclose()
        await until(lambda: len(learned) == 1)
        assert learned == [("m", "w", "p")] and b.learned == 1


async def test_a_full_backlog_drops_routes_instead_of_growing(redis_url: str) -> None:
    prefix = f"rs{next(_prefixes)}:"
    learned: Learned = []
    async with (
        replica(redis_url, prefix, "a", [], max_prompt_chars=10, max_batch=4) as a,
        replica(redis_url, prefix, "b", learned, max_prompt_chars=10) as _,
    ):
        await subscribed(redis_url, routes_channel(prefix), 2)
        for k in range(10):
            a.publish("m", "w", str(k))
        assert a.dropped == 6
        await until(lambda: len(learned) == 4)
        assert [p for *_, p in learned] == ["0", "1", "2", "3"]


async def test_publishing_to_an_unreachable_redis_drops_and_never_raises() -> None:
    dead = f"redis://127.0.0.1:{free_port()}"
    client = aioredis.Redis.from_url(dead, socket_connect_timeout=0.2)
    sync = RouteSync(client, aioredis.Redis.from_url(dead), "x:", "a", 100)
    sync.publish("m", "w", "p")
    sync.publish("m", "w", "q")
    for _ in range(200):
        await asyncio.sleep(0.01)
        if sync.dropped == 2:
            break
    assert (sync.dropped, sync.published) == (2, 0)
    await sync.close()
    await client.aclose()


def test_the_settings_turn_it_off_and_bound_the_prompt() -> None:
    redis = aioredis.Redis()
    assert route_sync(ReplicaSettings(share_routes=False), redis, redis, "p:", "a") is None
    on = route_sync(ReplicaSettings(route_sync_max_prompt_chars=123), redis, redis, "p:", "a")
    assert on is not None and on.channel == "p:routes"
    with pytest.raises(ValueError):
        ReplicaSettings(route_sync_max_prompt_chars=0)
    with pytest.raises(ValueError):
        RouteSync(redis, redis, "p:", "a", 0)
    for bad in (0, 100, 2**31):  # 1 KiB/s to 1 GiB/s
        with pytest.raises(ValueError):
            ReplicaSettings(route_sync_max_bytes_per_s=bad)
    with pytest.raises(ValueError):
        ReplicaSettings(route_sync_max_prompt_chars=65537)
    for bad_rate in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_bytes_per_s"):
            RouteSync(redis, redis, "p:", "a", 10, max_bytes_per_s=bad_rate)


async def test_routes_past_the_byte_budget_are_dropped_until_it_refills(redis_url: str) -> None:
    """4 KiB/s with a burst of one second's worth: three 1,500-byte routes fill it (the third is
    dropped); half a second later 2 KiB more are there."""
    now = [100.0]
    told: list[tuple[str, int]] = []
    client = aioredis.Redis.from_url(redis_url)
    sync = RouteSync(
        client,
        client,
        f"rs{next(_prefixes)}:",
        "a",
        2000,
        on_routes=lambda o, n: told.append((o, n)),
        max_bytes_per_s=4096,
        clock=lambda: now[0],
    )
    for _ in range(3):
        sync.publish("m", "w", "x" * 1500)
    assert sync.dropped == 1 and told == [("dropped", 1)]
    now[0] += 0.5  # 2,048 bytes back: 1,096 + 2,048 = 3,144, room for two more and 144 bytes
    sync.publish("m", "w", "é" * 750)  # 1,500 bytes in UTF-8 (750 characters)
    sync.publish("m", "w", "y" * 1500)
    sync.publish("m", "w", "z" * 200)
    assert sync.dropped == 2
    await until(lambda: sync.published == 4)
    await sync.close()
    await client.aclose()


async def test_delay_from_a_publish_to_the_other_router(redis_url: str) -> None:
    """What the fleet simulation assumes (1 ms) against loopback: printed, P50 and P99 of 300 routes
    published one per event-loop turn."""
    prefix = f"rs{next(_prefixes)}:"
    arrived: dict[str, float] = {}
    async with (
        replica(redis_url, prefix, "a", [], max_prompt_chars=100) as a,
        replica(redis_url, prefix, "b", [], max_prompt_chars=100) as b,
    ):
        await subscribed(redis_url, routes_channel(prefix), 2)
        follow = asyncio.create_task(b.follow(lambda m, w, p: arrived.setdefault(p, time.perf_counter())))
        await subscribed(redis_url, routes_channel(prefix), 3)
        sent: dict[str, float] = {}
        for k in range(300):
            sent[str(k)] = time.perf_counter()
            a.publish("m", "w", str(k))
            await asyncio.sleep(0.002)
        await until(lambda: len(arrived) == 300)
        follow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follow
    delays = sorted((arrived[k] - sent[k]) * 1000 for k in sent)
    p50, p99 = statistics.median(delays), delays[int(0.99 * len(delays)) - 1]
    simulated = ROUTE_SYNC_DELAY_S * 1000
    print(f"route sync delay on loopback: P50 {p50:.2f} ms, P99 {p99:.2f} ms (simulated: {simulated:g} ms)")


# ------------------------------------------------------------------------------------------ end to end
class CountGenerate:
    """Wraps an ASGI app; counts its ``/generate`` requests."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.total = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/generate":
            self.total += 1
        await self.app(scope, receive, send)


def gateway(redis_url: str, model_dir: Path, workers: list[str], prefix: str, share: bool) -> ThreadedServer:
    settings = Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": prefix},
            "engine": {"served_model_name": MODEL},
            "upstream": {"workers": workers, "health_interval_s": 0.2},
            "api": {"tokenizer_path": str(model_dir), "context_length": 4096},
            "scheduler": {"load_poll_interval_s": 0.1},
            "replicas": {"share_routes": share, "heartbeat_s": 0.2, "ttl_s": 2.0},
            "planner": {"enabled": False},
        }
    )
    return ThreadedServer(create_app(settings))


@contextlib.contextmanager
def two_gateways(
    redis_url: str, model_dir: Path, share: bool
) -> Iterator[tuple[list[CountGenerate], list[str]]]:
    prefix = f"rs{next(_prefixes)}:"
    counted = [
        CountGenerate(SimServer(get_profile("smollm2-135m-cpu2"), model_name=MODEL, speed=20.0).app)
        for _ in range(2)
    ]
    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(ThreadedServer(c)).url for c in counted]
        urls = [
            stack.enter_context(gateway(redis_url, model_dir, workers, prefix, share)).url for _ in range(2)
        ]
        yield counted, urls


def chat(url: str, key: str, system: str, question: str, cached: list[int] | None = None) -> None:
    """Send one chat; its ``cached_tokens`` (the engine's prefix cache) go into ``cached``."""
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
    }
    resp = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    assert resp.status_code == 200, resp.text
    if cached is not None:
        cached.append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def new_key(url: str) -> str:
    tenant = f"rs{next(_prefixes)}"
    resp = httpx.post(f"{url}/admin/tenants", json={"id": tenant, "name": tenant}, headers=ADMIN, timeout=10)
    assert resp.status_code == 201, resp.text
    issued = httpx.post(f"{url}/admin/tenants/{tenant}/keys", json={"name": "k"}, headers=ADMIN, timeout=10)
    return str(issued.json()["api_key"])


def served_by(workers: list[CountGenerate], send: Callable[[], None]) -> int:
    before = [w.total for w in workers]
    send()
    (which,) = [i for i, w in enumerate(workers) if w.total > before[i]]
    return which


@pytest.mark.parametrize("share", [True, False])
def test_a_prefix_one_gateway_placed_is_a_hit_on_the_other(
    redis_url: str, stub_model_dir: Path, share: bool
) -> None:
    long_system = "You answer questions about the ACME billing system, politely and briefly. " * 12
    with two_gateways(redis_url, stub_model_dir, share) as (workers, (a, b)):
        key = new_key(a)
        # gateway a: an unrelated prompt takes the first worker (every tree empty), the billing prompt
        # then goes to the other one (the smallest tree)
        first = served_by(workers, lambda: chat(a, key, "You translate German.", "Hallo"))
        placed = served_by(workers, lambda: chat(a, key, long_system, "Why was I charged twice?"))
        assert placed != first
        time.sleep(0.3)  # well past the sync's delay
        cached: list[int] = []
        again = served_by(workers, lambda: chat(b, key, long_system, "How do I update my card?", cached))
        metrics = httpx.get(f"{b}/metrics", timeout=10).text
        hits = [
            line
            for line in metrics.splitlines()
            if line.startswith("radixgate_routing_decisions_total{") and 'reason="cache_hit"' in line
        ]
        sync = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("radixgate_route_sync_")
        }
        if share:  # gateway b learned where a put the prefix: a hit there
            assert sync['radixgate_route_sync_routes_total{outcome="learned"}'] >= 2  # a's two chats
            assert sync['radixgate_route_sync_routes_total{outcome="dropped"}'] == 0
            assert sync["radixgate_route_sync_subscribed"] == 1
            a_metrics = httpx.get(f"{a}/metrics", timeout=10).text
            assert 'radixgate_route_sync_routes_total{outcome="published"} 2.0' in a_metrics
            assert again == placed
            assert cached[0] > 150  # the engine had the system prompt: most of the 180 prompt tokens
            assert hits and float(hits[0].rsplit(" ", 1)[1]) >= 1
        else:  # b's tree is empty: a miss, to its first worker
            assert sync == {}  # no sync, no series (a subscribed gauge at 0 would read as broken)
            assert again == first
            assert cached[0] < 20  # prefilled again on the other worker
            assert not hits or all(float(h.rsplit(" ", 1)[1]) == 0 for h in hits)


async def test_the_subscriber_probes_a_silent_connection(redis_url: str) -> None:
    """The subscriptions wait with no read timeout: their connection has TCP keepalive (idle 30 s, probes
    every 10 s, 3 of them), so a Redis gone without closing it is noticed in about a minute."""
    subscriber, pinger = connect_side_clients(RedisSettings(url=redis_url))
    pubsub = subscriber.pubsub()
    try:
        await pubsub.subscribe("rs-keepalive")
        assert pubsub.connection is not None
        sock = pubsub.connection._writer.get_extra_info("socket")  # type: ignore[union-attr]
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        for option, value in SUBSCRIBER_KEEPALIVE.items():
            assert sock.getsockopt(socket.IPPROTO_TCP, option) == value
        assert set(SUBSCRIBER_KEEPALIVE.values()) == {30, 10, 3}  # Linux has all three
    finally:
        await pubsub.aclose()
        await subscriber.aclose()
        await pinger.aclose()
