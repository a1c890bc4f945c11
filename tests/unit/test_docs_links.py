"""The README and ``docs/`` hold together: every relative link and anchor resolves, inside the repository.

Links are Markdown inline links ``[text](target)`` outside code blocks and code spans; an anchor is
checked against the headings of its file, slugged as GitHub does (lower case, punctuation dropped,
spaces to hyphens, ``-1``, ``-2`` for repeats). Engine-free.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a page's headings define."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(page.read_text()):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    """The targets of a page's inline links, code spans left out."""
    targets = []
    for line in prose_lines(page.read_text()):
        targets += _LINK.findall(_CODE_SPAN.sub("", line))
    return targets


def broken(page: Path) -> list[str]:
    """Why each relative link of ``page`` does not resolve (empty: all do)."""
    problems = []
    for target in links(page):
        if _SCHEME.match(target):
            continue  # a URL: not checked here
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(ROOT):
            problems.append(f"{target}: outside the repository")
        elif not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken(page) == []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_page_cites_a_document_outside_the_repository(page: Path) -> None:
    text = page.read_text()
    assert "DESIGN.md" not in text
    assert "../shared" not in text


def test_the_checker_sees_a_broken_link_and_a_broken_anchor(tmp_path: Path) -> None:
    """The checks above would fail on a bad link: a missing file, a missing anchor, a path out of the tree."""
    page = ROOT / "docs" / "api.md"
    assert "long-running-jobs" in anchors(page)
    assert slug("One `/execute`, request to record") == "one-execute-request-to-record"
    assert slug("Isolation between a session's scripts") == "isolation-between-a-sessions-scripts"
    bad = ROOT / "docs" / "_probe_broken_links.md"
    bad.write_text("[a](nope.md) [b](api.md#no-such-heading) [c](../../outside.md) [d](api.md#job-view) `[e](x.md)`\n")
    try:
        assert broken(bad) == [
            "nope.md: no such file",
            "api.md#no-such-heading: no heading with anchor #no-such-heading in docs/api.md",
            "../../outside.md: outside the repository",
        ]
    finally:
        bad.unlink()


def test_readme_leads_with_the_two_commands() -> None:
    """``.ci/run`` runs the README's test command: the README's first code block is exactly the two commands."""
    text = (ROOT / "README.md").read_text()
    first_block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    assert first_block == (
        "deploy/local.sh serve     # set everything up, then serve on http://127.0.0.1:8080\n"
        "deploy/local.sh test      # set everything up, then ruff, mypy --strict and the whole test suite\n"
    )
    assert "deploy/local.sh test" in (ROOT / ".ci" / "run").read_text()
    assert len(text.splitlines()) <= 220, "the README is the newcomer's first page: details go to docs/"
