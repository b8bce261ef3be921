"""Stateful sequences over the admin API (issue 31): Hypothesis draws sequences of create, issue a key,
revoke it, disable, enable, delete and re-create a tenant, and use a key, against one gateway on a real
Redis, and checks every answer against a model of what should exist.

Invariants after every step: no answer is a 5xx; each status is the model's (201/409 on create, 404 on
anything about a tenant that is not there, 200/204 otherwise); a key works exactly while its tenant exists
and is enabled and the key is not revoked (else 401, or 403 for a disabled tenant), on the same replica at
once; a tenant deleted and created again does not bring its old keys back.

CI runs 25 sequences of up to 25 steps (derandomized: the same each run); ``pytest -m deep_fuzz`` runs 400.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from service.app import create_app
from service.config.security import SecuritySettings
from tests.conftest import ADMIN_TOKEN, gateway_settings
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NAMES = ("alpha", "beta", "gamma")
"""Few tenant ids, so that sequences reuse them: delete and re-create, keys of a gone tenant."""

_runs = itertools.count()


@dataclass
class Key:
    tenant: str
    key_id: str
    secret: str
    revoked: bool = False
    generation: int = 0  # the tenant's generation it was issued in


@dataclass
class Model:
    tenants: dict[str, bool] = field(default_factory=dict)  # id -> enabled
    generation: dict[str, int] = field(default_factory=dict)  # id -> times created
    keys: list[Key] = field(default_factory=list)

    def key_works(self, key: Key) -> bool:
        return (
            key.tenant in self.tenants
            and self.generation[key.tenant] == key.generation
            and not key.revoked
            and self.tenants[key.tenant]
        )


@pytest.fixture(scope="module")
def gateway(redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]) -> Iterator[str]:
    settings = gateway_settings(redis_url, stub_model_dir, [fake[1]])
    # the sequences use revoked and deleted keys on purpose, hundreds of times from one address: the
    # bad-key throttle (tests/service/api/test_key_guessing.py) would answer them 429 instead of 401/403
    settings = settings.model_copy(update={"security": SecuritySettings(bad_key_rate_per_s=0)})
    with ThreadedServer(create_app(settings)) as server:
        yield server.url


def machine_for(url: str) -> type[RuleBasedStateMachine]:
    class AdminSequences(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.http = httpx.Client(base_url=url, timeout=30)
            self.model = Model()
            self.prefix = f"s{next(_runs)}-"  # each sequence its own tenants

        def teardown(self) -> None:
            for name in list(self.model.tenants):
                self.http.delete(f"/admin/tenants/{self.tid(name)}", headers=ADMIN)
            self.http.close()

        def tid(self, name: str) -> str:
            return self.prefix + name

        def expect(self, resp: httpx.Response, status: int) -> None:
            assert resp.status_code < 500, resp.text
            assert resp.status_code == status, (resp.request.method, resp.request.url.path, resp.text)

        @initialize()
        def start(self) -> None:
            pass

        @rule(name=st.sampled_from(NAMES))
        def create(self, name: str) -> None:
            resp = self.http.post("/admin/tenants", json={"id": self.tid(name), "name": name}, headers=ADMIN)
            if name in self.model.tenants:
                self.expect(resp, 409)
                return
            self.expect(resp, 201)
            self.model.tenants[name] = True
            self.model.generation[name] = self.model.generation.get(name, 0) + 1

        @rule(name=st.sampled_from(NAMES))
        def issue_key(self, name: str) -> None:
            resp = self.http.post(f"/admin/tenants/{self.tid(name)}/keys", json={}, headers=ADMIN)
            if name not in self.model.tenants:
                self.expect(resp, 404)
                return
            self.expect(resp, 201)
            body = resp.json()
            issued = Key(name, body["key_id"], body["api_key"], False, self.model.generation[name])
            self.model.keys.append(issued)

        @rule(data=st.data())
        def revoke_key(self, data: st.DataObject) -> None:
            if not self.model.keys:
                return
            key = data.draw(st.sampled_from(self.model.keys))
            resp = self.http.delete(f"/admin/tenants/{self.tid(key.tenant)}/keys/{key.key_id}", headers=ADMIN)
            live = key.tenant in self.model.tenants and self.model.generation[key.tenant] == key.generation
            if not live:
                self.expect(resp, 404)
                return
            assert resp.status_code in (200, 204), resp.text
            key.revoked = True

        @rule(name=st.sampled_from(NAMES), enable=st.booleans())
        def toggle(self, name: str, enable: bool) -> None:
            action = "enable" if enable else "disable"
            resp = self.http.post(f"/admin/tenants/{self.tid(name)}/{action}", headers=ADMIN)
            if name not in self.model.tenants:
                self.expect(resp, 404)
                return
            self.expect(resp, 200)
            self.model.tenants[name] = enable

        @rule(name=st.sampled_from(NAMES))
        def delete(self, name: str) -> None:
            resp = self.http.delete(f"/admin/tenants/{self.tid(name)}", headers=ADMIN)
            if name not in self.model.tenants:
                self.expect(resp, 404)
                return
            self.expect(resp, 204)
            del self.model.tenants[name]

        @rule(data=st.data())
        def use_key(self, data: st.DataObject) -> None:
            if not self.model.keys:
                return
            key = data.draw(st.sampled_from(self.model.keys))
            resp = self.http.get("/v1/models", headers={"Authorization": f"Bearer {key.secret}"})
            if self.model.key_works(key):
                self.expect(resp, 200)
            else:
                assert resp.status_code in (401, 403), (key, self.model, resp.text)
                disabled = key.tenant in self.model.tenants and not self.model.tenants[key.tenant]
                if resp.status_code == 403:  # only a disabled tenant's own, unrevoked key of today
                    assert disabled and not key.revoked, (key, self.model)

        @invariant()
        def listed_tenants_are_the_models(self) -> None:
            for name in NAMES:
                resp = self.http.get(f"/admin/tenants/{self.tid(name)}", headers=ADMIN)
                self.expect(resp, 200 if name in self.model.tenants else 404)
                if name in self.model.tenants:
                    assert resp.json()["enabled"] is self.model.tenants[name]

    return AdminSequences


def run_sequences(url: str, examples: int) -> None:
    run_state_machine_as_test(
        machine_for(url),
        settings=settings(
            max_examples=examples,
            stateful_step_count=25,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_admin_sequences_keep_the_model(gateway: str) -> None:
    run_sequences(gateway, 25)


@pytest.mark.deep_fuzz
def test_deep_admin_sequences_keep_the_model(gateway: str) -> None:
    run_sequences(gateway, 400)
