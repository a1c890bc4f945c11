"""Script normalization: undo the mechanical damage models do to scripts before they run (docs/normalization.md).

Only a script that does not compile as it is gets touched: a script that
compiles is returned byte for byte (and so is one longer than ``MAX_CHARS``), with one exception: a script that is
exactly one expression statement whose value is a dict display with one code-like string field
(``{"code": "print(1)"}``, which would do nothing) runs that field's code (``json_wrapper``) when it compiles,
after repairs of its own if need be; so does a repaired script of that form. For one that does not, a small
depth-first search applies the repairs below (each at most once, in this
order) and keeps the first sequence whose result compiles; when none does, the
script is returned unchanged, with a one-line ``hint`` when a known mechanical
cause was recognized (it is added to the job's ``SyntaxError``).

==================  ========================================================================
kind                repair
==================  ========================================================================
``bom``             a leading byte-order mark (U+FEFF) is removed
``crlf``            CRLF (and lone CR) line endings become LF
``fence``           exactly one Markdown fenced block (```` ``` ```` or ``~~~``, any info
                    string, prose around it) is replaced by its content; several blocks, or
                    text around the block that is itself code, are never guessed at
``tag_wrapper``     XML-like tags of any name around the code (``<code>...</code>``, ``<execute lang="py">``,
                    nested ``<a><b>...</b></a>``), text around them allowed, are replaced by their content
                    (HTML entities decoded if that is what compiles); text around that is itself code, or
                    several tagged blocks, are never guessed at
``json_wrapper``    a JSON object (or Python dict literal) with one code-like string field (``CODE_KEYS``:
                    ``code``, ``script``, ``python`` ...; other fields plain values), possibly inside one tool-call
                    envelope (``{"name": ..., "arguments": {...}}``, the arguments also as a JSON string), text
                    around it allowed: the field's string runs
``shell_wrapper``   ``python3 -c '...'`` / ``python -c "..."`` (a prompt ``$`` allowed), a heredoc
                    ``python3 - <<'EOF' ... EOF`` (or ``cat <<EOF | python3``), or a call such as
                    ``execute(command="python3 -c '...'")`` is replaced by the inner script, with the
                    shell's (and the call's string-literal) quoting undone exactly; a word the
                    shell would expand (``$x``, backticks, globs) is not unwrapped
``literal_escapes`` a script written on (nearly) one line with the two characters ``\\n`` for its
                    line breaks: escapes outside string literals become line breaks (``\\n``,
                    ``\\r\\n``, ``\\r``) and tabs (``\\t``), string literals keep theirs, except that
                    ``\\n`` inside a triple-quoted string becomes the line break it stands for
                    (same value, same line numbers as the intended script); if the script was
                    escaped twice (``\\"`` outside strings), it is decoded as one string literal
``indent``          a script indented as a whole (``" print(1)"``) loses the indentation common to its lines of
                    code (lines inside multi-line strings too, as they were indented with it; blank lines stay)
``tabs``            indentation that mixes tabs and spaces (``TabError``) is expanded with the tab
                    width (8, 4 or 2) that compiles, only when every width that compiles gives the
                    same program
==================  ========================================================================

"Compiles" means ``compile(script, ..., "exec")`` in the service's interpreter,
warnings off. The sandbox compiles the script again with its own interpreter,
which stays the authority on what runs.

Every repair made is counted in the Prometheus counter ``NORMALIZATIONS``
(``ptc_script_normalizations_total{kind}``); ``service.metrics`` registers it
with each app's registry.
"""

from __future__ import annotations

import ast
import html
import json
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter

__all__ = [
    "KINDS",
    "NORMALIZATIONS",
    "Normalized",
    "Repair",
    "compiles",
    "count",
    "normalize",
    "prepare",
    "verdict_only",
    "view_fields",
    "with_hint",
]

KINDS = ("bom", "crlf", "fence", "tag_wrapper", "json_wrapper", "shell_wrapper", "literal_escapes", "indent", "tabs")
COMPILE_FILENAME = "<ptc-normalize>"
MAX_COMPILES = 16  # compile attempts per script (each repair sequence costs one); bounds the search
MAX_CHARS = 64 * 1024  # longer scripts run as sent: compiling holds the GIL (about 1 ms per KiB here)
MAX_PROSE_LINES = 100  # non-blank lines of text around a fenced block; more is not "prose around a script"
MAX_HINT_TEXT = 60
MAX_ERROR_TEXT = 2000  # characters of a compile error's message and text, as the in-sandbox runtime caps them
SYNTAX_ERRORS = frozenset({"SyntaxError", "IndentationError", "TabError"})

NORMALIZATIONS = Counter(
    "ptc_script_normalizations",
    "Repairs made to scripts before they ran, by kind (see service.normalize).",
    ["kind"],
    registry=None,
)


@dataclass(frozen=True)
class Repair:
    """One repair made: its ``kind`` (one of ``KINDS``) and a one-line ``detail`` for the job view."""

    kind: str
    detail: str

    def as_dict(self) -> dict[str, str]:
        """The job view's form: ``{"kind": ..., "detail": ...}``."""
        return {"kind": self.kind, "detail": self.detail}


@dataclass(frozen=True)
class Normalized:
    """The outcome of ``normalize``.

    Attributes:
        script: what is to run (``original`` itself unless a repair was made).
        original: the script as sent.
        repairs: the repairs made, in the order applied (empty: ``script is original``).
        hint: when the script still does not compile, a one-line hint for a recognized
            mechanical cause (literal escapes, fences, shell wrapper, unbalanced quotes, ...), else None.
        compile_error: when the script still does not compile, the service's own compile error as a job
            ``error`` (``type``, ``message``, and for a SyntaxError ``line``, ``column``, ``text``), else None.
    """

    script: str
    original: str
    repairs: tuple[Repair, ...] = ()
    hint: str | None = None
    compile_error: dict[str, Any] | None = None

    @property
    def changed(self) -> bool:
        """Whether the script that runs differs from the one sent."""
        return bool(self.repairs)

    def view(self) -> list[dict[str, str]]:
        """The job view's ``normalization`` list."""
        return [r.as_dict() for r in self.repairs]


# -- compiling ----------------------------------------------------------------------------------------------------


_FILTER_MODULE = re.escape(COMPILE_FILENAME)


def _silence_compile_warnings() -> None:
    """Ignore the warnings of compiling under ``COMPILE_FILENAME`` (SyntaxWarning for ``"\\d"`` etc.), and only those.

    A filter is installed on first use (not at import) and again if someone reset the filters;
    ``warnings.catch_warnings`` would not do: it is not thread-safe.
    """
    if not any(getattr(f[3], "pattern", None) == _FILTER_MODULE for f in warnings.filters):
        warnings.filterwarnings("ignore", module=_FILTER_MODULE)


def _compile_error(source: str) -> BaseException | None:
    """None if ``source`` compiles, else the error (SyntaxError, or ValueError/RecursionError/MemoryError...)."""
    _silence_compile_warnings()
    try:
        # Top-level await is allowed: the runtime runs such a script as a coroutine (docs/tools-and-manifests.md).
        compile(source, COMPILE_FILENAME, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as exc:
        return exc
    return None


def compiles(source: str) -> bool:
    """Whether ``source`` compiles as a module in this interpreter (no code runs; warnings are not shown)."""
    return _compile_error(source) is None


# -- the repairs --------------------------------------------------------------------------------------------------
#
# Each takes the text and returns its candidate repairs, best first: (new text, detail). None / [] = not applicable.

Candidate = tuple[str, str]


def _bom(text: str) -> list[Candidate]:
    if not text.startswith("\ufeff"):
        return []
    return [(text.lstrip("\ufeff"), "removed a leading byte-order mark (U+FEFF)")]


def _crlf(text: str) -> list[Candidate]:
    if "\r" not in text:
        return []
    crlf = text.count("\r\n")
    fixed = text.replace("\r\n", "\n").replace("\r", "\n")
    lone = text.count("\r") - crlf
    parts = [f"{crlf} CRLF"] if crlf else []
    parts += [f"{lone} lone CR"] if lone else []
    return [(fixed, f"line endings: {' and '.join(parts)} became LF")]


def _line_forms(text: str) -> Iterator[tuple[list[str], str, str]]:
    """The text as lines: split at real line breaks, and (for a text of at most 3 real lines that holds
    literal ``\\n`` escapes) split at those escapes. Yields ``(lines, separator, how)``; joining is exact."""
    yield text.split("\n"), "\n", ""
    if "\\n" in text and text.count("\n") <= 2:
        yield text.split("\\n"), "\\n", " (its line breaks written as literal \\n)"


_FENCE_OPEN = re.compile(r"^[ \t]*+(?P<fence>`{3,}+|~{3,}+)[ \t]*+(?P<info>[^\s`]*+)[^`]*+$")  # possessive: linear


@dataclass
class _Fences:
    blocks: list[tuple[int, int, str]] = field(default_factory=list)  # (first content line, end, opening fence line)
    unclosed: bool = False


def _fences(lines: list[str]) -> _Fences:
    """Fenced blocks (CommonMark-like: a closing fence is the same character, at least as long, alone on its line)."""
    found = _Fences()
    opened: tuple[int, str] | None = None
    for number, line in enumerate(lines):
        stripped = line.strip()
        if opened is None:
            match = _FENCE_OPEN.match(line.rstrip("\r"))
            if match:
                opened = (number, match.group("fence"))
        else:
            fence = opened[1]
            if stripped and set(stripped) == {fence[0]} and len(stripped) >= len(fence):
                found.blocks.append((opened[0] + 1, number, lines[opened[0]].strip()))
                opened = None
    if opened is not None:
        found.blocks.append((opened[0] + 1, len(lines), lines[opened[0]].strip()))
        found.unclosed = True
    return found


def _is_code_line(line: str) -> bool:
    """A line of text outside a fence that is itself Python (not a lone name or constant, like ``Output``)."""
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
        return False
    try:
        _silence_compile_warnings()
        tree = ast.parse(stripped, COMPILE_FILENAME)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    lone = len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr)
    return not (lone and isinstance(tree.body[0].value, (ast.Name, ast.Constant)))  # type: ignore[attr-defined]


def _fence(text: str) -> list[Candidate]:
    for lines, sep, how in _line_forms(text):
        found = _fences(lines)
        if len(found.blocks) != 1:
            continue
        start, end, opener = found.blocks[0]
        outside = lines[: start - 1] + lines[end + 1 :]
        if sum(1 for line in outside if line.strip()) > MAX_PROSE_LINES or any(map(_is_code_line, outside)):
            continue
        content = sep.join(lines[start:end])
        if not content.strip():
            continue
        dropped = sum(1 for line in outside if line.strip())
        closed = " (no closing fence)" if found.unclosed else ""
        detail = f"ran the content of the one fenced block {opener!r}{closed}{how}"
        detail += f"; {dropped} line(s) of text around it dropped" if dropped else ""
        content += "\n" if sep == "\n" and not content.endswith("\n") else ""
        dedented, common = _dedent(content) if sep == "\n" else (content, "")
        if common:  # indented as a whole, the content cannot compile: the dedented form first
            return [(dedented, detail + "; its common indentation removed"), (content, detail)]
        return [(content, detail)]
    return []


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
_DASH_C = re.compile(rf"\A\s*(?:\$\s+|!)?(?P<cmd>{_PYTHON}\s+-c)\s+", re.S)
_HEREDOC_PY = re.compile(rf"^\s*(?:\$\s+)?{_PYTHON}(?:\s+-)?\s*<<(?P<dash>-?)\s*(?P<q>['\"]?)(?P<delim>\w+)(?P=q)\s*$")
_HEREDOC_CAT = re.compile(
    rf"^\s*(?:\$\s+)?cat\s*<<(?P<dash>-?)\s*(?P<q>['\"]?)(?P<delim>\w+)(?P=q)\s*\|\s*{_PYTHON}(?:\s+-)?\s*$"
)
# The head of a call holding one string argument: ``execute(command="``. The tail (``")`` and what may follow it) is
# matched by ``_call_body`` with string methods: as a regex (``(?P=q)\s*\)\s*;?\s*\Z`` after a greedy body) it took
# quadratic time on whitespace after a ``)`` (50 s for 64 KiB).
_CALL = re.compile(
    r"\A\s*(?P<fn>[A-Za-z_][\w.]*)\(\s*(?:(?P<kw>[A-Za-z_]\w*)\s*=\s*)?(?P<prefix>[rRuU]?)(?P<q>\"\"\"|'''|\"|')"
)
_PY_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "\n": ""}


def _call_body(text: str, head: re.Match[str]) -> str | None:
    """The string argument's body of a call ``text`` whose head ``_CALL`` matched: up to the last quote of its kind
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
    match = _DASH_C.match(text)
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
    match = _HEREDOC_PY.match(lines[first]) or _HEREDOC_CAT.match(lines[first])
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


def _shell(text: str) -> list[Candidate]:
    found = _dash_c(text)
    if found is not None:
        return [found]
    for lines, sep, how in _line_forms(text):
        heredoc = _heredoc_body(lines, sep)
        if heredoc is not None:
            script, command = heredoc
            return [(script, f"ran the script of the heredoc {command}{how} (shell quoting undone)")]
    call = _CALL.match(text)
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


_STRING_START = re.compile(r"(?i)(rb|br|fr|rf|r|b|u|f)?('''|\"\"\"|'|\")")


def _is_name_char(c: str) -> bool:
    return c.isalnum() or c == "_"


def _decode_structural(text: str) -> tuple[str, int] | None:
    """``text`` with the literal escapes outside string literals turned into what they stand for.

    Returns (decoded, line breaks made), or None when the text is not of this form: a ``\\"`` or
    ``\\'`` outside a string (escaped twice), or a string literal that is not closed.
    """
    out: list[str] = []
    made = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":  # a comment ends at a line break, real or escaped
            j = i
            while j < n and text[j] != "\n" and not text.startswith("\\n", j) and not text.startswith("\\r\\n", j):
                j += 1
            out.append(text[i:j])
            i = j
        elif c == "\\":
            if text.startswith("\\r\\n", i):
                out.append("\n")
                made += 1
                i += 4
            elif text.startswith(("\\n", "\\r"), i):
                out.append("\n")
                made += 1
                i += 2
            elif text.startswith("\\t", i):
                out.append("\t")
                i += 2
            elif text[i + 1 : i + 2] in ("'", '"'):
                return None
            else:  # a backslash of its own (``\\n`` is a line continuation written with a literal \n)
                out.append(c)
                i += 1
        elif (c in "'\"" or c.isalpha()) and (i == 0 or not _is_name_char(text[i - 1])):
            match = _STRING_START.match(text, i)
            if match is None:
                j = i
                while j < n and _is_name_char(text[j]):
                    j += 1
                out.append(text[i : max(j, i + 1)])
                i = max(j, i + 1)
                continue
            quote = match.group(2)
            triple = len(quote) == 3
            out.append(match.group())
            j = match.end()
            while True:
                if j >= n:
                    return None
                ch = text[j]
                if ch == "\\":
                    if triple and text.startswith("\\n", j):
                        out.append("\n")  # a line break of a multi-line string: same value, same line numbers
                        j += 2
                    else:
                        out.append(text[j : j + 2])
                        j += 2
                elif text.startswith(quote, j):
                    out.append(quote)
                    j += len(quote)
                    break
                elif ch == "\n" and not triple:
                    return None
                else:
                    out.append(ch)
                    j += 1
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out), made


_JSON_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "/": "/", "\\": "\\", '"': '"', "'": "'"}
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|.)", re.S)


def _decode_full(text: str) -> str:
    """``text`` decoded as the body of one string literal (JSON's escapes, ``\\'`` and ``\\xHH``); CRLF -> LF."""

    def one(m: re.Match[str]) -> str:
        e = m.group(1)
        if len(e) > 1:
            return chr(int(e[1:], 16))
        return _JSON_ESCAPES.get(e, m.group(0))

    decoded = _ESCAPE.sub(one, text)
    try:  # JSON writes characters beyond U+FFFF as surrogate pairs
        decoded = decoded.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeError:
        pass
    return decoded.replace("\r\n", "\n")


def _literal_escapes(text: str) -> list[Candidate]:
    real_breaks = text.rstrip("\n").count("\n")
    if "\\" not in text:
        return []
    found: list[Candidate] = []
    structural = _decode_structural(text)
    if structural is not None:
        decoded, made = structural
        if made and made >= real_breaks:
            lines = decoded.count("\n") + 1
            detail = f"turned {made} literal \\n escape(s) outside string literals into line breaks ({lines} lines)"
            found.append((decoded, detail))
    escapes = text.count("\\n")
    if escapes and escapes >= real_breaks:
        decoded = _decode_full(text)
        if decoded != text and (structural is None or decoded != structural[0]):
            detail = f"decoded the script as one escaped string ({escapes} literal \\n; quotes, backslashes unescaped)"
            found.append((decoded, detail))
    return found


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
        elif (c in "'\"" or c.isalpha()) and (i == 0 or not _is_name_char(text[i - 1])):
            match = _STRING_START.match(text, i)
            if match is None:
                i += 1
                while i < n and _is_name_char(text[i]):
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
        _silence_compile_warnings()
        return ast.dump(ast.parse(source, COMPILE_FILENAME))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _tabs(text: str) -> list[Candidate]:
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


# Wrappers that are not code: XML-like tags, a JSON object (a tool call's), a script indented as a whole.

_TAG_OPEN = re.compile(r"<(?P<name>[A-Za-z][\w.:-]*+)(?:\s[^<>]*+)?>")  # possessive, stops at the next < or >: linear
MAX_TAG_CANDIDATES = 4  # opening tags tried as the wrapper (each costs one scan of the text)


def _peel_tags(text: str, lo: int, hi: int) -> tuple[int, int, list[str]]:
    """Inside ``text[lo:hi]``, peel tags that enclose all of it (``<a><b>...</b></a>``); linear in what is peeled.

    Returns the content's bounds and the names peeled, outermost first.
    """
    names: list[str] = []
    while True:
        start = lo
        while start < hi and text[start].isspace():
            start += 1
        end = hi
        while end > start and text[end - 1].isspace():
            end -= 1
        match = _TAG_OPEN.match(text, start, end)
        if match is None:
            return lo, hi, names
        close = f"</{match.group('name')}>"
        if end - len(close) < match.end() or text[end - len(close) : end].lower() != close.lower():
            return lo, hi, names
        names.append(match.group("name"))
        lo, hi = match.end(), end - len(close)


def _prose_around(before: str, after: str) -> int | None:
    """Non-blank lines of text around a wrapper, or None when they are too many or one of them is itself code."""
    outside = before.split("\n") + after.split("\n")
    if sum(1 for line in outside if line.strip()) > MAX_PROSE_LINES or any(map(_is_code_line, outside)):
        return None
    return sum(1 for line in outside if line.strip())


def _does_nothing(code: str) -> bool:
    """Whether ``code`` parses as nothing but a lone name or constant (``hi`` between tags is text, not a script)."""
    try:
        _silence_compile_warnings()
        body = ast.parse(code, COMPILE_FILENAME).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return not body or (
        len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, (ast.Name, ast.Constant))
    )


def _tag_wrapper(text: str) -> list[Candidate]:
    lowered = text.lower()
    for number, match in enumerate(_TAG_OPEN.finditer(text)):
        if number >= MAX_TAG_CANDIDATES:
            break
        name = match.group("name")
        close = lowered.rfind(f"</{name.lower()}>", match.end())
        if close < 0:
            continue
        dropped = _prose_around(text[: match.start()], text[close + len(name) + 3 :])
        if dropped is None:
            continue
        lo, hi, inner = _peel_tags(text, match.end(), close)
        content = text[lo:hi].strip("\n")
        if not content.strip() or _does_nothing(content):
            continue
        opener = match.group() if len(match.group()) <= MAX_HINT_TEXT else f"<{name} ...>"
        shown = opener + "".join(f"<{n}>" for n in inner) + "..." + "".join(f"</{n}>" for n in [*inner[::-1], name])
        detail = f"ran the content of the tags {shown}"
        detail += f"; {dropped} line(s) of text around them dropped" if dropped else ""
        content += "\n" if "\n" in content else ""
        candidates = [(content, detail)]
        if "&" in content and (unescaped := html.unescape(content)) != content:
            candidates.append((unescaped, detail + "; HTML entities (&lt; &gt; &amp; ...) decoded"))
        return candidates
    return []


#: Keys of a JSON object whose string value is the script (a model's own tool call: ``{"code": "..."}``).
CODE_KEYS = frozenset({"code", "script", "python", "python_code", "source", "source_code", "program", "py", "src"})
#: Keys of a tool call's envelope that hold the call's arguments (``{"name": ..., "arguments": {"code": ...}}``).
ENVELOPE_KEYS = frozenset({"arguments", "args", "parameters", "input"})
_SCALARS = (str, int, float, bool, type(None))


def _code_field(obj: object, depth: int = 0) -> tuple[str, list[str], list[str]] | None:
    """``(code, path, dropped)`` for an object whose only code-like field is a string (other fields scalars), else
    None: ``path`` names the keys down to the code, ``dropped`` the other fields.

    One tool-call envelope is looked into (``arguments`` etc., as an object or as a JSON string).
    """
    if not isinstance(obj, dict):
        return None
    code = [k for k, v in obj.items() if isinstance(k, str) and k.lower() in CODE_KEYS and isinstance(v, str)]
    envelopes = [k for k in obj if isinstance(k, str) and k.lower() in ENVELOPE_KEYS]
    others = [str(k) for k in obj if k not in code and k not in envelopes]
    if any(not isinstance(obj[k], _SCALARS) for k in obj if k not in code and k not in envelopes):
        return None
    if len(code) == 1 and not envelopes:
        return obj[code[0]], [code[0]], others
    if len(envelopes) == 1 and not code and depth == 0:
        inner = obj[envelopes[0]]
        if isinstance(inner, str):
            try:
                inner = json.loads(inner)
            except (ValueError, RecursionError):
                return None
        found = _code_field(inner, depth + 1)
        if found is not None:
            return found[0], [envelopes[0], *found[1]], others + found[2]
    return None


def _json_object(text: str, start: int) -> tuple[object, int] | None:
    """The JSON object (or, failing that, Python dict literal) at ``text[start]``: (value, end), else None."""
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except (ValueError, RecursionError):
        pass
    try:  # single quotes: a Python dict literal, the whole rest of the text
        return ast.literal_eval(text[start:].strip()), len(text)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def _json_wrapper(text: str) -> list[Candidate]:
    stripped = text.lstrip()
    at = len(text) - len(stripped) if stripped.startswith("{") else text.find("\n{")
    if at < 0:
        return []
    at += text[at] == "\n"
    found = _json_object(text, at)
    if found is None:
        return []
    value, end = found
    field_ = _code_field(value)
    if field_ is None or not field_[0].strip() or _does_nothing(field_[0]):
        return []
    dropped = _prose_around(text[:at], text[end:])
    if dropped is None:
        return []
    code, path, others = field_
    detail = f"ran the string field {' -> '.join(map(repr, path))} of the JSON object sent as the script"
    detail += f"; its other fields dropped: {', '.join(map(repr, others))}" if others else ""
    detail += f"; {dropped} line(s) of text around it dropped" if dropped else ""
    return [(code, detail)]


def _is_bare_dict(script: str) -> bool:
    """Whether ``script`` (which compiles) is exactly one expression statement whose value is a dict display."""
    first = next((line for line in script.split("\n") if line.strip() and not line.lstrip().startswith("#")), "")
    if not first.lstrip().startswith(("{", "(")):
        return False  # most scripts: no second parse
    try:
        _silence_compile_warnings()
        tree = ast.parse(script, COMPILE_FILENAME)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Dict)


_INDENT_PREFIX = re.compile(r"[ \t]*+")


def _dedent(text: str) -> tuple[str, str]:
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


def _indent(text: str) -> list[Candidate]:
    dedented, common = _dedent(text)
    if not common:
        return []
    spaces, tabs = common.count(" "), common.count("\t")
    width = " and ".join(f"{n} {unit}" for n, unit in ((spaces, "space(s)"), (tabs, "tab(s)")) if n)
    return [(dedented, f"removed the indentation common to every line ({width})")]


_ENCODINGS = ("bom", "crlf")  # taken off before the search (see _search), in this order, first in _REPAIRS
_REPAIRS: tuple[tuple[str, Callable[[str], list[Candidate]]], ...] = (
    ("bom", _bom),
    ("crlf", _crlf),
    ("fence", _fence),
    ("tag_wrapper", _tag_wrapper),
    ("json_wrapper", _json_wrapper),
    ("shell_wrapper", _shell),
    ("literal_escapes", _literal_escapes),
    ("indent", _indent),
    ("tabs", _tabs),
)


# -- the search and the hint --------------------------------------------------------------------------------------


@dataclass
class _Budget:
    compiles_left: int = MAX_COMPILES

    def compiles(self, source: str) -> bool:
        if self.compiles_left <= 0:
            return False
        self.compiles_left -= 1
        return compiles(source)


def _search(text: str, used: frozenset[str], budget: _Budget) -> tuple[str, list[Repair]] | None:
    """The shortest sequence of repairs (each kind at most once) that makes ``text`` compile; among sequences as
    short, the first in ``_REPAIRS`` order. Breadth first: a script that one repair fixes is never rewritten by a
    longer sequence whose first step changes what it means (``  x = "\\\\n"`` indented as a whole is dedented, not
    decoded as an escaped string first). Every sequence tried costs one compile of ``budget``.

    A byte-order mark and CR line endings (``_ENCODINGS``), which no reading of the script needs, are taken off
    first, in that order, before the search.
    """
    repairs: list[Repair] = []
    for kind, repair in _REPAIRS[: len(_ENCODINGS)]:
        for candidate, detail in [] if kind in used else repair(text)[:1]:
            text, used, repairs = candidate, used | {kind}, [*repairs, Repair(kind, detail)]
            if budget.compiles(text):
                return text, repairs
            if budget.compiles_left <= 0:
                return None
    level: list[tuple[str, frozenset[str], list[Repair]]] = [(text, used, repairs)]
    while level:
        deeper: list[tuple[str, frozenset[str], list[Repair]]] = []
        for source, done, repairs in level:
            for kind, repair in _REPAIRS:
                if kind in done:
                    continue
                for candidate, detail in repair(source):
                    if candidate == source or not candidate.strip():
                        continue
                    steps = [*repairs, Repair(kind, detail)]
                    if budget.compiles(candidate):
                        return candidate, steps
                    if budget.compiles_left <= 0:
                        return None
                    deeper.append((candidate, done | {kind}, steps))
        level = deeper
    return None


def normalize(script: str) -> Normalized:
    """The script to run for ``script``: itself when it compiles, else the first repair that compiles (module doc).

    CPU-bound (it compiles the script, up to ``MAX_COMPILES`` times): call it off the event loop. A script longer
    than ``MAX_CHARS`` is returned as it is, unexamined.
    """
    if len(script) > MAX_CHARS:
        return Normalized(script, script)
    error = _compile_error(script)
    budget = _Budget()
    if error is None:
        found: tuple[str, list[Repair]] | None = (script, [])
    else:
        found = _search(script, frozenset(), budget)
    if found is not None:
        unwrapped = _unwrap_bare_dict(found[0], frozenset(r.kind for r in found[1]), budget)
        if unwrapped is not None:
            found = (unwrapped[0], [*found[1], *unwrapped[1]])
        return Normalized(found[0], script, tuple(found[1])) if found[1] else Normalized(script, script)
    assert error is not None  # found is None only when the search ran, i.e. the script did not compile
    return Normalized(script, script, hint=_hint(script, error), compile_error=_error_fields(error))


def _unwrap_bare_dict(script: str, used: frozenset[str], budget: _Budget) -> tuple[str, list[Repair]] | None:
    """For a compiling ``script`` that is only a dict display, which does nothing (``{"code": "print(1)"}``): the
    code of its one code-like field and the repairs, when that code compiles (after repairs of its own), else None."""
    if "json_wrapper" in used or not _is_bare_dict(script):
        return None
    for code, detail in _json_wrapper(script):
        repair = Repair("json_wrapper", detail)
        if budget.compiles(code):
            return code, [repair]
        deeper = _search(code, used | {"json_wrapper"}, budget)
        if deeper is not None:
            return deeper[0], [repair, *deeper[1]]
    return None


def verdict_only(script: str) -> Normalized:
    """``script`` unchanged, with its ``compile_error`` when it does not compile (unexamined past ``MAX_CHARS``)."""
    error = _compile_error(script) if len(script) <= MAX_CHARS else None
    return Normalized(script, script, compile_error=_error_fields(error) if error is not None else None)


def _error_fields(error: BaseException) -> dict[str, Any]:
    """A compile error as the job view's ``error`` shows it (messages capped like the runtime's)."""
    fields: dict[str, Any] = {"type": type(error).__name__, "message": str(error)[:MAX_ERROR_TEXT]}
    if isinstance(error, SyntaxError):
        fields.update(
            message=str(error.msg)[:MAX_ERROR_TEXT],
            line=error.lineno,
            column=error.offset,
            text=(error.text or "").rstrip("\n")[:MAX_ERROR_TEXT] or None,
        )
    return fields


def _short(line: str) -> str:
    line = line.strip()
    return line if len(line) <= MAX_HINT_TEXT else line[: MAX_HINT_TEXT - 3] + "..."


_PROSE = re.compile(r"^[A-Z][a-z']*+(?:[ ,]++[\w'’()/-]++){2,}+[.:!?]?$")  # possessive: linear


def _hint(script: str, error: BaseException) -> str | None:
    """A one-line hint for the mechanical causes recognized in a script that does not compile, else None."""
    for lines, _, how in _line_forms(script):
        blocks = _fences(lines).blocks
        if len(blocks) > 1:
            return (
                f"the script holds {len(blocks)} Markdown fenced code blocks{how}; none was run, because which "
                "one is meant is a guess: send one script, without fences"
            )
        if len(blocks) == 1:
            start, end, _ = blocks[0]
            around = (lines[: start - 1] + lines[end + 1 :])[:MAX_PROSE_LINES]
            outside = [line for line in around if _is_code_line(line)]
            if outside:
                return (
                    f"the script is a Markdown fenced block with code outside it too ({_short(outside[0])!r}); "
                    "not repaired, because what is meant to run is a guess: send one script, without fences"
                )
            return "the script is a Markdown fenced block whose content does not compile either: send the code alone"
    stripped = script.strip()
    if _DASH_C.match(stripped) or (_CALL.match(stripped) and "python" in stripped):
        return (
            "the script is a shell command (python -c ...) whose inner script could not be recovered exactly: "
            "send the Python code itself, not a command"
        )
    if any(_HEREDOC_PY.match(line) or _HEREDOC_CAT.match(line) for line in stripped.split("\n")[:1]):
        return "the script is a shell heredoc (python3 - <<EOF ...) that could not be unwrapped: send the Python code"
    tag = _TAG_OPEN.match(stripped)
    if tag is not None and f"</{tag.group('name').lower()}>" in stripped.lower():
        return (
            f"the script is wrapped in <{tag.group('name')}> tags whose content does not compile either (or is "
            "more than one block, or has code around it): send the code alone"
        )
    message = str(getattr(error, "msg", error))
    structural = _decode_structural(script) if "\\n" in script else None
    twice_escaped = structural is None and "\\n" in script and "line continuation" in message
    if twice_escaped or (structural is not None and structural[1] > 0):
        return (
            "the script has the two characters \\n where line breaks belong (outside string literals): "
            "send real line breaks"
        )
    if "unterminated" in message or "EOL while scanning" in message or "EOF while scanning" in message:
        return "a string literal is not closed on the reported line: check for unbalanced quotes"
    if isinstance(error, TabError):
        return "indentation mixes tabs and spaces and no single tab width gives one program: indent with spaces only"
    first = next((line for line in script.split("\n") if line.strip()), "")
    if _PROSE.match(first.strip()) and not _is_code_line(first):
        return f"the script starts with text, not Python ({_short(first)!r}): send only the code"
    return None


# -- the service's side ---------------------------------------------------------------------------------------------


def count(normalized: Normalized) -> None:
    """Count ``normalized``'s repairs in ``NORMALIZATIONS`` (one per repair, labelled by kind)."""
    for repair in normalized.repairs:
        NORMALIZATIONS.labels(kind=repair.kind).inc()


def prepare(script: str, enabled: bool) -> Normalized:
    """``normalize(script)`` (CPU-bound: call it on a worker thread; count its repairs with ``count`` after); when
    the request switched it off, the script unchanged with only the service's compile verdict (``compile_error``;
    no repair, no hint)."""
    return normalize(script) if enabled else verdict_only(script)


def view_fields(normalized: Normalized | None) -> dict[str, Any]:
    """The job view's ``normalization``, ``original_script`` and ``normalized_script`` (scripts only with repairs)."""
    changed = normalized is not None and normalized.changed
    return {
        "normalization": normalized.view() if normalized is not None else [],
        "original_script": normalized.original if changed and normalized else None,
        "normalized_script": normalized.script if changed and normalized else None,
    }


def with_hint(error: dict[str, Any] | None, normalized: Normalized | None) -> dict[str, Any] | None:
    """The job's ``error`` with ``hint`` added when it is the script's SyntaxError and a mechanical cause is known."""
    if error is None or normalized is None or normalized.hint is None or error.get("type") not in SYNTAX_ERRORS:
        return error
    return {**error, "hint": normalized.hint}
