"""The gateway's HTTP API against a real Redis and a fake upstream worker (error paths, quotas, admin)."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from service.app import create_app
from service.observability.breakdown import parse_server_timing
from tests.conftest import ADMIN_TOKEN, MODEL, gateway_settings
from tests.support.fake_worker import WORDS, FakeWorker
from tests.support.servers import ThreadedServer, free_port

_ids = itertools.count()


@pytest.fixture(scope="module")
def gateway(redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]) -> Iterator[str]:
    app = create_app(gateway_settings(redis_url, stub_model_dir, [fake[1]]))
    with ThreadedServer(app) as server:
        yield server.url


@pytest.fixture
def worker(fake: tuple[FakeWorker, str]) -> FakeWorker:
    fake[0].mode, fake[0].delay_s = "ok", 0.0
    fake[0].received.clear()
    fake[0].aborted.clear()
    return fake[0]


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def new_tenant(http: httpx.Client, **spec: Any) -> tuple[str, str]:
    """Create a tenant and a key through the admin API; returns (tenant id, api key)."""
    tenant_id = f"t{next(_ids)}"
    body = {"id": tenant_id, "name": tenant_id, **spec}
    assert http.post("/admin/tenants", json=body, headers=ADMIN).status_code == 201
    issued = http.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "k"}, headers=ADMIN)
    assert issued.status_code == 201
    return tenant_id, issued.json()["api_key"]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(content: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def usage_of(http: httpx.Client, tenant_id: str) -> dict[str, Any]:
    resp = http.get(f"/admin/tenants/{tenant_id}/usage", headers=ADMIN)
    assert resp.status_code == 200
    data: dict[str, Any] = resp.json()
    return data


def assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    # OpenAI's four fields; a token bucket's refusal (429, 413) also names the bucket in "quota"
    quota = {"quota"} if status in (413, 429) and err.get("code") != "too_many_long_prompts" else set()
    assert set(err) == {"message", "type", "param", "code"} | (quota & set(err))
    if "quota" in err:
        assert set(err["quota"]) == {"scope", "id", "bucket"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


def test_chat_non_stream_returns_openai_shape_and_records_usage(
    http: httpx.Client, worker: FakeWorker
) -> None:
    tenant_id, key = new_tenant(http)
    resp = http.post("/v1/chat/completions", json=chat(max_tokens=3), headers=auth(key))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert resp.headers["x-request-id"] and body["object"] == "chat.completion"
    timing = parse_server_timing(resp.headers["server-timing"])  # where its time went (W3C Server Timing)
    assert {"auth", "prepare", "quota", "route", "queue"} <= set(timing) and "ttft" not in timing
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "alpha beta gamma"}
    assert body["choices"][0]["finish_reason"] == "length"
    sent = worker.received[-1]
    assert sent["sampling_params"]["max_new_tokens"] == 3
    assert sent["priority"] == 5  # the tenant's default class 'standard'
    assert body["usage"]["prompt_tokens"] == len(sent["text"].split())
    assert body["usage"]["completion_tokens"] == 3
    usage = usage_of(http, tenant_id)
    assert usage["requests"] == 1 and usage["completion_tokens"] == 3
    assert usage["prompt_tokens"] == body["usage"]["prompt_tokens"]


def test_chat_stream_sends_deltas_and_final_usage_chunk(http: httpx.Client, worker: FakeWorker) -> None:
    _, key = new_tenant(http)
    req = chat(max_tokens=4, stream=True, stream_options={"include_usage": True})
    with http.stream("POST", "/v1/chat/completions", json=req, headers=auth(key)) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        # the headers go out with the first token: every phase up to it, and the TTFT
        timing = parse_server_timing(resp.headers["server-timing"])
        lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert {"auth", "prepare", "quota", "route", "queue", "upstream_connect", "ttft"} <= set(timing)
    assert sum(v for k, v in timing.items() if k != "ttft") <= timing["ttft"]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(ln) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == " ".join(WORDS[:4])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_text_completion_non_stream_and_stream(http: httpx.Client, worker: FakeWorker) -> None:
    _, key = new_tenant(http)
    resp = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "one two", "max_tokens": 2}, headers=auth(key)
    )
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "alpha beta"
    assert worker.received[-1]["text"] == "one two"
    req = {"model": MODEL, "prompt": "one two", "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/completions", json=req, headers=auth(key)) as resp:
        lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1]) == "alpha beta"


BAD_INPUTS: list[tuple[str, Any, int, str]] = [
    ("invalid json", b"{not json", 400, "invalid_json"),
    ("not an object", b"[1, 2]", 400, "invalid_json"),
    ("missing messages", {"model": MODEL}, 400, "missing_required_parameter"),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "invalid_value"),
    ("wrong type", {"model": MODEL, "messages": "hi"}, 400, "invalid_value"),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value"),
    ("max_tokens zero", chat(max_tokens=0), 400, "invalid_value"),
    ("max_tokens negative", chat(max_tokens=-5), 400, "invalid_value"),
    ("max_tokens above cap", chat(max_tokens=51), 400, "max_tokens_above_cap"),
    ("temperature too high", chat(temperature=7), 400, "invalid_value"),
    ("n above api.max_n", chat(n=9), 400, "unsupported_value"),
    ("unknown field", chat(frobnicate=True), 400, "unknown_parameter"),
    ("unknown model", {**chat(), "model": "gpt-9"}, 404, "model_not_found"),
    ("unknown priority", chat(priority="urgent"), 400, "invalid_priority"),
    ("empty priority", chat(priority=""), 400, "invalid_priority"),  # not silently the default class
    ("priority above tenant's", chat(priority="interactive"), 403, "priority_not_allowed"),
    ("body too large", chat("word " * 2000), 413, "request_too_large"),
    (
        "deeply nested JSON",
        b'{"model": "m", "messages": ' + b"[" * 1500 + b"]" * 1500 + b"}",
        400,
        "invalid_json",
    ),
    (
        "lone surrogate",
        b'{"model": "test-model", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
        400,
        "invalid_prompt",
    ),
    ("stream not a bool", chat(stream="yes"), 400, "invalid_value"),
    (
        "user message without content",
        {"model": MODEL, "messages": [{"role": "user"}]},
        400,
        "missing_required_parameter",
    ),
    (
        "tool message without tool_call_id",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "4"}]},
        400,
        "missing_required_parameter",
    ),
    ("two different max token limits", chat(max_tokens=5, max_completion_tokens=6), 400, "invalid_value"),
    ("prompt over context", chat("word " * 600), 400, "context_length_exceeded"),
]


@pytest.mark.parametrize(("case", "body", "status", "code"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_rejected_charges_nothing_and_never_reaches_a_worker(
    http: httpx.Client, worker: FakeWorker, case: str, body: Any, status: int, code: str
) -> None:
    tenant_id, key = new_tenant(
        http, max_tokens_cap=50, quotas={"requests_per_min": 2, "tokens_per_min": 1000}
    )
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = http.post(
        "/v1/chat/completions", content=raw, headers={**auth(key), "Content-Type": "application/json"}
    )
    assert_openai_error(resp, status, code)
    assert worker.received == []
    usage = usage_of(http, tenant_id)
    assert usage["requests"] == 0 and usage["prompt_tokens"] == 0
    # nothing was charged: the full request burst (2) is still there
    for _ in range(2):
        assert (
            http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)).status_code == 200
        )


def test_model_outside_the_tenants_allowed_list_gets_403(http: httpx.Client, worker: FakeWorker) -> None:
    _, key = new_tenant(http, allowed_models=["test-model-b"])
    assert_openai_error(
        http.post("/v1/chat/completions", json=chat(), headers=auth(key)), 403, "model_not_allowed"
    )
    assert [m["id"] for m in http.get("/v1/models", headers=auth(key)).json()["data"]] == ["test-model-b"]
    assert worker.received == []


def test_missing_unknown_and_revoked_keys_get_401(http: httpx.Client, worker: FakeWorker) -> None:
    tenant_id, key = new_tenant(http)
    assert_openai_error(http.post("/v1/chat/completions", json=chat()), 401, "missing_api_key")
    fake_key = "rg-000000000000." + "A" * 43
    assert_openai_error(
        http.post("/v1/chat/completions", json=chat(), headers=auth(fake_key)), 401, "invalid_api_key"
    )
    tampered = key[:-1] + ("A" if key[-1] != "A" else "B")
    assert_openai_error(
        http.post("/v1/chat/completions", json=chat(), headers=auth(tampered)), 401, "invalid_api_key"
    )
    key_id = key.split(".")[0].removeprefix("rg-")
    assert http.delete(f"/admin/tenants/{tenant_id}/keys/{key_id}", headers=ADMIN).json()["revoked"]
    assert_openai_error(
        http.post("/v1/chat/completions", json=chat(), headers=auth(key)), 401, "invalid_api_key"
    )
    assert worker.received == []


def test_disabled_tenant_gets_403_and_enabled_again_passes(http: httpx.Client, worker: FakeWorker) -> None:
    tenant_id, key = new_tenant(http)
    assert http.post(f"/admin/tenants/{tenant_id}/disable", headers=ADMIN).json()["enabled"] is False
    assert_openai_error(
        http.post("/v1/chat/completions", json=chat(), headers=auth(key)), 403, "tenant_disabled"
    )
    http.post(f"/admin/tenants/{tenant_id}/enable", headers=ADMIN)
    assert http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)).status_code == 200


def test_text_completion_rejects_unsupported_echo_and_suffix(http: httpx.Client, worker: FakeWorker) -> None:
    _, key = new_tenant(http)
    for extra in ({"echo": True}, {"suffix": "x"}):
        body = {"model": MODEL, "prompt": "one two", "max_tokens": 2, **extra}
        assert_openai_error(http.post("/v1/completions", json=body, headers=auth(key)), 400)
    raw = b'{"model": "test-model", "prompt": "a \\ud800", "max_tokens": 2}'
    resp = http.post(
        "/v1/completions", content=raw, headers={**auth(key), "Content-Type": "application/json"}
    )
    assert_openai_error(resp, 400, "invalid_prompt")
    assert resp.json()["error"]["param"] == "prompt"  # nu14: named "messages", a chat field
    assert worker.received == []


def test_admin_rejects_inconsistent_tenants(http: httpx.Client) -> None:
    body = {"id": "bad-classes", "name": "x", "priority_class": "interactive", "max_priority_class": "batch"}
    err = assert_openai_error(http.post("/admin/tenants", json=body, headers=ADMIN), 400, "invalid_priority")
    assert err["param"] == "max_priority_class"
    body = {"id": "bad-models", "name": "x", "allowed_models": ["nope"]}
    assert_openai_error(http.post("/admin/tenants", json=body, headers=ADMIN), 400, "model_not_found")
    tenant_id, _ = new_tenant(http, priority_class="standard")
    err = assert_openai_error(
        http.patch(f"/admin/tenants/{tenant_id}", json={"max_priority_class": "vip"}, headers=ADMIN), 400
    )
    assert err["param"] == "max_priority_class"
    assert_openai_error(
        http.patch(f"/admin/tenants/{tenant_id}", json={"priority_class": "interactive"}, headers=ADMIN), 400
    )


def test_admin_bounds_and_dedupes_allowed_models(http: httpx.Client) -> None:
    # nu13: 40,000 copies of one served id were stored as a 1 MB tenant record (read on authentication,
    # returned by every listing page), and 5,000 unknown ids were all echoed in the error message.
    body = {"id": "many-models", "name": "x", "allowed_models": ["m"] * 300}
    err = assert_openai_error(http.post("/admin/tenants", json=body, headers=ADMIN), 400, "invalid_value")
    assert err["param"] == "allowed_models"
    body = {"id": "many-unknown", "name": "x", "allowed_models": [f"m{i}" for i in range(200)]}
    resp = http.post("/admin/tenants", json=body, headers=ADMIN)
    assert_openai_error(resp, 400, "model_not_found")
    assert len(resp.content) < 1000
    body = {"id": "long-model", "name": "x", "allowed_models": ["m" * 300]}
    assert_openai_error(http.post("/admin/tenants", json=body, headers=ADMIN), 400, "invalid_value")
    tenant_id, _ = new_tenant(http, allowed_models=[MODEL, MODEL, MODEL])
    assert http.get(f"/admin/tenants/{tenant_id}", headers=ADMIN).json()["allowed_models"] == [MODEL]
    patched = http.patch(f"/admin/tenants/{tenant_id}", json={"allowed_models": [MODEL] * 5}, headers=ADMIN)
    assert patched.status_code == 200 and patched.json()["allowed_models"] == [MODEL]
    resp = http.patch(f"/admin/tenants/{tenant_id}", json={"allowed_models": ["m"] * 300}, headers=ADMIN)
    assert_openai_error(resp, 400, "invalid_value")


@pytest.mark.parametrize(
    "patch",
    [
        {"name": None},
        {"priority_class": None},
        {"weight": None},
        {"quotas": None},
        {"enabled": None},
        {"enabled": "no"},  # not coerced to False
        {"weight": "2"},
        {"quotas": {"requests_per_min": 1e400}},  # inf: not "unlimited"
        {"quotas": {"requests_per_min": 1e13}},
        {"max_tokens_cap": 10**30},
        {"weight": 1e-320},  # a denormal weight made WFQ finish tags infinite
        {"weight": 1e-6},
        {"quotas": {"requests_per_min": 60, "request_burst": 0.5}},  # a bucket below one request admits none
        {"quotas": {"requests_per_min": 1e-300}},  # nu11: Retry-After 10000000000
        {"quotas": {"tokens_per_min": 5e-324}},  # nu11: every request a 413 naming a burst of 4.9e-324
    ],
)
def test_admin_patch_refuses_nulls_coercion_and_unbounded_numbers(
    http: httpx.Client, patch: dict[str, Any]
) -> None:
    tenant_id, _ = new_tenant(http, quotas={"requests_per_min": 5})
    headers = {**ADMIN, "Content-Type": "application/json"}

    def raw(body: dict[str, Any]) -> str:  # 1e400 as sent on the wire (json.dumps writes Infinity)
        return json.dumps(body).replace("Infinity", "1e400")

    resp = http.patch(f"/admin/tenants/{tenant_id}", content=raw(patch), headers=headers)
    assert resp.status_code in (400, 422), resp.text
    error = assert_openai_error(resp, resp.status_code)
    assert error["param"] is not None and error["param"].split(".")[0] in patch  # nu13: a null had param null
    tenant = http.get(f"/admin/tenants/{tenant_id}", headers=ADMIN).json()
    assert tenant["enabled"] is True and tenant["quotas"]["requests_per_min"] == 5  # unchanged
    created = http.post(
        "/admin/tenants", content=raw({"id": f"{tenant_id}-c", "name": "x", **patch}), headers=headers
    )
    assert created.status_code in (400, 422), created.text


def test_request_bucket_below_one_request(http: httpx.Client) -> None:
    # a rate under 1 request/min with no burst still admits one request (the bucket holds at least one)
    tenant_id, key = new_tenant(http, quotas={"requests_per_min": 0.5})
    assert http.post("/v1/chat/completions", json=chat(), headers=auth(key)).status_code == 200
    resp = http.post("/v1/chat/completions", json=chat(), headers=auth(key))
    assert_openai_error(resp, 429)
    assert int(resp.headers["retry-after"]) > 60
    # an explicit burst below one request is refused at the admin API, on PUT quotas as on create
    err = assert_openai_error(
        http.put(f"/admin/tenants/{tenant_id}/quotas", json={"request_burst": 0.5}, headers=ADMIN), 400
    )
    assert err["param"] == "quotas.request_burst"
    assert http.get(f"/admin/tenants/{tenant_id}", headers=ADMIN).json()["quotas"]["requests_per_min"] == 0.5


def test_a_burst_without_its_rate_is_refused(http: httpx.Client, worker: FakeWorker) -> None:
    # nu19: a bucket without a rate is unlimited, so {"token_burst": 50} alone was stored, shown by the
    # usage routes, and limited nothing (a 500-token request passed)
    for quotas, param in (
        ({"token_burst": 50}, "quotas.token_burst"),
        ({"request_burst": 2, "tokens_per_min": 100}, "quotas.request_burst"),
    ):
        body = {"id": f"t{next(_ids)}", "name": "x", "quotas": quotas}
        err = assert_openai_error(http.post("/admin/tenants", json=body, headers=ADMIN), 400, "invalid_value")
        assert err["param"] == param
    tenant_id, _ = new_tenant(http, quotas={"tokens_per_min": 100})
    url = f"/admin/tenants/{tenant_id}"
    err = assert_openai_error(http.put(f"{url}/quotas", json={"token_burst": 50}, headers=ADMIN), 400)
    assert err["param"] == "quotas.token_burst"
    err = assert_openai_error(http.patch(url, json={"quotas": {"request_burst": 3}}, headers=ADMIN), 400)
    assert err["param"] == "quotas.request_burst"
    assert http.get(url, headers=ADMIN).json()["quotas"]["tokens_per_min"] == 100  # nothing written
    # with its rate, in the same body or already stored, a burst is taken
    patched = http.patch(url, json={"quotas": {"token_burst": 50}}, headers=ADMIN)
    assert patched.status_code == 200 and patched.json()["quotas"]["token_burst"] == 50
    both = {"quotas": {"request_burst": 3, "requests_per_min": 1}}
    assert http.patch(url, json=both, headers=ADMIN).json()["quotas"]["request_burst"] == 3


def test_admin_routes_need_the_admin_token(http: httpx.Client) -> None:
    _, key = new_tenant(http)
    assert_openai_error(http.get("/admin/tenants"), 401)
    assert_openai_error(http.get("/admin/tenants", headers=auth(key)), 403, "admin_required")
    assert_openai_error(http.get("/admin/tenants", headers=auth(ADMIN_TOKEN + "x")), 403, "admin_required")
    assert http.get("/admin/tenants", headers=ADMIN).status_code == 200


def test_admin_tenant_lifecycle(http: httpx.Client) -> None:
    tenant_id, _ = new_tenant(http, weight=2, priority_class="batch")
    assert_openai_error(http.post("/admin/tenants", json={"id": tenant_id, "name": "x"}, headers=ADMIN), 409)
    assert_openai_error(http.post("/admin/tenants", json={"id": "Bad Id", "name": "x"}, headers=ADMIN), 400)
    assert_openai_error(
        http.post("/admin/tenants", json={"id": "zz", "name": "x", "priority_class": "vip"}, headers=ADMIN),
        400,
        "invalid_priority",
    )
    got = http.get(f"/admin/tenants/{tenant_id}", headers=ADMIN).json()
    assert got["weight"] == 2 and got["priority_class"] == "batch" and got["max_priority_class"] == "batch"
    patched = http.patch(f"/admin/tenants/{tenant_id}", json={"name": "renamed"}, headers=ADMIN).json()
    assert patched["name"] == "renamed" and patched["weight"] == 2
    quotas = {"requests_per_min": 10, "tokens_per_min": 5000, "token_burst": 800}
    assert http.put(f"/admin/tenants/{tenant_id}/quotas", json=quotas, headers=ADMIN).json()["quotas"] == {
        **quotas,
        "request_burst": None,
        "models": None,
    }
    # PATCH merges quotas (RFC 7386): the fields it leaves out are kept, null makes one unlimited
    url = f"/admin/tenants/{tenant_id}"
    merged = http.patch(url, json={"quotas": {"requests_per_min": 20}}, headers=ADMIN).json()["quotas"]
    assert merged == {**quotas, "requests_per_min": 20, "request_burst": None, "models": None}
    cleared = http.patch(url, json={"quotas": {"tokens_per_min": None}}, headers=ADMIN).json()["quotas"]
    assert cleared == {
        **quotas,
        "requests_per_min": 20,
        "tokens_per_min": None,
        "request_burst": None,
        "models": None,
    }
    assert http.get(url, headers=ADMIN).json()["quotas"] == cleared
    second = http.post(f"/admin/tenants/{tenant_id}/keys", json={}, headers=ADMIN).json()
    keys = http.get(f"/admin/tenants/{tenant_id}/keys", headers=ADMIN).json()["data"]
    assert len(keys) == 2 and all("digest" not in k and "api_key" not in k for k in keys)
    assert second["api_key"].startswith(second["prefix"] + ".")
    ids = [t["id"] for t in http.get("/admin/tenants", headers=ADMIN).json()["data"]]
    assert tenant_id in ids
    assert http.delete(f"/admin/tenants/{tenant_id}", headers=ADMIN).status_code == 204
    assert_openai_error(http.get(f"/admin/tenants/{tenant_id}", headers=ADMIN), 404, "tenant_not_found")
    assert_openai_error(http.post("/v1/models", headers=auth(second["api_key"])), 405)
    assert_openai_error(http.get("/v1/models", headers=auth(second["api_key"])), 401)


def test_key_issue_refuses_fields_it_does_not_serve(http: httpx.Client) -> None:
    # an ignored field (nu: "expires_at", before keys could expire) would leave an admin believing it holds
    tenant_id, _ = new_tenant(http)
    resp = http.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "k", "expires_in": 1}, headers=ADMIN)
    assert assert_openai_error(resp, 400, "unknown_parameter")["param"] == "expires_in"
    err = assert_openai_error(
        http.post(f"/admin/tenants/{tenant_id}/keys", json={"name": 5}, headers=ADMIN), 400
    )
    assert err["param"] == "name"
    keys = http.get(f"/admin/tenants/{tenant_id}/keys", headers=ADMIN).json()["data"]
    assert len(keys) == 1  # new_tenant's own: the refused calls issued nothing


def test_retrieve_one_model(http: httpx.Client) -> None:
    # OpenAI's GET /v1/models/{model} (the openai client's models.retrieve)
    _, key = new_tenant(http)
    got = http.get(f"/v1/models/{MODEL}", headers=auth(key))
    assert got.status_code == 200, got.text
    assert got.json() == {
        "id": MODEL,
        "object": "model",
        "created": 0,
        "owned_by": "radixgate",
        "root": MODEL,  # issue 27: an alias's root is its model's id
        "context_length": 512,  # the setting (the fake worker reports none)
        "capabilities": {"tools": True, "structured_outputs": True},
    }
    assert_openai_error(http.get("/v1/models/nope", headers=auth(key)), 404, "model_not_found")
    assert_openai_error(http.get(f"/v1/models/{MODEL}"), 401)
    _, limited = new_tenant(http, allowed_models=[])
    assert_openai_error(http.get(f"/v1/models/{MODEL}", headers=auth(limited)), 404, "model_not_found")


def test_keys_are_stored_only_as_digests(http: httpx.Client, redis_url: str) -> None:
    _, key = new_tenant(http)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    secret = key.split(".", 1)[1]
    for name in client.scan_iter("*key*"):
        value = client.get(name) if client.type(name) == "string" else ""
        assert secret not in (value or "") and key not in (value or "")
    client.close()


def test_429_with_retry_after_when_the_request_bucket_is_empty(
    http: httpx.Client, worker: FakeWorker
) -> None:
    tenant_id, key = new_tenant(http, quotas={"requests_per_min": 2})
    for _ in range(2):
        assert (
            http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)).status_code == 200
        )
    resp = http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key))
    assert_openai_error(resp, 429, "rate_limit_exceeded")
    assert resp.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(resp.headers["Retry-After"]) <= 30  # 2/min: one request back within 30 s
    assert len(worker.received) == 2
    usage = usage_of(http, tenant_id)
    assert usage["requests"] == 2 and usage["quota_rejections"] == 1
    assert usage["oversized_rejections"] == 0
    assert quota_rejections(http, tenant_id) == {("requests", "rate_limited"): 1.0}


def test_429_on_tokens_and_refund_after_reconcile(http: httpx.Client, worker: FakeWorker) -> None:
    # burst 100 tokens: a request reserving ~5 prompt + 60 max_tokens fits once, not twice ...
    _, key = new_tenant(http, quotas={"tokens_per_min": 1, "token_burst": 100})
    assert http.post("/v1/chat/completions", json=chat(max_tokens=60), headers=auth(key)).status_code == 200
    # ... but it only used 8 completion tokens, so the unused reservation was refunded: it fits again
    assert http.post("/v1/chat/completions", json=chat(max_tokens=60), headers=auth(key)).status_code == 200
    resp = http.post("/v1/chat/completions", json=chat(max_tokens=85), headers=auth(key))
    assert_openai_error(resp, 429, "rate_limit_exceeded")
    assert int(resp.headers["Retry-After"]) > 60


def test_request_larger_than_the_burst_gets_413_not_429(http: httpx.Client, worker: FakeWorker) -> None:
    tenant_id, key = new_tenant(http, quotas={"tokens_per_min": 1000, "token_burst": 50})
    resp = http.post("/v1/chat/completions", json=chat(max_tokens=100), headers=auth(key))
    err = assert_openai_error(resp, 413, "request_exceeds_burst")
    assert "burst" in err["message"] and "Retry-After" not in resp.headers
    assert worker.received == []
    # the request's own size, not a rate limit: counted apart, so dashboards show no quota storm
    assert quota_rejections(http, tenant_id) == {("tokens", "exceeds_burst"): 1.0}
    usage = usage_of(http, tenant_id)
    assert (usage["quota_rejections"], usage["oversized_rejections"]) == (0, 1)


def test_a_request_without_max_tokens_fits_its_default_to_the_token_burst(
    http: httpx.Client, worker: FakeWorker
) -> None:
    # nu19: the default max_tokens (256) made every request without max_tokens of a tenant whose token
    # burst is smaller a 413 telling it to "lower max_tokens", a field it never sent
    tenant_id, key = new_tenant(http, quotas={"tokens_per_min": 100})
    resp = http.post("/v1/chat/completions", json=chat(), headers=auth(key))
    assert resp.status_code == 200, resp.text
    fitted = worker.received[-1]["sampling_params"]["max_new_tokens"]
    assert 0 < fitted < 100 - 5  # the burst less the prompt (the gateway's count of a few tokens)
    prompt = 100 - fitted
    resp = http.post("/v1/chat/completions", json=chat(n=2), headers=auth(key))
    assert resp.status_code in (200, 429), resp.text  # fits the burst; the bucket may still be short
    if resp.status_code == 200:
        assert worker.received[-1]["sampling_params"]["max_new_tokens"] == (100 - prompt) // 2
    # a prompt larger than the burst is still the request's own 413
    resp = http.post("/v1/chat/completions", json=chat("word " * 150), headers=auth(key))
    assert_openai_error(resp, 413, "request_exceeds_burst")
    assert usage_of(http, tenant_id)["oversized_rejections"] == 1


def quota_rejections(http: httpx.Client, tenant_id: str) -> dict[tuple[str, str], float]:
    """``radixgate_quota_rejections_total`` of one tenant on /metrics: (bucket, reason) -> count."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "radixgate_quota_rejections_total" and sample.labels["tenant"] == tenant_id:
                out[(sample.labels["bucket"], sample.labels["reason"])] = sample.value
    return out


def test_upstream_500_gives_502_and_refunds(http: httpx.Client, worker: FakeWorker) -> None:
    tenant_id, key = new_tenant(http, quotas={"requests_per_min": 1})
    worker.mode = "error500"
    assert_openai_error(
        http.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth(key)), 502, "upstream_error"
    )
    assert_openai_error(
        http.post("/v1/chat/completions", json=chat(max_tokens=2, stream=True), headers=auth(key)), 502
    )
    worker.mode = "ok"
    # the single request slot was refunded both times
    assert http.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth(key)).status_code == 200
    usage = usage_of(http, tenant_id)
    assert usage["requests"] == 1 and usage["errors"] == 2


def test_stream_broken_mid_way_ends_with_an_error_event(http: httpx.Client, worker: FakeWorker) -> None:
    tenant_id, key = new_tenant(http)
    worker.mode = "break_after_2"
    with http.stream(
        "POST", "/v1/chat/completions", json=chat(max_tokens=6, stream=True), headers=auth(key)
    ) as resp:
        lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["error"]["code"] == "upstream_error"
    text = "".join(json.loads(x)["choices"][0]["delta"].get("content", "") for x in lines[:-2])
    assert text == "alpha beta"
    assert usage_of(http, tenant_id)["completion_tokens"] == 2  # only what was delivered is charged


def test_upstream_down_gives_503_and_charges_nothing(redis_url: str, stub_model_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    app = create_app(gateway_settings(redis_url, stub_model_dir, [dead]))
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        tenant_id, key = new_tenant(http, quotas={"requests_per_min": 1})
        for _ in range(2):
            resp = http.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth(key))
            assert_openai_error(resp, 503)
            assert resp.headers["Retry-After"] == "1"
        assert usage_of(http, tenant_id)["requests"] == 0
        ready = http.get("/readyz", headers=ADMIN)  # the detail is an operator's (docs/security.md)
        assert ready.status_code == 503 and ready.json()["redis"] is True


def test_health_readiness_models_usage_and_metrics(http: httpx.Client, worker: FakeWorker) -> None:
    tenant_id, key = new_tenant(http)
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").json()["ready"] is True
    models = http.get("/v1/models", headers=auth(key)).json()["data"]
    assert [m["id"] for m in models] == [MODEL, "test-model-b"]
    http.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth(key))
    own = http.get("/v1/usage", headers=auth(key)).json()
    assert own["tenant_id"] == tenant_id and own["completion_tokens"] == 2
    assert usage_of(http, tenant_id) == own  # the admin's view has the same shape (nu13: no quotas, no total)
    assert own["total_tokens"] == own["prompt_tokens"] + 2 and "requests_per_min" in own["quotas"]
    text = http.get("/metrics").text
    assert f'radixgate_requests_total{{model="{MODEL}",status="200",tenant="{tenant_id}"}} 1.0' in text
    assert f'radixgate_completion_tokens_total{{tenant="{tenant_id}"}} 2.0' in text
    assert "radixgate_time_to_first_token_seconds_bucket" in text
    assert "radixgate_in_flight_requests 0.0" in text


def test_one_json_log_line_per_request_without_prompt_or_key(http: httpx.Client, worker: FakeWorker) -> None:
    import io

    from service.observability.logs import configure_logging

    buf = io.StringIO()
    configure_logging("INFO", stream=buf)
    try:
        tenant_id, key = new_tenant(http)
        secret_prompt = "zebra-unique-prompt-words"
        resp = http.post("/v1/chat/completions", json=chat(secret_prompt, max_tokens=2), headers=auth(key))
        rid = resp.headers["x-request-id"]
        deadline = time.monotonic() + 5  # the line is written once the answer is sent and settled

        def mine() -> list[dict[str, Any]]:
            lines = [json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{")]
            return [ln for ln in lines if ln.get("event") == "request" and ln.get("request_id") == rid]

        while not mine() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # a second line, were there one, would come with the first
        found = mine()
    finally:
        configure_logging("INFO")
    assert len(found) == 1
    entry = found[0]
    assert entry["tenant"] == tenant_id and entry["status"] == 200 and entry["worker"]
    assert entry["completion_tokens"] == 2 and entry["latency_ms"] > 0
    # a non-streamed answer's TTFT is the worker's first token; this worker reports no times: unknown,
    # never the end-to-end time
    assert entry["ttft_ms"] is None
    phases = entry["phases_ms"]
    assert {"auth", "prepare", "quota", "route", "queue"} <= set(phases)
    assert sum(phases.values()) <= entry["latency_ms"] + 0.1 and entry["overhead_ms"] >= 0
    # where the time went: the gateway's queue, and what admission predicted (0: rates not measured yet)
    assert 0 <= entry["queued_ms"] <= entry["latency_ms"] and entry["predicted_ttft_ms"] >= 0
    assert worker.received[-1]["rid"] == rid  # the same id reaches SGLang
    text = buf.getvalue()
    assert secret_prompt not in text and key not in text and key.split(".")[1] not in text


def test_concurrent_admin_patches_of_one_tenant_lose_no_update(gateway: str) -> None:
    """Two operators (or a script and an operator) patching different fields of one tenant at once both
    land: a PATCH of the quotas racing a disable must not re-enable the tenant (read-modify-write without
    a check lost one of them in 16 of 20 rounds)."""
    with httpx.Client(base_url=gateway, timeout=30) as a, httpx.Client(base_url=gateway, timeout=30) as b:
        tenant_id, _ = new_tenant(a, quotas={"requests_per_min": 5})
        url = f"/admin/tenants/{tenant_id}"
        lost = []
        with ThreadPoolExecutor(2) as pool:
            for i in range(20):
                assert a.post(f"{url}/enable", headers=ADMIN).status_code == 200
                quotas = {"requests_per_min": 100 + i}
                done = [
                    pool.submit(a.post, f"{url}/disable", headers=ADMIN),
                    pool.submit(b.patch, url, json={"quotas": quotas}, headers=ADMIN),
                ]
                assert [f.result().status_code for f in done] == [200, 200]
                tenant = a.get(url, headers=ADMIN).json()
                if tenant["enabled"] or tenant["quotas"]["requests_per_min"] != 100 + i:
                    lost.append((i, tenant["enabled"], tenant["quotas"]))
        assert lost == []


def test_concurrent_patches_of_different_quota_fields_both_land(gateway: str) -> None:
    """A JSON merge patch of ``quotas`` keeps the quota fields it leaves out, also when another PATCH of
    another quota field races it: the merge with the stored quotas happens where the record is written
    (merged with a copy read before the write, one of the two was lost in 29 of 30 rounds)."""
    with httpx.Client(base_url=gateway, timeout=30) as a, httpx.Client(base_url=gateway, timeout=30) as b:
        tenant_id, _ = new_tenant(a, quotas={"requests_per_min": 1, "tokens_per_min": 1})
        url = f"/admin/tenants/{tenant_id}"
        lost = []
        with ThreadPoolExecutor(2) as pool:
            for i in range(20):
                done = [
                    pool.submit(a.patch, url, json={"quotas": {"requests_per_min": 100 + i}}, headers=ADMIN),
                    pool.submit(b.patch, url, json={"quotas": {"tokens_per_min": 1000 + i}}, headers=ADMIN),
                ]
                assert [f.result().status_code for f in done] == [200, 200]
                quotas = a.get(url, headers=ADMIN).json()["quotas"]
                if (quotas["requests_per_min"], quotas["tokens_per_min"]) != (100 + i, 1000 + i):
                    lost.append((i, quotas))
        assert lost == []


def test_concurrent_patches_of_the_priority_classes_never_store_a_default_above_the_max(gateway: str) -> None:
    """A PATCH lowering ``max_priority_class`` racing one raising ``priority_class``: each is valid
    against the record before both, together they are not (every request of the tenant would get 403,
    and every later PATCH of another field 400). The check runs on the record the write merges with,
    so the second one gets 400 (both landed in 12 of 20 rounds when it ran on a copy read before)."""
    with httpx.Client(base_url=gateway, timeout=30) as a, httpx.Client(base_url=gateway, timeout=30) as b:
        tenant_id, _ = new_tenant(a, priority_class="standard", max_priority_class="interactive")
        url = f"/admin/tenants/{tenant_id}"
        broken = []
        with ThreadPoolExecutor(2) as pool:
            for i in range(20):
                reset = {"priority_class": "standard", "max_priority_class": "interactive"}
                assert a.patch(url, json=reset, headers=ADMIN).status_code == 200
                done = [
                    pool.submit(a.patch, url, json={"max_priority_class": "standard"}, headers=ADMIN),
                    pool.submit(b.patch, url, json={"priority_class": "interactive"}, headers=ADMIN),
                ]
                codes = sorted(f.result().status_code for f in done)
                tenant = a.get(url, headers=ADMIN).json()
                if (
                    codes != [200, 400]
                    or tenant["priority_class"] == "interactive" != tenant["max_priority_class"]
                ):
                    broken.append((i, codes, tenant["priority_class"], tenant["max_priority_class"]))
        assert broken == []


def test_admin_lists_tenants_page_by_page(http: httpx.Client) -> None:
    """``GET /admin/tenants?limit=&after=`` pages through the tenants in id order (OpenAI's list shape:
    ``has_more``, ``first_id``, ``last_id``); without ``limit`` a page of 100 (the whole list here;
    more in tests/service/api/test_admin_paging.py)."""
    for _ in range(5):
        new_tenant(http)
    everything = http.get("/admin/tenants", headers=ADMIN).json()
    assert everything["has_more"] is False
    ids = [t["id"] for t in everything["data"]]
    assert len(ids) >= 5 and ids == sorted(ids)
    seen: list[str] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 2} | ({"after": after} if after else {})
        page = http.get("/admin/tenants", params=params, headers=ADMIN).json()
        assert 1 <= len(page["data"]) <= 2
        seen += [t["id"] for t in page["data"]]
        assert page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == ids
    past_the_end = http.get("/admin/tenants", params={"after": ids[-1]}, headers=ADMIN).json()
    assert past_the_end["data"] == [] and past_the_end["has_more"] is False
    for bad in ({"limit": 0}, {"limit": "many"}, {"limit": 10**6}):
        assert_openai_error(http.get("/admin/tenants", params=bad, headers=ADMIN), 400)


@pytest.mark.parametrize("method", ["GET", "PATCH", "DELETE"])
@pytest.mark.parametrize("path", ["/admin/tenants/", "/admin/tenants/%2F%2F", "/admin/tenants//usage"])
def test_admin_empty_or_slash_ids_are_404_not_a_redirect(http: httpx.Client, method: str, path: str) -> None:
    """An empty tenant id (a script's unset variable: ``/admin/tenants/$ID``) or one of slashes gets 404 in
    OpenAI's shape, not a 307 to ``/admin/tenants`` (whose GET is the list of every tenant)."""
    resp = http.request(method, path, headers=ADMIN, json={} if method == "PATCH" else None)
    assert_openai_error(resp, 404)


def test_admin_404_does_not_echo_a_huge_id(http: httpx.Client) -> None:
    """An id of thousands of characters is cut in the 404's message (it echoed the whole id, twice for
    a key), as ids of 1-63 characters are the only ones that can exist."""
    huge = "x" * 5000
    for method, path in (("GET", f"/admin/tenants/{huge}"), ("DELETE", f"/admin/tenants/{huge}/keys/{huge}")):
        err = assert_openai_error(http.request(method, path, headers=ADMIN), 404)
        assert len(err["message"]) < 300, len(err["message"])
