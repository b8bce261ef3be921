"""Priority bands and weighted fair queuing (pure policies, simulated dispatches)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.fair_queue import BandConfig, PriorityBands, QueuedItem, WeightedFairQueue

BANDS = [
    BandConfig("interactive", rank=2, max_queue_len=100, wait_budget_s=1.0),
    BandConfig("standard", rank=1, max_queue_len=100, wait_budget_s=10.0),
    BandConfig("batch", rank=0, max_queue_len=100, wait_budget_s=60.0),
]


def item(
    tenant: str,
    band: str = "standard",
    cost: float = 100,
    weight: float = 1.0,
    now: float = 0.0,
    budget: float = 10.0,
) -> QueuedItem[str]:
    return QueuedItem(f"{tenant}", tenant, weight, cost, band, now, now + budget)


@pytest.mark.parametrize(
    ("arrivals", "expected_order"),
    [
        # (band) arrivals in order -> the bands served in order: strict priority, FIFO inside a tenant
        (["batch", "standard", "interactive"], ["interactive", "standard", "batch"]),
        (
            ["interactive", "batch", "interactive", "standard"],
            ["interactive", "interactive", "standard", "batch"],
        ),
        (["batch", "batch"], ["batch", "batch"]),
    ],
)
def test_strict_order_between_bands(arrivals: list[str], expected_order: list[str]) -> None:
    bands: PriorityBands[str] = PriorityBands(BANDS)
    for band in arrivals:
        bands.push(item("t", band))
    served = []
    while (nxt := bands.pop()) is not None:
        served.append(nxt.band)
    assert served == expected_order


@pytest.mark.parametrize(
    ("weights", "rates"),
    [
        ({"a": 1, "b": 1}, {"a": 10, "b": 1}),  # noisy tenant sends 10x, equal weights
        ({"a": 2, "b": 1}, {"a": 1, "b": 1}),  # weights 2:1
        ({"a": 1, "b": 1, "c": 1, "d": 4}, {"a": 5, "b": 1, "c": 1, "d": 1}),
    ],
)
def test_wfq_shares_follow_weights_for_backlogged_tenants(
    weights: dict[str, float], rates: dict[str, int]
) -> None:
    """10,000 dispatches with random costs; every tenant stays backlogged; shares within 5% of weights."""
    rng = random.Random(7)
    queue: WeightedFairQueue[str] = WeightedFairQueue()
    served: Counter[str] = Counter()
    for _ in range(50):  # initial backlog
        for tenant, rate in rates.items():
            for _ in range(rate):
                queue.push(item(tenant, cost=rng.randint(10, 500), weight=weights[tenant]))
    for _ in range(10_000):
        for tenant, rate in rates.items():  # arrivals keep coming at each tenant's own rate
            for _ in range(rate):
                queue.push(item(tenant, cost=rng.randint(10, 500), weight=weights[tenant]))
        got = queue.pop()
        assert got is not None
        served[got.tenant] += int(got.cost)
    total_w, total_s = sum(weights.values()), sum(served.values())
    for tenant, weight in weights.items():
        assert served[tenant] / total_s == pytest.approx(weight / total_w, rel=0.05), served


def test_no_starvation_inside_a_band() -> None:
    """A light tenant's request is served within a bounded number of dispatches despite a heavy one."""
    queue: WeightedFairQueue[str] = WeightedFairQueue()
    for _ in range(1000):
        queue.push(item("heavy", cost=100))
    queue.pop()
    queue.push(item("light", cost=100))
    position = next(i for i in range(1000) if (got := queue.pop()) is not None and got.tenant == "light")
    assert position <= 1


def test_idle_tenant_cannot_bank_credit() -> None:
    queue: WeightedFairQueue[str] = WeightedFairQueue()
    for _ in range(100):
        queue.push(item("a", cost=10))
    for _ in range(50):
        queue.pop()
    for _ in range(10):
        queue.push(item("late", cost=10))
    served = [got.tenant for _ in range(20) if (got := queue.pop()) is not None]
    assert Counter(served) == {"a": 10, "late": 10}  # alternate from now on, no burst for 'late'


@pytest.mark.parametrize(("min_share", "expected_batch_share"), [(0.0, 0.0), (0.1, 0.1), (0.25, 0.25)])
def test_minimum_share_for_a_lower_band(min_share: float, expected_batch_share: float) -> None:
    bands: PriorityBands[str] = PriorityBands(
        [
            BandConfig("interactive", 2, 100_000, 1.0),
            BandConfig("batch", 0, 100_000, 60.0, min_share=min_share),
        ]
    )
    for _ in range(5000):
        bands.push(item("i", "interactive"))
        bands.push(item("b", "batch"))
    served = Counter(got.band for _ in range(4000) if (got := bands.pop()) is not None)
    assert served["batch"] / 4000 == pytest.approx(expected_batch_share, abs=0.01)


def test_expiry_and_removal() -> None:
    bands: PriorityBands[str] = PriorityBands(BANDS)
    a, b, c = item("a", budget=1), item("b", budget=5), item("c", budget=5)
    for x in (a, b, c):
        bands.push(x)
    assert bands.expired(now=2.0) == [a]
    assert bands.remove(b) and not bands.remove(b)
    assert len(bands) == 1 and bands.pop() is c and bands.pop() is None
    assert not bands.remove(c)  # already dispatched


def test_cost_ahead_counts_higher_bands_and_earlier_tags() -> None:
    bands: PriorityBands[str] = PriorityBands(BANDS)
    bands.push(item("x", "interactive", cost=300))
    bands.push(item("a", "standard", cost=100))
    bands.push(item("a", "standard", cost=100))
    bands.push(item("z", "batch", cost=1000))
    # a new tenant in 'standard' lands after a's first item (tag 100 <= 100), before its second (200)
    assert bands.cost_ahead("standard", "new", 1.0, 100) == 300 + 100
    assert bands.cost_ahead("interactive", "new", 1.0, 100) == 0
    assert bands.cost_ahead("batch", "new", 1.0, 100) == 300 + 200


@pytest.mark.parametrize("first_weight", [1e-320, 1e-300, 1.0])
def test_weights_hold_after_an_idle_queue_whatever_came_before(first_weight: float) -> None:
    # SCFQ resets virtual time at the end of each busy period (Golestani 1994): a past tag, even a huge or
    # infinite one from a tiny weight, must not flatten the next busy period into FIFO order
    queue: WeightedFairQueue[str] = WeightedFairQueue()
    queue.push(item("tiny", weight=first_weight, cost=36))
    assert queue.pop() is not None
    for _ in range(4):
        queue.push(item("a", weight=1.0))
    for _ in range(4):
        queue.push(item("b", weight=4.0))
    served = [nxt.tenant for nxt in iter(queue.pop, None)]
    assert served[:3] == ["b", "b", "b"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["push", "pop", "remove", "remove_again"]), st.integers(0, 2)), max_size=60
    )
)
def test_the_length_kept_is_the_sum_of_the_bands_depths(ops: list[tuple[str, int]]) -> None:
    """``len(PriorityBands)`` is a counter kept on push, pop and remove (it was a sum over the bands, asked
    several times a request): it always equals the bands' depths, a second remove of an item included."""
    bands: PriorityBands[str] = PriorityBands(BANDS)
    names = [b.name for b in BANDS]
    queued: list[QueuedItem[str]] = []
    removed: list[QueuedItem[str]] = []
    for n, (op, band) in enumerate(ops):
        if op == "push":
            queued.append(item(f"t{n % 3}", names[band], cost=1.0 + n % 4))
            bands.push(queued[-1])
        elif op == "pop":
            got = bands.pop()
            assert (got is None) == (not queued)
            if got is not None:
                queued.remove(got)
        elif op == "remove" and queued:
            removed.append(queued.pop(band % len(queued)))
            assert bands.remove(removed[-1])
        elif op == "remove_again" and removed:
            assert not bands.remove(removed[-1])
        assert len(bands) == sum(bands.depth(name) for name in names) == len(queued)
        assert (bands.peek() is None) == (not queued)
