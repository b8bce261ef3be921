"""Per-tenant RPM/TPM token buckets in Redis, taken atomically by one Lua script (EVALSHA).

One admission = one round trip: the request bucket (cost 1) and the token bucket (cost = prompt tokens +
max_tokens) are checked and debited together or not at all, so many gateway replicas sharing Redis never
over-admit. Time comes from the Redis server's clock unless a test passes ``now_ms``.
The arithmetic mirrors :mod:`policies.token_bucket`.

A request may also take from buckets of narrower scopes (:class:`Scope`): its API key's own and its
tenant's for its model. They go into the same script call, in the order key, model, tenant: all are
debited or none, the refusal names the first one short, and a settle gives back to (or charges) each
bucket it took from.

Given the tenant's ``epoch``, the script first checks that the tenant record still exists with that epoch
and writes nothing otherwise (:mod:`tenancy.layout`), so a request racing the tenant's deletion cannot
leave a bucket behind, nor charge or refund a re-created tenant of the same id.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from policies.billing_periods import DAY_S, day_end_s, parse_day
from policies.pricing import FREE, ModelPrice
from policies.rate_limits import BucketLevel
from tenancy.billing import (
    COST_FIELD,
    ROW_COUNTERS,
    BudgetHold,
    BudgetRefusal,
    UsageRow,
    settle_tail,
    take_tail,
)
from tenancy.concurrency import HeldSlot
from tenancy.errors import CallObserver, TenantNotFoundError, timed_call, untimed_store_operation
from tenancy.layout import BucketName, KeyLayout, ScopeKind, lua
from tenancy.models import USAGE_FIELDS, BucketLimits, Quotas
from tenancy.redis_client import RedisClient
from tenancy.script_batch import ScriptBatcher

ONCE_TTL_MS = 10_000
"""How long a reservation's reply is kept for a call sent again, ms: past redis-py's one immediate retry of
a call whose reply was cut (each try bounded by ``redis.socket_timeout_s``, 2 s), with room."""


@dataclass(frozen=True, slots=True)
class Scope:
    """Buckets beyond a tenant's own that a request takes from.

    Attributes:
        kind: ``"key"`` (an API key's own buckets) or ``"model"`` (the tenant's for one model).
        name: the key id or the model id.
        limits: their rates and bursts (a bucket without a rate is not taken from).
    """

    kind: ScopeKind
    name: str
    limits: BucketLimits

    def describe(self) -> str:
        """How an error names it: ``API key 'rg-<id>'`` or ``model '<id>'``."""
        return f"API key 'rg-{self.name}'" if self.kind == "key" else f"model '{self.name}'"


class _Bucket(NamedTuple):
    """One bucket of a script call: whose (scope kind and name), which, its Redis key, terms and amount."""

    scope: ScopeKind
    name: str
    bucket: BucketName
    key: str
    rate: float
    cap: float
    amount: float


@dataclass(slots=True)
class QuotaDecision:
    """Outcome of :meth:`QuotaLimiter.reserve` (read, never changed: not frozen only because one is made for
    every admission from a lease, and a frozen dataclass of these fields takes three times as long to make).

    Attributes:
        allowed: the reservation was taken from every bucket.
        never: the request is larger than a bucket's burst and can never pass (``limiting`` says which).
        retry_after_s: when refused (and not ``never``), seconds until the slowest bucket holds enough.
        limiting: the bucket that refused, if any.
        remaining: bucket name -> level after the call (units; requests or tokens).
        granted: bucket name -> units leased beyond the request's own (``lease`` given and allowed;
            see :mod:`policies.quota_lease`).
        leased: admitted from a local lease, or a lease was taken with it
            (:class:`tenancy.quota_lease.LeasedQuota`): the tenant's bucket had at least a lease's
            headroom.
        scope: whose bucket refused (``limiting``): None for the tenant's own, else the key's or the
            model's (:class:`Scope`).
        levels: every bucket the call touched, as it left them (refused: as they were), with its terms;
            what the rate-limit headers are made from (:mod:`policies.rate_limits`).
        budget: the budget whose hard limit refused it (checked before the buckets), if one did.
    """

    allowed: bool
    never: bool
    retry_after_s: float
    limiting: BucketName | None
    remaining: dict[str, float]
    granted: dict[str, int] | None = None
    leased: bool = False
    scope: Scope | None = None
    levels: tuple[BucketLevel, ...] = ()
    budget: BudgetRefusal | None = None


@dataclass(frozen=True, slots=True)
class Reservation:
    """What was taken for one request, to be reconciled or refunded later.

    ``linger``: its settle may wait ``settle_linger_s`` to share a Redis write with others. Set for
    requests admitted under a lease (:attr:`QuotaDecision.leased`): their tenant's bucket had a lease's
    headroom, so a refund that lands 2 ms later does not refuse the tenant's next request on another
    replica. Small quotas, which lease nothing, settle at once.

    ``scopes``: the key's and model's buckets it also took from (:class:`Scope`); its settle gives back
    to (or charges) them as it does the tenant's.

    ``slot``: the request's concurrency slot (:mod:`tenancy.concurrency`), taken before the buckets and
    released when the request ends; None when no cap applies.

    ``budgets``: the budgets it took its worst-case cost from (:class:`tenancy.billing.BudgetHold`); its
    settle brings each down to the real cost. ``price``: its model's price when it was admitted, which its
    cost is reckoned at.

    ``local``: admitted from this replica's own buckets while Redis was out of reach
    (``redis.on_outage = open``, :mod:`service.pipeline.outage`): nothing was taken in Redis, so its settle
    goes to the outage ledger (usage only, no bucket), not to :meth:`QuotaLimiter.settle`.
    """

    tenant_id: str
    quotas: Quotas
    requests: int
    tokens: int
    epoch: str | None = None
    linger: bool = False
    scopes: tuple[Scope, ...] = ()
    slot: HeldSlot | None = None
    budgets: tuple[BudgetHold, ...] = ()
    price: ModelPrice = FREE
    local: bool = False


SoftLimitHook = Callable[[str, BudgetHold], None]
"""Told ``(tenant id, budget)`` when a settle took a budget's spend to its soft limit (once per period)."""


class QuotaLimiter:
    """The Python face of ``token_bucket.lua``.

    Args:
        redis: async client.
        prefix: RedisClient key prefix; buckets live at ``<prefix>bucket:<tenant>:{requests,tokens}``.
        settle_linger_s: how long a settle waits to share a pipeline with others, s
            (:class:`tenancy.script_batch.ScriptBatcher`).

        usage_retention_days: how long a day's usage rows are kept (their hash expires), days.
        max_usage_rows: most key x model rows of one tenant's day (``settle.lua``).
        clock: unix time, s (the day of a usage row, a spend's expiry; test hook).

    Methods that take ``epoch`` check the tenant record first when it is not None (see the module).
    ``observe_call``: told each script call's latency (reserve, adjust, settle; a settle's linger
    included), not that of a call with no bucket to touch (answered without Redis). ``on_soft_limit``:
    told when a settle took a budget to its soft limit.
    """

    observe_call: CallObserver | None = None
    on_soft_limit: SoftLimitHook | None = None

    def __init__(
        self,
        redis: RedisClient,
        prefix: str,
        settle_linger_s: float = 0.0,
        usage_retention_days: int = 400,
        max_usage_rows: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._layout = KeyLayout(prefix)
        self._script = redis.register_script(
            lua("token_bucket.lua", guarded=True, buckets=True, billing=True, once=True)
        )
        self._settle = redis.register_script(lua("settle.lua", guarded=True, buckets=True, billing=True))
        self._batch = ScriptBatcher(redis)  # concurrent requests' scripts share a pipeline
        self._settle_linger_s = settle_linger_s
        self._retention_s = usage_retention_days * DAY_S
        self._max_fields = max_usage_rows * len(ROW_COUNTERS)
        self.clock = clock

    def bucket_key(self, tenant_id: str, bucket: BucketName, scope: Scope | None = None) -> str:
        """Redis key of one of a tenant's buckets (of ``scope``'s, when given)."""
        if scope is None:
            return self._layout.bucket(tenant_id, bucket)
        return self._layout.scoped_bucket(tenant_id, scope.kind, scope.name, bucket)

    def _buckets(
        self,
        tenant_id: str,
        quotas: BucketLimits,
        requests: float,
        tokens: float,
        scopes: tuple[Scope, ...] = (),
    ) -> list[_Bucket]:
        """The buckets a call touches, the scopes' first (in order) and the tenant's own last: the order
        the script checks them in, so the first one short is the one a refusal names."""
        out: list[_Bucket] = []
        layout = self._layout
        for kind, name, limits in (*((s.kind, s.name, s.limits) for s in scopes), ("tenant", "", quotas)):
            if limits.requests_per_min is not None:
                cap = limits.effective_request_burst
                assert cap is not None
                key = layout.scoped_bucket(tenant_id, kind, name, "requests")
                out.append(_Bucket(kind, name, "requests", key, limits.requests_per_min, cap, requests))
            if limits.tokens_per_min is not None:
                cap = limits.effective_token_burst
                assert cap is not None
                key = layout.scoped_bucket(tenant_id, kind, name, "tokens")
                out.append(_Bucket(kind, name, "tokens", key, limits.tokens_per_min, cap, tokens))
        return out

    async def _run(
        self,
        tenant_id: str,
        epoch: str | None,
        mode: Literal["take", "adjust", "lease", "budget"],
        buckets: list[_Bucket],
        now_ms: float | None,
        tail: list[str | float] | None = None,
        operation: str = "QuotaLimiter.reserve",
        extra_keys: Sequence[str] = (),
    ) -> list[str | int]:
        # the call's marker first (lua(once=True)): a call redis-py sends again after a cut reply runs once
        once = self._layout.once(tenant_id, secrets.token_hex(8))
        keys = [once, self._layout.tenant(tenant_id), *(b.key for b in buckets), *extra_keys]
        args: list[str | float] = [
            ONCE_TTL_MS,
            "" if now_ms is None else repr(float(now_ms)),
            mode,
            "0" if epoch is None else "1",
            epoch or "",
        ]
        for b in buckets:
            args.extend([repr(float(b.rate)), repr(float(b.cap)), repr(float(b.amount))])
        if tail:
            args.extend(tail)
        result: list[str | int] = await timed_call(
            self.observe_call, operation, self._batch.run(self._script, keys, args)
        )
        return result

    @untimed_store_operation
    async def reserve(
        self,
        tenant_id: str,
        quotas: Quotas,
        tokens: int,
        now_ms: float | None = None,
        epoch: str | None = None,
        lease: Mapping[BucketName, tuple[float, float]] | None = None,
        scopes: tuple[Scope, ...] = (),
        budgets: tuple[BudgetHold, ...] = (),
    ) -> QuotaDecision:
        """Take 1 request and ``tokens`` tokens from the tenant's buckets and its ``scopes``' (its key's,
        its model's), and each budget's ``amount`` from its spend, all or nothing.

        Args:
            tenant_id: whose buckets.
            quotas: the tenant's limits (unlimited buckets are skipped).
            tokens: tokens to reserve (prompt + max_tokens).
            now_ms: test hook; ``None`` uses Redis server time.
            epoch: the tenant record's epoch as the caller read it; None skips the tenant check.
            lease: bucket -> ``(extra, credit)``: first give ``credit`` units back (an earlier lease's
                leftover, written even when refused), then, when the request passes, also take up to
                ``extra`` whole units more, as much as the bucket holds (``QuotaDecision.granted``).
                Buckets absent lease nothing. Used by :class:`tenancy.quota_lease.LeasedQuota`; only
                the tenant's own buckets lease (not with ``scopes``).
            scopes: the narrower buckets the request also takes from, checked first, in order.
            budgets: the budgets it takes its worst-case cost from, checked before every bucket: one whose
                hard limit the amount would pass refuses it (``QuotaDecision.budget``).

        Returns:
            A :class:`QuotaDecision`: refused, it names the budget over its hard limit, or the first
            bucket short (``limiting`` and ``scope``) and waits for the slowest.

        Raises:
            TenantNotFoundError: ``epoch`` was given and the tenant is gone (nothing was written).
            ValueError: ``lease`` with ``scopes`` or ``budgets``.
        """
        if lease is not None and (scopes or budgets):
            raise ValueError("only the tenant's own buckets lease")
        buckets = self._buckets(tenant_id, quotas, 1, tokens, scopes)
        if not buckets and not budgets:
            return QuotaDecision(True, False, 0.0, None, {})
        tail: list[str | float] | None = None
        extra_keys: list[str] = []
        mode: Literal["take", "lease", "budget"] = "take"
        if lease is not None:
            tail, mode = [], "lease"
            for b in buckets:
                extra, credit = lease.get(b.bucket, (0, 0))
                tail.extend([repr(float(extra)), repr(float(credit))])
            mode = "lease" if tail else "take"
        elif budgets:
            tail, mode = take_tail(budgets, self.clock()), "budget"
            extra_keys = [*(h.key for h in budgets), self._layout.billing_index(tenant_id)]
        result = await self._run(tenant_id, epoch, mode, buckets, now_ms, tail, extra_keys=extra_keys)
        status, wait_ms, idx = int(result[0]), int(result[1]), int(result[2])
        if status == -2:
            raise TenantNotFoundError(tenant_id)
        if status == -4:
            refusal = BudgetRefusal(budgets[idx - 1], int(float(result[3])))
            return QuotaDecision(False, False, math.inf, None, {}, budget=refusal)
        n = len(buckets)
        found = buckets[idx - 1] if idx > 0 else None
        limiting = found.bucket if found is not None else None
        scope = None
        if found is not None and found.scope != "tenant":
            scope = next(s for s in scopes if s.kind == found.scope and s.name == found.name)
        levels = tuple(
            BucketLevel(b.bucket, b.rate, b.cap, float(v))
            for b, v in zip(buckets, result[3 : 3 + n], strict=False)
        )
        remaining: dict[str, float] = {
            b.bucket: level.level for b, level in zip(buckets, levels, strict=False) if b.scope == "tenant"
        }
        if status == -1:
            return QuotaDecision(False, True, math.inf, limiting, remaining, scope=scope, levels=levels)
        if status == 0:
            wait_s = wait_ms / 1000.0
            return QuotaDecision(False, False, wait_s, limiting, remaining, scope=scope, levels=levels)
        granted: dict[str, int] | None = (
            {b.bucket: int(v) for b, v in zip(buckets, result[3 + n :], strict=False)}
            if mode == "lease"
            else None
        )
        return QuotaDecision(True, False, 0.0, None, remaining, granted, levels=levels)

    @untimed_store_operation
    async def adjust(
        self,
        tenant_id: str,
        quotas: Quotas,
        requests: float = 0,
        tokens: float = 0,
        now_ms: float | None = None,
        epoch: str | None = None,
        scopes: tuple[Scope, ...] = (),
    ) -> dict[str, float]:
        """Add units back to (positive) or charge (negative) the tenant's buckets, and its ``scopes``'.

        Levels are capped at the burst and floored at minus the burst. Returns bucket -> new level of the
        tenant's own buckets; empty when nothing changed, or when ``epoch`` was given and the tenant is
        gone (nothing written).
        """
        buckets = [b for b in self._buckets(tenant_id, quotas, requests, tokens, scopes) if b.amount != 0]
        if not buckets:
            return {}
        result = await self._run(tenant_id, epoch, "adjust", buckets, now_ms, operation="QuotaLimiter.adjust")
        if int(result[0]) == -2:
            return {}
        return {b.bucket: float(v) for b, v in zip(buckets, result[3:], strict=False) if b.scope == "tenant"}

    async def refund(self, reservation: Reservation) -> None:
        """Give a whole reservation back (request rejected downstream, failed upstream, or cancelled)."""
        r = reservation
        await self.adjust(r.tenant_id, r.quotas, r.requests, r.tokens, epoch=r.epoch, scopes=r.scopes)

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        """Settle a finished request: refund unused reserved tokens, or charge the overrun."""
        r = reservation
        await self.adjust(r.tenant_id, r.quotas, 0, r.tokens - used_tokens, epoch=r.epoch, scopes=r.scopes)

    @untimed_store_operation
    async def settle(
        self,
        reservation: Reservation,
        used_tokens: int | None,
        usage: Mapping[str, int],
        now_ms: float | None = None,
        once: tuple[str, int] | None = None,
        rows: Sequence[UsageRow] = (),
    ) -> bool:
        """Settle a request and record its usage in one atomic round trip (``settle.lua``): what
        :meth:`reconcile` (``used_tokens`` given) or :meth:`refund` (None: nothing was served) and then
        :meth:`tenancy.usage.UsageRecorder.record` do, with one tenant check for both. Every bucket the
        reservation took from (its scopes' too) gets its unused units back, or the overrun charged; every
        budget it holds (:attr:`Reservation.budgets`) gets its worst case replaced by the real cost
        (``usage["cost"]``; nothing served: given back whole), and a budget whose spend this takes to its
        soft limit is told to :attr:`on_soft_limit` (once per period, across every replica).

        Args:
            reservation: what :meth:`reserve` took.
            used_tokens: prompt + completion tokens served; None gives the whole reservation back.
            usage: usage field (of :class:`tenancy.models.Usage`, or ``cost`` in picodollars) -> amount;
                zeros are skipped.
            now_ms: test hook; ``None`` uses Redis server time.
            once: ``(request id, marker lifetime in s)``: the settle writes a marker
                (:meth:`KeyLayout.settled`) and does nothing when it is already there, so a settle may
                be retried after a timeout that hid whether it landed. None: no marker.
            rows: usage by UTC day, API key and model to add (each day's hash expires
                ``usage_retention_days`` after the day ends).

        Returns:
            False when the reservation has an epoch and the tenant is gone (nothing written), else True
            (also when ``once`` found the request settled already).

        Raises:
            ValueError: an unknown usage field, or a row's day not ``YYYY-MM-DD``.
        """
        unknown = set(usage) - {*USAGE_FIELDS, COST_FIELD}
        if unknown:
            raise ValueError(f"unknown usage fields: {sorted(unknown)}")
        r = reservation
        if used_tokens is None:
            requests, tokens = float(r.requests), float(r.tokens)
        else:
            requests, tokens = 0.0, float(r.tokens - used_tokens)
        touched = self._buckets(r.tenant_id, r.quotas, requests, tokens, r.scopes)
        buckets = [b for b in touched if b.amount != 0]
        counts = [(field, value) for field, value in usage.items() if value]
        if not buckets and not counts and not r.budgets and not rows:
            return True
        layout = self._layout
        marker = layout.settled(r.tenant_id, once[0] if once is not None else "")
        keys = [layout.tenant(r.tenant_id), layout.usage(r.tenant_id), marker, *(b.key for b in buckets)]
        args: list[str | int] = [
            "" if now_ms is None else repr(float(now_ms)),
            "0" if r.epoch is None else "1",
            r.epoch or "",
            len(buckets),
            "" if once is None else max(1, int(once[1])),
        ]
        for b in buckets:
            args.extend([repr(float(b.rate)), repr(float(b.cap)), repr(float(b.amount))])
        args.append(len(counts))
        for field, value in counts:
            args.extend([field, value])
        days = [
            (
                layout.usage_day(r.tenant_id, row.day),
                row,
                int(day_end_s(parse_day(row.day, "day")) + self._retention_s),
            )
            for row in rows
        ]
        keys += [h.key for h in r.budgets] + [day for day, _, _ in days]
        if r.budgets or days:
            keys.append(layout.billing_index(r.tenant_id))
        cost = None if used_tokens is None else usage.get(COST_FIELD, 0)
        args += settle_tail(r.budgets, cost, days, self._max_fields, self.clock())
        linger = self._settle_linger_s if r.linger else 0.0
        result = await timed_call(
            self.observe_call, "QuotaLimiter.settle", self._batch.run(self._settle, keys, args, linger)
        )
        if int(result[0]) == -2:
            return False
        hook = self.on_soft_limit
        if hook is not None and r.budgets and len(result) > 1:
            for hold, crossed in zip(r.budgets, result[1 + len(buckets) :], strict=False):
                if int(crossed) == 1:
                    hook(r.tenant_id, hold)
        return True
