"""Presentation of a gateway benchmark: rich tables (the issue's headline table, every target × mode,
the goals, the profile), JSON lines for ``--json``, and a PNG (matplotlib ``Figure``, Agg, no pyplot)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from loadgen.bench.targets import TARGETS

JSON_KEYS = (
    "target",
    "mode",
    "rps",
    "cpu_ms_per_request",
    "added_p50_ms",
    "added_p99_ms",
    "p50_ms",
    "p99_ms",
    "cpu_ms_per_chunk",
    "redis_commands_per_request",
    "redis_cpu_ms_per_request",
    "upstream_cpu_ms_per_request",
    "upstream_requests_per_request",
    "upstream_connections_per_request",
    "idle_cpu_ms_per_s",
    "target_cores_used",
    "others_on_target_core",
    "errors",
    "requests",
    "repeats",
    "rps_range",
    "cpu_ms_per_request_range",
    "redis_commands",
)


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, list):
        return [_round(v) for v in value]
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    return value


def json_lines(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """One compact JSON object per target and mode (``--json``), keys in :data:`JSON_KEYS` order."""
    return [json.dumps({k: _round(r.get(k)) for k in JSON_KEYS}, ensure_ascii=False) for r in results]


def _f(value: float | None, digits: int = 2, plus: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:+,.{digits}f}" if plus else f"{value:,.{digits}f}"


def _by_key(results: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], Mapping[str, Any]]:
    return {(r["target"], r["mode"]): r for r in results}


def _ordered_targets(results: Sequence[Mapping[str, Any]]) -> list[str]:
    present = {r["target"] for r in results}
    return [t for t in TARGETS if t in present]


def headline_table(report: Mapping[str, Any]) -> Table:
    """Issue 10's table: CPU per request and req/s at 64 connections, unloaded added latency (c1),
    streaming cost, idle CPU and Redis commands per request."""
    results = report["results"]
    by = _by_key(results)
    chunks = report["config"]["chunks"]
    table = Table(title="gateway benchmark (medians over repeats; target pinned to one core)")
    for col in (
        "target",
        "CPU ms/request (c64)",
        "req/s per core-second (1000 / CPU ms)",
        "req/s on one core (64 conns)",
        "unloaded added latency P50 / P99 (c1)",
        f"stream ({chunks} chunks) CPU ms/request",
        "CPU ms/chunk",
        "idle CPU ms/s",
        "Redis cmds/request",
    ):
        table.add_column(col, justify="right" if col != "target" else "left")
    for t in _ordered_targets(results):
        c64, c1, st = by.get((t, "c64"), {}), by.get((t, "c1"), {}), by.get((t, "stream"), {})
        cpu_range = c64.get("cpu_ms_per_request_range")
        rps_range = c64.get("rps_range")
        cpu = _f(c64.get("cpu_ms_per_request"), 3)
        rps = _f(c64.get("rps"), 0)
        if cpu_range and len(report["samples"]) > 1 and cpu_range[0] != cpu_range[1]:
            cpu += f" ({cpu_range[0]:.3f}-{cpu_range[1]:.3f})"
        if rps_range and rps_range[0] != rps_range[1]:
            rps += f" ({rps_range[0]:,.0f}-{rps_range[1]:,.0f})"
        added = f"{_f(c1.get('added_p50_ms'), 2, True)} / {_f(c1.get('added_p99_ms'), 2, True)} ms"
        idle = (report.get("idle_cpu_ms_per_s") or {}).get(t)
        redis_cmds = c64.get("redis_commands_per_request") if t.startswith("radixgate") else None
        per_core = 1000.0 / c64["cpu_ms_per_request"] if c64.get("cpu_ms_per_request") else None
        table.add_row(
            t,
            cpu,
            _f(per_core, 0),
            rps,
            added if c1 else "—",
            _f(st.get("cpu_ms_per_request"), 3),
            _f(st.get("cpu_ms_per_chunk"), 4),
            _f(idle, 2),
            _f(redis_cmds, 2),
        )
    return table


def detail_table(results: Sequence[Mapping[str, Any]]) -> Table:
    """Every target × mode with latency, Redis and upstream figures."""
    table = Table(title="per target and mode")
    cols = (
        "target",
        "mode",
        "req/s",
        "CPU ms/req",
        "P50 ms",
        "P99 ms",
        "added P50/P99 ms",
        "Redis cmds/req",
        "Redis CPU ms/req",
        "upstream CPU ms/req",
        "upstream calls/req",
        "upstream conns/req",
        "target cores used",
        "others on its core",
        "errors",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("target", "mode") else "right")
    for r in results:
        radix = r["target"].startswith("radixgate")
        table.add_row(
            r["target"],
            r["mode"],
            _f(r["rps"], 1),
            _f(r["cpu_ms_per_request"], 3),
            _f(r["p50_ms"], 2),
            _f(r["p99_ms"], 2),
            f"{_f(r['added_p50_ms'], 2, True)} / {_f(r['added_p99_ms'], 2, True)}",
            _f(r["redis_commands_per_request"], 2) if radix else "—",
            _f(r["redis_cpu_ms_per_request"], 3) if radix else "—",
            _f(r["upstream_cpu_ms_per_request"], 3),
            _f(r["upstream_requests_per_request"], 2),
            _f(r["upstream_connections_per_request"], 3),
            _f(r["target_cores_used"], 2),
            f"{r['others_on_target_core']:.0%}" if r["others_on_target_core"] is not None else "—",
            str(r["errors"]) if not r["errors"] else f"[red]{r['errors']}[/]",
        )
    return table


def goals_table(report: Mapping[str, Any]) -> Table:
    """Issue 10's goals for radixgate with the measured value."""
    table = Table(title="issue 10 goals (radixgate)")
    for col in ("goal", "measured", "bound", "met"):
        table.add_column(col, justify="left" if col == "goal" else "right")
    for g in report["goals"]:
        met = {True: "[green]yes[/]", False: "[red]no[/]", None: "—"}[g["met"]]
        table.add_row(g["description"], _f(g["value"], 3), _f(g["bound"], 2), met)
    return table


def profile_tables(profile: Mapping[str, Any]) -> list[Table]:
    """Shares of CPU samples (and ms per request) by library and by radixgate function."""
    if "error" in profile:
        return []
    cpu = profile.get("cpu_ms_per_request")
    tables = []
    for key, title in (
        ("inclusive_by_stage", "radixgate CPU by request stage (inclusive; stages overlap)"),
        ("inclusive_by_library", "radixgate CPU by library (inclusive: on the stack)"),
        ("self_by_library", "radixgate CPU by library (self: leaf frame)"),
        ("inclusive_own", "radixgate functions (inclusive)"),
        ("self_functions", "hottest leaf functions (self)"),
    ):
        table = Table(title=f"{title}; {profile.get('samples', 0)} samples, {_f(cpu, 3)} CPU ms/request")
        table.add_column("name")
        table.add_column("share", justify="right")
        table.add_column("ms/request", justify="right")
        for row in profile.get(key, []):
            table.add_row(row["name"], f"{row['share']:.1%}", _f(cpu * row["share"], 3) if cpu else "—")
        tables.append(table)
    return tables


def redis_breakdown(results: Sequence[Mapping[str, Any]], mode: str = "c64") -> str | None:
    """radixgate's Redis commands per request by name (INFO commandstats also counts the commands a Lua
    script runs, so EVALSHA's inner calls appear beside it)."""
    r = _by_key(results).get(("radixgate", mode))
    if not r or not r.get("redis_commands"):
        return None
    parts = ", ".join(f"{k} {v:.2f}" for k, v in r["redis_commands"].items())
    return f"radixgate Redis commands per request ({mode}; script-internal ones included): {parts}"


def print_report(report: Mapping[str, Any], console: Console) -> None:
    """All tables of a report."""
    console.print(headline_table(report))
    if line := redis_breakdown(report["results"]):
        console.print(line)
    console.print(detail_table(report["results"]))
    console.print(goals_table(report))
    if report.get("profile"):
        for table in profile_tables(report["profile"]):
            console.print(table)


def plot_report(report: Mapping[str, Any], path: Path) -> None:
    """req/s, CPU ms/request and added latency P50/P99 per mode, one bar per target."""
    results = report["results"]
    by = _by_key(results)
    targets = _ordered_targets(results)
    modes = list(report["config"]["modes"])
    fig = Figure(figsize=(16, 4.8))
    axes = fig.subplots(1, 3)
    width = 0.8 / max(1, len(targets))
    for i, t in enumerate(targets):
        xs = [m + (i - (len(targets) - 1) / 2) * width for m in range(len(modes))]
        for ax, key in zip(axes[:2], ("rps", "cpu_ms_per_request"), strict=True):
            ys = [by.get((t, m), {}).get(key) or 0.0 for m in modes]
            ax.bar(xs, ys, width, label=t)
        if t != "direct":
            # negative or missing differences (noise around zero) are drawn at the axis floor, 0.01 ms
            p50 = [max(0.01, by.get((t, m), {}).get("added_p50_ms") or 0.0) for m in modes]
            p99 = [max(0.01, by.get((t, m), {}).get("added_p99_ms") or 0.0) for m in modes]
            bars = axes[2].bar(xs, p99, width, alpha=0.35)
            axes[2].bar(xs, p50, width, color=bars.patches[0].get_facecolor()[:3], label=t)
    titles = ("req/s (target on one core)", "target CPU ms per request", "added latency vs direct, ms")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks(range(len(modes)), modes)
        ax.set_title(title)
        ax.set_yscale("log")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    axes[2].set_xlabel("solid: P50; light: P99")
    axes[2].set_ylim(bottom=0.01)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
