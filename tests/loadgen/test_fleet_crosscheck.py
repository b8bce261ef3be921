"""Cross-check: one scenario through the real gateway + simulated workers (real time) and in virtual time.

Per-class P50/P99 TTFT must agree within ``loadgen.fleet.crosscheck``'s tolerance. Takes ~40 s.
``RADIXGATE_WRITE_DOCS=1`` also writes the comparison into ``docs/experiments.md``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.cli import create_tenants
from loadgen.fleet.config import FleetConfig
from loadgen.fleet.crosscheck import compare, section
from loadgen.fleet.doc import write_section
from loadgen.fleet.run import run_scenario
from loadgen.report import build_report
from loadgen.runner import resolve_keys, run_plan
from loadgen.scenario import Scenario, generate_requests, parse_scenario
from loadgen.sim.profiles import get_profile
from loadgen.sim.server import SimServer
from service.app import create_app
from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.support.servers import ThreadedServer

MODEL = "sim-model"
PROFILE = "llama-3.1-70b-h100-tp8"
WORKERS = 2


def crosscheck_scenario(base_url: str) -> Scenario:
    """30 s at 8 requests/s, three classes, two shared system prompts, 16-48 tokens out."""
    return parse_scenario(
        {
            "name": "crosscheck",
            "seed": 11,
            "duration_s": 30,
            "warmup_s": 3,
            "target": {"base_url": base_url, "model": MODEL, "timeout_s": 60},
            "tenants": [
                {"id": "xc-interactive", "priority_class": "interactive"},
                {"id": "xc-standard", "priority_class": "standard"},
                {"id": "xc-batch", "priority_class": "batch"},
            ],
            "slo": {
                "interactive": {"ttft_ms": 500},
                "standard": {"ttft_ms": 2000},
                "batch": {"ttft_ms": 30000},
            },
            "arrival": {"process": "poisson", "rate_rps": 8},
            "prompts": {
                "system_prompts": {"count": 2, "length": 150, "users_per_prompt": 10},
                "user_turn": {"kind": "uniform", "low": 20, "high": 120},
                "output": {"kind": "uniform", "low": 16, "high": 48},
                "stream_ratio": 1.0,
            },
        }
    )


@pytest.fixture(scope="module")
def gateway(redis_url: str, stub_model_dir: Path) -> Iterator[str]:
    """The real gateway (default scheduler and routing) in front of simulated 70B TP-8 workers, real time."""
    sims = [SimServer(get_profile(PROFILE), seed=i, model_name=MODEL) for i in range(WORKERS)]
    with ThreadedServer(sims[0].app) as one, ThreadedServer(sims[1].app) as two:
        settings = Settings.model_validate(
            {
                "admin_token": ADMIN_TOKEN,
                "redis": {"url": redis_url, "key_prefix": "crosscheck:"},
                "engine": {"served_model_name": MODEL},
                "upstream": {"workers": [one.url, two.url], "health_interval_s": 0.5},
                "api": {"tokenizer_path": str(stub_model_dir), "context_length": 8192},
            }
        )
        with ThreadedServer(create_app(settings)) as server:
            yield server.url


async def test_http_path_and_virtual_time_agree(gateway: str) -> None:
    sc = crosscheck_scenario(gateway)
    keys = await asyncio.to_thread(create_tenants, sc, gateway, ADMIN_TOKEN)
    plan = generate_requests(sc)
    result = await run_plan(sc, plan, resolve_keys(sc, keys))
    run = {"wall_s": result.wall_s, "cpu_s": result.cpu_s, "send_lag_ms": result.send_lag_ms}
    http = build_report(sc, result.records, run)
    virtual = run_scenario(sc, FleetConfig(profile=PROFILE, workers=WORKERS)).report
    assert http["overall"]["ok"] == http["overall"]["sent"] == virtual["overall"]["ok"]
    rows = compare(http, virtual)
    assert len(rows) == 6
    if os.environ.get("RADIXGATE_WRITE_DOCS") == "1":
        setup = (
            f"Scenario `crosscheck` (`tests/loadgen/test_fleet_crosscheck.py`): {len(plan)} requests in 30 s "
            "(Poisson 8 RPS, 3 s warm-up), three tenants one per class, two shared system prompts of 150 "
            "words, user turns 20-120 words, 16-48 tokens out, all streamed. HTTP: the real gateway "
            "(default settings, "
            f"Redis, stub word-level tokenizer) in front of {WORKERS} `loadgen.sim` servers with profile "
            f"`{PROFILE}` in real time, driven by `loadgen.runner` on this CPU machine. Virtual: "
            f"`run_scenario` with {WORKERS} workers of the same profile and the gateway's defaults. Send lag "
            f"of the HTTP run: P99 {http['loadgen']['send_lag_ms']['p99']:.1f} ms."
        )
        write_section("crosscheck", section(rows, setup))
    print(*rows, sep="\n")
    bad = [r for r in rows if not r["agrees"]]
    assert not bad, rows
