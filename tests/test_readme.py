"""The README's settings table is the one rendered from ``Settings``."""

from __future__ import annotations

from pathlib import Path

from service.settings import settings_table


def test_readme_lists_every_setting() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert settings_table() in readme
