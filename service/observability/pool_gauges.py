"""Per-worker series labelled ``{worker, model}``: the gateway's own queue for each worker, and what each
worker's engine reports on its ``/metrics``, scraped by the gateway and re-exported as ``radixgate_engine_*``.

- ``radixgate_worker_queued_requests{worker,model}``: requests waiting in the gateway's queue that the
  model's admission core placed on the worker (:attr:`policies.admission_types.WorkerSnapshot.queued`).
  A prometheus_client gauge (``livesum`` in multiprocess mode: the host's total), set whenever the pool
  gauges are (each ``/metrics`` scrape, and every ``observability.metrics_refresh_s`` in multiprocess
  mode), beside ``radixgate_worker_in_flight_requests`` and ``radixgate_worker_window_requests``.
- ``radixgate_engine_*{worker,model}`` (:data:`ENGINE_SERIES`): the last reading of each worker's
  ``/metrics`` (:func:`service.workers.worker_info.parse_load`), taken every
  ``observability.engine_scrape_s`` by :func:`scrape_engines` and yielded at scrape time by
  :class:`PoolGauges` (a custom collector: no value is written to the multiprocess files; every process
  of a host scrapes the same workers, so the one answering ``/metrics`` has the same readings). A worker
  that left the pool, or whose last good reading is older than three scrape periods (down, or no longer
  answering ``/metrics``), is left out: a stale 0.99 KV usage must not keep an alert firing. A series
  the worker does not report (``sglang:spec_accept_length`` without speculative decoding) is left out too.

Cardinality: one series per pool worker and family; the pool is bounded by configuration, discovery and
the admin API, and ``model`` by the model registry (workers not serving one of its models: ``unknown``).

Where the engine series come from (SGLang 0.5.23, ``python/sglang/srt/observability/metrics_collector.py``,
``SchedulerMetricsCollector``): ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
``sglang:token_usage``, ``sglang:cache_hit_rate``, ``sglang:gen_throughput``, ``sglang:spec_accept_length``,
``sglang:spec_accept_rate``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class WorkerLoad(Protocol):
    """A worker's reported load (:class:`service.workers.worker_info.WorkerLoad`); None: not reported."""

    @property
    def running(self) -> int: ...
    @property
    def queued(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def cache_hit_rate(self) -> float | None: ...
    @property
    def gen_throughput(self) -> float | None: ...
    @property
    def spec_accept_length(self) -> float | None: ...
    @property
    def spec_accept_rate(self) -> float | None: ...


UNKNOWN_MODEL = "unknown"
"""The ``model`` label of a worker that serves none of the gateway's models (or not known yet)."""

STALE_PERIODS = 3.0
"""A reading older than this many scrape periods is left out (a worker down or not answering)."""

QUEUED_GAUGE = "radixgate_worker_queued_requests"


@dataclass(frozen=True, slots=True)
class EngineSeries:
    """One re-exported engine gauge: its name, help, and how it is read from a :class:`WorkerLoad`."""

    name: str
    doc: str
    read: Callable[[WorkerLoad], float | None]


ENGINE_SERIES: tuple[EngineSeries, ...] = (
    EngineSeries(
        "radixgate_engine_running_requests",
        "Requests the worker's engine runs (sglang:num_running_reqs, scraped by the gateway).",
        lambda load: load.running,
    ),
    EngineSeries(
        "radixgate_engine_queued_requests",
        "Requests waiting in the worker's engine queue (sglang:num_queue_reqs, scraped by the gateway).",
        lambda load: load.queued,
    ),
    EngineSeries(
        "radixgate_engine_token_usage",
        "Fraction of the worker's KV cache in use, 0..1 (sglang:token_usage, scraped by the gateway).",
        lambda load: load.kv_usage,
    ),
    EngineSeries(
        "radixgate_engine_cache_hit_rate",
        "Prefix-cache hit rate the worker's engine reports, 0..1 (sglang:cache_hit_rate, scraped).",
        lambda load: load.cache_hit_rate,
    ),
    EngineSeries(
        "radixgate_engine_gen_throughput",
        "Generation throughput the worker's engine reports, tokens/s (sglang:gen_throughput, scraped).",
        lambda load: load.gen_throughput,
    ),
    EngineSeries(
        "radixgate_engine_spec_accept_length",
        "Mean tokens accepted per speculative verify step (sglang:spec_accept_length, scraped; only "
        "from workers that run speculative decoding).",
        lambda load: load.spec_accept_length,
    ),
    EngineSeries(
        "radixgate_engine_spec_accept_rate",
        "Accepted / proposed draft tokens, 0..1 (sglang:spec_accept_rate, scraped; only from workers "
        "that run speculative decoding).",
        lambda load: load.spec_accept_rate,
    ),
)
"""The ``radixgate_engine_*`` gauges, in exposition order."""


class PoolWorker(Protocol):
    """What the per-worker series read of one pool worker (:class:`service.workers.pool.WorkerState`)."""

    @property
    def url(self) -> str: ...
    @property
    def model(self) -> str | None: ...


class LoadSource(Protocol):
    """Where worker loads are read (:class:`service.workers.client.SGLangClient`)."""

    async def load(self, worker: str, timeout_s: float = 2.0) -> WorkerLoad | None: ...


@dataclass(frozen=True, slots=True)
class EngineReading:
    """A worker's last good ``/metrics`` reading: its model label, the load, and when (monotonic s)."""

    model: str
    load: WorkerLoad
    at: float


def model_label(worker: PoolWorker) -> str:
    """The ``model`` label of ``worker``: the registry id it serves, else :data:`UNKNOWN_MODEL`."""
    return worker.model or UNKNOWN_MODEL


class PoolGauges(Collector):
    """The per-worker ``{worker, model}`` series (module docstring).

    Register the object itself (the engine gauges, yielded at scrape time) in the registry ``/metrics``
    serves directly, never in one a multiprocess collector reads files for; ``registry`` gets the
    ``queued`` gauge.

    Args:
        registry: where the ``radixgate_worker_queued_requests`` gauge is registered.
        period_s: the engine scrape period, s (readings older than :data:`STALE_PERIODS` periods are
            left out); 0: no engine scrape, no engine series.
        clock: monotonic clock, s.

    Attributes:
        readings: worker URL -> its last good reading.
        live: worker URL -> model label, of the workers in the pool at the last :meth:`record`.
        queued_of: the gateway's queue per worker URL now (set by the app once its admission cores
            exist; None: every worker 0).
    """

    def __init__(
        self, registry: CollectorRegistry, period_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.period_s = period_s
        self._clock = clock
        self.readings: dict[str, EngineReading] = {}
        self.live: dict[str, str] = {}
        self.queued_of: Callable[[], Mapping[str, int]] | None = None
        self.queued = Gauge(
            QUEUED_GAUGE,
            "Requests waiting in the gateway's queue that the model's admission core placed on this worker "
            "(summed over the host's processes in multiprocess mode).",
            ["worker", "model"],
            registry=registry,
            multiprocess_mode="livesum",
        )

    def record(self, workers: Iterable[PoolWorker]) -> None:
        """Note the pool's workers now (:attr:`live`) and set their ``queued`` gauge."""
        self.live = {w.url: model_label(w) for w in workers}
        queued = self.queued_of() if self.queued_of is not None else {}
        for url, model in self.live.items():
            self.queued.labels(url, model).set(queued.get(url, 0))

    def note(self, worker: str, model: str, load: WorkerLoad) -> None:
        """Keep ``load`` as ``worker``'s last reading, now."""
        self.readings[worker] = EngineReading(model, load, self._clock())

    def collect(self) -> Iterable[Metric]:
        """One gauge family per :data:`ENGINE_SERIES` entry, with a sample per live worker whose reading
        is fresh and reports that series."""
        if not self.period_s:
            return
        oldest = self._clock() - STALE_PERIODS * self.period_s
        fresh = [
            (url, reading)
            for url, reading in self.readings.items()
            if url in self.live and reading.at >= oldest
        ]
        for series in ENGINE_SERIES:
            family = GaugeMetricFamily(series.name, series.doc, labels=["worker", "model"])
            for url, reading in fresh:
                value = series.read(reading.load)
                if value is not None:
                    family.add_metric([url, self.live[url]], float(value))
            yield family

    def describe(self) -> Iterable[Metric]:
        """Nothing: the families are not registered ahead (``auto_describe`` stays off)."""
        return []


async def scrape_engines(
    gauges: PoolGauges,
    source: LoadSource,
    workers: Callable[[], Iterable[PoolWorker]],
    period_s: float,
) -> None:
    """Read every pool worker's ``/metrics`` every ``period_s`` s (all at once, each within
    ``min(2, period_s)`` s) into ``gauges`` until cancelled; forget the workers that left the pool. A
    worker that does not answer keeps its last reading, which ages out (:data:`STALE_PERIODS`)."""
    timeout_s = min(2.0, period_s)
    while True:
        pool = list(workers())
        loads = await asyncio.gather(*(source.load(w.url, timeout_s) for w in pool))
        for worker, load in zip(pool, loads, strict=True):
            if load is not None:
                gauges.note(worker.url, model_label(worker), load)
        present = {w.url for w in pool}
        for url in [u for u in gauges.readings if u not in present]:
            del gauges.readings[url]
        await asyncio.sleep(period_s)


__all__ = [
    "ENGINE_SERIES",
    "QUEUED_GAUGE",
    "STALE_PERIODS",
    "UNKNOWN_MODEL",
    "EngineReading",
    "EngineSeries",
    "PoolGauges",
    "scrape_engines",
]
