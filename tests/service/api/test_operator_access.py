"""What an outsider who reaches the API port can see (issue 31): ``/readyz`` says ready or not without the
workers' internal URLs (the detail is for an operator: the operator port, the admin token or the metrics
token), ``/metrics`` (tenant ids in its labels) asks for ``security.metrics_token`` when one is set, and with
``security.operator_port`` set ``/metrics`` and ``/admin`` answer only on that port."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config.security import SecuritySettings
from service.config.settings import Settings
from service.diagnose.sources import ScrapedWindow, SourceError, scrape_window
from tests.conftest import ADMIN_TOKEN, MODEL, gateway_settings
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer, free_port

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
METRICS_TOKEN = "metrics-token-0123456789"
_ids = itertools.count()


def settings_with(redis_url: str, model_dir: Path, worker: str, **security: Any) -> Settings:
    settings = gateway_settings(redis_url, model_dir, [worker])
    return settings.model_copy(update={"security": SecuritySettings.model_validate(security)})


def ready_body(client: httpx.Client, **headers: str) -> dict[str, object]:
    deadline = time.monotonic() + 60  # generous: a loaded machine
    while (resp := client.get("/readyz", headers=headers)).status_code != 200:
        assert time.monotonic() < deadline, resp.text
        time.sleep(0.1)
    body: dict[str, object] = resp.json()
    return body


def test_readiness_hides_worker_urls_from_outsiders_and_shows_them_to_the_admin(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]
) -> None:
    app = create_app(gateway_settings(redis_url, stub_model_dir, [fake[1]]))
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=10) as http:
        outsider = ready_body(http)
        assert outsider == {"ready": True, "draining": False}
        assert fake[1] not in http.get("/readyz").text
        assert ready_body(http, authorization="Bearer not-the-admin-token-at-all") == outsider
        admin = ready_body(http, **ADMIN)
        assert admin["workers"] == {fake[1]: True} and admin["redis"] is True
        # no metrics token configured: /metrics answers anyone (the compatible default)
        assert http.get("/metrics").status_code == 200


def test_metrics_token_guards_metrics_and_opens_readiness_detail(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]
) -> None:
    settings = settings_with(redis_url, stub_model_dir, fake[1], metrics_token=METRICS_TOKEN)
    with (
        ThreadedServer(create_app(settings)) as server,
        httpx.Client(base_url=server.url, timeout=10) as http,
    ):
        tenant = f"op{next(_ids)}"
        assert (
            http.post("/admin/tenants", json={"id": tenant, "name": tenant}, headers=ADMIN).status_code == 201
        )
        missing = http.get("/metrics")
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
        assert tenant not in missing.text
        wrong = http.get("/metrics", headers={"authorization": "Bearer " + "x" * 24})
        assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "metrics_token_required"
        scrape = http.get("/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"})
        assert scrape.status_code == 200 and "radixgate_" in scrape.text
        assert http.get("/metrics", headers=ADMIN).status_code == 200
        detail = ready_body(http, authorization=f"Bearer {METRICS_TOKEN}")
        assert detail["workers"] == {fake[1]: True}


def test_operator_port_serves_metrics_admin_and_detail_and_the_api_port_does_not(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]
) -> None:
    operator = free_port()
    settings = settings_with(redis_url, stub_model_dir, fake[1], operator_port=operator)
    with (
        ThreadedServer(create_app(settings), extra_ports=(operator,)) as server,
        httpx.Client(base_url=server.url, timeout=10) as api,
        httpx.Client(base_url=f"http://127.0.0.1:{operator}", timeout=10) as ops,
    ):
        assert ready_body(api) == {"ready": True, "draining": False}
        assert ready_body(api, **ADMIN) == {
            "ready": True,
            "draining": False,
        }  # the detail: operator port only
        assert api.get("/healthz").status_code == 200
        assert api.get("/v1/models").status_code == 401  # the API itself: a key is needed, not a 404
        for path in ("/metrics", "/admin/tenants", "/admin/workers", "/admin"):
            refused = api.get(path, headers=ADMIN)
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_found", path
        refused = api.post("/admin/tenants", json={"id": "nope", "name": "n"}, headers=ADMIN)
        assert refused.status_code == 404
        # the operator port: detail without a token (whoever reaches it is an operator), metrics, admin
        assert ready_body(ops)["workers"] == {fake[1]: True}
        assert ops.get("/metrics").status_code == 200
        tenant = f"op{next(_ids)}"
        assert (
            ops.post("/admin/tenants", json={"id": tenant, "name": tenant}, headers=ADMIN).status_code == 201
        )
        assert ops.get("/admin/tenants").status_code == 401  # still behind the admin token
        # and nothing of the API there
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        assert ops.post("/v1/chat/completions", json=chat).status_code == 404
        assert ops.get("/v1/models").status_code == 404


@pytest.fixture
def served(redis_url: str, stub_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """``python -m service serve`` (two processes) with an operator port; (API URL, operator URL)."""
    port, operator = free_port(), free_port()
    with ThreadedServer(FakeWorker().app) as upstream:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RADIXGATE_", "PROMETHEUS_"))}
        env |= {
            "RADIXGATE_WORKERS": "2",
            "RADIXGATE_PORT": str(port),
            "RADIXGATE_SECURITY__OPERATOR_PORT": str(operator),
            "RADIXGATE_ADMIN_TOKEN": ADMIN_TOKEN,
            "RADIXGATE_REDIS__URL": redis_url,
            "RADIXGATE_REDIS__KEY_PREFIX": f"opserve{next(_ids)}:",
            "RADIXGATE_UPSTREAM__WORKERS": f'["{upstream.url}"]',
            "RADIXGATE_ENGINE__SERVED_MODEL_NAME": MODEL,
            "RADIXGATE_API__TOKENIZER_PATH": str(stub_model_dir),
        }
        log = (tmp_path / "gateway.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{operator}"
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
            log.close()


def test_serve_listens_on_the_operator_port_in_every_process(served: tuple[str, str]) -> None:
    """`serve` binds the operator port beside the API port (two processes share both sockets)."""
    api, ops = served
    deadline = time.monotonic() + 120  # two processes start: generous on a loaded machine
    while True:
        try:
            if httpx.get(f"{ops}/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "no operator port in 120 s"
        time.sleep(0.2)
    # several connections: each process (whichever accepts) sorts by port the same way
    for _ in range(6):
        with httpx.Client(timeout=30) as fresh:
            assert fresh.get(f"{api}/metrics").status_code == 404
            assert fresh.get(f"{ops}/metrics").status_code == 200
            assert "workers" not in fresh.get(f"{api}/readyz").json()


def test_diagnose_scrapes_a_gateway_behind_the_metrics_token(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]
) -> None:
    """`python -m service diagnose --gateway` sends its admin token to the gateway's /metrics; without one it
    says what the gateway asks for."""
    settings = settings_with(redis_url, stub_model_dir, fake[1], metrics_token=METRICS_TOKEN)

    async def scrape(token: str | None) -> ScrapedWindow:
        async with httpx.AsyncClient(timeout=10) as http:
            return await scrape_window(server.url, [], 0.1, 0.1, http, token=token)

    with ThreadedServer(create_app(settings)) as server:
        window = asyncio.run(scrape(ADMIN_TOKEN))
        assert window.scrapes and any(name.startswith("radixgate_") for name in window.scrapes[0].samples)
        with pytest.raises(SourceError, match="metrics token"):
            asyncio.run(scrape(None))
