"""Stopping background tasks whose code may swallow a cancellation.

``task.cancel()`` only asks: code the task runs may catch the ``CancelledError`` and go on. redis-py's
asyncio client does so in some states (seen at shutdown: a registry poll's ``HGETALL`` returned normally
after its task was cancelled, the loop went back to sleep, and the lifespan waited for it for ever; a
gateway whose port was taken then hung, ignoring SIGTERM, instead of exiting). :func:`stop_tasks` asks
again until each task has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection

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


__all__ = ["RECANCEL_S", "stop_tasks"]
