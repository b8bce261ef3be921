"""Several gateway replicas in the fleet simulation: N admission cores in front of the same workers.

A gateway deployed as N replicas (pods, or ``RADIXGATE_WORKERS`` processes) behind a load balancer runs N
admission cores (:class:`policies.admission_core.AdmissionCore`), one per replica and model. Each sees every
worker, but:

- it lets into a worker only its share of the engine's ``max_running_requests``,
  :func:`policies.window_shares.window_share` over the replicas' ids, the same function the gateway calls
  (``service/workers/replicas.py``); with ``FleetConfig.share_windows`` off each takes the whole window,
  as the gateway does with ``RADIXGATE_REPLICAS__SHARE_WINDOWS=false``;
- it queues, routes, sheds and expires only the requests the load balancer gave it, and its estimates
  (capacity, engine TTFT, calibration) learn only from what it dispatched;
- its router's prefix tree learns what it dispatched at once, and what the other replicas dispatched
  :data:`ROUTE_SYNC_DELAY_S` later (the gateway's route sync over Redis pub/sub,
  ``RADIXGATE_REPLICAS__SHARE_ROUTES``; off with ``FleetConfig.share_routes``: each tree then learns only
  its own replica's dispatches);
- its load reports are the engine's own (``num_running_reqs``, ``num_queue_reqs``, ``token_usage``: every
  replica's requests together), with ``max_running_requests`` replaced by its share and ``replica_share``
  set to that share over the engine's (:class:`policies.windows.LoadReport`), as the gateway's scheduler
  reports them to its core.

:class:`GatewayReplicas` holds one model's N cores and offers the part of the core's interface the
simulation drives, so :class:`loadgen.fleet.sim.FleetSim` runs N replicas as it runs one. The load balancer
(:class:`ReplicaBalancer`) picks a replica per request, for every model alike (it does not read the body):
round robin (nginx's and Envoy's default) or uniformly at random with the run's seed (kube-proxy's iptables
mode). The engines run every replica's requests together. With one replica :func:`lane_cores` returns the
plain core: the simulation is then exactly what it was without replicas.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from policies.admission_core import AdmissionCore
from policies.admission_types import AdmissionRequest, CoreConfig, Decision, Dispatch, WorkerSnapshot
from policies.window_shares import window_share
from policies.windows import LoadReport

ROUTE_SYNC_DELAY_S = 0.001
"""From one replica's dispatch to the other replicas' routers learning it, s: a Redis ``PUBLISH`` and its
delivery to the subscribers, about one network round trip inside a zone (0.2-0.5 ms) plus the publisher's
batching (the next turn of its event loop); 1 ms leaves room for a busy Redis. Measured on loopback by
``tests/service/workers/test_route_sync.py`` (well under this)."""

Balance = Literal["round_robin", "random"]
"""How the load balancer in front of the replicas spreads requests (see the module docstring)."""


class ReplicaBalancer:
    """The load balancer in front of ``replicas`` gateway replicas: which replica takes the next request.

    Args:
        replicas: number of replicas (>= 1).
        balance: ``round_robin`` (in arrival order) or ``random`` (uniform, seeded by ``seed``).
        seed: the random mode's seed.

    Raises:
        ValueError: ``replicas`` < 1 or an unknown ``balance``.
    """

    def __init__(self, replicas: int, balance: Balance = "round_robin", seed: int = 0) -> None:
        if replicas < 1:
            raise ValueError(f"at least one gateway replica (got {replicas})")
        if balance not in ("round_robin", "random"):
            raise ValueError(f"unknown balance {balance!r}: round_robin or random")
        self.replicas = replicas
        self.balance = balance
        self._rng = random.Random(seed)
        self._next = 0
        self.picked = [0] * replicas  #: requests given to each replica so far

    def pick(self) -> int:
        """The replica (index) that takes the next request."""
        if self.balance == "random":
            i = self._rng.randrange(self.replicas)
        else:
            i = self._next
            self._next = (i + 1) % self.replicas
        self.picked[i] += 1
        return i


def replica_ids(replicas: int) -> list[str]:
    """The replicas' ids, ``replica-000`` ...: their sorted order is their index order (the share of
    :func:`~policies.window_shares.window_share` gives the remainder to the first ones)."""
    return [f"replica-{i:03d}" for i in range(replicas)]


@dataclass(frozen=True, slots=True)
class ReplicaWindows:
    """A worker's windows over the replicas: :attr:`size` is their sum (what the worker may be offered).

    Attributes:
        sizes: each replica's window, requests, in replica order.
    """

    sizes: tuple[int, ...]

    @property
    def size(self) -> int:
        """All replicas' windows together, requests."""
        return sum(self.sizes)


class GatewayReplicas:
    """One model's admission cores on ``balancer.replicas`` gateway replicas (see the module docstring).

    Args:
        config: every core's configuration (the replicas run the same settings).
        balancer: picks the replica of each arriving request (shared by every model of the gateway).
        share_windows: each core takes its :func:`~policies.window_shares.window_share` of a worker's
            ``max_running_requests`` (True, the gateway's default) or all of it.

    Decisions come back as each core gives them; a request's later events (first token, finish, cancel)
    go to the core that took it.
    """

    def __init__(
        self,
        config: CoreConfig,
        balancer: ReplicaBalancer,
        share_windows: bool = True,
        share_routes: bool = True,
        route_sync_delay_s: float = ROUTE_SYNC_DELAY_S,
    ) -> None:
        if not 0.0 <= route_sync_delay_s < float("inf"):
            raise ValueError(f"route_sync_delay_s must be finite and >= 0 (got {route_sync_delay_s})")
        self.config = config
        self.balancer = balancer
        self.share_windows = share_windows
        self.share_routes = share_routes
        self.route_sync_delay_s = route_sync_delay_s
        self.ids = replica_ids(balancer.replicas)
        self.cores = [AdmissionCore(config) for _ in self.ids]
        self._owner: dict[str, int] = {}  # rid -> the replica that holds it
        self._prompts: dict[str, str] = {}  # rid -> its prompt, while held (for the route sync)
        self._routes: deque[tuple[float, int, str, str]] = deque()  # (due, from replica, worker, prompt)

    # -- windows and workers ------------------------------------------------------------------------
    def share(self, replica: int, max_running: int) -> int:
        """``replica``'s part of a worker's ``max_running`` requests (all of it without sharing)."""
        if not self.share_windows:
            return max_running
        return window_share(max_running, self.ids, self.ids[replica])

    def replica_share(self, replica: int, max_running: int) -> float:
        """``replica``'s part of a worker's work: its window share over ``max_running`` (1 without
        sharing: each replica then counts the engine's work as all its own, as the gateway does)."""
        if not self.share_windows or max_running < 1:
            return 1.0
        return min(1.0, self.share(replica, max_running) / max_running)

    def add_worker(self, url: str, max_running: int | None = None) -> None:
        """Every replica adds the worker, with its share of ``max_running`` when known."""
        for i, core in enumerate(self.cores):
            if max_running is None:
                core.add_worker(url)
            else:
                core.add_worker(url, self.share(i, max_running), self.replica_share(i, max_running))

    def remove_worker(self, url: str, now: float) -> list[Decision]:
        """Every replica forgets the worker; their queues there are placed again (or shed)."""
        return self._collect((core.remove_worker(url, now) for core in self.cores), now)

    def set_eligible(self, url: str, eligible: bool, now: float) -> list[Decision]:
        """Every replica marks the worker eligible or not (the registry shares drains between them)."""
        return self._collect((core.set_eligible(url, eligible, now) for core in self.cores), now)

    @property
    def worker_urls(self) -> list[str]:
        """The workers the replicas know (all know the same)."""
        return self.cores[0].worker_urls

    def any_eligible(self) -> bool:
        """Whether some worker accepts requests."""
        return any(core.any_eligible() for core in self.cores)

    def window(self, url: str) -> ReplicaWindows | None:
        """The worker's windows on every replica (None if unknown)."""
        windows = [core.window(url) for core in self.cores]
        if any(w is None for w in windows):
            return None
        return ReplicaWindows(tuple(w.size for w in windows if w is not None))

    def in_flight(self, url: str) -> int:
        """Requests all replicas have dispatched to ``url`` and not finished."""
        return sum(core.in_flight(url) for core in self.cores)

    def snapshot(self, now: float) -> list[WorkerSnapshot]:
        """Each worker as the replicas see it together: windows, in-flight and queued requests and
        measured capacity summed over the replicas (each measures its own share); the TTFT model and
        prediction scales of the first replica (every replica measures the same engine)."""
        per_replica = [core.snapshot(now) for core in self.cores]
        out = []
        for k, first in enumerate(per_replica[0]):
            rows = [snaps[k] for snaps in per_replica]
            capacities = [r.capacity_rps for r in rows if r.capacity_rps is not None]
            out.append(
                replace(
                    first,
                    eligible=all(r.eligible for r in rows),
                    window=sum(r.window for r in rows),
                    in_flight=sum(r.in_flight for r in rows),
                    queued=sum(r.queued for r in rows),
                    capacity_rps=sum(capacities) if len(capacities) == len(rows) else None,
                )
            )
        return out

    def depth(self, band: str) -> int:
        """Requests of ``band`` waiting on every replica."""
        return sum(core.depth(band) for core in self.cores)

    def __len__(self) -> int:
        return sum(len(core) for core in self.cores)

    @property
    def holding(self) -> int:
        """Requests some replica holds (queued or dispatched); shed, expired and finished ones are
        forgotten."""
        return len(self._owner)

    # -- events ---------------------------------------------------------------------------------------
    def arrive(self, req: AdmissionRequest, now: float) -> list[Decision]:
        """The load balancer gives ``req`` to a replica, whose core dispatches, queues or sheds it."""
        self._deliver_routes(now)
        i = self.balancer.pick()
        self._owner[req.rid] = i
        if self.share_routes:
            self._prompts[req.rid] = req.prompt
        return self._collect([self.cores[i].arrive(req, now)], now)

    def first_token(self, rid: str, now: float, cached_tokens: int | None = None) -> list[Decision]:
        """``rid``'s first token, to the replica that streams it."""
        self._deliver_routes(now)
        i = self._owner.get(rid)
        return [] if i is None else self._collect([self.cores[i].first_token(rid, now, cached_tokens)], now)

    def finish(
        self,
        rid: str,
        now: float,
        *,
        ok: bool = True,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> list[Decision]:
        """``rid`` ended, on the replica that holds it (its slot there frees)."""
        self._deliver_routes(now)
        i = self._owner.pop(rid, None)
        self._prompts.pop(rid, None)
        if i is None:
            return []
        done = self.cores[i].finish(rid, now, ok=ok, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)
        return self._collect([done], now)

    def cancel(self, rid: str, now: float) -> list[Decision]:
        """The client gave up on ``rid``: same as an unserved finish."""
        return self.finish(rid, now, ok=False)

    def load(self, url: str, report: LoadReport, now: float) -> list[Decision]:
        """The worker's load report to every replica, ``max_running`` replaced by each one's share."""
        self._deliver_routes(now)
        out: list[Decision] = []
        for i, core in enumerate(self.cores):
            mine = report
            engine_max = report.max_running
            if engine_max is not None and engine_max > 0:
                mine = replace(
                    report,
                    max_running=self.share(i, engine_max),
                    replica_share=self.replica_share(i, engine_max),
                )
            out += core.load(url, mine, now)
        return self._collect([out], now)

    def tick(self, now: float) -> list[Decision]:
        """Every replica's :meth:`~policies.admission_core.AdmissionCore.tick`."""
        self._deliver_routes(now)
        return self._collect((core.tick(now) for core in self.cores), now)

    def next_deadline(self) -> float | None:
        """The earliest of the replicas' next deadlines."""
        due = [d for d in (core.next_deadline() for core in self.cores) if d is not None]
        return min(due) if due else None

    def _collect(self, batches: Iterable[Sequence[Decision]], now: float) -> list[Decision]:
        """The decisions, in order; a shed or expired request is forgotten (it has no later event). Each
        dispatch is published to the other replicas, to arrive ``route_sync_delay_s`` later."""
        out: list[Decision] = []
        for batch in batches:
            for d in batch:
                if isinstance(d, Dispatch):
                    prompt, source = self._prompts.get(d.rid), self._owner.get(d.rid)
                    if prompt is not None and source is not None:
                        self._routes.append((now + self.route_sync_delay_s, source, d.worker, prompt))
                else:
                    self._owner.pop(d.rid, None)
                    self._prompts.pop(d.rid, None)
                out.append(d)
        return out

    def _deliver_routes(self, now: float) -> None:
        """The other replicas' dispatches published by ``now`` reach each replica's router (the gateway's
        route sync, ``service/workers/route_sync.py``, over Redis pub/sub)."""
        routes = self._routes
        while routes and routes[0][0] <= now:
            due, source, worker, prompt = routes.popleft()
            for i, core in enumerate(self.cores):
                if i != source:
                    core.observe_peer_route(worker, prompt, due)


LaneCore = AdmissionCore | GatewayReplicas
"""What drives one model's requests in the simulation: the core of one gateway, or N replicas' cores."""


def lane_cores(
    configs: Sequence[CoreConfig],
    replicas: int,
    balance: Balance,
    seed: int,
    share_windows: bool = True,
    share_routes: bool = True,
    route_sync_delay_s: float = ROUTE_SYNC_DELAY_S,
) -> list[LaneCore]:
    """One :data:`LaneCore` per served model (``configs``, in order) on ``replicas`` gateway replicas, the
    models sharing one :class:`ReplicaBalancer`; with one replica, a plain
    :class:`~policies.admission_core.AdmissionCore` each.

    Raises:
        ValueError: ``replicas`` < 1, an unknown ``balance`` or a negative ``route_sync_delay_s``.
    """
    balancer = ReplicaBalancer(replicas, balance, seed)  # checks its arguments for one replica too
    if replicas == 1:
        return [AdmissionCore(c) for c in configs]
    return [GatewayReplicas(c, balancer, share_windows, share_routes, route_sync_delay_s) for c in configs]


__all__ = [
    "Balance",
    "GatewayReplicas",
    "LaneCore",
    "ReplicaBalancer",
    "ReplicaWindows",
    "lane_cores",
    "replica_ids",
]
