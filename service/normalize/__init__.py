"""Script normalization: undo the mechanical damage models do to scripts before they run (docs/normalization.md).

Only a script that does not compile as it is gets touched: a script that
compiles is returned byte for byte (and so is one longer than ``MAX_CHARS``), with one exception: a script that is
exactly one expression statement whose value is a dict display with one code-like string field
(``{"code": "print(1)"}``, which would do nothing) runs that field's code (``json_wrapper``) when it compiles,
after repairs of its own if need be; so does a repaired script of that form. For one that does not, a small
breadth-first search applies the repairs below (each at most once) and keeps the shortest sequence whose result
compiles (among sequences as short, the first in this order; a byte-order mark and CR line endings are taken off
first); when none does, the script is returned unchanged, with a one-line ``hint`` when a known mechanical
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
(``ptc_script_normalizations_total{kind}``); ``service.observability.metrics`` registers it
with each app's registry.

This module holds the search and the service's side; the repairs are in the package's modules: ``layout``
(``bom``, ``crlf``, ``indent``, ``tabs``), ``wrappers`` (``fence``, ``tag_wrapper``, ``json_wrapper``), ``shell``
(``shell_wrapper``) and ``escapes`` (``literal_escapes``); ``source`` holds what they share (compiling, lines, code
or text), ``hints`` the hint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from service.normalize.escapes import literal_escapes
from service.normalize.hints import hint_for
from service.normalize.layout import bom, crlf, indent, tabs
from service.normalize.shell import shell_wrapper
from service.normalize.source import Candidate, compile_error, compiles
from service.normalize.wrappers import fence, is_bare_dict, json_wrapper, tag_wrapper

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
MAX_COMPILES = 16  # compile attempts per script (each repair sequence costs one); bounds the search
MAX_CHARS = 64 * 1024  # longer scripts run as sent: compiling holds the GIL (about 1 ms per KiB here)
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


_ENCODINGS = ("bom", "crlf")  # taken off before the search (see _search), in this order, first in _REPAIRS
_REPAIRS: tuple[tuple[str, Callable[[str], list[Candidate]]], ...] = (
    ("bom", bom),
    ("crlf", crlf),
    ("fence", fence),
    ("tag_wrapper", tag_wrapper),
    ("json_wrapper", json_wrapper),
    ("shell_wrapper", shell_wrapper),
    ("literal_escapes", literal_escapes),
    ("indent", indent),
    ("tabs", tabs),
)


# -- the search ----------------------------------------------------------------------------------------------------


@dataclass
class _RepairBudget:
    compiles_left: int = MAX_COMPILES

    def compiles(self, source: str) -> bool:
        if self.compiles_left <= 0:
            return False
        self.compiles_left -= 1
        return compiles(source)


def _search(text: str, used: frozenset[str], budget: _RepairBudget) -> tuple[str, list[Repair]] | None:
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
    error = compile_error(script)
    budget = _RepairBudget()
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
    return Normalized(script, script, hint=hint_for(script, error), compile_error=_error_fields(error))


def _unwrap_bare_dict(script: str, used: frozenset[str], budget: _RepairBudget) -> tuple[str, list[Repair]] | None:
    """For a compiling ``script`` that is only a dict display, which does nothing (``{"code": "print(1)"}``): the
    code of its one code-like field and the repairs, when that code compiles (after repairs of its own), else None."""
    if "json_wrapper" in used or not is_bare_dict(script):
        return None
    for code, detail in json_wrapper(script):
        repair = Repair("json_wrapper", detail)
        if budget.compiles(code):
            return code, [repair]
        deeper = _search(code, used | {"json_wrapper"}, budget)
        if deeper is not None:
            return deeper[0], [repair, *deeper[1]]
    return None


def verdict_only(script: str) -> Normalized:
    """``script`` unchanged, with its ``compile_error`` when it does not compile (unexamined past ``MAX_CHARS``)."""
    error = compile_error(script) if len(script) <= MAX_CHARS else None
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
