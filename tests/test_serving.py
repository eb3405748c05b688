"""``proxy.serving``: the sockets ``cachegate serve`` binds before it starts, as uvicorn would."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import socket
import time
from typing import Any

import pytest

from proxy import serving
from proxy.serving import HttpProtocol, ServerThread, listening_sockets
from tests.e2e_support import asgi_body, free_port


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_localhost_is_every_loopback_address_the_machine_has() -> None:
    """``uvicorn.run(host="localhost")`` listened on 127.0.0.1 and ::1; a client that tries ::1
    first (Node 18's fetch) must still find cachegate."""
    port = free_port()
    sockets = listening_sockets("localhost", port)
    try:
        bound = {(s.family, s.getsockname()[0]) for s in sockets}
        assert (socket.AF_INET, "127.0.0.1") in bound
        if _ipv6_loopback() and any(
            info[0] == socket.AF_INET6 for info in socket.getaddrinfo("localhost", port)
        ):
            assert (socket.AF_INET6, "::1") in bound
        assert all(s.getsockname()[1] == port for s in sockets)
    finally:
        for s in sockets:
            s.close()


@pytest.mark.parametrize(("host", "address"), [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
def test_an_ipv4_host_is_one_socket(host: str, address: str) -> None:
    sockets = listening_sockets(host, free_port())
    try:
        assert [(s.family, s.getsockname()[0]) for s in sockets] == [(socket.AF_INET, address)]
    finally:
        for s in sockets:
            s.close()


def test_a_port_in_use_or_a_name_that_does_not_resolve_raises_and_leaves_nothing_open() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as info:
            listening_sockets("127.0.0.1", port)
        assert info.value.errno == errno.EADDRINUSE
    with pytest.raises(socket.gaierror):
        listening_sockets("nosuchhost.invalid", free_port())


@pytest.mark.timeout(30)
def test_a_hangup_while_the_server_is_being_built_still_stops_it() -> None:
    """SIGHUP stops `cachegate serve` as SIGTERM does; one that comes while the app is being
    built (before there is a server to stop) is not lost: the server stops once it runs."""
    import os
    import signal
    import threading

    import uvicorn

    from proxy.serving import serve_until_stopped

    if threading.current_thread() is not threading.main_thread():
        pytest.fail("signal handlers need the main thread")

    async def app(scope: dict, receive: object, send: object) -> None:  # never called
        raise AssertionError

    def build() -> uvicorn.Server:
        os.kill(os.getpid(), signal.SIGHUP)  # delivered now, before the server exists
        return uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))

    before = signal.getsignal(signal.SIGHUP)
    assert serve_until_stopped(listening_sockets("127.0.0.1", free_port()), build) == 0
    assert signal.getsignal(signal.SIGHUP) is before  # put back as it was


def test_the_started_callback_comes_once_connections_are_accepted_and_the_stop_one_first() -> None:
    """`cachegate serve` prints its "listening on" line from ``on_started``: it came before the
    app's start-up (a slow one: retention over a large log directory) and before the port
    listened, so a script that waited for the line had its first connection refused.
    ``on_stop`` comes as the server begins to stop, before it closes its sockets."""
    import asyncio
    import threading

    import uvicorn

    from proxy.serving import Server

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await asyncio.sleep(0.5)  # a slow start-up
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    port = free_port()
    (sock,) = listening_sockets("127.0.0.1", port)
    seen: list[str] = []
    server: Server

    def started() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            seen.append("accepting")
        server.should_exit = True

    def stopping(running: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            seen.append(f"stopping with {running} in flight, still open")

    server = Server(
        uvicorn.Config(app, lifespan="on", log_level="warning"),
        on_stop=stopping,
        on_started=started,
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    thread.join(10)
    sock.close()
    assert seen == ["accepting", "stopping with 0 in flight, still open"]


@pytest.mark.parametrize("answered", [True, False])
def test_a_request_answered_whole_is_not_in_flight_while_its_after_work_ends(
    answered: bool,
) -> None:
    """Ctrl+C right after an answer said "stopping: 1 request(s) in flight" (its task still
    wrote the log line and the accounting): the client had its whole answer, and nothing of it
    is at stake. A request still waiting for its answer is in flight."""
    import asyncio
    import threading

    import uvicorn

    from proxy.serving import Server

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if answered:
            await _answer(send, b"done")
            await asyncio.sleep(1.0)  # the work after the answer (the log line, accounting)
        else:
            await asyncio.sleep(1.0)
            await _answer(send, b"late")

    port = free_port()
    (sock,) = listening_sockets("127.0.0.1", port)
    seen: list[int] = []
    server: Server

    def started() -> None:
        def client() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                if answered:
                    assert _answers(conn, 1) == [b"done"]
                else:
                    time.sleep(0.3)  # (the request is being answered)
                server.should_exit = True
                if not answered:
                    assert _answers(conn, 1) == [b"late"]  # (given its grace period)

        threading.Thread(target=client).start()

    server = Server(
        uvicorn.Config(app, lifespan="off", log_level="warning"),
        on_stop=seen.append,
        on_started=started,
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    thread.join(10)
    sock.close()
    assert seen == [0 if answered else 1]


# --- requests that offer an upgrade (Upgrade: h2c) ------------------------------------------------


async def _answer(send: Any, reply: bytes) -> None:
    await send(
        {"type": "http.response.start", "status": 200,
         "headers": [(b"content-length", b"%d" % len(reply))]}
    )  # fmt: skip
    await send({"type": "http.response.body", "body": reply})


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An app that answers each request with its method, path and body."""
    if scope["type"] != "http":
        return
    body = await asgi_body(receive)
    await _answer(send, b"%s %s %s" % (scope["method"].encode(), scope["path"].encode(), body))


H2C = b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"


def _answers(sock: socket.socket, count: int) -> list[bytes]:
    """The bodies of ``count`` content-length framed answers read from ``sock``."""
    data, bodies = b"", []
    while len(bodies) < count:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {len(bodies)} answers: {data!r}"
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), head
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(data) < length:
            data += sock.recv(65536)
        bodies.append(data[:length])
        data = data[length:]
    return bodies


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_request_offering_an_upgrade_keeps_its_body_and_the_requests_after_it(
    framing: str,
) -> None:
    """httptools skips the body of a request that offers an upgrade: ``curl --http2`` and Java's
    HttpClient got an empty body (cachegate: ``invalid_json``), and the body was then read as a
    request of its own (a second 400, the connection closed). The offer is ignored (HTTP/1.1)."""
    body = b'{"model": "m", "messages": []}'
    if framing == "chunked":
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
        pieces = [b"%x\r\n%s\r\n" % (len(body[:9]), body[:9]),
                  b"%x\r\n%s\r\n0\r\n\r\n" % (len(body[9:]), body[9:])]  # fmt: skip
    else:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n" % len(
            body
        )
        pieces = [body[:9], body[9:]]
    after = b"POST /next HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc"
    with ServerThread(_echo) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(10)
        s.sendall(head + H2C + b"\r\n")  # the headers, then the body in pieces, as Ktor sends
        for piece in pieces:
            time.sleep(0.1)
            s.sendall(piece)
        s.sendall(after)
        assert _answers(s, 2) == [b"POST /v1/chat/completions " + body, b"POST /next abc"]
        # and all in one write, an upgrade without a body between two with one
        s.sendall(head + H2C + b"\r\n" + b"".join(pieces)
                  + b"GET /h HTTP/1.1\r\nhost: x\r\n" + H2C + b"\r\n" + after)  # fmt: skip
        assert _answers(s, 3) == [
            b"POST /v1/chat/completions " + body,
            b"GET /h ",
            b"POST /next abc",
        ]


async def _header_names(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An app that answers each request with its header names, sorted, and its body."""
    if scope["type"] != "http":
        return
    body = await asgi_body(receive)
    await _answer(send, b",".join(sorted(name for name, _ in scope["headers"])) + b" " + body)


@pytest.mark.parametrize("offer", [b"", H2C])
def test_a_chunked_bodys_trailer_fields_are_no_request_headers(offer: bytes) -> None:
    """uvicorn added a chunked body's trailer fields to the request's headers when they came in
    the packet its head came in (an ``Authorization`` trailer went upstream in place of
    cachegate's key, an ``X-Session-Id`` one named the session), not when they came later."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
    body = b"4\r\nabcd\r\n0\r\nauthorization: Bearer sk-trailer\r\nx-session-id: t\r\n\r\n"
    after = b"POST /next HTTP/1.1\r\nhost: x\r\nx-after: 1\r\ncontent-length: 3\r\n\r\nabc"
    with (
        ServerThread(_header_names) as server,
        socket.create_connection(("127.0.0.1", server.port)) as s,
    ):
        s.settimeout(10)
        s.sendall(head + offer + b"\r\n" + body + after)
        names = b"connection,host,http2-settings,transfer-encoding,upgrade" if offer else None
        first, second = _answers(s, 2)
        assert first == (names or b"host,transfer-encoding") + b" abcd"
        assert second == b"content-length,host,x-after abc"  # (the next request's are its own)


def test_an_upgrade_offer_does_not_change_which_bodies_are_refused() -> None:
    """A transfer coding other than chunked is refused (a 501) without an offer; with one,
    the connection was dropped with no answer (a traceback on the server)."""
    head = b"POST /p HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n"
    with ServerThread(_echo) as server:
        for offer in (b"", H2C):
            with socket.create_connection(("127.0.0.1", server.port)) as s:
                s.settimeout(10)
                s.sendall(head + offer + b"\r\nabc")
                answer = b""
                while chunk := s.recv(65536):
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 501 Not Implemented\r\n"), (offer, answer)
                answer_head, _, body = answer.partition(b"\r\n\r\n")
                assert b"content-type: application/json" in answer_head
                error = json.loads(body)["error"]
                assert error["code"] == "unsupported_transfer_coding"
                assert error["type"] == "invalid_request_error"
                assert error["message"].startswith("Transfer-Encoding 'gzip' is not supported")


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n",  # no colon
        b"GET /v1/mo dels x HTTP/1.1\r\nhost: x\r\n\r\n",  # a space in the path
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n",
        b"POST /v1/x HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n"
        b"transfer-encoding: chunked\r\n\r\n",  # both framings: a smuggling attempt
    ],
)
def test_a_request_the_parser_refuses_is_answered_in_openais_error_shape(
    request_head: bytes,
) -> None:
    """uvicorn answered these with a plain-text 400, which an SDK shows as an unreadable body;
    the parser's own reason is said."""
    with ServerThread(_echo) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(10)
        s.sendall(request_head)
        answer = b""
        while chunk := s.recv(65536):  # (closed after it)
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"application/json" in head
    assert head.count(b"\r\ndate: ") == 1  # (as any answer cachegate makes itself)
    assert int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]) == len(body)
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_http" and error["param"] is None
    assert error["message"].startswith("Invalid HTTP request received: ")


def test_requests_the_parser_refuses_are_warned_of_now_and_then_saying_why(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uvicorn's ``Invalid HTTP request received.`` came on stderr for every one, with no time
    and no reason: a client set to ``https://`` added a line a try, each retry too."""
    hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32)  # (a ClientHello's start)

    def send(data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.settimeout(10)
            s.sendall(data)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
            return answer

    caplog.set_level(logging.WARNING, logger="proxy.serving")
    malformed = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n"
    with ServerThread(_echo) as server:
        assert send(malformed)[:12] == b"HTTP/1.1 400"  # (a probe's first: the TLS still said)
        caplog.clear()
        for _ in range(3):
            assert send(hello).startswith(b"HTTP/1.1 400 ")
        warned = [r.getMessage() for r in caplog.records if r.name == "proxy.serving"]
        assert len(warned) == 1, warned
        assert warned[0].startswith("a client spoke TLS to this plain-HTTP port: its base URL")
        assert "(1 such since start-up; next such warning in 30 s" in warned[0]
        for _ in range(2):
            assert send(malformed)[:12] == b"HTTP/1.1 400"  # (within the 30 s of the first)
        monkeypatch.setattr(serving, "INVALID_WARN_EVERY_S", 0.0)
        assert send(malformed)[:12] == b"HTTP/1.1 400"
    warned = [r.getMessage() for r in caplog.records if r.name == "proxy.serving"]
    assert len(warned) == 2 and "parser refused (" in warned[1], warned
    assert "answered 400 invalid_http (3 such since the last such warning" in warned[1]
    assert not any("Invalid HTTP request received" in r.getMessage() for r in caplog.records)


def _exchange_once(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(10)
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):  # (closed after it)
            answer += chunk
        return answer


@pytest.mark.parametrize(
    "coding",
    [b"gzip, chunked", b"deflate,chunked", b"gzip\r\ntransfer-encoding: chunked"],
)
def test_a_body_in_a_transfer_coding_before_chunked_is_refused_with_a_501(
    coding: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """``Transfer-Encoding: gzip, chunked``: the parser undid the chunks and the app was given
    the body still compressed (a chat request: ``invalid_json``, "not valid UTF-8"; another
    route: forwarded with no ``Content-Encoding``). RFC 9112 6.1: a coding not understood is a
    501; nothing reaches the app."""
    import gzip

    body = gzip.compress(b'{"model": "m", "messages": []}')
    request = (
        b"POST /v1/x HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: " + coding + b"\r\n\r\n%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    )
    caplog.set_level(logging.WARNING, logger="proxy.serving")
    with ServerThread(_echo) as server:
        answer = _exchange_once(server.port, request)
    head, _, reply = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 501 Not Implemented\r\n"), answer[:200]
    error = json.loads(reply)["error"]
    assert error["code"] == "unsupported_transfer_coding"
    assert "Transfer-Encoding '" in error["message"] and "chunked alone" in error["message"]
    warned = [r.getMessage() for r in caplog.records if r.name == "proxy.serving"]
    assert len(warned) == 1 and "answered 501 unsupported_transfer_coding" in warned[0]
    # chunked alone, in any case, is read as ever
    plain = b'{"a": 1}'
    with ServerThread(_echo) as server:
        answer = _exchange_once(
            server.port,
            b"POST /v1/x HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
            b"transfer-encoding: Chunked \r\n\r\n%x\r\n" % len(plain) + plain + b"\r\n0\r\n\r\n",
        )
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"POST /v1/x " + plain)


def test_cachegate_set_as_a_clients_proxy_says_so() -> None:
    """cachegate set as ``HTTPS_PROXY`` (instead of the base URL): the client's ``CONNECT
    api.openai.com:443`` was answered "Invalid HTTP request received: User callback error.",
    which says nothing of the mistake."""
    with ServerThread(_echo) as server:
        answer = _exchange_once(
            server.port,
            b"CONNECT api.openai.com:443 HTTP/1.1\r\nhost: api.openai.com:443\r\n\r\n",
        )
        port = server.port
    head, _, reply = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 405 "), answer[:200]
    error = json.loads(reply)["error"]
    assert error["code"] == "method_not_allowed"
    assert "no HTTP proxy" in error["message"] and "CONNECT api.openai.com:443" in error["message"]
    assert f"OPENAI_BASE_URL=http://127.0.0.1:{port}/v1" in error["message"]


def test_a_request_for_another_server_sent_to_cachegate_as_a_proxy_is_refused() -> None:
    """cachegate set as ``HTTP_PROXY`` with a plain ``http://`` base URL: the client sends the
    other server's whole URL as its target, which was served as a request to cachegate: a 403
    for the other server's name, or, that name allowed (or ``localhost:11434``, an Ollama),
    answered by cachegate's upstream with cachegate's key. A URL of cachegate's own (a loopback
    name and its port) is served as any request (RFC 9112 3.2.2)."""
    with ServerThread(_echo) as server:
        port = server.port
        for target in (
            b"http://llm-gateway.corp.example/v1/chat/completions",
            b"http://localhost:11434/v1/chat/completions",
            b"HTTP://127.0.0.1:%d@evil.example/v1/x" % port,
            b"https://127.0.0.1/v1/x",
        ):
            answer = _exchange_once(
                port, b"POST " + target + b" HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
            )
            head, _, reply = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 405 "), (target, answer[:200])
            error = json.loads(reply)["error"]
            assert error["code"] == "method_not_allowed"
            assert "no HTTP proxy" in error["message"]
            assert "POST " + target.decode() in error["message"]
            assert f"OPENAI_BASE_URL=http://127.0.0.1:{port}/v1" in error["message"]
        for own in (b"http://127.0.0.1:%d/v1/x" % port, b"http://LOCALHOST:%d/v1/x" % port):
            answer = _exchange_once(
                port,
                b"POST " + own + b" HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n"
                b"connection: close\r\n\r\n",
            )
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"POST /v1/x "), own


def test_the_base_url_a_connect_is_told_to_use_instead_is_one_a_client_can_use() -> None:
    """cachegate bound to ::1: the 405 said ``OPENAI_BASE_URL=http://::1:8787/v1``."""
    refused = serving._not_a_proxy(b"api.openai.com:443", "::1", 8787)
    assert "OPENAI_BASE_URL=http://[::1]:8787/v1," in refused.message
    refused = serving._not_a_proxy(b"api.openai.com:443", "127.0.0.1", 8787)
    assert "OPENAI_BASE_URL=http://127.0.0.1:8787/v1," in refused.message
    # the client's target, said on stderr: no terminal escapes
    refused = serving._not_a_proxy(b"\x1b[2Jevil:443", "127.0.0.1", 8787)
    assert "\x1b" not in refused.message and "(CONNECT ?[2Jevil:443)" in refused.message


def test_a_request_refused_by_its_head_pipelined_behind_an_answer_gets_its_refusal_after_it() -> (
    None
):
    import asyncio

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await asyncio.sleep(0.5)
            await _answer(send, scope["path"].encode())

    first = b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n"
    second = b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n"
    with ServerThread(app) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(first + second)
        answer = _closed_within(s, 10)
    ok, _, refused = answer.partition(b"HTTP/1.1 405 ")
    assert ok.startswith(b"HTTP/1.1 200 ") and ok.endswith(b"/slow"), answer[:300]
    assert b"method_not_allowed" in refused


def test_a_websocket_handshake_is_answered_by_the_app_whatever_follows_it() -> None:
    """What a client sends after a WebSocket handshake would be frames: not read as HTTP."""
    with ServerThread(_echo) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(10)
        s.sendall(
            b"GET /ws HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: websocket\r\n"
            b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
            b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58"
        )
        assert _answers(s, 1) == [b"GET /ws "]


# --- what a client may make cachegate hold ---------------------------------------------------------


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What ``sock`` read until the server closed it (within ``seconds``, else fails)."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pytest.fail(f"still open after {seconds} s: {data!r}")
    except ConnectionResetError:
        pass
    return data


def test_a_request_head_past_its_limit_is_a_431_in_openais_error_shape() -> None:
    """Header lines without end were all held: 2 GB of memory from one connection."""
    with ServerThread(_echo) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n")
        try:
            for _ in range(20):  # 160 KiB of header lines, more than the 64 KiB allowed
                s.sendall(b"x-pad: " + b"a" * 8000 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # (closed once it was refused)
        answer = _closed_within(s, 10)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer[:200]
    error = json.loads(body)["error"]
    assert error["code"] == "request_header_too_large" and "64 KiB" in error["message"]
    # a head under the limit, in many pieces, is a request as any
    with ServerThread(_echo) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/x HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n")
        for _ in range(6):
            s.sendall(b"x-pad: " + b"a" * 8000 + b"\r\n")
        s.sendall(b"\r\nhi")
        assert _answers(s, 1) == [b"POST /v1/x hi"]


@pytest.mark.parametrize("where", ["a header", "the target"])
def test_a_head_past_its_limit_in_one_read_is_a_431_and_never_dispatched(where: str) -> None:
    """A read that began a head was not counted: a whole head of up to ~250 KiB (uvloop's
    read) sent in one write was taken and relayed upstream, where the same bytes in two
    writes got the 431."""
    seen: list[bytes] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append(scope["path"].encode())
            await _answer(send, b"dispatched")

    big = b"a" * 150_000
    head = (
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + big + b"\r\n\r\n"
        if where == "a header"
        else b"GET /v1/models?q=" + big + b" HTTP/1.1\r\nhost: x\r\n\r\n"
    )
    with ServerThread(app) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head)  # (one write: one read on loopback)
        answer = _closed_within(s, 10)
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer[:200]
    assert seen == []  # (never the app's: upstream, it went with the key added)
    # one under the limit in one read is a request as any
    with ServerThread(app) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(10)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 60_000 + b"\r\n\r\n")
        assert _answers(s, 1) == [b"dispatched"]


def test_a_head_past_its_limit_pipelined_behind_an_answer_gets_its_431_after_it() -> None:
    """A head over the limit behind a request still being answered (all of it in one read):
    its answer was not cut into, but the 431 never came: the connection was closed at the
    head's time limit, 30 s later, with no word."""
    import asyncio

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await asyncio.sleep(0.5)
            await _answer(send, scope["path"].encode())

    first = b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n"
    second = b"GET /second HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n"
    with ServerThread(app) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(first + second)
        started = time.monotonic()
        answer = _closed_within(s, 10)
    assert time.monotonic() - started < 5
    ok, _, refused = answer.partition(b"HTTP/1.1 431 ")
    assert ok.startswith(b"HTTP/1.1 200 ") and ok.endswith(b"/slow"), answer[:300]
    assert b"request_header_too_large" in refused and b"/second" not in answer


def _framed(data: bytes) -> list[tuple[bytes, bytes]]:
    """The heads and bodies of the content-length framed answers in ``data``."""
    answers = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        answers.append((head, data[:length]))
        data = data[length:]
    return answers


def test_requests_pipelined_past_the_limit_are_not_queued() -> None:
    """A local process that wrote small requests down one connection without reading the
    answers had each queued, ~40 times its size, and read on after every answer: 13 MB sent
    took 600 MB, and gigabytes over a few connections. Those past the limit are not taken:
    the ones queued are answered, in order, the last with ``Connection: close``."""
    import asyncio

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await asyncio.sleep(0.01)
            await _answer(send, scope["path"].encode())

    requests = b"".join(b"GET /%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(2000))
    with ServerThread(app) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(requests)
        answers = _framed(_closed_within(s, 20))
    assert HttpProtocol.max_pipelined < len(answers) < 1000
    assert [body for _, body in answers] == [b"/%d" % i for i in range(len(answers))]
    assert all(head.startswith(b"HTTP/1.1 200 ") for head, _ in answers)
    assert b"connection: close" in answers[-1][0].lower()
    assert not any(b"connection: close" in head.lower() for head, _ in answers[:-1])
    # as many as the limit, on a connection that goes on
    with ServerThread(app) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(10)
        s.sendall(requests[: requests.index(b"GET /%d " % HttpProtocol.max_pipelined)])
        assert len(_answers(s, HttpProtocol.max_pipelined)) == HttpProtocol.max_pipelined
        s.sendall(b"GET /more HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _answers(s, 1) == [b"/more"]


def test_a_head_past_its_limit_pipelined_behind_queued_requests_gets_its_431_after_them() -> None:
    """Three requests, then a head over the limit, in one write: the 431 came right after the
    first answer, in the place of the second (a client took it for that one's), and the
    second and third were never answered."""
    import asyncio

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await asyncio.sleep(0.05)
            await _answer(send, scope["path"].encode())

    queued = b"".join(b"GET /%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(3))
    big = b"GET /big HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n"
    with ServerThread(app) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(queued + big)
        answer = _closed_within(s, 10)
    answered, _, refused = answer.partition(b"HTTP/1.1 431 ")
    assert [body for _, body in _framed(answered)] == [b"/0", b"/1", b"/2"], answer[:600]
    assert b"request_header_too_large" in refused and b"/big" not in answer


def test_a_small_head_pipelined_behind_a_large_body_is_answered() -> None:
    """The bytes of a read that began a head were all counted as the head's, the body of the
    request before it too: a 45-byte request behind a 200 KB one got a 431."""
    body = b"x" * 200_000
    first = b"POST /v1/x HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    second = b"POST /v1/y HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi"
    with ServerThread(_echo) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(10)
        s.sendall(first + second[:20])
        time.sleep(0.3)
        s.sendall(second[20:])
        answers = _answers(s, 2)
    assert answers[0].startswith(b"POST /v1/x xxx") and answers[1] == b"POST /v1/y hi"


def test_connections_that_hold_a_head_or_a_body_back_are_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection that sent nothing, a head trickled a line at a time, an upload that
    stopped: each was held for ever (a local process could take every file descriptor, every
    other client refused). A request answered slowly is not cut, nor one whose body comes."""
    from proxy.serving import HttpProtocol

    monkeypatch.setattr(HttpProtocol, "head_timeout_s", 1.0)
    monkeypatch.setattr(HttpProtocol, "body_idle_s", 1.0)
    monkeypatch.setattr(HttpProtocol, "sweep_s", 0.1)

    async def slow(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await asgi_body(receive)
        import asyncio

        await asyncio.sleep(2.5)  # (an answer that takes its time: not the client's stall)
        await _answer(send, b"slow " + body)

    with ServerThread(slow) as server:
        address = ("127.0.0.1", server.port)
        with socket.create_connection(address) as idle:
            started = time.monotonic()
            assert _closed_within(idle, 5) == b""
            assert 0.9 < time.monotonic() - started < 3
        with socket.create_connection(address) as trickle:
            trickle.sendall(b"GET /v1/models HTTP/1.1\r\n")
            for _ in range(3):
                time.sleep(0.4)
                with contextlib.suppress(OSError):
                    trickle.sendall(b"x-a: b\r\n")
            assert _closed_within(trickle, 5) == b""
        with socket.create_connection(address) as upload:
            upload.sendall(b"POST /v1/x HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc")
            assert _closed_within(upload, 5) == b""
        with socket.create_connection(address) as patient:
            patient.sendall(b"POST /v1/x HTTP/1.1\r\nhost: x\r\ncontent-length: 6\r\n\r\nab")
            for piece in (b"cd", b"ef"):  # (each piece within the body's idle time)
                time.sleep(0.6)
                patient.sendall(piece)
            patient.settimeout(10)
            assert _answers(patient, 1) == [b"slow abcdef"]


# --- HTTP/1.0 clients --------------------------------------------------------------------------


async def _streamed(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An app that answers with three parts and no length: a stream."""
    if scope["type"] != "http":
        return
    await asgi_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for part in (b"data: one\n\n", b"data: two\n\n"):
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


@pytest.mark.parametrize("version", [b"1.0", b"1.1"])
def test_a_stream_to_an_http_10_client_goes_unchunked_and_ends_with_the_connection(
    version: bytes,
) -> None:
    """HTTP/1.0 knows no chunked coding, and a server must not send it one (RFC 9112 6.1):
    ApacheBench and ``curl -0`` read the chunk sizes (``b\\r\\n``) as part of the stream. To
    HTTP/1.1 a stream goes chunked, as before."""
    request = b"GET /v1/x HTTP/%b\r\nhost: 127.0.0.1\r\n\r\n" % version
    with (
        ServerThread(_streamed) as server,
        socket.create_connection(("127.0.0.1", server.port)) as s,
    ):
        s.sendall(request)
        if version == b"1.1":
            s.sendall(b"GET /v1/x HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        data = _closed_within(s, 10)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    if version == b"1.0":
        assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
        assert body == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
    else:
        assert b"transfer-encoding: chunked" in head.lower()
        assert body.startswith(b"b\r\ndata: one\n\n\r\n")
        assert body.count(b"HTTP/1.1 200 ") == 1  # (kept alive: the second request answered)


def test_an_agents_stream_through_cachegate_to_an_http_10_client_is_the_stream(
    proxy_factory: Any,
) -> None:
    from proxy.simulator import SimConfig, run_simulator
    from tests.e2e_support import events

    body = json.dumps(
        {"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": "hi there"}]}
    ).encode()
    with run_simulator(SimConfig(chunk_ms=1)) as sim:
        proxy = proxy_factory(sim.api_base)
        with socket.create_connection(("127.0.0.1", proxy.server.port)) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.0\r\nhost: 127.0.0.1\r\nx-session-id: old\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body
            )
            data = _closed_within(s, 20)
    head, _, stream = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding" not in head.lower()
    blocks = stream.split(b"\n\n")
    assert blocks[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(block.removeprefix(b"data: ")) for block in blocks[:-2]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    proxy.settle()
    (response,) = events(proxy.log_dir, "old", "response")
    assert response["status"] == 200 and not response["interrupted"]
