"""The commands that docs/configuration.md and docs/api.md name for their generated tables rewrite them:
run on a copy of each page with its tables emptied, ``--doc`` (and its old name ``--readme``) gives back
the page as committed, and touches nothing outside the markers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.__main__ import cli
from tests.support.paths import REPO

PAGES = {
    "config-table": (REPO / "docs" / "configuration.md", ["config-table"]),
    "params-table": (REPO / "docs" / "api.md", ["params-table", "responses-table"]),
}


def emptied(text: str, markers: list[str]) -> str:
    for marker in markers:
        pattern = rf"(<!-- {marker}:start -->\n).*?(\n<!-- {marker}:end -->)"
        text, count = re.subn(pattern, r"\1|old|\2", text, flags=re.DOTALL)
        assert count == 1, marker
    return text


@pytest.mark.parametrize("flag", ["--doc", "--readme"])
@pytest.mark.parametrize("command", sorted(PAGES))
def test_the_named_command_regenerates_the_page(tmp_path: Path, command: str, flag: str) -> None:
    page, markers = PAGES[command]
    committed = page.read_text()
    assert f"python -m service {command} --doc docs/{page.name}" in committed  # the page names its command
    copy = tmp_path / page.name
    copy.write_text(emptied(committed, markers))
    result = CliRunner().invoke(cli, [command, flag, str(copy)])
    assert result.exit_code == 0, result.output
    assert copy.read_text() == committed
