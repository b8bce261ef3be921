"""HTTP client for SGLang's native ``/generate`` API (stream and non-stream), ``/abort_request`` and health.

Request body (SGLang ``GenerateReqInput``): ``{"text", "sampling_params": {...}, "stream", "rid",
"priority"}``. Each response (or SSE chunk ``data: {...}``, ended by ``data: [DONE]``) carries ``text``,
``output_ids`` and ``meta_info`` with ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` and
``finish_reason``.

What a worker can take and how it streams is learned from the worker itself (``GET /server_info``, see
:class:`WorkerInfo`), once per worker and again after it was seen down (a restart may change its flags).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import orjson
import structlog
from prometheus_client.parser import text_string_to_metric_families

from service.config.settings import UpstreamSettings
from service.protocol.compact_json import compact_json
from service.workers.chunks import UpstreamChunk, WorkerLogprob
from service.workers.native_transport import NativeWorkerHTTP
from service.workers.stall_watch import StallWatch, StreamStalled
from service.workers.transport import TransportFailure, WorkerHTTP
from service.workers.upstream_errors import (
    MALFORMED_ANSWER,
    abort_error,
    http_error,
    json_or_none,
    malformed_error,
    stream_error,
)
from service.workers.upstream_errors import UpstreamError as UpstreamError  # re-exported

log = structlog.get_logger("radixgate.client")

ProbeResult = Literal["ok", "failed", "refused", "unknown"]
"""Outcome of one health probe ("unknown": the gateway's own connection pool was full; no evidence)."""


@dataclass(frozen=True, slots=True)
class ProbeReport:
    """One health probe: its :data:`ProbeResult` and what was seen, for the logs and ``/admin/workers``
    (e.g. ``"GET /health 200"``, ``"connection refused"``, ``"GET /health 404: not an SGLang server?"``)."""

    result: ProbeResult
    reason: str


def worker_logprobs(meta: dict[str, Any]) -> tuple[WorkerLogprob, ...] | None:
    """``meta_info.output_token_logprobs`` (``[logprob, id, text]`` per token) joined with
    ``output_top_logprobs`` (a list of ``[logprob, id, text]`` per token, or None) as
    :data:`WorkerLogprob`; None when the worker sent none. A missing logprob (None) reads as -inf."""
    chosen = meta.get("output_token_logprobs")
    if not isinstance(chosen, list):
        return None
    tops = meta.get("output_top_logprobs")
    tops = tops if isinstance(tops, list) else []
    out = []
    for i, entry in enumerate(chosen):
        alternatives = tops[i] if i < len(tops) and isinstance(tops[i], list) else []
        top = tuple((_logprob(a[0]), int(a[1])) for a in alternatives if isinstance(a, list) and len(a) >= 2)
        out.append((_logprob(entry[0]), int(entry[1]), top))
    return tuple(out)


def _logprob(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else float("-inf")


def finish_reason_of(meta: dict[str, Any]) -> str | None:
    """Map SGLang's ``meta_info.finish_reason`` (``{"type": ...}`` or a string) to OpenAI's."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    return {"length": "length", "stop": "stop", "abort": "abort"}.get(str(kind), "stop")


class StreamDeltas:
    """Turns one streamed answer's chunks into deltas: the text and token ids new since the last chunk.

    SGLang 0.5.23 (``tokenizer_manager.py``, ``_handle_batch_output``): by default each chunk carries
    the cumulative ``text`` and ``output_ids``; with ``--incremental-streaming-output`` both are deltas
    (queued deltas are concatenated, never dropped). The mode comes from the worker
    (:attr:`WorkerInfo.incremental_streaming`). When the worker did not say, the token counts tell: a
    cumulative chunk holds ``meta_info.completion_tokens`` ids, an incremental one only the new ones
    (the first chunk reads the same either way). The text's shape is never used to decide.

    Args:
        incremental: the worker's mode, or None when unknown.
    """

    def __init__(self, incremental: bool | None) -> None:
        self._incremental = incremental
        self._text_chars = 0  # length of the cumulative text so far
        self._ids = 0  # token ids so far
        self._logprobs = 0  # token logprobs so far
        self._last_incremental = False  # the mode the last step read

    def _is_incremental(self, n_ids: int | None, completion_tokens: int) -> bool:
        if self._incremental is not None:
            return self._incremental
        if n_ids is None or not completion_tokens or not self._ids:
            return False
        return n_ids + self._ids == completion_tokens

    def step(self, payload: dict[str, Any]) -> tuple[str, tuple[int, ...] | None]:
        """The new text and new token ids (None when the chunk has no ``output_ids``) of one chunk.

        Only the new ids are converted: a cumulative chunk repeats every id so far, and converting them
        all on each chunk made a stream's cost quadratic in its length."""
        raw_ids = payload.get("output_ids")
        ids: list[Any] | None = raw_ids if isinstance(raw_ids, list) else None
        meta = payload.get("meta_info") or {}
        text = payload.get("text")
        n_ids = None if ids is None else len(ids)
        self._last_incremental = self._is_incremental(n_ids, int(meta.get("completion_tokens") or 0))
        if self._last_incremental:
            self._ids += n_ids or 0
            new = None if ids is None else tuple([int(i) for i in ids])
            return (text if isinstance(text, str) else ""), new
        delta = ""
        if isinstance(text, str):
            delta = text[self._text_chars :]
            self._text_chars = max(self._text_chars, len(text))
        new_ids = None
        if ids is not None:
            new_ids = tuple([int(i) for i in ids[self._ids :]])
            self._ids = max(self._ids, len(ids))
        return delta, new_ids

    def new_logprobs(self, payload: dict[str, Any]) -> tuple[WorkerLogprob, ...] | None:
        """The token logprobs new in the chunk :meth:`step` just read (same mode as its ids)."""
        entries = worker_logprobs(payload.get("meta_info") or {})
        if entries is None or self._last_incremental:
            return entries
        new = entries[self._logprobs :]
        self._logprobs = max(self._logprobs, len(entries))
        return new


def _chunk(
    payload: dict[str, Any],
    text: str,
    output_ids: tuple[int, ...] | None,
    logprobs: tuple[WorkerLogprob, ...] | None = None,
    more_ready: bool = False,
) -> UpstreamChunk:
    meta = payload.get("meta_info") or {}
    return UpstreamChunk(
        text=text,
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        completion_tokens=int(meta.get("completion_tokens") or 0),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        finish_reason=finish_reason_of(meta),
        output_ids=output_ids,
        logprobs=logprobs,
        more_ready=more_ready,
    )


def _batch_chunks(
    worker: str, batch: list[bytes], deltas: StreamDeltas
) -> tuple[list[UpstreamChunk], UpstreamError | None, bool]:
    """The chunks of the SSE lines one read of ``worker``'s stream brought (``batch``), each but the last
    marked ``more_ready``; the error that ends the stream after them (an error event, a malformed or
    aborted chunk), if any; and whether ``data: [DONE]`` came. The last chunk before an error is not
    marked: the stream may then resume elsewhere, a wait its events must not be held over."""
    chunks: list[UpstreamChunk] = []
    failure: UpstreamError | None = None
    done = False
    for line in batch:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True  # the caller reads on to the end of the response: the connection is reused
            break
        try:
            payload = orjson.loads(data)
            if "error" in payload:
                failure = stream_error(worker, payload)
                break
            text, ids = deltas.step(payload)
            chunk = _chunk(payload, text, ids, deltas.new_logprobs(payload), True)
        except MALFORMED_ANSWER as exc:
            failure = malformed_error(worker, exc)
            failure.__cause__ = exc
            break
        if chunk.finish_reason == "abort":
            failure = abort_error(worker, payload.get("meta_info") or {})
            break
        chunks.append(chunk)
    if chunks:
        chunks[-1] = replace(chunks[-1], more_ready=False)
    return chunks, failure, done


def joined(first: UpstreamChunk, then: UpstreamChunk) -> UpstreamChunk:
    """Two consecutive chunks of one stream as one: texts, token ids and log probabilities in order; the
    counts, finish and ``more_ready`` of the later (the worker's counts are cumulative). Token ids or log
    probabilities missing from either are missing from both (unknown)."""
    ids = None if first.output_ids is None or then.output_ids is None else first.output_ids + then.output_ids
    logprobs = None if first.logprobs is None or then.logprobs is None else first.logprobs + then.logprobs
    return replace(then, text=first.text + then.text, output_ids=ids, logprobs=logprobs)


@dataclass(frozen=True, slots=True)
class TokenLimits:
    """Token limits of a worker (or the tightest over several).

    Attributes:
        max_prompt_tokens: longest prompt the worker schedules, tokens.
        max_total_tokens: longest prompt + completion it runs without cutting ``max_new_tokens``, tokens.
    """

    max_prompt_tokens: int
    max_total_tokens: int

    def tightest(self, other: TokenLimits | None) -> TokenLimits:
        """The smaller of both limits, field by field."""
        if other is None:
            return self
        return TokenLimits(
            min(self.max_prompt_tokens, other.max_prompt_tokens),
            min(self.max_total_tokens, other.max_total_tokens),
        )


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker reports about itself on ``GET /server_info`` (SGLang's resolved server arguments
    merged with its scheduler's start-up info).

    Attributes:
        incremental_streaming: the worker runs with ``--incremental-streaming-output`` (streamed ``text``
            and ``output_ids`` are deltas, not cumulative); None when it does not say (SGLang's default,
            cumulative, is then assumed only where the chunks themselves cannot tell).
        limits: its token limits, None when it reports none.
        max_running: requests the engine runs at once (:func:`engine_max_running`), None when unknown;
            the admission core starts the worker's window there.
        model: the model name it serves (SGLang's ``served_model_name``; its model path unless
            ``--served-model-name`` was given), None when it does not say.
    """

    incremental_streaming: bool | None = None
    limits: TokenLimits | None = None
    max_running: int | None = None
    model: str | None = None

    @classmethod
    def parse(cls, payload: Any) -> WorkerInfo:
        """Read a ``/server_info`` body.

        Limits (SGLang 0.5.23, ``tp_worker.py`` and ``scheduler.py``): the scheduler's
        ``max_req_len = min(context_len - 1, kv_capacity - 1)`` and ``max_req_input_len = max_req_len - 5``;
        it refuses a prompt of ``max_req_input_len`` tokens or more and silently cuts ``max_new_tokens`` to
        ``max_req_len - prompt - 1``. So a prompt may have ``max_req_input_len - 1`` tokens and prompt +
        completion ``max_req_input_len + 4``. Without ``max_req_input_len`` the model's
        ``context_length`` is used the same way (``max_req_len = context_length - 1``).
        """
        if not isinstance(payload, dict):
            return cls()
        flag = payload.get("incremental_streaming_output")
        limits = None
        max_input = payload.get("max_req_input_len")
        context = payload.get("context_length")
        if isinstance(max_input, int) and max_input > 1:
            limits = TokenLimits(max_input - 1, max_input + 4)
        elif isinstance(context, int) and context > 7:
            limits = TokenLimits(context - 7, context - 2)
        return cls(
            incremental_streaming=flag if isinstance(flag, bool) else None,
            limits=limits,
            max_running=engine_max_running(payload),
            model=model if isinstance(model := payload.get("served_model_name"), str) and model else None,
        )


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """Load a worker reports on ``/metrics`` (summed over its DP ranks and priorities).

    Attributes:
        running: ``sglang:num_running_reqs``, requests.
        queued: ``sglang:num_queue_reqs``, requests waiting inside the engine.
        kv_usage: ``sglang:token_usage``, fraction of the KV cache in use (0..1).
    """

    running: int
    queued: int
    kv_usage: float


def parse_load(metrics_text: str) -> WorkerLoad:
    """Read running/queued requests and KV usage from SGLang's Prometheus text."""
    totals = {"sglang:num_running_reqs": 0.0, "sglang:num_queue_reqs": 0.0}
    kv = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
            elif sample.name == "sglang:token_usage":
                kv = max(kv, sample.value)
    return WorkerLoad(int(totals["sglang:num_running_reqs"]), int(totals["sglang:num_queue_reqs"]), kv)


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
        """Read ``/server_info`` (``/get_server_info`` on older SGLang) and cache it.

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
        if self._info.get(worker) != info:
            log.info(
                "worker_info",
                worker=worker,
                incremental_streaming=info.incremental_streaming,
                max_prompt_tokens=info.limits.max_prompt_tokens if info.limits else None,
                max_total_tokens=info.limits.max_total_tokens if info.limits else None,
                max_running=info.max_running,
                model=info.model,
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

    async def generate(self, worker: str, body: dict[str, Any]) -> UpstreamChunk:
        """Non-streamed ``/generate``. Raises :class:`UpstreamError`."""
        try:
            status, raw = await self._http.call(
                "POST", worker, "/generate", compact_json({**body, "stream": False})
            )
        except TransportFailure as exc:
            raise self._transport_error(worker, exc) from exc
        if status != 200:
            raise http_error(worker, status, raw)
        try:
            payload = orjson.loads(raw)
            ids = payload.get("output_ids")
            meta = payload.get("meta_info") or {}
            text = str(payload.get("text", ""))
            output_ids = tuple(ids) if isinstance(ids, list) else None
            chunk = _chunk(payload, text, output_ids, worker_logprobs(meta))
        except MALFORMED_ANSWER as exc:
            raise malformed_error(worker, exc) from exc
        if chunk.finish_reason == "abort":
            raise abort_error(worker, meta, chunk)
        return chunk

    async def stream(self, worker: str, body: dict[str, Any]) -> AsyncIterator[UpstreamChunk]:
        """Streamed ``/generate``: yields deltas (see :class:`StreamDeltas`). Raises :class:`UpstreamError`
        (also mid-stream, and after ``stream_idle_timeout_s`` of silence once a token came: a
        :class:`~service.workers.stall_watch.StallWatch`). The response is read past ``data: [DONE]`` to
        its end, so its connection is reused.

        Chunks without text that open the stream are held and joined to the first chunk with text or a
        finish (:func:`joined`): SGLang 0.5.23 streams the first token of a grammar that admits none
        (an empty text) before it aborts the request with "Grammar accept_token failed", and an answer
        must not start (a 200, a charge) on a token the worker then takes back; that abort now comes
        before anything is yielded (a 400 with nothing charged, :mod:`service.workers.upstream_errors`)."""
        info = self._info.get(worker) or await self.learn(worker)
        deltas = StreamDeltas(info.incremental_streaming if info else None)
        done = finished = False
        opening = True
        held: UpstreamChunk | None = None
        try:
            with StallWatch(self._idle_s) as watch:
                async with await self._http.stream(
                    worker, "/generate", compact_json({**body, "stream": True})
                ) as resp:
                    if resp.status != 200:
                        raise http_error(worker, resp.status, await resp.body())
                    batches = resp.line_batches()
                    while (batch := await watch.read(anext(batches, None))) is not None:
                        if done:
                            continue
                        chunks, failure, done = _batch_chunks(worker, batch, deltas)
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


def engine_max_running(info: Any) -> int | None:
    """``max_running_requests`` of a worker from its ``/server_info`` JSON: SGLang reports
    ``internal_states[i].effective_max_running_requests_per_dp`` per data-parallel rank (the explicit
    ``--max-running-requests`` or what it derived from the KV pool), summed here; else the top-level
    ``max_running_requests`` server argument; None when absent."""
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states")
    if isinstance(states, list):
        per_dp = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
        values = [int(v) for v in per_dp if isinstance(v, int | float) and v > 0]
        if values:
            return sum(values)
    value = info.get("max_running_requests")
    return int(value) if isinstance(value, int | float) and value > 0 else None
