"""The gateway's request queue: priority bands, weighted fair queuing, admission windows, shedding.

Every admitted request (quota already reserved) calls :meth:`Scheduler.acquire`, which either sheds it at
once (503 + Retry-After; ``policies.shedding``), or queues it in its band (``policies.fair_queue``) until
a worker's concurrency window (``policies.admission``) has room, then returns the worker. The caller must
:meth:`Scheduler.release` the slot when the request ends. A request still queued when its band's wait
budget runs out is answered 503 ``queue_timeout``; one whose client goes away leaves the queue (the caller
refunds its reservation). Windows adapt to the load each worker reports on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from policies.admission import ConcurrencyWindow, WindowConfig
from policies.fair_queue import BandConfig, PriorityBands, QueuedItem
from policies.routing import RoundRobin
from policies.shedding import DispatchRate, decide_admission
from service.api.errors import APIError
from service.config import Settings
from service.metrics import GatewayMetrics
from service.workers.client import SGLangClient
from service.workers.pool import WorkerPool

log = structlog.get_logger("radixgate.scheduler")

Waiter = asyncio.Future[str]


@dataclass(frozen=True, slots=True)
class SchedulingRequest:
    """What the scheduler needs to know of a request.

    Attributes:
        tenant: tenant id (the WFQ flow).
        weight: the tenant's fair-queuing weight.
        band: priority class name.
        cost: reserved tokens (prompt + max_tokens).
    """

    tenant: str
    weight: float
    band: str
    cost: int


@dataclass(slots=True)
class Slot:
    """A request's place on a worker, held from dispatch to :meth:`Scheduler.release`."""

    worker: str
    cost: int
    released: bool = False


class Scheduler:
    """Queues requests by band and tenant and dispatches them into worker windows.

    Args:
        settings: app settings (priority classes, scheduler section).
        pool: the workers (health, in-flight counts).
        client: SGLang client, for load polls.
        metrics: the app's metrics.
        clock: monotonic clock in s (injected for tests).
    """

    def __init__(
        self,
        settings: Settings,
        pool: WorkerPool,
        client: SGLangClient,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        classes = settings.priority_classes
        self._bands: PriorityBands[Waiter] = PriorityBands(
            [
                BandConfig(name, c.rank, c.max_queue_len, c.queue_wait_budget_ms / 1000.0, c.min_share)
                for name, c in classes.items()
            ]
        )
        self._top_band = max(classes, key=lambda n: classes[n].rank)
        cfg = settings.scheduler
        self._window_config = WindowConfig(
            initial=cfg.window_initial,
            minimum=cfg.window_min,
            maximum=cfg.window_max,
            max_tokens=cfg.window_max_tokens,
            top_band_headroom=cfg.top_band_headroom,
        )
        self._windows: dict[str, ConcurrencyWindow] = {}
        self._max_total = cfg.max_queue_total
        self._settings = settings
        self._pool = pool
        self._client = client
        self._metrics = metrics
        self._clock = clock
        self._rate = DispatchRate()
        self._router = RoundRobin()
        self._tasks: list[asyncio.Task[None]] = []

    # -- public API ----------------------------------------------------------------------------------
    def window(self, worker: str) -> ConcurrencyWindow:
        """The concurrency window of ``worker`` (created on first use)."""
        if worker not in self._windows:
            self._windows[worker] = ConcurrencyWindow(self._window_config)
        return self._windows[worker]

    def depth(self, band: str) -> int:
        """Requests queued in ``band``."""
        return self._bands.depth(band)

    async def acquire(self, req: SchedulingRequest) -> Slot:
        """Wait for a worker slot.

        Raises:
            APIError: 503 ``overloaded`` (shed at arrival or evicted by a higher band) or
                ``queue_timeout`` (waited past the band's budget).
            asyncio.CancelledError: the caller was cancelled; the request left the queue.
        """
        now = self._clock()
        m, tenant_label = self._metrics, self._metrics.tenant(req.tenant)
        decision = decide_admission(
            self._bands, req.band, req.tenant, req.weight, req.cost, self._rate.rate(now), self._max_total
        )
        if not decision.admit:
            m.scheduler_outcomes.labels(req.band, tenant_label, "shed").inc()
            retry = max(1, math.ceil(min(decision.predicted_wait_s, 60.0)))
            raise APIError(
                503,
                f"The gateway is overloaded for priority class '{req.band}' ({decision.reason}); "
                f"retry after {retry} s.",
                code="overloaded",
                headers={"Retry-After": str(retry)},
            )
        if decision.evict_band is not None:
            self._evict_newest(decision.evict_band)
        waiter: Waiter = asyncio.get_running_loop().create_future()
        budget = self._bands.configs[req.band].wait_budget_s
        item = QueuedItem(waiter, req.tenant, req.weight, float(req.cost), req.band, now, now + budget)
        self._bands.push(item)
        self._pump()
        self._metrics.queue_depth.labels(req.band).set(self._bands.depth(req.band))
        try:
            worker = await waiter
        except asyncio.CancelledError:
            if self._bands.remove(item):
                m.scheduler_outcomes.labels(req.band, tenant_label, "cancelled").inc()
            elif waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(Slot(waiter.result(), req.cost))  # dispatched in the same instant
            self._metrics.queue_depth.labels(req.band).set(self._bands.depth(req.band))
            raise
        m.queue_wait.labels(req.band).observe(self._clock() - now)
        m.scheduler_outcomes.labels(req.band, tenant_label, "admitted").inc()
        return Slot(worker, req.cost)

    def release(self, slot: Slot) -> None:
        """Give a slot back (idempotent) and dispatch what now fits."""
        if slot.released:
            return
        slot.released = True
        self._pool.release(slot.worker, slot.cost)
        self._pump()

    async def start(self) -> None:
        """Start the deadline checker and the load poller."""
        self._tasks = [
            asyncio.create_task(self._expiry_loop(), name="queue-expiry"),
            asyncio.create_task(self._load_loop(), name="worker-load"),
        ]

    async def stop(self) -> None:
        """Stop background tasks; fail whatever is still queued with 503."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for item in self._bands.expired(math.inf):
            if not item.payload.done():
                item.payload.set_exception(
                    APIError(503, "The gateway is shutting down.", code="shutting_down")
                )

    # -- internals -----------------------------------------------------------------------------------
    def _choose_worker(self, item: QueuedItem[Waiter]) -> str | None:
        top = item.band == self._top_band
        views = [
            v
            for v in self._pool.views()
            if v.healthy and self.window(v.url).has_room(v.in_flight, v.in_flight_tokens, int(item.cost), top)
        ]
        pick = self._router.choose(views)
        return pick.url if pick else None

    def _pump(self) -> None:
        """Dispatch queued requests, in band/WFQ order, while some worker window has room."""
        while (head := self._bands.peek()) is not None:
            if head.payload.done():  # cancelled or failed while queued
                self._bands.remove(head)
                continue
            worker = self._choose_worker(head)
            if worker is None:
                break
            popped = self._bands.pop()
            assert popped is head
            self._pool.acquire(worker, int(head.cost))
            self._rate.record(self._clock(), head.cost)
            head.payload.set_result(worker)
            self._metrics.queue_depth.labels(head.band).set(self._bands.depth(head.band))

    def _evict_newest(self, band: str) -> None:
        victim = self._bands.queue(band).newest()
        if victim is None:
            return
        self._bands.remove(victim)
        self._metrics.scheduler_outcomes.labels(band, self._metrics.tenant(victim.tenant), "shed").inc()
        if not victim.payload.done():
            victim.payload.set_exception(
                APIError(
                    503,
                    f"Shed from the '{band}' queue to make room for higher-priority work; retry later.",
                    code="overloaded",
                    headers={"Retry-After": "5"},
                )
            )

    async def _expiry_loop(self) -> None:
        interval = self._settings.scheduler.expiry_interval_s
        while True:
            await asyncio.sleep(interval)
            for item in self._bands.expired(self._clock()):
                self._metrics.scheduler_outcomes.labels(
                    item.band, self._metrics.tenant(item.tenant), "expired"
                ).inc()
                if not item.payload.done():
                    item.payload.set_exception(
                        APIError(
                            503,
                            f"Waited longer than the '{item.band}' class allows "
                            f"({self._bands.configs[item.band].wait_budget_s * 1000:.0f} ms); retry later.",
                            code="queue_timeout",
                            headers={"Retry-After": "1"},
                        )
                    )
            self._pump()  # a worker may have become healthy again

    async def _load_loop(self) -> None:
        interval = self._settings.scheduler.load_poll_interval_s
        while True:
            await asyncio.sleep(interval)
            views = [v for v in self._pool.views() if v.healthy]
            loads = await asyncio.gather(*(self._client.load(v.url) for v in views))
            for view, load in zip(views, loads, strict=True):
                if load is None:
                    continue
                window = self.window(view.url)
                window.on_load_report(load.queued, load.kv_usage, view.in_flight)
                self._metrics.worker_window.labels(view.url).set(window.size)
            self._pump()
