"""A raw-socket HTTP/1.1 client for the benchmark: no client library in the measured path.

Non-streaming requests reuse one keep-alive connection; each stream gets its own connection, read
by a protocol in the transport's callback, and every SSE event is timestamped as the chunk holding
its end arrives. A closed-loop load generator (the
fallback when ``wrk`` is not installed) runs ``concurrency`` such connections back to back.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from dataclasses import dataclass, field


class HttpError(Exception):
    """The server answered something this client cannot read."""


def build_request(host: str, port: int, path: str, body: bytes, extra: bytes = b"") -> bytes:
    """One POST request's bytes, JSON body, keep-alive."""
    return (
        b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer sk-bench\r\ncontent-length: %d\r\n%s\r\n"
        % (path.encode(), host.encode(), port, len(body), extra)
    ) + body


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    return _parse_head((await reader.readuntil(b"\r\n\r\n"))[:-4])


async def _read_body(reader: asyncio.StreamReader, headers: dict[bytes, bytes]) -> bytes:
    if b"content-length" in headers:
        return await reader.readexactly(int(headers[b"content-length"]))
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        parts: list[bytes] = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                return b"".join(parts)
            parts.append(data[:-2])
    return await reader.read()


class Connection:
    """One keep-alive connection for sequential non-streaming requests."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self._reader, self._writer

    async def post(self, payload: bytes) -> tuple[int, bytes, float]:
        """Send a prepared request (``build_request``); status, body and seconds to the last byte."""
        reader, writer = await self._open()
        t0 = time.perf_counter()
        writer.write(payload)
        try:
            status, headers = await _read_head(reader)
            body = await _read_body(reader, headers)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.close()
            raise
        elapsed = time.perf_counter() - t0
        if headers.get(b"connection", b"").lower() == b"close":
            self.close()
        return status, body, elapsed

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


@dataclass
class StreamResult:
    """One stream as the client saw it."""

    status: int = 0
    ttfb_s: float | None = None  # request sent → first complete SSE event
    event_times: list[float] = field(default_factory=list)  # perf_counter of each event's end
    events: int = 0
    digest: str = ""
    error: str | None = None
    hung_up_at: float | None = None  # time.monotonic() when the client closed the socket early

    def gaps(self) -> list[float]:
        """Seconds between consecutive events after the first."""
        t = self.event_times
        return [b - a for a, b in itertools.pairwise(t)]


class _Incomplete(Exception):
    """The connection ended before the response did."""


class _StreamProtocol(asyncio.Protocol):
    """Reads one streamed response in the transport's own callback: no task switch and no
    ``await`` per chunk, so a thousand streams cost the load generator little CPU (it shares a
    core with the mock and must not be what delays them). Every chunk that ends an SSE event is
    timestamped as it arrives; the de-chunked body feeds the digest."""

    def __init__(self, result: StreamResult, hang_up_after_events: int | None) -> None:
        self.result = result
        self.hang_up_after_events = hang_up_after_events
        self.t0 = 0.0
        self.sha = hashlib.sha256()
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self._buf = b""
        self._head = True
        self._chunked = False
        self._remaining = -1  # content-length left; -1: until the connection closes
        self._chunk_left = 0  # bytes of the current chunk still to come (+2 for its CRLF)
        self._pending = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            if exc is not None:
                self.done.set_exception(exc)
            elif self._remaining < 0 and not self._chunked and not self._head:
                self.done.set_result(None)  # a close-delimited body ends here
            else:
                self.done.set_exception(_Incomplete())

    def _finish(self, exc: Exception | None = None) -> None:
        if not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        now = time.perf_counter()
        if self._head:
            data = self._buf + data
            end = data.find(b"\r\n\r\n")
            if end < 0:
                self._buf = data
                return
            self._buf = b""
            try:
                status, headers = _parse_head(data[:end])
            except (HttpError, ValueError) as exc:
                self._finish(exc)
                return
            self._head = False
            self.result.status = status
            self._chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
            try:
                self._remaining = int(headers.get(b"content-length", b"-1"))
            except ValueError as exc:
                self._finish(exc)
                return
            data = data[end + 4 :]
            if not self._chunked and self._remaining == 0:
                self._finish()
                return
        if self._chunked:
            try:
                body, ended = self._dechunk(data)
            except ValueError as exc:
                self._finish(exc)
                return
        else:
            body = data if self._remaining < 0 else data[: self._remaining]
            if self._remaining >= 0:
                self._remaining -= len(body)
            ended = self._remaining == 0
        if body:
            self._take(body, now)
        if ended:
            self._finish()

    def _dechunk(self, data: bytes) -> tuple[bytes, bool]:
        buf = self._buf + data if self._buf else data
        self._buf = b""
        parts: list[bytes] = []
        pos = 0
        while pos < len(buf):
            if self._chunk_left:
                take = buf[pos : pos + self._chunk_left]
                self._chunk_left -= len(take)
                pos += len(take)
                # the chunk's data, without the CRLF that closes it
                data_left = self._chunk_left - 2
                parts.append(take[: len(take) + min(0, data_left)])
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                self._buf = buf[pos:]
                break
            size = int(buf[pos:eol].split(b";")[0], 16)
            pos = eol + 2
            if size == 0:
                return b"".join(parts), True
            self._chunk_left = size + 2
        return b"".join(parts), False

    def _take(self, data: bytes, now: float) -> None:
        result = self.result
        self.sha.update(data)
        pending = self._pending + data
        n = pending.count(b"\n\n")
        if n:
            if result.ttfb_s is None:
                result.ttfb_s = now - self.t0
            result.events += n
            result.event_times.extend([now] * n)
            pending = pending[pending.rfind(b"\n\n") + 2 :]
            limit = self.hang_up_after_events
            if limit is not None and result.events >= limit:
                self._finish()
        self._pending = pending


def _parse_head(head: bytes) -> tuple[int, dict[bytes, bytes]]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise HttpError(f"bad status line {lines[0]!r}")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
    return int(parts[1]), headers


async def stream(
    host: str,
    port: int,
    payload: bytes,
    *,
    hang_up_after_events: int | None = None,
    hang_up_after_s: float | None = None,
    timeout_s: float = 60.0,
) -> StreamResult:
    """Run one stream; optionally hang up after some events or some seconds and note when."""
    result = StreamResult()
    loop = asyncio.get_running_loop()
    try:
        transport, proto = await loop.create_connection(
            lambda: _StreamProtocol(result, hang_up_after_events), host, port
        )
    except OSError as exc:
        result.error = f"connect: {exc}"
        return result
    proto.t0 = time.perf_counter()
    transport.write(payload)
    try:
        if hang_up_after_s is not None:
            await asyncio.sleep(hang_up_after_s)
        else:
            await asyncio.wait_for(asyncio.shield(proto.done), timeout_s)
    except (TimeoutError, _Incomplete, ConnectionError, HttpError, ValueError) as exc:
        result.error = "IncompleteReadError" if isinstance(exc, _Incomplete) else type(exc).__name__
    if hang_up_after_events is not None or hang_up_after_s is not None:
        result.hung_up_at = time.monotonic()
    transport.close()
    if not proto.done.done():
        proto.done.cancel()
    elif not proto.done.cancelled():
        proto.done.exception()  # retrieved: no "never retrieved" warning
    result.digest = proto.sha.hexdigest()
    return result


@dataclass
class LoadResult:
    """A closed-loop run: completed requests, errors, seconds."""

    requests: int
    errors: int
    seconds: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


async def closed_loop(
    host: str, port: int, payload: bytes, concurrency: int, duration_s: float
) -> LoadResult:
    """``concurrency`` keep-alive connections, each sending the next request as soon as one ends."""
    done = 0
    errors = 0
    deadline = time.perf_counter() + duration_s

    async def worker() -> None:
        nonlocal done, errors
        conn = Connection(host, port)
        while time.perf_counter() < deadline:
            try:
                status, _, _ = await conn.post(payload)
            except (OSError, asyncio.IncompleteReadError, HttpError):
                errors += 1
                continue
            if status == 200:
                done += 1
            else:
                errors += 1
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return LoadResult(done, errors, time.perf_counter() - t0)
