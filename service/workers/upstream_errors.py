"""A worker's failure as one :class:`UpstreamError`: its status, whose fault it is, and the worker's own text.

Where SGLang 0.5.23 puts its errors (``entrypoints/http_server.py``, ``managers/schedule_batch.py``):

- a non-streamed ``/generate`` that fails answers ``{"error": {"message"}}`` with the exception's
  ``status_code`` (400 by default); FastAPI's own validation answers 422 ``{"detail": [...]}``;
- a streamed one that fails after the 200 sends one event ``{"error": {"message", "type", "code",
  "retryable"}}`` (``code`` is the HTTP status it would have given: 400 for bad input);
- a request the scheduler aborts finishes with ``meta_info.finish_reason = {"type": "abort", "message",
  "status_code"}`` (400 for a grammar it cannot compile: "Failed to compile json grammar: ...");
- a grammar that compiles but admits no token (an empty language: a schema whose only instances are
  infinite cycles) is aborted at its first token with 500 "Grammar accept_token failed: ..."
  (``managers/scheduler_components/batch_result_processor.py``): the request's grammar is at fault, on any
  worker, so it is the input's fault too (:data:`GRAMMAR_REJECTED`).

The worker's text is kept whole in the error (for the gateway's log); what a tenant may see of it is
decided by :mod:`service.pipeline.rejection`.
"""

from __future__ import annotations

from typing import Any

import orjson

from service.workers.chunks import UpstreamChunk

WORKER_FAULT_4XX = frozenset({401, 403, 404, 405, 407})
"""4xx answers to ``/generate`` that are the worker's (or its URL's) fault whatever the input: SGLang's
API-key check (401, 403: ``sglang/srt/utils/auth.py``), no such route or method (404, 405: not an SGLang
server, a wrong URL or port), a proxy that wants credentials (407). Retried elsewhere and held against
the worker's breaker; every other 4xx is the input's fault."""


GRAMMAR_REJECTED = "Grammar accept_token failed"
"""How SGLang 0.5.23's 500 for a request whose grammar refused the token it sampled begins (its
``FINISH_ABORT`` when ``accept_token`` raises). The grammar is the request's (its schema or tools); every
worker fails it the same way, so it is taken as a 400: not retried, not held against the worker, nothing
charged."""


def _grammar_rejected(status: int | None, text: str) -> bool:
    return status is not None and status >= 500 and text.startswith(GRAMMAR_REJECTED)


class UpstreamError(Exception):
    """A worker call failed.

    Attributes:
        worker: base URL of the worker.
        status: HTTP status from the worker, or None for a transport error (connect, read, timeout).
        retryable: safe to try another worker (nothing was sent to the client yet is the caller's call).
        refused: the connection could not be opened (the worker is down, not just slow).
        local: the gateway's own connection pool to workers stayed exhausted past its wait bound; the
            worker was never called (not its fault).
        partial: an aborted answer's counts so far (what the worker computed), when it sent them.
        moved: the gateway cut the call itself, its worker's drain deadline having passed
            (``upstream.worker_drain_deadline_s``): no evidence against the worker, and always worth
            going on elsewhere.
    """

    def __init__(
        self,
        worker: str,
        message: str,
        status: int | None = None,
        retryable: bool = True,
        refused: bool = False,
        local: bool = False,
        partial: UpstreamChunk | None = None,
        moved: bool = False,
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.status = status
        self.retryable = retryable
        self.refused = refused
        self.local = local
        self.partial = partial
        self.moved = moved

    @property
    def rejected(self) -> bool:
        """The worker answered 4xx: the request's input is at fault, not the worker."""
        return self.status is not None and 400 <= self.status < 500 and self.status not in WORKER_FAULT_4XX


def abort_status(meta: dict[str, Any]) -> int | None:
    """The HTTP status SGLang gives an aborted request (``finish_reason.status_code``; 400 for a grammar
    it cannot compile), None when it gives none."""
    reason = meta.get("finish_reason")
    status = reason.get("status_code") if isinstance(reason, dict) else None
    return status if isinstance(status, int) else None


def abort_error(worker: str, meta: dict[str, Any], partial: UpstreamChunk | None = None) -> UpstreamError:
    """An aborted answer as an error: the worker's 4xx (the input's fault, not retried) or a 503; a
    non-streamed one carries its counts so far (``partial``)."""
    status = abort_status(meta)
    reason = meta.get("finish_reason")
    message = reason.get("message") if isinstance(reason, dict) else None
    if _grammar_rejected(status, str(message or "")):
        status = 400
    if status is not None and 400 <= status < 500:
        return UpstreamError(
            worker, str(message or "worker rejected the request"), status=status, retryable=False
        )
    said = f": {message}" if message else ""
    return UpstreamError(worker, f"worker aborted the request{said}", status=503, partial=partial)


def error_text(payload: Any, raw: bytes = b"") -> str:
    """The worker's own words from an error body: ``error.message`` (or ``error``), a top-level
    ``message`` or ``detail``, else the raw body; ``"worker returned an error"`` when it is empty."""
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
        for key in ("message", "detail"):
            if payload.get(key) is not None:
                return str(payload[key])
    text = raw.decode(errors="replace").strip()
    return text or "worker returned an error"


def http_error(worker: str, status: int, raw: bytes) -> UpstreamError:
    """A non-200 answer to ``/generate``: retried elsewhere when 5xx or a worker's fault
    (:data:`WORKER_FAULT_4XX`), the input's fault when another 4xx or the request's grammar refused its
    token (:data:`GRAMMAR_REJECTED`, a 400)."""
    text = error_text(json_or_none(raw), raw)
    if _grammar_rejected(status, text):
        return UpstreamError(worker, text, status=400, retryable=False)
    retryable = status >= 500 or status in WORKER_FAULT_4XX
    return UpstreamError(worker, text, status=status, retryable=retryable)


def stream_error(worker: str, payload: dict[str, Any]) -> UpstreamError:
    """An ``{"error": ...}`` event in a stream: its ``code`` when it is a 4xx (bad input, not retried) or
    the request's grammar refused its token (:data:`GRAMMAR_REJECTED`, a 400), else a 500."""
    err = payload.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    text = error_text(payload)
    if _grammar_rejected(500, text):
        code = 400
    if isinstance(code, int) and 400 <= code < 500:
        return UpstreamError(worker, text, status=code, retryable=False)
    return UpstreamError(worker, text, status=500)


MALFORMED_ANSWER: tuple[type[Exception], ...] = (ValueError, TypeError, AttributeError, KeyError)
"""What reading a 200 answer that is not SGLang's raises: not JSON (``orjson.JSONDecodeError`` is a
``ValueError``), JSON that is not an object, fields of the wrong type."""


def malformed_error(worker: str, cause: Exception) -> UpstreamError:
    """A 200 answer (whole, or one SSE event) that is not SGLang's: the worker failed (retryable, held
    against its breaker, a 502/503 for the tenant once attempts are spent), not a gateway bug (500)."""
    return UpstreamError(worker, f"malformed answer from the worker: {type(cause).__name__}: {cause}")


def json_or_none(raw: bytes) -> Any:
    """``raw`` parsed as JSON, or None when it is not JSON."""
    try:
        return orjson.loads(raw)
    except ValueError:
        return None


__all__ = [
    "GRAMMAR_REJECTED",
    "MALFORMED_ANSWER",
    "WORKER_FAULT_4XX",
    "UpstreamError",
    "abort_error",
    "abort_status",
    "error_text",
    "http_error",
    "json_or_none",
    "malformed_error",
    "stream_error",
]
