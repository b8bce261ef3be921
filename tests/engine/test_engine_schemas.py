"""Issue 25 item 2 against the real SGLang CPU worker (xgrammar 0.2.7): recursive schemas.

- Recursion with no way out (the issue's allOf/anyOf cycle: the engine aborted it with 500 "Grammar
  accept_token failed", a 502 for the tenant or, streamed, a 200 ending in an error event with a token
  charged; ``{"properties": {"x": {"$ref": "#"}}, "required": ["x"]}``: the model wrote ``{"x": {"x": ...``
  until ``max_tokens``) is a 400 naming the field and the pointer, streamed or not, for
  ``response_format`` and tool parameters, with nothing charged.
- The engine's own failure on such a grammar, reached without the gateway's check, is read as the
  input's 400 before anything is yielded (the client's side of the mapping).
- A recursive schema with a way out (a tree) is served and its answer follows the schema.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
import redis

from service.app import create_app
from service.config.settings import Settings
from service.workers.client import SGLangClient
from service.workers.launcher import WorkerProcess
from service.workers.upstream_errors import UpstreamError
from tenancy.layout import KeyLayout
from tests.conftest import ADMIN_TOKEN
from tests.support.schema_table import ROWS
from tests.support.servers import ThreadedServer

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"
PREFIX = "schemas:"
BURST = 1_000_000
ASK = [{"role": "user", "content": "Give me a small JSON value."}]
_ids = itertools.count()
ISSUE = next(r[1] for r in ROWS if r[0] == "issue: allOf/anyOf mutual cycle")


@pytest.fixture(scope="module")
def gateway(redis_url: str, engine_worker: WorkerProcess) -> Iterator[str]:
    settings = Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": PREFIX},
            "upstream": {"workers": [engine_worker.url]},
        }
    )
    with ThreadedServer(create_app(settings)) as server:
        yield server.url


@pytest.fixture
def http(gateway: str) -> Iterator[tuple[httpx.Client, str]]:
    """A client with a fresh tenant's key, and the tenant's id."""
    tenant_id = f"sch{next(_ids)}"
    spec = {"id": tenant_id, "name": tenant_id, "quotas": {"tokens_per_min": 1, "token_burst": BURST}}
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as admin:
        assert admin.post("/admin/tenants", json=spec).status_code == 201
        key = admin.post(f"/admin/tenants/{tenant_id}/keys", json={}).json()["api_key"]
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {key}"}, timeout=300) as client:
        yield client, tenant_id


def charged(http: httpx.Client, redis_url: str, tenant_id: str) -> tuple[float, dict[str, Any]]:
    """Tokens taken from the tenant's bucket (its burst less its level) and its usage counters, once the
    settles of its answers are done (a streamed answer settles after its last chunk)."""
    time.sleep(0.3)
    level = float(
        redis.Redis.from_url(redis_url).hget(KeyLayout(PREFIX).bucket(tenant_id, "tokens"), "level") or BURST
    )
    usage = http.get(f"/admin/tenants/{tenant_id}/usage", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    return BURST - level, usage.json()


def post(http: httpx.Client, req: dict[str, Any], stream: bool) -> httpx.Response:
    """The answer to ``req``, read whole (a stream's events as its body)."""
    with http.stream("POST", "/v1/chat/completions", json={**req, "stream": stream}) as resp:
        resp.read()
    return resp


NO_WAY_OUT = [
    r for r in ROWS if r[0] in {
        "issue: allOf/anyOf mutual cycle",
        "issue: required self through #",
        "two objects requiring each other",
        "array of itself, minItems 1",
        "optional property with no instance",
    }
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("where", ["response_format", "tools"])
@pytest.mark.parametrize("row", NO_WAY_OUT, ids=[r[0] for r in NO_WAY_OUT])
def test_a_recursive_schema_with_no_way_out_is_a_400_naming_its_pointer_and_costs_nothing(
    http: tuple[httpx.Client, str], redis_url: str, row: Any, where: str, stream: bool
) -> None:
    client, tenant_id = http
    name, schema, _, _, says = row
    req: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0}
    if where == "response_format":
        req["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "t", "strict": True, "schema": schema},
        }
        param = "response_format.json_schema.schema"
    else:
        req["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        req["tool_choice"] = {"type": "function", "function": {"name": "f"}}
        param = "tools.0.function.parameters"
    resp = post(client, req, stream)
    assert resp.status_code == 400, (name, resp.text)
    err = resp.json()["error"]
    assert err["param"] == param and "has no finite instance" in err["message"] and says in err["message"], (
        err
    )
    taken, usage = charged(client, redis_url, tenant_id)
    assert taken == 0 and usage["requests"] == usage["prompt_tokens"] == usage["completion_tokens"] == 0


def test_the_engines_own_failure_on_an_empty_grammar_is_a_rejection_before_any_chunk(
    engine_worker: WorkerProcess,
) -> None:
    """SGLang answers the issue's schema with 500 "Grammar accept_token failed" (whole) or a first empty
    token then that abort (streamed); the client reads both as the input's 400, and yields nothing first."""
    body = {
        "text": "<|im_start|>user\nJSON please<|im_end|>\n<|im_start|>assistant\n",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "json_schema": json.dumps(ISSUE)},
    }

    async def run() -> tuple[UpstreamError, UpstreamError, list[Any]]:
        async with SGLangClient() as api:
            with pytest.raises(UpstreamError) as whole:
                await api.generate(engine_worker.url, {**body, "rid": "schemas-whole"})
            chunks: list[Any] = []
            with pytest.raises(UpstreamError) as streamed:
                async for chunk in api.stream(engine_worker.url, {**body, "rid": "schemas-stream"}):
                    chunks.append(chunk)
            return whole.value, streamed.value, chunks

    whole, streamed, chunks = asyncio.run(run())
    for error in (whole, streamed):
        assert error.rejected and error.status == 400 and not error.retryable, (error.status, str(error))
        assert str(error).startswith("Grammar accept_token failed")
    assert chunks == []  # the opening empty token was held: no 200 goes out on it


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_keyword_sglang_refuses_is_a_400_and_costs_nothing(
    http: tuple[httpx.Client, str], redis_url: str, stream: bool
) -> None:
    """``not`` compiles in xgrammar but SGLang 0.5.23 refuses it (it would be ignored): the worker's 400,
    streamed (an abort in the first chunk, with a token counted) or not, is the tenant's 400, charged
    nothing."""
    client, tenant_id = http
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"not": {"type": "string"}}}}
    resp = post(client, {"model": MODEL, "messages": ASK, "max_tokens": 8, "response_format": fmt}, stream)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "upstream_rejected" and err["param"] == "response_format", err
    taken, usage = charged(client, redis_url, tenant_id)
    assert taken == 0 and usage["prompt_tokens"] == usage["completion_tokens"] == 0


TREE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
    },
    "required": ["name"],
    "additionalProperties": False,
}


def test_a_recursive_schema_with_a_way_out_is_served_and_followed(
    http: tuple[httpx.Client, str], redis_url: str
) -> None:
    client, tenant_id = http
    fmt = {"type": "json_schema", "json_schema": {"name": "tree", "strict": True, "schema": TREE}}
    req = {"model": MODEL, "messages": ASK, "max_tokens": 48, "temperature": 0, "response_format": fmt}
    resp = post(client, req, False)
    assert resp.status_code == 200, resp.text
    answer = resp.json()["choices"][0]
    if answer["finish_reason"] == "stop":  # whole: it follows the schema (its recursion included)
        jsonschema.validate(json.loads(answer["message"]["content"]), TREE)
    else:
        assert answer["finish_reason"] == "length"
    taken, usage = charged(client, redis_url, tenant_id)
    assert (
        taken == resp.json()["usage"]["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    )
