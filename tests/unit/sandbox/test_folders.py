"""SandboxFolders: the sandboxes' folders on a tmpfs of their own, mounted and unmounted by the service."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.sandbox.folders import OWN_MARK, SandboxFolders
from tests.conftest import in_ci


@pytest.fixture
def root_only() -> None:
    if os.geteuid() != 0:
        if in_ci():
            pytest.fail("mounting a tmpfs needs root")
        pytest.skip("mounting a tmpfs needs root")


def test_a_tmpfs_is_mounted_for_the_folders_and_unmounted_at_close(tmp_path: Path, root_only: None) -> None:
    folders = SandboxFolders(tmp_path / "run", 16)
    assert folders.open()
    try:
        assert os.path.ismount(folders.path)
        assert (folders.path / OWN_MARK).exists()
        assert os.stat(folders.path).st_mode & 0o777 == 0o700
        (folders.path / "jobs").mkdir()
    finally:
        folders.close()
    assert not os.path.ismount(folders.path)
    assert list(folders.path.iterdir()) == []  # nothing of it reached the disk


def test_a_tmpfs_left_by_a_crashed_run_is_reused_and_unmounted(tmp_path: Path, root_only: None) -> None:
    crashed = SandboxFolders(tmp_path / "run", 16)
    assert crashed.open()  # never closed
    again = SandboxFolders(tmp_path / "run", 16)
    assert again.open()
    again.close()
    assert not os.path.ismount(tmp_path / "run")


def test_size_zero_keeps_the_folders_on_disk(tmp_path: Path) -> None:
    folders = SandboxFolders(tmp_path / "run", 0)
    assert not folders.open()
    assert folders.path.is_dir() and not os.path.ismount(folders.path)
    folders.close()
