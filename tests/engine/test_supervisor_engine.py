"""A launched real SGLang worker whose scheduler process is killed comes back without a gateway restart.

The gateway launches the worker itself (``engine.launch``). Killing SGLang's scheduler (a child of the
``launch_server`` process) makes SGLang take its whole process tree down; the supervisor restarts the
worker with backoff, the pool re-admits it through half-open probes, and requests succeed again.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.support.engine import descendants, engine_home, engine_settings, processes
from tests.support.servers import ThreadedServer, free_port

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def test_killed_scheduler_is_restarted_and_service_returns(redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    engine = engine_settings(
        launch=True,
        base_port=port,
        log_dir=tmp_path,
        supervise_interval_s=0.5,
        restart_backoff_base_s=0.5,
        restart_backoff_max_s=5.0,
        startup_timeout_s=600,
    )
    settings = Settings.model_validate(
        {
            "home": engine_home(),  # RADIXGATE_HOME: the engine and model under it
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": "sup:"},
            "engine": engine.model_dump(),
            "upstream": {"health_interval_s": 0.5, "breaker_cooldown_s": 30},
        }
    )
    worker_url = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4}
    with (
        ThreadedServer(create_app(settings), startup_timeout_s=900) as gateway,
        httpx.Client(base_url=gateway.url, timeout=120) as http,
    ):
        assert http.post("/admin/tenants", json={"id": "sup", "name": "s"}, headers=ADMIN).status_code == 201
        key = http.post("/admin/tenants/sup/keys", json={}, headers=ADMIN).json()["api_key"]
        headers = {"Authorization": f"Bearer {key}"}
        assert http.post("/v1/chat/completions", json=body, headers=headers).status_code == 200

        [launcher] = processes(f"--port {port}")
        schedulers = [
            pid for pid, cmd in descendants(launcher).items() if cmd.startswith("sglang::scheduler")
        ]
        assert len(schedulers) == 1, descendants(launcher)
        os.kill(schedulers[0], signal.SIGKILL)
        killed_at = time.monotonic()

        statuses: list[int] = []
        while time.monotonic() - killed_at < 600:
            resp = http.post("/v1/chat/completions", json=body, headers=headers)
            statuses.append(resp.status_code)
            if resp.status_code == 200 and 503 in statuses:
                break
            time.sleep(0.5)
        recovered_s = time.monotonic() - killed_at
        # down for a while (503 with Retry-After, never a 500), then served by the restarted worker
        assert statuses[-1] == 200 and set(statuses) <= {200, 503}, statuses
        print(f"service back {recovered_s:.1f} s after the scheduler was killed ({len(statuses)} tries)")
        [new_launcher] = processes(f"--port {port}")
        assert new_launcher != launcher
        metrics = http.get("/metrics").text
        restarts = f'radixgate_worker_restarts_total{{reason="exited",worker="{worker_url}"}} 1.0'
        assert restarts in metrics, [ln for ln in metrics.splitlines() if "restarts" in ln]
        assert 'state="half_open"' in metrics  # re-admitted through half-open probes
