"""The benchmark's arithmetic: CPU time of process trees from ``/proc``, Redis command counts, and the
reduction of repeated runs to one figure per target and mode (medians, latency added over ``direct``).

Everything here is a pure function of its inputs (``/proc`` is read from a root folder given by the
caller), so tests feed it fixed data.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
"""Units of ``utime``/``stime`` in ``/proc/<pid>/stat`` (``USER_HZ``, 100 on Linux)."""


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The CPU fields of one ``/proc/<pid>/stat`` line (proc(5)), in clock ticks.

    Attributes:
        pid, ppid: the process and its parent.
        utime, stime: user and system time of the process itself (all its threads).
        cutime, cstime: user and system time of its children that exited and were waited for.
    """

    pid: int
    ppid: int
    utime: int
    stime: int
    cutime: int
    cstime: int

    @property
    def ticks(self) -> int:
        """Own plus reaped children's CPU time, ticks."""
        return self.utime + self.stime + self.cutime + self.cstime


def parse_proc_stat(text: str) -> ProcStat:
    """Parse one ``/proc/<pid>/stat`` line (proc(5): fields 1, 4, 14-17; the name in field 2 may hold
    spaces and parentheses, so fields are counted after its last ``)``).

    Raises:
        ValueError: not a stat line.
    """
    head, sep, rest = text.rpartition(")")
    if not sep or "(" not in head:
        raise ValueError(f"not a /proc stat line: {text[:80]!r}")
    pid = int(head.split("(", 1)[0])
    fields = rest.split()
    # fields[0] is field 3 (state): field n is fields[n - 3]
    return ProcStat(
        pid=pid,
        ppid=int(fields[1]),
        utime=int(fields[11]),
        stime=int(fields[12]),
        cutime=int(fields[13]),
        cstime=int(fields[14]),
    )


def read_proc_stats(proc_root: Path = Path("/proc")) -> dict[int, ProcStat]:
    """Every readable process under ``proc_root``, by pid (processes that vanish meanwhile are skipped)."""
    stats: dict[int, ProcStat] = {}
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stats[int(entry.name)] = parse_proc_stat((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
    return stats


def tree_pids(stats: Mapping[int, ProcStat], roots: Iterable[int]) -> set[int]:
    """The root pids that exist and all their descendants."""
    children: dict[int, list[int]] = {}
    for st in stats.values():
        children.setdefault(st.ppid, []).append(st.pid)
    found: set[int] = set()
    todo = [pid for pid in roots if pid in stats]
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found


def tree_cpu_s(stats: Mapping[int, ProcStat], roots: Iterable[int], hz: int = CLOCK_TICKS_PER_S) -> float:
    """CPU seconds used so far by the process trees under ``roots``: each live process's user + system
    time plus what its exited children left in ``cutime``/``cstime``."""
    return sum(stats[pid].ticks for pid in tree_pids(stats, roots)) / hz


def parse_cpu_busy(text: str) -> dict[int, int]:
    """Busy clock ticks per CPU from ``/proc/stat`` (proc(5): ``cpuN user nice system idle iowait irq
    softirq steal ...``; busy = all fields but idle and iowait; guest time is already in user)."""
    busy: dict[int, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        values = [int(v) for v in rest.split()]
        busy[int(name[3:])] = sum(values[:8]) - values[3] - values[4]
    return busy


def cores_busy_s(
    busy: Mapping[int, int], cores: Iterable[int] | None, hz: int = CLOCK_TICKS_PER_S
) -> float | None:
    """Busy seconds of ``cores`` in a :func:`parse_cpu_busy` snapshot; None when ``cores`` is None."""
    return None if cores is None else sum(busy.get(c, 0) for c in cores) / hz


def redis_calls(commandstats: Mapping[str, Any]) -> dict[str, int]:
    """Calls per command from redis-py's ``INFO commandstats`` (``{"cmdstat_get": {"calls": 3, ...}}``)."""
    calls: dict[str, int] = {}
    for key, value in commandstats.items():
        if key.startswith("cmdstat_") and isinstance(value, Mapping):
            calls[key.removeprefix("cmdstat_")] = int(value.get("calls", 0))
    return calls


def calls_delta(
    before: Mapping[str, int], after: Mapping[str, int], exclude: Iterable[str] = ("info",)
) -> dict[str, int]:
    """Commands run between two :func:`redis_calls` snapshots, leaving out ``exclude`` (the benchmark's own
    ``INFO``) and commands with no new call."""
    skip = set(exclude)
    out = {cmd: n - before.get(cmd, 0) for cmd, n in after.items() if cmd not in skip}
    return {cmd: n for cmd, n in sorted(out.items()) if n > 0}


def counts_delta(
    before: Mapping[str, int], after: Mapping[str, int], exclude: Iterable[str] = ()
) -> dict[str, int]:
    """Per-key increase between two counter snapshots (keys in ``exclude`` left out)."""
    skip = set(exclude)
    return {
        k: v - before.get(k, 0) for k, v in sorted(after.items()) if k not in skip and v > before.get(k, 0)
    }


@dataclass(slots=True)
class Sample:
    """One measured load run of one target in one mode.

    Counts, CPU times and Redis commands cover a measurement window inside the wrk run (after a lead-in,
    before its end), so requests cut off when wrk stops, and connection set-up, do not bias them;
    latency percentiles are wrk's over its whole run.

    Attributes:
        target, mode, repeat: what ran (repeat counts from 0).
        requests: requests the target completed in the window (the fake upstream's count of the target's
            upstream route: ``/generate`` for radixgate, ``/v1/chat/completions`` for the others).
        duration_s: wall time of the window, s.
        wrk_requests, wrk_duration_s: wrk's own count and run time (whole run).
        errors: failed requests over the whole wrk run (non-2xx, connect, read, write, timeout).
        error_kinds: the failures by kind (wrk's names: ``status`` is a non-2xx/3xx answer).
        p50_ms, p99_ms: latency percentiles of whole responses, ms.
        target_cpu_s: CPU time of the target's process tree in the window, s.
        redis_cpu_s, upstream_cpu_s: CPU time of Redis and of the fake upstream in the window, s.
        target_core_busy_s: busy time of the target's CPU(s) in the window, by anyone, s (None unpinned).
        redis_commands: Redis commands run in the window, by name.
        upstream_requests: requests the fake upstream served in the window, by path.
        upstream_connections: TCP connections the fake upstream accepted in the window.
    """

    target: str
    mode: str
    repeat: int
    requests: int
    duration_s: float
    errors: int
    p50_ms: float
    p99_ms: float
    target_cpu_s: float
    wrk_requests: int = 0
    wrk_duration_s: float = 0.0
    error_kinds: dict[str, int] = field(default_factory=dict)
    redis_cpu_s: float = 0.0
    upstream_cpu_s: float = 0.0
    target_core_busy_s: float | None = None
    redis_commands: dict[str, int] = field(default_factory=dict)
    upstream_requests: dict[str, int] = field(default_factory=dict)
    upstream_connections: int = 0

    @property
    def rps(self) -> float:
        """Completed requests per second."""
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    def per_request_ms(self, cpu_s: float) -> float | None:
        """``cpu_s`` spread over the run's requests, ms; None without requests."""
        return cpu_s * 1000.0 / self.requests if self.requests else None

    @property
    def target_cores_used(self) -> float | None:
        """The target's CPU time per second of the window (1.0 = one core busy)."""
        return self.target_cpu_s / self.duration_s if self.duration_s > 0 else None

    @property
    def others_on_target_core(self) -> float | None:
        """Share of the target's CPU(s) used by other processes in the window (other sessions on a shared
        machine); high values make req/s and latency, less so CPU per request, unreliable."""
        if self.target_core_busy_s is None or self.duration_s <= 0:
            return None
        return max(0.0, self.target_core_busy_s - self.target_cpu_s) / self.duration_s

    def to_json(self) -> dict[str, Any]:
        """Plain data, with the derived figures."""
        return {
            **asdict(self),
            "rps": self.rps,
            "target_cores_used": self.target_cores_used,
            "others_on_target_core": self.others_on_target_core,
        }


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _spread(values: Iterable[float | None]) -> list[float] | None:
    present = [v for v in values if v is not None]
    return [min(present), max(present)] if present else None


def added_latency_ms(samples: Sequence[Sample], direct: Sequence[Sample], attr: str) -> float | None:
    """Median over repeats of (target − direct) latency ``attr`` (``"p50_ms"`` or ``"p99_ms"``), pairing
    each repeat with the ``direct`` run of the same repeat (same mode); None without a direct run."""
    by_repeat = {s.repeat: s for s in direct}
    diffs = []
    for s in samples:
        base = by_repeat.get(s.repeat)
        if base is None and direct:
            base = direct[0]
        if base is not None:
            diffs.append(getattr(s, attr) - getattr(base, attr))
    return _median(diffs)


def aggregate(
    samples: Sequence[Sample], chunks: int, stream_mode: str = "stream", base_mode: str = "c64"
) -> list[dict[str, Any]]:
    """One result per (target, mode), in first-seen order: medians over repeats of the run figures.

    Args:
        samples: every measured run.
        chunks: tokens (SSE chunks) per streamed answer, for ``cpu_ms_per_chunk``.
        stream_mode, base_mode: ``cpu_ms_per_chunk`` = (CPU per request in ``stream_mode`` − CPU per request
            in ``base_mode``, non-streamed at the same concurrency and answer length) / ``chunks``.

    Returns:
        Dicts with ``target, mode, rps, cpu_ms_per_request, added_p50_ms, added_p99_ms, p50_ms, p99_ms,
        redis_commands_per_request, redis_cpu_ms_per_request, upstream_cpu_ms_per_request,
        upstream_requests_per_request, upstream_connections_per_request, target_cores_used,
        others_on_target_core, cpu_ms_per_chunk, errors, requests, repeats, rps_range,
        cpu_ms_per_request_range`` (ms and req/s; None where not measured).
    """
    groups: dict[tuple[str, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.target, s.mode), []).append(s)
    results: list[dict[str, Any]] = []
    for (target, mode), runs in groups.items():
        direct = groups.get(("direct", mode), [])
        cpu = [s.per_request_ms(s.target_cpu_s) for s in runs]
        redis_cmds = [sum(s.redis_commands.values()) / s.requests if s.requests else None for s in runs]
        up_reqs = [
            sum(v for k, v in s.upstream_requests.items() if not k.startswith("/_bench")) / s.requests
            if s.requests
            else None
            for s in runs
        ]
        commands: dict[str, float] = {}
        for s in runs:
            for cmd, n in s.redis_commands.items():
                commands[cmd] = commands.get(cmd, 0.0) + n / max(1, s.requests) / len(runs)
        results.append(
            {
                "target": target,
                "mode": mode,
                "rps": _median(s.rps for s in runs),
                "cpu_ms_per_request": _median(cpu),
                "added_p50_ms": added_latency_ms(runs, direct, "p50_ms"),
                "added_p99_ms": added_latency_ms(runs, direct, "p99_ms"),
                "p50_ms": _median(s.p50_ms for s in runs),
                "p99_ms": _median(s.p99_ms for s in runs),
                "redis_commands_per_request": _median(redis_cmds),
                "redis_commands": {k: round(v, 3) for k, v in sorted(commands.items())},
                "redis_cpu_ms_per_request": _median(s.per_request_ms(s.redis_cpu_s) for s in runs),
                "upstream_cpu_ms_per_request": _median(s.per_request_ms(s.upstream_cpu_s) for s in runs),
                "upstream_requests_per_request": _median(up_reqs),
                "upstream_connections_per_request": _median(
                    s.upstream_connections / s.requests if s.requests else None for s in runs
                ),
                "target_cores_used": _median(s.target_cores_used for s in runs),
                "others_on_target_core": _median(s.others_on_target_core for s in runs),
                "cpu_ms_per_chunk": None,
                "errors": sum(s.errors for s in runs),
                "requests": sum(s.requests for s in runs),
                "repeats": len(runs),
                "rps_range": _spread(s.rps for s in runs),
                "cpu_ms_per_request_range": _spread(cpu),
            }
        )
    by_key = {(r["target"], r["mode"]): r for r in results}
    for r in results:
        base = by_key.get((r["target"], base_mode))
        if r["mode"] != stream_mode or not base or chunks <= 0:
            continue
        if r["cpu_ms_per_request"] is not None and base["cpu_ms_per_request"] is not None:
            r["cpu_ms_per_chunk"] = (r["cpu_ms_per_request"] - base["cpu_ms_per_request"]) / chunks
    return results


def idle_cpu_ms_per_s(cpu_before_s: float, cpu_after_s: float, wall_s: float) -> float | None:
    """CPU a process tree burns while idle, ms of CPU per second of wall time; None for a zero window."""
    return (cpu_after_s - cpu_before_s) * 1000.0 / wall_s if wall_s > 0 else None


GOALS: tuple[tuple[str, str, float], ...] = (
    ("cpu_vs_router", "CPU per non-streamed request (c64) ≤ 3× the router's", 3.0),
    ("ms_per_chunk", "CPU per streamed chunk ≤ 0.02 ms", 0.02),
    ("added_p50_c1", "unloaded added latency P50 (c1) ≤ 1 ms", 1.0),
    ("added_p99_c1", "unloaded added latency P99 (c1) ≤ 3 ms", 3.0),
    ("rps_vs_litellm", "req/s (c64) ≥ 10× LiteLLM's", 10.0),
)
"""Issue 10's goals for radixgate: (key, description, bound); ``rps_vs_litellm`` is a lower bound."""


def goals(results: Sequence[Mapping[str, Any]], target: str = "radixgate") -> list[dict[str, Any]]:
    """Issue 10's goals evaluated on ``results`` (:func:`aggregate`): value, bound and whether it is met
    (None where a figure is missing, e.g. a peer not installed)."""
    by_key = {(r["target"], r["mode"]): r for r in results}

    def fig(t: str, mode: str, key: str) -> float | None:
        r = by_key.get((t, mode))
        value = r.get(key) if r else None
        return float(value) if value is not None else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    values = {
        "cpu_vs_router": ratio(
            fig(target, "c64", "cpu_ms_per_request"), fig("router", "c64", "cpu_ms_per_request")
        ),
        "ms_per_chunk": fig(target, "stream", "cpu_ms_per_chunk"),
        "added_p50_c1": fig(target, "c1", "added_p50_ms"),
        "added_p99_c1": fig(target, "c1", "added_p99_ms"),
        "rps_vs_litellm": ratio(fig(target, "c64", "rps"), fig("litellm", "c64", "rps")),
    }
    out = []
    for key, text, bound in GOALS:
        value = values[key]
        met = None if value is None else (value >= bound if key == "rps_vs_litellm" else value <= bound)
        out.append({"goal": key, "description": text, "value": value, "bound": bound, "met": met})
    return out
