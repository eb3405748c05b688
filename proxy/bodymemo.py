"""Parse an agent's request in proportion to what it appended, not to its whole history (pure).

Agents resend their whole conversation every turn: turn N+1's body is turn N's with a few messages
added at the end of ``messages``. When the new body's bytes start with everything the previous body
had before the ``]`` that closed its messages, and end with everything from that ``]`` on, the new
body *is* the previous one with the bytes in between appended to the array. Only those bytes are
parsed; the earlier messages and every other field are the previous parse's objects, so the checks
that follow (prefix sharing, the repair check, prefix hashing) see the same objects and skip them.

Soundness rests on knowing where the messages array closes. After a splice that is known by
construction. After a full parse a candidate position is taken from the layout (``messages`` as the
last key), from the previous body's tail, or from the usual serializations of the fields after
``messages``, and accepted only when the body cut there and closed with ``]}`` plus the fields after
it parse back to exactly the same body. That check is a second parse of the whole body, so it is
made only once a later body's bytes continue this one's at the candidate (``_settle``): a body that
is never continued (a conversation's last turn, a one-shot request, a system prompt with the time
in it) costs one parse, not two. Anything unexpected falls back to a full parse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import operator
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from proxy.prefix import deep_call, deep_dumps, leading_system_count

_WS = b" \t\r\n"
MIN_BYTES = 16 * 1024  # smaller bodies parse in microseconds: not worth remembering
# Sessions whose bodies open with the same bytes (one agent, several tasks), or conversations of
# one session: two memos each (``BodyMemos.put``), for as many as the session keeps
# (``sessions.CONVERSATIONS_KEPT``). Eight let four sub-agents taking turns splice, not five.
MEMOS_PER_KEY = 64
# Full parses in a row whose bytes did not continue a memo: stop remembering (each memo held
# pushes out others, of other keys too, once the memos' budget is full)
_MAX_MISSES = 3
# Memos of other keys a body whose first bytes are new is matched against (``BodyMemos.recent``):
# agents without a session id taking turns, each with the time in its prompt
RECENT_KEPT = 32
_FIRSTS_REMEMBERED = 32  # ...but for this many first requests of conversations (a fan-out)
# Where a body's last messages begin, kept with its memo: a body that changed one of them is
# parsed from there on (``_resplice``).
MARKS_KEPT = 8
# They are found walking back over the messages' bytes, at most this many (the last message's
# whole, however long): serialized and compared, then parsed once, at C's speed.
_MARK_BYTES = 256 * 1024


@dataclass
class BodyMemo:
    """One parsed body and where its messages array closes. Kept after a full parse with that
    place not yet checked (``candidates``): ``close`` and ``marks`` are then where the body's
    layout says they are, and ``_settle`` checks them, in place, once a body continues them."""

    raw: bytes
    close: int  # where the last message ends: only whitespace, then the "]" closing ``messages``
    keys: tuple[str, ...]  # the body's keys, in order
    values: dict[str, Any]  # every field but ``messages``, as parsed
    messages: tuple[Any, ...]  # the message objects the caller kept (shared across turns)
    misses: int = 0
    firsts: int = 0  # conversations' first requests remembered since the misses began
    lineage: int = 0  # memos that continue one another share it (set by ``BodyMemos.put``)
    # Where its last few messages begin: ``(offset, n)``, ``raw[:offset]`` holding messages up
    # to ``n - 1``, the comma after it (or white space) at ``offset``; earliest first.
    marks: tuple[tuple[int, int], ...] = ()
    style: int = 0  # how the client writes its messages (``_marks``)
    # Where the "]" closing the messages may be, the likeliest first, not yet checked (after a
    # full parse); () once checked (``_settle``): ``close`` is then -1 if none was it.
    candidates: tuple[int, ...] = ()
    # Where its first message after the system prompt begins: ``(offset, n)``, ``raw[offset]``
    # the first byte of message ``n``, ``raw[:offset]`` holding the fields before the messages
    # and messages up to ``n - 1`` (offset -1: none; -2: not looked for yet, ``_UNSOUGHT``);
    # checked (``head_checked``) before a body whose first bytes changed is parsed as other
    # bytes up to there, then these (``_rehead``).
    head: tuple[int, int] = (-1, 0)
    head_checked: bool = False
    # The array the history is in: ``messages`` (chat), ``input`` (the Responses API)
    field: str = "messages"


@dataclass(slots=True)
class Parsed:
    """The body, and what the caller needs to remember it (``close`` is None: not rememberable)."""

    body: Any
    close: int | None
    source: BodyMemo | None = None  # the memo this body continued (None: parsed in full)
    misses: int = 0  # full parses in a row under this key
    firsts: int = 0  # for ``BodyMemo.firsts``
    marks: tuple[tuple[int, int], ...] = ()  # for ``BodyMemo.marks``
    style: int = 0  # for ``BodyMemo.style``
    # From ``source``: the bytes up to this offset, and its messages before this index
    kept: tuple[int, int] = (0, 0)
    # ``source`` sent again as it was: the counts above are the key's, kept as they were (a
    # retry had set them back, and a batch retried now and then was checked nearly every time)
    resent: bool = False
    candidates: tuple[int, ...] = ()  # for ``BodyMemo.candidates``
    head: tuple[int, int] = (-1, 0)  # for ``BodyMemo.head``
    head_checked: bool = False
    # Parsed from bytes of its own, not ``source``'s: (bytes, messages); None: all but the
    # source's bytes up to ``kept`` and its messages before it
    own: tuple[int, int] | None = None


def _splice(raw: bytes, memo: BodyMemo) -> Parsed | None:
    old = memo.raw
    close = memo.close
    if len(raw) < len(old) or close < 0:
        return None
    view = memoryview(old)
    if memo.candidates:  # not checked yet: at any of the places the messages may close
        for bracket in memo.candidates:
            at = _before_space(old, bracket)
            if raw.startswith(view[:at]) and raw.endswith(view[at:]):
                return _splice(raw, memo) if _settle(memo) else None
        return None
    if not raw.startswith(view[:close]) or not raw.endswith(view[close:]):
        return None
    marks = memo.marks
    if memo.messages and len(raw) > len(old):  # where this body's appended messages begin
        marks = (*marks, (close, len(memo.messages)))[-MARKS_KEPT:]
    return _spliced(raw, memo, close, len(memo.messages), marks)


def _resplice(raw: bytes, memo: BodyMemo) -> Parsed | None:
    """``raw`` as ``memo``'s bytes up to one of its marks (where one of its last messages
    begins), then other messages, then the same bytes after the messages: a client that moves
    a ``cache_control`` mark to its newest message each turn, taking it off the one before, or
    one that rewinds or redoes its last steps. Parsed from that mark on."""
    marks = memo.marks
    if not marks or memo.close < 0:
        return None
    old = memo.raw
    view = memoryview(old)
    tail = view[memo.close :]
    if len(raw) < marks[0][0] + len(tail) or not raw.endswith(tail):
        return None
    if not raw.startswith(view[: marks[0][0]]):  # (not even up to the earliest)
        return None
    for at, count in reversed(marks):
        if raw.startswith(view[:at]):
            if memo.candidates:  # (as in ``_splice``)
                return _resplice(raw, memo) if _settle(memo) else None
            kept = tuple(mark for mark in marks if mark[0] <= at)
            return _spliced(raw, memo, at, count, kept, scan=True)
    return None


def _spliced(
    raw: bytes,
    memo: BodyMemo,
    at: int,
    count: int,
    marks: tuple[tuple[int, int], ...],
    scan: bool = False,
) -> Parsed | None:
    """``raw`` parsed as ``memo``'s first ``count`` messages (its bytes up to ``at``), the
    messages its bytes from ``at`` hold, then the fields after ``memo``'s messages. ``scan``:
    find where the messages parsed here begin (the next turn may change one of them)."""
    new_close = len(raw) - (len(memo.raw) - memo.close)
    if new_close < at:  # the bytes kept and those after the messages overlap: not this body
        return None
    appended = _appended(raw, at, new_close, count > 0)
    if appended is None:
        return None
    messages = [*memo.messages[:count], *appended]
    style = memo.style
    if scan and appended:
        found, style = _marks(raw, at, new_close, messages, tiled=True, style=style)
        marks = (*marks, *found)[-MARKS_KEPT:]
    body = {k: (messages if k == memo.field else memo.values[k]) for k in memo.keys}
    # (where the first message after the system prompt begins is where it was, if kept)
    head, checked = (memo.head, memo.head_checked) if memo.head[1] < count else (_UNSOUGHT, False)
    return Parsed(
        body,
        new_close,
        memo,
        marks=marks,
        style=style,
        kept=(at, count),
        head=head,
        head_checked=checked,
    )


def _appended(raw: bytes, at: int, close: int, after: bool) -> list[Any] | None:
    """The messages ``raw[at:close]`` appends (a comma first, ``after`` earlier ones), [] for
    white space alone, None if those bytes are anything else."""
    middle = raw[at:close].strip(_WS)
    if not middle:
        return []
    if after:
        if middle[:1] != b",":
            return None
        middle = middle[1:]
    try:  # one valid array of values, or nothing: "[1],[2" is not one document. Wrapped at
        # the depth it has in the body, so orjson's nesting limit applies as to a full parse.
        wrapped = orjson.loads(b"[[" + middle + b"]]")
    except orjson.JSONDecodeError:
        return None
    # One array, nothing beside it: "…],[…" would close the messages early and open another
    # value. (Wrapped in an object, fields after the messages that end in an array, as
    # ``"tools":[…]}`` does, parsed as that object's other keys, and were lost.)
    if len(wrapped) != 1:
        return None
    appended: list[Any] = wrapped[0]
    if not appended:  # "," alone, or a stray "[]"-like fragment: not an append
        return None
    return appended


# How far the first message after the system prompt may have moved (the prompt or the fields
# before the messages grew or shrank by this much at most) to be looked for (``_rehead``).
_HEAD_DRIFT: Final = 16 * 1024
_HEAD_TRIES: Final = 4  # places where its first bytes are found, looked at in turn
# A key's memos tried so: the newest of each lineage (a conversation: sub-agents taking turns
# under one session id), this many; then the recent memos of other keys. Past the first few
# memos tried, only near where the bytes were (the time in a prompt moves them a few bytes):
# a body that continues none of them costs ~1 µs for each, not the ~20 of the wider search.
_OWN_REHEADS: Final = 32
_WIDE_REHEADS: Final = 4
_NEAR_DRIFT: Final = 1024


def _kept_at(raw: bytes, memo: BodyMemo, drift: int, goes_on: bool = False) -> int:
    """Where ``raw`` holds ``memo``'s bytes from where its first message after the system
    prompt begins (``memo.head``) to where its messages end, with its bytes after the messages
    at its end and messages appended between (``_rehead``); -1 if nowhere, ``_GOES_ON_AT`` if
    there but ``memo`` may not be spliced onto (unless ``goes_on``: that is known already)."""
    if memo.head == _UNSOUGHT:  # (looked for once, the first time it may serve)
        memo.head = _head_of(memo.raw, memo.close, memo.messages, memo.style)
    at, count = memo.head
    close = memo.close
    if not 0 < at < close:
        return -1
    # More than one message kept, and a reply of the model among them: another conversation
    # that opens with the same task (and context) under another system prompt (a sub-agent's
    # role) is no turn of this one, and must not share its messages (the sessions' memory
    # estimate takes a request holding the very same first message for a later turn of its
    # history). Its bytes may go on here all the same: this body is then a conversation's
    # next turn, to be kept for the one after.
    opening = count + 1 >= len(memo.messages) or _first_request(memo.messages[count:])
    if opening and goes_on:
        return -1
    view = memoryview(memo.raw)
    kept = view[at:close]
    tail = view[close:]
    stop = len(raw) - len(tail) - len(kept)  # the furthest the kept bytes may begin
    if stop < 0 or not raw.endswith(tail):
        return -1
    probe = bytes(kept[:64])
    lo, hi = max(0, at - drift), min(stop, at + drift) + len(probe)
    where = at if at <= stop and raw.startswith(probe, at) else raw.find(probe, lo, hi)
    for _ in range(_HEAD_TRIES):
        if where < 0:
            return -1
        # Nothing appended: the history again under another prompt (another conversation's
        # opening, or a retry after the time changed): not spliced, nor a turn that goes on.
        if not raw[where + len(kept) : len(raw) - len(tail)].strip(_WS):
            return -1
        if raw.startswith(kept, where):
            return _GOES_ON_AT if opening else where
        where = raw.find(probe, where + 1, hi)
    return -1


_GOES_ON_AT: Final = -2  # (``_kept_at``)


def _changed(old: bytes, at: int, raw: bytes, where: int) -> int:
    """How many bytes of ``old[:at]`` and ``raw[:where]`` differ: all but their common start and
    end (the time in a prompt: a few; another sub-agent's role: its name and more)."""
    # By halves, each step a memcmp: ``bytes.startswith``/``endswith`` of a view. (Views
    # compared with ``==`` go byte by byte through their format: ~30 times slower, ~0.3 ms a
    # call for a 12 KB system prompt, twice a turn for an agent with the time in its prompt.)
    b = memoryview(raw)
    limit = min(at, where)
    lo, hi = 0, limit
    while lo < hi:  # the common start
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if old.startswith(b[:mid]) else (lo, mid - 1)
    start = lo
    lo, hi = 0, limit - start
    while lo < hi:  # the common end, of ``old[:at]`` and ``raw[:where]``
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if old.endswith(b[where - mid : where], 0, at) else (lo, mid - 1)
    return max(at, where) - start - lo


def _rehead(raw: bytes, memo: BodyMemo, where: int, drift: int) -> Parsed | None:
    """``raw`` as other bytes, then ``memo``'s bytes from where its first message after the
    system prompt begins to where its messages end (found at ``where``, ``_kept_at``), then
    messages appended, then its bytes after the messages: a system prompt with the time in it,
    a field before the messages that changed each turn (the first bytes change, so the body is
    filed under another key; its history need not be parsed again). The other bytes are parsed
    with a null closing the messages (it must land as their last element: they end where an
    element of the messages array begins), the rest as ``_splice`` parses an append."""
    at, count = memo.head
    view = memoryview(memo.raw)
    kept = view[at : memo.close]
    tail = view[memo.close :]
    if memo.candidates or not memo.head_checked:  # (checked once, when first found again)
        if not (_settle(memo) and _check_head(memo)):
            return None
        where = _kept_at(raw, memo, drift)  # (its messages may close elsewhere)
        return _rehead(raw, memo, where, drift) if where >= 0 else None
    try:
        head = orjson.loads(raw[:where] + b"null]}")
    except orjson.JSONDecodeError:
        return None
    field = memo.field
    if not isinstance(head, dict) or next(reversed(head)) != field:
        return None
    first = head[field]
    if not isinstance(first, list) or not first or first.pop() is not None:
        return None
    # The null lands in the array of the key written last, which a parse puts at the key's
    # first place (``{"x":1,"messages":[…,null],"x":[`` put it in x's array while the
    # messages, last in order, ended in a null of their own): no other array may end in one.
    if any(type(v) is list and v and v[-1] is None for k, v in head.items() if k != field):
        return None
    after = memo.keys[memo.keys.index(field) + 1 :]
    if not head.keys().isdisjoint(after):  # (a key on both sides: the later value counts)
        return None
    end = where + len(kept)  # where the kept messages end, in ``raw``
    new_close = len(raw) - len(tail)
    appended = _appended(raw, end, new_close, True)
    if appended is None:
        return None
    messages = [*first, *memo.messages[count:], *appended]
    shift, renumber = where - at, len(first) - count
    marks = tuple((o + shift, n + renumber) for o, n in memo.marks if n > count)
    if appended:
        marks = (*marks, (end, len(messages) - len(appended)))[-MARKS_KEPT:]
    body = {k: (messages if k == field else v) for k, v in head.items()}
    for k in after:
        body[k] = memo.values[k]
    return Parsed(
        body,
        new_close,
        memo,
        marks=marks,
        style=memo.style,
        head=(where, len(first)),
        head_checked=True,
        own=(len(raw) - len(kept) - len(tail), len(first) + len(appended)),
    )


def _check_head(memo: BodyMemo) -> bool:
    """Check, once, ``memo.head`` (its ``close`` checked): its bytes from there to ``close``
    parse as one run of values, as many as its messages after ``memo.head[1]``. They then are
    those messages: the array that ``close`` closes holds them (a cut in an earlier array under
    the same key would take its end for a value's). Forgotten if not."""
    if not memo.head_checked:
        at, count = memo.head
        try:
            values = orjson.loads(b"[" + memo.raw[at : memo.close] + b"]")
        except orjson.JSONDecodeError:
            values = None
        ok = isinstance(values, list) and len(values) == len(memo.messages) - count
        memo.head, memo.head_checked = (memo.head if ok else (-1, 0)), True
    return memo.head[0] >= 0


def _go(value: Any) -> bytes:
    """Go's ``encoding/json``: compact, UTF-8, ``<``, ``>``, ``&``, U+2028 and U+2029 escaped
    (none of them appears outside a string)."""
    text = orjson.dumps(value)
    for raw, escaped in _GO_ESCAPES:
        if raw in text:
            text = text.replace(raw, escaped)
    return text


_GO_ESCAPES: Final = (
    (b"<", b"\\u003c"),
    (b">", b"\\u003e"),
    (b"&", b"\\u0026"),
    ("\u2028".encode(), b"\\u2028"),
    ("\u2029".encode(), b"\\u2029"),
)

# How clients write a message, the most common first: each must give valid JSON of the value.
_STYLES: Final = (
    orjson.dumps,  # compact, UTF-8 (most JavaScript clients; httpx >= 0.28 but for floats)
    lambda value: json.dumps(value).encode(),  # Python's defaults: ", " and ": ", ASCII escapes
    _go,
    lambda value: json.dumps(value, ensure_ascii=False).encode(),
    lambda value: json.dumps(value, separators=(",", ":")).encode(),
    # PHP's json_encode: compact, ASCII escapes, "/" escaped (only ever inside a string)
    lambda value: json.dumps(value, separators=(",", ":")).replace("/", "\\/").encode(),
    # httpx >= 0.28: as orjson but for floats (1e-07, where orjson writes 1e-7)
    lambda value: json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode(),
)
_NO_STYLE: Final = -1  # none of them wrote the last message (an indented body)
_FAST_STYLES: Final = (0, 2)  # those orjson writes


def _marks(
    raw: bytes,
    start: int,
    stop: int,
    messages: Sequence[Any],
    tiled: bool = False,
    style: int = 0,
    check: bool | None = None,
) -> tuple[tuple[tuple[int, int], ...], int]:
    """Where the last messages begin, for those that lie in ``raw[start:stop]`` (``stop``: the
    end of the last one): ``(at, n)``, ``raw[:at]`` holding messages up to ``n - 1`` and
    ``raw[at]`` the comma after it, earliest first, at most ``MARKS_KEPT``; and the style (of
    ``_STYLES``) the client writes in, ``_NO_STYLE`` when none wrote its last message.

    Each message is serialized as the client writes it (``style`` tried first: the one found
    before under the key; after ``_NO_STYLE``, a full parse tries only the forms orjson writes)
    and must be the very bytes before the position reached, a comma before them: C's speed
    over text, whatever it holds.
    A text that is valid JSON of the same value and ends where a message ends begins where it
    begins (a proper suffix of one would leave a bracket open or end inside a string), so each
    mark found from ``stop`` back is exact. Past ``_MARK_BYTES`` walked, or at a message none
    of the styles writes, it stops with what it found. With ``check`` (by default unless
    ``tiled``: a splice has just parsed these bytes), the bytes walked are parsed once more
    (``_parsed_back``)."""
    if not messages:
        return (), style
    if style == _NO_STYLE:
        # Tried again, but after a full parse only in the forms written at C's speed (a message
        # none writes, an escape of a Go before 1.22, must not end the marks for a session)
        order = list(range(len(_STYLES))) if tiled else list(_FAST_STYLES)
    else:
        order = [style, *(i for i in range(len(_STYLES)) if i != style)]
    found: list[tuple[int, int]] = []
    pos = stop
    index = len(messages) - 1
    while index >= 0 and len(found) < MARKS_KEPT and stop - pos <= _MARK_BYTES:
        for i in order:
            try:
                text = _STYLES[i](messages[index])
            except (TypeError, ValueError, RecursionError):  # (an integer past 64 bits)
                continue
            if pos - len(text) > start and raw.startswith(text, pos - len(text)):
                if i != order[0]:
                    order.remove(i)
                    order.insert(0, i)  # (the next message is most likely written alike)
                break
        else:
            if pos == stop:  # not even the last one: not written in any of these styles
                return (), _NO_STYLE
            break
        begin = pos - len(text)
        comma = begin - 1
        while comma > start and raw[comma] in _WS:
            comma -= 1
        if comma <= start or raw[comma] != 0x2C:
            break
        found.append((comma, index))
        pos = comma
        while pos > start and raw[pos - 1] in _WS:
            pos -= 1
        index -= 1
    marks = tuple(reversed(found))
    if (not tiled if check is None else check) and not _parsed_back(raw, marks, stop, messages):
        return (), order[0]
    return marks, order[0]


def _parsed_back(
    raw: bytes, marks: tuple[tuple[int, int], ...], stop: int, messages: Sequence[Any]
) -> bool:
    """The bytes from the earliest of ``marks`` to ``stop`` parse as the messages after it."""
    if not marks:
        return True
    try:
        parsed = orjson.loads(b"[" + raw[marks[0][0] + 1 : stop] + b"]")
    except orjson.JSONDecodeError:
        return False
    return len(parsed) == len(messages) - marks[0][1]


def _written(after: dict[str, Any]) -> list[bytes]:
    """``after`` as clients write it: compact (httpx >= 0.28, most JavaScript clients), with
    Python's defaults (``", "`` and ``": "``, ASCII escapes), and so on. A value nested deeper
    than orjson writes (254 levels) is written by the standard library's encoder, up to the
    depth cachegate reads (a 500 for such a body of 16 KiB or more, nothing forwarded)."""
    forms: list[bytes] = []
    with contextlib.suppress(TypeError):  # (too deep for orjson: the standard library's below)
        forms.append(orjson.dumps(after))
    for options in ({}, {"ensure_ascii": False}, {"separators": (",", ":")}):
        with contextlib.suppress(RecursionError, ValueError):
            forms.append(deep_dumps(after, **options).encode())
    return forms


def _candidates(
    raw: bytes, body: dict[str, Any], previous: BodyMemo | None, field: str = "messages"
) -> list[int]:
    keys = list(body)
    trimmed = raw.rstrip(_WS)
    out: list[int] = []
    if keys[-1] == field and trimmed.endswith(b"}"):
        inner = trimmed[:-1].rstrip(_WS)
        if inner.endswith(b"]"):
            out.append(len(inner) - 1)
    after = {k: body[k] for k in keys[keys.index(field) + 1 :]}
    if after:
        for text in _written(after):
            for sep in (b",", b", "):
                expected = b"]" + sep + text[1:]
                if trimmed.endswith(expected):
                    out.append(len(trimmed) - len(expected))
    # The previous body's tail: after this body's own fields, as it may be another body's
    # (under one key, a side request without tools ends as ``],"stream":true}`` where this
    # one's tools do), and the first candidate is the one a later body is matched at first.
    if (
        previous is not None
        and previous.close >= 0
        and not previous.candidates
        and previous.field == field
    ):
        tail = memoryview(previous.raw)[previous.close :]
        if len(raw) >= len(tail) and raw.endswith(tail):
            start = len(raw) - len(tail)
            out.append(start + (len(tail) - len(bytes(tail).lstrip(_WS))))
    if after and not out:  # another layout (indented, say): find the next key's name instead
        name = orjson.dumps(next(iter(after)))
        end = len(raw)
        for _ in range(2):
            at = raw.rfind(name, 0, end)
            if at < 0:
                break
            i = at
            while i > 0 and raw[i - 1] in _WS:
                i -= 1
            if raw[i - 1 : i] == b",":
                i -= 1
                while i > 0 and raw[i - 1] in _WS:
                    i -= 1
                if raw[i - 1 : i] == b"]":
                    out.append(i - 1)
            end = at
    return list(dict.fromkeys(out))  # each candidate once, in order


def _verify(raw: bytes, body: dict[str, Any], close: int, field: str = "messages") -> bool:
    """``raw[close]`` closes the array that is ``body[field]``: cut there, both halves parse
    back to exactly ``body``, key order included."""
    if not 0 < close < len(raw) or raw[close : close + 1] != b"]":
        return False
    rest = raw[close + 1 :].lstrip(_WS)
    if rest[:1] == b",":
        rest = b"{" + rest[1:]
    elif rest[:1] == b"}":
        rest = b"{" + rest
    else:
        return False
    try:
        # A null closes the array cut at ``close``: it must land in the messages (with a key
        # that comes twice, ``{"tools":[…],"messages":[…],"tools":[…]}``, the cut may be in the
        # other array, and a parse keeps the key's first place).
        head = orjson.loads(raw[:close] + b",null]}")
        tail = orjson.loads(rest)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(head, dict) or not isinstance(tail, dict) or not head:
        return False
    messages = head.get(field)
    if not isinstance(messages, list) or not messages or messages.pop() is not None:
        return False
    if list(head)[-1] != field or not set(head).isdisjoint(tail):
        return False
    if [*head, *tail] != list(body):
        return False
    try:  # (a body nested as deep as cachegate reads: its next turn was a 500)
        return deep_call(operator.eq, {**head, **tail}, body)
    except RecursionError:
        return False


def parse(
    raw: bytes,
    memos: list[BodyMemo],
    others: Sequence[BodyMemo] | Callable[[], Sequence[BodyMemo]] = (),
    field: str = "messages",
) -> Parsed:
    """Parse ``raw``, splicing onto the first memo it continues; failing that, onto one of
    ``memos`` or ``others`` (recent memos of other keys, or what gives them, called only then)
    whose bytes it holds after other first bytes (``_rehead``). ``field``: the array the history
    is in (``messages``; a Responses API request's ``input``), that of every memo given. Raises
    ``orjson.JSONDecodeError``."""
    if not memos and not others and len(raw) < MIN_BYTES:  # (what the end below returns)
        return Parsed(orjson.loads(raw), None)
    for memo in memos:
        spliced = _splice(raw, memo)
        if spliced is not None:
            if len(raw) == len(memo.raw):  # the same bytes again (a retry): no sign either way
                head = memos[0]
                return dataclasses.replace(
                    spliced, misses=head.misses, firsts=head.firsts, resent=True
                )
            return spliced
    for memo in memos:
        spliced = _resplice(raw, memo)
        if spliced is not None:
            return spliced
    lineages: dict[int, BodyMemo] = {}  # (the newest of each: the memos come newest first)
    before: list[BodyMemo] = []  # the one before the newest, of the newest (a step redone)
    for memo in memos:
        lineage = memo.lineage or id(memo)  # (0: not filed, its own)
        if lineage not in lineages:
            if len(lineages) >= _OWN_REHEADS:
                break
            lineages[lineage] = memo
        elif not before and memo is not lineages[lineage] and len(lineages) == 1:
            before.append(memo)
    if callable(others):
        others = others()
    # Every memo whose bytes it holds, the one whose bytes before them differ least first:
    # sub-agents whose openings are the same (a few-shot example, a parent's history) under
    # role prompts of their own each go on from their own, not from the newest.
    goes_on = False
    found: list[tuple[int, int, BodyMemo, int, int]] = []
    for i, memo in enumerate((*lineages.values(), *before, *others)):
        drift = _NEAR_DRIFT if i >= _WIDE_REHEADS else _HEAD_DRIFT
        where = _kept_at(raw, memo, drift, goes_on)
        if where == _GOES_ON_AT:
            goes_on = True
        elif where >= 0:
            found.append((0, i, memo, where, drift))
    if len(found) > 1:
        found = sorted((_changed(m.raw, m.head[0], raw, w), i, m, w, d) for _, i, m, w, d in found)
    for _, _, memo, where, drift in found:
        spliced = _rehead(raw, memo, where, drift)
        if spliced is not None:
            return spliced
    body = orjson.loads(raw)
    previous = memos[0] if memos else None
    misses = previous.misses + 1 if previous is not None else 0
    firsts = previous.firsts if previous is not None else 0
    if len(raw) < MIN_BYTES or not isinstance(body, dict) or not isinstance(body.get(field), list):
        return Parsed(body, None, None, misses, firsts)
    if misses > _MAX_MISSES and misses % 16 and not goes_on:
        # This client's bodies do not continue each other: remember only now and then, but for
        # the first requests of new conversations, a key's worth of them (sub-agents fanned
        # out after a dozen others, or after a main agent whose system prompt has the time
        # in it, were no longer remembered, and their next turns were parsed whole). One-shot
        # requests (a batch) back off once past them; a history trimmed at its start is no
        # first request. A body that goes on past a memo's opening under another prompt is
        # remembered too: its next turn continues it (sub-agents under one id, the time in
        # their prompts, each second turn a full parse, had every later turn parsed whole).
        if firsts >= _FIRSTS_REMEMBERED or not _first_request(body[field]):
            return Parsed(body, None, None, misses, firsts)
        firsts += 1
    candidates = _candidates(raw, body, previous, field)
    if not candidates or not body[field]:
        return Parsed(body, None, None, misses, firsts)
    # Kept unchecked: where the layout says the messages close, and where the last of them
    # begin there. A later body that continues it there has it checked first (``_settle``).
    close = _before_space(raw, candidates[0])
    style = previous.style if previous is not None else 0
    marks, style = _marks(raw, 0, close, body[field], style=style, check=False)
    return Parsed(
        body,
        close,
        None,
        misses,
        firsts,
        marks,
        style,
        candidates=tuple(candidates),
        head=_UNSOUGHT,
    )


_UNSOUGHT: Final = (-2, 0)  # ``BodyMemo.head`` not looked for yet


def _head_of(raw: bytes, close: int, messages: Sequence[Any], style: int) -> tuple[int, int]:
    """Where the first message after the system prompt may begin (``BodyMemo.head``, not
    checked): its first place as the client writes it (that message serialized, its first
    bytes looked for, the rest compared), else (-1, 0)."""
    count = leading_system_count(messages)
    if count >= len(messages) or style == _NO_STYLE:
        return (-1, 0)
    try:
        text = _STYLES[style](messages[count])
    except (TypeError, ValueError, RecursionError):  # (an integer past 64 bits)
        return (-1, 0)
    probe = text[:64]
    at = raw.find(probe, 0, close)
    for _ in range(_HEAD_TRIES):
        if at <= 0:
            break
        if raw.startswith(text, at):
            return (at, count)
        at = raw.find(probe, at + 1, close)
    return (-1, 0)


def _before_space(raw: bytes, bracket: int) -> int:
    """The cut before the whitespace that precedes "]": an appended message follows the last
    one directly ("},\n  {"), not that whitespace."""
    close = bracket
    while close > 0 and raw[close - 1] in _WS:
        close -= 1
    return close


def _settle(memo: BodyMemo) -> bool:
    """Check, once, where ``memo``'s messages close (the first of its candidates that does) and
    that its bytes from its earliest mark on hold its last messages; record the result in
    ``memo`` (-1 if none closes them). Whether it can be spliced onto."""
    if memo.candidates:
        field = memo.field
        body = {k: (list(memo.messages) if k == field else memo.values[k]) for k in memo.keys}
        close = -1
        marks: tuple[tuple[int, int], ...] = ()
        for bracket in memo.candidates:
            if _verify(memo.raw, body, bracket, field):
                close = _before_space(memo.raw, bracket)
                if close == memo.close:
                    if _parsed_back(memo.raw, memo.marks, close, memo.messages):
                        marks = memo.marks
                else:  # (the style found at the wrong place is no sign)
                    style = 0 if memo.style == _NO_STYLE else memo.style
                    marks, memo.style = _marks(memo.raw, 0, close, memo.messages, style=style)
                break
        memo.close, memo.marks, memo.candidates = close, marks, ()
    return memo.close >= 0


def _first_request(messages: Sequence[Any]) -> bool:
    """Whether ``messages`` hold nothing from the model yet: a conversation's first request.
    (A Responses API request's items: no assistant message, and no item the model made, its
    calls and reasoning; the client's are its messages, the outputs and references.)"""
    for m in messages:
        if isinstance(m, dict):
            if m.get("role") == "assistant":
                return False
            kind = m.get("type")
            if isinstance(kind, str) and kind not in _CLIENT_ITEMS and not kind.endswith("_output"):
                return False
    return True


_CLIENT_ITEMS: Final = frozenset({"message", "item_reference"})


def memo_key(raw: bytes, session_id: str | None, field: str = "messages") -> str:
    """Where a body's memo is filed: its explicit session, else the hash of its first
    ``MIN_BYTES`` (a system prompt, the tools and the task, which later turns resend); a
    Responses API request's (``field`` ``input``) apart from a chat request's.

    Python's own hash of the bytes (~5 us for 16 KiB, where a BLAKE2b digest took ~22): the key
    lives in this process only, and the hash's key is the process's own. Two openings that
    hashed alike would only share a list of candidates: a body is spliced onto a memo only
    where its bytes are that memo's."""
    kind = "" if field == "messages" else "r"
    if session_id is not None:
        return f"{kind}s:{session_id}"
    return f"{kind}h:{hash(raw[:MIN_BYTES]):x}"


def by_first_bytes(key: str) -> bool:
    """Whether ``key`` (``memo_key``'s) files a body by its first bytes, not by its session."""
    return key.startswith(("h:", "rh:"))


class BodyMemos:
    """Recent memos by key, least recently used evicted first, bounded by the raw bytes they hold
    (the objects parsed from them take about three times as much again) and, with ``idle_s``,
    forgotten once no body was filed under their key for that long (as sessions are: an idle
    proxy holds none of its agents' bodies)."""

    def __init__(self, max_bytes: int = 128 * 1024 * 1024, idle_s: float = 0.0) -> None:
        self.max_bytes = max_bytes
        self.idle_s = idle_s
        self._memos: OrderedDict[str, list[BodyMemo]] = OrderedDict()
        self._filed: dict[str, float] = {}  # when a key last had a memo filed
        self._bytes = 0
        self._lineages = 0
        # The memos filed last that have a ``head``, newest first (weak: what the memos let go
        # is not kept here): a body under a key of its own may continue one of them past other
        # first bytes (``_rehead``).
        self._recent: deque[weakref.ref[BodyMemo]] = deque(maxlen=RECENT_KEPT)

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> list[BodyMemo]:
        memos = self._memos.get(key)
        if memos is None:
            return []
        self._memos.move_to_end(key)
        return list(memos)

    def put(
        self, key: str, memo: BodyMemo, source: BodyMemo | None = None, now: float = 0.0
    ) -> BodyMemo:
        """File ``memo`` first under ``key`` at ``now``; the memo filed (a copy). With ``source``
        (the memo it continued), the lineage keeps just those two: the newest turn, and the one
        before it for a retry or a regeneration from there. A resend of the same bytes replaces
        its source."""
        self.forget_idle(now)
        memos = self._memos.setdefault(key, [])
        self._memos.move_to_end(key)
        self._filed[key] = now
        if source is None:
            self._lineages += 1
            lineage = self._lineages
        else:
            lineage = source.lineage
            identical = len(source.raw) == len(memo.raw)
            for old in [m for m in memos if m.lineage == lineage]:
                if old is not source or identical:
                    memos.remove(old)
                    self._bytes -= len(old.raw)
        filed = dataclasses.replace(memo, lineage=lineage)
        memos.insert(0, filed)
        if filed.head[0] != -1:  # (one, or one not looked for yet)
            self._recent.appendleft(weakref.ref(filed))
        self._bytes += len(filed.raw)
        while len(memos) > MEMOS_PER_KEY:
            self._bytes -= len(memos.pop().raw)
        while self._bytes > self.max_bytes:
            oldest = next(iter(self._memos))
            if oldest != key:  # other keys first, least recently used first
                self._drop(oldest)
                continue
            self._bytes -= len(memos.pop().raw)  # then this key's oldest memos
            if not memos:
                self._drop(key)
                break
        return filed

    def recent(self, besides: Sequence[BodyMemo] = (), field: str = "messages") -> list[BodyMemo]:
        """The memos filed last that may be continued past other first bytes, newest first,
        but for ``besides`` (those of the body's own key, tried already); of bodies whose
        history is in ``field``."""
        out: list[BodyMemo] = []
        seen = set(map(id, besides))
        for ref in self._recent:
            memo = ref()
            if (
                memo is not None
                and memo.head[0] != -1
                and memo.field == field
                and id(memo) not in seen
            ):
                seen.add(id(memo))
                out.append(memo)
        return out

    def forget(self, key: str) -> None:
        """Forget every memo filed under ``key`` (its session was forgotten)."""
        if key in self._memos:
            self._drop(key)

    def discard(self, key: str, memo: BodyMemo) -> None:
        """Forget ``memo`` (that very object) if it is still filed under ``key``."""
        memos = self._memos.get(key)
        if memos is None:
            return
        for i, kept in enumerate(memos):
            if kept is memo:
                del memos[i]
                self._bytes -= len(memo.raw)
                if not memos:
                    self._drop(key)
                return

    def touch(self, key: str, now: float) -> None:
        """A request that filed under ``key`` ended at ``now``: its bodies age from then, as
        its session does (an answer longer than ``idle_s`` left them as much in use)."""
        if key in self._memos and now > self._filed.get(key, now):
            self._filed[key] = now
            self._memos.move_to_end(key)

    def forget_idle(self, now: float) -> None:
        """Forget the memos of keys with none filed in the last ``idle_s`` (none when 0)."""
        if not self.idle_s:
            return
        while self._memos:
            oldest = next(iter(self._memos))
            if now - self._filed.get(oldest, now) <= self.idle_s:
                break  # (least recently used first: the rest were used since)
            self._drop(oldest)

    def _drop(self, key: str) -> None:
        self._bytes -= sum(len(m.raw) for m in self._memos.pop(key))
        self._filed.pop(key, None)

    def note_miss(self, key: str, misses: int, firsts: int = 0) -> None:
        """A full parse under ``key`` that continued no memo: remember the counts on the newest."""
        memos = self._memos.get(key)
        if memos:
            memos[0].misses, memos[0].firsts = misses, firsts
