"""The scheduling part of the Settings tree: priority classes, the scheduler (windows, admission) and
routing. Each translates into the pure policy configs of ``policies/`` (``to_policy``/``core_config``), whose
dataclass defaults are the single source of every default here (nothing is redeclared).

Split from :mod:`service.config.settings`, which assembles the tree.
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policies.admission_types import CoreConfig
from policies.cache_aware import CacheAwareConfig
from policies.classes import ClassPolicy, default_classes
from policies.estimates import EstimateConfig
from policies.routing import RouterName
from policies.windows import WindowConfig, WindowMode
from service.config.checks import field_error

FINITE = ConfigDict(allow_inf_nan=False)
"""Config of every settings model: ``inf`` passes any ``ge``/``gt`` bound, and a timeout of ``inf`` failed
the gateway's startup with a traceback (aiohttp and redis-py take ``ceil`` of it) or never fired, so
``inf`` and ``nan`` are refused like any other bad value (one line, exit 2)."""

_CLASS = ClassPolicy(rank=0, sglang_priority=0, ttft_goal_s=1.0)  # field defaults of policies.classes
_WINDOW = WindowConfig()
_CORE = CoreConfig()
_CACHE = _CORE.cache_aware


class PriorityClassSettings(BaseModel):
    """A priority class (band): strict rank, TTFT goal, what a late answer is worth, SGLang ``priority``.

    Translated into :class:`policies.classes.ClassPolicy` (:meth:`policy`), where the defaults live.
    """

    model_config = FINITE

    rank: int = Field(..., description="Higher rank is served first (strict priority between bands).")
    sglang_priority: int = Field(..., description="'priority' sent to SGLang (higher runs first).")
    ttft_goal_ms: float = Field(
        ..., gt=0, description="Time-to-first-token goal (SLO), ms: predicted misses are shed at arrival."
    )
    serve_late: bool = Field(
        _CLASS.serve_late,
        description="Late answers are still useful: queue predicted misses (up to queue_wait_budget_ms).",
    )
    queue_wait_budget_ms: float | None = Field(
        None, gt=0, description="Longest gateway queue wait, ms (required with serve_late; else optional)."
    )
    max_queue_len: int = Field(_CLASS.max_queue_len, ge=1, description="Most requests waiting in this band.")
    min_share: float = Field(
        _CLASS.min_share, ge=0, lt=1, description="Guaranteed fraction of dispatched tokens."
    )
    window_share: float = Field(
        _CLASS.window_share,
        gt=0,
        le=1,
        description="Fraction of a worker's window this class may fill (at least one request).",
    )

    @model_validator(mode="after")
    def _late_needs_budget(self) -> PriorityClassSettings:
        if self.serve_late and self.queue_wait_budget_ms is None:
            raise ValueError("a serve_late class needs queue_wait_budget_ms")
        return self

    def policy(self) -> ClassPolicy:
        """The class as :mod:`policies.classes` takes it."""
        budget = self.queue_wait_budget_ms
        return ClassPolicy(
            rank=self.rank,
            sglang_priority=self.sglang_priority,
            ttft_goal_s=self.ttft_goal_ms / 1000.0,
            serve_late=self.serve_late,
            max_wait_s=None if budget is None else budget / 1000.0,
            max_queue_len=self.max_queue_len,
            min_share=self.min_share,
            window_share=self.window_share,
        )


DEFAULT_CLASS = "standard"
"""The default of ``default_priority_class``: the middle band of :func:`default_priority_classes`."""


def default_priority_classes() -> dict[str, PriorityClassSettings]:
    """``policies.classes.default_classes`` as settings: ``interactive`` > ``standard`` > ``batch``."""
    return {
        name: PriorityClassSettings(
            rank=c.rank,
            sglang_priority=c.sglang_priority,
            ttft_goal_ms=c.ttft_goal_s * 1000.0,
            serve_late=c.serve_late,
            queue_wait_budget_ms=None if c.max_wait_s is None else c.max_wait_s * 1000.0,
            max_queue_len=c.max_queue_len,
            min_share=c.min_share,
            window_share=c.window_share,
        )
        for name, c in default_classes().items()
    }


class SchedulerSettings(BaseModel):
    """The admission core (``policies.admission_core``): windows per worker, SLO-aware shedding.

    Translated into :class:`policies.admission_types.CoreConfig` by :meth:`Settings.core_config`.
    """

    model_config = FINITE

    max_queue_total: int = Field(_CORE.max_queue_total, ge=1, description="Most requests queued in all.")
    window_mode: WindowMode = Field(
        _WINDOW.mode, description="engine (from max_running_requests, queue and KV), aimd, or fixed."
    )
    window_initial: int = Field(
        _WINDOW.initial, ge=1, description="Window before the engine reports its size (fixed: the size)."
    )
    window_min: int = Field(_WINDOW.minimum, ge=1, description="Smallest window per worker, requests.")
    window_max: int = Field(_WINDOW.maximum, ge=1, description="Largest window per worker, requests.")
    window_max_tokens: int | None = Field(
        _WINDOW.max_tokens, ge=1, description="In-flight token cap per worker, tokens."
    )
    top_band_headroom: int = Field(
        _WINDOW.top_band_headroom, ge=0, description="Extra in-flight requests for the top band..."
    )
    top_band_headroom_fraction: float = Field(
        _WINDOW.top_band_headroom_fraction, ge=0, le=1, description="...or this fraction of the window."
    )
    window_ttft_target_ms: float | None = Field(
        None, gt=0, description="Shrink a window when its engine's TTFT of short prefills passes this, ms."
    )
    engine_queue_fraction: float = Field(
        _WINDOW.engine_queue_fraction, ge=0, description="Engine queue tolerated, fraction of the window."
    )
    load_poll_interval_s: float = Field(
        _CORE.load_report_interval_s, gt=0, description="Period of worker /metrics load polls, s."
    )
    prediction_calibration_target: float = Field(
        _CORE.estimates.calibration_target,
        ge=0,
        lt=1,
        description="Scale each worker's predicted queue waits per class up while fewer than this share "
        "of requests admitted after a predicted wait meet their TTFT goal (0.99: P99 goals; 0: off).",
    )

    first_token_deadline_factor: float = Field(
        _CORE.first_token_deadline_factor,
        ge=0,
        description="Give up a dispatched streamed request of a class that does not serve late answers "
        "when its first token has not come this many times its class's TTFT goal after arrival: its "
        "worker request is aborted, the client gets 503 first_token_timeout, nothing is charged (0: "
        "never; else >= 1).",
    )

    @field_validator("first_token_deadline_factor")
    @classmethod
    def _factor_off_or_at_least_one(cls, value: float) -> float:
        if 0 < value < 1:
            raise ValueError("must be 0 (off) or >= 1")
        return value

    @model_validator(mode="after")
    def _window_bounds_in_order(self) -> SchedulerSettings:
        # policies.windows.WindowConfig refuses it at startup (``need 1 <= minimum <= maximum``)
        if self.window_min > self.window_max:
            raise field_error(
                self,
                ("window_min", "window_max"),
                f"scheduler.window_min ({self.window_min}) must be at most scheduler.window_max "
                f"({self.window_max}): the smallest window per worker cannot pass the largest",
            )
        return self

    def estimate_config(self) -> EstimateConfig:
        """The worker estimates' settings."""
        return replace(_CORE.estimates, calibration_target=self.prediction_calibration_target)

    def window_config(self) -> WindowConfig:
        """The window controller's settings."""
        target = self.window_ttft_target_ms
        return replace(
            _WINDOW,
            mode=self.window_mode,
            initial=self.window_initial,
            minimum=self.window_min,
            maximum=self.window_max,
            max_tokens=self.window_max_tokens,
            top_band_headroom=self.top_band_headroom,
            top_band_headroom_fraction=self.top_band_headroom_fraction,
            ttft_target_s=None if target is None else target / 1000.0,
            engine_queue_fraction=self.engine_queue_fraction,
        )


class RoutingSettings(BaseModel):
    """How a request picks its worker (``policies.routing``; defaults from SGLang's router)."""

    model_config = FINITE

    policy: RouterName = Field(
        CoreConfig().routing, description="Routing policy: the worker a request waits for."
    )
    cache_threshold: float = Field(
        _CACHE.cache_threshold,
        ge=0,
        le=1,
        description="cache_aware: match rate above which the best match wins.",
    )
    balance: bool = Field(
        _CACHE.balance, description="cache_aware: SGLang's load-balance branch (off: the core weighs misses)."
    )
    balance_abs_threshold: int = Field(
        _CACHE.balance_abs_threshold,
        ge=0,
        description="cache_aware: load spread (requests) that counts as imbalance...",
    )
    balance_rel_threshold: float = Field(
        _CACHE.balance_rel_threshold,
        ge=1,
        description="...together with max > min x this factor; then least load.",
    )
    max_tree_chars_per_worker: int = Field(
        _CACHE.max_tree_chars_per_worker,
        ge=1024,
        description="cache_aware: prompt characters remembered per worker.",
    )
    eviction_interval_s: float = Field(
        _CACHE.eviction_interval_s, gt=0, description="cache_aware: LRU eviction period, s."
    )

    def cache_aware_config(self) -> CacheAwareConfig:
        """The cache-aware policy's settings."""
        return replace(
            _CACHE,
            cache_threshold=self.cache_threshold,
            balance=self.balance,
            balance_abs_threshold=self.balance_abs_threshold,
            balance_rel_threshold=self.balance_rel_threshold,
            max_tree_chars_per_worker=self.max_tree_chars_per_worker,
            eviction_interval_s=self.eviction_interval_s,
        )
