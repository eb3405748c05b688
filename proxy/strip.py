"""Take out of an SSE byte stream what cachegate's own usage request added, and nothing else.

When a client streams without ``stream_options.include_usage``, cachegate asks the upstream for usage
so it can account the exchange, and must then hide what that request added so the client receives
exactly what it would have received directly: the usage-only event (``"choices": []`` and a usage
object) and, on every other chunk, the ``"usage": null`` member OpenAI then adds (written last,
``,"usage":null}`` at the end of the data line; a null usage written anywhere else is left as it
is). Whole events pass as they arrive; an event cut by a read is held until its end (an SSE client
can use no event before its blank line).
"""

from __future__ import annotations

import orjson

_TERMINATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")
EVENT_ENDS = (b"\n\n", b"\r\r")  # a chunk ending in one ends with a whole event


def is_usage_only(event: bytes) -> bool:
    """True for an event whose data is a chunk with no choices and a usage object."""
    if event.find(b'"usage"') < 0:
        return False
    lines = event.splitlines()
    data = [ln[5:].lstrip(b" ") for ln in lines if ln.startswith(b"data:")]
    if len(data) != 1 or len(data) != sum(1 for ln in lines if ln.strip()):
        return False
    try:
        obj = orjson.loads(data[0])
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and not obj.get("choices") and isinstance(obj.get("usage"), dict)


# A null usage as OpenAI writes it: the data object's last member, at the end of the line.
NULL_USAGE_LF = b',"usage":null}\n'
_NULL_USAGE_CR = b',"usage":null}\r'


def without_null_usage(data: bytes) -> bytes:
    """``data`` (whole events) without the ``"usage": null`` member ending a data line."""
    out = data.replace(NULL_USAGE_LF, b"}\n")
    if out.find(_NULL_USAGE_CR) >= 0:
        out = out.replace(_NULL_USAGE_CR, b"}\r")
    return out


class UsageEventStripper:
    """Incremental filter: ``feed(chunk)`` returns the bytes to forward now; ``flush()`` the rest."""

    __slots__ = ("pending", "stripped")

    def __init__(self) -> None:
        self.pending = bytearray()  # the current event, cut by a read: empty between events
        self.stripped = 0  # usage-only events taken out

    def feed(self, chunk: bytes) -> bytes:
        if not self.pending and chunk.endswith(EVENT_ENDS):  # whole events: the usual read
            plain = chunk.replace(NULL_USAGE_LF, b"}\n")  # the same object when none
            if plain.find(b'"usage"') < 0:
                return plain  # no usage member left: none, or only OpenAI's null ones
        event = self.pending
        scan = max(0, len(event) - 3)
        event += chunk
        out = bytearray()
        # Where each terminator next occurs at or after ``scan`` (-1: nowhere). One is searched
        # again only once ``scan`` has passed it, and the events are cut off once, at the end:
        # a chunk of a thousand events costs a pass or two over it, not one per event.
        found = [event.find(term, scan) for term in _TERMINATORS]
        start = 0  # where the current event begins
        copy_from = 0  # events from here to ``start`` pass as they are
        while True:
            end = -1
            for k, term in enumerate(_TERMINATORS):
                at = found[k]
                if 0 <= at < scan:
                    at = found[k] = event.find(term, scan)
                if at >= 0 and (end < 0 or at + len(term) < end):
                    end = at + len(term)
            if end < 0:
                break
            if event.find(b'"usage"', start, end) >= 0:
                data = bytes(event[start:end])
                if is_usage_only(data):
                    self.stripped += 1
                    kept = b""
                else:
                    kept = without_null_usage(data)
                if kept != data:
                    out += event[copy_from:start]
                    out += kept
                    copy_from = end
            start = scan = end
        if start > copy_from:
            out += event[copy_from:start]
        del event[:start]
        if not out:
            return b""
        # A read of whole events with nothing taken out forwards the caller's own bytes object.
        return chunk if len(out) == len(chunk) and out == chunk else bytes(out)

    def flush(self) -> bytes:
        """The bytes of a final event that never ended (a truncated stream)."""
        rest = bytes(self.pending)
        if rest and is_usage_only(rest):
            self.stripped += 1
            rest = b""
        elif rest:
            rest = without_null_usage(rest)
        self.pending = bytearray()
        return rest
