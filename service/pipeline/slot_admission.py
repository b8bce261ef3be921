"""Admission against concurrency caps: a request of a tenant or API key with ``max_concurrent_requests``
takes a slot (:class:`tenancy.concurrency.ConcurrencyLimiter`, shared by every replica through Redis)
before its token buckets are charged, and gives it back when it ends.

A refused request is counted (``radixgate_quota_rejections_total{reason="concurrency_limit"}``, the
tenant's ``concurrency_rejections``) and answered 429 ``concurrency_limit_exceeded`` with ``Retry-After``;
nothing is charged to any bucket.
"""

from __future__ import annotations

import structlog

from service.errors import RateLimited, Unauthenticated
from service.observability.metrics import GatewayMetrics
from tenancy.concurrency import RETRY_AFTER_S, ConcurrencyLimiter, HeldSlot, SlotRefused
from tenancy.errors import StoreUnavailable, TenantNotFoundError
from tenancy.models import Tenant
from tenancy.usage import UsageRecorder

log = structlog.get_logger("radixgate.request")


class SlotAdmission:
    """Takes and gives back the concurrency slots of the dispatcher's requests.

    Args:
        limiter: the slot sets in Redis and this replica's leases on them.
        metrics: the app's metrics (refusals).
        usage: usage counters (refusals).
    """

    def __init__(self, limiter: ConcurrencyLimiter, metrics: GatewayMetrics, usage: UsageRecorder) -> None:
        self._limiter = limiter
        self._metrics = metrics
        self._usage = usage

    async def take(
        self, tenant: Tenant, request_id: str, key_id: str, key_cap: int | None
    ) -> HeldSlot | None:
        """A slot for a request of ``tenant`` through API key ``key_id`` (``key_cap``: the key's
        ``max_concurrent_requests``), in the tenant's slot set when it has a cap and the key's when it has
        one; None when neither has (no Redis call).

        Raises:
            RateLimited: the tenant's or the key's slot set is full (``concurrency_limit_exceeded``).
            Unauthenticated: the tenant was deleted since its key was checked.
            StoreUnavailable: Redis is exhausted, slow or unreachable.
        """
        try:
            taken = await self._limiter.acquire(
                tenant.id, tenant.max_concurrent_requests, key_id, key_cap, epoch=tenant.epoch
            )
        except TenantNotFoundError as exc:  # deleted since its key was checked
            raise Unauthenticated("Incorrect API key provided.") from exc
        if not isinstance(taken, SlotRefused):
            return taken
        self._metrics.quota_rejections.labels(
            self._metrics.tenant(tenant.id), f"{taken.scope}_concurrency", "concurrency_limit"
        ).inc()
        try:  # bookkeeping only: the 429 stands without it
            await self._usage.record(tenant.id, tenant.epoch, concurrency_rejections=1)
        except StoreUnavailable:
            log.warning("usage_record_failed", request_id=request_id, tenant=tenant.id)
        whose = f"tenant '{tenant.id}'" if taken.scope == "tenant" else "this API key"
        raise RateLimited(
            f"Concurrency limit reached for {whose}: {taken.held} of its {taken.cap} concurrent requests "
            f"are in flight. Retry after {RETRY_AFTER_S} s.",
            code="concurrency_limit_exceeded",
            retry_after_s=RETRY_AFTER_S,
        )

    def release(self, slot: HeldSlot) -> None:
        """Give ``slot`` back (its removal from Redis runs off the request's path; a second call is a
        no-op)."""
        self._limiter.release(slot)
