"""service.observability.breakdown: a request's phases, its TTFT share, TPOT, ITL and Server-Timing."""

from __future__ import annotations

import itertools

import pytest
from prometheus_client import CollectorRegistry, Histogram

from service.observability.breakdown import RequestTiming, engine_phases, parse_server_timing
from service.observability.buckets import SLO_BUCKETS_S, observe_tally

SGLANG_META = {  # the fields SGLang 0.5.23 reports with --enable-metrics (req_time_stats.py)
    "request_received_ts": 1000.000,
    "api_server_dispatch_finish_ts": 1000.002,
    "queue_time": 0.010,
    "forward_entry_time": 1000.012,
    "prefill_finished_time": 1000.052,
    "first_token_latency": 0.060,
    "e2e_latency": 0.260,
    "num_retractions": 1,
}


@pytest.mark.parametrize(
    ("meta", "expected"),
    [
        (SGLANG_META, {"engine_tokenize": 0.002, "engine_queue": 0.010, "engine_prefill": 0.040}),
        ({"queue_time": 0.5}, {"engine_queue": 0.5}),
        ({"forward_entry_time": 5.0, "prefill_finished_time": 4.0}, {}),  # out of order: unknown
        ({"queue_time": -1, "request_received_ts": True}, {}),  # not a time
        ({}, {}),
    ],
)
def test_engine_phases_read_only_well_formed_times(
    meta: dict[str, object], expected: dict[str, float]
) -> None:
    assert engine_phases(meta) == pytest.approx(expected)


def test_a_stream_s_phases_explain_its_ttft_and_give_tpot_and_itl() -> None:
    t = RequestTiming(start=10.0)
    t.mark("auth", 10.001)
    t.mark("prepare", 10.003)
    t.mark("quota", 10.004)
    t.queued(0.0005, 0.0995)  # route, queue: to 10.104
    t.attempt(10.104)
    t.headers(10.105)
    t.first_chunk(10.160, {k: v for k, v in SGLANG_META.items() if k != "request_received_ts"})
    for i in range(1, 5):
        t.token(10.160 + 0.02 * i)
    t.stream_ended(10.240, SGLANG_META)
    t.wrote(0.003)
    t.finish()
    assert t.ttft_s == pytest.approx(0.160)
    p = t.phases
    assert p["upstream_connect"] == pytest.approx(0.001)
    assert p["decode"] == pytest.approx(0.080) and p["client_write"] == pytest.approx(0.003)
    assert p["engine_tokenize"] == pytest.approx(0.002)  # from the last chunk: SGLang sends it there
    # 1+2+1+0.5+99.5+1 gateway ms + 2+10+40 engine ms of 160 ms
    assert t.ttft_share() == pytest.approx(157 / 160)
    assert t.tpot_s(5) == pytest.approx(0.020) and t.itl_mean_s() == pytest.approx(0.020)
    assert t.retractions == 1
    tally = t.gap_tally()
    assert tally is not None and sum(tally[0]) == 4 and tally[1] == pytest.approx(0.080)
    # overhead: e2e 0.243 minus queue 0.0995, the attempt 10.104..10.240 and the client's 3 ms
    assert t.overhead_s(0.243) == pytest.approx(0.243 - 0.0995 - 0.136 - 0.003)
    header = parse_server_timing(t.server_timing())
    assert header["ttft"] == pytest.approx(160.0) and header["queue"] == pytest.approx(99.5)
    assert list(header)[:3] == ["auth", "prepare", "quota"]


@pytest.mark.parametrize("streamed", [True, False])
def test_a_request_ended_while_the_worker_had_it_counts_no_worker_time_as_overhead(streamed: bool) -> None:
    # a client that leaves 2 s into its answer (also a revoked key, a stream cut at shutdown): the answer
    # never ended, so the worker's span runs to the request's end, not to nothing
    t = RequestTiming(start=0.0)
    t.mark("auth", 0.001)
    t.mark("prepare", 0.003)
    t.queued(0.0005, 0.0015)  # to 0.005
    t.attempt(0.006)
    if streamed:
        t.headers(0.007)
        t.first_chunk(0.250, {})
        t.token(0.270)
    t.finish()
    assert t.upstream_end is None
    assert t.overhead_s(2.0) == pytest.approx(0.006 - 0.0015)  # what came before the attempt, less the queue
    # and an attempt never made: everything but the queue is the gateway's
    u = RequestTiming(start=0.0)
    u.queued(0.0005, 0.5)
    assert u.overhead_s(0.6) == pytest.approx(0.1)


def test_a_non_streamed_answer_s_ttft_is_the_worker_s_first_token_or_unknown() -> None:
    t = RequestTiming(start=0.0)
    t.attempt(0.050)
    t.answered(0.320, SGLANG_META)
    assert t.ttft_s == pytest.approx(0.110) and t.phases["decode"] == pytest.approx(0.200)
    bare = RequestTiming(start=0.0)
    bare.attempt(0.050)
    bare.answered(0.320, {"prompt_tokens": 3})  # a worker without --enable-metrics
    assert bare.ttft_s is None and "decode" not in bare.phases
    late = RequestTiming(start=0.0)
    late.attempt(0.050)
    late.answered(0.080, SGLANG_META)  # a latency that does not fit before the answer: not believed
    assert late.ttft_s is None


def test_retries_count_from_the_first_attempt_and_resumes_change_nothing() -> None:
    t = RequestTiming(start=0.0)
    t.attempt(0.010)
    t.attempt(0.060)  # the first attempt failed; this one answers
    t.headers(0.061)
    t.first_chunk(0.100, None)
    t.attempt(0.500)  # a resume after the first token
    assert t.phases["retry"] == pytest.approx(0.050) and t.phases["upstream_connect"] == pytest.approx(0.001)
    assert t.attempt_at == pytest.approx(0.060)


@pytest.mark.parametrize("bad", ["", "a b;dur=1", "x;dur=fast"])
def test_server_timing_parse_refuses_malformed_entries(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_server_timing(bad)


def test_a_streams_gap_tally_adds_what_observing_each_gap_adds() -> None:
    gaps = [0.0005, 0.004, 0.004, 0.03, 0.2, 150.0, 0.01]
    t = RequestTiming(start=0.0)
    t.first_chunk(1.0, None)
    times = [1.0]
    for gap in gaps:
        times.append(times[-1] + gap)
        t.token(times[-1])
    gaps = [b - a for a, b in itertools.pairwise(times)]  # as the clock gives them
    tally = t.gap_tally()
    assert tally is not None
    registry = CollectorRegistry()
    bulk = Histogram("bulk_seconds", "", buckets=SLO_BUCKETS_S, registry=registry)
    each = Histogram("each_seconds", "", buckets=SLO_BUCKETS_S, registry=registry)
    observe_tally(bulk, *tally)
    for gap in gaps:
        each.observe(gap)
    samples = {
        m.name: {(s.name.replace(m.name, ""), tuple(s.labels.items())): s.value for s in m.samples}
        for m in registry.collect()
    }
    assert samples["bulk_seconds"] == pytest.approx(samples["each_seconds"])
