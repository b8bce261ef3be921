"""The admin audit log (issue 31): every request to ``/admin`` writes exactly one ``admin_audit`` line with
who (the admin token's id, never the token), the action, its target, the status answered and when. The table
below walks every mutating admin route the app has (read from the app's OpenAPI document: a route added
later fails the coverage check until it has a row)."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from fastapi import FastAPI
from structlog.testing import capture_logs

from service.api.admin_audit import AdminAuditLog
from service.app import create_app
from service.observability.logs import configure_logging
from service.workers.registry import worker_id
from tests.conftest import ADMIN_TOKEN, MODEL, gateway_settings
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ADMIN_ID = "sha256:" + hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest()[:12]
MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
_ids = itertools.count()


@dataclass
class Gateway:
    app: FastAPI
    http: httpx.Client
    spare_worker: str  # a worker URL the settings do not list (registered and removed by the table)
    ids: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def gw(redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]) -> Iterator[Gateway]:
    app = create_app(gateway_settings(redis_url, stub_model_dir, [fake[1]]))
    with (
        ThreadedServer(FakeWorker().app) as spare,
        ThreadedServer(app) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        yield Gateway(app, http, spare.url)


def mutating_admin_routes(app: FastAPI) -> set[tuple[str, str]]:
    """(method, path template) of every admin route that changes something, from the app's OpenAPI document
    (every route of the app is in it: none is declared with include_in_schema=False)."""
    return {
        (method.upper(), path)
        for path, operations in app.openapi()["paths"].items()
        if path.startswith("/admin")
        for method in operations
        if method.upper() in MUTATING
    }


@dataclass(frozen=True)
class Step:
    method: str
    route: str
    body: dict[str, Any] | None
    status: int
    action: str


# in order: each step may use what an earlier one created ({tenant}, {key}, {wid})
STEPS = [
    Step("POST", "/admin/tenants", {"id": "{tenant}", "name": "audited"}, 201, "create_tenant"),
    Step("PATCH", "/admin/tenants/{tenant_id}", {"name": "renamed"}, 200, "update_tenant"),
    Step("PUT", "/admin/tenants/{tenant_id}/quotas", {"requests_per_min": 60}, 200, "set_quotas"),
    Step("POST", "/admin/tenants/{tenant_id}/disable", None, 200, "disable_tenant"),
    Step("POST", "/admin/tenants/{tenant_id}/enable", None, 200, "enable_tenant"),
    Step("POST", "/admin/tenants/{tenant_id}/keys", {"name": "k"}, 201, "issue_key"),
    Step("PATCH", "/admin/tenants/{tenant_id}/keys/{key_id}", {"name": "k2"}, 200, "update_key"),
    Step(
        "PUT",
        "/admin/tenants/{tenant_id}/budget",
        {"period": "day", "hard_limit_usd": 5},
        200,
        "set_tenant_budget",
    ),
    Step("DELETE", "/admin/tenants/{tenant_id}/budget", None, 200, "clear_tenant_budget"),
    Step(
        "PUT",
        "/admin/tenants/{tenant_id}/keys/{key_id}/budget",
        {"period": "month", "soft_limit_usd": 1},
        200,
        "set_key_budget",
    ),
    Step("DELETE", "/admin/tenants/{tenant_id}/keys/{key_id}/budget", None, 200, "clear_key_budget"),
    Step("PUT", "/admin/prices/{model}", {"input_per_mtok": 1, "output_per_mtok": 2}, 200, "set_price"),
    Step("DELETE", "/admin/prices/{model}", None, 200, "clear_price"),
    Step("DELETE", "/admin/tenants/{tenant_id}/keys/{key_id}", None, 200, "revoke_key"),
    Step("DELETE", "/admin/tenants/{tenant_id}", None, 204, "delete_tenant"),
    Step("POST", "/admin/workers", {"url": "{spare}"}, 201, "add_worker"),
    Step("POST", "/admin/workers/{wid}/drain", None, 200, "drain_worker"),
    Step("DELETE", "/admin/workers/{wid}", None, 204, "remove_worker"),
]


def audit_lines(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in logs if line["event"] == "admin_audit"]


def test_the_table_covers_every_mutating_admin_route(gw: Gateway) -> None:
    assert {(s.method, s.route) for s in STEPS} == mutating_admin_routes(gw.app)


def test_every_mutating_admin_action_writes_exactly_one_audit_line(gw: Gateway) -> None:
    tenant = f"aud{next(_ids)}"
    params = {"tenant_id": tenant, "wid": worker_id(gw.spare_worker), "model": MODEL}
    fill = {"{tenant}": tenant, "{spare}": gw.spare_worker}
    for step in STEPS:
        path = step.route.format(**params)
        body = {k: fill.get(v, v) if isinstance(v, str) else v for k, v in (step.body or {}).items()}
        with capture_logs() as logs:
            resp = gw.http.request(
                step.method, path, json=body if step.body is not None else None, headers=ADMIN
            )
        assert resp.status_code == step.status, (step, resp.text)
        (line,) = audit_lines(logs)  # exactly one
        assert line["who"] == ADMIN_ID and line["action"] == step.action, line
        assert (line["method"], line["path"], line["status"]) == (step.method, path, step.status)
        assert line["request_id"] == resp.headers["x-request-id"]
        assert line["duration_ms"] >= 0
        named = {k: v for k, v in params.items() if "{" + k + "}" in step.route}
        assert {k: v for k, v in line["target"].items() if k != "created"} == named
        if step.action == "create_tenant":
            assert line["target"]["created"] == tenant
        if step.action == "issue_key":
            params["key_id"] = resp.json()["key_id"]
            assert line["target"]["created"] == params["key_id"]
            assert resp.json()["api_key"] not in str(logs)  # the issued key is never logged
        assert ADMIN_TOKEN not in str(logs)


@pytest.mark.parametrize(
    ("headers", "who", "status"),
    [
        ({}, "none", 401),
        ({"Authorization": "Bearer some-other-token-0000"}, "invalid", 403),
        (ADMIN, ADMIN_ID, 404),
    ],
)
def test_refusals_are_audited_too(gw: Gateway, headers: dict[str, str], who: str, status: int) -> None:
    with capture_logs() as logs:
        resp = gw.http.delete("/admin/tenants/no-such-tenant", headers=headers)
    assert resp.status_code == status
    (line,) = audit_lines(logs)
    assert (line["who"], line["action"], line["status"]) == (who, "delete_tenant", status)
    assert line["target"] == {"tenant_id": "no-such-tenant"}
    assert "some-other-token" not in str(logs)


def test_reads_are_audited_and_other_paths_are_not(gw: Gateway) -> None:
    with capture_logs() as logs:
        assert gw.http.get("/admin/tenants", headers=ADMIN).status_code == 200
        assert gw.http.get("/admin/planner", headers=ADMIN).status_code in (200, 404)
        assert gw.http.get("/metrics").status_code == 200
        assert gw.http.get("/healthz").status_code == 200
    lines = audit_lines(logs)
    assert [line["action"] for line in lines] == ["list_tenants", "planner_decisions"]


async def test_the_line_as_written_has_the_time_and_never_the_token() -> None:
    """The JSON line itself (the app's logging set up as `serve` sets it): a UTC timestamp, the token's id."""

    async def created(scope: Any, receive: Any, send: Any) -> None:
        scope["path_params"] = {"tenant_id": "acme"}
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"key_id": "k1", "api_key": "rg-secret"}'})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        pass

    out = io.StringIO()
    saved, handlers = structlog.get_config(), logging.getLogger().handlers[:]
    configure_logging("INFO", out)
    try:
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/admin/tenants/acme/keys",
            "headers": [(b"authorization", f"Bearer {ADMIN_TOKEN}".encode())],
            "query_string": b"",
        }
        await AdminAuditLog(created, ADMIN_TOKEN)(scope, receive, send)
    finally:  # the logging set up before, as it was
        structlog.configure(**saved)
        logging.getLogger().handlers = handlers
    (line,) = [json.loads(text) for text in out.getvalue().splitlines()]
    assert line["event"] == "admin_audit" and line["who"] == ADMIN_ID and line["status"] == 201
    assert line["target"] == {"tenant_id": "acme", "created": "k1"} and line["action"] == "unmatched"
    assert line["timestamp"].endswith("Z") and datetime.fromisoformat(line["timestamp"]).tzinfo is not None
    assert ADMIN_TOKEN not in out.getvalue() and "rg-secret" not in out.getvalue()


async def test_a_crash_is_one_line_with_status_500() -> None:
    async def crashing(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        pass

    scope = {"type": "http", "method": "DELETE", "path": "/admin/x", "headers": [], "query_string": b""}
    with capture_logs() as logs, pytest.raises(RuntimeError):
        await AdminAuditLog(crashing, ADMIN_TOKEN)(scope, receive, send)
    (line,) = audit_lines(logs)
    assert (line["status"], line["who"]) == (500, "none")
