"""End to end: the gateway in front of a real SGLang CPU worker (SmolLM2-135M-Instruct), real Redis.

The worker is started once per session by the ``engine_worker`` fixture (20-60 s on 2 cores).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from service.app import create_app
from service.config.settings import EngineSettings, Settings
from service.workers.launcher import WorkerProcess
from tests.conftest import ADMIN_TOKEN
from tests.support.engine import engine_home
from tests.support.servers import ThreadedServer

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"
_ids = itertools.count()
LONG_SYSTEM = (
    "You are a concise assistant for a library. Opening hours: Monday to Friday 09:00-20:00, Saturday "
    "10:00-16:00, closed on Sunday. Loans last 21 days and can be renewed twice online. Late fees are 20 "
    "cents per item per day. Members may borrow up to 12 items. The reading room upstairs is silent. "
) * 3


@pytest.fixture(scope="module")
def worker(engine_worker: WorkerProcess) -> WorkerProcess:
    return engine_worker


@pytest.fixture(scope="module")
def gateway(redis_url: str, worker: WorkerProcess) -> Iterator[str]:
    settings = Settings.model_validate(
        {
            "home": engine_home(),  # RADIXGATE_HOME: the engine and model under it
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": "e2e:"},
            "upstream": {"workers": [worker.url]},
        }
    )
    with ThreadedServer(create_app(settings)) as server:
        yield server.url


@pytest.fixture
def tenant(gateway: str) -> tuple[str, str]:
    tenant_id = f"e2e{next(_ids)}"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=gateway, headers=admin) as http:
        assert http.post("/admin/tenants", json={"id": tenant_id, "name": tenant_id}).status_code == 201
        key = http.post(f"/admin/tenants/{tenant_id}/keys", json={}).json()["api_key"]
    return tenant_id, key


def client(gateway: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=120)


def direct_chat(worker: WorkerProcess, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """The worker's own OpenAI route, bypassing the gateway."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{worker.url}/v1/chat/completions", json=body, timeout=120)
    resp.raise_for_status()
    data: dict[str, Any] = resp.json()
    return data


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_greedy_chat_through_the_gateway_equals_the_workers_direct_answer(
    gateway: str, worker: WorkerProcess, tenant: tuple[str, str]
) -> None:
    expected = direct_chat(worker, QUESTION, 24)
    got = client(gateway, tenant[1]).chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,  # type: ignore[arg-type]
    )
    assert got.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert "Paris" in (got.choices[0].message.content or "")
    assert got.usage is not None
    assert got.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert got.usage.completion_tokens == expected["usage"]["completion_tokens"]


def test_streamed_chat_equals_non_streamed_and_reports_usage(gateway: str, tenant: tuple[str, str]) -> None:
    api = client(gateway, tenant[1])
    whole = api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    pieces, usage = [], None
    for chunk in api.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert len(pieces) > 1  # really streamed
    assert "".join(pieces) == whole.choices[0].message.content
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_shared_system_prompt_is_served_from_the_prefix_cache(gateway: str, tenant: tuple[str, str]) -> None:
    api = client(gateway, tenant[1])
    cached = []
    for question in ("When are you open on Saturday?", "How long is a loan?"):
        resp = api.chat.completions.create(
            model=MODEL,
            max_tokens=8,
            temperature=0,
            messages=[{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}],
        )
        assert resp.usage is not None and resp.usage.prompt_tokens > 150
        details = resp.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
    assert cached[1] > 150  # the whole shared system prompt came from RadixAttention's cache


def test_text_completion_and_usage_recorded_for_the_tenant(
    gateway: str, worker: WorkerProcess, tenant: tuple[str, str]
) -> None:
    tenant_id, key = tenant
    api = client(gateway, key)
    got = api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    direct = httpx.post(
        f"{worker.url}/generate",
        timeout=120,
        json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
    ).json()
    assert got.choices[0].text == direct["text"]
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        usage = http.get(f"/admin/tenants/{tenant_id}/usage").json()
    assert got.usage is not None
    assert usage["requests"] == 1
    assert usage["prompt_tokens"] == got.usage.prompt_tokens
    assert usage["completion_tokens"] == got.usage.completion_tokens


@pytest.mark.parametrize("stop", ["", ["", "zzzz"], ["zzzz", "zzzz", ""]])
def test_empty_and_repeated_stop_sequences_answer_as_without_stop(
    gateway: str, tenant: tuple[str, str], stop: str | list[str]
) -> None:
    """Issue 8: ``"stop": ""`` used to end a greedy answer at once with one empty token."""
    with httpx.Client(
        base_url=gateway, headers={"Authorization": f"Bearer {tenant[1]}"}, timeout=120
    ) as http:
        for route, body in (
            ("/v1/completions", {"prompt": "The capital of France is"}),
            ("/v1/chat/completions", {"messages": QUESTION}),
        ):
            base = {"model": MODEL, "max_tokens": 12, "temperature": 0, **body}
            plain = http.post(route, json=base).json()
            stopped = http.post(route, json={**base, "stop": stop}).json()
            assert stopped["choices"] == plain["choices"], (route, stop)
            assert stopped["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] > 1


def test_launched_worker_runs_with_the_launchers_scheduling_flags(engine_worker: WorkerProcess) -> None:
    """The real engine took the launcher's flags: priority scheduling, preemption on any priority gap
    (SGLang's default threshold of 10 would never preempt for the default classes' gaps), incremental
    streaming."""
    info = httpx.get(f"{engine_worker.url}/server_info", timeout=30).json()
    assert info["enable_priority_scheduling"] is True
    assert info["priority_scheduling_preemption_threshold"] == 0
    assert info["incremental_streaming_output"] is True


def test_the_gateways_window_follows_what_the_real_engine_reports(
    redis_url: str, worker: WorkerProcess
) -> None:
    """Load polls parse the real engine's /metrics (it gzips them when asked: they once never parsed, and
    every window stayed at window_initial): a window that starts at 2 becomes the engine's
    max_running_requests, which the launcher set to engine.cpu_max_running_requests on this CPU worker."""
    engine_max = httpx.get(f"{worker.url}/server_info", timeout=30).json()["max_running_requests"]
    assert engine_max == EngineSettings().cpu_max_running_requests > 2
    settings = Settings.model_validate(
        {
            "home": engine_home(),  # RADIXGATE_HOME: the engine and model under it
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": "e2e-window:"},
            "upstream": {"workers": [worker.url]},
            "scheduler": {"window_initial": 2, "load_poll_interval_s": 0.2},
        }
    )
    line = f'radixgate_worker_window_requests{{worker="{worker.url}"}} {float(engine_max)}'
    with ThreadedServer(create_app(settings)) as server:
        deadline = time.monotonic() + 30
        while line not in (text := httpx.get(f"{server.url}/metrics", timeout=10).text):
            assert time.monotonic() < deadline, [ln for ln in text.splitlines() if "window" in ln]
            time.sleep(0.2)
