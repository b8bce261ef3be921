"""What one gateway replica keeps of each worker (:class:`WorkerState`), and the health log's words for
each piece of evidence (:data:`SIGNAL_REASONS`); :class:`service.workers.pool.WorkerPool` keeps and
updates them."""

from __future__ import annotations

from dataclasses import dataclass

from policies.circuit_breaker import CircuitBreaker, Signal

SIGNAL_REASONS: dict[Signal, str] = {
    "request_ok": "a request was served",
    "request_failed": "requests failed",
    "refused": "connection refused",
    "probe_ok": "GET /health 200",
    "probe_failed": "GET /health failed",
    "deep_probe_ok": "GET /health_generate 200",
    "deep_probe_failed": "GET /health_generate failed",
}
"""The health log's reason for a signal recorded without one of its own."""


@dataclass(slots=True)
class WorkerState:
    """Mutable per-worker state kept by one gateway replica."""

    url: str
    breaker: CircuitBreaker
    seen_up: bool = False
    draining: bool = False
    in_flight: int = 0
    in_flight_tokens: int = 0
    last_request_ok: float | None = None  # monotonic s of the last successful request
    suspects: int = 0  # 5xx answers waiting for the confirmation probe in flight
    health_reason: str | None = None  # why it is (un)healthy, as of the last change (None: not probed yet)
    health_since: float | None = None  # Unix time of that change, s
    reported: tuple[bool, str | None] | None = None  # (up, reason) last logged
    expected_model: str | None = None  # the model it is listed under in settings (None: discovered)
    model: str | None = None  # the model it serves (None: none of the gateway's, or not known yet)
    model_mismatch: str | None = None  # why it serves none of them: kept out of every model's pool

    def eligible(self, now: float) -> bool:
        """Accepts new requests at ``now`` (s); may move the breaker open -> half-open (the pool
        reports that transition: ask it through :meth:`WorkerPool.views` or ``any_healthy``)."""
        return self.seen_up and not self.draining and self.breaker.allow(now)

    @property
    def healthy(self) -> bool:
        """Breaker closed (or probing) and seen up; for display and readiness."""
        return self.seen_up and self.breaker.state != "open"


__all__ = ["SIGNAL_REASONS", "WorkerState"]
