"""Compact JSON bytes for everything the gateway sends: orjson, and Python's json for what orjson refuses.

orjson is several times faster, but refuses integers beyond 64 bits and strings with lone surrogates, both
of which a tenant can send (request bodies are decoded exactly, see :func:`service.api.deps.decode_json`)
and the gateway may echo (the Responses API echoes the request's tools; errors name offending values). A
refused value falls back to ``json.dumps`` with the same compact separators instead of failing the request.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def compact_json(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON.

    Raises:
        TypeError, ValueError: ``obj`` is not JSON at all (neither library can encode it).
    """
    try:
        return orjson.dumps(obj)
    except TypeError:  # integers beyond 64 bits, lone surrogates
        return json.dumps(obj, separators=(",", ":")).encode()
