"""Admission against the shared token buckets through local leases (:mod:`policies.quota_lease`): most
requests of a busy tenant are admitted from units this process already took, with no Redis round trip.

A reservation that the tenant's lease covers is drawn from it in memory. Otherwise one script call
(``token_bucket.lua``, mode ``lease``) gives the old lease's leftover back, takes the request's units
and, when it passes, up to :func:`policies.quota_lease.lease_size` more per bucket as the new lease.
A lease that is not used up goes back to Redis when it expires (a sweeper task that runs only while
leases exist and sleeps until the earliest expiry) or when the gateway stops (:meth:`LeasedQuota.close`).

What a request reserved is settled exactly as before (:meth:`tenancy.quota.QuotaLimiter.settle`):
unused tokens and refused or failed requests go back to the shared bucket, not to the lease.

A request that also takes from an API key's or a model's buckets (``scopes``) bypasses the lease: one
script call takes from all its buckets at once, as without leases. A lease is one replica's units of one
tenant's buckets; leasing a key's or a model's too would take one lease per key and model combination, each
holding units of the tenant's bucket back from the other replicas, and a lease could not say which of its
buckets would have refused. Those buckets are typically small (a key's 60 RPM leases nothing anyway, see
:func:`policies.quota_lease.lease_size`), so they are decided in Redis, exact across replicas.

An admission from a lease reports levels for the rate-limit headers without asking Redis
(:func:`policies.rate_limits.leased_level`): the levels of the tenant's last Redis call on this replica,
refilled since, plus the lease's units still held here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable

import structlog

from policies.quota_lease import QuotaLease, Terms, lease_size
from policies.rate_limits import BucketLevel, leased_level
from tenancy.billing import BudgetHold
from tenancy.errors import StoreUnavailable
from tenancy.layout import BucketName
from tenancy.models import Quotas
from tenancy.quota import QuotaDecision, QuotaLimiter, Scope

log = structlog.get_logger("radixgate.quota_lease")

_ALLOWED = QuotaDecision(True, False, 0.0, None, {}, leased=True)

_Seen = tuple[tuple[BucketLevel, ...], float]
"""The levels of a tenant's buckets at this replica's last Redis call for them (after its take and lease)
and the monotonic time of that call, s."""


def lease_terms(quotas: Quotas, epoch: str | None) -> Terms:
    """The terms a lease is granted under: the tenant's epoch and every limit of its buckets."""
    return (
        epoch,
        quotas.requests_per_min,
        quotas.tokens_per_min,
        quotas.effective_request_burst,
        quotas.effective_token_burst,
    )


def _limit(value: object) -> float:
    return math.inf if value is None else float(value)  # type: ignore[arg-type]


def may_credit(old: Terms, new: Terms) -> bool:
    """Whether a lease granted under ``old`` may give its leftover back to the buckets of ``new``: the
    same tenant (epoch) and no limit lower (a lowered burst already dropped what was above it)."""
    return old[0] == new[0] and all(_limit(n) >= _limit(o) for o, n in zip(old[1:], new[1:], strict=True))


class LeasedQuota:
    """:meth:`reserve` of :class:`QuotaLimiter` served from local leases where it can.

    Args:
        limiter: the shared buckets.
        horizon_s: seconds of a tenant's rate one lease holds at most, s (0: no leases; every
            reservation is one Redis call, as :meth:`QuotaLimiter.reserve`).
        max_fraction: the largest share of a bucket's burst one lease holds (0-1).
        ttl_s: a lease's lifetime, s: then its leftover goes back to the shared bucket.
        clock: monotonic clock, s (test hook).
        on_reserve: called with ``True`` for each reservation admitted from a lease, ``False`` for each
            decided by Redis (metrics).
        before_remote: awaited with the tenant id before a reservation the lease cannot cover goes to
            Redis (the settler sends that tenant's settles still collecting ahead of it, in the same
            write: :meth:`service.pipeline.settlement.Settler.ahead_of_reservation`).
        report_levels: give an admission from a lease the levels this replica sees (for the rate-limit
            headers); False: none (``levels`` empty), nothing computed.

    Counters ``local`` and ``remote`` count the same.
    """

    def __init__(
        self,
        limiter: QuotaLimiter,
        horizon_s: float,
        max_fraction: float,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_reserve: Callable[[bool], None] | None = None,
        before_remote: Callable[[str], Awaitable[None]] | None = None,
        report_levels: bool = True,
    ) -> None:
        self._limiter = limiter
        self._report_levels = report_levels
        self._before_remote = before_remote
        self._horizon_s = horizon_s
        self._max_fraction = max_fraction
        self._ttl_s = ttl_s
        self._clock = clock
        self._on_reserve = on_reserve or (lambda local: None)
        self._leases: dict[str, tuple[QuotaLease, Quotas]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._returns: set[asyncio.Task[None]] = set()
        # tenants with a lease-taking call in flight, each with the event set at its end
        self._asking: dict[str, asyncio.Event] = {}
        self._seen: dict[str, _Seen] = {}  # tenant -> levels at its lease's grant (lease admissions' levels)
        self.local = 0
        self.remote = 0

    @property
    def held(self) -> int:
        """Tenants with a lease held now."""
        return len(self._leases)

    async def reserve(
        self,
        tenant_id: str,
        quotas: Quotas,
        tokens: int,
        epoch: str | None = None,
        scopes: tuple[Scope, ...] = (),
        budgets: tuple[BudgetHold, ...] = (),
    ) -> QuotaDecision:
        """Reserve 1 request and ``tokens`` tokens of ``tenant_id`` (and of its ``scopes``, and the worst
        case of its ``budgets``: then without a lease, see the module, as a budget is checked in Redis);
        as :meth:`QuotaLimiter.reserve` (same decision, same errors:
        ``TenantNotFoundError``, ``StoreUnavailable``), except that an admission from the lease returns
        ``remaining`` empty (Redis was not asked) and ``levels`` as this replica sees them
        (:func:`policies.rate_limits.leased_level`)."""
        if scopes or budgets:
            if self._before_remote is not None:
                await self._before_remote(tenant_id)
            self.remote += 1
            self._on_reserve(False)
            return await self._limiter.reserve(
                tenant_id, quotas, tokens, epoch=epoch, scopes=scopes, budgets=budgets
            )
        terms = lease_terms(quotas, epoch)
        held = self._leases.get(tenant_id)
        if held is not None and held[0].take(terms, 1, tokens, self._clock()):
            return self._from_lease(tenant_id, held[0])
        asking = self._asking.get(tenant_id)
        if asking is not None:
            # a lease is on its way (single flight): its units may admit this request too, without a Redis
            # call of its own (at 64 concurrent requests each renewal sent the other 63 to Redis one by one)
            await asking.wait()
            held = self._leases.get(tenant_id)
            if held is not None and held[0].take(terms, 1, tokens, self._clock()):
                return self._from_lease(tenant_id, held[0])
        if self._before_remote is not None:
            await self._before_remote(tenant_id)
            held = self._leases.get(tenant_id)  # another request may have replaced it meanwhile
            if held is not None and held[0].take(terms, 1, tokens, self._clock()):
                return self._from_lease(tenant_id, held[0])
        self.remote += 1
        self._on_reserve(False)
        asks: dict[BucketName, tuple[float, float]] = {}
        extra_requests = lease_size(
            quotas.requests_per_min, quotas.effective_request_burst, self._horizon_s, self._max_fraction
        )
        extra_tokens = lease_size(
            quotas.tokens_per_min, quotas.effective_token_burst, self._horizon_s, self._max_fraction
        )
        if quotas.tokens_per_min is not None and extra_tokens < tokens:
            # a token lease smaller than this request would likely admit nothing: lease neither bucket
            # (a request lease alone would only hold units back from the other replicas)
            extra_requests = extra_tokens = 0
        if tenant_id in self._asking:
            # one lease at a time per tenant: a burst of first requests, all sent before any lease came
            # back, each took one and drained the shared bucket into this replica (429s far below quota)
            extra_requests = extra_tokens = 0
        credit = (0.0, 0.0)
        if held is not None:
            del self._leases[tenant_id]
            # a re-created tenant (another epoch) does not inherit the deleted one's units, and a
            # lowered limit does not get them either: its bucket was already cut down to the new burst,
            # so units leased under the old one, credited now, would fill it past what it allows
            if may_credit(held[0].terms, terms):
                credit = held[0].leftover()
        if extra_requests or credit[0]:
            asks["requests"] = (extra_requests, credit[0])
        if extra_tokens or credit[1]:
            asks["tokens"] = (extra_tokens, credit[1])
        if not asks:
            return await self._limiter.reserve(tenant_id, quotas, tokens, epoch=epoch)
        # when the call fails (StoreUnavailable, cancelled) its outcome is unknown: the leftover may have
        # gone back already, so it is not kept (that could count its units twice); at most one lease is
        # lost, refilled with time
        done: asyncio.Event | None = None
        if extra_requests or extra_tokens:
            done = self._asking[tenant_id] = asyncio.Event()
        try:
            decision = await self._limiter.reserve(tenant_id, quotas, tokens, epoch=epoch, lease=asks)
        finally:
            if done is not None:
                del self._asking[tenant_id]
                done.set()
        if decision.never and held is not None and credit != (0.0, 0.0):  # refused before the credit
            self._install(tenant_id, held[0], held[1])
        if decision.allowed and decision.granted:
            requests = decision.granted.get("requests", 0) if quotas.requests_per_min is not None else None
            tokens_left = decision.granted.get("tokens", 0) if quotas.tokens_per_min is not None else None
            if requests != 0 and tokens_left != 0:
                now = self._clock()
                lease = QuotaLease(
                    terms,
                    float("inf") if requests is None else float(requests),
                    float("inf") if tokens_left is None else float(tokens_left),
                    now + self._ttl_s,
                )
                self._install(tenant_id, lease, quotas)
                self._seen[tenant_id] = (decision.levels, now)
                levels = self._levels(tenant_id, self._leases[tenant_id][0], now)
                return dataclasses.replace(decision, leased=True, levels=levels)
            # a lease that can serve no request (one bucket granted nothing): give it back now
            unused = QuotaLease(terms, float(requests or 0), float(tokens_left or 0), 0.0)
            self._give_back_later(tenant_id, unused, quotas)
        return decision

    def _from_lease(self, tenant_id: str, lease: QuotaLease) -> QuotaDecision:
        """The decision of a reservation the lease covered (counted), with this replica's levels."""
        self.local += 1
        self._on_reserve(True)
        if not self._report_levels:
            return _ALLOWED
        levels = self._levels(tenant_id, lease, self._clock())
        return QuotaDecision(True, False, 0.0, None, {}, leased=True, levels=levels) if levels else _ALLOWED

    def _levels(self, tenant_id: str, lease: QuotaLease, now_s: float) -> tuple[BucketLevel, ...]:
        """The tenant's bucket levels as this replica sees them with ``lease`` held (the module)."""
        seen = self._seen.get(tenant_id)
        if seen is None:
            return ()
        levels, at = seen
        elapsed = now_s - at
        out = []
        for b in levels:
            held = lease.requests if b.bucket == "requests" else lease.tokens
            held = 0.0 if math.isinf(held) else held
            level = leased_level(b.level, b.rate_per_min, b.capacity, elapsed, held)
            out.append(BucketLevel(b.bucket, b.rate_per_min, b.capacity, level))
        return tuple(out)

    def on_invalidation(self, message: str) -> None:
        """Drop the lease of a tenant that changed (``tenant:<id>``, published by every tenant write:
        quotas, disable, delete), without giving it back: its quotas may have been lowered, and the
        leftover of a lease taken under the old ones, credited to a bucket already cut down to the new
        burst, would over-admit. At most one lease's units are lost, refilled within ``horizon_s``."""
        kind, _, tenant_id = message.partition(":")
        if kind == "tenant":
            self._leases.pop(tenant_id, None)
            self._seen.pop(tenant_id, None)

    def _install(self, tenant_id: str, lease: QuotaLease, quotas: Quotas) -> None:
        current = self._leases.get(tenant_id)
        if current is not None:
            if current[0].terms == lease.terms:  # granted meanwhile to a concurrent reservation
                current[0].merge(lease)
                return
            self._give_back_later(tenant_id, current[0], current[1])
        self._leases[tenant_id] = (lease, quotas)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="quota-leases")

    def _give_back_later(self, tenant_id: str, lease: QuotaLease, quotas: Quotas) -> None:
        """Give ``lease`` back in a task of its own (it is off every request's path)."""
        task = asyncio.get_running_loop().create_task(self._give_back(tenant_id, lease, quotas))
        self._returns.add(task)
        task.add_done_callback(self._returns.discard)

    async def _give_back(self, tenant_id: str, lease: QuotaLease, quotas: Quotas) -> None:
        requests, tokens = lease.leftover()
        if requests == 0 and tokens == 0:  # nothing to write (an unlimited bucket's lease, or used up)
            return
        epoch = lease.terms[0]
        try:
            await self._limiter.adjust(
                tenant_id, quotas, requests, tokens, epoch=epoch if isinstance(epoch, str) else None
            )
        except StoreUnavailable as exc:  # the units refill with time: at worst a lease's worth held back
            log.warning("quota_lease_return_failed", tenant=tenant_id, error=str(exc))

    async def _sweep(self) -> None:
        """Give back every lease at its expiry; ends when none is held."""
        try:
            while self._leases:
                now = self._clock()
                soonest = min(lease.expires_s for lease, _ in self._leases.values())
                if soonest > now:
                    await asyncio.sleep(soonest - now)
                    continue
                expired = [(t, h) for t, h in self._leases.items() if h[0].expires_s <= now]
                for tenant_id, _ in expired:
                    del self._leases[tenant_id]
                    self._seen.pop(tenant_id, None)
                for tenant_id, (lease, quotas) in expired:
                    await self._give_back(tenant_id, lease, quotas)
        finally:
            self._sweeper = None

    async def close(self) -> None:
        """Stop the sweeper and give every lease back (at shutdown, while Redis is open)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        held, self._leases = self._leases, {}
        self._seen.clear()
        for tenant_id, (lease, quotas) in held.items():
            await self._give_back(tenant_id, lease, quotas)
        if self._returns:
            await asyncio.wait(set(self._returns))
