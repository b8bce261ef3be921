"""HTTP client for SGLang's native ``/generate`` API (stream and non-stream), ``/abort_request`` and health.

Request body (SGLang ``GenerateReqInput``): ``{"text", "sampling_params": {...}, "stream", "rid",
"priority"}``. Each response (or SSE chunk ``data: {...}``, ended by ``data: [DONE]``) carries ``text``
and ``meta_info`` with ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` and ``finish_reason``.
Streamed ``text`` is cumulative by default; :func:`text_delta` handles both cumulative and incremental.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

ProbeResult = Literal["ok", "failed", "refused", "unknown"]
"""Outcome of one health probe ("unknown": the gateway's own connection pool was full; no evidence)."""


class UpstreamError(Exception):
    """A worker call failed.

    Attributes:
        worker: base URL of the worker.
        status: HTTP status from the worker, or None for a transport error (connect, read, timeout).
        retryable: safe to try another worker (nothing was sent to the client yet is the caller's call).
        refused: the connection could not be opened (the worker is down, not just slow).
        local: the gateway's own connection pool to workers stayed exhausted past its wait bound; the
            worker was never called (not its fault).
    """

    def __init__(
        self,
        worker: str,
        message: str,
        status: int | None = None,
        retryable: bool = True,
        refused: bool = False,
        local: bool = False,
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.status = status
        self.retryable = retryable
        self.refused = refused
        self.local = local


@dataclass(frozen=True, slots=True)
class UpstreamChunk:
    """One step of a worker's answer (or the whole answer, when not streamed).

    Attributes:
        text: new text since the previous chunk (the full text for a non-streamed answer).
        prompt_tokens, completion_tokens, cached_tokens: the worker's counts so far (tokens).
        finish_reason: ``"stop"``, ``"length"``, or None while generating.
        output_ids: all token ids generated so far (SGLang streams them cumulatively), if sent.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None
    output_ids: tuple[int, ...] | None = None


def finish_reason_of(meta: dict[str, Any]) -> str | None:
    """Map SGLang's ``meta_info.finish_reason`` (``{"type": ...}`` or a string) to OpenAI's."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    return {"length": "length", "stop": "stop", "abort": "abort"}.get(str(kind), "stop")


def text_delta(previous: str, current: str) -> str:
    """New text of a streamed chunk: SGLang sends cumulative text unless told otherwise."""
    if current.startswith(previous):
        return current[len(previous) :]
    return current


def _chunk(payload: dict[str, Any], text: str) -> UpstreamChunk:
    meta = payload.get("meta_info") or {}
    return UpstreamChunk(
        text=text,
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        completion_tokens=int(meta.get("completion_tokens") or 0),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        finish_reason=finish_reason_of(meta),
        output_ids=tuple(ids) if isinstance(ids := payload.get("output_ids"), list) else None,
    )


def _error_message(payload: Any) -> str:
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return "worker returned an error"


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
    """Talks to SGLang workers over one shared :class:`httpx.AsyncClient` (connection pooling).

    Args:
        http: the shared client; its timeouts apply (connect and per-read silence).
    """

    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http

    async def generate(self, worker: str, body: dict[str, Any]) -> UpstreamChunk:
        """Non-streamed ``/generate``. Raises :class:`UpstreamError`."""
        try:
            resp = await self._http.post(f"{worker}/generate", json={**body, "stream": False})
        except httpx.HTTPError as exc:
            raise _transport_error(worker, exc) from exc
        if resp.status_code != 200:
            raise UpstreamError(
                worker,
                _error_message(_json_or_none(resp.text)),
                status=resp.status_code,
                retryable=resp.status_code >= 500,
            )
        payload = resp.json()
        chunk = _chunk(payload, str(payload.get("text", "")))
        if chunk.finish_reason == "abort":
            raise UpstreamError(worker, "worker aborted the request", status=503)
        return chunk

    async def stream(self, worker: str, body: dict[str, Any]) -> AsyncIterator[UpstreamChunk]:
        """Streamed ``/generate``: yields deltas. Raises :class:`UpstreamError` (also mid-stream)."""
        previous = ""
        try:
            async with self._http.stream("POST", f"{worker}/generate", json={**body, "stream": True}) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    raise UpstreamError(
                        worker,
                        _error_message(_json_or_none(text)),
                        status=resp.status_code,
                        retryable=resp.status_code >= 500,
                    )
                finished = False
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    payload = json.loads(data)
                    if "error" in payload:
                        raise UpstreamError(worker, _error_message(payload), status=500)
                    current = str(payload.get("text", ""))
                    chunk = _chunk(payload, text_delta(previous, current))
                    previous = current
                    if chunk.finish_reason == "abort":
                        raise UpstreamError(worker, "worker aborted the request", status=503)
                    finished = finished or chunk.finish_reason is not None
                    yield chunk
                if not finished:
                    raise UpstreamError(worker, "stream ended before the answer finished")
        except httpx.HTTPError as exc:
            raise _transport_error(worker, exc) from exc

    async def abort(self, worker: str, rid: str) -> bool:
        """Ask a worker to abort request ``rid`` (SGLang ``/abort_request``). Never raises."""
        try:
            resp = await self._http.post(f"{worker}/abort_request", json={"rid": rid}, timeout=2.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def max_running_requests(self, worker: str, timeout_s: float = 5.0) -> int | None:
        """How many requests the engine runs at once, from ``GET /server_info`` (None if unknown).

        SGLang reports ``internal_states[i].effective_max_running_requests_per_dp`` per data-parallel rank
        (the explicit ``--max-running-requests`` or what it derived from the KV pool); the sum is the
        worker's. Falls back to the top-level ``max_running_requests`` server argument.
        """
        try:
            resp = await self._http.get(f"{worker}/server_info", timeout=timeout_s)
            info = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return engine_max_running(info)

    async def load(self, worker: str, timeout_s: float = 2.0) -> WorkerLoad | None:
        """The worker's reported load from ``GET /metrics``; None if it cannot be read."""
        try:
            resp = await self._http.get(f"{worker}/metrics", timeout=timeout_s)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        try:
            return parse_load(resp.text)
        except ValueError:
            return None

    async def probe(self, worker: str, timeout_s: float = 2.0, deep: bool = False) -> ProbeResult:
        """``GET /health`` (or, when ``deep``, ``/health_generate``, which runs a 1-token generation on an
        idle worker): ``"ok"`` for 200 within ``timeout_s``, ``"refused"`` when the connection could
        not be opened, ``"unknown"`` when no pooled connection was free, ``"failed"`` otherwise (other
        status, timeout, reset)."""
        path = "/health_generate" if deep else "/health"
        try:
            resp = await self._http.get(f"{worker}{path}", timeout=timeout_s)
        except httpx.ConnectError:
            return "refused"
        except httpx.PoolTimeout:
            return "unknown"
        except httpx.HTTPError:
            return "failed"
        return "ok" if resp.status_code == 200 else "failed"


def engine_max_running(info: Any) -> int | None:
    """``max_running_requests`` of a worker from its ``/server_info`` JSON (see
    :meth:`SGLangClient.max_running_requests`); None when absent."""
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


def _transport_error(worker: str, exc: httpx.HTTPError) -> UpstreamError:
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, httpx.PoolTimeout):  # no free connection in our own pool: not the worker's fault
        return UpstreamError(worker, message, retryable=False, local=True)
    return UpstreamError(worker, message, refused=isinstance(exc, httpx.ConnectError))


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
