"""A mock OpenAI upstream that is never the bottleneck: raw ASGI, no framework, canned bytes.

Mode A (``stream`` absent or false): an instant ~1 KB ``chat.completion``.
Mode B (``"stream": true``): headers and the first event after ``first_token_ms``, then one delta of
~120 bytes every ``interval_ms`` (on an absolute schedule, so gaps do not drift), a finish chunk, a
usage-only chunk when ``stream_options.include_usage`` is set (as OpenAI sends it), then ``[DONE]``.
Mode C (large agent bodies): the same instant answer as mode A, whatever the body size.

Every stream's bytes are the same for every request, so a digest of what a client received through a
proxy can be compared with one received directly. The request's ``user`` field names it; the handler
records when it sees ``http.disconnect`` for that name (``GET /__bench/disconnects``), so the runner
can time how long an upstream keeps a socket open after its client hung up.

Run as its own process: ``python -m bench.mock_upstream --port N`` (uvicorn, httptools, uvloop).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

_STREAM_RE = re.compile(rb'"stream"\s*:\s*true')
_USAGE_RE = re.compile(rb'"include_usage"\s*:\s*true')
_USER_RE = re.compile(rb'"user"\s*:\s*"([A-Za-z0-9._:-]{1,64})"')
_CREATED = 1700000000
_MODEL = "gpt-4o-mini"

Scope = dict[str, Any]


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
    """Mode B's events, each a whole ``data: …\\n\\n`` of ~120 bytes, ending with ``[DONE]``."""
    head = b'data: {"id":"chatcmpl-bench-b","object":"chat.completion.chunk","created":1700000000,"model":"gpt-4o-mini","choices":[{"index":0,"delta":'
    events = []
    for i in range(deltas):
        role = b'"role":"assistant",' if i == 0 else b""
        events.append(head + b"{" + role + b'"content":"w%03d "},"finish_reason":null}]}\n\n' % i)
    events.append(head + b'{},"finish_reason":"stop"}]}\n\n')
    if include_usage:
        events.append(
            b'data: {"id":"chatcmpl-bench-b","object":"chat.completion.chunk","created":1700000000,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":412,"completion_tokens":64,"total_tokens":476,"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
        )
    events.append(b"data: [DONE]\n\n")
    return events


@dataclass
class MockUpstream:
    """The raw ASGI app; ``disconnects`` maps a request's ``user`` to when its handler saw it leave."""

    shape: StreamShape = field(default_factory=StreamShape)
    disconnects: dict[str, float] = field(default_factory=dict)
    arrivals: dict[str, float] = field(default_factory=dict)
    requests: int = 0

    def __post_init__(self) -> None:
        self._completion = completion_body()
        self._events = {flag: stream_events(self.shape.deltas, flag) for flag in (False, True)}

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":
            await self._get(scope, send)
            return
        message = await receive()
        body = message.get("body", b"")
        if message.get("more_body", False):
            parts = [body]
            while message.get("more_body", False):
                message = await receive()
                parts.append(message.get("body", b""))
            body = b"".join(parts)
        self.requests += 1
        # Only the first 512 bytes name the mode: clients put these keys first, and a 600 KB body is
        # never scanned whole (cachegate splices stream_options at the front).
        head = body[:512] + body[-512:]
        if _STREAM_RE.search(head):
            match = _USER_RE.search(head)
            name = match.group(1).decode() if match else ""
            await self._stream(receive, send, bool(_USAGE_RE.search(head)), name)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(self._completion)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": self._completion})

    async def _get(self, scope: Scope, send: Any) -> None:
        if scope["path"] == "/__bench/disconnects":
            payload = orjson.dumps(
                {
                    "disconnects": self.disconnects,
                    "arrivals": self.arrivals,
                    "requests": self.requests,
                }
            )
            status = 200
        elif scope["path"] == "/__bench/reset":
            self.disconnects.clear()
            self.arrivals.clear()
            payload, status = b"{}", 200
        elif scope["path"] in ("/healthz", "/v1/models"):
            payload = b'{"object":"list","data":[{"id":"gpt-4o-mini","object":"model"}]}'
            status = 200
        else:
            payload, status = b'{"error":{"message":"not found"}}', 404
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def _stream(self, receive: Any, send: Any, include_usage: bool, name: str) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        if name:
            self.arrivals[name] = time.monotonic()
        task = asyncio.current_task()
        gone = False

        async def watch() -> None:
            nonlocal gone
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone = True
                    if name:
                        self.disconnects[name] = time.monotonic()
                    if task is not None:
                        task.cancel()
                    return

        watcher = loop.create_task(watch())
        shape = self.shape
        try:
            await asyncio.sleep(shape.first_token_ms / 1000.0)
            if gone:
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                    ],
                }
            )
            events = self._events[include_usage]
            last = len(events) - 1
            for i, event in enumerate(events):
                if i:
                    due = start + (shape.first_token_ms + i * shape.interval_ms) / 1000.0
                    delay = due - loop.time()
                    if delay > 0 and i < last - (1 if include_usage else 0):
                        await asyncio.sleep(delay)
                    if gone:
                        return
                await send({"type": "http.response.body", "body": event, "more_body": i < last})
        except asyncio.CancelledError:
            if not gone:
                raise
        finally:
            if not watcher.done():
                watcher.cancel()


def main(argv: list[str] | None = None) -> None:
    """Serve the mock with uvicorn: one worker, httptools, uvloop, no access log."""
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9901)
    parser.add_argument("--first-token-ms", type=float, default=100.0)
    parser.add_argument("--deltas", type=int, default=64)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    ns = parser.parse_args(argv)
    app = MockUpstream(StreamShape(ns.first_token_ms, ns.deltas, ns.interval_ms))
    uvicorn.run(
        app,
        host=ns.host,
        port=ns.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        server_header=False,
        date_header=False,
        backlog=4096,
        timeout_keep_alive=60,
    )


if __name__ == "__main__":
    main()
