"""cachegate's upstream connection pool: HTTP/1.1 on asyncio protocols, responses parsed by httptools.

A relay needs four things from its upstream client: send a request, read the status and headers,
iterate the body as the bytes arrive, and close at once when the client hangs up. General clients do
much more per request and per chunk (httpx's models and decoders, aiohttp's client session and
stream reader, the httpx-aiohttp bridge between them). Measured on the benchmark (2 cores, loopback,
100 concurrent streams), the same uvicorn app spent 3.9 ms of CPU per stream with httpx over aiohttp
and 2.2 ms with this pool, and the time to first byte it added fell from about 30 ms to about 0.

What it does:

- keep-alive connections per origin (scheme, host, port), reused newest first, dropped after
  ``keepalive_expiry`` idle seconds, at most ``max_keepalive`` idle and ``max_connections`` open;
  a request waits for a free slot up to ``pool_timeout``;
- request bodies as bytes (``content-length``) or an async iterator (``transfer-encoding:
  chunked``), written with flow control;
- a new plain-HTTP connection to an IP address sends a request with a bytes body in the same
  step as its non-blocking connect (``sendmsg``) where the connect completes at once (Linux, to
  an upstream on the same host), then hands the socket to the loop; a connect still in progress
  (macOS, a remote host) waits for the socket to be writable; names, ``https``, streamed bodies
  and Windows use ``loop.create_connection``;
- response bodies framed by ``content-length``, chunked encoding, or the connection's end; interim
  1xx responses skipped; HEAD answered without a body;
- timeouts: ``connect_timeout`` to open a connection, ``read_timeout`` between bytes;
- TLS for ``https`` origins, verified against certifi's bundle as httpx does (``SSL_CERT_FILE`` or
  ``SSL_CERT_DIR`` select another);
- a request that finds its reused connection closed by the server before any byte of an answer is
  sent once more on a new connection (the server closed an idle connection as it was reused);
  an idle connection whose socket has bytes or its end waiting is not reused, nor one that
  carried a 5xx answer (servers close after those, sometimes without saying so);
- failures raised as httpx's exceptions (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
  ``PoolTimeout``, ``RemoteProtocolError``, ``ReadError``), so callers handle every pool alike.

It adds no header of its own but ``host``, ``content-length`` or ``transfer-encoding``, keeps no
cookies, and never follows redirects.
"""

from __future__ import annotations

import asyncio
import asyncio.staggered as staggered
import collections
import contextlib
import errno
import functools
import itertools
import os
import select
import socket
import ssl
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, overload
from urllib.parse import urlsplit

import httptools
import httpx

_OUTQ: int | None  # the ioctl that says what the kernel still holds of what a socket was given
try:  # to send (Linux)
    import fcntl
    import termios

    # macOS defines it for terminals only (a socket answers ENOTTY there): Linux's alone
    _OUTQ = termios.TIOCOUTQ if sys.platform.startswith("linux") else None
except ImportError:  # pragma: no cover  (Windows)
    _OUTQ = None
_POLL = getattr(select, "poll", None)  # not on Windows

_HIGH_WATER = 256 * 1024  # buffered response bytes before the socket stops being read
_WRITE_JOIN = 64 * 1024  # bodies up to this size go out in one write with the head
# An answer's status line and headers beyond this are refused (h11, under httpx, allows 16 KiB;
# providers send 1-4): an upstream that never ends its headers must not take the memory with it.
MAX_HEAD_BYTES = 64 * 1024
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # a closed peer is an error, never a signal
# Sending a request in the connect's own step needs ``sendmsg`` and a loop that watches sockets
# for writing (``add_writer``): Windows has neither (no ``sendmsg``; the Proactor loop).
_SEND_WITH_CONNECT = hasattr(socket.socket, "sendmsg") and sys.platform != "win32"
# What a non-blocking connect says when it has not completed in the call (EINTR: it goes on in
# the background).
_CONNECTING = frozenset({errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR})

Origin = tuple[str, str, int]  # scheme, host, port


# A request body longer than this answered early is not trusted to have been read (below it, the
# kernel's buffers took it whole and a server reads a refused body's few bytes as a rule).
_UNREAD_UPLOAD: Final = 64 * 1024


class SizedStream(AsyncIterator[bytes]):
    """A request body streamed on as it arrives, of the length its client announced: sent with
    that ``content-length`` (an upload of a file, an audio clip), not chunked, as the client
    sent it; servers that take no chunked request bodies, or check a length, see no difference."""

    __slots__ = ("chunks", "length")

    def __init__(self, chunks: AsyncIterator[bytes], length: int) -> None:
        self.chunks = chunks
        self.length = length

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        return await self.chunks.__anext__()


class InvalidAnswer(httpx.RemoteProtocolError):
    """The upstream answered, but not in HTTP/1.1 as cachegate (and other clients) read it."""


class UpstreamHeaders:
    """The response's headers in the order and spelling the upstream sent them."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw

    @overload
    def get(self, name: str) -> str | None: ...
    @overload
    def get(self, name: str, default: str) -> str: ...
    def get(self, name: str, default: str | None = None) -> str | None:
        """The first value of ``name`` (any case), decoded as latin-1."""
        key = name.lower().encode("latin-1")
        for k, v in self.raw:
            if k.lower() == key:
                return v.decode("latin-1")
        return default

    def __getitem__(self, name: str) -> str:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value


class UpstreamResponse:
    """One response: status and headers are read; the body is iterated with ``async for chunk in
    response.stream``. ``aclose()`` returns the connection to the pool when the body was read to its
    end and the upstream keeps it alive, and closes it at once otherwise."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_error",
        "_retired",
        "_sink",
        "_sink_full",
        "_waiter",
        "headers",
        "status_code",
    )

    def __init__(self, conn: _Connection, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._conn: _Connection | None = conn
        self._retired = False
        self.status_code = status
        self.headers = UpstreamHeaders(headers)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], bool] | None = None
        self._sink_full = False

    @property
    def stream(self) -> UpstreamResponse:
        return self

    # -- fed by the connection -----------------------------------------------------------------

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        if self._sink is not None:  # piped: handed over when the socket read is parsed
            return
        self._buffered += len(chunk)
        if self._buffered > _HIGH_WATER and self._conn is not None:
            self._conn.pause_reading()
        self._wake()

    def _take(self) -> bytes:
        """Everything buffered, as one piece (the caller checked there is some)."""
        chunks = self._chunks
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        return chunk

    def _to_sink(self) -> None:
        """Piped: what one socket read brought, to the sink in one call (several events that
        arrived together leave in one write). Called from the connection's callback."""
        sink = self._sink
        chunks = self._chunks
        if sink is None or not chunks:
            return
        # _take(), inlined: this runs once per relayed chunk
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        try:
            room = sink(chunk)
        except Exception as exc:  # the consumer failed: the pipe ends with its error
            self._sink = None
            self._error = exc  # even when the body had just ended: the consumer did not get it
            self._wake()
            return
        if not room and not self._sink_full:
            self._sink_full = True
            if self._conn is not None:
                self._conn.pause_reading()
            self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if self._done or self._error is not None:
            return
        if error is None:
            self._done = True
        else:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the caller --------------------------------------------------------------------

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._chunks:
                # Everything already buffered, as one piece: a relay that fell behind catches up
                # with one write instead of one per upstream chunk (the bytes are the same).
                chunk = self._take()
                if self._conn is not None:
                    self._conn.resume_reading()  # a no-op unless reading was paused
                return chunk
            if self._error is not None:
                raise self._error
            if self._done:
                raise StopAsyncIteration
            await self._more()

    async def _more(self) -> None:
        """Wait, with the read timeout, until the connection brings something (or ends)."""
        conn = self._conn
        if conn is None:
            raise httpx.ReadError("the response was closed")
        self._waiter = conn.loop.create_future()
        try:
            await conn.wait(self._waiter)
        finally:
            self._waiter = None

    async def pipe(
        self, sink: Callable[[bytes], bool], drain: Callable[[], Awaitable[object]]
    ) -> None:
        """Hand the rest of the body to ``sink`` as it arrives, called from the connection's own
        callback: a relay then costs no task switch per chunk, and what one socket read brought
        goes in one call. ``sink`` returns False when its consumer is full; reading then pauses
        until ``drain()`` returns. Returns at the end of the body; raises what ``__anext__``
        would (and what ``sink`` raised), after handing over every byte received before the
        error. Chunks already buffered go first. The read timeout applies as usual."""
        self._sink = sink
        if self._conn is not None:
            # Reading may have been paused while this body was buffered before the pipe began:
            # from now on only a full sink pauses it.
            self._conn.resume_reading()
        try:
            while True:
                if self._chunks:
                    self._to_sink()
                if self._error is not None:
                    raise self._error
                if self._sink_full:
                    await drain()
                    self._sink_full = False
                    if self._conn is not None:
                        self._conn.resume_reading()
                    continue
                if self._done:
                    return
                await self._more()
        finally:
            self._sink = None

    async def aread(self) -> bytes:
        """The rest of the body."""
        return b"".join([chunk async for chunk in self])

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        # The error the body ended with was raised where it was awaited: its traceback holds
        # that frame, which holds this response (a cycle only a collection would free, with
        # the request's body in it). Read after the close, the body says it was closed.
        self._error = None
        if conn is not None:
            conn.release(self._done and not self._chunks and not self._retired)

    def retire(self) -> None:
        """Close its connection when the response is closed, not back to the pool: the request
        it refused goes again at once, and a server that closes after a refusal without saying
        so (no ``connection: close``) closes it a moment later, with the request on it
        unanswered (cachegate's 502, where the client's own request had been answered)."""
        self._retired = True


class _Connection(asyncio.Protocol):
    """One upstream connection and the exchange currently on it."""

    def __init__(self, pool: UpstreamPool, origin: Origin, read_timeout: float) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.uses = 0
        self.idle_since = 0.0
        self._parser: httptools.HttpResponseParser | None = None
        self._head_only = False
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None
        self._received = False  # any byte of an answer to the current request
        self._until_close = False  # the body ends with the connection
        self._ambiguous = False  # framed both by length and by chunks, or said to close
        self._complete = False
        self._keep_alive = False
        self._request_incomplete = False  # the answer came before the request body was all sent
        self._upload = 0  # the request body's length (a chunked one's, as it goes; 0: none)
        self._aborted = False
        self._reading_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._waiting: asyncio.Future[Any] | None = None  # what a caller awaits (read timeout)
        self._mark = 0.0  # loop time of the last byte received or the last wait begun
        self._timer: asyncio.TimerHandle | None = None
        self._sent: int | None = None  # bytes of the first request sent before the transport
        self._sent_at = 0.0  # loop time the request was all written
        self._head_bytes = 0  # bytes received of the current answer before its headers ended
        self._fd = -1
        self._inode = -1  # the socket's, when plain TCP: what a salvage reads is its own
        self._queued = -1  # bytes of a large request not yet sent when last looked at (-1: none)
        self._upload_poll: asyncio.TimerHandle | None = None  # looks at them while they leave
        self._tls = False

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's too)
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1
        self._tls = transport.get_extra_info("sslcontext") is not None
        if self._fd >= 0 and not self._tls:
            with contextlib.suppress(OSError):
                self._inode = os.fstat(self._fd).st_ino

    def unsent(self) -> int:
        """Bytes of what was written that have not left yet: the transport's buffer and the
        socket's send queue. Over TLS the transport's buffer is empty once it has encrypted
        what it was given (the encrypted bytes wait in the TCP transport under it, which no
        public interface shows): the socket's queue alone."""
        transport = self.transport
        queued = transport.get_write_buffer_size() if transport is not None else 0
        if self._fd >= 0 and _OUTQ is not None:
            with contextlib.suppress(OSError):
                answer = fcntl.ioctl(self._fd, _OUTQ, b"\0\0\0\0")
                queued += int.from_bytes(answer, sys.byteorder)
        return queued

    def readable(self) -> bool:
        """Whether the socket has bytes or its end waiting that the loop has not read yet. An
        idle connection should have none: it is the server's close (or a stray answer) that
        arrived after the last answer, in the same moment (httpcore checks the same)."""
        if self._fd < 0:
            return False
        if _POLL is None:  # Windows: ``select`` takes sockets there, whatever their number
            return bool(select.select([self._fd], [], [], 0)[0])
        poller = _POLL()
        poller.register(self._fd, select.POLLIN)
        return bool(poller.poll(0))

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None or self._complete:  # nothing was asked: a confused upstream
            self.abort()
            return
        self._received = True
        self._mark = self.loop.time()
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(InvalidAnswer(f"invalid answer from upstream: {exc}"))
            self.abort()
        except httptools.HttpParserUpgrade:  # after a 101, which on_headers_complete refused
            self.abort()
        response = self._response
        if response is None:  # the headers have not ended yet
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and not self._aborted:
                self._fail(
                    InvalidAnswer(f"upstream's response headers exceed {MAX_HEAD_BYTES} bytes")
                )
                self.abort()
        elif response._sink is not None:
            response._to_sink()

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        if exc is not None and self._parser is not None and not self._complete:
            self._salvage()
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stop_upload_poll()
        self.pool._forget(self)
        if self._response is not None and self._until_close and exc is None and not self._aborted:
            self._response._finish()  # a body delimited by the connection's end has ended
        elif not self._complete:
            self._fail(
                httpx.RemoteProtocolError("upstream closed the connection before answering")
                if not self._received or self._response is None
                else httpx.ReadError("upstream closed the connection mid-response")
            )
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_exception(httpx.WriteError("upstream closed the connection"))
            drain.exception()  # retrieved: a body written whole (no one waits) must not log it
        # The parser holds this connection's methods, a cycle only a collection would free
        # (after an error answer or a failure; a connection released whole lets it go there).
        self._parser = None

    def _salvage(self) -> None:
        """Read what the socket still holds when a write failed. A server that refuses an upload
        (401, 413) answers and closes without reading it; a write of the upload's next piece
        then fails on the reset, and the transport closes before the loop reads the answer that
        came just before the reset: the client would get an error instead of the refusal (and
        its SDK would send the whole upload again). Plain TCP only (TLS bytes are the
        transport's to decrypt), and only the socket this connection opened (its inode)."""
        if self._inode < 0 or self._aborted:
            return
        try:
            if os.fstat(self._fd).st_ino != self._inode:
                return
            for _ in range(64):  # an error answer: a few KiB; at most 4 MiB
                data = os.read(self._fd, 65536)
                if not data:
                    return
                self.data_received(data)
                if self._complete or self._aborted:
                    return
        except OSError:  # nothing more (the reset itself, or nothing waiting)
            return

    def pause_writing(self) -> None:
        if self._drain is None or self._drain.done():
            self._drain = self.loop.create_future()

    def resume_writing(self) -> None:
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    # -- httptools callbacks -------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None
        if self._complete:  # a second answer to one request: never reuse this connection
            self._keep_alive = False
            return
        status = parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._raw_headers = []  # an interim answer (100 Continue, 103 Early Hints): skip it
            return
        if status == 101:  # cachegate never asks to switch protocols (Upgrade is not forwarded)
            self._raw_headers = []
            self._fail(InvalidAnswer("upstream switched protocols (101) unasked"))
            return
        headers, self._raw_headers = self._raw_headers, []
        coding, unchunked = _transfer_coding(headers)
        if coding is not None:  # (relayed, its bytes would reach the client still encoded)
            self._fail(InvalidAnswer(f"upstream used transfer coding {coding!r}, not supported"))
            return
        response = UpstreamResponse(self, status, headers)
        self._response = response
        framing = {k.lower() for k, _ in headers} & {b"content-length", b"transfer-encoding"}
        bodiless = self._head_only or status in (204, 304) or status == 101
        # (a transfer coding whose last is not chunked, ``identity``: the body ends with the
        # connection, whatever length is said, as RFC 9112, 6.3 and the parser read it)
        self._until_close = (not framing or unchunked) and not bodiless
        # RFC 9112, 6.3: close the connection after an answer framed both ways; and after one
        # that says ``close`` (9.6), wherever its Connection header says it: llhttp reads an
        # HTTP/1.0 answer's ``keep-alive, close`` as kept alive
        self._ambiguous = len(framing) == 2 or _says_close(headers)
        if self._head_only:  # the parser would wait for a body the length announces: stop here
            self._complete = True
            self._keep_alive = False
            response._finish()
        head = self._head
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        response = self._response
        if response is not None and not self._complete:
            if response._sink is not None:  # piped: handed over after the read is parsed
                response._chunks.append(body)
            else:
                response._feed(body)

    def on_message_complete(self) -> None:
        parser = self._parser
        if self._response is None or self._complete:  # the end of a skipped 1xx answer
            return
        assert parser is not None
        self._complete = True
        self._keep_alive = (
            parser.should_keep_alive() and not self._until_close and not self._ambiguous
        )
        self._response._finish()

    # -- the exchange --------------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        head = self._head
        if head is not None and not head.done():
            head.set_exception(error)
            head.exception()  # retrieved: an exchange abandoned mid-upload must not log it
        if self._response is not None:
            self._response._finish(error)

    async def wait(self, future: asyncio.Future[Any]) -> Any:
        """Await ``future`` with the read timeout (counted from the later of now and the last
        byte received); a timeout closes the connection.

        One timer per connection, re-armed when it fires early, instead of one per wait: a
        stream waits once per event."""
        self._waiting = future
        self._mark = self.loop.time()
        if self._timer is None:
            self._timer = self.loop.call_at(self._mark + self.read_timeout, self._check_timeout)
        try:
            return await future
        finally:
            self._waiting = None
            # A timeout is set on ``future`` itself: raised here, its traceback holds this frame,
            # which would hold the future, which holds the error (a cycle, with the response).
            del future

    def _check_timeout(self) -> None:
        self._timer = None
        future = self._waiting
        if future is None or future.done() or self.closed:
            return  # nobody is waiting: the next wait arms a timer again
        deadline = self._mark + self.read_timeout
        if self.loop.time() < deadline:
            self._timer = self.loop.call_at(deadline, self._check_timeout)
            return
        future.set_exception(httpx.ReadTimeout("upstream sent nothing for too long"))
        self._fail(httpx.ReadTimeout("upstream sent nothing for too long"))
        self.abort()

    def begin(self, method: bytes) -> None:
        """Ready the connection for one answer, before any byte of its request goes out."""
        self.uses += 1
        self._parser = parser = httptools.HttpResponseParser(self)
        # What HTTP clients take (h11, httpx): bare LF line ends, a length beside chunked
        # framing (the chunks win; the connection is not reused after), and blanks after a
        # chunk's size (h11 takes them at the line's end, RFC 9112 before a ``;`` extension;
        # llhttp refuses both unless told). httptools >= 0.6.4.
        parser.set_dangerous_leniencies(
            lenient_optional_cr_before_lf=True,
            lenient_chunked_length=True,
            lenient_spaces_after_chunk_size=True,
        )
        self._head_only = method == b"HEAD"
        self._response = None
        self._received = self._complete = self._until_close = self._keep_alive = False
        self._ambiguous = False
        self._request_incomplete = False
        self._stop_upload_poll()
        self._raw_headers = []
        self._head_bytes = 0
        self._head = self.loop.create_future()

    async def exchange(
        self, method: bytes, head: bytes, content: bytes | AsyncIterator[bytes]
    ) -> UpstreamResponse:
        """Send one request and wait for the answer's status and headers.

        On a connection opened by ``UpstreamPool._connect_sending`` the exchange has begun and
        the request's first ``_sent`` bytes are already sent: only the rest is written."""
        transport = self.transport
        assert transport is not None
        sent, self._sent = self._sent, None
        if sent is None:
            self.begin(method)
        answer = self._head
        assert answer is not None
        self._upload = (
            len(content)
            if isinstance(content, bytes)
            else content.length
            if isinstance(content, SizedStream)
            else 0
        )
        if isinstance(content, bytes):
            if sent:  # as much as the socket took at once
                if self.closed or transport.is_closing():  # answered and closed already
                    return await self.wait(answer)
                if sent < len(head):
                    transport.write(head[sent:])
                    sent = len(head)
                if sent - len(head) < len(content):
                    transport.write(memoryview(content)[sent - len(head) :])
            elif len(content) <= _WRITE_JOIN:
                transport.write(head + content)
            else:
                transport.write(head)
                transport.write(content)
        else:
            transport.write(head)
            sized = isinstance(content, SizedStream)
            async for chunk in content:
                if _refused(answer) or self.closed or transport.is_closing():
                    # Refused (or failed, or closed) before the body was all sent: a server
                    # that refuses an upload (401, 413) answers and closes without reading it.
                    # Its answer is relayed; the connection cannot carry another request. (One
                    # that accepts it early, a 2xx before the body, reads on: the rest goes.)
                    self._request_incomplete = True
                    break
                if chunk:
                    transport.write(chunk if sized else b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                    if not sized:  # (its length, as it goes: ``release`` judges the upload by it)
                        self._upload += len(chunk)
                    drain = self._drain
                    if drain is not None and not drain.done():
                        await self._drain_or_answer(drain, answer)
                if _refused(answer):  # (not waiting for the client's next piece to notice)
                    self._request_incomplete = True
                    break
            else:
                if not sized and not (self.closed or transport.is_closing()):
                    transport.write(b"0\r\n\r\n")
        if not isinstance(content, bytes) or len(content) > _WRITE_JOIN:
            queued = self.unsent()
            if queued > 0 or self._tls:  # on its way: the read timeout counts from its progress
                self._queued = queued
                self._upload_poll = self.loop.call_later(self._poll_s, self._poll_upload)
        self._sent_at = self.loop.time()
        return await self.wait(answer)

    @property
    def _poll_s(self) -> float:
        return min(1.0, self.read_timeout / 8)

    def _poll_upload(self) -> None:
        """While a large request is still leaving (an upload over a slow link, the upstream
        reading it before it answers), each step of it counts as the upstream's progress for
        the read timeout, its last step included (within ``_poll_s``); it stops at the first
        byte of the answer, or once nothing is left to send."""
        self._upload_poll = None
        if self.closed or self._received or self._queued < 0:
            self._queued = -1
            return
        queued = self.unsent()
        if queued != self._queued:
            # (a change either way: over TLS the count is the socket's queue only, the
            # encrypted rest waiting in a transport below refills it as it empties)
            self._mark = self.loop.time()
        self._queued = queued
        if queued > 0 or self._tls:  # (TLS: watched until the answer; see unsent)
            self._upload_poll = self.loop.call_later(self._poll_s, self._poll_upload)
        else:
            self._queued = -1

    def _stop_upload_poll(self) -> None:
        self._queued = -1
        if self._upload_poll is not None:
            self._upload_poll.cancel()
            self._upload_poll = None

    async def _drain_or_answer(
        self, drain: asyncio.Future[None], answer: asyncio.Future[Any]
    ) -> None:
        """Wait until the upstream reads more of an upload, or refuses it. An upstream that stops
        reading and says nothing times out; one that refuses meanwhile (and closes, or keeps the
        connection open unread) ends the wait, and its answer is what the client gets; one that
        accepted it early (a 2xx) is waited for as one that has not answered."""
        if answer.done():
            if not _refused(answer):  # accepted early: the server reads on, at its own pace
                with contextlib.suppress(httpx.WriteError):  # (closed since: its answer goes)
                    await self.wait(drain)
            return
        wake = functools.partial(_settle_drain, drain)
        answer.add_done_callback(wake)
        try:
            await self.wait(drain)
        except httpx.WriteError:
            if not answer.done():  # closed with no answer: the answer's own error follows
                raise
        finally:
            answer.remove_done_callback(wake)

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()

    def release(self, read_to_end: bool) -> None:
        """The caller is done with the response: back to the pool, or closed."""
        if (
            read_to_end
            and self._complete
            and self._keep_alive
            and not self._request_incomplete
            and not self.closed
            # A server in trouble may close after its 5xx without saying so (no "connection:
            # close"), a moment after the answer: the next request sent on it would be lost
            # unanswered. Errors are rare; a new connection for the next request costs little.
            and (self._response is None or self._response.status_code < 500)
            # A large upload answered with a refusal (413, 401) may be unread, or still on its
            # way: the next request would follow its rest, and wait for an answer that never
            # comes (a 504 after timeout_s) or be read as part of it.
            and (
                self._upload <= _UNREAD_UPLOAD
                or (
                    (self._response is None or self._response.status_code < 400)
                    and self.unsent() == 0
                )
            )
        ):
            self._parser = None
            self._response = None
            self._head = None
            self.resume_reading()
            self.pool._release(self)
        else:
            self.abort()

    def abort(self) -> None:
        """Close at once (the upstream sees its socket closed)."""
        self._aborted = True  # closed by us: a body delimited by the close has not ended
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.abort()
        if not self.closed:
            # connection_lost follows from the loop; account for the slot now
            self.pool._forget(self)


def _let_go(conn: _Connection, exc: BaseException) -> None:
    """An exchange's error, on its way out of the pool: the frames it was raised through (the
    exchange's, its waits') have ended, but its traceback keeps them, their locals with them,
    and among those the future that holds the error, as the connection does: a cycle only a
    collection would free, with the request's body in it. Both let it go."""
    conn._head = None
    traceback.clear_frames(exc.__traceback__)


def _ip_family(host: str) -> int:
    """``AF_INET`` or ``AF_INET6`` for an IP address literal, 0 for a name (or a scoped address)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return family
    return 0


def _new_socket(family: int) -> socket.socket:
    """A TCP socket for ``_connect_sending`` (a test puts another platform's behaviour here)."""
    return socket.socket(family, socket.SOCK_STREAM)


# Happy Eyeballs (RFC 8305): a host name's next address is tried when the one before has not
# connected within this long, the first to connect taken
ATTEMPT_DELAY_S: Final = 0.25

Address = tuple[int, int, int, Any]  # (family, type, proto, sockaddr) of ``getaddrinfo``


async def _resolve(loop: asyncio.AbstractEventLoop, host: str, port: int) -> list[Address]:
    """``host``'s addresses for TCP, in the resolver's order (a test puts others here)."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [(family, kind, proto, sockaddr) for family, kind, proto, _, sockaddr in infos]


def _interleaved(addresses: list[Address]) -> list[Address]:
    """``addresses`` with their families taken in turn, the first one's first (RFC 8305): a
    broken IPv6 route costs one attempt's delay, not each IPv6 address's."""
    first = [a for a in addresses if a[0] == addresses[0][0]]
    rest = [a for a in addresses if a[0] != addresses[0][0]]
    out: list[Address] = []
    for pair in itertools.zip_longest(first, rest):
        out.extend(a for a in pair if a is not None)
    return out


async def _connected_socket(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    """A socket connected to ``host``: its addresses tried in turn, each next one started when
    the one before has not connected within ``ATTEMPT_DELAY_S`` (the event loop's own connect
    tries them one after another, each until it fails: an address that drops packets, a broken
    IPv6 route to a dual-stack provider, spent the whole connect timeout and every request was
    a 504, where the SDKs, through anyio, connect at once)."""
    addresses = _interleaved(await _resolve(loop, host, port))
    if not addresses:
        raise OSError(f"{host} resolves to no address")
    opened: list[socket.socket] = []

    async def attempt(address: Address) -> socket.socket:
        family, kind, proto, sockaddr = address
        sock = socket.socket(family, kind, proto)
        opened.append(sock)
        sock.setblocking(False)
        await loop.sock_connect(sock, sockaddr)
        return sock

    try:
        if len(addresses) == 1:
            winner = await attempt(addresses[0])
        else:
            found, _, errors = await staggered.staggered_race(
                [functools.partial(attempt, address) for address in addresses], ATTEMPT_DELAY_S
            )
            if found is None:
                failed = [str(e) for e in errors if e is not None]
                raise OSError(f"no address of {host} took the connection: {'; '.join(failed)}")
            winner = found
    except BaseException:
        for sock in opened:
            sock.close()
        raise
    for sock in opened:
        if sock is not winner:
            sock.close()  # (one that connected too, after the winner)
    return winner


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _refused(answer: asyncio.Future[Any]) -> bool:
    """Whether an upload's answer, come before the upload's end, ends it: a failure, or an error
    status (a refusal, 401 or 413, which a server sends before reading what it refuses). A 1xx
    is skipped before it gets here; a 2xx or 3xx sent early (RFC 9112 allows it) is no reason to
    stop: a server that answers so may read the rest, and wait for it (as httpx and curl send
    it)."""
    if not answer.done():
        return False
    if answer.cancelled() or answer.exception() is not None:
        return True
    return bool(answer.result().status_code >= 400)


def _settle_drain(drain: asyncio.Future[None], answer: asyncio.Future[Any]) -> None:
    """An upload's answer came while the upload waited for room: a refusal ends the wait; an
    answer that accepts it leaves the wait to the room it waits for (settled, the drain read as
    room made, and the rest of the upload went into cachegate's memory at the client's pace)."""
    if _refused(answer):
        _settle(drain)


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Wait for a connecting socket to be connected; raise the connect's error."""
    ready = loop.create_future()
    fd = sock.fileno()
    loop.add_writer(fd, _settle, ready)
    try:
        await ready
    finally:
        loop.remove_writer(fd)
    error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if error:
        raise OSError(error, os.strerror(error))


def _says_close(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a ``Connection`` header among ``headers`` holds the ``close`` option."""
    return any(
        len(name) == 10
        and name.lower() == b"connection"
        and value.lower().find(b"close") >= 0
        and any(option.strip() == b"close" for option in value.lower().split(b","))
        for name, value in headers
    )


def _transfer_coding(headers: list[tuple[bytes, bytes]]) -> tuple[str | None, bool]:
    """A transfer coding other than ``chunked`` that ``headers`` name (``gzip, chunked``:
    the parser takes the chunks off but not the gzip, and no header would tell the client),
    and whether they name codings of which the last is not ``chunked`` (``identity``)."""
    last = None
    for name, value in headers:
        if name.lower() == b"transfer-encoding":
            codings = [c.strip(b" ").lower() for c in value.split(b",")]
            if value.find(b"\t") >= 0 or not codings[-1]:
                # (``chunked,``, ``chunked\t``: the parser reads such a body raw to the end,
                # its chunks' framing and all, where this list would read it as chunked; empty
                # items before the last it skips, as RFC 9110, 5.6.1 asks)
                return value.decode("latin-1"), False
            for coding in codings:
                if coding and coding not in (b"chunked", b"identity"):
                    return coding.decode("latin-1"), False
                last = coding or last
    return None, last is not None and last != b"chunked"


def ca_source() -> str:
    """Where ``ssl_context`` takes its CA file from, as a start-up error names it (a directory,
    ``SSL_CERT_DIR``, is only read as a connection needs it, and cannot fail the load)."""
    cafile = os.environ.get("SSL_CERT_FILE")
    return f"SSL_CERT_FILE={cafile}" if cafile else "certifi's bundle"


def ssl_context() -> ssl.SSLContext:
    """Verification as httpx does it: certifi's bundle unless SSL_CERT_FILE/SSL_CERT_DIR say else
    (an unreadable file, or one with no certificate, raises ``OSError``)."""
    cafile = os.environ.get("SSL_CERT_FILE")
    capath = os.environ.get("SSL_CERT_DIR")
    if not cafile and not capath:
        try:
            import certifi

            cafile = certifi.where()
        except ImportError:  # pragma: no cover - certifi comes with httpx
            cafile = None
    return ssl.create_default_context(cafile=cafile or None, capath=capath or None)


# A request is sent again on a new connection (``UpstreamPool.open``) when the reused one had
# been idle this long at least (long enough to have met the server's keep-alive timeout)...
RESEND_IDLE_S = 1.0
# ...and closed unanswered within this time of the request: a round trip to a far provider.
RESEND_WINDOW_S = 1.0


class UpstreamPool:
    """Pooled HTTP/1.1 connections to the upstream origins."""

    def __init__(
        self,
        *,
        max_connections: int = 1000,
        max_keepalive: int = 200,
        keepalive_expiry: float = 30.0,
        connect_timeout: float = 10.0,
        read_timeout: float = 600.0,
        pool_timeout: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.max_keepalive = max_keepalive
        self.keepalive_expiry = keepalive_expiry
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.pool_timeout = read_timeout if pool_timeout is None else pool_timeout
        # When a reused connection's close without an answer reads as the keep-alive race, and
        # the request is sent again on a new connection (``RESEND_IDLE_S``).
        self.resend_idle = RESEND_IDLE_S
        self.resend_window = RESEND_WINDOW_S
        self._ssl = ssl_context
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._connecting = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._targets: dict[str, tuple[Origin, bytes, bytes]] = {}
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._open) + self._connecting

    @property
    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    @property
    def in_use(self) -> int:
        """Connections checked out to an exchange (not idle, not closed)."""
        return len(self._open) - self.idle_connections

    def _target(self, url: str) -> tuple[Origin, bytes, bytes]:
        """Origin, host header and request target of ``url`` (cached: a proxy has few URLs)."""
        cached = self._targets.get(url)
        if cached is not None:
            return cached
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise httpx.UnsupportedProtocol(f"cannot send a request to {url!r}")
        default = 443 if scheme == "https" else 80
        port = parts.port or default
        host = parts.hostname
        try:
            name = host.encode("ascii")
        except UnicodeEncodeError:
            name = host.encode("idna")
        host_header = name if b":" not in name else b"[%s]" % name
        if port != default:
            host_header += b":%d" % port
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        result = ((scheme, host, port), host_header, target.encode("latin-1"))
        if len(self._targets) < 4096:
            self._targets[url] = result
        return result

    async def open(
        self,
        method: str,
        url: str,
        headers: list[tuple[bytes, bytes]],
        content: bytes | AsyncIterator[bytes] = b"",
    ) -> UpstreamResponse:
        """Send a request; the answer's status and headers are read, its body is not."""
        origin, host, target = self._target(url)
        if isinstance(content, bytearray | memoryview):
            content = bytes(content)
        verb = method.encode("ascii")
        lines = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (verb, target, host)]
        lines.extend(b"%s: %s\r\n" % (k, v) for k, v in headers)
        if isinstance(content, bytes):
            if content or verb not in (b"GET", b"HEAD", b"DELETE", b"OPTIONS"):
                lines.append(b"content-length: %d\r\n" % len(content))
        elif isinstance(content, SizedStream):
            lines.append(b"content-length: %d\r\n" % content.length)
        else:
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"\r\n")
        head = b"".join(lines)
        request = (verb, head, content) if isinstance(content, bytes) else None
        for attempt in (0, 1):
            # The resend goes on a new connection: the other idle ones may be as stale (a burst
            # of sub-agents leaves several, whose keep-alive ends together).
            conn = await self._acquire(origin, request, fresh=attempt == 1)
            idle = time.monotonic() - conn.idle_since  # (a new connection: never used, no matter)
            try:
                return await conn.exchange(verb, head, content)
            except httpx.RemoteProtocolError as exc:
                # The server closed this idle connection as it was reused (its keep-alive
                # timeout, which a connection idle for a second or more may have run into):
                # the close comes within a round trip of the request, unanswered. Else the
                # request may have been taken (a generation begun, billed): not sent twice
                # (RFC 9112, 9.3.1), the client gets the error.
                stale = (
                    conn.uses > 1
                    and not conn._received
                    and idle >= self.resend_idle
                    and conn.loop.time() - conn._sent_at < self.resend_window
                )
                conn.abort()
                _let_go(conn, exc)
                if attempt == 0 and stale and isinstance(content, bytes):
                    continue
                raise
            except BaseException as exc:
                conn.abort()  # cancelled (the client left) or failed: the upstream sees the close
                _let_go(conn, exc)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _acquire(
        self,
        origin: Origin,
        request: tuple[bytes, bytes, bytes] | None = None,
        *,
        fresh: bool = False,
    ) -> _Connection:
        """An idle connection to ``origin``, or a new one (which ``request``, when given, may
        already be on its way through: see ``_connect_sending``); ``fresh``: a new one."""
        if self._closed:
            raise httpx.ConnectError("the upstream pool is closed")
        idle = None if fresh else self._idle.get(origin)
        if idle:
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                if self._usable(conn, now):
                    return conn
                conn.abort()
        deadline: float | None = None  # one wait in all: a slot lost to another is no restart
        while self.open_connections >= self.max_connections:
            spare = next((c for idle in self._idle.values() for c in idle), None)
            if spare is not None:  # an idle connection to another origin gives up its slot
                spare.abort()
                continue
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            if deadline is None:
                deadline = loop.time() + self.pool_timeout
                self._waiters.append(waiter)
            else:  # woken for a slot another took: still the first in line
                self._waiters.appendleft(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException as exc:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self._wake_waiter()  # handed a free slot, but leaving: pass it on
                if isinstance(exc, TimeoutError):
                    raise httpx.PoolTimeout(
                        f"all {self.max_connections} upstream connections"
                        " (upstream.max_connections) stayed in use"
                        f" for {self.pool_timeout:g} s"
                    ) from None
                raise
            idle = None if fresh else self._idle.get(origin)
            if idle:
                conn = idle.pop()
                if self._usable(conn, time.monotonic()):
                    return conn
                conn.abort()  # its slot is free now: a new connection takes it
        return await self._connect(origin, request)

    def _usable(self, conn: _Connection, now: float) -> bool:
        """Whether an idle connection may carry a request: open, not idle past
        ``keepalive_expiry``, and with nothing waiting on its socket (the server's close)."""
        return (
            not conn.closed
            and now - conn.idle_since < self.keepalive_expiry
            and not conn.readable()
        )

    async def _connect(
        self, origin: Origin, request: tuple[bytes, bytes, bytes] | None = None
    ) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl_context()
            tls = self._ssl
        family = (
            _ip_family(host) if tls is None and request is not None and _SEND_WITH_CONNECT else 0
        )
        self._connecting += 1
        try:
            async with asyncio.timeout(self.connect_timeout):
                if family:
                    assert request is not None
                    conn = await self._connect_sending(origin, family, request)
                else:
                    sock = await _connected_socket(loop, host, port)
                    try:
                        _, conn = await loop.create_connection(
                            lambda: _Connection(self, origin, self.read_timeout),
                            sock=sock,
                            ssl=tls,
                            server_hostname=host if tls is not None else None,
                        )
                    except BaseException:
                        sock.close()
                        raise
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            hint = ""
            if isinstance(exc, ssl.SSLError) and exc.reason == "WRONG_VERSION_NUMBER":
                # (TLS spoken to a plain-HTTP port, its "HTTP/1.1 400" read as a TLS record: a
                # local vLLM, Ollama or the simulator given as https://, which OpenSSL says only
                # in its own words)
                hint = f": the upstream speaks plain HTTP on port {port}, use http:// for it"
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}{hint}") from exc
        finally:
            self._connecting -= 1
            self._wake_waiter()
        if not conn.closed:  # (an answer and the close can come before the transport is handed)
            self._open.add(conn)
        return conn

    async def _connect_sending(
        self, origin: Origin, family: int, request: tuple[bytes, bytes, bytes]
    ) -> _Connection:
        """A new plain-HTTP connection to an IP address, with ``request`` (method, head, body)
        sent in the same step as the connect where the kernel completes it at once.

        To an upstream on the same host a non-blocking connect is usually complete when the call
        returns, so the request can go out before the event loop has seen the socket at all.
        Through ``loop.create_connection`` it waits for the loop's next pass over I/O, and when
        a burst of requests arrives that pass comes only after every handler of the burst has
        run: 1,000 concurrent new streams reached the upstream together, ~300 ms after the
        first (``bench.sustain_probe``). Where the connect is still in progress the send
        would block: the loop waits until the socket is writable and the transport sends all
        of the request."""
        _, host, port = origin
        method, head, content = request
        loop = asyncio.get_running_loop()
        sock = _new_socket(family)
        conn: _Connection | None = None
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            error = sock.connect_ex((host, port))
            if error and error not in _CONNECTING:
                raise OSError(error, os.strerror(error))
            conn = _Connection(self, origin, self.read_timeout)
            conn.begin(method)  # the answer can be read once the loop has the socket
            try:  # Linux completes a connect to this host at once (though it says EINPROGRESS)
                sent = sock.sendmsg([head, content] if content else [head], [], _NOSIGNAL)
            except OSError as exc:
                # Still connecting: Linux says EAGAIN, macOS ENOTCONN (even to this host). The
                # transport sends all of the request once the socket is connected.
                if not isinstance(exc, BlockingIOError | InterruptedError) and (
                    exc.errno != errno.ENOTCONN
                ):
                    raise
                await _writable(loop, sock)
                sent = 0
            conn._sent = sent
        except BaseException:
            sock.close()
            if conn is not None:
                conn._parser = None  # (a cycle, as in ``connection_lost``)
            raise
        # On failure or cancellation the loop closes the socket (uvloop since 0.23: earlier
        # versions closed the descriptor and left the socket object to close it again).
        try:
            await loop.create_connection(lambda: conn, sock=sock)
        except BaseException:
            conn._parser = None
            raise
        return conn

    def _release(self, conn: _Connection) -> None:
        if self._closed or self.idle_connections >= self.max_keepalive:
            conn.abort()
            return
        now = conn.idle_since = time.monotonic()
        idle = self._idle.setdefault(conn.origin, [])
        # The oldest idle ones past ``keepalive_expiry`` go (``_acquire`` takes the newest: the
        # others were left open, a burst's connections for as long as the upstream allowed)
        while idle and now - idle[0].idle_since >= self.keepalive_expiry:
            idle.pop(0).abort()
        idle.append(conn)
        self._wake_waiter()

    def _forget(self, conn: _Connection) -> None:
        """``conn`` is closed or closing: it no longer counts."""
        if conn in self._open:
            self._open.discard(conn)
            idle = self._idle.get(conn.origin)
            if idle and conn in idle:
                idle.remove(conn)
            self._wake_waiter()

    def _wake_waiter(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def aclose(self) -> None:
        """Close every connection (exchanges still running see their connection end)."""
        self._closed = True
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(httpx.ConnectError("the upstream pool is closed"))
        self._waiters.clear()
