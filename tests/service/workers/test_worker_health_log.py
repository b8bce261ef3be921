"""A worker that is down, is not SGLang, or serves another model is said so: every change of its health is
logged once with the reason (not once per probe), and ``/admin/workers`` shows the last reason and since
when (service/workers/pool.py)."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from structlog.testing import capture_logs

from service.app import create_app
from service.workers.client import SGLangClient
from service.workers.pool import WorkerPool
from tests.conftest import ADMIN_TOKEN, gateway_settings
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer, free_port

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def plain_http_server(folder: Path) -> Iterator[str]:
    """Python's ``http.server`` (a file server, not SGLang) on a free port in a thread; its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: _Quiet(*a, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def health_lines(logs: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(event, worker, reason) of the health-change lines."""
    return [
        (e["event"], e["worker"], e["reason"])
        for e in logs
        if e["event"] in ("worker_healthy", "worker_unhealthy")
    ]


async def test_each_change_of_health_is_logged_once_with_its_reason(tmp_path: Path) -> None:
    port = free_port()
    closed = f"http://127.0.0.1:{port}"
    with plain_http_server(tmp_path) as plain:
        async with SGLangClient() as client:
            pool = WorkerPool([closed, plain], client, 1.0, served_models=["test-model"])
            with capture_logs() as logs:
                for _ in range(4):
                    await pool.probe_all()
            assert sorted(health_lines(logs)) == sorted(
                [
                    ("worker_unhealthy", closed, "connection refused"),
                    ("worker_unhealthy", plain, "GET /health 404: not an SGLang server?"),
                ]
            )
            assert all(e["log_level"] == "warning" for e in logs if e["event"] == "worker_unhealthy")
            state = pool.get(plain)
            assert state is not None and state.health_reason == "GET /health 404: not an SGLang server?"
            assert state.health_since is not None and abs(state.health_since - time.time()) < 60

            # the closed port comes up as SGLang, then goes away again: one line per change
            fake = FakeWorker()
            with capture_logs() as logs:
                with ThreadedServer(fake.app, port=port):
                    for _ in range(3):
                        await pool.probe_all()
                for _ in range(3):
                    await pool.probe_all()
            assert [line for line in health_lines(logs) if line[1] == closed] == [
                ("worker_healthy", closed, "GET /health 200"),
                ("worker_unhealthy", closed, "connection refused: circuit breaker open"),
            ]
            assert health_lines(logs) == [line for line in health_lines(logs) if line[1] == closed]


async def test_a_worker_that_reports_another_model_is_logged_once() -> None:
    fake = FakeWorker()
    fake.server_info = {"served_model_name": "other-model"}
    with ThreadedServer(fake.app) as server:
        async with SGLangClient() as client:
            pool = WorkerPool([server.url], client, 1.0, served_models=["test-model", "alias"])
            with capture_logs() as logs:
                for _ in range(4):
                    await pool.probe_all()
                    pool.record(server.url, "request_ok")
            lines = [e for e in logs if e["event"] in ("worker_healthy", "worker_unhealthy")]
            assert len(lines) == 1 and lines[0]["event"] == "worker_healthy", lines
            assert lines[0]["log_level"] == "warning"
            assert "reports model 'other-model'" in lines[0]["reason"]
            assert "test-model, alias" in lines[0]["reason"]
            assert pool.any_healthy()  # still used: SGLang names a model by its path unless told
            # restarted with the right name (what was learned is dropped when it goes down): logged again
            fake.server_info = {"served_model_name": "alias"}
            client.forget(server.url)
            with capture_logs() as logs:
                for _ in range(3):
                    await pool.probe_all()
            assert health_lines(logs) == [("worker_healthy", server.url, "GET /health 200")]


def test_admin_workers_show_the_last_reason_and_since_when(
    redis_url: str, stub_model_dir: Path, tmp_path: Path
) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    fake = FakeWorker()
    with plain_http_server(tmp_path) as plain, ThreadedServer(fake.app) as good:
        settings = gateway_settings(redis_url, stub_model_dir, [closed, plain, good.url])
        before = datetime.now(UTC)
        with ThreadedServer(create_app(settings)) as gw, httpx.Client(base_url=gw.url, timeout=30) as admin:
            data = {w["url"]: w for w in admin.get("/admin/workers", headers=ADMIN).json()["data"]}
    assert (data[closed]["healthy"], data[closed]["health_reason"]) == (False, "connection refused")
    assert data[plain]["health_reason"] == "GET /health 404: not an SGLang server?"
    assert (data[good.url]["healthy"], data[good.url]["health_reason"]) == (True, "GET /health 200")
    for worker in data.values():
        since = datetime.fromisoformat(str(worker["health_since"]).replace("Z", "+00:00"))
        assert before.replace(microsecond=0) <= since <= datetime.now(UTC)
