"""Usage counters per tenant in Redis (one hash per tenant, added to by one Lua call per request).

Given the tenant's ``epoch``, nothing is recorded once the tenant is gone (see :mod:`tenancy.layout`),
so a request settling after its tenant's deletion leaves no counters behind.
"""

from __future__ import annotations

from tenancy.errors import CallObserver, store_operation
from tenancy.layout import KeyLayout, lua
from tenancy.models import USAGE_FIELDS, Usage
from tenancy.redis_client import RedisClient

_FIELDS = USAGE_FIELDS


class UsageRecorder:
    """Accumulates and reads per-tenant usage.

    Args:
        redis: async client (``decode_responses=True``).
        prefix: RedisClient key prefix; counters live at ``<prefix>usage:<tenant>``.

    ``observe_call``: told each call's latency (:func:`tenancy.errors.store_operation`).
    """

    observe_call: CallObserver | None = None

    def __init__(self, redis: RedisClient, prefix: str) -> None:
        self._redis = redis
        self._layout = KeyLayout(prefix)
        self._script = redis.register_script(lua("usage_record.lua", guarded=True))

    def _key(self, tenant_id: str) -> str:
        return self._layout.usage(tenant_id)

    @store_operation
    async def record(self, tenant_id: str, epoch: str | None = None, **counts: int) -> bool:
        """Add counts (field names of :class:`Usage`) to a tenant's counters in one round trip.

        Args:
            tenant_id: whose counters.
            epoch: the tenant record's epoch as the caller read it; None skips the tenant check.
            counts: field -> amount (zeros are skipped).

        Returns:
            False when ``epoch`` was given and the tenant is gone (nothing recorded), else True.

        Raises:
            ValueError: an unknown field name.
        """
        unknown = set(counts) - set(_FIELDS)
        if unknown:
            raise ValueError(f"unknown usage fields: {sorted(unknown)}")
        args: list[str | int] = ["0" if epoch is None else "1", epoch or ""]
        for field, value in counts.items():
            if value:
                args += [field, value]
        if len(args) == 2:
            return True
        keys = [self._layout.tenant(tenant_id), self._key(tenant_id)]
        return bool(await self._script(keys=keys, args=args))

    @store_operation
    async def get(self, tenant_id: str) -> Usage:
        """Return a tenant's counters (zeros if none yet)."""
        raw = await self._redis.hgetall(self._key(tenant_id))
        return Usage(tenant_id=tenant_id, **{k: int(v) for k, v in raw.items() if k in _FIELDS})
