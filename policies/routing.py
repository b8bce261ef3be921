"""Choosing a worker for a request (pure: the caller passes a snapshot of the pool).

Policies here: round robin and least load. Cache-aware routing builds on the same
:class:`WorkerView` snapshot.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What routing knows of a worker at decision time.

    Attributes:
        url: the worker's base URL (its identity).
        healthy: passing health checks and accepting new requests.
        in_flight: requests the gateway has running on it.
        in_flight_tokens: tokens (prompt + max_tokens) of those requests.
    """

    url: str
    healthy: bool
    in_flight: int = 0
    in_flight_tokens: int = 0


def candidates(workers: Sequence[WorkerView], exclude: Collection[str] = ()) -> list[WorkerView]:
    """Healthy workers not in ``exclude`` (e.g. those a retry already tried)."""
    return [w for w in workers if w.healthy and w.url not in exclude]


class RoundRobin:
    """Cycles through eligible workers in order; skips unhealthy and excluded ones.

    Holds only a counter; ``choose`` is deterministic given the call sequence.
    """

    def __init__(self) -> None:
        self._next = 0

    def choose(self, workers: Sequence[WorkerView], exclude: Collection[str] = ()) -> WorkerView | None:
        """Next eligible worker, or None if there is none."""
        eligible = candidates(workers, exclude)
        if not eligible:
            return None
        pick = eligible[self._next % len(eligible)]
        self._next += 1
        return pick


def least_loaded(workers: Sequence[WorkerView], exclude: Collection[str] = ()) -> WorkerView | None:
    """Eligible worker with the fewest in-flight tokens, then requests; ties keep list order."""
    eligible = candidates(workers, exclude)
    if not eligible:
        return None
    return min(eligible, key=lambda w: (w.in_flight_tokens, w.in_flight))
