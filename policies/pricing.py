"""What a request costs, in exact integers: prices per million tokens and the cost of a request's tokens.

Money is never a float here. A price is a whole number of **micro-dollars per million tokens**
(``$0.15 / 1M`` = 150,000), so a price has at most six decimal places in USD. A cost is then a whole
number of **picodollars** (1e-12 USD): ``tokens x price`` exactly, since one token at ``p`` micro-dollars
per million tokens costs ``p x 1e-6 / 1e6`` USD = ``p`` picodollars. Costs add up exactly in Redis's 64-bit
integers (``HINCRBY``); one counter holds up to about $9.2M (``tenancy/billing_lib.lua`` carries above $1M
into a second field, so a lifetime total never overflows).

A cached prompt token (a prefix-cache hit the worker reports as ``cached_tokens``, OpenAI's
``prompt_tokens_details.cached_tokens``) is part of ``prompt_tokens`` and is charged at the cached-input
price instead of the input price, as OpenAI bills its prompt caching.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

MICRO_PER_USD = 10**6
"""Micro-dollars in a dollar: a price's unit is micro-dollars per million tokens."""

PICO_PER_USD = 10**12
"""Picodollars in a dollar: a cost's unit."""

MAX_PRICE_USD_PER_MTOK = 10_000
"""Highest price an admin may set, USD per million tokens (over 10x the dearest public model's in 2026)."""

MAX_REQUEST_TOKENS = 10**8
"""Most tokens one request may be priced for (prompt + completion; a context of 100M tokens): bounds a
request's cost to ``1e8 x 1e10 = 1e18`` picodollars, below Redis's 64-bit integers."""


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """A model's prices, whole micro-dollars per million tokens (each 0 to ``MAX_PRICE_USD_PER_MTOK`` x 1e6).

    Attributes:
        input: an uncached prompt token's.
        cached_input: a prompt token served from the worker's prefix cache.
        output: a completion token's.
    """

    input: int
    cached_input: int
    output: int

    def __post_init__(self) -> None:
        top = MAX_PRICE_USD_PER_MTOK * MICRO_PER_USD
        for name in ("input", "cached_input", "output"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
                raise ValueError(f"{name} must be a whole number of micro-dollars from 0 to {top}")

    @property
    def free(self) -> bool:
        """Whether every token costs nothing (a model without a price)."""
        return self.input == self.cached_input == self.output == 0


FREE = ModelPrice(0, 0, 0)
"""The price of a model nobody priced: its requests cost nothing."""


def usd_to_micro(value: float | int | str | Decimal, what: str = "price") -> int:
    """A dollar amount as whole micro-dollars, exactly (``0.15`` -> 150,000).

    A float is read as its shortest decimal form (``repr``), so ``0.1`` is ten cents, not the binary
    fraction nearest it.

    Raises:
        ValueError: not a finite number, negative, or with more than six decimal places (naming ``what``).
    """
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number of dollars, not a boolean")
    try:
        amount = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    except InvalidOperation:
        raise ValueError(f"{what} must be a number of dollars, got {str(value)[:40]!r}") from None
    if not amount.is_finite():
        raise ValueError(f"{what} must be finite")
    if amount < 0:
        raise ValueError(f"{what} must be at least 0")
    micros = amount * MICRO_PER_USD
    if micros != micros.to_integral_value():
        raise ValueError(f"{what} has more than six decimal places ({value}); a micro-dollar is the unit")
    return int(micros)


def micro_to_usd(micros: int) -> float:
    """Micro-dollars as dollars, for display (``150_000`` -> ``0.15``); exact for what JSON shows."""
    return float(Decimal(micros) / MICRO_PER_USD)


def pico_to_usd(picos: int) -> float:
    """Picodollars as dollars, for display and metrics (a float: only the sums kept as integers are exact)."""
    return float(Decimal(picos) / PICO_PER_USD)


def usd_to_pico(value: float | int | str | Decimal, what: str = "amount") -> int:
    """A dollar amount with at most six decimal places as whole picodollars (``1.5`` -> ``1.5e12``).

    Raises:
        ValueError: as :func:`usd_to_micro`.
    """
    return usd_to_micro(value, what) * (PICO_PER_USD // MICRO_PER_USD)


def usd_text(picos: int) -> str:
    """Picodollars as an exact decimal dollar string without trailing zeros (``1_500_000`` ->
    ``"0.0000015"``): what the CSV export writes, so a spreadsheet's sum is exact."""
    text = format(Decimal(picos) / PICO_PER_USD, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _tokens(name: str, value: int) -> int:
    if not 0 <= value <= MAX_REQUEST_TOKENS:
        raise ValueError(f"{name} must be 0 to {MAX_REQUEST_TOKENS} tokens, got {value}")
    return value


def request_cost(price: ModelPrice, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
    """A served request's cost, picodollars: uncached prompt tokens at the input price, cached ones at the
    cached-input price, completion tokens at the output price.

    Args:
        price: the model's prices.
        prompt_tokens: prompt tokens the worker processed, cached ones included (OpenAI's ``prompt_tokens``).
        cached_tokens: of those, the ones served from its prefix cache (more than ``prompt_tokens`` counts as
            ``prompt_tokens``: a worker cannot have cached more than the prompt).
        completion_tokens: tokens generated.

    Raises:
        ValueError: a count below 0 or above ``MAX_REQUEST_TOKENS``.
    """
    prompt = _tokens("prompt_tokens", prompt_tokens)
    cached = min(_tokens("cached_tokens", cached_tokens), prompt)
    completion = _tokens("completion_tokens", completion_tokens)
    return (prompt - cached) * price.input + cached * price.cached_input + completion * price.output


def worst_case_cost(price: ModelPrice, prompt_tokens: int, max_completion_tokens: int) -> int:
    """The most a request may cost before it runs, picodollars: every prompt token at the dearer of the
    input and cached-input prices (no cache hit assumed), plus its whole completion allowance (``max_tokens``
    times ``n``) at the output price. What a hard budget reserves at admission.

    Raises:
        ValueError: a count below 0 or above ``MAX_REQUEST_TOKENS``.
    """
    prompt = _tokens("prompt_tokens", prompt_tokens)
    completion = _tokens("max_completion_tokens", max_completion_tokens)
    return prompt * max(price.input, price.cached_input) + completion * price.output
