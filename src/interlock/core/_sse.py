"""The one ``text/event-stream`` parser: the providers read model streams with it, the
gateway client reads run streams with it.

Per the HTML standard's event-stream rules: lines end with CRLF, LF or CR; a leading BOM is
dropped; ``:`` starts a comment; a field's value loses one leading space; ``data`` lines
accumulate; a blank line dispatches an event if it has data; ``id`` sets the last event id
(kept across events, ignored if it holds a NUL); an event left incomplete when the stream
ends is dropped.
"""

from __future__ import annotations

import codecs
import re
from typing import NamedTuple

__all__ = ["SseEvent", "SseParser"]

_LINE_END = re.compile(r"\r\n|\r|\n")


class SseEvent(NamedTuple):
    """One server-sent event."""

    event: str
    """The ``event:`` field; ``""`` when the event had none (the standard's ``message``)."""
    data: str
    """The ``data:`` lines joined with ``\\n``."""
    id: str | None = None
    """The last event id the stream set (at or before this event), None if it set none."""


class SseParser:
    """An incremental event-stream parser: :meth:`feed` bytes as they arrive, or
    :meth:`feed_line` lines already split (an HTTP client's ``iter_lines``)."""

    __slots__ = ("_buffer", "_data", "_decoder", "_event", "_first", "_id", "_skip_lf")

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._buffer = ""
        self._skip_lf = False
        self._first = True
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """The events ``chunk`` completes (a chunk may end anywhere, mid-character too)."""
        text = self._decoder.decode(chunk)
        if self._skip_lf and text:
            self._skip_lf = False
            text = text.removeprefix("\n")
        if not text:
            return []
        lines = _LINE_END.split(self._buffer + text)
        self._buffer = lines.pop()
        if self._buffer == "" and text.endswith("\r"):
            self._skip_lf = True  # the LF of a CRLF split across two chunks
        events: list[SseEvent] = []
        for line in lines:
            event = self.feed_line(line)
            if event is not None:
                events.append(event)
        return events

    def feed_line(self, line: str) -> SseEvent | None:
        """One line, without its line break: the event a blank line dispatches, else None."""
        if self._first:
            self._first = False
            line = line.removeprefix("\ufeff")
        if not line:
            event = None
            if self._data:
                event = SseEvent(self._event, "\n".join(self._data), self._id)
            self._event = ""
            self._data = []
            return event
        if line[0] == ":":
            return None
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        # ``retry`` steers a browser's reconnection; no reader here reconnects by it
        return None
