"""Supervision of launched SGLang workers: a worker that dies is a fault the gateway survives.

What dying looks like (SGLang 0.5.23): ``launch_server`` runs the HTTP server and forks a scheduler and a
detokenizer. A scheduler that raises sends SIGQUIT to its parent; one killed outright is noticed within
about 1 s by the parent's ``SubprocessWatchdog``, which sends the same SIGQUIT; the SIGQUIT handler kills the
whole process tree, the HTTP process included. So a dead child ends the ``launch_server`` process, which is
what the supervisor watches. A process that lives but cannot serve (``/health`` failing or timing out for
``unhealthy_restart_s``) is treated the same way.

Every ``supervise_interval_s`` one :class:`WorkerSupervisor` per launched worker checks, and on a fault:

1. opens the worker's breaker (no new traffic), counts ``radixgate_worker_restarts_total{worker,reason}``
   (``exited`` or ``unhealthy``) and logs ``worker_restart``;
2. stops what is left of the process group (SIGTERM, then SIGKILL);
3. waits the backoff of :mod:`policies.restart_backoff` (bounded, jittered, reset after a stable run);
4. starts the worker again and waits for its ``/health``; then the pool re-admits it through half-open
   probes (:meth:`WorkerPool.readmit`). A restart that fails to come up is noticed by the next check and
   restarted after a longer wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from typing import Literal

import structlog

from policies.restart_backoff import RestartBackoff, RestartBackoffConfig
from service.config.settings import EngineSettings
from service.workers.client import SGLangClient
from service.workers.launcher import WorkerProcess, WorkerStartError
from service.workers.pool import WorkerPool

log = structlog.get_logger("radixgate.supervisor")

RestartReason = Literal["exited", "unhealthy"]
RestartHook = Callable[[str, RestartReason], None]


class WorkerSupervisor:
    """Keeps one launched worker running.

    Args:
        worker: the launched worker (already started and ready).
        pool: the pool that routes to it.
        client: for ``/health`` checks.
        engine: engine settings (check period, unhealthy bound, backoff).
        on_restart: called with (worker URL, reason) for each restart (metrics).
        clock: monotonic clock, s.
        jitter: uniform random numbers in [0, 1).
    """

    def __init__(
        self,
        worker: WorkerProcess,
        pool: WorkerPool,
        client: SGLangClient,
        engine: EngineSettings,
        on_restart: RestartHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.worker = worker
        self._pool = pool
        self._client = client
        self._engine = engine
        self._on_restart = on_restart
        self._clock = clock
        self._jitter = jitter
        self._backoff = RestartBackoff(
            RestartBackoffConfig(
                engine.restart_backoff_base_s, engine.restart_backoff_max_s, engine.restart_stable_s
            )
        )
        self._backoff.started(clock())
        self._unhealthy_since: float | None = None
        self.restarts = 0
        self.last_delay_s: float | None = None
        self._task: asyncio.Task[None] | None = None

    async def check(self) -> RestartReason | None:
        """One look at the worker: why it must restart, or None if it is fine (or may still recover)."""
        if self.worker.proc is None or self.worker.exit_code is not None:
            return "exited"
        now = self._clock()
        result = await self._client.probe(self.worker.url, self._engine.supervise_interval_s + 4.0)
        if result == "ok":
            self._unhealthy_since = None
        elif result != "unknown":
            if self._unhealthy_since is None:
                self._unhealthy_since = now
            if now - self._unhealthy_since >= self._engine.unhealthy_restart_s:
                return "unhealthy"
        return None

    async def restart(self, reason: RestartReason) -> bool:
        """Stop what is left, wait the backoff, start again and wait until ready; True once ready."""
        url = self.worker.url
        self._pool.trip(url)
        delay = self._backoff.next_delay(self._clock(), self._jitter())
        self.restarts += 1
        self.last_delay_s = delay
        if self._on_restart is not None:
            self._on_restart(url, reason)
        log.warning(
            "worker_restart",
            worker=url,
            reason=reason,
            exit_code=self.worker.exit_code,
            restarts=self.restarts,
            delay_s=round(delay, 3),
        )
        await asyncio.to_thread(self.worker.stop)
        await asyncio.sleep(delay)
        self._unhealthy_since = None
        self.worker.start()
        self._backoff.started(self._clock())
        try:
            await self.worker.wait_ready()
        except WorkerStartError as exc:
            log.error("worker_restart_failed", worker=url, error=str(exc))
            return False
        self._pool.readmit(url)
        log.info("worker_restarted", worker=url, restarts=self.restarts)
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._engine.supervise_interval_s)
            try:
                reason = await self.check()
                if reason is not None:
                    await self.restart(reason)
            except asyncio.CancelledError:
                raise
            except Exception:  # supervision must outlive any single failure
                log.exception("worker_supervision_failed", worker=self.worker.url)

    def start(self) -> None:
        """Supervise in the background."""
        self._task = asyncio.create_task(self._run(), name=f"supervise-{self.worker.port}")

    async def stop(self) -> None:
        """Stop supervising (the worker itself is stopped by its owner)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
