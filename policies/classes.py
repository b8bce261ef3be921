"""Priority classes (bands): rank, SGLang priority, TTFT goal, and whether a late answer is still useful.

This module is the one home of the class defaults. ``service.config.settings`` translates its settings into
:class:`ClassPolicy` and the fleet simulation uses the same objects, so neither redeclares them.

A class's TTFT goal is enforced by the admission core (:mod:`policies.admission_core`): a request whose
predicted time to first token exceeds its class's goal is shed at arrival, and a queued request whose
deadline passes is not dispatched, unless the class says late answers are still useful (``serve_late``),
as for offline batch work (the "deadline-aware" admission of goodput-oriented serving, e.g. SLOs-Serve,
Chen et al. 2025, and SCORPIO, Tian et al. 2025, which drop or defer requests that cannot meet their SLO
instead of spending capacity on answers that are already late).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PREEMPTION_THRESHOLD = 0
"""SGLang's ``--priority-scheduling-preemption-threshold`` the gateway's workers run with (the launcher's
default, ``engine.priority_preemption_threshold``) and the simulated engine models: a waiting request
preempts running ones whose ``priority`` is lower by *more* than this (SGLang,
``schedule_policy.py::preempt_to_schedule``). SGLang's own default, 10, never preempts for gaps of 10 or less,
so not for the default classes' 5 and 10."""


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    """One priority class.

    Attributes:
        rank: higher rank is served first (strict priority between bands).
        sglang_priority: ``priority`` sent to SGLang (higher runs first; a gap *greater* than SGLang's
            ``--priority-scheduling-preemption-threshold`` lets it preempt lower work: SGLang's default 10
            never does for gaps of 10 or less, so launched workers get
            ``engine.priority_preemption_threshold``, 0 by default).
        ttft_goal_s: time-to-first-token goal (SLO), s; enforced at arrival and at dispatch.
        serve_late: True when an answer after the goal is still useful: such requests are queued even when
            predicted late, and wait up to ``max_wait_s``.
        max_wait_s: longest gateway queue wait, s, whatever the prediction; None = no cap beyond the goal.
            Required (and used as the only deadline) when ``serve_late``.
        max_queue_len: most requests of this class waiting in the gateway.
        min_share: fraction (0..1) of dispatched tokens the class is guaranteed while backlogged.
        window_share: fraction (0..1] of a worker's window this class may fill (at least one request,
            however small the window); the rest stays free for
            higher classes, which otherwise wait for a lower class's long generations to end (a
            partitioned limit, as the partitions of Netflix's ``concurrency-limits``).

    Raises:
        ValueError: a non-positive goal or wait, or ``serve_late`` without ``max_wait_s``.
    """

    rank: int
    sglang_priority: int
    ttft_goal_s: float
    serve_late: bool = False
    max_wait_s: float | None = None
    max_queue_len: int = 2000
    min_share: float = 0.0
    window_share: float = 1.0

    def __post_init__(self) -> None:
        if self.ttft_goal_s <= 0 or (self.max_wait_s is not None and self.max_wait_s <= 0):
            raise ValueError("ttft_goal_s and max_wait_s must be > 0")
        if self.serve_late and self.max_wait_s is None:
            raise ValueError("a serve_late class needs max_wait_s")
        if self.max_queue_len < 1 or not 0 <= self.min_share < 1 or not 0 < self.window_share <= 1:
            raise ValueError("max_queue_len >= 1, 0 <= min_share < 1 and 0 < window_share <= 1")


def default_classes() -> dict[str, ClassPolicy]:
    """``interactive`` > ``standard`` > ``batch``.

    Goals 500 ms / 2 s / 30 s (the SLOs of ``loadgen/scenarios/mixed-classes.yaml``: chat, API and offline
    traffic on a GPU fleet); batch answers stay useful late (queued up to 5 min). SGLang priorities 10/5/0:
    with ``--priority-scheduling-preemption-threshold 0`` (what the launcher passes) a higher class preempts
    lower running work inside the engine when its batch is full; with SGLang's default threshold of 10 none
    of these gaps would (it preempts only on a gap greater than the threshold).
    """
    return {
        "interactive": ClassPolicy(rank=2, sglang_priority=10, ttft_goal_s=0.5, max_queue_len=1000),
        "standard": ClassPolicy(rank=1, sglang_priority=5, ttft_goal_s=2.0, max_queue_len=2000),
        "batch": ClassPolicy(
            rank=0,
            sglang_priority=0,
            ttft_goal_s=30.0,
            serve_late=True,
            max_wait_s=300.0,
            max_queue_len=10000,
        ),
    }


def top_class(classes: Mapping[str, ClassPolicy]) -> str:
    """Name of the highest-rank class.

    Raises:
        ValueError: no classes.
    """
    if not classes:
        raise ValueError("no priority classes")
    return max(classes, key=lambda n: classes[n].rank)
