"""Admin API for the planner: ``GET /admin/planner``, each model's last ``radixgate_desired_workers``
decision and what it came from (admin token required).

The same numbers as the planner's series on ``/metrics`` (``radixgate_desired_workers``,
``radixgate_planner_needed_workers``, ``radixgate_planner_reason``), plus each class's part: its measured
and forecast arrival rate, what one request costs a worker and one worker's capacity for it
(:class:`policies.planner.PlanDecision`). Each replica answers with its own planner's decisions, which
every replica takes from the same combined measure (``service/pipeline/planner_task.py``).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from service.api.deps import AdminDep, StateDep
from service.api.errors import APIError

router = APIRouter(prefix="/admin/planner", tags=["admin"], dependencies=[AdminDep])


@router.get("")
async def planner_decisions(state: StateDep) -> dict[str, Any]:
    """Per served model its last decision (``decision`` null before the first tick).

    Raises:
        APIError: 404 ``planner_disabled`` when ``RADIXGATE_PLANNER__ENABLED`` is false.
    """
    planner = state.planner
    if planner is None:
        raise APIError(
            404,
            "The planner is off on this gateway (RADIXGATE_PLANNER__ENABLED=false).",
            code="planner_disabled",
        )
    data = []
    for lane in state.models.lanes:
        decision = planner.decisions.get(lane.model.id)
        shown = None if decision is None else asdict(decision)
        data.append({"object": "planner.decision", "model": lane.model.id, "decision": shown})
    return {"object": "list", "data": data, "interval_s": state.settings.planner.interval_s}
