"""Prometheus metrics (prefix ``radixgate_``), in a registry owned by the app (no module globals).

Tenant label cardinality is bounded: the first ``max_tenant_labels`` tenant ids seen keep their own
label value, later ones report as ``"other"``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

# Latency buckets, seconds: from 10 ms (cached TTFT on a GPU) to 5 min (long CPU generations).
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


_Family = TypeVar("_Family", bound=MetricWrapperBase)


class TenantLabels:
    """Maps tenant ids to bounded metric label values.

    Args:
        cap: how many distinct tenant ids get their own label; the rest become ``"other"``.
    """

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant_id: str) -> str:
        if tenant_id in self._seen:
            return tenant_id
        with self._lock:
            if len(self._seen) < self._cap:
                self._seen.add(tenant_id)
                return tenant_id
        return "other"


@dataclass(frozen=True, slots=True)
class RequestSeries:
    """The series one finished request updates, for one (tenant label, model, status)."""

    requests: Counter
    e2e: Histogram
    ttft: Histogram
    prompt_tokens: Counter
    completion_tokens: Counter
    cached_tokens: Counter


class GatewayMetrics:
    """Every gateway metric, registered in ``registry``.

    Args:
        registry: where to register (one per app; ``/metrics`` serves it).
        max_tenant_labels: the tenant label cap.
    """

    def __init__(self, registry: CollectorRegistry, max_tenant_labels: int) -> None:
        self.registry = registry
        self.tenant = TenantLabels(max_tenant_labels)
        self._series: dict[tuple[str, str, int], RequestSeries] = {}
        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}
        self.requests = Counter(
            "radixgate_requests_total",
            "Completed API requests.",
            ["tenant", "model", "status"],
            registry=registry,
        )
        self.ttft = Histogram(
            "radixgate_time_to_first_token_seconds",
            "Time from arrival to the first token, s.",
            ["tenant", "model"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.e2e = Histogram(
            "radixgate_request_latency_seconds",
            "Time from arrival to the last byte, s.",
            ["tenant", "model"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "radixgate_prompt_tokens_total", "Prompt tokens served.", ["tenant"], registry=registry
        )
        self.completion_tokens = Counter(
            "radixgate_completion_tokens_total", "Completion tokens served.", ["tenant"], registry=registry
        )
        self.cached_tokens = Counter(
            "radixgate_cached_tokens_total",
            "Prompt tokens served from a worker's prefix cache.",
            ["tenant"],
            registry=registry,
        )
        self.quota_rejections = Counter(
            "radixgate_quota_rejections_total",
            "Requests refused by a token bucket, per reason: rate_limited (429, the bucket is short for "
            "now) or exceeds_burst (413, the request needs more than the bucket's burst and can never pass).",
            ["tenant", "bucket", "reason"],
            registry=registry,
        )
        self.upstream_errors = Counter(
            "radixgate_upstream_errors_total", "Failed worker calls.", ["worker", "kind"], registry=registry
        )
        self.in_flight = Gauge(
            "radixgate_in_flight_requests", "Requests being served by this replica.", registry=registry
        )
        self.worker_in_flight = Gauge(
            "radixgate_worker_in_flight_requests",
            "Requests in flight per worker.",
            ["worker"],
            registry=registry,
        )
        self.queue_depth = Gauge(
            "radixgate_queue_depth",
            "Requests waiting in the gateway queue per band.",
            ["band"],
            registry=registry,
        )
        self.queue_wait = Histogram(
            "radixgate_queue_wait_seconds",
            "Time spent in the gateway queue before dispatch, s.",
            ["band"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.scheduler_outcomes = Counter(
            "radixgate_scheduler_outcomes_total",
            "Queue outcomes per band and tenant: admitted, shed, expired, cancelled.",
            ["band", "tenant", "outcome"],
            registry=registry,
        )
        self.shed = Counter(
            "radixgate_shed_total",
            "Requests refused by admission control per band and reason (predicted_ttft, costly_miss, "
            "band_full, queue_full, evicted, no_worker).",
            ["band", "reason"],
            registry=registry,
        )
        self.worker_window = Gauge(
            "radixgate_worker_window_requests",
            "Current concurrency window per worker, requests.",
            ["worker"],
            registry=registry,
        )
        self.routing_decisions = Counter(
            "radixgate_routing_decisions_total",
            "Worker choices by policy and reason.",
            ["policy", "reason"],
            registry=registry,
        )
        self.routing_predicted_cached_chars = Counter(
            "radixgate_routing_predicted_cached_chars_total",
            "Prompt characters the router expected the chosen worker to have cached.",
            registry=registry,
        )
        self.routing_prompt_chars = Counter(
            "radixgate_routing_prompt_chars_total", "Prompt characters routed.", registry=registry
        )
        self.breaker_transitions = Counter(
            "radixgate_breaker_transitions_total",
            "Circuit-breaker state changes per worker.",
            ["worker", "state"],
            registry=registry,
        )
        self.upstream_5xx_confirmations = Counter(
            "radixgate_upstream_5xx_confirmations_total",
            "Deep probes confirming a worker's 5xx answers, by verdict: confirmed (counted against its "
            "breaker), cleared (the requests' own fault), refused, no_evidence.",
            ["worker", "verdict"],
            registry=registry,
        )
        self.retries = Counter(
            "radixgate_retries_total",
            "Attempts on another worker: before the first token or mid-stream.",
            ["kind"],
            registry=registry,
        )
        self.worker_restarts = Counter(
            "radixgate_worker_restarts_total",
            "Launched workers restarted by the supervisor: reason exited (process group died) or unhealthy.",
            ["worker", "reason"],
            registry=registry,
        )
        self.store_unavailable = Counter(
            "radixgate_store_unavailable_total",
            "Requests answered 503 because Redis was exhausted, slow or unreachable, per store call.",
            ["operation"],
            registry=registry,
        )
        self.settle_failures = Counter(
            "radixgate_settle_failures_total",
            "Requests whose settle (quota reconcile and usage record) was given up: background retries "
            "spent, a script error, too many pending, or shutdown (answer kept; logged as settle_lost).",
            registry=registry,
        )
        self.settle_deferred = Counter(
            "radixgate_settle_deferred_total",
            "Settles that failed on the response path (Redis unavailable) and went to background retries.",
            registry=registry,
        )
        self.settle_pending = Gauge(
            "radixgate_settle_pending",
            "Settles being retried in the background now.",
            registry=registry,
        )
        self.worker_healthy = Gauge(
            "radixgate_worker_healthy", "1 if the worker passes health checks.", ["worker"], registry=registry
        )

    def child(self, family: _Family, *labels: str) -> _Family:
        """``family.labels(*labels)``, looked up once and kept: prometheus-client's ``labels`` takes a lock
        and validates on every call, which the request path pays several times per request. For label
        values from bounded sets only (bands, reasons, policies, tenant labels from :class:`TenantLabels`)."""
        key = (id(family), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = family.labels(*labels)
        return found  # type: ignore[return-value]

    def request_series(self, tenant_label: str, model: str, status: int) -> RequestSeries:
        """The children of the per-request metrics for these labels, looked up once and kept (tenant
        labels are bounded by :class:`TenantLabels`, models by the served list, statuses by the API)."""
        key = (tenant_label, model, status)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = RequestSeries(
                self.requests.labels(tenant_label, model, str(status)),
                self.e2e.labels(tenant_label, model),
                self.ttft.labels(tenant_label, model),
                self.prompt_tokens.labels(tenant_label),
                self.completion_tokens.labels(tenant_label),
                self.cached_tokens.labels(tenant_label),
            )
        return series
