"""What a client is told of its buckets (policies/rate_limits.py): closest to empty, reset, leased level."""

from __future__ import annotations

import pytest

from policies.rate_limits import BucketLevel, closest_to_empty, leased_level
from policies.token_bucket import MAX_WAIT_MS


@pytest.mark.parametrize(
    ("level", "remaining", "reset_s"),
    [
        (BucketLevel("requests", 60, 60, 60), 60, 0.0),  # full
        (BucketLevel("requests", 60, 60, 59.5), 59, 0.5),  # 0.5 request missing at 1/s
        (BucketLevel("tokens", 6000, 1000, 0), 0, 10.0),  # empty: 1000 tokens at 100/s
        (BucketLevel("tokens", 600, 100, -100), 0, 20.0),  # in debt: nothing left, two bursts to refill
        (BucketLevel("requests", 1e-9, 1, 0), 0, MAX_WAIT_MS / 1000),  # bounded like a wait
    ],
)
def test_remaining_and_reset(level: BucketLevel, remaining: int, reset_s: float) -> None:
    assert level.remaining == remaining
    assert level.reset_s == pytest.approx(reset_s)


KEY = BucketLevel("requests", 1, 10, 3)  # 7 missing at 1/min: full in 420 s
MODEL = BucketLevel("requests", 100, 100, 50)
TENANT = BucketLevel("requests", 1000, 1000, 3.5)  # 3 whole left, like the key: full in 59.8 s
TOKENS = BucketLevel("tokens", 1000, 1000, 10)


@pytest.mark.parametrize(
    ("levels", "expected"),
    [
        ((), {}),
        ((TENANT,), {"requests": TENANT}),
        ((KEY, MODEL, TENANT, TOKENS), {"requests": KEY, "tokens": TOKENS}),  # tie on 3: the slower one
        ((MODEL, TENANT), {"requests": TENANT}),  # fewest whole units, whatever the fraction
        ((TOKENS, BucketLevel("tokens", 10, 10, 10)), {"tokens": TOKENS}),  # equal: longer refill
    ],
)
def test_closest_to_empty_per_kind(levels: tuple[BucketLevel, ...], expected: dict[str, BucketLevel]) -> None:
    assert closest_to_empty(levels) == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((100, 600, 1000, 0.0, 50), 150),  # no time passed: shared level + what this replica holds
        ((100, 600, 1000, 1.0, 50), 160),  # 1 s at 10/s refilled
        ((990, 600, 1000, 5.0, 50), 1000),  # capped at the burst
        ((-20, 600, 1000, 1.0, 0), -10),  # debt refills too
        ((100, 600, 1000, -1.0, 0), 100),  # a clock going back refills nothing
    ],
)
def test_leased_level(args: tuple[float, float, float, float, float], expected: float) -> None:
    assert leased_level(*args) == pytest.approx(expected)
