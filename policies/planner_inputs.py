"""What the planner decides from, measured on an admission core (pure; time comes in as arguments).

The gateway's planner task (``service/pipeline/planner_task.py``) and the fleet simulation's planner
controller (``loadgen/fleet/controllers.py``) both turn what one model's admission core measured into
:class:`policies.planner.PlannerInputs` with this module, so the simulated planner sees exactly what the
gateway's would:

1. :meth:`PlannerMeter.measure`, once an interval: per class, the arrival rate of every request that reached
   admission, shed ones included (:class:`policies.demand.DemandMeter`), its mean prompt and output lengths
   (the last measured ones while a class has no arrivals), and the requests queued now; the prompt and
   cached tokens of the requests answered; each eligible worker's capacity
   (:meth:`policies.estimates.WorkerEstimates.capacity`, requests/s at a full window), kept only from
   moments it ran full (its window at least :data:`FULL_FRACTION` used, or requests waiting for it: below
   saturation Little's law reads a short step and overstates it), scaled from this core's window share to
   the engine's whole window; the engines' running batch and KV usage (their load reports). With
   ``prior_capacity_rps``, a worker's capacity at the classes' goals from a profiling run (what Dynamo's
   SLA planner profiles before deployment: throughput per replica at the TTFT target), the measured
   capacity counts only where it is lower (a slower engine, a heavier mix): at a full window a worker
   completes more than it serves within the goals (the fleet experiment's mix: 36-40 requests/s measured
   running full, 25 within the goals), so a higher measure is throughput past the goals, not capacity
   at them. Without a prior, the measured capacity alone (the planner holds until there is one);
2. :func:`combine`: several gateway replicas' measures of one model as one (arrivals, queues and cache
   tokens add up; capacity, batch and KV usage average: every replica sees the same engines);
3. :meth:`PlannerMeter.inputs`: the combined measure as the planner's inputs, the worker model from the
   measured capacity (:meth:`policies.planner.EngineModel.from_capacity`) at the arrival-weighted mean
   output length, with the cache hit rate of the last interval that answered a prompt.

A measure is a plain dict (it rides on the replicas' heartbeats as JSON): ``{"classes": {band: [rate_rps,
prompt_tokens, output_tokens, queued]}, "capacity": rps | null, "window": W | null, "batch": running |
null, "kv": usage | null, "tokens": [prompt, cached]}``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace
from typing import Any

from policies.admission_types import WorkerSnapshot
from policies.demand import DemandCounts
from policies.planner import ClassDemand, EngineModel, PlannerInputs
from policies.windows import LoadReport

FULL_FRACTION = 0.9
"""A worker's capacity counts only while this share of its window runs (or requests wait for it)."""


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def combine(measures: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's measures of several replicas as one (module docstring, step 2)."""
    classes: dict[str, list[float]] = {}
    for m in measures:
        for band, (rate, prompt, output, queued) in m.get("classes", {}).items():
            # rate, rate x prompt, rate x output, queued, replicas that report it
            c = classes.setdefault(band, [0.0, 0.0, 0.0, 0.0, 0.0])
            c[0] += rate
            c[1] += rate * prompt if rate > 0 else 0.0
            c[2] += rate * output if rate > 0 else 0.0
            c[3] += queued
            c[4] += 1
    out: dict[str, list[float]] = {}
    for band, (rate, prompt, output, queued, n) in classes.items():
        if rate > 0:
            out[band] = [rate, prompt / rate, output / rate, queued]
        else:  # lengths unweighted: no arrivals to weigh them by
            firsts = [m["classes"][band] for m in measures if band in m.get("classes", {})]
            out[band] = [0.0, sum(f[1] for f in firsts) / n, sum(f[2] for f in firsts) / n, queued]
    windows: list[int] = [m["window"] for m in measures if m.get("window")]
    tokens = [m.get("tokens", [0, 0]) for m in measures]
    return {
        "classes": out,
        "capacity": _mean(m.get("capacity") for m in measures),
        "window": max(windows) if windows else None,
        "batch": _mean(m.get("batch") for m in measures),
        "kv": _mean(m.get("kv") for m in measures),
        "tokens": [sum(t[0] for t in tokens), sum(t[1] for t in tokens)],
    }


class PlannerMeter:
    """One model's measures between the planner's decisions (module docstring, steps 1 and 3).

    Args:
        prior_capacity_rps: a worker's capacity at the classes' goals from a profiling run, requests/s:
            the planner plans with it, or with the capacity measured running full where that is lower
            (None: with the measured one alone, and holds until a worker has been measured).
    """

    def __init__(self, prior_capacity_rps: float | None = None) -> None:
        self.prior_capacity_rps = prior_capacity_rps
        self._full: dict[str, float] = {}  # url -> capacity measured running full (whole engine window)
        self._lengths: dict[str, tuple[float, float]] = {}  # band -> last measured (prompt, output)
        self.hit_rate = 0.0  #: the cache hit rate of the last interval that answered a prompt (0-1)

    def measure(
        self,
        counts: DemandCounts,
        elapsed_s: float,
        bands: Iterable[str],
        depth: Mapping[str, int],
        snapshots: Iterable[WorkerSnapshot],
        loads: Mapping[str, LoadReport],
        eligible: Collection[str],
    ) -> dict[str, Any]:
        """This core's measure over the last ``elapsed_s`` seconds (> 0).

        Args:
            counts: the demand meter's counts of the interval (:meth:`policies.demand.DemandMeter.take`).
            elapsed_s: the interval's length, s.
            bands: the model's classes.
            depth: requests queued per band now.
            snapshots: the core's per-worker state (:meth:`policies.admission_core.AdmissionCore.snapshot`).
            loads: each worker's last load report (its ``max_running`` the engine's whole window).
            eligible: the URLs of the workers that take new requests now.
        """
        lengths = self._lengths
        classes: dict[str, list[float]] = {}
        for band in bands:
            c = counts.bands.get(band)
            if c is not None and c.requests:
                lengths[band] = (c.prompt_tokens / c.requests, max(1.0, c.output_tokens / c.requests))
            prompt, output = lengths.get(band, (0.0, 1.0))
            rate = c.requests / elapsed_s if c is not None else 0.0
            classes[band] = [rate, prompt, output, float(depth.get(band, 0))]
        full = self._full
        for url in [u for u in full if u not in eligible]:
            del full[url]
        runs, kvs, windows = [], [], []
        for snap in snapshots:
            if snap.url not in eligible:
                continue
            load = loads.get(snap.url)
            engine_window = load.max_running if load is not None and load.max_running else snap.window
            windows.append(engine_window)
            if load is not None:
                runs.append(float(load.running))
                kvs.append(load.kv_usage)
            saturated = snap.in_flight >= FULL_FRACTION * snap.window or snap.queued > 0
            if snap.capacity_rps and saturated and snap.window > 0:
                full[snap.url] = snap.capacity_rps * engine_window / snap.window
        measured = _mean(full.values()) if full else None
        prior = self.prior_capacity_rps
        capacity = prior if measured is None else measured if prior is None else min(prior, measured)
        return {
            "classes": classes,
            "capacity": capacity,
            "window": max(windows) if windows else None,
            "batch": _mean(runs),
            "kv": _mean(kvs),
            "tokens": [counts.prompt_tokens, counts.cached_tokens],
        }

    def inputs(self, m: dict[str, Any], goals_s: Mapping[str, float], workers: int) -> PlannerInputs:
        """The planner's inputs from a (combined) measure ``m``; ``goals_s``: each class's TTFT goal, s
        (classes without one are left out); ``workers``: the eligible workers now."""
        prompt, cached = m["tokens"]
        if prompt > 0:
            self.hit_rate = cached / prompt
        classes = {
            band: ClassDemand(rate, prompt_len, output_len, round(queued), goals_s[band])
            for band, (rate, prompt_len, output_len, queued) in m["classes"].items()
            if band in goals_s
        }
        engine = None
        capacity, window = m["capacity"], m["window"]
        rate = sum(c.arrival_rps for c in classes.values())
        if capacity and window and classes:
            if rate > 0:
                output = sum(c.arrival_rps * c.output_tokens for c in classes.values()) / rate
            else:
                output = max(c.output_tokens for c in classes.values())
            engine = EngineModel.from_capacity(capacity, window, output, self.hit_rate)
            engine = replace(engine, batch=m["batch"], kv_usage=m["kv"])
        return PlannerInputs(workers, classes, engine)


__all__ = ["FULL_FRACTION", "PlannerMeter", "combine"]
