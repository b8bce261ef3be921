"""The SGLang launch command and environment built from settings (no process started here)."""

from __future__ import annotations

from pathlib import Path

from service.config import EngineSettings
from service.workers.launcher import build_command, build_env


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


def test_gpu_worker_command_has_no_cpu_workarounds() -> None:
    engine = EngineSettings(
        tp=8, device="cuda", model_path=Path("/models/llama-70b"), extra_args=["--foo", "1"]
    )
    cmd = build_command(engine, 30000)
    f = flags(cmd)
    assert f["--tp"] == "8" and f["--device"] == "cuda" and f["--dtype"] == "auto"
    assert "--sleep-on-idle" not in f and "--attention-backend" not in f and "--disable-cuda-graph" not in f
    assert cmd[-2:] == ["--foo", "1"]


def test_env_puts_the_cpu_shim_on_the_path_only_on_cpu(tmp_path: Path) -> None:
    cpu = build_env(EngineSettings(device="cpu", tp=2, cpu_shim_path=tmp_path), base={"PYTHONPATH": "/x"})
    assert cpu["SGLANG_USE_CPU_ENGINE"] == "1" and cpu["HF_HUB_OFFLINE"] == "1"
    assert cpu["PYTHONPATH"].split(":") == [str(tmp_path), "/x"]
    assert cpu["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1  # one core set per TP rank
    gpu = build_env(EngineSettings(device="cuda", cpu_shim_path=tmp_path), base={})
    assert "SGLANG_USE_CPU_ENGINE" not in gpu and "PYTHONPATH" not in gpu
