"""Attacks on the replicated mode (issue 17): a network peer that is not a replica, and a tenant pressing on the
resources the replicas share (the signed path's body read, the peers' connections)."""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from service import internal
from service.auth import BearerAuth, KeyRing, hash_token, parse_keys

SECRET = b"s" * 32


def refusal(reason: str) -> Response:
    return JSONResponse({"detail": reason}, status_code=401)


async def test_a_forged_signed_request_trickling_its_body_costs_linear_time() -> None:
    """Any network peer may send ``Ptc-Internal-Signature`` with a body in many small pieces (one ASGI message per
    TCP segment): the body read before the signature is checked must not copy the whole body at each piece (that
    was quadratic: a 19 MB body in 64-byte pieces, about 3 TB of copying on the event loop, pre-authentication)."""
    chunk, pieces = b"x" * 64, 300_000
    sent = 0

    async def receive() -> Message:
        nonlocal sent
        sent += 1
        if sent % 1000 == 0:
            await asyncio.sleep(0)
        return {"type": "http.request", "body": chunk, "more_body": sent < pieces}

    answers: list[Message] = []

    async def send(message: Message) -> None:
        answers.append(message)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("a forged request reached the app")

    verifier = internal.Verifier([SECRET])
    verifier.target = "t1.1"
    auth = BearerAuth(
        app, KeyRing(parse_keys(f"alice:{hash_token('a' * 40)}")), frozenset(), refusal, verifier, body_limit=64 << 20
    )
    headers = [(b"ptc-internal-signature", b"v1=" + b"0" * 64), (b"ptc-internal-target", b"t1.1")]
    scope: Scope = {"type": "http", "method": "POST", "path": "/execute", "raw_path": b"/execute", "headers": headers}
    # a liveness bound, not a measurement: linear, this is well under a second; quadratic, several minutes
    await asyncio.wait_for(auth(scope, receive, send), 60)
    assert sent == pieces
    assert answers[0]["status"] == 401
    assert verifier.counts == {"bad_signature": 1}
