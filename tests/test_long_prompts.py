"""One tenant's long prompt does not stall the other tenants' requests (``api.offload_body_bytes``).

Counting a long prompt's tokens takes the tokenizer most of a second per megabyte. On the event loop that
second stalls every request of the gateway process; a body over ``api.offload_body_bytes`` is prepared in
a worker thread instead, where the tokenizer releases Python's lock. Checked by order, not by time: a
short request sent while a 3 MB prompt is being counted is answered first.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from service.prompt_cache import BoundedCache
from tests.conftest import ADMIN_TOKEN
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer
from tests.test_api import MODEL, assert_openai_error, auth, new_tenant, usage_of

LONG = "word " * 600_000  # 3 MB, 600,000 tokens of the stub tokenizer: far past the context


def gateway_with(redis_url: str, model_dir: Path, worker: str, offload_body_bytes: int) -> Settings:
    return Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": f"long{offload_body_bytes}:"},
            "engine": {"served_model_name": MODEL},
            "upstream": {"workers": [worker], "health_interval_s": 0.2},
            "api": {
                "tokenizer_path": str(model_dir),
                "context_length": 512,
                "max_body_bytes": 4_000_000,
                "offload_body_bytes": offload_body_bytes,
            },
        }
    )


@pytest.fixture(scope="module")
def fake() -> Iterator[str]:
    with ThreadedServer(FakeWorker().app) as server:
        yield server.url


def finish_order(gateway: str) -> tuple[list[str], httpx.Response, str]:
    """Send the long prompt, then (while it is counted) a short request; the order the answers came in,
    the long prompt's answer and its tenant."""
    with httpx.Client(base_url=gateway, timeout=60) as http:
        tenant_id, key = new_tenant(http)
        _, other = new_tenant(http)
    order: list[str] = []
    answers: dict[str, httpx.Response] = {}

    def send(name: str, key: str, content: str) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
        answers[name] = httpx.post(f"{gateway}/v1/chat/completions", json=body, headers=auth(key), timeout=60)
        order.append(name)

    long = threading.Thread(target=send, args=("long", key, LONG))
    long.start()
    time.sleep(0.5)  # the 3 MB body is in; its count takes about 1.5 s on this tokenizer
    send("short", other, "hello there")
    long.join()
    assert answers["short"].status_code == 200, answers["short"].text
    return order, answers["long"], tenant_id


def test_a_long_prompt_is_counted_beside_the_event_loop(
    redis_url: str, stub_model_dir: Path, fake: str
) -> None:
    with ThreadedServer(create_app(gateway_with(redis_url, stub_model_dir, fake, 32_768))) as server:
        order, long, tenant_id = finish_order(server.url)
        assert order == ["short", "long"]  # the short request did not wait for the long count
        err = assert_openai_error(long, 400)
        assert "context" in err["message"] and err["param"] == "messages"
        with httpx.Client(base_url=server.url) as http:
            assert usage_of(http, tenant_id)["prompt_tokens"] == 0  # a 400 costs nothing


def test_the_same_prompt_on_the_event_loop_holds_every_request(
    redis_url: str, stub_model_dir: Path, fake: str
) -> None:
    # the control: with the threshold above the body, the short request waits for the count
    with ThreadedServer(create_app(gateway_with(redis_url, stub_model_dir, fake, 4_000_000))) as server:
        order, long, _ = finish_order(server.url)
        assert order == ["long", "short"]
        assert_openai_error(long, 400)


def test_the_prompt_caches_take_concurrent_threads() -> None:
    cache: BoundedCache[int, int] = BoundedCache(max_weight=64)
    errors: list[BaseException] = []

    def churn(offset: int) -> None:
        try:
            for i in range(20_000):
                cache.put((offset + i) % 97, i, 1 + i % 5)
                cache.get((offset + i * 7) % 97)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between almost every bytecode: an unlocked cache breaks
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    assert cache.weight <= 64 and cache.weight == sum(w for _, w in cache._entries.values())
