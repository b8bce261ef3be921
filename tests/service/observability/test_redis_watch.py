"""A Redis that is down (at startup or later) is said in the log with its address, password masked:
``redis_unreachable`` once, then at a bounded rate, and ``redis_reachable`` when it is back
(service/observability/redis_watch.py); with a real redis-server stopped and started."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from service.app import create_app
from service.observability.redis_watch import RedisReachability, masked_url
from tests.conftest import gateway_settings
from tests.support.servers import ThreadedServer, free_port, redis_server


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:s3cret@10.0.0.5:6379/0", "redis://:****@10.0.0.5:6379/0"),
        ("rediss://app:p%40ss@redis.internal/2", "rediss://app:****@redis.internal/2"),
        ("redis://app@redis.internal", "redis://app@redis.internal"),  # a user and no password
        ("unix://:pw@/run/redis.sock?db=1", "unix://:****@/run/redis.sock?db=1"),
    ],
)
def test_the_url_is_logged_with_its_password_masked(url: str, shown: str) -> None:
    assert masked_url(url) == shown


def test_an_outage_is_logged_once_then_at_a_bounded_rate() -> None:
    now = [0.0]
    reach = RedisReachability("redis://:pw@r:6379/0", repeat_s=60.0, clock=lambda: now[0])
    with capture_logs() as logs:
        reach.reached()  # reachable from the start: nothing to say
        for second in range(181):  # three minutes down, one failed attempt a second
            now[0] = 100.0 + second
            reach.failed("ConnectionError: refused")
        now[0] = 290.0
        reach.reached()
        reach.reached()
    down = [e for e in logs if e["event"] == "redis_unreachable"]
    assert [(e["down_s"], e["failures"]) for e in down] == [(0.0, 1), (60.0, 61), (120.0, 121), (180.0, 181)]
    assert all(e["url"] == "redis://:****@r:6379/0" and e["log_level"] == "warning" for e in down)
    up = [e for e in logs if e["event"] == "redis_reachable"]
    assert [(e["down_s"], e["failures"]) for e in up] == [(190.0, 181)]


def wait_for_event(logs: list[dict[str, Any]], event: str, count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(e["event"] == event for e in logs) < count:
        assert time.monotonic() < deadline, f"no {count} x {event}: {[e['event'] for e in logs]}"
        time.sleep(0.05)


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def test_a_redis_down_at_startup_then_up_then_down_is_said_once_each_time(
    stub_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    # a user and a password (Redis's default user takes any password while it has none)
    url = f"redis://default:s3cret@127.0.0.1:{port}/0"
    shown = f"redis://default:****@127.0.0.1:{port}/0"
    settings = gateway_settings(url, stub_model_dir, [])
    settings.redis.quota_lease_s = 0.5  # the invalidation follower runs (and retries every second)
    app = create_app(settings)
    with capture_logs() as logs, ThreadedServer(app):
        wait_for_event(logs, "redis_unreachable", 1)
        time.sleep(3.0)  # three more failed pings: no more lines
        assert len(events(logs, "redis_unreachable")) == 1
        assert len(events(logs, "auth_invalidations_lost")) == 1  # not one per retry
        (down,) = events(logs, "redis_unreachable")
        assert down["url"] == shown and down["log_level"] == "warning"
        assert "Error" in down["error"]
        with redis_server(tmp_path, port):
            wait_for_event(logs, "redis_reachable", 1)
            time.sleep(1.5)
            assert len(events(logs, "redis_reachable")) == 1
            assert events(logs, "redis_reachable")[0]["url"] == shown
        wait_for_event(logs, "redis_unreachable", 2)
        time.sleep(2.0)
        assert len(events(logs, "redis_unreachable")) == 2
    assert "s3cret" not in json.dumps(logs, default=str)
