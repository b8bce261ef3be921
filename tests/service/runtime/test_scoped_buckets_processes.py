"""Per-model and per-key buckets are exact across gateway processes: several ``python -m service serve``
processes (each its own quota leases) sharing one Redis admit exactly a bucket's burst of concurrent
requests, and every refusal names the bucket (issue 30)."""

from __future__ import annotations

import concurrent.futures
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.service.runtime.test_gateway_processes import ADMIN, MODEL, gateway_env, serve
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer, free_port

PROCESSES = 3
LARGE = {"requests_per_min": 1e6, "tokens_per_min": 1e9}  # leased on every process


def ask(base: str, key: str) -> tuple[int, dict[str, Any]]:
    """One chat completion on a fresh connection (any process may take it): status and error object."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    resp = httpx.post(
        f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )
    return resp.status_code, resp.json().get("error", {}) if resp.status_code != 200 else {}


def test_model_and_key_buckets_admit_exactly_their_burst_across_processes(
    redis_url: str, stub_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "gateway.log"
    with ThreadedServer(FakeWorker().app) as upstream:
        env = gateway_env(redis_url, stub_model_dir, upstream.url, port, PROCESSES, "procscoped:")
        server = serve(env, log, port)
        base = next(server)
        try:
            with httpx.Client(base_url=base, timeout=30, headers=ADMIN) as admin:
                model_quota = {"model": MODEL, "requests_per_min": 1, "request_burst": 20}
                tenant = {"id": "per-model", "name": "m", "quotas": {**LARGE, "models": [model_quota]}}
                assert admin.post("/admin/tenants", json=tenant).status_code == 201
                model_key = admin.post("/admin/tenants/per-model/keys", json={}).json()["api_key"]
                assert (
                    admin.post(
                        "/admin/tenants", json={"id": "per-key", "name": "k", "quotas": LARGE}
                    ).status_code
                    == 201
                )
                limited = admin.post(
                    "/admin/tenants/per-key/keys",
                    json={"quotas": {"requests_per_min": 1, "request_burst": 15}},
                ).json()
                free = admin.post("/admin/tenants/per-key/keys", json={}).json()["api_key"]
            # 60 requests of each bucket and 30 of the tenant's other key, all at once, interleaved
            jobs = [model_key] * 60 + [limited["api_key"]] * 60 + [free] * 30
            jobs = jobs[::3] + jobs[1::3] + jobs[2::3]
            with concurrent.futures.ThreadPoolExecutor(24) as pool:
                answers = list(pool.map(lambda key: (key, *ask(base, key)), jobs))
            with httpx.Client(base_url=base, timeout=30, headers=ADMIN) as admin:
                usage = {t: admin.get(f"/admin/tenants/{t}/usage").json() for t in ("per-model", "per-key")}
        finally:
            server.close()
    by_key = {key: Counter(status for k, status, _ in answers if k == key) for key in set(jobs)}
    assert by_key[model_key] == {200: 20, 429: 40}
    assert by_key[limited["api_key"]] == {200: 15, 429: 45}
    assert by_key[free] == {200: 30}  # the tenant's other key: not limited by the key's bucket
    quotas = {json.dumps(err["quota"], sort_keys=True) for _, status, err in answers if status == 429}
    assert quotas == {
        json.dumps({"bucket": "requests", "id": MODEL, "scope": "model"}, sort_keys=True),
        json.dumps({"bucket": "requests", "id": limited["key_id"], "scope": "key"}, sort_keys=True),
    }
    # nothing charged for a refusal: the tenants' usage counts exactly the answers
    assert (usage["per-model"]["requests"], usage["per-model"]["quota_rejections"]) == (20, 40)
    assert (usage["per-key"]["requests"], usage["per-key"]["quota_rejections"]) == (45, 45)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    served = Counter(line["pid"] for line in lines if line.get("event") == "request")
    assert len(served) >= 2, f"one process served every request: {served}"
