"""Bounds on every number and size a tenant can send, so that nothing reaches a worker that it cannot take.

Each bound is the narrower of OpenAI's published limit and what SGLang 0.5.23 takes without failing
(``sglang/srt/sampling/sampling_params.py`` ``SamplingParams.verify``/``normalize``, and
``sampling_batch_info.py``, which puts ``top_k`` in an int32 tensor and temperatures, ``top_p``,
``min_p`` and the penalties in float32 tensors). A value outside is refused with 400 naming the
parameter before anything is charged. The prompt + ``max_tokens`` limit comes from the workers
themselves (:class:`service.workers.worker_info.TokenLimits`), checked in :mod:`service.pipeline.prepare`.
"""

from __future__ import annotations

from typing import Any

from service.errors import InvalidRequest

TOP_K_ALL = 1 << 30
"""Largest ``top_k``: SGLang's own "whole vocabulary" value (``sampling_params.TOP_K_ALL``). SGLang keeps
``top_k`` in an int32 tensor, so 2**31 kills its scheduler (issue 8); anything above the vocabulary
size already means the whole vocabulary. ``-1`` and ``0`` mean "off" and are not sent."""

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""``seed`` range: SGLang's ``sampling_seed`` is an int64 (``SamplingParams.verify``; msgspec ``i64``)."""

TEMPERATURE_MAX = 2.0
"""``temperature`` in [0, 2] (OpenAI). SGLang treats values below 1e-6 as greedy."""

PENALTY_MIN, PENALTY_MAX = -2.0, 2.0
"""``frequency_penalty`` and ``presence_penalty`` in [-2, 2] (OpenAI, and SGLang's ``verify``)."""

REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.01, 2.0
"""``repetition_penalty`` in [0.01, 2]. SGLang accepts (0, 2] but divides positive logits by it in
float32: 1e-30 hung a CPU worker here, while 1e-20 and everything from 0.01 up answered. Below 0.01 the
penalty only turns output into repetition of one token, so nothing useful is lost."""

MAX_STOP_SEQUENCES = 4
"""Stop sequences per request (OpenAI; SGLang allows 32)."""

MAX_STOP_BYTES = 256
"""Longest stop sequence, UTF-8 bytes: SGLang's bound on a stop pattern (``MAX_STOP_REGEX_LEN``); a long
stop string makes the engine hold back and re-decode that many tokens at every step."""

MAX_MESSAGES = 2048
"""Messages per chat request (OpenAI's limit)."""

MAX_CONTENT_PARTS = 1024
"""Content parts of one message (chat ``content``, a Responses message's ``content`` or a tool output's
``output``). OpenAI publishes no limit; each part is validated and joined, so a body of 30,000 one-letter
parts (within the 1 MiB body bound) took ~0.2 s of validation: counted before any validation, as
``messages`` and ``tools`` are."""

MAX_USER_CHARS = 256
"""Length of ``user``-like identifiers (``user``, ``safety_identifier``, ``prompt_cache_key``)."""

MAX_NAME_CHARS = 256
"""Length of a message's ``name``."""


MAX_JSON_DEPTH = 512
"""Deepest nesting of a request body's JSON (objects and arrays), levels. The decoders stop near 1,000
(orjson at 1,024, Python's json at its recursion limit), but code that walks a value recursively (a
``json.dumps`` of it for an error message) failed at about 900 (Python's recursion limit of 1,000 less the
stack below it): a 500. 512 stays well below that, and above what a field's own checks answer by name
(a JSON schema nested 300 deep in ``tools.0.function.parameters`` is refused naming that field)."""


def nested_deeper_than(value: Any, limit: int, containers: int | None = None) -> bool:
    """Whether ``value`` (decoded JSON) nests objects and arrays more than ``limit`` levels deep; iterative,
    linear in the number of containers. ``containers``: how many objects and arrays the body holds at most
    (e.g. its ``{`` and ``[`` count), when known: no more than ``limit`` of them cannot be too deep, and
    nothing is walked."""
    if containers is not None and containers <= limit:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def check_count(items: Any, limit: int, param: str, what: str) -> None:
    """Refuse a list longer than ``limit`` before anything in it is validated (a list of 10,000 invalid
    items cost 10,000 validation errors, ~0.25 s, where its length alone answers it). Not a list: left to
    the request model.

    Raises:
        InvalidRequest: 400 ``invalid_value`` naming ``param``.
    """
    if isinstance(items, list) and len(items) > limit:
        raise InvalidRequest(
            f"Invalid '{param}': {len(items)} {what}; at most {limit} are served.",
            code="invalid_value",
            param=param,
        )


__all__ = [
    "MAX_CONTENT_PARTS",
    "MAX_JSON_DEPTH",
    "MAX_MESSAGES",
    "MAX_NAME_CHARS",
    "MAX_STOP_BYTES",
    "MAX_STOP_SEQUENCES",
    "MAX_USER_CHARS",
    "PENALTY_MAX",
    "PENALTY_MIN",
    "REPETITION_PENALTY_MAX",
    "REPETITION_PENALTY_MIN",
    "SEED_MAX",
    "SEED_MIN",
    "TEMPERATURE_MAX",
    "TOP_K_ALL",
    "check_count",
    "nested_deeper_than",
]
