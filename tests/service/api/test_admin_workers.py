"""Admin worker management shared by two gateway replicas through Redis."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_api import ADMIN, MODEL, assert_openai_error, auth, chat, new_tenant
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer


def replica(redis_url: str, model_dir: Path) -> ThreadedServer:
    settings = Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": "aw:"},
            "engine": {"served_model_name": MODEL},
            "upstream": {"workers": [], "health_interval_s": 0.1},
            "api": {"tokenizer_path": str(model_dir)},
        }
    )
    return ThreadedServer(create_app(settings))


@pytest.fixture
def replicas(redis_url: str, stub_model_dir: Path) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    with (
        replica(redis_url, stub_model_dir) as r1,
        replica(redis_url, stub_model_dir) as r2,
        httpx.Client(base_url=r1.url, timeout=30) as c1,
        httpx.Client(base_url=r2.url, timeout=30) as c2,
    ):
        yield c1, c2


def wait_for(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def workers(http: httpx.Client) -> list[dict[str, object]]:
    data: list[dict[str, object]] = http.get("/admin/workers", headers=ADMIN).json()["data"]
    return data


def test_add_drain_remove_a_worker_across_replicas(replicas: tuple[httpx.Client, httpx.Client]) -> None:
    r1, r2 = replicas
    fake = FakeWorker()
    with ThreadedServer(fake.app) as server:
        assert_openai_error(r1.post("/admin/workers", json={"url": "not a url"}, headers=ADMIN), 400)
        added = r1.post("/admin/workers", json={"url": server.url}, headers=ADMIN)
        assert added.status_code == 201
        wid = added.json()["id"]
        # the other replica picks it up from Redis and probes it healthy
        wait_for(lambda: any(w["id"] == wid and w["healthy"] for w in workers(r2)))
        _, key = new_tenant(r2)
        assert r2.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)).status_code == 200
        assert len(fake.received) == 1
        assert f'radixgate_worker_healthy{{worker="{server.url}"}} 1.0' in r2.get("/metrics").text
        assert r1.post(f"/admin/workers/{wid}/drain", headers=ADMIN).json()["mode"] == "draining"
        wait_for(lambda: not any(w["id"] == wid and w["in_pool"] for w in workers(r2)))
        assert_openai_error(r2.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)), 503)
        assert len(fake.received) == 1  # drained: no new traffic
        assert r1.delete(f"/admin/workers/{wid}", headers=ADMIN).status_code == 204
        wait_for(lambda: workers(r2) == [])
        # a removed worker's gauges leave /metrics on every replica (a stale worker_healthy 0 would keep an
        # alert firing forever); its counters stay
        for replica_http in (r1, r2):
            gauges = [
                line
                for line in replica_http.get("/metrics").text.splitlines()
                if server.url in line and line.startswith(("radixgate_worker_healthy", "radixgate_worker_in"))
            ]
            assert gauges == []
        assert_openai_error(r1.delete(f"/admin/workers/{wid}", headers=ADMIN), 404, "worker_not_found")
        assert_openai_error(r1.get("/admin/workers", headers=auth(key)), 403)


@pytest.mark.parametrize(
    "url",
    [
        "http://user:secret@10.0.0.5:30000",  # credentials would show in /metrics labels (no auth) and logs
        "http://10.0.0.5:30000/?token=secret",
        "http://10.0.0.5:30000/#frag",
    ],
)
def test_worker_urls_carry_no_credentials_query_or_fragment(
    replicas: tuple[httpx.Client, httpx.Client], url: str
) -> None:
    r1, _ = replicas
    err = assert_openai_error(r1.post("/admin/workers", json={"url": url}, headers=ADMIN), 400)
    assert err["param"] == "url" and "secret" not in err["message"]
    assert workers(r1) == []


def settings_replica(redis_url: str, model_dir: Path, prefix: str, workers: list[str]) -> ThreadedServer:
    settings = Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": prefix},
            "engine": {"served_model_name": MODEL},
            "upstream": {"workers": workers, "health_interval_s": 0.1},
            "api": {"tokenizer_path": str(model_dir)},
        }
    )
    return ThreadedServer(create_app(settings))


def test_a_worker_from_the_settings_is_drained_on_every_replica_and_never_removed(
    redis_url: str, stub_model_dir: Path
) -> None:
    """Workers listed in settings are shared through the registry like admin-added ones (issue 29): a
    drain on one replica reaches the others within a sync period, ``POST /admin/workers`` makes it active
    again everywhere, and it cannot be removed (the next sync would register it again)."""
    fake = FakeWorker()
    with ThreadedServer(fake.app) as upstream:
        url = upstream.url.rstrip("/")
        with (
            settings_replica(redis_url, stub_model_dir, "aw-settings:", [url]) as g1,
            settings_replica(redis_url, stub_model_dir, "aw-settings:", [url]) as g2,
            settings_replica(redis_url, stub_model_dir, "aw-settings:", []) as g3,  # does not list it
            httpx.Client(base_url=g1.url, timeout=30) as r1,
            httpx.Client(base_url=g2.url, timeout=30) as r2,
            httpx.Client(base_url=g3.url, timeout=30) as r3,
        ):
            (listed,) = workers(r1)
            assert listed["url"] == url and listed["source"] == "settings" and listed["mode"] == "active"
            _, key = new_tenant(r1)
            for http in (r1, r2):
                wait_for(lambda http=http: any(w["healthy"] for w in workers(http)))
                assert (
                    http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)).status_code
                    == 200
                )
            assert len(fake.received) == 2
            # the third replica sees the entry but does not serve a worker only other replicas' settings list
            (seen,) = workers(r3)
            assert seen["source"] == "settings" and not seen["in_pool"]
            # drained over one replica: every replica that serves it stops within a sync period
            assert r1.post(f"/admin/workers/{listed['id']}/drain", headers=ADMIN).json()["mode"] == "draining"
            for http in (r1, r2):
                wait_for(lambda http=http: not any(w["in_pool"] for w in workers(http)))
                assert workers(http)[0]["mode"] == "draining"
                assert_openai_error(
                    http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)), 503
                )
            assert len(fake.received) == 2  # no new traffic
            # never removed over the admin API: a replica's next sync would register it again
            err = assert_openai_error(r2.delete(f"/admin/workers/{listed['id']}", headers=ADMIN), 409)
            assert err["code"] == "worker_exists" and "drain" in err["message"]
            # made active again over one replica: every replica that lists it serves it again
            again = r2.post("/admin/workers", json={"url": url}, headers=ADMIN)
            assert again.status_code == 201 and again.json()["mode"] == "active"
            for http in (r1, r2):
                wait_for(lambda http=http: any(w["in_pool"] and w["healthy"] for w in workers(http)))
                assert (
                    http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)).status_code
                    == 200
                )
                assert workers(http)[0]["source"] == "settings"
            assert len(fake.received) == 4
            assert not workers(r3)[0]["in_pool"]
            # an admin-added worker may still be registered (and registered again) as before
            other = "http://127.0.0.1:9"
            assert r1.post("/admin/workers", json={"url": other}, headers=ADMIN).status_code == 201
            assert r1.post("/admin/workers", json={"url": other}, headers=ADMIN).status_code == 201
            assert {w["url"]: w["source"] for w in workers(r1)} == {url: "settings", other: "admin"}


@pytest.mark.parametrize(
    "body",
    [
        {"url": "http://10.0.0.5:30000", "mode": "draining"},  # looks honoured, but the worker came up active
        {"url": "http://10.0.0.5:30000", "weight": 2},
        {"url": 30000},  # strict, as every admin body: not coerced to anything
    ],
)
def test_a_worker_body_with_unknown_or_mistyped_fields_is_refused(
    replicas: tuple[httpx.Client, httpx.Client], body: dict[str, object]
) -> None:
    """``POST /admin/workers`` refuses what it does not serve, as the tenant admin bodies do: an unknown
    field was silently ignored, so ``"mode": "draining"`` answered 201 and registered an active worker."""
    r1, _ = replicas
    err = assert_openai_error(r1.post("/admin/workers", json=body, headers=ADMIN), 400)
    assert err["param"] in {"mode", "weight", "url"}
    assert workers(r1) == []
