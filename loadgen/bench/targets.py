"""The processes of a gateway benchmark: the fake upstream, Redis, and the targets (radixgate,
sglang-router, LiteLLM proxy), each started pinned to its cores, logging to the run folder, and stopped
with its whole process group.

Targets talk OpenAI's ``POST /v1/chat/completions``; ``direct`` is the fake upstream's own route (the
baseline latency is measured against). The peers run from their own virtualenvs under
``$RADIXGATE_HOME/peers`` (``scripts/peers/setup.sh``; default ``~/.cache/radixgate/peers``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from service.config.engine import configured_home, home_engine_paths

TARGETS = ("radixgate", "router", "litellm", "direct")
BASELINE = "radixgate-base"
"""A second radixgate (``--baseline-env``): the same settings plus the baseline's, measured interleaved
with the others, sharing radixgate's Redis (the two run one at a time), for before/after figures."""
"""Every target the benchmark knows, in table order."""

MODEL = "bench-model"
"""Model id every target is asked for (radixgate serves it under this name; the fake answers any)."""


class BenchSetupError(RuntimeError):
    """A process did not start, or a target is not installed."""


def default_peers_dir() -> Path:
    """Where ``scripts/peers/setup.sh`` installs the peers: ``peers`` under the ``home`` setting
    (``RADIXGATE_HOME``, default ``~/.cache/radixgate``)."""
    return home_engine_paths(configured_home())["peers"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, slots=True)
class CorePlan:
    """Which CPUs each role is pinned to (None: not pinned).

    Attributes:
        target: the target under test, alone.
        load: the load tool (wrk) and the benchmark itself.
        aux: the fake upstream and Redis.
    """

    target: frozenset[int] | None
    load: frozenset[int] | None
    aux: frozenset[int] | None


def plan_cores(available: Sequence[int]) -> CorePlan:
    """Pin the target alone on the last CPU, wrk on the first, the fake upstream and Redis on the second
    when there are three or more (else with wrk). One CPU: nothing is pinned."""
    cpus = sorted(available)
    if len(cpus) < 2:
        return CorePlan(None, None, None)
    target = frozenset({cpus[-1]})
    load = frozenset({cpus[0]})
    aux = frozenset({cpus[1]}) if len(cpus) >= 3 else load
    return CorePlan(target, load, aux)


@dataclass(slots=True)
class Target:
    """A target under load.

    Attributes:
        name: one of :data:`TARGETS`.
        url: its ``/v1/chat/completions`` URL.
        headers: headers every request carries (authentication).
        pids: root processes whose trees' CPU time is the target's.
        upstream_route: the fake upstream's path one request of this target calls (its served requests
            are counted there).
    """

    name: str
    url: str
    headers: dict[str, str]
    pids: list[int] = field(default_factory=list)
    upstream_route: str = "/v1/chat/completions"


def chat_body(chunks: int, stream: bool) -> dict[str, object]:
    """The one request every target gets: a short chat with a system prompt, ``max_tokens=chunks``."""
    return {
        "model": MODEL,
        "messages": [
            {
                "role": "system",
                "content": "You are a concise assistant for an infrastructure team. Answer in plain text, "
                "cite no sources, and keep every answer under one paragraph.",
            },
            {
                "role": "user",
                "content": "Explain in two sentences why a radix cache speeds up shared prompts.",
            },
        ],
        "max_tokens": chunks,
        "temperature": 0,
        "stream": stream,
    }


class Processes:
    """Child processes of one benchmark run: pinned, logged to ``run_dir``, stopped together.

    Args:
        run_dir: folder for the logs.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._procs: list[subprocess.Popen[bytes]] = []

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cpus: frozenset[int] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in its own session, pinned to ``cpus`` (threads and children inherit it)."""

        def pin() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        with open(self.run_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                list(argv),
                env=dict(env) if env is not None else None,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=pin,
                cwd=cwd,
            )
        self._procs.append(proc)
        return proc

    def wait_until(
        self, proc: subprocess.Popen[bytes], name: str, ready: Callable[[], bool], timeout_s: float
    ) -> None:
        """Poll ``ready`` until it holds.

        Raises:
            BenchSetupError: the process exited, or ``timeout_s`` passed.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BenchSetupError(f"{name} exited with {proc.returncode}: {self.log_tail(name)}")
            with contextlib.suppress(httpx.HTTPError, OSError):
                if ready():
                    return
            time.sleep(0.2)
        raise BenchSetupError(f"{name} not ready after {timeout_s:.0f} s: {self.log_tail(name)}")

    def log_tail(self, name: str, chars: int = 1500) -> str:
        """The end of a process's log."""
        try:
            return (self.run_dir / f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM every process group, then SIGKILL what is left after 10 s."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._procs.clear()


def _post_ok(url: str, headers: Mapping[str, str]) -> bool:
    resp = httpx.post(url, json=chat_body(4, False), headers=dict(headers), timeout=5)
    return resp.status_code == 200


def base_env() -> dict[str, str]:
    """The caller's environment without ``RADIXGATE_*`` (the benchmark sets those itself)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RADIXGATE_")}


def start_fake(
    procs: Processes, model_dir: Path, cpus: frozenset[int] | None, incremental: bool = False
) -> tuple[str, int]:
    """Start the instant fake SGLang upstream (``incremental``: its ``/generate`` streams deltas, as
    ``--incremental-streaming-output``); returns (base URL, pid). Its reported model path is the local
    tokenizer folder, so sglang-router loads that tokenizer instead of asking a model hub; it serves the model
    as :data:`MODEL`, the name radixgate serves (a worker reporting another model is kept out of its pool)."""
    port = free_port()
    argv = [sys.executable, "-m", "loadgen.bench.upstream", "--port", str(port), "--model", str(model_dir)]
    argv += ["--served-model-name", MODEL]  # what radixgate checks each worker against (/server_info)
    argv += ["--incremental"] if incremental else []
    proc = procs.spawn("upstream", argv, base_env(), cpus)
    url = f"http://127.0.0.1:{port}"
    procs.wait_until(proc, "upstream", lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 30)
    return url, proc.pid


def start_redis(procs: Processes, cpus: frozenset[int] | None) -> tuple[str, int]:
    """Start Debian's redis-server on a free port (no persistence); returns (URL, pid).

    Raises:
        BenchSetupError: redis-server is not installed.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise BenchSetupError("redis-server is not installed: run scripts/setup_gateway.sh")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(procs.run_dir)]
    proc = procs.spawn("redis", argv, None, cpus)

    def ready() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")

    procs.wait_until(proc, "redis", ready, 30)
    return f"redis://127.0.0.1:{port}/0", proc.pid


def start_radixgate(
    procs: Processes,
    upstream: str,
    redis_url: str,
    tokenizer_dir: Path,
    extra_env: Mapping[str, str],
    cpus: frozenset[int] | None,
    timeout_s: float = 120.0,
    name: str = "radixgate",
    tenant_cap: int | None = None,
) -> Target:
    """Start ``python -m service serve`` (uvicorn, uvloop, httptools) with default settings except the
    upstream, Redis, tokenizer, model name and ``SCHEDULER__WINDOW_INITIAL=256`` (issue 10), plus
    ``extra_env``; create a tenant with finite, huge quotas (and ``max_concurrent_requests`` =
    ``tenant_cap`` when given) and return the target (``name``: radixgate, or :data:`BASELINE` for a second
    gateway with other settings) with its key."""
    port = free_port()
    admin = secrets.token_urlsafe(24)
    env = {
        **base_env(),
        "RADIXGATE_HOST": "127.0.0.1",
        "RADIXGATE_PORT": str(port),
        "RADIXGATE_ADMIN_TOKEN": admin,
        "RADIXGATE_KEY_PEPPER": secrets.token_hex(16),
        "RADIXGATE_REDIS__URL": redis_url,
        "RADIXGATE_UPSTREAM__WORKERS": json.dumps([upstream]),
        "RADIXGATE_ENGINE__SERVED_MODEL_NAME": MODEL,
        "RADIXGATE_API__TOKENIZER_PATH": str(tokenizer_dir),
        "RADIXGATE_SCHEDULER__WINDOW_INITIAL": "256",
        **extra_env,
    }
    proc = procs.spawn(name, [sys.executable, "-m", "service", "serve"], env, cpus)
    base = f"http://127.0.0.1:{port}"
    procs.wait_until(proc, name, lambda: httpx.get(f"{base}/readyz", timeout=2).status_code == 200, timeout_s)
    auth = {"Authorization": f"Bearer {admin}"}
    tenant: dict[str, Any] = {
        "id": "bench",
        "name": "bench",
        "priority_class": "standard",
        "quotas": {"requests_per_min": 1e9, "tokens_per_min": 1e12},
    }
    if tenant_cap is not None:
        tenant["max_concurrent_requests"] = tenant_cap
    httpx.post(f"{base}/admin/tenants", json=tenant, headers=auth, timeout=10).raise_for_status()
    issued = httpx.post(f"{base}/admin/tenants/bench/keys", json={"name": "bench"}, headers=auth, timeout=10)
    issued.raise_for_status()
    target = Target(
        name,
        f"{base}/v1/chat/completions",
        {"Authorization": f"Bearer {issued.json()['api_key']}"},
        [proc.pid],
        "/generate",
    )
    procs.wait_until(proc, name, lambda: _post_ok(target.url, target.headers), 30)
    return target


def router_python(peers_dir: Path) -> Path:
    """The sglang-router virtualenv's python."""
    return peers_dir / "router" / "bin" / "python"


def litellm_cli(peers_dir: Path) -> Path:
    """The LiteLLM virtualenv's ``litellm`` command."""
    return peers_dir / "litellm" / "bin" / "litellm"


def installed(name: str, peers_dir: Path) -> bool:
    """Whether target ``name`` can run here (the peers need their virtualenvs)."""
    if name == "router":
        return router_python(peers_dir).is_file()
    if name == "litellm":
        return litellm_cli(peers_dir).is_file()
    return name in TARGETS


def start_router(
    procs: Processes, peers_dir: Path, upstream: str, cpus: frozenset[int] | None, timeout_s: float = 60.0
) -> Target:
    """Start sglang-router (cache-aware policy, its defaults otherwise) in front of the fake upstream."""
    port = free_port()
    argv = [
        str(router_python(peers_dir)),
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        upstream,
        "--policy",
        "cache_aware",
        "--log-level",
        "warn",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    proc = procs.spawn("router", argv, base_env(), cpus)
    target = Target(
        "router", f"http://127.0.0.1:{port}/v1/chat/completions", {"Authorization": "Bearer bench"}
    )
    target.pids = [proc.pid]
    procs.wait_until(proc, "router", lambda: _post_ok(target.url, target.headers), timeout_s)
    return target


def start_litellm(
    procs: Processes, peers_dir: Path, upstream: str, cpus: frozenset[int] | None, timeout_s: float = 180.0
) -> Target:
    """Start the LiteLLM proxy (one worker, its defaults) with one OpenAI-compatible model on the fake
    upstream; a master key is required by the proxy, so requests carry it."""
    port = free_port()
    master = f"sk-{secrets.token_hex(16)}"
    config = procs.run_dir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: fake-key\n"
    )
    env = {**base_env(), "LITELLM_MASTER_KEY": master, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    argv = [str(litellm_cli(peers_dir)), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    proc = procs.spawn("litellm", argv, env, cpus, cwd=procs.run_dir)
    target = Target(
        "litellm", f"http://127.0.0.1:{port}/v1/chat/completions", {"Authorization": f"Bearer {master}"}
    )
    target.pids = [proc.pid]
    procs.wait_until(proc, "litellm", lambda: _post_ok(target.url, target.headers), timeout_s)
    return target
