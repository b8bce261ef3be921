"""Load shedding at arrival: reject at once what would wait past its budget (pure, time injected).

A request is refused immediately (503 + Retry-After) instead of timing out later when
1. its predicted queue wait exceeds its band's wait budget: ``wait = tokens ahead / service rate``, where
   *tokens ahead* are the queued tokens of higher bands plus those of its own band with an earlier WFQ tag,
   and the service rate is the gateway's measured dispatch rate (tokens/s) — Little's-law style prediction,
   as in Google's "Doorman" and Envoy's adaptive concurrency write-ups;
2. its band queue is full (``max_queue_len``);
3. the whole queue is full: then the newest request of the lowest backlogged band below it is evicted
   instead (lowest band shed first), or the arrival itself when it is in the lowest backlogged band.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal, TypeVar

from policies.fair_queue import PriorityBands

T = TypeVar("T")

ShedReason = Literal["admitted", "predicted_wait", "band_full", "queue_full"]


@dataclass(frozen=True, slots=True)
class ShedDecision:
    """Outcome of :func:`decide_admission`.

    Attributes:
        admit: queue the request.
        reason: why (``"admitted"`` when admitted).
        evict_band: when admitted into a full queue, the band whose newest request must be shed.
        predicted_wait_s: the predicted queue wait, s.
    """

    admit: bool
    reason: ShedReason
    evict_band: str | None
    predicted_wait_s: float


def decide_admission(
    bands: PriorityBands[T],
    band: str,
    tenant: str,
    weight: float,
    cost: float,
    service_rate: float | None,
    max_total: int | None,
) -> ShedDecision:
    """Decide whether a new request may queue.

    Args:
        bands: the current queues.
        band, tenant, weight, cost: the request (cost in tokens).
        service_rate: measured dispatch rate, tokens/s (None while unknown: no wait prediction).
        max_total: most requests queued across bands (None: unbounded).
    """
    cfg = bands.configs[band]
    ahead = bands.cost_ahead(band, tenant, weight, cost)
    wait = ahead / service_rate if service_rate and ahead > 0 else 0.0
    if wait > cfg.wait_budget_s:
        return ShedDecision(False, "predicted_wait", None, wait)
    if bands.depth(band) >= cfg.max_queue_len:
        return ShedDecision(False, "band_full", None, wait)
    if max_total is not None and len(bands) >= max_total:
        victim = bands.lowest_backlogged_below(cfg.rank)
        if victim is None:
            return ShedDecision(False, "queue_full", None, wait)
        return ShedDecision(True, "admitted", victim, wait)
    return ShedDecision(True, "admitted", None, wait)


class DispatchRate:
    """Tokens dispatched per second over a sliding window (pure; the caller passes ``now`` in s).

    Args:
        window_s: averaging window, s.
        min_span_s: shortest observed span before a rate is reported, s (5 s: in the first seconds
            after a cold start dispatches are few and the rate would be underestimated).
    """

    def __init__(self, window_s: float = 10.0, min_span_s: float = 5.0) -> None:
        self._window = window_s
        self._min_span = min_span_s
        self._events: deque[tuple[float, float]] = deque()
        self._total = 0.0
        self._first: float | None = None

    def record(self, now: float, tokens: float) -> None:
        """Count ``tokens`` dispatched at ``now``."""
        if self._first is None:
            self._first = now
        self._events.append((now, tokens))
        self._total += tokens
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self._window:
            self._total -= self._events.popleft()[1]

    def rate(self, now: float) -> float | None:
        """Tokens/s over the window, or None before ``min_span_s`` of history."""
        if self._first is None or now - self._first < self._min_span:
            return None
        self._trim(now)
        span = min(self._window, now - self._first)
        return self._total / span if span > 0 else None
