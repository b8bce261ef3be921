"""The gateway's planner task (issue 29): ``radixgate_desired_workers{model}`` rises under load against a
simulated worker and falls back after it, slowly (hysteresis); replicas' measures combine into one."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import httpx
import pytest

from policies.planner import Reason
from service.observability.planner_metrics import REASONS
from service.pipeline.planner_task import combine
from tests.conftest import ADMIN_TOKEN
from tests.support.prometheus import SimStack

PRIOR_RPS = 5.0  # the profiled capacity the planner plans with until a worker is measured running full


def test_the_reason_label_values_are_the_planners() -> None:
    assert get_args(Reason) == REASONS


def test_replicas_measures_add_up_and_engine_measures_average() -> None:
    a = {
        "classes": {"interactive": [4.0, 100.0, 10.0, 2.0], "batch": [0.0, 500.0, 50.0, 0.0]},
        "capacity": 10.0,
        "window": 64,
        "batch": 30.0,
        "kv": 0.5,
        "tokens": [1000, 400],
    }
    b = {
        "classes": {"interactive": [2.0, 400.0, 40.0, 1.0]},
        "capacity": None,  # not measured running full on that replica
        "window": 64,
        "batch": 34.0,
        "kv": 0.7,
        "tokens": [500, 100],
    }
    m = combine([a, b])
    rate, prompt, output, queued = m["classes"]["interactive"]
    assert (rate, queued) == (6.0, 3.0)
    assert prompt == pytest.approx((4 * 100 + 2 * 400) / 6) and output == pytest.approx((4 * 10 + 2 * 40) / 6)
    assert m["classes"]["batch"] == [0.0, 500.0, 50.0, 0.0]
    assert m["capacity"] == 10.0 and m["window"] == 64  # one engine, seen from two replicas
    assert m["batch"] == pytest.approx(32.0) and m["kv"] == pytest.approx(0.6)
    assert m["tokens"] == [1500, 500]


def gauge(text: str, name: str, **labels: str) -> float | None:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and ",".join(sorted(match.group(1).split(","))) == wanted:
            return float(match.group(2))
    return None


@pytest.fixture
def stack(redis_url: str, stub_model_dir: Path) -> Iterator[SimStack]:
    planner = {
        "interval_s": 0.2,
        "prior_capacity_rps": PRIOR_RPS,
        "cold_start_s": 0.0,
        "scale_down_window_s": 2.0,
        "forecast_median_samples": 1,
        "forecast_level_tau_s": 0.3,
        "forecast_trend_tau_s": 1.0,
        # 0.2 s samples of 30 requests/s count 6 requests each: the noise band (two standard errors of
        # such counts, 6 workers' worth here) would hold the decision; the plumbing is under test
        "scale_up_z": 0.0,
        "scale_down_z": 0.0,
        "min_workers": 1,
        "max_workers": 20,
    }
    with SimStack(redis_url, stub_model_dir, workers=1, planner=planner) as s:
        yield s


def send_load(stack: SimStack, key: str, rps: float, seconds: float) -> list[int]:
    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
            calls = []
            start = time.monotonic()
            i = 0
            while time.monotonic() - start < seconds:
                body = stack.chat(f"question {i}", max_tokens=4)
                calls.append(
                    asyncio.ensure_future(
                        http.post(
                            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                        )
                    )
                )
                i += 1
                await asyncio.sleep(max(0.0, start + i / rps - time.monotonic()))
            return [r.status_code for r in await asyncio.gather(*calls)]

    return asyncio.run(run())


def test_desired_workers_rise_under_load_and_fall_back_slowly(stack: SimStack) -> None:
    model = SimStack.MODEL
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        key = stack.new_key(http)

        def read() -> tuple[float | None, float | None, str | None]:
            text = http.get("/metrics").text
            reason = next(
                (r for r in REASONS if gauge(text, "radixgate_planner_reason", model=model, reason=r) == 1),
                None,
            )
            return (
                gauge(text, "radixgate_desired_workers", model=model),
                gauge(text, "radixgate_planner_needed_workers", model=model),
                reason,
            )

        time.sleep(0.5)
        assert read() == (1.0, 0.0, "floor")  # idle: the floor
        seen: list[tuple[float | None, float | None, str | None]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                seen.append(read())
                time.sleep(0.1)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            statuses = send_load(stack, key, rps=30.0, seconds=3.0)
        finally:
            stop.set()
            watcher.join()
        assert statuses.count(200) == len(statuses)
        peak = max(d or 0 for d, _, _ in seen)
        # 30 requests/s over a capacity of 5 per worker at 90 %: about 7 workers
        assert 5 <= peak <= 9, seen
        assert any(r == "up" for _, _, r in seen)
        # the load is gone: the need falls at once, the decision holds for the scale-down window first. It is
        # the largest raw decision of the last window, which may step down from the peak by one as the load's
        # own early peak leaves the window ("down" to that maximum, never to the need), so either reason holds
        # while the decision stays far above what the need alone gives.
        time.sleep(0.6)
        desired, needed, reason = read()
        peak_need = max(n or 0 for _, n, _ in seen)
        assert needed is not None and needed < 0.5 * peak_need
        assert desired is not None and desired >= peak - 1 and reason in ("stabilizing", "down")
        assert desired > needed / 0.9 + 1, (desired, needed)
        deadline = time.monotonic() + 6.0
        while read()[0] != 1.0:
            assert time.monotonic() < deadline, read()
            time.sleep(0.1)
        assert read() == (1.0, 0.0, "floor")


def test_admin_planner_shows_each_models_last_decision(stack: SimStack) -> None:
    """``GET /admin/planner``: the decision the series publish, with each class's part; admin only."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        key = stack.new_key(http)
        assert http.get("/admin/planner").status_code == 401
        assert http.get("/admin/planner", headers={"Authorization": f"Bearer {key}"}).status_code in (
            401,
            403,
        )
        assert send_load(stack, key, rps=20.0, seconds=1.0).count(200) == 20
        time.sleep(0.5)  # a tick or two after the load
        answer = http.get("/admin/planner", headers=admin)
        desired = gauge(http.get("/metrics").text, "radixgate_desired_workers", model=SimStack.MODEL)
    assert answer.status_code == 200
    body = answer.json()
    assert body["object"] == "list" and body["interval_s"] == 0.2
    [entry] = body["data"]
    decision = entry["decision"]
    assert entry["model"] == SimStack.MODEL and decision is not None
    assert decision["reason"] in get_args(Reason)
    assert abs(decision["desired"] - (desired or 0)) <= 1  # the gauge may be one tick apart
    assert decision["raw"] >= 1 and decision["needed_now"] >= 0.0
    part = decision["classes"]["standard"]  # the classes of the model, each with its part
    assert set(decision["classes"]) >= {"standard"}
    assert part["arrival_rps"] > 0 and part["capacity_rps"] == pytest.approx(PRIOR_RPS, rel=0.5)


def test_admin_planner_is_404_when_the_planner_is_off(redis_url: str, stub_model_dir: Path) -> None:
    with SimStack(redis_url, stub_model_dir, workers=1, planner={"enabled": False}) as s:
        answer = httpx.get(f"{s.url}/admin/planner", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "planner_disabled"
