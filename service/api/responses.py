"""Response bodies streamed in slices: job views (``view_response``) and retained output (``output_slices``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi.responses import Response, StreamingResponse

from service.output import OutputRange, StoredRange
from service.views.render import BATCH_BYTES, Body

WHOLE_BYTES = 64 * 1024  # a view of at most this is sent whole (a slice, at most BATCH_BYTES, is held the same way)

OUTPUT_SLICE_BYTES = 256 * 1024  # GET /jobs/{id}/output/{stream} reads and sends the range this much at a time


def view_response(body: Body, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A job view as ``application/json``: at most ``WHOLE_BYTES`` in one piece, else in slices of ``BATCH_BYTES``
    (with flow control, so a slow client holds no copy of the view): whole bytes with their length, or pieces as
    they are rendered; ``headers``: more headers (``Location``)."""
    if isinstance(body, bytes) and len(body) <= WHOLE_BYTES:  # one message: no task group of a streaming answer
        return Response(body, status_code=status_code, media_type="application/json", headers=headers)
    if isinstance(body, bytes):
        return StreamingResponse(
            _slices(body),
            status_code=status_code,
            media_type="application/json",
            headers={"content-length": str(len(body)), **(headers or {})},
        )
    return StreamingResponse(body, status_code=status_code, media_type="application/json", headers=headers)


async def _slices(body: bytes | memoryview) -> AsyncIterator[bytes]:
    view = memoryview(body)
    for start in range(0, len(body), BATCH_BYTES):
        yield bytes(view[start : start + BATCH_BYTES])


async def event_pieces(head: bytes, data: Body | memoryview) -> AsyncIterator[bytes]:
    """One server-sent event, ``head`` (its ``id:``, ``event:`` and ``data:`` up to the data) then ``data`` and
    the blank line, in pieces of at most ``BATCH_BYTES``: the server writes a piece whole and waits for the
    client between pieces, so a client that stops reading holds about one piece, not a copy of a whole view
    (``data``: the shared bytes of a stored view, a view of them, or pieces rendered as they are sent)."""
    if isinstance(data, bytes | memoryview):
        if len(head) + len(data) <= BATCH_BYTES:
            yield head + data + b"\r\n\r\n"
            return
        yield head
        async for piece in _slices(data):
            yield piece
    else:
        yield head
        async for part in data:
            async for piece in _slices(part):
                yield piece
    yield b"\r\n\r\n"


async def output_slices(retained: OutputRange) -> AsyncIterator[bytes]:
    """The bytes of ``retained``, ``OUTPUT_SLICE_BYTES`` at a time, each read in a thread when the previous one
    was sent (uvicorn's flow control: a client that does not read holds at most about one slice here)."""
    try:
        while retained.remaining > 0:
            if isinstance(retained, StoredRange):  # from the shared store, a statement per slice
                yield await retained.aread(OUTPUT_SLICE_BYTES)
            else:
                yield await asyncio.to_thread(retained.read, OUTPUT_SLICE_BYTES)
    finally:
        # in a thread (it waits for a read under way), not awaited: a cancelled response may not await here
        try:
            asyncio.get_running_loop().run_in_executor(None, retained.close)
        except RuntimeError:  # no running loop (finalized at shutdown): nothing can be reading any more
            retained.close()
