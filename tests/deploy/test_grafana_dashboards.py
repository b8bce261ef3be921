"""The dashboards of deploy/grafana/ (issue 28): the committed JSON is the generator's output
(``python -m service.observability.dashboards``), each file is a Grafana dashboard that Grafana's own
schema library (grafana-foundation-sdk) reads back unchanged, every panel queries the one Prometheus
datasource variable, and the hardware dashboard keeps compute, memory bandwidth and network apart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard as DashboardModel

from service.observability.dashboards.__main__ import main
from service.observability.dashboards.catalog import build_all, render
from service.observability.dashboards.queries import (
    BUILTIN_RANGES,
    concrete,
    panel_queries,
    panels,
    variable_defaults,
    variable_selectors,
    variables_in,
)
from tests.support.grafana import GRAFANA, committed
from tests.support.prometheus import run_tool, tool

BOARDS = committed()
EXPECTED = {"radixgate-service", "radixgate-tenants", "radixgate-workers", "radixgate-hardware"}


def test_the_committed_json_is_the_generators_output() -> None:
    built = build_all()
    assert {name.removesuffix(".json") for name in built} == EXPECTED
    assert sorted(BOARDS) == sorted(built), "deploy/grafana/ holds other files than the generator writes"
    stale = [name for name, board in built.items() if (GRAFANA / name).read_text() != render(board)]
    assert stale == [], f"regenerate: python -m service.observability.dashboards ({stale})"


def test_the_check_command_finds_a_stale_or_missing_file(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path)]) == 0
    assert main(["--out", str(tmp_path), "--check"]) == 0
    edited = tmp_path / "radixgate-service.json"
    board = json.loads(edited.read_text())
    board["panels"][1]["targets"][0]["expr"] = "radixgate_class_goodput_total"
    edited.write_text(render(board))
    assert main(["--out", str(tmp_path), "--check"]) == 1
    (tmp_path / "radixgate-tenants.json").unlink()
    assert main(["--out", str(tmp_path)]) == 0
    assert main(["--out", str(tmp_path), "--check"]) == 0
    assert json.loads(edited.read_text()) == build_all()["radixgate-service.json"]


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_grafanas_schema_reads_the_dashboard_back_unchanged(name: str) -> None:
    register_default_plugins()
    board = BOARDS[name]
    decoded = DashboardModel.from_json(board)
    assert json.loads(JSONEncoder(sort_keys=True).encode(decoded)) == board


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_each_dashboard_is_a_complete_grafana_dashboard(name: str) -> None:
    board = BOARDS[name]
    assert board["uid"] == name.removesuffix(".json") and board["title"] and board["schemaVersion"] >= 39
    variables = board["templating"]["list"]
    assert variables[0] == {**variables[0], "name": "datasource", "type": "datasource", "query": "prometheus"}
    found = list(panels(board))
    assert len(found) >= 10
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "two panels share an id"
    for panel in found:
        title = panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel.get("description"), f"{title}: no description"
        assert panel["targets"], f"{title}: no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)) and all(refs), f"{title}: refIds {refs}"
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip(), title
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, f"{title}: {pos}"


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_every_query_names_only_known_variables_and_parses(name: str) -> None:
    board = BOARDS[name]
    defined = set(variable_defaults(board)) | set(BUILTIN_RANGES)
    exprs = [q.expr for q in panel_queries(board)] + list(variable_selectors(board).values())
    for expr in exprs:
        assert variables_in(expr) <= defined, expr
        promql_parser.parse(concrete(expr, board))
    # every label variable a dashboard offers filters some panel
    used = set().union(*(variables_in(q.expr) for q in panel_queries(board)))
    assert set(variable_defaults(board)) <= used


def test_concrete_fills_defaults_and_given_ranges() -> None:
    board = BOARDS["radixgate-tenants.json"]
    expr = 'topk($topn, sum by (tenant) (rate(x{tenant=~"$tenant"}[$__rate_interval]))) or y[${__range}]'
    assert concrete(expr, board, {"__rate_interval": "4s"}) == (
        'topk(10, sum by (tenant) (rate(x{tenant=~".*"}[4s]))) or y[1h]'
    )
    with pytest.raises(KeyError):
        concrete("x{worker=~'$worker'}", board)


def _rows(board: dict[str, Any]) -> dict[str, str]:
    """Row title -> the PromQL of every panel under it, joined."""
    rows: dict[str, list[str]] = {}
    current = ""
    for panel in board["panels"]:
        if panel["type"] == "row":
            current = panel["title"]
            continue
        rows.setdefault(current, []).extend(t["expr"] for t in panel["targets"])
    return {title: "\n".join(exprs) for title, exprs in rows.items()}


def test_the_hardware_dashboard_keeps_compute_bandwidth_and_network_apart() -> None:
    rows = _rows(BOARDS["radixgate-hardware.json"])
    where = {
        "DCGM_FI_PROF_SM_ACTIVE": "Compute",
        "DCGM_FI_PROF_DRAM_ACTIVE": "Memory bandwidth",
        "DCGM_FI_DEV_FB_USED": "Memory capacity",
        "DCGM_FI_PROF_NVLINK_TX_BYTES": "Interconnect and network",
        "DCGM_FI_PROF_NVLINK_RX_BYTES": "Interconnect and network",
        "sglang:time_to_first_token_seconds_bucket": "Compute",
        "sglang:inter_token_latency_seconds_bucket": "Memory bandwidth",
        "radixgate_class_ttft_seconds_sum": "Interconnect and network",
    }
    for series, row in where.items():
        holders = [title for title, exprs in rows.items() if series in exprs]
        assert holders and all(title.startswith(row) for title in holders), (series, holders)
    # the descriptions say which resource each GPU panel points at
    described = {
        p["title"]: p["description"] for p in panels(BOARDS["radixgate-hardware.json"]) if "DCGM" in str(p)
    }
    assert "compute bound" in described["SM active"]
    assert "memory-bandwidth bound" in described["DRAM active"]
    assert "interconnect is the bottleneck" in described["NVLink throughput"]


def test_prometheus_itself_parses_every_query(tmp_path: Path) -> None:
    """Prometheus's own parser (``promtool check rules`` on every concrete query as a recording rule)
    accepts each query: stricter than the Rust parser on types (a range vector where an instant one is
    due, a function's arguments)."""
    rules = [
        {"record": f"grafana:{board['uid'].replace('-', '_')}:q{i}", "expr": concrete(expr, board)}
        for board in BOARDS.values()
        for i, expr in enumerate(
            [q.expr for q in panel_queries(board)] + list(variable_selectors(board).values())
        )
    ]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    out = run_tool(tool("promtool"), "check", "rules", path)
    assert f"SUCCESS: {len(rules)} rules found" in out, out
