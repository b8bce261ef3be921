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
from policies.cache_aware import CacheAwareConfig
from policies.fair_queue import BandConfig, PriorityBands, QueuedItem
from policies.routing import RouteDecision, Router, make_router
from policies.shedding import DispatchRate, decide_admission
from service.api.errors import APIError
from service.config import Settings
from service.metrics import GatewayMetrics
from service.workers.client import SGLangClient
from service.workers.pool import WorkerPool

log = structlog.get_logger("radixgate.scheduler")

Waiter = asyncio.Future["Slot"]


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
    prompt: str = ""
    session_id: str | None = None


@dataclass(slots=True)
class Slot:
    """A request's place on a worker, held from dispatch to :meth:`Scheduler.release`.

    Attributes:
        worker: base URL of the chosen worker.
        cost: reserved tokens counted in the worker's window.
        decision: the routing decision (reason, predicted cached characters).
    """

    worker: str
    cost: int
    decision: RouteDecision | None = None
    released: bool = False


@dataclass(slots=True)
class _Pending:
    waiter: Waiter
    request: SchedulingRequest


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
        self._bands: PriorityBands[_Pending] = PriorityBands(
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
            engine_queue_fraction=cfg.engine_queue_fraction,
        )
        self._windows: dict[str, ConcurrencyWindow] = {}
        self._max_total = cfg.max_queue_total
        self._settings = settings
        self._pool = pool
        self._client = client
        self._metrics = metrics
        self._clock = clock
        self._rate = DispatchRate()
        routing = settings.routing
        self._router: Router = make_router(
            routing.policy,
            cache_aware=CacheAwareConfig(
                cache_threshold=routing.cache_threshold,
                balance_abs_threshold=routing.balance_abs_threshold,
                balance_rel_threshold=routing.balance_rel_threshold,
                max_tree_chars_per_worker=routing.max_tree_chars_per_worker,
                eviction_interval_s=routing.eviction_interval_s,
            ),
        )
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
        if not self._pool.any_healthy():  # nothing could serve it: fail fast rather than wait out the budget
            raise APIError(
                503,
                "No healthy worker is available; retry shortly.",
                code="no_worker_available",
                headers={"Retry-After": "1"},
            )
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
        pending = _Pending(waiter, req)
        item = QueuedItem(pending, req.tenant, req.weight, float(req.cost), req.band, now, now + budget)
        self._bands.push(item)
        self._pump()
        self._metrics.queue_depth.labels(req.band).set(self._bands.depth(req.band))
        try:
            slot = await waiter
        except asyncio.CancelledError:
            if self._bands.remove(item):
                m.scheduler_outcomes.labels(req.band, tenant_label, "cancelled").inc()
            elif waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(waiter.result())  # dispatched in the same instant
            self._metrics.queue_depth.labels(req.band).set(self._bands.depth(req.band))
            raise
        m.queue_wait.labels(req.band).observe(self._clock() - now)
        m.scheduler_outcomes.labels(req.band, tenant_label, "admitted").inc()
        return slot

    def observe(self, slot: Slot, prompt: str, engine_cached_tokens: int, prompt_tokens: int) -> None:
        """Feed a finished request's engine-reported cached tokens back to the router."""
        predicted = slot.decision.matched_chars if slot.decision else None
        self._router.observe_cached_tokens(
            slot.worker, prompt, engine_cached_tokens, prompt_tokens, predicted
        )

    def remove_worker(self, url: str) -> None:
        """Forget a worker's routing state (it left the pool)."""
        self._router.remove_worker(url)
        self._windows.pop(url, None)

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
            if not item.payload.waiter.done():
                item.payload.waiter.set_exception(
                    APIError(503, "The gateway is shutting down.", code="shutting_down")
                )

    # -- internals -----------------------------------------------------------------------------------
    def _choose_worker(self, item: QueuedItem[_Pending]) -> RouteDecision | None:
        """Route among healthy workers whose window has room for ``item``; None if there is none."""
        top = item.band == self._top_band
        cost = int(item.cost)
        views = [
            v
            for v in self._pool.views()
            if v.healthy and self.window(v.url).has_room(v.in_flight, v.in_flight_tokens, cost, top)
        ]
        if not views:
            return None
        req = item.payload.request
        return self._router.choose(views, req.prompt, self._clock(), session_id=req.session_id)

    def _pump(self) -> None:
        """Dispatch queued requests, in band/WFQ order, while some worker window has room."""
        m = self._metrics
        while (head := self._bands.peek()) is not None:
            if head.payload.waiter.done():  # cancelled or failed while queued
                self._bands.remove(head)
                continue
            decision = self._choose_worker(head)
            if decision is None:
                break
            popped = self._bands.pop()
            assert popped is head
            self._pool.acquire(decision.url, int(head.cost))
            self._rate.record(self._clock(), head.cost)
            head.payload.waiter.set_result(Slot(decision.url, int(head.cost), decision))
            m.queue_depth.labels(head.band).set(self._bands.depth(head.band))
            m.routing_decisions.labels(self._router.name, decision.reason).inc()
            m.routing_predicted_cached_chars.inc(decision.matched_chars)
            m.routing_prompt_chars.inc(len(head.payload.request.prompt))

    def _evict_newest(self, band: str) -> None:
        victim = self._bands.queue(band).newest()
        if victim is None:
            return
        self._bands.remove(victim)
        self._metrics.scheduler_outcomes.labels(band, self._metrics.tenant(victim.tenant), "shed").inc()
        if not victim.payload.waiter.done():
            victim.payload.waiter.set_exception(
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
                if not item.payload.waiter.done():
                    item.payload.waiter.set_exception(
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
