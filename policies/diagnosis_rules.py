"""The figures every rule of :mod:`policies.diagnosis` reads (the typical worker's engine against its
baseline, the means of the window) and the rules of the causes on the gateway's side of a request:
``network``, ``gateway``, ``client``, ``quota_store``, ``queueing`` (pure; what each measures and its gate:
:mod:`policies.diagnosis`'s docstring).

Each rule returns its :class:`~policies.diagnosis_types.Verdict` and whether it is named.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from policies.diagnosis_types import (
    CAUSE_TITLES,
    NO_DATA,
    Cause,
    Evidence,
    FleetView,
    Latency,
    Thresholds,
    Verdict,
    WorkerView,
)

KV_FULL = 0.95
"""KV usage from which the pool counts as full (SGLang retracts decodes when it cannot grow them)."""

MIN_BASELINE_COUNT = 20.0
"""Fewest observations of a worker's baseline histogram that make it a reference."""

PRE_DISPATCH = ("auth", "prepare", "quota", "route", "queue", "retry")
"""The gateway's own phases before a request reaches a worker (:mod:`service.observability.breakdown`)."""


def mean_of(latency: Latency) -> float:
    return latency.mean if latency.mean is not None and latency.count > 0 else 0.0


def median(values: Iterable[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference <= 0:
        return None
    return value / reference


def share(part: float, whole: float) -> float:
    return max(0.0, min(1.0, part / whole)) if whole > 0 else 0.0


def weighted_mean(workers: Sequence[WorkerView], pick: Callable[[WorkerView], Latency]) -> float | None:
    count = sum(pick(w).count for w in workers)
    if count <= 0:
        return None
    return sum(mean_of(pick(w)) * pick(w).count for w in workers) / count


@dataclass(frozen=True, slots=True)
class TypicalEngine:
    """The typical worker's engine over the window against its baseline (medians over workers), s."""

    ttft_mean: float | None
    ttft_ratio: float | None
    ttft_excess: float | None
    itl_mean: float | None
    itl_ratio: float | None
    itl_step_excess: float
    itl_excess: float | None
    base_ttft: float | None
    base_itl: float | None
    queue_wait: float | None
    running: float | None
    kv_usage: float | None
    dram: float | None
    sm: float | None


def baseline_p50(latency: Latency) -> float | None:
    return latency.p50 if latency.count >= MIN_BASELINE_COUNT else None


def typical_engine(
    workers: Sequence[WorkerView], baseline: dict[str, WorkerView], span_s: float
) -> TypicalEngine:
    """The typical (median) worker of ``workers`` (slow or failing ones left out by the caller)."""

    def med(pick: Callable[[WorkerView], float | None]) -> float | None:
        return median(v for w in workers if (v := pick(w)) is not None)

    def base(w: WorkerView) -> WorkerView:
        return baseline.get(w.name) or WorkerView(w.name)

    def queue_wait(w: WorkerView) -> float | None:
        if w.queue_time.count > 0:
            return mean_of(w.queue_time)
        if w.queued is None or w.requests <= 0 or span_s <= 0:
            return None
        return w.queued / (w.requests / span_s)  # Little's law: L = lambda W

    ttft_excess = med(lambda w: excess(w.ttft, baseline_p50(base(w).ttft)))
    itl_step = med(lambda w: excess_p50(w.itl, baseline_p50(base(w).itl))) or 0.0
    return TypicalEngine(
        ttft_mean=med(lambda w: w.ttft.mean),
        ttft_ratio=med(lambda w: ratio(w.ttft.p50, baseline_p50(base(w).ttft))),
        ttft_excess=ttft_excess,
        itl_mean=med(lambda w: w.itl.mean),
        itl_ratio=med(lambda w: ratio(w.itl.p50, baseline_p50(base(w).itl))),
        itl_step_excess=itl_step,
        itl_excess=med(lambda w: excess(w.itl, baseline_p50(base(w).itl))),
        base_ttft=med(lambda w: baseline_p50(base(w).ttft)),
        base_itl=med(lambda w: baseline_p50(base(w).itl)),
        queue_wait=med(queue_wait),
        running=med(lambda w: w.running),
        kv_usage=max((w.kv_usage for w in workers if w.kv_usage is not None), default=None),
        dram=med(lambda w: w.dram_active),
        sm=med(lambda w: w.sm_active),
    )


def excess(window: Latency, reference: float | None) -> float | None:
    if window.count <= 0 or reference is None:
        return None
    return max(0.0, mean_of(window) - reference)


def excess_p50(window: Latency, reference: float | None) -> float | None:
    if window.p50 is None or reference is None:
        return None
    return max(0.0, window.p50 - reference)


def make_verdict(
    cause: Cause,
    explained_s: float,
    whole_s: float,
    of: str,
    summary: str,
    evidence: Sequence[Evidence],
    worker: str | None = None,
) -> Verdict:
    return Verdict(
        cause=cause,
        title=CAUSE_TITLES[cause],
        score=round(share(explained_s, whole_s), 4),
        explained_s=explained_s,
        of=of,
        summary=summary,
        evidence=tuple(e for e in evidence if e.value is not None),
        worker=worker,
    )


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def pct(value: float | None) -> str:
    """A share as a percentage: whole below 100, one decimal under 10%."""
    if value is None:
        return "n/a"
    return f"{value * 100:.0f}%" if abs(value) >= 0.1 or value == 0 else f"{value * 100:.1f}%"


ON_PATH_STORE_OPS = ("QuotaLimiter.reserve", "TenantStore.authenticate")
"""Quota-store calls a request waits for (``radixgate_store_call_seconds{op}``); settles and usage records
run off its path."""


@dataclass(frozen=True, slots=True)
class RuleContext:
    """What every rule reads: the window, its means and the typical engine."""

    th: Thresholds
    window: FleetView
    ttft: float
    e2e: float
    tokens_out: float
    engine: TypicalEngine
    fleet_ttft: float | None
    fleet_itl: float | None
    hit_now: float | None
    hit_before: float | None
    uncached_now: float | None
    uncached_before: float | None

    def phase(self, name: str) -> float:
        return mean_of(self.window.gateway.phases.get(name, NO_DATA))

    def named(self, verdict: Verdict, gate: bool) -> bool:
        """Whether ``verdict`` passes ``gate`` and the common floors."""
        return gate and verdict.explained_s >= self.th.min_excess_s and verdict.score >= self.th.min_share


def hit_rate(workers: Iterable[WorkerView]) -> tuple[float | None, float | None]:
    """The engines' prefix-cache hit rate (cached / prompt tokens) and uncached tokens per request."""
    listed = list(workers)
    prompt = sum(w.prompt_tokens for w in listed)
    cached = sum(w.cached_tokens for w in listed)
    requests = sum(w.requests for w in listed)
    hit = cached / prompt if prompt > 0 else None
    return hit, ((prompt - cached) / requests if requests > 0 else None)


def network(c: RuleContext) -> tuple[Verdict, bool]:
    g = c.window.gateway
    pre = sum(c.phase(p) for p in PRE_DISPATCH)
    lag = mean_of(g.loop_lag)
    gap = max(0.0, c.ttft - pre - c.fleet_ttft - lag) if c.fleet_ttft is not None and g.ttft.count else 0.0
    per_token = max(0.0, mean_of(g.tpot) - c.fleet_itl) if c.fleet_itl is not None and g.tpot.count else 0.0
    stream = per_token * max(0.0, c.tokens_out - 1)
    on_ttft, on_e2e = share(gap, c.ttft), share(gap + stream, c.e2e)
    explained, whole, of = (gap, c.ttft, "TTFT") if on_ttft >= on_e2e else (gap + stream, c.e2e, "E2E")
    summary = (
        f"the gateway's TTFT ({ms(c.ttft)}) is {ms(gap)} more than the engine's ({ms(c.fleet_ttft)}) and "
        f"the gateway's own steps before dispatch ({ms(pre)})"
    )
    if stream > gap:
        summary = f"each streamed token reaches the gateway {ms(per_token)} later than the engine made it"
    verdict = make_verdict(
        "network",
        explained,
        whole,
        of,
        summary,
        [
            Evidence("gateway TTFT, mean", c.ttft, "s", c.fleet_ttft, "engine TTFT, mean"),
            Evidence("gateway TTFT, P99", g.ttft.p99, "s"),
            Evidence("upstream_connect (to the worker's headers), mean", c.phase("upstream_connect"), "s"),
            Evidence("upstream_connect, P99", g.phases.get("upstream_connect", NO_DATA).p99, "s"),
            Evidence("gateway phases before dispatch, mean", pre, "s"),
            Evidence(
                "gateway TPOT, mean",
                mean_of(g.tpot) if g.tpot.count else None,
                "s",
                c.fleet_itl,
                "engine ITL, mean",
            ),
            Evidence("event-loop lag, mean", lag, "s"),
        ],
    )
    return verdict, c.named(verdict, True)


def gateway(c: RuleContext) -> tuple[Verdict, bool]:
    g = c.window.gateway
    own = max(0.0, mean_of(g.overhead) - c.phase("quota") - c.phase("auth"))
    lag = mean_of(g.loop_lag)
    explained = max(own, lag)
    summary = (
        f"the gateway's own time, quota store aside, is {ms(own)} a request; its event loop lags {ms(lag)}"
    )
    verdict = make_verdict(
        "gateway",
        explained,
        c.ttft,
        "TTFT",
        summary,
        [
            Evidence("gateway overhead, mean", mean_of(g.overhead) if g.overhead.count else None, "s"),
            Evidence("gateway overhead, P99", g.overhead.p99, "s"),
            Evidence("event-loop lag, mean", lag if g.loop_lag.count else None, "s"),
            Evidence("event-loop lag, P99", g.loop_lag.p99, "s"),
        ],
    )
    return verdict, c.named(verdict, True)


def client(c: RuleContext) -> tuple[Verdict, bool]:
    waits = c.phase("client_write")
    p99 = c.window.gateway.phases.get("client_write", NO_DATA).p99
    verdict = make_verdict(
        "client",
        waits,
        c.e2e,
        "E2E",
        f"streams wait {ms(waits)} a request for their clients to read",
        [Evidence("client_write, mean", waits, "s"), Evidence("client_write, P99", p99, "s")],
    )
    return verdict, c.named(verdict, True)


def quota_store(c: RuleContext) -> tuple[Verdict, bool]:
    calls = c.window.gateway.store_calls
    on_path = [(op, calls[op]) for op in ON_PATH_STORE_OPS if op in calls and calls[op].count > 0]
    slowest = max((mean_of(lat) for _, lat in on_path), default=c.phase("quota"))
    explained = c.phase("auth") + c.phase("quota")
    evidence = [Evidence("auth + quota phases, mean", explained, "s")]
    for op, lat in on_path:
        evidence += [
            Evidence(f"store call {op}, mean", mean_of(lat), "s"),
            Evidence(f"store call {op}, P99", lat.p99, "s"),
        ]
    verdict = make_verdict(
        "quota_store",
        explained,
        c.ttft,
        "TTFT",
        f"quota-store (Redis) calls on the request's path take {ms(slowest)} on average",
        evidence,
    )
    return verdict, c.named(verdict, slowest >= c.th.min_store_call_s)


def queueing(c: RuleContext) -> tuple[Verdict, bool]:
    g, e = c.window.gateway, c.engine
    gateway_wait = c.phase("queue")
    engine_wait = c.phase("engine_queue") if g.phases.get("engine_queue", NO_DATA).count else e.queue_wait
    if engine_wait is not None:
        cap = e.ttft_excess if e.ttft_excess is not None else e.ttft_mean
        engine_wait = min(engine_wait, cap) if cap is not None else engine_wait
    explained = gateway_wait + (engine_wait or 0.0)
    where = "the gateway's queue" if gateway_wait >= (engine_wait or 0.0) else "the engines' queues"
    verdict = make_verdict(
        "queueing",
        explained,
        c.ttft,
        "TTFT",
        f"requests wait {ms(explained)} before their prefill, most in {where}",
        [
            Evidence("gateway queue wait, mean", gateway_wait, "s"),
            Evidence("gateway queue wait, P99", g.phases.get("queue", NO_DATA).p99, "s"),
            Evidence("gateway queue length, mean", g.queue_depth, "requests"),
            Evidence("engine queue wait, mean", engine_wait, "s"),
            Evidence("engine queue length, typical worker", engine_queued(c), "requests"),
            Evidence("shed requests", g.shed, "requests"),
        ],
    )
    return verdict, c.named(verdict, True)


def engine_queued(c: RuleContext) -> float | None:
    """The typical worker's mean engine queue length over the window."""
    return median(w.queued for w in c.window.workers if w.queued is not None)
