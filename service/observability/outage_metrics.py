"""The Redis outage policy's series (``redis.on_outage = open``, :mod:`service.pipeline.outage`):

- ``radixgate_redis_outage_mode``: 1 while this replica admits from its own buckets because Redis cannot be
  reached, else 0 (in multiprocess mode: 1 when any live process does);
- ``radixgate_outage_admissions_total{outcome}``: requests decided by the local buckets: ``admitted``,
  ``rate_limited`` (429: the replica's share of a bucket is short), ``refused`` (503: a budget, a
  concurrency cap with no share here, or a request larger than the share's burst: decided once Redis is
  back);
- ``radixgate_outage_authentications_total{outcome}``: API keys authenticated from memory: ``accepted``,
  ``refused`` (401: wrong secret or known revoked), ``unknown`` (503: not authenticated here within
  ``redis.outage_auth_stale_s``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class OutageMetrics:
    """The outage policy's series, in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.mode = Gauge(
            "radixgate_redis_outage_mode",
            "1 while this replica admits from its own buckets because Redis cannot be reached "
            "(redis.on_outage=open), else 0.",
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.admissions = Counter(
            "radixgate_outage_admissions_total",
            "Requests decided by a replica's own buckets while Redis could not be reached: admitted, "
            "rate_limited (429) or refused (503).",
            ["outcome"],
            registry=registry,
        )
        self.authentications = Counter(
            "radixgate_outage_authentications_total",
            "API keys authenticated from a replica's memory while Redis could not be reached: accepted, "
            "refused (401) or unknown (503).",
            ["outcome"],
            registry=registry,
        )
