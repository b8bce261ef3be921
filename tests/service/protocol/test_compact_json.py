"""compact_json: orjson's bytes where it can, Python's json (same compact form) where orjson refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.protocol.compact_json import compact_json


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({"a": [1, 2.5, None, True]}, b'{"a":[1,2.5,null,true]}'),
        ({"text": "é→"}, '{"text":"é→"}'.encode()),  # orjson: UTF-8, not \\u escapes
        ({"n": 2**64 + 1}, b'{"n":18446744073709551617}'),  # beyond 64 bits: json, exact
        ({"n": -(2**63) - 1}, b'{"n":-9223372036854775809}'),
        ({"s": "\ud800"}, b'{"s":"\\ud800"}'),  # a lone surrogate: escaped, still valid JSON
    ],
)
def test_compact_json(obj: Any, expected: bytes) -> None:
    assert compact_json(obj) == expected
    assert json.loads(compact_json(obj)) == obj


def test_what_is_not_json_at_all_still_raises() -> None:
    with pytest.raises(TypeError):
        compact_json({"x": object()})
