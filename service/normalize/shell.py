"""The ``shell_wrapper`` repair: a script sent inside a shell command (``python3 -c '...'``, a heredoc, or a call
such as ``execute(command="python3 -c '...'")``), the shell's quoting undone exactly (see ``service.normalize``)."""

from __future__ import annotations

import re

from service.normalize.source import Candidate, line_forms

# Shell words, POSIX sh plus bash's $'...': the quoting is undone exactly; anything the shell would expand is refused.

_EXPANDS = re.compile(r"[A-Za-z_0-9{(@*#?$!-]")
_ANSI_C = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "f": "\f", "v": "\v", "e": "\x1b", "E": "\x1b"}
_ANSI_C.update({"\\": "\\", "'": "'", '"': '"', "?": "?"})


class _NotExact(Exception):
    """The shell would do something to this word that is not undoing its quoting (an expansion, an operator)."""


def _ansi_c(s: str, i: int) -> tuple[str, int]:
    """Decode bash's ``$'...'`` body from ``s[i]`` (after the opening quote); returns (text, index after the quote)."""
    out: list[str] = []
    while i < len(s):
        c = s[i]
        if c == "'":
            return "".join(out), i + 1
        if c != "\\" or i + 1 >= len(s):
            out.append(c)
            i += 1
            continue
        e = s[i + 1]
        if e in _ANSI_C:
            out.append(_ANSI_C[e])
            i += 2
        elif e == "x" and (m := re.match(r"[0-9a-fA-F]{1,2}", s[i + 2 :])):
            out.append(chr(int(m.group(), 16)))
            i += 2 + len(m.group())
        elif e in "01234567" and (m := re.match(r"[0-7]{1,3}", s[i + 1 :])):
            out.append(chr(int(m.group(), 8) & 0xFF))
            i += 1 + len(m.group())
        elif e in "uU" and (m := re.match(r"[0-9a-fA-F]{1,8}" if e == "U" else r"[0-9a-fA-F]{1,4}", s[i + 2 :])):
            out.append(chr(int(m.group(), 16)))
            i += 2 + len(m.group())
        else:
            out += ["\\", e]
            i += 2
    raise _NotExact("unterminated $'...'")


def _shell_word(s: str, i: int) -> tuple[str, int]:
    """One shell word starting at ``s[i]`` with its quoting undone; returns (word, index after it).

    Raises:
        _NotExact: the word holds an expansion, a glob or an operator, or a quote is not closed.
    """
    out: list[str] = []
    n = len(s)
    while i < n:
        c = s[i]
        if c in " \t\n":
            break
        if c == "'":
            j = s.find("'", i + 1)
            if j < 0:
                raise _NotExact("unterminated '...'")
            out.append(s[i + 1 : j])
            i = j + 1
        elif c == '"':
            i += 1
            while True:
                if i >= n:
                    raise _NotExact('unterminated "..."')
                c = s[i]
                if c == '"':
                    i += 1
                    break
                if c == "\\" and i + 1 < n and s[i + 1] in '$`"\\\n':
                    if s[i + 1] != "\n":
                        out.append(s[i + 1])
                    i += 2
                elif c == "`" or (c == "$" and i + 1 < n and _EXPANDS.match(s[i + 1])):
                    raise _NotExact("expansion inside double quotes")
                else:
                    out.append(c)
                    i += 1
        elif c == "$" and s.startswith("$'", i):
            text, i = _ansi_c(s, i + 2)
            out.append(text)
        elif c == "\\":
            if i + 1 >= n:
                raise _NotExact("trailing backslash")
            if s[i + 1] != "\n":
                out.append(s[i + 1])
            i += 2
        elif c in "|&;<>()`*?[" or (c == "$" and i + 1 < n and _EXPANDS.match(s[i + 1])) or (c == "~" and not out):
            raise _NotExact(f"unquoted {c!r}")
        else:
            out.append(c)
            i += 1
    return "".join(out), i


_PYTHON = r"(?:(?:/usr(?:/local)?)?/bin/)?(?:env\s+)?python(?:3(?:\.\d+)?)?(?:\s+-[BEIOsSu]+)*"
DASH_C = re.compile(rf"\A\s*(?:\$\s+|!)?(?P<cmd>{_PYTHON}\s+-c)\s+", re.S)
HEREDOC_PY = re.compile(rf"^\s*(?:\$\s+)?{_PYTHON}(?:\s+-)?\s*<<(?P<dash>-?)\s*(?P<q>['\"]?)(?P<delim>\w+)(?P=q)\s*$")
HEREDOC_CAT = re.compile(
    rf"^\s*(?:\$\s+)?cat\s*<<(?P<dash>-?)\s*(?P<q>['\"]?)(?P<delim>\w+)(?P=q)\s*\|\s*{_PYTHON}(?:\s+-)?\s*$"
)
# The head of a call holding one string argument: ``execute(command="``. The tail (``")`` and what may follow it) is
# matched by ``_call_body`` with string methods: as a regex (``(?P=q)\s*\)\s*;?\s*\Z`` after a greedy body) it took
# quadratic time on whitespace after a ``)`` (50 s for 64 KiB).
CALL = re.compile(
    r"\A\s*(?P<fn>[A-Za-z_][\w.]*)\(\s*(?:(?P<kw>[A-Za-z_]\w*)\s*=\s*)?(?P<prefix>[rRuU]?)(?P<q>\"\"\"|'''|\"|')"
)
_PY_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "\n": ""}


def _call_body(text: str, head: re.Match[str]) -> str | None:
    """The string argument's body of a call ``text`` whose head ``CALL`` matched: up to the last quote of its kind
    that is followed only by whitespace, ``)``, whitespace, an optional ``;`` and whitespace; None if ``text`` does
    not end so. Linear in the length of ``text``."""
    tail = text.rstrip()
    if tail.endswith(";"):
        tail = tail[:-1].rstrip()
    if not tail.endswith(")"):
        return None
    tail = tail[:-1].rstrip()
    quote, start = head.group("q"), head.end()
    if len(quote) == 3 and not (tail.endswith(quote) and len(tail) - 3 >= start):
        quote, start = quote[0], head.start("q") + 1  # as the regex would backtrack: a one-quote string
    if not tail.endswith(quote) or len(tail) - len(quote) < start:
        return None
    return text[start : len(tail) - len(quote)]


def _dash_c(text: str) -> Candidate | None:
    match = DASH_C.match(text)
    if match is None:
        return None
    try:
        script, end = _shell_word(text, match.end())
    except _NotExact:
        return None
    if text[end:].strip():
        return None  # more words or operators after the script: not only a wrapper
    cmd = " ".join(match.group("cmd").split())
    return script, f"unwrapped the shell command {cmd} '...' (shell quoting undone)"


def _heredoc_body(lines: list[str], sep: str) -> tuple[str, str] | None:
    """The script of a heredoc command in ``lines`` and the command line, or None."""
    first = next((k for k, line in enumerate(lines) if line.strip()), None)
    if first is None:
        return None
    match = HEREDOC_PY.match(lines[first]) or HEREDOC_CAT.match(lines[first])
    if match is None:
        return None
    delim, quoted, dash = match.group("delim"), bool(match.group("q")), bool(match.group("dash"))
    body: list[str] = []
    for k in range(first + 1, len(lines)):
        line = lines[k].lstrip("\t") if dash else lines[k]
        if line.rstrip() == delim:
            if any(rest.strip() for rest in lines[k + 1 :]):
                return None  # more commands after the heredoc
            script: str | None = sep.join(body)
            if not quoted:
                script = _unquoted_heredoc(sep.join(body), escaped=sep != "\n")
            if script is None:
                return None
            return script + ("\n" if sep == "\n" else ""), " ".join(lines[first].split())
        body.append(line)
    return None


def _unquoted_heredoc(body: str, escaped: bool) -> str | None:
    """The body of a heredoc whose delimiter is unquoted, as the shell passes it; None if it would expand."""
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body) and body[i + 1] in "$`\\\n":
            if escaped:
                return None  # cannot tell a quoted backslash from a line-break escape: not exact
            if body[i + 1] != "\n":
                out.append(body[i + 1])
            i += 2
            continue
        if c == "`" or (c == "$" and i + 1 < len(body) and _EXPANDS.match(body[i + 1])):
            return None
        out.append(c)
        i += 1
    return "".join(out)


def _py_string_body(body: str, raw: bool) -> str:
    """The value of a Python string literal's body (the escapes a model uses; others are kept as written)."""
    if raw:
        return body
    return re.sub(r"\\(.)", lambda m: _PY_ESCAPES.get(m.group(1), m.group(0)), body, flags=re.S)


def shell_wrapper(text: str) -> list[Candidate]:
    """``shell_wrapper``: the script of a ``python -c``, a heredoc, or a call holding one of them."""
    found = _dash_c(text)
    if found is not None:
        return [found]
    for lines, sep, how in line_forms(text):
        heredoc = _heredoc_body(lines, sep)
        if heredoc is not None:
            script, command = heredoc
            return [(script, f"ran the script of the heredoc {command}{how} (shell quoting undone)")]
    call = CALL.match(text)
    body = _call_body(text, call) if call is not None else None
    if call is not None and body is not None:
        inner = _py_string_body(body, raw=call.group("prefix") in ("r", "R"))
        found = _dash_c(inner)
        if found is None:
            heredoc = _heredoc_body(inner.split("\n"), "\n")
            found = (heredoc[0], f"ran the script of the heredoc {heredoc[1]}") if heredoc else None
        if found is not None:
            kw = f"{call.group('kw')}=" if call.group("kw") else ""
            return [(found[0], f"unwrapped the call {call.group('fn')}({kw}...), then: {found[1]}")]
    return []
