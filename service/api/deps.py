"""Request helpers and FastAPI dependencies (Annotated): app state, tenant authentication, admin
authentication, raw body.

Every dependency is ``async``: FastAPI runs a plain ``def`` dependency on a worker thread, a thread-pool
hop per request (issue 10). The completion routes call the helpers directly (no dependency solving);
the other routes use them through the ``...Dep`` aliases.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from datetime import UTC, datetime
from typing import Annotated, Any

import orjson
from fastapi import Depends, Request

from service.api.body_encoding import body_decoder
from service.api.errors import APIError
from service.api.key_guessing import bad_key_throttle
from service.pipeline.outage import OutageMode
from service.protocol.limits import MAX_JSON_DEPTH, nested_deeper_than
from service.state import GatewayState
from tenancy.errors import StoreUnavailable
from tenancy.keys import tokens_equal
from tenancy.models import ApiKeyRecord, Tenant


def gateway_state(request: Request) -> GatewayState:
    """The replica's :class:`GatewayState` (set by the lifespan)."""
    state: GatewayState = request.app.state.radixgate
    return state


async def get_state(request: Request) -> GatewayState:
    """:func:`gateway_state` as a dependency."""
    return gateway_state(request)


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


async def authenticate(request: Request, state: GatewayState) -> Tenant:
    """Resolve the caller's API key to an enabled tenant (its id, the key's id and the key's record are
    left in the request's scope state as ``tenant_id``, ``key_id`` and ``api_key``).

    Raises:
        APIError: 401 missing/unknown/revoked key, or ``expired_api_key`` past the key's ``expires_at``
            (unix time of this replica's clock); 403 disabled tenant; 429 ``too_many_bad_keys`` from an
            address that presented too many bad keys (:mod:`service.api.key_guessing`).
        StoreUnavailable: Redis is exhausted, slow or unreachable (under ``redis.on_outage = open``: and
            the key was not authenticated on this replica within ``redis.outage_auth_stale_s``).
    """
    token = bearer_token(request)
    if token is None:
        raise APIError(
            401, "You didn't provide an API key. Send 'Authorization: Bearer <key>'.", code="missing_api_key"
        )
    throttle = bad_key_throttle(request)
    throttle.check(request)  # an address that keeps guessing: 429 before the lookup costs a Redis read
    outage = state.outage  # None under redis.on_outage = closed
    found: tuple[Tenant, ApiKeyRecord] | None
    if outage is None:
        found = await state.tenants.authenticate_key(token)
    else:
        found = await _authenticate_open(outage, state, token)
    if found is None:
        throttle.failed(request)
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    tenant, record = found
    if record.expires_at is not None and record.expired(time.time()):
        raise APIError(
            401,
            f"The API key rg-{record.key_id} expired at {_utc(record.expires_at)}; ask for a new one.",
            code="expired_api_key",
        )
    scope_state = request.scope.setdefault("state", {})
    scope_state["tenant_id"] = tenant.id  # for the log of a refusal
    scope_state["key_id"] = record.key_id  # service.pipeline.revocation
    # the key's terms (models, quotas, concurrency cap): service.api.openai_routes
    scope_state["api_key"] = record
    if not tenant.enabled:
        raise APIError(403, f"Tenant '{tenant.id}' is disabled.", code="tenant_disabled")
    return tenant


async def _authenticate_open(
    outage: OutageMode, state: GatewayState, token: str
) -> tuple[Tenant, ApiKeyRecord] | None:
    """Authentication under ``redis.on_outage = open`` (:mod:`service.pipeline.outage`): from Redis (what
    it answers is remembered) until it cannot be reached, then from this replica's memory of the keys it
    authenticated recently, without asking Redis until it is back.

    Raises:
        StoreUnavailable: Redis is out of reach and the key is not known here.
    """
    if outage.active:
        return outage.authenticate(token)
    try:
        found = await state.tenants.authenticate_key(token)
    except StoreUnavailable as exc:
        outage.enter(exc)
        return outage.authenticate(token)
    if found is None:
        outage.refused_by_redis(token)
        return None
    outage.remember(token, found.tenant, found.key)
    return found


def _utc(unix_s: float) -> str:
    """``unix_s`` as an RFC 3339 UTC date-time, to the second."""
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def authenticated_tenant(request: Request, state: StateDep) -> Tenant:
    """:func:`authenticate` as a dependency."""
    return await authenticate(request, state)


TenantDep = Annotated[Tenant, Depends(authenticated_tenant)]


async def require_admin(request: Request, state: StateDep) -> None:
    """Allow only the admin token (constant-time comparison).

    Raises:
        APIError: 401 no token; 403 any other token, or the admin API is off (no token configured); 429
            ``too_many_bad_keys`` (:mod:`service.api.key_guessing`).
    """
    token = bearer_token(request)
    if token is None:
        raise APIError(
            401, "Admin routes need 'Authorization: Bearer <admin token>'.", code="missing_api_key"
        )
    expected = state.settings.admin_token.get_secret_value()
    if not expected:
        raise APIError(403, "The admin API is disabled (no admin token configured).", code="admin_disabled")
    throttle = bad_key_throttle(request)
    throttle.check(request)
    if not tokens_equal(token, expected):
        throttle.failed(request)
        raise APIError(403, "This token may not use the admin API.", code="admin_required")


AdminDep = Depends(require_admin)


def _not_json(constant: str) -> Any:
    """``NaN``/``Infinity``, which Python's json module accepts but JSON (RFC 8259) does not."""
    raise ValueError(f"{constant} is not JSON")


_LONG_NUMBER = re.compile(rb"\d{19}")
"""A run of 19+ digits: an integer orjson may turn into a float (outside int64/uint64) where Python's
json keeps it exact."""


def decode_json(raw: bytes) -> Any:
    """Decode a request body exactly as ``json.loads(raw, parse_constant=<refuse NaN/Infinity>)`` does:
    with orjson where it gives the same result (most bodies), Python's json otherwise (orjson refuses the
    body, or it holds a digit run long enough to be an integer orjson would round).

    Raises:
        ValueError, UnicodeDecodeError, RecursionError: not JSON.
    """
    if _LONG_NUMBER.search(raw) is None:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw, parse_constant=_not_json)


async def read_json(request: Request, limit: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """Read and decode the JSON body, at most ``limit`` bytes within ``timeout_s`` seconds
    (:func:`read_body`, then :func:`json_object`).

    Raises:
        APIError: 413 body too large; 408 the body did not arrive in time (a slow or stalled sender, e.g. a
            Content-Length larger than what it sends, would otherwise hold a connection and a task);
            400 not JSON (also ``NaN``/``Infinity``) or not an object.
    """
    return json_object(await read_body(request, limit, timeout_s))


async def read_body(request: Request, limit: int, timeout_s: float = 10.0) -> bytes:
    """The request body, decoded by its ``Content-Encoding`` (:mod:`service.api.body_encoding`: gzip,
    deflate, identity), at most ``limit`` bytes as sent and once decoded, within ``timeout_s`` seconds.

    Raises:
        APIError: 415 an unsupported ``Content-Encoding`` (before any of the body is read); 413 body too
            large, as sent or decoded (decoding stops at ``limit + 1`` bytes); 400 a body that is not
            valid data of its coding; 408 the body did not arrive in time.
    """
    encodings = request.headers.getlist("content-encoding")
    decoder = body_decoder(encodings, limit) if encodings else None
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"Request body is larger than {limit} bytes.", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(
                        413, f"Request body is larger than {limit} bytes.", code="request_too_large"
                    )
                chunks.append(chunk if decoder is None else decoder.feed(chunk))
            if decoder is not None:
                chunks.append(decoder.finish())
    except TimeoutError:
        raise APIError(
            408,
            f"The request body did not arrive within {timeout_s:g} s ({size} bytes received).",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def json_object(raw: bytes) -> dict[str, Any]:
    """A body decoded as a JSON object (:func:`decode_json`).

    Raises:
        APIError: 400 not JSON (also ``NaN``/``Infinity``), not an object, or nested deeper than
            :data:`service.protocol.limits.MAX_JSON_DEPTH` levels.
    """
    try:
        payload = decode_json(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise APIError(
            400,
            "We could not parse the JSON body of your request. (HINT: send valid JSON.)",
            code="invalid_json",
        ) from exc
    if not isinstance(payload, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    if nested_deeper_than(payload, MAX_JSON_DEPTH, raw.count(b"{") + raw.count(b"[")):
        raise APIError(400, f"The JSON body nests deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json")
    return payload


async def json_body(request: Request, state: StateDep) -> dict[str, Any]:
    """:func:`read_json` bounded by ``api.max_body_bytes``, as a dependency."""
    api = state.settings.api
    return await read_json(request, api.max_body_bytes, api.body_timeout_s)


JsonBody = Annotated[dict[str, Any], Depends(json_body)]


def new_request_id() -> str:
    """A fresh request id: 32 random hex characters (128 bits)."""
    return os.urandom(16).hex()


def request_id(request: Request) -> str:
    """This request's id (set where the request entered the app; a fresh one otherwise)."""
    rid = request.scope.get("state", {}).get("request_id")
    return rid if isinstance(rid, str) else new_request_id()
