"""Fleet experiments in virtual time; each writes its section of ``docs/experiments.md`` and a plot.

``python -m loadgen.fleet.experiments NAME [--json]`` with NAME one of:

- ``workers``: smallest number of Llama-3.1-70B TP-8 workers serving 1,000 RPS of short prompts (~200 words
  in, 50-150 tokens out) with 99% of requests' TTFT < 500 ms (a shed request counts as a miss), with the
  gateway's default windows (derived from the engine) against fixed windows and the rejected alternatives;
- ``routing``: cache-aware vs round robin on 400 shared system prompts of ~4,000 words: the highest rate
  meeting the SLO, then served RPS and hit rate at 1.5x, 2x and 3x that rate (no congestion collapse);
- ``overload``: three classes at 2x the fleet's capacity: per-class goodput and P99 TTFT;
- ``fairness``: one tenant at 10x the rate of nine others of equal weight at 1.5x capacity: per-tenant
  goodput and Jain's index, WFQ vs first-come-first-served;
- ``all``: all four.

Every run drives :class:`policies.admission_core.AdmissionCore`, the gateway's own scheduler, configured by
the gateway's defaults unless a variant says otherwise. The classes' TTFT goals are set to the scenario's
SLOs, as an operator would. ``--json`` prints one JSON object per experiment with its headline figures.
Runs go to a process pool (one process per CPU). Everything is deterministic for the seeds used here.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from loadgen.fleet.config import FleetConfig
from loadgen.fleet.doc import DOC, IMG, line_plot, table, write_section
from loadgen.fleet.run import run_scenario
from loadgen.scenario import Scenario, parse_scenario
from loadgen.stack import terminate_as_exit
from policies.classes import ClassPolicy, default_classes
from policies.windows import WindowConfig

PROFILE = "llama-3.1-70b-h100-tp8"
GOOD = 0.99  # the SLO: 99% of sent requests within their class's TTFT goal ("P99 TTFT < goal")
SHORT = {
    "system_prompts": {"count": 0},
    "user_turn": {"kind": "uniform", "low": 150, "high": 250},
    "output": {"kind": "uniform", "low": 50, "high": 150},
}
DEFAULT_WINDOW = WindowConfig()
ALTERNATIVES: dict[str, WindowConfig] = {
    "fixed 256": WindowConfig(mode="fixed", initial=256, minimum=256, maximum=256),
    "fixed 512": WindowConfig(mode="fixed", initial=512, minimum=512, maximum=512),
    "AIMD (first round's default: 8 → 1..256)": WindowConfig(mode="aimd", initial=8, maximum=256),
    "engine + TTFT target (½ goal)": WindowConfig(ttft_target_fraction=0.5),
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


# ----------------------------------------------------------------------------------------- experiment 1
def _workers_scenario(rate: float = 1000, duration_s: float = 30, warmup_s: float = 10) -> Scenario:
    tenants = [{"id": "app", "priority_class": "standard"}]
    return scenario("workers-1000rps", rate, duration_s, warmup_s, tenants, {"standard": 500})


def _search(window: WindowConfig, lo: int, hi: int, rate: float, duration_s: float) -> tuple[int | None, Any]:
    sc = _workers_scenario(rate, duration_s, min(10.0, duration_s / 3))
    return smallest_fleet(sc, fleet(1, {"standard": 500}, window=window), lo, hi)


def workers_figures(
    rate: float = 1000, duration_s: float = 30, bounds: tuple[int, int] = (12, 48)
) -> tuple[dict[str, Any], dict[str, tuple[int | None, list[dict[str, Any]]]]]:
    """Experiment 1's headline (``default_workers``, ``best_fixed_workers``) and every search it ran."""
    variants = {"engine-derived (default)": DEFAULT_WINDOW, **ALTERNATIVES}
    found = parallel(_search, [(w, *bounds, rate, duration_s) for w in variants.values()])
    results = dict(zip(variants, found, strict=True))
    fixed = [n for n, w in variants.items() if w.mode == "fixed" and results[n][0] is not None]
    best_fixed = min((results[n][0] for n in fixed), default=None)
    head = {
        "experiment": "workers",
        "default_workers": results["engine-derived (default)"][0],
        "best_fixed_workers": best_fixed,
        "workers_by_window": {n: r[0] for n, r in results.items()},
        "rate_rps": rate,
    }
    return head, results


def exp_workers() -> dict[str, Any]:
    """Experiment 1 (see the module docstring): writes its section and plot; returns the headline."""
    t0 = time.monotonic()
    head, results = workers_figures()
    rows, series = [], {}
    for label, (_, runs) in results.items():
        runs = sorted(runs, key=lambda s: s["workers"])
        series[label] = ([float(s["workers"]) for s in runs], [s["p99"] for s in runs])
        rows += [
            [label, s["workers"], s["p50"], s["p99"], s["goodput"], s["shed_rate"], _windows(s["windows"])]
            for s in runs
        ]
    img = line_plot(
        IMG / "fleet-workers.png",
        series,
        "workers (Llama-3.1-70B, TP 8, H100)",
        "P99 TTFT of served requests, ms (log)",
        "1,000 RPS, ~210 tokens in / ~100 out",
        hline=500,
        logy=True,
    )
    answers = "; ".join(
        f"{n}: {r if r is not None else '> 48'}" for n, r in head["workers_by_window"].items()
    )
    body = f"""## 1. Workers for 1,000 RPS of short prompts (`python -m loadgen.fleet.experiments workers`)

Scenario: one tenant, Poisson 1,000 requests/s for 30 s (first 10 s warm-up, not reported), prompts of
150-250 words (≈ 210 tokens with the chat template), `max_tokens` uniform 50-150 (`ignore_eos`), profile
`{PROFILE}` (NIM-calibrated, see `loadgen/sim/README.md`; SGLang's `max_running_requests` 512). Criterion:
99% of the sent requests get their first token within 500 ms (a shed request counts as a miss). Bisection over
the worker count; every run it made is listed. All variants run the gateway's admission core with its defaults
(cache-aware routing, SLO-aware admission); only the window controller differs.

**Smallest fleet:** {answers}. The default needs **{head["default_workers"]}** workers, the best fixed window
**{head["best_fixed_workers"]}**.

![P99 TTFT vs workers]({img.relative_to(DOC.parent)})

{table(["window", "workers", "TTFT P50 ms", "TTFT P99 ms", "goodput", "shed", "windows (min-max)"], rows)}

Reading: the default window grows (slow start) to what the engine reports it can run at once,
`max_running_requests` = 512, and shrinks only when the engine keeps requests waiting or its KV cache fills;
so each worker runs at its own concurrency and the gateway costs no GPUs. Rejected alternatives:
the first round's AIMD (shrinks on any short engine queue, then grows by one request per second) keeps
windows far below the engine's capacity; a TTFT target on the engine (shrink when its TTFT passes half the
goal) holds here, where TTFT hardly depends on the window, but collapses windows to one request on the
prefill-heavy traffic of experiment 2 (TTFT there is the prefill, not the concurrency). Fixed windows need the
engine's size to be known and configured per model and GPU. ({time.monotonic() - t0:.0f} s wall)
"""
    write_section("workers", body)
    return head


def _windows(sizes: Sequence[int | None]) -> str:
    vals = [v for v in sizes if v is not None]
    return f"{min(vals)}-{max(vals)}" if vals else "-"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the named experiments and print their headlines (JSON lines with ``--json``)."""
    from loadgen.fleet.experiments_load import exp_fairness, exp_overload, exp_routing

    experiments: dict[str, Callable[[], dict[str, Any] | list[dict[str, Any]]]] = {
        "workers": exp_workers,
        "routing": exp_routing,
        "overload": exp_overload,
        "fairness": exp_fairness,
    }
    ap = argparse.ArgumentParser(
        prog="python -m loadgen.fleet.experiments",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the list of experiments a list
    )
    ap.add_argument("name", choices=[*experiments, "all"])
    ap.add_argument("--json", action="store_true", help="print one JSON object per line and experiment")
    args = ap.parse_args(argv)
    for name in experiments if args.name == "all" else [args.name]:
        try:
            result = experiments[name]()
        except KeyboardInterrupt:
            print(f"interrupted during {name}: its figures were not written", file=sys.stderr)
            return 130
        lines = result if isinstance(result, list) else [result]
        for line in lines:
            print(json.dumps(line, default=str) if args.json else f"== {name}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
