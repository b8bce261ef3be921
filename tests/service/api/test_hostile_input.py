"""Hostile bodies get short answers (issue 31): a body invalid in 10,000 places, a 200,000-character unknown
parameter, 10,000 content parts or tools, JSON nested 100,000 deep, on every route that takes a body, is
answered 400 in OpenAI's shape with one error of bounded size; and URLs inside messages (``image_url``,
``input_image``, file parts) are refused with 400 naming the part, never fetched: a listener on a loopback
port sees no connection."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from service.app import create_app
from service.protocol.errors import MAX_MESSAGE_CHARS, MAX_PARAM_CHARS
from tests.conftest import ADMIN_TOKEN, MODEL, gateway_settings
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_ANSWER_BYTES = 1600  # the four fields, a message of at most 1,000 characters and a param of 256
_ids = itertools.count()


@pytest.fixture(scope="module")
def http(redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]) -> Iterator[httpx.Client]:
    settings = gateway_settings(redis_url, stub_model_dir, [fake[1]], max_body_bytes=1_048_576)
    with (
        ThreadedServer(create_app(settings)) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def key(http: httpx.Client) -> dict[str, str]:
    tenant = f"hostile{next(_ids)}"
    assert http.post("/admin/tenants", json={"id": tenant, "name": tenant}, headers=ADMIN).status_code == 201
    issued = http.post(f"/admin/tenants/{tenant}/keys", json={"name": "k"}, headers=ADMIN)
    return {"Authorization": f"Bearer {issued.json()['api_key']}"}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


LONG_NAME = "x" * 200_000
LONG_PARAM = LONG_NAME[: MAX_PARAM_CHARS - 1] + "…"  # the name, cut
BAD_PART = {"type": "bogus", "text": 7}
DEEP = "[" * 100_000 + "]" * 100_000


def deep_in(field: str, depth: int, route: str = "chat") -> str:
    """A body with ``field`` nested ``depth`` levels deep (objects), raw JSON."""
    nested = '{"a":' * depth + "1" + "}" * depth
    head = '"input": "hi"' if route == "responses" else '"messages": [{"role": "user", "content": "hi"}]'
    return f'{{"model": "{MODEL}", {head}, "{field}": {nested}}}'


# (route, body as JSON or raw bytes, the param named, or None when the body is not JSON)
HOSTILE: list[tuple[str, str, Any, str | None]] = [
    (
        "unknown parameter, 200k name",
        "/v1/chat/completions",
        chat(**{LONG_NAME: 1}),
        LONG_PARAM,
    ),
    (
        "10k invalid parts",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [BAD_PART] * 10_000}]),
        "messages.0.content",
    ),
    (
        "1k parts, each invalid",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [BAD_PART] * 1000}]),
        "messages.0.content.0.type",
    ),
    (
        "2k messages, each invalid 4 ways",
        "/v1/chat/completions",
        chat(messages=[{"role": "nobody", "content": 7, "name": [], "x": 1}] * 2000),
        "messages.0.name",
    ),
    (
        "10k messages",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "a"}] * 10_000),
        "messages",
    ),
    (
        "10k tools",
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": 1}}] * 10_000),
        "tools",
    ),
    ("JSON nested 100k deep", "/v1/chat/completions", DEEP, None),
    # under the decoders' own limit (~1,000), over what code that walks a value recursively takes (~900)
    ("tools nested 1,020 deep", "/v1/chat/completions", deep_in("tools", 1020), None),
    ("tool_choice nested 1,020 deep", "/v1/responses", deep_in("tool_choice", 1020, "responses"), None),
    ("metadata nested 513 deep", "/v1/chat/completions", deep_in("metadata", 513), None),
    ("10k invalid prompts", "/v1/completions", {"model": MODEL, "prompt": [1.5] * 10_000}, "prompt.0"),
    (
        "unknown parameter",
        "/v1/completions",
        {"model": MODEL, "prompt": "p", LONG_NAME: 1},
        LONG_PARAM,
    ),
    (
        "10k invalid items",
        "/v1/responses",
        {"model": MODEL, "input": [{"role": "nobody", "content": 7}] * 2000},
        "input.0.role",
    ),
    (
        "2k parts of one item",
        "/v1/responses",
        {"model": MODEL, "input": [{"role": "user", "content": [BAD_PART] * 2000}]},
        "input.0.content",
    ),
    ("an item type of 200k", "/v1/responses", {"model": MODEL, "input": [{"type": LONG_NAME}]}, "input.0"),
    ("JSON nested 100k deep", "/v1/responses", DEEP, None),
    (
        "admin: every field wrong",
        "/admin/tenants",
        {"id": ["x"] * 10_000, "name": {"a": 1}, "quotas": [1] * 10_000, LONG_NAME: 1},
        None,
    ),
    ("admin: JSON nested 100k deep", "/admin/tenants", DEEP, None),
]


@pytest.mark.parametrize(("case", "route", "body", "param"), HOSTILE, ids=[c[0] for c in HOSTILE])
def test_a_hostile_body_gets_one_short_error(
    http: httpx.Client, key: dict[str, str], case: str, route: str, body: Any, param: str | None
) -> None:
    headers = ADMIN if route.startswith("/admin") else key
    content = body.encode() if isinstance(body, str) else httpx.Request("POST", "/", json=body).content
    assert len(content) <= 1_048_576, case  # within the body bound: this is about what comes after it
    started = time.perf_counter()
    with capture_logs() as logs:
        resp = http.post(route, content=content, headers=headers | {"content-type": "application/json"})
    elapsed = time.perf_counter() - started
    assert len(str(logs)) < 4 * MAX_ANSWER_BYTES  # the request_rejected line is bounded too
    assert resp.status_code == 400, resp.text[:500]
    assert len(resp.content) <= MAX_ANSWER_BYTES, (case, len(resp.content))
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert len(error["message"]) <= MAX_MESSAGE_CHARS
    if isinstance(body, str):
        assert error["code"] == "invalid_json"
    elif param is not None:
        assert error["param"] == param, error
    assert elapsed < 10, elapsed  # generous: a loaded machine; these took 2-40 ms each here


class Listener:
    """A TCP listener on a loopback port that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


def url_bodies(url: str) -> list[tuple[str, dict[str, Any], str]]:
    """(route, body, the param the refusal names) for every place a request can carry a URL."""

    def parts(*content: dict[str, Any]) -> dict[str, Any]:
        return chat(messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, *content]}])

    tool_turn = [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_image", "image_url": url}],
        },
    ]
    return [
        (
            "/v1/chat/completions",
            parts({"type": "image_url", "image_url": {"url": url}}),
            "messages.0.content.1",
        ),
        ("/v1/chat/completions", parts({"type": "image_url", "image_url": url}), "messages.0.content.1"),
        (
            "/v1/chat/completions",
            parts({"type": "file", "file": {"file_url": url, "filename": "a.pdf"}}),
            "messages.0.content.1",
        ),
        (
            "/v1/chat/completions",
            parts({"type": "input_audio", "input_audio": {"data": url, "format": "wav"}}),
            "messages.0.content.1",
        ),
        (
            "/v1/responses",
            {
                "model": MODEL,
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}],
            },
            "input.0.content.0",
        ),
        (
            "/v1/responses",
            {
                "model": MODEL,
                "input": [{"role": "user", "content": [{"type": "input_file", "file_url": url}]}],
            },
            "input.0.content.0",
        ),
        ("/v1/responses", {"model": MODEL, "input": tool_turn}, "input.1.output.0"),
    ]


def test_urls_in_messages_are_refused_and_never_fetched(http: httpx.Client, key: dict[str, str]) -> None:
    listener = Listener()
    try:
        url = f"http://127.0.0.1:{listener.port}/secret.png"
        for route, body, param in url_bodies(url):
            resp = http.post(route, json=body, headers=key)
            assert resp.status_code == 400, (route, resp.text)
            error = resp.json()["error"]
            assert error["param"] == param and error["code"] == "unsupported_parameter", error
            assert "text only" in error["message"]
        # a URL in text is text: served (the fake worker answers), fetched by nobody
        served = http.post(
            "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": url}]), headers=key
        )
        assert served.status_code == 200
        time.sleep(0.5)  # a fetch started by any of them would have connected by now
        assert listener.accepted == 0
        # the listener itself works: a connection is counted
        socket.create_connection(("127.0.0.1", listener.port), timeout=2).close()
        deadline = time.monotonic() + 5
        while listener.accepted == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        listener.close()
