"""A caller's own request id (``X-Request-Id``), kept beside the gateway's.

The gateway gives every request an id of its own (:func:`service.api.deps.new_request_id`: SGLang's
``rid``, the settle's idempotency key, the ``request_id`` of its log lines). A caller may send its own in
``X-Request-Id``; when it is well formed (:func:`sanitized`) it is kept: echoed as the answer's
``x-request-id`` (streamed, not streamed, refused), logged as ``client_request_id`` beside ``request_id``,
and set on the request's span (``radixgate.client_request_id``), so an operator can follow a request from
the client's logs. The gateway's own id then comes back as ``x-radixgate-request-id``; without a caller's
id, ``x-request-id`` is the gateway's as before. A malformed one is dropped, never reflected (no header
or log injection, no unbounded value).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MAX_CLIENT_ID_CHARS = 128
"""The longest caller id kept, characters (a UUID is 36, a W3C trace id 32; OpenAI's ids stay under 64)."""

_SAFE = re.compile(rb"[A-Za-z0-9._~:/+=@-]{1,%d}" % MAX_CLIENT_ID_CHARS)
"""What a kept id may hold: letters, digits and ``._~:/+=@-`` (UUIDs, ULIDs, base64 and URL-safe base64,
``service:123``-style ids); no space, quote, comma, semicolon or control character."""

_HEADER = b"x-request-id"
GATEWAY_ID_HEADER = b"x-radixgate-request-id"
"""The answer's header that carries the gateway's own id when ``x-request-id`` echoes the caller's."""


def sanitized(value: bytes) -> str | None:
    """``value`` (a header's raw bytes) as a kept id, or None when it is empty, longer than
    :data:`MAX_CLIENT_ID_CHARS` or holds a character outside the safe set."""
    return value.decode("ascii") if _SAFE.fullmatch(value) else None


def client_request_id(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The caller's kept ``X-Request-Id`` from a request's ASGI ``headers`` (lowercase names; the first
    one when several came), or None."""
    for name, value in headers:
        if name == _HEADER:
            return sanitized(value)
    return None


def id_headers(gateway_id: str, client_id: str | None) -> list[tuple[bytes, bytes]]:
    """The answer's id headers: ``x-request-id`` (the caller's when kept, else the gateway's) and, with a
    caller's id, ``x-radixgate-request-id`` (the gateway's)."""
    if client_id is None:
        return [(_HEADER, gateway_id.encode())]
    return [(_HEADER, client_id.encode()), (GATEWAY_ID_HEADER, gateway_id.encode())]


__all__ = ["GATEWAY_ID_HEADER", "MAX_CLIENT_ID_CHARS", "client_request_id", "id_headers", "sanitized"]
