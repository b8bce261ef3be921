"""structlog configured for one JSON object per line on stdout, stdlib logging (uvicorn, httpx) included."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import orjson
import structlog


def _dumps(obj: Any, **kw: Any) -> str:
    """JSON of one log line with orjson (structlog passes its fallback for other types as ``default``);
    Python's json for what orjson refuses (integers beyond 64 bits, lone surrogates)."""
    try:
        return orjson.dumps(obj, default=kw.get("default"), option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return json.dumps(obj, **kw)


def _add_pid(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Name the process of each line: several gateway processes (``workers``) share one output."""
    event["pid"] = os.getpid()
    return event


def configure_logging(level: str, stream: TextIO | None = None) -> None:
    """Route structlog and stdlib logging to JSON lines at ``level`` (e.g. ``"INFO"``) on ``stream``
    (default stdout).

    httpx's per-request INFO lines are lowered to WARNING (the gateway logs one line per request itself).
    Safe to call more than once (the last call wins).
    """
    out = stream or sys.stdout
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_pid,
    ]
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer(serializer=_dumps),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # one write (and flush) per line: print() writes the line and its newline apart, and several gateway
        # processes share this output
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
