"""Ending in-flight requests when their tenant is disabled or deleted, or their API key is revoked.

Authentication happens once, at arrival; a long stream outlives it. An operator who disables a tenant,
deletes it or revokes a leaked key expects its work to stop, not to run to ``max_tokens``. Every write
that changes what authentication answers already publishes ``tenant:<id>`` or ``key:<id>`` on the
replicas' invalidation channel (:mod:`tenancy.auth_cache`). :class:`RevocationRegistry` follows the same
messages: when one names a tenant or key with requests in flight on this replica, it reads the tenant or
key again from Redis, and if it no longer authenticates, ends those requests: each request's task is
cancelled with the reason attached, and the dispatcher turns that cancellation into the error a new
request would get (401 ``invalid_api_key``, 403 ``tenant_disabled``). A streamed answer already under way
ends with that error event; its worker requests are aborted and the tokens generated so far are charged.

A stopping gateway process ends what is still in flight at its drain's deadline the same way
(:meth:`RevocationRegistry.end_all`, :mod:`service.runtime.drain`): 503 ``shutting_down``, charged what was
generated.

A message lost with the subscriber's connection is not replayed, so a revocation that races a Redis
failover may leave streams running to their end (new requests are refused either way).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import structlog

from service.errors import GatewayError, PermissionDenied, Unauthenticated
from tenancy.errors import TenantNotFoundError
from tenancy.store import TenantStore

log = structlog.get_logger("radixgate.revocation")

T = TypeVar("T")

Check = Callable[[str], Awaitable[GatewayError | None]]
"""Reads a tenant (or key) again: the error a new request of it would get now, or None if it still
authenticates. May raise (Redis unavailable): nothing is ended then."""


@dataclass(slots=True, eq=False)
class Revocable:
    """One in-flight request that can be ended.

    Attributes:
        rid: the request id.
        tenant_id: its tenant.
        key_id: the id of the API key it came with.
        task: the task now serving it (the dispatcher sets it: a stream moves from the route's task to
            the response's once its first event is out), None while it awaits nothing that may be cut
            (a stream handing an event to its client).
        error: why it was ended (set just before its task, if any, is cancelled; a stream checks it
            before each await of its worker, so a revocation while it sends an event is not lost), else
            None.
        charge: whether what its worker computed is charged when it is ended (a revocation: yes; the
            scheduler giving it up for want of a first token: no, :meth:`RevocationRegistry.end_request`).
    """

    rid: str
    tenant_id: str
    key_id: str
    task: asyncio.Task[object] | None = None
    error: GatewayError | None = field(default=None)
    charge: bool = True

    def take_error(self) -> GatewayError | None:
        """The error this request was ended with, uncancelling the current task once (None: the
        cancellation came from elsewhere and must propagate)."""
        if self.error is None:
            return None
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            task.uncancel()
        return self.error

    async def guard(self, work: Awaitable[T]) -> T:
        """Await ``work`` as the request's cancellable step: :meth:`RevocationRegistry.end` may cancel it
        only while it runs (the task is named for this await alone).

        Raises:
            GatewayError: the revocation's error, when it ended the request meanwhile.
        """
        if self.error is not None:  # ended before it got here (the drain's deadline: end_all)
            close = getattr(work, "close", None)
            if close is not None:
                close()  # never awaited: no "coroutine was never awaited" warning
            raise self.error
        self.task = asyncio.current_task()
        try:
            return await work
        except asyncio.CancelledError:
            error = self.take_error()
            if error is None:
                raise
            raise error from None
        finally:
            self.task = None


class RevocationRegistry:
    """The requests in flight on this replica, by tenant and by API key.

    Args:
        tenant_check: reads a tenant again (:data:`Check`).
        key_check: reads an API key again (:data:`Check`).
        enabled: False makes :meth:`on_invalidation` a no-op (requests run to their end).
    """

    def __init__(self, tenant_check: Check, key_check: Check, enabled: bool = True) -> None:
        self._checks = {"tenant": tenant_check, "key": key_check}
        self.enabled = enabled
        self._by: dict[str, dict[str, dict[str, Revocable]]] = {"tenant": {}, "key": {}}
        self._checking: set[asyncio.Task[None]] = set()
        self._ending: GatewayError | None = None  # set by end_all: later requests end at once too

    def track(self, rid: str, tenant_id: str, key_id: str) -> Revocable:
        """Register a request from now until :meth:`untrack`; its task is the current one. After
        :meth:`end_all` the request is ended from the start (its first guarded step raises the error)."""
        entry = Revocable(rid, tenant_id, key_id, asyncio.current_task())
        entry.error = self._ending
        for kind, name in (("tenant", tenant_id), ("key", key_id)):
            if name:
                self._by[kind].setdefault(name, {})[rid] = entry
        return entry

    def untrack(self, entry: Revocable) -> None:
        """Forget a request (it ended)."""
        for kind, name in (("tenant", entry.tenant_id), ("key", entry.key_id)):
            group = self._by[kind].get(name)
            if group is not None:
                group.pop(entry.rid, None)
                if not group:
                    del self._by[kind][name]

    def in_flight(self, kind: str, name: str) -> int:
        """Requests tracked for tenant (``kind="tenant"``) or key (``"key"``) ``name``."""
        return len(self._by.get(kind, {}).get(name, {}))

    def on_invalidation(self, message: str) -> None:
        """Handle one invalidation message (``tenant:<id>`` or ``key:<id>``): when requests of it are in
        flight here, check it again in the background and end them if it no longer authenticates."""
        kind, _, name = message.partition(":")
        if not self.enabled or not name or not self._by.get(kind, {}).get(name):
            return
        task = asyncio.get_running_loop().create_task(self._check(kind, name), name=f"revocation-{kind}")
        self._checking.add(task)
        task.add_done_callback(self._checking.discard)

    async def _check(self, kind: str, name: str) -> None:
        try:
            error = await self._checks[kind](name)
        except Exception as exc:  # Redis unavailable: leave them running (new requests are checked anyway)
            log.warning("revocation_check_failed", kind=kind, id=name, error=f"{type(exc).__name__}: {exc}")
            return
        if error is not None:
            self.end(kind, name, error)

    def end(self, kind: str, name: str, error: GatewayError) -> int:
        """End every request of tenant or key ``name`` with ``error``; returns how many were ended. One
        already cancelled from elsewhere (its client left) is left to its clean-up: a second cancellation
        would cut short its abort at the worker."""
        entries = list(self._by.get(kind, {}).get(name, {}).values())
        ended = sum(_end(entry, error) for entry in entries)
        if ended:
            log.info("requests_revoked", kind=kind, id=name, requests=ended, code=error.code)
        return ended

    def end_request(self, tenant_id: str, rid: str, error: GatewayError) -> bool:
        """End one request of ``tenant_id`` with ``error``, charging nothing for it (the scheduler gave it
        up: :class:`service.errors.FirstTokenTimeout`); False when it is not in flight here, or ended
        or cancelled already. Works whether or not revocations are ``enabled``."""
        entry = self._by["tenant"].get(tenant_id, {}).get(rid)
        if entry is None:
            return False
        if not _end(entry, error):
            return False
        entry.charge = False  # read as its task unwinds, after this
        return True

    def end_all(self, error: GatewayError) -> int:
        """End every request in flight here with ``error``, and every one registered later (the process
        is stopping: :mod:`service.runtime.drain`); returns how many were ended now. Charged like a
        revocation:
        what their workers generated. Works whether or not revocations are ``enabled``."""
        self._ending = error
        entries = {id(e): e for group in self._by["tenant"].values() for e in group.values()}
        ended = sum(_end(entry, error) for entry in entries.values())
        if ended:
            log.info("requests_ended", requests=ended, code=error.code)
        return ended

    async def stop(self) -> None:
        """Cancel the checks still running (shutdown)."""
        for task in list(self._checking):
            task.cancel()
        await asyncio.gather(*self._checking, return_exceptions=True)


def _end(entry: Revocable, error: GatewayError) -> bool:
    """End ``entry`` with ``error`` (cancel its task); False when it was ended already or is cancelled
    from elsewhere (its client left: a second cancellation would cut short its abort at the worker)."""
    task = entry.task
    if entry.error is not None or (task is not None and (task.done() or task.cancelling())):
        return False
    entry.error = error
    if task is not None:
        task.cancel()
    return True


def store_checks(store: TenantStore) -> tuple[Check, Check]:
    """The tenant and key checks of :class:`RevocationRegistry` on ``store``: the errors
    :func:`service.api.deps.authenticate` gives a new request (401 for a deleted tenant or a revoked key,
    403 for a disabled tenant)."""

    async def tenant(tenant_id: str) -> GatewayError | None:
        try:
            found = await store.get(tenant_id)
        except TenantNotFoundError:
            return Unauthenticated(f"Tenant '{tenant_id}' was deleted.", code="invalid_api_key")
        if not found.enabled:
            return PermissionDenied(f"Tenant '{tenant_id}' is disabled.", code="tenant_disabled")
        return None

    async def key(key_id: str) -> GatewayError | None:
        if await store.key_revoked(key_id):
            return Unauthenticated("The API key was revoked.", code="invalid_api_key")
        return None

    return tenant, key


__all__ = ["Check", "Revocable", "RevocationRegistry", "store_checks"]
