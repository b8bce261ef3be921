"""Usage counters per tenant in Redis (one hash per tenant, HINCRBY in one pipeline per request)."""

from __future__ import annotations

from redis.asyncio import Redis

from tenancy.models import Usage

_FIELDS = ("requests", "errors", "prompt_tokens", "completion_tokens", "cached_tokens", "quota_rejections")


class UsageRecorder:
    """Accumulates and reads per-tenant usage.

    Args:
        redis: async client (``decode_responses=True``).
        prefix: Redis key prefix; counters live at ``<prefix>usage:<tenant>``.
    """

    def __init__(self, redis: Redis, prefix: str) -> None:
        self._redis = redis
        self._prefix = prefix

    def _key(self, tenant_id: str) -> str:
        return f"{self._prefix}usage:{tenant_id}"

    async def record(self, tenant_id: str, **counts: int) -> None:
        """Add counts (field names of :class:`Usage`) to a tenant's counters in one round trip.

        Raises:
            ValueError: an unknown field name.
        """
        unknown = set(counts) - set(_FIELDS)
        if unknown:
            raise ValueError(f"unknown usage fields: {sorted(unknown)}")
        pipe = self._redis.pipeline(transaction=False)
        for field, value in counts.items():
            if value:
                pipe.hincrby(self._key(tenant_id), field, value)
        await pipe.execute()

    async def get(self, tenant_id: str) -> Usage:
        """Return a tenant's counters (zeros if none yet)."""
        raw = await self._redis.hgetall(self._key(tenant_id))
        return Usage(tenant_id=tenant_id, **{k: int(v) for k, v in raw.items() if k in _FIELDS})

    async def delete(self, tenant_id: str) -> None:
        """Drop a tenant's counters (when the tenant is deleted)."""
        await self._redis.delete(self._key(tenant_id))
