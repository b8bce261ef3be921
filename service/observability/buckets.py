"""Histogram bucket bounds (seconds) of the gateway's metrics, and a bulk observe for per-request tallies."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Histogram

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Request latency buckets, s: from 10 ms (cached TTFT on a GPU) to 5 min (long CPU generations); the
per-tenant series (``radixgate_time_to_first_token_seconds``, ``radixgate_request_latency_seconds``)."""

SLO_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
"""Per-class latency buckets, s, 1 ms to 120 s (issue 28): TTFT goals (0.5 / 2 / 30 s by default) and
per-token times (ITL, TPOT: a few ms on a GPU, tens to hundreds on a CPU) both fall between two close
bounds, so ``histogram_quantile`` over them stays within about 30% of the true value."""

PHASE_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
"""Request phase and gateway overhead buckets, s: 100 µs (a key found in the auth cache, a quota taken from
a local lease) to 120 s (a long decode); the 1 ms .. 120 s range of :data:`SLO_BUCKETS_S` and three
bounds below it, where the gateway's own phases fall."""


def observe_tally(histogram: Histogram, counts: Sequence[int], total: float) -> None:
    """Add a tally of observations to one histogram child at once: ``counts[i]`` values in bucket ``i``
    (in the child's bucket order, ``+Inf`` last; each value <= that bucket's bound and above the one
    before) summing to ``total``. Equal to observing each value (a test holds it to that), in one
    counter update per non-empty bucket instead of one per value: a stream's inter-token gaps are
    tallied while it runs (:meth:`service.observability.breakdown.RequestTiming.token`) and added
    here once, when it ends.

    Reads prometheus_client's ``Histogram._buckets`` and ``_sum`` (the values ``observe`` itself
    increments, in memory or in multiprocess files alike)."""
    buckets = histogram._buckets
    for i, count in enumerate(counts):
        if count:
            buckets[i].inc(count)
    histogram._sum.inc(total)
