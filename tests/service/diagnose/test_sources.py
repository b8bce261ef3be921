"""service/diagnose's reading of a window: Prometheus's histogram_quantile over bucket increases, the
increases and gauges of two direct scrapes (resets, series that appear, SGLang's per-priority breakdown),
the snapshot they make, the PromQL it sends, and the bounds of the command's options."""

from __future__ import annotations

import math

import promql_parser
import pytest

from service.diagnose.command import DiagnoseInputError, base_url, parse_duration
from service.diagnose.snapshot import bucket_quantile, fleet_view, latencies
from service.diagnose.sources import PrometheusWindow, Scrape, ScrapedWindow, host_port, parse_exposition

INF = math.inf


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, [(0.1, 0), (0.5, 10), (INF, 10)], 0.3),  # inside (0.1, 0.5]: 0.1 + 0.4 x 5/10
        (0.5, [(1.0, 10), (INF, 10)], 0.5),  # the first bucket starts at 0
        (0.99, [(1.0, 5), (2.0, 8), (INF, 10)], 2.0),  # the rank falls in +Inf: the highest finite bound
        (0.5, [(-1.0, 10), (INF, 10)], -1.0),  # a first bucket at or below 0: its bound
        (0.5, [(0.5, 10), (0.1, 0), (INF, 10)], 0.3),  # any order
        (0.5, [(0.1, 0), (0.5, 4), (0.5, 6), (INF, 10)], 0.3),  # one bound twice: added (replicas)
        (0.5, [(0.1, 0), (0.5, 10), (1.0, 9), (INF, 10)], 0.3),  # a count that falls is held (monotonic)
        (0.5, [(0.1, 0), (INF, 0)], None),  # no observation
        (0.5, [(0.1, 5), (0.5, 10)], None),  # no +Inf bucket
        (0.5, [(INF, 10)], None),  # one bucket
        (1.5, [(0.1, 5), (INF, 10)], None),  # no such quantile
    ],
)
def test_bucket_quantile_is_prometheus_histogram_quantile(
    q: float, buckets: list[tuple[float, float]], expected: float | None
) -> None:
    got = bucket_quantile(q, buckets)
    assert got == (None if expected is None else pytest.approx(expected))


FIRST = """\
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",priority=""} 2.0
sglang:num_queue_reqs{model_name="m",priority="10"} 2.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 1000.0
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 10.0
sglang:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 10.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 10.0
sglang:time_to_first_token_seconds_sum{model_name="m"} 0.5
sglang:time_to_first_token_seconds_count{model_name="m"} 10.0
"""

LAST = """\
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",priority=""} 6.0
sglang:num_queue_reqs{model_name="m",priority="10"} 6.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 400.0
sglang:prompt_tokens_total{model_name="other"} 50.0
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 10.0
sglang:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 20.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 20.0
sglang:time_to_first_token_seconds_sum{model_name="m"} 5.5
sglang:time_to_first_token_seconds_count{model_name="m"} 20.0
"""


def window() -> ScrapedWindow:
    where = {"instance": "w0:30000"}
    return ScrapedWindow(
        [Scrape(10.0, parse_exposition(FIRST, where)), Scrape(12.5, parse_exposition(LAST, where))]
    )


def test_a_scraped_window_counts_increases_resets_and_new_series() -> None:
    win = window()
    assert win.span_s == 2.5
    # a reset (1000 -> 400) counts its last value, as Prometheus's increase does; a new series from 0
    assert win.increase("sglang:prompt_tokens_total", ("model_name",)) == {("m",): 400.0, ("other",): 50.0}
    assert win.increase("sglang:prompt_tokens_total", ()) == {(): 450.0}
    assert win.increase("sglang:prompt_tokens_total", (), baseline=True) == {(): 1000.0}
    # the total only (priority ""), averaged over the two scrapes
    assert win.gauge("sglang:num_queue_reqs", ("instance",), {"priority": ""}) == {("w0:30000",): 4.0}
    assert win.gauge("sglang:num_queue_reqs", (), None, "max", "sum") == {(): 12.0}
    ttft = latencies(win, "sglang:time_to_first_token_seconds", ("instance",))[("w0:30000",)]
    assert (ttft.count, ttft.mean) == (10.0, pytest.approx(0.5))  # 10 more, 5 s more
    assert ttft.p50 == pytest.approx(0.55)  # all 10 in (0.1, 1.0]
    before = latencies(win, "sglang:time_to_first_token_seconds", ("instance",), baseline=True)
    assert before[("w0:30000",)].mean == pytest.approx(0.05)


def test_the_snapshot_names_each_worker_and_leaves_out_what_is_missing() -> None:
    view = fleet_view(window(), ["w0:30000", "w9:30000"])
    by_name = {w.name: w for w in view.workers}
    assert set(by_name) == {"w0:30000", "w9:30000"}
    w0, w9 = by_name["w0:30000"], by_name["w9:30000"]
    assert (w0.queued, w0.prompt_tokens, w0.ttft.count) == (4.0, 450.0, 10.0)  # every model it serves
    assert (w9.queued, w9.ttft.count, w9.kv_usage) == (None, 0.0, None)
    assert view.gateway.served == 0 and view.gateway.ttft.count == 0
    baseline = fleet_view(window(), ["w0:30000"], baseline=True)
    assert baseline.span_s == 0 and baseline.workers[0].queued is None  # no gauges before the window


def test_the_promql_sent_parses_and_covers_the_window_and_the_baseline() -> None:
    sent: list[str] = []

    def query(expr: str) -> list[tuple[dict[str, str], float]]:
        sent.append(expr)
        return []

    src = PrometheusWindow(query, window_s=300, baseline_s=3600)
    view = fleet_view(src, [])
    fleet_view(src, [], baseline=True)
    assert view.workers == () and view.span_s == 300
    for expr in sent:
        promql_parser.parse(expr)  # raises on a syntax error
    assert "sum by (instance, le) (increase(sglang:time_to_first_token_seconds_bucket[300000ms]))" in sent
    assert any("[3600000ms] offset 300000ms" in e for e in sent)
    # a worker's data-parallel ranks summed, averaged over the window
    assert 'sum by (instance) (avg_over_time(sglang:num_queue_reqs{priority=""}[300000ms]))' in sent
    assert "sum by (phase, le) (increase(radixgate_request_phase_seconds_bucket[300000ms]))" in sent


@pytest.mark.parametrize(
    ("text", "seconds"), [("5m", 300.0), ("1h30m", 5400.0), ("90s", 90.0), ("1500ms", 1.5), ("2d", 172800.0)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text, "--window") == seconds


BAD = [
    ("5 m", "not a duration"),
    ("", "not a duration"),
    ("m", "not a"),
    ("500ms", "bounds"),
    ("100d", "bounds"),
]


@pytest.mark.parametrize(("text", "reason"), BAD)
def test_bad_durations(text: str, reason: str) -> None:
    with pytest.raises(DiagnoseInputError, match=reason):
        parse_duration(text, "--window")


def test_urls() -> None:
    assert base_url(" http://gw:8000/ ", "--gateway") == "http://gw:8000"
    assert host_port("http://gw:8000") == "gw:8000" and host_port("https://gw") == "gw:443"
    for bad in ("gw:8000", "ftp://gw", "http://", "not a url"):
        with pytest.raises(DiagnoseInputError):
            base_url(bad, "--gateway")
