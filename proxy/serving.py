"""Run an ASGI app with uvicorn on a loopback port in a background thread.

Tests, the demo and the benchmark need real sockets (streams and disconnects cannot be observed
through ``httpx.ASGITransport``), so every in-process server goes through this one helper.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final, Literal

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.config import url_host
from proxy.errors import REFUSED_BODY, ProxyError, http_date

log = logging.getLogger(__name__)


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """TCP sockets bound to every address ``host`` resolves to, as ``uvicorn.run`` gets them from
    asyncio's ``create_server`` (``localhost``: 127.0.0.1 and ::1; an IPv6 socket is IPv6 only;
    ``SO_REUSEADDR``); the server listens on them. An address whose family the machine lacks
    (no IPv6) is skipped. Raises ``OSError`` (``socket.gaierror`` for a name that does not
    resolve), with none left open."""
    infos = socket.getaddrinfo(
        host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    unavailable: OSError | None = None
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as exc:  # the family is not supported here (IPv6 off): skipped
                unavailable = exc
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
            except OSError as exc:
                sock.close()
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                unavailable = exc  # the family is off here (::1 without IPv6): skipped
                continue
            sockets.append(sock)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    if not sockets:
        raise unavailable or OSError(errno.EADDRNOTAVAIL, f"no address for {host!r}")
    return sockets


# What a client may make cachegate hold before it can answer: uvicorn's parser has no limit on
# a request's head and no time limit on its head or its body (a connection that sent nothing,
# a head trickled a line at a time, an upload that stopped were held for ever: a local process
# could take the memory and the file descriptors, refusing every other client).
MAX_HEAD_BYTES: Final = 64 * 1024  # a request's line and header fields (nginx: 32 KiB)
HEAD_TIMEOUT_S: Final = 30.0  # from a connection's start, or a request's first byte, to its end
BODY_IDLE_S: Final = 60.0  # a request body's upload with no byte come (nginx's 60 s)
SWEEP_S: Final = 1.0  # how often the connections are looked at for those limits
# How long an idle client connection is kept open: longer than clients keep theirs (httpx and
# so the openai SDKs 5 s, Node's agents 4 s), so the client is the side that closes. At
# uvicorn's 5 s, the SDK's 5 s, a connection closed by cachegate as the client sent its next
# request on it failed that request (a ReadError the SDKs' retries hide; curl's is an error).
CLIENT_KEEPALIVE_S: Final = 75  # (nginx's keepalive_timeout)
# Requests a client may pipeline behind the one being answered: past them, those are answered
# and the connection closed after them (a client retries the rest, RFC 9112 9.3.2). A read of
# 64 KiB holds ~1,500 small requests, each queued at ~40 times its size: one connection that
# wrote requests without reading its answers took gigabytes. (No SDK or browser pipelines.)
MAX_PIPELINED: Final = 32


class _HeadTooLarge(Exception):
    """Raised in the parser's callback for a head past the limit: it stops the parser."""


class _TooManyPipelined(Exception):
    """Raised in the parser's callback for a request past ``MAX_PIPELINED``: it stops the
    parser."""


class _Refused(Exception):
    """Raised in the parser's callback for a request cachegate refuses from its head alone
    (``HttpProtocol._refusal``): it stops the parser; the answer is sent once it has."""

    def __init__(self, status: int, reason: str, message: str, code: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.code, self.kind = (
            status,
            reason,
            message,
            code,
            kind,
        )


INVALID_WARN_EVERY_S: Final = 30.0  # a request HTTP's parser refuses is said at most this often
_TLS_HANDSHAKE: Final = b"\x16\x03"  # (a TLS record's first bytes: a ClientHello)


def _not_a_proxy(target: bytes, host: str, port: int, method: bytes = b"CONNECT") -> _Refused:
    """The refusal of a ``CONNECT`` to ``target`` (cachegate set as a client's
    ``HTTPS_PROXY``), or of another ``method`` to a URL of another server (``HTTP_PROXY``),
    made to cachegate listening at ``host`` and ``port``: it says the base URL to set instead
    (an IPv6 address in brackets)."""
    # (the client's bytes, said on stderr too: printable ones only, no terminal escapes)
    said = method[:20] + b" " + target[:200]
    shown = "".join(c if " " <= c < "\x7f" else "?" for c in said.decode("latin-1"))
    does = "tunnels nothing" if method == b"CONNECT" else "forwards nothing to other servers"
    return _Refused(
        405,
        "Method Not Allowed",
        f"cachegate is no HTTP proxy and {does} ({shown}):"
        f" point the client's base URL at it, OPENAI_BASE_URL=http://{url_host(host)}:{port}/v1,"
        " not HTTPS_PROXY or HTTP_PROXY",
        "method_not_allowed",
        "proxy",
    )


# The names of this machine's loopback interface a URL of cachegate's own may use
_LOOPBACK_NAMES: Final = frozenset({"localhost", "::1", "[::1]"})


def _another_server(target: bytes, host: str, port: int) -> bool:
    """Whether a request target in absolute form (``http://host:port/path``, as a client
    sends it to its ``HTTP_PROXY``) names a server other than cachegate listening at ``host``
    and ``port``: a loopback name, or the address it listens on, and its port."""
    scheme, sep, rest = target.decode("latin-1").partition("://")
    if not sep:
        return False  # (no URL: the parser's to judge)
    authority = rest.split("/", 1)[0].split("?", 1)[0].rsplit("@", 1)[-1].lower()
    name, colon, number = authority.rpartition(":")
    if not colon or "]" in number:  # (no port: the scheme's; an IPv6 address's last group)
        name, number = authority, ("443" if scheme.lower() == "https" else "80")
    own = (
        name in _LOOPBACK_NAMES
        or name.startswith("127.")
        or name.strip("[]") == host.lower()
        or name.endswith(".localhost")
    )
    return not (own and number == str(port))


class _Refusals:
    """Warns of requests HTTP's parser refuses at most every ``INVALID_WARN_EVERY_S`` of each
    kind (TLS spoken to the port, any other), with how many came meanwhile (a client with an
    ``https://`` base URL sent a line a try, each retry too, which said nothing of why; a
    kind of its own, so that a probe's malformed request does not hide it)."""

    def __init__(self) -> None:
        self.warned_at: dict[str, float] = {}
        self.unwarned: dict[str, int] = {}

    def warn(self, exc: Exception, data: bytes) -> None:
        if isinstance(exc, _Refused):
            kind = exc.kind
        else:
            kind = "tls" if data.startswith(_TLS_HANDSHAKE) else "invalid"
        self.unwarned[kind] = count = self.unwarned.get(kind, 0) + 1
        now = time.monotonic()
        last = self.warned_at.get(kind)
        if last is not None and now - last < INVALID_WARN_EVERY_S:
            return
        if kind == "tls":
            why = "a client spoke TLS to this plain-HTTP port: its base URL must be http://, not https://"
        elif isinstance(exc, _Refused):
            why = f"{exc.message} (answered {exc.status} {exc.code})"
        else:
            why = (
                f"a request HTTP's parser refused ({exc or 'malformed'}), answered 400 invalid_http"
            )
        since = "the last such warning" if last is not None else "start-up"
        log.warning(
            "%s (%d such since %s; next such warning in %.0f s at the soonest)",
            why,
            count,
            since,
            INVALID_WARN_EVERY_S,
        )
        self.warned_at[kind], self.unwarned[kind] = now, 0


_REFUSALS: weakref.WeakKeyDictionary[Any, _Refusals] = weakref.WeakKeyDictionary()


def _refusals(server_state: Any) -> _Refusals:
    """The warnings of one server (its connections share its ``server_state``)."""
    found = _REFUSALS.get(server_state)
    if found is None:
        found = _REFUSALS[server_state] = _Refusals()
    return found


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, reading on after an upgrade it does not make, with limits on
    a request's head (``MAX_HEAD_BYTES``: a 431) and on the time its head and its body take
    (``HEAD_TIMEOUT_S``, ``BODY_IDLE_S``: the connection is closed).

    A request that offers an upgrade (``Upgrade: h2c`` from ``curl --http2``, Java's HttpClient,
    JetBrains' clients; a WebSocket handshake) stops uvicorn's parser at the end of its headers
    (httptools skips the body of any upgrade request): the app got an empty body, answered
    ``invalid_json`` for a valid request, and the body's bytes were then read as a request of
    their own (uvicorn#2722). HTTP lets a server ignore an offer and answer in HTTP/1.1 (RFC
    9110 7.8), which this one does: a parser of its own reads the body on (framed by the
    request's ``Content-Length`` or chunked coding) into the same request, then the requests
    that follow it on the connection. (cachegate answers a WebSocket handshake itself, 501.)"""

    _active: Any = None  # the request being answered (a pipelined one waits behind it)
    _trailers = False  # past the request's head: a field now is a chunked body's trailer
    # The limits, class attributes so that a test may shorten them
    max_head_bytes = MAX_HEAD_BYTES
    head_timeout_s = HEAD_TIMEOUT_S
    body_idle_s = BODY_IDLE_S
    sweep_s = SWEEP_S
    _head_since: float | None = None  # a head is awaited or coming since then
    _head_bytes = 0  # bytes of the head so far, read by read (from the read after its first)
    _head_fields = 0  # bytes of its request line's target and fields, as the parser gave them
    _head_over = False  # the parser was stopped in a head past the limit
    _pipeline_over = False  # the parser was stopped at a request past ``max_pipelined``
    _refused: _Refused | None = None  # the parser was stopped at a request refused by its head
    _codings: bytes | None = None  # the request's Transfer-Encoding fields, joined
    max_pipelined = MAX_PIPELINED
    _began = 0  # requests begun on the connection
    _read_at = 0.0  # when the client's bytes last came (a body's progress)

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        # Writing pauses while anything written is left in the transport's buffer, and goes on
        # once it is all in the client's socket (uvicorn's limits: on past 64 KiB, again at
        # 16): a relay that waits on it knows what it wrote reached the client (a stream's last
        # event of megabytes, read whole before the client hung up, was taken for cut).
        with contextlib.suppress(AttributeError, ValueError):
            transport.set_write_buffer_limits(high=0)
        self._head_since = self.loop.time()
        _sweep_later(self)

    def on_message_begin(self) -> None:
        self._trailers = False
        if self._head_since is None:
            self._head_since = self.loop.time()
        self._head_bytes = self._head_fields = 0
        self._codings = None
        self._began += 1
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def _count_head(self, size: int) -> None:
        """The head's target and fields counted as the parser gives them, whatever reads they
        came in (a head that began and ended in one read was never counted): past the limit,
        the parser is stopped before the request is dispatched (``data_received``: a 431)."""
        self._head_fields += size
        if self._head_fields > self.max_head_bytes:
            self._head_over = True
            raise _HeadTooLarge

    def on_header(self, name: bytes, value: bytes) -> None:
        # A chunked body's trailer fields are no header fields (RFC 9110 6.5.1): uvicorn put
        # them in the request's headers when they came in the packet its head came in (a
        # trailer's Authorization or X-Session-Id then went upstream, or named the session),
        # and not when they came later. (uvicorn's own steps, inline: a call per header.)
        if self._trailers:
            return
        self._head_fields += len(name) + len(value) + 4  # (": " and its line's end: inline)
        if self._head_fields > self.max_head_bytes:
            self._count_head(0)
        name = name.lower()
        value = value.rstrip(b" \t")  # (llhttp keeps trailing white space; RFC 9110 5.5)
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        elif name == b"transfer-encoding":  # (its codings, for ``_refusal``)
            self._codings = value if self._codings is None else self._codings + b"," + value
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._trailers = True
        self._head_since = None
        if len(self.pipeline) >= self.max_pipelined:
            self._pipeline_over = True
            raise _TooManyPipelined
        refusal = self._refusal()
        if refusal is not None:
            self._refused = refusal
            raise refusal
        super().on_headers_complete()

    def _refusal(self) -> _Refused | None:
        """A request refused from its head, before uvicorn reads it: ``CONNECT`` (cachegate set
        as a client's ``HTTPS_PROXY``; uvicorn failed on its target and said only "User
        callback error"), a URL of another server as its target (set as ``HTTP_PROXY``: the
        request, for another server, was answered by cachegate's upstream, with cachegate's
        key where it carried none), a transfer coding other than ``chunked`` before it (``gzip,
        chunked``: the parser undid the chunks and the body went on still compressed, read as
        no JSON or forwarded with no ``Content-Encoding``; RFC 9112 6.1: a 501)."""
        method = self.parser.get_method()
        if method == b"CONNECT":
            where = self.transport.get_extra_info("sockname") or ("127.0.0.1", 8000)
            return _not_a_proxy(bytes(self.url), where[0], where[1])
        url = self.url
        if url[:1] != b"/" and url[:4].lower() == b"http":  # (absolute form: as to a proxy)
            where = self.transport.get_extra_info("sockname") or ("127.0.0.1", 8000)
            if _another_server(bytes(url), where[0], where[1]):
                return _not_a_proxy(bytes(url), where[0], where[1], method)
        if self._codings is None:
            return None
        codings = [c.strip().lower() for c in self._codings.split(b",") if c.strip()]
        if codings and codings != [b"chunked"]:
            said = b", ".join(codings).decode("latin-1")[:200]
            return _Refused(
                501,
                "Not Implemented",
                f"Transfer-Encoding '{said}' is not supported: send the body with chunked alone"
                " or with a Content-Length (a compressed body: with Content-Encoding)",
                "unsupported_transfer_coding",
                "coding",
            )
        return None

    def on_response_complete(self) -> None:
        if self._head_over and not self.transport.is_closing() and not self.pipeline:
            # A head past the limit came behind this answer (its bytes all read, the parser
            # stopped): its 431 now, not a close at the head's time limit with no word; after
            # the requests queued before it are answered (the 431 came in the place of the
            # first, which a client took for its answer, and the rest were never answered)
            self._refuse_head()
            return
        if self._refused is not None and not self.transport.is_closing() and not self.pipeline:
            self._refuse()  # (as a head past the limit: after the answers queued before it)
            return
        super().on_response_complete()
        if self._head_over or self._refused is not None:  # (the next queued one is answered)
            self.flow.pause_reading()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._active = cycle
        # Where a refusal of its body is said (``send_400_response``): a list, so that the
        # copies of the scope the app makes share it
        cycle.scope[REFUSED_BODY] = []
        if cycle.scope["http_version"] == "1.0":
            _close_delimited(cycle)
        super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        # uvicorn marks the newest request's cycle, which with a request pipelined behind the
        # one being answered is the queued one: the answer's relay never heard that its client
        # had gone (the upstream request ran on, billed, to its end; logged as an upstream's
        # failure to write to the closed socket).
        active = self._active
        if active is not None and active is not self.cycle and not active.response_complete:
            active.disconnected = True
            active.message_event.set()
        self._head_since = None
        # (the requests queued behind, never to be answered: each holds this protocol, which
        # holds them, a cycle only a full collection frees, which ``tune_gc`` makes rare)
        self.pipeline.clear()
        super().connection_lost(exc)

    def _overdue(self, now: float) -> bool:
        """Whether the connection is past a limit: a head not ended ``head_timeout_s`` after
        the connection or its first byte (unless a request before it is being answered: a
        pipelined one waits), a body with no byte for ``body_idle_s`` (unless cachegate paused
        its reading: the upstream is taking it slowly)."""
        since = self._head_since
        if since is not None and now - since > self.head_timeout_s:
            active = self._active
            if active is None or active.response_complete:
                return True
        cycle = self.cycle
        if (
            cycle is not None
            and cycle.more_body  # (its body is being read: its message has not ended)
            and not cycle.response_complete
            and now - self._read_at > self.body_idle_s
        ):
            if not self.flow.read_paused:
                return True
            self._read_at = now  # (not the client's stall: counted from the resumption)
        return False

    def data_received(self, data: bytes) -> None:
        if self._pipeline_over:
            return  # (read and dropped: the queue is answered, then the connection closed)
        self._read_at = self.loop.time()
        self._unset_keepalive_if_required()
        while True:
            try:
                began = self._began
                self.parser.feed_data(data)
                # A head still coming, begun before these bytes: all of them are its (a read
                # that began it may hold the end of the request before it: not counted)
                if self._head_since is not None and self._began == began:
                    self._head_bytes += len(data)
                    if self._head_bytes > self.max_head_bytes:
                        self._refuse_head()
                        return
            except httptools.HttpParserError as exc:
                if self._pipeline_over:  # (stopped by ``on_headers_complete``)
                    self._close_after_queue()
                    return
                if self._head_over:  # (stopped by ``_count_head``)
                    self._refuse_head()
                    return
                if self._refused is not None:  # (stopped by ``on_headers_complete``)
                    _refusals(self.server_state).warn(self._refused, data)
                    self._refuse()
                    return
                msg = "Invalid HTTP request received."
                _refusals(self.server_state).warn(exc, data)
                self.send_400_response(f"{msg[:-1]}: {exc}." if str(exc) else msg)
                return
            except httptools.HttpParserUpgrade as upgrade:
                if self._should_upgrade():  # a WebSocket, where uvicorn was given a library
                    self.handle_websocket_upgrade()
                    return
                if self._get_upgrade() == b"websocket":
                    return  # the app answers it (426); what follows would be frames
                data = data[upgrade.args[0] :]  # where the headers ended: the body, if any
                if self._read_on() and data:
                    continue
            return

    def _close_after_queue(self) -> None:
        """Too many requests pipelined: those queued are answered, the last of them with
        ``Connection: close``, and the connection closed after it. What the client sends
        meanwhile is read and dropped: left unread, the close would reset the connection, and
        the client could lose the answers it had not read yet."""
        self.flow.resume_reading()
        if self.cycle is not None:  # (the newest: the queue's last)
            self.cycle.keep_alive = False

    def _refuse_head(self) -> None:
        """A head past ``max_head_bytes``: a 431, and the connection closed; where a request
        before it is being answered, its answer is not cut into: the rest waits unread, and
        it is refused once that answer is done."""
        active = self._active
        if active is not None and not active.response_complete:
            self._head_over = True  # (refused once that answer is done: ``on_response_complete``)
            self.flow.pause_reading()
            return
        self._send_error(
            431,
            "Request Header Fields Too Large",
            f"Request head too large: over {self.max_head_bytes // 1024} KiB"
            " of request line and header fields",
            "request_header_too_large",
        )

    def _refuse(self) -> None:
        """A request refused by its head (``_refusal``), answered and the connection closed;
        where a request before it is being answered, once that answer is done."""
        active = self._active
        if active is not None and not active.response_complete:
            self.flow.pause_reading()  # (refused once that answer is done)
            return
        refused = self._refused
        assert refused is not None
        self._send_error(refused.status, refused.reason, refused.message, refused.code)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its parser refuses (a malformed request line or header,
        conflicting framing), in OpenAI's error shape: uvicorn's own is plain text, which an SDK
        shows as a body it cannot read. The connection is closed after it, as uvicorn does."""
        cycle = getattr(self, "cycle", None)
        counted = cycle is not None and cycle is self._active and bool(cycle.more_body)
        if counted and cycle is not None:
            # refused in the body of the request the app is answering, or answered already (a
            # 404 before its body was read): the app counts it, once (with this 400, which its
            # scope now says: it had counted the client gone, a 499); one refused after a
            # request whose body was all read (pipelined behind it) is a request of its own,
            # counted here
            with contextlib.suppress(Exception):
                cycle.scope[REFUSED_BODY].append(msg)
        self._send_error(400, "Bad Request", msg, "invalid_http", counted=counted)

    def _send_error(
        self, status: int, reason: str, msg: str, code: str, *, counted: bool = False
    ) -> None:
        """An error of cachegate's own, in OpenAI's shape, and the connection closed."""
        body = ProxyError(status, msg, code=code).body()
        if not counted:
            count = getattr(self.app, "invalid_http", None)  # (cachegate's app: its metrics)
            if callable(count):
                with contextlib.suppress(Exception):  # (an observer: never the answer's failure)
                    method = self.parser.get_method() if self.parser is not None else b""
                    count(method or b"", bytes(getattr(self, "url", b"") or b""), status)
        content = [b"HTTP/1.1 %d %s\r\n" % (status, reason.encode())]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body),
                b"date: %s\r\n" % http_date(),
                b"connection: close\r\n\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(content))
        self.transport.close()

    def _read_on(self) -> bool:
        """Parse what follows the upgrade request's headers as its body, then as requests.
        False when the body's framing is refused (a 400, as without the offer)."""
        headers = dict(self.headers)  # (names lowered)
        coding = headers.get(b"transfer-encoding")
        length = headers.get(b"content-length", b"").strip()
        if coding is None and length.lstrip(b"0") == b"":  # no body: nothing to read on
            return True
        parser = httptools.HttpRequestParser(_ReadOn(self))
        with contextlib.suppress(AttributeError):  # as uvicorn sets it (httptools 0.6.3 on)
            parser.set_dangerous_leniencies(lenient_data_after_close=True)
        framing = (
            b"transfer-encoding: " + coding if coding is not None else b"content-length: " + length
        )
        try:  # (a coding other than chunked: the old parser let it pass, for the offer)
            parser.feed_data(b"POST / HTTP/1.1\r\n" + framing + b"\r\n\r\n")
        except httptools.HttpParserError:
            self.cycle.disconnected = True  # the app, if it runs, sees the client gone
            self.cycle.more_body = True  # (its body refused: the app's request, counted there)
            self.send_400_response("Invalid HTTP request received.")
            return False
        self.parser = parser
        self.cycle.more_body = True  # (the old parser ended the message at its headers)
        return True


# What an answer of no stated length to an HTTP/1.0 request may hold: its end is the connection's
_CLOSE_DELIMITED: Final = 1 << 62


def _close_delimited(cycle: Any) -> None:
    """An answer of no stated length (a stream) to an HTTP/1.0 request goes as it is, its end
    the connection's close (which uvicorn makes after any answer to HTTP/1.0), not in chunked
    coding, which HTTP/1.0 clients do not know (RFC 9112 6.1: a server must not send it to
    them; ApacheBench, ``curl -0`` and such read the chunk sizes as the answer's text).
    ``cycle.send`` is wrapped: the relay writes such an answer through it, event by event."""
    send = cycle.send
    unframed = False

    async def send_http10(message: Any) -> None:
        nonlocal unframed
        if message["type"] == "http.response.start":
            framed = any(
                name.lower() in (b"content-length", b"transfer-encoding")
                for name, _ in message.get("headers", ())
            )
            if not framed and cycle.chunked_encoding is None:
                unframed = True
                cycle.chunked_encoding = False
                cycle.expected_content_length = _CLOSE_DELIMITED
        elif unframed and not message.get("more_body", False):
            # (uvicorn checks what was sent against the length: this last part is all of it)
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)

    cycle.send = send_http10


def _sweep_later(protocol: HttpProtocol) -> None:
    """Close the connections of ``protocol``'s server that are past a limit
    (``HttpProtocol._overdue``): one timer a server, every ``sweep_s`` while it has any, where a
    timer per request would cost each request its setting and cancelling."""
    state, loop, every = protocol.server_state, protocol.loop, protocol.sweep_s
    if getattr(state, "cachegate_sweep", None) is not None:
        return

    def sweep() -> None:
        now = loop.time()
        for conn in list(state.connections):
            if (
                isinstance(conn, HttpProtocol)
                and conn._overdue(now)
                and not conn.transport.is_closing()
            ):
                conn.transport.close()
        handle = loop.call_later(every, sweep) if state.connections else None
        setattr(state, "cachegate_sweep", handle)  # noqa: B010 - uvicorn's object, not ours

    setattr(state, "cachegate_sweep", loop.call_later(every, sweep))  # noqa: B010


class _ReadOn:
    """The callbacks of ``HttpProtocol``'s own parser: the head it is given to learn the body's
    framing is not a request; the body and every request after it are the protocol's."""

    def __init__(self, protocol: HttpToolsProtocol) -> None:
        self._protocol = protocol
        self._head = True

    def on_message_begin(self) -> None:
        if not self._head:
            self._protocol.on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self._head:
            self._protocol.on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._head:
            self._protocol.on_header(name, value)

    def on_headers_complete(self) -> None:
        if not self._head:
            self._protocol.on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._protocol.on_body(body)

    def on_message_complete(self) -> None:
        self._head = False
        self._protocol.on_message_complete()


class Server(uvicorn.Server):
    """uvicorn's server, which calls ``on_started`` once it accepts connections (its app
    started, its sockets listening: a script that waits for a line printed there finds the port
    open), and ``on_stop`` with the number of requests in flight as it begins to stop (a
    signal, a hang-up), before it closes its sockets and gives those their grace period."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_stop: Callable[[int], None] | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.on_stop = on_stop
        self.on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit and self.on_started is not None:
            self.on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        from proxy.relay import stop_draining

        # (a refused upload still being read is answered whole already, its response ended
        # only once the rest is read: not in flight)
        draining = stop_draining()
        if self.on_stop is not None:
            with contextlib.suppress(Exception):  # (saying so must not keep it from stopping)
                self.on_stop(max(0, self.unanswered() - draining))
        await super().shutdown(sockets=sockets)

    def unanswered(self) -> int:
        """The requests whose answer has not been sent whole: those the grace period is for. A
        request answered whole whose task still ends (its log line, its accounting) is not one
        (Ctrl+C right after an answer said "1 request(s) in flight")."""
        count = 0
        for connection in self.server_state.connections:
            cycle = getattr(connection, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                count += 1
        return count


def serve_until_stopped(
    sockets: list[socket.socket], make_server: Callable[[], uvicorn.Server]
) -> int:
    """Make the server (``make_server``, which may build the app) and run it on ``sockets``
    (bound already: see ``listening_sockets``) until it stops; the sockets are closed whatever
    happens. The exit code, as ``uvicorn.run`` gives it: 0 after Ctrl+C (at any point) or a
    clean stop, 3 when start-up failed (uvicorn logged why)."""
    server: uvicorn.Server | None = None
    hung_up = False

    def stop() -> None:
        nonlocal hung_up
        hung_up = True  # (a SIGHUP while the app is being built: the server stops at once)
        if server is not None:
            server.should_exit = True

    hangup = _on_hangup(stop)
    try:
        server = make_server()
        server.should_exit = server.should_exit or hung_up
        server.run(sockets=sockets)
    except KeyboardInterrupt:  # uvicorn raises the Ctrl+C it deferred, once it has shut down
        return 0
    finally:
        if hangup is not None:
            signal.signal(signal.SIGHUP, hangup)
        for sock in sockets:
            sock.close()
    return 0 if server.started else 3


def _on_hangup(stop: Callable[[], None]) -> Any:
    """Stop gracefully on SIGHUP (the terminal closed), as on SIGTERM: answers in flight get
    their grace period and their log lines, where the default action ended the process at
    once. Returns the handler it replaced, or None where it left SIGHUP alone (ignored, as
    under ``nohup``; not the main thread; no SIGHUP on this system)."""
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        return None

    return signal.signal(signal.SIGHUP, lambda signum, frame: stop())


class ServerThread:
    """A uvicorn server bound to ``host`` on a free (or given) port, served from a daemon thread.

    Use as a context manager; ``url`` is ``http://host:port``.
    """

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        loop: str = "auto",
        lifespan: Literal["auto", "on", "off"] = "on",
    ) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            loop=loop,
            http=HttpProtocol,
            lifespan=lifespan,
            timeout_graceful_shutdown=2,
            timeout_keep_alive=CLIENT_KEEPALIVE_S,
            ws="none",  # as `cachegate serve`: WebSocket handshakes reach the app as HTTP
            server_header=False,  # a proxy's response headers are the upstream's
            date_header=False,
            proxy_headers=False,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name=f"uvicorn:{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        self.server.run(sockets=[self._sock])

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
