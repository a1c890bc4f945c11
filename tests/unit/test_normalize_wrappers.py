"""Hostile review of ``service.normalize`` (issue 12, item 7): inputs that made a repair slow or wrong.

Normalization runs on a worker thread, but a regex match holds the GIL for as long as it runs: a slow one stalls
the whole service (``/healthz`` included) for every tenant.
"""

from __future__ import annotations

import time

import pytest

from service.normalize import normalize

SIZE = 60_000  # under MAX_CHARS: examined


@pytest.mark.parametrize(
    "text",
    [
        'f("")' + " " * SIZE + "x",  # a call's tail followed by whitespace: 21 s before
        'f("' + '"' * 10 + ")" + "\t" * SIZE + ";x",  # and by whitespace and a ';': 50 s before
        'f("")' + " ;" * (SIZE // 2),
        "run(cmd='" + "' ) " * (SIZE // 4),
    ],
)
def test_a_call_wrapper_with_whitespace_after_it_is_examined_in_linear_time(text: str) -> None:
    started = time.perf_counter()
    normalize(text)
    elapsed = time.perf_counter() - started
    assert elapsed < 2.0, elapsed  # generous (noisy shared machine): each takes a few ms after the fix


@pytest.mark.parametrize(
    ("text", "script"),
    [
        ('execute(command="python3 -c \'print("hi")\'")  ;  \n', 'print("hi")'),  # invalid Python: "hi" ends the string
        ('execute(command="python3 -c \'print("hi")\'"\n)\n', 'print("hi")'),
        ("execute(command='''python3 -c 'print(1)'''') ;", "print(1)"),  # the quote before ''' ends it early
        ('run("""python3 -c \'print("hi")\'")', None),  # ends with one quote: the body would be '""python3 ...'
    ],
)
def test_a_call_wrapper_is_still_unwrapped_as_before(text: str, script: str | None) -> None:
    result = normalize(text)
    if script is None:
        assert result.script == text and not result.repairs
    else:
        assert result.script == script and [r.kind for r in result.repairs] == ["shell_wrapper"]
