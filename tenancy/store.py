"""Tenants and API keys in Redis (key layout in :mod:`tenancy.layout`).

Each creation gives the tenant a fresh random ``epoch``; scripts that write its buckets or usage check it,
and :meth:`TenantStore.delete` removes the record, its keys, buckets and usage in one Lua call, so a
deleted tenant leaves nothing behind and a re-created one (same id) starts clean.

Every key a tenant owns carries its hash tag (:mod:`tenancy.layout`), so each call on them is one slot's,
on one Redis or a Redis Cluster. Three entries live in other slots and are written by separate commands,
in an order that leaves, after a crash between two of them, only an entry that reads as absent: the tenant
index (``P tenants``, id -> epoch: written after the record, removed after it and only for the deleted
epoch), and each key id's owner (``P keyid:<key id>``: written before the key record, which is what
authentication trusts; a leftover names a tenant without that record).
"""

from __future__ import annotations

import asyncio
import bisect
import secrets
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

import structlog
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline
from redis.exceptions import RedisClusterException, RedisError, WatchError

from tenancy.auth_cache import AuthCache, invalidation_channel
from tenancy.errors import (
    CallObserver,
    KeyNotFoundError,
    TenantExistsError,
    TenantNotFoundError,
    store_operation,
    untimed_store_operation,
)
from tenancy.key_records import KeyRecords, key_info
from tenancy.keys import digest_matches, generate_key, key_digest, parse_key, tokens_equal
from tenancy.layout import BUCKETS, KeyLayout, lua
from tenancy.models import (
    ApiKeyInfo,
    ApiKeyRecord,
    IssuedKey,
    KeyTerms,
    Quotas,
    Tenant,
    TenantCreate,
    TenantPatch,
)
from tenancy.redis_client import RedisClient

__all__ = ["Authenticated", "KeyNotFoundError", "TenantExistsError", "TenantNotFoundError", "TenantStore"]


class Authenticated(NamedTuple):
    """A presented API key that matched: its tenant and its record (the key's terms: expiry, models,
    quotas, ``max_concurrent_requests``). An expired key is returned too (:meth:`ApiKeyRecord.expired`
    says so): the caller answers it with its own error."""

    tenant: Tenant
    key: ApiKeyRecord


log = structlog.get_logger("radixgate.tenants")


async def eviction_policy(redis: RedisClient) -> str | None:
    """Redis's ``maxmemory_policy`` (``INFO memory``, allowed where ``CONFIG`` is not), or None when Redis
    cannot be asked now. Anything but ``noeviction`` lets a full Redis drop this project's keys: tenant
    records and API keys (no TTL: ``allkeys-*``), buckets (a quota starts over) and ``settled:`` markers
    (a retried settle could land twice) (``volatile-*`` too)."""
    try:
        info = await redis.info("memory")
    except (RedisError, RedisClusterException, OSError):
        return None
    if info and all(isinstance(v, dict) for v in info.values()):  # Redis Cluster: one reply per node
        info = next(iter(info.values()))
    policy = info.get("maxmemory_policy")
    return str(policy) if policy is not None else None


class TenantStore(KeyRecords):
    """CRUD for tenants and their API keys.

    Args:
        redis: async client (``decode_responses=True``).
        prefix: Redis key prefix.
        pepper: HMAC key for API-key digests (from settings).
        cache: this replica's memory of authenticated keys (:mod:`tenancy.auth_cache`); None reads
            Redis on every authentication. Writes that change what authentication answers drop the
            entries here and publish the invalidation to every replica either way.

    Concurrent cache misses of one key id share one Redis read (single flight): when an entry expires
    under load, every request in flight for that key used to read the key and its tenant itself (the
    benchmark's 64 connections: about 0.11 Redis reads per request, and the Redis pool grown by about a
    dozen connections a second).

    ``observe_call``: told each Redis call's latency (:func:`tenancy.errors.store_operation`); an
    authentication is timed only when it reads Redis (as ``TenantStore.authenticate``).

    ``wall_clock``: unix time, s (keys' expiry; a test hook).
    """

    observe_call: CallObserver | None = None

    def __init__(
        self,
        redis: RedisClient,
        prefix: str,
        pepper: bytes,
        cache: AuthCache | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis = redis
        self._wall_clock = wall_clock
        self._layout = KeyLayout(prefix)
        self._pepper = pepper
        self._cache = cache
        self._reads: dict[str, tuple[int, asyncio.Task[_KeyRead]]] = {}  # key id -> (generation, read)
        self._channel = invalidation_channel(prefix)
        self._delete_script = redis.register_script(lua("tenant_delete.lua"))
        self._issue_script = redis.register_script(lua("key_issue.lua"))
        self._key_page_script = redis.register_script(lua("key_page.lua"))
        self._unindex_script = redis.register_script(lua("tenant_unindex.lua"))

    def _tenant_key(self, tenant_id: str) -> str:
        return self._layout.tenant(tenant_id)

    def _tenant_keys_key(self, tenant_id: str) -> str:
        return self._layout.tenant_keys(tenant_id)

    def _key_key(self, tenant_id: str, key_id: str) -> str:
        return self._layout.api_key(tenant_id, key_id)

    @property
    def _index(self) -> str:
        return self._layout.index

    @store_operation
    async def create(self, spec: TenantCreate) -> Tenant:
        """Store a new tenant with a fresh epoch.

        Raises:
            TenantExistsError: the id is taken.
            ValueError: ``spec`` has no priority class (the caller fills in its default class).
        """
        if spec.priority_class is None:
            raise ValueError("a stored tenant needs a priority class: give the default class")
        tenant = Tenant(**spec.model_dump(), epoch=secrets.token_hex(8))
        # the record first, then its index entry (another slot on Redis Cluster) naming its epoch: a crash
        # between the two leaves a tenant unlisted until it is written again (an index entry without its
        # record, the other order, lists nothing and is skipped); a delete racing removes only its epoch's
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._tenant_key(tenant.id), tenant.model_dump_json(), nx=True)
            self._note_quota_models(pipe, tenant.id, tenant.quotas)
            created, *_ = await pipe.execute()
        if not created:
            raise TenantExistsError(tenant.id)
        await self._index_entry(tenant.id, tenant.epoch)
        return tenant

    async def _index_entry(self, tenant_id: str, epoch: str) -> None:
        """Index the record of ``epoch``, then check it is still there: a delete that removed the record
        in between (and found no entry to remove yet) has its entry removed here. With the check after the
        removal in :meth:`delete`, whichever of the two writes second sees the other's write."""
        await self._redis.hset(self._index, tenant_id, epoch)
        raw = await self._redis.get(self._tenant_key(tenant_id))
        if raw is None or Tenant.model_validate_json(raw).epoch != epoch:
            await self._unindex_script(keys=[self._index], args=[tenant_id, epoch])

    @store_operation
    async def get(self, tenant_id: str) -> Tenant:
        """Return a tenant. Raises :class:`TenantNotFoundError`."""
        raw = await self._redis.get(self._tenant_key(tenant_id))
        if raw is None:
            raise TenantNotFoundError(tenant_id)
        return Tenant.model_validate_json(raw)

    @store_operation
    async def list_all(self) -> list[Tenant]:
        """All tenants, sorted by id."""
        return (await self.list_page())[0]

    @store_operation
    async def list_page(
        self, after: str | None = None, limit: int | None = None
    ) -> tuple[list[Tenant], bool]:
        """Tenants sorted by id: those after id ``after`` (None: from the first), at most ``limit`` (None:
        all); and whether more follow. Only the page's records are read (the index's ids all are: a SET,
        sorted here). Ids are unique and the page starts at the first id above ``after``, so a tenant that
        exists from the first page to the last is on exactly one page."""
        ids = sorted(str(i) for i in await self._redis.hkeys(self._index))
        if after is not None:
            ids = ids[bisect.bisect_right(ids, after) :]
        page: list[Tenant] = []
        while ids and (limit is None or len(page) < limit):
            # an id whose record is gone (deleted since the index was read) is skipped and the page
            # filled from the ids after it: a short page must not end the listing early
            batch, ids = (ids, []) if limit is None else (ids[: limit - len(page)], ids[limit - len(page) :])
            raws = await self._get_many([self._tenant_key(i) for i in batch])
            page += [Tenant.model_validate_json(r) for r in raws if r is not None]
        return page, bool(ids)

    @store_operation
    async def update(
        self,
        tenant_id: str,
        patch: TenantPatch,
        quota_fields: Mapping[str, float | None] | None = None,
        check: Callable[[Tenant], None] | None = None,
    ) -> Tenant:
        """Apply a partial update. Raises :class:`TenantNotFoundError`.

        Optimistic concurrency (Redis ``WATCH``/``MULTI``/``EXEC``): the record is read and written back
        only if nobody changed it in between, else read again; so two patches of different fields that
        race both land (a quota change racing a disable cannot re-enable the tenant), and a patch racing
        a delete and re-creation never writes the old record (with its old epoch) over the new one.

        ``quota_fields`` (a JSON merge patch of the quotas): these quota fields replace the stored ones
        and the others are kept, merged with the record read here, so that two patches of different
        quota fields that race both land; it takes the place of ``patch.quotas``.

        ``check`` is called with the record about to be written (merged with the one read in the
        transaction) and may raise to write nothing: a rule across fields (a default priority class
        not above the highest one) holds also when two patches of those fields race.
        """
        key = self._tenant_key(tenant_id)
        changes = patch.model_dump(exclude_unset=True)
        if quota_fields is not None:
            changes.pop("quotas", None)
        async with self._redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        raise TenantNotFoundError(tenant_id)
                    current = Tenant.model_validate_json(raw)
                    fields = current.model_dump()
                    if quota_fields is not None:
                        fields["quotas"] = {**fields["quotas"], **quota_fields}
                    merged = Tenant.model_validate({**fields, **changes})
                    if check is not None:
                        check(merged)
                    pipe.multi()  # type: ignore[no-untyped-call, unused-ignore]
                    pipe.set(key, merged.model_dump_json(), xx=True)
                    self._note_quota_models(pipe, tenant_id, merged.quotas)
                    await pipe.execute()
                    break
                except WatchError:
                    continue  # changed since it was read: read it again
        await self._index_entry(tenant_id, merged.epoch)  # again: a create cut short before it
        await self._invalidate(f"tenant:{tenant_id}")
        return merged

    def _note_quota_models(self, pipe: Pipeline | ClusterPipeline, tenant_id: str, quotas: Quotas) -> None:
        """Add the model ids ``quotas`` names to the tenant's set of them, in ``pipe`` (the transaction
        that writes the record): every model bucket a request can write is then named there, also after
        its entry is removed, so :meth:`delete` clears them all."""
        if quotas.models:
            pipe.sadd(self._layout.quota_models(tenant_id), *(m.model for m in quotas.models))

    async def _get_many(self, keys: list[str]) -> list[str | None]:
        """``GET`` of each key, in one pipeline (not atomic: on Redis Cluster the keys may be in several
        slots, which ``MGET`` refuses)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(key)
            replies: list[str | None] = await pipe.execute()
        return replies

    @store_operation
    async def delete(self, tenant_id: str) -> None:
        """Delete a tenant and every key it owns (record, API keys, buckets of its own, of its keys and of
        its models, usage totals and by day, budgets and their spend, concurrency slot sets of its own and
        of its keys) in one atomic call; then its index entry and its key ids' owner entries.

        Raises:
            TenantNotFoundError: no such tenant.
        """
        layout = self._layout
        keys = [
            layout.tenant(tenant_id),
            layout.tenant_keys(tenant_id),
            layout.usage(tenant_id),
            layout.tenant_keys_by_time(tenant_id),
            *(layout.bucket(tenant_id, b) for b in BUCKETS),
            layout.slots(tenant_id),
            layout.quota_models(tenant_id),
            layout.budgets(tenant_id),
            layout.billing_index(tenant_id),
        ]
        args = [
            layout.api_key_prefix(tenant_id),
            layout.scoped_bucket_prefix(tenant_id),
            layout.quota_models(tenant_id),
            layout.key_slots_prefix(tenant_id),
            layout.billing_index(tenant_id),
        ]
        deleted = await self._delete_script(keys=keys, args=args)
        epoch, key_ids = (str(deleted[0]), [str(k) for k in deleted[1:]]) if deleted else ("", [])
        if await self._unindex_script(keys=[self._index], args=[tenant_id, epoch]) and not epoch:
            # an entry without its record removed: unless a create wrote both meanwhile (re-indexed)
            raw = await self._redis.get(self._tenant_key(tenant_id))
            if raw is not None:
                await self._redis.hset(self._index, tenant_id, Tenant.model_validate_json(raw).epoch)
        if not deleted:
            raise TenantNotFoundError(tenant_id)
        if key_ids:
            await self._redis.delete(*(layout.key_owner(k) for k in key_ids))
        await self._invalidate(f"tenant:{tenant_id}")

    @store_operation
    async def issue_key(self, tenant_id: str, name: str = "", terms: KeyTerms | None = None) -> IssuedKey:
        """Create an API key for a tenant, with ``terms`` (expiry, models, quotas, concurrency cap; the
        caller checks them against the tenant); the returned ``api_key`` is never stored.

        Raises:
            TenantNotFoundError: no such tenant (also when it is deleted meanwhile).
        """
        await self.get(tenant_id)
        for _ in range(3):  # a 48-bit key id collides with odds ~n/2^48: draw again
            parsed = generate_key()
            record = ApiKeyRecord(
                key_id=parsed.key_id,
                tenant_id=tenant_id,
                digest=key_digest(parsed.full, self._pepper),
                name=name,
                **(terms.model_dump(include=set(KeyTerms.model_fields)) if terms is not None else {}),
            )
            owner = self._layout.key_owner(parsed.key_id)
            if not await self._redis.set(owner, tenant_id, nx=True):
                continue  # the id is taken (by any tenant)
            keys = [
                self._tenant_key(tenant_id),
                self._key_key(tenant_id, parsed.key_id),
                self._tenant_keys_key(tenant_id),
                self._layout.tenant_keys_by_time(tenant_id),
            ]
            args = [record.model_dump_json(), parsed.key_id, repr(record.created_at)]
            stored = int(await self._issue_script(keys=keys, args=args))
            if stored == 1:
                return IssuedKey(**key_info(record).model_dump(), api_key=parsed.full)
            await self._redis.delete(owner)
            if stored == -1:
                raise TenantNotFoundError(tenant_id)
        raise RuntimeError("could not draw an unused API key id")

    @store_operation
    async def list_keys(self, tenant_id: str) -> list[ApiKeyInfo]:
        """Every key of a tenant (no digests), oldest first, read page by page (:meth:`list_keys_page`).

        Raises:
            TenantNotFoundError: no such tenant.
        """
        keys: list[ApiKeyInfo] = []
        after, more = None, True
        while more:
            page, more = await self.list_keys_page(tenant_id, after, 1000)
            keys += page
            after = page[-1].key_id if page else None
            more = more and after is not None
        return keys

    @store_operation
    async def list_keys_page(
        self, tenant_id: str, after: str | None = None, limit: int = 100
    ) -> tuple[list[ApiKeyInfo], bool]:
        """A page of a tenant's keys (no digests), oldest first (creation time, then key id): at most
        ``limit`` after key ``after`` (None: from the oldest), and whether more follow; one atomic Lua call
        (``key_page.lua``) that reads only the page's records.

        Every key that exists from the first page to the last is listed exactly once: the order is total,
        and a page starts after its cursor's position (``ZRANK`` then ``ZRANGE`` in one script); a key
        issued meanwhile is on a later page (or, when a replica's clock is behind, not listed).

        Raises:
            TenantNotFoundError: no such tenant.
            KeyNotFoundError: ``after`` is not one of this tenant's keys.
        """
        layout = self._layout
        keys = [
            layout.tenant(tenant_id),
            layout.tenant_keys(tenant_id),
            layout.tenant_keys_by_time(tenant_id),
        ]
        reply = await self._key_page_script(
            keys=keys, args=[layout.api_key_prefix(tenant_id), after or "", limit]
        )
        if reply == -1:
            raise TenantNotFoundError(tenant_id)
        if reply == -2:
            raise KeyNotFoundError(str(after))
        more, *raws = reply
        return [key_info(ApiKeyRecord.model_validate_json(raw)) for raw in raws], bool(more)

    @store_operation
    async def revoke_key(self, tenant_id: str, key_id: str) -> ApiKeyInfo:
        """Mark a key revoked (kept for audit). Raises :class:`KeyNotFoundError`."""
        record = await self._key_record(tenant_id, key_id)
        record.revoked = True
        await self._redis.set(self._key_key(tenant_id, key_id), record.model_dump_json(), xx=True)
        await self._invalidate(f"key:{key_id}")
        return key_info(record)

    @store_operation
    async def key_revoked(self, key_id: str) -> bool:
        """Whether API key ``key_id`` is revoked or gone (its tenant is not looked at)."""
        owner = await self._redis.get(self._layout.key_owner(key_id))
        raw = None if owner is None else await self._redis.get(self._key_key(str(owner), key_id))
        return raw is None or ApiKeyRecord.model_validate_json(raw).revoked

    async def _invalidate(self, message: str) -> None:
        """Drop what this replica's cache holds about ``message`` (``key:<id>``/``tenant:<id>``) and tell
        every replica. A failed publish is only logged: the write is done, and the other replicas' entries
        expire within their TTL."""
        if self._cache is not None:
            self._cache.apply(message)
        try:
            await self._redis.publish(self._channel, message)
        except (RedisError, RedisClusterException) as exc:
            log.warning("auth_invalidation_not_published", message=message, error=str(exc))

    async def authenticate(self, presented: str) -> Tenant | None:
        """Resolve a presented API key to its tenant (:meth:`authenticate_key`); None also for an expired
        key."""
        found = await self.authenticate_key(presented)
        if found is None or found.key.expired(self._wall_clock()):
            return None
        return found.tenant

    @untimed_store_operation
    async def authenticate_key(self, presented: str) -> Authenticated | None:
        """Resolve a presented API key to its tenant and its record (terms).

        Returns ``None`` for a malformed, unknown, revoked or wrong key, or a key whose tenant is gone.
        The caller decides what a disabled tenant (403) or an expired key (401) means. A key that passed
        within the cache's TTL is answered from the cache (its digest still checked), never past the
        key's expiry; otherwise Redis is read.
        """
        parsed = parse_key(presented)
        if parsed is None:
            return None
        cache = self._cache
        if cache is None or not cache.enabled:  # off: every authentication reads Redis itself
            found = await self._read_key(parsed.key_id)
            return _matched(found, parsed.full, self._pepper)
        hit = cache.get(parsed.key_id)
        if hit is not None and hit.key is not None:
            if tokens_equal(parsed.full, hit.verified) or digest_matches(
                parsed.full, hit.digest, self._pepper
            ):
                return Authenticated(hit.tenant, hit.key)
            return None
        read_at, generation = cache.now(), cache.generation
        shared = self._reads.get(parsed.key_id)
        if shared is not None and shared[0] == generation:  # a read begun since the last invalidation
            found = await asyncio.shield(shared[1])
            return _matched(found, parsed.full, self._pepper)
        read = asyncio.ensure_future(self._read_key(parsed.key_id))
        self._reads[parsed.key_id] = (generation, read)
        read.add_done_callback(lambda done: self._read_done(parsed.key_id, done))
        found = await asyncio.shield(read)  # the first caller leaving does not fail the others
        matched = _matched(found, parsed.full, self._pepper)
        if matched is None:
            return None
        record, tenant = matched.key, matched.tenant
        # an entry never outlives its key: past the expiry the record is read again (and refused)
        life = None if record.expires_at is None else max(0.0, record.expires_at - self._wall_clock())
        cache.put(parsed.key_id, record.digest, tenant, read_at, generation, parsed.full, record, life)
        return matched

    async def _read_key(self, key_id: str) -> _KeyRead:
        """The key record and its tenant from Redis; None when the key or its tenant is gone. Two reads:
        the key id's owner, then the key record and the tenant record together (one slot). Timed as
        ``TenantStore.authenticate`` when ``observe_call`` is set."""
        observe, start = self.observe_call, time.perf_counter()
        try:
            owner = await self._redis.get(self._layout.key_owner(key_id))
            if owner is None:
                return None
            raw_key, raw_tenant = await self._redis.mget(
                self._key_key(str(owner), key_id), self._tenant_key(str(owner))
            )
            if raw_key is None or raw_tenant is None:
                return None
            record = ApiKeyRecord.model_validate_json(raw_key)
            tenant = Tenant.model_validate_json(raw_tenant)
            if record.tenant_id != tenant.id:
                return None
            return record, tenant
        finally:
            if observe is not None:
                observe("TenantStore.authenticate", time.perf_counter() - start)

    def _read_done(self, key_id: str, read: asyncio.Task[_KeyRead]) -> None:
        """Forget a finished shared read (retrieving its error: every caller may have left)."""
        if self._reads.get(key_id, (0, None))[1] is read:
            del self._reads[key_id]
        if not read.cancelled():
            read.exception()


_KeyRead = tuple[ApiKeyRecord, Tenant] | None
"""A key record and its tenant as read together, or None (key or tenant gone)."""


def _matched(found: _KeyRead, presented: str, pepper: bytes) -> Authenticated | None:
    """The key and tenant read when the presented key matches the record, which is not revoked."""
    if found is None or found[0].revoked or not digest_matches(presented, found[0].digest, pepper):
        return None
    return Authenticated(found[1], found[0])
