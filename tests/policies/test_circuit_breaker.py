"""The breaker rule (policies.circuit_breaker.judge) and the breaker's transitions, table-driven."""

from __future__ import annotations

import pytest

from policies.circuit_breaker import BreakerConfig, BreakerState, CircuitBreaker, Signal, Verdict, judge

# (signal, seconds since the last successful request or None, expected verdict); trust window 30 s
RULE: list[tuple[Signal, float | None, Verdict]] = [
    ("refused", None, "trip"),
    ("refused", 1.0, "trip"),  # a refused connection is definitive even right after a success
    ("request_failed", None, "serving_failure"),
    ("request_failed", 1.0, "serving_failure"),  # requests are never outweighed
    ("request_ok", None, "success"),
    ("deep_probe_ok", None, "success"),
    ("probe_ok", None, "alive"),
    ("probe_failed", None, "liveness_failure"),
    ("probe_failed", 31.0, "liveness_failure"),
    ("probe_failed", 30.0, "ignore"),
    ("deep_probe_failed", None, "serving_failure"),  # never definitive: one failure like any other
    ("deep_probe_failed", 45.0, "serving_failure"),
    ("deep_probe_failed", 0.5, "ignore"),  # requests to it succeed: the probe does not count
]


@pytest.mark.parametrize(("signal", "age", "verdict"), RULE)
def test_judge(signal: Signal, age: float | None, verdict: Verdict) -> None:
    assert judge(signal, age, trust_window_s=30.0) == verdict


CONFIG = BreakerConfig(failure_threshold=3, success_threshold=2, open_cooldown_s=10.0, max_cooldown_s=25.0)

# sequences of (time s, verdict) and the state after each step
SEQUENCES: list[tuple[str, list[tuple[float, Verdict]], list[BreakerState]]] = [
    (
        "three serving failures open",
        [(0, "serving_failure"), (1, "serving_failure"), (2, "serving_failure")],
        ["closed", "closed", "open"],
    ),
    (
        "a success clears the count",
        [(0, "serving_failure"), (1, "serving_failure"), (2, "success"), (3, "serving_failure")],
        ["closed", "closed", "closed", "closed"],
    ),
    (
        "a plain /health 200 does not clear failed generations",
        [(0, "serving_failure"), (1, "alive"), (2, "serving_failure"), (3, "alive"), (4, "serving_failure")],
        ["closed", "closed", "closed", "closed", "open"],
    ),
    (
        "a plain /health 200 clears failed plain probes",
        [(0, "liveness_failure"), (1, "liveness_failure"), (2, "alive"), (3, "liveness_failure")],
        ["closed", "closed", "closed", "closed"],
    ),
    (
        "liveness and serving failures add up",
        [(0, "liveness_failure"), (1, "serving_failure"), (2, "liveness_failure")],
        ["closed", "closed", "open"],
    ),
    ("ignored evidence changes nothing", [(0, "ignore")] * 5, ["closed"] * 5),
    ("a refused connection opens at once", [(0, "trip")], ["open"]),
]


@pytest.mark.parametrize(("name", "steps", "states"), SEQUENCES, ids=[s[0] for s in SEQUENCES])
def test_breaker_sequences(name: str, steps: list[tuple[float, Verdict]], states: list[BreakerState]) -> None:
    breaker = CircuitBreaker(CONFIG)
    got = [breaker.apply(verdict, t) for t, verdict in steps]
    assert got == states, name


def test_cooldown_half_open_and_doubling() -> None:
    breaker = CircuitBreaker(CONFIG)
    breaker.apply("trip", 0.0)
    assert not breaker.allow(9.9)
    assert breaker.allow(10.0) and breaker.state == "half_open"
    assert breaker.apply("serving_failure", 10.0) == "open" and breaker.cooldown_s == 20.0
    assert breaker.allow(30.0)
    assert breaker.apply("liveness_failure", 30.0) == "open" and breaker.cooldown_s == 25.0  # capped
    assert breaker.allow(55.0)
    # a plain probe's 200 is how a half-open worker is probed back in
    assert breaker.apply("alive", 55.0) == "half_open"
    assert breaker.apply("alive", 56.0) == "closed" and breaker.cooldown_s == CONFIG.open_cooldown_s


def test_half_open_on_demand_resets_the_record() -> None:
    breaker = CircuitBreaker(CONFIG)
    breaker.apply("trip", 0.0)
    breaker.cooldown_s = 25.0
    assert breaker.half_open() == "half_open" and breaker.allow(0.1)
    assert breaker.cooldown_s == CONFIG.open_cooldown_s and breaker.failures == 0


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        BreakerConfig(failure_threshold=0)
    with pytest.raises(ValueError):
        BreakerConfig(trust_window_s=-1)
