"""Workers listed in settings are shared through the registry by every gateway process (issue 29): two
processes of ``python -m service serve`` (``RADIXGATE_WORKERS=2``, one port, one Redis) list the same two
workers; one drained over the admin API (which reaches one process) is drained by both within a registry
sync, and made active again the same way."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections import Counter
from pathlib import Path

import httpx

from service.workers.registry import worker_id
from tests.service.runtime.test_gateway_processes import ADMIN, MODEL, gateway_env, issue_key, serve
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer, free_port

SYNC_S = 0.2  # upstream.health_interval_s: the registry sync period too


def ask_many(base: str, key: str, count: int) -> list[int]:
    """``count`` requests, each on a fresh connection (either process may take it); their statuses."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {key}"}

    def one(_: int) -> int:
        return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(count)))


def served_by(log: Path, tenant: str) -> Counter[tuple[int, str]]:
    """(process id, worker) of each of ``tenant``'s requests in the gateway's log."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return Counter(
        (int(line["pid"]), str(line["worker"]))
        for line in lines
        if line.get("event") == "request" and line.get("tenant") == tenant
    )


def test_a_settings_worker_drained_over_one_process_is_drained_by_both(
    redis_url: str, stub_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "gateway.log"
    with ThreadedServer(FakeWorker().app) as wa, ThreadedServer(FakeWorker().app) as wb:
        a, b = wa.url.rstrip("/"), wb.url.rstrip("/")
        env = gateway_env(redis_url, stub_model_dir, a, port, workers=2, prefix="shared-drain:")
        env |= {
            "RADIXGATE_UPSTREAM__WORKERS": json.dumps([a, b]),
            "RADIXGATE_UPSTREAM__HEALTH_INTERVAL_S": str(SYNC_S),
            "RADIXGATE_ROUTING__POLICY": "round_robin",  # each process uses both workers in turn
        }
        server = serve(env, log, port)
        base = next(server)
        try:
            keys = {phase: issue_key(base, phase) for phase in ("before", "drained", "again")}
            assert set(ask_many(base, keys["before"], 40)) == {200}
            before = served_by(log, "before")
            assert {pid for pid, worker in before if worker == a} and len({pid for pid, _ in before}) == 2
            assert {worker for _, worker in before} == {a, b}
            # drained over one connection, so one process; the other follows the registry
            with httpx.Client(base_url=base, timeout=30) as admin:
                drained = admin.post(f"/admin/workers/{worker_id(a)}/drain", headers=ADMIN)
                assert drained.status_code == 200 and drained.json()["mode"] == "draining"
            time.sleep(3 * SYNC_S)  # a sync period, and margin for the load of the machine
            for _ in range(6):  # fresh connections: each process answers some
                listed = httpx.get(f"{base}/admin/workers", headers=ADMIN, timeout=30).json()["data"]
                entry = next(w for w in listed if w["url"] == a)
                assert entry["mode"] == "draining" and not entry["in_pool"] and entry["source"] == "settings"
            assert set(ask_many(base, keys["drained"], 40)) == {200}
            drained_phase = served_by(log, "drained")
            assert len({pid for pid, _ in drained_phase}) == 2, drained_phase  # both processes served
            assert {worker for _, worker in drained_phase} == {b}, drained_phase  # and neither sent to A
            # active again over one process: both use it again
            again = httpx.post(f"{base}/admin/workers", json={"url": a}, headers=ADMIN, timeout=30)
            assert again.status_code == 201
            time.sleep(3 * SYNC_S + 1.0)  # the sync, then the re-added worker's first health probe
            assert set(ask_many(base, keys["again"], 40)) == {200}
            again_phase = served_by(log, "again")
            assert {pid for pid, worker in again_phase if worker == a} == {pid for pid, _ in again_phase}
            assert len({pid for pid, _ in again_phase}) == 2, again_phase
        finally:
            server.close()
