"""PNG plots of a run (matplotlib ``Figure`` objects rendered by Agg: no pyplot state, no display).

- ``latency_cdf.png``: empirical CDFs of TTFT, TPOT and E2E (ms, log x) per priority class.
- ``timeline.png``: TTFT P50 per class and P99 overall (ms) by send time; sent / served / 429 / 503
  requests per second; completion tokens per second by end time.
- ``tenant_share.png``: per tenant, its share of the measured requests sent (offered), its share of the
  completion tokens served, and its goodput.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from loadgen.runner import RequestRecord


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    if not values:
        return
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def plot_latency_cdf(records: Sequence[RequestRecord], path: Path) -> None:
    """TTFT / TPOT / E2E CDFs per class of the measured, successful requests."""
    by_class: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        if r.ok and not r.warmup:
            by_class[r.priority_class].append(r)
    fig = Figure(figsize=(15, 4.5))
    axes = fig.subplots(1, 3)
    for cls, rs in sorted(by_class.items()):
        _cdf(axes[0], [r.ttft_ms for r in rs if r.ttft_ms is not None], cls)
        _cdf(axes[1], [t for r in rs if (t := r.tpot_ms) is not None], cls)
        _cdf(axes[2], [r.e2e_ms for r in rs if r.e2e_ms is not None], cls)
    for ax, name in zip(axes, ("TTFT", "TPOT", "E2E"), strict=True):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests ≤ x")
        ax.set_title(f"{name} CDF per class")
        if ax.has_data():
            ax.set_xscale("log")
            ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _series(values: Sequence[float | None]) -> list[float]:
    return [float("nan") if v is None else v for v in values]


def plot_timeline(report: Mapping[str, Any], path: Path) -> None:
    """Latency and throughput over time from the report's ``timeline``."""
    tl = report["timeline"]
    t = tl["t_s"]
    fig = Figure(figsize=(11, 9))
    axes = fig.subplots(3, 1, sharex=True)
    if t:
        for cls, values in tl["ttft_p50_ms_by_class"].items():
            axes[0].plot(t, _series(values), label=f"TTFT P50 {cls}")
        axes[0].plot(t, _series(tl["ttft_p99_ms"]), "k--", label="TTFT P99 all", linewidth=1)
        axes[0].plot(t, _series(tl["e2e_p50_ms"]), "k:", label="E2E P50 all", linewidth=1)
        axes[1].plot(t, tl["sent_rps"], label="sent")
        axes[1].plot(t, tl["ok_rps"], label="served")
        axes[1].plot(t, tl["status_429_rps"], label="429")
        axes[1].plot(t, tl["status_503_rps"], label="503 (shed)")
        axes[2].plot(t, tl["completion_tokens_per_s"], label="completion tokens/s")
    warmup = float(report.get("warmup_s") or 0)
    for ax in axes:
        if warmup:
            ax.axvspan(0, warmup, color="grey", alpha=0.15, label="warm-up")
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel("latency (ms)")
    if t and axes[0].has_data():
        axes[0].set_yscale("log")
    axes[1].set_ylabel("requests/s")
    axes[2].set_ylabel("tokens/s")
    axes[2].set_xlabel(f"time since start (s), bins of {tl['bin_s']:g} s")
    axes[0].set_title(f"{report['scenario']} → {report['base_url']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_tenant_share(report: Mapping[str, Any], path: Path) -> None:
    """Offered share, served share and goodput per tenant (bars)."""
    tenants = report["tenants"]
    names = list(tenants)
    fig = Figure(figsize=(max(6.0, 1.4 * len(names) + 2), 4.5))
    ax = fig.subplots()
    width = 0.27
    xs = range(len(names))
    for k, (key, label) in enumerate(
        (("offered_share", "share of requests sent"), ("served_share", "share of tokens served"),
         ("goodput", "goodput (met SLO)"))
    ):  # fmt: skip
        values = [tenants[n][key] or 0.0 for n in names]
        ax.bar([x + (k - 1) * width for x in xs], values, width, label=label)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{n}\n({tenants[n].get('priority_class') or '?'})" for n in names], fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("share")
    ax.set_title("per-tenant share")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_plots(report: Mapping[str, Any], records: Sequence[RequestRecord], out_dir: Path) -> list[Path]:
    """All three PNGs into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "latency_cdf.png", out_dir / "timeline.png", out_dir / "tenant_share.png"]
    plot_latency_cdf(records, paths[0])
    plot_timeline(report, paths[1])
    plot_tenant_share(report, paths[2])
    return paths
