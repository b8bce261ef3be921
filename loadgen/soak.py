"""A soak: minutes of open-loop load past the fleet's capacity, with a worker killed and Redis restarted on a
schedule, and what the gateway's processes held over time (issue 31).

``python -m loadgen soak [--duration 600] [--load 2.0] [--json]``

The stack is local processes (as :mod:`loadgen.rolling_restart`): Redis with an append-only file fsynced on
every write (so a restart keeps every tenant, key and counter), ``python -m service serve`` with
``RADIXGATE_WORKERS`` gateway processes, and simulated SGLang workers registered over the admin API. While
streams arrive at ``load`` times the capacity measured first, spread over several tenants:

- every ``kill_every_s`` one worker in turn is killed (SIGKILL: its streams break mid-answer) and started
  again on its port ``down_s`` later;
- every ``redis_every_s`` Redis is stopped and started again ``redis_down_s`` later (``down_s`` unless
  given; minutes with ``--redis-down 120``), the gateways running the ``on_outage`` policy meanwhile;
- every ``sample_every_s`` each gateway process's resident memory (``VmRSS``) and open file descriptors are
  read from ``/proc``, and the loop's tasks from ``/metrics`` (``radixgate_event_loop_tasks``).

Each request is a stream with ``stream_options.include_usage``. It is **answered** when it ends whole (200,
every token, ``[DONE]``) or with a clean refusal (a status with an OpenAI error object: 429 from a quota,
503 from load shedding or Redis being down); anything else (a transport error, a truncated stream, an error
event, a 5xx without an error object, a 500) is **unanswered**. The **ledger** of each tenant balances when
its usage in Redis (what was charged) equals the sum of the usages its clients received (what was served);
a stream ended by an error event was sent its prompt and the tokens it received (one per chunk from the
simulated workers), which it is charged.
Slopes are least-squares fits, per minute, over the run's second half (the goal: a leak keeps rising once
caches and pools have filled) and, for memory, over all but the first ``warmup_s`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadgen.rolling_restart import (
    KEEPALIVE_EXPIRY_S,
    MODEL,
    SimWorker,
    charged,
    measure_capacity,
    sim_workers,
)
from loadgen.stack import LocalStack

GOAL_RSS_SLOPE_MB_PER_MIN = 1.0
"""The largest growth of a gateway process's resident memory that counts as flat, MB/min."""


@dataclass
class SoakFigures:
    """What one soak measured.

    Attributes:
        duration_s: how long the load ran, s; ``capacity_rps``: streams/s measured first; ``rate_rps``:
            the offered rate; ``load``: their ratio.
        sent: streams sent; ``outcomes``: count per outcome (``ok``, ``429 rate_limit_exceeded``,
            ``503 overloaded``, ...); ``unanswered``: the first 50 unanswered ones, described.
        unanswered_count: all of them.
        worker_kills, redis_restarts: the faults injected.
        rss_mb: per gateway process, its samples (s since the load began, MB); ``fds``: the same for open
            descriptors; ``tasks``: the loop's tasks summed over the processes.
        rss_slope_mb_per_min, fds_slope_per_min, tasks_slope_per_min: the largest slope over the
            processes (tasks: of the sum), over the run's second half: a leak keeps rising once the caches
            and pools have filled (in the 10-minute soak a process's RSS rose 13 MB in its first 5 minutes,
            then by 0.02 MB in the last 5); ``rss_slope_after_warmup_mb_per_min``: over all but the first
            ``warmup_s``, filling included.
        ledger: per tenant ``{"charged": {...}, "served": {...}}`` (requests, prompt and completion tokens).
    """

    duration_s: float = 0.0
    capacity_rps: float = 0.0
    rate_rps: float = 0.0
    load: float = 0.0
    sent: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    unanswered: list[str] = field(default_factory=list)
    unanswered_count: int = 0
    worker_kills: int = 0
    redis_restarts: int = 0
    rss_mb: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    fds: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    tasks: list[tuple[float, float]] = field(default_factory=list)
    rss_slope_mb_per_min: float = 0.0
    rss_slope_after_warmup_mb_per_min: float = 0.0
    fds_slope_per_min: float = 0.0
    tasks_slope_per_min: float = 0.0
    ledger: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)

    @property
    def balanced(self) -> bool:
        """Whether every tenant's charged usage equals its served usage."""
        return all(entry["charged"] == entry["served"] for entry in self.ledger.values())

    @property
    def met(self) -> bool:
        """Every request answered, every ledger balanced, memory flat (:data:`GOAL_RSS_SLOPE_MB_PER_MIN`)."""
        return (
            self.unanswered_count == 0
            and self.balanced
            and self.rss_slope_mb_per_min <= GOAL_RSS_SLOPE_MB_PER_MIN
        )


def slope_per_min(samples: list[tuple[float, float]], after_s: float) -> float:
    """Least-squares slope of ``(s, value)`` samples taken after ``after_s``, per minute (0 with fewer
    than 3)."""
    kept = [(t, v) for t, v in samples if t >= after_s]
    if len(kept) < 3:
        return 0.0
    fit = statistics.linear_regression([t for t, _ in kept], [v for _, v in kept])
    return fit.slope * 60.0


def gateway_pids(parent: int) -> list[int]:
    """The gateway's worker processes: the children of its parent (uvicorn's supervisor) that serve, not
    multiprocessing's resource tracker; the parent when it serves alone."""
    pids = []
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
            with contextlib.suppress(OSError):
                if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes():
                    pids.append(int(child))
    return pids or [parent]


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid``, MB (``VmRSS`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def open_fds(pid: int) -> int:
    """Open file descriptors of ``pid``."""
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def loop_tasks(metrics_text: str) -> float | None:
    """``radixgate_event_loop_tasks`` from a ``/metrics`` answer (None when absent)."""
    for line in metrics_text.splitlines():
        if line.startswith("radixgate_event_loop_tasks "):
            return float(line.split()[1])
    return None


async def one_stream(
    client: httpx.AsyncClient,
    key: str,
    tenant: str,
    max_tokens: int,
    figures: SoakFigures,
    served: Counter[str],
) -> None:
    """Send one stream and classify its outcome; a whole one's usage is added to ``served``
    (``<tenant>:<field>`` keys)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Soak {tenant}: say something long."}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    outcome = "ok"
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    code = orjson.loads(raw)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = None
                if code is None or resp.status_code not in (429, 503):
                    outcome = f"unanswered: status {resp.status_code}: {raw[:160]!r}"
                else:
                    outcome = f"{resp.status_code} {code}"
            else:
                done, usage, deltas = False, None, 0
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        event = orjson.loads(line[6:])
                        if "error" in event:
                            outcome = f"unanswered: error event after {deltas} tokens: {event['error']}"
                            # charged what it was sent (one token per chunk from the simulated workers)
                            served[f"{tenant}:cut"] += 1
                            served[f"{tenant}:completion_tokens"] += deltas
                            break
                        usage = event.get("usage") or usage
                        choices = event.get("choices") or ()
                        deltas += sum(1 for c in choices if c.get("delta", {}).get("content"))
                whole = done and usage is not None and usage["completion_tokens"] == max_tokens
                if outcome == "ok" and not whole:
                    outcome = f"unanswered: truncated (done={done}, usage={usage})"
                elif outcome == "ok" and usage is not None:
                    served[f"{tenant}:requests"] += 1
                    served[f"{tenant}:prompt_tokens"] += int(usage["prompt_tokens"])
                    served[f"{tenant}:prompt_each"] = int(usage["prompt_tokens"])  # one prompt per tenant
                    served[f"{tenant}:completion_tokens"] += int(usage["completion_tokens"])
    except httpx.HTTPError as exc:
        outcome = f"unanswered: transport {type(exc).__name__}: {exc}"
    if outcome.startswith("unanswered"):
        figures.unanswered_count += 1
        if len(figures.unanswered) < 50:
            figures.unanswered.append(outcome)
        outcome = "unanswered"
    figures.outcomes[outcome] = figures.outcomes.get(outcome, 0) + 1


def run_soak(
    run_dir: Path,
    tokenizer_dir: Path | None = None,
    duration_s: float = 600.0,
    load: float = 2.0,
    tenants: int = 3,
    processes: int = 2,
    workers: int = 3,
    window: int = 8,
    speed: float = 6.0,
    max_tokens: int = 16,
    kill_every_s: float = 120.0,
    redis_every_s: float = 180.0,
    down_s: float = 5.0,
    redis_down_s: float | None = None,
    on_outage: str = "closed",
    sample_every_s: float = 5.0,
    warmup_s: float = 60.0,
    log_level: str = "WARNING",
) -> SoakFigures:
    """Run the soak (see the module text) and return its figures.

    Args:
        run_dir: folder for logs and Redis files. tokenizer_dir: the gateway's tokenizer (None: default).
        duration_s: how long streams arrive, s; load: their rate as a multiple of the measured capacity.
        tenants: tenants the streams are spread over (one key each).
        processes, workers, window, speed, max_tokens: as :func:`loadgen.rolling_restart.run_rolling_restart`.
        kill_every_s, redis_every_s: the faults' periods, s (the first after one period); down_s: how long
            a killed worker or stopped Redis stays down, s; redis_down_s: how long Redis stays down, s
            (None: ``down_s``); on_outage: the gateways' ``redis.on_outage`` (``closed``, ``open``). The
            gateways' ``redis.settle_give_up_s`` is twice the outage (60 s at least), so that the settles of
            the streams in flight when Redis stops outlast it.
        sample_every_s: the period of the memory, descriptor and task samples, s; warmup_s: samples
            before this are left out of the slopes, s.
        log_level: the gateway's log level (WARNING: a line per request for minutes would be the disk's
            load, not the gateway's; INFO to study a run's requests).
    """
    figures = SoakFigures(load=load)
    env = {
        "RADIXGATE_WORKERS": str(processes),
        "RADIXGATE_ENGINE__SERVED_MODEL_NAME": MODEL,
        "RADIXGATE_UPSTREAM__WORKERS": "[]",
        "RADIXGATE_UPSTREAM__HEALTH_INTERVAL_S": "0.5",
        "RADIXGATE_SCHEDULER__WINDOW_MODE": "fixed",
        "RADIXGATE_SCHEDULER__WINDOW_INITIAL": str(window),
        "RADIXGATE_OBSERVABILITY__LOG_LEVEL": log_level,
        "RADIXGATE_REDIS__ON_OUTAGE": on_outage,
        # the settles of the streams in flight when Redis stops are retried for this long: past the
        # outage, so that they land when it is back (docs/failure-modes.md: a longer outage loses them)
        "RADIXGATE_REDIS__SETTLE_GIVE_UP_S": str(
            max(60.0, 2.0 * (down_s if redis_down_s is None else redis_down_s))
        ),
    }
    if tokenizer_dir is not None:
        env["RADIXGATE_API__TOKENIZER_PATH"] = str(tokenizer_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    persistent = ("--appendonly", "yes", "--appendfsync", "always")
    with (
        sim_workers(run_dir, workers, speed) as sims,
        LocalStack(
            run_dir,
            env=env,
            launch_workers=False,
            ready_timeout_s=60,
            require_ready=False,
            redis_args=persistent,
        ) as stack,
        stack.admin() as admin,
    ):
        for sim in sims:
            admin.post("/admin/workers", json={"url": sim.url}).raise_for_status()
        stack.wait_ready()
        large = {"requests_per_min": 1e6, "tokens_per_min": 1e9}  # finite: every request is reserved
        keys = {f"soak-{i}": stack.create_tenant(f"soak-{i}", quotas=large) for i in range(tenants)}
        probe = stack.create_tenant("capacity-probe")
        served: Counter[str] = Counter()
        assert stack.gateway is not None
        parent = stack.gateway.pid

        async def every(period_s: float, stop: asyncio.Event, fault: Callable[[int], None]) -> None:
            """``fault(n)`` (in a thread) every ``period_s``, the first after one period, until ``stop``."""
            n = 0
            due = time.monotonic() + period_s
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, due - time.monotonic()))
                if stop.is_set():
                    return
                await asyncio.to_thread(fault, n)
                n, due = n + 1, due + period_s

        def kill(n: int) -> None:
            kill_and_restart(sims[n % len(sims)], down_s)
            figures.worker_kills += 1

        def restart(_: int) -> None:
            stack.restart_redis(down_s if redis_down_s is None else redis_down_s)
            figures.redis_restarts += 1

        def sampler(start: float, stop: threading.Event) -> None:
            """In a thread of its own: the load's event loop is busy, and samples must keep their period."""
            with httpx.Client(base_url=stack.url, timeout=5) as client:
                while not stop.is_set():
                    at = round(time.monotonic() - start, 1)
                    for pid in gateway_pids(parent):
                        with contextlib.suppress(OSError):
                            figures.rss_mb.setdefault(str(pid), []).append((at, round(rss_mb(pid), 2)))
                            figures.fds.setdefault(str(pid), []).append((at, open_fds(pid)))
                    with contextlib.suppress(httpx.HTTPError):
                        tasks = loop_tasks(client.get("/metrics").text)
                        if tasks is not None:
                            figures.tasks.append((at, tasks))
                    stop.wait(sample_every_s)

        async def run() -> None:
            concurrency = window * workers * processes
            figures.capacity_rps = await measure_capacity(stack.url, probe, concurrency, 3.0, max_tokens)
            figures.rate_rps = rate = load * figures.capacity_rps
            limits = httpx.Limits(
                max_connections=1024, max_keepalive_connections=128, keepalive_expiry=KEEPALIVE_EXPIRY_S
            )
            sending_ended = asyncio.Event()
            async with httpx.AsyncClient(base_url=stack.url, timeout=120, limits=limits) as client:
                start = time.monotonic()
                side = [
                    asyncio.create_task(every(kill_every_s, sending_ended, kill)),
                    asyncio.create_task(every(redis_every_s, sending_ended, restart)),
                ]
                sampling_stop = threading.Event()
                sampling = threading.Thread(target=sampler, args=(start, sampling_stop), daemon=True)
                sampling.start()
                names = sorted(keys)
                streams: set[asyncio.Task[None]] = set()
                i = 0
                while (elapsed := time.monotonic() - start) < duration_s:
                    delay = i / rate - elapsed
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tenant = names[i % len(names)]
                    sending = one_stream(client, keys[tenant], tenant, max_tokens, figures, served)
                    task = asyncio.create_task(sending)
                    streams.add(task)
                    task.add_done_callback(streams.discard)
                    figures.sent += 1
                    i += 1
                sending_ended.set()  # no fault begins after the last arrival (one under way finishes)
                await asyncio.gather(*streams)
                figures.duration_s = round(time.monotonic() - start, 1)
                await asyncio.gather(*side)
                sampling_stop.set()
                await asyncio.to_thread(sampling.join)

        asyncio.run(run())
        deadline = time.monotonic() + 30  # settles held back by the last Redis restart land
        while True:
            for tenant in keys:
                fields = ("requests", "prompt_tokens", "completion_tokens")
                want = {f: served[f"{tenant}:{f}"] for f in fields}
                cut = served[f"{tenant}:cut"]  # streams ended by an error event: charged their prompt too
                want["requests"] += cut
                want["prompt_tokens"] += cut * served[f"{tenant}:prompt_each"]
                figures.ledger[tenant] = {"charged": charged(stack.redis_url, "rg:", tenant), "served": want}
            if figures.balanced or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    half = figures.duration_s / 2
    rss = [slope_per_min(s, half) for s in figures.rss_mb.values()]
    fds = [slope_per_min(s, half) for s in figures.fds.values()]
    figures.rss_slope_mb_per_min = round(max(rss, default=0.0), 3)
    figures.rss_slope_after_warmup_mb_per_min = round(
        max((slope_per_min(s, warmup_s) for s in figures.rss_mb.values()), default=0.0), 3
    )
    figures.fds_slope_per_min = round(max(fds, default=0.0), 3)
    figures.tasks_slope_per_min = round(slope_per_min(figures.tasks, half), 3)
    return figures


def kill_and_restart(worker: SimWorker, down_s: float) -> None:
    """SIGKILL ``worker`` (its streams break mid-answer), wait ``down_s``, start it again on its port."""
    if worker.proc is not None and worker.proc.poll() is None:
        worker.proc.kill()
        worker.proc.wait()
    time.sleep(down_s)
    worker.start()


def figures_json(figures: SoakFigures) -> dict[str, Any]:
    """The figures as JSON, with ``balanced`` and ``met`` (the samples left out: see the text form)."""
    out = asdict(figures) | {"balanced": figures.balanced, "met": figures.met}
    for name in ("rss_mb", "fds", "tasks"):
        out.pop(name)
    out["rss_mb_by_minute"] = {pid: by_minute(samples) for pid, samples in figures.rss_mb.items()}
    out["fds_by_minute"] = {pid: by_minute(samples) for pid, samples in figures.fds.items()}
    out["tasks_by_minute"] = by_minute(figures.tasks)
    return out


def by_minute(samples: list[tuple[float, float]]) -> list[float]:
    """The last sample of each whole minute since the start (the shape of a slope: a leak keeps rising, a
    cache that fills levels off)."""
    last: dict[int, float] = {}
    for at, value in samples:
        last[int(at // 60)] = value
    return [last[m] for m in sorted(last)]


def figures_text(figures: SoakFigures) -> str:
    """A few lines for a terminal or a document."""
    rss = {pid: (s[0][1], s[-1][1]) for pid, s in figures.rss_mb.items() if s}
    return "\n".join(
        [
            f"{figures.sent} streams in {figures.duration_s:.0f} s at {figures.rate_rps:.1f}/s "
            f"({figures.load:g}x the measured {figures.capacity_rps:.1f}/s); "
            f"{figures.worker_kills} worker kills, {figures.redis_restarts} Redis restarts",
            "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(figures.outcomes.items())),
            f"unanswered: {figures.unanswered_count}"
            + (f" (first: {figures.unanswered[0]})" if figures.unanswered else ""),
            "RSS per gateway process, first -> last sample (MB): "
            + ", ".join(f"{a:.0f} -> {b:.0f}" for a, b in rss.values())
            + f"; slope over the second half {figures.rss_slope_mb_per_min:+.2f} MB/min (goal <= "
            f"{GOAL_RSS_SLOPE_MB_PER_MIN}), after the warm-up "
            f"{figures.rss_slope_after_warmup_mb_per_min:+.2f}",
            f"open fds slope {figures.fds_slope_per_min:+.2f}/min; "
            f"loop tasks slope {figures.tasks_slope_per_min:+.2f}/min",
            "ledger (charged = served): "
            + ", ".join(
                f"{t} {'yes' if e['charged'] == e['served'] else 'NO'} "
                f"({e['served'].get('completion_tokens', 0)} tokens)"
                for t, e in sorted(figures.ledger.items())
            ),
        ]
    )
