"""``cachegate demo``: the simulator and cachegate in-process, four scripted agent conversations.

Everything runs offline on loopback ports: the provider simulator, cachegate in front of it, and an
agent's requests over the real HTTP path (httpx, as the SDKs send them: the demo needs nothing
beyond cachegate's own dependencies). Each scenario prints what
cachegate recorded for it (read back from the session logs through ``proxy.report``, never
hard-coded): an interrupted turn repaired, a timestamp in the system prompt that destroys the prompt
cache, an idle gap past the cache TTL, and a history compacted before it outgrows the context window.

Both clocks (the simulator's and cachegate's) are fake and move together, so a ten-minute idle gap
takes no time at all.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shlex
import stat
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO, cast

import httpx
import orjson
from prometheus_client import CollectorRegistry

from proxy import report
from proxy.app import Gateway, create_app
from proxy.config import Settings, settings_from_mapping
from proxy.eventlog import read_events, session_log_path
from proxy.serving import ServerThread
from proxy.simulator import RunningSimulator, SimConfig, run_simulator
from proxy.sse import SSEDecoder

log = logging.getLogger(__name__)

DEMO_MODEL = "demo-model"
# The sessions the scenarios log (a second run in the same directory replaces their files).
INTERRUPTED_SESSION, STABLE_SESSION, STAMPED_SESSION = (
    "demo-interrupted",
    "demo-stable",
    "demo-timestamp",
)
IDLE_SESSION, COMPACTION_SESSION = "demo-idle", "demo-compaction"
CODEX_SESSION = "demo-codex"
DEMO_SESSIONS = (
    INTERRUPTED_SESSION,
    STABLE_SESSION,
    STAMPED_SESSION,
    IDLE_SESSION,
    COMPACTION_SESSION,
    CODEX_SESSION,
)
CONTEXT_WINDOW = 8000
CACHE_TTL_S = 300.0
TRIGGER_PERCENT = 75.0
# USD per 1M tokens: a cached input token costs a tenth of a fresh one, as at several providers.
PRICES = {
    "price_input": 1.25,
    "price_cached_input": 0.125,
    "price_cache_write": 0.0,
    "price_output": 10.0,
}
TURN_GAP_S = 20.0  # simulated time an agent spends between two requests (tools, typing)
IDLE_GAP_S = 600.0  # the user's lunch break in scenario 3, past the 300 s cache TTL
DEMO_START_AGO_S = 3600  # the fake clocks start this long before the real now
WIDTH = 100  # the report's line width

SYSTEM_PROMPT = """\
You are Forge, a coding agent working in the user's repository through the tools below. You read \
code before changing it, make the smallest change that solves the task, and run the tests before \
you say that anything works.

## How you work
- Start every task by restating it in one sentence, then list the files you expect to touch.
- Read a file with read_file before you edit it; never guess its contents from its name.
- Prefer editing existing code to adding new modules. Keep the style of the surrounding code: its \
naming, its error handling, its comments and its tests.
- Run the narrowest test command that covers your change first, then the whole suite.
- When a command fails, read the whole error before you try a fix. Do not retry the same command \
more than twice without changing something.
- Never delete files, rewrite git history, or push to a remote unless the user asked for it in \
this conversation.
- Keep secrets out of the code, the logs and your replies: API keys, tokens, passwords, private \
URLs. If you find one committed, tell the user instead of copying it.

## Editing
- Use edit_file with an exact old string and its replacement; include enough context for the old \
string to be unique in the file.
- After an edit, read the changed region again to check indentation and imports.
- Update the docstrings and the documentation that describe behaviour you changed.
- Add a test for every bug you fix: it must fail before your change and pass after it.

## Commands
- run_command runs in the repository root with a 120 second timeout and no network access.
- Prefer the project's own tooling: the test runner, the formatter and the linter it configures.
- Long outputs are truncated to their first and last lines; ask for a narrower command instead of \
scrolling through pages of output.

## Repository conventions
- Python 3.11, type hints on every public function, dataclasses for values, named loggers with \
%-style arguments. No utils or helpers modules: every module is named after the one idea it holds.
- Pure modules take time and state as arguments; the I/O shell wires them to sockets and disk.
- Tests mirror the package: tests/test_retry.py for proxy/retry.py. Use the provider simulator \
as the fake upstream; do not mock the HTTP client. Property tests use hypothesis with a fixed \
number of examples and no deadline.
- Errors cross the HTTP boundary once, in the OpenAI error shape, with a meaningful status: 400 \
for bad input, 502 when the upstream is unreachable, 504 when it timed out.
- Configuration is validated at start-up; an unknown key stops the process with a message that \
names the key.

## Talking to the user
- Be brief. Say what you did, what you found, and what is left, in that order.
- Quote file paths, commands and error messages exactly, in backticks.
- When the task is ambiguous, ask one precise question instead of guessing; when it is clear, do \
not ask for permission to start.
- If you stop before the task is done, say which step was in progress and what the next one is.
"""

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file of the repository, with line numbers.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "relative path"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_command",
            "description": "Run a shell command in the repository root; returns its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "edit_file",
            "description": "Replace one exact occurrence of old with new in a file.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "old": {"type": "string"},
                    "new": {"type": "string"},
                },
                "required": ["path", "old", "new"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "list_dir",
            "description": "List the files and directories under a path, one per line.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "depth": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the repository for a regular expression; returns matching lines.",
            "parameters": {
                "type": "object",
                "properties": {
                    "pattern": {"type": "string"},
                    "glob": {"type": "string", "description": "only files matching this glob"},
                },
                "required": ["pattern"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite or the tests selected by an expression.",
            "parameters": {
                "type": "object",
                "properties": {"select": {"type": "string", "description": "e.g. tests/test_x.py"}},
                "required": [],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "git_diff",
            "description": "Show the uncommitted changes of the working tree.",
            "parameters": {"type": "object", "properties": {}, "required": []},
        },
    },
]


class DemoClock:
    """A clock that moves only when told to: cachegate's ``clock=``, kept in step with the
    simulator's own clock."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move forward by ``seconds``."""
        self.now += seconds


def demo_settings(upstream: str, log_dir: str) -> Settings:
    """cachegate's settings for the demo: the demo model with a small context window, compaction on."""
    return settings_from_mapping(
        {
            "upstream": {"base_url": upstream, "api_key_env": ""},
            "logging": {"dir": log_dir},
            "compaction": {"enabled": True, "trigger_percent": TRIGGER_PERCENT},
            "models": {
                DEMO_MODEL: {
                    "context_window": CONTEXT_WINDOW,
                    "cache_ttl_s": CACHE_TTL_S,
                    "dialect": "openai",
                    **PRICES,
                }
            },
        }
    )


class DemoError(RuntimeError):
    """A request of the demo's agent that cachegate answered with an error."""


def _error_text(raw: bytes) -> str:
    """The ``error.message`` of an OpenAI-shaped error body, else its start."""
    try:
        error = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else raw[:200].decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class _Reply:
    """What the agent sees of one response through cachegate."""

    status: int
    headers: dict[str, str]  # the X-Cachegate-* headers, lower-cased
    message: dict[str, Any]  # the assistant message, ready to append to the history


@dataclass
class _Demo:
    """What every scenario uses: the clients, the simulator, the clocks and the log reader."""

    client: httpx.Client  # through cachegate
    direct: httpx.Client  # straight to the simulator
    running: RunningSimulator
    proxy_url: str
    clock: DemoClock
    gateway: Gateway
    log_dir: str
    out: TextIO
    problems: list[str] = field(default_factory=list)
    sent: dict[str, int] = field(default_factory=dict)  # requests per session through cachegate

    def say(self, text: str = "", indent: int = 0) -> None:
        """Print ``text`` indented, wrapped at ``WIDTH`` (continuation lines two spaces deeper)."""
        pad = " " * indent
        lines = textwrap.wrap(text, WIDTH, initial_indent=pad, subsequent_indent=pad + "  ")
        self.out.write("\n".join(lines) + "\n")

    def expect(self, ok: bool, what: str) -> None:
        """Note (and print) a scenario that did not show what it is meant to show."""
        if not ok:
            self.problems.append(what)
            self.say(f"! unexpected: {what}", 3)

    def advance(self, seconds: float) -> None:
        """Move both clocks: the provider's cache and cachegate's accounting see the same time."""
        self.running.sim.advance(seconds)
        self.clock.advance(seconds)

    def chat(
        self,
        session: str,
        messages: list[dict[str, Any]],
        *,
        stream: bool = False,
        script: dict[str, Any] | None = None,
    ) -> _Reply:
        """One request through cachegate, as an agent sends it; ``script`` is the simulated
        model's reply (``X-Sim-Script``), else the simulator derives one."""
        headers = {"X-Session-Id": session}
        if script is not None:
            headers["X-Sim-Script"] = orjson.dumps(script).decode()
        self.sent[session] = self.sent.get(session, 0) + 1
        body = {"model": DEMO_MODEL, "messages": messages, "tools": TOOLS, "stream": stream}
        response = self.client.post("chat/completions", content=orjson.dumps(body), headers=headers)
        if response.status_code >= 400:
            raise DemoError(f"{response.status_code}: {_error_text(response.content)}")
        status = response.status_code
        ours = {k: v for k, v in response.headers.items() if k.startswith("x-cachegate-")}
        if not stream:
            message = orjson.loads(response.content)["choices"][0]["message"]
            return _Reply(status, ours, {k: v for k, v in message.items() if v is not None})
        content = []
        for event in SSEDecoder().decode(response.content):
            if event.data.strip() == "[DONE]":
                break
            choices = orjson.loads(event.data).get("choices") or []
            delta = choices[0].get("delta") or {} if choices else {}
            if delta.get("content"):
                content.append(delta["content"])
        return _Reply(status, ours, {"role": "assistant", "content": "".join(content)})

    # -- reading back what cachegate recorded -------------------------------------------------

    def rows(self, session: str) -> dict[int, report.ExchangeRow]:
        """The session's exchanges as cachegate logged them, by exchange id."""
        self.settle(session)
        rows = report.show_session(self.log_dir, session).rows
        return {r.exchange: r for r in rows if r.exchange}

    def events(self, session: str, kind: str) -> list[dict[str, Any]]:
        """The session's logged events of one type, in order."""
        self.settle(session)
        path = session_log_path(self.log_dir, session)
        return [e for e in read_events(path).events if e.get("type") == kind]

    def settle(self, session: str, timeout_s: float = 5.0) -> None:
        """Wait until the log holds a response for every request sent in ``session``: cachegate
        logs a response once the client has it, so the client can be a step ahead."""
        deadline = time.monotonic() + timeout_s
        path = session_log_path(self.log_dir, session)
        while True:
            self.flush()
            with contextlib.suppress(FileNotFoundError):
                events = read_events(path).events
                if sum(e.get("type") == "response" for e in events) >= self.sent.get(session, 0):
                    return
            if time.monotonic() > deadline:
                return  # report what is there; the figures show what is missing
            time.sleep(0.005)

    def flush(self) -> None:
        if self.gateway.writer is not None:
            self.gateway.writer.flush()


def _tokens(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _money(usd: float) -> str:
    return f"${usd:.4f}"


def _clip(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _system(preamble: str = "") -> dict[str, Any]:
    return {"role": "system", "content": preamble + SYSTEM_PROMPT}


# --------------------------------------------------------------------------------------------------
# 1. The interrupted turn


def interrupted_turn(demo: _Demo) -> None:
    """A history whose last tool call has no result: the provider refuses it, cachegate repairs it."""
    session = INTERRUPTED_SESSION
    demo.say(f"1. The interrupted turn (session {session})")
    demo.say("The user pressed Ctrl+C while read_file ran: its call has no result.", 3)
    messages: list[dict[str, Any]] = [
        _system(),
        _user("test_retry fails since yesterday's merge. Find out why."),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_read_retry",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "proxy/retry.py"}'},
                }
            ],
        },
        _user("Sorry, I stopped you. Look at tests/test_retry.py first."),
    ]
    body = {"model": DEMO_MODEL, "messages": messages, "tools": TOOLS}
    direct = demo.direct.post("chat/completions", content=orjson.dumps(body))
    if direct.status_code == 400:
        demo.say(f"direct to the provider: 400 {_error_text(direct.content)}", 3)
    else:
        demo.say(f"direct to the provider: {direct.status_code}", 3)
        demo.expect(False, "the provider should refuse a dangling tool call with a 400")

    reply = demo.chat(session, messages)
    repairs = reply.headers.get("x-cachegate-repairs", "absent")
    demo.say(f"through cachegate:      {reply.status}  X-Cachegate-Repairs: {repairs}", 3)
    for repair in demo.events(session, "request")[-1].get("repairs") or []:
        demo.say(
            f"  {repair.get('kind')} at messages[{repair.get('index')}] "
            f"({repair.get('tool_call_id')}): {repair.get('action')}",
            3,
        )
    demo.expect(repairs == "1", f"expected 1 repair, cachegate reported {repairs}")

    demo.advance(TURN_GAP_S)
    messages = [*messages, reply.message, _user("Thanks. Go on with the fix.")]
    reply = demo.chat(session, messages)
    row = demo.rows(session).get(2)
    read, prompt = (row.cache_read, row.tokens_in) if row else (None, None)
    demo.say(
        f"next turn:              {reply.status}  X-Cachegate-Repairs: "
        f"{reply.headers.get('x-cachegate-repairs', 'absent')} (the same repair, byte for byte), "
        f"{_tokens(read)} of {_tokens(prompt)} prompt tokens cached",
        3,
    )
    demo.expect(bool(read), "the repaired prefix should hit the provider's cache")


# --------------------------------------------------------------------------------------------------
# 2. A timestamp in the system prompt

QUESTIONS = (
    "Where does the proxy decide how long to wait before retrying a request?",
    "Does it honour the Retry-After header of a 429?",
    "What happens when the upstream closes the stream halfway?",
    "Which test covers that case?",
)


def _streamed_session(
    demo: _Demo, session: str, system: Callable[[], dict[str, Any]], questions: Sequence[str]
) -> None:
    """Streamed question-and-answer turns, ``TURN_GAP_S`` apart; the system prompt is rebuilt for
    every request, as agents do."""
    history: list[dict[str, Any]] = []
    for i, question in enumerate(questions):
        if i:
            demo.advance(TURN_GAP_S)
        history.append(_user(question))
        history.append(demo.chat(session, [system(), *history], stream=True).message)


def timestamp_in_system_prompt(demo: _Demo) -> None:
    """The same session twice: a stable system prompt, then one that starts with the current time."""
    stable, stamped = STABLE_SESSION, STAMPED_SESSION
    demo.say(f"2. A timestamp in the system prompt (sessions {stable}, {stamped})")
    demo.say(
        f"The same {len(QUESTIONS)} streamed turns, {TURN_GAP_S:.0f} s apart, with a long system "
        f"prompt and {len(TOOLS)} tools: once as is, once starting with the current time.",
        3,
    )

    def stamped_system() -> dict[str, Any]:
        now = datetime.fromtimestamp(demo.clock(), UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return _system(f"Current time: {now}\n\n")

    _streamed_session(demo, stable, _system, QUESTIONS)
    demo.advance(TURN_GAP_S)
    _streamed_session(demo, stamped, stamped_system, QUESTIONS)

    for label, session in (("as is:", stable), ("with the time:", stamped)):
        rows = demo.rows(session).values()
        cost = report.session_cost(demo.log_dir, session)
        demo.say(
            f"{label:<15}{_tokens(sum(r.tokens_in or 0 for r in rows))} prompt tokens, "
            f"{_tokens(sum(r.cache_read or 0 for r in rows))} cached, "
            f"{_tokens(cost.waste_tokens)} wasted; cost {_money(cost.actual)} "
            f"(no cache: {_money(cost.uncached)})",
            3,
        )
    wasteful = [r for r in demo.rows(stamped).values() if r.cache_waste]
    demo.expect(bool(wasteful), "the timestamped session should waste cache tokens")
    if not wasteful:
        return
    first = wasteful[0]
    divergence = next(
        (
            e.get("divergence") or {}
            for e in demo.events(stamped, "response")
            if e.get("exchange") == first.exchange
        ),
        {},
    )
    volatile = bool(divergence.get("volatile"))
    causes = sorted({f"{r.waste_cause} at {r.waste_location}" for r in wasteful})
    demo.say(
        f"wasted on turns {', '.join(str(r.exchange) for r in wasteful)}: "
        f"{' + '.join(_tokens(r.cache_waste) for r in wasteful)} tokens; cause {', '.join(causes)}"
        + (
            f", a volatile token ({divergence.get('volatile_kind')})"
            if volatile
            else ", not flagged as a volatile token"
        ),
        3,
    )
    demo.say(f"  before: {_clip(divergence.get('old', ''), 64)}", 3)
    demo.say(f"  after:  {_clip(divergence.get('new', ''), 64)}", 3)
    base = report.session_cost(demo.log_dir, stable).actual
    extra = report.session_cost(demo.log_dir, stamped).actual - base
    if base > 0:
        demo.say(
            f"the timestamp cost {_money(extra)} more over {len(QUESTIONS)} turns "
            f"({100 * extra / base:+.0f}%)",
            3,
        )
    demo.expect(
        causes == ["prefix_rewrite at system"],
        f"the waste should be a prefix_rewrite at system, not {', '.join(causes)}",
    )
    demo.expect(volatile, "the rewrite should be flagged as a volatile token")


# --------------------------------------------------------------------------------------------------
# 3. An idle gap past the TTL


def idle_gap(demo: _Demo) -> None:
    """A warm session, a pause longer than the cache TTL, and the miss it costs."""
    session = IDLE_SESSION
    demo.say(f"3. An idle gap past the cache TTL (session {session})")
    questions = (
        "Summarize what the retry module does.",
        "List its public functions.",
        "Which of them are untested?",
    )
    history: list[dict[str, Any]] = []
    for question in questions:
        history.append(_user(question))
        history.append(demo.chat(session, [_system(), *history], stream=True).message)
        demo.advance(TURN_GAP_S)
    demo.advance(IDLE_GAP_S - TURN_GAP_S)
    history.append(_user("Back from lunch. Write the missing tests."))
    demo.chat(session, [_system(), *history], stream=True)
    rows = demo.rows(session)
    warm, cold = rows.get(len(questions)), rows.get(len(questions) + 1)
    if warm is None or cold is None:
        demo.expect(False, "the session's exchanges are missing from the log")
        return
    demo.say(
        f"turn {warm.exchange}: {_tokens(warm.cache_read)} of {_tokens(warm.tokens_in)} prompt "
        f"tokens cached; then {IDLE_GAP_S / 60:.0f} min idle (cache TTL {CACHE_TTL_S / 60:.0f} min)",
        3,
    )
    demo.say(
        f"turn {cold.exchange}: {_tokens(cold.cache_read)} cached, {_tokens(cold.cache_waste)} "
        f"wasted, cause {cold.waste_cause}; cost {_money(cold.cost_actual or 0.0)} "
        f"(turn {warm.exchange}: {_money(warm.cost_actual or 0.0)})",
        3,
    )
    demo.expect(bool(warm.cache_read), "the warm session should hit the cache")
    demo.expect(bool(cold.cache_waste), "the turn after the idle gap should waste cache tokens")
    demo.expect(
        cold.waste_cause == "ttl_expired", f"cause should be ttl_expired, not {cold.waste_cause}"
    )


# --------------------------------------------------------------------------------------------------
# 4. Compaction

FIRST_TASK_FILES = (
    "proxy/retry.py",
    "proxy/backoff.py",
    "proxy/budget.py",
    "proxy/clock.py",
    "tests/test_retry.py",
    "tests/test_backoff.py",
    "tests/test_budget.py",
    "proxy/relay.py",
)
SECOND_TASK_FILES = tuple(f"proxy/cli/part{i}.py" for i in range(1, 13))


def _fake_file(path: str, functions: int = 5) -> str:
    """A plausible source file for ``read_file`` to return (about 1,100 characters)."""
    stem = path.rsplit("/", 1)[-1].removesuffix(".py")
    lines = [f'"""{stem}: part of the retry machinery."""', "", "import time", ""]
    for i in range(functions):
        lines += [
            f"def {stem}_step_{i}(request, attempt={i}, budget_s=30.0):",
            f'    """Step {i} of {stem}: wait, then send the request again if the budget allows."""',
            f"    delay = min(budget_s, 0.5 * 2 ** attempt) + {i} * 0.01",
            "    time.sleep(delay)",
            "",
        ]
    return "\n".join(lines)


def _tool_round(demo: _Demo, session: str, history: list[dict[str, Any]], path: str) -> _Reply:
    """One agent step: the (scripted) model asks to read ``path``; the agent runs the tool."""
    script = {
        "content": f"Reading {path}.",
        "tool_calls": [{"name": "read_file", "arguments": {"path": path}}],
    }
    reply = demo.chat(session, [_system(), *history], script=script)
    history.append(reply.message)
    for call in reply.message.get("tool_calls") or []:
        history.append({"role": "tool", "tool_call_id": call["id"], "content": _fake_file(path)})
    demo.advance(TURN_GAP_S)
    return reply


def compaction_scenario(demo: _Demo) -> None:
    """A long session: cachegate compacts it at the threshold, and the cache hits again after."""
    session = COMPACTION_SESSION
    threshold = int(CONTEXT_WINDOW * TRIGGER_PERCENT / 100)
    demo.say(f"4. A history that crosses the compaction threshold (session {session})")
    demo.say(
        f"An agent reads file after file for two tasks; window {_tokens(CONTEXT_WINDOW)} tokens, "
        f"compaction at {TRIGGER_PERCENT:.0f}% ({_tokens(threshold)}).",
        3,
    )
    history: list[dict[str, Any]] = [_user("test_retry fails since yesterday's merge. Fix it.")]
    for path in FIRST_TASK_FILES:
        _tool_round(demo, session, history, path)
    done = demo.chat(session, [_system(), *history], script={"content": "Fixed: see the diff."})
    history += [
        done.message,
        _user("Good. Now add a --max-retries option to the CLI, with a test."),
    ]
    demo.advance(TURN_GAP_S)
    compacting: _Reply | None = None
    for path in SECOND_TASK_FILES:
        reply = _tool_round(demo, session, history, path)
        if reply.headers.get("x-cachegate-compacted") == "1":
            compacting = reply
            break
    if compacting is None:
        demo.expect(False, "cachegate never compacted the session")
        return
    following = _tool_round(demo, session, history, "proxy/cli.py")

    made = [
        e
        for e in demo.events(session, "request")
        if "source" in ((e.get("transforms") or {}).get("compacted") or {})
    ]
    rows = demo.rows(session)
    at_id = made[0]["exchange"] if made else None
    before, at, after = (rows.get(at_id + k) for k in (-1, 0, 1)) if at_id else (None, None, None)
    if not made or before is None or at is None or after is None:
        demo.expect(False, "the compaction or its neighbours are missing from the log")
        return
    info = made[0]["transforms"]["compacted"]
    demo.say(
        f"request {before.exchange}: {_tokens(before.tokens_in)} prompt + "
        f"{_tokens(before.tokens_out)} completion tokens, {_tokens(before.cache_read)} cached",
        3,
    )
    demo.say(
        f"request {at.exchange}: X-Cachegate-Compacted: "
        f"{compacting.headers.get('x-cachegate-compacted')}; {info['covered'] - info['start']} "
        f"messages -> 1 summary ({info['source']}), messages estimated at "
        f"{_tokens(info['tokens_before'])} -> {_tokens(info['tokens_after'])} tokens",
        3,
    )
    demo.say(
        f"  the provider counted {_tokens(at.tokens_in)} prompt tokens, "
        f"{_tokens(at.cache_read)} cached; waste recorded: {_tokens(at.cache_waste)} (the miss "
        "a compaction buys is expected)",
        3,
    )
    demo.say(
        f"request {after.exchange}: X-Cachegate-Compacted: "
        f"{following.headers.get('x-cachegate-compacted', 'absent')} (the same summary); "
        f"{_tokens(after.cache_read)} of {_tokens(after.tokens_in)} prompt tokens cached, "
        f"{_tokens(after.cache_waste)} wasted",
        3,
    )
    demo.expect(
        info["tokens_before"] > info["tokens_after"], "compaction should shrink the history"
    )
    demo.expect(
        (at.tokens_in or 0) < (before.tokens_in or 0),
        "the compacted request should be smaller than the one before",
    )
    demo.expect((after.cache_read or 0) > (at.cache_read or 0), "the next request should hit")


# --------------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------------
# 5. A Codex-style agent over the Responses API


def _respond(demo: _Demo, items: list[dict[str, Any]], instructions: str) -> httpx.Response:
    """One Responses API request through cachegate, as Codex CLI sends it (its session's id in
    a ``session_id`` header, its instructions and tools, its whole history as ``input`` items)."""
    demo.sent[CODEX_SESSION] = demo.sent.get(CODEX_SESSION, 0) + 1
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    body = {"model": DEMO_MODEL, "instructions": instructions, "tools": tools, "input": items}
    return demo.client.post(
        "responses", content=orjson.dumps(body), headers={"session_id": CODEX_SESSION}
    )


def responses_agent(demo: _Demo) -> None:
    """An interrupted turn repaired, a warm cache, then the time put into the instructions."""
    session = CODEX_SESSION
    demo.say(f"5. A Codex-style agent over the Responses API (session {session})")
    call = {
        "type": "function_call",
        "call_id": "call_run_tests",
        "name": "run_command",
        "arguments": '{"command": "pytest -x"}',
    }
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "test_retry fails since yesterday's merge. Find out why."},
        call,
        {"role": "user", "content": "Stop, that takes too long: read tests/test_retry.py."},
    ]
    direct = demo.direct.post(
        "responses",
        content=orjson.dumps({"model": DEMO_MODEL, "instructions": SYSTEM_PROMPT, "input": items}),
    )
    said = _error_text(direct.content) if direct.status_code >= 400 else ""
    demo.say(f"direct to the provider: {direct.status_code} {said}".rstrip(), 3)
    demo.expect(direct.status_code == 400, "the provider should refuse a call without its output")
    answers = []
    for turn in range(3):
        if turn:
            demo.advance(TURN_GAP_S)
        instructions = SYSTEM_PROMPT
        if turn == 2:  # the agent starts its instructions with the time
            now = datetime.fromtimestamp(demo.clock(), UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
            instructions = f"Current time: {now}\n\n" + SYSTEM_PROMPT
        answer = _respond(demo, items, instructions)
        if answer.status_code >= 400:
            raise DemoError(f"{answer.status_code}: {_error_text(answer.content)}")
        answers.append(answer)
        items += orjson.loads(answer.content).get("output") or []
        items.append({"role": "user", "content": f"Go on ({turn + 1})."})
    repairs = answers[0].headers.get("x-cachegate-repairs", "absent")
    demo.say(
        f"through cachegate: {answers[0].status_code}  X-Cachegate-Repairs: {repairs} (a "
        f"function_call_output for call_run_tests), session "
        f"{answers[0].headers.get('x-cachegate-session')} from Codex's session_id header",
        3,
    )
    rows = demo.rows(session)
    warm, stamped = rows.get(2), rows.get(3)
    if warm is None or stamped is None:
        demo.expect(False, "the session's exchanges are missing from the log")
        return
    demo.say(
        f"turn 2: {_tokens(warm.cache_read)} of {_tokens(warm.tokens_in)} prompt tokens cached; "
        f"turn 3, the time first in its instructions: {_tokens(stamped.cache_read)} cached, "
        f"{_tokens(stamped.cache_waste)} wasted, {stamped.waste_cause} at "
        f"{stamped.waste_location}",
        3,
    )
    demo.expect(repairs == "1", f"expected 1 repair, cachegate reported {repairs}")
    demo.expect(bool(warm.cache_read), "the repaired history should hit the provider's cache")
    demo.expect(
        (stamped.waste_cause, stamped.waste_location) == ("prefix_rewrite", "instructions"),
        "the waste should be a prefix_rewrite at the instructions, not "
        f"{stamped.waste_cause} at {stamped.waste_location}",
    )


SCENARIOS: tuple[Callable[[_Demo], None], ...] = (
    interrupted_turn,
    timestamp_in_system_prompt,
    idle_gap,
    compaction_scenario,
    responses_agent,
)


@contextlib.contextmanager
def _running(log_dir: str, out: TextIO) -> Iterator[_Demo]:
    """The simulator and cachegate on free loopback ports, their clocks in step, two clients."""
    # The scenarios take ~20 minutes of fake time: starting an hour ago keeps every line of
    # their logs in the past, below the user's real sessions in `sessions list`.
    start = float(int(time.time()) - DEMO_START_AGO_S)
    clock = DemoClock(start)
    sim_config = SimConfig(ttft_ms=2, chunk_ms=1, cache_ttl_s=CACHE_TTL_S, start_time=start)
    with contextlib.ExitStack() as stack:
        running = stack.enter_context(run_simulator(sim_config))
        settings = demo_settings(running.api_base, log_dir)
        app = create_app(settings, registry=CollectorRegistry(), clock=clock, environ={})
        server = stack.enter_context(ServerThread(app))
        auth = {"Authorization": "Bearer demo", "Content-Type": "application/json"}
        client = stack.enter_context(
            httpx.Client(base_url=server.url + "/v1/", headers=auth, timeout=30, trust_env=False)
        )
        direct = stack.enter_context(
            httpx.Client(base_url=running.api_base + "/", headers=auth, timeout=30, trust_env=False)
        )
        yield _Demo(
            client=client,
            direct=direct,
            running=running,
            proxy_url=server.url + "/v1",
            clock=clock,
            gateway=app.state.gateway,
            log_dir=log_dir,
            out=out,
        )


class _Report(io.TextIOBase):
    """The demo's output, which a reader may stop taking (``cachegate demo | head``): the demo
    plays on to the end regardless, so its logs are written (an earlier demo's were removed
    at the start), and what it would print goes nowhere."""

    def __init__(self, out: TextIO) -> None:
        self._out: TextIO | None = out
        # A failed write other than a reader gone (a full disk): said at the end, exit code 1
        self.failed: OSError | None = None

    def write(self, text: str) -> int:
        if self._out is not None:
            try:
                self._out.write(text)
            except BrokenPipeError:
                self._gone()
            except OSError as exc:
                self.failed = self.failed or exc
                self._gone()
        return len(text)

    def flush(self) -> None:
        if self._out is not None:
            try:
                self._out.flush()
            except BrokenPipeError:
                self._gone()
            except OSError as exc:
                self.failed = self.failed or exc
                self._gone()

    def _gone(self) -> None:
        out, self._out = self._out, None
        if out is not None and out is sys.stdout:  # (or the interpreter's flush at exit fails)
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())


def _demo_log(path: str, session: str) -> bool:
    """Whether ``path`` is a log an earlier demo wrote for ``session``: a regular file, empty
    (a demo stopped before its first line) or opened by that session's ``session_meta`` line
    for ``DEMO_MODEL``."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        with open(path, "rb") as f:
            first = f.readline(65536)
        if not first.strip():
            return os.path.getsize(path) == 0
        meta = orjson.loads(first)
    except (OSError, orjson.JSONDecodeError):
        return False
    return (
        isinstance(meta, dict)
        and meta.get("type") == "session_meta"
        and meta.get("session") == session
        and meta.get("model") == DEMO_MODEL
    )


def run_demo(*, log_dir: str | None = None, out: TextIO = sys.stdout) -> int:
    """Play the scenarios and print their report to ``out``; 0 when each showed what it should.

    ``log_dir`` None: a fresh temporary directory, left in place so the logs can be opened after.
    """
    started = time.perf_counter()
    report = _Report(out)
    out = cast(TextIO, report)
    log_dir = log_dir or tempfile.mkdtemp(prefix="cachegate-demo-")
    # An earlier demo's logs there: replaced, or the two runs' exchanges (on fake clocks) would
    # interleave in one session and its costs add up.
    earlier = [(s, p) for s in DEMO_SESSIONS if os.path.lexists(p := session_log_path(log_dir, s))]
    for session, path in earlier:  # (only a demo's own: a log of a session of that name stays)
        if not _demo_log(path, session):
            print(
                f"cachegate: {path} is in the way: it is no log of an earlier demo (an earlier"
                " demo's begins with its session_meta line, model demo-model); move it, or give"
                " the demo another --log-dir",
                file=sys.stderr,
            )
            return 1
    for _, path in earlier:
        os.unlink(path)
    with _running(log_dir, out) as demo:
        if earlier:
            demo.say(f"(replaced the logs of an earlier demo in {log_dir})")
        demo.say(f"cachegate demo: simulator {demo.running.api_base}, cachegate {demo.proxy_url}")
        demo.say(
            f"{DEMO_MODEL}: {_tokens(CONTEXT_WINDOW)}-token window, cache TTL {CACHE_TTL_S:.0f} s, "
            f"${PRICES['price_input']:.2f} / ${PRICES['price_cached_input']:.3f} cached / "
            f"${PRICES['price_output']:.2f} out per 1M tokens"
        )
        for scenario in SCENARIOS:
            demo.say()
            try:
                scenario(demo)
            except Exception as exc:  # the report goes on; the exit code says it went wrong
                log.debug("demo scenario %s failed", scenario.__name__, exc_info=True)
                demo.expect(False, f"{scenario.__name__} failed: {type(exc).__name__}: {exc}")
        demo.flush()
        problems = len(demo.problems)
    arg = shlex.quote(log_dir)
    out.write(
        f"\nSession logs in {log_dir}\n"
        f"  cachegate sessions list --log-dir {arg}\n"
        f"  cachegate sessions show {STAMPED_SESSION} --log-dir {arg}\n"
        f"  cachegate sessions cost {STAMPED_SESSION} --log-dir {arg}\n"
    )
    elapsed = time.perf_counter() - started
    if problems:
        out.write(f"{problems} unexpected result(s), see the lines marked '!' ({elapsed:.1f} s)\n")
    else:
        out.write(f"All {len(SCENARIOS)} scenarios showed what they should ({elapsed:.1f} s)\n")
    out.flush()
    if report.failed is not None:  # (the logs are written: the demo played on)
        reason = report.failed.strerror or str(report.failed)
        print(
            f"cachegate demo: cannot write its report: {reason} (its logs are in {log_dir})",
            file=sys.stderr,
        )
        return 1
    return 1 if problems else 0
