"""The soak (loadgen/soak.py, issue 31): streams at twice the measured capacity over three tenants, two
gateway processes and three simulated workers, with a worker SIGKILLed and Redis (append-only, fsync
always) stopped and started again while they run.

CI runs a short one (28 s: one kill, two Redis restarts): every stream is answered, whole or with a clean
429/503, and every tenant's ledger balances (what Redis charged equals what the clients received, the
streams cut by an error event included). ``pytest -m soak`` runs the 10-minute one of the issue (a kill
every 2 minutes, a Redis restart every 3) and checks the memory too; its figures are in
docs/failure-modes.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.soak import GOAL_RSS_SLOPE_MB_PER_MIN, figures_text, run_soak, slope_per_min


@pytest.mark.parametrize(
    ("samples", "after_s", "slope"),
    [
        ([(0, 100.0), (60, 101.0), (120, 102.0)], 0, 1.0),
        ([(0, 50.0), (30, 100.0), (60, 100.0), (90, 100.0), (120, 100.0)], 60, 0.0),  # warm-up left out
        ([(0, 1.0), (60, 2.0)], 0, 0.0),  # too few samples
    ],
)
def test_slope_per_min(samples: list[tuple[float, float]], after_s: float, slope: float) -> None:
    assert slope_per_min(samples, after_s) == pytest.approx(slope)


def test_a_short_soak_answers_every_stream_and_balances_every_ledger(
    tmp_path: Path, stub_model_dir: Path
) -> None:
    figures = run_soak(
        tmp_path,
        tokenizer_dir=stub_model_dir,
        duration_s=28,
        load=2.0,
        kill_every_s=15,
        redis_every_s=12,
        down_s=3,
        sample_every_s=2,
        warmup_s=8,
    )
    print(figures_text(figures))
    assert (figures.worker_kills, figures.redis_restarts) == (1, 2)
    assert figures.unanswered_count == 0, figures.unanswered[:5]
    assert figures.outcomes["ok"] > 0 and figures.outcomes.get("503 store_unavailable", 0) > 0
    assert figures.balanced, figures.ledger
    assert len(figures.rss_mb) == 2 and figures.tasks  # both gateway processes sampled, and the tasks


@pytest.mark.soak
def test_ten_minutes_at_twice_capacity_with_kills_and_redis_restarts(
    tmp_path: Path, stub_model_dir: Path
) -> None:
    figures = run_soak(tmp_path, tokenizer_dir=stub_model_dir, duration_s=600, load=2.0)
    print(figures_text(figures))
    assert figures.worker_kills >= 4 and figures.redis_restarts >= 3
    assert figures.unanswered_count == 0, figures.unanswered[:5]
    assert figures.balanced, figures.ledger
    assert figures.rss_slope_mb_per_min <= GOAL_RSS_SLOPE_MB_PER_MIN


@pytest.mark.soak
@pytest.mark.parametrize("on_outage", ["closed", "open"])
def test_a_two_minute_redis_outage_at_twice_capacity(
    tmp_path: Path, stub_model_dir: Path, on_outage: str
) -> None:
    """Redis stopped for 120 s under load (from 140 s to 260 s of a 275 s run; no worker killed): every
    stream answered, every tenant's ledger exact after Redis returns; ``open`` serves through the outage from
    the replicas' local buckets, ``closed`` answers 503 ``store_unavailable`` for it."""
    figures = run_soak(
        tmp_path,
        tokenizer_dir=stub_model_dir,
        duration_s=275,
        load=2.0,
        kill_every_s=10_000,
        redis_every_s=140,
        redis_down_s=120,
        on_outage=on_outage,
    )
    print(figures_text(figures))
    assert figures.redis_restarts == 1 and figures.worker_kills == 0
    assert figures.unanswered_count == 0, figures.unanswered[:5]
    assert figures.balanced, figures.ledger
    unavailable = figures.outcomes.get("503 store_unavailable", 0)
    if on_outage == "open":
        assert unavailable < 0.01 * figures.sent, figures.outcomes
    else:
        assert unavailable > 0.2 * figures.sent, figures.outcomes
