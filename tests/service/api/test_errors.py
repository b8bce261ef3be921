"""Domain errors (service/errors.py) map to status, Retry-After and OpenAI's shape in one place."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.api.errors import http_status, to_api_error, validation_error
from service.errors import (
    BudgetExhausted,
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
from service.protocol.completions import ChatCompletionRequest
from service.protocol.errors import error_type, sse_error_event


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
        (BudgetExhausted("spent", retry_after_s=3600), 429, "insufficient_quota", "3600"),
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
    # a spent budget does not come back by retrying: the openai client reads x-should-retry first
    assert api.headers.get("x-should-retry") == ("false" if isinstance(error, BudgetExhausted) else None)


def _every_error_class(kind: type[GatewayError] = GatewayError) -> set[type[GatewayError]]:
    return {kind}.union(*(_every_error_class(sub) for sub in kind.__subclasses__()))


STATUS_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}
STATUS_TYPE |= {404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}
STATUS_TYPE |= {500: "server_error", 502: "upstream_error", 503: "service_unavailable"}
OWN_TYPE = {BudgetExhausted: "insufficient_quota"}
"""Errors whose type is not their status's: OpenAI answers a spent quota with 429, insufficient_quota."""


@pytest.mark.parametrize("transport", [True, False])
def test_a_domain_error_s_type_without_http_matches_its_status(transport: bool) -> None:
    """The error type a started stream sends (service/protocol/errors.py, no status) is the type its status
    gives when refused before the stream (service/api/errors.py), for every domain error there is."""
    for kind in _every_error_class():
        if kind is UpstreamFailed:
            error: GatewayError = UpstreamFailed("x", transport=transport)
        elif kind is Overloaded:
            error = Overloaded("x", "queue_full", 1.0)
        else:
            error = kind("x")
        status = http_status(error)
        assert error_type(error) == OWN_TYPE.get(kind, STATUS_TYPE[status]), kind
        assert to_api_error(error).body()["error"]["type"] == error_type(error)
        assert sse_error_event(error) == to_api_error(error).sse_event()


_MSG = {"role": "user", "content": "x"}


@pytest.mark.parametrize(
    ("changes", "param", "code"),
    [
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "invalid_value"),
        (  # of the union's errors, the one that goes deepest into what was sent
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages.0.content.0.text",
            "invalid_value",
        ),
        ({"stop": [1]}, "stop.0", "invalid_value"),
        (
            {"tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function.name",
            "missing_required_parameter",
        ),
        ({"temperature": "hot"}, "temperature", "invalid_value"),
        ({"bogus": 1}, "bogus", "unknown_parameter"),
    ],
)
def test_validation_errors_name_the_parameter_sent_not_pydantic_s_union_member(
    changes: dict[str, object], param: str, code: str
) -> None:
    body = {"model": "m", "messages": [_MSG], **changes}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    err = validation_error(info.value, body).body()["error"]
    assert (err["param"], err["code"]) == (param, code)
    assert "str" not in err["param"].split(".") and "[" not in err["param"]
    assert param in err["message"]
