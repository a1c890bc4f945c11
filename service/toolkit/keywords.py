"""The JSON Schema keywords a tool's arguments and results are checked with: Draft 2020-12, bounded.

``Validator`` is jsonschema's Draft 2020-12 validator with these keywords replaced: ``pattern`` and
``patternProperties`` search with a time bound (the ``regex`` module, ``PATTERN_TIMEOUT_S``); the keywords that
loop over an instance's members count each member against the running check's CPU budget
(``service.toolkit.validation.tick``); ``uniqueItems`` runs in linear time, ``multipleOf`` exactly where floats
overflow. Every keyword counts against the budget of the check it runs in.
"""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import jsonschema
import jsonschema._keywords as _jsonschema_keywords
import regex
from jsonschema.exceptions import ValidationError

from service.errors import CheckTooCostly
from service.toolkit.validation import budget_left, budgeted, canonical, enum_keyword, running_budget_s, tick

PATTERN_TIMEOUT_S = 0.05  # one regex search (or what is left of the check's budget, if less)
PATTERN_SHOWN = 100  # characters of a pattern or value an error message shows
ERROR_KEYS_SHOWN = 20  # unexpected keys an error message lists


def _search(pattern: str, text: str) -> bool:
    """``re.search`` semantics with a time bound (the ``regex`` module), so a pattern cannot stall the broker.

    The bound is ``PATTERN_TIMEOUT_S`` or what is left of the running check's CPU budget, if less.

    Raises:
        CheckTooCostly: the search ran out of time (the call is refused, ``limit_exceeded``), or the budget was
            already spent; a search bounded by what was left of the budget reports the budget, not its remainder.
        regex.error: ``pattern`` is not a valid pattern (the keywords below turn it into a validation error).
    """
    limit = budget_left(PATTERN_TIMEOUT_S)
    tick()
    try:
        return regex.search(pattern, text, timeout=limit) is not None
    except TimeoutError:
        budget_left(PATTERN_TIMEOUT_S)  # the check's budget is spent: say so
        budget_s = running_budget_s()
        if budget_s is not None and limit < PATTERN_TIMEOUT_S:  # the search had only what was left of the budget
            raise CheckTooCostly(budget_s) from None
        shown = pattern if len(pattern) <= PATTERN_SHOWN else pattern[:PATTERN_SHOWN] + "..."
        raise CheckTooCostly(
            limit, f"matching the pattern {shown!r} against one value took more than {limit:g} s"
        ) from None


def _bad_pattern(pattern: str, exc: regex.error) -> ValidationError:
    return ValidationError(f"the tool's schema has an invalid pattern {pattern[:PATTERN_SHOWN]!r}: {exc}")


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "string"):
        return
    try:
        found = _search(pattern, instance)
    except regex.error as exc:
        yield _bad_pattern(pattern, exc)
        return
    if not found:
        shown = instance if len(instance) <= PATTERN_SHOWN else instance[:PATTERN_SHOWN] + "..."
        yield ValidationError(f"{shown!r} does not match {pattern!r}")


# Keywords that loop over an instance's members count each member against the check's budget (``tick``): the
# keyword itself ticks once per call, but a loop over 100,000 keys or items costs 100,000 times more.


def _pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            try:
                found = _search(pattern, key)
            except regex.error as exc:
                yield _bad_pattern(pattern, exc)
                return
            if found:
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _extra_keys(instance: dict[str, Any], schema: Any) -> list[str] | ValidationError:
    """The keys of ``instance`` that neither ``properties`` nor ``patternProperties`` cover (regex searches bounded,
    each key counted); a ValidationError for an invalid pattern. (jsonschema's own uses ``re`` without a bound.)"""
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = []
    for key in instance:
        tick()
        if key in properties:
            continue
        try:
            if any(_search(pattern, key) for pattern in patterns):
                continue
        except regex.error as exc:
            return _bad_pattern(str(patterns), exc)
        extras.append(key)
    return extras


def _additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    extras = _extra_keys(instance, schema)
    if isinstance(extras, ValidationError):
        yield extras
        return
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:
        listed = ", ".join(repr(k[:PATTERN_SHOWN]) for k in sorted(extras)[:ERROR_KEYS_SHOWN])
        more = f" and {len(extras) - ERROR_KEYS_SHOWN} more" if len(extras) > ERROR_KEYS_SHOWN else ""
        if "patternProperties" in schema:
            patterns = ", ".join(repr(p) for p in sorted(schema["patternProperties"]))
            yield ValidationError(f"{listed}{more} match none of the patterns {patterns}")
        else:
            verb = "was" if len(extras) == 1 else "were"
            yield ValidationError(f"Additional properties are not allowed ({listed}{more} {verb} unexpected)")


def _property_names(validator: Any, names: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for key in instance:
        tick()
        yield from validator.descend(instance=key, schema=names)


def _items(validator: Any, items: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "array"):
        return
    prefix = len(schema.get("prefixItems", []))
    extra = len(instance) - prefix
    if extra <= 0:
        return
    if items is False:
        yield ValidationError(f"expected at most {prefix} items but found {extra} extra")
        return
    for index in range(prefix, len(instance)):
        tick()
        yield from validator.descend(instance=instance[index], schema=items, path=index)


def _contains(validator: Any, contains: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    tick(len(instance) if validator.is_type(instance, "array") else 1)
    keyword: Any = _jsonschema_keywords.contains
    yield from keyword(validator, contains, instance, schema)


def _unevaluated(name: str) -> Any:
    """jsonschema's ``unevaluatedItems`` / ``unevaluatedProperties``, every member counted first. (Their search for
    evaluated keys uses ``re`` without a bound: a manifest may not combine them with ``patternProperties``.)"""
    keyword = getattr(_jsonschema_keywords, name)

    def counted(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
        tick(len(instance) if isinstance(instance, (list, dict)) else 1)
        yield from keyword(validator, value, instance, schema)

    return counted


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    """uniqueItems in linear time (jsonschema's own compares every pair)."""
    if unique and validator.is_type(instance, "array"):
        seen: set[Any] = set()
        for item in instance:
            tick()  # an item's canonical form costs its size: count it against the check's budget
            key = canonical(item, counted=True)
            if key in seen:
                yield ValidationError(f"{item!r} appears more than once; items must be unique")
                return
            seen.add(key)


def _multiple_of(validator: Any, divisor: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    """jsonschema's ``multipleOf``, exact (``Fraction``) where it would convert an integer past a float's range
    (10**400 against 0.5: jsonschema raises OverflowError, and the call failed as the service's fault)."""
    keyword: Any = _jsonschema_keywords.multipleOf
    try:
        yield from keyword(validator, divisor, instance, schema)
    except (OverflowError, ValueError):  # ValueError: a NaN quotient (an infinite divisor: the API's reader lets
        # ``Infinity``, ``NaN`` and ``1e400`` into a tool's schema, and the meta-schema's exclusiveMinimum passes NaN)
        try:
            failed = (Fraction(instance) / Fraction(divisor)).denominator != 1
        except (OverflowError, ValueError):  # an infinite or NaN float: a multiple of nothing
            failed = True
        if failed:
            yield ValidationError(f"{instance!r} is not a multiple of {divisor}")


_KEYWORDS: dict[str, Any] = {
    **jsonschema.Draft202012Validator.VALIDATORS,
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "propertyNames": _property_names,
    "items": _items,
    "contains": _contains,
    "unevaluatedItems": _unevaluated("unevaluatedItems"),
    "unevaluatedProperties": _unevaluated("unevaluatedProperties"),
    "uniqueItems": _unique_items,
    "enum": enum_keyword,
    "multipleOf": _multiple_of,
}
# Every keyword counts against the CPU budget of the check it runs in (service.toolkit.validation).
Validator = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
    jsonschema.Draft202012Validator, {name: budgeted(fn) for name, fn in _KEYWORDS.items()}
)
