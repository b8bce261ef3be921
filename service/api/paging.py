"""Paging of the admin lists (tenants, a tenant's keys, workers), in OpenAI's list shape.

Every list takes ``limit`` (1 to :data:`MAX_PAGE`, default :data:`DEFAULT_PAGE`) and ``after`` (the
``last_id`` of the page before; none: from the start), and answers
``{"object": "list", "data": [...], "first_id", "last_id", "has_more"}`` (OpenAI's cursor lists, e.g.
``GET /v1/files``). A ``limit`` outside the bounds is refused with 400 ``invalid_value`` naming
``query.limit``, never clamped: a client that asked for more than it got would take the page for the end.

Each list has a total order and a page starts after its cursor's position in it, so an item that exists
from the first page to the last is listed exactly once, whatever is added or removed in between.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

from fastapi import Query

DEFAULT_PAGE = 100
"""Items on a page when the request names no ``limit``."""

MAX_PAGE = 1000
"""Largest ``limit`` of one page."""

Limit = Annotated[
    int, Query(ge=1, le=MAX_PAGE, description=f"Items on the page, 1-{MAX_PAGE} (default {DEFAULT_PAGE}).")
]
"""The ``limit`` query parameter."""

After = Annotated[
    str | None, Query(max_length=256, description="Start after this id (the previous page's last_id).")
]
"""The ``after`` query parameter (an empty value is no cursor)."""

T = TypeVar("T")


def page_after(
    items: Sequence[T], key: Callable[[T], str], after: str | None, limit: int
) -> tuple[list[T], bool]:
    """The page of ``items`` (sorted by ``key``, unique) after id ``after`` (any string: the page starts
    at the first id above it), at most ``limit``; and whether more follow."""
    start = bisect.bisect_right([key(item) for item in items], after) if after else 0
    return list(items[start : start + limit]), start + limit < len(items)


def list_object(data: list[dict[str, Any]], id_field: str, has_more: bool) -> dict[str, Any]:
    """OpenAI's list object for a page: ``object``, ``data``, ``first_id``/``last_id`` (the ``id_field``
    of its first and last items; None when empty) and ``has_more``."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0][id_field] if data else None,
        "last_id": data[-1][id_field] if data else None,
        "has_more": has_more,
    }
