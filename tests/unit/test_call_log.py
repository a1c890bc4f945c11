"""A durable job's call log in its broker (``service.broker.durable``): what is stored before a call goes out and
before its script sees the outcome, the batches, the replay's matching and its divergence."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from service.broker import Broker, BrokerConfig, BrokerHooks, BrokerShared
from service.broker.durable import Diverged, DurableLog, Logged, call_id, decode_outcome, encode_answer, encode_outcome
from service.egress import EgressPolicy
from service.toolkit.endpoints import EndpointClients
from service.toolkit.manifest import parse_manifest


class Port:
    """A call log in memory: each write's entries, and the log as stored (seq -> entry)."""

    def __init__(self, fail: bool = False) -> None:
        self.writes: list[list[Logged]] = []
        self.stored: dict[int, Logged] = {}
        self.fail = fail

    async def __call__(self, entries: Sequence[Logged]) -> None:
        await asyncio.sleep(0)
        if self.fail:
            raise OSError("the store is down")
        self.writes.append(list(entries))
        self.stored.update((entry.seq, entry) for entry in entries)


def record() -> dict[str, Any]:
    return {"status": "ok", "started_at": datetime.now(UTC), "duration_ms": 1.5, "repairs": [], "repaired": False}


def test_call_ids_are_deterministic_per_job_and_place() -> None:
    assert call_id("job_a", 1) == call_id("job_a", 1)
    assert len({call_id("job_a", 1), call_id("job_a", 2), call_id("job_b", 1)}) == 3
    assert call_id("job_a", 1).startswith("call_") and len(call_id("job_a", 1)) == 21


def test_an_outcome_keeps_the_reply_and_the_result_bytes_exactly() -> None:
    body = b'{"big": 123456789012345678901234567890, "s": "\\u00e9"}'
    replayed = decode_outcome(encode_outcome(record(), {"ok": True, "result": orjson.Fragment(body)}))
    assert replayed.result == body and orjson.dumps(replayed.reply) == b'{"ok":true,"result":' + body + b"}"
    assert replayed.fields["status"] == "ok" and replayed.fields["duration_ms"] == 1.5
    failed = decode_outcome(encode_outcome(record(), {"ok": False, "error": {"type": "x", "message": "m"}}))
    assert failed.reply == {"ok": False, "error": {"type": "x", "message": "m"}} and failed.result is None


async def test_intents_of_one_loop_turn_are_stored_in_one_write_before_any_call_goes_on() -> None:
    port = Port()
    log = DurableLog("job_a", port)
    placed = await asyncio.gather(*(log.begin("t", b'{"i":%d}' % i) for i in range(50)))
    assert [seq for seq, _, _ in placed] == list(range(1, 51))
    assert len(port.writes) == 1 and len(port.stored) == 50  # every intent stored by the time any begin returned
    assert all(entry.outcome is None for entry in port.stored.values())


async def test_an_intent_the_store_refuses_raises_so_the_call_is_not_made() -> None:
    log = DurableLog("job_a", Port(fail=True))
    with pytest.raises(OSError):
        await log.begin("t", b"{}")


async def test_a_replay_answers_logged_calls_in_any_order_then_goes_live() -> None:
    done = [
        Logged(n, call_id("job_a", n), "t", b'{"i":%d}' % n, encode_outcome(record(), {"ok": True, "result": n}))
        for n in (1, 2, 3)
    ]
    pending = Logged(4, call_id("job_a", 4), "t", b'{"i":4}')  # sent, perhaps: made again under its id
    port = Port()
    log = DurableLog("job_a", port, [*done, pending])
    answers = await asyncio.gather(*(log.begin("t", b'{"i":%d}' % n) for n in (3, 1, 4, 2)))
    assert [(seq, call) for seq, call, _ in answers] == [(n, call_id("job_a", n)) for n in (3, 1, 4, 2)]
    assert [replayed is not None for _, _, replayed in answers] == [True, True, False, True]
    assert answers[0][2] is not None and orjson.dumps(answers[0][2].reply) == b'{"ok":true,"result":3}'
    assert not log.replaying and log.replayed == 3
    assert await log.begin("t", b'{"i":5}') == (5, call_id("job_a", 5), None)  # the log is consumed: live


async def test_a_call_the_log_does_not_hold_diverges_once_no_other_call_consumes_the_log() -> None:
    logged = [Logged(1, call_id("job_a", 1), "t", b'{"t":1.5}', encode_outcome(record(), {"ok": True, "result": 1}))]
    log = DurableLog("job_a", Port(), logged, settle_s=0.05)
    with pytest.raises(Diverged, match=r'the replay called t\(\{"t":2.5\}\).*the first: t\(\{"t":1.5\}\) \(call 1\)'):
        await log.begin("t", b'{"t":2.5}')
    with pytest.raises(Diverged):  # and every later call
        await log.begin("t", b'{"t":1.5}')


async def test_an_unlogged_call_waits_while_concurrent_calls_consume_the_log() -> None:
    """Calls in flight when a run died may have no intent stored: one arriving first waits for the others."""
    logged = [Logged(1, call_id("job_a", 1), "t", b'{"i":1}', encode_outcome(record(), {"ok": True, "result": 1}))]
    log = DurableLog("job_a", Port(), logged, settle_s=5)
    unlogged = asyncio.ensure_future(log.begin("t", b'{"i":2}'))
    await asyncio.sleep(0.05)
    assert not unlogged.done()
    assert (await log.begin("t", b'{"i":1}'))[2] is not None
    assert await asyncio.wait_for(unlogged, 1) == (2, call_id("job_a", 2), None)


ECHO = [{"name": "echo", "parameters": {"properties": {"x": {}}}, "endpoint": {"kind": "echo"}}]


async def test_a_durable_brokers_calls_are_answered_only_once_their_outcome_is_stored() -> None:
    port = Port()
    tools = parse_manifest(ECHO)
    shared = BrokerShared(EndpointClients(5.0, 1 << 20, EgressPolicy()))
    broker = Broker(tools, shared, BrokerConfig(100, 1 << 20, 1 << 20), durable=DurableLog("job_a", port))
    try:
        reply = await broker.call("echo", {"x": 1})
        assert reply == {"ok": True, "result": {"tool": "echo", "args": {"x": 1}}}
        assert [[entry.outcome is None for entry in write] for write in port.writes] == [[True], [False]]
        assert broker.records.calls[0]["call_id"] == call_id("job_a", 1)
    finally:
        await broker.close()
        await shared.endpoints.aclose()


async def test_a_diverged_replay_tells_its_hook_and_makes_no_call() -> None:
    diverged: list[str] = []
    logged = [Logged(1, call_id("job_a", 1), "echo", b'{"x":1}', None)]
    tools = parse_manifest(ECHO)
    shared = BrokerShared(EndpointClients(5.0, 1 << 20, EgressPolicy()))
    hooks = BrokerHooks(on_diverged=diverged.append)
    durable = DurableLog("job_a", Port(), logged, settle_s=0.05)
    broker = Broker(tools, shared, BrokerConfig(100, 1 << 20, 1 << 20), hooks=hooks, durable=durable)
    try:
        reply = await broker.call("echo", {"x": 2})
        assert reply["ok"] is False and reply["error"]["type"] == "replay_diverged" and len(diverged) == 1
        assert broker.records.calls[0]["status"] == "rejected"
    finally:
        await broker.close()
        await shared.endpoints.aclose()


async def test_a_log_past_its_cap_gives_up_durability_once_and_calls_go_on_unlogged() -> None:
    port, gave_up = Port(), []

    async def give_up() -> None:
        gave_up.append(len(port.stored))

    log = DurableLog("job_a", port, bounds=(100, give_up))
    made: list[int] = []

    async def call(i: int) -> dict[str, Any]:
        async def make() -> dict[str, Any]:
            made.append(i)
            return {"ok": True, "result": "x" * 30}

        return await log.run("t", b'{"i":%d}' % i, record(), make, lambda *_: None, None, 0.0)

    for i in range(5):
        assert await call(i) == {"ok": True, "result": "x" * 30}
    assert made == [0, 1, 2, 3, 4]  # every call made, logged or not
    assert log.given_up and gave_up == [1] and log.logged_bytes <= 100
    assert sorted(port.stored) == [1] and port.stored[1].outcome is None  # its outcome would pass the cap


async def test_calls_waiting_on_the_log_cost_nothing_per_later_consumption() -> None:
    """A replay holding hundreds of calls that match nothing while it consumes the log one call at a time: each
    consumption is one lookup, the waiting calls are not woken (they were rescanning the whole log each time)."""
    logged = [
        Logged(n, call_id("job_a", n), "t", b'{"i":%d}' % n, encode_outcome(record(), {"ok": True, "result": n}))
        for n in range(1, 2001)
    ]
    log = DurableLog("job_a", Port(), logged, settle_s=60)
    held = [asyncio.ensure_future(log.begin("other", b'{"j":%d}' % j)) for j in range(500)]
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    began = loop.time()
    for n in range(1, 2000):
        assert (await log.begin("t", b'{"i":%d}' % n))[2] is not None
    assert loop.time() - began < 1.0 and not any(call.done() for call in held)
    assert (await log.begin("t", b'{"i":2000}'))[2] is not None  # the last one: the held calls go live
    placed = await asyncio.gather(*held)
    assert sorted(seq for seq, _, replayed in placed if replayed is None) == list(range(2001, 2501))


async def test_an_intent_the_store_refuses_ends_the_jobs_durability_and_the_call_is_not_made() -> None:
    gave_up: list[bool] = []

    async def give_up() -> None:
        gave_up.append(True)

    log = DurableLog("job_a", Port(fail=True), bounds=(1 << 30, give_up))
    made: list[bool] = []

    async def make() -> dict[str, Any]:
        made.append(True)
        return {"ok": True, "result": 1}

    reply = await log.run("t", b"{}", record(), make, lambda *_: None, None, 0.0)
    assert reply["error"]["type"] == "store_unavailable" and not made and gave_up == [True] and log.given_up
    assert await log.run("t", b"{}", record(), make, lambda *_: None, None, 0.0) == {"ok": True, "result": 1}


async def test_a_closing_broker_waits_for_the_writes_under_way() -> None:
    port = Port()
    log = DurableLog("job_a", port)
    pending = [asyncio.ensure_future(log.begin("t", b'{"i":%d}' % i)) for i in range(3)]
    await asyncio.sleep(0)  # the calls have handed their intents to the writer; its batch is not stored yet
    assert not port.stored
    await log.flushed()
    assert sorted(port.stored) == [1, 2, 3]
    await asyncio.gather(*pending)


async def test_a_stored_answer_stays_in_the_log_until_its_call_has_an_outcome() -> None:
    """The replay reaching a call answered while its job was parked does not write its bare intent over the stored
    answer: for an approval, the whole endpoint request lies between, and a crash there lost the decision (the next
    start asked for an approval again of a call its endpoint had received)."""
    answer = {"kind": "approval", "approval": {"decision": "approved", "by": "alice", "at": "2026-12-07T00:00:00Z"}}
    stored = Logged(1, "c1", "publish", b"{}", encode_answer(answer))
    port = Port()
    durable = DurableLog("job_a", port, [stored])
    assert durable.answers == {"c1": answer}
    assert await durable.begin("publish", b"{}") == (1, "c1", None)  # made again, to take its answer
    await asyncio.sleep(0.01)
    assert port.writes == []  # the answer stays stored
