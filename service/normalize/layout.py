"""The repairs of a script's layout: ``bom``, ``crlf``, ``indent`` and ``tabs`` (see ``service.normalize``)."""

from __future__ import annotations

import ast
import re

from service.normalize.source import COMPILE_FILENAME, STRING_START, Candidate, is_name_char, silence_compile_warnings


def bom(text: str) -> list[Candidate]:
    """``bom``: the text without a leading byte-order mark (U+FEFF)."""
    if not text.startswith("\ufeff"):
        return []
    return [(text.lstrip("\ufeff"), "removed a leading byte-order mark (U+FEFF)")]


def crlf(text: str) -> list[Candidate]:
    """``crlf``: CRLF and lone CR line endings made LF."""
    if "\r" not in text:
        return []
    pairs = text.count("\r\n")
    fixed = text.replace("\r\n", "\n").replace("\r", "\n")
    lone = text.count("\r") - pairs
    parts = [f"{pairs} CRLF"] if pairs else []
    parts += [f"{lone} lone CR"] if lone else []
    return [(fixed, f"line endings: {' and '.join(parts)} became LF")]


_INDENT_PREFIX = re.compile(r"[ \t]*+")


def dedent(text: str) -> tuple[str, str]:
    """``text`` without the indentation common to its lines of code, and that indentation.

    Unlike ``textwrap.dedent``, blank lines and comments do not count, blank lines are left as they are (one may
    be inside a string literal, and editors do not indent blank lines), and so is a comment without the whole
    common indentation.
    """
    lines = text.split("\n")
    common: str | None = None
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        prefix = _INDENT_PREFIX.match(line).group()  # type: ignore[union-attr]  # always matches
        if common is None or prefix.startswith(common):
            common = prefix if common is None else common
        else:
            k = 0
            while k < len(common) and k < len(prefix) and common[k] == prefix[k]:
                k += 1
            common = common[:k]
        if not common:
            return text, ""
    if not common:
        return text, ""
    return "\n".join(
        line[len(common) :] if line.startswith(common) and line.strip() else line for line in lines
    ), common


def indent(text: str) -> list[Candidate]:
    """``indent``: the text without the indentation common to its lines of code (``dedent``)."""
    dedented, common = dedent(text)
    if not common:
        return []
    spaces, tab_chars = common.count(" "), common.count("\t")
    width = " and ".join(f"{n} {unit}" for n, unit in ((spaces, "space(s)"), (tab_chars, "tab(s)")) if n)
    return [(dedented, f"removed the indentation common to every line ({width})")]


_LEADING_WS = re.compile(r"^[ \t]+", re.M)


def _line_starts_in_strings(text: str) -> set[int]:
    """Numbers (0-based) of the lines that begin inside a string literal (their leading whitespace is data)."""
    inside: set[int] = set()
    line = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif (c in "'\"" or c.isalpha()) and (i == 0 or not is_name_char(text[i - 1])):
            match = STRING_START.match(text, i)
            if match is None:
                i += 1
                while i < n and is_name_char(text[i]):
                    i += 1
                continue
            quote = match.group(2)
            j = match.end()
            while j < n:
                if text[j] == "\\":
                    if text[j + 1 : j + 2] == "\n":
                        line += 1
                        inside.add(line)
                    j += 2
                elif text.startswith(quote, j):
                    j += len(quote)
                    break
                elif text[j] == "\n":
                    if len(quote) == 1:
                        break  # not closed: the outer loop counts the line break
                    line += 1
                    inside.add(line)
                    j += 1
                else:
                    j += 1
            i = j
        else:
            i += 1
    return inside


def _expand_tabs(text: str, width: int, keep: set[int]) -> str:
    lines = text.split("\n")
    for k, line in enumerate(lines):
        if k in keep:
            continue
        match = _LEADING_WS.match(line)
        if match and "\t" in match.group():
            lines[k] = match.group().expandtabs(width) + line[match.end() :]
    return "\n".join(lines)


def _program(source: str) -> str | None:
    try:
        silence_compile_warnings()
        return ast.dump(ast.parse(source, COMPILE_FILENAME))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def tabs(text: str) -> list[Candidate]:
    """``tabs``: tabs in indentation expanded with the one width (8, 4 or 2) that gives a program; [] when widths
    disagree."""
    if "\t" not in text or not re.search(r"^[ \t]*\t", text, re.M):
        return []
    keep = _line_starts_in_strings(text)
    expanded = {width: _expand_tabs(text, width, keep) for width in (8, 4, 2)}
    programs = {width: _program(source) for width, source in expanded.items()}
    good = {width: program for width, program in programs.items() if program is not None}
    if not good:
        return [(expanded[8], "expanded tabs in indentation to 8 columns")]
    if len(set(good.values())) != 1:
        return []  # tab widths disagree on the program: ambiguous, no guess
    width = min(good, key=lambda w: (w != 8, w))
    return [(expanded[width], f"expanded tabs in indentation to {width} columns (the only reading that compiles)")]
