"""The one pipeline every completion goes through.

1. :meth:`Dispatcher.prepare`: model, priority class and max_tokens checks, prompt rendering and token
   count (nothing charged yet; bad input raises :class:`APIError` 4xx).
2. :meth:`Dispatcher.admit`: one atomic Redis call takes 1 request and prompt+max_tokens tokens from the
   tenant's buckets (429 with ``Retry-After``, or 413 when the request exceeds a burst).
3. :meth:`Dispatcher.complete` / :meth:`Dispatcher.stream`: pick a worker, call SGLang ``/generate``,
   retrying on another worker before the first token.
4. Settle once, whatever happened: reconcile the reservation with the real usage (refund on failure or
   cancellation), record usage, metrics and one log line.

Cancellation (client gone) raises ``CancelledError`` inside 3; the settle step runs shielded, aborts the
upstream request and refunds what was not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from service.api.errors import APIError
from service.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    UsageInfo,
    chat_chunk,
    chat_response,
    now_s,
    text_chunk,
    text_response,
    usage_chunk,
)
from service.config import Settings
from service.metrics import GatewayMetrics
from service.preparation import PreparedRequest, RequestPreparer
from service.prompting import PromptRenderer
from service.scheduler import Scheduler, SchedulingRequest, Slot
from service.workers.client import SGLangClient, UpstreamChunk, UpstreamError
from service.workers.pool import WorkerPool
from tenancy.models import Tenant
from tenancy.quota import QuotaLimiter, Reservation
from tenancy.usage import UsageRecorder

log = structlog.get_logger("radixgate.request")


@dataclass(slots=True)
class Outcome:
    """What happened to a request, filled in as it runs and settled once."""

    status: int = 200
    worker: str | None = None
    attempts: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    error_code: str | None = None
    streamed_any: bool = False
    finished: bool = False
    slot: Slot | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class Dispatcher:
    """Runs the request pipeline. One per app, built in the lifespan.

    Args:
        settings: the app's settings.
        renderer: chat template and tokenizer.
        quota: token buckets.
        usage: usage counters.
        pool: workers.
        client: SGLang HTTP client.
        metrics: the app's metrics.
    """

    def __init__(
        self,
        settings: Settings,
        renderer: PromptRenderer,
        quota: QuotaLimiter,
        usage: UsageRecorder,
        pool: WorkerPool,
        client: SGLangClient,
        metrics: GatewayMetrics,
        scheduler: Scheduler,
    ) -> None:
        self._settings = settings
        self._preparer = RequestPreparer(settings, renderer)
        self._scheduler = scheduler
        self._quota = quota
        self._usage = usage
        self._pool = pool
        self._client = client
        self._metrics = metrics

    # 1. validation -------------------------------------------------------------------------------
    def prepare(
        self, tenant: Tenant, req: ChatCompletionRequest | CompletionRequest, rid: str, arrival: float
    ) -> PreparedRequest:
        """Validate and render a request (see :meth:`RequestPreparer.prepare`); charges nothing."""
        return self._preparer.prepare(tenant, req, rid, arrival)

    # 2. admission ----------------------------------------------------------------------------------
    async def admit(self, prepared: PreparedRequest) -> Reservation:
        """Reserve the request against the tenant's token buckets.

        Raises:
            APIError: 429 with ``Retry-After`` when a bucket is short; 413 when the request is larger
                than a bucket's burst and so can never pass.
        """
        tenant = prepared.tenant
        tokens = prepared.reserved_tokens
        decision = await self._quota.reserve(tenant.id, tenant.quotas, tokens)
        if decision.allowed:
            return Reservation(tenant.id, tenant.quotas, 1, tokens)
        self._metrics.quota_rejections.labels(self._metrics.tenant(tenant.id), decision.limiting).inc()
        await self._usage.record(tenant.id, quota_rejections=1)
        if decision.never:
            burst = (
                tenant.quotas.effective_token_burst
                if decision.limiting == "tokens"
                else tenant.quotas.effective_request_burst
            )
            raise APIError(
                413,
                f"This request needs {tokens} tokens (prompt {prompt_tokens_of(prepared)} + max_tokens "
                f"{prepared.max_tokens}) but the tenant's {decision.limiting} burst is {burst:g}; it can "
                "never be admitted. Lower max_tokens or shorten the prompt.",
                code="request_exceeds_burst",
                param="max_tokens",
            )
        retry_after = max(1, math.ceil(decision.retry_after_s))
        per = "requests per minute" if decision.limiting == "requests" else "tokens per minute"
        raise APIError(
            429,
            f"Rate limit reached for tenant '{tenant.id}' on {per}. Retry after {retry_after} s.",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after)},
        )

    # 3. upstream -----------------------------------------------------------------------------------
    def _pick(self, tried: set[str], outcome: Outcome, last_error: APIError | None) -> str:
        """An untried healthy worker (recorded in ``outcome``); else the last attempt's error, or 503."""
        worker = self._pool.choose(exclude=tried)
        if worker is None:
            if last_error is not None:
                raise last_error
            raise APIError(
                503,
                "No healthy worker is available; retry shortly.",
                code="no_worker_available",
                headers={"Retry-After": "1"},
            )
        tried.add(worker)
        outcome.worker, outcome.attempts = worker, outcome.attempts + 1
        return worker

    async def _worker_for_attempt(
        self, prepared: PreparedRequest, outcome: Outcome, tried: set[str], last_error: APIError | None
    ) -> tuple[str, contextlib.AbstractContextManager[None]]:
        """The worker of the next attempt and a context that counts it as in flight there.

        The first attempt waits in the scheduler's queue for a slot (may raise 503 shed/timeout); a
        retry goes straight to another healthy worker (the request was already admitted).
        """
        if outcome.slot is None:
            tenant = prepared.tenant
            outcome.slot = await self._scheduler.acquire(
                SchedulingRequest(
                    tenant.id,
                    tenant.weight,
                    prepared.priority_class,
                    prepared.reserved_tokens,
                    prepared.prompt.text,
                    prepared.session_id,
                )
            )
            worker = outcome.slot.worker
            tried.add(worker)
            outcome.worker, outcome.attempts = worker, outcome.attempts + 1
            return worker, contextlib.nullcontext()
        self._scheduler.release(outcome.slot)  # the failed worker's window is free again
        worker = self._pick(tried, outcome, last_error)
        return worker, self._pool.lease(worker, prepared.reserved_tokens)

    def _retry_or_raise(self, exc: UpstreamError, outcome: Outcome) -> APIError:
        """Record a failed attempt; raise its :class:`APIError` unless another worker may be tried."""
        err = self._upstream_failed(exc, outcome)
        budget_left = outcome.attempts < self._settings.upstream.max_attempts
        if outcome.streamed_any or not exc.retryable or not budget_left:
            raise err from exc
        return err

    def _upstream_failed(self, exc: UpstreamError, outcome: Outcome) -> APIError:
        kind = "transport" if exc.status is None else f"http_{exc.status}"
        self._metrics.upstream_errors.labels(exc.worker, kind).inc()
        if exc.status is None:
            self._pool.mark_failed(exc.worker)
        if exc.status is not None and 400 <= exc.status < 500:
            outcome.error_code = "upstream_rejected"
            return APIError(400, f"The worker rejected the request: {exc}", code="upstream_rejected")
        outcome.error_code = "upstream_unavailable"
        status = 503 if exc.status is None else 502
        return APIError(
            status,
            "The upstream worker failed; retry shortly.",
            code="upstream_error",
            headers={"Retry-After": "1"},
        )

    async def complete(self, prepared: PreparedRequest, reservation: Reservation) -> dict[str, Any]:
        """Serve a non-streamed request; returns the OpenAI response object.

        Raises:
            APIError: 502/503 after the retry budget is spent, 400 if the worker rejects the input.
        """
        outcome = Outcome()
        self._metrics.in_flight.inc()
        try:
            tried: set[str] = set()
            last_error: APIError | None = None
            while True:
                worker, in_flight = await self._worker_for_attempt(prepared, outcome, tried, last_error)
                try:
                    with in_flight:
                        chunk = await self._client.generate(worker, prepared.body)
                    break
                except UpstreamError as exc:
                    last_error = self._retry_or_raise(exc, outcome)
            outcome.ttft_s = time.perf_counter() - prepared.arrival
            self._count(outcome, chunk)
            outcome.finished = True
            usage = UsageInfo.of(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens)
            make = chat_response if prepared.chat else text_response
            return make(prepared.rid, prepared.model, chunk.text, chunk.finish_reason, usage)
        except APIError as err:
            outcome.status = err.status
            raise
        except asyncio.CancelledError:
            outcome.status = 499
            raise
        finally:
            self._metrics.in_flight.dec()
            if outcome.slot is not None:
                self._scheduler.release(outcome.slot)
            with anyio.CancelScope(shield=True):
                await self._settle(prepared, reservation, outcome)

    async def stream(
        self, prepared: PreparedRequest, reservation: Reservation
    ) -> AsyncGenerator[bytes, None]:
        """Serve a streamed request as OpenAI SSE chunks, ending with ``data: [DONE]``.

        Errors before the first token are retried on another worker and, once the retry budget is spent,
        raised as :class:`APIError` before anything is yielded; later ones end the stream with an OpenAI
        error event. Cancellation aborts the upstream request and refunds the unused tokens.
        """
        outcome = Outcome()
        created = now_s()
        self._metrics.in_flight.inc()
        try:
            async for event in self._stream_events(prepared, outcome, created):
                yield event
            if prepared.include_usage:
                usage = UsageInfo.of(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens)
                yield _sse(usage_chunk(prepared.rid, prepared.model, created, prepared.chat, usage))
            yield b"data: [DONE]\n\n"
        except APIError as err:
            outcome.status = err.status
            if not outcome.streamed_any:
                raise  # nothing sent yet: the route answers with a real HTTP status
            yield err.sse_event()
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            outcome.status = 499
            raise
        finally:
            self._metrics.in_flight.dec()
            if outcome.slot is not None:
                self._scheduler.release(outcome.slot)
            with anyio.CancelScope(shield=True):
                if not outcome.finished and outcome.worker is not None:
                    await self._client.abort(outcome.worker, prepared.rid)
                await self._settle(prepared, reservation, outcome)

    async def _stream_events(
        self, prepared: PreparedRequest, outcome: Outcome, created: int
    ) -> AsyncIterator[bytes]:
        tried: set[str] = set()
        last_error: APIError | None = None
        while True:
            worker, in_flight = await self._worker_for_attempt(prepared, outcome, tried, last_error)
            try:
                with in_flight:
                    async for chunk in self._client.stream(worker, prepared.body):
                        if not outcome.streamed_any:
                            outcome.ttft_s = time.perf_counter() - prepared.arrival
                            outcome.streamed_any = True
                            if prepared.chat:
                                yield _sse(
                                    chat_chunk(
                                        prepared.rid,
                                        prepared.model,
                                        created,
                                        {"role": "assistant", "content": ""},
                                        None,
                                    )
                                )
                        self._count(outcome, chunk)
                        if chunk.text or chunk.finish_reason:
                            yield _sse(
                                chat_chunk(
                                    prepared.rid,
                                    prepared.model,
                                    created,
                                    {"content": chunk.text} if chunk.text else {},
                                    chunk.finish_reason,
                                )
                                if prepared.chat
                                else text_chunk(
                                    prepared.rid, prepared.model, created, chunk.text, chunk.finish_reason
                                )
                            )
                        if chunk.finish_reason:
                            outcome.finished = True
                return
            except UpstreamError as exc:
                last_error = self._retry_or_raise(exc, outcome)

    @staticmethod
    def _count(outcome: Outcome, chunk: UpstreamChunk) -> None:
        outcome.prompt_tokens = chunk.prompt_tokens or outcome.prompt_tokens
        outcome.completion_tokens = max(outcome.completion_tokens, chunk.completion_tokens)
        outcome.cached_tokens = max(outcome.cached_tokens, chunk.cached_tokens)

    # 4. settle -------------------------------------------------------------------------------------
    async def _settle(self, prepared: PreparedRequest, reservation: Reservation, outcome: Outcome) -> None:
        """Reconcile quota, record usage and metrics, and log one line. Never raises."""
        tenant_id = prepared.tenant.id
        served = outcome.finished or outcome.streamed_any
        slot = outcome.slot
        if served and slot is not None and outcome.worker == slot.worker:
            self._scheduler.observe(slot, prepared.prompt.text, outcome.cached_tokens, outcome.prompt_tokens)
        try:
            if served:
                if not outcome.prompt_tokens:
                    outcome.prompt_tokens = prepared.prompt.num_tokens
                await self._quota.reconcile(reservation, outcome.prompt_tokens + outcome.completion_tokens)
                await self._usage.record(
                    tenant_id,
                    requests=1,
                    errors=int(outcome.status != 200),
                    prompt_tokens=outcome.prompt_tokens,
                    completion_tokens=outcome.completion_tokens,
                    cached_tokens=outcome.cached_tokens,
                )
            else:
                await self._quota.refund(reservation)
                await self._usage.record(tenant_id, errors=int(outcome.status not in (200, 499)))
        except Exception:
            log.exception("settle_failed", request_id=prepared.rid, tenant=tenant_id)
        latency = time.perf_counter() - prepared.arrival
        m, label = self._metrics, self._metrics.tenant(tenant_id)
        m.requests.labels(label, prepared.model, str(outcome.status)).inc()
        m.e2e.labels(label, prepared.model).observe(latency)
        if outcome.ttft_s is not None:
            m.ttft.labels(label, prepared.model).observe(outcome.ttft_s)
        if served:
            m.prompt_tokens.labels(label).inc(outcome.prompt_tokens)
            m.completion_tokens.labels(label).inc(outcome.completion_tokens)
            m.cached_tokens.labels(label).inc(outcome.cached_tokens)
        log.info(
            "request",
            request_id=prepared.rid,
            tenant=tenant_id,
            model=prepared.model,
            priority_class=prepared.priority_class,
            stream=prepared.stream,
            worker=outcome.worker,
            attempts=outcome.attempts,
            status=outcome.status,
            error=outcome.error_code,
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            cached_tokens=outcome.cached_tokens,
            reserved_tokens=reservation.tokens,
            ttft_ms=None if outcome.ttft_s is None else round(outcome.ttft_s * 1000, 1),
            latency_ms=round(latency * 1000, 1),
        )


def prompt_tokens_of(prepared: PreparedRequest) -> int:
    """Prompt tokens of a prepared request."""
    return prepared.prompt.num_tokens
