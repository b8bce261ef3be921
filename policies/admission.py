"""Per-worker concurrency windows: how much the gateway lets into each worker (pure).

The gateway keeps the queue itself, where priority and fairness apply, and lets into a worker only as many
requests (and tokens) as it can run without queueing inside the engine. The window adapts with AIMD
(additive increase, multiplicative decrease; Chiu & Jain 1989, as in TCP congestion control and Netflix's
``concurrency-limits``) from the load the worker reports (SGLang ``/metrics``: ``num_queue_reqs``,
``token_usage``): the engine queueing more than a fraction of the window, or its KV cache nearly full,
shrinks the window by ``decrease``; a saturated window with a short engine queue and spare KV grows it,
doubling in slow start (until the first decrease, as TCP's slow start) and by ``increase`` after.
A short engine queue is normal (arrivals wait for the next scheduler step), hence the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WindowConfig:
    """AIMD window settings.

    Attributes:
        initial: starting window, requests.
        minimum, maximum: bounds of the window, requests.
        max_tokens: cap on in-flight tokens (prompt + max_tokens) per worker; None = no cap.
        increase: additive step per saturated, healthy report, requests.
        decrease: multiplicative factor when the engine queues or KV is high (0 < decrease < 1).
        engine_queue_fraction: engine queue tolerated before shrinking, as a fraction of the window
            (at least 1 request).
        slow_start: double the window on each saturated report until the first decrease.
        kv_high: KV usage fraction (0..1) above which the window shrinks.
        top_band_headroom: extra requests the highest band may send beyond the window, so an
            interactive request reaches a busy worker and overtakes batch work in SGLang's scheduler.
    """

    initial: int = 8
    minimum: int = 1
    maximum: int = 256
    max_tokens: int | None = None
    increase: float = 1.0
    decrease: float = 0.7
    engine_queue_fraction: float = 0.25
    slow_start: bool = True
    kv_high: float = 0.92
    top_band_headroom: int = 2


class ConcurrencyWindow:
    """One worker's adaptive window.

    Args:
        config: the AIMD settings.
    """

    def __init__(self, config: WindowConfig) -> None:
        self.config = config
        self.limit = float(config.initial)
        self.in_slow_start = config.slow_start

    @property
    def size(self) -> int:
        """Current window, whole requests (>= minimum)."""
        return max(self.config.minimum, int(self.limit))

    def has_room(self, in_flight: int, in_flight_tokens: int, cost: int, top_band: bool = False) -> bool:
        """Whether one more request of ``cost`` tokens may be sent now."""
        limit = self.size + (self.config.top_band_headroom if top_band else 0)
        if in_flight >= limit:
            return False
        cap = self.config.max_tokens
        return cap is None or in_flight == 0 or in_flight_tokens + cost <= cap

    def on_load_report(self, engine_queue: int, kv_usage: float, in_flight: int) -> float:
        """Adapt to a load report; returns the new limit (requests, fractional).

        Args:
            engine_queue: requests waiting inside the engine.
            kv_usage: KV cache usage fraction, 0..1.
            in_flight: requests the gateway has on this worker now.
        """
        cfg = self.config
        tolerated = max(1.0, cfg.engine_queue_fraction * self.limit)
        if engine_queue > tolerated or kv_usage > cfg.kv_high:
            self.limit = max(float(cfg.minimum), self.limit * cfg.decrease)
            self.in_slow_start = False
        elif in_flight >= self.size:
            grown = self.limit * 2 if self.in_slow_start else self.limit + cfg.increase
            self.limit = min(float(cfg.maximum), grown)
        return self.limit
