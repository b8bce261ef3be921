"""Token-bucket arithmetic (pure, time injected).

A bucket holds up to ``capacity`` units (the burst) and refills continuously at ``rate_per_min`` units per
minute (the RPM or TPM limit). A request costing ``cost`` units passes when the bucket holds at least
``cost``; otherwise it must wait ``ceil((cost - level) / rate)`` ms. This is the classic token bucket of
RFC 2697 / RFC 4115 (single rate, committed burst), refilled lazily from elapsed time as in most
distributed rate limiters (e.g. Stripe's and GitHub's Redis limiters).

``tenancy/token_bucket.lua`` performs exactly this arithmetic inside Redis; the two are tested on one
table (``tests/policies/test_token_bucket.py``), so keep them in step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MS_PER_MIN = 60_000.0
MAX_WAIT_MS = 1e13
"""Longest wait (and bucket key lifetime) ever computed, ms (~317 years): a rate as slow as the admin API
allows (any > 0 per minute) would otherwise give waits beyond what Redis takes as an integer (the Lua
script's PEXPIRE failed: a 500; its integer reply wrapped). Below 1e14, so that Lua's own number-to-string
conversion (``%.14g`` before Redis 7) still writes it as digits."""


@dataclass(frozen=True, slots=True)
class BucketLimit:
    """A bucket's configuration.

    Attributes:
        rate_per_min: refill rate, units per minute (requests/min or tokens/min); > 0.
        capacity: burst size, units; > 0. A cost above it can never be admitted.
    """

    rate_per_min: float
    capacity: float

    def __post_init__(self) -> None:
        if self.rate_per_min <= 0 or self.capacity <= 0:
            raise ValueError("rate_per_min and capacity must be > 0")


@dataclass(frozen=True, slots=True)
class BucketState:
    """A bucket's stored state: ``level`` units at time ``updated_ms`` (ms, any monotonic epoch)."""

    level: float
    updated_ms: float


@dataclass(frozen=True, slots=True)
class TakeResult:
    """Outcome of :func:`try_take`.

    Attributes:
        allowed: the cost was taken.
        state: the state to store (refilled, and debited when allowed).
        wait_ms: when refused, ms until the bucket holds ``cost`` (0 when allowed; ``math.inf`` when the
            cost exceeds the capacity and can never pass).
    """

    allowed: bool
    state: BucketState
    wait_ms: float


def full_bucket(limit: BucketLimit, now_ms: float) -> BucketState:
    """Return the state of a bucket seen for the first time: full at ``now_ms``."""
    return BucketState(level=limit.capacity, updated_ms=now_ms)


def refill(state: BucketState, limit: BucketLimit, now_ms: float) -> BucketState:
    """Return ``state`` refilled for the time elapsed until ``now_ms`` (ms), capped at the capacity.

    Time going backwards (clock skew) refills nothing and keeps the stored timestamp.
    """
    elapsed = now_ms - state.updated_ms
    if elapsed <= 0:
        return state
    level = min(limit.capacity, state.level + elapsed * limit.rate_per_min / MS_PER_MIN)
    return BucketState(level=level, updated_ms=now_ms)


def wait_ms_for(level: float, cost: float, limit: BucketLimit) -> float:
    """Milliseconds until a bucket at ``level`` holds ``cost`` units (0 if it already does), at most
    :data:`MAX_WAIT_MS`; ``math.inf`` when ``cost`` is above the capacity."""
    if cost > limit.capacity:
        return math.inf
    if level >= cost:
        return 0.0
    return min(float(math.ceil((cost - level) * MS_PER_MIN / limit.rate_per_min)), MAX_WAIT_MS)


def try_take(state: BucketState, limit: BucketLimit, cost: float, now_ms: float) -> TakeResult:
    """Refill ``state`` to ``now_ms`` and take ``cost`` units if they are there.

    Args:
        state: stored state (use :func:`full_bucket` for a new bucket).
        limit: the bucket's rate and capacity.
        cost: units to take (>= 0), e.g. 1 request or prompt+max_tokens tokens.
        now_ms: current time, ms.

    Returns:
        A :class:`TakeResult`; the state is debited only when allowed.
    """
    current = refill(state, limit, now_ms)
    wait = wait_ms_for(current.level, cost, limit)
    if wait > 0:
        return TakeResult(allowed=False, state=current, wait_ms=wait)
    return TakeResult(allowed=True, state=BucketState(current.level - cost, current.updated_ms), wait_ms=0.0)


def adjust(state: BucketState, limit: BucketLimit, delta: float, now_ms: float) -> BucketState:
    """Refill to ``now_ms`` then add ``delta`` units (refund > 0, overrun charge < 0).

    The level is capped at the capacity and floored at ``-capacity``: an overrun can put a tenant into
    debt (later requests wait for it to be paid back) but never more than one burst deep.
    """
    current = refill(state, limit, now_ms)
    level = max(-limit.capacity, min(limit.capacity, current.level + delta))
    return BucketState(level=level, updated_ms=current.updated_ms)
