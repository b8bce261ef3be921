"""Schema-driven fuzzing of the gateway's own OpenAPI document (schemathesis, Hypothesis underneath).

Every route the document describes, tenant and admin alike, gets generated paths, queries and bodies (valid
per the schema, and some not): the answer is never a 5xx. The OpenAI routes' bodies are in the document
(:mod:`service.api.openapi_bodies`); their ``model`` is pinned to the served models so the fuzzing reaches
past the model check into validation, preparation and the worker. The admin worker routes are left out:
registering random URLs as workers would make later answers a legitimate 502/503 (tested on their own in
``tests/service/api/test_admin_workers.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from service.app import create_app
from tests.conftest import ADMIN_TOKEN, MODEL, gateway_settings
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

BODIES = ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest")


@pytest.fixture(scope="module")
def served(redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]) -> Iterator[tuple[str, str]]:
    """(gateway URL, a tenant's API key); the tenant's quotas are large, so fuzzing is not rate limited."""
    settings_ = gateway_settings(redis_url, stub_model_dir, [fake[1]])
    with ThreadedServer(create_app(settings_)) as server, httpx.Client(base_url=server.url) as http:
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        tenant = {"id": "fuzz", "name": "fuzz", "quotas": {"requests_per_min": 1e9, "tokens_per_min": 1e12}}
        assert http.post("/admin/tenants", json=tenant, headers=admin).status_code == 201
        key = http.post("/admin/tenants/fuzz/keys", json={}, headers=admin).json()["api_key"]
        yield server.url, key


@pytest.fixture(scope="module")
def api_schema(served: tuple[str, str]) -> Any:
    """The gateway's own ``/openapi.json``, served models pinned in the OpenAI bodies."""
    document = httpx.get(f"{served[0]}/openapi.json").json()
    components = document["components"]["schemas"]
    for name in BODIES:
        components[name]["properties"]["model"] = {"type": "string", "enum": [MODEL, "test-model-b"]}
    return schemathesis.openapi.from_dict(document).exclude(path_regex="^/admin/workers")


def test_the_openai_bodies_are_in_the_document(served: tuple[str, str]) -> None:
    document = httpx.get(f"{served[0]}/openapi.json").json()
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    schemas = document["components"]["schemas"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    assert "prompt" in schemas["CompletionRequest"]["properties"]
    assert "input" in schemas["ResponsesRequest"]["properties"]
    for name in BODIES:
        assert schemas[name]["additionalProperties"] is False


def fuzz(operation: Any, url: str, token: str, examples: int) -> int:
    """Run ``examples`` generated cases of ``operation`` (derandomized: the same every run) against ``url``;
    fail on any 5xx. Returns the number of cases sent (Hypothesis stops early when an operation has fewer
    distinct inputs)."""
    sent = 0

    @given(case=operation.as_strategy())
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def call(case: schemathesis.Case) -> None:
        nonlocal sent
        sent += 1
        case.call_and_validate(
            base_url=url,
            headers={"Authorization": f"Bearer {token}"},
            checks=[not_a_server_error],
            timeout=30,
        )

    call()
    return sent


def test_no_generated_request_gets_a_server_error(api_schema: Any, served: tuple[str, str]) -> None:
    # schemathesis's pytest plugin reads a pytest-internal attribute that pytest 9 no longer has: each
    # operation's Hypothesis strategy is driven here instead
    url, key = served
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 15
    for operation in operations:
        tenant_facing = operation.path.startswith("/v1/")
        fuzz(operation, url, key if tenant_facing else ADMIN_TOKEN, 150 if tenant_facing else 40)


@pytest.mark.deep_fuzz
def test_deep_no_generated_request_gets_a_server_error(api_schema: Any, served: tuple[str, str]) -> None:
    """The same at depth (``pytest -m deep_fuzz``, not in CI): 1,000 cases per operation; prints the cases
    each operation was sent (a 5xx fails the run at once, so the count of 5xx answers is 0 when it passes)."""
    url, key = served
    counts: dict[str, int] = {}
    for result in api_schema.get_all_operations():
        operation = result.ok()
        tenant_facing = operation.path.startswith("/v1/")
        counts[f"{operation.method.upper()} {operation.path}"] = fuzz(
            operation, url, key if tenant_facing else ADMIN_TOKEN, 1000
        )
    for name, sent in sorted(counts.items()):
        print(f"{sent:6d}  {name}")
    print(f"{sum(counts.values())} cases over {len(counts)} operations, 0 answered 5xx")
    assert min(counts.values()) >= 1
