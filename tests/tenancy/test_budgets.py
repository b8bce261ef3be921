"""Budgets and usage by day in Redis (tenancy/budgets.py, token_bucket.lua mode budget, settle.lua): a hard
limit admits exactly what fits among concurrent reservations, a settle brings a reservation down to the real
cost, a soft limit is told once per period, day rows are bounded, money never overflows, delete takes
it all."""

from __future__ import annotations

import asyncio
import time
from datetime import date
from typing import Any

import pytest
import redis.asyncio as aioredis

from policies.billing_periods import utc_day
from policies.pricing import ModelPrice, request_cost, worst_case_cost
from tenancy.billing import BudgetHold, UsageRow
from tenancy.budgets import Budget, BudgetCache, BudgetSpec, BudgetStore
from tenancy.errors import TenantNotFoundError
from tenancy.layout import KeyLayout
from tenancy.models import Quotas, TenantCreate
from tenancy.quota import QuotaLimiter, Reservation
from tenancy.store import TenantStore
from tenancy.usage_periods import UsagePeriods, grouped
from tests.support.leftovers import lasting_async

PREFIX = "bud:"
NOW = time.time() // 86_400 * 86_400 + 43_200  # noon UTC today: the clock of these tests
DAY = utc_day(NOW).isoformat()
MONTH = DAY[:7]
PRICE = ModelPrice(input=150_000, cached_input=75_000, output=600_000)
WORST = worst_case_cost(PRICE, 100, 50)  # 100 prompt tokens, max_tokens 50
REAL = request_cost(PRICE, 100, 40, 20)  # 40 of them cached, 20 generated


async def _tenant(redis: aioredis.Redis, tenant_id: str, quotas: Quotas | None = None) -> str:
    store = TenantStore(redis, PREFIX, b"pepper")
    spec = TenantCreate(priority_class="standard", id=tenant_id, name=tenant_id, quotas=quotas or Quotas())
    return (await store.create(spec)).epoch


def _parts(redis: aioredis.Redis) -> tuple[QuotaLimiter, BudgetStore]:
    quota = QuotaLimiter(redis, PREFIX, clock=lambda: NOW)
    return quota, BudgetStore(redis, PREFIX, clock=lambda: NOW)


async def test_hard_limit_admits_exactly_what_fits_and_settle_brings_it_to_the_real_cost(
    redis_client: aioredis.Redis,
) -> None:
    epoch = await _tenant(redis_client, "hard")
    quota, budgets = _parts(redis_client)
    budget = Budget("day", None, int(WORST * 5.5))
    hold = budgets.hold("hard", "tenant", "", budget, WORST, NOW)
    quotas = Quotas(requests_per_min=0.001, request_burst=1000)  # no refill to blur the count
    # 20 concurrent requests, each holding its worst case: exactly 5 fit under 5.5 worst cases
    decisions = await asyncio.gather(
        *(quota.reserve("hard", quotas, 150, epoch=epoch, budgets=(hold,)) for _ in range(20))
    )
    admitted = [d for d in decisions if d.allowed]
    assert len(admitted) == 5
    refused = [d for d in decisions if not d.allowed]
    assert all(d.budget is not None and d.budget.hold == hold for d in refused)
    assert {d.budget.used for d in refused if d.budget} == {5 * WORST}
    spend = await budgets.spend("hard", "tenant", "", budget)
    assert (spend.used, spent_then := spend.spent) == (5 * WORST, 0)
    assert spend.used <= budget.hard  # never past the limit: the reservations are the in-flight part
    # a refused request took nothing: 5 requests out of the bucket, not 20
    levels = await quota.adjust("hard", quotas, requests=0.001, epoch=epoch)
    assert levels["requests"] == pytest.approx(995, abs=0.01)
    # each settles at its real cost: used comes down to what was spent
    reservation = Reservation("hard", quotas, 1, 150, epoch, budgets=(hold,), price=PRICE)
    usage = {"requests": 1, "prompt_tokens": 100, "cached_tokens": 40, "completion_tokens": 20, "cost": REAL}
    for i in range(5):
        assert await quota.settle(reservation, 120, usage, once=(f"hard-{i}", 60))
    spend = await budgets.spend("hard", "tenant", "", budget)
    assert (spend.used, spend.spent) == (5 * REAL, 5 * REAL)
    assert spent_then == 0
    # the room the real costs left admits more: (5.5 W - 5 R) // W
    more = await asyncio.gather(
        *(quota.reserve("hard", quotas, 150, epoch=epoch, budgets=(hold,)) for _ in range(10))
    )
    assert sum(d.allowed for d in more) == (int(WORST * 5.5) - 5 * REAL) // WORST
    # a failed request gives its whole worst case back
    before = await budgets.spend("hard", "tenant", "", budget)
    assert await quota.settle(reservation, None, {"errors": 1}, once=("hard-failed", 60))
    after = await budgets.spend("hard", "tenant", "", budget)
    assert (after.used, after.spent) == (before.used - WORST, before.spent)
    # a retried settle lands once
    assert await quota.settle(reservation, 120, usage, once=("hard-0", 60))
    assert (await budgets.spend("hard", "tenant", "", budget)).spent == after.spent


async def test_soft_limit_is_told_once_per_period(redis_client: aioredis.Redis) -> None:
    epoch = await _tenant(redis_client, "soft")
    quota, budgets = _parts(redis_client)
    told: list[tuple[str, BudgetHold]] = []
    quota.on_soft_limit = lambda tenant, hold: told.append((tenant, hold))
    budget = Budget("month", 2 * REAL, None)  # soft only: nothing is ever refused
    hold = budgets.hold("soft", "tenant", "", budget, WORST, NOW)
    assert hold.period_id == MONTH
    reservation = Reservation("soft", Quotas(), 1, 150, epoch, budgets=(hold,), price=PRICE)
    for i in range(5):
        assert (await quota.reserve("soft", Quotas(), 150, epoch=epoch, budgets=(hold,))).allowed
        assert await quota.settle(reservation, 120, {"cost": REAL}, once=(f"soft-{i}", 60))
        assert len(told) == (0 if i == 0 else 1)  # the second settle reached 2 x REAL
    assert told == [("soft", hold)]
    assert (await budgets.spend("soft", "tenant", "", budget)).soft_reached


async def test_day_rows_sum_to_totals_are_bounded_and_money_carries(redis_client: aioredis.Redis) -> None:
    epoch = await _tenant(redis_client, "rows")
    quota = QuotaLimiter(redis_client, PREFIX, max_usage_rows=3, clock=lambda: NOW)
    periods = UsagePeriods(redis_client, PREFIX)
    reservation = Reservation("rows", Quotas(), 1, 10, epoch)
    for i in range(5):  # five key x model pairs into a day that keeps three
        row = UsageRow(DAY, f"k{i}", "m/a:b", 1, 10, 2, 3, 1000 + i)
        assert await quota.settle(reservation, 13, {"requests": 1, "cost": row.cost}, rows=(row,))
    rows = await periods.rows("rows", [date.fromisoformat(DAY)])
    assert [(r.key_id, r.model) for r in rows] == [
        ("_other", "_other"),
        ("k0", "m/a:b"),
        ("k1", "m/a:b"),
        ("k2", "m/a:b"),
    ]
    total = grouped(rows, [])[0]
    assert (total["requests"], total["cost_picodollars"]) == (5, 5010)
    assert await periods.cost("rows") == 5010
    # a lifetime total past $1M carries into its own field: exact, never an overflow
    big = 9 * 10**17
    for _ in range(3):
        assert await quota.settle(reservation, 13, {"cost": big})
    assert await periods.cost("rows") == 5010 + 3 * big
    raw = await redis_client.hgetall(KeyLayout(PREFIX).usage("rows"))
    assert int(raw["cost"]) < 10**18 and raw["carry:cost"] == "2"
    # the day's hash expires after the retention, and is in the tenant's billing index
    ttl = await redis_client.ttl(KeyLayout(PREFIX).usage_day("rows", DAY))
    assert 400 * 86_400 - 10 < ttl - (NOW - time.time()) <= 400.5 * 86_400 + 2  # TTL is whole seconds


async def test_budget_store_bounds_and_cache(redis_client: aioredis.Redis) -> None:
    await _tenant(redis_client, "store")
    store = BudgetStore(redis_client, PREFIX, clock=lambda: NOW)
    t = [0.0]
    cache = BudgetCache(store, ttl_s=1.0, clock=lambda: t[0])
    assert (await cache.get("store")).tenant is None
    await store.set("store", "tenant", "", Budget.of(BudgetSpec(period="day", hard_limit_usd=2.5)))
    assert cache.fresh("store") is not None and cache.fresh("store").tenant is None  # type: ignore[union-attr]
    cache.on_invalidation("budget:store")  # what every replica hears
    loaded = await cache.get("store")
    assert loaded.tenant == Budget("day", None, 2_500_000_000_000)
    # a stale entry is read once, however many requests find it stale at once
    loads = 0
    real_load = store.load

    async def counted(tenant_id: str) -> Any:
        nonlocal loads
        loads += 1
        return await real_load(tenant_id)

    store.load = counted  # type: ignore[method-assign]
    t[0] += 5
    got = await asyncio.gather(*(cache.get("store") for _ in range(64)))
    assert loads == 1 and all(g == loaded for g in got)
    with pytest.raises(TenantNotFoundError):
        await store.set("nobody", "tenant", "", Budget("day", None, 1))
    bad = [
        {"period": "week", "hard_limit_usd": 1},
        {"period": "day"},
        {"period": "day", "hard_limit_usd": 1.0000001},
        {"period": "day", "hard_limit_usd": -1},
        {"period": "day", "hard_limit_usd": 1e7},
        {"period": "day", "soft_limit_usd": 2, "hard_limit_usd": 1},
        {"period": "day", "hard_limit_usd": "1"},
        {"period": "day", "hard_limit_usd": 1, "extra": 1},
    ]
    for body in bad:
        with pytest.raises(ValueError):
            BudgetSpec.model_validate(body)


async def test_delete_removes_budgets_spend_and_day_rows(redis_client: aioredis.Redis) -> None:
    epoch = await _tenant(redis_client, "gone")
    store = TenantStore(redis_client, PREFIX, b"pepper")
    key = await store.issue_key("gone")
    quota, budgets = _parts(redis_client)
    await budgets.set("gone", "tenant", "", Budget("day", 1, 10**15))
    await budgets.set("gone", "key", key.key_id, Budget("month", None, 10**15))
    holds = (
        budgets.hold("gone", "key", key.key_id, Budget("month", None, 10**15), WORST, NOW),
        budgets.hold("gone", "tenant", "", Budget("day", 1, 10**15), WORST, NOW),
    )
    assert (await quota.reserve("gone", Quotas(), 150, epoch=epoch, budgets=holds)).allowed
    row = UsageRow(DAY, key.key_id, "m", 1, 100, 40, 20, REAL)
    reservation = Reservation("gone", Quotas(), 1, 150, epoch, budgets=holds, price=PRICE)
    assert await quota.settle(reservation, 120, {"requests": 1, "cost": REAL}, rows=(row,))
    owned = [k async for k in redis_client.scan_iter(match="*gone*")]
    layout = KeyLayout(PREFIX)
    assert {layout.budgets("gone"), layout.usage_day("gone", DAY), layout.billing_index("gone")} <= set(owned)
    assert layout.spend("gone", f"key:{key.key_id}", MONTH) in owned
    await store.delete("gone")
    assert await lasting_async(redis_client, "*gone*") == []
    assert await lasting_async(redis_client, f"*{key.key_id}*") == []
