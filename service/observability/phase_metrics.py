"""Where requests' time goes, as Prometheus series: ``radixgate_request_phase_seconds{phase}`` (each phase
of :mod:`service.observability.breakdown`) and ``radixgate_gateway_overhead_seconds`` (the gateway's own
time: neither its queue, nor a worker, nor the client; the figure LiteLLM's
``litellm_overhead_latency_metric`` and Dynamo's router-overhead histograms report).

Labels: ``phase`` only (the twelve names of :data:`~service.observability.breakdown.PHASES`): the per-class
and per-model split lives in :mod:`service.observability.class_metrics`; a phase's distribution over the
whole gateway is what tells which step a tail comes from.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from service.observability.breakdown import PHASES, RequestTiming
from service.observability.buckets import PHASE_BUCKETS_S


class PhaseMetrics:
    """The phase and overhead histograms, registered in ``registry`` (:data:`PHASE_BUCKETS_S`, 100 us to
    120 s)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.phase = Histogram(
            "radixgate_request_phase_seconds",
            "Time of each phase of a request (auth, prepare, quota, route, queue, retry, upstream_connect, "
            "engine_tokenize, engine_queue, engine_prefill, decode, client_write), s.",
            ["phase"],
            buckets=PHASE_BUCKETS_S,
            registry=registry,
        )
        self.overhead = Histogram(
            "radixgate_gateway_overhead_seconds",
            "The gateway's own time per request (neither its queue, nor a worker, nor the client), s.",
            buckets=PHASE_BUCKETS_S,
            registry=registry,
        )
        self._children = {name: self.phase.labels(name) for name in PHASES}

    def record(self, timing: RequestTiming, e2e_s: float) -> None:
        """Observe the phases ``timing`` measured, and its overhead over ``e2e_s`` (s)."""
        children = self._children
        for name, seconds in timing.phases.items():
            children[name].observe(seconds)
        self.overhead.observe(timing.overhead_s(e2e_s))
