"""Discrete-event simulation of the gateway and its SGLang workers in virtual time.

It drives the project's own decision code the way ``service/scheduler.py`` and ``service/dispatch.py``
do, with the HTTP and Redis parts replaced by direct calls and the workers by
:class:`loadgen.sim.engine.SimEngine` (same profiles as the simulated HTTP worker):

1. arrival (+ ``gateway_latency_s``): quota, 1 request and ``prompt + max_tokens`` tokens from the tenant's
   buckets (:mod:`loadgen.fleet.quota` over ``policies.token_bucket``) -> 429 / 413;
2. ``policies.shedding.decide_admission`` with the ``DispatchRate`` of dispatched tokens -> 503 shed, or
   queue in ``policies.fair_queue.PriorityBands`` (evicting the newest of a lower band when the whole
   queue is full);
3. pump: while the head of the queue fits some worker's ``policies.admission.ConcurrencyWindow`` (the top
   band gets the headroom), route it among those workers with the ``policies.routing`` router, count it in
   flight, record its tokens in the dispatch rate and submit it to the worker's engine with its class's
   SGLang priority;
4. engine steps: first token -> TTFT, last token -> release the slot, feed the engine's cached tokens back
   to the router, reconcile the quota with the real usage, pump;
5. every ``expiry_interval_s``: expire queued requests past their band's budget (503), pump; every
   ``load_poll_interval_s``: each window adapts to its engine's ``num_queue_reqs`` and ``token_usage``
   (what the gateway reads from ``/metrics``), pump.

The event loop is one ``heapq`` of ``(time, seq, kind, payload)``; planned arrivals are merged from a
sorted list rather than pushed. Equal inputs and seed give equal results. Times are virtual seconds.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from loadgen.fleet.config import FleetConfig, FleetRequest
from loadgen.fleet.engine import FleetEngine
from loadgen.fleet.quota import TenantBuckets
from loadgen.fleet.records import FleetResult, RequestRecord, WorkerTally
from loadgen.sim.engine import SimRequest
from loadgen.sim.tokens import TOKEN_PATTERN, token_id
from policies.admission import ConcurrencyWindow
from policies.cost import reserved_tokens
from policies.fair_queue import BandConfig, PriorityBands, QueuedItem
from policies.routing import RouteDecision, Router, WorkerView, make_router
from policies.shedding import DispatchRate, decide_admission

_STEP, _EXPIRY, _POLL = 0, 1, 2


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
    """A request the gateway holds: its record, prompt ids, cost and routing decision."""

    record: RequestRecord
    prompt: str
    ids: tuple[int, ...]
    cost: int
    weight: float
    session_id: str | None
    decision: RouteDecision | None = None


@dataclass(slots=True)
class _Worker:
    """One simulated worker and the gateway's view of it."""

    index: int
    url: str
    engine: FleetEngine
    window: ConcurrencyWindow
    tally: WorkerTally
    in_flight: int = 0
    in_flight_tokens: int = 0
    scheduled: float | None = None
    busy_since: float | None = None
    jobs: dict[str, _Job] = field(default_factory=dict)

    def view(self) -> WorkerView:
        return WorkerView(self.url, True, self.in_flight, self.in_flight_tokens)


class FleetSim:
    """One run of the gateway in front of ``config.workers`` simulated workers.

    Args:
        config: fleet and gateway settings.
        requests: planned requests (any order; sorted by arrival here).

    Use ``FleetSim(config, requests).run()`` once per instance.
    """

    def __init__(self, config: FleetConfig, requests: Iterable[FleetRequest]) -> None:
        self.config = config
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.rid))
        profile = config.sim_profile()
        self.workers = [
            _Worker(
                i,
                f"sim://worker-{i:03d}",
                FleetEngine(profile, seed=config.seed * 1000 + i),
                ConcurrencyWindow(config.window),
                WorkerTally(),
            )
            for i in range(config.workers)
        ]
        self._by_url = {w.url: w for w in self.workers}
        self.bands: PriorityBands[_Job] = PriorityBands(
            [
                BandConfig(name, c.rank, c.max_queue_len, c.wait_budget_s, c.min_share)
                for name, c in config.classes.items()
            ]
        )
        self._top_band = max(config.classes, key=lambda n: config.classes[n].rank)
        self.router: Router = make_router(config.routing, cache_aware=config.cache_aware)
        self.rate = DispatchRate()
        self.buckets = TenantBuckets()
        self._tokenize = PseudoTokenizer()
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = itertools.count()
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
        self._push(cfg.expiry_interval_s, _EXPIRY, 0)
        self._push(cfg.load_poll_interval_s, _POLL, 0)
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
            elif self._idle(nxt):
                continue  # nothing left to tick for: let the heap run dry
            elif kind == _EXPIRY:
                self._expire(t)
                self._push(t + cfg.expiry_interval_s, _EXPIRY, 0)
            else:
                self._poll(t)
                self._push(t + cfg.load_poll_interval_s, _POLL, 0)
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

    def _idle(self, next_arrival: int) -> bool:
        return (
            next_arrival >= len(self.requests)
            and len(self.bands) == 0
            and not any(w.in_flight for w in self.workers)
        )

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
        ids = self._tokenize(req.prompt) or (0,)
        cost = reserved_tokens(len(ids), req.max_tokens)
        rec = RequestRecord(req.rid, req.tenant, band, req.arrival_s, len(ids), req.max_tokens)
        verdict = self.buckets.reserve(spec, cost, now)
        if not verdict.allowed:
            rec.outcome = "too_large" if verdict.never else "quota"
            return rec
        flow = spec.id if cfg.fair_queuing else "*"
        decision = decide_admission(
            self.bands, band, flow, spec.weight, cost, self.rate.rate(now), cfg.max_queue_total
        )
        if not decision.admit:
            rec.outcome, rec.shed_reason = "shed", decision.reason
            self.buckets.give_back(spec, 1, cost, now)
            return rec
        if decision.evict_band is not None:
            victim = self.bands.queue(decision.evict_band).newest()
            if victim is not None:
                self.bands.remove(victim)
                self._fail(victim.payload, "evicted", now)
        job = _Job(rec, req.prompt, ids, cost, spec.weight, req.session_id)
        budget = cfg.classes[band].wait_budget_s
        self.bands.push(QueuedItem(job, flow, spec.weight, float(cost), band, now, now + budget))
        self._pump(now)
        return rec

    def _fail(self, job: _Job, outcome: str, now: float) -> None:
        rec = job.record
        rec.outcome = "evicted" if outcome == "evicted" else "expired"
        self.buckets.give_back(self.config.tenant(rec.tenant), 1, job.cost, now)

    def _pump(self, now: float) -> None:
        bands, workers = self.bands, self.workers
        while (head := bands.peek()) is not None:
            top = head.band == self._top_band
            cost = head.payload.cost
            views = [
                w.view() for w in workers if w.window.has_room(w.in_flight, w.in_flight_tokens, cost, top)
            ]
            if not views:
                return
            job = head.payload
            decision = self.router.choose(views, job.prompt, now, session_id=job.session_id)
            if decision is None:
                return
            popped = bands.pop()
            assert popped is head
            self.rate.record(now, cost)
            self._dispatch(job, self._by_url[decision.url], decision, now)

    def _dispatch(self, job: _Job, w: _Worker, decision: RouteDecision, now: float) -> None:
        rec = job.record
        rec.dispatch_s, rec.worker, rec.route_reason = now, w.index, decision.reason
        job.decision = decision
        w.in_flight += 1
        w.in_flight_tokens += job.cost
        w.tally.requests += 1
        if w.busy_since is None:
            w.busy_since = now
        w.jobs[rec.rid] = job
        priority = self.config.classes[rec.band].sglang_priority
        w.engine.submit(
            SimRequest(rec.rid, job.ids, rec.max_tokens, priority), now + self.config.network_latency_s
        )
        self._reschedule(w)

    def _step(self, w: _Worker, t: float) -> None:
        if w.scheduled != t:
            return  # superseded
        w.scheduled = None
        lat = self.config.network_latency_s
        finished = False
        quiet = w.engine.quiet
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
            if ev.finish_reason is not None:
                rec.done_s = ev.time_s + lat
                rec.completion_tokens = ev.completion_tokens
                rec.outcome = "ok"
                self._release(w, job, ev.time_s)
                finished = True
        self._reschedule(w)
        if finished:
            self._pump(t)

    def _release(self, w: _Worker, job: _Job, now: float) -> None:
        rec = job.record
        del w.jobs[rec.rid]
        w.in_flight -= 1
        w.in_flight_tokens -= job.cost
        if w.in_flight == 0 and w.busy_since is not None:
            w.tally.busy_s += now - w.busy_since
            w.busy_since = None
        tally = w.tally
        tally.prompt_tokens += rec.prompt_tokens
        tally.cached_tokens += rec.cached_tokens
        tally.completion_tokens += rec.completion_tokens
        predicted = job.decision.matched_chars if job.decision else None
        self.router.observe_cached_tokens(w.url, job.prompt, rec.cached_tokens, rec.prompt_tokens, predicted)
        used = rec.prompt_tokens + rec.completion_tokens
        self.buckets.give_back(self.config.tenant(rec.tenant), 0, job.cost - used, now)

    def _expire(self, now: float) -> None:
        for item in self.bands.expired(now):
            self._fail(item.payload, "expired", now)
        self._pump(now)

    def _poll(self, now: float) -> None:
        for w in self.workers:
            stats = w.engine.stats()
            w.window.on_load_report(stats.num_queue_reqs, stats.token_usage, w.in_flight)
            w.tally.window_sizes.append(w.window.size)
        self._pump(now)


def simulate(
    config: FleetConfig, requests: Iterable[FleetRequest], until_s: float | None = None
) -> FleetResult:
    """Run ``requests`` through a fleet built from ``config`` (see :class:`FleetSim`)."""
    return FleetSim(config, requests).run(until_s)
