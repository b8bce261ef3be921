"""What a client is told of its token buckets (pure): which bucket of each kind is closest to empty, when
it is full again, and the level a replica reports for a bucket it holds a local lease of.

These feed OpenAI's rate-limit headers (``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``,
https://platform.openai.com/docs/guides/rate-limits): per kind (requests, tokens) the bucket with the fewest
units left among those a request took from (its key's, its tenant's for its model, its tenant's own), since
that one refuses the next request first. Its limit is its burst (what it holds full: the per-minute rate
unless a burst is set), its reset the time until it is full again at its refill rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from policies.token_bucket import MAX_WAIT_MS


class BucketLevel(NamedTuple):
    """One token bucket as a request left it (a named tuple: one is made per bucket of every admission, and
    a tuple is made in a third of a frozen dataclass's time).

    Attributes:
        bucket: ``"requests"`` or ``"tokens"``.
        rate_per_min: refill rate, units/min (> 0).
        capacity: burst, units (> 0).
        level: units in it (negative: in debt after an overrun).
    """

    bucket: str
    rate_per_min: float
    capacity: float
    level: float

    @property
    def remaining(self) -> int:
        """Whole units left, at least 0 (a bucket in debt has none)."""
        return max(0, math.floor(self.level))

    @property
    def reset_s(self) -> float:
        """Seconds until the bucket is full again at its rate (0 when full), at most
        :data:`policies.token_bucket.MAX_WAIT_MS`."""
        missing = self.capacity - self.level
        if missing <= 0:
            return 0.0
        return min(missing * 60.0 / self.rate_per_min, MAX_WAIT_MS / 1000.0)


def closest_to_empty(levels: Iterable[BucketLevel]) -> dict[str, BucketLevel]:
    """Per bucket kind, the bucket with the fewest whole units left (of equals, the one that takes longer
    to refill: the smaller rate for its gap). ``{}`` for no buckets."""
    chosen: dict[str, BucketLevel] = {}
    for level in levels:
        best = chosen.get(level.bucket)
        if best is None or (level.remaining, -level.reset_s) < (best.remaining, -best.reset_s):
            chosen[level.bucket] = level
    return chosen


def leased_level(level: float, rate_per_min: float, capacity: float, elapsed_s: float, held: float) -> float:
    """The level a replica reports for a bucket it holds a lease of (:mod:`policies.quota_lease`), when it
    admits a request from that lease without asking Redis.

    Args:
        level: the shared bucket's level at the replica's last Redis call for it, units (after that
            call's take and lease).
        rate_per_min: its refill rate, units/min.
        capacity: its burst, units.
        elapsed_s: seconds since that call (>= 0).
        held: units of the lease still unused on this replica.

    Returns:
        ``min(capacity, min(capacity, level + rate * elapsed / 60) + held)``: the shared level refilled
        since, plus what this replica holds. It leaves out what other replicas took meanwhile (so it may
        be high by up to that) and the leases they hold unused (so it may be low by those).
    """
    refilled = min(capacity, level + rate_per_min * max(0.0, elapsed_s) / 60.0)
    return min(capacity, refilled + held)
