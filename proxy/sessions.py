"""Session identity and per-session state, behind a small store interface.

A request's session is, in order: an explicit id (``X-Session-Id``, the ``/s/{id}/v1`` path, or a
session header that popular agents and gateways already send); else the session whose previous
request this one's history extends (same opening message, longest shared message prefix, most recent
on a tie); else a new session.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import operator
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

import orjson

from proxy.prefix import (
    canonical_json,
    canonical_message,
    leading_run,
    leading_system_count,
    same_as_sent,
    same_json,
    single_text,
)
from proxy.redact import (
    SCHEMED_KEY_HEADERS,
    credential_keys,
    holds_key,
    known_secrets,
    query_keys,
    redact_text,
)

log = logging.getLogger(__name__)

SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")

# X-Session-Id (cachegate's own, strict), then the headers other agents and gateways already
# send, honoured in this order when their value is an id (``explicit_session_id`` relies on
# X-Session-Id coming first).
SESSION_HEADERS: tuple[str, ...] = (
    "x-session-id",
    "x-claude-code-session-id",
    "x-litellm-session-id",
    "helicone-session-id",
    "x-portkey-trace-id",
    "langfuse-session-id",
    "session_id",  # OpenAI's Codex CLI: its session's UUID, on every request
)


# On Windows a ``:`` in a file name names a drive (``D:x`` is outside the log directory) or an
# alternate data stream, and a device's name (``CON``, ``NUL``, ``COM1``, also with an extension)
# is no file: such ids name no log file there.
WINDOWS_FILE_NAMES: bool = os.name == "nt"
_WINDOWS_DEVICE = re.compile(r"(?i)(?:CON|PRN|AUX|NUL|COM[0-9]|LPT[0-9])(?:\..*)?")


def valid_session_id(value: object) -> bool:
    """True for ids that can safely name a log file (``.`` and ``..`` are never ids; on Windows,
    nor ids with a ``:`` or a device's name)."""
    if not isinstance(value, str) or SESSION_ID_RE.fullmatch(value) is None:
        return False
    if value in {".", ".."}:
        return False
    return not WINDOWS_FILE_NAMES or (":" not in value and not _WINDOWS_DEVICE.fullmatch(value))


def explicit_session_id(headers: Mapping[str, str], path_id: str | None) -> str | None:
    """The id the client named, if any. The path's id and ``X-Session-Id`` (cachegate's own ways
    to name a session) must be acceptable ids: ``ValueError`` otherwise. The other tools' headers
    are honoured when their value is an acceptable id and passed over when it is not (the next
    one is tried, then inference): a tracing tool's id need not fit a file name, and refusing it
    would break a request that works without cachegate. An id that reads as a key (one a client
    put there by mistake: ``sk-…``, ``AKIA…``) names no session: its log file's name, ``sessions
    list`` and every metric would show it, where the log's lines have it redacted."""
    if path_id is not None:
        if not valid_session_id(path_id):
            raise ValueError(_invalid("path"))
        if reads_as_key(path_id) or is_own_key(path_id, headers):
            raise ValueError(_secret_said("path"))
        return path_id
    if headers.keys().isdisjoint(SESSION_HEADERS):  # the usual answer, in one call
        return None
    own = headers.get("x-session-id")
    if own is not None:
        if not valid_session_id(own):
            raise ValueError(_invalid("x-session-id"))
        if reads_as_key(own) or is_own_key(own, headers):
            raise ValueError(_secret_said("x-session-id"))
        return own
    for name in SESSION_HEADERS[1:]:
        value = headers.get(name)
        if (
            value is not None
            and valid_session_id(value)
            and not reads_as_key(value)
            and not is_own_key(value, headers)
        ):
            return value
    return None


class RequestHeaders(dict[str, str]):
    """A request's headers by lower-case name (``chat.header_map``), with its query string
    (``query``, set once made: a constructor of its own took half as long again as the dict):
    a key may be sent there too (``?key=``: ``redact.query_keys``)."""

    __slots__ = ("query",)
    query: bytes


def is_own_key(value: str, headers: Mapping[str, str]) -> bool:
    """Whether ``value`` holds a key the request itself is sent with, or cachegate's own
    (``never_an_id``): a key of no family the redaction knows (``gw-…``), which the log takes
    out as the client's own, but a file's name would show. The keys are those the log's lines
    never hold (``observers.client_keys``, ``redact.query_keys``): in a credential header or a
    gateway's, alone or after its scheme (``Bearer``, then a space or a tab), ``Basic``'s user
    and password, and in the query's key parameters; whole, or ``KEY_PIECE`` characters of its
    start or end (``holds_key``), which the log takes out too."""
    for name in KEY_HEADERS:
        sent = headers.get(name)
        if sent and holds_key(
            value, known_secrets(credential_keys(name in SCHEMED_KEY_HEADERS, sent))
        ):
            return True
    query = getattr(headers, "query", b"") if isinstance(headers, RequestHeaders) else b""
    if query and holds_key(value, known_secrets(query_keys(query))):
        return True
    return holds_key(value, _own_keys)


# cachegate's own upstream keys (``never_an_id``), never a session's id
_own_keys: set[str] = set()


def never_an_id(key: str) -> None:
    """``key`` (cachegate's own, added to requests without one) names no session: an id that
    holds it is refused as one that reads as a key."""
    _own_keys.update(known_secrets((key,)))


def reads_as_key(value: str) -> bool:
    """Whether a session id reads as a key: the log's redaction takes something out of it (~1
    µs on a short text). Of its generic ``sk-`` pattern's matches, only one shaped like a key
    is taken (``sk_key_shaped``: ``sk-learn-pipeline-debugging``,
    ``eval_sk-learn_regression_2024_run_07`` are names); any other family's match (``hf_…``,
    ``glpat-…``, ``AKIA…``) is a key whatever its letters."""
    return redact_text(value) != value


def _secret_said(source: str) -> str:
    return (
        f"Invalid session id in {source}: it reads as an API key or another secret, and a session"
        " id names its log file; cachegate writes no key anywhere"
    )


def _invalid(source: str) -> str:
    return (
        f"Invalid session id in {source}: ids must match [A-Za-z0-9._:-]{{1,128}} "
        "(and not be '.' or '..')"
    )


_stamp: tuple[int, str] = (-1, "")  # the last second formatted, and its text


class _IdBits:
    """Unpredictable id suffixes without a system call: a keyed BLAKE2b of a counter (a
    pseudorandom function: without the key, one suffix tells nothing of another). The key comes
    from ``os.urandom`` once per process, again in a forked child.

    ``os.urandom`` per id releases the GIL for its system call, and the event loop then waited up
    to the interpreter's switch interval (5 ms) whenever the log writer thread took the GIL
    meanwhile: at 32 new sessions in flight the mean time before forwarding went from ~60 to
    ~150 µs."""

    def __init__(self) -> None:
        self.reseed()

    def reseed(self) -> None:
        self._key = os.urandom(32)
        self._count = itertools.count()

    def take(self) -> str:
        counter = next(self._count).to_bytes(8, "little")
        return hashlib.blake2b(counter, key=self._key, digest_size=4).hexdigest()


_id_bits = _IdBits()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_id_bits.reseed)


def new_session_id(now: float) -> str:
    """A fresh id that sorts by creation time: ``YYYYmmdd-HHMMSS-<8 hex>``, the hex digits
    unpredictable (``_IdBits``; a thousand sessions starting in one second share the formatting
    of that second)."""
    global _stamp
    second = int(now)
    if _stamp[0] != second:
        _stamp = (second, time.strftime("%Y%m%d-%H%M%S", time.gmtime(second)))
    return f"{_stamp[1]}-{_id_bits.take()}"


# Conversations of one session kept track of (a main agent, its sub-agents, title requests):
# the accounting's baselines, the event log's delta bases and tools arrays, the compactions,
# one each. Past them, conversations taking turns push one another out and each turn reads as
# a new conversation: eight was passed by nine sub-agents working at once.
CONVERSATIONS_KEPT: Final = 32

OpeningKey = tuple[str, str] | str

# The client's own credential, where it sends one: a request sent under another key is another
# user's (a provider's cache is per organisation), never a turn of a session inferred for the
# first. Only a keyed hash of it is kept, in memory, never written: Python's own string hash
# (SipHash, keyed by a secret drawn at start-up), ~0.1 µs where a BLAKE2b digest took ~1.3.
CredentialTag = int
CREDENTIAL_HEADERS: Final = ("authorization", "api-key", "x-api-key", "x-goog-api-key")
# Those that carry a client's key for a gateway between cachegate and the provider (Helicone's,
# Portkey's, Cloudflare AI Gateway's): not the provider's key (cachegate still adds its own
# beside them), but the client's all the same, never to be written in the log nor name a file.
GATEWAY_KEY_HEADERS: Final = ("helicone-auth", "x-portkey-api-key", "cf-aig-authorization")
KEY_HEADERS: Final = (*CREDENTIAL_HEADERS, *GATEWAY_KEY_HEADERS)


def credential_tag(headers: Mapping[str, str]) -> CredentialTag | None:
    """A keyed hash of the credential headers ``headers`` carry (lower-case names:
    ``authorization``, ``api-key``, ``x-api-key``, ``x-goog-api-key``), or None when there are
    none (cachegate adds its own key: every such client is one)."""
    auth = headers.get("authorization")
    others = (headers.get("api-key"), headers.get("x-api-key"), headers.get("x-goog-api-key"))
    if others == (None, None, None):
        return hash(auth) if auth else None
    if not auth and not any(others):
        return None
    return hash((auth, *others))


_SYSTEM_ROLES = ("system", "developer")  # messages before the opening one


def opening_key(messages: Sequence[Any]) -> OpeningKey | None:
    """The first non-system message, as a key: what a conversation starts with and keeps.

    A plain ``{"role", "content"}`` message with text content is keyed by those two strings (a
    dict lookup then hashes the text once, where a digest would serialize and hash it first);
    any other message by a digest of its canonical form (``canonical_message``: a
    ``cache_control`` marker the client moves on to a later message the next turn, or a null
    field, changes no key). Equal keys mean equal messages.
    """
    for message in messages:
        if isinstance(message, dict) and message.get("role") not in _SYSTEM_ROLES:
            role, content = message.get("role"), message.get("content")
            if len(message) == 2 and type(role) is str and type(content) is str:
                return (role, content)
            # A marker, a null field: keyed as the message they leave; a Responses API message
            # item (its ``type``, one ``input_text`` part) as the plain message it stands for,
            # as a one-string ``input`` is indexed (``index``'s ``opening``)
            canonical = _plain_item(canonical_message(message))
            role, content = canonical.get("role"), canonical.get("content")
            if len(canonical) == 2 and type(role) is str and type(content) is str:
                return (role, content)
            try:  # (canonical_json: content nested deeper than orjson writes, 254 levels)
                return hashlib.blake2b(canonical_json(canonical), digest_size=16).hexdigest()
            except RecursionError:  # past what even the standard library writes: no key
                return None
    return None


def _plain_item(message: dict[str, Any]) -> dict[str, Any]:
    """A Responses API message item (``canonical_message``'s) as a chat message: without its
    ``"type": "message"``, one ``input_text`` part as its text."""
    if message.get("type") == "message":
        message = {k: v for k, v in message.items() if k != "type"}
    text = single_text(message.get("content"), "input_text")
    return message if text is None else {**message, "content": text}


def _same_opening(old: Sequence[Any], new: Sequence[Any]) -> bool:
    """Whether ``new`` starts with the very objects of ``old`` up to its first non-system message
    (so both have the same ``opening_key``, without hashing it again)."""
    for i, message in enumerate(new):
        if i >= len(old) or old[i] is not message:
            return False
        if not isinstance(message, dict) or message.get("role") not in _SYSTEM_ROLES:
            return isinstance(message, dict)
    return False


def shared_prefix(
    old: Sequence[Any], new: Sequence[Any], dumps: tuple[bytes | None, bytes | None] = (None, None)
) -> int:
    """How many leading messages two lists share: the same JSON, number types included (``1``,
    ``1.0`` and ``true`` are equal to Python; a history that shared an old message in place of
    its edit logged and re-sent the old one), in any key order (a client whose serializer orders
    keys anew each turn still shares its history, or the log would grow with its square).
    ``dumps``: the two lists' compact JSON (``dump_items``), when known: a list that carries the
    other on whole is told from them at once (a Responses API request's items, parsed anew each
    turn: their serializations were compared, and the two lists, each turn)."""
    old_dump, new_dump = dumps
    if old_dump is not None and new_dump is not None and old and len(old) <= len(new):
        # (JSON values delimit themselves: the same bytes up to a comma are the same items)
        end = len(old_dump) - 1
        if new_dump[end : end + 1] in (b",", b"]") and new_dump.startswith(old_dump[:end]):
            return len(old)
    n = min(len(old), len(new))
    # The leading run of the very same objects (a spliced or shared history) is found at C speed.
    i = leading_run(operator.is_, old, new)
    # Then the rest at once, where it is the same as sent (a body parsed in full: its first bytes
    # changed): two serializations, not two sorted ones per message.
    if n - i > 1 and same_as_sent(old[i:n], new[i:n]):
        return n
    while i < n and (old[i] is new[i] or same_json(old[i], new[i])):
        i += 1
    return i


ItemsDump = bytes  # (a name of its own: the store's ``bytes`` property hides the type there)


def dump_items(items: Sequence[Any]) -> ItemsDump | None:
    """``items``' compact JSON for ``shared_prefix``; None where orjson cannot write it (nested
    past its 254 levels, an integer beyond 64 bits)."""
    try:
        return orjson.dumps(items)
    except TypeError:
        return None


REALIGN_PROBES: Final = 16  # the last messages of ``new`` looked at for ``old``'s last one


def realigned(old: Sequence[Any], new: Sequence[Any], shared: int) -> tuple[int, int, int]:
    """Where two histories that part after their first ``shared`` messages meet again: ``(q,
    r, n)``, ``new[q:q + n]`` the same JSON as ``old[r:r + n]`` (``n`` 0: they do not), past
    both system blocks and the parting. ``old``'s last message is looked for among ``new``'s
    last few (what a turn appended comes after it, maybe that message again: the longest run
    is taken), then the run is followed back. A system prompt with the time in it (the history
    after it unchanged), a history trimmed at its start or cut in its middle (a client's
    truncation near the context limit), a message edited: each keeps the messages after the
    change. Tried first: where both system blocks end (a changed system prompt, the history
    after it maybe rewound: a run that need not reach ``old``'s end). A turn that appended
    ``REALIGN_PROBES`` messages or more is not found again."""
    if shared >= len(old) or shared >= len(new):
        return shared, shared, 0
    start = max(shared, leading_system_count(new))
    since = max(shared, leading_system_count(old))
    if start >= len(new) or since >= len(old):
        return start, shared, 0
    aligned = shared_prefix(old[since:], new[start:])  # (a changed system block, rewound too)
    if since + aligned == len(old):
        return (start, since, aligned) if aligned else (start, shared, 0)
    last = old[-1]
    best, at = aligned, -1
    for e in range(len(new) - 1, max(start, len(new) - REALIGN_PROBES) - 1, -1):
        if new[e] is last or same_json(new[e], last):
            n = 1
            while (
                e - n >= start
                and len(old) - 1 - n >= since
                and (new[e - n] is old[-1 - n] or same_json(new[e - n], old[-1 - n]))
            ):
                n += 1
            if n > best:
                best, at = n, e
                if e - n < start or len(old) - 1 - n < since:
                    break  # (back to the parting: none is longer)
            # else: the same message again (a "continue" the turn appended): looked further
    if at >= 0:
        return at - best + 1, len(old) - best, best
    return (start, since, aligned) if aligned else (start, shared, 0)


@dataclass
class SessionState:
    """Everything cachegate keeps about one session between requests."""

    id: str
    created: float
    last_seen: float
    exchanges: int = 0
    meta_written: bool = False
    weight: int = 0  # estimated bytes held (``MemorySessionStore.weigh``)
    # Summaries being written for it (``Compactor``): its client's retry, or next turn, is to
    # find them, so it is not forgotten for memory or count meanwhile.
    busy: int = 0
    # Its requests in flight (``MemorySessionStore.enter``/``leave``): a session at work is not
    # idle, however long an answer takes, nor forgotten for memory or count.
    requests: int = 0
    # (held for the whole request, held for its own objects alone, its first message after the
    # system prompt: the requests that hold that very object continue one another)
    sizes: list[tuple[int, int, Any]] = field(default_factory=list)
    # Of each history (by its first message after the system prompt, that object), what its
    # latest request holds of its own: counted past ``sizes`` while the log keeps it as a base.
    owns: dict[int, tuple[int, Any]] = field(default_factory=dict)
    # The keys of ``owns`` whose history no entry of ``sizes`` holds any more (``_held_beyond``
    # looks at these alone: not every one of ``owns`` for every request).
    beyond: set[int] = field(default_factory=set)
    opening: OpeningKey | None = None
    # (``credential_tag`` of the requests it was inferred from: others' never join it)
    credential: int | None = field(default=None, repr=False)
    last_client_messages: list[Any] = field(default_factory=list)
    # Their compact JSON, for a Responses API session (``shared_prefix``'s ``dumps``)
    last_client_dump: bytes | None = field(default=None, repr=False)
    # (exchange id, forwarded messages) of recent exchanges, the bases of delta-coded log lines
    # (the event log adds each exchange right after writing its request line).
    recent: list[tuple[int, list[Any]]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # accounting, compaction, fingerprints
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def next_exchange(self) -> int:
        with self.lock:
            self.exchanges += 1
            return self.exchanges

    def remember(
        self,
        exchange_id: int,
        forwarded: list[Any],
        keep: int = CONVERSATIONS_KEPT,
        continues: int | None = None,
    ) -> None:
        """Keep ``forwarded`` as the messages of ``exchange_id`` (replacing what a refused
        attempt of the same exchange had: replay takes an exchange's latest request line), in
        the place of ``continues``, the exchange whose messages it carries on whole: one base per
        conversation, so that sub-agents interleaved in one session each find their own."""
        recent = self.recent
        for i in range(len(recent) - 1, -1, -1):  # (in place, as the appends and trims are)
            eid = recent[i][0]
            if eid in (exchange_id, continues):
                del recent[i]
        recent.append((exchange_id, forwarded))
        if len(recent) > keep:
            del recent[0 : len(recent) - keep]


class SessionStore(Protocol):
    """Where session state lives: memory now; a shared backend for several instances later."""

    def get(self, session_id: str, now: float | None = None) -> SessionState | None: ...

    def create(self, session_id: str, now: float) -> SessionState: ...

    def infer(self, messages: Sequence[Any]) -> SessionState | None: ...

    def infer_shared(
        self,
        messages: Sequence[Any],
        now: float | None = None,
        dump: bytes | None = None,
        credential: CredentialTag | None = None,
    ) -> tuple[SessionState | None, int]: ...

    def index(
        self,
        state: SessionState,
        messages: list[Any],
        inferable: bool = True,
        credential: CredentialTag | None = None,
    ) -> None: ...

    def weigh(
        self,
        state: SessionState,
        request_bytes: int,
        messages: int = 0,
        new: tuple[int, int] | None = None,
        anchor: Any = None,
        parts: tuple[int, int] = (0, 0),
    ) -> None: ...

    def active_ids(self) -> Iterable[str]: ...

    def holds(self, session_id: str) -> bool: ...

    def touch(self, state: SessionState) -> None: ...

    def enter(self, state: SessionState) -> None: ...

    def leave(self, state: SessionState, now: float) -> None: ...


# What a session holds in memory per byte of its largest recent request: the parsed history
# (shared by its last request, the recent ones kept as bases of the log's delta coding, and the
# accounting's copy), the raw bytes of the last two bodies the body memos keep. Measured: ~2.4 MB
# of RSS per session of 600 KB agent requests; tracemalloc, 3.4 bytes per byte (README, "Memory").
BYTES_HELD_PER_BODY_BYTE = 4
# ...and at least this much per message: a message's objects (its dict, its fingerprint, the
# copies) outweigh its bytes when it is short. Measured: 100,000 messages of ~40 bytes held
# ~700-750 bytes each of RSS, where 4 bytes per byte counted 160; an agent's tool calls and
# short results (~120 bytes a message) ~1,135 each by tracemalloc (the parse ~650, the
# fingerprint ~270, the memo's raw bytes, the accounting's and the check's): at 768 a budget of
# 100 MiB held ~150 MiB.
BYTES_HELD_PER_MESSAGE = 1152
# ...and this much more per content part past a message's first: each part is a dict of its
# own in the parse, the fingerprint and the copies. Measured by tracemalloc: 2,002 messages of
# 10 short text parts each held ~4.3 KB a message, of one part ~1.07 KB (~360 a part more):
# uncounted, a 20 MiB budget held ~63 MiB of such sessions.
BYTES_HELD_PER_PART = 384


# The histories (by their anchor) whose content parts a session's store keeps (``extra_parts``):
# those with any (a sub-agent's of plain text takes no place)
PART_HISTORIES_KEPT = 32


def extra_parts(
    messages: Any, new: int, state: SessionState, anchor: Any = None
) -> tuple[int, int]:
    """Content parts past each message's first, for ``weigh``: of the ``new`` last messages,
    counted (a loop over what was appended only), and of them all: those counted, plus the
    share of the parts of the history's last request (its ``anchor``, as ``weigh`` tells a
    history: a title request or sub-agents between two turns are others') that the messages
    carried on from it stand for, or where the history was parsed anew (its anchor another
    object), of the session's last request, with which its shared messages were counted (kept
    on ``state``: the latest request's, and those of the last histories that had parts)."""
    if not isinstance(messages, list):
        return 0, 0
    count = len(messages)
    new = min(max(new, 0), count)
    counted = 0
    for message in messages[count - new :]:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and len(content) > 1:
            counted += len(content) - 1
    extra = state.extra
    kept: dict[int, tuple[Any, int, int]] | None = extra.get("parts")
    key = id(anchor)
    held = kept.get(key) if kept is not None else None
    last: tuple[Any, int, int] | None = held if held is not None and held[0] is anchor else None
    if last is None and new < count:
        last = extra.get("parts_last")
    carried = 0
    if last is not None and last[1]:
        carried = last[2] * min(count - new, last[1]) // last[1]
    whole = carried + counted
    if whole or "parts_last" in extra:
        extra["parts_last"] = (anchor, count, whole)
    if whole:
        if kept is None:
            kept = extra["parts"] = {}
        kept.pop(key, None)
        kept[key] = (anchor, count, whole)
        if len(kept) > PART_HISTORIES_KEPT:
            del kept[next(iter(kept))]
    elif held is not None and kept is not None:
        del kept[key]  # (a history that has none now: its place is not kept)
    return whole, counted


# What a request holds of its own where it shares no message objects with the session's other
# requests (``weigh``): its parse and its raw body in the body memos. Measured: 8 turns of a
# 4.7 MB history whose system prompt changed each turn held ~74 MB of RSS, ~16 bytes per byte.
BYTES_HELD_PER_OWN_BYTE = 2
# The state, its index entry, a small request's objects, its log's and accounting's share.
# Measured: 3,000 sessions of one short request each, ~6.0 KiB of RSS each, where 2 KiB here
# (and 4 bytes per byte of the request) estimated 3.5.
SESSION_BASE_BYTES = 4096
# The last requests the estimate looks at: a burst of small requests of other conversations does
# not hide the large history the session still holds. Fewer than the conversations kept: a
# history rewritten each turn shares no objects from turn to turn, so each of these counts
# whole, as its body memos (a few: ``bodymemo``) and bases hold about as many (8 turns of 4.7 MB
# of a system prompt that changed, before what follows it was shared: ~74 MB held, 85
# estimated); over 32 turns it would count turns no longer held. The histories of other
# conversations the log still keeps count past them (``_held_beyond``).
SIZES_KEPT = 8
_WARN_EVERY_S = 300.0

EvictionReason = Literal["idle", "count", "memory"]


def anchor_of(messages: Any) -> Any:
    """A history's first message after its system prompt (``MemorySessionStore.weigh``): the
    requests that hold that very object continue one another."""
    if isinstance(messages, list):
        for message in messages:
            if not (isinstance(message, dict) and message.get("role") in _SYSTEM_ROLES):
                return message
    return None


def _held_beyond(state: SessionState) -> int:
    """What the histories whose latest requests are older than ``state.sizes`` hold of their
    own while the event log keeps them as bases (a dozen sub-agents taking turns: each one's
    history counted; SIZES_KEPT alone left all but eight out, ~25 times less than was held).
    The others are forgotten here: the log no longer holds them either."""
    beyond = state.beyond
    if not beyond:
        return 0
    live = {id(anchor_of(messages)) for _, messages in state.recent}
    held = 0
    for key in list(beyond):
        if key in live:
            held += state.owns[key][0]
        else:
            del state.owns[key]
            beyond.discard(key)
    return held


class MemorySessionStore:
    """In-process store, bounded in number, in estimated memory (least recently seen evicted
    first) and in idle time. ``on_evict`` hears each session forgotten and why."""

    def __init__(
        self,
        *,
        max_sessions: int = 10000,
        idle_ttl_s: float = 6 * 3600.0,
        max_bytes: int = 0,
        on_evict: Callable[[EvictionReason], None] | None = None,
    ) -> None:
        self.max_sessions = max_sessions
        self.idle_ttl_s = idle_ttl_s
        self.max_bytes = max_bytes  # 0: no limit
        self.on_evict = on_evict
        # hears each session forgotten (the chat pipeline lets go of the bodies it kept for it)
        self.on_forget: Callable[[str, SessionState], None] | None = None
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()
        self._by_opening: dict[OpeningKey, list[str]] = {}
        self._bytes = 0
        self._warned = -_WARN_EVERY_S

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def bytes(self) -> int:
        """The estimated memory all sessions hold."""
        return self._bytes

    def weigh(
        self,
        state: SessionState,
        request_bytes: int,
        messages: int = 0,
        new: tuple[int, int] | None = None,
        anchor: Any = None,
        parts: tuple[int, int] = (0, 0),
    ) -> None:
        """Estimate what ``state`` holds now that its latest request had ``request_bytes`` and
        ``messages`` (and ``parts``: content parts past each message's first, of them all and
        of the new ones, ``BYTES_HELD_PER_PART``), of which ``new`` (bytes, messages) are objects of its own, shared with no
        earlier request (None: all shared, as an agent's next turn shares its history), whose
        history's first message after the system prompt is ``anchor`` (an earlier request with
        that very object is an earlier turn of it: what it held of its own, this one holds now:
        a sub-agent's history in its main agent's session is counted whole), and
        forget the least recently seen other sessions while all of them hold more than
        ``max_bytes`` (the one being served is kept, however large; a request still in flight
        keeps its own state, see ``Exchange.session``).

        The estimate is the largest of the last few requests (a small side request does not
        free the history its agent turn left), plus what each of the others holds of its own:
        histories that do not continue one another (one rewritten each turn, which no sharing
        finds again) are each held whole, as bases of the log's
        delta coding and the accounting's baselines: counted once, 4 sessions of 4.7 MB held
        285 MB of RSS under a budget of 100, and none was forgotten."""
        sizes = state.sizes
        whole = max(
            BYTES_HELD_PER_BODY_BYTE * request_bytes,
            BYTES_HELD_PER_MESSAGE * messages + BYTES_HELD_PER_PART * parts[0],
        )
        own = 0
        if new is not None:
            own = min(
                whole,
                max(
                    BYTES_HELD_PER_OWN_BYTE * new[0],
                    BYTES_HELD_PER_MESSAGE * new[1] + BYTES_HELD_PER_PART * parts[1],
                ),
            )
        if anchor is not None:  # the earlier turns of this history: their objects are its own
            # (a sub-agent's history, however little each turn appends). Each turn takes what
            # its history's latest entry held, which took the earlier ones': that one alone is
            # not 0 (one look back where turns follow one another, not a walk of them all).
            key = id(anchor)
            held = state.owns.get(key)
            carried = 0
            if held is not None:  # (every history in ``sizes`` is in ``owns``: a new one is not)
                for at in range(len(sizes) - 1, -1, -1):
                    w, o, a = sizes[at]
                    if a is anchor:
                        if o:
                            carried = o
                            sizes[at] = (w, 0, a)
                        break
                else:  # its latest request is older than those looked at
                    carried = held[0]
                    state.beyond.discard(key)  # (in ``sizes`` again, below)
            if carried:
                own = min(whole, own + carried)
            state.owns[key] = (own, anchor)
        sizes.append((whole, own, anchor))
        if len(sizes) > SIZES_KEPT:
            dropped = sizes.pop(0)[2]
            # (the usual case, one history's turns: it is this request's own, just appended)
            if (
                dropped is not None
                and dropped is not anchor
                and all(a is not dropped for _, _, a in sizes)
            ):
                state.beyond.add(id(dropped))  # its history's latest request is past them now
        # the largest whole (of equals, the latest: what earlier turns held is carried on to
        # it), plus the others' own (one pass: it runs for every request)
        largest = owns = own_of_largest = 0
        for whole_i, own_i, _ in sizes:
            owns += own_i
            if whole_i >= largest:
                largest, own_of_largest = whole_i, own_i
        if len(state.owns) > 1:
            owns += _held_beyond(state)
        weight = SESSION_BASE_BYTES + largest + owns - own_of_largest
        if self._sessions.get(state.id) is state:
            self._bytes += weight - state.weight
            self._sessions.move_to_end(state.id)
        state.weight = weight
        if not self.max_bytes:
            return
        while self._bytes > self.max_bytes and len(self._sessions) > 1:
            found = self._oldest_idle(state)
            if found is None:
                return
            sid, oldest = found
            self._forget(sid, oldest, "memory")
            self._warn_memory(sid, state.last_seen - oldest.last_seen)

    def _oldest_idle(self, keep: SessionState | None = None) -> tuple[str, SessionState] | None:
        """The least recently seen session with no summary being written for it and no request
        in flight, other than ``keep`` (None when there is none)."""
        for sid, state in self._sessions.items():
            if not (state.busy or state.requests) and state is not keep:
                return sid, state
        return None

    def _idle(self, state: SessionState, now: float) -> bool:
        """Whether ``state`` has been idle for longer than ``idle_ttl_s`` at ``now``: no
        request of it in flight, no summary being written for it, and none seen since."""
        return now - state.last_seen > self.idle_ttl_s and not (state.requests or state.busy)

    def enter(self, state: SessionState) -> None:
        """A request of ``state`` is in flight (until ``leave``)."""
        state.requests += 1

    def leave(self, state: SessionState, now: float) -> None:
        """A request of ``state`` is done at ``now``: the session's idle time runs from here
        (not from the request's start: an answer that took longer than ``idle_ttl_s`` left the
        session as much at work as its client is)."""
        state.requests -= 1
        if now > state.last_seen:
            state.last_seen = now
        self.touch(state)
        if not state.requests and (
            (self.max_bytes and self._bytes > self.max_bytes)
            or len(self._sessions) > self.max_sessions
        ):
            # Sessions with requests in flight are kept past the budgets: once a burst of them
            # is done, the budgets hold again (not when the next request comes: maybe hours)
            self._trim(now, state)

    def _trim(self, now: float, keep: SessionState | None) -> None:
        """Forget the least recently seen idle sessions (not ``keep``) while all of them hold
        more than ``max_bytes``, then while there are more than ``max_sessions``."""
        while self.max_bytes and self._bytes > self.max_bytes and len(self._sessions) > 1:
            found = self._oldest_idle(keep)
            if found is None:
                break
            sid, oldest = found
            self._forget(sid, oldest, "memory")
            self._warn_memory(sid, now - oldest.last_seen)
        while len(self._sessions) > self.max_sessions:
            found = self._oldest_idle(keep)
            if found is None:
                break
            self._forget(found[0], found[1], "count")

    def touch(self, state: SessionState) -> None:
        """``state`` counts as just seen for eviction (a summary written for it is done: its
        client's retry is on its way), if it is still held."""
        if self._sessions.get(state.id) is state:
            self._sessions.move_to_end(state.id)

    def _warn_memory(self, sid: str, idle_s: float) -> None:
        """Say, now and then, that the budget forgets sessions: a session seen minutes ago that
        comes back starts its accounting again, so a budget too small should be noticed."""
        now = time.monotonic()
        if now - self._warned < _WARN_EVERY_S:
            return
        self._warned = now
        log.warning(
            "sessions.max_memory_mb (%d MiB) reached: forgetting the least recently seen "
            "sessions (session %s, last seen %.0f s ago); raise it if sessions still at work "
            'are forgotten (cachegate_session_evictions_total{reason="memory"})',
            self.max_bytes // (1024 * 1024),
            sid,
            idle_s,
        )

    def get(self, session_id: str, now: float | None = None) -> SessionState | None:
        """The session, or None. With ``now`` (a request's time), a session idle for longer than
        ``idle_ttl_s`` is forgotten here and None returned: eviction by idle time otherwise runs
        only when a session is created, and a session coming back after the limit must start
        again whether or not another one was created meanwhile."""
        state = self._sessions.get(session_id)
        if state is None:
            return None
        if now is not None and self._idle(state, now):
            self._forget(session_id, state, "idle")
            return None
        self._sessions.move_to_end(session_id)
        return state

    def create(self, session_id: str, now: float) -> SessionState:
        state = SessionState(id=session_id, created=now, last_seen=now)
        replaced = self._sessions.pop(session_id, None)
        if replaced is not None:
            self._forget_state(session_id, replaced)
        self._sessions[session_id] = state
        self._evict(now, keep=state)
        return state

    def infer(self, messages: Sequence[Any]) -> SessionState | None:
        """The session ``messages`` continue (the longest shared prefix, then the latest seen)."""
        return self.infer_shared(messages)[0]

    def infer_shared(
        self,
        messages: Sequence[Any],
        now: float | None = None,
        dump: ItemsDump | None = None,
        credential: CredentialTag | None = None,
    ) -> tuple[SessionState | None, int]:
        """``infer``, with how many leading messages the session's last request shares (0 when
        no session was found). With ``now``, sessions idle for longer than ``idle_ttl_s`` are
        forgotten instead of joined. ``dump``: ``messages``' compact JSON (``dump_items``).
        ``credential``: the request's ``credential_tag``; only sessions inferred under the same
        are joined."""
        key = opening_key(messages)
        if key is None:
            return None, 0
        best: SessionState | None = None
        best_len = -1
        stale: list[SessionState] = []
        for sid in self._by_opening.get(key, ()):
            state = self._sessions.get(sid)
            if state is None or state.credential != credential:
                continue
            if now is not None and self._idle(state, now):
                stale.append(state)
                continue
            n = shared_prefix(state.last_client_messages, messages, (state.last_client_dump, dump))
            if n > best_len or (
                n == best_len and best is not None and state.last_seen > best.last_seen
            ):
                best, best_len = state, n
        for state in stale:
            self._forget(state.id, state, "idle")
        if best is None:
            return None, 0
        self._sessions.move_to_end(best.id)
        return best, best_len

    def index(
        self,
        state: SessionState,
        messages: list[Any],
        inferable: bool = True,
        credential: CredentialTag | None = None,
    ) -> None:
        """Keep ``messages`` as the session's latest; ``inferable``: a request without an id may
        be found to continue it (a session named by its client is only ever named: another
        client that sends no id is no part of it, whatever it sends). ``credential``: the
        request's ``credential_tag``, which a request must have to be found to continue it."""
        previous, state.last_client_messages = state.last_client_messages, messages
        if not inferable:
            if state.opening is not None:  # inferred, and now named: named from now on
                self._unindex(state.id, state.opening)
                state.opening = None
            return
        state.credential = credential
        if state.opening is not None and _same_opening(previous, messages):
            return  # the opening message is the very object already indexed: same key
        key = opening_key(messages)
        if key is not None and key != state.opening:
            if state.opening is not None:
                self._unindex(state.id, state.opening)
            state.opening = key
            self._by_opening.setdefault(key, []).append(state.id)

    def _unindex(self, sid: str, key: OpeningKey) -> None:
        ids = self._by_opening.get(key)
        if ids and sid in ids:
            ids.remove(sid)
            if not ids:
                del self._by_opening[key]

    def forget_idle(self, now: float) -> None:
        """Forget the sessions idle for longer than ``idle_ttl_s`` now, as the next request would
        (a scrape calls it, so the sessions gauges fall once agents stop), and those past the
        memory budget but the idle one seen last (as ``leave`` keeps it: its client is the
        likeliest back, and the others' requests in flight hold what is over)."""
        self._evict(now)
        if self.max_bytes and self._bytes > self.max_bytes:
            latest = (
                st for st in reversed(self._sessions.values()) if not (st.requests or st.busy)
            )
            self._trim(now, next(latest, None))

    def _evict(self, now: float, keep: SessionState | None = None) -> None:
        """Forget the idle sessions, then the least recently seen past ``max_sessions`` (none a
        summary is being written for, nor ``keep``, the one just created)."""
        # The idle ones, least recently seen first: up to the first not idle (the later ones
        # were seen after it), past any with a request in flight or a summary being written
        # (held whatever their age: one such at the front kept the idle ones after it).
        idle = []
        for sid, state in self._sessions.items():
            if state.requests or state.busy:
                continue
            if now - state.last_seen <= self.idle_ttl_s:
                break
            idle.append((sid, state))
        for sid, state in idle:
            self._forget(sid, state, "idle")
        while len(self._sessions) > self.max_sessions:
            found = self._oldest_idle(keep)
            if found is None:
                break
            self._forget(found[0], found[1], "count")

    def _forget(self, sid: str, state: SessionState, reason: EvictionReason) -> None:
        del self._sessions[sid]
        self._forget_state(sid, state)
        if self.on_forget is not None:
            try:
                self.on_forget(sid, state)
            except Exception:  # (memory let go of, or not: never the request's failure)
                log.exception("session forget hook failed")
        if self.on_evict is not None:
            try:
                self.on_evict(reason)
            except Exception:  # an observer (metrics) must not break the request
                log.exception("session eviction observer failed")

    def _forget_state(self, sid: str, state: SessionState) -> None:
        self._bytes -= state.weight
        if state.opening:
            self._unindex(sid, state.opening)

    def active_ids(self) -> Iterable[str]:
        return list(self._sessions)

    def holds(self, session_id: str) -> bool:
        """Whether the session is held in memory (asked from retention's thread: one lookup)."""
        return session_id in self._sessions
