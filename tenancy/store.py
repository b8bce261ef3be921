"""Tenants and API keys in Redis.

Layout (``P`` = the configured key prefix, default ``rg:``):
``P tenants`` (set of ids), ``P tenant:<id>`` (JSON :class:`Tenant`), ``P tenant:<id>:keys`` (set of key
ids), ``P key:<key_id>`` (JSON :class:`ApiKeyRecord`).
"""

from __future__ import annotations

from redis.asyncio import Redis

from tenancy.keys import digest_matches, generate_key, key_digest, parse_key
from tenancy.models import (
    ApiKeyInfo,
    ApiKeyRecord,
    IssuedKey,
    Tenant,
    TenantCreate,
    TenantPatch,
)


class TenantExistsError(Exception):
    """Raised when creating a tenant whose id is taken."""


class TenantNotFoundError(Exception):
    """Raised when a tenant id is unknown."""


class KeyNotFoundError(Exception):
    """Raised when a key id is unknown (or belongs to another tenant)."""


class TenantStore:
    """CRUD for tenants and their API keys.

    Args:
        redis: async client (``decode_responses=True``).
        prefix: Redis key prefix.
        pepper: HMAC key for API-key digests (from settings).
    """

    def __init__(self, redis: Redis, prefix: str, pepper: bytes) -> None:
        self._redis = redis
        self._prefix = prefix
        self._pepper = pepper

    def _tenant_key(self, tenant_id: str) -> str:
        return f"{self._prefix}tenant:{tenant_id}"

    def _tenant_keys_key(self, tenant_id: str) -> str:
        return f"{self._prefix}tenant:{tenant_id}:keys"

    def _key_key(self, key_id: str) -> str:
        return f"{self._prefix}key:{key_id}"

    @property
    def _index(self) -> str:
        return f"{self._prefix}tenants"

    async def create(self, spec: TenantCreate) -> Tenant:
        """Store a new tenant. Raises :class:`TenantExistsError` if the id is taken."""
        tenant = Tenant(**spec.model_dump())
        created = await self._redis.set(self._tenant_key(tenant.id), tenant.model_dump_json(), nx=True)
        if not created:
            raise TenantExistsError(tenant.id)
        await self._redis.sadd(self._index, tenant.id)
        return tenant

    async def get(self, tenant_id: str) -> Tenant:
        """Return a tenant. Raises :class:`TenantNotFoundError`."""
        raw = await self._redis.get(self._tenant_key(tenant_id))
        if raw is None:
            raise TenantNotFoundError(tenant_id)
        return Tenant.model_validate_json(raw)

    async def list_all(self) -> list[Tenant]:
        """All tenants, sorted by id."""
        ids = sorted(str(i) for i in await self._redis.smembers(self._index))
        if not ids:
            return []
        raws = await self._redis.mget([self._tenant_key(i) for i in ids])
        return [Tenant.model_validate_json(r) for r in raws if r is not None]

    async def update(self, tenant_id: str, patch: TenantPatch) -> Tenant:
        """Apply a partial update. Raises :class:`TenantNotFoundError`."""
        current = await self.get(tenant_id)
        changes = patch.model_dump(exclude_unset=True)
        merged = Tenant.model_validate({**current.model_dump(), **changes})
        await self._redis.set(self._tenant_key(tenant_id), merged.model_dump_json(), xx=True)
        return merged

    async def delete(self, tenant_id: str) -> None:
        """Delete a tenant and all its keys. Raises :class:`TenantNotFoundError`."""
        await self.get(tenant_id)
        key_ids = [str(i) for i in await self._redis.smembers(self._tenant_keys_key(tenant_id))]
        pipe = self._redis.pipeline(transaction=True)
        for key_id in key_ids:
            pipe.delete(self._key_key(key_id))
        pipe.delete(self._tenant_keys_key(tenant_id), self._tenant_key(tenant_id))
        pipe.srem(self._index, tenant_id)
        await pipe.execute()

    async def issue_key(self, tenant_id: str, name: str = "") -> IssuedKey:
        """Create an API key for a tenant; the returned ``api_key`` is never stored."""
        await self.get(tenant_id)
        parsed = generate_key()
        record = ApiKeyRecord(
            key_id=parsed.key_id,
            tenant_id=tenant_id,
            digest=key_digest(parsed.full, self._pepper),
            name=name,
        )
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self._key_key(parsed.key_id), record.model_dump_json(), nx=True)
        pipe.sadd(self._tenant_keys_key(tenant_id), parsed.key_id)
        await pipe.execute()
        return IssuedKey(**_info(record).model_dump(), api_key=parsed.full)

    async def list_keys(self, tenant_id: str) -> list[ApiKeyInfo]:
        """Keys of a tenant (no digests), oldest first."""
        await self.get(tenant_id)
        ids = sorted(str(i) for i in await self._redis.smembers(self._tenant_keys_key(tenant_id)))
        if not ids:
            return []
        raws = await self._redis.mget([self._key_key(i) for i in ids])
        records = [ApiKeyRecord.model_validate_json(r) for r in raws if r is not None]
        return [_info(r) for r in sorted(records, key=lambda r: r.created_at)]

    async def revoke_key(self, tenant_id: str, key_id: str) -> ApiKeyInfo:
        """Mark a key revoked (kept for audit). Raises :class:`KeyNotFoundError`."""
        raw = await self._redis.get(self._key_key(key_id))
        if raw is None:
            raise KeyNotFoundError(key_id)
        record = ApiKeyRecord.model_validate_json(raw)
        if record.tenant_id != tenant_id:
            raise KeyNotFoundError(key_id)
        record.revoked = True
        await self._redis.set(self._key_key(key_id), record.model_dump_json(), xx=True)
        return _info(record)

    async def authenticate(self, presented: str) -> Tenant | None:
        """Resolve a presented API key to its tenant.

        Returns ``None`` for a malformed, unknown, revoked or wrong key, or a key whose tenant is gone.
        The caller decides what a disabled tenant means (403).
        """
        parsed = parse_key(presented)
        if parsed is None:
            return None
        raw = await self._redis.get(self._key_key(parsed.key_id))
        if raw is None:
            return None
        record = ApiKeyRecord.model_validate_json(raw)
        if record.revoked or not digest_matches(parsed.full, record.digest, self._pepper):
            return None
        try:
            return await self.get(record.tenant_id)
        except TenantNotFoundError:
            return None


def _info(record: ApiKeyRecord) -> ApiKeyInfo:
    return ApiKeyInfo(
        key_id=record.key_id,
        tenant_id=record.tenant_id,
        name=record.name,
        created_at=record.created_at,
        revoked=record.revoked,
        prefix=f"rg-{record.key_id}",
    )
