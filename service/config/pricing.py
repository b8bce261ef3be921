"""The pricing part of the Settings tree (``pricing.*``): each model's price per million tokens, and how long
usage by day is kept.

Split from :mod:`service.config.settings`, which assembles the tree. The prices here are every replica's
defaults; an admin may set a model's price at run time (``PUT /admin/prices/{model}``, stored in Redis,
:mod:`tenancy.pricing_store`), which wins over these. The arithmetic is :mod:`policies.pricing`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from policies.pricing import MAX_PRICE_USD_PER_MTOK, ModelPrice, usd_to_micro
from service.config.models import ModelRegistry
from service.config.policies import FINITE

MAX_PRICED_MODELS = 256
"""Most entries in ``pricing.models`` (one per served model id)."""

_PRICE_FIELD = Field(ge=0, le=MAX_PRICE_USD_PER_MTOK)


class ModelPricing(BaseModel):
    """One model's prices, USD per million tokens, each 0 to 10,000 with at most six decimal places (money
    is kept in whole micro-dollars per million tokens, :mod:`policies.pricing`).

    Attributes:
        input_per_mtok: an uncached prompt token's price, USD per 1M tokens.
        cached_input_per_mtok: a prompt token served from the worker's prefix cache (``cached_tokens``),
            USD per 1M tokens; None: the input price.
        output_per_mtok: a completion token's price, USD per 1M tokens.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    input_per_mtok: Annotated[float, _PRICE_FIELD] = Field(
        description="USD per million uncached prompt tokens (at most 6 decimal places)."
    )
    cached_input_per_mtok: Annotated[float, _PRICE_FIELD] | None = Field(
        None, description="USD per million prompt tokens from the prefix cache; None: the input price."
    )
    output_per_mtok: Annotated[float, _PRICE_FIELD] = Field(
        description="USD per million completion tokens (at most 6 decimal places)."
    )

    @field_validator("input_per_mtok", "cached_input_per_mtok", "output_per_mtok")
    @classmethod
    def _whole_micro_dollars(cls, value: float | None) -> float | None:
        """At most six decimal places: a price is kept as whole micro-dollars per million tokens."""
        if value is not None:
            usd_to_micro(value)
        return value

    def price(self) -> ModelPrice:
        """The prices as whole micro-dollars per million tokens."""
        cached = self.input_per_mtok if self.cached_input_per_mtok is None else self.cached_input_per_mtok
        return ModelPrice(
            usd_to_micro(self.input_per_mtok), usd_to_micro(cached), usd_to_micro(self.output_per_mtok)
        )


class PricingSettings(BaseModel):
    """Prices per model, and the usage kept per UTC day (docs/tenancy.md, "Cost, usage and budgets")."""

    model_config = FINITE

    models: dict[str, ModelPricing] = Field(
        default_factory=dict,
        max_length=MAX_PRICED_MODELS,
        description="JSON object: model id -> {input_per_mtok, cached_input_per_mtok, output_per_mtok}, "
        "USD per million tokens (at most 6 decimals). A model without a price costs nothing; an admin's "
        "PUT /admin/prices/{model} (kept in Redis) wins over this.",
    )
    usage_retention_days: int = Field(
        400,
        ge=1,
        le=3660,
        description="Days of usage by day, model and key kept in Redis (each day's hash expires after "
        "them); the longest range a usage export may ask for.",
    )
    max_usage_rows_per_day: int = Field(
        10_000,
        ge=1,
        le=1_000_000,
        description="Most model x key rows of one tenant's day of usage; beyond it, new pairs are counted "
        "under model and key '_other' (the day's totals stay exact).",
    )
    cache_ttl_s: float = Field(
        1.0,
        ge=0,
        le=60,
        description="Longest a replica uses prices and budgets from memory, s; a change through the admin "
        "API reaches every replica at once (Redis pub/sub), this bounds a lost message.",
    )

    @field_validator("models")
    @classmethod
    def _ids_bounded(cls, value: dict[str, ModelPricing]) -> dict[str, ModelPricing]:
        for model in value:
            if not 1 <= len(model) <= 256:
                raise ValueError(f"model id '{model[:80]}' must be 1 to 256 characters")
        return value

    def prices(self) -> dict[str, ModelPrice]:
        """Model id -> its configured price (whole micro-dollars per million tokens)."""
        return {model: entry.price() for model, entry in self.models.items()}


def check_priced_models(pricing: PricingSettings, registry: ModelRegistry) -> None:
    """Refuse a price for a model the gateway does not serve, or for an alias (a request through an alias
    is priced as its model: give the id).

    Raises:
        ValueError: naming the entry (and the id of an alias).
    """
    for name in pricing.models:
        served = registry.resolve(name)
        if served is None:
            raise ValueError(f"pricing.models names '{name[:80]}', which is not served ({registry.names})")
        if served.id != name:
            raise ValueError(f"pricing.models names the alias '{name}': price its model id '{served.id}'")
