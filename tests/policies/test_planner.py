"""Desired workers of a model's pool (policies.planner): pure, time injected, table-driven."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from policies.forecast import ForecastConfig
from policies.planner import (
    ClassDemand,
    EngineModel,
    Planner,
    PlannerConfig,
    PlannerInputs,
    batch_limit,
    worker_seconds,
)

# a forecast that follows the last sample at once and keeps no trend: the hysteresis is then alone
INSTANT = ForecastConfig(median_samples=1, level_tau_s=1e-6, trend_tau_s=1e9)
# one request of 100 output tokens costs 1 s of a worker (a = 0.1 s per step of 10): capacity 1 request/s
FLAT = EngineModel(step_base_s=0.1, step_per_seq_s=0.0, prefill_s_per_token=0.0, max_batch=10)


def _inputs(
    rps: float, workers: int = 1, queued: int = 0, engine: EngineModel | None = FLAT
) -> PlannerInputs:
    return PlannerInputs(workers, {"standard": ClassDemand(rps, 100.0, 100.0, queued, 10.0)}, engine)


def _config(**kw: float) -> PlannerConfig:
    base = {
        "interval_s": 10.0,
        "cold_start_s": 0.0,
        "scale_down_window_s": 0.0,
        "forecast": INSTANT,
        "scale_up_z": 0.0,  # the noise band off: the hysteresis alone
        "scale_down_z": 0.0,
    }
    return PlannerConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_worker_seconds_adds_the_uncached_prefill_and_each_tokens_share_of_a_step() -> None:
    engine = EngineModel(0.01, 0.001, 0.0001, 64, cache_hit_rate=0.5)
    demand = ClassDemand(1.0, 1000.0, 100.0, 0, 1.0)
    # prefill 1000 x 0.5 x 0.1 ms = 0.05 s; decode 100 x (10 ms + 10 x 1 ms) / 10 = 0.2 s
    assert worker_seconds(engine, demand, 10.0) == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("engine", "goal_s", "rps", "expected"),
    [
        (EngineModel(0.01, 0.001, 0.0001, 8), 10.0, 1.0, 8.0),  # the window
        (EngineModel(0.01, 0.001, 0.0001, 512, batch=10.0, kv_usage=0.5), 10.0, 1.0, 16.0),  # KV to 0.8
        # the goal: 0.5 x 1 s - 0.1 s of prefill = 0.4 s for two steps: (0.2 - 0.01) / 0.001 = 190
        (EngineModel(0.01, 0.001, 0.0001, 512), 1.0, 1.0, 190.0),
        (EngineModel(0.01, 0.001, 0.0001, 512), 1.0, 0.0, 512.0),  # an idle class does not limit
        (EngineModel(0.01, 0.001, 0.0001, 512), 0.05, 1.0, 1.0),  # an unreachable goal: at least 1
    ],
)
def test_batch_limit(engine: EngineModel, goal_s: float, rps: float, expected: float) -> None:
    classes = {"c": ClassDemand(rps, 1000.0, 100.0, 0, goal_s)}
    assert batch_limit(engine, classes, PlannerConfig()) == pytest.approx(expected)


def test_from_capacity_gives_back_the_measured_capacity_at_the_measured_length() -> None:
    engine = EngineModel.from_capacity(capacity_rps=4.0, window=32, output_tokens=200.0)
    demand = ClassDemand(1.0, 500.0, 200.0, 0, 1.0)
    batch = batch_limit(engine, {"c": demand}, PlannerConfig())
    assert batch == 32.0
    assert worker_seconds(engine, demand, batch) == pytest.approx(0.25)
    longer = ClassDemand(1.0, 500.0, 400.0, 0, 1.0)
    assert worker_seconds(engine, longer, batch) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        EngineModel.from_capacity(0.0, 32, 200.0)


@pytest.mark.parametrize(
    ("rps", "queued", "expected"),
    [
        (4.5, 0, 5),  # need 4.5 workers / 0.9 = 5
        (4.6, 0, 6),  # 5.11 -> 6
        (0.0, 0, 1),  # the floor
        (1000.0, 0, 64),  # the ceiling
        (4.5, 9, 6),  # 9 queued within a 10 s goal: 0.9 more workers -> 5.4 / 0.9 = 6
    ],
)
def test_a_first_decision_is_the_demand_over_the_target_utilization(
    rps: float, queued: int, expected: int
) -> None:
    planner = Planner(_config(), initial=1)
    assert planner.decide(_inputs(rps, queued=queued), 10.0).desired == expected


@pytest.mark.parametrize(("rps", "reason"), [(0.0, "floor"), (1000.0, "ceiling"), (4.5, "up")])
def test_reasons_at_the_bounds(rps: float, reason: str) -> None:
    planner = Planner(_config(min_workers=2, max_workers=8), initial=3)
    assert planner.decide(_inputs(rps), 10.0).reason == reason


def test_up_at_once_down_only_after_the_scale_down_window() -> None:
    planner = Planner(_config(scale_down_window_s=120.0), initial=1)
    assert planner.decide(_inputs(8.0), 10.0).desired == 9  # 1 -> 9 in one call
    t, trail = 10.0, []
    while t < 300.0:
        t += 10.0
        trail.append((t, planner.decide(_inputs(0.5), t)))
    down_at = next(at for at, d in trail if d.desired < 9)
    assert down_at == 140.0  # the raw 9 of t = 10 leaves the 120 s window at t = 140
    assert all(d.reason == "stabilizing" for at, d in trail if at < down_at)
    assert trail[-1][1].desired == 1


@pytest.mark.parametrize(
    ("rps", "expected", "reason"),
    [
        # 0.85 workers of need: raw 1, but one worker would then run at 85% > 0.9 x 0.9: keep 2
        (0.85, 2, "stabilizing"),
        (0.80, 1, "down"),  # 80% <= 81%: remove one
        (1.5, 2, "hold"),
    ],
)
def test_the_load_is_projected_onto_n_minus_1_before_removing_one(
    rps: float, expected: int, reason: str
) -> None:
    planner = Planner(_config(min_workers=0), initial=2)  # no floor: the projection alone
    d = planner.decide(_inputs(rps, workers=2), 10.0)
    assert (d.desired, d.reason) == (expected, reason)


@pytest.mark.parametrize(
    ("margin", "window_s", "most_changes"),
    [
        (0.9, 60.0, 1),  # the planner: one step up, then stays
        (0.9, 0.0, 1),  # the N-1 projection alone holds it: 0.84 on one worker > 0.81
        (1.0, 0.0, 20),  # neither: 2 -> 1 -> 2 every 30 s (the flap Dynamo's PR #9294 fixed)
    ],
)
def test_demand_around_a_boundary_does_not_flap_between_two_and_one(
    margin: float, window_s: float, most_changes: int
) -> None:
    planner = Planner(_config(scale_down_window_s=window_s, scale_down_margin=margin), initial=1)
    desired = [1]
    for k in range(120):
        rps = 0.95 if k % 6 < 3 else 0.84  # raw 2 (0.95 / 0.9 > 1), then raw 1, every 30 s
        desired.append(planner.decide(_inputs(rps, workers=planner.desired), 10.0 * (k + 1)).desired)
    changes = sum(1 for a, b in itertools.pairwise(desired) if a != b)
    if most_changes == 1:
        assert changes == 1 and desired[-1] == 2
    else:
        assert changes >= most_changes


def test_without_a_measured_engine_it_holds_what_runs() -> None:
    planner = Planner(_config(), initial=2)
    d = planner.decide(_inputs(50.0, workers=3, engine=None), 10.0)
    assert (d.desired, d.reason, d.batch) == (3, "unmeasured", None)


# one request of 100 output tokens costs 0.1 s of a worker: capacity 10 requests/s
FAST = EngineModel(step_base_s=0.01, step_per_seq_s=0.0, prefill_s_per_token=0.0, max_batch=10)


@pytest.mark.parametrize(
    ("start", "slope", "engine", "forecast"),
    [
        # 20 -> 99 requests/s: each 90 s the rate rises 9 requests/s, 5 standard errors of the counts
        (20.0, 0.1, FAST, True),
        # 2 -> 3.6 requests/s: 0.36 requests/s between the medians of two 3-minute windows is 1.5
        # standard errors of 10 s counts at 3.5 requests/s (Poisson): within the noise, not extrapolated
        (2.0, 0.002, FLAT, False),
    ],
)
def test_the_forecast_asks_for_workers_a_cold_start_ahead_of_a_ramp_beyond_the_noise(
    start: float, slope: float, engine: EngineModel, forecast: bool
) -> None:
    ahead = Planner(PlannerConfig(cold_start_s=300.0, scale_down_window_s=0.0), initial=1)
    now_only = Planner(PlannerConfig(cold_start_s=0.0, interval_s=10.0, scale_down_window_s=0.0), initial=1)
    for k in range(1, 80):
        rps = start + slope * 10.0 * k
        a = ahead.decide(_inputs(rps, engine=engine), 10.0 * k)
        b = now_only.decide(_inputs(rps, engine=engine), 10.0 * k)
    w = worker_seconds(engine, ClassDemand(1.0, 100.0, 100.0, 0, 10.0), 10.0)
    if not forecast:
        assert a.needed_forecast == a.needed_now and a.desired == b.desired
        return
    assert a.needed_forecast > a.needed_now
    assert a.desired > b.desired
    # the forecast is not the fitted trend extrapolated blindly: it is within the next 300 s of the ramp
    assert a.needed_forecast < (start + slope * (790.0 + 310.0)) * w


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_workers": -1},
        {"max_workers": 0},
        {"min_workers": 5, "max_workers": 4},
        {"interval_s": 0.0},
        {"target_utilization": 0.0},
        {"scale_down_margin": 1.5},
        {"kv_target": 0.0},
        {"queue_median_samples": 0},
    ],
)
def test_bad_configs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PlannerConfig(**kwargs)  # type: ignore[arg-type]


def test_the_decision_reports_each_classes_part() -> None:
    planner = Planner(_config(), initial=1)
    inputs = PlannerInputs(
        1,
        {
            "interactive": ClassDemand(2.0, 100.0, 100.0, 0, 1.0),
            "batch": ClassDemand(1.0, 100.0, 300.0, 0, 60.0),
        },
        FLAT,
    )
    d = planner.decide(inputs, 10.0)
    assert d.classes["interactive"].worker_s == pytest.approx(1.0)
    assert d.classes["batch"].capacity_rps == pytest.approx(1.0 / 3.0)
    assert d.needed_now == pytest.approx(5.0) and d.desired == math.ceil(5.0 / 0.9)
    assert d.projected_utilization == pytest.approx(5.0 / 6)


@pytest.mark.parametrize(
    ("queues", "expected"),
    [
        ([0, 0, 0, 0, 45], 5),  # a one-interval queue (a burst admission sheds or drains): ignored
        ([0, 0, 0, 45, 45], 5),  # two of five: still under the median
        ([0, 0, 45, 45, 45], 10),  # three of five: a persistent queue, 45 within 10 s -> 4.5 more workers
    ],
)
def test_only_a_queue_that_persists_over_half_the_median_window_asks_for_workers(
    queues: list[int], expected: int
) -> None:
    cfg = _config(forecast=ForecastConfig(median_samples=5, level_tau_s=1e-6, trend_tau_s=1e9))
    planner = Planner(cfg, initial=5)
    for k, q in enumerate(queues):
        d = planner.decide(_inputs(4.5, workers=5, queued=q), 10.0 * (k + 1))
    assert d.desired == expected


@pytest.mark.parametrize(
    ("queue_samples", "queues", "expected"),
    [
        (None, [0, 0, 45, 45, 45], 10),  # the forecast's 5 samples: three of five persist
        (9, [0, 0, 0, 0, 0, 45, 45, 45, 45], 5),  # its own 9 (the rates' 5): four of nine do not
        (9, [0, 0, 0, 0, 45, 45, 45, 45, 45], 10),  # five of nine do
        (1, [0, 0, 0, 0, 45], 10),  # one sample: every queue counts at once
    ],
)
def test_the_queue_term_has_its_own_median_when_set(
    queue_samples: int | None, queues: list[int], expected: int
) -> None:
    forecast = ForecastConfig(median_samples=5, level_tau_s=1e-6, trend_tau_s=1e9)
    planner = Planner(_config(forecast=forecast, queue_median_samples=queue_samples), initial=5)
    for k, q in enumerate(queues):
        d = planner.decide(_inputs(4.5, workers=5, queued=q), 10.0 * (k + 1))
    assert d.desired == expected


@pytest.mark.parametrize(
    ("workers", "rps", "margin", "expected"),
    [
        (50, 40.0, 0.9, 46),  # raw 45; the relative band would hold 50 (40 / 0.81): one worker above raw
        (46, 40.0, 0.9, 46),
        (46, 39.0, 0.9, 45),  # raw 44 (39 / 0.9 = 43.3): the band keeps 45 (not 49 = ceil(39 / 0.81))
        (2, 0.85, 0.9, 2),  # the 2 <-> 1 boundary keeps its band
        (50, 40.0, 1.0, 45),  # no margin: down to raw
    ],
)
def test_the_dead_band_is_one_worker_above_raw_at_most(
    workers: int, rps: float, margin: float, expected: int
) -> None:
    planner = Planner(_config(min_workers=0, scale_down_margin=margin), initial=workers)
    assert planner.decide(_inputs(rps, workers=workers), 10.0).desired == expected


@pytest.mark.parametrize(
    ("window_s", "initial", "first", "down_at"),
    [
        (120.0, 5, 5, 140.0),  # holds what runs: the start (t = 10) leaves the 120 s window at t = 140
        (0.0, 5, 1, 10.0),  # no window: nothing holds it
        (120.0, None, 1, 10.0),  # no workers told: the floor at once (min_workers 1)
    ],
)
def test_a_starting_planner_holds_the_workers_that_run_for_a_scale_down_window(
    window_s: float, initial: int | None, first: int, down_at: float
) -> None:
    planner = Planner(_config(scale_down_window_s=window_s), initial=initial)
    decisions = [(t, planner.decide(_inputs(0.0, workers=5), t)) for t in (10.0 * k for k in range(1, 20))]
    assert decisions[0][1].desired == first
    assert next(t for t, d in decisions if d.desired == 1) == down_at
    assert all(d.reason == "stabilizing" for t, d in decisions if t < down_at)


def _reversals(series: list[int]) -> int:
    changes, direction = 0, 0
    for a, b in itertools.pairwise(series):
        if a != b:
            step = 1 if b > a else -1
            changes += direction != 0 and step != direction
            direction = step
    return changes


@pytest.mark.parametrize("rate", [6.0, 60.0])
@pytest.mark.parametrize(
    ("noise_band", "trend_z", "most", "least"),
    [
        ((2.0, 2.0), 2.0, 2, 0),  # the defaults: at most 2 reversals in 2 hours
        ((0.0, 0.0), 0.0, None, 30),  # neither the noise band nor the trend's evidence: 30 or more
    ],
)
def test_a_steady_poisson_rate_does_not_flap(
    rate: float, noise_band: tuple[float, float], trend_z: float, most: int | None, least: int
) -> None:
    """Two hours of 10 s decisions at a steady Poisson rate (1 request/s per worker: the need is the rate
    near a boundary of ``ceil(need / 0.9)``): the decision's reversals, with and without the noise band
    and the trend weighed by its evidence."""
    rng = random.Random(5)
    up_z, down_z = noise_band
    config = PlannerConfig(
        scale_up_z=up_z, scale_down_z=down_z, max_workers=200, forecast=ForecastConfig(trend_z=trend_z)
    )
    planner = Planner(config, initial=round(rate / 0.9))
    desired = []
    for k in range(1, 721):
        measured = max(0.0, rng.gauss(rate * 10.0, (rate * 10.0) ** 0.5) / 10.0)
        desired.append(planner.decide(_inputs(measured, workers=planner.desired), 10.0 * k).desired)
    assert _reversals(desired) >= least
    if most is not None:
        assert _reversals(desired) <= most
        assert min(desired) >= math.ceil(rate / 0.9)  # never under what the rate needs


@pytest.mark.parametrize(
    ("samples", "rises"),
    [
        ([6.0] * 30, False),  # 6 requests/s on 1 request/s workers: ceil(6 / 0.9) = 7
        # the rate 6% up to 6.35 (raw ceil(7.06) = 8): within two standard errors of its counts (0.33
        # requests/s each), held
        ([6.0] * 20 + [6.35] * 10, False),
        ([6.0] * 20 + [9.0] * 10, True),  # a sustained rise of 50%: up, at once to raw
    ],
)
def test_a_rise_is_taken_once_it_is_beyond_the_noise(samples: list[float], rises: bool) -> None:
    planner = Planner(PlannerConfig(cold_start_s=0.0, scale_down_window_s=0.0), initial=7)
    raws = []
    for k, rps in enumerate(samples, start=1):
        before = planner.desired
        d = planner.decide(_inputs(rps, workers=planner.desired), 10.0 * k)
        raws.append(d.raw)
        if d.desired > before:
            assert d.desired == d.raw  # taken whole
    if rises:
        assert d.desired >= 10  # ceil(9 / 0.9)
    else:
        assert d.desired == 7 and max(raws) == (8 if samples[-1] > 6.0 else 7)
        # a rise of raw held back by the noise band says so (not "stabilizing", which holds above raw)
        assert d.reason == ("noise" if d.raw > d.desired else "hold")
