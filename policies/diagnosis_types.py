"""The shapes :mod:`policies.diagnosis` reads and answers: a window of a gateway's and its workers' metrics
(:class:`FleetView`, once for the window and once for the span before it, the baseline), the thresholds a
verdict must pass, and the ranked verdicts with their evidence. Pure data; times in seconds.

Built by ``service/diagnose/`` from a Prometheus server or from two scrapes of the ``/metrics`` routes;
every field is optional where a deployment may lack the series (a worker without ``--enable-metrics``, no
DCGM exporter, a baseline that does not exist yet).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Cause = Literal[
    "network", "gateway", "client", "quota_store", "queueing", "prefill", "decode", "retraction", "worker"
]
"""What a verdict blames (``docs/observability.md``, "Diagnose", says what each means and how it is told)."""

CAUSE_TITLES: Mapping[Cause, str] = {
    "network": "network between gateway and workers",
    "gateway": "gateway's own time (CPU, event loop)",
    "client": "slow clients (writes wait on the client)",
    "quota_store": "quota store (Redis) latency",
    "queueing": "queueing (load over capacity)",
    "prefill": "prefill compute",
    "decode": "decode memory bandwidth",
    "retraction": "preemption / retraction (KV cache full)",
    "worker": "one worker slow or failing",
}

ROOT_CAUSES: frozenset[Cause] = frozenset({"network", "prefill", "decode", "retraction", "worker"})
"""Causes that make each request hold its slot longer: a queue that grows beside one of them is its
consequence (Little's law: the wait grows with the service time), not a cause of its own."""


@dataclass(frozen=True, slots=True)
class Latency:
    """One latency's distribution over a span, from a histogram's bucket increases.

    Attributes:
        count: observations. mean: sum / count, s. p50, p99: ``histogram_quantile`` (Prometheus's linear
        interpolation within a bucket), s. None where there is no observation.
    """

    count: float = 0.0
    mean: float | None = None
    p50: float | None = None
    p99: float | None = None


NO_DATA = Latency()


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker over a span: what its engine reports (``sglang:*``, DCGM) and what the gateway saw of it.

    Attributes:
        name: its address (``host:port``; Prometheus's ``instance``).
        ttft, itl, e2e: the engine's own time to first token, inter-token latency and request latency.
        queue_time: the engine's queue wait (``sglang:queue_time_seconds``), when it reports one.
        running, queued: mean requests in its batch and in its queue over the span.
        kv_usage: highest used share of its KV pool, 0..1.
        prompt_tokens, cached_tokens, generated_tokens: counter increases, tokens.
        requests: requests it finished. retractions: requests it retracted (KV pressure).
        errors: the gateway's failed calls to it. healthy: lowest ``worker_healthy`` (0: out of rotation).
        sm_active, dram_active: mean DCGM activity of its GPUs (0..1), when exported.
    """

    name: str
    ttft: Latency = NO_DATA
    itl: Latency = NO_DATA
    e2e: Latency = NO_DATA
    queue_time: Latency = NO_DATA
    running: float | None = None
    queued: float | None = None
    kv_usage: float | None = None
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    generated_tokens: float = 0.0
    requests: float = 0.0
    retractions: float = 0.0
    errors: float = 0.0
    healthy: float | None = None
    sm_active: float | None = None
    dram_active: float | None = None


@dataclass(frozen=True, slots=True)
class GatewayView:
    """The gateway (every replica summed) over a span.

    Attributes:
        ttft, tpot, itl, e2e: served requests' latencies (``radixgate_class_*_seconds``, all classes).
        phases: ``radixgate_request_phase_seconds`` per phase.
        overhead: ``radixgate_gateway_overhead_seconds``. loop_lag: ``radixgate_event_loop_lag_seconds``.
        store_calls: ``radixgate_store_call_seconds`` per store operation.
        served, shed, errors: requests by outcome (``radixgate_class_requests_total``).
        prompt_tokens, cached_tokens, completion_tokens: tokens of served requests.
        predicted_cached_chars, prompt_chars: the router's prefix-cache prediction, characters.
        queue_depth: mean requests in the gateway's queues.
    """

    ttft: Latency = NO_DATA
    tpot: Latency = NO_DATA
    itl: Latency = NO_DATA
    e2e: Latency = NO_DATA
    phases: Mapping[str, Latency] = field(default_factory=dict)
    overhead: Latency = NO_DATA
    loop_lag: Latency = NO_DATA
    store_calls: Mapping[str, Latency] = field(default_factory=dict)
    served: float = 0.0
    shed: float = 0.0
    errors: float = 0.0
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    completion_tokens: float = 0.0
    predicted_cached_chars: float = 0.0
    prompt_chars: float = 0.0
    queue_depth: float | None = None


@dataclass(frozen=True, slots=True)
class FleetView:
    """A gateway and its workers over ``span_s`` seconds."""

    span_s: float
    gateway: GatewayView
    workers: tuple[WorkerView, ...] = ()


@dataclass(frozen=True, slots=True)
class Thresholds:
    """What a verdict must pass to be named (defaults: ``docs/observability.md``, "Diagnose").

    Attributes:
        min_share: least share of the P99 a cause must explain (0..1).
        min_excess_s: least time a cause must add to the P99, s (below it: noise of the buckets).
        min_slowdown: least ratio of the window's engine latency to the baseline's for prefill or decode.
        min_store_call_s: least P99 of a quota-store call, s (a local Redis answers in about 1 ms).
        min_retraction_share: least retractions per finished request.
        min_worker_ratio: least ratio of one worker's latency to the other workers' median.
        min_error_share: least share of a worker's calls that failed to call it failing.
        min_hit_rate_drop: least fall of the prefix-cache hit rate (absolute, 0..1) to call it collapsed.
    """

    min_share: float = 0.15
    min_excess_s: float = 0.05
    min_slowdown: float = 1.5
    min_store_call_s: float = 0.02
    min_retraction_share: float = 0.01
    min_worker_ratio: float = 2.0
    min_error_share: float = 0.05
    min_hit_rate_drop: float = 0.3


Unit = Literal["s", "ratio", "times", "tokens/s", "count", "requests"]
"""``ratio``: a share, 0..1; ``times``: a factor (a slowdown)."""


@dataclass(frozen=True, slots=True)
class Evidence:
    """One figure behind a verdict: ``what`` measured ``value`` (``unit``) against ``reference`` (the
    baseline, the other workers, or a bound; None: none), and what the reference is (``against``)."""

    what: str
    value: float | None
    unit: Unit
    reference: float | None = None
    against: str = ""


@dataclass(frozen=True, slots=True)
class Verdict:
    """One cause, judged.

    Attributes:
        cause: what it blames. title: in words.
        score: the share of the P99 (``of``) it explains, 0..1: the ranking key.
        explained_s: the seconds of that P99 it explains.
        of: ``"TTFT P99"`` or ``"E2E P99"``.
        summary: one line saying why.
        evidence: the figures.
        worker: the worker it names (``worker`` cause).
        consequence_of: a root cause that fired beside it and explains it (it then ranks after the roots).
    """

    cause: Cause
    title: str
    score: float
    explained_s: float
    of: str
    summary: str
    evidence: tuple[Evidence, ...]
    worker: str | None = None
    consequence_of: Cause | None = None


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """What :func:`policies.diagnosis.diagnose` answers.

    Attributes:
        verdicts: the causes that passed their thresholds, ranked (roots by score, then consequences).
        rejected: the causes judged and not named, with their figures (why not: their summary).
        ttft_p99, e2e_p99, tpot_p99: the gateway's P99s over the window, s.
        served: requests served in the window. span_s: the window.
        notes: what limited the judgement (no baseline, no engine series...).
    """

    verdicts: tuple[Verdict, ...]
    rejected: tuple[Verdict, ...]
    ttft_p99: float | None
    e2e_p99: float | None
    tpot_p99: float | None
    served: float
    span_s: float
    notes: tuple[str, ...] = ()
