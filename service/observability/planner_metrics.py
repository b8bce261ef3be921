"""The planner's series (:mod:`service.pipeline.planner_task`): the autoscaling signal and why.

- ``radixgate_desired_workers{model}``: the workers the model's pool should run (the planner's decision,
  hysteresis applied). KEDA's ScaledObject (``deploy/k8s``) reads ``max(radixgate_desired_workers{model})``
  over the replicas: each decides from every replica's measures (shared through Redis), so any one of them
  is the fleet's answer;
- ``radixgate_planner_needed_workers{model}``: the fractional need before the target utilization and
  hysteresis (the larger of now and the forecast at the cold-start horizon);
- ``radixgate_planner_reason{model,reason}``: 1 for the decision's reason (``up``, ``down``, ``hold``,
  ``stabilizing``, ``noise``, ``floor``, ``ceiling``, ``unmeasured``), 0 for the others.

Labels are bounded: models by the served list, reasons by :data:`policies.planner.Reason`. In multiprocess
mode each process runs its own planner over the same shared measures, with its own hysteresis (its own
history of decisions), so two processes can differ by a worker for a step or two, and each process's
``GET /admin/planner`` shows its own. The gauges are merged with ``livemax``: the largest decision any
live process holds, the safe side for a scaler; the reason gauge may then show 1 for two reasons at once
(one per process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

#: :data:`policies.planner.Reason`'s values (this room imports nothing of the others; a test holds them equal)
REASONS: tuple[str, ...] = ("up", "down", "hold", "stabilizing", "noise", "floor", "ceiling", "unmeasured")


class PlannerMetrics:
    """The planner's gauges, in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.desired = Gauge(
            "radixgate_desired_workers",
            "Workers the model's pool should run: the planner's decision (docs/scaling.md).",
            ["model"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.needed = Gauge(
            "radixgate_planner_needed_workers",
            "Workers the model's demand needs, fractional, before the target utilization and hysteresis.",
            ["model"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.reason = Gauge(
            "radixgate_planner_reason",
            "1 for the reason of the planner's last decision per model, 0 for the others.",
            ["model", "reason"],
            registry=registry,
            multiprocess_mode="livemax",
        )

    def publish(self, model: str, desired: int, needed: float, reason: str) -> None:
        """Set the three series of ``model`` from one decision."""
        self.desired.labels(model).set(desired)
        self.needed.labels(model).set(needed)
        for name in REASONS:
            self.reason.labels(model, name).set(1 if name == reason else 0)


__all__ = ["REASONS", "PlannerMetrics"]
