"""The one pipeline every completion goes through.

1. :meth:`Dispatcher.prepare`: model, priority class and max_tokens checks, prompt rendering and token
   count (nothing charged yet; bad input raises a 4xx :class:`service.errors.GatewayError`).
2. :meth:`Dispatcher.admit`: one atomic Redis call takes 1 request and prompt+max_tokens tokens from the
   tenant's buckets (429 with ``Retry-After``, or 413 when the request exceeds a burst).
3. :meth:`Dispatcher.complete` / :meth:`Dispatcher.stream`: wait for a slot in the scheduler's queue
   (priority bands, fair queuing, shedding; it routes the request), then call SGLang ``/generate``
   through :class:`service.upstream.UpstreamCaller` (retries, mid-stream resume, circuit breakers).
4. Settle once, whatever happened: reconcile the reservation with the real usage (refund on failure or
   cancellation) and record usage in one atomic Redis call (:meth:`QuotaLimiter.settle`), then
   metrics and one log line.

Cancellation (client gone) raises ``CancelledError`` inside 3; the settle step runs shielded, aborts the
upstream request and refunds what was not used.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator
from typing import Any

import anyio
import orjson
import structlog

from service.api.errors import http_status, sse_error_event
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
from service.errors import GatewayError, RateLimited, RequestTooLarge, Unauthenticated
from service.metrics import GatewayMetrics
from service.preparation import PreparedRequest, RequestPreparer
from service.prompting import PromptRenderer
from service.scheduler import Scheduler
from service.upstream import Outcome, UpstreamCaller
from service.workers.client import SGLangClient
from service.workers.pool import WorkerPool
from tenancy.errors import StoreUnavailable, TenantNotFoundError
from tenancy.models import Tenant
from tenancy.quota import QuotaLimiter, Reservation
from tenancy.usage import UsageRecorder

log = structlog.get_logger("radixgate.request")


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


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
        self._preparer = RequestPreparer(
            settings, renderer, lambda: client.token_limits([w.url for w in pool.workers])
        )
        self._upstream = UpstreamCaller(settings, pool, scheduler, client, metrics, renderer)
        self._scheduler = scheduler
        self._quota = quota
        self._usage = usage
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
            RateLimited: a bucket is short (``retry_after_s`` says when it refills enough).
            RequestTooLarge: the request is larger than a bucket's burst and can never pass.
            Unauthenticated: the tenant was deleted since its key was checked.
            StoreUnavailable: Redis is exhausted, slow or unreachable (a reservation a timed-out call
                may still have taken refills with time).
        """
        tenant = prepared.tenant
        tokens = prepared.reserved_tokens
        try:
            decision = await self._quota.reserve(tenant.id, tenant.quotas, tokens, epoch=tenant.epoch)
        except TenantNotFoundError as exc:  # deleted since its key was checked
            raise Unauthenticated("Incorrect API key provided.") from exc
        if decision.allowed:
            return Reservation(tenant.id, tenant.quotas, 1, tokens, tenant.epoch)
        self._metrics.quota_rejections.labels(self._metrics.tenant(tenant.id), decision.limiting).inc()
        try:  # bookkeeping only: the 429 stands without it
            await self._usage.record(tenant.id, tenant.epoch, quota_rejections=1)
        except StoreUnavailable:
            log.warning("usage_record_failed", request_id=prepared.rid, tenant=tenant.id)
        if decision.never:
            burst = (
                tenant.quotas.effective_token_burst
                if decision.limiting == "tokens"
                else tenant.quotas.effective_request_burst
            )
            raise RequestTooLarge(
                f"This request needs {tokens} tokens (prompt {prepared.prompt.num_tokens} + max_tokens "
                f"{prepared.max_tokens}) but the tenant's {decision.limiting} burst is {burst:g}; it can "
                "never be admitted. Lower max_tokens or shorten the prompt.",
                code="request_exceeds_burst",
                param="max_tokens",
            )
        retry_after = max(1, math.ceil(decision.retry_after_s))
        per = "requests per minute" if decision.limiting == "requests" else "tokens per minute"
        raise RateLimited(
            f"Rate limit reached for tenant '{tenant.id}' on {per}. Retry after {retry_after} s.",
            retry_after_s=retry_after,
        )

    # 3. upstream -----------------------------------------------------------------------------------
    async def complete(self, prepared: PreparedRequest, reservation: Reservation) -> dict[str, Any]:
        """Serve a non-streamed request; returns the OpenAI response object.

        Raises:
            GatewayError: shed or timed out in the queue, attempts spent, or the worker rejected the input.
        """
        outcome = Outcome()
        self._metrics.in_flight.inc()
        try:
            chunk = await self._upstream.generate(prepared, outcome)
            outcome.ttft_s = time.perf_counter() - prepared.arrival
            usage = UsageInfo.of(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens)
            make = chat_response if prepared.chat else text_response
            return make(prepared.rid, prepared.model, chunk.text, chunk.finish_reason, usage)
        except GatewayError as err:
            outcome.status, outcome.error_code = http_status(err), outcome.error_code or err.code
            raise
        except asyncio.CancelledError:
            outcome.status = 499
            raise
        finally:
            await self._finish(prepared, reservation, outcome)

    async def stream(
        self, prepared: PreparedRequest, reservation: Reservation
    ) -> AsyncGenerator[bytes, None]:
        """Serve a streamed request as OpenAI SSE chunks, ending with ``data: [DONE]``.

        Errors before the first token are retried on another worker and, once the attempts are spent,
        raised as a :class:`GatewayError` before anything is yielded (the route answers with that status). A
        stream that breaks later is resumed on another worker; if that fails too the stream ends with an
        OpenAI error event. Cancellation aborts the upstream request and refunds the unused tokens.
        """
        outcome = Outcome()
        created = now_s()
        self._metrics.in_flight.inc()
        try:
            async for chunk in self._upstream.stream(prepared, outcome):
                if outcome.ttft_s is None:
                    outcome.ttft_s = time.perf_counter() - prepared.arrival
                    if prepared.chat:
                        role = {"role": "assistant", "content": ""}
                        yield _sse(chat_chunk(prepared.rid, prepared.model, created, role, None))
                if chunk.text or chunk.finish_reason:
                    if prepared.chat:
                        delta = {"content": chunk.text} if chunk.text else {}
                        event = chat_chunk(prepared.rid, prepared.model, created, delta, chunk.finish_reason)
                    else:
                        event = text_chunk(
                            prepared.rid, prepared.model, created, chunk.text, chunk.finish_reason
                        )
                    yield _sse(event)
            if prepared.include_usage:
                usage = UsageInfo.of(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens)
                yield _sse(usage_chunk(prepared.rid, prepared.model, created, prepared.chat, usage))
            yield b"data: [DONE]\n\n"
        except GatewayError as err:
            outcome.status, outcome.error_code = http_status(err), outcome.error_code or err.code
            if not outcome.streamed_any:
                raise  # nothing sent yet: the route answers with a real HTTP status
            yield sse_error_event(err)
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            outcome.status = 499
            raise
        finally:
            await self._finish(prepared, reservation, outcome)

    async def _finish(self, prepared: PreparedRequest, reservation: Reservation, outcome: Outcome) -> None:
        """Release the queue slot, abort an unfinished upstream request, settle. Shielded from cancel."""
        self._metrics.in_flight.dec()
        slot = outcome.slot
        if slot is not None:
            served_here = (outcome.finished or outcome.streamed_any) and outcome.worker == slot.worker
            cached = outcome.cached_tokens if served_here and not outcome.resumes else None
            self._scheduler.release(
                slot, ok=served_here, prompt_tokens=outcome.prompt_tokens, cached_tokens=cached
            )
        with anyio.CancelScope(shield=True):
            if not outcome.finished and outcome.worker is not None and outcome.status != 200:
                await self._client.abort(outcome.worker, outcome.upstream_rid or prepared.rid)
            await self._settle(prepared, reservation, outcome)

    # 4. settle -------------------------------------------------------------------------------------
    async def _settle(self, prepared: PreparedRequest, reservation: Reservation, outcome: Outcome) -> None:
        """Reconcile quota, record usage and metrics, and log one line. Never raises."""
        tenant_id = prepared.tenant.id
        served = outcome.finished or outcome.streamed_any
        try:
            if served:
                if not outcome.prompt_tokens:
                    outcome.prompt_tokens = prepared.prompt.num_tokens
                usage = {
                    "requests": 1,
                    "errors": int(outcome.status != 200),
                    "prompt_tokens": outcome.prompt_tokens,
                    "completion_tokens": outcome.completion_tokens,
                    "cached_tokens": outcome.cached_tokens,
                }
                used: int | None = outcome.prompt_tokens + outcome.completion_tokens
            else:
                usage, used = {"errors": int(outcome.status not in (200, 499))}, None  # refund it all
            await self._quota.settle(reservation, used, usage)  # one round trip: buckets and usage
        except Exception:  # Redis unavailable (or worse) after the answer: keep the answer, count it
            self._metrics.settle_failures.inc()
            log.exception("settle_failed", request_id=prepared.rid, tenant=tenant_id)
        latency = time.perf_counter() - prepared.arrival
        m = self._metrics.request_series(self._metrics.tenant(tenant_id), prepared.model, outcome.status)
        m.requests.inc()
        m.e2e.observe(latency)
        if outcome.ttft_s is not None:
            m.ttft.observe(outcome.ttft_s)
        if served:
            m.prompt_tokens.inc(outcome.prompt_tokens)
            m.completion_tokens.inc(outcome.completion_tokens)
            m.cached_tokens.inc(outcome.cached_tokens)
        log.info(
            "request",
            request_id=prepared.rid,
            tenant=tenant_id,
            model=prepared.model,
            priority_class=prepared.priority_class,
            stream=prepared.stream,
            worker=outcome.worker,
            attempts=outcome.attempts,
            resumes=outcome.resumes,
            resume_mode=outcome.resume_mode,
            status=outcome.status,
            error=outcome.error_code,
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            cached_tokens=outcome.cached_tokens,
            reserved_tokens=reservation.tokens,
            ttft_ms=None if outcome.ttft_s is None else round(outcome.ttft_s * 1000, 1),
            latency_ms=round(latency * 1000, 1),
        )
