"""The sandbox's broker client (``ptc_runtime.client``) against a fake broker: one reader thread, replies to the
right callers whatever their order, awaited calls sent together, a lost broker fails every waiting call, and
whatever ends a call early (a signal handler's exception, KeyboardInterrupt, a cancelled task, a thread that dies,
a write cut short) leaves the client usable, the late reply dropped."""

from __future__ import annotations

import array
import asyncio
import ctypes
import fcntl
import json
import signal
import socket
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sandbox_image"))  # the runtime, as in the image

from ptc_runtime.client import Client, ToolError


class FakeBroker:
    """Accepts one connection; answers each chunk's requests in reverse order (``{"args": ...}`` as result);
    closes the connection after ``close_after`` requests (never answering that one)."""

    def __init__(self, path: Path, close_after: int | None = None, ignore: str | None = None) -> None:
        self.path = path
        self.close_after = close_after
        self.ignore = ignore  # requests of this tool are never answered
        self.hold = False  # while set, answers wait for ``release``
        self.held: list[str] = []
        self.conn: socket.socket | None = None
        self.requests = 0
        self.malformed = 0
        self.reading = threading.Event()  # cleared: the fake stops reading (a script's writes then block)
        self.reading.set()
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        self.conn = conn
        unread = b""
        with conn:
            while True:
                self.reading.wait()
                data = conn.recv(1 << 16)
                if not data:
                    return
                *lines, unread = (unread + data).split(b"\n")
                replies = []
                for line in lines:
                    self.requests += 1
                    if self.close_after is not None and self.requests >= self.close_after:
                        return
                    try:
                        request = json.loads(line)
                    except ValueError:  # a line broken by an interrupted write: the broker answers it without id
                        self.malformed += 1
                        continue
                    if request.get("tool") != self.ignore:
                        replies.append(json.dumps({"id": request["id"], "ok": True, "result": request.get("args")}))
                if self.hold:
                    self.held += replies
                    continue
                try:
                    conn.sendall("".join(r + "\n" for r in reversed(replies)).encode())
                except OSError:  # the test is over and closed the client while a (big) answer was going out
                    return

    def release(self) -> None:
        """Send the answers held while ``hold`` was set."""
        assert self.conn is not None
        held, self.held = self.held, []
        self.conn.sendall("".join(r + "\n" for r in held).encode())

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeBroker]:
    broker = FakeBroker(tmp_path / "tools.sock")
    yield broker
    broker.close()


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    """Clients to close after the test (the runtime's live as long as their process)."""
    made: list[Client] = []
    yield made
    for client in made:
        if "live" in client._made:
            client._made["live"].sock.close()


def readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ptc-broker-reader"]


def test_one_reader_thread_reads_for_every_caller(fake: FakeBroker, clients: list[Client]) -> None:
    """Only the reader thread reads the socket (a caller that reads can be cut short by a signal handler's
    exception mid-read, issue 24 item 3): one per connection, however many calls."""
    before = len(readers())
    client = Client(str(fake.path))
    clients.append(client)
    assert [client.request({"tool": "e", "args": {"i": i}}) for i in range(50)] == [{"i": i} for i in range(50)]
    assert len(readers()) == before + 1


def test_awaited_calls_of_one_turn_go_out_in_one_write(
    fake: FakeBroker, clients: list[Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = 0
    sendall = socket.socket.sendall

    def counted(self: socket.socket, data: Any, *args: Any) -> None:
        nonlocal writes
        writes += threading.current_thread() is not fake.thread  # the client's writes, not the fake's
        sendall(self, data, *args)

    monkeypatch.setattr(socket.socket, "sendall", counted)
    client = Client(str(fake.path))
    clients.append(client)

    async def fan_out() -> list[Any]:
        return await asyncio.gather(*(client.arequest({"tool": "e", "args": {"i": i}}) for i in range(300)))

    assert asyncio.run(fan_out()) == [{"i": i} for i in range(300)]
    assert writes == 1  # before: one per call


def test_threads_and_loops_get_their_own_replies(fake: FakeBroker, clients: list[Client]) -> None:
    client = Client(str(fake.path))
    clients.append(client)
    results: dict[str, list[Any]] = {}

    def blocking(name: str) -> None:
        results[name] = [client.request({"tool": "e", "args": {"who": name, "i": i}}) for i in range(200)]

    def awaiting(name: str) -> None:
        async def calls() -> list[Any]:
            out = []
            for i in range(20):
                out += await asyncio.gather(*(client.arequest({"tool": "e", "args": {"who": name, "i": i * 10 + j}})
                                              for j in range(10)))  # fmt: skip
            return out

        results[name] = asyncio.run(calls())

    threads = [threading.Thread(target=blocking, args=(f"t{n}",)) for n in range(4)]
    threads += [threading.Thread(target=awaiting, args=(f"a{n}",)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert results == {name: [{"who": name, "i": i} for i in range(200)] for name in results} and len(results) == 7


def test_a_lost_broker_fails_every_waiting_call(tmp_path: Path, clients: list[Client]) -> None:
    broker = FakeBroker(tmp_path / "tools.sock", close_after=5)
    client = Client(str(broker.path))
    clients.append(client)
    assert client.request({"tool": "e", "args": 1}) == 1
    errors: list[ToolError] = []

    def blocking() -> None:
        try:
            client.request({"tool": "e", "args": 2})
        except ToolError as exc:
            errors.append(exc)

    async def awaiting() -> list[Any]:
        return await asyncio.gather(*(client.arequest({"tool": "e", "args": i}) for i in range(6)),
                                    return_exceptions=True)  # fmt: skip

    thread = threading.Thread(target=blocking)
    thread.start()
    outcomes = asyncio.run(asyncio.wait_for(awaiting(), 10))
    thread.join(10)
    broker.close()
    lost = [o for o in [*outcomes, *errors] if isinstance(o, ToolError)]
    assert lost and all(e.type == "broker_unavailable" for e in lost)
    with pytest.raises(ToolError, match="broker_unavailable"):
        client.request({"tool": "e", "args": 3})


def test_a_call_with_a_timeout_is_never_handed_the_reading(tmp_path: Path, clients: list[Client]) -> None:
    """The runtime's report (``timeout=2.0``) must give up in time even when a blocking call that was reading hands
    the reading over while the report waits: it never becomes the reader, so no read blocks it past its timeout."""
    broker = FakeBroker(tmp_path / "tools.sock", ignore="silent")
    client = Client(str(broker.path))
    clients.append(client)
    outcome: list[str] = []
    release = threading.Event()

    def slow_reader() -> None:  # the reader while the report waits: its reply comes once the report was sent
        outcome.append(str(client.request({"tool": "hold", "args": "a"})))

    def report() -> None:
        try:
            client.request({"tool": "silent", "args": None}, timeout=0.5)
        except ToolError as exc:
            outcome.append(exc.type)
        release.set()

    broker.hold = True
    reader = threading.Thread(target=slow_reader)
    reader.start()
    while broker.requests < 1:
        time.sleep(0.01)
    reporter = threading.Thread(target=report)
    reporter.start()
    while broker.requests < 2:
        time.sleep(0.01)
    broker.hold = False  # answers the held call now: its caller hands the reading over, the report still waits
    broker.release()
    assert release.wait(5)
    reader.join(5)
    reporter.join(5)
    broker.close()
    assert sorted(outcome) == ["a", "timeout"]


class Interrupted(Exception):
    """What the tests' signal handlers raise (as a ``signal.alarm`` timeout decorator does)."""


def raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


@pytest.fixture
def alarm() -> Iterator[None]:
    """SIGALRM raises Interrupted for the test; put back after it."""
    previous = signal.signal(signal.SIGALRM, raise_interrupted)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def held_call_abandoned_then_answered(broker: FakeBroker, client: Client, interrupt: Any) -> None:
    """A call whose reply the broker holds is cut short by ``interrupt`` (raising Interrupted or
    KeyboardInterrupt); a later call gets its own value, then the late reply comes and is dropped."""
    broker.hold = True
    with pytest.raises((Interrupted, KeyboardInterrupt)):
        interrupt()
    broker.hold = False
    assert client.request({"tool": "e", "args": "second"}, timeout=5) == "second"  # before: timeout
    broker.release()  # the abandoned call's late reply
    assert client.request({"tool": "e", "args": "third"}, timeout=5) == "third"
    assert not client._pending


def test_a_signal_handlers_exception_during_a_call_leaves_the_client_usable(
    fake: FakeBroker, clients: list[Client], alarm: None
) -> None:
    broker = fake
    client = Client(str(broker.path))
    clients.append(client)
    assert client.request({"tool": "e", "args": "first"}) == "first"

    def interrupt() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        client.request({"tool": "e", "args": "abandoned"})

    held_call_abandoned_then_answered(broker, client, interrupt)
    assert client.request({"tool": "e", "args": "blocking"}) == "blocking"


@pytest.fixture
def sigint() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt for the test, whatever the test run inherited (a shell's background job
    starts with SIGINT ignored, and Python then installs no handler: the signal would be dropped and the call
    wait for ever); put back after it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_keyboard_interrupt_during_a_call_leaves_the_client_usable(
    fake: FakeBroker, clients: list[Client], sigint: None
) -> None:
    broker = fake
    client = Client(str(broker.path))
    clients.append(client)
    main = threading.main_thread().ident
    assert main is not None and threading.current_thread().ident == main

    def interrupt() -> None:
        threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT)).start()
        client.request({"tool": "e", "args": "abandoned"})

    held_call_abandoned_then_answered(broker, client, interrupt)


def test_a_cancelled_awaited_call_leaves_the_client_usable(fake: FakeBroker, clients: list[Client]) -> None:
    broker = fake
    client = Client(str(broker.path))
    clients.append(client)

    async def script() -> list[Any]:
        broker.hold = True
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.arequest({"tool": "e", "args": "abandoned"}), 0.2)
        broker.hold = False
        second = await asyncio.wait_for(client.arequest({"tool": "e", "args": "second"}), 5)
        broker.release()
        third = await asyncio.wait_for(client.arequest({"tool": "e", "args": "third"}), 5)
        return [second, third, client.request({"tool": "e", "args": "blocking"}, timeout=5)]

    assert asyncio.run(script()) == ["second", "third", "blocking"]
    assert not client._pending


def test_a_thread_that_dies_mid_call_leaves_the_client_usable(fake: FakeBroker, clients: list[Client]) -> None:
    broker = fake
    client = Client(str(broker.path))
    clients.append(client)
    died: list[BaseException] = []

    def doomed() -> None:
        try:
            client.request({"tool": "e", "args": "abandoned"})
        except BaseException as exc:  # the exception injected below
            died.append(exc)

    broker.hold = True
    thread = threading.Thread(target=doomed)
    thread.start()
    while broker.requests < 1:
        time.sleep(0.01)
    assert thread.ident is not None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(Interrupted))
    broker.hold = False
    assert client.request({"tool": "e", "args": "second"}, timeout=5) == "second"  # before: timeout
    broker.release()  # the doomed thread wakes, dies of its exception; its reply is dropped
    thread.join(5)
    assert [type(exc) for exc in died] == [Interrupted]
    assert client.request({"tool": "e", "args": "third"}, timeout=5) == "third"
    assert not client._pending


def test_a_signal_handler_may_call_a_tool_while_a_call_waits(
    fake: FakeBroker, clients: list[Client], alarm: None
) -> None:
    client = Client(str(fake.path))
    clients.append(client)
    seen: list[Any] = []

    def handler(signum: int, frame: Any) -> None:
        seen.append(client.request({"tool": "e", "args": "from the handler"}, timeout=5))  # before: timeout

    signal.signal(signal.SIGALRM, handler)
    fake.hold = True
    signal.setitimer(signal.ITIMER_REAL, 0.2)

    def answer() -> None:
        fake.hold = False
        fake.release()

    releaser = threading.Timer(0.5, answer)
    releaser.start()
    assert client.request({"tool": "e", "args": "outer"}) == "outer"
    releaser.join()
    assert seen == ["from the handler"]


def test_a_write_cut_short_mid_line_leaves_the_client_usable(
    fake: FakeBroker, clients: list[Client], alarm: None
) -> None:
    """A request bigger than the socket's buffer, while the broker does not read, is cut short by a signal
    handler's exception: the writer thread still sends the line whole (before: the part sent was ended as a
    malformed line of its own), and the next call goes through."""
    broker = fake
    client = Client(str(broker.path))
    clients.append(client)
    assert client.request({"tool": "e", "args": "first"}) == "first"
    conn, main = broker.conn, threading.main_thread().ident
    assert conn is not None and main is not None and threading.current_thread().ident == main
    broker.reading.clear()
    handled = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        handled.set()
        raise Interrupted(signum)

    def cut_then_read() -> None:
        """Once the request's first bytes wait at the broker (the rest cannot fit: the write is under way and
        blocked), interrupt it; once the handler ran, the broker reads again (the line's end waits for that)."""
        queued = array.array("i", [0])
        while not queued[0]:
            time.sleep(0.01)
            fcntl.ioctl(conn, termios.FIONREAD, queued)
        signal.pthread_kill(main, signal.SIGALRM)
        handled.wait(10)
        broker.reading.set()

    signal.signal(signal.SIGALRM, handler)
    helper = threading.Thread(target=cut_then_read)
    helper.start()
    with pytest.raises(Interrupted):
        client.request({"tool": "e", "args": "x" * (16 << 20)})
    helper.join()
    assert client.request({"tool": "e", "args": "second"}, timeout=10) == "second"
    assert broker.malformed == 0
    assert not client._pending


def test_a_signal_handler_may_call_a_tool_while_a_call_is_being_written(
    fake: FakeBroker, clients: list[Client], alarm: None
) -> None:
    """Review of issue 24 item 3: a handler's call made while the interrupted call is still in ``sendall`` (the
    broker reads slowly) must not be written into the middle of that call's line. Today the re-entrant send lock
    lets the handler's line in mid-line: the broker sees one malformed line, answers neither call by id, the
    handler waits for ever and the outer ``sendall`` never resumes (the script is wedged until its timeout)."""
    client = Client(str(fake.path))
    clients.append(client)
    assert client.request({"tool": "e", "args": "first"}) == "first"
    seen: list[Any] = []

    def handler(signum: int, frame: Any) -> None:
        seen.append(client.request({"tool": "e", "args": "from the handler"}, timeout=5))

    signal.signal(signal.SIGALRM, handler)
    fake.reading.clear()  # the big line's sendall blocks once the socket's buffer is full
    signal.setitimer(signal.ITIMER_REAL, 0.3)  # the handler runs inside that sendall
    resume = threading.Timer(0.6, fake.reading.set)
    resume.start()
    try:
        big = client.request({"tool": "e", "args": "x" * (4 << 20)}, timeout=10)
    finally:
        resume.join()
    assert (len(big), seen, fake.malformed) == (4 << 20, ["from the handler"], 0)


def test_a_signal_handler_may_call_a_tool_while_the_connection_is_made(
    fake: FakeBroker, clients: list[Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of issue 24 item 3: a handler's call made during the first call's connect (same thread, past the
    re-entrant connect lock) must not leave two connections and two reader threads (before: it made its own, and
    the outer connect then made a second)."""
    client = Client(str(fake.path))
    clients.append(client)
    before = len(readers())
    seen: list[Any] = []
    main = threading.get_ident()
    connect = socket.socket.connect
    poked = False

    def poking_connect(self: socket.socket, address: Any) -> None:
        nonlocal poked
        if not poked:  # the handler runs right here, before the outer call's socket is connected
            poked = True
            signal.pthread_kill(main, signal.SIGUSR1)
        connect(self, address)

    def handler(signum: int, frame: Any) -> None:
        seen.append(client.request({"tool": "e", "args": "from the handler"}, timeout=5))

    monkeypatch.setattr(socket.socket, "connect", poking_connect)
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        assert client.request({"tool": "e", "args": "outer"}, timeout=5) == "outer"
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert seen == ["from the handler"]
    deadline = time.monotonic() + 5
    while len(readers()) > before + 1 and time.monotonic() < deadline:  # a discarded connection's reader ends
        time.sleep(0.01)
    assert len(readers()) == before + 1
