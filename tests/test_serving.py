"""``proxy.serving``: the sockets ``cachegate serve`` binds before it starts, as uvicorn would."""

from __future__ import annotations

import errno
import socket

import pytest

from proxy.serving import listening_sockets
from tests.e2e_support import free_port


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
