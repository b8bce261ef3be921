"""A flapping deep probe never ejects a worker that serves (issue 8, item 2), over HTTP.

One worker, a deep probe (``/health_generate``) every round, a short health interval; ``/health_generate``
answers 500 for about 1 s while requests keep coming. Every request must succeed: no
``no_worker_available``, no breaker opening.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_api import MODEL, auth, chat, new_tenant
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeWorker, str]]:
    worker = FakeWorker()
    with ThreadedServer(worker.app) as server:
        yield worker, server.url


@pytest.mark.parametrize("breaker_failures", [5, 1])
def test_failing_deep_probe_does_not_eject_a_serving_worker(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str], breaker_failures: int
) -> None:
    worker, url = fake
    worker.deep_status, worker.deep_probes = 200, 0
    settings = Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": f"hvt{breaker_failures}:"},
            "engine": {"served_model_name": MODEL},
            "upstream": {
                "workers": [url],
                "health_interval_s": 0.1,
                "deep_probe_every": 1,
                "breaker_failures": breaker_failures,
            },
            "api": {"tokenizer_path": str(stub_model_dir)},
        }
    )
    app = create_app(settings)
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        _, key = new_tenant(http)
        first = http.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth(key))
        assert first.status_code == 200, first.text

        def flap() -> None:
            time.sleep(0.3)
            worker.deep_status = 500
            time.sleep(1.0)
            worker.deep_status = 200

        before = worker.deep_probes
        flapper = threading.Thread(target=flap)
        flapper.start()
        statuses: list[int] = []
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            resp = http.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth(key))
            statuses.append(resp.status_code)
            assert resp.status_code == 200, resp.text
            time.sleep(0.02)
        flapper.join()
        # the deep probe really failed several times in a row meanwhile
        assert worker.deep_probes - before >= 8
        assert len(statuses) >= 20
        metrics = http.get("/metrics").text
        assert 'state="open"' not in metrics
