"""Calling workers for one request: queue slot, retries before the first token, mid-stream failover.

- The first attempt waits for a slot in the scheduler's queue (which routes it).
- Before the first token, a connect error, 5xx or timeout is retried on another eligible worker, at
  most ``max_attempts`` attempts in all, after a "full jitter" exponential backoff (AWS Architecture
  Blog, "Exponential Backoff and Jitter", 2015). The client sees one response.
- After the first token, a broken stream is resumed on another worker: the new request's prompt is the
  original prompt followed by what was already generated, ``max_new_tokens`` reduced by the tokens
  already produced. When the worker streams ``output_ids`` (the client turns them into per-chunk deltas
  whatever the worker's streaming mode) and the gateway's tokenization of the prompt matches the
  worker's prompt-token count, the resume is exact at the token level (``input_ids`` = prompt ids +
  generated ids); otherwise it resumes on the text. With greedy sampling the client's text
  equals an uninterrupted run's. Usage counts each token once.
- A worker that leaves (drained) and still runs the request at its drain deadline
  (``upstream.worker_drain_deadline_s``, :mod:`service.workers.drain_deadline`) has the call cut
  (``UpstreamError.moved``): a stream resumes on another worker as above, a non-streamed request starts
  again there. A move is neither a failure of the worker nor one of the request's attempts or resumes
  (``max_attempts`` bounds failures only), and goes on without a backoff.
- Every outcome feeds the worker's circuit breaker: a success, a refused connection (definitive) and a
  transport failure (timeout, reset) at once; an HTTP 5xx only once a deep probe confirmed the worker is
  at fault (:meth:`service.workers.pool.WorkerPool.suspect`); a 4xx never (the input's fault: the tenant
  gets a short, sanitized reason, :mod:`service.pipeline.rejection`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from service.config.settings import Settings
from service.errors import GatewayError, NoWorkerAvailable, UpstreamFailed
from service.observability.breakdown import RequestTiming
from service.observability.metrics import GatewayMetrics
from service.pipeline.prepare import PreparedRequest
from service.pipeline.prompting import PromptRenderer
from service.pipeline.rejection import tenant_rejection
from service.pipeline.scheduler import Scheduler, SchedulingRequest, Slot
from service.runtime.task_stop import finish_despite_cancel
from service.workers.chunks import UpstreamChunk
from service.workers.client import SGLangClient, UpstreamError
from service.workers.pool import WorkerPool


@dataclass(slots=True)
class Outcome:
    """What happened to a request, filled in as it runs and settled once."""

    status: int = 200
    worker: str | None = None
    attempts: int = 0
    resumes: int = 0
    moves: int = 0  # attempts cut at a draining worker's deadline (continued elsewhere; not failures)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    error_code: str | None = None
    streamed_any: bool = False
    finished: bool = False
    slot: Slot | None = None
    upstream_rid: str | None = None  # SGLang rid of the attempt running now (resumes get a suffix)
    resume_mode: str | None = None  # "token_ids" (exact) or "text", once a stream was resumed
    dispatched: bool = False  # an attempt was sent to a worker and has not failed (it may be computing)
    aborted: bool = False  # the gateway already asked the worker to abort it
    revoked: bool = False  # its API key or tenant was revoked while it ran (service.pipeline.revocation)
    shed_reason: str | None = None  # shed by admission control: the core's reason (policies.admission_types)
    shed_predicted_ttft_s: float | None = None  # ... and the predicted TTFT that refused (or expired) it
    expired_after_s: float | None = None  # left the gateway's queue unserved (queue_timeout) after this long
    timing: RequestTiming | None = None  # the request's phases, kept by its first choice (breakdown)


@dataclass(slots=True)
class _Progress:
    """What one streamed request has produced so far, across resumes."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    ids_known: bool = True
    completion_base: int = 0


class UpstreamCaller:
    """Runs the attempts of one request against the workers.

    Args:
        settings: app settings (upstream section).
        pool: workers and their breakers.
        scheduler: the queue that hands out the first worker.
        client: SGLang HTTP client.
        metrics: the app's metrics.
        renderer: the tokenizer, for exact token-level resume.
    """

    def __init__(
        self,
        settings: Settings,
        pool: WorkerPool,
        scheduler: Scheduler,
        client: SGLangClient,
        metrics: GatewayMetrics,
        renderer: PromptRenderer,
    ) -> None:
        self._up = settings.upstream
        self._pool = pool
        self._scheduler = scheduler
        self._client = client
        self._metrics = metrics
        self._renderer = renderer

    # -- attempts ------------------------------------------------------------------------------------
    async def acquire(self, prepared: PreparedRequest) -> Slot:
        """Wait in the scheduler's queue for the request's slot; it is held for prompt +
        n x max_tokens (what the quota reservation holds; n > 1 choices share it) and takes n of the
        worker's window (the engine runs the n choices at once)."""
        tenant = prepared.tenant
        return await self._scheduler.acquire(
            SchedulingRequest(
                prepared.rid,
                tenant.id,
                tenant.weight,
                prepared.priority_class,
                prepared.prompt.text,
                prepared.prompt.num_tokens,
                prepared.n * prepared.max_tokens,
                prepared.arrival,
                prepared.session_id,
                prepared.stream or prepared.n > 1,  # n > 1 choices stream from the worker either way
                prepared.n,
            ),
            prepared.timing,
        )

    async def _next_worker(
        self,
        prepared: PreparedRequest,
        outcome: Outcome,
        tried: set[str],
        last_error: GatewayError | None,
        backoff: bool = True,
    ) -> str:
        """The worker of the next attempt: the scheduler's slot first, then another worker for a retry
        (after a jittered backoff unless ``backoff`` is False: a move off a draining worker). An outcome
        that comes with a slot (a choice of an n > 1 request) starts on the slot's worker."""
        if outcome.slot is None:
            outcome.slot = await self.acquire(prepared)
            worker: str | None = outcome.slot.worker
        elif outcome.attempts == 0 and not outcome.slot.released:
            worker = outcome.slot.worker
        else:
            if backoff:
                wait_s = self._up.retry_backoff_s * 2 ** max(0, outcome.attempts - outcome.moves - 1)
                await asyncio.sleep(random.uniform(0, wait_s))
            worker = None if outcome.slot.released else self._scheduler.reroute(outcome.slot, tried)
            if worker is None:
                if last_error is not None:
                    raise last_error
                raise NoWorkerAvailable(
                    "No healthy worker is available; retry shortly.", retry_after_s=self._pool.retry_after_s()
                )
        assert worker is not None
        tried.add(worker)
        outcome.worker, outcome.attempts = worker, outcome.attempts + 1
        if outcome.timing is not None:
            outcome.timing.attempt(time.perf_counter())
        return worker

    def _failed(self, exc: UpstreamError, outcome: Outcome, prepared: PreparedRequest) -> GatewayError:
        """Record a failed attempt (metrics, breaker evidence) and the error the client would get; an
        attempt moved off a draining worker is no failure (counted as a ``worker_drained`` retry)."""
        if exc.moved:
            outcome.moves += 1
            self._metrics.retries.labels("worker_drained").inc()
            return NoWorkerAvailable(
                "The worker serving this request left and no other worker could take it; retry shortly.",
                retry_after_s=self._pool.retry_after_s(),
            )
        kind = "pool_exhausted" if exc.local else "transport" if exc.status is None else f"http_{exc.status}"
        self._metrics.upstream_errors.labels(exc.worker, kind).inc()
        if exc.local:  # the gateway's connection pool to workers stayed full: no worker is to blame
            outcome.error_code = "upstream_pool_exhausted"
            return UpstreamFailed(
                "The gateway has no free connection to the workers; retry shortly.",
                transport=True,
                code="upstream_pool_exhausted",
            )
        if exc.rejected:  # the input's fault: no evidence against the worker
            outcome.error_code = "upstream_rejected"
            return tenant_rejection(exc, prepared.body, prepared.rid)
        if exc.refused:
            self._pool.record(exc.worker, "refused")
        elif exc.status is None or exc.status < 500:  # no answer, or a worker's own 4xx (WORKER_FAULT_4XX)
            self._pool.record(exc.worker, "request_failed")
        else:  # a 5xx may be this request's own fault: a deep probe decides (shared, in the background)
            self._pool.suspect(exc.worker)
        outcome.error_code = "upstream_unavailable"
        return UpstreamFailed("The upstream worker failed; retry shortly.", transport=exc.status is None)

    def _may_retry(self, exc: UpstreamError, outcome: Outcome) -> bool:
        return exc.moved or (exc.retryable and outcome.attempts - outcome.moves < self._up.max_attempts)

    @staticmethod
    def _count(outcome: Outcome, chunk: UpstreamChunk, base: int) -> None:
        if outcome.resumes == 0:
            outcome.prompt_tokens = chunk.prompt_tokens or outcome.prompt_tokens
            outcome.cached_tokens = max(outcome.cached_tokens, chunk.cached_tokens)
        outcome.completion_tokens = max(outcome.completion_tokens, base + chunk.completion_tokens)

    # -- non-streamed --------------------------------------------------------------------------------
    async def generate(self, prepared: PreparedRequest, outcome: Outcome) -> UpstreamChunk:
        """One whole answer, retried on other workers on failure.

        Raises:
            UpstreamRejected: the worker rejected the input.
            UpstreamFailed: the attempts are spent.
            Overloaded, QueueTimeout, NoWorkerAvailable: from the scheduler.
        """
        tried: set[str] = set()
        last_error: GatewayError | None = None
        moved = False
        while True:
            worker = await self._next_worker(prepared, outcome, tried, last_error, backoff=not moved)
            outcome.dispatched = True
            call = asyncio.ensure_future(self._client.generate(worker, prepared.body))
            try:
                chunk = await asyncio.shield(call)  # the client leaving does not cut the worker call
            except asyncio.CancelledError:
                await finish_despite_cancel(self._abandon(worker, prepared, outcome, call))
                raise
            except UpstreamError as exc:
                outcome.dispatched = False
                last_error = self._failed(exc, outcome, prepared)
                if not self._may_retry(exc, outcome):
                    raise last_error from exc
                moved = exc.moved
                if moved:  # SGLang notices a non-streamed call's closed connection only every few seconds
                    await self._client.abort(worker, outcome.upstream_rid or prepared.rid)
                else:
                    self._metrics.retries.labels("before_first_token").inc()
                continue
            self._pool.record(worker, "request_ok")
            self._count(outcome, chunk, 0)
            if outcome.timing is not None:
                outcome.timing.answered(time.perf_counter(), chunk.meta)
            outcome.finished = True
            return chunk

    async def _abandon(
        self, worker: str, prepared: PreparedRequest, outcome: Outcome, call: asyncio.Future[UpstreamChunk]
    ) -> None:
        """The client left while ``worker`` computes a non-streamed answer: abort it there and read what it
        computed from its answer to the abort (SGLang 0.5.23 answers a running request aborted through
        ``/abort_request`` with its text and counts so far, ``finish_reason.type`` ``"abort"``; one still
        waiting in its queue with no counts). Waits at most ``upstream.abort_grace_s``; counts nothing
        when no answer comes (the caller then charges the reservation's prompt part)."""
        outcome.aborted = True
        await self._client.abort(worker, outcome.upstream_rid or prepared.rid)
        chunk: UpstreamChunk | None = None
        try:
            chunk = await asyncio.wait_for(call, self._up.abort_grace_s)
        except UpstreamError as exc:
            chunk = exc.partial
        except Exception:  # no answer within the grace (TimeoutError), or none readable: count unknown
            pass
        finally:
            if not call.done():
                call.cancel()
                with contextlib.suppress(BaseException):
                    await call
        if chunk is not None:
            self._count(outcome, chunk, 0)

    # -- streamed ------------------------------------------------------------------------------------
    async def stream(self, prepared: PreparedRequest, outcome: Outcome) -> AsyncIterator[UpstreamChunk]:
        """Text deltas of the answer, continued on another worker if a stream breaks.

        ``outcome.completion_tokens`` counts across resumes. Raises a :class:`GatewayError` when the
        attempts are spent (before the first chunk the caller answers with its status; after it, an error
        event).
        """
        tried: set[str] = set()
        last_error: GatewayError | None = None
        progress = _Progress()
        body = prepared.body
        timing = outcome.timing
        on_headers = timing.headers if timing is not None else None
        moved = False
        broken = 0  # resumes after a broken stream (moves off a draining worker are not counted)
        while True:
            worker = await self._next_worker(prepared, outcome, tried, last_error, backoff=not moved)
            first = True
            outcome.dispatched = True
            try:
                async for chunk in self._client.stream(worker, body, on_headers):
                    if timing is not None:
                        now = time.perf_counter()
                        if timing.first_token_at is None:
                            timing.first_chunk(now, chunk.meta)
                        else:
                            timing.token(now)
                        if chunk.finish_reason:
                            timing.stream_ended(now, chunk.meta)
                    if first and outcome.slot is not None:  # teaches the scheduler this worker's TTFT
                        first = False
                        self._scheduler.first_token(
                            outcome.slot, chunk.cached_tokens if not outcome.resumes else None
                        )
                    self._count(outcome, chunk, progress.completion_base)
                    progress.text += chunk.text
                    if chunk.output_ids is None:
                        progress.ids_known = False
                    elif progress.ids_known:
                        progress.output_ids.extend(chunk.output_ids)
                    outcome.streamed_any = True
                    if chunk.finish_reason:
                        outcome.finished = True
                    yield chunk
                self._pool.record(worker, "request_ok")
                return
            except UpstreamError as exc:
                outcome.dispatched = False
                last_error = self._failed(exc, outcome, prepared)
                moved = exc.moved
                if not self._may_retry(exc, outcome) and not outcome.streamed_any:
                    raise last_error from exc
                if outcome.streamed_any:
                    if not moved and (
                        broken >= self._up.max_attempts or exc.rejected
                    ):  # the input: it fails anywhere
                        raise last_error from exc
                    remaining = prepared.max_tokens - outcome.completion_tokens
                    if remaining <= 0:
                        outcome.finished = True
                        yield UpstreamChunk("", outcome.prompt_tokens, 0, 0, "length")
                        return
                    body = self._resume_body(prepared, outcome, progress, remaining)
                    outcome.resumes += 1
                    progress.completion_base = outcome.completion_tokens
                    tried = {worker}  # any other eligible worker may take the continuation
                    if not moved:
                        broken += 1
                        self._metrics.retries.labels("mid_stream").inc()
                elif not moved:
                    self._metrics.retries.labels("before_first_token").inc()

    def _resume_body(
        self, prepared: PreparedRequest, outcome: Outcome, progress: _Progress, remaining: int
    ) -> dict[str, Any]:
        """The ``/generate`` body that continues a broken stream."""
        sampling = {**prepared.body["sampling_params"], "max_new_tokens": remaining}
        body = {k: v for k, v in prepared.body.items() if k not in ("text", "input_ids", "sampling_params")}
        body["sampling_params"] = sampling
        body["rid"] = outcome.upstream_rid = f"{prepared.rid}-r{outcome.resumes + 1}"
        prompt_ids = self._renderer.encode(prepared.prompt.text)
        exact = (
            progress.ids_known
            and len(progress.output_ids) == outcome.completion_tokens
            and len(prompt_ids) == outcome.prompt_tokens
        )
        if exact:
            body["input_ids"] = prompt_ids + progress.output_ids
        else:
            body["text"] = prepared.prompt.text + progress.text
        outcome.resume_mode = "token_ids" if exact else "text"
        return body


__all__ = ["Outcome", "UpstreamCaller"]
