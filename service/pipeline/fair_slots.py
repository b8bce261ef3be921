"""A counting semaphore whose waiters are served round robin across tenants.

The long-prompt preparations (:meth:`service.pipeline.dispatch.Dispatcher.prepare_offloaded`) share a few
worker
threads. With a plain FIFO semaphore one tenant that sends a hundred long prompts makes every other
tenant's long prompt wait behind all hundred (each costs up to about a second of tokenizing), and each
waiting request holds its body in memory. :class:`FairSlots` hands a freed slot to the next tenant in
turn (one grant per tenant per round, FIFO within a tenant: deficit round robin with equal quanta and unit
costs, Shreedhar & Varghese, SIGCOMM 1995), and bounds how many requests one tenant may have waiting.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress


class TooManyWaiting(Exception):
    """The tenant already has ``max_waiting`` requests waiting for a slot."""


class FairSlots:
    """At most ``slots`` holders at once; waiters get freed slots round robin across tenants.

    Args:
        slots: holders at once (>= 1).
        max_waiting: most waiters one tenant may have (>= 0); one more raises :class:`TooManyWaiting`.
    """

    def __init__(self, slots: int, max_waiting: int) -> None:
        if slots < 1 or max_waiting < 0:
            raise ValueError("slots must be >= 1 and max_waiting >= 0")
        self._free = slots
        self._max_waiting = max_waiting
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}  # insertion order = turn order

    def waiting(self, tenant: str | None = None) -> int:
        """Waiters of ``tenant`` (of every tenant when None)."""
        if tenant is not None:
            return len(self._queues.get(tenant, ()))
        return sum(len(q) for q in self._queues.values())

    @asynccontextmanager
    async def hold(self, tenant: str) -> AsyncIterator[None]:
        """Hold a slot for the body of the ``with``.

        Raises:
            TooManyWaiting: no slot is free and ``tenant`` already has ``max_waiting`` waiters.
            asyncio.CancelledError: cancelled while waiting (the place in line is given up).
        """
        await self._acquire(tenant)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, tenant: str) -> None:
        if self._free > 0 and not self._queues:
            self._free -= 1
            return
        queue = self._queues.get(tenant)
        if len(queue or ()) >= self._max_waiting:
            raise TooManyWaiting(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._release()  # the slot came with the cancellation: pass it on
            else:
                self._forget(tenant, granted)
            raise

    def _forget(self, tenant: str, granted: asyncio.Future[None]) -> None:
        queue = self._queues.get(tenant)
        if queue is not None:
            with suppress(ValueError):
                queue.remove(granted)
            if not queue:
                del self._queues[tenant]

    def _release(self) -> None:
        """Give the slot to the first waiter of the tenant whose turn it is (that tenant goes last)."""
        while self._queues:
            tenant = next(iter(self._queues))
            queue = self._queues.pop(tenant)
            granted = queue.popleft()
            if queue:
                self._queues[tenant] = queue
            if not granted.done():
                granted.set_result(None)
                return
        self._free += 1


__all__ = ["FairSlots", "TooManyWaiting"]
