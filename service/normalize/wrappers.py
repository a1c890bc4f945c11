"""The repairs of wrappers that are not code: ``fence`` (Markdown), ``tag_wrapper`` (XML-like tags) and
``json_wrapper`` (a JSON object, a tool call's; see ``service.normalize``)."""

from __future__ import annotations

import ast
import html
import json
import re
from dataclasses import dataclass, field

from service.normalize.layout import dedent
from service.normalize.source import (
    COMPILE_FILENAME,
    MAX_HINT_TEXT,
    MAX_PROSE_LINES,
    Candidate,
    does_nothing,
    is_code_line,
    line_forms,
    prose_around,
    silence_compile_warnings,
)

_FENCE_OPEN = re.compile(r"^[ \t]*+(?P<fence>`{3,}+|~{3,}+)[ \t]*+(?P<info>[^\s`]*+)[^`]*+$")  # possessive: linear


@dataclass
class Fences:
    """The fenced blocks of a text's lines, and whether the last one was left open."""

    blocks: list[tuple[int, int, str]] = field(default_factory=list)  # (first content line, end, opening fence line)
    unclosed: bool = False


def fences(lines: list[str]) -> Fences:
    """Fenced blocks (CommonMark-like: a closing fence is the same character, at least as long, alone on its line)."""
    found = Fences()
    opened: tuple[int, str] | None = None
    for number, line in enumerate(lines):
        stripped = line.strip()
        if opened is None:
            match = _FENCE_OPEN.match(line.rstrip("\r"))
            if match:
                opened = (number, match.group("fence"))
        else:
            opener = opened[1]
            if stripped and set(stripped) == {opener[0]} and len(stripped) >= len(opener):
                found.blocks.append((opened[0] + 1, number, lines[opened[0]].strip()))
                opened = None
    if opened is not None:
        found.blocks.append((opened[0] + 1, len(lines), lines[opened[0]].strip()))
        found.unclosed = True
    return found


def fence(text: str) -> list[Candidate]:
    """``fence``: the content of the one Markdown fenced block (the dedented form first when it is indented)."""
    for lines, sep, how in line_forms(text):
        found = fences(lines)
        if len(found.blocks) != 1:
            continue
        start, end, opener = found.blocks[0]
        outside = lines[: start - 1] + lines[end + 1 :]
        if sum(1 for line in outside if line.strip()) > MAX_PROSE_LINES or any(map(is_code_line, outside)):
            continue
        content = sep.join(lines[start:end])
        if not content.strip():
            continue
        dropped = sum(1 for line in outside if line.strip())
        closed = " (no closing fence)" if found.unclosed else ""
        detail = f"ran the content of the one fenced block {opener!r}{closed}{how}"
        detail += f"; {dropped} line(s) of text around it dropped" if dropped else ""
        content += "\n" if sep == "\n" and not content.endswith("\n") else ""
        dedented, common = dedent(content) if sep == "\n" else (content, "")
        if common:  # indented as a whole, the content cannot compile: the dedented form first
            return [(dedented, detail + "; its common indentation removed"), (content, detail)]
        return [(content, detail)]
    return []


TAG_OPEN = re.compile(r"<(?P<name>[A-Za-z][\w.:-]*+)(?:\s[^<>]*+)?>")  # possessive, stops at the next < or >: linear
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
        match = TAG_OPEN.match(text, start, end)
        if match is None:
            return lo, hi, names
        close = f"</{match.group('name')}>"
        if end - len(close) < match.end() or text[end - len(close) : end].lower() != close.lower():
            return lo, hi, names
        names.append(match.group("name"))
        lo, hi = match.end(), end - len(close)


def tag_wrapper(text: str) -> list[Candidate]:
    """``tag_wrapper``: the content of the tags around the code (with HTML entities decoded, second)."""
    lowered = text.lower()
    for number, match in enumerate(TAG_OPEN.finditer(text)):
        if number >= MAX_TAG_CANDIDATES:
            break
        name = match.group("name")
        close = lowered.rfind(f"</{name.lower()}>", match.end())
        if close < 0:
            continue
        dropped = prose_around(text[: match.start()], text[close + len(name) + 3 :])
        if dropped is None:
            continue
        lo, hi, inner = _peel_tags(text, match.end(), close)
        content = text[lo:hi].strip("\n")
        if not content.strip() or does_nothing(content):
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


def json_wrapper(text: str) -> list[Candidate]:
    """``json_wrapper``: the code-like string field of the JSON object (or dict literal) sent."""
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
    if field_ is None or not field_[0].strip() or does_nothing(field_[0]):
        return []
    dropped = prose_around(text[:at], text[end:])
    if dropped is None:
        return []
    code, path, others = field_
    detail = f"ran the string field {' -> '.join(map(repr, path))} of the JSON object sent as the script"
    detail += f"; its other fields dropped: {', '.join(map(repr, others))}" if others else ""
    detail += f"; {dropped} line(s) of text around it dropped" if dropped else ""
    return [(code, detail)]


def is_bare_dict(script: str) -> bool:
    """Whether ``script`` (which compiles) is exactly one expression statement whose value is a dict display."""
    first = next((line for line in script.split("\n") if line.strip() and not line.lstrip().startswith("#")), "")
    if not first.lstrip().startswith(("{", "(")):
        return False  # most scripts: no second parse
    try:
        silence_compile_warnings()
        tree = ast.parse(script, COMPILE_FILENAME)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Dict)
