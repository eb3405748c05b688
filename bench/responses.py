"""What reading a Responses API stream for its usage costs the relay.

    python -m bench.responses [--events 5000] [--rounds 10] [--delta-bytes 100]
    python -m bench.responses --agent-rounds 200 [--events 20]

An upstream (its own process, on CPU 1 where ``taskset`` is present) answers every POST with the
same stream: ``response.created``, ``--events`` text deltas of ``--delta-bytes`` each, the
``response.completed`` event that repeats the whole text with its usage. Measured in the same
run, interleaved: the client's time for the whole stream directly from the upstream and
through cachegate (one worker, default configuration, on CPU 0), and cachegate's CPU time per
relayed event (``/proc``), for that Responses stream (read for its usage since 7d724f7) and for
a chat stream of as many events (recorded for the session log and accounting). cachegate's
``cachegate_tokens_total`` must have counted every Responses stream's tokens: the run fails if
not.

``--agent-rounds N``: instead, a coding agent's session over the Responses API, as Codex CLI
sends it (mode C's traffic, ``bench.agent``, as ``instructions``, tools and ``input`` items:
each turn resends the whole history and appends one ``function_call`` and its output, up to
~600 KB at 200 rounds), each turn sent directly and through cachegate, interleaved; printed:
the time cachegate adds per request (p50 of each tenth of the session, by size) and its CPU per
request, which reads, finds the session, logs and accounts each turn. The run fails unless the
session's log holds one request line per turn, delta-coded (the log smaller than twice the
last body).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson

from bench import agent, procs

HOST = "127.0.0.1"


def responses_stream(events: int, delta_bytes: int) -> bytes:
    """The Responses API stream the upstream sends, as OpenAI writes it."""
    delta = ("word " * (delta_bytes // 5 + 1))[:delta_bytes]
    started = {"id": "resp_1", "object": "response", "status": "in_progress", "error": None}
    out = [
        b"event: response.created\ndata: "
        + orjson.dumps({"type": "response.created", "sequence_number": 0, "response": started})
        + b"\n\n"
    ]
    for n in range(events):
        event = {
            "type": "response.output_text.delta",
            "sequence_number": n + 1,
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "delta": delta,
            "logprobs": [],
        }
        out.append(b"event: response.output_text.delta\ndata: " + orjson.dumps(event) + b"\n\n")
    text = delta * events
    done = {
        **started,
        "status": "completed",
        "model": "gpt-5",
        "output": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "usage": {
            "input_tokens": 1000,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": events,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 1000 + events,
        },
    }
    last = {"type": "response.completed", "sequence_number": events + 1, "response": done}
    out.append(b"event: response.completed\ndata: " + orjson.dumps(last) + b"\n\n")
    return b"".join(out)


def chat_stream(events: int, delta_bytes: int) -> bytes:
    """A chat stream of as many deltas, its usage chunk and ``[DONE]``."""
    delta = ("word " * (delta_bytes // 5 + 1))[:delta_bytes]
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-5"}
    out = []
    for _ in range(events):
        chunk = {**head, "choices": [{"index": 0, "delta": {"content": delta}}]}
        out.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    usage = {"prompt_tokens": 1000, "completion_tokens": events, "total_tokens": 1000 + events}
    finish = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    out.append(b"data: " + orjson.dumps(finish) + b"\n\n")
    out.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


async def _serve(port: int, events: int, delta_bytes: int) -> None:
    bodies = {
        b"/v1/responses": responses_stream(events, delta_bytes),
        b"/v1/chat/completions": chat_stream(events, delta_bytes),
    }

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                body = bodies.get(path, b"")
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"content-length: %d\r\n\r\n" % len(body) + body
                )
                await writer.drain()
                if re.search(rb"(?i)\r\nconnection: *close", head):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, HOST, port)
    async with server:
        await server.serve_forever()


async def _fetch(port: int, path: str, body: bytes) -> float:
    """One whole answer read from ``port``; the seconds it took."""
    began = time.perf_counter()
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nhost: {HOST}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    answer = await reader.read()
    writer.close()
    if not answer.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{path} on {port}: {answer[:200]!r}")
    return time.perf_counter() - began


def agent_bodies(rounds: int, seed: int = 7) -> list[bytes]:
    """Mode C's session (``bench.agent``) as Responses API requests: the system prompt as
    ``instructions``, the tools flattened, each message as the item Codex CLI would send."""
    bodies = []
    for turn in agent.session(seed, rounds=rounds):
        chat = orjson.loads(turn.body)
        messages = chat["messages"]
        items: list[dict[str, object]] = []
        for m in messages[1:]:
            if m["role"] == "assistant":
                call = m["tool_calls"][0]
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": call["function"]["arguments"],
                    }
                )
            elif m["role"] == "tool":
                items.append(
                    {
                        "type": "function_call_output",
                        "call_id": m["tool_call_id"],
                        "output": m["content"],
                    }
                )
            else:
                items.append({"type": "message", "role": m["role"], "content": m["content"]})
        tools = [{"type": "function", **t["function"]} for t in chat["tools"]]
        body = {
            "model": "gpt-5",
            "instructions": messages[0]["content"],
            "tools": tools,
            "input": items,
            "stream": True,
            "store": False,
        }
        bodies.append(orjson.dumps(body))
    return bodies


def _agent_run(up_port: int, cg_port: int, cachegate: procs.Server, work: Path, rounds: int) -> int:
    bodies = agent_bodies(rounds)
    asyncio.run(_fetch(cg_port, "/v1/responses", orjson.dumps({"model": "gpt-5", "input": "hi"})))
    added: list[float] = []
    cpu: list[float] = []
    for body in bodies:
        direct = asyncio.run(_fetch(up_port, "/v1/responses", body))
        before = cachegate.cpu()
        through = asyncio.run(_fetch(cg_port, "/v1/responses", body))
        time.sleep(0.02)  # (the observers' work after the answer)
        cpu.append(cachegate.cpu() - before)
        added.append(through - direct)
    print(
        f"a Responses agent session of {len(bodies)} turns, {len(bodies[-1]) / 1e3:.0f} KB at the end"
    )
    print(f"{'turns':<14}{'body KB':>9}{'added p50 ms':>14}{'proxy CPU/request ms':>22}")
    tenth = max(1, len(bodies) // 10)
    for start in range(0, len(bodies), tenth):
        part = slice(start, start + tenth)
        size = statistics.median(len(b) for b in bodies[part]) / 1e3
        print(
            f"{f'{start + 1}-{min(start + tenth, len(bodies))}':<14}{size:>9.0f}"
            f"{statistics.median(added[part]) * 1e3:>14.2f}"
            f"{statistics.median(cpu[part]) * 1e3:>22.2f}"
        )
    deadline = time.monotonic() + 10
    while True:  # (the log's writer takes its lines every 50 ms)
        logs = list(work.glob("*.jsonl"))
        lines = [
            line
            for path in logs
            for line in path.read_bytes().splitlines()
            if b'"type":"request"' in line
        ]
        if len(lines) > len(bodies) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    logged = sum(p.stat().st_size for p in logs)
    print(f"logged: {len(lines)} request lines in {len(logs)} file(s), {logged / 1e3:.0f} KB")
    if len(lines) != len(bodies) + 1 or logged > 2 * len(bodies[-1]) + 100_000:
        print("the session's log is not one delta-coded line per turn")
        return 1
    return 0


def _metric(port: int, name: str, labels: str) -> float:
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.responses", description=__doc__)
    parser.add_argument(
        "--events", type=int, help="events of each answer (5000; 20 with --agent-rounds)"
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--delta-bytes", type=int, default=100)
    parser.add_argument("--agent-rounds", type=int, default=0)
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.events is None:  # (an agent's turn answers briefly: its log holds each answer)
        args.events = 20 if args.agent_rounds else 5000
    if args.serve_upstream:
        procs.stop_on_sigterm()
        asyncio.run(_serve(args.serve_upstream, args.events, args.delta_bytes))
        return 0
    work = Path(tempfile.mkdtemp(prefix="cachegate-bench-responses-"))
    servers: list[procs.Server] = []
    try:
        up_port, cg_port = procs.free_port(), procs.free_port()
        upstream_argv = ["-m", "bench.responses", "--serve-upstream", str(up_port)]
        upstream_argv += ["--events", str(args.events), "--delta-bytes", str(args.delta_bytes)]
        cachegate_argv = ["-m", "proxy.cli", "serve", "--port", str(cg_port)]
        cachegate_argv += ["--upstream", f"http://{HOST}:{up_port}/v1", "--log-dir", str(work)]
        for name, argv, port, core in (
            ("upstream", upstream_argv, up_port, 1),
            ("cachegate", cachegate_argv, cg_port, 0),
        ):
            servers.append(
                procs.start(
                    name,
                    [procs.python(), *argv],
                    port=port,
                    cpu=core,
                    log_dir=work,
                    env=procs.bench_env(),
                )
            )
        upstream, cachegate = servers
        cachegate.wait_ready("/healthz", 30)
        deadline = time.monotonic() + 30
        while True:  # (the upstream, which has no /healthz, listening)
            try:
                socket.create_connection((HOST, up_port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or upstream.popen.poll() is not None:
                    raise RuntimeError(f"upstream not listening: {upstream.log_tail()}") from None
                time.sleep(0.1)
        if args.agent_rounds:
            return _agent_run(up_port, cg_port, cachegate, work, args.agent_rounds)
        responses = orjson.dumps({"model": "gpt-5", "stream": True, "input": "hi"})
        chat = orjson.dumps(
            {"model": "gpt-5", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        )
        times: dict[str, list[float]] = {"direct": [], "responses": [], "chat": []}
        cpu: dict[str, list[float]] = {"responses": [], "chat": []}
        for _ in range(2):  # warm-up: connections, first-use imports
            asyncio.run(_fetch(cg_port, "/v1/responses", responses))
            asyncio.run(_fetch(cg_port, "/v1/chat/completions", chat))
        counted = _metric(cg_port, "cachegate_tokens_total", 'kind="completion",model="gpt-5"')
        for _ in range(args.rounds):
            times["direct"].append(asyncio.run(_fetch(up_port, "/v1/responses", responses)))
            for arm, path, body in (
                ("responses", "/v1/responses", responses),
                ("chat", "/v1/chat/completions", chat),
            ):
                before = cachegate.cpu()
                times[arm].append(asyncio.run(_fetch(cg_port, path, body)))
                time.sleep(0.05)  # (the observers' work after the answer)
                cpu[arm].append(cachegate.cpu() - before)
        now = _metric(cg_port, "cachegate_tokens_total", 'kind="completion",model="gpt-5"')
        expected = counted + 2 * args.rounds * args.events  # (chat's and the Responses')
        size = len(responses_stream(args.events, args.delta_bytes))
        direct = statistics.median(times["direct"])
        print(f"{args.events} events of {args.delta_bytes} bytes, {size / 1e6:.2f} MB a stream")
        print(f"{'arm':<28}{'stream p50 ms':>14}{'vs direct':>11}{'proxy CPU/event µs':>20}")
        print(f"{'direct (Responses)':<28}{direct * 1e3:>14.2f}{1.0:>11.2f}{'':>20}")
        for arm, label in (("responses", "cachegate, Responses"), ("chat", "cachegate, chat")):
            p50 = statistics.median(times[arm])
            per_event = statistics.median(cpu[arm]) / (args.events + 2) * 1e6
            print(f"{label:<28}{p50 * 1e3:>14.2f}{p50 / direct:>11.2f}{per_event:>20.2f}")
        if now != expected:
            print(
                f"cachegate counted {now - counted:.0f} completion tokens, not {expected - counted}"
            )
            return 1
        print("every stream's tokens counted")
        return 0
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
