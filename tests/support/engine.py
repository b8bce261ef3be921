"""The real SGLang CPU worker for end-to-end tests (engine venv and model from scripts/engine/setup.sh)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

from service.config import EngineSettings
from service.workers.launcher import WorkerProcess
from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "scripts" / "engine" / "shim"


def engine_settings(**overrides: object) -> EngineSettings:
    """Engine settings of the CPU test worker; fails loudly if the engine is not installed."""
    settings = EngineSettings.model_validate({"cpu_shim_path": str(SHIM), **overrides})
    if not settings.python.exists() or not (settings.model_path / "config.json").exists():
        raise RuntimeError(
            f"SGLang engine or model missing ({settings.python}, {settings.model_path}): "
            "run `bash scripts/engine/setup.sh` (make test does)"
        )
    return settings


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces


def processes(cmdline_contains: str) -> list[int]:
    """Pids of live processes whose command line holds ``cmdline_contains`` (read from /proc)."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [pid for pid in pids if cmdline_contains in _cmdline(pid)]


def descendants(pid: int) -> dict[int, str]:
    """Pid -> command line of every live descendant of ``pid`` (SGLang's scheduler is
    ``sglang::scheduler``, its detokenizer ``sglang::detokenizer``: they set their process titles)."""
    parents = {p: _parent(p) for p in (int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit())}
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        current = frontier.pop()
        for child, parent in parents.items():
            if parent == current and child not in found:
                found[child] = _cmdline(child)
                frontier.append(child)
    return found


@contextlib.contextmanager
def running_worker(log_dir: Path, **overrides: object) -> Iterator[WorkerProcess]:
    """Start one real SGLang worker on a free port, wait for /health, stop its process group after."""
    worker = WorkerProcess(engine_settings(**overrides), free_port(), log_path=log_dir / "worker.log")
    worker.start()
    try:
        try:
            asyncio.run(worker.wait_ready(timeout_s=600))
        except Exception as exc:
            log = (log_dir / "worker.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"worker failed to start: {exc}; log tail:\n{log}") from None
        yield worker
    finally:
        worker.stop()
