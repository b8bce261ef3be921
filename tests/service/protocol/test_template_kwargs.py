"""Issue 25 item 10: ``chat_template_kwargs`` (SGLang / vLLM) reaches the gateway's chat template renderer
(the worker gets the rendered text), the prompt charged is the prompt it rendered, and its bounds are 400s
naming it, with nothing sent or charged (was: 400 ``unknown_parameter`` for any value)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.pipeline.prompting import PromptRenderer
from service.protocol.template_kwargs import MAX_BYTES, MAX_DEPTH, MAX_KWARGS
from tests.service.api.test_api import (
    MODEL,
    assert_openai_error,
    auth,
    chat,
    gateway_settings,
    new_tenant,
    usage_of,
)
from tests.support.fake_worker import FakeWorker
from tests.support.model_stub import write_stub_model
from tests.support.servers import ThreadedServer

THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think> skipped </think>\n{% endif %}"
    "{% if persona is defined %}[{{ persona }}] {% endif %}{% endif %}"
)
"""Qwen 3's switch in small: ``enable_thinking: false`` writes an empty thinking block; ``persona`` is
printed as given."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_stub_model(tmp_path_factory.mktemp("thinking-model"))
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def gateway(redis_url: str, model_dir: Path, fake: tuple[FakeWorker, str]) -> Iterator[str]:
    settings = gateway_settings(redis_url, model_dir, [fake[1]], max_body_bytes=65536)
    with ThreadedServer(create_app(settings)) as server:
        yield server.url


@pytest.fixture
def worker(fake: tuple[FakeWorker, str]) -> FakeWorker:
    fake[0].received.clear()
    return fake[0]


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


PLAIN = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("kwargs", "prompt"),
    [
        (None, PLAIN),
        ({}, PLAIN),
        ({"enable_thinking": True}, PLAIN),
        ({"enable_thinking": False}, PLAIN + "<think> skipped </think>\n"),
        ({"enable_thinking": False, "persona": "pirate"}, PLAIN + "<think> skipped </think>\n[pirate] "),
        ({"unused": {"a": [1, 2]}}, PLAIN),
    ],
)
def test_the_template_renders_with_the_kwargs_and_the_charge_follows_the_rendered_prompt(
    http: httpx.Client,
    worker: FakeWorker,
    model_dir: Path,
    kwargs: dict[str, Any] | None,
    prompt: str,
    stream: bool,
) -> None:
    tenant_id, key = new_tenant(http)
    extra = {} if kwargs is None else {"chat_template_kwargs": kwargs}
    resp = http.post(
        "/v1/chat/completions", json=chat(max_tokens=2, stream=stream, **extra), headers=auth(key)
    )
    assert resp.status_code == 200, resp.text
    (sent,) = worker.received
    assert sent["text"] == prompt
    assert "chat_template_kwargs" not in sent  # the worker gets text: the gateway rendered it
    words = len(prompt.split())  # the fake worker's count of the prompt it got, charged as the worker's
    assert usage_of(http, tenant_id)["prompt_tokens"] == words
    if not stream:
        assert resp.json()["usage"]["prompt_tokens"] == words
    # the reservation is the gateway's own count of the rendered prompt: a burst one token short says so
    counted = PromptRenderer(model_dir).count(prompt)
    _, short = new_tenant(http, quotas={"tokens_per_min": 1, "token_burst": counted + 2 - 1})
    resp = http.post(
        "/v1/chat/completions", json=chat(max_tokens=2, stream=stream, **extra), headers=auth(short)
    )
    err = assert_openai_error(resp, 413, "request_exceeds_burst")
    assert f"needs {counted + 2} tokens (prompt {counted} + max_tokens 2)" in err["message"]


def _nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


BAD: list[tuple[str, Any, str]] = [
    ("not an object", ["enable_thinking"], "valid dictionary"),
    ("a string", "enable_thinking=false", "valid dictionary"),
    ("too many entries", {f"k{i}": True for i in range(MAX_KWARGS + 1)}, f"at most {MAX_KWARGS}"),
    ("messages", {"messages": []}, "set by the gateway"),
    ("tools", {"tools": None}, "set by the gateway"),
    ("add_generation_prompt", {"add_generation_prompt": False}, "set by the gateway"),
    ("bos_token", {"bos_token": "<s>"}, "set by the gateway"),
    ("a Jinja global", {"namespace": 1}, "set by the gateway"),
    ("raise_exception", {"raise_exception": 1}, "set by the gateway"),
    ("not a variable name", {"enable-thinking": False}, "not a template variable name"),
    ("an empty name", {"": False}, "not a template variable name"),
    ("too deep", {"deep": _nested(MAX_DEPTH + 1)}, f"deeper than {MAX_DEPTH}"),
    ("too large", {"persona": "x" * MAX_BYTES}, f"{MAX_BYTES} bytes"),
    ("a lone surrogate", {"persona": "\ud800"}, "valid Unicode"),
]


@pytest.mark.parametrize(("case", "kwargs", "says"), BAD, ids=[b[0] for b in BAD])
def test_kwargs_out_of_bounds_get_400_naming_them_and_cost_nothing(
    http: httpx.Client, worker: FakeWorker, case: str, kwargs: Any, says: str
) -> None:
    tenant_id, key = new_tenant(http)
    body = chat(max_tokens=2, chat_template_kwargs=kwargs)
    raw = httpx.Request("POST", "/", json=body).content if case != "a lone surrogate" else None
    if raw is None:  # httpx refuses to encode a lone surrogate; send its JSON escape as a client may
        raw = (
            b'{"model": "'
            + MODEL.encode()
            + b'", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],'
            b' "chat_template_kwargs": {"persona": "\\ud800"}}'
        )
    headers = {**auth(key), "Content-Type": "application/json"}
    err = assert_openai_error(http.post("/v1/chat/completions", content=raw, headers=headers), 400)
    assert err["param"] == "chat_template_kwargs", err
    assert says in err["message"], err
    assert worker.received == []
    assert usage_of(http, tenant_id)["requests"] == 0


def test_text_completions_do_not_take_chat_template_kwargs(http: httpx.Client, worker: FakeWorker) -> None:
    _, key = new_tenant(http)
    req = {
        "model": MODEL,
        "prompt": "one two",
        "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    err = assert_openai_error(
        http.post("/v1/completions", json=req, headers=auth(key)), 400, "unknown_parameter"
    )
    assert err["param"] == "chat_template_kwargs" and worker.received == []
