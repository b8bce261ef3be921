"""What a request's reservation and settle carry for cost: the budgets it holds a worst-case cost against
(:class:`BudgetHold`), the usage row of its day, API key and model (:class:`UsageRow`), and how both become
the arguments of ``token_bucket.lua`` (mode ``budget``) and ``settle.lua``.

Money is whole picodollars (:mod:`policies.pricing`); a money counter in Redis may carry whole millions of
dollars into a ``carry:<field>`` field (``billing_lib.lua``): :func:`money` reads both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from policies.billing_periods import Period

BudgetScope = Literal["tenant", "key"]

NO_KEY = "-"
"""The key id of a usage row whose request came without a known API key."""

OTHER = "_other"
"""Model and key of the usage rows past ``pricing.max_usage_rows_per_day`` (``settle.lua``)."""

ROW_COUNTERS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost")
"""The counters of a day's usage row (``cost`` in picodollars)."""

COST_FIELD = "cost"
"""The usage hash's money counter: a tenant's total cost, picodollars (beside
:data:`tenancy.models.USAGE_FIELDS`)."""

MONEY_CARRY = 10**18
"""Picodollars in one unit of a ``carry:<field>`` counter (``billing_lib.lua``)."""

SPEND_RETENTION_S = 7 * 86_400
"""How long a budget's spend hash outlives its period, s: late settles land, the last period reads back."""


def money(raw: Mapping[str, str], field: str) -> int:
    """A money counter of a hash as read (``HGETALL``), picodollars: ``field`` plus its carry."""
    return int(raw.get(field, 0)) + int(raw.get(f"carry:{field}", 0)) * MONEY_CARRY


@dataclass(frozen=True, slots=True)
class BudgetHold:
    """A budget a request takes its worst-case cost from at admission, and gives the rest of back at its
    settle.

    Attributes:
        scope: ``tenant`` or ``key`` (an API key's budget).
        name: the key id (``""`` for the tenant's).
        period: ``day`` or ``month``.
        period_id: the period the request was admitted in (``2026-12-05``, ``2026-12``).
        key: the Redis key of its spend in that period.
        hard: the hard limit, picodollars (None: a soft limit only).
        soft: the soft limit, picodollars (None: none).
        amount: the worst-case cost taken, picodollars.
        expire_at: when the spend hash expires, unix s (a week after the period ends).
        period_end_s: when the period ends, unix s (a refusal's ``Retry-After``).
    """

    scope: BudgetScope
    name: str
    period: Period
    period_id: str
    key: str
    hard: int | None
    soft: int | None
    amount: int
    expire_at: int
    period_end_s: float

    def describe(self) -> str:
        """How a message names it: ``the tenant's daily budget``, ``the monthly budget of API key 'rg-…'``."""
        per = "daily" if self.period == "day" else "monthly"
        if self.scope == "tenant":
            return f"the tenant's {per} budget"
        return f"the {per} budget of API key 'rg-{self.name}'"


@dataclass(frozen=True, slots=True)
class BudgetRefusal:
    """The budget that refused a reservation: which (its hold) and what it had taken then, picodollars."""

    hold: BudgetHold
    used: int


class UsageRow(NamedTuple):
    """One settle's usage on one UTC day, of one API key and model (a named tuple: one is made for every
    request, and a frozen dataclass takes four times as long to make).

    Attributes:
        day: ``YYYY-MM-DD`` (UTC).
        key_id: the API key's id (:data:`NO_KEY` when none was known).
        model: the model's canonical id.
        requests, prompt_tokens, cached_tokens, completion_tokens: counts.
        cost: picodollars.
    """

    day: str
    key_id: str
    model: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost: int


def take_tail(holds: Sequence[BudgetHold], now_s: float) -> list[str | float]:
    """The ``budget`` mode's ARGV after the buckets' (``token_bucket.lua``)."""
    tail: list[str | float] = []
    for h in holds:
        tail.extend(["" if h.hard is None else str(h.hard), str(h.amount), str(h.expire_at)])
    tail.extend([str(int(now_s)), str(len(holds))])
    return tail


def settle_tail(
    holds: Sequence[BudgetHold],
    cost: int | None,
    rows: Sequence[tuple[str, UsageRow, int]],
    max_fields: int,
    now_s: float,
) -> list[str | int]:
    """``settle.lua``'s ARGV after its usage pairs: the budgets (``cost`` None: nothing served, the whole
    worst case given back) and the day rows (``(day hash key, row, expiry unix s)``)."""
    tail: list[str | int] = [len(holds)]
    for h in holds:
        real = cost or 0
        tail.extend([real - h.amount, real, "" if h.soft is None else str(h.soft), h.expire_at])
    tail.append(len(rows))
    for _, row, expire_at in rows:
        tail.extend(
            [
                row.key_id,
                row.model,
                row.requests,
                row.prompt_tokens,
                row.cached_tokens,
                row.completion_tokens,
                row.cost,
                expire_at,
            ]
        )
    tail.extend([max_fields, int(now_s)])
    return tail
