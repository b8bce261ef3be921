"""Stopping as a state of one gateway process: the drain between SIGTERM (or SIGINT) and the exit.

:class:`Drain` holds the state that admission and readiness read (``draining``, ``refusing``) and the
count of HTTP requests in the app (the ASGI entry counts them: :class:`service.app.GatewayApp`). From the
signal on:

1. ``draining`` is True: ``/readyz`` answers 503 (``"draining": true``); every request that still
   reaches the process is served, its answer with ``Connection: close``, so each client connection
   carries at most one more request and the client's next one opens a connection elsewhere (another
   replica behind the balancer, or a sibling process on the same port);
2. after ``shutdown.accept_for_s`` (0 by default) the server is told to stop (``then``: uvicorn's
   ``Server.handle_exit``): it closes its listening socket (new connections are refused, or taken by the
   sibling processes that share it), closes each connection only where its client was told
   (:meth:`service.runtime.http_protocol.GatewayHttpToolsProtocol.shutdown`: an answer not yet started
   says ``Connection: close``; an idle keep-alive connection, or one whose answer had started without
   it, is not reset under a client that may be sending on it, it is closed by its next answer or its
   keep-alive timeout) and waits for the connections to close;
3. the requests in flight run on until none is left, and no client connection is open, or
   ``shutdown.drain_timeout_s`` has passed;
4. those still running are then ended (:meth:`service.pipeline.revocation.RevocationRegistry.end_all`: a
   stream ends with a ``shutting_down`` error event and ``[DONE]``, a non-streamed request gets 503; each
   is aborted at its worker and charged what it generated, as a revocation is) and get
   ``shutdown.end_timeout_s`` to settle; from the deadline on (``refusing``) a request that still arrives
   (on a connection that was idle) gets 503 ``shutting_down`` with ``Retry-After``;
5. uvicorn's shutdown, once the connections are closed, runs the lifespan's shutdown.

This is what a rolling restart needs to cost the clients nothing: the orchestrator (or uvicorn's
``restart_all`` on SIGHUP, which starts the replacement first) sends SIGTERM, the balancer (or the kernel's
shared accept queue) stops giving the process new connections, and what it had is finished, not refused
(tests/service/runtime/test_rolling_restart.py).

``drain_started`` and ``drain_finished`` are logged with the counts in flight. :func:`drain_on_signals`
installs the signal handlers for the lifespan's serving part (main thread only: an app served from a thread
in tests drains only when :meth:`Drain.begin` is called).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Collection, Iterator
from types import FrameType
from typing import Any

import structlog
from starlette.types import Message, Send

from service.config.shutdown import ShutdownSettings
from service.errors import GatewayError, ShuttingDown

log = structlog.get_logger("radixgate.drain")

EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)

SERVED_WHILE_DRAINING = frozenset({"/healthz", "/readyz", "/metrics"})
"""Paths answered as usual even past the drain deadline: liveness (the process is alive and finishing its
work: a liveness failure would have it killed), readiness (its 503 says the drain) and the metrics (the
drain's progress); from the deadline on everything else is refused with 503."""

QUIET_POLL_S = 0.05
"""How often the drain looks whether the process is quiet (nothing in flight, no connection open), s."""

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
        draining: True from :meth:`begin` on (read by ``/readyz``; answers get ``Connection: close``).
        refusing: True from the drain deadline on (new requests get 503 ``shutting_down``).
        in_flight: HTTP requests in the app now (:meth:`enter` / :meth:`leave`).
        connections: the server's open client connections (uvicorn's ``ServerState.connections``, handed
            over by the app from the :data:`service.runtime.http_protocol.CONNECTIONS_EXTENSION`), or None
            when unknown (a server without it): the drain is over once none is left.
        finished: True once the drain is over.
    """

    __slots__ = (
        "_cut",
        "_end_all",
        "_idle",
        "_settings",
        "_stop",
        "_stopped",
        "_task",
        "connections",
        "draining",
        "finished",
        "in_flight",
        "refusing",
    )

    def __init__(self, settings: ShutdownSettings, end_all: Callable[[GatewayError], int]) -> None:
        self._settings = settings
        self._end_all = end_all
        self.draining = False
        self.refusing = False
        self.finished = False
        self.in_flight = 0
        self._stop: asyncio.TimerHandle | None = None
        self._stopped = False
        self.connections: Collection[object] | None = None
        self._idle: asyncio.Event | None = None  # made when the drain begins (on the running loop)
        self._cut: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def enter(self) -> None:
        """One more request in the app."""
        self.in_flight += 1
        if self._idle is not None and self._idle.is_set():  # a request on a connection left open
            self._idle.clear()

    def leave(self) -> None:
        """One request fewer (it returned); wakes the drain when it was the last."""
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    def begin(self, then: Callable[[], None], why: str = "") -> bool:
        """Start draining (on the running loop); ``then`` is called once, ``shutdown.accept_for_s`` later,
        or at once when the drain is over sooner (whatever happens). A drain already begun is left as it
        is: False.

        Args:
            then: what stops the server: it stops listening, closes each connection once its answer is
                out and shuts down when none is left (uvicorn's exit handler).
            why: what started it, for the log (e.g. ``"SIGTERM"``).
        """
        if self.draining:
            return False
        self.draining = True
        self._idle = asyncio.Event()
        self._cut = asyncio.Event()
        if self.in_flight == 0:
            self._idle.set()
        loop = asyncio.get_running_loop()

        def stop() -> None:
            self._stopped = True
            then()

        stop_once = _once(stop)
        self._stop = loop.call_later(self._settings.accept_for_s, stop_once)
        self._task = loop.create_task(self._run(stop_once, why), name="drain")
        return True

    def cut_short(self) -> None:
        """Reach the deadline now (a second Ctrl-C): what is in flight is ended at once."""
        if self._cut is not None:
            self._cut.set()

    async def wait(self) -> None:
        """Until the drain is over (returns at once when it never began)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    def _open_connections(self) -> int:
        return 0 if self.connections is None else len(self.connections)

    async def _quiet(self) -> None:
        """Until the port is closed, nothing is in flight and no client connection is left open (an idle
        one closes at its next answer or its keep-alive timeout)."""
        # polled: the connections are uvicorn's set, which signals nothing (uvicorn polls it too)
        while not self._stopped or self.in_flight or self._open_connections():  # noqa: ASYNC110
            await asyncio.sleep(QUIET_POLL_S)

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
            quiet = asyncio.ensure_future(self._quiet())
            cut = asyncio.ensure_future(self._cut.wait())
            try:
                await asyncio.wait(
                    {quiet, cut}, timeout=self._settings.drain_timeout_s, return_when="FIRST_COMPLETED"
                )
            finally:
                quiet.cancel()
                cut.cancel()
            self.refusing = True  # the deadline (or quiet): what comes now would hold up the exit
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
            if self._stop is not None:
                self._stop.cancel()
            then()


def closing_connection(send: Send) -> Send:
    """``send`` with ``Connection: close`` added to the answer's headers (unless it has a ``connection``
    header): uvicorn then closes the connection once the answer is out, and the client's next request
    opens a new one (to a replica or sibling process that is not stopping)."""

    async def send_closing(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            if not any(name.lower() == b"connection" for name, _ in headers):
                headers.append((b"connection", b"close"))
            message = {**message, "headers": headers}
        await send(message)

    return send_closing


def _once(call: Callable[[], None]) -> Callable[[], None]:
    """``call`` that runs at most once, however often it is called."""
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            call()

    return run


@contextlib.contextmanager
def drain_on_signals(drain: Drain) -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT begin ``drain`` instead of stopping the server at once: the
    handler installed before (uvicorn's ``Server.handle_exit``, which makes it stop listening and shut
    down once its connections are closed) is called with the first signal after
    ``shutdown.accept_for_s`` (or when the drain is over, if sooner). A second SIGTERM during the drain is
    ignored (a process group signalled as a whole, then again by its parent); a second SIGINT (Ctrl-C
    again) cuts the drain short.
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
            else:  # no server handler: the default action of the signal once drained, handlers back first
                tasks.add(loop.create_task(default_action(sig)))

        return call

    async def default_action(sig: int) -> None:
        await drain.wait()
        for number, handler in previous.items():
            signal.signal(number, handler)
        signal.raise_signal(sig)

    tasks: set[asyncio.Task[None]] = set()

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


__all__ = [
    "RETRY_AFTER_S",
    "SERVED_WHILE_DRAINING",
    "Drain",
    "closing_connection",
    "drain_on_signals",
    "shutting_down",
]
