"""A changing worker count in the fleet simulation: a scaling controller drives it every interval.

:func:`run_scaled` runs :class:`loadgen.fleet.sim.FleetSim` with a :class:`ScalingController` (the planner, an
oracle, threshold rules: :mod:`loadgen.fleet.controllers`). Every ``controller.interval_s`` of virtual time
the controller reads the model's admission core through a :class:`LaneView` (what the gateway or a
Prometheus scrape could read: the eligible workers, the core's per-worker state and queues, the engines'
load reports, the demand counted at admission) and answers how many workers the model should have; the run
then acts like Kubernetes on a StatefulSet's replica count:

- more wanted than asked for: new workers start, each serving after ``FleetConfig.cold_start_s``;
- fewer: workers still starting are cancelled first (newest first), then the newest serving workers are
  drained (a StatefulSet removes its highest ordinals): no new requests, their queued ones placed elsewhere,
  their running ones finish, then they are gone.

A worker costs from the moment it is asked for to the moment it is gone (its GPUs are held during its cold
start and its drain): :meth:`ScaledRun.worker_seconds`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from loadgen.fleet.config import FleetConfig, FleetRequest
from loadgen.fleet.records import FleetResult
from loadgen.fleet.sim import FleetSim
from policies.admission_types import WorkerSnapshot
from policies.demand import DemandCounts
from policies.windows import LoadReport


class LaneView:
    """What a controller reads of one served model at a tick (the gateway's view of its workers).

    Args:
        sim: the running simulation.
        lane: the model's index in ``sim.lanes``.
    """

    def __init__(self, sim: FleetSim, lane: int = 0) -> None:
        self._sim = sim
        self._lane = sim.lanes[lane]
        self._index = lane

    @property
    def now(self) -> float:
        """Virtual time, s."""
        return self._sim.now

    def states(self) -> dict[str, str]:
        """Every worker ever asked for: URL -> ``starting``, ``ready``, ``draining`` or ``stopped``."""
        return self._sim.worker_states(self._index)

    def eligible(self) -> list[str]:
        """The workers taking new requests (ready, not draining)."""
        return [u for u, s in self.states().items() if s == "ready"]

    def count(self, state: str) -> int:
        """Workers in ``state``."""
        return sum(s == state for s in self.states().values())

    def snapshots(self) -> list[WorkerSnapshot]:
        """The core's per-worker state (:meth:`policies.admission_core.AdmissionCore.snapshot`)."""
        return self._lane.core.snapshot(self._sim.now)

    @property
    def loads(self) -> dict[str, LoadReport]:
        """Each serving or draining worker's last load report (SGLang's ``/metrics``)."""
        return self._lane.loads

    @property
    def bands(self) -> list[str]:
        """The model's classes."""
        return list(self._lane.model.core.classes)

    @property
    def goals_s(self) -> dict[str, float]:
        """Each class's TTFT goal, s."""
        return {b: c.ttft_goal_s for b, c in self._lane.model.core.classes.items()}

    def depth(self) -> dict[str, int]:
        """Requests queued in the gateway per class now."""
        return {b: self._lane.core.depth(b) for b in self._lane.model.core.classes}

    def take_demand(self) -> DemandCounts:
        """The arrivals and cache hits counted since the last call (one reader: the planner)."""
        return self._lane.demand.take()

    def waiting(self) -> dict[str, int]:
        """Requests waiting per eligible worker: in the gateway's queue for it and inside its engine
        (``sglang:num_queue_reqs``): vLLM's ``num_requests_waiting`` where no gateway queues."""
        queued = {s.url: s.queued for s in self.snapshots()}
        out = {}
        for url in self.eligible():
            load = self.loads.get(url)
            out[url] = queued.get(url, 0) + (load.queued if load is not None else 0)
        return out


class ScalingController(Protocol):
    """Decides a model's worker count; :func:`run_scaled` asks it every :attr:`interval_s`."""

    name: str
    interval_s: float

    def decide(self, view: LaneView, now: float) -> int:
        """Workers the model should have (asked for and serving, not draining) from ``now`` (s) on."""
        ...


@dataclass(frozen=True, slots=True)
class ScalePoint:
    """One tick: time (s), the decision, and the workers starting, ready and draining just after it."""

    t: float
    desired: int
    starting: int
    ready: int
    draining: int


@dataclass(slots=True)
class ScaledRun:
    """A run with a changing worker count.

    Attributes:
        name: the controller's name.
        result: the simulation's records and per-worker tallies (with their start and stop times).
        timeline: one point per tick.
        extra: what the controller kept of its decisions (e.g. the planner's reasons).
    """

    name: str
    result: FleetResult
    timeline: list[ScalePoint]
    extra: dict[str, Any] = field(default_factory=dict)

    def worker_seconds(self, start_s: float, end_s: float) -> float:
        """Workers held (asked for and not yet gone) integrated over ``[start_s, end_s]``, worker-s."""
        total = 0.0
        for w in self.result.workers:
            stop = end_s if w.stopped_s is None else min(w.stopped_s, end_s)
            total += max(0.0, stop - max(w.started_s, start_s))
        return total

    def held(self, t: float) -> int:
        """Workers held at time ``t`` (s)."""
        return sum(w.started_s <= t and (w.stopped_s is None or w.stopped_s > t) for w in self.result.workers)


def direction_changes(points: Sequence[tuple[float, int]], start_s: float, end_s: float) -> int:
    """Reversals of a decision series ``(t, value)`` within ``[start_s, end_s)``: a rise followed by a fall
    or a fall by a rise, counting the last move before ``start_s`` as the direction it starts from."""
    changes, direction, prev = 0, 0, None
    for t, v in points:
        if prev is not None and v != prev:
            step = 1 if v > prev else -1
            if start_s <= t < end_s and direction != 0 and step != direction:
                changes += 1
            if t < end_s:
                direction = step
        prev = v
    return changes


def reconcile(sim: FleetSim, desired: int, now: float, lane: int = 0) -> None:
    """Make the workers asked for and serving (not draining) ``desired`` (see the module docstring)."""
    states = sim.worker_states(lane)
    alive = [u for u, s in states.items() if s in ("starting", "ready")]
    if desired > len(alive):
        for _ in range(desired - len(alive)):
            sim.start_worker(now, sim.config.cold_start_s, lane)
        return
    excess = len(alive) - max(0, desired)
    victims = [u for u in reversed(alive) if states[u] == "starting"][:excess]
    victims += [u for u in reversed(alive) if states[u] == "ready"][: excess - len(victims)]
    for url in victims:
        sim.stop_worker(url, now)


def run_scaled(
    config: FleetConfig,
    requests: Iterable[FleetRequest],
    controller: ScalingController,
    start_s: float | None = None,
    extra: Callable[[], dict[str, Any]] | None = None,
) -> ScaledRun:
    """Simulate ``requests`` on ``config.workers`` workers (serving at time 0) under ``controller``.

    Args:
        config: the fleet (one served model); ``cold_start_s`` is every new worker's cold start.
        requests: the planned requests.
        controller: asked every ``controller.interval_s`` from ``start_s`` (default: one interval) on, until
            no arrival is left and nothing is in flight.
        start_s: the first tick, s.
        extra: called after the run; what it returns is kept as :attr:`ScaledRun.extra`.

    Raises:
        ValueError: ``config`` serves several models, or a controller interval that is not positive.
    """
    if config.models:
        raise ValueError("run_scaled drives one served model (config.models must be empty)")
    if not controller.interval_s > 0:
        raise ValueError("a controller's interval_s must be > 0")
    sim = FleetSim(config, requests)
    view = LaneView(sim)
    timeline: list[ScalePoint] = []

    def tick(t: float) -> None:
        if sim.finished:
            return
        desired = max(0, int(controller.decide(view, t)))
        reconcile(sim, desired, t)
        states = list(sim.worker_states().values())
        count = states.count
        timeline.append(ScalePoint(t, desired, count("starting"), count("ready"), count("draining")))
        sim.call_at(t + controller.interval_s, tick)

    sim.call_at(controller.interval_s if start_s is None else start_s, tick)
    result = sim.run()
    return ScaledRun(controller.name, result, timeline, extra() if extra is not None else {})


def ceil_workers(need: float) -> int:
    """Whole workers for a fractional need (a hair of float error does not add one)."""
    return max(0, math.ceil(need - 1e-9))


__all__ = [
    "LaneView",
    "ScalePoint",
    "ScaledRun",
    "ScalingController",
    "ceil_workers",
    "direction_changes",
    "reconcile",
    "run_scaled",
]
