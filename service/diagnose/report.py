"""A :class:`policies.diagnosis_types.Diagnosis` as a ranked table (``rich``) or as JSON (``--json``: the
same data, times in seconds, shares 0..1)."""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from policies.diagnosis_types import Diagnosis, Evidence


def as_json(diagnosis: Diagnosis, source: str) -> dict[str, Any]:
    """The diagnosis as JSON-ready data (``source``: where the window came from, in words): ``window``
    (``span_s``, ``served``, the gateway's ``ttft_p99_s``, ``e2e_p99_s``, ``tpot_p99_s``), ``causes``
    (the named verdicts, ranked; empty: no cause), ``rejected`` (the others, with their figures),
    ``notes``."""

    causes = [{"rank": i + 1, **dataclasses.asdict(v)} for i, v in enumerate(diagnosis.verdicts)]
    return {
        "source": source,
        "window": {
            "span_s": diagnosis.span_s,
            "served": diagnosis.served,
            "ttft_p99_s": diagnosis.ttft_p99,
            "e2e_p99_s": diagnosis.e2e_p99,
            "tpot_p99_s": diagnosis.tpot_p99,
        },
        "causes": causes,
        "rejected": [dataclasses.asdict(v) for v in diagnosis.rejected],
        "notes": list(diagnosis.notes),
    }


def seconds(value: float | None) -> str:
    """A duration in words: ``850 us``, ``12.3 ms``, ``1.25 s``; ``-`` for None."""
    if value is None:
        return "-"
    if value < 0.001:
        return f"{value * 1e6:.0f} us"
    if value < 1:
        return f"{value * 1000:.1f} ms"
    return f"{value:.2f} s"


def figure(value: float | None, unit: str) -> str:
    """An evidence value in its unit."""
    if value is None:
        return "-"
    if unit == "s":
        return seconds(value)
    if unit == "ratio":
        return f"{value * 100:.0f}%" if abs(value) >= 0.1 or value == 0 else f"{value * 100:.1f}%"
    if unit == "times":
        return f"{value:.1f}x"
    if unit == "tokens/s":
        return f"{value:,.0f} tokens/s"
    return f"{value:,.1f}" if value != int(value) else f"{value:,.0f}"


def _evidence(rows: tuple[Evidence, ...]) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False, padding=(0, 1))
    for e in rows:
        against = f"{e.against} {figure(e.reference, e.unit)}" if e.reference is not None else ""
        table.add_row(Text(e.what, style="dim"), figure(e.value, e.unit), Text(against, style="dim"))
    return table


def render(diagnosis: Diagnosis, source: str, console: Console) -> None:
    """Print the diagnosis: a headline, the ranked causes with their evidence, the notes."""
    console.print(
        f"[bold]Window[/bold] {diagnosis.span_s:.1f} s from {source}: {diagnosis.served:.0f} requests "
        "served; "
        f"TTFT P99 {seconds(diagnosis.ttft_p99)}, E2E P99 {seconds(diagnosis.e2e_p99)}, "
        f"TPOT P99 {seconds(diagnosis.tpot_p99)}"
    )
    if not diagnosis.verdicts:
        console.print("[bold green]No cause[/bold green]: nothing stands out in this window.")
    else:
        table = Table(title="Where the latency went, ranked", show_lines=True)
        table.add_column("#", justify="right")
        table.add_column("cause")
        table.add_column("score", justify="right")
        table.add_column("adds", justify="right")
        table.add_column("evidence")
        for rank, v in enumerate(diagnosis.verdicts, 1):
            cause = Text(v.cause, style="bold")
            cause.append(f"\n{v.title}", style="")
            if v.worker:
                cause.append(f"\n{v.worker}", style="cyan")
            if v.consequence_of:
                cause.append(f"\n(consequence of {v.consequence_of})", style="yellow")
            adds = f"{seconds(v.explained_s)}\nof {v.of}"
            why = Group(Text(v.summary), _evidence(v.evidence))
            table.add_row(str(rank), cause, f"{v.score:.2f}", adds, why)
        console.print(table)
    for note in diagnosis.notes:
        console.print(f"[yellow]note[/yellow]: {note}")
