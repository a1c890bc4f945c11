"""service.toolkit.validation: enum by set with JSON equality, the CPU budget of a check, fair scheduling."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import jsonschema
import pytest

from service.errors import CheckTooCostly, ManifestError
from service.toolkit.keywords import Validator
from service.toolkit.manifest import parse_tool
from service.toolkit.validation import ENUM_SET_MIN, CheckScheduler, canonical, run_budgeted

PADDING = [f"pad{i}" for i in range(ENUM_SET_MIN)]  # makes an enum long enough to be checked by set
SAMPLES: list[Any] = [
    1,
    1.0,
    True,
    False,
    0,
    0.0,
    None,
    "1",
    "",
    2**63,
    float(2**63),
    1.5,
    [1, "a"],
    [1.0, "a"],
    [True, "a"],
    {"a": 1},
    {"a": 1.0},
    {"a": True},
    {"a": 1, "b": None},
    [],
    {},
    [[0]],
    [[False]],
]


def _valid(validator_class: Any, enum: list[Any], value: Any) -> bool:
    return bool(validator_class({"enum": enum}).is_valid(value))


@pytest.mark.parametrize("padded", [False, True], ids=["scanned", "by-set"])
@pytest.mark.parametrize("member", SAMPLES, ids=repr)
def test_enum_agrees_with_jsonschema_on_json_equality(member: Any, padded: bool) -> None:
    enum = [member, *PADDING] if padded else [member]
    for value in SAMPLES:
        expected = _valid(jsonschema.Draft202012Validator, enum, value)
        assert _valid(Validator, enum, value) == expected, (member, value)


def test_one_true_and_one_point_zero() -> None:
    ones = [1, *PADDING]
    assert _valid(Validator, ones, 1) and _valid(Validator, ones, 1.0)
    assert not _valid(Validator, ones, True)
    assert not _valid(Validator, [True, *PADDING], 1)
    assert not _valid(Validator, [0, *PADDING], False)
    assert canonical(1) == canonical(1.0) != canonical(True)


def test_a_long_enums_error_lists_a_few_members() -> None:
    [error] = Validator({"enum": [f"v{i}" for i in range(3000)]}).iter_errors("nope")
    assert error.message.startswith("'nope' is not one of ['v0', 'v1'")
    assert error.message.endswith("... (3000 values)]") and len(error.message) < 400


def test_a_large_enum_over_many_items_is_cheap() -> None:
    enum = [f"v{i}" for i in range(3000)]
    tool = parse_tool(
        {
            "name": "t",
            "parameters": {"type": "object", "properties": {"xs": {"type": "array", "items": {"enum": enum}}}},
            "endpoint": {"kind": "echo"},
        },
        ("tools", 0),
    )
    check = run_budgeted(1.0, tool.check_arguments, {"xs": [enum[-1]] * 20_000})  # 4 s with jsonschema's enum
    assert check.problem is None
    assert "is not one of" in (run_budgeted(1.0, tool.check_arguments, {"xs": ["v3000"]}).problem or "")


def test_a_check_past_its_cpu_budget_raises() -> None:
    schema = {"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": i} for i in range(50)]}}
    with pytest.raises(CheckTooCostly, match=r"0\.01 s of CPU"):
        run_budgeted(0.01, lambda: list(Validator(schema).iter_errors([-1] * 100_000)))
    assert list(Validator(schema).iter_errors([-1])) != []  # outside a budgeted run nothing counts


def test_the_scheduler_serializes_a_job_and_serves_jobs_round_robin() -> None:
    async def scenario() -> list[str]:
        checks = CheckScheduler(threads=1, budget_s=5.0)
        order: list[str] = []
        gate = threading.Event()

        def work(name: str) -> str:
            if name == "a1":
                gate.wait(5)
            order.append(name)
            return name

        hog = [asyncio.ensure_future(checks.run("key-a", "job-a", work, f"a{i}")) for i in range(1, 4)]
        await asyncio.sleep(0.05)  # a1 runs (blocked); a2, a3 wait
        other = asyncio.ensure_future(checks.run("key-b", "job-b", work, "b1"))
        await asyncio.sleep(0.05)
        gate.set()
        assert await other == "b1"
        await asyncio.gather(*hog)
        checks.close()
        return order

    # a2 was waiting before b1 arrived, so it goes first; a3 does not overtake b1 (FIFO would give a1 a2 a3 b1)
    assert asyncio.run(scenario()) == ["a1", "a2", "b1", "a3"]


def test_one_job_never_takes_two_threads() -> None:
    async def scenario() -> int:
        checks = CheckScheduler(threads=4, budget_s=5.0)
        running = 0
        most = 0
        lock = threading.Lock()

        def work() -> None:
            nonlocal running, most
            with lock:
                running += 1
                most = max(most, running)
            threading.Event().wait(0.02)
            with lock:
                running -= 1

        await asyncio.gather(*(checks.run("k", "job", work) for _ in range(6)))
        checks.close()
        return most

    assert asyncio.run(scenario()) == 1


def test_a_budget_error_reaches_the_caller() -> None:
    async def scenario() -> None:
        checks = CheckScheduler(threads=1, budget_s=0.01)
        schema = {"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": i} for i in range(50)]}}
        with pytest.raises(CheckTooCostly):
            await checks.run("k", "job", lambda: list(Validator(schema).iter_errors([-1] * 100_000)))
        assert await checks.run("k", "job", lambda: 42) == 42
        checks.close()

    asyncio.run(scenario())


# -- keywords that loop over an instance's members (issue 11 review, fault 4) ----------------------------------------

REDOS = "^(a|a)+$"  # exponential backtracking on "aaaa...b"


def _tool(parameters: dict[str, Any]) -> Any:
    return parse_tool({"name": "t", "parameters": parameters, "endpoint": {"kind": "echo"}}, ("tools", 0))


def _cpu(fn: Any, *args: Any) -> tuple[Any, float]:
    started = time.thread_time()
    try:
        return fn(*args), time.thread_time() - started
    except CheckTooCostly as exc:
        return exc, time.thread_time() - started


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "patternProperties": {REDOS: {}}, "additionalProperties": True},
        {"type": "object", "patternProperties": {REDOS: {}}, "additionalProperties": False},
        {"type": "object", "propertyNames": {"pattern": REDOS}, "additionalProperties": True},
    ],
    ids=["patternProperties", "additionalProperties", "propertyNames"],
)
def test_regex_work_over_many_keys_stays_within_the_budget(parameters: dict[str, Any]) -> None:
    # 1,500 keys that each take the pattern (almost) its whole 50 ms: 75 s of CPU before the fix (52 s measured).
    args = {"a" * 16 + "b" + str(i): 1 for i in range(1500)}
    outcome, cpu_s = _cpu(run_budgeted, 0.2, _tool(parameters).check_arguments, args)
    assert isinstance(outcome, CheckTooCostly)
    assert cpu_s < 0.2 + 0.5  # the budget, plus at most one regex search's time limit (and generous slack)


def test_a_regex_timeout_refuses_the_call_instead_of_escaping() -> None:
    tool = _tool({"type": "object", "patternProperties": {REDOS: {}}, "additionalProperties": True})
    with pytest.raises(CheckTooCostly, match=r"took more than 0\.05 s"):
        run_budgeted(5.0, tool.check_arguments, {"a" * 25 + "b": 1})  # before: jsonschema ValidationError raised


def test_an_invalid_pattern_is_a_validation_error_not_an_exception() -> None:
    tool = _tool({"type": "object", "properties": {"s": {"type": "string", "pattern": "(?<"}}})
    check = run_budgeted(1.0, tool.check_arguments, {"s": "x"})
    assert check.problem is not None and "invalid pattern" in check.problem


@pytest.mark.parametrize(
    ("parameters", "args"),
    [
        ({"type": "object", "properties": {"xs": {"type": "array", "items": {}}}}, {"xs": [0] * 2_000_000}),
        ({"type": "object", "properties": {"xs": {"type": "array", "contains": True}}}, {"xs": [0] * 2_000_000}),
        ({"type": "object", "propertyNames": True, "additionalProperties": True}, {str(i): 0 for i in range(400_000)}),
        ({"type": "object", "additionalProperties": {}}, {str(i): 0 for i in range(400_000)}),
    ],
    ids=["items", "contains", "propertyNames", "additionalProperties"],
)
def test_members_count_even_under_an_empty_subschema(parameters: dict[str, Any], args: dict[str, Any]) -> None:
    with pytest.raises(CheckTooCostly):  # a member under `true` / `{}` runs no keyword of its own
        run_budgeted(0.0, _tool(parameters).check_arguments, args)


def test_unevaluated_properties_with_pattern_properties_is_refused() -> None:
    with pytest.raises(ManifestError, match="unevaluatedProperties"):
        _tool({"type": "object", "patternProperties": {REDOS: {}}, "unevaluatedProperties": False})


# Compiling a pattern has no time limit (the search's timeout bounds matching) and `regex` unrolls counted repeats:
# 26 characters took 8 s and 2.9 GB to compile, and with {100} for {10} more memory than the machine had, at the
# first call of the tool. Such patterns are refused when the manifest is parsed, before anything compiles them.
COMPILE_BOMB = "(?:(?:a{1000}){1000}){100}"


@pytest.mark.parametrize(
    ("entry", "where"),
    [
        ({"parameters": {"properties": {"s": {"type": "string", "pattern": COMPILE_BOMB}}}}, "parameters"),
        ({"parameters": {"patternProperties": {COMPILE_BOMB: {}}}}, "parameters"),
        ({"parameters": {"properties": {"s": {"propertyNames": {"pattern": "(" * 200 + ")" * 200}}}}}, "parameters"),
        ({"parameters": {"properties": {"s": {"pattern": "a" * 30_000}}}}, "parameters"),
        ({"parameters": {"properties": {f"s{i}": {"pattern": "a" * 15_000} for i in range(20)}}}, "parameters"),
        ({"outputSchema": {"properties": {"s": {"pattern": COMPILE_BOMB}}}}, "outputSchema"),
        ({"approval": {"when": {"properties": {"s": {"pattern": COMPILE_BOMB}}}}}, "approval.when"),
        ({"approval": {"when": {"properties": {"s": {"pattern": "(" * 5000 + ")" * 5000}}}}}, "approval.when"),
    ],
)
def test_patterns_too_costly_to_compile_are_refused_when_parsed(entry: dict[str, Any], where: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ManifestError, match="too costly to compile") as caught:
        parse_tool({"name": "t", "endpoint": {"kind": "echo"}, **entry}, ("tools", 0))
    assert ".".join(map(str, caught.value.loc)) == f"tools.0.{where}"
    assert time.perf_counter() - started < 5  # nothing compiled (the bomb alone takes minutes and gigabytes)


@pytest.mark.parametrize(
    "pattern",
    [
        r"^(?:\d{1,3}\.){3}\d{1,3}$",
        r"^[0-9a-f]{8}-(?:[0-9a-f]{4}-){3}[0-9a-f]{12}$",
        r"^[a-z]{1,63}(?:\.[a-z]{1,63}){0,126}$",
        r"^\p{L}{1,255}$",
        r"^(?:a{100}){100}$",
        "x{1000}[{}]\\{5000}",
    ],
)
def test_ordinary_patterns_are_taken(pattern: str) -> None:
    tool = _tool({"properties": {"s": {"type": "string", "pattern": pattern}}})
    assert tool.check_arguments({"s": "!"}).problem is not None  # checked at call time, as before
