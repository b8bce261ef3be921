"""Measured rates and latencies (policies.estimates): pure, time injected."""

from __future__ import annotations

import math
import random

import pytest

from policies.estimates import DecayingEwma, DecayingRate, EstimateConfig, Ewma, WorkerEstimates
from policies.fair_queue import PriorityBands
from policies.windows import WindowConfig, WorkerWindow
from policies.worker_queue import WorkerQueue


@pytest.mark.parametrize(("rate", "tau"), [(1.0, 5.0), (50.0, 5.0), (200.0, 1.0)])
def test_decaying_rate_reads_a_steady_rate_from_the_start(rate: float, tau: float) -> None:
    r = DecayingRate(tau)
    t = 0.0
    for _ in range(int(rate * 3 * tau)):
        r.add(t)
        t += 1.0 / rate
        if t > 0.5 * tau:
            assert r.rate(t) == pytest.approx(rate, rel=0.15)


def test_decaying_rate_falls_when_events_stop_and_waits_for_history() -> None:
    r = DecayingRate(2.0, min_span_s=1.0)
    r.add(0.0)
    assert r.rate(0.5) is None  # less than min_span of history
    for k in range(1, 40):
        r.add(k * 0.1)
    busy = r.rate(4.0)
    # one time constant later: decayed by e^-1, with the warm-up correction 1 - e^(-elapsed / tau)
    later = busy * math.exp(-1.0) * (1 - math.exp(-2.0)) / (1 - math.exp(-3.0)) if busy else None
    assert r.rate(4.0 + 2.0) == pytest.approx(later, rel=1e-6)


def test_ewma_and_its_relaxation_towards_zero_without_samples() -> None:
    e = Ewma(0.5)
    assert [e.update(x) for x in (4.0, 0.0, 2.0)] == [4.0, 2.0, 2.0]
    d = DecayingEwma(0.5, tau_s=1.0)
    assert d.value(0.0) is None
    d.update(1.0, 10.0)
    assert d.value(10.0) == 1.0 and d.value(11.0) == pytest.approx(math.exp(-1.0))
    d.update(1.0, 11.0)  # continues from the relaxed value
    assert d.value(11.0) == pytest.approx((math.exp(-1.0) + 1.0) / 2)


def test_engine_ttft_model_separates_base_and_prefill() -> None:
    est = WorkerEstimates(EstimateConfig(ttft_alpha=1.0, long_prefill_tokens=1000))
    assert est.engine_ttft(5000, 0.0) == 0.0  # unknown: optimistic
    est.on_first_token(0.0, 0.04, 10)  # short: base 40 ms
    est.on_first_token(0.0, 0.54, 2000)  # long: (0.54 - 0.04) / 2000 = 0.25 ms per token
    assert est.engine_ttft(0, 0.0) == pytest.approx(0.04)
    assert est.engine_ttft(4000, 0.0) == pytest.approx(0.04 + 1.0)
    est.on_first_token(0.0, 0.04 + 0.25e-3 * 100 + 0.01, 100)  # short again: base excludes its prefill
    assert est.ttft_base.value(0.0) == pytest.approx(0.05)


def test_capacity_is_the_larger_of_measured_completions_and_littles_law() -> None:
    est = WorkerEstimates(EstimateConfig(rate_tau_s=2.0, min_history_s=1.0))
    assert est.capacity(0.0, 8) is None
    for k in range(40):
        est.on_done(k * 0.1, 2.0)  # 10/s measured, each 2 s long
    assert est.capacity(4.0, 8) == pytest.approx(10.0, rel=0.15)  # Little: 8 / 2 = 4 < measured
    assert est.capacity(4.0, 64) == pytest.approx(32.0, rel=0.05)  # a bigger window: 64 / 2


@pytest.mark.parametrize(
    ("rank", "higher_tokens_per_s", "expected_s"),
    [
        (0, 0.0, 0.54),  # nothing arrives above it: the engine model as it is
        (0, 1000.0, 0.54 / (1 - 0.25)),  # 1000 tokens/s x 0.25 ms/token: a quarter of the prefill time
        (0, 2000.0, 0.54 / (1 - 0.5)),
        (0, 10_000.0, 0.54 / (1 - 0.8)),  # capped
        (1, 1000.0, 0.54),  # the same class's arrivals queue behind it, not ahead
    ],
)
def test_engine_ttft_of_a_lower_class_counts_the_higher_classes_prefills_that_go_first(
    rank: int, higher_tokens_per_s: float, expected_s: float
) -> None:
    est = WorkerEstimates(EstimateConfig(ttft_alpha=1.0, long_prefill_tokens=1000, rate_tau_s=5.0))
    est.on_first_token(0.0, 0.04, 10)
    est.on_first_token(0.0, 0.54, 2000)
    queue = WorkerQueue("w", WorkerWindow(WindowConfig(mode="fixed", initial=8)), PriorityBands([]), est)
    for i in range(1, 2001):  # the 200 s before: a steady 10 requests/s of the higher class (rank 1)
        queue.count_arrival(1, i / 10 - 200, 5.0, round(higher_tokens_per_s / 10))
    assert queue.engine_ttft(2000, rank, 0.0) == pytest.approx(expected_s, rel=0.03)


@pytest.mark.parametrize(
    ("target", "late_by", "low", "high", "warm"),
    [
        (0.0, 2.0, 1.0, 1.0, True),  # off: predictions stay as the model makes them
        (
            0.95,
            1.0,
            1.0,
            1.0,
            True,
        ),  # an engine the model describes: goals met, scale 1
        (
            0.95,
            0.5,
            1.0,
            1.0,
            True,
        ),  # a model that predicts too long: never scaled down
        (
            0.95,
            2.0,
            1.75,
            2.05,
            True,
        ),  # first tokens at twice the prediction: 95% met at about 1.9
        (0.8, 2.0, 1.45, 1.8, True),  # a laxer target: 80% met at about 1.6
        (0.95, 10.0, 3.9, 4.0, True),  # at (never beyond) calibration_max
        (0.95, 2.0, 1.0, 1.0, False),  # misses of a cold start (capacity not yet measured) are not counted
    ],
)
def test_predictions_are_scaled_up_until_the_target_share_of_admitted_requests_meets_its_goal(
    target: float, late_by: float, low: float, high: float, warm: bool
) -> None:
    """Closed loop: the model's raw predictions are spread over [0, goal); admission lets in those whose
    scaled prediction is within the goal; their first tokens come ``late_by`` x the raw prediction. With
    a scale s the share that misses is 1 - s / late_by, so the scale settles where it is 1 - target."""
    est = WorkerEstimates(EstimateConfig(calibration_target=target, calibration_step=0.05))
    now = 0.0
    for now in range(1, 8 if warm else 3):  # completions for 6 s: capacity measured (min_history_s 5)
        est.on_done(float(now), 1.0)
    rng = random.Random(7)
    goal = 1.0
    for _ in range(20_000):
        raw = rng.uniform(0.0, goal)
        if raw * est.prediction_scale("interactive", now) <= goal:  # admitted as on time
            est.on_goal_outcome("interactive", late_by * raw <= goal, float(now))
    assert low <= est.prediction_scale("interactive", now) <= high
    assert est.prediction_scale("batch", now) == 1.0  # per class


def warm_estimates(**config: float) -> WorkerEstimates:
    """Estimates with calibration on and the capacity measured (completions from 1 s to 7 s)."""
    est = WorkerEstimates(EstimateConfig(calibration_target=0.99, **config))
    for now in range(1, 8):
        est.on_done(float(now), 1.0)
    return est


@pytest.mark.parametrize(
    ("decay_s", "after_s", "low", "high"),
    [
        (60.0, 0.0, 3.99, 4.0),  # just after the misses: at the cap
        (60.0, 60.0, 1.65, 1.67),  # one time constant: log 4 x e^-1
        (60.0, 300.0, 1.0, 1.01),  # five: about 1, though no request came to show its goals are met
        (0.0, 300.0, 3.99, 4.0),  # no decay: the scale waits for met goals
    ],
)
def test_a_scale_returns_toward_1_with_time(decay_s: float, after_s: float, low: float, high: float) -> None:
    est = warm_estimates(calibration_decay_s=decay_s)
    for _ in range(20):
        est.on_goal_outcome("interactive", False, 10.0)
    assert low <= est.prediction_scale("interactive", 10.0 + after_s) <= high
    # what GET /admin/workers lists: a scale back to about 1 is no longer shown
    assert bool(est.prediction_scales(10.0 + after_s)) == (high > 1.01)


def test_the_unbiased_prefill_cost_is_learned_from_slow_samples_far_apart() -> None:
    # nu12: ~3,000-token prefills 12 s apart on a CPU worker; the biased estimate settles near 5% of it
    est = WorkerEstimates()
    now = 0.0
    est.busy(now)
    for _ in range(10):
        now += 12.0
        est.on_first_token(now, 12.0, 3000)
    assert est.prefill_s(3000, now) == pytest.approx(12.0, rel=0.01)
    assert est.prefill_s(3000, now + 12.0) > 0.8 * 12.0  # still there when the next long prompt comes
    assert est.engine_ttft(3000, now) < 0.1 * 12.0  # admission's own, biased (kept: the routing experiment)


def test_a_request_given_up_before_its_first_token_teaches_a_lower_bound() -> None:
    est = WorkerEstimates()
    est.busy(0.0)
    assert est.prefill_s(3000, 0.0) == 0.0  # nothing learned: long prompts look free
    est.on_first_token_missing(12.0, 12.0, 3000)  # given up 12 s after dispatch, 3,000 tokens to prefill
    assert est.prefill_s(3000, 12.0) == pytest.approx(12.0)
    est.on_first_token_missing(13.0, 1.0, 3000)  # a bound below the estimate changes nothing
    assert est.prefill_s(3000, 13.0) == pytest.approx(12.0 * math.exp(-1.0 / 60.0))
    est.on_first_token_missing(14.0, 30.0, 500)  # short prefills are the base's, not the per-token cost's
    assert est.prefill_s(3000, 14.0) == pytest.approx(12.0 * math.exp(-2.0 / 60.0))


@pytest.mark.parametrize(("apart_s", "low"), [(0.02, 0.99), (1.0, 0.8), (3.0, 0.5)])
def test_the_top_class_base_reads_its_samples_mean_however_far_apart(apart_s: float, low: float) -> None:
    # a CPU worker's interactive first tokens (0.5 s each) about 1 s apart: the biased base reads 0.22x
    est = WorkerEstimates()
    now = 0.0
    est.busy(now)
    for _ in range(200):
        now += apart_s
        est.on_first_token(now, 0.5, 40)
    assert est.engine_ttft(0, now, unbiased_base=True) == pytest.approx(0.5)
    # read just before the next sample: only the relaxation since the last one (5 s time constant)
    assert low * 0.5 < est.engine_ttft(40, now + apart_s, unbiased_base=True) <= 0.5
    # the other classes' base keeps DecayingEwma's bias (see WorkerEstimates.top_ttft_base)
    alpha, decay = 0.05, math.exp(-apart_s / 5.0)
    biased = 0.5 * alpha / (1 - (1 - alpha) * decay)
    assert est.base_ttft(now) == pytest.approx(biased, rel=0.01)
