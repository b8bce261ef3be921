"""Experiment 7 of :mod:`loadgen.fleet.experiments` (its command line runs it): the planner over a day.

``python -m loadgen.fleet.experiments planner [--write-doc]``: the runs and figures are
:mod:`loadgen.fleet.planner_runs`' (the trace :mod:`loadgen.fleet.planner_trace`'s); this module writes
the section of ``docs/experiments.md`` and its plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.style

from loadgen.fleet.doc import DPI, PNG_METADATA, img_dir, table, write_section
from loadgen.fleet.experiments_common import PROFILE
from loadgen.fleet.planner_runs import (
    GPUS_PER_WORKER,
    ORACLE_HEADROOMS,
    POLICIES,
    Setup,
    headline,
    meets_goodput,
    planner_figures,
)
from loadgen.fleet.provenance import stamp

LABELS = {
    "planner": "planner (radixgate)",
    "oracle": "oracle (knows the trace)",
    "queue rule": "waiting > 5 per worker (vLLM production-stack, KEDA)",
    "saturation rule": "KV > 0.8 or waiting > 5 (llm-d WVA)",
}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _yes(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def workers_plot(path: Path, figures: dict[str, Any], setup: Setup) -> Path:
    """Workers held per minute of the day for each policy, and the demand in workers' worth."""
    day = setup.day
    rows = figures["rows"]
    minutes = list(range(len(rows["planner"]["held"])))
    path.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.style.context("default"):
        fig, ax = plt.subplots(figsize=(8, 4.2))
        xs = [m / 10 for m in range(0, int(day.day_s / 6))]
        ax.plot(
            [x for x in xs],
            [day.multiple(x * 60) * day.scale for x in xs],
            color="grey",
            linewidth=1,
            label="demand, workers' worth",
        )
        for name in POLICIES:
            ax.step(minutes, rows[name]["held"], where="mid", label=LABELS[name], linewidth=1.4)
        ax.set_xlabel("minute of the day")
        ax.set_ylabel("workers held (8 H100 each)")
        ax.set_title(
            f"Workers over the day ({day.speed:g}x time-lapse, cold start {setup.cold_start_s:.0f} s)"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        fig.savefig(path, dpi=DPI, metadata=PNG_METADATA)
        plt.close(fig)
    return path


def write_planner(doc: Path, figures: dict[str, Any], setup: Setup) -> None:
    """Experiment 7's section of ``doc`` and its plot, from :func:`planner_figures`' results."""
    day, rows, v = setup.day, figures["rows"], figures["verdicts"]
    oracle = rows["oracle"]["gpu_hours"]
    names = [c.name for c in setup.mix]
    lines = []
    for name in POLICIES:
        r = rows[name]
        lines.append(
            [
                LABELS[name],
                f"{r['gpu_hours']:.0f}",
                f"{r['gpu_hours'] / oracle:.3f}",
                *(_pct(r["goodput_outside"][n]) for n in names),
                *(_pct(r["goodput_all"][n]) for n in names),
                f"{r['changes']} ({r['changes_per_10min']:.2f})",
                r["peak_workers"],
            ]
        )
    header = [
        "policy",
        "GPU-hours",
        "ratio to oracle",
        *(f"{n} goodput outside burst" for n in names),
        *(f"{n} goodput overall" for n in names),
        "direction changes at steady load (per 10 min)",
        "peak workers",
    ]
    p = rows["planner"]
    goals = [
        [
            "interactive >= 99% and standard >= 95% outside the burst",
            ", ".join(f"{n} {_pct(p['goodput_outside'][n])}" for n in names),
            _yes(v["goodput"]),
        ],
        ["GPU-hours <= 1.15x the oracle's", f"{v['ratio']:.3f}x", _yes(v["ratio_ok"])],
        [
            "<= 1 change of direction per 10 minutes at steady load",
            f"{p['changes']} in {sum(b - a for a, b in day.steady()) / 60:.0f} steady minutes "
            f"({p['changes_per_10min']:.2f} per 10 min)",
            _yes(v["changes_ok"]),
        ],
    ]
    for name, r in v["rules"].items():
        how = (
            "same goodput, more GPU-hours"
            if r["same_goodput"]
            else "the rule misses the goodput goals"
            if not meets_goodput(rows[name], setup.mix)
            else "the rule's goodput is higher"
        )
        goals.append(
            [
                f"beats the {LABELS[name]} on GPU-hours at the same goodput",
                f"{p['gpu_hours']:.0f} vs {r['gpu_hours']:.0f} GPU-hours; {how}",
                _yes(r["beaten"]),
            ]
        )
    img = workers_plot(img_dir(doc) / "fleet-planner.png", figures, setup)
    b0, b1 = day.burst_window
    reasons = ", ".join(f"{k} {n}" for k, n in sorted(p["extra"].get("reasons", {}).items()))
    mix = "; ".join(
        f"`{c.name}` {c.share:.0%} of the arrivals, {c.prompt_words[0]}-{c.prompt_words[1]} words in, "
        f"{c.output_tokens[0]}-{c.output_tokens[1]} tokens out, TTFT goal {c.goal_ms:.0f} ms"
        for c in setup.mix
    )
    pc = setup.planner
    oracles = "; ".join(
        f"headroom {o['headroom']:.0%}: {o['gpu_hours']:.0f} GPU-hours, goodput outside the burst "
        + ", ".join(f"{n} {_pct(o['goodput_outside'][n])}" for n in names)
        for o in figures["oracles"]
    )
    body = f"""## 7. The planner over a day (`python -m loadgen.fleet.experiments planner`)

The gateway's planner (`policies/planner.py`, fed by `policies/planner_inputs.py` exactly as the gateway's
planner task feeds it: the demand counted at admission, the queues, the engines' load reports, capacity)
scales a fleet of `{PROFILE}` workers through a day, against an oracle that knows the trace and the two
threshold rules the anchors use, on the same trace and the same simulation (`loadgen/fleet/scaling.py`,
`loadgen/fleet/controllers.py`). A worker asked for serves **{setup.cold_start_s:.0f} s** later (a 70B TP-8
SGLang worker: weights loaded onto 8 GPUs and CUDA graphs captured; sources in `loadgen/fleet/config.py`)
and costs {GPUS_PER_WORKER} GPUs from the moment it is asked for until it has drained.

**Trace** (`loadgen/fleet/planner_trace.py`): a day of {day.day_s / 60:.0f} minutes: 0.3x for
{day.low_s / 60:.0f} min, a half-cosine ramp to 2x over {day.ramp_s / 60:.0f} min, 2x for
{day.peak_s / 60:.0f} min with a {day.burst_s:.0f} s burst at 3x from minute {b0 / 60:.1f} to
{b1 / 60:.1f}, back to 0.3x over {day.ramp_s / 60:.0f} min and 0.3x for {day.tail_s / 60:.0f} min, where
1x is {day.scale:.0f} workers' capacity at the goals, {figures["unit_rps"]:.2f} requests/s per worker
(measured first by bisection: the highest rate per worker at which 4 workers meet both goodput goals at a
constant rate). Classes: {mix}; Poisson arrivals. **Time-lapse:** the day runs {day.speed:g}x faster in
the simulation: every duration of the day, the cold start and every controller's period are divided by
{day.speed:g}; the requests (goals, lengths, engine step times, the admission core's estimates) are not.
The scaling problem keeps its proportions (the cold start against the ramps and the controllers'
periods); requests live a few seconds, far below every scaled period. Times here are the day's.

**Policies.** *Planner*: the gateway's defaults (every {pc.interval_s:.0f} s; forecast {
        pc.cold_start_s + pc.interval_s:.0f} s ahead, the cold start plus one interval; target utilization
{pc.target_utilization:g}; down only to the highest need of the last {pc.scale_down_window_s:.0f} s and
only while the load projected onto N-1 workers stays under {pc.scale_down_margin:g} x the target; the
trend used in proportion to its evidence from {pc.forecast.trend_z:g} standard errors; a rise taken once the
need less {pc.scale_up_z:g} standard errors of its counts asks for more, a fall only while the need plus {
        pc.scale_down_z:g} still fits), with the
profiling run's capacity as `planner.prior_capacity_rps`. *Oracle*: per minute, the fewest workers that
serve that minute's peak rate (burst left out) at the measured capacity per worker times (1 + headroom),
asked for one cold start ahead (`OracleController`), with the smallest headroom of {
        ", ".join(f"{h:.0%}" for h in ORACLE_HEADROOMS)
    } whose run meets both goodput goals: the fewest workers that meet the goal ({
        oracles
    }). *Waiting > 5* (vLLM production-stack's
KEDA trigger on `num_requests_waiting`, here the requests waiting for a worker in the gateway plus in its
engine): the HPA that KEDA creates, `ceil(total waiting / 5)` every 15 s, up by at most max(+100%, +4) per
sync, down to the highest recommendation of the last 300 s and by one worker per minute at most (the
sensible scale-down: the bare HPA drops to the floor once nothing waits). *KV > 0.8* (llm-d's Workload
Variant Autoscaler, saturation analyzer with its defaults): every 60 s on each replica's peak over the last
minute, a replica is saturated at KV usage 0.8 or 5 waiting; one more when the unsaturated replicas' mean
spare KV < 0.1 or spare queue < 3 (none while one is starting), one fewer when their load spread over one
fewer still leaves those spares. On this traffic the KV cache never nears 0.8 (a batch of 512 requests of
about 1,000 tokens fills 40% of the 1.2M-token pool), so its queue half is what scales.

![Workers over the day]({img.relative_to(doc.parent).as_posix()})

{table(header, lines)}

GPU-hours are the day's ({GPUS_PER_WORKER} GPUs per worker, from the request to the end of the drain).
Goodput: share of the sent requests whose first token came within the class's goal (shed requests count
as misses); outside the burst leaves out the arrivals from the burst's start to one standard goal after
its end. Direction changes: reversals of the policy's decision (a rise followed by a fall or the reverse)
within the steady stretches (the three plateaus, burst included:
{sum(b - a for a, b in day.steady()) / 60:.0f} minutes). The planner's decisions by reason: {reasons}.

{table(["goal (issue 29)", "figure", "verdict"], goals)}

{stamp()}
"""
    write_section("planner", body, doc)


def exp_planner(doc: Path | None = None) -> dict[str, Any]:
    """Experiment 7: its headline; its section and plot go into ``doc`` (and ``img/`` beside it) only when
    ``doc`` is given."""
    figures = planner_figures()
    if doc is not None:
        write_planner(doc, figures, Setup(unit_rps=figures["unit_rps"]))
    return headline(figures)


__all__ = ["LABELS", "exp_planner", "workers_plot", "write_planner"]
