"""CappedStream: head and tail kept, middle elided and counted, UTF-8 handled at the edges; OutputRange: a
retained range read a slice at a time, its length fixed when opened."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from service.output import ELISION_MARK, CappedStream, OutputRange, read_range


def test_under_the_cap_everything_is_kept() -> None:
    stream = CappedStream(100)
    stream.write(b"hello ")
    stream.write(b"world")
    out = stream.render()
    assert (out.text, out.truncated, out.total_bytes, out.invalid_utf8) == ("hello world", False, 11, False)


def test_over_the_cap_head_and_tail_are_kept() -> None:
    stream = CappedStream(10)
    for i in range(100):
        stream.write(str(i % 10).encode())
    out = stream.render()
    assert out.truncated and out.total_bytes == 100
    assert out.text == "01234" + ELISION_MARK.format(n=90) + "56789"


def test_multibyte_characters_cut_at_the_gap_are_not_flagged() -> None:
    stream = CappedStream(8)
    stream.write(("é" * 50).encode())
    out = stream.render()
    assert not out.invalid_utf8
    head, tail = out.text.split(ELISION_MARK.format(n=92))
    assert head == "éé" and tail == "éé"


def test_invalid_bytes_are_replaced_and_flagged() -> None:
    stream = CappedStream(100)
    stream.write(b"a\xffb")
    out = stream.render()
    assert (out.text, out.invalid_utf8) == ("a\ufffdb", True)


@given(st.lists(st.binary(max_size=300), max_size=30), st.integers(min_value=2, max_value=200))
def test_any_writes_keep_exact_head_tail_and_total(chunks: list[bytes], cap: int) -> None:
    stream = CappedStream(cap)
    for chunk in chunks:
        stream.write(chunk)
    data = b"".join(chunks)
    assert stream.total_bytes == len(data)
    out = stream.render()
    if len(data) <= cap:
        assert out.text == data.decode("utf-8", "replace") and not out.truncated
    else:
        assert out.truncated
        assert stream._head == data[: cap // 2] and stream._tail == data[len(data) - (cap - cap // 2) :]


def test_an_output_range_gives_its_bytes_a_slice_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "stdout"
    data = bytes(range(256)) * 40
    path.write_bytes(data)
    retained = OutputRange.open(path, 100, 5000)
    assert (retained.offset, retained.length, retained.remaining) == (100, 5000, 5000)
    pieces = []
    while piece := retained.read(1024):
        assert len(piece) <= 1024
        pieces.append(piece)
    retained.close()
    assert b"".join(pieces) == data[100:5100] == read_range(path, 100, 5000)
    assert retained.read(1024) == b"" and retained.remaining == 0


def test_an_output_range_is_what_was_retained_when_it_opened(tmp_path: Path) -> None:
    path = tmp_path / "stdout"
    path.write_bytes(b"a" * 1000)
    retained = OutputRange.open(path, 900, 1 << 24)
    assert retained.length == 100
    with open(path, "ab") as f:  # the job writes on: the range keeps its length (its Content-Length)
        f.write(b"b" * 1000)
    path.unlink()  # purged meanwhile: the open file still gives the range
    assert retained.read(1 << 20) == b"a" * 100 and retained.read(1 << 20) == b""
    retained.close()
    retained.close()  # idempotent


def test_an_output_range_past_the_end_or_without_a_file_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "stdout"
    path.write_bytes(b"abc")
    for retained in (
        OutputRange.open(path, 3, 10),
        OutputRange.open(path, 2**63 - 1, 10),
        OutputRange.open(tmp_path / "nope", 0, 10),
    ):
        assert retained.length == 0 and retained.read(10) == b""
        retained.close()
