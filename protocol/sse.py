"""Server-sent events: framing JSON-RPC responses as events, and an incremental parser.

A2A streams send each JSON-RPC response as one ``data:`` line followed by a blank line
(spec 1.0 §9.4.2, wire/v1_stream.resp.txt). The parser follows the WHATWG event-stream rules
(``data``, ``event``, ``id``, ``retry``, comments) and is fed bytes as they arrive, so a line
or a UTF-8 character split across reads is handled.
"""

from __future__ import annotations

import codecs
import re

import attrs

from protocol.jsonrpc import encode_json

_LINE_END = re.compile(r"\r\n|\r|\n")

CONTENT_TYPE = "text/event-stream; charset=utf-8"
HEADERS = (("content-type", CONTENT_TYPE), ("cache-control", "no-store"), ("x-accel-buffering", "no"))
"""Response headers for a stream, as the reference server sends them (no proxy buffering)."""


# Characters that JSON leaves raw but Python's str.splitlines() (which httpx's aiter_lines(), and
# so the a2a-sdk client, splits a stream with) reads as line breaks: escaped, or a data line holding
# one is cut in two inside a JSON string. In UTF-8 each is a whole character wherever it appears.
_SPLITLINES_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def encode_event(response: object) -> bytes:
    """One JSON-RPC response as an SSE event: ``data: {...}\\n\\n``, on one line for every
    client (see _SPLITLINES_BREAKS)."""
    data = encode_json(response)
    for raw, escaped in _SPLITLINES_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


def encode_comment(text: str = "") -> bytes:
    """A comment line, which clients ignore: a keep-alive that holds idle proxies open."""
    if "\n" in text or "\r" in text:
        raise ValueError("an SSE comment must fit on one line")
    return b":" + (b" " + text.encode("utf-8") if text else b"") + b"\n\n"


@attrs.frozen
class SseEvent:
    data: str
    event: str = "message"
    id: str | None = None
    retry_ms: int | None = None


@attrs.define(eq=False)
class SseLines:
    """The lines of an event stream, fed its bytes as they arrive: a line or a UTF-8 character
    split across reads is put back together, and a leading byte order mark is skipped.

    Lines end at CRLF, CR or LF, and nowhere else: not at the other characters
    ``str.splitlines()`` breaks at (U+2028, U+0085...), which a server may send raw inside JSON.
    Each read is searched once, so a long line costs its length, not its length squared; with
    ``max_line_chars``, a longer line raises LineTooLong rather than growing without end.
    """

    max_line_chars: int | None = None
    _decoder: codecs.IncrementalDecoder = attrs.field(
        init=False, factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    _pending: list[str] = attrs.field(init=False, factory=list)  # the start of a line not yet ended
    _pending_chars: int = attrs.field(init=False, default=0)
    _started: bool = attrs.field(init=False, default=False)
    _skip_lf: bool = attrs.field(init=False, default=False)

    def feed(self, chunk: bytes) -> list[str]:
        """The lines ``chunk`` completes, without their line endings."""
        text = self._decoder.decode(chunk)
        if not text:
            return []
        if not self._started:
            text = text.removeprefix("\ufeff")
            self._started = True
        if self._skip_lf:
            # The previous read ended in CR; an LF now is the second half of that CRLF.
            text = text.removeprefix("\n")
            self._skip_lf = False
        lines = []
        start = 0
        for match in _LINE_END.finditer(text):
            lines.append(self._take(text[start : match.start()]))
            start = match.end()
            self._skip_lf = match.group() == "\r" and start == len(text)
        if start < len(text):
            self._pending.append(text[start:])
            self._pending_chars += len(text) - start
            if self.max_line_chars is not None and self._pending_chars > self.max_line_chars:
                raise LineTooLong(self.max_line_chars)
        return lines

    def close(self) -> str:
        """The stream has ended: what came after its last line ending ("" when nothing did)."""
        return self._take(self._decoder.decode(b"", final=True))

    def _take(self, end: str) -> str:
        line = "".join((*self._pending, end)) if self._pending else end
        self._pending.clear()
        self._pending_chars = 0
        if self.max_line_chars is not None and len(line) > self.max_line_chars:
            raise LineTooLong(self.max_line_chars)
        return line


class LineTooLong(ValueError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"a line of the event stream is longer than {limit} characters")


@attrs.define(eq=False)
class SseParser:
    """Turns a byte stream into events; call ``feed`` with each chunk as it arrives."""

    _lines: SseLines = attrs.field(init=False, factory=lambda: SseLines())
    _data: list[str] = attrs.field(init=False, factory=list)
    _event: str = attrs.field(init=False, default="")
    _last_id: str | None = attrs.field(init=False, default=None)
    _retry_ms: int | None = attrs.field(init=False, default=None)

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """The events completed by ``chunk`` (often none, sometimes several)."""
        events = []
        for line in self._lines.feed(chunk):
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> bool:
        """Finish the stream; True when it ended cleanly, False when an event was left unfinished
        (the spec discards it, and a client should treat the stream as cut short)."""
        return not self._lines.close() and not self._data and not self._event

    def _line(self, line: str) -> SseEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._last_id = value
        elif name == "retry" and value.isdigit() and value.isascii():
            self._retry_ms = int(value)
        return None

    def _dispatch(self) -> SseEvent | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None
        return SseEvent("\n".join(data), event or "message", self._last_id, self._retry_ms)
