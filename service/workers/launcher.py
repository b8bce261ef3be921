"""Launching and stopping SGLang workers as child processes.

The command is built from :class:`service.config.settings.EngineSettings`:
``<engine python> -m sglang.launch_server --model-path ... --tp N --dp N --device cpu|cuda
--enable-priority-scheduling --enable-metrics --enable-cache-report --schedule-policy P --port ...``
plus ``--incremental-streaming-output`` (``engine.incremental_streaming``, on by default)
plus, on CPU, ``--attention-backend torch_native --disable-cuda-graph --sleep-on-idle`` and the
environment SGLang's CPU path needs (``SGLANG_USE_CPU_ENGINE=1``, the ``sgl_kernel`` stand-in on
``PYTHONPATH``; see scripts/engine/README.md). Each worker gets its own process group so that stopping
it also stops the scheduler and detokenizer processes it forks, and (on Linux) is sent SIGTERM by the
kernel when the gateway dies without stopping it (``prctl(PR_SET_PDEATHSIG)``, prctl(2)): SGLang then takes
its own process tree down.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import httpx
import structlog

from service.config.settings import EngineSettings

log = structlog.get_logger("radixgate.launcher")

_PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal a process gets when the thread that forked it ends (linux/prctl.h)."""
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
"""Loaded before any fork: the child only calls into it between fork and exec."""


def _die_with_gateway() -> None:
    """Runs in the forked worker before exec: SIGTERM it when the gateway dies, even by SIGKILL."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _before_exec(cores: frozenset[int] | None) -> Callable[[], None]:
    """The forked worker's steps before exec: :func:`_die_with_gateway`, then, with ``cores``, confine it
    (and every process and thread it starts, which inherit the mask) to those CPU cores
    (sched_setaffinity(2))."""

    def run() -> None:
        _die_with_gateway()
        if cores is not None:
            os.sched_setaffinity(0, cores)

    return run


def build_command(engine: EngineSettings, port: int) -> list[str]:
    """The ``sglang.launch_server`` argv for one worker listening on ``port``."""
    dtype = engine.dtype
    if dtype == "auto" and engine.device == "cpu":
        dtype = "float32"  # bf16 is slower and less exact on CPU (shared/notes/sglang-on-cpu.md)
    cmd = [
        str(engine.python),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(engine.model_path),
        "--served-model-name",
        engine.served_model_name,
        "--host",
        engine.host,
        "--port",
        str(port),
        "--tp",
        str(engine.tp),
        "--dp",
        str(engine.dp),
        "--device",
        engine.device,
        "--dtype",
        dtype,
        "--schedule-policy",
        engine.schedule_policy,
        "--enable-priority-scheduling",
        "--enable-metrics",
        "--enable-cache-report",
        # strict bands inside the engine too: SGLang preempts only when the priority gap is *greater* than
        # this (schedule_policy.py, preempt_to_schedule), 10 by default
        "--priority-scheduling-preemption-threshold",
        str(engine.priority_preemption_threshold),
    ]
    if engine.incremental_streaming:  # O(1) per streamed chunk, for the engine and the gateway
        cmd.append("--incremental-streaming-output")
    if engine.device == "cpu":
        cmd += ["--attention-backend", "torch_native", "--disable-cuda-graph", "--sleep-on-idle"]
        cmd += ["--mem-fraction-static", str(engine.mem_fraction_static or 0.05)]
    elif engine.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(engine.mem_fraction_static)]
    max_running = engine.max_running_requests
    if max_running is None and engine.device == "cpu":
        max_running = engine.cpu_max_running_requests
    if max_running is not None:
        cmd += ["--max-running-requests", str(max_running)]
    if engine.context_length is not None:
        cmd += ["--context-length", str(engine.context_length)]
    return cmd + list(engine.extra_args)


def build_env(engine: EngineSettings, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a worker process: offline hub, and on CPU the CPU engine switches."""
    env = dict(os.environ if base is None else base)
    env["HF_HUB_OFFLINE"] = "1"
    # /health answers from the HTTP process without running a 1-token generation (SGLang's default);
    # the gateway probes /health often and /health_generate rarely.
    env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if engine.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        if engine.tp > 1:
            # one OpenMP core set per TP rank: "0|1" for tp=2 on 2 cores
            cores = os.cpu_count() or 1
            per = max(1, cores // engine.tp)
            env.setdefault(
                "SGLANG_CPU_OMP_THREADS_BIND",
                "|".join(
                    f"{r * per}-{r * per + per - 1}" if per > 1 else str(r * per) for r in range(engine.tp)
                ),
            )
        if engine.cpu_affinity is not None:
            # OpenMP sizes its pool from the cores at start; more threads than cores spin against each other
            env["OMP_NUM_THREADS"] = str(len(engine.cpu_affinity))
        shim = engine.cpu_shim_path
        if shim is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), env.get("PYTHONPATH", "")) if p)
    return env


class WorkerStartError(RuntimeError):
    """A worker exited or did not become healthy in time."""


class WorkerProcess:
    """One launched SGLang worker.

    Args:
        engine: engine settings.
        port: port to listen on.
        log_path: file for the worker's stdout/stderr (None: ``engine.log_dir``/worker-<port>.log, or
            inherit when that is None too).
    """

    def __init__(self, engine: EngineSettings, port: int, log_path: Path | None = None) -> None:
        self.engine = engine
        self.port = port
        if log_path is None and engine.log_dir is not None:
            log_path = engine.log_dir / f"worker-{port}.log"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: BinaryIO | None = None

    @property
    def url(self) -> str:
        """Base URL of the worker."""
        return f"http://{self.engine.host}:{self.port}"

    def command(self) -> list[str]:
        """The argv of the worker process (:func:`build_command`)."""
        return build_command(self.engine, self.port)

    def environment(self) -> dict[str, str]:
        """The environment of the worker process (:func:`build_env`)."""
        return build_env(self.engine)

    def cpu_cores(self) -> frozenset[int] | None:
        """The cores a CPU worker is confined to (``engine.cpu_affinity``); None: not confined."""
        cores = self.engine.cpu_affinity
        return frozenset(cores) if cores is not None and self.engine.device == "cpu" else None

    @property
    def exit_code(self) -> int | None:
        """The launch_server process's exit status once it ended (negative: killed by that signal)."""
        return None if self.proc is None else self.proc.poll()

    def start(self) -> None:
        """Spawn the worker in its own process group (returns at once)."""
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - closed in stop()
        self._log_file = out
        self.proc = subprocess.Popen(
            self.command(),
            env=self.environment(),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
            # started from the event loop's thread, which lives as long as the gateway process
            # two system calls between fork and exec, no Python lock taken
            preexec_fn=_before_exec(self.cpu_cores()),
        )
        log.info("worker_starting", worker=self.url, pid=self.proc.pid, tp=self.engine.tp)

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Poll ``/health`` until 200.

        Raises:
            WorkerStartError: the process exited, or ``timeout_s`` (default from settings) passed.
        """
        deadline = time.monotonic() + (timeout_s or self.engine.startup_timeout_s)
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise WorkerStartError(f"worker on port {self.port} exited with {self.proc.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        log.info("worker_ready", worker=self.url)
                        return
                await asyncio.sleep(0.5)
        waited = timeout_s or self.engine.startup_timeout_s
        raise WorkerStartError(f"worker on port {self.port} not healthy after {waited} s")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the worker's process group, then SIGKILL whatever is left after ``grace_s``."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # children (scheduler, detokenizer) may linger
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if self._log_file is not None:
            self._log_file.close()
        log.info("worker_stopped", worker=self.url)
        self.proc = None
