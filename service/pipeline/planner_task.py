"""The planner's periodic task: ``radixgate_desired_workers{model}`` from what admission measured.

Every ``planner.interval_s`` for each served model (:class:`service.pipeline.served_models.ModelLane`):

1. **Measure** on this replica (:meth:`PlannerTask.measure`): per class, the arrival rate of every request
   that reached admission, shed ones included (:class:`service.pipeline.demand.DemandMeter`), its mean
   prompt and output lengths, and the requests queued now; the cache hit rate of the requests answered;
   each eligible worker's capacity (:meth:`policies.estimates.WorkerEstimates.capacity`, requests/s at a
   full window), kept only from moments it ran full (its window at least 90 % used, or requests waiting
   for it: below saturation Little's law reads a short step and overstates it), scaled from this
   replica's window share to the engine's whole window; the engines' running batch and KV usage (their
   load reports); else ``planner.prior_capacity_rps``, a profiled figure.
2. **Share** it (:class:`service.workers.replicas.ReplicaRegistry`): the measures ride on the replica's
   heartbeat, and the live replicas' are summed (arrivals, queues, cache tokens) or averaged (capacity,
   batch, KV usage: every replica sees the same engines): each replica decides for the whole gateway
   tier, so one replica's opinion (KEDA's ``max`` over them) is the fleet's.
3. **Decide** (:meth:`policies.planner.Planner.decide`, hysteresis included) with
   :meth:`policies.planner.EngineModel.from_capacity` and publish the decision
   (:class:`service.observability.planner_metrics.PlannerMetrics`); a change is logged
   (``planner_decision``).

Payload of a heartbeat, per model id: ``{"classes": {band: [rate_rps, prompt_tokens, output_tokens,
queued]}, "capacity": rps | null, "window": W | null, "batch": running | null, "kv": usage | null,
"tokens": [prompt, cached]}``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import structlog

from policies.planner import ClassDemand, EngineModel, PlanDecision, Planner, PlannerInputs
from service.config.fleet import PlannerSettings
from service.observability.planner_metrics import PlannerMetrics
from service.pipeline.served_models import ModelLane, ServedModels
from service.workers.pool import WorkerPool
from service.workers.replicas import ReplicaRegistry
from tenancy.errors import StoreUnavailable

log = structlog.get_logger("radixgate.planner")

FULL_FRACTION = 0.9
"""A worker's capacity counts only while this share of its window runs (or requests wait for it)."""


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def combine(measures: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's measures of several replicas as one (module docstring, step 2)."""
    classes: dict[str, list[float]] = {}
    for m in measures:
        for band, (rate, prompt, output, queued) in m.get("classes", {}).items():
            # rate, rate x prompt, rate x output, queued, replicas that report it
            c = classes.setdefault(band, [0.0, 0.0, 0.0, 0.0, 0.0])
            c[0] += rate
            c[1] += rate * prompt if rate > 0 else 0.0
            c[2] += rate * output if rate > 0 else 0.0
            c[3] += queued
            c[4] += 1
    out: dict[str, list[float]] = {}
    for band, (rate, prompt, output, queued, n) in classes.items():
        if rate > 0:
            out[band] = [rate, prompt / rate, output / rate, queued]
        else:  # lengths unweighted: no arrivals to weigh them by
            firsts = [m["classes"][band] for m in measures if band in m.get("classes", {})]
            out[band] = [0.0, sum(f[1] for f in firsts) / n, sum(f[2] for f in firsts) / n, queued]
    windows: list[int] = [m["window"] for m in measures if m.get("window")]
    tokens = [m.get("tokens", [0, 0]) for m in measures]
    return {
        "classes": out,
        "capacity": _mean(m.get("capacity") for m in measures),
        "window": max(windows) if windows else None,
        "batch": _mean(m.get("batch") for m in measures),
        "kv": _mean(m.get("kv") for m in measures),
        "tokens": [sum(t[0] for t in tokens), sum(t[1] for t in tokens)],
    }


class PlannerTask:
    """One :class:`~policies.planner.Planner` per served model, driven every ``settings.interval_s``.

    Args:
        settings: ``planner.*``.
        models: the served models (their schedulers and goals).
        pool: the workers (eligible count per model).
        metrics: where the decisions are published.
        replicas: the replica heartbeat the measures are shared on (None: this replica alone).
        clock: monotonic time, s (injected for tests).
    """

    def __init__(
        self,
        settings: PlannerSettings,
        models: ServedModels,
        pool: WorkerPool,
        metrics: PlannerMetrics,
        replicas: ReplicaRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._models = models
        self._pool = pool
        self._metrics = metrics
        self._replicas = replicas
        self._clock = clock
        config = settings.config()
        self._planners: dict[str, Planner] = {}
        for lane in models.lanes:
            eligible = sum(ok for _, ok in pool.eligibility(lane.model.id))
            self._planners[lane.model.id] = Planner(config, initial=eligible)
        self._full: dict[str, dict[str, float]] = {lane.model.id: {} for lane in models.lanes}
        self._lengths: dict[str, dict[str, tuple[float, float]]] = {m.model.id: {} for m in models.lanes}
        self._hit_rate: dict[str, float] = {}
        self._last: float | None = None
        self.decisions: dict[str, PlanDecision] = {}  #: the last decision per model id

    # -- step 1 -------------------------------------------------------------------------------------
    def measure(self, now: float) -> dict[str, dict[str, Any]]:
        """This replica's measures per model id since the last call (module docstring, step 1)."""
        elapsed = self._settings.interval_s if self._last is None else max(1e-3, now - self._last)
        self._last = now
        return {lane.model.id: self._measure_lane(lane, elapsed) for lane in self._models.lanes}

    def _measure_lane(self, lane: ModelLane, elapsed: float) -> dict[str, Any]:
        scheduler, model_id = lane.scheduler, lane.model.id
        counts = scheduler.demand.take()
        lengths = self._lengths[model_id]
        classes: dict[str, list[float]] = {}
        for band in lane.model.classes:
            c = counts.bands.get(band)
            if c is not None and c.requests:
                lengths[band] = (c.prompt_tokens / c.requests, max(1.0, c.output_tokens / c.requests))
            prompt, output = lengths.get(band, (0.0, 1.0))
            rate = c.requests / elapsed if c is not None else 0.0
            classes[band] = [rate, prompt, output, float(scheduler.depth(band))]
        full = self._full[model_id]
        eligible = {url for url, ok in self._pool.eligibility(model_id) if ok}
        for url in [u for u in full if u not in eligible]:
            del full[url]
        runs, kvs, windows = [], [], []
        for snap in scheduler.snapshot():
            if snap.url not in eligible:
                continue
            load = scheduler.loads.get(snap.url)
            engine_window = load.max_running if load is not None and load.max_running else snap.window
            windows.append(engine_window)
            if load is not None:
                runs.append(float(load.running))
                kvs.append(load.kv_usage)
            saturated = snap.in_flight >= FULL_FRACTION * snap.window or snap.queued > 0
            if snap.capacity_rps and saturated and snap.window > 0:
                full[snap.url] = snap.capacity_rps * engine_window / snap.window
        capacity = _mean(full.values()) if full else self._settings.prior_capacity_rps
        return {
            "classes": classes,
            "capacity": capacity,
            "window": max(windows) if windows else None,
            "batch": _mean(runs),
            "kv": _mean(kvs),
            "tokens": [counts.prompt_tokens, counts.cached_tokens],
        }

    # -- steps 2 and 3 ------------------------------------------------------------------------------
    async def tick(self) -> dict[str, PlanDecision]:
        """Measure, share, decide and publish once; returns the decisions per model id."""
        now = self._clock()
        local = self.measure(now)
        peers: list[dict[str, Any]] = []
        if self._replicas is not None:
            self._replicas.payload = {"planner": local}
            try:
                live = await self._replicas.beat()
            except StoreUnavailable:
                live = []
            for r in live:
                if r.id != self._replicas.id and isinstance(r.payload, dict):
                    peers.append(r.payload.get("planner") or {})
        for lane in self._models.lanes:
            model_id = lane.model.id
            measures = [local[model_id]] + [p[model_id] for p in peers if model_id in p]
            self.decisions[model_id] = self._decide(lane, combine(measures), now)
        return self.decisions

    def _decide(self, lane: ModelLane, m: dict[str, Any], now: float) -> PlanDecision:
        model_id = lane.model.id
        prompt, cached = m["tokens"]
        if prompt > 0:
            self._hit_rate[model_id] = cached / prompt
        goals = {band: c.ttft_goal_ms / 1e3 for band, c in lane.model.classes.items()}
        classes = {
            band: ClassDemand(rate, prompt_len, output_len, round(queued), goals[band])
            for band, (rate, prompt_len, output_len, queued) in m["classes"].items()
            if band in goals
        }
        engine = None
        capacity, window = m["capacity"], m["window"]
        rate = sum(c.arrival_rps for c in classes.values())
        if capacity and window and classes:
            if rate > 0:
                output = sum(c.arrival_rps * c.output_tokens for c in classes.values()) / rate
            else:
                output = max(c.output_tokens for c in classes.values())
            engine = EngineModel.from_capacity(capacity, window, output, self._hit_rate.get(model_id, 0.0))
            engine = replace(engine, batch=m["batch"], kv_usage=m["kv"])
        workers = sum(ok for _, ok in self._pool.eligibility(model_id))
        planner = self._planners[model_id]
        before = planner.desired
        decision = planner.decide(PlannerInputs(workers, classes, engine), now)
        needed = max(decision.needed_now, decision.needed_forecast)
        self._metrics.publish(model_id, decision.desired, needed, decision.reason)
        if decision.desired != before:
            log.info(
                "planner_decision",
                model=model_id,
                desired=decision.desired,
                before=before,
                reason=decision.reason,
                needed=round(needed, 3),
                workers=workers,
                arrival_rps=round(rate, 3),
                capacity_rps=capacity,
            )
        return decision

    async def run(self) -> None:
        """:meth:`tick` now, then every ``interval_s`` until cancelled (a failing tick is logged)."""
        while True:
            try:
                await self.tick()
            except Exception:  # a bug in one decision must not end the signal
                log.exception("planner_tick_failed")
            await asyncio.sleep(self._settings.interval_s)


__all__ = ["FULL_FRACTION", "PlannerTask", "combine"]
