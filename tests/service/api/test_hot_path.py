"""The hot path's shortcuts behave as the code they replace: request JSON decoded as Python's json does,
the completion routes served outside FastAPI's stack with the same answers (request id, errors, 405)."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest

from service.api.deps import decode_json
from tests.service.api.test_api import MODEL, auth, gateway, http, new_tenant

__all__ = ["gateway", "http"]  # fixtures of test_api, used here (fake: conftest)


def _not_json(constant: str) -> Any:
    raise ValueError(constant)


def _reference(raw: bytes) -> Any:
    return json.loads(raw, parse_constant=_not_json)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","messages":[{"role":"user","content":"hi \\u00e9\\u4e2d"}],"max_tokens":5}',
        b'{"seed":123456789012345678901234}',  # beyond 64 bits: orjson would make it a float
        b'{"seed":-9223372036854775809}',
        b'{"seed":9223372036854775807,"top_k":1073741824}',
        b'{"text":"0123456789012345678901234"}',
        b'{"a":1,"a":2}',
        b'{"t":1e400}',  # infinity
        b'{"t":1.5e-400,"u":-0,"v":1E2}',
        b'{"s":"\\ud800"}',  # lone surrogate
        b'{"s":"\xed\xa0\x80"}',
        b"\xef\xbb\xbf{}",  # UTF-8 BOM
        '{"utf16": 1}'.encode("utf-16"),
        b" [1, 2] ",
        b'"just a string"',
    ],
)
def test_request_json_decodes_as_pythons_json(raw: bytes) -> None:
    expected = _reference(raw)
    got = decode_json(raw)
    assert got == expected or (isinstance(expected, dict) and all(math.isinf(v) for v in expected.values()))
    assert json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)  # same types too


@pytest.mark.parametrize(
    "raw",
    [b'{"t":NaN}', b'{"t":-Infinity}', b'{"a":01}', b'{"a":"\x01"}', b"{", b'{"a": "\xff"}', b"[" * 5000],
)
def test_request_json_refusals_are_pythons(raw: bytes) -> None:
    with pytest.raises((ValueError, UnicodeDecodeError, RecursionError)) as reference:
        _reference(raw)
    with pytest.raises(type(reference.value)):
        decode_json(raw)


def test_completion_routes_keep_request_id_errors_and_405(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    unauthenticated = http.post("/v1/chat/completions", json=body)
    assert unauthenticated.status_code == 401 and len(unauthenticated.headers["x-request-id"]) == 32
    assert unauthenticated.json()["error"]["code"] == "missing_api_key"
    wrong_method = http.get("/v1/chat/completions")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    _, key = new_tenant(http)
    ok = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, headers=auth(key)
    )
    assert ok.status_code == 200 and ok.headers["content-type"] == "application/json"
    assert ok.headers["x-request-id"] != unauthenticated.headers["x-request-id"]
    assert ok.json()["id"] == f"cmpl-{ok.headers['x-request-id']}"
    too_big = http.post("/v1/chat/completions", content=b"x" * 5000, headers=auth(key))
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    not_json = http.post("/v1/chat/completions", content=b'{"t":NaN}', headers=auth(key))
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"
