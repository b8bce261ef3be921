"""A local radixgate stack as child processes: redis-server + the gateway (which launches its workers).

Used by the demo (``scripts/demo.py``) and by experiments. Everything listens on 127.0.0.1; logs go to a
run folder. Talks to the gateway over HTTP only.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType, TracebackType

import httpx

CPU_PRIORITY_CLASSES = json.dumps(
    {
        "interactive": {"rank": 2, "sglang_priority": 10, "queue_wait_budget_ms": 1500, "ttft_goal_ms": 1500},
        "standard": {"rank": 1, "sglang_priority": 5, "queue_wait_budget_ms": 4000, "ttft_goal_ms": 4000},
        "batch": {"rank": 0, "sglang_priority": 0, "queue_wait_budget_ms": 15000, "ttft_goal_ms": 15000},
    }
)
"""``RADIXGATE_PRIORITY_CLASSES`` sized for the CPU worker (TTFT goals 1.5 / 4 / 15 s, ranks 2 / 1 / 0): an
idle SmolLM2-135M request on this CPU takes about 0.4-0.6 s to its first token and a decode step of 8
requests about 0.3 s, so the gateway's GPU-sized defaults (0.5 / 2 / 30 s) would shed most interactive
requests. Used by the demo (``make demo``/``make up``) and ``loadgen.priority_overload``."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


READY_STREAK = 10
"""Consecutive 200s from ``/readyz`` :meth:`LocalStack.wait_ready` waits for (each on its own connection:
every gateway process answers one with odds 1 - 2^-9 for two processes)."""


class StackError(RuntimeError):
    """A process of the stack exited or did not become ready."""


@contextmanager
def terminate_as_exit() -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` like Ctrl-C raises
    ``KeyboardInterrupt``, so ``finally: stack.stop()`` runs (Python's default for both is to die at once,
    which left the gateway and its SGLang workers, in their own sessions, running). Main thread only."""

    def exit_now(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    before = {sig: signal.signal(sig, exit_now) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def wait_until_stopped(announce: str = "") -> None:
    """Print ``announce`` (if any), then sleep until Ctrl-C, SIGTERM or SIGHUP (the last two inside
    :func:`terminate_as_exit`), then return: for a stack kept running (``make up``) they are the way to stop
    it, so the caller stops the stack and exits 0 (SIGTERM made ``make up`` fail with 143 after a clean
    stop). The announcement is printed inside the wait, so a signal sent as soon as it is read is caught
    here (printed before the call, a signal in between left with 143)."""
    try:
        if announce:
            print(announce, flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    except SystemExit as stop:  # raised by terminate_as_exit's handler only
        if stop.code not in (128 + signal.SIGTERM, 128 + signal.SIGHUP):
            raise


class LocalStack:
    """Redis + gateway (+ the SGLang workers the gateway launches), started and stopped together.

    Args:
        run_dir: folder for logs and Redis files.
        port: gateway port (0 = a free one).
        env: extra ``RADIXGATE_*`` settings for the gateway (e.g. scheduler or priority classes).
        launch_workers: let the gateway launch its SGLang CPU worker(s) (``RADIXGATE_ENGINE__LAUNCH``).
        ready_timeout_s: how long to wait for ``/readyz``, s.
        require_ready: :meth:`start` waits for ``/readyz`` (a healthy worker); False: only for
            ``/healthz`` (workers registered afterwards over the admin API; then :meth:`wait_ready`).
        redis_args: extra ``redis-server`` arguments (e.g. ``--appendonly yes --appendfsync always``, so
            that :meth:`restart_redis` keeps every write).

    Attributes:
        gateway: the gateway's process once started (its parent, with ``RADIXGATE_WORKERS`` > 1).
        redis_url: URL of the stack's Redis once started.
    """

    def __init__(
        self,
        run_dir: Path,
        port: int = 0,
        env: dict[str, str] | None = None,
        launch_workers: bool = True,
        ready_timeout_s: float = 600.0,
        require_ready: bool = True,
        redis_args: tuple[str, ...] = (),
    ) -> None:
        self.run_dir = run_dir
        self.port = port or free_port()
        self.admin_token = os.environ.get("RADIXGATE_ADMIN_TOKEN") or secrets.token_urlsafe(24)
        self._env = env or {}
        self._launch = launch_workers
        self._timeout = ready_timeout_s
        self._procs: list[tuple[subprocess.Popen[bytes], bool]] = []
        self._require_ready = require_ready
        self.gateway: subprocess.Popen[bytes] | None = None
        self.redis_url = ""
        self._redis_args = redis_args
        self._redis_argv: list[str] = []
        self._redis: subprocess.Popen[bytes] | None = None
        self.redis_restarts = 0

    @property
    def url(self) -> str:
        """Base URL of the gateway."""
        return f"http://127.0.0.1:{self.port}"

    def _spawn(
        self, argv: list[str], log_name: str, env: dict[str, str] | None = None, group: bool = False
    ) -> subprocess.Popen[bytes]:
        log = open(self.run_dir / log_name, "wb")  # noqa: SIM115 - owned by the child process
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=group)
        log.close()
        self._procs.append((proc, group))
        return proc

    def start(self) -> LocalStack:
        """Start Redis and the gateway; return when ``/readyz`` answers 200.

        Raises:
            StackError: redis-server missing, a process exited, or readiness timed out (whatever ends the
                wait, the stack's processes are stopped first).
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        binary = shutil.which("redis-server")
        if binary is None:
            raise StackError("redis-server is not installed: run `make setup`")
        redis_port = free_port()
        self._redis_argv = [
            binary,
            "--port",
            str(redis_port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(self.run_dir),
            *self._redis_args,
        ]
        # its own session: a terminal's Ctrl-C must not stop Redis before the gateway drains
        self._redis = self._spawn(self._redis_argv, "redis.log", group=True)
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        env = {
            **os.environ,
            "RADIXGATE_PORT": str(self.port),
            "RADIXGATE_ADMIN_TOKEN": self.admin_token,
            "RADIXGATE_KEY_PEPPER": os.environ.get("RADIXGATE_KEY_PEPPER") or secrets.token_hex(16),
            "RADIXGATE_REDIS__URL": self.redis_url,
            **(
                {"RADIXGATE_ENGINE__LAUNCH": "true", "RADIXGATE_ENGINE__BASE_PORT": str(free_port())}
                if self._launch
                else {}
            ),
            **self._env,
        }
        gateway = self._spawn([sys.executable, "-m", "service", "serve"], "gateway.log", env, group=True)
        self.gateway = gateway
        try:
            self._wait_ready(gateway, "/readyz" if self._require_ready else "/healthz")
        except BaseException:  # not ready, Ctrl-C or a signal while waiting: leave nothing running
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        """Wait until ``/readyz`` answers 200 (Redis and a healthy worker) :data:`READY_STREAK` times in a
        row, each on a new connection: with several gateway processes (``RADIXGATE_WORKERS``) each
        connection goes to one of them, and one that has not yet synced the worker registry or probed its
        workers answers 503 (a soak's capacity probe that began after the first 200 saw
        ``no_worker_available`` from such a process on a loaded machine).

        Raises:
            StackError: the gateway exited or was not ready within the stack's ready timeout.
        """
        assert self.gateway is not None, "start() first"
        self._wait_ready(self.gateway, "/readyz")

    def _wait_ready(self, gateway: subprocess.Popen[bytes], path: str) -> None:
        deadline = time.monotonic() + self._timeout
        streak, needed = 0, 1 if path == "/healthz" else READY_STREAK
        while time.monotonic() < deadline:
            if gateway.poll() is not None:
                raise StackError(f"gateway exited with {gateway.returncode}; see {self.run_dir}/gateway.log")
            try:
                ok = httpx.get(f"{self.url}{path}", timeout=2).status_code == 200
            except httpx.HTTPError:
                ok = False
            streak = streak + 1 if ok else 0
            if streak >= needed:
                return
            time.sleep(0.05 if streak else 0.2 if path == "/healthz" else 1)
        raise StackError(f"gateway not ready after {self._timeout:.0f} s; see {self.run_dir}/gateway.log")

    def stop(self) -> None:
        """Stop the gateway (and its workers) and Redis."""
        for proc, group in reversed(self._procs):
            if proc.poll() is not None:
                continue
            if group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                if group:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
                proc.wait(timeout=10)
        self._procs.clear()

    def restart_redis(self, down_s: float, timeout_s: float = 30) -> None:
        """Stop Redis (SIGTERM: with ``--appendonly yes`` it writes what it holds), keep it down ``down_s``
        seconds, start it again on its port with its arguments and wait until it answers PING.

        Raises:
            StackError: not started, or it did not answer within ``timeout_s``.
        """
        if self._redis is None:
            raise StackError("start() first")
        old = self._redis
        os.killpg(old.pid, signal.SIGTERM)
        old.wait(timeout=timeout_s)
        self._procs = [(p, g) for p, g in self._procs if p is not old]
        time.sleep(down_s)
        self.redis_restarts += 1
        self._redis = self._spawn(self._redis_argv, f"redis-{self.redis_restarts}.log", group=True)
        port = int(self._redis_argv[self._redis_argv.index("--port") + 1])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise StackError(f"Redis did not come back within {timeout_s} s; see {self.run_dir}")

    def admin(self) -> httpx.Client:
        """An HTTP client carrying the admin token."""
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=60
        )

    def runbook_variables(self, prometheus: str | None = None) -> str:
        """The shell lines that set docs/runbook.md's variables for this stack (its ports are random): the
        gateway (``GW``), one worker (``WORKER``, from ``GET /admin/workers``; the others in a comment),
        Prometheus (``PROM``, when the stack runs one), the Redis URL and the admin token under the
        gateway's own setting names (``RADIXGATE_REDIS__URL``, ``RADIXGATE_ADMIN_TOKEN``)."""
        with self.admin() as http:
            workers = [w["url"] for w in http.get("/admin/workers").json()["data"]]
        lines = [f"export GW={self.url}"]
        if workers:
            others = f"   # the others: {' '.join(workers[1:])}" if len(workers) > 1 else ""
            lines.append(f"export WORKER={workers[0]}{others}")
        lines.append(
            f"export PROM={prometheus}"
            if prometheus
            else "# no Prometheus in this stack (make up-sim runs one): the PromQL needs your own"
        )
        lines += [
            f"export RADIXGATE_REDIS__URL={self.redis_url}",
            f"export RADIXGATE_ADMIN_TOKEN={self.admin_token}",
        ]
        return "For docs/runbook.md, in another shell:\n" + "\n".join(f"  {line}" for line in lines)

    def create_tenant(self, tenant_id: str, **spec: object) -> str:
        """Create a tenant and one API key; returns the key."""
        with self.admin() as http:
            http.post("/admin/tenants", json={"id": tenant_id, "name": tenant_id, **spec}).raise_for_status()
            resp = http.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "loadgen"})
            resp.raise_for_status()
            key: str = resp.json()["api_key"]
            return key

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
