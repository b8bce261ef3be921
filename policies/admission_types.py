"""The admission core's inputs and outputs: requests in, decisions out (frozen dataclasses, no behaviour).

Kept apart from :mod:`policies.admission_core` so adapters (the gateway's asyncio scheduler, the fleet
simulation) can import the vocabulary without the machinery. Times are seconds on the caller's clock;
sizes are tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from policies.cache_aware import CacheAwareConfig
from policies.classes import ClassPolicy, default_classes
from policies.estimates import EstimateConfig
from policies.route_types import RouteDecision
from policies.routing import RouterName
from policies.windows import WindowConfig

ShedReason = Literal["predicted_ttft", "costly_miss", "band_full", "queue_full", "evicted", "no_worker"]
"""Why a request was refused: its predicted TTFT exceeds its class's goal; it needs a long uncached prefill
on a worker past capacity (it would displace cheaper work); its band or the whole queue is full; it was
pushed out of a full queue by a higher band; no worker is eligible."""


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """A request the gateway has authenticated, priced and charged to its tenant's quota.

    Attributes:
        rid: unique request id.
        tenant: tenant id (the fair-queuing flow).
        band: priority class name.
        prompt: rendered prompt text (the routing key; prefix matches are counted in its characters).
        prompt_tokens: prompt length, tokens.
        max_tokens: completion limit, tokens.
        arrival: when the request reached the gateway, s (its TTFT goal counts from here).
        weight: the tenant's fair-queuing weight (> 0).
        session_id: sticky routing key (consistent hashing), if any.
        reports_first_token: the caller will call ``first_token`` when it arrives (a streamed answer);
            otherwise the core assumes the first token at its predicted time.
        sequences: sequences the engine runs for it at once (OpenAI's ``n`` choices, each its own SGLang
            request): the slots it takes in its worker's window, whose size counts the engine's running
            requests (SGLang's ``max_running_requests`` counts sequences). ``max_tokens`` is then the
            choices' total. A request wider than the window is sent alone to an idle worker.
    """

    rid: str
    tenant: str
    band: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    weight: float = 1.0
    session_id: str | None = None
    reports_first_token: bool = True
    sequences: int = 1

    @property
    def cost(self) -> int:
        """Tokens the request may occupy: prompt + max_tokens."""
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send request ``rid`` to ``worker`` now.

    Attributes:
        rid: the request.
        worker: the worker's URL.
        route: the routing decision (reason, predicted cached characters).
        queued_s: time spent in the gateway's queue, s.
        predicted_ttft_s: the TTFT predicted at admission, s (0 while the worker's rates are unknown).
    """

    rid: str
    worker: str
    route: RouteDecision
    queued_s: float
    predicted_ttft_s: float


@dataclass(frozen=True, slots=True)
class Shed:
    """Refuse request ``rid`` (503 with ``Retry-After``); nothing was sent to a worker.

    Attributes:
        rid: the request.
        band: its class.
        reason: see :data:`ShedReason`.
        retry_after_s: when a retry may succeed, s (the predicted wait, at least 1 s).
        predicted_ttft_s: the prediction that refused it, s (None for the other reasons).
    """

    rid: str
    band: str
    reason: ShedReason
    retry_after_s: float
    predicted_ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class Expire:
    """Request ``rid`` is given up unserved (503): it waited in the queue past its dispatch deadline, or
    (``in_engine``) it was dispatched and its first token did not come by its first-token deadline
    (:attr:`CoreConfig.first_token_deadline_factor`); the adapter then ends its worker request.

    Attributes:
        rid: the request.
        band: its class.
        waited_s: time since its arrival, s.
        tenant: its tenant (set when ``in_engine``: the adapter finds the running request by it).
        in_engine: it had been dispatched (the core already freed its slot).
        predicted_ttft_s: the TTFT predicted at its admission, s (0 while its worker's rates were unknown).
    """

    rid: str
    band: str
    waited_s: float
    tenant: str = ""
    in_engine: bool = False
    predicted_ttft_s: float = 0.0


Decision = Dispatch | Shed | Expire


@dataclass(frozen=True, slots=True)
class CoreConfig:
    """Everything the admission core decides with; defaults are the gateway's defaults.

    Attributes:
        classes: priority classes by name (:mod:`policies.classes`).
        window: per-worker window controller (:mod:`policies.windows`).
        routing: routing policy (:func:`policies.routing.make_router`).
        cache_aware: settings of the cache-aware policy (SGLang router's defaults, but its load-balance
            branch off: the core weighs misses against waits itself).
        estimates: smoothing of the measured rates (:mod:`policies.estimates`).
        max_queue_total: most requests queued across all bands and workers.
        load_report_interval_s: how often the adapter feeds each worker's load report (:meth:`load`), s;
            the windows' controllers count in reports (the gateway polls ``/metrics`` this often).
        lower_band_prefill_guard: a request below the top band is dispatched only while the worker's
            predicted engine TTFT, its own prefill included, stays within this fraction of the top band's
            goal (when anything is prefilling there at all): lower work then never fills the engine's
            prefill queue so far that a top-band request arriving next would miss its goal (SGLang
            schedules prefills by priority, but a step already running with lower work must end first).
        dispatch_margin: a queued request is dispatched only if its predicted first token, with the
            engine's part stretched by this fraction, still meets its goal (the prediction is a mean).
        slo_admission: shed requests predicted to miss their TTFT goal and expire queued ones at their
            deadline (False: the first round's behaviour, a fixed queue-wait budget; an ablation).
        spill: when the policy's worker cannot meet the goal, use the worker predicted to be fastest, cache
            miss included (False: stay with the policy's worker; an ablation).
        fair_queuing: weighted fair queuing between tenants inside a band (False: every tenant is one
            flow, first come first served; an ablation).
        first_token_deadline_factor: a dispatched request that reports its first token, of a class below
            the top one that does not serve late answers, whose first token has not come ``factor x`` its
            class's goal after its arrival while a higher class has work in flight on its worker is given
            up (:class:`Expire` ``in_engine``): inside the engine, higher classes' arrivals and SGLang's
            priority preemption can hold lower work back for as long as they keep coming, and the client
            would wait with no answer (minutes were seen on a CPU worker). With no higher work there it
            waits its turn in a queue that drains, and is looked at again one goal later. Not for
            requests whose own prefill exceeds the goal (admitted as ``beyond_goal``). 0: never.
    """

    classes: Mapping[str, ClassPolicy] = field(default_factory=default_classes)
    window: WindowConfig = field(default_factory=WindowConfig)
    routing: RouterName = "cache_aware"
    cache_aware: CacheAwareConfig = field(default_factory=lambda: CacheAwareConfig(balance=False))
    estimates: EstimateConfig = field(default_factory=EstimateConfig)
    max_queue_total: int = 10000
    load_report_interval_s: float = 1.0
    lower_band_prefill_guard: float = 0.5
    dispatch_margin: float = 0.25
    slo_admission: bool = True
    spill: bool = True
    fair_queuing: bool = True
    first_token_deadline_factor: float = 3.0

    def __post_init__(self) -> None:
        if self.first_token_deadline_factor < 0 or (0 < self.first_token_deadline_factor < 1):
            raise ValueError("first_token_deadline_factor must be 0 (off) or >= 1")


IDLE_TTFT_PROMPT_TOKENS = 1000
"""Uncached prompt tokens of the request :attr:`WorkerSnapshot.idle_ttft_s` is predicted for (a short
chat's system prompt and question: below ``EstimateConfig.long_prefill_tokens``, where the per-token model
takes over)."""


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """The core's view of one worker, for metrics and the admin API.

    Attributes:
        url: the worker.
        eligible: accepting new requests (healthy, not draining).
        window: current window, requests.
        in_flight: requests dispatched and not finished.
        queued: requests waiting in the gateway for this worker.
        capacity_rps: measured completions per second when saturated (None while unknown).
        ttft_base_s: the fixed part of the worker's engine TTFT model (dispatch to first token, the part
            not explained by prefill tokens: scheduling step, decode interleave), s (None while unknown).
            Not a TTFT: a prefill's per-token cost comes on top of it.
        prefill_s_per_token: the per-token part of that model, s per uncached prompt token (None while
            unknown).
        idle_ttft_s: the engine TTFT the model predicts here for a request of
            :data:`IDLE_TTFT_PROMPT_TOKENS` uncached prompt tokens with nothing ahead of it, s
            (``ttft_base_s`` + that many tokens at ``prefill_s_per_token``; None while neither part is
            known): what an idle worker can do at best, to compare with a class's TTFT goal.
        prediction_scales: per class (band) with a calibrated scale, the factor its predicted queue waits
            on this worker are scaled by now (:meth:`policies.estimates.WorkerEstimates.on_goal_outcome`).
    """

    url: str
    eligible: bool
    window: int
    in_flight: int
    queued: int
    capacity_rps: float | None
    ttft_base_s: float | None
    prefill_s_per_token: float | None = None
    idle_ttft_s: float | None = None
    prediction_scales: dict[str, float] = field(default_factory=dict)
