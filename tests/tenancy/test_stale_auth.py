"""Authentication from memory while Redis is out of reach (tenancy/stale_auth.py), on a fake clock."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tenancy.keys import generate_key, key_digest
from tenancy.models import ApiKeyRecord, Tenant
from tenancy.stale_auth import StaleKeys

PEPPER = b"pepper"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def issued(tenant_id: str = "t") -> tuple[str, Tenant, ApiKeyRecord]:
    parsed = generate_key()
    tenant = Tenant(id=tenant_id, name=tenant_id, priority_class="standard")
    record = ApiKeyRecord(key_id=parsed.key_id, tenant_id=tenant_id, digest=key_digest(parsed.full, PEPPER))
    return parsed.full, tenant, record


def wrong_secret(key: str) -> str:
    return key[:-1] + ("A" if key[-1] != "A" else "B")


Step = Callable[[StaleKeys, Clock, str], None]

CASES: list[tuple[str, Step, str]] = [
    ("just remembered", lambda s, c, k: None, "accepted"),
    ("within the bound", lambda s, c, k: setattr(c, "now", c.now + 60), "accepted"),
    ("past the bound", lambda s, c, k: setattr(c, "now", c.now + 61), "unknown"),
    ("a revocation heard", lambda s, c, k: s.apply(f"key:{k[3:15]}"), "refused"),
    ("its tenant changed", lambda s, c, k: s.apply("tenant:t"), "unknown"),
    ("another tenant changed", lambda s, c, k: s.apply("tenant:u"), "accepted"),
    ("Redis refused this very key", lambda s, c, k: s.refused_by_redis(k), "refused"),
    (
        "Redis refused a wrong secret of its id",
        lambda s, c, k: s.refused_by_redis(wrong_secret(k)),
        "accepted",
    ),
    ("an unrelated message", lambda s, c, k: s.apply("budget:t"), "accepted"),
]


@pytest.mark.parametrize(("name", "step", "answer"), CASES, ids=[c[0] for c in CASES])
def test_a_key_remembered_then(name: str, step: Step, answer: str) -> None:
    clock = Clock()
    keys = StaleKeys(60, 100, PEPPER, clock)
    key, tenant, record = issued()
    keys.remember(key, tenant, record)
    step(keys, clock, key)
    found = keys.lookup(key)
    assert (found if isinstance(found, str) else "accepted") == answer
    if answer == "accepted":
        assert found == (tenant, record)


def test_wrong_secrets_and_malformed_keys_are_refused_and_unseen_keys_unknown() -> None:
    keys = StaleKeys(60, 100, PEPPER, Clock())
    key, tenant, record = issued()
    keys.remember(key, tenant, record)
    assert keys.lookup(wrong_secret(key)) == "refused"
    assert keys.lookup("not-a-key") == "refused"
    assert keys.lookup(issued()[0]) == "unknown"


def test_a_presented_key_other_than_the_one_entered_is_checked_by_its_digest() -> None:
    keys = StaleKeys(60, 100, PEPPER, Clock())
    key, tenant, record = issued()
    keys.remember(key, tenant, record)
    assert keys.lookup(f"  {key}") == (tenant, record)  # parsed: the same key


def test_a_revoked_key_stays_refused_for_the_bound_then_is_unknown() -> None:
    clock = Clock()
    keys = StaleKeys(60, 100, PEPPER, clock)
    key, tenant, record = issued()
    keys.remember(key, tenant, record)
    keys.revoked(record.key_id)
    clock.now += 60
    assert keys.lookup(key) == "refused"
    clock.now += 1
    assert keys.lookup(key) == "unknown"


def test_bounded_and_off() -> None:
    clock = Clock()
    keys = StaleKeys(60, 2, PEPPER, clock)
    entries = [issued() for _ in range(3)]
    for key, tenant, record in entries:
        keys.remember(key, tenant, record)
    assert len(keys) == 2 and keys.lookup(entries[0][0]) == "unknown"  # the oldest dropped
    off = StaleKeys(0, 10, PEPPER, clock)
    off.remember(*entries[0])
    assert off.lookup(entries[0][0]) == "unknown" and len(off) == 0
