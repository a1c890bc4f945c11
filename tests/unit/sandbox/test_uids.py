"""The uids a sandbox image offers (``labels.uid_range``) and the pick of a free one (``docker._free_uid``)."""

from __future__ import annotations

from service.sandbox.docker import _free_uid
from service.sandbox.labels import LABEL_UIDS, uid_range


def test_an_images_range_is_read_and_a_bad_one_is_none() -> None:
    assert uid_range({LABEL_UIDS: "1000000-1004095"}) == range(1000000, 1004096)
    for bad in ("", "x-y", "0-100", "5000-20000", "2000-1000", "1000000", f"20000-{2**31}", "20000-2000000"):
        assert uid_range({LABEL_UIDS: bad}) is None, bad
    assert uid_range({}) is None


def test_a_free_uid_is_never_a_taken_one() -> None:
    uids = range(20000, 20004)
    for _ in range(50):
        assert _free_uid(uids, {"20000", "20001"}) in (20002, 20003)
    assert _free_uid(uids, {"20000", "20001", "20003"}) == 20002
    assert _free_uid(uids, {str(n) for n in uids}) is None
