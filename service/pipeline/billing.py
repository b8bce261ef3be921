"""Cost and budgets on the request path: the price a request is reckoned at and the budgets it takes its
worst-case cost from at admission (:meth:`Billing.terms`), its budget refusal (:func:`budget_refusal`), and
what a crossed soft limit tells (:meth:`Billing.soft_limit_reached`).

A tenant without budgets pays two in-memory look-ups per request (its model's price, its budgets, each
read from Redis at most every ``pricing.cache_ttl_s`` per replica) and its requests keep the lease path;
a request that takes from a budget is decided in Redis (one script call with its buckets), like one that
takes from a key's or a model's bucket.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import structlog

from policies.pricing import ModelPrice, pico_to_usd, worst_case_cost
from service.config.settings import Settings
from service.errors import BudgetExhausted
from service.observability.metrics import GatewayMetrics
from service.pipeline.prepare import PreparedRequest
from tenancy.billing import BudgetHold, BudgetRefusal
from tenancy.budgets import BudgetCache, BudgetStore, TenantBudgets
from tenancy.models import Quotas
from tenancy.pricing_store import PriceBook, PriceStore
from tenancy.redis_client import RedisClient
from tenancy.usage import UsageRecorder
from tenancy.usage_periods import UsagePeriods

log = structlog.get_logger("radixgate.budgets")


class Billing:
    """Prices and budgets of one replica.

    Args:
        prices: the admin's prices in Redis.
        book: this replica's price table (settings' defaults, admin's over them).
        budgets: budgets and spend in Redis.
        cache: this replica's memory of tenants' budgets.
        periods: usage by day, API key and model (and the tenant's total cost).
        metrics: the app's metrics.
        clock: unix time, s (the period a request is admitted in).
    """

    def __init__(
        self,
        prices: PriceStore,
        book: PriceBook,
        budgets: BudgetStore,
        cache: BudgetCache,
        periods: UsagePeriods,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.periods = periods
        self.prices = prices
        self.book = book
        self.budgets = budgets
        self.cache = cache
        self._metrics = metrics
        self._clock = clock

    @classmethod
    def build(cls, redis: RedisClient, settings: Settings, metrics: GatewayMetrics) -> Billing:
        """A replica's billing from its settings (``pricing.*``, ``redis.key_prefix``)."""
        prefix, cfg = settings.redis.key_prefix, settings.pricing
        prices = PriceStore(redis, prefix)
        budgets = BudgetStore(redis, prefix)
        periods = UsagePeriods(redis, prefix)
        prices.observe_call = budgets.observe_call = metrics.runtime.observe_store_call
        periods.observe_call = metrics.runtime.observe_store_call
        book = PriceBook(prices, cfg.prices(), cfg.cache_ttl_s)
        cache = BudgetCache(budgets, cfg.cache_ttl_s, settings.redis.auth_cache_entries)
        return cls(prices, book, budgets, cache, periods, metrics)

    async def usage_report(self, usage: UsageRecorder, tenant_id: str, quotas: Quotas) -> dict[str, object]:
        """The usage routes' body (``GET /v1/usage``, the admin's without a range): the tenant's counters,
        ``total_tokens``, its quotas, and its total cost (``cost_usd``, exact in ``cost_picodollars``)."""
        report = (await usage.get(tenant_id)).report(quotas)
        cost = await self.periods.cost(tenant_id)
        return {**report, "cost_usd": pico_to_usd(cost), "cost_picodollars": cost}

    def on_invalidation(self, message: str) -> None:
        """A price or a tenant's budgets changed somewhere (Redis pub/sub)."""
        self.book.on_invalidation(message)
        self.cache.on_invalidation(message)

    def known_terms(self, prepared: PreparedRequest) -> ModelPrice | None:
        """:meth:`terms` answered from memory when it can be (no coroutine on the path of a tenant without
        budgets): the price, when both it and the tenant's budgets are fresh and no budget applies; else
        None (call :meth:`terms`)."""
        price = self.book.fresh(prepared.model_id)
        known = self.cache.fresh(prepared.tenant.id)
        if price is None or known is None:
            return None
        key = prepared.key
        if known.tenant is not None or (key is not None and key.key_id in known.keys):
            return None
        return price

    async def terms(self, prepared: PreparedRequest) -> tuple[ModelPrice, tuple[BudgetHold, ...]]:
        """The price ``prepared`` is reckoned at, and the budgets it takes its worst-case cost from
        (:func:`policies.pricing.worst_case_cost`: its prompt, and ``n x max_tokens`` of completion).

        Raises:
            StoreUnavailable: RedisClient failed while prices or budgets had to be read.
        """
        tenant_id = prepared.tenant.id
        price = self.book.fresh(prepared.model_id)
        if price is None:
            price = await self.book.price(prepared.model_id)
        known = self.cache.fresh(tenant_id)
        budgets = known if known is not None else await self.cache.get(tenant_id)
        key = prepared.key
        key_id = key.key_id if key is not None else None
        if not budgets.any_for(key_id):
            return price, ()
        return price, self._holds(prepared, price, budgets, key_id)

    def _holds(
        self, prepared: PreparedRequest, price: ModelPrice, budgets: TenantBudgets, key_id: str | None
    ) -> tuple[BudgetHold, ...]:
        prompt = prepared.prompt.num_tokens
        worst = worst_case_cost(price, prompt, prepared.reserved_tokens - prompt)
        now_s, tenant_id = self._clock(), prepared.tenant.id
        holds = []
        if key_id is not None and (own := budgets.keys.get(key_id)) is not None:
            holds.append(self.budgets.hold(tenant_id, "key", key_id, own, worst, now_s))
        if budgets.tenant is not None:
            holds.append(self.budgets.hold(tenant_id, "tenant", "", budgets.tenant, worst, now_s))
        return tuple(holds)

    def soft_limit_reached(self, tenant_id: str, hold: BudgetHold) -> None:
        """A settle took ``hold``'s budget to its soft limit (once per period, across replicas): a metric
        and one ``budget_soft_limit_reached`` log event."""
        self._metrics.cost.soft_limit_reached.labels(self._metrics.tenant(tenant_id), hold.scope).inc()
        log.warning(
            "budget_soft_limit_reached",
            tenant=tenant_id,
            scope=hold.scope,
            key_id=hold.name or None,
            period=hold.period,
            period_id=hold.period_id,
            soft_limit_usd=None if hold.soft is None else pico_to_usd(hold.soft),
            hard_limit_usd=None if hold.hard is None else pico_to_usd(hold.hard),
        )

    def refused(self, prepared: PreparedRequest, refusal: BudgetRefusal) -> BudgetExhausted:
        """The 429 ``insufficient_quota`` of a budget over its hard limit (counted), with ``Retry-After``
        until its period ends and the budget named in ``details["budget"]``."""
        hold = refusal.hold
        tenant = prepared.tenant.id
        self._metrics.quota_rejections.labels(
            self._metrics.tenant(tenant), f"{hold.scope}_budget", "insufficient_quota"
        ).inc()
        left = max(0, (hold.hard or 0) - refusal.used)
        err = BudgetExhausted(
            f"You exceeded your current quota: {hold.describe()} of tenant '{tenant}' has "
            f"${pico_to_usd(left):.6f} left of its ${pico_to_usd(hold.hard or 0):.6f} hard limit for "
            f"{hold.period_id} (UTC), and this request may cost up to ${pico_to_usd(hold.amount):.6f} "
            "(its prompt and max_tokens at the model's price). Lower max_tokens, or wait for the next "
            "period.",
            retry_after_s=max(1.0, math.ceil(hold.period_end_s - self._clock())),
        )
        err.details = {"budget": {"scope": hold.scope, "id": hold.name or tenant, "period": hold.period_id}}
        return err
