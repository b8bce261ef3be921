"""Fleet experiments in virtual time: their headline figures, and with ``--write-doc`` their sections of
``docs/experiments.md`` and plots in ``docs/img/``.

``python -m loadgen.fleet.experiments NAME [--json] [--write-doc [--doc PATH]]`` with NAME one of:

- ``workers``: smallest number of Llama-3.1-70B TP-8 workers serving 1,000 RPS of short prompts (~200 words
  in, 50-150 tokens out) with 99% of requests' TTFT < 500 ms (a shed request counts as a miss), with the
  gateway's default windows (derived from the engine) against fixed windows and the rejected alternatives;
- ``routing``: cache-aware vs round robin on 400 shared system prompts of ~4,000 words: the highest rate
  meeting the SLO, then served RPS and hit rate at 1.5x, 2x and 3x that rate (no congestion collapse);
- ``overload``: three classes at 2x the fleet's capacity: per-class goodput and P99 TTFT;
- ``fairness``: one tenant at 10x the rate of nine others of equal weight at 1.5x capacity: per-tenant
  goodput and Jain's index, WFQ vs first-come-first-served;
- ``models``: two models behind one gateway, each with its own workers and admission core: a small one at
  80% of its capacity while a large one is offered 0.8x, 2x and 3x of its own (:mod:`.experiments_models`);
- ``replicas``: the same load (80% and 120% of 4 workers' capacity) through 1, 2, 3 and 4 gateway replicas,
  each with its own admission core and its share of each worker's window: goodput and TTFT per class
  against one replica's (:mod:`.experiments_replicas`);
- ``planner``: the gateway's planner scaling Llama-3.1-70B TP-8 workers (each serving a cold start after it
  is asked for) through a day-shaped trace, against an oracle that knows the trace and the two threshold
  rules of vLLM's production-stack and llm-d (:mod:`.experiments_planner`);
- ``all``: all seven.

Every run drives :class:`policies.admission_core.AdmissionCore`, the gateway's own scheduler, configured by
the gateway's defaults unless a variant says otherwise. The classes' TTFT goals are set to the scenario's
SLOs, as an operator would. ``--json`` prints one JSON object per experiment with its headline figures.
Without ``--write-doc`` nothing is written; with it, each experiment replaces its section of the document
(``--doc``, default ``docs/experiments.md``; plots in ``img/`` beside it), stamped with the hash of the code
that ran (:mod:`loadgen.fleet.provenance`). Runs go to a process pool (one process per CPU). Everything is
deterministic for the code and the seeds used here: the same code gives the same document, byte for byte.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadgen.fleet import experiments_load, experiments_models, experiments_planner, experiments_replicas
from loadgen.fleet.doc import DOC, img_dir, line_plot, table, write_section
from loadgen.fleet.experiments_common import PROFILE, fleet, parallel, scenario, smallest_fleet
from loadgen.fleet.provenance import stamp
from loadgen.scenario import Scenario
from policies.windows import WindowConfig

DEFAULT_WINDOW = WindowConfig()
ALTERNATIVES: dict[str, WindowConfig] = {
    "fixed 256": WindowConfig(mode="fixed", initial=256, minimum=256, maximum=256),
    "fixed 512": WindowConfig(mode="fixed", initial=512, minimum=512, maximum=512),
    "AIMD (first round's default: 8 → 1..256)": WindowConfig(mode="aimd", initial=8, maximum=256),
    "engine + TTFT target (½ goal)": WindowConfig(ttft_target_fraction=0.5),
}


# ----------------------------------------------------------------------------------------- experiment 1
def _workers_scenario(rate: float = 1000, duration_s: float = 30, warmup_s: float = 10) -> Scenario:
    tenants = [{"id": "app", "priority_class": "standard"}]
    return scenario("workers-1000rps", rate, duration_s, warmup_s, tenants, {"standard": 500})


def _search(window: WindowConfig, lo: int, hi: int, rate: float, duration_s: float) -> tuple[int | None, Any]:
    sc = _workers_scenario(rate, duration_s, min(10.0, duration_s / 3))
    return smallest_fleet(sc, fleet(1, {"standard": 500}, window=window), lo, hi)


def workers_figures(
    rate: float = 1000, duration_s: float = 30, bounds: tuple[int, int] = (12, 48)
) -> tuple[dict[str, Any], dict[str, tuple[int | None, list[dict[str, Any]]]]]:
    """Experiment 1's headline (``default_workers``, ``best_fixed_workers``) and every search it ran."""
    variants = {"engine-derived (default)": DEFAULT_WINDOW, **ALTERNATIVES}
    found = parallel(_search, [(w, *bounds, rate, duration_s) for w in variants.values()])
    results = dict(zip(variants, found, strict=True))
    fixed = [n for n, w in variants.items() if w.mode == "fixed" and results[n][0] is not None]
    best_fixed = min((results[n][0] for n in fixed), default=None)
    head = {
        "experiment": "workers",
        "default_workers": results["engine-derived (default)"][0],
        "best_fixed_workers": best_fixed,
        "workers_by_window": {n: r[0] for n, r in results.items()},
        "rate_rps": rate,
    }
    return head, results


def exp_workers(doc: Path | None = None) -> dict[str, Any]:
    """Experiment 1 (see the module docstring): its headline; its section and plot go into ``doc`` (and
    ``img/`` beside it) only when ``doc`` is given."""
    head, results = workers_figures()
    if doc is not None:
        write_workers(doc, head, results)
    return head


def write_workers(
    doc: Path, head: dict[str, Any], results: dict[str, tuple[int | None, list[dict[str, Any]]]]
) -> None:
    """Experiment 1's section of ``doc`` and its plot, from :func:`workers_figures`' results."""
    rows, series = [], {}
    for label, (_, runs) in results.items():
        runs = sorted(runs, key=lambda s: s["workers"])
        series[label] = ([float(s["workers"]) for s in runs], [s["p99"] for s in runs])
        rows += [
            [label, s["workers"], s["p50"], s["p99"], s["goodput"], s["shed_rate"], _windows(s["windows"])]
            for s in runs
        ]
    img = line_plot(
        img_dir(doc) / "fleet-workers.png",
        series,
        "workers (Llama-3.1-70B, TP 8, H100)",
        "P99 TTFT of served requests, ms (log)",
        "1,000 RPS, ~210 tokens in / ~100 out",
        hline=500,
        logy=True,
    )
    answers = "; ".join(
        f"{n}: {r if r is not None else '> 48'}" for n, r in head["workers_by_window"].items()
    )
    body = f"""## 1. Workers for 1,000 RPS of short prompts (`python -m loadgen.fleet.experiments workers`)

Scenario: one tenant, Poisson 1,000 requests/s for 30 s (first 10 s warm-up, not reported), prompts of
150-250 words (≈ 210 tokens with the chat template), `max_tokens` uniform 50-150 (`ignore_eos`), profile
`{PROFILE}` (NIM-calibrated, see `loadgen/sim/README.md`; SGLang's `max_running_requests` 512). Criterion:
99% of the sent requests get their first token within 500 ms (a shed request counts as a miss). Bisection over
the worker count; every run it made is listed. All variants run the gateway's admission core with its defaults
(cache-aware routing, SLO-aware admission); only the window controller differs.

**Smallest fleet:** {answers}. The default needs **{head["default_workers"]}** workers, the best fixed window
**{head["best_fixed_workers"]}**.

![P99 TTFT vs workers]({img.relative_to(doc.parent).as_posix()})

{table(["window", "workers", "TTFT P50 ms", "TTFT P99 ms", "goodput", "shed", "windows (min-max)"], rows)}

Reading: the default window grows (slow start) to what the engine reports it can run at once,
`max_running_requests` = 512, and shrinks only when the engine keeps requests waiting or its KV cache fills;
so each worker runs at its own concurrency and the gateway costs no GPUs. Rejected alternatives:
the first round's AIMD (shrinks on any short engine queue, then grows by one request per second) keeps
windows far below the engine's capacity; a TTFT target on the engine (shrink when its TTFT passes half the
goal) holds here, where TTFT hardly depends on the window, but collapses windows to one request on the
prefill-heavy traffic of experiment 2 (TTFT there is the prefill, not the concurrency). Fixed windows need the
engine's size to be known and configured per model and GPU.

{stamp()}
"""
    write_section("workers", body, doc)


def _windows(sizes: Sequence[int | None]) -> str:
    vals = [v for v in sizes if v is not None]
    return f"{min(vals)}-{max(vals)}" if vals else "-"


Experiment = Callable[[Path | None], dict[str, Any] | list[dict[str, Any]]]


def registry() -> dict[str, Experiment]:
    """The experiments by name, in the order ``all`` runs them (looked up at call time)."""
    return {
        "workers": exp_workers,
        "routing": experiments_load.exp_routing,
        "overload": experiments_load.exp_overload,
        "fairness": experiments_load.exp_fairness,
        "models": experiments_models.exp_models,
        "replicas": experiments_replicas.exp_replicas,
        "planner": experiments_planner.exp_planner,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the named experiments and print their headlines (JSON lines with ``--json``);
    with ``--write-doc``, also write their sections of ``--doc`` and their plots."""
    table_of = registry()
    ap = argparse.ArgumentParser(
        prog="python -m loadgen.fleet.experiments",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the list of experiments a list
    )
    ap.add_argument("name", choices=[*table_of, "all"])
    ap.add_argument("--json", action="store_true", help="print one JSON object per line and experiment")
    ap.add_argument(
        "--write-doc",
        action="store_true",
        help="write each experiment's section of --doc and its plots (default: write nothing)",
    )
    ap.add_argument(
        "--doc",
        type=Path,
        default=DOC,
        help="the document --write-doc rewrites; plots go to img/ beside it (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    doc: Path | None = args.doc if args.write_doc else None
    for name in table_of if args.name == "all" else [args.name]:
        t0 = time.monotonic()
        try:
            result = table_of[name](doc)
        except KeyboardInterrupt:
            print(f"interrupted during {name}: its figures were not written", file=sys.stderr)
            return 130
        print(f"{name}: {time.monotonic() - t0:.0f} s wall", file=sys.stderr, flush=True)
        lines = result if isinstance(result, list) else [result]
        for line in lines:
            print(json.dumps(line, default=str) if args.json else f"== {name}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
