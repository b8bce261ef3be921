"""Per-worker circuit breaker and the one rule for what feeds it (pure, time injected in seconds).

States (M. Nygard, "Release It!", 2007; the same three states as Envoy's outlier detection and
resilience4j):
- ``closed``: traffic flows; ``failure_threshold`` failures with no success in between open it.
- ``open``: no traffic for ``cooldown_s``; then the next :meth:`CircuitBreaker.allow` moves to half-open.
- ``half_open``: traffic and probes are let through; ``success_threshold`` consecutive successes close the
  breaker, any failure opens it again (the cool-down doubles, up to ``max_cooldown_s``).

The rule (:func:`judge`), the same for probes and requests:

===================================  ==========================================================
signal                               verdict
===================================  ==========================================================
``refused`` (connect refused)        ``trip``: definitive, the breaker opens at once
``request_failed`` (timeout, reset,  ``serving_failure``: one failure
a 5xx its deep probe confirmed)
``request_ok``, ``deep_probe_ok``    ``success``: clears every counted failure
``probe_ok`` (plain ``/health``)     ``alive``: clears liveness failures only; a success when half-open
``probe_failed``                     ``liveness_failure``: one failure ...
``deep_probe_failed`` (500, slow)    ``serving_failure``: one failure ...
either probe failure, while a        ``ignore``: real traffic outranks health signals
request succeeded within
``trust_window_s``
===================================  ==========================================================

An HTTP 5xx answer is not a signal by itself: SGLang answers 5xx to some requests that are their own
fault, so the pool confirms it with an immediate deep probe and only a failed one makes it a
``request_failed`` (``service/workers/pool.py``). A failed deep probe is never definitive (SGLang's
``/health_generate`` fails during long prefills under load), and a plain ``/health`` 200 does not
disprove a failed generation (with ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` it only says the
HTTP process is up), so it clears only failed plain probes. Because probe failures count for nothing
while requests to the worker succeed, the last healthy worker is never ejected on probe evidence alone
while it serves.

Defaults: 5 failures (Envoy ``consecutive_5xx`` default 5), 30 s cool-down (Envoy
``base_ejection_time`` default 30 s), 2 successes to close (resilience4j
``permittedNumberOfCallsInHalfOpenState`` is 10 by default; 2 suits a handful of probes per period).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]

Signal = Literal[
    "request_ok",
    "request_failed",
    "refused",
    "probe_ok",
    "probe_failed",
    "deep_probe_ok",
    "deep_probe_failed",
]
"""One piece of evidence about a worker: an outcome of a real request or of a health probe."""

Verdict = Literal["success", "alive", "serving_failure", "liveness_failure", "trip", "ignore"]
"""What a signal does to the breaker (see the module's table)."""

_PROBE_FAILURES = ("probe_failed", "deep_probe_failed")


def judge(signal: Signal, request_ok_age_s: float | None, trust_window_s: float) -> Verdict:
    """Apply the breaker rule to one signal.

    Args:
        signal: the evidence.
        request_ok_age_s: seconds since the last successful request to this worker (None: never).
        trust_window_s: a request success at most this old (s) outweighs failed probes.

    Returns:
        The :data:`Verdict` for :meth:`CircuitBreaker.apply`.
    """
    if signal == "refused":
        return "trip"
    if signal in ("request_ok", "deep_probe_ok"):
        return "success"
    if signal == "probe_ok":
        return "alive"
    if signal == "request_failed":
        return "serving_failure"
    assert signal in _PROBE_FAILURES
    if request_ok_age_s is not None and request_ok_age_s <= trust_window_s:
        return "ignore"
    return "liveness_failure" if signal == "probe_failed" else "serving_failure"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Thresholds of a :class:`CircuitBreaker`.

    Attributes:
        failure_threshold: failures (liveness + serving, none cleared by a success) that open it.
        success_threshold: consecutive successes that close a half-open breaker.
        open_cooldown_s: time an open breaker blocks traffic, s.
        max_cooldown_s: cap of the doubling cool-down after failed half-open probes, s.
        trust_window_s: a request success at most this old outweighs failed probes, s.
    """

    failure_threshold: int = 5
    success_threshold: int = 2
    open_cooldown_s: float = 30.0
    max_cooldown_s: float = 300.0
    trust_window_s: float = 30.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.success_threshold < 1 or self.open_cooldown_s <= 0:
            raise ValueError("thresholds must be >= 1 and the cool-down > 0")
        if self.trust_window_s < 0:
            raise ValueError("trust_window_s must be >= 0")


class CircuitBreaker:
    """One worker's breaker.

    Args:
        config: thresholds.
    """

    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self.state: BreakerState = "closed"
        self.liveness_failures = 0
        self.serving_failures = 0
        self.successes = 0
        self.opened_at = 0.0
        self.cooldown_s = config.open_cooldown_s

    @property
    def failures(self) -> int:
        """Failures counted toward opening (liveness + serving)."""
        return self.liveness_failures + self.serving_failures

    def allow(self, now: float) -> bool:
        """Whether a request (or probe) may go to the worker at ``now``; moves open -> half-open."""
        if self.state == "open" and now - self.opened_at >= self.cooldown_s:
            self.state = "half_open"
            self.successes = 0
        return self.state != "open"

    def reopens_in(self, now: float) -> float | None:
        """Seconds from ``now`` until an open breaker lets traffic through again (0 when due); None when
        it is not open."""
        if self.state != "open":
            return None
        return max(0.0, self.opened_at + self.cooldown_s - now)

    def apply(self, verdict: Verdict, now: float) -> BreakerState:
        """Apply a :func:`judge` verdict at ``now`` (s); returns the new state."""
        if verdict == "ignore":
            return self.state
        if verdict == "trip":
            return self.trip(now)
        if verdict in ("success", "alive"):
            if verdict == "success" or self.state == "half_open":
                self.liveness_failures = self.serving_failures = 0
            else:
                self.liveness_failures = 0
            if self.state == "half_open":
                self.successes += 1
                if self.successes >= self.config.success_threshold:
                    self.state = "closed"
                    self.cooldown_s = self.config.open_cooldown_s
            return self.state
        if self.state == "half_open":
            self.cooldown_s = min(self.config.max_cooldown_s, self.cooldown_s * 2)
            self._open(now)
        elif self.state == "closed":
            if verdict == "liveness_failure":
                self.liveness_failures += 1
            else:
                self.serving_failures += 1
            if self.failures >= self.config.failure_threshold:
                self._open(now)
        return self.state

    def trip(self, now: float) -> BreakerState:
        """Open at once (a definitive failure such as connection refused)."""
        if self.state != "open":
            self._open(now)
        return self.state

    def half_open(self) -> BreakerState:
        """Let probes in now, with the base cool-down (a restarted worker: fresh process, fresh record)."""
        self.state = "half_open"
        self.successes = 0
        self.liveness_failures = self.serving_failures = 0
        self.cooldown_s = self.config.open_cooldown_s
        return self.state

    def _open(self, now: float) -> None:
        self.state = "open"
        self.opened_at = now
        self.liveness_failures = self.serving_failures = 0
        self.successes = 0
