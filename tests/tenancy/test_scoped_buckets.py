"""A request's key, model and tenant buckets taken in one script call (tenancy/quota.py, token_bucket.lua):
all or nothing, the first short named, every bucket settled; leases bypassed for them; keys that carry
terms in the store, their expiry in the authentication cache; delete clearing the new buckets."""

from __future__ import annotations

import math
from typing import TypeVar

import pytest
import redis.asyncio as aioredis

from tenancy.auth_cache import AuthCache
from tenancy.layout import KeyLayout
from tenancy.models import BucketLimits, KeyCreate, KeyPatch, ModelQuota, Quotas, TenantCreate, TenantPatch
from tenancy.quota import QuotaLimiter, Reservation, Scope
from tenancy.quota_lease import LeasedQuota
from tenancy.store import TenantStore
from tests.support.leftovers import lasting_async

KEY = Scope("key", "k1", BucketLimits(requests_per_min=60, request_burst=2))
MODEL = Scope("model", "m1", BucketLimits(tokens_per_min=600, token_burst=100))
TENANT = Quotas(requests_per_min=600, request_burst=5, tokens_per_min=6000, token_burst=1000)
SCOPES = (KEY, MODEL)

# (now_ms, tokens, allowed, named (scope kind, bucket) or None, wait_ms,
#  levels after: key requests, model tokens, tenant requests, tenant tokens)
TABLE: list[tuple[float, int, bool, tuple[str, str] | None, float, tuple[float, float, float, float]]] = [
    (0, 40, True, None, 0, (1, 60, 4, 960)),  # every bucket debited
    (0, 70, False, ("model", "tokens"), 1000, (1, 60, 4, 960)),  # the model's 60 are short: nothing taken
    (0, 10, True, None, 0, (0, 50, 3, 950)),
    (0, 10, False, ("key", "requests"), 1000, (0, 50, 3, 950)),  # the key's requests are gone
    # the key (first in order) and the model are both short: the key is named, the wait is the model's
    (0, 80, False, ("key", "requests"), 3000, (0, 50, 3, 950)),
    (1000, 10, True, None, 0, (0, 50, 4, 990)),  # 1 s later: 1 key request, 10 model tokens back
    (1000, 101, False, ("model", "tokens"), math.inf, (0, 50, 4, 990)),  # above the model's burst
    (1000, 1, False, ("key", "requests"), 1000, (0, 50, 4, 990)),
]


L = TypeVar("L", bound=BucketLimits)


async def levels_of(client: aioredis.Redis, limiter: QuotaLimiter) -> tuple[float, ...]:
    """The four buckets' stored levels (a missing bucket is full)."""
    out = []
    for scope, bucket, full in ((KEY, "requests", 2), (MODEL, "tokens", 100)):
        raw = await client.hget(limiter.bucket_key("t", bucket, scope), "level")  # type: ignore[arg-type]
        out.append(full if raw is None else float(raw))
    for bucket, full in (("requests", 5), ("tokens", 1000)):
        raw = await client.hget(limiter.bucket_key("t", bucket), "level")  # type: ignore[arg-type]
        out.append(full if raw is None else float(raw))
    return tuple(out)


async def test_key_model_and_tenant_buckets_follow_the_table(redis_client: aioredis.Redis) -> None:
    limiter = QuotaLimiter(redis_client, "sc:")
    for row in TABLE:
        now, tokens, allowed, named, wait, levels = row
        decision = await limiter.reserve("t", TENANT, tokens, now_ms=now, scopes=SCOPES)
        assert decision.allowed == allowed, row
        if named is None:
            assert decision.limiting is None and decision.scope is None, row
        else:
            assert decision.limiting == named[1], row
            assert decision.scope is not None and decision.scope.kind == named[0], row
            assert decision.never == math.isinf(wait), row
            assert decision.retry_after_s * 1000 == wait, row
        assert await levels_of(redis_client, limiter) == pytest.approx(levels), row
        # what the headers are made of: every bucket, as the call left it (refused: as it found it)
        assert [(b.bucket, b.capacity) for b in decision.levels] == [
            ("requests", 2),
            ("tokens", 100),
            ("requests", 5),
            ("tokens", 1000),
        ], row
        assert [b.level for b in decision.levels] == pytest.approx(levels), row


async def test_a_tenant_short_alone_is_named_as_before(redis_client: aioredis.Redis) -> None:
    limiter = QuotaLimiter(redis_client, "sc2:")
    quotas = Quotas(requests_per_min=60, request_burst=1, tokens_per_min=60, token_burst=10)
    assert (await limiter.reserve("t", quotas, 5, now_ms=0, scopes=SCOPES)).allowed
    refused = await limiter.reserve("t", quotas, 8, now_ms=0, scopes=SCOPES)
    # the tenant's requests (0) and tokens (5 < 8) are short; the key's 1 request and the model's 95
    # tokens are not: the tenant's requests, first of the two, are named
    assert not refused.allowed and refused.scope is None and refused.limiting == "requests"
    assert refused.remaining == {"requests": pytest.approx(0), "tokens": pytest.approx(5)}
    assert refused.retry_after_s == pytest.approx(3.0)  # the slowest: 3 tokens at 1/s


def slowed(limits: L) -> L:
    """``limits`` with each rate it sets at 0.001 per minute (its bursts kept)."""
    rates = ("requests_per_min", "tokens_per_min")
    return limits.model_copy(update={r: 0.001 for r in rates if getattr(limits, r) is not None})


async def test_a_settle_gives_back_to_every_bucket_it_took_from(redis_client: aioredis.Redis) -> None:
    limiter = QuotaLimiter(redis_client, "sc3:")
    assert (await limiter.reserve("t", TENANT, 90, now_ms=0, scopes=SCOPES)).allowed
    assert await levels_of(redis_client, limiter) == pytest.approx((1, 10, 4, 910))
    held = Reservation("t", TENANT, 1, 90, scopes=SCOPES)
    assert await limiter.settle(held, 30, {"requests": 1}, now_ms=0)  # 60 unused tokens back to both
    assert await levels_of(redis_client, limiter) == pytest.approx((1, 70, 4, 970))
    assert (await limiter.reserve("t", TENANT, 50, now_ms=0, scopes=SCOPES)).allowed
    assert await limiter.settle(Reservation("t", TENANT, 1, 50, scopes=SCOPES), None, {}, now_ms=0)  # refund
    assert await levels_of(redis_client, limiter) == pytest.approx((1, 70, 4, 970))
    await limiter.adjust("t", TENANT, 0, -15, now_ms=0, scopes=SCOPES)  # an overrun of 15, charged to both
    assert await levels_of(redis_client, limiter) == pytest.approx((1, 55, 4, 955))
    # refund and reconcile (on the server's clock) reach the scopes' buckets too; the same buckets with
    # rates of 0.001/min: what refills between the calls (a loaded machine's milliseconds) is below 0.01
    tenant = slowed(TENANT)
    scopes = tuple(Scope(s.kind, s.name, slowed(s.limits)) for s in SCOPES)
    other = QuotaLimiter(redis_client, "sc3b:")
    assert (await other.reserve("t", tenant, 90, scopes=scopes)).allowed
    await other.refund(Reservation("t", tenant, 1, 90, scopes=scopes))
    assert await levels_of(redis_client, other) == pytest.approx((2, 100, 5, 1000), abs=0.01)
    assert (await other.reserve("t", tenant, 90, scopes=scopes)).allowed
    await other.reconcile(Reservation("t", tenant, 1, 90, scopes=scopes), used_tokens=40)
    assert await levels_of(redis_client, other) == pytest.approx((1, 60, 4, 960), abs=0.01)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_scoped_requests_bypass_the_lease_and_leased_ones_report_levels(
    redis_client: aioredis.Redis,
) -> None:
    clock = Clock()
    limiter = QuotaLimiter(redis_client, "sc4:")
    quota = LeasedQuota(limiter, horizon_s=0.5, max_fraction=0.05, ttl_s=5.0, clock=clock)
    quotas = Quotas(requests_per_min=6000, request_burst=12000)  # leases 50 requests (0.5 s at 100/s)
    await limiter.adjust("t", quotas, requests=-1000)  # room below the burst, for the refill below
    try:
        scoped = await quota.reserve("t", quotas, 10, scopes=(KEY,))
        assert scoped.allowed and not scoped.leased and quota.held == 0 and quota.remote == 1
        assert [(b.bucket, b.capacity) for b in scoped.levels] == [("requests", 2), ("requests", 12000)]
        first = await quota.reserve("t", quotas, 10)  # a Redis call that takes a lease of 50
        assert first.leased and quota.held == 1 and quota.remote == 2
        level = await redis_client.hget(limiter.bucket_key("t", "requests"), "level")  # type: ignore[arg-type]
        shared = float(level)
        assert shared < 11000 - 51  # the scoped one, this one and the lease (the server's clock refills)
        (reported,) = first.levels
        assert reported.level == pytest.approx(shared + 50)  # the shared level and the units held here
        second = await quota.reserve("t", quotas, 10)  # from the lease: no Redis call
        assert second.leased and quota.remote == 2 and quota.local == 1
        assert second.levels[0].level == pytest.approx(shared + 49)
        clock.now += 0.1  # 10 requests refilled since
        third = await quota.reserve("t", quotas, 10)
        assert third.levels[0].level == pytest.approx(shared + 10 + 48)
        # a scoped request of the same tenant still goes to Redis, and its lease stays here
        assert (await quota.reserve("t", quotas, 10, scopes=(KEY,))).allowed
        refused = await quota.reserve("t", quotas, 10, scopes=(KEY,))
        assert not refused.allowed and refused.scope == KEY and quota.held == 1
    finally:
        await quota.close()


PEPPER = b"terms-pepper"


async def test_keys_carry_terms_and_a_patch_merges_them(redis_client: aioredis.Redis) -> None:
    store = TenantStore(redis_client, "kt:", PEPPER)
    await store.create(TenantCreate(id="acme", name="Acme", priority_class="standard"))
    terms = KeyCreate(
        name="ci",
        expires_at=2_000_000_000,
        allowed_models=["m1"],
        quotas=BucketLimits(requests_per_min=30, tokens_per_min=1000),
    )
    issued = await store.issue_key("acme", "ci", terms)
    assert (issued.name, issued.expires_at, issued.allowed_models) == ("ci", 2e9, ["m1"])
    found = await store.authenticate_key(issued.api_key)
    assert found is not None and found.key.quotas == terms.quotas and found.tenant.id == "acme"
    patch = KeyPatch.model_validate(
        {"quotas": {"requests_per_min": 20, "token_burst": 500}, "expires_at": None}
    )
    updated = await store.update_key("acme", issued.key_id, patch)
    assert updated.expires_at is None and updated.allowed_models == ["m1"] and updated.name == "ci"
    assert updated.quotas == BucketLimits(requests_per_min=20, tokens_per_min=1000, token_burst=500)
    cleared = await store.update_key("acme", issued.key_id, KeyPatch.model_validate({"quotas": None}))
    assert cleared.quotas is None and (await store.get_key("acme", issued.key_id)) == cleared
    with pytest.raises(ValueError):  # the check refuses: nothing written
        await store.update_key("acme", issued.key_id, KeyPatch(name="x"), check=_refuse)
    assert (await store.get_key("acme", issued.key_id)).name == "ci"


def _refuse(_: object) -> None:
    raise ValueError("no")


async def test_a_cached_key_is_not_served_past_its_expiry(redis_client: aioredis.Redis) -> None:
    mono, wall = Clock(), Clock()
    wall.now = 1_800_000_000.0
    cache = AuthCache(60.0, 100, mono)  # a minute's cache...
    store = TenantStore(redis_client, "kx:", PEPPER, cache, wall_clock=wall)
    await store.create(TenantCreate(id="acme", name="Acme", priority_class="standard"))
    issued = await store.issue_key("acme", "", KeyCreate(expires_at=wall.now + 5))  # ...a key for 5 s
    found = await store.authenticate_key(issued.api_key)
    assert found is not None and not found.key.expired(wall.now)
    assert cache.get(issued.key_id) is not None
    mono.now += 4.9
    wall.now += 4.9
    assert cache.get(issued.key_id) is not None and await store.authenticate(issued.api_key) is not None
    mono.now += 0.1
    wall.now += 0.1  # expired: the entry is gone, so the record is read again (and says so)
    assert cache.get(issued.key_id) is None
    again = await store.authenticate_key(issued.api_key)
    assert again is not None and again.key.expired(wall.now)
    assert await store.authenticate(issued.api_key) is None
    # a patch that moves the expiry on is seen at once (the entry is dropped on this replica)
    await store.update_key("acme", issued.key_id, KeyPatch(expires_at=wall.now + 100))
    assert await store.authenticate(issued.api_key) is not None


async def test_delete_clears_key_and_model_buckets_even_of_removed_entries(
    redis_client: aioredis.Redis,
) -> None:
    store = TenantStore(redis_client, "kd:", PEPPER)
    limiter = QuotaLimiter(redis_client, "kd:")
    quotas = Quotas(requests_per_min=100, models=[ModelQuota(model="m1", requests_per_min=10)])
    tenant = await store.create(
        TenantCreate(id="acme", name="Acme", priority_class="standard", quotas=quotas)
    )
    issued = await store.issue_key("acme", "", KeyCreate(quotas=BucketLimits(tokens_per_min=100)))
    scopes = (
        Scope("key", issued.key_id, BucketLimits(tokens_per_min=100)),
        Scope("model", "m1", BucketLimits(requests_per_min=10)),
    )
    assert (await limiter.reserve("acme", quotas, 5, epoch=tenant.epoch, scopes=scopes)).allowed
    # the model's entry is removed (its bucket lives on until it refills), another is added
    patch = TenantPatch(quotas=Quotas(models=[ModelQuota(model="m2", tokens_per_min=50)]))
    await store.update("acme", patch)
    owned = sorted([k async for k in redis_client.scan_iter(match="kd:*acme*")])
    layout = KeyLayout("kd:")
    assert layout.scoped_bucket("acme", "model", "m1", "requests") in owned
    assert layout.scoped_bucket("acme", "key", issued.key_id, "tokens") in owned
    await store.delete("acme")
    assert await lasting_async(redis_client, "*acme*") == []
    assert await lasting_async(redis_client, f"*{issued.key_id}*") == []
