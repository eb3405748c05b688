"""Forward a request upstream and stream the answer back, byte for byte, teeing it to a recorder.

The relay knows nothing about pairing, caching or logs: it forwards what it is given, sends the
client the upstream's bytes as they arrive (less the one usage event cachegate asked for, when told
to strip it), feeds the same bytes to a side-channel recorder, and fills in the exchange's timings
and outcome. A client that hangs up cancels the upstream request at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import re
import time
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Final
from urllib.parse import SplitResult, urlsplit

import httpx
import orjson
import zstandard

from proxy.assemble import (
    AssembledResponse,
    StreamRecorder,
    assemble_completion,
    read_answer,
)
from proxy.config import shown_url
from proxy.errors import (
    CLIENT_CLOSED,
    STOPPED_CUT,
    ProxyError,
    bad_request,
    body_cut,
    http_date,
    shutting_down,
    too_large,
    upstream_busy,
    upstream_invalid,
    upstream_timeout,
    upstream_unreachable,
)
from proxy.pipeline import Exchange, RefusedAnswer, UnreadableAnswer, refusal_text
from proxy.redact import PLACEHOLDER_KEY
from proxy.resanswers import ResponsesRecorder, assemble_response
from proxy.sessions import CREDENTIAL_HEADERS
from proxy.sessions import GATEWAY_KEY_HEADERS as GATEWAY_KEY_NAMES  # (by name: bytes here)
from proxy.strip import EVENT_ENDS, UsageEventStripper, without_lf_nulls
from proxy.upstream import InvalidAnswer, SizedStream, UpstreamPool, UpstreamResponse

log = logging.getLogger(__name__)

# A read ending in a blank line whose line ends run longer (three in a row, or mixed): the
# stripper pairs them up as an SSE reader does.
_LINE_ENDS = (b"\n", b"\r")

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Request headers cachegate sets itself or that only concern cachegate (``Expect``: the body is
# read whole before the request is forwarded, so there is nothing to wait for).
_DROP_REQUEST = HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"accept-encoding",
    b"expect",
    b"x-cachegate-strict",
}
UPSTREAM_WARN_EVERY_S = 30.0  # an unreachable upstream is logged at most this often
MAX_RECORDED_BODY = 32 * 1024 * 1024  # non-streamed bodies larger than this are relayed, not parsed


class UpstreamAborted(Exception):
    """The upstream broke off mid-response; the client's connection is cut the same way."""


class DecodedTooLarge(ValueError):
    """A compressed stream decodes to more than ``MAX_DECODED_STREAM``: cachegate cuts it."""


def _own_error(exc: BaseException) -> ProxyError | None:
    """cachegate's own error raised inside a streamed request body, wrapped by the transport."""
    current: BaseException | None = exc
    for _ in range(8):
        if current is None:
            return None
        if isinstance(current, ProxyError):
            return current
        current = current.__cause__ or current.__context__
    return None


class RetryRequest(Exception):
    """The upstream refused in a way the caller can fix (``retry_if``); nothing reached the client."""

    def __init__(
        self,
        status: int,
        body: bytes,
        content_type: bytes = b"",
        encoding: bytes = b"",
        text: bytes | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(status)
        self.status = status
        self.body = body  # as the upstream sent it (identity asked for; an odd one not undone)
        self.content_type = content_type
        self.encoding = encoding  # its Content-Encoding, to relay it with
        self.text = body if text is None else text  # its coding undone, to read
        # its other end-to-end headers (Date, a request id), to relay it with
        self.headers = headers or []


_UvicornCycle: Any
try:  # uvicorn's HTTP/1.1 protocol on httptools, the one cachegate serves with
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as _UvicornCycle
except ImportError:  # pragma: no cover - httptools is a dependency
    _UvicornCycle = None


class DisconnectWatch:
    """Cancels the relaying task the moment the client disconnects (uvicorn's ``send`` is silent).

    Under uvicorn's httptools protocol, once the request body is read, the watch waits on the
    request cycle's own event (set when the connection is lost) through a future with a callback:
    no task per request. Otherwise (any other server, a body still being uploaded, a uvicorn whose
    internals differ) a task waits on ``receive`` for ``http.disconnect``.
    """

    __slots__ = ("_cycle", "_done", "_task", "_waiter", "_watcher", "disconnected")

    taskless = 0  # watches that used the cycle's event (for tests and the benchmark)

    def __init__(self, receive: Receive, after: asyncio.Event | None = None) -> None:
        """Watch for the current task. With ``after``, start listening only once it is set (the
        request body is still being read from ``receive`` until then)."""
        self.disconnected = False
        self._done = False
        self._task = asyncio.current_task()
        self._watcher: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[Any] | None = None
        self._cycle: Any = _watchable_cycle(receive) if after is None else None
        if self._cycle is not None:
            DisconnectWatch.taskless += 1
            self._cycle.flow.resume_reading()  # as uvicorn's receive does before it waits
            self._arm()
            return
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive, after))

    def _arm(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        waiter.add_done_callback(self._woken)
        self._waiter = waiter
        self._cycle.message_event._waiters.append(waiter)

    def _woken(self, waiter: asyncio.Future[Any]) -> None:
        self._waiter = None
        if self._done or waiter.cancelled():
            return
        cycle = self._cycle
        if cycle.disconnected or cycle.response_complete:  # what receive() reports as a disconnect
            if self._task is not None:
                self.disconnected = True
                self._task.cancel()
            return
        cycle.message_event.clear()  # woken for something else: as receive() does, and wait again
        self._arm()

    async def _watch(self, receive: Receive, after: asyncio.Event | None) -> None:
        if after is not None:
            await after.wait()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self._done and self._task is not None:
                    self.disconnected = True
                    self._task.cancel()
                return

    def stop(self) -> None:
        self._done = True
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            # Out of the event's waiters and its callback dropped (the callback holds this
            # object); the pending future then simply goes away with its last reference.
            waiter.remove_done_callback(self._woken)
            with contextlib.suppress(ValueError, AttributeError):
                self._cycle.message_event._waiters.remove(waiter)
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            # Dropped before it is cancelled: the cancelled task's traceback holds this object
            # (the watching frame's ``self``), and holding the task back would make a reference
            # cycle per request that only a full garbage collection frees.
            watcher.cancel()


def _watchable_cycle(receive: Receive) -> Any:
    """uvicorn's httptools request cycle behind ``receive`` when its whole body has been read and
    it has the attributes the watch relies on (an ``asyncio.Event`` keeping its waiters in a
    deque); else None."""
    cycle: Any = getattr(receive, "__self__", None)
    if _UvicornCycle is None or type(cycle) is not _UvicornCycle:
        return None
    try:
        event = cycle.message_event
        ok = type(event) is asyncio.Event and isinstance(event._waiters, collections.deque)
        ok = ok and cycle.more_body is False and not cycle.body and not event.is_set()
        ok = ok and isinstance(cycle.disconnected, bool) and not cycle.disconnected
        ok = ok and not cycle.response_complete and callable(cycle.flow.resume_reading)
    except AttributeError:
        return None
    return cycle if ok else None


def _coding(response: httpx.Response | UpstreamResponse) -> str:
    """The answer's content coding, lower-cased (codings are case-insensitive); "" for none."""
    coding = response.headers.get("content-encoding", "").strip().lower()
    return "" if coding == "identity" else coding


# Codings cachegate can undo (zlib's auto-detected gzip or zlib header); others (br, zstd) not.
_DECODABLE: Final = frozenset({"gzip", "x-gzip", "deflate"})

REFUSAL_READ_MAX: Final = 1024 * 1024
"""The most of a 400, 413 or 422 answer read whole to judge whether to send the request again
(a ``stream_options`` refusal, a history too long to compact): past it, relayed as it comes."""


def _decode(coding: str, body: bytes, strict: bool = False) -> bytes:
    """``body`` with its content coding undone; ``body`` as it is when it cannot be, or when it
    would come to more than ``MAX_RECORDED_BODY`` (a compressed body of a few MB can hold GBs).
    ``strict``: bytes that are not what their gzip or deflate coding says raise ``zlib.error``
    (a body sent plain under the label: the SDKs fail on it)."""
    if coding not in _DECODABLE:
        return body
    failed: zlib.error | None = None
    for wbits in _WBITS[coding]:
        decoder = zlib.decompressobj(wbits)
        try:
            plain = decoder.decompress(body, MAX_RECORDED_BODY)
        except zlib.error as exc:
            failed = failed or exc
            continue
        return body if decoder.unconsumed_tail else plain
    if strict and failed is not None:
        raise failed
    return body


def decoded_answer(response: httpx.Response | UpstreamResponse, body: bytes) -> bytes:
    """``body``, ``response``'s whole answer, with its gzip or deflate coding undone (an
    upstream that compresses although cachegate asks for ``identity``), as the relay reads one
    for the log; as it is otherwise, and where httpx's ``aread`` undid it already (gzip,
    deflate: a JSON text read again as raw deflate can come out as bytes of nothing; not
    ``x-gzip``, which httpx leaves)."""
    coding = _coding(response)
    if isinstance(response, httpx.Response) and coding in ("gzip", "deflate"):
        return body
    return _decode(coding, body)


# How each coding may be framed: gzip's or zlib's header (zlib tells them apart), else a raw
# deflate stream, which some servers send as "deflate" (HTTP clients read both).
_WBITS: Final = {
    "gzip": (zlib.MAX_WBITS | 32,),
    "x-gzip": (zlib.MAX_WBITS | 32,),
    "deflate": (zlib.MAX_WBITS | 32, -zlib.MAX_WBITS),
}


def decoded_request(coding: str, body: bytes, limit: int) -> bytes:
    """A request's body with its ``Content-Encoding`` undone (gzip, deflate or zstd: Codex CLI
    compresses its requests with zstd), for the pipeline to read; at most ``limit`` bytes of it
    (413 beyond, as for a plain body). Another coding, or bytes that are not what the coding
    says, is refused in OpenAI's shape."""
    coding = coding.strip().lower()
    if coding == "zstd":
        return _zstd_request(body, limit)
    if coding not in _DECODABLE:
        raise ProxyError(
            415,
            f"cachegate cannot read a chat request in Content-Encoding {coding!r}: send it "
            "uncompressed, or compressed with gzip, deflate or zstd.",
            code="unsupported_content_encoding",
        )
    for wbits in _WBITS[coding]:
        try:
            plain = _members(body, wbits, limit)
        except zlib.error:
            continue
        if plain is not None:
            return plain
        break  # cut short, or followed by bytes of no member
    raise bad_request(
        f"The request body is not valid {coding}: it could not be decompressed (or it holds"
        f" more than {_MAX_MEMBERS} gzip members).",
        code="invalid_content_encoding",
    )


def _zstd_request(body: bytes, limit: int) -> bytes:
    """A zstd request body (one frame, RFC 8878) decoded, at most ``limit`` bytes of it: a
    frame that says its size is refused past ``limit`` before anything is decoded; any frame
    (a streaming encoder's, as Codex CLI's, says none) is fed to the decoder in pieces small
    enough that one decodes little past what is left of ``limit`` (a block of 4 bytes can hold
    128 KB: at most 2 MiB past it, from the smallest pieces), so that a bomb is refused once
    past it, and no buffer of the limit's size is asked for (a limit larger than the memory at
    hand failed every request). A frame cut short, or followed by anything (another frame,
    other bytes), is no body cachegate reads."""
    frame = zstandard.ZstdDecompressor().decompressobj()
    out: list[bytes] = []
    produced = at = 0
    try:
        if zstandard.frame_content_size(body) > limit:
            raise too_large(limit)
        while at < len(body) and not frame.eof:
            step = max(_ZSTD_MIN_PIECE, (limit - produced) // _ZSTD_MOST_PER_BYTE)
            plain = frame.decompress(body[at : at + step])
            at += step
            produced += len(plain)
            if produced > limit:
                raise too_large(limit)
            out.append(plain)
    except zstandard.ZstdError as exc:
        raise bad_request(
            f"The request body is not valid zstd ({exc}).", code="invalid_content_encoding"
        ) from None
    if not frame.eof or frame.unused_data or at < len(body):
        raise bad_request(
            "The request body is not valid zstd: "
            + ("its frame is cut short." if not frame.eof else "cachegate reads one zstd frame.")
            + " Send it whole, in one frame, or uncompressed.",
            code="invalid_content_encoding",
        )
    return b"".join(out)


# What one byte of a zstd frame can decode to, at most (an RLE block: 4 bytes, 128 KB), with
# room to spare; and the smallest piece fed (each call costs ~1 µs; 64 bytes of RLE blocks
# decode to 2 MiB, what a bomb may decode past the limit before it is refused).
_ZSTD_MOST_PER_BYTE: Final = 65536
_ZSTD_MIN_PIECE: Final = 64


def _members(body: bytes, wbits: int, limit: int) -> bytes | None:
    """``body`` decoded: gzip members one after another as gzip reads them (RFC 1952), one
    zlib or raw deflate stream otherwise; None when it stops short or bytes follow that are
    no member. Raises ``zlib.error`` when it is not that coding; 413 past ``limit`` bytes."""
    out: list[bytes] = []
    size = 0
    copied, budget = 0, 2 * len(body) + (1 << 16)  # (what the members' rests copy, at most)
    for _ in range(_MAX_MEMBERS):
        copied += len(body)
        if copied > budget:  # empty members before a large one: each copied the large rest
            return None
        decoder = zlib.decompressobj(wbits)
        plain = decoder.decompress(body, limit + 1 - size)
        size += len(plain)
        if size > limit or decoder.unconsumed_tail:
            raise too_large(limit)
        out.append(plain)
        if not decoder.eof:
            return None
        body = decoder.unused_data
        if not body:
            return b"".join(out)
        if wbits != _GZIP_WBITS or not body.startswith(b"\x1f\x8b"):
            return None
    return None  # (each member copies the rest of the body: thousands would hold the loop)


_GZIP_WBITS: Final = zlib.MAX_WBITS | 32
# gzip members read in one body: clients write one; 160,000 empty ones held the event loop 9 s,
# and 63 before a 64 MB one 4 s (so what their rests copy is bounded too).
_MAX_MEMBERS: Final = 64


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _then(data: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``data``, then what ``rest`` has left: an answer read in part, relayed whole."""
    yield data
    async for chunk in rest:
        yield chunk


async def _then_raise(data: bytes, exc: BaseException) -> AsyncIterator[bytes]:
    """``data``, then ``exc``: an answer read in part, relayed as it broke off."""
    if data:
        yield data
    raise exc


def refuse_announced(headers: Mapping[str, str], limit: int) -> None:
    """A 413 ``ProxyError`` for a request whose ``content-length`` announces more than ``limit``
    bytes: refused before any of it is read or forwarded (it waited for the limit's worth, and a
    relayed upload had sent that much upstream)."""
    length = headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) > limit:
        raise too_large(limit, unread=int(length) > 0)


async def read_body(receive: Receive, limit: int, scope: Scope | None = None) -> bytes:
    """The whole request body; a 413 ``ProxyError`` past ``limit`` bytes, a 499 when the client
    leaves before it is whole (also before its first byte: read as an empty body, it was a 400
    ``invalid_json`` counted as the client's error), a 400 ``invalid_http`` when the HTTP
    server refused the rest of it (``body_cut``: ``scope`` says so)."""
    message = await receive()
    if message["type"] == "http.disconnect":
        raise body_cut(scope, "client disconnected while sending the request")
    body = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise too_large(limit)
        return body
    parts = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise body_cut(scope, "client disconnected while sending the request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit, unread=message.get("more_body", False))
        parts.append(chunk)
    return b"".join(parts)


# Request headers that carry a client's own key: with any of them, cachegate adds none of its own.
CLIENT_KEY_HEADERS: Final = frozenset(name.encode() for name in CREDENTIAL_HEADERS)
# Those with a client's key for a gateway between cachegate and the provider (``sessions``')
GATEWAY_KEY_HEADERS: Final = frozenset(name.encode() for name in GATEWAY_KEY_NAMES)


# The key a client that must send one (the OpenAI SDKs refuse to start without) sends to have
# cachegate's own key used instead: ``OPENAI_API_KEY=cachegate`` in the agent's environment.
PLACEHOLDER_AUTHORIZATION: Final = b"Bearer " + PLACEHOLDER_KEY.encode()
_PLACEHOLDER_WORDS: Final = PLACEHOLDER_AUTHORIZATION.lower().split()  # any case and spacing


def _connection_listed(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names a ``Connection`` header declares hop-by-hop (RFC 9110 7.6.1)."""
    names = [
        token.strip().lower() for k, v in headers if k == b"connection" for token in v.split(b",")
    ]
    return frozenset(n for n in names if n)


def upstream_request_headers(
    scope_headers: list[tuple[bytes, bytes]], api_key: str | None
) -> list[tuple[bytes, bytes]]:
    """Client headers minus hop-by-hop ones; identity encoding; the configured key if the client
    brought none (in ``Authorization`` or another provider's key header, ``CLIENT_KEY_HEADERS``:
    a client talking to Azure or Anthropic through cachegate must not have the OpenAI key sent
    along with its own). A key header the client's ``Connection`` header lists is dropped and not
    replaced: the client chose to send no key. The placeholder key ``cachegate``
    (``PLACEHOLDER_AUTHORIZATION``) is replaced by the configured key when there is one."""
    headers = []
    connection = authorized = False
    for header in scope_headers:  # one pass: the usual request has no Connection header
        name = header[0]
        if name in _DROP_REQUEST:
            connection = connection or name == b"connection"
            continue
        if name in CLIENT_KEY_HEADERS:
            if (
                api_key
                and name == b"authorization"
                and len(header[1]) < 40  # a real key is longer: not split on every request
                and header[1].lower().split() == _PLACEHOLDER_WORDS
                and api_key.strip()  # (white space only: no key to put in its place)
            ):
                continue
            authorized = True
        headers.append(header)
    if connection:  # and the names it lists (RFC 9110 7.6.1)
        listed = _connection_listed(scope_headers)
        headers = [header for header in headers if header[0] not in listed]
    headers.append((b"accept-encoding", b"identity"))
    if api_key and not authorized:
        value = bearer(api_key)
        if value:
            headers.append((b"authorization", value))
    return headers


@functools.lru_cache(maxsize=4)
def bearer(api_key: str) -> bytes:
    """The ``Authorization`` value for the configured key, surrounding white space (a line end
    read from a file) taken off. A key with a character a header cannot carry (a line break
    would end the header and start another) is cachegate's configuration error, answered as a
    500 that names the setting, never the key. Empty for a key of white space only (unset)."""
    key = api_key.strip()
    if not key:
        return b""
    value = b""
    with contextlib.suppress(UnicodeEncodeError):
        value = b"Bearer " + key.encode("latin-1")
    if not value or any(c < 0x20 or c == 0x7F for c in value):
        raise ProxyError(
            500,
            "The API key cachegate adds to requests without one has a character an HTTP header "
            "cannot carry (a line break, a control or a non-Latin-1 character): check the "
            "environment variable that upstream.api_key_env names.",
            type="server_error",
            code="internal_error",
        )
    return value


# What no header value may hold (uvicorn refuses to send it): a control character but the tab
_CONTROL: Final = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def client_response_headers(
    upstream: httpx.Response | UpstreamResponse,
    *,
    drop_length: bool,
    extra: list[tuple[bytes, bytes]],
    drop_coding: bool = False,
) -> list[tuple[bytes, bytes]]:
    raw = [(k.lower(), v) for k, v in upstream.headers.raw]
    # The names looked at, in one pass; the names dropped, one set made once (it was made anew
    # for each of them, and the headers walked once for each look: ~11,000 instructions of a
    # small answer's, a review's callgrind count)
    ctypes: list[bytes] = []
    drop = set(HOP_BY_HOP)
    for k, v in raw:
        if k in _LOOKED_AT:
            if k == b"content-type":
                ctypes.append(v)
            elif k == b"connection":  # and the names it lists
                drop.update(_connection_listed([(k, v)]))
            else:  # transfer-encoding: chunks win (RFC 9112)
                drop_length = True
    drop.update([k for k, _ in extra])  # cachegate's own win over an upstream's
    if drop_length:
        drop.add(b"content-length")
    if drop_coding:  # the body goes decoded
        drop.add(b"content-encoding")
    headers = [(k, v) for k, v in raw if k not in drop]
    headers.extend(extra)
    if not _inert(ctypes):
        headers.extend(_SANDBOXED)
        if not any(k == b"x-content-type-options" for k, _ in headers):
            headers.append(_NOSNIFF)
    return headers


_LOOKED_AT: Final = frozenset((b"content-type", b"connection", b"transfer-encoding"))
_SANDBOXED: Final = ((b"content-security-policy", b"sandbox"),)
_NOSNIFF: Final = (b"x-content-type-options", b"nosniff")


def _inert(ctypes: list[bytes]) -> bool:
    """Whether a browser shows an answer of this media type as data, running nothing in it:
    JSON (``+json``, NDJSON) and an event stream. Any other (HTML, SVG, XML, none: a browser
    may sniff one) is given ``Content-Security-Policy: sandbox`` and ``nosniff``: a page an
    upstream served would otherwise run its scripts on cachegate's own origin, which the
    guard against web pages trusts (a top-level navigation to a relayed GET path is let
    through). One type only: given twice, or a list (``text/html,json``), a browser reads the
    last valid one, which is not ours to guess."""
    if len(ctypes) != 1 or ctypes[0].find(b",") >= 0:  # (not ``in``: README, Performance)
        return False
    media = ctypes[0].partition(b";")[0].strip().lower()
    return media.endswith(b"json") or media == b"text/event-stream"


def client_location(location: bytes, base_url: str, client_prefix: bytes) -> bytes:
    """An upstream's redirect target as the client should follow it: one inside the upstream's
    base URL (``http://127.0.0.1:8000/v1/chat/completions``, ``//host/v1/...`` or the path
    ``/v1/...``, in the base URL's own scheme) is given under the prefix the client used
    (``/v1``, ``/s/<id>/v1``), as a path on cachegate's own host; any other target (another
    scheme too: ``http`` to ``https`` is the upstream asking for TLS, which cachegate asked of
    it again would only repeat), one with ``.``/``..`` segments, or one that cannot be read as
    a URL, is left as it is. Relayed unchanged, a
    framework's redirect of a trailing slash sent the SDK, which follows redirects, to the
    provider directly: no log, no repair, and its key dropped on the way."""
    try:
        base = urlsplit(base_url.rstrip("/"))
        target = urlsplit(location.decode("latin-1"))
    except ValueError:  # (``http://[bad/x``: not a URL; the client's to refuse)
        return location
    if target.netloc:
        if target.scheme.lower() not in ("", base.scheme.lower()) or _origin(target, base) != (
            _origin(base, base)
        ):
            return location
    elif target.scheme or not target.path.startswith("/"):
        return location  # (another scheme; a relative reference resolves as it is)
    if target.path != base.path and not target.path.startswith(base.path + "/"):
        return location if target.netloc else _on_upstream(location, base)
    rest = target.path[len(base.path) :]
    if any(segment in (".", "..") for segment in rest.split("/")):
        # (it could lead out of the base: the upstream's to resolve)
        return location if target.netloc else _on_upstream(location, base)
    query = "?" + target.query if target.query else ""
    fragment = "#" + target.fragment if target.fragment else ""
    return client_prefix + (rest + query + fragment).encode("latin-1")


def _on_upstream(location: bytes, base: SplitResult) -> bytes:
    """A path-only redirect target outside the base URL as a URL on the upstream's origin (its
    scheme, host and port, never its ``user:password@``): as a path, the client resolved it
    against cachegate, which sent it to the upstream under the base's path (``/v1/echo`` of an
    upstream at ``/api/v1`` reached ``/api/v1/echo``), or answered its own 404."""
    host = base.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = base.port
    except ValueError:
        return location
    origin = f"{base.scheme}://{host}" + (f":{port}" if port is not None else "")
    return origin.encode("latin-1") + location


def _origin(url: SplitResult, base: SplitResult) -> tuple[str, int] | None:
    """The host and port ``url`` names (its default port if none, in ``base``'s scheme if it
    has none): ``http://user:pw@up:80/`` and ``//up/`` name one server. None for a bad port."""
    try:
        port = url.port
    except ValueError:
        return None
    scheme = (url.scheme or base.scheme).lower()
    return (url.hostname or "", port or (443 if scheme == "https" else 80))


def _client_prefix(scope: Scope, path: str) -> bytes:
    """The part of the client's path before the one relayed (``/v1``, ``/s/<id>/v1``)."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode("latin-1")
    raw = raw.split(b"?", 1)[0]
    tail = b"/" + path.encode("latin-1")
    return raw[: -len(tail)] if raw.endswith(tail) else b"/v1"


# How long the rest of a refused upload is read and dropped, at most, before its connection is
# closed (nginx's lingering close); each read may wait this long for the client's next bytes
DRAIN_S: Final = 10.0
DRAIN_IDLE_S: Final = 2.0


async def send_error(
    send: Send,
    err: ProxyError,
    extra: list[tuple[bytes, bytes]] | None = None,
    receive: Receive | None = None,
) -> None:
    """``err`` in OpenAI's shape. A 413 whose body the client is still sending (``err.unread``)
    is answered whole, then the rest of the upload read and dropped (given ``receive``) before
    the connection closes: closed at once, with the client's bytes unread, the kernel resets
    it, and a client still uploading (the async SDKs) lost the 413 for a connection error."""
    body = err.body()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"date", http_date()),
    ]
    if extra:
        headers.extend(extra)
    if err.status == 413:
        # The body is not read (refused from its announced length, or cut where it passed the
        # limit): what the client sends next on the connection would be taken for the rest of
        # it. Closed, as nginx closes after its 413 (RFC 9110 15.5.14).
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    if receive is None or not err.unread:
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return
    # (the answer whole, by its length, then the upload's rest; the server closes at the end)
    await send({"type": "http.response.body", "body": body, "more_body": True})
    stop = asyncio.Event()  # set when cachegate stops (``stop_draining``): no grace spent here
    _DRAINING.add(stop)
    reader = asyncio.ensure_future(_drain(receive))
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({reader, stopper}, timeout=DRAIN_S, return_when=asyncio.FIRST_COMPLETED)
    finally:
        _DRAINING.discard(stop)
        for task in (reader, stopper):
            task.cancel()
    await send({"type": "http.response.body", "body": b"", "more_body": False})


# Refused uploads being read and dropped (``send_error``), each ended by a stop at once
_DRAINING: set[asyncio.Event] = set()


def stop_draining() -> int:
    """cachegate is stopping: the refused uploads being read end now, their answers whole, so
    that they hold neither its grace period nor count as requests in flight. Returns how many
    there were (their tasks are still the server's until they end)."""
    stopping = list(_DRAINING)
    for stop in stopping:
        stop.set()
    return len(stopping)


async def _drain(receive: Receive) -> None:
    with contextlib.suppress(TimeoutError):
        while True:
            message = await asyncio.wait_for(receive(), DRAIN_IDLE_S)
            if message["type"] != "http.request" or not message.get("more_body", False):
                return


class _Tee:
    """The relay's side channel: every upstream chunk, as received, kept by the stream recorder
    (SSE; the relay appends to its ``chunks``) or collected whole (a JSON body, up to
    ``MAX_RECORDED_BODY``)."""

    __slots__ = ("coding", "collected", "labelled", "recorder", "responses", "size")

    def __init__(
        self,
        recorder: StreamRecorder | ResponsesRecorder | None,
        collect: bool,
        coding: str = "",
        responses: bool = False,
    ) -> None:
        self.recorder = recorder
        self.responses = responses  # a Responses API answer (``proxy.resanswers``), not chat's
        self.collected: list[bytes] | None = [] if collect else None
        self.size = 0
        self.coding = coding  # a collected body's content coding, undone to read it
        self.labelled = False  # collected by a recorder: a body labelled an event stream

    def take(self, chunk: bytes) -> None:
        """Collect one chunk of a JSON body; past the limit, the body is not kept."""
        if self.collected is not None:
            self.size += len(chunk)
            if self.size <= MAX_RECORDED_BODY:
                self.collected.append(chunk)
            else:
                self.collected = None

    def assemble(self, status: int) -> AssembledResponse | None:
        """The recorded stream's message, or the collected body's when it is a chat completion
        (``status`` below 400); None when nothing could be assembled. A body answered with a
        status of 400 or more raises ``RefusedAnswer`` with what it says; one whose status
        allows no body (204, 205, 304) ``UnreadableAnswer``: no answer, and nothing was cut."""
        if status in (204, 205, 304):
            said = {204: "No Content", 205: "Reset Content", 304: "Not Modified"}[status]
            raise UnreadableAnswer(
                f"upstream answered {status} ({said}): no answer in it",
                invalid=status != 304,  # (as the other 3xx: no broken answer, not counted)
            )
        if self.recorder is not None:
            try:
                assembled = self.recorder.finish()
            except Exception:
                log.exception("stream recorder failed to finish")
                return None
            recorder = self.recorder
            if not recorder.json_body:
                return assembled
            # a whole completion under an event stream's type: read as the body it is (the
            # exchange's ``recorder`` None: no stream, as the SDKs read none of it)
            self.recorder, self.collected, self.labelled = None, recorder.whole, True
        if status >= 400:
            if self.collected is None:  # past the limit: not kept
                raise RefusedAnswer(f"upstream answered {status}")
            body = _decode(self.coding, b"".join(self.collected))
            raise RefusedAnswer(refusal_text(status, body))
        if 300 <= status < 400:  # (relayed, its Location rewritten: the SDKs follow it)
            raise UnreadableAnswer(
                f"upstream redirected the request ({status}): no answer of its own",
                invalid=False,  # (valid HTTP, no broken answer: not counted as invalid)
            )
        if self.collected is not None:
            if self.coding and self.coding not in _DECODABLE:
                raise UnreadableAnswer(
                    f"upstream compressed its answer ({self.coding}) though asked not to: not read",
                    invalid=False,
                )
            try:
                body = _decode(self.coding, b"".join(self.collected), strict=True)
            except zlib.error as exc:  # (sent plain under a gzip label: the SDKs fail on it)
                raise UnreadableAnswer(
                    f"upstream's {self.coding} answer does not decode: {exc} (the openai SDKs"
                    " fail on it)"
                ) from None
            if not body:
                raise UnreadableAnswer(f"upstream answered {status} with an empty body")
            if body.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark, which JSON readers skip
                body = body[3:]
            try:
                parsed = read_answer(body)  # (a lone surrogate escape too, as the SDKs read it)
            except orjson.JSONDecodeError as exc:
                if self.labelled and _json_lines(body):
                    raise UnreadableAnswer(
                        "upstream sent newline-delimited JSON, not an event stream (no data:"
                        " lines): the openai SDKs read none of it"
                    ) from None
                raise UnreadableAnswer(
                    f"upstream answered {status} with a body that is not JSON "
                    f"({len(body)} bytes: {exc})"
                ) from None
            try:
                return assemble_response(parsed) if self.responses else assemble_completion(parsed)
            except Exception:
                log.debug("response body is not an answer cachegate reads", exc_info=True)
        return None


def _json_lines(body: bytes) -> bool:
    """Whether ``body`` opens with a line that is a JSON object of its own, more lines after it
    (an NDJSON stream: Ollama's own API, a gateway's)."""
    first, _, rest = body.lstrip().partition(b"\n")
    if not rest.strip():
        return False
    try:
        return isinstance(orjson.loads(first), dict)
    except orjson.JSONDecodeError:
        return False


class _Held:
    """Stands in for a transport while uvicorn writes a response's start: keeps the bytes."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.parts.append(data)


# A stream's last event, at the end of what was written (any of SSE's line ends; its start at
# a line's start). Bytes that end so are looked at with the tail of the writes before: a
# gateway may split the event across reads.
# ``[DONE]`` and two line ends of any of SSE's kinds: an SSE reader dispatches the event at the
# second one's first byte (a CR: the openai SDKs skip the LF after it), so the LF of a CRLF that
# has not come yet is no part of what the client needs.
_DONE_ENDS: Final = (
    b"]\n\n",
    b"]\n\r",
    b"]\n\r\n",
    b"]\r\r",
    b"]\r\r\n",
    b"]\r\n\n",
    b"]\r\n\r",
    b"]\r\n\r\n",
)
_DONE_EVENT: Final = re.compile(
    rb"(?:\A|[\r\n])data: ?\[DONE\](?:\n\n|\n\r\n?|\r\r\n?|\r\n\n|\r\n\r\n?)\Z"
)


def _ends_done(tail: bytes, body: bytes) -> tuple[bytes, bool]:
    """The tail to keep after writing ``body`` (the last write of 32 bytes or more, and those
    after it) and whether the bytes written end with a stream's ``[DONE]`` event. (The event
    itself: a model's text may say "[DONE]", never with a raw blank line; a short write is
    looked at with the end of the one before, which is kept, not copied.)"""
    tail = body if len(body) >= 32 else tail[-32:] + body
    return tail, (
        tail.endswith(_DONE_ENDS) and _DONE_EVENT.search(tail, max(0, len(tail) - 32)) is not None
    )


def _handed_over(cycle: Any) -> bool:
    """Whether what a server's ``send`` was last given went to its client's socket: for
    uvicorn's cycle, its client not gone (its ``send`` drops what comes after) and nothing left
    in the transport's buffer; for another server, that ``send`` returned."""
    if getattr(cycle, "disconnected", False) is not False:
        return False
    buffered = getattr(getattr(cycle, "transport", None), "get_write_buffer_size", None)
    return buffered is None or buffered() == 0


class DirectBody:
    """Response body chunks written straight to the client's transport, for uvicorn's httptools
    protocol: what its ``send`` does for a body chunk (chunked framing, or counting down the
    declared length), without a coroutine and an ASGI message per chunk. Together with
    ``UpstreamResponse.pipe`` a relayed chunk goes from the upstream socket's callback to the
    client's socket with no task switch. The response's start and end still go through ``send``,
    so uvicorn keeps its own bookkeeping (keep-alive, completion).

    ``of(send)`` is None for any other server (or a uvicorn whose internals differ); the relay
    then sends chunk by chunk through ASGI.
    """

    __slots__ = ("_cycle", "_done", "_head", "_tail", "done_handed_over", "dropped", "handed_over")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._head = b""  # the response's start, held to go out with the first body bytes
        # A stream's ``[DONE]`` went to the client's socket whole, nothing of it left in the
        # transport's buffer: a client that hangs up after that had the whole answer.
        self.done_handed_over = False
        # ...and what was last written, whatever it was (a Responses API stream's last event)
        self.handed_over = False
        self.dropped = False  # bytes came after the client had left: it never had them
        self._done = False  # the last write ended a stream's [DONE]
        self._tail = b""  # the last write of 32 bytes or more, and those after it (unframed)

    @staticmethod
    async def start(send: Send, message: dict[str, Any]) -> DirectBody | None:
        """Send the response's start with its bytes held back to go out with the first body
        bytes: an answer and its headers in one write (one system call and one segment where
        there were two). For uvicorn's httptools protocol, whose ``send`` writes the start to the
        cycle's transport; for any other server the start is sent as usual and this is None.
        The caller must ``release`` the start before sending anything through ``send``."""
        cycle: Any = getattr(send, "__self__", None)
        if _UvicornCycle is None or type(cycle) is not _UvicornCycle:
            await send(message)
            return None
        try:
            transport = cycle.transport
            hold = not cycle.response_started and not cycle.flow.write_paused
        except AttributeError:
            hold = False
        if not hold:
            await send(message)
            return DirectBody.of(send)
        held = _Held()
        cycle.transport = held  # its send(start) writes to the transport and does not wait
        try:
            await send(message)
        finally:
            cycle.transport = transport
        direct = DirectBody.of(send)
        head = b"".join(held.parts)
        if direct is None or len(held.parts) != 1:  # not the one write of a start: as it came
            if head:
                transport.write(head)
            return None
        direct._head = head
        return direct

    def withdraw(self) -> bool:
        """Take back the held start, if it is still held (nothing of the answer reached the
        client): uvicorn's cycle is as before it was sent, so another answer (cachegate's own
        503 at a shutdown) can go in its place. False when the start went out."""
        if not self._head:
            return False
        self._head = b""
        cycle = self._cycle
        cycle.response_started = False
        cycle.chunked_encoding = None
        cycle.expected_content_length = 0
        return True

    def release(self) -> None:
        """Write the held start, if it is still held."""
        head, self._head = self._head, b""
        if head and not self._cycle.disconnected:
            self._cycle.transport.write(head)

    @staticmethod
    def of(send: Send) -> DirectBody | None:
        cycle: Any = getattr(send, "__self__", None)
        if _UvicornCycle is None or type(cycle) is not _UvicornCycle:
            return None
        try:  # the attributes the body branch of its send uses
            cycle.transport.write  # noqa: B018
            cycle.flow.write_paused  # noqa: B018
            cycle.flow.drain  # noqa: B018
            ok = cycle.response_started and not cycle.response_complete
            ok = ok and cycle.chunked_encoding in (True, False)
            ok = ok and isinstance(cycle.expected_content_length, int)
            ok = ok and isinstance(cycle.disconnected, bool)
            ok = ok and cycle.scope["method"] != "HEAD"
        except (AttributeError, KeyError, TypeError):
            return None
        return DirectBody(cycle) if ok else None

    def write(self, body: bytes) -> bool:
        """Write one non-empty chunk; False when the client's buffer is full (wait on drain)."""
        cycle = self._cycle
        if cycle.disconnected or cycle.response_complete:
            self.dropped = True
            return True  # as uvicorn's send: nothing goes to a client that left
        self._tail, done = _ends_done(self._tail, body)
        if cycle.chunked_encoding:
            body = b"%x\r\n%b\r\n" % (len(body), body)
        else:
            size = len(body)
            if size > cycle.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            cycle.expected_content_length -= size
        if self._head:
            body, self._head = self._head + body, b""
        transport = cycle.transport
        transport.write(body)
        self._done = done
        self.handed_over = transport.get_write_buffer_size() == 0
        self.done_handed_over = done and self.handed_over
        return not cycle.flow.write_paused

    async def drain(self) -> None:
        """Wait until the client took what was written: cachegate's protocol pauses writing
        while any of it is left in the transport's buffer (``serving.HttpProtocol``), so what
        was last written has then gone to the client's socket (a last event of megabytes, a
        client slower than its socket: it read it all and hung up before the upstream's end,
        and the answer was logged as interrupted)."""
        cycle = self._cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
            if not cycle.disconnected:
                self.handed_over = cycle.transport.get_write_buffer_size() == 0
                self.done_handed_over = self._done and self.handed_over


def open_error_kind(exc: httpx.HTTPError) -> str:
    """What a transport error while opening an upstream request was, for
    ``cachegate_upstream_errors_total``: ``timeout``, ``invalid`` (reached, but its answer is no
    HTTP) or ``connect``. (The pool's own ``PoolTimeout`` is no upstream error: the caller's.)"""
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, InvalidAnswer) or (
        type(exc) is httpx.RemoteProtocolError
        and not any(word in str(exc) for word in ("disconnected", "closed"))
    ):  # (httpx's pool says so in words: an answer it could not parse, or none)
        return "invalid"
    return "connect"


class Relay:
    """Streams one exchange through the shared, pooled upstream transport.

    Requests go straight to the transport (the pool), not through ``httpx.AsyncClient``: a proxy
    wants none of the client's extras (cookie persistence across clients, default headers,
    redirects, auth), and skipping them halved the per-request cost of that layer.
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | UpstreamPool,
        base_url: str,
        timeout: httpx.Timeout,
    ) -> None:
        self.transport = transport
        self.base_url = base_url.rstrip("/")
        self._timeout = timeout.as_dict()
        self.direct_relays = 0  # responses relayed through DirectBody (no task switch per chunk)
        self._warned_at: float | None = None
        self._unwarned: collections.Counter[int] = collections.Counter()  # statuses since

    def _timeout_detail(self, exc: httpx.HTTPError) -> str:
        """What a 504 says of the limit that ran out: the setting, and its value."""
        if isinstance(exc, httpx.ConnectTimeout):
            limit, what = self._timeout.get("connect"), "no connection within"
            key = "upstream.connect_timeout_s"
        else:
            limit, what, key = self._timeout.get("read"), "nothing for", "upstream.timeout_s"
        if not isinstance(limit, int | float):
            return type(exc).__name__
        return f"{type(exc).__name__} ({what} {limit:g} s, {key})"

    def _warn_upstream(self, err: ProxyError) -> None:
        """Say on the terminal, now and then, that the upstream cannot be reached: the client
        gets a 502 or 504, but the user watching cachegate should see why too."""
        self._unwarned[err.status] += 1
        now = time.monotonic()
        if self._warned_at is not None and now - self._warned_at < UPSTREAM_WARN_EVERY_S:
            return
        answered = ", ".join(
            f"{n} answered {status}" for status, n in sorted(self._unwarned.items())
        )
        since = "the last such warning" if self._warned_at is not None else "start-up"
        log.warning(
            "upstream %s: %s (requests since %s: %s; next such warning in %.0f s at the soonest)",
            shown_url(self.base_url),
            err.message,
            since,
            answered,
            UPSTREAM_WARN_EVERY_S,
        )
        self._warned_at = now
        self._unwarned.clear()

    async def open(
        self,
        method: str,
        url: str,
        headers: list[tuple[bytes, bytes]],
        content: bytes | AsyncIterator[bytes],
    ) -> httpx.Response | UpstreamResponse:
        """Send one request through the pool; the response's body is not read yet."""
        if isinstance(self.transport, UpstreamPool):
            return await self.transport.open(method, url, headers, content)
        if isinstance(content, SizedStream):  # httpx sends a stream chunked unless told its length
            headers = [*headers, (b"content-length", b"%d" % content.length)]
            content = content.chunks
        request = httpx.Request(
            method,
            url,
            headers=headers,
            content=content,
            extensions={"timeout": self._timeout},
        )
        response = await self.transport.handle_async_request(request)
        response.request = request
        if any(_CONTROL.search(value) for _, value in response.headers.raw):
            # (h11 takes a control character in a header's value, which uvicorn refuses to
            # send on: the client's connection was dropped with no answer; a 502, as the
            # native pool's parser gives)
            await response.aclose()
            raise InvalidAnswer("invalid answer from upstream: Invalid header value char")
        return response

    def url(self, path: str, query: bytes) -> str:
        url = f"{self.base_url}/{path}"
        return f"{url}?{query.decode('latin-1')}" if query else url

    async def forward(
        self,
        ex: Exchange,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        content: bytes | AsyncIterator[bytes],
        headers: list[tuple[bytes, bytes]],
        extra_headers: list[tuple[bytes, bytes]],
        record: bool,
        responses: bool = False,
        watch: DisconnectWatch | None = None,
        watch_after: asyncio.Event | None = None,
        retry_if: Callable[[int, bytes], bool] | None = None,
    ) -> None:
        """Relay the exchange and fill in ``ex``. Raises ``UpstreamAborted`` (the upstream broke off
        after the response began) and ``RetryRequest`` (``retry_if`` accepted an error answer).
        ``record``: the answer is kept for the observers, a chat answer's (a compressed stream
        then decoded for the client), or with ``responses`` a Responses API answer's (for its
        usage; a compressed stream is then relayed as it came, not read)."""
        if watch is None:
            watch = DisconnectWatch(receive, watch_after)
        response: httpx.Response | UpstreamResponse | None = None
        started = False
        direct: DirectBody | None = None
        done_sent = False  # (the ASGI path's ``done_handed_over``)
        handed = False  # (the ASGI path's ``handed_over``)
        tee: _Tee | None = None
        stripper: UsageEventStripper | None = None
        try:
            try:
                opened_at = time.perf_counter()
                ex.overhead_s = opened_at - ex.t0 - ex.upstream_wait_s - ex.client_wait_s
                response = await self.open(
                    ex.method, self.url(ex.path, scope.get("query_string", b"")), headers, content
                )
            except httpx.HTTPError as exc:
                own = _own_error(exc)
                if own is not None:  # the request body the client was streaming failed (413, 499)
                    raise own from exc
                if isinstance(exc, httpx.PoolTimeout):  # cachegate's own limit, not the upstream
                    raise upstream_busy(str(exc) or "the pool stayed full") from exc
                kind = open_error_kind(exc)
                ex.upstream_error = kind
                if kind == "timeout":  # (which limit, and the setting to raise)
                    raise upstream_timeout(self._timeout_detail(exc)) from exc
                if kind == "invalid":
                    raise upstream_invalid(_plain_bytes(str(exc))) from exc
                raise upstream_unreachable(str(exc) or type(exc).__name__) from exc
            except Exception as exc:  # a transport error its wrapper did not map (malformed answer)
                own = _own_error(exc)
                if own is not None:
                    raise own from exc
                ex.upstream_error = "connect"
                raise upstream_unreachable(f"invalid answer ({type(exc).__name__})") from exc
            if not 100 <= response.status_code <= 599:  # three digits, which HTTP has no status
                ex.upstream_error = "invalid"  # (for: the server's framing would fail on it)
                raise upstream_invalid(f"status {response.status_code} is no HTTP status")
            ex.status = response.status_code
            if watch_after is not None:
                # An upstream that answered before the whole upload arrived has stopped taking
                # it: from now on a disconnect must cancel the exchange, as after a full upload.
                watch_after.set()
            # The transport's own stream: httpx's aiter_raw() adds per-chunk work a relay does
            # not need (re-chunking support, decoders, timers).
            chunks: AsyncIterator[bytes] = aiter(response.stream)  # type: ignore[arg-type]
            read: list[bytes] | None = None
            if retry_if is not None and response.status_code in (400, 413, 422):
                got: list[bytes] = []
                read, size = got, 0
                try:  # the raw bytes, still encoded as the upstream sent them
                    async for chunk in chunks:
                        got.append(chunk)
                        size += len(chunk)
                        if size > REFUSAL_READ_MAX:
                            # No refusal a retry answers is this long (a gateway's page, a
                            # body echoed whole): relayed as it comes, not held (a 150 MB one
                            # took ~270 MB, the answers of 5xx streaming through as they came)
                            chunks = _then(b"".join(got), chunks)
                            read = None
                            break
                except httpx.HTTPError as exc:
                    # Relayed as it came, its status and headers, what was read, then cut as
                    # any answer that breaks off (it was a 502 "could not reach the upstream",
                    # which an SDK retries: the provider had answered, and its headers were lost)
                    chunks = _then_raise(b"".join(got), exc)
                    read = None
            if read is not None and retry_if is not None:  # (a refusal read whole)
                error_body = b"".join(read)
                text = _decode(_coding(response), error_body)
                if retry_if(response.status_code, text):
                    ex.upstream_wait_s += time.perf_counter() - opened_at
                    if isinstance(response, UpstreamResponse):
                        response.retire()  # (the retry goes on another connection)
                    raise RetryRequest(
                        response.status_code,
                        error_body,
                        response.headers.get("content-type", "").encode("latin-1", "replace"),
                        response.headers.get("content-encoding", "").encode("latin-1", "replace"),
                        text,
                        [
                            header
                            for header in client_response_headers(
                                response, drop_length=True, extra=[]
                            )
                            if header[0] not in (b"content-type", b"content-encoding")
                        ],
                    )
                chunks = _one(error_body)  # not retried: relay what was read, verbatim
            if response.status_code >= 400:
                ex.upstream_error = "status"
            ctype = response.headers.get("content-type", "").lstrip().lower()  # case-insensitive
            # A chat stream's answer is read as SSE whatever it says it is (text/plain, x-ndjson,
            # nothing), as the SDKs read it: the usage event cachegate asked for must not reach
            # a client that did not. An answer of a known length is none (a whole completion of
            # a server that ignored "stream", an error page), nor is a JSON or HTML one.
            is_sse = ctype.startswith("text/event-stream") or (
                ex.stream
                and response.status_code < 300
                and response.headers.get("content-length") is None
                and not _whole_type(ctype)
            )
            coding = _coding(response)  # we asked for none; some upstreams compress anyway
            # A compressed stream is decoded for the client (as its HTTP client would) where
            # cachegate must read it: to take out the usage event it asked for, or to record it.
            decoder = None
            reads = (record and not responses) or ex.strip_usage
            if is_sse and coding in _DECODABLE and reads:
                decoder = _Decoder(coding)
            elif is_sse and coding and (reads or (record and coding not in _DECODABLE)):
                ex.error = (
                    f"upstream compressed its stream ({coding}) though asked not to: not "
                    "recorded"
                    + (
                        ", the usage event cachegate asked for not removed"
                        if ex.strip_usage
                        else ""
                    )
                )
            # (a Responses API stream goes as it came, compressed: its recorder decodes a copy)
            inflated = responses and is_sse and coding in _DECODABLE and decoder is None
            if record and (not is_sse or not coding or decoder is not None or inflated):
                # A refusal is read for its words whatever its content type (a gateway may
                # declare its stream before it knows the outcome): a stream only below 400.
                streamed = is_sse and response.status_code < 400
                recorder: StreamRecorder | ResponsesRecorder | None = None
                if streamed:
                    recorder = (
                        ResponsesRecorder(_inflater(coding) if inflated else None)
                        if responses
                        else StreamRecorder()
                    )
                tee = _Tee(
                    recorder,
                    collect=not streamed,
                    coding=coding if decoder is None else "",  # (a decoded stream's: undone)
                    responses=responses,
                )
            if ex.strip_usage and is_sse and (not coding or decoder is not None):
                stripper = UsageEventStripper()
            start: dict[str, Any] = {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": client_response_headers(
                    response,
                    # A 204 or 304 has no body: uvicorn would wait for the length announced.
                    drop_length=stripper is not None
                    or decoder is not None
                    or response.status_code in (204, 304),
                    drop_coding=decoder is not None,
                    extra=extra_headers,
                ),
            }
            if 300 <= response.status_code < 400:
                start["headers"] = [
                    (k, client_location(v, self.base_url, _client_prefix(scope, ex.path)))
                    if k == b"location"
                    else (k, v)
                    for k, v in start["headers"]
                ]
            if not isinstance(response, UpstreamResponse) or chunks is not response.stream:
                await send(start)
            elif is_sse or response.headers.get("content-length") is None:
                # A stream's headers (or those of a body of unknown length, perhaps streamed
                # too) go at once: a client may wait on them.
                await send(start)
                direct = DirectBody.of(send)
            else:  # a whole answer's headers go with its first bytes
                direct = await DirectBody.start(send, start)
            started = True
            try:
                if direct is not None:
                    self.direct_relays += 1
                    sink = _sink(ex, stripper, tee, direct.write)  # in the upstream's callback
                    if decoder is None:
                        await response.pipe(sink, direct.drain)  # type: ignore[union-attr]
                    else:
                        await response.pipe(_decoding(decoder, sink), direct.drain)  # type: ignore[union-attr]
                        rest = decoder.flush()
                        if rest and not sink(rest):
                            await direct.drain()
                else:
                    ready: list[bytes] = []
                    sent = b""  # the end of what went out, to see [DONE] handed over

                    def keep(out: bytes) -> bool:
                        ready.append(out)
                        return True

                    async def send_ready() -> None:
                        nonlocal sent, done_sent, handed
                        for out in ready:
                            done_sent = handed = False
                            await send(
                                {"type": "http.response.body", "body": out, "more_body": True}
                            )
                            sent, done = _ends_done(sent, out)
                            handed = _handed_over(cycle)
                            done_sent = done and handed
                        ready.clear()

                    cycle = getattr(send, "__self__", None)
                    sink = _sink(ex, stripper, tee, keep)
                    feed = sink if decoder is None else _decoding(decoder, sink)
                    async for chunk in chunks:
                        try:
                            feed(chunk)
                        except DecodedTooLarge:
                            await send_ready()  # (what came before the limit, as natively)
                            raise
                        await send_ready()
                    rest = decoder.flush() if decoder is not None else b""
                    if rest:
                        sink(rest)
                        await send_ready()
            except Exception as exc:  # after the headers went out: cut the client the same way
                if direct is not None:
                    direct.release()
                if isinstance(exc, DecodedTooLarge):  # (cachegate's cut, no upstream failure)
                    ex.error = f"cut by cachegate: {exc}, as a compression bomb"
                elif isinstance(exc, httpx.TimeoutException):  # (the upstream went quiet)
                    ex.upstream_error = "timeout"
                    ex.error = f"upstream sent nothing mid-response: {self._timeout_detail(exc)}"
                elif isinstance(exc, zlib.error):  # (it sent its body: one that does not decode)
                    ex.upstream_error = "invalid"
                    ex.error = f"upstream's {coding} stream does not decode: {exc}"
                else:
                    ex.upstream_error = "midstream"
                    ex.error = f"upstream broke off mid-response: {type(exc).__name__}"
                if stripper is not None:
                    tail = stripper.flush()
                    if tail:
                        await send({"type": "http.response.body", "body": tail, "more_body": True})
                raise UpstreamAborted(ex.error) from exc
            if direct is not None:
                direct.release()
                if direct.dropped:  # the client left as the last bytes came: it never had them
                    ex.interrupted = True
            if stripper is not None:
                tail = stripper.flush()
                if tail:
                    await send({"type": "http.response.body", "body": tail, "more_body": True})
            watch.stop()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if direct is not None:
                if direct.withdraw():
                    # An answer whose headers were held for its first bytes, none come yet:
                    # nothing reached the client (a 503 at a shutdown, 499 if it left).
                    started = False
                else:
                    direct.release()  # a shutdown cuts the client after the headers
            ex.interrupted = True  # cut, by the client or by cachegate: never a clean answer
            task = asyncio.current_task()
            if watch is None or not watch.disconnected or task is None:
                # Not the client: cachegate is stopping (its grace period for answers in
                # flight ran out) and cancelled the request. The log says so.
                ex.error = ex.error or STOPPED_CUT
                ex.stopped = True
                if started and stripper is not None:
                    # an event the usage stripper held back, partly come: the client has what
                    # came, as when the upstream cuts it (the bytes it would have had directly)
                    tail = stripper.flush()
                    if tail and direct is not None:
                        direct.write(tail)
                    elif tail:
                        with contextlib.suppress(Exception):
                            await send(
                                {"type": "http.response.body", "body": tail, "more_body": True}
                            )
                if started or task is None:
                    raise
                # Nothing sent yet: the client is told why, in OpenAI's shape, rather than
                # left to the server's bare 500.
                task.uncancel()
                err = shutting_down()
                ex.status, ex.error = err.status, err.message
                await send_error(send, err, extra_headers)
            else:
                task.uncancel()
                if not started:
                    ex.status = CLIENT_CLOSED  # no status was sent: the client left first
                    refused = body_cut(scope, "")
                    if refused.status != CLIENT_CLOSED:  # (the server refused its body, 400)
                        ex.status, ex.error, ex.interrupted = 400, refused.message, False
                elif (
                    direct.done_handed_over and not direct.dropped
                    if direct is not None
                    else done_sent
                ):
                    # The whole stream, [DONE] included, had gone to the client's socket (or
                    # through the server's ``send``), and the client closed before the
                    # upstream's last bytes came (the openai SDKs stop reading at [DONE]): a
                    # whole answer.
                    ex.interrupted = False
                elif (
                    tee is not None
                    and isinstance(tee.recorder, ResponsesRecorder)
                    and (
                        direct.handed_over and not direct.dropped if direct is not None else handed
                    )
                    and tee.recorder.ended()
                ):
                    # A Responses API stream whose last event had gone to the client, which
                    # stopped reading there (Codex CLI does): a whole answer too.
                    ex.interrupted = False
        except ProxyError as err:
            if watch is not None:
                watch.stop()
            ex.status = err.status
            ex.error = err.message
            if err.status == CLIENT_CLOSED:  # the client left while sending its body
                ex.interrupted = True
            cut = body_cut(scope, "") if not started else None
            if cut is not None and cut.status != CLIENT_CLOSED:
                # the server refused its body and answered that 400 itself, whatever came of
                # the upstream request after (its connection refused, say)
                ex.status, ex.error, ex.interrupted = 400, cut.message, False
            if (
                ex.upstream_error in ("connect", "timeout")
                or err.code == "upstream_connections_busy"
            ) and not started:
                self._warn_upstream(err)
            if not started:
                await send_error(send, err, extra_headers, receive)
        finally:
            if watch is not None:
                watch.stop()
            if response is not None:
                await response.aclose()
            ex.duration_s = time.perf_counter() - ex.t0
            if tee is not None and started:  # (else the client had none of it: no answer)
                ex.recorded = tee  # assembled by ex.assemble(), with the observers


# A compressed stream is decoded in pieces of at most this many bytes, and cut past the most a
# stream decodes to: a few MB of gzip can hold GBs, which the client's buffer would take.
_DECODE_PIECE = 1024 * 1024
MAX_DECODED_STREAM = 64 * 1024 * 1024


def _whole_type(ctype: str) -> bool:
    """Whether a media type is a whole document's: JSON (``+json`` too, not NDJSON) or HTML."""
    media = ctype.partition(";")[0].strip()
    streamed = media.endswith(("ndjson", "stream+json"))  # (NDJSON; Spring's streaming JSON)
    return (media.endswith("json") and not streamed) or media.endswith("html")


class _Decoder:
    """A compressed stream's decoder (``zlib.decompressobj``), which falls back to a raw deflate
    stream when a "deflate" one has no zlib header (its first bytes say so)."""

    def __init__(self, coding: str) -> None:
        self.wbits = list(_WBITS[coding])
        self.obj = zlib.decompressobj(self.wbits.pop(0))
        self.head = b""  # the first bytes fed, until the framing is known (zlib's is 2 bytes)
        # gzip may hold several members one after another (RFC 1952), as a server that
        # compresses each flush on its own sends them: what follows one that ended
        self.members = coding in ("gzip", "x-gzip")
        self.rest: bytes | None = None  # (None: no member ended; b"": nothing after it yet)

    def next_member(self, data: bytes = b"") -> bytes:
        """After a gzip member ended: the bytes of the next one (``data`` added to what came
        after the end), its decoder made ready; b"" while they are too few to tell, or when
        what follows is no member (ignored, as HTTP clients ignore it)."""
        if self.rest is None:
            return data
        rest = self.rest + data
        if len(rest) < 2 or not rest.startswith(b"\x1f\x8b"):
            self.rest = rest if len(rest) < 2 else b"\x00\x00"  # (no member: none after it)
            return b""
        self.rest = None
        self.obj = zlib.decompressobj(zlib.MAX_WBITS | 16)
        return rest

    def decompress(self, data: bytes, limit: int) -> bytes:
        if self.rest is not None:
            data = self.next_member(data)
            if not data:
                return b""
        plain = self._decompress(data, limit)
        if self.members and self.obj.eof:
            self.rest = self.obj.unused_data
        return plain

    def _decompress(self, data: bytes, limit: int) -> bytes:
        if self.wbits:  # the framing is not known yet: the first bytes may change the guess
            self.head += data
        try:
            plain = self.obj.decompress(data, limit)
        except zlib.error:
            if not self.wbits:
                raise
            self.obj = zlib.decompressobj(self.wbits.pop(0))  # raw deflate: start again
            self.wbits.clear()
            plain = self.obj.decompress(self.head, limit)
        if self.wbits and (plain or len(self.head) >= 2):  # zlib's header was read: it is zlib
            self.wbits.clear()
        if not self.wbits:
            self.head = b""
        return plain

    @property
    def unconsumed_tail(self) -> bytes:
        return self.obj.unconsumed_tail

    def flush(self) -> bytes:
        return self.obj.flush()


def _inflater(coding: str) -> Callable[[bytes], bytes]:
    """What a compressed stream's chunks decode to, one after another, for its recorder (the
    client gets them as they came); nothing past ``MAX_DECODED_STREAM`` or after bytes that do
    not decode (the record then ends there)."""
    pieces: list[bytes] = []

    def keep(plain: bytes) -> bool:
        pieces.append(plain)
        return True

    decoding: Callable[[bytes], bool] | None = _decoding(_Decoder(coding), keep)

    def inflate(chunk: bytes) -> bytes:
        nonlocal decoding
        try:
            if decoding is not None:
                decoding(chunk)
        except (DecodedTooLarge, zlib.error):
            decoding = None  # (what came before the limit is read, nothing after)
        taken = b"".join(pieces)
        pieces.clear()
        return taken

    return inflate


def _decoding(decoder: _Decoder, sink: Callable[[bytes], bool]) -> Callable[[bytes], bool]:
    """``sink`` fed what ``decoder`` makes of each chunk, piece by piece; past
    ``MAX_DECODED_STREAM`` it raises (the relay cuts the stream)."""
    total = 0

    def decoding(chunk: bytes) -> bool:
        nonlocal total
        room = True
        while chunk:
            plain = decoder.decompress(chunk, _DECODE_PIECE)
            total += len(plain)
            if total > MAX_DECODED_STREAM:
                kept = len(plain) - (total - MAX_DECODED_STREAM)
                if kept > 0:  # (what comes before the limit goes, to the limit exactly)
                    sink(plain[:kept])
                raise DecodedTooLarge(
                    f"the compressed stream decodes to over {MAX_DECODED_STREAM} bytes"
                )
            if plain:
                room = sink(plain) and room
            chunk = decoder.unconsumed_tail or decoder.next_member()
        return room

    return decoding


_BYTEARRAY_REPR = re.compile(
    r"""bytearray\(b('[^'\\]*(?:\\.[^'\\]*)*'|"[^"\\]*(?:\\.[^"\\]*)*")\)"""
)


def _plain_bytes(text: str) -> str:
    """h11's error text with the bytes it quotes as a quoted string, not as Python's
    ``bytearray(b'...')``, which a user reading the 502 has no reason to know."""
    return _BYTEARRAY_REPR.sub(r"\1", text)


def _sink(
    ex: Exchange,
    stripper: UsageEventStripper | None,
    tee: _Tee | None,
    write: Callable[[bytes], bool],
) -> Callable[[bytes], bool]:
    """The per-chunk work of a relay, in one call: the time to the first byte, the side channel
    fed, what cachegate's own usage request added taken out (``proxy.strip``), then ``write``
    what the client gets (nothing, for now, while an event is cut by a read). Returns
    ``write``'s answer: False when the client's buffer is full. The common steps are done here
    rather than by calling the recorder's ``feed`` and the stripper's ``feed``: a stream's chunk
    is kept with one list append, and a chunk of whole events with no usage member passes the
    stripper untouched, as its own ``feed`` would pass it."""
    recorder = tee.recorder if tee is not None else None
    keep = recorder.chunks.append if recorder is not None else None
    collect = tee.take if tee is not None and recorder is None else None
    kept = 0
    chunk_cost, keep_bytes = StreamRecorder.CHUNK_COST, StreamRecorder.KEEP_BYTES  # as cells

    def sink(chunk: bytes) -> bool:
        nonlocal keep, kept
        if ex.ttfb_s is None:
            ex.ttfb_s = time.perf_counter() - ex.t0
        if keep is not None:
            keep(chunk)  # recorder.feed(chunk), inlined; decoded below, after the write
            kept += len(chunk) + chunk_cost
        elif collect is not None:
            collect(chunk)
        if stripper is not None:
            if (
                stripper.pending
                or not chunk.endswith(EVENT_ENDS)
                or chunk[-3:-2] in _LINE_ENDS
                or stripper.lf_owed  # (an LF may open this read: the last event's own)
            ):
                chunk = stripper.feed(chunk)
            else:  # whole events: the stripper's own short path, inlined
                plain = without_lf_nulls(chunk)  # OpenAI's null usages, if any
                # partition: fewer instructions than find() in CPython 3.11
                if plain.partition(b'"usage"')[1]:
                    chunk = stripper.feed(chunk)
                else:
                    chunk = plain
                    if chunk[-1] == 13:  # ended by a CR: an LF opening the next read is its own
                        stripper.lf_owed = True
        room = write(chunk) if chunk else True
        if kept >= keep_bytes:  # a long stream is not kept whole
            kept = 0
            try:
                recorder.decode()  # type: ignore[union-attr]
            except Exception:
                log.exception("stream recorder failed; relaying continues unrecorded")
                keep = None
                tee.recorder = None  # type: ignore[union-attr]
        return room

    return sink
