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
