"""API keys a replica authenticated recently, for authentication while Redis cannot be reached
(``redis.on_outage = open``).

The auth cache (:mod:`tenancy.auth_cache`) trusts an entry for about a second and is cleared when its
pub/sub subscription breaks, as it does when Redis goes away. :class:`StaleKeys` keeps, per key id, what the
last successful authentication *from Redis* returned (the key's record and its tenant, and the presented key
that matched), for ``stale_s`` from that moment: while Redis is out of reach a key found here is accepted
(its secret still checked in constant time), an unknown key is not (the caller answers 503: never admitted
blind), and a key this replica learnt was revoked (the ``key:<id>`` invalidation of a revocation, or Redis
refusing the very secret it had accepted) is refused for ``stale_s``.

A revocation this replica did not hear of (its subscription was down at the time, while another replica
still reached Redis) is honoured within ``stale_s`` of the key's last authentication from Redis.
A tenant's change (``tenant:<id>``: disabled, re-quota'd, deleted) drops its keys here: they are entered
again, with the new record, at their next authentication from Redis.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tenancy.keys import digest_matches, parse_key, tokens_equal
from tenancy.models import ApiKeyRecord, Tenant

StaleAnswer = tuple[Tenant, ApiKeyRecord] | Literal["refused", "unknown"]
"""What :meth:`StaleKeys.lookup` answers: the key's tenant and record, ``"refused"`` (malformed, wrong
secret, or known revoked: 401) or ``"unknown"`` (not seen within ``stale_s``: 503)."""


@dataclass(frozen=True, slots=True)
class _Known:
    """A key as its last authentication from Redis found it (``record`` None: known revoked)."""

    verified: str
    digest: str
    tenant: Tenant | None
    record: ApiKeyRecord | None
    at: float


class StaleKeys:
    """Key id -> the key's last authentication from Redis, at most ``max_entries`` (the oldest dropped
    first), each used for ``stale_s`` from the moment it was entered.

    Args:
        stale_s: how long an entry is used, s (0: never: every key is unknown).
        max_entries: bound on entries (memory).
        pepper: the HMAC key of the stored digests (a presented key that is not the one entered is checked
            against its record's digest).
        clock: monotonic clock, s.
    """

    def __init__(
        self,
        stale_s: float,
        max_entries: int,
        pepper: bytes,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stale_s = stale_s
        self._max = max_entries
        self._pepper = pepper
        self._clock = clock
        self._entries: OrderedDict[str, _Known] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _put(self, key_id: str, known: _Known) -> None:
        if self.stale_s <= 0:
            return
        self._entries[key_id] = known
        self._entries.move_to_end(key_id)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def remember(self, presented: str, tenant: Tenant, record: ApiKeyRecord) -> None:
        """Enter a key that Redis has just authenticated (``presented`` matched ``record``)."""
        self._put(record.key_id, _Known(presented, record.digest, tenant, record, self._clock()))

    def refused_by_redis(self, presented: str) -> None:
        """Redis refused ``presented`` (401): when it is the very key entered here, it was revoked or deleted
        since, and is refused here from now on; a wrong secret of a known key id changes nothing."""
        parsed = parse_key(presented)
        if parsed is None:
            return
        known = self._entries.get(parsed.key_id)
        if known is not None and known.record is not None and self._matches(parsed.full, known):
            self.revoked(parsed.key_id)

    def revoked(self, key_id: str) -> None:
        """Refuse ``key_id`` from now on, for ``stale_s``."""
        self._put(key_id, _Known("", "", None, None, self._clock()))

    def drop_tenant(self, tenant_id: str) -> None:
        """Forget the keys of ``tenant_id`` (known revoked ones stay refused)."""
        for key_id in [
            k for k, e in self._entries.items() if e.tenant is not None and e.tenant.id == tenant_id
        ]:
            del self._entries[key_id]

    def apply(self, message: str) -> None:
        """Apply one invalidation message (:mod:`tenancy.auth_cache`): ``key:<id>`` (a revocation) marks the
        key revoked, ``tenant:<id>`` forgets the tenant's keys; anything else is ignored (the entries are
        bounded by ``stale_s`` anyway)."""
        kind, _, name = message.partition(":")
        if kind == "key" and name:
            self.revoked(name)
        elif kind == "tenant" and name:
            self.drop_tenant(name)

    def _matches(self, presented: str, known: _Known) -> bool:
        return tokens_equal(presented, known.verified) or digest_matches(
            presented, known.digest, self._pepper
        )

    def lookup(self, presented: str) -> StaleAnswer:
        """Authenticate ``presented`` from memory (Redis cannot be asked).

        Returns:
            ``(tenant, record)`` for a key entered within ``stale_s`` whose secret matches (constant time);
            ``"refused"`` for a malformed key, a wrong secret of a known key id, or a key known revoked;
            ``"unknown"`` otherwise (never seen, or seen longer than ``stale_s`` ago).
        """
        parsed = parse_key(presented)
        if parsed is None:
            return "refused"
        known = self._entries.get(parsed.key_id)
        if known is None:
            return "unknown"
        if self._clock() - known.at > self.stale_s:
            del self._entries[parsed.key_id]
            return "unknown"
        if known.record is None or known.tenant is None or not self._matches(parsed.full, known):
            return "refused"
        return known.tenant, known.record


__all__ = ["StaleAnswer", "StaleKeys"]
