"""Value types of the Settings tree whose checks are more than a bound: URLs, log levels and CPU cores;
and :func:`field_error`, the error of a rule between two settings, located at the one it names.

Each raises ``ValueError`` with a short reason, which ``python -m service`` prints as ``invalid setting
RADIXGATE_...: ...`` (no traceback).
"""

from __future__ import annotations

import os
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, StrictInt, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def redis_url(value: str) -> str:
    """A URL redis-py connects to (``redis://``, ``rediss://``, ``unix://``)."""
    if urlsplit(value).scheme not in ("redis", "rediss", "unix"):
        raise ValueError("must be a redis://, rediss:// or unix:// URL")
    return value


def worker_url(value: str) -> str:
    """A worker base URL: ``http://`` or ``https://`` with a host, and no credentials, query or fragment
    (worker URLs are metric labels on the unauthenticated ``/metrics`` and appear in logs)."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("a worker URL must be http:// or https:// with a host")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise ValueError(
            "a worker URL must not carry credentials, a query or a fragment (it shows in logs and /metrics)"
        )
    return value


def http_urls(value: list[str]) -> list[str]:
    """Worker base URLs, each checked by :func:`worker_url`."""
    for i, url in enumerate(value):
        try:
            worker_url(url)
        except ValueError as exc:
            raise ValueError(f"worker {i}: {exc}") from None
    return value


def log_level(value: str) -> str:
    """A stdlib log level name, upper-cased (``info`` -> ``INFO``)."""
    if value.upper() not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
    return value.upper()


def cpu_cores(value: list[int] | None) -> list[int] | None:
    """CPU core ids of this machine (0 to ``os.cpu_count() - 1``), none twice; None passes. (Not this
    process's own affinity: a gateway confined to other cores may give its workers these.)"""
    if value is None:
        return None
    cores = os.cpu_count() or 1
    if not value or len(set(value)) != len(value):
        raise ValueError("a non-empty list of distinct core ids")
    outside = sorted(c for c in value if not 0 <= c < cores)
    if outside:
        raise ValueError(f"cores {outside} are not among this machine's cores 0-{cores - 1}")
    return value


TOGETHER = "settings_together"
"""The error type of a rule between settings (:func:`field_error`)."""


def field_error(section: BaseModel, fields: tuple[str, str], message: str) -> ValidationError:
    """The error of a rule between two settings of one section (e.g. ``window_min <= window_max``),
    located at one of them rather than at the section: raised by the section's ``model_validator``,
    pydantic-core puts its location under the section's (tested with pydantic 2.14), so the command line
    names a variable (``RADIXGATE_SCHEDULER__WINDOW_MIN``) and where it was set, as for a bound.

    Args:
        section: the section model, validated.
        fields: the two fields; the error is shown at the second when only it was set, else at the
            first.
        message: the reason, naming both with their values (no braces: it is a format template).
    """
    first, second = fields
    field = second if second in section.model_fields_set and first not in section.model_fields_set else first
    details = InitErrorDetails(
        type=PydanticCustomError(TOGETHER, message), loc=(field,), input=getattr(section, field)
    )
    return ValidationError.from_exception_data("settings", [details])


RedisUrl = Annotated[str, AfterValidator(redis_url)]
HttpUrls = Annotated[list[str], AfterValidator(http_urls)]
LogLevel = Annotated[str, AfterValidator(log_level)]
CpuCores = Annotated[list[StrictInt] | None, AfterValidator(cpu_cores)]
