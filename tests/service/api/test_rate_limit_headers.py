"""OpenAI's rate-limit headers: Go's duration format for resets, whole numbers, one set per kind."""

from __future__ import annotations

import pytest

from service.api.rate_limit_headers import go_duration, rate_limit_headers
from service.errors import LimitState


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-1, "0s"),
        (0.0004, "0s"),  # below half a millisecond
        (0.02, "20ms"),
        (0.9996, "1s"),  # rounded to the millisecond
        (1, "1s"),
        (1.5, "1.5s"),
        (8.64, "8.64s"),
        (59.999, "59.999s"),
        (360, "6m0s"),  # OpenAI's example
        (77.12, "1m17.12s"),
        (3723.25, "1h2m3.25s"),
        (7200, "2h0m0s"),
    ],
)
def test_go_duration(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


def test_headers_of_each_kind() -> None:
    states = {"requests": LimitState(60, 59, 1.0), "tokens": LimitState(150000.7, 149984, 0.0064)}
    assert rate_limit_headers(states) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "150000",
        "x-ratelimit-remaining-tokens": "149984",
        "x-ratelimit-reset-tokens": "6ms",
    }
    assert rate_limit_headers({"tokens": LimitState(10, 0, 6)}) == {
        "x-ratelimit-limit-tokens": "10",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "6s",
    }
    assert rate_limit_headers({}) == {}
