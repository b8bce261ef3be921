"""Fleet simulation (loadgen.fleet): the gateway's policies in virtual time over simulated workers."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from loadgen.fleet.bridge import fleet_requests, render_chatml, runner_records, tenant_specs
from loadgen.fleet.config import FleetConfig, FleetRequest, TenantSpec
from loadgen.fleet.engine import FleetEngine
from loadgen.fleet.run import main as fleet_main
from loadgen.fleet.run import run_scenario
from loadgen.fleet.sim import PseudoTokenizer, simulate
from loadgen.scenario import ChatMessage, generate_requests, parse_scenario
from loadgen.sim.engine import SimEngine, SimRequest
from loadgen.sim.profiles import get_profile
from loadgen.sim.tokens import tokenize
from policies.admission_types import CoreConfig
from policies.windows import WindowConfig
from service.config.settings import Settings

PROFILE_70B = "llama-3.1-70b-h100-tp8"


def poisson(
    rate: float, duration: float, seed: int = 0, words: int = 200, out: int = 100, **kw: object
) -> list[FleetRequest]:
    rng = random.Random(seed)
    reqs, t, i = [], 0.0, 0
    while (t := t + rng.expovariate(rate)) < duration:
        prompt = " ".join(f"w{rng.randrange(5000)}" for _ in range(words))
        reqs.append(FleetRequest(f"r{i}", t, str(kw.get("tenant", "t0")), prompt, out))
        i += 1
    return reqs


def test_the_simulation_runs_the_gateways_own_core_config() -> None:
    """Nothing is copied: default settings translate into exactly the core the simulation runs."""
    assert Settings().core_config() == FleetConfig().core == CoreConfig()


def fixed(n: int) -> WindowConfig:
    return WindowConfig(mode="fixed", initial=n, minimum=n, maximum=n)


def test_fleet_engine_keeps_the_schedule_of_the_simulated_worker() -> None:
    """Same first-token and finish times as SimEngine under shared prefixes, priorities and KV pressure."""
    profile = dataclasses.replace(get_profile("llama-3.1-8b-h100"), kv_capacity_tokens=30_000)
    rng = random.Random(3)
    shared = [tuple(rng.randrange(1, 1 << 30) for _ in range(300)) for _ in range(4)]
    reqs = []
    t = 0.0
    for i in range(400):
        t += rng.expovariate(200)
        prompt = rng.choice(shared) + tuple(rng.randrange(1, 1 << 30) for _ in range(rng.randint(5, 200)))
        reqs.append((t, SimRequest(f"r{i}", prompt, rng.randint(1, 300), priority=rng.choice([0, 5, 10]))))

    def run(engine: SimEngine) -> dict[str, tuple[float, float, int]]:
        first: dict[str, float] = {}
        out: dict[str, tuple[float, float, int]] = {}
        pending = list(reqs)
        while pending or engine.next_event_time() is not None:
            nxt = engine.next_event_time()
            if pending and (nxt is None or pending[0][0] <= nxt):
                at, req = pending.pop(0)
                engine.advance(at)
                engine.submit(req, at)
                continue
            assert nxt is not None
            for ev in engine.advance(nxt):
                if ev.completion_tokens == 1:
                    first[ev.rid] = ev.time_s
                if ev.finish_reason:
                    out[ev.rid] = (first[ev.rid], ev.time_s, ev.cached_tokens)
        return out

    base = run(SimEngine(profile, seed=1))
    fast = run(FleetEngine(profile, seed=1))
    assert len(base) == 400
    assert fast == base
    assert SimEngine(profile).stats().preemptions_total == 0  # sanity of the helper engine below
    engine = SimEngine(profile, seed=1)
    run(engine)
    assert engine.stats().preemptions_total > 0  # the workload did exercise retraction


def test_pseudo_tokenizer_matches_the_simulated_worker() -> None:
    text = render_chatml([ChatMessage("system", "You are x."), ChatMessage("user", "Hi, there!")])
    assert PseudoTokenizer()(text) == tuple(tokenize(text))


def test_deterministic_for_a_seed_and_all_served_below_capacity() -> None:
    reqs = poisson(100, 10)
    cfg = FleetConfig(workers=4).with_core(window=fixed(64))
    one, two = simulate(cfg, reqs), simulate(cfg, reqs)
    assert [(r.first_token_s, r.done_s, r.worker) for r in one.records] == [
        (r.first_token_s, r.done_s, r.worker) for r in two.records
    ]
    assert Counter(r.outcome for r in one.records) == {"ok": len(reqs)}
    ttfts = sorted(r.ttft_s or 0.0 for r in one.records)
    assert 0.02 < ttfts[len(ttfts) // 2] < 0.2  # 70B TP-8 at low load: ~25-60 ms (NIM anchor 25 ms at c=1)
    assert all(r.completion_tokens == 100 for r in one.records)
    assert sum(w.requests for w in one.workers) == len(reqs)


def test_quota_rejects_and_refunds() -> None:
    reqs = poisson(20, 5, tenant="capped")
    tenants = {"capped": TenantSpec("capped", requests_per_min=600, request_burst=10)}
    res = simulate(FleetConfig(workers=1, tenants=tenants), reqs)
    outcomes = Counter(r.outcome for r in res.records)
    # 10 burst + 10/s refill over 5 s ≈ 60 of ~100 pass
    assert 45 <= outcomes["ok"] <= 70 and outcomes["quota"] == len(reqs) - outcomes["ok"]
    big = [FleetRequest("big", 0.0, "tiny", "a b c", 1000)]
    tiny = {"tiny": TenantSpec("tiny", tokens_per_min=100)}
    assert simulate(FleetConfig(tenants=tiny), big).records[0].outcome == "too_large"


def test_overload_sheds_and_priority_protects_the_top_band() -> None:
    reqs = []
    for cls, seed in (("interactive", 1), ("standard", 2), ("batch", 3)):
        for r in poisson(40, 20, seed=seed, tenant=cls):
            reqs.append(dataclasses.replace(r, rid=f"{cls}-{r.rid}"))
    tenants = {c: TenantSpec(c, priority_class=c) for c in ("interactive", "standard", "batch")}
    res = simulate(FleetConfig(workers=1, tenants=tenants), reqs)
    by = {c: [r for r in res.records if r.band == c] for c in tenants}
    goal = {c: p.ttft_goal_s for c, p in CoreConfig().classes.items()}
    good = {
        c: sum(r.outcome == "ok" and (r.ttft_s or 0.0) <= goal[c] for r in rs) / len(rs)
        for c, rs in by.items()
    }
    failed = {c: sum(r.outcome in ("shed", "expired", "evicted") for r in rs) for c, rs in by.items()}
    # 120 RPS offered to one worker (~55 RPS of capacity) for 20 s: interactive (40 RPS) keeps its 500 ms
    # goal; standard gets what is left within 2 s and the rest is refused (shed at arrival, or expired at
    # its deadline) rather than served late; batch (late answers useful, queued up to 5 min) is never
    # refused, waits behind both and runs mostly after the load ends
    assert good["interactive"] > 0.95
    assert failed["batch"] == 0 and failed["standard"] > len(by["standard"]) // 4
    late = [r for r in by["standard"] if r.outcome == "ok" and (r.ttft_s or 0.0) > goal["standard"]]
    assert len(late) < 0.05 * len(by["standard"])  # capacity is not spent on answers that are late
    during = {c: sum(r.dispatch_s is not None and r.dispatch_s < 20 for r in rs) for c, rs in by.items()}
    assert during["batch"] < 0.1 * during["standard"]  # strict priority while standard is backlogged


def test_fair_queuing_protects_normal_tenants_from_a_noisy_one() -> None:
    reqs = []
    for i, share in enumerate([10] + [1] * 4):
        tenant = f"t{i}"
        for r in poisson(1.5 * share, 30, seed=i, words=100, out=100, tenant=tenant):
            reqs.append(dataclasses.replace(r, rid=f"{tenant}-{r.rid}"))
    res = simulate(FleetConfig(workers=1).with_core(window=fixed(16)), reqs)
    ok_share = {
        t: sum(r.outcome == "ok" for r in rs) / len(rs)
        for t in {r.tenant for r in res.records}
        if (rs := [r for r in res.records if r.tenant == t])
    }
    assert ok_share["t0"] < 0.8
    assert min(ok_share[f"t{i}"] for i in range(1, 5)) > 0.95


def test_cache_aware_keeps_system_prompts_on_their_workers() -> None:
    rng = random.Random(0)
    systems = [" ".join(f"s{k}x{rng.randrange(10**6)}" for _ in range(3000)) for k in range(48)]
    reqs, t = [], 0.0
    for i in range(1500):
        t += rng.expovariate(50)
        prompt = rng.choice(systems) + " " + " ".join(f"q{rng.randrange(10**6)}" for _ in range(50))
        reqs.append(FleetRequest(f"r{i}", t, "t", prompt, 20))
    small = dataclasses.replace(get_profile("llama-3.1-8b-h100"), name="small-kv", kv_capacity_tokens=60_000)
    hit = {}
    for routing in ("cache_aware", "round_robin"):
        res = simulate(FleetConfig(profile=small, workers=4).with_core(routing=routing), reqs)
        done = [r for r in res.records if r.outcome == "ok"]
        hit[routing] = sum(r.cached_tokens for r in done) / sum(r.prompt_tokens for r in done)
    assert hit["cache_aware"] > 0.8 > hit["round_robin"] + 0.2


def test_scenario_bridge_reports_like_the_runner() -> None:
    scenario = parse_scenario(
        {
            "name": "t",
            "seed": 1,
            "duration_s": 10,
            "warmup_s": 1,
            "tenants": [
                {"id": "a", "priority_class": "interactive", "quotas": {"requests_per_min": 60}},
                {"id": "b", "priority_class": "batch"},
            ],
            "slo": {"interactive": {"ttft_ms": 500}, "batch": {"ttft_ms": 30000}},
            "arrival": {"rate_rps": 10},
        }
    )
    specs = tenant_specs(scenario)
    assert specs["a"].requests_per_min == 60 and specs["b"].priority_class == "batch"
    plan = generate_requests(scenario)
    fr = run_scenario(scenario, FleetConfig(workers=2))
    assert len(fr.records) == len(plan) == len(fleet_requests(plan))
    assert runner_records(plan, fr.result) == fr.records
    report = fr.report
    assert report["classes"]["batch"]["ok"] == report["classes"]["batch"]["sent"]
    assert report["classes"]["interactive"]["status_429"] >= 0
    assert report["overall"]["ttft_ms"]["p50"] is not None
    assert report["fleet"]["workers"] == 2 and report["fleet"]["sim_requests_per_cpu_s"] > 0


@pytest.mark.parametrize("routing", ["cache_aware", "round_robin"])
def test_simulation_speed(routing: str) -> None:
    """100 RPS x 20 s on 4 workers (2,000 requests, 200k generated tokens) in a few CPU seconds."""
    res = simulate(FleetConfig(workers=4).with_core(routing=routing), poisson(100, 20))
    assert res.cpu_s < 10
    assert len(res.records) / res.cpu_s > 500


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/no/such.yaml"], "cannot read"),
        (["README.md"], "unknown scenario format"),
        (["loadgen/scenarios/smoke.toml", "--workers", "0"], "--workers: at least 1"),
        (["loadgen/scenarios/smoke.toml", "--profile", "bogus"], "invalid choice: 'bogus'"),
        (["loadgen/scenarios/smoke.toml", "--json", "/no/such/dir/r.json"], "no folder /no/such/dir"),
    ],
)
def test_fleet_command_line_refuses_bad_arguments_with_a_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        fleet_main(args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_fleet_command_line_reports_a_run_with_nothing_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # no request at all: no per-worker balance to show (it crashed formatting None)
    path = tmp_path / "quiet.json"
    scenario = {"name": "quiet", "duration_s": 2, "tenants": [{"id": "a"}]}
    scenario["slo"] = {"standard": {"ttft_ms": 1000}}
    scenario["arrival"] = {"process": "poisson", "rate_rps": 0.001}
    path.write_text(json.dumps(scenario))
    assert fleet_main([str(path), "--workers", "2", "--json", str(tmp_path / "r.json")]) == 0
    assert "fleet: imbalance -" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["fleet"]["imbalance"] is None
