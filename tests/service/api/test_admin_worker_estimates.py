"""``GET /admin/workers`` shows the engine TTFT model admission predicts with under names that say what each
number is: ``ttft_base_ms`` (its fixed part, not a TTFT), ``prefill_ms_per_1k_tokens`` (its per-token part)
and ``idle_ttft_ms`` (the TTFT it predicts for 1,000 uncached prompt tokens on an idle worker). It showed
the fixed part alone as ``engine_ttft_ms``, about 4 ms on a worker whose prefills took 150-250 ms, and the
runbook compared that with the class goal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_api import auth, chat, new_tenant
from tests.support.fake_worker import FakeWorker
from tests.support.gateway import fake_worker_settings
from tests.support.servers import ThreadedServer

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MODEL_FIELDS = ("ttft_base_ms", "prefill_ms_per_1k_tokens", "idle_ttft_ms")


@pytest.fixture
def gateway(redis_url: str, stub_model_dir: Path) -> Iterator[tuple[httpx.Client, FakeWorker]]:
    fake = FakeWorker()
    with ThreadedServer(fake.app) as upstream:
        settings = fake_worker_settings(redis_url, stub_model_dir, upstream.url, "worker-estimates:")
        with (
            ThreadedServer(create_app(settings)) as server,
            httpx.Client(base_url=server.url, timeout=30) as http,
        ):
            yield http, fake


def listed(http: httpx.Client) -> dict[str, Any]:
    (worker,) = http.get("/admin/workers", headers=ADMIN).json()["data"]
    return dict(worker)


def test_admin_workers_name_the_ttft_models_parts(gateway: tuple[httpx.Client, FakeWorker]) -> None:
    http, fake = gateway
    before = listed(http)
    assert "engine_ttft_ms" not in before
    assert [before[name] for name in MODEL_FIELDS] == [None, None, None]  # nothing measured yet
    _, key = new_tenant(http)
    fake.delay_s = 0.05  # each first token 50 ms after the worker takes the request
    for content in ["word " * 1100, "hello there"] * 3:  # long prefills teach the per-token part
        with http.stream(
            "POST", "/v1/chat/completions", json=chat(content, stream=True, max_tokens=1), headers=auth(key)
        ) as resp:
            assert resp.status_code == 200
            resp.read()
    after = listed(http)
    base, per_1k, idle = (after[name] for name in MODEL_FIELDS)
    assert base is not None and per_1k is not None and per_1k > 0
    assert idle == pytest.approx(
        base + per_1k, abs=0.002
    )  # 1,000 tokens at the per-token part, plus the base
    # the part of a first token that prefill tokens do not explain: the fake worker's 50 ms, whatever the
    # prompt's length, plus the call's own time (a few ms, more on a loaded machine): neither 0 nor a multiple
    assert 25 < base < 100
