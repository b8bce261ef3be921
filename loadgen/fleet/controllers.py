"""Scaling controllers for :func:`loadgen.fleet.scaling.run_scaled`: the planner, an oracle and two threshold
rules, each answering every interval how many workers a model should have.

- :class:`PlannerController`: the gateway's planner, :class:`policies.planner.Planner`, fed exactly as the
  gateway's planner task feeds it (:mod:`policies.planner_inputs`: the demand counted at admission, the
  queues, the capacity measured on workers running full or a profiled prior, the engines' batch and KV);
- :class:`QueueRule`: vLLM production-stack's autoscaling, KEDA on ``vllm:num_requests_waiting`` with a
  target of 5 per replica, as the HPA that KEDA creates computes it (Kubernetes 1.30
  ``pkg/controller/podautoscaler``): ``desired = ceil(total waiting / 5)``, no change within the 10 %
  tolerance, scale-up at once but by at most ``max(+100 %, +4)`` per 15 s, scale-down only to the highest
  recommendation of the last 300 s (``scaleDown.stabilizationWindowSeconds``' default) and, the sensible
  scale-down rule added here, by one worker per minute at most (an HPA ``Pods`` policy: with the bare
  formula, no queue means ``ceil(0 / 5)``, the floor, at once);
- :class:`SaturationRule`: llm-d's Workload Variant Autoscaler, its saturation analyzer with its defaults
  (``kvCacheThreshold`` 0.8, ``queueLengthThreshold`` 5, ``kvSpareTrigger`` 0.1, ``queueSpareTrigger`` 3,
  every 60 s, ``GLOBAL_OPT_INTERVAL``, on the peak of each replica's metrics over the last minute,
  ``max_over_time[1m]``): a replica is saturated when its KV cache usage reaches 0.8 or its waiting
  requests 5; one more replica when the non-saturated ones' mean spare KV falls under 0.1 or their mean
  spare queue under 3 (or none is left unsaturated), counted from the ready replicas so that none is added
  while one is starting; one fewer when the load of the non-saturated replicas spread over one replica less
  still leaves both spares at their triggers (its scale-down safety simulation, itself an N-1 projection);
- :class:`OracleController`: knows the trace; holds, in each minute, the fewest workers that meet the goals
  at that minute's peak rate (a per-worker capacity measured by the experiment), asking for them one cold
  start ahead.

Every controller keeps its decisions in :attr:`decisions` (time, desired, and what it decided from).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loadgen.fleet.scaling import LaneView
from policies.planner import Planner, PlannerConfig
from policies.planner_inputs import PlannerMeter, combine


class PlannerController:
    """The gateway's planner in the simulation (module docstring).

    Args:
        config: the planner's settings (the gateway's ``planner.*``).
        prior_capacity_rps: ``planner.prior_capacity_rps``: a worker's capacity at a full window from a
            profiling run, used until a worker is measured running full.
        initial: the workers running at the start (the planner's first decision holds them).
        name: its label in reports.
    """

    def __init__(
        self,
        config: PlannerConfig,
        prior_capacity_rps: float | None,
        initial: int,
        name: str = "planner",
    ) -> None:
        self.name = name
        self.interval_s = config.interval_s
        self.planner = Planner(config, initial=initial)
        self.meter = PlannerMeter(prior_capacity_rps)
        self._last: float | None = None
        #: (time, desired, reason, needed now, needed at the horizon, capacity rps used)
        self.decisions: list[tuple[float, int, str, float, float, float | None]] = []

    def decide(self, view: LaneView, now: float) -> int:
        """Measure what the core saw since the last tick and decide (as ``PlannerTask.tick`` does)."""
        elapsed = self.interval_s if self._last is None else max(1e-3, now - self._last)
        self._last = now
        eligible = view.eligible()
        measure = self.meter.measure(
            view.take_demand(),
            elapsed,
            view.bands,
            view.depth(),
            view.snapshots(),
            view.loads,
            set(eligible),
        )
        combined = combine([measure])  # one gateway replica
        d = self.planner.decide(self.meter.inputs(combined, view.goals_s, len(eligible)), now)
        self.decisions.append(
            (now, d.desired, d.reason, d.needed_now, d.needed_forecast, combined["capacity"])
        )
        return d.desired


@dataclass(slots=True)
class QueueRule:
    """KEDA/HPA on requests waiting per worker (module docstring). Times in s.

    Attributes:
        target: waiting requests per worker the HPA aims at (production-stack: 5).
        interval_s: the HPA's sync period (15 s).
        tolerance: no change while ``|total / (target x current) - 1|`` is within it (0.1).
        down_window_s: scale-down stabilization window (300 s).
        down_step: workers removed per ``down_period_s`` at most (the sensible scale-down rule).
        down_period_s: see ``down_step``.
        min_workers, max_workers: the ScaledObject's ``minReplicaCount`` and ``maxReplicaCount``.
        name: its label in reports.
    """

    target: float = 5.0
    interval_s: float = 15.0
    tolerance: float = 0.1
    down_window_s: float = 300.0
    down_step: int = 1
    down_period_s: float = 60.0
    min_workers: int = 1
    max_workers: int = 64
    name: str = "queue rule"
    decisions: list[tuple[float, int, int]] = field(default_factory=list)
    _current: int | None = None
    _recommendations: deque[tuple[float, int]] = field(default_factory=deque)
    _last_down: float = -math.inf

    def decide(self, view: LaneView, now: float) -> int:
        """One HPA sync (module docstring)."""
        current = self._current
        recs = self._recommendations
        if current is None:  # as if it had held the workers it finds for a whole window
            current = view.count("ready") + view.count("starting")
            recs.append((now, current))
        waiting = sum(view.waiting().values())
        ratio = waiting / (self.target * current) if current else math.inf
        rec = current if abs(ratio - 1.0) <= self.tolerance else math.ceil(waiting / self.target)
        rec = min(self.max_workers, max(self.min_workers, rec))
        recs.append((now, rec))
        while len(recs) > 1 and recs[0][0] < now - self.down_window_s:
            recs.popleft()
        if rec > current:
            desired = min(rec, max(2 * current, current + 4))
        else:
            desired = max(r for _, r in recs)  # the stabilized recommendation
            if desired < current:
                if now - self._last_down >= self.down_period_s:
                    desired = max(desired, current - self.down_step)
                    self._last_down = now
                else:
                    desired = current
        desired = min(self.max_workers, max(self.min_workers, desired))
        self._current = desired
        self.decisions.append((now, desired, waiting))
        return desired


@dataclass(slots=True)
class SaturationRule:
    """llm-d's WVA saturation analyzer (module docstring). Times in s.

    Attributes:
        kv_threshold: a replica is saturated at this KV cache usage (0.8).
        queue_threshold: ... or at this many waiting requests (5).
        kv_spare_trigger: scale up when the mean spare KV of the non-saturated replicas is below (0.1).
        queue_spare_trigger: ... or their mean spare queue (3).
        decide_every_s: how often it acts (``GLOBAL_OPT_INTERVAL``, 60 s).
        interval_s: how often it samples each replica's metrics (for ``max_over_time[1m]``).
        window_s: the metrics' peak window (60 s).
        min_workers, max_workers: bounds.
        name: its label in reports.
    """

    kv_threshold: float = 0.8
    queue_threshold: float = 5.0
    kv_spare_trigger: float = 0.1
    queue_spare_trigger: float = 3.0
    decide_every_s: float = 60.0
    interval_s: float = 15.0
    window_s: float = 60.0
    min_workers: int = 1
    max_workers: int = 64
    name: str = "saturation rule"
    decisions: list[tuple[float, int, str]] = field(default_factory=list)
    _samples: deque[tuple[float, dict[str, tuple[float, float]]]] = field(default_factory=deque)
    _desired: int | None = None
    _next_decision: float | None = None

    def decide(self, view: LaneView, now: float) -> int:
        """Sample the replicas; every ``decide_every_s`` analyse their peaks and move by one replica."""
        loads = view.loads
        sample = {
            url: (loads[url].kv_usage if url in loads else 0.0, float(q)) for url, q in view.waiting().items()
        }
        self._samples.append((now, sample))
        while self._samples and self._samples[0][0] <= now - self.window_s:
            self._samples.popleft()
        ready = len(sample)
        if self._desired is None:
            self._desired = ready + view.count("starting")
            self._next_decision = now + self.decide_every_s
        if self._next_decision is not None and now + 1e-9 < self._next_decision:
            return self._desired
        self._next_decision = now + self.decide_every_s
        action = self.analyse(self.peaks(), ready)
        if action == "up":
            # counted from the ready replicas: none added while one is starting
            self._desired = max(self._desired, ready + 1)
        elif action == "down" and view.count("starting") == 0:
            self._desired = ready - 1
        self._desired = min(self.max_workers, max(self.min_workers, self._desired))
        self.decisions.append((now, self._desired, action))
        return self._desired

    def peaks(self) -> dict[str, tuple[float, float]]:
        """Each replica's peak KV usage and waiting requests over the window (``max_over_time[1m]``)."""
        latest = self._samples[-1][1] if self._samples else {}
        out: dict[str, tuple[float, float]] = {}
        for url in latest:
            kv = max(s[url][0] for _, s in self._samples if url in s)
            q = max(s[url][1] for _, s in self._samples if url in s)
            out[url] = (kv, q)
        return out

    def analyse(self, peaks: dict[str, tuple[float, float]], ready: int) -> str:
        """``up``, ``down`` or ``hold`` from the replicas' peaks (WVA's steps 1-5)."""
        if ready == 0:
            return "up"
        free = [(kv, q) for kv, q in peaks.values() if kv < self.kv_threshold and q < self.queue_threshold]
        if not free:
            return "up"
        spare_kv = sum(self.kv_threshold - kv for kv, _ in free) / len(free)
        spare_q = sum(self.queue_threshold - q for _, q in free) / len(free)
        if spare_kv < self.kv_spare_trigger or spare_q < self.queue_spare_trigger:
            return "up"
        if len(free) >= 2:
            left = len(free) - 1
            kv_after = self.kv_threshold - sum(kv for kv, _ in free) / left
            q_after = self.queue_threshold - sum(q for _, q in free) / left
            if kv_after >= self.kv_spare_trigger and q_after >= self.queue_spare_trigger:
                return "down"
        return "hold"


class OracleController:
    """Knows the trace: in each ``minute_s`` slot ``m`` it holds ``counts[m]`` workers, asking for them
    ``lead_s`` (the cold start) ahead; it never lets go of a worker the current slot needs.

    Args:
        counts: the fewest workers that meet the goals in each slot, from time 0.
        minute_s: a slot's length, s.
        lead_s: how far ahead it looks (the cold start plus one interval), s.
        interval_s: how often it is asked, s.
        name: its label in reports.
    """

    def __init__(
        self,
        counts: Sequence[int],
        minute_s: float,
        lead_s: float,
        interval_s: float,
        name: str = "oracle",
    ) -> None:
        if not counts or minute_s <= 0 or lead_s < 0 or interval_s <= 0:
            raise ValueError("counts, minute_s > 0, lead_s >= 0 and interval_s > 0")
        self.counts = list(counts)
        self.minute_s = minute_s
        self.lead_s = lead_s
        self.interval_s = interval_s
        self.name = name
        self.decisions: list[tuple[float, int]] = []

    def wanted(self, t: float) -> int:
        """Workers to hold at ``t``: the most any slot from ``t`` to ``t + lead_s`` needs."""
        first = max(0, int(t // self.minute_s))
        last = min(len(self.counts) - 1, int((t + self.lead_s) // self.minute_s))
        if first > last:
            return self.counts[-1]
        return max(self.counts[first : last + 1])

    def decide(self, view: LaneView, now: float) -> int:
        """The schedule's count (the view is not read: it knows the future)."""
        desired = self.wanted(now)
        self.decisions.append((now, desired))
        return desired


def decision_series(controller: Any) -> list[tuple[float, int]]:
    """``(time, desired)`` of a controller's decisions."""
    return [(d[0], d[1]) for d in controller.decisions]


__all__ = [
    "OracleController",
    "PlannerController",
    "QueueRule",
    "SaturationRule",
    "decision_series",
]
