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
it parse back to exactly the same body. Anything unexpected falls back to a full parse.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

_WS = b" \t\r\n"
MIN_BYTES = 16 * 1024  # smaller bodies parse in microseconds: not worth remembering
# Sessions whose bodies open with the same bytes (one agent, several tasks), or conversations of
# one session: two memos each (``BodyMemos.put``), for as many as the session keeps
# (``sessions.CONVERSATIONS_KEPT``). Eight let four sub-agents taking turns splice, not five.
MEMOS_PER_KEY = 64
_MAX_MISSES = 3  # full parses in a row whose bytes did not continue the memo: stop verifying


@dataclass(frozen=True)
class BodyMemo:
    """One parsed body and where its messages array closes."""

    raw: bytes
    close: int  # where the last message ends: only whitespace, then the "]" closing ``messages``
    keys: tuple[str, ...]  # the body's keys, in order
    values: dict[str, Any]  # every field but ``messages``, as parsed
    messages: tuple[Any, ...]  # the message objects the caller kept (shared across turns)
    misses: int = 0
    lineage: int = 0  # memos that continue one another share it (set by ``BodyMemos.put``)
    continued: bool = False  # it continued another (set by ``BodyMemos.put``)


@dataclass(frozen=True)
class Parsed:
    """The body, and what the caller needs to remember it (``close`` is None: not rememberable)."""

    body: Any
    close: int | None
    source: BodyMemo | None = None  # the memo this body continued (None: parsed in full)
    misses: int = 0  # full parses in a row under this key


def _splice(raw: bytes, memo: BodyMemo) -> Parsed | None:
    old = memo.raw
    close = memo.close
    if len(raw) < len(old):
        return None
    view = memoryview(old)
    if not raw.startswith(view[:close]) or not raw.endswith(view[close:]):
        return None
    new_close = len(raw) - (len(old) - close)
    middle = raw[close:new_close].strip(_WS)
    appended: list[Any] = []
    if middle:
        if memo.messages:
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
        appended = wrapped[0]
        if not appended:  # "," alone, or a stray "[]"-like fragment: not an append
            return None
    messages = [*memo.messages, *appended]
    body = {k: (messages if k == "messages" else memo.values[k]) for k in memo.keys}
    return Parsed(body, new_close, memo)


def _candidates(raw: bytes, body: dict[str, Any], previous: BodyMemo | None) -> list[int]:
    keys = list(body)
    trimmed = raw.rstrip(_WS)
    out: list[int] = []
    if keys[-1] == "messages" and trimmed.endswith(b"}"):
        inner = trimmed[:-1].rstrip(_WS)
        if inner.endswith(b"]"):
            out.append(len(inner) - 1)
    if previous is not None:
        tail = memoryview(previous.raw)[previous.close :]
        if len(raw) >= len(tail) and raw.endswith(tail):
            start = len(raw) - len(tail)
            out.append(start + (len(tail) - len(bytes(tail).lstrip(_WS))))
    after = {k: body[k] for k in keys[keys.index("messages") + 1 :]}
    if after:
        for text in (
            orjson.dumps(after),  # compact (httpx >= 0.28, most JavaScript clients)
            json.dumps(after).encode(),  # Python's defaults: ", " and ": ", ASCII escapes
            json.dumps(after, ensure_ascii=False).encode(),
            json.dumps(after, separators=(",", ":")).encode(),
        ):
            for sep in (b",", b", "):
                expected = b"]" + sep + text[1:]
                if trimmed.endswith(expected):
                    out.append(len(trimmed) - len(expected))
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


def _verify(raw: bytes, body: dict[str, Any], close: int) -> bool:
    """``raw[close]`` closes the array that is ``body["messages"]``: cut there, both halves parse
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
    messages = head.get("messages")
    if not isinstance(messages, list) or not messages or messages.pop() is not None:
        return False
    if list(head)[-1] != "messages" or not set(head).isdisjoint(tail):
        return False
    return [*head, *tail] == list(body) and {**head, **tail} == body


def parse(raw: bytes, memos: list[BodyMemo]) -> Parsed:
    """Parse ``raw``, splicing onto the first memo it continues. Raises ``orjson.JSONDecodeError``."""
    for memo in memos:
        spliced = _splice(raw, memo)
        if spliced is not None:
            return spliced
    body = orjson.loads(raw)
    previous = memos[0] if memos else None
    misses = _misses(body, memos)
    if (
        len(raw) < MIN_BYTES
        or not isinstance(body, dict)
        or not isinstance(body.get("messages"), list)
        # This client's bodies do not continue each other: verify only now and then.
        or (misses > _MAX_MISSES and misses % 16)
    ):
        return Parsed(body, None, None, misses)
    for bracket in _candidates(raw, body, previous):
        if _verify(raw, body, bracket):
            # Remember the cut before the whitespace that precedes "]": an appended message
            # follows the last one directly ("},\n  {"), not that whitespace.
            close = bracket
            while close > 0 and raw[close - 1] in _WS:
                close -= 1
            return Parsed(body, close, None, misses)
    return Parsed(body, None, None, misses)


def _misses(body: Any, memos: list[BodyMemo]) -> int:
    """Full parses in a row under a key, with this one, of bodies that should have continued a
    memo: of a conversation one holds (the same opening message) or not a conversation at all.
    The first body of a new conversation counts for nothing (sub-agents fanned out under one
    session id start a dozen at once, and each was counted: past three, the others' bodies were
    no longer remembered, so their next turns were parsed whole), unless the key holds its full
    number of memos and none was ever continued (one-shot requests: a batch)."""
    if not memos:
        return 0
    misses = memos[0].misses
    messages = body.get("messages") if isinstance(body, dict) else None
    opening = _opening(messages) if isinstance(messages, list) else None
    if opening is None or any(_opening(memo.messages) == opening for memo in memos):
        return misses + 1
    if len(memos) >= MEMOS_PER_KEY and not any(memo.continued for memo in memos):
        return misses + 1
    return misses


def _opening(messages: Sequence[Any]) -> Any:
    """A history's first message after its system block (None: none): what its conversation
    keeps from turn to turn."""
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
            return message
    return None


def memo_key(raw: bytes, session_id: str | None) -> str:
    """Where a body's memo is filed: its explicit session, else the digest of its first
    ``MIN_BYTES`` (a system prompt, the tools and the task, which later turns resend)."""
    if session_id is not None:
        return "s:" + session_id
    return "h:" + hashlib.blake2b(raw[:MIN_BYTES], digest_size=16).hexdigest()


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
    ) -> None:
        """File ``memo`` first under ``key`` at ``now``. With ``source`` (the memo it continued),
        the lineage keeps just those two: the newest turn, and the one before it for a retry or
        a regeneration from there. A resend of the same bytes replaces its source."""
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
        memo = dataclasses.replace(memo, lineage=lineage, continued=source is not None)
        memos.insert(0, memo)
        self._bytes += len(memo.raw)
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

    def note_miss(self, key: str, misses: int) -> None:
        """A full parse under ``key`` that continued no memo: remember the count on the newest."""
        memos = self._memos.get(key)
        if memos:
            first = memos[0]
            memos[0] = dataclasses.replace(first, misses=misses)
