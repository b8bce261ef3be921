"""Worker supervision with simulated workers (``python -m loadgen.sim`` as the launched process).

The real engine's case (its scheduler killed under a gateway that launched it) is in
``tests/engine/test_supervisor_engine.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from policies.circuit_breaker import BreakerConfig
from service.config.settings import EngineSettings
from service.workers.client import SGLangClient
from service.workers.launcher import WorkerProcess
from service.workers.pool import WorkerPool
from service.workers.supervisor import RestartReason, WorkerSupervisor
from tests.support.paths import REPO
from tests.support.servers import free_port

ROOT = REPO


class SimWorkerProcess(WorkerProcess):
    """A launched worker that is the simulated SGLang server (or any other command)."""

    def __init__(self, engine: EngineSettings, port: int, argv: list[str] | None = None) -> None:
        super().__init__(engine, port)
        self.argv = argv

    def command(self) -> list[str]:
        return self.argv or [sys.executable, "-m", "loadgen.sim", "--port", str(self.port), "--speed", "20"]

    def environment(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT)}


ENGINE = EngineSettings(
    supervise_interval_s=0.1,
    unhealthy_restart_s=0.6,
    restart_backoff_base_s=0.2,
    restart_backoff_max_s=0.8,
    startup_timeout_s=30,
)


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


@pytest.fixture
async def client() -> AsyncIterator[SGLangClient]:
    async with SGLangClient() as shared:
        yield shared


async def supervised(
    client: SGLangClient, worker: WorkerProcess
) -> tuple[WorkerPool, WorkerSupervisor, list[tuple[str, RestartReason]], list[str]]:
    worker.start()
    await worker.wait_ready()
    transitions: list[str] = []
    pool = WorkerPool(
        [worker.url],
        client,
        0.1,
        1.0,
        BreakerConfig(2, 1, 60.0),  # a long cool-down: only readmit() can bring it back this fast
        on_transition=lambda _, state: transitions.append(state),
    )
    await pool.start()
    restarts: list[tuple[str, RestartReason]] = []
    supervisor = WorkerSupervisor(
        worker, pool, client, ENGINE, on_restart=lambda u, r: restarts.append((u, r)), jitter=lambda: 0.0
    )
    supervisor.start()
    return pool, supervisor, restarts, transitions


async def test_a_killed_worker_is_restarted_and_readmitted(
    http: httpx.AsyncClient, client: SGLangClient
) -> None:
    worker = SimWorkerProcess(ENGINE, free_port())
    pool, supervisor, restarts, transitions = await supervised(client, worker)
    try:
        assert pool.any_healthy()
        assert worker.proc is not None
        first_pid = worker.proc.pid
        os.killpg(first_pid, signal.SIGKILL)
        await until(lambda: supervisor.restarts == 1 and transitions[-1:] == ["closed"])
        assert restarts == [(worker.url, "exited")] and pool.any_healthy()
        assert worker.proc is not None and worker.proc.pid != first_pid
        assert transitions == ["open", "half_open", "closed"]  # re-admitted through a half-open probe
        resp = await http.post(
            f"{worker.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        )
        assert resp.status_code == 200
    finally:
        await supervisor.stop()
        await pool.stop()
        worker.stop()


async def test_a_live_worker_failing_health_is_restarted(
    http: httpx.AsyncClient, client: SGLangClient
) -> None:
    worker = SimWorkerProcess(ENGINE, free_port())
    pool, supervisor, restarts, _ = await supervised(client, worker)
    try:
        assert worker.proc is not None
        first_pid = worker.proc.pid
        fault = {"mode": "http_500", "fail_health": True}
        assert (await http.post(f"{worker.url}/sim/fault", json=fault)).status_code == 200
        await asyncio.sleep(0.3)
        assert supervisor.restarts == 0  # not yet: /health must fail for unhealthy_restart_s
        await until(lambda: supervisor.restarts == 1 and pool.any_healthy())
        assert restarts == [(worker.url, "unhealthy")]
        assert worker.proc is not None and worker.proc.pid != first_pid
        assert (await http.get(f"{worker.url}/health")).status_code == 200
    finally:
        await supervisor.stop()
        await pool.stop()
        worker.stop()


async def test_a_crash_loop_backs_off(http: httpx.AsyncClient, client: SGLangClient) -> None:
    port = free_port()
    worker = SimWorkerProcess(ENGINE, port)
    pool, supervisor, restarts, _ = await supervised(client, worker)
    try:
        # from now on every start exits at once
        worker.argv = [sys.executable, "-c", "raise SystemExit(3)"]
        assert worker.proc is not None
        os.killpg(worker.proc.pid, signal.SIGKILL)
        delays: list[float] = []

        def seen() -> bool:
            if supervisor.restarts > len(delays) and supervisor.last_delay_s is not None:
                delays.append(supervisor.last_delay_s)
            return len(delays) >= 4

        await until(seen, timeout_s=20)
        assert delays[:4] == pytest.approx([0.1, 0.2, 0.4, 0.4])  # doubling, capped at max_s / 2 (jitter 0)
        assert {r for _, r in restarts} == {"exited"} and not pool.any_healthy()
    finally:
        await supervisor.stop()
        await pool.stop()
        worker.stop()
