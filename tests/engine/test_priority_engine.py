"""Priority bands on a real SGLang CPU worker kept busy by batch traffic (real Redis, real gateway).

The gateway lets 2 requests into the worker (plus 2 of headroom for the top band); batch traffic queues
in the gateway behind that window, and interactive requests jump the queue and, inside SGLang, run with a
higher ``priority``.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from service.app import create_app
from service.config.settings import Settings
from service.workers.launcher import WorkerProcess
from tests.conftest import ADMIN_TOKEN
from tests.support.engine import engine_home
from tests.support.servers import ThreadedServer

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"
INTERACTIVE_TTFT_GOAL_MS = 2500.0
_ids = itertools.count()


def band(rank: int, prio: int, budget_ms: float, goal_ms: float, max_len: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "sglang_priority": prio,
        "queue_wait_budget_ms": budget_ms,
        "ttft_goal_ms": goal_ms,
        "max_queue_len": max_len,
    }


@pytest.fixture(scope="module")
def gateway(redis_url: str, engine_worker: WorkerProcess) -> Iterator[str]:
    settings = Settings.model_validate(
        {
            "home": engine_home(),  # RADIXGATE_HOME: the engine and model under it
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": "prio:"},
            "upstream": {"workers": [engine_worker.url]},
            "scheduler": {"window_initial": 2, "window_min": 2, "window_max": 2, "top_band_headroom": 2},
            "priority_classes": {
                "interactive": band(2, 10, 5000, INTERACTIVE_TTFT_GOAL_MS, 50),
                "standard": band(1, 5, 10_000, 10_000, 50),
                "batch": band(0, 0, 4000, 30_000, 6),
            },
        }
    )
    with ThreadedServer(create_app(settings)) as server:
        yield server.url


def tenant(gateway: str, cls: str, **extra: Any) -> tuple[str, str]:
    tenant_id = f"p{next(_ids)}"
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        body = {"id": tenant_id, "name": tenant_id, "priority_class": cls, **extra}
        assert http.post("/admin/tenants", json=body).status_code == 201
        return tenant_id, http.post(f"/admin/tenants/{tenant_id}/keys", json={}).json()["api_key"]


def body(content: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def streamed_ttft_ms(gateway: str, key: str, content: str) -> float:
    """Client-side time to the first content chunk of a streamed request, ms."""
    t0 = time.perf_counter()
    ttft: float | None = None
    with (
        httpx.Client(base_url=gateway, timeout=60) as http,
        http.stream(
            "POST",
            "/v1/chat/completions",
            json=body(content, 4, stream=True),
            headers={"Authorization": f"Bearer {key}"},
        ) as resp,
    ):
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            content = line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                "content"
            )
            if ttft is None and content:
                ttft = (time.perf_counter() - t0) * 1000
    assert ttft is not None, "no content streamed"
    return ttft


def running_on_worker(worker: WorkerProcess) -> int:
    """Requests running inside the worker now (SGLang ``/v1/loads``; ``/metrics`` gauges lag)."""
    loads = httpx.get(f"{worker.url}/v1/loads", timeout=10).json()["loads"]
    return sum(int(load["num_running_reqs"]) for load in loads)


def test_interactive_keeps_its_ttft_goal_while_batch_queues_or_is_shed(gateway: str) -> None:
    _, batch_key = tenant(gateway, "batch")
    _, live_key = tenant(gateway, "interactive")
    batch_status: list[int] = []

    def batch_request(i: int) -> None:
        with httpx.Client(base_url=gateway, timeout=120) as http:
            r = http.post(
                "/v1/chat/completions",
                json=body(f"Write a long story number {i}.", 48),
                headers={"Authorization": f"Bearer {batch_key}"},
            )
            batch_status.append(r.status_code)

    threads = [threading.Thread(target=batch_request, args=(i,), daemon=True) for i in range(12)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # the worker is busy with batch work, more batch work waits in the gateway queue
    ttfts = [streamed_ttft_ms(gateway, live_key, f"Say hello to person {i}.") for i in range(4)]
    for t in threads:
        t.join(timeout=180)
    print(f"\ninteractive TTFT ms: {[round(x) for x in ttfts]}; batch statuses: {sorted(batch_status)}")
    assert max(ttfts) < INTERACTIVE_TTFT_GOAL_MS
    assert len(batch_status) == 12
    assert batch_status.count(503) >= 1  # shed (band full) or expired (queued past 4 s)
    assert batch_status.count(200) >= 2


def test_disconnect_while_running_aborts_the_request_inside_the_worker(
    gateway: str, engine_worker: WorkerProcess
) -> None:
    _, key = tenant(gateway, "standard")
    with (
        httpx.Client(base_url=gateway, timeout=60) as http,
        http.stream(
            "POST",
            "/v1/chat/completions",
            json=body("Count to one thousand.", 400, stream=True),
            headers={"Authorization": f"Bearer {key}"},
        ) as resp,
    ):
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
        assert running_on_worker(engine_worker) == 1
    deadline = time.monotonic() + 10
    while running_on_worker(engine_worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running_on_worker(engine_worker) == 0  # aborted long before its 400 tokens


def test_non_streamed_request_left_while_running_is_charged_what_the_worker_computed(
    gateway: str, engine_worker: WorkerProcess
) -> None:
    # SGLang answers a running request aborted through /abort_request with its counts so far: the
    # gateway waits for that answer after the client left and charges it
    tenant_id, key = tenant(gateway, "standard")
    # the client leaves once the worker is decoding its answer (a fixed wait could find it still queued
    # in a loaded engine, which then has no counts to give)
    address = urlsplit(gateway)
    assert address.hostname is not None and address.port is not None
    with socket.create_connection((address.hostname, address.port), timeout=30) as client:
        payload = json.dumps(body("Count to one thousand.", 400)).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        client.sendall(head.encode() + payload)
        wait_until_decoding(engine_worker)
    deadline = time.monotonic() + 10
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        usage = http.get(f"/admin/tenants/{tenant_id}/usage").json()
        while not usage["requests"] and time.monotonic() < deadline:
            time.sleep(0.2)
            usage = http.get(f"/admin/tenants/{tenant_id}/usage").json()
    assert usage["requests"] == 1 and usage["errors"] == 0, usage
    assert usage["prompt_tokens"] > 5 and 0 < usage["completion_tokens"] < 400, usage
    assert running_on_worker(engine_worker) == 0  # aborted long before its 400 tokens


def wait_until_decoding(worker: WorkerProcess, tokens: int = 5, within_s: float = 120.0) -> None:
    """Wait until a request runs on ``worker`` and its KV cache grew by ``tokens`` since (decode steps
    made)."""
    deadline = time.monotonic() + within_s
    start: int | None = None
    while True:
        loads = httpx.get(f"{worker.url}/v1/loads", timeout=10).json()["loads"]
        running = sum(int(load["num_running_reqs"]) for load in loads)
        used = sum(int(load["num_used_tokens"]) for load in loads)
        if running and start is None:
            start = used
        if start is not None and used >= start + tokens:
            return
        assert time.monotonic() < deadline, "the request never ran on the worker"
        time.sleep(0.1)


def test_disconnect_while_queued_refunds_the_reservation(gateway: str, engine_worker: WorkerProcess) -> None:
    # 'hog' fills the 2-request window; 'waiter' queues behind it, gives up, and must get its tokens back
    _, hog_key = tenant(gateway, "standard")
    tenant_id, key = tenant(gateway, "standard", quotas={"tokens_per_min": 1, "token_burst": 200})
    hogs = [
        threading.Thread(
            target=lambda: httpx.post(
                f"{gateway}/v1/chat/completions",
                json=body("Tell me a story.", 64),
                headers={"Authorization": f"Bearer {hog_key}"},
                timeout=120,
            ),
            daemon=True,
        )
        for _ in range(2)
    ]
    for t in hogs:
        t.start()
    deadline = time.monotonic() + 60
    while running_on_worker(engine_worker) < 2:  # the window is full: the waiter will queue
        assert time.monotonic() < deadline, "the hogs never ran"
        time.sleep(0.1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{gateway}/v1/chat/completions",
            json=body("Hi.", 150),
            headers={"Authorization": f"Bearer {key}"},
            timeout=0.5,
        )
    for t in hogs:
        t.join(timeout=120)
    # ~20 prompt + 150 reserved of a 200-token burst: a second reservation fits only if the first came back
    resp = httpx.post(
        f"{gateway}/v1/chat/completions",
        json=body("Hi.", 150),
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        assert http.get(f"/admin/tenants/{tenant_id}/usage").json()["requests"] == 1
