"""The Python client (clients/python, ``ptc_sandbox_client``) against scripted answers (``httpx.MockTransport``):
SSE parsing and resuming, problems as typed exceptions, safe retries, schemas from signatures, the callback verifier
against the service's own signer, and the distribution importing nothing of the server."""

from __future__ import annotations

import ast
import asyncio
import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from ptc_sandbox_client import (
    AsyncClient,
    Client,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    ProblemError,
    RateLimitedError,
    SSEParser,
    schema_of,
    verify_callback,
)

from service.callbacks import CallbackSecret, message_id, signed_headers

PACKAGE = Path(__file__).resolve().parents[2] / "clients" / "python" / "ptc_sandbox_client"
P = "tag:ptc-sandbox.dev,2026:problems/"


def test_the_client_imports_only_httpx_pydantic_and_the_standard_library() -> None:
    import sys

    found: set[str] = set()
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    assert found - set(sys.stdlib_module_names) == {"httpx", "pydantic"}


def test_sse_lines_in_crlf_with_comments_ids_and_multi_line_data() -> None:
    raw = 'id: 1\r\nevent: status\r\ndata: {"status": "running"}\r\n\r\n: ping\r\n\r\nid: 2\r\nevent: stdout\r\n'
    raw += 'data: {"offset": 0,\r\ndata:  "text": "hi"}\r\n\r\n'
    parser = SSEParser()
    events = [e for line in raw.split("\r\n") if (e := parser.feed(line + "\r")) is not None]
    assert [(e.event, e.id, e.data) for e in events] == [
        ("status", "1", {"status": "running"}),
        ("stdout", "2", {"offset": 0, "text": "hi"}),
    ]
    assert parser.last_id == "2"


class _Dropping(httpx.SyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks
        raise httpx.RemoteProtocolError("peer closed connection")


def test_a_dropped_stream_resumes_with_the_last_event_id() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("last-event-id"))
        if len(seen) == 1:  # two events, then half of a third, then the connection drops
            chunks = [
                b"id: a\r\nevent: status\r\ndata: {}\r\n\r\n",
                b'id: b\r\nevent: stdout\r\ndata: {"text": "x"}\r\n\r\n',
                b"id: c\r\nevent: std",
            ]
            return httpx.Response(200, stream=_Dropping(chunks))
        end = {"job_id": "job_1", "status": "succeeded", "stdout": "x"}
        return httpx.Response(200, content=f"id: d\r\nevent: end\r\ndata: {json.dumps(end)}\r\n\r\n".encode())

    client = Client("http://t", "tok", http=httpx.Client(base_url="http://t", transport=httpx.MockTransport(handler)))
    client.max_retry_wait_s = 0
    events = list(client.stream("job_1"))
    assert [(e.event, e.id) for e in events] == [("status", "a"), ("stdout", "b"), ("end", "d")]
    assert seen == [None, "b"]
    assert events[-1].view is not None and events[-1].view.stdout == "x"


def _problem(status: int, name: str, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    body = {"type": P + name, "title": name, "status": status, "detail": f"detail of {name}", **extra}
    return httpx.Response(status, json=body, headers={"content-type": "application/problem+json", **(headers or {})})


@pytest.mark.parametrize(
    ("name", "status", "cls"),
    [
        ("job-not-found", 404, NotFoundError),
        ("invalid-request", 422, InvalidRequestError),
        ("call-not-pending", 409, ConflictError),
        ("quota-exceeded", 429, RateLimitedError),
        ("some-future-problem", 400, ProblemError),
    ],
)
def test_problems_are_raised_as_typed_exceptions_with_their_members(
    name: str, status: int, cls: type[ProblemError]
) -> None:
    transport = httpx.MockTransport(lambda r: _problem(status, name, {"retry-after": "7"}, reason="why"))
    client = Client("http://t", http=httpx.Client(base_url="http://t", transport=transport), max_retries=0)
    with pytest.raises(cls) as raised:
        client.get("job_000000000000000000000000")
    error = raised.value
    assert type(error) is cls
    assert (error.name, error.status, error.detail, error.extra) == (
        name,
        status,
        f"detail of {name}",
        {"reason": "why"},
    )
    assert error.type == P + name and error.retry_after == 7


def test_retries_only_where_safe_honouring_retry_after() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path} {request.headers.get('idempotency-key')}")
        if len(calls) % 2:
            return _problem(429, "queue-full", {"retry-after": "0"}, reason="queue_full")
        return httpx.Response(200, json={"job_id": "job_1", "status": "succeeded"})

    client = Client("http://t", http=httpx.Client(base_url="http://t", transport=httpx.MockTransport(handler)))
    assert client.get("job_1").status == "succeeded"  # a GET: retried
    assert client.execute("print(1)", idempotency_key="k1").status == "succeeded"  # a keyed POST: retried
    with pytest.raises(RateLimitedError) as raised:  # an unkeyed POST: not retried (it might run twice)
        client.execute("print(1)")
    assert raised.value.extra == {"reason": "queue_full"} and raised.value.retry_after == 0
    assert calls == [
        "GET /jobs/job_1 None",
        "GET /jobs/job_1 None",
        "POST /execute k1",
        "POST /execute k1",
        "POST /execute None",
    ]


def test_retries_are_bounded() -> None:
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return _problem(503, "engine-unavailable", {"retry-after": "0"})

    client = Client("http://t", http=httpx.Client(base_url="http://t", transport=httpx.MockTransport(handler)))
    with pytest.raises(ProblemError):
        client.get("job_1")
    assert len(calls) == 3


def test_schemas_from_signatures() -> None:
    def lookup(city: str, days: int = 3, unit: Literal["c", "f"] = "c", tags: list[str] | None = None) -> Any:
        """Weather."""

    assert schema_of(lookup) == {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"enum": ["c", "f"]},
            "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        },
        "required": ["city"],
    }


def test_the_verifier_accepts_what_the_service_signs_and_nothing_else() -> None:
    newer = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    older = "plain-older-secret"
    body = b'{"job_id": "job_1", "status": "succeeded"}'
    now = int(time.time())
    keys = (CallbackSecret.parse(newer), CallbackSecret.parse(older))
    headers = signed_headers(keys, message_id("job_1"), now, body)
    assert verify_callback(body, headers, newer)
    assert verify_callback(body, {k.upper(): v for k, v in headers.items()}, [older])
    assert verify_callback(body, headers, ["whsec_" + base64.b64encode(b"x" * 32).decode(), older])
    assert not verify_callback(body + b" ", headers, newer)
    assert not verify_callback(body, headers, "another")
    assert not verify_callback(body, headers, newer, now=now + 301)
    assert not verify_callback(body, {k: v for k, v in headers.items() if k != "webhook-id"}, newer)
    with pytest.raises(ValueError):
        verify_callback(body, headers, "whsec_not base64!")


async def test_the_async_client_answers_client_executed_calls_with_coroutines() -> None:
    state: dict[str, Any] = {"answers": []}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/execute":
            manifest = json.loads(request.content)["tools"]
            assert manifest[0]["endpoint"] == {"kind": "client"} and manifest[0]["parameters"]["required"] == ["x"]
            pending = [
                {"call_id": f"call_{i}", "tool": "double", "args": {"x": i}, "awaiting": "client"} for i in (1, 2)
            ]
            return httpx.Response(202, json={"job_id": "job_1", "status": "waiting", "pending_calls": pending})
        if request.url.path.startswith("/jobs/job_1/calls/"):
            state["answers"].append((request.url.path.rsplit("/", 1)[1], json.loads(request.content)))
            return httpx.Response(200, json={"job_id": "job_1", "status": "running", "pending_calls": []})
        assert request.url.path == "/jobs/job_1/wait"
        return httpx.Response(200, json={"job_id": "job_1", "status": "succeeded", "stdout": "2 4\n"})

    async def double(x: int) -> int:
        """Twice x."""
        if x == 2:
            raise KeyError("no")
        return 2 * x

    http = httpx.AsyncClient(base_url="http://t", transport=httpx.MockTransport(handler))
    async with AsyncClient("http://t", http=http) as client:
        view = await client.run_with_tools("...", {"double": double})
    assert view.status == "succeeded"
    assert state["answers"] == [
        ("call_1", {"result": 2}),
        ("call_2", {"error": {"type": "KeyError", "message": "'no'"}}),
    ]


async def test_the_async_helper_runs_at_most_max_concurrency_tools_at_once() -> None:
    """A script that gathers 40 calls gets them answered, at most 4 tool runs at a time in this process."""
    pending = [{"call_id": f"call_{i}", "tool": "slow", "args": {"x": i}, "awaiting": "client"} for i in range(40)]
    answered: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/execute":
            return httpx.Response(202, json={"job_id": "job_1", "status": "waiting", "pending_calls": pending})
        if request.url.path.startswith("/jobs/job_1/calls/"):
            answered.append(request.url.path.rsplit("/", 1)[1])
            return httpx.Response(200, json={"job_id": "job_1", "status": "running", "pending_calls": []})
        return httpx.Response(200, json={"job_id": "job_1", "status": "succeeded"})

    running, most = 0, 0

    async def slow(x: int) -> int:
        """x, after a pause."""
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.005)
        running -= 1
        return x

    http = httpx.AsyncClient(base_url="http://t", transport=httpx.MockTransport(handler))
    async with AsyncClient("http://t", http=http) as client:
        view = await client.run_with_tools("...", {"slow": slow}, max_concurrency=4)
    assert view.status == "succeeded" and len(answered) == 40
    assert most == 4


def test_a_keyed_post_is_retried_while_its_first_request_is_in_flight() -> None:
    answers = [_problem(409, "idempotency-key-in-flight", {"retry-after": "0"})]

    def handler(request: httpx.Request) -> httpx.Response:
        return answers.pop() if answers else httpx.Response(200, json={"job_id": "job_1", "status": "succeeded"})

    client = Client("http://t", http=httpx.Client(base_url="http://t", transport=httpx.MockTransport(handler)))
    assert client.execute("print(1)", idempotency_key="k").status == "succeeded"
    answers.append(_problem(409, "call-not-pending"))
    with pytest.raises(ConflictError):  # another 409 is not retried
        client.execute("print(1)", idempotency_key="k")


def test_the_tools_helper_polls_a_job_waiting_on_something_else_and_passes_over_a_call_no_longer_pending() -> None:
    requests: list[str] = []
    approval = {"call_id": "call_a", "tool": "deploy", "args": {}, "awaiting": "approval"}
    mine = {"call_id": "call_m", "tool": "mine", "args": {}, "awaiting": "client"}

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(f"{request.method} {request.url.path}")
        if request.url.path == "/execute":
            return httpx.Response(202, json={"job_id": "job_1", "status": "waiting", "pending_calls": [approval]})
        if request.url.path == "/jobs/job_1/calls/call_m":
            return _problem(409, "call-not-pending")
        if len(requests) == 2:  # the approval was given; now a call of its own waits
            return httpx.Response(200, json={"job_id": "job_1", "status": "waiting", "pending_calls": [mine]})
        return httpx.Response(200, json={"job_id": "job_1", "status": "failed"})

    client = Client("http://t", http=httpx.Client(base_url="http://t", transport=httpx.MockTransport(handler)))
    view = client.run_with_tools("...", {"mine": lambda: 1}, poll_s=0)
    assert view.status == "failed"
    assert requests == ["POST /execute", "GET /jobs/job_1", "POST /jobs/job_1/calls/call_m", "GET /jobs/job_1"]


def test_the_verifier_refuses_forged_timestamps_and_empty_secrets() -> None:
    body = b'{"job_id": "job_1"}'
    now = int(time.time())
    signed = signed_headers((CallbackSecret.parse("s3cret"),), message_id("job_1"), now, body)
    assert verify_callback(body, signed, "s3cret", now=now)
    for forged in ("9" * 400, "-" + "9" * 400, f" {now}", f"+{now}", f"{now:_}", "１２３"):
        headers = {**signed, "webhook-timestamp": forged}
        assert verify_callback(body, headers, "s3cret") is False  # before: OverflowError (400 digits vs the clock)
    # An empty secret (an unset variable read as ""): anyone can sign with the empty key. Before: accepted.
    mac = hmac.new(b"", f"{signed['webhook-id']}.{now}.".encode() + body, hashlib.sha256).digest()
    headers = {**signed, "webhook-signature": "v1," + base64.b64encode(mac).decode()}
    for empty in ("", "whsec_", ["", "s3cret"]):
        with pytest.raises(ValueError, match="empty"):
            verify_callback(body, headers, empty, now=now)


@pytest.mark.parametrize("status", ["500", None, 1e400, True, 99, {"a": 1}])
def test_a_problem_with_odd_members_is_still_a_problem(status: Any) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = {"type": ["not", "text"], "title": {"x": 1}, "status": status, "detail": None, "extra": "kept"}
        text = json.dumps(body).replace("Infinity", "1e400")
        return httpx.Response(502, content=text, headers={"content-type": "application/problem+json"})

    client = Client("http://t", http=httpx.Client(base_url="http://t", transport=httpx.MockTransport(handler)))
    with pytest.raises(ProblemError) as raised:  # before: ValueError, TypeError or OverflowError from int()
        client.stop("job_1")
    assert raised.value.status == 502 and raised.value.extra == {"extra": "kept"}


def test_a_redirect_is_an_error_and_is_not_followed() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.host} {request.headers.get('authorization')}")
        return httpx.Response(307, headers={"location": "http://elsewhere.example/jobs/job_1"}, text="moved")

    client = Client("http://t", "tok", http=httpx.Client(base_url="http://t", transport=httpx.MockTransport(handler)))
    with pytest.raises(ProblemError) as raised:  # before: a JSONDecodeError from the redirect's body
        client.get("job_1")
    assert raised.value.status == 307
    assert all(host.startswith("t ") for host in seen)


class _Stalled(httpx.SyncByteStream):
    """An event stream that sends one event and then nothing: the transport's read timeout ends it."""

    def __iter__(self) -> Iterator[bytes]:
        yield b"id: a\r\nevent: status\r\ndata: {}\r\n\r\n"
        raise httpx.ReadTimeout("no byte within the read timeout")


def test_a_silent_event_stream_times_out_and_is_resumed_not_waited_on_forever() -> None:
    timeouts: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"]["read"])
        if len(timeouts) == 1:
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Stalled())
        return httpx.Response(200, content=b'id: b\r\nevent: end\r\ndata: {"status": "succeeded"}\r\n\r\n')

    client = Client("http://t", http=httpx.Client(base_url="http://t", transport=httpx.MockTransport(handler)))
    client._delay = lambda attempt, response: 0.0  # type: ignore[method-assign]
    assert [e.event for e in client.stream("job_1")] == ["status", "end"]
    assert timeouts[0] is not None and timeouts[0] >= 30  # before: None, a stalled server held the caller for ever


def test_an_answer_to_a_call_named_wait_is_not_retried() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        raise httpx.ReadError("the answer was lost after the request went out")

    client = Client("http://t", http=httpx.Client(base_url="http://t", transport=httpx.MockTransport(handler)))
    client._delay = lambda attempt, response: 0.0  # type: ignore[method-assign]
    with pytest.raises(httpx.ReadError):
        client.answer_call("job_1", "wait", result=1)
    assert calls == ["/jobs/job_1/calls/wait"]  # before: sent 3 times (its path ends in /wait)
    with pytest.raises(httpx.ReadError):
        client.wait("job_1", timeout_s=1)
    assert len(calls) == 4  # a wait only reads: retried


def test_ids_from_elsewhere_stay_one_path_segment() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.raw_path.decode()}")
        return httpx.Response(200, json={"job_id": "job_1", "status": "succeeded", "session_id": "s"})

    client = Client("http://t", http=httpx.Client(base_url="http://t", transport=httpx.MockTransport(handler)))
    client.stop("../execute?x=")  # before: POST /execute?x=/stop
    client.answer_call("job_1", "../../sessions", result=1)  # before: POST /sessions
    client.get("a/b#c")
    client.job_file("job_1", "outputs/../../../execute")  # before: GET /execute
    assert seen == [
        "POST /jobs/..%2Fexecute%3Fx%3D/stop",
        "POST /jobs/job_1/calls/..%2F..%2Fsessions",
        "GET /jobs/a%2Fb%23c",
        "GET /jobs/job_1/files/outputs/%2E%2E/%2E%2E/%2E%2E/execute",
    ]


class _Endless(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body of ``chunks`` chunks of 1 MiB (a broken or hostile server's endless answer); ``clock`` advances by
    ``step`` seconds a chunk."""

    def __init__(self, chunks: int, clock: list[float] | None = None, step: float = 0.0) -> None:
        self.chunks, self.clock, self.step, self.sent = chunks, clock, step, 0

    def _next(self) -> bytes:
        self.sent += 1
        if self.clock is not None:
            self.clock[0] += self.step
        return b"x" * (1 << 20)

    def __iter__(self) -> Iterator[bytes]:
        for _ in range(self.chunks):
            yield self._next()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.chunks):
            yield self._next()


def test_an_endless_answer_is_cut_at_the_size_cap() -> None:
    body = _Endless(64)  # stands for "endless": before, read whole (here 64 MiB; for ever, from a real server)
    transport = httpx.MockTransport(lambda r: httpx.Response(200, stream=body))
    client = Client("http://t", max_retries=0, http=httpx.Client(base_url="http://t", transport=transport))
    client.max_response_bytes = 4 << 20
    with pytest.raises(httpx.ReadError, match="exceeds"):
        client.get("job_1")
    assert body.sent <= 5


async def test_a_dripping_answer_is_cut_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("ptc_sandbox_client.client.time.monotonic", lambda: clock[0])
    body = _Endless(64, clock, step=59.0)  # each chunk within the read timeout, the whole never
    transport = httpx.MockTransport(lambda r: httpx.Response(200, stream=body))
    http = httpx.AsyncClient(base_url="http://t", transport=transport)
    async with AsyncClient("http://t", max_retries=0, timeout=60, http=http) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.get("job_1")
    assert body.sent <= 5  # 4 x 60 s


def test_an_event_without_end_is_cut_at_the_size_cap() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Endless(64))  # one line of "x", never ended (a hostile server)

    client = Client("http://t", http=httpx.Client(base_url="http://t", transport=httpx.MockTransport(handler)))
    client.max_response_bytes = 4 << 20
    with pytest.raises(httpx.DecodingError, match="exceeds"):  # before: the line was buffered whole, for ever
        list(client.stream("job_1"))


def test_an_event_cut_by_a_dropped_connection_is_not_glued_to_its_repeat() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.headers.get("last-event-id") is None:
            chunks = [
                b"id: a\r\nevent: status\r\ndata: {}\r\n\r\n",
                b'id: b\r\nevent: stdout\r\ndata: {"text": "x"}\r\n',
            ]
            return httpx.Response(200, stream=_Dropping(chunks))  # b's data line came, its blank line did not
        assert request.headers["last-event-id"] == "a"
        body = b'id: b\r\nevent: stdout\r\ndata: {"text": "x"}\r\n\r\nid: c\r\nevent: end\r\ndata: {}\r\n\r\n'
        return httpx.Response(200, content=body)

    client = Client("http://t", http=httpx.Client(base_url="http://t", transport=httpx.MockTransport(handler)))
    client._delay = lambda attempt, response: 0.0  # type: ignore[method-assign]
    events = list(client.stream("job_1"))
    assert [(e.event, e.data) for e in events] == [("status", {}), ("stdout", {"text": "x"}), ("end", {})]
    # before: b's data twice, joined by a newline: not JSON, kept as text


def test_lines_split_anywhere_between_pieces() -> None:
    raw = 'id: 1\r\nevent: status\r\ndata: {"status": "running"}\r\n\r\n: ping\r\r\nid: 2\ndata: "x"\n\n'
    for size in (1, 2, 3, 7):
        parser = SSEParser()
        events = [e for i in range(0, len(raw), size) for e in parser.feed_text(raw[i : i + size])]
        assert [(e.event, e.id, e.data) for e in events] == [
            ("status", "1", {"status": "running"}),
            ("message", "2", "x"),
        ]


def test_a_callers_own_http_client_gets_the_base_url_and_the_token() -> None:
    """``http=`` a client of the caller's own (its proxies, its certificates), with no base URL and no headers:
    each request still goes to ``base_url`` with the token."""
    seen: list[tuple[str, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.headers.get("authorization")))
        return httpx.Response(200, json={"job_id": "job_1", "status": "succeeded"})

    client = Client("http://svc:8080/", "tok", http=httpx.Client(transport=httpx.MockTransport(handler)))
    assert client.get("job_1").status == "succeeded"
    assert seen == [("http://svc:8080/jobs/job_1", "Bearer tok")]
