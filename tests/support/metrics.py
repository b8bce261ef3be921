"""Waiting on a gateway's ``/metrics`` text in tests."""

from __future__ import annotations

import time

import httpx


def metrics_once_shown(http: httpx.Client, line: str, within_s: float = 10.0) -> str:
    """The ``/metrics`` text once it contains ``line`` (polled every 0.2 s); fails after ``within_s``."""
    deadline = time.monotonic() + within_s
    metrics = http.get("/metrics").text
    while line not in metrics:
        assert time.monotonic() < deadline, f"/metrics never showed {line!r}"
        time.sleep(0.2)
        metrics = http.get("/metrics").text
    return metrics
