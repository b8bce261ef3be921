"""Concurrency caps across gateway processes (``python -m service serve``, ``RADIXGATE_WORKERS=2``, one
Redis): together they never pass a tenant's cap (counted at the fake worker); slots held longer than their
lease are renewed; and when the processes are killed (SIGKILL) with slots held, the slots come back with
their lease (2 s here), not before and not much after."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from service.app import create_app
from tests.service.runtime.test_gateway_processes import ADMIN, MODEL, gateway_env, ready_pids, serve
from tests.support.fake_worker import TOKENS, served_fake_worker
from tests.support.gateway import fake_worker_settings
from tests.support.servers import ThreadedServer, free_port

LEASE_S = 2.0
RENEW_S = LEASE_S / 3


def chat(content: str, stream: bool, max_tokens: int = len(TOKENS)) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def stream_once(base: str, key: str, content: str) -> int:
    """One streamed chat on a fresh connection (either process may take it), read to its end; its status
    (0 when the connection broke: the process serving it was killed)."""
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=chat(content, True), headers=headers, timeout=60
        ) as resp:
            for _ in resp.iter_bytes():
                pass
            return resp.status_code
    except httpx.HTTPError:
        return 0


def test_two_processes_share_a_cap_and_a_killed_replicas_slots_come_back_with_the_lease(
    redis_url: str, stub_model_dir: Path, tmp_path: Path
) -> None:
    port, log = free_port(), tmp_path / "gateway.log"
    prefix = "capprocs:"
    with served_fake_worker() as worker:
        env = gateway_env(redis_url, stub_model_dir, worker.url, port, workers=2, prefix=prefix)
        env["RADIXGATE_REDIS__CONCURRENCY_LEASE_S"] = str(LEASE_S)
        server = serve(env, log, port)
        base = next(server)
        try:
            with httpx.Client(base_url=base, timeout=30) as admin:
                tenant = {"id": "capped", "name": "capped", "max_concurrent_requests": 3}
                assert admin.post("/admin/tenants", json=tenant, headers=ADMIN).status_code == 201
                issued = admin.post("/admin/tenants/capped/keys", json={}, headers=ADMIN)
                key = issued.json()["api_key"]

            # 1. 20 concurrent streams over both processes: never more than 3 at the worker
            worker.markers.append("capped-load")
            worker.delay_s = 0.15
            with concurrent.futures.ThreadPoolExecutor(20) as pool:
                statuses = list(pool.map(lambda i: stream_once(base, key, f"capped-load {i}"), range(20)))
            assert worker.peak_in_flight["capped-load"] == 3
            assert set(statuses) == {200, 429}, statuses
            lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
            seen = Counter(
                line["pid"]
                for line in lines
                if line.get("tenant") == "capped" and line.get("event") in ("request", "request_rejected")
            )
            assert len(seen) == 2, f"one process took every request: {seen}"

            # 2. three streams held, then every gateway process killed: nothing releases their slots
            settings = fake_worker_settings(
                redis_url, stub_model_dir, worker.url, prefix, engine={"served_model_name": MODEL}
            )
            with ThreadedServer(create_app(settings)) as survivor:
                worker.markers.append("capped-held")
                worker.delay_s = 1.0  # 8 s streams: they outlive the kill
                held = [
                    threading.Thread(target=stream_once, args=(base, key, f"capped-held {i}"), daemon=True)
                    for i in range(3)
                ]
                for thread in held:
                    thread.start()
                deadline = time.monotonic() + 20
                while worker.in_flight["capped-held"] < 3:
                    assert time.monotonic() < deadline, "the three streams did not reach the worker"
                    time.sleep(0.02)

                def refused() -> bool:
                    full = httpx.post(
                        f"{survivor.url}/v1/chat/completions",
                        json=chat("refused", False, 1),
                        headers={"Authorization": f"Bearer {key}"},
                        timeout=30,
                    )
                    return full.status_code == 429 and "concurrency_limit_exceeded" in full.text

                assert refused()
                time.sleep(LEASE_S + RENEW_S)  # past their first lease: the processes renew them
                assert worker.in_flight["capped-held"] == 3 and refused()
                os.killpg(os.getpgid(ready_pids(log)[0]), signal.SIGKILL)
                killed = time.monotonic()
                worker.delay_s = 0.0
                with httpx.Client(base_url=survivor.url, timeout=30) as http:
                    while True:  # the survivor asks until a slot is free again
                        resp = http.post(
                            "/v1/chat/completions",
                            json=chat("after the kill", False, 1),
                            headers={"Authorization": f"Bearer {key}"},
                        )
                        if resp.status_code == 200:
                            back = time.monotonic() - killed
                            break
                        assert resp.status_code == 429, resp.text
                        assert time.monotonic() - killed < 3 * LEASE_S, "the slots never came back"
                        time.sleep(0.02)
                for thread in held:
                    thread.join(timeout=10)
        finally:
            with contextlib.suppress(ProcessLookupError):
                server.close()
    print(f"slots back {back:.2f} s after SIGKILL (lease {LEASE_S} s, renewed every {RENEW_S:.2f} s)")
    # held until their lease ran out (at most one renewal period before the kill), and not much longer
    assert LEASE_S - RENEW_S - 0.2 <= back <= LEASE_S + RENEW_S + 1.0
