"""``python -m loadgen bench-gateway``: the command-line face of :mod:`loadgen.bench.runner`."""

from __future__ import annotations

import json
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from loadgen.bench.report import json_lines, plot_report, print_report
from loadgen.bench.runner import MODES, BenchConfig, check_targets, run_bench
from loadgen.bench.targets import BASELINE, TARGETS, BenchSetupError, default_peers_dir
from loadgen.bench.wrk import WrkError, wrk_binary


class UpstreamStreaming(StrEnum):
    """How the fake upstream's ``/generate`` streams (``--upstream-streaming``)."""

    incremental = "incremental"
    cumulative = "cumulative"


def _split(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = list(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))  # each once, in order
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise typer.BadParameter(f"{what}: choose from {', '.join(allowed)} (got {value!r})")
    return names


def _env_pairs(pairs: list[str], option: str = "--radixgate-env") -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.startswith("RADIXGATE_"):
            raise typer.BadParameter(f"{option} wants RADIXGATE_NAME=VALUE (got {pair!r})")
        env[key] = value
    return env


def bench_gateway(
    targets: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated targets (default: every installed one of radixgate,router,litellm,direct)."
        ),
    ] = None,
    modes: Annotated[
        str, typer.Option(help="Comma-separated modes: c64,c8,c1 (non-streamed), stream.")
    ] = ",".join(MODES),
    repeats: Annotated[int, typer.Option(min=1, help="Interleaved repeats (medians are reported).")] = 3,
    duration_s: Annotated[int, typer.Option(min=1, help="Seconds of each measured run.")] = 10,
    warmup_s: Annotated[
        int, typer.Option(min=0, help="Unmeasured lead-in of each run, s (0: none, and no warm-up runs).")
    ] = 1,
    idle_s: Annotated[float, typer.Option(min=0, help="Window for idle CPU, s (0: skip).")] = 10.0,
    chunks: Annotated[int, typer.Option(min=1, help="Tokens per answer = SSE chunks of a stream.")] = 32,
    quick: Annotated[
        bool, typer.Option("--quick", help="One short repeat: 1 repeat, 3 s windows, 1 s lead-ins, 3 s idle.")
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", help="Print one JSON object per target and mode on stdout (tables go to stderr)."
        ),
    ] = False,
    out: Annotated[Path | None, typer.Option(help="Output folder (default .run/bench/gateway-TIME).")] = None,
    peers_dir: Annotated[
        Path | None,
        typer.Option(
            help="Virtualenvs of the peers (scripts/peers/setup.sh; default: $RADIXGATE_HOME/peers)"
        ),
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="Tokenizer folder for radixgate (default: the engine's model, else a stub)."),
    ] = None,
    radixgate_env: Annotated[
        list[str] | None, typer.Option(help="Extra RADIXGATE_NAME=VALUE setting for radixgate (repeatable).")
    ] = None,
    baseline_env: Annotated[
        list[str] | None,
        typer.Option(
            help="Also run radixgate-base: a second radixgate with these RADIXGATE_NAME=VALUE settings on "
            "top (repeatable), interleaved with the others: before/after figures of a change in one run."
        ),
    ] = None,
    tenant_cap: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=1_000_000,
            help="max_concurrent_requests of radixgate's bench tenant (not radixgate-base's): what a "
            "concurrency cap costs (one slot call per request and its release).",
        ),
    ] = None,
    profile_s: Annotated[
        int,
        typer.Option(min=0, help="py-spy radixgate under --profile-mode for this many seconds after runs."),
    ] = 0,
    profile_mode: Annotated[str, typer.Option(help="The mode profiled: c64, c8, c1 or stream.")] = "c64",
    pin: Annotated[
        bool, typer.Option(help="Pin the target alone on one CPU, load and upstream on another.")
    ] = True,
    png: Annotated[bool, typer.Option(help="Write bench.png.")] = True,
    upstream_streaming: Annotated[
        UpstreamStreaming,
        typer.Option(
            help="How the fake upstream's /generate streams: incremental (deltas, as workers run with "
            "--incremental-streaming-output: the gateway's launched ones and the README's command) or "
            "cumulative (SGLang's default)."
        ),
    ] = UpstreamStreaming.incremental,
) -> None:
    """Benchmark radixgate against sglang-router, LiteLLM and a direct call on an instant fake SGLang.

    Prints CPU ms per request (from /proc), req/s on one core, latency added over `direct`, Redis commands
    per request and streaming cost per chunk; writes bench.json and bench.png. Exit 3 when a run had errors.
    """
    console = Console(stderr=as_json)
    if not console.is_terminal:
        console.width = max(console.width, 200)
    if quick:
        repeats, duration_s, warmup_s, idle_s = 1, 3, 1, 3.0
    try:
        names = _split(targets, TARGETS, "--targets") if targets is not None else None
        mode_names = _split(modes, tuple(MODES), "--modes")
        if profile_mode not in MODES:
            raise typer.BadParameter(f"--profile-mode: choose from {', '.join(MODES)} (got {profile_mode!r})")
        extra_env = _env_pairs(radixgate_env or [])
        base_env = _env_pairs(baseline_env, "--baseline-env") if baseline_env else None
    except typer.BadParameter as err:
        console.print(f"[red]{err}[/]")
        raise typer.Exit(2) from err
    if wrk_binary() is None:
        console.print("[red]wrk is not installed: run scripts/peers/setup.sh (or apt-get install wrk)[/]")
        raise typer.Exit(2)
    peers_dir = peers_dir or default_peers_dir()  # read when it runs, not at import
    missing = check_targets(names or list(TARGETS), peers_dir)
    if names is None:
        names = [t for t in TARGETS if t not in missing]
        for name in missing:
            console.print(
                f"[yellow]{name} is not installed in {peers_dir}: skipped (scripts/peers/setup.sh)[/]"
            )
    elif missing:
        console.print(
            f"[red]not installed in {peers_dir}: {', '.join(missing)}; run scripts/peers/setup.sh[/]"
        )
        raise typer.Exit(2)
    if base_env is not None and "radixgate" in names:
        names.insert(names.index("radixgate") + 1, BASELINE)
    out = out or Path(".run/bench") / f"gateway-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = BenchConfig(
        targets=names,
        modes=mode_names,
        out=out,
        repeats=repeats,
        duration_s=duration_s,
        warmup_s=warmup_s,
        idle_s=idle_s,
        chunks=chunks,
        peers_dir=peers_dir,
        tokenizer=tokenizer,
        radixgate_env=extra_env,
        baseline_env=base_env,
        tenant_cap=tenant_cap,
        profile_s=profile_s,
        profile_mode=profile_mode,
        pin=pin,
        upstream_streaming=(
            "cumulative" if upstream_streaming is UpstreamStreaming.cumulative else "incremental"
        ),
    )
    try:
        report = run_bench(cfg, lambda line: console.print(line, highlight=False))
    except (BenchSetupError, WrkError) as err:
        console.print(f"[red]{err}[/]")
        raise typer.Exit(1) from err
    except KeyboardInterrupt:  # run_bench stopped every process it started on the way out
        console.print(
            f"[yellow]interrupted: the targets, Redis and the fake upstream were stopped; no report ({out})"
        )
        raise typer.Exit(130) from None
    print_report(report, console)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    written = [out / "bench.json"]
    if png:
        plot_report(report, out / "bench.png")
        written.append(out / "bench.png")
    console.print("wrote " + ", ".join(str(p) for p in written))
    if as_json:
        for line in json_lines(report["results"]):
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
    errors = sum(r["errors"] for r in report["results"])
    if errors:
        console.print(f"[red]{errors} requests failed (error_kinds in bench.json; logs) in {out}[/]")
        raise typer.Exit(3)
