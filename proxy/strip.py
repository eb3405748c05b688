"""Take out of an SSE byte stream what cachegate's own usage request added, and nothing else.

When a client streams without ``stream_options.include_usage``, cachegate asks the upstream for usage
so it can account the exchange, and must then hide what that request added so the client receives
exactly what it would have received directly: the usage-only event (``"choices": []`` and a usage
object) and, on every other chunk, the ``"usage": null`` member OpenAI then adds: a line ending in
``,"usage":null}`` loses those bytes (OpenAI writes it as the last member of the chunk's one
``data:`` line), and so does one ending in ``,"usage":null,"obfuscation":"…"}`` (since August 2025
OpenAI pads each chunk with that last member, unless asked not to); a null usage written any
other way is left as the provider sent it. Whole events pass as they arrive; an event cut by a
read is held until its end (an SSE client can use no event before its blank line).
"""

from __future__ import annotations

import re

import orjson

# An event ends with an empty line: two line ends in a row, each CRLF, LF or CR, mixed or not. A
# CR followed by LF is one line end (CRLF), so an end whose last byte is a CR takes the LF that
# follows it, when one does. At the end of a read the next byte is not known yet: the event is
# dispatched all the same (an SSE reader dispatches it at that CR), and an LF that comes next
# opens the next read (``_CR_ENDS``); only the usage event waits there for its LF, to go with it.
_EVENT_END = re.compile(rb"\r\n\r\n|\n\r\n|\r\r\n|\n\n|\r\r(?=[^\n])|\n\r(?=[^\n])|\r\n\r(?=[^\n])")
_CR_ENDS = (b"\r\r", b"\n\r")  # (b"\r\n\r" ends in b"\n\r")
EVENT_ENDS = (b"\n\n", b"\r\r")  # a chunk ending in one ends with a whole event


# The other lines an event may have (an id, a name, a retry time, a comment), which some servers
# and gateways give every event: the usage event goes with them (the upstream would have sent no
# such event at all). An event named "error" is never taken for one.
_OTHER_FIELD = re.compile(rb"(?::|id(?::|$)|retry(?::|$)|event(?::|$)(?! ?error\s*$))")


def is_usage_only(event: bytes) -> bool:
    """True for an event whose data is a chunk with no choices and a usage object (one data
    line; its other lines, if any, an id, a name, a retry time or comments)."""
    if event.find(b'"usage"') < 0:
        return False
    lines = event.splitlines()
    data = [ln[5:].lstrip(b" ") for ln in lines if ln.startswith(b"data:")]
    if len(data) != 1:
        return False
    for line in lines:
        if line.strip() and not line.startswith(b"data:") and not _OTHER_FIELD.match(line):
            return False
    try:
        obj = orjson.loads(data[0])
    except orjson.JSONDecodeError:
        return False
    return (
        isinstance(obj, dict)
        and not obj.get("choices")
        and isinstance(obj.get("usage"), dict)
        and obj.get("error") is None  # (an error with usage the client must see, however named)
    )


# A null usage as OpenAI writes it: the chunk's last member, at the end of its one data line.
# (Matched on bytes: a JSON string cannot hold it, its quotes and line ends being escaped.)
NULL_USAGE_LF = b',"usage":null}\n'
_NULL_USAGE_CR = b',"usage":null}\r'
# The same null before OpenAI's padding, the chunk's last member: a string with no escape, so its
# first quote ends it, and then the chunk and its line.
_PADDED_NULL_AT = re.compile(rb',"usage":null(?=,"obfuscation":"[^"\\\r\n]*"\}[\r\n])')


def without_lf_nulls(data: bytes) -> bytes:
    """``data`` (whole events, LF line ends) without the null usages ending its data lines."""
    out = data.replace(NULL_USAGE_LF, b"}\n")
    # (no look for the padding first: OpenAI pads every chunk, and the pattern's own search
    # for its literal start costs what a look would: 1.35 -> 0.92 µs a padded chunk, 0.33 ->
    # 0.53 an unpadded one)
    return _PADDED_NULL_AT.sub(b"", out)


def without_null_usage(data: bytes) -> bytes:
    """``data`` (whole events) without the ``"usage": null`` member ending a data line, or
    standing before the padding that ends it."""
    out = without_lf_nulls(data)
    if out.find(_NULL_USAGE_CR) >= 0:
        out = out.replace(_NULL_USAGE_CR, b"}\r")
    return out


# The most of one event the stripper holds back until its end (see ``UsageEventStripper.feed``).
MAX_PENDING = 16 * 1024 * 1024


class UsageEventStripper:
    """Incremental filter: ``feed(chunk)`` returns the bytes to forward now; ``flush()`` the rest."""

    __slots__ = ("_cr", "lf_owed", "pending", "stripped")

    def __init__(self) -> None:
        self.pending = bytearray()  # the current event, cut by a read: empty between events
        self.stripped = 0  # usage-only events taken out
        self._cr = False  # whether ``pending`` holds a CR
        # An event ending in a CR was forwarded at the end of a read: an LF that opens the next
        # read is its own (a CRLF), forwarded, not a blank line before the next event.
        self.lf_owed = False

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to forward now. An event held past ``MAX_PENDING`` bytes (a stream with no
        event ends, or one huge event) is passed on as it is: no usage event is that long."""
        out = self._feed(chunk)
        pending = self.pending
        if pending and pending[0] == 58:  # ``:``: a comment line opens the held event
            out += self._comments()
        if len(pending) > MAX_PENDING:
            out, self.pending, self._cr = out + bytes(pending), bytearray(), False
        return out

    def _feed(self, chunk: bytes) -> bytes:
        # The usual read, whole events with no usage member but OpenAI's nulls, is handled by the
        # relay's sink before it calls this (``proxy.relay._sink``); any read is right here too.
        if self.lf_owed:
            self.lf_owed = False
            if chunk[:1] == b"\n":
                return b"\n" + self._feed(chunk[1:]) if len(chunk) > 1 else chunk
        event = self.pending
        held = len(event)
        event += chunk
        chunk_cr = chunk.find(b"\r") >= 0
        if not self._cr and not chunk_cr:
            # Line ends are all LF (what every provider sends): the whole events end at the last
            # blank line, and they are taken together, OpenAI's nulls with one replace, as long
            # as no other usage member is among them. Else the general path below.
            last = event.rfind(b"\n\n", max(held - 1, 0))
            if last < 0:
                return b""
            # Line ends pair up from the start of their run, as an SSE reader takes them: of
            # three in a row, two end the event and the third opens the next one.
            run = last
            while run and event[run - 1] == 10:
                run -= 1
            cut = run + (last + 2 - run) // 2 * 2
            whole = bytes(event[:cut])
            del event[:cut]
            plain = without_lf_nulls(whole)
            if plain.find(b'"usage"') >= 0:
                plain = self._lf_events(whole)
            return chunk if not held and cut == len(chunk) and plain == chunk else plain
        before = len(event)
        out = self._events(event, max(0, held - 3))
        if len(event) < before:  # events were cut off: is a CR left in the one still open?
            self._cr = event.find(b"\r") >= 0
        else:
            self._cr = self._cr or chunk_cr
        if not out:
            return b""
        # A read of whole events with nothing taken out forwards the caller's own bytes object.
        return chunk if len(out) == len(chunk) and out == chunk else bytes(out)

    def _comments(self) -> bytes:
        """The comment lines at the start of the held event that another comment line follows,
        and nothing else (a server's keep-alive, ``: ping`` and a line end, with no blank line
        after it, while the model thinks): taken off it to be forwarded, where they were held
        until a blank line came, past a client's read timeout. The last comment line stays
        held: a server that writes one in every event writes one in the usage event too, which
        goes whole. A comment line whose CR is the last byte held stays held, as the next byte
        may be its LF."""
        event = self.pending
        at = 0
        ends: list[int] = []
        size = len(event)
        while at < size and event[at] == 58:  # ``:``
            end = event.find(b"\n", at)
            cr = event.find(b"\r", at, end if end >= 0 else size)
            if cr >= 0 and cr != end - 1:  # (ended by a CR alone, or one an LF may follow)
                if cr + 1 == size:
                    ends.append(size)  # (its LF may be the next byte: still open)
                    break
                end = cr
            elif end < 0:
                ends.append(size)  # (a comment line still open)
                break
            at = end + 1
            ends.append(at)
        if at < size and event[at] != 58 and ends and ends[-1] != size:
            return b""  # (another field follows: the comments go with its event)
        if len(ends) < 2:
            return b""
        cut = ends[-2]
        lines = bytes(event[:cut])
        del event[:cut]
        return lines

    def _lf_events(self, whole: bytes) -> bytes:
        """What whole events with LF line ends forward, event by event (a read holding a usage
        member other than OpenAI's null: the usage event, once per stream)."""
        parts = whole.split(b"\n\n")
        for i in range(len(parts) - 1):  # the last part is what follows the last end: b"" or LF
            data = parts[i] + b"\n\n"
            parts[i] = self._kept(data) if data.find(b'"usage"') >= 0 else data
        return b"".join(parts)

    def _events(self, event: bytearray, scan: int) -> bytearray:
        """What the whole events in ``event`` forward, event by event (any line ends); they are
        cut off ``event``, which keeps the event still open. ``scan`` is where an end may begin."""
        out = bytearray()
        # Each search starts where the last event ended, and the events are cut off once, at the
        # end: a chunk of a thousand events costs one pass over it, not one per event.
        start = 0  # where the current event begins
        copy_from = 0  # events from here to ``start`` pass as they are
        search = _EVENT_END.search
        while True:
            found = search(event, scan)
            if found is None:
                break
            end = found.end()
            if event.find(b'"usage"', start, end) >= 0:
                data = bytes(event[start:end])
                kept = self._kept(data)
                if kept != data:
                    out += event[copy_from:start]
                    out += kept
                    copy_from = end
            start = scan = end
        if start > copy_from:
            out += event[copy_from:start]
        if len(event) - start >= 2 and event.endswith(_CR_ENDS):  # (of the open event's own)
            # An event ended by a CR at the end of the read (CR line ends): not held until the
            # next byte says whether an LF belongs to it (a stream of CR line ends came an event
            # late, [DONE] at the stream's end), but for the usage event.
            data = bytes(event[start:])
            if data.find(b'"usage"') < 0:
                out += data
                start = len(event)
                self.lf_owed = True
            elif not is_usage_only(data):
                out += without_null_usage(data)
                start = len(event)
                self.lf_owed = True
        del event[:start]
        return out

    def _kept(self, data: bytes) -> bytes:
        """What one event forwards: nothing for the usage event, else itself without OpenAI's
        null usages."""
        kept = without_null_usage(data)
        # Only a usage member other than OpenAI's null can make it the usage event.
        if kept.find(b'"usage"') >= 0 and is_usage_only(data):
            self.stripped += 1
            return b""
        return kept

    def flush(self) -> bytes:
        """The bytes of a final event that never ended (a truncated stream, or one whose last
        event has no line end): read as if its line ended there, so that OpenAI's null usage
        at its end goes too (and a whole usage event so cut)."""
        rest = b""
        if self.pending:
            rest = self._kept(bytes(self.pending) + b"\n")
            if rest.endswith(b"\n"):
                rest = rest[:-1]  # (the line end read into it)
        self.pending = bytearray()
        self._cr = self.lf_owed = False
        return rest
