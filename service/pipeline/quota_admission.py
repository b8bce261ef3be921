"""Which token buckets a request takes from, and what it is told: its rate-limit state on every answer, and
the error when a bucket refuses it (:meth:`service.pipeline.dispatch.Dispatcher.admit`).

A request takes from its API key's own buckets (the key's ``quotas``), its tenant's buckets for its model
(the tenant's ``quotas.models`` entry of the model's canonical id) and its tenant's own, in one script call
(:meth:`tenancy.quota.QuotaLimiter.reserve`): all or nothing, refused by the first short in that order. A
request of a key and model without limits of their own takes from its tenant's buckets alone, through the
tenant's local lease, as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from policies.rate_limits import BucketLevel, closest_to_empty
from service.errors import GatewayError, LimitState, RateLimited, RequestTooLarge
from service.pipeline.prepare import PreparedRequest
from tenancy.models import BucketLimits
from tenancy.quota import QuotaDecision, Scope

_PER = {"requests": "requests per minute", "tokens": "tokens per minute"}


def scopes_of(prepared: PreparedRequest) -> tuple[Scope, ...]:
    """The buckets beyond its tenant's own that ``prepared`` takes from: its key's (when the key has
    quotas), then its tenant's for its model (when ``quotas.models`` names it); ``()`` for most."""
    key = prepared.key
    key_limits = key.limits if key is not None else None
    quotas = prepared.tenant.quotas
    model_limits = quotas.for_model(prepared.model_id) if quotas.models else None
    if key_limits is None and model_limits is None:
        return ()
    scopes: list[Scope] = []
    if key is not None and key_limits is not None:
        scopes.append(Scope("key", key.key_id, key_limits))
    if model_limits is not None:
        scopes.append(Scope("model", prepared.model_id, model_limits))
    return tuple(scopes)


def limit_states(levels: tuple[BucketLevel, ...]) -> dict[str, LimitState]:
    """Per kind (requests, tokens), the state of the bucket closest to empty (:mod:`policies.rate_limits`);
    ``{}`` when the request took from no bucket."""
    if not levels:
        return {}
    chosen: Iterable[BucketLevel] = levels
    if len(levels) > 2 or (len(levels) == 2 and levels[0].bucket == levels[1].bucket):
        chosen = closest_to_empty(levels).values()  # several of a kind (a key's, a model's): pick
    return {level.bucket: LimitState(level.capacity, level.remaining, level.reset_s) for level in chosen}


def metric_bucket(decision: QuotaDecision) -> str:
    """The ``bucket`` label of ``radixgate_quota_rejections_total``: ``requests`` or ``tokens`` for the
    tenant's own, ``key_requests``, ``model_tokens``... for a key's or a model's."""
    bucket = decision.limiting or "requests"
    return bucket if decision.scope is None else f"{decision.scope.kind}_{bucket}"


def refusal(prepared: PreparedRequest, decision: QuotaDecision, headers: bool = True) -> GatewayError:
    """The error of a refused reservation: 413 ``request_exceeds_burst`` when it can never pass, else 429
    ``rate_limit_exceeded`` with ``Retry-After``. Both name the bucket in the message and in the error
    object's ``quota`` (``{"scope": "tenant"|"key"|"model", "id", "bucket": "requests"|"tokens"}``) and
    carry the rate-limit state for the headers (unless ``headers`` is False: ``api.rate_limit_headers``)."""
    tenant = prepared.tenant
    bucket = decision.limiting or "requests"
    scope = decision.scope
    limits: BucketLimits = tenant.quotas if scope is None else scope.limits
    if scope is None:
        whose, quota = f"tenant '{tenant.id}'", {"scope": "tenant", "id": tenant.id, "bucket": bucket}
    else:
        whose = f"{scope.describe()} of tenant '{tenant.id}'"
        quota = {"scope": scope.kind, "id": scope.name, "bucket": bucket}
    err: GatewayError
    if decision.never:
        burst = limits.effective_token_burst if bucket == "tokens" else limits.effective_request_burst
        times = "" if prepared.n == 1 else f"n {prepared.n} x "
        owner = (
            f"the tenant's {bucket} burst" if scope is None else f"the {bucket} burst of {scope.describe()}"
        )
        err = RequestTooLarge(
            f"This request needs {prepared.reserved_tokens} tokens (prompt {prepared.prompt.num_tokens} + "
            f"{times}max_tokens {prepared.max_tokens}) but {owner} is {burst:g}; it can never be "
            "admitted. Lower max_tokens or shorten the prompt.",
            code="request_exceeds_burst",
            param="max_tokens",
        )
    else:
        retry_after = max(1, math.ceil(decision.retry_after_s))
        err = RateLimited(
            f"Rate limit reached for {whose} on {_PER[bucket]}. Retry after {retry_after} s.",
            retry_after_s=decision.retry_after_s,
        )
    err.details = {"quota": quota}
    if headers:
        err.rate_limits = limit_states(decision.levels)
    return err
