"""Where a window's tail latency went: ranked causes with their evidence (pure: no I/O, no clock).

:func:`diagnose` reads a window of a gateway's and its workers' metrics and the same metrics before it (the
baseline; :mod:`policies.diagnosis_types`) and judges each cause. Attribution uses histogram **means**
(``sum / count``: exact, where a quantile from buckets is an interpolation, and additive along a request's
path), so each cause says how many seconds it adds to the latency it affects; the P99s are the symptom,
shown beside. A cause is named when it passes its own gate (below) and adds at least
``min_excess_s`` and ``min_share`` of that latency. Its **score** is the share (0..1) of the affected
requests' mean latency it adds: of the TTFT for the causes before the first token, of the end-to-end time
for decode and slow clients, of its own requests' end-to-end time for one worker.

The causes, each with the time it adds and its gate:

- ``network``: the gateway's TTFT less its own phases before dispatch (auth, prepare, quota, route, queue,
  retry) less the engine's own TTFT, less the event loop's lag: time on the wire (``upstream_connect``
  is its first part); and the gateway's TPOT less the engine's ITL, per output token (a slow link).
- ``gateway``: the gateway's overhead (``radixgate_gateway_overhead_seconds``) less the quota store's
  phases, or the event loop's lag, whichever is larger.
- ``client``: the stream's waits on the client (``client_write``), of the end-to-end time.
- ``quota_store``: the ``auth`` and ``quota`` phases; gate: an on-path store call (quota reservation, key
  read) averages at least ``min_store_call_s`` (a local Redis answers in about 1 ms).
- ``queueing``: the gateway's queue, and the engine's queue wait above its normal (``engine_queue`` phase,
  else ``sglang:queue_time_seconds``, else Little's law: mean queue length / request rate), capped at the
  engine's TTFT excess over its baseline.
- ``prefill``: the engine's TTFT above its baseline median, less the slower decode step a new request
  waits for; gate: the typical worker's TTFT median at least ``min_slowdown`` times its baseline's. The
  evidence says whether prompts lost their prefix cache (hit rate fell by ``min_hit_rate_drop``, more
  uncached tokens per request) or each token costs more (same hit rate).
- ``decode``: the engine's ITL above its baseline median, times the output tokens of a request; gate: the
  typical worker's ITL median at least ``min_slowdown`` times its baseline's. Evidence: the running batch,
  KV usage, DCGM DRAM activity where exported.
- ``retraction``: the KV pool is full (``sglang:token_usage`` at least :data:`KV_FULL`) and the engine
  retracts requests (at least ``min_retraction_share`` per request) or queues them: the engine's TTFT
  excess.
- ``worker``: one worker's engine TTFT or ITL at least ``min_worker_ratio`` times the other workers'
  median (slow: its E2E above theirs, of its own E2E), or at least ``min_error_share`` of the gateway's
  calls to it failing, or out of rotation (failing: scored by the share of calls that failed, or of the
  fleet's workers it took away). The fleet-wide engine causes are judged on the other workers' median
  (the typical worker).

Consequences: a queue that grows beside a slower service is Little's law, not a cause; ``queueing`` is
marked a consequence of any root (:data:`policies.diagnosis_types.ROOT_CAUSES`) that fired, and
``prefill`` and ``queueing`` of ``retraction`` (a full KV pool is why the engine waits and recomputes).
Consequences rank after every root. A window with no cause that passes answers none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from policies.diagnosis_rules import (
    KV_FULL,
    MIN_BASELINE_COUNT,
    RuleContext,
    client,
    engine_queued,
    gateway,
    hit_rate,
    make_verdict,
    mean_of,
    median,
    network,
    pct,
    queueing,
    quota_store,
    ratio,
    typical_engine,
    weighted_mean,
)
from policies.diagnosis_types import (
    NO_DATA,
    ROOT_CAUSES,
    Cause,
    Diagnosis,
    Evidence,
    FleetView,
    Thresholds,
    Verdict,
    WorkerView,
)


def _prefill(c: RuleContext) -> tuple[Verdict, bool]:
    e = c.engine
    explained = max(0.0, (e.ttft_excess or 0.0) - e.itl_step_excess)
    collapsed = (
        c.hit_now is not None
        and c.hit_before is not None
        and c.hit_before - c.hit_now >= c.th.min_hit_rate_drop
    )
    if collapsed:
        summary = (
            f"the prefix cache hit rate fell from {pct(c.hit_before)} to {pct(c.hit_now)}: each request "
            f"prefills {c.uncached_now or 0:.0f} uncached tokens (before: {c.uncached_before or 0:.0f})"
        )
    else:
        summary = (
            f"the engine's TTFT is {e.ttft_ratio or 0:.1f}x its baseline at the same cache hit rate "
            f"({pct(c.hit_now)}): each prompt token costs more"
        )
    span = c.window.span_s
    uncached_rate = sum(w.prompt_tokens - w.cached_tokens for w in c.window.workers) / span if span else None
    verdict = make_verdict(
        "prefill",
        explained,
        c.ttft,
        "TTFT",
        summary,
        [
            Evidence("engine TTFT, mean (typical worker)", e.ttft_mean, "s", e.base_ttft, "baseline median"),
            Evidence("engine TTFT slowdown, median", e.ttft_ratio, "times", c.th.min_slowdown, "gate"),
            Evidence("prefix-cache hit rate", c.hit_now, "ratio", c.hit_before, "baseline"),
            Evidence(
                "uncached prompt tokens per request", c.uncached_now, "count", c.uncached_before, "baseline"
            ),
            Evidence("uncached prompt tokens/s, all workers", uncached_rate, "tokens/s"),
            Evidence("DCGM SM active (typical worker)", e.sm, "ratio"),
        ],
    )
    gate = e.ttft_ratio is not None and e.ttft_ratio >= c.th.min_slowdown
    return verdict, c.named(verdict, gate)


def _decode(c: RuleContext) -> tuple[Verdict, bool]:
    e, g = c.engine, c.window.gateway
    explained = (e.itl_excess or 0.0) * max(0.0, c.tokens_out - 1)
    verdict = make_verdict(
        "decode",
        explained,
        c.e2e,
        "E2E",
        f"each decode step takes {e.itl_ratio or 0:.1f}x its baseline with {e.running or 0:.0f} requests "
        f"in the batch and {pct(e.kv_usage)} of the KV pool used",
        [
            Evidence("engine ITL, mean (typical worker)", e.itl_mean, "s", e.base_itl, "baseline median"),
            Evidence("engine ITL slowdown, median", e.itl_ratio, "times", c.th.min_slowdown, "gate"),
            Evidence("gateway TPOT, P99", g.tpot.p99, "s"),
            Evidence("running batch, mean (typical worker)", e.running, "requests"),
            Evidence("KV usage, max", e.kv_usage, "ratio"),
            Evidence("DCGM DRAM active (typical worker)", e.dram, "ratio"),
        ],
    )
    gate = e.itl_ratio is not None and e.itl_ratio >= c.th.min_slowdown
    return verdict, c.named(verdict, gate)


def _retraction(c: RuleContext, workers: Sequence[WorkerView]) -> tuple[Verdict, bool]:
    e = c.engine
    retracted = sum(w.retractions for w in workers)
    requests = sum(w.requests for w in workers)
    per_request = retracted / requests if requests > 0 else (1.0 if retracted else 0.0)
    explained = max(e.ttft_excess or 0.0, min(e.queue_wait or 0.0, e.ttft_mean or 0.0))
    full = e.kv_usage is not None and e.kv_usage >= KV_FULL
    verdict = make_verdict(
        "retraction",
        explained,
        c.ttft,
        "TTFT",
        f"the KV pool is {pct(e.kv_usage)} full: {retracted:.0f} requests retracted, the rest wait for room",
        [
            Evidence("KV usage, max", e.kv_usage, "ratio", KV_FULL, "full"),
            Evidence("retracted requests", retracted, "requests"),
            Evidence(
                "retractions per finished request", per_request, "ratio", c.th.min_retraction_share, "gate"
            ),
            Evidence("engine queue length, typical worker", engine_queued(c), "requests"),
            Evidence("engine TTFT, mean (typical worker)", e.ttft_mean, "s", e.base_ttft, "baseline median"),
        ],
    )
    waits = e.ttft_excess is not None and e.ttft_excess >= c.th.min_excess_s
    return verdict, c.named(verdict, full and (per_request >= c.th.min_retraction_share or waits))


def _workers(window: FleetView, th: Thresholds) -> list[tuple[Verdict, bool]]:
    """One verdict per worker that stands out from the others (slow) or fails."""
    out: list[tuple[Verdict, bool]] = []
    served = sum(w.requests for w in window.workers)
    retry = mean_of(window.gateway.phases.get("retry", NO_DATA))
    for w in window.workers:
        others = [o for o in window.workers if o is not w and o.ttft.count > 0]
        ttft_ratio = ratio(w.ttft.mean, median(mean_of(o.ttft) for o in others)) if w.ttft.count else None
        itl_ratio = (
            ratio(w.itl.mean, median(mean_of(o.itl) for o in others if o.itl.count)) if w.itl.count else None
        )
        slowest = max((r for r in (ttft_ratio, itl_ratio) if r is not None), default=None)
        reaches_tail = served > 0 and w.requests / served >= 0.01
        slow = slowest is not None and slowest >= th.min_worker_ratio and reaches_tail
        calls = w.requests + w.errors
        error_share = w.errors / calls if calls > 0 else 0.0
        out_of_rotation = w.healthy is not None and w.healthy <= 0
        failing = (calls > 0 and error_share >= th.min_error_share) or out_of_rotation
        own, usual = mean_of(w.e2e), median(mean_of(o.e2e) for o in others if o.e2e.count)
        slow_s = max(0.0, own - usual) if usual is not None and w.e2e.count else 0.0
        explained, whole = (slow_s, own) if slow else (retry, retry or 1.0)
        if failing and not slow:
            summary = f"{error_share * 100:.0f}% of the gateway's calls to it failed" + (
                "; it is out of rotation" if out_of_rotation else ""
            )
        else:
            summary = f"its engine is {slowest or 0:.1f}x slower than the other workers' median"
        verdict = make_verdict(
            "worker",
            explained,
            whole,
            "its E2E" if slow else "retries",
            summary,
            [
                Evidence(
                    "its engine TTFT, mean",
                    w.ttft.mean,
                    "s",
                    median(mean_of(o.ttft) for o in others),
                    "others' median",
                ),
                Evidence(
                    "its engine ITL, mean",
                    w.itl.mean,
                    "s",
                    median(mean_of(o.itl) for o in others if o.itl.count),
                    "others' median",
                ),
                Evidence("its engine E2E, mean", own if w.e2e.count else None, "s", usual, "others' median"),
                Evidence("requests it finished", w.requests, "requests"),
                Evidence("failed calls to it", w.errors, "requests"),
                Evidence("in rotation (min over the window)", w.healthy, "ratio"),
            ],
            worker=w.name,
        )
        if failing and not slow:  # the calls it fails, or the share of the fleet's capacity it took away
            lost = 1.0 / len(window.workers) if out_of_rotation else 0.0
            verdict = replace(verdict, score=round(max(error_share, lost), 4))
            out.append((verdict, True))
        else:
            out.append((verdict, slow and verdict.score >= th.min_share))
    return out


def diagnose(window: FleetView, baseline: FleetView | None = None, th: Thresholds | None = None) -> Diagnosis:
    """Judge every cause over ``window`` against ``baseline`` (module docstring); the named ones ranked
    (roots by score, then consequences), and the others with their figures.

    Args:
        window: the gateway and its workers over the window.
        baseline: the same before it (what the engines' normal TTFT and ITL are read from); None or too
            few observations: the prefill and decode causes cannot be judged (a note says so).
        th: the thresholds (default :class:`~policies.diagnosis_types.Thresholds`).
    """
    th = th or Thresholds()
    g = window.gateway
    notes: list[str] = []
    if g.served <= 0:
        notes.append("no request was served in the window: latency causes cannot be judged")
    if not window.workers or all(w.ttft.count <= 0 for w in window.workers):
        notes.append("no engine series (sglang:*) in the window: engine causes cannot be judged")
    worker_results = _workers(window, th)
    outliers = {v.worker for v, named in worker_results if named}
    typical = [w for w in window.workers if w.name not in outliers and (w.ttft.count > 0 or w.itl.count > 0)]
    before = {w.name: w for w in baseline.workers} if baseline is not None else {}
    if not any(w.ttft.count >= MIN_BASELINE_COUNT for w in before.values()):
        notes.append("no baseline of the engines' latency: prefill and decode slowdowns cannot be judged")
    hit_now, uncached_now = hit_rate(typical)
    hit_before, uncached_before = hit_rate(before[w.name] for w in typical if w.name in before)
    generated = sum(w.generated_tokens for w in window.workers)
    finished = sum(w.requests for w in window.workers)
    tokens_out = g.completion_tokens / g.served if g.served > 0 else generated / finished if finished else 0.0
    ctx = RuleContext(
        th=th,
        window=window,
        ttft=mean_of(g.ttft),
        e2e=mean_of(g.e2e),
        tokens_out=tokens_out,
        engine=typical_engine(typical, before, window.span_s),
        fleet_ttft=weighted_mean(window.workers, lambda w: w.ttft),
        fleet_itl=weighted_mean(window.workers, lambda w: w.itl),
        hit_now=hit_now,
        hit_before=hit_before,
        uncached_now=uncached_now,
        uncached_before=uncached_before,
    )
    results = [
        network(ctx),
        gateway(ctx),
        client(ctx),
        quota_store(ctx),
        queueing(ctx),
        _prefill(ctx),
        _decode(ctx),
        _retraction(ctx, typical),
        *worker_results,
    ]
    named = [v for v, ok in results if ok]
    fired = {v.cause for v in named}
    roots = sorted((v for v in named if v.cause in ROOT_CAUSES), key=lambda v: -v.score)
    ranked: list[Verdict] = []
    for v in named:
        root: Cause | None = None
        if v.cause in ("prefill", "queueing") and "retraction" in fired:
            root = "retraction"
        elif v.cause == "queueing" and roots:
            root = roots[0].cause
        ranked.append(replace(v, consequence_of=root) if root else v)
    ranked.sort(key=lambda v: (v.consequence_of is not None, -v.score))
    return Diagnosis(
        verdicts=tuple(ranked),
        rejected=tuple(sorted((v for v, ok in results if not ok), key=lambda v: -v.score)),
        ttft_p99=g.ttft.p99,
        e2e_p99=g.e2e.p99,
        tpot_p99=g.tpot.p99,
        served=g.served,
        span_s=window.span_s,
        notes=tuple(notes),
    )


__all__ = ["diagnose"]
