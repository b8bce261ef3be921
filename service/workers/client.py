"""HTTP client for SGLang's native ``/generate`` API (stream and non-stream), ``/abort_request`` and health.

Request body (SGLang ``GenerateReqInput``): ``{"text", "sampling_params": {...}, "stream", "rid",
"priority"}``. Each response (or SSE chunk ``data: {...}``, ended by ``data: [DONE]``) carries ``text``,
``output_ids`` and ``meta_info`` with ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` and
``finish_reason``.

What a worker can take and how it streams is learned from the worker itself (``GET /server_info``, see
:class:`service.workers.worker_info.WorkerInfo`), once per worker and again after it was seen down (a restart
may change its flags).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import structlog

from service.config.settings import UpstreamSettings
from service.protocol.compact_json import compact_json
from service.workers.answers import StreamDeltas, batch_chunks, chunk_of, joined, worker_logprobs
from service.workers.chunks import UpstreamChunk
from service.workers.native_transport import NativeWorkerHTTP
from service.workers.stall_watch import CallMoved, StallWatch, StreamStalled
from service.workers.transport import TransportFailure, WorkerHTTP
from service.workers.upstream_errors import (
    MALFORMED_ANSWER,
    abort_error,
    http_error,
    json_or_none,
    malformed_error,
)
from service.workers.upstream_errors import UpstreamError as UpstreamError  # re-exported
from service.workers.worker_info import TokenLimits, WorkerInfo, WorkerLoad, parse_load

log = structlog.get_logger("radixgate.client")

ProbeResult = Literal["ok", "failed", "refused", "unknown"]
"""Outcome of one health probe ("unknown": the gateway's own connection pool was full; no evidence)."""


@dataclass(frozen=True, slots=True)
class ProbeReport:
    """One health probe: its :data:`ProbeResult` and what was seen, for the logs and ``/admin/workers``
    (e.g. ``"GET /health 200"``, ``"connection refused"``, ``"GET /health 404: not an SGLang server?"``)."""

    result: ProbeResult
    reason: str


class SGLangClient:
    """Talks to SGLang workers over the replica's pooled keep-alive connections
    (:class:`service.workers.transport.WorkerHTTP`).

    Args:
        settings: the upstream settings (pool size, keep-alive, timeouts); defaults when None.
    """

    def __init__(self, settings: UpstreamSettings | None = None) -> None:
        settings = settings or UpstreamSettings()
        native = settings.http_client == "httptools"
        self._http = NativeWorkerHTTP(settings) if native else WorkerHTTP(settings)
        self._idle_s = settings.stream_idle_timeout_s
        self._info: dict[str, WorkerInfo] = {}
        self._calls: dict[str, set[StallWatch]] = {}  # worker -> the watches of its /generate calls

    async def aclose(self) -> None:
        """Close every pooled connection."""
        await self._http.aclose()

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- what each worker is -------------------------------------------------------------------------
    def known_info(self, worker: str) -> WorkerInfo | None:
        """The cached :class:`WorkerInfo` of ``worker``; None until it was learned."""
        return self._info.get(worker)

    def forget(self, worker: str) -> None:
        """Drop what was learned about ``worker`` (it went down; it may come back with other flags)."""
        self._info.pop(worker, None)

    async def learn(self, worker: str, timeout_s: float = 5.0) -> WorkerInfo | None:
        """Read ``/server_info`` (``/get_server_info`` on older SGLang), and ``/v1/models`` when it names no
        model, and cache it.

        A worker without either route (404) is cached as reporting nothing; a transport error caches
        nothing and returns None (try again on the next contact).
        """
        for path in ("/server_info", "/get_server_info"):
            try:
                status, raw = await self._http.call("GET", worker, path, timeout_s=timeout_s)
            except TransportFailure:
                return None
            if status == 200:
                info = WorkerInfo.parse(json_or_none(raw))
                break
            if status != 404:
                return None
        else:
            info = WorkerInfo()
        if info.model is None:  # it names no model there: its OpenAI listing may
            try:
                status, raw = await self._http.call("GET", worker, "/v1/models", timeout_s=timeout_s)
            except TransportFailure:
                return None
            if status == 200:
                info = info.with_listed_model(json_or_none(raw))
        if self._info.get(worker) != info:
            log.info(
                "worker_info",
                worker=worker,
                incremental_streaming=info.incremental_streaming,
                max_prompt_tokens=info.limits.max_prompt_tokens if info.limits else None,
                max_total_tokens=info.limits.max_total_tokens if info.limits else None,
                max_running=info.max_running,
                model=info.model,
                context_length=info.context_length,
            )
        self._info[worker] = info
        return info

    def token_limits(self, workers: list[str]) -> TokenLimits | None:
        """The tightest limits over those of ``workers`` that reported theirs; None when none did."""
        limits: TokenLimits | None = None
        for worker in workers:
            info = self._info.get(worker)
            if info is not None and info.limits is not None:
                limits = info.limits.tightest(limits)
        return limits

    def context_lengths(self, workers: list[str]) -> list[int]:
        """The context lengths those of ``workers`` that reported one report, tokens."""
        found = [self._info.get(w) for w in workers]
        return [i.context_length for i in found if i is not None and i.context_length is not None]

    # -- calls in flight ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _watched(self, worker: str) -> Iterator[StallWatch]:
        """A :class:`StallWatch` for one ``/generate`` call to ``worker``, listed for :meth:`move_off`
        while the block runs."""
        with StallWatch(self._idle_s) as watch:
            calls = self._calls.setdefault(worker, set())
            calls.add(watch)
            try:
                yield watch
            finally:
                calls.discard(watch)
                if not calls:
                    self._calls.pop(worker, None)

    def calls_on(self, worker: str) -> int:
        """``/generate`` calls to ``worker`` in flight now (streams and non-streamed)."""
        return len(self._calls.get(worker, ()))

    def move_off(self, worker: str) -> int:
        """Cut every ``/generate`` call to ``worker`` in flight now (its drain deadline passed): each fails
        with an :class:`UpstreamError` whose ``moved`` is set, which the caller continues on another worker
        (:class:`service.pipeline.upstream.UpstreamCaller`); a stream whose last token came already ends as
        it is. Closing the call's connection has the worker abort the request (SGLang aborts a request whose
        client disconnected). Returns how many calls were cut."""
        return sum(watch.cut() for watch in list(self._calls.get(worker, ())))

    async def generate(self, worker: str, body: dict[str, Any]) -> UpstreamChunk:
        """Non-streamed ``/generate``. Raises :class:`UpstreamError` (``moved`` when :meth:`move_off` cut
        it)."""
        try:
            with self._watched(worker) as watch:
                status, raw = await watch.read(
                    self._http.call("POST", worker, "/generate", compact_json({**body, "stream": False}))
                )
        except TransportFailure as exc:
            raise self._transport_error(worker, exc) from exc
        except CallMoved as exc:
            raise UpstreamError(worker, str(exc), moved=True) from exc
        if status != 200:
            raise http_error(worker, status, raw)
        try:
            payload = orjson.loads(raw)
            ids = payload.get("output_ids")
            meta = payload.get("meta_info") or {}
            text = str(payload.get("text", ""))
            output_ids = tuple(ids) if isinstance(ids, list) else None
            chunk = chunk_of(payload, text, output_ids, worker_logprobs(meta))
        except MALFORMED_ANSWER as exc:
            raise malformed_error(worker, exc) from exc
        if chunk.finish_reason == "abort":
            raise abort_error(worker, meta, chunk)
        return chunk

    async def stream(
        self, worker: str, body: dict[str, Any], on_headers: Callable[[float], None] | None = None
    ) -> AsyncIterator[UpstreamChunk]:
        """Streamed ``/generate``: yields deltas (see :class:`service.workers.answers.StreamDeltas`). Raises
        :class:`UpstreamError`
        (also mid-stream, and after ``stream_idle_timeout_s`` of silence once a token came: a
        :class:`~service.workers.stall_watch.StallWatch`). The response is read past ``data: [DONE]`` to
        its end, so its connection is reused.

        Chunks without text that open the stream are held and joined to the first chunk with text or a
        finish (:func:`joined`): SGLang 0.5.23 streams the first token of a grammar that admits none
        (an empty text) before it aborts the request with "Grammar accept_token failed", and an answer
        must not start (a 200, a charge) on a token the worker then takes back; that abort now comes
        before anything is yielded (a 400 with nothing charged, :mod:`service.workers.upstream_errors`).

        ``on_headers`` is called with ``time.perf_counter()`` when the answer's status line and headers
        have been read (the request's ``upstream_connect`` phase ends there).

        :meth:`move_off` cuts it (its worker's drain deadline): :class:`UpstreamError` with ``moved``."""
        info = self._info.get(worker) or await self.learn(worker)
        deltas = StreamDeltas(info.incremental_streaming if info else None)
        done = finished = False
        opening = True
        held: UpstreamChunk | None = None
        try:
            with self._watched(worker) as watch:
                async with await watch.read(
                    self._http.stream(worker, "/generate", compact_json({**body, "stream": True}))
                ) as resp:
                    if on_headers is not None:
                        on_headers(time.perf_counter())
                    if resp.status != 200:
                        raise http_error(worker, resp.status, await resp.body())
                    batches = resp.line_batches()
                    while (batch := await watch.read(anext(batches, None))) is not None:
                        if done:
                            continue
                        chunks, failure, done = batch_chunks(worker, batch, deltas)
                        if chunks:
                            watch.arm()  # a token came: from now on silence means a stuck engine
                        for each in chunks:
                            chunk = each if held is None else joined(held, each)
                            held = None
                            if opening and not chunk.text and chunk.finish_reason is None:
                                held = chunk  # see the docstring: a grammar's token SGLang takes back
                                continue
                            opening = False
                            finished = finished or chunk.finish_reason is not None
                            yield chunk
                        if failure is not None:
                            raise failure
        except TransportFailure as exc:
            if not done:  # after [DONE] the answer is whole: a failure while draining costs the connection
                raise self._transport_error(worker, exc) from exc
        except StreamStalled as exc:
            if not done:
                raise UpstreamError(worker, str(exc)) from exc
        except CallMoved as exc:
            if not finished:  # a stream whose last token was out is whole: it ends as it is
                raise UpstreamError(worker, str(exc), moved=True) from exc
        if not finished:
            raise UpstreamError(worker, "stream ended before the answer finished")

    async def abort(self, worker: str, rid: str) -> bool:
        """Ask a worker to abort request ``rid`` (SGLang ``/abort_request``). Never raises."""
        try:
            status, _ = await self._http.call(
                "POST", worker, "/abort_request", orjson.dumps({"rid": rid}), timeout_s=2.0
            )
        except TransportFailure:
            return False
        return status == 200

    async def load(self, worker: str, timeout_s: float = 2.0) -> WorkerLoad | None:
        """The worker's reported load from ``GET /metrics``; None if it cannot be read."""
        try:
            status, raw = await self._http.call("GET", worker, "/metrics", timeout_s=timeout_s)
        except TransportFailure:
            return None
        if status != 200:
            return None
        try:
            return parse_load(raw.decode(errors="replace"))
        except ValueError:
            return None

    async def probe(self, worker: str, timeout_s: float = 2.0, deep: bool = False) -> ProbeResult:
        """:meth:`check`'s result alone."""
        return (await self.check(worker, timeout_s, deep)).result

    async def check(self, worker: str, timeout_s: float = 2.0, deep: bool = False) -> ProbeReport:
        """``GET /health`` (or, when ``deep``, ``/health_generate``, which runs a 1-token generation on an
        idle worker): ``"ok"`` for 200 within ``timeout_s``, ``"refused"`` when the connection could
        not be opened, ``"unknown"`` when no pooled connection was free, ``"failed"`` otherwise (other
        status, timeout, reset); with what was seen (:class:`ProbeReport`).

        A worker that answers for the first time (or again after a failed probe) has its
        :class:`WorkerInfo` learned; one that does not answer has it forgotten."""
        path = "/health_generate" if deep else "/health"
        try:
            status, _ = await self._http.call("GET", worker, path, timeout_s=timeout_s)
        except TransportFailure as exc:
            if exc.refused:
                text = str(exc)
                refused = "refused" in text.lower()
                return ProbeReport("refused", "connection refused" if refused else f"cannot connect: {text}")
            if exc.local:
                return ProbeReport("unknown", "no free connection in the gateway's own pool")
            self.forget(worker)
            return ProbeReport("failed", f"GET {path} failed: {exc}")
        if status != 200:
            self.forget(worker)
            hint = ": not an SGLang server?" if status == 404 else ""
            return ProbeReport("failed", f"GET {path} {status}{hint}")
        if worker not in self._info:
            await self.learn(worker, timeout_s)
        return ProbeReport("ok", f"GET {path} 200")

    def _transport_error(self, worker: str, exc: TransportFailure) -> UpstreamError:
        if exc.local:  # no free connection in our own pool: not the worker's fault
            return UpstreamError(worker, str(exc), retryable=False, local=True)
        if exc.refused:
            self.forget(worker)
        return UpstreamError(worker, str(exc), refused=exc.refused)
