"""The SGLang launch command and environment built from settings, and a launched worker's lifetime (a
stand-in process instead of SGLang)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.config.settings import EngineSettings
from service.workers.launcher import WorkerProcess, build_command, build_env
from tests.support.model_stub import write_stub_model
from tests.support.servers import free_port


def flags(cmd: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, arg in enumerate(cmd):
        if arg.startswith("--"):
            nxt = cmd[i + 1] if i + 1 < len(cmd) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_cpu_worker_command_with_tensor_parallel() -> None:
    engine = EngineSettings(tp=2, dp=1, device="cpu", model_path=Path("/m"), max_running_requests=8)
    cmd = build_command(engine, 31000)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    f = flags(cmd)
    assert (f["--tp"], f["--dp"], f["--device"], f["--port"], f["--model-path"]) == (
        "2",
        "1",
        "cpu",
        "31000",
        "/m",
    )
    assert f["--dtype"] == "float32" and f["--schedule-policy"] == "fcfs"
    for flag in (
        "--enable-priority-scheduling",
        "--enable-metrics",
        "--enable-cache-report",
        "--sleep-on-idle",
        "--disable-cuda-graph",
    ):
        assert flag in f
    assert (f["--attention-backend"], f["--max-running-requests"]) == ("torch_native", "8")
    # SGLang preempts only on a priority gap greater than this (its default 10 never does for 10/5/0)
    assert f["--priority-scheduling-preemption-threshold"] == "0"


def test_gpu_worker_command_has_no_cpu_workarounds() -> None:
    engine = EngineSettings(
        tp=8, device="cuda", model_path=Path("/models/llama-70b"), extra_args=["--foo", "1"]
    )
    cmd = build_command(engine, 30000)
    f = flags(cmd)
    assert f["--tp"] == "8" and f["--device"] == "cuda" and f["--dtype"] == "auto"
    assert "--sleep-on-idle" not in f and "--attention-backend" not in f and "--disable-cuda-graph" not in f
    assert "--max-running-requests" not in f  # SGLang sizes it from the KV pool on a GPU
    assert cmd[-2:] == ["--foo", "1"]


@pytest.mark.parametrize(
    ("device", "configured", "expected"),
    [("cpu", None, "8"), ("cpu", 32, "32"), ("cuda", None, None), ("cuda", 256, "256")],
)
def test_max_running_requests_defaults_to_a_small_batch_on_cpu_only(
    device: str, configured: int | None, expected: str | None
) -> None:
    engine = EngineSettings(device=device, model_path=Path("/m"), max_running_requests=configured)
    assert flags(build_command(engine, 30000)).get("--max-running-requests") == expected


def test_env_puts_the_cpu_shim_on_the_path_only_on_cpu(tmp_path: Path) -> None:
    cpu = build_env(EngineSettings(device="cpu", tp=2, cpu_shim_path=tmp_path), base={"PYTHONPATH": "/x"})
    assert cpu["SGLANG_USE_CPU_ENGINE"] == "1" and cpu["HF_HUB_OFFLINE"] == "1"
    assert cpu["PYTHONPATH"].split(":") == [str(tmp_path), "/x"]
    assert cpu["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1  # one core set per TP rank
    gpu = build_env(EngineSettings(device="cuda", cpu_shim_path=tmp_path), base={})
    assert "SGLANG_USE_CPU_ENGINE" not in gpu and "PYTHONPATH" not in gpu


LAUNCHING_PARENT = """
import sys, time
from pathlib import Path
from service.config.settings import EngineSettings
from service.workers.launcher import WorkerProcess
worker = WorkerProcess(EngineSettings(python=Path(sys.argv[1])), 39999)
worker.start()
print("PID", worker.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_launched_worker_dies_with_the_gateway(tmp_path: Path) -> None:
    # a gateway killed while its workers run (SIGKILL after a stop timeout, OOM, a crash) must not leave
    # them holding the accelerator: workers run in their own session, so only the kernel can tell them
    fake_engine = tmp_path / "python"
    fake_engine.write_text("#!/bin/sh\nexec sleep 600\n")
    fake_engine.chmod(0o755)
    parent = subprocess.Popen(
        [sys.executable, "-c", LAUNCHING_PARENT, str(fake_engine)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    line = ""
    while not line.startswith("PID "):  # after the launcher's log line
        line = parent.stdout.readline()
        if not line:
            parent.kill()
            raise AssertionError("the launching process ended")
    worker_pid = int(line.split()[1])
    try:
        os.kill(worker_pid, 0)  # running
        parent.kill()
        parent.wait(timeout=10)
        assert_gone(worker_pid, "the worker outlived the gateway that launched it")
    finally:
        parent.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker_pid, signal.SIGKILL)


def assert_gone(pid: int, why: str, within_s: float = 10.0) -> None:
    """Wait until process ``pid`` has exited (gone, or a zombie); fail with ``why`` after ``within_s``."""
    deadline = time.monotonic() + within_s
    while Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_gateway_waits_for_its_worker_stops_both_at_once(
    tmp_path: Path, redis_url: str, sig: signal.Signals
) -> None:
    # loading a model takes minutes; uvicorn looks at SIGTERM/SIGINT only after start-up, so `docker stop`
    # or Ctrl-C used to wait out engine.startup_timeout_s (300 s by default)
    fake_engine = tmp_path / "python"
    fake_engine.write_text("#!/bin/sh\nexec sleep 600\n")
    fake_engine.chmod(0o755)
    env = {
        **os.environ,
        "RADIXGATE_PORT": str(free_port()),
        "RADIXGATE_REDIS__URL": redis_url,
        "RADIXGATE_ENGINE__LAUNCH": "true",
        "RADIXGATE_ENGINE__PYTHON": str(fake_engine),
        "RADIXGATE_ENGINE__BASE_PORT": str(free_port()),
        "RADIXGATE_ENGINE__LOG_DIR": str(tmp_path),
        "RADIXGATE_API__TOKENIZER_PATH": str(write_stub_model(tmp_path / "model")),
    }
    gateway = subprocess.Popen(
        [sys.executable, "-m", "service", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert gateway.stdout is not None
    worker_pid = 0
    seen: list[str] = []
    try:
        for line in gateway.stdout:  # the launcher's log line names the worker's pid
            seen.append(line)
            if '"worker_starting"' in line:
                worker_pid = json.loads(line)["pid"]
                break
        assert worker_pid, f"the gateway did not launch its worker; it wrote: {''.join(seen)[-3000:]}"
        time.sleep(0.5)
        gateway.send_signal(sig)
        rest = gateway.communicate(timeout=20)[0]  # not startup_timeout_s
        assert f"{sig.name} while waiting for launched workers" in rest, rest[-3000:]
        assert_gone(worker_pid, "the launched worker outlived the interrupted start-up")
    finally:
        gateway.kill()
        if worker_pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker_pid, signal.SIGKILL)


def test_a_cpu_worker_runs_on_the_cores_it_is_given(tmp_path: Path) -> None:
    # engine.cpu_affinity keeps a CPU engine off the gateway's cores: the worker process (and what it
    # starts) may run on those cores only, and OpenMP sizes its pool to them
    last = max(os.sched_getaffinity(0))
    fake_engine = tmp_path / "python"
    fake_engine.write_text("#!/bin/sh\nexec sleep 600\n")
    fake_engine.chmod(0o755)
    worker = WorkerProcess(EngineSettings(python=fake_engine, device="cpu", cpu_affinity=[last]), free_port())
    worker.start()
    try:
        assert worker.proc is not None
        assert os.sched_getaffinity(worker.proc.pid) == {last}
        assert worker.environment()["OMP_NUM_THREADS"] == "1"
    finally:
        assert worker.proc is not None
        os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait()
    unpinned = WorkerProcess(EngineSettings(python=fake_engine, device="cpu"), free_port())
    assert unpinned.cpu_cores() is None and "OMP_NUM_THREADS" not in build_env(unpinned.engine, base={})


@pytest.mark.parametrize("cores", [[], [0, 0], [100_000], [-1], [True], ["0"]])
def test_cpu_affinity_outside_the_machine_is_refused(cores: list[object]) -> None:
    with pytest.raises(ValueError, match="cpu_affinity"):
        EngineSettings(cpu_affinity=cores)
