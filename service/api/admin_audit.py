"""The admin audit log: one ``admin_audit`` JSON line for every request to ``/admin`` (issue 31).

Each line says who (:func:`token_id` of the admin token, never the token; ``"invalid"`` for another
token, ``"none"`` without one), what (``action``: the route's name, e.g. ``revoke_key``; ``method`` and
``path``), on what (``target``: the route's path parameters, e.g. ``{"tenant_id": ...,
"key_id": ...}``, plus ``created``, the id a 201 answer names), the outcome (``status``, the HTTP status
answered), when (``timestamp``, ISO 8601 UTC, as every line; ``duration_ms``) and the request id. Refusals
count: a wrong token's 403, a body's 400, a missing tenant's 404 are each one line.

It is an ASGI middleware (:class:`AdminAuditLog`), so one line is written whatever answers: the route, a
dependency's refusal (admin token, body) or an error handler; and exactly one, once the app returns: with
the status it answered, 500 when it raised before answering, 499 when it was cancelled (the client left).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import orjson
import structlog
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.deps import bearer_token
from service.api.operator_access import is_operator_path
from tenancy.keys import tokens_equal

log = structlog.get_logger("radixgate.admin_audit")

_CREATED_BODY_MAX = 65_536
"""Largest 201 answer read back for the id it names, bytes (an admin answer is a few hundred)."""

_SHOWN = 200
"""Characters of a path parameter or an unmatched path written to the line at most."""


def token_id(token: str) -> str:
    """A token's id for logs: ``sha256:`` and the first 12 hex digits (48 bits) of its SHA-256 digest. It
    tells tokens apart (a rotated admin token gets a new id) and reveals nothing usable of a 16+ character
    secret."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()[:12]


def _created_id(body: bytes) -> str | None:
    """The id a 201 answer names (``key_id`` of an issued key, else ``id``), if it is JSON."""
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(answer, dict):
        return None
    found = answer.get("key_id", answer.get("id"))
    return str(found)[:_SHOWN] if found is not None else None


class AdminAuditLog:
    """ASGI middleware writing one ``admin_audit`` line per ``/admin`` request (module docstring).

    Args:
        app: the ASGI app it wraps (inside :class:`service.app.RequestIdMiddleware`, whose request id it
            logs).
        admin_token: the configured admin token (``Settings.admin_token``; empty: the admin API is off).
    """

    def __init__(self, app: ASGIApp, admin_token: str) -> None:
        self.app = app
        self.admin_token = admin_token
        self.admin_id = token_id(admin_token) if admin_token else None

    def who(self, scope: Scope) -> str:
        """The caller: the admin token's id, ``"invalid"`` (another token) or ``"none"`` (no token)."""
        token = bearer_token(Request(scope))
        if token is None:
            return "none"
        if self.admin_id is not None and tokens_equal(token, self.admin_token):
            return self.admin_id
        return "invalid"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_operator_path(scope["path"]) or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: int | None = None
        body = bytearray()

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif status == 201 and len(body) <= _CREATED_BODY_MAX:
                body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:  # answered 500 by the server-error middleware outside this one
            if status is None:
                status = 500
            raise
        finally:
            self._write(scope, status, bytes(body), time.perf_counter() - start)

    def _write(self, scope: Scope, status: int | None, body: bytes, elapsed_s: float) -> None:
        route = scope.get("route")
        target: dict[str, Any] = {k: str(v)[:_SHOWN] for k, v in (scope.get("path_params") or {}).items()}
        if status == 201 and (created := _created_id(body)) is not None:
            target["created"] = created
        state = scope.get("state") or {}
        log.info(
            "admin_audit",
            who=self.who(scope),
            action=getattr(route, "name", None) or "unmatched",
            method=scope["method"],
            path=scope["path"][:_SHOWN],
            target=target,
            status=status if status is not None else 499,
            duration_ms=round(elapsed_s * 1e3, 3),
            request_id=state.get("request_id"),
        )
