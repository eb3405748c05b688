"""The full pipeline of ``POST /v1/chat/completions``: parse once, name the session, transform, relay.

Transforms run in order and each may replace the forwarded body: tool-pairing repair (or a strict
rejection), compaction, and the stream-usage request. When none changed anything, the client's exact
bytes are forwarded; the usage request alone is spliced into the raw bytes rather than re-serializing
a 600 KB body.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from proxy import compaction, pairing
from proxy.compactor import provider_window
from proxy.config import Settings
from proxy.errors import ProxyError, bad_request
from proxy.pipeline import Exchange, Observer, notify
from proxy.relay import (
    Receive,
    Relay,
    RetryRequest,
    Scope,
    Send,
    UpstreamAborted,
    read_body,
    send_error,
    upstream_request_headers,
)
from proxy.sessions import SessionState, SessionStore, explicit_session_id, new_session_id

log = logging.getLogger(__name__)

_USAGE_OPTION = b'"stream_options":{"include_usage":true}'


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request as a JSON object, or a 400 that says what is wrong with it."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(
            f"Request body must be a JSON object, got {type(body).__name__}.", "invalid_body"
        )
    messages = body.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise bad_request("'messages' must be an array.", "invalid_messages", "messages")
    return body


def splice_usage_option(raw: bytes) -> bytes | None:
    """Insert ``stream_options.include_usage`` as the first key of a JSON object, bytes only."""
    start = raw.find(b"{")
    if start < 0 or raw[:start].strip():
        return None
    rest = raw[start + 1 :]
    empty = rest.lstrip().startswith(b"}")
    return raw[: start + 1] + _USAGE_OPTION + (b"" if empty else b",") + rest


def header_map(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


class ChatPipeline:
    """Runs one chat-completions exchange through transforms, the relay and the observers."""

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
        compactor: Any = None,
    ) -> None:
        self.settings = settings
        self.relay = relay
        self.sessions = sessions
        self.observers = observers
        self.api_key = api_key
        self.clock = clock
        self.on_strict_rejection = on_strict_rejection
        self.compactor = compactor
        note = settings.pairing.interrupted_note or pairing.DEFAULT_INTERRUPTED_NOTE
        self.interrupted_note = note
        self.in_flight = 0  # exchanges whose observers have not all run yet

    def resolve_session(
        self, headers: Mapping[str, str], path_id: str | None, body: dict[str, Any], now: float
    ) -> SessionState:
        try:
            sid = explicit_session_id(headers, path_id)
        except ValueError as exc:
            raise bad_request(str(exc), "invalid_session_id") from None
        messages = body.get("messages") or []
        if sid is not None:
            state = self.sessions.get(sid) or self.sessions.create(sid, now)
        else:
            state = self.sessions.infer(messages) or self.sessions.create(new_session_id(now), now)
        state.last_seen = now
        self.sessions.index(state, messages)
        return state

    def repair(self, ex: Exchange, body: dict[str, Any], strict: bool) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not pairing.needs_repair(messages):
            return body
        if strict:
            defects = pairing.diagnose(messages)
            if defects:
                if self.on_strict_rejection is not None:
                    self.on_strict_rejection()
                raise bad_request(
                    pairing.format_strict_error(defects), "strict_pairing", "messages"
                )
            return body
        result = pairing.repair_messages(
            messages,
            orphan_policy=self.settings.pairing.orphan_policy,
            interrupted_note=self.interrupted_note,
        )
        if not result.changed:
            return body
        ex.repairs = [
            {"kind": r.kind, "index": r.index, "tool_call_id": r.tool_call_id, "action": r.action}
            for r in result.repairs
        ]
        return {**body, "messages": result.messages}

    async def handle(
        self, scope: Scope, receive: Receive, send: Send, path_session: str | None
    ) -> None:
        t0 = time.perf_counter()
        now = self.clock()
        headers = header_map(scope)
        ex = Exchange(
            route="chat",
            method="POST",
            path="chat/completions",
            started_at=now,
            t0=t0,
            user_agent=headers.get("user-agent", ""),
        )
        state: SessionState | None = None
        try:
            raw = await read_body(receive, self.settings.server.max_body_bytes)
            ex.request_bytes = len(raw)
            body = parse_body(raw)
            model = body.get("model")
            ex.model = model if isinstance(model, str) else None
            ex.stream = body.get("stream") is True
            ex.client_body = body
            state = self.resolve_session(headers, path_session, body, now)
            ex.session_id = state.id
            ex.exchange_id = state.next_exchange()
            strict = self.settings.pairing.strict or headers.get("x-cachegate-strict", "") in (
                "1",
                "true",
            )
            forwarded = body
            if self.settings.pairing.repair or strict:
                forwarded = self.repair(ex, forwarded, strict)
            upstream_headers = upstream_request_headers(scope["headers"], self.api_key())
            if self.compactor is not None:
                forwarded = await self.compactor.apply(ex, state, forwarded, upstream_headers)
            changed = forwarded is not body
            content = raw
            if ex.stream and self.settings.upstream.request_usage:
                options = forwarded.get("stream_options")
                if not (isinstance(options, dict) and options.get("include_usage")):
                    ex.strip_usage = True
                    if changed or options is not None:
                        forwarded = {
                            **forwarded,
                            "stream_options": {**(options or {}), "include_usage": True},
                        }
                        changed = True
                    else:
                        spliced = splice_usage_option(raw)
                        if spliced is None:
                            forwarded = {**forwarded, "stream_options": {"include_usage": True}}
                            changed = True
                        else:
                            content = spliced
            if changed:
                content = orjson.dumps(forwarded)
            ex.body = forwarded
        except ProxyError as err:
            ex.status = err.status
            ex.error = err.message
            extra = [(b"x-cachegate-session", state.id.encode())] if state is not None else []
            notify(self.observers, "on_error", ex)
            await send_error(send, err, extra)
            return
        messages = forwarded.get("messages")
        state.remember(ex.exchange_id, messages if isinstance(messages, list) else [])
        notify(self.observers, "on_request", ex)
        extra = [
            (b"x-cachegate-session", state.id.encode()),
            (b"x-cachegate-repairs", str(len(ex.repairs)).encode()),
        ]
        if ex.compacted:
            extra.append((b"x-cachegate-compacted", b"1"))
        retry_if = compaction.is_context_length_error if self.compactor is not None else None
        try:
            try:
                await self.relay.forward(
                    ex,
                    scope,
                    receive,
                    send,
                    content=content,
                    headers=upstream_headers,
                    extra_headers=extra,
                    record=True,
                    retry_if=retry_if,
                )
            except RetryRequest as retry:
                # The provider refused a history too long for its window: compact now, retry once.
                log.info("session %s: context length exceeded; compacting and retrying", state.id)
                assert self.compactor is not None
                forwarded = await self.compactor.apply(
                    ex,
                    state,
                    self.repair(ex, ex.client_body or body, strict=False),
                    upstream_headers,
                    force=True,
                    window=provider_window(retry.body),
                )
                if ex.stream and ex.strip_usage:
                    forwarded = {
                        **forwarded,
                        "stream_options": {
                            **(forwarded.get("stream_options") or {}),
                            "include_usage": True,
                        },
                    }
                ex.body = forwarded
                if ex.compacted and (b"x-cachegate-compacted", b"1") not in extra:
                    extra.append((b"x-cachegate-compacted", b"1"))
                await self.relay.forward(
                    ex,
                    scope,
                    receive,
                    send,
                    content=orjson.dumps(forwarded),
                    headers=upstream_headers,
                    extra_headers=extra,
                    record=True,
                )
        except UpstreamAborted:
            notify(self.observers, "on_response", ex)
            raise
        notify(self.observers, "on_response", ex)
