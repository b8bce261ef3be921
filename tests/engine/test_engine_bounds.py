"""Property: whatever numbers a tenant sends, the real SGLang worker behind the gateway survives (issue 8).

Hypothesis draws edge values (int32/int64 limits, ±0, subnormal and huge floats, NaN and infinity as
Python's json writes them, wrong types, long and many stop sequences, long ``user``, many or long
messages) for every numeric and size field of both routes. Each answer must be 200 or a 400 in OpenAI's
shape (naming the parameter when the body was JSON), never 5xx, and the worker must still answer a normal
request afterwards. The tenant's ``max_tokens_cap`` of 3 keeps every generation tiny.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.app import create_app
from service.config.settings import Settings
from service.workers.launcher import WorkerProcess
from tests.conftest import ADMIN_TOKEN
from tests.support.engine import engine_home
from tests.support.servers import ThreadedServer

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"

EDGE_INTS = [
    0, 1, -1, 2, 3, 4, 2**30, 2**30 + 1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1,
    2**32, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**30,
]  # fmt: skip
EDGE_FLOATS = [
    0.0, -0.0, 5e-324, -5e-324, 1e-300, 1e-30, 1e-6, 0.0099, 0.01, 0.5, 1.0, 1.0000001, 2.0,
    2.0000001, -2.0, -2.0000001, 3.4028235e38, 3.5e38, 1e308, -1e308,
]  # fmt: skip
NON_FINITE = [float("nan"), float("inf"), float("-inf")]  # json.dumps writes NaN / Infinity


def numbers() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from(EDGE_INTS),
        st.sampled_from(EDGE_FLOATS),
        st.sampled_from(NON_FINITE),
        st.integers(),
        st.floats(),
        st.sampled_from([None, True, False, "1", [1], {}]),
    )


def stops() -> st.SearchStrategy[Any]:
    piece = st.one_of(st.sampled_from(["", "\n", "zzzz", "x" * 256, "x" * 257]), st.text(max_size=8))
    return st.one_of(piece, st.lists(piece, max_size=6), numbers())


IN_RANGE: dict[str, list[Any]] = {  # edge values inside the bounds: these reach the engine
    "max_tokens": [1, 2, 3, None],
    "max_completion_tokens": [1, 3, None],
    "temperature": [0, 0.0, -0.0, 5e-324, 1e-300, 1e-6, 1.0000001e-6, 0.7, 2, 2.0],
    "top_p": [5e-324, 1e-300, 1e-10, 0.5, 1, 1.0],
    "top_k": [-1, 0, 1, 2, 49151, 49152, 49153, 2**30],
    "min_p": [0, -0.0, 5e-324, 0.5, 1.0],
    "presence_penalty": [-2, -2.0, -5e-324, 0, 5e-324, 2.0],
    "frequency_penalty": [-2.0, 0.0, 2],
    "repetition_penalty": [0.01, 0.0100001, 1, 2.0],
    "seed": [0, -1, 2**31 - 1, 2**31, -(2**63), 2**63 - 1],
    "n": [1, None],
    "stop": ["", "\n", "zzzz", ["", "zzzz"], "x" * 256, [" ", "a", "b", "c"], None],
    "user": ["", "u" * 256, None],
    "logprobs": [None],  # unserved features: only their off values are in range
    "top_logprobs": [None, 0],
    "logit_bias": [None, {}],
}


def field_values(name: str, wild_too: bool) -> st.SearchStrategy[Any]:
    """An edge inside the bounds or, when ``wild_too``, half the time any numeric edge (or a long/odd
    one)."""
    if not wild_too:
        return st.sampled_from(IN_RANGE[name])
    wild: st.SearchStrategy[Any] = numbers()
    if name == "stop":
        wild = stops()
    elif name == "logit_bias":
        wild = st.one_of(
            st.dictionaries(st.sampled_from(["0", "1", "49151", "-1", "99999999999"]), numbers()), numbers()
        )
    elif name == "user":
        wild = st.one_of(st.text(max_size=4), st.just("u" * 257), numbers())
    return st.one_of(st.sampled_from(IN_RANGE[name]), wild)


def some_fields(names: list[str], wild_too: bool) -> st.SearchStrategy[dict[str, Any]]:
    """One to four of ``names``, each with a value from :func:`field_values`."""
    chosen = st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True)
    return chosen.flatmap(
        lambda picked: st.fixed_dictionaries({n: field_values(n, wild_too) for n in picked})
    )


CHAT_ONLY = ["max_completion_tokens", "top_logprobs"]
COMMON = [name for name in IN_RANGE if name not in CHAT_ONLY]


def request_bodies(wild_too: bool) -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """A chat or text completion body with a few drawn fields. With ``wild_too``, also prompts over the
    context and messages lists that are empty."""
    contents = ["Hi", "Hi", "", "word " * 20000] if wild_too else ["Hi", "", "1,000,000"]
    message = st.fixed_dictionaries({"role": st.just("user"), "content": st.sampled_from(contents)})
    messages = st.lists(message, min_size=1, max_size=3)
    if wild_too:
        messages = st.one_of(messages, st.just([]))
    chat = st.tuples(messages, some_fields([*COMMON, *CHAT_ONLY], wild_too)).map(
        lambda mf: {"model": MODEL, "messages": mf[0], **mf[1]}
    )
    prompts = st.sampled_from([c for c in contents if c] or ["Hi"])
    text = st.tuples(prompts, some_fields(COMMON, wild_too)).map(
        lambda pf: {"model": MODEL, "prompt": pf[0], **pf[1]}
    )
    return st.one_of(
        st.tuples(st.just("/v1/chat/completions"), chat), st.tuples(st.just("/v1/completions"), text)
    )


@pytest.fixture(scope="module")
def gateway(redis_url: str, engine_worker: WorkerProcess) -> Iterator[str]:
    settings = Settings.model_validate(
        {
            "home": engine_home(),  # RADIXGATE_HOME: the engine and model under it
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": "bounds-e2e:"},
            "upstream": {"workers": [engine_worker.url]},
        }
    )
    with ThreadedServer(create_app(settings)) as server:
        yield server.url


@pytest.fixture(scope="module")
def http(gateway: str) -> Iterator[httpx.Client]:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=gateway, timeout=120) as client:
        body = {"id": "bounds", "name": "bounds", "max_tokens_cap": 3}
        assert client.post("/admin/tenants", json=body, headers=admin).status_code == 201
        key = client.post("/admin/tenants/bounds/keys", json={}, headers=admin).json()["api_key"]
        client.headers["Authorization"] = f"Bearer {key}"
        yield client


def send(http: httpx.Client, route: str, body: dict[str, Any]) -> httpx.Response:
    raw = json.dumps(body)  # allow_nan: NaN and Infinity go out as Python writes them
    return http.post(route, content=raw, headers={"Content-Type": "application/json"})


def assert_served_or_refused(resp: httpx.Response, raw_is_json: bool) -> None:
    assert resp.status_code in (200, 400), (resp.status_code, resp.text)
    data = resp.json()
    if resp.status_code == 200:
        assert data["choices"] and data["usage"]["completion_tokens"] <= 3
        return
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if raw_is_json:
        assert err["param"], err  # every refusal of a JSON body names the parameter


def assert_worker_serves(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


def test_the_issue_8_reproduction_is_refused_and_the_worker_keeps_serving(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi!"}],
        "max_tokens": 4,
        "temperature": 0.7,
        "top_k": 2147483648,
    }
    resp = http.post("/v1/chat/completions", json={**body, "max_tokens": 3})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_k"
    served = http.post("/v1/chat/completions", json={**body, "max_tokens": 3, "top_k": 2**30})
    assert served.status_code == 200, served.text  # the largest top_k served reaches the engine
    assert_worker_serves(http)


def property_settings(examples: int) -> settings:
    """Reproducible runs of ``examples`` requests, however slow the shared CPU is."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )


def test_edge_values_inside_the_bounds_are_all_served_by_the_engine(http: httpx.Client) -> None:
    @property_settings(12)
    @given(request=request_bodies(wild_too=False))
    def one_request(request: tuple[str, dict[str, Any]]) -> None:
        route, body = request
        resp = send(http, route, body)
        assert resp.status_code == 200, (body, resp.text)
        assert resp.json()["usage"]["completion_tokens"] <= 3

    one_request()
    assert_worker_serves(http)


def test_any_numbers_give_200_or_400_and_the_worker_survives(http: httpx.Client) -> None:
    @property_settings(40)
    @given(request=request_bodies(wild_too=True))
    def one_request(request: tuple[str, dict[str, Any]]) -> None:
        route, body = request
        raw = json.dumps(body)
        resp = send(http, route, body)
        assert_served_or_refused(resp, raw_is_json="NaN" not in raw and "Infinity" not in raw)

    one_request()
    assert_worker_serves(http)
