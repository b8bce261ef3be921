"""How many workers a model needs: the autoscaling signal ``radixgate_desired_workers{model}`` (pure).

The gateway (``service/pipeline/planner_task.py``) and the fleet simulation
(``loadgen/fleet/controllers.py``, driven by ``loadgen/fleet/scaling.py``) call :meth:`Planner.decide`
every :attr:`PlannerConfig.interval_s` with what the admission core measured, built the same way by both
(:mod:`policies.planner_inputs`, :meth:`EngineModel.from_capacity`); it returns the worker count to run and
why. No clock, no I/O.

**Per-worker capacity** (the work one request costs a worker, s). An aggregated SGLang worker runs
prefill and decode in the same steps (continuous batching); a step over a batch of ``B`` decoding
sequences takes ``a + b B`` (``a``: reading the weights once, launch overhead; ``b``: each sequence's
GEMM rows and attention) plus ``c_p`` per uncached prompt token it prefills. At a batch ``B*`` a decoded
token then costs ``(a + b B*) / B*`` of the worker's time, and a request of class ``c`` with ``P_c`` prompt
tokens, a cache hit rate ``h`` and ``D_c`` output tokens costs

    ``w_c = P_c (1 - h) c_p + D_c (a + b B*) / B*``                                         (s)

so one worker serves ``1 / w_c`` requests/s of that class when busy all the time at ``B*``. This is
Dynamo's SLA planner (NVIDIA Dynamo, *Planner Design*, docs.nvidia.com/dynamo, "throughput-based
scaling": prefill replicas = ceil(predicted prefill tokens/s x (1 - predicted KV hit rate) / prefill
throughput per GPU at the TTFT target), decode replicas = ceil(predicted decode load / decode throughput
per GPU at the ITL target)) with both phases on one engine, so their shares of a worker add. ``B*`` is
the largest batch that keeps every class with traffic within its goal:

- the window (the engine's ``max_running_requests``);
- the KV cache: the batch at which KV usage reaches ``kv_target`` (llm-d's autoscaler's 0.8 threshold);
- each class's TTFT goal: a new request waits for the step in flight, then is prefilled in the next one,
  so ``2 (a + b B) + P_c (1 - h) c_p <= goal_fraction x goal``.

**Demand.** Per class, the arrival rate of every request that reached admission (admitted or shed: a shed
request is demand), forecast ``cold_start_s + interval_s`` ahead (:mod:`policies.forecast`), and the
requests waiting in the gateway's queues, which must be served within their goal:

    ``needed = sum_c lambda_c w_c + sum_c Q_c w_c / goal_c``                       (workers, fractional)

where ``Q_c`` is the running median of the class's queue over its last ``queue_median_samples``
decisions (the forecast's ``median_samples`` unless set), like its rates: a queue that a burst shorter
than half that window built is drained by admission control before any worker asked for now could
serve (the fleet experiment's 30 s burst at 3x raised the decision of 40 workers to 56 for three minutes
when the queue counted at once); one that
persists is a deficit the arrival rates have not shown.

taken at the larger of now and the forecast (a worker asked for now serves only after its cold start; one
removed now is gone at once), and ``raw = ceil(needed / target_utilization)``.

**Hysteresis** (the decision, :meth:`Planner.decide`):

- up at once: ``raw`` above the last decision replaces it (a cold start is already minutes);
- down slowly: the decision falls only to the highest ``raw`` of the last ``scale_down_window_s``
  (Kubernetes' HPA ``behavior.scaleDown.stabilizationWindowSeconds``, default 300 s), and only to a count
  ``n`` whose projected utilization, the current need spread over ``n`` workers, stays at most
  ``scale_down_margin x target_utilization``: before removing one of ``N`` workers the load is projected
  onto ``N - 1`` (each then carries ``N / (N - 1)`` times its share), as Dynamo's planner does since its
  PR #9294 fixed a 2 <-> 1 flap (removing one of two doubled the survivor's load past the scale-up point);
  the margin leaves a dead band between the two thresholds, of one worker at most above ``raw`` (at the
  noise band's upper edge, below): enough
  for the 2 <-> 1 boundary, where a relative band held 50 workers for the 40 workers' need of the fleet
  experiment's peak (40 / 0.81) while one worker (2.5%) is already above the noise of its measured rates;
- never below ``min_workers`` or above ``max_workers``; without a measured capacity, hold.

**The noise band** (``scale_up_z``, ``scale_down_z``). A measured rate is a count: at a steady load the
need wanders by its counting noise, and where it sits near a boundary of ``ceil`` every excursion past it
is a worker asked for, then given back (the planner experiment's steady minutes). The need's standard
error ``se = sqrt(sum_c (se_c w_c)^2)`` comes from each class's running median
(:attr:`policies.forecast.RateForecaster.level_se`: Poisson counting or the samples' own scatter,
whichever is larger). A rise of ``raw`` is taken only when ``ceil((need - scale_up_z se) / target)`` also
exceeds the workers decided, and then whole (to ``raw``: once the evidence is there, nothing is held
back); a fall only to a count that ``now_need + scale_down_z se`` fits within the margin (and one worker
at most above what that need asks for). The forecast's own standard error
(:meth:`policies.forecast.RateForecaster.forecast_se`: the level's and the trend's, the projection over
its evidence ``z``) stands for the level's when the forecast is the larger need. Two standard errors each
way (the defaults) widen the dead band by four, a few percent of the need at the planner experiment's
rates, and delay a scale-up on a ramp by the time the ramp takes to rise two standard errors (seconds,
against a cold start of minutes). Two hours of 10 s decisions at a steady Poisson rate of 6 or 60 workers'
worth reversed the decision 32 to 48 times without the band and the trend's weighing, and at most once
with them, over 8 seeds each (``tests/policies/test_planner.py`` runs one). This is the HPA's tolerance
(Kubernetes scales only past a 10% deviation from the target, ``--horizontal-pod-autoscaler-tolerance``)
sized by the measurement's own noise instead of a fixed share.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from policies.forecast import ForecastConfig, RateForecaster

Reason = Literal["up", "down", "hold", "stabilizing", "noise", "floor", "ceiling", "unmeasured"]
"""Why the decision is what it is: raised to ``raw``; lowered; unchanged; held above ``raw`` by the
scale-down window or the N-1 projection; held below ``raw`` because the rise is within the measurement's
noise band (``scale_up_z``); at ``min_workers``; at ``max_workers``; no capacity measured."""


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """The planner's settings (``planner.*`` in the gateway's Settings tree).

    Attributes:
        min_workers: floor of the decision (>= 0).
        max_workers: ceiling of the decision.
        interval_s: how often :meth:`Planner.decide` is called, s.
        cold_start_s: time from asking for a worker to its first answer, s: the forecast's horizon (with
            one interval). 300 s: a Llama-70B TP-8 worker (image pull, weight download and load, CUDA graph
            capture; see ``docs/scaling.md``).
        target_utilization: the share of a worker's capacity at ``B*`` the decision plans to fill (the
            headroom left for Poisson bursts and estimation error).
        scale_down_margin: a scale-down to ``n`` workers needs the current need over ``n`` to stay within
            this share of ``target_utilization`` (the dead band against flapping).
        scale_down_window_s: the decision falls no lower than the highest ``raw`` of this past window, s.
        kv_target: KV cache usage the batch ``B*`` may reach (llm-d: 0.8).
        goal_fraction: share of a class's TTFT goal the two steps and its prefill may take at ``B*``.
        forecast: smoothing of the arrival-rate forecasts.
        queue_median_samples: decisions in the queue term's running median (None: the forecast's
            ``median_samples``). A queue lives as long as its requests take to drain, in the requests'
            own time; a time-lapsed simulation (``loadgen/fleet/planner_runs.py``) keeps it there by
            spreading the median over as many real seconds as the gateway's would cover.
        scale_up_z: a scale-up needs the need less this many of its standard errors to ask for more
            workers than run (module docstring: the noise band; 0: any rise of ``raw``).
        scale_down_z: a scale-down to ``n`` needs the need plus this many of its standard errors to fit
            ``n`` within the margin (0: the need as measured).
    """

    min_workers: int = 1
    max_workers: int = 64
    interval_s: float = 10.0
    cold_start_s: float = 300.0
    target_utilization: float = 0.9
    scale_down_margin: float = 0.9
    scale_down_window_s: float = 120.0
    kv_target: float = 0.8
    goal_fraction: float = 0.5
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    queue_median_samples: int | None = None
    scale_up_z: float = 2.0
    scale_down_z: float = 2.0

    def __post_init__(self) -> None:
        if self.queue_median_samples is not None and self.queue_median_samples < 1:
            raise ValueError("queue_median_samples must be >= 1 (or None)")
        if not (0 <= self.scale_up_z < math.inf and 0 <= self.scale_down_z < math.inf):
            raise ValueError("scale_up_z and scale_down_z must be finite and >= 0")
        if self.min_workers < 0 or self.max_workers < max(1, self.min_workers):
            raise ValueError("0 <= min_workers <= max_workers and max_workers >= 1")
        if self.interval_s <= 0 or self.cold_start_s < 0 or self.scale_down_window_s < 0:
            raise ValueError("interval_s > 0, cold_start_s >= 0 and scale_down_window_s >= 0")
        for name in ("target_utilization", "scale_down_margin", "kv_target", "goal_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class EngineModel:
    """A worker's speed, the same for every worker of a model's pool: the step-time model
    ``a + b B + c_p x uncached prompt tokens`` of ``loadgen.sim.profiles`` (the simulator knows it), or
    what the admission core measured (:meth:`from_capacity`).

    Attributes:
        step_base_s: ``a``, a decode step's time over an empty batch, s.
        step_per_seq_s: ``b``, what each decoding sequence adds to a step, s.
        prefill_s_per_token: ``c_p``, a prompt token's prefill, s (0 when its cost is inside ``b``: the
            meter then measured it per decoded token at the current mix).
        max_batch: the window, sequences (SGLang's ``max_running_requests``).
        cache_hit_rate: share of prompt tokens served from the prefix cache (0-1).
        batch: the mean decoding batch per worker now (None: unknown); with ``kv_usage``, it gives the
            batch at which KV fills to the target.
        kv_usage: mean KV cache usage per worker now (0-1; None: unknown).
    """

    step_base_s: float
    step_per_seq_s: float
    prefill_s_per_token: float
    max_batch: int
    cache_hit_rate: float = 0.0
    batch: float | None = None
    kv_usage: float | None = None

    @classmethod
    def from_capacity(
        cls, capacity_rps: float, window: int, output_tokens: float, cache_hit_rate: float = 0.0
    ) -> EngineModel:
        """The model of a worker the admission core measured completing ``capacity_rps`` requests/s with a
        full ``window`` (:meth:`policies.estimates.WorkerEstimates.capacity`) at a mean ``output_tokens``.

        The measure folds prefill into the decode cost at the current mix, so ``c_p = b = 0`` and
        ``a = window / (capacity_rps x output_tokens)``: then ``w_c = D_c a / window = 1 / capacity_rps``
        for a class of the measured mean length, and scales with each class's own output length.

        Raises:
            ValueError: a capacity, window or length that is not positive.
        """
        if capacity_rps <= 0 or window < 1 or output_tokens <= 0:
            raise ValueError("capacity_rps > 0, window >= 1 and output_tokens > 0")
        step = window / (capacity_rps * output_tokens)
        return cls(step, 0.0, 0.0, window, cache_hit_rate)

    def step_s(self, batch: float) -> float:
        """A decode step's time over ``batch`` sequences, s."""
        return self.step_base_s + self.step_per_seq_s * batch

    def prefill_s(self, prompt_tokens: float) -> float:
        """The prefill of a ``prompt_tokens`` prompt at the cache hit rate, s."""
        return prompt_tokens * (1.0 - self.cache_hit_rate) * self.prefill_s_per_token


@dataclass(frozen=True, slots=True)
class ClassDemand:
    """One class's traffic over the last interval.

    Attributes:
        arrival_rps: requests that reached admission (admitted or shed), per s.
        prompt_tokens: mean prompt length, tokens.
        output_tokens: mean output length, tokens.
        queued: requests of the class waiting in the gateway now.
        ttft_goal_s: the class's TTFT goal, s.
    """

    arrival_rps: float
    prompt_tokens: float
    output_tokens: float
    queued: int
    ttft_goal_s: float


@dataclass(frozen=True, slots=True)
class PlannerInputs:
    """What :meth:`Planner.decide` decides from.

    Attributes:
        workers: workers serving the model now (eligible).
        classes: per class (band) its demand.
        engine: the measured worker speed, None while unmeasured.
    """

    workers: int
    classes: Mapping[str, ClassDemand]
    engine: EngineModel | None


@dataclass(frozen=True, slots=True)
class ClassPlan:
    """One class's part of a decision.

    Attributes:
        arrival_rps: its measured rate, requests/s.
        forecast_rps: its rate forecast at the horizon, requests/s.
        worker_s: ``w_c``, a request's cost to a worker, s (None while unmeasured).
        capacity_rps: ``1 / w_c``: one worker's rate of such requests when busy all the time, requests/s.
        needed_workers: its share of ``needed``, workers.
    """

    arrival_rps: float
    forecast_rps: float
    worker_s: float | None
    capacity_rps: float | None
    needed_workers: float


@dataclass(frozen=True, slots=True)
class PlanDecision:
    """One decision and what it came from (the gateway's ``GET /admin/planner`` shows it).

    Attributes:
        desired: workers to run.
        raw: ``ceil(needed / target_utilization)`` within the floor and ceiling, before hysteresis.
        needed_now: workers the current demand needs (fractional).
        needed_forecast: workers the demand at the horizon needs (fractional).
        batch: ``B*``, the batch the capacity is taken at (None while unmeasured).
        projected_utilization: ``needed_now / desired``, the load each decided worker would carry now.
        reason: see :data:`Reason`.
        classes: per class its part.
    """

    desired: int
    raw: int
    needed_now: float
    needed_forecast: float
    batch: float | None
    projected_utilization: float | None
    reason: Reason
    classes: dict[str, ClassPlan]


def batch_limit(engine: EngineModel, classes: Mapping[str, ClassDemand], config: PlannerConfig) -> float:
    """``B*``: the largest batch within the window, the KV target and every busy class's goal (>= 1)."""
    limit = float(engine.max_batch)
    if engine.batch and engine.kv_usage and engine.kv_usage > 0:
        limit = min(limit, engine.batch * config.kv_target / engine.kv_usage)
    if engine.step_per_seq_s > 0:
        for c in classes.values():
            if c.arrival_rps <= 0 and c.queued <= 0:
                continue
            budget = config.goal_fraction * c.ttft_goal_s - engine.prefill_s(c.prompt_tokens)
            limit = min(limit, (budget / 2.0 - engine.step_base_s) / engine.step_per_seq_s)
    return max(1.0, limit)


def worker_seconds(engine: EngineModel, demand: ClassDemand, batch: float) -> float:
    """``w_c``: what one request of ``demand``'s class costs a worker running ``batch`` sequences, s."""
    return engine.prefill_s(demand.prompt_tokens) + demand.output_tokens * engine.step_s(batch) / batch


class Planner:
    """Desired workers of one model's pool (see the module docstring). One instance per pool; call
    :meth:`decide` every ``config.interval_s``.

    Args:
        config: the settings.
        initial: the decision before the first call (e.g. the workers running at start); it counts as a
            decision of the first call's time in the scale-down window, so that a planner restarted with
            the gateway does not scale a running fleet down before it has measured anything.
    """

    def __init__(self, config: PlannerConfig | None = None, initial: int | None = None) -> None:
        self.config = cfg = config or PlannerConfig()
        start = cfg.min_workers if initial is None else initial
        self._desired = min(cfg.max_workers, max(cfg.min_workers, start))
        self._forecasters: dict[str, RateForecaster] = {}
        self._raw: deque[tuple[float, int]] = deque()  # (time, raw) over the scale-down window
        self._started = initial is None  # the first decision puts ``initial`` in the window
        self._queues: dict[str, deque[int]] = {}  # per band, its last queue depths (the median's window)
        self.last: PlanDecision | None = None

    @property
    def desired(self) -> int:
        """The last decision (``initial`` before the first)."""
        return self._desired

    def decide(self, inputs: PlannerInputs, now: float) -> PlanDecision:
        """Fold in the last interval's ``inputs`` measured at ``now`` (s) and decide."""
        cfg = self.config
        horizon = cfg.cold_start_s + cfg.interval_s
        rates: dict[str, tuple[float, float]] = {}
        noise: dict[str, tuple[float, float]] = {}  # per band: the level's and the forecast's se
        for band, c in inputs.classes.items():
            fc = self._forecasters.get(band)
            if fc is None:
                fc = self._forecasters[band] = RateForecaster(cfg.forecast)
            fc.add(c.arrival_rps, now)
            level = fc.level or 0.0
            rates[band] = (level, fc.forecast(horizon) or 0.0)
            noise[band] = (fc.level_se, fc.forecast_se(horizon))
        engine = inputs.engine
        if engine is None:
            plans = {b: ClassPlan(r[0], r[1], None, None, 0.0) for b, r in rates.items()}
            held = min(cfg.max_workers, max(cfg.min_workers, self._desired, inputs.workers))
            return self._record(PlanDecision(held, held, 0.0, 0.0, None, None, "unmeasured", plans), now)
        batch = batch_limit(engine, inputs.classes, cfg)
        now_need = ahead_need = now_var = ahead_var = 0.0
        plans = {}
        for band, c in inputs.classes.items():
            level, ahead = rates[band]
            w = worker_seconds(engine, c, batch)
            recent = self._queues.get(band)
            if recent is None:
                samples = cfg.queue_median_samples or cfg.forecast.median_samples
                recent = self._queues[band] = deque(maxlen=samples)
            recent.append(c.queued)
            queue = statistics.median(recent) * w / c.ttft_goal_s
            now_var += (noise[band][0] * w) ** 2
            ahead_var += (noise[band][1] * w) ** 2
            now_need += level * w + queue
            ahead_need += ahead * w + queue
            plans[band] = ClassPlan(level, ahead, w, 1.0 / w if w > 0 else None, level * w + queue)
        need = max(now_need, ahead_need)
        raw = min(cfg.max_workers, max(cfg.min_workers, math.ceil(need / cfg.target_utilization - 1e-9)))
        if not self._started:
            # a planner that starts (a gateway restarted) holds what runs for a scale-down window: it has
            # measured nothing yet, and a first tick before any request came in decided the floor
            self._started = True
            if cfg.scale_down_window_s > 0:
                self._raw.append((now, self._desired))
        self._raw.append((now, raw))
        while self._raw and self._raw[0][0] < now - cfg.scale_down_window_s:
            self._raw.popleft()
        prev = self._desired
        now_se = math.sqrt(now_var)
        low = max(now_need - cfg.scale_up_z * now_se, ahead_need - cfg.scale_up_z * math.sqrt(ahead_var))
        evident = math.ceil(low / cfg.target_utilization - 1e-9)
        reason: Reason
        if raw > prev and evident > prev:
            desired, reason = raw, "up"
        else:
            window_max = max(r for _, r in self._raw)
            high = now_need + cfg.scale_down_z * now_se  # the need it may be, at the noise band's edge
            projected = math.ceil(high / (cfg.target_utilization * cfg.scale_down_margin) - 1e-9)
            # the dead band: one worker at most above what that need asks for
            projected = min(projected, math.ceil(high / cfg.target_utilization - 1e-9) + 1)
            desired = min(prev, max(raw, window_max, projected))
            if desired < prev:
                reason = "down"
            elif desired == raw:
                reason = "hold"
            else:
                reason = "noise" if desired < raw else "stabilizing"
        desired = min(cfg.max_workers, max(cfg.min_workers, desired))
        if desired == cfg.min_workers and need / cfg.target_utilization < cfg.min_workers:
            reason = "floor"
        elif desired == cfg.max_workers and need / cfg.target_utilization > cfg.max_workers:
            reason = "ceiling"
        utilization = now_need / desired if desired else None
        return self._record(
            PlanDecision(desired, raw, now_need, ahead_need, batch, utilization, reason, plans), now
        )

    def _record(self, decision: PlanDecision, now: float) -> PlanDecision:
        self._desired = decision.desired
        self.last = decision
        return decision
