"""One worker as the admission core sees it: its queue, window, in-flight work, measured rates (pure).

:class:`WorkerQueue` holds the state :mod:`policies.admission_core` keeps per worker and the arithmetic on
it: the prefill backlog the engine still has to work through, the room a band has, and the predicted time
to first token of a request queued there. Times are seconds on the caller's clock; sizes are tokens.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from policies.admission_types import IDLE_TTFT_PROMPT_TOKENS, AdmissionRequest, CoreConfig, WorkerSnapshot
from policies.classes import ClassPolicy
from policies.estimates import DecayingRate, WorkerEstimates
from policies.fair_queue import PriorityBands, QueuedItem
from policies.route_types import RouteDecision
from policies.windows import WorkerWindow

MIN_RESIDUAL = 0.05
"""Capacity fraction a band is assumed to keep when higher bands' arrivals would take it all (project
choice: a prediction of an infinite wait would shed what a burst's end lets through a moment later)."""

MAX_PREFILL_SHARE = 0.8
"""Most of the engine's prefill time that higher bands' arrivals are assumed to take from a lower band's
wait for its first token (project choice, the same guard against infinite predictions)."""


class Prediction(NamedTuple):
    """A request's predicted TTFT on one worker, s: ``wait_s`` in the gateway's queue (the model's),
    ``engine_s`` from dispatch to first token, and the class's calibration ``scale`` of the wait."""

    wait_s: float
    engine_s: float
    scale: float = 1.0

    @property
    def ttft_s(self) -> float:
        """The calibrated prediction, s: what admission holds against the goal."""
        return self.wait_s * self.scale + self.engine_s

    @property
    def model_ttft_s(self) -> float:
        """The model's prediction, uncalibrated, s."""
        return self.wait_s + self.engine_s


@dataclass(slots=True, eq=False)
class Entry:
    """A request the core holds, from arrival to its end.

    Attributes:
        req: the request.
        cls: its class.
        worker: the worker it is bound to (queued there or running there).
        route: the routing decision that bound it.
        item: its place in the worker's queue while queued.
        deadline: latest dispatch time, s.
        uncached: prompt tokens predicted uncached on its worker.
        predicted: its predicted TTFT at admission, s.
        dispatched_at: when it was dispatched, s (None while queued).
        backlog_at_dispatch: the worker's prefill backlog when it was dispatched, tokens.
        first_token_seen: its prefill is over (first token reported, assumed, or it ended).
        beyond_goal: its own prefill alone cannot meet its class's goal (a long prompt on a slow engine):
            admitted only to a worker with an empty queue, it may then wait up to its goal and is
            dispatched even when late (refusing it would refuse it on every retry).
        waits: it was predicted to wait in the gateway's queue (which needs its worker's capacity
            measured: before, waits are predicted as zero): only then does its outcome calibrate the
            predicted waits (:meth:`WorkerEstimates.on_goal_outcome`).
        first_token_by: its first-token deadline once dispatched, s (None: it has none; see
            :attr:`policies.admission_types.CoreConfig.first_token_deadline_factor`).
    """

    req: AdmissionRequest
    cls: ClassPolicy
    worker: WorkerQueue | None = None
    route: RouteDecision | None = None
    item: QueuedItem[Entry] | None = None
    deadline: float = 0.0
    uncached: int = 0
    predicted: float = 0.0
    dispatched_at: float | None = None
    backlog_at_dispatch: int = 0
    first_token_seen: bool = False
    beyond_goal: bool = False
    waits: bool = False
    first_token_by: float | None = None

    def awaits_first_token(self, deadline: float) -> bool:
        """Dispatched, its first token not come yet, and ``deadline`` is its first-token deadline."""
        started = self.dispatched_at is not None
        return started and not self.first_token_seen and self.first_token_by == deadline


@dataclass(slots=True, eq=False)
class WorkerQueue:
    """A worker's queue and accounting.

    Attributes:
        url: the worker.
        window: its concurrency window.
        bands: requests waiting for it (priority bands, WFQ inside).
        est: what it was measured to do.
        arrivals: admitted arrivals per class rank, requests/s.
        arrival_tokens: uncached prompt tokens of those arrivals per class rank, tokens/s.
        last_arrival: when the last admitted arrival of each class rank came, s.
        eligible: healthy and not draining.
        in_flight, in_flight_tokens: window slots (engine sequences: a request of ``n`` choices takes
            ``n``) of dispatched, unfinished requests, and their reserved tokens.
        band_in_flight: in-flight slots per class.
        prefill_backlog: uncached tokens of dispatched requests whose first token has not come yet.
        long_prefills: those of them with at least ``long_prefill_tokens`` uncached tokens.
        silent: (assumed first-token time, seq, entry) of non-streamed requests (no first-token signal).
        top_rank: the top class's rank: its predictions use the unbiased short-request base
            (:attr:`WorkerEstimates.top_ttft_base`), and lower bands' long prefills are judged by its
            arrivals (:meth:`blocks_top`).
        replica_share: this gateway replica's part of the worker's work, 0 < share <= 1 (its window
            share over the engine's ``max_running_requests``; 1: one replica). The engine prefills every
            replica's requests, but a replica sees only its own: the prefill backlog (:meth:`backlog`) and
            the higher classes' prefill arrivals (:meth:`engine_ttft`) are its own over this share (the
            load balancer gives every replica the same traffic, so each has as much pending). Counted as
            its own alone, with four replicas, the backlog read a quarter of the engine's, the per-token
            cost was learned 7x too low, predicted engine TTFTs were 143 ms at the median for 211 ms
            measured, and the standard class's P99 TTFT at 120% load rose 9% above one replica's
            (docs/experiments.md, experiment 6).
    """

    url: str
    window: WorkerWindow
    bands: PriorityBands[Entry]
    est: WorkerEstimates
    arrivals: dict[int, DecayingRate] = field(default_factory=dict)
    arrival_tokens: dict[int, DecayingRate] = field(default_factory=dict)
    last_arrival: dict[int, float] = field(default_factory=dict)
    eligible: bool = True
    in_flight: int = 0
    in_flight_tokens: int = 0
    band_in_flight: dict[str, int] = field(default_factory=dict)
    prefill_backlog: int = 0
    long_prefills: int = 0
    silent: list[tuple[float, int, Entry]] = field(default_factory=list)
    top_rank: int | None = None
    replica_share: float = 1.0
    _seq: Iterator[int] = field(default_factory=itertools.count, repr=False)  # heap tie-breaker

    def backlog(self, now: float) -> int:
        """The engine's prefill backlog at ``now``, tokens: this replica's own over its
        :attr:`replica_share`; non-streamed requests count until their predicted first token (the gateway
        cannot see it)."""
        silent = self.silent
        while silent and silent[0][0] <= now:
            prefilled(heapq.heappop(silent)[2])
        if self.replica_share >= 1.0:
            return self.prefill_backlog
        return round(self.prefill_backlog / self.replica_share)

    def snapshot(self, now: float) -> WorkerSnapshot:
        """Its state at ``now``, for metrics and the admin API."""
        est, window = self.est, self.window
        base, per_token = est.base_ttft(now), est.per_token_ttft(now)
        return WorkerSnapshot(
            self.url,
            self.eligible,
            window.size,
            self.in_flight,
            len(self.bands),
            est.capacity(now, window.size),
            ttft_base_s=base,
            prefill_s_per_token=per_token,
            idle_ttft_s=None
            if base is None and per_token is None
            else est.engine_ttft(IDLE_TTFT_PROMPT_TOKENS, now),
            prediction_scales=est.prediction_scales(now),
        )

    def headroom(self, band: str, top: str) -> int:
        """Requests beyond the window ``band`` may send: the top band's headroom, at most what the lower bands
        have in flight here (requests it can overtake inside the engine); 0 for other bands."""
        if band != top:
            return 0
        lower = self.in_flight - self.band_in_flight.get(band, 0)
        return min(self.window.headroom, max(0, lower))

    def would_wait(self, req: AdmissionRequest, top: str) -> bool:
        """Whether ``req`` would wait here for a slot: requests are queued, or its sequences do not fit in
        the window (with the top band's :meth:`headroom`)."""
        return len(self.bands) > 0 or self.in_flight + req.sequences > self.window.size + self.headroom(
            req.band, top
        )

    def band_room(self, band: str, cls: ClassPolicy, top: str) -> int:
        """Slots ``band`` may still take here under the class's ``window_share``: that fraction of the
        window, rounded down, but at least one (a small window, e.g. one an adaptive window shrank to,
        would otherwise give the class none and starve it on an idle worker)."""
        if cls.window_share >= 1.0:
            return self.window.size + self.headroom(band, top)
        return max(1, int(cls.window_share * self.window.size)) - self.band_in_flight.get(band, 0)

    def band_fits(self, req: AdmissionRequest, cls: ClassPolicy, top: str) -> bool:
        """Whether ``req``'s sequences fit in its band's room (:meth:`band_room`); one wider than the
        band's share starts when its band has nothing in flight here."""
        room = self.band_room(req.band, cls, top)
        return room >= req.sequences or (room > 0 and not self.band_in_flight.get(req.band, 0))

    def predict(
        self,
        req: AdmissionRequest,
        uncached: int,
        now: float,
        classes: Mapping[str, ClassPolicy],
        top: str,
        fair_queuing: bool,
    ) -> Prediction:
        """Predicted TTFT of ``req`` queued here now: queue wait plus engine TTFT, s.

        The wait is the requests served before it (higher bands, earlier WFQ tags in its band) beyond the free
        window (a request of n choices needs n slots, at most the whole window or its band's share: one
        wider goes alone, :meth:`band_fits`), over the measured capacity left by the higher bands' arrivals
        (Little's law); the engine part is the measured TTFT after the prefill backlog plus its own
        ``uncached`` tokens. Zero wait while the capacity is unknown. The wait is scaled by the class's
        calibration (:meth:`WorkerEstimates.prediction_scale`, in :attr:`Prediction.ttft_s`): what it
        corrects is the queue model (a capacity measured as completions/s overstates what a
        step-quantized engine serves under open-loop arrivals), not the engine TTFT, whose misses (cold
        prefixes, engine stalls) no scale learned from earlier first tokens foresees.
        """
        cls = classes[req.band]
        widest = self.window.size + self.headroom(req.band, top)
        free = min(widest - self.in_flight, self.band_room(req.band, cls, top))
        if cls.window_share < 1.0:
            widest = min(widest, max(1, int(cls.window_share * self.window.size)))
        flow = req.tenant if fair_queuing else "*"
        ahead = self.bands.count_ahead(req.band, flow, req.weight, float(req.cost))
        # one wider than the window (or its band's share) goes alone once that is free (band_fits)
        need = ahead + min(req.sequences, widest) - max(free, 0)
        wait = 0.0
        if need > 0:
            capacity = self.est.capacity(now, self.window.size)
            if capacity is not None:
                higher = sum(r.rate(now) or 0.0 for k, r in self.arrivals.items() if k > cls.rank)
                wait = need / max(capacity - higher, capacity * MIN_RESIDUAL)
        engine = self.engine_ttft(self.backlog(now) + uncached, cls.rank, now)
        return Prediction(wait, engine, self.est.prediction_scale(req.band, now) if wait else 1.0)

    def dispatch_deadline(self, e: Entry, now: float, slo_admission: bool) -> float:
        """Latest dispatch time of ``e`` queued here, s (``slo_admission`` off: its goal or its class's
        ``max_wait_s``, the first round's fixed budget)."""
        cls, arrival = e.cls, e.req.arrival
        if cls.serve_late and cls.max_wait_s is not None:
            return arrival + cls.max_wait_s
        cap = arrival + cls.max_wait_s if cls.max_wait_s is not None else float("inf")
        if not slo_admission:
            return min(cap, arrival + cls.ttft_goal_s) if cls.max_wait_s is None else cap
        if e.beyond_goal:
            return min(cap, arrival + cls.ttft_goal_s)
        # the backlog ahead may drain while it waits: only its own prefill is certain here; the check at
        # dispatch (:meth:`late_at_dispatch`) then uses the backlog of that moment
        engine = self.engine_ttft(e.uncached, cls.rank, now)
        return min(cap, arrival + cls.ttft_goal_s - engine)

    def late_at_dispatch(self, e: Entry, now: float, config: CoreConfig) -> bool:
        """Whether ``e``, dispatched here now, is predicted to miss its goal, its engine TTFT stretched by
        ``config.dispatch_margin`` (late classes: never)."""
        if not config.slo_admission or e.cls.serve_late or e.beyond_goal:
            return False
        engine = self.engine_ttft(self.backlog(now) + e.uncached, e.cls.rank, now)
        first_token = now + engine * (1.0 + config.dispatch_margin)
        return first_token > e.req.arrival + e.cls.ttft_goal_s

    def holds_back(self, e: Entry, classes: Mapping[str, ClassPolicy]) -> bool:
        """Higher classes (of ``classes``) have work in flight here: SGLang prefills them first and
        preempts ``e`` for them, for as long as they keep coming. Without them, ``e`` waits its turn in the
        engine's queue, which drains, and giving it up would waste its prefill (the cache it warms for the
        requests after it: in the routing experiment, cold prefills given up never warmed their workers
        and served throughput fell to a third past the SLO rate)."""
        rank = e.cls.rank
        return any(n > 0 and classes[band].rank > rank for band, n in self.band_in_flight.items())

    def blocks_top(self, backlog: int, uncached: int, guard_s: float, now: float) -> bool:
        """The top band (class rank :attr:`top_rank`) sends work here (an arrival within ``rate_tau_s``) and a
        lower band's prefill of ``uncached`` tokens behind ``backlog`` (together at least
        ``long_prefill_tokens``) would hold its first tokens past ``guard_s`` at the unbiased per-token cost
        (:meth:`WorkerEstimates.prefill_s`).

        While that cost is still unknown (no long prefill measured or given up here), one long prefill at
        a time goes through to measure it: blocked while another one waits for its first token
        (:attr:`long_prefills`; not a backlog of short prefills, which a busy GPU worker always has and
        which would then keep the cost unknown for good). Without that, a cold worker's first burst of
        long prompts all went in and held interactive first tokens for 18.5 s (p50) on a CPU worker (nu12).
        """
        cfg = self.est.config
        top = None if self.top_rank is None else self.last_arrival.get(self.top_rank)
        prefill_tokens = backlog + uncached
        if prefill_tokens < cfg.long_prefill_tokens or top is None or now - top > cfg.rate_tau_s:
            return False
        if not self.est.prefill_per_token.count:
            return self.long_prefills > 0
        return self.est.prefill_s(prefill_tokens, now) > guard_s

    def engine_ttft(self, prefill_tokens: int, rank: int, now: float) -> float:
        """Predicted dispatch-to-first-token time of a class-``rank`` request after ``prefill_tokens`` of
        prefill, s, counting the higher classes' prefills that arrive meanwhile and go first.

        SGLang's priority scheduling admits a waiting request of a higher priority before it, so while it
        waits the engine also prefills the higher classes' arrivals: with ``u`` the share of prefill time
        they take (their uncached tokens/s, every replica's: this one's over :attr:`replica_share`, x the
        measured s/token), the wait ``T = E + u T`` gives
        ``T = E / (1 - u)`` (the M/G/1 preemptive-priority form, Kleinrock, Queueing Systems II, 1976, 3.7),
        ``u`` capped at :data:`MAX_PREFILL_SHARE`. ``E`` is :meth:`WorkerEstimates.engine_ttft` (for the top
        class, with its unbiased base).
        """
        base = self.est.engine_ttft(prefill_tokens, now, unbiased_base=rank == self.top_rank)
        per_token = self.est.per_token_ttft(now)
        if not per_token:
            return base
        tokens = sum(r.rate(now) or 0.0 for k, r in self.arrival_tokens.items() if k > rank)
        share = min(MAX_PREFILL_SHARE, tokens / self.replica_share * per_token)
        return base / (1.0 - share)

    def count_arrival(self, rank: int, now: float, tau_s: float, tokens: int = 0) -> None:
        """Count an admitted arrival of class ``rank`` at ``now`` with ``tokens`` uncached prompt tokens."""
        self.last_arrival[rank] = now
        for rates, amount in ((self.arrivals, 1.0), (self.arrival_tokens, float(tokens))):
            rate = rates.get(rank)
            if rate is None:
                rate = rates[rank] = DecayingRate(tau_s)
                rate.start(now)
            rate.add(now, amount)

    def start(self, e: Entry, now: float) -> None:
        """Count ``e`` as dispatched here at ``now``."""
        e.dispatched_at, e.first_token_seen = now, False
        e.backlog_at_dispatch = self.backlog(now)
        if not e.req.reports_first_token:
            expected = now + self.est.engine_ttft(e.backlog_at_dispatch + e.uncached, now)
            heapq.heappush(self.silent, (expected, next(self._seq), e))
        self.prefill_backlog += e.uncached
        self.long_prefills += e.uncached >= self.est.config.long_prefill_tokens
        if not self.in_flight:
            self.est.busy(now)
        self.in_flight += e.req.sequences
        self.in_flight_tokens += e.req.cost
        self.band_in_flight[e.req.band] = self.band_in_flight.get(e.req.band, 0) + e.req.sequences

    def release(self, e: Entry, now: float) -> None:
        """Undo :meth:`start` (the request ended at ``now``, s, or moved to another worker)."""
        prefilled(e)
        self.in_flight -= e.req.sequences
        if not self.in_flight:
            self.est.idle(now)
        self.in_flight_tokens -= e.req.cost
        self.band_in_flight[e.req.band] -= e.req.sequences


def prefilled(e: Entry) -> None:
    """``e`` no longer waits for its prefill on its worker (first token, end, or moved)."""
    if not e.first_token_seen and e.worker is not None:
        e.worker.prefill_backlog -= e.uncached
        e.worker.long_prefills -= e.uncached >= e.worker.est.config.long_prefill_tokens
    e.first_token_seen = True


def uncached_tokens(req: AdmissionRequest, matched_chars: int) -> int:
    """Prompt tokens not covered by a predicted prefix match of ``matched_chars`` characters."""
    if not req.prompt or matched_chars <= 0:
        return req.prompt_tokens
    return max(0, round(req.prompt_tokens * (1.0 - min(1.0, matched_chars / len(req.prompt)))))
