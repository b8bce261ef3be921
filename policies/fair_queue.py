"""Priority bands with weighted fair queuing between tenants inside each band (pure, time injected).

Inside a band: Self-Clocked Fair Queuing (SCFQ; S. J. Golestani, "A Self-Clocked Fair Queueing Scheme for
Broadband Applications", INFOCOM 1994), a virtual-finish-time WFQ (Demers, Keshav & Shenker, SIGCOMM 1989)
whose virtual time is the finish tag of the item last dequeued. An item of tenant ``t`` with cost ``c``
(tokens) gets the tag ``F = max(V, F_last[t]) + c / w_t``; the smallest tag is served next. While tenants are
backlogged, each receives service (in tokens) in proportion to its weight, whatever its arrival rate; a tenant
that was idle cannot bank credit (its tag starts at ``V``).

Between bands: strict priority by rank, with an optional minimum share per lower band: every dispatch of
cost ``c`` from another band credits each backlogged band ``b`` with ``c * s_b / (1 - s_b)``; a band whose
credit covers its head item is served first (then pays the cost from its credit), so a backlogged band gets
at least the fraction ``s_b`` of all dispatched cost. With all shares at 0
(the default) a lower band runs only when every higher band is empty: starvation is a choice.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sortedcontainers import SortedList

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BandConfig:
    """One priority band.

    Attributes:
        name: class name (e.g. ``"interactive"``).
        rank: higher rank is served first.
        max_queue_len: most requests waiting in this band; a full band sheds new arrivals.
        wait_budget_s: longest queue wait before a request is useless and expires, s.
        min_share: fraction (0..1) of dispatched cost this band is guaranteed while backlogged.
    """

    name: str
    rank: int
    max_queue_len: int
    wait_budget_s: float
    min_share: float = 0.0


@dataclass(slots=True, eq=False)
class QueuedItem(Generic[T]):
    """A request waiting in a band.

    Attributes:
        payload: the caller's object.
        tenant: tenant id (the WFQ flow).
        weight: the tenant's weight (> 0).
        cost: tokens the request will use (prompt + max_tokens).
        band: band name.
        enqueued_at: arrival time, s.
        deadline: time after which it expires, s.
    """

    payload: T
    tenant: str
    weight: float
    cost: float
    band: str
    enqueued_at: float
    deadline: float
    finish_tag: float = 0.0
    seq: int = 0
    removed: bool = field(default=False, repr=False)


class WeightedFairQueue(Generic[T]):
    """SCFQ queue of one band, kept sorted by finish tag (``sortedcontainers.SortedList``).

    Push, pop and removal are O(log n); so is :meth:`count_ahead` (a rank query), which the admission
    core uses to predict how many requests are served before a new one.
    """

    def __init__(self) -> None:
        self._sorted: SortedList = SortedList()
        self._last_finish: dict[str, float] = {}
        self._vtime = 0.0
        self._cost = 0.0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._sorted)

    @property
    def queued_cost(self) -> float:
        """Sum of the costs waiting, tokens."""
        return self._cost

    def tag_for(self, tenant: str, weight: float, cost: float) -> float:
        """The finish tag an item would get if pushed now."""
        return max(self._vtime, self._last_finish.get(tenant, 0.0)) + cost / weight

    def push(self, item: QueuedItem[T]) -> None:
        """Enqueue ``item`` (sets its finish tag)."""
        item.finish_tag = self.tag_for(item.tenant, item.weight, item.cost)
        item.seq = next(self._seq)
        item.removed = False
        self._last_finish[item.tenant] = item.finish_tag
        self._sorted.add((item.finish_tag, item.seq, item))
        self._cost += item.cost

    def peek(self) -> QueuedItem[T] | None:
        """The item ``pop`` would return, or None."""
        return self._sorted[0][2] if self._sorted else None

    def pop(self) -> QueuedItem[T] | None:
        """Dequeue the smallest finish tag and advance virtual time to it."""
        if not self._sorted:
            return None
        item: QueuedItem[T] = self._sorted.pop(0)[2]
        item.removed = True  # no longer queued: a later remove() is a no-op
        self._vtime = item.finish_tag
        self._cost -= item.cost
        if not self._sorted:
            self._end_busy_period()
        return item

    def remove(self, item: QueuedItem[T]) -> bool:
        """Take ``item`` out (cancelled or expired); False if it was not queued."""
        if item.removed:
            return False
        item.removed = True
        self._sorted.remove((item.finish_tag, item.seq, item))
        self._cost -= item.cost
        if not self._sorted:
            self._end_busy_period()
        return True

    def _end_busy_period(self) -> None:
        """Nobody is backlogged: no tag carries over, and virtual time restarts at 0 (SCFQ resets it at the
        end of each busy period, Golestani 1994), so one huge tag (a tiny weight) cannot flatten later
        periods into FIFO order."""
        self._last_finish.clear()
        self._vtime = 0.0

    def items(self) -> Iterator[QueuedItem[T]]:
        """Queued items in service order."""
        return (entry[2] for entry in self._sorted)

    def count_ahead(self, finish_tag: float) -> int:
        """How many queued items would be served before a new item with ``finish_tag``."""
        return int(self._sorted.bisect_right((finish_tag, math.inf)))

    def cost_ahead(self, finish_tag: float) -> float:
        """Cost of the queued items that would be served before a new item with ``finish_tag``."""
        return sum(i.cost for i in self.items() if i.finish_tag <= finish_tag)

    def newest(self) -> QueuedItem[T] | None:
        """The item with the largest finish tag (served last), or None."""
        return self._sorted[-1][2] if self._sorted else None


class PriorityBands(Generic[T]):
    """Strict-priority bands, each a :class:`WeightedFairQueue`, with optional minimum shares.

    Args:
        bands: band configurations (names unique).

    Raises:
        ValueError: duplicate band names or a min_share outside [0, 1).
    """

    def __init__(self, bands: Sequence[BandConfig]) -> None:
        names = [b.name for b in bands]
        if len(set(names)) != len(names):
            raise ValueError("band names must be unique")
        if any(not 0 <= b.min_share < 1 for b in bands):
            raise ValueError("min_share must be in [0, 1)")
        self.configs = {b.name: b for b in sorted(bands, key=lambda b: -b.rank)}
        self._queues: dict[str, WeightedFairQueue[T]] = {name: WeightedFairQueue() for name in self.configs}
        self._credit: dict[str, float] = dict.fromkeys(self.configs, 0.0)
        self._count = 0  # items queued over all bands (len() is asked several times a request)

    def __len__(self) -> int:
        return self._count

    def depth(self, band: str) -> int:
        """Requests waiting in ``band``."""
        return len(self._queues[band])

    def queue(self, band: str) -> WeightedFairQueue[T]:
        """The WFQ queue of ``band``."""
        return self._queues[band]

    def push(self, item: QueuedItem[T]) -> None:
        """Enqueue into ``item.band`` (capacity checks are the caller's, see ``policies.admission_core``)."""
        self._queues[item.band].push(item)
        self._count += 1

    def remove(self, item: QueuedItem[T]) -> bool:
        """Take an item out of its band; False if it was not queued."""
        removed = self._queues[item.band].remove(item)
        self._count -= removed
        return removed

    def _next_band(self) -> str | None:
        if not self._count:
            return None
        # a backlogged band whose guaranteed-share credit covers its head goes first (highest rank first),
        # else the highest backlogged band; one pass over the bands
        first: str | None = None
        for name, cfg in self.configs.items():
            head = self._queues[name].peek()
            if head is None:
                continue
            if cfg.min_share > 0 and self._credit[name] >= head.cost:
                return name
            if first is None:
                first = name
        return first

    def peek(self) -> QueuedItem[T] | None:
        """The item ``pop`` would return next, or None when all bands are empty."""
        band = self._next_band()
        return None if band is None else self._queues[band].peek()

    def pop(self) -> QueuedItem[T] | None:
        """Dequeue the next item: min-share credit first, then strict priority, WFQ inside the band."""
        band = self._next_band()
        if band is None:
            return None
        item = self._queues[band].pop()
        assert item is not None
        self._count -= 1
        if self.configs[band].min_share > 0 and self._credit[band] >= item.cost:
            self._credit[band] -= item.cost
        for name, cfg in self.configs.items():
            if name != band and cfg.min_share > 0:
                if self._queues[name].peek() is not None:
                    # credit s/(1-s) per unit served elsewhere => this band gets fraction s of the total
                    self._credit[name] += cfg.min_share / (1.0 - cfg.min_share) * item.cost
                else:
                    self._credit[name] = 0.0  # no banking while idle
        return item

    def all_items(self) -> list[QueuedItem[T]]:
        """Every queued item, highest band first, in service order inside a band."""
        return [i for q in self._queues.values() for i in q.items()]

    def expired(self, now: float) -> list[QueuedItem[T]]:
        """Remove and return every item whose deadline has passed at ``now`` (s)."""
        out = [i for q in self._queues.values() for i in q.items() if i.deadline <= now]
        for item in out:
            self.remove(item)
        return out

    def cost_ahead(self, band: str, tenant: str, weight: float, cost: float) -> float:
        """Tokens that would be served before a new request: higher bands plus earlier tags in its band."""
        if not self._count:
            return 0.0
        rank = self.configs[band].rank
        higher = sum(q.queued_cost for name, q in self._queues.items() if self.configs[name].rank > rank)
        own = self._queues[band]
        return higher + own.cost_ahead(own.tag_for(tenant, weight, cost))

    def count_ahead(self, band: str, tenant: str, weight: float, cost: float) -> int:
        """Requests that would be served before a new one: higher bands plus earlier tags in its band."""
        if not self._count:
            return 0
        rank = self.configs[band].rank
        higher = sum(len(q) for name, q in self._queues.items() if self.configs[name].rank > rank)
        own = self._queues[band]
        return higher + own.count_ahead(own.tag_for(tenant, weight, cost))

    def lowest_backlogged_below(self, rank: int) -> str | None:
        """Name of the lowest-rank non-empty band whose rank is below ``rank``, or None."""
        for name in reversed(list(self.configs)):
            if self.configs[name].rank < rank and len(self._queues[name]) > 0:
                return name
        return None
