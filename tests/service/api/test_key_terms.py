"""Keys that carry their own terms, per-model and per-key buckets, and OpenAI's rate-limit headers, through
the gateway's HTTP API (real Redis, simulated workers): admin checks, expiry (401 ``expired_api_key``, also
for a cached key), a key's models, a refusal naming its bucket and charging nothing, and the headers on
answers, streams and 429s as the official ``openai`` client reads them."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from service.app import create_app
from service.config.settings import Settings
from tenancy.layout import KeyLayout
from tests.conftest import ADMIN_TOKEN, MODEL, gateway_settings
from tests.service.api.test_api import assert_openai_error, auth, usage_of
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

TWO = "model-two"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
RATE_HEADERS = {
    f"x-ratelimit-{what}-{kind}"
    for what in ("limit", "remaining", "reset")
    for kind in ("requests", "tokens")
}
_ids = itertools.count()


@pytest.fixture(scope="module")
def gateway(redis_url: str, stub_model_dir: Path) -> Iterator[tuple[str, str]]:
    """A gateway serving two models (each on its own fake worker), its auth cache a minute long; (its URL,
    its Redis key prefix)."""
    one, two = FakeWorker(), FakeWorker()
    with ThreadedServer(one.app) as w1, ThreadedServer(two.app) as w2:
        prefix = f"terms{next(_ids)}:"
        settings = Settings.model_validate(
            {
                "admin_token": ADMIN_TOKEN,
                "redis": {"url": redis_url, "key_prefix": prefix, "auth_cache_ttl_s": 60},
                "upstream": {"health_interval_s": 0.2},
                "api": {"context_length": 512},
                "models": [
                    {"id": MODEL, "workers": [w1.url], "tokenizer_path": str(stub_model_dir)},
                    {
                        "id": TWO,
                        "aliases": ["two-alias"],
                        "workers": [w2.url],
                        "tokenizer_path": str(stub_model_dir),
                    },
                ],
            }
        )
        with ThreadedServer(create_app(settings)) as server:
            yield server.url, prefix


@pytest.fixture
def http(gateway: tuple[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway[0], timeout=30) as client:
        yield client


def tenant(http: httpx.Client, **spec: Any) -> str:
    tenant_id = f"k{next(_ids)}"
    body = {"id": tenant_id, "name": tenant_id, **spec}
    resp = http.post("/admin/tenants", json=body, headers=ADMIN)
    assert resp.status_code == 201, resp.text
    return tenant_id


def issue(http: httpx.Client, tenant_id: str, **terms: Any) -> dict[str, Any]:
    resp = http.post(f"/admin/tenants/{tenant_id}/keys", json=terms, headers=ADMIN)
    assert resp.status_code == 201, resp.text
    issued: dict[str, Any] = resp.json()
    return issued


def chat(model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 2,
        **extra,
    }


TENANT_QUOTAS = {"requests_per_min": 600, "tokens_per_min": 60000}


@pytest.mark.parametrize(
    ("terms", "param", "code"),
    [
        ({"expires_at": True}, "expires_at", "invalid_value"),
        ({"expires_at": "2027-01-31T00:00:00"}, "expires_at", "invalid_value"),  # no offset
        ({"expires_at": "next week"}, "expires_at", "invalid_value"),
        ({"expires_at": 0}, "expires_at", "invalid_value"),
        ({"expires_at": 1e13}, "expires_at", "invalid_value"),  # past year 9999
        ({"allowed_models": ["nope"]}, "allowed_models", "model_not_found"),
        ({"allowed_models": [TWO]}, "allowed_models", "model_not_allowed"),  # not the tenant's
        ({"allowed_models": ["m"] * 300}, "allowed_models", None),
        ({"quotas": {"requests_per_min": 601}}, "quotas.requests_per_min", "invalid_value"),
        ({"quotas": {"tokens_per_min": 100, "token_burst": 60001}}, "quotas.token_burst", "invalid_value"),
        ({"quotas": {"token_burst": 100}}, "quotas.token_burst", "invalid_value"),  # a burst, no rate
        ({"quotas": {"requests_per_min": 6, "request_burst": 0.5}}, "quotas.request_burst", "invalid_value"),
        ({"quotas": {"requests_per_min": -1}}, "quotas.requests_per_min", None),
        ({"quotas": {"models": []}}, "quotas.models", "unknown_parameter"),  # a key's quotas name no models
    ],
)
def test_key_terms_are_checked_against_the_tenant(
    http: httpx.Client, terms: dict[str, Any], param: str, code: str | None
) -> None:
    tenant_id = tenant(http, quotas=TENANT_QUOTAS, allowed_models=[MODEL])
    resp = http.post(f"/admin/tenants/{tenant_id}/keys", json=terms, headers=ADMIN)
    assert assert_openai_error(resp, 400, code)["param"] == param
    assert http.get(f"/admin/tenants/{tenant_id}/keys", headers=ADMIN).json()["data"] == []


@pytest.mark.parametrize(
    ("models", "param", "code"),
    [
        (
            [{"model": "two-alias", "requests_per_min": 5}],
            "quotas.models.0.model",
            "model_not_found",
        ),  # alias
        ([{"model": "nope", "requests_per_min": 5}], "quotas.models.0.model", "model_not_found"),
        ([{"model": TWO, "requests_per_min": 5}] * 2, "quotas.models", "invalid_value"),  # twice
        ([{"model": MODEL, "token_burst": 5}], "quotas.models.0.token_burst", "invalid_value"),
        ([{"model": TWO, "rpm": 5}], "quotas.models.0.rpm", "unknown_parameter"),
        ([{"model": f"m{i}", "requests_per_min": 1} for i in range(65)], "quotas.models", None),
    ],
)
def test_model_quotas_name_served_ids(
    http: httpx.Client, models: list[dict[str, Any]], param: str, code: str | None
) -> None:
    resp = http.post(
        "/admin/tenants", json={"id": "badm", "name": "x", "quotas": {"models": models}}, headers=ADMIN
    )
    assert assert_openai_error(resp, 400, code)["param"] == param
    tenant_id = tenant(http)
    for body in ({"quotas": {"models": models}}, None):
        if body is None:  # PUT replaces all quotas
            resp = http.put(f"/admin/tenants/{tenant_id}/quotas", json={"models": models}, headers=ADMIN)
        else:
            resp = http.patch(f"/admin/tenants/{tenant_id}", json=body, headers=ADMIN)
        # the PUT body is the quotas: its schema errors name the field from there (as for every quota)
        assert assert_openai_error(resp, 400, code)["param"] in (param, param.removeprefix("quotas."))
    assert http.get(f"/admin/tenants/{tenant_id}", headers=ADMIN).json()["quotas"]["models"] is None


def test_a_key_s_terms_are_shown_and_patched(http: httpx.Client) -> None:
    tenant_id = tenant(http, quotas=TENANT_QUOTAS)
    issued = issue(
        http,
        tenant_id,
        name="ci",
        expires_at="2030-01-01T00:00:00+01:00",
        allowed_models=[TWO],
        quotas={"requests_per_min": 60},
    )
    expected = {
        "expires_at": datetime(2029, 12, 31, 23, tzinfo=UTC).timestamp(),
        "allowed_models": [TWO],
        "quotas": {
            "requests_per_min": 60,
            "tokens_per_min": None,
            "request_burst": None,
            "token_burst": None,
        },
    }
    assert {k: issued[k] for k in expected} == expected
    url = f"/admin/tenants/{tenant_id}/keys/{issued['key_id']}"
    got = http.get(url, headers=ADMIN).json()
    assert got == {k: v for k, v in issued.items() if k != "api_key"}
    listed = http.get(f"/admin/tenants/{tenant_id}/keys", headers=ADMIN).json()["data"]
    assert listed == [got]
    patched = http.patch(url, json={"quotas": {"tokens_per_min": 500}, "allowed_models": None}, headers=ADMIN)
    assert patched.status_code == 200, patched.text
    body = patched.json()
    assert body["quotas"]["requests_per_min"] == 60 and body["quotas"]["tokens_per_min"] == 500
    assert body["allowed_models"] is None and body["expires_at"] == expected["expires_at"]
    assert body["name"] == "ci"
    # refused patches write nothing: above the tenant, a null name, another tenant's key
    too_much = http.patch(url, json={"quotas": {"tokens_per_min": 1e6}}, headers=ADMIN)
    assert assert_openai_error(too_much, 400, "invalid_value")["param"] == "quotas.tokens_per_min"
    assert assert_openai_error(http.patch(url, json={"name": None}, headers=ADMIN), 400)["param"] == "name"
    other = tenant(http)
    assert_openai_error(
        http.patch(f"/admin/tenants/{other}/keys/{issued['key_id']}", json={}, headers=ADMIN),
        404,
        "key_not_found",
    )
    assert_openai_error(http.get(f"/admin/tenants/{other}/keys/{issued['key_id']}", headers=ADMIN), 404)
    assert http.get(url, headers=ADMIN).json() == body


def test_an_expired_key_gets_401_also_once_cached(http: httpx.Client) -> None:
    tenant_id = tenant(http)
    soon = datetime.fromtimestamp(time.time() + 1.5, UTC).isoformat()
    issued = issue(http, tenant_id, expires_at=soon)
    key = issued["api_key"]
    first = http.post("/v1/chat/completions", json=chat(), headers=auth(key))  # cached for 60 s from here
    assert first.status_code == 200, first.text
    while time.time() < issued["expires_at"]:
        time.sleep(0.05)
    err = assert_openai_error(http.post("/v1/chat/completions", json=chat(), headers=auth(key)), 401)
    assert err["code"] == "expired_api_key" and issued["key_id"] in err["message"]
    assert_openai_error(http.get("/v1/models", headers=auth(key)), 401, "expired_api_key")
    # an admin moves the expiry on: it works again at once; back into the past: refused at once
    url = f"/admin/tenants/{tenant_id}/keys/{issued['key_id']}"
    assert http.patch(url, json={"expires_at": None}, headers=ADMIN).status_code == 200
    assert http.post("/v1/chat/completions", json=chat(), headers=auth(key)).status_code == 200
    assert http.patch(url, json={"expires_at": 1_000_000_000}, headers=ADMIN).status_code == 200
    assert_openai_error(
        http.post("/v1/chat/completions", json=chat(), headers=auth(key)), 401, "expired_api_key"
    )
    assert usage_of(http, tenant_id)["requests"] == 2


def test_a_key_s_models_narrow_its_tenant_s(http: httpx.Client) -> None:
    tenant_id = tenant(http)
    key = issue(http, tenant_id, allowed_models=[TWO])["api_key"]
    err = assert_openai_error(http.post("/v1/chat/completions", json=chat(), headers=auth(key)), 403)
    assert (
        err["code"] == "model_not_allowed" and err["param"] == "model" and "restricted to" in err["message"]
    )
    assert http.post("/v1/chat/completions", json=chat("two-alias"), headers=auth(key)).status_code == 200
    assert [m["id"] for m in http.get("/v1/models", headers=auth(key)).json()["data"]] == [TWO, "two-alias"]
    assert_openai_error(http.get(f"/v1/models/{MODEL}", headers=auth(key)), 404)
    other = issue(http, tenant_id)["api_key"]  # the tenant's other keys keep every model
    assert http.post("/v1/chat/completions", json=chat(), headers=auth(other)).status_code == 200
    assert usage_of(http, tenant_id)["requests"] == 2


def bucket_levels(gateway: tuple[str, str], redis_url: str, tenant_id: str) -> dict[str, float]:
    """Every stored bucket of a tenant: name after the tenant id -> level."""
    prefix = KeyLayout(gateway[1]).scoped_bucket_prefix(tenant_id)
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        return {
            str(k)[len(prefix) :]: float(r.hget(k, "level") or 0) for k in r.scan_iter(match=f"{prefix}*")
        }


def test_a_key_bucket_refuses_naming_the_key_and_charges_nothing(
    http: httpx.Client, gateway: tuple[str, str], redis_url: str
) -> None:
    tenant_id = tenant(http, quotas={"requests_per_min": 60, "tokens_per_min": 6000})
    issued = issue(http, tenant_id, quotas={"requests_per_min": 1, "request_burst": 2})
    key = issued["api_key"]
    for _ in range(2):
        assert http.post("/v1/chat/completions", json=chat(), headers=auth(key)).status_code == 200
    before = bucket_levels(gateway, redis_url, tenant_id)
    refused = http.post("/v1/chat/completions", json=chat(), headers=auth(key))
    err = assert_openai_error(refused, 429, "rate_limit_exceeded")
    assert err["quota"] == {"scope": "key", "id": issued["key_id"], "bucket": "requests"}
    assert f"API key 'rg-{issued['key_id']}'" in err["message"]
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"  # the key's bucket: closest to empty
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert 55 <= int(refused.headers["retry-after-ms"]) <= 60_000 and refused.headers["retry-after"] == "60"
    after = bucket_levels(gateway, redis_url, tenant_id)
    assert (
        after.keys()
        == before.keys()
        == {
            f"key:{issued['key_id']}:requests",
            "requests",
            "tokens",
        }
    )
    assert after["tokens"] == before["tokens"] and after[f"key:{issued['key_id']}:requests"] < 0.01
    assert after["requests"] - before["requests"] < 0.5  # refilled a little, nothing taken
    usage = usage_of(http, tenant_id)
    assert (usage["requests"], usage["quota_rejections"]) == (2, 1)
    other = issue(http, tenant_id)["api_key"]  # the tenant's other keys are not limited by it
    assert http.post("/v1/chat/completions", json=chat(), headers=auth(other)).status_code == 200


def test_a_model_bucket_refuses_naming_the_model(http: httpx.Client) -> None:
    models = [{"model": TWO, "requests_per_min": 1, "request_burst": 2, "tokens_per_min": 6000}]
    tenant_id = tenant(http, quotas={"requests_per_min": 600, "models": models})
    stored = http.get(f"/admin/tenants/{tenant_id}", headers=ADMIN).json()["quotas"]["models"]
    assert stored[0]["model"] == TWO and stored[0]["request_burst"] == 2
    key = issue(http, tenant_id)["api_key"]
    assert http.post("/v1/chat/completions", json=chat(TWO), headers=auth(key)).status_code == 200
    ok = http.post("/v1/chat/completions", json=chat("two-alias"), headers=auth(key))  # an alias is its model
    assert ok.status_code == 200 and ok.headers["x-ratelimit-remaining-requests"] == "0"
    err = assert_openai_error(http.post("/v1/chat/completions", json=chat(TWO), headers=auth(key)), 429)
    assert err["quota"] == {"scope": "model", "id": TWO, "bucket": "requests"}
    assert f"model '{TWO}' of tenant '{tenant_id}'" in err["message"]
    for _ in range(3):  # the other model is limited by the tenant's buckets only
        assert http.post("/v1/chat/completions", json=chat(), headers=auth(key)).status_code == 200
    # the entry removed: the model takes from the tenant's buckets alone
    assert (
        http.patch(
            f"/admin/tenants/{tenant_id}", json={"quotas": {"models": None}}, headers=ADMIN
        ).status_code
        == 200
    )
    assert http.post("/v1/chat/completions", json=chat(TWO), headers=auth(key)).status_code == 200


def test_headers_on_answers_streams_and_429s(http: httpx.Client) -> None:
    tenant_id = tenant(http, quotas={"requests_per_min": 60, "tokens_per_min": 60, "token_burst": 100})
    key = issue(http, tenant_id)["api_key"]
    first = http.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth(key))
    assert first.status_code == 200 and set(first.headers) >= RATE_HEADERS
    tokens_left = int(first.headers["x-ratelimit-remaining-tokens"])
    assert 50 < tokens_left <= 100 - 2 - 1  # after its reservation: the prompt and max_tokens
    assert first.headers["x-ratelimit-limit-requests"] == "60"
    assert first.headers["x-ratelimit-remaining-requests"] == "59"
    assert first.headers["x-ratelimit-reset-requests"] == "1s"  # one request at 1/s
    assert first.headers["x-ratelimit-limit-tokens"] == "100"
    assert first.headers["x-ratelimit-reset-tokens"].endswith("s")
    req = chat(max_tokens=3, stream=True)
    with http.stream("POST", "/v1/chat/completions", json=req, headers=auth(key)) as resp:
        assert resp.status_code == 200 and set(resp.headers) >= RATE_HEADERS
        assert resp.headers["x-ratelimit-remaining-requests"] == "58"
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    big = http.post("/v1/chat/completions", json=chat(max_tokens=85), headers=auth(key))  # 13 + 85 tokens
    assert_openai_error(big, 429, "rate_limit_exceeded")
    assert set(big.headers) >= RATE_HEADERS and int(big.headers["x-ratelimit-remaining-tokens"]) < 98
    assert big.headers["x-ratelimit-remaining-requests"] == "58"  # nothing taken
    never = http.post("/v1/chat/completions", json=chat(max_tokens=99), headers=auth(key))  # above the burst
    assert assert_openai_error(never, 413, "request_exceeds_burst")["quota"]["bucket"] == "tokens"
    assert set(never.headers) >= RATE_HEADERS and never.headers["x-ratelimit-limit-tokens"] == "100"
    unlimited = issue(http, tenant(http))["api_key"]  # no bucket, no header
    plain = http.post("/v1/chat/completions", json=chat(), headers=auth(unlimited))
    assert plain.status_code == 200 and not RATE_HEADERS & set(plain.headers)


def test_the_openai_client_sees_the_headers(http: httpx.Client, gateway: tuple[str, str]) -> None:
    tenant_id = tenant(http, quotas={"requests_per_min": 60, "request_burst": 2, "tokens_per_min": 6000})
    key = issue(http, tenant_id)["api_key"]
    client = openai.OpenAI(base_url=f"{gateway[0]}/v1", api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"
    assert raw.headers["x-ratelimit-limit-tokens"] == "6000"
    streamed = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
    )
    assert streamed.headers["x-ratelimit-remaining-requests"] == "0"
    assert [c for c in streamed.parse() if c.choices]
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    headers = refused.value.response.headers
    assert headers["x-ratelimit-remaining-requests"] == "0" and float(headers["retry-after-ms"]) > 0
    assert refused.value.code == "rate_limit_exceeded"
    body = json.loads(refused.value.response.text)["error"]
    assert body["quota"] == {"scope": "tenant", "id": tenant_id, "bucket": "requests"}
    client.close()


def test_headers_can_be_turned_off(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]
) -> None:
    settings = gateway_settings(redis_url, stub_model_dir, [fake[1]], rate_limit_headers=False)
    app = create_app(settings)
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        leased = {"requests_per_min": 1e9, "tokens_per_min": 1e12}  # admitted from a lease after the first
        small = {"requests_per_min": 60, "request_burst": 1}  # decided in Redis
        for quotas in (leased, small):
            key = issue(http, tenant(http, quotas=quotas))["api_key"]
            answers = [http.post("/v1/chat/completions", json=chat(), headers=auth(key)) for _ in range(3)]
            for resp in answers:
                assert not RATE_HEADERS & set(resp.headers) and "retry-after-ms" not in resp.headers
            if quotas is small:  # the refusal still names its bucket
                assert [r.status_code for r in answers] == [200, 429, 429]
                assert assert_openai_error(answers[1], 429)["quota"]["scope"] == "tenant"
            else:
                assert [r.status_code for r in answers] == [200] * 3
