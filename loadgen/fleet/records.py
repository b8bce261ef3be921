"""What a fleet simulation records: one :class:`RequestRecord` per request, a :class:`WorkerTally` per worker.

Times are virtual seconds from the start of the run; sizes are tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Outcome = Literal["ok", "quota", "too_large", "shed", "evicted", "expired", "unfinished"]
"""``ok`` served (HTTP 200); ``quota`` 429 (token bucket); ``too_large`` 413 (above a bucket's burst);
``shed`` 503 at arrival (``policies.admission_core``); ``evicted`` 503, pushed out of a full queue by a
higher band; ``expired`` 503 ``queue_timeout`` (its dispatch deadline passed while queued); ``unfinished``
still queued or running when the run was cut off."""

HTTP_STATUS: dict[Outcome, int] = {
    "ok": 200,
    "quota": 429,
    "too_large": 413,
    "shed": 503,
    "evicted": 503,
    "expired": 503,
    "unfinished": 0,
}


@dataclass(slots=True)
class RequestRecord:
    """One request's life.

    Attributes:
        rid, tenant, band: identity, tenant id and the priority class it ran in.
        arrival_s: when the client sent it.
        prompt_tokens, max_tokens: its size (pseudo-tokens of ``loadgen.sim.tokens``), tokens.
        outcome: see :data:`Outcome`.
        shed_reason: the admission core's reason when shed (``policies.admission_types.ShedReason``).
        dispatch_s: when the gateway sent it to a worker (None if never).
        first_token_s, done_s: when the client saw its first and last token (None if never).
        worker: index of the worker that ran it (-1 if none).
        route_reason: the router's reason (``cache_hit``, ``round_robin``, ...).
        cached_tokens: prompt tokens the engine served from its prefix cache.
        completion_tokens: tokens generated.
        model: the served model it named (:class:`loadgen.fleet.config.FleetModel`).
    """

    rid: str
    tenant: str
    band: str
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    outcome: Outcome = "unfinished"
    shed_reason: str = ""
    dispatch_s: float | None = None
    first_token_s: float | None = None
    done_s: float | None = None
    worker: int = -1
    route_reason: str = ""
    cached_tokens: int = 0
    completion_tokens: int = 0
    model: str = "default"

    @property
    def ttft_s(self) -> float | None:
        """Time to first token as the client saw it, s (None unless a token came)."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        """Request latency (arrival to last token), s (None unless it finished)."""
        return None if self.done_s is None else self.done_s - self.arrival_s

    @property
    def queue_wait_s(self) -> float | None:
        """Time in the gateway's queue (arrival to dispatch), s."""
        return None if self.dispatch_s is None else self.dispatch_s - self.arrival_s


@dataclass(slots=True)
class WorkerTally:
    """Totals of one worker over a run.

    Attributes:
        requests: requests dispatched to it.
        prompt_tokens, cached_tokens, completion_tokens: tokens of its finished requests.
        window_sizes: its AIMD window after each load poll, requests.
        busy_s: virtual seconds it had requests in flight.
        peak_in_flight: the most requests it had at once from every gateway replica together
            (dispatched, not yet finished or aborted), requests.
        started_s: when it was asked for (0 for the workers a run starts with), s.
        ready_s: when it could take requests (``started_s`` + the cold start; None if it never did).
        stopped_s: when it was gone: drained, or cancelled while starting (None while it lives).
    """

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    window_sizes: list[int] = field(default_factory=list)
    busy_s: float = 0.0
    peak_in_flight: int = 0
    started_s: float = 0.0
    ready_s: float | None = 0.0
    stopped_s: float | None = None


@dataclass(slots=True)
class FleetResult:
    """Everything a run produced.

    Attributes:
        records: one per planned request, in arrival order.
        workers: one tally per worker.
        duration_s: virtual time from 0 to the last event.
        cpu_s: process CPU seconds the simulation took.
        events: events processed (arrivals, engine steps, ticks).
        preemptions: retractions inside the engines (KV pressure or priority).
    """

    records: list[RequestRecord]
    workers: list[WorkerTally]
    duration_s: float
    cpu_s: float
    events: int
    preemptions: int
