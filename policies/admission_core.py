"""The admission core: one pure object that queues, routes, sheds, expires and dispatches requests.

The gateway's asyncio scheduler (``service/pipeline/scheduler.py``) and the virtual-time fleet simulation
(``loadgen/fleet/sim.py``) drive this same object; it never reads a clock, starts a task or does I/O.
Events come in with a time value and return decisions (:mod:`policies.admission_types`):

- ``arrive(request, now)`` -> the request is dispatched, queued (no decision yet) or shed; a full queue
  may also shed a lower band's newest request;
- ``first_token(rid, now)``, ``finish(rid, now, ...)``, ``cancel(rid, now)`` -> slots free up, queued
  requests are dispatched;
- ``load(worker, report, now)`` -> windows adapt (:mod:`policies.windows`), requests are dispatched;
- ``tick(now)`` at :meth:`AdmissionCore.next_deadline` -> queued requests past their deadline expire;
- ``add_worker``, ``remove_worker``, ``set_eligible`` -> the worker set changes; a lost worker's queue is
  placed again elsewhere.

How a request is placed (at arrival, or again when its worker is lost):

1. Route first: the routing policy (cache-aware by default) picks its worker among all eligible workers,
   whether their windows have room or not, with load = in flight + queued there. Each worker has its own
   queue: strict priority bands, weighted fair queuing between tenants inside a band
   (:mod:`policies.fair_queue`). Binding the request to its warm worker is what keeps the cache hit rate
   under overload: the first round routed only among workers with room, so past capacity requests spilled
   onto cold workers, paid full prefills and throughput collapsed to a third.
2. Predict its TTFT on that worker: the requests served before it there (higher bands, earlier WFQ tags)
   beyond the free window, over the worker's measured capacity left by the higher bands' arrivals, plus the
   engine's measured time to first token for its uncached prefill (:mod:`policies.estimates`). Queueing
   delay = work ahead / service rate, as in Little's-law admission (Google's Doorman; llm-d's
   inference-scheduler predicts TTFT the same way for SLO-aware routing).
3. If that misses the class's TTFT goal, weigh the cache miss: the worker with the lowest predicted TTFT,
   its uncached prefill included, is used instead when it is faster ("spill"). If no worker meets the goal
   the request is shed at once (503 + Retry-After) unless its class serves late answers: goodput-oriented
   admission (SLOs-Serve, SCORPIO) rather than queueing work that is already late. Past capacity every
   worker's queue is at its goal, so the excess is shed instead of spilled.
4. Its dispatch deadline is ``arrival + goal - predicted engine TTFT``; a queued request whose deadline
   passes expires instead of being served late (late classes: ``arrival + max_wait_s``).

A worker's window frees -> its queue's head (highest band, smallest WFQ tag) is dispatched.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable

from policies.admission_types import (
    AdmissionRequest,
    CoreConfig,
    Decision,
    Dispatch,
    Expire,
    Shed,
    ShedReason,
    WorkerSnapshot,
)
from policies.classes import ClassPolicy, top_class
from policies.deadlines import DeadlineHeap
from policies.estimates import WorkerEstimates
from policies.fair_queue import BandConfig, PriorityBands, QueuedItem
from policies.route_types import RouteDecision, WorkerView
from policies.routing import Router, make_router
from policies.windows import LoadReport, WorkerWindow
from policies.worker_queue import Entry, Prediction, WorkerQueue, prefilled, uncached_tokens

_RETRY_MIN_S = 1.0


class AdmissionCore:
    """Queues, routes, sheds, expires and dispatches (see the module docstring).

    Args:
        config: classes, windows, routing and ablation switches.

    Raises:
        ValueError: no classes.
    """

    def __init__(self, config: CoreConfig | None = None) -> None:
        self.config = cfg = config or CoreConfig()
        self._classes = dict(cfg.classes)
        self._top = top_class(self._classes)
        self._band_configs = [
            BandConfig(name, c.rank, c.max_queue_len, c.max_wait_s or c.ttft_goal_s, c.min_share)
            for name, c in self._classes.items()
        ]
        goal = min(c.ttft_goal_s for c in self._classes.values())
        self._guard_s = cfg.lower_band_prefill_guard * self._classes[self._top].ttft_goal_s
        fraction = cfg.window.ttft_target_fraction
        self._ttft_target = cfg.window.ttft_target_s or (fraction * goal if fraction else None)
        self.router: Router = make_router(cfg.routing, cache_aware=cfg.cache_aware)
        self._workers: dict[str, WorkerQueue] = {}
        self._entries: dict[str, Entry] = {}
        self._deadlines = DeadlineHeap()  # queued requests' dispatch deadlines
        self._first_tokens = DeadlineHeap()  # dispatched requests' first-token deadlines
        self._depth = dict.fromkeys(self._classes, 0)
        self._queued = 0

    # -- workers ------------------------------------------------------------------------------------
    def add_worker(self, url: str, max_running: int | None = None, replica_share: float = 1.0) -> None:
        """Add a worker (eligible at once; a no-op if present).

        ``max_running``: the engine's ``max_running_requests`` when already known (its window starts there;
        with several gateway replicas, this replica's share of it). ``replica_share``: this replica's part
        of the worker's work (:attr:`LoadReport.replica_share`; load reports update it).

        Raises:
            ValueError: ``replica_share`` outside (0, 1].
        """
        if not 0.0 < replica_share <= 1.0:
            raise ValueError(f"replica_share must be in (0, 1] (got {replica_share})")
        if url not in self._workers:
            cfg = self.config
            w = WorkerQueue(
                url,
                WorkerWindow(cfg.window, self._ttft_target),
                PriorityBands(self._band_configs),
                self._seed_estimates(),
                top_rank=self._classes[self._top].rank,
            )
            w.replica_share = replica_share
            self._workers[url] = w
            if max_running is not None:
                w.window.on_report(LoadReport(0, 0, 0.0, max_running, replica_share), 0, None)

    def _seed_estimates(self) -> WorkerEstimates:
        """A joining worker's estimates: a copy of those of the peer measured most (most first tokens),
        else none. One core serves one model, whose workers run the same engine, so a peer's TTFT model,
        capacity and calibration are the best first guess, and measurements replace them as fast as
        they would fill empty ones. Empty, a joining worker's prefill backlog is predicted free, so
        nothing bounds what the router sends it (it is the least loaded) while its whole
        ``max_running_requests`` window is open."""
        measured = [w.est for w in self._workers.values() if w.est.ttft_base.count > 0]
        if not measured:
            return WorkerEstimates(self.config.estimates)
        return copy.deepcopy(max(measured, key=lambda e: e.ttft_base.count))

    def remove_worker(self, url: str, now: float) -> list[Decision]:
        """Forget a worker; its queued requests are placed again elsewhere (or shed)."""
        w = self._workers.pop(url, None)
        if w is None:
            return []
        self.router.remove_worker(url)
        w.eligible = False
        return self._rebind(w, now)

    def observe_peer_route(self, url: str, prompt: str, now: float) -> None:
        """Another gateway replica dispatched ``prompt`` to ``url`` at ``now`` (s): the router learns it
        (:meth:`policies.route_types.Router.observe_peer_route`). A worker this core does not know is
        ignored (it left, or has not been seen yet)."""
        if url in self._workers:
            self.router.observe_peer_route(url, prompt, now)

    def set_eligible(self, url: str, eligible: bool, now: float) -> list[Decision]:
        """Mark a worker eligible (healthy, not draining) or not; returns what that dispatched or shed."""
        w = self._workers.get(url)
        if w is None or w.eligible == eligible:
            return []
        w.eligible = eligible
        return self._pump(w, now) if eligible else self._rebind(w, now)

    @property
    def worker_urls(self) -> list[str]:
        """Every worker the core knows, eligible or not."""
        return list(self._workers)

    def any_eligible(self) -> bool:
        """Whether some worker accepts requests."""
        return any(w.eligible for w in self._workers.values())

    def snapshot(self, now: float) -> list[WorkerSnapshot]:
        """Per-worker state for metrics and the admin API."""
        return [w.snapshot(now) for w in self._workers.values()]

    def window(self, url: str) -> WorkerWindow | None:
        """A worker's window (None if unknown)."""
        w = self._workers.get(url)
        return None if w is None else w.window

    def in_flight(self, url: str) -> int:
        """Requests dispatched to ``url`` and not finished (0 if unknown)."""
        w = self._workers.get(url)
        return 0 if w is None else w.in_flight

    def depth(self, band: str) -> int:
        """Requests of ``band`` waiting, over all workers."""
        return self._depth[band]

    def __len__(self) -> int:
        return self._queued

    # -- requests -----------------------------------------------------------------------------------
    def arrive(self, req: AdmissionRequest, now: float) -> list[Decision]:
        """A new request at ``now``: dispatched, queued (no decision about it yet) or shed.

        Raises:
            KeyError: unknown class.
            ValueError: a request id already known.
        """
        if req.rid in self._entries:
            raise ValueError(f"request {req.rid!r} is already known")
        cls = self._classes[req.band]
        if self._depth[req.band] >= cls.max_queue_len:
            return [Shed(req.rid, req.band, "band_full", self._retry_after(cls))]
        entry = Entry(req, cls)
        out: list[Decision] = []
        if self._queued >= self.config.max_queue_total and not self._evict_below(cls.rank, now, out):
            return [*out, Shed(req.rid, req.band, "queue_full", self._retry_after(cls))]
        shed = self._place(entry, now, ())
        if shed is not None:
            return [*out, shed]
        self._entries[req.rid] = entry
        assert entry.worker is not None
        return out + self._pump(entry.worker, now)

    def first_token(self, rid: str, now: float, cached_tokens: int | None = None) -> list[Decision]:
        """The first token of ``rid`` reached the gateway at ``now``: learn the engine's TTFT; returns what
        the shorter prefill queue let through."""
        e = self._entries.get(rid)
        if e is None or e.dispatched_at is None or e.first_token_seen or e.worker is None:
            return []
        prefilled(e)
        uncached = e.uncached if cached_tokens is None else max(0, e.req.prompt_tokens - cached_tokens)
        e.worker.est.on_first_token(now, now - e.dispatched_at, e.backlog_at_dispatch + uncached)
        if self.config.slo_admission and not e.cls.serve_late and not e.beyond_goal and e.waits:
            # admitted as on time after a predicted wait, on a measured capacity: did it keep that
            # promise? (one dispatched at once, or admitted at a cold start with its wait predicted as
            # zero, says nothing about the queue model, the part the calibration scales)
            e.worker.est.on_goal_outcome(e.req.band, now - e.req.arrival <= e.cls.ttft_goal_s, now)
        return self._pump(e.worker, now) if len(e.worker.bands) else []

    def finish(
        self,
        rid: str,
        now: float,
        *,
        ok: bool = True,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> list[Decision]:
        """Request ``rid`` ended at ``now`` (``ok``: answered in full); frees its slot and dispatches.

        ``prompt_tokens``/``cached_tokens`` are the engine's counts, fed back to the router.
        """
        e = self._entries.pop(rid, None)
        if e is None:
            return []
        if e.dispatched_at is None:  # still queued: the caller gave up on it
            self._unqueue(e)
            return []
        w = e.worker
        assert w is not None
        w.release(e, now)
        if ok:
            w.est.on_done(now, now - e.dispatched_at)
            if cached_tokens is not None:
                matched = e.route.matched_chars if e.route else None
                self.router.observe_cached_tokens(
                    w.url, e.req.prompt, cached_tokens, prompt_tokens or e.req.prompt_tokens, matched
                )
        return self._pump(w, now)

    def cancel(self, rid: str, now: float) -> list[Decision]:
        """The caller gave up on ``rid`` (client gone, or the attempt failed): same as an unserved finish."""
        return self.finish(rid, now, ok=False)

    def reroute(self, rid: str, exclude: Collection[str], now: float) -> tuple[str | None, list[Decision]]:
        """Move a dispatched request to another eligible worker (a retry after a failed attempt).

        The least loaded eligible worker not in ``exclude`` takes it at once, window or not (a retry must
        not queue again). Returns its URL (None when there is none: the request then holds no slot) and
        what the freed slot dispatched.
        """
        e = self._entries.get(rid)
        if e is None or e.worker is None or e.dispatched_at is None:
            return None, []
        e.worker.release(e, now)
        out = self._pump(e.worker, now)
        pool = [w for w in self._workers.values() if w.eligible and w.url not in exclude]
        if not pool:
            self._entries.pop(rid, None)
            return None, out
        w = min(pool, key=lambda x: (x.in_flight + len(x.bands), x.in_flight_tokens))
        e.worker, e.route = w, RouteDecision(w.url, "retry")
        w.start(e, now)
        return w.url, out

    def load(self, url: str, report: LoadReport, now: float) -> list[Decision]:
        """A load report from ``url``: its window adapts (and this replica's part of the worker's work,
        :attr:`LoadReport.replica_share`, is updated); returns what that dispatched."""
        w = self._workers.get(url)
        if w is None:
            return []
        w.replica_share = report.replica_share
        w.window.on_report(report, w.in_flight, w.est.base_ttft(now))
        return self._pump(w, now)

    def tick(self, now: float) -> list[Decision]:
        """Expire queued requests whose deadline is ``<= now`` and dispatched ones whose first-token
        deadline is (:attr:`CoreConfig.first_token_deadline_factor`); dispatch what that and assumed
        first tokens let through."""
        out: list[Decision] = []
        touched: dict[str, WorkerQueue] = {}
        for deadline, rid in self._first_tokens.due(now):
            e = self._entries.get(rid)
            if e is None or not e.awaits_first_token(deadline):
                continue
            w = e.worker
            assert w is not None
            if not w.holds_back(e, self._classes):  # waits its turn in the engine's queue: look again later
                e.first_token_by = now + e.cls.ttft_goal_s
                self._first_tokens.push(e.first_token_by, rid)
                continue
            del self._entries[rid]
            w.release(e, now)
            assert e.dispatched_at is not None
            w.est.on_first_token_missing(now, now - e.dispatched_at, e.backlog_at_dispatch + e.uncached)
            if e.waits:  # admitted as on time after a predicted wait: a miss of the queue model
                w.est.on_goal_outcome(e.req.band, False, now)
            out.append(Expire(rid, e.req.band, now - e.req.arrival, e.req.tenant, True, e.predicted))
            touched[w.url] = w
        for w in self._workers.values():
            if (w.silent and w.silent[0][0] <= now and len(w.bands)) or w.url in touched:
                w.backlog(now)
                out += self._pump(w, now)
        for deadline, rid in self._deadlines.due(now):
            e = self._entries.get(rid)
            if e is None or e.dispatched_at is not None or e.deadline != deadline:
                continue
            self._entries.pop(rid)
            self._unqueue(e)
            out.append(Expire(rid, e.req.band, now - e.req.arrival, predicted_ttft_s=e.predicted))
        return out

    def next_deadline(self) -> float | None:
        """When to call :meth:`tick` next: the earliest deadline of a queued request, first-token deadline
        of a dispatched one, or assumed first token of a non-streamed request on a worker whose queue
        waits; None when there is nothing."""
        soonest = self._deadlines.earliest(self._queued_by)
        first_token = self._first_tokens.earliest(self._first_token_by)
        if first_token is not None and (soonest is None or first_token < soonest):
            soonest = first_token
        for w in self._workers.values():
            if w.silent and len(w.bands) and (soonest is None or w.silent[0][0] < soonest):
                soonest = w.silent[0][0]
        return soonest

    def _queued_by(self, deadline: float, rid: str) -> bool:
        """``rid`` is queued with dispatch deadline ``deadline``."""
        e = self._entries.get(rid)
        return e is not None and e.dispatched_at is None and e.deadline == deadline

    def _first_token_by(self, deadline: float, rid: str) -> bool:
        """``rid`` is dispatched and awaits its first token by ``deadline``."""
        e = self._entries.get(rid)
        return e is not None and e.awaits_first_token(deadline)

    # -- placement ----------------------------------------------------------------------------------
    def _place(self, e: Entry, now: float, exclude: Collection[str]) -> Shed | None:
        """Bind ``e`` to a worker and queue it there, or return why it is shed."""
        req, cls, cfg = e.req, e.cls, self.config
        eligible = [w for w in self._workers.values() if w.eligible and w.url not in exclude]
        if not eligible:
            return Shed(req.rid, req.band, "no_worker", _RETRY_MIN_S)
        top = self._top
        views = [
            WorkerView(w.url, True, w.in_flight + len(w.bands), w.in_flight_tokens, w.would_wait(req, top))
            for w in eligible
        ]
        decision = self.router.choose(views, req.prompt, now, session_id=req.session_id, commit=False)
        if decision is None:
            return Shed(req.rid, req.band, "no_worker", _RETRY_MIN_S)
        by_url = {w.url: w for w in eligible}
        choice, route = by_url[decision.url], decision
        uncached = uncached_tokens(req, decision.matched_chars)
        prediction = choice.predict(req, uncached, now, self._classes, self._top, cfg.fair_queuing)
        budget = cls.ttft_goal_s - (now - req.arrival)
        long = cfg.estimates.long_prefill_tokens
        if cfg.slo_admission and prediction.model_ttft_s > budget and cfg.spill:
            # weigh a cache miss elsewhere against the wait here: only onto a worker predicted to meet
            # the goal, and never at the price of a long extra prefill (it would delay all that
            # worker's work for its duration and evict other prefixes from its cache). Only where the
            # model itself predicts a miss: the calibration's margin sheds, it does not move work (moving
            # a backlogged tenant's excess onto every worker let weighted fair queuing share each worker
            # with it: the fairness experiment's quiet tenants fell from 100% to 94.8% goodput)
            matches = self.router.prefix_matches(req.prompt)
            best: tuple[Prediction, WorkerQueue, int] | None = None
            for w in eligible:
                if w is choice:
                    continue
                unc = uncached_tokens(req, matches.get(w.url, 0))
                if unc - uncached >= long:
                    continue
                p = w.predict(req, unc, now, self._classes, self._top, cfg.fair_queuing)
                if p.ttft_s <= budget and (best is None or p.ttft_s < best[0].ttft_s):
                    best = (p, w, unc)
            if best is not None:
                prediction, choice, uncached = best
                matched = matches.get(choice.url, 0)
                rate = matched / len(req.prompt) if req.prompt else 0.0
                route = RouteDecision(choice.url, "spill", matched, rate)
        predicted = prediction.ttft_s
        # a request whose own prefill, on an idle engine, already misses its goal is not refused for it
        # while its worker has no queue: no retry would ever meet the goal, and serving it costs no one
        # (behind a queue it is shed: past capacity its late answer would displace work that is on time).
        # Judged with the dispatch margin, as dispatch judges it: an own prefill within the goal but not
        # within the margin was admitted, then expired at dispatch 0 ms later on every retry, so an idle
        # worker never served again and its estimate (on the busy clock) never moved
        own = choice.est.engine_ttft(uncached, now, unbiased_base=req.band == self._top)
        beyond_goal = own * (1.0 + cfg.dispatch_margin) > budget and len(choice.bands) == 0
        if cfg.slo_admission and not cls.serve_late and not beyond_goal:
            if predicted > budget:
                retry = max(_RETRY_MIN_S, predicted - budget)
                return Shed(req.rid, req.band, "predicted_ttft", retry, predicted)
            backlog = choice.backlog
            if uncached >= long and (
                len(choice.bands) > 0 or self._blocks_top(choice, req.band, backlog(now), uncached, now)
            ):
                # past capacity (requests wait for this worker's slots) a long prefill displaces cheaper
                # work, and while the top band sends work here it would hold its first tokens (nothing
                # preempts a prefill under way): shed it rather than spend on it
                return Shed(req.rid, req.band, "costly_miss", self._retry_after(cls), predicted)
        self.router.commit(choice.url, req.prompt, now, route.matched_chars)  # the tree is not walked again
        e.worker, e.route, e.uncached, e.predicted = choice, route, uncached, predicted
        e.waits = prediction.wait_s > 0.0  # a wait is predicted only on a measured capacity
        e.beyond_goal = beyond_goal and cfg.slo_admission and not cls.serve_late
        e.deadline = choice.dispatch_deadline(e, now, cfg.slo_admission)
        flow = req.tenant if cfg.fair_queuing else "*"
        e.item = QueuedItem(e, flow, req.weight, float(req.cost), req.band, now, e.deadline)
        choice.bands.push(e.item)
        self._depth[req.band] += 1
        self._queued += 1
        self._deadlines.push(e.deadline, req.rid)
        choice.count_arrival(cls.rank, now, cfg.estimates.rate_tau_s, uncached)
        return None

    def _retry_after(self, cls: ClassPolicy) -> float:
        return max(_RETRY_MIN_S, min(cls.ttft_goal_s, 5.0))

    # -- queue mechanics ----------------------------------------------------------------------------
    def _unqueue(self, e: Entry) -> None:
        if e.item is not None and e.worker is not None and e.worker.bands.remove(e.item):
            self._depth[e.req.band] -= 1
            self._queued -= 1
        e.item = None  # entry and queue item refer to each other: no cycle left for the collector

    def _pump(self, w: WorkerQueue, now: float) -> list[Decision]:
        """Dispatch ``w``'s queue head while its window has room."""
        out: list[Decision] = []
        bands, window = w.bands, w.window
        while w.eligible and (head := bands.peek()) is not None:
            e = head.payload
            if not window.has_room(
                w.in_flight,
                w.in_flight_tokens,
                e.req.cost,
                w.headroom(e.req.band, self._top),
                e.req.sequences,
            ):
                break
            if not w.band_fits(e.req, e.cls, self._top) or self._guarded(w, e, now):
                break
            bands.pop()
            placed_now = head.enqueued_at == now
            e.item = None  # see _unqueue
            self._depth[e.req.band] -= 1
            self._queued -= 1
            if e.deadline < now or (not placed_now and w.late_at_dispatch(e, now, self.config)):
                # never spend capacity on an answer that is already late (unless late is useful); one
                # placed this instant was judged on time by admission, on the same prediction: stretched
                # by the margin here, it was expired 0 ms later (a worker that had just joined, the
                # least loaded, took every cache miss and expired each one while its prefill backlog
                # stood between the goal and the goal over the margin: 450-1,150 interactive requests a
                # minute in the planner experiment)
                self._entries.pop(e.req.rid, None)
                out.append(Expire(e.req.rid, e.req.band, now - e.req.arrival, predicted_ttft_s=e.predicted))
                continue
            w.start(e, now)
            self._watch_first_token(e)
            assert e.route is not None
            out.append(Dispatch(e.req.rid, w.url, e.route, now - e.req.arrival, e.predicted))
        return out

    def _watch_first_token(self, e: Entry) -> None:
        """Give the just-dispatched ``e`` its first-token deadline, when it gets one."""
        factor, cls = self.config.first_token_deadline_factor, e.cls
        if not factor or not self.config.slo_admission or not e.req.reports_first_token:
            return
        # the top band: nothing ranks above it to hold it back (:meth:`WorkerQueue.holds_back`)
        if cls.serve_late or e.beyond_goal or e.req.band == self._top:
            return
        e.first_token_by = e.req.arrival + factor * cls.ttft_goal_s
        self._first_tokens.push(e.first_token_by, e.req.rid)

    def _guarded(self, w: WorkerQueue, e: Entry, now: float) -> bool:
        """A lower-band request would fill ``w``'s prefill queue past ``lower_band_prefill_guard``, or its
        long prefill would hold the top band's first tokens (:meth:`WorkerQueue.blocks_top`: an engine does
        not preempt a prefill under way; a CPU worker held interactive first tokens 11-19 s, nu12)."""
        if e.req.band == self._top or not self.config.slo_admission:
            return False
        backlog = w.backlog(now)
        if self._blocks_top(w, e.req.band, backlog, e.uncached, now):
            return True
        return backlog > 0 and w.est.engine_ttft(backlog + e.uncached, now) > self._guard_s

    def _blocks_top(self, w: WorkerQueue, band: str, backlog: int, uncached: int, now: float) -> bool:
        """:meth:`WorkerQueue.blocks_top` for a request of ``band`` (never for the top band's own)."""
        return band != self._top and w.blocks_top(backlog, uncached, self._guard_s, now)

    def _rebind(self, w: WorkerQueue, now: float) -> list[Decision]:
        """Place ``w``'s queued requests on other workers (or shed them)."""
        out: list[Decision] = []
        entries = [item.payload for item in w.bands.all_items()]
        for e in entries:
            self._unqueue(e)
        touched: set[str] = set()
        for e in entries:
            shed = self._place(e, now, (w.url,))
            if shed is not None:
                self._entries.pop(e.req.rid, None)
                out.append(shed)
            elif e.worker is not None:
                touched.add(e.worker.url)
        for url in touched:
            out.extend(self._pump(self._workers[url], now))
        return out

    def _evict_below(self, rank: int, now: float, out: list[Decision]) -> bool:
        """Shed the newest request of the lowest backlogged band below ``rank``; False if there is none."""
        bands = sorted(
            (c.rank, name) for name, c in self._classes.items() if c.rank < rank and self._depth[name] > 0
        )
        if not bands:
            return False
        band = bands[0][1]
        newest: QueuedItem[Entry] | None = None
        for w in self._workers.values():
            item = w.bands.queue(band).newest()
            if item is not None and (newest is None or item.enqueued_at > newest.enqueued_at):
                newest = item
        if newest is None:
            return False
        e = newest.payload
        self._entries.pop(e.req.rid, None)
        self._unqueue(e)
        out.append(Shed(e.req.rid, band, "evicted", self._retry_after(e.cls)))
        return True


def decisions_for(decisions: Iterable[Decision], rid: str) -> list[Decision]:
    """The decisions about one request (a helper for tests and adapters)."""
    return [d for d in decisions if d.rid == rid]


__all__ = ["AdmissionCore", "ShedReason", "decisions_for"]
