"""The planner's periodic task: ``radixgate_desired_workers{model}`` from what admission measured.

Every ``planner.interval_s`` for each served model (:class:`service.pipeline.served_models.ModelLane`):

1. **Measure** on this replica (:meth:`PlannerTask.measure`, with
   :class:`policies.planner_inputs.PlannerMeter`, which the fleet simulation's planner uses too): per
   class, the arrival rate of every request that reached admission, shed ones included
   (:class:`policies.demand.DemandMeter`), its mean prompt and output lengths, and the requests queued
   now; the cache hit rate of the requests answered; each eligible worker's capacity
   (:meth:`policies.estimates.WorkerEstimates.capacity`, requests/s at a full window), kept only from
   moments it ran full (its window at least 90 % used, or requests waiting for it: below saturation
   Little's law reads a short step and overstates it), scaled from this replica's window share to the
   engine's whole window; the engines' running batch and KV usage (their load reports); else
   ``planner.prior_capacity_rps``, a profiled figure.
2. **Share** it (:class:`service.workers.replicas.ReplicaRegistry`): the measures ride on the replica's
   heartbeat, and the live replicas' are summed (arrivals, queues, cache tokens) or averaged (capacity,
   batch, KV usage: every replica sees the same engines): each replica decides for the whole gateway
   tier, so one replica's opinion (KEDA's ``max`` over them) is the fleet's.
3. **Decide** (:meth:`policies.planner.Planner.decide`, hysteresis included) on the inputs
   :meth:`policies.planner_inputs.PlannerMeter.inputs` builds, with
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
from collections.abc import Callable
from typing import Any

import structlog

from policies.planner import PlanDecision, Planner
from policies.planner_inputs import FULL_FRACTION, PlannerMeter, combine
from service.config.fleet import PlannerSettings
from service.observability.planner_metrics import PlannerMetrics
from service.pipeline.served_models import ModelLane, ServedModels
from service.workers.pool import WorkerPool
from service.workers.replicas import ReplicaRegistry
from tenancy.errors import StoreUnavailable

log = structlog.get_logger("radixgate.planner")


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
        self._meters = {lane.model.id: PlannerMeter(settings.prior_capacity_rps) for lane in models.lanes}
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
        eligible = {url for url, ok in self._pool.eligibility(model_id) if ok}
        return self._meters[model_id].measure(
            scheduler.demand.take(),
            elapsed,
            lane.model.classes,
            {band: scheduler.depth(band) for band in lane.model.classes},
            scheduler.snapshot(),
            scheduler.loads,
            eligible,
        )

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
        goals = {band: c.ttft_goal_ms / 1e3 for band, c in lane.model.classes.items()}
        workers = sum(ok for _, ok in self._pool.eligibility(model_id))
        planner = self._planners[model_id]
        before = planner.desired
        inputs = self._meters[model_id].inputs(m, goals, workers)
        decision = planner.decide(inputs, now)
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
                arrival_rps=round(sum(c.arrival_rps for c in inputs.classes.values()), 3),
                capacity_rps=m["capacity"],
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
