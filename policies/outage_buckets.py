"""A replica's own token buckets while Redis cannot be reached (``redis.on_outage = open``; pure, time
injected).

While the shared buckets in Redis are out of reach, each replica admits from local buckets, one per
tenant bucket the request would have taken from in Redis (its API key's, its tenant's for its model, its
tenant's own; requests and tokens). Each holds the replica's share of the limit, never a full copy: rate
and burst divided by the number of live replicas this replica last saw (:func:`replica_share`), so N
replicas together admit at most the tenant's rate plus one burst, as the shared bucket would (each
replica's bucket starts full: burst / N). The arithmetic is :mod:`policies.token_bucket`'s (RFC 2697's
single-rate bucket, refilled lazily); a request takes from all of its buckets or none, as
``token_bucket.lua`` does, and the refusal names the first one short and waits for the slowest.

This is the "local fallback limit" of distributed rate limiters that lose their shared store (Envoy's
global rate limit service answers by its ``failure_mode_deny`` setting; per-pod fallback buckets of
``limit / pods`` in API gateways such as Kong's ``local`` policy), sized by the replicas this replica
knows of instead of a fixed divisor.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from policies.token_bucket import BucketLimit, BucketState, adjust, full_bucket, refill, wait_ms_for


def replica_share(rate_per_min: float, capacity: float, replicas: int) -> BucketLimit:
    """One replica's share of a bucket among ``replicas`` live replicas.

    Args:
        rate_per_min: the bucket's refill rate, units/min (> 0).
        capacity: its burst, units (> 0).
        replicas: live replicas this replica last saw, itself included (values below 1 count as 1).

    Returns:
        ``BucketLimit(rate_per_min / n, capacity / n)``, ``n = max(1, replicas)``.
    """
    n = max(1, replicas)
    return BucketLimit(rate_per_min / n, capacity / n)


def concurrency_share(cap: int, replicas: int) -> int:
    """One replica's share of a concurrency cap (``max_concurrent_requests``) among ``replicas`` live
    replicas: ``floor(cap / max(1, replicas))`` requests in flight (0: none while Redis is out of reach,
    so the replicas together never run more than the cap)."""
    return cap // max(1, replicas)


class LocalWant(NamedTuple):
    """One bucket a request takes from.

    Attributes:
        key: the bucket's identity (e.g. ``(tenant id, epoch, scope kind, scope name, "requests")``).
        limit: this replica's share of it (:func:`replica_share`).
        cost: units to take (1 request, or prompt + max_tokens tokens), >= 0.
    """

    key: Hashable
    limit: BucketLimit
    cost: float


@dataclass(frozen=True, slots=True)
class LocalTake:
    """Outcome of :meth:`OutageBuckets.take`.

    Attributes:
        allowed: every bucket held its cost and was debited.
        limiting: refused: the index (into the wants) of the first bucket short; None when allowed.
        never: refused because a cost exceeds that bucket's (shared) capacity: it can never pass here.
        wait_ms: refused: ms until the slowest short bucket holds its cost (``math.inf`` with ``never``).
        levels: each bucket's level after the call (refused: refilled, not debited), units.
    """

    allowed: bool
    limiting: int | None
    never: bool
    wait_ms: float
    levels: tuple[float, ...]


class OutageBuckets:
    """Local token buckets by key, at most ``max_entries`` (the least recently used dropped first: a
    dropped bucket comes back full, so the bound should exceed the buckets one outage touches).

    A bucket first seen is full (its share's capacity). When its share changes (the live replicas or the
    tenant's limits changed), its level is kept, capped at the new capacity.
    """

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self._max = max_entries
        self._states: OrderedDict[Hashable, BucketState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def _current(self, want: LocalWant, now_ms: float) -> BucketState:
        state = self._states.get(want.key)
        if state is None:
            return full_bucket(want.limit, now_ms)
        state = refill(state, want.limit, now_ms)
        if state.level > want.limit.capacity:
            state = BucketState(want.limit.capacity, state.updated_ms)
        return state

    def _store(self, key: Hashable, state: BucketState) -> None:
        self._states[key] = state
        self._states.move_to_end(key)
        while len(self._states) > self._max:
            self._states.popitem(last=False)

    def take(self, wants: Sequence[LocalWant], now_ms: float) -> LocalTake:
        """Take each want's cost from its bucket, all or none, at ``now_ms`` (ms, any monotonic epoch).

        Returns:
            A :class:`LocalTake`; refused, nothing is debited (the refill is kept), ``limiting`` names the
            first bucket short in the given order and ``wait_ms`` is the longest wait among those short.
        """
        states = [self._current(w, now_ms) for w in wants]
        limiting: int | None = None
        wait = 0.0
        never = False
        for i, (want, state) in enumerate(zip(wants, states, strict=True)):
            need = wait_ms_for(state.level, want.cost, want.limit)
            if need > 0:
                if limiting is None:
                    limiting = i
                    never = math.isinf(need)
                wait = max(wait, need)
        if limiting is None:
            states = [BucketState(s.level - w.cost, s.updated_ms) for w, s in zip(wants, states, strict=True)]
        for want, state in zip(wants, states, strict=True):
            self._store(want.key, state)
        return LocalTake(limiting is None, limiting, never, wait, tuple(s.level for s in states))

    def give_back(self, wants: Sequence[LocalWant], now_ms: float) -> None:
        """Add each want's ``cost`` back to its bucket (a refund; negative: an overrun charged), capped at
        the capacity and floored at minus it (:func:`policies.token_bucket.adjust`). A bucket no longer
        held is left alone (it comes back full anyway)."""
        for want in wants:
            if want.cost == 0 or want.key not in self._states:
                continue
            self._store(want.key, adjust(self._current(want, now_ms), want.limit, want.cost, now_ms))


__all__ = ["LocalTake", "LocalWant", "OutageBuckets", "concurrency_share", "replica_share"]
