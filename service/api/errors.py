"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from service.api.protocol import MESSAGE_FIELD_INVALID, MESSAGE_FIELD_MISSING
from service.compact_json import compact_json
from service.errors import (
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
from tenancy.errors import StoreUnavailable

log = structlog.get_logger("radixgate.errors")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_error",
}


class APIError(Exception):
    """An error answered to the client in OpenAI's shape.

    Args:
        status: HTTP status (400, 401, 403, 404, 413, 429, 502, 503, ...).
        message: human-readable explanation (never contains prompt text or key material).
        code: machine-readable code, e.g. ``"invalid_api_key"``, ``"rate_limit_exceeded"``.
        param: the offending request field, if any.
        headers: extra response headers (e.g. ``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @property
    def error_type(self) -> str:
        """OpenAI error ``type`` for this status."""
        return _TYPE_BY_STATUS.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        """The JSON body ``{"error": {...}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def sse_event(self) -> bytes:
        """The error as one server-sent event (used once a stream has started)."""
        return f"data: {json.dumps(self.body())}\n\n".encode()


class FastJSONResponse(JSONResponse):
    """A JSON response rendered with orjson (compact, UTF-8; what the hot routes answer), Python's json for
    what orjson refuses (:func:`service.compact_json.compact_json`)."""

    def render(self, content: Any) -> bytes:
        return compact_json(content)


def error_response(err: APIError) -> JSONResponse:
    """Render an :class:`APIError` as a JSON response."""
    return FastJSONResponse(err.body(), status_code=err.status, headers=err.headers)


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


def validation_error(exc: RequestValidationError | Exception, body: Any = None) -> APIError:
    """Turn a pydantic/FastAPI validation failure into OpenAI's 400 ``invalid_request_error``.

    ``body``: the JSON the request sent, when known; it names the parameter precisely (``param``): of a
    union's several errors the one that goes deepest into what was sent is reported, and pydantic's union
    members (``str``, ``list[...]``) are left out of the path."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return APIError(400, str(exc), code="invalid_request")
    if body is None and isinstance(exc, RequestValidationError):
        body = exc.body
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
        return APIError(
            400,
            f"Missing required parameter: '{param}'; {msg}.",
            code="missing_required_parameter",
            param=param,
        )
    if kind == "extra_forbidden":
        return APIError(
            400, f"Unrecognized request argument supplied: {param}", code="unknown_parameter", param=param
        )
    if kind == "missing":
        return APIError(
            400, f"Missing required parameter: '{param}'.", code="missing_required_parameter", param=param
        )
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    text = f"Invalid value for '{param}': {msg}" if param else f"Invalid request: {msg}"
    return APIError(400, text, code="invalid_value", param=param)


def store_unavailable(retry_after_s: int) -> APIError:
    """The 503 for :class:`tenancy.errors.StoreUnavailable` (Redis exhausted, slow or unreachable)."""
    return APIError(
        503,
        "The gateway's shared store is busy or unavailable; retry shortly.",
        code="store_unavailable",
        headers={"Retry-After": str(retry_after_s)},
    )


_STATUS_BY_ERROR: tuple[tuple[type[GatewayError], int], ...] = (
    (InvalidRequest, 400),
    (UpstreamRejected, 400),
    (Unauthenticated, 401),
    (PermissionDenied, 403),
    (NotFound, 404),
    (RequestTooLarge, 413),
    (RateLimited, 429),
    (Overloaded, 503),
    (QueueTimeout, 503),
    (FirstTokenTimeout, 503),
    (NoWorkerAvailable, 503),
    (ShuttingDown, 503),
)


def http_status(exc: GatewayError) -> int:
    """The HTTP status of a domain error (the only place that decides it)."""
    if isinstance(exc, UpstreamFailed):
        return 503 if exc.transport else 502
    for kind, status in _STATUS_BY_ERROR:
        if isinstance(exc, kind):
            return status
    return 500


def to_api_error(exc: GatewayError) -> APIError:
    """A domain error as an :class:`APIError`: status, OpenAI shape, ``Retry-After`` when retryable."""
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return APIError(http_status(exc), exc.message, code=exc.code, param=exc.param, headers=headers)


def sse_error_event(exc: GatewayError | APIError) -> bytes:
    """An error as one server-sent event, for a stream that has already started."""
    err = exc if isinstance(exc, APIError) else to_api_error(exc)
    return err.sse_event()


def refused(request: Request, err: APIError) -> Response:
    """``err``'s response, logged (``request_rejected``: request id, method, path, status, code, param and
    the tenant once its key was checked) and counted (``radixgate_rejected_requests_total{status,code}``),
    unless the pipeline admitted the request: then its settle logs the ``request`` line and counts it in
    ``requests_total``. A request refused earlier (key, body, model, bounds, quota) would leave no trace."""
    state = request.scope.get("state") or {}
    if not state.get("admitted"):
        code = err.code or "none"
        (log.warning if err.status >= 500 else log.info)(
            "request_rejected",
            request_id=state.get("request_id"),
            method=request.method,
            path=request.url.path[:200],
            status=err.status,
            code=code,
            param=err.param,
            tenant=state.get("tenant_id"),
        )
        request.app.state.metrics.child(request.app.state.metrics.rejected, str(err.status), code).inc()
    return error_response(err)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return refused(request, exc)


async def _on_gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return refused(request, to_api_error(exc))


async def _on_store_unavailable(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StoreUnavailable)
    log.warning("store_unavailable", operation=exc.operation, error=str(exc.__cause__ or exc))
    request.app.state.metrics.store_unavailable.labels(exc.operation).inc()
    return refused(request, store_unavailable(request.app.state.settings.redis.retry_after_s))


async def _on_validation(request: Request, exc: Exception) -> Response:
    return refused(request, validation_error(exc))


async def _on_http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return refused(request, APIError(exc.status_code, str(exc.detail), code=code))


async def _on_client_left(_: Request, exc: Exception) -> Response:
    """The client closed its connection before its request body was complete: nobody reads an answer;
    a 499 (client closed request, nginx's code) for the access log, not a crash."""
    return Response(status_code=499)


async def _on_crash(request: Request, exc: Exception) -> Response:
    log.exception("unhandled_error", error_type=type(exc).__name__)
    return refused(request, APIError(500, "Internal error; it has been logged.", code="internal_error"))


_HANDLERS: tuple[tuple[type[Exception], Callable[[Request, Exception], Awaitable[Response]]], ...] = (
    (APIError, _on_api_error),
    (GatewayError, _on_gateway_error),
    (StoreUnavailable, _on_store_unavailable),
    (RequestValidationError, _on_validation),
    (StarletteHTTPException, _on_http),
    (ClientDisconnect, _on_client_left),
)


async def response_for(request: Request, exc: Exception) -> Response:
    """The response :func:`install_error_handlers` gives for ``exc`` (for handlers served outside
    FastAPI's exception middleware)."""
    for kind, handler in _HANDLERS:
        if isinstance(exc, kind):
            return await handler(request, exc)
    return await _on_crash(request, exc)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error leave the app in OpenAI's shape (APIError, domain errors, validation, 404/405,
    crashes). Domain errors raised below the routes map here: :class:`StoreUnavailable` -> 503 with
    ``Retry-After`` (``redis.retry_after_s``), counted in ``radixgate_store_unavailable_total``."""
    app.add_exception_handler(Exception, _on_crash)
    for kind, handler in _HANDLERS:
        app.add_exception_handler(kind, handler)
