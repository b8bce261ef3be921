"""How much of each request's TTFT the gateway's named phases explain, under load against simulated workers.

``python -m loadgen breakdown-share [--load 0.8] [--duration-s 25] [--json]``

The gateway logs one ``request`` line per request with ``ttft_ms`` and ``phases_ms``
(``service/observability/breakdown.py``): the gateway's own steps (``auth``, ``prepare``, ``quota``,
``route``, ``queue``, ``retry``, ``upstream_connect``) and the engine's, from the worker's
``--enable-metrics`` ``meta_info`` (``engine_tokenize``, ``engine_queue``, ``engine_prefill``). Each is
measured, none is a remainder, so for one request ``share = sum(phases up to the first token) / ttft``;
what is left is time nothing names (the loopback network both ways, the worker's output path, the event
loops' turns between steps).

The run: Redis and a gateway process (:class:`loadgen.stack.LocalStack`) in front of simulated SGLang
workers (``python -m loadgen.sim``, the CPU profile at ``--speed 1`` so that the simulated times are the
wall clock's), registered over the admin API; the fleet's capacity measured closed-loop with every window
full (:func:`loadgen.rolling_restart.measure_capacity`); then streams arrive as a Poisson process at
``load`` x that capacity for ``duration_s``. The summary is over the served streams: the share at P50 and
the share that 99 % of requests reach (P99, the low tail), the unexplained milliseconds, and each phase's
mean. The goal (issue 28): P50 >= 0.95 and P99 >= 0.90.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadgen.latency_breakdown import read_request_lines
from loadgen.rolling_restart import MODEL, measure_capacity, sim_workers
from loadgen.stack import CPU_PRIORITY_CLASSES, LocalStack

TTFT_PHASES = (
    "auth",
    "prepare",
    "quota",
    "route",
    "queue",
    "retry",
    "upstream_connect",
    "engine_tokenize",
    "engine_queue",
    "engine_prefill",
)
"""The phases that end by a stream's first token (``service.observability.breakdown.TTFT_PHASES``; loadgen
does not import the gateway's code, a test holds the two equal)."""

GOAL_P50 = 0.95
GOAL_P99 = 0.90
SYSTEM = "You are the assistant of a load test of radixgate's latency breakdown. Answer in a few words. "


def ttft_share(entry: Mapping[str, Any]) -> float | None:
    """The share of one ``request`` log line's TTFT that its phases up to the first token add up to; None
    for a request not served (status not 200) or without a TTFT above 0 or its ``phases_ms``."""
    ttft = entry.get("ttft_ms")
    phases = entry.get("phases_ms")
    if entry.get("status") != 200 or not isinstance(ttft, int | float) or ttft <= 0:
        return None
    if not isinstance(phases, Mapping):
        return None
    return sum(float(phases.get(name, 0.0)) for name in TTFT_PHASES) / float(ttft)


def _rank(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (sorted ascending); NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class ShareSummary:
    """What the named phases explain, over the served requests.

    Attributes:
        requests: served requests with a TTFT and phases.
        share_p50: the median share of a request's TTFT its phases add up to.
        share_p99: the share that 99 % of the requests reach or pass (the 1st percentile).
        share_min: the lowest share.
        tail_share_p50: the median share among the requests whose TTFT is at or above the P99 TTFT.
        beyond_queue_p50, beyond_queue_p99: the same two quantiles of the share of the TTFT outside the
            gateway's queue that the other phases explain (``(named - queue) / (ttft - queue)``): a queue
            that grows under load is timed whole and lifts the plain share; this one does not.
        ttft_p50_ms, ttft_p99_ms: the TTFT's quantiles, ms.
        unexplained_p50_ms, unexplained_p99_ms: TTFT minus the named phases, ms (P99: the largest 1 %).
        phase_mean_ms: each phase's mean over the requests (0 where a request has none), ms.
        meets_goal: ``share_p50 >= 0.95`` and ``share_p99 >= 0.90``.
    """

    requests: int = 0
    share_p50: float = float("nan")
    share_p99: float = float("nan")
    share_min: float = float("nan")
    tail_share_p50: float = float("nan")
    beyond_queue_p50: float = float("nan")
    beyond_queue_p99: float = float("nan")
    ttft_p50_ms: float = float("nan")
    ttft_p99_ms: float = float("nan")
    unexplained_p50_ms: float = float("nan")
    unexplained_p99_ms: float = float("nan")
    phase_mean_ms: dict[str, float] = field(default_factory=dict)
    meets_goal: bool = False


def summarize(entries: Iterable[Mapping[str, Any]]) -> ShareSummary:
    """The :class:`ShareSummary` of ``request`` log lines (the ones :func:`ttft_share` cannot read are
    left out)."""
    rows = [(share, e) for e in entries if (share := ttft_share(e)) is not None]
    if not rows:
        return ShareSummary()
    shares = [share for share, _ in rows]
    ttfts = [float(e["ttft_ms"]) for _, e in rows]
    unexplained = [t * (1.0 - s) for s, t in zip(shares, ttfts, strict=True)]
    queued = [float(e["phases_ms"].get("queue", 0.0)) for _, e in rows]
    beyond = [1.0 - u / (t - q) for u, t, q in zip(unexplained, ttfts, queued, strict=True) if t - q > 0]
    ttft_p99 = _rank(ttfts, 0.99)
    tail = [s for s, t in zip(shares, ttfts, strict=True) if t >= ttft_p99]
    means = {
        name: sum(float(e["phases_ms"].get(name, 0.0)) for _, e in rows) / len(rows) for name in TTFT_PHASES
    }
    p50, p99 = _rank(shares, 0.5), _rank(shares, 0.01)
    return ShareSummary(
        requests=len(rows),
        share_p50=p50,
        share_p99=p99,
        share_min=min(shares),
        tail_share_p50=_rank(tail, 0.5),
        beyond_queue_p50=_rank(beyond, 0.5),
        beyond_queue_p99=_rank(beyond, 0.01),
        ttft_p50_ms=_rank(ttfts, 0.5),
        ttft_p99_ms=ttft_p99,
        unexplained_p50_ms=_rank(unexplained, 0.5),
        unexplained_p99_ms=_rank(unexplained, 0.99),
        phase_mean_ms={name: round(ms, 3) for name, ms in means.items() if ms > 0},
        meets_goal=p50 >= GOAL_P50 and p99 >= GOAL_P99,
    )


@dataclass
class ShareRun:
    """One breakdown-share run: its load and what it measured.

    Attributes:
        capacity_rps: the fleet's measured capacity, streams/s; ``load``: the offered share of it;
            ``rate_rps``: the offered rate, streams/s; ``duration_s``: how long arrivals ran, s.
        sent: streams sent; ``ok``: those answered 200 to the end; ``errors``: the first client errors.
        summary: the :class:`ShareSummary` over the served streams.
    """

    capacity_rps: float = 0.0
    load: float = 0.0
    rate_rps: float = 0.0
    duration_s: float = 0.0
    sent: int = 0
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    summary: ShareSummary = field(default_factory=ShareSummary)

    def to_json(self) -> dict[str, Any]:
        """The run as JSON (NaN summary figures as null)."""
        out = asdict(self)
        out["summary"] = {
            k: (None if isinstance(v, float) and v != v else v) for k, v in out["summary"].items()
        }
        return out


async def _one_stream(
    client: httpx.AsyncClient, key: str, max_tokens: int, question: str, run: ShareRun, ids: list[str]
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp:
            if resp.status_code != 200:
                run.errors.append(f"status {resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            ids.append(resp.headers.get("x-request-id", ""))
            done = False
            async for line in resp.aiter_lines():
                done = done or line == "data: [DONE]"
            if not done:
                run.errors.append("a stream ended without [DONE]")
                return
    except httpx.HTTPError as exc:
        run.errors.append(f"transport: {type(exc).__name__}: {exc}")
        return
    run.ok += 1


async def offer_poisson(
    base: str, key: str, rate_rps: float, duration_s: float, max_tokens: int, seed: int, run: ShareRun
) -> list[str]:
    """Streams arriving as a Poisson process at ``rate_rps`` for ``duration_s`` (seeded); waits for all of
    them; returns the request ids the gateway gave them (``X-Request-Id``)."""
    rng = random.Random(seed)
    ids: list[str] = []
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        tasks = []
        start = time.monotonic()
        at = 0.0
        while True:
            at += rng.expovariate(rate_rps)
            if at >= duration_s:
                break
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            question = f"Question {rng.randrange(10_000)}: what is item {rng.randrange(100)} made of?"
            tasks.append(asyncio.create_task(_one_stream(client, key, max_tokens, question, run, ids)))
            run.sent += 1
        await asyncio.gather(*tasks)
        run.duration_s = time.monotonic() - start
    return ids


def run_breakdown_share(
    run_dir: Path,
    load: float = 0.8,
    duration_s: float = 25.0,
    workers: int = 2,
    window: int = 8,
    max_tokens: int = 16,
    seed: int = 0,
) -> ShareRun:
    """Start the stack, measure its capacity, offer ``load`` x capacity for ``duration_s`` s and summarize
    the request lines of the load's streams (see the module docstring).

    Args:
        run_dir: folder for the logs (``gateway.log`` holds the request lines).
        load: arrival rate as a share of the measured capacity; duration_s: how long arrivals run, s.
        workers: simulated workers; window: requests the gateway admits to each at once (fixed).
        max_tokens: tokens per stream; seed: the arrivals' and questions' seed.

    Raises:
        loadgen.stack.StackError: the gateway did not start; RuntimeError: a worker did not, or the
            capacity probe saw errors.
    """
    run = ShareRun(load=load)
    env = {
        "RADIXGATE_ENGINE__SERVED_MODEL_NAME": MODEL,
        "RADIXGATE_UPSTREAM__WORKERS": "[]",
        "RADIXGATE_UPSTREAM__HEALTH_INTERVAL_S": "0.5",
        "RADIXGATE_SCHEDULER__WINDOW_MODE": "fixed",
        "RADIXGATE_SCHEDULER__WINDOW_INITIAL": str(window),
        "RADIXGATE_PRIORITY_CLASSES": CPU_PRIORITY_CLASSES,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    with (
        sim_workers(run_dir, workers, speed=1.0) as sims,
        LocalStack(run_dir, env=env, launch_workers=False, ready_timeout_s=60, require_ready=False) as stack,
        stack.admin() as admin,
    ):
        for sim in sims:
            admin.post("/admin/workers", json={"url": sim.url}).raise_for_status()
        stack.wait_ready()
        key = stack.create_tenant("breakdown-share")
        probe_key = stack.create_tenant("capacity-probe")

        async def measure_and_load() -> list[str]:
            run.capacity_rps = await measure_capacity(stack.url, probe_key, window * workers, 4.0, max_tokens)
            run.rate_rps = load * run.capacity_rps
            return await offer_poisson(stack.url, key, run.rate_rps, duration_s, max_tokens, seed, run)

        ids = asyncio.run(measure_and_load())
        entries = _await_lines(stack.run_dir / "gateway.log", ids)
    run.errors = run.errors[:20]
    run.summary = summarize(entries)
    return run


def _await_lines(log: Path, ids: list[str], timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The request lines of ``ids`` in ``log``, waiting up to ``timeout_s`` for the last ones (each is
    written as its answer settles)."""
    wanted = set(ids) - {""}
    deadline = time.monotonic() + timeout_s
    while True:
        lines = read_request_lines(log)
        if wanted <= set(lines) or time.monotonic() > deadline:
            return [lines[rid] for rid in wanted if rid in lines]
        time.sleep(0.2)


__all__ = ["TTFT_PHASES", "ShareRun", "ShareSummary", "run_breakdown_share", "summarize", "ttft_share"]
