"""Per-tenant quota buckets in virtual time: what ``tenancy/token_bucket.lua`` does in Redis, in memory.

The gateway takes 1 request and ``prompt + max_tokens`` tokens from a tenant's two buckets in one atomic
Lua call, all or nothing, refunds a request that is shed, expires or fails, and reconciles a finished one
with its real usage (``tenancy.quota.QuotaLimiter``). The arithmetic is ``policies.token_bucket``'s
(:func:`~policies.token_bucket.try_take`, :func:`~policies.token_bucket.adjust`), which the Lua script
mirrors; times here are virtual seconds, converted to the module's milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loadgen.fleet.config import TenantSpec
from policies.token_bucket import BucketLimit, BucketState, adjust, full_bucket, refill, wait_ms_for


@dataclass(frozen=True, slots=True)
class QuotaVerdict:
    """Outcome of :meth:`TenantBuckets.reserve`.

    Attributes:
        allowed: both buckets were debited.
        never: the cost exceeds a bucket's burst (the gateway answers 413).
        retry_after_s: when refused, seconds until the slowest bucket holds enough (``inf`` when never).
    """

    allowed: bool
    never: bool
    retry_after_s: float


class TenantBuckets:
    """All tenants' request and token buckets (created full on first use, as the Lua script does)."""

    def __init__(self) -> None:
        self._states: dict[tuple[str, str], BucketState] = {}

    def _buckets(
        self, spec: TenantSpec, requests: float, tokens: float
    ) -> list[tuple[str, BucketLimit, float]]:
        out: list[tuple[str, BucketLimit, float]] = []
        if (req_limit := spec.request_limit()) is not None:
            out.append(("requests", req_limit, requests))
        if (tok_limit := spec.token_limit()) is not None:
            out.append(("tokens", tok_limit, tokens))
        return out

    def _state(self, tenant: str, name: str, limit: BucketLimit, now_ms: float) -> BucketState:
        key = (tenant, name)
        if key not in self._states:
            self._states[key] = full_bucket(limit, now_ms)
        return self._states[key]

    def reserve(self, spec: TenantSpec, tokens: float, now_s: float) -> QuotaVerdict:
        """Take 1 request and ``tokens`` tokens at ``now_s`` from both buckets, or from neither."""
        now_ms = now_s * 1000.0
        buckets = self._buckets(spec, 1.0, tokens)
        refilled = []
        worst = 0.0
        for name, limit, amount in buckets:
            state = refill(self._state(spec.id, name, limit, now_ms), limit, now_ms)
            wait = wait_ms_for(state.level, amount, limit)
            if math.isinf(wait):
                return QuotaVerdict(False, True, math.inf)
            worst = max(worst, wait)
            refilled.append((name, state, amount))
        if worst > 0:
            return QuotaVerdict(False, False, worst / 1000.0)
        for name, state, amount in refilled:
            self._states[(spec.id, name)] = BucketState(state.level - amount, state.updated_ms)
        return QuotaVerdict(True, False, 0.0)

    def give_back(self, spec: TenantSpec, requests: float, tokens: float, now_s: float) -> None:
        """Add units back (refund > 0) or charge them (< 0), capped at +/- one burst (``adjust``)."""
        now_ms = now_s * 1000.0
        for name, limit, amount in self._buckets(spec, requests, tokens):
            if amount != 0:
                state = self._state(spec.id, name, limit, now_ms)
                self._states[(spec.id, name)] = adjust(state, limit, amount, now_ms)
