"""Run a scenario through the fleet simulation and report it like an HTTP run.

``python -m loadgen.fleet SCENARIO.yaml --workers 8 --routing cache_aware [--profile P] [--replicas N
[--balance random]] [--json out.json]``
prints the same report as ``python -m loadgen run`` (``loadgen.report``), plus the fleet's own figures
(per-worker balance, engine preemptions, simulation speed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.fleet.bridge import fleet_requests, runner_records, tenant_specs
from loadgen.fleet.config import FleetConfig
from loadgen.fleet.records import FleetResult
from loadgen.fleet.sim import simulate
from loadgen.report import build_report, print_report
from loadgen.runner import RequestRecord
from loadgen.scenario import Scenario, ScenarioError, generate_requests, load_scenario
from loadgen.sim.profiles import PROFILES


@dataclass(slots=True)
class FleetRun:
    """A scenario run in virtual time.

    Attributes:
        report: :func:`loadgen.report.build_report`'s dict, plus ``fleet`` (:func:`fleet_figures`).
        records: the runner-shaped records (one per planned request).
        result: the raw simulation result.
    """

    report: dict[str, Any]
    records: list[RequestRecord]
    result: FleetResult


def fleet_figures(result: FleetResult, warmup_s: float = 0.0) -> dict[str, Any]:
    """Balance and speed figures the HTTP report cannot have.

    ``imbalance``: max / mean of the requests each worker received after the warm-up (1.0 = even);
    ``requests_cv``: their coefficient of variation (std / mean); ``sim_requests_per_cpu_s``: planned
    requests simulated per CPU second (the simulation's speed); ``preemptions``: engine retractions.
    """
    per_worker = [0] * len(result.workers)
    for r in result.records:
        if r.worker >= 0 and r.arrival_s >= warmup_s:
            per_worker[r.worker] += 1
    mean = statistics.fmean(per_worker) if per_worker else 0.0
    return {
        "workers": len(result.workers),
        "requests_per_worker": per_worker,
        "imbalance": max(per_worker) / mean if mean else None,
        "requests_cv": statistics.pstdev(per_worker) / mean if mean else None,
        "final_windows": [w.window_sizes[-1] if w.window_sizes else None for w in result.workers],
        "preemptions": result.preemptions,
        "virtual_s": result.duration_s,
        "cpu_s": result.cpu_s,
        "events": result.events,
        "sim_requests_per_cpu_s": len(result.records) / result.cpu_s if result.cpu_s > 0 else None,
        "shed_reasons": _count(r.shed_reason for r in result.records if r.shed_reason),
        "outcomes": _count(r.outcome for r in result.records),
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def run_scenario(scenario: Scenario, config: FleetConfig, until_s: float | None = None) -> FleetRun:
    """Plan ``scenario``, simulate it on ``config`` (its tenants taken from the scenario), report it."""
    plan = generate_requests(scenario)
    tenants = {**config.tenants, **tenant_specs(scenario)}
    result = simulate(dataclasses.replace(config, tenants=tenants), fleet_requests(plan), until_s)
    records = runner_records(plan, result)
    run = {"base_url": f"virtual://{config.workers}x{config.profile_name}/{config.routing}", "wall_s": 0.0}
    report = build_report(scenario, records, run)
    report["fleet"] = fleet_figures(result, scenario.warmup_s)
    return FleetRun(report, records, result)


def _positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1 (got {value})")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: simulate a scenario file and print its report; bad arguments exit 2 with a message."""
    ap = argparse.ArgumentParser(prog="python -m loadgen.fleet", description=__doc__)
    ap.add_argument("scenario", type=Path)
    ap.add_argument("--workers", type=_positive_int, default=4)
    ap.add_argument("--profile", default="llama-3.1-70b-h100-tp8", choices=sorted(PROFILES))
    ap.add_argument("--routing", default="cache_aware", choices=["cache_aware", "round_robin", "least_load"])
    ap.add_argument(
        "--replicas",
        type=_positive_int,
        default=1,
        help="gateway replicas, each with its own admission core and its share of each worker's window",
    )
    ap.add_argument("--balance", default="round_robin", choices=["round_robin", "random"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the report as JSON here")
    args = ap.parse_args(argv)
    if args.json and not args.json.parent.is_dir():  # found out before the run, not after it
        ap.error(f"--json: no folder {args.json.parent}")
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as err:
        ap.error(str(err))
    config = FleetConfig(
        profile=args.profile,
        workers=args.workers,
        seed=args.seed,
        replicas=args.replicas,
        balance=args.balance,
    ).with_core(routing=args.routing)
    fr = run_scenario(scenario, config)
    print_report(fr.report)
    fleet = fr.report["fleet"]
    imbalance, speed = fleet["imbalance"], fleet["sim_requests_per_cpu_s"]  # None: nothing to measure
    print(
        f"fleet: imbalance {'-' if imbalance is None else f'{imbalance:.3f}'}, preemptions "
        f"{fleet['preemptions']}, {fleet['virtual_s']:.1f} virtual s in {fleet['cpu_s']:.2f} CPU s "
        f"({'-' if speed is None else f'{speed:.0f}'} requests/CPU s)"
    )
    if args.json:
        args.json.write_text(json.dumps(fr.report, indent=1, default=str))
    return 0
