"""Concurrency caps across every gateway replica: slots in Redis sorted sets, held under leases.

A tenant with ``max_concurrent_requests`` (and an API key with its own) has a slot set in Redis
(:meth:`tenancy.layout.KeyLayout.slots`, :meth:`~tenancy.layout.KeyLayout.key_slots`): a sorted set whose
members are the slot ids of the requests in flight, each scored by the end of its lease (ms, on the Redis
server's clock, one clock for every replica). One Lua call (``slot_acquire.lua``) removes the members whose
lease has ended, checks every capped set against its cap and adds the slot to all of them, or to none.
The replica that holds slots renews their leases in one batched call (``slot_renew.lua``) every third of
the lease, from one task per process that runs only while slots are held; a request that ends removes its
slot (``slot_release.lua``). A replica that dies stops renewing: its slots end with their lease (at most
``lease_s`` after its last renewal) and the next acquire of that tenant removes them. The sorted-set
lease is the pattern of Redis semaphores with timeouts (Redis in Action, section 6.3, "Counting
semaphores"), with the lease renewed by its holder as in Chubby's sessions (Burrows, OSDI 2006).

Given the tenant's ``epoch``, the acquire first checks that the tenant record still exists with that epoch
(``tenant_guard.lua``) and writes nothing otherwise; renewals only update members that exist (``ZADD XX``)
and releases only remove them, so a slot racing the tenant's deletion leaves no key behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import structlog
from redis.exceptions import RedisClusterException, RedisError

from tenancy.errors import CallObserver, StoreUnavailable, TenantNotFoundError, store_operation, timed_call
from tenancy.layout import KeyLayout, lua
from tenancy.redis_client import RedisClient
from tenancy.script_batch import ScriptBatcher

log = structlog.get_logger("radixgate.concurrency")

SlotScope = Literal["tenant", "key"]
"""Whose cap a slot set counts against."""

RENEWALS_PER_LEASE = 3
"""Renewals per lease length: a slot is renewed every ``lease_s / 3``, so two renewals in a row may fail
(Redis slow, a pause of the event loop) before its lease ends."""

RETRY_AFTER_S = 1
"""``Retry-After`` of a request refused for a full slot set, s: a slot frees when one of the tenant's
requests ends, which the gateway cannot predict; one second is the shortest a ``Retry-After`` says."""

RENEW_BATCH = 500
"""Most slots renewed by one script call (each a few microseconds of Redis time; the call blocks Redis)."""


@dataclass(frozen=True, slots=True, eq=False)
class HeldSlot:
    """One request's slot, held in each of its slot sets.

    Attributes:
        slot_id: unique id of the slot (the member in each set), 16 hex characters.
        tenant_id: whose slot.
        sets: RedisClient keys of the slot sets it holds a member in (the tenant's, the key's: those capped).
    """

    slot_id: str
    tenant_id: str
    sets: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SlotRefused:
    """An acquire that found a slot set full; nothing was taken.

    Attributes:
        scope: the set that is full (``"tenant"`` or ``"key"``; the tenant's is checked first).
        cap: its cap, requests.
        held: its live slots when refused, requests.
    """

    scope: SlotScope
    cap: int
    held: int


class ConcurrencyLimiter:
    """The Python face of ``slot_acquire.lua``, ``slot_renew.lua`` and ``slot_release.lua``, and the
    replica's record of the slots it holds.

    Args:
        redis: async client (``decode_responses=True``).
        prefix: RedisClient key prefix.
        lease_s: a slot's lease, s: a slot its holder stops renewing is free again after at most this.
        on_lost: called with the number of slots found lost by a renewal (their lease ended before it
            landed, e.g. Redis was unreachable for longer than the lease), for a metric.

    ``observe_call``: told the latency of each acquire, renewal (all its batches) and release
    (:func:`tenancy.errors.store_operation`).
    """

    observe_call: CallObserver | None = None

    def __init__(
        self,
        redis: RedisClient,
        prefix: str,
        lease_s: float,
        on_lost: Callable[[int], None] | None = None,
    ) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be above 0, got {lease_s}")
        self._layout = KeyLayout(prefix)
        self._acquire = redis.register_script(lua("slot_acquire.lua", guarded=True, buckets=True))
        self._renew = redis.register_script(lua("slot_renew.lua", buckets=True))
        self._release = redis.register_script(lua("slot_release.lua"))
        self._batch = ScriptBatcher(redis)
        self.lease_s = lease_s
        self.renew_every_s = lease_s / RENEWALS_PER_LEASE
        self._on_lost = on_lost
        self._held: dict[str, HeldSlot] = {}
        self._renewer: asyncio.Task[None] | None = None
        self._releases: set[asyncio.Task[None]] = set()

    @property
    def held(self) -> int:
        """Slots this replica holds now."""
        return len(self._held)

    def slot_sets(
        self, tenant_id: str, tenant_cap: int | None, key_id: str, key_cap: int | None
    ) -> list[tuple[SlotScope, str, int]]:
        """``(scope, Redis key, cap)`` of the slot sets a request takes a slot in: the tenant's when it
        has a cap, the key's when it has one (and a key id)."""
        sets: list[tuple[SlotScope, str, int]] = []
        if tenant_cap is not None:
            sets.append(("tenant", self._layout.slots(tenant_id), tenant_cap))
        if key_cap is not None and key_id:
            sets.append(("key", self._layout.key_slots(tenant_id, key_id), key_cap))
        return sets

    @store_operation
    async def acquire(
        self,
        tenant_id: str,
        tenant_cap: int | None,
        key_id: str = "",
        key_cap: int | None = None,
        epoch: str | None = None,
        now_ms: float | None = None,
    ) -> HeldSlot | SlotRefused | None:
        """Take a slot in the tenant's set (when ``tenant_cap`` is set) and the key's (when ``key_cap`` is
        set), all or nothing, and renew it from now on until :meth:`release`.

        Args:
            tenant_id: whose slot.
            tenant_cap: the tenant's ``max_concurrent_requests`` (None: no tenant set).
            key_id: the API key's id ("" or ``key_cap`` None: no key set).
            key_cap: the key's ``max_concurrent_requests``.
            epoch: the tenant record's epoch as the caller read it; None skips the tenant check.
            now_ms: test hook; None uses the Redis server's clock.

        Returns:
            The :class:`HeldSlot`, a :class:`SlotRefused` (nothing taken), or None when no cap applies
            (no Redis call).

        Raises:
            TenantNotFoundError: ``epoch`` was given and the tenant is gone (nothing was written).
            StoreUnavailable: RedisClient is unavailable; whatever the call may have taken is released.
        """
        sets = self.slot_sets(tenant_id, tenant_cap, key_id, key_cap)
        if not sets:
            return None
        slot = HeldSlot(secrets.token_hex(8), tenant_id, tuple(name for _, name, _ in sets))
        keys = [self._layout.tenant(tenant_id), *slot.sets]
        args: list[str | int | float] = [
            "" if now_ms is None else repr(float(now_ms)),
            "0" if epoch is None else "1",
            epoch or "",
            slot.slot_id,
            max(1, round(self.lease_s * 1000)),
            *(cap for _, _, cap in sets),
        ]
        try:
            reply = await self._batch.run(self._acquire, keys, args)
        except BaseException:  # cancelled or failed: the call may have landed; remove what it may have added
            self._release_later(slot)
            raise
        status = int(reply[0])
        if status == -2:
            raise TenantNotFoundError(tenant_id)
        if status == 0:
            scope, _, cap = sets[int(reply[1]) - 1]
            return SlotRefused(scope, cap, int(reply[2]))
        self._held[slot.slot_id] = slot
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_loop(), name="slot-leases")
        return slot

    def release(self, slot: HeldSlot) -> None:
        """Give ``slot`` back: it is no longer renewed, and its removal from Redis starts in a task of its
        own (off the request's path). A slot released twice, or found lost, is removed once."""
        if self._held.pop(slot.slot_id, None) is not None:
            self._release_later(slot)

    def _release_later(self, slot: HeldSlot) -> None:
        task = asyncio.get_running_loop().create_task(self._remove(slot))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _remove(self, slot: HeldSlot) -> None:
        try:
            await timed_call(
                self.observe_call,
                "ConcurrencyLimiter.release",
                self._batch.run(self._release, list(slot.sets), [slot.slot_id]),
            )
        except (TimeoutError, RedisError, RedisClusterException, OSError) as exc:  # its lease ends it
            log.warning(
                "concurrency_release_failed", tenant=slot.tenant_id, error=f"{type(exc).__name__}: {exc}"
            )

    async def wait_released(self) -> None:
        """Wait until the releases started so far have landed (or failed)."""
        if self._releases:
            await asyncio.wait(set(self._releases))

    @store_operation
    async def renew(self, now_ms: float | None = None) -> list[HeldSlot]:
        """Extend the lease of every slot this replica holds to ``lease_s`` from now, in script calls of
        at most :data:`RENEW_BATCH` slots; returns the slots found lost (gone from a set, or their lease
        ended first), which are no longer renewed and are removed from their other sets.

        Raises:
            StoreUnavailable: RedisClient is unavailable (the leases not renewed end in time).
        """
        held = list(self._held.values())
        found: list[HeldSlot] = []
        for start in range(0, len(held), RENEW_BATCH):
            found += await self._renew_batch(held[start : start + RENEW_BATCH], now_ms)
        lost = [slot for slot in found if self._held.pop(slot.slot_id, None) is not None]  # not released
        for slot in lost:
            self._release_later(slot)
        if lost:
            log.warning(
                "concurrency_slots_lost", slots=len(lost), tenants=sorted({s.tenant_id for s in lost})
            )
            if self._on_lost is not None:
                self._on_lost(len(lost))
        return lost

    async def _renew_batch(self, slots: Sequence[HeldSlot], now_ms: float | None) -> list[HeldSlot]:
        pairs = [(name, slot) for slot in slots for name in slot.sets]
        args: list[str | int | float] = [
            "" if now_ms is None else repr(float(now_ms)),
            max(1, round(self.lease_s * 1000)),
            *(slot.slot_id for _, slot in pairs),
        ]
        reply = await self._batch.run(self._renew, [name for name, _ in pairs], args)
        gone = {pairs[int(i) - 1][1].slot_id: pairs[int(i) - 1][1] for i in reply[1:]}
        return list(gone.values())

    async def _renew_loop(self) -> None:
        """Renew the held slots every ``renew_every_s``; ends when none is held."""
        try:
            while self._held:
                await asyncio.sleep(self.renew_every_s)
                if not self._held:
                    break
                try:
                    await self.renew()
                except (StoreUnavailable, RedisError) as exc:  # retried next period; leases end otherwise
                    log.warning("concurrency_renewal_failed", slots=len(self._held), error=str(exc))
        finally:
            self._renewer = None

    async def close(self) -> None:
        """Stop renewing and release every slot still held (at shutdown, while Redis is open)."""
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        for slot in list(self._held.values()):
            self.release(slot)
        await self.wait_released()
