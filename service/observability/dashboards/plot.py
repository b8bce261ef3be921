"""Every dashboard's panels as PNG images, from a Prometheus: what Grafana would draw, with matplotlib.

``python -m service.observability.dashboards.plot --prometheus URL --start T --end T [--out DIR]`` runs each
panel's queries (read from the committed JSON of ``deploy/grafana/``, made concrete by
:func:`.queries.concrete`) over ``[start, end]`` with ``/api/v1/query_range`` (an instant panel: one
``/api/v1/query`` at ``end``) and draws one image per dashboard, ``DIR/ops-<name>.png`` (``radixgate-service``
-> ``ops-service.png``): a grid of its panels in order, a time series per target and series (legend from the
target's ``legendFormat``), bars for an instant panel, the panels that got no data listed at the bottom.

Times are ``time.time()`` seconds (or RFC 3339). ``--scale`` shrinks Grafana's built-in ranges for a
Prometheus whose rules run faster than real time (the live test's 1/60: ``$__rate_interval`` 5 m -> 5 s);
``--mark name=seconds`` draws a labelled vertical line that many seconds after ``start``.

The drawing (:func:`draw`) is a pure function of the query results (Prometheus API ``data`` objects), so it
is tested without a server. Rendered by matplotlib's Agg ``Figure`` (no pyplot state, no display).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from matplotlib.figure import Figure

from service.observability.dashboards.queries import concrete, panels

Fetch = Callable[[str, bool], dict[str, Any]]
"""``(expr, instant) -> the data object of Prometheus's answer`` (``{"resultType", "result"}``)."""

_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
"""Grafana's legend placeholders: ``{{label}}``."""

UNITS = {
    "s": ("seconds", 1.0),
    "percentunit": ("share", 1.0),
    "reqps": ("requests/s", 1.0),
    "Bps": ("bytes/s", 1.0),
    "mbytes": ("MiB", 1.0),
    "short": ("", 1.0),
}
"""Grafana unit -> (axis label, multiplier). ``suffix: X`` units label the axis ``X``."""


@dataclass(frozen=True, slots=True)
class Line:
    """One series of one target: its legend and its points (seconds after the plot's start, value)."""

    legend: str
    times: tuple[float, ...]
    values: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class PanelData:
    """A panel's title, unit, kind (``range`` or ``instant``) and every series its targets returned."""

    title: str
    unit: str
    instant: bool
    lines: tuple[Line, ...]


def legend(fmt: str, metric: Mapping[str, str]) -> str:
    """The legend Grafana shows for ``metric`` (a series' labels) with ``legendFormat`` ``fmt``: each
    ``{{label}}`` replaced by its value (empty if absent); no format: the labels, ``{a="b", ...}``."""
    if fmt:
        return _LEGEND.sub(lambda m: metric.get(m.group(1), ""), fmt).strip()
    labels = ", ".join(f'{k}="{v}"' for k, v in sorted(metric.items()) if k != "__name__")
    return f"{metric.get('__name__', '')}{{{labels}}}"


def lines_of(data: Mapping[str, Any], fmt: str, start: float) -> list[Line]:
    """The series of a Prometheus answer's ``data`` (a matrix, or a vector as one point each), their times
    relative to ``start``; NaN and infinite values are dropped (Grafana leaves gaps for them)."""
    out = []
    for series in data.get("result", []):
        points = series["values"] if data.get("resultType") == "matrix" else [series["value"]]
        kept = [(float(t) - start, float(v)) for t, v in points if math.isfinite(float(v))]
        if kept:
            times, values = zip(*kept, strict=True)
            out.append(Line(legend(fmt, series["metric"]), tuple(times), tuple(values)))
    return out


def panel_data(
    dashboard: Mapping[str, Any], fetch: Fetch, start: float, ranges: Mapping[str, str]
) -> list[PanelData]:
    """Every panel of ``dashboard`` with what its targets returned (``fetch`` runs each concrete query)."""
    out = []
    for panel in panels(dashboard):
        unit = str(panel.get("fieldConfig", {}).get("defaults", {}).get("unit") or "short")
        lines: list[Line] = []
        instant = False
        for target in panel.get("targets", []):
            instant = instant or bool(target.get("instant"))
            data = fetch(concrete(str(target["expr"]), dashboard, ranges), bool(target.get("instant")))
            lines += lines_of(data, str(target.get("legendFormat", "")), start)
        out.append(PanelData(str(panel.get("title", "")), unit, instant, tuple(lines)))
    return out


def _axis_label(unit: str) -> tuple[str, float]:
    if unit.startswith("suffix:"):
        return unit.removeprefix("suffix:").strip(), 1.0
    return UNITS.get(unit, (unit, 1.0))


def draw(
    title: str,
    data: Sequence[PanelData],
    path: Path,
    marks: Mapping[str, float] | None = None,
    note: str = "",
    columns: int = 3,
) -> Path:
    """Draw ``data`` (the panels that have series) in a grid into the PNG ``path``; the panels without any
    are named at the bottom. ``marks``: name -> seconds, a labelled vertical line on every time axis."""
    shown = [p for p in data if p.lines]
    empty = [p.title for p in data if not p.lines]
    rows = max(1, math.ceil(len(shown) / columns))
    fig = Figure(figsize=(5.2 * columns, 3.1 * rows + 1.0))
    fig.suptitle(title + (f"\n{note}" if note else ""), fontsize=12)
    for i, panel in enumerate(shown):
        ax = fig.add_subplot(rows, columns, i + 1)
        label, scale = _axis_label(panel.unit)
        if panel.instant:
            bars = sorted(panel.lines, key=lambda line: line.values[-1])
            ax.barh([b.legend or "-" for b in bars], [b.values[-1] * scale for b in bars])
            ax.set_xlabel(label)
            ax.tick_params(axis="y", labelsize=7)
        else:
            for line in panel.lines:
                ax.plot(line.times, [v * scale for v in line.values], label=line.legend or "-", lw=1.2)
            for name, at in (marks or {}).items():
                ax.axvline(at, color="grey", lw=0.8, ls=":")
                ax.text(at, 1.0, f" {name}", transform=ax.get_xaxis_transform(), fontsize=6, va="top")
            ax.set_xlabel("seconds")
            ax.set_ylabel(label)
            if len(panel.lines) <= 8:
                ax.legend(fontsize=6, loc="best")
        ax.set_title(panel.title, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    if empty:
        fig.text(0.01, 0.005, "No data in this run: " + "; ".join(empty), fontsize=7, wrap=True)
    height = 3.1 * rows + 1.0
    fig.tight_layout(rect=(0, 0.35 / height if empty else 0, 1, 1 - 0.55 / height))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    return path


def prometheus_fetch(url: str, start: float, end: float, step_s: float) -> Fetch:
    """A :data:`Fetch` on the Prometheus at ``url``: range queries over ``[start, end]`` every ``step_s``,
    instant ones at ``end``. Raises RuntimeError with Prometheus's error on a failed query."""

    def fetch(expr: str, instant: bool) -> dict[str, Any]:
        if instant:
            params: dict[str, Any] = {"query": expr, "time": end}
            path = "query"
        else:
            params = {"query": expr, "start": start, "end": end, "step": step_s}
            path = "query_range"
        body = httpx.get(f"{url}/api/v1/{path}", params=params, timeout=30).json()
        if body.get("status") != "success":
            raise RuntimeError(f"{expr}: {body.get('error')}")
        return dict(body["data"])

    return fetch


def builtin_ranges(scale: float, start: float, end: float, step_s: float) -> dict[str, str]:
    """Grafana's built-in ranges for a plot of ``[start, end]``: ``$__rate_interval`` 5 m times ``scale``,
    ``$__interval`` the step, ``$__range`` the whole span (ms)."""
    return {
        "__rate_interval": f"{max(1, round(300_000 * scale))}ms",
        "__interval": f"{max(1, round(step_s * 1000))}ms",
        "__range": f"{max(1, round((end - start) * 1000))}ms",
    }


def scale_text(scale: float) -> str:
    """``1/60`` for a scale whose inverse is a whole number, else the number (``0.25``... ``1``)."""
    inverse = 1 / scale
    return f"1/{round(inverse)}" if scale < 1 and abs(inverse - round(inverse)) < 1e-6 else f"{scale:g}"


def image_name(dashboard_file: str) -> str:
    """``radixgate-service.json`` -> ``ops-service.png``."""
    return "ops-" + Path(dashboard_file).stem.removeprefix("radixgate-") + ".png"


def render_all(
    prometheus: str,
    start: float,
    end: float,
    out: Path,
    scale: float = 1.0,
    marks: Mapping[str, float] | None = None,
    dashboards: Path = Path("deploy/grafana"),
    step_s: float = 1.0,
) -> list[Path]:
    """One PNG per dashboard of ``dashboards`` into ``out``, from ``prometheus`` over ``[start, end]``."""
    fetch = prometheus_fetch(prometheus, start, end, step_s)
    ranges = builtin_ranges(scale, start, end, step_s)
    note = f"{end - start:.0f} s of a live run; rules and rate windows at {scale_text(scale)} of real time"
    written = []
    for path in sorted(dashboards.glob("*.json")):
        board = json.loads(path.read_text())
        data = panel_data(board, fetch, start, ranges)
        written.append(
            draw(str(board.get("title", path.stem)), data, out / image_name(path.name), marks, note)
        )
    return written


def _time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return datetime.datetime.fromisoformat(text).timestamp()


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); 0."""
    parser = argparse.ArgumentParser(
        prog="python -m service.observability.dashboards.plot", description=__doc__
    )
    parser.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--start", required=True, type=_time, help="unix seconds or RFC 3339")
    parser.add_argument("--end", required=True, type=_time, help="unix seconds or RFC 3339")
    parser.add_argument("--step", type=float, default=1.0, help="range-query step, s")
    parser.add_argument("--scale", type=float, default=1.0, help="time scale of the rules (1/60: 5 m -> 5 s)")
    parser.add_argument("--mark", action="append", default=[], help="name=seconds after start")
    parser.add_argument("--dashboards", type=Path, default=Path("deploy/grafana"))
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args(argv)
    marks = {name: float(at) for name, _, at in (m.partition("=") for m in args.mark)}
    for path in render_all(
        args.prometheus, args.start, args.end, args.out, args.scale, marks, args.dashboards, args.step
    ):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
