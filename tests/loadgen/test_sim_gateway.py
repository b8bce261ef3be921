"""The real gateway in front of two simulated SGLang workers (loadgen.sim): chat end to end over HTTP."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadgen.sim.profiles import get_profile
from loadgen.sim.server import SimServer
from service.app import create_app
from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.support.servers import ThreadedServer

MODEL = "sim-model"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SYSTEM = "You are the simulated assistant of radixgate. Answer briefly and politely. " * 8
_ids = itertools.count()


@pytest.fixture(scope="module")
def sims() -> Iterator[list[tuple[SimServer, str]]]:
    """Two simulated H100 workers (Llama-3.1-8B profile, real time): (server, base URL) pairs."""
    servers = [
        SimServer(get_profile("llama-3.1-8b-h100"), seed=i, model_name=MODEL, speed=1.0) for i in range(2)
    ]
    with ThreadedServer(servers[0].app) as one, ThreadedServer(servers[1].app) as two:
        yield [(servers[0], one.url), (servers[1], two.url)]


@pytest.fixture(scope="module")
def gateway(redis_url: str, stub_model_dir: Path, sims: list[tuple[SimServer, str]]) -> Iterator[str]:
    settings = Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": f"simgw{next(_ids)}:"},
            "engine": {"served_model_name": MODEL},
            "upstream": {
                "workers": [url for _, url in sims],
                "health_interval_s": 0.2,
                "max_attempts": 2,
            },
            "api": {"tokenizer_path": str(stub_model_dir), "context_length": 4096},
        }
    )
    with ThreadedServer(create_app(settings)) as server:
        yield server.url


@pytest.fixture
def http(gateway: str, sims: list[tuple[SimServer, str]]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client
    for _, url in sims:
        httpx.post(f"{url}/sim/fault", json={"mode": "none"})


@pytest.fixture
def key(http: httpx.Client) -> str:
    tenant = f"sim{next(_ids)}"
    assert http.post("/admin/tenants", json={"id": tenant, "name": tenant}, headers=ADMIN).status_code == 201
    issued = http.post(f"/admin/tenants/{tenant}/keys", json={"name": "k"}, headers=ADMIN)
    assert issued.status_code == 201
    return str(issued.json()["api_key"])


def chat(question: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


def test_chat_through_the_gateway_to_simulated_workers(http: httpx.Client, key: str) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    resp = http.post("/v1/chat/completions", json=chat("What is a radix tree?"), headers=auth)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert len(body["choices"][0]["message"]["content"].split()) == 8
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8 and body["usage"]["prompt_tokens"] > 100

    req = chat("What is a radix tree?", stream=True, stream_options={"include_usage": True})
    with http.stream("POST", "/v1/chat/completions", json=req, headers=auth) as streamed:
        assert streamed.status_code == 200
        lines = [ln[6:] for ln in streamed.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(ln) for ln in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == body["choices"][0]["message"]["content"]  # greedy output is reproducible
    assert chunks[-1]["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"]


def test_shared_system_prompt_hits_the_simulated_prefix_cache(
    http: httpx.Client, key: str, sims: list[tuple[SimServer, str]]
) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    cached = []
    for i in range(4):
        resp = http.post("/v1/chat/completions", json=chat(f"Question number {i}?"), headers=auth)
        assert resp.status_code == 200, resp.text
        cached.append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert max(cached) > 100  # the system prompt came from a worker's radix cache
    assert sum(s.engine.stats().cached_tokens_total for s, _ in sims) >= max(cached)


def test_gateway_retries_past_a_failing_simulated_worker(
    http: httpx.Client, key: str, sims: list[tuple[SimServer, str]]
) -> None:
    httpx.post(f"{sims[0][1]}/sim/fault", json={"mode": "http_500"})
    failing_before = sims[0][0].generate_calls
    auth = {"Authorization": f"Bearer {key}"}
    for i in range(6):
        resp = http.post("/v1/chat/completions", json=chat(f"Still there {i}?", 4), headers=auth)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
    assert sims[0][0].generate_calls > failing_before  # it was tried, answered 500, and the gateway retried
