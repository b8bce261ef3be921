"""A client that leaves (499) after its request reached a worker is charged what the worker computed,
streamed or not; one that leaves while its request still waits in the gateway's queue is refunded.

Fake worker (``delay_s`` per generated word; a non-streamed answer aborted through ``/abort_request``
ends at once with its counts so far, as SGLang's does) and clients that time out to disconnect.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from tests.conftest import gateway_settings
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer
from tests.test_api import auth, chat, new_tenant, usage_of


@pytest.fixture(scope="module")
def gateways(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]
) -> Iterator[dict[str, httpx.Client]]:
    """``"counts"``: waits for the worker's answer to the abort; ``"no_counts"``: does not
    (``abort_grace_s`` 0), so the worker's count stays unknown."""
    clients: dict[str, httpx.Client] = {}
    servers = []
    for name, grace in (("counts", 2.0), ("no_counts", 0.0)):
        settings = gateway_settings(redis_url, stub_model_dir, [fake[1]])
        settings.upstream.abort_grace_s = grace
        server = ThreadedServer(create_app(settings)).__enter__()
        servers.append(server)
        clients[name] = httpx.Client(base_url=server.url, timeout=30)
    yield clients
    for client in clients.values():
        client.close()
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture
def worker(fake: tuple[FakeWorker, str]) -> FakeWorker:
    fake[0].mode, fake[0].delay_s = "ok", 0.2  # 8 words take 1.6 s
    fake[0].received.clear()
    fake[0].aborted.clear()
    return fake[0]


def leave_after(http: httpx.Client, key: str, body: dict[str, Any], seconds: float) -> None:
    """Send ``body`` and disconnect after ``seconds``, before the answer is complete."""
    if not body.get("stream"):
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=body, headers=auth(key), timeout=seconds)
        return
    deadline = time.monotonic() + seconds
    try:  # the headers come with the first token: a wait for them may time out too
        with http.stream(
            "POST", "/v1/chat/completions", json=body, headers=auth(key), timeout=seconds
        ) as resp:
            for line in resp.iter_lines():
                assert "[DONE]" not in line
                if time.monotonic() > deadline:
                    break  # leaving the block closes the connection
    except httpx.ReadTimeout:
        pass


def settled_usage(http: httpx.Client, tenant_id: str) -> dict[str, Any]:
    """The tenant's usage once its request is settled (5 s at most)."""
    deadline = time.monotonic() + 5
    usage = usage_of(http, tenant_id)
    while not usage["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
        usage = usage_of(http, tenant_id)
    return usage


def test_non_streamed_request_abandoned_mid_generation_is_charged_what_the_worker_computed(
    gateways: dict[str, httpx.Client], worker: FakeWorker
) -> None:
    http = gateways["counts"]
    tenant_id, key = new_tenant(http, quotas={"tokens_per_min": 1, "token_burst": 400})
    leave_after(http, key, chat(max_tokens=8), 0.7)  # ~3 of 8 words generated
    usage = settled_usage(http, tenant_id)
    sent = worker.received[-1]
    assert sent["rid"] in worker.aborted  # the worker was told to stop
    assert usage["requests"] == 1 and usage["errors"] == 0, usage
    assert usage["prompt_tokens"] == len(sent["text"].split())  # the worker's own count
    assert 1 <= usage["completion_tokens"] <= 5, usage  # what it generated before the abort, not 8
    assert 'status="499"' in http.get("/metrics").text


def test_streamed_and_non_streamed_requests_abandoned_mid_generation_are_charged_alike(
    gateways: dict[str, httpx.Client], worker: FakeWorker
) -> None:
    http = gateways["counts"]
    usages = []
    for stream in (False, True):
        tenant_id, key = new_tenant(http)
        leave_after(http, key, chat(max_tokens=8, stream=stream), 0.5)  # ~2 words
        usages.append(settled_usage(http, tenant_id))
    for usage in usages:  # one request, not an error, the worker's prompt and a part of the answer
        assert usage["requests"] == 1 and usage["errors"] == 0, usages
        assert usage["prompt_tokens"] == len(worker.received[-1]["text"].split())
        assert 1 <= usage["completion_tokens"] <= 4, usages


def test_unknown_worker_count_charges_the_prompt_part_of_the_reservation(
    gateways: dict[str, httpx.Client], worker: FakeWorker
) -> None:
    counted = gateways["counts"]
    _, key = new_tenant(counted, quotas={"tokens_per_min": 1, "token_burst": 5})
    # what the gateway itself counts for this prompt: the 413 names it
    too_large = counted.post("/v1/chat/completions", json=chat(max_tokens=8), headers=auth(key))
    assert too_large.status_code == 413
    prompt = int(too_large.json()["error"]["message"].split("(prompt ")[1].split(" ")[0])
    http = gateways["no_counts"]
    # a stream left before its first token gave no count either, nor n choices before their first
    for extra in ({"stream": False}, {"stream": True}, {"n": 2}):
        tenant_id, key = new_tenant(http)
        leave_after(http, key, chat(max_tokens=8, **extra), 0.1)
        usage = settled_usage(http, tenant_id)
        assert (usage["requests"], usage["errors"]) == (1, 0), usage
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, 0), usage
        assert worker.received[-1]["rid"] in worker.aborted
