"""``cachegate serve | simulate | demo | sessions …`` — the command line."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import logging
import os
import re
import socket
import sys
import time
import tomllib
from collections.abc import Sequence
from typing import Final
from urllib.parse import urlsplit

from proxy import __version__
from proxy.browser import binds_loopback, is_loopback_name, parse_address
from proxy.config import (
    DEFAULT_MODELS,
    INTEGER_TEXT,
    NUMBER_TEXT,
    ConfigError,
    UpstreamSettings,
    host_problem,
    load_settings,
    shown_url,
    unknown_variable_notes,
    url_host,
)

DEFAULT_LOG_DIR = "./cachegate-logs"
_VARIABLE_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,63}")  # as variables are named, not as keys are


_AWS_KEY_ID = re.compile(r"A(?:KIA|SIA|BIA|CCA)[A-Z2-7]{16}")


def _key_like_name(name: str) -> bool:
    """Whether a name written as a variable's is a key of capitals and digits: an AWS key id
    (``AKIA…``), or a piece between underscores of 16 characters or more with three digits or
    more (a hex key in capitals; a variable's words have few: ``LLM_KEY_EASTUS2PRODUCTION``,
    ``CLAUDE35SONNETAPIKEY``)."""
    return any(
        _AWS_KEY_ID.fullmatch(p) or (len(p) >= 16 and sum(c.isdigit() for c in p) >= 3)
        for p in name.split("_")
    )


SHUTDOWN_GRACE_S = 5  # after Ctrl+C, how long answers in flight may still finish
# ...and how much longer a restart waits for the stopping one: its requests' observers (3 s at
# most), its log writer's last lines (5 s, and 2 more at exit), with room for a slow disk
STOPPING_WAIT_S = 20


def tune_gc() -> None:
    """Keep the cyclic garbage collector off the relay's back.

    A full collection walks every live object: with a thousand streams in flight that is ~45 ms
    during which no stream moves, and the default thresholds ran five of them per thousand-stream
    burst in the benchmark (~110 ms of pauses). The objects alive at start-up (modules, the app)
    live as long as the process: ``gc.freeze()`` takes them out of every collection. A relayed
    request leaves no reference cycle behind, nor does one the upstream refused, answered with
    an error, cut off mid-way, stalled past the read timeout or answered malformed
    (``tests/test_relay.py`` checks each, on cachegate's own upstream pool, the default: with
    ``upstream.transport: httpx`` httpcore's errors still leave some), so reference counting
    frees its objects at once and full collections can run a tenth as often (after 100
    middle-generation ones instead of 10) without garbage piling up.

    The young generation is collected when the objects made since its last collection, less
    those freed, pass its threshold. Requests in flight hold theirs (a parsed body, its
    exchange, its log lines): with 32 of them the count went past the interpreter's 700 every
    ~18 requests, and each pass (~130 µs, walking what those requests held) cost ~8 µs a
    request, ~3% of cachegate's CPU. At ``YOUNG_THRESHOLD`` it passes only when that much more
    is alive than before, not with the ebb and flow of requests (and a 600 KB agent body, ~1,500
    containers, is no longer walked while it is parsed). A pass then walks more: a reviewer's
    model of a thousand parsed bodies in flight, replaced in turn, made one pass of ~19 ms where
    the old threshold made 734 (up to 5.5 ms) and 66 middle-generation ones (up to 15 ms), 2.4 s
    of collecting in all.
    """
    import gc

    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, 100)


YOUNG_THRESHOLD: Final = 10_000


# glibc's mallopt parameters, and the values ``tune_malloc`` sets
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
MMAP_THRESHOLD_BYTES: Final = 16 * 1024 * 1024
TRIM_THRESHOLD_BYTES: Final = 32 * 1024 * 1024
_MALLOC_ENV: Final = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


OPEN_FILES_CAP: Final = 1 << 20
"""The most open files ``raise_open_files`` asks for (where the hard limit is unlimited)."""


def raise_open_files() -> tuple[int | None, int | None] | None:
    """Raise the soft limit on open files to the hard one (at most ``OPEN_FILES_CAP``); the
    soft and hard limits after (None: unlimited), None where there are none to read (Windows).

    Each stream in flight holds two sockets, the client's and the upstream's, and the event log
    keeps session files open: the soft limit most systems start a process with (1,024) ran out
    at ~500 concurrent streams, whose next connections failed (an upstream connection with a
    502, a client's accept delayed a second at a time). The hard limit is what the system lets
    a process take without privileges; servers take it at start (nginx's
    ``worker_rlimit_nofile``, Go's runtime). cachegate waits on sockets with epoll, never with
    ``select``'s 1,024 slots."""
    try:
        import resource
    except ImportError:
        return None
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return None
    want = OPEN_FILES_CAP if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_CAP)
    if soft != resource.RLIM_INFINITY and soft < want:
        # (macOS refuses a soft limit past kern.maxfilesperproc, whatever the hard one says:
        # OPEN_MAX, 10,240, is what it takes)
        for value in (want, min(want, 10240)):
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (value, hard))
            except (OSError, ValueError):
                continue
            soft = value
            break
    unlimited = resource.RLIM_INFINITY
    return (None if soft == unlimited else soft), (None if hard == unlimited else hard)


def tune_malloc() -> bool:
    """Keep request bodies out of fresh memory from the kernel (glibc only; True when set).

    glibc serves an allocation past its mmap threshold (128 KiB at first, then the size of the
    largest such block freed) with memory mapped for it alone, and unmaps it when freed. An
    agent's body grows every turn, past the last one freed: each turn's 600 KB body came in new
    pages, ~150 page faults, ~0.4 ms of a 1.4 ms request at that size. Blocks up to 16 MiB now
    come from the heap, and up to 32 MiB freed at its top is kept for the next ones rather than
    given back (freed blocks below live ones stay, as before). ``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or a ``malloc.`` glibc tunable in the
    environment are left to decide instead."""
    if sys.platform != "linux" or any(name in os.environ for name in _MALLOC_ENV):
        return False
    if "malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        import ctypes  # (a Python built without libffi has none: left as it is)

        libc = ctypes.CDLL(None)
    except (ImportError, OSError):
        return False
    # (glibc's own function: musl's mallopt does nothing)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def _canonical_host(host: str, unspecified_is_loopback: bool = False) -> str:
    """``host`` lower-cased without brackets; an address in the one form ``ipaddress`` writes
    (``127.1``, ``0x7f000001`` and ``0`` as the socket layer reads them; an IPv4-mapped IPv6
    address as its IPv4 one, where a connection to it goes). With ``unspecified_is_loopback``
    ``0.0.0.0`` (``0``) and ``::`` (``[::0]``) are this machine's loopback, as Linux connects
    them."""
    # (a name's trailing dot, the root's: ``localhost.`` is ``localhost``)
    name = host.strip().lower().strip("[]").removesuffix(".")
    address = parse_address(name)
    if address is None:
        return name
    mapped = getattr(address, "ipv4_mapped", None)
    if mapped is not None:
        address = mapped
    if unspecified_is_loopback and address.is_unspecified:
        return "127.0.0.1" if address.version == 4 else "::1"
    return str(address)


def _upstream_is_self(base_url: str, host: str, port: int) -> bool:
    """Whether ``base_url`` names the address cachegate listens on (``--port 8787 --upstream
    http://127.0.0.1:8787/v1``): every request was sent back in, until the connections ran out.
    Names are looked up only for an http URL of the same port whose host is an address, a
    loopback name or the one bound (no DNS query for a provider's name)."""
    parts = urlsplit(base_url)
    try:
        upstream_port = parts.port or (80 if parts.scheme.lower() == "http" else 443)
    except ValueError:
        return False
    if parts.scheme.lower() != "http" or upstream_port != port:
        return False  # (an https URL to a plain HTTP port fails its handshake: no loop)
    # (an upstream at an unspecified address reaches this machine's own: Linux connects 0.0.0.0
    # as 127.0.0.1)
    name = _canonical_host(parts.hostname or "", unspecified_is_loopback=True)
    own = _canonical_host(host)

    def addresses(of: str) -> set[tuple[int, str]]:
        try:
            found = socket.getaddrinfo(of, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return set()
        return {(int(info[0]), str(info[4][0]).partition("%")[0]) for info in found}

    if not (parse_address(name) is not None or is_loopback_name(name) or name == own):
        return False  # (a provider's name, or another: not looked up)
    if own in ("", "*", "0.0.0.0", "::"):  # every address of a family (``listening_sockets``
        # binds "::" to IPv6 alone, "0.0.0.0" to IPv4 alone, no host to both): the loopback's
        # and every other this machine has (192.0.2.2 as well as 127.0.0.1)
        families = {"0.0.0.0": {socket.AF_INET}, "::": {socket.AF_INET6}}.get(
            own, {socket.AF_INET, socket.AF_INET6}
        )
        return any(
            f in families and (is_loopback_name(a) or _is_own_address(f, a))
            for f, a in addresses(name)
        )
    # (the bound name is looked up as binding it was: ``--host vm`` is 127.0.0.1 too)
    return name == own or bool(addresses(name) & addresses(own))


def _is_own_address(family: int, address: str) -> bool:
    """Whether ``address`` is one of this machine's own: a socket can be bound to it."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError:
        return False
    return True


def _serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from proxy.app import create_app
    from proxy.serving import CLIENT_KEEPALIVE_S, HttpProtocol, Server, serve_until_stopped

    try:
        settings = load_settings(
            ns.config,
            {
                "host": ns.host,
                "port": ns.port,
                "upstream": ns.upstream,
                "log_dir": ns.log_dir,
                "strict_pairing": True if ns.strict_pairing else None,
            },
        )
    except ConfigError as exc:
        print(f"cachegate: {exc}", file=sys.stderr)
        return 2
    if _upstream_is_self(settings.upstream.base_url, settings.server.host, settings.server.port):
        print(
            f"cachegate: the upstream URL {shown_url(settings.upstream.base_url)} is this"
            f" cachegate itself (it listens on {url_host(settings.server.host)}:"
            f"{settings.server.port}): each request would be sent back to it, without end;"
            " give the provider's URL (--upstream, upstream.base_url)",
            file=sys.stderr,
        )
        return 2
    if settings.upstream.base_url.lower().startswith("https:"):
        from proxy.upstream import ca_source, ssl_context

        try:  # (the app loads them again as it starts: here, one line instead of a traceback)
            ssl_context()
        except OSError as exc:
            print(
                f"cachegate: cannot load the CA certificates for the https upstream from"
                f" {ca_source()}: {exc.strerror or exc} (SSL_CERT_FILE names a PEM bundle of"
                " CAs; unset, certifi's bundle is used)",
                file=sys.stderr,
            )
            return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per upstream request
    host, port = settings.server.host, settings.server.port
    sockets = _bound(host, port, "cachegate")  # before anything else: nothing created yet
    if sockets is None:
        return 1
    if settings.logging.enabled and _log_dir_taken(settings.logging.dir):
        for sock in sockets:
            sock.close()
        return 1
    if settings.logging.enabled:
        from proxy.eventlog import log_dir_problem

        # A directory there that cannot be written into (a bind mount of the host user's, a
        # container running as another): said at once, not at the first request. (One that
        # cannot be made, the writer says as it starts.)
        problem = log_dir_problem(settings.logging.dir)
        if problem is not None and problem.startswith("cannot write in"):
            print(
                f"cachegate: note: {problem}: cachegate serves, and its session logs are lost"
                " (cachegate_event_log_lost_total) until it can write there",
                file=sys.stderr,
            )

    def server() -> Server:
        limits = raise_open_files()  # (before the app: the log writer sizes its files by it)
        app = create_app(settings)
        writer = app.state.gateway.writer
        if writer is not None:  # the shutdown closes it; at exit, whatever happened to that
            atexit.register(writer.close, 2.0)
        logs = f"logs: {settings.logging.dir}" if settings.logging.enabled else "session logs off"
        config_file = ns.config or os.environ.get("CACHEGATE_CONFIG")
        if config_file:
            logs = f"config: {config_file}; {logs}"
        key_env = settings.upstream.api_key_env
        if key_env and os.environ.get(key_env, "").strip().lower() == "cachegate":
            print(
                f"cachegate: note: ${key_env} here is the placeholder 'cachegate', which"
                " stands for this key: give cachegate the real key, and the agent the placeholder",
                file=sys.stderr,
            )
        for note in unknown_variable_notes(os.environ):
            print(f"cachegate: note: {note}", file=sys.stderr)
        given = (
            "--log-dir"
            if ns.log_dir
            else "CACHEGATE_LOG_DIR"
            if os.environ.get("CACHEGATE_LOG_DIR")
            else None
        )
        if given is not None and not settings.logging.enabled:
            print(
                f"cachegate: note: {given} is set, but logging.enabled = false: no session logs"
                " are written",
                file=sys.stderr,
            )
        idle = settings.sessions.idle_ttl_s
        own = _file_model_names(config_file)
        from proxy.cache import default_cache_ttl

        outlived = sorted(  # (of the user's own tables: a built-in one may be no model in use;
            n  # one the file repeats as it is built in, the example config's, is the user's)
            for n, m in settings.models.items()
            # (a TTL left at 0, its provider's default: a DeepSeek name's hour too)
            if (m.cache_ttl_s or default_cache_ttl(n, m.dialect)) > idle
            and (n in own or DEFAULT_MODELS.get(n) != m)
        )
        if outlived:
            print(
                f"cachegate: note: the cache TTL of {', '.join(outlived)} is longer than"
                f" sessions.idle_ttl_s ({idle:g} s): a session idle between the two is"
                " forgotten, and the miss after its pause not judged; raise sessions.idle_ttl_s",
                file=sys.stderr,
            )
        # (the default's variable unset is the usual setup, where every client brings its key)
        default_env = UpstreamSettings.api_key_env
        if key_env and key_env != default_env and not os.environ.get(key_env, "").strip():
            # Named only when it reads as a variable's name (MY_GATEWAY_KEY): a key written
            # where its variable's name goes (gsk_..., a hex key) is never shown.
            what = (
                f"${key_env}, which is not set here"
                + (" (it holds only white space)" if os.environ.get(key_env) else "")
                if _VARIABLE_NAME.fullmatch(key_env) and not _key_like_name(key_env)
                else "no variable set here (what it holds is not shown: a key belongs in a"
                " variable it names)"
            )
            print(
                f"cachegate: note: upstream.api_key_env names {what}: requests without a key of"
                " their own go without one",
                file=sys.stderr,
            )
        if key_env and os.environ.get(key_env, "").strip():
            from proxy.errors import ProxyError
            from proxy.relay import bearer

            try:
                bearer(os.environ[key_env])
            except ProxyError:  # each request without a key of its own would get a 500
                print(
                    f"cachegate: note: ${key_env} has a character an HTTP header cannot carry"
                    " (a line break, a control or a non-Latin-1 character): requests without a"
                    " key of their own get a 500 until it is fixed",
                    file=sys.stderr,
                )
        if key_env and os.environ.get(key_env, "").strip() and not binds_loopback(host):
            print(
                f"cachegate: note: listening on {host}, beyond this machine, with ${key_env}"
                " set: anyone who can reach the port can use that key (requests without their"
                " own); keep the port behind something that authenticates, or set"
                ' upstream.api_key_env = "" so that every client brings its own key',
                file=sys.stderr,
            )
        if "@" in (urlsplit(settings.upstream.base_url).netloc or ""):
            added = f" (or adds Bearer ${key_env})" if key_env else ""
            print(
                "cachegate: note: the upstream URL's user:password is not sent: cachegate"
                f" forwards the client's key headers{added}; an upstream behind basic"
                " authentication needs the client to send it (an Authorization header)",
                file=sys.stderr,
            )
        ends = [
            e
            for e in _ENDPOINTS
            if urlsplit(settings.upstream.base_url).path.rstrip("/").endswith(e)
        ]
        if ends:  # (a pasted endpoint URL: every request went to .../chat/completions/chat/...)
            print(
                f"cachegate: note: the upstream URL {shown_url(settings.upstream.base_url)}"
                f" ends in an endpoint, {ends[0]}: each request's path under /v1 is appended to"
                f" it (.../{ends[0].strip('/')}/chat/completions); give the base URL, which"
                " usually ends in /v1",
                file=sys.stderr,
            )
        elif urlsplit(settings.upstream.base_url).path.strip("/") == "":
            print(
                f"cachegate: note: the upstream URL {shown_url(settings.upstream.base_url)}"
                " has no path; an OpenAI-compatible base URL usually ends in /v1"
                " (https://api.openai.com/v1), or the provider's 404 answers every request",
                file=sys.stderr,
            )
        listening = (
            f"cachegate {__version__} listening on http://{url_host(host)}:{port}/v1"
            f" -> {shown_url(settings.upstream.base_url)} ({logs})"
        )
        tune_gc()
        tune_malloc()
        needed = 2 * settings.upstream.max_connections + 64  # (two sockets a stream, the logs)
        soft = limits[0] if limits is not None else None
        if soft is not None and soft < needed:
            print(
                f"cachegate: note: this process may open {soft} files (ulimit -n, its hard"
                " limit), and each request in flight holds two sockets: past"
                f" ~{max(1, (soft - 64) // 2)} at once, new connections"
                " fail; raise the hard limit (ulimit -Hn, LimitNOFILE=, docker --ulimit"
                " nofile=) or lower upstream.max_connections",
                file=sys.stderr,
            )
        config = uvicorn.Config(
            app,
            loop="auto",
            http=HttpProtocol,  # uvicorn's, reading on after an upgrade it does not make
            access_log=False,
            server_header=False,
            date_header=False,
            proxy_headers=False,  # a local proxy: X-Forwarded-* from clients mean nothing here
            log_level="warning",
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            timeout_keep_alive=CLIENT_KEEPALIVE_S,  # (past the clients' own: they close first)
            # WebSocket handshakes reach the app as HTTP, which answers them with its 501
            # (with a WebSocket library installed, uvicorn would refuse them with a bare 403)
            ws="none",
        )
        logging.getLogger("uvicorn.error").addFilter(_grace_note)
        # (a restart on the same log directory meanwhile waits for this one: _log_dir_taken)
        gateway = app.state.gateway

        def stopping(running: int) -> None:
            gateway.stopping()
            _stopping(running)

        return Server(  # (the line once it accepts connections: a script may wait for it)
            config, on_stop=stopping, on_started=lambda: print(listening, file=sys.stderr)
        )

    return serve_until_stopped(sockets, server)


def _stopping(running: int) -> None:
    """Stopping: a restart on the same log directory meanwhile waits for this one
    (``mark_stopping``), and the terminal says what it waits for, if anything."""
    from proxy.eventlog import mark_stopping

    mark_stopping()
    if running:
        print(
            f"cachegate: stopping: {running} request(s) in flight have up to {SHUTDOWN_GRACE_S} s"
            " to finish (Ctrl+C again cuts them now)",
            file=sys.stderr,
        )


def _grace_note(record: logging.LogRecord) -> bool:
    """uvicorn's own line when the grace period runs out (``ERROR: Cancel 1 running task(s),
    timeout graceful shutdown exceeded``) read as a failure; it is the documented cut. Said in
    cachegate's words instead; any other record passes."""
    if isinstance(record.msg, str) and record.msg.startswith("Cancel %s running task"):
        count = record.args[0] if isinstance(record.args, tuple) and record.args else "some"
        if count == 0:  # (only connections left, their requests not begun: nothing was cut)
            return False
        # (a closed terminal's stderr fails with EIO: raised in a filter, it stopped uvicorn's
        # shutdown before it cut the requests, and the process exited 1)
        with contextlib.suppress(OSError, ValueError):
            print(
                f"cachegate: stopping: {count} request(s) still in flight after the"
                f" {SHUTDOWN_GRACE_S} s grace period were cut (a stream ends short, a request"
                " not answered yet gets a 503)",
                file=sys.stderr,
            )
        return False
    return True


def _file_model_names(config_file: str | None) -> frozenset[str]:
    """The ``[models."…"]`` tables a config file (read already, and valid) names."""
    if not config_file:
        return frozenset()
    import tomllib

    try:
        with open(config_file, "rb") as fh:
            data = tomllib.loads(fh.read().decode("utf-8").removeprefix("\ufeff"))
    except (OSError, ValueError):
        return frozenset()
    models = data.get("models")
    return frozenset(models) if isinstance(models, dict) else frozenset()


def _bound(host: str, port: int, prog: str) -> list[socket.socket] | None:
    """Sockets listening on ``host:port``; None, once the reason is said in one line (a port in
    use), when they cannot be bound."""
    from proxy.serving import listening_sockets

    try:
        return listening_sockets(host, port)
    except OSError as exc:
        where = f"{url_host(host)}:{port}"
        print(f"{prog}: cannot listen on {where}: {exc.strerror or exc}", file=sys.stderr)
        return None


def _simulate(ns: argparse.Namespace) -> int:
    from proxy.simulator import cli as sim_cli

    try:
        config = sim_cli.config_from_args(ns)
    except ValueError as exc:  # named as the flag that set it: fault_rate -> --fault-rate
        message = str(exc)
        for flag in sim_cli.flags():
            name = re.escape(flag.lstrip("-").replace("-", "_"))
            message = re.sub(rf"(?<![\w-]){name}(?!\w)", flag, message)
        print(f"cachegate simulate: {message}", file=sys.stderr)
        return 2
    problem = host_problem(ns.host, port="--port")  # (as serve's server.host)
    if problem is not None:
        print(f"cachegate simulate: --host: {problem}", file=sys.stderr)
        return 2
    sockets = _bound(ns.host, ns.port, "cachegate simulate")  # in use: one line, as for serve
    if sockets is None:
        return 1
    return sim_cli.serve(config, ns.host, ns.port, sockets)


def _demo(ns: argparse.Namespace) -> int:
    from proxy.demo import run_demo

    if ns.log_dir is not None and not ns.log_dir.strip():  # (as serve and sessions refuse it)
        print(
            "cachegate: --log-dir: empty; give the directory for the demo's logs, or leave the"
            " flag out for a temporary one",
            file=sys.stderr,
        )
        return 2
    log_dir = os.path.expanduser(ns.log_dir) if ns.log_dir else None
    if log_dir and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        print(f"cachegate: log directory {log_dir!r} is not a directory", file=sys.stderr)
        return 1
    if log_dir:
        from proxy.eventlog import log_dir_problem

        problem = log_dir_problem(log_dir)  # (four scenarios played for nothing, ~20 s)
        if problem is not None:
            print(f"cachegate: {problem}", file=sys.stderr)
            return 1
    if log_dir and _log_dir_taken(log_dir):
        return 1
    _utf8_stdout()  # (its excerpts end in "…")
    return run_demo(log_dir=log_dir, out=sys.stdout)


def _log_dir_taken(log_dir: str) -> bool:
    """Claim ``log_dir`` for this process (``claim_log_dir``); True, once said in one line, when
    another cachegate writes it."""
    from proxy.eventlog import STOPPING, UNKNOWN_HOLDER, UnsafeLockFile, claim_log_dir

    try:
        holder = claim_log_dir(log_dir)
    except UnsafeLockFile as exc:
        print(f"cachegate: log directory {log_dir}: {exc}", file=sys.stderr)
        return True
    if holder is not None and (holder.endswith(STOPPING) or holder == UNKNOWN_HOLDER):
        # A restart: the cachegate before this one is stopping, its answers in flight finishing
        # (SHUTDOWN_GRACE_S) and its log written. Wait for it, rather than refuse a user who
        # did "stop; start", or send them to another directory (a session's log then in two).
        # One that wrote no pid (its disk full when it started, and when it stopped) may be
        # stopping too: waited for as long.
        pid = holder.removesuffix(STOPPING).strip()
        print(
            f"cachegate: waiting for the cachegate that is stopping (pid {pid}) to finish"
            f" writing log directory {log_dir}"
            if pid != UNKNOWN_HOLDER
            else f"cachegate: log directory {log_dir} is held by a cachegate that wrote no pid"
            " in its lock file (its disk full?): waiting for it, in case it is stopping",
            file=sys.stderr,
        )
        deadline = time.monotonic() + SHUTDOWN_GRACE_S + STOPPING_WAIT_S
        while (
            holder is not None
            and (holder.endswith(STOPPING) or holder == UNKNOWN_HOLDER)
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
            try:
                holder = claim_log_dir(log_dir)
            except UnsafeLockFile as exc:
                print(f"cachegate: log directory {log_dir}: {exc}", file=sys.stderr)
                return True
    if holder is None:
        return False
    pid = holder.removesuffix(STOPPING).strip()
    if pid == UNKNOWN_HOLDER:
        print(
            f"cachegate: log directory {log_dir} is still held by a cachegate that wrote no pid"
            " in its lock file (its disk full?); stop it, or start this one once it has exited",
            file=sys.stderr,
        )
    elif holder.endswith(STOPPING):
        print(
            f"cachegate: log directory {log_dir} is still being written by the cachegate that"
            f" is stopping (pid {pid}); start this one once it has exited",
            file=sys.stderr,
        )
    else:
        print(
            f"cachegate: log directory {log_dir} is being written by another cachegate "
            f"(pid {pid}); give this one its own --log-dir",
            file=sys.stderr,
        )
    return True


def _utf8_stdout() -> None:
    """Reports, replayed requests and the demo in UTF-8 where stdout is a file or a pipe in
    another encoding (Windows' ANSI code page, a Latin-1 locale: one character it lacks failed
    the whole output); on a terminal in such an encoding, a character it lacks is shown as
    ``?`` (it failed the command with UnicodeEncodeError)."""
    out = sys.stdout
    if (
        isinstance(out, io.TextIOWrapper)
        and out.encoding.lower().replace("-", "").replace("_", "") != "utf8"
    ):
        if out.isatty():
            out.reconfigure(errors="replace")
        else:
            out.reconfigure(encoding="utf-8")


def _sessions(ns: argparse.Namespace) -> int:
    from proxy import report
    from proxy.eventlog import lost_requests
    from proxy.listmemo import SummaryMemo
    from proxy.redact import REDACTED

    _utf8_stdout()
    if ns.log_dir is not None and not ns.log_dir.strip():  # (as serve refuses it: a script's
        # unset variable, --log-dir "$DIR", must not read the default directory's logs instead)
        print(
            "cachegate: --log-dir: empty; give the directory serve writes, or leave the flag out",
            file=sys.stderr,
        )
        return 2
    log_dir = ns.log_dir or os.environ.get("CACHEGATE_LOG_DIR")
    config_file = getattr(ns, "config", None)
    for name, used in (
        ("CACHEGATE_LOG_DIR", not ns.log_dir),
        ("CACHEGATE_CONFIG", not log_dir and config_file is None),
    ):
        value = os.environ.get(name)
        if used and value and not value.strip():  # (as serve refuses it; empty is unset)
            print(f"cachegate: {name}: only spaces; give a path, or unset it", file=sys.stderr)
            return 2
    if config_file is not None and not config_file.strip():  # (as serve refuses it)
        print(
            "cachegate: --config: empty; give a TOML file, or leave the flag out", file=sys.stderr
        )
        return 2
    config_file = config_file or os.environ.get("CACHEGATE_CONFIG")
    source = "--log-dir" if ns.log_dir else "CACHEGATE_LOG_DIR" if log_dir else "the default"
    if not log_dir and config_file:  # the directory serve writes with that file
        try:
            # (the file alone: CACHEGATE_LOG_DIR is unset here, and the other variables, a
            # CACHEGATE_PORT=abc say, are serve's to judge; so are what serve's flags set, a
            # file's `port = 0` that its --port replaces)
            beside = {"host": "127.0.0.1", "port": 8787, "upstream": "http://127.0.0.1/v1"}
            log_dir = load_settings(config_file, beside, environ={}).logging.dir
        except ConfigError as exc:
            print(f"cachegate: {exc}", file=sys.stderr)
            return 2
        # (the file named where it sets the directory, the default's own value too)
        source = f"config file {config_file}" if _sets_log_dir(config_file) else "the default"
    log_dir = os.path.expanduser(log_dir or DEFAULT_LOG_DIR)
    try:
        if ns.action == "list":
            unreadable: list[tuple[str, str]] = []
            since = time.time() - ns.since if ns.since is not None else None
            memo = SummaryMemo.load(log_dir)
            sessions = report.list_sessions(
                log_dir, unreadable, since=since, limit=ns.limit, memo=memo
            )
            for path, reason in unreadable:  # (the others are listed: one file must not hide them)
                hint = (
                    "; log files are private to the user that wrote them: run as that user"
                    if reason == "permission denied"
                    else ""
                )
                print(f"cachegate: cannot read {path}: {reason} (left out{hint})", file=sys.stderr)
            if ns.json:
                print(json.dumps([s.to_json() for s in sessions], indent=2))
            elif not sessions and ns.since is not None:  # (not an empty directory: say why)
                print(f"no sessions written in the last {_age(ns.since)}")
            else:
                print(report.terminal_safe(report.render_list(sessions)))
            memo.save()  # (after the listing: the memo only ever saves time)
        elif ns.action == "show":
            detail = report.show_session(log_dir, ns.id)
            print(
                json.dumps(detail.to_json(), indent=2)
                if ns.json
                else report.terminal_safe(report.render_show(detail))
            )
        elif ns.action == "cost":
            cost = report.session_cost(log_dir, ns.id)
            print(
                json.dumps(cost.to_json(), indent=2)
                if ns.json
                else report.terminal_safe(report.render_cost(cost))
            )
        elif ns.action == "replay":
            requests, skipped, read = report.replayed_whole(log_dir, ns.id)
            torn = read.torn_requests
            redacted = 0
            metadata = False
            for request in requests:  # (each written as it is rebuilt: not all held at once)
                if not metadata and report.metadata_only(request):
                    metadata = True
                    print(
                        'cachegate: this log was written with logging.bodies = "metadata": it'
                        " keeps sizes and hashes, not the text; these lines cannot be sent again",
                        file=sys.stderr,
                    )
                for line in report.request_lines((request,)):
                    redacted += REDACTED in line
                    sys.stdout.write(report.json_terminal_safe(line) + "\n")
            if redacted:  # (the JSON is the body sent but for them: said, not an error)
                sys.stdout.flush()
                print(
                    f"cachegate: {redacted} request{'s' if redacted != 1 else ''} hold"
                    f"{'' if redacted != 1 else 's'} {REDACTED}: where the log took out a secret"
                    " (logging.redact_secrets), sent again it is not what was sent (where the"
                    " client sent that text itself, it is)",
                    file=sys.stderr,
                )
            lost = lost_requests(read.events)  # (a lost response line loses no request)
            if skipped or torn or lost:  # a script re-sending the session must not take it
                sys.stdout.flush()  # for the whole
                if lost:
                    print(
                        f"cachegate: {lost} request line{'s' if lost != 1 else ''} of this"
                        " session could not be written to its log (a full disk, a write error,"
                        " a full queue): the output is not the whole session",
                        file=sys.stderr,
                    )
                if skipped:
                    n = len(skipped)
                    print(
                        f"cachegate: {n} request{'s' if n != 1 else ''} could not be rebuilt"
                        " (malformed, or built on a line that was torn, lost or malformed): the"
                        " output is not the whole session",
                        file=sys.stderr,
                    )
                if torn:
                    said = (
                        "its last line has no end yet (being written as it was read, or cut by"
                        " a crash) and holds a request, or cannot say"
                        if torn == 1 and read.torn_at_end
                        else f"{torn} line{'s' if torn != 1 else ''} of the log"
                        f" {'were' if torn != 1 else 'was'} torn (a crash while writing) and"
                        " held a request, or cannot say"
                    )
                    print(
                        f"cachegate: {said}: not replayed; the output may not be the whole session",
                        file=sys.stderr,
                    )
                return 1
        sys.stdout.flush()  # (a write error here, not at exit where nothing reports it)
    except (ValueError, FileNotFoundError, NotADirectoryError) as exc:
        where = ""
        if (
            isinstance(exc, FileNotFoundError)
            and not os.path.isabs(log_dir)
            and not os.path.isdir(log_dir)  # (not a session that is not there)
        ):
            # (serve resolves a relative directory from where it runs, not from its config file)
            where = (
                f" (from {source}: a relative directory is taken from the current one,"
                f" {os.getcwd()}; run from where cachegate serve runs"
                + (")" if source == "--log-dir" else ", or give --log-dir)")
            )
        print(f"cachegate: {exc}{where}", file=sys.stderr)
        return 1
    except PermissionError as exc:  # a log directory written by another user (a container's)
        print(
            f"cachegate: cannot read {exc.filename or log_dir}: permission denied "
            "(log files are private to the user that wrote them: run as that user)",
            file=sys.stderr,
        )
        return 1
    except BrokenPipeError:
        raise  # `| head`: main ends quietly
    except OSError as exc:  # a socket named like a log, an I/O error, stdout on a full disk
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"cachegate: {where}{exc.strerror or exc}", file=sys.stderr)
        if exc.filename is None:  # stdout's
            _stdout_to_null()
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cachegate",
        description="OpenAI-compatible local proxy for LLM agents.",
    )
    parser.add_argument("--version", action="version", version=f"cachegate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", help="TOML config file (env CACHEGATE_CONFIG)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1; env CACHEGATE_HOST)")
    serve.add_argument("--port", help="port (default 8787; env CACHEGATE_PORT)")
    serve.add_argument(
        "--upstream",
        help="upstream base URL, e.g. https://api.openai.com/v1 (env CACHEGATE_UPSTREAM)",
    )
    serve.add_argument("--log-dir", help="session log directory (env CACHEGATE_LOG_DIR)")
    serve.add_argument(
        "--strict-pairing",
        action="store_true",
        default=None,
        help="refuse broken tool pairing with a diagnosis instead of repairing (env CACHEGATE_STRICT_PAIRING)",
    )
    serve.set_defaults(func=_serve)

    simulate = sub.add_parser("simulate", help="run the offline provider simulator")
    from proxy.simulator import cli as sim_cli

    sim_cli.add_arguments(simulate)
    simulate.set_defaults(func=_simulate)

    demo = sub.add_parser("demo", help="simulator + proxy + scripted agent scenarios, offline")
    demo.add_argument(
        "--log-dir", default=None, help="where the demo's session logs go (default: a temp dir)"
    )
    demo.set_defaults(func=_demo)

    sessions = sub.add_parser("sessions", help="read the session audit logs")
    sessions.add_argument(
        "--log-dir",
        default=None,
        help=f"log directory (default {DEFAULT_LOG_DIR}; env CACHEGATE_LOG_DIR)",
    )
    sessions.add_argument(
        "--config",
        default=None,
        help="TOML config file whose logging.dir to read (env CACHEGATE_CONFIG)",
    )
    sessions.add_argument("--json", action="store_true", help="machine-readable output")
    actions = sessions.add_subparsers(dest="action", required=True)
    listing = actions.add_parser(
        "list", help="every session: exchanges, tokens, cache hit %%, repairs"
    )
    listing.add_argument(
        "--since",
        type=_duration,
        default=None,
        metavar="AGE",
        help="only the sessions whose log was written in the last AGE (90s, 30m, 2h, 7d, or"
        " seconds)",
    )
    listing.add_argument(
        "--limit",
        type=_positive_int,
        default=None,
        metavar="N",
        help="only the N sessions whose logs were written last",
    )
    for name, text in (
        ("show", "one line per exchange"),
        ("cost", "actual, uncached and saved cost; waste by cause"),
        ("replay", "every request's full message list as forwarded, one JSON object per line"),
    ):
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument("id", help="the session id (its log is <log dir>/<id>.jsonl)")
    actions.choices["list"].description = (
        "The sessions in the log directory, latest first (all of them, unless --since or --limit"
        " is given)."
    )
    for action in actions.choices.values():  # also after the action, as a user types them
        action.add_argument(
            "--log-dir",
            default=argparse.SUPPRESS,
            help=f"log directory (default {DEFAULT_LOG_DIR}; env CACHEGATE_LOG_DIR)",
        )
        action.add_argument(
            "--config",
            default=argparse.SUPPRESS,
            help="TOML config file whose logging.dir to read (env CACHEGATE_CONFIG)",
        )
        action.add_argument(
            "--json",
            action="store_true",
            default=argparse.SUPPRESS,
            help="machine-readable output (replay's is JSON lines either way)",
        )
    sessions.set_defaults(func=_sessions)
    _own_errors(parser)
    return parser


def _own_errors(parser: argparse.ArgumentParser) -> None:
    """Each subcommand's parser its own: an argument it does not know (``cachegate serve
    --logdir x``) is said with its usage, not the top level's, which shows none of its
    options (``main``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.set_defaults(_parser=child)
                _own_errors(child)


# An endpoint's path, pasted with the base URL (a provider's page shows the whole URL)
_ENDPOINTS: Final = ("/chat/completions", "/completions", "/responses", "/embeddings", "/messages")
_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _duration(text: str) -> float:
    """Seconds from ``90s``, ``30m``, ``2h``, ``7d`` or a plain number of seconds."""
    value = text.strip().lower()
    unit = _UNITS.get(value[-1:], None)
    number = value[:-1] if unit is not None else value
    try:
        seconds = float(number) * (unit or 1.0) if NUMBER_TEXT.fullmatch(number) else -1.0
    except ValueError:
        seconds = -1.0
    if not (0 <= seconds < float("inf")):
        raise argparse.ArgumentTypeError(
            f"expected an age such as 90s, 30m, 2h or 7d, got {text!r}"
        )
    return seconds


def _age(seconds: float) -> str:
    """``seconds`` as ``--since`` takes it: ``7d``, ``2h``, ``30m``, ``90s``."""
    for unit in "dhm":
        if seconds >= _UNITS[unit] and seconds % _UNITS[unit] == 0:
            return f"{_number(seconds / _UNITS[unit])}{unit}"
    return f"{_number(seconds)}s"


def _number(value: float) -> str:
    """``value`` as written: whole numbers as integers (``1234567``, where ``:g`` wrote
    ``1.23457e+06``), others to the digits a float holds."""
    return str(int(value)) if value.is_integer() else f"{value:.15g}"


def _positive_int(text: str) -> int:
    try:
        value = int(text) if INTEGER_TEXT.fullmatch(text) else 0
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {text!r}")
    return value


def _sets_log_dir(config_file: str) -> bool:
    """Whether the TOML file ``config_file`` (read already, and valid) sets ``logging.dir``."""
    try:
        with open(config_file, "rb") as file:
            raw = file.read().decode("utf-8").removeprefix("\ufeff")  # (as the config reads it)
        logging_table = tomllib.loads(raw).get("logging")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return isinstance(logging_table, dict) and "dir" in logging_table


def _dash_id(argv: list[str]) -> list[str]:
    """``sessions show -abc`` read as ``sessions show -- -abc``: a session id may start with a
    dash (the server accepts ``X-Session-Id: -abc``), which argparse would take for an unknown
    option. After ``show``, ``cost`` or ``replay``, a word with one leading dash that is no
    option of theirs is that id (``--…`` stays an option: a mistyped ``--jsn`` is refused), and
    so is the word after a ``--``, options after it read as options
    (``show -- -abc --log-dir DIR``). The id is passed in its place, marked (``_DASH_ID``),
    so that a word too many is the one argparse names (``unrecognized arguments: extra``, not
    the id); ``main`` takes the mark off."""
    if not argv or argv[0] != "sessions":
        return argv
    action: str | None = None
    skip = named = False  # (named: the id came already; a word after it is one too many)
    for at, word in enumerate(argv[1:], 1):
        if skip:  # the value of --log-dir or --config
            skip = False
        elif word == "--":
            if action is not None and not named and at + 1 < len(argv):
                return [*argv[:at], _DASH_ID + argv[at + 1], *argv[at + 2 :]]
            break
        elif len(word) > 2 and ("--log-dir".startswith(word) or "--config".startswith(word)):
            skip = True  # (argparse takes --conf, --log: unique prefixes)
        elif action is None and not word.startswith("-"):
            action = word
            if action not in ("show", "cost", "replay"):
                break
        elif action is not None and not word.startswith("-"):
            named = True
        elif (
            action is not None
            and not named
            and word.startswith("-")
            and word[:2] != "--"
            and word != "-h"
        ):
            return [*argv[:at], _DASH_ID + word, *argv[at + 1 :]]
    return argv


_DASH_ID: Final = "\x00"  # (marks an id ``_dash_id`` passed: no word a shell passes holds it)


def _stdout_to_null() -> None:
    """Standard output failed (a full disk): what it still holds goes nowhere, not at exit
    (where the interpreter's own flush failed again, a traceback-like line and exit 120)."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _closed_streams_to_null() -> None:
    """A standard stream the shell closed (``cachegate serve >&-``) is None in Python: uvicorn's
    log set-up then failed on it (a traceback, nothing served, no demo logs written). Such a
    stream is opened on the null device: what would go there goes nowhere."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 (for the process's life)


def main(argv: Sequence[str] | None = None) -> int:
    _closed_streams_to_null()
    try:
        parser = build_parser()  # (imports most of cachegate: Ctrl+C may come meanwhile)
        ns, unknown = parser.parse_known_args(
            _dash_id(list(sys.argv[1:] if argv is None else argv))
        )
        if unknown:  # (said by the subcommand's parser, with its usage: ``_own_errors``)
            getattr(ns, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
        if isinstance(getattr(ns, "id", None), str) and ns.id.startswith(_DASH_ID):
            ns.id = ns.id[len(_DASH_ID) :]
        return int(ns.func(ns))
    except BrokenPipeError:  # `cachegate sessions show … | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:  # Ctrl+C before serve or simulate were up: no traceback
        return 130
    except SystemExit:  # --version, --help: said on a standard output that may not take it
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            sys.stderr.close()
        except OSError as exc:  # (a full disk: exit 0 said nothing of the lost text)
            print(f"cachegate: {exc.strerror or exc}", file=sys.stderr)
            _stdout_to_null()
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
