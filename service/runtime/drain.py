"""Stopping as a state of one gateway process: the drain between SIGTERM (or SIGINT) and the exit.

:class:`Drain` holds the state that admission and readiness read (``draining``) and the count of HTTP
requests in the app (the ASGI entry counts them: :class:`service.app.GatewayApp`). From the signal on:

1. ``draining`` is True: ``/readyz`` answers 503 (``"draining": true``) and every new request but the
   probes and ``/metrics`` gets 503 ``shutting_down`` with ``Retry-After`` and ``Connection: close``; the
   listening socket stays open, so nothing new is accepted and left unanswered;
2. the requests in flight run on until none is left or ``shutdown.drain_timeout_s`` has passed;
3. those still running are then ended (:meth:`service.pipeline.revocation.RevocationRegistry.end_all`: a
stream
   ends with a ``shutting_down`` error event and ``[DONE]``, a non-streamed request gets 503; each is
   aborted at its worker and charged what it generated, as a revocation is) and get
   ``shutdown.end_timeout_s`` to settle;
4. the handler that was installed before (uvicorn's ``Server.handle_exit``) is called: uvicorn closes the
   listening socket (new connections are refused from then on), closes idle connections and runs the
   lifespan's shutdown.

``drain_started`` and ``drain_finished`` are logged with the counts in flight. :func:`drain_on_signals`
installs the signal handlers for the lifespan's serving part (main thread only: an app served from a thread
in tests drains only when :meth:`Drain.begin` is called).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import structlog

from service.config.shutdown import ShutdownSettings
from service.errors import GatewayError, ShuttingDown

log = structlog.get_logger("radixgate.drain")

EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)

SERVED_WHILE_DRAINING = frozenset({"/healthz", "/readyz", "/metrics"})
"""Paths answered as usual during a drain: liveness (the process is alive and finishing its work: a
liveness failure would have it killed), readiness (its 503 says the drain) and the metrics (the drain's
progress); everything else is refused with 503."""

RETRY_AFTER_S = 1.0
"""``Retry-After`` of a request refused during a drain, s: another replica (or this one's successor)
takes it."""


def shutting_down() -> ShuttingDown:
    """The error of a request refused, or ended, because its gateway process is stopping (503)."""
    return ShuttingDown(
        "This gateway process is shutting down; retry (another replica will take the request).",
        retry_after_s=RETRY_AFTER_S,
    )


class Drain:
    """The drain state of one gateway process.

    Args:
        settings: ``shutdown.*`` (deadline and end timeout, s).
        end_all: ends every request in flight with the given error, returns how many it ended
            (:meth:`service.pipeline.revocation.RevocationRegistry.end_all`).

    Attributes:
        draining: True from :meth:`begin` on (read by admission and ``/readyz``).
        in_flight: HTTP requests in the app now (:meth:`enter` / :meth:`leave`).
        finished: True once the drain is over (the exit was asked for).
    """

    __slots__ = ("_cut", "_end_all", "_idle", "_settings", "_task", "draining", "finished", "in_flight")

    def __init__(self, settings: ShutdownSettings, end_all: Callable[[GatewayError], int]) -> None:
        self._settings = settings
        self._end_all = end_all
        self.draining = False
        self.finished = False
        self.in_flight = 0
        self._idle: asyncio.Event | None = None  # made when the drain begins (on the running loop)
        self._cut: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def enter(self) -> None:
        """One more request in the app."""
        self.in_flight += 1

    def leave(self) -> None:
        """One request fewer (it returned); wakes the drain when it was the last."""
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    def begin(self, then: Callable[[], None], why: str = "") -> bool:
        """Start draining (on the running loop); ``then`` is called once the drain is over (whatever
        happens). A drain already begun is left as it is: False.

        Args:
            then: what stops the server (uvicorn's exit handler).
            why: what started it, for the log (e.g. ``"SIGTERM"``).
        """
        if self.draining:
            return False
        self.draining = True
        self._idle = asyncio.Event()
        self._cut = asyncio.Event()
        if self.in_flight == 0:
            self._idle.set()
        self._task = asyncio.get_running_loop().create_task(self._run(then, why), name="drain")
        return True

    def cut_short(self) -> None:
        """Reach the deadline now (a second Ctrl-C): what is in flight is ended at once."""
        if self._cut is not None:
            self._cut.set()

    async def wait(self) -> None:
        """Until the drain is over (returns at once when it never began)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _run(self, then: Callable[[], None], why: str) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert self._idle is not None and self._cut is not None
        log.info(
            "drain_started",
            signal=why or None,
            in_flight=self.in_flight,
            drain_timeout_s=self._settings.drain_timeout_s,
        )
        ended = 0
        try:
            idle = asyncio.ensure_future(self._idle.wait())
            cut = asyncio.ensure_future(self._cut.wait())
            try:
                await asyncio.wait(
                    {idle, cut}, timeout=self._settings.drain_timeout_s, return_when="FIRST_COMPLETED"
                )
            finally:
                idle.cancel()
                cut.cancel()
            if self.in_flight:
                left = self.in_flight
                ended = self._end_all(shutting_down())
                log.warning(
                    "drain_deadline", in_flight=left, ended=ended, waited_s=round(loop.time() - started, 3)
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), self._settings.end_timeout_s)
            log.info(
                "drain_finished",
                in_flight=self.in_flight,
                ended=ended,
                drain_s=round(loop.time() - started, 3),
            )
        finally:
            self.finished = True
            then()


@contextlib.contextmanager
def drain_on_signals(drain: Drain) -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT begin ``drain`` instead of stopping the server at once: the
    handler installed before (uvicorn's ``Server.handle_exit``, which makes it shut down) is called with
    the first signal once the drain is over. A second SIGTERM during the drain is ignored (a process group
    signalled as a whole, then again by its parent); a second SIGINT (Ctrl-C again) cuts the drain short.
    After the drain, signals go to the previous handler as they came. Handlers are restored on exit. Off
    the main thread (tests serving the app in a thread) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    previous: dict[int, Any] = {sig: signal.getsignal(sig) for sig in EXIT_SIGNALS}

    def stop(sig: int) -> Callable[[], None]:
        def call() -> None:
            before = previous[sig]
            if callable(before):
                before(sig, None)
            else:  # no server handler: the default action of the signal, handlers back first
                for number, handler in previous.items():
                    signal.signal(number, handler)
                signal.raise_signal(sig)

        return call

    def handler(sig: int, frame: FrameType | None) -> None:
        if drain.finished:
            before = previous[sig]
            if callable(before):
                before(sig, frame)
            return
        if not drain.draining:
            name = signal.Signals(sig).name
            loop.call_soon_threadsafe(drain.begin, stop(sig), name)
        elif sig == signal.SIGINT:
            loop.call_soon_threadsafe(drain.cut_short)

    for sig in EXIT_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for number, before in previous.items():
            signal.signal(number, before)


__all__ = ["RETRY_AFTER_S", "SERVED_WHILE_DRAINING", "Drain", "drain_on_signals", "shutting_down"]
