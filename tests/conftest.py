"""Shared fixtures: real loopback servers for cachegate and for scripted upstreams."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config import Settings, settings_from_mapping
from proxy.serving import ServerThread


@pytest.fixture(autouse=True)
def _own_cache_dir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """``cachegate sessions list`` keeps a memo under ``$XDG_CACHE_HOME``: each test gets its own
    (the CLI in this process and in the ones it starts), never the user's."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


@dataclass
class RunningProxy:
    server: ServerThread
    app: Any
    registry: CollectorRegistry
    settings: Settings
    log_dir: Path

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def base_url(self) -> str:
        return self.server.url + "/v1"

    @property
    def gateway(self) -> Any:
        return self.app.state.gateway

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until every exchange's observers have run (they run after the client has its
        answer) and the event log writer has written what they emitted."""
        deadline = time.monotonic() + timeout
        while self.gateway.chat.in_flight and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.gateway.writer is not None:
            self.gateway.writer.flush()

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        self.settle()
        value = self.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value


@contextlib.contextmanager
def run_proxy(
    upstream: str, log_dir: Path, config: dict[str, Any] | None = None, **kw: Any
) -> Iterator[RunningProxy]:
    data: dict[str, Any] = {"upstream": {"base_url": upstream}, "logging": {"dir": str(log_dir)}}
    for section, values in (config or {}).items():
        data.setdefault(section, {}).update(values)
    settings = settings_from_mapping(data)
    registry = CollectorRegistry()
    app = create_app(settings, registry=registry, environ=kw.pop("environ", {}), **kw)
    with ServerThread(app) as server:
        yield RunningProxy(server, app, registry, settings, log_dir)


@pytest.fixture
def proxy_factory(tmp_path: Path) -> Iterator[Any]:
    stack = contextlib.ExitStack()

    def make(upstream: str, config: dict[str, Any] | None = None, **kw: Any) -> RunningProxy:
        return stack.enter_context(run_proxy(upstream, tmp_path / "logs", config, **kw))

    with stack:
        yield make


@pytest.fixture
def sdk() -> Iterator[Any]:
    """Factory of official openai SDK clients, closed at teardown."""
    from openai import OpenAI

    made: list[OpenAI] = []

    def make(base_url: str, **kw: Any) -> OpenAI:
        kw.setdefault("api_key", "sk-test-not-a-real-key")
        kw.setdefault("max_retries", 0)
        c = OpenAI(base_url=base_url, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@dataclass
class ScriptedUpstream:
    """A raw ASGI upstream that answers with exact chunks and records what it saw."""

    chunks: list[bytes] = field(default_factory=list)
    delay_s: float = 0.0
    first_delay_s: float = 0.0
    status: int = 200
    content_type: bytes = b"text/event-stream"
    requests: list[dict[str, Any]] = field(default_factory=list)
    disconnects: list[float] = field(default_factory=list)
    in_flight: int = 0
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    abort_after: int | None = None  # drop the connection after this many chunks
    header_delay_s: float = 0.0  # wait this long before even the status line
    sent: int = 0  # body chunks handed to the server so far (uvicorn waits while a reader lags)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            message = await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.requests.append(
            {
                "method": scope["method"],
                "path": scope["path"],
                "raw_path": scope.get("raw_path"),
                "query": scope["query_string"],
                "headers": scope["headers"],
                "body": body,
            }
        )
        self.in_flight += 1
        gone = asyncio.Event()

        async def watch() -> None:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.disconnects.append(time.monotonic())
                gone.set()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            if self.header_delay_s:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(gone.wait(), self.header_delay_s)
                if gone.is_set():
                    return
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status,
                    "headers": [(b"content-type", self.content_type), *self.extra_headers],
                }
            )
            for i, chunk in enumerate(self.chunks):
                wait = self.first_delay_s if i == 0 else self.delay_s
                if wait:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(gone.wait(), wait)
                if gone.is_set():
                    return
                if self.abort_after is not None and i >= self.abort_after:
                    raise ConnectionAbortedError("scripted upstream dies mid-stream")
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self.sent += 1
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.in_flight -= 1
            watcher.cancel()


@pytest.fixture
def scripted() -> Iterator[Any]:
    stack = contextlib.ExitStack()

    def make(**kw: Any) -> tuple[ScriptedUpstream, str]:
        upstream = ScriptedUpstream(**kw)
        server = stack.enter_context(ServerThread(upstream))
        return upstream, server.url + "/v1"

    with stack:
        yield make
