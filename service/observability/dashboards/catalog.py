"""Every radixgate dashboard, by the name of its JSON file under ``deploy/grafana/`` (its uid)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from service.observability.dashboards import hardware_board, service_board, tenants_board, workers_board
from service.observability.dashboards.kit import Board

BUILDERS: tuple[Callable[[], Board], ...] = (
    service_board.build,
    tenants_board.build,
    workers_board.build,
    hardware_board.build,
)
"""The dashboards, in the order docs/observability.md lists them."""


def build_all() -> dict[str, dict[str, Any]]:
    """File name (``<uid>.json``) -> the dashboard's Grafana JSON model."""
    boards = [build() for build in BUILDERS]
    return {f"{board.uid}.json": board.to_json() for board in boards}


def render(dashboard: dict[str, Any]) -> str:
    """The text committed for ``dashboard``: JSON, 2-space indent, keys sorted, one final newline."""
    return json.dumps(dashboard, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
