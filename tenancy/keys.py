"""API-key format, generation and hashing (no I/O).

A key looks like ``rg-<key_id>.<secret>``: ``key_id`` is 12 lowercase hex characters (the lookup handle,
safe to log and show), ``secret`` is 32 random bytes in URL-safe base64 (256 bits of entropy, from
:mod:`secrets`). Only ``HMAC-SHA256(pepper, key)`` is stored; because the secret is high-entropy a fast
hash is appropriate (no password KDF needed), and the server-side pepper makes a leaked Redis dump useless
for offline guessing. Comparison uses :func:`hmac.compare_digest` (constant time).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

KEY_PREFIX = "rg-"
_KEY_PATTERN = re.compile(r"^rg-([0-9a-f]{12})\.([A-Za-z0-9_-]{43})$")


@dataclass(frozen=True, slots=True)
class ParsedKey:
    """A syntactically valid API key split into its lookup id and the full string."""

    key_id: str
    full: str


def generate_key() -> ParsedKey:
    """Return a new random API key (``rg-<12 hex>.<43 base64url chars>``)."""
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return ParsedKey(key_id=key_id, full=f"{KEY_PREFIX}{key_id}.{secret}")


def parse_key(raw: str) -> ParsedKey | None:
    """Split a presented key; ``None`` if it is not in radixgate's format."""
    match = _KEY_PATTERN.match(raw.strip())
    if match is None:
        return None
    return ParsedKey(key_id=match.group(1), full=match.group(0))


def key_digest(full_key: str, pepper: bytes) -> str:
    """Hex HMAC-SHA256 of the whole key under the server's pepper (what Redis stores)."""
    return hmac.new(pepper, full_key.encode(), hashlib.sha256).hexdigest()


def digest_matches(full_key: str, stored_digest: str, pepper: bytes) -> bool:
    """Constant-time check of a presented key against a stored digest."""
    return hmac.compare_digest(key_digest(full_key, pepper), stored_digest)


def tokens_equal(presented: str, expected: str) -> bool:
    """Constant-time comparison of two secrets (e.g. the admin token); False if either is empty."""
    if not presented or not expected:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())
