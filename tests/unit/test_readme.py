"""The settings table of ``docs/settings.md`` is the one rendered from ``Settings``.

Regenerate it with ``.venv/bin/python -m tests.unit.test_readme``.
"""

from __future__ import annotations

from pathlib import Path

from service.settings import settings_table

SETTINGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
HEADER = "| variable | default | meaning |"


def test_settings_doc_lists_every_setting() -> None:
    assert settings_table() in SETTINGS_DOC.read_text(), (
        "stale settings table in docs/settings.md: run .venv/bin/python -m tests.unit.test_readme"
    )


def rewrite_table() -> None:
    """Replace the settings table of ``docs/settings.md`` (from its header to the next blank line) with the current."""
    text = SETTINGS_DOC.read_text()
    start = text.index(HEADER)
    end = text.index("\n\n", start) if "\n\n" in text[start:] else len(text.rstrip("\n"))
    SETTINGS_DOC.write_text(text[:start] + settings_table() + text[end:])


if __name__ == "__main__":
    rewrite_table()
