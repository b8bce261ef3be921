"""Experiments 2-4 of :mod:`loadgen.fleet.experiments`: routing on shared prompts, overload, fairness."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from loadgen.fleet.config import FleetConfig
from loadgen.fleet.doc import DOC, IMG, bar_plot, line_plot, table, write_section
from loadgen.fleet.experiments import (
    DEFAULT_WINDOW,
    FIXED_256,
    PROFILE,
    capacity,
    meets,
    parallel,
    scenario,
    summarize,
)
from loadgen.report import jain_index
from loadgen.scenario import Scenario
from policies.routing import RouterName

SLO_MS = {"interactive": 500.0, "standard": 2000.0, "batch": 30000.0}  # loadgen/scenarios/mixed-classes.yaml
CAPACITY_FLEET = FleetConfig(profile=PROFILE, workers=4, window=FIXED_256)


# ----------------------------------------------------------------------------------------- experiment 2
def _shared(rate: float) -> Scenario:
    prompts = {
        "system_prompts": {
            "count": 400,
            "length": {"kind": "uniform", "low": 3500, "high": 4500},
            "users_per_prompt": 4,
        },
        "user_turn": {"kind": "uniform", "low": 30, "high": 80},
        "output": {"kind": "uniform", "low": 50, "high": 150},
    }
    tenants = [{"id": "app", "priority_class": "standard"}]
    return scenario("shared-system-prompts", rate, 40, 15, tenants, {"standard": 500}, prompts)


def exp_routing() -> str:
    """Experiment 2: cache-aware vs round robin over a rate sweep on 8 workers; returns the headline."""
    t0 = time.monotonic()
    rates = [50.0, 100.0, 150.0, 200.0, 250.0, 300.0]
    routers: tuple[RouterName, ...] = ("cache_aware", "round_robin")
    config = FleetConfig(profile=PROFILE, workers=8, window=FIXED_256)
    jobs = [(_shared(r), replace(config, routing=p)) for p in routers for r in rates]
    runs: list[dict[str, Any]] = parallel(summarize, jobs)
    by = {p: [s for s in runs if s["routing"] == p] for p in routers}
    best = {p: max((s["rate"] for s in by[p] if meets(s, 500)), default=None) for p in routers}
    rows = [
        [
            s["routing"],
            s["rate"],
            s["hit_rate"],
            s["p50"],
            s["p99"],
            s["shed_rate"],
            s["throughput_rps"],
            s["imbalance"],
            s["requests_cv"],
            s["preemptions"],
        ]
        for s in runs
    ]
    series_p99: dict[str, tuple[list[float], list[float | None]]] = {
        p: ([s["rate"] for s in by[p]], [s["p99"] for s in by[p]]) for p in routers
    }
    img = line_plot(
        IMG / "fleet-routing.png",
        series_p99,
        "offered requests/s (8 workers)",
        "P99 TTFT, ms (log)",
        "400 shared system prompts of ~4,000 words",
        hline=500,
        logy=True,
    )
    hit = {p: [s["hit_rate"] for s in by[p] if s["hit_rate"] is not None] for p in routers}
    head = "; ".join(
        f"{p}: hit rate {min(hit[p]):.0%}-{max(hit[p]):.0%}, throughput at the SLO {best[p] or '< 50'} RPS, "
        f"imbalance ≤ {max(s['imbalance'] or 0 for s in by[p]):.2f}"
        for p in routers
    )
    body = f"""## 2. Cache-aware vs round robin (`python -m loadgen.fleet.experiments routing`)

Scenario: 8 workers `{PROFILE}` (KV pool 1.2M tokens each), fixed window 256; 400 system prompts of
3,500-4,500 words (≈ 1.6M tokens of distinct prefixes: more than one worker's pool, a fifth of the fleet's),
4 users each; user turns of 30-80 words, 50-150 tokens out; Poisson arrivals for 40 s, first 15 s warm-up.
SLO: P99 TTFT < 500 ms with nothing shed; throughput at the SLO = the highest swept rate meeting it.
Hit rate = cached / prompt tokens as the engines report them. Imbalance = max / mean requests per worker.

**Headline:** {head}.

![P99 TTFT vs rate]({img.relative_to(DOC.parent)})

{
        table(
            [
                "policy",
                "RPS",
                "hit rate",
                "TTFT P50 ms",
                "TTFT P99 ms",
                "shed",
                "served RPS",
                "imbalance",
                "CV per worker",
                "engine preemptions",
            ],
            rows,
        )
    }

Reading: round robin sends every prompt to every worker, so each worker's radix cache must hold all 400
prefixes and evicts them LRU before they come back; cache-aware routing partitions the prefixes, each worker
keeping about a fifth of the pool in use. The price is balance: per-prefix affinity follows the popularity of
the prompts, bounded by SGLang's imbalance rule (`balance_abs_threshold` 64 requests). ({
        time.monotonic() - t0:.0f} s wall)
"""
    write_section("routing", body)
    return head


# ----------------------------------------------------------------------------------------- experiment 3
def _three(rate: float, classes: bool) -> Scenario:
    tenants = [
        {"id": f"{c}-app", "priority_class": c if classes else "standard", "share": 1}
        for c in ("interactive", "standard", "batch")
    ]
    return scenario("overload-2x", rate, 60, 10, tenants, SLO_MS if classes else {"standard": 2000.0})


def exp_overload() -> str:
    """Experiment 3: three classes at 2x capacity (4 workers); returns the headline."""
    t0 = time.monotonic()
    cap = capacity(CAPACITY_FLEET, 500, 40.0, 280.0)
    rate = 2 * cap
    variants = {
        "priority classes, fixed window 256": (_three(rate, True), CAPACITY_FLEET),
        "priority classes, AIMD windows (default)": (
            _three(rate, True),
            replace(CAPACITY_FLEET, window=DEFAULT_WINDOW),
        ),
        "no classes (all standard), fixed 256": (_three(rate, False), CAPACITY_FLEET),
    }
    runs = parallel(summarize, list(variants.values()))
    rows, good = [], {}
    for name, s in zip(variants, runs, strict=True):
        per_tenant = s["tenants"]
        good[name] = [per_tenant[f"{c}-app"]["goodput"] or 0.0 for c in ("interactive", "standard", "batch")]
        for c in ("interactive", "standard", "batch"):
            t = per_tenant[f"{c}-app"]
            rows.append(
                [
                    name,
                    c,
                    t["sent"],
                    t["ttft_ms"]["p50"],
                    t["ttft_ms"]["p99"],
                    t["goodput"],
                    t["shed_rate"],
                    t["throughput_rps"],
                ]
            )
    img = bar_plot(
        IMG / "fleet-overload.png",
        ["interactive", "standard", "batch"],
        good,
        "goodput (share of sent within SLO)",
        f"2x overload ({rate:.0f} RPS on 4 workers)",
    )
    first = good["priority classes, fixed window 256"]
    head = (
        f"capacity {cap:.0f} RPS on 4 workers; at {rate:.0f} RPS goodput interactive/standard/batch "
        + ", ".join(f"{name}: " + "/".join(f"{g:.0%}" for g in good[name]) for name in variants)
    )
    body = f"""## 3. Three classes at 2x overload (`python -m loadgen.fleet.experiments overload`)

Capacity: the highest rate at which 4 workers `{PROFILE}` with fixed windows of 256 serve short prompts
(150-250 words in, 50-150 tokens out) with P99 TTFT < 500 ms and nothing shed, found by bisection:
**{cap:.0f} RPS**. Then {rate:.0f} RPS (2x) for 60 s (10 s warm-up) from three tenants with equal shares,
one per class; the gateway's default classes (wait budgets 1 s / 5 s / 30 s, SGLang priorities 10 / 5 / 0)
and SLOs (TTFT) interactive 500 ms, standard 2 s, batch 30 s. The tenants keep their names (`interactive-app`,
...) in the baseline where all three run in `standard` (SLO 2 s for all).

**Headline:** {first[0]:.0%} / {first[1]:.0%} / {first[2]:.0%} goodput for interactive / standard / batch with
fixed windows ({head}).

![goodput per class]({img.relative_to(DOC.parent)})

{
        table(
            [
                "gateway",
                "tenant class",
                "sent",
                "TTFT P50 ms",
                "TTFT P99 ms",
                "goodput",
                "shed (503)",
                "served RPS",
            ],
            rows,
        )
    }

Reading: the gateway's priority acts in its own queue; once a worker's window is full, a new interactive
request waits for any running request to end (only `top_band_headroom` = 2 extra slots let it reach the
engine, where SGLang's priority scheduling can preempt).
With large windows most queueing happens inside the engines,
so the classes are separated less than the wait budgets suggest. ({time.monotonic() - t0:.0f} s wall)
"""
    write_section("overload", body)
    return head


# ----------------------------------------------------------------------------------------- experiment 4
def _noisy(rate: float) -> Scenario:
    tenants = [{"id": "noisy", "priority_class": "standard", "share": 10}] + [
        {"id": f"normal-{i}", "priority_class": "standard", "share": 1} for i in range(1, 10)
    ]
    return scenario("noisy-neighbour", rate, 60, 10, tenants, {"standard": 2000.0})


def exp_fairness() -> str:
    """Experiment 4: one tenant at 10x nine equal-weight others, 1.5x capacity; returns the headline."""
    t0 = time.monotonic()
    cap = capacity(CAPACITY_FLEET, 500, 40.0, 280.0)
    rate = 1.5 * cap
    variants = {
        "WFQ (gateway)": CAPACITY_FLEET,
        "FIFO (ablation)": replace(CAPACITY_FLEET, fair_queuing=False),
    }
    runs = parallel(summarize, [(_noisy(rate), c) for c in variants.values()])
    ids = ["noisy"] + [f"normal-{i}" for i in range(1, 10)]
    bars, rows, heads = {}, [], []
    for name, s in zip(variants, runs, strict=True):
        t = s["tenants"]
        goodput = [t[i]["goodput"] or 0.0 for i in ids]
        bars[name] = goodput
        jain_all, jain_normal = jain_index(goodput), jain_index(goodput[1:])
        served = [t[i]["completion_tokens_per_s"] for i in ids]
        heads.append(
            f"{name}: Jain(goodput) all {jain_all:.3f}, nine normal {jain_normal:.3f}, "
            f"normal goodput ≥ {min(goodput[1:]):.0%}, noisy {goodput[0]:.0%}"
        )
        for i, g, tok in zip(ids, goodput, served, strict=True):
            rows.append([name, i, t[i]["sent"], t[i]["ttft_ms"]["p99"], g, t[i]["shed_rate"], tok])
    img = bar_plot(
        IMG / "fleet-fairness.png",
        ids,
        bars,
        "goodput (share of sent within 2 s TTFT)",
        f"noisy tenant at 10x, {rate:.0f} RPS on 4 workers",
    )
    head = "; ".join(heads)
    body = f"""## 4. Fairness: one noisy tenant at 10x (`python -m loadgen.fleet.experiments fairness`)

Ten `standard` tenants of weight 1: `noisy` sends 10 shares, `normal-1..9` one share each; {rate:.0f} RPS in
all (1.5x the {cap:.0f} RPS capacity of experiment 3's fleet: 4 workers, fixed windows 256), 60 s,
10 s warm-up, short prompts. Goodput: share of a tenant's requests served with TTFT ≤ 2 s. Jain's index
(Σx)² / (n Σx²) over the tenants' goodput. "FIFO" is a simulation-only ablation: all tenants one WFQ flow,
so the band is served in arrival order (the gateway has no such switch).

**Headline:** {head}.

![per-tenant goodput]({img.relative_to(DOC.parent)})

{table(["queue", "tenant", "sent", "TTFT P99 ms", "goodput", "shed (503)", "served tokens/s"], rows)}

Reading: with WFQ each backlogged tenant gets an equal share of dispatched tokens; the nine normal tenants ask
for less than their share (0.079 vs 0.1 of capacity) so they are served almost entirely and the noisy tenant
absorbs the overload (its finish tags run ahead, so its predicted wait exceeds the 5 s budget and it is shed
at arrival). In arrival order everybody's requests wait behind the noisy tenant's.
({time.monotonic() - t0:.0f} s wall)
"""
    write_section("fairness", body)
    return head
