"""Short-horizon arrival-rate forecast (policies.forecast): pure, time injected."""

from __future__ import annotations

import pytest

from policies.forecast import ForecastConfig, RateForecaster


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


def test_a_falling_rate_is_never_forecast_below_zero() -> None:
    fc = RateForecaster(ForecastConfig(damping=1.0))
    _feed(fc, [max(0.0, 50.0 - 2.0 * k) for k in range(30)])
    assert fc.forecast(3600.0) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [{"median_samples": 0}, {"level_tau_s": 0.0}, {"trend_tau_s": -1.0}, {"damping": 0.0}, {"damping": 1.1}],
)
def test_bad_configs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ForecastConfig(**kwargs)  # type: ignore[arg-type]
