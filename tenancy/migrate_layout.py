"""Move keys written before the hash tags (``P tenant:<id>``, ``P key:<key id>``, ``P bucket:<id>:...``) to
the layout of :mod:`tenancy.layout` (``P{<id>}:tenant``, ``P{<id>}:key:<key id>``, ...), in place on one Redis
or from one Redis into another (a Redis Cluster).

Each key is copied whole with ``DUMP``/``RESTORE`` (its type, contents and remaining time to live), under its
new name; then, in place, the old key is deleted. Besides the renames:

- the tenant index, a set of ids, becomes a hash of id -> the record's epoch;
- each API key gets its owner entry, ``P keyid:<key id>`` -> tenant id;
- a tenant's billing index (a sorted set of its day-usage and spend keys) names the new keys;
- the worker registry's three keys take one hash tag (``P{workers}``);
- ``settled:`` and ``once:`` markers, which name no tenant and expire in seconds to days, are not copied
  (run the migration with the gateways stopped: no settle is then pending).

A key whose new name exists already (copied by an earlier run from a source that was kept, or written by
a gateway since) is never overwritten: it is counted in :attr:`MigrationReport.existing` and, in place, its
old key is left for the operator to look at. So running it again moves nothing and rolls nothing back. Keys
under the prefix that it does not know are left and counted (:attr:`MigrationReport.unknown`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import redis

from tenancy.layout import KeyLayout

SyncClient = redis.Redis | redis.RedisCluster
"""A synchronous client of one Redis or of a Redis Cluster (``decode_responses=False``: ``DUMP`` is
binary)."""

_TENANT_SUFFIXES = {"keys": "keys", "keys_by_time": "keys_by_time", "quota_models": "quota_models"}
_WORKER_KEYS = {"workers": "{workers}", "workers:discovered": "{workers}:discovered"}
_WORKER_KEYS["workers:settings"] = "{workers}:settings"


@dataclass
class MigrationReport:
    """What a migration did (or, dry, would do).

    Attributes:
        moved: old-layout keys copied to their new names, by kind (``tenant``, ``key``, ``bucket``, ...).
        owners: API key owner entries written.
        dropped: markers not copied (``settled``, ``once``).
        existing: old keys whose new name exists already: not copied (the new one kept), by kind.
        unknown: keys under the prefix of neither layout, left where they are.
    """

    moved: Counter[str] = field(default_factory=Counter)
    owners: int = 0
    existing: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    unknown: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "moved": dict(self.moved),
            "owners": self.owners,
            "dropped": dict(self.dropped),
            "existing": dict(self.existing),
            "unknown": self.unknown[:100],
            "unknown_count": len(self.unknown),
        }


def migration_client(url: str, cluster: bool) -> SyncClient:
    """A synchronous client of ``url`` (a node of a Redis Cluster when ``cluster``), binary replies."""
    if cluster:
        return redis.RedisCluster.from_url(url)
    return redis.Redis.from_url(url)


def new_name(layout: KeyLayout, old: str) -> tuple[str, str] | None:
    """``(kind, new key name)`` of an old-layout key ``old`` (without the prefix check: the caller strips
    it), or None when ``old`` is not a key of the old layout that moves by its name alone (the index, API
    keys, markers and unknown keys are the caller's).

    >>> new_name(KeyLayout("rg:"), "bucket:acme:key:k1:tokens")
    ('bucket', 'rg:{acme}:bucket:key:k1:tokens')
    """
    kind, _, rest = old.partition(":")
    tenant, _, tail = rest.partition(":")
    if not tenant or tenant.startswith("{"):
        return None
    root = layout.tenant_root(tenant)
    if kind == "tenant":
        if not tail:
            return "tenant", layout.tenant(tenant)
        if tail in _TENANT_SUFFIXES:
            return "tenant", f"{root}{_TENANT_SUFFIXES[tail]}"
        if tail == "billing":
            return "billing", layout.billing_index(tenant)
        return None
    if kind in ("bucket", "slots", "spend") and tail:
        return kind, f"{root}{kind}:{tail}"
    if kind in ("usage", "slots", "budgets") and not tail:
        return kind, f"{root}{kind}"
    if kind == "usage" and tail.startswith("day:"):
        return "usage", f"{root}usage:{tail}"
    return None


def migrate(source: SyncClient, target: SyncClient, prefix: str, dry_run: bool = False) -> MigrationReport:
    """Copy every old-layout key under ``prefix`` from ``source`` to its new name in ``target``; when
    ``source`` and ``target`` are the same client, delete each old key after its copy.

    Args:
        source: where the old keys are (``decode_responses=False``).
        target: where the new ones go: ``source`` itself (in place), or another Redis or a Redis Cluster.
        prefix: ``redis.key_prefix``.
        dry_run: count what would move; write nothing.

    Returns:
        A :class:`MigrationReport`.

    Raises:
        redis.RedisError: Redis failed; what was copied stays copied (running it again goes on).
    """
    layout, report, in_place = KeyLayout(prefix), MigrationReport(), source is target
    names = sorted(_text(k) for k in source.scan_iter(match=f"{prefix}*", count=1000))
    for name in names:
        rest = name[len(prefix) :]
        if rest.startswith("{") or rest.startswith("keyid:"):
            continue  # the new layout already
        kind = rest.partition(":")[0]
        if kind in ("settled", "once"):
            report.dropped[kind] += 1
            if not dry_run and in_place:
                source.delete(name)
            continue
        if rest == "tenants":
            _index(source, target, layout, name, report, dry_run)
            continue
        if rest in _WORKER_KEYS:
            copied = _copy(source, target, name, f"{prefix}{_WORKER_KEYS[rest]}", dry_run, in_place)
            (report.moved if copied else report.existing)["workers"] += 1
            continue
        if kind == "key":
            _api_key(source, target, layout, name, report, dry_run, in_place)
            continue
        found = new_name(layout, rest)
        if found is None:
            if rest == "prices":  # no tenant's: the same name (copied when the target is another Redis)
                if not in_place:
                    copied = _copy(source, target, name, name, dry_run, in_place=False)
                    (report.moved if copied else report.existing)["prices"] += 1
            elif rest != "replicas":  # (the live replicas' heartbeats: written again within seconds)
                report.unknown.append(name)
            continue
        moved_kind, new = found
        copied = _copy(source, target, name, new, dry_run, in_place)
        if copied and moved_kind == "billing" and not dry_run:
            _rename_members(target, layout, new)
        (report.moved if copied else report.existing)[moved_kind] += 1
    return report


def _copy(source: SyncClient, target: SyncClient, old: str, new: str, dry_run: bool, in_place: bool) -> bool:
    """``DUMP`` ``old`` and ``RESTORE`` it as ``new`` with its time to live; in place, delete ``old``.
    False (nothing written) when ``new`` exists already (dry: would exist)."""
    if dry_run:
        return not target.exists(new)
    dumped = source.dump(old)
    if dumped is None:  # expired since the scan
        return True
    ttl_ms = int(source.pttl(old))
    try:
        target.restore(new, max(ttl_ms, 0), dumped)
    except redis.ResponseError as exc:
        if "BUSYKEY" in str(exc):
            return False
        raise
    if in_place and new != old:
        source.delete(old)
    return True


def _api_key(
    source: SyncClient,
    target: SyncClient,
    layout: KeyLayout,
    name: str,
    report: MigrationReport,
    dry_run: bool,
    in_place: bool,
) -> None:
    raw = source.get(name)
    if raw is None:
        return
    try:
        record = json.loads(raw)
        tenant, key_id = str(record["tenant_id"]), str(record["key_id"])
    except (ValueError, KeyError, TypeError):
        report.unknown.append(name)
        return
    copied = _copy(source, target, name, layout.api_key(tenant, key_id), dry_run, in_place)
    if not copied:
        report.existing["key"] += 1
        return
    report.moved["key"] += 1
    report.owners += 1
    if not dry_run:
        target.set(layout.key_owner(key_id), tenant, nx=True)


def _index(
    source: SyncClient,
    target: SyncClient,
    layout: KeyLayout,
    name: str,
    report: MigrationReport,
    dry_run: bool,
) -> None:
    """The old index (a set of ids) as a hash of id -> epoch, read from each tenant's record (old or new
    name); ids without a record are dropped."""
    if source.type(name) != b"set":
        return  # the new index (a hash) already
    ids = sorted(_text(m) for m in source.smembers(name))
    if dry_run:
        report.moved["index"] += 1
        return
    epochs: dict[str, str] = {}
    for tenant in ids:
        raw = source.get(f"{layout.prefix}tenant:{tenant}") or target.get(layout.tenant(tenant))
        if raw is not None:
            epochs[tenant] = str(json.loads(raw).get("epoch", ""))
    if source is target:
        source.delete(name)
    added = 0
    for tenant_id, epoch in epochs.items():  # an entry there already (a tenant of the target's) is kept
        added += int(target.hsetnx(name, tenant_id, epoch))
    (report.moved if added or source is target else report.existing)["index"] += 1


def _rename_members(target: SyncClient, layout: KeyLayout, billing: str) -> None:
    """A billing index's members are key names: map each old name to its new one."""
    members: list[tuple[bytes, float]] = list(target.zrange(billing, 0, -1, withscores=True))  # type: ignore[arg-type]
    renamed: dict[str, float] = {}
    for member, score in members:
        old = _text(member)
        found = new_name(layout, old[len(layout.prefix) :]) if old.startswith(layout.prefix) else None
        renamed[found[1] if found is not None else old] = score
    if renamed:
        pipe = target.pipeline(transaction=False)
        pipe.delete(billing)
        pipe.zadd(billing, renamed)
        pipe.execute()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


__all__ = ["MigrationReport", "SyncClient", "migrate", "migration_client", "new_name"]
