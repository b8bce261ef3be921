"""Tenant isolation over every route (issue 31). The table below has a row for every route of the app, read
from the app's own routing table (a route added later fails the coverage check until it has a row). With a key
of tenant A, each route either answers about A alone, or refuses (``/admin``: 403; ``/metrics``: 403 with the
metrics token set); tenant B's record, keys and usage are unchanged after all of it, whatever A sent to name
B (path parameters, ``user``, headers, query). A revoked key and a disabled tenant's key are refused on every
tenant route within the auth cache's bound. After the run, which used distinctive keys and prompt text, none
of the key material or the prompt text is in the gateway's log lines, its ``/metrics``, its trace spans or any
answer."""

from __future__ import annotations

import io
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import structlog
from fastapi import FastAPI
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.routing import BaseRoute, Route

from service.app import create_app
from service.config.security import SecuritySettings
from service.observability.logs import configure_logging
from service.observability.tracing import Tracing
from service.workers.registry import worker_id
from tenancy.layout import KeyLayout
from tests.conftest import ADMIN_TOKEN, MODEL, gateway_settings
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
METRICS = {"Authorization": "Bearer isolation-metrics-token-0123"}
PROMPT = "zebra-kumquat-7731 tell me about the quiet harbour"  # distinctive: grepped for afterwards
_ids = itertools.count()


def walk(routes: list[BaseRoute], prefix: str = "") -> set[tuple[str, str]]:
    """(method, path) of every route under ``routes``, included routers' prefixes applied (FastAPI >= 0.165
    keeps an included router as one lazy entry: its ``original_router`` and ``include_context.prefix``)."""
    found: set[tuple[str, str]] = set()
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            found |= walk(inner.routes, prefix + route.include_context.prefix)  # type: ignore[attr-defined]
        elif isinstance(route, Route) or hasattr(route, "methods"):
            path = prefix + route.path  # type: ignore[attr-defined]
            found |= {(m, path) for m in route.methods or () if m != "HEAD"}  # type: ignore[attr-defined]
    return found


def all_routes(app: FastAPI) -> set[tuple[str, str]]:
    routes = walk(list(app.routes))
    documented = {
        (m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops if m.upper() != "HEAD"
    }
    # the walk finds every documented route (and the undocumented ones: /docs, /openapi.json, ...)
    assert {(m, p.replace("{model_id}", "{model_id:path}")) for m, p in documented} <= routes
    return routes


@dataclass
class Tenant:
    id: str
    key: str
    key_id: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass
class Run:
    http: httpx.Client
    app: FastAPI
    logs: io.StringIO
    a: Tenant
    b: Tenant
    spans: InMemorySpanExporter
    answers: list[str] = field(default_factory=list)  # every body the gateway answered, to grep

    def send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        resp = self.http.request(method, path, **kw)
        self.answers.append(resp.text)
        return resp


def new_tenant(http: httpx.Client, rpm: int) -> Tenant:
    tenant = f"iso{next(_ids)}"
    spec = {"id": tenant, "name": tenant, "quotas": {"requests_per_min": rpm}}
    assert http.post("/admin/tenants", json=spec, headers=ADMIN).status_code == 201
    issued = http.post(f"/admin/tenants/{tenant}/keys", json={"name": "k"}, headers=ADMIN).json()
    return Tenant(tenant, issued["api_key"], issued["key_id"])


@pytest.fixture(scope="module")
def run(redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]) -> Iterator[Run]:
    settings = gateway_settings(redis_url, stub_model_dir, [fake[1]])
    security = SecuritySettings(metrics_token=METRICS["Authorization"].split()[1], bad_key_rate_per_s=0)
    app = create_app(settings.model_copy(update={"security": security}))
    spans = InMemorySpanExporter()
    app.state.tracing = Tracing(spans, "radixgate-isolation", batch=False)  # every request traced, kept here
    logs = io.StringIO()
    saved, handlers = structlog.get_config(), logging.getLogger().handlers[:]
    configure_logging("DEBUG", logs)  # every line the gateway writes, at every level, into this buffer
    try:
        with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
            a, b = new_tenant(http, 1000), new_tenant(http, 999)
            for _ in range(2):  # B has usage of its own
                chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
                assert http.post("/v1/chat/completions", json=chat, headers=b.auth).status_code == 200
            yield Run(http, app, logs, a, b, spans)
    finally:
        structlog.configure(**saved)
        logging.getLogger().handlers = handlers


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, **extra}


# what tenant A may try on each route, naming B wherever it can; the expected status; and, for a route
# that answers, what the answer must (not) hold
Probe = Callable[[Run], list[httpx.Response]]


def public(path: str) -> Probe:
    return lambda r: [r.send("GET", path, headers=r.a.auth)]


def admin(method: str, template: str) -> Probe:
    def probe(r: Run) -> list[httpx.Response]:
        path = template.format(
            tenant_id=r.b.id, key_id=r.b.key_id, wid=worker_id("http://127.0.0.1:1"), model=MODEL
        )
        body = {
            "id": r.a.id,
            "name": "taken",
            "requests_per_min": 1,
            "url": "http://127.0.0.1:1",
            "disabled": True,
        }
        return [r.send(method, path, json=body, headers=r.a.auth | {"X-Tenant-Id": r.b.id})]

    return probe


def completion(path: str, body: Callable[[Run], dict[str, Any]]) -> Probe:
    def probe(r: Run) -> list[httpx.Response]:
        smuggled = {"X-Tenant-Id": r.b.id, "OpenAI-Organization": r.b.id, "OpenAI-Project": r.b.id}
        return [r.send("POST", f"{path}?tenant_id={r.b.id}", json=body(r), headers=r.a.auth | smuggled)]

    return probe


def own_usage(r: Run) -> list[httpx.Response]:
    return [
        r.send("GET", "/v1/usage", headers=r.a.auth),
        r.send("GET", f"/v1/usage?tenant_id={r.b.id}", headers=r.a.auth | {"X-Tenant-Id": r.b.id}),
    ]


def models(path: str) -> Probe:
    return lambda r: [r.send("GET", path, headers=r.a.auth | {"X-Tenant-Id": r.b.id})]


TABLE: dict[tuple[str, str], tuple[Probe, int]] = {
    ("GET", "/healthz"): (public("/healthz"), 200),
    ("GET", "/readyz"): (public("/readyz"), 200),
    ("GET", "/openapi.json"): (public("/openapi.json"), 200),
    ("GET", "/docs"): (public("/docs"), 200),
    ("GET", "/docs/oauth2-redirect"): (public("/docs/oauth2-redirect"), 200),
    ("GET", "/redoc"): (public("/redoc"), 200),
    ("GET", "/metrics"): (public("/metrics"), 403),
    ("GET", "/v1/models"): (models("/v1/models"), 200),
    ("GET", "/v1/models/{model_id:path}"): (models(f"/v1/models/{MODEL}"), 200),
    ("GET", "/v1/usage"): (own_usage, 200),
    ("POST", "/v1/chat/completions"): (
        completion("/v1/chat/completions", lambda r: chat_body(user=r.b.id)),
        200,
    ),
    ("POST", "/v1/completions"): (
        completion(
            "/v1/completions", lambda r: {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "user": r.b.id}
        ),
        200,
    ),
    ("POST", "/v1/responses"): (
        completion(
            "/v1/responses",
            lambda r: {"model": MODEL, "input": PROMPT, "max_output_tokens": 2, "user": r.b.id},
        ),
        200,
    ),
}
ADMIN_ROUTES = [
    ("GET", "/admin/planner"),
    ("GET", "/admin/tenants"),
    ("POST", "/admin/tenants"),
    ("GET", "/admin/tenants/{tenant_id}"),
    ("PATCH", "/admin/tenants/{tenant_id}"),
    ("DELETE", "/admin/tenants/{tenant_id}"),
    ("POST", "/admin/tenants/{tenant_id}/disable"),
    ("POST", "/admin/tenants/{tenant_id}/enable"),
    ("PUT", "/admin/tenants/{tenant_id}/quotas"),
    ("GET", "/admin/tenants/{tenant_id}/usage"),
    ("GET", "/admin/tenants/{tenant_id}/keys"),
    ("POST", "/admin/tenants/{tenant_id}/keys"),
    ("GET", "/admin/tenants/{tenant_id}/keys/{key_id}"),
    ("PATCH", "/admin/tenants/{tenant_id}/keys/{key_id}"),
    ("DELETE", "/admin/tenants/{tenant_id}/keys/{key_id}"),
    ("GET", "/admin/tenants/{tenant_id}/budget"),
    ("PUT", "/admin/tenants/{tenant_id}/budget"),
    ("DELETE", "/admin/tenants/{tenant_id}/budget"),
    ("GET", "/admin/tenants/{tenant_id}/keys/{key_id}/budget"),
    ("PUT", "/admin/tenants/{tenant_id}/keys/{key_id}/budget"),
    ("DELETE", "/admin/tenants/{tenant_id}/keys/{key_id}/budget"),
    ("GET", "/admin/prices"),
    ("GET", "/admin/prices/{model}"),
    ("PUT", "/admin/prices/{model}"),
    ("DELETE", "/admin/prices/{model}"),
    ("GET", "/admin/workers"),
    ("POST", "/admin/workers"),
    ("POST", "/admin/workers/{wid}/drain"),
    ("DELETE", "/admin/workers/{wid}"),
]
TABLE |= {route: (admin(*route), 403) for route in ADMIN_ROUTES}
TENANT_ROUTES = [route for route, (_, status) in TABLE.items() if route[1].startswith("/v1/")]


def state_of(http: httpx.Client, tenant: Tenant) -> tuple[Any, ...]:
    """What the admin API shows of a tenant: its record, its keys, its request count and quotas."""
    record = http.get(f"/admin/tenants/{tenant.id}", headers=ADMIN).json()
    keys = http.get(f"/admin/tenants/{tenant.id}/keys", headers=ADMIN).json()
    usage = http.get(f"/admin/tenants/{tenant.id}/usage", headers=ADMIN).json()
    return record, keys, usage["requests"], usage["quotas"]


def test_the_table_covers_every_route(run: Run) -> None:
    assert set(TABLE) == all_routes(run.app)


def test_a_key_of_tenant_a_never_reads_or_changes_tenant_b(run: Run) -> None:
    before_b = state_of(run.http, run.b)
    served_a = run.http.get(f"/admin/tenants/{run.a.id}/usage", headers=ADMIN).json()["requests"]
    for route, (probe, status) in TABLE.items():
        for resp in probe(run):
            assert resp.status_code == status, (route, resp.text[:300])
            if status == 403:
                assert resp.json()["error"]["code"] in ("admin_required", "metrics_token_required"), route
            # the Responses API echoes the `user` A sent (OpenAI's shape): A's own words, not B's data
            text = resp.text.replace(f'"user":"{run.b.id}"', "")
            assert run.b.id not in text and run.b.key_id not in text, (route, text[:300])
    assert state_of(run.http, run.b) == before_b  # B: record, keys, usage, quotas unchanged
    # what A sent was A's: its usage counts the three completions, and /v1/usage answers A's quotas
    after_a = run.http.get(f"/admin/tenants/{run.a.id}/usage", headers=ADMIN).json()
    assert after_a["requests"] == served_a + 3
    for resp in own_usage(run):
        assert (
            resp.json()["quotas"]["requests_per_min"] == 1000
            and resp.json()["requests"] == after_a["requests"]
        )


def refused_within(run: Run, tenant: Tenant, status: int, bound_s: float) -> float:
    """Seconds until every tenant route refuses ``tenant``'s key with ``status`` (at most ``bound_s``)."""
    started = time.monotonic()
    pending = list(TENANT_ROUTES)
    while pending:
        route = pending[0]
        probe, _ = TABLE[route]
        if all(
            resp.status_code == status
            for resp in probe(Run(run.http, run.app, run.logs, tenant, run.b, run.spans, run.answers))
        ):
            pending.pop(0)
            continue
        assert time.monotonic() - started < bound_s, (route, "still answered")
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_revoked_key_and_a_disabled_tenant_are_refused_within_the_cache_bound(run: Run) -> None:
    bound = (
        run.app.state.settings.redis.auth_cache_ttl_s + 1.0
    )  # the cache's TTL, and a loaded machine's slack
    revoked = new_tenant(run.http, 100)
    assert run.http.post("/v1/chat/completions", json=chat_body(), headers=revoked.auth).status_code == 200
    assert (
        run.http.delete(f"/admin/tenants/{revoked.id}/keys/{revoked.key_id}", headers=ADMIN).status_code
        == 200
    )
    refused_within(run, revoked, 401, bound)
    disabled = new_tenant(run.http, 100)
    assert run.http.post("/v1/chat/completions", json=chat_body(), headers=disabled.auth).status_code == 200
    assert run.http.post(f"/admin/tenants/{disabled.id}/disable", headers=ADMIN).status_code == 200
    refused_within(run, disabled, 403, bound)


def test_a_key_gone_without_an_invalidation_message_is_refused_within_the_cache_ttl(run: Run) -> None:
    """A lost pub/sub message: the key's record leaves Redis with no message (a raw DEL), so only the auth
    cache's TTL (``redis.auth_cache_ttl_s``) bounds how long a replica still answers it from memory."""
    settings = run.app.state.settings
    gone = new_tenant(run.http, 100)
    assert run.http.post("/v1/chat/completions", json=chat_body(), headers=gone.auth).status_code == 200
    with redis.Redis.from_url(settings.redis.url) as store:
        assert store.delete(KeyLayout(settings.redis.key_prefix).api_key(gone.id, gone.key_id)) == 1
    elapsed = refused_within(run, gone, 401, settings.redis.auth_cache_ttl_s + 1.0)
    print(f"refused {elapsed:.2f} s after its record left Redis (TTL {settings.redis.auth_cache_ttl_s} s)")


def test_no_key_material_or_prompt_text_in_logs_metrics_or_answers(run: Run) -> None:
    """Runs last in this module: everything above wrote its lines, answers and metrics by now."""
    # a few more answers that could quote what was sent: errors about the prompt, the key, the body
    too_long = chat_body(messages=[{"role": "user", "content": (PROMPT + " ") * 70}])  # > 512 tokens
    for body in (too_long, chat_body(stop=[PROMPT] * 9), chat_body(n=999), chat_body(temperature=PROMPT)):
        assert run.send("POST", "/v1/chat/completions", json=body, headers=run.a.auth).status_code == 400
    wrong = run.a.key[:-4] + "AAAA"  # the key with its secret changed
    assert (
        run.send(
            "POST", "/v1/chat/completions", json=chat_body(), headers={"Authorization": f"Bearer {wrong}"}
        ).status_code
        == 401
    )
    metrics = run.http.get("/metrics", headers=METRICS)
    assert metrics.status_code == 200 and "radixgate_requests_total" in metrics.text
    logs = run.logs.getvalue()
    assert '"event":"request"' in logs and '"event":"admin_audit"' in logs  # the buffer did get the lines
    secrets = [run.a.key, run.b.key, wrong, ADMIN_TOKEN, METRICS["Authorization"].split()[1]]
    secrets += [key.split(".", 1)[1] for key in (run.a.key, run.b.key)]  # the secret part alone
    traces = "\n".join(span.to_json() for span in run.spans.get_finished_spans())
    assert '"radixgate.tenant.id"' in traces  # the spans were recorded
    sources = [
        ("logs", logs),
        ("metrics", metrics.text),
        ("answers", "\n".join(run.answers)),
        ("traces", traces),
    ]
    for where, text in sources:
        for secret in secrets:
            assert secret not in text, (where, "key material")
        assert "zebra-kumquat" not in text, (where, "prompt text")
