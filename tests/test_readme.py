"""The README's settings table is the one rendered from ``Settings``.

Regenerate it with ``.venv/bin/python -m tests.test_readme``.
"""

from __future__ import annotations

from pathlib import Path

from service.settings import settings_table

README = Path(__file__).resolve().parent.parent / "README.md"
HEADER = "| variable | default | meaning |"


def test_readme_lists_every_setting() -> None:
    assert settings_table() in README.read_text(), "stale settings table: run .venv/bin/python -m tests.test_readme"


def rewrite_table() -> None:
    """Replace the README's settings table (from its header to the next blank line) with the current one."""
    text = README.read_text()
    start = text.index(HEADER)
    end = text.index("\n\n", start)
    README.write_text(text[:start] + settings_table() + text[end:])


if __name__ == "__main__":
    rewrite_table()
