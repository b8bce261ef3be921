"""The real SGLang CPU worker for end-to-end tests (engine venv and model from scripts/engine/setup.sh, under
the ``home`` setting: ``RADIXGATE_HOME``, default ``~/.cache/radixgate``)."""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

from service.config.settings import EngineSettings, Settings, configured_home
from service.workers.launcher import WorkerProcess
from tests.support.paths import REPO
from tests.support.servers import free_port

ROOT = REPO
SHIM = ROOT / "scripts" / "engine" / "shim"


def engine_home() -> str:
    """The ``home`` setting as the gateway reads it (``RADIXGATE_HOME``): what ``make engine`` built is
    there; a test gateway's settings name it, so its tokenizer (engine.model_path) is found there too."""
    return str(configured_home())


def engine_settings(**overrides: object) -> EngineSettings:
    """Engine settings of the CPU test worker, paths under :func:`engine_home` unless ``overrides`` name
    them; fails loudly if the engine is not installed."""
    tree = {"home": engine_home(), "engine": {"cpu_shim_path": str(SHIM), **overrides}}
    settings = Settings.model_validate(tree).engine
    if not settings.python.exists() or not (settings.model_path / "config.json").exists():
        raise RuntimeError(
            f"SGLang engine or model missing ({settings.python}, {settings.model_path}): "
            "run `bash scripts/engine/setup.sh` (make test does; both follow RADIXGATE_HOME)"
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


START_TIMEOUT_S = 240.0
"""Longest one start may take before it is tried again, s (20-47 s measured on 2 cores:
shared/notes/sglang-on-cpu.md)."""


def _log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(no log: {exc})"


def start_worker(
    log_path: Path,
    port: int | None = None,
    *,
    attempts: int = 2,
    timeout_s: float = START_TIMEOUT_S,
    **overrides: object,
) -> WorkerProcess:
    """Start one real SGLang worker and wait for its /health; returns it running.

    A start that exits or is not healthy within ``timeout_s`` is stopped and tried again, up to ``attempts``
    times in all (on a fresh port when ``port`` is None). Each failed try is reported as a warning with the
    tail of its log, so a CI run shows why (one clean-clone CI run once waited 600 s on a worker that never
    became healthy, and its log was lost with the runner).

    Raises:
        RuntimeError: no try became healthy; the message holds each try's log tail.
    """
    failures: list[str] = []
    for attempt in range(1, attempts + 1):
        path = (
            log_path.with_name(f"{log_path.stem}.try{attempt}{log_path.suffix}") if attempt > 1 else log_path
        )
        worker = WorkerProcess(engine_settings(**overrides), port or free_port(), log_path=path)
        worker.start()
        try:
            asyncio.run(worker.wait_ready(timeout_s=timeout_s))
        except Exception as exc:
            worker.stop()
            failures.append(f"try {attempt}: {exc}; log tail:\n{_log_tail(path)}")
            warnings.warn(f"SGLang worker start failed, {failures[-1]}", stacklevel=2)
            continue
        return worker
    raise RuntimeError("worker failed to start:\n" + "\n".join(failures))


@contextlib.contextmanager
def running_worker(log_dir: Path, **overrides: object) -> Iterator[WorkerProcess]:
    """Start one real SGLang worker on a free port (:func:`start_worker`), stop its process group after."""
    worker = start_worker(log_dir / "worker.log", **overrides)
    try:
        yield worker
    finally:
        worker.stop()
