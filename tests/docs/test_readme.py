"""README.md stays an entrance (at most 15 KiB), and docs/configuration.md's table is the one generated
from the Settings tree (``python -m service config-table --doc docs/configuration.md``)."""

from __future__ import annotations

from service.config.doc import settings_rows, settings_table
from tests.support.paths import REPO

README = REPO / "README.md"
CONFIGURATION = REPO / "docs" / "configuration.md"
README_MAX_BYTES = 15 * 1024


def test_the_configuration_page_table_matches_the_settings() -> None:
    text = CONFIGURATION.read_text()
    start, end = "<!-- config-table:start -->\n", "\n<!-- config-table:end -->"
    table = text[text.index(start) + len(start) : text.index(end)]
    regenerate = "regenerate with: python -m service config-table --doc docs/configuration.md"
    assert table == settings_table(), regenerate
    assert len(settings_rows()) >= 35 and all(desc for _, _, desc in settings_rows())


def test_the_readme_is_an_entrance_of_at_most_15_kib() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move the detail into a page of docs/"


def test_no_generated_table_is_left_in_the_readme() -> None:
    text = README.read_text()
    for marker in ("config-table", "params-table", "responses-table"):
        assert f"<!-- {marker}:start -->" not in text, marker
