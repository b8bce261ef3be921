"""The asyncio adapter of the admission core: futures, a deadline timer, load polls, metrics.

Every decision (route, queue, shed, expire, dispatch) is made by
:class:`policies.admission_core.AdmissionCore`, the same object the fleet simulation drives in virtual
time. This module only turns its decisions into awaited futures and domain errors, keeps the core's view
of the workers in step with the pool's health, arms one timer on the earliest queue deadline, and feeds it
the workers' reported load (``/metrics``) and limits (``/server_info``).

A request calls :meth:`Scheduler.acquire` (after its quota was reserved) and gets a :class:`Slot` or a
domain error: :class:`~service.errors.Overloaded` (shed at arrival or evicted),
:class:`~service.errors.QueueTimeout` (its deadline passed while queued),
:class:`~service.errors.NoWorkerAvailable`. It must :meth:`Scheduler.release` the slot when it ends; a
cancelled wait leaves the queue. Times are ``time.perf_counter()`` seconds, the clock of
:attr:`service.pipeline.prepare.PreparedRequest.arrival`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import structlog

from policies.admission_core import AdmissionCore
from policies.admission_types import AdmissionRequest, Decision, Dispatch, Expire, Shed, WorkerSnapshot
from policies.demand import DemandMeter
from policies.route_types import RouteDecision
from policies.windows import LoadReport, WorkerWindow
from service.config.models import ServedModel
from service.config.settings import Settings
from service.errors import (
    FirstTokenTimeout,
    GatewayError,
    NoWorkerAvailable,
    Overloaded,
    QueueTimeout,
    ShuttingDown,
)
from service.observability.breakdown import RequestTiming
from service.observability.metrics import GatewayMetrics
from service.workers.client import SGLangClient
from service.workers.pool import WorkerPool

log = structlog.get_logger("radixgate.scheduler")

_RETRY_CAP_S = 60.0

EndRequest = Callable[[str, str, GatewayError], bool]
"""Ends a running request: ``(tenant id, request id, error)`` -> whether one was found
(:meth:`service.pipeline.revocation.RevocationRegistry.end_request`)."""


@dataclass(frozen=True, slots=True)
class SchedulingRequest:
    """What the scheduler needs to know of a request.

    Attributes:
        rid: request id.
        tenant: tenant id (the WFQ flow).
        weight: the tenant's fair-queuing weight.
        band: priority class name.
        prompt: the rendered prompt (routing key).
        prompt_tokens: prompt length, tokens.
        max_tokens: completion limit, tokens.
        arrival: ``time.perf_counter()`` when the request arrived, s.
        session_id: sticky routing key, if any.
        streamed: the answer is streamed, so its first token is reported (:meth:`Scheduler.first_token`).
        sequences: engine sequences it runs at once (its ``n`` choices): the window slots it takes;
            ``max_tokens`` is then the choices' total.
    """

    rid: str
    tenant: str
    weight: float
    band: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    session_id: str | None = None
    streamed: bool = True
    sequences: int = 1


@dataclass(slots=True)
class Slot:
    """A request's place on a worker, held from dispatch to :meth:`Scheduler.release`.

    Attributes:
        rid: the request id (the core's handle).
        worker: base URL of the worker now serving it.
        cost: reserved tokens (prompt + max_tokens).
        decision: the routing decision (reason, predicted cached characters).
        queued_s: time it waited in the gateway's queue, s.
        predicted_ttft_s: its TTFT as predicted at admission, s (0 while the worker's rates are unknown).
    """

    rid: str
    worker: str
    cost: int
    decision: RouteDecision | None = None
    released: bool = False
    queued_s: float = 0.0
    predicted_ttft_s: float = 0.0


class Scheduler:
    """Drives one :class:`AdmissionCore` for one model of one gateway replica: its requests are placed
    among that model's workers only, with its classes' goals, scheduler and routing settings.

    Args:
        settings: app settings.
        pool: the workers (health, draining, in-flight counts for draining).
        client: SGLang client, for load polls and engine limits.
        metrics: the app's metrics.
        clock: the clock of requests' ``arrival``, s (injected for tests).
        end_request: ends a dispatched request the core gave up on (no first token by its first-token
            deadline) with a :class:`~service.errors.FirstTokenTimeout`; None: such requests run on.
        model: the model it schedules (its workers: :meth:`WorkerPool.eligibility`); None: the settings'
            default model over every worker of the pool.
        total_depth: requests of a band queued for every model (the ``queue_depth`` gauge); None: this
            scheduler's own.
        window_share: this replica's share of an engine's ``max_running_requests``
            (:meth:`service.workers.replicas.ReplicaRegistry.share`); None: all of it.
        on_route: told ``(model id, worker, prompt)`` of each dispatch, for the other replicas
            (:meth:`service.workers.route_sync.RouteSync.publish`); None: nothing is shared.
    """

    def __init__(
        self,
        settings: Settings,
        pool: WorkerPool,
        client: SGLangClient,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.perf_counter,
        end_request: EndRequest | None = None,
        model: ServedModel | None = None,
        total_depth: Callable[[str], int] | None = None,
        window_share: Callable[[int], int] | None = None,
        on_route: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self._settings = settings
        self._on_route = on_route
        self._end_request = end_request
        self._model = model or settings.model_registry().default
        self._pool_model = None if model is None else model.id
        self._total_depth = total_depth
        self._core = AdmissionCore(self._model.core_config())
        self._pool = pool
        self._client = client
        self._metrics = metrics
        self._clock = clock
        self._waiters: dict[str, asyncio.Future[Slot]] = {}
        self._costs: dict[str, int] = {}
        self._tenants: dict[str, str] = {}  # rid -> tenant label, while the core decides about it
        self._eligible: dict[str, bool] = {}
        self._max_running: dict[str, int | None] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._share = window_share
        #: arrivals per class and cache hits, for the planner (service/pipeline/planner_task.py)
        self.demand = DemandMeter()
        #: each eligible worker's last load report (running, queued, KV usage; its max_running unshared)
        self.loads: dict[str, LoadReport] = {}

    # -- public API ----------------------------------------------------------------------------------
    @property
    def model(self) -> ServedModel:
        """The model it schedules."""
        return self._model

    @property
    def core(self) -> AdmissionCore:
        """The admission core (read it; drive it only through this adapter)."""
        return self._core

    def window(self, worker: str) -> WorkerWindow | None:
        """The concurrency window of ``worker`` (None if unknown)."""
        return self._core.window(worker)

    def depth(self, band: str) -> int:
        """Requests queued in ``band``."""
        return self._core.depth(band)

    def snapshot(self) -> list[WorkerSnapshot]:
        """The core's per-worker state."""
        return self._core.snapshot(self._clock())

    async def acquire(self, req: SchedulingRequest, timing: RequestTiming | None = None) -> Slot:
        """Wait for a worker slot; ``timing`` (the request's breakdown) gets the decision's time
        (``route``) and the wait after it (``queue``), s.

        Raises:
            Overloaded: shed at arrival (predicted to miss its TTFT goal, queue full) or evicted later.
            QueueTimeout: its dispatch deadline passed while queued.
            NoWorkerAvailable: no eligible worker.
            asyncio.CancelledError: the caller was cancelled; the request left the queue.
        """
        began = time.perf_counter()
        now = self._clock()
        self._sync_workers(now)
        waiter: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        self._waiters[req.rid] = waiter
        cost = req.prompt_tokens + req.max_tokens
        self._costs[req.rid] = cost
        self.demand.arrive(req.band, req.prompt_tokens, req.max_tokens)
        self._tenants[req.rid] = self._metrics.tenant(req.tenant)
        self._apply(
            self._core.arrive(
                AdmissionRequest(
                    req.rid,
                    req.tenant,
                    req.band,
                    req.prompt,
                    req.prompt_tokens,
                    req.max_tokens,
                    req.arrival,
                    req.weight,
                    req.session_id,
                    req.streamed,
                    req.sequences,
                ),
                now,
            )
        )
        m, label = self._metrics, self._metrics.tenant(req.tenant)
        decided = time.perf_counter()
        try:
            slot = await waiter
        except asyncio.CancelledError:
            if self._waiters.pop(req.rid, None) is not None:
                m.child(m.scheduler_outcomes, req.band, label, "cancelled").inc()
                self._apply(self._core.cancel(req.rid, self._clock()))
            elif waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(waiter.result(), ok=False)  # dispatched in the same instant
            self._costs.pop(req.rid, None)
            raise
        except Exception:
            self._costs.pop(req.rid, None)
            raise
        finally:
            self._tenants.pop(req.rid, None)
            self._gauge_depth(req.band)
        if timing is not None:
            timing.queued(decided - began, time.perf_counter() - decided)
        m.child(m.queue_wait, req.band).observe(max(0.0, self._clock() - now))
        m.child(m.scheduler_outcomes, req.band, label, "admitted").inc()
        if self._on_route is not None:  # the other replicas' routers learn where it went
            self._on_route(self._model.id, slot.worker, req.prompt)
        return slot

    def first_token(self, slot: Slot, cached_tokens: int | None = None) -> None:
        """The first token of ``slot``'s request arrived now (teaches the core the engine's TTFT)."""
        self._apply(self._core.first_token(slot.rid, self._clock(), cached_tokens))

    def release(
        self, slot: Slot, ok: bool = True, prompt_tokens: int | None = None, cached_tokens: int | None = None
    ) -> None:
        """Give a slot back (idempotent) and dispatch what now fits.

        ``ok``: the request was answered by ``slot.worker``; ``prompt_tokens``/``cached_tokens`` are the
        engine's counts (router feedback).
        """
        if slot.released:
            return
        slot.released = True
        self._pool.release(slot.worker, slot.cost)
        self._costs.pop(slot.rid, None)
        if ok:
            self.demand.answered(prompt_tokens, cached_tokens)
        self._apply(
            self._core.finish(
                slot.rid, self._clock(), ok=ok, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens
            )
        )

    def reroute(self, slot: Slot, exclude: Collection[str]) -> str | None:
        """Move ``slot`` to another eligible worker for a retry; None when there is none (slot released)."""
        self._sync_workers(self._clock())
        self._pool.release(slot.worker, slot.cost)
        worker, decisions = self._core.reroute(slot.rid, exclude, self._clock())
        if worker is None:
            slot.released = True
            self._costs.pop(slot.rid, None)
        else:
            slot.worker, slot.decision = worker, RouteDecision(worker, "retry")
            self._pool.acquire(worker, slot.cost)
        self._apply(decisions)
        return worker

    def observe_peer_route(self, worker: str, prompt: str) -> None:
        """Another replica dispatched ``prompt`` to ``worker`` (:mod:`service.workers.route_sync`): the
        router learns it now (:meth:`policies.admission_core.AdmissionCore.observe_peer_route`)."""
        self._core.observe_peer_route(worker, prompt, self._clock())

    def remove_worker(self, url: str) -> None:
        """Forget a worker (it left the pool); its queued requests are placed elsewhere or shed."""
        self._eligible.pop(url, None)
        self._max_running.pop(url, None)
        self.loads.pop(url, None)
        self._apply(self._core.remove_worker(url, self._clock()))

    async def start(self) -> None:
        """Start the load poller."""
        self._sync_workers(self._clock())
        self._tasks = [asyncio.create_task(self._load_loop(), name="worker-load")]

    async def stop(self) -> None:
        """Stop background work; fail whatever is still queued with 503."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._timer is not None:
            self._timer.cancel()
        for rid, waiter in list(self._waiters.items()):
            if not waiter.done():
                waiter.set_exception(ShuttingDown("The gateway is shutting down.", retry_after_s=1.0))
            self._waiters.pop(rid, None)

    # -- decisions -----------------------------------------------------------------------------------
    def _apply(self, decisions: list[Decision]) -> None:
        """Resolve the waiters the core decided about; re-arm the deadline timer."""
        m = self._metrics
        for d in decisions:
            waiter = self._waiters.pop(d.rid, None)
            if isinstance(d, Dispatch):
                cost = self._costs.get(d.rid, 0)
                self._pool.acquire(d.worker, cost)
                m.child(m.routing_decisions, self._model.routing.policy, d.route.reason).inc()
                m.routing_predicted_cached_chars.inc(d.route.matched_chars)
                slot = Slot(d.rid, d.worker, cost, d.route, False, d.queued_s, d.predicted_ttft_s)
                if waiter is None or waiter.done():  # its caller is gone: give the slot straight back
                    self.release(slot, ok=False)
                else:
                    waiter.set_result(slot)
                continue
            self._costs.pop(d.rid, None)
            tenant = self._tenants.get(d.rid, "-")
            if isinstance(d, Shed):
                m.child(m.shed, d.band, d.reason).inc()
                m.child(m.scheduler_outcomes, d.band, tenant, "shed").inc()
                error: Exception = (
                    NoWorkerAvailable(
                        "No healthy worker is available; retry shortly.",
                        retry_after_s=self._pool.retry_after_s(),
                    )
                    if d.reason == "no_worker"
                    else Overloaded(
                        _shed_message(d), d.reason, min(_RETRY_CAP_S, d.retry_after_s), d.predicted_ttft_s
                    )
                )
            elif d.in_engine:
                self._first_token_expired(d)
                continue
            else:
                m.child(m.scheduler_outcomes, d.band, tenant, "expired").inc()
                goal = self._model.classes[d.band].ttft_goal_ms
                error = QueueTimeout(
                    f"Queued {d.waited_s * 1000:.0f} ms; the '{d.band}' class's time-to-first-token goal "
                    f"({goal:.0f} ms) can no longer be met. Retry later.",
                    retry_after_s=1.0,
                    waited_s=d.waited_s,
                    predicted_ttft_s=d.predicted_ttft_s,
                )
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)
        self._arm_timer()

    def _first_token_expired(self, d: Expire) -> None:
        """End a dispatched request whose first token did not come by its deadline (the core freed its
        slot already; its own release, as it unwinds, gives the pool's back)."""
        m = self._metrics
        m.child(m.scheduler_outcomes, d.band, m.tenant(d.tenant), "first_token_timeout").inc()
        goal_s = self._model.classes[d.band].ttft_goal_ms / 1000.0
        error = FirstTokenTimeout(
            f"No first token {d.waited_s * 1000:.0f} ms after arrival, "
            f"{self._model.scheduler.first_token_deadline_factor:g}x the '{d.band}' class's "
            f"time-to-first-token goal ({goal_s * 1000:.0f} ms): its worker is busy with higher-priority "
            "work. Nothing was charged; retry later.",
            retry_after_s=max(1.0, min(goal_s, 5.0)),
        )
        if self._end_request is not None:
            self._end_request(d.tenant, d.rid, error)

    def _arm_timer(self) -> None:
        deadline = self._core.next_deadline()
        if deadline == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = deadline
        if deadline is not None:
            delay = max(0.0, deadline - self._clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, None
        self._apply(self._core.tick(self._clock()))

    def _gauge_depth(self, band: str) -> None:
        depth = self._core.depth(band) if self._total_depth is None else self._total_depth(band)
        self._metrics.child(self._metrics.queue_depth, band).set(depth)

    # -- workers -------------------------------------------------------------------------------------
    def _sync_workers(self, now: float) -> None:
        """Bring the core's worker set and eligibility in line with the pool (health, draining)."""
        decisions: list[Decision] = []
        known = self._eligible
        pairs = self._pool.eligibility(self._pool_model)
        for url, eligible in pairs:
            was = known.get(url)
            if was is None:
                engine_max = self._max_running.get(url)
                self._core.add_worker(url, self._shared(engine_max), self._replica_share(engine_max))
                known[url] = was = True
            if was != eligible:
                known[url] = eligible
                decisions += self._core.set_eligible(url, eligible, now)
        if len(known) == len(pairs):  # every known worker is still in the pool
            if decisions:
                self._apply(decisions)
            return
        seen = {url for url, _ in pairs}
        for url in [u for u in known if u not in seen]:
            self._eligible.pop(url)
            self.loads.pop(url, None)
            decisions += self._core.remove_worker(url, now)
        if decisions:
            self._apply(decisions)

    async def _load_loop(self) -> None:
        interval = self._model.scheduler.load_poll_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self._poll_once()
            except Exception:  # a poll must never kill the loop
                log.exception("load_poll_failed")

    async def _poll_once(self) -> None:
        self._sync_workers(self._clock())
        urls = [url for url, ok in self._eligible.items() if ok]
        for url in urls:
            if self._max_running.get(url) is None:
                info = self._client.known_info(url) or await self._client.learn(url)
                self._max_running[url] = info.max_running if info is not None else None
        loads = await asyncio.gather(*(self._client.load(u) for u in urls))
        now = self._clock()
        for url, load in zip(urls, loads, strict=True):
            if load is None:
                continue
            engine_max = self._max_running.get(url)
            self.loads[url] = LoadReport(load.running, load.queued, load.kv_usage, engine_max)
            report = LoadReport(
                load.running,
                load.queued,
                load.kv_usage,
                self._shared(engine_max),
                self._replica_share(engine_max),
            )
            self._apply(self._core.load(url, report, now))
            window = self._core.window(url)
            if window is not None:
                self._metrics.worker_window.labels(url).set(window.size)
        for band in self._model.classes:
            self._gauge_depth(band)

    def _shared(self, max_running: int | None) -> int | None:
        """This replica's part of an engine's ``max_running_requests`` (all of it without sharing)."""
        if max_running is None or self._share is None:
            return max_running
        return self._share(max_running)

    def _replica_share(self, max_running: int | None) -> float:
        """This replica's part of a worker's work: its share over the engine's ``max_running_requests``
        (1 without sharing or while the engine's is unknown; :attr:`LoadReport.replica_share`)."""
        if max_running is None or max_running < 1 or self._share is None:
            return 1.0
        return min(1.0, self._share(max_running) / max_running)


def _shed_message(d: Shed) -> str:
    retry = max(1, math.ceil(min(_RETRY_CAP_S, d.retry_after_s)))
    why = {
        "predicted_ttft": "its predicted time to first token exceeds the class's goal",
        "costly_miss": "it needs a long uncached prefill on a worker past capacity",
        "band_full": "the class's queue is full",
        "queue_full": "the queue is full",
        "evicted": "higher-priority work needed its place in the queue",
    }.get(d.reason, d.reason)
    return f"The gateway is overloaded for priority class '{d.band}' ({why}); retry after {retry} s."
