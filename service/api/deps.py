"""FastAPI dependencies (Annotated): app state, tenant authentication, admin authentication, raw body."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

from fastapi import Depends, Request

from service.api.errors import APIError
from service.state import GatewayState
from tenancy.keys import tokens_equal
from tenancy.models import Tenant


def get_state(request: Request) -> GatewayState:
    """The replica's :class:`GatewayState` (set by the lifespan)."""
    state: GatewayState = request.app.state.radixgate
    return state


StateDep = Annotated[GatewayState, Depends(get_state)]


def bearer_token(request: Request) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (or of an ``api-key`` header), if any."""
    header = request.headers.get("authorization")
    if header:
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return request.headers.get("api-key") or None


async def authenticated_tenant(request: Request, state: StateDep) -> Tenant:
    """Resolve the caller's API key to an enabled tenant.

    Raises:
        APIError: 401 missing/unknown/revoked key; 403 disabled tenant.
    """
    token = bearer_token(request)
    if token is None:
        raise APIError(
            401, "You didn't provide an API key. Send 'Authorization: Bearer <key>'.", code="missing_api_key"
        )
    tenant = await state.tenants.authenticate(token)
    if tenant is None:
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    if not tenant.enabled:
        raise APIError(403, f"Tenant '{tenant.id}' is disabled.", code="tenant_disabled")
    request.state.tenant_id = tenant.id
    return tenant


TenantDep = Annotated[Tenant, Depends(authenticated_tenant)]


def require_admin(request: Request, state: StateDep) -> None:
    """Allow only the admin token (constant-time comparison).

    Raises:
        APIError: 401 no token; 403 any other token, or the admin API is off (no token configured).
    """
    token = bearer_token(request)
    if token is None:
        raise APIError(
            401, "Admin routes need 'Authorization: Bearer <admin token>'.", code="missing_api_key"
        )
    expected = state.settings.admin_token.get_secret_value()
    if not expected:
        raise APIError(403, "The admin API is disabled (no admin token configured).", code="admin_disabled")
    if not tokens_equal(token, expected):
        raise APIError(403, "This token may not use the admin API.", code="admin_required")


AdminDep = Depends(require_admin)


def _not_json(constant: str) -> Any:
    """``NaN``/``Infinity``, which Python's json module accepts but JSON (RFC 8259) does not."""
    raise ValueError(f"{constant} is not JSON")


async def json_body(request: Request, state: StateDep) -> dict[str, Any]:
    """Read and decode the JSON body, at most ``api.max_body_bytes``.

    Raises:
        APIError: 413 body too large; 400 not JSON (also ``NaN``/``Infinity``) or not an object.
    """
    limit = state.settings.api.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"Request body is larger than {limit} bytes.", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"Request body is larger than {limit} bytes.", code="request_too_large")
        chunks.append(chunk)
    try:
        payload = json.loads(b"".join(chunks), parse_constant=_not_json)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise APIError(
            400,
            "We could not parse the JSON body of your request. (HINT: send valid JSON.)",
            code="invalid_json",
        ) from exc
    if not isinstance(payload, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    return payload


JsonBody = Annotated[dict[str, Any], Depends(json_body)]


def request_id(request: Request) -> str:
    """This request's id (set by the request-id middleware; a fresh one otherwise)."""
    rid = getattr(request.state, "request_id", None)
    return rid if isinstance(rid, str) else uuid.uuid4().hex
