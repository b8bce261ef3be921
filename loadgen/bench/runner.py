"""One gateway benchmark run: start the processes, measure idle CPU, drive every (target, mode) with wrk,
interleaved and repeated, and reduce the runs to one result per target and mode.

Order: for each repeat, for each mode, every target in turn (the order of targets rotates with the
repeat), so slow drifts of a shared machine spread over all targets. Every target and mode first gets a
1 s warm-up run. A measured run is one wrk run of lead-in (``warmup_s``) + window (``duration_s``) + 1 s;
request counts, CPU times and Redis commands are taken over the window only, so the connections' set-up
and the requests cut off when wrk stops do not bias CPU per request or req/s.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import redis

from loadgen.bench.measure import (
    Sample,
    aggregate,
    calls_delta,
    cores_busy_s,
    counts_delta,
    goals,
    idle_cpu_ms_per_s,
    parse_cpu_busy,
    read_proc_stats,
    redis_calls,
    tree_cpu_s,
)
from loadgen.bench.profile import profile_target
from loadgen.bench.stub_tokenizer import write_stub_model
from loadgen.bench.targets import (
    BASELINE,
    TARGETS,
    BenchSetupError,
    CorePlan,
    Processes,
    Target,
    chat_body,
    default_peers_dir,
    installed,
    litellm_cli,
    plan_cores,
    router_python,
    start_fake,
    start_litellm,
    start_radixgate,
    start_redis,
    start_router,
)
from loadgen.bench.wrk import WrkResult, WrkRun, lua_script, run_wrk
from loadgen.stack import terminate_as_exit
from service.config.engine import configured_home, home_engine_paths


@dataclass(frozen=True, slots=True)
class Mode:
    """A load mode: wrk connections and whether answers are streamed."""

    connections: int
    stream: bool


MODES: dict[str, Mode] = {
    "c64": Mode(64, False),
    "c8": Mode(8, False),
    "c1": Mode(1, False),
    "stream": Mode(64, True),
}
"""Modes of issue 10: non-streamed at 64, 8 and 1 connections; streamed (``chunks`` SSE chunks) at 64."""


@dataclass(slots=True)
class BenchConfig:
    """What one benchmark run does.

    Attributes:
        targets: targets to measure (subset of :data:`loadgen.bench.targets.TARGETS`).
        modes: modes to run (keys of :data:`MODES`).
        repeats: interleaved repeats; results are medians over them.
        duration_s: length of each measured wrk run, whole seconds.
        warmup_s: unmeasured lead-in at the start of each wrk run, whole seconds; when > 0, every target
            and mode also gets one 1 s warm-up run before the first measurement.
        idle_s: window for idle CPU, s (0: skip).
        chunks: tokens per answer (= SSE chunks of a streamed one), also ``max_tokens`` of every request.
        out: folder for JSON, PNG, logs and wrk scripts.
        peers_dir: virtualenvs of sglang-router and LiteLLM.
        tokenizer: tokenizer folder for radixgate (None: the engine's model if present, else a stub).
        radixgate_env: extra ``RADIXGATE_*`` settings for radixgate.
        baseline_env: when not None, also start :data:`loadgen.bench.targets.BASELINE`, a radixgate with
            ``radixgate_env`` and these settings on top (the "before" of a change that a setting turns off).
        tenant_cap: ``max_concurrent_requests`` of radixgate's bench tenant (None: no cap; radixgate-base's
            tenant never has one).
        profile_s: if > 0, py-spy records radixgate for this long under ``profile_mode`` load after the runs.
        profile_mode: the mode (a key of :data:`MODES`) profiled.
        pin: pin processes to CPUs (when there are two or more).
        upstream_streaming: how the fake's ``/generate`` streams: ``incremental`` (each event its own
            tokens, as workers the gateway launches and the README's command run) or ``cumulative``
            (SGLang's default: each event the whole answer so far, parsed again by the gateway).
    """

    targets: list[str]
    modes: list[str]
    out: Path
    repeats: int = 3
    duration_s: int = 10
    warmup_s: int = 1
    idle_s: float = 10.0
    chunks: int = 32
    peers_dir: Path = field(default_factory=default_peers_dir)
    tokenizer: Path | None = None
    radixgate_env: dict[str, str] = field(default_factory=dict)
    baseline_env: dict[str, str] | None = None
    tenant_cap: int | None = None
    profile_s: int = 0
    profile_mode: str = "c64"
    pin: bool = True
    upstream_streaming: Literal["incremental", "cumulative"] = "incremental"


def resolve_tokenizer(cfg: BenchConfig) -> Path:
    """The tokenizer folder for radixgate: the configured one, the engine's model (SmolLM2, the default
    setting) when converted, else a word-level stub written into the run folder."""
    if cfg.tokenizer is not None:
        return cfg.tokenizer
    model = home_engine_paths(configured_home())["model_path"]  # what `make engine` converted
    if (model / "tokenizer.json").is_file():
        return model
    return write_stub_model(cfg.out / "stub-tokenizer")


def _peer_version(python: Path, dist: str) -> str | None:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    try:
        out = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError:
        return None
    return out.stdout.strip() or None


class _Snapshot:
    """CPU times, Redis command counts and fake-upstream counters at one instant."""

    def __init__(self, bench: _Bench, target: Target) -> None:
        self.t = time.monotonic()
        self.core_busy = cores_busy_s(parse_cpu_busy(Path("/proc/stat").read_text()), bench.cores.target)
        stats = read_proc_stats()
        self.target_cpu = tree_cpu_s(stats, target.pids)
        self.redis_cpu = tree_cpu_s(stats, [bench.redis_pid]) if bench.redis_pid else 0.0
        self.upstream_cpu = tree_cpu_s(stats, [bench.fake_pid])
        self.redis_calls = redis_calls(bench.redis.info("commandstats")) if bench.redis else {}
        up = bench.http.get(f"{bench.fake_url}/_bench/stats").json()
        self.upstream_requests: dict[str, int] = up["requests"]
        self.upstream_connections = int(up["connections"])


class _Bench:
    """The running processes and the measured samples of one run."""

    def __init__(self, cfg: BenchConfig, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.say = say
        self.procs = Processes(cfg.out)
        self.http = httpx.Client(timeout=10)
        self.redis: redis.Redis | None = None
        self.redis_pid = 0
        self.redis_url = ""
        self.fake_url = ""
        self.fake_pid = 0
        self.targets: list[Target] = []
        self.scripts: dict[tuple[str, str], Path] = {}
        self.samples: list[Sample] = []
        self.cores = CorePlan(None, None, None)

    def start(self) -> dict[str, Any]:
        cfg = self.cfg
        available = sorted(os.sched_getaffinity(0))
        self.cores = plan_cores(available) if cfg.pin else CorePlan(None, None, None)
        if self.cores.load:
            os.sched_setaffinity(0, self.cores.load)
        tokenizer = resolve_tokenizer(cfg)
        self.say(f"upstream: instant fake SGLang ({cfg.upstream_streaming} streaming); tokenizer {tokenizer}")
        self.fake_url, self.fake_pid = start_fake(
            self.procs, tokenizer, self.cores.aux, cfg.upstream_streaming == "incremental"
        )
        versions: dict[str, str | None] = {"python": platform.python_version()}
        for name in cfg.targets:
            t0 = time.monotonic()
            if name == "direct":
                target = Target(
                    "direct", f"{self.fake_url}/v1/chat/completions", {"Authorization": "Bearer bench"}
                )
                target.pids = [self.fake_pid]
            elif name in ("radixgate", BASELINE):
                if not self.redis_url:
                    self.redis_url, self.redis_pid = start_redis(self.procs, self.cores.aux)
                    self.redis = redis.Redis.from_url(self.redis_url, decode_responses=True)
                env = dict(cfg.radixgate_env)
                if name == BASELINE:  # its own keys in the shared Redis
                    env |= {"RADIXGATE_REDIS__KEY_PREFIX": "rgbase:", **(cfg.baseline_env or {})}
                cap = cfg.tenant_cap if name == "radixgate" else None
                target = start_radixgate(
                    self.procs,
                    self.fake_url,
                    self.redis_url,
                    tokenizer,
                    env,
                    self.cores.target,
                    name=name,
                    tenant_cap=cap,
                )
            elif name == "router":
                target = start_router(self.procs, cfg.peers_dir, self.fake_url, self.cores.target)
                versions["sglang-router"] = _peer_version(router_python(cfg.peers_dir), "sglang-router")
            elif name == "litellm":
                target = start_litellm(self.procs, cfg.peers_dir, self.fake_url, self.cores.target)
                python = litellm_cli(cfg.peers_dir).parent / "python"
                versions["litellm"] = _peer_version(python, "litellm")
            else:
                raise BenchSetupError(f"unknown target {name!r}")
            self.say(f"{name} ready in {time.monotonic() - t0:.1f} s at {target.url}")
            self.targets.append(target)
            for mode_name in cfg.modes:
                mode = MODES[mode_name]
                script = cfg.out / "wrk" / f"{name}-{mode_name}.lua"
                script.parent.mkdir(parents=True, exist_ok=True)
                body = json.dumps(chat_body(cfg.chunks, mode.stream), separators=(",", ":"))
                script.write_text(lua_script(body, {"Content-Type": "application/json", **target.headers}))
                self.scripts[(name, mode_name)] = script
        return {
            "cpus": available,
            "pinning": {k: sorted(v) if v else None for k, v in asdict(self.cores).items()},
            "tokenizer": str(tokenizer),
            "versions": versions,
            "radixgate_env": cfg.radixgate_env,
            "baseline_env": cfg.baseline_env,
            "tenant_cap": cfg.tenant_cap,
        }

    def idle(self) -> dict[str, float | None]:
        """CPU each target (and Redis, the fake upstream) burns while nothing is sent, ms per second."""
        stats = read_proc_stats()
        before = {t.name: tree_cpu_s(stats, t.pids) for t in self.targets}
        extra = {"redis": [self.redis_pid] if self.redis_pid else [], "upstream": [self.fake_pid]}
        before |= {k: tree_cpu_s(stats, pids) for k, pids in extra.items()}
        t0 = time.monotonic()
        time.sleep(self.cfg.idle_s)
        wall = time.monotonic() - t0
        stats = read_proc_stats()
        after = {t.name: tree_cpu_s(stats, t.pids) for t in self.targets}
        after |= {k: tree_cpu_s(stats, pids) for k, pids in extra.items()}
        return {k: idle_cpu_ms_per_s(before[k], after[k], wall) for k in before}

    def load(self, target: Target, mode_name: str, duration_s: int) -> WrkResult:
        """Run wrk on ``target`` in ``mode_name`` for ``duration_s`` and return its summary."""
        mode = MODES[mode_name]
        script = self.scripts[(target.name, mode_name)]
        return run_wrk(target.url, script, mode.connections, duration_s, self.cores.load)

    def settle(self, target: Target, timeout_s: float = 30.0) -> float:
        """Wait until ``target`` stops calling the upstream and burning CPU (a slow target keeps working on
        requests wrk gave up on, which would run into the next target's window on the same core).

        Returns:
            Seconds waited.
        """
        t0 = time.monotonic()
        last: tuple[int, float] | None = None
        while time.monotonic() - t0 < timeout_s:
            served = self.http.get(f"{self.fake_url}/_bench/stats").json()["requests"]
            now = (int(served.get(target.upstream_route, 0)), tree_cpu_s(read_proc_stats(), target.pids))
            if last is not None and now[0] == last[0] and now[1] - last[1] <= 0.02:
                break
            last = now
            time.sleep(0.25)
        return time.monotonic() - t0

    def measure(self, target: Target, mode_name: str, repeat: int) -> Sample:
        """One run: wrk for lead-in + window + 1 s; counts and CPU over the window only."""
        cfg = self.cfg
        mode = MODES[mode_name]
        script = self.scripts[(target.name, mode_name)]
        run = WrkRun(target.url, script, mode.connections, cfg.warmup_s + cfg.duration_s + 1, self.cores.load)
        try:
            time.sleep(cfg.warmup_s)
            before = _Snapshot(self, target)
            time.sleep(cfg.duration_s)
            after = _Snapshot(self, target)
            result = run.result()
        finally:
            run.stop()
        self.settle(target)
        radixgate = target.name in ("radixgate", BASELINE)
        upstream = counts_delta(before.upstream_requests, after.upstream_requests, ["/_bench/stats"])
        core_busy = None
        if before.core_busy is not None and after.core_busy is not None:
            core_busy = after.core_busy - before.core_busy
        sample = Sample(
            target=target.name,
            mode=mode_name,
            repeat=repeat,
            requests=upstream.get(target.upstream_route, 0),
            duration_s=after.t - before.t,
            errors=result.error_count,
            p50_ms=result.latency_ms["p50"],
            p99_ms=result.latency_ms["p99"],
            target_cpu_s=after.target_cpu - before.target_cpu,
            wrk_requests=result.requests,
            wrk_duration_s=result.duration_s,
            error_kinds={k: v for k, v in result.errors.items() if v},
            redis_cpu_s=after.redis_cpu - before.redis_cpu if radixgate else 0.0,
            upstream_cpu_s=after.upstream_cpu - before.upstream_cpu,
            target_core_busy_s=core_busy,
            redis_commands=calls_delta(before.redis_calls, after.redis_calls) if radixgate else {},
            upstream_requests=upstream,
            upstream_connections=after.upstream_connections - before.upstream_connections,
        )
        self.samples.append(sample)
        return sample

    def stop(self) -> None:
        self.http.close()
        if self.redis is not None:
            self.redis.close()
        self.procs.stop()


def check_targets(names: list[str], peers_dir: Path) -> list[str]:
    """Targets of ``names`` that are not installed (empty when all can run).

    Raises:
        BenchSetupError: an unknown target name.
    """
    unknown = [n for n in names if n not in (*TARGETS, BASELINE)]
    if unknown:
        raise BenchSetupError(f"unknown target(s) {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    return [n for n in names if n != BASELINE and not installed(n, peers_dir)]


def run_bench(cfg: BenchConfig, say: Callable[[str], None]) -> dict[str, Any]:
    """Run the benchmark; returns the report (``config``, ``machine``, ``idle_cpu_ms_per_s``, ``samples``,
    ``results``, ``goals``, ``profile``). Processes are stopped whatever happens, SIGTERM and SIGHUP
    included (:func:`loadgen.stack.terminate_as_exit`).

    Raises:
        BenchSetupError: a target did not start.
        loadgen.bench.wrk.WrkError: wrk is missing or failed.
    """
    cfg.out = cfg.out.resolve()  # children (LiteLLM) run in other folders
    cfg.out.mkdir(parents=True, exist_ok=True)
    bench = _Bench(cfg, say)
    started = time.time()
    with terminate_as_exit():
        return _run(cfg, bench, say, started)


def _run(cfg: BenchConfig, bench: _Bench, say: Callable[[str], None], started: float) -> dict[str, Any]:
    """The body of :func:`run_bench`: every phase, then the report; ``bench`` is stopped whatever happens."""
    try:
        machine = bench.start()
        idle: dict[str, float | None] = bench.idle() if cfg.idle_s > 0 else {}
        if idle:
            say("idle CPU ms/s: " + ", ".join(f"{k} {v:.2f}" for k, v in idle.items() if v is not None))
        if cfg.warmup_s > 0:
            for target in bench.targets:
                for mode_name in cfg.modes:
                    warm = bench.load(target, mode_name, 1)
                    bench.settle(target)
                    if warm.error_count:
                        say(f"[yellow]warm-up of {target.name} {mode_name}: {warm.errors}[/]")
        order = list(bench.targets)
        for repeat in range(cfg.repeats):
            rotated = order[repeat % len(order) :] + order[: repeat % len(order)]
            for mode_name in cfg.modes:
                for target in rotated:
                    s = bench.measure(target, mode_name, repeat)
                    say(
                        f"[{repeat + 1}/{cfg.repeats}] {target.name:<9} {mode_name:<6} {s.rps:9.1f} req/s  "
                        f"CPU {s.per_request_ms(s.target_cpu_s) or 0:.3f} ms/req  p50 {s.p50_ms:.2f} ms  "
                        f"p99 {s.p99_ms:.2f} ms" + (f"  ERRORS {s.error_kinds}" if s.errors else "")
                    )
        profile: dict[str, Any] | None = None
        radixgate = next((t for t in bench.targets if t.name == "radixgate"), None)
        if cfg.profile_s > 0 and radixgate is not None:
            say(f"profiling radixgate under {cfg.profile_mode} for {cfg.profile_s} s (py-spy)")
            profile = profile_target(
                radixgate.pids[0],
                cfg.out / "profile",
                cfg.profile_s,
                lambda: bench.load(radixgate, cfg.profile_mode, cfg.profile_s),
                cfg.chunks,
                mode=cfg.profile_mode,
            )
    finally:
        bench.stop()
    results = aggregate(bench.samples, cfg.chunks)
    for r in results:
        r["idle_cpu_ms_per_s"] = idle.get(r["target"])
    return {
        "config": {
            "targets": cfg.targets,
            "modes": {m: asdict(MODES[m]) for m in cfg.modes},
            "repeats": cfg.repeats,
            "duration_s": cfg.duration_s,
            "warmup_s": cfg.warmup_s,
            "idle_s": cfg.idle_s,
            "chunks": cfg.chunks,
            "upstream_streaming": cfg.upstream_streaming,
        },
        "machine": {**machine, "argv": sys.argv, "started": started, "wall_s": time.time() - started},
        "idle_cpu_ms_per_s": idle,
        "samples": [s.to_json() for s in bench.samples],
        "results": results,
        "goals": goals(results),
        "profile": profile,
    }
