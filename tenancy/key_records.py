"""One API key's record and terms in Redis (:class:`KeyRecords`, a part of
:class:`tenancy.store.TenantStore`): read one key of a tenant, change its name or terms atomically; and what
admins see of a key."""

from __future__ import annotations

from collections.abc import Callable

from redis.exceptions import WatchError

from tenancy.errors import KeyNotFoundError, store_operation
from tenancy.layout import KeyLayout
from tenancy.models import ApiKeyInfo, ApiKeyRecord, KeyPatch
from tenancy.redis_client import RedisClient


def key_info(record: ApiKeyRecord) -> ApiKeyInfo:
    """What admins see of a key: its record without the digest, with its visible prefix and its terms."""
    return ApiKeyInfo(
        key_id=record.key_id,
        tenant_id=record.tenant_id,
        name=record.name,
        created_at=record.created_at,
        revoked=record.revoked,
        prefix=f"rg-{record.key_id}",
        expires_at=record.expires_at,
        allowed_models=record.allowed_models,
        quotas=record.quotas,
        max_concurrent_requests=record.max_concurrent_requests,
    )


class KeyRecords:
    """Reads and writes of one key's record; :class:`tenancy.store.TenantStore` sets ``_redis`` and
    ``_layout`` and publishes the invalidations (``_invalidate``)."""

    _redis: RedisClient
    _layout: KeyLayout

    async def _invalidate(self, message: str) -> None:
        """Drop what the replicas' caches hold about ``message`` (``key:<id>``); the store's."""
        raise NotImplementedError

    async def _key_record(self, tenant_id: str, key_id: str) -> ApiKeyRecord:
        raw = await self._redis.get(self._layout.api_key(tenant_id, key_id))
        if raw is None:
            raise KeyNotFoundError(key_id)
        record = ApiKeyRecord.model_validate_json(raw)
        if record.tenant_id != tenant_id:
            raise KeyNotFoundError(key_id)
        return record

    @store_operation
    async def get_key(self, tenant_id: str, key_id: str) -> ApiKeyInfo:
        """One key of a tenant (no digest). Raises :class:`KeyNotFoundError` (also another tenant's)."""
        return key_info(await self._key_record(tenant_id, key_id))

    @store_operation
    async def update_key(
        self,
        tenant_id: str,
        key_id: str,
        patch: KeyPatch,
        check: Callable[[ApiKeyRecord], None] | None = None,
    ) -> ApiKeyInfo:
        """Change a key's name or terms: the fields ``patch`` sets replace the stored ones (``null``
        clears a term), and ``patch.quotas`` merges field by field with the stored quotas (RFC 7386).
        ``check`` is called with the record about to be written and may raise to write nothing.

        Optimistic concurrency (``WATCH``/``MULTI``/``EXEC``), as :meth:`update`: two patches of different
        fields that race both land, and a patch racing a revoke keeps the key revoked. Every replica drops
        its cached entry of the key.

        Raises:
            KeyNotFoundError: no such key of that tenant.
        """
        key = self._layout.api_key(tenant_id, key_id)
        changes = patch.model_dump(exclude_unset=True)
        quota_fields = (
            {name: getattr(patch.quotas, name) for name in patch.quotas.model_fields_set}
            if patch.quotas is not None
            else None
        )
        async with self._redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    current = None if raw is None else ApiKeyRecord.model_validate_json(raw)
                    if current is None or current.tenant_id != tenant_id:
                        raise KeyNotFoundError(key_id)
                    fields = current.model_dump()
                    if quota_fields is not None:
                        changes["quotas"] = {**(fields["quotas"] or {}), **quota_fields}
                    merged = ApiKeyRecord.model_validate({**fields, **changes})
                    if check is not None:
                        check(merged)
                    pipe.multi()  # type: ignore[no-untyped-call, unused-ignore]
                    pipe.set(key, merged.model_dump_json(), xx=True)
                    await pipe.execute()
                    break
                except WatchError:
                    continue
        await self._invalidate(f"key:{key_id}")
        return key_info(merged)
