"""Errors as HTTP answers: each domain error's status (the one place that decides it), ``Retry-After``, and
OpenAI's error shape (:mod:`service.protocol.errors`); the app's exception handlers."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from service.api.rate_limit_headers import rate_limit_headers
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
from service.protocol.compact_json import compact_json
from service.protocol.errors import (
    MAX_MESSAGE_CHARS,
    MAX_PARAM_CHARS,
    cut,
    error_object,
    error_type,
    invalid_params,
    sse_error_frame,
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
        details: more fields of the error object (:attr:`service.errors.GatewayError.details`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        error_type: str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        # bounded here, so that neither the answer nor the request_rejected line echoes a large body back
        message = cut(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = None if param is None else cut(param, MAX_PARAM_CHARS)
        self.headers = headers or {}
        self.details = details
        self.error_type = error_type or _TYPE_BY_STATUS.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        """The JSON body ``{"error": {...}}``."""
        return error_object(self.message, self.error_type, self.param, self.code, self.details)

    def sse_event(self) -> bytes:
        """The error as one server-sent event (used once a stream has started)."""
        return sse_error_frame(self.body())


class FastJSONResponse(JSONResponse):
    """A JSON response rendered with orjson (compact, UTF-8; what the hot routes answer), Python's json for
    what orjson refuses (:func:`service.protocol.compact_json.compact_json`)."""

    def render(self, content: Any) -> bytes:
        return compact_json(content)


def error_response(err: APIError) -> JSONResponse:
    """Render an :class:`APIError` as a JSON response."""
    return FastJSONResponse(err.body(), status_code=err.status, headers=err.headers)


def validation_error(exc: RequestValidationError | Exception, body: Any = None) -> APIError:
    """A pydantic/FastAPI validation failure as OpenAI's 400 ``invalid_request_error`` naming the parameter
    (:func:`service.protocol.errors.invalid_params`)."""
    return to_api_error(invalid_params(exc, body))


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
    """A domain error as an :class:`APIError`: status, OpenAI shape, ``Retry-After`` when retryable. A
    token bucket's refusal (``rate_limits`` set) also gets OpenAI's ``x-ratelimit-*`` headers and
    ``retry-after-ms`` (the wait to the millisecond, which the ``openai`` client reads before
    ``Retry-After``'s whole seconds)."""
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    if isinstance(exc, BudgetExhausted):  # the openai client reads it before retrying a 429
        headers["x-should-retry"] = "false"
    if exc.rate_limits is not None:
        headers.update(rate_limit_headers(exc.rate_limits))
        if exc.retry_after_s is not None and math.isfinite(exc.retry_after_s):
            headers["retry-after-ms"] = str(max(1, math.ceil(exc.retry_after_s * 1000)))
    return APIError(
        http_status(exc),
        exc.message,
        code=exc.code,
        param=exc.param,
        headers=headers,
        error_type=error_type(exc),
        details=exc.details,
    )


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
            client_request_id=state.get("client_request_id"),
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
