"""Restart backoff of supervised workers (policies.restart_backoff), table-driven."""

from __future__ import annotations

import pytest

from policies.restart_backoff import RestartBackoff, RestartBackoffConfig

CONFIG = RestartBackoffConfig(base_s=1.0, max_s=8.0, stable_s=100.0)

# (time of the event s, "start" or (jitter, expected delay s))
TIMELINES: list[tuple[str, list[tuple[float, str | tuple[float, float]]]]] = [
    (
        "doubles up to the cap, jitter scales between half and all of it",
        [
            (0, "start"),
            (1, (0.0, 0.5)),
            (2, (0.0, 1.0)),
            (3, (0.5, 3.0)),
            (4, (0.0, 4.0)),
            (5, (0.999, 7.996)),
            (6, (0.0, 4.0)),  # capped at max_s = 8
        ],
    ),
    (
        "restarts that do not last keep growing",
        [(0, "start"), (10, (0.0, 0.5)), (11, "start"), (20, (0.0, 1.0)), (21, "start"), (30, (0.0, 2.0))],
    ),
    (
        "a stable run resets the backoff",
        [(0, "start"), (10, (0.0, 0.5)), (11, "start"), (20, (0.0, 1.0)), (21, "start"), (121, (0.0, 0.5))],
    ),
    ("a worker never started counts from the base", [(5, (0.0, 0.5)), (6, (0.0, 1.0))]),
]


@pytest.mark.parametrize(("name", "timeline"), TIMELINES, ids=[t[0] for t in TIMELINES])
def test_restart_delays(name: str, timeline: list[tuple[float, str | tuple[float, float]]]) -> None:
    backoff = RestartBackoff(CONFIG)
    for now, event in timeline:
        if event == "start":
            backoff.started(now)
        else:
            assert isinstance(event, tuple)
            jitter, expected = event
            assert backoff.next_delay(now, jitter) == pytest.approx(expected), (name, now)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        RestartBackoffConfig(base_s=2.0, max_s=1.0)
    with pytest.raises(ValueError):
        RestartBackoff(CONFIG).next_delay(0.0, 1.0)
