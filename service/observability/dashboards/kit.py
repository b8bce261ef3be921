"""The pieces every radixgate dashboard is made of, on ``grafana-foundation-sdk``'s builders.

- One Prometheus datasource, chosen by the ``datasource`` variable (``${datasource}``): a dashboard imports
  into any Grafana whatever its Prometheus datasource is called.
- Label variables (:func:`label_variable`) are multi-valued with an "All" whose value is ``.*``, so a query
  filters with ``label=~"$var"``; :mod:`.queries` replaces them by that default to parse or run a query.
- Panels (:func:`timeseries`, :func:`stat`, :func:`top`, :func:`states`) take their queries as
  :class:`Query` (PromQL, legend, instant or range); :class:`Board` numbers the panels (``id``) and each
  panel's targets (``refId`` ``A``, ``B``, ...) so the JSON is the same at every build.
- Ranges are ``$__rate_interval`` (Grafana: at least 4 scrape intervals, so a rate always has two samples)
  unless a panel reads a recording rule, whose range the rule fixes (5 m, deploy/prometheus/rules).
"""

from __future__ import annotations

import itertools
import json
import string
from dataclasses import dataclass
from typing import Any

from grafana_foundation_sdk.builders import bargauge as bargauge_builder
from grafana_foundation_sdk.builders import stat as stat_builder
from grafana_foundation_sdk.builders import statetimeline as statetimeline_builder
from grafana_foundation_sdk.builders import timeseries as timeseries_builder
from grafana_foundation_sdk.builders.common import StackingConfig, VizLegendOptions
from grafana_foundation_sdk.builders.dashboard import (
    CustomVariable,
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model

DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
"""Every panel's and every query's datasource: the one the ``datasource`` variable names."""

ALL = ".*"
"""The value of a label variable's "All": matches every value (and a missing label)."""

RATE = "$__rate_interval"
"""The range of a panel's ``rate``/``increase``: Grafana's ``max($__interval + scrape, 4 x scrape)``."""

TOKENS_PER_S = "suffix: tok/s"
"""Grafana's custom-unit syntax: the number with ``tok/s`` after it."""


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL target of a panel.

    Attributes:
        expr: the PromQL (may name the dashboard's variables: ``$model``, ``$__rate_interval``).
        legend: Grafana's legend format (``{{class}}``); empty: the series' labels.
        instant: an instant query (one value per series at the range's end) instead of a range.
    """

    expr: str
    legend: str = ""
    instant: bool = False


def datasource_variable() -> DatasourceVariable:
    """The ``datasource`` variable: any Prometheus datasource of the Grafana the dashboard is imported in."""
    return DatasourceVariable("datasource").label("Prometheus").type("prometheus")


def label_variable(name: str, label: str, metric: str, title: str, description: str) -> QueryVariable:
    """A multi-valued variable over the values of ``label`` on ``metric`` (a series selector: a name, and
    optionally matchers on the other variables), with "All" (``.*``) as its default."""
    return (
        QueryVariable(name)
        .label(title)
        .description(description)
        .datasource(DATASOURCE)
        .query(f"label_values({metric}, {label})")
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(ALL)
        .current(model.VariableOption(text="All", value="$__all", selected=True))
    )


def choice_variable(name: str, title: str, values: list[str], default: str) -> CustomVariable:
    """A single-valued variable with fixed ``values`` (``default`` selected)."""
    return (
        CustomVariable(name)
        .label(title)
        .values(",".join(values))
        .current(model.VariableOption(text=default, value=default, selected=True))
    )


def _targets(panel: Any, queries: tuple[Query, ...]) -> None:
    """Add ``queries`` to ``panel`` with refIds A, B, ... in order."""
    assert queries, "a panel with no query"
    for ref, query in zip(string.ascii_uppercase, queries, strict=False):
        target = Dataquery().expr(query.expr).ref_id(ref).datasource(DATASOURCE)
        if query.legend:
            target = target.legend_format(query.legend)
        panel.with_target(target.instant() if query.instant else target.range())


def _thresholds(steps: list[tuple[float | None, str]]) -> ThresholdsConfig:
    return (
        ThresholdsConfig()
        .mode(model.ThresholdsMode.ABSOLUTE)
        .steps([model.Threshold(value=value, color=color) for value, color in steps])
    )


def timeseries(
    title: str,
    description: str,
    unit: str,
    *queries: Query,
    width: int = 12,
    height: int = 8,
    stack: bool = False,
    bars: bool = False,
    min_val: float | None = 0,
    max_val: float | None = None,
) -> timeseries_builder.Panel:
    """A time series panel of ``queries`` (lines; ``bars`` for counts per interval, ``stack`` to stack)."""
    panel = (
        timeseries_builder.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .legend(
            VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["mean", "max", "lastNotNull"])
        )
        .fill_opacity(30 if stack or bars else 10)
    )
    if min_val is not None:
        panel = panel.min(min_val)
    if max_val is not None:
        panel = panel.max(max_val)
    if stack:
        panel = panel.stacking(StackingConfig().mode(common.StackingMode.NORMAL))
    if bars:
        panel = panel.draw_style(common.GraphDrawStyle.BARS)
    _targets(panel, queries)
    return panel


def stat(
    title: str,
    description: str,
    unit: str,
    *queries: Query,
    width: int = 6,
    height: int = 4,
    steps: list[tuple[float | None, str]] | None = None,
) -> stat_builder.Panel:
    """A single-value panel (last value of each series; ``steps``: threshold colours, lowest first)."""
    panel = (
        stat_builder.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .graph_mode(common.BigValueGraphMode.AREA)
        .color_mode(common.BigValueColorMode.VALUE)
    )
    if steps:
        panel = panel.thresholds(_thresholds(steps))
    _targets(panel, queries)
    return panel


def top(
    title: str, description: str, unit: str, *queries: Query, width: int = 12, height: int = 8
) -> bargauge_builder.Panel:
    """A horizontal bar per series of instant ``queries`` (top-N tables: ``topk``)."""
    panel = (
        bargauge_builder.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .orientation(common.VizOrientation.HORIZONTAL)
        .display_mode(common.BarGaugeDisplayMode.GRADIENT)
        .min(0)
    )
    _targets(panel, tuple(Query(q.expr, q.legend, instant=True) for q in queries))
    return panel


def states(
    title: str,
    description: str,
    mapping: dict[str, tuple[str, str]],
    *queries: Query,
    width: int = 12,
    height: int = 8,
) -> statetimeline_builder.Panel:
    """A state timeline: each series a band coloured by its value (``mapping``: value -> (text, colour))."""
    panel = (
        statetimeline_builder.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(width)
        .height(height)
        .fill_opacity(70)
        .line_width(0)
        .mappings(
            [
                model.ValueMap(options={value: model.ValueMappingResult(text=text, color=color, index=i)})
                for i, (value, (text, color)) in enumerate(mapping.items())
            ]
        )
    )
    _targets(panel, queries)
    return panel


class Board:
    """A dashboard under construction: its panels numbered in the order they are added.

    Args:
        uid: Grafana's dashboard uid (also the JSON file's name under deploy/grafana/).
        title, description: as Grafana shows them.
    """

    def __init__(self, uid: str, title: str, description: str) -> None:
        self.uid = uid
        self._ids = itertools.count(1)
        self._builder = (
            Dashboard(title)
            .uid(uid)
            .description(description)
            .tags(["radixgate", "generated"])
            .editable()
            .time("now-1h", "now")
            .refresh("30s")
            .timezone(common.TimeZoneBrowser)
            .tooltip(model.DashboardCursorSync.CROSSHAIR)
            .with_variable(datasource_variable())
        )

    def variable(self, variable: Builder[model.VariableModel]) -> Board:
        """Add a template variable (after ``datasource``, in order)."""
        self._builder.with_variable(variable)
        return self

    def row(self, title: str) -> Board:
        """Start a row: the panels added next sit under it."""
        self._builder.with_row(Row(title).id(next(self._ids)))
        return self

    def panel(self, panel: Any) -> Board:
        """Add a panel (laid out left to right, then down, by its width and height)."""
        self._builder.with_panel(panel.id(next(self._ids)))
        return self

    def to_json(self) -> dict[str, Any]:
        """The dashboard as Grafana's JSON model (a dict, keys sorted)."""
        encoded = JSONEncoder(sort_keys=True).encode(self._builder.build())
        loaded: dict[str, Any] = json.loads(encoded)
        return loaded
