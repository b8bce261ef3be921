"""Rates and latencies measured from a worker's own answers (pure; the caller passes ``now`` in s).

The admission core predicts a request's time to first token from what the gateway itself saw the worker do:

- :class:`DecayingRate`: events (or units) per second, exponentially time-decayed (time constant ``tau``;
  the continuous-time EWMA of a rate, as in Linux's load average or Finagle's "peak EWMA"). Used for each
  worker's completion rate and for the arrival rate of each band at a worker.
- :class:`Ewma`: exponentially weighted moving average of samples (weight ``alpha`` per sample).
- :class:`WorkerEstimates`: per worker, the completion rate, the mean dispatch-to-done time and a linear
  model of the engine's time to first token, ``ttft = base + per_token x (backlog + uncached)``: a
  request's first token comes after the engine has prefilled what was sent before it and is still
  prefilling (``backlog``, uncached tokens of dispatched requests without a first token yet) and its own
  uncached prompt; prefill is compute-bound, so its time is linear in the tokens (e.g. DistServe, Zhong et
  al., OSDI 2024, section 3). ``per_token`` is learned from first tokens that followed at least
  ``long_prefill_tokens`` of prefill, ``base`` (scheduling step, decode interleave) from the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class DecayingRate:
    """Rate of events (or of amounts) per second, exponentially decayed with time constant ``tau_s``.

    ``rate(now)`` is ``sum(amount_i x exp(-(now - t_i) / tau)) / tau``, corrected during the first
    ``tau`` seconds by ``1 / (1 - exp(-elapsed / tau))`` so that a steady rate reads right from the start.

    Args:
        tau_s: time constant, s (> 0).
        min_span_s: history needed before a rate is reported, s.

    Raises:
        ValueError: ``tau_s <= 0``.
    """

    __slots__ = ("_first", "_last", "_min_span", "_tau", "_value")

    def __init__(self, tau_s: float = 5.0, min_span_s: float = 0.0) -> None:
        if tau_s <= 0:
            raise ValueError("tau_s must be > 0")
        self._tau = tau_s
        self._min_span = min_span_s
        self._value = 0.0
        self._last: float | None = None
        self._first: float | None = None

    def start(self, now: float) -> None:
        """Start the clock at ``now`` without an event (a rate of zero is then a measurement)."""
        if self._first is None:
            self._first = self._last = now

    def add(self, now: float, amount: float = 1.0) -> None:
        """Count ``amount`` at ``now`` (s)."""
        if self._last is None:
            self._first = self._last = now
        elif now > self._last:
            self._value *= math.exp(-(now - self._last) / self._tau)
            self._last = now
        self._value += amount / self._tau

    def rate(self, now: float) -> float | None:
        """Units per second at ``now``; None before ``min_span_s`` of history."""
        if self._first is None or self._last is None:
            return None
        elapsed = now - self._first
        if elapsed < self._min_span:
            return None
        value = self._value * math.exp(-max(0.0, now - self._last) / self._tau)
        warm = 1.0 - math.exp(-elapsed / self._tau) if elapsed > 0 else 0.0
        return value / warm if warm > 1e-9 else None


class Ewma:
    """Exponentially weighted moving average of samples.

    Args:
        alpha: weight of each new sample, 0 < alpha <= 1.

    Raises:
        ValueError: alpha outside (0, 1].
    """

    __slots__ = ("_alpha", "count", "value")

    def __init__(self, alpha: float) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self._alpha = alpha
        self.value: float | None = None
        self.count = 0

    def update(self, sample: float) -> float:
        """Fold in ``sample``; returns the new average."""
        self.count += 1
        if self.value is None:
            self.value = sample
        else:
            self.value += self._alpha * (sample - self.value)
        return self.value


def relaxed(value: float, since_s: float, tau_s: float) -> float:
    """``value`` relaxed toward 0 for ``since_s`` seconds with time constant ``tau_s``:
    ``value x exp(-since_s / tau_s)`` (no change for ``since_s <= 0``)."""
    return value * math.exp(-max(0.0, since_s) / tau_s)


class DecayingEwma:
    """An :class:`Ewma` of samples that relaxes towards zero when samples stop.

    ``value(now) = v x exp(-(now - t_last) / tau)`` where ``v`` is the EWMA at the last sample. A worker
    whose estimate was measured under a load that has since gone gets no new samples if that estimate makes
    the gateway send it nothing; relaxing lets traffic, and so fresh samples, come back (an optimistic
    estimate costs at most a few late requests, which their deadlines then catch).

    Args:
        alpha: weight of each sample, 0 < alpha <= 1.
        tau_s: relaxation time constant, s (> 0).
    """

    __slots__ = ("_ewma", "_last", "_tau")

    def __init__(self, alpha: float, tau_s: float) -> None:
        if tau_s <= 0:
            raise ValueError("tau_s must be > 0")
        self._ewma = Ewma(alpha)
        self._tau = tau_s
        self._last = 0.0

    @property
    def count(self) -> int:
        """Samples seen."""
        return self._ewma.count

    def update(self, sample: float, now: float) -> None:
        """Fold in ``sample`` taken at ``now`` (s).

        Known bias (nu10): the EWMA continues from the value relaxed towards zero, so samples ``dt`` apart
        read as ``alpha / (1 - (1 - alpha) exp(-dt / tau))`` of their mean: 0.22x at 1 s apart with the
        defaults (a CPU worker's engine TTFT), about 0.66x at 0.14 s, 0.93x at 0.02 s (a GPU worker at 50
        first tokens/s). An unbiased form (the old value keeping ``(1 - alpha) exp(-dt / tau)`` of the
        weight) was tried for the per-token cost: the routing experiment's cache-aware SLO rate fell from
        306 to 35 (later 158) RPS, its cold prefills then predicted past their goal and shed. The
        per-token cost keeps this bias; the top class's short-request base does not
        (:class:`WorkerEstimates` ``top_ttft_base``).
        """
        current = self.value(now)
        if current is not None:
            self._ewma.value = current  # continue from the relaxed value
        self._ewma.update(sample)
        self._last = now

    def value(self, now: float) -> float | None:
        """The estimate at ``now``; None before the first sample."""
        v = self._ewma.value
        return None if v is None else relaxed(v, now - self._last, self._tau)


class UnbiasedDecayingEwma:
    """Like :class:`DecayingEwma`, without its bias: each sample's weight decays by ``(1 - alpha) x
    exp(-dt / tau)`` per later sample (``dt`` apart), and the estimate is their weighted mean
    (``sum w_i x_i / sum w_i``), so samples far apart read as their mean, not as a fraction of it; the
    value read still relaxes toward zero after the last sample (``x exp(-(now - t_last) / tau)``).

    Args:
        alpha: weight of each sample, 0 < alpha <= 1.
        tau_s: time constant, s (> 0).
    """

    __slots__ = ("_alpha", "_last", "_tau", "_weighted", "_weights", "count")

    def __init__(self, alpha: float, tau_s: float) -> None:
        if not 0 < alpha <= 1 or tau_s <= 0:
            raise ValueError("0 < alpha <= 1 and tau_s > 0")
        self._alpha, self._tau = alpha, tau_s
        self._weighted = self._weights = self._last = 0.0
        self.count = 0

    def update(self, sample: float, now: float) -> None:
        """Fold in ``sample`` taken at ``now`` (s)."""
        keep = (1.0 - self._alpha) * math.exp(-max(0.0, now - self._last) / self._tau) if self.count else 0.0
        self._weighted = keep * self._weighted + self._alpha * sample
        self._weights = keep * self._weights + self._alpha
        self._last = now
        self.count += 1

    def value(self, now: float) -> float | None:
        """The estimate at ``now``; None before the first sample."""
        if not self.count:
            return None
        return relaxed(self._weighted / self._weights, now - self._last, self._tau)


@dataclass(frozen=True, slots=True)
class EstimateConfig:
    """Smoothing of :class:`WorkerEstimates`.

    Attributes:
        rate_tau_s: time constant of the completion and arrival rates, s (5 s: a few load polls; long enough
            to average Poisson noise at tens of requests/s, short enough to follow a load step).
        min_history_s: history needed before a worker's capacity is used to predict waits, s (5 s; before
            that, waits are predicted as zero, so a cold start sheds nothing).
        ttft_alpha: weight of each TTFT sample (0.05: about the last 20 first tokens).
        e2e_alpha: weight of each dispatch-to-done sample.
        long_prefill_tokens: uncached prompt tokens from which a request's TTFT is treated as
            prefill-dominated (``per_token`` model) rather than as the short-request ``base``.
        prefill_tau_s: relaxation time constant of the unbiased per-token cost
            (``WorkerEstimates.prefill_per_token``), s of busy time: long, since it is a property of the
            engine more than of its load, and it guards the top band between samples that a CPU worker
            gives 12 s apart (at 5 s the estimate read 9% of itself by the next one).
        calibration_target: the share of each class's requests admitted as on time after a predicted
            wait in the gateway's queue whose first tokens must meet the class's TTFT goal (0.99, for
            P99 goals; 0: off): while fewer do, that class's predicted waits on the worker are scaled
            up, so admission sheds more of what the queue model lets in
            (:meth:`WorkerEstimates.on_goal_outcome`). Never scaled below the model (scale >= 1), so on an
            engine the model describes, where admitted requests already meet their goals, it does nothing.
            On by default since it scales only the predicted waits: the simulated fleet's four
            experiments meet their goals with it, and the CPU worker's interactive P99 TTFT at 2x overload
            comes closer to its goal (docs/experiments.md). Scaling the whole prediction instead let the
            misses of a cold start (cold prefixes, which no wait explains) shed on-time work: cache-aware
            routing's SLO rate fell from 306 to 207.5 RPS.
        calibration_step: how fast that scale moves, in log units per sample (0.2: at a target of 0.99 a
            miss raises it by about 22% and a hundred met goals take that back; a CPU worker serves only
            a few requests per second, so a smaller step would leave a 2-minute overload uncorrected).
        calibration_max: the scale stays within ``[1, calibration_max]``.
        calibration_decay_s: time constant, s, of each scale's return toward 1 (its log decays as
            ``exp(-dt / tau)``; 0: no decay). 60 s: a scale learned in an overload is mostly gone a few
            minutes after it ends, even where no more requests of that class come to show that they meet
            their goal; while the misses go on, their updates (hundreds a minute on a GPU worker, a few a
            second on a CPU one) hold it up. On the simulated fleet's fairness experiment (one tenant at
            10x nine others, 1.5x capacity, calibration at 0.99) the quiet tenants' lowest goodput was
            99.3% without decay and 100% with it. Kept per class, not per (class, tenant): per tenant,
            the same run gave the quiet tenants 92.3%: the noisy tenant got more answers (3,151 against
            2,813) and the quiet tenants' TTFT P90 rose from 0.7 to 1.7 s (why is not yet known).
    """

    rate_tau_s: float = 5.0
    min_history_s: float = 5.0
    ttft_alpha: float = 0.05
    e2e_alpha: float = 0.02
    long_prefill_tokens: int = 1024
    prefill_tau_s: float = 60.0
    calibration_target: float = 0.99
    calibration_step: float = 0.2
    calibration_max: float = 4.0
    calibration_decay_s: float = 60.0


@dataclass(slots=True)
class WorkerEstimates:
    """What one worker was measured to do.

    Attributes:
        config: smoothing settings.
        completions: finished requests per s.
        e2e: mean dispatch-to-last-token time, s.
        ttft_base: engine TTFT (dispatch to first token) not explained by prefill tokens, s.
        top_ttft_base: the same, without :class:`DecayingEwma`'s bias (:class:`UnbiasedDecayingEwma`), s:
            the top class's predictions use it (:meth:`engine_ttft` ``unbiased_base``). Biased, it read a
            CPU worker's interactive first tokens (samples about 1 s apart) at 0.3-0.4x their time, and
            admission let in interactive requests that then missed their goal (measured over predicted
            TTFT: median 2.56; unbiased 0.91). For every class, it cut the routing experiment's SLO rate
            from 306 to 208 RPS (shed 4.8% at 232 RPS): the base also takes in what the biased per-token
            cost leaves unexplained (cold prefills queued ahead in the engine), and unbiased it kept that.
        ttft_per_token: engine TTFT per prefilled token, s/token (biased, :class:`DecayingEwma`: see
            ``prefill_per_token``).
        prefill_per_token: the same, without :class:`DecayingEwma`'s bias (:class:`UnbiasedDecayingEwma`),
            s/token: what protects the top band from lower bands' long prefills (:meth:`prefill_s`).
            Admission keeps the biased one: it reads a CPU worker's cost at about 5% (samples 12 s
            apart) but the fleet's cache-aware routing relies on it: with the unbiased one its cold
            ~5,000-token prefills were predicted late and shed, never warmed their workers, and the routing
            experiment's SLO rate fell from 306 to 158 RPS (served at 1.5x that rate, 58% of peak).

    ``ttft_base`` and ``ttft_per_token`` relax toward zero only while the worker
    has work in flight: their clock is its busy time (:meth:`busy`, :meth:`idle`). Relaxing lets traffic
    come back to a worker whose estimate, measured under a load since gone, sheds what is sent to it; an
    idle worker needs none of that (with no queue and nothing in flight, admission predicts no more than
    a request's own prefill, and one whose prefill alone misses its goal is served there anyway). Relaxed
    on wall time, a 30 s idle spell took the per-token prefill cost to zero, and the burst that came next,
    long prompts and interactive requests behind them, was admitted as free and waited 30-250 s for first
    tokens on a CPU worker (nu11).
    """

    config: EstimateConfig = field(default_factory=EstimateConfig)
    completions: DecayingRate = field(init=False)
    e2e: Ewma = field(init=False)
    ttft_base: DecayingEwma = field(init=False)
    top_ttft_base: UnbiasedDecayingEwma = field(init=False)
    ttft_per_token: DecayingEwma = field(init=False)
    prefill_per_token: UnbiasedDecayingEwma = field(init=False)
    log_scale: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per class (band): (log of the factor its TTFT predictions are scaled by, s it was set at); it decays
    with ``calibration_decay_s`` from then. Absent: 1."""
    _idle_since: float | None = None
    _idle_s: float = 0.0

    def busy(self, now: float) -> None:
        """The worker got work in flight at ``now`` (s): the TTFT estimates' clock runs again."""
        if self._idle_since is not None:
            self._idle_s += max(0.0, now - self._idle_since)
            self._idle_since = None

    def idle(self, now: float) -> None:
        """The worker has nothing in flight from ``now`` (s): the TTFT estimates' clock stops."""
        if self._idle_since is None:
            self._idle_since = now

    def _busy_clock(self, now: float) -> float:
        """``now`` less the time the worker was idle, s (the TTFT estimates' clock)."""
        idle = self._idle_s + (max(0.0, now - self._idle_since) if self._idle_since is not None else 0.0)
        return now - idle

    def base_ttft(self, now: float) -> float | None:
        """``ttft_base`` at ``now`` (s); None before its first sample."""
        return self.ttft_base.value(self._busy_clock(now))

    def per_token_ttft(self, now: float) -> float | None:
        """``ttft_per_token`` at ``now`` (s/token); None before its first sample."""
        return self.ttft_per_token.value(self._busy_clock(now))

    def __post_init__(self) -> None:
        cfg = self.config
        self.completions = DecayingRate(cfg.rate_tau_s, cfg.min_history_s)
        self.e2e = Ewma(cfg.e2e_alpha)
        self.ttft_base = DecayingEwma(cfg.ttft_alpha, cfg.rate_tau_s)
        self.top_ttft_base = UnbiasedDecayingEwma(cfg.ttft_alpha, cfg.rate_tau_s)
        self.ttft_per_token = DecayingEwma(cfg.ttft_alpha, cfg.rate_tau_s)
        self.prefill_per_token = UnbiasedDecayingEwma(cfg.ttft_alpha, cfg.prefill_tau_s)

    def on_first_token(self, now: float, engine_ttft_s: float, prefill_tokens: int) -> None:
        """Learn from a first token that came at ``now`` (s), ``engine_ttft_s`` after dispatch.

        ``prefill_tokens``: the engine's prefill backlog at dispatch plus the request's own uncached tokens.
        """
        clock = self._busy_clock(now)
        base = self.ttft_base.value(clock) or 0.0
        per_token = self.ttft_per_token.value(clock)
        if prefill_tokens >= self.config.long_prefill_tokens:
            sample = max(0.0, engine_ttft_s - base) / prefill_tokens
            self.ttft_per_token.update(sample, clock)
            self.prefill_per_token.update(sample, clock)
        else:
            explained = per_token * prefill_tokens if per_token is not None else 0.0
            sample = max(0.0, engine_ttft_s - explained)
            self.ttft_base.update(sample, clock)
            self.top_ttft_base.update(sample, clock)

    def _log_scale(self, band: str, now: float) -> float:
        entry = self.log_scale.get(band)
        if entry is None:
            return 0.0
        value, at = entry
        tau = self.config.calibration_decay_s
        return relaxed(value, now - at, tau) if tau > 0 else value

    def prediction_scale(self, band: str, now: float) -> float:
        """The factor ``band``'s predicted queue waits on this worker are scaled by at ``now`` (s), >= 1 (1
        while calibration is off or its admitted requests meet their goal)."""
        return 1.0 if band not in self.log_scale else math.exp(self._log_scale(band, now))

    def prediction_scales(self, now: float) -> dict[str, float]:
        """Every scale still above 1 at ``now`` (s; one that decayed to within 1% of 1 is left out), per
        class (band)."""
        scales = {band: math.exp(self._log_scale(band, now)) for band in self.log_scale}
        return {band: x for band, x in scales.items() if x > 1.01}

    def on_goal_outcome(self, band: str, met: bool, now: float) -> None:
        """Learn from a first token of a class-``band`` request, at ``now`` (s), that was predicted at
        admission to wait in the gateway's queue and still meet its TTFT goal: ``met`` says whether it did
        (the admission core leaves out requests dispatched at once: their misses, a cold prefix or an
        engine stall, are not in the wait this scale corrects). Ignored until the
        worker's capacity is measured (``min_history_s``): before that, waits are predicted as zero, and
        the misses of a cold start (empty caches, windows still growing) say nothing about the model (the
        admission core also leaves out requests admitted before then, whose first tokens may come after).

        Stochastic-approximation quantile tracking (Robbins & Monro, 1951) on the log of the scale: a miss
        raises it by ``step x target``, a hit lowers it by ``step x (1 - target)``, so it settles where a
        share ``target`` of the requests admitted as on time meet their goal, and stays at 1 where more do.
        Between samples it decays toward 1 (``calibration_decay_s``). It corrects what the queue model
        leaves out on a real engine (a capacity measured in completions/s overstates what a CPU's
        step-quantized decode batches serve under open-loop arrivals, each of which stalls them for a
        prefill step; preemption and re-prefill) by
        the measure the operator set: goal attainment, the quantity SLO-oriented serving optimizes
        (SLOs-Serve, Chen et al. 2025; SCORPIO, 2025), not the model's error. No-op while
        ``calibration_target`` is 0.
        """
        cfg = self.config
        target = cfg.calibration_target
        if target <= 0.0 or self.completions.rate(now) is None:
            return
        value = self._log_scale(band, now) + cfg.calibration_step * (target - (1.0 if met else 0.0))
        value = min(math.log(cfg.calibration_max), value)
        if value <= 0.0:
            self.log_scale.pop(band, None)
        else:
            self.log_scale[band] = (value, now)

    def on_done(self, now: float, e2e_s: float) -> None:
        """Learn from a request that finished at ``now`` after ``e2e_s`` on the worker."""
        self.completions.add(now)
        self.e2e.update(e2e_s)

    def engine_ttft(self, prefill_tokens: int, now: float, unbiased_base: bool = False) -> float:
        """Predicted dispatch-to-first-token time after ``prefill_tokens`` of prefill, s (0 while unknown);
        ``unbiased_base``: with ``top_ttft_base`` (the top class's)."""
        return self._ttft(self.ttft_per_token, prefill_tokens, now, unbiased_base)

    def _ttft(
        self, per_token: DecayingEwma | UnbiasedDecayingEwma, prefill_tokens: int, now: float, unbiased: bool
    ) -> float:
        """``base + per_token x prefill_tokens`` at ``now`` on the busy clock, s (unknown parts: 0)."""
        clock = self._busy_clock(now)
        cost = per_token.value(clock)
        base = (self.top_ttft_base if unbiased else self.ttft_base).value(clock) or 0.0
        return base + (cost * prefill_tokens if cost is not None else 0.0)

    def on_first_token_missing(self, now: float, waited_s: float, prefill_tokens: int) -> None:
        """A request given up at ``now`` (s) with no first token ``waited_s`` after dispatch, behind
        ``prefill_tokens`` of prefill (backlog at dispatch and its own): the per-token cost is at least
        ``waited_s / prefill_tokens``, a lower bound (a censored sample) that raises ``prefill_per_token``
        when it reads less. A request given up before its first token would otherwise teach nothing, and
        a cold worker's first burst of long prompts, all given up, would leave the cost unknown (nu12)."""
        if prefill_tokens < self.config.long_prefill_tokens:
            return
        clock = self._busy_clock(now)
        bound = waited_s / prefill_tokens
        current = self.prefill_per_token.value(clock)
        if current is None or bound > current:
            self.prefill_per_token.update(bound, clock)

    def prefill_s(self, prefill_tokens: int, now: float) -> float:
        """Like :meth:`engine_ttft`, with the unbiased per-token cost (``prefill_per_token``), s."""
        return self._ttft(self.prefill_per_token, prefill_tokens, now, False)

    def capacity(self, now: float, window: int) -> float | None:
        """Requests per second the worker completes when its window is full; None while unknown.

        The larger of the measured completion rate and Little's law ``window / e2e`` (the latter reads the
        capacity even when demand kept the window from filling).
        """
        measured = self.completions.rate(now)
        if measured is None:
            return None
        e2e = self.e2e.value
        little = window / e2e if e2e and e2e > 0 else 0.0
        best = max(measured, little)
        return best if best > 0 else None
