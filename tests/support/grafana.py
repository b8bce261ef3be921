"""deploy/grafana/ for the tests (issue 28): the committed dashboards, and the metric names their panels'
PromQL selects (the queries made concrete by the generator's :mod:`service.observability.dashboards.queries`,
then parsed by the same PromQL parser as the rules in :mod:`tests.support.prometheus`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from service.observability.dashboards.queries import concrete, panel_queries, variable_selectors
from tests.support.paths import REPO
from tests.support.prometheus import rules, selector_names

GRAFANA = REPO / "deploy" / "grafana"


def committed() -> dict[str, dict[str, Any]]:
    """File name -> dashboard JSON of every ``deploy/grafana/*.json``."""
    return {path.name: json.loads(path.read_text()) for path in sorted(GRAFANA.glob("*.json"))}


def recorded_names() -> set[str]:
    """The names the recording rules of deploy/prometheus/rules/ record."""
    return {rule["record"] for rule in rules() if "record" in rule}


def panel_series(dashboards: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, set[str]]:
    """Metric name -> the panels and variables (``uid: title``, ``uid: $name``) whose PromQL selects it,
    over ``dashboards`` (default: the committed ones). Recording-rule names are in it too (the rules'
    own inputs are checked by tests/deploy/test_prometheus_names.py)."""
    used: dict[str, set[str]] = {}
    for board in (dashboards or committed()).values():
        exprs = [(q.expr, f"{q.dashboard}: {q.panel}") for q in panel_queries(board)]
        exprs += [(sel, f"{board['uid']}: ${name}") for name, sel in variable_selectors(board).items()]
        for expr, where in exprs:
            for name in selector_names(concrete(expr, board)):
                used.setdefault(name, set()).add(where)
    return used
