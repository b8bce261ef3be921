"""Issue 25 item 2: a schema the gateway admits is one xgrammar 0.2.7 compiles into a grammar whose every
part has a finite instance (:mod:`service.protocol.schema_grammar`), for ``response_format``, the Responses
API's ``text.format`` and tool parameters; refused with a 400 naming the field and the JSON pointer, with
nothing sent to a worker and nothing charged.

The table (``tests/support/schema_table.py``) is checked against xgrammar itself in
``test_schema_grammar_xgrammar.py``; the real engine's answers are in ``test_engine_schemas.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service.protocol.features import check_schema
from service.protocol.schema_grammar import grammar_problem
from tests.service.api.test_api import MODEL, assert_openai_error, auth, chat, new_tenant, usage_of
from tests.support.fake_worker import FakeWorker
from tests.support.schema_table import ROWS


@pytest.mark.parametrize(("name", "schema", "verdict", "says"), [(r[0], r[1], r[2], r[4]) for r in ROWS])
def test_the_gateway_admits_exactly_the_schemas_xgrammar_compiles_with_finite_instances(
    name: str, schema: Any, verdict: str, says: str | None
) -> None:
    problem = check_schema(schema)
    if verdict == "ok":
        assert problem is None, (name, problem)
    else:
        assert problem is not None, name
        assert says is None or says in problem, (name, problem)


def test_the_message_names_the_cycle_with_its_pointers() -> None:
    problem = grammar_problem({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]})
    assert problem == (
        "'#' has no finite instance: # -> #/properties/x -> # is a cycle that every instance must go round "
        "again (recursion with no way out: make a property optional, give anyOf a branch that does not "
        "recur, or let the array be empty)"
    )
    problem = grammar_problem(
        {
            "$ref": "#/$defs/a",
            "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
        }
    )
    assert problem is not None and problem.startswith(
        "'#' has no finite instance: #/$defs/a -> #/$defs/a/allOf/0 -> #/$defs/b -> #/$defs/b/anyOf/0 -> "
        "#/$defs/a is a cycle"
    )


def test_a_long_cycle_is_found_in_linear_time_and_its_message_stays_short() -> None:
    n = 4000
    defs = {
        f"d{i}": {
            "type": "object",
            "properties": {"next": {"$ref": f"#/$defs/d{(i + 1) % n}"}},
            "required": ["next"],
        }
        for i in range(n)
    }
    started = time.perf_counter()
    problem = grammar_problem({"$ref": "#/$defs/d0", "$defs": defs})
    assert time.perf_counter() - started < 1.0
    assert problem is not None and "…" in problem and len(problem) < 1200
    chain = {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n - 1}": {"type": "string"}}}  # the last one ends it
    assert grammar_problem(chain) is None


@pytest.fixture
def worker(fake: tuple[FakeWorker, str]) -> Iterator[FakeWorker]:
    fake[0].received.clear()
    yield fake[0]


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


ENDLESS = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
ISSUE = {
    "$ref": "#/$defs/a",
    "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
}


def _tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


NAMED_F = {"type": "function", "function": {"name": "f"}}
CASES: list[tuple[str, dict[str, Any], str]] = [
    (
        "/v1/chat/completions",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "t", "strict": True, "schema": ISSUE},
            }
        ),
        "response_format.json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": ENDLESS}}),
        "response_format.json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        chat(tools=[_tool(ENDLESS)], tool_choice=NAMED_F),
        "tools.0.function.parameters",
    ),
    (
        "/v1/chat/completions",
        chat(
            tools=[
                {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
                _tool(ISSUE),
            ]
        ),
        "tools.1.function.parameters",
    ),
    (
        "/v1/responses",
        {
            "model": MODEL,
            "input": "hi",
            "text": {"format": {"type": "json_schema", "name": "t", "schema": ENDLESS}},
        },
        "text.format.schema",
    ),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "req", "param"), CASES)
def test_a_recursive_schema_with_no_way_out_is_a_400_naming_field_and_pointer_before_any_worker(
    http: httpx.Client, worker: FakeWorker, path: str, req: dict[str, Any], param: str, stream: bool
) -> None:
    tenant_id, key = new_tenant(http)
    resp = http.post(path, json={**req, "stream": stream}, headers=auth(key))
    err = assert_openai_error(resp, 400)
    assert err["param"] == param
    assert "has no finite instance" in err["message"] and "'#'" in err["message"], err
    assert worker.received == []
    usage = usage_of(http, tenant_id)
    assert usage["requests"] == usage["prompt_tokens"] == usage["completion_tokens"] == 0


def test_a_tree_schema_with_a_way_out_reaches_the_worker(http: httpx.Client, worker: FakeWorker) -> None:
    tree = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["name", "children"],
    }
    _, key = new_tenant(http)
    fmt = {"type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}
    assert (
        http.post(
            "/v1/chat/completions", json=chat(max_tokens=3, response_format=fmt), headers=auth(key)
        ).status_code
        == 200
    )
    assert len(worker.received) == 1
