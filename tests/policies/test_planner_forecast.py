"""Short-horizon arrival-rate forecast (policies.forecast): pure, time injected."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from policies.forecast import (
    MIN_OUTLIER_MADS,
    ForecastConfig,
    RateForecaster,
    hampel_median,
    trend_significance,
)


def _feed(fc: RateForecaster, rates: list[float], dt: float = 10.0) -> float:
    t = 0.0
    for r in rates:
        t += dt
        fc.add(r, t)
    return t


def test_nothing_before_the_first_sample() -> None:
    fc = RateForecaster()
    assert fc.level is None and fc.median is None and fc.forecast(300.0) is None


@pytest.mark.parametrize("rate", [0.0, 3.0, 250.0])
def test_a_steady_rate_forecasts_itself(rate: float) -> None:
    fc = RateForecaster()
    _feed(fc, [rate] * 40)
    assert fc.level == pytest.approx(rate, abs=1e-9)
    assert fc.forecast(0.0) == pytest.approx(rate, abs=1e-9)
    assert fc.forecast(310.0) == pytest.approx(rate, abs=1e-6)


@pytest.mark.parametrize(
    ("burst_samples", "moves"),
    [
        (4, False),  # a 30 s burst over 4 intervals (straddling their edges): under half of 9 samples
        (5, True),  # 50 s: a majority of the window, the median follows
    ],
)
def test_a_burst_shorter_than_half_the_median_window_is_ignored(burst_samples: int, moves: bool) -> None:
    fc = RateForecaster()
    _feed(fc, [10.0] * 20 + [30.0] * burst_samples)
    assert (fc.median == 30.0) is moves
    assert (fc.level is not None and fc.level > 11.0) is moves


def test_a_ramp_is_forecast_ahead_and_the_damped_trend_stays_below_the_linear_one() -> None:
    slope = 0.05  # requests/s per s
    rates = [10.0 + slope * 10.0 * k for k in range(60)]
    damped, linear = RateForecaster(), RateForecaster(ForecastConfig(damping=1.0))
    _feed(damped, rates)
    _feed(linear, rates)
    assert damped.trend == pytest.approx(slope, rel=0.2)
    assert damped.level is not None and damped.level < rates[-1]  # the median lags half its window
    ahead = damped.forecast(300.0)
    assert ahead is not None and ahead > rates[-1]  # ahead of what is measured now
    lin = linear.forecast(300.0)
    assert lin is not None and ahead < lin
    assert lin == pytest.approx(linear.level + linear.trend * 300.0)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("samples", "mads", "median"),
    [
        ([10.0, 11.0, 9.0, 10.0, 12.0, 30.0, 31.0, 29.0, 10.0], 3.0, 10.0),  # the burst's three left out
        ([10.0, 11.0, 9.0, 10.0, 12.0, 30.0, 31.0, 29.0, 10.0], 0.0, 11.0),  # plain: lifted a rank
        ([10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0, 24.0, 26.0], 3.0, 18.0),  # a ramp: nothing is an outlier
        ([10.0] * 5 + [30.0] * 4, 3.0, 10.0),  # MAD 0: only the median's value counts
        ([10.0] * 4 + [30.0] * 5, 3.0, 30.0),  # a majority: the new level, the old one left out
        ([7.0], 3.0, 7.0),
    ],
)
def test_the_hampel_median_leaves_out_outliers(samples: list[float], mads: float, median: float) -> None:
    assert hampel_median(samples, mads) == median


def _noisy(level: float, n: int, rng: random.Random) -> list[float]:
    """``n`` rates measured over 10 s intervals of a Poisson stream at ``level`` requests/s (the count's
    sampling noise, normal approximation)."""
    return [max(0.0, rng.gauss(level * 10.0, (level * 10.0) ** 0.5) / 10.0) for _ in range(n)]


def test_a_burst_does_not_lift_the_median_that_its_samples_displace() -> None:
    rng = random.Random(7)
    lifts: dict[float, list[float]] = {0.0: [], 2.0: []}
    for _ in range(200):
        base = _noisy(100.0, 9, rng)
        burst = base[:5] + [150.0] * 4  # 4 of 9 samples at 1.5x, as the experiment's 30 s burst
        for mads, lift in lifts.items():
            lift.append(hampel_median(burst, mads) - hampel_median(base, mads))
    assert statistics.mean(lifts[0.0]) > 1.5  # the plain median rises by about a standard deviation
    assert abs(statistics.mean(lifts[2.0])) < 0.5


def test_a_falling_rate_is_never_forecast_below_zero() -> None:
    fc = RateForecaster(ForecastConfig(damping=1.0))
    _feed(fc, [max(0.0, 50.0 - 2.0 * k) for k in range(30)])
    assert fc.forecast(3600.0) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"median_samples": 0},
        {"level_tau_s": 0.0},
        {"trend_tau_s": -1.0},
        {"damping": 0.0},
        {"damping": 1.1},
        {"outlier_mads": -1.0},
    ],
)
def test_bad_configs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ForecastConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("mads", [0.1, 0.5, 0.67])
def test_a_small_threshold_with_no_sample_within_it_falls_back_to_the_plain_median(mads: float) -> None:
    # an even count: the median (1.5) is no sample, every sample lies 1 MAD (0.5) from it, beyond the limit
    assert hampel_median([1.0, 2.0], mads) == 1.5
    assert hampel_median([1.0, 2.0, 3.0, 4.0], mads) == 2.5
    with pytest.raises(ValueError, match=r"at least 0\.6745"):  # a forecaster is not given such a threshold
        ForecastConfig(outlier_mads=mads)


@pytest.mark.parametrize("mads", [MIN_OUTLIER_MADS, 1.0, 2.0, 3.0])
def test_a_threshold_from_its_minimum_on_keeps_half_of_any_window(mads: float) -> None:
    rng = random.Random(3)
    for n in range(1, 12):
        for _ in range(50):
            samples = [rng.choice([1.0, 2.0, 2.5, 7.0, rng.uniform(0, 10)]) for _ in range(n)]
            m = statistics.median(samples)
            limit = mads * 1.4826 * statistics.median(abs(x - m) for x in samples)
            assert 2 * sum(abs(x - m) <= limit + 1e-12 for x in samples) >= n
            assert min(samples) <= hampel_median(samples, mads) <= max(samples)
    forecaster = RateForecaster(ForecastConfig(outlier_mads=mads))
    for k, rate in enumerate([1.0, 2.0, 3.0, 4.0]):  # the planner's first intervals (2 and 4 samples)
        forecaster.add(rate, 10.0 * (k + 1))
    assert forecaster.median == 2.5


@pytest.mark.parametrize(
    ("older", "newer", "dt", "z"),
    [
        ([10.0] * 9, [10.0] * 9, 10.0, 0.0),  # no change
        # a step of 10 on 100 requests/s measured over 10 s: Poisson sd sqrt(105 / 10) = 3.24 per sample,
        # se = 1.2533 x 3.24 x sqrt(2 / 9) = 1.92: z = 5.2
        ([100.0] * 9, [110.0] * 9, 10.0, 5.22),
        # the same rates over 1 s intervals (a 10x time-lapse): a tenth of the counts, z / sqrt(10)
        ([100.0] * 9, [110.0] * 9, 1.0, 1.65),
        ([110.0] * 9, [100.0] * 9, 10.0, -5.22),  # a fall
        ([0.0] * 9, [5.0] * 9, 0.0, math.inf),  # no noise at all: any change is certain
        # scatter beyond Poisson (bursty traffic): samples alternating 90 / 110, then 100 / 120 (Hampel
        # medians 90 and 100); the successive differences +-20 scatter by 10 about their median (scaled:
        # 1.4826 x 10 / sqrt 2 = 10.5 per sample, against Poisson's 3.1): se 6.2, z = 1.6
        ([90.0, 110.0] * 4 + [90.0], [100.0, 120.0] * 4 + [100.0], 10.0, 1.61),
    ],
)
def test_trend_significance(older: list[float], newer: list[float], dt: float, z: float) -> None:
    assert trend_significance(older, newer, dt, 2.0) == pytest.approx(z, abs=0.01)


def test_a_steady_rate_leaves_the_trend_out_of_the_forecast() -> None:
    """Over 3,000 intervals of a Poisson rate, Holt's trend moved the forecast 310 s ahead by up to a
    quarter of the rate (its 99th percentile); weighed by its evidence, the trend is used in under 5% of
    the intervals and the 99th percentile falls under a fourth of that."""
    deviations: dict[float, list[float]] = {0.0: [], 2.0: []}
    used = 0
    for trend_z, devs in deviations.items():
        rng = random.Random(3)
        fc = RateForecaster(ForecastConfig(trend_z=trend_z))
        for k, rate in enumerate(_noisy(20.0, 3000, rng)):
            fc.add(rate, 10.0 * (k + 1))
            if k >= 2 * 9:
                ahead = fc.forecast(310.0)
                assert ahead is not None and fc.level is not None
                devs.append(abs(ahead - fc.level) / 20.0)
                used += trend_z > 0 and fc.trend_weight > 0
    p99 = {z: sorted(d)[int(0.99 * len(d))] for z, d in deviations.items()}
    assert p99[0.0] > 0.15
    assert p99[2.0] < p99[0.0] / 4
    assert used < 0.05 * len(deviations[2.0])


def test_the_trend_is_left_out_until_both_windows_are_full() -> None:
    fc = RateForecaster()
    rates = [10.0 + 2.0 * k for k in range(2 * 18)]  # a steep ramp, noise-free: two windows of 18
    for k, rate in enumerate(rates[:-1]):
        fc.add(rate, 10.0 * (k + 1))
    assert fc.significance is None and fc.trend_weight == 0.0 and fc.forecast(310.0) == fc.level
    fc.add(rates[-1], 10.0 * len(rates))
    assert fc.significance is not None and fc.significance > 4.0 and fc.trend_weight == 1.0
    ahead = fc.forecast(310.0)
    assert ahead is not None and fc.level is not None and ahead > fc.level


@pytest.mark.parametrize(
    ("z", "weight"), [(1.9, 0.0), (2.0, 0.0), (3.0, 2.0 - 4.0 / 3.0), (4.0, 1.0), (9.0, 1.0)]
)
def test_the_trend_weight_is_the_firm_shrinkage_of_its_significance(z: float, weight: float) -> None:
    # a step from 100 to 100 + d requests/s over 10 s samples: z = d / 1.915 (see test_trend_significance)
    fc = RateForecaster(ForecastConfig(level_tau_s=1e-6, trend_window_samples=9))
    d = z * 1.2533141373155001 * math.sqrt((100.0 + (100.0 + z * 2.0)) / 2.0 / 10.0) * math.sqrt(2.0 / 9.0)
    for k in range(9):
        fc.add(100.0, 10.0 * (k + 1))
    for k in range(9):
        fc.add(100.0 + d, 10.0 * (k + 10))
    assert fc.significance is not None
    expected = min(1.0, max(0.0, 2.0 - 4.0 / fc.significance))
    assert fc.trend_weight == pytest.approx(expected)
    assert fc.trend_weight == pytest.approx(weight, abs=0.05)
