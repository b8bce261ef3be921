"""Cost and budgets over HTTP (issue 30): the admin's prices, each request's cost in usage, its log line and
radixgate_cost_usd_total, the usage export (JSON, CSV, bad ranges), budgets (429 insufficient_quota, nothing
charged, the soft limit told once), and concurrent requests never taking the spend past the hard limit."""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from policies.billing_periods import period_window, utc_day
from policies.pricing import ModelPrice, pico_to_usd, request_cost, usd_text, worst_case_cost
from service.app import create_app
from service.config.pricing import PricingSettings
from tests.conftest import MODEL, gateway_settings
from tests.service.api.test_api import ADMIN, assert_openai_error, auth, chat, new_tenant, usage_of
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

SETTINGS_PRICE = {"input_per_mtok": 0.15, "cached_input_per_mtok": 0.075, "output_per_mtok": 0.6}


@pytest.fixture(scope="module")
def gateway(redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]) -> Iterator[str]:
    settings = gateway_settings(redis_url, stub_model_dir, [fake[1]])
    settings.pricing = PricingSettings.model_validate(
        {"models": {MODEL: SETTINGS_PRICE}, "usage_retention_days": 30}
    )
    with ThreadedServer(create_app(settings)) as server:
        yield server.url


@pytest.fixture
def worker(fake: tuple[FakeWorker, str]) -> FakeWorker:
    fake[0].mode, fake[0].delay_s, fake[0].cached_tokens = "ok", 0.0, 0
    return fake[0]


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


def price_now(http: httpx.Client) -> ModelPrice:
    info = http.get(f"/admin/prices/{MODEL}", headers=ADMIN).json()
    return ModelPrice(
        round(info["input_per_mtok"] * 10**6),
        round(info["cached_input_per_mtok"] * 10**6),
        round(info["output_per_mtok"] * 10**6),
    )


def usage_cost(usage: dict[str, Any], price: ModelPrice) -> int:
    """The exact cost of an answer's (worker-reported) usage."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return request_cost(price, usage["prompt_tokens"], cached, usage["completion_tokens"])


def test_admin_prices_bounded_and_over_the_settings(http: httpx.Client, worker: FakeWorker) -> None:
    listed = http.get("/admin/prices", headers=ADMIN).json()["data"]
    assert listed == [{"model": MODEL, **SETTINGS_PRICE, "source": "settings"}]
    assert http.get("/admin/prices/test-model-b", headers=ADMIN).json()["model"] == MODEL  # an alias
    assert_openai_error(http.get("/admin/prices/nope", headers=ADMIN), 404, "model_not_found")
    good = {"input_per_mtok": 3, "output_per_mtok": 15}
    assert_openai_error(
        http.put("/admin/prices/test-model-b", json=good, headers=ADMIN), 400, "model_not_found"
    )
    for bad in (
        {"input_per_mtok": 0.1234567, "output_per_mtok": 1},  # below a micro-dollar
        {"input_per_mtok": -1, "output_per_mtok": 1},
        {"input_per_mtok": 1e9, "output_per_mtok": 1},
        {"input_per_mtok": "1", "output_per_mtok": 1},  # no coercion
        {"input_per_mtok": 1},
        {**good, "currency": "eur"},
    ):
        err = assert_openai_error(http.put(f"/admin/prices/{MODEL}", json=bad, headers=ADMIN), 400)
        assert err["type"] == "invalid_request_error", bad
    assert http.get(f"/admin/prices/{MODEL}", headers=ADMIN).json()["source"] == "settings"
    assert http.put(f"/admin/prices/{MODEL}", json=good, headers=ADMIN).json() == {
        "model": MODEL,
        "input_per_mtok": 3.0,
        "cached_input_per_mtok": 3.0,
        "output_per_mtok": 15.0,
        "source": "admin",
    }
    tenant, key = new_tenant(http)
    answer = http.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth(key)).json()
    expected = usage_cost(answer["usage"], ModelPrice(3_000_000, 3_000_000, 15_000_000))
    assert usage_of(http, tenant)["cost_picodollars"] == expected
    back = http.delete(f"/admin/prices/{MODEL}", headers=ADMIN).json()
    assert back == {"model": MODEL, **SETTINGS_PRICE, "source": "settings"}
    assert price_now(http) == ModelPrice(150_000, 75_000, 600_000)


def test_cost_of_each_request_in_usage_log_and_metric(http: httpx.Client, worker: FakeWorker) -> None:
    tenant, key = new_tenant(http)
    price = price_now(http)
    worker.cached_tokens = 2  # cached tokens at their own price
    with capture_logs() as logs:
        plain = http.post("/v1/chat/completions", json=chat(max_tokens=3), headers=auth(key)).json()
        body = chat(max_tokens=4, stream=True, stream_options={"include_usage": True})
        with http.stream("POST", "/v1/chat/completions", json=body, headers=auth(key)) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
        streamed = httpx.Response(200, content=lines[-1][6:]).json()
        usage = usage_of(http, tenant)  # waits for this replica's settles
        own = http.get("/v1/usage", headers=auth(key)).json()
    costs = [usage_cost(plain["usage"], price), usage_cost(streamed["usage"], price)]
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    assert costs[0] == request_cost(price, plain["usage"]["prompt_tokens"], 2, 3) > 0
    assert usage["cost_picodollars"] == own["cost_picodollars"] == sum(costs)
    assert usage["cost_usd"] == pico_to_usd(sum(costs))
    lines_logged = [e for e in logs if e["event"] == "request" and e["tenant"] == tenant]
    assert sorted(e["cost_usd"] for e in lines_logged) == sorted(pico_to_usd(c) for c in costs)
    metrics = http.get("/metrics").text
    samples = [
        s
        for family in text_string_to_metric_families(metrics)
        if family.name == "radixgate_cost_usd"
        for s in family.samples
        if s.name == "radixgate_cost_usd_total" and s.labels["tenant"] == tenant
    ]
    assert len(samples) == 1 and samples[0].labels["model"] == MODEL
    assert samples[0].value == pytest.approx(pico_to_usd(sum(costs)), rel=1e-9)


def test_usage_export_by_day_model_key_as_json_and_csv(http: httpx.Client, worker: FakeWorker) -> None:
    tenant, key = new_tenant(http)
    other = http.post(f"/admin/tenants/{tenant}/keys", json={"name": "b"}, headers=ADMIN).json()
    price = price_now(http)
    costs: dict[str, int] = {}
    for api_key, model, n in ((key, MODEL, 2), (other["api_key"], "test-model-b", 3)):
        for _ in range(n):
            answer = http.post(
                "/v1/chat/completions", json=chat(model=model, max_tokens=2), headers=auth(api_key)
            )
            costs[api_key] = costs.get(api_key, 0) + usage_cost(answer.json()["usage"], price)
    today = utc_day(time.time()).isoformat()
    url = f"/admin/tenants/{tenant}/usage"
    by_key = http.get(url, params={"from": today, "to": today, "group_by": "key"}, headers=ADMIN).json()
    assert by_key["object"] == "usage_export" and by_key["group_by"] == ["key"]
    key_ids = {key: http.get(f"/admin/tenants/{tenant}/keys", headers=ADMIN).json()["data"][0]["key_id"]}
    first = next(row for row in by_key["data"] if row["key_id"] == key_ids[key])
    assert (first["requests"], first["cost_picodollars"]) == (2, costs[key])
    assert (
        by_key["total"]["cost_picodollars"]
        == sum(costs.values())
        == usage_of(http, tenant)["cost_picodollars"]
    )
    by_model = http.get(url, params={"group_by": "model"}, headers=ADMIN).json()  # this month so far
    assert [(row["model"], row["requests"]) for row in by_model["data"]] == [(MODEL, 5)]  # the alias folds
    by_day = http.get(url, params={"group_by": "day,model"}, headers=ADMIN).json()
    assert [(row["day"], row["model"], row["requests"]) for row in by_day["data"]] == [(today, MODEL, 5)]
    for extra in ({"format": "csv"}, {}):
        headers = {**ADMIN, "Accept": "text/csv"} if not extra else ADMIN
        got = http.get(url, params={"group_by": "key", "from": today, **extra}, headers=headers)
        assert got.headers["content-type"].startswith("text/csv")
        table = list(csv.DictReader(io.StringIO(got.text)))
        assert list(table[0]) == [
            "key_id",
            "requests",
            "prompt_tokens",
            "cached_tokens",
            "completion_tokens",
            "cost_usd",
        ]
        assert sorted(row["cost_usd"] for row in table) == sorted(usd_text(c) for c in costs.values())
    old = (utc_day(time.time()) - timedelta(days=40)).isoformat()
    later = (utc_day(time.time()) + timedelta(days=5)).isoformat()
    for params, param in (
        ({"from": today, "to": old}, "from"),  # from after to
        ({"from": old}, "from"),  # past the 30 days kept
        ({"to": later}, "to"),
        ({"from": "2026-02-30"}, "from"),
        ({"from": "yesterday"}, "from"),
        ({"group_by": "week"}, "group_by"),
        ({"group_by": "day,day"}, "group_by"),
        ({"start": today}, "start"),  # an unknown parameter is an error, not ignored
    ):
        err = assert_openai_error(http.get(url, params=params, headers=ADMIN), 400, "invalid_value")
        assert err["param"] == param, (params, err)
    assert_openai_error(http.get(url, params={"format": "xml"}, headers=ADMIN), 400)
    assert_openai_error(
        http.get("/admin/tenants/nobody/usage", params={"group_by": "day"}, headers=ADMIN), 404
    )


def budget_error(resp: httpx.Response) -> dict[str, Any]:
    """A budget's refusal: OpenAI's 429 insufficient_quota (its four fields), and the budget that refused."""
    assert resp.status_code == 429, resp.text
    err: dict[str, Any] = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "budget"}
    assert err["code"] == err["type"] == "insufficient_quota"
    assert set(err["budget"]) == {"scope", "id", "period"}
    return err


def budget_status(http: httpx.Client, path: str) -> dict[str, Any]:
    got = http.get(path, headers=ADMIN)
    assert got.status_code == 200, got.text
    data: dict[str, Any] = got.json()
    return data


def test_budgets_refuse_with_insufficient_quota_charge_nothing_and_warn_once(
    http: httpx.Client, worker: FakeWorker
) -> None:
    tenant, key = new_tenant(http)
    price = price_now(http)
    probe = http.post("/v1/chat/completions", json=chat(max_tokens=4), headers=auth(key)).json()["usage"]
    worst = worst_case_cost(price, probe["prompt_tokens"], 4)
    assert usage_cost(probe, price) == worst  # no cache hit, 4 tokens: each request costs its worst case
    path = f"/admin/tenants/{tenant}/budget"
    assert budget_status(http, path) == {"tenant_id": tenant, "key_id": None, "budget": None, "spend": None}
    for bad in (
        {"period": "week", "hard_limit_usd": 1},
        {"period": "day"},
        {"period": "day", "hard_limit_usd": 1e9},
    ):
        assert_openai_error(http.put(path, json=bad, headers=ADMIN), 400)
    assert_openai_error(
        http.put("/admin/tenants/nobody/budget", json={"period": "day", "hard_limit_usd": 1}, headers=ADMIN),
        404,
    )
    usd = lambda picos: math.ceil(picos / 10**6) / 10**6  # noqa: E731  (whole micro-dollars, rounded up)
    body = {"period": "day", "soft_limit_usd": usd(worst * 1.5), "hard_limit_usd": usd(worst * 2.5)}
    assert http.put(path, json=body, headers=ADMIN).json()["budget"] == body
    with capture_logs() as logs:
        statuses = [
            http.post("/v1/chat/completions", json=chat(max_tokens=4), headers=auth(key)) for _ in range(3)
        ]
        assert [s.status_code for s in statuses] == [200, 200, 429]
        refused = statuses[2]
        err = budget_error(refused)
        assert err["budget"] == {"scope": "tenant", "id": tenant, "period": utc_day(time.time()).isoformat()}
        assert "daily budget" in err["message"]
        assert refused.headers["x-should-retry"] == "false"
        day_end = period_window("day", time.time()).end_s  # retrying helps only in the next period
        assert 0 < int(refused.headers["retry-after"]) <= day_end - time.time() + 2
        status = budget_status(http, path)
    assert status["spend"]["spent_picodollars"] == 2 * worst
    assert status["spend"]["in_flight_usd"] == 0 and status["spend"]["soft_limit_reached"]
    usage = usage_of(http, tenant)
    assert (usage["requests"], usage["quota_rejections"]) == (3, 1)  # the refused one charged nothing
    assert usage["cost_picodollars"] == 3 * worst
    soft = [e for e in logs if e["event"] == "budget_soft_limit_reached" and e["tenant"] == tenant]
    assert len(soft) == 1 and soft[0]["scope"] == "tenant"
    # raised: more passes, and the soft limit, crossed already this period, is not told again
    body["hard_limit_usd"] = usd(worst * 10)
    http.put(path, json=body, headers=ADMIN)
    with capture_logs() as logs:
        assert (
            http.post("/v1/chat/completions", json=chat(max_tokens=4), headers=auth(key)).status_code == 200
        )
        budget_status(http, path)
    assert not [e for e in logs if e["event"] == "budget_soft_limit_reached"]
    # a key's own budget binds the key: its refusal names it; the tenant's other key passes
    other = http.post(f"/admin/tenants/{tenant}/keys", json={"name": "b"}, headers=ADMIN).json()
    key_path = f"/admin/tenants/{tenant}/keys/{other['key_id']}/budget"
    assert (
        http.put(
            key_path, json={"period": "month", "hard_limit_usd": usd(worst / 2)}, headers=ADMIN
        ).status_code
        == 200
    )
    err = budget_error(
        http.post("/v1/chat/completions", json=chat(max_tokens=4), headers=auth(other["api_key"]))
    )
    assert err["budget"]["scope"] == "key" and f"rg-{other['key_id']}" in err["message"]
    assert http.post("/v1/chat/completions", json=chat(max_tokens=4), headers=auth(key)).status_code == 200
    assert budget_status(http, key_path)["budget"]["period"] == "month"
    assert http.delete(key_path, headers=ADMIN).json()["budget"] is None
    assert (
        http.post("/v1/chat/completions", json=chat(max_tokens=4), headers=auth(other["api_key"])).status_code
        == 200
    )
    assert_openai_error(
        http.get(f"/admin/tenants/{tenant}/keys/nokey/budget", headers=ADMIN), 404, "key_not_found"
    )
    assert http.delete(path, headers=ADMIN).json()["budget"] is None


def test_concurrent_requests_never_spend_past_the_hard_limit(http: httpx.Client, worker: FakeWorker) -> None:
    tenant, key = new_tenant(http)
    price = price_now(http)
    probe = http.post("/v1/chat/completions", json=chat(max_tokens=4), headers=auth(key)).json()["usage"]
    worst = worst_case_cost(price, probe["prompt_tokens"], 8)  # they ask for 8 tokens...
    worker.finish = "stop"
    hard = math.ceil(worst * 3.5 / 10**6) * 10**6  # room for 3 worst cases in flight at once
    path = f"/admin/tenants/{tenant}/budget"
    assert http.put(path, json={"period": "month", "hard_limit_usd": hard / 10**12}, headers=ADMIN).is_success
    worker.delay_s = 0.3  # each holds its reservation while its words come
    try:
        with ThreadPoolExecutor(10) as pool:
            answers = list(
                pool.map(
                    lambda _: http.post("/v1/chat/completions", json=chat(max_tokens=8), headers=auth(key)),
                    range(10),
                )
            )
    finally:
        worker.delay_s, worker.finish = 0.0, "length"
    served = [a for a in answers if a.status_code == 200]
    assert {a.status_code for a in answers} <= {200, 429}
    assert 1 <= len(served) <= 3  # never more in flight than the hard limit holds
    real = sum(usage_cost(a.json()["usage"], price) for a in served)
    spend = budget_status(http, path)["spend"]
    # ...and settle at what they cost: the reservations came down to it, nothing is left in flight
    assert spend["spent_picodollars"] == real <= hard
    assert spend["in_flight_usd"] == 0
