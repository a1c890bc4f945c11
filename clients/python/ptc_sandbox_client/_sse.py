"""Server-Sent Events parsing (the WHATWG event-stream format): lines (``feed``) or pieces of text split into lines
here (``feed_text``: CRLF, LF or CR), an event at most ``max_event_chars`` long."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .models import Event

_EOL = re.compile(r"\r\n|\r|\n")
MAX_EVENT_CHARS = 256 * 1024 * 1024  # an event (its lines) at most: a larger one is a broken or hostile server


@dataclass
class SSEParser:
    """Feed it lines without their end; it answers an :class:`Event` at each blank line ending an event.

    Comment lines (``: ping``) and events without data are skipped; ``data`` lines are joined with ``\\n`` and decoded
    as JSON (kept as text when they are not JSON). ``last_id`` is the last ``id:`` seen, for ``Last-Event-ID``.
    """

    last_id: str | None = None
    max_event_chars: int = MAX_EVENT_CHARS
    _event: str = ""
    _data: list[str] = field(default_factory=list)
    _id: str | None = None
    _chars: int = 0  # of the event being read: its lines so far
    _line: list[str] = field(default_factory=list)  # the line not yet ended, and its length
    _line_chars: int = 0
    _after_cr: bool = False

    def reset(self) -> None:
        """Forget the event being read (a new connection sends it again from its start); ``last_id`` stays."""
        self._event, self._data, self._id, self._chars = "", [], None, 0
        self._line, self._line_chars, self._after_cr = [], 0, False

    def feed_text(self, text: str) -> list[Event]:
        """A piece of the stream as decoded (a line may span pieces; CRLF, LF or CR end one); the events it
        completes. Raises ValueError once the event being read exceeds ``max_event_chars``."""
        if not text:
            return []
        if self._after_cr and text.startswith("\n"):
            text = text[1:]  # the LF of a CRLF split between two pieces
        self._after_cr = text.endswith("\r")
        events, start = [], 0
        for match in _EOL.finditer(text):
            self._line.append(text[start : match.start()])
            line, self._line, self._line_chars = "".join(self._line), [], 0
            start = match.end()
            event = self.feed(line)
            if event is not None:
                events.append(event)
        if start < len(text):
            self._line.append(text[start:])
            self._line_chars += len(text) - start
        if self._chars + self._line_chars > self.max_event_chars:
            raise ValueError(f"an event of the stream exceeds {self.max_event_chars} characters")
        return events

    def feed(self, line: str) -> Event | None:
        """One line (any ``\\r`` or ``\\n`` at its end is dropped); the event it completes, if any."""
        line = line.rstrip("\r\n")
        if not line:
            self._chars = 0
            return self._dispatch()
        self._chars += len(line)
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
