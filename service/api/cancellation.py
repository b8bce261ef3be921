"""Run a handler's work until it finishes or the client disconnects (then cancel the work).

Same idea as vLLM's ``with_cancellation``: race the work against ``http.disconnect`` on the ASGI receive
channel, so a client that goes away cancels the upstream call and the pipeline unwinds (abort, refund).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` in this task; if the client disconnects first, cancel it and raise
    :class:`ClientDisconnected`.

    One watcher task reads the ASGI receive channel; on ``http.disconnect`` it cancels the task that
    awaits ``work``, whose own cancellation handling (abort at the worker, refund) runs as it unwinds.
    The work runs inline, not in a task of its own: the work's task, a watcher task and an
    ``asyncio.wait`` cost about 16 µs of CPU per request against about 7 µs for one watcher task
    (micro-benchmark under uvloop on the 2-core development machine).

    The request body must already have been read. A cancellation from elsewhere (server shutdown)
    propagates unchanged.
    """
    current = asyncio.current_task()
    assert current is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        current.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        current.uncancel()
        raise ClientDisconnected from None
    finally:
        watcher.cancel()
