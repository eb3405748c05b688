"""Run an ASGI app with uvicorn on a loopback port in a background thread.

Tests, the demo and the benchmark need real sockets (streams and disconnects cannot be observed
through ``httpx.ASGITransport``), so every in-process server goes through this one helper.
"""

from __future__ import annotations

import errno
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

import uvicorn


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
            http="auto",
            lifespan=lifespan,
            timeout_graceful_shutdown=2,
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
