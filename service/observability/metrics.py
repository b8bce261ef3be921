"""Prometheus metrics (prefix ``radixgate_``), in a registry owned by the app (no module globals).

Tenant label cardinality is bounded: the first ``max_tenant_labels`` tenant ids seen keep their own
label value, later ones report as ``"other"``.

One process (the default) keeps every value in memory and ``/metrics`` serves the app's registry. With
several gateway processes on a host (``RADIXGATE_WORKERS`` > 1) ``service.runtime.host_serve`` runs them with
prometheus_client's multiprocess mode: each process writes its values to mmap files in a fresh private
directory (``observability.metrics_multiproc_dir``) and ``/metrics``, whichever process answers it, sums the
files of every process of the host (:class:`prometheus_client.multiprocess.MultiProcessCollector`):
counters and histograms add up, and each gauge says how (its ``multiprocess_mode``, see
:class:`GatewayMetrics`). That mode costs a lock and an mmap write per update, so it is never used with one
process.
"""

from __future__ import annotations

import asyncio
import fcntl
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import values as prometheus_values
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector

from service.observability.class_metrics import ClassMetrics
from service.observability.cost_metrics import CostMetrics
from service.observability.outage_metrics import OutageMetrics
from service.observability.phase_metrics import PhaseMetrics
from service.observability.planner_metrics import PlannerMetrics
from service.observability.pool_gauges import QUEUED_GAUGE, PoolGauges
from service.observability.runtime_metrics import RuntimeMetrics

# Latency buckets, seconds: from 10 ms (cached TTFT on a GPU) to 5 min (long CPU generations).
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def multiprocess_values_active() -> bool:
    """True when prometheus_client keeps metric values in mmap files: ``PROMETHEUS_MULTIPROC_DIR`` was
    set when it was first imported in this process (it chooses its value class then, once)."""
    return bool(getattr(prometheus_values.ValueClass, "_multiprocess", False))


class PoolWorkerGauges(Protocol):
    """What the scrape-time gauges read from one pool worker (:class:`service.workers.pool.WorkerState`)."""

    @property
    def url(self) -> str: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def model(self) -> str | None: ...


_Family = TypeVar("_Family", bound=MetricWrapperBase)

#: gauges that describe a pool worker now: a worker that left the pool drops out of them
_WORKER_GAUGES = frozenset(
    {
        "radixgate_worker_healthy",
        "radixgate_worker_in_flight_requests",
        "radixgate_worker_window_requests",
        QUEUED_GAUGE,
    }
)


class LiveWorkerGauges(Collector):
    """``source``'s metrics, with the per-worker gauges (``_WORKER_GAUGES``) cut to the workers in ``live``.

    prometheus_client cannot remove a label set in multiprocess mode (its mmap files keep every value a
    process wrote), so a worker removed over the admin API would stay in ``worker_healthy`` (1, or 0: an
    alert firing forever) and its in-flight and window gauges; the scrape leaves them out instead. Counters
    (errors, breaker transitions, restarts) keep the worker's label: their history stays valid. A sample
    with a ``model`` label is kept only under the worker's model now (a worker whose model became known
    leaves its ``unknown`` series behind).
    """

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source
        #: URL -> model label of the workers in this replica's pool at the current scrape
        self.live: Mapping[str, str] = {}

    def collect(self) -> Iterable[Metric]:
        """Every family of ``source``; the worker gauges' samples only for the ``live`` workers."""
        live = self.live
        for family in self.source.collect():
            if family.name in _WORKER_GAUGES:
                family.samples = [
                    s
                    for s in family.samples
                    if s.labels.get("worker") in live
                    and s.labels.get("model", live[s.labels["worker"]]) == live[s.labels["worker"]]
                ]
            yield family


class TenantLabels:
    """Maps tenant ids to bounded metric label values: the first ``cap`` tenants seen get their own label,
    the rest ``"other"``.

    Args:
        cap: how many distinct tenant ids get their own label.
        shared_path: a file that the host's gateway processes share (multiprocess mode), listing the
            labelled tenants one a line under an exclusive ``flock``, so the cap holds for the whole host
            (each process alone would label its own first ``cap``: up to N x cap series on ``/metrics``)
            and a tenant gets the same label whichever process serves it. Read only when a process meets
            a tenant for the first time, until the cap is reached. None: this process alone.
    """

    def __init__(self, cap: int, shared_path: Path | None = None) -> None:
        self._cap = cap
        self._shared_path = shared_path
        self._seen: set[str] = set()
        self._full = False
        self._lock = threading.Lock()

    def __call__(self, tenant_id: str) -> str:
        if tenant_id in self._seen:
            return tenant_id
        if self._full:
            return "other"
        with self._lock:
            if self._shared_path is None:
                labelled = len(self._seen) < self._cap
                if labelled:
                    self._seen.add(tenant_id)
            else:
                labelled = self._claim_shared(self._shared_path, tenant_id)
            self._full = self._full or len(self._seen) >= self._cap
        return tenant_id if labelled else "other"

    def _claim_shared(self, path: Path, tenant_id: str) -> bool:
        """Whether ``tenant_id`` has a label host-wide, adding it to ``path`` while there is room."""
        with open(path, "a+", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            self._seen.update(line for line in f.read().splitlines() if line)
            if tenant_id in self._seen:
                return True
            if len(self._seen) >= self._cap:
                return False
            f.write(tenant_id + "\n")
            self._seen.add(tenant_id)
            return True


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

    Gauges in multiprocess mode (``multiproc_dir`` set; ignored otherwise), each summarised over the
    host's live processes (a process uvicorn replaced is dropped by ``mark_process_dead``):

    - ``in_flight_requests``, ``queue_depth{band}``, ``settle_pending``, ``worker_in_flight_requests``:
      ``livesum``, the host's total.
    - ``worker_window_requests{worker}``: ``livesum``. Each process runs its own scheduler with its own
      AIMD window per worker; the sum is the concurrency the host as a whole may send that worker, the
      figure to compare with the summed ``worker_in_flight_requests`` and with the worker's own capacity.
      Chosen over a ``pid`` label (``liveall``) so that names and labels stay those of one process and
      dashboards read the same either way; a single process's window is in its logs (``pid``).
    - ``worker_healthy{worker}``: ``livemin``: 0 as soon as one process has the worker out of rotation
      (its breaker open or its probes failing), so an alert on 0 fires for a partial outage too.

    The two scrape-time gauges (``worker_in_flight_requests``, ``worker_healthy``) are written by
    whichever process answers ``/metrics``; in multiprocess mode every process also writes them every
    ``observability.metrics_refresh_s`` (:func:`refresh_pool_gauges`), so the others are at most that old.

    Args:
        registry: where to register the families (one per app).
        max_tenant_labels: the tenant label cap.
        multiproc_dir: prometheus_client's multiprocess directory, or None for in-memory values.
        engine_scrape_s: period of the workers' ``/metrics`` scrape behind the ``radixgate_engine_*``
            gauges (:mod:`.pool_gauges`), s; 0: none.

    Raises:
        ValueError: ``multiproc_dir`` is set but is not a directory, or prometheus_client is not in
            multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` unset when the process started) or writes to
            another directory; or it is in multiprocess mode while ``multiproc_dir`` is unset (``/metrics``
            would show one process only).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        max_tenant_labels: int,
        multiproc_dir: Path | None = None,
        engine_scrape_s: float = 0.0,
    ) -> None:
        self.registry = registry
        #: what ``/metrics`` serves: ``registry`` itself, or every process's files summed
        self.exposition = registry
        self.multiprocess = multiproc_dir is not None
        if multiproc_dir is not None:
            if not multiproc_dir.is_dir():
                raise ValueError(f"metrics_multiproc_dir {multiproc_dir} is not a directory")
            if not multiprocess_values_active():
                raise ValueError(
                    "metrics_multiproc_dir is set but prometheus_client keeps values in memory: set "
                    "PROMETHEUS_MULTIPROC_DIR to the same directory before the process starts"
                )
            self.exposition = CollectorRegistry(auto_describe=False)
            MultiProcessCollector(self.exposition, path=str(multiproc_dir))  # type: ignore[no-untyped-call, unused-ignore]
        elif multiprocess_values_active():
            raise ValueError(
                "PROMETHEUS_MULTIPROC_DIR is set but observability.metrics_multiproc_dir is not: set "
                "both to one fresh directory (python -m service serve does it when RADIXGATE_WORKERS > 1) "
                "or neither"
            )
        self._live_view = LiveWorkerGauges(self.exposition)
        self._scrape_registry = CollectorRegistry(auto_describe=False)
        self._scrape_registry.register(self._live_view)
        #: per-worker {worker, model} series: the gateway's queue per worker, the scraped engine gauges
        self.pool = PoolGauges(registry, engine_scrape_s)
        self._scrape_registry.register(self.pool)  # yielded at scrape time, never in multiprocess files
        #: event-loop lag and store-call latency, :mod:`.runtime_metrics`
        self.runtime = RuntimeMetrics(registry)
        # the multiprocess directory holds only *.db files for prometheus_client; this one is the host's
        self.tenant = TenantLabels(
            max_tenant_labels, multiproc_dir / "tenant-labels" if multiproc_dir is not None else None
        )
        #: per-class SLO series (TTFT, TPOT, E2E, outcomes, goodput), :mod:`.class_metrics`
        self.classes = ClassMetrics(registry)
        self.phases = PhaseMetrics(registry)
        self.planner = PlannerMetrics(registry)  #: radixgate_desired_workers and why, :mod:`.planner_metrics`
        self.cost = CostMetrics(registry)  #: cost per tenant and model, soft limits, :mod:`.cost_metrics`
        self.outage = OutageMetrics(registry)  #: the Redis outage policy, :mod:`.outage_metrics`
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
        self.rejected = Counter(
            "radixgate_rejected_requests_total",
            "Requests answered with an error before the pipeline admitted them (key, body, model, bounds, "
            "quota, admin routes), per status and error code; admitted ones count in requests_total.",
            ["status", "code"],
            registry=registry,
        )
        self.quota_rejections = Counter(
            "radixgate_quota_rejections_total",
            "Requests refused by a token bucket, a concurrency cap or a budget, per reason: rate_limited "
            "(429, the bucket is short for now), exceeds_burst (413, the request needs more than the "
            "bucket's burst and can never pass), concurrency_limit (429: the tenant or the key had its "
            "max_concurrent_requests in flight) or insufficient_quota (429: a budget's hard limit); bucket: "
            "requests, tokens (the tenant's own), key_requests, key_tokens, model_requests, model_tokens, "
            "tenant_concurrency, key_concurrency, tenant_budget, key_budget.",
            ["tenant", "bucket", "reason"],
            registry=registry,
        )
        self.concurrency_slots_lost = Counter(
            "radixgate_concurrency_slots_lost_total",
            "Concurrency slots whose lease ended while their request still ran (their renewal did not land "
            "within the lease, e.g. Redis unreachable): the cap did not count them from then on.",
            registry=registry,
        )
        self.quota_reservations = Counter(
            "radixgate_quota_reservations_total",
            "Quota reservations per source: lease (admitted from this replica's local lease, no Redis round "
            "trip) or redis (decided by a script call in Redis; a new lease is taken with it).",
            ["source"],
            registry=registry,
        )
        self.upstream_errors = Counter(
            "radixgate_upstream_errors_total", "Failed worker calls.", ["worker", "kind"], registry=registry
        )
        self.in_flight = Gauge(
            "radixgate_in_flight_requests",
            "Requests being served by this replica (by the host's processes in multiprocess mode).",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.worker_in_flight = Gauge(
            "radixgate_worker_in_flight_requests",
            "Requests in flight per worker.",
            ["worker"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.queue_depth = Gauge(
            "radixgate_queue_depth",
            "Requests waiting in the gateway queue per band.",
            ["band"],
            registry=registry,
            multiprocess_mode="livesum",
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
            "Queue outcomes per band and tenant: admitted, shed, expired, cancelled, first_token_timeout "
            "(dispatched, but given up with no first token by its deadline).",
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
            "Current concurrency window per worker, requests (summed over the host's processes in "
            "multiprocess mode).",
            ["worker"],
            registry=registry,
            multiprocess_mode="livesum",
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
        self.settle_journaled = Counter(
            "radixgate_settle_journaled_total",
            "Requests whose settle a stopping gateway wrote to its local journal (redis.settle_journal_dir) "
            "for the next process to replay, instead of counting it lost.",
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
            multiprocess_mode="livesum",
        )
        self.worker_healthy = Gauge(
            "radixgate_worker_healthy",
            "1 if the worker passes health checks (in every process of the host, in multiprocess mode).",
            ["worker"],
            registry=registry,
            multiprocess_mode="livemin",
        )

    def record_pool(self, workers: Iterable[PoolWorkerGauges]) -> None:
        """Set ``worker_healthy``, ``worker_in_flight_requests`` and ``worker_queued_requests`` from the
        pool's workers now."""
        workers = list(workers)
        for worker in workers:
            self.child(self.worker_healthy, worker.url).set(1 if worker.healthy else 0)
            self.child(self.worker_in_flight, worker.url).set(worker.in_flight)
        self.pool.record(workers)

    def scrape(self, workers: Iterable[PoolWorkerGauges], openmetrics: bool = False) -> bytes:
        """The Prometheus text exposition for ``/metrics`` (``openmetrics``: the OpenMetrics text format,
        which carries exemplars): the pool gauges set from ``workers`` now, and workers that left the pool
        left out of the per-worker gauges (:class:`LiveWorkerGauges`)."""
        workers = list(workers)
        self.record_pool(workers)
        self._live_view.live = self.pool.live
        if openmetrics:
            text: bytes = generate_openmetrics(self._scrape_registry)  # type: ignore[no-untyped-call]
            return text
        return generate_latest(self._scrape_registry)

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


async def refresh_pool_gauges(
    metrics: GatewayMetrics, workers: Callable[[], Iterable[PoolWorkerGauges]], interval_s: float
) -> None:
    """Write the scrape-time gauges every ``interval_s`` s until cancelled (multiprocess mode: a scrape
    answered by another process reads this one's values from its files)."""
    while True:
        metrics.record_pool(workers())
        await asyncio.sleep(interval_s)
