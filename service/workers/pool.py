"""The set of workers a gateway replica sends to: health probing and in-flight accounting.

Each worker is probed with ``GET /health`` every ``health_interval_s``. A busy CPU worker can answer a
probe late, so one missed probe is not enough: a worker leaves rotation after ``unhealthy_after``
consecutive failed probes (default 3, the same default as Kubernetes' ``failureThreshold``) and returns
on the first successful one. A transport failure while serving (connection refused or reset) is
definitive and takes the worker out at once, so retries move elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import structlog

from policies.routing import RoundRobin, WorkerView
from service.workers.client import SGLangClient

log = structlog.get_logger("radixgate.pool")


@dataclass(slots=True)
class WorkerState:
    """Mutable per-worker state kept by one gateway replica."""

    url: str
    healthy: bool = False
    failed_probes: int = 0
    in_flight: int = 0
    in_flight_tokens: int = 0

    def view(self) -> WorkerView:
        """An immutable snapshot for the routing policy."""
        return WorkerView(self.url, self.healthy, self.in_flight, self.in_flight_tokens)


class WorkerPool:
    """Workers, their health, and the routing choice.

    Args:
        urls: base URLs of the workers.
        client: SGLang client used for probes.
        health_interval_s: probe period, seconds.
    """

    def __init__(
        self,
        urls: list[str],
        client: SGLangClient,
        health_interval_s: float,
        health_timeout_s: float = 5.0,
        unhealthy_after: int = 3,
    ) -> None:
        self._workers = {u.rstrip("/"): WorkerState(u.rstrip("/")) for u in urls}
        self._client = client
        self._interval = health_interval_s
        self._timeout = health_timeout_s
        self._unhealthy_after = unhealthy_after
        self._router = RoundRobin()
        self._task: asyncio.Task[None] | None = None

    @property
    def workers(self) -> list[WorkerState]:
        """All workers, in configuration order."""
        return list(self._workers.values())

    def add(self, url: str, healthy: bool = False) -> None:
        """Add a worker (no-op if present)."""
        url = url.rstrip("/")
        self._workers.setdefault(url, WorkerState(url, healthy=healthy))

    def any_healthy(self) -> bool:
        """At least one worker passes health checks."""
        return any(w.healthy for w in self._workers.values())

    async def probe_all(self) -> None:
        """Probe every worker once, concurrently, and record the results."""
        urls = list(self._workers)
        results = await asyncio.gather(*(self._client.healthy(u, self._timeout) for u in urls))
        for url, ok in zip(urls, results, strict=True):
            state = self._workers.get(url)
            if state is None:
                continue
            state.failed_probes = 0 if ok else state.failed_probes + 1
            # never probed successfully yet (startup) counts as down at once
            healthy = ok or (state.healthy and state.failed_probes < self._unhealthy_after)
            if state.healthy != healthy:
                log.info(
                    "worker_health_changed", worker=url, healthy=healthy, failed_probes=state.failed_probes
                )
            state.healthy = healthy

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.probe_all()
            except Exception:  # a probe must never kill the loop
                log.exception("health_probe_failed")

    async def start(self) -> None:
        """Probe once, then keep probing in the background."""
        await self.probe_all()
        self._task = asyncio.create_task(self._probe_loop(), name="worker-health")

    async def stop(self) -> None:
        """Stop probing."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def choose(self, exclude: Collection[str] = ()) -> str | None:
        """URL of the worker for the next request, or None when no healthy one is left."""
        pick = self._router.choose([w.view() for w in self._workers.values()], exclude)
        return pick.url if pick else None

    def mark_failed(self, url: str) -> None:
        """Take a worker out of rotation until its next successful probe."""
        state = self._workers.get(url)
        if state is not None and state.healthy:
            state.healthy = False
            log.warning("worker_marked_unhealthy", worker=url)

    def views(self) -> list[WorkerView]:
        """Immutable snapshots of every worker, for routing."""
        return [w.view() for w in self._workers.values()]

    def get(self, url: str) -> WorkerState | None:
        """A worker's state, or None if it is not in the pool."""
        return self._workers.get(url)

    def acquire(self, url: str, tokens: int) -> None:
        """Count one request of ``tokens`` as in flight on ``url``."""
        state = self._workers[url]
        state.in_flight += 1
        state.in_flight_tokens += tokens

    def release(self, url: str, tokens: int) -> None:
        """Undo :meth:`acquire`."""
        state = self._workers.get(url)
        if state is not None:
            state.in_flight -= 1
            state.in_flight_tokens -= tokens

    @contextlib.contextmanager
    def lease(self, url: str, tokens: int) -> Iterator[None]:
        """Count a request as in flight on ``url`` for the duration of the block."""
        self.acquire(url, tokens)
        try:
            yield
        finally:
            self.release(url, tokens)
