"""The fleet parts of the Settings tree: replicas sharing workers (``replicas.*``) and the planner's
autoscaling signal (``planner.*``).

Split from :mod:`service.config.settings`, which assembles the tree. What is done with these is in
:mod:`service.workers.replicas` (heartbeats, window shares) and :mod:`service.pipeline.planner_task`
(``radixgate_desired_workers``).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator, model_validator

from policies.forecast import MIN_OUTLIER_MADS, ForecastConfig
from policies.planner import PlannerConfig
from service.config.checks import field_error
from service.config.policies import FINITE


class ReplicaSettings(BaseModel):
    """Gateway replicas that front the same workers, found through Redis.

    Every replica (each gateway process) writes a heartbeat into Redis every ``heartbeat_s``; those heard
    from within ``ttl_s`` are live. With ``share_windows`` each replica lets into a worker only its share
    of the engine's ``max_running_requests``: the window split over the live replicas (floor, the remainder
    to the first replicas in id order, at least 1 each), so that all replicas together never offer a worker
    more than it runs. Off: each replica takes the whole window (one replica, or engines left to queue).
    With ``share_routes`` each replica's dispatches reach the others' routers
    (:mod:`service.workers.route_sync`).
    """

    model_config = FINITE

    share_windows: bool = Field(
        True,
        description="Split each worker's window (its max_running_requests) over the live gateway "
        "replicas, so that together they never send it more than it runs.",
    )
    share_routes: bool = Field(
        True,
        description="Publish each dispatch (model, worker, prompt prefix) to the other gateway replicas "
        "over Redis pub/sub and learn theirs, so that every replica's cache-aware router sees where every "
        "prefix went (prompts pass through Redis, not stored).",
    )
    route_sync_max_prompt_chars: int = Field(
        16384,
        ge=1,
        le=65536,
        description="A prompt published to the other replicas is cut to this many characters.",
    )
    route_sync_max_bytes_per_s: float = Field(
        8 * 2**20,
        ge=1024,
        le=2**30,
        description="Most bytes of routes a replica publishes per second (a token bucket, one second's "
        "worth of burst); routes beyond it are dropped and counted. Keeps the subscribers' output buffers "
        "in Redis (client-output-buffer-limit pubsub) from filling while one of them is slow.",
    )
    heartbeat_s: float = Field(
        2.0, gt=0, le=600, description="How often a replica writes its heartbeat into Redis, s."
    )
    ttl_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="A replica not heard from for this long is gone (its window share goes back to the "
        "others), s; more than heartbeat_s.",
    )

    @model_validator(mode="after")
    def _ttl_above_period(self) -> ReplicaSettings:
        if self.ttl_s <= self.heartbeat_s:
            raise field_error(
                self,
                ("ttl_s", "heartbeat_s"),
                f"replicas.ttl_s ({self.ttl_s}) must be more than replicas.heartbeat_s ({self.heartbeat_s})",
            )
        return self


class PlannerSettings(BaseModel):
    """``radixgate_desired_workers{model}``: how many workers each model needs
    (:class:`policies.planner.Planner`, docs/scaling.md). The gateway only publishes the number; KEDA (or
    an operator) acts on it. On by default: it costs one decision per model every ``interval_s``.
    """

    model_config = FINITE

    enabled: bool = Field(True, description="Publish radixgate_desired_workers{model} (the planner).")
    interval_s: float = Field(10.0, gt=0, le=3600, description="How often the planner decides, s.")
    min_workers: int = Field(1, ge=0, description="Floor of the decision, workers.")
    max_workers: int = Field(64, ge=1, le=100_000, description="Ceiling of the decision, workers.")
    target_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of a worker's capacity the decision plans to fill."
    )
    cold_start_s: float = Field(
        300.0,
        ge=0,
        le=86_400,
        description="From asking for a worker to its first answer, s (the forecast's horizon; 300 s: a "
        "70B TP-8 worker, docs/scaling.md).",
    )
    scale_down_window_s: float = Field(
        120.0, ge=0, description="The decision falls no lower than the highest need of this past window, s."
    )
    scale_down_margin: float = Field(
        0.9,
        gt=0,
        le=1,
        description="A scale-down to n workers needs the load over n to stay within this share of "
        "target_utilization (the dead band against flapping).",
    )
    scale_up_z: float = Field(
        2.0,
        ge=0,
        le=100,
        description="A scale-up needs the need less this many of its standard errors (its rates' counting "
        "noise) to ask for more workers than run (0: any rise).",
    )
    scale_down_z: float = Field(
        2.0,
        ge=0,
        le=100,
        description="A scale-down to n workers needs the need plus this many of its standard errors to fit "
        "n within scale_down_margin (0: the need as measured).",
    )
    kv_target: float = Field(0.8, gt=0, le=1, description="KV cache usage the planned batch may reach.")
    goal_fraction: float = Field(
        0.5, gt=0, le=1, description="Share of a class's TTFT goal the planned batch's steps may take."
    )
    forecast_median_samples: int = Field(
        9,
        ge=1,
        le=1000,
        description="Arrival-rate samples in the forecast's running median (bursts "
        "shorter than half of them x interval_s are ignored).",
    )
    forecast_outlier_mads: float = Field(
        2.0,
        ge=0,
        le=100,
        description="Rate samples further than this many scaled median absolute deviations from the "
        "median's window are left out of it (the Hampel identifier; 0: a plain running median; else at "
        "least 0.6745, below which it could leave out every sample).",
    )
    forecast_level_tau_s: float = Field(20.0, gt=0, description="Time constant of the forecast's level, s.")
    forecast_damping: float = Field(
        0.995, gt=0, le=1, description="Share of the forecast's trend kept per interval ahead (1: undamped)."
    )
    forecast_trend_tau_s: float = Field(60.0, gt=0, description="Time constant of the forecast's trend, s.")
    forecast_trend_window_samples: int | None = Field(
        None,
        ge=1,
        le=2000,
        description="Samples in each of the two windows whose medians the trend's evidence compares (unset: "
        "twice forecast_median_samples).",
    )
    forecast_trend_z: float = Field(
        2.0,
        ge=0,
        le=100,
        description="The forecast's trend counts in proportion to its evidence: none while the rate's change "
        "between the last two median windows is under this many standard errors (Poisson counts or the "
        "samples' scatter), all of it from twice as many (0: always all of it).",
    )
    prior_capacity_rps: float | None = Field(
        None,
        gt=0,
        description="A worker's capacity at the classes' TTFT goals, requests/s, from a profiling run: "
        "the planner plans with it, or with the capacity measured on workers running full where that is "
        "lower (unset: with the measured one alone; the decision holds until a worker ran full).",
    )

    @field_validator("forecast_outlier_mads")
    @classmethod
    def _outlier_mads(cls, mads: float) -> float:
        if mads != 0.0 and mads < MIN_OUTLIER_MADS:
            raise ValueError(
                f"must be 0 (no outliers left out) or at least {MIN_OUTLIER_MADS:.4f}: below it a window "
                "of an even number of samples can keep none"
            )
        return mads

    @model_validator(mode="after")
    def _bounds(self) -> PlannerSettings:
        if self.max_workers < max(1, self.min_workers):
            raise field_error(
                self,
                ("max_workers", "min_workers"),
                f"planner.max_workers ({self.max_workers}) must be at least planner.min_workers "
                f"({self.min_workers}) and at least 1",
            )
        return self

    def config(self) -> PlannerConfig:
        """The pure planner's configuration."""
        return PlannerConfig(
            min_workers=self.min_workers,
            max_workers=self.max_workers,
            interval_s=self.interval_s,
            cold_start_s=self.cold_start_s,
            target_utilization=self.target_utilization,
            scale_down_margin=self.scale_down_margin,
            scale_down_window_s=self.scale_down_window_s,
            scale_up_z=self.scale_up_z,
            scale_down_z=self.scale_down_z,
            kv_target=self.kv_target,
            goal_fraction=self.goal_fraction,
            forecast=ForecastConfig(
                median_samples=self.forecast_median_samples,
                outlier_mads=self.forecast_outlier_mads,
                damping=self.forecast_damping,
                level_tau_s=self.forecast_level_tau_s,
                trend_tau_s=self.forecast_trend_tau_s,
                trend_z=self.forecast_trend_z,
                trend_window_samples=self.forecast_trend_window_samples,
            ),
        )


__all__ = ["PlannerSettings", "ReplicaSettings"]
