"""Per-worker circuit breaker (pure, time injected in seconds).

States (M. Nygard, "Release It!", 2007; the same three states as Envoy's outlier detection and
resilience4j):
- ``closed``: traffic flows; ``failure_threshold`` consecutive failures open the breaker.
- ``open``: no traffic for ``open_cooldown_s``; then the next :meth:`CircuitBreaker.allow` moves to
  half-open.
- ``half_open``: traffic is allowed as probes; ``success_threshold`` consecutive successes close the
  breaker, any failure opens it again (the cool-down doubles, up to ``max_cooldown_s``).

Defaults: 5 consecutive failures (Envoy ``consecutive_5xx`` default 5), 30 s cool-down (Envoy
``base_ejection_time`` default 30 s), 2 successes to close (resilience4j
``permittedNumberOfCallsInHalfOpenState`` is 10 by default; 2 suits a handful of probes per period).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Thresholds of a :class:`CircuitBreaker`.

    Attributes:
        failure_threshold: consecutive failures that open a closed breaker.
        success_threshold: consecutive successes that close a half-open breaker.
        open_cooldown_s: time an open breaker blocks traffic, s.
        max_cooldown_s: cap of the doubling cool-down after failed half-open probes, s.
    """

    failure_threshold: int = 5
    success_threshold: int = 2
    open_cooldown_s: float = 30.0
    max_cooldown_s: float = 300.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.success_threshold < 1 or self.open_cooldown_s <= 0:
            raise ValueError("thresholds must be >= 1 and the cool-down > 0")


class CircuitBreaker:
    """One worker's breaker.

    Args:
        config: thresholds.
    """

    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self.state: BreakerState = "closed"
        self.failures = 0
        self.successes = 0
        self.opened_at = 0.0
        self.cooldown_s = config.open_cooldown_s

    def allow(self, now: float) -> bool:
        """Whether a request (or probe) may go to the worker at ``now``; moves open -> half-open."""
        if self.state == "open" and now - self.opened_at >= self.cooldown_s:
            self.state = "half_open"
            self.successes = 0
        return self.state != "open"

    def record_success(self) -> BreakerState:
        """Count a success; returns the new state."""
        self.failures = 0
        if self.state == "half_open":
            self.successes += 1
            if self.successes >= self.config.success_threshold:
                self.state = "closed"
                self.cooldown_s = self.config.open_cooldown_s
        return self.state

    def record_failure(self, now: float) -> BreakerState:
        """Count a failure at ``now``; returns the new state."""
        if self.state == "half_open":
            self.cooldown_s = min(self.config.max_cooldown_s, self.cooldown_s * 2)
            self._open(now)
        elif self.state == "closed":
            self.failures += 1
            if self.failures >= self.config.failure_threshold:
                self._open(now)
        return self.state

    def trip(self, now: float) -> BreakerState:
        """Open at once (a definitive failure such as connection refused)."""
        if self.state != "open":
            self._open(now)
        return self.state

    def _open(self, now: float) -> None:
        self.state = "open"
        self.opened_at = now
        self.failures = 0
        self.successes = 0
