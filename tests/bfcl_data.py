"""Access to the BFCL v4 data shipped inside the ``bfcl_eval`` package, and its replay as scripts (tests only).

Stdlib only.  ``bfcl_eval`` is located through :mod:`importlib` without being
imported, so its (many) runtime dependencies need not be installed::

    pip install --no-deps bfcl-eval==2026.3.23

Layout of ``bfcl_eval/data`` as of 2026.3.23:

* ``BFCL_v4_<category>.json`` -- JSON Lines; each entry has ``id``,
  ``question`` and, for the single-turn categories, ``function`` (a list of
  tool schemas: ``name``, ``description``, ``parameters``).
* ``BFCL_v4_multi_turn_*.json`` -- entries reference classes through
  ``involved_classes``; their schemas live in ``multi_turn_func_doc/*.json``
  (JSON Lines, one schema per line).
* ``BFCL_v4_memory.json`` and ``BFCL_v4_web_search.json`` -- JSON Lines
  without ``function`` (they use ``involved_classes``).
* ``BFCL_v4_format_sensitivity.json`` -- a single pretty-printed JSON object
  mapping a category to a list of entry ids; not JSON Lines.
* ``possible_answer/BFCL_v4_<category>.json`` -- JSON Lines of
  ``{"id": ..., "ground_truth": [{func_name: {arg: [accepted values...]}}]}``.
  The ``live_*`` files (user-contributed entries, ids such as
  ``live_simple_0-0-0``) have the same layout as the others; what differs is
  only in the values (see :func:`load_ground_truth`, rule 3).
"""

from __future__ import annotations

import importlib.util
import json
import keyword
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Literal

__all__ = [
    "CASE_MARKER",
    "GROUND_TRUTH_CATEGORIES",
    "GroundTruthCase",
    "ReplayKind",
    "ReplayOutcome",
    "bfcl_data_dir",
    "call_source",
    "classify_replay",
    "iter_function_docs",
    "load_ground_truth",
    "pack_batches",
    "replay_manifest",
    "replay_script",
    "split_records",
]

BFCL_PIN: Final = "bfcl-eval==2026.3.23"

#: Categories supported by :func:`load_ground_truth`.
GROUND_TRUTH_CATEGORIES: Final = (
    "simple_python",
    "multiple",
    "parallel",
    "parallel_multiple",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
)

_OPTIONAL: Final = ""  # marker inside an accepted-values list: "may be omitted"


def bfcl_data_dir() -> pathlib.Path:
    """Return the ``data`` folder of the installed ``bfcl_eval`` package.

    Raises:
        RuntimeError: if ``bfcl_eval`` (or its data folder) is not installed.
    """
    hint = f"install it with: pip install --no-deps {BFCL_PIN}"
    try:
        spec = importlib.util.find_spec("bfcl_eval")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the 'bfcl_eval' package is not installed; {hint}")
    for location in spec.submodule_search_locations:
        data = pathlib.Path(location) / "data"
        if data.is_dir():
            return data
    raise RuntimeError(
        f"'bfcl_eval' is installed but has no 'data' folder (searched {list(spec.submodule_search_locations)}); {hint}"
    )


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    """Parse a JSON Lines file whose every non-blank line is a JSON object."""
    entries: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            entry = json.loads(line)
            if not isinstance(entry, dict):
                raise TypeError(f"{path}:{line_no}: expected a JSON object")
            entries.append(entry)
    return entries


def _function_entries(path: pathlib.Path) -> list[dict[str, Any]] | None:
    """Entries of a single-turn file, or ``None`` if it has no tool schemas.

    ``None`` is returned for files that are not JSON Lines of objects (e.g.
    ``format_sensitivity``) and for files none of whose entries has a
    ``function`` list (e.g. ``memory``, ``web_search``).
    """
    try:
        entries = _read_jsonl(path)
    except (ValueError, TypeError):  # JSONDecodeError is a ValueError
        return None
    with_functions = [e for e in entries if isinstance(e.get("function"), list)]
    if not with_functions:
        return None
    if len(with_functions) != len(entries):
        raise ValueError(f"{path}: only some entries have a 'function' list")
    return with_functions


def iter_function_docs(
    include_multi_turn: bool = False,
) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Yield ``(file stem, entry id, function doc)`` for every tool schema.

    Covers every ``BFCL_v4_*.json`` file whose entries carry a ``function``
    list (files are visited in sorted order, entries and schemas in file
    order; the same schema may be yielded several times when several entries
    share it).  Files whose name contains ``multi_turn`` are skipped, as are
    files without tool schemas (``memory``, ``web_search``,
    ``format_sensitivity``).

    With ``include_multi_turn=True`` the shared multi-turn schemas in
    ``multi_turn_func_doc/*.json`` are yielded afterwards, each once; as they
    belong to no single entry, the doc file's stem (e.g.
    ``"gorilla_file_system"``) is used both as file stem and as entry id.
    These docs also carry a ``response`` schema next to ``parameters``.
    """
    data = bfcl_data_dir()
    for path in sorted(data.glob("BFCL_v4_*.json")):
        if "multi_turn" in path.name:
            continue
        entries = _function_entries(path)
        if entries is None:
            continue
        for entry in entries:
            for doc in entry["function"]:
                yield path.stem, str(entry["id"]), doc
    if include_multi_turn:
        for path in sorted((data / "multi_turn_func_doc").glob("*.json")):
            for doc in _read_jsonl(path):
                yield path.stem, path.stem, doc


@dataclass(frozen=True)
class GroundTruthCase:
    """One BFCL entry with its ground truth resolved to concrete calls."""

    id: str
    category: str
    functions: list[dict[str, Any]] = field(repr=False)
    calls: list[tuple[str, dict[str, Any]]]


def _pick(accepted: list[Any], *, required: bool, where: str) -> tuple[bool, Any]:
    """Apply the resolution rule to one accepted-values list.

    Returns ``(present, value)``; ``present`` is False when the argument is
    to be omitted.
    """
    if not isinstance(accepted, list):
        raise TypeError(f"{where}: accepted values must be a list, got {accepted!r}")
    if _OPTIONAL in accepted and not required:
        return False, None
    for value in accepted:
        if value != _OPTIONAL:
            return True, value
    if not accepted:  # rule 3: "[]" stands for the empty array
        return True, []
    return True, _OPTIONAL  # rule 3: a required argument whose only accepted value is ""


def _resolve_dict(accepted: dict[str, Any], schema: dict[str, Any], where: str) -> dict[str, Any]:
    """Resolve a ground-truth dict whose values are accepted-values lists."""
    required = schema.get("required", [])
    resolved: dict[str, Any] = {}
    for key, values in accepted.items():
        present, value = _pick(values, required=key in required, where=f"{where}.{key}")
        if present:
            resolved[key] = value
    return resolved


def _resolve_value(value: Any, schema: dict[str, Any], where: str) -> Any:
    """Resolve nested accepted-values lists, following the BFCL checker.

    A ``dict`` parameter's ground truth is a dict of accepted-values lists,
    and so is every element of an array/tuple whose ``items`` are ``dict``
    (``ast_checker.dict_checker`` / ``list_dict_checker``).  Other values are
    literal.
    """
    declared = schema.get("type")
    if declared == "dict" and isinstance(value, dict):
        return _resolve_dict(value, schema, where)
    items = schema.get("items")
    if (
        declared in ("array", "tuple")
        and isinstance(items, dict)
        and items.get("type") == "dict"
        and isinstance(value, list)
    ):
        return [
            _resolve_dict(item, items, f"{where}[{i}]") if isinstance(item, dict) else item
            for i, item in enumerate(value)
        ]
    return value


def load_ground_truth(category: str) -> list[GroundTruthCase]:
    """Load ``BFCL_v4_<category>.json`` with its possible answers.

    ``category`` is one of :data:`GROUND_TRUTH_CATEGORIES`.  Cases come in
    file order; ``calls`` keeps the ground-truth order (``parallel*`` are
    graded order-insensitively by BFCL, so the order is merely the listed one).

    In the possible answers each argument maps to a list of accepted values,
    ``""`` in the list meaning the argument may be omitted.  Each argument is
    resolved to ONE concrete value (or omitted) by this rule:

    1. If ``""`` is accepted and the argument is not listed in the schema's
       ``required``, the argument is OMITTED, so a call holds only the
       arguments that must be given.  This includes lists that are only
       ``[""]`` and the few ground-truth arguments absent from the schema.
    2. Otherwise the argument takes the FIRST accepted value that is not
       ``""``.  A handful of arguments are ``required`` yet list ``""`` (e.g.
       ``simple_python_17`` ``formatted: [true, ""]``); BFCL's checker still
       demands them, hence the ``required`` exception in rule 1.
    3. An argument with no concrete accepted value takes the empty value its
       list spells; only ``live_*`` entries have such lists.  ``[""]`` on a
       ``required`` argument gives ``""`` itself, which BFCL's string checker
       accepts (``live_multiple_507-149-4`` ``origin_airport``); an empty
       list ``[]`` gives the empty array ``[]``, the answer the question asks
       for (``live_simple_106-63-0``, ``live_simple_112-68-0``: ``array``
       arguments for which the query lists nothing; BFCL's checker accepts no
       value at all there).

    An argument the schema does not declare and whose list has no ``""`` is
    kept (``live_multiple_862-181-3``, ``live_multiple_964-207-0``): such
    ground truth contradicts its own schema, and a call made from it is
    expected to be refused.

    The rule recurses into ``dict`` arguments and arrays of ``dict`` items,
    whose ground truth holds accepted-values lists per key (keys are
    "required" only if the nested schema says so).  Values are otherwise kept
    as JSON gives them: tuples are lists, and a value may not match its
    declared type (e.g. ``0`` for a ``float``, a string expression such as
    ``"data['sales']"`` for an ``array``).

    Raises:
        ValueError: for an unknown category or a malformed ground truth (a
            call that is not a one-key object, or of a function the entry
            does not declare).
        TypeError: for an accepted-values entry that is not a list.
    """
    if category not in GROUND_TRUTH_CATEGORIES:
        raise ValueError(f"unsupported category {category!r}; expected one of {GROUND_TRUTH_CATEGORIES}")
    data = bfcl_data_dir()
    questions = _read_jsonl(data / f"BFCL_v4_{category}.json")
    answers = {str(a["id"]): a for a in _read_jsonl(data / "possible_answer" / f"BFCL_v4_{category}.json")}
    cases: list[GroundTruthCase] = []
    for entry in questions:
        case_id = str(entry["id"])
        functions: list[dict[str, Any]] = entry["function"]
        by_name = {doc["name"]: doc for doc in functions}
        calls: list[tuple[str, dict[str, Any]]] = []
        for index, call in enumerate(answers[case_id]["ground_truth"]):
            if not isinstance(call, dict) or len(call) != 1:
                raise ValueError(f"{case_id}: ground-truth call #{index} is not a one-key object")
            ((name, accepted_args),) = call.items()
            if name not in by_name:
                raise ValueError(f"{case_id}: ground truth calls unknown function {name!r}")
            parameters: dict[str, Any] = by_name[name]["parameters"]
            properties: dict[str, Any] = parameters.get("properties", {})
            required = parameters.get("required", [])
            args: dict[str, Any] = {}
            for arg, accepted in accepted_args.items():
                where = f"{case_id}:{name}.{arg}"
                present, value = _pick(accepted, required=arg in required, where=where)
                if present:
                    args[arg] = _resolve_value(value, properties.get(arg, {}), where)
            calls.append((name, args))
        cases.append(GroundTruthCase(id=case_id, category=category, functions=functions, calls=calls))
    if len(answers) != len(cases):
        raise ValueError(f"{category}: {len(answers)} answers for {len(cases)} entries")
    return cases


# --- Replay: many entries per script -------------------------------------------------------------------------------

#: The marker tool a replay script calls before each entry's calls (``bfcl_case(id=...)``), so that one job's call
#: records can be split per entry.  No BFCL function has this name (checked by :func:`pack_batches`).
CASE_MARKER: Final = "bfcl_case"
_MARKER_DOC: Final = {
    "name": CASE_MARKER,
    "description": "Marks the start of a BFCL entry's calls in a replay script.",
    "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
}


def call_source(name: str, args: dict[str, Any]) -> str:
    """How a model writes the call: keywords where the name allows, ``**{...}`` for the rest.

    ``name`` is used as the attribute path (``math.factorial`` -> ``tools.math.factorial(...)``); BFCL's names in
    :data:`GROUND_TRUTH_CATEGORIES` are all identifiers per dotted segment, so no safe spelling is needed.
    """
    plain = {k: v for k, v in args.items() if k.isidentifier() and not keyword.iskeyword(k)}
    parts = [f"{k}={v!r}" for k, v in plain.items()]
    rest = {k: v for k, v in args.items() if k not in plain}
    if rest:
        parts.append(f"**{rest!r}")
    return f"tools.{name}({', '.join(parts)})"


def replay_script(cases: list[GroundTruthCase], marker: bool = True) -> str:
    """Source of a script that makes each case's ground-truth calls in order, one blocking call at a time.

    With ``marker`` each case's calls are preceded by ``tools.bfcl_case(id=<case id>)``.  A refused call
    (``tools.ToolError``) does not stop the script; any other exception does (it would be a stub bug).
    """
    lines = ["import tools", ""]
    for case in cases:
        if marker:
            lines.append(call_source(CASE_MARKER, {"id": case.id}))
        for name, args in case.calls:
            lines += ["try:", f"    {call_source(name, args)}", "except tools.ToolError:", "    pass"]
    return "\n".join(lines) + "\n"


def _doc_key(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True)


def pack_batches(cases: list[GroundTruthCase], max_cases: int) -> list[list[GroundTruthCase]]:
    """Group cases so that each group's function docs can share one manifest.

    First fit, in order: a case joins the first batch that has room and in which every one of its function names is
    either new or declared by an identical doc (name, description and parameters); otherwise it opens a batch.  So
    no name is ever renamed, and a batch's manifest (:func:`replay_manifest`) gives each case exactly its own docs.

    Raises:
        ValueError: if a case declares :data:`CASE_MARKER`, or one name twice with different docs.
    """
    batches: list[list[GroundTruthCase]] = []
    docs: list[dict[str, str]] = []  # per batch: name -> doc key
    for case in cases:
        own: dict[str, str] = {}
        for doc in case.functions:
            name, key = doc["name"], _doc_key(doc)
            if name == CASE_MARKER or own.setdefault(name, key) != key:
                raise ValueError(f"{case.id}: function {name!r} cannot be replayed in a batch")
        for batch, names in zip(batches, docs, strict=True):
            if len(batch) < max_cases and all(names.get(n, k) == k for n, k in own.items()):
                batch.append(case)
                names.update(own)
                break
        else:
            batches.append([case])
            docs.append(dict(own))
    return batches


def replay_manifest(cases: list[GroundTruthCase], marker: bool = True) -> list[dict[str, Any]]:
    """The union of the cases' function docs (one per name), each with an ``echo`` endpoint, plus the marker tool."""
    by_name: dict[str, dict[str, Any]] = {}
    for case in cases:
        for doc in case.functions:
            by_name.setdefault(doc["name"], doc)
    docs = [*by_name.values(), _MARKER_DOC] if marker else list(by_name.values())
    return [{**doc, "endpoint": {"kind": "echo"}} for doc in docs]


def split_records(records: list[dict[str, Any]], cases: list[GroundTruthCase]) -> dict[str, list[dict[str, Any]]]:
    """A job's call records (from :func:`replay_script` with markers) split per case id, the markers dropped.

    Raises:
        ValueError: if the markers are not exactly one per case, in order, with ``ok`` status.
    """
    split: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] | None = None
    expected = iter(case.id for case in cases)
    for record in records:
        if record["tool"] == CASE_MARKER:
            case_id = next(expected, None)
            if case_id is None or record["args"] != {"id": case_id} or record["status"] != "ok":
                raise ValueError(f"marker record {record['seq']} is {record}, expected one for {case_id!r}")
            current = split[case_id] = []
        elif current is None:
            raise ValueError(f"record {record['seq']} comes before the first marker")
        else:
            current.append(record)
    missing = list(expected)
    if missing:
        raise ValueError(f"no marker record for {len(missing)} cases, from {missing[0]!r}")
    return split


ReplayKind = Literal["exact", "rejected", "other"]


@dataclass(frozen=True)
class ReplayOutcome:
    """How one case's replay went, judged from its call records.

    ``kind``:

    * ``exact`` -- the records' ``(tool, args)`` sequence is the resolved ground truth (same order, same JSON values:
      ``1`` is not ``1.0`` nor ``true``) and every call is ``ok``;
    * ``rejected`` -- the same sequence, but the broker refused some calls with ``invalid_arguments`` (the others
      ``ok``): the ground truth contradicts the entry's own schema;
    * ``other`` -- anything else (a different sequence, another status or error type).

    ``detail`` is empty for ``exact``; the broker's messages for ``rejected``; what differs for ``other``.
    """

    kind: ReplayKind
    detail: str = ""


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def classify_replay(case: GroundTruthCase, records: list[dict[str, Any]]) -> ReplayOutcome:
    """Judge ``records`` (this case's call records, as in a job view's ``calls``) against ``case.calls``."""
    recorded = [[r["tool"], r["args"]] for r in records]
    expected = [[name, args] for name, args in case.calls]
    if _canonical(recorded) != _canonical(expected):
        return ReplayOutcome("other", f"recorded {_canonical(recorded)}, expected {_canonical(expected)}")
    refused = [r for r in records if r["status"] == "rejected" and r["error"]["type"] == "invalid_arguments"]
    unexpected = [r for r in records if r["status"] != "ok" and r not in refused]
    if unexpected:
        return ReplayOutcome("other", "; ".join(f"{r['tool']}: {r['status']} {r['error']}" for r in unexpected))
    if refused:
        return ReplayOutcome("rejected", "; ".join(r["error"]["message"] for r in refused))
    return ReplayOutcome("exact")
