"""service.toolkit.validation: enum by set with JSON equality, the CPU budget of a check, fair scheduling."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import jsonschema
import pytest

from service.errors import CheckTooCostly
from service.toolkit.manifest import Validator, parse_tool
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
