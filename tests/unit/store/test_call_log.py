"""The contract of ``CallLog`` (``store.runs``), run against both stores (``store_kind``: SQLite, PostgreSQL).

The PostgreSQL cases need the server ``deploy/local.sh`` starts (``PTC_TEST_STORE_URL``); each gets a fresh
database. They skip without it, and fail under ``CI=true``.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from service.store import JobStore, LoggedCall
from tests.unit.store.rows import T0, job


def call(seq: int, outcome: bytes | None = None, tool: str = "search") -> LoggedCall:
    """The call at ``seq`` of a job's log, its intent only unless ``outcome`` is given."""
    return LoggedCall(seq, f"call-{seq}", tool, f'{{"q": {seq}}}'.encode(), outcome)


async def test_a_spec_is_kept_and_replaced(store: JobStore) -> None:
    assert await store.runs.spec("job_1") is None
    await store.runs.put_spec("job_1", b'{"script": "a"}')
    await store.runs.put_spec("job_2", b'{"script": "b"}')
    assert await store.runs.spec("job_1") == b'{"script": "a"}'
    await store.runs.put_spec("job_1", b'{"script": "again"}')
    assert await store.runs.spec("job_1") == b'{"script": "again"}'
    assert await store.runs.spec("job_2") == b'{"script": "b"}'


async def test_calls_are_read_back_by_seq(store: JobStore) -> None:
    assert await store.runs.calls("job_1") == []
    for seq in (3, 1, 2):
        await store.runs.write("job_1", [call(seq, b'{"reply": %d}' % seq)])
    await store.runs.write("job_2", [call(1)])
    assert await store.runs.calls("job_1") == [
        call(1, b'{"reply": 1}'),
        call(2, b'{"reply": 2}'),
        call(3, b'{"reply": 3}'),
    ]
    assert await store.runs.calls("job_2") == [call(1)]


async def test_an_outcome_replaces_its_intent(store: JobStore) -> None:
    await store.runs.write("job_1", [call(1)])
    assert await store.runs.calls("job_1") == [call(1)]
    await store.runs.write("job_1", [call(1, b'{"reply": "ok", "record": {}}')])
    assert await store.runs.calls("job_1") == [call(1, b'{"reply": "ok", "record": {}}')]
    await store.runs.write("job_1", [call(1, b"", tool="other")])  # every column is replaced, an empty outcome kept
    assert await store.runs.calls("job_1") == [call(1, b"", tool="other")]


async def test_several_calls_are_written_at_once(store: JobStore) -> None:
    await store.runs.write("job_1", [call(1)])
    await store.runs.write("job_1", [call(1, b"done"), call(2), call(3, b"done")])
    assert await store.runs.calls("job_1") == [call(1, b"done"), call(2), call(3, b"done")]
    await store.runs.write("job_1", [call(4), call(4, b"last")])  # a seq given twice: its last
    assert (await store.runs.calls("job_1"))[3] == call(4, b"last")
    await store.runs.write("job_1", [])
    assert len(await store.runs.calls("job_1")) == 4


async def test_concurrent_writes_and_reads(store: JobStore) -> None:
    """Many jobs logging calls at once, as every method: safe concurrently."""
    for round_ in range(5):
        await asyncio.gather(
            *(store.runs.put_spec(f"job_{n}", b"spec %d" % round_) for n in range(8)),
            *(store.runs.write(f"job_{n}", [call(round_ + 1), call(round_ + 1, b"done")]) for n in range(8)),
            *(store.runs.calls(f"job_{n}") for n in range(8)),
        )
    logs = await asyncio.gather(*(store.runs.calls(f"job_{n}") for n in range(8)))
    assert logs == [[call(seq, b"done") for seq in range(1, 6)]] * 8
    assert await store.runs.spec("job_7") == b"spec 4"


async def test_forget_drops_one_jobs_spec_and_calls(store: JobStore) -> None:
    for job_id in ("job_1", "job_2"):
        await store.runs.put_spec(job_id, b"{}")
        await store.runs.write(job_id, [call(1, b"done"), call(2)])
    await store.runs.forget("job_1")
    assert await store.runs.spec("job_1") is None
    assert await store.runs.calls("job_1") == []
    assert await store.runs.spec("job_2") == b"{}"
    assert await store.runs.calls("job_2") == [call(1, b"done"), call(2)]
    await store.runs.forget("job_never_logged")


async def test_purge_takes_an_ended_jobs_spec_and_calls(store: JobStore) -> None:
    await store.jobs.put(job("job_old", 0, 10))
    await store.jobs.put(job("job_new", 0, 120))
    await store.jobs.put(job("job_running", 0, None, status="running"))
    for job_id in ("job_old", "job_new", "job_running"):
        await store.runs.put_spec(job_id, b"{}")
        await store.runs.write(job_id, [call(1, b"done")])
    assert await store.jobs.purge(T0 + timedelta(hours=1)) == ["job_old"]
    assert await store.runs.spec("job_old") is None
    assert await store.runs.calls("job_old") == []
    for job_id in ("job_new", "job_running"):
        assert await store.runs.spec(job_id) == b"{}"
        assert await store.runs.calls(job_id) == [call(1, b"done")]


async def test_large_bytes_round_trip_exactly(store: JobStore) -> None:
    spec = bytes(range(256)) * (3 * 4096)  # 3 MiB, every byte value
    args, outcome = spec[::-1], b"\x00" + spec[1:] + b"\xff"
    await store.runs.put_spec("job_1", spec)
    await store.runs.write("job_1", [LoggedCall(1, "call-1", "upload", args, outcome)])
    assert await store.runs.spec("job_1") == spec
    assert await store.runs.calls("job_1") == [LoggedCall(1, "call-1", "upload", args, outcome)]


async def test_settle_sets_one_calls_answer_and_settled_finds_it(store: JobStore) -> None:
    """A harness's answer is written into its call's row alone: over no outcome, or over an earlier answer when
    asked (a later answer replaces it), never over an outcome; ``settled`` names the calls holding one."""
    answer = b'{"answer":'
    await store.runs.write("job_1", [call(1, b"done"), call(2), call(3)])
    await store.runs.write("job_2", [call(2)])
    assert await store.runs.settle("job_1", "call-2", answer + b'"a"}', over=None)
    assert not await store.runs.settle("job_1", "call-2", answer + b'"timeout"}', over=None)  # answered already
    assert await store.runs.settle("job_1", "call-2", answer + b'"b"}', over=answer)  # a later answer replaces it
    assert not await store.runs.settle("job_1", "call-1", answer + b'"c"}', over=answer)  # an outcome stays
    assert not await store.runs.settle("job_1", "call-9", answer + b'"c"}', over=answer)  # no such call
    assert await store.runs.calls("job_1") == [call(1, b"done"), call(2, answer + b'"b"}'), call(3)]
    assert await store.runs.calls("job_2") == [call(2)]  # another job's call of the same id untouched
    assert await store.runs.settled("job_1", answer) == {"call-2"}
    assert await store.runs.settled("job_2", answer) == set()
