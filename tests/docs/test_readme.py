"""The README's configuration table is the one generated from the Settings tree."""

from __future__ import annotations

from service.config.doc import settings_rows, settings_table
from tests.support.paths import REPO

README = REPO / "README.md"


def test_readme_configuration_table_matches_the_settings() -> None:
    text = README.read_text()
    start, end = "<!-- config-table:start -->\n", "\n<!-- config-table:end -->"
    table = text[text.index(start) + len(start) : text.index(end)]
    assert table == settings_table(), "regenerate with: python -m service config-table"
    assert len(settings_rows()) >= 35 and all(desc for _, _, desc in settings_rows())
