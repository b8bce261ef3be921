"""Every Redis key radixgate writes for tenants, in one place (``P`` = the configured prefix, ``rg:``).

``T`` = ``P{<id>}:``, the tenant's root: its id in braces is the hash tag of every key it owns.

====================================  ===============================================================
key                                   holds
====================================  ===============================================================
``P tenants``                         set of tenant ids
``P keyid:<key_id>``                  the id of the tenant that owns the API key (written at issue)
``T tenant``                          JSON :class:`~tenancy.models.Tenant` (with its ``epoch``)
``T keys``                            set of the tenant's API key ids
``T keys_by_time``                    the same ids in a sorted set scored by creation time (unix s),
                                      for paging (``key_page.lua``)
``T key:<key_id>``                    JSON :class:`~tenancy.models.ApiKeyRecord` (names its tenant)
``T bucket:requests|tokens``          token-bucket hashes (``level``, ``ts``), expire when full
``T bucket:key:<key_id>:...``         an API key's own buckets (``requests|tokens``), likewise
``T bucket:model:<model>:...``        the tenant's buckets for one model (``requests|tokens``)
``T quota_models``                    set of every model id its quotas have named (what delete clears)
``T usage``                           usage counters hash
``T settled:<request_id>``            marker of a settled request (expires): a retried settle lands once
``T once:<call_id>``                  one script call's reply (expires): a resent call runs once
``T slots``                           the tenant's concurrency slots: a sorted set of slot ids scored
                                      by their lease's end (Redis server ms), expires with its last lease
``T slots:key:<key_id>``              the same for one API key of the tenant
``T usage:day:<YYYY-MM-DD>``          one UTC day's usage by API key and model
                                      (``<counter>:<key>:<model>`` fields), expires after
                                      ``pricing.usage_retention_days``
``T budgets``                         the tenant's budgets: field ``tenant`` and ``key:<key_id>`` -> JSON
``T spend:<scope>:<period>``          one budget's spend in one period (``used``, ``spent``, ``soft``),
                                      scope ``tenant`` or ``key:<key_id>``; expires a week after it
``T billing``                         sorted set of the tenant's day-usage and spend keys, scored by
                                      their expiry (unix s): what delete clears
``P prices``                          model id -> JSON price (the admin's, over the settings'); no tenant's
====================================  ===============================================================

A tenant owns its record, key set, key records, buckets (its own, its keys' and its models'), usage (its
totals and its days), budgets, spend and slot sets (its own and its keys'); deleting it removes all of them
in one Lua call (``tenant_delete.lua``), then its ``keyid:`` entries and its index entry (other slots).
Keys written by the layout before the hash tags (``P tenant:<id>``, ``P key:<key_id>``, ...) are moved by
``python -m service migrate-keys`` (:mod:`tenancy.migrate_layout`; docs/redis-cluster.md).
Scripts that write buckets or usage first check that the tenant
record still exists with the epoch the caller saw (``tenant_guard.lua``), so a request racing the delete
(or the deleted tenant's re-creation under the same id) writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Literal

BucketName = Literal["requests", "tokens"]
BUCKETS: tuple[BucketName, ...] = ("requests", "tokens")
ScopeKind = Literal["tenant", "key", "model"]
"""Whose buckets: the tenant's own, one of its API keys', or the tenant's for one model."""


@dataclass(frozen=True, slots=True)
class KeyLayout:
    """Names of the Redis keys under ``prefix``.

    Every key a tenant owns starts with :meth:`tenant_root`, ``P{<tenant id>}:``: the braces make the
    tenant id the key's hash tag, so on Redis Cluster all of one tenant's keys hash to one slot and each
    Lua call (which names one tenant's keys) runs on one node (https://redis.io/docs/latest/operate/oss_and_
    stack/reference/cluster-spec/#hash-tags). Tenant ids cannot hold braces (``TENANT_ID_PATTERN``). The
    keys no tenant owns (the tenant index, API-key owners, prices, the workers' and replicas' keys) are
    each used alone, by commands of one key.
    """

    prefix: str

    @property
    def index(self) -> str:
        """Set of every tenant id."""
        return f"{self.prefix}tenants"

    def tenant_root(self, tenant_id: str) -> str:
        """What every key of the tenant starts with: ``P{<tenant id>}:`` (its hash tag)."""
        return f"{self.prefix}{{{tenant_id}}}:"

    def tenant(self, tenant_id: str) -> str:
        """A tenant's JSON record."""
        return f"{self.tenant_root(tenant_id)}tenant"

    def tenant_keys(self, tenant_id: str) -> str:
        """Set of a tenant's API key ids."""
        return f"{self.tenant_root(tenant_id)}keys"

    def tenant_keys_by_time(self, tenant_id: str) -> str:
        """Sorted set of a tenant's API key ids, scored by creation time (unix s)."""
        return f"{self.tenant_root(tenant_id)}keys_by_time"

    def api_key(self, tenant_id: str, key_id: str) -> str:
        """One API key's JSON record, in its tenant's slot."""
        return f"{self.api_key_prefix(tenant_id)}{key_id}"

    def api_key_prefix(self, tenant_id: str) -> str:
        """What :meth:`api_key` puts before the key id."""
        return f"{self.tenant_root(tenant_id)}key:"

    def key_owner(self, key_id: str) -> str:
        """``P keyid:<key id>``: the id of the tenant that owns API key ``key_id`` (a string, written once
        when the key is issued): what authentication reads first, since a presented key does not name its
        tenant. Its own slot; a leftover of a deleted tenant points at a record that is gone."""
        return f"{self.prefix}keyid:{key_id}"

    def bucket(self, tenant_id: str, bucket: BucketName) -> str:
        """One of a tenant's token buckets."""
        return f"{self.scoped_bucket_prefix(tenant_id)}{bucket}"

    def scoped_bucket(self, tenant_id: str, kind: ScopeKind, name: str, bucket: BucketName) -> str:
        """One bucket of a tenant's scope: its own (``kind`` "tenant", ``name`` ignored), an API key's
        (``name``: the key id) or one model's (``name``: the model id)."""
        if kind == "tenant":
            return self.bucket(tenant_id, bucket)
        return f"{self.scoped_bucket_prefix(tenant_id)}{kind}:{name}:{bucket}"

    def scoped_bucket_prefix(self, tenant_id: str) -> str:
        """What :meth:`scoped_bucket` puts before ``<kind>:<name>:<bucket>``."""
        return f"{self.tenant_root(tenant_id)}bucket:"

    def quota_models(self, tenant_id: str) -> str:
        """Set of every model id the tenant's quotas have named (its model buckets, for delete)."""
        return f"{self.tenant_root(tenant_id)}quota_models"

    def usage(self, tenant_id: str) -> str:
        """A tenant's usage counters."""
        return f"{self.tenant_root(tenant_id)}usage"

    def slots(self, tenant_id: str) -> str:
        """A tenant's concurrency slots (``slot_acquire.lua``): slot id -> lease end, ms."""
        return f"{self.tenant_root(tenant_id)}slots"

    def key_slots_prefix(self, tenant_id: str) -> str:
        """What :meth:`key_slots` puts before the key id (``tenant_delete.lua`` names them from it)."""
        return f"{self.tenant_root(tenant_id)}slots:key:"

    def key_slots(self, tenant_id: str, key_id: str) -> str:
        """One API key's concurrency slots, under its tenant's id."""
        return f"{self.key_slots_prefix(tenant_id)}{key_id}"

    def usage_day(self, tenant_id: str, day: str) -> str:
        """One UTC day's usage of a tenant by API key and model (``day``: ``YYYY-MM-DD``)."""
        return f"{self.tenant_root(tenant_id)}usage:day:{day}"

    def budgets(self, tenant_id: str) -> str:
        """A tenant's budgets (its own and its keys')."""
        return f"{self.tenant_root(tenant_id)}budgets"

    def spend(self, tenant_id: str, scope: str, period_id: str) -> str:
        """One budget's spend in one period; ``scope``: ``tenant`` or ``key:<key_id>``."""
        return f"{self.tenant_root(tenant_id)}spend:{scope}:{period_id}"

    def billing_index(self, tenant_id: str) -> str:
        """Sorted set of a tenant's day-usage and spend keys, scored by expiry (``tenant_delete.lua``)."""
        return f"{self.tenant_root(tenant_id)}billing"

    @property
    def prices(self) -> str:
        """Model id -> JSON price set by an admin."""
        return f"{self.prefix}prices"

    def once(self, tenant_id: str, call_id: str) -> str:
        """The reply of one script call on the tenant's keys (:func:`lua` with ``once``), kept seconds; in
        the tenant's slot, like the keys the call names. Expires in seconds: nothing a deletion must find."""
        return f"{self.tenant_root(tenant_id)}once:{call_id}"

    def settled(self, tenant_id: str, request_id: str) -> str:
        """Marker of a request of the tenant whose settle landed (``settle.lua``; expires)."""
        return f"{self.tenant_root(tenant_id)}settled:{request_id}"


ONCE_CALL = """
-- once: KEYS[1] this call's marker, ARGV[1] its lifetime (ms); the script's own keys and arguments follow.
-- A call sent again (redis-py retries a command whose reply a broken connection cut off, after Redis may
-- have run it) finds the marker and gets the first run's reply, changing nothing.
local once_key, once_ttl = KEYS[1], ARGV[1]
local seen = redis.call('GET', once_key)
if seen then
  return cjson.decode(seen)
end
local once_out = once_body({unpack(KEYS, 2)}, {unpack(ARGV, 2)})
redis.call('SET', once_key, cjson.encode(once_out), 'PX', once_ttl)
return once_out
"""
"""The end of a script made with ``once=True`` (:func:`lua`)."""


def lua(
    name: str, guarded: bool = False, buckets: bool = False, billing: bool = False, once: bool = False
) -> str:
    """The text of ``tenancy/<name>``, after the tenant guard (``tenant_guard.lua``) when ``guarded``, the
    token-bucket steps (``bucket_lib.lua``) when ``buckets`` and the money steps (``billing_lib.lua``)
    when ``billing``.

    ``once``: the script runs at most once per call: its body becomes a function of its keys and
    arguments, called behind a marker (:data:`ONCE_CALL`; the caller puts the marker's key first in
    ``KEYS`` and its lifetime in ms first in ``ARGV``, :meth:`KeyLayout.once`), so that a call Redis ran
    and whose reply was lost is not run twice when the client sends it again (the idempotency key of
    Stripe's API, per call). The script's replies must be JSON-encodable (numbers, strings, arrays)."""
    files = resources.files("tenancy")
    parts = [files.joinpath("tenant_guard.lua").read_text()] if guarded else []
    if buckets:
        parts.append(files.joinpath("bucket_lib.lua").read_text())
    if billing:
        parts.append(files.joinpath("billing_lib.lua").read_text())
    body = files.joinpath(name).read_text()
    if once:
        parts += ["local function once_body(KEYS, ARGV)", body, "end", ONCE_CALL]
    else:
        parts.append(body)
    return "\n".join(parts)
