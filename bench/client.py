"""A raw-socket HTTP/1.1 client for the benchmark: no client library in the measured path.

Non-streaming requests reuse one keep-alive connection; each stream gets its own connection and every
SSE event is timestamped as the chunk holding its end arrives. A closed-loop load generator (the
fallback when ``wrk`` is not installed) runs ``concurrency`` such connections back to back.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    head = await reader.readuntil(b"\r\n\r\n")
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
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        result.error = f"connect: {exc}"
        return result
    t0 = time.perf_counter()
    writer.write(payload)
    sha = hashlib.sha256()
    pending = b""

    async def run() -> None:
        nonlocal pending
        if hang_up_after_s is not None:
            await asyncio.sleep(hang_up_after_s)
            return
        status, headers = await _read_head(reader)
        result.status = status
        chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        remaining = int(headers.get(b"content-length", b"-1"))
        while True:
            if chunked:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                data = await reader.readexactly(size + 2)
                if size == 0:
                    return
                data = data[:-2]
            else:
                if remaining == 0:
                    return
                data = await reader.read(65536 if remaining < 0 else min(remaining, 65536))
                if not data:
                    return
                remaining -= len(data)
            now = time.perf_counter()
            sha.update(data)
            pending += data
            n = pending.count(b"\n\n")
            if n:
                if result.ttfb_s is None:
                    result.ttfb_s = now - t0
                result.events += n
                result.event_times.extend([now] * n)
                pending = pending[pending.rfind(b"\n\n") + 2 :]
                if hang_up_after_events is not None and result.events >= hang_up_after_events:
                    return

    try:
        await asyncio.wait_for(run(), timeout_s)
    except (
        TimeoutError,
        asyncio.IncompleteReadError,
        ConnectionError,
        HttpError,
        ValueError,
    ) as exc:
        result.error = type(exc).__name__
    if hang_up_after_events is not None or hang_up_after_s is not None:
        result.hung_up_at = time.monotonic()
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    result.digest = sha.hexdigest()
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
