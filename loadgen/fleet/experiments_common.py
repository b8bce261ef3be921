"""What the fleet experiments share: the scenarios' shape, the fleet, one run's figures, bisections.

Used by :mod:`loadgen.fleet.experiments` (experiment 1 and the command line) and
:mod:`loadgen.fleet.experiments_load` (experiments 2-4); neither imports the other's experiments.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from loadgen.fleet.config import FleetConfig
from loadgen.fleet.run import run_scenario
from loadgen.scenario import Scenario, parse_scenario
from loadgen.stack import terminate_as_exit
from policies.classes import ClassPolicy, default_classes

PROFILE = "llama-3.1-70b-h100-tp8"
GOOD = 0.99  # the SLO: 99% of sent requests within their class's TTFT goal ("P99 TTFT < goal")
SHORT = {
    "system_prompts": {"count": 0},
    "user_turn": {"kind": "uniform", "low": 150, "high": 250},
    "output": {"kind": "uniform", "low": 50, "high": 150},
}


def goals(slo_ms: Mapping[str, float]) -> dict[str, ClassPolicy]:
    """The default classes with their TTFT goals set to a scenario's SLOs (ms)."""
    return {
        name: replace(c, ttft_goal_s=slo_ms[name] / 1000.0) if name in slo_ms else c
        for name, c in default_classes().items()
    }


def fleet(workers: int, slo_ms: Mapping[str, float], **core: Any) -> FleetConfig:
    """``workers`` workers of :data:`PROFILE`, gateway defaults except the class goals and ``core``."""
    return FleetConfig(profile=PROFILE, workers=workers).with_core(classes=goals(slo_ms), **core)


def scenario(
    name: str,
    rate: float,
    duration_s: float,
    warmup_s: float,
    tenants: list[dict[str, Any]],
    slo_ms: dict[str, float],
    prompts: dict[str, Any] | None = None,
    seed: int = 1,
) -> Scenario:
    """A Poisson scenario in ``loadgen.scenario``'s format (rate in requests/s; SLOs as TTFT in ms)."""
    return parse_scenario(
        {
            "name": name,
            "seed": seed,
            "duration_s": duration_s,
            "warmup_s": warmup_s,
            "tenants": tenants,
            "slo": {c: {"ttft_ms": ms} for c, ms in slo_ms.items()},
            "arrival": {"rate_rps": rate},
            "prompts": prompts or SHORT,
        }
    )


def summarize(sc: Scenario, config: FleetConfig) -> dict[str, Any]:
    """Run one scenario and keep the figures the experiments use (picklable, small)."""
    fr = run_scenario(sc, config)
    rep = fr.report
    o = rep["overall"]
    window = sc.duration_s - sc.warmup_s  # rates over the arrival window: a drain tail does not dilute them
    slo = {c: v.ttft_ms for c, v in sc.slo.items()}
    during: dict[str, list[int]] = {}  # tenant -> [sent, good with the first token before the load ended]
    for r in fr.records:
        if r.warmup:
            continue
        counts = during.setdefault(r.tenant, [0, 0])
        counts[0] += 1
        goal = slo.get(r.priority_class)
        if r.ok and r.ttft_ms is not None and goal is not None and r.ttft_ms <= goal:
            counts[1] += r.sent_s + r.ttft_ms / 1000.0 <= sc.duration_s
    return {
        "workers": config.workers,
        "routing": config.routing,
        "rate": sc.arrival.rate_rps,
        "sent": o["sent"],
        "ok": o["ok"],
        "p50": o["ttft_ms"]["p50"],
        "p99": o["ttft_ms"]["p99"],
        "shed_rate": o["shed_rate"],
        "goodput": o["goodput"],
        "good_rps": (o["goodput"] or 0.0) * o["sent"] / window,
        "throughput_rps": o["ok"] / window,
        "hit_rate": o["cache_hit_rate"],
        "classes": rep["classes"],
        "tenants": rep["tenants"],
        "goodput_during": {t: good / sent for t, (sent, good) in during.items() if sent},
        "imbalance": rep["fleet"]["imbalance"],
        "requests_cv": rep["fleet"]["requests_cv"],
        "windows": rep["fleet"]["final_windows"],
        "shed_reasons": rep["fleet"]["shed_reasons"],
        "cpu_s": rep["fleet"]["cpu_s"],
        "speed": rep["fleet"]["sim_requests_per_cpu_s"],
        "preemptions": rep["fleet"]["preemptions"],
    }


def meets(s: Mapping[str, Any]) -> bool:
    """At least :data:`GOOD` of the sent requests got their first token within the SLO."""
    return s["goodput"] is not None and s["goodput"] >= GOOD


def _ignore_sigint() -> None:
    """Pool processes leave Ctrl-C to their parent, which stops them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def parallel(fn: Callable[..., Any], args: Sequence[tuple[Any, ...]]) -> list[Any]:
    """``fn(*a)`` for each ``a`` in a process pool (one process per CPU), results in order.

    Ctrl-C, SIGTERM or SIGHUP stop the pool's processes at once (``multiprocessing.Pool`` terminates them
    on the way out); ``concurrent.futures``' pool waited for every queued run after Ctrl-C, and its
    processes outlived a parent stopped by SIGTERM."""
    if len(args) == 1:
        return [fn(*args[0])]
    processes = min(len(args), os.cpu_count() or 1)
    with terminate_as_exit():
        pool = multiprocessing.Pool(processes, initializer=_ignore_sigint)
        try:
            results = pool.starmap(fn, args)
            # done: let the workers exit on their own (close + join). ``Pool.__exit__`` terminates them,
            # and its worker-handler thread can start a replacement meanwhile, which terminate then waits
            # for forever (seen once in CI: a forked worker blocked on the task queue's lock)
            pool.close()
            pool.join()
            return results
        finally:
            pool.terminate()  # an error or a signal: stop them at once (a no-op after join)


def smallest_fleet(
    sc: Scenario, config: FleetConfig, lo: int, hi: int
) -> tuple[int | None, list[dict[str, Any]]]:
    """Bisection on the worker count in ``(lo, hi]``: the smallest that :func:`meets` the SLO.

    Assumes more workers never hurt. Returns (count or None if even ``hi`` fails, every run made).
    """
    runs: list[dict[str, Any]] = []
    top = summarize(sc, replace(config, workers=hi))
    runs.append(top)
    if not meets(top):
        return None, runs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        s = summarize(sc, replace(config, workers=mid))
        runs.append(s)
        if meets(s):
            hi = mid
        else:
            lo = mid
    return hi, runs


def slo_rate(
    make: Callable[[float], Scenario], config: FleetConfig, lo: float, hi: float, steps: int
) -> tuple[float, list[dict[str, Any]]]:
    """Largest rate (requests/s, bisection in ``[lo, hi]``) at which ``config`` :func:`meets` the SLO.

    Returns (rate, every run made); ``lo`` when even ``lo`` was not probed successfully.
    """
    runs: list[dict[str, Any]] = []
    for _ in range(steps):
        mid = (lo + hi) / 2
        s = summarize(make(mid), config)
        runs.append(s)
        if meets(s):
            lo = mid
        else:
            hi = mid
    return lo, runs


def _capacity_scenario(rate: float, duration_s: float = 60, warmup_s: float = 10) -> Scenario:
    return scenario(
        "capacity",
        rate,
        duration_s,
        warmup_s,
        [{"id": "app", "priority_class": "standard"}],
        {"standard": 500},
    )


@functools.lru_cache(maxsize=4)
def capacity(
    workers: int = 4, lo: float = 40.0, hi: float = 400.0, steps: int = 6, duration_s: float = 60.0
) -> float:
    """Highest rate (requests/s) at which ``workers`` default-configured workers serve short prompts with
    99% of TTFTs < 500 ms (bisection), over the same duration as the runs that overload it (a shorter probe
    passes rates whose queues have not built up yet); the capacity experiments 3 and 4 overload."""
    warmup = min(10.0, duration_s / 6)
    rate, _ = slo_rate(
        lambda r: _capacity_scenario(r, duration_s, warmup), fleet(workers, {"standard": 500}), lo, hi, steps
    )
    return rate
