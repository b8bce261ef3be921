"""When to restart a crashed worker: bounded, jittered exponential backoff, reset after a stable run
(pure; time and randomness injected).

The n-th restart in a row (n = 0, 1, ...) waits ``d = min(max_s, base_s * 2**n)`` scaled by "equal
jitter", ``d/2 + u * d/2`` with ``u`` uniform in [0, 1) (AWS Architecture Blog, "Exponential Backoff and
Jitter", 2015): the wait always grows with n, and workers that crashed together do not restart in step.
A worker that ran ``stable_s`` since its last start counts as healthy again: its next crash restarts after
the base delay (the same reset as systemd's ``StartLimitIntervalSec`` window or Kubernetes' CrashLoopBackOff
reset after 10 minutes of running).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartBackoffConfig:
    """Attributes:
    base_s: wait before the first restart, s (before jitter).
    max_s: the most any wait grows to, s.
    stable_s: a run this long (s) since the last start resets the backoff.
    """

    base_s: float = 1.0
    max_s: float = 60.0
    stable_s: float = 300.0

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.max_s < self.base_s or self.stable_s <= 0:
            raise ValueError("need 0 < base_s <= max_s and stable_s > 0")


class RestartBackoff:
    """The restart schedule of one worker.

    Args:
        config: delays and the stable period.
    """

    def __init__(self, config: RestartBackoffConfig) -> None:
        self.config = config
        self.attempt = 0
        self.started_at: float | None = None

    def started(self, now: float) -> None:
        """The worker (re)started at ``now`` (s)."""
        self.started_at = now

    def next_delay(self, now: float, jitter: float) -> float:
        """Seconds to wait before restarting a worker that failed at ``now``.

        Args:
            now: time of the failure, s.
            jitter: a uniform random number in [0, 1).

        Returns:
            The delay, s: in ``[d/2, d)`` with ``d = min(max_s, base_s * 2**attempt)``.
        """
        if not 0.0 <= jitter < 1.0:
            raise ValueError("jitter must be in [0, 1)")
        if self.started_at is not None and now - self.started_at >= self.config.stable_s:
            self.attempt = 0
        ceiling = min(self.config.max_s, self.config.base_s * 2.0**self.attempt)
        self.attempt += 1
        return ceiling / 2 + jitter * ceiling / 2
