"""OpenAI's error shape, without HTTP: ``{"error": {"message", "type", "param", "code"}}``.

The ``type`` of each domain error (:mod:`service.errors`) is decided here, from what went wrong, so that a
stream that has started (no status left to send) carries the same error object as a refused request.
:mod:`service.api.errors` maps the same errors to their HTTP status; a test holds the two tables together.
Types are OpenAI's (``invalid_request_error``, ``authentication_error``, ``permission_error``,
``not_found_error``, ``rate_limit_error``) and, for the gateway's own faults, ``service_unavailable``,
``upstream_error`` and ``server_error``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pydantic import ValidationError

from service.errors import (
    BudgetExhausted,
    FirstTokenTimeout,
    GatewayError,
    InvalidRequest,
    NotFound,
    NoWorkerAvailable,
    Overloaded,
    PermissionDenied,
    QueueTimeout,
    RateLimited,
    RequestTooLarge,
    ShuttingDown,
    Unauthenticated,
    UpstreamFailed,
    UpstreamRejected,
)
from service.protocol.completions import MESSAGE_FIELD_INVALID, MESSAGE_FIELD_MISSING

_TYPE_BY_ERROR: tuple[tuple[type[GatewayError], str], ...] = (
    (InvalidRequest, "invalid_request_error"),
    (UpstreamRejected, "invalid_request_error"),
    (RequestTooLarge, "invalid_request_error"),
    (Unauthenticated, "authentication_error"),
    (PermissionDenied, "permission_error"),
    (NotFound, "not_found_error"),
    (BudgetExhausted, "insufficient_quota"),
    (RateLimited, "rate_limit_error"),
    (Overloaded, "service_unavailable"),
    (QueueTimeout, "service_unavailable"),
    (FirstTokenTimeout, "service_unavailable"),
    (NoWorkerAvailable, "service_unavailable"),
    (ShuttingDown, "service_unavailable"),
)


def error_type(exc: GatewayError) -> str:
    """OpenAI's error ``type`` of a domain error (``server_error`` for one this table does not know)."""
    if isinstance(exc, UpstreamFailed):
        return "service_unavailable" if exc.transport else "upstream_error"
    for kind, name in _TYPE_BY_ERROR:
        if isinstance(exc, kind):
            return name
    return "server_error"


MAX_MESSAGE_CHARS = 1000
"""Longest ``message`` of an error answer, characters: a message that quotes what the client sent (an
unknown parameter's name, a part's type) is cut here, so an answer never echoes a large body back."""

MAX_PARAM_CHARS = 256
"""Longest ``param`` of an error answer, characters."""

MAX_RANKED_ERRORS = 64
"""Validation errors :func:`invalid_params` looks at to name the parameter: the first ones pydantic
reports. A body invalid in 30,000 places took ~0.17 s to rank them all; the answer names one either way."""


def cut(text: str, limit: int) -> str:
    """``text``, or its first ``limit - 1`` characters and an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def error_object(
    message: str, type_: str, param: str | None, code: str | None, details: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON body ``{"error": {"message", "type", "param", "code"}}``, and ``details``' fields after
    them when given (e.g. a rate-limit refusal's ``quota``). ``message`` and ``param`` are cut to
    :data:`MAX_MESSAGE_CHARS` and :data:`MAX_PARAM_CHARS`: every error answer is bounded in size."""
    param = None if param is None else cut(param, MAX_PARAM_CHARS)
    error = {"message": cut(message, MAX_MESSAGE_CHARS), "type": type_, "param": param, "code": code}
    if details:
        error.update(details)
    return {"error": error}


def error_body(exc: GatewayError) -> dict[str, Any]:
    """A domain error's JSON body in OpenAI's shape."""
    return error_object(exc.message, error_type(exc), exc.param, exc.code, exc.details)


def sse_error_frame(body: dict[str, Any]) -> bytes:
    """An error body as one server-sent event (``data: {...}``), for a stream that has already started."""
    return f"data: {json.dumps(body)}\n\n".encode()


def sse_error_event(exc: GatewayError) -> bytes:
    """A domain error as one server-sent event."""
    return sse_error_frame(error_body(exc))


class ValidationFailure(Protocol):
    """What pydantic's ``ValidationError`` and FastAPI's ``RequestValidationError`` both offer."""

    def errors(self) -> Sequence[Any]: ...


def _param_path(loc: Sequence[Any], body: Any, missing: bool) -> tuple[list[str], int]:
    """The request parameter an error's ``loc`` names, as path parts, and how many of them the body has.

    pydantic puts the member of a union that failed into ``loc`` (``str``, ``list[TextPart]``, a tag):
    those parts are not in the request, so they are left out, walking ``body`` along the path. Without a
    body (None) every part is kept but the ones that look like type names. A missing field's last part is
    kept (it is missing from the body by definition)."""
    parts = [p for p in loc if p != "body"]
    out: list[str] = []
    node, found = body, 0
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(part, int):
            if isinstance(node, list) and 0 <= part < len(node):
                node, found = node[part], found + 1
            else:
                node = None
            out.append(str(part))
        elif isinstance(node, dict) and part in node:
            node, found = node[part], found + 1
            out.append(part)
        elif (missing and last) or (body is None and not _looks_like_a_type(part)):
            out.append(str(part))
            node = None
    return out, found


def _looks_like_a_type(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "none"} or any(c in part for c in "[-'")


def invalid_params(exc: ValidationFailure | Exception, body: Any = None) -> InvalidRequest:
    """A pydantic validation failure as OpenAI's ``invalid_request_error`` naming the parameter.

    ``body``: the JSON the request sent, when known; it names the parameter precisely (``param``): of a
    union's several errors the one that goes deepest into what was sent is reported, and pydantic's union
    members (``str``, ``list[...]``) are left out of the path. Codes: ``missing_required_parameter``,
    ``unknown_parameter``, ``invalid_value`` (``invalid_request`` when pydantic lists no error)."""
    if isinstance(exc, ValidationError):  # without the input each error carries (a copy of the body's part)
        errors = exc.errors(include_url=False, include_input=False)[:MAX_RANKED_ERRORS]
    else:
        errors = list(exc.errors())[:MAX_RANKED_ERRORS] if hasattr(exc, "errors") else []
    if not errors:
        return InvalidRequest(str(exc), code="invalid_request")
    if body is None:
        body = getattr(exc, "body", None)
    ranked = [
        (_param_path(e.get("loc", ()), body, e.get("type") == "missing"), n, e) for n, e in enumerate(errors)
    ]
    (loc, _), _, first = max(ranked, key=lambda r: (r[0][1], -r[1]))
    kind = first.get("type")
    if kind in (MESSAGE_FIELD_MISSING, MESSAGE_FIELD_INVALID):  # a message shape rule: name the field
        loc.append(str((first.get("ctx") or {}).get("field")))
    param = ".".join(loc) or None
    if kind == MESSAGE_FIELD_MISSING:
        msg = str(first.get("msg", ""))
        return InvalidRequest(
            f"Missing required parameter: '{param}'; {msg}.", code="missing_required_parameter", param=param
        )
    if kind == "extra_forbidden":
        return InvalidRequest(
            f"Unrecognized request argument supplied: {param}", code="unknown_parameter", param=param
        )
    if kind == "missing":
        return InvalidRequest(
            f"Missing required parameter: '{param}'.", code="missing_required_parameter", param=param
        )
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    text = f"Invalid value for '{param}': {msg}" if param else f"Invalid request: {msg}"
    return InvalidRequest(text, code="invalid_value", param=param)
