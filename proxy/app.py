"""The Starlette app factory: routes, the lifespan (one pooled upstream client, the log writer)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping
from typing import Any, Final
from urllib.parse import quote, unquote

import httpx
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive as ASGIReceive
from starlette.types import Scope as ASGIScope
from starlette.types import Send as ASGISend

from proxy import __version__, bodymemo, pairing, respairing
from proxy.browser import BrowserGuard
from proxy.chat import (
    ChatPipeline,
    dump_body,
    header_map,
    internal_error,
    lenient_json,
    request_headers,
    retry_count,
)
from proxy.compactor import Compactor
from proxy.config import Settings, strict_pairing
from proxy.errors import (
    CLIENT_CLOSED,
    ProxyError,
    bad_request,
    body_cut,
    client_closed,
    http_date,
    shutting_down,
    too_large,
    websocket_unsupported,
)
from proxy.eventlog import EventLogWriter, enforce_retention
from proxy.metrics import Metrics, MetricsObserver
from proxy.observers import AccountingObserver, EventLogObserver
from proxy.pipeline import Exchange, Observer, notify
from proxy.redact import placeholder_key
from proxy.relay import (
    DisconnectWatch,
    Receive,
    Relay,
    Scope,
    Send,
    UpstreamAborted,
    decoded_answer,
    decoded_request,
    read_body,
    refuse_announced,
    send_error,
    upstream_request_headers,
)
from proxy.sessions import (
    MemorySessionStore,
    SessionState,
    anchor_of,
    explicit_session_id,
    extra_parts,
    is_own_key,
    never_an_id,
    reads_as_key,
    valid_session_id,
)
from proxy.upstream import SizedStream, UpstreamPool, ssl_context

log = logging.getLogger(__name__)

# How long a stop waits for the event log's writer to write what is queued (a backlog is at
# most ``eventlog.MAX_QUEUE_BYTES`` of request bodies: ~10 s of the secret scan at its slowest)
WRITER_DRAIN_S: Final = 30.0


class _AbortFilter(logging.Filter):
    """uvicorn logs an application error when cachegate cuts a client off because the upstream did,
    or when a shutdown cancels a stream; both are intended, not bugs worth a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        for _ in range(8):  # the abort may be wrapped by middleware
            if exc is None:
                return True
            if isinstance(exc, UpstreamAborted | asyncio.CancelledError):
                return False  # cut off by the upstream, or by a shutdown: not a bug
            exc = exc.__cause__ or exc.__context__
        return True


class _UpgradeFilter(logging.Filter):
    """uvicorn warns of a WebSocket upgrade it cannot make and suggests installing a WebSocket
    library; cachegate answers such a request itself (``websocket_unsupported``), and a library
    would not help: the warning only misleads."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        return not message.startswith(("Unsupported upgrade request", "No supported WebSocket"))


logging.getLogger("uvicorn.error").addFilter(_AbortFilter())
logging.getLogger("uvicorn.error").addFilter(_UpgradeFilter())


def build_transport(
    settings: Settings, transport: httpx.AsyncBaseTransport | None
) -> httpx.AsyncBaseTransport | UpstreamPool:
    """The one pooled upstream transport (a test may inject its own)."""
    if transport is not None:
        return transport
    up = settings.upstream
    # The CAs of an https upstream are loaded once, here (a stale SSL_CERT_FILE fails the start,
    # as the CLI says before it: not every request, as an invalid answer); only for one, so
    # that a stale SSL_CERT_FILE does not stop a plain-HTTP upstream's server from starting.
    # (Not httpx's own reading of the environment: that would take proxies from it too.)
    tls = ssl_context() if up.base_url.lower().startswith("https:") else None
    if up.transport == "native":
        return UpstreamPool(
            ssl_context=tls,
            max_connections=up.max_connections,
            max_keepalive=up.max_keepalive_connections,
            keepalive_expiry=30.0,
            connect_timeout=up.connect_timeout_s,
            read_timeout=up.timeout_s,
        )
    limits = httpx.Limits(
        max_connections=up.max_connections,
        max_keepalive_connections=up.max_keepalive_connections,
        keepalive_expiry=30.0,
    )
    if tls is not None:
        return httpx.AsyncHTTPTransport(limits=limits, trust_env=False, verify=tls)
    return httpx.AsyncHTTPTransport(limits=limits, trust_env=False)


def build_timeout(settings: Settings) -> httpx.Timeout:
    up = settings.upstream
    return httpx.Timeout(up.timeout_s, connect=up.connect_timeout_s, pool=up.timeout_s)


class Gateway:
    """Everything one cachegate process holds; the ASGI endpoints delegate here."""

    def __init__(
        self,
        settings: Settings,
        *,
        transport: httpx.AsyncBaseTransport | None,
        registry: CollectorRegistry,
        clock: Callable[[], float],
        environ: Mapping[str, str],
    ) -> None:
        self.settings = settings
        self.transport = transport
        self.registry = registry
        self.clock = clock
        key_env = settings.upstream.api_key_env
        # The key added to requests without one, read once: the log writer never writes it.
        self._api_key: str | None = environ.get(key_env) if key_env else None
        # (the placeholder given as the key, ``OPENAI_API_KEY=cachegate`` in cachegate's own
        # shell, which ``serve`` notes: no secret, never taken out of the log's text, nor
        # refused in a session's id, ``cachegate-dev``)
        secrets = [] if placeholder_key(self._api_key) else [self._api_key or ""]
        for key in secrets:
            never_an_id(key)  # (nor a session's id: a log file's name would show it)
        self.metrics = Metrics(registry, settings.models.keys())
        ss = settings.sessions
        self.sessions = MemorySessionStore(
            max_sessions=ss.max_sessions,
            idle_ttl_s=ss.idle_ttl_s,
            max_bytes=ss.max_memory_mb * 1024 * 1024,
            on_evict=self.metrics.observe_session_eviction,
        )
        self.writer: EventLogWriter | None = None
        self.observers: list[Observer] = [
            AccountingObserver(settings, self.sessions, self.metrics, secrets)
        ]
        if settings.logging.enabled:
            lg = settings.logging
            self.writer = EventLogWriter(
                lg.dir,
                fsync=lg.fsync,
                max_queue=lg.queue_size,
                bodies=lg.bodies,
                redact_secrets=lg.redact_secrets,
                on_loss=self._log_loss,
                secrets=secrets,
                metas_kept=min(max(settings.sessions.max_sessions, 4096), 100_000),
            )
            self.observers.append(EventLogObserver(settings, self.sessions, self.writer, clock))
        self.observers.append(MetricsObserver(self.metrics))
        self._retention: asyncio.Task[None] | None = None
        self._started_at = time.time()  # (again in start: files written before it are another's)
        self.upstream: httpx.AsyncBaseTransport | UpstreamPool | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.relay: Relay | None = None
        self.chat: ChatPipeline | None = None
        # A Responses API answer's id -> its session: a request that continues that stored
        # response (``previous_response_id``) is of the same session (its ``input`` holds only
        # what is new: no history to find the session by)
        self._response_sessions: collections.OrderedDict[str, str] = collections.OrderedDict()
        # The calls of the Responses API answers relayed, by response id (``_remember_calls``):
        # a request that continues one must answer them (``_responses_body``)
        self._response_calls: collections.OrderedDict[str, tuple[dict[str, str], ...]] = (
            collections.OrderedDict()
        )
        # The Responses API answers whose stream the client cut: what calls the provider stored
        # for them is asked of it when a request continues one (``_learn_stored_calls``)
        self._cut_responses: collections.OrderedDict[str, None] = collections.OrderedDict()

    def api_key(self) -> str | None:
        """The configured key, read from the environment once (when the app was built)."""
        return self._api_key

    def _log_loss(self, kind: str) -> None:
        self.metrics.observe_log_loss("queue_full" if kind == "queue_full" else "write_error")

    async def start(self) -> None:
        self._started_at = time.time()
        self.loop = asyncio.get_running_loop()
        self.upstream = build_transport(self.settings, self.transport)
        self.relay = Relay(
            self.upstream, self.settings.upstream.base_url, build_timeout(self.settings)
        )
        compactor = None
        if self.settings.compaction.enabled:
            logging_on = self.settings.logging.enabled
            compactor = Compactor(
                self.settings,
                self.relay,
                self.observers,
                self.sessions,
                log_dir=self.settings.logging.dir if logging_on else None,
                flush_log=self.writer.flush_session if self.writer is not None else None,
            )
        self.chat = ChatPipeline(
            self.settings,
            self.relay,
            self.sessions,
            self.observers,
            api_key=self.api_key,
            clock=self.clock,
            on_strict_rejection=self.metrics.observe_strict_rejection,
            compactor=compactor,
        )
        self.sessions.on_forget = self.chat.forget_bodies
        if self.writer is not None:
            self.writer.start()
            lg = self.settings.logging
            if lg.max_age_days or lg.max_total_mb:
                self._retention = asyncio.get_running_loop().create_task(self._enforce_retention())

    def forget_idle(self) -> None:
        """Forget the sessions idle past ``sessions.idle_ttl_s`` now, and the bodies kept for
        their next turns."""
        now = self.clock()
        self.sessions.forget_idle(now)
        if self.chat is not None:
            self.chat.memos.forget_idle(now)

    def _live_session(self, session_id: str) -> bool:
        """Whether a session is held now (asked by retention's thread before each deletion)."""
        writer = self.writer
        return self.sessions.holds(session_id) or (
            writer is not None and writer.holds_open(session_id)
        )

    async def _enforce_retention(self) -> None:
        """Hourly (and at start): delete whole old log files, never one being written."""
        while True:
            await self.retain_once()
            await asyncio.sleep(3600)

    async def retain_once(self) -> None:
        """One pass of the log retention (``logging.max_age_days``, ``logging.max_total_mb``)."""
        lg = self.settings.logging
        # (sessions idle past sessions.idle_ttl_s are forgotten first, as a scrape or the next
        # request would: on a quiet server they were held, their files kept, for good)
        self.forget_idle()
        active = set(self.sessions.active_ids())
        if self.writer is not None:
            active |= self.writer.open_sessions()
        try:
            removed = await asyncio.to_thread(
                enforce_retention,
                lg.dir,
                max_age_days=lg.max_age_days or None,
                max_total_mb=lg.max_total_mb or None,
                active=active,
                now=time.time(),
                previous=(self._started_at, self.settings.sessions.idle_ttl_s),
                live=self._live_session,
            )
            if removed:
                log.info("retention removed %d old session logs", len(removed))
        except Exception:
            log.exception("log retention failed")

    def stopping(self) -> None:
        """Cachegate begins to stop (the server's shutdown, before its grace period): what is
        cut from now on is said as the shutdown's."""
        if self.chat is not None and self.chat.compactor is not None:
            self.chat.compactor.stopping = True

    async def stop(self) -> None:
        if self._retention is not None:
            self._retention.cancel()
        # Exchanges cut off by the shutdown still log their responses: let them finish first.
        if self.chat is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.chat.idle.wait(), 3.0)
            if self.chat.compactor is not None:  # summaries kept for a client that left
                await self.chat.compactor.stop()
        if self.writer is not None:
            lines, weight = self.writer.backlog
            if lines >= 1000 or weight >= 4 * 1024 * 1024:  # (a writer behind a burst: the
                print(  # wait is said, not taken for a hang)
                    f"cachegate: stopping: writing {lines} queued log line(s) (up to"
                    f" {WRITER_DRAIN_S:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            await asyncio.to_thread(self.writer.close, WRITER_DRAIN_S)
        if self.upstream is not None:
            await self.upstream.aclose()

    async def refuse(
        self,
        scope: Scope,
        send: Send,
        route: str,
        err: ProxyError,
        extra: list[tuple[bytes, bytes]] | None = None,
        receive: Receive | None = None,
    ) -> None:
        """Answer a request cachegate refuses before any route's work begins (an invalid session
        id or path), counted by the observers like every other answer: a request with no session
        is in the metrics, not in any session's log. ``receive``: the rest of a refused upload
        is read before the connection closes (``send_error``)."""
        self.count_refusal(scope, route, err)
        if route == "chat" and self._chat_pairing_on(scope):  # (as on every chat answer)
            extra = [*(extra or ()), (b"x-cachegate-repairs", b"0")]
        await send_error(send, err, extra, receive)

    def _chat_pairing_on(self, scope: Scope) -> bool:
        """Whether a chat request's answers say ``X-Cachegate-Repairs`` (``ChatHandler``'s
        rule: the repair or strict mode on, by the settings or the request's header)."""
        return self.settings.pairing.repair or strict_pairing(self.settings, header_map(scope))

    def count_refusal(self, scope: MutableMapping[str, Any], route: str, err: ProxyError) -> None:
        """Tell the observers of an answer cachegate gives itself before any route's work (the
        metrics count it; no session's log has it)."""
        headers = header_map(dict(scope))
        ex = Exchange(
            route=route,
            method=scope["method"],
            path="",
            started_at=self.clock(),
            t0=time.perf_counter(),
            user_agent=headers.get("user-agent", ""),
        )
        ex.status = err.status
        ex.error = err.message
        notify(self.observers, "on_error", ex)

    async def passthrough(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        path: str,
        path_session: str | None,
        responses: bool = False,
    ) -> None:
        """Relay any other /v1 request generically: method, query, headers, streamed bodies.
        ``responses``: a ``POST /v1/responses``, whose body is read whole for its tool pairing
        to be repaired (``_responses``) when the settings or its headers ask for that."""
        assert self.relay is not None
        headers = header_map(scope)
        route = "responses" if responses else "passthrough"  # (the metrics' label)
        ex = Exchange(
            route="passthrough",
            method=scope["method"],
            path=path,
            started_at=self.clock(),
            t0=time.perf_counter(),
            user_agent=headers.get("user-agent", ""),
            query=scope.get("query_string", b""),  # (a key in it: never in its log, as on chat)
        )
        extra: list[tuple[bytes, bytes]] = []
        try:
            sid = explicit_session_id(headers, path_session)
        except ValueError as exc:
            await self.refuse(scope, send, route, bad_request(str(exc), "invalid_session_id"))
            return
        if sid is not None:
            ex.session_id = sid
            extra.append((b"x-cachegate-session", sid.encode()))
        # A browser's CORS preflight carries no key, and asks for none: none is added to it
        preflight = scope["method"] == "OPTIONS" and "access-control-request-method" in headers
        try:
            forward_headers = upstream_request_headers(
                request_headers(scope), None if preflight else self.api_key()
            )
        except ProxyError as err:
            await self.refuse(scope, send, route, err)
            return
        # (the client's keys in them: never in its log, a refusal's before it is sent included)
        ex.upstream_headers = forward_headers
        strict = reads = False
        if responses:
            retry = headers.get("x-stainless-retry-count")  # (the SDK's retry, as on chat)
            if retry is not None:
                ex.client_retry = retry_count(retry)
            strict = strict_pairing(self.settings, headers)
            reads = strict or self.settings.pairing.repair
        if not reads:  # (a body read is refused there: in the log of a session it names)
            try:
                refuse_announced(headers, self.settings.server.max_body_bytes)
            except ProxyError as err:
                await self.refuse(scope, send, route, err, extra, receive)
                return
        if reads:
            assert self.chat is not None
            entered: list[SessionState] = []  # (its session, once found: at work until the end)
            with self.chat.at_work():  # (its observers run before the shutdown is done)
                try:
                    await self._responses(
                        ex,
                        scope,
                        receive,
                        send,
                        headers,
                        path_session,
                        forward_headers,
                        extra,
                        strict=strict,
                        entered=entered,
                    )
                finally:
                    for state in entered:
                        self.chat.leave(state)
            return
        first = await receive()
        if first["type"] == "http.disconnect":  # gone before its body's first byte: not sent
            cut = body_cut(scope, "client disconnected while sending the request")
            ex.status, ex.error = cut.status, cut.message
            ex.interrupted = cut.status == CLIENT_CLOSED  # (else the server refused its body)
            notify(self.observers, "on_error", ex)
            return
        body = first.get("body", b"")
        content: bytes | AsyncIterator[bytes]
        uploaded: asyncio.Event | None = None
        if first.get("more_body", False):
            limit = self.settings.server.max_body_bytes
            uploaded = asyncio.Event()  # from then on, a disconnect cancels the upstream request

            async def stream_body() -> AsyncIterator[bytes]:
                size = len(body)
                yield body
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise body_cut(scope, "client disconnected")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    more = message.get("more_body", False)
                    if size > limit:
                        raise too_large(limit, unread=more)
                    if not more:
                        uploaded.set()
                    yield chunk

            length = headers.get("content-length", "")
            # (uvicorn has read the length; the body arrives as announced, or the client left)
            content = (
                SizedStream(stream_body(), int(length))
                if length.isascii() and length.isdigit()
                else stream_body()
            )
        else:
            if len(body) > self.settings.server.max_body_bytes:
                limit = self.settings.server.max_body_bytes
                await self.refuse(scope, send, route, too_large(limit), extra)
                return
            content = body
        ex.request_bytes = len(body)
        await self._relay(
            ex, scope, receive, send, content, forward_headers, extra, uploaded, responses
        )

    async def _relay(
        self,
        ex: Exchange,
        scope: Scope,
        receive: Receive,
        send: Send,
        content: bytes | AsyncIterator[bytes],
        forward_headers: list[tuple[bytes, bytes]],
        extra: list[tuple[bytes, bytes]],
        uploaded: asyncio.Event | None = None,
        responses: bool = False,
    ) -> None:
        """Relay a request that is not chat's, the observers told before and after.
        ``responses``: a Responses API request, whose answer is read for its usage and model
        (``proxy.resanswers``) once the client has it."""
        assert self.relay is not None
        if ex.session_id is not None and ex.body is not None:
            # A Responses API request of a session: its log line (its items compared with the
            # session's earlier lines) is written while the upstream is asked, not before, as
            # the chat route's; before its response's, whatever comes first.
            asyncio.get_running_loop().call_soon(self._request_observers, ex)
        else:
            self._request_observers(ex)
        try:
            await self.relay.forward(
                ex,
                scope,
                receive,
                send,
                content=content,
                headers=forward_headers,
                extra_headers=extra,
                record=responses,
                responses=responses,
                watch_after=uploaded,
            )
        finally:
            self._request_observers(ex)
            if responses:
                ex.assemble()
                if ex.assembled is not None:
                    if ex.model is None:
                        ex.model = ex.assembled.model  # (the request's, where it was read)
                    if ex.session_id is not None and ex.assembled.id:
                        self._remember_response(ex.assembled.id, ex.session_id)
                    if ex.assembled.id and ex.assembled.message.get("tool_calls"):
                        self._remember_calls(ex.assembled.id, ex.assembled.message["tool_calls"])
                    if ex.assembled.id and ex.interrupted and ex.stream:
                        # (its client left mid-stream: the provider may have stored calls the
                        # client never saw, which its next turn must answer all the same)
                        cut = self._cut_responses
                        cut[ex.assembled.id] = None
                        if len(cut) > RESPONSE_CALLS_REMEMBERED:
                            cut.popitem(last=False)
            notify(self.observers, "on_response", ex)

    def _request_observers(self, ex: Exchange) -> None:
        """The request's observers, once."""
        if not ex.request_noted:
            ex.request_noted = True
            notify(self.observers, "on_request", ex)

    def _remember_response(self, response_id: str, session_id: str) -> None:
        held = self._response_sessions
        held[response_id] = session_id
        if len(held) > RESPONSES_REMEMBERED:
            held.popitem(last=False)

    def _remember_calls(self, response_id: str, calls: list[Any]) -> None:
        """Keep the function and custom tool calls of the answer ``response_id`` (the latest
        ``RESPONSE_CALLS_REMEMBERED`` answers that made any)."""
        kept = tuple(
            {
                "type": "custom_tool_call" if call.get("type") == "custom" else "function_call",
                "call_id": call["id"],
                "name": str((call.get("custom") or call.get("function") or {}).get("name") or ""),
            }
            for call in calls
            if isinstance(call, dict) and isinstance(call.get("id"), str) and call["id"]
        )
        if kept:
            held = self._response_calls
            held[response_id] = kept
            if len(held) > RESPONSE_CALLS_REMEMBERED:
                held.popitem(last=False)

    async def _learn_stored_calls(
        self, ex: Exchange, response_id: str, forward_headers: list[tuple[bytes, bytes]]
    ) -> None:
        """Ask the provider for the answer ``response_id``, whose stream its client cut, and
        keep its function and custom tool calls, as ``_remember_calls`` keeps those of an answer
        relayed whole: the client saw only the calls that came before it left (none, where it
        left at the first event), and the provider refuses a request that continues the answer
        without an output for each one it stored (``No tool output found …``) on every turn
        after. Asked once per answer (``GET /v1/responses/{id}``, with the client's key, for up
        to ``STORED_CALLS_TIMEOUT_S``); a failure leaves the calls relayed, as before."""
        assert self.relay is not None
        self._cut_responses.pop(response_id, None)
        if not _RESPONSE_ID.fullmatch(response_id):  # (it goes in a path: an id, nothing else)
            return
        headers = [(k, v) for k, v in forward_headers if k not in _NOT_FOR_A_GET]
        headers.append((b"accept", b"application/json"))
        url = self.relay.url("responses/" + response_id, ex.query)
        asked = time.perf_counter()
        try:
            try:
                async with asyncio.timeout(STORED_CALLS_TIMEOUT_S):
                    response = await self.relay.open("GET", url, headers, b"")
                    try:
                        body = decoded_answer(response, await response.aread())
                    finally:
                        await response.aclose()
            finally:  # (the provider's time, not cachegate's overhead)
                ex.upstream_wait_s += time.perf_counter() - asked
            answer = orjson.loads(body) if response.status_code == 200 else None
        except Exception as exc:  # (unreachable, too slow, no JSON: what was relayed stands)
            log.info(
                "could not ask the upstream for the calls of the Responses API answer whose"
                " stream its client cut (%s): its next turn is paired on the calls relayed",
                type(exc).__name__,
            )
            return
        output = answer.get("output") if isinstance(answer, dict) else None
        if not isinstance(output, list):
            if response.status_code != 200:
                log.info(
                    "the upstream answered %d when asked for the Responses API answer whose"
                    " stream its client cut: its next turn is paired on the calls relayed",
                    response.status_code,
                )
            return
        calls = []  # (in the shape ``_remember_calls`` reads: a chat message's calls)
        for item in output:
            if (
                isinstance(item, dict)
                and item.get("type") in ("function_call", "custom_tool_call")
                and isinstance(item.get("call_id"), str)
            ):
                kind = "custom" if item["type"] == "custom_tool_call" else "function"
                calls.append(
                    {"id": item["call_id"], "type": kind, kind: {"name": item.get("name")}}
                )
        if calls:
            self._remember_calls(response_id, calls)

    def _responses_session(
        self,
        ex: Exchange,
        body: dict[str, Any],
        size: int,
        headers: Mapping[str, str],
        path_session: str | None,
        memo: tuple[str, bytes, bodymemo.Parsed] | None = None,
    ) -> SessionState:
        """A Responses API request's session, as a chat request's is found (an explicit id,
        else the session whose last request its ``input`` items carry on, else a new one), and
        its exchange numbered in it. A request that continues what the provider stores (a
        ``conversation``, a ``previous_response_id``) carries only its new items: it is of the
        conversation's session (the conversation's id is the session's), or of the session
        that made the response it continues; neither finds another by its items, nor is found.
        ``size``: the body's, decoded (what its parse holds, for the sessions' memory budget).
        ``memo``: where its parse is filed, its bytes and parse, for the next turn to splice onto
        (``ChatPipeline.remember_body``)."""
        assert self.chat is not None
        now = self.clock()
        named: str | None = None
        whole = True
        conversation = body.get("conversation")
        if isinstance(conversation, dict):
            conversation = conversation.get("id")
        if conversation is not None:
            whole = False
            if (
                valid_session_id(conversation)
                and not reads_as_key(conversation)
                and not is_own_key(conversation, headers)
            ):
                named = conversation  # (one that reads as a key names no log file: passed over)
        previous = body.get("previous_response_id")
        if isinstance(previous, str) and previous:
            whole = False
            named = named or self._response_sessions.get(previous)
        spliced = memo is not None and memo[2].source is not None
        state, shared = self.chat.resolve_session(
            headers, path_session, body, now, key="input", named=named, whole=whole, spliced=spliced
        )
        if memo is not None:  # (its items as the session now holds them: shared with the last)
            self.chat.remember_body(memo[0], memo[1], body, memo[2], now, state, "input")
        items = body.get("input")
        count = len(items) if isinstance(items, list) else 0
        new = (size * (count - shared) // count if count else size, count - shared)
        anchor = anchor_of(items)
        parts = extra_parts(items, new[1], state, anchor)
        self.sessions.weigh(state, size, count, new, anchor, parts)
        ex.session_id, ex.session = state.id, state
        ex.exchange_id = state.next_exchange()
        return state

    async def _responses(
        self,
        ex: Exchange,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: Mapping[str, str],
        path_session: str | None,
        forward_headers: list[tuple[bytes, bytes]],
        extra: list[tuple[bytes, bytes]],
        *,
        strict: bool,
        entered: list[SessionState],
    ) -> None:
        """A Responses API request: its body read whole, its session found (for its log, and
        entered: in ``entered``), its ``input`` items' tool pairing repaired (or, ``strict``,
        refused with a diagnosis), then relayed as any other request; the answer, streamed or
        not, byte for byte."""
        assert self.relay is not None

        def find_session(
            body: dict[str, Any], size: int, memo: tuple[str, bytes, bodymemo.Parsed] | None
        ) -> None:
            try:
                state = self._responses_session(ex, body, size, headers, path_session, memo)
            except Exception:  # cachegate's own defect: the request goes on, in no session's log
                log.exception("finding the session of a Responses API request failed")
                ex.session_id, ex.session = None, None
                return
            self.sessions.enter(state)
            entered.append(state)

        explicit = ex.session_id
        try:
            refuse_announced(headers, self.settings.server.max_body_bytes)
            reading = time.perf_counter()
            raw = await read_body(receive, self.settings.server.max_body_bytes, scope)
            ex.client_wait_s = time.perf_counter() - reading
            ex.request_bytes = len(raw)
            try:
                try:
                    repaired = self._repaired_responses(
                        ex, raw, headers, forward_headers, strict, find_session, path_session
                    )
                except _CallsUnknown as unknown:  # (it continues an answer its client cut)
                    watch = DisconnectWatch(receive)  # (a client that leaves meanwhile: a 499)
                    try:
                        await self._learn_stored_calls(ex, unknown.response_id, forward_headers)
                    except asyncio.CancelledError:
                        task = asyncio.current_task()
                        if not watch.disconnected or task is None:
                            raise  # (cachegate stopping: as while the body came)
                        task.uncancel()
                        raise client_closed(
                            "client disconnected before the request was forwarded"
                        ) from None
                    finally:
                        watch.stop()
                    repaired = self._repaired_responses(
                        ex, raw, headers, forward_headers, strict, find_session, path_session
                    )
                content, forward_headers, read = repaired
            except ProxyError:
                raise
            except Exception:  # cachegate's own defect: the request goes as it came
                log.exception("the pairing check of a Responses API request failed")
                ex.repairs = []
                content, read = raw, False
                if ex.body is not None:
                    ex.body = ex.client_body  # (logged as the client sent it: it goes so)
        except (ProxyError, asyncio.CancelledError) as caught:
            if isinstance(caught, ProxyError):
                err = caught
            else:  # cachegate stopping, its grace period over, while the body still came
                task = asyncio.current_task()
                if task is None:
                    raise
                task.uncancel()  # (said as on the chat route: uvicorn's plain-text 500 was sent)
                err = shutting_down()
                ex.stopped = True
            ex.status, ex.error = err.status, err.message
            # the client left while sending it, or cachegate stopped
            ex.interrupted = err.status == CLIENT_CLOSED or ex.stopped
            if ex.session is None and ex.session_id is not None:
                # Refused before its session was found (too large, the client gone during its
                # upload): in the log of the session it named if that one is held, numbered
                # there, as on the chat route (a refusal makes no session: only a held one's)
                now = self.clock()
                state = self.sessions.get(ex.session_id, now)
                if state is None:
                    ex.session_id = None
                else:
                    state.last_seen = now
                    ex.session, ex.exchange_id = state, state.next_exchange()
            notify(self.observers, "on_error", ex)
            if err.status != CLIENT_CLOSED:
                if err.code == "strict_pairing":
                    self.metrics.observe_strict_rejection()
                extra = [*extra, (b"x-cachegate-repairs", b"0")]  # (as on the chat route)
                if ex.session_id is not None and explicit is None:  # (its log has the refusal)
                    extra.append((b"x-cachegate-session", ex.session_id.encode()))
                await send_error(send, err, extra, receive)
            return
        if read:  # (a body not read was not checked: no count of repairs said for it)
            extra = [*extra, (b"x-cachegate-repairs", str(len(ex.repairs)).encode())]
        if ex.session_id is not None and explicit is None:  # (found, not named: said too)
            extra = [*extra, (b"x-cachegate-session", ex.session_id.encode())]
        await self._relay(ex, scope, receive, send, content, forward_headers, extra, responses=True)

    def _repaired_responses(
        self,
        ex: Exchange,
        raw: bytes,
        headers: Mapping[str, str],
        forward_headers: list[tuple[bytes, bytes]],
        strict: bool,
        find_session: Callable[
            [dict[str, Any], int, tuple[str, bytes, bodymemo.Parsed] | None], None
        ]
        | None = None,
        path_session: str | None = None,
    ) -> tuple[bytes, list[tuple[bytes, bytes]], bool]:
        """The body to forward for a Responses API request, and its headers: the client's
        bytes unless its ``input`` needed a repair; and whether it could be read. A body
        cachegate cannot read (a coding it does not know, no JSON) is the provider's to judge,
        and goes as it came. ``find_session`` hears the parsed body (a JSON object) and its
        size decoded before its repair, and where its parse is to be filed for the next turn to
        splice onto (its items continue the last turn's bytes: only what was appended is parsed,
        as on the chat route, ``proxy.bodymemo``); ``ex.client_body`` and ``ex.body`` are then
        the client's and the one forwarded."""
        text = raw
        coding = headers.get("content-encoding")
        coded = coding is not None and coding.strip().lower() not in ("", "identity")
        if coded:
            try:
                text = decoded_request(coding or "", raw, self.settings.server.max_body_bytes)
            except ProxyError:
                return raw, forward_headers, False
        lenient = False
        memo: tuple[str, bytes, bodymemo.Parsed] | None = None
        try:
            if find_session is not None and self.chat is not None:
                key, memos, others = self.chat.memos_for(text, headers, path_session, "input")
                parsed = bodymemo.parse(text, memos, others, "input")
                del memos, others  # (held no longer than the parse: the memos' budget decides)
                body = parsed.body
                if key is not None:
                    memo = (key, text, parsed)
            else:
                body = orjson.loads(text)
        except orjson.JSONDecodeError:  # (a lone surrogate, as JavaScript cuts an emoji: read)
            body, lenient = lenient_json(text, big_ints=True), True
        if isinstance(body, dict):
            if self._cut_responses:
                previous = body.get("previous_response_id")
                if isinstance(previous, str) and previous in self._cut_responses:
                    raise _CallsUnknown(previous)  # (asked of the provider, then read again)
            ex.stream = body.get("stream") is True  # (counted among the streams in flight)
            model = body.get("model")  # (its answer's usage is counted under it)
            ex.model = model if isinstance(model, str) and model else None
        elif body is None:  # (not JSON, or nested too deep to read: looked through)
            ex.stream = _streamed(text)
        if not isinstance(body, dict):
            return raw, forward_headers, body is not None
        ex.client_body = ex.body = body
        if find_session is not None:
            ex.request_bytes = len(text)  # (decoded, as the chat route logs it)
            find_session(body, len(text), memo)
        p = self.settings.pairing
        note = p.interrupted_note or pairing.DEFAULT_INTERRUPTED_NOTE
        previous = body.get("previous_response_id")
        stored = self._response_calls.get(previous) if isinstance(previous, str) else None
        # (the calls of the answer it continues, which it gives no output for: interrupted)
        pending = respairing.stored_call_outputs(body, stored, note) if stored else []
        if b'"call_id"' not in text and not pending:
            return raw, forward_headers, True  # (no call and no output: nothing to pair)
        # Resumed from where the session's last request left off: a turn that resends the
        # same items (spliced from the last body's parse, or shared with the session's last
        # request) is read past them only. Two scans kept, as on the chat route: the latest
        # turn's, and the one it resumed from (a retry or a regeneration resumes too).
        state = ex.session
        kept: list[respairing.PairingScan] = (
            state.extra.get("responses_pairing", []) if state is not None else []
        )
        needed, scan, resumed = respairing.check(body, kept)
        if state is not None and scan is not None:
            base = resumed or (kept[0] if kept else None)
            state.extra["responses_pairing"] = [scan] if base is None else [scan, base]
        if not needed and not pending:
            return raw, forward_headers, True
        # an integer beyond 64 bits maybe, which orjson reads as a float: read again as it is,
        # so that the repaired body has it as it was sent
        if not lenient and _LONG_NUMBER.search(text) is not None:
            reread = lenient_json(text, big_ints=True)
            if not isinstance(reread, dict):
                return raw, forward_headers, True
            body = ex.client_body = ex.body = reread
        if strict:  # (every defect in one refusal: the stored answer's calls first)
            defects = respairing.diagnose(body) if needed else []
            stored_ids = [call_id for _, call_id, _ in pending]
            raise bad_request(
                respairing.format_strict_error(body, defects, stored_ids),
                "strict_pairing",
                "input",
            )
        items = body.get("input")
        repairs: list[dict[str, Any]] = []
        if needed:
            # where the session's last repair put each synthetic output: kept there
            placed: dict[str, int] = state.extra.get("responses_placed", {}) if state else {}
            record: dict[str, int] = {}
            result = respairing.repair_input(
                body,
                orphan_policy=p.orphan_policy,
                interrupted_note=note,
                placed=placed,
                record=record,
            )
            if not result.messages and p.orphan_policy == "drop":
                # only orphans (a client that lost its previous_response_id): dropped, nothing is
                # left to send, and sent as they are, the provider refuses them: downgraded
                result = respairing.repair_input(
                    body, orphan_policy="downgrade", interrupted_note=note, placed=placed
                )
            if state is not None and record:  # (sub-agents' beside the main agent's)
                kept_places = {k: v for k, v in placed.items() if k not in record}
                kept_places.update(record)  # (the latest last: the oldest go first)
                if len(kept_places) > _PLACES_KEPT:
                    kept_places = dict(list(kept_places.items())[-_PLACES_KEPT:])
                state.extra["responses_placed"] = kept_places
            if not result.messages:  # (defensive: the provider judges what was sent)
                return raw, forward_headers, True
            items = result.messages
            repairs = [
                {
                    "kind": r.kind,
                    "index": r.index,
                    "tool_call_id": r.tool_call_id,
                    "action": r.action,
                }
                for r in result.repairs
            ]
        if pending:
            # first in the input: they answer the stored answer's calls, before what it says next
            # (an ``input`` that is one string is a user message)
            said = [{"role": "user", "content": items}] if isinstance(items, str) else items
            items = [output for output, _, _ in pending] + list(said or ())
            repairs[:0] = [
                {
                    "kind": "dangling_call",
                    "index": None,
                    "tool_call_id": call_id,
                    "action": f"added a synthetic output for {name} (its call is in the stored"
                    f" response {previous})",
                }
                for _, call_id, name in pending
            ]
        ex.repairs = repairs
        if coded:  # forwarded as read: decoded
            forward_headers = [h for h in forward_headers if h[0].lower() != b"content-encoding"]
        ex.body = {**body, "input": items}
        return dump_body(ex.body), forward_headers, True


# The Responses API answers whose sessions are remembered (``Gateway._remember_response``):
# ~150 bytes each
RESPONSES_REMEMBERED = 65536
# The Responses API answers with calls whose calls are remembered (``Gateway._remember_calls``):
# ~400 bytes each
RESPONSE_CALLS_REMEMBERED = 8192
# The longest cachegate waits on the provider for a cut answer's calls (``_learn_stored_calls``)
STORED_CALLS_TIMEOUT_S: Final = 10.0
# A response id as it may go in a path: letters, digits, ``_`` and ``-`` (OpenAI's ``resp_…``)
_RESPONSE_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,256}")
# What the client said of its own request's body, not of a GET's
_NOT_FOR_A_GET: Final = frozenset(
    {b"content-type", b"content-length", b"content-encoding", b"accept", b"idempotency-key"}
)


class _CallsUnknown(Exception):
    """A Responses API request continues an answer whose stream its client cut: the calls
    the provider stored for it are to be asked of it before its pairing is checked."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


# Synthetic outputs of the Responses route whose place a session keeps (``responses_placed``)
_PLACES_KEPT: Final = 256
# where an integer beyond 64 bits may be (-2**63 has 19 digits, 2**64 20)
_LONG_NUMBER = re.compile(rb"[0-9]{20}|-[0-9]{19}")
_TRUE_VALUE = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*true")


def _streamed(text: bytes) -> bool:
    """Whether an unparsed request body says ``"stream": true`` (a nested object's key reads as
    the request's too: only the count of streams in flight is told). A scan of the body, ~0.5
    ms a MB: where it is parsed, its ``stream`` is read instead."""
    at = text.find(b'"stream"')
    while at >= 0:
        if _TRUE_VALUE.match(text, at + 8) is not None:
            return True
        at = text.find(b'"stream"', at + 8)
    return False


class _ProxyEndpoint:
    """Raw ASGI endpoint for /v1/* and /s/{id}/v1/*: no Request object, no buffering."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        params = scope.get("path_params", {})
        path = params.get("path", "")
        path_session = params.get("session_id")
        chat = path == "chat/completions" and scope["method"] == "POST"
        if path_session is not None and not valid_session_id(path_session):
            await self.gateway.refuse(
                scope,
                send,
                route_of(scope),
                bad_request(
                    "Invalid session id in path: ids must match [A-Za-z0-9._:-]{1,128}"
                    " (and not be '.' or '..')",
                    "invalid_session_id",
                ),
            )
            return
        if chat:
            assert self.gateway.chat is not None
            await self.gateway.chat.handle(scope, receive, send, path_session)
            return
        if scope["method"] not in _RELAYED_METHODS:
            # TRACE (which asks the upstream to echo the request, cachegate's key with it),
            # CONNECT, WebDAV's and caches' methods (PROPFIND, PURGE): no provider's API uses
            # them
            await self.gateway.refuse(
                scope,
                send,
                "passthrough",
                ProxyError(
                    405,
                    f"{scope['method']} is not relayed: cachegate relays"
                    f" {', '.join(_ALL_METHODS)} under /v1/.",
                    code="method_not_allowed",
                ),
                [(b"allow", ", ".join(_ALL_METHODS).encode()), *explicit_session(scope)],
            )
            return
        upstream_path = upstream_path_of(scope)
        if upstream_path is None:
            await self.gateway.refuse(
                scope,
                send,
                "passthrough",
                bad_request(
                    "Invalid path: '.' and '..' segments (also percent-encoded), and a /v1 or"
                    " /s/{id}/v1 prefix that is percent-encoded, are not relayed.",
                    "invalid_path",
                ),
                explicit_session(scope),
            )
            return
        # (and its compaction, ``/v1/responses/compact``: Codex CLI's remote compaction, whose
        # answer is a ``response.compaction`` with its usage)
        responses = path in ("responses", "responses/compact") and scope["method"] == "POST"
        await self.gateway.passthrough(scope, receive, send, upstream_path, path_session, responses)


def explicit_session(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The ``X-Cachegate-Session`` header of a refusal of a request with an explicit session
    (``/s/{id}/v1/...``, or ``X-Session-Id`` and the other session headers): its answers say
    it, as its other answers do. Not a session the path names only once decoded
    (``/s/abc%2Fv1/...``), nor an id that is not one."""
    path: str = scope["path"]
    path_id = None
    if path.startswith("/s/"):
        path_id = path[3:].partition("/")[0]
        raw: bytes = scope.get("raw_path") or b""
        segments = raw.split(b"?", 1)[0].split(b"/")
        if (
            not valid_session_id(path_id)
            or segments[3:4] != [b"v1"]
            or len(segments) < 5  # (``/s/x/v1`` is no route: its 404 names no session)
            or unquote(segments[2].decode("latin-1")) != path_id  # (``a%3Ab`` is ``a:b``)
        ):
            return []
    try:
        sid = explicit_session_id(header_map(scope), path_id)
    except ValueError:  # (an X-Session-Id that is no id: refused as such on its route)
        return []
    return [(b"x-cachegate-session", sid.encode())] if sid is not None else []


def upstream_path_of(scope: Scope) -> str | None:
    """The path after ``/v1/`` (or ``/s/{id}/v1/``) exactly as the client encoded it, or None when
    a segment would climb out of the upstream's ``/v1`` (``..``, also as ``%2E%2E`` or behind an
    encoded ``%2F``), or when the prefix was routed only once decoded (``/v1%2Fmodels``,
    ``/s/abc%2Fv1/models``: the raw path's segments would not line up with the route's).
    Starlette's path parameter is decoded, so ``%2F`` would become a separator."""
    raw = scope.get("raw_path") or quote(scope["path"]).encode()
    segments = raw.split(b"?", 1)[0].split(b"/")
    if segments[1:2] == [b"v1"]:
        rest = segments[2:]
    elif (
        segments[1:2] == [b"s"]
        and segments[3:4] == [b"v1"]
        # the session segment as routed: "/s/zz%2Fv1/v1/chat/completions" routes, decoded, as
        # session "zz" asking for "v1/chat/completions", and would reach the chat endpoint
        # upstream past cachegate's chat route
        and unquote(segments[2].decode("latin-1")) == scope.get("path_params", {}).get("session_id")
    ):
        rest = segments[4:]
    else:
        return None
    for segment in rest:
        text = unquote(segment.decode("latin-1")).replace("\\", "/")
        # (``..;x``: a path parameter, which servers such as Tomcat take off before the segment)
        if any(part.partition(";")[0] in (".", "..") for part in text.split("/")):
            return None
    return b"/".join(rest).decode("latin-1")


def route_of(scope: Scope) -> str:
    """The metrics' route label of a request refused before routing: "chat" for a POST to a
    chat-completions path (also under /s/{id}/), "responses" for one to the Responses API's,
    else "passthrough"."""
    if scope["method"] == "POST":
        path = scope["path"]
        if path.endswith("/v1/chat/completions"):
            return "chat"
        if path.endswith(("/v1/responses", "/v1/responses/compact")):
            return "responses"
    return "passthrough"


def _error_response(err: ProxyError, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        err.body(),
        status_code=err.status,
        headers={**(headers or {}), "date": http_date().decode()},
        media_type="application/json",
    )


class _BadSessionPath:
    """Raw ASGI endpoint for anything else under /s/: an id that is not one (a slash smuggled in
    as %2F, an empty id, no /v1 after it). Refused, and counted as a chat request when the path
    ends as one."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = scope.get("raw_path") or scope["path"].encode()
        segment = raw.split(b"?", 1)[0].split(b"/")[2:3]  # b"/s/<id>/..." -> [b"<id>"]
        said: str | None = None  # (an id that reads as a key: refused, as on the routes)
        if segment and valid_session_id(segment[0].decode("latin-1")):
            try:
                explicit_session_id(header_map(scope), segment[0].decode("latin-1"))
            except ValueError as exc:
                said = str(exc)
        if said is not None:
            err = bad_request(said, "invalid_session_id")
        elif segment and valid_session_id(segment[0].decode("latin-1")):
            # A valid id, without /v1 after it (/s/abc/healthz, /s/abc/chat/completions), or
            # the base URL itself
            base = "/s/" + segment[0].decode("latin-1") + "/v1"
            advice = (
                f" {base} is the session's base URL: requests go under it"
                f" ({base}/chat/completions)."
                if scope["path"] == base
                else " A session's base URL ends in /v1: /s/{id}/v1/... (e.g."
                f" {base}/chat/completions)."
            )
            err = ProxyError(
                404,
                f"Nothing is served at {scope['method']} {scope['path']}.{advice}",
                code="not_found",
            )
        else:
            err = bad_request(
                "Invalid session path: use /s/{id}/v1/... with an id matching "
                "[A-Za-z0-9._:-]{1,128}",
                "invalid_session_id",
            )
        await self.gateway.refuse(scope, send, route_of(scope), err)


_ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
_RELAYED_METHODS = frozenset(_ALL_METHODS)


# cachegate's own routes, which add no key: listening beyond the machine, their Host is not judged
_KEYLESS_PATHS = frozenset({"/metrics", "/healthz"})


class CachegateApp(Starlette):
    """Starlette, with the relayed routes dispatched before its middleware and router.

    ``/v1/{path}`` and ``/s/{id}/v1/{path}`` go straight to the raw endpoint, matched exactly as
    their ``Route`` patterns would match them: every request and every relayed chunk would
    otherwise pass through two middleware layers and two ``send`` wrappers that a raw endpoint
    has no use for. Everything else (health, metrics, malformed session paths, 404s) takes the
    normal Starlette path.
    """

    endpoint: _ProxyEndpoint
    guard: BrowserGuard

    async def __call__(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "http":
            headers = header_map(scope)  # type: ignore[arg-type]
            refusal = self.guard.refusal(headers, scope["path"] in _KEYLESS_PATHS)
            if refusal is None and headers.get("upgrade", "").lower().find("websocket") >= 0:
                refusal = websocket_unsupported()
            if refusal is not None:
                await self._refuse(scope, send, refusal)  # type: ignore[arg-type]
                return
        if scope["type"] == "http" and not scope.get("root_path"):
            path: str = scope["path"]
            if path.startswith("/v1/"):
                scope["path_params"] = {"path": path[4:]}
                await self.endpoint(scope, receive, send)  # type: ignore[arg-type]
                return
            if path.startswith("/s/"):
                sid, slash, rest = path[3:].partition("/")
                if sid and slash and rest.startswith("v1/"):
                    scope["path_params"] = {"session_id": sid, "path": rest[3:]}
                    await self.endpoint(scope, receive, send)  # type: ignore[arg-type]
                    return
        if scope["type"] == "lifespan":

            async def quiet(message: MutableMapping[str, Any]) -> None:
                # A second Ctrl+C: uvicorn skips the shutdown and cancels the lifespan, and
                # Starlette reports that as a failed shutdown, which uvicorn prints as a
                # traceback. Nothing failed: the lifespan's ``finally`` still stops the gateway
                # (the answers cut are logged, the log's queue written).
                text = message.get("message")
                if (
                    message.get("type") == "lifespan.shutdown.failed"
                    and isinstance(text, str)
                    and text.rstrip().endswith("CancelledError")
                ):
                    return
                await send(message)

            await super().__call__(scope, receive, quiet)
            return
        await super().__call__(scope, receive, send)

    def invalid_http(self, method: bytes, target: bytes, status: int = 400) -> None:
        """Count a request HTTP's parser refused (``serving.HttpProtocol``'s 400
        ``invalid_http``, its 431 for a head too large), by its route as far as it was read:
        the app never saw it."""
        path = target.split(b"?", 1)[0].decode("latin-1")
        scope = {"method": method.decode("latin-1"), "path": path}
        self.endpoint.gateway.metrics.observe_request(route_of(scope), None, status, 0.0)

    async def _refuse(self, scope: Scope, send: Send, err: ProxyError) -> None:
        # (counted as any request: a foreign page's or a WebSocket's refusal outside /v1/ too,
        # as cachegate's own 404 there is)
        await self.endpoint.gateway.refuse(
            scope, send, route_of(scope), err, explicit_session(scope) or None
        )


def create_app(
    settings: Settings | None = None,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    registry: CollectorRegistry | None = None,
    clock: Callable[[], float] = time.time,
    environ: Mapping[str, str] | None = None,
) -> CachegateApp:
    """Build the ASGI app. Tests inject a registry, an upstream transport and a clock."""
    settings = settings or Settings()
    registry = registry if registry is not None else CollectorRegistry()
    gateway = Gateway(
        settings,
        transport=transport,
        registry=registry,
        clock=clock,
        environ=os.environ if environ is None else environ,
    )

    async def healthz(request: Request) -> Response:
        body = {"status": "ok", "version": __version__}
        return JSONResponse(body, headers={"date": http_date().decode()})

    async def metrics(request: Request) -> Response:
        gateway.forget_idle()
        gateway.metrics.observe_sessions(len(gateway.sessions), gateway.sessions.bytes)
        return Response(
            gateway.metrics.scrape(registry),
            media_type=CONTENT_TYPE_LATEST,
            headers={"date": http_date().decode()},
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    async def not_found(request: Request, exc: Exception) -> Response:
        path = request.url.path
        message = f"Nothing is served at {request.method} {path}."
        if path == "/v1":
            message += " /v1 is the base URL: requests go under it (/v1/chat/completions)."
        elif not path.startswith(("/v1/", "/s/")):
            message += (
                " cachegate serves the OpenAI API under /v1: a client's base URL ends in /v1,"
                f" e.g. OPENAI_BASE_URL={request.base_url}v1."
            )
        err = ProxyError(404, message, code="not_found")
        gateway.count_refusal(request.scope, "passthrough", err)  # (a base URL without /v1)
        return _error_response(err)

    async def bare_v1(request: Request) -> Response:
        return await not_found(request, HTTPException(404))

    async def not_allowed(request: Request, exc: Exception) -> Response:
        message = f"{request.method} is not allowed on {request.url.path}."
        allow = getattr(exc, "headers", None)  # Starlette's HTTPException names what is allowed
        err = ProxyError(405, message, code="method_not_allowed")
        gateway.count_refusal(request.scope, "passthrough", err)
        return _error_response(err, allow)

    async def failed(request: Request, exc: Exception) -> Response:
        return _error_response(internal_error(exc, "cachegate failed to answer this request"))

    endpoint = _ProxyEndpoint(gateway)
    app = CachegateApp(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/{path:path}", endpoint),
            # /v1 itself: a counted 404 with a hint (Starlette would answer a 307 to /v1/, uncounted,
            # built from the Host header, and a POST followed there reached the upstream's /v1/)
            Route("/v1", bare_v1, methods=_ALL_METHODS),
            Route("/s/{session_id}/v1/{path:path}", endpoint),
            # Anything else under /s/ carries an id that is not one (a slash smuggled in as %2F, …).
            Route("/s/{rest:path}", _BadSessionPath(gateway), methods=_ALL_METHODS),
        ],
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: not_allowed, 500: failed},
    )
    app.state.gateway = gateway
    app.endpoint = endpoint
    server = settings.server
    app.guard = BrowserGuard(
        server.host, server.allowed_origins.split(","), server.allowed_hosts.split(",")
    )
    return app
