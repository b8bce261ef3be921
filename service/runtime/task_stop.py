"""Stopping background tasks whose code may swallow a cancellation; finishing work whatever cancels.

``task.cancel()`` only asks: code the task runs may catch the ``CancelledError`` and go on. redis-py's
asyncio client does so in some states (seen at shutdown: a registry poll's ``HGETALL`` returned normally
after its task was cancelled, the loop went back to sleep, and the lifespan waited for it for ever; a
gateway whose port was taken then hung, ignoring SIGTERM, instead of exiting). :func:`stop_tasks` asks
again until each task has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Collection
from typing import TypeVar

import structlog

T = TypeVar("T")
log = structlog.get_logger("radixgate.tasks")

RECANCEL_S = 0.5
"""Time a cancelled task gets to end before it is cancelled again, s."""


async def stop_tasks(tasks: Collection[asyncio.Task[None]], recancel_s: float = RECANCEL_S) -> None:
    """Cancel ``tasks`` and wait until every one has ended, cancelling those still running every
    ``recancel_s`` seconds. A task that ends with an exception other than ``CancelledError`` raises it
    here (after all have ended), as awaiting it would."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_s)
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


def log_failure(task: asyncio.Task[None]) -> None:
    """A done-callback for a background task that should run for the process's life: logs
    ``background_task_failed`` (error level, with the task's name and exception) when it ended with an
    exception, at once rather than only when :func:`stop_tasks` awaits it at shutdown. A cancelled task or
    one that returned is not logged."""
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    log.error("background_task_failed", task=task.get_name(), error=f"{type(exc).__name__}: {exc}")


async def finish_despite_cancel(work: Awaitable[T]) -> T:
    """Await ``work`` to its end in a task of its own, however often the calling task is cancelled
    meanwhile (a client that leaves, then a revocation or a shutdown); the caller's cancellation is raised
    once ``work`` has ended. For clean-up that must not be cut short (an abort at the worker, a settle,
    closing an upstream stream): anyio's ``CancelScope(shield=True)`` does not stop a plain
    ``task.cancel()``, which still reaches the awaits inside it.

    Returns:
        ``work``'s result when the caller was not cancelled.

    Raises:
        asyncio.CancelledError: the caller was cancelled (after ``work`` ended; its own error, if any, is
            then dropped).
        Exception: ``work``'s own error, when the caller was not cancelled.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])  # a cancelled wait leaves ``task`` running
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" warning
        raise asyncio.CancelledError
    return task.result()


__all__ = ["RECANCEL_S", "finish_despite_cancel", "stop_tasks"]
