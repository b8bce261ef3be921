"""The per-request breakdown (service/observability/breakdown.py) of a gateway in front of a simulated SGLang
worker: the worker's --enable-metrics timing (loadgen/sim/timing.py) gives the engine phases, in the
``Server-Timing`` header and in the request's log line, where the named phases explain its TTFT."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadgen.sim.profiles import get_profile
from loadgen.sim.server import SimServer
from service.app import create_app
from service.config.settings import Settings
from service.observability.breakdown import TTFT_PHASES, parse_server_timing
from service.observability.logs import configure_logging
from tests.conftest import ADMIN_TOKEN
from tests.support.servers import ThreadedServer

MODEL = "sim-model"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ENGINE_PHASES = ("engine_tokenize", "engine_queue", "engine_prefill")
# the CPU profile with slow forward passes (~0.25 s to a first token): the few milliseconds that no phase
# names (loopback network, the event loops' turns on a shared machine) stay well under a tenth of the TTFT
SLOW_CPU = dataclasses.replace(get_profile("smollm2-135m-cpu2"), step_base_ms=200.0, step_jitter=0.0)
_ids = itertools.count()


@pytest.fixture(scope="module")
def gateway(redis_url: str, stub_model_dir: Path) -> Iterator[str]:
    sim = SimServer(SLOW_CPU, model_name=MODEL, speed=1.0)
    with ThreadedServer(sim.app) as worker:
        settings = Settings.model_validate(
            {
                "admin_token": ADMIN_TOKEN,
                "redis": {"url": redis_url, "key_prefix": f"simbreak{next(_ids)}:"},
                "engine": {"served_model_name": MODEL},
                "upstream": {"workers": [worker.url], "health_interval_s": 0.2},
                "api": {"tokenizer_path": str(stub_model_dir), "context_length": 4096},
            }
        )
        with ThreadedServer(create_app(settings)) as server:
            yield server.url


@pytest.fixture
def log() -> Iterator[io.StringIO]:
    buf = io.StringIO()
    configure_logging("INFO", stream=buf)
    yield buf
    configure_logging("INFO")


def request_line(buf: io.StringIO, rid: str) -> dict[str, Any]:
    """The ``request`` log line of ``rid`` (written once the answer is out and settled)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in buf.getvalue().splitlines():
            if line.startswith("{") and f'"{rid}"' in line:
                entry = json.loads(line)
                if entry.get("event") == "request" and entry.get("request_id") == rid:
                    return dict(entry)
        time.sleep(0.02)
    raise AssertionError(f"no request line for {rid}")


@pytest.mark.parametrize("stream", [False, True])
def test_the_engine_phases_come_from_the_simulated_worker_and_explain_the_ttft(
    gateway: str, log: io.StringIO, stream: bool
) -> None:
    with httpx.Client(base_url=gateway, timeout=30) as http:
        tenant = f"breakdown{next(_ids)}"
        assert (
            http.post("/admin/tenants", json={"id": tenant, "name": tenant}, headers=ADMIN).status_code == 201
        )
        key = http.post(f"/admin/tenants/{tenant}/keys", json={"name": "k"}, headers=ADMIN).json()["api_key"]
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Where did the time go, stream={stream}?"}],
            "max_tokens": 3,
            "stream": stream,
        }
        resp = http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 200, resp.text
    timing = parse_server_timing(resp.headers["server-timing"])
    # SGLang sends the tokenizer's times with the last chunk only: a stream's headers (sent with its
    # first token) have the engine's queue and prefill; a whole answer has all three
    in_header = ENGINE_PHASES[1:] if stream else ENGINE_PHASES
    assert set(in_header) <= set(timing) and "ttft" in timing
    assert all(timing[name] >= 0 for name in timing)
    engine_ms = sum(timing[name] for name in in_header)
    assert 200 < engine_ms <= timing["ttft"]  # at least one 200 ms forward pass, inside the TTFT

    entry = request_line(log, resp.headers["x-request-id"])
    phases, ttft_ms = entry["phases_ms"], entry["ttft_ms"]
    assert set(ENGINE_PHASES) <= set(phases) and ttft_ms == pytest.approx(timing["ttft"], abs=0.1)
    assert phases["engine_tokenize"] == pytest.approx(SLOW_CPU.ttft_floor_ms, abs=0.01)  # the floor
    assert phases["engine_prefill"] >= 200 and phases["engine_queue"] >= 0
    assert ("upstream_connect" in phases) is stream  # a whole answer's headers come with its body
    named = sum(phases.get(name, 0.0) for name in TTFT_PHASES)
    assert 0.9 * ttft_ms <= named <= ttft_ms + 2.0, (named, ttft_ms, phases)
    assert entry["retractions"] == 0
