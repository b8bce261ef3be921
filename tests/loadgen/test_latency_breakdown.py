"""loadgen.latency_breakdown: TTFT split into the gateway's queue and the engine, from request log lines."""

from __future__ import annotations

import json
import math
from pathlib import Path

from loadgen.latency_breakdown import breakdown, read_request_lines


def line(
    rid: str, status: int = 200, ttft: float | None = 400.0, queued: float = 100.0, pred: float = 200.0
) -> str:
    return json.dumps(
        {
            "event": "request",
            "request_id": rid,
            "status": status,
            "ttft_ms": ttft,
            "queued_ms": queued,
            "predicted_ttft_ms": pred,
        }
    )


def test_the_log_is_read_by_request_id_and_other_lines_are_skipped(tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    log.write_text(
        "\n".join(
            [
                line("a"),
                '{"event":"gateway_ready"}',
                "[2026-12-01] Decode batch. #running-req: 3",  # the engine's own lines share the file
                '{"event":"request", broken',
                line("b", status=503, ttft=None),
            ]
        )
    )
    assert set(read_request_lines(log)) == {"a", "b"}
    assert read_request_lines(tmp_path / "missing.log") == {}


def test_queue_and_engine_shares_and_prediction_ratios_per_class() -> None:
    entries = {
        "i1": json.loads(line("i1", ttft=400.0, queued=100.0, pred=200.0)),  # engine 300, 2.0x predicted
        "i2": json.loads(line("i2", ttft=300.0, queued=0.0, pred=600.0)),  # engine 300, 0.5x
        "i3": json.loads(line("i3", ttft=900.0, queued=600.0, pred=0.0)),  # no prediction yet
        "i4": json.loads(line("i4", status=503, ttft=None)),  # shed: not served
        "b1": json.loads(line("b1", ttft=50.0, queued=10.0, pred=50.0)),
    }
    rows = {
        r["class"]: r
        for r in breakdown({"interactive": ["i1", "i2", "i3", "i4", "gone"], "batch": ["b1"]}, entries)
    }
    i = rows["interactive"]
    assert i["served"] == 3 and i["predicted"] == 2
    assert (i["queued_p50_ms"], i["queued_p99_ms"]) == (100.0, 600.0)
    assert (i["engine_p50_ms"], i["engine_p99_ms"]) == (300.0, 300.0)
    assert (i["measured_over_predicted_p50"], i["measured_over_predicted_p90"]) == (2.0, 2.0)
    assert i["above_prediction"] == 0.5
    b = rows["batch"]
    assert b["served"] == 1 and b["engine_p99_ms"] == 40.0 and b["above_prediction"] == 0.0


def test_a_class_with_nothing_served_reads_nan() -> None:
    (row,) = breakdown({"standard": ["x"]}, {})
    assert row["served"] == 0 and math.isnan(row["queued_p99_ms"]) and math.isnan(row["above_prediction"])
