"""docs/architecture.md's rooms table holds: no import runs against it, and no two modules import each
other."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.import_rules import import_cycles, read_rooms, violations
from tests.support.paths import REPO

DOC = REPO / "docs" / "architecture.md"


def test_every_import_follows_the_rooms_table() -> None:
    rooms = read_rooms(DOC.read_text())
    assert violations(REPO, rooms) == [], "an import runs against docs/architecture.md's rooms table"


def test_no_two_modules_import_each_other_anywhere() -> None:
    assert import_cycles(REPO) == []


def test_the_table_names_every_room_of_service() -> None:
    rooms = read_rooms(DOC.read_text())
    folders = {p.parent for p in (REPO / "service").glob("*/__init__.py")}
    modules = {p for p in (REPO / "service").glob("*.py")}
    named = {REPO / room.replace(".", "/") for room in rooms}
    assert {f for f in folders if f not in named} == set()
    assert {m for m in modules if m.with_suffix("") not in named and m.name != "__init__.py"} == set()


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in ("service", "tenancy", "policies", "loadgen", "tests", "scripts"):
        (root / package).mkdir(exist_ok=True)
    return root


UPWARD = "room service.low may not import service.high"

TABLE = """<!-- rooms:start -->
| room | may import |
|---|---|
| `policies/` | — |
| `service/low/` | `policies/` |
| `service/high.py` | `service/low/`, `policies/` |
<!-- rooms:end -->"""


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"service/low/a.py": "import policies.x\n", "policies/x.py": ""}, []),
        (
            {"service/low/a.py": "def f():\n    from service.high import g\n", "service/high.py": ""},
            [f"service/low/a.py:2: service.low.a -> service.high ({UPWARD})"],
        ),
        (
            {"policies/x.py": "from ..service.low import a\n", "service/low/a.py": ""},
            ["policies/x.py:1: policies.x -> service.low.a (room policies may not import service.low)"],
        ),
        ({"service/other.py": ""}, ["service/other.py: service.other is in no room of the table"]),
    ],
)
def test_the_check_finds_an_import_against_the_table(
    tmp_path: Path, files: dict[str, str], expected: list[str]
) -> None:
    root = _tree(tmp_path, files)
    assert violations(root, read_rooms(TABLE)) == expected


def test_the_check_finds_modules_that_import_each_other(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "service/a.py": "from service import b\n",
            "service/b.py": "import service.c\n",
            "service/c.py": "from service.a import f\n",
            "service/d.py": "import service.a\n",
            "tests/t.py": "from tests import u\n",
            "tests/u.py": "import tests.t\n",
        },
    )
    assert import_cycles(root) == [["service.a", "service.b", "service.c"], ["tests.t", "tests.u"]]
