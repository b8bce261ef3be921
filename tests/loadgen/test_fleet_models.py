"""Several models in the fleet simulation: each with its own workers and its own admission core, as the
gateway has one per model of RADIXGATE_MODELS (issue 27)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadgen.fleet.config import FleetConfig, FleetModel
from loadgen.fleet.experiments_common import goals
from loadgen.fleet.experiments_models import BIG, SMALL, ModelLoad, model_requests, models_figures, run_models
from loadgen.fleet.sim import FleetSim, simulate


def two_models(small_rate: float, big_rate: float) -> tuple[ModelLoad, ModelLoad]:
    return replace(SMALL, rate=small_rate), replace(BIG, rate=big_rate, workers=2)


def test_requests_run_only_on_their_models_workers_each_model_with_its_own_core() -> None:
    small, big = two_models(150, 120)
    config = FleetConfig(models=(small.fleet_model(), big.fleet_model()))
    requests = model_requests(small, 8, 0) + model_requests(big, 8, 0)
    sim = FleetSim(config, requests)
    assert [w.url for w in sim.workers] == [
        "sim://llama-3.1-8b/worker-000",
        "sim://llama-3.1-8b/worker-001",
        "sim://llama-3.1-70b/worker-000",
        "sim://llama-3.1-70b/worker-001",
    ]
    assert len({id(lane.core) for lane in sim.lanes}) == 2
    result = sim.run()
    lane_of = {0: small.name, 1: small.name, 2: big.name, 3: big.name}
    ran = [r for r in result.records if r.worker >= 0]
    assert {r.model for r in ran} == {small.name, big.name}
    assert all(lane_of[r.worker] == r.model for r in ran)
    assert all(r.rid.startswith(f"{r.model}/") for r in result.records)
    assert sum(w.requests for w in result.workers[:2]) == sum(r.model == small.name for r in ran)


def test_one_models_overload_leaves_the_other_request_for_request_as_alone() -> None:
    small, big = two_models(150, 600)  # the large model on 2 workers at ~3x what they serve
    alone, trace_alone = run_models([small], 15, 3)
    both, trace_both = run_models([small, big], 15, 3)
    assert both[big.name]["shed_rate"] > 0.3  # it is overloaded, and sheds
    assert both[small.name]["shed_rate"] == alone[small.name]["shed_rate"]
    assert trace_both[small.name] == trace_alone[small.name]
    assert len(trace_alone[small.name]) > 1500


def test_per_model_goals_shape_admission() -> None:
    # the same model and load (a little past what 2 workers serve) under two goals: the tight goal sheds
    # what would miss it and keeps its served P99 near it; the loose one queues them and serves them all
    tight = ModelLoad("tight", BIG.profile, 2, 150.0, 110.0)
    loose = ModelLoad("loose", BIG.profile, 2, 3000.0, 110.0)
    figures, _ = run_models([tight, loose], 15, 3)
    assert figures["tight"]["shed_rate"] > 0.05 and figures["loose"]["shed_rate"] == 0.0
    assert figures["tight"]["p99"] < 150.0 * 1.2
    assert figures["loose"]["p99"] > 3 * figures["tight"]["p99"]
    assert figures["loose"]["goodput"] == 1.0


def test_a_request_for_a_model_the_fleet_does_not_serve_is_refused() -> None:
    small, _ = two_models(50, 0)
    config = FleetConfig(models=(small.fleet_model(),))
    stray = replace(model_requests(small, 1, 0)[0], model="gpt-4")
    with pytest.raises(ValueError, match="gpt-4"):
        FleetSim(config, [stray])


def test_one_model_without_models_is_the_default_fleet() -> None:
    small, _ = two_models(100, 0)
    requests = [replace(r, model=None) for r in model_requests(small, 4, 0)]
    core = replace(FleetConfig().core, classes=goals(small.slo()))
    default = simulate(FleetConfig(profile=small.profile, workers=2, core=core), requests)
    named = simulate(FleetConfig(models=(FleetModel("default", small.profile, 2, core),)), requests)
    assert [(r.outcome, r.first_token_s, r.worker) for r in default.records] == [
        (r.outcome, r.first_token_s, r.worker) for r in named.records
    ]
    assert FleetSim(FleetConfig(workers=2), []).workers[1].url == "sim://worker-001"


def test_the_experiment_reports_the_small_model_unaffected() -> None:
    head, rows = models_figures(duration_s=10, warmup_s=2, caps=(200.0, 100.0), multiples=(3.0,))
    assert head["small_unaffected"] is True
    assert [r["run"] for r in rows] == ["small model alone", "with the large model at 3x"]
    assert head["small_goodput_at_worst"] == head["small_goodput_alone"]
    assert rows[1]["figures"][BIG.name]["shed_rate"] > 0.2
