"""Local quota leases: units a gateway process takes from a tenant's shared token buckets ahead of its
requests, so that most admissions need no Redis round trip (pure, time injected).

A lease is taken in the same atomic step as a request's own reservation (``tenancy/token_bucket.lua``,
mode ``lease``): the request's units plus up to :func:`lease_size` more per bucket, never more than the
bucket holds. Later requests of that tenant on this process draw on the lease while it covers them; a
lease that no longer does, or that has expired, goes back to Redis with the next reservation (or a
sweeper) and a fresh one is taken.

Leased units were debited from the shared bucket, so no replica ever admits more than the bucket allows:
a lease only holds back what other replicas could have had, at most ``horizon_s`` seconds of the
tenant's rate (and ``max_fraction`` of its burst) per replica, for at most ``ttl_s``. A tenant near its
limit gets smaller leases (a grant is bounded by the level), and none once its bucket is short.

The idea is Google's Doorman (capacity leases handed to clients, refreshed before they expire,
https://github.com/youtube/doorman) and the "local batch" of Envoy's and Lyft's global rate limiters,
applied to one token bucket per tenant and bucket kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Terms = tuple[object, ...]
"""What a lease was granted under (the tenant's epoch and limits): a lease serves only requests under
equal terms, so a changed quota or a re-created tenant never draws on an old lease."""


def lease_size(
    rate_per_min: float | None, capacity: float | None, horizon_s: float, max_fraction: float
) -> int:
    """Units to lease from one bucket beyond a request's own, whole units.

    Args:
        rate_per_min: the bucket's refill rate (RPM or TPM), units/min; None: unlimited (no lease).
        capacity: the bucket's burst, units.
        horizon_s: seconds of the rate one lease may hold, s.
        max_fraction: the largest share of the burst one lease may hold (0-1).

    Returns:
        ``floor(min(rate_per_min / 60 * horizon_s, capacity * max_fraction))``, and 0 for an unlimited
        bucket or a zero horizon. Small quotas lease nothing: a 60 RPM tenant at ``horizon_s`` 0.5
        leases 0 requests, so its every request is decided by Redis, as without leases.
    """
    if rate_per_min is None or capacity is None or horizon_s <= 0 or max_fraction <= 0:
        return 0
    return max(0, math.floor(min(rate_per_min / 60.0 * horizon_s, capacity * max_fraction)))


@dataclass(slots=True)
class QuotaLease:
    """Units one process holds of one tenant's buckets.

    Attributes:
        terms: what it was granted under (:data:`Terms`).
        requests: request units left (``math.inf`` for an unlimited bucket).
        tokens: token units left (``math.inf`` for an unlimited bucket).
        expires_s: monotonic time, s, after which it serves nothing and goes back.
    """

    terms: Terms
    requests: float
    tokens: float
    expires_s: float

    def take(self, terms: Terms, requests: float, tokens: float, now_s: float) -> bool:
        """Draw ``requests`` and ``tokens`` from the lease if it covers both, under equal terms and before
        it expires; returns whether it did (nothing is drawn otherwise)."""
        if terms != self.terms or now_s >= self.expires_s:
            return False
        if self.requests < requests or self.tokens < tokens:
            return False
        self.requests -= requests
        self.tokens -= tokens
        return True

    def leftover(self) -> tuple[float, float]:
        """``(requests, tokens)`` still held, an unlimited bucket's as 0 (nothing to give back)."""
        return (
            0.0 if math.isinf(self.requests) else self.requests,
            0.0 if math.isinf(self.tokens) else self.tokens,
        )

    def merge(self, other: QuotaLease) -> None:
        """Add ``other`` (a lease granted under the same terms meanwhile) to this one; the later expiry
        stands."""
        self.requests += other.requests
        self.tokens += other.tokens
        self.expires_s = max(self.expires_s, other.expires_s)
