"""Requests refused before the pipeline takes them (key, body, model, quota) leave a log line with their
request id and a metric, like the requests the pipeline settles (``request`` lines, ``requests_total``)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from tests.service.api.test_api import ADMIN, auth, chat, new_tenant


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


def rejected_counts(http: httpx.Client) -> dict[tuple[str, str], float]:
    """``radixgate_rejected_requests_total`` on /metrics: (status, code) -> count."""
    return {
        (s.labels["status"], s.labels["code"]): s.value
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for s in family.samples
        if s.name == "radixgate_rejected_requests_total"
    }


def test_refused_requests_are_logged_with_their_id_and_counted(http: httpx.Client) -> None:
    tenant_id, key = new_tenant(http, quotas={"requests_per_min": 1})
    before = rejected_counts(http)
    url = "/v1/chat/completions"
    with capture_logs() as logs:
        refused = [
            http.post(url, json=chat(max_tokens=1), headers=auth("rg-nokey")),
            http.post(url, content=b"{bad", headers=auth(key)),
            http.post(url, json=chat(max_tokens=1, model="no-such-model"), headers=auth(key)),
            http.post("/v1/responses", json={"model": "x", "input": "hi", "bogus": 1}, headers=auth(key)),
            http.get("/admin/tenants", headers=auth(key)),
        ]
        assert http.post(url, json=chat(max_tokens=1), headers=auth(key)).status_code == 200
        refused.append(http.post(url, json=chat(max_tokens=1), headers=auth(key)))
        assert http.get("/admin/tenants", headers=ADMIN).status_code == 200
    assert [r.status_code for r in refused] == [401, 400, 404, 400, 403, 429]
    lines = [line for line in logs if line["event"] == "request_rejected"]
    expected = [(r.headers["x-request-id"], r.status_code, r.json()["error"]["code"]) for r in refused]
    assert [(line["request_id"], line["status"], line["code"]) for line in lines] == expected
    assert lines[-1]["tenant"] == tenant_id and lines[-1]["path"] == url
    assert not any(key in str(line) for line in logs)  # never the key
    after = rejected_counts(http)
    for _, status, code in expected:
        assert after[(str(status), code)] >= before.get((str(status), code), 0) + 1
    assert ("429", "rate_limit_exceeded") in after
