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

Replays: :func:`replay_script` writes entries' ground-truth calls as a Python script, :func:`js_replay_script` as a
JavaScript module (sequential ``await`` or ``Promise.all``); ``simple_javascript``, whose types and values are
BFCL's JavaScript dialect, is loaded by :func:`load_javascript_ground_truth`.  What a number becomes on its way from
a JavaScript script to the call record is said at :func:`js_literal` (a large integer is a BigInt, sent exactly) and
:func:`as_sent_from_javascript` (a whole float is sent as an integer).
"""

from __future__ import annotations

import importlib.util
import json
import keyword
import math
import pathlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Literal

__all__ = [
    "CASE_MARKER",
    "GROUND_TRUTH_CATEGORIES",
    "JAVASCRIPT_CATEGORY",
    "MAX_SAFE_INTEGER",
    "GroundTruthCase",
    "ReplayKind",
    "ReplayOutcome",
    "as_sent_from_javascript",
    "bfcl_data_dir",
    "call_source",
    "classify_replay",
    "iter_function_docs",
    "javascript_expectation",
    "js_call_source",
    "js_literal",
    "js_replay_script",
    "load_ground_truth",
    "load_javascript_ground_truth",
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
    return _load_cases(category)


def _load_cases(category: str) -> list[GroundTruthCase]:
    """The entries of ``category`` with their ground truth resolved (:func:`load_ground_truth`'s rules)."""
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


# --- simple_javascript: BFCL's JavaScript dialect ------------------------------------------------------------------

#: The BFCL category of JavaScript functions (:func:`load_javascript_ground_truth`); not one of
#: :data:`GROUND_TRUTH_CATEGORIES`, whose values are Python's.
JAVASCRIPT_CATEGORY: Final = "simple_javascript"


def load_javascript_ground_truth() -> list[GroundTruthCase]:
    """Load ``BFCL_v4_simple_javascript.json`` (50 entries, one call each) with its possible answers.

    Each argument is resolved to one value by the rule of :func:`load_ground_truth` (recursing into ``dict``
    arguments), and the value is replayed as it is: the possible answers are JSON values already, not JavaScript
    source.  BFCL asks the model for a JavaScript call and reads each argument's source text by the parameter's
    declared type (``ast_checker`` through ``js_type_converter``): a quoted string for ``String``, a number for
    ``integer`` / ``float``, ``true`` / ``false`` for ``Boolean``, an array or object literal for ``array`` / ``dict``,
    and for ``any`` nothing at all (the text itself, as a string); text that is not a literal of its type (a
    variable's name, a call) stays text.  The possible answers hold what that reading gives, so, type by type:

    * ``String`` -> a string, ``integer`` -> an integer, ``float`` -> a number (whole ones such as ``4.0``: see
      :func:`as_sent_from_javascript` for what JavaScript sends), ``Boolean`` -> a boolean, ``array`` -> an array,
      ``dict`` -> an object (its values are accepted-values lists, resolved by the same rule);
    * ``any`` -> a string: the argument's source text (``"listElement"``, ``"React.createContext()"``, ``"null"``),
      which is what BFCL compares; the service reads ``any`` as "any value", so such a call passes;
    * a string for an ``array`` or ``dict`` parameter (or property of a ``dict``): the name of a variable holding the
      value in the model's call (BFCL's ``type_checker`` takes an answer whose type is not the declared one as a
      variable).  A replay has no such variable and passes the name, a string, which the entry's own schema refuses
      (``simple_javascript_9``: ``jsonPayload: "responseData"`` for a ``dict``; 8 entries of 50): like the Python
      categories' schema contradictions, such calls are expected to be refused, from JavaScript and Python alike.

    Every tool name of the category is an identifier.  ``simple_javascript_16`` lists two accepted values for
    ``vertices`` (``[10.0, 15.0]``, ``[20.0, 25.0]``); rule 2 takes the first.

    Raises:
        ValueError, TypeError: as :func:`load_ground_truth` does for a malformed ground truth.
    """
    return _load_cases(JAVASCRIPT_CATEGORY)


# --- Replay as JavaScript ------------------------------------------------------------------------------------------

#: ``Number.MAX_SAFE_INTEGER``: past it a JavaScript number no longer holds every integer, so an integer beyond
#: ``±MAX_SAFE_INTEGER`` is written as a BigInt literal (:func:`js_literal`).
MAX_SAFE_INTEGER: Final = 2**53 - 1
_JS_EXPONENT_FROM: Final = 1e21  # JSON.stringify writes a number at least this large with an exponent ("1e+21")
_JS_IDENTIFIER: Final = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")


def _js_key(key: Any) -> str:
    """An object literal's property name: bare when an identifier, else a string literal; ``__proto__`` computed."""
    if not isinstance(key, str):
        raise TypeError(f"an object key must be a string, got {key!r}")
    if key == "__proto__":  # `{__proto__: v}` and `{"__proto__": v}` set the prototype; `{["__proto__"]: v}` does not
        return f"[{json.dumps(key)}]"
    return key if _JS_IDENTIFIER.fullmatch(key) else json.dumps(key, ensure_ascii=True)


def js_literal(value: Any) -> str:
    """A JSON value as JavaScript source that evaluates to it, as a model writes it (``{city: "Oslo", days: 3}``).

    * an integer within ``±MAX_SAFE_INTEGER`` is a number literal; beyond, a BigInt literal (``12345678901234567890n``),
      which the runtime sends as that exact integer (``ptc_runtime/js/client.mjs``).  A number literal there would be
      rounded to a double before it is sent: ``12345678901234567890`` is recorded as ``12345678901234567000``;
    * a float is Python's ``repr`` (``0.1``, ``1e-05``, ``4.0``), which JavaScript reads as the same double; a whole
      one keeps its ``.0`` for the reader, though ``4.0`` is ``4`` in JavaScript (:func:`as_sent_from_javascript`);
    * a string is a JSON string literal with every non-ASCII character escaped (U+2028 and U+2029 included);
    * an object's keys are bare when identifiers, else string literals, and ``__proto__`` is computed
      (``["__proto__"]: ...``), because in a literal ``__proto__: ...`` sets the prototype instead of a property;
    * ``None``, booleans and lists (or tuples) are ``null``, ``true`` / ``false`` and arrays.

    Raises:
        ValueError: for NaN or an infinity (JSON has no such number).
        TypeError: for what JSON has not (a set, a non-string object key, ...).
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value) if abs(value) <= MAX_SAFE_INTEGER else f"{value}n"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a JSON number")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=True)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(js_literal(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_js_key(key)}: {js_literal(item)}" for key, item in value.items()) + "}"
    raise TypeError(f"{type(value).__name__} is not a JSON value: {value!r}")


def as_sent_from_javascript(value: Any) -> Any:
    """What the broker records for ``value`` written by :func:`js_literal`: the same JSON value, a whole float aside.

    JavaScript has one number type, and ``JSON.stringify`` writes a whole number below 1e21 without a fraction: the
    literal ``4.0`` is sent as ``4`` (``-0.0`` as ``0``, ``1e16`` as ``10000000000000000``), so the broker records
    the integer ``4`` where a Python script, whose ``json`` writes ``4.0``, gets ``4.0`` recorded.  Measured on the
    node image (Node.js 18, ``ptc-sandbox-node``): Python ``tools.f(a=2.0)`` records ``{"a": 2.0}``, JavaScript
    ``tools.f({a: 2.0})`` records ``{"a": 2}``; no JavaScript value is sent as ``2.0``.  The records of the two
    replays thus differ only there, in the JSON spelling of one value; this gives that integer (exact: a whole double
    is an integer), so a JavaScript record compares exactly with it, which compares the Python record by value.
    Everything else is recorded as Python's is: integers exactly (a BigInt beyond ``MAX_SAFE_INTEGER``), other floats
    as the same double (``0.1``; ``1e+21`` and above stay floats), strings, booleans, null; tuples become lists.
    """
    if isinstance(value, float) and value.is_integer() and abs(value) < _JS_EXPONENT_FROM:
        return int(value)
    if isinstance(value, (list, tuple)):
        return [as_sent_from_javascript(item) for item in value]
    if isinstance(value, dict):
        return {key: as_sent_from_javascript(item) for key, item in value.items()}
    return value


def javascript_expectation(case: GroundTruthCase) -> GroundTruthCase:
    """``case`` with its calls as a JavaScript replay gets them recorded (:func:`as_sent_from_javascript`), for
    :func:`classify_replay`."""
    calls = [(name, as_sent_from_javascript(args)) for name, args in case.calls]
    return GroundTruthCase(id=case.id, category=case.category, functions=case.functions, calls=calls)


def js_call_source(name: str, args: dict[str, Any]) -> str:
    """A call as JavaScript: ``tools[<name as a string literal>](<args as an object literal>)``, a promise.

    Every tool is on the ``tools`` object under its original name, so the bracket form needs no rule for dotted
    names or names that are not identifiers; the arguments are :func:`js_literal`'s.

    Raises:
        TypeError: if ``args`` is not a dict (a tool takes one object of arguments), or as :func:`js_literal`.
        ValueError: as :func:`js_literal`.
    """
    if not isinstance(args, dict):
        raise TypeError(f"{name}: the arguments must be one object, got {args!r}")
    return f"tools[{json.dumps(name, ensure_ascii=True)}]({js_literal(args)})"


_JS_PRELUDE: Final = (
    'import tools, { ToolError } from "tools";',
    "",
    "// A refused call (ToolError) does not stop the replay; any other exception does (it would be a runtime bug).",
    "const refused = (error) => {",
    "  if (!(error instanceof ToolError)) throw error;",
    "};",
    "",
)


def js_replay_script(cases: list[GroundTruthCase], marker: bool = True, gather: bool = False) -> str:
    """Source of a JavaScript module that makes each case's ground-truth calls, as :func:`replay_script` does in Python.

    Sequential (the default): one ``await`` per call, in ``try`` / ``catch``.  With ``gather`` a case's calls are
    started together: ``await Promise.all([call.catch(refused), ...])``, one per case.  Either way the records come in
    the Python replay's order, the ground truth's: a call's request is written on the broker connection when the call
    starts, before its first ``await`` (``ptc_runtime/js/client.mjs``), ``Promise.all`` starts its calls in array
    order, and the broker numbers records (``seq``) in arrival order (``service/broker/records.py``).

    With ``marker`` each case's calls are preceded by ``await tools["bfcl_case"]({id: <case id>})``, awaited, so that
    :func:`split_records` applies.  A refused call (``ToolError``) does not stop the script; any other exception does.

    Raises:
        TypeError, ValueError: as :func:`js_literal`, for a value JSON cannot carry.
    """
    lines = list(_JS_PRELUDE)
    for case in cases:
        if marker:
            lines.append(f"await {js_call_source(CASE_MARKER, {'id': case.id})};")
        calls = [js_call_source(name, args) for name, args in case.calls]
        if gather:
            lines += ["await Promise.all([", *(f"  {call}.catch(refused)," for call in calls), "]);"]
        else:
            lines += [f"try {{ await {call}; }} catch (error) {{ refused(error); }}" for call in calls]
    return "\n".join(lines) + "\n"
