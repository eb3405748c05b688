"""Shared pieces of the end-to-end tests: the SDK client, log readers, the CLI in-process, a
cachegate subprocess, and an upstream whose usage carries no cache fields.

Imported by ``tests/test_e2e_sessions.py``, ``tests/test_e2e_cache.py`` and ``tests/test_cli.py``;
``tests/conftest.py`` supplies ``proxy_factory`` (an in-process cachegate on a loopback port).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from openai import OpenAI, Stream
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from proxy import cli
from proxy.eventlog import read_events
from proxy.serving import ServerThread
from proxy.simulator.tokens import request_tokens

REPO = Path(__file__).resolve().parent.parent

# A system prompt and tools large enough (well over 1024 simulated tokens together) for the
# provider's prefix cache and cachegate's noise floor to matter.
_LOREM = (
    "Read the code before you change it. Prefer small commits with clear messages. Run the "
    "tests after every change and report failures verbatim. Never invent file contents. "
)
SYSTEM_PROMPT = "You are a careful coding agent working in a Python repository. " + _LOREM * 12
# A tool's outputs the agent scenarios append: a file read, a test run
FILE_TEXT = "\n".join(
    f"def handler_{i}(request):\n    return respond(request, status={200 + i % 5})"
    for i in range(120)
)
PYTEST_OUTPUT = (
    "\n".join(f"tests/test_parser.py::test_case_{i} PASSED [{i}%]" for i in range(100))
    + "\n100 passed in 0.42s"
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository and return its text. " + _LOREM * 4,
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "repository path"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command in the repository and return its output. "
            + _LOREM * 4,
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string", "description": "the command line"}},
                "required": ["cmd"],
            },
        },
    },
]


async def asgi_lifespan(receive: Any, send: Any) -> None:
    """A test upstream's side of an ASGI lifespan: started, then stopped."""
    await receive()
    await send({"type": "lifespan.startup.complete"})
    await receive()
    await send({"type": "lifespan.shutdown.complete"})


async def asgi_body(receive: Any) -> bytes:
    """A test upstream's whole request body, read from its ASGI messages."""
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            return raw


def prompt_tokens(body: dict[str, Any]) -> int:
    """What the simulator will count as ``prompt_tokens`` for a request body."""
    return len(request_tokens(body))


def make_client(base_url: str, **kw: Any) -> OpenAI:
    """The official openai SDK client, without retries (a retry would hide a failure)."""
    kw.setdefault("api_key", "sk-test-not-a-real-key")
    kw.setdefault("max_retries", 0)
    kw.setdefault("timeout", 20.0)
    return OpenAI(base_url=base_url, **kw)


def assistant_message(completion: Any) -> dict[str, Any]:
    """The assistant message of a non-streamed SDK completion, as an agent appends it."""
    return dict(completion.choices[0].message.model_dump(exclude_none=True))


def consume_stream(stream: Any) -> dict[str, Any]:
    """Drain an SDK stream and assemble the assistant message the way agents do (calls by index)."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
            for call in delta.tool_calls or ():
                slot = calls.setdefault(
                    call.index,
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if call.id:
                    slot["id"] = call.id
                if call.function is not None:
                    slot["function"]["name"] += call.function.name or ""
                    slot["function"]["arguments"] += call.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    if message["content"] is None:
        del message["content"]
    return message


def chat(
    client: OpenAI, messages: list[dict[str, Any]], *, stream: bool, **kw: Any
) -> tuple[dict[str, Any], httpx.Headers]:
    """One chat exchange through the SDK: the assistant message and the response headers."""
    kw.setdefault("model", "gpt-4o")
    if stream:
        with client.chat.completions.with_streaming_response.create(
            messages=messages,
            stream=True,
            **kw,
        ) as response:
            return consume_stream(response.parse()), response.headers
    raw = client.chat.completions.with_raw_response.create(
        messages=messages,
        **kw,
    )
    return assistant_message(raw.parse()), raw.headers


def post_chat(client: OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    """One chat exchange through the SDK's own HTTP layer with a prepared body: the assistant
    message. Skips the SDK's per-message parameter transform, which costs ~0.1 s on a
    400-message history and would dominate long-conversation tests."""
    if body.get("stream"):
        stream = client.post(
            "/chat/completions",
            body=body,
            cast_to=ChatCompletion,
            stream=True,
            stream_cls=Stream[ChatCompletionChunk],
        )
        return consume_stream(stream)
    return assistant_message(client.post("/chat/completions", body=body, cast_to=ChatCompletion))


def events(log_dir: Path, session_id: str, kind: str | None = None) -> list[dict[str, Any]]:
    """The parsed events of a session's log, optionally only those of one type."""
    read = read_events(log_dir / f"{session_id}.jsonl")
    return [e for e in read.events if kind is None or e.get("type") == kind]


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def tree(root: Path) -> set[str]:
    """Every path under ``root`` (files and directories), relative, as strings."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return orjson.loads(self.out)


def run_cli(*argv: str) -> CliResult:
    """Run ``cachegate ARGV`` in this process (``proxy.cli.main``), capturing its output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:  # argparse: --version, usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return CliResult(code, out.getvalue(), err.getvalue())


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any CACHEGATE_* setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEGATE_")}
    env.pop("OPENAI_API_KEY", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_healthy(proc: subprocess.Popen[Any], url: str) -> None:
    """Wait for a started ``cachegate serve`` at ``url`` to answer ``/healthz``; fail the test,
    with its stderr, if it exits first."""

    def healthy() -> bool:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            err = err.decode() if isinstance(err, bytes) else err
            raise AssertionError(f"cachegate exited with {proc.returncode}: {err}")
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, timeout=20, what="cachegate /healthz")


@contextlib.contextmanager
def cachegate_process(upstream: str, log_dir: Path, *args: str) -> Iterator[tuple[Any, str]]:
    """``python -m proxy.cli serve`` as a real subprocess; yields (Popen, base URL with /v1)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "proxy.cli", "serve", "--port", str(port)),
            *("--upstream", upstream, "--log-dir", str(log_dir), *args),
        ],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url)
        yield proc, url + "/v1"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


# --- an upstream whose usage has no cache fields at all ------------------------------------------


@dataclass
class NoCacheUpstream:
    """A minimal OpenAI-compatible chat upstream (raw ASGI) that reports only prompt and completion
    tokens, like providers without a prompt cache. ``prompt_tokens`` grows with the messages
    (``base_prompt`` + 50 per message), so a wrongly counted "expected" would show as waste."""

    base_prompt: int = 3000
    requests: list[dict[str, Any]] = field(default_factory=list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await asgi_lifespan(receive, send)
            return
        body = orjson.loads(await asgi_body(receive))
        await self.before_answer(body)
        self.requests.append(body)
        usage = {
            "prompt_tokens": self.base_prompt + 50 * len(body["messages"]),
            "completion_tokens": 2,
            "total_tokens": self.base_prompt + 50 * len(body["messages"]) + 2,
        }
        base = {"id": "chatcmpl-nocache", "created": 1700000000, "model": body["model"]}
        if body.get("stream"):
            chunks = [
                {
                    **base,
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Done."}}],
                },
                {
                    **base,
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                },
            ]
            if (body.get("stream_options") or {}).get("include_usage"):
                chunks.append(
                    {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
                )
            payload = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
            payload += b"data: [DONE]\n\n"
            ctype = b"text/event-stream"
        else:
            payload = orjson.dumps(
                {
                    **base,
                    "object": "chat.completion",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "Done."},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": usage,
                }
            )
            ctype = b"application/json"
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]}
        )
        await send({"type": "http.response.body", "body": payload})

    async def before_answer(self, body: dict[str, Any]) -> None:
        """Called with each request's body before it is recorded and answered (a subclass may
        take its time here: a slow summarizer)."""


@contextlib.contextmanager
def run_no_cache_upstream() -> Iterator[tuple[NoCacheUpstream, str]]:
    """Serve a ``NoCacheUpstream`` on loopback; yields it and its ``/v1`` base URL."""
    upstream = NoCacheUpstream()
    with ServerThread(upstream) as server:
        yield upstream, server.url + "/v1"
