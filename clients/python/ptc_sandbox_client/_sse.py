"""Server-Sent Events parsing (the WHATWG event-stream format): lines already split (CRLF, LF or CR)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .models import Event


@dataclass
class SSEParser:
    """Feed it lines without their end; it answers an :class:`Event` at each blank line ending an event.

    Comment lines (``: ping``) and events without data are skipped; ``data`` lines are joined with ``\\n`` and decoded
    as JSON (kept as text when they are not JSON). ``last_id`` is the last ``id:`` seen, for ``Last-Event-ID``.
    """

    last_id: str | None = None
    _event: str = ""
    _data: list[str] = field(default_factory=list)
    _id: str | None = None

    def feed(self, line: str) -> Event | None:
        """One line (any ``\\r`` or ``\\n`` at its end is dropped); the event it completes, if any."""
        line = line.rstrip("\r\n")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self._id = value
        return None

    def _dispatch(self) -> Event | None:
        event_id, self._id = self._id, None
        if event_id is not None:
            self.last_id = event_id
        if not self._data:
            self._event = ""
            return None
        text = "\n".join(self._data)
        try:
            data = json.loads(text)
        except ValueError:
            data = text
        event = Event(event=self._event or "message", id=event_id if event_id is not None else self.last_id, data=data)
        self._event, self._data = "", []
        return event
