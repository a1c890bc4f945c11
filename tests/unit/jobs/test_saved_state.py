"""A parked job's saved state (``durability.SavedState``): kept in its run spec across the store, and what a run that
continues it makes again before it starts (``catch_up``: the calls behind the state, in their order, none it waited
for and none made after it)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

import orjson

from service.broker.durable import Logged
from service.jobs.durability import RunSpec, SavedState, catch_up
from service.schemas.job_models import ExecuteRequest


def test_a_saved_state_survives_the_run_specs_encoding() -> None:
    state = SavedState(b"\x00\xffmonty-dump", 7, frozenset({"call_a", "call_b"}))
    spec = RunSpec("job_1", "alice", False, "monty", "default", datetime.now(UTC), None, ExecuteRequest(script="1"))
    assert RunSpec.decode(spec.encode()).state is None
    kept = RunSpec.decode(RunSpec(**{**spec.__dict__, "state": state}).encode())
    assert kept.state == state and kept.engine == "monty"


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def call(self, tool: str, args: Any, repair: str | None = None) -> dict[str, Any]:
        self.calls.append((tool, args))
        return {"ok": True, "result": None}


async def test_catch_up_makes_the_calls_behind_the_state_again_in_their_order() -> None:
    log = [
        Logged(3, "c3", "echo", orjson.dumps({"x": 3}), b"{}"),
        Logged(1, "c1", "echo", orjson.dumps({"x": 1}), b"{}"),
        Logged(2, "c2", "ask", orjson.dumps({"q": "go"})),  # waited for at the park: made again by the script
        Logged(4, "c4", "echo", orjson.dumps({"x": 4}), b"{}"),  # after the state: the script makes it
    ]
    broker = Recorder()
    await catch_up(cast(Any, broker), log, SavedState(b"", 4, frozenset({"c2"})))
    assert broker.calls == [("echo", {"x": 1}), ("echo", {"x": 3})]
    await catch_up(cast(Any, broker), log, None)  # a replay: the script makes them all
    assert len(broker.calls) == 2
