"""Types every routing policy shares: the worker snapshot, the decision, and the router interface.

Kept apart from :mod:`policies.routing` (which re-exports them) so the policy modules can import them
without an import cycle through the factory.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

RouteReason = Literal[
    "cache_hit", "cache_miss", "imbalance", "round_robin", "hash", "least_load", "spill", "retry"
]
"""Why a worker was chosen; a small closed set, suitable as a metrics label. ``spill``: the admission core
sent the request elsewhere because the policy's choice could not meet its TTFT goal; ``retry``: another
worker after a failed attempt."""

ROUTE_REASONS: tuple[RouteReason, ...] = get_args(RouteReason)
"""All values of :data:`RouteReason`, e.g. to pre-register a Prometheus label set."""


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What routing knows of a worker at decision time.

    Attributes:
        url: the worker's base URL (its identity).
        healthy: passing health checks and accepting new requests.
        in_flight: requests the gateway has running on it (the "load" of SGLang's router).
        in_flight_tokens: tokens (prompt + max_tokens) of those requests.
        full: the request being routed would wait here for a slot of the gateway's window (requests are
            queued for it, or its window is full); False below capacity.
    """

    url: str
    healthy: bool
    in_flight: int = 0
    in_flight_tokens: int = 0
    full: bool = False


def candidates(workers: Sequence[WorkerView], exclude: Collection[str] = ()) -> list[WorkerView]:
    """Healthy workers not in ``exclude`` (e.g. those a retry already tried), in input order."""
    return [w for w in workers if w.healthy and w.url not in exclude]


def load_key(w: WorkerView) -> tuple[int, int]:
    """Sort key for "least loaded": in-flight requests, then in-flight tokens (SGLang's load is requests)."""
    return (w.in_flight, w.in_flight_tokens)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The worker chosen for one request and why.

    Attributes:
        url: the chosen worker's URL.
        reason: which branch of the policy chose it (see :data:`RouteReason`).
        matched_chars: characters of the prompt the router's prefix tree predicts the chosen worker has
            cached (0 for policies without a tree). Pass it back to ``observe_cached_tokens``.
        match_rate: ``matched_chars / len(prompt)`` in [0, 1]; 0.0 for an empty prompt.
    """

    url: str
    reason: RouteReason
    matched_chars: int = 0
    match_rate: float = 0.0


class Router(Protocol):
    """The one interface the service uses for every routing policy (selected by a setting).

    Times are the caller's monotonic clock in **seconds** (float).
    """

    @property
    def name(self) -> str:
        """The policy's setting name: round_robin, least_load, consistent_hash or cache_aware."""
        ...

    def choose(
        self,
        workers: Sequence[WorkerView],
        prompt: str,
        now: float,
        exclude: Collection[str] = (),
        session_id: str | None = None,
        commit: bool = True,
    ) -> RouteDecision | None:
        """Pick a worker among the healthy, non-excluded ``workers``; None when there is none.

        Args:
            workers: snapshot of the pool (order matters only for ties).
            prompt: the rendered prompt text as sent to the worker.
            now: caller's monotonic clock, seconds.
            exclude: URLs not to use (a retry's already-failed workers).
            session_id: optional sticky key (used by consistent hashing).
            commit: record the choice in the policy's state (the cache-aware tree learns that the worker
                now holds the prompt). False lets the caller weigh the choice first and :meth:`commit`
                the worker it finally uses.
        """
        ...

    def commit(self, url: str, prompt: str, now: float, matched: int | None = None) -> None:
        """Record that ``prompt`` was sent to ``url`` at ``now`` (s); no-op for stateless policies.
        ``matched``: the characters :meth:`choose` or :meth:`prefix_matches` predicted cached on ``url``
        just before (None: looked up again)."""
        ...

    def observe_peer_route(self, url: str, prompt: str, now: float) -> None:
        """Record that another gateway replica sent ``prompt`` to ``url`` at ``now`` (s), as :meth:`commit`
        does but without remembering a prediction for feedback (that replica gets the engine's answer).
        No-op for stateless policies."""
        ...

    def prefix_matches(self, prompt: str) -> dict[str, int]:
        """Prompt characters each worker is predicted to hold cached (empty for policies without a tree)."""
        ...

    def remove_worker(self, url: str) -> None:
        """Forget all state about a worker that left the pool."""
        ...

    def observe_cached_tokens(
        self,
        worker: str,
        prompt_text: str,
        engine_cached_tokens: int,
        prompt_tokens: int,
        predicted_chars: int | None = None,
    ) -> bool:
        """Feedback after a request: the engine's reported cached prompt tokens.

        Returns:
            True when the feedback made the router drop state about ``worker`` (for a metric/log line).
        """
        ...
