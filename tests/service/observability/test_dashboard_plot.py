"""service.observability.dashboards.plot on hand-made Prometheus answers (no server), and the panel images
docs/observability.md shows (made by ``python -m tests.support.live_scenario``)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from matplotlib.image import imread

from service.observability.dashboards.plot import (
    Line,
    PanelData,
    builtin_ranges,
    draw,
    image_name,
    legend,
    lines_of,
    panel_data,
    scale_text,
)
from tests.support.grafana import committed
from tests.support.paths import REPO

NAN = "NaN"


@pytest.mark.parametrize(
    ("fmt", "metric", "shown"),
    [
        ("p99 {{class}}", {"class": "batch"}, "p99 batch"),
        ("{{ worker }} {{state}}", {"worker": "w1"}, "w1"),
        ("", {"__name__": "up", "job": "sglang", "instance": "h:1"}, 'up{instance="h:1", job="sglang"}'),
        ("", {}, "{}"),
    ],
)
def test_legend_is_grafanas(fmt: str, metric: dict[str, str], shown: str) -> None:
    assert legend(fmt, metric) == shown


def test_lines_of_a_matrix_and_a_vector() -> None:
    matrix = {
        "resultType": "matrix",
        "result": [
            {"metric": {"class": "a"}, "values": [[100, "1"], [101, NAN], [102, "+Inf"], [103, "0.5"]]},
            {"metric": {"class": "b"}, "values": [[100, NAN]]},
        ],
    }
    # NaN and infinite points are gaps; a series with nothing left is dropped
    assert lines_of(matrix, "{{class}}", start=100) == [Line("a", (0.0, 3.0), (1.0, 0.5))]
    vector = {"resultType": "vector", "result": [{"metric": {"t": "x"}, "value": [110, "7"]}]}
    [line] = lines_of(vector, "{{t}}", start=100)
    assert (line.legend, line.times, line.values) == ("x", (10.0,), (7.0,))


BOARD: dict[str, Any] = {
    "uid": "tiny",
    "title": "tiny",
    "templating": {
        "list": [{"name": "class", "type": "query", "includeAll": True, "current": {"value": "$__all"}}]
    },
    "panels": [
        {"type": "row", "title": "row", "panels": []},
        {
            "type": "timeseries",
            "title": "TTFT",
            "fieldConfig": {"defaults": {"unit": "s"}},
            "targets": [
                {"expr": 'rate(x{class=~"$class"}[$__rate_interval])', "legendFormat": "{{class}}"},
                {"expr": "absent_series", "legendFormat": "none"},
            ],
        },
        {
            "type": "bargauge",
            "title": "Top",
            "targets": [{"expr": "topk(3, y[$__range])", "instant": True, "legendFormat": "{{tenant}}"}],
        },
        {"type": "timeseries", "title": "Empty", "targets": [{"expr": "nothing"}]},
    ],
}


def _fetch(asked: list[tuple[str, bool]]) -> Any:
    def fetch(expr: str, instant: bool) -> dict[str, Any]:
        asked.append((expr, instant))
        if instant:
            result = [{"metric": {"tenant": t}, "value": [130, str(v)]} for t, v in (("a", 3), ("b", 9))]
            return {"resultType": "vector", "result": result}
        if expr.startswith("rate"):
            points = [[100 + i, str(i % 5 / 10)] for i in range(30)]
            return {"resultType": "matrix", "result": [{"metric": {"class": "batch"}, "values": points}]}
        return {"resultType": "matrix", "result": []}

    return fetch


def test_panel_data_runs_concrete_queries_and_draw_writes_a_png(tmp_path: Any) -> None:
    asked: list[tuple[str, bool]] = []
    ranges = builtin_ranges(1 / 60, start=100, end=130, step_s=1)
    assert ranges == {"__rate_interval": "5000ms", "__interval": "1000ms", "__range": "30000ms"}
    data = panel_data(BOARD, _fetch(asked), start=100, ranges=ranges)
    # Grafana's substitutions: the variable's All (.*), the scaled built-in ranges; the row is no panel
    assert asked == [
        ('rate(x{class=~".*"}[5000ms])', False),
        ("absent_series", False),
        ("topk(3, y[30000ms])", True),
        ("nothing", False),
    ]
    assert [(p.title, p.instant, len(p.lines)) for p in data] == [
        ("TTFT", False, 1),
        ("Top", True, 2),
        ("Empty", False, 0),
    ]
    path = draw("tiny", data, tmp_path / "ops-tiny.png", marks={"overload": 10.0}, note="a note")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(path).shape
    # two drawn panels in a 3-column grid: one row of 5.2 x 3.1 in plus the titles, at 72 dpi
    assert (width, height) == (round(3 * 5.2 * 72), round(4.1 * 72))


def test_a_panel_without_data_is_not_drawn(tmp_path: Any) -> None:
    only_empty = [PanelData("Empty", "short", False, ())]
    assert draw("t", only_empty, tmp_path / "e.png").is_file()


def test_names_and_scale() -> None:
    assert image_name("radixgate-workers.json") == "ops-workers.png"
    assert (scale_text(1 / 60), scale_text(1.0), scale_text(0.3)) == ("1/60", "1", "0.3")


def test_the_docs_show_every_dashboard_from_a_real_run() -> None:
    doc = (REPO / "docs" / "observability.md").read_text()
    section = doc[doc.index("## Operations: the panels from a real run") :]
    shown = re.findall(r"!\[[^\]]*\]\((img/ops-[\w-]+\.png)\)", section)
    assert sorted(shown) == sorted(f"img/{image_name(name)}" for name in committed())
    for link in shown:
        path = REPO / "docs" / link
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", link
        assert 50_000 < path.stat().st_size < 1_000_000, link
