"""Budgets per tenant and per API key over a UTC period (day or month), in Redis, and a replica's short-lived
memory of them (:class:`BudgetCache`).

A budget has a soft limit (crossing it is told once per period: a metric and a log event) and a hard limit
(a request whose worst-case cost would take the period's spend past it is refused, 429
``insufficient_quota``). Its spend in a period is a hash (``P spend:<id>:<scope>:<period>``): ``used``, the
worst-case costs of the requests in flight plus the real costs of those settled, which admission checks
against the hard limit and takes from in the same atomic call as the token buckets (``token_bucket.lua``,
mode ``budget``); ``spent``, the real costs settled; ``soft``, set once the soft limit was crossed. A settle
replaces a request's worst case by its real cost (``settle.lua``), so concurrent requests never take the
spend past the hard limit by more than the real costs' overrun of their worst cases (none, unless a worker
reports more prompt tokens than the gateway counted).

The budgets of a tenant are one hash (``P budgets:<id>``: field ``tenant`` and ``key:<key_id>`` -> JSON). A
write publishes ``budget:<tenant>`` on the invalidation channel of :mod:`tenancy.auth_cache`: every
replica drops its memory of that tenant's budgets at once; a lost message costs at most ``ttl_s``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import structlog
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from redis.exceptions import RedisClusterException, RedisError

from policies.billing_periods import Period, PeriodWindow, period_window
from policies.pricing import pico_to_usd, usd_to_pico
from tenancy.auth_cache import invalidation_channel
from tenancy.billing import SPEND_RETENTION_S, BudgetHold, BudgetScope
from tenancy.errors import CallObserver, TenantNotFoundError, store_operation
from tenancy.layout import KeyLayout
from tenancy.redis_client import RedisClient

log = structlog.get_logger("radixgate.budgets")

MAX_BUDGET_USD = 5_000_000
"""Largest soft or hard limit an admin may set, USD per period (a spend counter holds up to about $9.2M in
picodollars; the rest is headroom for the requests in flight)."""

MAX_KEY_BUDGETS = 1000
"""Most API keys of one tenant with a budget of their own (a replica reads them all with the tenant's)."""


class BudgetSpec(BaseModel):
    """An admin's budget (``PUT /admin/tenants/{id}/budget``, ``.../keys/{key_id}/budget``).

    Attributes:
        period: ``day`` or ``month`` (UTC).
        soft_limit_usd: crossing it is told once per period (metric, log event); None: none.
        hard_limit_usd: a request whose worst-case cost would take the period's spend past it is refused
            (429 ``insufficient_quota``); None: none.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    period: Period = Field(description="'day' or 'month' (UTC).")
    soft_limit_usd: float | None = Field(
        None, ge=0, le=MAX_BUDGET_USD, description="USD per period; crossing it is logged once. None: none."
    )
    hard_limit_usd: float | None = Field(
        None,
        ge=0,
        le=MAX_BUDGET_USD,
        description="USD per period; a request that could pass it is refused (429 insufficient_quota).",
    )

    @field_validator("soft_limit_usd", "hard_limit_usd")
    @classmethod
    def _whole_micro_dollars(cls, value: float | None) -> float | None:
        if value is not None:
            usd_to_pico(value, "a budget limit")
        return value

    @model_validator(mode="after")
    def _a_limit(self) -> BudgetSpec:
        if self.soft_limit_usd is None and self.hard_limit_usd is None:
            raise ValueError("a budget needs soft_limit_usd, hard_limit_usd or both")
        if (
            self.soft_limit_usd is not None
            and self.hard_limit_usd is not None
            and self.soft_limit_usd > self.hard_limit_usd
        ):
            raise ValueError("soft_limit_usd is above hard_limit_usd: it would never be reached")
        return self


@dataclass(frozen=True, slots=True)
class Budget:
    """A stored budget, limits in picodollars."""

    period: Period
    soft: int | None
    hard: int | None

    @classmethod
    def of(cls, spec: BudgetSpec) -> Budget:
        """From an admin's spec."""
        soft = None if spec.soft_limit_usd is None else usd_to_pico(spec.soft_limit_usd)
        hard = None if spec.hard_limit_usd is None else usd_to_pico(spec.hard_limit_usd)
        return cls(spec.period, soft, hard)

    def dump(self) -> dict[str, Any]:
        """What the admin routes show (dollars) of it."""
        return {
            "period": self.period,
            "soft_limit_usd": None if self.soft is None else pico_to_usd(self.soft),
            "hard_limit_usd": None if self.hard is None else pico_to_usd(self.hard),
        }


class TenantBudgets(NamedTuple):
    """A tenant's budgets: its own, and its keys' by key id."""

    tenant: Budget | None
    keys: dict[str, Budget]

    def any_for(self, key_id: str | None) -> bool:
        """Whether a request of API key ``key_id`` takes from a budget."""
        return self.tenant is not None or (key_id is not None and key_id in self.keys)


NO_BUDGETS = TenantBudgets(None, {})


def _field(scope: BudgetScope, key_id: str) -> str:
    return "tenant" if scope == "tenant" else f"key:{key_id}"


def _spend_scope(scope: BudgetScope, key_id: str) -> str:
    return "tenant" if scope == "tenant" else f"key:{key_id}"


@dataclass(frozen=True, slots=True)
class Spend:
    """A budget's spend in one period, picodollars: ``used`` (in flight included), ``spent`` (settled),
    whether its soft limit was crossed."""

    window: PeriodWindow
    used: int
    spent: int
    soft_reached: bool

    def dump(self) -> dict[str, Any]:
        """What the admin routes show (dollars)."""
        return {
            "period_id": self.window.id,
            "period_start": int(self.window.start_s),
            "period_end": int(self.window.end_s),
            "spent_usd": pico_to_usd(self.spent),
            "in_flight_usd": pico_to_usd(max(0, self.used - self.spent)),
            "spent_picodollars": self.spent,
            "soft_limit_reached": self.soft_reached,
        }


_SET = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return -1
end
if ARGV[1] ~= 'tenant' and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0
    and redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[3]) then
  return 0
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""
"""KEYS[1] tenant record, KEYS[2] its budgets; ARGV field, JSON, most fields: -1 no tenant, 0 too many."""


class BudgetStore:
    """Budgets and their spend in Redis.

    Args:
        redis: async client (``decode_responses=True``).
        prefix: RedisClient key prefix.
        clock: unix time, s (which period is now; test hook).
    """

    observe_call: CallObserver | None = None

    def __init__(self, redis: RedisClient, prefix: str, clock: Callable[[], float] = time.time) -> None:
        self._redis = redis
        self._layout = KeyLayout(prefix)
        self._channel = invalidation_channel(prefix)
        self._set = redis.register_script(_SET)
        self.clock = clock

    @store_operation
    async def load(self, tenant_id: str) -> TenantBudgets:
        """A tenant's budgets (:data:`NO_BUDGETS` when none)."""
        raw = cast(dict[str, str], await self._redis.hgetall(self._layout.budgets(tenant_id)))
        if not raw:
            return NO_BUDGETS
        tenant: Budget | None = None
        keys: dict[str, Budget] = {}
        for field, value in raw.items():
            data = json.loads(value)
            budget = Budget(data["period"], data.get("soft"), data.get("hard"))
            if field == "tenant":
                tenant = budget
            elif field.startswith("key:"):
                keys[field[4:]] = budget
        return TenantBudgets(tenant, keys)

    @store_operation
    async def set(self, tenant_id: str, scope: BudgetScope, key_id: str, budget: Budget) -> None:
        """Set the tenant's budget (``scope`` ``tenant``) or an API key's (the caller checks the key is
        the tenant's), and tell every replica.

        Raises:
            TenantNotFoundError: no such tenant.
            ValueError: the tenant already has :data:`MAX_KEY_BUDGETS` keys with budgets.
        """
        data = json.dumps({"period": budget.period, "soft": budget.soft, "hard": budget.hard})
        keys = [self._layout.tenant(tenant_id), self._layout.budgets(tenant_id)]
        done = await self._set(keys=keys, args=[_field(scope, key_id), data, MAX_KEY_BUDGETS])
        if int(done) == -1:
            raise TenantNotFoundError(tenant_id)
        if int(done) == 0:
            raise ValueError(f"tenant '{tenant_id}' has {MAX_KEY_BUDGETS} keys with budgets already")
        await self._publish(tenant_id)

    @store_operation
    async def clear(self, tenant_id: str, scope: BudgetScope, key_id: str = "") -> bool:
        """Remove a budget (its spend stays until it expires); False when there was none."""
        removed = bool(await self._redis.hdel(self._layout.budgets(tenant_id), _field(scope, key_id)))
        await self._publish(tenant_id)
        return removed

    @store_operation
    async def spend(self, tenant_id: str, scope: BudgetScope, key_id: str, budget: Budget) -> Spend:
        """A budget's spend in the period now."""
        window = period_window(budget.period, self.clock())
        key = self._layout.spend(tenant_id, _spend_scope(scope, key_id), window.id)
        used, spent, soft = await self._redis.hmget(key, ["used", "spent", "soft"])
        return Spend(window, int(used or 0), int(spent or 0), soft is not None)

    def hold(
        self, tenant_id: str, scope: BudgetScope, key_id: str, budget: Budget, amount: int, now_s: float
    ) -> BudgetHold:
        """What a request admitted at unix time ``now_s`` takes from ``budget``: ``amount`` picodollars
        (its worst-case cost) from the spend of the period now."""
        window = period_window(budget.period, now_s)
        return BudgetHold(
            scope,
            key_id if scope == "key" else "",
            budget.period,
            window.id,
            self._layout.spend(tenant_id, _spend_scope(scope, key_id), window.id),
            budget.hard,
            budget.soft,
            amount,
            int(window.end_s) + SPEND_RETENTION_S,
            window.end_s,
        )

    async def _publish(self, tenant_id: str) -> None:
        try:
            await self._redis.publish(self._channel, f"budget:{tenant_id}")
        except (RedisError, RedisClusterException) as exc:
            log.warning("budget_invalidation_not_published", tenant=tenant_id, error=str(exc))


def _retrieved(task: asyncio.Future[TenantBudgets]) -> None:
    if not task.cancelled():
        task.exception()


class BudgetCache:
    """A replica's memory of tenants' budgets: each tenant's read at most every ``ttl_s``, dropped at once
    on ``budget:<id>`` or ``tenant:<id>`` (:meth:`on_invalidation`); at most ``max_entries`` tenants (the
    least recently read go first).

    A tenant without budgets costs one Redis read per ``ttl_s`` per replica, and nothing on its requests'
    path between reads.
    """

    def __init__(
        self,
        store: BudgetStore,
        ttl_s: float,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._max = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[TenantBudgets, float]] = OrderedDict()
        self._generation = 0
        self._loading: dict[str, asyncio.Future[TenantBudgets]] = {}

    def fresh(self, tenant_id: str) -> TenantBudgets | None:
        """The tenant's budgets if known and fresh (no Redis call), else None: call :meth:`get`."""
        entry = self._entries.get(tenant_id)
        if entry is not None and self._clock() < entry[1]:
            return entry[0]
        return None

    def last_known(self, tenant_id: str) -> TenantBudgets | None:
        """The tenant's budgets as last read, fresh or not (no Redis call), or None when none is held:
        what a request admitted while Redis is out of reach is judged by."""
        entry = self._entries.get(tenant_id)
        return entry[0] if entry is not None else None

    async def get(self, tenant_id: str) -> TenantBudgets:
        """The tenant's budgets, read from Redis when not fresh: one read at a time per tenant, which the
        requests that find the entry stale meanwhile wait for (at 64 requests in flight, each expiry sent
        64 reads), in a task of its own (a caller that leaves does not cancel it for the others).

        Raises:
            StoreUnavailable: RedisClient failed.
        """
        found = self.fresh(tenant_id)
        if found is not None:
            return found
        loading = self._loading.get(tenant_id)
        if loading is None:
            loading = self._loading[tenant_id] = asyncio.ensure_future(self._load(tenant_id))
            loading.add_done_callback(_retrieved)  # its callers may all have left
        return await asyncio.shield(loading)

    async def _load(self, tenant_id: str) -> TenantBudgets:
        generation, began = self._generation, self._clock()
        try:
            budgets = await self._store.load(tenant_id)
        finally:
            del self._loading[tenant_id]
        if generation == self._generation and self._ttl_s > 0:  # no invalidation meanwhile
            self._entries[tenant_id] = (budgets, began + self._ttl_s)
            self._entries.move_to_end(tenant_id)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)
        return budgets

    def on_invalidation(self, message: str) -> None:
        """Forget a tenant's budgets after ``budget:<id>`` or ``tenant:<id>``."""
        kind, _, tenant_id = message.partition(":")
        if kind in ("budget", "tenant"):
            self._generation += 1
            self._entries.pop(tenant_id, None)


__all__ = [
    "MAX_BUDGET_USD",
    "NO_BUDGETS",
    "Budget",
    "BudgetCache",
    "BudgetSpec",
    "BudgetStore",
    "Spend",
    "TenantBudgets",
]
