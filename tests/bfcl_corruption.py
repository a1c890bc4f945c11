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

import httpx

from tests.bfcl_data import CASE_MARKER, GroundTruthCase, call_source, replay_manifest, split_records

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


JOB_TIMEOUT_S: Final = 120


def run_job(api: httpx.Client, script: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """POST /execute and wait for the job's final view (``202`` answers are waited for)."""
    body = {"script": script, "tools": tools, "timeout_s": JOB_TIMEOUT_S, "wait_s": JOB_TIMEOUT_S}
    view: dict[str, Any] = api.post("/execute", json=body).raise_for_status().json()
    while view["status"] in ("queued", "running"):
        view = api.post(f"/jobs/{view['job_id']}/wait", params={"timeout_s": JOB_TIMEOUT_S}).raise_for_status().json()
    return view


def clean_run(api: httpx.Client, batch: list[GroundTruthCase]) -> dict[str, tuple[list[dict[str, Any]], str]]:
    """Run the clean scripts of ``batch`` as one job; each entry's (records, printed line) by id.

    Raises:
        AssertionError: the job did not succeed or its output was truncated.
    """
    view = run_job(api, batch_script(batch), replay_manifest(batch))
    assert view["status"] == "succeeded" and not view["stdout_truncated"], view["error"]
    printed = {line.split(" ", 1)[0]: line + "\n" for line in view["stdout"].splitlines()}
    return {case_id: (records, printed[case_id]) for case_id, records in split_records(view["calls"], batch).items()}


def corrupted_run(api: httpx.Client, case: GroundTruthCase) -> dict[str, Any]:
    """The final view of the entry's corrupted script, run as its own job with the entry's own manifest."""
    return run_job(api, corrupt(ground_truth_script(case)), replay_manifest([case], marker=False))


def recovery_problem(
    case: GroundTruthCase, view: dict[str, Any], clean: tuple[list[dict[str, Any]], str]
) -> str | None:
    """None when the corrupted script's job did what the clean script did (and said it repaired it), else why not."""
    records, printed = clean
    if view["status"] != "succeeded":
        return f"{view['status']}: {view['error']}"
    if [r["kind"] for r in view["normalization"]] != ["literal_escapes"]:
        return f"normalization {view['normalization']}"
    if [record_key(r) for r in view["calls"]] != [record_key(r) for r in records]:
        return f"records differ: {view['calls']} != {records}"
    if view["stdout"] != printed:
        return f"stdout {view['stdout']!r} != {printed!r}"
    if len(records) != len(case.calls) or any(r["status"] != "ok" for r in records):
        return f"the clean script's own records are off: {records}"
    return None
