"""The replicas' memory of authenticated keys (tenancy/auth_cache.py): bounded, expiring, and invalidated
on every replica through Redis pub/sub, so a revoked key, a disabled or deleted tenant take effect within
the cache's bound (redis.auth_cache_ttl_s) everywhere."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis as syncredis
import redis.asyncio as aioredis

from service.app import create_app
from tenancy import keys
from tenancy.auth_cache import AuthCache, follow_invalidations, invalidation_channel
from tenancy.layout import KeyLayout
from tenancy.models import Tenant, TenantCreate, TenantPatch
from tenancy.redis_client import RedisClient
from tenancy.store import TenantStore
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_api import MODEL, auth, gateway_settings, new_tenant
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer
from tests.tenancy.conftest import RedisTarget

PEPPER = b"cache-pepper"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_entries_expire_are_bounded_and_a_racing_read_is_not_stored() -> None:
    clock = Clock()
    cache = AuthCache(1.0, 2, clock)
    tenant_a, tenant_b = (
        Tenant(id="a", name="a", priority_class="standard"),
        Tenant(id="b", name="b", priority_class="standard"),
    )
    cache.put("k1", "d1", tenant_a, clock.now, cache.generation)
    clock.now += 0.99
    hit = cache.get("k1")
    assert hit is not None and hit.digest == "d1"
    clock.now += 0.01  # 1 s after the read began: gone
    assert cache.get("k1") is None and len(cache) == 0
    for i in range(3):  # bounded: the oldest goes first
        cache.put(f"k{i}", "d", tenant_b, clock.now, cache.generation)
    assert len(cache) == 2 and cache.get("k0") is None and cache.get("k2") is not None
    generation = cache.generation  # a read begins...
    cache.apply("key:k9")  # ...an invalidation arrives meanwhile...
    cache.put("k5", "d", tenant_a, clock.now, generation)
    assert cache.get("k5") is None  # ...so what it read is not trusted
    cache.apply("tenant:b")
    assert len(cache) == 0
    off = AuthCache(0.0, 10, clock)
    off.put("k", "d", tenant_a, clock.now, off.generation)
    assert not off.enabled and off.get("k") is None


async def test_store_answers_from_the_cache_within_its_ttl_only(redis_client: aioredis.Redis) -> None:
    clock = Clock()
    cache = AuthCache(1.0, 100, clock)
    store = TenantStore(redis_client, "ac1:", PEPPER, cache)
    await store.create(TenantCreate(priority_class="standard", id="acme", name="a"))
    issued = await store.issue_key("acme")
    assert (tenant := await store.authenticate(issued.api_key)) is not None and tenant.id == "acme"
    wrong = issued.api_key[:-4] + ("AAAA" if not issued.api_key.endswith("AAAA") else "BBBB")
    assert await store.authenticate(wrong) is None  # the digest is checked on a hit too
    hmacs: list[str] = []

    def counted(full: str, digest: str, pepper: bytes) -> bool:
        hmacs.append(full)
        return keys.digest_matches(full, digest, pepper)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tenancy.store.digest_matches", counted)
        assert await store.authenticate(issued.api_key) is not None
        assert hmacs == []  # the key that passed: compared, not hashed again
        assert await store.authenticate(wrong) is None and hmacs == [wrong]
    await redis_client.delete(
        KeyLayout("ac1:").api_key("acme", issued.key_id)
    )  # behind the store's back: no invalidation
    clock.now += 0.9
    assert await store.authenticate(issued.api_key) is not None  # answered from memory
    clock.now += 0.1
    assert await store.authenticate(issued.api_key) is None  # the bound: read again, gone


async def _gets(redis: RedisClient) -> int:
    """Reads Redis has answered: GET and MGET calls (on a cluster, summed over its nodes)."""
    if isinstance(redis, aioredis.RedisCluster):
        replies = await redis.info("commandstats", target_nodes=aioredis.RedisCluster.PRIMARIES)
        nodes = list(replies.values())
    else:
        nodes = [await redis.info("commandstats")]
    return sum(int(n.get(f"cmdstat_{c}", {}).get("calls", 0)) for n in nodes for c in ("get", "mget"))


async def test_concurrent_misses_of_one_key_share_one_read(redis_client: aioredis.Redis) -> None:
    """When an entry expires under load, the requests in flight for the key read Redis once between them
    (was: each its own two reads, the benchmark's 64 connections at every expiry), each still checked
    against the digest; a read that began before an invalidation is not joined, and the first caller
    leaving does not fail the others."""
    clock = Clock()
    store = TenantStore(redis_client, "ac5:", PEPPER, AuthCache(1.0, 100, clock))
    await store.create(TenantCreate(priority_class="standard", id="acme", name="a"))
    issued = await store.issue_key("acme")
    wrong = issued.api_key[:-4] + ("AAAA" if not issued.api_key.endswith("AAAA") else "BBBB")
    before = await _gets(redis_client)
    answers = await asyncio.gather(*(store.authenticate(k) for k in [issued.api_key] * 20 + [wrong]))
    assert await _gets(redis_client) - before == 2  # the key's owner, then the key and its tenant, once
    assert all(a is not None and a.id == "acme" for a in answers[:20]) and answers[20] is None
    clock.now += 1.0  # expired: the next burst reads once more
    before = await _gets(redis_client)
    first = asyncio.ensure_future(store.authenticate(issued.api_key))
    await asyncio.sleep(0)  # its read is under way
    others = [asyncio.ensure_future(store.authenticate(issued.api_key)) for _ in range(5)]
    first.cancel()
    assert all(t is not None for t in await asyncio.gather(*others))
    assert await _gets(redis_client) - before == 2
    with contextlib.suppress(asyncio.CancelledError):
        await first
    clock.now += 1.0
    before = await _gets(redis_client)
    stale = asyncio.ensure_future(store.authenticate(issued.api_key))
    await asyncio.sleep(0)
    await store.revoke_key("acme", issued.key_id)  # an invalidation while that read is under way
    assert await store.authenticate(issued.api_key) is None  # read again, not joined: revoked
    await stale
    assert await _gets(redis_client) - before >= 3


async def test_writes_invalidate_this_replica_and_publish(
    redis_client: aioredis.Redis, redis_target: RedisTarget
) -> None:
    here, there = AuthCache(60.0, 100), AuthCache(60.0, 100)
    store = TenantStore(redis_client, "ac2:", PEPPER, here)
    other = TenantStore(redis_client, "ac2:", PEPPER, there)
    # on a cluster, one node's subscriber hears what is published on any node (Redis Cluster pub/sub)
    subscriber = aioredis.Redis.from_url(redis_target.url, decode_responses=True)
    follower = asyncio.create_task(follow_invalidations(subscriber, invalidation_channel("ac2:"), there))
    try:
        await store.create(TenantCreate(priority_class="standard", id="acme", name="a"))
        one, two = await store.issue_key("acme"), await store.issue_key("acme")
        await asyncio.sleep(0.2)  # subscribed
        for key in (one.api_key, two.api_key):
            assert await store.authenticate(key) is not None
            assert await other.authenticate(key) is not None
        assert len(here) == len(there) == 2
        await store.revoke_key("acme", one.key_id)
        assert await store.authenticate(one.api_key) is None  # this replica: at once
        await until(lambda: len(there) == 1)  # the other: through pub/sub, long before its 60 s TTL
        assert await other.authenticate(one.api_key) is None
        await store.update("acme", TenantPatch(enabled=False))
        await until(lambda: len(there) == 0)
        seen = await other.authenticate(two.api_key)
        assert seen is not None and not seen.enabled
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await subscriber.aclose()


async def test_a_message_that_is_not_utf8_does_not_end_the_invalidations(
    redis_client: aioredis.Redis, redis_target: RedisTarget
) -> None:
    """A non-UTF-8 payload on the channel (any Redis client may publish there) once ended the follower
    for good, silently: revocations then no longer reached this replica's cache."""
    there = AuthCache(60.0, 100)
    store = TenantStore(redis_client, "ac3:", PEPPER, AuthCache(60.0, 100))
    other = TenantStore(redis_client, "ac3:", PEPPER, there)
    subscriber = aioredis.Redis.from_url(redis_target.url, decode_responses=True)
    follower = asyncio.create_task(
        follow_invalidations(subscriber, invalidation_channel("ac3:"), there, retry_s=0.05)
    )
    try:
        await store.create(TenantCreate(priority_class="standard", id="acme", name="a"))
        one = await store.issue_key("acme")
        await asyncio.sleep(0.2)  # subscribed
        await redis_client.publish(invalidation_channel("ac3:"), b"\xff\xfe")
        await asyncio.sleep(0.3)  # subscribed again
        assert await other.authenticate(one.api_key) is not None
        assert len(there) == 1
        await store.revoke_key("acme", one.key_id)
        await until(lambda: len(there) == 0)
        assert await other.authenticate(one.api_key) is None
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await subscriber.aclose()


async def until(condition: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# -- two replicas over HTTP ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with ThreadedServer(FakeWorker().app) as server:
        yield server.url


@contextlib.contextmanager
def two_replicas(redis_url: str, model_dir: Path, worker: str, ttl_s: float) -> Iterator[list[str]]:
    urls: list[str] = []
    with contextlib.ExitStack() as stack:
        for _ in range(2):
            settings = gateway_settings(redis_url, model_dir, [worker])
            settings.redis.key_prefix = "ac-shared:"
            settings.redis.auth_cache_ttl_s = ttl_s
            urls.append(stack.enter_context(ThreadedServer(create_app(settings))).url)
        yield urls


def _ask(base: str, key: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=auth(key), timeout=10).status_code


def _time_until(status: int, base: str, key: str, bound_s: float) -> float:
    started = time.monotonic()
    while _ask(base, key) != status:
        assert time.monotonic() - started < bound_s + 1.0, f"no {status} within {bound_s} s"
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.mark.parametrize("ttl_s", [1.0, 30.0])
def test_revoking_a_key_takes_effect_on_every_replica_within_the_bound(
    redis_url: str, stub_model_dir: Path, fake_url: str, ttl_s: float
) -> None:
    """ttl 1 s: the issue's bound. ttl 30 s: pub/sub alone must carry the revocation in well under 1 s."""
    with (
        two_replicas(redis_url, stub_model_dir, fake_url, ttl_s) as (a, b),
        httpx.Client(base_url=a) as admin,
    ):
        tenant_id, key = new_tenant(admin, quotas={"requests_per_min": 1e9, "tokens_per_min": 1e12})
        key_id = key.removeprefix("rg-").split(".")[0]
        assert _ask(a, key) == 200 and _ask(b, key) == 200  # both replicas now hold the key
        revoked = admin.delete(f"/admin/tenants/{tenant_id}/keys/{key_id}", headers=ADMIN)
        assert revoked.status_code == 200
        assert _ask(a, key) == 401  # where it was revoked: at once
        assert _time_until(401, b, key, 1.0) < 1.0  # the other replica: within 1 s


def test_revocation_without_its_message_still_takes_effect_within_the_ttl(
    redis_url: str, stub_model_dir: Path, fake_url: str
) -> None:
    """A lost pub/sub message (here: the record revoked behind the gateways' backs) is bounded by the TTL."""
    with two_replicas(redis_url, stub_model_dir, fake_url, 1.0) as (a, b), httpx.Client(base_url=a) as admin:
        tenant_id, key = new_tenant(admin)
        key_id = key.removeprefix("rg-").split(".")[0]
        assert _ask(b, key) == 200
        with syncredis.Redis.from_url(redis_url) as r:
            name = KeyLayout("ac-shared:").api_key(tenant_id, key_id)
            raw = r.get(name)
            assert raw is not None
            r.set(name, raw.replace(b'"revoked":false', b'"revoked":true'))
        waited = _time_until(401, b, key, 1.0)
        assert waited <= 1.0 + 0.3


def test_disabling_and_deleting_a_tenant_reach_the_other_replica(
    redis_url: str, stub_model_dir: Path, fake_url: str
) -> None:
    with two_replicas(redis_url, stub_model_dir, fake_url, 30.0) as (a, b), httpx.Client(base_url=a) as admin:
        tenant_id, key = new_tenant(admin)
        assert _ask(b, key) == 200
        assert admin.post(f"/admin/tenants/{tenant_id}/disable", headers=ADMIN).status_code == 200
        assert _time_until(403, b, key, 1.0) < 1.0
        assert admin.post(f"/admin/tenants/{tenant_id}/enable", headers=ADMIN).status_code == 200
        assert _time_until(200, b, key, 1.0) < 1.0
        assert admin.delete(f"/admin/tenants/{tenant_id}", headers=ADMIN).status_code == 204
        assert _time_until(401, b, key, 1.0) < 1.0
