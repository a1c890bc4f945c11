"""A job's output folder says its owner and, once ended, what it keeps in the store (``service.jobs.marks``): as
extended attributes, or in the owner file where the file system keeps none, and as folders of older versions did."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from service.jobs import marks
from service.jobs.marks import OWNER_FILE, RECORDS_FILE, mark_owner, mark_stored, read_marks


def test_marks_are_attributes_of_the_folder_and_make_no_file(tmp_path: Path) -> None:
    mark_owner(tmp_path, "alice")
    assert read_marks(tmp_path) == ("alice", None)  # not ended yet
    mark_stored(tmp_path, 5000)
    assert read_marks(tmp_path) == ("alice", 5000)
    assert list(tmp_path.iterdir()) == []  # no file: a new file costs the file system far more than an attribute
    assert os.getxattr(tmp_path, marks.OWNER_ATTR) == b"alice"


def test_without_attributes_the_owner_file_holds_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise OSError(errno.ENOTSUP, "Operation not supported")

    monkeypatch.setattr(os, "setxattr", refuse)
    monkeypatch.setattr(os, "getxattr", refuse)
    mark_owner(tmp_path, "bob")
    assert (tmp_path / OWNER_FILE).read_text() == "bob\n"
    assert read_marks(tmp_path) == ("bob", None)
    mark_stored(tmp_path, 42)
    assert (tmp_path / OWNER_FILE).read_text() == "bob\n42\n"  # appended: the owner's line is never rewritten
    assert read_marks(tmp_path) == ("bob", 42)


def test_without_attributes_or_owner_file_the_stored_bytes_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> None:
        raise OSError(errno.ENOTSUP, "Operation not supported")

    monkeypatch.setattr(os, "setxattr", refuse)
    with pytest.raises(OSError):  # never made by mark_stored: its first line would be read as the owner
        mark_stored(tmp_path, 42)
    assert not (tmp_path / OWNER_FILE).exists()


def test_folders_of_older_versions_are_read(tmp_path: Path) -> None:
    (tmp_path / OWNER_FILE).write_text("carol")  # no line break: written before the stored bytes were appended
    (tmp_path / RECORDS_FILE).write_text("7")
    assert read_marks(tmp_path) == ("carol", 7)
    unmarked = tmp_path / "older"
    unmarked.mkdir()
    assert read_marks(unmarked) == (None, None)  # before owners were recorded: counted against nobody


def test_a_mark_that_is_not_a_count_counts_nothing(tmp_path: Path) -> None:
    os.setxattr(tmp_path, marks.OWNER_ATTR, b"dave")
    os.setxattr(tmp_path, marks.STORED_ATTR, b"lots")
    assert read_marks(tmp_path) == ("dave", None)


def test_an_owner_attribute_with_no_room_for_the_stored_bytes_moves_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mark_owner(tmp_path, "erin")
    real = os.setxattr

    def full(path: object, name: str, *args: object) -> None:
        if name == marks.STORED_ATTR:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "setxattr", full)
    mark_stored(tmp_path, 9)
    assert (tmp_path / OWNER_FILE).read_text() == "erin\n9\n"
    assert read_marks(tmp_path) == ("erin", 9)
