"""``ptc_runtime.ring`` without an engine: the server's reader against any header, and a writer in a forked
process through rings small enough (4 KiB) that every write wraps around and waits for the reader."""

from __future__ import annotations

import os
import random
import select
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sandbox_image"))  # the runtime, as in the image

from ptc_runtime.ring import ASLEEP, HEAD, TAIL, WAITING, Ring, RingReader, install, make_streams


def test_the_reader_stays_in_bounds_whatever_the_header_says() -> None:
    rng = random.Random(7)
    ring = Ring(4096)
    try:
        for _ in range(2000):
            reader = RingReader(ring)
            reader.tail = rng.choice((0, 5, 4096, 2**63, 2**64 - 1))
            for word in (HEAD, TAIL, ASLEEP, WAITING):
                ring.header[word] = rng.choice((0, 1, 4095, 4096, 4097, 2**63, 2**64 - 1, rng.getrandbits(64)))
            head = reader.head()
            if head is None:
                assert reader.ended and reader.head() is None
                continue
            assert 0 <= head - reader.tail <= ring.size
            took = reader.tail != head
            while reader.tail != head:
                data = reader.take(head, 1000)
                assert 0 < len(data) <= 1000
            assert not took or ring.header[TAIL] == reader.tail  # published
    finally:
        ring.close()


def test_a_forked_writer_wraps_and_waits_and_every_byte_arrives_in_order() -> None:
    rings = [Ring(4096), Ring(4096)]
    nudge_r, nudge_w = os.pipe()
    ack_r, ack_w = os.pipe()
    out_r, out_w = os.pipe()
    rng = random.Random(3)
    chunks = [bytes([65 + i % 26]) * rng.choice((1, 7, 4095, 4096, 4097, 10_000)) for i in range(300)]
    expected = b"".join(chunks) + b"".join(b"%d\n" % i for i in range(5000))
    pid = os.fork()
    if pid == 0:  # the script's process
        try:
            os.close(nudge_r)
            os.close(ack_w)
            os.dup2(out_w, 1)
            os.dup2(out_w, 2)
            install(make_streams(rings, nudge_w, ack_r))
            for chunk in chunks:
                sys.stdout.buffer.write(chunk)
            for i in range(5000):
                print(i)
        finally:
            os._exit(0)
    os.close(nudge_w)
    os.close(ack_r)
    os.close(out_w)
    reader = RingReader(rings[0])
    got = bytearray()
    ended = False
    try:
        while not ended:
            ready, _, _ = select.select([nudge_r], [], [], 0.01)
            if ready:
                os.read(nudge_r, 4096)
            ended = os.waitpid(pid, os.WNOHANG)[0] == pid
            head = reader.head()
            assert head is not None
            while reader.tail != head:
                got += reader.take(head, 1500)
            if reader.waited():
                os.write(ack_w, b"\0")
        assert bytes(got) == expected
        assert os.read(out_r, 100) == b""  # nothing went to the pipe
    finally:
        if not ended:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for ring in rings:
            ring.close()
        for fd in (nudge_r, ack_w, out_r):
            os.close(fd)


def _serve(pid: int, rings: list[Ring], nudge_r: int, ack_w: int, alarm: bool) -> list[bytes]:
    """Act as the resident interpreter for the forked writer ``pid`` until it exits: take both rings at every
    nudge or 10 ms, ack a waiting writer (one byte per waiting ring, as the server does). ``alarm``: first wait
    until the writer waits for room in the stdout ring, send it SIGALRM there, and serve 0.2 s later. Returns
    what each ring held; the writer reports its end through them."""
    import time

    readers = [RingReader(ring) for ring in rings]
    got = [bytearray() for _ in rings]
    serve_at = None if alarm else 0.0
    deadline = time.monotonic() + 30
    while True:
        if time.monotonic() > deadline:  # the writer hangs (an ack lost between two waiting threads)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the writer did not finish in 30 s")
        ready, _, _ = select.select([nudge_r], [], [], 0.01)
        if ready:
            os.read(nudge_r, 4096)
        if serve_at is None:
            if rings[0].header[WAITING]:  # blocked on a full stdout ring (nothing is taken until then)
                os.kill(pid, signal.SIGALRM)
                serve_at = time.monotonic() + 0.2
            continue
        if time.monotonic() < serve_at:
            continue
        ended = os.waitpid(pid, os.WNOHANG)[0] == pid
        for index, reader in enumerate(readers):
            head = reader.head()
            assert head is not None
            while reader.tail != head:
                got[index] += reader.take(head, 1500)
        for reader in readers:
            if reader.waited():
                try:
                    os.write(ack_w, b"\0")
                except BrokenPipeError:  # the writer has exited
                    pass
        if ended:
            return [bytes(data) for data in got]


def _run_writer(body: object, alarm: bool = False) -> tuple[int, list[bytes]]:
    """Fork a process that installs 4 KiB rings and calls ``body()``; exit 0 if it returned, 1 if it raised."""
    rings = [Ring(4096), Ring(4096)]
    nudge_r, nudge_w = os.pipe()
    ack_r, ack_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(nudge_r)
            os.close(ack_w)
            os.dup2(out_w, 1)
            os.dup2(out_w, 2)
            install(make_streams(rings, nudge_w, ack_r))
            body()  # type: ignore[operator]
            sys.stdout.flush()
            sys.stderr.flush()
            code = 0
        finally:
            os._exit(code)
    os.close(nudge_w)
    os.close(ack_r)
    os.close(out_w)
    try:
        got = _serve(pid, rings, nudge_r, ack_w, alarm)
    finally:
        for ring in rings:
            ring.close()
        for fd in (nudge_r, ack_w, out_r):
            os.close(fd)
    # _serve returned after waitpid collected it: its status is gone; the body reports through the rings
    return (0 if got[1].endswith(b"BODY DONE\n") else 1), got


def test_a_signal_handler_may_write_stderr_while_stdout_waits_for_room() -> None:
    # python3 script.py | slow_reader: a handler's sys.stderr.write while a sys.stdout write is blocked works;
    # the rings shared one lock and busy flag: "RuntimeError: reentrant call inside a ring writer" (exit 1)
    def body() -> None:
        signal.signal(signal.SIGALRM, lambda *_: sys.stderr.write("handler\n"))
        sys.stdout.buffer.write(b"x" * 20_000)  # 5 rings' worth: waits; SIGALRM comes while it does
        sys.stderr.write("BODY DONE\n")

    code, (out, err) = _run_writer(body, alarm=True)
    assert code == 0, err[-300:]
    assert out == b"x" * 20_000
    assert err == b"handler\nBODY DONE\n"


def test_two_threads_waiting_for_both_rings_at_once_both_finish() -> None:
    # one ack pipe for both rings: a thread's read may take the other's ack; neither may then wait forever
    def body() -> None:
        import threading

        def write(stream: object, n: int) -> None:
            for _ in range(n):
                stream.buffer.write(b"y" * 3000)  # type: ignore[attr-defined]

        threads = [threading.Thread(target=write, args=(s, 200)) for s in (sys.stdout, sys.stderr)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        sys.stderr.write("BODY DONE\n")

    code, (out, err) = _run_writer(body)
    assert code == 0
    assert out == b"y" * 600_000
    assert err == b"y" * 600_000 + b"BODY DONE\n"
