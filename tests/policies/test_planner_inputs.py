"""The planner's inputs from what an admission core measured (policies.planner_inputs): pure, table-driven."""

from __future__ import annotations

import pytest

from policies.admission_types import WorkerSnapshot
from policies.demand import DemandMeter
from policies.planner_inputs import PlannerMeter, combine
from policies.windows import LoadReport

BANDS = ("interactive", "standard")
GOALS = {"interactive": 0.5, "standard": 2.0}


def snap(
    url: str, in_flight: int, queued: int = 0, capacity: float | None = 30.0, window: int = 100
) -> WorkerSnapshot:
    return WorkerSnapshot(url, True, window, in_flight, queued, capacity, None)


def measure(meter: PlannerMeter, snaps: list[WorkerSnapshot], eligible: set[str] | None = None) -> dict:
    demand = DemandMeter()
    for _ in range(20):
        demand.arrive("interactive", 200, 100)
    for _ in range(30):
        demand.arrive("standard", 800, 100)
    demand.answered(1000, 250)
    loads = {s.url: LoadReport(s.in_flight, 0, 0.1, 200) for s in snaps}
    urls = eligible if eligible is not None else {s.url for s in snaps}
    return meter.measure(demand.take(), 10.0, BANDS, {"standard": 3}, snaps, loads, urls)


@pytest.mark.parametrize(
    ("prior", "snaps", "capacity"),
    [
        # nothing ran full: the prior, or nothing (the planner holds)
        (25.0, [snap("a", 50)], 25.0),
        (None, [snap("a", 50)], None),
        # ran full (window 90% used, or requests waiting for it): measured, scaled to the engine's window
        # of 200 from this core's window of 100; the profiled prior bounds it from above
        (None, [snap("a", 95)], 60.0),
        (None, [snap("a", 10, queued=1)], 60.0),
        (25.0, [snap("a", 95)], 25.0),
        (80.0, [snap("a", 95)], 60.0),
        (80.0, [snap("a", 95), snap("b", 95, capacity=20.0)], 50.0),
        # full but nothing measured yet
        (25.0, [snap("a", 95, capacity=None)], 25.0),
    ],
)
def test_capacity_is_the_profiled_one_unless_a_worker_running_full_measured_less(
    prior: float | None, snaps: list[WorkerSnapshot], capacity: float | None
) -> None:
    assert measure(PlannerMeter(prior), snaps)["capacity"] == capacity


def test_a_worker_that_leaves_takes_its_measure_with_it() -> None:
    meter = PlannerMeter(None)
    assert measure(meter, [snap("a", 95), snap("b", 95, capacity=20.0)])["capacity"] == 50.0
    # b is no longer eligible (drained): only a's measure is left, though a is not full now
    assert measure(meter, [snap("a", 10), snap("b", 10)], eligible={"a"})["capacity"] == 60.0


def test_rates_lengths_queues_and_tokens_per_class() -> None:
    m = measure(PlannerMeter(None), [snap("a", 10)])
    assert m["classes"]["interactive"] == [2.0, 200.0, 100.0, 0.0]
    assert m["classes"]["standard"] == [3.0, 800.0, 100.0, 3.0]
    assert m["tokens"] == [1000, 250] and m["window"] == 200 and m["batch"] == 10.0


def test_a_class_without_arrivals_keeps_its_last_lengths() -> None:
    meter = PlannerMeter(None)
    measure(meter, [snap("a", 10)])
    quiet = meter.measure(DemandMeter().take(), 10.0, BANDS, {}, [snap("a", 10)], {}, {"a"})
    assert quiet["classes"]["standard"] == [0.0, 800.0, 100.0, 0.0]


@pytest.mark.parametrize(
    ("prior", "snaps", "engine"),
    [
        (None, [snap("a", 50)], False),  # no capacity yet: the planner holds
        (25.0, [snap("a", 50)], True),
        (None, [snap("a", 95)], True),
    ],
)
def test_inputs_have_an_engine_model_once_a_capacity_is_known(
    prior: float | None, snaps: list[WorkerSnapshot], engine: bool
) -> None:
    meter = PlannerMeter(prior)
    inputs = meter.inputs(combine([measure(meter, snaps)]), GOALS, workers=len(snaps))
    assert (inputs.engine is not None) == engine
    assert set(inputs.classes) == set(BANDS) and inputs.workers == len(snaps)
    assert meter.hit_rate == 0.25
    if inputs.engine is not None:
        cap = 25.0 if prior else 60.0
        # a request of the mean output length costs 1 / capacity of a worker
        assert inputs.engine.step_base_s * 100.0 / inputs.engine.max_batch == pytest.approx(1 / cap)
