"""Admin API: tenants, quotas, API keys and usage. Every route needs the admin token."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from fastapi import APIRouter, Response

from service.api.admin_keys import check_key_terms, check_limits, check_model_quotas
from service.api.deps import AdminDep, JsonBody, StateDep
from service.api.errors import APIError
from service.api.openai_routes import parse
from service.api.openapi_bodies import ADMIN_SUFFIX, json_body
from service.api.paging import DEFAULT_PAGE, After, Limit, list_object
from service.config.settings import Settings
from tenancy.models import (
    MIN_REQUEST_BURST,
    ApiKeyInfo,
    IssuedKey,
    KeyCreate,
    Quotas,
    Tenant,
    TenantCreate,
    TenantPatch,
)
from tenancy.store import KeyNotFoundError, TenantExistsError, TenantNotFoundError

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[AdminDep])


def _shown(value: str, limit: int = 80) -> str:
    """An id from the path as a message may echo it: at most ``limit`` characters (tenant ids have 1-63)."""
    return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters)"


def _not_found(tenant_id: str) -> APIError:
    return APIError(404, f"Tenant '{_shown(tenant_id)}' does not exist.", code="tenant_not_found")


_CLASS_FIELDS = ("priority_class", "max_priority_class")


def _check_tenant(
    settings: Settings,
    default_class: str | None,
    max_class: str | None,
    allowed_models: list[str] | None,
    named: Collection[str] = _CLASS_FIELDS,
) -> None:
    """Reject unknown classes the body ``named`` or models, and a default class above the tenant's highest
    class. A stored class the body does not name may be one that is no longer configured: it is served at
    the default class (:mod:`service.pipeline.tenant_classes`), and a PATCH of another field must not fail on
    it."""
    classes = settings.priority_classes
    for param, name in (("priority_class", default_class), ("max_priority_class", max_class)):
        if name is not None and name not in classes and param in named:
            raise APIError(
                400,
                f"Unknown priority class '{name}'; known: {sorted(classes)}.",
                code="invalid_priority",
                param=param,
            )
    known = default_class in classes and max_class in classes
    if known and classes[str(default_class)].rank > classes[str(max_class)].rank:
        raise APIError(
            400,
            f"priority_class '{default_class}' is above max_priority_class '{max_class}'.",
            code="invalid_priority",
            param="max_priority_class",
        )
    unknown = sorted(set(allowed_models or ()) - set(settings.served_models))
    if unknown:
        shown = [_shown(name) for name in unknown[:5]]
        if len(unknown) > 5:
            shown.append(f"... {len(unknown) - 5} more")
        raise APIError(
            400,
            f"Unknown model(s) {shown}; served: {settings.served_models}.",
            code="model_not_found",
            param="allowed_models",
        )


_BURST_RATES = {"request_burst": "requests_per_min", "token_burst": "tokens_per_min"}
"""Each burst and the rate of its bucket."""


def _check_quotas(quotas: Quotas | None, given: Collection[str] | None = None) -> None:
    """Reject a request bucket smaller than one request (it would refuse every request with 413), and a
    burst the body sets (``given``: the quota fields it names; None: all) for a bucket without a rate.

    A bucket without a rate is unlimited, so its burst does nothing (nu19: ``{"token_burst": 1000}`` alone
    was stored and shown, and every request passed); a burst kept by a PATCH that clears the rate stays
    stored, as the rate may come back."""
    if quotas is None:
        return
    if quotas.request_burst is not None and quotas.request_burst < MIN_REQUEST_BURST:
        raise APIError(
            400,
            f"Invalid value for 'quotas.request_burst': {quotas.request_burst:g} is below one request; "
            "such a bucket admits nothing.",
            code="invalid_value",
            param="quotas.request_burst",
        )
    for burst, rate in _BURST_RATES.items():
        named = given is None or burst in given
        if named and getattr(quotas, burst) is not None and getattr(quotas, rate) is None:
            raise APIError(
                400,
                f"Invalid value for 'quotas.{burst}': the bucket has no {rate}, so it is unlimited and "
                f"a burst would do nothing; set {rate} too (or {burst} null).",
                code="invalid_value",
                param=f"quotas.{burst}",
            )


ADMIN_BODY_MODELS = (TenantCreate, TenantPatch, Quotas, KeyCreate)
"""JSON bodies of the admin routes here, in the OpenAPI document (:mod:`service.api.openapi_bodies`)."""


@router.post("/tenants", status_code=201, openapi_extra=json_body(TenantCreate, ADMIN_SUFFIX))
async def create_tenant(body: JsonBody, state: StateDep) -> Tenant:
    """Create a tenant (409 if the id exists)."""
    spec = parse(TenantCreate, body)
    if spec.priority_class is None:  # the configured default, not a name fixed in the code
        spec = spec.model_copy(update={"priority_class": state.settings.default_priority_class})
    _check_tenant(state.settings, spec.priority_class, spec.max_priority_class, spec.allowed_models)
    _check_quotas(spec.quotas)
    check_model_quotas(state.settings, spec.quotas)
    try:
        return await state.tenants.create(spec)
    except TenantExistsError as exc:
        raise APIError(409, f"Tenant '{spec.id}' already exists.", code="tenant_exists") from exc


@router.get("/tenants")
async def list_tenants(state: StateDep, limit: Limit = DEFAULT_PAGE, after: After = None) -> dict[str, Any]:
    """Tenants in id order, a page at a time (:mod:`service.api.paging`): at most ``limit`` (1-1000,
    default 100) after id ``after`` (any string: the page starts at the first id above it), with
    ``first_id``, ``last_id`` and ``has_more`` (pass ``last_id`` as ``after`` for the next page). Ids are
    unique and ordered, so a tenant that exists throughout a listing is on exactly one page."""
    tenants, more = await state.tenants.list_page(after or None, limit)
    return list_object([t.model_dump() for t in tenants], "id", more)


@router.get("/tenants/{tenant_id}")
async def get_tenant(tenant_id: str, state: StateDep) -> Tenant:
    """One tenant."""
    try:
        return await state.tenants.get(tenant_id)
    except TenantNotFoundError as exc:
        raise _not_found(tenant_id) from exc


@router.patch("/tenants/{tenant_id}", openapi_extra=json_body(TenantPatch, ADMIN_SUFFIX))
async def update_tenant(tenant_id: str, body: JsonBody, state: StateDep) -> Tenant:
    """Partial update (name, class, weight, quotas, caps, models, enabled, max_concurrent_requests), as a
    JSON merge patch (RFC 7386): absent fields are kept, and so are the quota fields ``quotas`` leaves out
    (``{"quotas": {"requests_per_min": 20}}`` keeps the tenant's TPM; ``null`` makes one unlimited).
    ``PUT /admin/tenants/{id}/quotas`` replaces them all."""
    patch = parse(TenantPatch, body)
    try:
        current = await state.tenants.get(tenant_id)
    except TenantNotFoundError as exc:
        raise _not_found(tenant_id) from exc
    given: dict[str, float | None] | None = None
    if patch.quotas is not None:
        # checked merged with the quotas read now; merged again with those the write reads (a PATCH of
        # another quota field may land in between)
        given = {name: getattr(patch.quotas, name) for name in patch.quotas.model_fields_set}
        patch = patch.model_copy(update={"quotas": current.quotas.model_copy(update=given)})
    _check_quotas(patch.quotas, () if given is None else given.keys())
    if given is not None and "models" in given:
        check_model_quotas(state.settings, patch.quotas)
    named = patch.model_fields_set & set(_CLASS_FIELDS)
    _check_tenant(
        state.settings,
        patch.priority_class or current.priority_class,
        patch.max_priority_class or current.max_priority_class,
        patch.allowed_models,
        named,
    )
    try:
        return await state.tenants.update(
            tenant_id,
            patch,
            quota_fields=given,
            # again on the record the write merges with: a PATCH of the other class may land in between
            check=lambda merged: _check_tenant(
                state.settings, merged.priority_class, merged.max_priority_class, None, named
            ),
        )
    except TenantNotFoundError as exc:
        raise _not_found(tenant_id) from exc


@router.post("/tenants/{tenant_id}/disable")
async def disable_tenant(tenant_id: str, state: StateDep) -> Tenant:
    """Disable a tenant: its keys get 403 until it is enabled again."""
    return await update_tenant_fields(state, tenant_id, TenantPatch(enabled=False))


@router.post("/tenants/{tenant_id}/enable")
async def enable_tenant(tenant_id: str, state: StateDep) -> Tenant:
    """Enable a tenant."""
    return await update_tenant_fields(state, tenant_id, TenantPatch(enabled=True))


@router.put("/tenants/{tenant_id}/quotas", openapi_extra=json_body(Quotas, ADMIN_SUFFIX))
async def set_quotas(tenant_id: str, body: JsonBody, state: StateDep) -> Tenant:
    """Replace a tenant's quotas (RPM/TPM and bursts; omitted = unlimited)."""
    return await update_tenant_fields(state, tenant_id, TenantPatch(quotas=parse(Quotas, body)))


async def update_tenant_fields(state: StateDep, tenant_id: str, patch: TenantPatch) -> Tenant:
    """Apply a patch built by a route."""
    _check_quotas(patch.quotas)
    check_model_quotas(state.settings, patch.quotas)
    try:
        return await state.tenants.update(tenant_id, patch)
    except TenantNotFoundError as exc:
        raise _not_found(tenant_id) from exc


@router.delete("/tenants/{tenant_id}", status_code=204)
async def delete_tenant(tenant_id: str, state: StateDep) -> Response:
    """Delete a tenant and everything it owns: keys, buckets, usage counters (one atomic call)."""
    try:
        await state.tenants.delete(tenant_id)
    except TenantNotFoundError as exc:
        raise _not_found(tenant_id) from exc
    return Response(status_code=204)


@router.post("/tenants/{tenant_id}/keys", status_code=201, openapi_extra=json_body(KeyCreate, ADMIN_SUFFIX))
async def issue_key(tenant_id: str, state: StateDep, body: JsonBody) -> IssuedKey:
    """Issue an API key, with its terms (``expires_at``, ``allowed_models``, ``quotas``,
    ``max_concurrent_requests``: checked against its tenant, :func:`service.api.admin_keys.check_key_terms`);
    the response holds the key, shown this once. A tenant's cap or quota lowered later binds the key too."""
    spec = parse(KeyCreate, body)
    try:
        if (
            spec.allowed_models is not None
            or spec.quotas is not None
            or spec.max_concurrent_requests is not None
        ):
            check_limits(spec.quotas, "quotas")
            tenant = await state.tenants.get(tenant_id)
            check_key_terms(
                state.settings, tenant, spec.allowed_models, spec.quotas, spec.max_concurrent_requests
            )
        return await state.tenants.issue_key(tenant_id, spec.name, spec)
    except TenantNotFoundError as exc:
        raise _not_found(tenant_id) from exc


@router.get("/tenants/{tenant_id}/keys")
async def list_keys(
    tenant_id: str, state: StateDep, limit: Limit = DEFAULT_PAGE, after: After = None
) -> dict[str, Any]:
    """A tenant's keys (ids and prefixes only), oldest first, a page at a time: at most ``limit`` (1-1000,
    default 100) after key ``after`` (a ``key_id`` of this tenant's: 400 otherwise), in OpenAI's list
    shape with ``key_id`` as the id (:meth:`tenancy.store.TenantStore.list_keys_page`: a key that exists
    throughout a listing is on exactly one page)."""
    try:
        keys, more = await state.tenants.list_keys_page(tenant_id, after or None, limit)
    except TenantNotFoundError as exc:
        raise _not_found(tenant_id) from exc
    except KeyNotFoundError as exc:
        raise APIError(
            400,
            f"Invalid value for 'after': '{_shown(after or '')}' is not a key of tenant "
            f"'{_shown(tenant_id)}'.",
            code="invalid_value",
            param="after",
        ) from exc
    return list_object([k.model_dump() for k in keys], "key_id", more)


@router.delete("/tenants/{tenant_id}/keys/{key_id}")
async def revoke_key(tenant_id: str, key_id: str, state: StateDep) -> ApiKeyInfo:
    """Revoke a key: it gets 401 from now on."""
    try:
        return await state.tenants.revoke_key(tenant_id, key_id)
    except KeyNotFoundError as exc:
        raise APIError(
            404,
            f"Key '{_shown(key_id)}' does not exist for tenant '{_shown(tenant_id)}'.",
            code="key_not_found",
        ) from exc
