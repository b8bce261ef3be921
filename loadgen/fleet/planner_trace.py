"""The planner experiment's day-shaped trace (:mod:`loadgen.fleet.experiments_planner`), in time-lapse.

A day at ``scale`` workers' worth of load per 1x (one worker's capacity at the goals times ``scale``):
``low`` (0.3x) for ``low_s``, a half-cosine ramp to ``high`` (2x) over ``ramp_s``, ``high`` for ``peak_s``
with a ``burst_s`` (30 s) burst at ``burst`` (3x) ``burst_at_s`` into it, a half-cosine ramp back to
``low`` over ``ramp_s``, and ``low`` for ``tail_s``. Durations are the day's (real seconds).

**Time-lapse.** The simulation runs the day ``speed`` times faster: every duration of the day, the workers'
cold start and every period of the scaling controllers (the planner's interval, windows and forecast time
constants, the HPA's sync period and stabilization, the WVA's interval) is divided by ``speed``; the
requests themselves are not (their TTFT goals, prompt and output lengths, the engines' step times and
the admission core's own estimates are real-time). What the scaling decides depends on the ratio of the
cold start to the ramps and to the controllers' periods, which the time-lapse keeps; the requests live
seconds, far below every scaled period (a 300 s cold start becomes 60 s at 5x, a request ~2-5 s). Reports
give times in the day's seconds (virtual seconds x ``speed``).

Classes: ``interactive`` (chat: short prompts) and ``standard`` (API calls with documents: longer prompts),
each a Poisson stream (time-rescaled by the day's rate, :func:`loadgen.scenario.arrival_times`) from a
tenant of its own. Prompts are cut from a seeded pool of :data:`loadgen.scenario.WORDS` (the scenario
planner draws every word, which took a minute of CPU per run of the day's half-million requests).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from loadgen.fleet.bridge import render_chatml
from loadgen.fleet.config import FleetRequest, TenantSpec
from loadgen.scenario import WORDS, Arrival, ChatMessage, RateStep, arrival_times

_POOL = 50_000
"""Words in each class's seeded pool that prompts are cut from."""


@dataclass(frozen=True, slots=True)
class ClassMix:
    """One class of the trace: its share of the arrivals, its prompts and outputs (uniform, words and
    tokens) and its TTFT goal (the class's SLO; the gateway's default goal), ms."""

    name: str
    share: float
    prompt_words: tuple[int, int]
    output_tokens: tuple[int, int]
    goal_ms: float
    goodput_goal: float


MIX: tuple[ClassMix, ...] = (
    ClassMix("interactive", 0.4, (150, 250), (50, 150), 500.0, 0.99),
    ClassMix("standard", 0.6, (600, 1000), (50, 150), 2000.0, 0.95),
)
"""Chat turns and API calls carrying a document; goodput goals 99% and 95% of the sent requests within their
TTFT goal (issue 29)."""


@dataclass(frozen=True, slots=True)
class DayShape:
    """The day (module docstring). Times in the day's seconds; ``speed`` is the time-lapse factor."""

    scale: float = 20.0
    low: float = 0.3
    high: float = 2.0
    burst: float = 3.0
    low_s: float = 300.0
    ramp_s: float = 1500.0
    peak_s: float = 600.0
    tail_s: float = 600.0
    burst_at_s: float = 300.0
    burst_s: float = 30.0
    step_s: float = 10.0
    speed: float = 10.0

    def __post_init__(self) -> None:
        if min(self.scale, self.low, self.high, self.speed, self.step_s) <= 0:
            raise ValueError("scale, low, high, speed and step_s must be > 0")
        if not 0 <= self.burst_at_s <= self.peak_s - self.burst_s:
            raise ValueError("the burst must lie inside the peak")

    @property
    def day_s(self) -> float:
        """The day's length, s."""
        return self.low_s + 2 * self.ramp_s + self.peak_s + self.tail_s

    @property
    def burst_window(self) -> tuple[float, float]:
        """The burst's start and end, day s."""
        start = self.low_s + self.ramp_s + self.burst_at_s
        return start, start + self.burst_s

    def multiple(self, t: float) -> float:
        """The rate at day time ``t`` (s), in multiples of ``scale`` workers' capacity; the burst included."""
        b0, b1 = self.burst_window
        if b0 <= t < b1:
            return self.burst
        return self.base(t)

    def base(self, t: float) -> float:
        """The rate at day time ``t`` without the burst, multiples."""
        lo, hi = self.low, self.high
        up = self.low_s
        top = up + self.ramp_s
        down = top + self.peak_s
        end = down + self.ramp_s
        if t < up or t >= end:
            return lo
        if t < top:
            return lo + (hi - lo) * (1 - math.cos(math.pi * (t - up) / self.ramp_s)) / 2
        if t < down:
            return hi
        return hi - (hi - lo) * (1 - math.cos(math.pi * (t - down) / self.ramp_s)) / 2

    def steady(self) -> list[tuple[float, float]]:
        """The stretches of steady load (the plateaus, the burst included), day s."""
        top = self.low_s + self.ramp_s
        end = top + self.peak_s + self.ramp_s
        return [(0.0, self.low_s), (top, top + self.peak_s), (end, end + self.tail_s)]

    def schedule(self, unit_rps: float, share: float) -> list[dict[str, float]]:
        """The arrival rate as ``loadgen.scenario`` steps (virtual s, requests/s), every ``step_s`` of the day
        (its mean over the step) and at the burst's edges; ``unit_rps``: one worker's capacity."""
        points = {round(k * self.step_s, 9) for k in range(int(self.day_s // self.step_s) + 1)}
        points |= set(self.burst_window)
        edges = [*sorted(p for p in points if p < self.day_s), self.day_s]
        steps = []
        for a, b in itertools.pairwise(edges):
            n = 8
            mean = sum(self.multiple(a + (i + 0.5) * (b - a) / n) for i in range(n)) / n
            rate = mean * self.scale * unit_rps * share
            steps.append({"at_s": a / self.speed, "rate_rps": rate})
        return steps


def _arrivals(steps: list[dict[str, float]], horizon_s: float, rng: random.Random) -> list[float]:
    """Poisson arrival times (s) under a piecewise-constant rate (``loadgen.scenario``'s time rescaling)."""
    arrival = Arrival(rate_rps=steps[0]["rate_rps"], schedule=[RateStep(**st) for st in steps])
    return arrival_times(arrival, horizon_s, rng)


def class_requests(
    c: ClassMix, steps: list[dict[str, float]], horizon_s: float, seed: int
) -> list[FleetRequest]:
    """One class's requests: Poisson arrivals at ``steps``' rate (virtual s) over ``[0, horizon_s)``; each
    prompt the ChatML rendering of ``Question CLASS-N:`` and a run of words from a seeded pool (no two
    prompts share more than their template's first tokens, as in a stream of independent calls), its
    ``max_tokens`` uniform in the class's range. Rids ``CLASS/N``; the tenant is the class."""
    rng = random.Random(f"radixgate-planner-trace:{seed}:{c.name}")
    pool = rng.choices(WORDS, k=_POOL)
    out = []
    for i, t in enumerate(_arrivals(steps, horizon_s, rng)):
        n = rng.randint(*c.prompt_words)
        start = rng.randrange(_POOL - n)
        text = f"Question {c.name}-{i}: " + " ".join(pool[start : start + n])
        prompt = render_chatml([ChatMessage("user", text)])
        tokens = rng.randint(*c.output_tokens)
        out.append(FleetRequest(f"{c.name}/{i}", t, c.name, prompt, tokens, priority_class=c.name))
    return out


def merged_requests(
    parts: list[list[FleetRequest]], mix: tuple[ClassMix, ...]
) -> tuple[list[FleetRequest], dict[str, TenantSpec]]:
    """The classes' requests as one stream, in arrival order, and one tenant per class."""
    out = [r for part in parts for r in part]
    out.sort(key=lambda r: (r.arrival_s, r.rid))
    return out, {c.name: TenantSpec(c.name, priority_class=c.name) for c in mix}


def day_requests(
    day: DayShape, unit_rps: float, mix: tuple[ClassMix, ...] = MIX, seed: int = 1
) -> tuple[list[FleetRequest], dict[str, TenantSpec]]:
    """The day's requests (virtual time) and tenants."""
    horizon = day.day_s / day.speed
    parts = [class_requests(c, day.schedule(unit_rps, c.share), horizon, seed) for c in mix]
    return merged_requests(parts, mix)


def steady_requests(
    rate_rps: float, duration_s: float, mix: tuple[ClassMix, ...] = MIX, seed: int = 1
) -> tuple[list[FleetRequest], dict[str, TenantSpec]]:
    """Constant-rate requests of the mix (virtual time) and tenants."""
    parts = [
        class_requests(c, [{"at_s": 0.0, "rate_rps": rate_rps * c.share}], duration_s, seed) for c in mix
    ]
    return merged_requests(parts, mix)


__all__ = [
    "MIX",
    "ClassMix",
    "DayShape",
    "class_requests",
    "day_requests",
    "merged_requests",
    "steady_requests",
]
