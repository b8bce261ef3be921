"""loadgen end to end: the real gateway in front of two simulated workers, and a bare OpenAI-shaped stub."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from typer.testing import CliRunner

from loadgen.cli import app as cli_app
from loadgen.cli import create_tenants
from loadgen.plots import write_plots
from loadgen.report import build_report
from loadgen.runner import load_results, resolve_keys, run_plan, save_results
from loadgen.scenario import Scenario, generate_requests, parse_scenario
from loadgen.sim.profiles import get_profile
from loadgen.sim.server import SimServer
from service.app import create_app
from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.support.servers import ThreadedServer

MODEL = "sim-model"
_ids = itertools.count()


def scenario(base_url: str, tag: str, **over: Any) -> Scenario:
    """5 s at 6 req/s: two equal standard tenants and one interactive, one shared system prompt."""
    data: dict[str, Any] = {
        "name": f"e2e-{tag}",
        "seed": 3,
        "duration_s": 5,
        "warmup_s": 1,
        "target": {"base_url": base_url, "model": MODEL, "timeout_s": 30},
        "tenants": [
            {"id": f"lg{tag}-a", "priority_class": "standard"},
            {"id": f"lg{tag}-b", "priority_class": "standard"},
            {"id": f"lg{tag}-i", "priority_class": "interactive"},
        ],
        "slo": {"standard": {"ttft_ms": 5000, "tpot_ms": 500}, "interactive": {"ttft_ms": 5000}},
        "arrival": {"process": "poisson", "rate_rps": 6},
        "prompts": {
            "system_prompts": {"count": 1, "length": 120, "users_per_prompt": 5},
            "user_turn": {"kind": "uniform", "low": 5, "high": 15},
            "output": {"kind": "uniform", "low": 4, "high": 12},
            "stream_ratio": 0.7,
            "sessions": {"turns": 2, "think_time_s": 0.5},
        },
    }
    data.update(over)
    return parse_scenario(data)


@pytest.fixture(scope="module")
def gateway(redis_url: str, stub_model_dir: Path) -> Iterator[str]:
    """The gateway in front of two simulated Llama-3.1-8B H100 workers (real time)."""
    sims = [SimServer(get_profile("llama-3.1-8b-h100"), seed=i, model_name=MODEL) for i in range(2)]
    with ThreadedServer(sims[0].app) as one, ThreadedServer(sims[1].app) as two:
        settings = Settings.model_validate(
            {
                "admin_token": ADMIN_TOKEN,
                "redis": {"url": redis_url, "key_prefix": f"loadgen{next(_ids)}:"},
                "engine": {"served_model_name": MODEL},
                "upstream": {"workers": [one.url, two.url], "health_interval_s": 0.2},
                "api": {"tokenizer_path": str(stub_model_dir), "context_length": 4096},
            }
        )
        with ThreadedServer(create_app(settings)) as server:
            yield server.url


def check_report(report: dict[str, Any], classes: set[str]) -> None:
    o = report["overall"]
    assert o["sent"] == report["measured"] > 10
    assert set(report["classes"]) == classes
    for figures in [o, *report["classes"].values(), *report["tenants"].values()]:
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            assert set(figures[key]) == {"n", "mean", "p50", "p90", "p99"}
    assert o["ok"] == o["sent"] and o["errors"] == 0 and o["shed_rate"] == 0 and o["rate_limited_rate"] == 0
    assert 0 < o["ttft_ms"]["p50"] <= o["ttft_ms"]["p99"] < 5000
    assert o["e2e_ms"]["p50"] >= o["ttft_ms"]["p50"]
    assert o["throughput_rps"] > 2 and o["completion_tokens_per_s"] > 10 and o["goodput"] > 0.9
    # the generator keeps its schedule: the gateway and workers run in this process (one GIL), so a pause of
    # theirs (a full GC late in a long test session took 257 ms) shows as lag; a generator that waited for
    # answers before sending would lag by seconds
    assert report["loadgen"]["cpu_cores"] < 1 and report["loadgen"]["send_lag_ms"]["p50"] < 50
    assert report["loadgen"]["send_lag_ms"]["p99"] < 1000
    assert len(report["timeline"]["t_s"]) >= 5


async def test_run_through_the_gateway(gateway: str, tmp_path: Path) -> None:
    sc = scenario(gateway, "gw")
    keys = await asyncio.to_thread(create_tenants, sc, gateway, ADMIN_TOKEN)
    plan = generate_requests(sc)
    done: list[int] = []
    result = await run_plan(sc, plan, resolve_keys(sc, keys), on_done=lambda r: done.append(r.index))
    assert len(done) == len(plan) == len(result.records)
    assert [r.index for r in result.records] == list(range(len(plan)))
    streamed = [r for r in result.records if r.stream]
    assert streamed and all(r.ttft_ms is not None and len(r.itl_ms) >= 3 for r in streamed)
    assert all(r.completion_tokens == r.max_tokens for r in result.records)  # ignore_eos
    save_results(tmp_path / "results.json", sc, result)
    scenario_data, run, records = load_results(tmp_path / "results.json")
    report = build_report(parse_scenario(scenario_data), records, run)
    check_report(report, {"standard", "interactive"})
    assert report["overall"]["cache_hit_rate"] > 0.3  # the shared system prompt and earlier turns
    fair = report["fairness"]
    assert len(fair) == 1 and fair[0]["tenants"] == ["lggw-a", "lggw-b"]
    assert 0.5 < fair[0]["jain_throughput"] <= 1 and fair[0]["jain_demand"] == pytest.approx(1.0)
    paths = write_plots(report, records, tmp_path)
    assert all(p.stat().st_size > 10_000 for p in paths)
    json.dumps(report)  # JSON-ready


async def test_rate_limited_tenant_is_recorded_as_429(gateway: str) -> None:
    sc = scenario(gateway, "q", duration_s=3, warmup_s=0)
    sc = sc.model_copy(
        update={
            "tenants": [
                sc.tenants[0].model_copy(update={"quotas": {"requests_per_min": 2, "request_burst": 2}}),
                sc.tenants[1],
            ]
        }
    )
    keys = await asyncio.to_thread(create_tenants, sc, gateway, ADMIN_TOKEN)
    result = await run_plan(sc, generate_requests(sc), keys)
    limited = [r for r in result.records if r.tenant == sc.tenants[0].id and r.status == 429]
    assert limited and all(r.retry_after_s is not None and r.retry_after_s > 0 for r in limited)
    report = build_report(sc, result.records, result.to_json(sc)["run"])
    assert report["tenants"][sc.tenants[0].id]["rate_limited_rate"] > 0.5
    assert report["tenants"][sc.tenants[1].id]["rate_limited_rate"] == 0


def openai_stub() -> Starlette:
    """A bare OpenAI-shaped chat server (no auth): 3 words per SSE chunk, 20 ms apart; usage only if asked."""

    async def chat(request: Request) -> Response:
        body = await request.json()
        n = int(body["max_tokens"])
        prompt = sum(len(m["content"].split()) for m in body["messages"])
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        if not body.get("stream"):
            await asyncio.sleep(0.02 * n / 3)
            msg = {"role": "assistant", "content": "word " * n}
            return JSONResponse(
                {"choices": [{"index": 0, "message": msg, "finish_reason": "length"}], "usage": usage}
            )

        async def events() -> AsyncIterator[str]:
            for i in range(0, n, 3):
                await asyncio.sleep(0.02)
                delta = {"content": "word " * min(3, n - i)}
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]})}\n\n"
            last = {"index": 0, "delta": {}, "finish_reason": "length"}
            yield f"data: {json.dumps({'choices': [last]})}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def test_cli_runs_against_any_openai_endpoint(tmp_path: Path) -> None:
    with ThreadedServer(openai_stub()) as stub:
        sc = scenario(stub.url, "stub")
        path = tmp_path / "sc.json"
        path.write_text(json.dumps(sc.model_dump(mode="json")))
        runner = CliRunner()
        out = tmp_path / "out"
        res = runner.invoke(cli_app, ["run", str(path), "--api-key", "none", "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert "requests (measured)" in res.output and "load generator" in res.output
    report = json.loads((out / "report.json").read_text())
    check_report(report, {"standard", "interactive"})
    assert report["overall"]["cache_hit_rate"] is None  # the stub reports no cached tokens
    assert {p.name for p in out.glob("*.png")} == {"latency_cdf.png", "timeline.png", "tenant_share.png"}
    again = runner.invoke(cli_app, ["report", str(out / "results.json"), "--no-plots"])
    assert again.exit_code == 0, again.output
    assert json.loads((out / "report.json").read_text())["overall"] == report["overall"]


def test_cli_plan_and_missing_keys(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(cli_app, ["plan", "loadgen/scenarios/mixed-classes.yaml"])
    assert res.exit_code == 0 and "chat-app" in res.output
    res = runner.invoke(cli_app, ["run", "loadgen/scenarios/smoke.toml", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "no API key for tenant(s) smoke-a, smoke-b" in res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("duration_s: -1\ntenants: []\n")
    res = runner.invoke(cli_app, ["plan", str(bad)])
    assert res.exit_code == 2 and "duration_s" in res.output and "tenants" in res.output


def test_cli_tenants_reports_gateway_errors_without_a_traceback(gateway: str, tmp_path: Path) -> None:
    sc = scenario(gateway, "tn")
    path = tmp_path / "sc.json"
    path.write_text(json.dumps(sc.model_dump(mode="json")))
    runner = CliRunner()
    keys_out = str(tmp_path / "keys.json")
    res = runner.invoke(cli_app, ["tenants", str(path), "--admin-token", "x" * 20, "--keys-out", keys_out])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert "403" in res.output and "admin" in res.output.lower() and "Traceback" not in res.output
    dead = ["tenants", str(path), "--base-url", "http://127.0.0.1:1", "--admin-token", "x" * 20]
    res = runner.invoke(cli_app, [*dead, "--keys-out", keys_out])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert "http://127.0.0.1:1" in res.output and "cannot reach" in res.output
    res = runner.invoke(cli_app, ["tenants", str(path), "--base-url", "nourl", "--admin-token", "x" * 20])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert not (tmp_path / "keys.json").exists()


def test_cli_run_exits_3_when_no_request_reached_the_endpoint(tmp_path: Path) -> None:
    sc = scenario("http://127.0.0.1:1", "dead", duration_s=2, warmup_s=0)
    path = tmp_path / "sc.json"
    path.write_text(json.dumps(sc.model_dump(mode="json")))
    args = ["run", str(path), "--api-key", "k", "--no-plots", "--out", str(tmp_path)]
    res = CliRunner().invoke(cli_app, args)
    assert res.exit_code == 3 and isinstance(res.exception, SystemExit), res.output
    assert "no request reached http://127.0.0.1:1" in res.output
    assert (tmp_path / "results.json").exists()  # what was recorded is still written


def test_cli_run_refuses_an_unwritable_out_folder_and_a_negative_drain_before_sending(tmp_path: Path) -> None:
    sc = scenario("http://127.0.0.1:1", "badout", duration_s=2, warmup_s=0)
    path = tmp_path / "sc.json"
    path.write_text(json.dumps(sc.model_dump(mode="json")))
    (tmp_path / "file").write_text("")
    base = ["run", str(path), "--api-key", "k", "--no-plots"]
    res = CliRunner().invoke(cli_app, [*base, "--out", str(tmp_path / "file" / "out")])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert "cannot write" in res.output and "requests over" not in res.output  # nothing was sent
    for bad in ("-1", "nan"):
        res = CliRunner().invoke(cli_app, [*base, "--out", str(tmp_path / "o"), "--drain-timeout-s", bad])
        assert res.exit_code == 2 and "--drain-timeout-s" in res.output, res.output
