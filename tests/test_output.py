"""CappedStream: head and tail kept, middle elided and counted, UTF-8 handled at the edges."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from service.output import ELISION_MARK, CappedStream


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
