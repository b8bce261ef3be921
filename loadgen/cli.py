"""``python -m loadgen``: plan, run and report load scenarios against any OpenAI-compatible endpoint.

Commands:
  plan SCENARIO                      validate a scenario and summarize its plan (no network)
  tenants SCENARIO --admin-token T   create the scenario's tenants on a radixgate gateway; write their keys
  run SCENARIO [--base-url URL]      send the plan open-loop; write results.json, report.json and PNG plots
  report RESULTS.json                recompute the report (table, JSON, plots) from a results file
  bench-gateway [--quick] [--json]   radixgate vs sglang-router, LiteLLM and direct on an instant fake SGLang
  bench-route-sync [--json]          the CPU a replica spends on the other replicas' routes
  rolling-restart [--json]           gateway processes and workers restarted under load
  soak [--duration S] [--json]       minutes past capacity, a worker killed and Redis restarted on a schedule
  breakdown-share [--json]           the share of each request's TTFT its named phases explain, under load
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadgen.bench.command import bench_gateway
from loadgen.bench.route_sync import bench_route_sync
from loadgen.plots import write_plots
from loadgen.report import build_report, print_report
from loadgen.runner import (
    MissingKeyError,
    RequestRecord,
    ResultsError,
    load_results,
    resolve_keys,
    run_plan,
    save_results,
)
from loadgen.scenario import Scenario, ScenarioError, generate_requests, load_scenario, parse_scenario

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Plan, run and report load scenarios against any OpenAI-compatible endpoint.",
    # click's plain help: rich's table cut long option names at 80 columns (--worker-drain-deadli…)
    rich_markup_mode=None,
)

app.command("bench-gateway")(bench_gateway)
app.command("bench-route-sync")(bench_route_sync)

ScenarioArg = Annotated[Path, typer.Argument(help="Scenario file (.yaml, .yml, .toml or .json).")]


def _read_keys(path: Path, console: Console) -> dict[str, str]:
    """The ``{tenant: key}`` JSON that ``loadgen tenants`` writes; exit 2 with the reason when it is not."""
    try:
        keys = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        console.print(f"[red]{path}: cannot read the keys file: {err}[/]")
        raise typer.Exit(2) from err
    if not isinstance(keys, dict) or not all(isinstance(v, str) for v in keys.values()):
        console.print(f'[red]{path}: a keys file is a JSON object {{"tenant": "key", ...}}[/]')
        raise typer.Exit(2)
    return keys


def _load(path: Path, console: Console) -> Scenario:
    try:
        return load_scenario(path)
    except ScenarioError as err:
        console.print(f"[red]{err}[/]")
        raise typer.Exit(2) from err


@app.command()
def plan(scenario_file: ScenarioArg) -> None:
    """Validate a scenario and summarize its request plan (counts, rates, shares, lengths)."""
    console = Console()
    scenario = _load(scenario_file, console)
    reqs = generate_requests(scenario)
    console.print(f"[bold]{scenario.name}[/]: {len(reqs)} requests in {scenario.duration_s:g} s")
    if not reqs:
        return
    measured = [r for r in reqs if not r.warmup]
    console.print(
        f"  offered {len(reqs) / scenario.duration_s:.2f} req/s; measured {len(measured)} after "
        f"{scenario.warmup_s:g} s warm-up; streamed {sum(r.stream for r in reqs) / len(reqs):.0%}"
    )
    tenants = Counter(r.tenant for r in reqs)
    for t in scenario.tenants:
        console.print(
            f"  {t.id:<20} {t.priority_class:<12} {tenants[t.id]:>6} ({tenants[t.id] / len(reqs):.1%})"
        )
    words = [r.prompt_words for r in reqs]
    outs = [r.max_tokens for r in reqs]
    console.print(
        f"  prompt words: mean {statistics.fmean(words):.0f}, max {max(words)}; max_tokens: mean "
        f"{statistics.fmean(outs):.0f}, max {max(outs)}; sessions {len({r.session_id for r in reqs})}, "
        f"system prompts {len({r.system_prompt_id for r in reqs} - {None})}"
    )


@app.command()
def tenants(
    scenario_file: ScenarioArg,
    base_url: Annotated[
        str | None, typer.Option(help="Gateway URL (default: the scenario's target).")
    ] = None,
    admin_token: Annotated[
        str | None, typer.Option(envvar="RADIXGATE_ADMIN_TOKEN", help="Admin token.")
    ] = None,
    keys_out: Annotated[Path, typer.Option(help="Where to write {tenant: key} (JSON).")] = Path("keys.json"),
) -> None:
    """Create (or update) the scenario's tenants on a radixgate gateway and issue one key each."""
    console = Console()
    scenario = _load(scenario_file, console)
    if not admin_token:
        console.print("[red]--admin-token (or RADIXGATE_ADMIN_TOKEN) is required[/]")
        raise typer.Exit(2)
    url = (base_url or scenario.target.base_url).rstrip("/")
    try:
        keys = create_tenants(scenario, url, admin_token)
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as err:
        console.print(f"[red]{url}: not an http(s) URL ({err})[/]")
        raise typer.Exit(2) from err
    except httpx.HTTPStatusError as err:
        console.print(f"[red]{err.request.method} {err.request.url}: {_gateway_error(err.response)}[/]")
        raise typer.Exit(1) from err
    except httpx.TransportError as err:
        console.print(f"[red]cannot reach {url}: {err!r}[/]")
        raise typer.Exit(1) from err
    keys_out.write_text(json.dumps(keys, indent=2))
    keys_out.chmod(0o600)
    console.print(f"{len(keys)} tenants ready on {url}; keys in {keys_out}")


def _gateway_error(resp: httpx.Response) -> str:
    """``"<status> <reason>: <message>"`` of an error answer (OpenAI's error shape, else 200 chars)."""
    try:
        message = str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = resp.text[:200]
    return f"{resp.status_code} {resp.reason_phrase}: {message}"


def create_tenants(scenario: Scenario, base_url: str, admin_token: str) -> dict[str, str]:
    """Create or update each tenant (``POST``/``PATCH /admin/tenants``) and issue a key; returns the keys.

    Raises ``httpx.HTTPStatusError`` on an error answer, ``httpx.TransportError`` when the gateway cannot
    be reached, ``httpx.UnsupportedProtocol``/``httpx.InvalidURL`` for a base URL that is not http(s).
    """
    keys: dict[str, str] = {}
    headers = {"Authorization": f"Bearer {admin_token}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as http:
        for t in scenario.tenants:
            spec: dict[str, Any] = {"name": t.id, "priority_class": t.priority_class, "weight": t.weight}
            if t.quotas is not None:
                spec["quotas"] = t.quotas
            if t.max_tokens_cap is not None:
                spec["max_tokens_cap"] = t.max_tokens_cap
            resp = http.post("/admin/tenants", json={"id": t.id, **spec})
            if resp.status_code == 409:
                resp = http.patch(f"/admin/tenants/{t.id}", json=spec)
            resp.raise_for_status()
            issued = http.post(f"/admin/tenants/{t.id}/keys", json={"name": f"loadgen-{scenario.name}"})
            issued.raise_for_status()
            keys[t.id] = str(issued.json()["api_key"])
    return keys


def _finish(
    scenario: Scenario, records: list[RequestRecord], run: dict[str, Any], out: Path, plots: bool
) -> dict[str, Any]:
    console = Console()
    report = build_report(scenario, records, run)
    print_report(report, console)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    written = [out / "report.json"]
    if plots:
        written += write_plots(report, records, out)
    console.print("wrote " + ", ".join(str(p) for p in written))
    return report


@app.command()
def run(
    scenario_file: ScenarioArg,
    base_url: Annotated[str | None, typer.Option(help="Endpoint (default: the scenario's target).")] = None,
    model: Annotated[str | None, typer.Option(help="Model name (default: the scenario's).")] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder (default .run/loadgen/NAME-TIME).")] = None,
    keys: Annotated[Path | None, typer.Option(help="JSON {tenant: key} from `loadgen tenants`.")] = None,
    api_key: Annotated[
        str | None, typer.Option(help="Key for tenants without one (e.g. a bare worker).")
    ] = None,
    plots: Annotated[bool, typer.Option(help="Write PNG plots.")] = True,
    drain_timeout_s: Annotated[float | None, typer.Option(help="Wait after the last arrival, s.")] = None,
) -> None:
    """Send the scenario open-loop, then print the report and write results.json, report.json and plots.

    Exit status 3 when no request got an HTTP answer (a wrong URL, the endpoint down).
    """
    console = Console()
    scenario = _load(scenario_file, console)
    if model:
        scenario = scenario.model_copy(update={"target": scenario.target.model_copy(update={"model": model})})
    try:
        key_map = resolve_keys(scenario, _read_keys(keys, console) if keys else None, api_key)
    except MissingKeyError as err:
        console.print(f"[red]{err}[/]")
        raise typer.Exit(2) from err
    if drain_timeout_s is not None and not drain_timeout_s >= 0:  # NaN too
        console.print(f"[red]--drain-timeout-s must be 0 or more (got {drain_timeout_s:g})[/]")
        raise typer.Exit(2)
    out = out or Path(".run/loadgen") / f"{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:  # found out now, not after the run (whose results would be lost)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        console.print(f"[red]--out {out}: cannot write there: {err}[/]")
        raise typer.Exit(2) from err
    reqs = generate_requests(scenario)
    url = base_url or scenario.target.base_url
    console.print(f"{scenario.name}: {len(reqs)} requests over {scenario.duration_s:g} s → {url}")
    counts: Counter[str] = Counter()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
        refresh_per_second=4,
    ) as progress:
        task = progress.add_task("requests", total=len(reqs), status="")

        def done(rec: RequestRecord) -> None:
            counts["ok" if rec.ok else str(rec.status) if rec.status else "err"] += 1
            progress.update(task, advance=1, status=" ".join(f"{k}={v}" for k, v in sorted(counts.items())))

        try:
            result = asyncio.run(run_plan(scenario, reqs, key_map, url, done, drain_timeout_s))
        except KeyboardInterrupt:
            progress.stop()
            console.print(
                f"[yellow]interrupted after {counts.total()} of {len(reqs)} answers: the run stopped, "
                f"no results written to {out}[/]"
            )
            raise typer.Exit(130) from None
    save_results(out / "results.json", scenario, result)
    _finish(scenario, result.records, result.to_json(scenario)["run"], out, plots)
    if result.records and all(r.status == 0 for r in result.records):
        first = next((r.error for r in result.records if r.error), "no answer")
        console.print(f"[red]no request reached {url} (status 0 for all; first error: {first})[/]")
        raise typer.Exit(3)


@app.command()
def report(
    results: Annotated[Path, typer.Argument(help="results.json written by `loadgen run`.")],
    out: Annotated[Path | None, typer.Option(help="Output folder (default: the results' folder).")] = None,
    plots: Annotated[bool, typer.Option(help="Write PNG plots.")] = True,
) -> None:
    """Recompute the report (table, report.json, plots) from a results file."""
    console = Console()
    try:
        scenario_data, run_data, records = load_results(results)
        scenario = parse_scenario(scenario_data, str(results))
    except (ResultsError, ScenarioError) as err:
        console.print(f"[red]{err}[/]")
        raise typer.Exit(2) from err
    _finish(scenario, records, run_data, out or results.parent, plots)


@app.command("rolling-restart")
def rolling_restart(
    streams: Annotated[int, typer.Option(min=1, max=100_000, help="Streams to send.")] = 1200,
    load: Annotated[
        float, typer.Option(min=0.05, max=2.0, help="Arrival rate as a fraction of the measured capacity.")
    ] = 0.8,
    max_tokens: Annotated[int, typer.Option(min=1, max=256, help="Tokens per stream.")] = 16,
    worker_drain_deadline: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=60.0,
            help="The gateway's upstream.worker_drain_deadline_s, s: the streams a drained worker still "
            "runs then resume on another worker.",
        ),
    ] = 0.05,
    run_dir: Annotated[Path, typer.Option(help="Folder for the logs.")] = Path(".run/rolling-restart"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as one JSON line.")] = False,
) -> None:
    """Restart every gateway process and every simulated worker, one at a time, under a steady stream
    load (loadgen/rolling_restart.py); exit 1 when a client saw an error, the ledger does not balance or
    a restart began after the load had ended (too few --streams to cover the restarts)."""
    from loadgen.rolling_restart import figures_json, run_rolling_restart

    figures = run_rolling_restart(
        run_dir,
        streams=streams,
        load=load,
        max_tokens=max_tokens,
        worker_drain_deadline_s=worker_drain_deadline,
    )
    out = figures_json(figures)
    if as_json:
        print(json.dumps(out))
    else:
        console = Console()
        for name, value in out.items():
            console.print(f"{name:>18}: {len(value) if name == 'errors' else value}")
        for line in figures.errors[:20]:
            console.print(f"  error: {line}")
    if figures.restarts_after_load:
        typer.echo(
            f"{figures.restarts_after_load} of the restarts began after the load had ended "
            f"({figures.streams} streams in {figures.duration_s:.1f} s): no stream saw them; raise --streams",
            err=True,
        )
    if figures.errors or not figures.balanced or figures.restarts_after_load:
        raise typer.Exit(1)


@app.command("soak")
def soak(
    duration_s: Annotated[
        float, typer.Option("--duration", min=10.0, max=86_400.0, help="How long streams arrive, s.")
    ] = 600.0,
    load: Annotated[
        float, typer.Option(min=0.1, max=10.0, help="Arrival rate as a multiple of the measured capacity.")
    ] = 2.0,
    kill_every_s: Annotated[
        float, typer.Option("--kill-every", min=1.0, max=86_400.0, help="A worker is killed this often, s.")
    ] = 120.0,
    redis_every_s: Annotated[
        float, typer.Option("--redis-every", min=1.0, max=86_400.0, help="Redis is restarted this often, s.")
    ] = 180.0,
    redis_down_s: Annotated[
        float, typer.Option("--redis-down", min=0.5, max=3_600.0, help="How long Redis stays stopped, s.")
    ] = 5.0,
    on_outage: Annotated[
        str,
        typer.Option("--on-outage", help="The gateways' redis.on_outage while Redis is down: closed|open."),
    ] = "closed",
    run_dir: Annotated[Path, typer.Option(help="Folder for the logs and Redis files.")] = Path(".run/soak"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as one JSON line.")] = False,
) -> None:
    """Streams past capacity for minutes, with a worker killed and Redis restarted on a schedule
    (loadgen/soak.py); exit 1 when a request was not answered (whole, or a clean 429/503), a tenant's
    ledger does not balance, or a gateway process's memory grew by more than 1 MB/min over the run's
    second half."""
    from loadgen.soak import figures_json, figures_text, run_soak

    if on_outage not in ("closed", "open"):
        raise typer.BadParameter("closed or open", param_hint="--on-outage")
    figures = run_soak(
        run_dir,
        duration_s=duration_s,
        load=load,
        kill_every_s=kill_every_s,
        redis_every_s=redis_every_s,
        redis_down_s=redis_down_s,
        on_outage=on_outage,
    )
    print(json.dumps(figures_json(figures)) if as_json else figures_text(figures))
    if not figures.met:
        raise typer.Exit(1)


@app.command("breakdown-share")
def breakdown_share(
    load: Annotated[
        float, typer.Option(min=0.05, max=1.5, help="Arrival rate as a fraction of the measured capacity.")
    ] = 0.8,
    duration_s: Annotated[float, typer.Option(min=2.0, max=600.0, help="How long arrivals run, s.")] = 25.0,
    workers: Annotated[int, typer.Option(min=1, max=16, help="Simulated workers.")] = 2,
    window: Annotated[int, typer.Option(min=1, max=64, help="Requests admitted to each worker at once.")] = 8,
    max_tokens: Annotated[int, typer.Option(min=1, max=256, help="Tokens per stream.")] = 16,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the arrivals and questions.")] = 0,
    run_dir: Annotated[Path, typer.Option(help="Folder for the logs.")] = Path(".run/breakdown-share"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as one JSON line.")] = False,
) -> None:
    """Run a gateway in front of simulated workers at LOAD x its capacity and say how much of each
    stream's TTFT the named phases of its request log line explain (loadgen/breakdown_share.py); exit 1
    when P50 < 0.95 or P99 < 0.90, or a client saw an error."""
    from loadgen.breakdown_share import GOAL_P50, GOAL_P99, run_breakdown_share

    run = run_breakdown_share(run_dir, load, duration_s, workers, window, max_tokens, seed)
    s = run.summary
    if as_json:
        print(json.dumps(run.to_json()))
    else:
        console = Console()
        console.print(
            f"capacity {run.capacity_rps:.2f} streams/s; offered {run.rate_rps:.2f}/s ({run.load:.0%}) for "
            f"{run.duration_s:.1f} s: {run.sent} sent, {run.ok} complete, {s.requests} request lines"
        )
        console.print(
            f"TTFT P50 {s.ttft_p50_ms:.1f} ms, P99 {s.ttft_p99_ms:.1f} ms; named phases explain "
            f"P50 {s.share_p50:.3f} (goal {GOAL_P50}), P99 {s.share_p99:.3f} (goal {GOAL_P99}), "
            f"min {s.share_min:.3f}; at the P99 TTFT {s.tail_share_p50:.3f}"
        )
        console.print(
            f"outside the gateway's queue: P50 {s.beyond_queue_p50:.3f}, P99 {s.beyond_queue_p99:.3f}"
        )
        console.print(f"unexplained P50 {s.unexplained_p50_ms:.2f} ms, P99 {s.unexplained_p99_ms:.2f} ms")
        for name, ms in s.phase_mean_ms.items():
            console.print(f"  {name:>17}: {ms:9.3f} ms mean")
        for line in run.errors:
            console.print(f"  error: {line}")
    if run.errors or not s.meets_goal:
        raise typer.Exit(1)


def main() -> None:
    """Entry point of ``python -m loadgen``."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    app()
