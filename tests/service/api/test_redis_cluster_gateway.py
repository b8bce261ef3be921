"""Two gateway replicas on a real Redis Cluster of three nodes (``redis.cluster``): tenants, keys, quotas,
usage, streams, revocation heard by the other replica, concurrency caps, budgets and deletion, each tenant's
keys in its own slot."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from service.app import create_app
from service.config.settings import Settings
from tenancy.keys import generate_key
from tenancy.layout import KeyLayout
from tenancy.redis_client import cluster_mismatch
from tests.conftest import gateway_settings
from tests.service.api.test_api import ADMIN, auth, chat, usage_of
from tests.support.fake_worker import FakeWorker
from tests.support.redis_cluster import local_cluster
from tests.support.servers import ThreadedServer, free_port

PREFIX = "rc:"
_ids = itertools.count()


def cluster_settings(url: str, model_dir: Path, worker: str) -> Settings:
    base = gateway_settings(url, model_dir, [worker])
    redis_section = base.redis.model_copy(update={"cluster": True, "key_prefix": PREFIX})
    return base.model_copy(update={"redis": redis_section})


@pytest.fixture(scope="module")
def replicas(redis_cluster_url: str, stub_model_dir: Path) -> Iterator[tuple[str, str, FakeWorker]]:
    """Two gateway replicas on the Redis Cluster, one fake worker."""
    worker = FakeWorker()
    with ThreadedServer(worker.app) as upstream:
        settings = cluster_settings(redis_cluster_url, stub_model_dir, upstream.url)
        with ThreadedServer(create_app(settings)) as a, ThreadedServer(create_app(settings)) as b:
            yield a.url, b.url, worker


def tenant(http: httpx.Client, **spec: Any) -> tuple[str, str, str]:
    """A new tenant and key: (tenant id, key id, api key)."""
    tenant_id = f"c{next(_ids)}"
    body = {"id": tenant_id, "name": tenant_id, **spec}
    assert http.post("/admin/tenants", json=body, headers=ADMIN).status_code == 201
    issued = http.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "k"}, headers=ADMIN).json()
    return tenant_id, issued["key_id"], issued["api_key"]


def cluster_keys(url: str, pattern: str) -> dict[str, int]:
    """Every key matching ``pattern`` on every node: name -> its hash slot."""
    client = redis.RedisCluster.from_url(url, decode_responses=True)
    try:
        return {str(k): int(client.keyslot(k)) for k in client.scan_iter(match=pattern)}
    finally:
        client.close()


def test_requests_quotas_and_usage_across_two_replicas(
    replicas: tuple[str, str, FakeWorker], redis_cluster_url: str
) -> None:
    a, b, _ = replicas
    with httpx.Client(base_url=a, timeout=30) as admin, httpx.Client(base_url=b, timeout=30) as other:
        tenant_id, key_id, key = tenant(admin, quotas={"requests_per_min": 0.001, "request_burst": 6})
        statuses = []
        for i in range(8):  # alternating replicas, non-streamed and streamed: exactly the burst passes
            http = admin if i % 2 else other
            body = chat(max_tokens=2, stream=bool(i % 3 == 0))
            statuses.append(http.post("/v1/chat/completions", json=body, headers=auth(key)).status_code)
        assert statuses.count(200) == 6 and statuses.count(429) == 2, statuses
        usage = usage_of(admin, tenant_id)
        assert usage["requests"] == 6 and usage["completion_tokens"] == 12
        # every key of the tenant (record, key, buckets, usage) in the tenant's one slot
        owned = cluster_keys(redis_cluster_url, f"{PREFIX}{{{tenant_id}}}:*")
        assert len(owned) >= 4 and len(set(owned.values())) == 1, owned
        assert KeyLayout(PREFIX).api_key(tenant_id, key_id) in owned


def test_tenants_spread_over_the_nodes(replicas: tuple[str, str, FakeWorker], redis_cluster_url: str) -> None:
    """Twelve tenants land in slots of more than one node, and each is served from its own."""
    a, _, _ = replicas
    with httpx.Client(base_url=a, timeout=30) as admin:
        made = [tenant(admin) for _ in range(12)]
        with ThreadPoolExecutor(6) as pool:
            answers = list(
                pool.map(
                    lambda t: admin.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(t[2])),
                    made,
                )
            )
        assert [r.status_code for r in answers] == [200] * 12
        client = redis.RedisCluster.from_url(redis_cluster_url, decode_responses=True)
        try:
            nodes = {client.get_node_from_key(KeyLayout(PREFIX).tenant(t[0])).name for t in made}
        finally:
            client.close()
        assert len(nodes) >= 2, nodes


def test_revoke_on_one_replica_is_heard_by_the_other(replicas: tuple[str, str, FakeWorker]) -> None:
    a, b, _ = replicas
    with httpx.Client(base_url=a, timeout=30) as admin, httpx.Client(base_url=b, timeout=30) as other:
        tenant_id, key_id, key = tenant(admin)
        assert (
            other.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)).status_code == 200
        )
        assert admin.delete(f"/admin/tenants/{tenant_id}/keys/{key_id}", headers=ADMIN).is_success
        answer = other.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key))
        assert answer.status_code == 401


def test_caps_budgets_and_delete_on_the_cluster(
    replicas: tuple[str, str, FakeWorker], redis_cluster_url: str
) -> None:
    a, _, worker = replicas
    with httpx.Client(base_url=a, timeout=30) as admin:
        tenant_id, key_id, key = tenant(admin, max_concurrent_requests=1)
        budget = {"period": "day", "hard_limit_usd": 1.0}
        assert admin.put(f"/admin/tenants/{tenant_id}/budget", json=budget, headers=ADMIN).is_success
        worker.delay_s = 0.3
        try:
            with admin.stream(
                "POST", "/v1/chat/completions", json=chat(max_tokens=4, stream=True), headers=auth(key)
            ) as held:
                lines = held.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                refused = admin.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key))
                assert refused.status_code == 429
                assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
                assert "[DONE]" in "".join(lines)
        finally:
            worker.delay_s = 0.0
        assert admin.delete(f"/admin/tenants/{tenant_id}", headers=ADMIN).status_code == 204
        left = cluster_keys(redis_cluster_url, f"*{tenant_id}*") | cluster_keys(
            redis_cluster_url, f"*{key_id}*"
        )
        assert [k for k in left if ":once:" not in k and ":settled:" not in k] == []
        gone = admin.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key))
        assert gone.status_code == 401


def test_a_cluster_down_gives_503_and_service_resumes_when_it_is_back(
    tmp_path: Path, stub_model_dir: Path
) -> None:
    """One node killed (not the one ``redis.url`` names): once the cluster says ``cluster_state:fail``
    (``cluster-require-full-coverage yes``, the default), readiness 503 and 503 ``store_unavailable`` for a
    tenant on a node that still runs, never 500; the node back: answers again. Then every node killed:
    the same."""
    worker = FakeWorker()
    with local_cluster(tmp_path) as cluster, ThreadedServer(worker.app) as upstream:
        settings = cluster_settings(cluster.url, stub_model_dir, upstream.url)
        redis_section = settings.redis.model_copy(update={"socket_timeout_s": 0.5, "connect_timeout_s": 0.5})
        with (
            ThreadedServer(create_app(settings.model_copy(update={"redis": redis_section}))) as gw,
            httpx.Client(base_url=gw.url, timeout=30) as http,
        ):
            _, _, key = tenant(http)
            assert (
                http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)).status_code
                == 200
            )
            for only, name in ((len(cluster.ports) - 1, "later"), (None, "latest")):
                cluster.stop_nodes(only)
                until(lambda: http.get("/readyz").status_code == 503, 20.0)
                down = http.post(
                    "/v1/chat/completions", json=chat(max_tokens=1), headers=auth(generate_key().full)
                )
                assert down.status_code == 503 and down.json()["error"]["code"] == "store_unavailable", (
                    down.text
                )
                create = {"id": name, "name": name}
                assert http.post("/admin/tenants", json=create, headers=ADMIN).status_code == 503
                cluster.start_nodes(
                    only
                )  # the same nodes.conf: the same cluster (a restarted node's data gone)
                cluster.wait_formed()
                until(
                    lambda body=create: (
                        http.post("/admin/tenants", json=body, headers=ADMIN).status_code == 201
                    ),
                    15.0,
                )
                assert http.get("/readyz").status_code == 200


def until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.2)


def test_the_cluster_setting_must_match_the_server(
    redis_url: str, redis_cluster_url: str, stub_model_dir: Path
) -> None:
    """``serve`` refuses a cluster node named as one Redis, and one Redis named as a cluster, in one line
    (exit 2); an unreachable server is no mismatch (the gateway starts and answers 503 until it is up)."""
    assert cluster_mismatch(redis_url, cluster=False) is None
    assert cluster_mismatch(redis_cluster_url, cluster=True) is None
    assert cluster_mismatch(f"redis://127.0.0.1:{free_port()}/0", cluster=True, timeout_s=0.5) is None
    for url, cluster, says in (
        (redis_url, "true", "RADIXGATE_REDIS__CLUSTER is true but"),
        (redis_cluster_url, "false", "set RADIXGATE_REDIS__CLUSTER=true"),
    ):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXGATE_")}
        env |= {"RADIXGATE_REDIS__URL": url, "RADIXGATE_REDIS__CLUSTER": cluster}
        env |= {"RADIXGATE_API__TOKENIZER_PATH": str(stub_model_dir), "RADIXGATE_PORT": str(free_port())}
        done = subprocess.run(
            [sys.executable, "-m", "service", "serve"], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, done.stderr
        assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
