"""Renamed priority classes and stored tenants (issue 25, item 8): the default class is a setting; a tenant
stored with a class that is no longer configured is reported at startup and served at the default class
(never a 400 blamed on a ``priority`` the client did not send); only a class the request names is its error.

Real Redis, the fake worker; a first gateway with the default classes stores the tenants, a second one with
renamed classes serves them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs
from typer.testing import CliRunner

from service import __main__ as service_main
from service.__main__ import cli
from service.app import create_app
from service.config.settings import Settings
from tests.service.api.test_api import ADMIN, assert_openai_error, auth, chat
from tests.support.fake_worker import FakeWorker, served_fake_worker
from tests.support.gateway import fake_worker_settings
from tests.support.servers import ThreadedServer

PREFIX = "dflt:"


def band(rank: int, sglang_priority: int) -> dict[str, Any]:
    return {"rank": rank, "sglang_priority": sglang_priority, "ttft_goal_ms": 60_000}


RENAMED = {"gold": band(2, 20), "silver": band(1, 15), "batch": band(0, 0)}
"""``interactive`` and ``standard`` are gone; ``batch`` stays."""


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWorker]:
    with served_fake_worker() as worker:
        yield worker


@pytest.fixture(scope="module")
def stored(redis_url: str, stub_model_dir: Path, fake: FakeWorker) -> dict[str, str]:
    """Tenants stored under the default classes; tenant id -> API key."""
    settings = fake_worker_settings(redis_url, stub_model_dir, fake.url, PREFIX)
    specs = {
        "old": {},  # standard, highest standard
        "wide": {"priority_class": "standard", "max_priority_class": "interactive"},
        "lowmax": {"priority_class": "batch", "max_priority_class": "interactive"},
    }
    keys = {}
    with ThreadedServer(create_app(settings)) as server, httpx.Client(base_url=server.url) as http:
        for tenant_id, spec in specs.items():
            http.delete(f"/admin/tenants/{tenant_id}", headers=ADMIN)  # a rerun on the same Redis
            assert (
                http.post(
                    "/admin/tenants", json={"id": tenant_id, "name": tenant_id, **spec}, headers=ADMIN
                ).status_code
                == 201
            )
            keys[tenant_id] = http.post(f"/admin/tenants/{tenant_id}/keys", json={}, headers=ADMIN).json()[
                "api_key"
            ]
        assert http.get("/admin/tenants/old", headers=ADMIN).json()["priority_class"] == "standard"
    return keys


@pytest.fixture(scope="module")
def renamed(
    redis_url: str, stub_model_dir: Path, fake: FakeWorker, stored: dict[str, str]
) -> Iterator[tuple[httpx.Client, list[dict[str, Any]]]]:
    """A gateway whose classes are gold > silver > batch (default silver) on the same Redis, and the log
    lines it wrote."""
    settings = fake_worker_settings(
        redis_url,
        stub_model_dir,
        fake.url,
        PREFIX,
        priority_classes=RENAMED,
        default_priority_class="silver",
    )
    app = create_app(settings)  # configures logging: capture after it
    with (
        capture_logs() as logs,
        ThreadedServer(app) as server,
        httpx.Client(base_url=server.url, timeout=10) as http,
    ):
        yield http, logs


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [line for line in logs if line.get("event") == name]


def sent_priority(fake: FakeWorker, resp: httpx.Response) -> int:
    rid = resp.headers["x-request-id"]
    return int(next(b for b in reversed(fake.received) if b["rid"] == rid)["priority"])


def test_stored_tenants_with_removed_classes_are_reported_at_startup(
    renamed: tuple[httpx.Client, list[dict[str, Any]]],
) -> None:
    _, logs = renamed
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not events(logs, "tenant_classes_unknown"):
        time.sleep(0.05)
    report = {(e["stored_class"], e["field"]): e for e in events(logs, "tenant_classes_unknown")}
    assert set(report) == {("standard", "priority_class"), ("interactive", "max_priority_class")}
    assert sorted(report["standard", "priority_class"]["sample"]) == ["old", "wide"]
    assert report["standard", "priority_class"]["replaced_by"] == "silver"
    assert sorted(report["interactive", "max_priority_class"]["sample"]) == ["lowmax", "wide"]


def test_a_tenant_whose_class_is_gone_is_served_at_the_default_class(
    renamed: tuple[httpx.Client, list[dict[str, Any]]], fake: FakeWorker, stored: dict[str, str]
) -> None:
    """Every request got 400 invalid_priority with param "priority", which the client never sent."""
    http, logs = renamed
    for _ in range(2):
        resp = http.post("/v1/chat/completions", json=chat(max_tokens=2), headers=auth(stored["old"]))
        assert resp.status_code == 200, resp.text
        assert sent_priority(fake, resp) == RENAMED["silver"]["sglang_priority"]
    lines = [e for e in events(logs, "tenant_class_unknown") if e["tenant"] == "old"]
    assert len(lines) == 1  # once per tenant, not per request
    assert lines[0]["stored_class"] == "standard" and lines[0]["served_class"] == "silver"


def test_a_class_the_request_names_is_still_checked(
    renamed: tuple[httpx.Client, list[dict[str, Any]]], stored: dict[str, str]
) -> None:
    http, _ = renamed
    unknown = http.post(
        "/v1/chat/completions", json=chat(max_tokens=2, priority="standard"), headers=auth(stored["old"])
    )
    assert assert_openai_error(unknown, 400, "invalid_priority")["param"] == "priority"
    # a removed highest class is no ceiling to climb to: the tenant stays at its own class
    above = http.post(
        "/v1/chat/completions", json=chat(max_tokens=2, priority="gold"), headers=auth(stored["wide"])
    )
    assert_openai_error(above, 403, "priority_not_allowed")
    lowmax = http.post(
        "/v1/chat/completions", json=chat(max_tokens=2, priority="silver"), headers=auth(stored["lowmax"])
    )
    assert_openai_error(lowmax, 403, "priority_not_allowed")
    own = http.post(
        "/v1/chat/completions", json=chat(max_tokens=2, priority="batch"), headers=auth(stored["lowmax"])
    )
    assert own.status_code == 200, own.text


def test_a_tenant_created_without_a_class_gets_the_default_setting(
    renamed: tuple[httpx.Client, list[dict[str, Any]]],
) -> None:
    """It failed with 400: 'standard' was the hard-coded default."""
    http, _ = renamed
    http.delete("/admin/tenants/fresh", headers=ADMIN)
    resp = http.post("/admin/tenants", json={"id": "fresh", "name": "f"}, headers=ADMIN)
    assert resp.status_code == 201, resp.text
    assert resp.json()["priority_class"] == "silver" and resp.json()["max_priority_class"] == "silver"
    above = http.post(
        "/admin/tenants",
        json={"id": "fresh2", "name": "f", "max_priority_class": "batch"},
        headers=ADMIN,
    )
    assert assert_openai_error(above, 400, "invalid_priority")["param"] == "max_priority_class"


def test_patching_another_field_of_a_stale_tenant_does_not_fail_on_its_class(
    renamed: tuple[httpx.Client, list[dict[str, Any]]], stored: dict[str, str]
) -> None:
    http, _ = renamed
    resp = http.patch("/admin/tenants/old", json={"name": "renamed"}, headers=ADMIN)
    assert resp.status_code == 200, resp.text
    named = http.patch("/admin/tenants/old", json={"priority_class": "standard"}, headers=ADMIN)
    assert assert_openai_error(named, 400, "invalid_priority")["param"] == "priority_class"
    fixed = http.patch("/admin/tenants/old", json={"priority_class": "batch"}, headers=ADMIN)
    assert fixed.status_code == 200, fixed.text
    assert fixed.json()["priority_class"] == "batch"


def test_the_default_class_must_be_configured() -> None:
    with pytest.raises(ValidationError, match="'standard' is not a configured priority class"):
        Settings.model_validate({"priority_classes": RENAMED})
    assert Settings.model_validate({"priority_classes": RENAMED, "default_priority_class": "gold"})


def test_renamed_classes_without_a_default_stop_serve_with_one_line(
    monkeypatch: pytest.MonkeyPatch, stub_model_dir: Path
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the gateway started with a default class that is not configured")

    monkeypatch.setattr(service_main, "serve_one", refuse)
    monkeypatch.setenv("RADIXGATE_API__TOKENIZER_PATH", str(stub_model_dir))
    monkeypatch.setenv(
        "RADIXGATE_PRIORITY_CLASSES", '{"gold": {"rank": 1, "sglang_priority": 1, "ttft_goal_ms": 9}}'
    )
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("invalid setting RADIXGATE_DEFAULT_PRIORITY_CLASS: 'standard' is not"), (
        result.output
    )
