"""Writing experiment results into ``docs/experiments.md`` and plots into ``docs/img/`` (matplotlib, Agg).

Each experiment owns one section between ``<!-- fleet:NAME -->`` and ``<!-- /fleet:NAME -->``; rerunning an
experiment replaces only its section, so the document is assembled by running each experiment once.
Plots are drawn with matplotlib's default style (whatever a ``matplotlibrc`` says) at a fixed size and dpi,
and saved without the ``Software`` entry (matplotlib's version), so the same figures give the same bytes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.style
from matplotlib.figure import Figure

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "experiments.md"
IMG = REPO / "docs" / "img"
DPI = 110
PNG_METADATA: dict[str, str | None] = {"Software": None}
"""PNG text chunks of every plot: none (matplotlib adds its version as ``Software`` otherwise; PNGs it
writes carry no date)."""


def img_dir(doc: Path) -> Path:
    """Where the plots of ``doc`` go: ``img/`` beside it (``docs/img`` for :data:`DOC`)."""
    return doc.parent / "img"


HEADER = """# Fleet experiments (virtual time)

Produced by `python -m loadgen.fleet.experiments NAME [--json]` (`loadgen/fleet/`): a discrete-event
simulation whose every scheduling decision (routing, queueing, shedding, expiry, windows) is made by the
gateway's own admission core (`policies/admission_core.py`, the object `service/pipeline/scheduler.py`
drives),
configured with the gateway's defaults, over simulated SGLang workers (`loadgen.sim.engine`, calibrated
profiles in `loadgen/sim/profiles.py`), fed by the same scenario planner as the HTTP load generator
(`loadgen.scenario.generate_requests`) and reported by the same code (`loadgen.report`). `python -m
loadgen.fleet.experiments all --json` prints each experiment's headline as one JSON object per line and
writes nothing; with `--write-doc` each fleet section below and its plot in `docs/img/` is rewritten by its
command (`flock /tmp/radixgate-heavy.lock .venv/bin/python -m loadgen.fleet.experiments all --write-doc`,
25-35 minutes on 2 cores). The numbers are deterministic for the code and the seeds: each fleet section
ends with the hash of the code that wrote it (`python -m loadgen.fleet.provenance`), and
`tests/loadgen/test_experiments_doc.py` fails when the code has changed since.

Percentiles: linear interpolation (NumPy's default). TTFT: arrival at the gateway to the first token at the
client. Goodput: share of sent requests that succeeded within their class's SLO. Shed rate: share answered
503 (shed at arrival, evicted, or expired in the queue). Rates (served, good) are counted over the arrival
window after the warm-up.
"""


def write_section(name: str, body: str, doc: Path = DOC) -> None:
    """Put ``body`` (markdown) into ``doc`` as section ``name``, replacing the previous one."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.exists() else HEADER
    start, end = f"<!-- fleet:{name} -->", f"<!-- /fleet:{name} -->"
    block = f"{start}\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = (
        pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    )
    doc.write_text(text)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def line_plot(
    path: Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float | None]]],
    xlabel: str,
    ylabel: str,
    title: str,
    hline: float | None = None,
    logy: bool = False,
) -> Path:
    """One line per series (x, y); an optional horizontal line (e.g. the SLO). Returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.style.context("default"):
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, (xs, ys) in series.items():
            pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        if hline is not None:
            ax.axhline(hline, color="grey", linestyle="--", linewidth=1)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        _save(fig, path)
    return path


def bar_plot(
    path: Path, groups: Sequence[str], bars: Mapping[str, Sequence[float]], ylabel: str, title: str
) -> Path:
    """Grouped bars: one group per ``groups`` entry, one bar per ``bars`` key. Returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.style.context("default"):
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / max(1, len(bars))
        for i, (label, values) in enumerate(bars.items()):
            ax.bar([g + i * width for g in range(len(groups))], values, width, label=label)
        ax.set_xticks([g + width * (len(bars) - 1) / 2 for g in range(len(groups))], groups)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
        _save(fig, path)
    return path


def _save(fig: Figure, path: Path) -> None:
    """Lay out, save (PNG, :data:`DPI`, :data:`PNG_METADATA`) and close ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, metadata=PNG_METADATA)
    plt.close(fig)
