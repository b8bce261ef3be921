"""Issue 11 against the real SGLang CPU worker (SmolLM2-135M-Instruct), with the official ``openai`` client.

One worker for the session (``engine_worker``), one gateway for this module. Each test also checks that
the tenant's token bucket was settled to exactly what the worker reported (:func:`assert_settled`): the
tenant's token burst is large and its refill negligible (1 token/min), so the bucket's level is the burst
minus the tokens charged.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
import redis
from pydantic import BaseModel

from service.app import create_app
from service.config.settings import Settings
from service.openai.tool_formats import FORMATS, FunctionSpec
from service.openai.tool_parser import CallParser
from service.pipeline.prompting import PromptRenderer
from service.workers.launcher import WorkerProcess
from tenancy.layout import KeyLayout
from tests.conftest import ADMIN_TOKEN
from tests.support.engine import engine_home
from tests.support.servers import ThreadedServer

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"
PREFIX = "oai:"
BURST = 1_000_000
_ids = itertools.count()

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def gateway(redis_url: str, engine_worker: WorkerProcess) -> Iterator[str]:
    settings = Settings.model_validate(
        {
            "home": engine_home(),  # RADIXGATE_HOME: the engine and model under it
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": PREFIX},
            "upstream": {"workers": [engine_worker.url]},
        }
    )
    with ThreadedServer(create_app(settings)) as server:
        yield server.url


@pytest.fixture
def tenant(gateway: str) -> tuple[str, str]:
    tenant_id = f"oai{next(_ids)}"
    spec = {"id": tenant_id, "name": tenant_id, "quotas": {"tokens_per_min": 1, "token_burst": BURST}}
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        assert http.post("/admin/tenants", json=spec).status_code == 201
        key = http.post(f"/admin/tenants/{tenant_id}/keys", json={}).json()["api_key"]
    return tenant_id, key


def client(gateway: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=300)


def assert_settled(redis_url: str, gateway: str, tenant_id: str, totals: list[int]) -> None:
    """The tenant was charged exactly the worker-reported tokens of its answers (``totals``), and its usage
    counters hold them.

    A streamed answer settles after its last chunk was sent (the client may return first), so this waits up
    to 10 s for the level to come into range; a wrong charge still fails, at the deadline."""
    store, deadline = redis.Redis.from_url(redis_url), time.monotonic() + 10.0
    while True:
        level = float(store.hget(KeyLayout(PREFIX).bucket(tenant_id, "tokens"), "level") or 0)
        if 0 <= level - (BURST - sum(totals)) < 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert 0 <= level - (BURST - sum(totals)) < 2, (level, totals)  # < 2: refill at 1 token/min
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as http:
        usage = http.get(f"/admin/tenants/{tenant_id}/usage").json()
    assert usage["prompt_tokens"] + usage["completion_tokens"] == sum(totals)


def accumulate_tool_calls(stream: Any) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """content, [(id, name, arguments)], finish_reason of a streamed chat answer (as clients join it)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, ["", "", ""])
                call[0] = part.id or call[0]
                call[1] += (part.function and part.function.name) or ""
                call[2] += (part.function and part.function.arguments) or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish  # type: ignore[misc]


# -- tool calling -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
def test_a_forced_tool_call_validates_against_its_schema_streamed_or_not(
    gateway: str, redis_url: str, tenant: tuple[str, str], choice: Any
) -> None:
    api = client(gateway, tenant[1])
    request = dict(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False,
        max_tokens=60, temperature=0,
    )  # fmt: skip
    whole = api.chat.completions.create(**request)  # type: ignore[call-overload]
    (answer,) = whole.choices
    finish = "tool_calls" if choice == "required" else "stop"  # OpenAI: "stop" for a named function
    assert answer.finish_reason == finish
    (call,) = answer.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    schemas = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME["function"]["parameters"]}  # type: ignore[index]
    if choice != "required":
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    content, calls, streamed_finish = accumulate_tool_calls(
        api.chat.completions.create(stream=True, **request)
    )
    assert (content, streamed_finish) == (answer.message.content or "", finish)
    assert [(name, arguments) for _, name, arguments in calls] == [
        (call.function.name, call.function.arguments)
    ]
    assert whole.usage is not None
    assert_settled(redis_url, gateway, tenant[0], [whole.usage.total_tokens] * 2)


def test_a_tool_round_trip_renders_calls_and_results_through_the_template(
    gateway: str, redis_url: str, tenant: tuple[str, str], engine_worker: WorkerProcess
) -> None:
    api = client(gateway, tenant[1])
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = api.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice=named,
        max_tokens=60,
        temperature=0,  # type: ignore[arg-type]
    )
    (call,) = first.choices[0].message.tool_calls or []
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21, "sky": "sunny"})},
    ]
    final = api.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=40,
        temperature=0,  # type: ignore[arg-type]
    )
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    assert final.usage is not None and first.usage is not None
    # The worker saw the history written through SmolLM2's template: the call in the hermes format (the
    # template has no tool_calls of its own), the result as a tool message.
    expected = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        f'{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call><|im_end|>\n'
        '<|im_start|>tool\n<tool_response>\n{"celsius": 21, "sky": "sunny"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    assert final.usage.prompt_tokens == PromptRenderer(engine_worker.engine.model_path).count(expected)
    assert_settled(redis_url, gateway, tenant[0], [first.usage.total_tokens, final.usage.total_tokens])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_family_format_forced_by_the_grammar_reads_back_as_a_call(
    engine_worker: WorkerProcess, fmt: str
) -> None:
    """The structural tag of each family makes even SmolLM2 write that family's syntax, and the family's
    parser reads the call back with schema-valid arguments."""
    spec = FunctionSpec("get_weather", "Current weather in a city", WEATHER_PARAMETERS)
    tag = FORMATS[fmt].forced_constraint([spec], parallel=False)
    prompt = "<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 60, "temperature": 0, "structural_tag": json.dumps(tag)},
    }
    text = httpx.post(f"{engine_worker.url}/generate", json=body, timeout=300).json()["text"]
    parser = CallParser(FORMATS[fmt], frozenset({"get_weather"}))
    step, rest = parser.feed(text), parser.finish()
    assert (step.text + rest.text).strip() == "", text
    (call,) = step.calls + rest.calls
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)


# -- structured outputs, logprobs, n, Responses API ------------------------------------------------------
class Forecast(BaseModel):
    """The ``parse()`` target: enum, integer and boolean fields keep the small model's answer short."""

    city: Literal["Paris", "London", "Berlin"]
    celsius: int
    sunny: bool


def test_parse_with_a_pydantic_model_returns_the_object(
    gateway: str, redis_url: str, tenant: tuple[str, str]
) -> None:
    api = client(gateway, tenant[1])
    messages = [{"role": "user", "content": "The weather in Paris: 21 degrees and sunny. Give it as JSON."}]
    done = api.chat.completions.parse(
        model=MODEL,
        messages=messages,
        response_format=Forecast,
        max_tokens=60,
        temperature=0,  # type: ignore[arg-type]
    )
    answer = done.choices[0]
    assert answer.finish_reason == "stop"
    assert isinstance(answer.message.parsed, Forecast)
    assert answer.message.parsed == Forecast.model_validate_json(answer.message.content or "")
    assert done.usage is not None
    assert_settled(redis_url, gateway, tenant[0], [done.usage.total_tokens])


def test_top_logprobs_give_alternatives_per_token_and_the_tokens_join_to_the_text(
    gateway: str, redis_url: str, tenant: tuple[str, str]
) -> None:
    api = client(gateway, tenant[1])
    request = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    whole = api.chat.completions.create(**request)  # type: ignore[call-overload]
    (answer,) = whole.choices
    tokens = answer.logprobs.content
    assert len(tokens) >= 5 and "".join(t.token for t in tokens) == answer.message.content
    for token in tokens:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-4)  # greedy: the best
        assert bytes(token.bytes or []).decode("utf-8", errors="replace") or token.token == ""
    streamed: list[Any] = []
    content = ""
    for chunk in api.chat.completions.create(stream=True, **request):  # type: ignore[call-overload]
        for choice in chunk.choices:
            content += choice.delta.content or ""
            streamed += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    assert content == answer.message.content
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in tokens]
    text = api.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    legacy = text.choices[0].logprobs
    assert legacy is not None and "".join(legacy.tokens or []) == text.choices[0].text
    assert all(len(top) >= 2 for top in legacy.top_logprobs or [])
    assert whole.usage is not None and text.usage is not None
    assert_settled(redis_url, gateway, tenant[0], [whole.usage.total_tokens * 2, text.usage.total_tokens])


def test_n_choices_are_all_answered_and_charged(
    gateway: str, redis_url: str, tenant: tuple[str, str]
) -> None:
    api = client(gateway, tenant[1])
    done = api.chat.completions.create(
        model=MODEL, messages=ASK, n=3, max_tokens=8, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.content for c in done.choices)
    assert done.usage is not None and done.usage.completion_tokens == 3 * 8
    single = api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert single.usage is not None and done.usage.prompt_tokens == single.usage.prompt_tokens  # once
    assert_settled(redis_url, gateway, tenant[0], [done.usage.total_tokens, single.usage.total_tokens])


def test_responses_create_streamed_and_not(gateway: str, redis_url: str, tenant: tuple[str, str]) -> None:
    api = client(gateway, tenant[1])
    request = dict(model=MODEL, instructions="Answer briefly.", input="Name a colour.", max_output_tokens=12)
    whole = api.responses.create(**request, temperature=0)  # type: ignore[call-overload]
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert (
        whole.usage is not None
        and whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    )
    kinds, deltas, final = [], [], None
    for event in api.responses.create(**request, temperature=0, stream=True):  # type: ignore[call-overload]
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete") and final is not None
    assert "".join(deltas) == final.output_text == whole.output_text  # greedy: the same answer
    assert final.usage is not None and final.usage.total_tokens == whole.usage.total_tokens
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER_PARAMETERS,
    }
    called = api.responses.create(
        model=MODEL,
        input="What's the weather in Paris?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )  # type: ignore[arg-type, list-item]
    (call,) = [item for item in called.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    assert called.usage is not None
    assert_settled(redis_url, gateway, tenant[0], [whole.usage.total_tokens * 2, called.usage.total_tokens])


# -- a schema the engine's grammar compiler refuses ---------------------------------------------------
def test_a_schema_the_grammar_compiler_refuses_is_a_clean_400_and_costs_nothing(
    gateway: str, redis_url: str, tenant: tuple[str, str], engine_worker: WorkerProcess
) -> None:
    """xgrammar has no lookbehind: SGLang aborts the request with its compiler's words (a C++ source path
    among them). The tenant gets a short 400 naming ``response_format``, without the worker's address or
    the compiler's internals, is charged nothing, and the worker keeps serving."""
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "string", "pattern": "(?<=a)b"}},
    }
    req = {"model": MODEL, "messages": ASK, "max_tokens": 5, "response_format": fmt}
    headers = {"Authorization": f"Bearer {tenant[1]}"}
    with httpx.Client(base_url=gateway, headers=headers, timeout=300) as http:
        for stream in (False, True):
            resp = http.post("/v1/chat/completions", json={**req, "stream": stream})
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == "response_format" and err["code"] == "upstream_rejected", err
            assert "Lookbehind" in err["message"], err  # the reason is kept...
            for leaked in (engine_worker.url, str(engine_worker.port), ".cc", "/project", "cpp"):
                assert leaked not in err["message"], (leaked, err)  # ...the internals are not
        served = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2})
        assert served.status_code == 200, served.text
    usage = served.json()["usage"]
    assert_settled(redis_url, gateway, tenant[0], [usage["total_tokens"]])  # the 400s cost nothing
