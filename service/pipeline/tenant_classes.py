"""The priority classes a stored tenant runs in when the configured classes changed since it was stored.

A tenant record names its default class and its highest class (``priority_class``, ``max_priority_class``).
Renaming the classes (``RADIXGATE_PRIORITY_CLASSES``) left records naming classes that no longer exist, and
every request of such a tenant got ``400 invalid_priority`` blamed on ``param: "priority"``, which the client
never sent. Here a stored class that is gone is replaced by the ``default_priority_class`` setting, each such
tenant is logged once per process when it is first served, and the gateway reports them all at startup
(:func:`report_unknown_classes`). Only a class the client itself asks for can be its error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from service.config.policies import PriorityClassSettings
from service.config.settings import Settings
from tenancy.errors import StoreUnavailable
from tenancy.models import Tenant
from tenancy.store import TenantStore

log = structlog.get_logger("radixgate.tenant_classes")

SAMPLE = 20
"""Tenant ids named per stale class in the startup report (the count is always complete)."""

LOGGED_MAX = 10_000
"""Tenants a process remembers having logged as stale (then it stops logging new ones)."""


@dataclass(frozen=True)
class TenantClasses:
    """The classes a tenant runs in: ``own`` (its requests' class when they ask for none) and ``ceiling``
    (the highest one they may ask for); ``stale`` when its record names a class that is not configured."""

    own: str
    ceiling: str
    stale: bool


def tenant_classes(
    tenant: Tenant, classes: Mapping[str, PriorityClassSettings], default: str
) -> TenantClasses:
    """The classes ``tenant`` runs in under the configured ``classes``.

    A stored default class that is gone becomes ``default``; a stored highest class that is gone becomes
    the tenant's own class (never a higher one: a missing ceiling let such a tenant ask for any class); the
    own class is lowered to the ceiling when it would be above it.
    """
    own = tenant.priority_class if tenant.priority_class in classes else default
    stored_max = tenant.max_priority_class or tenant.priority_class
    ceiling = stored_max if stored_max in classes else own
    if classes[own].rank > classes[ceiling].rank:
        own = ceiling
    stale = tenant.priority_class not in classes or stored_max not in classes
    return TenantClasses(own, ceiling, stale)


class ClassResolver:
    """:func:`tenant_classes` for each request, logging ``tenant_class_unknown`` the first time a process
    serves a stale tenant (at most :data:`LOGGED_MAX` tenants are remembered)."""

    def __init__(self, settings: Settings) -> None:
        self._classes = settings.priority_classes
        self._default = settings.default_priority_class
        self._logged: set[tuple[str, str, str | None]] = set()

    def classes_of(self, tenant: Tenant) -> TenantClasses:
        """The tenant's classes (see :func:`tenant_classes`)."""
        found = tenant_classes(tenant, self._classes, self._default)
        if found.stale:
            key = (tenant.id, tenant.priority_class, tenant.max_priority_class)
            if key not in self._logged and len(self._logged) < LOGGED_MAX:
                self._logged.add(key)
                log.warning(
                    "tenant_class_unknown",
                    tenant=tenant.id,
                    stored_class=tenant.priority_class,
                    stored_max_class=tenant.max_priority_class,
                    served_class=found.own,
                    max_class=found.ceiling,
                    hint="set the tenant's classes with PATCH /admin/tenants/{id}",
                )
        return found


async def report_unknown_classes(store: TenantStore, settings: Settings) -> int:
    """Log one ``tenant_classes_unknown`` line per stored class that is not configured (the count of its
    tenants, up to :data:`SAMPLE` ids, the class they are served at), reading every tenant once; return
    how many tenants are stale. Redis unavailable: one ``tenant_class_check_failed`` line, returns 0."""
    classes, default = settings.priority_classes, settings.default_priority_class
    stale: dict[tuple[str, str], list[str]] = {}
    try:
        tenants = await store.list_all()
    except StoreUnavailable as exc:
        log.warning("tenant_class_check_failed", reason=str(exc))
        return 0
    count = 0
    for tenant in tenants:
        if not tenant_classes(tenant, classes, default).stale:
            continue
        count += 1
        stored_max = tenant.max_priority_class or tenant.priority_class
        if tenant.priority_class not in classes:
            stale.setdefault((tenant.priority_class, "priority_class"), []).append(tenant.id)
        if stored_max not in classes and stored_max != tenant.priority_class:
            stale.setdefault((stored_max, "max_priority_class"), []).append(tenant.id)
    for (name, role), ids in sorted(stale.items()):
        log.warning(
            "tenant_classes_unknown",
            stored_class=name,
            field=role,
            tenants=len(ids),
            sample=ids[:SAMPLE],
            # a default class that is gone: the default_priority_class setting (not above their highest
            # class); a highest class that is gone: their own class
            replaced_by=default if role == "priority_class" else "their priority_class",
            configured=list(classes),
            hint="PATCH /admin/tenants/{id} with a configured class",
        )
    return count


async def report_at_startup(store: TenantStore, settings: Settings) -> None:
    """:func:`report_unknown_classes` as the gateway's startup task (its count unused)."""
    await report_unknown_classes(store, settings)
