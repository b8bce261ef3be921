"""The shipped rules and dashboards against a real Prometheus and Alertmanager (issue 28).

One run (:mod:`tests.support.live_scenario`, module fixture, ~40 s): a gateway in front of three simulated
workers under light load, an overload, its end and a worker's death, scraped every 0.5 s by Debian's
``prometheus`` evaluating deploy/prometheus/rules at 1/60 of real time (5 m -> 5 s), alerting through
``prometheus-alertmanager`` with deploy/prometheus/alertmanager.yml (its receivers pointed at a webhook here,
its waits shortened). The tests read what the webhook got and ask Prometheus's HTTP API:

- light load fires nothing; the overload fires RadixgateShedRateHigh (band interactive) and
  RadixgateTTFTBudgetBurnFast (class batch, routed as a page), which resolve once the load stops; the killed
  worker's RadixgateWorkerUnhealthy reaches the webhook, for it alone;
- every panel query of deploy/grafana runs without error over the run and returns data unless all it reads
  is a series this stack cannot have; every series name a panel, a variable or a rule selects is one
  Prometheus holds, or is listed in deploy/prometheus/external_series.txt (DCGM, SGLang-only: may be
  absent), or is one of :data:`NOT_IN_THIS_RUN`, which the gateway declares on ``/metrics`` but counts only
  on events this run does not cause.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from service.observability.dashboards.plot import builtin_ranges
from service.observability.dashboards.queries import concrete, panel_queries, variable_selectors
from tests.support.grafana import committed, panel_series
from tests.support.live_scenario import Timeline, live, run
from tests.support.prometheus import SimStack, exposed_names, external_series, queried_series, selector_names
from tests.support.prometheus_live import FACTOR, LivePrometheus, Webhook

NOT_IN_THIS_RUN = {
    "radixgate_worker_restarts_total": "counted by the supervisor of workers the gateway launches "
    "(engine.launch); the simulated workers here are not launched by it",
    "radixgate_store_unavailable_total": "counted when Redis fails; Redis stays up in this run",
    "radixgate_engine_spec_accept_rate": "re-exported from a worker that runs speculative decoding; the "
    "simulated workers do not",
    "radixgate_engine_spec_accept_length": "the same",
}
"""Families the gateway declares (HELP/TYPE, no sample until the event) that this run never increments."""


@dataclass
class LiveRun:
    """The run's record, its Prometheus and webhook, and the stack (still up)."""

    timeline: Timeline
    prom: LivePrometheus
    hook: Webhook
    stack: SimStack


@pytest.fixture(scope="module")
def live_run(
    redis_url: str, stub_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveRun]:
    with live(tmp_path_factory.mktemp("prometheus"), redis_url, stub_model_dir) as (stack, prom, hook):
        yield LiveRun(run(stack, hook), prom, hook, stack)


def test_light_load_fires_nothing(live_run: LiveRun) -> None:
    start, end = live_run.timeline.phases["light"]
    assert live_run.hook.between(start, end) == []
    assert set(live_run.timeline.statuses["light"]) == {200}
    # the quota-limited tenant was refused, as the 429/413 panels need: a quarter of its requests ask more
    # than its token burst (413), and past its burst of 2 (refilled at 6/min) the rest get 429
    limited = live_run.timeline.statuses["limited"]
    assert set(limited) == {200, 413, 429} and limited[413] == (limited.total() + 3) // 4
    assert 2 <= limited[200] <= 3 and limited[429] >= 3


def test_overload_fires_the_shed_rate_and_ttft_burn_alerts(live_run: LiveRun) -> None:
    timeline = live_run.timeline
    start, stop = timeline.phases["overload"]
    shed, burn = timeline.seen["shed"], timeline.seen["ttft_burn"]
    assert shed is not None, "RadixgateShedRateHigh{band=interactive} never reached the webhook"
    assert burn is not None, "RadixgateTTFTBudgetBurnFast{class=batch} never reached the webhook"
    assert start < shed.at <= stop and start < burn.at <= stop
    # routed by deploy/prometheus/alertmanager.yml: a warning to the webhook, a page to the page receiver
    assert (shed.receiver, shed.labels["severity"]) == ("/alerts", "warning")
    assert (burn.receiver, burn.labels["severity"]) == ("/page", "page")
    # what fired them is in Prometheus: interactive shed (503) above 5% for the (scaled) 10 minutes, batch
    # served late: above 14.4 x 1% of its answers missed its TTFT goal over both windows
    assert timeline.statuses["overload"][503] > timeline.statuses["overload"][200] > 0
    at = {"time": shed.at}
    shed_ratio = live_run.prom.api(
        "query", query='band:radixgate_shed:ratio_rate5m{band="interactive"}', **at
    )
    assert float(shed_ratio["result"][0]["value"][1]) > 0.05
    burn_ratio = live_run.prom.api(
        "query", query='class:radixgate_ttft_slo_errors:ratio_rate1h{class="batch"}', time=burn.at
    )
    assert float(burn_ratio["result"][0]["value"][1]) > 0.144


def test_the_overload_alerts_resolve_when_the_load_stops(live_run: LiveRun) -> None:
    timeline = live_run.timeline
    _, stop = timeline.phases["overload"]
    for name in ("shed", "ttft_burn"):
        fired, resolved = timeline.seen[name], timeline.seen[f"{name}_resolved"]
        assert fired is not None and resolved is not None, f"{name}: fired {fired}, resolved {resolved}"
        assert resolved.at >= stop and resolved.labels == fired.labels and resolved.receiver == fired.receiver
        # and it stayed firing until the load stopped: no resolved notification in between
        between = live_run.hook.between(fired.at, stop)
        assert not [n for n in between if n.labels == fired.labels and n.status == "resolved"]


def test_a_killed_worker_reaches_the_webhook_as_worker_unhealthy(live_run: LiveRun) -> None:
    timeline = live_run.timeline
    start, end = timeline.phases["kill"]
    unhealthy = timeline.seen["unhealthy"]
    assert unhealthy is not None, "RadixgateWorkerUnhealthy never reached the webhook"
    assert unhealthy.status == "firing" and unhealthy.receiver == "/alerts"
    assert start < unhealthy.at <= end and unhealthy.labels["worker"] == timeline.killed
    # for that worker alone, in the whole run
    every = [n for n in live_run.hook.received if n.labels["alertname"] == "RadixgateWorkerUnhealthy"]
    assert {n.labels["worker"] for n in every} == {timeline.killed}
    # the alert reads the gateway's own view, which the rule records per worker
    healthy = live_run.prom.api("query", query="worker:radixgate_worker_healthy:max", time=unhealthy.at)
    by_worker = {r["metric"]["worker"]: float(r["value"][1]) for r in healthy["result"]}
    assert by_worker == {url: float(url != timeline.killed) for url in timeline.workers}
    # its streams that broke before it stopped were retried on the others: every client got its answer
    assert set(timeline.statuses["kill"]) == {200}


def _ranges(timeline: Timeline) -> dict[str, str]:
    start, end = timeline.span
    return builtin_ranges(FACTOR, start, end, 1.0)


def test_every_panel_query_runs_on_the_live_prometheus(live_run: LiveRun) -> None:
    """88 queries of 63 panels; all run, and every one that reads a series this stack emits has data."""
    start, end = live_run.timeline.span
    ranges = _ranges(live_run.timeline)
    may_be_absent = set(external_series()) | set(NOT_IN_THIS_RUN)
    checked, empty, panels = 0, [], set()
    for board in committed().values():
        for query in panel_queries(board):
            expr = concrete(query.expr, board, ranges)
            if query.instant:
                data = live_run.prom.api("query", query=expr, time=end)
            else:
                data = live_run.prom.api("query_range", query=expr, start=start, end=end, step=1)
            checked += 1
            panels.add((query.dashboard, query.panel))
            if not data["result"] and not selector_names(expr) <= may_be_absent:
                empty.append(f"{query.dashboard}: {query.panel} {query.ref_id}: {expr}")
    assert (checked, len(panels)) == (105, 74)
    assert empty == [], "panel queries with no data over the live run:\n" + "\n".join(empty)


def test_every_variable_selector_matches_series(live_run: LiveRun) -> None:
    start, end = live_run.timeline.span
    may_be_absent = set(external_series())
    for board in committed().values():
        for name, selector in variable_selectors(board).items():
            expr = concrete(selector, board, _ranges(live_run.timeline))
            found = live_run.prom.api("series", **{"match[]": expr}, start=start, end=end)
            assert found or selector_names(expr) <= may_be_absent, f"{board['uid']}: ${name}: {expr}"


def test_every_selected_series_is_one_prometheus_holds(live_run: LiveRun) -> None:
    """Panels' and rules' names: held by Prometheus, or external (may be absent), or NOT_IN_THIS_RUN,
    declared by the gateway's /metrics."""
    held = live_run.prom.names()
    used = set(panel_series()) | set(queried_series())
    unknown = used - held - set(external_series())
    assert unknown == set(NOT_IN_THIS_RUN)
    declared = exposed_names(httpx.get(f"{live_run.stack.url}/metrics").text)
    assert set(NOT_IN_THIS_RUN) <= declared
    # the external list is what it says: none of it comes from this stack (Prometheus's own `up` aside)
    assert set(external_series()) & held == {"up"}
