"""Stream deltas come from what the worker says it sends, never from the text's shape (issue 8, item 7).

SGLang streams cumulative ``text``/``output_ids`` by default and deltas with
``--incremental-streaming-output``; the client learns which from ``/server_info``. Here a fake worker
plays both modes with repetition-heavy tokens (``"0"`` after ``"0"``), the case the old guess dropped;
``tests/engine/test_engine_streaming.py`` does the same against the real engine in both modes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config.settings import Settings, UpstreamSettings
from service.workers.answers import StreamDeltas
from service.workers.client import SGLangClient
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_api import MODEL, auth, new_tenant
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

REPEATING = ["1", ",", "0", "0", "0", ",", "0", "0", "0", "\n", "\n", "0"]  # "1,000,000\n\n0"


def chunks(pieces: list[str], incremental: bool) -> list[dict[str, Any]]:
    """SGLang's stream chunks for ``pieces`` (one token each), in either mode."""
    out = []
    for i in range(1, len(pieces) + 1):
        text = pieces[i - 1] if incremental else "".join(pieces[:i])
        ids = [i - 1] if incremental else list(range(i))
        out.append({"text": text, "output_ids": ids, "meta_info": {"completion_tokens": i}})
    return out


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("known", [True, False])
def test_deltas_rebuild_the_text_and_token_ids_in_either_mode(incremental: bool, known: bool) -> None:
    deltas = StreamDeltas(incremental if known else None)  # unknown: the token counts tell
    texts, ids = [], []
    for payload in chunks(REPEATING, incremental):
        text, new_ids = deltas.step(payload)
        texts.append(text)
        ids.extend(new_ids or ())
    assert texts == REPEATING  # every repeated "0" and "\n" is kept, one per chunk
    assert ids == list(range(len(REPEATING)))


def test_coalesced_incremental_chunks_and_chunks_without_text_keep_everything() -> None:
    deltas = StreamDeltas(True)  # SGLang joins queued deltas into one chunk: two tokens at once
    steps = [
        {"text": "00", "output_ids": [5, 5], "meta_info": {"completion_tokens": 2}},
        {"text": "0", "output_ids": [5], "meta_info": {"completion_tokens": 3}},
    ]
    assert [deltas.step(p) for p in steps] == [("00", (5, 5)), ("0", (5,))]
    cumulative = StreamDeltas(False)
    steps = [
        {"text": "ab", "output_ids": [1, 2], "meta_info": {"completion_tokens": 2}},
        {"text": None, "output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 3}},  # text withheld
        {"text": "abc", "output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 3}},
    ]
    assert [cumulative.step(p) for p in steps] == [("ab", (1, 2)), ("", (3,)), ("c", ())]


def gateway_settings(redis_url: str, model_dir: Path, workers: list[str], prefix: str) -> Settings:
    return Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": prefix},
            "engine": {"served_model_name": MODEL},
            "upstream": {"workers": workers, "health_interval_s": 0.2, "max_attempts": 2},
            "routing": {"policy": "round_robin"},
            "api": {"tokenizer_path": str(model_dir)},
        }
    )


@pytest.fixture(scope="module", params=[False, True], ids=["cumulative", "incremental"])
def repeating_gateway(
    request: pytest.FixtureRequest, redis_url: str, stub_model_dir: Path
) -> Iterator[tuple[FakeWorker, str]]:
    worker = FakeWorker()
    worker.tokens = list(REPEATING)
    worker.server_info = {"incremental_streaming_output": request.param}
    with ThreadedServer(worker.app) as fake:
        app = create_app(gateway_settings(redis_url, stub_model_dir, [fake.url], f"modes{request.param}:"))
        with ThreadedServer(app) as server:
            yield worker, server.url


def streamed_text(http: httpx.Client, route: str, body: dict[str, Any]) -> str:
    with http.stream("POST", route, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        events = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: {")]
    if route.endswith("chat/completions"):
        return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


def test_stream_equals_non_stream_with_repeated_tokens_in_both_modes(
    repeating_gateway: tuple[FakeWorker, str],
) -> None:
    worker, url = repeating_gateway
    with httpx.Client(base_url=url, timeout=30) as http:
        _, key = new_tenant(http)
        http.headers.update(auth(key))
        for route, body in (
            ("/v1/completions", {"model": MODEL, "prompt": "One million is", "max_tokens": 12}),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
        ):
            whole = http.post(route, json=body).json()["choices"][0]
            expected = whole.get("text", whole.get("message", {}).get("content"))
            assert expected == "".join(REPEATING)
            assert streamed_text(http, route, body) == expected
    assert worker.info_requests >= 1


async def test_the_mode_is_learned_once_and_again_after_the_worker_was_down() -> None:
    worker = FakeWorker()
    worker.tokens = list(REPEATING)
    worker.server_info = {"incremental_streaming_output": False}
    body = {"text": "x", "sampling_params": {"max_new_tokens": 12}}
    with ThreadedServer(worker.app) as fake:
        async with SGLangClient(UpstreamSettings(read_timeout_s=10.0)) as client:
            assert await client.probe(fake.url) == "ok"
            assert await client.probe(fake.url) == "ok"
            assert worker.info_requests == 1  # learned on first contact, then cached
            known = client.known_info(fake.url)
            assert known is not None and known.incremental_streaming is False
            # the worker restarts with --incremental-streaming-output
            worker.up = False
            assert await client.probe(fake.url) == "failed"
            assert client.known_info(fake.url) is None  # seen down: forgotten
            worker.server_info = {"incremental_streaming_output": True}
            worker.up = True
            assert await client.probe(fake.url) == "ok"
            known = client.known_info(fake.url)
            assert known is not None and known.incremental_streaming is True
            text = "".join([c.text async for c in client.stream(fake.url, body)])
            assert text == "".join(REPEATING)


def test_a_broken_incremental_stream_resumes_exactly_on_its_token_ids(
    redis_url: str, stub_model_dir: Path
) -> None:
    """Mid-stream resume builds on the generated token ids: with deltas they must be appended, not
    taken as the whole list (which would lose all but the last and fall back to resuming on text)."""
    a, b = FakeWorker(), FakeWorker()
    for worker in (a, b):
        worker.server_info = {"incremental_streaming_output": True}
    a.mode = "break_after_2"
    with ThreadedServer(a.app) as fa, ThreadedServer(b.app) as fb:
        app = create_app(gateway_settings(redis_url, stub_model_dir, [fa.url, fb.url], "modes-resume:"))
        with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
            _, key = new_tenant(http)
            http.headers.update(auth(key))
            body = {"model": MODEL, "prompt": "one two three", "max_tokens": 6}
            text = streamed_text(http, "/v1/completions", body)
    resumed = b.received[-1]
    assert "text" not in resumed
    prompt_ids = [0, 0, 0]  # the stub tokenizer knows no word: every prompt word is id 0
    assert resumed["input_ids"] == [*prompt_ids, 0, 1]  # + the two ids streamed before the break
    assert resumed["sampling_params"]["max_new_tokens"] == 4
    assert text == "alpha beta" + "alpha beta gamma delta"  # the fake restarts its words
