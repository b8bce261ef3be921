"""A worker's 4xx reaches the tenant as a short, sanitized 400 in OpenAI's shape, never its raw text.

SGLang refuses bad input three ways (a 400 body, an aborted answer with ``status_code`` 400, an error event
in a stream; see ``service/workers/upstream_errors.py``); each is tried streamed and not, against a fake
worker whose error text is long and carries its URL, file paths and a traceback, as xgrammar's and
Python's do. The tenant sees none of that, is charged nothing, and the worker keeps serving.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from service.pipeline.rejection import REASON_MAX_CHARS, rejected_param, sanitized_reason, tenant_rejection
from service.workers.upstream_errors import UpstreamError
from tests.service.api.test_api import ADMIN, MODEL, assert_openai_error, auth, chat, new_tenant, usage_of
from tests.service.openai.test_tools_api import WEATHER
from tests.support.fake_worker import TOKENS, FakeWorker

SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}},
}


def worker_text(url: str) -> str:
    """A long, path-laden grammar error as a worker might send it."""
    return (
        "Failed to compile json grammar: [12:03:44] /workspace/xgrammar/cpp/json_schema_converter.cc:912: "
        f"unsupported keyword at {url}/generate (object at 0x7f3a2b1c9d00) "
        + "while converting the schema "
        * 200
        + '\nTraceback (most recent call last):\n  File "/opt/venv/lib/python3.11/site-packages/sglang/srt/'
        'constrained/xgrammar_backend.py", line 88, in compile\nRuntimeError: internal compiler state'
    )


@pytest.fixture
def worker(fake: tuple[FakeWorker, str]) -> Iterator[tuple[FakeWorker, str]]:
    fake[0].received.clear()
    yield fake
    fake[0].reject, fake[0].reject_style = None, "status"


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


def assert_clean(message: str, url: str) -> None:
    port = url.rsplit(":", 1)[1]
    for leaked in (
        url,
        port,
        "/workspace",
        "/opt/venv",
        ".cc",
        ".py",
        "Traceback",
        "0x7f",
        "internal compiler",
    ):
        assert leaked not in message, (leaked, message)
    assert len(message) <= REASON_MAX_CHARS + 60


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("style", ["status", "abort", "event"])
def test_a_schema_the_worker_refuses_is_a_sanitized_400_naming_response_format(
    http: httpx.Client, worker: tuple[FakeWorker, str], style: str, stream: bool
) -> None:
    fake, url = worker
    fake.reject, fake.reject_style = worker_text(url), style
    tenant_id, key = new_tenant(http)
    resp = http.post(
        "/v1/chat/completions",
        json=chat(max_tokens=5, stream=stream, response_format=SCHEMA_FORMAT),
        headers=auth(key),
    )
    err = assert_openai_error(resp, 400, "upstream_rejected")
    assert err["param"] == "response_format" and err["type"] == "invalid_request_error"
    assert err["message"].startswith("The model server rejected the request's schema: Failed to compile")
    assert_clean(err["message"], url)
    assert len(fake.received) == 1  # the input's fault: not retried elsewhere
    usage = usage_of(http, tenant_id)
    assert usage["prompt_tokens"] == usage["completion_tokens"] == usage["requests"] == 0
    fake.reject = None  # the worker was not held responsible: it serves the next request
    assert http.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth(key)).status_code == 200
    workers = http.get("/admin/workers", headers=ADMIN).json()["data"]
    assert [w["breaker"] for w in workers] == ["closed"]


def test_a_forced_tool_call_the_worker_refuses_names_tools(
    http: httpx.Client, worker: tuple[FakeWorker, str]
) -> None:
    fake, url = worker
    fake.reject, fake.reject_style = (
        worker_text(url).replace("json grammar", "structural_tag grammar"),
        "abort",
    )
    _, key = new_tenant(http)
    req = chat(max_tokens=5, tools=[WEATHER], tool_choice="required")
    err = assert_openai_error(http.post("/v1/chat/completions", json=req, headers=auth(key)), 400)
    assert err["param"] == "tools"
    assert_clean(err["message"], url)


def test_a_refusal_not_about_a_grammar_names_no_param(
    http: httpx.Client, worker: tuple[FakeWorker, str]
) -> None:
    fake, url = worker
    fake.reject = f"The input (900 tokens) is longer than the model's context length; see {url}/docs"
    _, key = new_tenant(http)
    req = chat(max_tokens=5, response_format=SCHEMA_FORMAT)
    err = assert_openai_error(http.post("/v1/chat/completions", json=req, headers=auth(key)), 400)
    assert err["param"] is None
    assert err["message"] == (
        "The model server rejected the request: The input (900 tokens) is longer than the model's context "
        "length; see [worker]/docs"
    )


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            "Failed to compile json grammar: bad $ref #/$defs/Item",
            "Failed to compile json grammar: bad $ref #/$defs/Item",
        ),
        (
            "Failed to compile json grammar: [00:51:54] /project/cpp/regex_converter.cc:83: Regex parsing "
            "error at position 3: Lookbehind is not supported yet.",
            "Failed to compile json grammar: Regex parsing error at position 3: Lookbehind is not supported "
            "yet.",
        ),  # xgrammar's own words (0.1.x)
        ("see http://10.0.0.5:30000/generate now", "see [url] now"),
        ("worker 10.0.0.5:30000 said no", "worker [host] said no"),
        (
            "error in /usr/lib/python3.11/json/decoder.py:337: Expecting value",
            "error in [path]: Expecting value",
        ),
        ('File "/srv/app.py", line 3, in main: boom', "[path]: boom"),
        (
            "content type application/json and ratio 1/2/3 are fine",
            "content type application/json and ratio 1/2/3 are fine",
        ),
        ("object at 0xdeadbeef12", "object at [address]"),
        ("first line\nsecond line", "first line"),
        (
            'Traceback (most recent call last):\n  File "/a/b.py", line 1\nValueError: bad schema',
            "ValueError: bad schema",
        ),
        (
            'Bad input\nTraceback (most recent call last):\n  File "/a/b.py", line 1\nValueError: x',
            "Bad input",
        ),
        ("  \n\t ", "no reason given"),
        ("a   b\tc", "a b c"),
    ],
)
def test_sanitized_reason(text: str, reason: str) -> None:
    assert sanitized_reason(text) == reason


def test_sanitized_reason_caps_the_length_and_removes_the_workers_own_address() -> None:
    long = sanitized_reason("x" * 5000)
    assert len(long) == REASON_MAX_CHARS and long.endswith("…")
    assert (
        sanitized_reason(
            "at http://worker-3.internal:30000 and worker-3.internal:30000", "http://worker-3.internal:30000"
        )
        == "at [worker] and [worker]"
    )


@pytest.mark.parametrize(
    ("sampling", "text", "param"),
    [
        ({"json_schema": "{}"}, "Failed to compile json grammar: x", "response_format"),
        ({"structural_tag": "{}"}, "Failed to compile structural_tag grammar: x", "tools"),
        ({"json_schema": "{}"}, "The input is too long", None),  # not about the grammar
        ({}, "Grammar preprocessing timed out", None),  # no grammar sent: nothing to name
    ],
)
def test_rejected_param(sampling: dict[str, Any], text: str, param: str | None) -> None:
    assert rejected_param(sampling, text) == param


def test_the_full_worker_text_is_logged_with_the_request_id() -> None:
    text = worker_text("http://127.0.0.1:30000")
    exc = UpstreamError("http://127.0.0.1:30000", text, status=400, retryable=False)
    with capture_logs() as logs:
        err = tenant_rejection(exc, {"sampling_params": {"json_schema": "{}"}}, "req-42")
    assert err.param == "response_format" and "127.0.0.1" not in err.message
    (line,) = [entry for entry in logs if entry["event"] == "upstream_rejected"]
    assert line["request_id"] == "req-42" and line["worker"] == "http://127.0.0.1:30000"
    assert (
        line["worker_message"] == text and line["worker_message_chars"] == len(text) and line["status"] == 400
    )


def test_the_responses_api_names_its_own_field(http: httpx.Client, worker: tuple[FakeWorker, str]) -> None:
    fake, url = worker
    fake.reject, fake.reject_style = worker_text(url), "abort"
    tenant_id, key = new_tenant(http)
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA_FORMAT["json_schema"]["schema"]}  # type: ignore[index]
    req = {"model": MODEL, "input": "hi", "max_output_tokens": 5, "text": {"format": fmt}}
    err = assert_openai_error(
        http.post("/v1/responses", json=req, headers=auth(key)), 400, "upstream_rejected"
    )
    assert err["param"] == "text.format"
    assert_clean(err["message"], url)
    assert usage_of(http, tenant_id)["prompt_tokens"] == 0


GRAMMAR_500 = (
    "Grammar accept_token failed: Tokens not accepted: 0\nAccepted tokens: []\n"
    'Key string: {"$ref": "#/$defs/a", "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}}}'
)
"""SGLang 0.5.23's words when a request's grammar refuses the first token sampled under it (the real
engine's answer to the issue 25 schema; ``tests/engine/test_engine_schemas.py``)."""


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("style", "tools"), [("token500", False), ("token500", True), ("event500", False)]
)  # fmt: skip
def test_a_grammar_that_refuses_its_first_token_is_the_tenants_400_with_nothing_charged(
    http: httpx.Client, worker: tuple[FakeWorker, str], style: str, tools: bool, stream: bool
) -> None:
    """Was a 502 ``upstream_unavailable`` (retried on every worker and held against it), and streamed a 200
    whose first chunk was the grammar's empty token, then an error event, with 1 token charged."""
    fake, _ = worker
    if style == "event500":  # the same words in an error event with code 500
        fake.reject, fake.reject_style = GRAMMAR_500, "event"
        fake.reject_status = 500
    else:
        fake.reject, fake.reject_style = GRAMMAR_500, style
    tenant_id, key = new_tenant(http)
    shape = {"tools": [WEATHER], "tool_choice": "required"} if tools else {"response_format": SCHEMA_FORMAT}
    try:
        resp = http.post(
            "/v1/chat/completions", json=chat(max_tokens=5, stream=stream, **shape), headers=auth(key)
        )
    finally:
        fake.reject_status = 400
    err = assert_openai_error(resp, 400, "upstream_rejected")
    assert err["param"] == ("tools" if tools else "response_format")
    assert err["message"] == (
        "The model server rejected the request's schema: Grammar accept_token failed: Tokens not accepted: 0"
    )
    assert len(fake.received) == 1  # not retried: every worker fails it alike
    usage = usage_of(http, tenant_id)
    assert usage["prompt_tokens"] == usage["completion_tokens"] == usage["requests"] == 0
    fake.reject = None
    assert http.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth(key)).status_code == 200
    assert [w["breaker"] for w in http.get("/admin/workers", headers=ADMIN).json()["data"]] == ["closed"]


@pytest.mark.parametrize("incremental", [False, True])
def test_a_stream_whose_first_token_has_no_text_loses_nothing(
    http: httpx.Client, worker: tuple[FakeWorker, str], incremental: bool
) -> None:
    """The opening chunk without text (held until the next, :meth:`SGLangClient.stream`) is joined to it:
    every token's text and count arrive, and the answer is the non-streamed one."""
    fake, _ = worker
    fake.tokens, fake.server_info = (
        ["", "alpha", " beta", " gamma"],
        {"incremental_streaming_output": incremental},
    )
    try:
        tenant_id, key = new_tenant(http)
        req = chat(max_tokens=4, stream=True, stream_options={"include_usage": True})
        with http.stream("POST", "/v1/chat/completions", json=req, headers=auth(key)) as resp:
            assert resp.status_code == 200
            lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    finally:
        fake.tokens, fake.server_info = list(TOKENS), None
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "alpha beta gamma"
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert usage_of(http, tenant_id)["completion_tokens"] == 4
