"""The context length ``/v1/models`` shows is the one a request is held to: the most prompt + ``max_tokens`` a
client may ask for, the number a ``context_length_exceeded`` refusal names. It showed the workers' model
context (8,192) while requests were refused above 8,190 (SGLang keeps a reserve: ``max_req_len =
context_len - 1``, ``max_req_input_len = max_req_len - 5``; service/workers/worker_info.py)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.config.models import DEFAULT_CONTEXT_LENGTH
from service.pipeline.served_models import usable_limits
from service.workers.worker_info import TokenLimits, WorkerInfo
from tests.service.api.test_api import MODEL, assert_openai_error, auth, new_tenant
from tests.support.fake_worker import FakeWorker
from tests.support.gateway import fake_worker_settings
from tests.support.servers import ThreadedServer

SGLANG_8192 = {"context_length": 8192, "max_req_input_len": 8186}
"""What SGLang 0.5.23 reports on ``/server_info`` for a model of context 8,192 (``--context-length``)."""


@pytest.mark.parametrize(
    ("setting", "reported", "expected"),
    [
        (None, None, TokenLimits(DEFAULT_CONTEXT_LENGTH - 1, DEFAULT_CONTEXT_LENGTH)),  # neither says
        (None, TokenLimits(8185, 8190), TokenLimits(8185, 8190)),  # the workers', their reserve kept
        (None, TokenLimits(131_065, 131_070), TokenLimits(131_065, 131_070)),  # never a smaller default
        (4096, TokenLimits(8185, 8190), TokenLimits(4095, 4096)),  # the setting, when smaller
        (8192, TokenLimits(8185, 8190), TokenLimits(8185, 8190)),  # the workers', when smaller
        (16_384, None, TokenLimits(16_383, 16_384)),
    ],
)
def test_usable_limits_are_the_smaller_of_the_setting_and_the_workers(
    setting: int | None, reported: TokenLimits | None, expected: TokenLimits
) -> None:
    assert usable_limits(setting, reported) == expected


def test_sglang_reports_a_context_of_8192_as_8190_usable_tokens() -> None:
    assert WorkerInfo.parse(SGLANG_8192).limits == TokenLimits(8185, 8190)


@pytest.fixture
def gateway(redis_url: str, stub_model_dir: Path) -> Iterator[tuple[httpx.Client, FakeWorker]]:
    """A gateway (no context length set) in front of a fake worker that reports SGLang's 8,192 limits."""
    fake = FakeWorker()
    fake.server_info = dict(SGLANG_8192)
    with ThreadedServer(fake.app) as upstream:
        settings = fake_worker_settings(redis_url, stub_model_dir, upstream.url, "usable-context:")
        with (
            ThreadedServer(create_app(settings)) as server,
            httpx.Client(base_url=server.url, timeout=30) as http,
        ):
            deadline = time.monotonic() + 30  # the worker probed healthy: what it reports is learned
            while http.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, "the gateway never saw its worker healthy"
                time.sleep(0.05)
            yield http, fake


def test_models_shows_the_context_the_refusal_names(gateway: tuple[httpx.Client, FakeWorker]) -> None:
    http, fake = gateway
    _, key = new_tenant(http)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    over = http.post("/v1/chat/completions", json=body | {"max_tokens": 8190}, headers=auth(key))
    err = assert_openai_error(over, 400, "context_length_exceeded")
    found = re.fullmatch(
        r"prompt \((\d+)\) \+ max_tokens \(8190\) exceeds the context length \((\d+)\)\.", err["message"]
    )
    assert found is not None, err
    prompt, enforced = int(found.group(1)), int(found.group(2))
    assert enforced == 8190
    listed = http.get("/v1/models", headers=auth(key)).json()["data"]
    assert [m["context_length"] for m in listed] == [enforced]
    assert http.get(f"/v1/models/{MODEL}", headers=auth(key)).json()["context_length"] == enforced
    # what /v1/models shows is usable to the last token: prompt + max_tokens = context_length is served
    fitting = http.post(
        "/v1/chat/completions", json=body | {"max_tokens": enforced - prompt}, headers=auth(key)
    )
    assert fitting.status_code == 200, fitting.text
    assert fake.received[-1]["sampling_params"]["max_new_tokens"] == enforced - prompt
