"""Gateway replicas share a worker's window (issue 29): together they never offer a worker more requests
than its ``max_running_requests``.

Three gateway apps (each its own admission core, as three processes or pods) share one redis-server and
front one simulated SGLang worker (``smollm2-135m-cpu2``: ``max_running_requests`` 64). A counting
wrapper around the worker's ASGI app records the most ``/generate`` requests it ever had at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from loadgen.sim.profiles import get_profile
from loadgen.sim.server import SimServer
from service.app import create_app
from service.config.settings import Settings
from service.workers.replicas import window_share
from tests.conftest import ADMIN_TOKEN
from tests.support.servers import ThreadedServer

MODEL = "sim-model"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
_prefixes = itertools.count()


@pytest.mark.parametrize("window", [1, 2, 7, 64, 100])
@pytest.mark.parametrize("replicas", [1, 2, 3, 5, 8])
def test_shares_add_up_to_the_window(window: int, replicas: int) -> None:
    ids = [f"r{i}" for i in range(replicas)]
    shares = [window_share(window, ids, me) for me in ids]
    assert min(shares) >= 1
    assert max(shares) - min(shares) <= 1
    # exactly the window when each replica can have a slot; one each (the floor) otherwise
    assert sum(shares) == max(window, replicas)


def test_a_replica_not_yet_listed_counts_itself() -> None:
    assert window_share(64, ["a", "b"], "c") == 21  # three replicas: 22, 21, 21
    assert window_share(64, [], "a") == 64


class PeakConcurrency:
    """Wraps an ASGI app; counts the ``/generate`` requests in progress and keeps their peak."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.now = self.peak = self.total = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate":
            await self.app(scope, receive, send)
            return
        self.now += 1
        self.total += 1
        self.peak = max(self.peak, self.now)
        try:
            await self.app(scope, receive, send)
        finally:
            self.now -= 1


def gateway(redis_url: str, model_dir: Path, worker: str, prefix: str, share: bool) -> ThreadedServer:
    settings = Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": prefix},
            "engine": {"served_model_name": MODEL},
            "upstream": {"workers": [worker], "health_interval_s": 0.2},
            "api": {"tokenizer_path": str(model_dir), "context_length": 4096},
            "scheduler": {"load_poll_interval_s": 0.1},
            "replicas": {"share_windows": share, "heartbeat_s": 0.2, "ttl_s": 2.0},
            "planner": {"enabled": False},
            # serve late: nothing is shed, every request waits its turn for a slot
            "priority_classes": {
                "batch": {
                    "rank": 0,
                    "sglang_priority": 0,
                    "ttft_goal_ms": 60_000,
                    "serve_late": True,
                    "queue_wait_budget_ms": 120_000,
                }
            },
            "default_priority_class": "batch",
        }
    )
    return ThreadedServer(create_app(settings))


@contextlib.contextmanager
def fleet(
    redis_url: str, model_dir: Path, share: bool, replicas: int = 3
) -> Iterator[tuple[PeakConcurrency, list[str]]]:
    sim = SimServer(get_profile("smollm2-135m-cpu2"), model_name=MODEL, speed=5.0)
    counted = PeakConcurrency(sim.app)
    prefix = f"share{next(_prefixes)}:"
    with contextlib.ExitStack() as stack:
        worker = stack.enter_context(ThreadedServer(counted))
        urls = [
            stack.enter_context(gateway(redis_url, model_dir, worker.url, prefix, share)).url
            for _ in range(replicas)
        ]
        yield counted, urls


def windows(urls: list[str]) -> list[int | None]:
    """Each gateway's window on its one worker (``GET /admin/workers``)."""
    out = []
    for url in urls:
        (worker,) = httpx.get(f"{url}/admin/workers", headers=ADMIN, timeout=10).json()["data"]
        out.append(worker["window"])
    return out


def wait_for(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def new_key(url: str) -> str:
    tenant = f"share{next(_prefixes)}"
    body = {"id": tenant, "name": tenant}  # no quotas: unlimited
    resp = httpx.post(f"{url}/admin/tenants", json=body, headers=ADMIN, timeout=10)
    assert resp.status_code == 201, resp.text
    issued = httpx.post(f"{url}/admin/tenants/{tenant}/keys", json={"name": "k"}, headers=ADMIN, timeout=10)
    return str(issued.json()["api_key"])


async def load(urls: list[str], key: str, per_gateway: int) -> list[int]:
    """``per_gateway`` concurrent chats on each gateway at once; their statuses."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count slowly"}],
        "max_tokens": 24,
    }
    limits = httpx.Limits(max_connections=per_gateway * len(urls))
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        calls = [
            http.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            for url in urls
            for _ in range(per_gateway)
        ]
        return [r.status_code for r in await asyncio.gather(*calls)]


def test_three_replicas_never_offer_a_worker_more_than_its_window(
    redis_url: str, stub_model_dir: Path
) -> None:
    with fleet(redis_url, stub_model_dir, share=True) as (worker, urls):
        # 64 over 3 live replicas: 22, 21, 21 (which one gets 22 follows their random ids)
        wait_for(lambda: sorted(w or 0 for w in windows(urls)) == [21, 21, 22])
        statuses = asyncio.run(load(urls, new_key(urls[0]), per_gateway=50))
        assert statuses == [200] * 150
        assert worker.total == 150
        assert 50 < worker.peak <= 64  # busy, and never past max_running_requests
        metrics = httpx.get(f"{urls[0]}/metrics", timeout=10).text
        assert "radixgate_worker_window_requests" in metrics


def test_without_sharing_the_same_load_overfills_the_worker(redis_url: str, stub_model_dir: Path) -> None:
    """The check above can fail: each replica taking the whole window offers the worker up to 3 x 64."""
    with fleet(redis_url, stub_model_dir, share=False) as (worker, urls):
        wait_for(lambda: windows(urls) == [64, 64, 64])
        statuses = asyncio.run(load(urls, new_key(urls[0]), per_gateway=50))
        assert statuses == [200] * 150
        assert worker.peak > 64


def test_a_replica_that_stops_gives_its_share_back(redis_url: str, stub_model_dir: Path) -> None:
    sim = SimServer(get_profile("smollm2-135m-cpu2"), model_name=MODEL, speed=5.0)
    prefix = f"share{next(_prefixes)}:"
    with (
        ThreadedServer(sim.app) as worker,
        gateway(redis_url, stub_model_dir, worker.url, prefix, True) as first,
    ):
        with gateway(redis_url, stub_model_dir, worker.url, prefix, True):
            wait_for(lambda: windows([first.url]) == [32])
        # the second left its heartbeat at once; the first's window grows back as it is used
        wait_for(lambda: windows([first.url])[0] == 32)
        asyncio.run(load([first.url], new_key(first.url), per_gateway=80))
        assert windows([first.url]) == [64]
