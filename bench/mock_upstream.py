"""A mock OpenAI upstream that is never the bottleneck: asyncio protocols, no framework, canned bytes.

Mode A (``stream`` absent or false): an instant ~1 KB ``chat.completion``.
Mode B (``"stream": true``): headers and the first event after ``first_token_ms``, then one delta
event of ~200-230 bytes every ``interval_ms`` (on an absolute schedule, so gaps do not drift), a finish chunk, a
usage-only chunk when ``stream_options.include_usage`` is set (as OpenAI sends it), then ``[DONE]``.
Mode C (large agent bodies): the same instant answer as mode A, whatever the body size.

Every stream's bytes are the same for every request, so a digest of what a client received through a
proxy can be compared with one received directly. The request's ``user`` field names it; the mock
records when the connection of an unfinished stream closes (``GET /__bench/disconnects``), so the
runner can time how long an upstream keeps a socket open after its client hung up.

Run as its own process: ``python -m bench.mock_upstream --port N`` (httptools, uvloop). It shares a
core with the load generator, so it answers from the transport's callbacks and timers: an ASGI
server's task and messages per event cost ~15 µs each, enough to delay a thousand streams.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import time
from dataclasses import dataclass, field

import httptools
import orjson

_STREAM_RE = re.compile(rb'"stream"\s*:\s*true')
_USAGE_RE = re.compile(rb'"include_usage"\s*:\s*true')
_USER_RE = re.compile(rb'"user"\s*:\s*"([A-Za-z0-9._:-]{1,64})"')
_CREATED = 1700000000
_MODEL = "gpt-4o-mini"


@dataclass(frozen=True)
class StreamShape:
    """The timing and size of a mode-B stream."""

    first_token_ms: float = 100.0
    deltas: int = 64
    interval_ms: float = 20.0


def completion_body() -> bytes:
    """Mode A's answer: one ~1 KB chat completion with usage."""
    text = (
        "The quick brown fox jumps over the lazy dog while the proxy relays every byte unchanged. "
        * 8
    )
    return orjson.dumps(
        {
            "id": "chatcmpl-bench-a",
            "object": "chat.completion",
            "created": _CREATED,
            "model": _MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text.strip(), "refusal": None},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": 412,
                "completion_tokens": 150,
                "total_tokens": 562,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
            "system_fingerprint": "fp_bench",
        }
    )


def stream_events(deltas: int, include_usage: bool) -> list[bytes]:
    """Mode B's events, each a whole ``data: …\\n\\n`` of ~200-230 bytes, ending with ``[DONE]``.
    As OpenAI has sent them since August 2025, each chunk ends with an ``obfuscation`` padding
    string; with ``include_usage``, a null ``usage`` stands before it in every chunk, and a
    usage-only chunk comes before ``[DONE]``."""
    head = b'data: {"id":"chatcmpl-bench-b","object":"chat.completion.chunk","created":1700000000,"model":"gpt-4o-mini","choices":[{"index":0,"delta":'
    nulls = b',"usage":null' if include_usage else b""
    events = []
    for i in range(deltas):
        role = b'"role":"assistant",' if i == 0 else b""
        pad = b',"obfuscation":"%s"}\n\n' % b"Xq7pL2mZ"[: 1 + i % 8]
        delta = b'"content":"w%03d "},"finish_reason":null}]' % i
        events.append(head + b"{" + role + delta + nulls + pad)
    events.append(head + b'{},"finish_reason":"stop"}]' + nulls + b',"obfuscation":"Rk"}\n\n')
    if include_usage:
        events.append(
            b'data: {"id":"chatcmpl-bench-b","object":"chat.completion.chunk","created":1700000000,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":412,"completion_tokens":64,"total_tokens":476,"prompt_tokens_details":{"cached_tokens":0}},"obfuscation":"m3"}\n\n'
        )
    events.append(b"data: [DONE]\n\n")
    return events


_OK_JSON = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n%s\r\n"
)
_CLOSE = b"connection: close\r\n"


def _json_response(payload: bytes, status: bytes = b"200 OK", keep_alive: bool = True) -> bytes:
    head = _OK_JSON.replace(b"200 OK", status) % (len(payload), b"" if keep_alive else _CLOSE)
    return head + payload


@dataclass
class MockUpstream:
    """The shared state: ``disconnects`` maps a stream request's ``user`` to when its connection
    closed before the stream ended, ``arrivals`` to when the request arrived."""

    shape: StreamShape = field(default_factory=StreamShape)
    disconnects: dict[str, float] = field(default_factory=dict)
    arrivals: dict[str, float] = field(default_factory=dict)
    requests: int = 0

    def __post_init__(self) -> None:
        self.completion = completion_body()
        # Each event framed as one HTTP/1.1 chunk; the last one also ends the body.
        self.framed: dict[bool, list[bytes]] = {}
        for flag in (False, True):
            chunks = [b"%x\r\n%s\r\n" % (len(e), e) for e in stream_events(self.shape.deltas, flag)]
            chunks[-1] += b"0\r\n\r\n"
            self.framed[flag] = chunks

    def get(self, path: bytes) -> tuple[bytes, bytes]:
        """(status, JSON payload) for a GET."""
        if path == b"/__bench/disconnects":
            payload = {"disconnects": self.disconnects, "arrivals": self.arrivals}
            return b"200 OK", orjson.dumps({**payload, "requests": self.requests})
        if path == b"/__bench/reset":
            self.disconnects.clear()
            self.arrivals.clear()
            return b"200 OK", b"{}"
        if path in (b"/healthz", b"/v1/models"):
            return b"200 OK", b'{"object":"list","data":[{"id":"gpt-4o-mini","object":"model"}]}'
        return b"404 Not Found", b'{"error":{"message":"not found"}}'


class _Stream:
    """One mode-B answer in progress: which event is next and when it is due."""

    __slots__ = ("events", "index", "name", "paced", "start", "timer")

    def __init__(self, events: list[bytes], name: str, paced: int, start: float) -> None:
        self.events = events
        self.name = name
        self.paced = paced  # events before this index wait for their time; the rest follow at once
        self.start = start
        self.index = 0
        self.timer: asyncio.TimerHandle | None = None


class MockProtocol(asyncio.Protocol):
    """One client connection: httptools parses the requests, answers are written from the
    transport's callbacks and timers (no task per request or per event), so the mock costs a few
    microseconds per event and stays far from being the bottleneck. Requests on a keep-alive
    connection are answered in order."""

    def __init__(self, app: MockUpstream) -> None:
        self.app = app
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self._url = b""
        self._body: list[bytes] = []
        self._queue: list[tuple[bytes, bytes, bytes, bool]] = []
        self._stream: _Stream | None = None
        self._keep_alive = True

    # -- transport callbacks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            if stream.timer is not None:
                stream.timer.cancel()
            if stream.name:
                self.app.disconnects[stream.name] = time.monotonic()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(
                _json_response(
                    b'{"error":{"message":"bad request"}}', b"400 Bad Request", keep_alive=False
                )
            )
            self.transport.close()

    # -- parser callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        method = self.parser.get_method()
        request = (method, self._url, body, self.parser.should_keep_alive())
        if self._stream is not None or self._queue:
            self._queue.append(request)
        elif self._answer(*request):
            self._next()

    # -- answers ------------------------------------------------------------------------------

    def _answer(self, method: bytes, url: bytes, body: bytes, keep_alive: bool) -> bool:
        """Answer one request: True when the answer is complete, False when a stream began
        (its last event calls ``_next``)."""
        transport = self.transport
        assert transport is not None
        self._keep_alive = keep_alive
        app = self.app
        if method == b"GET":
            status, payload = app.get(url.split(b"?", 1)[0])
            transport.write(_json_response(payload, status, keep_alive))
            return True
        app.requests += 1
        # Only the first and last 512 bytes name the mode: clients put these keys first, and a
        # 600 KB body is never scanned whole (cachegate splices stream_options at the front).
        head = body[:512] + body[-512:]
        if not _STREAM_RE.search(head):
            transport.write(_json_response(app.completion, keep_alive=keep_alive))
            return True
        match = _USER_RE.search(head)
        name = match.group(1).decode() if match else ""
        if name:
            app.arrivals[name] = time.monotonic()
        usage = bool(_USAGE_RE.search(head))
        events = app.framed[usage]
        # Deltas and the finish chunk keep their schedule; a usage chunk and [DONE] follow at once.
        paced = len(events) - 1 - (1 if usage else 0)
        stream = _Stream(events, name, paced, self.loop.time())
        self._stream = stream
        stream.timer = self.loop.call_at(
            stream.start + app.shape.first_token_ms / 1000.0, self._tick, stream
        )
        return False

    def _tick(self, stream: _Stream) -> None:
        if stream is not self._stream:
            return
        transport = self.transport
        assert transport is not None
        shape = self.app.shape
        events = stream.events
        out: list[bytes] = []
        if stream.index == 0:  # the headers go out with the first event
            out.append(_STREAM_HEAD % (b"" if self._keep_alive else _CLOSE))
            out.append(events[0])
            stream.index = 1
        now = self.loop.time()
        while stream.index < len(events):
            i = stream.index
            if i < stream.paced:
                due = stream.start + (shape.first_token_ms + i * shape.interval_ms) / 1000.0
                if due > now:
                    stream.timer = self.loop.call_at(due, self._tick, stream)
                    break
            out.append(events[i])
            stream.index = i + 1
        transport.write(b"".join(out))
        if stream.index == len(events):
            self._stream = None
            self._next()

    def _next(self) -> None:
        """After an answer: close when the client asked to, else answer the queued requests in
        order (a loop, not recursion: a long pipelined burst is fine) until one is a stream."""
        assert self.transport is not None
        while True:
            if not self._keep_alive:
                self.transport.close()
                return
            if not self._queue or not self._answer(*self._queue.pop(0)):
                return


async def serve(app: MockUpstream, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: MockProtocol(app), host, port, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    """Serve the mock on uvloop (asyncio's own loop when uvloop is missing)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9901)
    parser.add_argument("--first-token-ms", type=float, default=100.0)
    parser.add_argument("--deltas", type=int, default=64)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    ns = parser.parse_args(argv)
    app = MockUpstream(StreamShape(ns.first_token_ms, ns.deltas, ns.interval_ms))
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    asyncio.run(serve(app, ns.host, ns.port))


if __name__ == "__main__":
    main()
