"""Prometheus metrics of the simulated SGLang worker, under SGLang's own ``sglang:`` names.

Names follow SGLang's ``--enable-metrics`` output (``python/sglang/srt/metrics/collector.py``): gauges
``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:num_used_tokens``, ``sglang:token_usage``,
``sglang:cache_hit_rate``, ``sglang:gen_throughput`` (tokens/s); counters ``sglang:prompt_tokens_total``,
``sglang:generation_tokens_total``, ``sglang:cached_tokens_total``, ``sglang:num_requests_total``,
``sglang:num_aborted_requests_total``; histograms (seconds)
``sglang:time_to_first_token_seconds``, ``sglang:inter_token_latency_seconds``,
``sglang:e2e_request_latency_seconds``. Every series has the label ``model_name``. Latencies are in the
simulated clock (seconds of the modelled GPU, not of the ``--speed``-scaled wall clock).

Retractions, as SGLang 0.5.23 counts them (``observability/metrics_collector.py``; the scheduler's
``update_running_batch`` calls ``increment_retracted_reqs`` after ``retract_decode``): the counters
``sglang:num_retracted_requests_total``, ``sglang:num_retracted_input_tokens_total`` and
``sglang:num_retracted_output_tokens_total`` count the requests retracted for KV space during decode and
their prompt and output tokens (a priority preemption is not counted there, though it adds to the
request's ``meta_info.num_retractions``); the gauge ``sglang:num_retracted_reqs`` is the requests retracted
since the previous report (SGLang sets it per stats interval and zeroes it after logging it; here per
scrape of ``/metrics``).

One :class:`SimMetrics` per server, on its own registry (no process-wide state).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from loadgen.sim.engine import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 60, 120, 300, 600)


class SimMetrics:
    """The worker's metric families on a private registry.

    Args:
        model_name: value of the ``model_name`` label.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._model = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"sglang:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"sglang:{name}", doc, labels, registry=r)

        self.running = gauge("num_running_reqs", "Running requests (prefilling or decoding).")
        self.queued = gauge("num_queue_reqs", "Requests waiting to be scheduled.")
        self.used_tokens = gauge("num_used_tokens", "KV slots held by running requests (tokens).")
        self.token_usage = gauge("token_usage", "Used share of the KV pool (0-1).")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prefix cache hit rate over prompt tokens (0-1).")
        self.gen_throughput = gauge("gen_throughput", "Generation throughput (tokens/s).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache.")
        self.requests = counter("num_requests", "Requests finished (length or stop).")
        self.aborted = counter("num_aborted_requests", "Requests aborted.")
        self._retraction_families(gauge, counter)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds", "Time to first token (s).", labels, registry=r,
            buckets=TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds", "Time between tokens (s).", labels, registry=r,
            buckets=ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds", "Request latency (s).", labels, registry=r,
            buckets=E2E_BUCKETS,
        )  # fmt: skip
        self._seen = {"prompt": 0, "generated": 0, "cached": 0}

    def render(self, stats: EngineStats) -> bytes:
        """Refresh gauges and engine counters from ``stats``; the Prometheus text exposition."""
        m = self._model
        self.running.labels(m).set(stats.num_running_reqs)
        self.queued.labels(m).set(stats.num_queue_reqs)
        self.used_tokens.labels(m).set(stats.num_used_tokens)
        self.token_usage.labels(m).set(stats.token_usage)
        self.cache_hit_rate.labels(m).set(stats.cache_hit_rate)
        self.gen_throughput.labels(m).set(stats.gen_throughput)
        for key, total, family in (
            ("prompt", stats.prompt_tokens_total, self.prompt_tokens),
            ("generated", stats.generation_tokens_total, self.generation_tokens),
            ("cached", stats.cached_tokens_total, self.cached_tokens),
        ):
            family.labels(m).inc(max(0, total - self._seen[key]))
            self._seen[key] = max(total, self._seen[key])
        self._render_retractions(stats)
        self.requests.labels(m).inc(0)
        self.aborted.labels(m).inc(0)
        return generate_latest(self.registry)

    def _retraction_families(
        self, gauge: Callable[[str, str], Gauge], counter: Callable[[str, str], Counter]
    ) -> None:
        """SGLang 0.5.23's retraction series (see the module docstring)."""
        self.retracted_now = gauge("num_retracted_reqs", "Requests retracted since the previous report.")
        self.retracted = counter("num_retracted_requests", "Requests retracted for KV space (decode).")
        self.retracted_input = counter("num_retracted_input_tokens", "Prompt tokens of retracted requests.")
        self.retracted_output = counter("num_retracted_output_tokens", "Output tokens of retracted requests.")
        self._retracted_seen = (0, 0, 0)

    def _render_retractions(self, stats: EngineStats) -> None:
        m = self._model
        now = (
            stats.retracted_requests_total,
            stats.retracted_input_tokens_total,
            stats.retracted_output_tokens_total,
        )
        for family, total, seen in zip(
            (self.retracted, self.retracted_input, self.retracted_output),
            now,
            self._retracted_seen,
            strict=True,
        ):
            family.labels(m).inc(max(0, total - seen))
        self.retracted_now.labels(m).set(max(0, now[0] - self._retracted_seen[0]))
        self._retracted_seen = now

    def observe_first_token(self, seconds: float) -> None:
        """Record a time to first token (s)."""
        self.ttft.labels(self._model).observe(seconds)

    def observe_token_gap(self, seconds: float) -> None:
        """Record a gap between two tokens of one request (s)."""
        self.itl.labels(self._model).observe(seconds)

    def observe_finished(self, seconds: float) -> None:
        """Record a finished request's latency (s)."""
        self.e2e.labels(self._model).observe(seconds)
        self.requests.labels(self._model).inc()

    def observe_aborted(self) -> None:
        """Count an aborted request."""
        self.aborted.labels(self._model).inc()
