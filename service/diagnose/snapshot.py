"""A window of metrics (:mod:`.sources`) as the typed snapshot :func:`policies.diagnosis.diagnose` reads:
:class:`policies.diagnosis_types.FleetView`, once for the window and once for the baseline.

Quantiles come from histogram bucket increases, with Prometheus's own algorithm (:func:`bucket_quantile`),
so a figure here equals ``histogram_quantile(q, sum by (le) (rate(x_bucket[W])))``, the expression of
``deploy/prometheus/rules/recording.yml``'s ``:p99_5m`` rules, over the same window.

Series read (gateway, every replica summed; workers keyed by ``instance``, ``host:port``):

- gateway: ``radixgate_class_{ttft,tpot,itl,e2e}_seconds``, ``radixgate_request_phase_seconds{phase}``,
  ``radixgate_gateway_overhead_seconds``, ``radixgate_event_loop_lag_seconds``,
  ``radixgate_store_call_seconds{op}``, ``radixgate_class_requests_total{outcome}``, the token and routing
  counters, ``radixgate_queue_depth``, ``radixgate_upstream_errors_total{worker}``,
  ``radixgate_worker_healthy{worker}``;
- workers: SGLang's ``sglang:time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds``, ``queue_time_seconds``, ``num_running_reqs``, ``num_queue_reqs``,
  ``token_usage``, ``prompt_tokens_total``, ``cached_tokens_total``, ``generation_tokens_total``,
  ``num_retracted_requests_total`` (SGLang 0.5.23's name; the simulator's older
  ``num_retracted_reqs_total`` too); DCGM exporter's ``DCGM_FI_PROF_SM_ACTIVE`` and
  ``DCGM_FI_PROF_DRAM_ACTIVE`` on the same ``instance``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import httpx

from policies.diagnosis_types import NO_DATA, FleetView, GatewayView, Latency, WorkerView
from service.diagnose.sources import Key, Match, MetricSource, host_port, merged

TOTAL: Match = {"priority": ""}
"""SGLang's totals, not its per-priority breakdown."""

RETRACTED = ("sglang:num_retracted_requests_total", "sglang:num_retracted_reqs_total")


def bucket_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The ``q`` quantile (0..1) of a histogram given as (upper bound, cumulative count) pairs, ``+Inf``
    included: Prometheus's ``histogram_quantile`` (``promql/quantile.go``, ``bucketQuantile``, 2.x):
    linear interpolation inside the bucket where the rank falls (the first bucket from 0 when its bound
    is positive); a rank in the ``+Inf`` bucket gives the highest finite bound. None without
    observations, without a ``+Inf`` bucket, or with fewer than two buckets.
    """
    ordered: list[tuple[float, float]] = []
    for bound, count in sorted(buckets):
        if ordered and ordered[-1][0] == bound:
            ordered[-1] = (bound, ordered[-1][1] + count)
        else:
            ordered.append((bound, count))
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]):
        return None
    counts, running = [], 0.0
    for _, count in ordered:  # cumulative counts must not fall (Prometheus's ensureMonotonic)
        running = max(running, count)
        counts.append(running)
    total = counts[-1]
    if total <= 0 or not 0 <= q <= 1:
        return None
    rank = q * total
    index = next(i for i, c in enumerate(counts) if c >= rank)
    if index == len(ordered) - 1:
        return ordered[-2][0]
    upper = ordered[index][0]
    if index == 0 and upper <= 0:
        return upper
    lower = 0.0 if index == 0 else ordered[index - 1][0]
    below = 0.0 if index == 0 else counts[index - 1]
    inside = counts[index] - below
    if inside <= 0:
        return upper
    return lower + (upper - lower) * (rank - below) / inside


def latencies(
    src: MetricSource, name: str, by: Sequence[str] = (), match: Match | None = None, baseline: bool = False
) -> dict[Key, Latency]:
    """The distribution of histogram ``name`` (without ``_bucket``) per ``by`` group, over the window or
    the baseline."""
    buckets = src.increase(name + "_bucket", (*by, "le"), match, baseline)
    sums = src.increase(name + "_sum", by, match, baseline)
    counts = src.increase(name + "_count", by, match, baseline)
    grouped: dict[Key, list[tuple[float, float]]] = {}
    for key, value in buckets.items():
        grouped.setdefault(key[:-1], []).append((float(key[-1]), value))
    out: dict[Key, Latency] = {}
    for key, rows in grouped.items():
        count = counts.get(key, 0.0)
        if count <= 0:
            out[key] = NO_DATA
            continue
        mean = sums.get(key, 0.0) / count
        out[key] = Latency(count, mean, bucket_quantile(0.5, rows), bucket_quantile(0.99, rows))
    return out


def _one(values: dict[Key, Latency]) -> Latency:
    return values.get((), NO_DATA)


def _total(values: dict[Key, float]) -> float:
    return math.fsum(values.values())


def gateway_view(src: MetricSource, baseline: bool = False) -> GatewayView:
    """The gateway over the window (or the baseline: no gauges there)."""

    def lat(name: str) -> Latency:
        return _one(latencies(src, name, baseline=baseline))

    outcomes = src.increase("radixgate_class_requests_total", ("outcome",), baseline=baseline)
    queue = None if baseline else src.gauge("radixgate_queue_depth", ())
    return GatewayView(
        ttft=lat("radixgate_class_ttft_seconds"),
        tpot=lat("radixgate_class_tpot_seconds"),
        itl=lat("radixgate_class_itl_seconds"),
        e2e=lat("radixgate_class_e2e_seconds"),
        phases={
            k[0]: v
            for k, v in latencies(
                src, "radixgate_request_phase_seconds", ("phase",), baseline=baseline
            ).items()
        },
        overhead=lat("radixgate_gateway_overhead_seconds"),
        loop_lag=lat("radixgate_event_loop_lag_seconds"),
        store_calls={
            k[0]: v
            for k, v in latencies(src, "radixgate_store_call_seconds", ("op",), baseline=baseline).items()
        },
        served=outcomes.get(("served",), 0.0),
        shed=outcomes.get(("shed",), 0.0),
        errors=outcomes.get(("error",), 0.0),
        prompt_tokens=_total(src.increase("radixgate_prompt_tokens_total", (), baseline=baseline)),
        cached_tokens=_total(src.increase("radixgate_cached_tokens_total", (), baseline=baseline)),
        completion_tokens=_total(src.increase("radixgate_completion_tokens_total", (), baseline=baseline)),
        predicted_cached_chars=_total(
            src.increase("radixgate_routing_predicted_cached_chars_total", (), baseline=baseline)
        ),
        prompt_chars=_total(src.increase("radixgate_routing_prompt_chars_total", (), baseline=baseline)),
        queue_depth=queue.get(()) if queue else None,
    )


def worker_views(src: MetricSource, names: Sequence[str], baseline: bool = False) -> tuple[WorkerView, ...]:
    """Each worker (``instance`` values ``names``; those the engine series name are added) over the window
    or the baseline (no gauges there)."""
    by = ("instance",)

    def lat(name: str) -> dict[Key, Latency]:
        return latencies(src, name, by, baseline=baseline)

    def inc(name: str, match: Match | None = None) -> dict[Key, float]:
        return src.increase(name, by, match, baseline)

    def gauge(
        name: str, over_time: str = "avg", across: str = "sum", match: Match | None = TOTAL
    ) -> dict[Key, float]:
        if baseline:
            return {}
        return src.gauge(name, by, match, over_time, across)  # type: ignore[arg-type]

    ttft, itl = lat("sglang:time_to_first_token_seconds"), lat("sglang:inter_token_latency_seconds")
    e2e, queue_time = lat("sglang:e2e_request_latency_seconds"), lat("sglang:queue_time_seconds")
    running, queued = gauge("sglang:num_running_reqs"), gauge("sglang:num_queue_reqs")
    kv = gauge("sglang:token_usage", "max", "max")
    prompt, cached = inc("sglang:prompt_tokens_total"), inc("sglang:cached_tokens_total")
    generated = inc("sglang:generation_tokens_total")
    retracted = merged(inc(name) for name in RETRACTED)
    sm = gauge("DCGM_FI_PROF_SM_ACTIVE", across="avg", match=None)
    dram = gauge("DCGM_FI_PROF_DRAM_ACTIVE", across="avg", match=None)
    errors = _by_worker_url(src.increase("radixgate_upstream_errors_total", ("worker",), baseline=baseline))
    healthy = (
        {}
        if baseline
        else _by_worker_url(src.gauge("radixgate_worker_healthy", ("worker",), None, "min", "min"))
    )
    known = dict.fromkeys([*names, *(k[0] for k in (*ttft, *e2e) if k[0]), *errors, *healthy])
    views = []
    for name in known:
        key = (name,)
        views.append(
            WorkerView(
                name=name,
                ttft=ttft.get(key, NO_DATA),
                itl=itl.get(key, NO_DATA),
                e2e=e2e.get(key, NO_DATA),
                queue_time=queue_time.get(key, NO_DATA),
                running=running.get(key),
                queued=queued.get(key),
                kv_usage=kv.get(key),
                prompt_tokens=prompt.get(key, 0.0),
                cached_tokens=cached.get(key, 0.0),
                generated_tokens=generated.get(key, 0.0),
                requests=e2e.get(key, NO_DATA).count,
                retractions=retracted.get(key, 0.0),
                errors=errors.get(name, 0.0),
                healthy=healthy.get(name),
                sm_active=sm.get(key),
                dram_active=dram.get(key),
            )
        )
    return tuple(views)


def _by_worker_url(values: dict[Key, float]) -> dict[str, float]:
    """A gateway series keyed by its ``worker`` label (a URL), re-keyed by ``host:port``."""
    out: dict[str, float] = {}
    for (url,), value in values.items():
        try:
            name = host_port(url)
        except (httpx.InvalidURL, TypeError, ValueError):  # an odd label value: keep it as it is
            name = url
        out[name] = out.get(name, 0.0) + value
    return out


def fleet_view(src: MetricSource, workers: Sequence[str], baseline: bool = False) -> FleetView:
    """The gateway and ``workers`` (``host:port``) over the window, or over the baseline."""
    return FleetView(
        span_s=0.0 if baseline else src.span_s,
        gateway=gateway_view(src, baseline),
        workers=worker_views(src, workers, baseline),
    )
