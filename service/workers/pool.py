"""The workers one gateway replica sends to: health probes, circuit breakers, draining, in-flight counts.

Each worker has a :class:`policies.circuit_breaker.CircuitBreaker`. Everything the pool learns about a
worker is one :data:`~policies.circuit_breaker.Signal` -- outcomes of real requests and of ``GET /health``
probes (every ``health_interval_s``; every ``deep_probe_every``-th round ``GET /health_generate``, which
runs a 1-token generation) -- and one rule, :func:`policies.circuit_breaker.judge`, decides what it does,
for probes and requests alike:

- a refused connection is definitive: the breaker opens at once;
- a failed request (timeout, reset), a failed or slow deep probe, or a failed plain probe counts as one
  failure; ``breaker_failures`` of them with no success in between open the breaker;
- an HTTP 5xx answer to a request is only a suspicion (SGLang answers 5xx to some requests that are their
  own fault, e.g. a grammar it crashes on): :meth:`WorkerPool.suspect` confirms it at once with a deep probe
  (``/health_generate``), shared by every 5xx the worker gives while it runs. A failed probe confirms each
  of those answers as one failed request; a passing one clears the worker (a success); a refused one trips
  the breaker; no answer from our own connection pool is no evidence either way;
- a successful request or deep probe clears the count; a plain ``/health`` 200 only clears failed plain
  probes (it proves the HTTP process is up, not that the engine generates);
- while a request to the worker succeeded within ``probe_trust_window_s``, failed probes count for
  nothing: real traffic outranks health signals, so the last healthy worker is never ejected on probe
  evidence alone while it serves.

Every change of a worker's health is logged once (``worker_healthy`` / ``worker_unhealthy``, with the reason:
``"connection refused"``, ``"GET /health 404: not an SGLang server?"``, ``"requests failed: circuit breaker
open"``, ...; not once per probe) and kept for ``/admin/workers`` (``health_reason``, ``health_since``). A
worker is healthy for this purpose when it was seen up and its breaker is closed; a healthy worker that
reports another model than the gateway serves is logged too (at WARNING, the reason naming both).

Each worker serves one of the gateway's models (:class:`service.config.models.ModelRegistry`): the one it is
listed under in settings, checked against the model it reports (``/server_info``'s ``served_model_name`` or
``model_path``, else ``/v1/models``), or, for a worker added over the admin API, the one it reports. A
worker that reports another model is kept out of every model's pool (:meth:`WorkerPool.eligibility`), still
probed (a restart with the right name brings it back), and logged once (``worker_excluded`` with the reason;
``/admin/workers`` shows ``model_mismatch``).

After the cool-down the breaker is half-open: probes and requests go through and ``breaker_successes``
successes close it. A worker is eligible for new requests when it has answered a probe at least once, its
breaker lets traffic through and it is not draining. A draining worker (:meth:`WorkerPool.drain`: the
admin API, its DNS record gone, a scale-down) gets no new requests; what it runs finishes there, or, still
running ``drain_deadline_s`` after the drain began, goes on on another worker of its model
(:mod:`service.workers.drain_deadline`). The worker leaves the pool when its in-flight count reaches zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path

import structlog

from policies.circuit_breaker import BreakerConfig, BreakerState, CircuitBreaker, Signal, judge
from policies.routing import LeastLoadRouter, WorkerView
from service.config.models import ModelRegistry, ServedModel
from service.config.policies import RoutingSettings, SchedulerSettings
from service.workers.client import SGLangClient
from service.workers.drain_deadline import DrainDeadlines
from service.workers.worker_state import SIGNAL_REASONS, WorkerState

log = structlog.get_logger("radixgate.pool")

TransitionHook = Callable[[str, BreakerState], None]
ConfirmationHook = Callable[[str, str], None]
"""Called with (worker URL, verdict) for each settled confirmation: ``confirmed``, ``cleared``, ``refused``
or ``no_evidence``."""


class WorkerPool:
    """Workers, their health, and the choice of a worker for retries.

    Args:
        urls: base URLs of the workers.
        client: SGLang client used for probes.
        health_interval_s: probe period, s.
        health_timeout_s: timeout of one probe, s.
        breaker: circuit-breaker thresholds.
        on_transition: called with (url, new state) when a breaker changes state.
        clock: monotonic clock in s.
        deep_probe_every: every n-th probe round uses ``/health_generate`` (a real 1-token generation)
            instead of ``/health``; 0 disables deep probes (confirmations of a 5xx still use it).
        on_confirmation: called with (url, verdict) when a 5xx's confirmation probe settles.
        served_models: the model names of a single-model gateway (its id, then aliases), when ``models``
            is not given; a worker that reports another one
            (:attr:`service.workers.worker_info.WorkerInfo.model`) is kept out and logged (empty: not
            checked).
        wall_clock: Unix time in s (``health_since``).
        models: the served models (:meth:`ModelRegistry.place` decides each worker's).
        assigned: worker URL -> the model it is listed under, beside the registry's own lists (launched
            workers).
        drain_deadline_s: how long a draining worker keeps the calls it runs before they move to another
            worker (``upstream.worker_drain_deadline_s``), s; None: they finish where they run.
    """

    def __init__(
        self,
        urls: list[str],
        client: SGLangClient,
        health_interval_s: float,
        health_timeout_s: float = 5.0,
        breaker: BreakerConfig | None = None,
        on_transition: TransitionHook | None = None,
        clock: Callable[[], float] = time.monotonic,
        deep_probe_every: int = 6,
        on_confirmation: ConfirmationHook | None = None,
        served_models: Collection[str] = (),
        wall_clock: Callable[[], float] = time.time,
        models: ModelRegistry | None = None,
        assigned: Mapping[str, str] | None = None,
        drain_deadline_s: float | None = None,
    ) -> None:
        self._breaker_config = breaker or BreakerConfig()
        self._models = models or _single_model(list(served_models))
        self._listed = {
            **(self._models.worker_models() if self._models else {}),
            **{url.rstrip("/"): m for url, m in (assigned or {}).items()},
        }
        self._workers: dict[str, WorkerState] = {}
        for url in urls:
            self.add(url)
        self._client = client
        self._interval = health_interval_s
        self._timeout = health_timeout_s
        self._on_transition = on_transition
        self._clock = clock
        self._retry_router = LeastLoadRouter()
        self._deep_every = deep_probe_every
        self._rounds = 0
        self._task: asyncio.Task[None] | None = None
        self._on_confirmation = on_confirmation
        self._confirming: dict[str, asyncio.Task[None]] = {}  # url -> its confirmation probe
        self._wall_clock = wall_clock
        self.deadlines = DrainDeadlines(
            drain_deadline_s,
            health_interval_s,
            lambda url: state.in_flight if (state := self._workers.get(url)) else 0,
            self._other_eligible,
            lambda url: self._client.move_off(url),
            clock,
        )

    @property
    def workers(self) -> list[WorkerState]:
        """All workers, in the order they were added."""
        return list(self._workers.values())

    def add(self, url: str) -> WorkerState:
        """Add a worker (kept as it is if present); it becomes eligible after its first good probe. It
        serves the model it is listed under (or the only one) until what it reports says otherwise."""
        url = url.rstrip("/")
        if url not in self._workers:
            state = WorkerState(url, CircuitBreaker(self._breaker_config))
            state.expected_model = self._listed.get(url)
            if self._models is not None:
                single = len(self._models.models) == 1
                state.model = state.expected_model or (self._models.default.id if single else None)
            self._workers[url] = state
        return self._workers[url]

    def drain(self, url: str) -> bool:
        """Stop sending new requests to ``url``; what it runs moves to another worker at the drain deadline
        (module text); it is removed once idle. Draining an already draining worker changes nothing (its
        deadline stays). False if unknown."""
        state = self._workers.get(url.rstrip("/"))
        if state is None:
            return False
        if not state.draining:
            state.draining = True
            log.info(
                "worker_draining",
                worker=state.url,
                in_flight=state.in_flight,
                deadline_s=self.deadlines.deadline_s,
            )
            if state.in_flight:
                self.deadlines.begin(state.url)
        self._remove_if_drained(state)
        return True

    def activate(self, url: str) -> bool:
        """Take a draining worker back (it gets new requests again; nothing is moved off it). False if
        unknown."""
        state = self._workers.get(url.rstrip("/"))
        if state is None:
            return False
        if state.draining:
            state.draining = False
            self.deadlines.cancel(state.url)
            log.info("worker_active_again", worker=state.url)
        return True

    def remove(self, url: str) -> bool:
        """Forget ``url`` at once (in-flight requests finish on their own). False if unknown."""
        self.deadlines.cancel(url.rstrip("/"))
        return self._workers.pop(url.rstrip("/"), None) is not None

    def _remove_if_drained(self, state: WorkerState) -> None:
        if state.draining and state.in_flight == 0:
            self._workers.pop(state.url, None)
            self.deadlines.cancel(state.url)
            log.info("worker_drained", worker=state.url)

    def get(self, url: str) -> WorkerState | None:
        """A worker's state, or None if it is not in the pool."""
        return self._workers.get(url)

    def any_healthy(self) -> bool:
        """At least one worker is eligible now."""
        now = self._clock()
        return any([self._eligible(w, now) for w in self._workers.values()])

    def views(self) -> list[WorkerView]:
        """Immutable snapshots of every worker, for routing."""
        now = self._clock()
        return [
            WorkerView(w.url, self._eligible(w, now), w.in_flight, w.in_flight_tokens)
            for w in self._workers.values()
        ]

    def retry_after_s(self, floor_s: float = 1.0, cap_s: float = 60.0) -> float:
        """When a request refused for want of an eligible worker may be retried, s: the soonest any
        worker may take traffic again (an open breaker's remaining cool-down; a worker not yet seen up:
        the next health probe), within ``[floor_s, cap_s]``; ``floor_s`` when no worker says more (none,
        or only draining ones). A fixed 1 s sent clients back 30 times per 30 s cool-down."""
        now = self._clock()
        waits: list[float] = []
        for w in self._workers.values():
            if w.draining:
                continue
            reopens = w.breaker.reopens_in(now)
            waits.append(reopens if reopens is not None else (0.0 if w.seen_up else self._interval))
        return min(cap_s, max(floor_s, min(waits))) if waits else floor_s

    def eligibility(self, model: str | None = None) -> list[tuple[str, bool]]:
        """``(url, eligible now)`` of every worker of ``model`` (None: every worker): what :meth:`views`
        says of them, without building the views (the scheduler asks on every request). A worker that
        serves none of the gateway's models is in no model's list."""
        now = self._clock()
        return [
            (w.url, self._eligible(w, now))
            for w in self._workers.values()
            if model is None or w.model == model
        ]

    def _other_eligible(self, url: str) -> bool:
        """Whether a worker of ``url``'s model other than ``url`` takes new requests now."""
        state = self._workers.get(url)
        if state is None:
            return False
        now = self._clock()
        return any(
            [
                w is not state and w.model == state.model and self._eligible(w, now)
                for w in self._workers.values()
            ]
        )

    def workers_of(self, model: str) -> list[str]:
        """URLs of the workers that serve ``model`` (canonical id)."""
        return [w.url for w in self._workers.values() if w.model == model]

    def _eligible(self, state: WorkerState, now: float) -> bool:
        """``state.eligible(now)``, reporting the open -> half-open move its cool-down may make."""
        before = state.breaker.state
        ok = state.eligible(now)
        self._transition(state, before)
        return ok

    # -- health ----------------------------------------------------------------------------------------
    def _transition(self, state: WorkerState, before: BreakerState) -> None:
        after = state.breaker.state
        if after != before:
            log.info("worker_breaker", worker=state.url, state=after, before=before)
            if self._on_transition is not None:
                self._on_transition(state.url, after)

    def _note(self, state: WorkerState, reason: str) -> None:
        """Log a change of ``state``'s health (up: seen up, breaker closed) once, with ``reason`` (what
        was seen last), and keep it for ``/admin/workers``."""
        up = state.seen_up and state.breaker.state == "closed"
        mismatch = state.model_mismatch if up else None
        if not up and state.breaker.state == "open" and "circuit breaker" not in reason:
            reason = f"{reason}: circuit breaker open"
        key = (up, mismatch if up else reason)
        if key == state.reported:
            return
        before, reason = state.health_reason, mismatch or reason
        state.reported, state.health_reason, state.health_since = key, reason, self._wall_clock()
        if up:
            (log.warning if mismatch else log.info)(
                "worker_healthy", worker=state.url, reason=reason, before=before
            )
        else:
            log.warning(
                "worker_unhealthy",
                worker=state.url,
                reason=reason,
                breaker=state.breaker.state,
                before=before,
            )

    def _check_model(self, state: WorkerState) -> None:
        """Place ``state`` by the model its worker reports (:meth:`ModelRegistry.place`); a change is
        logged once: ``worker_excluded`` (WARNING, with the reason) or ``worker_model`` (it serves one)."""
        info = self._client.known_info(state.url)
        if self._models is None or info is None:  # nothing learned (yet): it keeps its place
            return
        model, why = self._models.place(state.expected_model, info.model)
        if (model, why) == (state.model, state.model_mismatch):
            return
        state.model, state.model_mismatch = model, why
        if why is not None:
            log.warning(
                "worker_excluded",
                worker=state.url,
                reason=why,
                reported_model=info.model,
                listed_under=state.expected_model,
            )
        else:
            log.info("worker_model", worker=state.url, model=model, reported_model=info.model)

    def record(self, url: str, signal: Signal, reason: str | None = None) -> None:
        """Feed one piece of evidence about ``url`` to its breaker (the module's rule); unknown URLs
        are ignored. ``reason``: what was seen, for the health log (default: the signal's own words)."""
        state = self._workers.get(url)
        if state is None:
            return
        now = self._clock()
        if signal in ("request_ok", "probe_ok", "deep_probe_ok"):
            state.seen_up = True
        if signal in ("probe_ok", "deep_probe_ok"):  # what it reports was (re)learned with the probe
            self._check_model(state)
        age = None if state.last_request_ok is None else now - state.last_request_ok
        verdict = judge(signal, age, self._breaker_config.trust_window_s)
        if signal == "request_ok":
            state.last_request_ok = now
        before = state.breaker.state
        state.breaker.apply(verdict, now)
        if verdict == "ignore":
            log.info("probe_failure_outweighed", worker=url, signal=signal, request_ok_age_s=age)
        self._transition(state, before)
        # a served request says nothing new of a worker already logged up (nothing more per request)
        if signal != "request_ok" or state.reported is None or not state.reported[0]:
            self._note(state, reason or SIGNAL_REASONS[signal])

    def trip(self, url: str) -> None:
        """Open ``url``'s breaker now (its supervisor saw the process die); unknown URLs are ignored."""
        self.record(url, "refused", "its process exited or stopped answering (supervisor)")

    def readmit(self, url: str) -> None:
        """Make a restarted worker's breaker half-open at once (fresh process, base cool-down): the next
        probes, and requests, decide whether it closes."""
        state = self._workers.get(url)
        if state is None:
            return
        before = state.breaker.state
        state.breaker.half_open()
        state.last_request_ok = None
        self._transition(state, before)

    async def probe_all(self) -> None:
        """Probe every worker whose breaker admits a probe, concurrently, and record the results."""
        now = self._clock()
        self._rounds += 1
        deep = self._deep_every > 0 and self._rounds % self._deep_every == 0
        due: list[tuple[str, bool]] = []  # (url, deep): a worker not yet seen up gets the plain probe
        for worker in list(self._workers.values()):
            before = worker.breaker.state
            if not worker.seen_up or worker.breaker.allow(now):  # allow() may move open -> half-open
                due.append((worker.url, deep and worker.seen_up))
            self._transition(worker, before)
        reports = await asyncio.gather(
            *(self._client.check(u, self._deep_timeout if d else self._timeout, d) for u, d in due)
        )
        for (url, deep_here), report in zip(due, reports, strict=True):
            state = self._workers.get(url)
            result = report.result
            if state is None:
                continue
            if result == "ok":
                self.record(url, "deep_probe_ok" if deep_here else "probe_ok", report.reason)
            elif result == "unknown":  # our own connection pool was full: no evidence either way
                continue
            elif state.seen_up:  # a worker still starting up is not failing
                failed: Signal = "deep_probe_failed" if deep_here else "probe_failed"
                self.record(url, "refused" if result == "refused" else failed, report.reason)
            else:  # not up yet: no evidence for its breaker, but why it is not is logged (one kind of
                # probe for it, so that its reason does not alternate between /health and /health_generate)
                self._note(state, report.reason)

    @property
    def _deep_timeout(self) -> float:
        # SGLang's /health_generate itself waits up to 20 s (SGLANG_HEALTH_CHECK_TIMEOUT) for progress
        # before answering 503, so a deep probe gets longer than that: its failure is then SGLang's verdict
        return max(self._timeout, 25.0)

    def suspect(self, url: str) -> None:
        """A request to ``url`` got an HTTP 5xx: confirm it with a deep probe before it counts.

        Starts a background ``/health_generate`` probe of ``url`` unless one is already in flight (then
        this answer waits for that one's verdict: concurrent 5xx share one probe). When it settles, each
        answer it confirms is one ``request_failed`` (failed probe), or the worker is cleared with
        ``deep_probe_ok`` (passing probe: the 5xx was the request's own fault), or tripped (``refused``).
        Needs a running event loop; unknown URLs are ignored.
        """
        state = self._workers.get(url)
        if state is None:
            return
        state.suspects += 1
        if url not in self._confirming:
            self._confirming[url] = asyncio.create_task(self._confirm(url), name=f"confirm-5xx {url}")

    async def _confirm(self, url: str) -> None:
        try:
            report = await self._client.check(url, self._deep_timeout, deep=True)
            result, why = report.result, f"5xx answers, then {report.reason}"
        except Exception:  # a probe must never leave its suspects waiting forever
            log.exception("confirmation_probe_failed", worker=url)
            result, why = "unknown", ""
        finally:
            self._confirming.pop(url, None)
        state = self._workers.get(url)
        if state is None:
            return
        suspects, state.suspects = state.suspects, 0
        verdict = {"ok": "cleared", "failed": "confirmed", "refused": "refused"}.get(result, "no_evidence")
        log.info("worker_5xx_confirmation", worker=url, verdict=verdict, answers=suspects)
        if result == "ok":
            self.record(url, "deep_probe_ok", why)
        elif result == "refused":
            self.record(url, "refused", why)
        elif result == "failed":
            for _ in range(suspects):
                self.record(url, "request_failed", why)
        if self._on_confirmation is not None:
            self._on_confirmation(url, verdict)

    async def settle_confirmations(self) -> None:
        """Wait until every confirmation probe in flight has settled (for shutdown and tests)."""
        while self._confirming:
            await asyncio.gather(*self._confirming.values(), return_exceptions=True)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.probe_all()
            except Exception:  # a probe must never kill the loop
                log.exception("health_probe_failed")

    async def start(self) -> None:
        """Probe once, then keep probing in the background."""
        await self.probe_all()
        self._task = asyncio.create_task(self._probe_loop(), name="worker-health")

    async def stop(self) -> None:
        """Stop probing (confirmation probes in flight are cancelled: their suspicions are dropped) and
        drain deadlines."""
        self.deadlines.stop()
        tasks = [t for t in (self._task, *self._confirming.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None
        self._confirming.clear()

    # -- choice and accounting ---------------------------------------------------------------------
    def choose(self, exclude: Collection[str] = ()) -> str | None:
        """The least-loaded eligible worker not in ``exclude``, for retries; None when there is none."""
        pick = self._retry_router.choose(self.views(), "", self._clock(), exclude)
        return pick.url if pick else None

    def acquire(self, url: str, tokens: int) -> None:
        """Count one request of ``tokens`` as in flight on ``url``."""
        state = self._workers.get(url)
        if state is None:  # removed meanwhile: nothing to count
            return
        state.in_flight += 1
        state.in_flight_tokens += tokens

    def release(self, url: str, tokens: int) -> None:
        """Undo :meth:`acquire`."""
        state = self._workers.get(url)
        if state is not None:
            state.in_flight -= 1
            state.in_flight_tokens -= tokens
            self._remove_if_drained(state)

    @contextlib.contextmanager
    def lease(self, url: str, tokens: int) -> Iterator[None]:
        """Count a request as in flight on ``url`` for the duration of the block."""
        self.acquire(url, tokens)
        try:
            yield
        finally:
            self.release(url, tokens)


def _single_model(names: list[str]) -> ModelRegistry | None:
    """A registry of one model named ``names`` (its id, then aliases), for a pool given only the names;
    None when there are none (models not checked)."""
    if not names:
        return None
    model = ServedModel(
        names[0], Path("."), {}, SchedulerSettings(), RoutingSettings(), aliases=tuple(names[1:])
    )
    return ModelRegistry([model])
