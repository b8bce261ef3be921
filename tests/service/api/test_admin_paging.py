"""Paging of the admin lists (issue 25, item 10): tenants, a tenant's keys and workers, each with a bounded
``limit`` (default 100, at most 1000, refused outside) and an ``after`` cursor under which every item that
exists throughout a listing is listed exactly once, with items added and removed between pages. Against a
real Redis, with the gateway in front of the fake worker (conftest ``gateway``, a key prefix of its own)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from tests.service.api.test_api import ADMIN, assert_openai_error
from tests.support.fake_worker import FakeWorker
from tests.support.servers import free_port

_ids = itertools.count()
DEFAULT_PAGE, MAX_PAGE = 100, 1000  # the documented bounds (README, service/api/paging.py)


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


def tenant(http: httpx.Client, prefix: str = "pg") -> str:
    tenant_id = f"{prefix}{next(_ids):04d}"
    assert http.post("/admin/tenants", json={"id": tenant_id, "name": "p"}, headers=ADMIN).status_code == 201
    return tenant_id


def key(http: httpx.Client, tenant_id: str) -> str:
    issued = http.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "k"}, headers=ADMIN)
    assert issued.status_code == 201, issued.text
    key_id: str = issued.json()["key_id"]
    return key_id


def page(http: httpx.Client, path: str, **params: Any) -> dict[str, Any]:
    resp = http.get(path, params=params, headers=ADMIN)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    assert set(body) == {"object", "data", "first_id", "last_id", "has_more"} and body["object"] == "list"
    return body


def all_ids(http: httpx.Client, path: str, id_field: str) -> list[str]:
    ids: list[str] = []
    after = None
    while True:
        body = page(http, path, limit=MAX_PAGE, **({"after": after} if after else {}))
        ids += [item[id_field] for item in body["data"]]
        if not body["has_more"]:
            return ids
        after = body["last_id"]


def walk(
    http: httpx.Client, path: str, id_field: str, limit: int, between: Any = None
) -> tuple[list[str], int]:
    """Page through ``path`` ``limit`` at a time, calling ``between(page number)`` after each page; the
    ids seen in order and the number of pages."""
    seen: list[str] = []
    after, pages = None, 0
    while True:
        body = page(http, path, limit=limit, **({"after": after} if after else {}))
        pages += 1
        ids = [item[id_field] for item in body["data"]]
        assert len(ids) <= limit
        if ids:
            assert (body["first_id"], body["last_id"]) == (ids[0], ids[-1])
        else:
            assert body["first_id"] is None and body["last_id"] is None
        seen += ids
        if not body["has_more"]:
            return seen, pages
        assert ids, "has_more with an empty page"
        after = body["last_id"]
        if between is not None:
            between(pages)


def test_tenants_are_paged_with_a_default_and_each_listed_once_under_changes(http: httpx.Client) -> None:
    for _ in range(DEFAULT_PAGE + 3):
        tenant(http)
    first = page(http, "/admin/tenants")
    assert len(first["data"]) == DEFAULT_PAGE and first["has_more"] is True  # bounded without a limit
    everything = all_ids(http, "/admin/tenants", "id")
    assert everything == sorted(everything) and len(everything) == len(set(everything)) >= DEFAULT_PAGE + 3
    gone = {everything[5], everything[-2]}  # one already seen by then, one not yet
    added: list[str] = []

    def between(n: int) -> None:
        if n == 3:
            for tenant_id in gone:
                assert http.delete(f"/admin/tenants/{tenant_id}", headers=ADMIN).status_code == 204
            added.extend([tenant(http, "aa"), tenant(http, "zz")])  # before and after every cursor

    seen, pages = walk(http, "/admin/tenants", "id", 7, between)
    assert pages > 3 and len(seen) == len(set(seen)) and seen == sorted(seen)
    throughout = [t for t in everything if t not in gone]
    assert [t for t in seen if t in set(everything)] == [t for t in everything if t in set(seen)]
    assert set(throughout) <= set(seen) and set(seen) <= set(everything) | set(added)
    assert everything[5] in seen and everything[-2] not in seen  # removed after / before its page
    assert added[0] not in seen and added[1] in seen  # added before the cursor / after it
    past_the_end = page(http, "/admin/tenants", after=seen[-1])
    assert past_the_end["data"] == [] and past_the_end["has_more"] is False


def test_a_tenants_keys_are_paged_oldest_first_each_once_and_only_its_own(http: httpx.Client) -> None:
    owner, other = tenant(http), tenant(http)
    issued = [key(http, owner) for _ in range(DEFAULT_PAGE + 2)]
    foreign = key(http, other)
    first = page(http, f"/admin/tenants/{owner}/keys")
    assert len(first["data"]) == DEFAULT_PAGE and first["has_more"] is True
    assert [k["key_id"] for k in first["data"]] == issued[:DEFAULT_PAGE]  # oldest first
    assert all(k["tenant_id"] == owner and "digest" not in k for k in first["data"])
    later: list[str] = []

    def between(n: int) -> None:
        later.append(key(http, owner))  # a key issued during the listing goes after every cursor

    seen, pages = walk(http, f"/admin/tenants/{owner}/keys", "key_id", 9, between)
    assert pages > 10
    assert seen[: len(issued)] == issued and seen[len(issued) :] == later[: len(seen) - len(issued)]
    assert len(seen) == len(set(seen)) and foreign not in seen
    assert all_ids(http, f"/admin/tenants/{other}/keys", "key_id") == [foreign]
    # another tenant's key, or none, is no cursor
    for after in (foreign, "0123456789ab", "x" * 40):
        resp = http.get(f"/admin/tenants/{owner}/keys", params={"after": after}, headers=ADMIN)
        assert assert_openai_error(resp, 400, "invalid_value")["param"] == "after"
    assert_openai_error(http.get("/admin/tenants/nobody/keys", headers=ADMIN), 404, "tenant_not_found")
    # revoked keys stay listed (kept for audit), in their place
    assert http.delete(f"/admin/tenants/{owner}/keys/{issued[3]}", headers=ADMIN).status_code == 200
    again = page(http, f"/admin/tenants/{owner}/keys", limit=5)["data"]
    assert [k["key_id"] for k in again] == issued[:5] and again[3]["revoked"] is True


def test_keys_issued_before_the_time_index_are_listed_in_their_order(
    http: httpx.Client, redis_url: str, gateway: str
) -> None:
    """A store written before the sorted set existed (only the key-id set): the first listing indexes
    the keys by the time in their records, in the order they were issued."""
    owner = tenant(http)
    issued = [key(http, owner) for _ in range(6)]
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        (index,) = [str(k) for k in client.scan_iter(match=f"*{{{owner}}}:keys_by_time")]
        client.delete(index)
        assert walk(http, f"/admin/tenants/{owner}/keys", "key_id", 4)[0] == issued
        assert client.zcard(index) == 6
        assert http.delete(f"/admin/tenants/{owner}", headers=ADMIN).status_code == 204
        assert list(client.scan_iter(match=f"*{owner}*")) == []  # the delete takes the index too
    finally:
        client.close()


def test_workers_are_paged_in_id_order(http: httpx.Client, fake: tuple[FakeWorker, str]) -> None:
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(5)]
    try:
        for url in urls:
            assert http.post("/admin/workers", json={"url": url}, headers=ADMIN).status_code == 201
        everything = page(http, "/admin/workers")["data"]
        ids = [w["id"] for w in everything]
        assert ids == sorted(ids) and {w["url"] for w in everything} == {*urls, fake[1]}
        seen, pages = walk(http, "/admin/workers", "id", 2)
        assert seen == ids and pages == 3
        removed = next(w["id"] for w in everything[:2] if w["url"] != fake[1])  # one on the first page

        def between(n: int) -> None:
            if n == 1:
                assert http.delete(f"/admin/workers/{removed}", headers=ADMIN).status_code == 204

        assert walk(http, "/admin/workers", "id", 2, between)[0] == ids  # its page was already read
    finally:
        for url in urls:
            wid = next((w["id"] for w in page(http, "/admin/workers")["data"] if w["url"] == url), None)
            if wid is not None:
                http.delete(f"/admin/workers/{wid}", headers=ADMIN)


@pytest.mark.parametrize("path", ["/admin/tenants", "/admin/tenants/{t}/keys", "/admin/workers"])
def test_page_bounds_are_refused_not_clamped(http: httpx.Client, path: str) -> None:
    path = path.format(t=tenant(http))
    bounds: list[dict[str, Any]] = [{"limit": 0}, {"limit": MAX_PAGE + 1}, {"limit": "many"}, {"limit": -1}]
    for bad in [*bounds, {"after": "x" * 300}]:
        err = assert_openai_error(http.get(path, params=bad, headers=ADMIN), 400, "invalid_value")
        assert err["param"] in ("query.limit", "query.after")
    assert page(http, path, limit=MAX_PAGE)["has_more"] is False
    assert len(page(http, path, limit=1)["data"]) <= 1
