"""The ``literal_escapes`` repair: a script written on one line with ``\\n`` for its line breaks, or escaped
twice (see ``service.normalize``)."""

from __future__ import annotations

import re

from service.normalize.source import STRING_START, Candidate, is_name_char


def decode_structural(text: str) -> tuple[str, int] | None:
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
        elif (c in "'\"" or c.isalpha()) and (i == 0 or not is_name_char(text[i - 1])):
            match = STRING_START.match(text, i)
            if match is None:
                j = i
                while j < n and is_name_char(text[j]):
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


def literal_escapes(text: str) -> list[Candidate]:
    """``literal_escapes``: escapes outside strings made line breaks; or the text decoded as one escaped string."""
    real_breaks = text.rstrip("\n").count("\n")
    if "\\" not in text:
        return []
    found: list[Candidate] = []
    structural = decode_structural(text)
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
