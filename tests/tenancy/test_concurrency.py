"""Concurrency slots against a real Redis (``slot_acquire.lua``, ``slot_renew.lua``, ``slot_release.lua``):
acquire, renew, release and lease expiry on an injected clock, the tenant guard, and the renewal task on
the server's clock."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from tenancy.concurrency import ConcurrencyLimiter, HeldSlot, SlotRefused
from tenancy.errors import TenantNotFoundError
from tenancy.layout import KeyLayout
from tenancy.models import KeyCreate, TenantCreate
from tenancy.store import TenantStore
from tests.support.leftovers import lasting_async

LEASE_S = 60.0  # injected clock in ms: steps 30 s apart; a set's real TTL (60 s) outlives the test
P = "slots-test:"


@dataclass(frozen=True)
class Step:
    """One call: ``op`` at injected time ``now`` (ms) for request ``name``; ``want`` is "held",
    "tenant"/"key" (refused by that set) or "none" (no cap: no call); after it, the live slot ids
    of the tenant's and the key's sets must be ``tenant_set`` and ``key_set``."""

    op: str  # "acquire" (tenant_cap, key_cap) | "release" | "renew"
    now: float
    name: str = ""
    tenant_cap: int | None = None
    key_cap: int | None = None
    want: str = "held"
    tenant_set: tuple[str, ...] = ()
    key_set: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()


CASES: dict[str, list[Step]] = {
    "tenant cap 2: the third waits": [
        Step("acquire", 0, "a", 2, tenant_set=("a",)),
        Step("acquire", 1, "b", 2, tenant_set=("a", "b")),
        Step("acquire", 2, "c", 2, want="tenant", tenant_set=("a", "b")),
        Step("release", 3, "a", tenant_set=("b",)),
        Step("acquire", 4, "c", 2, tenant_set=("b", "c")),
    ],
    "a lease that ends frees its slot (at its end, not before)": [
        Step("acquire", 0, "a", 1, tenant_set=("a",)),
        Step("acquire", 59_999, "b", 1, want="tenant", tenant_set=("a",)),
        Step("acquire", 60_000, "b", 1, tenant_set=("b",)),
    ],
    "a renewed lease holds past its first end": [
        Step("acquire", 0, "a", 1, tenant_set=("a",)),
        Step("renew", 50_000, tenant_set=("a",)),
        Step("acquire", 100_000, "b", 1, want="tenant", tenant_set=("a",)),
        Step("acquire", 110_000, "b", 1, tenant_set=("b",)),
    ],
    "a renewal after the lease ended finds the slot lost": [
        Step("acquire", 0, "a", 2, tenant_set=("a",)),
        Step("acquire", 40_000, "b", 2, tenant_set=("a", "b")),
        Step("renew", 60_000, tenant_set=("b",), lost=("a",)),
        Step("release", 60_001, "a", tenant_set=("b",)),  # already given up: a no-op
    ],
    "key cap below the tenant's: the key is full, the tenant set untouched": [
        Step("acquire", 0, "a", 3, 1, tenant_set=("a",), key_set=("a",)),
        Step("acquire", 1, "b", 3, 1, want="key", tenant_set=("a",), key_set=("a",)),
        Step("release", 2, "a"),
        Step("acquire", 3, "b", 3, 1, tenant_set=("b",), key_set=("b",)),
    ],
    "tenant full: the key set gets nothing either": [
        Step("acquire", 0, "a", 1, tenant_set=("a",)),
        Step("acquire", 1, "b", 1, 5, want="tenant", tenant_set=("a",)),
    ],
    "a key cap alone": [
        Step("acquire", 0, "a", None, 1, key_set=("a",)),
        Step("acquire", 1, "b", None, 1, want="key", key_set=("a",)),
    ],
    "no cap: no call, nothing written": [
        Step("acquire", 0, "a", None, None, want="none"),
    ],
    "a slot released twice is removed once": [
        Step("acquire", 0, "a", 2, tenant_set=("a",)),
        Step("acquire", 1, "b", 2, tenant_set=("a", "b")),
        Step("release", 2, "a", tenant_set=("b",)),
        Step("release", 3, "a", tenant_set=("b",)),
    ],
}


async def live(redis: aioredis.Redis, key: str, ids: dict[str, str]) -> tuple[str, ...]:
    """The request names whose slot ids ``key`` holds (expired members included: the scripts remove them)."""
    names = {slot_id: name for name, slot_id in ids.items()}
    return tuple(sorted(names[m] for m in await redis.zrange(key, 0, -1)))


@pytest.mark.parametrize("steps", CASES.values(), ids=CASES.keys())
async def test_slot_scripts(redis_client: aioredis.Redis, steps: list[Step]) -> None:
    store = TenantStore(redis_client, P, b"pepper")
    tenant = await store.create(TenantCreate(id="acme", name="a", priority_class="standard"))
    reported: list[int] = []  # what the metric is told (on_lost)
    limiter = ConcurrencyLimiter(redis_client, P, LEASE_S, on_lost=reported.append)
    layout = KeyLayout(P)
    held: dict[str, HeldSlot] = {}
    for step in steps:
        if step.op == "acquire":
            got = await limiter.acquire(
                "acme", step.tenant_cap, "k1", step.key_cap, epoch=tenant.epoch, now_ms=step.now
            )
            if step.want == "held":
                assert isinstance(got, HeldSlot), (step, got)
                held[step.name] = got
            elif step.want == "none":
                assert got is None
            else:
                assert isinstance(got, SlotRefused) and got.scope == step.want, (step, got)
                assert got.cap == (step.tenant_cap if step.want == "tenant" else step.key_cap)
        elif step.op == "release":
            limiter.release(held[step.name])
            await limiter.wait_released()
        else:
            lost = await limiter.renew(now_ms=step.now)
            assert sorted(n for n, s in held.items() if s in lost) == list(step.lost)
            assert reported == ([len(lost)] if lost else [])
            reported.clear()
            await limiter.wait_released()
        ids = {name: slot.slot_id for name, slot in held.items()}
        assert await live(redis_client, layout.slots("acme"), ids) == step.tenant_set, step
        assert await live(redis_client, layout.key_slots("acme", "k1"), ids) == step.key_set, step
    await limiter.close()


async def test_a_set_expires_with_its_last_lease(redis_client: aioredis.Redis) -> None:
    limiter = ConcurrencyLimiter(redis_client, P, 5.0)
    slot = await limiter.acquire("acme", 3)
    assert isinstance(slot, HeldSlot)
    ttl_ms = await redis_client.pttl(KeyLayout(P).slots("acme"))
    assert 4_000 < ttl_ms <= 5_002
    limiter.release(slot)
    await limiter.wait_released()
    assert not await redis_client.exists(KeyLayout(P).slots("acme"))  # the last release deletes it
    await limiter.close()


async def test_a_slot_racing_the_tenants_deletion_leaves_nothing(redis_client: aioredis.Redis) -> None:
    store = TenantStore(redis_client, P, b"pepper")
    tenant = await store.create(TenantCreate(id="gone", name="g", priority_class="standard"))
    issued = await store.issue_key("gone", terms=KeyCreate(max_concurrent_requests=2))
    limiter = ConcurrencyLimiter(redis_client, P, LEASE_S)
    slot = await limiter.acquire("gone", 4, issued.key_id, 2, epoch=tenant.epoch)
    assert isinstance(slot, HeldSlot) and len(slot.sets) == 2
    assert len(await lasting_async(redis_client, "*gone*")) > 0
    await store.delete("gone")  # both slot sets go with the tenant
    assert await lasting_async(redis_client, "*gone*") == []
    with pytest.raises(TenantNotFoundError):  # a request that saw the old tenant takes nothing
        await limiter.acquire("gone", 4, issued.key_id, 2, epoch=tenant.epoch)
    assert await limiter.renew() == [slot]  # the renewal creates nothing: the slot is lost
    limiter.release(slot)
    await limiter.wait_released()
    assert await lasting_async(redis_client, "*gone*") == []
    # re-created under the same id: a fresh epoch and empty slot sets
    fresh = await store.create(TenantCreate(id="gone", name="g", priority_class="standard"))
    assert isinstance(await limiter.acquire("gone", 1, epoch=fresh.epoch), HeldSlot)
    await limiter.close()
    assert await redis_client.zcard(KeyLayout(P).slots("gone")) == 0  # close released it


async def test_the_renewal_task_keeps_slots_past_their_lease(redis_client: aioredis.Redis) -> None:
    """On the server's clock: a 1 s lease renewed every 1/3 s holds for 2.5 s; a replica that stops renewing
    (its limiter closed without releasing: slots removed from its memory only) loses them within the lease."""
    holder = ConcurrencyLimiter(redis_client, P, 1.0)
    other = ConcurrencyLimiter(redis_client, P, 1.0)
    slot = await holder.acquire("acme", 1)
    assert isinstance(slot, HeldSlot)
    await asyncio.sleep(2.5)
    assert isinstance(await other.acquire("acme", 1), SlotRefused)
    assert holder.held == 1
    # the holder dies: its renewal stops, and nothing releases the slot
    assert holder._renewer is not None
    holder._renewer.cancel()
    died = time.monotonic()
    while not isinstance(taken := await other.acquire("acme", 1), HeldSlot):
        assert time.monotonic() - died < 3.0, "the dead holder's slot did not come back"
        await asyncio.sleep(0.05)
    assert time.monotonic() - died <= 1.0 + 0.3  # within the lease (+ polling)
    other.release(taken)
    await other.close()


async def test_many_slots_renew_in_batches(redis_client: aioredis.Redis) -> None:
    limiter = ConcurrencyLimiter(redis_client, P, LEASE_S)
    slots = await asyncio.gather(*(limiter.acquire("big", 2000, "k", 1500, now_ms=0) for _ in range(1200)))
    held = [s for s in slots if isinstance(s, HeldSlot)]
    assert len(held) == 1200 and limiter.held == 1200
    assert await limiter.renew(now_ms=59_000) == []  # three script calls of at most 500 slots
    members = await redis_client.zrange(KeyLayout(P).key_slots("big", "k"), 0, -1, withscores=True)
    scores = {score for _, score in members}
    assert scores == {59_000 + LEASE_S * 1000}
    await limiter.close()
    assert await lasting_async(redis_client, f"{P}*slots*") == []
