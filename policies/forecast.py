"""Short-horizon forecast of an arrival rate (pure; samples come in with their time, s).

The planner (:mod:`policies.planner`) asks each class's demand ``horizon_s`` ahead, the time a worker it
asks for now needs before it serves (its cold start). :class:`RateForecaster` takes one sample per planner
interval (arrivals in the interval / its length, requests/s) and forecasts with:

1. a running median of the last ``median_samples`` samples: a burst shorter than half that window moves
   it not at all (a workers' cold start is minutes, so no worker asked for during a 30 s burst could serve
   it; admission control sheds the excess, :mod:`policies.admission_core`), while a sustained change shows
   after half the window (Tukey's running median, Tukey 1977, *Exploratory Data Analysis*, ch. 7);
2. Holt's linear trend with damping on the medians (Holt 1957; the damped trend of Gardner & McKenzie,
   *Forecasting trends in time series*, Management Science 31(10), 1985): level ``L`` and trend ``T``
   (requests/s per s),

   ``L_i = a m_i + (1 - a)(L_{i-1} + phi dt T_{i-1})``,
   ``T_i = b (L_i - L_{i-1}) / dt + (1 - b) phi T_{i-1}``,

   with ``a = 1 - exp(-dt / level_tau_s)`` and ``b = 1 - exp(-dt / trend_tau_s)`` (the smoothing weights of
   time constants, so the interval can change without retuning); the forecast ``h`` seconds ahead is
   ``L + T x sum_{k=1..n} phi^k x dt`` with ``n = h / dt`` steps (``phi`` per step), never below 0.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ForecastConfig:
    """Smoothing of :class:`RateForecaster`.

    Attributes:
        median_samples: samples in the running median (9 at a 10 s interval: 90 s, so bursts under 45 s
            are ignored; a 30 s burst touches 4 samples when it straddles their edges, a majority of 7).
        level_tau_s: time constant of the level, s.
        trend_tau_s: time constant of the trend, s (longer than the level's: a trend is the slower signal).
        damping: ``phi``, the trend kept per step ahead (1 = Holt's undamped trend). 0.995: over a 310 s
            horizon of 10 s steps the forecast takes 93% of the trend (0.98 took 74%: the planner
            experiment's fleet lagged the ramp more; undamped, it overshoots the ramp's top the most).
    """

    median_samples: int = 9
    level_tau_s: float = 20.0
    trend_tau_s: float = 60.0
    damping: float = 0.995

    def __post_init__(self) -> None:
        if self.median_samples < 1 or self.level_tau_s <= 0 or self.trend_tau_s <= 0:
            raise ValueError("median_samples >= 1 and positive time constants")
        if not 0 < self.damping <= 1:
            raise ValueError("damping must be in (0, 1]")


class RateForecaster:
    """A rate's running median, smoothed level and damped trend (see the module docstring)."""

    __slots__ = ("_at", "_config", "_level", "_recent", "_step", "_trend")

    def __init__(self, config: ForecastConfig | None = None) -> None:
        self._config = config or ForecastConfig()
        self._recent: deque[float] = deque(maxlen=self._config.median_samples)
        self._level: float | None = None
        self._trend = 0.0
        self._at: float | None = None
        self._step = 0.0  # the last interval's length, s (the forecast's step)

    @property
    def level(self) -> float | None:
        """The smoothed rate now, requests/s (None before the first sample)."""
        return self._level

    @property
    def trend(self) -> float:
        """The smoothed trend, requests/s per s."""
        return self._trend

    @property
    def median(self) -> float | None:
        """The running median of the recent samples, requests/s (None before the first)."""
        return statistics.median(self._recent) if self._recent else None

    def add(self, rate: float, now: float) -> None:
        """Fold in the rate measured over the interval that ended at ``now`` (s), requests/s."""
        cfg = self._config
        self._recent.append(max(0.0, rate))
        m = statistics.median(self._recent)
        if self._level is None or self._at is None or now <= self._at:
            if self._level is None:
                self._level = m
            self._at = now if self._at is None else max(self._at, now)
            return
        dt = now - self._at
        a = 1.0 - math.exp(-dt / cfg.level_tau_s)
        b = 1.0 - math.exp(-dt / cfg.trend_tau_s)
        phi = cfg.damping
        prev = self._level
        level = a * m + (1.0 - a) * (prev + phi * dt * self._trend)
        self._trend = b * (level - prev) / dt + (1.0 - b) * phi * self._trend
        self._level, self._at, self._step = level, now, dt

    def forecast(self, horizon_s: float) -> float | None:
        """The rate ``horizon_s`` ahead, requests/s (None before the first sample; >= 0)."""
        if self._level is None:
            return None
        if horizon_s <= 0 or self._step <= 0:
            return self._level
        phi = self._config.damping
        steps = horizon_s / self._step
        ahead = steps if phi == 1.0 else phi * (1.0 - phi**steps) / (1.0 - phi)
        return max(0.0, self._level + self._trend * ahead * self._step)
