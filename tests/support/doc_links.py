"""Relative links in markdown pages, and whether each resolves: its file exists and its ``#anchor`` is a
heading of the target page.

Anchors follow GitHub's rule for headings (github-slugger, which github.com's renderer uses): the heading's
text as rendered (inline code, emphasis and link markup removed), lower-cased, every character that is not a
letter, a digit, a space, ``-`` or ``_`` dropped, each space turned into ``-``; a heading whose anchor is
already taken in the page gets ``-1``, ``-2``, ... Links inside fenced code blocks and inline code are not
links and are not checked; links with a scheme (``https:``, ``mailto:``) are not relative and are not checked.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_DROPPED = re.compile(r"[^\w\- ]", re.UNICODE)


@dataclass(frozen=True)
class Link:
    """One link of a page.

    Attributes:
        page: the markdown file it is written in.
        line: its 1-based line number there.
        target: what it points to, as written (``docs/api.md#errors``, ``#quotas``).
    """

    page: Path
    line: int
    target: str


def _outside_code(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line with inline code blanked) for every line outside fenced code blocks."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif match.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's markdown text: ``"### Tools, n > 1: which path"`` -> (given the text
    after the hashes) ``"tools-n--1-which-path"``."""
    codes: list[str] = []

    def keep(match: re.Match[str]) -> str:  # inline code is rendered as it is written
        codes.append(match.group(2))
        return f"\0{len(codes) - 1}\0"

    text = _CODE_SPAN.sub(keep, heading)
    text = _INLINE_LINK.sub(lambda m: m.group(1), text)
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"\*+|(?<!\w)_+|_+(?!\w)", "", text)  # emphasis markers, not snake_case's underscores
    text = re.sub(r"\0(\d+)\0", lambda m: codes[int(m.group(1))], text)
    return _DROPPED.sub("", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in _outside_code(text):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        anchor = base if base not in seen else f"{base}-{seen[base]}"
        seen[base] = seen.get(base, 0) + 1
        found.add(anchor)
    return found


def links(page: Path) -> list[Link]:
    """Every relative link of ``page`` (inline ``[text](target)``, images and reference definitions)."""
    found: list[Link] = []
    for number, line in _outside_code(page.read_text()):
        plain = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)
        targets = [m.group(2) for m in _INLINE_LINK.finditer(plain)]
        definition = _REFERENCE_DEF.match(plain)
        if definition:
            targets.append(definition.group(1))
        found += [Link(page, number, t) for t in targets if t and not _SCHEME.match(t)]
    return found


def broken(link: Link) -> str | None:
    """Why ``link`` does not resolve (``None`` when it does): a missing file, or an anchor that is not a
    heading of its target page."""
    path, _, anchor = link.target.partition("#")
    target = (link.page.parent / path).resolve() if path else link.page.resolve()
    where = f"{link.page.name}:{link.line}: {link.target}"
    if not target.exists():
        return f"{where}: no file {target}"
    if anchor:
        if target.suffix != ".md" or target.is_dir():
            return f"{where}: an anchor into {target.name}, which is not a markdown page"
        if anchor not in anchors(target.read_text()):
            return f"{where}: no heading with anchor #{anchor} in {target.name}"
    return None
