"""Every number and size a tenant sends is bounded before it reaches a worker (issue 8, item 1).

A fake worker stands in for SGLang here: it records what reaches it and reports token limits on
``/server_info`` as SGLang does. ``tests/engine/test_engine_bounds.py`` sends the same kind of values to the
real
engine.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from service.app import create_app
from service.config.settings import Settings
from service.protocol import limits
from service.workers.worker_info import TokenLimits, WorkerInfo
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_api import MODEL, assert_openai_error, auth, chat, new_tenant, usage_of
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

MAX_REQ_INPUT_LEN = 60  # what the fake worker reports: prompts up to 59 tokens, prompt + completion 64


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeWorker, str]]:
    worker = FakeWorker()
    worker.server_info = {"max_req_input_len": MAX_REQ_INPUT_LEN, "incremental_streaming_output": False}
    with ThreadedServer(worker.app) as server:
        yield worker, server.url


@pytest.fixture(scope="module")
def gateway(redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]) -> Iterator[str]:
    settings = Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": "bounds:"},
            "engine": {"served_model_name": MODEL},
            "upstream": {"workers": [fake[1]], "health_interval_s": 0.2},
            "api": {"tokenizer_path": str(stub_model_dir), "context_length": 512, "body_timeout_s": 1.0},
        }
    )
    with ThreadedServer(create_app(settings)) as server:
        yield server.url


@pytest.fixture
def http(gateway: str, fake: tuple[FakeWorker, str]) -> Iterator[httpx.Client]:
    fake[0].received.clear()
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


def text(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "one two three", "max_tokens": 2, **extra}


OUT_OF_BOUNDS: list[tuple[str, dict[str, Any], str]] = [
    ("top_k 2**31 (issue 8)", chat(max_tokens=4, temperature=0.7, top_k=2147483648), "top_k"),
    ("top_k int32 max", chat(top_k=2**31 - 1), "top_k"),
    ("top_k above SGLang's whole-vocabulary value", chat(top_k=limits.TOP_K_ALL + 1), "top_k"),
    ("top_k -2", chat(top_k=-2), "top_k"),
    ("top_k a float", chat(top_k=5.0), "top_k"),
    ("top_k a bool", chat(top_k=True), "top_k"),
    ("top_k a string", chat(top_k="5"), "top_k"),
    ("seed above int64", chat(seed=2**63), "seed"),
    ("seed below int64", chat(seed=-(2**63) - 1), "seed"),
    ("seed 2**64", text(seed=2**64), "seed"),
    ("temperature above 2", chat(temperature=2.0000001), "temperature"),
    ("temperature negative", chat(temperature=-0.0001), "temperature"),
    ("temperature huge", text(temperature=1e308), "temperature"),
    ("top_p zero", chat(top_p=0), "top_p"),
    ("top_p negative zero", chat(top_p=-0.0), "top_p"),
    ("top_p above 1", chat(top_p=1.5), "top_p"),
    ("min_p above 1", chat(min_p=1.01), "min_p"),
    ("min_p negative", chat(min_p=-1e-9), "min_p"),
    ("presence_penalty above 2", chat(presence_penalty=2.5), "presence_penalty"),
    ("frequency_penalty below -2", text(frequency_penalty=-3), "frequency_penalty"),
    ("repetition_penalty zero", chat(repetition_penalty=0), "repetition_penalty"),
    ("repetition_penalty tiny", chat(repetition_penalty=1e-30), "repetition_penalty"),
    ("repetition_penalty above 2", chat(repetition_penalty=2.01), "repetition_penalty"),
    ("max_tokens int64 overflow", chat(max_tokens=2**63), "max_tokens"),
    ("max_tokens zero", text(max_tokens=0), "max_tokens"),
    ("max_tokens a float", chat(max_tokens=2.5), "max_tokens"),
    ("max_completion_tokens negative", chat(max_completion_tokens=-1), "max_completion_tokens"),
    ("five stop sequences", chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    ("stop sequence too long", chat(stop="x" * (limits.MAX_STOP_BYTES + 1)), "stop"),
    ("stop sequence too long in bytes", text(stop=["é" * (limits.MAX_STOP_BYTES // 2 + 1)]), "stop"),
    ("user too long", chat(user="u" * (limits.MAX_USER_CHARS + 1)), "user"),
    (
        "too many messages",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * (limits.MAX_MESSAGES + 1)},
        "messages",
    ),
    (
        "message name too long",
        {"model": MODEL, "messages": [{"role": "user", "content": "x", "name": "n" * 300}]},
        "messages.0.name",
    ),
]


@pytest.mark.parametrize(("case", "body", "param"), OUT_OF_BOUNDS, ids=[c[0] for c in OUT_OF_BOUNDS])
def test_out_of_bounds_values_get_400_naming_the_parameter_and_never_reach_the_worker(
    http: httpx.Client, fake: tuple[FakeWorker, str], case: str, body: dict[str, Any], param: str
) -> None:
    tenant_id, key = new_tenant(http)
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = assert_openai_error(http.post(route, json=body, headers=auth(key)), 400)
    assert err["param"] == param, err
    assert fake[0].received == []
    assert usage_of(http, tenant_id)["requests"] == 0


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_are_not_json(
    http: httpx.Client, fake: tuple[FakeWorker, str], literal: bytes
) -> None:
    _, key = new_tenant(http)
    raw = b'{"model": "test-model", "prompt": "one", "max_tokens": 2, "temperature": ' + literal + b"}"
    resp = http.post(
        "/v1/completions", content=raw, headers={**auth(key), "Content-Type": "application/json"}
    )
    assert_openai_error(resp, 400, "invalid_json")
    assert fake[0].received == []


def test_a_number_overflowing_to_infinity_is_refused_naming_its_field(
    http: httpx.Client, fake: tuple[FakeWorker, str]
) -> None:
    _, key = new_tenant(http)
    raw = b'{"model": "test-model", "prompt": "one", "max_tokens": 2, "top_p": 1e400}'  # valid JSON
    resp = http.post(
        "/v1/completions", content=raw, headers={**auth(key), "Content-Type": "application/json"}
    )
    assert assert_openai_error(resp, 400, "invalid_value")["param"] == "top_p"
    assert fake[0].received == []


def test_values_at_the_bounds_are_served_and_sent_as_sglang_takes_them(
    http: httpx.Client, fake: tuple[FakeWorker, str]
) -> None:
    _, key = new_tenant(http)
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"top_k": limits.TOP_K_ALL}, {"top_k": limits.TOP_K_ALL}),
        ({"top_k": 1}, {"top_k": 1}),
        ({"seed": limits.SEED_MAX, "temperature": 2}, {"sampling_seed": limits.SEED_MAX, "temperature": 2}),
        ({"seed": limits.SEED_MIN, "temperature": 0}, {"sampling_seed": limits.SEED_MIN, "temperature": 0}),
        ({"top_p": 5e-324, "min_p": 1, "repetition_penalty": 0.01}, {"top_p": 5e-324, "min_p": 1}),
        (
            {"presence_penalty": -2, "frequency_penalty": 2.0},
            {"presence_penalty": -2, "frequency_penalty": 2},
        ),
        ({"temperature": 1}, {"temperature": 1.0}),  # an integer where a float is expected is fine
    ]
    for extra, sent in cases:
        assert http.post("/v1/completions", json=text(**extra), headers=auth(key)).status_code == 200
        sampling = fake[0].received[-1]["sampling_params"]
        assert {k: sampling[k] for k in sent} == sent
    for off in (-1, 0):  # "no top-k" in OpenAI-compatible servers: nothing is sent
        assert http.post("/v1/completions", json=text(top_k=off), headers=auth(key)).status_code == 200
        assert "top_k" not in fake[0].received[-1]["sampling_params"]


def test_max_tokens_is_bounded_by_the_context_the_worker_reports(
    http: httpx.Client, fake: tuple[FakeWorker, str]
) -> None:
    _, key = new_tenant(http)
    resp = http.post("/v1/completions", json=text(max_tokens=1), headers=auth(key))
    prompt_tokens = resp.json()["usage"]["prompt_tokens"]
    total = MAX_REQ_INPUT_LEN + 4  # SGLang runs prompt + max_new_tokens <= max_req_len - 1
    ok = http.post("/v1/completions", json=text(max_tokens=total - prompt_tokens), headers=auth(key))
    assert ok.status_code == 200, ok.text
    assert fake[0].received[-1]["sampling_params"]["max_new_tokens"] == total - prompt_tokens
    over = http.post("/v1/completions", json=text(max_tokens=total - prompt_tokens + 1), headers=auth(key))
    err = assert_openai_error(over, 400, "context_length_exceeded")
    assert err["param"] == "max_tokens" and str(total) in err["message"]
    # without max_tokens the default is cut to the room left
    assert http.post("/v1/completions", json=text(max_tokens=None), headers=auth(key)).status_code == 200
    assert fake[0].received[-1]["sampling_params"]["max_new_tokens"] == total - prompt_tokens
    # a prompt the worker would refuse (>= max_req_input_len tokens) is refused here, naming it
    long_prompt = " ".join(["w"] * MAX_REQ_INPUT_LEN)
    err = assert_openai_error(
        http.post("/v1/completions", json=text(prompt=long_prompt, max_tokens=1), headers=auth(key)),
        400,
        "context_length_exceeded",
    )
    assert err["param"] == "prompt"
    sent = len(fake[0].received)
    assert (
        http.post(
            "/v1/completions",
            json=text(prompt=" ".join(["w"] * (MAX_REQ_INPUT_LEN - 1)), max_tokens=1),
            headers=auth(key),
        ).status_code
        == 200
    )
    assert len(fake[0].received) == sent + 1


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"max_req_input_len": 8186, "context_length": None}, TokenLimits(8185, 8190)),
        ({"context_length": 8192}, TokenLimits(8185, 8190)),  # the simulator reports only this
        ({"max_req_input_len": 8186, "incremental_streaming_output": True}, TokenLimits(8185, 8190)),
        ({}, None),
        ("not a dict", None),
    ],
)
def test_worker_info_reads_sglang_server_info(payload: Any, expected: TokenLimits | None) -> None:
    assert WorkerInfo.parse(payload).limits == expected


def test_the_tightest_limits_win() -> None:
    a, b = TokenLimits(100, 120), TokenLimits(150, 110)
    assert a.tightest(b) == TokenLimits(100, 110) and a.tightest(None) == a


def test_a_request_body_with_nan_is_refused_even_inside_lists(http: httpx.Client) -> None:
    _, key = new_tenant(http)
    raw = json.dumps(chat(stop=["a"])).replace('["a"]', "[NaN]").encode()
    resp = http.post(
        "/v1/chat/completions", content=raw, headers={**auth(key), "Content-Type": "application/json"}
    )
    assert_openai_error(resp, 400, "invalid_json")


@pytest.mark.parametrize(
    ("stop", "sent"),
    [
        ("", None),
        (["", ""], None),
        ([], None),
        (["", "zzzz"], ["zzzz"]),
        (["zzzz", "", "zzzz"], ["zzzz"]),
        (["\n", "\n", "."], ["\n", "."]),
        (["ab", "b"], ["ab", "b"]),  # "ab" can still decide the cut ("xab" ends after "x")
        ("\n", ["\n"]),
    ],
)
def test_degenerate_stop_sequences_are_normalised_before_the_engine(
    http: httpx.Client, fake: tuple[FakeWorker, str], stop: Any, sent: list[str] | None
) -> None:
    _, key = new_tenant(http)
    for route, body in (("/v1/completions", text(stop=stop)), ("/v1/chat/completions", chat(stop=stop))):
        assert http.post(route, json=body, headers=auth(key)).status_code == 200
        assert fake[0].received[-1]["sampling_params"].get("stop") == sent


def test_a_body_that_stalls_gets_408_within_the_body_timeout_and_costs_nothing(
    gateway: str, http: httpx.Client, fake: tuple[FakeWorker, str]
) -> None:
    tenant, key = new_tenant(http, quotas={"requests_per_min": 100})
    body = json.dumps(chat(max_tokens=4)).encode()
    url = urlsplit(gateway)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body) + 100}\r\n\r\n"
    )
    t0 = time.monotonic()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(head.encode() + body)  # 100 bytes short of what it declared, then nothing
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    waited = time.monotonic() - t0
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"408", answer
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert 0.9 <= waited < 5
    assert fake[0].received == []
    assert usage_of(http, tenant)["requests"] == 0
