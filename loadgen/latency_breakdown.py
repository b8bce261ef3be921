"""Where served requests' time to first token went, from the gateway's own request log.

Each request the gateway served logs one JSON ``request`` line
(:meth:`service.pipeline.dispatch.Dispatcher._settle`)
with ``ttft_ms`` (arrival at the gateway to first token), ``queued_ms`` (the wait in the gateway's queue)
and ``predicted_ttft_ms`` (what admission control predicted). The rest of the TTFT, ``ttft_ms - queued_ms``,
is the worker's: its own queue, the prefill, and any wait behind other prefills or preemptions. Splitting
the two tells whether a tail comes from the gateway's windows or from the engine, and the ratio of
predicted to measured TTFT tells how far admission's prediction can be trusted.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def read_request_lines(path: Path) -> dict[str, dict[str, Any]]:
    """``request_id`` -> the ``request`` log line of every request in the JSON-lines log at ``path`` (other
    lines, and lines that are not JSON, are skipped; a missing file reads as empty)."""
    entries: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return entries
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if '"request"' not in line:  # a cheap first sieve; the JSON decides
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("event") == "request" and entry.get("request_id"):
                entries[str(entry["request_id"])] = entry
    return entries


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def breakdown(
    request_ids: Mapping[str, Iterable[str]], entries: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Per class (``request_ids``: class -> ids of its requests), over those served (status 200 with a
    TTFT) and found in ``entries``: how many, P50/P99 of ``queued_ms`` and of the engine's part
    (``ttft_ms - queued_ms``), and, over those with a prediction (> 0), the median and P90 of measured /
    predicted TTFT and the share measured above predicted. NaN where there is nothing to count."""
    rows = []
    for cls, rids in request_ids.items():
        served = [
            e
            for rid in rids
            if (e := entries.get(rid)) is not None and e.get("status") == 200 and e.get("ttft_ms") is not None
        ]
        queued = [float(e.get("queued_ms") or 0.0) for e in served]
        engine = [float(e["ttft_ms"]) - q for e, q in zip(served, queued, strict=True)]
        ratios = [
            float(e["ttft_ms"]) / float(e["predicted_ttft_ms"]) for e in served if e.get("predicted_ttft_ms")
        ]
        rows.append(
            {
                "class": cls,
                "served": len(served),
                "queued_p50_ms": _pct(queued, 0.5),
                "queued_p99_ms": _pct(queued, 0.99),
                "engine_p50_ms": _pct(engine, 0.5),
                "engine_p99_ms": _pct(engine, 0.99),
                "predicted": len(ratios),
                "measured_over_predicted_p50": _pct(ratios, 0.5),
                "measured_over_predicted_p90": _pct(ratios, 0.9),
                "above_prediction": sum(r > 1.0 for r in ratios) / len(ratios) if ratios else float("nan"),
            }
        )
    return rows


__all__ = ["breakdown", "read_request_lines"]
