"""Verifying a completion callback (Standard Webhooks, as docs/webhooks.md's "Verifying by hand")."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Mapping, Sequence


def _key(secret: str) -> bytes:
    if secret.startswith("whsec_"):
        encoded = secret.removeprefix("whsec_")
        try:
            key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
        except binascii.Error as error:
            raise ValueError("a whsec_ secret is not base64") from error
    else:
        key = secret.encode()
    if not key:  # anyone can sign with an empty key (an unset variable read as "")
        raise ValueError("a callback secret is empty")
    return key


def verify_callback(
    body: bytes,
    headers: Mapping[str, str],
    secrets: str | Sequence[str],
    tolerance_s: float = 300,
    now: float | None = None,
) -> bool:
    """Whether ``body`` with these ``headers`` was signed with one of ``secrets`` (``whsec_``+base64, or plain text).

    ``headers`` may be in any case (``webhook-id``, ``webhook-timestamp``, ``webhook-signature``); a missing header,
    a timestamp not an integer or farther than ``tolerance_s`` seconds from ``now`` (default: the clock) is ``False``.
    Several secrets (a rotation: the older and the newer) verify if any one does. Raises ``ValueError`` for a
    ``whsec_`` secret that is not base64, or an empty secret (which anyone could sign with). It does not remember
    ids: to refuse a replay within ``tolerance_s``, keep the ``webhook-id`` values seen that long.
    """
    lower = {k.lower(): v for k, v in headers.items()}
    msg_id, timestamp, signature = (lower.get(k) for k in ("webhook-id", "webhook-timestamp", "webhook-signature"))
    if msg_id is None or timestamp is None or signature is None:
        return False
    if not (timestamp.isascii() and timestamp.isdigit() and len(timestamp) <= 20):
        return False  # no sign, space or "_" int() would take; no 400 digits a float subtraction overflows on
    if abs((time.time() if now is None else now) - int(timestamp)) > tolerance_s:
        return False
    signed = [s[3:].encode() for s in signature.split(" ") if s.startswith("v1,")]
    for secret in [secrets] if isinstance(secrets, str) else secrets:
        digest = hmac.new(_key(secret), f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
        expected = base64.b64encode(digest)
        if any(hmac.compare_digest(expected, s) for s in signed):
            return True
    return False
