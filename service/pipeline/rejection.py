"""What a tenant is told when a worker refuses its request (the worker's 4xx), and what the log keeps.

A worker's error text is written for its operator: SGLang's grammar compiler (xgrammar) reports C++
source locations, Python tracebacks carry file paths, and some messages echo the whole grammar key or
the worker's address. The tenant gets a 400 in OpenAI's shape with a short reason cut from that text:

0. the worker's own URL and ``host:port`` become ``[worker]``;
1. a Python traceback is dropped (its last line, the exception, is kept when nothing precedes it);
2. the first remaining non-empty line is the reason;
3. a C++ log prefix (xgrammar's ``[12:03:44] /project/cpp/regex_converter.cc:83: ``) is dropped; URLs,
   ``host:port`` and IPv4 addresses, absolute file paths (with ``:line`` suffixes), ``File "...",
   line N`` frames and hex addresses are replaced by ``[url]``, ``[host]``, ``[path]``, ``[address]``;
4. whitespace is collapsed and the reason is cut to :data:`REASON_MAX_CHARS` characters.

``param`` names the request field at fault when the reason is about a grammar and the request carried
one: ``response_format`` for a JSON schema, ``tools`` for a tool call's structural tag (the gateway
builds no other grammar). The full text is logged (``upstream_rejected``, with the request id).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import structlog

from service.errors import UpstreamRejected
from service.workers.upstream_errors import UpstreamError

log = structlog.get_logger("radixgate.upstream")

REASON_MAX_CHARS = 200
"""Longest reason shown to a tenant, characters (one line of a log or a UI; our own choice)."""

LOGGED_MAX_CHARS = 16_000
"""Longest worker text kept in one log line, characters (a body is at most ``api.max_body_bytes``, and an
echoed grammar key can be as long; the total length is logged too)."""

_TRACEBACK = "Traceback (most recent call last)"
_LOG_PREFIX = re.compile(r"\[\d{1,2}:\d{2}:\d{2}\]\s*(?:\S+:\d+:\s*)?")
_FRAME = re.compile(r'\bFile "[^"]*", line \d+(?:, in [\w.<>]+)?')
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S+")
_HOST = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b|\blocalhost:\d+\b")
# an absolute path of two or more segments, not a JSON pointer ("#/$defs/a") nor a MIME type ("a/b")
_PATH = re.compile(r"(?<![\w#])(?:[A-Za-z]:)?(?:[\\/][\w.@+~-]+){2,}[\\/]?(?::\d+)*")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")
_SPACE = re.compile(r"\s+")
_GRAMMAR = re.compile(r"grammar|schema|structural|regex|ebnf|xgrammar|outlines|llguidance", re.IGNORECASE)
_PARAM_BY_CONSTRAINT = (("structural_tag", "tools"), ("json_schema", "response_format"))


def sanitized_reason(text: str, worker: str = "", limit: int = REASON_MAX_CHARS) -> str:
    """A short reason, safe to show a tenant, cut from a worker's error ``text`` (see the module's steps).

    Args:
        text: the worker's error text (any length, any lines).
        worker: the worker's base URL (removed wherever it appears); empty when unknown.
        limit: the most characters returned (>= 2).

    Returns:
        One line of at most ``limit`` characters; ``"no reason given"`` when nothing is left.
    """
    if worker:
        for own in sorted({worker, worker.rstrip("/"), urlsplit(worker).netloc} - {""}, key=len)[::-1]:
            text = text.replace(own, "[worker]")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    cut = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith(_TRACEBACK)), None)
    if cut is not None:
        lines = lines[:cut] or lines[-1:]
    reason = lines[0] if lines else ""
    reason = _LOG_PREFIX.sub("", reason)
    reason = _FRAME.sub("[path]", reason)
    reason = _URL.sub("[url]", reason)
    reason = _HOST.sub("[host]", reason)
    reason = _PATH.sub("[path]", reason)
    reason = _ADDRESS.sub("[address]", reason)
    reason = _SPACE.sub(" ", reason).strip()
    if len(reason) > limit:
        reason = reason[: limit - 1].rstrip() + "…"
    return reason or "no reason given"


def rejected_param(sampling_params: dict[str, Any], text: str) -> str | None:
    """The request field a worker's refusal is about: the field that built the request's grammar when
    ``text`` speaks of a grammar, else None."""
    if not _GRAMMAR.search(text):
        return None
    for key, param in _PARAM_BY_CONSTRAINT:
        if sampling_params.get(key) is not None:
            return param
    return None


def tenant_rejection(exc: UpstreamError, body: dict[str, Any], request_id: str) -> UpstreamRejected:
    """The tenant's error for a worker's 4xx ``exc`` to the ``/generate`` ``body`` (a 400 in OpenAI's
    shape, code ``upstream_rejected``); logs the worker's full text with ``request_id``."""
    text = str(exc)
    log.warning(
        "upstream_rejected",
        request_id=request_id,
        worker=exc.worker,
        status=exc.status,
        worker_message=text[:LOGGED_MAX_CHARS],
        worker_message_chars=len(text),
    )
    sampling = body.get("sampling_params")
    param = rejected_param(sampling if isinstance(sampling, dict) else {}, text)
    reason = sanitized_reason(text, exc.worker)
    where = "the request's schema" if param else "the request"  # param: the API's own name for it
    return UpstreamRejected(f"The model server rejected {where}: {reason}", param=param)


__all__ = ["REASON_MAX_CHARS", "rejected_param", "sanitized_reason", "tenant_rejection"]
