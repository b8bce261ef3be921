"""A watchdog for worker streams that go silent: a hung engine whose connection stays open.

Once a stream's first token has come, the gap between two reads of it is a decode step or a few (tens of
milliseconds on a GPU, under a second on a CPU worker), or a preempted request's wait to be scheduled
again. A stream silent for ``idle_s`` is taken to be stuck: the read is cancelled and the stream fails
like a broken one, so it resumes on another worker (:class:`service.pipeline.upstream.UpstreamCaller`)
instead of
holding its tenant until ``upstream.read_timeout_s`` (the bound before the first token, which a long
prefill may need). Same rule as nginx's ``proxy_read_timeout`` (time between two successive reads), with
one timer per stream rather than a timeout around each read (a timeout per read cost about 9 µs per
chunk; see :class:`service.api.cancellation.SendBoundedStreamingResponse`).

The same watch cuts a call on demand (:meth:`StallWatch.cut`): a draining worker's calls still running at
its drain deadline (``upstream.worker_drain_deadline_s``, :meth:`service.workers.pool.WorkerPool.drain`)
fail with :class:`CallMoved` and go on on another worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class StreamStalled(Exception):
    """No data came on a worker stream for ``idle_s`` seconds after its first token."""

    def __init__(self, idle_s: float) -> None:
        super().__init__(f"worker stream silent for {idle_s:g} s after its first token")
        self.idle_s = idle_s


class CallMoved(Exception):
    """The call was cut because its worker is leaving (its drain deadline passed): not the worker's fault."""

    def __init__(self) -> None:
        super().__init__("worker draining: the call moves to another worker (drain deadline)")


class StallWatch:
    """Cancels a read of a stream that waits longer than ``idle_s`` once :meth:`arm` was called.

    One timer per stream wakes every ``idle_s / 4`` and checks whether the read in progress began more than
    ``idle_s`` ago (a stall is cut after 1 to 1.25 x ``idle_s``). Time spent outside :meth:`read` (the
    consumer busy, or a slow client) is not counted. Use as a context manager around the stream.

    Args:
        idle_s: longest silence once armed, s.
    """

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._waiting_since: float | None = None
        self._reader: asyncio.Task[object] | None = None
        self._stalled = False
        self._cut = False

    def arm(self) -> None:
        """Start watching (after the first token). Idempotent."""
        if self._timer is None:
            self._timer = self._loop.call_later(self.idle_s / 4, self._check)

    def _check(self) -> None:
        since = self._waiting_since
        if since is not None and self._reader is not None and self._loop.time() - since >= self.idle_s:
            self._stalled = True
            self._reader.cancel()
            self._timer = None
            return
        self._timer = self._loop.call_later(self.idle_s / 4, self._check)

    def cut(self) -> bool:
        """Cut the call: the read in progress (or the next one) raises :class:`CallMoved`. False when it
        was cut already (the call counts once)."""
        if self._cut:
            return False
        self._cut = True
        if self._waiting_since is not None and self._reader is not None:
            self._reader.cancel()
        return True

    async def read(self, step: Awaitable[T]) -> T:
        """Await ``step`` (the stream's next read) under the watch.

        Raises:
            StreamStalled: the watch cut it after ``idle_s`` of silence.
            CallMoved: :meth:`cut` was called before or during the read (``step`` is then not awaited
                further: a coroutine is closed).
        """
        if self._cut:
            close = getattr(step, "close", None)
            if close is not None:
                close()
            raise CallMoved
        self._reader = asyncio.current_task()
        self._waiting_since = self._loop.time()
        try:
            return await step
        except asyncio.CancelledError:
            ours = self._stalled or self._cut
            if not ours or self._reader is None or self._reader.uncancel() > 0:
                raise  # not the watch's cancellation, or another one came with it (a client that left)
            if self._cut:
                raise CallMoved from None
            raise StreamStalled(self.idle_s) from None
        finally:
            self._waiting_since = None

    def __enter__(self) -> StallWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


__all__ = ["CallMoved", "StallWatch", "StreamStalled"]
