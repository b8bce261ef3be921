"""FairSlots: freed slots go round robin across tenants, FIFO within one, with a per-tenant waiting bound."""

from __future__ import annotations

import asyncio

import pytest

from service.pipeline.fair_slots import FairSlots, TooManyWaiting


async def _run(slots: FairSlots, tenant: str, name: str, order: list[str], gate: asyncio.Event) -> None:
    async with slots.hold(tenant):
        order.append(name)
        await gate.wait()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize(
    ("slots", "arrivals", "served"),
    [
        # one tenant's flood does not delay a later tenant's request by more than one turn
        (1, ["a1", "a2", "a3", "a4", "b1"], ["a1", "a2", "b1", "a3", "a4"]),
        # three tenants take turns; each in its own arrival order
        (1, ["a1", "a2", "a3", "b1", "b2", "c1"], ["a1", "a2", "b1", "c1", "a3", "b2"]),
        # two slots: the first two start at once, then turns
        (2, ["a1", "a2", "a3", "a4", "b1"], ["a1", "a2", "a3", "b1", "a4"]),
    ],
)
async def test_freed_slots_go_round_robin_across_tenants(
    slots: int, arrivals: list[str], served: list[str]
) -> None:
    fair = FairSlots(slots, max_waiting=10)
    order: list[str] = []
    gates = {name: asyncio.Event() for name in arrivals}
    tasks = {}
    for name in arrivals:
        tasks[name] = asyncio.create_task(_run(fair, name[0], name, order, gates[name]))
        await _settle()
    while len(order) < len(arrivals):
        running = [n for n in order if not gates[n].is_set()]
        gates[running[0]].set()  # the oldest holder finishes
        await _settle()
    for gate in gates.values():
        gate.set()
    await asyncio.gather(*tasks.values())
    assert order == served
    assert fair.waiting() == 0


async def test_a_tenant_past_its_waiting_bound_is_refused_and_others_are_not() -> None:
    fair = FairSlots(1, max_waiting=2)
    gate = asyncio.Event()
    order: list[str] = []
    holders = [
        asyncio.create_task(_run(fair, "a", f"a{i}", order, gate)) for i in range(3)
    ]  # 1 holds, 2 wait
    await _settle()
    assert fair.waiting("a") == 2
    with pytest.raises(TooManyWaiting):
        async with fair.hold("a"):
            pass
    other = asyncio.create_task(_run(fair, "b", "b1", order, gate))
    await _settle()
    assert fair.waiting("b") == 1
    gate.set()
    await asyncio.gather(*holders, other)
    assert order == ["a0", "a1", "b1", "a2"]


async def test_a_cancelled_waiter_gives_up_its_place_and_no_slot_is_lost() -> None:
    fair = FairSlots(1, max_waiting=5)
    gate = asyncio.Event()
    order: list[str] = []
    first = asyncio.create_task(_run(fair, "a", "a1", order, gate))
    await _settle()
    quitter = asyncio.create_task(_run(fair, "b", "b1", order, gate))
    stayer = asyncio.create_task(_run(fair, "c", "c1", order, gate))
    await _settle()
    quitter.cancel()
    await _settle()
    assert fair.waiting("b") == 0 and fair.waiting() == 1
    gate.set()
    await asyncio.gather(first, stayer)
    assert order == ["a1", "c1"]
    async with fair.hold("d"):  # the slot came back
        assert fair.waiting() == 0


async def test_a_waiter_cancelled_as_it_was_granted_passes_the_slot_on() -> None:
    fair = FairSlots(1, max_waiting=5)
    gate = asyncio.Event()
    order: list[str] = []
    await fair._acquire("a")  # this test holds the slot
    granted_then_cancelled = asyncio.create_task(_run(fair, "b", "b1", order, gate))
    after = asyncio.create_task(_run(fair, "c", "c1", order, gate))
    await _settle()
    fair._release()  # grants b1's turn ...
    granted_then_cancelled.cancel()  # ... and b1 is cancelled before it runs
    gate.set()
    await asyncio.gather(granted_then_cancelled, after, return_exceptions=True)
    assert granted_then_cancelled.cancelled()
    assert order == ["c1"]


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        FairSlots(0, 1)
    with pytest.raises(ValueError):
        FairSlots(1, -1)
