"""UTC calendar periods of usage and budgets: days and months, and the date ranges a usage export may ask for.

A budget's period (``day`` or ``month``) starts at 00:00 UTC of the day or of the first of the month; a
request is charged to the period it was admitted in (its settle lands there too, even after midnight).
Usage is kept per UTC day. Dates are ISO 8601 calendar dates (``YYYY-MM-DD``), as OpenAI's usage API takes
them. Pure: the time comes in as unix seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Literal

Period = Literal["day", "month"]
"""A budget's period."""

PERIODS: tuple[Period, ...] = ("day", "month")

DAY_S = 86_400


@dataclass(frozen=True, slots=True)
class PeriodWindow:
    """One period: its id (``2026-12-05`` or ``2026-12``) and its bounds, unix s (``start <= t < end``)."""

    id: str
    start_s: float
    end_s: float


def _utc(day: date) -> float:
    return datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()


def utc_day(now_s: float) -> date:
    """The UTC calendar day of unix time ``now_s``."""
    return datetime.fromtimestamp(now_s, UTC).date()


def period_window(period: Period, now_s: float) -> PeriodWindow:
    """The period of kind ``period`` that holds unix time ``now_s``.

    Raises:
        ValueError: an unknown period.
    """
    day = utc_day(now_s)
    if period == "day":
        return PeriodWindow(day.isoformat(), _utc(day), _utc(day + timedelta(days=1)))
    if period == "month":
        first = day.replace(day=1)
        following = date(first.year + first.month // 12, first.month % 12 + 1, 1)
        return PeriodWindow(f"{first.year:04d}-{first.month:02d}", _utc(first), _utc(following))
    raise ValueError(f"period must be one of {PERIODS}, got {period!r}")


def day_end_s(day: date) -> float:
    """The unix time at which UTC day ``day`` ends (the next day's 00:00 UTC)."""
    return _utc(day + timedelta(days=1))


def parse_day(text: str, name: str) -> date:
    """A ``YYYY-MM-DD`` date.

    Raises:
        ValueError: not an ISO calendar date (the message names the parameter ``name``).
    """
    if len(text) != 10:
        raise ValueError(f"'{name}' must be a date YYYY-MM-DD, got '{text[:40]}'")
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise ValueError(f"'{name}' must be a date YYYY-MM-DD, got '{text}'") from None


def export_days(first: date, last: date, today: date, retention_days: int) -> list[date]:
    """The days of a usage export from ``first`` to ``last`` (both included), checked against what is kept:
    the last ``retention_days`` days up to ``today``.

    Raises:
        ValueError: ``first`` after ``last``; a range longer than ``retention_days`` days; a range that ends
            after ``today`` + 1 day (a clock ahead of another replica's may have written tomorrow already)
            or starts before the oldest kept day (the message says which).
    """
    if first > last:
        raise ValueError(f"'from' ({first}) is after 'to' ({last})")
    span = (last - first).days + 1
    if span > retention_days:
        raise ValueError(f"the range holds {span} days; at most {retention_days} (the usage retention)")
    oldest = today - timedelta(days=retention_days - 1)
    if first < oldest:
        raise ValueError(f"'from' ({first}) is before the oldest day kept ({oldest}, {retention_days} days)")
    if last > today + timedelta(days=1):
        raise ValueError(f"'to' ({last}) is in the future (today is {today} UTC)")
    return [first + timedelta(days=i) for i in range(span)]
