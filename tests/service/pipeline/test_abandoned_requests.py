"""A client that leaves (499) after its request reached a worker is charged what the worker computed,
streamed or not; one that leaves while its request still waits in the gateway's queue is refunded.

Fake worker (``delay_s`` per generated word; a non-streamed answer aborted through ``/abort_request``
ends at once with its counts so far, as SGLang's does) and clients that time out to disconnect.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from service.app import create_app
from tests.conftest import ADMIN_TOKEN, gateway_settings
from tests.service.api.test_api import auth, chat, new_tenant, usage_of
from tests.support.fake_worker import TOKENS, FakeWorker
from tests.support.metrics import metrics_once_shown
from tests.support.servers import SERVE_PROTOCOL, ThreadedServer


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


class Records(logging.Handler):
    """Keeps every record at ERROR or above of the logger it is added to."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# the protocols `serve` runs: with write coalescing (the default) and without it
@pytest.mark.parametrize("http", [SERVE_PROTOCOL, "service.runtime.http_protocol:GatewayHttpToolsProtocol"])
def test_stream_whose_client_stops_reading_is_given_up_and_its_worker_slot_freed(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str], worker: FakeWorker, http: str
) -> None:
    """A tenant that opens a stream and never reads it (its connection stays open) blocks the gateway's
    writes once the socket buffers are full; after ``api.stream_send_timeout_s`` without taking a chunk
    the gateway gives up on it: closes the connection, aborts the worker's request, frees its slot (the
    in-flight gauge back to 0) and charges what was generated (a 499), instead of holding a worker slot
    for as long as the client keeps the socket open. That close is handled: uvicorn logs no ERROR for it
    (it logged "ASGI callable returned without completing response" for each, which fires alerts on
    ERROR lines); the connection is reset (nginx's ``reset_timedout_connection``: the unread buffers are
    freed at once, not kept for a client that does not read)."""
    worker.delay_s = 0.0
    worker.server_info = {"incremental_streaming_output": True}  # deltas: 64 KiB per chunk
    worker.tokens = ["x" * 65536] * 200  # 13 MB: far more than the socket buffers hold
    settings = gateway_settings(redis_url, stub_model_dir, [fake[1]], stream_send_timeout_s=1.0)
    errors = Records()
    uvicorn_log = logging.getLogger("uvicorn.error")
    try:
        with (
            ThreadedServer(create_app(settings), http=http) as gw,
            httpx.Client(base_url=gw.url, timeout=30) as http,
            socket.socket() as sock,
        ):
            uvicorn_log.addHandler(errors)  # after uvicorn configured its loggers (which drops handlers)
            tenant_id, key = new_tenant(http)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", gw.port))
            body = json.dumps(chat(max_tokens=200, stream=True)).encode()
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            sock.sendall(head.encode() + body)
            assert sock.recv(12) == b"HTTP/1.1 200"  # then it reads nothing more
            # the 499 is counted when the request settles, after its slot and in-flight count were released
            metrics = metrics_once_shown(
                http, 'radixgate_requests_total{model="test-model",status="499"', within_s=15
            )
            assert "radixgate_in_flight_requests 0.0" in metrics
            usage = settled_usage(http, tenant_id)
            assert usage["requests"] == 1 and usage["errors"] == 0, usage
            assert 1 <= usage["completion_tokens"] < 200, usage  # what was generated, not the whole answer
            assert worker.received[-1]["rid"] in worker.aborted  # the worker was told to stop
            sock.settimeout(10)
            rest = b""
            with contextlib.suppress(ConnectionResetError):  # closed by the gateway: not a hang
                while chunk := sock.recv(1 << 20):
                    rest += chunk
            assert b"[DONE]" not in rest
        assert [r.getMessage() for r in errors.records] == []
    finally:
        uvicorn_log.removeHandler(errors)
        worker.server_info, worker.tokens = None, list(TOKENS)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/admin/tenants"])
def test_client_that_leaves_before_its_body_is_complete_is_no_error(
    gateways: dict[str, httpx.Client], worker: FakeWorker, path: str
) -> None:
    """A client that closes its connection halfway through sending the body is a client that left (499,
    nothing logged as an error), not an unhandled ``ClientDisconnect`` (an ``unhandled_error`` traceback
    and a 500 in the logs for every such client)."""
    http = gateways["counts"]
    tenant_id, key = new_tenant(http)
    port = int(str(http.base_url).rsplit(":", 1)[1].rstrip("/"))
    body = json.dumps(chat(max_tokens=8)).encode()
    with capture_logs() as logs:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                auth_key = ADMIN_TOKEN if path.startswith("/admin") else key
                head = (
                    f"POST {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {auth_key}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                )
                sock.sendall(head.encode() + body[: len(body) // 2])
                time.sleep(0.2)
        time.sleep(0.5)
    assert http.get("/healthz").status_code == 200
    assert [e for e in logs if e["log_level"] in ("error", "critical")] == []
    assert usage_of(http, tenant_id)["requests"] == 0  # nothing was reserved or charged
    assert worker.received == []
