"""Parking's parts that need no engine: the paused calls of a resumed job (answers given while it was parked,
expiries carried over), the call log's answers, and the index of parked jobs (bounds, expiry order)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from service.broker.config import BrokerConfig
from service.broker.durable import DurableLog, Logged, decode_answer, encode_answer, encode_outcome
from service.broker.paused import ClientResult, PausedCalls, approval_decision, client_answer
from service.errors import CallNotPending, PayloadTooLarge
from service.jobs.parking import ParkedJob, ParkedJobs
from service.toolkit.manifest import parse_manifest

CONFIG = BrokerConfig(max_calls=10, max_line_bytes=1 << 20, max_record_bytes=1 << 20, max_pause_s=3.0)
TOOLS = parse_manifest(
    [
        {"name": "ask", "parameters": {}, "endpoint": {"kind": "client"}, "timeout_s": 86400},
        {"name": "drop", "parameters": {}, "endpoint": {"kind": "echo"}, "approval": "always"},
    ]
)


def record(call_id: str, seq: int = 1) -> dict[str, Any]:
    return {"call_id": call_id, "seq": seq, "tool": "ask", "status": "pending"}


async def test_an_answer_given_while_parked_is_taken_at_once_by_the_call_made_again() -> None:
    answers: dict[str, dict[str, Any]] = {
        "c1": {"kind": "client", "ok": True, "value": {"v": 1}},
        "c2": {"kind": "timeout"},
    }
    paused = PausedCalls(CONFIG, answers=answers)
    assert await asyncio.wait_for(paused.ask_client(TOOLS["ask"], b"{}", record("c1")), 1) == ClientResult({"v": 1})
    reply = await asyncio.wait_for(paused.ask_client(TOOLS["ask"], b"{}", record("c2")), 1)
    assert isinstance(reply, dict) and reply["error"]["type"] == "timeout"
    decided = {"kind": "approval", "approval": approval_decision(False, "alice", "no")}
    rec = record("c3")
    approvals = PausedCalls(CONFIG, answers={"c3": decided})
    refused = await asyncio.wait_for(approvals.await_approval(TOOLS["drop"], b"{}", rec), 1)
    assert refused is not None and refused["error"]["type"] == "denied" and rec["approval"]["by"] == "alice"


async def test_no_call_waits_past_the_longest_pause_whatever_its_tool_says() -> None:
    paused = PausedCalls(BrokerConfig(max_calls=1, max_line_bytes=1, max_record_bytes=1, max_pause_s=0.2))
    began = asyncio.get_running_loop().time()
    reply = await paused.ask_client(TOOLS["ask"], b"{}", record("c1"))  # its tool says a day
    assert isinstance(reply, dict) and reply["error"]["type"] == "timeout"
    assert asyncio.get_running_loop().time() - began < 1


async def test_a_carried_call_waits_only_until_its_first_expiry_and_keeps_an_early_answer() -> None:
    soon = datetime.now(UTC) + timedelta(seconds=0.2)
    paused = PausedCalls(CONFIG, carried={"c1": ("client", soon), "c2": ("client", soon + timedelta(days=1))})
    began = asyncio.get_running_loop().time()
    reply = await paused.ask_client(TOOLS["ask"], b"{}", record("c1"))
    assert isinstance(reply, dict) and reply["error"]["type"] == "timeout"
    assert asyncio.get_running_loop().time() - began < 1
    paused.answer_client_call("c2", True, "early")  # before the replay made it again: kept for it
    with pytest.raises(CallNotPending):
        paused.decide_approval("c2", True, "alice", None)  # a client call: not an approval's to decide
    assert await asyncio.wait_for(paused.ask_client(TOOLS["ask"], b"{}", record("c2", 2)), 1) == ClientResult("early")
    with pytest.raises(CallNotPending):
        paused.answer_client_call("c9", True, 1)  # never carried, never paused


async def test_waiting_since_marks_the_start_of_an_unbroken_wait() -> None:
    paused = PausedCalls(CONFIG)
    assert paused.waiting_since is None
    task = asyncio.ensure_future(paused.ask_client(TOOLS["ask"], b"{}", record("c1")))
    await asyncio.sleep(0.01)
    assert paused.waiting_since is not None and paused.waiting == 1
    [pending] = paused.pending_calls
    assert pending["expires_at"] > datetime.now(UTC)
    paused.answer_client_call("c1", True, 1)
    await task
    assert paused.waiting_since is None and paused.waiting == 0


async def port(entries: Any) -> None:
    return None


def test_answers_in_the_log_are_handed_over_and_their_calls_made_again() -> None:
    answer = {"kind": "client", "ok": True, "value": 1}
    assert decode_answer(encode_answer(answer)) == answer
    outcome = encode_outcome({"status": "ok"}, {"ok": True, "result": 1})
    assert decode_answer(outcome) is None and decode_answer(None) is None
    logged = [Logged(1, "c1", "ask", b"{}", encode_answer(answer)), Logged(2, "c2", "t", b"{}", outcome)]
    log = DurableLog("job_a", port, logged)
    assert log.answers == {"c1": answer}


async def test_the_answered_entry_is_made_again_under_its_id() -> None:
    answer = {"kind": "client", "ok": True, "value": 1}
    log = DurableLog("job_a", port, [Logged(1, "c1", "ask", b"{}", encode_answer(answer))])
    seq, call, replayed = await log.begin("ask", b"{}")
    assert (seq, call, replayed) == (1, "c1", None)  # not answered from the log: made again, taking the answer


def test_parked_jobs_are_bounded_in_all_and_per_key() -> None:
    parked = ParkedJobs(8, shared=True)
    later = datetime.now(UTC) + timedelta(days=1)
    for i in range(2):
        assert parked.room("alice")
        parked.add(ParkedJob(f"job_{i}", "alice", {"c": ("client", later)}))
    assert not parked.room("alice") and parked.room("bob")  # a quarter of 8 each
    assert parked.take("job_0") is not None and parked.room("alice") and parked.count("alice") == 1
    alone = ParkedJobs(2, shared=False)
    alone.add(ParkedJob("a", "x", {}))
    alone.add(ParkedJob("b", "x", {}))
    assert not alone.room("x") and not alone.room("y")
    assert not ParkedJobs(0, shared=False).room("x")  # parking off


async def test_expiries_come_in_order_and_skip_answered_calls() -> None:
    parked = ParkedJobs(10, shared=False)
    now = datetime.now(UTC)
    parked.add(ParkedJob("late", "x", {"c1": ("client", now + timedelta(seconds=0.3))}))
    early = ParkedJob("early", "x", {"c2": ("client", now + timedelta(seconds=0.1)), "c3": ("approval", now)})
    parked.add(early)
    del early.calls["c3"]  # answered
    seen: list[tuple[str, str]] = []

    async def expire(job: ParkedJob, call_id: str) -> None:
        seen.append((job.job_id, call_id))
        del job.calls[call_id]

    loop = asyncio.ensure_future(parked.expiry_loop(expire))
    try:
        await asyncio.sleep(0.6)
    finally:
        loop.cancel()
    assert seen == [("early", "c2"), ("late", "c1")]


def test_a_place_reserved_while_a_job_is_being_parked_counts_until_it_is_added_or_released() -> None:
    parked = ParkedJobs(4, shared=True)  # one place per key
    assert parked.reserve("alice") and not parked.reserve("alice")  # the second job of the same instant waits
    parked.add(ParkedJob("a", "alice", {}), reserved=True)
    assert not parked.room("alice") and parked.count("alice") == 1
    assert parked.reserve("bob")
    parked.release("bob")
    assert parked.room("bob")


async def test_answers_kept_before_their_call_is_made_again_are_bounded_in_bytes() -> None:
    later = datetime.now(UTC) + timedelta(days=1)
    small = BrokerConfig(max_calls=10, max_line_bytes=1 << 20, max_record_bytes=1 << 20, max_in_flight_bytes=1000)
    paused = PausedCalls(small, carried={"c1": ("client", later), "c2": ("client", later)})
    assert paused.answer_client_call("c1", True, "x" * 900)  # kept early
    with pytest.raises(PayloadTooLarge):
        paused.answer_client_call("c2", True, "y" * 200)
    assert paused.answer_client_call("c2", True, "y" * 50)


async def test_an_answer_json_cannot_carry_is_refused_when_taken_as_it_would_be_live() -> None:
    answer = client_answer(True, float("nan"))
    assert "invalid" in answer and decode_answer(encode_answer(answer)) == answer
    big = client_answer(True, 123456789012345678901234567890)
    assert decode_answer(encode_answer(big)) == big  # exactly, past 64 bits
    with pytest.raises(ValueError):
        encode_answer({"kind": "client", "ok": True, "value": "\ud800"})
    reply = await PausedCalls(CONFIG, answers={"c1": answer}).ask_client(TOOLS["ask"], b"{}", record("c1"))
    assert isinstance(reply, dict) and reply["error"]["type"] == "bad_response", reply


async def test_a_replay_that_ends_with_logged_calls_not_made_again_says_so() -> None:
    log = DurableLog("job_a", port, [Logged(1, "c1", "ask", b'{"q":1}'), Logged(2, "c2", "ask", b'{"q":2}')])
    assert log.unmade() is not None and "2 logged call(s) not made again" in (log.unmade() or "")
    await log.begin("ask", b'{"q":1}')
    await log.begin("ask", b'{"q":2}')
    assert log.unmade() is None
    assert DurableLog("job_b", port).unmade() is None  # not resumed
