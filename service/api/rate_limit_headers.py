"""OpenAI's rate-limit headers (https://platform.openai.com/docs/guides/rate-limits, "Rate limits in
headers"): ``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests``, ``x-ratelimit-reset-requests``
and the ``-tokens`` forms, in OpenAI's formats (whole numbers; a reset as Go writes a duration: ``1s``,
``6m0s``, ``20ms``).

What the values are (the bucket of each kind closest to empty, and how a replica with a local lease
computes it) is :mod:`policies.rate_limits`; the pipeline hands them over as
:class:`service.errors.LimitState`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from service.errors import LimitState


def go_duration(seconds: float) -> str:
    """``seconds`` as OpenAI writes a reset: Go's ``time.Duration`` string, rounded to the millisecond
    (``0s``, ``20ms``, ``1s``, ``1.5s``, ``6m0s``, ``1h2m3.25s``)."""
    ms = round(max(0.0, seconds) * 1000)
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    secs = f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _whole(value: float) -> str:
    """A limit as a whole number (a fractional burst is floored: what fits whole)."""
    return str(math.floor(value))


_NAMES = {
    kind: (f"x-ratelimit-limit-{kind}", f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}")
    for kind in ("requests", "tokens")
}
"""The three header names of each kind."""


def rate_limit_headers(states: Mapping[str, LimitState]) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers of ``states`` (``"requests"``/``"tokens"`` -> state); a kind without
    a bucket (unlimited) has none."""
    headers: dict[str, str] = {}
    for kind, (limit, remaining, reset_s) in states.items():
        limit_name, remaining_name, reset_name = _NAMES[kind]
        headers[limit_name] = _whole(limit)
        headers[remaining_name] = str(remaining)
        headers[reset_name] = "0s" if reset_s <= 0 else go_duration(reset_s)
    return headers
