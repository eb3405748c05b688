"""Incremental Server-Sent Events decoder (pure): byte chunks in, events out.

It follows the WHATWG event-stream rules and sits on the hot path of every streamed response, so it
works on whole chunks with ``bytes`` methods and decodes UTF-8 once per event, never per byte.
Line terminators are ASCII, so splitting raw bytes on them never cuts a multi-byte character: a
character split across two chunks simply waits in the partial-line buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event.

    ``event`` is None when the block had no ``event:`` field (WHATWG would call it "message").
    ``id`` is the stream's last event id at dispatch time (it persists across events, as in
    WHATWG); ``retry`` is the ``retry:`` value given in this event's own block, if any;
    ``no_data``: a block with no ``data:`` line, dispatched as the openai SDKs dispatch one
    (``sdk_events``).
    """

    event: str | None
    data: str
    id: str | None = None
    retry: int | None = None
    no_data: bool = False  # dispatched with no data line, as the SDKs do (``sdk_events``)


class SSEDecoder:
    """Turn an event stream, fed in arbitrary chunks, into ``SSEEvent`` values.

    ``decode(chunk)`` returns the events completed by that chunk; ``flush()`` at the end of the
    stream returns a last event that never got its blank line (a truncated stream). As in WHATWG, a
    block without any ``data:`` field dispatches nothing, and ``retry:`` values are also kept in
    ``retry``. ``comments`` counts comment lines such as ``: keep-alive``.

    With ``sdk_events``, a blank line also dispatches an event with empty ``data`` where the
    openai Python SDK dispatches one (and then fails to parse it): after a block with a
    non-empty ``event:`` (the Node SDK too) or a ``retry:`` but no data, and after any extra
    blank line once the stream has given a non-empty ``id:`` (which persists).
    """

    def __init__(self, sdk_events: bool = False) -> None:
        self.sdk_events = sdk_events
        self.comments = 0
        self.retry: int | None = None
        self.last_event_id: str | None = None
        self._pending: list[bytes] = []  # pieces of a line whose terminator has not arrived
        self._after_cr = False  # the last chunk ended in "\r": a leading "\n" next completes it
        self._at_start = True  # a UTF-8 BOM is only stripped from the very first line
        self._data: list[bytes] = []
        self._event: str | None = None
        self._block_retry: int | None = None
        self._has_data = False

    def decode(self, chunk: bytes) -> list[SSEEvent]:
        """Feed one chunk; return the events it completed, in order."""
        if self._after_cr and chunk:
            self._after_cr = False
            if chunk[0] == 0x0A:
                chunk = chunk[1:]
        if not chunk:
            return []
        has_cr = chunk.find(b"\r") >= 0
        if not has_cr and chunk.find(b"\n") < 0:
            self._pending.append(chunk)
            return []
        if self._pending:
            self._pending.append(chunk)
            chunk = b"".join(self._pending)
            self._pending = []
        if has_cr:
            self._after_cr = chunk[-1] == 0x0D
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = chunk.split(b"\n")
        rest = lines.pop()
        if rest:
            self._pending.append(rest)
        return self._lines(lines)

    def decode_data(self, chunk: bytes) -> list[bytes] | None:
        """The fast path for the common stream shape: when the decoder sits between events and
        ``chunk`` is whole ``data: ...`` events of one line each (LF only, no other field), return
        their raw data payloads and keep any trailing part for later; otherwise None, with nothing
        consumed (call ``decode``). The payloads are what ``decode`` would give as ``data``, still
        as bytes, for events with no ``event``, ``id`` or ``retry``."""
        if (
            not self.idle
            or (self._at_start and chunk.startswith(_BOM[: len(chunk)]))
            or chunk.find(b"\r") >= 0
        ):
            return None
        blocks = chunk.split(b"\n\n")
        tail = blocks.pop()
        if tail.startswith(b"\n"):  # (a blank line more: ``decode`` may dispatch an event)
            return None
        for block in blocks:
            # find, not ``in``: CPython 3.11 formats and discards a TypeError in every bytes
            # ``in`` test before it searches.
            if not block.startswith(b"data: ") or block.find(b"\n") >= 0:
                return None
        if blocks:
            self._at_start = False
        if tail:  # the start of an event whose blank line has not come yet
            self.decode(tail)
        return [block[6:] for block in blocks]

    def decode_shaped(
        self, chunk: bytes, before: bytes, after: bytes, accept: Callable[[list[bytes]], bool]
    ) -> bool:
        """``decode_data`` for a chunk whose whole events are all plain one-line events with data
        ``before + middle + after``: their middles go to ``accept`` and any trailing part is
        kept for later, as there. False, with nothing consumed, if the chunk is anything else or
        ``accept`` refuses the middles. ``before`` and ``after`` must hold no line break. The
        events are checked by rebuilding them from the middles and comparing, so the bulk of a
        stream costs one slice per event."""
        if not self.idle:
            return False
        blocks = chunk.split(b"\n\n")
        tail = blocks.pop()
        if not blocks or tail.startswith(b"\n"):  # (a blank line more: as ``decode_data``)
            return False
        first = b"data: " + before
        start, stop = len(first), -len(after)
        middles = [block[start:stop] for block in blocks]
        joined = b"".join(middles)
        end = after + b"\n\n"
        if (
            joined.find(b"\n") >= 0
            or joined.find(b"\r") >= 0
            or first + (end + first).join(middles) + end != chunk[: len(chunk) - len(tail)]
            or not accept(middles)
        ):
            return False
        self._at_start = False
        if tail:
            self.decode(tail)
        return True

    @property
    def pending_bytes(self) -> int:
        """Bytes held of an event not ended yet: its unfinished line and its data lines."""
        return sum(map(len, self._pending)) + sum(map(len, self._data))

    @property
    def idle(self) -> bool:
        """Between events: nothing pending, no field of an unfinished block kept."""
        return not (
            self._pending
            or self._has_data
            or self._after_cr
            or self._event is not None
            or self._block_retry is not None
        )

    def flush(self) -> list[SSEEvent]:
        """End of stream: finish a pending line; dispatch an event left without its blank line."""
        events = self._lines([b"".join(self._pending)]) if self._pending else []
        self._pending = []
        self._after_cr = False
        events += self._lines([b""], at_end=True)  # (the SDKs dispatch nothing there)
        return events

    def _lines(self, lines: list[bytes], at_end: bool = False) -> list[SSEEvent]:
        if self._at_start and lines:
            self._at_start = False
            if lines[0].startswith(_BOM):
                lines[0] = lines[0][len(_BOM) :]
        events: list[SSEEvent] = []
        for line in lines:
            if not line:
                if self._has_data:
                    events.append(
                        SSEEvent(
                            self._event,
                            b"\n".join(self._data).decode("utf-8", "replace"),
                            self.last_event_id,
                            self._block_retry,
                        )
                    )
                elif (
                    self.sdk_events
                    and not at_end
                    and (self._event or self._block_retry is not None or self.last_event_id)
                ):
                    events.append(
                        SSEEvent(self._event, "", self.last_event_id, self._block_retry, True)
                    )
                self._data = []
                self._event = None
                self._block_retry = None
                self._has_data = False
                continue
            if line[0] == 0x3A:  # ":" starts a comment
                self.comments += 1
                continue
            colon = line.find(b":")
            if colon < 0:
                name, value = line, b""
            else:
                name, value = line[:colon], line[colon + 1 :]
                if value[:1] == b" ":
                    value = value[1:]
            if name == b"data":
                self._data.append(value)
                self._has_data = True
            elif name == b"event":
                self._event = value.decode("utf-8", "replace")
            elif name == b"id":
                if b"\x00" not in value:
                    self.last_event_id = value.decode("utf-8", "replace")
            elif name == b"retry" and value.isdigit():
                self._block_retry = self.retry = int(value)
        return events
