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
from service.pipeline.prepare import PreparedRequest
from tenancy.concurrency import RETRY_AFTER_S, ConcurrencyLimiter, HeldSlot, SlotRefused
from tenancy.errors import StoreUnavailable, TenantNotFoundError
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

    async def take(self, prepared: PreparedRequest) -> HeldSlot | None:
        """A slot for ``prepared``: in its tenant's slot set when the tenant has a cap, and in its API
        key's (``prepared.key``, the record read at authentication) when the key has one; None when
        neither has (no Redis call).

        Raises:
            RateLimited: the tenant's or the key's slot set is full (``concurrency_limit_exceeded``).
            Unauthenticated: the tenant was deleted since its key was checked.
            StoreUnavailable: Redis is exhausted, slow or unreachable.
        """
        tenant, key = prepared.tenant, prepared.key
        key_cap = key.max_concurrent_requests if key is not None else None
        if tenant.max_concurrent_requests is None and key_cap is None:
            return None
        try:
            taken = await self._limiter.acquire(
                tenant.id,
                tenant.max_concurrent_requests,
                key.key_id if key is not None else "",
                key_cap,
                epoch=tenant.epoch,
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
            log.warning("usage_record_failed", request_id=prepared.rid, tenant=tenant.id)
        if taken.scope == "tenant" or key is None:
            whose = f"tenant '{tenant.id}'"
        else:
            whose = f"this API key (rg-{key.key_id})"
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
