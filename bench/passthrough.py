"""A bare pass-through on cachegate's own stack: the floor the full pipeline is compared with.

Raw ASGI under uvicorn (httptools, uvloop), cachegate's native upstream pool (``proxy.upstream``)
with the same limits and timeouts cachegate configures, the request body forwarded as received and
the upstream's bytes sent back as they arrive (written to the client from the upstream
connection's callback, as cachegate's relay does: ``proxy.relay.DirectBody``), with disconnect
cancellation. No parsing, sessions, repair, accounting, logging or
metrics: what is left is the cost of the stack itself.

``python -m bench.passthrough --port N --upstream http://127.0.0.1:M/v1 [--transport native]``
(``native``, the default: cachegate's own pool; ``httpx``: httpx's own pool; ``aiohttp``: the httpx
API over the ``httpx-aiohttp`` transport, cachegate's previous pool, which needs ``pip install
httpx-aiohttp`` in the bench's tools venv: evidence, not a dependency.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

import httpx

from proxy.relay import DirectBody

_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"host",
        b"content-length",
        b"accept-encoding",
    }
)


class Passthrough:
    """The ASGI app; ``client`` lives for the lifespan."""

    def __init__(self, upstream: str, transport: str = "native") -> None:
        self.upstream = upstream.rstrip("/")
        self.transport = transport
        self.client: httpx.AsyncClient | None = None
        self.pool: Any = None  # proxy.upstream.UpstreamPool with --transport native

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            limits = httpx.Limits(
                max_connections=1000, max_keepalive_connections=200, keepalive_expiry=30.0
            )
            transport = None
            if self.transport == "native":
                from proxy.upstream import UpstreamPool

                self.pool = UpstreamPool(
                    max_connections=1000, max_keepalive=200, connect_timeout=10.0
                )
            elif self.transport == "aiohttp":
                # Only in the bench's tools venv (bench/.venv-tools): evidence, not a dependency.
                from httpx_aiohttp import AiohttpTransport

                transport = AiohttpTransport(limits=limits, trust_env=False)
            self.client = httpx.AsyncClient(
                timeout=httpx.Timeout(600.0, connect=10.0, pool=600.0),
                limits=limits,
                transport=transport,
                trust_env=False,
            )
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await self.client.aclose()
            if self.pool is not None:
                await self.pool.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        assert self.client is not None
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        path = scope["path"].removeprefix("/v1")
        headers = [(k, v) for k, v in scope["headers"] if k not in _HOP]
        headers.append((b"accept-encoding", b"identity"))
        body = b"".join(parts)
        url = self.upstream + path
        task = asyncio.current_task()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if task is not None:
                task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        response: Any = None
        try:
            if self.pool is not None:  # cachegate's native pool
                response = await self.pool.open(scope["method"], url, headers, body)
                chunks = response.stream
            else:  # an httpx client
                request = self.client.build_request(
                    scope["method"], url, headers=headers, content=body
                )
                response = await self.client.send(request, stream=True)
                chunks = response.aiter_raw()
            out = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in _HOP]
            length = response.headers.get("content-length")
            if length is not None:
                out.append((b"content-length", length.encode()))
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": out}
            )
            # The same relay technique as cachegate: upstream chunks written to the client from
            # the upstream connection's callback when serving on uvicorn's httptools protocol.
            direct = DirectBody.of(send) if self.pool is not None else None
            if direct is not None:
                await response.pipe(lambda c: direct.write(c) if c else True, direct.drain)
            else:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            pass
        finally:
            watcher.cancel()
            if response is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(response.aclose())


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="bare pass-through proxy on cachegate's stack")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--transport", choices=("native", "httpx", "aiohttp"), default="native")
    ns = parser.parse_args(argv)
    from proxy.cli import tune_gc, tune_malloc

    tune_gc()  # the same process settings as ``cachegate serve``
    tune_malloc()
    uvicorn.run(
        Passthrough(ns.upstream, ns.transport),
        host="127.0.0.1",
        port=ns.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        server_header=False,
        date_header=False,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
