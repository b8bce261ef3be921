"""Exact cost arithmetic (policies/pricing.py) and UTC billing periods (policies/billing_periods.py)."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal

import pytest

from policies.billing_periods import export_days, parse_day, period_window, utc_day
from policies.pricing import (
    MAX_REQUEST_TOKENS,
    ModelPrice,
    request_cost,
    usd_text,
    usd_to_micro,
    usd_to_pico,
    worst_case_cost,
)

# (dollars as given, micro-dollars) -- floats read as their shortest decimal form
USD_TO_MICRO = [
    (0.15, 150_000),
    (0.1, 100_000),
    (2.5, 2_500_000),
    (0.000001, 1),
    (0.01875, 18_750),
    (3, 3_000_000),
    ("0.075", 75_000),
    (0, 0),
    (10_000, 10_000_000_000),
]


@pytest.mark.parametrize(("value", "micro"), USD_TO_MICRO)
def test_usd_to_micro_is_exact(value: float | str, micro: int) -> None:
    assert usd_to_micro(value) == micro


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (0.0000001, "six decimal places"),
        (-1, "at least 0"),
        (float("inf"), "finite"),
        ("abc", "number of dollars"),
        (True, "boolean"),
    ],
)
def test_usd_to_micro_refuses(value: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        usd_to_micro(value)  # type: ignore[arg-type]


P = ModelPrice(input=150_000, cached_input=75_000, output=600_000)  # $0.15, $0.075, $0.60 per 1M tokens

# (prompt, cached, completion, cost in picodollars)
COSTS = [
    (1000, 0, 100, 1000 * 150_000 + 100 * 600_000),
    (1000, 400, 100, 600 * 150_000 + 400 * 75_000 + 100 * 600_000),
    (1000, 1000, 0, 1000 * 75_000),
    (10, 50, 0, 10 * 75_000),  # more cached than prompt: all of the prompt cached
    (0, 0, 0, 0),
    (1, 0, 0, 150_000),  # one token at $0.15/1M = 1.5e-7 USD = 150,000 picodollars
]


@pytest.mark.parametrize(("prompt", "cached", "completion", "picos"), COSTS)
def test_request_cost(prompt: int, cached: int, completion: int, picos: int) -> None:
    assert request_cost(P, prompt, cached, completion) == picos
    # the same in exact decimal dollars: tokens x price per token
    dollars = (
        Decimal(prompt - min(cached, prompt)) * Decimal("0.15")
        + Decimal(min(cached, prompt)) * Decimal("0.075")
        + Decimal(completion) * Decimal("0.60")
    ) / 10**6
    assert Decimal(picos) / 10**12 == dollars


def test_worst_case_is_at_least_any_outcome() -> None:
    dear_cache = ModelPrice(input=100, cached_input=300, output=7)
    for price in (P, dear_cache):
        worst = worst_case_cost(price, 500, 64)
        assert worst == 500 * max(price.input, price.cached_input) + 64 * price.output
        for cached in (0, 250, 500):
            for completion in (0, 1, 64):
                assert request_cost(price, 500, cached, completion) <= worst


def test_counts_and_prices_are_bounded() -> None:
    with pytest.raises(ValueError, match="prompt_tokens"):
        request_cost(P, -1, 0, 0)
    with pytest.raises(ValueError, match="completion_tokens"):
        request_cost(P, 0, 0, MAX_REQUEST_TOKENS + 1)
    with pytest.raises(ValueError, match="output"):
        ModelPrice(1, 1, 10**20)
    # the dearest request fits a 64-bit counter
    top = ModelPrice(10**10, 10**10, 10**10)
    assert worst_case_cost(top, MAX_REQUEST_TOKENS, 0) < 2**63


@pytest.mark.parametrize(
    ("picos", "text"),
    [
        (1_500_000, "0.0000015"),
        (10**12, "1"),
        (0, "0"),
        (123_456_789_000_000, "123.456789"),
        (1, "0.000000000001"),
    ],
)
def test_usd_text_is_exact(picos: int, text: str) -> None:
    assert usd_text(picos) == text
    assert usd_to_pico("1.5") == 1_500_000_000_000


def _ts(*parts: int) -> float:
    return datetime(*parts, tzinfo=UTC).timestamp()  # type: ignore[misc]


# (period, now, id, start, end)
WINDOWS = [
    ("day", _ts(2026, 12, 5, 23, 59, 59), "2026-12-05", _ts(2026, 12, 5), _ts(2026, 12, 6)),
    ("day", _ts(2026, 12, 6), "2026-12-06", _ts(2026, 12, 6), _ts(2026, 12, 7)),
    ("month", _ts(2026, 12, 31, 12), "2026-12", _ts(2026, 12, 1), _ts(2027, 1, 1)),
    ("month", _ts(2028, 2, 29), "2028-02", _ts(2028, 2, 1), _ts(2028, 3, 1)),
    ("month", _ts(2027, 1, 1), "2027-01", _ts(2027, 1, 1), _ts(2027, 2, 1)),
]


@pytest.mark.parametrize(("period", "now", "pid", "start", "end"), WINDOWS)
def test_period_window(period: str, now: float, pid: str, start: float, end: float) -> None:
    w = period_window(period, now)  # type: ignore[arg-type]
    assert (w.id, w.start_s, w.end_s) == (pid, start, end)


def test_export_days() -> None:
    today = utc_day(_ts(2026, 12, 5, 10))
    assert export_days(date(2026, 12, 1), date(2026, 12, 3), today, 400) == [
        date(2026, 12, 1),
        date(2026, 12, 2),
        date(2026, 12, 3),
    ]
    assert len(export_days(date(2025, 11, 2), today, today, 400)) == 399
    cases = [
        (date(2026, 12, 3), date(2026, 12, 1), "after 'to'"),
        (date(2025, 1, 1), date(2026, 12, 1), "at most 400"),
        (date(2025, 10, 31), date(2025, 11, 5), "oldest day kept"),
        (date(2026, 12, 1), date(2026, 12, 9), "future"),
    ]
    for first, last, fragment in cases:
        with pytest.raises(ValueError, match=fragment):
            export_days(first, last, today, 400)
    for bad in ("2026-13-01", "2026-1-1", "yesterday", "2026-12-05T00:00"):
        with pytest.raises(ValueError, match="'from' must be a date"):
            parse_day(bad, "from")
