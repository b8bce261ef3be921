"""A min-heap of request deadlines with lazy deletion (pure).

The admission core keeps two: queued requests' dispatch deadlines and dispatched requests' first-token
deadlines. A request that leaves (dispatched, finished, its deadline moved) is not searched for in the
heap: its stale entry is dropped when it reaches the top and the caller's ``valid`` check says so, which
keeps every operation O(log n) (the usual "lazy deletion" of a binary heap, e.g. Python's ``heapq``
documentation, "Priority Queue Implementation Notes").
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator


class DeadlineHeap:
    """Deadlines (s, on the caller's clock) of request ids, earliest first.

    Entries are never removed from the middle; :meth:`due` and :meth:`earliest` ask ``valid(deadline,
    rid)`` whether an entry still stands, and drop it otherwise.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()  # tie-breaker: equal deadlines in push order

    def push(self, deadline: float, rid: str) -> None:
        """Add ``rid``'s ``deadline``, s."""
        heapq.heappush(self._heap, (deadline, next(self._seq), rid))

    def due(self, now: float) -> Iterator[tuple[float, str]]:
        """Pop and yield every ``(deadline, rid)`` with ``deadline <= now``, earliest first (stale ones
        too: the caller checks each)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, _, rid = heapq.heappop(heap)
            yield deadline, rid

    def earliest(self, valid: Callable[[float, str], bool]) -> float | None:
        """The earliest deadline that is still ``valid``, s (stale ones above it are dropped); None when
        there is none."""
        heap = self._heap
        while heap:
            deadline, _, rid = heap[0]
            if valid(deadline, rid):
                return deadline
            heapq.heappop(heap)
        return None

    def __len__(self) -> int:
        return len(self._heap)


__all__ = ["DeadlineHeap"]
