"""A rolling restart under load: every gateway process and every worker restarted one at a time while a
steady stream load runs, with what the clients saw and what the quota ledger charged.

``python -m loadgen rolling-restart [--streams 1200] [--load 0.8] [--worker-drain-deadline 0.05] [--json]``

The stack is local processes: Redis and ``python -m service serve`` with ``RADIXGATE_WORKERS`` gateway
processes on one port (:class:`loadgen.stack.LocalStack`), and simulated SGLang workers
(``python -m loadgen.sim``) registered over the admin API, so that every process shares them. While the
load runs:

1. the gateway's parent gets SIGHUP: uvicorn's ``restart_all`` starts a new process, waits until it is
   serving, then sends SIGTERM to an old one (its drain: service/runtime/drain.py), one process at a time;
2. each worker in turn is drained (``POST /admin/workers/{id}/drain``, which reaches every process within
   a registry sync): it gets no new request, and the streams it still runs at the drain deadline
   (``upstream.worker_drain_deadline_s``, 0.05 s here: shorter than a stream, so that the streams running
   at each drain resume on another worker mid-stream, the path under test) move to another worker; once it
   has run nothing for longer than a sync period it is stopped with SIGTERM, started again on its port and
   made active again (``POST /admin/workers``);
3. the gateway is restarted again (SIGHUP), with the restarted workers.

Each request is a stream with ``stream_options.include_usage``; a client-visible error is any status but
200, any error event, a transport error, or a stream without ``[DONE]`` or with fewer tokens than asked
(the simulated worker never stops early: ``--eos-per-token 0``). The ledger balances when the tenant's
usage in Redis (what was charged) equals the sum of the usages the clients received (what was served).
``moved`` counts the complete streams that moved off a draining worker (the gateway's ``request`` log lines
with ``moves`` > 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis

from loadgen.stack import LocalStack, free_port
from tenancy.layout import KeyLayout

MODEL = "sim-model"
KEEPALIVE_EXPIRY_S = 2.0
"""How long the clients keep an idle connection, s: under the gateway's keep-alive timeout (5 s,
``service.runtime.http_protocol.KEEP_ALIVE_S``). httpx's default, 5 s too, races the gateway's close: a
request sent on a connection the gateway closes in the same instant fails with a reset and no answer
(``ReadError``; about 1 run in 4 of ``tests/service/runtime/test_rolling_restart.py`` saw one), as with
any HTTP/1.1 server (a client must expire idle connections before the server does)."""
SIM_PROFILE = "smollm2-135m-cpu2"


@dataclass
class RestartFigures:
    """What one rolling-restart run measured.

    Attributes:
        streams: streams sent; ``ok``: those that ended complete (200, every token, ``[DONE]``).
        errors: a line per client-visible error (status, error event, transport error, truncation).
        gateway_restarts: gateway processes replaced (from the ``gateway_ready`` log lines past the first
            ``processes``); ``worker_restarts``: workers stopped and started again.
        charged: the tenant's usage in Redis (requests, prompt_tokens, completion_tokens, errors).
        served: the same sums over what the clients received.
        capacity_rps: the fleet's capacity measured before the run (:func:`measure_capacity`), streams/s.
        load: the offered rate as a fraction of it; ``rate_rps``: that rate, streams/s.
        duration_s: how long the load ran, s; ``mean_stream_s``: mean time a complete stream took, s.
        moved: streams served whole after moving off a draining worker at its drain deadline
            (``moves`` > 0 in the gateway's ``request`` log lines); ``worker_drain_deadline_s``: that
            deadline, s; ``drain_wait_s``: the longest a worker took from its drain to running nothing, s.
        restarts_after_load: restarts (gateway or worker) that began after the last stream had ended, so
            that no load saw them: too few ``streams`` for the restarts' time (each takes seconds).
    """

    streams: int = 0
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    gateway_restarts: int = 0
    worker_restarts: int = 0
    charged: dict[str, int] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)
    capacity_rps: float = 0.0
    load: float = 0.0
    rate_rps: float = 0.0
    duration_s: float = 0.0
    mean_stream_s: float = 0.0
    moved: int = 0
    worker_drain_deadline_s: float = 0.0
    drain_wait_s: float = 0.0
    restarts_after_load: int = 0

    @property
    def balanced(self) -> bool:
        """Whether what was charged equals what was served."""
        return self.charged == self.served


class SimWorker:
    """One ``python -m loadgen.sim`` process on a fixed port, which can be restarted on it.

    Args:
        run_dir: folder for its log. port: its port. speed: simulated seconds per wall second.
    """

    def __init__(self, run_dir: Path, port: int, speed: float) -> None:
        self.run_dir = run_dir
        self.port = port
        self.speed = speed
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30) -> None:
        """Start it and wait until ``/health`` answers 200.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout_s``.
        """
        self.starts += 1
        argv = [sys.executable, "-m", "loadgen.sim", "--profile", SIM_PROFILE, "--port", str(self.port)]
        argv += ["--speed", str(self.speed), "--model-name", MODEL, "--seed", str(self.starts)]
        with open(self.run_dir / f"sim-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"simulated worker on {self.port} exited with {self.proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"simulated worker on {self.port} not healthy in {timeout_s} s")

    def live_requests(self) -> int:
        """Requests the simulated engine holds now (``/sim/state``)."""
        return int(httpx.get(f"{self.url}/sim/state", timeout=5).json()["live_requests"])

    def stop(self) -> None:
        """SIGTERM, then wait (SIGKILL after 10 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def sim_workers(run_dir: Path, count: int, speed: float) -> Iterator[list[SimWorker]]:
    """``count`` started simulated workers, stopped on exit."""
    workers = [SimWorker(run_dir, free_port(), speed) for _ in range(count)]
    try:
        for worker in workers:
            worker.start()
        yield workers
    finally:
        for worker in workers:
            worker.stop()


async def one_stream(
    client: httpx.AsyncClient, key: str, max_tokens: int, figures: RestartFigures, times: list[float]
) -> None:
    """Send one stream and check it whole; its usage is added to ``figures.served``."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something about rolling restarts."}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    tokens = 0
    usage: dict[str, Any] | None = None
    done = False
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            if resp.status_code != 200:
                figures.errors.append(f"status {resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    continue
                event = orjson.loads(data)
                if "error" in event:
                    figures.errors.append(f"error event: {event['error']}")
                    return
                if event.get("usage"):
                    usage = event["usage"]
                tokens += sum(
                    1 for choice in event.get("choices", ()) if choice.get("delta", {}).get("content")
                )
    except httpx.HTTPError as exc:
        figures.errors.append(f"transport: {type(exc).__name__}: {exc}")
        return
    if not done or usage is None or usage["completion_tokens"] != max_tokens:
        figures.errors.append(f"truncated: done={done} usage={usage} content chunks={tokens}")
        return
    figures.ok += 1
    times.append(time.monotonic() - t0)
    for name in ("prompt_tokens", "completion_tokens"):
        figures.served[name] = figures.served.get(name, 0) + int(usage[name])
    figures.served["requests"] = figures.served.get("requests", 0) + 1


async def offer_load(
    base: str, key: str, streams: int, rate_rps: float, max_tokens: int, figures: RestartFigures
) -> list[float]:
    """Open-loop arrivals at ``rate_rps`` (evenly spaced) until ``streams`` were sent; returns the stream
    times of the complete ones, s."""
    times: list[float] = []
    limits = httpx.Limits(
        max_connections=256, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_EXPIRY_S
    )
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        tasks = []
        start = time.monotonic()
        for i in range(streams):
            delay = start + i / rate_rps - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_stream(client, key, max_tokens, figures, times)))
            figures.streams += 1
        await asyncio.gather(*tasks)
        figures.duration_s = time.monotonic() - start
    return times


async def measure_capacity(base: str, key: str, concurrency: int, seconds: float, max_tokens: int) -> float:
    """The fleet's capacity, streams/s: ``concurrency`` clients (the windows' sum, so every window is
    full and nothing queues) each sending one stream after another for ``seconds``; completions per
    second."""
    figures = RestartFigures()
    times: list[float] = []
    limits = httpx.Limits(
        max_connections=concurrency,
        max_keepalive_connections=concurrency,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        end = time.monotonic() + seconds

        async def loop() -> None:
            while time.monotonic() < end:
                await one_stream(client, key, max_tokens, figures, times)

        start = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        elapsed = time.monotonic() - start
    if figures.errors:
        raise RuntimeError(f"capacity probe saw errors: {figures.errors[:3]}")
    return figures.ok / elapsed


def restart_gateway(stack: LocalStack, processes: int, before: int, timeout_s: float = 60) -> int:
    """SIGHUP to the gateway's parent; waits until ``processes`` new processes logged ``gateway_ready``
    and the old ones exited (uvicorn's ``restart_all`` replaces them one at a time); returns how many
    ``gateway_ready`` lines the log then has."""
    assert stack.gateway is not None
    stack.gateway.send_signal(signal.SIGHUP)
    want = before + processes
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            len(ready_lines(stack.run_dir / "gateway.log")) >= want
            and drains_finished(stack) >= want - processes
        ):
            return want
        time.sleep(0.1)
    raise RuntimeError(f"gateway restart not finished in {timeout_s} s")


def ready_lines(log: Path) -> list[dict[str, Any]]:
    """The ``gateway_ready`` lines of the gateway's log."""
    return [line for line in log_lines(log) if line.get("event") == "gateway_ready"]


def drains_finished(stack: LocalStack) -> int:
    """How many gateway processes logged ``drain_finished``."""
    return sum(
        1 for line in log_lines(stack.run_dir / "gateway.log") if line.get("event") == "drain_finished"
    )


def log_lines(log: Path) -> list[dict[str, Any]]:
    """The JSON lines of a log."""
    lines = []
    for text in log.read_text(errors="replace").splitlines():
        if text.startswith("{"):
            with contextlib.suppress(ValueError):
                lines.append(json.loads(text))
    return lines


def restart_worker(admin: httpx.Client, worker: SimWorker, sync_s: float, timeout_s: float = 60) -> float:
    """Drain ``worker`` for every gateway process, wait until it has run nothing for longer than a
    registry sync (``sync_s``: a process that had not seen the drain yet could still send it a request),
    stop it, start it again on its port and make it active again. Returns how long it took from the drain
    to running nothing, s.

    Raises:
        RuntimeError: it still ran requests ``timeout_s`` after its drain.
    """
    wid = next(w["id"] for w in admin.get("/admin/workers").json()["data"] if w["url"] == worker.url)
    admin.post(f"/admin/workers/{wid}/drain").raise_for_status()
    drained = time.monotonic()
    deadline = drained + timeout_s
    quiet_since = None
    while True:
        if worker.live_requests() == 0:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 3 * sync_s:
                break
        else:
            quiet_since = None
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {worker.url} still busy {timeout_s} s after its drain")
        time.sleep(0.02)
    worker.stop()
    worker.start()
    admin.post("/admin/workers", json={"url": worker.url}).raise_for_status()
    return (quiet_since or drained) - drained


def moved_streams(log: Path, tenant: str) -> int:
    """``tenant``'s requests answered 200 that moved off a draining worker (``moves`` > 0 in the
    gateway's ``request`` log lines)."""
    return sum(
        1
        for line in log_lines(log)
        if line.get("event") == "request"
        and line.get("tenant") == tenant
        and line.get("status") == 200
        and int(line.get("moves") or 0) > 0
    )


def charged(redis_url: str, prefix: str, tenant: str) -> dict[str, int]:
    """The tenant's usage as Redis holds it (requests, prompt and completion tokens, errors)."""
    raw = redis.Redis.from_url(redis_url, decode_responses=True).hgetall(KeyLayout(prefix).usage(tenant))
    return {name: int(raw.get(name, 0)) for name in ("requests", "prompt_tokens", "completion_tokens")}


def run_rolling_restart(
    run_dir: Path,
    tokenizer_dir: Path | None = None,
    streams: int = 1200,
    load: float = 0.8,
    max_tokens: int = 16,
    processes: int = 2,
    workers: int = 3,
    window: int = 8,
    speed: float = 6.0,
    worker_drain_deadline_s: float = 0.05,
) -> RestartFigures:
    """Run the load, restart everything one at a time during it, and measure (see the module text).

    Args:
        run_dir: folder for the logs. tokenizer_dir: the gateway's tokenizer folder (None: its default).
        streams: how many streams; load: their arrival rate as a fraction of the capacity measured
            first (:func:`measure_capacity`); max_tokens: tokens each.
        processes: gateway processes (``RADIXGATE_WORKERS``); workers: simulated workers.
        window: requests each gateway process admits to each worker at once (fixed window).
        speed: the simulated workers' speed (simulated seconds per wall second).
        worker_drain_deadline_s: ``upstream.worker_drain_deadline_s`` of the gateway, s.
    """
    figures = RestartFigures(load=load, worker_drain_deadline_s=worker_drain_deadline_s)
    sync_s = 0.5  # upstream.health_interval_s: also the period of the registry sync
    env = {
        "RADIXGATE_WORKERS": str(processes),
        "RADIXGATE_ENGINE__SERVED_MODEL_NAME": MODEL,
        "RADIXGATE_UPSTREAM__WORKERS": "[]",
        "RADIXGATE_UPSTREAM__HEALTH_INTERVAL_S": str(sync_s),
        "RADIXGATE_UPSTREAM__WORKER_DRAIN_DEADLINE_S": str(worker_drain_deadline_s),
        "RADIXGATE_SCHEDULER__WINDOW_MODE": "fixed",
        "RADIXGATE_SCHEDULER__WINDOW_INITIAL": str(window),
        "RADIXGATE_SHUTDOWN__DRAIN_TIMEOUT_S": "20",
    }
    if tokenizer_dir is not None:
        env["RADIXGATE_API__TOKENIZER_PATH"] = str(tokenizer_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with (
        sim_workers(run_dir, workers, speed) as sims,
        LocalStack(run_dir, env=env, launch_workers=False, ready_timeout_s=60, require_ready=False) as stack,
        stack.admin() as admin,
    ):
        for sim in sims:
            admin.post("/admin/workers", json={"url": sim.url}).raise_for_status()
        stack.wait_ready()
        key = stack.create_tenant("restarts")
        probe_key = stack.create_tenant("capacity-probe")
        log = stack.run_dir / "gateway.log"
        first = len(ready_lines(log))

        async def run() -> list[float]:
            concurrency = window * workers * processes
            figures.capacity_rps = await measure_capacity(stack.url, probe_key, concurrency, 3.0, max_tokens)
            figures.rate_rps = rate_rps = load * figures.capacity_rps
            offered = offer_load(stack.url, key, streams, rate_rps, max_tokens, figures)
            load_task = asyncio.create_task(offered)
            total = streams / rate_rps
            await asyncio.sleep(total * 0.15)
            figures.restarts_after_load += load_task.done()
            ready = await asyncio.to_thread(restart_gateway, stack, processes, first)
            for sim in sims:
                figures.restarts_after_load += load_task.done()
                waited = await asyncio.to_thread(restart_worker, admin, sim, sync_s)
                figures.drain_wait_s = max(figures.drain_wait_s, round(waited, 3))
                figures.worker_restarts += 1
            figures.restarts_after_load += load_task.done()
            await asyncio.to_thread(restart_gateway, stack, processes, ready)
            return await load_task

        times = asyncio.run(run())
        figures.gateway_restarts = len(ready_lines(log)) - first
        time.sleep(1.0)  # the last settles (each lands right after its answer)
        figures.charged = charged(stack.redis_url, "rg:", "restarts")
        figures.moved = moved_streams(log, "restarts")
    figures.mean_stream_s = sum(times) / len(times) if times else 0.0
    return figures


def figures_json(figures: RestartFigures) -> dict[str, Any]:
    """The figures as JSON, with ``balanced``."""
    return asdict(figures) | {"balanced": figures.balanced}
