"""Where a target's CPU goes: py-spy samples it under load, and the collapsed stacks are summed into
shares by library (inclusive: a sample counts for every library on its stack) and by function.

py-spy (https://github.com/benfred/py-spy) ``record --format raw`` writes one line per distinct stack:
``frame;frame;...;leaf COUNT`` with frames ``function (file:line)``, outermost first. ``--nonblocking``
samples without pausing the target; idle threads are left out, so samples are CPU time. The raw file
also opens in https://www.speedscope.app (collapsed-stack import).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from loadgen.bench.measure import read_proc_stats, tree_cpu_s

LIBRARIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("httpx/httpcore", ("httpx/", "httpcore/", "h11/", "h2/")),
    ("redis-py", ("redis/",)),
    ("fastapi", ("fastapi/",)),
    ("starlette", ("starlette/",)),
    ("anyio", ("anyio/",)),
    ("uvicorn/httptools", ("uvicorn/", "httptools/")),
    ("pydantic", ("pydantic/", "pydantic_core/")),
    ("structlog/logging", ("structlog/", "logging/")),
    ("prometheus_client", ("prometheus_client/",)),
    ("json", ("json/",)),
    ("tokenizers/jinja2", ("tokenizers/", "jinja2/")),
    ("threading (thread-pool hops)", ("threading.py", "concurrent/futures/", "queue.py")),
    ("asyncio/uvloop", ("asyncio/", "uvloop/")),
    ("radixgate", ("service/", "tenancy/", "policies/")),
)
"""Library buckets by the file of a frame (py-spy prints paths relative to site-packages or the cwd)."""

STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("upstream client (service/workers/client.py)", ("service/workers/client.py",)),
    ("auth: key + tenant lookup (tenancy/store.py)", ("tenancy/store.py", "tenancy/keys.py")),
    ("quota scripts (tenancy/quota.py)", ("tenancy/quota.py",)),
    ("usage counters (tenancy/usage.py)", ("tenancy/usage.py",)),
    ("settle (Dispatcher._settle)", ("service/pipeline/dispatch.py::Dispatcher._settle",)),
    ("prompt render + token count (service/pipeline/prompting.py)", ("service/pipeline/prompting.py",)),
    (
        "scheduler + routing (service/pipeline/scheduler.py, policies/)",
        ("service/pipeline/scheduler.py", "policies/"),
    ),
    ("FastAPI dependency solving (fastapi/dependencies/)", ("fastapi/dependencies/",)),
    ("thread-pool hops (anyio to_thread, threading)", ("anyio/to_thread.py", "threading.py")),
    ("metrics (prometheus_client)", ("prometheus_client/",)),
    ("logs (structlog, logging)", ("structlog/", "logging/")),
)
"""Request-path stages of radixgate, by ``file`` or ``file::function`` prefix of any frame on the stack
(inclusive, so they overlap). A stage whose code moved shows 0; update the prefixes with the code."""

OWN_CODE = ("service/", "tenancy/", "policies/")
ENTRY_FRAMES = ("<module>", "serve", "main", "run")
"""Own-code frames at the base of every stack (process entry points), left out of ``inclusive_own``."""


def parse_frame(frame: str) -> tuple[str, str]:
    """Split a py-spy frame: ``"Dispatcher.complete (service/pipeline/dispatch.py:120)"`` →
    ``("Dispatcher.complete", "service/pipeline/dispatch.py")``."""
    name, _, where = frame.rpartition(" (")
    if not name:
        return frame, ""
    return name, where.rstrip(")").rsplit(":", 1)[0]


def parse_collapsed(text: str) -> list[tuple[list[tuple[str, str]], int]]:
    """Stacks (outermost frame first) and their sample counts from py-spy's raw output."""
    stacks = []
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        # --subprocesses prefixes each stack with a `process PID:"argv"` pseudo-frame (no file)
        frames = [parse_frame(f) for f in stack.split(";") if not f.startswith("process ")]
        if frames:
            stacks.append((frames, int(count)))
    return stacks


def library_of(path: str) -> str:
    """The :data:`LIBRARIES` bucket of a frame's file, or ``"other"``."""
    for name, prefixes in LIBRARIES:
        if any(path.startswith(p) or f"/{p}" in path for p in prefixes):
            return name
    return "other"


def summarize(stacks: Iterable[tuple[list[tuple[str, str]], int]], top: int = 15) -> dict[str, Any]:
    """Shares of samples (0..1).

    Returns:
        ``samples``; ``self_by_library`` (the leaf frame's library; sums to 1); ``inclusive_by_library``
        (any frame of the library on the stack; ``other`` and radixgate's process entry points left
        out); ``inclusive_by_stage`` (:data:`STAGES`); ``inclusive_own`` (radixgate functions at any
        depth, top ``top``); ``self_functions``
        (leaf functions, top ``top``).
    """
    total = 0
    self_lib: Counter[str] = Counter()
    incl_lib: Counter[str] = Counter()
    incl_own: Counter[str] = Counter()
    incl_stage: Counter[str] = Counter()
    self_fn: Counter[str] = Counter()
    for frames, count in stacks:
        total += count
        leaf_name, leaf_file = frames[-1]
        self_lib[library_of(leaf_file)] += count
        self_fn[f"{leaf_name} ({leaf_file})"] += count
        inner = [(n, f) for n, f in frames if not (f.startswith(OWN_CODE) and n in ENTRY_FRAMES)]
        for lib in {library_of(f) for _, f in inner} - {"other"}:
            incl_lib[lib] += count
        for key in {f"{n} ({f})" for n, f in inner if f.startswith(OWN_CODE)}:
            incl_own[key] += count
        keys = [f"{f}::{n}" for n, f in frames]
        for stage, prefixes in STAGES:
            if any(k.startswith(prefixes) for k in keys):
                incl_stage[stage] += count
    if total == 0:
        return {"samples": 0}

    def shares(counter: Counter[str], n: int | None = None) -> list[dict[str, Any]]:
        return [{"name": k, "share": v / total} for k, v in counter.most_common(n)]

    return {
        "samples": total,
        "self_by_library": shares(self_lib),
        "inclusive_by_library": shares(incl_lib),
        "inclusive_by_stage": shares(incl_stage),
        "inclusive_own": shares(incl_own, top),
        "self_functions": shares(self_fn, top),
    }


def py_spy_binary() -> str | None:
    """``py-spy`` next to this Python (the dev virtualenv), or on PATH."""
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.is_file() else shutil.which("py-spy")


def profile_target(
    pid: int,
    out: Path,
    duration_s: int,
    load: Callable[[], Any],
    chunks: int,
    rate_hz: int = 200,
    mode: str = "c64",
) -> dict[str, Any]:
    """Record ``pid`` (and its subprocesses) with py-spy while ``load()`` runs; returns the summary plus
    the CPU per request of that run (``cpu_ms_per_request``) and the raw file's path
    (``radixgate-<mode>.collapsed.txt``).

    ``load`` returns wrk's result (``requests`` is read from it). py-spy runs on the caller's CPUs.
    Returns ``{"error": ...}`` when py-spy is missing or fails (the benchmark's figures stand without it).
    """
    binary = py_spy_binary()
    if binary is None:
        return {"error": "py-spy is not installed (pip install py-spy; it is in radixgate's dev extras)"}
    out.mkdir(parents=True, exist_ok=True)
    raw = out / f"radixgate-{mode}.collapsed.txt"
    argv = [binary, "record", "--nonblocking", "--subprocesses", "-r", str(rate_hz), "-d", str(duration_s)]
    argv += ["-f", "raw", "-o", str(raw), "-p", str(pid)]
    cpu0 = tree_cpu_s(read_proc_stats(), [pid])
    with open(out / "py-spy.log", "wb") as log:
        spy = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        time.sleep(0.3)  # attached before the load starts
        result = load()
        try:
            spy.wait(timeout=duration_s + 30)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
    cpu1 = tree_cpu_s(read_proc_stats(), [pid])
    if spy.returncode != 0 or not raw.is_file():
        tail = (out / "py-spy.log").read_text(errors="replace")[-500:]
        return {"error": f"py-spy exited {spy.returncode}: {tail}"}
    summary = summarize(parse_collapsed(raw.read_text()))
    requests = int(getattr(result, "requests", 0))
    wall_s = float(getattr(result, "duration_s", duration_s))
    summary.update(
        {
            "raw": os.fspath(raw),
            "rps": requests / wall_s if wall_s else None,
            "cpu_ms_per_request": (cpu1 - cpu0) * 1000 / requests if requests else None,
            "chunks": chunks,
        }
    )
    return summary
