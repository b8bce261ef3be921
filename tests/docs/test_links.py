"""Every relative link in README.md and docs/*.md resolves (its file exists, its ``#anchor`` is a heading
of the target page, by GitHub's anchor rule), the README's contents list every page of docs/, and each
manual page links back to the README. The checker itself is tried on a small page with broken links."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.doc_links import Link, anchors, broken, links, slug
from tests.support.paths import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GENERATED_OR_OWN_LINE = {"experiments.md", "architecture.md"}  # generated; the map has its own first line


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    checked = [link for page in PAGES for link in links(page)]
    assert [why for link in checked if (why := broken(link))] == []
    assert len(checked) >= 40  # the README's contents and the pages' links are found at all


def test_the_readme_lists_every_page_of_docs() -> None:
    linked = {(REPO / link.target.partition("#")[0]).resolve() for link in links(REPO / "README.md")}
    assert [page.name for page in PAGES[1:] if page.resolve() not in linked] == []


@pytest.mark.parametrize(
    "page", [p for p in PAGES[1:] if p.name not in GENERATED_OR_OWN_LINE], ids=lambda p: p.name
)
def test_each_manual_page_says_what_it_covers_and_links_back_to_the_readme(page: Path) -> None:
    title, blank, *rest = page.read_text().split("\n")
    first = " ".join(rest[: rest.index("")])  # the paragraph under the title
    assert title.startswith("# ") and blank == "", title
    assert first and "](../README.md" in first, first


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Quotas", "quotas"),
        ("Priority, fairness and load shedding", "priority-fairness-and-load-shedding"),
        (
            "Tools, structured outputs, logprobs, n > 1, Responses API: which path serves what",
            "tools-structured-outputs-logprobs-n--1-responses-api-which-path-serves-what",
        ),
        ("Gateway benchmark (overhead per request)", "gateway-benchmark-overhead-per-request"),
        (
            "1. Workers for 1,000 RPS of short prompts (`python -m loadgen.fleet.experiments workers`)",
            "1-workers-for-1000-rps-of-short-prompts-python--m-loadgenfleetexperiments-workers",
        ),
        (
            "`service/__init__.py` and *emphasis* and [a link](x.md)",
            "service__init__py-and-emphasis-and-a-link",
        ),
        ("snake_case_name stays", "snake_case_name-stays"),
    ],
)
def test_anchors_follow_githubs_rule(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


BAD_PAGE = """# Page

## Quotas
## Quotas
Good: [same page](#quotas), [second of two](#quotas-1), [other page](other.md#a-heading),
[a folder](sub/), [an image](sub/pic.png), [external](https://example.com/nope.md#x).
Broken: [missing file](missing.md), [missing anchor](other.md#no-such-heading),
[missing here](#quotas-2), ![missing image](sub/none.png),
[anchor into a picture](sub/pic.png#x).
Inline code is not a link: `[not a link](gone.md)`.

```bash
echo "[not a link](gone-too.md)"
```

[ref]: gone-ref.md
"""


def test_the_checker_finds_each_kind_of_broken_link(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "pic.png").write_bytes(b"\x89PNG")
    (tmp_path / "other.md").write_text("# Other\n\n## A heading\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(BAD_PAGE)
    found = links(page)
    assert "gone.md" not in {link.target for link in found}
    assert "gone-too.md" not in {link.target for link in found}
    assert "https://example.com/nope.md#x" not in {link.target for link in found}
    failing = {link.target for link in found if broken(link)}
    assert failing == {
        "missing.md",
        "other.md#no-such-heading",
        "#quotas-2",
        "sub/none.png",
        "sub/pic.png#x",
        "gone-ref.md",
    }
    assert broken(Link(page, 5, "other.md#a-heading")) is None
    assert "no heading with anchor #no-such-heading in other.md" in (
        broken(Link(page, 7, "other.md#no-such-heading")) or ""
    )
    assert anchors((tmp_path / "other.md").read_text()) == {"other", "a-heading"}
