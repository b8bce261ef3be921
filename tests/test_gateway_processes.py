"""Several gateway processes on one host (``RADIXGATE_WORKERS``): ``python -m service serve`` forks uvicorn
workers from the app factory; they share the port and Redis, so a tenant's quota holds across them."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from service.config import Settings
from tests.conftest import ADMIN_TOKEN
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer, free_port

MODEL = "proc-model"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def test_several_processes_cannot_each_launch_the_engines() -> None:
    with pytest.raises(ValidationError, match=r"workers > 1 needs engine\.launch false"):
        Settings.model_validate({"workers": 2, "engine": {"launch": True}})
    assert Settings.model_validate({"workers": 2}).workers == 2


def serve(env: dict[str, str], log: Path, port: int) -> Iterator[str]:
    """Run ``python -m service serve`` with ``env`` until the generator is closed; yields its URL."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "gateway not ready in 60 s"
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_two_processes_serve_and_share_a_tenants_quota(
    redis_url: str, stub_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "gateway.log"
    with ThreadedServer(FakeWorker().app) as upstream:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXGATE_")}
        env |= {
            "PYTHONUNBUFFERED": "1",
            "RADIXGATE_WORKERS": "2",
            "RADIXGATE_PORT": str(port),
            "RADIXGATE_ADMIN_TOKEN": ADMIN_TOKEN,
            "RADIXGATE_REDIS__URL": redis_url,
            "RADIXGATE_REDIS__KEY_PREFIX": "procs:",
            "RADIXGATE_UPSTREAM__WORKERS": json.dumps([upstream.url]),
            "RADIXGATE_ENGINE__SERVED_MODEL_NAME": MODEL,
            "RADIXGATE_API__TOKENIZER_PATH": str(stub_model_dir),
        }
        server = serve(env, log, port)
        base = next(server)
        try:
            with httpx.Client(base_url=base, timeout=30) as admin:
                # a burst of 30 requests refilled at 1/min: 30 pass in all, whichever process serves them
                tenant = {
                    "id": "shared",
                    "name": "shared",
                    "quotas": {"requests_per_min": 1, "request_burst": 30},
                }
                assert admin.post("/admin/tenants", json=tenant, headers=ADMIN).status_code == 201
                issued = admin.post("/admin/tenants/shared/keys", json={"name": "k"}, headers=ADMIN)
                assert issued.status_code == 201
                key = issued.json()["api_key"]

            def ask(_: int) -> tuple[int, str]:  # a fresh connection each time: either process may take it
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                headers = {"Authorization": f"Bearer {key}"}
                resp = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30)
                return resp.status_code, resp.text

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(ask, range(60)))
        finally:
            server.close()
    statuses = Counter(status for status, _ in answers)
    odd = [text for status, text in answers if status not in (200, 429)]
    assert statuses == {200: 30, 429: 30}, odd
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    served = [line for line in lines if line.get("event") == "request" and line.get("tenant") == "shared"]
    assert len(served) == 30 and {line["status"] for line in served} == {200}
    by_process = Counter(line["pid"] for line in served)
    assert len(by_process) == 2, f"one process served every request: {by_process}"
