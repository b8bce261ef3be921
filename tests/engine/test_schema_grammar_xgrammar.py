"""The schema table of issue 25 (``tests/support/schema_table.py``) is true to xgrammar 0.2.7 itself, the
grammar backend of the engine's SGLang: each row's verdict is what xgrammar makes of the schema (run with
the engine's own Python: ``tests/support/xgrammar_verdicts.py``). The gateway admits exactly the ``ok``
rows (``test_schema_grammar.py``), so together they say: what the gateway admits, the engine compiles into
a grammar whose every part has a finite instance; what it refuses, the engine cannot compile or would
fail on (an empty grammar: a 500) or write without end.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.support.engine import engine_settings
from tests.support.paths import REPO
from tests.support.schema_table import ROWS

pytestmark = pytest.mark.engine

SCRIPT = REPO / "tests" / "support" / "xgrammar_verdicts.py"


def _verdict(found: dict[str, Any]) -> str:
    if not found["compiled"]:
        return "compile"
    if not found["starts"]:
        return "empty"
    return {"complete": "ok", "prefix": "endless"}.get(found["witness"], f"witness {found['witness']}")


def test_every_row_of_the_schema_table_is_what_xgrammar_makes_of_it() -> None:
    rows = json.dumps([[schema, witness] for _, schema, _, witness, _ in ROWS])
    done = subprocess.run(
        [str(engine_settings().python), str(SCRIPT)], input=rows, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    wrong = [
        (name, verdict, _verdict(seen), seen)
        for (name, _, verdict, _, _), seen in zip(ROWS, found, strict=True)
        if _verdict(seen) != verdict
    ]
    assert wrong == []
    assert {v for _, _, v, _, _ in ROWS} == {"ok", "compile", "empty", "endless"}
