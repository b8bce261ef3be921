"""Cost equals price x worker-reported tokens for every request of a mixed run (issue 30): two models at
their own prices, simulated SGLang workers (loadgen/sim) that report prefix-cache hits, two API keys,
streamed and non-streamed requests with and without a shared system prompt. Every request's logged cost
is its answer's usage at its model's price (cached tokens at the cached price), and the usage by key and
model, and the tenant's total, are the exact sums."""

from __future__ import annotations

import itertools
import random
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
from policies.pricing import ModelPrice, pico_to_usd, request_cost
from service.app import create_app
from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.service.pipeline.test_two_models import LLAMA, SMALL, llama_folder
from tests.support.servers import ThreadedServer

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PRICES = {
    SMALL: {"input_per_mtok": 0.1, "cached_input_per_mtok": 0.025, "output_per_mtok": 0.4},
    LLAMA: {"input_per_mtok": 3, "cached_input_per_mtok": 0.3, "output_per_mtok": 15},
}
EXACT = {SMALL: ModelPrice(100_000, 25_000, 400_000), LLAMA: ModelPrice(3_000_000, 300_000, 15_000_000)}
_ids = itertools.count()


@pytest.fixture(scope="module")
def gateway(redis_url: str, stub_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cpu, h100 = get_profile("smollm2-135m-cpu2"), get_profile("llama-3.1-8b-h100")
    sims = [
        SimServer(cpu, seed=1, speed=20.0, model_name=SMALL),
        SimServer(cpu, seed=2, speed=20.0, model_name=SMALL),
        SimServer(h100, seed=3, model_name=LLAMA),
    ]
    servers = [ThreadedServer(s.app) for s in sims]
    for server in servers:
        server.__enter__()
    try:
        url = [s.url for s in servers]
        settings = Settings.model_validate(
            {
                "admin_token": ADMIN_TOKEN,
                "redis": {"url": redis_url, "key_prefix": f"cost{next(_ids)}:"},
                "upstream": {"health_interval_s": 0.2},
                "models": [
                    {"id": SMALL, "workers": url[:2], "tokenizer_path": str(stub_model_dir)},
                    {
                        "id": LLAMA,
                        "aliases": ["llama"],
                        "workers": url[2:],
                        "tokenizer_path": str(llama_folder(tmp_path_factory.mktemp("llama"))),
                        "tools": False,
                        "structured_outputs": False,
                    },
                ],
                "pricing": {"models": PRICES},
            }
        )
        with ThreadedServer(create_app(settings)) as gw:
            yield gw.url
    finally:
        for server in servers:
            server.__exit__(None, None, None)


SYSTEM = "You are a terse assistant for a railway company. Answer in one short sentence. " * 3


def request_body(rng: random.Random, i: int) -> dict[str, Any]:
    """A mixed request: either model, streamed or not, the shared system prompt (cache hits) or not."""
    model = rng.choice([SMALL, LLAMA, "llama"])
    messages = [{"role": "user", "content": f"Question {i}: when does train {rng.randint(1, 9)} leave?"}]
    if rng.random() < 0.7:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": rng.randint(1, 12)}
    if rng.random() < 0.5:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def send(http: httpx.Client, key: str, body: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(request id, model answered, usage as the worker reported it)."""
    headers = {"Authorization": f"Bearer {key}"}
    if not body.get("stream"):
        resp = http.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        return resp.headers["x-request-id"], body["model"], resp.json()["usage"]
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200
        chunks = [line[6:] for line in resp.iter_lines() if line.startswith("data: {")]
        rid = resp.headers["x-request-id"]
    usage = httpx.Response(200, content=chunks[-1]).json()["usage"]
    return rid, body["model"], usage


@pytest.mark.parametrize(
    "quotas",
    [
        {},  # every settle its own script call
        # big quotas: admitted from local leases, their settles summed per tenant (rows and cost summed too)
        {"requests_per_min": 1_000_000, "tokens_per_min": 100_000_000},
    ],
)
def test_cost_in_usage_is_price_times_worker_tokens_for_every_request(
    gateway: str, quotas: dict[str, float]
) -> None:
    rng = random.Random(30)
    with httpx.Client(base_url=gateway, timeout=60) as http:
        tenant = f"mixed{next(_ids)}"
        body = {"id": tenant, "name": "m", "quotas": quotas}
        assert http.post("/admin/tenants", json=body, headers=ADMIN).status_code == 201
        keys = [http.post(f"/admin/tenants/{tenant}/keys", json={}, headers=ADMIN).json() for _ in range(2)]
        jobs = [(keys[i % 2], request_body(rng, i)) for i in range(60)]
        with capture_logs() as logs, ThreadPoolExecutor(6) as pool:
            results = list(
                pool.map(lambda job: (job[0]["key_id"], *send(http, job[0]["api_key"], job[1])), jobs)
            )
            usage = http.get(f"/admin/tenants/{tenant}/usage", headers=ADMIN).json()  # waits for the settles
        export = http.get(
            f"/admin/tenants/{tenant}/usage", params={"group_by": "key,model"}, headers=ADMIN
        ).json()
    logged = {e["request_id"]: e for e in logs if e["event"] == "request" and e["tenant"] == tenant}
    expected: dict[tuple[str, str], int] = {}
    cached_total = 0
    for key_id, rid, model, reported in results:
        model_id = LLAMA if model == "llama" else model
        cached = (reported.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        cached_total += cached
        cost = request_cost(EXACT[model_id], reported["prompt_tokens"], cached, reported["completion_tokens"])
        assert logged[rid]["cost_usd"] == pico_to_usd(cost), (rid, reported)  # every request's own cost
        assert (logged[rid]["prompt_tokens"], logged[rid]["cached_tokens"]) == (
            reported["prompt_tokens"],
            cached,
        )
        expected[(key_id, model_id)] = expected.get((key_id, model_id), 0) + cost
    assert cached_total > 0  # the shared system prompt came from the workers' prefix caches
    assert len(expected) == 4  # both keys used both models
    got = {(row["key_id"], row["model"]): row["cost_picodollars"] for row in export["data"]}
    assert got == expected  # exact sums, in picodollars
    assert usage["cost_picodollars"] == export["total"]["cost_picodollars"] == sum(expected.values())
    assert usage["requests"] == export["total"]["requests"] == 60
    assert usage["cached_tokens"] == export["total"]["cached_tokens"] == cached_total
    if quotas:  # the lease path was taken: these settles were summed
        leased = [
            s.value
            for family in text_string_to_metric_families(httpx.get(f"{gateway}/metrics").text)
            for s in family.samples
            if s.name == "radixgate_quota_reservations_total" and s.labels["source"] == "lease"
        ]
        assert leased and leased[0] > 0
