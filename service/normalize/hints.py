"""The one-line hint for a script that no repair made compile: the mechanical cause recognized, if any."""

from __future__ import annotations

import re

from service.normalize.escapes import decode_structural
from service.normalize.shell import CALL, DASH_C, HEREDOC_CAT, HEREDOC_PY
from service.normalize.source import MAX_HINT_TEXT, MAX_PROSE_LINES, is_code_line, line_forms
from service.normalize.wrappers import TAG_OPEN, fences


def _short(line: str) -> str:
    line = line.strip()
    return line if len(line) <= MAX_HINT_TEXT else line[: MAX_HINT_TEXT - 3] + "..."


_PROSE = re.compile(r"^[A-Z][a-z']*+(?:[ ,]++[\w'’()/-]++){2,}+[.:!?]?$")  # possessive: linear


def hint_for(script: str, error: BaseException) -> str | None:
    """A one-line hint for the mechanical causes recognized in a script that does not compile, else None."""
    for lines, _, how in line_forms(script):
        blocks = fences(lines).blocks
        if len(blocks) > 1:
            return (
                f"the script holds {len(blocks)} Markdown fenced code blocks{how}; none was run, because which "
                "one is meant is a guess: send one script, without fences"
            )
        if len(blocks) == 1:
            start, end, _ = blocks[0]
            around = (lines[: start - 1] + lines[end + 1 :])[:MAX_PROSE_LINES]
            outside = [line for line in around if is_code_line(line)]
            if outside:
                return (
                    f"the script is a Markdown fenced block with code outside it too ({_short(outside[0])!r}); "
                    "not repaired, because what is meant to run is a guess: send one script, without fences"
                )
            return "the script is a Markdown fenced block whose content does not compile either: send the code alone"
    stripped = script.strip()
    if DASH_C.match(stripped) or (CALL.match(stripped) and "python" in stripped):
        return (
            "the script is a shell command (python -c ...) whose inner script could not be recovered exactly: "
            "send the Python code itself, not a command"
        )
    if any(HEREDOC_PY.match(line) or HEREDOC_CAT.match(line) for line in stripped.split("\n")[:1]):
        return "the script is a shell heredoc (python3 - <<EOF ...) that could not be unwrapped: send the Python code"
    tag = TAG_OPEN.match(stripped)
    if tag is not None and f"</{tag.group('name').lower()}>" in stripped.lower():
        return (
            f"the script is wrapped in <{tag.group('name')}> tags whose content does not compile either (or is "
            "more than one block, or has code around it): send the code alone"
        )
    message = str(getattr(error, "msg", error))
    structural = decode_structural(script) if "\\n" in script else None
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
    if _PROSE.match(first.strip()) and not is_code_line(first):
        return f"the script starts with text, not Python ({_short(first)!r}): send only the code"
    return None
