"""The bad-key throttle: a client address that keeps presenting unknown API keys is answered 429 before each
guess costs a Redis read (settings ``security.bad_key_*``, :class:`service.config.security.SecuritySettings`).

Each address that has failed gets a token bucket (:mod:`policies.token_bucket`, the arithmetic the quotas use)
of ``bad_key_burst`` units refilled at ``bad_key_rate_per_s``; every unknown, revoked or malformed key (401
``invalid_api_key``) and every wrong admin token (403 ``admin_required``) takes one unit. While its bucket
holds less than one, a request from that address with any key is answered 429 ``too_many_bad_keys`` with
``Retry-After`` before its key is looked up: a guesser gets ``burst`` guesses, then ``rate`` per second. A
valid key from the same address is refused too while the bucket is empty (the gateway cannot know it is valid
without the lookup), so the address is the client's own: the TCP peer, or, behind a proxy,
``security.client_address_header``. The buckets live in the process's memory (at most ``bad_key_addresses``,
least recently failed dropped first); several processes or replicas each allow a burst.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.requests import Request

from policies.token_bucket import BucketLimit, BucketState, full_bucket, refill, try_take
from service.api.errors import APIError
from service.config.security import SecuritySettings


class BadKeyThrottle:
    """Per-address token buckets of bad-key attempts (module docstring).

    Args:
        settings: ``security.*`` (rate, burst, addresses, the address header).
        clock: monotonic time, s (injected for tests).
    """

    def __init__(self, settings: SecuritySettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = settings.bad_key_rate_per_s > 0
        self._limit = BucketLimit(
            rate_per_min=max(settings.bad_key_rate_per_s, 1e-9) * 60, capacity=settings.bad_key_burst
        )
        self._max_addresses = settings.bad_key_addresses
        self._header = settings.client_address_header.lower()
        self._clock = clock
        self._buckets: OrderedDict[str, BucketState] = OrderedDict()

    def address(self, request: Request) -> str:
        """The client's address: ``client_address_header``'s value (its last comma-separated entry) when
        set and present, else the TCP peer's host (``"unknown"`` without one)."""
        if self._header:
            value = request.headers.get(self._header)
            if value:
                return value.rsplit(",", 1)[-1].strip()[:64]
        client = request.client
        return client.host if client is not None else "unknown"

    def check(self, request: Request) -> None:
        """Refuse a request from an address whose bucket is spent, before its key is looked up.

        Raises:
            APIError: 429 ``too_many_bad_keys`` with ``Retry-After`` (whole s until one more attempt).
        """
        if not self.enabled or not self._buckets:
            return
        state = self._buckets.get(self.address(request))
        if state is None:
            return
        current = refill(state, self._limit, self._clock() * 1e3)
        if current.level >= 1:
            return
        wait_s = (1 - current.level) / (self._limit.rate_per_min / 60)
        raise APIError(
            429,
            "Too many requests with an invalid API key from this address; retry later.",
            code="too_many_bad_keys",
            headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
        )

    def failed(self, request: Request) -> None:
        """Count one bad key (or admin token) from the request's address."""
        if not self.enabled:
            return
        address = self.address(request)
        now_ms = self._clock() * 1e3
        state = self._buckets.pop(address, None) or full_bucket(self._limit, now_ms)
        self._buckets[address] = try_take(state, self._limit, 1, now_ms).state  # most recent last
        if len(self._buckets) > self._max_addresses:
            self._buckets.popitem(last=False)

    def __len__(self) -> int:
        """Addresses with a bucket."""
        return len(self._buckets)


def bad_key_throttle(request: Request) -> BadKeyThrottle:
    """The app's :class:`BadKeyThrottle` (made by :func:`service.app.create_app`)."""
    throttle: BadKeyThrottle = request.app.state.bad_keys
    return throttle
