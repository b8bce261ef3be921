"""A replica's short-lived memory of authenticated API keys, and its invalidation through Redis pub/sub.

Authentication costs two Redis reads (the key record, then its tenant). :class:`AuthCache` keeps, per key
id, the stored digest and the tenant for ``ttl_s`` (1 s by default) in a bounded table, so a busy key is
read from Redis about once a second per replica. Every write that changes what authentication answers
(key revoked; tenant patched, disabled, enabled, re-quota'd or deleted) drops the entry on the replica
that made it and publishes ``key:<key_id>`` or ``tenant:<tenant_id>`` on ``<prefix>auth-invalidate``;
:func:`follow_invalidations` applies those messages on every replica. A lost message (the subscriber's
connection broke, Redis failed over) costs at most ``ttl_s``: an entry never outlives it, and a replica
clears its whole table each time it (re)subscribes.

A presented key is still checked against the cached HMAC digest in constant time; only keys that passed
are cached (unknown or revoked keys always go to Redis). An entry read before an invalidation arrived is
not stored (:attr:`AuthCache.generation`), so a read racing a revoke cannot bring the old record back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from tenancy.models import ApiKeyRecord, Tenant
from tenancy.pubsub import follow_channel
from tenancy.redis_client import RedisClient

log = structlog.get_logger("radixgate.auth_cache")


def invalidation_channel(prefix: str) -> str:
    """The pub/sub channel of authentication invalidations under Redis key prefix ``prefix``."""
    return f"{prefix}auth-invalidate"


@dataclass(frozen=True, slots=True)
class CachedKey:
    """What authentication learned about one key id.

    Attributes:
        digest: the key record's stored HMAC digest.
        tenant: the key's tenant as read then.
        expires: monotonic s after which the entry is not used.
        verified: the presented key that matched ``digest`` when the entry was stored ("": none); a key
            equal to it (constant-time) passes without the HMAC (about 3 us a request).
        key: the key's record as read then (its terms: expiry, models, quotas, concurrency cap); None:
            not kept (such an entry never passes :meth:`tenancy.store.TenantStore.authenticate_key`).
    """

    digest: str
    tenant: Tenant
    expires: float
    verified: str = ""
    key: ApiKeyRecord | None = None


class AuthCache:
    """Key id -> :class:`CachedKey`, at most ``max_entries`` (the oldest is dropped first), each for
    ``ttl_s`` from the moment its Redis read began.

    Args:
        ttl_s: longest time an entry is trusted, s (0 turns the cache off).
        max_entries: bound on entries (memory).
        clock: monotonic clock, s.
    """

    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._max = max_entries
        self._clock = clock
        self._entries: dict[str, CachedKey] = {}
        self.generation = 0
        """Counts invalidations; a read that saw another generation start is not stored."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        """Whether entries are kept at all."""
        return self.ttl_s > 0

    def now(self) -> float:
        """The cache's clock, s."""
        return self._clock()

    def get(self, key_id: str) -> CachedKey | None:
        """The live entry of ``key_id``, if any (an expired one is dropped)."""
        entry = self._entries.get(key_id)
        if entry is None:
            return None
        if entry.expires <= self._clock():
            del self._entries[key_id]
            return None
        return entry

    def put(
        self,
        key_id: str,
        digest: str,
        tenant: Tenant,
        read_at: float,
        generation: int,
        verified: str = "",
        key: ApiKeyRecord | None = None,
        lifetime_s: float | None = None,
    ) -> None:
        """Remember a successful authentication whose Redis read began at ``read_at`` (clock s) in
        ``generation``; ignored when an invalidation came in between or the cache is off. ``lifetime_s``:
        the most the entry may live from ``read_at`` beside the TTL, s (a key's time left until it
        expires: the entry never outlives the key, so its expiry is read again from Redis)."""
        if not self.enabled or generation != self.generation:
            return
        if key_id not in self._entries and len(self._entries) >= self._max:
            del self._entries[next(iter(self._entries))]  # oldest insertion first
        life = self.ttl_s if lifetime_s is None else min(self.ttl_s, lifetime_s)
        self._entries[key_id] = CachedKey(digest, tenant, read_at + life, verified, key)

    def drop_key(self, key_id: str) -> None:
        """Forget one key id."""
        self.generation += 1
        self._entries.pop(key_id, None)

    def drop_tenant(self, tenant_id: str) -> None:
        """Forget every key of a tenant."""
        self.generation += 1
        for key_id in [k for k, e in self._entries.items() if e.tenant.id == tenant_id]:
            del self._entries[key_id]

    def clear(self) -> None:
        """Forget everything."""
        self.generation += 1
        self._entries.clear()

    def apply(self, message: str) -> None:
        """Apply one invalidation message: ``key:<key_id>`` or ``tenant:<tenant_id>`` (anything else
        clears the whole table)."""
        kind, _, name = message.partition(":")
        if kind == "key" and name:
            self.drop_key(name)
        elif kind == "tenant" and name:
            self.drop_tenant(name)
        else:
            self.clear()


async def follow_invalidations(
    redis: RedisClient,
    channel: str,
    cache: AuthCache,
    retry_s: float = 1.0,
    also: Callable[[str], None] | None = None,
) -> None:
    """Apply the invalidations published on ``channel`` to ``cache`` until cancelled, and hand each
    message to ``also`` (e.g. :meth:`service.pipeline.revocation.RevocationRegistry.on_invalidation`), if
    given.

    ``redis`` must be a client without a read timeout (the subscription waits for messages
    indefinitely); it holds one connection. Every (re)subscription clears the cache (messages may have
    been missed); a broken subscription is retried every ``retry_s`` seconds. ``auth_invalidations_lost``
    is logged once when the subscription breaks (or cannot be made), not at every retry, and
    ``auth_invalidations_resumed`` once it is back (``redis_unreachable`` says why, with the address:
    :mod:`service.observability.redis_watch`). Whatever breaks it (Redis away, a message the client cannot
    decode: any Redis client may publish on the channel) only re-makes the subscription; nothing but a
    cancellation ends this, since revocations must keep reaching the cache.
    """

    def apply(text: str) -> None:
        cache.apply(text)
        if also is not None:
            also(text)

    # every (re)subscription, and every end of one, clears the cache: messages may have been missed
    await follow_channel(
        redis,
        channel,
        apply,
        name="auth_invalidations",
        retry_s=retry_s,
        on_subscribed=lambda _: cache.clear(),
    )


__all__ = ["AuthCache", "CachedKey", "follow_invalidations", "invalidation_channel"]
