"""Discrete-event simulation of the gateway and its SGLang workers in virtual time.

The gateway's decisions are made by :class:`policies.admission_core.AdmissionCore`, the very object the
gateway's asyncio scheduler drives; this module only feeds it events in virtual time and plays the parts
that are I/O in the gateway: HTTP and Redis are direct calls, the workers are
:class:`loadgen.fleet.engine.FleetEngine` (same model as the simulated HTTP worker).

1. arrival (+ ``gateway_latency_s``): quota, 1 request and ``prompt + max_tokens`` tokens from the tenant's
   buckets (:mod:`loadgen.fleet.quota` over ``policies.token_bucket``) -> 429 / 413; then
   ``core.arrive`` -> dispatched, queued or shed (503);
2. a dispatch submits the request to its worker's engine with its class's SGLang priority;
3. engine steps: first token -> ``core.first_token`` (TTFT); last token -> ``core.finish`` (releases the
   slot, feeds the engine's cached tokens back to the router, dispatches what now fits), the quota is
   reconciled with the real usage;
4. ``core.tick`` at ``core.next_deadline()``: queued requests past their deadline expire (503);
5. every ``core.load_report_interval_s``: ``core.load`` with each engine's ``num_running_reqs``,
   ``num_queue_reqs``, ``token_usage`` and ``max_running_requests`` (what the gateway reads from
   ``/metrics`` and ``/server_info``).

A changing worker count (driven by :mod:`loadgen.fleet.scaling`): :meth:`FleetSim.start_worker` asks for a
worker that joins its model's core after a cold start; :meth:`FleetSim.stop_worker` cancels a starting one,
or drains a serving one (no new requests, its queued ones placed elsewhere, its running ones finish) and
removes it once empty; :meth:`FleetSim.call_at` runs a callback at a virtual time (a controller's ticks).
Each lane counts its demand (:class:`policies.demand.DemandMeter`, as the gateway's scheduler does) and
keeps each worker's last load report, for the planner.

The event loop is one ``heapq`` of ``(time, seq, kind, payload)``; planned arrivals are merged from a
sorted list rather than pushed. Equal inputs and seed give equal results. Times are virtual seconds.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loadgen.fleet.config import FleetConfig, FleetModel, FleetRequest
from loadgen.fleet.engine import FleetEngine
from loadgen.fleet.quota import TenantBuckets
from loadgen.fleet.records import FleetResult, RequestRecord, WorkerTally
from loadgen.fleet.replicas import LaneCore, lane_cores
from loadgen.sim.engine import SimRequest
from loadgen.sim.tokens import TOKEN_PATTERN, token_id
from policies.admission_types import AdmissionRequest, Decision, Dispatch, Shed
from policies.cost import reserved_tokens
from policies.demand import DemandMeter
from policies.windows import LoadReport

_STEP, _EXPIRY, _POLL, _TIMER = 0, 1, 2, 3


class PseudoTokenizer:
    """``loadgen.sim.tokens.tokenize`` with a per-instance memo of each piece's id (same ids, faster)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def __call__(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text``."""
        ids = self._ids
        out = []
        for piece in TOKEN_PATTERN.findall(text):
            tid = ids.get(piece)
            if tid is None:
                tid = ids[piece] = token_id(piece)
            out.append(tid)
        return tuple(out)


@dataclass(slots=True)
class _Job:
    """A request the gateway holds: its record, prompt ids, cost and its model's lane."""

    record: RequestRecord
    ids: tuple[int, ...]
    cost: int
    lane: _Lane


@dataclass(slots=True)
class _Lane:
    """One served model: its admission core (the gateway's, one per model; one per replica with
    ``FleetConfig.replicas``), its workers' size, its demand (counted as the gateway's scheduler counts
    it) and each worker's last load report."""

    index: int
    model: FleetModel
    core: LaneCore
    max_running: int
    demand: DemandMeter = field(default_factory=DemandMeter)
    loads: dict[str, LoadReport] = field(default_factory=dict)


@dataclass(slots=True)
class _Worker:
    """One simulated worker: its engine and its tallies (the gateway's view of it is in the core); ``state``
    is ``starting`` (cold start), ``ready``, ``draining`` or ``stopped``."""

    index: int
    url: str
    engine: FleetEngine
    tally: WorkerTally
    lane: _Lane
    in_flight: int = 0
    scheduled: float | None = None
    busy_since: float | None = None
    jobs: dict[str, _Job] = field(default_factory=dict)
    state: str = "ready"


class FleetSim:
    """One run of the gateway in front of its simulated workers: ``config.workers`` of one model, or each
    of ``config.models``' workers, every model with its own admission core (as the gateway has).

    Args:
        config: fleet and gateway settings.
        requests: planned requests (any order; sorted by arrival here).

    Raises:
        ValueError: a request names a model that ``config`` does not serve.

    Use ``FleetSim(config, requests).run()`` once per instance. :attr:`core` is the first model's core
    (with ``config.replicas`` > 1, its replicas' cores: :class:`loadgen.fleet.replicas.GatewayReplicas`).
    """

    def __init__(self, config: FleetConfig, requests: Iterable[FleetRequest]) -> None:
        self.config = config
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.rid))
        models = config.served_models()
        cores = lane_cores(
            [m.core for m in models],
            config.replicas,
            config.balance,
            config.seed,
            config.share_windows,
            config.share_routes,
            config.route_sync_delay_s,
        )
        self.lanes = [
            _Lane(k, m, cores[k], m.sim_profile().max_running_requests) for k, m in enumerate(models)
        ]
        self._lane_of: dict[str | None, _Lane] = {lane.model.name: lane for lane in self.lanes}
        self._lane_of[None] = self.lanes[0]
        unknown = sorted({str(r.model) for r in self.requests if r.model not in self._lane_of})
        if unknown:
            raise ValueError(f"requests name models the fleet does not serve: {', '.join(unknown)}")
        self.workers: list[_Worker] = []
        self._by_url: dict[str, _Worker] = {}
        for lane in self.lanes:
            for _ in range(lane.model.workers):
                # the gateway reads max_running_requests from /server_info when it first sees a worker
                lane.core.add_worker(self._new_worker(lane).url, lane.max_running)
        self.core = self.lanes[0].core
        self.buckets = TenantBuckets()
        self._tokenize = PseudoTokenizer()
        self._jobs: dict[str, _Job] = {}
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = itertools.count()
        self._timers: dict[int, Callable[[float], None]] = {}
        self._timer_ids = itertools.count()
        self._next_arrival = 0
        self._expiry_at: float | None = None
        self._now = 0.0
        self._events = 0
        self._ran = False

    # ----- event loop ------------------------------------------------------------------------------------
    def run(self, until_s: float | None = None) -> FleetResult:
        """Simulate every planned request to its end (or until ``until_s``); returns the records.

        Raises:
            RuntimeError: called twice.
        """
        if self._ran:
            raise RuntimeError("a FleetSim runs once")
        self._ran = True
        cpu0 = time.process_time()
        cfg = self.config
        records: list[RequestRecord] = []
        arrivals = self.requests
        nxt = 0
        lag = cfg.gateway_latency_s
        for lane in self.lanes:
            self._push(lane.model.core.load_report_interval_s, _POLL, lane.index)
        heap = self._heap
        while True:
            arrival_t = arrivals[nxt].arrival_s + lag if nxt < len(arrivals) else None
            if arrival_t is not None and (not heap or arrival_t < heap[0][0]):
                t = arrival_t
                if until_s is not None and t > until_s:
                    break
                self._now = t
                records.append(self._arrive(arrivals[nxt], t))
                nxt += 1
                self._events += 1
                self._schedule_expiry()
                continue
            if not heap:
                break
            t, _, kind, payload = heapq.heappop(heap)
            if until_s is not None and t > until_s:
                break
            self._now = t
            self._events += 1
            if kind == _STEP:
                self._step(self.workers[payload], t)
            elif kind == _EXPIRY:
                if t == self._expiry_at:
                    self._expiry_at = None
                for lane in self.lanes:
                    self._apply(lane.core.tick(t), t)
            elif kind == _TIMER:
                self._next_arrival = nxt
                self._timers.pop(payload)(t)
            elif not self._idle(nxt):
                lane = self.lanes[payload]
                self._poll(lane, t)
                self._push(t + lane.model.core.load_report_interval_s, _POLL, payload)
            self._schedule_expiry()
        preempted = sum(w.engine.stats().preemptions_total for w in self.workers)
        for w in self.workers:
            if w.busy_since is not None:
                w.tally.busy_s += self._now - w.busy_since
        return FleetResult(
            records=records,
            workers=[w.tally for w in self.workers],
            duration_s=self._now,
            cpu_s=time.process_time() - cpu0,
            events=self._events,
            preemptions=preempted,
        )

    def _push(self, t: float, kind: int, payload: int) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def _schedule_expiry(self) -> None:
        deadlines = [d for d in (lane.core.next_deadline() for lane in self.lanes) if d is not None]
        deadline = min(deadlines) if deadlines else None
        if deadline is not None and (self._expiry_at is None or deadline < self._expiry_at):
            self._expiry_at = deadline
            self._push(deadline, _EXPIRY, 0)

    def _idle(self, next_arrival: int) -> bool:
        return next_arrival >= len(self.requests) and not self._jobs

    def _reschedule(self, w: _Worker) -> None:
        t = w.engine.next_event_time()
        if t is not None and t != w.scheduled:
            w.scheduled = t
            self._push(t, _STEP, w.index)
        elif t is None:
            w.scheduled = None

    # ----- gateway ---------------------------------------------------------------------------------------
    def _arrive(self, req: FleetRequest, now: float) -> RequestRecord:
        cfg = self.config
        spec = cfg.tenant(req.tenant)
        band = cfg.class_of(req)
        lane = self._lane_of[req.model]
        ids = self._tokenize(req.prompt) or (0,)
        cost = reserved_tokens(len(ids), req.max_tokens)
        rec = RequestRecord(
            req.rid, req.tenant, band, req.arrival_s, len(ids), req.max_tokens, model=lane.model.name
        )
        verdict = self.buckets.reserve(spec, cost, now)
        if not verdict.allowed:
            rec.outcome = "too_large" if verdict.never else "quota"
            return rec
        self._jobs[req.rid] = _Job(rec, ids, cost, lane)
        lane.demand.arrive(band, len(ids), req.max_tokens)
        decisions = lane.core.arrive(
            AdmissionRequest(
                req.rid, spec.id, band, req.prompt, len(ids), req.max_tokens, now, spec.weight, req.session_id
            ),
            now,
        )
        self._apply(decisions, now)
        return rec

    def _apply(self, decisions: list[Decision], now: float) -> None:
        for d in decisions:
            job = self._jobs.get(d.rid)
            if job is None:
                continue
            rec = job.record
            if isinstance(d, Dispatch):
                self._dispatch(job, self._by_url[d.worker], d, now)
                continue
            del self._jobs[d.rid]
            if isinstance(d, Shed):
                rec.outcome = "evicted" if d.reason == "evicted" else "shed"
                rec.shed_reason = d.reason
            else:
                rec.outcome = "expired"
                if d.in_engine and rec.worker is not None:  # the gateway ends its worker request
                    w = self.workers[rec.worker]
                    w.engine.abort(d.rid)
                    self._detach(w, d.rid, now)
                    self._reschedule(w)
            self.buckets.give_back(self.config.tenant(rec.tenant), 1, job.cost, now)

    def _dispatch(self, job: _Job, w: _Worker, d: Dispatch, now: float) -> None:
        rec = job.record
        rec.dispatch_s, rec.worker, rec.route_reason = now, w.index, d.route.reason
        w.in_flight += 1
        w.tally.requests += 1
        w.tally.peak_in_flight = max(w.tally.peak_in_flight, w.in_flight)
        if w.busy_since is None:
            w.busy_since = now
        w.jobs[rec.rid] = job
        priority = w.lane.model.core.classes[rec.band].sglang_priority
        w.engine.submit(
            SimRequest(rec.rid, job.ids, rec.max_tokens, priority), now + self.config.network_latency_s
        )
        self._reschedule(w)

    def _step(self, w: _Worker, t: float) -> None:
        if w.scheduled != t:
            return  # superseded
        w.scheduled = None
        lat = self.config.network_latency_s
        quiet = w.engine.quiet
        decisions: list[Decision] = []
        for ev in w.engine.advance(t):
            if ev is quiet:
                continue
            job = w.jobs.get(ev.rid)
            if job is None:
                continue
            rec = job.record
            if ev.completion_tokens == 1:
                rec.first_token_s = ev.time_s + lat
                rec.cached_tokens = ev.cached_tokens
                decisions += w.lane.core.first_token(rec.rid, ev.time_s + lat, ev.cached_tokens)
            if ev.finish_reason is not None:
                rec.done_s = ev.time_s + lat
                rec.completion_tokens = ev.completion_tokens
                rec.outcome = "ok"
                decisions += self._release(w, job, ev.time_s)
        self._reschedule(w)
        if decisions:
            self._apply(decisions, t)

    def _detach(self, w: _Worker, rid: str, now: float) -> None:
        """``rid`` no longer runs on ``w`` (finished or aborted)."""
        del w.jobs[rid]
        w.in_flight -= 1
        if w.in_flight == 0 and w.busy_since is not None:
            w.tally.busy_s += now - w.busy_since
            w.busy_since = None
        if w.in_flight == 0 and w.state == "draining":
            self._retire(w, now)

    def _release(self, w: _Worker, job: _Job, now: float) -> list[Decision]:
        rec = job.record
        self._detach(w, rec.rid, now)
        self._jobs.pop(rec.rid, None)
        tally = w.tally
        tally.prompt_tokens += rec.prompt_tokens
        tally.cached_tokens += rec.cached_tokens
        tally.completion_tokens += rec.completion_tokens
        used = rec.prompt_tokens + rec.completion_tokens
        self.buckets.give_back(self.config.tenant(rec.tenant), 0, job.cost - used, now)
        w.lane.demand.answered(rec.prompt_tokens, rec.cached_tokens)
        return w.lane.core.finish(
            rec.rid, now, ok=True, prompt_tokens=rec.prompt_tokens, cached_tokens=rec.cached_tokens
        )

    def _poll(self, lane: _Lane, now: float) -> None:
        decisions: list[Decision] = []
        core = lane.core
        for w in self.workers:
            if w.lane is not lane or w.state in ("starting", "stopped"):
                continue
            stats = w.engine.stats()
            report = LoadReport(
                stats.num_running_reqs, stats.num_queue_reqs, stats.token_usage, lane.max_running
            )
            lane.loads[w.url] = report
            decisions += core.load(w.url, report, now)
            window = core.window(w.url)
            w.tally.window_sizes.append(window.size if window is not None else 0)
        self._apply(decisions, now)

    # ----- changing worker count (loadgen.fleet.scaling drives these) ------------------------------------
    def _new_worker(self, lane: _Lane, state: str = "ready", now: float = 0.0) -> _Worker:
        """A new worker of ``lane`` (not yet in its core), numbered after every worker so far."""
        i = len(self.workers)
        j = sum(w.lane is lane for w in self.workers)
        url = f"sim://worker-{i:03d}" if not self.config.models else f"sim://{lane.model.name}/worker-{j:03d}"
        engine = FleetEngine(lane.model.sim_profile(), seed=self.config.seed * 1000 + i)
        ready = now if state == "ready" else None
        w = _Worker(i, url, engine, WorkerTally(started_s=now, ready_s=ready), lane, state=state)
        self.workers.append(w)
        self._by_url[url] = w
        return w

    @property
    def now(self) -> float:
        """The virtual time of the event being run, s."""
        return self._now

    @property
    def finished(self) -> bool:
        """No planned arrival left and nothing in flight or queued (as of the last timer callback)."""
        return self._idle(self._next_arrival)

    def call_at(self, t: float, fn: Callable[[float], None]) -> None:
        """Run ``fn(t)`` at virtual time ``t`` (s) during :meth:`run` (after what is due before it)."""
        key = next(self._timer_ids)
        self._timers[key] = fn
        self._push(t, _TIMER, key)

    def start_worker(self, now: float, cold_start_s: float, lane: int = 0) -> str:
        """Ask for a worker of lane ``lane`` at ``now``: it joins the lane's core ``cold_start_s`` later
        (the gateway reads its ``max_running_requests`` then). Returns its URL."""
        w = self._new_worker(self.lanes[lane], "starting", now)
        self.call_at(now + cold_start_s, lambda t: self._ready(w, t))
        return w.url

    def _ready(self, w: _Worker, now: float) -> None:
        if w.state != "starting":
            return  # cancelled while starting
        w.state, w.tally.ready_s = "ready", now
        lane = w.lane
        lane.core.add_worker(w.url, lane.max_running)
        # the gateway's first poll of a new worker: an empty engine, which lets its queue flow there at once
        report = LoadReport(0, 0, 0.0, lane.max_running)
        lane.loads[w.url] = report
        self._apply(lane.core.load(w.url, report, now), now)

    def stop_worker(self, url: str, now: float) -> None:
        """A starting worker is cancelled at once; a ready one drains: the core sends it nothing new and
        places its queued requests elsewhere, its running requests finish, then it is removed.

        Raises:
            KeyError: an unknown URL.
        """
        w = self._by_url[url]
        if w.state == "starting":
            w.state, w.tally.stopped_s = "stopped", now
        elif w.state == "ready":
            w.state = "draining"
            self._apply(w.lane.core.set_eligible(url, False, now), now)
            if w.in_flight == 0:
                self._retire(w, now)

    def _retire(self, w: _Worker, now: float) -> None:
        """A drained worker leaves its core."""
        w.state, w.tally.stopped_s = "stopped", now
        w.lane.loads.pop(w.url, None)
        self._apply(w.lane.core.remove_worker(w.url, now), now)

    def worker_states(self, lane: int = 0) -> dict[str, str]:
        """Each worker of lane ``lane`` ever asked for, by URL: its state."""
        return {w.url: w.state for w in self.workers if w.lane is self.lanes[lane]}


def simulate(
    config: FleetConfig, requests: Iterable[FleetRequest], until_s: float | None = None
) -> FleetResult:
    """Run ``requests`` through a fleet built from ``config`` (see :class:`FleetSim`)."""
    return FleetSim(config, requests).run(until_s)
