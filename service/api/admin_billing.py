"""Admin API for cost: model prices (``/admin/prices``), budgets of tenants and API keys with their spend
(``/admin/tenants/{id}/budget``, ``.../keys/{key_id}/budget``) and usage, in total or by day, model and key
as JSON or CSV (``GET /admin/tenants/{id}/usage``). Every route needs the admin token.

Prices and budgets live in Redis (every replica sees a change within milliseconds, through pub/sub);
the settings' ``pricing.models`` are the prices of models no admin priced.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field

from policies.billing_periods import export_days, parse_day, utc_day
from policies.pricing import ModelPrice, micro_to_usd
from service.api.deps import AdminDep, JsonBody, StateDep
from service.api.errors import APIError
from service.api.openai_routes import parse
from service.api.openapi_bodies import ADMIN_SUFFIX, json_body
from service.config.pricing import ModelPricing
from service.state import GatewayState
from tenancy.billing import BudgetScope
from tenancy.budgets import Budget, BudgetSpec
from tenancy.errors import KeyNotFoundError, TenantNotFoundError
from tenancy.usage_periods import GROUPS, GroupBy, as_csv, grouped

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[AdminDep])

ADMIN_BODY_MODELS = (ModelPricing, BudgetSpec)
"""JSON bodies of the routes here, in the OpenAPI document (:mod:`service.api.openapi_bodies`)."""


class PriceInfo(BaseModel):
    """A served model's prices, USD per million tokens, and where they come from."""

    model: str
    input_per_mtok: float
    cached_input_per_mtok: float
    output_per_mtok: float
    source: Literal["admin", "settings", "none"] = Field(
        description="admin: PUT /admin/prices/{model}; settings: pricing.models; none: unpriced (free)."
    )


class BudgetLimits(BaseModel):
    """A budget as stored, USD per period."""

    period: Literal["day", "month"]
    soft_limit_usd: float | None
    hard_limit_usd: float | None


class SpendInfo(BaseModel):
    """A budget's spend in the period now (UTC)."""

    period_id: str = Field(description="'2026-12-05' (day) or '2026-12' (month).")
    period_start: int = Field(description="Unix s.")
    period_end: int = Field(description="Unix s.")
    spent_usd: float = Field(description="Real cost of the requests settled in the period.")
    in_flight_usd: float = Field(description="Worst-case cost held by the requests running now.")
    spent_picodollars: int = Field(description="spent_usd exactly, 1e-12 USD.")
    soft_limit_reached: bool


class BudgetStatus(BaseModel):
    """A tenant's or an API key's budget and its spend (both null: none set)."""

    tenant_id: str
    key_id: str | None
    budget: BudgetLimits | None
    spend: SpendInfo | None


class UsageBucket(BaseModel):
    """Usage summed over one group (its ``day``, ``model``, ``key_id`` when grouped by them)."""

    day: str | None = None
    model: str | None = None
    key_id: str | None = None
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float
    cost_picodollars: int


class UsageExport(BaseModel):
    """``GET /admin/tenants/{id}/usage?from=&to=&group_by=``: usage by UTC day, model and/or API key."""

    object: Literal["usage_export"] = "usage_export"
    tenant_id: str
    from_: str = Field(alias="from")
    to: str
    group_by: list[str]
    data: list[UsageBucket]
    total: UsageBucket


def _price_info(model: str, price: ModelPrice, source: Literal["admin", "settings", "none"]) -> PriceInfo:
    return PriceInfo(
        model=model,
        input_per_mtok=micro_to_usd(price.input),
        cached_input_per_mtok=micro_to_usd(price.cached_input),
        output_per_mtok=micro_to_usd(price.output),
        source=source,
    )


def _served_id(state: GatewayState, name: str, exact: bool) -> str:
    """The canonical id of a served model (``exact``: an alias is refused, naming its id)."""
    model = state.settings.model_registry().resolve(name)
    shown = name[:80]
    if model is None:
        raise APIError(404, f"The model '{shown}' is not served.", code="model_not_found")
    if exact and model.id != name:
        raise APIError(
            400, f"'{shown}' is an alias: price its model id '{model.id}'.", code="model_not_found"
        )
    return model.id


async def _prices(state: GatewayState) -> list[PriceInfo]:
    table, overrides = await state.billing.book.table()
    out = []
    for model in state.settings.model_registry().models:
        price = table.get(model.id)
        if price is None:
            out.append(_price_info(model.id, ModelPrice(0, 0, 0), "none"))
        else:
            out.append(_price_info(model.id, price, "admin" if model.id in overrides else "settings"))
    return out


@router.get("/prices")
async def list_prices(state: StateDep) -> dict[str, Any]:
    """Every served model's prices (USD per million tokens) and their source, in OpenAI's list shape."""
    return {"object": "list", "data": [p.model_dump() for p in await _prices(state)]}


@router.get("/prices/{model}")
async def get_price(model: str, state: StateDep) -> PriceInfo:
    """One model's prices (an alias shows its model's)."""
    model_id = _served_id(state, model, exact=False)
    return next(p for p in await _prices(state) if p.model == model_id)


@router.put("/prices/{model}", openapi_extra=json_body(ModelPricing, ADMIN_SUFFIX))
async def set_price(model: str, body: JsonBody, state: StateDep) -> PriceInfo:
    """Set a model's prices (its canonical id), over the settings': every replica prices its next requests
    with them (a request is reckoned at the price of its admission)."""
    model_id = _served_id(state, model, exact=True)
    price = parse(ModelPricing, body).price()
    await state.billing.prices.set(model_id, price)
    state.billing.book.on_invalidation(f"price:{model_id}")
    return _price_info(model_id, price, "admin")


@router.delete("/prices/{model}")
async def clear_price(model: str, state: StateDep) -> PriceInfo:
    """Drop the admin's prices of a model: the settings' apply again (or none: free)."""
    model_id = _served_id(state, model, exact=True)
    await state.billing.prices.clear(model_id)
    state.billing.book.on_invalidation(f"price:{model_id}")
    return await get_price(model_id, state)


async def _owner(state: GatewayState, tenant_id: str, key_id: str | None) -> None:
    """404 unless the tenant (and its key ``key_id``) exists."""
    try:
        if key_id is None:
            await state.tenants.get(tenant_id)
        else:
            await state.tenants.get_key(tenant_id, key_id)
    except TenantNotFoundError as exc:
        raise APIError(404, f"Tenant '{tenant_id[:80]}' does not exist.", code="tenant_not_found") from exc
    except KeyNotFoundError as exc:
        raise APIError(
            404,
            f"Key '{(key_id or '')[:80]}' does not exist for tenant '{tenant_id[:80]}'.",
            code="key_not_found",
        ) from exc


async def _status(state: GatewayState, tenant_id: str, key_id: str | None) -> BudgetStatus:
    budgets = await state.billing.budgets.load(tenant_id)
    budget = budgets.tenant if key_id is None else budgets.keys.get(key_id)
    if budget is None:
        return BudgetStatus(tenant_id=tenant_id, key_id=key_id, budget=None, spend=None)
    scope: BudgetScope = "tenant" if key_id is None else "key"
    await state.dispatcher.settled(tenant_id)
    spend = await state.billing.budgets.spend(tenant_id, scope, key_id or "", budget)
    return BudgetStatus(
        tenant_id=tenant_id,
        key_id=key_id,
        budget=BudgetLimits.model_validate(budget.dump()),
        spend=SpendInfo.model_validate(spend.dump()),
    )


async def _set_budget(state: GatewayState, tenant_id: str, key_id: str | None, body: Any) -> BudgetStatus:
    spec = parse(BudgetSpec, body)
    await _owner(state, tenant_id, key_id)
    scope: BudgetScope = "tenant" if key_id is None else "key"
    try:
        await state.billing.budgets.set(tenant_id, scope, key_id or "", Budget.of(spec))
    except TenantNotFoundError as exc:  # deleted meanwhile
        raise APIError(404, f"Tenant '{tenant_id}' does not exist.", code="tenant_not_found") from exc
    except ValueError as exc:
        raise APIError(400, str(exc), code="too_many_budgets") from exc
    state.billing.cache.on_invalidation(f"budget:{tenant_id}")
    return await _status(state, tenant_id, key_id)


async def _clear_budget(state: GatewayState, tenant_id: str, key_id: str | None) -> BudgetStatus:
    await _owner(state, tenant_id, key_id)
    await state.billing.budgets.clear(tenant_id, "tenant" if key_id is None else "key", key_id or "")
    state.billing.cache.on_invalidation(f"budget:{tenant_id}")
    return await _status(state, tenant_id, key_id)


@router.get("/tenants/{tenant_id}/budget")
async def get_tenant_budget(tenant_id: str, state: StateDep) -> BudgetStatus:
    """A tenant's budget and its spend in the period now."""
    await _owner(state, tenant_id, None)
    return await _status(state, tenant_id, None)


@router.put("/tenants/{tenant_id}/budget", openapi_extra=json_body(BudgetSpec, ADMIN_SUFFIX))
async def set_tenant_budget(tenant_id: str, body: JsonBody, state: StateDep) -> BudgetStatus:
    """Set a tenant's budget (replaces it; its spend in the period so far counts against the new one)."""
    return await _set_budget(state, tenant_id, None, body)


@router.delete("/tenants/{tenant_id}/budget")
async def clear_tenant_budget(tenant_id: str, state: StateDep) -> BudgetStatus:
    """Remove a tenant's budget."""
    return await _clear_budget(state, tenant_id, None)


@router.get("/tenants/{tenant_id}/keys/{key_id}/budget")
async def get_key_budget(tenant_id: str, key_id: str, state: StateDep) -> BudgetStatus:
    """An API key's budget and its spend in the period now."""
    await _owner(state, tenant_id, key_id)
    return await _status(state, tenant_id, key_id)


@router.put("/tenants/{tenant_id}/keys/{key_id}/budget", openapi_extra=json_body(BudgetSpec, ADMIN_SUFFIX))
async def set_key_budget(tenant_id: str, key_id: str, body: JsonBody, state: StateDep) -> BudgetStatus:
    """Set an API key's own budget (its requests take from it and from their tenant's)."""
    return await _set_budget(state, tenant_id, key_id, body)


@router.delete("/tenants/{tenant_id}/keys/{key_id}/budget")
async def clear_key_budget(tenant_id: str, key_id: str, state: StateDep) -> BudgetStatus:
    """Remove an API key's budget."""
    return await _clear_budget(state, tenant_id, key_id)


_EXPORT_PARAMS = frozenset({"from", "to", "group_by", "format"})


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, code="invalid_value", param=param)


def _group_by(text: str) -> list[GroupBy]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name[:20] for name in names if name not in GROUPS]
    if unknown or len(set(names)) != len(names) or not names:
        raise _bad("group_by", f"'group_by' is a comma list of {list(GROUPS)}, each once; got '{text[:60]}'.")
    return names  # type: ignore[return-value]


@router.get(
    "/tenants/{tenant_id}/usage",
    responses={200: {"model": UsageExport, "content": {"text/csv": {"schema": {"type": "string"}}}}},
)
async def tenant_usage(
    tenant_id: str,
    request: Request,
    state: StateDep,
    from_: str | None = Query(None, alias="from", max_length=10, description="First UTC day, YYYY-MM-DD."),
    to: str | None = Query(None, max_length=10, description="Last UTC day (included), YYYY-MM-DD."),
    group_by: str | None = Query(None, max_length=40, description="day, model, key or a comma list."),
    format: Literal["json", "csv"] | None = Query(None, description="csv: as Accept: text/csv."),
) -> Any:
    """A tenant's usage. Without parameters: its counters since it was created, ``total_tokens``, its
    quotas and its total cost (the shape of ``GET /v1/usage``). With ``from``/``to`` (UTC days, both
    included; by default this month so far) and ``group_by`` (``day`` by default): its usage by day, model
    and/or API key, as JSON (:class:`UsageExport`) or CSV (``Accept: text/csv`` or ``format=csv``). A range
    after ``to`` before ``from``, longer than ``pricing.usage_retention_days`` or older than it: 400. The
    answers this replica has sent it are counted (their settles are awaited)."""
    params = set(request.query_params)
    unknown = sorted(params - _EXPORT_PARAMS)
    if unknown:
        raise _bad(
            unknown[0][:40], f"Unknown parameter '{unknown[0][:40]}'; known: {sorted(_EXPORT_PARAMS)}."
        )
    try:
        tenant = await state.tenants.get(tenant_id)
    except TenantNotFoundError as exc:
        raise APIError(404, f"Tenant '{tenant_id[:80]}' does not exist.", code="tenant_not_found") from exc
    await state.dispatcher.settled(tenant_id)
    csv_wanted = format == "csv" or (format is None and "text/csv" in request.headers.get("accept", ""))
    if not params and not csv_wanted:
        return await state.billing.usage_report(state.usage, tenant_id, tenant.quotas)
    today = utc_day(state.billing.budgets.clock())
    try:
        last = today if to is None else parse_day(to, "to")
        first = last.replace(day=1) if from_ is None else parse_day(from_, "from")
        days = export_days(first, last, today, state.settings.pricing.usage_retention_days)
    except ValueError as exc:
        param = "from" if "'from'" in str(exc) or "range" in str(exc) else "to"
        raise _bad(param, str(exc)) from exc
    groups = _group_by(group_by or "day")
    rows = await state.billing.periods.rows(tenant_id, days)
    data = grouped(rows, groups)
    if csv_wanted:
        return Response(as_csv(data, groups), media_type="text/csv; charset=utf-8")
    return {
        "object": "usage_export",
        "tenant_id": tenant_id,
        "from": first.isoformat(),
        "to": last.isoformat(),
        "group_by": groups,
        "data": data,
        "total": grouped(rows, [])[0],
    }
