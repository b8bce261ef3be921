"""The drain deadline of leaving workers (``upstream.worker_drain_deadline_s``).

A worker that leaves (drained over the admin API, its DNS record gone, a scale-down) gets no new requests
from the moment it drains (:meth:`service.workers.pool.WorkerPool.drain`). What it runs then finishes there,
or, still running ``deadline_s`` after the drain began, is cut (:meth:`SGLangClient.move_off`): a stream
resumes on another worker of its model with what was generated so far (the mid-stream failover of
:class:`service.pipeline.upstream.UpstreamCaller`: the client sees one unbroken stream and each token is
charged once), a non-streamed request starts again there. While no other worker of its model is eligible
nothing is cut (a resume would have nowhere to go): the deadline is tried again every ``retry_s``.

Kubernetes' pod termination is the model: a terminating pod leaves its Service's endpoints (and a headless
Service's DNS records) at once, runs its ``preStop`` hook, and is killed ``terminationGracePeriodSeconds``
after it began to terminate; a worker pod's ``preStop`` sleep must cover the discovery period plus this
deadline so that its calls have moved before SIGTERM reaches SGLang (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("radixgate.pool")


class DrainDeadlines:
    """One timer per draining worker that still runs requests.

    Args:
        deadline_s: how long a draining worker keeps what it runs, s; None: it keeps it to the end.
        retry_s: when no other worker could take the calls, how long until the deadline is tried again, s.
        in_flight: requests a worker runs now (the pool's count; 0 for a worker no longer in the pool).
        has_other: whether another worker of the same model is eligible now.
        move_off: cuts a worker's calls; returns how many (:meth:`SGLangClient.move_off`).
        clock: monotonic time, s (for the log's ``waited_s``).
    """

    def __init__(
        self,
        deadline_s: float | None,
        retry_s: float,
        in_flight: Callable[[str], int],
        has_other: Callable[[str], bool],
        move_off: Callable[[str], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deadline_s = deadline_s
        self._retry_s = retry_s
        self._in_flight = in_flight
        self._has_other = has_other
        self._move_off = move_off
        self._clock = clock
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._since: dict[str, float] = {}

    def begin(self, url: str) -> None:
        """``url`` began to drain now: its deadline is armed (nothing when ``deadline_s`` is None, or
        without a running event loop, as in a synchronous test)."""
        if self.deadline_s is None:
            return
        self._since[url] = self._clock()
        self._arm(url, self.deadline_s)

    def cancel(self, url: str) -> None:
        """``url`` stopped draining (active again), is idle or left the pool: no deadline."""
        self._since.pop(url, None)
        timer = self._timers.pop(url, None)
        if timer is not None:
            timer.cancel()

    def pending(self) -> list[str]:
        """The workers whose deadline is armed."""
        return list(self._timers)

    def stop(self) -> None:
        """Cancel every deadline (the pool stops)."""
        for url in list(self._timers):
            self.cancel(url)

    def _arm(self, url: str, delay_s: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        old = self._timers.pop(url, None)
        if old is not None:
            old.cancel()
        self._timers[url] = loop.call_later(delay_s, self._fire, url)

    def _fire(self, url: str) -> None:
        self._timers.pop(url, None)
        in_flight = self._in_flight(url)
        if not in_flight:
            self._since.pop(url, None)
            return
        since = self._since.get(url)
        waited = None if since is None else round(self._clock() - since, 3)
        if not self._has_other(url):
            log.warning(
                "worker_drain_deadline",
                worker=url,
                in_flight=in_flight,
                moved=0,
                waited_s=waited,
                reason="no other eligible worker of its model: its requests run on",
            )
            self._arm(url, self._retry_s)
            return
        self._since.pop(url, None)
        moved = self._move_off(url)
        log.info("worker_drain_deadline", worker=url, in_flight=in_flight, moved=moved, waited_s=waited)


__all__ = ["DrainDeadlines"]
