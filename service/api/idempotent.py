"""The routes' side of ``Idempotency-Key`` (``service.idempotency``): claiming a request's key, and marking a
replayed answer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from service.api import problems
from service.errors import InvalidField, OwnerElsewhere, PtcError
from service.idempotency import (
    FINGERPRINT_QUERY,
    KEY_HEADER,
    REPLAYED_HEADER,
    Claim,
    IdempotencyKeys,
    Kind,
    canonical_digest,
    fingerprint,
    parse_key,
)
from service.store import IdempotencyRecord

KEY_DESCRIPTION = (
    "Send the same key when retrying: at most one job (or session) is created per key and API key; a repeat "
    "answers the first one's current view with `Idempotent-Replayed: true`. 1 to 255 printable ASCII characters."
)


async def claim_key(
    request: Request, keys: IdempotencyKeys, owner: str, header: str | None, kind: Kind, body: BaseModel
) -> Claim | IdempotencyRecord | None:
    """Claim the request's ``Idempotency-Key`` (``IdempotencyKeys.claim``); None when it has none.

    The body's digest was taken where it was parsed (``bodies.parse_body``); a body parsed elsewhere is digested
    from its model here, off the event loop.

    Raises:
        InvalidField: the header's value is not a key (``parse_key``), or the header is sent more than once
            (which one is the key would depend on the proxies between the client and the service).
        IdempotencyKeyReused / IdempotencyKeyInFlight: see ``IdempotencyKeys.claim``.
    """
    if len(request.headers.getlist(KEY_HEADER)) > 1:
        raise InvalidField("must be sent once", ("header", KEY_HEADER))
    key = parse_key(header)
    if key is None:
        return None
    digest: bytes | None = getattr(request.state, "body_digest", None)
    if digest is None:
        digest = await asyncio.to_thread(canonical_digest, body.model_dump(mode="json"))
    path = request.url.path
    wanted = FINGERPRINT_QUERY.get(path, ())
    query = [(name, value) for name, value in request.query_params.multi_items() if name in wanted]
    return await keys.claim(owner, key, fingerprint(f"{request.method} {path}", query, digest), kind)


async def replay(request: Request, answer: Callable[[], Awaitable[Response]]) -> Response:
    """The answer of a repeated request (its ``answer``, or the problem it raises) with ``Idempotent-Replayed``.

    Raises:
        OwnerElsewhere: the job or session runs on another replica: the request is relayed there (``api.forward``),
            whose own claim of the key finds it bound and replays it.
    """
    try:
        response = await answer()
    except OwnerElsewhere:
        raise
    except PtcError as exc:
        response = await problems.handle(request, exc)
    response.headers[REPLAYED_HEADER] = "true"
    return response


__all__ = ["KEY_DESCRIPTION", "KEY_HEADER", "claim_key", "replay"]
