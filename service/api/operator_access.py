"""Who may see the operator endpoints: ``/metrics`` (tenant ids in its labels), ``/admin/*`` and the detail of
``/readyz`` (worker URLs, Redis), settings ``security.*`` (:class:`service.config.security.SecuritySettings`).

With ``security.operator_port`` set the gateway listens on a second port (``python -m service serve`` binds
both: :func:`service.runtime.host_serve.operator_socket`), and :class:`OperatorPorts` sorts each request by
the port it came in on (the ASGI scope's ``server``): the operator paths answer 404 on the API port, and every
path but the operator ones, ``/healthz`` and ``/readyz`` answers 404 on the operator port (no completions
there), and ``/readyz``'s detail answers there only. Without it, every path answers on the API port, and
``/readyz``'s detail goes to a request that carries the admin token or the metrics token (compared in
constant time). With ``security.metrics_token`` set, ``/metrics`` asks for it (or the admin token) on
whichever port serves it.
"""

from __future__ import annotations

from fastapi import Request
from starlette.types import Receive, Scope, Send

from service.api.deps import bearer_token
from service.api.errors import APIError, error_response
from service.config.settings import Settings
from tenancy.keys import tokens_equal

BOTH_PORTS = frozenset({"/healthz", "/readyz"})
"""Paths every port answers (``/readyz`` with its detail only on the operator port)."""


def is_operator_path(path: str) -> bool:
    """``path`` is ``/metrics`` or under ``/admin``."""
    return path == "/metrics" or path == "/admin" or path.startswith("/admin/")


class OperatorPorts:
    """Sorts requests between the API port and the operator port (``security.operator_port``).

    Args:
        operator_port: the operator port (TCP port number).
    """

    def __init__(self, operator_port: int) -> None:
        self.operator_port = operator_port

    def on_operator_port(self, scope: Scope) -> bool:
        """The request came in on the operator port (its scope's ``server`` port)."""
        server = scope.get("server")
        return server is not None and server[1] == self.operator_port

    def allowed(self, scope: Scope) -> bool:
        """The request's path answers on the port it came in on."""
        path = scope["path"]
        if path in BOTH_PORTS:
            return True
        return is_operator_path(path) == self.on_operator_port(scope)

    async def refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        """404 ``not_found`` in OpenAI's shape (as any unknown path: the port does not reveal what the other
        one serves)."""
        err = APIError(404, "Not Found", code="not_found")
        await error_response(err)(scope, receive, send)


def operator_ports(settings: Settings) -> OperatorPorts | None:
    """The :class:`OperatorPorts` of ``settings`` (None without ``security.operator_port``)."""
    port = settings.security.operator_port
    return None if port is None else OperatorPorts(port)


def operator_token(request: Request, settings: Settings) -> bool:
    """The request's bearer token is the admin token or ``security.metrics_token`` (constant-time
    comparisons, both made whatever the first gives: the time does not tell which one matched)."""
    token = bearer_token(request)
    if token is None:
        return False
    known = [settings.admin_token.get_secret_value(), settings.security.metrics_token.get_secret_value()]
    matches = [tokens_equal(token, secret) for secret in known if secret]
    return any(matches)


def operator_request(request: Request, settings: Settings) -> bool:
    """The request may see ``/readyz``'s detail: with ``security.operator_port`` set, it came in on that port
    (the detail answers there only, as every operator endpoint); without, it carries the admin token or
    the metrics token (:func:`operator_token`)."""
    port = settings.security.operator_port
    if port is not None:
        return OperatorPorts(port).on_operator_port(request.scope)
    return operator_token(request, settings)


def require_metrics_access(request: Request, settings: Settings) -> None:
    """``/metrics``'s check: with ``security.metrics_token`` set, only a request with that token or the admin
    token passes, on whichever port serves ``/metrics``.

    Raises:
        APIError: 401 no bearer token; 403 a token that is neither the metrics nor the admin token.
    """
    if not settings.security.metrics_token.get_secret_value() or operator_token(request, settings):
        return
    if bearer_token(request) is None:
        raise APIError(401, "/metrics needs 'Authorization: Bearer <metrics token>'.", code="missing_api_key")
    raise APIError(403, "This token may not read /metrics.", code="metrics_token_required")
