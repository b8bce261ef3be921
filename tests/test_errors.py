"""Domain errors (service/errors.py) map to status, Retry-After and OpenAI's shape in one place."""

from __future__ import annotations

import pytest

from service.api.errors import http_status, to_api_error
from service.errors import (
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


@pytest.mark.parametrize(
    ("error", "status", "code", "retry_after"),
    [
        (InvalidRequest("bad", param="top_k"), 400, "invalid_request", None),
        (UpstreamRejected("worker said no"), 400, "upstream_rejected", None),
        (Unauthenticated("who"), 401, "invalid_api_key", None),
        (PermissionDenied("no", code="model_not_allowed"), 403, "model_not_allowed", None),
        (NotFound("gone", code="model_not_found"), 404, "model_not_found", None),
        (RequestTooLarge("big"), 413, "request_too_large", None),
        (RateLimited("slow down", retry_after_s=2.2), 429, "rate_limit_exceeded", "3"),
        (Overloaded("busy", "predicted_ttft", 0.2), 503, "overloaded", "1"),
        (QueueTimeout("late", retry_after_s=1.0), 503, "queue_timeout", "1"),
        (NoWorkerAvailable("none", retry_after_s=1.0), 503, "no_worker_available", "1"),
        (ShuttingDown("bye", retry_after_s=1.0), 503, "shutting_down", "1"),
        (UpstreamFailed("reset", transport=True), 503, "upstream_error", "1"),
        (UpstreamFailed("5xx", transport=False), 502, "upstream_error", "1"),
    ],
)
def test_each_domain_error_has_one_status_and_shape(
    error: GatewayError, status: int, code: str, retry_after: str | None
) -> None:
    assert http_status(error) == status
    api = to_api_error(error)
    body = api.body()["error"]
    assert (api.status, body["code"], body["message"]) == (status, code, error.message)
    assert body["param"] == error.param
    assert api.headers.get("Retry-After") == retry_after
