"""Value types of the Settings tree whose checks are more than a bound: URLs and log levels.

Each raises ``ValueError`` with a short reason, which ``python -m service`` prints as ``invalid setting
RADIXGATE_...: ...`` (no traceback).
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def redis_url(value: str) -> str:
    """A URL redis-py connects to (``redis://``, ``rediss://``, ``unix://``)."""
    if urlsplit(value).scheme not in ("redis", "rediss", "unix"):
        raise ValueError("must be a redis://, rediss:// or unix:// URL")
    return value


def http_urls(value: list[str]) -> list[str]:
    """Worker base URLs: each ``http://`` or ``https://`` with a host."""
    for url in value:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    return value


def log_level(value: str) -> str:
    """A stdlib log level name, upper-cased (``info`` -> ``INFO``)."""
    if value.upper() not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
    return value.upper()


RedisUrl = Annotated[str, AfterValidator(redis_url)]
HttpUrls = Annotated[list[str], AfterValidator(http_urls)]
LogLevel = Annotated[str, AfterValidator(log_level)]
