"""Remove from an SSE byte stream the one usage-only event cachegate asked for, and nothing else.

When a client streams without ``stream_options.include_usage``, cachegate asks the upstream for usage
so it can account the exchange, and must then hide the extra event so the client receives exactly
what it would have received directly. Every other byte passes through as it arrives: an event is only
held back while it could still be the usage-only one (it starts with ``data:`` and no ``"delta"`` has
appeared in it yet); a chunk event is recognised by ``"delta"`` within its first ~150 bytes.
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


class UsageEventStripper:
    """Incremental filter: ``feed(chunk)`` returns the bytes to forward now; ``flush()`` the rest."""

    __slots__ = ("_passing", "_sent", "pending", "stripped")

    def __init__(self) -> None:
        # Bytes of the current, incomplete event: empty between events. A chunk of whole events
        # (ending in a blank line) with no usage object in it ("usage":null is none) passes
        # unchanged when nothing is pending; the relay checks that itself before calling
        # ``feed``.
        self.pending = bytearray()
        self._sent = 0  # how many of them were already forwarded
        self._passing = False  # the current event is known not to be usage-only
        self.stripped = 0

    def feed(self, chunk: bytes) -> bytes:
        if (
            not self.pending
            and chunk.endswith(EVENT_ENDS)
            and (
                chunk.find(b'"usage"') < 0
                or chunk.count(b'"usage"') == chunk.count(b'"usage":null')
            )
        ):
            return chunk  # whole events, no usage object in any: the common case, no copying
        event = self.pending
        scan = max(0, len(event) - 3)
        event += chunk
        out = bytearray()
        # Where each terminator next occurs at or after ``scan`` (-1: nowhere). One is searched
        # again only once ``scan`` has passed it, and the events are cut off once, at the end:
        # a chunk of a thousand events costs a pass or two over it, not one per event.
        found = [event.find(term, scan) for term in _TERMINATORS]
        start = 0  # where the current event begins
        copy_from = self._sent  # what was forwarded of the first event is not sent again
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
            if (
                not self._passing
                # an event whose every usage is null is not the one (as the relay's own test)
                and event.count(b'"usage"', start, end) != event.count(b'"usage":null', start, end)
                and is_usage_only(bytes(event[start:end]))
            ):
                self.stripped += 1
                out += event[copy_from:start]  # the events before it pass as they are
                copy_from = end
            start = scan = end
            self._sent = 0
            self._passing = False
        if start > copy_from:
            out += event[copy_from:start]
        del event[:start]
        if event and not self._passing and self._decided(event):
            self._passing = True
        if self._passing and len(event) > self._sent:
            out += event[self._sent :]
            self._sent = len(event)
        if not out:
            return b""
        # The common case, one whole event per chunk, forwards the caller's own bytes object.
        return chunk if len(out) == len(chunk) and out == chunk else bytes(out)

    @staticmethod
    def _decided(event: bytearray) -> bool:
        if len(event) < 5:
            return not b"data:".startswith(bytes(event))
        return not event.startswith(b"data:") or event.find(b'"delta"') >= 0

    def flush(self) -> bytes:
        """The bytes of a final event that never ended (a truncated stream): forwarded as they were."""
        rest = bytes(self.pending[self._sent :])
        if rest and not self._passing and is_usage_only(rest):
            self.stripped += 1
            rest = b""
        self.pending = bytearray()
        self._sent = 0
        self._passing = False
        return rest
