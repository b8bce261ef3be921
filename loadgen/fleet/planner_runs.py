"""The runs of experiment 7 (:mod:`loadgen.fleet.experiments_planner`): the planner over a day.

The gateway's planner (:class:`policies.planner.Planner`,
fed as the gateway feeds it) scales a fleet of Llama-3.1-70B TP-8 workers through a day-shaped trace
(:mod:`loadgen.fleet.planner_trace`: 0.3x -> 2x -> 0.3x of 20 workers' capacity, a 30 s burst at 3x),
against an oracle that knows the trace and the two threshold rules the anchors use
(:mod:`loadgen.fleet.controllers`), on the same trace and the same simulation, each new worker serving a
cold start after it is asked for (:attr:`loadgen.fleet.config.FleetConfig.cold_start_s`). Goals (issue 29):
interactive goodput >= 99% and standard >= 95% outside the burst; GPU-hours <= 1.15x the oracle's; at
most one change of direction per 10 minutes at steady load; fewer GPU-hours than either rule at the same
goodput.

**The unit and the oracle.** One worker's capacity at the goals, ``unit_rps``, is measured first by
bisection (:func:`goal_capacity`: the highest rate per worker at which ``capacity_workers`` workers serve
the class mix at constant rate with both goodput goals met). It is the trace's unit (1x = 20 x it), the
planner's profiled prior (``planner.prior_capacity_rps``: an operator's profiling run, as Dynamo's SLA
planner profiles throughput per replica at its targets) and the oracle's capacity: in each minute of the
day the oracle holds ``ceil(peak rate of the minute without the burst / unit_rps)`` workers, the fewest
that meet the goals at that minute's peak, and asks for them one cold start (plus one interval) ahead
(:class:`loadgen.fleet.controllers.OracleController`). Its own run in the simulation shows its goodput.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from loadgen.fleet.config import FleetConfig, TenantSpec
from loadgen.fleet.controllers import (
    OracleController,
    PlannerController,
    QueueRule,
    SaturationRule,
    decision_series,
)
from loadgen.fleet.experiments_common import PROFILE, goals, parallel
from loadgen.fleet.planner_trace import MIX, ClassMix, DayShape, day_requests, steady_requests
from loadgen.fleet.records import RequestRecord
from loadgen.fleet.scaling import ScaledRun, ScalingController, direction_changes, run_scaled
from loadgen.fleet.sim import simulate
from policies.planner import PlannerConfig
from service.config.fleet import PlannerSettings

GPUS_PER_WORKER = 8
"""A worker of :data:`loadgen.fleet.experiments_common.PROFILE` is one tensor-parallel group of 8 H100s."""

POLICIES = ("planner", "oracle", "queue rule", "saturation rule")
"""The controllers compared, in the table's order."""

ORACLE_HEADROOMS = (0.0, 0.05, 0.1)
"""The oracle's headrooms over the unit capacity (:attr:`Setup.oracle_headroom`), tried in order: the
issue's oracle is the fewest workers per minute *that meet the goal*. At exactly the unit (the highest rate
per worker at which 4 workers met both goals over a minute at a constant rate) a day's oracle misses them:
the unit sits on the goal's edge, and 4 workers' minute at it passing says little of 40 workers' 10 minutes
(its standard goodput was 94.2% over the day). The experiment runs each and keeps the first that meets
both goodput goals (the last when none does)."""


@dataclass(frozen=True, slots=True)
class Setup:
    """One run of the experiment: the day, the unit, the cold start and the planner's settings.

    Attributes:
        day: the trace (and the time-lapse ``day.speed``).
        unit_rps: one worker's capacity at the goals, requests/s (:func:`goal_capacity`).
        cold_start_s: a new worker's cold start in the day's seconds (the fleet's default, 300 s).
        planner: the planner's settings in the day's seconds (the gateway's defaults unless changed).
        mix: the classes.
        seed: the trace's seed.
        miss_policy: where the cache-aware router sends a cache miss (``CacheAwareConfig.miss_policy``).
            ``least_load`` here: with the gateway's default, ``smallest_tree``, a worker that joins has the
            smallest tree and takes every miss until its tree has caught up with the others', so that with
            prompts that share no prefix, each scale-up sends all new traffic to the new workers while the
            others idle (the section shows the oracle's goodput both ways).
        oracle_headroom: the oracle's workers per minute are ``ceil(peak x (1 + oracle_headroom))``
            workers' worth (:data:`ORACLE_HEADROOMS`: the experiment keeps the cheapest that meets the
            goals).
    """

    day: DayShape = field(default_factory=DayShape)
    unit_rps: float = 25.0
    cold_start_s: float = field(default_factory=lambda: FleetConfig().cold_start_s)
    planner: PlannerConfig = field(default_factory=lambda: PlannerSettings().config())
    mix: tuple[ClassMix, ...] = MIX
    seed: int = 1
    miss_policy: Literal["smallest_tree", "least_load"] = "least_load"
    oracle_headroom: float = 0.0

    @property
    def speed(self) -> float:
        """The time-lapse factor."""
        return self.day.speed

    def virtual(self, day_s: float) -> float:
        """A duration of the day in the simulation's seconds."""
        return day_s / self.day.speed

    def oracle_counts(self) -> list[int]:
        """Per minute of the day, the fewest workers that serve its peak rate (the burst left out)."""
        day = self.day
        counts = []
        for m in range(math.ceil(day.day_s / 60.0)):
            peak = max(day.base(m * 60.0 + k) for k in range(0, 61, 5))
            counts.append(max(1, math.ceil(peak * day.scale * (1.0 + self.oracle_headroom) - 1e-9)))
        return counts

    def fleet(self, workers: int, tenants: dict[str, TenantSpec]) -> FleetConfig:
        """The fleet: ``workers`` serving at time 0, the mix's goals, the time-lapsed cold start."""
        slo = {c.name: c.goal_ms for c in self.mix}
        config = FleetConfig(profile=PROFILE, workers=workers, cold_start_s=self.virtual(self.cold_start_s))
        routing = replace(config.core.cache_aware, miss_policy=self.miss_policy)
        return replace(config, tenants=tenants).with_core(classes=goals(slo), cache_aware=routing)


def lapsed_planner(config: PlannerConfig, speed: float, cold_start_s: float) -> PlannerConfig:
    """The planner's settings with every period divided by ``speed`` (the forecast's samples and damping
    per step stay: the number of steps per period is the same), except the queue term's median: a queue
    drains in the requests' time, which the time-lapse keeps, so its median spans ``speed`` times as many
    decisions, the same real seconds as the gateway's (lapsed too, the queue of the 30 s burst, which took
    some 20 s of the requests' time to drain, outlasted the median's 90 day-seconds and asked for 17
    workers that came 5 minutes after it)."""
    f = config.forecast
    queue = config.queue_median_samples or f.median_samples
    return replace(
        config,
        queue_median_samples=max(1, round(queue * speed)),
        interval_s=config.interval_s / speed,
        cold_start_s=cold_start_s / speed,
        scale_down_window_s=config.scale_down_window_s / speed,
        forecast=replace(f, level_tau_s=f.level_tau_s / speed, trend_tau_s=f.trend_tau_s / speed),
    )


def controller(name: str, setup: Setup, initial: int) -> ScalingController:
    """The controller ``name`` (one of :data:`POLICIES`) with its periods time-lapsed."""
    s = setup.speed
    if name == "planner":
        cfg = lapsed_planner(setup.planner, s, setup.cold_start_s)
        return PlannerController(cfg, setup.unit_rps, initial)
    if name == "oracle":
        interval = setup.planner.interval_s / s
        lead = setup.virtual(setup.cold_start_s) + interval
        return OracleController(setup.oracle_counts(), 60.0 / s, lead, interval)
    if name == "queue rule":
        return QueueRule(interval_s=15.0 / s, down_window_s=300.0 / s, down_period_s=60.0 / s)
    if name == "saturation rule":
        return SaturationRule(decide_every_s=60.0 / s, interval_s=15.0 / s, window_s=60.0 / s)
    raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")


def goodput(records: Sequence[RequestRecord], c: ClassMix, keep: Any = None) -> float | None:
    """Share of ``c``'s sent requests (those ``keep(record)`` accepts) served with a first token within its
    goal; None when none was sent."""
    sent = [r for r in records if r.band == c.name and (keep is None or keep(r))]
    if not sent:
        return None
    good = sum(r.outcome == "ok" and r.ttft_s is not None and r.ttft_s * 1000.0 <= c.goal_ms for r in sent)
    return good / len(sent)


def policy_figures(run: ScaledRun, setup: Setup, decisions: list[tuple[float, int]]) -> dict[str, Any]:
    """One run's figures (small and picklable): GPU-hours, goodput per class outside the burst and over
    the day, direction changes at steady load, and the worker counts per minute for the plot."""
    day, v = setup.day, setup.virtual
    end = v(day.day_s)
    b0, b1 = day.burst_window
    settle = max(c.goal_ms for c in setup.mix) / 1000.0  # the burst's queue is gone one goal after it

    def outside(r: RequestRecord) -> bool:
        return not v(b0) <= r.arrival_s < v(b1) + settle

    records = [r for r in run.result.records if r.arrival_s < end]
    steady = [(v(a), v(b)) for a, b in day.steady()]
    changes = sum(direction_changes(decisions, a, b) for a, b in steady)
    steady_min = sum(b - a for a, b in day.steady()) / 60.0
    minutes = range(math.ceil(day.day_s / 60.0))
    return {
        "name": run.name,
        "gpu_hours": run.worker_seconds(0.0, end) * setup.speed * GPUS_PER_WORKER / 3600.0,
        "goodput_outside": {c.name: goodput(records, c, outside) for c in setup.mix},
        "goodput_all": {c.name: goodput(records, c) for c in setup.mix},
        "changes": changes,
        "changes_per_10min": changes / (steady_min / 10.0),
        "held": [run.held(v(m * 60.0 + 30.0)) for m in minutes],
        "decided": [_at(decisions, v(m * 60.0 + 30.0)) for m in minutes],
        "peak_workers": max((p.starting + p.ready + p.draining for p in run.timeline), default=0),
        "sent": len(records),
        "shed": sum(r.outcome in ("shed", "evicted", "expired") for r in records),
        "cpu_s": run.result.cpu_s,
        "extra": run.extra,
    }


def _at(series: list[tuple[float, int]], t: float) -> int | None:
    last = None
    for when, value in series:
        if when > t:
            break
        last = value
    return last


def run_policy(name: str, setup: Setup) -> dict[str, Any]:
    """Run one policy over the day (in a pool process: the trace is generated here, not pickled)."""
    requests, tenants = day_requests(setup.day, setup.unit_rps, setup.mix, setup.seed)
    initial = setup.oracle_counts()[0]
    ctl = controller(name, setup, initial)
    extra = None
    if isinstance(ctl, PlannerController):
        planner = ctl

        def extra() -> dict[str, Any]:
            reasons: dict[str, int] = {}
            for d in planner.decisions:
                reasons[d[2]] = reasons.get(d[2], 0) + 1
            return {"reasons": reasons}

    run = run_scaled(setup.fleet(initial, tenants), requests, ctl, extra=extra)
    return policy_figures(run, setup, decision_series(ctl)) | {"headroom": setup.oracle_headroom}


def meets_goals(records: Sequence[RequestRecord], mix: Sequence[ClassMix], warmup_s: float) -> bool:
    """Every class's goodput (arrivals from ``warmup_s`` on) at or above its goal."""
    kept = [r for r in records if r.arrival_s >= warmup_s]
    return all((goodput(kept, c) or 0.0) >= c.goodput_goal for c in mix)


def _probe(
    per_worker: float, workers: int, duration_s: float, warmup_s: float, mix: tuple[ClassMix, ...]
) -> bool:
    requests, tenants = steady_requests(per_worker * workers, duration_s, mix)
    setup = Setup(mix=mix)
    result = simulate(setup.fleet(workers, tenants), requests)
    return meets_goals(result.records, mix, warmup_s)


def goal_capacity(
    workers: int = 4,
    lo: float = 16.0,
    hi: float = 36.0,
    steps: int = 6,
    duration_s: float = 60.0,
    warmup_s: float = 10.0,
    mix: tuple[ClassMix, ...] = MIX,
) -> float:
    """One worker's capacity at the goals, requests/s: the highest rate per worker (bisection in
    ``[lo, hi]``) at which ``workers`` workers serve the mix at a constant Poisson rate with every class's
    goodput goal met."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _probe(mid, workers, duration_s, warmup_s, mix) else (lo, mid)
    return lo


def meets_goodput(row: dict[str, Any], mix: Sequence[ClassMix]) -> bool:
    """Whether a run's figures (:func:`policy_figures`) have every class's goodput outside the burst at or
    above its goal."""
    return all((row["goodput_outside"][c.name] or 0.0) >= c.goodput_goal for c in mix)


def verdicts(rows: dict[str, dict[str, Any]], mix: Sequence[ClassMix]) -> dict[str, Any]:
    """The goals, each with its figure and whether the planner meets it."""
    p, o = rows["planner"], rows["oracle"]

    ratio = p["gpu_hours"] / o["gpu_hours"]
    rules = {}
    for name in ("queue rule", "saturation rule"):
        r = rows[name]
        # at the same goodput: a rule that reaches the planner's goodput must cost more; one that does
        # not reach the goals is beaten by a planner that does
        same = all(
            (r["goodput_outside"][c.name] or 0.0) >= (p["goodput_outside"][c.name] or 0.0) - 0.005
            for c in mix
        )
        rules[name] = {
            "same_goodput": same,
            "gpu_hours": r["gpu_hours"],
            "beaten": meets_goodput(p, mix)
            and (p["gpu_hours"] < r["gpu_hours"] or (not same and not meets_goodput(r, mix))),
        }
    return {
        "goodput": meets_goodput(p, mix),
        "ratio": ratio,
        "ratio_ok": ratio <= 1.15,
        "changes_ok": p["changes_per_10min"] <= 1.0,
        "rules": rules,
        "oracle_meets": meets_goodput(o, mix),
    }


def planner_figures(setup: Setup | None = None, capacity_workers: int = 4) -> dict[str, Any]:
    """The experiment: the unit (measured unless ``setup`` gives one), every policy's run, the verdicts."""
    if setup is None:
        setup = Setup(unit_rps=goal_capacity(capacity_workers))
    jobs = [(name, setup) for name in POLICIES if name != "oracle"]
    jobs += [("oracle", replace(setup, oracle_headroom=h)) for h in ORACLE_HEADROOMS]
    runs = parallel(run_policy, jobs)
    rows = {r["name"]: r for r in runs if r["name"] != "oracle"}
    oracles = [r for r in runs if r["name"] == "oracle"]
    meeting = [r for r in oracles if meets_goodput(r, setup.mix)]
    rows["oracle"] = meeting[0] if meeting else oracles[-1]
    return {
        "oracles": [
            {"headroom": r["headroom"], "gpu_hours": r["gpu_hours"], "goodput_outside": r["goodput_outside"]}
            for r in oracles
        ],
        "experiment": "planner",
        "unit_rps": setup.unit_rps,
        "speed": setup.speed,
        "cold_start_s": setup.cold_start_s,
        "oracle_counts": setup.oracle_counts(),
        "rows": rows,
        "verdicts": verdicts(rows, setup.mix),
    }


def headline(figures: dict[str, Any]) -> dict[str, Any]:
    """What the command line prints: the planner's figures against the oracle and the rules."""
    rows, v = figures["rows"], figures["verdicts"]
    return {
        "experiment": "planner",
        "unit_rps": round(figures["unit_rps"], 2),
        "gpu_hours": {n: round(r["gpu_hours"], 1) for n, r in rows.items()},
        "ratio_to_oracle": round(v["ratio"], 3),
        "planner_goodput_outside_burst": rows["planner"]["goodput_outside"],
        "planner_changes_per_10min": round(rows["planner"]["changes_per_10min"], 2),
        "goals": {
            "goodput": v["goodput"],
            "gpu_hours": v["ratio_ok"],
            "direction_changes": v["changes_ok"],
            "beats_rules": all(r["beaten"] for r in v["rules"].values()),
        },
    }


__all__ = [
    "GPUS_PER_WORKER",
    "ORACLE_HEADROOMS",
    "POLICIES",
    "Setup",
    "controller",
    "goal_capacity",
    "goodput",
    "headline",
    "lapsed_planner",
    "meets_goodput",
    "planner_figures",
    "policy_figures",
    "run_policy",
    "verdicts",
]
