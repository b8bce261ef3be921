"""Token cost of a completion request, as reserved against the tokens-per-minute bucket."""

from __future__ import annotations


def reserved_tokens(prompt_tokens: int, max_tokens: int) -> int:
    """Tokens to reserve before a request runs: the prompt plus the most it may generate.

    Args:
        prompt_tokens: tokens of the rendered prompt (model tokenizer), >= 0.
        max_tokens: the completion limit of the request, >= 1.

    Returns:
        ``prompt_tokens + max_tokens``; the reservation is reconciled with the real usage afterwards.
    """
    if prompt_tokens < 0 or max_tokens < 0:
        raise ValueError("token counts must be >= 0")
    return prompt_tokens + max_tokens


def reconcile_delta(reserved: int, prompt_tokens: int, completion_tokens: int) -> int:
    """Tokens to give back to the bucket once the real usage is known.

    Returns:
        ``reserved - (prompt_tokens + completion_tokens)``: positive refunds an unused reservation,
        negative charges an overrun (e.g. a worker that generated more than estimated).
    """
    return reserved - (prompt_tokens + completion_tokens)
