"""Usage by UTC day, API key and model, read back for export (``GET /admin/tenants/{id}/usage?from=&to=``).

``settle.lua`` adds each charged request to its day's hash (``P usage:<id>:day:<YYYY-MM-DD>``, fields
``<counter>:<key id>:<model>``; money ``cost`` in picodollars with its ``carry:`` field, see
``billing_lib.lua``) in the same call that adds it to the tenant's totals, so the days of a tenant sum to
its totals for the days kept. :func:`grouped` sums the rows of a range by day, model and/or key.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from datetime import date
from typing import Any, Literal

from policies.pricing import pico_to_usd, usd_text
from tenancy.billing import MONEY_CARRY, ROW_COUNTERS, UsageRow
from tenancy.errors import CallObserver, store_operation
from tenancy.layout import KeyLayout
from tenancy.redis_client import RedisClient

GroupBy = Literal["day", "model", "key"]
GROUPS: tuple[GroupBy, ...] = ("day", "model", "key")
_COLUMN = {"day": "day", "model": "model", "key": "key_id"}


def rows_of(day: str, raw: dict[str, str]) -> list[UsageRow]:
    """The rows of one day's hash as read (``HGETALL``)."""
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for field, value in raw.items():
        carry = field.startswith("carry:")
        counter, _, rest = (field[6:] if carry else field).partition(":")
        key_id, _, model = rest.partition(":")
        if counter not in ROW_COUNTERS or not model:
            continue
        row = counts.setdefault((key_id, model), dict.fromkeys(ROW_COUNTERS, 0))
        row[counter] += int(value) * (MONEY_CARRY if carry else 1)
    return [UsageRow(day, key_id, model, **c) for (key_id, model), c in sorted(counts.items())]


def grouped(rows: Iterable[UsageRow], group_by: Sequence[GroupBy]) -> list[dict[str, Any]]:
    """Rows summed by the columns ``group_by`` names (in that order; none: one total), sorted by them.
    Each: its columns (``day``, ``model``, ``key_id``), the counts, ``cost_usd`` (a number) and
    ``cost_picodollars`` (exact)."""
    sums: dict[tuple[str, ...], list[int]] = {}
    for row in rows:
        at = tuple(getattr(row, "key_id" if g == "key" else g) for g in group_by)
        acc = sums.setdefault(at, [0] * len(ROW_COUNTERS))
        for i, counter in enumerate(ROW_COUNTERS):
            acc[i] += getattr(row, counter)
    if not group_by and not sums:
        sums[()] = [0] * len(ROW_COUNTERS)
    out = []
    for at, acc in sorted(sums.items()):
        item: dict[str, Any] = {_COLUMN[g]: value for g, value in zip(group_by, at, strict=True)}
        item.update(zip(ROW_COUNTERS[:-1], acc[:-1], strict=True))
        item["cost_usd"] = pico_to_usd(acc[-1])
        item["cost_picodollars"] = acc[-1]
        out.append(item)
    return out


def as_csv(items: Sequence[dict[str, Any]], group_by: Sequence[GroupBy]) -> str:
    """Grouped rows as CSV (RFC 4180, a header line), the cost as an exact decimal dollar string."""
    columns = [_COLUMN[g] for g in group_by] + list(ROW_COUNTERS[:-1]) + ["cost_usd"]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(columns)
    for item in items:
        values = {**item, "cost_usd": usd_text(item["cost_picodollars"])}
        writer.writerow([values[c] for c in columns])
    return out.getvalue()


class UsagePeriods:
    """Reads a tenant's usage by day.

    Args:
        redis: async client (``decode_responses=True``).
        prefix: RedisClient key prefix.
    """

    observe_call: CallObserver | None = None

    def __init__(self, redis: RedisClient, prefix: str) -> None:
        self._redis = redis
        self._layout = KeyLayout(prefix)

    @store_operation
    async def rows(self, tenant_id: str, days: Sequence[date]) -> list[UsageRow]:
        """Every row of ``days`` (one pipelined read; at most ``pricing.usage_retention_days`` days)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for day in days:
                pipe.hgetall(self._layout.usage_day(tenant_id, day.isoformat()))
            raws = await pipe.execute()
        out: list[UsageRow] = []
        for day, raw in zip(days, raws, strict=True):
            out += rows_of(day.isoformat(), raw)
        return out

    @store_operation
    async def cost(self, tenant_id: str) -> int:
        """A tenant's total cost since it was created, picodollars."""
        value, carry = await self._redis.hmget(self._layout.usage(tenant_id), ["cost", "carry:cost"])
        return int(value or 0) + int(carry or 0) * MONEY_CARRY
