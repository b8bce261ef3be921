"""The shutdown part of the Settings tree: how long a stopping gateway process drains (``shutdown.*``).

Split from :mod:`service.config.settings`, which assembles the tree. What the drain does with these is in
:mod:`service.runtime.drain`.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from service.config.policies import FINITE

KUBERNETES_GRACE_S = 30.0
"""Kubernetes' default ``terminationGracePeriodSeconds``: SIGKILL follows SIGTERM after it, s."""


class ShutdownSettings(BaseModel):
    """What a gateway process does between SIGTERM (or SIGINT) and its exit.

    From the signal on it is draining: ``/readyz`` answers 503; for ``accept_for_s`` the process still
    accepts new connections (a balancer that has not yet seen the readiness failure sends them), then it
    stops listening. Every request that reaches it until the drain deadline is served, its answer with
    ``Connection: close`` (the client's next request opens a connection to another replica); what is in
    flight runs on for up to ``drain_timeout_s``; what is left then is ended (an error event or a 503,
    aborted at its worker, charged what was generated) and gets ``end_timeout_s`` to settle, and requests
    from then on get 503 with ``Retry-After``; the process then stops (status 0).
    ``accept_for_s + drain_timeout_s + end_timeout_s`` plus about a second of shutdown must stay under the
    orchestrator's grace period (Kubernetes: ``terminationGracePeriodSeconds``, 30 s by default; the
    defaults leave 5 s of it).
    """

    model_config = FINITE

    accept_for_s: float = Field(
        0.0,
        ge=0,
        le=60,
        description="After SIGTERM/SIGINT: how long the process still accepts new connections while "
        "/readyz answers 503, s, so that a balancer that polls readiness stops sending before the port "
        "closes (0: close it at once, right when the orchestrator runs a preStop delay before SIGTERM, as "
        "deploy/k8s does, or when sibling processes share the port, as with RADIXGATE_WORKERS > 1).",
    )
    drain_timeout_s: float = Field(
        20.0,
        ge=0,
        description="After SIGTERM/SIGINT: how long requests in flight get to finish, s (meanwhile "
        "/readyz answers 503 and requests that still reach the process are served with Connection: "
        "close); those left are then ended (an error event or a 503 shutting_down, aborted at the "
        "worker, charged what was generated). With shutdown.accept_for_s, shutdown.end_timeout_s and "
        "~1 s of shutdown it must fit the grace period before SIGKILL (Kubernetes' "
        "terminationGracePeriodSeconds: 30 s by default).",
    )
    end_timeout_s: float = Field(
        5.0,
        gt=0,
        description="After the drain deadline: how long the ended requests get to abort at their worker "
        "and settle before the process stops anyway, s.",
    )


__all__ = ["KUBERNETES_GRACE_S", "ShutdownSettings"]
