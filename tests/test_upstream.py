"""The native upstream pool against raw-socket servers on 127.0.0.1: framing, reuse, timeouts,
cancellation, limits, TLS."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy import upstream
from proxy.upstream import UpstreamPool, UpstreamResponse, _Connection, ssl_context

DATA = Path(__file__).parent / "data"
CERT = DATA / "tls-test-cert.pem"
KEY = DATA / "tls-test-key.pem"

Handler = Callable[[int, int, bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


def answer(body: bytes, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n" % (status, len(body), extra) + body


class Server:
    """A raw HTTP/1.1 server. ``handler(conn_no, request_no_on_conn, request, reader, writer)``
    answers one request and says whether to keep reading the connection."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_at: list[float] = []
        self.server: asyncio.Server | None = None
        self.request_seen = asyncio.Event()
        self.connection_closed = asyncio.Event()

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn_no = self.connections
        n = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                body = b""
                lower = head.lower()
                if b"content-length:" in lower:
                    size = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
                    body = await reader.readexactly(size)
                elif b"transfer-encoding: chunked" in lower:
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                        data = await reader.readexactly(size + 2)
                        if size == 0:
                            break
                        body += data[:-2]
                n += 1
                self.requests.append(head + body)
                self.request_seen.set()
                if not await self.handler(conn_no, n, head + body, reader, writer):
                    return
        finally:
            self.closed_at.append(time.monotonic())
            self.connection_closed.set()
            writer.close()


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def answers_ok(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
    """A ``Server`` handler that answers every request ``ok`` on a kept-alive connection."""
    w.write(answer(b"ok"))
    return True


async def endless_upload() -> AsyncIterator[bytes]:
    """An upload that never ends, in 64 KiB pieces (for upstreams that stop reading it)."""
    while True:
        yield b"x" * 65536


async def read(response: UpstreamResponse) -> bytes:
    try:
        return await response.aread()
    finally:
        await response.aclose()


def test_keep_alive_reuses_one_connection_and_preserves_headers() -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(answer(b"answer %d" % n, extra=b"X-Dup: a\r\nx-dup: b\r\n"))
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            for i in (1, 2, 3):
                resp = await pool.open(
                    "POST", srv.url + "/v1/x?q=1", [(b"x-h", b"1"), (b"x-h", b"2")], b"{}"
                )
                assert resp.status_code == 200
                assert [v for k, v in resp.headers.raw if k.lower() == b"x-dup"] == [b"a", b"b"]
                assert await read(resp) == b"answer %d" % i
            assert srv.connections == 1
            first = srv.requests[0]
            port = srv.url.rsplit(":", 1)[1]
            assert first.startswith(
                b"POST /v1/x?q=1 HTTP/1.1\r\nhost: 127.0.0.1:%s\r\n" % port.encode()
            )
            assert b"x-h: 1\r\nx-h: 2\r\n" in first and first.endswith(
                b"content-length: 2\r\n\r\n{}"
            )
            assert b"user-agent" not in first.lower()  # the pool adds nothing of its own
            assert pool.in_use == 0 and pool.idle_connections == 1
            await pool.aclose()

    run(main())


@contextlib.contextmanager
def blackhole() -> Any:
    """A loopback port that takes no connection and refuses none: its listen queue full, the
    kernel drops each new SYN (an address a broken route leads to). Yields its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fill = [socket.socket() for _ in range(3)]
    try:
        for sock in fill:
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
        time.sleep(0.1)
        yield port
    finally:
        for sock in fill:
            sock.close()
        listener.close()


def test_a_host_whose_first_address_drops_packets_is_reached_at_its_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dual-stack provider behind a broken IPv6 route: the event loop's connect tried its
    addresses one after another, each until it failed, so the first one spent the whole connect
    timeout and every request was a 504, where the SDKs (anyio's Happy Eyeballs) connect at
    once. The next address is tried when the first has not connected within a quarter second;
    the first to connect is taken, the other attempt closed."""

    async def main() -> None:
        async with Server(answers_ok) as srv:
            good = int(srv.url.rsplit(":", 1)[1])
            with blackhole() as dropped:

                async def resolve(loop: Any, host: str, port: int) -> list[Any]:
                    assert (host, port) == ("dual.test", 8000)
                    tcp = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
                    return [(*tcp, ("127.0.0.1", dropped)), (*tcp, ("127.0.0.1", good))]

                monkeypatch.setattr(upstream, "_resolve", resolve)
                pool = UpstreamPool(connect_timeout=3.0)
                try:
                    resp = await pool.open("GET", "http://dual.test:8000/v1/models", [], b"")
                    assert resp.status_code == 200 and await read(resp) == b"ok"
                    assert srv.requests[0].startswith(
                        b"GET /v1/models HTTP/1.1\r\nhost: dual.test:8000"
                    )
                finally:
                    await pool.aclose()

    run(main())


def test_interleaved_addresses_alternate_families_first_one_first() -> None:
    v6 = [(socket.AF_INET6, socket.SOCK_STREAM, 6, (f"::{i}", 443, 0, 0)) for i in (1, 2, 3)]
    v4 = [(socket.AF_INET, socket.SOCK_STREAM, 6, (f"10.0.0.{i}", 443)) for i in (1, 2)]
    mixed = [v6[0], v6[1], v4[0], v6[2], v4[1]]
    assert upstream._interleaved(mixed) == [v6[0], v4[0], v6[1], v4[1], v6[2]]
    assert upstream._interleaved(v4) == v4


@pytest.mark.parametrize(
    ("raw", "body", "reused"),
    [
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
            b"abcde",
            True,
        ),
        (b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end", b"until the end", False),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 3\r\n\r\nold", b"old", False),
        (
            b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + answer(b"after hints"),
            b"after hints",
            True,
        ),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b"", True),
        # bare LF line ends, as h11 and httpx read them
        (b"HTTP/1.1 200 OK\ncontent-length: 3\n\nabc", b"abc", True),
        # chunks beside a length: the chunks win, and the connection is not reused after
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\n\r\n"
            b"3\r\nabc\r\n0\r\n\r\n",
            b"abc",
            False,
        ),
        # blanks after a chunk's size: before an extension (RFC 9112's BWS) and at the line's
        # end (as h11 takes them); llhttp refuses both unless told
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            b"3 ;name=value\r\nabc\r\n2\t\r\nde\r\n0\r\n\r\n",
            b"abcde",
            True,
        ),
        # empty items before the last, which the parser skips (RFC 9110, 5.6.1): chunked
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: identity, , chunked\r\n\r\n"
            b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
            b"abcde",
            True,
        ),
        # a transfer coding whose last is not chunked: the body ends with the connection, a
        # length said beside it or not (it failed as cut mid-response)
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: identity\r\n\r\nto the end", b"to the end", False),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, identity\r\ncontent-length: 3\r\n\r\n"
            b"to the end",
            b"to the end",
            False,
        ),
    ],
)
def test_response_framings(raw: bytes, body: bytes, reused: bool) -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(raw)
        await w.drain()
        return not any(s in raw for s in (b"connection: close", b"HTTP/1.0", b"identity\r\n"))

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            for _ in range(2):
                resp = await pool.open("GET", srv.url + "/", [], b"")
                assert await read(resp) == body
            assert srv.connections == (1 if reused else 2)
            await pool.aclose()

    run(main())


@pytest.mark.parametrize(
    "connection", [b"connection: keep-alive, close", b"connection: keep-alive\r\nConnection: Close"]
)
def test_an_answer_that_says_close_is_the_connections_last_whatever_else_it_says(
    connection: bytes,
) -> None:
    """An HTTP/1.0 answer whose Connection says ``keep-alive`` and ``close`` (one header or
    two) was taken as kept alive (llhttp reads only the former there): the next request went
    on a connection the server was closing, a 502 where it closed a moment later."""

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.0 200 OK\r\n" + connection + b"\r\ncontent-length: 3\r\n\r\nold")
        await w.drain()
        return True  # (it lingers: the close it said comes later)

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            for _ in range(2):
                resp = await pool.open("GET", srv.url + "/", [], b"")
                assert await read(resp) == b"old"
            assert srv.connections == 2
            await pool.aclose()

    run(main())


def test_head_has_no_body_even_with_a_length() -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool(read_timeout=2)
            resp = await pool.open("HEAD", srv.url + "/", [], b"")
            assert resp.headers["content-length"] == "1000"
            assert await asyncio.wait_for(read(resp), 1) == b""
            await pool.aclose()

    run(main())


def test_large_body_with_a_slow_reader_arrives_whole() -> None:
    payload = bytes(range(256)) * 16384  # 4 MiB: the socket is paused and resumed on the way

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(answer(payload))
        await w.drain()
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            resp = await pool.open("GET", srv.url + "/", [], b"")
            parts = []
            async for chunk in resp.stream:
                parts.append(chunk)
                if len(parts) % 8 == 0:
                    await asyncio.sleep(0.001)
            await resp.aclose()
            assert b"".join(parts) == payload
            assert pool.idle_connections == 1  # read to the end: kept
            await pool.aclose()

    run(main())


def test_a_reader_that_fell_behind_gets_the_buffered_chunks_in_one_piece() -> None:
    events = [b"data: %d\n\n" % i for i in range(6)]
    framed = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(framed[: framed.index(b"\r\n", 8) + 2])  # the first event alone
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(framed[framed.index(b"\r\n", 8) + 2 :])  # the rest, while the reader is busy
        await w.drain()
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            resp = await pool.open("GET", srv.url + "/", [], b"")
            parts = []
            async for chunk in resp.stream:
                parts.append(chunk)
                await asyncio.sleep(0.2)  # behind: the other five events arrive meanwhile
            await resp.aclose()
            assert parts == [events[0], b"".join(events[1:])]
            await pool.aclose()

    run(main())


def test_streamed_request_body_is_sent_chunked() -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(answer(req.split(b"\r\n\r\n", 1)[1]))
        return True

    async def gen() -> AsyncIterator[bytes]:
        for i in range(5):
            yield b"part%d;" % i
            await asyncio.sleep(0)

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            resp = await pool.open("POST", srv.url + "/upload", [], gen())
            assert await read(resp) == b"part0;part1;part2;part3;part4;"
            assert b"transfer-encoding: chunked" in srv.requests[0]
            await pool.aclose()

    run(main())


@pytest.mark.parametrize(
    ("idle_s", "taken_s", "resent"),
    [
        # idle long enough to have met the server's keep-alive timeout, closed at once: the
        # server had given up on this connection; the request goes again on a new one
        (0.15, 0.0, True),
        # reused right after its last answer: no keep-alive timeout met, and a close with no
        # answer, however soon, may follow a request the server took (a fast completion,
        # billed, then a crash): not sent twice
        (0.0, 0.0, False),
        # closed well after taking the request (a crash mid-generation): it may have been
        # applied, and billed; it used to be re-sent on a new connection, unseen
        (0.15, 0.3, False),
    ],
)
def test_a_reused_connection_closed_unanswered_is_retried_only_in_the_keep_alive_race(
    idle_s: float, taken_s: float, resent: bool
) -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        if n == 2:  # the second request on this connection: closed, unanswered
            await asyncio.sleep(taken_s)
            return False
        w.write(answer(b"ok from connection %d" % c))
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            pool.resend_window = pool.resend_idle = 0.1
            assert await read(await pool.open("POST", srv.url + "/", [], b"{}")) == (
                b"ok from connection 1"
            )
            await asyncio.sleep(idle_s)
            if resent:
                assert await read(await pool.open("POST", srv.url + "/", [], b"{}")) == (
                    b"ok from connection 2"
                )
                assert len(srv.requests) == 3
            else:
                with pytest.raises(httpx.RemoteProtocolError):
                    await pool.open("POST", srv.url + "/", [], b"{}")
                assert len(srv.requests) == 2  # the second request once
            await pool.aclose()

    run(main())


def test_idle_connections_past_their_expiry_are_closed_not_only_the_one_taken() -> None:
    """A burst leaves several idle connections; the requests after it take the newest, and
    only the one taken was looked at for its expiry: the others stayed open for as long as the
    upstream allowed (Go's default: for ever), up to ``max_keepalive_connections``."""

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.05)  # the burst's requests overlap: one connection each
        w.write(answer(b"ok"))
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            pool.keepalive_expiry = 0.3
            burst = [pool.open("POST", srv.url + "/", [], b"{}") for _ in range(5)]
            for response in await asyncio.gather(*burst):
                await read(response)
            assert pool.idle_connections == 5
            for _ in range(4):  # one request at a time, past the others' expiry
                await asyncio.sleep(0.15)
                await read(await pool.open("POST", srv.url + "/", [], b"{}"))
            assert pool.idle_connections == 1
            for _ in range(100):  # (the upstream sees them closed)
                if len(srv.closed_at) == 4:
                    break
                await asyncio.sleep(0.01)
            assert len(srv.closed_at) == 4
            await pool.aclose()

    run(main())


def test_the_resend_after_a_stale_connection_goes_on_a_new_one_not_another_idle_one() -> None:
    """A burst (sub-agents) leaves several idle connections, whose keep-alive ends together:
    the resend took the next idle one, as stale, and the client got a 502."""

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        if n == 2:  # every connection's second request: closed, unanswered (keep-alive over)
            return False
        await asyncio.sleep(0.05)  # the burst's requests overlap: one connection each
        w.write(answer(b"ok from connection %d" % c))
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            pool.resend_window = pool.resend_idle = 0.1
            burst = [pool.open("POST", srv.url + "/", [], b"{}") for _ in range(3)]
            for response in await asyncio.gather(*burst):
                await read(response)
            assert pool.idle_connections == 3
            await asyncio.sleep(0.15)
            assert await read(await pool.open("POST", srv.url + "/", [], b"{}")) == (
                b"ok from connection 4"
            )
            assert srv.connections == 4
            await pool.aclose()

    run(main())


@pytest.mark.parametrize(
    ("status", "close_after_s"),
    [
        # closes as it answers, without "connection: close": its end waits on the socket
        # when the next request comes (every second request was a 502)
        (b"200 OK", 0.0),
        (b"404 Not Found", 0.0),
        # closes a moment after its 500, when the next request may already be on its way
        (b"500 Internal Server Error", 0.02),
    ],
)
def test_a_connection_the_server_closes_after_answering_is_not_reused(
    status: bytes, close_after_s: float
) -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(answer(b"from connection %d" % c, status))
        await w.drain()
        await asyncio.sleep(close_after_s)
        return False

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            for i in range(1, 21):  # back to back, as an agent's next request follows
                response = await pool.open("POST", srv.url + "/", [], b"{}")
                assert await read(response) == b"from connection %d" % i
            assert len(srv.requests) == 20  # none lost on a closing connection, none resent
            await pool.aclose()

    run(main())


def test_a_request_waiting_for_a_full_pool_is_not_handed_a_connection_the_server_closed() -> None:
    """With every slot in use, a waiting request took the next idle connection unchecked: one
    the server had closed as it answered made it a 502 (13-18% of requests with two slots)."""

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.02)  # the others queue for the slot meanwhile
        w.write(answer(b"from connection %d" % c))
        return False  # closed as it answered, without "connection: close"

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool(max_connections=1)

            async def one() -> bytes:
                return await read(await pool.open("POST", srv.url + "/", [], b"{}"))

            answers = await asyncio.gather(*(one() for _ in range(6)))
            assert sorted(answers) == sorted(b"from connection %d" % i for i in range(1, 7))
            assert len(srv.requests) == 6
            await pool.aclose()

    run(main())


def test_a_new_connection_closed_before_answering_is_not_retried() -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        return False

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            with pytest.raises(httpx.RemoteProtocolError):
                await pool.open("POST", srv.url + "/", [], b"{}")
            assert len(srv.requests) == 1
            assert pool.open_connections == 0
            await pool.aclose()

    run(main())


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 abc OK\r\ncontent-length: 2\r\n\r\n{}",
        b"NOT HTTP AT ALL\r\n\r\n",
        # a coding the parser does not take off: relayed, the client got gzip bytes unmarked
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        # a list the parser does not read as chunked: it relayed the chunks' framing as the body
        # and waited for the connection's end
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked,\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\t\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    ],
    ids=["bad-status", "not-http", "gzip-transfer-coding", "chunked-comma", "chunked-tab"],
)
def test_a_malformed_answer_is_a_protocol_error(raw: bytes) -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(raw)
        await w.drain()
        await asyncio.sleep(0.5)
        return False

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            with pytest.raises(httpx.RemoteProtocolError):
                await pool.open("GET", srv.url + "/", [], b"")
            await pool.aclose()

    run(main())


def test_death_mid_body_raises_from_the_stream() -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await w.drain()
        return False

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            resp = await pool.open("GET", srv.url + "/", [], b"")
            got = b""
            with pytest.raises(httpx.ReadError):
                async for chunk in resp.stream:
                    got += chunk
            assert got == b"only this"
            await resp.aclose()
            assert pool.open_connections == 0
            await pool.aclose()

    run(main())


def test_read_timeouts_before_the_head_and_between_chunks_close_the_connection() -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        if b"/slow-body" in req:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nstart")
        await r.read()  # say nothing more until the client gives up
        return False

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool(read_timeout=0.3)
            t0 = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                await pool.open("GET", srv.url + "/silent", [], b"")
            assert 0.25 < time.monotonic() - t0 < 2
            resp = await pool.open("GET", srv.url + "/slow-body", [], b"")
            with pytest.raises(httpx.ReadTimeout):
                async for _ in resp.stream:
                    pass
            await resp.aclose()
            await asyncio.sleep(0.1)
            assert len(srv.closed_at) == 2  # the server saw both connections closed
            assert pool.open_connections == 0
            await pool.aclose()

    run(main())


def test_cancelling_a_waiting_request_closes_its_connection_at_once() -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        await r.read()
        return False

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            task = asyncio.create_task(pool.open("POST", srv.url + "/", [], b"{}"))
            await asyncio.wait_for(srv.request_seen.wait(), 2)
            cancelled = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(srv.connection_closed.wait(), 2)
            assert srv.closed_at[0] - cancelled < 0.2
            assert pool.open_connections == 0
            await pool.aclose()

    run(main())


def test_a_body_left_unread_closes_the_connection_instead_of_reusing_it() -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await w.drain()
        await r.read()
        return False

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            resp = await pool.open("GET", srv.url + "/", [], b"")
            assert await resp.stream.__anext__() == b"first"
            await resp.aclose()
            await asyncio.wait_for(srv.connection_closed.wait(), 2)
            assert pool.open_connections == 0
            await pool.aclose()

    run(main())


def test_the_connection_limit_queues_requests_and_times_out() -> None:
    async def main() -> None:
        async with Server(answers_ok) as srv:
            pool = UpstreamPool(max_connections=1, pool_timeout=0.2)
            held = await pool.open("GET", srv.url + "/", [], b"")
            with pytest.raises(httpx.PoolTimeout, match=r"all 1 upstream connections"):
                await pool.open("GET", srv.url + "/", [], b"")
            waiting = asyncio.create_task(pool.open("GET", srv.url + "/", [], b""))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            assert await read(held) == b"ok"
            assert await read(await asyncio.wait_for(waiting, 1)) == b"ok"
            assert srv.connections == 1
            await pool.aclose()

    run(main())


def test_a_request_woken_without_a_slot_waits_no_longer_than_the_pool_timeout_in_all() -> None:
    """A waiter woken for a slot that another request took first waits again: it started a
    full ``pool_timeout`` anew each time (3.6 s for a 2 s ``upstream.timeout_s``, a reviewer's
    run), where the README promises the 503 after ``upstream.timeout_s``."""

    async def main() -> None:
        async with Server(answers_ok) as srv:
            pool = UpstreamPool(max_connections=1, pool_timeout=1.0)
            held = await pool.open("GET", srv.url + "/", [], b"")
            t0 = time.monotonic()
            waiting = asyncio.create_task(pool.open("GET", srv.url + "/", [], b""))
            await asyncio.sleep(0.6)
            pool._wake_waiter()  # woken, but the slot is still taken: as if another took it
            with pytest.raises(httpx.PoolTimeout):
                await asyncio.wait_for(waiting, 3)
            waited = time.monotonic() - t0
            assert 0.9 < waited < 1.4  # not 1.6: one pool_timeout in all
            assert await read(held) == b"ok"
            await pool.aclose()

    run(main())


def test_a_request_woken_for_a_slot_another_took_stays_first_in_line() -> None:
    """Woken, it went to the back of the queue: with one wait in all, the earliest request was
    the likeliest to get the 503."""

    async def main() -> None:
        async with Server(answers_ok) as srv:
            pool = UpstreamPool(max_connections=1, pool_timeout=5.0)
            held = await pool.open("GET", srv.url + "/", [], b"")
            first = asyncio.create_task(pool.open("GET", srv.url + "/", [], b""))
            await asyncio.sleep(0.05)
            second = asyncio.create_task(pool.open("GET", srv.url + "/", [], b""))
            await asyncio.sleep(0.05)
            pool._wake_waiter()  # the first is woken, but the slot is still taken
            await asyncio.sleep(0.05)
            assert await read(held) == b"ok"  # now free: the first in line has it
            got = await asyncio.wait_for(first, 2)
            assert not second.done()
            assert await read(got) == b"ok"
            assert await read(await asyncio.wait_for(second, 2)) == b"ok"
            await pool.aclose()

    run(main())


def test_unreachable_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        pool = UpstreamPool()
        with pytest.raises(httpx.ConnectError):
            await pool.open("GET", f"http://127.0.0.1:{port}/", [], b"")
        with pytest.raises(httpx.UnsupportedProtocol):
            await pool.open("GET", "ftp://127.0.0.1/", [], b"")
        assert pool.open_connections == 0
        await pool.aclose()

    run(main())


def test_tls_upstream_is_verified() -> None:
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(CERT, KEY)

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(answer(b"over tls"))
        return True

    async def main() -> None:
        async with Server(handler, tls=server_tls) as srv:
            trusted = UpstreamPool(ssl_context=ssl.create_default_context(cafile=str(CERT)))
            resp = await trusted.open("GET", srv.url + "/", [], b"")
            assert await read(resp) == b"over tls"
            await trusted.aclose()
            untrusted = UpstreamPool(ssl_context=ssl.create_default_context())
            with pytest.raises(httpx.ConnectError):
                await untrusted.open("GET", srv.url + "/", [], b"")
            await untrusted.aclose()

    run(main())


def test_an_https_url_to_a_plain_http_server_says_to_use_http() -> None:
    """A local vLLM, Ollama or the simulator given as ``https://``: the 502 said only
    OpenSSL's ``[SSL: WRONG_VERSION_NUMBER] wrong version number``."""

    async def plain_http(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read(1024)  # (a ClientHello, which an HTTP server refuses as it refuses junk)
        w.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await w.drain()
        w.close()

    async def main() -> None:
        server = await asyncio.start_server(plain_http, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool(ssl_context=ssl.create_default_context())
        with pytest.raises(httpx.ConnectError) as caught:
            await pool.open("GET", f"https://127.0.0.1:{port}/", [], b"")
        await pool.aclose()
        server.close()
        await server.wait_closed()
        said = str(caught.value)
        assert "WRONG_VERSION_NUMBER" in said
        assert said.endswith(f"the upstream speaks plain HTTP on port {port}, use http:// for it")

    run(main())


def test_ssl_cert_file_selects_the_trusted_bundle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(CERT))
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    names = [c.get("subject") for c in ssl_context().get_ca_certs()]
    assert names == [((("commonName", "cachegate test upstream"),),)]
    monkeypatch.delenv("SSL_CERT_FILE")
    assert len(ssl_context().get_ca_certs()) > 50  # certifi's bundle, as httpx uses


def test_the_httpx_transport_trusts_ssl_cert_file_as_the_native_pool_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``upstream.transport = "httpx"`` a private CA in ``SSL_CERT_FILE`` was ignored
    (502 ``certificate verify failed``), though the README promises it for both transports."""
    from proxy.app import build_transport
    from proxy.config import settings_from_mapping

    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(CERT, KEY)

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(answer(b"over tls"))
        return True

    async def fetch(url: str) -> bytes:
        transport = build_transport(
            settings_from_mapping({"upstream": {"transport": "httpx"}}), None
        )
        assert isinstance(transport, httpx.AsyncHTTPTransport)
        async with httpx.AsyncClient(transport=transport) as client:
            return (await client.get(url)).content

    async def main() -> None:
        async with Server(handler, tls=server_tls) as srv:
            monkeypatch.setenv("SSL_CERT_FILE", str(CERT))
            monkeypatch.delenv("SSL_CERT_DIR", raising=False)
            assert await fetch(srv.url + "/") == b"over tls"
            monkeypatch.delenv("SSL_CERT_FILE")
            with pytest.raises(httpx.ConnectError):  # still verified: certifi's bundle alone
                await fetch(srv.url + "/")

    run(main())  # (the default upstream, https://api.openai.com/v1, is https)
    # A stale SSL_CERT_FILE does not stop a plain-HTTP upstream's transport (nor its server)
    monkeypatch.setenv("SSL_CERT_FILE", "/nonexistent/ca.pem")
    plain = {"upstream": {"transport": "httpx", "base_url": "http://127.0.0.1:9/v1"}}
    assert isinstance(build_transport(settings_from_mapping(plain), None), httpx.AsyncHTTPTransport)


def test_an_answer_before_the_whole_upload_retires_the_connection() -> None:
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")  # a head; answer at once, body unread
                writer.write(answer(b"too large", b"413 Payload Too Large"))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def slow_upload() -> AsyncIterator[bytes]:
        for _ in range(50):
            yield b"x" * 1000
            await asyncio.sleep(0.01)

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        pool = UpstreamPool()
        resp = await pool.open("POST", url + "files", [], slow_upload())
        assert resp.status_code == 413
        assert await read(resp) == b"too large"
        assert pool.idle_connections == 0  # half an upload is on that connection: not reused
        resp = await pool.open("GET", url + "models", [], b"")
        assert await read(resp) == b"too large"
        assert connections == 2
        await pool.aclose()
        server.close()

    run(main())


def test_a_slot_handed_to_a_request_that_leaves_passes_to_the_next() -> None:
    async def main() -> None:
        async with Server(answers_ok) as srv:
            pool = UpstreamPool(max_connections=1, pool_timeout=3)
            held = await pool.open("GET", srv.url + "/", [], b"")
            first = asyncio.create_task(pool.open("GET", srv.url + "/", [], b""))
            second = asyncio.create_task(pool.open("GET", srv.url + "/", [], b""))
            await asyncio.sleep(0.05)  # both wait for the one connection
            assert await read(held) == b"ok"  # released: the first waiter is woken...
            first.cancel()  # ...and its client leaves in the same turn of the loop
            t0 = time.monotonic()
            assert await read(await asyncio.wait_for(second, 2)) == b"ok"
            assert time.monotonic() - t0 < 1  # not after pool_timeout
            assert first.cancelled()
            await pool.aclose()

    run(main())


def test_an_upload_that_ends_after_an_early_answer_still_ends_its_request() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                writer.write(answer(b"no", b"401 Unauthorized"))  # before reading the body
                if b"chunked" in head:
                    while True:
                        line = await reader.readuntil(b"\r\n")
                        try:
                            size = int(line.strip(), 16)
                        except ValueError:  # the next request read as a chunk: refuse it
                            writer.write(answer(b"bad chunk", b"400 Bad Request"))
                            await writer.drain()
                            return
                        await reader.readexactly(size + 2)
                        if size == 0:
                            break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        pool = UpstreamPool(read_timeout=2)

        async def upload() -> AsyncIterator[bytes]:
            yield b"part"
            await asyncio.sleep(0.1)  # the answer arrives meanwhile; then the body just ends

        resp = await pool.open("POST", url + "files", [], upload())
        assert await read(resp) == b"no"
        resp = await pool.open("GET", url + "models", [], b"")
        assert resp.status_code == 401  # the server read a well-formed next request
        await read(resp)
        await pool.aclose()
        server.close()

    run(main())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sized", [False, True])
def test_an_upload_accepted_before_its_end_is_sent_whole(sized: bool) -> None:
    """A server may answer 2xx before it has read the body, and read on (RFC 9112): the rest of
    the upload still goes, as httpx and curl send it. Stopping at the answer left the server
    waiting for the body and the client for the rest of the answer until the read timeout."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        writer.write(b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{"\r\n')
        await writer.drain()
        received = 0
        try:
            if b"chunked" in head:
                while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                    received += len(await reader.readexactly(size + 2)) - 2
                await reader.readexactly(2)
            else:
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                received = len(await reader.readexactly(length))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        tail = b'received":%d}' % received
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
        await writer.drain()
        writer.close()

    async def upload() -> AsyncIterator[bytes]:
        for _ in range(40):  # 2.6 MB, more than the socket buffers take at once
            yield b"x" * 65536
            await asyncio.sleep(0.005)

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        pool = UpstreamPool(read_timeout=3)
        body = upstream.SizedStream(upload(), 40 * 65536) if sized else upload()
        t0 = time.monotonic()
        resp = await pool.open("POST", url + "files", [], body)
        assert resp.status_code == 200
        assert await read(resp) == b'{"received":%d}' % (40 * 65536)
        assert time.monotonic() - t0 < 2.5  # (not cut by the read timeout)
        await pool.aclose()
        server.close()

    run(main())


@pytest.mark.timeout(60)
def test_an_upload_accepted_while_it_waits_for_room_goes_at_the_servers_pace() -> None:
    """The usual timing of an early answer to a large upload: the socket is full, the upload
    waits for room, and the server answers 200 before reading on. The answer must not count as
    room: the rest of the upload went into memory as fast as the client gave it (a 400 MB
    upload, ~440 MB of RSS) and the answer then timed out while the server still read it."""
    total = 48 * 2**20
    yielded = 0
    ahead: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(0.3)  # the buffers fill up: the upload waits for room
        writer.write(b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{"\r\n')
        await writer.drain()
        received = 0
        while received < total:  # ~40 MB/s
            received += len(await reader.readexactly(min(1 << 20, total - received)))
            ahead.append(yielded - received)
            await asyncio.sleep(0.025)
        tail = b'received":%d}' % received
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(tail), tail))
        await writer.drain()
        writer.close()

    async def upload() -> AsyncIterator[bytes]:
        nonlocal yielded
        for _ in range(total // 65536):
            yielded += 65536
            yield b"x" * 65536

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        pool = UpstreamPool(read_timeout=3)
        resp = await pool.open("POST", url + "files", [], upstream.SizedStream(upload(), total))
        assert await read(resp) == b'{"received":%d}' % total
        await pool.aclose()
        server.close()

    run(main())
    # what was taken from the client and not yet read by the server: the socket buffers and
    # the transport's (a few MB), not the whole upload
    assert max(ahead) < 16 * 2**20, max(ahead)


@pytest.mark.timeout(30)
def test_an_answer_while_the_upload_waits_for_room_ends_the_wait() -> None:
    """An upstream that answers (413) and then leaves the connection open, reading nothing
    more: the answer comes back at once, not after the read timeout's wait for room."""
    release = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(0.3)  # the socket buffers fill up meanwhile
        writer.write(answer(b"too large", b"413 Payload Too Large"))
        await writer.drain()
        await release.wait()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        pool = UpstreamPool(read_timeout=8)
        t0 = time.monotonic()
        resp = await pool.open("POST", url, [], endless_upload())
        assert resp.status_code == 413
        assert await read(resp) == b"too large"
        assert time.monotonic() - t0 < 4
        assert pool.idle_connections == 0  # half an upload is on it: not reused
        release.set()
        await pool.aclose()
        server.close()

    run(main())


def test_a_bytearray_body_is_sent_with_its_length() -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(answer(req.split(b"\r\n\r\n", 1)[1]))
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            for body in (bytearray(b'{"a":1}'), memoryview(b'{"a":1}')):
                resp = await pool.open("POST", srv.url + "/", [], body)  # type: ignore[arg-type]
                assert await read(resp) == b'{"a":1}'
            assert b"content-length: 7" in srv.requests[0]
            await pool.aclose()

    run(main())


def test_an_upload_that_fails_leaves_no_unretrieved_error(caplog: pytest.LogCaptureFixture) -> None:
    import gc

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        return False

    async def failing() -> AsyncIterator[bytes]:
        yield b"x" * 10
        raise ValueError("client disconnected")

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            with pytest.raises(ValueError):
                await pool.open("POST", srv.url + "/", [], failing())
            await asyncio.sleep(0.05)
            gc.collect()
            await asyncio.sleep(0.05)
            await pool.aclose()

    run(main())
    assert "never retrieved" not in caplog.text


@pytest.mark.timeout(20)
def test_an_upstream_that_stops_reading_an_upload_times_out() -> None:
    stop = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await stop.wait()  # reads nothing more: the socket buffers fill up
        writer.close()
        await writer.wait_closed()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        pool = UpstreamPool(read_timeout=0.5)
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            await pool.open("POST", url, [], endless_upload())
        assert time.monotonic() - t0 < 3
        assert pool.open_connections == 0
        await pool.aclose()
        stop.set()
        await asyncio.sleep(0.05)
        server.close()
        await server.wait_closed()

    run(main())


def test_a_connection_that_answered_twice_is_not_reused() -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(answer(b"first") + answer(b"unsolicited"))  # one request, two answers
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            assert await read(await pool.open("GET", srv.url + "/", [], b"")) == b"first"
            assert await read(await pool.open("GET", srv.url + "/", [], b"")) == b"first"
            assert srv.connections == 2  # the confused connection was closed, not reused
            await pool.aclose()

    run(main())


# --- pipe: chunks handed to a sink from the connection's callback ------------------------------


def _chunked(events: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


async def _nothing_to_drain() -> None:
    """For sinks that never report full."""


def test_pipe_hands_every_chunk_to_the_sink_in_order_and_keeps_the_connection() -> None:
    events = [b"data: %d\n\n" % i for i in range(5)]
    pieces = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        w.write(pieces[0] + pieces[1])  # two events before the pipe is set up
        await w.drain()
        await asyncio.sleep(0.1)
        for piece in pieces[2:]:
            w.write(piece)
            await w.drain()
            await asyncio.sleep(0.05)
        w.write(b"0\r\n\r\n")
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            resp = await pool.open("GET", srv.url + "/", [], b"")
            await asyncio.sleep(0.05)  # the first two events are buffered by now
            got: list[tuple[bytes, bool]] = []

            def sink(chunk: bytes) -> bool:
                got.append((chunk, asyncio.current_task() is None))
                return True

            async def drain() -> None:
                raise AssertionError("never full")

            await resp.pipe(sink, drain)
            await resp.aclose()
            assert [c for c, _ in got] == [events[0] + events[1], *events[2:]]
            # All but the buffered piece came straight from the protocol callback, no task.
            assert all(outside for _, outside in got[1:])
            assert pool.idle_connections == 1
            await pool.aclose()

    run(main())


def test_pipe_pauses_reading_while_the_sink_is_full() -> None:
    payload = b"x" * 65536
    total = 512  # 32 MiB: more than loopback's buffers take (~4 MiB, whatever tcp_rmem allows)

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (len(payload) * total))
        for _ in range(total):
            w.write(payload)
            await w.drain()
            srv.written += len(payload)
        return True

    async def main() -> None:
        nonlocal srv
        async with Server(handler) as s:
            srv = s
            srv.written = 0  # type: ignore[attr-defined]
            pool = UpstreamPool()
            resp = await pool.open("GET", s.url + "/", [], b"")
            received = 0
            released = asyncio.Event()

            def sink(chunk: bytes) -> bool:
                nonlocal received
                received += len(chunk)
                return released.is_set()  # full until released

            async def drain() -> None:
                await released.wait()

            piping = asyncio.get_running_loop().create_task(resp.pipe(sink, drain))
            await asyncio.sleep(0.5)
            held = srv.written  # type: ignore[attr-defined]
            assert held < len(payload) * total // 2  # the upstream was made to wait
            released.set()
            await asyncio.wait_for(piping, 10)
            await resp.aclose()
            assert received == len(payload) * total
            await pool.aclose()

    srv: Any = None
    run(main())


def test_a_failing_sink_ends_the_pipe_with_its_error_and_retires_the_connection() -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(20):
            w.write(_chunked([b"data: %d\n\n" % i])[:-5])
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(b"0\r\n\r\n")
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            resp = await pool.open("GET", srv.url + "/", [], b"")
            seen = 0

            def sink(chunk: bytes) -> bool:
                nonlocal seen
                seen += 1
                if seen == 3:
                    raise RuntimeError("client went away")
                return True

            with pytest.raises(RuntimeError, match="client went away"):
                await resp.pipe(sink, _nothing_to_drain)
            await resp.aclose()
            assert seen == 3  # nothing more reached the failed sink
            await asyncio.sleep(0.1)
            assert pool.idle_connections == 0 and pool.open_connections == 0
            await pool.aclose()

    run(main())


def test_the_read_timeout_applies_while_piping() -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nstart")
        await r.read()
        return False

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool(read_timeout=0.3)
            resp = await pool.open("GET", srv.url + "/", [], b"")
            got: list[bytes] = []

            t0 = time.monotonic()
            with pytest.raises(httpx.ReadTimeout):
                await resp.pipe(lambda c: got.append(c) is None, _nothing_to_drain)
            assert 0.25 < time.monotonic() - t0 < 2
            assert b"".join(got) == b"start"
            await resp.aclose()
            await pool.aclose()

    run(main())


def test_a_sink_failing_on_the_last_piece_is_not_mistaken_for_success() -> None:
    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.1)
        w.write(_chunked([b"data: a\n\n", b"data: b\n\n"]))  # the rest and the end, at once
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            resp = await pool.open("GET", srv.url + "/", [], b"")
            pieces: list[bytes] = []

            def sink(chunk: bytes) -> bool:
                pieces.append(chunk)
                raise RuntimeError("client buffer refused it")

            with pytest.raises(RuntimeError, match="refused"):
                await resp.pipe(sink, _nothing_to_drain)
            assert pieces == [b"data: a\n\ndata: b\n\n"]  # one read, one call
            await resp.aclose()
            await pool.aclose()

    run(main())


def test_a_body_buffered_past_the_pause_mark_before_the_pipe_still_arrives_whole() -> None:
    """Reading pauses when more than the high-water mark is buffered and nobody reads; a pipe
    started after that must turn reading back on, or it would wait for the read timeout."""
    payload = bytes(range(256)) * 16384  # 4 MiB

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(answer(payload))
        await w.drain()
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool(read_timeout=3.0)
            resp = await pool.open("GET", srv.url + "/", [], b"")
            await asyncio.sleep(0.3)  # the buffer passes the mark; reading pauses
            got: list[bytes] = []

            await asyncio.wait_for(
                resp.pipe(lambda c: got.append(c) is None, _nothing_to_drain), 10
            )
            await resp.aclose()
            assert b"".join(got) == payload
            await pool.aclose()

    run(main())


# -- a new connection's first request ----------------------------------------------------------

LOOPS = ["asyncio", "uvloop"]  # the tests' loop, and the one cachegate serves on


def run_on(loop: str, coro: Awaitable[Any]) -> Any:
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)  # type: ignore[arg-type]
    return asyncio.run(coro)  # type: ignore[arg-type]


def _read_request(conn: socket.socket) -> bytes:
    """One request with a content-length, read with blocking calls (the test's loop stands)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    size = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < size:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(("address", "host"), [("127.0.0.1", "127.0.0.1"), ("::1", "[::1]")])
def test_a_new_connection_sends_its_request_before_the_loop_runs_again(
    loop: str, address: str, host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of requests on new connections must not wait for the loop's next pass over I/O
    (which comes after every handler of the burst has run) to reach the upstream."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.create_server((address, 0), family=family)
    port = listener.getsockname()[1]
    listener.settimeout(5)
    waited: list[int] = []  # connects the kernel had not completed within the call
    writable = getattr(upstream, "_writable", None)

    async def counted(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        waited.append(1)
        assert writable is not None
        await writable(loop, sock)

    monkeypatch.setattr(upstream, "_writable", counted, raising=False)

    async def main() -> None:
        pool = UpstreamPool()
        # A loaded machine can leave a loopback handshake to the kernel's softirq thread: then
        # the request rightly waits for the loop. That attempt proves nothing; try again.
        for _ in range(5):
            task = asyncio.get_running_loop().create_task(
                pool.open("POST", f"http://{host}:{port}/v1/x", [(b"x-a", b"1")], b'{"k": 1}')
            )
            await asyncio.sleep(0)  # the task's first step, and nothing else, has run
            if not waited:
                break
            waited.clear()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            listener.accept()[0].close()
        else:
            pytest.fail("no connect completed within the call in five attempts")
        conn, _ = listener.accept()  # blocking: the loop does not run while the server reads
        with conn:
            conn.settimeout(5)
            request = _read_request(conn)
            assert request.startswith(
                b"POST /v1/x HTTP/1.1\r\nhost: %s:%d\r\n" % (host.encode(), port)
            )
            assert b"\r\nx-a: 1\r\n" in request and request.endswith(b'\r\n\r\n{"k": 1}')
            conn.sendall(answer(b"ok"))
            resp = await task
            assert resp.status_code == 200 and await read(resp) == b"ok"
        assert pool.idle_connections == 1
        await pool.aclose()

    try:
        run_on(loop, main())
    finally:
        listener.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_new_connection_s_request_larger_than_the_socket_takes_arrives_whole(loop: str) -> None:
    payload = bytes(range(256)) * 32768  # 8 MiB: the first send takes part, the transport the rest

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(answer(b"%d" % req.count(payload)))
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            resp = await asyncio.wait_for(pool.open("POST", srv.url + "/up", [], payload), 30)
            assert await read(resp) == b"1"
            assert srv.requests[0].endswith(b"\r\n\r\n" + payload)
            await pool.aclose()

    run_on(loop, main())


def _full_accept_queue() -> tuple[socket.socket, int, socket.socket]:
    """A listener on 127.0.0.1 whose accept queue one connection fills: the kernel drops the
    SYN of the next connect and retries it ~1 s later. Returns the listener, its port and the
    filling connection (the caller closes both)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    return listener, port, socket.create_connection(("127.0.0.1", port))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connect_still_in_progress_waits_and_then_sends_the_whole_request(loop: str) -> None:
    """An upstream whose connect does not complete at once (here: a full accept queue, which
    drops the SYN until the kernel retries it, ~1 s) gets the request once connected."""
    listener, port, filler = _full_accept_queue()

    async def main() -> None:
        pool = UpstreamPool()
        task = asyncio.get_running_loop().create_task(
            pool.open("POST", f"http://127.0.0.1:{port}/late", [], b"whole")
        )
        await asyncio.sleep(0.3)
        assert not task.done()  # connecting
        got: list[bytes] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            data = await reader.read(65536)
            if not data:  # the filler
                writer.close()
                return
            got.append(data)
            writer.write(answer(b"done", extra=b"connection: close\r\n"))
            await writer.drain()
            writer.close()

        filler.close()
        server = await asyncio.start_server(serve, sock=listener)  # accepts the queue
        resp = await asyncio.wait_for(task, 10)
        assert await read(resp) == b"done"
        assert got[0].startswith(b"POST /late HTTP/1.1\r\n") and got[0].endswith(b"\r\n\r\nwhole")
        await pool.aclose()
        server.close()
        await server.wait_closed()

    run_on(loop, main())


class _DarwinSocket(socket.socket):
    """A socket whose non-blocking connect behaves as macOS's does, even to this host: it is
    never complete within the call, and a send before the socket is seen writable fails with
    ENOTCONN (where Linux says EAGAIN)."""

    connecting = True

    def connect(self, address: Any) -> None:
        error = self.connect_ex(address)
        if error:
            raise OSError(error, os.strerror(error))

    def connect_ex(self, address: Any) -> int:
        error = super().connect_ex(address)
        return errno.EINPROGRESS if error in (0, errno.EINPROGRESS) else error

    def sendmsg(self, *args: Any) -> int:
        if self.connecting:
            raise OSError(errno.ENOTCONN, "Socket is not connected")
        return super().sendmsg(*args)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_new_connection_on_macos_waits_for_its_connect_and_sends_the_request(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """macOS refuses a send on a socket still connecting (ENOTCONN): every new connection to an
    upstream given as an IP address (``http://127.0.0.1:8788/v1``) was a 502."""
    made: list[_DarwinSocket] = []

    def darwin_socket(family: int) -> socket.socket:
        made.append(_DarwinSocket(family, socket.SOCK_STREAM))
        return made[-1]

    monkeypatch.setattr(upstream, "_new_socket", darwin_socket)

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(answer(b"got " + req.rpartition(b"\r\n\r\n")[2]))
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool(max_keepalive=0)  # a new connection each time
            for body in (b'{"n": 1}', b"x" * 200_000):  # one write with the head, and not
                resp = await pool.open("POST", srv.url + "/v1/x", [], body)
                assert resp.status_code == 200 and await read(resp) == b"got " + body
            assert len(made) == 2 and srv.connections == 2
            await pool.aclose()

    run_on(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_without_sendmsg_or_poll_as_on_windows_requests_go_through_and_reuse_connections(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows has no ``sendmsg`` and no ``select.poll``: each new connection to an IP address
    failed (AttributeError, a 502), and each reuse of an idle one."""
    monkeypatch.setattr(upstream, "_SEND_WITH_CONNECT", False)
    monkeypatch.setattr(upstream, "_POLL", None)
    monkeypatch.setattr(upstream, "_new_socket", None)  # the path that sends with the connect

    async def handler(c: int, n: int, req: bytes, r: Any, w: asyncio.StreamWriter) -> bool:
        w.write(answer(b"%d.%d" % (c, n)))
        return True

    async def main() -> None:
        async with Server(handler) as srv:
            pool = UpstreamPool()
            got = [await read(await pool.open("POST", srv.url + "/", [], b"{}")) for _ in range(3)]
            assert got == [b"1.1", b"1.2", b"1.3"]  # one connection, reused
            await pool.aclose()

    run_on(loop, main())


@pytest.mark.parametrize("poll", [True, False], ids=["poll", "select"])
def test_an_idle_socket_is_readable_once_its_peer_closed(
    poll: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What keeps a connection the server closed from being reused, with ``select.poll`` and
    without it (Windows)."""
    if not poll:
        monkeypatch.setattr(upstream, "_POLL", None)
    mine, theirs = socket.socketpair()

    async def main() -> None:
        conn = _Connection(UpstreamPool(), ("http", "127.0.0.1", 1), 1.0)
        conn._fd = mine.fileno()
        assert not conn.readable()
        theirs.close()
        assert conn.readable()

    with mine, theirs:
        run(main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connect_that_never_completes_times_out_and_frees_its_slot(loop: str) -> None:
    listener, port, filler = _full_accept_queue()

    async def main() -> None:
        pool = UpstreamPool(connect_timeout=0.3)
        with pytest.raises(httpx.ConnectTimeout):
            await pool.open("POST", f"http://127.0.0.1:{port}/", [], b"x")
        assert pool.open_connections == 0
        await pool.aclose()

    try:
        run_on(loop, main())
    finally:
        filler.close()
        listener.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connect_refused_after_waiting_is_a_connect_error(loop: str) -> None:
    listener, port, filler = _full_accept_queue()

    async def main() -> None:
        pool = UpstreamPool()
        task = asyncio.get_running_loop().create_task(
            pool.open("POST", f"http://127.0.0.1:{port}/", [], b"x")
        )
        await asyncio.sleep(0.2)
        assert not task.done()  # connecting: the SYN was dropped
        listener.close()  # the kernel's retry of the SYN is refused
        with pytest.raises(httpx.ConnectError):
            await asyncio.wait_for(task, 10)
        assert pool.open_connections == 0
        await pool.aclose()

    try:
        run_on(loop, main())
    finally:
        filler.close()
        listener.close()


class _Recorder(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False


@pytest.mark.parametrize(
    ("sent", "expected"),
    [
        (5, [b"/x HTTP/1.1\r\n\r\n", b"body"]),  # the socket took part of the head
        (20, [b"body"]),  # the head, exactly
        (22, [b"dy"]),  # the head and part of the body
        (24, []),  # all of it
    ],
)
def test_only_what_the_first_send_left_is_written(sent: int, expected: list[bytes]) -> None:
    head = b"POST /x HTTP/1.1\r\n\r\n"
    assert len(head) == 20

    async def main() -> None:
        pool = UpstreamPool()
        conn = _Connection(pool, ("http", "127.0.0.1", 1), 5.0)
        conn.begin(b"POST")
        conn._sent = sent
        transport = _Recorder()
        conn.connection_made(transport)
        task = asyncio.get_running_loop().create_task(conn.exchange(b"POST", head, b"body"))
        await asyncio.sleep(0)
        assert transport.writes == expected
        conn.data_received(answer(b"ok"))
        resp = await task
        assert resp.status_code == 200 and await resp.aread() == b"ok"

    run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("sized", [False, True], ids=["chunked", "with-length"])
def test_a_refusal_before_the_upload_and_a_close_reach_the_caller(loop: str, sized: bool) -> None:
    """nginx and Cloudflare answer an upload they refuse (401, 413) at once and close without
    reading it. The answer is what the caller gets, every time: not an error from writing the
    rest of the upload to the closed socket (which the client's SDK takes for an unreachable
    upstream and answers by uploading it all again)."""
    size = 30 * 1024 * 1024

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                answer(b'{"error":"no key"}', b"401 Unauthorized", b"connection: close\r\n")
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()  # the upload is left unread in the socket

    async def upload() -> AsyncIterator[bytes]:
        piece = b"x" * (1024 * 1024)  # (more than the socket takes at once: writes wait)
        for _ in range(size // len(piece)):
            yield piece

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/files"
        pool = UpstreamPool(read_timeout=10)
        for _ in range(6):
            body = upstream.SizedStream(upload(), size) if sized else upload()
            resp = await pool.open("POST", url, [], body)
            assert resp.status_code == 401
            assert await read(resp) == b'{"error":"no key"}'
        assert pool.open_connections == 0
        await pool.aclose()
        server.close()

    run_on(loop, main())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop", LOOPS)
def test_an_answer_the_loop_had_not_read_when_a_write_failed_still_reaches_the_caller(
    loop: str,
) -> None:
    """The refusal and the reset arrive together; the next write of the upload fails on the reset
    and the transport closes before the loop has read the refusal. It is read from the socket
    then: the caller gets the 401, not 'closed before answering'. (Reading is paused here so the
    loop cannot read it first, as it cannot when both land between its polls.)"""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer(b'{"error":"no key"}', b"401 Unauthorized", b"connection: close\r\n"))
        await writer.drain()
        writer.transport.abort()  # unread upload in its buffer: the kernel resets

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/files"
        pool = UpstreamPool(read_timeout=10)

        async def upload() -> AsyncIterator[bytes]:
            (conn,) = pool._open
            assert conn.transport is not None
            conn.transport.pause_reading()  # the answer stays in the socket
            yield b"x" * 1000
            await asyncio.sleep(0.3)  # the refusal and the reset arrive
            for _ in range(100):
                yield b"x" * 65536
                await asyncio.sleep(0.01)

        resp = await pool.open("POST", url, [], upload())
        assert resp.status_code == 401
        assert await read(resp) == b'{"error":"no key"}'
        await pool.aclose()
        server.close()

    run_on(loop, main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", LOOPS)
def test_a_refused_body_sent_whole_logs_no_unretrieved_write_error(
    loop: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A large chat body is written whole (no one waits for room); the upstream refuses it and
    closes unread. The room the transport waited for failed with the close, and asyncio logged
    "Future exception was never retrieved" at ERROR level for an ordinary refusal."""
    import gc

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer(b"too large", b"413 Payload Too Large", b"connection: close\r\n"))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.transport.abort()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        pool = UpstreamPool(read_timeout=10)
        for _ in range(8):
            resp = await pool.open("POST", url, [], b"x" * (16 * 1024 * 1024))
            assert resp.status_code == 413
            await read(resp)
        await asyncio.sleep(0.1)
        gc.collect()
        await asyncio.sleep(0.1)
        await pool.aclose()
        server.close()

    with caplog.at_level(logging.ERROR):
        run_on(loop, main())
        gc.collect()
    assert "never retrieved" not in caplog.text


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(("think_s", "tls"), [(0.0, False), (0.45, False), (0.45, True)])
def test_an_upload_slower_than_the_read_timeout_that_keeps_moving_is_not_cut(
    loop: str, think_s: float, tls: bool
) -> None:
    """A 16 MB body held whole, read by the upstream at ~6 MB/s, then answered ``think_s``
    later: the upload takes longer than the read timeout, but bytes move all along. It was a
    ReadTimeout (a 504 to the client) because the timeout counted from the moment the body was
    queued; and an upload that ended between two looks left its answer only what remained of
    the period, not a whole one."""
    size = 16 * 1024 * 1024
    read_at: list[float] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        left = size
        while left:
            left -= len(await reader.read(min(left, 65536)))
            await asyncio.sleep(0.01)
        read_at.append(time.monotonic())
        await asyncio.sleep(think_s)  # (under the timeout: an answer due in time)
        writer.write(answer(b"read it all"))
        await writer.drain()
        writer.close()

    async def main() -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # (the kernel holds little)
        sock.bind(("127.0.0.1", 0))
        server_tls = None
        if tls:  # (the encrypted bytes wait below the TLS transport, where no count shows)
            server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            server_tls.load_cert_chain(CERT, KEY)
        server = await asyncio.start_server(serve, sock=sock, limit=65536, ssl=server_tls)
        scheme = "https" if tls else "http"
        url = f"{scheme}://127.0.0.1:{sock.getsockname()[1]}/"
        trusted = ssl.create_default_context(cafile=str(CERT)) if tls else None
        pool = UpstreamPool(read_timeout=0.6, ssl_context=trusted)
        t0 = time.monotonic()
        try:
            response = await pool.open("POST", url, [], b"x" * size)
            assert await read(response) == b"read it all"
        finally:
            await pool.aclose()
            server.close()
            await server.wait_closed()
        assert read_at[0] - t0 > 1.2  # (the upload did outlast the timeout, twice)

    run_on(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(
    ("size", "tls"), [(1000, False), (200_000, False), (4_000_000, False), (4_000_000, True)]
)
def test_a_silent_upstream_is_cut_after_the_read_timeout_whatever_the_request_s_size(
    loop: str, size: int, tls: bool
) -> None:
    """The upstream reads the whole request, then says nothing: cut after one read timeout.
    A look at the request's unsent bytes granted a second period to every request over 64 KiB
    (its upload long gone), a hung answer then waited twice ``upstream.timeout_s``."""

    async def main() -> float:
        read_all, done = asyncio.Event(), asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(size)
            read_all.set()
            await done.wait()  # says nothing
            writer.close()

        server_tls = None
        if tls:
            server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            server_tls.load_cert_chain(CERT, KEY)
        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_tls)
        scheme = "https" if tls else "http"
        url = f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        trusted = ssl.create_default_context(cafile=str(CERT)) if tls else None
        pool = UpstreamPool(read_timeout=1.0, ssl_context=trusted)
        task = asyncio.ensure_future(pool.open("POST", url, [], b"x" * size))
        await read_all.wait()
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            await task
        waited = time.monotonic() - t0
        await pool.aclose()
        done.set()
        server.close()
        await server.wait_closed()
        return waited

    assert run_on(loop, main()) < 1.5


def test_over_tls_an_upload_is_watched_until_the_answer_however_its_queue_looks() -> None:
    """Over TLS the count of unsent bytes is the socket's queue only: the encrypted rest waits
    in the TCP transport below, refilling the queue as it empties. A look that found the queue
    empty for a moment stopped the watch, and the rest of the upload ran unwatched (cut by the
    read timeout while it moved); a refill read as no progress."""

    class _TlsTransport(_Recorder):
        def get_extra_info(self, name: str, default: Any = None) -> Any:
            return object() if name == "sslcontext" else default

        def get_write_buffer_size(self) -> int:
            return 0

    async def main() -> None:
        pool = UpstreamPool(read_timeout=0.4)  # (looked at every 0.05 s)
        conn = _Connection(pool, ("https", "127.0.0.1", 1), 0.4)
        conn.connection_made(_TlsTransport())
        # the socket's queue as the looks find it: emptied, refilled, emptied... then done
        queue = iter([3_000_000, 0, 2_500_000, 2_000_000, 0, 1_500_000] * 4 + [0] * 1000)
        conn.unsent = lambda: next(queue)  # type: ignore[method-assign]
        task = asyncio.ensure_future(
            conn.exchange(b"POST", b"POST / HTTP/1.1\r\n\r\n", b"x" * 100_000)
        )
        await asyncio.sleep(1.2)  # the upload moved all along: longer than the read timeout
        assert not task.done()
        conn.data_received(answer(b"got it"))
        response = await task
        assert response.status_code == 200 and await response.aread() == b"got it"
        # once nothing moves, the silence is cut after the read timeout as ever
        silent = _Connection(pool, ("https", "127.0.0.1", 1), 0.4)
        silent.connection_made(_TlsTransport())
        silent.unsent = lambda: 0  # type: ignore[method-assign]
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            await silent.exchange(b"POST", b"POST / HTTP/1.1\r\n\r\n", b"x" * 100_000)
        assert time.monotonic() - t0 < 0.8
        await pool.aclose()

    run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_a_large_body_refused_before_it_was_read_does_not_hold_up_the_next_request(
    loop: str, chunked: bool
) -> None:
    """A server answers 413 to a 5 MB body without reading it and keeps the connection (no
    "connection: close"). The connection went back to the pool with the rest of the body
    still to come on it: the next request waited behind it for an answer that never came."""
    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                sized = re.search(rb"content-length: (\d+)", head.lower())
                length = int(sized.group(1)) if sized else -1
                if length > 1024 * 1024 or length < 0:  # (a chunked upload: all of it large)
                    writer.write(answer(b"too large", b"413 Payload Too Large"))
                    await writer.drain()
                    await asyncio.sleep(30)  # reads on, in its own time: never here
                    return
                await reader.readexactly(length)
                writer.write(answer(b"ok"))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        pool = UpstreamPool(read_timeout=5)

        async def upload() -> AsyncIterator[bytes]:
            for _ in range(4):  # (256 KiB: all of it sent before the refusal comes)
                yield b"x" * 65536

        body = upload() if chunked else b"x" * (5 * 1024 * 1024)
        resp = await pool.open("POST", url, [], body)
        assert resp.status_code == 413 and await read(resp) == b"too large"
        resp = await asyncio.wait_for(pool.open("POST", url, [], b"{}"), 4)
        assert resp.status_code == 200 and await read(resp) == b"ok"
        assert len(connections) == 2  # (a connection of its own)
        await pool.aclose()
        server.close()

    run_on(loop, main())
