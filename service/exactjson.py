"""JSON that keeps every value's exact meaning: integers of any size, no NaN, no infinities, no lone surrogates.

orjson is fast but reads an integer past 64 bits as a float (``12345678901234567890123`` becomes
``1.2345678901234568e+22``) and cannot write one; the stdlib ``json`` keeps such integers exactly. So
``loads`` reads with orjson unless the text holds a run of 19 or more digits (the shortest integer orjson
may round: ``-9999999999999999999`` is past int64), and then with the stdlib ``json``, refusing what orjson
refuses; ``dumps`` writes with orjson and falls back to the stdlib for an integer past 64 bits.

What crosses exactly: integers up to Python's limit of 4,300 digits (``sys.get_int_max_str_digits``), past it
refused; floats as IEEE doubles (JSON's own meaning of a number with a fraction or exponent). What is refused
(``ValueError``): text that is not JSON, not UTF-8, ``NaN`` / ``Infinity`` / a number that overflows to an
infinity, a lone surrogate escape (``"\\ud800"``), nesting past the parser's limit (about 1,000 levels).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19
_LONG_DIGITS_TEXT = re.compile(r"[0-9]{19}")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800 to \udfff: half of a pair, or a lone one


def has_long_digits(data: bytes | bytearray | memoryview | str) -> bool:
    """Whether 19 or more ASCII digits follow each other somewhere (in a number, or in a string: harmless)."""
    if isinstance(data, str):
        return _LONG_DIGITS_TEXT.search(data) is not None
    return _LONG_RUN in bytes(data).translate(_DIGITS_AS_ZERO)  # about 1.5 ms per MB (a regex: about 25)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range of a double")
    return value


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Decode JSON exactly (integers past 64 bits stay integers).

    Raises:
        ValueError: the text is not JSON, or holds what JSON cannot carry exactly (see the module).
    """
    if not has_long_digits(data):
        return orjson.loads(data)  # orjson.JSONDecodeError is a ValueError
    text = data if isinstance(data, str) else bytes(data).decode("utf-8")  # UnicodeDecodeError: a ValueError
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite)
        if isinstance(data, str) or _SURROGATE_ESCAPE.search(text):  # a str may hold one raw
            strict_dumps(value)  # a lone surrogate escape decodes to a str that UTF-8 cannot carry: refused
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None
    return value


def dumps(value: Any) -> bytes:
    """Encode a JSON value that came from ``loads`` (or is otherwise free of NaN and infinities) exactly.

    orjson first; an integer past 64 bits is written by the stdlib ``json`` instead. orjson would write NaN
    as ``null``: for values from outside (a client's answer, an MCP server's result) use ``strict_dumps``.

    Raises:
        ValueError: not representable as JSON (a lone surrogate, a non-JSON type, too deep).
    """
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return strict_dumps(value)


def strict_dumps(value: Any) -> bytes:
    """Encode with the stdlib ``json``: integers of any size, NaN and infinities refused, UTF-8 only.

    Raises:
        ValueError: not representable as JSON exactly.
    """
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8")
    except (TypeError, RecursionError) as exc:
        raise ValueError(f"not representable as JSON: {exc}") from None
