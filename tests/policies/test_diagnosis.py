"""policies/diagnosis.py: each cause, from a healthy fleet's window with one thing changed, is the one named
first; a healthy window names none; consequences rank after their roots; what limits a judgement is said
(table-driven, no I/O)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from policies.diagnosis import diagnose
from policies.diagnosis_types import Cause, FleetView, GatewayView, Latency, Thresholds, WorkerView

MS = 0.001


def lat(
    mean_ms: float, count: float = 100, p99_ms: float | None = None, p50_ms: float | None = None
) -> Latency:
    """A latency of ``count`` observations around ``mean_ms``."""
    return Latency(count, mean_ms * MS, (p50_ms or mean_ms) * MS, (p99_ms or 2 * mean_ms) * MS)


def worker(name: str, **changes: Any) -> WorkerView:
    """A healthy 70B-on-H100 worker over a 2 s window: 30 requests of ~1,800 prompt tokens, 90% cached."""
    base = WorkerView(
        name=name,
        ttft=lat(30, 30),
        itl=lat(13, 450),
        e2e=lat(230, 30),
        running=3.0,
        queued=0.1,
        kv_usage=0.01,
        prompt_tokens=54_000,
        cached_tokens=48_600,
        generated_tokens=480,
        requests=30,
        healthy=1.0,
        sm_active=0.6,
        dram_active=0.6,
    )
    return replace(base, **changes)


PHASES = {
    "auth": lat(0.2),
    "prepare": lat(1),
    "quota": lat(4),
    "route": lat(0.1),
    "queue": lat(0.05),
    "upstream_connect": lat(4),
    "decode": lat(200),
    "client_write": lat(0.1),
}


def gateway(phases: dict[str, Latency] | None = None, **changes: Any) -> GatewayView:
    """The gateway of that window: 90 requests of 16 tokens, TTFT 45 ms (30 of it the engine's)."""
    base = GatewayView(
        ttft=lat(45, 90),
        tpot=lat(13.5, 90),
        itl=lat(13.5, 1350),
        e2e=lat(250, 90),
        phases={**PHASES, **(phases or {})},
        overhead=lat(7, 90),
        loop_lag=lat(1, 40),
        store_calls={"QuotaLimiter.reserve": lat(3, 90), "QuotaLimiter.settle": lat(5, 90)},
        served=90,
        prompt_tokens=162_000,
        cached_tokens=145_800,
        completion_tokens=1440,
        queue_depth=0.0,
    )
    return replace(base, **changes)


NAMES = ("w0:30000", "w1:30000", "w2:30000")


def fleet(gw: GatewayView | None = None, **per_worker: dict[str, Any]) -> FleetView:
    """A window of the gateway and three workers; ``w0=dict(...)`` changes worker w0, ``all=...`` each."""
    every = per_worker.get("all", {})
    workers = tuple(worker(n, **{**every, **per_worker.get(n.split(":")[0], {})}) for n in NAMES)
    return FleetView(2.0, gw or gateway(), workers)


BASELINE = FleetView(
    0.0,
    gateway(ttft=lat(45, 900), e2e=lat(250, 900)),
    tuple(worker(n, ttft=lat(30, 300), itl=lat(13, 4500), e2e=lat(230, 300), requests=300) for n in NAMES),
)


def slow_engine(ttft_ms: float, itl_ms: float = 13) -> dict[str, Any]:
    return {"ttft": lat(ttft_ms, 30, p50_ms=ttft_ms), "itl": lat(itl_ms, 450, p50_ms=itl_ms)}


CASES: list[tuple[str, Callable[[], FleetView], Cause | None]] = [
    ("healthy", lambda: fleet(), None),
    (
        "300 ms on the wire",
        lambda: fleet(gateway({"upstream_connect": lat(304)}, ttft=lat(345, 90), e2e=lat(550, 90))),
        "network",
    ),
    (
        "a slow link: every chunk 20 ms late",
        lambda: fleet(gateway(tpot=lat(33.5, 90), e2e=lat(550, 90))),
        "network",
    ),
    (
        "the gateway's event loop lags",
        lambda: fleet(gateway(loop_lag=lat(120, 40), ttft=lat(170, 90), overhead=lat(130, 90))),
        "gateway",
    ),
    (
        "slow clients",
        lambda: fleet(gateway({"client_write": lat(400)}, e2e=lat(650, 90))),
        "client",
    ),
    (
        "Redis 100 ms slower",
        lambda: fleet(
            gateway(
                {"quota": lat(205)},
                ttft=lat(246, 90),
                overhead=lat(208, 90),
                store_calls={"QuotaLimiter.reserve": lat(204, 90)},
            )
        ),
        "quota_store",
    ),
    (
        "more clients than the windows hold",
        lambda: fleet(gateway({"queue": lat(300)}, ttft=lat(345, 90), queue_depth=12.0)),
        "queueing",
    ),
    (
        "a prefill 8x slower",
        lambda: fleet(gateway(ttft=lat(255, 90)), all={**slow_engine(240), "queued": 0.2}),
        "prefill",
    ),
    (
        "decode 4x slower",
        lambda: fleet(gateway(tpot=lat(54, 90), e2e=lat(860, 90)), all=slow_engine(40, 52)),
        "decode",
    ),
    (
        "the KV pool full, requests retracted",
        lambda: fleet(
            gateway(ttft=lat(400, 90)),
            all={**slow_engine(380), "kv_usage": 0.99, "retractions": 6.0, "queued": 2.0},
        ),
        "retraction",
    ),
    (
        "one worker 6x slower",
        lambda: fleet(
            gateway(ttft=lat(100, 90), e2e=lat(500, 90)),
            w0={**slow_engine(180, 80), "e2e": lat(1400, 5), "requests": 5},
        ),
        "worker",
    ),
    (
        "one worker answers 500",
        lambda: fleet(gateway({"retry": lat(60)}), w1={"errors": 20.0, "healthy": 0.0}),
        "worker",
    ),
]


@pytest.mark.parametrize(("name", "window", "expected"), CASES, ids=[c[0] for c in CASES])
def test_the_cause_is_named_first(name: str, window: Callable[[], FleetView], expected: Cause | None) -> None:
    d = diagnose(window(), BASELINE)
    assert d.notes == ()
    if expected is None:
        assert d.verdicts == (), d.verdicts
        assert {v.cause for v in d.rejected} >= {"network", "prefill", "decode", "queueing", "quota_store"}
        return
    first = d.verdicts[0]
    assert (first.cause, first.consequence_of) == (expected, None), [(v.cause, v.score) for v in d.verdicts]
    assert 0.15 <= first.score <= 1 and first.evidence
    assert d.ttft_p99 is not None and d.served == 90


def test_the_worker_it_names_and_the_fleet_causes_judged_without_it() -> None:
    window = fleet(w0={**slow_engine(180, 80), "e2e": lat(1400, 5), "requests": 5})
    d = diagnose(window, BASELINE)
    assert [(v.cause, v.worker) for v in d.verdicts] == [("worker", "w0:30000")]
    assert d.verdicts[0].summary.startswith("its engine is 6.2x slower")  # ITL 80 / 13 ms
    # the other two are the typical worker: neither prefill nor decode looks slow
    assert {"prefill", "decode"} <= {v.cause for v in d.rejected}


def test_a_queue_beside_a_slower_service_is_its_consequence() -> None:
    window = fleet(gateway({"queue": lat(200)}, ttft=lat(450, 90)), all=slow_engine(240))
    d = diagnose(window, BASELINE)
    assert [(v.cause, v.consequence_of) for v in d.verdicts] == [("prefill", None), ("queueing", "prefill")]
    # alone, the same queue is the cause
    alone = diagnose(fleet(gateway({"queue": lat(200)}, ttft=lat(245, 90))), BASELINE)
    assert [(v.cause, v.consequence_of) for v in alone.verdicts] == [("queueing", None)]


def test_a_full_kv_pool_explains_the_prefill_and_the_queue() -> None:
    window = fleet(gateway(ttft=lat(400, 90)), all={**slow_engine(380), "kv_usage": 0.99, "queued": 3.0})
    d = diagnose(window, BASELINE)
    assert d.verdicts[0].cause == "retraction"
    assert {v.cause: v.consequence_of for v in d.verdicts[1:]} == {
        "prefill": "retraction",
        "queueing": "retraction",
    }
    # the same window with room in the pool is a prefill
    roomy = diagnose(
        replace(window, workers=tuple(replace(w, kv_usage=0.5) for w in window.workers)), BASELINE
    )
    assert roomy.verdicts[0].cause == "prefill"


def test_a_hot_spot_is_told_from_a_slower_prefill_by_the_hit_rate() -> None:
    hot = fleet(gateway(ttft=lat(255, 90)), all={**slow_engine(240), "cached_tokens": 0.0})
    slow = fleet(gateway(ttft=lat(255, 90)), all=slow_engine(240))
    assert (
        diagnose(hot, BASELINE)
        .verdicts[0]
        .summary.startswith("the prefix cache hit rate fell from 90% to 0%")
    )
    assert "each prompt token costs more" in diagnose(slow, BASELINE).verdicts[0].summary


def test_the_decode_wait_of_a_new_request_is_not_blamed_on_prefill() -> None:
    """A decode 4x slower makes a new request wait a longer step before its prefill: decode, not prefill."""
    d = diagnose(fleet(gateway(tpot=lat(54, 90), e2e=lat(860, 90)), all=slow_engine(75, 52)), BASELINE)
    assert [v.cause for v in d.verdicts] == ["decode"]


@pytest.mark.parametrize(
    ("baseline", "note"),
    [
        (None, "no baseline of the engines' latency"),
        (
            replace(BASELINE, workers=tuple(replace(w, ttft=lat(30, 5)) for w in BASELINE.workers)),
            "no baseline",
        ),
    ],
)
def test_without_a_baseline_engine_slowdowns_are_not_judged(baseline: FleetView | None, note: str) -> None:
    d = diagnose(fleet(gateway(ttft=lat(255, 90)), all=slow_engine(240)), baseline)
    assert d.verdicts == () and any(n.startswith(note) for n in d.notes)
    # what needs no baseline still is: a network delay
    net = diagnose(fleet(gateway({"upstream_connect": lat(304)}, ttft=lat(345, 90))), baseline)
    assert net.verdicts[0].cause == "network"


def test_an_empty_window_names_nothing_and_says_why() -> None:
    empty = FleetView(2.0, GatewayView(), tuple(WorkerView(n) for n in NAMES))
    d = diagnose(empty, BASELINE)
    assert d.verdicts == () and d.served == 0
    assert any("no request was served" in n for n in d.notes)
    assert any("no engine series" in n for n in d.notes)


def test_the_thresholds_decide() -> None:
    window = fleet(gateway({"queue": lat(60)}, ttft=lat(105, 90)))  # 60 ms of a 105 ms TTFT
    assert [v.cause for v in diagnose(window, BASELINE).verdicts] == ["queueing"]
    assert diagnose(window, BASELINE, Thresholds(min_excess_s=0.07)).verdicts == ()
    assert diagnose(window, BASELINE, Thresholds(min_share=0.6)).verdicts == ()


def test_causes_rank_by_score() -> None:
    both = fleet(
        gateway(
            {"upstream_connect": lat(104), "quota": lat(305)},
            ttft=lat(445, 90),
            store_calls={"QuotaLimiter.reserve": lat(304, 90)},
        )
    )
    d = diagnose(both, BASELINE)
    assert [v.cause for v in d.verdicts] == ["quota_store", "network"]
    assert d.verdicts[0].score > d.verdicts[1].score


def test_a_worker_out_of_rotation_scores_the_capacity_it_took_away() -> None:
    idle = {"healthy": 0.0, "requests": 0.0, "ttft": Latency(), "itl": Latency(), "e2e": Latency()}
    d = diagnose(fleet(w2=idle), BASELINE)
    assert [(v.cause, v.worker) for v in d.verdicts] == [("worker", "w2:30000")]
    assert d.verdicts[0].score == pytest.approx(1 / 3, abs=1e-4)
    assert d.verdicts[0].summary == "0% of the gateway's calls to it failed; it is out of rotation"
