"""What a deleted tenant leaves in Redis: every key matching a pattern but the per-call markers, which carry
the tenant's hash tag (so they live in its slot) and expire by themselves within seconds to minutes
(``once:`` and ``settled:``, :mod:`tenancy.layout`); a marker without an expiry counts as left."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

MARKERS = (":once:", ":settled:")


def _marker(name: str) -> bool:
    return any(m in name for m in MARKERS)


def lasting(client: redis.Redis, pattern: str) -> list[str]:
    """The keys matching ``pattern`` (SCAN) but expiring markers."""
    names = [
        k.decode() if isinstance(k, bytes) else str(k) for k in client.scan_iter(match=pattern, count=1000)
    ]
    return [n for n in names if not (_marker(n) and int(client.ttl(n)) > 0)]


async def lasting_async(client: aioredis.Redis, pattern: str) -> list[str]:
    """:func:`lasting` with an async client."""
    names = [k.decode() if isinstance(k, bytes) else str(k) async for k in client.scan_iter(match=pattern)]
    return [n for n in names if not (_marker(n) and int(await client.ttl(n)) > 0)]
