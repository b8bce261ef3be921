"""loadgen.breakdown_share's arithmetic: the share of a request's TTFT its named phases explain, and the
summary over many (the run itself, ``python -m loadgen breakdown-share``: docs/observability.md)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from typer.testing import CliRunner

from loadgen.breakdown_share import TTFT_PHASES, ShareRun, summarize, ttft_share
from loadgen.cli import app
from service.observability.breakdown import TTFT_PHASES as GATEWAY_TTFT_PHASES


def line(ttft: float | None, status: int = 200, **phases: float) -> dict[str, Any]:
    return {"event": "request", "status": status, "ttft_ms": ttft, "phases_ms": phases}


def test_the_phases_are_the_gateway_s() -> None:
    assert TTFT_PHASES == GATEWAY_TTFT_PHASES


@pytest.mark.parametrize(
    ("entry", "share"),
    [
        (
            line(100.0, auth=1, prepare=2, queue=10, upstream_connect=1, engine_queue=20, engine_prefill=61),
            0.95,
        ),
        (
            line(50.0, engine_prefill=50, decode=400, client_write=3),
            1.0,
        ),  # after the first token: not counted
        (line(80.0), 0.0),  # nothing named
        (line(None, auth=1), None),  # no TTFT (a non-streamed answer from a worker without times)
        (line(0.0, auth=1), None),
        (line(100.0, status=429, auth=1), None),  # not served
        ({"status": 200, "ttft_ms": 10.0}, None),  # no phases
    ],
)
def test_a_request_s_share_is_its_ttft_phases_over_its_ttft(
    entry: dict[str, Any], share: float | None
) -> None:
    assert ttft_share(entry) == (None if share is None else pytest.approx(share))


def test_the_summary_takes_the_median_and_the_low_tail() -> None:
    # 100 requests: 98 explained at 0.99, one at 0.92 with the longest TTFT, one at 0.5
    entries = [line(100.0, engine_prefill=99.0) for _ in range(98)]
    entries += [line(1000.0, queue=500.0, engine_prefill=420.0), line(60.0, engine_prefill=30.0)]
    entries += [line(None, auth=1.0), line(100.0, status=503)]  # not counted
    s = summarize(entries)
    assert s.requests == 100
    assert s.share_p50 == pytest.approx(0.99)
    assert s.share_p99 == pytest.approx(0.92)  # the 1st percentile: 99 of 100 reach it
    assert s.share_min == pytest.approx(0.5)
    assert s.tail_share_p50 == pytest.approx(0.92)  # the request at or above the P99 TTFT (1000 ms)
    # outside the queue: 420 of 500 ms for the long one; the others have no queue
    assert s.beyond_queue_p50 == pytest.approx(0.99) and s.beyond_queue_p99 == pytest.approx(0.84)
    assert (s.ttft_p50_ms, s.ttft_p99_ms) == (100.0, 1000.0)
    assert s.unexplained_p50_ms == pytest.approx(1.0) and s.unexplained_p99_ms == pytest.approx(80.0)
    assert s.phase_mean_ms == {"queue": 5.0, "engine_prefill": pytest.approx((98 * 99 + 420 + 30) / 100)}
    assert s.meets_goal


def test_a_low_tail_misses_the_goal_and_nothing_reads_nan() -> None:
    low = summarize([line(100.0, engine_prefill=99.0)] * 90 + [line(100.0, engine_prefill=80.0)] * 10)
    assert low.share_p50 == pytest.approx(0.99) and low.share_p99 == pytest.approx(0.8)
    assert not low.meets_goal
    empty = summarize([])
    assert empty.requests == 0 and math.isnan(empty.share_p50) and not empty.meets_goal
    as_json = ShareRun(summary=empty).to_json()
    assert as_json["summary"]["share_p50"] is None  # JSON has no NaN
    assert "NaN" not in json.dumps(as_json)


def test_the_command_bounds_its_options() -> None:
    result = CliRunner().invoke(app, ["breakdown-share", "--load", "3"])
    assert result.exit_code == 2 and "--load" in result.output
