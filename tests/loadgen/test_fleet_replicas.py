"""N gateway replicas in the fleet simulation (loadgen/fleet/replicas.py, issue 29): each replica's admission
core owns its share of every worker's window, the replicas together never offer a worker more than it runs,
one replica is the simulator as it was, and N replicas serve as one does (the reduced experiment 6)."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from typing import Any

import pytest

from loadgen.fleet import sim as sim_module
from loadgen.fleet.config import FleetConfig, FleetRequest, TenantSpec
from loadgen.fleet.experiments_common import capacity
from loadgen.fleet.experiments_replicas import TOLERANCE, Variant, replicas_figures
from loadgen.fleet.records import FleetResult
from loadgen.fleet.replicas import (
    GatewayReplicas,
    LaneCore,
    ReplicaBalancer,
    lane_cores,
    replica_ids,
)
from loadgen.fleet.sim import FleetSim, simulate
from loadgen.sim.profiles import get_profile
from policies.admission_core import AdmissionCore
from policies.admission_types import AdmissionRequest, CoreConfig, Dispatch
from policies.window_shares import window_share
from policies.windows import LoadReport

PROFILE_70B = "llama-3.1-70b-h100-tp8"


def poisson(
    rate: float, duration: float, seed: int = 0, tenants: tuple[str, ...] = ("t0",)
) -> list[FleetRequest]:
    """Poisson arrivals of ~200-word prompts, 100 tokens out, tenants in turn."""
    rng = random.Random(seed)
    reqs, t, i = [], 0.0, 0
    while (t := t + rng.expovariate(rate)) < duration:
        prompt = " ".join(f"w{rng.randrange(5000)}" for _ in range(200))
        reqs.append(FleetRequest(f"r{i}", t, tenants[i % len(tenants)], prompt, 100))
        i += 1
    return reqs


def small_engine(max_running: int = 16) -> Any:
    """The 70B TP-8 profile with a small ``max_running_requests``, so that a few RPS fill its window."""
    return dataclasses.replace(get_profile(PROFILE_70B), max_running_requests=max_running)


def trace(result: FleetResult) -> list[tuple[object, ...]]:
    """Every request's outcome, worker and times, and every worker's tally: what a run produced."""
    requests = [
        (r.rid, r.outcome, r.shed_reason, r.worker, r.dispatch_s, r.first_token_s, r.done_s, r.cached_tokens)
        for r in result.records
    ]
    workers = [(w.requests, w.completion_tokens, w.window_sizes, w.peak_in_flight) for w in result.workers]
    return [*requests, *workers, (result.duration_s, result.preemptions)]


# ----------------------------------------------------------------------------------------- the window
@pytest.mark.parametrize("replicas", [2, 3, 5])
def test_replicas_together_never_offer_a_worker_more_than_its_window(replicas: int) -> None:
    """Standard requests only (the top class alone may exceed a window, by its headroom), 3x what two
    workers of 16 slots serve: the replicas fill every window together, and never past it; each taking the
    whole window, as without sharing, they offer a worker several times what it runs."""
    cfg = FleetConfig(profile=small_engine(16), workers=2, replicas=replicas)
    reqs = poisson(30, 20)
    shared = simulate(cfg, reqs)
    assert [w.peak_in_flight for w in shared.workers] == [16, 16]
    assert max(max(w.window_sizes) for w in shared.workers) == 16  # the replicas' windows add up to it
    assert Counter(r.outcome for r in shared.records)["ok"] > 100
    unshared = simulate(dataclasses.replace(cfg, share_windows=False), reqs)
    assert min(w.peak_in_flight for w in unshared.workers) > 16


def test_each_replica_owns_the_gateways_share_of_the_window() -> None:
    sim = FleetSim(FleetConfig(profile=small_engine(64), workers=2, replicas=3), [])
    core = sim.core
    assert isinstance(core, GatewayReplicas)
    ids = replica_ids(3)
    for url in ("sim://worker-000", "sim://worker-001"):
        sizes = [c.window(url).size for c in core.cores]  # type: ignore[union-attr]
        assert sizes == [window_share(64, ids, me) for me in ids] == [22, 21, 21]
        window = core.window(url)
        assert window is not None and window.size == 64


# ----------------------------------------------------------------------------------------- one replica
def mixed_overload() -> tuple[FleetConfig, list[FleetRequest]]:
    """Three tenants, one per class, at about twice what one 16-slot worker serves: requests are
    dispatched, queued, shed and expired."""
    tenants = {c: TenantSpec(c, priority_class=c) for c in ("interactive", "standard", "batch")}
    cfg = FleetConfig(profile=small_engine(16), workers=2, tenants=tenants)
    return cfg, poisson(40, 20, seed=3, tenants=tuple(tenants))


def test_one_replica_is_the_simulator_without_replicas() -> None:
    cfg, _ = mixed_overload()
    sim = FleetSim(cfg, [])
    assert type(sim.core) is AdmissionCore  # replicas=1 (the default) runs the plain core, as before
    assert all(type(c) is AdmissionCore for c in lane_cores([CoreConfig()], 1, "round_robin", 0))


def test_a_single_replica_through_the_replica_layer_gives_the_same_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The replica layer itself (load balancer, window shares, decisions handed back, requests forgotten
    when shed or expired) changes nothing with one replica: request for request, the same run."""
    cfg, reqs = mixed_overload()
    plain = simulate(cfg, reqs)
    outcomes = Counter(r.outcome for r in plain.records)
    assert outcomes["ok"] and outcomes["shed"] and outcomes["expired"]  # every path is exercised

    def wrapped(configs: list[CoreConfig], *args: object, **kwargs: object) -> list[LaneCore]:
        return [GatewayReplicas(c, ReplicaBalancer(1)) for c in configs]

    monkeypatch.setattr(sim_module, "lane_cores", wrapped)
    sim = FleetSim(cfg, reqs)
    assert isinstance(sim.core, GatewayReplicas)
    assert trace(sim.run()) == trace(plain)
    assert sim.core.holding == 0  # every request's end reached the layer: none is held after the run


# ----------------------------------------------------------------------------------------- the layer
def test_round_robin_and_seeded_random_balance() -> None:
    rr = ReplicaBalancer(3)
    assert [rr.pick() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    picks = [ReplicaBalancer(4, "random", seed=7) for _ in range(2)]
    first, second = ([b.pick() for _ in range(400)] for b in picks)
    assert first == second and set(first) == {0, 1, 2, 3}
    assert all(70 <= first.count(i) <= 130 for i in range(4))
    with pytest.raises(ValueError, match="at least one"):
        ReplicaBalancer(0)
    with pytest.raises(ValueError, match="unknown balance"):
        ReplicaBalancer(2, "least_conn")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        FleetSim(FleetConfig(replicas=0), [])


def test_a_requests_later_events_go_to_the_replica_that_took_it() -> None:
    gw = GatewayReplicas(CoreConfig(), ReplicaBalancer(2))
    gw.add_worker("w", 8)
    assert [c.window("w").size for c in gw.cores] == [4, 4]  # type: ignore[union-attr]
    decisions = [
        gw.arrive(AdmissionRequest(f"r{i}", "t", "standard", "p", 10, 10, 0.0), 0.0) for i in range(3)
    ]
    assert all(isinstance(d[0], Dispatch) for d in decisions)
    assert [gw.cores[0].in_flight("w"), gw.cores[1].in_flight("w")] == [2, 1]  # r0, r2 | r1
    assert gw.in_flight("w") == 3
    gw.first_token("r1", 0.1, 0)
    gw.finish("r1", 0.2, prompt_tokens=10, cached_tokens=0)
    assert [gw.cores[0].in_flight("w"), gw.cores[1].in_flight("w")] == [2, 0]
    assert gw.finish("r1", 0.3) == []  # forgotten once finished


def test_load_reports_reach_each_replica_with_its_share() -> None:
    gw = GatewayReplicas(CoreConfig(), ReplicaBalancer(3))
    gw.add_worker("w")
    gw.load("w", LoadReport(10, 0, 0.1, 64), 1.0)
    assert [c.window("w").size for c in gw.cores] == [22, 21, 21]  # type: ignore[union-attr]
    assert [gw.replica_share(i, 64) for i in range(3)] == [22 / 64, 21 / 64, 21 / 64]
    unshared = GatewayReplicas(CoreConfig(), ReplicaBalancer(3), share_windows=False)
    unshared.add_worker("w", 64)
    assert [c.window("w").size for c in unshared.cores] == [64, 64, 64]
    assert unshared.replica_share(0, 64) == 1.0


# ----------------------------------------------------------------------------------------- experiment 6
def test_replicas_serve_as_one_does_within_five_percent() -> None:
    """Reduced experiment 6: 2 workers for 30 s, 1-3 replicas at 80% and 120% of their capacity: each
    class's goodput no more than 5% below one replica's, its TTFT P50 and P99 no more than 5% above. Each
    replica counting the engine's prefill backlog as its own alone (``replica_share`` 1), the interactive
    P99 TTFT at 120% rose 8% with 2 replicas."""
    cap = capacity(workers=2, lo=20.0, hi=200.0, steps=5, duration_s=30.0)
    head, runs = replicas_figures(
        workers=2, duration_s=30, cap=cap, replicas=(1, 2, 3), contrasts=False, beyond=(), seeds=(1,)
    )
    assert [r["variant"] for r in runs] == [Variant(n) for n in (1, 2, 3)] * 2
    assert head["misses"] == [] and head["within_goal"]
    assert head["worst_goodput_change"] >= -TOLERANCE and head["worst_ttft_change"] <= TOLERANCE
    overloaded = [r for r in runs if r["rate"] > cap]
    assert len(overloaded) == 3
    assert all(r["classes"]["standard"]["shed_rate"] > 0.05 for r in overloaded)  # 120% is past capacity


# ----------------------------------------------------------------------------------------- route sync
def _req(rid: str, prompt: str, at: float) -> AdmissionRequest:
    return AdmissionRequest(rid, "t", "standard", prompt, 10, 10, at)


@pytest.mark.parametrize("share_routes", [True, False])
def test_a_dispatch_reaches_the_other_replicas_routers_after_the_sync_delay(share_routes: bool) -> None:
    """Replica 0 dispatches a prompt; replica 1's tree learns it ``route_sync_delay_s`` later (the
    gateway's route sync), and never without ``share_routes``."""
    gw = GatewayReplicas(
        CoreConfig(), ReplicaBalancer(2), share_routes=share_routes, route_sync_delay_s=0.005
    )
    for url in ("w0", "w1"):
        gw.add_worker(url, 64)
    prompt = "a system prompt shared by every request of this tenant. " * 4
    (d,) = gw.arrive(_req("r0", prompt + "first question", 0.0), 0.0)  # replica 0
    assert isinstance(d, Dispatch)
    assert gw.cores[1].router.prefix_matches(prompt) == {}  # not yet: published, in flight
    gw.tick(0.004)
    assert gw.cores[1].router.prefix_matches(prompt) == {}
    gw.tick(0.006)
    learned = gw.cores[1].router.prefix_matches(prompt)
    assert learned == ({d.worker: len(prompt)} if share_routes else {})
    (d1,) = gw.arrive(_req("r1", prompt + "second question", 0.01), 0.01)  # replica 1
    assert isinstance(d1, Dispatch)
    # a hit on the prefix's worker, or a miss (its own tree is empty: the first worker, by chance the same)
    assert d1.route.reason == ("cache_hit" if share_routes else "cache_miss")
    if share_routes:
        assert d1.worker == d.worker and d1.route.matched_chars >= len(prompt)
    gw.tick(0.02)
    assert gw.cores[0].router.prefix_matches(prompt + "second question")  # replica 1's route came back


def test_the_sync_delay_must_be_finite_and_not_negative() -> None:
    for bad in (-0.001, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="route_sync_delay_s"):
            GatewayReplicas(CoreConfig(), ReplicaBalancer(2), route_sync_delay_s=bad)
        with pytest.raises(ValueError, match="route_sync_delay_s"):
            FleetConfig(route_sync_delay_s=bad)
