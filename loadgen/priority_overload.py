"""Experiment: three priority classes under 2x overload, through the gateway, over HTTP.

1. Start a local stack (Redis + gateway + one SGLang CPU worker; ``loadgen.stack.LocalStack``).
2. Measure capacity with the top class: a closed loop of ``--concurrency`` clients for ``--probe-s``
   seconds -> R requests/s (with ``--capacity open``, then the requests/s the worker serves under
   open-loop Poisson arrivals of that class offered above R). With ``--pin`` the worker has the last core
   to itself.
3. Offer an open-loop Poisson load of ``--overload`` x R for ``--duration-s`` seconds, each arrival a
   streamed chat request from one of three tenants (interactive, standard, batch; equal shares).
4. Print per class: sent, served, shed (503), P50/P99 TTFT of the served ones, goodput (share of all sent
   that was served within the class's TTFT goal).

Run: ``.venv/bin/python -m loadgen.priority_overload`` (about 2 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from loadgen.latency_breakdown import breakdown, read_request_lines
from loadgen.stack import CPU_PRIORITY_CLASSES, LocalStack, terminate_as_exit

CLASSES = ("interactive", "standard", "batch")
CPU_CALIBRATION = 0.99
"""Default of ``--calibration``, the gateway's own: 99% of the requests admitted after a predicted wait should
meet their goal."""
HEADER = ("class", "sent", "served", "shed", "P50 TTFT ms", "P99 TTFT ms", "goal ms", "goodput")
BREAKDOWN_HEADER = (
    "class",
    "served",
    "queued P50 / P99 ms",
    "engine P50 / P99 ms",
    "measured / predicted P50 / P90",
    "above prediction",
)
DEFAULT_DURATION_S = 40.0
GOAL_MS = {"interactive": 1500.0, "standard": 4000.0, "batch": 15000.0}


@dataclass(slots=True)
class Result:
    """One request's outcome: class, HTTP status, TTFT (ms, None when not served)."""

    cls: str
    status: int
    ttft_ms: float | None
    end_s: float = 0.0
    """When the answer ended (``time.monotonic()``), s."""
    rid: str | None = None
    """The gateway's request id (``x-request-id``)."""


async def one_request(http: httpx.AsyncClient, key: str, cls: str, max_tokens: int, i: int) -> Result:
    """Send one streamed chat request; measure the time to its first content chunk."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": f"Tell me fact number {i} about rivers."}],
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    try:
        async with http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            rid = resp.headers.get("x-request-id")
            if resp.status_code != 200:
                await resp.aread()
                return Result(cls, resp.status_code, None, time.monotonic(), rid)
            async for line in resp.aiter_lines():
                if (
                    ttft is None
                    and line.startswith("data: {")
                    and '"content":"' in line
                    and '"content":""' not in line
                ):
                    ttft = (time.perf_counter() - t0) * 1000
    except httpx.HTTPError:
        return Result(cls, 599, None, time.monotonic())
    return Result(cls, 200, ttft, time.monotonic(), rid)


async def measure_capacity(base: str, key: str, concurrency: int, seconds: float, max_tokens: int) -> float:
    """Closed loop: completed requests/s with ``concurrency`` clients."""
    done = 0
    deadline = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient, c: int) -> None:
        nonlocal done
        i = 0
        while time.monotonic() < deadline:
            if (await one_request(http, key, "probe", max_tokens, c * 1000 + i)).status == 200:
                done += 1
            i += 1

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        await asyncio.gather(*(client(http, c) for c in range(concurrency)))
    return done / (time.monotonic() - t0)


async def measure_open_capacity(
    base: str, key: str, rate: float, seconds: float, max_tokens: int, seed: int
) -> float:
    """Open loop: completed requests/s while Poisson arrivals of one class (``key``'s) come at ``rate``
    req/s, above what the worker serves (the gateway sheds the excess). Answers that end in the first
    quarter (warm-up) or after the arrivals stop (drain) are not counted.

    A closed loop measures a different engine: its clients' requests finish together and come back
    together, so the engine prefills them in one step; open-loop arrivals come one by one, and on a CPU
    each one's prefill is a forward pass that stalls every running decode. The overload is a multiple of
    what the worker serves under this arrival process."""
    t0 = time.monotonic()
    results, _ = await open_loop(base, {"probe": key}, rate, seconds, max_tokens, seed, ("probe",))
    start, end = t0 + seconds / 4, t0 + seconds
    return sum(r.status == 200 and start <= r.end_s <= end for r in results) / (end - start)


async def open_loop(
    base: str,
    keys: dict[str, str],
    rate: float,
    seconds: float,
    max_tokens: int,
    seed: int,
    classes: tuple[str, ...] = CLASSES,
) -> tuple[list[Result], float]:
    """Poisson arrivals at ``rate`` req/s for ``seconds``, each of a class drawn from ``classes``;
    arrivals never wait for responses. Returns the results and the wall time from the first arrival until
    the last answer ended, s."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task[Result]] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
        t_start = time.monotonic()
        t_end = t_start + seconds
        i = 0
        while time.monotonic() < t_end:
            cls = rng.choice(classes)
            tasks.append(asyncio.create_task(one_request(http, keys[cls], cls, max_tokens, i)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        results = list(await asyncio.gather(*tasks))
        return results, time.monotonic() - t_start


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, nearest rank; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(results: list[Result]) -> list[dict[str, Any]]:
    """Per-class figures: sent, served, shed, P50/P99 TTFT (ms), goodput."""
    rows = []
    for cls in CLASSES:
        mine = [r for r in results if r.cls == cls]
        served = [r.ttft_ms for r in mine if r.status == 200 and r.ttft_ms is not None]
        good = [t for t in served if t <= GOAL_MS[cls]]
        rows.append(
            {
                "class": cls,
                "sent": len(mine),
                "served": len(served),
                "shed_rate": sum(r.status == 503 for r in mine) / max(1, len(mine)),
                "ttft_p50_ms": pct(served, 0.5),
                "ttft_p99_ms": pct(served, 0.99),
                "goal_ms": GOAL_MS[cls],
                "goodput": len(good) / max(1, len(mine)),
                "mean_ttft_ms": statistics.fmean(served) if served else float("nan"),
            }
        )
    return rows


async def run(stack_url: str, keys: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """Measure capacity, then offer ``args.overload`` x capacity; returns the figures."""
    # probed with the top class (a class may be limited to part of the window, window_share)
    top = keys["interactive"]
    closed = await measure_capacity(stack_url, top, args.concurrency, args.probe_s, args.max_tokens)
    capacity = closed
    if args.capacity == "open":
        probe_rate = args.open_probe_factor * closed
        capacity = await measure_open_capacity(
            stack_url, top, probe_rate, args.probe_s, args.max_tokens, args.seed + 1
        )
    rate = args.overload * capacity
    results, wall_s = await open_loop(stack_url, keys, rate, args.duration_s, args.max_tokens, args.seed)
    served_rps = sum(r.status == 200 for r in results) / wall_s
    interactive_rps = sum(r.cls == "interactive" for r in results) / args.duration_s
    return {
        "request_ids": {cls: [r.rid for r in results if r.cls == cls and r.rid] for cls in CLASSES},
        "window_max": args.window_max or None,
        "capacity_rps": capacity,
        "capacity_kind": args.capacity,
        "closed_loop_capacity_rps": closed,
        "offered_rps": rate,
        # the worker's throughput under this overload, and how much of it interactive alone asked for
        "served_rps": served_rps,
        "interactive_share_of_served": interactive_rps / served_rps if served_rps else float("nan"),
        "overload": args.overload,
        "classes": report(results),
    }


def print_figures(figures: dict[str, Any]) -> None:
    """A rich table of the per-class figures."""
    console = Console()
    cores = figures.get("engine_cores")
    console.print(f"engine cores: {cores if cores else 'shared with the load generator and the gateway'}")
    console.print(
        f"capacity ({capacity_words(figures)}): {figures['capacity_rps']:.2f} req/s; closed loop "
        f"{figures['closed_loop_capacity_rps']:.2f} req/s; offered {figures['offered_rps']:.2f} "
        f"req/s ({figures['overload']:g}x); served {figures['served_rps']:.2f} req/s under that load, "
        f"of which interactive alone asked {figures['interactive_share_of_served']:.0%}"
    )
    scales = figures.get("prediction_scale") or {}
    console.print(
        "TTFT prediction scale at the end (calibration): "
        + (", ".join(f"{band} {x:g}" for band, x in scales.items()) or "none")
    )
    table = Table(*HEADER)
    for r in figures["classes"]:
        table.add_row(
            r["class"],
            str(r["sent"]),
            str(r["served"]),
            f"{r['shed_rate']:.1%}",
            f"{r['ttft_p50_ms']:.0f}",
            f"{r['ttft_p99_ms']:.0f}",
            f"{r['goal_ms']:.0f}",
            f"{r['goodput']:.1%}",
        )
    console.print(table)
    split = Table(*BREAKDOWN_HEADER, title="served requests' TTFT: the gateway's queue and the engine")
    for cells in breakdown_rows(figures.get("breakdown", [])):
        split.add_row(*map(str, cells))
    console.print(split)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line (see the module's text); bad arguments exit 2 before anything starts."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--overload", type=float, default=2.0, help="offered load / measured capacity")
    parser.add_argument("--duration-s", type=float, default=DEFAULT_DURATION_S)
    parser.add_argument("--probe-s", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=8, help="clients of the closed-loop probe")
    parser.add_argument(
        "--capacity",
        choices=("open", "closed"),
        default="closed",
        help="what the overload multiplies: open = requests/s the worker serves under open-loop "
        "Poisson arrivals of one class, offered at --open-probe-factor x the closed-loop figure for "
        "--probe-s (the arrival process of the run itself); closed (default) = a closed loop of "
        "--concurrency clients (its requests come back together and share prefill steps: an "
        "overstatement on a CPU)",
    )
    parser.add_argument("--open-probe-factor", type=float, default=1.5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--window-max",
        type=int,
        default=0,
        help="largest window per worker, requests (0: the gateway's default, the engine's own "
        "max_running_requests: engine.cpu_max_running_requests, 8, on a launched CPU worker)",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="give the SGLang worker the last core to itself and this process, Redis and the gateway the "
        "others (engine.cpu_affinity), so the load generator does not take the engine's CPU (default: off; "
        "on 2 cores the engine then runs on one, each step about twice as long)",
    )
    parser.add_argument(
        "--calibration",
        type=float,
        default=CPU_CALIBRATION,
        help="scheduler.prediction_calibration_target of the gateway (default %(default)s, the gateway's "
        "own): scale predicted queue waits up while fewer than this share of requests admitted after a "
        "predicted wait meet their goal; on this CPU worker the TTFT model predicts interactive first "
        "tokens at about 0.6x their time (0: off)",
    )
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument(
        "--write-doc",
        action="store_true",
        help="also write the figures into docs/experiments.md (a section per --window-max)",
    )
    args = parser.parse_args(argv)
    for flag, value, smallest in (
        ("--overload", args.overload, 0),
        ("--duration-s", args.duration_s, 0),
        ("--probe-s", args.probe_s, 0),
        ("--open-probe-factor", args.open_probe_factor, 0),
        ("--concurrency", args.concurrency, 0),
        ("--max-tokens", args.max_tokens, 0),
    ):
        if not value > smallest:  # NaN too
            parser.error(f"{flag} must be above {smallest} (got {value:g})")
    if args.window_max < 0:
        parser.error(f"--window-max must be 0 or more (got {args.window_max})")
    if not 0 <= args.calibration < 1:
        parser.error(f"--calibration must be in [0, 1) (got {args.calibration:g})")
    if args.json and not Path(args.json).resolve().parent.is_dir():  # not found out after the run
        parser.error(f"--json: no folder {Path(args.json).parent}")
    env = {"RADIXGATE_PRIORITY_CLASSES": CPU_PRIORITY_CLASSES}
    env["RADIXGATE_SCHEDULER__PREDICTION_CALIBRATION_TARGET"] = repr(args.calibration)
    if args.window_max > 0:
        env["RADIXGATE_SCHEDULER__WINDOW_INITIAL"] = str(min(4, args.window_max))
        env["RADIXGATE_SCHEDULER__WINDOW_MAX"] = str(args.window_max)
    engine_cores = pin_engine(args.pin)
    if engine_cores is not None:
        env["RADIXGATE_ENGINE__CPU_AFFINITY"] = json.dumps(sorted(engine_cores))
    try:
        with terminate_as_exit(), LocalStack(Path(".run/priority-overload"), env=env) as stack:
            keys = {cls: stack.create_tenant(f"tenant-{cls}", priority_class=cls) for cls in CLASSES}
            figures = asyncio.run(run(stack.url, keys, args))
            figures["prediction_scale"] = prediction_scales(stack)
            log = read_request_lines(stack.run_dir / "gateway.log")
    except KeyboardInterrupt:  # the stack is stopped by now (Redis, gateway, its SGLang worker)
        print("interrupted: the stack was stopped; no figures", file=sys.stderr)
        raise SystemExit(130) from None
    figures["breakdown"] = breakdown(figures.pop("request_ids"), log)
    figures["engine_cores"] = sorted(engine_cores) if engine_cores is not None else None
    print_figures(figures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    if args.write_doc:
        write_doc(figures, args)


def prediction_scales(stack: LocalStack) -> dict[str, float]:
    """The gateway's calibration scale of its TTFT predictions per class, on the (one) worker at the end
    of the run (``GET /admin/workers``)."""
    with stack.admin() as http:
        workers = http.get("/admin/workers").raise_for_status().json()["data"]
    return {band: round(x, 3) for w in workers for band, x in w.get("prediction_scale", {}).items()}


def scale_words(figures: dict[str, Any]) -> str:
    """The calibration scales at the end of the run, in words ('' when none was learned)."""
    scales = figures.get("prediction_scale") or {}
    if not scales:
        return ""
    return "; scale of the predictions at the end: " + ", ".join(f"{b} {x:.2f}" for b, x in scales.items())


def capacity_words(figures: dict[str, Any]) -> str:
    """What the capacity figure is, in words."""
    if figures["capacity_kind"] == "open":
        return "served under open-loop arrivals of one class"
    return "closed loop"


def pin_engine(pin: bool) -> set[int] | None:
    """With ``pin``, confine this process, and so Redis and the gateway it starts, to every usable core but
    the last, and return ``{last}`` for the engine; else None."""
    usable = os.sched_getaffinity(0)
    if not pin:
        return None
    if len(usable) < 2:
        raise SystemExit("--pin needs 2 or more usable cores")
    last = max(usable)
    os.sched_setaffinity(0, usable - {last})
    return {last}


def write_doc(figures: dict[str, Any], args: argparse.Namespace) -> None:
    """Write the figures into ``docs/experiments.md`` as the section ``cpu-overload-w<N>`` (or
    ``cpu-overload-engine`` for the gateway's default window), with the command that made them."""
    from loadgen.fleet.doc import table, write_section

    which = f"w{args.window_max}" if args.window_max else "engine"
    flag = f" --window-max {args.window_max}" if args.window_max else ""
    cores = figures.get("engine_cores")
    if cores:
        which += "-pinned"
        flag += " --pin"
    placement = (
        f"the worker pinned to core {', '.join(map(str, cores))} alone, the load generator, Redis and the "
        "gateway on the other core"
        if cores
        else "the load generator shares the cores"
    )
    if args.duration_s != DEFAULT_DURATION_S:
        flag += f" --duration-s {args.duration_s:g}"
    if args.capacity != "closed":
        which += "-open"
        flag += f" --capacity {args.capacity}"
    if args.calibration != CPU_CALIBRATION:
        which += f"-cal{args.calibration:g}"
        flag += f" --calibration {args.calibration:g}"
    calibration = (
        f"TTFT predictions calibrated until {args.calibration:.0%} of the requests admitted as on time "
        "meet their goal (`scheduler.prediction_calibration_target`, the gateway's default: it scales "
        "the predicted waits in the gateway's queue)"
        if args.calibration == CPU_CALIBRATION
        else f"`scheduler.prediction_calibration_target` {args.calibration:g}"
        if args.calibration
        else "uncalibrated TTFT predictions (`scheduler.prediction_calibration_target` 0)"
    )
    window = (
        f"windows of at most {args.window_max} requests"
        if args.window_max
        else "the gateway's default window (the engine's own max_running_requests)"
    )
    rows = [
        [
            r["class"],
            r["sent"],
            r["served"],
            f"{r['shed_rate']:.1%}",
            round(r["ttft_p50_ms"]),
            round(r["ttft_p99_ms"]),
            round(r["goal_ms"]),
            f"{r['goodput']:.1%}",
        ]
        for r in figures["classes"]
    ]
    body = "\n\n".join(
        [
            f"## Real CPU worker: three classes at {args.overload:g}x overload, {window}, "
            f"{'calibrated' if args.calibration else 'uncalibrated'} TTFT predictions",
            f"Command: `python -m loadgen.priority_overload{flag} --write-doc` (real Redis, gateway and one "
            "SGLang CPU worker with SmolLM2-135M-Instruct on this 2-core machine, wall-clock time; "
            f"{placement}). Capacity ({capacity_words(figures)}): {figures['capacity_rps']:.2f} req/s "
            f"(a closed loop of {args.concurrency} clients: {figures['closed_loop_capacity_rps']:.2f}); "
            "offered "
            f"{figures['offered_rps']:.2f} req/s for {args.duration_s:g} s; the worker served "
            f"{figures['served_rps']:.2f} req/s under that load, and interactive alone asked "
            f"{figures['interactive_share_of_served']:.0%} of that. Classes sized for the CPU "
            f"(TTFT goals 1.5 / 4 / 15 s); {calibration}{scale_words(figures)}. Run on "
            f"{time.strftime('%Y-%m-%d', time.gmtime())}; figures vary from run to run with the "
            "machine's load.",
            table(HEADER, rows),
            "Where the served requests' TTFT went, from the gateway's `request` log lines "
            "(`loadgen.latency_breakdown`): the gateway's queue (`queued_ms`), the engine (the rest of "
            "`ttft_ms`), and measured over predicted TTFT (`predicted_ttft_ms`, admission's prediction):",
            table(BREAKDOWN_HEADER, breakdown_rows(figures.get("breakdown", []))),
        ]
    )
    write_section(f"cpu-overload-{which}", body)


def breakdown_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """The breakdown's figures as table cells."""
    return [
        [
            b["class"],
            b["served"],
            f"{b['queued_p50_ms']:.0f} / {b['queued_p99_ms']:.0f}",
            f"{b['engine_p50_ms']:.0f} / {b['engine_p99_ms']:.0f}",
            f"{b['measured_over_predicted_p50']:.2f} / {b['measured_over_predicted_p90']:.2f}",
            f"{b['above_prediction']:.0%}",
        ]
        for b in rows
    ]


if __name__ == "__main__":
    main()
