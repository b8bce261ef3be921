"""Experiment 5 of :mod:`loadgen.fleet.experiments` (its command line runs it): two models behind one gateway.

A small model (Llama-3.1-8B on one H100 per worker, 2 workers, TTFT goal 300 ms) and a large one
(Llama-3.1-70B TP 8, 4 workers, TTFT goal 500 ms) behind one gateway, each with its own admission core as the
gateway gives each model of ``RADIXGATE_MODELS`` (:class:`loadgen.fleet.config.FleetModel`). The small model
gets 80% of its capacity throughout; the large one 0.8x, 2x and 3x of its own. The question: does one
model's overload reach the other? Every decision (routing, queueing, shedding, expiry, windows) comes from
:class:`policies.admission_core.AdmissionCore`, one per model. Capacities are found by bisection, each model
alone, with the same criterion as the other experiments (99% of sent requests within the TTFT goal).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loadgen.fleet.bridge import fleet_requests
from loadgen.fleet.config import FleetConfig, FleetModel, FleetRequest
from loadgen.fleet.doc import table, write_section
from loadgen.fleet.experiments_common import GOOD, PROFILE, capacity, goals, parallel, scenario
from loadgen.fleet.provenance import stamp
from loadgen.fleet.records import RequestRecord
from loadgen.fleet.sim import simulate
from loadgen.report import percentile
from loadgen.scenario import generate_requests

SMALL_PROFILE = "llama-3.1-8b-h100"


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model of the experiment: its name, profile, workers, TTFT goal (ms) and offered rate (RPS)."""

    name: str
    profile: str
    workers: int
    goal_ms: float
    rate: float

    def fleet_model(self) -> FleetModel:
        """Its served model: the gateway's default core with its ``standard`` goal set to :attr:`goal_ms`."""
        core = FleetConfig().core
        return FleetModel(self.name, self.profile, self.workers, replace(core, classes=goals(self.slo())))

    def slo(self) -> dict[str, float]:
        """Its SLO by class, ms."""
        return {"standard": self.goal_ms}


SMALL = ModelLoad("llama-3.1-8b", SMALL_PROFILE, 2, 300.0, 0.0)
BIG = ModelLoad("llama-3.1-70b", PROFILE, 4, 500.0, 0.0)
MULTIPLES = (0.8, 2.0, 3.0)
"""The large model's offered rate, in multiples of its capacity."""
SMALL_LOAD = 0.8
"""The small model's offered rate, as a share of its capacity."""


def model_requests(m: ModelLoad, duration_s: float, warmup_s: float, seed: int = 1) -> list[FleetRequest]:
    """Poisson short prompts (150-250 words in, 50-150 tokens out) at ``m.rate`` RPS from one tenant of
    ``m``'s own, naming ``m``; request ids prefixed with the model's name."""
    tenant = m.name.replace(".", "-")  # scenario ids are [a-z0-9_-]
    sc = scenario(tenant, m.rate, duration_s, warmup_s, [{"id": f"{tenant}-app"}], m.slo(), seed=seed)
    return [replace(r, rid=f"{m.name}/{r.rid}", model=m.name) for r in fleet_requests(generate_requests(sc))]


def lane_figures(
    records: Sequence[RequestRecord], goal_ms: float, warmup_s: float, window_s: float
) -> dict[str, Any]:
    """One model's figures from its records after ``warmup_s``: sent, goodput (share of sent with TTFT <=
    ``goal_ms``), TTFT P50/P99 of served requests (ms), shed rate (503: shed, evicted or expired), good
    RPS over the ``window_s`` s of arrivals."""
    sent = [r for r in records if r.arrival_s >= warmup_s]
    ttfts = [r.ttft_s * 1000 for r in sent if r.outcome == "ok" and r.ttft_s is not None]
    good = sum(t <= goal_ms for t in ttfts)
    shed = sum(r.outcome in ("shed", "evicted", "expired") for r in sent)
    n = len(sent)
    return {
        "sent": n,
        "goodput": good / n if n else None,
        "p50": percentile(ttfts, 50),
        "p99": percentile(ttfts, 99),
        "shed_rate": shed / n if n else None,
        "good_rps": good / window_s,
    }


def run_models(
    loads: Sequence[ModelLoad], duration_s: float, warmup_s: float
) -> tuple[dict[str, dict[str, Any]], dict[str, list[tuple[str, str, float | None]]]]:
    """Simulate ``loads`` behind one gateway (one core each, in this order); per model its
    :func:`lane_figures` and its requests' ``(rid, outcome, first-token time)`` in arrival order."""
    config = FleetConfig(models=tuple(m.fleet_model() for m in loads))
    requests = [r for m in loads for r in model_requests(m, duration_s, warmup_s)]
    result = simulate(config, requests)
    figures, trace = {}, {}
    for m in loads:
        records = [r for r in result.records if r.model == m.name]
        figures[m.name] = lane_figures(records, m.goal_ms, warmup_s, duration_s - warmup_s)
        trace[m.name] = [(r.rid, str(r.outcome), r.first_token_s) for r in records]
    return figures, trace


def _meets(m: ModelLoad, rate: float, duration_s: float, warmup_s: float) -> bool:
    figures, _ = run_models([replace(m, rate=rate)], duration_s, warmup_s)
    goodput = figures[m.name]["goodput"]
    return goodput is not None and goodput >= GOOD


def lane_capacity(
    m: ModelLoad, lo: float, hi: float, steps: int = 7, duration_s: float = 60, warmup_s: float = 10
) -> float:
    """Highest rate (RPS, bisection in ``[lo, hi]``) at which ``m`` alone serves 99% of its requests
    within its goal."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _meets(m, mid, duration_s, warmup_s) else (lo, mid)
    return lo


def models_figures(
    duration_s: float = 60,
    warmup_s: float = 10,
    caps: tuple[float, float] | None = None,
    multiples: Sequence[float] = MULTIPLES,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The experiment's headline and one row per run.

    ``caps``: (small, large) capacities in RPS; None = found by bisection (the large model's is
    experiment 3's, :func:`loadgen.fleet.experiments_common.capacity`).
    """
    if caps is None:
        caps = (lane_capacity(SMALL, 20.0, 1500.0), capacity(BIG.workers, duration_s=duration_s))
    small = replace(SMALL, rate=SMALL_LOAD * caps[0])
    runs: list[tuple[str, list[ModelLoad]]] = [("small model alone", [small])]
    runs += [(f"with the large model at {k:g}x", [small, replace(BIG, rate=k * caps[1])]) for k in multiples]
    done = parallel(run_models, [(loads, duration_s, warmup_s) for _, loads in runs])
    alone_figures, alone_trace = done[0]
    rows = []
    for (label, loads), (figures, trace) in zip(runs, done, strict=True):
        rows.append(
            {
                "run": label,
                "big_rate": loads[1].rate if len(loads) > 1 else None,
                "figures": figures,
                "small_as_alone": trace[SMALL.name] == alone_trace[SMALL.name],
            }
        )
    worst = rows[-1]["figures"]
    head = {
        "experiment": "models",
        "small_capacity_rps": caps[0],
        "big_capacity_rps": caps[1],
        "small_rate_rps": small.rate,
        "small_goodput_alone": alone_figures[SMALL.name]["goodput"],
        "small_goodput_at_worst": worst[SMALL.name]["goodput"],
        "big_goodput_at_worst": worst[BIG.name]["goodput"] if BIG.name in worst else None,
        "big_good_rps_at_worst": worst[BIG.name]["good_rps"] if BIG.name in worst else None,
        "small_unaffected": all(r["small_as_alone"] for r in rows),
    }
    return head, rows


def exp_models(doc: Path | None = None) -> dict[str, Any]:
    """Experiment 5 (see the module docstring): its headline; its section goes into ``doc`` only when
    ``doc`` is given."""
    head, rows = models_figures()
    if doc is not None:
        write_models(doc, head, rows)
    return head


def write_models(doc: Path, head: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    """Experiment 5's section of ``doc``, from :func:`models_figures`' results."""
    lines = []
    for row in rows:
        for m in (SMALL, BIG):
            f = row["figures"].get(m.name)
            if f is None:
                continue
            rate = head["small_rate_rps"] if m is SMALL else row["big_rate"]
            lines.append(
                [
                    row["run"],
                    m.name,
                    f"{rate:.0f}",
                    f["sent"],
                    f["p50"],
                    f["p99"],
                    f["goodput"],
                    f["shed_rate"],
                ]
            )
    same = "identical, request for request," if head["small_unaffected"] else "**not** identical"
    body = f"""## 5. Two models, one overloaded (`python -m loadgen.fleet.experiments models`)

Two models behind one gateway, each with its own workers and its own admission core, as the gateway gives
each model of `RADIXGATE_MODELS` (`service/pipeline/served_models.py`; in the simulation
`loadgen.fleet.config.FleetModel`): `{SMALL.name}` on {SMALL.workers} workers `{SMALL.profile}` with a TTFT
goal of {SMALL.goal_ms:.0f} ms, and `{BIG.name}` on {BIG.workers} workers `{BIG.profile}` with
{BIG.goal_ms:.0f} ms (a per-model goal: the small model's is tighter). Short prompts (150-250 words in,
50-150 tokens out), one tenant per model, 60 s (10 s warm-up). Capacities, each model alone, by bisection
(99% of sent requests within the goal): small **{head["small_capacity_rps"]:.0f} RPS**, large
**{head["big_capacity_rps"]:.0f} RPS** (experiment 3's). The small model is offered
{SMALL_LOAD:.0%} of its capacity ({head["small_rate_rps"]:.0f} RPS) throughout, the large one 0.8x, 2x
and 3x of its own.

**Headline:** with the large model at 3x its capacity, the small model's goodput is
{head["small_goodput_at_worst"]:.1%} (alone: {head["small_goodput_alone"]:.1%}), and its requests'
outcomes and first-token times are {same} those of the run without the large model. The large model
serves {head["big_good_rps_at_worst"]:.0f} good requests/s of its {head["big_capacity_rps"]:.0f} RPS
capacity (goodput {head["big_goodput_at_worst"]:.1%} of what was sent): it sheds what it cannot serve in
time and does not collapse.

{table(["run", "model", "offered RPS", "sent", "TTFT P50 ms", "TTFT P99 ms", "goodput", "shed (503)"], lines)}

Reading: a request is queued, routed and shed only among its model's workers, by its model's core, with
that model's goals, windows and estimates; the large model's queue and its shedding never see the small
model's workers, and the small model's predictions never count the large model's backlog. What the models
share is the tenant (quotas are per tenant across models) and the gateway process, whose CPU the simulation
does not charge (`bench-gateway` measures it).

{stamp()}
"""
    write_section("models", body, doc)
