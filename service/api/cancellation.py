"""Run a handler's work until it finishes or the client disconnects (then cancel the work).

Same idea as vLLM's ``with_cancellation``: race the work against ``http.disconnect`` on the ASGI receive
channel, so a client that goes away cancels the upstream call and the pipeline unwinds (abort, refund).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

import structlog
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from service.observability.breakdown import RequestTiming
from service.runtime.http_protocol import ABORT_EXTENSION

log = structlog.get_logger("radixgate.api")

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """:func:`race_disconnect` on ``request``'s receive channel."""
    return await race_disconnect(request.receive, work)


async def race_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work`` in this task; if the client disconnects first (``http.disconnect`` on ASGI channel
    ``receive``), cancel it and raise :class:`ClientDisconnected`.

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
        while (await receive())["type"] != "http.disconnect":
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


class SendBoundedStreamingResponse(StreamingResponse):
    """A streaming response that gives up on a client that stops reading.

    Once the socket buffers are full, each write waits for the client to take data (uvicorn's flow
    control); a write still waiting after ``send_timeout_s`` ends the stream: the body generator is
    closed (its ``GeneratorExit`` is a client that left: abort at the worker, charge what was generated,
    499), a ``stream_stalled`` warning is logged, and the handler returns with the response incomplete,
    so the server closes the connection. The bound covers the writes only, not the waits for the
    worker's next chunk. Same rule as nginx's ``send_timeout`` (time between two successive writes).

    One watchdog timer per stream checks every ``send_timeout_s / 4`` whether the write in progress
    started longer than ``send_timeout_s`` ago (a stall is cut after 1 to 1.25 x ``send_timeout_s``); a
    timeout around each write cost 9 us per chunk against 0.2 us (micro-benchmark under uvloop on the
    2-core development machine).

    Args:
        content: the SSE body (an async generator: it is closed when the client stalls).
        send_timeout_s: longest wait for one write, s.
        request_id: logged with the warning.
        timing: the request's breakdown: each write's time is added to its ``client_write`` phase.
    """

    def __init__(
        self,
        content: AsyncGenerator[bytes, None],
        send_timeout_s: float,
        request_id: str,
        timing: RequestTiming | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__(content, **kwargs)  # type: ignore[arg-type]
        self._content = content
        self._send_timeout_s = send_timeout_s
        self._request_id = request_id
        self._timing = timing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream until the body ends or the client disconnects (then the body's task is cancelled: abort at
        the worker, charge what was generated, 499). One watcher task (:func:`race_disconnect`) instead of
        Starlette's anyio task group, which left cyclic garbage per stream (its tasks, their contexts and
        the request's coroutine) for Python's collector to find (``gc.DEBUG_SAVEALL`` under bench stream)."""
        try:
            await race_disconnect(receive, self.stream_response(send))
        except ClientDisconnected:
            pass
        except _Stalled:
            # closed once the disconnect watcher has stopped: a client that left meanwhile would cancel
            # the close part-way (the body's abort at the worker and settle)
            log.warning("stream_stalled", request_id=self._request_id, send_timeout_s=self._send_timeout_s)
            await self._content.aclose()
            await _reset_connection(scope, receive)

    async def stream_response(self, send: Send) -> None:
        """Stream the body; cancel it when one write waits longer than ``send_timeout_s``."""
        task = asyncio.current_task()
        assert task is not None
        watchdog = _WriteWatchdog(task, self._send_timeout_s)

        timing = self._timing

        async def timed_send(message: Message) -> None:
            # the watchdog reads the loop's clock; the phase reads perf_counter: uvloop's loop.time() is
            # libuv's cached millisecond clock, which rounded each write to 0 or whole ms
            watchdog.writing_since = watchdog.loop.time()
            began = time.perf_counter()
            try:
                await send(message)
            finally:
                watchdog.writing_since = None
                if timing is not None:
                    timing.wrote(time.perf_counter() - began)

        try:
            await super().stream_response(timed_send)
        except asyncio.CancelledError:
            if not watchdog.stalled:
                raise
            task.uncancel()
            raise _Stalled from None
        finally:
            watchdog.stop()


RESET_WAIT_S = 1.0
"""Longest wait for the server to report a reset connection lost, s (it does so on the next loop step)."""


async def _reset_connection(scope: Scope, receive: Receive) -> None:
    """Reset the connection of a response given up on purpose, through the server's
    :data:`service.runtime.http_protocol.ABORT_EXTENSION`, and wait until the server has seen it lost: the
    response then ends as a client that left, not as an app that returned without completing it (uvicorn
    logs that at ERROR). Without the extension (another server) nothing is done: the server closes the
    connection as it does for any incomplete response."""
    extension = scope.get("extensions", {}).get(ABORT_EXTENSION)
    if extension is None:
        return
    extension["abort"]()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(RESET_WAIT_S):
            while (await receive())["type"] != "http.disconnect":
                pass


class _Stalled(Exception):
    """A write waited longer than the send timeout (the stream is closed by the caller)."""


class _WriteWatchdog:
    """Cancels ``task`` once a write started ``timeout_s`` ago is still waiting (``writing_since``, loop
    time, s, set by the writer), checking every ``timeout_s / 4``; :meth:`stop` when the stream ends.

    A class rather than a closure that re-arms itself: that closure referred to itself and to its timer
    handle, so each stream left a cycle (with its task and coroutine) for Python's collector to find.
    """

    __slots__ = ("loop", "period_s", "stalled", "task", "timeout_s", "timer", "writing_since")

    def __init__(self, task: asyncio.Task[object], timeout_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = task
        self.timeout_s = timeout_s
        self.period_s = timeout_s / 4
        self.writing_since: float | None = None
        self.stalled = False
        self.timer: asyncio.TimerHandle | None = self.loop.call_later(self.period_s, self._check)

    def _check(self) -> None:
        if self.writing_since is not None and self.loop.time() - self.writing_since >= self.timeout_s:
            self.stalled, self.timer = True, None
            self.task.cancel()
            return
        self.timer = self.loop.call_later(self.period_s, self._check)

    def stop(self) -> None:
        """Stop checking (the handle, which holds this object, is dropped)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
