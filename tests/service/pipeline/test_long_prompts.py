"""One tenant's long prompt does not stall the other tenants' requests (``api.offload_body_bytes``).

Counting a long prompt's tokens takes the tokenizer most of a second per megabyte. On the event loop that
second stalls every request of the gateway process; a body over ``api.offload_body_bytes`` is prepared in
a worker thread instead, where the tokenizer releases Python's lock. Checked by order, not by time: a
short request sent while a 3 MB prompt is being counted is answered first.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.config.settings import Settings
from service.pipeline.prompt_cache import BoundedCache
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_api import MODEL, assert_openai_error, auth, new_tenant, usage_of
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

LONG = "word " * 600_000  # 3 MB, 600,000 tokens of the stub tokenizer: far past the context


def gateway_with(
    redis_url: str, model_dir: Path, worker: str, offload_body_bytes: int, **api: int
) -> Settings:
    return Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": f"long{offload_body_bytes}{len(api)}:"},
            "engine": {"served_model_name": MODEL},
            "upstream": {"workers": [worker], "health_interval_s": 0.2},
            "api": {
                "tokenizer_path": str(model_dir),
                "context_length": 512,
                "max_body_bytes": 4_000_000,
                "offload_body_bytes": offload_body_bytes,
                **api,
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


MEDIUM = "word " * 20_000
"""A 100 kB prompt: offloaded, counted in a moment (and past the 512-token context as well)."""


def one_at_a_time(redis_url: str, stub_model_dir: Path, fake: str) -> Settings:
    """A gateway that prepares one long prompt at a time and lets each tenant have one waiting."""
    return gateway_with(
        redis_url, stub_model_dir, fake, 32_768, max_offloaded_prepares=1, max_offload_waiting_per_tenant=1
    )


def test_one_tenant_may_have_only_so_many_long_prompts_waiting(
    redis_url: str, stub_model_dir: Path, fake: str
) -> None:
    """One preparation at a time, one waiter per tenant: while tenant a's 3 MB prompt is counted, its
    second long prompt waits, its third is refused (429, nothing charged), and tenant b's still waits its
    turn and is answered."""
    settings = one_at_a_time(redis_url, stub_model_dir, fake)
    with (
        ThreadedServer(create_app(settings)) as server,
        httpx.Client(base_url=server.url, timeout=60) as http,
    ):
        tenant_a, key_a = new_tenant(http)
        _, key_b = new_tenant(http)
        answers: dict[str, httpx.Response] = {}

        def send(name: str, key: str, content: str) -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
            answers[name] = http.post("/v1/chat/completions", json=body, headers=auth(key))

        threads = [threading.Thread(target=send, args=("a1", key_a, LONG))]
        threads[0].start()
        time.sleep(0.5)  # a1's count has started (about 1.5 s)
        for name, key in (("a2", key_a), ("b1", key_b)):
            threads.append(threading.Thread(target=send, args=(name, key, MEDIUM)))
            threads[-1].start()
        time.sleep(0.2)
        send("a3", key_a, MEDIUM)
        assert_openai_error(answers["a3"], 429, "too_many_long_prompts")
        assert answers["a3"].headers["retry-after"] == "1"
        for thread in threads:
            thread.join()
        for name in ("a1", "a2", "b1"):  # all counted in turn: each past the 512-token context
            assert_openai_error(answers[name], 400, "context_length_exceeded")
        assert usage_of(http, tenant_a)["requests"] == 0


def test_a_client_that_leaves_while_its_long_prompt_waits_gives_up_its_place(
    redis_url: str, stub_model_dir: Path, fake: str
) -> None:
    """One preparation at a time, one waiter per tenant: while tenant a's 3 MB prompt is counted, its
    second long prompt waits and its client leaves; that place is free again at once, so a third long
    prompt of the same tenant waits its turn (not 429) and is answered."""
    settings = one_at_a_time(redis_url, stub_model_dir, fake)
    with (
        ThreadedServer(create_app(settings)) as server,
        httpx.Client(base_url=server.url, timeout=60) as http,
    ):
        _, key = new_tenant(http)
        answers: dict[str, httpx.Response] = {}

        def send(name: str, content: str, timeout: float = 60) -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
            with contextlib.suppress(httpx.TimeoutException):  # the client left
                answers[name] = httpx.post(
                    f"{server.url}/v1/chat/completions", json=body, headers=auth(key), timeout=timeout
                )

        first = threading.Thread(target=send, args=("a1", LONG))
        first.start()
        time.sleep(0.5)  # a1's count has started (about 1.5 s)
        send("a2", MEDIUM, timeout=0.3)  # waits behind a1, then its client leaves
        assert "a2" not in answers
        time.sleep(0.2)
        send("a3", MEDIUM)
        first.join()
        assert_openai_error(answers["a3"], 400, "context_length_exceeded")
