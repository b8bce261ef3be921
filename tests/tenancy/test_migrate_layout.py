"""Keys of the layout before hash tags, moved by ``python -m service migrate-keys``
(tenancy/migrate_layout.py): in place on one Redis, and from one Redis into a Redis Cluster; afterwards the
stores read them as if written by the current layout (the old API key authenticates, usage and buckets are
kept with their expiry, the tenant lists and deletes whole)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import orjson
import redis
import redis.asyncio as aioredis

from tenancy.keys import generate_key, key_digest
from tenancy.layout import KeyLayout
from tenancy.migrate_layout import migrate, migration_client, new_name
from tenancy.models import ApiKeyRecord, Tenant
from tenancy.store import TenantStore
from tenancy.usage import UsageRecorder
from tests.support.leftovers import lasting_async
from tests.tenancy.conftest import RedisTarget

PEPPER = b"migration-pepper"
P = "mig:"
DAY = "2026-12-01"


def write_old_layout(client: redis.Redis) -> tuple[str, str]:
    """One tenant as the layout before hash tags stored it (names from that layout's table); returns
    (the tenant's epoch, its API key)."""
    tenant = Tenant(id="acme", name="Acme", priority_class="standard", epoch="e0e0e0e0e0e0e0e0")
    parsed = generate_key()
    record = ApiKeyRecord(
        key_id=parsed.key_id, tenant_id="acme", digest=key_digest(parsed.full, PEPPER), name="old"
    )
    kid = parsed.key_id
    client.sadd(f"{P}tenants", "acme", "ghost")  # "ghost": an index entry without its record
    client.set(f"{P}tenant:acme", tenant.model_dump_json())
    client.sadd(f"{P}tenant:acme:keys", kid)
    client.zadd(f"{P}tenant:acme:keys_by_time", {kid: record.created_at})
    client.set(f"{P}key:{kid}", record.model_dump_json())
    client.hset(f"{P}bucket:acme:tokens", mapping={"level": "123.5", "ts": "1000"})
    client.expire(f"{P}bucket:acme:tokens", 300)
    client.hset(f"{P}bucket:acme:key:{kid}:requests", mapping={"level": "4", "ts": "1000"})
    client.hset(f"{P}usage:acme", mapping={"requests": 7, "prompt_tokens": 70, "completion_tokens": 21})
    client.hset(f"{P}usage:acme:day:{DAY}", mapping={f"requests:{kid}:m": 7})
    client.expire(f"{P}usage:acme:day:{DAY}", 86_400)
    client.hset(f"{P}spend:acme:tenant:{DAY}", mapping={"used": 5, "spent": 5})
    client.hset(f"{P}budgets:acme", "tenant", '{"period":"day","hard_limit_usd":1.0}')
    expiry = int(time.time()) + 86_400
    client.zadd(
        f"{P}tenant:acme:billing", {f"{P}usage:acme:day:{DAY}": expiry, f"{P}spend:acme:tenant:{DAY}": expiry}
    )
    client.sadd(f"{P}tenant:acme:quota_models", "m")
    client.hset(f"{P}workers", "http://w1:30000", "active")
    client.sadd(f"{P}workers:settings", "http://w1:30000")
    client.hset(f"{P}prices", "m", '{"prompt_usd_per_mtok":1}')
    client.set(f"{P}settled:rid-1", "1", ex=600)
    client.set(f"{P}something-else", "x")
    return tenant.epoch, parsed.full


def test_each_old_name_maps_to_the_tenants_slot() -> None:
    layout = KeyLayout("rg:")
    table = {
        "tenant:acme": ("tenant", "rg:{acme}:tenant"),
        "tenant:acme:keys": ("tenant", "rg:{acme}:keys"),
        "tenant:acme:billing": ("billing", "rg:{acme}:billing"),
        "bucket:acme:requests": ("bucket", "rg:{acme}:bucket:requests"),
        "bucket:acme:model:m:1:tokens": ("bucket", "rg:{acme}:bucket:model:m:1:tokens"),
        "usage:acme": ("usage", "rg:{acme}:usage"),
        "usage:acme:day:2026-01-02": ("usage", "rg:{acme}:usage:day:2026-01-02"),
        "slots:acme:key:k1": ("slots", "rg:{acme}:slots:key:k1"),
        "spend:acme:key:k1:2026-01": ("spend", "rg:{acme}:spend:key:k1:2026-01"),
        "budgets:acme": ("budgets", "rg:{acme}:budgets"),
        "tenant:acme:unknown": None,
        "{acme}:tenant": None,
    }
    for old, expected in table.items():
        assert new_name(layout, old) == expected, old
    # every new name is the current layout's own
    assert new_name(layout, "tenant:acme") == ("tenant", layout.tenant("acme"))
    assert new_name(layout, "bucket:acme:requests") == ("bucket", layout.bucket("acme", "requests"))


async def check_migrated(client: aioredis.Redis, epoch: str, api_key: str) -> None:
    store = TenantStore(client, P, PEPPER)
    found = await store.authenticate_key(api_key)
    assert found is not None and found.tenant.id == "acme" and found.tenant.epoch == epoch
    assert [t.id for t in await store.list_all()] == ["acme"]
    assert [k.name for k in await store.list_keys("acme")] == ["old"]
    usage = await UsageRecorder(client, P).get("acme")
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens) == (7, 70, 21)
    layout = KeyLayout(P)
    assert await client.hget(layout.bucket("acme", "tokens"), "level") == "123.5"
    assert 0 < await client.ttl(layout.bucket("acme", "tokens")) <= 300
    assert 80_000 < await client.ttl(layout.usage_day("acme", DAY)) <= 86_400
    assert await client.hget(f"{P}{{workers}}", "http://w1:30000") == "active"
    # the billing index names the new keys: the delete finds them, and nothing of the tenant is left
    await store.delete("acme")
    assert await lasting_async(client, "*acme*") == []
    assert await lasting_async(client, f"{P}keyid:*") == []


async def test_in_place_on_one_redis(one_redis_client: aioredis.Redis, redis_url: str) -> None:
    sync = migration_client(redis_url, cluster=False)
    try:
        epoch, api_key = write_old_layout(sync)
        dry = migrate(sync, sync, P, dry_run=True)
        assert dry.moved["key"] == 1 and await one_redis_client.exists(f"{P}tenant:acme")  # nothing written
        report = migrate(sync, sync, P)
        assert report.moved["tenant"] == 4 and report.moved["key"] == 1 and report.owners == 1
        assert report.moved["usage"] == 2 and report.moved["bucket"] == 2 and report.moved["billing"] == 1
        assert report.dropped["settled"] == 1 and report.unknown == [f"{P}something-else"]
        assert await one_redis_client.hgetall(f"{P}tenants") == {"acme": epoch}  # the ghost is dropped
        again = migrate(sync, sync, P)  # nothing of the old layout is left
        assert sum(again.moved.values()) == 0 and again.unknown == [f"{P}something-else"]
        left = [k for k in await one_redis_client.keys(f"{P}*") if not k.startswith(f"{P}{{")]
        assert sorted(left) == sorted(
            [f"{P}tenants", f"{P}keyid:{api_key[3:15]}", f"{P}prices", f"{P}something-else"]
        )
    finally:
        sync.close()
    await check_migrated(one_redis_client, epoch, api_key)


async def test_from_one_redis_into_a_cluster(
    one_redis_client: aioredis.Redis, redis_url: str, redis_cluster_url: str
) -> None:
    source, target = (
        migration_client(redis_url, cluster=False),
        migration_client(redis_cluster_url, cluster=True),
    )
    target.flushall()
    try:
        epoch, api_key = write_old_layout(source)
        migrate(source, target, P)
        assert await one_redis_client.exists(f"{P}tenant:acme")  # the source is left as it was
        assert target.hget(f"{P}prices", "m") is not None
        # served since, then the same command again: nothing copied over the newer keys (no rollback)
        usage = KeyLayout(P).usage("acme")
        target.hincrby(usage, "requests", 1)
        again = migrate(source, target, P)
        assert sum(again.moved.values()) == 0 and again.existing["usage"] == 2 and again.existing["key"] == 1
        assert int(target.hget(usage, "requests") or 0) == 8
        target.hincrby(usage, "requests", -1)
    finally:
        source.close()
        target.close()
    cluster = aioredis.RedisCluster.from_url(redis_cluster_url, decode_responses=True)
    try:
        await check_migrated(cluster, epoch, api_key)
    finally:
        await cluster.aclose()


def test_the_cli_prints_what_moved(redis_target: RedisTarget, redis_url: str) -> None:
    """``python -m service migrate-keys --dry-run`` from the settings' Redis (one or a cluster)."""
    env = {"RADIXGATE_REDIS__URL": redis_target.url, "RADIXGATE_REDIS__KEY_PREFIX": "cli:"}
    env["RADIXGATE_REDIS__CLUSTER"] = str(redis_target.kind == "cluster").lower()
    sync = migration_client(redis_target.url, cluster=redis_target.kind == "cluster")
    try:
        sync.set(
            "cli:tenant:x1",
            Tenant(id="x1", name="x", priority_class="standard", epoch="e1").model_dump_json(),
        )
    finally:
        sync.close()
    done = subprocess.run(
        [sys.executable, "-m", "service", "migrate-keys", "--dry-run"],
        env={**_base_env(), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    out = orjson.loads(done.stdout)
    assert out["dry_run"] is True and out["moved"] == {"tenant": 1}


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RADIXGATE_")}
