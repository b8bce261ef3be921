"""Choosing a worker for a request (pure: the caller passes a snapshot of the pool and the time).

Four policies behind one interface (:class:`~policies.route_types.Router`), selected by a setting through
:func:`make_router`:

- ``round_robin``: cycle through eligible workers (:class:`RoundRobinRouter`).
- ``least_load``: fewest in-flight requests, then tokens (:class:`LeastLoadRouter`).
- ``consistent_hash``: hash ring over session id or prompt head (:mod:`policies.consistent_hash`).
- ``cache_aware``: SGLang router's prefix-tree affinity with load balancing (:mod:`policies.cache_aware`).

Every policy can be asked without committing (``choose(..., commit=False)``, then ``commit``) so that the
admission core can weigh its choice against the TTFT goal first (:mod:`policies.admission_core`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Literal

from policies.cache_aware import CacheAwareConfig, CacheAwarePolicy, is_imbalanced
from policies.consistent_hash import ConsistentHash, ConsistentHashConfig
from policies.route_types import (
    ROUTE_REASONS,
    RouteDecision,
    Router,
    RouteReason,
    WorkerView,
    candidates,
    load_key,
)

__all__ = [
    "ROUTE_REASONS",
    "CacheAwareConfig",
    "CacheAwarePolicy",
    "ConsistentHash",
    "ConsistentHashConfig",
    "LeastLoadRouter",
    "RoundRobinRouter",
    "RouteDecision",
    "RouteReason",
    "Router",
    "RouterName",
    "WorkerView",
    "candidates",
    "is_imbalanced",
    "make_router",
]

RouterName = Literal["round_robin", "least_load", "consistent_hash", "cache_aware"]


class _Stateless:
    """No-op feedback hooks shared by the policies that keep no per-worker state."""

    def remove_worker(self, url: str) -> None:
        """Nothing to forget."""

    def commit(self, url: str, prompt: str, now: float, matched: int | None = None) -> None:
        """Nothing to record."""

    def observe_peer_route(self, url: str, prompt: str, now: float) -> None:
        """Nothing to record."""

    def prefix_matches(self, prompt: str) -> dict[str, int]:
        """No tree: no predicted matches."""
        return {}

    def observe_cached_tokens(
        self,
        worker: str,
        prompt_text: str,
        engine_cached_tokens: int,
        prompt_tokens: int,
        predicted_chars: int | None = None,
    ) -> bool:
        """Feedback is not used; always False."""
        return False


class RoundRobinRouter(_Stateless):
    """Cycles through eligible workers in list order (skipping unhealthy and excluded ones); reason
    ``round_robin``; ignores prompt and time. Holds only a counter, so it is deterministic given the
    call sequence."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self,
        workers: Sequence[WorkerView],
        prompt: str,
        now: float,
        exclude: Collection[str] = (),
        session_id: str | None = None,
        commit: bool = True,
    ) -> RouteDecision | None:
        """Next eligible worker in list order; None when there is none."""
        eligible = candidates(workers, exclude)
        if not eligible:
            return None
        pick = eligible[self._next % len(eligible)]
        self._next += 1
        return RouteDecision(pick.url, "round_robin")


class LeastLoadRouter(_Stateless):
    """Least in-flight requests, then in-flight tokens, ties in list order; reason ``least_load``.

    Requests first, like the shortest-queue branch of SGLang's router (its load is the request count).
    """

    name = "least_load"

    def choose(
        self,
        workers: Sequence[WorkerView],
        prompt: str,
        now: float,
        exclude: Collection[str] = (),
        session_id: str | None = None,
        commit: bool = True,
    ) -> RouteDecision | None:
        """The least loaded eligible worker; None when there is none."""
        eligible = candidates(workers, exclude)
        if not eligible:
            return None
        return RouteDecision(min(eligible, key=load_key).url, "least_load")


def make_router(
    name: RouterName,
    *,
    cache_aware: CacheAwareConfig | None = None,
    consistent_hash: ConsistentHashConfig | None = None,
) -> Router:
    """Build the router a setting names, with optional per-policy configuration (defaults documented there).

    Raises:
        ValueError: unknown ``name``.
    """
    if name == "round_robin":
        return RoundRobinRouter()
    if name == "least_load":
        return LeastLoadRouter()
    if name == "consistent_hash":
        return ConsistentHash(consistent_hash)
    if name == "cache_aware":
        return CacheAwarePolicy(cache_aware)
    raise ValueError(f"unknown routing policy {name!r}")
