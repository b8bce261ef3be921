"""The one pipeline every completion goes through.

1. :meth:`Dispatcher.prepare`: model, priority class and max_tokens checks, prompt rendering and token
   count (nothing charged yet; bad input raises a 4xx :class:`service.errors.GatewayError`).
2. :meth:`Dispatcher.admit`: for a tenant or key with ``max_concurrent_requests``, one atomic Redis call
   takes a concurrency slot (429 ``concurrency_limit_exceeded``; :mod:`tenancy.concurrency`); then one
   atomic Redis call takes 1 request and prompt+max_tokens tokens from the key's, the model's and the
   tenant's buckets (429 with ``Retry-After``, or 413 when the request exceeds a burst). The slot is
   released when the request ends.
3. :meth:`Dispatcher.complete` / :meth:`Dispatcher.stream`: wait for a slot in the scheduler's queue
   (priority bands, fair queuing, shedding; it routes the request), then call SGLang ``/generate``
   through :class:`service.pipeline.upstream.UpstreamCaller` (retries, mid-stream resume, circuit breakers).
4. Settle once, whatever happened: reconcile the reservation with the real usage (refund on failure or
   cancellation) and record usage in one atomic Redis call (:meth:`QuotaLimiter.settle`, through
   :class:`service.pipeline.settlement.Settler`, which retries it in the background when Redis is short), then
   metrics and one log line.

Cancellation (client gone) raises ``CancelledError`` inside 3; the settle step runs shielded, aborts the
upstream request and refunds what was not used. What a worker computed for a request before its client
left is charged, streamed or not: the prompt and the completion tokens the worker reported (a
non-streamed answer's counts come with the worker's answer to the abort), or the reservation's prompt
part when the worker reported nothing. A request whose client left before it reached a worker is
refunded in full.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import structlog

from service.config.settings import Settings
from service.errors import GatewayError, Overloaded, QueueTimeout, RateLimited
from service.observability.breakdown import RequestTiming
from service.observability.metrics import GatewayMetrics
from service.openai.choices import ChoiceState
from service.openai.shapes import ChatShaper, Shaper, TextShaper
from service.pipeline.billing import Billing
from service.pipeline.fair_slots import FairSlots, TooManyWaiting
from service.pipeline.fanout import choice_requests, merge_choices, stream_choices
from service.pipeline.outage import OutageMode
from service.pipeline.prepare import PreparedRequest, RequestPreparer
from service.pipeline.prompting import PromptRenderer
from service.pipeline.quota_admission import Admitted, RequestAdmission
from service.pipeline.request_record import record_request, settlement_of
from service.pipeline.revocation import Revocable, RevocationRegistry
from service.pipeline.served_models import ServedModels
from service.pipeline.settlement import Settler
from service.pipeline.slot_admission import SlotAdmission
from service.pipeline.upstream import Outcome, UpstreamCaller
from service.protocol.completions import ChatCompletionRequest, CompletionRequest, UsageInfo, now_s
from service.runtime.task_stop import finish_despite_cancel
from service.workers.chunks import UpstreamChunk
from service.workers.client import SGLangClient
from service.workers.pool import WorkerPool
from tenancy.billing import COST_FIELD
from tenancy.concurrency import ConcurrencyLimiter
from tenancy.models import ApiKeyRecord, Tenant
from tenancy.quota import Reservation
from tenancy.quota_lease import LeasedQuota
from tenancy.usage import UsageRecorder

T = TypeVar("T")


log = structlog.get_logger("radixgate.request")


class _Run:
    """One request's choices while it runs: their worker requests, outcomes and answers so far.

    ``outcome`` is the request's own (status, error, TTFT; for n = 1 the one choice's); for n > 1 it is
    filled from the choices' when the request ends (:func:`service.pipeline.fanout.merge_choices`).
    ``revocable`` is its entry in the replica's :class:`RevocationRegistry`.
    """

    def __init__(self, prepared: PreparedRequest, renderer: PromptRenderer, revocable: Revocable) -> None:
        self.parts = choice_requests(prepared)
        self.choices = [Outcome() for _ in self.parts]
        for part, choice in zip(self.parts, self.choices, strict=True):
            if prepared.n > 1:
                choice.upstream_rid = part.rid
        self.outcome = self.choices[0] if prepared.n == 1 else Outcome()
        self.choices[0].timing = prepared.timing  # the request's phases: its first choice's attempts
        tokens = renderer if prepared.output.logprobs is not None else None
        self.states = [ChoiceState(i, prepared.rid, prepared.output, tokens) for i in range(prepared.n)]
        self.revocable = revocable

    async def until_revoked(self, work: Awaitable[T]) -> T:
        """Await ``work``, which :mod:`service.pipeline.revocation` may cancel while it runs
        (:meth:`Revocable.guard`); a revocation's :class:`GatewayError` is raised and marks the outcome."""
        try:
            return await self.revocable.guard(work)
        except GatewayError as err:
            if err is self.revocable.error:
                self.outcome.revoked = self.revocable.charge
            raise

    def revoked(self) -> GatewayError | None:
        """After a cancellation: the revocation's error if it was one (the task is uncancelled and the
        outcome marked), else None."""
        revoked = self.revocable.take_error()
        if revoked is not None:
            self.outcome.revoked = self.revocable.charge
        return revoked

    def usage(self) -> UsageInfo:
        """The usage so far: the prompt once, the completions of all choices."""
        merge_choices(self.outcome, self.choices)
        o = self.outcome
        return UsageInfo.of(o.prompt_tokens, o.completion_tokens, o.cached_tokens)


class Dispatcher:
    """Runs the request pipeline. One per app, built in the lifespan.

    Args:
        settings: the app's settings.
        models: the served models (each its tokenizer and template, and its scheduler: the gateway's
            queue for that model's workers).
        quota: token buckets, through local leases.
        usage: usage counters.
        pool: workers.
        client: SGLang HTTP client.
        metrics: the app's metrics.
        settler: settles requests (retrying in the background when Redis is short).
        revocations: the requests in flight by tenant and key, ended when those are revoked.
        concurrency: the concurrency slots of capped tenants and keys (Redis, shared by every replica).
        billing: prices and budgets (:mod:`service.pipeline.billing`).
        status_of: the HTTP status a domain error is answered with
            (:func:`service.api.errors.http_status`; the pipeline knows no statuses of its own but 200 and
            499), recorded in the ``request`` log line and ``radixgate_requests_total{status}``.
        outage: the ``open`` Redis outage policy (:mod:`service.pipeline.outage`); None: ``closed``.
    """

    def __init__(
        self,
        settings: Settings,
        models: ServedModels,
        quota: LeasedQuota,
        usage: UsageRecorder,
        pool: WorkerPool,
        client: SGLangClient,
        metrics: GatewayMetrics,
        settler: Settler,
        revocations: RevocationRegistry,
        concurrency: ConcurrencyLimiter,
        billing: Billing,
        status_of: Callable[[GatewayError], int],
        outage: OutageMode | None = None,
    ) -> None:
        self._settings = settings
        self._outage = outage
        self._status_of = status_of
        self._preparer = RequestPreparer(settings, models)
        self._models = models
        self._upstreams = {
            lane.model.id: UpstreamCaller(settings, pool, lane.scheduler, client, metrics, lane.renderer)
            for lane in models.lanes
        }
        self._client = client
        self._metrics = metrics
        self._settler = settler
        self._revocations = revocations
        api = settings.api
        slots = SlotAdmission(concurrency, metrics, usage)
        self._admission = RequestAdmission(
            quota, slots, usage, metrics, api.rate_limit_headers, billing, outage
        )
        self._offload_slots = FairSlots(api.max_offloaded_prepares, api.max_offload_waiting_per_tenant)

    # 1. validation -------------------------------------------------------------------------------
    def prepare(
        self,
        tenant: Tenant,
        req: ChatCompletionRequest | CompletionRequest,
        rid: str,
        timing: RequestTiming,
        key: ApiKeyRecord | None = None,
    ) -> PreparedRequest:
        """Validate and render a request (of API key ``key``; see :meth:`RequestPreparer.prepare`);
        charges nothing."""
        return self._preparer.prepare(tenant, req, rid, timing, key)

    async def prepare_offloaded(
        self,
        tenant: Tenant,
        req: ChatCompletionRequest | CompletionRequest,
        rid: str,
        timing: RequestTiming,
        key: ApiKeyRecord | None = None,
    ) -> PreparedRequest:
        """:meth:`prepare` in a worker thread, at most ``api.max_offloaded_prepares`` at once (later calls
        wait): for long prompts, whose token count would otherwise stall every request on the event loop
        (the tokenizer releases Python's lock for long texts, :meth:`PromptRenderer.encode`). Waiters take
        turns across tenants (:class:`FairSlots`). Cancelled while waiting, it gives up its place; while
        counting, it keeps its slot until the thread is done (threads stay bounded). Same result and
        errors as :meth:`prepare`, and

        Raises:
            RateLimited: the tenant already has ``api.max_offload_waiting_per_tenant`` requests waiting.
        """
        try:
            async with self._offload_slots.hold(tenant.id):
                # cancelled, it keeps its slot until the thread is done (threads stay bounded)
                return await finish_despite_cancel(
                    asyncio.to_thread(self._preparer.prepare, tenant, req, rid, timing, key)
                )
        except TooManyWaiting:
            raise RateLimited(
                f"Tenant '{tenant.id}' has too many long prompts waiting to be prepared; retry shortly.",
                code="too_many_long_prompts",
                retry_after_s=1.0,
            ) from None

    # 2. admission ----------------------------------------------------------------------------------
    async def admit(self, prepared: PreparedRequest) -> Admitted:
        """Take a concurrency slot when the tenant or the request's API key has a cap, then reserve the
        request against its key's, its model's and its tenant's token buckets in one atomic call
        (:meth:`service.pipeline.quota_admission.RequestAdmission.admit`). The slot is released when the
        request ends (:meth:`_finish`), or at once when the buckets refuse.

        Returns:
            The reservation and the rate-limit state to tell the client (``{}``: no bucket).

        Raises:
            RateLimited: a cap is full (``concurrency_limit_exceeded``) or a bucket is short.
            RequestTooLarge: the request is larger than a bucket's burst and can never pass.
            Unauthenticated: the tenant was deleted since its key was checked.
            StoreUnavailable: Redis is exhausted, slow or unreachable.
        """
        return await self._admission.admit(prepared)

    # 3. upstream -----------------------------------------------------------------------------------
    def shaper(self, prepared: PreparedRequest) -> Shaper:
        """The response format of a chat or text completion."""
        kind = ChatShaper if prepared.chat else TextShaper
        return kind(prepared.rid, prepared.model, now_s(), prepared.include_usage)

    def _pieces(
        self, prepared: PreparedRequest, run: _Run
    ) -> AsyncGenerator[tuple[int, UpstreamChunk], None]:
        """``(choice index, chunk)`` of a streamed answer (or of n answers)."""
        upstream = self._upstream(prepared)
        if prepared.n > 1:
            return stream_choices(upstream, prepared, run.parts, run.choices)

        async def one() -> AsyncGenerator[tuple[int, UpstreamChunk], None]:
            async for chunk in upstream.stream(prepared, run.outcome):
                yield 0, chunk

        return one()

    async def complete(
        self,
        prepared: PreparedRequest,
        reservation: Reservation,
        shaper: Shaper | None = None,
        key_id: str = "",
    ) -> dict[str, Any]:
        """Serve a non-streamed request (of API key ``key_id``); returns the response object
        (``shaper``'s, by default the chat or text completion).

        A served answer's settle (its quota reconcile and usage, one Redis round trip, and its log line)
        is started as the answer is returned and not waited for (:meth:`_finish`); a failed request's is
        done before it raises.

        Raises:
            GatewayError: shed or timed out in the queue, attempts spent, the worker rejected the input, or
                the key or tenant was revoked meanwhile (:mod:`service.pipeline.revocation`).
        """
        run = _Run(prepared, self._renderer(prepared), self._track(prepared, key_id))
        self._metrics.in_flight.inc()
        try:
            if prepared.n == 1:
                answer = self._upstream(prepared).generate(prepared, run.outcome)
                run.states[0].step(await run.until_revoked(answer))
            else:  # n > 1: the choices stream in (the first one's prompt is cached before the rest start)
                pieces = self._pieces(prepared, run)
                try:
                    while (piece := await run.until_revoked(anext(pieces, None))) is not None:
                        run.states[piece[0]].step(piece[1])
                finally:
                    await finish_despite_cancel(pieces.aclose())
            # a non-streamed answer's TTFT is the worker's first token (breakdown), or unknown
            run.outcome.ttft_s = prepared.timing.ttft_s
            return (shaper or self.shaper(prepared)).response(run.states, run.usage())
        except GatewayError as err:
            self._failed(run.outcome, err)
            raise
        except asyncio.CancelledError:
            run.outcome.status = 499
            raise
        finally:
            await self._finish(prepared, reservation, run)

    async def stream(
        self,
        prepared: PreparedRequest,
        reservation: Reservation,
        shaper: Shaper | None = None,
        key_id: str = "",
    ) -> AsyncGenerator[bytes, None]:
        """Serve a streamed request as server-sent events (``shaper``'s, by default OpenAI's chunks ending
        with ``data: [DONE]``).

        Errors before the first token are retried on another worker and, once the attempts are spent,
        raised as a :class:`GatewayError` before anything is yielded (the route answers with that status). A
        stream that breaks later is resumed on another worker; if that fails too the stream ends with an
        error event. Cancellation aborts the upstream requests and refunds the unused tokens. A revoked
        key or tenant (API key ``key_id``) ends it like an error (:mod:`service.pipeline.revocation`).
        As in :meth:`complete`, the end of a stream that went well does not wait for its settle.
        """
        shaper = shaper or self.shaper(prepared)
        run = _Run(prepared, self._renderer(prepared), self._track(prepared, key_id))
        revocable = run.revocable
        outcome = run.outcome
        self._metrics.in_flight.inc()
        pieces = self._pieces(prepared, run)
        # events of chunks that came in one read from the worker are sent in one write (one syscall
        # instead of one per chunk); never held across a wait (n > 1 interleaves streams: no holding)
        held: list[bytes] = []
        coalesce = prepared.n == 1
        try:
            while True:  # run.until_revoked inlined: it runs once per chunk
                if revocable.error is not None:  # revoked while the last event was being sent
                    raise run.revoked() or revocable.error
                revocable.task = asyncio.current_task()
                try:
                    piece = await anext(pieces, None)
                except asyncio.CancelledError:
                    if (revoked := run.revoked()) is None:
                        raise
                    raise revoked from None
                finally:
                    revocable.task = None
                if piece is None:
                    break
                index, chunk = piece
                if outcome.ttft_s is None:
                    outcome.ttft_s = prepared.timing.ttft_s or time.perf_counter() - prepared.arrival
                state = run.states[index]
                first = not state.started
                held.extend(shaper.events(state, state.step(chunk), first))
                if held and not (coalesce and chunk.more_ready):
                    yield held[0] if len(held) == 1 else b"".join(held)
                    held.clear()
            held.extend(shaper.end(run.usage()))
            if held:
                yield b"".join(held)
        except GatewayError as err:
            self._failed(outcome, err)
            if not any(s.started for s in run.states):
                raise  # nothing sent yet: the route answers with a real HTTP status
            held.extend(shaper.error(err))
            yield b"".join(held)
        except (asyncio.CancelledError, GeneratorExit):
            outcome.status = 499
            raise
        finally:
            if outcome.status == 200:  # read to its end: closing it awaits nothing
                await pieces.aclose()
            else:  # it may be waiting on its worker: closing it ends that call and frees its connection
                await finish_despite_cancel(pieces.aclose())
            await self._finish(prepared, reservation, run)

    def _upstream(self, prepared: PreparedRequest) -> UpstreamCaller:
        """The attempts of a request's model (its scheduler, its tokenizer)."""
        return self._upstreams[prepared.model_id]

    def _renderer(self, prepared: PreparedRequest) -> PromptRenderer:
        """The tokenizer of a request's model."""
        return self._models.of(prepared.model_id).renderer

    def _track(self, prepared: PreparedRequest, key_id: str) -> Revocable:
        """Register the request (of API key ``key_id``) with the revocation registry until it ends."""
        return self._revocations.track(prepared.rid, prepared.tenant.id, key_id)

    async def _finish(self, prepared: PreparedRequest, reservation: Reservation, run: _Run) -> None:
        """Release the queue slot, abort unfinished upstream requests, settle. Shielded from cancel.

        A served answer's settle is started here and not waited for (:meth:`Settler.start` owns it, and
        :meth:`Settler.drain` waits for it at shutdown): the answer never waits for Redis, yet the refund
        is under way before the client holds the answer, so a next request it sends at once is not
        reserved first (a 429 its quota did not call for)."""
        self._metrics.in_flight.dec()
        self._admission.release(reservation)  # its last byte is written: its slot goes back now
        self._revocations.untrack(run.revocable)
        merge_choices(run.outcome, run.choices)
        outcome = run.outcome
        slot = outcome.slot
        if slot is not None:
            served_here = (outcome.finished or outcome.streamed_any) and outcome.worker == slot.worker
            cached = outcome.cached_tokens if served_here and not outcome.resumes else None
            self._models.of(prepared.model_id).scheduler.release(
                slot, ok=served_here, prompt_tokens=outcome.prompt_tokens, cached_tokens=cached
            )
        if outcome.status == 200:  # nothing awaited: no cancel scope needed (2% of a request's CPU)
            if reservation.linger:
                self._settle_with_others(prepared, reservation, outcome)
            else:
                self._settler.start(prepared.tenant.id, self._settle(prepared, reservation, outcome))
            return
        # in a task of the settler's: a cancel of this one (a client that leaves as its stream's error event
        # goes out) cuts neither short (anyio's shield does not stop a task's own cancel)
        ending = self._settler.start(prepared.tenant.id, self._abort_and_settle(prepared, reservation, run))
        await asyncio.shield(ending)

    async def _abort_and_settle(self, prepared: PreparedRequest, reservation: Reservation, run: _Run) -> None:
        await self._abort(prepared, run.choices)
        await self._settle(prepared, reservation, run.outcome)

    async def _abort(self, prepared: PreparedRequest, choices: Sequence[Outcome]) -> None:
        """Ask the workers to drop the choices that did not finish."""
        for choice in choices:
            if not choice.finished and not choice.aborted and choice.worker is not None:
                await self._client.abort(choice.worker, choice.upstream_rid or prepared.rid)

    # 4. settle -------------------------------------------------------------------------------------
    async def settled(self, tenant_id: str) -> None:
        """Wait for the settles of ``tenant_id``'s answers already sent (:meth:`Settler.settled`)."""
        await self._settler.settled(tenant_id)

    async def _settle(self, prepared: PreparedRequest, reservation: Reservation, outcome: Outcome) -> None:
        """Reconcile quota, record usage and metrics, and log one line. Never raises.

        Charged: a served answer (finished, or streamed in part), and one whose client left (499) or whose
        key or tenant was revoked while a worker had it: the worker's counts, or the reservation's prompt
        part when it gave none. Refunded in full: everything else. A 499 is the client's choice, not an
        error.
        """
        item, charged = settlement_of(prepared, reservation, outcome)
        latency = time.perf_counter() - prepared.arrival  # the answer's, not the bookkeeping's below
        if reservation.local and self._outage is not None:  # admitted while Redis was out of reach
            self._outage.settle(item)
        else:  # one round trip for buckets and usage; retried in the background if Redis is short
            await self._settler.settle(item)
        cost = item.usage.get(COST_FIELD, 0)
        goal_s = self._goal_s(prepared)
        record_request(self._metrics, prepared, reservation, outcome, charged, latency, goal_s, cost)

    def _settle_with_others(
        self, prepared: PreparedRequest, reservation: Reservation, outcome: Outcome
    ) -> None:
        """:meth:`_settle` of a served answer under a lease: summed with its tenant's other settles of the
        linger (:meth:`service.pipeline.settlement.Settler.submit`), nothing awaited."""
        item, charged = settlement_of(prepared, reservation, outcome)
        self._settler.submit(item)
        latency = time.perf_counter() - prepared.arrival
        cost = item.usage.get(COST_FIELD, 0)
        goal_s = self._goal_s(prepared)
        record_request(self._metrics, prepared, reservation, outcome, charged, latency, goal_s, cost)

    def _goal_s(self, prepared: PreparedRequest) -> float | None:
        """The TTFT goal of ``prepared``'s class for its model, s (None: a class the model does not have)."""
        lane = self._models.lane(prepared.model_id) if prepared.model_id else None
        cls = lane.model.classes.get(prepared.priority_class) if lane is not None else None
        return cls.ttft_goal_ms / 1000.0 if cls is not None else None

    def _failed(self, outcome: Outcome, err: GatewayError) -> None:
        """Record ``err`` on ``outcome``: its HTTP status, its code (the first one, when several came), and
        for a request admission control shed, why and on what prediction (the ``request`` log line shows
        both)."""
        outcome.status = self._status_of(err)
        outcome.error_code = outcome.error_code or err.code
        if isinstance(err, Overloaded):
            outcome.shed_reason, outcome.shed_predicted_ttft_s = err.reason, err.predicted_ttft_s
        elif isinstance(err, QueueTimeout):
            outcome.expired_after_s, outcome.shed_predicted_ttft_s = err.waited_s, err.predicted_ttft_s
