"""Two models behind one gateway (issue 27): each model's requests reach its own simulated workers only,
with one tenant's quota exact across both; each model's prompts are rendered and counted with its own
template and tokenizer (equal to what its workers count); a worker that reports another model is kept out;
context lengths come from the workers; /v1/models, 404 and allowed_models across models; per-model goals
shape admission."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from loadgen.sim.profiles import get_profile
from loadgen.sim.server import SimServer
from service.app import create_app
from service.config.settings import Settings
from service.observability.pool_gauges import UNKNOWN_MODEL
from service.workers.client import SGLangClient
from service.workers.pool import WorkerPool
from service.workers.worker_info import WorkerInfo
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_api import assert_openai_error
from tests.support.fake_worker import FakeWorker
from tests.support.model_stub import write_stub_model
from tests.support.servers import ThreadedServer

SMALL, LLAMA = "small", "sim-llama-3.1-8b"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>"
    "\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""A Llama-3-like chat template: the second model renders the same chat into more tokens."""
_ids = itertools.count()


def llama_folder(folder: Path) -> Path:
    """The stub word-level tokenizer with the Llama-3-like template and its BOS."""
    write_stub_model(folder)
    (folder / "chat_template.jinja").write_text(LLAMA3)
    (folder / "tokenizer_config.json").write_text(
        '{"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}'
    )
    return folder


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, tuple[SimServer, str]]]:
    """Two simulated CPU workers of ``small``, two simulated H100 workers of the Llama model, and one that
    reports another model ("stray", listed under ``small``): name -> (server, URL)."""
    cpu, h100 = get_profile("smollm2-135m-cpu2"), get_profile("llama-3.1-8b-h100")
    servers = {
        "a1": SimServer(cpu, seed=1, speed=20.0, model_name=SMALL),
        "a2": SimServer(cpu, seed=2, speed=20.0, model_name=SMALL),
        "b1": SimServer(h100, seed=3, model_name=LLAMA),
        "b2": SimServer(h100, seed=4, model_name=LLAMA),
        "stray": SimServer(h100, seed=5, model_name="other-model"),
    }
    running = {name: ThreadedServer(s.app) for name, s in servers.items()}
    try:
        for server in running.values():
            server.__enter__()
        yield {name: (servers[name], running[name].url) for name in servers}
    finally:
        for server in running.values():
            server.__exit__(None, None, None)


def two_model_settings(
    redis_url: str, small_dir: Path, llama_dir: Path, sims: dict[str, tuple[SimServer, str]]
) -> Settings:
    url = {name: u for name, (_, u) in sims.items()}
    return Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": f"two{next(_ids)}:"},
            "upstream": {"health_interval_s": 0.2},
            "models": [
                {
                    "id": SMALL,
                    "aliases": ["small-latest"],
                    "workers": [url["a1"], url["a2"], url["stray"]],
                    "tokenizer_path": str(small_dir),
                    "context_length": 4096,  # below its workers' 8192: the setting
                },
                {
                    "id": LLAMA,
                    "aliases": ["llama"],
                    "workers": [url["b1"], url["b2"]],
                    "tokenizer_path": str(llama_dir),
                    "owned_by": "meta",
                    "tools": False,
                    "structured_outputs": False,
                    "tool_call_format": "llama3_json",
                },
            ],
        }
    )


@pytest.fixture(scope="module")
def gateway(
    redis_url: str, stub_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, sims: Any
) -> Iterator[str]:
    llama_dir = llama_folder(tmp_path_factory.mktemp("llama"))
    with ThreadedServer(create_app(two_model_settings(redis_url, stub_model_dir, llama_dir, sims))) as gw:
        yield gw.url


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


def new_key(http: httpx.Client, **spec: Any) -> tuple[str, dict[str, str]]:
    tenant = f"t{next(_ids)}"
    assert (
        http.post("/admin/tenants", json={"id": tenant, "name": tenant, **spec}, headers=ADMIN).status_code
        == 201
    )
    issued = http.post(f"/admin/tenants/{tenant}/keys", json={"name": "k"}, headers=ADMIN)
    return tenant, {"Authorization": f"Bearer {issued.json()['api_key']}"}


MESSAGES = [
    {"role": "system", "content": "You answer questions about trains, briefly."},
    {"role": "user", "content": "When does the last train leave, and how much is a day pass?"},
]


def chat(model: str, max_tokens: int = 3, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, **extra}


def calls(sims: dict[str, tuple[SimServer, str]]) -> dict[str, int]:
    return {name: server.generate_calls for name, (server, _) in sims.items()}


def test_requests_reach_their_models_workers_only_with_exact_quotas(
    http: httpx.Client, sims: dict[str, tuple[SimServer, str]]
) -> None:
    tenant, auth = new_key(http, quotas={"requests_per_min": 8})
    before = calls(sims)
    names = [SMALL, "small-latest", LLAMA, "llama"] * 2
    with capture_logs() as logs:
        answers = [http.post("/v1/chat/completions", json=chat(name), headers=auth) for name in names]
        assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
        over = http.post("/v1/chat/completions", json=chat(LLAMA), headers=auth)
    assert_openai_error(over, 429, "rate_limit_exceeded")  # one tenant's quota, across both models
    assert [a.json()["model"] for a in answers] == names  # the name asked for is echoed
    after = calls(sims)
    served = {name: after[name] - before[name] for name in after}
    assert served["a1"] + served["a2"] == 4 and served["b1"] + served["b2"] == 4, served
    assert served["stray"] == 0  # it reports another model: kept out of small's pool
    # usage: exactly what the workers counted, both models together
    usage = http.get(f"/admin/tenants/{tenant}/usage", headers=ADMIN).json()
    assert usage["requests"] == 8
    assert usage["prompt_tokens"] == sum(a.json()["usage"]["prompt_tokens"] for a in answers)
    assert usage["completion_tokens"] == sum(a.json()["usage"]["completion_tokens"] for a in answers) == 24
    # logs and metrics carry the canonical id: aliases fold into it
    lines = [line for line in logs if line["event"] == "request" and line["tenant"] == tenant]
    assert sorted(line["model"] for line in lines) == [LLAMA] * 4 + [SMALL] * 4
    labels = {
        s.labels["model"]
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for s in family.samples
        if s.name == "radixgate_requests_total"
    }
    assert labels == {SMALL, LLAMA}


def model_label_values(http: httpx.Client) -> set[str]:
    """Every ``model`` label value on the gateway's ``/metrics``."""
    return {
        s.labels["model"]
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for s in family.samples
        if "model" in s.labels
    }


def test_model_labels_stay_the_served_ids_whatever_clients_send(http: httpx.Client) -> None:
    # the model label's values are the registry's ids: a client naming 300 models the gateway does not
    # serve (404, nothing charged) or an alias adds no series; the bound is the operator's model count
    tenant, auth = new_key(http, quotas={"requests_per_min": 1000})
    assert http.post("/v1/chat/completions", json=chat("small-latest"), headers=auth).status_code == 200
    before = model_label_values(http)
    for i in range(300):
        resp = http.post("/v1/chat/completions", json=chat(f"made-up-{i}"), headers=auth)
        assert_openai_error(resp, 404, "model_not_found")
    assert http.post("/v1/chat/completions", json=chat("llama"), headers=auth).status_code == 200
    after = model_label_values(http)
    # plus "unknown": the per-worker engine series of a worker kept out of every pool (the wrong model)
    assert after <= {SMALL, LLAMA, UNKNOWN_MODEL} and SMALL in before
    assert http.get(f"/admin/tenants/{tenant}/usage", headers=ADMIN).json()["requests"] == 2


def gateway_count(resp: httpx.Response) -> int:
    """The gateway's own prompt count, from a 413's message ("... (prompt P + max_tokens M) ...")."""
    err = assert_openai_error(resp, 413, "request_exceeds_burst")
    found = re.search(r"\(prompt (\d+) \+", err["message"])
    assert found is not None, err
    return int(found.group(1))


def test_each_model_counts_prompts_with_its_own_tokenizer_and_context_length(http: httpx.Client) -> None:
    _, auth = new_key(http, quotas={"tokens_per_min": 600})
    counted = {}
    for model in (SMALL, LLAMA):
        served = http.post("/v1/chat/completions", json=chat(model), headers=auth)
        assert served.status_code == 200, served.text
        worker = served.json()["usage"]["prompt_tokens"]
        # too large for the tenant's burst: refused with the gateway's own count, nothing charged
        gateway = gateway_count(http.post("/v1/chat/completions", json=chat(model, 1000), headers=auth))
        assert gateway == worker, model  # its template and tokenizer count what its workers count
        counted[model] = gateway
    assert counted[LLAMA] > counted[SMALL]  # the same chat, two templates
    # context length: small's setting (4096) refuses 5000 tokens; the Llama workers' own 131,072 does not
    # (the request then meets the tenant's burst, past the context check), never a default of 8192
    assert_openai_error(http.post("/v1/chat/completions", json=chat(SMALL, 5000), headers=auth), 400)
    gateway_count(http.post("/v1/chat/completions", json=chat(LLAMA, 9000), headers=auth))


def test_models_lists_every_model_and_alias(http: httpx.Client) -> None:
    _, auth = new_key(http)
    data = http.get("/v1/models", headers=auth).json()["data"]
    assert [(m["id"], m["root"], m["owned_by"], m["context_length"]) for m in data] == [
        (SMALL, SMALL, "radixgate", 4096),  # the setting, below its workers' 8192
        ("small-latest", SMALL, "radixgate", 4096),
        (LLAMA, LLAMA, "meta", 131_070),  # from its workers (131,072 less SGLang's reserve), no setting
        ("llama", LLAMA, "meta", 131_070),
    ]
    assert data[0]["capabilities"] == {"tools": True, "structured_outputs": True}
    assert data[3]["capabilities"] == {"tools": False, "structured_outputs": False}
    assert http.get("/v1/models/llama", headers=auth).json() == data[3]
    assert_openai_error(http.get("/v1/models/gpt-4o", headers=auth), 404, "model_not_found")
    assert_openai_error(
        http.post("/v1/chat/completions", json=chat("gpt-4o"), headers=auth), 404, "model_not_found"
    )


def test_a_models_switches_refuse_what_it_does_not_serve(http: httpx.Client) -> None:
    _, auth = new_key(http)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    refused = http.post("/v1/chat/completions", json=chat("llama", tools=[tool]), headers=auth)
    assert assert_openai_error(refused, 400, "unsupported_parameter")["param"] == "tools"
    json_mode = chat(LLAMA, response_format={"type": "json_object"})
    refused = http.post("/v1/chat/completions", json=json_mode, headers=auth)
    assert assert_openai_error(refused, 400, "unsupported_parameter")["param"] == "response_format"
    assert http.post("/v1/chat/completions", json=chat(SMALL, tools=[tool]), headers=auth).status_code == 200


def test_allowed_models_work_across_models(http: httpx.Client) -> None:
    _, auth = new_key(http, allowed_models=[LLAMA, "small-latest"])
    for model, status in ((LLAMA, 200), ("llama", 200), ("small-latest", 200), (SMALL, 403)):
        resp = http.post("/v1/chat/completions", json=chat(model), headers=auth)
        assert resp.status_code == status, (model, resp.text)
    listed = [m["id"] for m in http.get("/v1/models", headers=auth).json()["data"]]
    assert listed == ["small-latest", LLAMA, "llama"]  # an id allows its aliases; an alias itself only
    bad = {"id": f"t{next(_ids)}", "name": "x", "allowed_models": ["llama", "gpt-4o"]}
    assert_openai_error(http.post("/admin/tenants", json=bad, headers=ADMIN), 400, "model_not_found")


def test_admin_workers_show_each_workers_model_and_the_mismatch(
    http: httpx.Client, sims: dict[str, tuple[SimServer, str]]
) -> None:
    workers = {w["url"]: w for w in http.get("/admin/workers", headers=ADMIN).json()["data"]}
    url = {name: u for name, (_, u) in sims.items()}
    assert [workers[url[n]]["model"] for n in ("a1", "a2", "b1", "b2")] == [SMALL, SMALL, LLAMA, LLAMA]
    assert all(workers[url[n]]["model_mismatch"] is None for n in ("a1", "b1"))
    stray = workers[url["stray"]]
    assert stray["healthy"] and stray["model"] is None
    assert "reports model 'other-model' but is listed under model 'small'" in stray["model_mismatch"]


async def test_a_mismatch_is_logged_once_with_its_reason(
    sims: dict[str, tuple[SimServer, str]], stub_model_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    registry = two_model_settings(redis_url, stub_model_dir, tmp_path, sims).model_registry()
    stray, good = sims["stray"][1], sims["b1"][1]
    async with SGLangClient() as client:
        pool = WorkerPool([stray, good], client, 1.0, models=registry)
        with capture_logs() as logs:
            for _ in range(4):
                await pool.probe_all()
        excluded = [line for line in logs if line["event"] == "worker_excluded"]
        assert [(line["worker"], line["reported_model"]) for line in excluded] == [(stray, "other-model")]
        assert "add 'other-model' to its aliases in RADIXGATE_MODELS" in excluded[0]["reason"]
        assert pool.eligibility(SMALL) == [] and pool.eligibility(LLAMA) == [(good, True)]


@pytest.fixture(scope="module")
def goal_gateway(redis_url: str, stub_model_dir: Path) -> Iterator[tuple[str, FakeWorker, FakeWorker]]:
    """Two models on one slow fake worker each, a window of one request, and standard goals of 300 ms
    ("tight") and 5 s ("loose")."""
    tight, loose = FakeWorker(), FakeWorker()
    tight.delay_s = loose.delay_s = 0.25  # a 4-token answer takes 1 s
    window = {"window_mode": "fixed", "window_initial": 1}

    def model(name: str, url: str, goal_ms: float) -> dict[str, Any]:
        return {
            "id": name,
            "workers": [url],
            "tokenizer_path": str(stub_model_dir),
            "scheduler": window,
            "priority_classes": {"standard": {"ttft_goal_ms": goal_ms}},
        }

    with ThreadedServer(tight.app) as t, ThreadedServer(loose.app) as lo:
        settings = Settings.model_validate(
            {
                "admin_token": ADMIN_TOKEN,
                "redis": {"url": redis_url, "key_prefix": f"goals{next(_ids)}:"},
                "upstream": {"health_interval_s": 0.2},
                "models": [model("tight", t.url, 300), model("loose", lo.url, 5000)],
            }
        )
        with ThreadedServer(create_app(settings)) as gw:
            yield gw.url, tight, loose


def test_per_model_goals_shape_admission(goal_gateway: tuple[str, FakeWorker, FakeWorker]) -> None:
    url, tight, loose = goal_gateway
    with httpx.Client(base_url=url, timeout=30) as http:
        _, auth = new_key(http)

        def ask(model: str) -> httpx.Response:
            return http.post("/v1/chat/completions", json=chat(model, 4), headers=auth)

        with ThreadPoolExecutor(4) as pool:  # two at once per model: one runs, one waits for the window
            answers = list(pool.map(ask, ["tight", "tight", "loose", "loose"]))
    # the tight model's waiting request passes its 300 ms goal in the queue and is given up unserved;
    # the loose model's waits its turn within 5 s
    assert sorted(a.status_code for a in answers[:2]) == [200, 503], [a.text for a in answers]
    assert_openai_error(next(a for a in answers[:2] if a.status_code == 503), 503, "queue_timeout")
    assert [a.status_code for a in answers[2:]] == [200, 200], [a.text for a in answers]
    assert (len(tight.received), len(loose.received)) == (1, 2)
    # the class metrics say the same per model: outcomes, goodput against each model's own goal
    with httpx.Client(base_url=url, timeout=30) as http:
        samples = [
            s
            for family in text_string_to_metric_families(http.get("/metrics").text)
            for s in family.samples
            if s.name.startswith("radixgate_class_")
        ]

    def value(name: str, model: str, **labels: str) -> float:
        want = {"class": "standard", "model": model, **labels}
        return sum(s.value for s in samples if s.name == name and want.items() <= s.labels.items())

    assert value("radixgate_class_requests_total", "tight", outcome="served") == 1
    assert value("radixgate_class_requests_total", "tight", outcome="shed") == 1
    assert value("radixgate_class_requests_total", "loose", outcome="served") == 2
    assert value("radixgate_class_requests_total", "loose", outcome="shed") == 0
    assert value("radixgate_class_goodput_total", "loose") == 2  # within 5 s, the second after 1 s waiting
    assert value("radixgate_class_e2e_seconds_count", "loose") == 2
    assert value("radixgate_class_e2e_seconds_bucket", "loose", le="0.75") == 0  # each took >= 1 s


@pytest.mark.parametrize(
    ("info", "models", "model", "context"),
    [
        ({"served_model_name": "a", "model_path": "/m/a", "context_length": 4096}, None, "a", 4096),
        ({"model_path": "/m/a"}, None, "/m/a", None),  # SGLang names a model by its path unless told
        ({"max_req_input_len": 8186}, None, None, 8192),  # SGLang's max_req_len + 1 (no --context-length)
        ({}, {"data": [{"id": "listed"}]}, "listed", None),  # else its OpenAI listing
        ({"served_model_name": "a"}, {"data": [{"id": "listed"}]}, "a", None),
        ({}, {"data": []}, None, None),
        ({"served_model_name": ""}, "not json", None, None),
    ],
)
def test_what_a_worker_says_it_serves(
    info: dict[str, Any], models: Any, model: str | None, context: int | None
) -> None:
    parsed = WorkerInfo.parse(info).with_listed_model(models)
    assert (parsed.model, parsed.context_length) == (model, context)
