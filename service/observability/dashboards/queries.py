"""Every panel's PromQL, read back from a dashboard's Grafana JSON, and made concrete.

Grafana fills a dashboard's variables in before it sends a query; a PromQL parser or a Prometheus server
given the raw text sees ``$model`` and fails. :func:`concrete` does what Grafana does with the
dashboard's defaults: a label variable's "All" is its ``allValue`` (``.*``), a custom variable its current
value, and the built-in ranges (``$__rate_interval``, ``$__interval``, ``$__range``) the durations given
(a test against a Prometheus that scrapes every second can pass short ones).

Pure functions on the JSON (dicts): they read the committed files as well as the generator's output, so
a test can take the queries from either. No Grafana library is needed here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

BUILTIN_RANGES = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
"""Default durations of Grafana's built-in range variables (a 1 h dashboard, 15 s scrapes)."""

_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.+),\s*(?P<label>[A-Za-z_]\w*)\s*\)\s*$", re.S)
"""A Prometheus query variable: ``label_values(<series selector>, <label>)``."""

_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]")
"""Grafana's three variable syntaxes: ``$name``, ``${name}`` (``${name:format}``), ``[[name]]``."""


@dataclass(frozen=True, slots=True)
class PanelQuery:
    """One target of one panel.

    Attributes:
        dashboard: the dashboard's uid. panel: the panel's title. ref_id: the target's refId.
        expr: the PromQL as the dashboard holds it (with variables).
        instant: an instant query (else a range query).
    """

    dashboard: str
    panel: str
    ref_id: str
    expr: str
    instant: bool


def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of ``dashboard`` that is not a row, rows' nested panels included, in order."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from (p for p in panel.get("panels", []) if p.get("type") != "row")
        else:
            yield panel


def panel_queries(dashboard: Mapping[str, Any]) -> list[PanelQuery]:
    """Every target of every panel of ``dashboard``."""
    return [
        PanelQuery(
            dashboard=str(dashboard["uid"]),
            panel=str(panel.get("title", "")),
            ref_id=str(target.get("refId", "")),
            expr=str(target["expr"]),
            instant=bool(target.get("instant", False)),
        )
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
    ]


def variable_defaults(dashboard: Mapping[str, Any]) -> dict[str, str]:
    """Variable name -> the text Grafana puts in a query at the dashboard's defaults: ``allValue`` for a
    variable whose current value is "All", else its current value. The ``datasource`` variable is left
    out (it is no part of a query)."""
    values: dict[str, str] = {}
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "datasource":
            continue
        current = variable.get("current") or {}
        value = current.get("value")
        if value in ("$__all", ["$__all"]) or (value is None and variable.get("includeAll")):
            values[variable["name"]] = str(variable.get("allValue", ".*"))
        elif isinstance(value, list):
            values[variable["name"]] = "|".join(map(str, value))
        elif value is not None:
            values[variable["name"]] = str(value)
    return values


def variables_in(expr: str) -> set[str]:
    """The names of the variables ``expr`` uses (built-ins too)."""
    return {next(g for g in match.groups() if g) for match in _VARIABLE.finditer(expr)}


def concrete(
    expr: str,
    dashboard: Mapping[str, Any],
    ranges: Mapping[str, str] | None = None,
) -> str:
    """``expr`` with the variables of ``dashboard`` at their defaults and the built-in ranges at
    ``ranges`` (over :data:`BUILTIN_RANGES`). Raises KeyError on a variable the dashboard lacks."""
    values = {**BUILTIN_RANGES, **(ranges or {}), **variable_defaults(dashboard)}

    def fill(match: re.Match[str]) -> str:
        return values[next(g for g in match.groups() if g)]

    return _VARIABLE.sub(fill, expr)


def variable_selectors(dashboard: Mapping[str, Any]) -> dict[str, str]:
    """Query variable name -> the series selector its ``label_values(selector, label)`` reads (the
    selector may use the other variables). Raises ValueError on a query variable of another form."""
    selectors: dict[str, str] = {}
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query)
        match = _LABEL_VALUES.match(text)
        if match is None:
            raise ValueError(f"variable {variable.get('name')}: not label_values(selector, label): {text}")
        selectors[str(variable["name"])] = match["selector"].strip()
    return selectors
