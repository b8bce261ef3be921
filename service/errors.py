"""Domain errors of the request path: what went wrong, in the gateway's terms, with no HTTP in them.

Everything below ``service/api/`` raises these; only :mod:`service.api.errors` maps them to an HTTP status,
headers (``Retry-After``) and OpenAI's error shape. Each carries a machine-readable ``code`` (OpenAI's
``error.code``), the offending request field (``param``) when there is one, and, for the retryable ones,
``retry_after_s`` (seconds). A refusal by a token bucket also carries what the client is told of its rate
limits (:class:`LimitState`, per kind) and which bucket refused (``details``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple


class LimitState(NamedTuple):
    """One kind of rate limit (requests or tokens) as a client is told it, for the bucket of that kind
    closest to empty (OpenAI's ``x-ratelimit-*`` headers; a named tuple, made for every answer).

    Attributes:
        limit: units the bucket holds full (its burst).
        remaining: whole units left now.
        reset_s: seconds until it is full again.
    """

    limit: float
    remaining: int
    reset_s: float


class GatewayError(Exception):
    """Base of the domain errors.

    Args:
        message: human-readable explanation (never contains prompt text or key material).
        code: machine-readable code, e.g. ``"overloaded"``.
        param: the offending request field, if any.
        retry_after_s: when a retry may succeed, s (None: retrying the same request will not help).

    Attributes:
        rate_limits: ``"requests"``/``"tokens"`` -> :class:`LimitState`, when a token bucket refused it
            (answered as OpenAI's rate-limit headers); None otherwise.
        details: more fields of the error object (e.g. ``quota``: the bucket that refused), or None.
    """

    default_code = "error"
    rate_limits: Mapping[str, LimitState] | None = None
    details: Mapping[str, Any] | None = None

    def __init__(
        self,
        message: str,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param
        self.retry_after_s = retry_after_s


class InvalidRequest(GatewayError):
    """The request cannot be served as sent (bad value, too long for the context, unserved feature)."""

    default_code = "invalid_request"


class NotFound(GatewayError):
    """Something the request names does not exist (a model)."""

    default_code = "not_found"


class Unauthenticated(GatewayError):
    """The API key does not (or no longer) identify a tenant."""

    default_code = "invalid_api_key"


class PermissionDenied(GatewayError):
    """The tenant may not do this (model or priority class not allowed)."""

    default_code = "permission_denied"


class RateLimited(GatewayError):
    """A tenant's token bucket is short (RPM or TPM); ``retry_after_s`` says when it refills enough."""

    default_code = "rate_limit_exceeded"


class BudgetExhausted(RateLimited):
    """A budget's hard limit would be passed by the request's worst-case cost: OpenAI's 429
    ``insufficient_quota`` (error type ``insufficient_quota`` too). Retrying does not help before the budget's
    period ends (``retry_after_s``), so the answer tells clients not to retry (``x-should-retry: false``)."""

    default_code = "insufficient_quota"


class RequestTooLarge(GatewayError):
    """The request is larger than a bucket's burst (or a body limit) and can never pass."""

    default_code = "request_too_large"


class Overloaded(GatewayError):
    """Shed by admission control: predicted to miss its TTFT goal, queue full, or evicted by a higher band.

    Attributes:
        reason: the admission core's reason (``policies.admission_types.ShedReason``).
        predicted_ttft_s: the predicted TTFT that refused it, s (None for the other reasons).
    """

    default_code = "overloaded"

    def __init__(
        self, message: str, reason: str, retry_after_s: float, predicted_ttft_s: float | None = None
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.reason = reason
        self.predicted_ttft_s = predicted_ttft_s


class QueueTimeout(GatewayError):
    """Waited in the gateway's queue until its deadline passed; never reached a worker.

    Attributes:
        waited_s: how long it waited, s (None: not known).
        predicted_ttft_s: the TTFT predicted at its admission, s (None: not known).
    """

    default_code = "queue_timeout"

    def __init__(
        self,
        message: str,
        retry_after_s: float | None = None,
        waited_s: float | None = None,
        predicted_ttft_s: float | None = None,
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.waited_s = waited_s
        self.predicted_ttft_s = predicted_ttft_s


class FirstTokenTimeout(GatewayError):
    """Dispatched, but no first token came by its first-token deadline (its class's goal times
    ``scheduler.first_token_deadline_factor``): its worker request was ended, nothing was charged."""

    default_code = "first_token_timeout"


class NoWorkerAvailable(GatewayError):
    """No healthy worker can take the request now."""

    default_code = "no_worker_available"


class UpstreamFailed(GatewayError):
    """The workers failed the request (attempts spent).

    Attributes:
        transport: True when no HTTP answer came (connection refused, reset, timeout); False for a 5xx.
    """

    default_code = "upstream_error"

    def __init__(self, message: str, transport: bool, code: str | None = None) -> None:
        super().__init__(message, code=code, retry_after_s=1.0)
        self.transport = transport


class UpstreamRejected(GatewayError):
    """A worker refused the request's input (its 4xx)."""

    default_code = "upstream_rejected"


class ShuttingDown(GatewayError):
    """The replica is stopping; the request was not served."""

    default_code = "shutting_down"
