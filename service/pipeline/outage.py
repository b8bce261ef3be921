"""The ``open`` Redis outage policy (``redis.on_outage = open``): what a replica does while Redis cannot be
reached, and how it returns.

Under ``closed`` (the default) there is no :class:`OutageMode`: a request that needs Redis gets 503
``store_unavailable``. Under ``open`` a replica enters outage mode when a call of the request path fails
with :class:`tenancy.errors.StoreUnavailable` (authentication or admission) or when its Redis watcher's
ping fails (:mod:`service.observability.redis_watch`), and leaves it when the watcher's ping succeeds
again. In outage mode it asks Redis nothing on a request's path:

- **authentication**: a key this replica authenticated from Redis within ``redis.outage_auth_stale_s`` is
  accepted from memory (:class:`tenancy.stale_auth.StaleKeys`, its secret checked in constant time); a key
  it knows revoked gets 401; an unknown key 503 (never admitted blind);
- **admission**: from the replica's own token buckets (:class:`policies.outage_buckets.OutageBuckets`),
  one per bucket the request would have taken from in Redis (its key's, its tenant's for its model, its
  tenant's own; requests and tokens), each holding the limit divided by the live replicas this replica last
  saw (:class:`service.workers.replicas.ReplicaRegistry`): N replicas admit at most the tenant's rate plus
  one burst together. A concurrency cap is shared the same way (``floor(cap / N)`` in flight here; none:
  503). A request that takes from a budget is refused with 503 (its spend cannot be checked), as is one
  of a tenant whose budgets this replica never read;
- **settle**: a request admitted locally gives its unused units back to the local buckets, and its usage
  goes to the :class:`service.pipeline.outage_ledger.OutageLedger`, handed to the settler once Redis
  answers (its usage recorded once; no bucket charged).

``redis_outage_mode_entered`` and ``redis_outage_mode_left`` (structlog) mark each outage, and
``radixgate_redis_outage_mode`` is 1 during it (:mod:`service.observability.outage_metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from policies.outage_buckets import LocalWant, OutageBuckets, concurrency_share, replica_share
from policies.rate_limits import BucketLevel
from service.config.redis import RedisSettings
from service.config.settings import Settings
from service.errors import RateLimited
from service.observability.metrics import GatewayMetrics
from service.observability.redis_watch import RedisReachability
from service.pipeline.billing import Billing
from service.pipeline.outage_ledger import OutageLedger
from service.pipeline.prepare import PreparedRequest
from service.pipeline.settlement import Settlement, Settler
from tenancy.concurrency import RETRY_AFTER_S, HeldSlot
from tenancy.errors import StoreUnavailable
from tenancy.layout import BucketName
from tenancy.models import ApiKeyRecord, BucketLimits, Tenant
from tenancy.quota import QuotaDecision, Reservation, Scope
from tenancy.stale_auth import StaleKeys

log = structlog.get_logger("radixgate.redis")


def outage_refusal(operation: str, why: str) -> StoreUnavailable:
    """The 503 ``store_unavailable`` of a request that outage mode does not admit (``why`` is logged)."""
    return StoreUnavailable(operation, ConnectionError(f"Redis is out of reach: {why}"))


class OutageMode:
    """One replica's outage mode under ``redis.on_outage = open``.

    Args:
        settings: the Redis settings (``outage_auth_stale_s``, ``outage_buckets``, ``auth_cache_entries``).
        metrics: the app's metrics (:class:`service.observability.outage_metrics.OutageMetrics`).
        replicas: the number of live replicas this replica last saw, itself included.
        billing: the budgets and prices last read (no Redis call).
        settler: lands the ledger's sums once Redis is back.
        pepper: the HMAC key of API-key digests.
        clock: monotonic clock, s.
    """

    def __init__(
        self,
        settings: RedisSettings,
        metrics: GatewayMetrics,
        replicas: Callable[[], int],
        billing: Billing,
        settler: Settler,
        pepper: bytes,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics.outage
        self._replicas = replicas
        self._billing = billing
        self._settler = settler
        self._clock = clock
        self.keys = StaleKeys(settings.outage_auth_stale_s, settings.auth_cache_entries, pepper, clock)
        self.buckets = OutageBuckets(settings.outage_buckets)
        self.ledger = OutageLedger()
        self._in_flight: dict[tuple[str, str], int] = {}
        self.active = False
        self._since = 0.0
        self._counts: dict[str, int] = {}
        self._metrics.mode.set(0)

    # -- entering and leaving ------------------------------------------------------------------------
    def enter(self, cause: BaseException | str) -> None:
        """Enter outage mode (nothing when in it): ``redis_outage_mode_entered`` and the gauge."""
        if self.active:
            return
        self.active, self._since, self._counts = True, self._clock(), {}
        self._metrics.mode.set(1)
        log.warning(
            "redis_outage_mode_entered",
            policy="open",
            cause=cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}",
            replicas=self._replicas(),
            auth_stale_s=self.keys.stale_s,
        )

    def leave(self) -> None:
        """Leave outage mode (nothing when not in it): ``redis_outage_mode_left`` with what it decided, and
        the ledger handed to the settler."""
        if not self.active:
            return
        self.active = False
        self._metrics.mode.set(0)
        pending = self.ledger.requests
        log.info(
            "redis_outage_mode_left",
            down_s=round(self._clock() - self._since, 3),
            served_requests=pending,
            **self._counts,
        )
        self.flush()

    def reachability(self, reachable: bool) -> None:
        """The Redis watcher's outcome of one ping: a success leaves outage mode, a failure enters it."""
        if reachable:
            self.leave()
        else:
            self.enter("redis_watch: ping failed")

    def flush(self) -> None:
        """Hand every sum of the ledger to the settler (each in a task of its own; retried or journaled by
        it when Redis is short again)."""
        for item in self.ledger.take():
            self._settler.start(item.reservation.tenant_id, self._settler.settle(item))

    def _count(self, what: str) -> None:
        self._counts[what] = self._counts.get(what, 0) + 1

    # -- authentication ------------------------------------------------------------------------------
    def remember(self, presented: str, tenant: Tenant, record: ApiKeyRecord) -> None:
        """A key Redis (or the auth cache, within its TTL) has just accepted."""
        self.keys.remember(presented, tenant, record)

    def refused_by_redis(self, presented: str) -> None:
        """A key Redis has just refused (:meth:`StaleKeys.refused_by_redis`)."""
        self.keys.refused_by_redis(presented)

    def authenticate(self, presented: str) -> tuple[Tenant, ApiKeyRecord] | None:
        """Authenticate ``presented`` from memory (:meth:`StaleKeys.lookup`): its tenant and record, or None
        (401: wrong secret, malformed, known revoked).

        Raises:
            StoreUnavailable: the key was not authenticated here within ``redis.outage_auth_stale_s``.
        """
        answer = self.keys.lookup(presented)
        if answer == "unknown":
            self._metrics.authentications.labels("unknown").inc()
            self._count("unknown_keys")
            raise outage_refusal("OutageMode.authenticate", "an API key not authenticated here recently")
        if answer == "refused":
            self._metrics.authentications.labels("refused").inc()
            return None
        self._metrics.authentications.labels("accepted").inc()
        return answer

    # -- admission -----------------------------------------------------------------------------------
    def _refuse(self, why: str) -> StoreUnavailable:
        self._metrics.admissions.labels("refused").inc()
        self._count("refused")
        return outage_refusal("OutageMode.admit", why)

    def take_slot(self, prepared: PreparedRequest) -> HeldSlot | None:
        """A local concurrency slot for a capped tenant or key: its share of the cap here (None: no cap).

        Raises:
            StoreUnavailable: the share here is 0 (fewer slots than live replicas).
            RateLimited: the share is in flight (``concurrency_limit_exceeded``).
        """
        tenant, key = prepared.tenant, prepared.key
        caps = []
        if tenant.max_concurrent_requests is not None:
            caps.append((("tenant", tenant.id), tenant.max_concurrent_requests))
        if key is not None and key.max_concurrent_requests is not None:
            caps.append((("key", key.key_id), key.max_concurrent_requests))
        if not caps:
            return None
        n = self._replicas()
        for held, cap in caps:
            share = concurrency_share(cap, n)
            if share == 0:
                raise self._refuse("a concurrency cap smaller than the live replicas")
            if self._in_flight.get(held, 0) >= share:
                self._metrics.admissions.labels("rate_limited").inc()
                self._count("rate_limited")
                raise RateLimited(
                    f"Concurrency limit reached: this replica's share ({share} of {cap}) of the concurrent "
                    f"requests is in flight while the shared store is out of reach. Retry after "
                    f"{RETRY_AFTER_S} s.",
                    code="concurrency_limit_exceeded",
                    retry_after_s=RETRY_AFTER_S,
                )
        for held, _ in caps:
            self._in_flight[held] = self._in_flight.get(held, 0) + 1
        return HeldSlot(f"local-{prepared.rid}", tenant.id, tuple(f"{k}:{n}" for (k, n), _ in caps))

    def release_slot(self, slot: HeldSlot) -> None:
        """Give back a slot of :meth:`take_slot`."""
        for name in slot.sets:
            kind, _, ident = name.partition(":")
            held = (kind, ident)
            left = self._in_flight.get(held, 0) - 1
            if left > 0:
                self._in_flight[held] = left
            else:
                self._in_flight.pop(held, None)

    def _wants(
        self, reservation: Reservation, requests: float, tokens: float
    ) -> tuple[list[LocalWant], list[tuple[Scope | None, BucketName]]]:
        """The local buckets of ``reservation``'s buckets in Redis (its scopes', then its tenant's), with
        this replica's share of each, and whose each is."""
        n = self._replicas()
        wants: list[LocalWant] = []
        owners: list[tuple[Scope | None, BucketName]] = []
        base = (reservation.tenant_id, reservation.epoch)
        scoped: list[tuple[Scope | None, BucketLimits]] = [(s, s.limits) for s in reservation.scopes]
        for scope, limits in [*scoped, (None, reservation.quotas)]:
            name = ("tenant", "") if scope is None else (scope.kind, scope.name)
            if limits.requests_per_min is not None and limits.effective_request_burst is not None:
                share = replica_share(limits.requests_per_min, limits.effective_request_burst, n)
                wants.append(LocalWant((*base, *name, "requests"), share, requests))
                owners.append((scope, "requests"))
            if limits.tokens_per_min is not None and limits.effective_token_burst is not None:
                share = replica_share(limits.tokens_per_min, limits.effective_token_burst, n)
                wants.append(LocalWant((*base, *name, "tokens"), share, tokens))
                owners.append((scope, "tokens"))
        return wants, owners

    def admit(self, prepared: PreparedRequest, reservation: Reservation) -> QuotaDecision:
        """Decide ``prepared`` from the local buckets; ``reservation`` is what it would take (1 request and
        its tokens, its scopes), marked ``local``. Admitted, its units are taken here.

        Returns:
            The decision; refused by a bucket short here: ``retry_after_s`` says when this replica's share
            holds enough, ``limiting`` and ``scope`` name it (a 429).

        Raises:
            StoreUnavailable: the request takes from a budget, or its tenant's budgets were never read
                here, or it is larger than this replica's share of a burst (503: decided once Redis is
                back).
        """
        key = prepared.key
        budgets = self._billing.cache.last_known(prepared.tenant.id)
        if budgets is None or budgets.any_for(key.key_id if key is not None else None):
            raise self._refuse("a request with a budget, or of a tenant whose budgets are not known here")
        wants, owners = self._wants(reservation, reservation.requests, reservation.tokens)
        taken = self.buckets.take(wants, self._clock() * 1000.0)
        levels = tuple(
            BucketLevel(bucket, w.limit.rate_per_min, w.limit.capacity, level)
            for w, (_, bucket), level in zip(wants, owners, taken.levels, strict=True)
        )
        tenant_own = [lv for (scope, _), lv in zip(owners, levels, strict=True) if scope is None]
        remaining: dict[str, float] = {lv.bucket: lv.level for lv in tenant_own}
        if taken.allowed:
            self._metrics.admissions.labels("admitted").inc()
            self._count("admitted")
            return QuotaDecision(True, False, 0.0, None, remaining, levels=levels)
        if taken.never:
            raise self._refuse("a request larger than this replica's share of a burst")
        assert taken.limiting is not None
        scope, bucket = owners[taken.limiting]
        self._metrics.admissions.labels("rate_limited").inc()
        self._count("rate_limited")
        return QuotaDecision(
            False, False, taken.wait_ms / 1000.0, bucket, remaining, scope=scope, levels=levels
        )

    # -- settle --------------------------------------------------------------------------------------
    def settle(self, item: Settlement) -> None:
        """Settle a request admitted here: its unused units back to the local buckets (all of them when it
        was not charged), its usage to the ledger, handed over at once when Redis is back already."""
        r = item.reservation
        if item.used_tokens is None:
            wants, _ = self._wants(r, r.requests, r.tokens)
        else:
            wants, _ = self._wants(r, 0, r.tokens - item.used_tokens)
        self.buckets.give_back(wants, self._clock() * 1000.0)
        self.ledger.add(item)
        if not self.active:
            self.flush()


def outage_policy(
    settings: Settings,
    metrics: GatewayMetrics,
    replicas: Callable[[], int],
    billing: Billing,
    settler: Settler,
    reach: RedisReachability,
) -> OutageMode | None:
    """The replica's :class:`OutageMode` under ``redis.on_outage = open``, told the Redis watcher's
    outcomes (``reach``); None under ``closed``."""
    if settings.redis.on_outage != "open":
        return None
    pepper = settings.key_pepper.get_secret_value().encode()
    outage = OutageMode(settings.redis, metrics, replicas, billing, settler, pepper)
    reach.on_outcome = outage.reachability
    return outage


__all__ = ["OutageMode", "outage_policy", "outage_refusal"]
