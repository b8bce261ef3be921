"""Per-worker concurrency windows: how many requests the gateway lets into each worker (pure).

The gateway keeps the queue itself, where priority, fairness and deadlines apply, and lets into a worker
as many requests as it can run at once without queueing inside the engine or losing the TTFT goals. Three
controllers (``WindowConfig.mode``):

- ``engine`` (default): the window is bounded by what the engine reports it can run at once, SGLang's
  ``max_running_requests`` (``/server_info``), and grown towards it while the engine keeps up. It shrinks
  when KV use passes ``kv_high`` (to what the engine runs), and when the engine keeps requests waiting
  (``sglang:num_queue_reqs``) for ``engine_queue_reports`` reports in a row (a standing queue, as CoDel's
  test, Nichols & Jacobson 2012; llm-d's saturation detector uses the same two signals, queue and KV).
  A queue that comes and goes is not a reason: with chunked prefill a burst of long prompts waits its turn
  for a step or two on any engine. Optionally (``ttft_target_s`` or ``ttft_target_fraction``) it also
  shrinks when the engine's TTFT of short prefills passes a target. It starts at ``initial`` and doubles
  per report while saturated and healthy (slow start, as TCP), then grows by ``increase_fraction`` per
  report; once the engine has reported ``max_running_requests`` the window starts there instead. On a GPU
  engine the window sits at ``max_running_requests``: the engine's own concurrency, so
  the gateway costs no throughput. The TTFT target is off by default: on prefill-heavy traffic the
  engine's TTFT is high whatever the window (it is the prefill, not the concurrency), and the target then
  shrank windows to 1 (docs/experiments.md shows the run).
- ``aimd``: the first round's AIMD (additive increase, multiplicative decrease; Chiu & Jain 1989) on the
  engine queue and KV use only. Kept for the experiments' comparison: it settles far below the engine's
  capacity and cost 78% more workers (docs/experiments.md).
- ``fixed``: ``initial`` requests, never changed (a baseline for experiments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

WindowMode = Literal["engine", "aimd", "fixed"]


@dataclass(frozen=True, slots=True)
class WindowConfig:
    """Window settings.

    Attributes:
        mode: ``engine``, ``aimd`` or ``fixed`` (see the module docstring).
        initial: starting window, requests.
        minimum, maximum: bounds, requests (``maximum`` also caps the engine-reported limit).
        max_tokens: cap on in-flight tokens (prompt + max_tokens) per worker; None = no cap.
        top_band_headroom: extra requests the highest band may send beyond the window while lower bands
            run there, so an interactive request reaches a busy worker and overtakes lower work in SGLang's
            scheduler (priority scheduling, preemption) instead of waiting for a lower request's long
            generation. Never more than the lower bands have in flight: beyond that the extra requests
            would only wait inside the engine.
        top_band_headroom_fraction: the same as a fraction of the window; the larger of the two applies.
            1.0 (the default): the top band may keep a whole window of its own in flight, however much
            lower work runs there (SGLang preempts that work for it), so it never waits in the gateway's
            queue behind lower bands. At 0.25 (two slots of a CPU worker's eight), interactive requests
            waited up to a second in the gateway's queue while lower work filled the window plus headroom,
            and their P99 TTFT at 2x overload was 1,492 ms against 1,323 ms at a whole window (one run
            each, docs/experiments.md); the simulated fleet's overload experiment meets its goals either
            way (interactive goodput 99.5% against 99.7%).
        ttft_target_s: engine TTFT of short prefills above which the window shrinks (``engine`` mode), s;
            None = ``ttft_target_fraction`` x the tightest class goal (set by the admission core).
        ttft_target_fraction: see ``ttft_target_s``; 0.5 leaves the other half of the tightest goal to the
            gateway's queue.
        decrease: multiplicative factor on a decrease (0 < decrease < 1).
        increase_fraction: growth per healthy saturated report after slow start (``engine``), fraction.
        aimd_increase: additive growth per report (``aimd``), requests.
        engine_queue_fraction: engine queue tolerated before shrinking, as a fraction of the window
            (at least 1 request).
        engine_queue_reports: consecutive reports over that tolerance before the ``engine`` window
            shrinks (a queue while a burst of prefills is chunked is normal; one that persists is not).
        kv_high: KV usage fraction (0..1) above which the window shrinks.
        slow_start: double on each saturated healthy report until the first decrease.

    Raises:
        ValueError: inconsistent bounds or factors.
    """

    mode: WindowMode = "engine"
    initial: int = 8
    minimum: int = 1
    maximum: int = 1024
    max_tokens: int | None = None
    top_band_headroom: int = 2
    top_band_headroom_fraction: float = 1.0
    ttft_target_s: float | None = None
    ttft_target_fraction: float | None = None
    decrease: float = 0.9
    increase_fraction: float = 0.1
    aimd_increase: float = 1.0
    engine_queue_fraction: float = 0.25
    engine_queue_reports: int = 3
    kv_high: float = 0.92
    slow_start: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum or self.initial < 1:
            raise ValueError("need 1 <= minimum <= maximum and initial >= 1")
        if (
            not 0 < self.decrease < 1
            or self.increase_fraction < 0
            or not 0 < (self.ttft_target_fraction or 1) <= 1
        ):
            raise ValueError("need 0 < decrease < 1, increase_fraction >= 0, 0 < ttft_target_fraction <= 1")
        if self.mode not in ("engine", "aimd", "fixed"):
            raise ValueError(f"unknown window mode {self.mode!r}")


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a worker reports about itself (SGLang ``/metrics`` and ``/server_info``).

    Attributes:
        running: ``sglang:num_running_reqs``, requests.
        queued: ``sglang:num_queue_reqs``, requests waiting inside the engine.
        kv_usage: ``sglang:token_usage``, fraction of the KV pool in use (0..1).
        max_running: the engine's ``max_running_requests`` when known (with several gateway replicas,
            this replica's share of it: :func:`policies.window_shares.window_share`).
        replica_share: this gateway replica's part of the worker's work, 0 < share <= 1: its window
            share over the engine's ``max_running_requests`` (1: one replica). ``running`` and ``queued``
            count every replica's requests; the window takes this part of them as its own, and the
            admission core counts the engine's prefill backlog as its own over this part
            (:attr:`policies.worker_queue.WorkerQueue.replica_share`).

    Raises:
        ValueError: ``replica_share`` outside (0, 1].
    """

    running: int
    queued: int
    kv_usage: float
    max_running: int | None = None
    replica_share: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.replica_share <= 1.0:
            raise ValueError(f"replica_share must be in (0, 1] (got {self.replica_share})")


class WorkerWindow:
    """One worker's window.

    Args:
        config: the settings.
        ttft_target_s: the engine-TTFT target (``engine`` mode), s; overrides ``config.ttft_target_s``.
    """

    def __init__(self, config: WindowConfig, ttft_target_s: float | None = None) -> None:
        self.config = config
        self.limit = float(config.initial)
        self.in_slow_start = config.slow_start
        self.engine_max: int | None = None
        self._queued_reports = 0
        self.ttft_target_s = ttft_target_s if ttft_target_s is not None else config.ttft_target_s
        self._ceiling = self._size = self._headroom = 0
        self._derive()

    def _derive(self) -> None:
        """Recompute :attr:`ceiling`, :attr:`size` and :attr:`headroom` from ``limit`` and ``engine_max``
        (they change only in :meth:`on_report`; the admission core reads them several times a request)."""
        cfg = self.config
        cap = cfg.maximum
        if cfg.mode == "engine" and self.engine_max is not None:
            cap = min(cap, self.engine_max)
        self._ceiling = max(cfg.minimum, cap)
        self._size = (
            cfg.initial if cfg.mode == "fixed" else max(cfg.minimum, min(self._ceiling, int(self.limit)))
        )
        self._headroom = max(cfg.top_band_headroom, int(cfg.top_band_headroom_fraction * self._size))

    @property
    def ceiling(self) -> int:
        """Largest window allowed now: ``maximum``, or the engine's ``max_running_requests`` if lower."""
        return self._ceiling

    @property
    def size(self) -> int:
        """Current window, whole requests, within ``[minimum, ceiling]``."""
        return self._size

    @property
    def headroom(self) -> int:
        """Extra requests the highest band may send beyond :attr:`size`."""
        return self._headroom

    def has_room(
        self, in_flight: int, in_flight_tokens: int, cost: int, headroom: int = 0, slots: int = 1
    ) -> bool:
        """Whether one more request of ``cost`` tokens taking ``slots`` slots (its engine sequences) may be
        sent now, ``headroom`` slots beyond the window allowed (the top band's; see :attr:`headroom`). A
        request wider than the window goes when nothing is in flight."""
        limit = self.size + headroom
        if in_flight >= limit or (in_flight > 0 and in_flight + slots > limit):
            return False
        cap = self.config.max_tokens
        return cap is None or in_flight == 0 or in_flight_tokens + cost <= cap

    def on_report(self, report: LoadReport, in_flight: int, engine_ttft_s: float | None) -> float:
        """Adapt to a load report (:meth:`_adapt`) and derive the window from the new limit."""
        limit = self._adapt(report, in_flight, engine_ttft_s)
        self._derive()
        return limit

    def _adapt(self, report: LoadReport, in_flight: int, engine_ttft_s: float | None) -> float:
        """Adapt to a load report; returns the new limit (requests, fractional).

        Args:
            report: the worker's load.
            in_flight: requests the gateway has on this worker now.
            engine_ttft_s: recent engine TTFT of short prefills (dispatch to first token), s; None unknown.
        """
        cfg = self.config
        if report.max_running is not None and report.max_running > 0:
            first = self.engine_max is None
            self.engine_max = report.max_running
            self._derive()
            if first and cfg.mode == "engine" and self.in_slow_start:
                # the engine says what it runs at once: start there (slow start is for unknown engines)
                self.limit = float(self.ceiling)
                self._derive()
        if cfg.mode == "fixed":
            return self.limit
        if cfg.mode == "aimd":
            return self._aimd(report, in_flight)
        tolerated = max(1.0, cfg.engine_queue_fraction * self.limit)
        target = self.ttft_target_s
        # the engine's figures count every gateway replica's requests: this replica's part of them (its
        # replica_share; the load balancer gives each replica the same traffic) is compared with its window
        share = report.replica_share
        running = report.running * share
        # what the gateway itself sent beyond the engine's max_running_requests (the top band's headroom,
        # or a window since shrunk) must wait inside the engine: that queue says nothing about the engine
        own_overflow = max(0, in_flight - self.engine_max) if self.engine_max is not None else 0
        engine_queue = report.queued * share - own_overflow
        self._queued_reports = self._queued_reports + 1 if engine_queue > tolerated else 0
        if report.kv_usage > cfg.kv_high:
            # KV nearly full: the engine cannot hold more than it runs
            self.limit = max(float(cfg.minimum), min(self.limit, running) * cfg.decrease)
            self.in_slow_start = False
        elif self._queued_reports >= cfg.engine_queue_reports:
            # the engine kept requests waiting report after report: what it runs is its concurrency now
            self.limit = max(float(cfg.minimum), min(self.limit * cfg.decrease, running + tolerated))
            self.in_slow_start = False
        elif target is not None and engine_ttft_s is not None and engine_ttft_s > target:
            self.limit = max(float(cfg.minimum), self.limit * cfg.decrease)
            self.in_slow_start = False
        elif in_flight >= self.size and (target is None or engine_ttft_s is None or engine_ttft_s < target):
            grown = self.limit * 2 if self.in_slow_start else self.limit * (1 + cfg.increase_fraction) + 1
            self.limit = min(float(self.ceiling), grown)
        self.limit = min(self.limit, float(self.ceiling))
        return self.limit

    def _aimd(self, report: LoadReport, in_flight: int) -> float:
        cfg = self.config
        tolerated = max(1.0, cfg.engine_queue_fraction * self.limit)
        if report.queued * report.replica_share > tolerated or report.kv_usage > cfg.kv_high:
            self.limit = max(float(cfg.minimum), self.limit * 0.7)
            self.in_slow_start = False
        elif in_flight >= self.size:
            grown = self.limit * 2 if self.in_slow_start else self.limit + cfg.aimd_increase
            self.limit = min(float(cfg.maximum), grown)
        return self.limit
