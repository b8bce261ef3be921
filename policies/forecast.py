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

The median is Hampel's (Hampel, *The influence curve and its role in robust estimation*, JASA 69(346),
1974; the Hampel identifier, Pearson, *Outliers in process modeling and identification*, IEEE Trans.
Control Systems Technology 10(1), 2002): samples further than ``outlier_mads`` scaled median absolute
deviations (``1.4826 MAD``, the normal's standard deviation) from the window's median are left out before
the median is taken. A plain running median ignores a short burst's samples, but they still displace
the window's order statistics: 4 burst samples of 9 lift the median to the highest of the other 5, by
about a standard deviation of the rate's noise, and the trend extrapolated the lift over the cold start
(after the planner experiment's burst at 1.5x the plateau, it asked for up to 8 more workers); left out,
they move nothing. The threshold is 2, not the usual 3: with 4 of 9 samples out, the median sits at the
edge of the other 5, which inflates the MAD to about their range. Over 200 windows of a rate with 3%
noise and 4 samples at 1.5x (``tests/policies/test_planner_forecast.py``), the plain median rose by 3.4%
on average; at 3 the burst's samples were kept in 27 windows and the median rose by 0.7%; at 2 they were
kept in 3 and it did not rise (the normal samples left out with them lie on both sides of it). A steady
ramp loses no sample (within 9 samples its spread is 4 steps, its MAD 2). A sustained change is the
window's majority after half the window, as before: its samples are then the median's and the old ones
the outliers.

**The trend only when it is there** (:func:`trend_significance`). Extrapolated over a cold start, the
trend multiplies noise: at a steady rate, a level that wandered by one standard deviation of its noise
over a minute is a trend that, 310 s ahead, asks for several more workers, which are removed once the
level wanders back (the planner experiment's steady minutes counted their direction changes from it).
So the forecast uses the trend in proportion to the evidence for it: the Hampel medians of the last
``trend_window_samples`` samples (``2 x median_samples`` by default, 18: three minutes at 10 s) and of as
many before them are compared in units of their difference's standard error (``z``), and the trend is
weighed by the firm shrinkage of ``z`` (Gao & Bruce, *WaveShrink with firm shrinkage*, Statistica Sinica
7(4), 1997) with thresholds ``trend_z`` and ``2 trend_z``: ``weight = clip(2 - 2 trend_z / |z|, 0, 1)``:
none below ``trend_z`` (2: a steady rate crosses it in about one window of 20), all of it from ``2
trend_z``, and none when the halves disagree with its sign.
The standard error takes a sample's noise as the larger of two: Poisson counting (a rate measured over
``dt`` seconds at ``r`` requests/s has variance ``r / dt``, so a time-lapsed simulation with shorter
intervals is as noisy as its counts) and the samples' own scatter (the scaled MAD of their successive
differences over ``sqrt 2``, which a linear trend leaves out and bursty traffic puts in); a median of
``k`` samples has ``sqrt(pi / 2) = 1.2533`` times the standard error of their mean (Laplace's asymptotic
variance of the sample median, ``pi sigma^2 / 2k``), so ``se = 1.2533 sigma sqrt(2 / k)``. Until both
windows are full the forecast is the level. Windows of 18 rather than 9 samples: for a steady slope the
change between their medians doubles and its standard error falls by ``sqrt 2``, so a ramp's ``z`` is
2.8 times as large and the planner experiment's ramp is seen a minute or two earlier, while a steady
rate's ``z`` keeps its distribution and changes more slowly (fewer false alarms per hour). A real
deployment's 10 s samples hold ten times the time-lapsed simulation's counts, so its ``z`` is about
three times as large for the same change. :meth:`RateForecaster.forecast_se` gives the forecast's
standard error (the level's and the trend's part, its projection over ``z``), which the planner's
noise band reads (:mod:`policies.planner`).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

MEDIAN_SE_FACTOR = math.sqrt(math.pi / 2.0)
"""Standard error of a sample median over that of the mean, for normal samples (Laplace: the median's
asymptotic variance is ``pi sigma^2 / 2n``)."""

MIN_OUTLIER_MADS = 1.0 / 1.4826
"""The smallest Hampel threshold that always keeps half the window: at least half the samples lie within
one MAD of their median, and ``1.4826 MAD`` is the threshold's unit (:func:`hampel_median`)."""


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
        outlier_mads: the Hampel identifier's threshold, scaled MADs (2, module docstring; 0: every
            sample counts, a plain running median; else at least :data:`MIN_OUTLIER_MADS`). In one
            diagnostic run of the planner experiment's day (before the trend's weighing and the noise
            band), 2 direction changes at steady load against 3 with the plain median (301 GPU-hours
            against 303).
        trend_z: the forecast's trend counts in proportion to its evidence: none while the change between
            the last two windows of samples is under ``trend_z`` standard errors, all of it from twice that
            (module docstring; 0: always all of it, Holt's forecast unweighed).
        trend_window_samples: samples in each of those two windows (None: ``2 x median_samples``).
    """

    median_samples: int = 9
    level_tau_s: float = 20.0
    trend_tau_s: float = 60.0
    damping: float = 0.995
    outlier_mads: float = 2.0
    trend_z: float = 2.0
    trend_window_samples: int | None = None

    def __post_init__(self) -> None:
        if self.median_samples < 1 or self.level_tau_s <= 0 or self.trend_tau_s <= 0:
            raise ValueError("median_samples >= 1 and positive time constants")
        if self.outlier_mads != 0.0 and self.outlier_mads < MIN_OUTLIER_MADS:
            raise ValueError(f"outlier_mads must be 0 (off) or at least {MIN_OUTLIER_MADS:.4f}")
        if not 0 < self.damping <= 1:
            raise ValueError("damping must be in (0, 1]")
        if not 0 <= self.trend_z < math.inf:
            raise ValueError("trend_z must be finite and >= 0")
        if self.trend_window_samples is not None and self.trend_window_samples < 1:
            raise ValueError("trend_window_samples must be >= 1 (or None)")

    @property
    def significance_samples(self) -> int:
        """Samples in each of the two windows the trend's evidence compares (``trend_window_samples``, or
        ``2 x median_samples``)."""
        return self.trend_window_samples or 2 * self.median_samples


class RateForecaster:
    """A rate's running median, smoothed level and damped trend (see the module docstring)."""

    __slots__ = ("_at", "_config", "_history", "_level", "_recent", "_step", "_steps", "_trend")

    def __init__(self, config: ForecastConfig | None = None) -> None:
        self._config = config or ForecastConfig()
        self._recent: deque[float] = deque(maxlen=self._config.median_samples)
        window = self._config.significance_samples
        self._history: deque[float] = deque(maxlen=2 * window)  # both windows
        self._steps: deque[float] = deque(maxlen=2 * window)  # their intervals, s
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
    def significance(self) -> float | None:
        """``z`` of the change between the last two windows of samples (:func:`trend_significance`; None
        until both are full)."""
        k = self._config.significance_samples
        if len(self._history) < 2 * k:
            return None
        samples = list(self._history)
        dt = statistics.fmean(self._steps) if self._steps else 0.0
        return trend_significance(samples[:k], samples[k:], dt, self._config.outlier_mads)

    @property
    def trend_weight(self) -> float:
        """The share of the trend the forecast uses (0-1; module docstring: firm shrinkage of
        :attr:`significance`, 0 until it is known, 1 with ``trend_z`` 0)."""
        cut = self._config.trend_z
        if cut == 0.0:
            return 1.0
        z = self.significance
        if z is None or z == 0.0 or (z > 0) != (self._trend > 0):
            return 0.0
        return min(1.0, max(0.0, 2.0 - 2.0 * cut / abs(z)))

    @property
    def level_se(self) -> float:
        """The standard error of the running median, requests/s: ``1.2533 sigma / sqrt k`` over the ``k``
        samples it holds, ``sigma`` the samples' noise (:func:`sample_noise`); 0 before the first sample."""
        if not self._recent:
            return 0.0
        dt = statistics.fmean(self._steps) if self._steps else 0.0
        level = self.median or 0.0
        sigma = sample_noise(list(self._history), level, dt)
        return MEDIAN_SE_FACTOR * sigma / math.sqrt(len(self._recent))

    def forecast_se(self, horizon_s: float) -> float:
        """The standard error of :meth:`forecast` ``horizon_s`` ahead, requests/s: the level's
        (:attr:`level_se`) and the trend's part, the projection it adds over ``|z|`` (its evidence,
        :attr:`significance`: a projection known to ``z`` standard errors), combined as independent."""
        level_se = self.level_se
        if self._level is None or self.trend_weight == 0.0 or horizon_s <= 0 or self._step <= 0:
            return level_se
        z = self.significance
        projection = abs((self.forecast(horizon_s) or 0.0) - self._level) / self.trend_weight
        trend_se = projection / abs(z) if z else 0.0
        return math.hypot(level_se, trend_se)

    @property
    def median(self) -> float | None:
        """The running median of the recent samples without their outliers, requests/s (None before the
        first)."""
        return hampel_median(self._recent, self._config.outlier_mads) if self._recent else None

    def add(self, rate: float, now: float) -> None:
        """Fold in the rate measured over the interval that ended at ``now`` (s), requests/s."""
        cfg = self._config
        self._recent.append(max(0.0, rate))
        self._history.append(max(0.0, rate))
        if self._at is not None and now > self._at:
            self._steps.append(now - self._at)
        m = hampel_median(self._recent, cfg.outlier_mads)
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
        return max(0.0, self._level + self.trend_weight * self._trend * ahead * self._step)


def trend_significance(
    older: Sequence[float], newer: Sequence[float], dt: float, outlier_mads: float
) -> float:
    """``z`` of the change from ``older`` to ``newer`` (two windows of rate samples, requests/s, each
    measured over ``dt`` seconds): the difference of their Hampel medians over its standard error
    (module docstring: each sample's noise the larger of Poisson counting, ``sqrt(rate / dt)``, and the
    scaled MAD of the successive differences over ``sqrt 2``; ``1.2533 sigma sqrt(1/k_old + 1/k_new)``).
    A change with no noise at all is ``+-inf``; none at all, 0.

    Raises:
        statistics.StatisticsError: either window is empty.
    """
    before = hampel_median(older, outlier_mads)
    after = hampel_median(newer, outlier_mads)
    change = after - before
    if change == 0.0:
        return 0.0
    sigma = sample_noise([*older, *newer], (before + after) / 2.0, dt)
    se = MEDIAN_SE_FACTOR * sigma * math.sqrt(1.0 / len(older) + 1.0 / len(newer))
    if se == 0.0:
        return math.copysign(math.inf, change)
    return change / se


def hampel_median(samples: Sequence[float], outlier_mads: float) -> float:
    """The median of ``samples`` (non-empty) without those further than ``outlier_mads`` scaled median
    absolute deviations (``1.4826 MAD``) from their median (the Hampel identifier; module docstring).
    ``outlier_mads`` 0: the plain median. Below ``1 / 1.4826`` (about 0.67) an even number of samples can
    leave none within the limit (their median is then the mean of the middle two, none of them on it, and
    the MAD can be the smallest deviation: two samples 1 and 2 at 0.5 MADs); the plain median then.

    Raises:
        statistics.StatisticsError: ``samples`` is empty.
    """
    m = statistics.median(samples)
    if outlier_mads == 0.0:
        return m
    limit = outlier_mads * 1.4826 * statistics.median(abs(x - m) for x in samples)
    kept = [x for x in samples if abs(x - m) <= limit]
    return statistics.median(kept) if kept else m


def sample_noise(samples: Sequence[float], rate: float, dt: float) -> float:
    """One rate sample's standard deviation, requests/s: the larger of Poisson counting at ``rate``
    (requests/s) over ``dt`` seconds, ``sqrt(rate / dt)``, and the samples' own scatter, the scaled MAD of
    their successive differences over ``sqrt 2`` (a linear trend moves every difference alike and adds
    nothing; fewer than 3 samples: none)."""
    poisson = math.sqrt(max(0.0, rate) / dt) if dt > 0 else 0.0
    steps = [b - a for a, b in itertools.pairwise(samples)]
    if len(steps) < 2:
        return poisson
    mid = statistics.median(steps)
    return max(poisson, 1.4826 * statistics.median(abs(d - mid) for d in steps) / math.sqrt(2.0))
