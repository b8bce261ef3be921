"""Step 2 of the pipeline (:meth:`service.pipeline.dispatch.Dispatcher.admit`): a request's concurrency slot,
then the token buckets it takes from, and what it is told: its rate-limit state on every answer, and the error
when a cap or a bucket refuses it (:class:`RequestAdmission`).

A request of a tenant or API key with ``max_concurrent_requests`` first takes a concurrency slot
(:class:`service.pipeline.slot_admission.SlotAdmission`; none: no Redis call), released when the request
ends. It then takes from its API key's own buckets (the key's ``quotas``), its tenant's buckets for its model
(the tenant's ``quotas.models`` entry of the model's canonical id) and its tenant's own, in one script call
(:meth:`tenancy.quota.QuotaLimiter.reserve`): all or nothing, refused by the first short in that order (and
the slot given back). A request of a key and model without limits of their own takes from its tenant's
buckets alone, through the tenant's local lease, as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import structlog

from policies.rate_limits import BucketLevel, closest_to_empty
from service.errors import GatewayError, LimitState, RateLimited, RequestTooLarge, Unauthenticated
from service.observability.metrics import GatewayMetrics
from service.pipeline.billing import Billing
from service.pipeline.outage import OutageMode
from service.pipeline.prepare import PreparedRequest
from service.pipeline.slot_admission import SlotAdmission
from tenancy.billing import BudgetHold
from tenancy.errors import StoreUnavailable, TenantNotFoundError
from tenancy.models import BucketLimits
from tenancy.quota import QuotaDecision, Reservation, Scope
from tenancy.quota_lease import LeasedQuota
from tenancy.usage import UsageRecorder

log = structlog.get_logger("radixgate.request")

_PER = {"requests": "requests per minute", "tokens": "tokens per minute"}


def scopes_of(prepared: PreparedRequest) -> tuple[Scope, ...]:
    """The buckets beyond its tenant's own that ``prepared`` takes from: its key's (when the key has
    quotas), then its tenant's for its model (when ``quotas.models`` names it); ``()`` for most."""
    key = prepared.key
    key_limits = key.limits if key is not None else None
    quotas = prepared.tenant.quotas
    model_limits = quotas.for_model(prepared.model_id) if quotas.models else None
    if key_limits is None and model_limits is None:
        return ()
    scopes: list[Scope] = []
    if key is not None and key_limits is not None:
        scopes.append(Scope("key", key.key_id, key_limits))
    if model_limits is not None:
        scopes.append(Scope("model", prepared.model_id, model_limits))
    return tuple(scopes)


def limit_states(levels: tuple[BucketLevel, ...]) -> dict[str, LimitState]:
    """Per kind (requests, tokens), the state of the bucket closest to empty (:mod:`policies.rate_limits`);
    ``{}`` when the request took from no bucket."""
    if not levels:
        return {}
    chosen: Iterable[BucketLevel] = levels
    if len(levels) > 2 or (len(levels) == 2 and levels[0].bucket == levels[1].bucket):
        chosen = closest_to_empty(levels).values()  # several of a kind (a key's, a model's): pick
    return {level.bucket: LimitState(level.capacity, level.remaining, level.reset_s) for level in chosen}


def metric_bucket(decision: QuotaDecision) -> str:
    """The ``bucket`` label of ``radixgate_quota_rejections_total``: ``requests`` or ``tokens`` for the
    tenant's own, ``key_requests``, ``model_tokens``... for a key's or a model's."""
    bucket = decision.limiting or "requests"
    return bucket if decision.scope is None else f"{decision.scope.kind}_{bucket}"


def refusal(prepared: PreparedRequest, decision: QuotaDecision, headers: bool = True) -> GatewayError:
    """The error of a refused reservation: 413 ``request_exceeds_burst`` when it can never pass, else 429
    ``rate_limit_exceeded`` with ``Retry-After``. Both name the bucket in the message and in the error
    object's ``quota`` (``{"scope": "tenant"|"key"|"model", "id", "bucket": "requests"|"tokens"}``) and
    carry the rate-limit state for the headers (unless ``headers`` is False: ``api.rate_limit_headers``)."""
    tenant = prepared.tenant
    bucket = decision.limiting or "requests"
    scope = decision.scope
    limits: BucketLimits = tenant.quotas if scope is None else scope.limits
    if scope is None:
        whose, quota = f"tenant '{tenant.id}'", {"scope": "tenant", "id": tenant.id, "bucket": bucket}
    else:
        whose = f"{scope.describe()} of tenant '{tenant.id}'"
        quota = {"scope": scope.kind, "id": scope.name, "bucket": bucket}
    err: GatewayError
    if decision.never:
        burst = limits.effective_token_burst if bucket == "tokens" else limits.effective_request_burst
        times = "" if prepared.n == 1 else f"n {prepared.n} x "
        owner = (
            f"the tenant's {bucket} burst" if scope is None else f"the {bucket} burst of {scope.describe()}"
        )
        err = RequestTooLarge(
            f"This request needs {prepared.reserved_tokens} tokens (prompt {prepared.prompt.num_tokens} + "
            f"{times}max_tokens {prepared.max_tokens}) but {owner} is {burst:g}; it can never be "
            "admitted. Lower max_tokens or shorten the prompt.",
            code="request_exceeds_burst",
            param="max_tokens",
        )
    else:
        retry_after = max(1, math.ceil(decision.retry_after_s))
        err = RateLimited(
            f"Rate limit reached for {whose} on {_PER[bucket]}. Retry after {retry_after} s.",
            retry_after_s=decision.retry_after_s,
        )
    err.details = {"quota": quota}
    if headers:
        err.rate_limits = limit_states(decision.levels)
    return err


def lease_counter(metrics: GatewayMetrics) -> Callable[[bool], None]:
    """Counts quota reservations by source (``radixgate_quota_reservations_total``), children cached."""
    local, remote = metrics.quota_reservations.labels("lease"), metrics.quota_reservations.labels("redis")

    def count(from_lease: bool) -> None:
        (local if from_lease else remote).inc()

    return count


class Admitted(NamedTuple):
    """An admitted request: what it reserved, and its rate-limit state per kind (``x-ratelimit-*``)."""

    reservation: Reservation
    rate_limits: Mapping[str, LimitState]


class RequestAdmission:
    """Admits the dispatcher's requests: a concurrency slot when a cap applies, then one reservation in every
    bucket that applies.

    Args:
        quota: token buckets, through local leases.
        slots: concurrency slots (capped tenants and keys).
        usage: usage counters (refusals).
        metrics: the app's metrics (refusals).
        rate_limit_headers: whether answers and refusals carry their rate-limit state
            (``api.rate_limit_headers``).
        billing: prices and budgets (:mod:`service.pipeline.billing`).
        outage: the ``open`` outage policy (:mod:`service.pipeline.outage`); None under ``closed``: a
            request that finds Redis out of reach gets 503.
    """

    def __init__(
        self,
        quota: LeasedQuota,
        slots: SlotAdmission,
        usage: UsageRecorder,
        metrics: GatewayMetrics,
        rate_limit_headers: bool,
        billing: Billing,
        outage: OutageMode | None = None,
    ) -> None:
        self._outage = outage
        self._billing = billing
        self._quota = quota
        self._slots = slots
        self._usage = usage
        self._metrics = metrics
        self._rate_limit_headers = rate_limit_headers

    async def admit(self, prepared: PreparedRequest) -> Admitted:
        """Take a concurrency slot when the tenant or the request's API key (``prepared.key``) has a
        ``max_concurrent_requests``, then reserve the request against its token buckets
        (:func:`scopes_of` and its tenant's) and its worst-case cost against its key's and its tenant's
        budgets (:meth:`service.pipeline.billing.Billing.terms`) in one atomic call. The slot rides on the
        reservation (:meth:`release` at the request's end), or goes back here when they refuse.

        Returns:
            The reservation and the rate-limit state to tell the client (``{}``: no bucket).

        Raises:
            RateLimited: the tenant or key has its cap in flight (``concurrency_limit_exceeded``, nothing
                charged), or a bucket is short (``retry_after_s`` says when the slowest refills enough;
                the message and ``details["quota"]`` name the first short).
            BudgetExhausted: its worst-case cost would take a budget past its hard limit (429
                ``insufficient_quota``, nothing charged).
            RequestTooLarge: the request is larger than a bucket's burst and can never pass.
            Unauthenticated: the tenant was deleted since its key was checked.
            StoreUnavailable: Redis is exhausted, slow or unreachable (a reservation a timed-out call
                may still have taken refills with time; a slot it may have taken is released); under
                ``redis.on_outage = open`` only for what outage mode does not admit (:meth:`admit_local`).
        """
        outage = self._outage
        if outage is None:
            return await self._admit_shared(prepared)
        if outage.active:
            return self.admit_local(prepared, outage)
        try:
            return await self._admit_shared(prepared)
        except StoreUnavailable as exc:
            outage.enter(exc)
            return self.admit_local(prepared, outage)

    def admit_local(self, prepared: PreparedRequest, outage: OutageMode) -> Admitted:
        """Admit ``prepared`` from this replica's own buckets while Redis is out of reach
        (:meth:`service.pipeline.outage.OutageMode.admit`): a local share of a concurrency cap, then its
        share of each bucket; the reservation is marked ``local`` (settled into the outage ledger).

        Raises:
            RateLimited: the local share of a cap or a bucket is short (429 with ``Retry-After``).
            StoreUnavailable: outage mode does not decide it (a budget, a share of 0): 503.
        """
        tenant = prepared.tenant
        price = self._billing.book.last_known(prepared.model_id)
        slot = outage.take_slot(prepared)
        reservation = Reservation(
            tenant.id,
            tenant.quotas,
            1,
            prepared.reserved_tokens,
            tenant.epoch,
            scopes=scopes_of(prepared),
            slot=slot,
            price=price,
            local=True,
        )
        try:
            decision = outage.admit(prepared, reservation)
        except BaseException:
            if slot is not None:
                outage.release_slot(slot)
            raise
        if decision.allowed:
            return Admitted(reservation, limit_states(decision.levels) if self._rate_limit_headers else {})
        if slot is not None:
            outage.release_slot(slot)
        self._metrics.quota_rejections.labels(
            self._metrics.tenant(tenant.id), metric_bucket(decision), "rate_limited"
        ).inc()
        raise refusal(prepared, decision, self._rate_limit_headers)

    async def _admit_shared(self, prepared: PreparedRequest) -> Admitted:
        """:meth:`admit` in Redis (the request path with Redis reachable)."""
        tenant = prepared.tenant
        tokens = prepared.reserved_tokens
        scopes = scopes_of(prepared)
        key = prepared.key
        price = self._billing.known_terms(prepared)
        budgets: tuple[BudgetHold, ...] = ()
        if price is None:
            price, budgets = await self._billing.terms(prepared)
        slot = None
        if tenant.max_concurrent_requests is not None or (
            key is not None and key.max_concurrent_requests is not None
        ):  # checked here: no coroutine for the slot on an uncapped tenant's path
            slot = await self._slots.take(prepared)
        try:
            decision = await self._quota.reserve(
                tenant.id, tenant.quotas, tokens, tenant.epoch, scopes, budgets
            )
        except BaseException as exc:
            if slot is not None:
                self._slots.release(slot)
            if isinstance(exc, TenantNotFoundError):  # deleted since its key was checked
                raise Unauthenticated("Incorrect API key provided.") from exc
            raise
        if decision.allowed:
            reservation = Reservation(
                tenant.id,
                tenant.quotas,
                1,
                tokens,
                tenant.epoch,
                decision.leased,
                scopes=scopes,
                slot=slot,
                budgets=budgets,
                price=price,
            )
            return Admitted(reservation, limit_states(decision.levels) if self._rate_limit_headers else {})
        if slot is not None:  # refused by a bucket or a budget: nothing taken, the slot goes back
            self._slots.release(slot)
        if decision.budget is not None:
            await self._count_refusal(prepared, "quota_rejections")
            raise self._billing.refused(prepared, decision.budget)
        # a request larger than a burst (413) is the request's fault, not a quota storm: counted apart
        reason = "exceeds_burst" if decision.never else "rate_limited"
        self._metrics.quota_rejections.labels(
            self._metrics.tenant(tenant.id), metric_bucket(decision), reason
        ).inc()
        await self._count_refusal(prepared, "oversized_rejections" if decision.never else "quota_rejections")
        raise refusal(prepared, decision, self._rate_limit_headers)

    async def _count_refusal(self, prepared: PreparedRequest, counter: str) -> None:
        """Count a refusal in the tenant's usage (bookkeeping only: the 429 or 413 stands without it)."""
        tenant = prepared.tenant
        try:
            await self._usage.record(tenant.id, tenant.epoch, **{counter: 1})
        except StoreUnavailable:
            log.warning("usage_record_failed", request_id=prepared.rid, tenant=tenant.id)

    def release(self, reservation: Reservation) -> None:
        """Give back the concurrency slot ``reservation`` holds, if any (its request has ended: its last
        byte is written); a second call is a no-op."""
        if reservation.slot is not None:
            if reservation.local and self._outage is not None:
                self._outage.release_slot(reservation.slot)
            else:
                self._slots.release(reservation.slot)
