"""Admin API for what an API key carries and a tenant's per-model quotas: the checks of their terms, and the
routes that read and change one key (``GET``/``PATCH /admin/tenants/{id}/keys/{key_id}``). Issuing, listing
and revoking keys are in :mod:`service.api.admin_routes`, which calls the checks here.

A key's terms (:class:`tenancy.models.KeyTerms`): ``expires_at`` (unix s or RFC 3339), ``allowed_models``
(served models its tenant may use), ``quotas`` (its own buckets, each rate and burst at most its
tenant's, checked when set: a tenant's quota lowered later binds first anyway) and
``max_concurrent_requests`` (its own concurrency cap, at most its tenant's, checked when set: a tenant's
cap lowered later binds too, as a request takes a slot under both). A tenant's
``quotas.models[]`` name served models by their canonical id (an alias is refused, naming the id).
"""

from __future__ import annotations

from collections.abc import Collection

from fastapi import APIRouter

from service.api.deps import AdminDep, JsonBody, StateDep
from service.api.errors import APIError
from service.api.openai_routes import parse
from service.api.openapi_bodies import ADMIN_SUFFIX, json_body
from service.config.settings import Settings
from tenancy.models import MIN_REQUEST_BURST, ApiKeyInfo, BucketLimits, KeyPatch, Quotas, Tenant
from tenancy.store import KeyNotFoundError, TenantNotFoundError

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[AdminDep])

ADMIN_BODY_MODELS = (KeyPatch,)
"""JSON bodies of the routes here, in the OpenAPI document (:mod:`service.api.openapi_bodies`)."""

_BURST_RATES = {"request_burst": "requests_per_min", "token_burst": "tokens_per_min"}
"""Each burst and the rate of its bucket."""


def _shown(value: str, limit: int = 80) -> str:
    """An id as a message may echo it: at most ``limit`` characters."""
    return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters)"


def check_limits(limits: BucketLimits | None, where: str, given: Collection[str] | None = None) -> None:
    """Reject a request bucket smaller than one request (it would refuse every request with 413), and a
    burst the body sets (``given``: the fields it names; None: all) for a bucket without a rate (an
    unlimited bucket, so the burst would do nothing). ``where``: the body path of ``limits`` in
    messages and ``param`` (``quotas``, ``quotas.models.2``)."""
    if limits is None:
        return
    if limits.request_burst is not None and limits.request_burst < MIN_REQUEST_BURST:
        raise APIError(
            400,
            f"Invalid value for '{where}.request_burst': {limits.request_burst:g} is below one request; "
            "such a bucket admits nothing.",
            code="invalid_value",
            param=f"{where}.request_burst",
        )
    for burst, rate in _BURST_RATES.items():
        named = given is None or burst in given
        if named and getattr(limits, burst) is not None and getattr(limits, rate) is None:
            raise APIError(
                400,
                f"Invalid value for '{where}.{burst}': the bucket has no {rate}, so it is unlimited and "
                f"a burst would do nothing; set {rate} too (or {burst} null).",
                code="invalid_value",
                param=f"{where}.{burst}",
            )


def check_model_quotas(settings: Settings, quotas: Quotas | None) -> None:
    """Reject ``quotas.models`` entries that name no served model by its canonical id, or whose buckets
    :func:`check_limits` refuses.

    Raises:
        APIError: 400 ``model_not_found`` (unknown, or an alias: the message names its id) or
            ``invalid_value``, with ``param`` ``quotas.models.<i>...``.
    """
    if quotas is None or not quotas.models:
        return
    registry = settings.model_registry()
    ids = [m.id for m in registry.models]
    for i, entry in enumerate(quotas.models):
        model = registry.resolve(entry.model)
        if model is None or model.id != entry.model:
            alias = f" is an alias of '{model.id}'; quotas name models by id" if model is not None else ""
            raise APIError(
                400,
                f"Unknown model id '{_shown(entry.model)}' in quotas.models{alias}; served ids: {ids[:10]}.",
                code="model_not_found",
                param=f"quotas.models.{i}.model",
            )
        check_limits(entry, f"quotas.models.{i}")


def check_key_terms(
    settings: Settings,
    tenant: Tenant,
    models: list[str] | None,
    quotas: BucketLimits | None,
    max_concurrent_requests: int | None = None,
) -> None:
    """Reject a key's ``allowed_models`` that are not served or not its tenant's, key ``quotas`` above
    its tenant's (each rate and each effective burst at most the tenant's, where the tenant has one), and
    a key's ``max_concurrent_requests`` above its tenant's (where the tenant has one).

    Raises:
        APIError: 400 ``model_not_found`` (not served), ``model_not_allowed`` (not the tenant's) or
            ``invalid_value`` (a quota or a cap above the tenant's), naming the field in ``param``.
    """
    cap = tenant.max_concurrent_requests
    if max_concurrent_requests is not None and cap is not None and max_concurrent_requests > cap:
        raise APIError(
            400,
            f"Invalid value for 'max_concurrent_requests': {max_concurrent_requests} is above tenant "
            f"'{tenant.id}''s max_concurrent_requests ({cap}); a key's cap is at most its tenant's.",
            code="invalid_value",
            param="max_concurrent_requests",
        )
    if models:
        registry = settings.model_registry()
        unknown = [m for m in models if registry.resolve(m) is None]
        if unknown:
            raise APIError(
                400,
                f"Unknown model(s) {[_shown(m) for m in unknown[:5]]}; served: {settings.served_models}.",
                code="model_not_found",
                param="allowed_models",
            )
        allowed = tenant.allowed_models
        if allowed is not None:
            outside = []
            for name in models:
                model = registry.resolve(name)
                if model is not None and name not in allowed and model.id not in allowed:
                    outside.append(name)
            if outside:
                raise APIError(
                    400,
                    f"Model(s) {[_shown(m) for m in outside[:5]]} are not among tenant '{tenant.id}''s "
                    f"allowed_models {allowed[:10]}; a key's models are a subset of its tenant's.",
                    code="model_not_allowed",
                    param="allowed_models",
                )
    if quotas is None:
        return
    own = tenant.quotas
    pairs = (
        ("requests_per_min", quotas.requests_per_min, own.requests_per_min),
        ("tokens_per_min", quotas.tokens_per_min, own.tokens_per_min),
        ("request_burst", quotas.effective_request_burst, own.effective_request_burst),
        ("token_burst", quotas.effective_token_burst, own.effective_token_burst),
    )
    for name, value, ceiling in pairs:
        if value is not None and ceiling is not None and value > ceiling:
            raise APIError(
                400,
                f"Invalid value for 'quotas.{name}': {value:g} is above tenant '{tenant.id}''s {ceiling:g}; "
                "a key's quotas are at most its tenant's (a burst defaults to its rate: set it lower).",
                code="invalid_value",
                param=f"quotas.{name}",
            )


def _not_found(tenant_id: str, key_id: str) -> APIError:
    return APIError(
        404,
        f"Key '{_shown(key_id)}' does not exist for tenant '{_shown(tenant_id)}'.",
        code="key_not_found",
    )


@router.get("/tenants/{tenant_id}/keys/{key_id}")
async def get_key(tenant_id: str, key_id: str, state: StateDep) -> ApiKeyInfo:
    """One key of a tenant, with its terms (no digest)."""
    try:
        return await state.tenants.get_key(tenant_id, key_id)
    except KeyNotFoundError as exc:
        raise _not_found(tenant_id, key_id) from exc


@router.patch("/tenants/{tenant_id}/keys/{key_id}", openapi_extra=json_body(KeyPatch, ADMIN_SUFFIX))
async def update_key(tenant_id: str, key_id: str, body: JsonBody, state: StateDep) -> ApiKeyInfo:
    """Change a key's name or terms, as a JSON merge patch (RFC 7386): absent fields are kept, ``null``
    clears a term (never expires, its tenant's models, no quotas or concurrency cap of its own), and
    ``quotas`` merges field by field. Checked against its tenant as when issued (a
    ``max_concurrent_requests`` when the patch sets it: one a tenant's lowered cap has since passed does
    not block a patch of the key's other fields); every replica sees it within about a second (its
    cached entry is dropped). Requests in flight keep their slots; a lowered cap refuses the key's next
    requests until fewer than it are in flight."""
    patch = parse(KeyPatch, body)
    try:
        tenant = await state.tenants.get(tenant_id)
    except TenantNotFoundError as exc:
        raise _not_found(tenant_id, key_id) from exc
    given = patch.quotas.model_fields_set if patch.quotas is not None else None
    check_limits(patch.quotas, "quotas", given)
    cap_given = "max_concurrent_requests" in patch.model_fields_set
    try:
        return await state.tenants.update_key(
            tenant_id,
            key_id,
            patch,
            check=lambda merged: check_key_terms(
                state.settings,
                tenant,
                merged.allowed_models,
                merged.quotas,
                merged.max_concurrent_requests if cap_given else None,
            ),
        )
    except KeyNotFoundError as exc:
        raise _not_found(tenant_id, key_id) from exc
