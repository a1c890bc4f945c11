"""What the repairs of ``service.normalize`` share: compiling a script, its lines, and telling code from text.

"Compiles" means ``compile(script, ..., "exec")`` in the service's interpreter (top-level await allowed), warnings
off. A candidate repair is ``(new text, detail)``: the detail is the one-line account the job view shows.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Iterator

COMPILE_FILENAME = "<ptc-normalize>"
MAX_PROSE_LINES = 100  # non-blank lines of text around a fenced block; more is not "prose around a script"
MAX_HINT_TEXT = 60  # characters of a line (or an opening tag) quoted in a hint or a detail

#: One candidate repair of a text: (new text, detail). Each repair returns its candidates, best first ([]: none).
Candidate = tuple[str, str]

_FILTER_MODULE = re.escape(COMPILE_FILENAME)


def silence_compile_warnings() -> None:
    """Ignore the warnings of compiling under ``COMPILE_FILENAME`` (SyntaxWarning for ``"\\d"`` etc.), and only those.

    A filter is installed on first use (not at import) and again if someone reset the filters;
    ``warnings.catch_warnings`` would not do: it is not thread-safe.
    """
    if not any(getattr(f[3], "pattern", None) == _FILTER_MODULE for f in warnings.filters):
        warnings.filterwarnings("ignore", module=_FILTER_MODULE)


def compile_error(source: str) -> BaseException | None:
    """None if ``source`` compiles, else the error (SyntaxError, or ValueError/RecursionError/MemoryError...)."""
    silence_compile_warnings()
    try:
        # Top-level await is allowed: the runtime runs such a script as a coroutine (docs/tools-and-manifests.md).
        compile(source, COMPILE_FILENAME, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as exc:
        return exc
    return None


def compiles(source: str) -> bool:
    """Whether ``source`` compiles as a module in this interpreter (no code runs; warnings are not shown)."""
    return compile_error(source) is None


def line_forms(text: str) -> Iterator[tuple[list[str], str, str]]:
    """The text as lines: split at real line breaks, and (for a text of at most 3 real lines that holds
    literal ``\\n`` escapes) split at those escapes. Yields ``(lines, separator, how)``; joining is exact."""
    yield text.split("\n"), "\n", ""
    if "\\n" in text and text.count("\n") <= 2:
        yield text.split("\\n"), "\\n", " (its line breaks written as literal \\n)"


def is_code_line(line: str) -> bool:
    """A line of text outside a fence that is itself Python (not a lone name or constant, like ``Output``)."""
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
        return False
    try:
        silence_compile_warnings()
        tree = ast.parse(stripped, COMPILE_FILENAME)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    lone = len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr)
    return not (lone and isinstance(tree.body[0].value, (ast.Name, ast.Constant)))  # type: ignore[attr-defined]


def prose_around(before: str, after: str) -> int | None:
    """Non-blank lines of text around a wrapper, or None when they are too many or one of them is itself code."""
    outside = before.split("\n") + after.split("\n")
    if sum(1 for line in outside if line.strip()) > MAX_PROSE_LINES or any(map(is_code_line, outside)):
        return None
    return sum(1 for line in outside if line.strip())


def does_nothing(code: str) -> bool:
    """Whether ``code`` parses as nothing but a lone name or constant (``hi`` between tags is text, not a script)."""
    try:
        silence_compile_warnings()
        body = ast.parse(code, COMPILE_FILENAME).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return not body or (
        len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, (ast.Name, ast.Constant))
    )


#: The start of a string literal: its prefix (group 1) and its quote (group 2).
STRING_START = re.compile(r"(?i)(rb|br|fr|rf|r|b|u|f)?('''|\"\"\"|'|\")")


def is_name_char(c: str) -> bool:
    """Whether ``c`` may be part of a Python name."""
    return c.isalnum() or c == "_"
