"""The simulator's HTTP face: routes, streaming with real-time pacing, injected faults.

``create_simulator_app`` returns the Starlette app; ``run_simulator`` serves it on a free loopback
port for tests and the demo. Per-request controls are headers:

- ``X-Sim-Fault: 429|500|503|reset|stall|malformed|error_event`` (or ``fault_rate`` + ``seed``):
  429/500/503 answer at once in the OpenAI error shape (429 with ``retry-after``); ``reset`` drops
  the connection after a few chunks (non-streaming: halfway through the body); ``stall`` goes
  silent after a few chunks for ``X-Sim-Stall-S`` seconds (default ``stall_s``) then finishes;
  ``malformed`` inserts one truncated ``data:`` line; ``error_event`` sends ``data: {"error": …}``
  and ends the stream without ``[DONE]`` (non-streaming: the error object is the 200 body).
- ``X-Sim-Script``: one scripted reply as JSON (see ``proxy.simulator.reply``).
- ``X-Sim-Time-Advance``: seconds to move the simulated clock before handling.

Admin routes: ``POST /_sim/clock {"advance_s": N}``, ``GET /_sim/clock``, ``GET /_sim/requests``,
``POST /_sim/reset``, ``POST /_sim/script`` (a reply, a list, or ``{"responses": [...]}``).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
import random
import struct
from collections.abc import AsyncGenerator, Iterator, Mapping
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.browser import BrowserGuard
from proxy.errors import ProxyError
from proxy.prefix import deep_dumps
from proxy.relay import send_error
from proxy.serving import ServerThread
from proxy.simulator.cache import EXTENDED_TTL_S, LONG_TTL_S, claude_minimum
from proxy.simulator.config import FAULTS, STATUS_FAULTS, SimConfig
from proxy.simulator.reply import Reply, completion_tokens, cut_to, derive_reply, parse_script
from proxy.simulator.state import ReceivedRequest, Simulator
from proxy.simulator.tokens import count_tokens, marked_request_tokens, response_tokens
from proxy.simulator.validate import (
    GEMINI_EMPTY_TEXT_ERROR,
    ValidationError,
    gemini_refusal,
    json_kind,
    mistral_refusal,
    validate_claude_messages,
    validate_messages,
    validate_response_input,
    validate_stored_calls,
)
from proxy.simulator.wire import (
    DONE,
    KEEPALIVE,
    compacted_user_message,
    completion_object,
    encode_event,
    error_object,
    response_call,
    response_events,
    response_message,
    response_object,
    response_usage,
    stream_chunks,
    usage_object,
)

logger = logging.getLogger(__name__)

BAD_JSON_TEXT = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't using "
    "your HTTP library correctly. The OpenAI API expects a JSON payload, but what was sent was not "
    "valid JSON. If you have trouble figuring out how to fix this, please contact us through our "
    "help center at help.openai.com.)"
)
CONTEXT_TEXT = (
    "This model's maximum context length is {window} tokens. However, your messages resulted in "
    "{tokens} tokens. Please reduce the length of the messages."
)
CONTEXT_WITH_COMPLETION_TEXT = (
    "This model's maximum context length is {window} tokens. However, you requested {total} "
    "tokens ({tokens} in the messages, {asked} in the completion). Please reduce the length of "
    "the messages or completion."
)
RESPONSES_CONTEXT_TEXT = (
    "Your input exceeds the context window of this model. Please adjust your input and try again."
)
EMPTY_TOOLS_TEXT = (
    "Invalid 'tools': empty array. Expected an array with minimum length 1, but got an empty "
    "array instead."
)
SERVER_ERROR_TEXT = "The server had an error while processing your request. Sorry about that!"
STATUS_FAULT_BODIES: dict[str, dict[str, Any]] = {
    "429": error_object(
        "Rate limit reached for requests. Please try again later.",
        "requests",
        None,
        "rate_limit_exceeded",
    ),
    "500": error_object(SERVER_ERROR_TEXT, "server_error"),
    "503": error_object("The server is overloaded or not ready yet.", "server_error"),
}
# Chunks sent before a mid-stream fault strikes (fewer when the stream is shorter).
FAULT_AFTER_CHUNKS = 3
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class SimulatedReset(Exception):
    """Raised on purpose inside a response under way: uvicorn then drops the connection."""


class _QuietReset(logging.Filter):
    """Keeps uvicorn from logging a deliberate reset as an application crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, SimulatedReset)


def _install_quiet_reset() -> None:
    uvicorn_error = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietReset) for f in uvicorn_error.filters):
        uvicorn_error.addFilter(_QuietReset())


class PacedResponse:
    """An ASGI response sending body pieces as an async iterator yields them.

    It stops at once when the client disconnects (so a stall never outlives its client), and a
    ``SimulatedReset`` from the iterator closes the connection without finishing the body. With
    ``start_at_once`` false the status line waits for the first piece (a stalled non-stream reply).
    """

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        *,
        status_code: int = 200,
        media_type: str,
        headers: Mapping[str, str] | None = None,
        start_at_once: bool = True,
    ) -> None:
        self.body = body
        self.start_at_once = start_at_once
        raw = [(b"content-type", media_type.encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        self.start_message = {"type": "http.response.start", "status": status_code, "headers": raw}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        reset = False
        started = False

        async def start() -> None:
            nonlocal started
            if not started:
                started = True
                await send(self.start_message)

        async def pump() -> None:
            nonlocal reset
            try:
                if self.start_at_once:
                    await start()
                async with aclosing(self.body) as pieces:
                    async for piece in pieces:
                        await start()
                        await send({"type": "http.response.body", "body": piece, "more_body": True})
                await start()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except SimulatedReset:
                reset = True
            except OSError:  # the client left; uvicorn's ClientDisconnected is an OSError
                pass
            task_group.cancel_scope.cancel()

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            task_group.cancel_scope.cancel()

        async with anyio.create_task_group() as task_group:
            task_group.start_soon(pump)
            task_group.start_soon(watch_disconnect)
        if reset:
            if not started:
                await start()
            raise SimulatedReset("simulated connection reset")


def _json_response(
    obj: Any, status_code: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    try:
        content = orjson.dumps(obj)
    except TypeError:  # a recorded request nested deeper than orjson writes: /_sim/requests
        content = deep_dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    return Response(content, status_code, headers=headers, media_type="application/json")


# OpenAI's answer to stream_options on a request that does not stream
STREAM_OPTIONS_UNSTREAMED_TEXT = (
    "The 'stream_options' parameter is only allowed when 'stream' is enabled."
)
# Mistral's answer to a request with stream_options (FastAPI's validation error, wrapped)
STREAM_OPTIONS_REFUSAL: dict[str, Any] = {
    "object": "error",
    "message": {
        "detail": [
            {
                "type": "extra_forbidden",
                "loc": ["body", "stream_options"],
                "msg": "Extra inputs are not permitted",
            }
        ]
    },
    "type": "invalid_request_error",
    "param": None,
    "code": None,
}


def _error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> Response:
    return _json_response(error_object(message, "invalid_request_error", param, code), status)


@dataclass(frozen=True, slots=True)
class _Controls:
    """The per-request ``X-Sim-*`` headers, parsed."""

    fault: str | None
    stall_s: float
    script: Reply | None


def _seconds(text: str, header: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 2**62:  # also rejects NaN and infinity
        raise ValueError(f"{header} must be a number of seconds >= 0")
    return value


def _refused_stream_options(options: Any) -> Response | None:
    """OpenAI's 400 for a ``stream_options`` of the wrong type, or one of its two flags not a
    boolean (a string ``"true"``, a number); None where it is fine (absent, null, an object)."""
    if options is None:
        return None
    if not isinstance(options, dict):
        message = (
            "Invalid type for 'stream_options': expected an object, but got"
            f" {json_kind(options)} instead."
        )
        return _error(400, message, "stream_options", "invalid_type")
    for flag in ("include_usage", "include_obfuscation"):
        value = options.get(flag)
        if value is not None and not isinstance(value, bool):
            where = f"stream_options.{flag}"
            message = (
                f"Invalid type for '{where}': expected a boolean, but got {json_kind(value)}"
                " instead."
            )
            return _error(400, message, where, "invalid_type")
    return None


def _refused_logprobs(logprobs: Any, top: Any) -> Response | None:
    """OpenAI's 400 for a ``logprobs`` that is no boolean or a ``top_logprobs`` that is no
    whole number from 0 to 20, else None (both may be null)."""
    if logprobs is not None and not isinstance(logprobs, bool):
        kind = json_kind(logprobs)
        message = f"Invalid type for 'logprobs': expected a boolean, but got {kind} instead."
        return _error(400, message, "logprobs", "invalid_type")
    return None if top is None else _refused_integer("top_logprobs", top, 0, 20)


def _refused_n(value: Any) -> Response | None:
    """OpenAI's refusal of an ``n`` that is no whole number from 1 to 128, else None."""
    return _refused_integer("n", value, 1, 128)


def _refused_integer(name: str, value: Any, low: int, high: int) -> Response | None:
    """OpenAI's refusal of a parameter ``name`` that is no whole number from ``low`` to
    ``high``, else None."""
    if type(value) is not int:
        kind = json_kind(value)
        message = f"Invalid type for '{name}': expected an integer, but got {kind} instead."
        return _error(400, message, name, "invalid_type")
    if value < low:
        message = (
            f"Invalid '{name}': integer below minimum value. Expected a value >= {low}, but got"
            f" {value} instead."
        )
        return _error(400, message, name, "integer_below_min_value")
    if value > high:
        message = (
            f"Invalid '{name}': integer above maximum value. Expected a value <= {high}, but got"
            f" {value} instead."
        )
        return _error(400, message, name, "integer_above_max_value")
    return None


def _parse_controls(headers: Mapping[str, str], config: SimConfig) -> _Controls:
    """``ValueError`` names a bad header."""
    fault = headers.get("x-sim-fault")
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"Unknown X-Sim-Fault {fault!r}; known: {', '.join(FAULTS)}")
    stall_s = _seconds(headers.get("x-sim-stall-s", str(config.stall_s)), "X-Sim-Stall-S")
    script = None
    if "x-sim-script" in headers:
        try:
            # (a header's bytes come as Latin-1: UTF-8 text, as curl sends it, read again)
            script = parse_script(orjson.loads(headers["x-sim-script"].encode("latin-1")))
        except orjson.JSONDecodeError:
            raise ValueError("X-Sim-Script must be JSON") from None
    return _Controls(fault=fault, stall_s=stall_s, script=script)


def _fault_index(n_events: int) -> int:
    """Where a mid-stream fault strikes: after a few events, but before the last chunk."""
    return max(1, min(FAULT_AFTER_CHUNKS, n_events - 2))


def _truncated(data: bytes) -> bytes:
    """The first half of ``data``, cut on a UTF-8 character boundary."""
    cut = len(data) // 2
    while 0 < cut < len(data) and 0x80 <= data[cut] < 0xC0:
        cut -= 1
    return data[:cut]


class _Handlers:
    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.config = sim.config

    # -- provider routes ------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response | PacedResponse:
        raw = await request.body()
        headers = dict(request.headers)
        try:
            controls = _parse_controls(headers, self.config)
            advance = _seconds(headers.get("x-sim-time-advance", "0"), "X-Sim-Time-Advance")
            if advance:
                self.sim.advance(advance)
        except ValueError as exc:
            return _error(400, str(exc), None, "invalid_sim_control")
        received = self.sim.record(request.method, request.url.path, headers, raw)
        response = self._chat(received, raw, controls)
        if isinstance(response, Response):
            received.status = response.status_code
        return response

    def _chat(
        self, received: ReceivedRequest, raw: bytes, controls: _Controls
    ) -> Response | PacedResponse:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            return _error(400, BAD_JSON_TEXT)
        received.body = body
        fault = controls.fault or self.sim.draw_fault()
        if fault in STATUS_FAULTS:
            received.fault = fault
            return self._status_fault(fault)
        if not body.get("model"):
            return _error(400, "you must provide a model parameter")
        if self.config.refuse_stream_options and "stream_options" in body:
            return _json_response(STREAM_OPTIONS_REFUSAL, 422)
        for key, expected, kinds in (("model", "a string", str), ("stream", "a boolean", bool)):
            value = body.get(key)
            if value is not None and not isinstance(value, kinds):  # (as OpenAI checks them)
                kind = json_kind(value)
                message = f"Invalid type for '{key}': expected {expected}, but got {kind} instead."
                return _error(400, message, key, "invalid_type")
        if body.get("stream_options") is not None and body.get("stream") is not True:
            return _error(400, STREAM_OPTIONS_UNSTREAMED_TEXT, "stream_options")
        refused_options = _refused_stream_options(body.get("stream_options"))
        if refused_options is not None:
            return refused_options
        refused_logprobs = _refused_logprobs(body.get("logprobs"), body.get("top_logprobs"))
        if refused_logprobs is not None:
            return refused_logprobs
        top = body.get("top_logprobs") or 0
        logprobs = top if body.get("logprobs") is True else None
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):  # (a TypeError, a 500, before)
            kind = json_kind(tools)
            message = f"Invalid type for 'tools': expected an array, but got {kind} instead."
            return _error(400, message, "tools", "invalid_type")
        if tools == []:  # (as OpenAI refuses it: a client that drops every tool must drop the key)
            return _error(400, EMPTY_TOOLS_TEXT, "tools", "empty_array")
        choices = body.get("n", 1) if body.get("n") is not None else 1
        refused_n = _refused_n(choices)
        if refused_n is not None:
            return refused_n
        try:
            validate_messages(body.get("messages"))
            if self.config.dialect == "anthropic-compat":
                validate_claude_messages(body["messages"])
        except ValidationError as exc:
            return _error(400, exc.message, exc.param, exc.code)
        if self.config.mistral_rules:
            refused = mistral_refusal(body["messages"])
            if refused is not None:  # (Mistral's error object, at the top level)
                return _json_response(refused, 400)
        if self.config.gemini_rules and gemini_refusal(body["messages"]):
            return _json_response(GEMINI_EMPTY_TEXT_ERROR, 400)
        # (Claude renders the tools first; OpenAI and DeepSeek the system prompt, then the tools)
        claude = self.config.dialect == "anthropic-compat"
        tokens, marked, hour, ends, bounds = marked_request_tokens(body, system_first=not claude)
        if len(tokens) > self.config.context_window:
            message = CONTEXT_TEXT.format(window=self.config.context_window, tokens=len(tokens))
            return _error(400, message, "messages", "context_length_exceeded")
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if type(asked) is int and asked > 0 and len(tokens) + asked > self.config.context_window:
            # (the window holds the completion asked for too, as OpenAI's older models and
            # vLLM count it)
            message = CONTEXT_WITH_COMPLETION_TEXT.format(
                window=self.config.context_window,
                total=len(tokens) + asked,
                tokens=len(tokens),
                asked=asked,
            )
            return _error(400, message, "messages", "context_length_exceeded")

        reply = controls.script or self.sim.take_scripted() or derive_reply(body)
        fault = fault or reply.fault
        received.fault = fault
        if fault in STATUS_FAULTS:
            return self._status_fault(fault)
        if type(asked) is int and asked > 0:  # (the completion ends at the length asked)
            reply = cut_to(reply, asked)
        missing = sum(1 for c in reply.tool_calls if not c.id)
        # (Mistral's ids are nine letters and digits; it refuses any other it is sent back)
        prefix, length = ("", 9) if self.config.mistral_rules else ("call_", 24)
        # (``n`` choices, each the same reply, each call with an id of its own)
        replies = [
            reply.with_call_ids([self.sim.new_id(prefix, length) for _ in range(missing)])
            for _ in range(choices)
        ]
        reply = replies[0]
        model = str(body["model"])
        # Claude caches up to the last breakpoint only, for an hour up to the last one that asks
        # for it; a gateway may mark for a client that marks nothing (``cache_unmarked``: a mark
        # at the end of the request)
        limit: int | None = None
        entries: list[int] | None = None  # (Claude: where its entries end; others: any prefix)
        long_ttl_s, minimum = LONG_TTL_S, None
        if self.config.dialect == "anthropic-compat":
            limit = marked if marked or not self.config.cache_unmarked else None
            entries = ends if limit is not None else [len(tokens)]
            minimum = claude_minimum(model)  # (4,096 for Opus 4.5 and Haiku 4.5)
        elif self._kept_a_day(body):
            hour, long_ttl_s = len(tokens), EXTENDED_TTL_S
        else:
            hour = 0  # (others keep their own TTL, whatever a mark asks)
        # (the look-back from a request's own breakpoints: one a gateway marks for its client,
        # ``cache_unmarked``, is cached whole, as before)
        reach = bounds if claude and marked else None
        cache = self.sim.process_prompt(
            tokens, model, limit, hour, entries, long_ttl_s, minimum, reach
        )
        usage = usage_object(
            self.config.dialect,
            len(tokens),
            completion_tokens(reply) * choices,
            cache,
            reasoning=reply.reasoning_tokens * choices,
        )
        received.usage = usage
        received.status = 200
        dialect = self.config.dialect
        completion_id = (
            self.sim.new_uuid() if dialect == "deepseek" else self.sim.new_id("chatcmpl-", 29)
        )
        created = int(self.sim.now)
        request_id = self.sim.new_id("req_", 24)
        asked = body.get("service_tier")  # (the tier it used: the one asked, if one it has)
        tier = asked if dialect == "openai" and asked in ("flex", "priority") else None
        if body.get("stream"):
            options = body.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            obfuscation = not (
                isinstance(options, dict) and options.get("include_obfuscation") is False
            )
            chunks = stream_chunks(
                dialect=dialect,
                completion_id=completion_id,
                created=created,
                model=model,
                reply=reply,
                usage=usage,
                include_usage=include_usage,
                obfuscation=obfuscation,
                interleave=self.config.interleave_tool_calls,
                service_tier=tier,
                replies=replies,
                logprobs=logprobs,
            )
            if self.config.refuse_stream_options and chunks:
                # (Mistral, which refuses the option, puts the usage in its last chunk unasked)
                chunks[-1]["usage"] = usage
            events = [encode_event(c) for c in chunks] + [DONE]
            return PacedResponse(
                self._stream_body(events, fault, controls.stall_s),
                media_type="text/event-stream; charset=utf-8",
                headers={**SSE_HEADERS, "x-request-id": request_id},
            )
        obj = completion_object(
            dialect=dialect,
            completion_id=completion_id,
            created=created,
            model=model,
            reply=reply,
            usage=usage,
            service_tier=tier,
            replies=replies,
            logprobs=logprobs,
        )
        return self._plain_body(orjson.dumps(obj), fault, controls.stall_s, request_id)

    def _status_fault(self, fault: str) -> Response:
        headers = {"retry-after": str(self.config.retry_after_s)} if fault == "429" else None
        return _json_response(STATUS_FAULT_BODIES[fault], int(fault), headers)

    async def _ttft(self) -> AsyncGenerator[bytes, None]:
        """Wait for the first token, with keep-alive comments if configured."""
        remaining = self.config.ttft_ms / 1000
        if not self.config.keepalive:
            await anyio.sleep(remaining)
            return
        interval = self.config.keepalive_interval_ms / 1000
        yield KEEPALIVE
        while remaining > 0:
            step = min(remaining, interval)
            await anyio.sleep(step)
            remaining -= step
            if remaining > 1e-6:
                yield KEEPALIVE

    async def _stream_body(
        self, events: list[bytes], fault: str | None, stall_s: float
    ) -> AsyncGenerator[bytes, None]:
        async for comment in self._ttft():
            yield comment
        strike = _fault_index(len(events))
        for i, event in enumerate(events):
            if i:
                await anyio.sleep(self.config.chunk_ms / 1000)
            if i == strike and fault is not None:
                logger.info("simulated fault %s after %d events", fault, i)
                if fault == "reset":
                    raise SimulatedReset(fault)
                if fault == "stall":
                    await anyio.sleep(stall_s)
                elif fault == "malformed":
                    yield _truncated(event.rstrip(b"\n")) + b"\n\n"
                elif fault == "error_event":
                    yield encode_event(error_object(SERVER_ERROR_TEXT, "server_error"))
                    return
            yield event

    def _plain_body(
        self, body: bytes, fault: str | None, stall_s: float, request_id: str
    ) -> PacedResponse:
        if fault == "malformed":
            body = _truncated(body)
        elif fault == "error_event":
            body = orjson.dumps(error_object(SERVER_ERROR_TEXT, "server_error"))

        async def paced() -> AsyncGenerator[bytes, None]:
            await anyio.sleep(self.config.ttft_ms / 1000)
            if fault == "stall":
                await anyio.sleep(stall_s)
            if fault == "reset":
                yield _truncated(body)
                raise SimulatedReset(fault)
            yield body

        headers = {"content-length": str(len(body)), "x-request-id": request_id}
        return PacedResponse(
            paced(), media_type="application/json", headers=headers, start_at_once=False
        )

    async def _json_request(self, request: Request) -> tuple[ReceivedRequest, dict[str, Any]]:
        """The request recorded, and its body: a JSON object, else status 400 recorded."""
        raw = await request.body()
        received = self.sim.record(request.method, request.url.path, dict(request.headers), raw)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            received.status = 400
            return received, {}
        received.body = body
        return received, body

    async def _responses_request(
        self, request: Request
    ) -> tuple[_Controls, ReceivedRequest, dict[str, Any], str, list[bytes]] | Response:
        """A Responses API request (``responses``, ``compact``) read and checked as OpenAI
        checks it: its controls, its record (the fault drawn for it in ``fault``), its body,
        model and tokens; or the answer to it (a bad control, no JSON, a status fault, a missing
        model, a broken pairing of its input items, an input over the context window)."""
        headers = dict(request.headers)
        try:
            controls = _parse_controls(headers, self.config)
            # (the clock moves first, as on the chat route: an expiry on the Responses route)
            advance = _seconds(headers.get("x-sim-time-advance", "0"), "X-Sim-Time-Advance")
            if advance:
                self.sim.advance(advance)
        except ValueError as exc:
            return _error(400, str(exc), None, "invalid_sim_control")
        received, body = await self._json_request(request)
        if received.status == 400:
            return _error(400, BAD_JSON_TEXT)
        fault = controls.fault or self.sim.draw_fault()
        received.fault = fault
        if fault in STATUS_FAULTS:
            received.status = int(fault)
            return self._status_fault(fault)
        model = body.get("model")
        try:
            if not isinstance(model, str) or not model:
                raise ValidationError("Missing required parameter: 'model'.", "model")
            validate_response_input(body)
            previous = body.get("previous_response_id")
            if isinstance(previous, str):
                validate_stored_calls(body, self.sim.response_calls.get(previous, ()))
        except ValidationError as exc:
            received.status = 400
            return _error(400, exc.message, exc.param, exc.code)
        tokens = response_tokens(body)
        if len(tokens) > self.config.context_window:  # (Codex CLI compacts on this code)
            received.status = 400
            return _error(400, RESPONSES_CONTEXT_TEXT, "input", "context_length_exceeded")
        return controls, received, body, model, tokens

    async def responses(self, request: Request) -> Response | PacedResponse:
        """``POST /v1/responses``: OpenAI's checks of the input items' tool pairing, then the next
        scripted reply (its text as an assistant message, its calls as ``function_call`` items),
        else a message ``Done.``, streamed as the Responses API's events when asked, paced and
        faulted as a chat answer. Its calls are kept by its id: a request that continues it
        (``previous_response_id``) must give their outputs, as OpenAI refuses otherwise (``No
        tool output found for function call …``); nothing else of it is stored."""
        checked = await self._responses_request(request)
        if isinstance(checked, Response):
            return checked
        controls, received, body, model, tokens = checked
        fault = received.fault
        reply = controls.script or self.sim.take_scripted() or Reply("Done.")
        fault = fault or reply.fault
        received.fault = fault
        if fault in STATUS_FAULTS:
            received.status = int(fault)
            return self._status_fault(fault)
        if not reply.content and not reply.tool_calls:
            reply = Reply("Done.")
        new_id = self.sim.new_id
        output = [response_message(new_id("msg_", 32), reply.content)] if reply.content else []
        output += (
            response_call(
                new_id("fc_", 32), call.id or new_id("call_", 24), call.name, call.arguments
            )
            for call in reply.tool_calls
        )
        cache = self._responses_cache(body, tokens, model)  # (the prefix cache chat's use)
        response_id = new_id("resp_", 32)
        calls = tuple((item["call_id"], "function call") for item in output if "call_id" in item)
        if calls:
            self.sim.store_response(response_id, calls)
        done = response_object(
            response_id=response_id,
            created=int(self.sim.now),
            model=model,
            output=output,
            usage=response_usage(
                len(tokens), completion_tokens(reply), cache.read, reply.reasoning_tokens
            ),
            request=body,
        )
        received.usage = done["usage"]
        received.status = 200
        self.sim.keep_response(done)
        request_id = new_id("req_", 24)
        if body.get("stream") is True:
            return PacedResponse(
                self._stream_body(response_events(done), fault, controls.stall_s),
                media_type="text/event-stream; charset=utf-8",
                headers={**SSE_HEADERS, "x-request-id": request_id},
            )
        return self._plain_body(orjson.dumps(done), fault, controls.stall_s, request_id)

    def _kept_a_day(self, body: dict[str, Any]) -> bool:
        """OpenAI's extended retention: ``"prompt_cache_retention": "24h"`` keeps the prompt's
        prefix a day (chat and the Responses API alike)."""
        return self.config.dialect == "openai" and body.get("prompt_cache_retention") == "24h"

    def _responses_cache(self, body: dict[str, Any], tokens: list[bytes], model: str) -> Any:
        """A Responses API request through the prefix cache: kept a day under
        ``"prompt_cache_retention": "24h"`` (OpenAI's extended retention), as on chat."""
        if self._kept_a_day(body):
            return self.sim.process_prompt(
                tokens, model, None, len(tokens), None, EXTENDED_TTL_S, None
            )
        return self.sim.process_prompt(tokens, model)

    async def stored(self, request: Request) -> Response:
        """``GET /v1/responses/{id}``: an answer it gave, whole (as OpenAI gives back a stored
        response, its client having cut its stream or not), else OpenAI's 404."""
        received = self.sim.record(request.method, request.url.path, dict(request.headers), b"")
        response_id = request.path_params["response_id"]
        found = self.sim.stored_response(response_id)
        if found is None:
            received.status = 404
            return _error(404, f"Response with id '{response_id}' not found.", None)
        received.status = 200
        return _json_response(found, 200)

    async def compact(self, request: Request) -> Response:
        """``POST /v1/responses/compact`` (Codex CLI's remote compaction): the same checks of the
        input items as ``responses``, then a ``response.compaction`` object, never streamed: the
        input's user messages, then one ``compaction`` item whose ``encrypted_content`` is a
        Fernet-shaped token of ~1.4 KB (a digest of the input: the same input, the same token),
        billed as the request's prompt (its cached part from the prefix cache) and a tenth of it
        as output (16 to 2,000 tokens). Status faults apply; stream faults do not."""
        checked = await self._responses_request(request)
        if isinstance(checked, Response):
            return checked
        _, received, body, model, tokens = checked
        new_id = self.sim.new_id
        items = body.get("input")
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items
        kept = [
            compacted_user_message(new_id("msg_", 32), item.get("content"))
            for item in (items if isinstance(items, list) else ())
            if isinstance(item, dict) and item.get("role") == "user"
        ]
        digest = hashlib.sha256(orjson.dumps(items, option=orjson.OPT_SORT_KEYS)).digest()
        sealed = "gAAAAA" + base64.urlsafe_b64encode(digest * 32).decode()
        kept.append({"id": new_id("cmp_", 32), "type": "compaction", "encrypted_content": sealed})
        cache = self._responses_cache(body, tokens, model)
        written = min(2000, max(16, len(tokens) // 10))
        usage = response_usage(len(tokens), written, cache.read)
        answer = {
            "id": new_id("resp_", 32),
            "object": "response.compaction",
            "created_at": int(self.sim.now),
            "output": kept,
            "usage": usage,
        }
        received.usage = usage
        received.status = 200
        return _json_response(answer, headers={"x-request-id": new_id("req_", 24)})

    async def models(self, request: Request) -> Response:
        self.sim.record(request.method, request.url.path, dict(request.headers), b"").status = 200
        created = int(self.config.start_time)
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "cachegate-sim"}
            for m in self.config.model_ids
        ]
        return _json_response({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}``: any name is a model here (as any is served)."""
        self.sim.record(request.method, request.url.path, dict(request.headers), b"").status = 200
        name = request.path_params["model"]
        created = int(self.config.start_time)
        return _json_response(
            {"id": name, "object": "model", "created": created, "owned_by": "cachegate-sim"}
        )

    async def embeddings(self, request: Request) -> Response:
        received, body = await self._json_request(request)
        if received.status == 400:
            return _error(400, BAD_JSON_TEXT)
        inputs = body.get("input")
        if isinstance(inputs, str) or (
            isinstance(inputs, list) and inputs and isinstance(inputs[0], int)
        ):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs:
            received.status = 400
            return _error(400, "'input' must be a non-empty string or array", "input")
        dims = body.get("dimensions") or self.config.embedding_dimensions
        if not isinstance(dims, int) or dims < 1:
            received.status = 400
            return _error(400, "'dimensions' must be a positive integer", "dimensions")
        model = str(body.get("model", ""))
        as_base64 = body.get("encoding_format") == "base64"
        data = []
        prompt = 0
        for index, item in enumerate(inputs):
            prompt += (
                count_tokens(item)
                if isinstance(item, str)
                else len(item)
                if isinstance(item, list)
                else 1
            )
            vector = embed(item, model, dims)
            encoded: Any = (
                base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
                if as_base64
                else vector
            )
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        usage = {"prompt_tokens": prompt, "total_tokens": prompt}
        received.status = 200
        received.usage = usage
        return _json_response({"object": "list", "data": data, "model": model, "usage": usage})

    # -- admin routes ---------------------------------------------------------------------------

    async def clock(self, request: Request) -> Response:
        if request.method == "POST":
            try:
                advance_s = orjson.loads(await request.body()).get("advance_s")
                if isinstance(advance_s, bool) or not isinstance(advance_s, int | float):
                    raise ValueError
                try:
                    self.sim.advance(advance_s)
                except ValueError as exc:  # (a time past any the clock can hold: said so)
                    return _error(400, str(exc), "advance_s")
            except (orjson.JSONDecodeError, AttributeError, ValueError):
                return _error(400, 'expected {"advance_s": seconds >= 0}', "advance_s")
        return _json_response({"now": self.sim.now})

    async def requests(self, request: Request) -> Response:
        return _json_response({"requests": [r.to_json() for r in list(self.sim.requests)]})

    async def reset(self, request: Request) -> Response:
        self.sim.reset()
        return _json_response({"reset": True, "now": self.sim.now})

    async def script(self, request: Request) -> Response:
        try:
            obj = orjson.loads(await request.body())
            if isinstance(obj, dict) and "responses" in obj:
                obj = obj["responses"]
            items = obj if isinstance(obj, list) else [obj]
            replies = [parse_script(item) for item in items]
        except orjson.JSONDecodeError:
            return _error(400, BAD_JSON_TEXT)
        except ValueError as exc:
            return _error(400, str(exc), "responses")
        return _json_response({"queued": self.sim.enqueue(replies)})


def embed(item: Any, model: str, dimensions: int) -> list[float]:
    """A deterministic unit vector for one embeddings input."""
    digest = hashlib.blake2b(orjson.dumps([model, item]), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "big"))
    vector = [rng.gauss(0.0, 1.0) for _ in range(dimensions)]
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


class _BrowserGuarded:
    """cachegate's browser guard before the simulator: a page whose name was re-pointed at this
    machine (DNS rebinding), which could read the answers, is refused (403). The simulator
    serves what it received (``/_sim/requests``: prompts, a key masked). On its API, a page on
    another origin cannot read them (no CORS), and a cachegate in front passes on the Origin of
    the pages it lets through (``server.allowed_origins``): not judged there. Its own routes
    (``/_sim/…``) judge the Origin too: a page's cross-site POST needs no preflight, and queued a
    script (a tool call an agent then runs), reset it or moved its clock."""

    def __init__(self, app: ASGIApp, bind_host: str) -> None:
        self.app = app
        self.guard = BrowserGuard(bind_host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            own = scope["path"].startswith("/_sim")
            headers = {
                name: v.decode("latin-1")
                for k, v in scope["headers"]
                if (name := k.decode("latin-1")) != "origin" or own
            }
            refusal = self.guard.refusal(headers)
            if refusal is not None:
                if refusal.code == "forbidden_host":  # (it has no server.allowed_hosts)
                    refusal = ProxyError(
                        403,
                        f"Host {headers.get('host', '')!r} is refused by the simulator (a web"
                        " page's name re-pointed at this machine could read its answers): reach"
                        " it at http://127.0.0.1:PORT or http://localhost:PORT, or, listening"
                        " beyond the machine, by an address or a name without a dot.",
                        code="forbidden_host",
                    )
                elif own and refusal.code == "forbidden_origin":  # (cachegate's words do not fit)
                    refusal = ProxyError(
                        403,
                        f"The simulator's own routes ({scope['path']}) take requests from pages on"
                        f" this machine only, not from origin {headers.get('origin', '')!r}.",
                        code="forbidden_origin",
                    )
                await send_error(send, refusal)
                return
        await self.app(scope, receive, send)


def create_simulator_app(
    config: SimConfig | None = None,
    *,
    simulator: Simulator | None = None,
    bind_host: str = "127.0.0.1",
) -> Starlette:
    """The simulator as an ASGI app; its state is ``app.state.simulator``.

    Pass ``simulator`` to share state you already hold (its config then wins over ``config``);
    ``bind_host``, the address it listens on, for the browser guard (``_BrowserGuarded``).
    """
    sim = simulator or Simulator(config)
    handlers = _Handlers(sim)
    _install_quiet_reset()
    routes = [
        Route("/v1/chat/completions", handlers.chat, methods=["POST"]),
        Route("/v1/responses", handlers.responses, methods=["POST"]),
        Route("/v1/responses/compact", handlers.compact, methods=["POST"]),
        Route("/v1/responses/{response_id}", handlers.stored, methods=["GET"]),
        Route("/v1/models", handlers.models, methods=["GET"]),
        Route("/v1/models/{model:path}", handlers.model, methods=["GET"]),
        Route("/v1/embeddings", handlers.embeddings, methods=["POST"]),
        Route("/_sim/clock", handlers.clock, methods=["GET", "POST"]),
        Route("/_sim/requests", handlers.requests, methods=["GET"]),
        Route("/_sim/reset", handlers.reset, methods=["POST"]),
        Route("/_sim/script", handlers.script, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error},
        middleware=[Middleware(_BrowserGuarded, bind_host=bind_host)],
    )
    app.state.simulator = sim
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    """An unknown path or a wrong method, answered as OpenAI words it (in its error shape)."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    what = "Invalid method for URL" if status == 405 else "Invalid URL"
    return _error(status, f"{what} ({request.method} {request.url.path})")


@dataclass(frozen=True, slots=True)
class RunningSimulator:
    """A simulator served on a loopback port: ``url`` (no ``/v1``), ``api_base`` and its state."""

    server: ServerThread
    sim: Simulator

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def api_base(self) -> str:
        """The base URL an OpenAI client takes (``url`` + ``/v1``)."""
        return self.server.url + "/v1"


@contextmanager
def run_simulator(
    config: SimConfig | None = None, *, host: str = "127.0.0.1", port: int = 0
) -> Iterator[RunningSimulator]:
    """Serve a fresh simulator in a background thread for the duration of the ``with`` block."""
    sim = Simulator(config)
    app = create_simulator_app(simulator=sim, bind_host=host)
    with ServerThread(app, host=host, port=port) as server:
        yield RunningSimulator(server=server, sim=sim)
