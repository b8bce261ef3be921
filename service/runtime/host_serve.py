"""Serving the gateway: one process (:func:`serve_one`), or several on one host (``RADIXGATE_WORKERS`` > 1,
:func:`serve_processes`) whose ``/metrics`` sums them all.

Stopping (:mod:`service.runtime.drain`): each gateway process drains on SIGTERM/SIGINT (its app's handlers),
then
uvicorn stops it. One process runs :class:`GatewayServer`, which exits with status 0 after a signal it
handled (uvicorn's server raises the signal again once it has stopped: status -15), and ignores SIGHUP
with a warning (``sighup_ignored``): a rolling restart needs a supervisor to start the replacement, which one
process does not have, and SIGHUP's default action killed it at once, cutting its streams with no error
event, no ``request`` line and no usage settled. With several, the
parent passes SIGTERM on to every process at once (uvicorn's supervisor looks at signals every 0.5 s, and
until then its processes went on admitting new requests), and closes its own copy of the listening socket
once it has (the processes keep theirs while they drain: when the last one closes it, new connections are
refused; the parent's copy kept the socket listening with nobody accepting, and connections waited unanswered
until the parent exited).

The parent process creates a fresh private directory (:func:`tempfile.mkdtemp`, mode 0700) before it
starts any worker, points prometheus_client's multiprocess mode at it (``PROMETHEUS_MULTIPROC_DIR``) and
the gateway at it (``RADIXGATE_OBSERVABILITY__METRICS_MULTIPROC_DIR``) in the environment the workers
inherit, runs uvicorn's worker supervisor, and removes the directory when it exits. Each run has its own
directory, so files from an earlier run are never summed in (a parent killed with SIGKILL leaves its
directory in the temp folder, unused by any later run). When uvicorn replaces a worker (it died or hung,
SIGHUP, SIGTTOU), the parent marks the old process dead: its ``live*`` gauge files are removed, so its
in-flight requests and queue depths stop counting, while its counters and histograms stay (what it
served was served, and the replacement writes files of its own pid, so nothing is counted twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from socket import AF_INET, AF_INET6, SO_REUSEADDR, SOCK_STREAM, SOL_SOCKET, socket
from types import FrameType
from typing import Any

import structlog
import uvicorn
from prometheus_client.multiprocess import mark_process_dead
from uvicorn.config import STARTUP_FAILURE
from uvicorn.server import HANDLED_SIGNALS
from uvicorn.supervisors import Multiprocess
from uvicorn.supervisors.multiprocess import Process

log = structlog.get_logger("radixgate.host_serve")

#: the environment variables the workers inherit; the first is prometheus_client's own
MULTIPROC_ENV = ("PROMETHEUS_MULTIPROC_DIR", "RADIXGATE_OBSERVABILITY__METRICS_MULTIPROC_DIR")


@contextmanager
def fresh_multiproc_dir() -> Iterator[Path]:
    """A new empty directory, readable by this user only, removed (with every file in it) on exit."""
    path = Path(tempfile.mkdtemp(prefix="radixgate-metrics-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


SIGHUP_IGNORED = (
    "one gateway process (RADIXGATE_WORKERS=1) keeps serving: it has no supervisor to start its replacement; "
    "for a rolling restart run RADIXGATE_WORKERS > 1 (SIGHUP to the parent) or a process manager "
    "(Kubernetes, systemd, Compose) that starts a new process and sends this one SIGTERM"
)
"""The ``hint`` of the ``sighup_ignored`` warning of a one-process gateway."""


class GatewayServer(uvicorn.Server):
    """uvicorn's server, except that a SIGINT or SIGTERM it stopped on is not raised again once it has
    stopped: a drained gateway exits with status 0 (uvicorn's ``capture_signals`` re-raises the signal,
    so the process died of it: status -15, shell 143); and SIGHUP is ignored with a ``sighup_ignored``
    warning (its default action ends the process at once: streams cut, nothing settled)."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's handlers (``handle_exit``) and the SIGHUP warning for the run (start-up, serving and
        the drain), the previous ones restored after."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()  # uvicorn enters this in its serve() coroutine

        def on_sighup(sig: int, frame: FrameType | None) -> None:
            # logged on the loop, not inside the handler: it may interrupt a log line being written
            loop.call_soon_threadsafe(lambda: log.warning("sighup_ignored", hint=SIGHUP_IGNORED))

        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        original[signal.SIGHUP] = signal.signal(signal.SIGHUP, on_sighup)
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def operator_socket(host: str, port: int) -> socket:
    """A bound TCP socket on ``host``:``port`` for the operator endpoints (``security.operator_port``,
    :mod:`service.api.operator_access`), made as uvicorn makes its own (``SO_REUSEADDR``, inheritable by
    the gateway processes of ``RADIXGATE_WORKERS`` > 1); the server listens on it.

    Raises:
        OSError: the address is in use or not this host's.
    """
    sock = socket(AF_INET6 if ":" in host else AF_INET, SOCK_STREAM)
    sock.setsockopt(SOL_SOCKET, SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve_one(app: Any, options: dict[str, Any], operator: tuple[str, int] | None = None) -> int:
    """Serve ``app`` in this process with :class:`GatewayServer` until it stops; the exit status: 0, or
    uvicorn's start-up failure status (3) when it never started serving.

    Args:
        app: the ASGI app.
        options: keyword arguments of :class:`uvicorn.Config` (host, port, loop, ...).
        operator: (host, port) of the operator endpoints' own listening socket, served by the same server.

    Raises:
        OSError: a port is in use.
    """
    config = uvicorn.Config(app, **options)
    server = GatewayServer(config)
    sockets = None if operator is None else [config.bind_socket(), operator_socket(*operator)]
    try:
        with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run: Ctrl-C before its handlers were set
            server.run(sockets=sockets)
    finally:
        for sock in sockets or ():
            sock.close()
    return 0 if server.started else STARTUP_FAILURE


class MetricsMultiprocess(Multiprocess):
    """uvicorn's worker supervisor that calls ``mark_process_dead`` for every worker it replaces or
    retires while running (the three places it does: a dead or hung worker, SIGHUP, SIGTTOU).

    Args:
        config: uvicorn's config (``workers`` > 1, the app as an import string).
        sockets: the bound listening sockets the workers share.
        multiproc_dir: the prometheus_client multiprocess directory of this run.
    """

    def __init__(self, config: uvicorn.Config, sockets: list[socket], multiproc_dir: Path) -> None:
        super().__init__(config, sockets)
        self._multiproc_dir = multiproc_dir
        self._starting: Process | None = None  # a rolling restart's replacement, not yet in processes
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_stop_signal)

    def _on_stop_signal(self, sig: int, frame: FrameType | None) -> None:
        """Queue the signal for uvicorn's loop (which stops, as before) and pass SIGTERM on to every
        process now: each begins its drain at once (service/runtime/drain.py; a second SIGTERM, when the whole
        process group was signalled, is ignored there). During a rolling restart (SIGHUP) the replacement
        being started is signalled too, and ``should_exit`` is set now so that the restart starts no
        further process: uvicorn reads the queue only once the restart returns, which waits for an old
        process's drain (up to ``shutdown.drain_timeout_s``), and meanwhile the replacement went on
        answering ``/readyz`` 200 and admitting requests, and one more was started after the signal."""
        self.signal_queue.append(sig)
        self.should_exit.set()
        starting = [self._starting] if self._starting is not None else []
        for process in [*self.processes, *starting]:
            if process.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(process.pid, signal.SIGTERM)

    def terminate_all(self) -> None:
        """uvicorn's (SIGTERM to every process), then this process's copies of the listening sockets
        closed: the processes keep theirs while they drain, and the last one to close it makes the kernel
        refuse new connections (none waits unanswered in the backlog until this process exits)."""
        super().terminate_all()
        for sock in self.sockets:
            sock.close()

    def _pids(self) -> set[int]:
        return {p.pid for p in self.processes if p.pid is not None}

    def _marking_dead(self, step: Callable[[], None]) -> None:
        before = self._pids()
        try:
            step()
        finally:
            for pid in before - self._pids():
                mark_process_dead(pid, str(self._multiproc_dir))  # type: ignore[no-untyped-call, unused-ignore]
                log.info("gateway_process_replaced", dead_pid=pid)

    def keep_subprocess_alive(self) -> None:
        """uvicorn's check (restart a dead or hung worker), then the replaced pid marked dead."""
        self._marking_dead(super().keep_subprocess_alive)

    def restart_all(self) -> None:
        """uvicorn's rolling restart (SIGHUP; its ``Multiprocess.restart_all`` of uvicorn 0.55, with the
        replacement kept in ``_starting`` for :meth:`_on_stop_signal`), then the retired pids marked dead."""
        self._marking_dead(self._replace_each)

    def _replace_each(self) -> None:
        for idx, old_process in enumerate(self.processes):
            if self.should_exit.is_set():
                return
            new_process = Process(self.config, self.sockets)
            self._starting = new_process
            try:
                new_process.start()
                if not new_process.wait_until_ready(self.config.timeout_worker_healthcheck, self.should_exit):
                    if self.should_exit.is_set():
                        # stopping: the replacement got SIGTERM from the handler and drains what it took
                        # (it may have begun serving just before the signal); not killed under a stream
                        new_process.join()
                        return
                    new_process.kill()
                    new_process.join()
                    log.error("gateway_restart_aborted", new_pid=new_process.pid, kept_pid=old_process.pid)
                    return
                old_process.terminate()
                old_process.join()
                self.processes[idx] = new_process
            finally:
                self._starting = None

    def handle_ttou(self) -> None:
        """uvicorn's one-worker-fewer (SIGTTOU), then the retired pid marked dead."""
        self._marking_dead(super().handle_ttou)


def serve_processes(
    workers: int,
    options: dict[str, Any],
    environ: MutableMapping[str, str],
    operator: tuple[str, int] | None = None,
) -> None:
    """Run ``workers`` gateway processes (``service.app:create_app``, each building its own Settings from
    the environment) on one port until SIGINT/SIGTERM, in prometheus_client's multiprocess mode.

    Args:
        workers: how many processes (> 1).
        options: keyword arguments of :class:`uvicorn.Config` (host, port, loop, ...).
        environ: the process environment the workers inherit (``os.environ``); the two
            :data:`MULTIPROC_ENV` variables are set in it for the run.
    """
    with fresh_multiproc_dir() as multiproc_dir:
        for name in MULTIPROC_ENV:
            environ[name] = str(multiproc_dir)
        config = uvicorn.Config("service.app:create_app", factory=True, workers=workers, **options)
        sockets = [config.bind_socket()]
        try:
            if operator is not None:
                sockets.append(operator_socket(*operator))
            MetricsMultiprocess(config, sockets, multiproc_dir).run()
        except KeyboardInterrupt:  # as uvicorn.run: a Ctrl-C during start-up ends quietly
            pass
        finally:
            for sock in sockets:
                sock.close()
