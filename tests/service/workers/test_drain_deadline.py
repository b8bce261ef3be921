"""The drain deadline of leaving workers (service/workers/drain_deadline.py, through WorkerPool.drain): at
``deadline_s`` a draining worker's calls are cut, unless it is idle by then, active again, gone from the
pool, or no other worker of its model could take them (then tried again ``retry_s`` later)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from service.workers.drain_deadline import DrainDeadlines
from service.workers.pool import WorkerPool

A, B = "http://a", "http://b"


@dataclass
class Fleet:
    """What the deadlines read and do, set by each test."""

    in_flight: dict[str, int] = field(default_factory=dict)
    others: bool = True
    moved: list[str] = field(default_factory=list)

    def deadlines(self, deadline_s: float | None, retry_s: float = 0.05) -> DrainDeadlines:
        return DrainDeadlines(
            deadline_s,
            retry_s,
            lambda url: self.in_flight.get(url, 0),
            lambda url: self.others,
            self.move_off,
        )

    def move_off(self, url: str) -> int:
        self.moved.append(url)
        return self.in_flight.get(url, 0)


@pytest.mark.parametrize(
    ("deadline_s", "in_flight", "cancelled", "moved"),
    [
        (0.05, 3, False, [A]),  # still busy at the deadline: its calls move
        (0.0, 1, False, [A]),  # 0: at once
        (0.05, 0, False, []),  # idle by then: nothing to move
        (0.05, 3, True, []),  # active again (or idle, or removed) before the deadline
        (None, 3, False, []),  # no deadline: they finish where they run
    ],
)
async def test_the_deadline_moves_what_still_runs(
    deadline_s: float | None, in_flight: int, cancelled: bool, moved: list[str]
) -> None:
    fleet = Fleet(in_flight={A: in_flight})
    deadlines = fleet.deadlines(deadline_s)
    deadlines.begin(A)
    if cancelled:
        deadlines.cancel(A)
    await asyncio.sleep(0.15)
    assert fleet.moved == moved
    assert deadlines.pending() == []


async def test_with_no_other_worker_the_calls_stay_until_one_can_take_them() -> None:
    fleet = Fleet(in_flight={A: 2}, others=False)
    deadlines = fleet.deadlines(0.02, retry_s=0.05)
    deadlines.begin(A)
    await asyncio.sleep(0.2)
    assert fleet.moved == [] and deadlines.pending() == [A]  # a resume would have nowhere to go
    fleet.others = True
    await asyncio.sleep(0.1)
    assert fleet.moved == [A] and deadlines.pending() == []


async def test_stop_cancels_every_deadline() -> None:
    fleet = Fleet(in_flight={A: 1, B: 1})
    deadlines = fleet.deadlines(0.05)
    deadlines.begin(A)
    deadlines.begin(B)
    deadlines.stop()
    await asyncio.sleep(0.1)
    assert fleet.moved == []


class CutCounter:
    """The pool's client, as the drain deadline uses it."""

    def __init__(self) -> None:
        self.cut: list[str] = []

    def move_off(self, url: str) -> int:
        self.cut.append(url)
        return 1


async def test_the_pool_drains_with_a_deadline_only_a_busy_worker_of_a_model_with_another() -> None:
    client = CutCounter()
    pool = WorkerPool([A, B], client, 0.05, drain_deadline_s=0.05)  # type: ignore[arg-type]
    for url in (A, B):
        pool.record(url, "request_ok")
    pool.acquire(A, 10)
    assert pool.drain(A) and pool.deadlines.pending() == [A]
    assert pool.drain(A) and pool.deadlines.pending() == [A]  # drained again: the same deadline
    await asyncio.sleep(0.15)
    assert client.cut == [A]  # B was eligible: A's calls were cut
    pool.release(A, 10)  # the moved call left A: it is idle, and removed
    assert pool.get(A) is None and pool.deadlines.pending() == []
    # B alone: drained while busy, its calls have nowhere to go and stay
    pool.acquire(B, 10)
    pool.drain(B)
    await asyncio.sleep(0.15)
    assert client.cut == [A] and pool.deadlines.pending() == [B]
    assert pool.activate(B) and pool.deadlines.pending() == []  # active again: nothing to move
    assert pool.choose() == B
    await pool.stop()
