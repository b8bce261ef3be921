"""loadgen scenarios: validation messages; the pure planner (determinism, rates, shares, prompt sharing)."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from loadgen.scenario import (
    ScenarioError,
    generate_requests,
    load_scenario,
    parse_scenario,
)

EXAMPLES = sorted(Path("loadgen/scenarios").glob("*.*"))


def base(**over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "duration_s": 100,
        "tenants": [{"id": "a"}, {"id": "b", "share": 3}],
        "slo": {"standard": {"ttft_ms": 1000}},
        "arrival": {"rate_rps": 20},
    }
    data.update(over)
    return data


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_scenarios_load_and_plan(path: Path) -> None:
    scenario = load_scenario(path)
    plan = generate_requests(scenario)
    assert plan and plan == generate_requests(scenario)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (base(duration_s=0), "duration_s: Input should be greater than 0"),
        (base(tenants=[]), "tenants: List should have at least 1 item"),
        (base(arival={"rate_rps": 1}), "arival: Extra inputs are not permitted"),
        (base(tenants=[{"id": "a", "priority_class": "gold"}]), "no 'slo' entry for priority class(es) used"),
        (base(tenants=[{"id": "a"}, {"id": "a"}]), "duplicate tenant ids: a"),
        (base(tenants=[{"id": "Bad Id"}]), "tenants.0.id: String should match pattern"),
        (base(warmup_s=100), "warmup_s (100.0) must be below duration_s (100.0)"),
        (base(arrival={"schedule": [{"at_s": 5, "rate_rps": 1}, {"at_s": 5, "rate_rps": 2}]}), "strictly"),
        (base(prompts={"user_turn": {"kind": "lognormal"}}), "prompts.user_turn: Value error, a lognormal"),
        (base(prompts={"output": {"kind": "uniform", "low": 9, "high": 3}}), "'high' (3) is below 'low' (9)"),
        (base(prompts={"output": 0}), "output length must be at least 1 token"),
        (
            base(prompts={"stream_ratio": 1.5}),
            "prompts.stream_ratio: Input should be less than or equal to 1",
        ),
        (base(tenants=[{"id": "a", "share": 0}]), "tenants.0.share: Input should be greater than 0"),
    ],
)
def test_bad_scenarios_are_rejected_with_the_field_and_reason(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data, "test.yaml")
    assert message in str(err.value)
    assert str(err.value).startswith("test.yaml: invalid scenario")


def test_bad_files(tmp_path: Path) -> None:
    cases = {
        "a.ini": ("duration_s = 1", "unknown scenario format '.ini'"),
        "b.yaml": ("duration_s: [1", "syntax error"),
        "c.toml": ("duration_s = ", "syntax error"),
        "d.yaml": ("- 1\n- 2\n", "expected a mapping at the top level, got list"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ScenarioError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_scenario(tmp_path / name)
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")


def test_yaml_and_toml_give_the_same_scenario(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(
        "duration_s: 10\ntenants: [{id: a}]\nslo: {standard: {ttft_ms: 500}}\nprompts: {output: 7}\n"
    )
    (tmp_path / "s.toml").write_text(
        'duration_s = 10\ntenants = [{id = "a"}]\n[slo.standard]\nttft_ms = 500\n[prompts]\noutput = 7\n'
    )
    assert load_scenario(tmp_path / "s.yaml") == load_scenario(tmp_path / "s.toml")


def test_plan_is_deterministic_per_seed_and_sorted() -> None:
    one = generate_requests(parse_scenario(base(seed=1)))
    assert one == generate_requests(parse_scenario(base(seed=1)))
    assert one != generate_requests(parse_scenario(base(seed=2)))
    assert [r.index for r in one] == list(range(len(one)))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(one))
    assert all(0 <= r.arrival_s < 100 for r in one)


def test_poisson_rate_and_tenant_shares() -> None:
    plan = generate_requests(parse_scenario(base(duration_s=500)))
    assert len(plan) == pytest.approx(20 * 500, rel=0.03)
    shares = Counter(r.tenant for r in plan)
    assert shares["b"] / len(plan) == pytest.approx(0.75, abs=0.02)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(plan)]
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)


def test_gamma_arrivals_have_the_requested_burstiness() -> None:
    plan = generate_requests(
        parse_scenario(base(duration_s=500, arrival={"process": "gamma", "rate_rps": 20, "cv": 3}))
    )
    assert len(plan) == pytest.approx(20 * 500, rel=0.1)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(plan)]
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(3.0, rel=0.15)


def test_rate_schedule_is_followed_including_a_silent_step() -> None:
    steps = [{"at_s": 0, "rate_rps": 10}, {"at_s": 100, "rate_rps": 0}, {"at_s": 150, "rate_rps": 40}]
    plan = generate_requests(parse_scenario(base(duration_s=200, arrival={"schedule": steps})))
    times = [r.arrival_s for r in plan]
    assert sum(t < 100 for t in times) == pytest.approx(1000, rel=0.08)
    assert sum(100 <= t < 150 for t in times) == 0
    assert sum(t >= 150 for t in times) == pytest.approx(2000, rel=0.06)


def test_system_prompts_are_shared_as_specified() -> None:
    prompts = {"system_prompts": {"count": 3, "length": 50, "users_per_prompt": 4}, "output": 5}
    plan = generate_requests(parse_scenario(base(prompts=prompts)))
    by_prompt: dict[str | None, set[str]] = {}
    texts: dict[str | None, set[str]] = {}
    for r in plan:
        by_prompt.setdefault(r.system_prompt_id, set()).add(r.user_id.split("/")[1])
        texts.setdefault(r.system_prompt_id, set()).add(r.messages[0].content)
        assert r.messages[0].role == "system" and len(r.messages[0].content.split()) == 50
    assert len(by_prompt) == 3 and all(len(users) == 4 for users in by_prompt.values())
    assert all(len(t) == 1 for t in texts.values())  # one text per prompt id
    per_tenant = {**prompts, "system_prompts": {**prompts["system_prompts"], "shared_across_tenants": False}}
    plan = generate_requests(parse_scenario(base(prompts=per_tenant)))
    assert len({r.system_prompt_id for r in plan}) == 6
    assert all(r.system_prompt_id and r.system_prompt_id.startswith(r.tenant) for r in plan)
    none = generate_requests(parse_scenario(base(prompts={"system_prompts": {"count": 0}})))
    assert all(r.system_prompt_id is None and r.messages[0].role == "user" for r in none)


def test_lengths_stream_ratio_warmup_and_cap() -> None:
    prompts = {
        "system_prompts": {"count": 0},
        "user_turn": {"kind": "lognormal", "mean": 40, "cv": 0.5, "low": 5, "high": 100},
        "output": {"kind": "uniform", "low": 10, "high": 20},
        "stream_ratio": 0.25,
    }
    plan = generate_requests(parse_scenario(base(prompts=prompts, warmup_s=10)))
    assert statistics.fmean(r.prompt_words for r in plan) == pytest.approx(40, rel=0.08)
    assert all(5 <= r.prompt_words <= 100 and 10 <= r.max_tokens <= 20 for r in plan)
    assert sum(r.stream for r in plan) / len(plan) == pytest.approx(0.25, abs=0.03)
    assert all(r.warmup == (r.arrival_s < 10) for r in plan)
    capped = generate_requests(parse_scenario(base(prompts=prompts, warmup_s=10, max_requests=7)))
    assert capped == plan[:7]


def test_sessions_extend_their_history_and_keep_the_request_rate() -> None:
    prompts = {"sessions": {"turns": 3, "think_time_s": 2}, "output": 6}
    plan = generate_requests(parse_scenario(base(duration_s=300, prompts=prompts)))
    assert len(plan) == pytest.approx(20 * 300, rel=0.05)  # rate counts every turn
    sessions: dict[str, list[Any]] = {}
    for r in plan:
        sessions.setdefault(r.session_id, []).append(r)
    full = [s for s in sessions.values() if len(s) == 3]
    assert len(full) > 0.9 * len(sessions)
    for turns in full:
        assert [r.turn for r in turns] == [0, 1, 2]
        assert len({(r.tenant, r.user_id, r.system_prompt_id) for r in turns}) == 1
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.arrival_s >= prev.arrival_s
            assert nxt.messages[: len(prev.messages)] == prev.messages  # same prefix: cacheable
            assert [m.role for m in nxt.messages[len(prev.messages) :]] == ["assistant", "user"]
            assert len(nxt.messages[len(prev.messages)].content.split()) == prev.max_tokens


def test_request_body_is_openai_chat() -> None:
    req = generate_requests(parse_scenario(base(prompts={"stream_ratio": 1})))[0]
    body = req.body("m", ignore_eos=True, priority=True)
    assert body["model"] == "m" and body["stream"] is True and body["max_tokens"] == req.max_tokens
    assert body["stream_options"] == {"include_usage": True} and body["priority"] == "standard"
    assert body["messages"][0]["role"] == "system" and body["ignore_eos"] is True
    plain = req.body("m", ignore_eos=False)
    assert "ignore_eos" not in plain and "priority" not in plain
