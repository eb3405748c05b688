"""The full pipeline of ``POST /v1/chat/completions``: parse once, name the session, transform, relay.

Transforms run in order and each may replace the forwarded body: tool-pairing repair (or a strict
rejection), compaction, and the stream-usage request. When none changed anything, the client's exact
bytes are forwarded; the usage request alone is spliced into the raw bytes rather than re-serializing
a 600 KB body.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import re
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

import orjson

from proxy import bodymemo, cache, compaction, pairing, prefix
from proxy.compactor import Compactor
from proxy.config import Settings, sends_usage_unasked, strict_pairing
from proxy.errors import CLIENT_CLOSED, ProxyError, bad_request, shutting_down
from proxy.observers import exchange_keys
from proxy.pipeline import Exchange, Observer, Transform, notify, notify_each, refusal_text
from proxy.redact import redact_text, without_values
from proxy.relay import (
    DisconnectWatch,
    Receive,
    Relay,
    RetryRequest,
    Scope,
    Send,
    decoded_request,
    read_body,
    refuse_announced,
    send_error,
    upstream_request_headers,
)
from proxy.sessions import (
    BYTES_HELD_PER_BODY_BYTE,
    RequestHeaders,
    SessionState,
    SessionStore,
    anchor_of,
    credential_tag,
    dump_items,
    explicit_session_id,
    extra_parts,
    new_session_id,
    realigned,
    shared_prefix,
)

log = logging.getLogger(__name__)
_USAGE_REFUSED_KEPT: Final = 1024  # models remembered to refuse stream_options, at most

# The longest the event loop runs finished exchanges' observers before it polls sockets again.
OBSERVER_SLICE_S = 0.002
# Due observer entries run together, observer by observer (``ChatPipeline._drain``): as many as
# fit in a slice by the cost measured so far, at most this many, from this first guess per entry.
OBSERVER_BATCH = 64
OBSERVER_FIRST_GUESS_S = 0.00025

_USAGE_OPTION = b'"stream_options":{"include_usage":true}'


def retry_count(value: str) -> int:
    """An SDK's retry count (``x-stainless-retry-count``), 0 when it is none (bounded: logged)."""
    value = value.strip()
    if not (value.isascii() and value.isdigit() and len(value) <= 4):
        return 0
    return int(value)


# A body's top-level value by its JSON name, as OpenAI's refusals say it ("got an array", not
# Python's "got list").
_JSON_TYPES: Final[dict[type, str]] = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def parse_request(
    raw: bytes,
    memos: list[bodymemo.BodyMemo],
    others: Sequence[bodymemo.BodyMemo] | Callable[[], Sequence[bodymemo.BodyMemo]] = (),
) -> bodymemo.Parsed:
    """The request as a JSON object, or a 400 that says what is wrong with it. A body that continues
    the session's previous one (``memos``; ``others``, recent ones of other keys, past its first
    bytes) is spliced onto its parse (see ``proxy.bodymemo``)."""
    try:
        parsed = bodymemo.parse(raw, memos, others)
    except orjson.JSONDecodeError as exc:
        # (orjson's depth limit is its own verdict; the standard parser's recursion limit
        # differs by Python version, and told it as "not valid JSON" on 3.12)
        too_deep = str(exc).startswith("depth limit")
        lenient = _TOO_DEEP if too_deep else _lenient_body(raw)
        if lenient is _TOO_DEEP:
            raise bad_request(
                f"Request body is nested deeper than {ORJSON_MAX_DEPTH} levels, the most"
                " cachegate reads.",
                "invalid_json",
            ) from None
        if lenient is _UNREADABLE:
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as bad:  # orjson says "surrogates not allowed" of it
                byte = raw[bad.start : bad.start + 1].hex()
                raise bad_request(
                    f"Request body is not valid UTF-8: byte 0x{byte} at position {bad.start}.",
                    "invalid_json",
                ) from None
            raise bad_request(f"Request body is not valid JSON: {exc}", "invalid_json") from None
        parsed = bodymemo.Parsed(lenient, None)
    body = parsed.body
    if not isinstance(body, dict):
        raise bad_request(
            f"Request body must be a JSON object, got {_JSON_TYPES.get(type(body), 'another value')}.",
            "invalid_body",
        )
    messages = body.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise bad_request("'messages' must be an array.", "invalid_messages", "messages")
    return parsed


# The keys a session without an id has had its bodies filed under, remembered to find a body
# that a later one, filed under another key, carries on (``ChatPipeline.remember_body``).
KEYS_TRACKED: Final = 32


def _carried_on(older: Sequence[Any], newer: Sequence[Any], start: int) -> bool:
    """Whether ``newer``'s messages from ``start`` (past its system block) begin with the very
    objects of ``older``'s past its own system block, more than one, and go on past them
    (conversations of one task under several models or role prompts open with the very same
    task message, shared with the request before)."""
    return 1 < prefix.carried_past_prompt(older, newer) < len(newer) - start


_UNREADABLE: Final = object()
_TOO_DEEP: Final = object()


def _lenient_body(raw: bytes, parse_int: Callable[[str], int] | None = None) -> Any:
    """A body orjson refuses only for a lone UTF-16 surrogate escaped in a string
    (``"\\ud83d"``, what JavaScript writes for a text cut in the middle of an emoji, and an
    agent then resends every turn), or ``_UNREADABLE``. Such a body is the provider's to judge:
    it is forwarded as its client sent it unless a repair changes it; in cachegate's own copy
    (accounting, the log, a repaired body) the surrogate reads as U+FFFD. Anything else JSON
    does not allow stays refused: another encoding than UTF-8, ``NaN``/``Infinity``, a number
    beyond a double (it would be written back as ``null``), an integer beyond 64 bits."""
    try:
        text = raw.decode("utf-8")
        options: dict[str, Any] = {
            "parse_constant": _refuse,
            "parse_float": _finite_float,
            "parse_int": parse_int or _int64,
        }
        # ~990 levels at the usual recursion limit; read on as deep as orjson reads, no deeper
        # (checked whichever way it was read: another thread may have the limit raised)
        body = prefix.deep_call(json.loads, text, **options)
        if _depth(body) > ORJSON_MAX_DEPTH:
            return _TOO_DEEP
        return prefix.deep_call(prefix.without_surrogates, body)  # (two frames a level)
    except (ValueError, RecursionError):
        return _UNREADABLE


def lenient_json(raw: bytes, big_ints: bool = False) -> Any:
    """``raw`` read as ``_lenient_body`` reads it (a lone surrogate read as U+FFFD), or None
    where it reads nothing (no JSON, nested too deep, an integer beyond 64 bits unless
    ``big_ints``: then read as it is, which ``dump_body`` writes as it was)."""
    body = _lenient_body(raw, int if big_ints else None)
    return None if body is _UNREADABLE or body is _TOO_DEEP else body


ORJSON_MAX_DEPTH = 1024  # the deepest body orjson reads, so the deepest cachegate takes


def _depth(value: Any) -> int:
    """How deep ``value`` nests (an array or object of scalars is 1), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((inner, level + 1) for inner in item)
    return deepest


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _int64(text: str) -> int:
    value = int(text)
    if not -(2**63) <= value < 2**64:  # what orjson, and so the log, can write
        raise ValueError(f"{text[:20]}... is beyond 64 bits")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if value - value != 0.0:  # inf (NaN cannot be written as a number)
        raise ValueError(f"{text} is beyond a double")
    return value


def _explicit_or_none(headers: Mapping[str, str], path_session: str | None) -> str | None:
    """The session a request named, for the header of an error answered before its session was
    resolved (a body that is not JSON); None when it named none or an invalid one."""
    try:
        return explicit_session_id(headers, path_session)
    except ValueError:
        return None


def splice_usage_option(raw: bytes) -> bytes | None:
    """Insert ``stream_options.include_usage`` as the first key of a JSON object, bytes only."""
    start = raw.find(b"{")
    if start < 0 or raw[:start].strip():
        return None
    rest = raw[start + 1 :]
    empty = rest.lstrip().startswith(b"}")
    return raw[: start + 1] + _USAGE_OPTION + (b"" if empty else b",") + rest


def header_map(scope: Scope) -> RequestHeaders:
    """The request's headers by (lower-case) name (and its query string, for the session id's
    check: ``sessions.is_own_key``), a repeated one's values joined by ", " as
    HTTP combines them (RFC 9110, 5.3: two different X-Session-Id values are no id, where the
    last was taken and a framework upstream read the first); made once per request (the browser
    guard reads it before the route does) and kept in the scope."""
    headers: RequestHeaders | None = scope.get("cachegate.headers")
    if headers is None:
        raw = scope["headers"]
        headers = RequestHeaders({k.decode("latin-1"): v.decode("latin-1") for k, v in raw})
        if len(headers) < len(raw):  # a name given more than once (rare): all its values
            combined: dict[str, list[str]] = {}
            for k, v in raw:
                combined.setdefault(k.decode("latin-1"), []).append(v.decode("latin-1"))
            headers = RequestHeaders(
                {k: ", ".join(dict.fromkeys(vs)) for k, vs in combined.items()}
            )
        headers.query = scope.get("query_string") or b""
        scope["cachegate.headers"] = headers
        scope["cachegate.header_count"] = len(raw)
    return headers


def request_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The request's header fields as ``header_map`` read them. uvicorn appends a chunked
    body's trailer fields to the same list as they arrive: those are not forwarded as headers
    (RFC 9110, 6.5.1), nor does a late one change what the request was taken for (its session,
    its key)."""
    fields: list[tuple[bytes, bytes]] = scope["headers"]
    count = scope.get("cachegate.header_count")
    return fields if count is None or count >= len(fields) else fields[:count]


class PairingRepair:
    """Transform: repair tool pairing, or in strict mode refuse with a diagnosis (a 400)."""

    def __init__(self, settings: Settings, on_strict_rejection: Callable[[], None] | None) -> None:
        self.settings = settings
        self.on_strict_rejection = on_strict_rejection
        self.note = settings.pairing.interrupted_note or pairing.DEFAULT_INTERRUPTED_NOTE
        self._families: dict[str, tuple[bool, bool, bool, str]] = {}  # model -> ``family``

    async def apply(
        self, ex: Exchange, state: SessionState, body: dict[str, Any]
    ) -> dict[str, Any]:
        return self.repair(ex, body, state)

    def repair(
        self, ex: Exchange, body: dict[str, Any], state: SessionState | None = None
    ) -> dict[str, Any]:
        if not (self.settings.pairing.repair or ex.strict):
            return body
        messages = body.get("messages")
        if not isinstance(messages, list):
            return body
        # Resumed from where the session's previous request left off: an agent's next turn
        # resends the same message objects (prefix sharing), so only the new ones are checked.
        # Two checkpoints are kept: the latest turn's, and the one it resumed from (or the turn
        # before), so a retry or a regeneration of the latest turn resumes too.
        # (A Claude model's history has one defect more, a blank assistant message, and a
        # Mistral model's another, a user message right after a tool result: their checkpoints
        # are kept apart, for a session that switches models.)
        claude, gemini, mistral, key = self.family(body.get("model"))
        drop_empty = claude or gemini  # (both refuse an empty assistant message)
        kept: list[pairing.Checkpoint] = state.extra.get(key, []) if state is not None else []
        needed, after, resumed = pairing.needs_repair_from(
            messages, kept, drop_empty, mistral, claude, not gemini
        )
        if state is not None and after is not None:
            base = resumed or (kept[0] if kept else None)
            state.extra[key] = [after] if base is None else [after, base]
        if not needed:
            if state is not None:  # a repair state can never be resumed from again: let it go
                state.extra.pop("pairing_repair", None)
            return body
        if ex.strict:
            defects = pairing.diagnose(messages, drop_empty, mistral, claude, not gemini)
            if self.on_strict_rejection is not None:
                self.on_strict_rejection()
            raise bad_request(pairing.format_strict_error(defects), "strict_pairing", "messages")
        # A history that keeps a repaired defect is repaired again every turn: resumed from the
        # session's previous repair, the work is in proportion to what was appended.
        previous = state.extra.pop("pairing_repair", None) if state is not None else None
        result, resume = pairing.repair_messages_from(
            messages,
            previous,
            orphan_policy=self.settings.pairing.orphan_policy,
            interrupted_note=self.note,
            drop_empty=drop_empty,
            mistral=mistral,
            unique_ids=claude,
            blank_spaces=not gemini,  # (white space is text to Gemini)
        )
        if messages and not result.messages and self.settings.pairing.orphan_policy == "drop":
            # (orphans alone, dropped, left nothing to send: downgraded instead, as on the
            # Responses route; the provider refused them as they were)
            result, resume = pairing.repair_messages_from(
                messages,
                None,
                orphan_policy="downgrade",
                interrupted_note=self.note,
                drop_empty=drop_empty,
                mistral=mistral,
                unique_ids=claude,
                blank_spaces=not gemini,
            )
            resume = None  # (a resume is for the session's own policy: none kept)
        if state is not None and resume is not None:
            state.extra["pairing_repair"] = resume
        if not result.changed or (messages and not result.messages):
            # (nothing left after the repair, the history only an empty assistant message or
            # orphans dropped: the provider's 400 said "empty array" of a list the client never
            # sent; it now answers what was sent)
            return body
        ex.repairs = [
            {"kind": r.kind, "index": r.index, "tool_call_id": r.tool_call_id, "action": r.action}
            for r in result.repairs
        ]
        return {**body, "messages": result.messages}

    def family(self, model: Any) -> tuple[bool, bool, bool, str]:
        """Whether ``model`` is a Claude model (by its name, ``claude-…``, a gateway's or
        Bedrock's, or, a name no provider's, its configured entry's ``dialect = "anthropic"``),
        whether a Gemini model (``gemini`` a word in its name: ``gemini-2.5-pro``, a gateway's
        ``google/gemini-…``; or, a name no provider's, its configured entry's
        ``dialect = "gemini"``, a gateway's alias; its OpenAI endpoint refuses an empty text,
        "Unable to submit request because it has an empty text parameter", and takes two user
        turns in a row),
        whether a Mistral model (by its name: ``mistral-large-latest``, ``codestral-…``,
        ``mistralai/Devstral-…`` behind a gateway or vLLM; or, a name no provider's, its
        configured entry's ``dialect = "mistral"``: a name of the user's own, ``--served-model-name``
        on vLLM), and the key its checkpoints are kept under. (Asked of every request: each
        name's answer is kept, ~2-10 µs each time otherwise.)"""
        name = model if isinstance(model, str) else ""
        known = self._families.get(name)
        if known is not None:
            return known
        dialect = self.settings.model(name or None)[1].dialect
        claude = cache.caching_provider(name, dialect) == "anthropic"  # (as the accounting reads)
        # (a dialect is for a name no provider's: a Gemini or Mistral name keeps its own rules)
        unknown = cache.provider_of(name) == "*" and not cache.named_elsewhere(name)
        named_gemini = cache.GEMINI_WORD.search(name.lower()) is not None  # (under any entry)
        mistral = not claude and (
            cache.MISTRAL_NAME.search(name.lower()) is not None
            or (dialect == "mistral" and unknown)
        )
        gemini = not (claude or mistral) and (named_gemini or (dialect == "gemini" and unknown))
        known = (claude, gemini, mistral, _CHECKPOINT_KEYS[claude or gemini, claude, mistral])
        if len(self._families) >= 256:  # (bounded: a client that sends many names)
            self._families.clear()
        self._families[name] = known
        return known


_CHECKPOINT_KEYS: Final = {  # (drop_empty, unique_ids, mistral)
    (False, False, False): "pairing_checkpoints",
    (True, True, False): "pairing_checkpoints_claude",
    (True, False, False): "pairing_checkpoints_gemini",
    (False, False, True): "pairing_checkpoints_mistral",
}


def internal_error(exc: BaseException, what: str | None = None) -> ProxyError:
    """A 500 for a bug (the traceback goes to cachegate's own log). Without ``what``, the
    failure came before anything was forwarded; ``what`` says what failed otherwise."""
    if what is None:
        what = "cachegate failed to process this request; nothing was forwarded"
    return ProxyError(
        500,
        f"{what} ({type(exc).__name__}). See cachegate's log.",
        type="server_error",
        code="internal_error",
    )


class ChatPipeline:
    """Runs one chat-completions exchange through the transforms, the relay and the observers."""

    def __init__(
        self,
        settings: Settings,
        relay: Relay,
        sessions: SessionStore,
        observers: list[Observer],
        *,
        api_key: Callable[[], str | None],
        clock: Callable[[], float] = time.time,
        on_strict_rejection: Callable[[], None] | None = None,
        compactor: Compactor | None = None,
    ) -> None:
        self.settings = settings
        self.relay = relay
        self.sessions = sessions
        self.observers = observers
        self.api_key = api_key
        self.clock = clock
        self.pairing = PairingRepair(settings, on_strict_rejection)
        self.compactor = compactor
        # An upstream that streams usage to everyone is not asked, and its usage not hidden.
        self.asks_usage = settings.upstream.request_usage and not sends_usage_unasked(
            settings.upstream.base_url
        )
        # Models whose upstream refused the stream_options cachegate added: not asked again.
        self.usage_refused: set[str | None] = set()
        self.transforms: list[Transform] = [self.pairing]
        if compactor is not None:
            self.transforms.append(compactor)
        # The previous body of recent sessions, parsed: its raw bytes and the objects parsed from
        # them (shared with the sessions that hold them) count in the sessions' memory budget.
        # Without a budget they keep their own bound: memos outlive the sessions they came from.
        budget = settings.sessions.max_memory_mb * 1024 * 1024
        idle_s = settings.sessions.idle_ttl_s
        self.memos = (
            bodymemo.BodyMemos(budget // BYTES_HELD_PER_BODY_BYTE, idle_s)
            if budget
            else bodymemo.BodyMemos(idle_s=idle_s)
        )
        self.spliced_parses = 0  # bodies parsed only in what they appended
        self.in_flight = 0  # exchanges whose observers have not all run yet
        self.idle = asyncio.Event()  # set whenever in_flight is 0
        self.idle.set()
        # Exchanges whose observers are due: (exchange, True) for on_request, False for
        # on_response, in the order they became due.
        self._due: collections.deque[tuple[Exchange, bool]] = collections.deque()
        self._draining = False
        self._entry_s = OBSERVER_FIRST_GUESS_S  # what one due entry's observers cost, lately

    def resolve_session(
        self,
        headers: Mapping[str, str],
        path_id: str | None,
        body: dict[str, Any],
        now: float,
        *,
        key: str = "messages",
        named: str | None = None,
        whole: bool = True,
        spliced: bool = False,
    ) -> tuple[SessionState, int]:
        """The request's session, and how many of its messages (``body[key]``: a Responses API
        request's ``input`` items) it shares with the session's last request (their objects
        now the same: held once): the leading ones, and those of the history it resumes after
        a change. ``named``: the session the request belongs to where it names none itself
        (the one that made the stored response it continues). ``whole``: the request carries
        its whole history (not one continued from a response stored at the provider), so it
        may be found to continue a session by it, and later ones to continue it. ``spliced``:
        its items were spliced onto an earlier body's parse (``proxy.bodymemo``): those it
        shares with the session's last request are its very objects."""
        try:
            explicit = explicit_session_id(headers, path_id)
        except ValueError as exc:
            raise bad_request(str(exc), "invalid_session_id") from None
        sid = explicit or named
        # A continuation (a ``previous_response_id``) of a session found by its history: its
        # items are not the history, and it leaves the session found as it was (it was named
        # from then on, its history replaced by the continuation's items: the client's next
        # request with the whole history, a fallback from stored responses, began a new one)
        if explicit is None and named is not None and not whole:
            state = self.sessions.get(named, now) or self.sessions.create(named, now)
            state.last_seen = now
            return state, 0
        messages = body.get(key) or []
        if not isinstance(messages, list):  # (a Responses API ``input`` that is one string)
            # one user message, found and kept as such, as chat's: a retry finds its attempt's
            # session, a next turn that sends it as an item goes on in it
            messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else []
        # A Responses API request's items parsed anew (not spliced onto the last body's parse):
        # their JSON, to tell at once that they carry the session's last ones on
        dump = dump_items(messages) if key != "messages" and not spliced else None
        shared = -1  # not known yet
        credential = None
        if sid is not None:
            state = self.sessions.get(sid, now) or self.sessions.create(sid, now)
        elif not whole:
            state = self._new_session(now)
        else:
            credential = credential_tag(headers)
            found, shared = self.sessions.infer_shared(messages, now, dump, credential)
            state = self._new_session(now) if found is None else found
        state.last_seen = now
        if isinstance(messages, list):
            # Agents resend their whole history. Share the previous request's message objects for
            # the unchanged prefix: the session then holds one copy of the history, not one per
            # request, and every later comparison of those messages is an identity check. (The
            # same JSON, not Python's equality, under which 1 -> 1.0 kept the old message in the
            # log and a re-serialized body; in any key order, so a message resent in another
            # order is logged and re-sent in the order it first came, the same JSON.)
            previous = state.last_client_messages
            if shared < 0:
                shared = shared_prefix(previous, messages, (state.last_client_dump, dump))
            if shared:
                messages[:shared] = previous[:shared]
            # The history after a change may be unchanged (a system prompt with the time in
            # it, a history trimmed at its start or in its middle): share that too. Each such
            # turn's history had been a copy of its own, held by the log and the body memos,
            # and compared again by the log's delta coding. Only a run of more than one
            # message that carries the last request on to its end and goes on past it: another
            # conversation that opens with the same task under another system prompt (a
            # sub-agent's role) is no turn of this one (the memory estimate takes requests
            # holding the very same first message for turns of one history).
            q, r, after = realigned(previous, messages, shared)
            if after > 1 and r + after == len(previous) and q + after < len(messages):
                messages[q : q + after] = previous[r : r + after]
                shared += after
        self.sessions.index(state, messages, sid is None and whole, credential=credential)
        state.last_client_dump = dump
        return state, max(shared, 0)

    def _new_session(self, now: float) -> SessionState:
        # (8 hex digits a second: two conversations starting in one second may draw the same;
        # the store would replace the first, and their logs would be one)
        made = new_session_id(now)
        while self.sessions.get(made) is not None:
            made = new_session_id(now)
        return self.sessions.create(made, now)

    def memos_for(
        self,
        raw: bytes,
        headers: Mapping[str, str],
        path_session: str | None,
        field: str = "messages",
    ) -> tuple[
        str | None,
        list[bodymemo.BodyMemo],
        Callable[[], list[bodymemo.BodyMemo]] | tuple[()],
    ]:
        """Where a body's memo is filed (None: too small to be worth one), the memos filed there
        (newest first), and what gives the recent ones of other keys, for ``bodymemo.parse``.
        ``field``: the array its history is in (``input``: a Responses API request)."""
        if len(raw) < bodymemo.MIN_BYTES:
            return None, [], ()
        try:
            sid = explicit_session_id(headers, path_session)
        except ValueError:
            sid = None  # refused by resolve_session
        key = bodymemo.memo_key(raw, sid, field)
        # (the bodies of a session idle past its TTL first: a body spliced onto one would count
        # as held by another session, which its own is about to forget)
        self.memos.forget_idle(self.clock())
        memos = self.memos.get(key)
        if sid is not None:
            return key, memos, ()
        # (its first bytes changed: filed under a key of its own)
        return key, memos, functools.partial(self.memos.recent, memos, field)

    def remember_body(
        self,
        key: str,
        raw: bytes,
        body: dict[str, Any],
        parsed: bodymemo.Parsed,
        now: float,
        state: SessionState | None = None,
        field: str = "messages",
    ) -> None:
        """Keep this body's parse (with the message objects the session now holds) for the next
        turn to splice onto. Without a session id, a body filed under another key than an
        earlier one of the session whose history it carries on (the very same messages after
        the system prompt) replaces it: a client whose first 16 KiB change every turn (the time
        in its system prompt) had every body kept under a key of its own, though none was
        continued (~160 MB more RSS over a 200-turn session of up to ~600 KB bodies)."""
        if parsed.close is None:
            self.memos.note_miss(key, parsed.misses, parsed.firsts)
            return
        if parsed.source is not None:
            self.spliced_parses += 1
        messages = body[field]
        memo = bodymemo.BodyMemo(
            raw,
            parsed.close,
            tuple(body),
            {k: v for k, v in body.items() if k != field},
            tuple(messages),
            0 if parsed.source is not None and not parsed.resent else parsed.misses,
            0 if parsed.source is not None and not parsed.resent else parsed.firsts,
            marks=parsed.marks,
            style=parsed.style,
            candidates=parsed.candidates,
            head=parsed.head,
            head_checked=parsed.head_checked,
            field=field,
        )
        filed = self.memos.put(key, memo, source=parsed.source, now=now)
        if state is not None:
            state.extra["memo_key"] = key  # (aged from the request's end: ``leave``)
        if state is not None and bodymemo.by_first_bytes(key):
            # Weak references: they hold nothing alive the memos have let go.
            filed_by: dict[str, weakref.ref[bodymemo.BodyMemo]]
            filed_by = state.extra.setdefault("body_memos", {})
            filed_by.pop(key, None)
            newer = filed.messages
            start = prefix.leading_system_count(newer)
            for other, ref in list(filed_by.items()):
                older = ref()
                if older is None:
                    del filed_by[other]
                elif _carried_on(older.messages, newer, start):
                    self.memos.discard(other, older)
                    del filed_by[other]
            filed_by[key] = weakref.ref(filed)
            while len(filed_by) > KEYS_TRACKED:  # (forgotten here, not discarded)
                del filed_by[next(iter(filed_by))]

    def forget_bodies(self, session_id: str, state: SessionState) -> None:
        """Let go of the bodies kept for a session cachegate forgets (for count, memory or idle
        time): under its id, and those its turns filed by their first bytes. They were kept
        until the memos' own bound (a quarter of the sessions' budget in raw bytes, three
        times as much again in objects) or 6 idle hours: 8,000 sessions of 22 KB, each
        forgotten at once, held ~270 MB beyond what ``cachegate_sessions_memory_bytes`` said."""
        self.memos.forget(bodymemo.memo_key(b"", session_id))
        self.memos.forget(bodymemo.memo_key(b"", session_id, "input"))
        filed_by: dict[str, weakref.ref[bodymemo.BodyMemo]] = state.extra.get("body_memos", {})
        for key, ref in list(filed_by.items()):
            memo = ref()
            if memo is not None:
                self.memos.discard(key, memo)
        filed_by.clear()

    async def _forward(
        self,
        ex: Exchange,
        scope: Scope,
        receive: Receive,
        send: Send,
        content: bytes,
        unasked: dict[str, Any] | None,
        unasked_raw: bytes | None,
        extra: list[tuple[bytes, bytes]],
        watch: DisconnectWatch | None,
        too_long: Callable[[int, bytes], bool] | None,
    ) -> None:
        """Relay the exchange (``RetryRequest`` when ``too_long`` accepts the refusal). When the
        upstream refuses the ``stream_options`` cachegate added, the request goes again at once
        as it was before that (``unasked``; its bytes ``unasked_raw`` if they are the client's),
        and its model is not asked again; if that is refused for the option too (the client's
        own), the model is asked again next time and the client gets the refusal."""
        second = False  # the request sent again without the option
        remembered = False
        while True:
            asked = ex.strip_usage or second

            def retry_if(status: int, text: bytes, asked: bool = asked) -> bool:
                return (asked and refuses_usage_option(status, text)) or (
                    too_long is not None and too_long(status, text)
                )

            try:
                await self.relay.forward(
                    ex,
                    scope,
                    receive,
                    send,
                    content=content,
                    headers=ex.upstream_headers,
                    extra_headers=extra,
                    record=True,
                    watch=watch,
                    retry_if=retry_if if asked or too_long else None,
                )
                return
            except RetryRequest as refused:
                if unasked is None or not refuses_usage_option(refused.status, refused.text):
                    raise  # too long: compacted by the caller (the option not asked again)
                if second:  # the client's own option was refused: not the model's answer
                    if remembered:
                        self.usage_refused.discard(ex.model)
                    ex.status, ex.upstream_error = refused.status, "status"
                    ex.error = refusal_text(refused.status, refused.text)
                    await _relay_refusal(send, refused, extra)
                    return
                remembered = self._usage_option_refused(ex, refused.status)
                self._request_observers(ex)  # the refused attempt's line first, as sent
                ex.status, ex.strip_usage = 0, False
                ex.body = unasked
                ex.transforms["usage_not_asked"] = refusal_text(refused.status, refused.text)
                notify(self.observers, "on_retry", ex)  # the log records what was re-sent
                # (on that line only: a later line of the exchange, a compaction's retry, is
                # no re-sending of this kind)
                del ex.transforms["usage_not_asked"]
                content = unasked_raw if unasked_raw is not None else dump_body(unasked)
                watch, second = None, True

    def _usage_option_refused(self, ex: Exchange, status: int) -> bool:
        """Remember that the upstream refused ``stream_options`` for ``ex``'s model (said on
        stderr once per model, for the first ``_USAGE_REFUSED_KEPT``; past them every model is
        asked again, and refuses once more)."""
        model = ex.model
        if model in self.usage_refused or len(self.usage_refused) >= _USAGE_REFUSED_KEPT:
            return False
        self.usage_refused.add(model)
        # (a client's text on the terminal: quoted with its controls escaped, keys taken out)
        shown = without_values(redact_text(model or ""), exchange_keys(ex))
        log.warning(
            "upstream answered %d to the stream_options cachegate added for model %r: its "
            "streams go as the client sends them, and their tokens and cost are known only if "
            "the upstream sends usage unasked or the client asks (upstream.request_usage = false "
            "stops asking every model)",
            status,
            shown,
        )
        return True

    def request_usage(
        self, ex: Exchange, body: dict[str, Any], raw: bytes
    ) -> tuple[dict[str, Any], bytes | None]:
        """Ask for stream usage the client did not ask for. Returns the body and, when only the
        option was added to an otherwise untouched body, the raw bytes with it spliced in."""
        if not (ex.stream and self.asks_usage) or ex.model in self.usage_refused:
            return body, None
        options = body.get("stream_options")
        if isinstance(options, dict) and (
            options.get("include_usage")
            # vLLM's and SGLang's own option: there, an object without ``include_usage`` asks
            # for usage (their default is true): the client gets it, and it was taken out
            or ("include_usage" not in options and "continuous_usage_stats" in options)
        ):
            return body, None
        if options is not None and not isinstance(options, dict):
            return body, None  # ("x", []: the provider's to refuse, as without cachegate)
        ex.strip_usage = True
        if body is ex.client_body and "stream_options" not in body:
            spliced = splice_usage_option(raw)
            if spliced is not None:
                return {**body, "stream_options": {"include_usage": True}}, spliced
        base = options if isinstance(options, dict) else {}
        if base.get("continuous_usage_stats"):
            # (``include_usage`` false beside it: vLLM sends no usage at all, and asked for it
            # with this on, it put usage in every chunk, which the client had refused: the
            # usage asked for is the last event's alone)
            base = {k: v for k, v in base.items() if k != "continuous_usage_stats"}
        return {**body, "stream_options": {**base, "include_usage": True}}, None

    async def handle(
        self, scope: Scope, receive: Receive, send: Send, path_session: str | None
    ) -> None:
        self.in_flight += 1
        self.idle.clear()
        entered: list[SessionState] = []  # (the session, once resolved: at work until the end)
        try:
            await self._handle(scope, receive, send, path_session, entered)
        finally:
            for state in entered:
                self.leave(state)
            self._one_done()

    def leave(self, state: SessionState) -> None:
        """A request of ``state`` is done: the session's idle time, and its kept bodies', run
        from now (``memos_for`` forgets bodies idle past the sessions' TTL)."""
        now = self.clock()
        self.sessions.leave(state, now)
        key = state.extra.get("memo_key")
        if key is not None:
            self.memos.touch(key, now)

    def _pairing_on(self, ex: Exchange, headers: Mapping[str, str]) -> bool:
        """Whether the repair or strict mode is on for a request (its X-Cachegate-Repairs is
        sent: 0 on a refusal; none with both off, where nothing was checked)."""
        return self.settings.pairing.repair or ex.strict or strict_pairing(self.settings, headers)

    def _refusal_headers(
        self,
        ex: Exchange,
        state: SessionState | None,
        headers: Mapping[str, str],
        path_session: str | None,
    ) -> list[tuple[bytes, bytes]]:
        """cachegate's own headers on an answer it gives before forwarding."""
        sid = state.id if state is not None else _explicit_or_none(headers, path_session)
        extra = [(b"x-cachegate-session", sid.encode())] if sid is not None else []
        if self._pairing_on(ex, headers):
            extra.append((b"x-cachegate-repairs", str(len(ex.repairs)).encode()))  # as forwarded
        return extra

    def _held(
        self, ex: Exchange, headers: Mapping[str, str], path_session: str | None, now: float
    ) -> SessionState | None:
        """For a request refused or stopped before its session was resolved (a body too large,
        not JSON, without messages; cachegate stopping during its upload): the session it named,
        if held, which then has the refusal in its log (none is made for it: refusals cost
        nothing, and would push real sessions out)."""
        sid = _explicit_or_none(headers, path_session)
        state = self.sessions.get(sid, now) if sid is not None else None
        if state is not None:
            state.last_seen = now
            ex.session_id, ex.session = state.id, state
            ex.exchange_id = state.next_exchange()
        return state

    @contextlib.contextmanager
    def at_work(self) -> Iterator[None]:
        """One more exchange whose observers have not all run, not the chat route's own (a
        Responses API request's, which the gateway serves): ``idle`` waits for it too (the
        shutdown, so that it still logs its response)."""
        self.in_flight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self._one_done()

    def _one_done(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self.idle.set()

    def _before_forward(self, ex: Exchange) -> None:
        """Run the request's observers (its log line, the streams gauge) soon, off the path
        between the client's request and the upstream's: on the loop's next turn, ahead of the
        same exchange's response observers (see ``_after_response``); ``request_noted`` records
        that they ran."""
        self._queue(ex, True)

    def _request_observers(self, ex: Exchange) -> None:
        """The request's observers now, if they have not run yet (before a retry is logged)."""
        if ex.request_noted:
            return
        ex.request_noted = True
        notify(self.observers, "on_request", ex)

    def _after_response(self, ex: Exchange) -> None:
        """Run the observers of a finished exchange soon, off the relay's path.

        Streams started together end together: a thousand of them ending at once left ~200 ms of
        accounting, logging and metrics in one turn of the event loop, during which no other
        stream moved. Due observers are queued and run in slices of about ``OBSERVER_SLICE_S``,
        with the loop polling sockets between slices. A slice runs its entries together,
        observer by observer (``notify_each``): as many as the cost per entry measured so far
        says fit in it (at least one, at most ``OBSERVER_BATCH``), because one observer's code
        run for many exchanges in a row stays in the processor's caches where observers taking
        turns for each exchange evicted one another. Every observer sees the entries in the
        order they became due (an exchange's request before its response); ``in_flight`` counts
        them until they have run. The response the relay recorded is assembled here too, just
        before its observers see it.
        """
        self._queue(ex, False)

    def _queue(self, ex: Exchange, request: bool) -> None:
        self._due.append((ex, request))
        self.in_flight += 1
        self.idle.clear()
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        due = self._due
        started = begun = time.perf_counter()
        try:
            while due:
                size = min(len(due), OBSERVER_BATCH, int(OBSERVER_SLICE_S / self._entry_s) or 1)
                calls: list[tuple[bool, Exchange]] = []
                for _ in range(size):
                    ex, request = due.popleft()
                    if not request:
                        ex.assemble()
                    elif ex.request_noted:  # a retry ran them already
                        continue
                    else:
                        ex.request_noted = True
                    calls.append((request, ex))
                try:
                    notify_each(self.observers, calls)
                finally:
                    self.in_flight -= size
                    if not self.in_flight:
                        self.idle.set()
                now = time.perf_counter()
                # Up at once, down gradually: when costly entries (streams ending) follow cheap
                # ones, only the first batch of them is sized by the cheap ones; a cheap batch or
                # two do not make the next one long.
                cost = (now - begun) / size
                self._entry_s = max(cost, 1e-7, self._entry_s + (cost - self._entry_s) / 4)
                begun = now
                if now - started > OBSERVER_SLICE_S:
                    break
        finally:
            if due:
                asyncio.get_running_loop().call_soon(self._drain)
            else:
                self._draining = False

    async def _handle(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        path_session: str | None,
        entered: list[SessionState],
    ) -> None:
        now = self.clock()
        headers = header_map(scope)
        ex = Exchange(
            route="chat",
            method="POST",
            path="chat/completions",
            started_at=now,
            t0=time.perf_counter(),
            user_agent=headers.get("user-agent", ""),
            query=scope.get("query_string", b""),
        )
        retry = headers.get("x-stainless-retry-count")
        if retry is not None:
            ex.client_retry = retry_count(retry)
        state: SessionState | None = None
        watch: DisconnectWatch | None = None
        try:
            refuse_announced(headers, self.settings.server.max_body_bytes)
            reading = time.perf_counter()
            raw = await read_body(receive, self.settings.server.max_body_bytes, scope)
            ex.client_wait_s = time.perf_counter() - reading
            coding = headers.get("content-encoding")
            if coding is not None and coding.strip().lower() not in ("", "identity"):
                raw = decoded_request(coding, raw, self.settings.server.max_body_bytes)
            ex.request_bytes = len(raw)
            memo_key, memos, others = self.memos_for(raw, headers, path_session)
            parsed = parse_request(raw, memos, others)
            del memos, others  # (held no longer than the parse: the memos' budget decides)
            body = parsed.body
            model = body.get("model")
            ex.model = model if isinstance(model, str) else None
            ex.stream = body.get("stream") is True
            ex.client_body = body
            state, shared = self.resolve_session(headers, path_session, body, now)
            self.sessions.enter(state)
            entered.append(state)
            messages = body.get("messages")
            count = len(messages) if isinstance(messages, list) else 0
            if parsed.own is not None:  # spliced after other first bytes: those and the end
                new = parsed.own
            elif parsed.source is not None:  # spliced: only the bytes past its cut parsed anew
                at, kept = parsed.kept
                source = parsed.source
                new = (max(0, len(raw) - len(source.raw) + source.close - at), max(0, count - kept))
            else:  # the unchanged prefix it shares with the session's last request, by count
                new = (len(raw) * (count - shared) // count if count else len(raw), count - shared)
            anchor = anchor_of(messages)
            held = (len(raw), count)
            if (
                not shared
                and (parsed.own is not None or parsed.source is not None)
                and (anchor is None or id(anchor) not in state.owns)
            ):
                # Spliced onto a body of a conversation this session does not hold (its first
                # message is new to it): what it shares of that body's objects (a long prompt
                # every call of a classifier loop sends, each call a session of its own) is
                # that body's, counted there.
                held = new
            parts = extra_parts(messages, new[1], state, anchor)
            if held is new:
                parts = (parts[1], parts[1])
            self.sessions.weigh(state, held[0], held[1], new, anchor, parts)
            if memo_key is not None:
                self.remember_body(memo_key, raw, body, parsed, now, state)
            ex.session_id, ex.session = state.id, state
            ex.exchange_id = state.next_exchange()
            ex.strict = strict_pairing(self.settings, headers)
            ex.upstream_headers = upstream_request_headers(request_headers(scope), self.api_key())
            if coding is not None:  # forwarded as read: decoded
                ex.upstream_headers = [
                    h for h in ex.upstream_headers if h[0].lower() != b"content-encoding"
                ]
            watch = DisconnectWatch(receive)  # a client leaving during compaction cancels it too
            forwarded = body
            for transform in self.transforms:
                forwarded = await transform.apply(ex, state, forwarded)
            unasked = forwarded  # (sent instead if the upstream refuses the option)
            forwarded, spliced = self.request_usage(ex, forwarded, raw)
            if spliced is not None:
                content = spliced
            elif forwarded is body:
                content = raw  # nothing changed: the client's exact bytes
            else:
                content = dump_body(forwarded)
            ex.body = forwarded
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if watch is not None:
                watch.stop()
            if task is None:
                raise
            task.uncancel()
            ex.interrupted = True
            if state is None:  # (stopped while the body was arriving)
                state = self._held(ex, headers, path_session, now)
            if watch is None or not watch.disconnected:  # cachegate is stopping
                ex.stopped = True
                err = shutting_down()
                ex.status, ex.error = err.status, err.message
                notify(self.observers, "on_error", ex)
                await send_error(send, err, self._refusal_headers(ex, state, headers, path_session))
                return
            ex.status = CLIENT_CLOSED
            ex.error = "client disconnected before the request was forwarded"
            notify(self.observers, "on_error", ex)
            return
        except Exception as exc:
            if watch is not None:
                watch.stop()
            if isinstance(exc, ProxyError):
                err = exc
            else:
                log.exception("chat pipeline failed before forwarding")
                err = internal_error(exc)
            ex.status = err.status
            ex.error = err.message
            ex.interrupted = err.status == CLIENT_CLOSED  # the client left while sending its body
            if state is None and err.status < 500:
                state = self._held(ex, headers, path_session, now)
            notify(self.observers, "on_error", ex)
            try:
                await send_error(
                    send, err, self._refusal_headers(ex, state, headers, path_session), receive
                )
            finally:
                # (the error's traceback holds this frame, which holds the error and the body:
                # a cycle only a collection would free, which runs seldom, a refused body of up
                # to 64 MiB held till then, each time)
                del err
            return
        self._before_forward(ex)
        extra = [(b"x-cachegate-session", state.id.encode())]
        if self._pairing_on(ex, headers):  # (none with both off: nothing was checked)
            extra.append((b"x-cachegate-repairs", str(len(ex.repairs)).encode()))
        if ex.compacted:
            extra.append((b"x-cachegate-compacted", b"1"))
        compactor = self.compactor
        too_long = compaction.is_context_length_error if compactor else None
        try:
            try:
                await self._forward(
                    ex,
                    scope,
                    receive,
                    send,
                    content,
                    unasked,
                    raw if unasked is body else None,
                    extra,
                    watch,
                    too_long,
                )
            except RetryRequest as retry:
                # The provider refused a history too long for its window: compact now, retry once.
                assert compactor is not None
                self._request_observers(ex)  # the refused attempt's line first, as it was sent
                log.info("session %s: context length exceeded; compacting", state.id)
                ex.status = 0
                watch = DisconnectWatch(receive)  # a client leaving now cancels the summary call
                try:
                    forwarded = await compactor.apply(
                        ex,
                        state,
                        self.pairing.repair(ex, body, state),
                        force=True,
                        window=compaction.provider_window(retry.text),
                        overcount=_overcount(ex.body, retry.text),
                        reserved=compaction.reserved_output(retry.text, ex.body),
                        counted=compaction.provider_prompt_tokens(retry.text),
                    )
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    watch.stop()
                    # the provider's refusal, counted as when the retry goes (not relayed: the
                    # exchange's answer is none, or cachegate's own)
                    notify(self.observers, "on_refused", ex)
                    if task is None:
                        raise
                    task.uncancel()
                    ex.interrupted = True
                    if not watch.disconnected:  # cachegate is stopping
                        ex.stopped = True
                        err = shutting_down()
                        ex.status, ex.error = err.status, err.message
                        await send_error(send, err, extra)
                        return
                    ex.status = CLIENT_CLOSED
                    ex.error = "client disconnected while the history was being compacted"
                    ex.unread = True
                    return
                except ProxyError as err:  # nothing reached the client yet: OpenAI's shape
                    watch.stop()
                    notify(self.observers, "on_refused", ex)  # (as above)
                    ex.status = err.status
                    ex.error = err.message
                    await send_error(send, err, extra)
                    return
                except Exception:
                    # cachegate's own defect: the client gets the provider's refusal as it came
                    # (an agent that compacts on context_length_exceeded itself still can)
                    log.exception(
                        "compaction after a context-length refusal failed; the provider's "
                        "refusal is relayed"
                    )
                    forwarded = None
                compacted = forwarded
                if forwarded is not None:
                    forwarded, _ = self.request_usage(ex, forwarded, b"")
                if forwarded is None or forwarded == ex.body:
                    # Nothing could be compacted: the retry would be the very body refused. The
                    # client gets the provider's refusal as it came, and nothing is sent again.
                    if forwarded is not None:
                        log.info("session %s: nothing to compact; the refusal is relayed", state.id)
                    watch.stop()
                    ex.status, ex.upstream_error = retry.status, "status"
                    ex.error = refusal_text(retry.status, retry.text)
                    await _relay_refusal(send, retry, extra)
                    return
                log.info("session %s: retrying the compacted history", state.id)
                ex.body = forwarded
                notify(self.observers, "on_refused", ex)  # the provider's refusal, counted
                notify(self.observers, "on_retry", ex)  # the log records what was re-sent
                if ex.compacted and (b"x-cachegate-compacted", b"1") not in extra:
                    extra.append((b"x-cachegate-compacted", b"1"))
                try:
                    await self._forward(
                        ex,
                        scope,
                        receive,
                        send,
                        dump_body(forwarded),
                        compacted,
                        None,
                        extra,
                        watch,
                        None,
                    )
                except RetryRequest as again:  # (cannot happen: nothing else is retried)
                    await _relay_refusal(send, again, extra)
        finally:
            # (a retry's compaction cut by the client or a shutdown: its time since arrival,
            # not the refused first attempt's, which the relay wrote)
            ex.duration_s = time.perf_counter() - ex.t0
            self._after_response(ex)


async def _relay_refusal(
    send: Send, refused: RetryRequest, extra: list[tuple[bytes, bytes]]
) -> None:
    """The upstream's refusal to the client as it came (its bytes, content type and coding)."""
    ctype = refused.content_type or b"application/json"
    own = {name for name, _ in extra}  # (cachegate's own win over an upstream's)
    answer = [*(h for h in refused.headers if h[0] not in own), (b"content-type", ctype), *extra]
    if refused.encoding:  # relayed as it came: said how it came
        answer.append((b"content-encoding", refused.encoding))
    await send({"type": "http.response.start", "status": refused.status, "headers": answer})
    await send({"type": "http.response.body", "body": refused.body})


def refuses_usage_option(status: int, text: bytes) -> bool:
    """Whether an upstream's 400 or 422 refuses ``stream_options`` (Mistral: 422
    ``extra_forbidden`` at ``["body", "stream_options"]``; Azure OpenAI's older API versions: 400
    ``Unrecognized request argument supplied: stream_options``): by what the error says (its
    message, param, code, a validation error's location and text), not by what it echoes of the
    request (a validation error's ``input``: a message that mentions stream_options)."""
    if status not in (400, 422) or b"stream_options" not in text:
        return False
    try:
        said = orjson.loads(text)
    except orjson.JSONDecodeError:
        return True  # a refusal in plain words that names it
    return any("stream_options" in _ECHOED.sub("", words) for words in _error_words(said, 0))


# What a validation error's text quotes of the request (pydantic: ``input_value={...},``)
_ECHOED = re.compile(r"input_value=.*?(?:, input_type=|\]|$)", re.DOTALL)
_ECHO_KEYS = frozenset({"input", "body", "ctx", "url"})


def _error_words(value: Any, depth: int) -> list[str]:
    """The strings of an error body and the keys they stand under, without the fields that
    echo the request (``_ECHO_KEYS``)."""
    if depth > 8:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [w for item in value for w in _error_words(item, depth + 1)]
    if isinstance(value, dict):
        return [
            w
            for key, item in value.items()
            if key not in _ECHO_KEYS
            for w in _error_words(item, depth + 1)
        ]
    return []


def _overcount(sent: Any, refusal: bytes) -> float:
    """How many times cachegate's estimate of the refused body ``sent`` the provider counted it,
    when its refusal says (1.0 when it does not, or counted less)."""
    said = compaction.provider_prompt_tokens(refusal)
    if not said:
        return 1.0
    estimate = compaction.body_estimate(sent)
    return max(1.0, said / estimate) if estimate > 0 else 1.0


def dump_body(body: Any) -> bytes:
    """A request body cachegate changed, as JSON bytes: orjson's, or the standard library's for
    what orjson does not write (content nested deeper than 254 levels, which a client may send
    and orjson reads up to 1,024; an integer beyond 64 bits from a lenient parse). A repair of
    such a body was a 500 of cachegate's."""
    try:
        return orjson.dumps(body)
    except TypeError:  # (orjson.JSONEncodeError is one)
        try:
            return prefix.deep_dumps(body, separators=(",", ":")).encode()
        except RecursionError:  # deeper than orjson reads: not met from a client's JSON
            raise bad_request(
                "The request is nested too deeply for cachegate to send it again after"
                " repairing or compacting it.",
                "invalid_body",
            ) from None
