"""BFCL v4 entries as multi-line scripts, and the literal-escape corruption models made of such scripts (tests only).

The PTC research found models writing their scripts on one line with the two characters ``\\n`` for each line break
(and ``\\t`` for each indentation level), so that every such script died with a SyntaxError. ``ground_truth_script``
writes an entry's ground-truth calls the way the research's harness asked for them (imports, a variable, a function
making the calls, the answer printed); ``corrupt`` damages it the way those models did.
"""

from __future__ import annotations

import re
from types import CodeType
from typing import Any, Final

from tests.bfcl_data import CASE_MARKER, GroundTruthCase, call_source

#: The categories whose every entry the corruption test replays.
CORRUPTION_CATEGORIES: Final = ("simple_python", "parallel", "multiple")

_INDENT = re.compile(r"^((?:    )*)")


def ground_truth_script(case: GroundTruthCase) -> str:
    """A multi-line script that makes the entry's ground-truth calls in order and prints what they returned."""
    lines = ["import json", "", "import tools", "", f"CASE = {case.id!r}", "results = []", "", "", "def main():"]
    lines += [f"    results.append({call_source(name, args)})" for name, args in case.calls]
    lines += ["    return len(results)", "", "", "count = main()"]
    lines += ["print(CASE, count, json.dumps(results, sort_keys=True, ensure_ascii=False))"]
    return "\n".join(lines) + "\n"


def batch_script(cases: list[GroundTruthCase]) -> str:
    """The cases' ground-truth scripts run one after the other, each after a ``bfcl_case(id=...)`` marker call."""
    return "".join(f"import tools\n{call_source(CASE_MARKER, {'id': c.id})}\n{ground_truth_script(c)}" for c in cases)


def corrupt(script: str) -> str:
    """``script`` on one line: each line break written as the two characters ``\\n``, each 4-space indent as ``\\t``."""
    return "\\n".join(
        "\\t" * (len(m.group(1)) // 4) + line[len(m.group(1)) :]
        for line in script.split("\n")
        if (m := _INDENT.match(line)) is not None
    )


def record_key(record: dict[str, Any]) -> tuple[Any, ...]:
    """What a call record says about the call (no ids, no times)."""
    return (record["tool"], record["args"], record["status"], record["result"], record["error"])


def bytecode(source: str) -> tuple[Any, ...]:
    """The compiled program of ``source`` without positions: equal for programs that differ only in layout."""

    def walk(code: CodeType) -> tuple[Any, ...]:
        consts = tuple(walk(c) if isinstance(c, CodeType) else (type(c), c) for c in code.co_consts)
        return (code.co_name, code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars, code.co_flags)

    return walk(compile(source, "<script>", "exec", dont_inherit=True))
