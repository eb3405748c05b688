"""Mode C's traffic: a coding agent's session that grows by one tool round per turn.

The opening is a ~6 KB system prompt, a dozen tool definitions and the user's task; each turn appends
an assistant message with one tool call and the tool's result (file reads, test output, grep hits:
0.5–12 KB, deterministic). About 200 rounds make ~400 messages and ~600 KB of JSON, the size real
agents send near 150k tokens. Each request resends the whole history unchanged, as agents do, so a
proxy that compares with the previous body only has the new round to examine.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import orjson

_TOOL_NAMES = (
    "read_file",
    "write_file",
    "edit_file",
    "list_dir",
    "grep",
    "run_tests",
    "run_shell",
    "git_diff",
    "git_log",
    "search_docs",
    "open_url",
    "ask_user",
)
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')}: " + "Use it when the task needs it. " * 6,
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "file or directory path"},
                    "pattern": {"type": "string", "description": "text or regex to look for"},
                    "content": {"type": "string", "description": "new text"},
                },
                "required": ["path"],
            },
        },
    }
    for name in _TOOL_NAMES
]

_WORDS = [
    "def",
    "class",
    "return",
    "import",
    "self",
    "value",
    "result",
    "error",
    "buffer",
    "stream",
    "session",
    "request",
    "response",
    "config",
    "cache",
    "token",
    "message",
    "tool",
    "index",
    "parse",
    "relay",
    "event",
    "client",
    "server",
    "upstream",
    "proxy",
]


def _text(rng: random.Random, size: int) -> str:
    out: list[str] = []
    n = 0
    while n < size:
        line = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12)))
        out.append(line)
        n += len(line) + 1
    return "\n".join(out)[:size]


@dataclass(frozen=True)
class Turn:
    """One request of the session: its body and how it differs from the previous one."""

    index: int
    body: bytes
    messages: int
    appended_bytes: int  # bytes of JSON added since the previous turn


def session(
    seed: int,
    rounds: int = 200,
    mean_result_bytes: int = 2800,
    round_sizes: list[int] | None = None,
    marked: bool = False,
    timed: bool = False,
) -> Iterator[Turn]:
    """The session's requests, turn by turn; ``round_sizes`` fixes each round's tool-output size.
    ``marked``: the newest message carries a ``cache_control`` mark, taken off the one before
    each turn (Claude's prompt caching through an OpenAI-compatible gateway), so a body never
    continues the bytes of the one before. ``timed``: the system prompt opens with the time,
    a minute later each turn, so no body opens as the one before did."""
    rng = random.Random(seed)
    head = orjson.dumps(
        {"model": "gpt-4o-mini", "user": f"agent-{seed}", "tools": _TOOLS, "messages": []}
    )[: -len(b"]}")]
    system = {"role": "system", "content": "You are a careful coding agent.\n" + _text(rng, 6000)}
    task = {"role": "user", "content": f"Task {seed}: fix the failing tests.\n" + _text(rng, 800)}
    parts = [orjson.dumps(system), orjson.dumps(task)]
    size = sum(len(p) + 1 for p in parts)

    def body(last: Mapping[str, object]) -> bytes:
        if timed:
            minutes = 9 * 60 + len(parts) // 2
            now = {**system, "content": f"It is {minutes // 60:02d}:{minutes % 60:02d}.\n"}
            now["content"] += str(system["content"])
            parts[0] = orjson.dumps(now)
        if not marked:
            return head + b",".join(parts) + b"]}"
        newest = orjson.dumps({**last, "cache_control": {"type": "ephemeral"}})
        return head + b",".join([*parts[:-1], newest]) + b"]}"

    yield Turn(0, body(task), len(parts), size)
    for i in range(rounds):
        call_id = f"call_{seed}_{i:04d}"
        tool = _TOOL_NAMES[rng.randrange(len(_TOOL_NAMES))]
        args = orjson.dumps({"path": f"src/module_{rng.randint(0, 99)}.py", "pattern": "relay"})
        call = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": tool, "arguments": args.decode()},
                }
            ],
        }
        if round_sizes is not None:
            out_size = round_sizes[i % len(round_sizes)]
        else:
            out_size = int(min(12000, max(500, rng.expovariate(1 / mean_result_bytes))))
        result = {"role": "tool", "tool_call_id": call_id, "content": _text(rng, out_size)}
        new = [orjson.dumps(call), orjson.dumps(result)]
        parts.extend(new)
        yield Turn(i + 1, body(result), len(parts), sum(len(p) + 1 for p in new))


def fork(base: bytes, seed: int, result_bytes: int) -> bytes:
    """``base`` (a turn's body) plus one more round whose tool output is ``result_bytes`` long."""
    rng = random.Random(seed)
    call_id = f"call_fork_{seed}"
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path":"src/x.py"}'},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": call_id, "content": _text(rng, result_bytes)}
    tail = b"," + orjson.dumps(call) + b"," + orjson.dumps(result) + b"]}"
    return base[: -len(b"]}")] + tail
