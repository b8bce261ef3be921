"""The report of a run: pure functions over request records (no I/O, no clock), plus a rich table printer.

Definitions (all over the *measured* requests: those that arrived after the warm-up):

- Percentiles: linear interpolation between closest ranks (NumPy's default ``linear`` method).
- TTFT: time to the first non-empty content chunk of a streamed request, ms. TPOT: (E2E − TTFT) /
  (completion tokens − 1), ms. E2E: send to last byte, ms. ITL: gaps between content chunks, ms.
- Throughput: successful requests, prompt and completion tokens per second of the measurement window
  (from ``warmup_s`` to the last measured request's end).
- Goodput: the share of sent requests that succeeded *and* met their class's SLO. A streamed request must
  meet ``ttft_ms``, ``tpot_ms`` (if set) and ``e2e_ms`` (if set); a non-streamed one has no TTFT, so it must
  finish within ``e2e_ms`` if set, else within ``ttft_ms + tpot_ms × (completion tokens − 1)``.
- Shed rate: share answered 503 (the gateway's load shedding or queue expiry); rate-limited: share answered
  429 (quota); errors: any other failure (status or transport).
- Cache hit rate: Σ cached prompt tokens / Σ prompt tokens (``usage.prompt_tokens_details.cached_tokens``)
  over the successful requests whose server reported cached tokens; ``None`` if none did.
- Jain fairness index J = (Σx)² / (n Σx²) over tenants of the same class and weight (equal-weight peers),
  with x = each tenant's completion tokens/s (``jain_throughput``) and x = served share of its demanded
  tokens (``jain_demand``: completion tokens / Σ max_tokens sent). J = 1 is perfectly even, 1/n worst;
  peers none of whom was served (``served_any`` false) are printed as undefined, not as 1.
  Source: R. Jain, D. Chiu, W. Hawe, "A Quantitative Measure of Fairness and Discrimination for Resource
  Allocation in Shared Computer Systems", DEC-TR-301, 1984.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from loadgen.runner import RequestRecord
from loadgen.scenario import ClassSLO, Scenario


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def latency_summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """Count, mean and P50/P90/P99 (same unit as the values)."""
    return {
        "n": len(values),
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index (Σx)² / (n Σx²); ``None`` for no values, 1.0 when all are zero."""
    if not values:
        return None
    squares = sum(x * x for x in values)
    if squares == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * squares)


def meets_slo(rec: RequestRecord, slo: ClassSLO | None) -> bool:
    """Whether a request succeeded and met its class's SLO (rules in the module docstring)."""
    if not rec.ok or rec.e2e_ms is None:
        return False
    if slo is None:
        return True
    if slo.e2e_ms is not None and rec.e2e_ms > slo.e2e_ms:
        return False
    if rec.stream:
        if rec.ttft_ms is None or rec.ttft_ms > slo.ttft_ms:
            return False
        tpot = rec.tpot_ms
        return not (slo.tpot_ms is not None and tpot is not None and tpot > slo.tpot_ms)
    if slo.e2e_ms is not None:
        return True
    budget = slo.ttft_ms + (slo.tpot_ms or 0.0) * max(0, (rec.completion_tokens or 1) - 1)
    return rec.e2e_ms <= budget


def group_figures(
    records: Sequence[RequestRecord], slo: Mapping[str, ClassSLO], window_s: float
) -> dict[str, Any]:
    """Counts, rates, latencies, throughput, goodput and cache hit rate of one group of records."""
    sent = len(records)
    ok = [r for r in records if r.ok]
    good = [r for r in records if meets_slo(r, slo.get(r.priority_class))]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    completion = sum(r.completion_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]  # servers that report cached tokens at all
    reported_prompt = sum(r.prompt_tokens or 0 for r in reported)
    n429 = sum(r.status == 429 for r in records)
    n503 = sum(r.status == 503 for r in records)
    window = max(window_s, 1e-9)
    return {
        "sent": sent,
        "ok": len(ok),
        "status_429": n429,
        "status_503": n503,
        "errors": sent - len(ok) - n429 - n503,
        "shed_rate": n503 / sent if sent else None,
        "rate_limited_rate": n429 / sent if sent else None,
        "error_rate": (sent - len(ok) - n429 - n503) / sent if sent else None,
        "ttft_ms": latency_summary([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": latency_summary([t for r in ok if (t := r.tpot_ms) is not None]),
        "e2e_ms": latency_summary([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "itl_ms": latency_summary([x for r in ok for x in r.itl_ms]),
        "throughput_rps": len(ok) / window,
        "prompt_tokens_per_s": prompt / window,
        "completion_tokens_per_s": completion / window,
        "goodput": len(good) / sent if sent else None,
        "goodput_rps": len(good) / window,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "cache_hit_rate": cached / reported_prompt if reported_prompt else None,
        "demanded_tokens": sum(r.max_tokens for r in records),
    }


def _by(records: Iterable[RequestRecord], key: str) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[str(getattr(r, key))].append(r)
    return dict(sorted(groups.items()))


def fairness(scenario: Scenario, tenants: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Jain indices over each set of ≥ 2 equal-weight tenants of one class.

    ``tenants``: per-tenant figures from :func:`group_figures`.
    """
    peers: dict[tuple[str, float], list[str]] = defaultdict(list)
    for t in scenario.tenants:
        if t.id in tenants:
            peers[(t.priority_class, t.weight)].append(t.id)
    out = []
    for (cls, weight), ids in sorted(peers.items()):
        if len(ids) < 2:
            continue
        tput = [float(tenants[i]["completion_tokens_per_s"]) for i in ids]
        demand = [
            tenants[i]["completion_tokens"] / tenants[i]["demanded_tokens"]
            for i in ids
            if tenants[i]["demanded_tokens"]
        ]
        out.append(
            {
                "priority_class": cls,
                "weight": weight,
                "tenants": ids,
                "jain_throughput": jain_index(tput),
                "jain_demand": jain_index(demand),
                "served_any": any(tenants[i]["completion_tokens"] for i in ids),
            }
        )
    return out


def timeline(records: Sequence[RequestRecord], bin_s: float) -> dict[str, Any]:
    """Per time bin (``bin_s`` s, by send time for latency, end time for throughput): sent/ok/429/503 per s,
    completion tokens/s, and TTFT/E2E P50/P99 (ms) overall and TTFT P50 per class."""
    if not records:
        return {"bin_s": bin_s, "t_s": []}
    n_bins = max(1, math.ceil(max(max(r.done_s, r.sent_s) for r in records) / bin_s))

    def idx(t: float) -> int:
        return min(n_bins - 1, max(0, int(t / bin_s)))

    sent = [0] * n_bins
    ok = [0] * n_bins
    r429 = [0] * n_bins
    r503 = [0] * n_bins
    tokens = [0] * n_bins
    ttft: list[list[float]] = [[] for _ in range(n_bins)]
    e2e: list[list[float]] = [[] for _ in range(n_bins)]
    ttft_cls: dict[str, list[list[float]]] = defaultdict(lambda: [[] for _ in range(n_bins)])
    for r in records:
        i = idx(r.sent_s)
        sent[i] += 1
        r429[i] += r.status == 429
        r503[i] += r.status == 503
        if r.ok:
            j = idx(r.done_s)
            ok[j] += 1
            tokens[j] += r.completion_tokens or 0
            if r.ttft_ms is not None:
                ttft[i].append(r.ttft_ms)
                ttft_cls[r.priority_class][i].append(r.ttft_ms)
            if r.e2e_ms is not None:
                e2e[i].append(r.e2e_ms)
    return {
        "bin_s": bin_s,
        "t_s": [i * bin_s for i in range(n_bins)],
        "sent_rps": [x / bin_s for x in sent],
        "ok_rps": [x / bin_s for x in ok],
        "status_429_rps": [x / bin_s for x in r429],
        "status_503_rps": [x / bin_s for x in r503],
        "completion_tokens_per_s": [x / bin_s for x in tokens],
        "ttft_p50_ms": [percentile(b, 50) for b in ttft],
        "ttft_p99_ms": [percentile(b, 99) for b in ttft],
        "e2e_p50_ms": [percentile(b, 50) for b in e2e],
        "e2e_p99_ms": [percentile(b, 99) for b in e2e],
        "ttft_p50_ms_by_class": {
            c: [percentile(b, 50) for b in bins] for c, bins in sorted(ttft_cls.items())
        },
    }


def build_report(
    scenario: Scenario, records: Sequence[RequestRecord], run: Mapping[str, Any], bin_s: float | None = None
) -> dict[str, Any]:
    """The whole report as a JSON-ready dict (``run``: the runner's figures: wall_s, cpu_s, send_lag_ms)."""
    measured = [r for r in records if not r.warmup]
    end = max((r.done_s for r in measured), default=scenario.warmup_s)
    window = max(1e-9, end - scenario.warmup_s)
    classes = {
        c: group_figures(rs, scenario.slo, window) for c, rs in _by(measured, "priority_class").items()
    }
    tenants = {t: group_figures(rs, scenario.slo, window) for t, rs in _by(measured, "tenant").items()}
    total_sent = max(1, len(measured))
    total_completion = max(1, sum(t["completion_tokens"] for t in tenants.values()))
    for t, figures in tenants.items():
        figures["priority_class"] = scenario.tenant(t).priority_class if t in _ids(scenario) else None
        figures["offered_share"] = figures["sent"] / total_sent
        figures["served_share"] = figures["completion_tokens"] / total_completion
    lags = [float(x) for x in run.get("send_lag_ms", [])]
    wall = float(run.get("wall_s", 0.0))
    cpu = float(run.get("cpu_s", 0.0))
    return {
        "scenario": scenario.name,
        "base_url": run.get("base_url"),
        "planned": len(records),
        "measured": len(measured),
        "warmup_s": scenario.warmup_s,
        "window_s": window,
        "slo": {c: s.model_dump() for c, s in scenario.slo.items()},
        "overall": group_figures(measured, scenario.slo, window),
        "classes": classes,
        "tenants": tenants,
        "fairness": fairness(scenario, tenants),
        "loadgen": {
            "wall_s": wall,
            "cpu_s": cpu,
            "cpu_cores": cpu / wall if wall > 0 else None,
            "cpu_ms_per_request": 1000 * cpu / len(records) if records else None,
            "send_lag_ms": latency_summary(lags) | {"max": max(lags, default=None)},
        },
        "timeline": timeline(records, bin_s or max(1.0, scenario.duration_s / 60)),
    }


def _ids(scenario: Scenario) -> set[str]:
    return {t.id for t in scenario.tenants}


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v:.1%}"


def _outcomes(sections: Sequence[Mapping[str, Mapping[str, Any]]]) -> Table:
    table = Table(title="requests (measured)", title_justify="left")
    for col in ("", "sent", "ok", "429", "503", "err", "req/s", "out tok/s", "goodput", "cache hit"):
        table.add_column(col, justify="left" if not col else "right")
    for name, g in ((n, g) for groups in sections for n, g in groups.items()):
        if name in ("all", next(iter(sections[-1]), None)):
            table.add_section()  # classes | all | tenants
        table.add_row(
            name, str(g["sent"]), str(g["ok"]), str(g["status_429"]), str(g["status_503"]), str(g["errors"]),
            f"{g['throughput_rps']:.2f}", f"{g['completion_tokens_per_s']:.0f}", _pct(g["goodput"]),
            _pct(g["cache_hit_rate"]),
        )  # fmt: skip
    return table


def _latencies(sections: Sequence[Mapping[str, Mapping[str, Any]]]) -> Table:
    table = Table(title="latency ms: p50 / p90 / p99", title_justify="left")
    for col in ("", "TTFT", "TPOT", "E2E"):
        table.add_column(col, justify="left" if not col else "right")
    for name, g in ((n, g) for groups in sections for n, g in groups.items()):
        if name in ("all", next(iter(sections[-1]), None)):
            table.add_section()  # classes | all | tenants
        table.add_row(
            name,
            *(
                " / ".join(_ms(g[m][p]) for p in ("p50", "p90", "p99"))
                for m in ("ttft_ms", "tpot_ms", "e2e_ms")
            ),
        )
    return table


def print_report(report: Mapping[str, Any], console: Console | None = None) -> None:
    """Print the report: per class and per tenant tables, fairness, and the load generator's own load."""
    console = console or Console()
    o = report["overall"]
    console.print(
        f"[bold]{report['scenario']}[/] → {report['base_url']}: {report['measured']} measured of "
        f"{report['planned']} planned over {report['window_s']:.1f} s (warm-up {report['warmup_s']:g} s)"
    )
    sections = [report["classes"], {"all": o}, report["tenants"]]  # classes, all, then tenants
    console.print(_outcomes(sections))
    console.print(_latencies(sections))
    for f in report["fairness"]:
        names = ", ".join(f["tenants"])
        peers = f"Jain fairness, {f['priority_class']} tenants of weight {f['weight']:g} ({names})"
        if not f.get("served_any", True):  # all at zero: even, but nothing to compare (nu17)
            console.print(f"{peers}: none of them was served (undefined)")
            continue
        console.print(
            f"{peers}: throughput {_num(f['jain_throughput'])}, served/demanded {_num(f['jain_demand'])}"
        )
    lg = report["loadgen"]
    lag = lg["send_lag_ms"]
    console.print(
        f"load generator: {lg['cpu_s']:.2f} s CPU in {lg['wall_s']:.1f} s wall = "
        f"{_num(lg['cpu_cores'])} cores ({_ms(lg['cpu_ms_per_request'])} ms a request); "
        f"send lag p50 {_ms(lag['p50'])} ms, p99 {_ms(lag['p99'])} ms, max {_ms(lag['max'])} ms"
    )


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}"
