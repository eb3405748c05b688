"""``cachegate demo``: the simulator and cachegate in-process, four scripted agent conversations.

Everything runs offline on loopback ports: the provider simulator, cachegate in front of it, and an
agent played by the official ``openai`` SDK through the real HTTP path. Each scenario prints what
cachegate recorded for it (read back from the session logs through ``proxy.report``, never
hard-coded): an interrupted turn repaired, a timestamp in the system prompt that destroys the prompt
cache, an idle gap past the cache TTL, and a history compacted before it outgrows the context window.

Both clocks (the simulator's and cachegate's) are fake and move together, so a ten-minute idle gap
takes no time at all.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

import orjson
from openai import BadRequestError, OpenAI
from prometheus_client import CollectorRegistry

from proxy import report
from proxy.app import Gateway, create_app
from proxy.config import Settings, settings_from_mapping
from proxy.eventlog import read_events, session_log_path
from proxy.serving import ServerThread
from proxy.simulator import RunningSimulator, SimConfig, run_simulator

log = logging.getLogger(__name__)

DEMO_MODEL = "demo-model"
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
IDLE_GAP_S = 600.0  # the user's coffee break in scenario 3, past the 300 s cache TTL

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
    simulator's own clock by ``advance``."""

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


@dataclass
class _Demo:
    """What every scenario uses: the two clients, the simulator, the clocks and the log reader."""

    client: OpenAI  # through cachegate
    direct: OpenAI  # straight to the simulator
    running: RunningSimulator
    clock: DemoClock
    gateway: Gateway
    settings: Settings
    log_dir: str
    out: TextIO
    problems: list[str] = field(default_factory=list)

    def say(self, text: str = "", indent: int = 0) -> None:
        self.out.write(textwrap.indent(text, " " * indent) + "\n")

    def expect(self, ok: bool, what: str) -> None:
        """Note (and print) a scenario that did not show what it is meant to show."""
        if not ok:
            self.problems.append(what)
            self.say(f"! unexpected: {what}", 3)

    def advance(self, seconds: float) -> None:
        """Move both clocks: the provider's cache and cachegate's accounting see the same time."""
        self.running.sim.advance(seconds)
        self.clock.advance(seconds)

    def rows(self, session: str) -> list[report.ExchangeRow]:
        """The session's exchanges as cachegate logged them (after the writer caught up)."""
        self.flush()
        return report.show_session(self.log_dir, session).rows

    def events(self, session: str, kind: str) -> list[dict[str, Any]]:
        self.flush()
        path = session_log_path(self.log_dir, session)
        return [e for e in read_events(path).events if e.get("type") == kind]

    def flush(self) -> None:
        if self.gateway.writer is not None:
            self.gateway.writer.flush()

    def chat(
        self,
        session: str,
        messages: list[dict[str, Any]],
        *,
        stream: bool = False,
        script: dict[str, Any] | None = None,
    ) -> tuple[dict[str, str], dict[str, Any]]:
        """One request through cachegate: its ``X-Cachegate-*`` headers and the assistant message."""
        headers = {"X-Session-Id": session}
        if script is not None:
            headers["X-Sim-Script"] = orjson.dumps(script).decode()
        raw = self.client.chat.completions.with_raw_response.create(
            model=DEMO_MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            stream=stream,
            extra_headers=headers,
        )
        cachegate = {k.lower(): v for k, v in raw.headers.items() if k.lower().startswith("x-cache")}
        if not stream:
            completion = raw.parse()
            message = completion.choices[0].message.model_dump(exclude_none=True)
            return cachegate, message
        content: list[str] = []
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                content.append(chunk.choices[0].delta.content)
        return cachegate, {"role": "assistant", "content": "".join(content)}


def _tokens(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _money(usd: float) -> str:
    return f"${usd:.4f}"


def _clip(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _system(extra: str = "") -> dict[str, Any]:
    return {"role": "system", "content": extra + SYSTEM_PROMPT}


# --------------------------------------------------------------------------------------------------
# 1. The interrupted turn


def interrupted_turn(demo: _Demo) -> None:
    """A history whose last tool call has no result: the provider refuses it, cachegate repairs it."""
    session = "demo-interrupted"
    demo.say(f"1. The interrupted turn (session {session})")
    demo.say("The user pressed Ctrl+C while read_file ran: the call has no result.", 3)
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
    try:
        demo.direct.chat.completions.create(
            model=DEMO_MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
        )
        demo.say("direct to the provider: 200 (the provider accepted the broken history)", 3)
        demo.expect(False, "the provider should refuse a dangling tool call with a 400")
    except BadRequestError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        text = str(body.get("message", exc))
        demo.say(f"direct to the provider: {exc.status_code}", 3)
        demo.say(textwrap.fill(text, 96, initial_indent="  ", subsequent_indent="  "), 3)

    headers, reply = demo.chat(session, messages)
    repairs = headers.get("x-cachegate-repairs", "?")
    demo.say(f"through cachegate:      200  X-Cachegate-Repairs: {repairs}", 3)
    for repair in demo.events(session, "request")[-1].get("repairs") or []:
        demo.say(
            f"  {repair.get('kind')} at messages[{repair.get('index')}] "
            f"({repair.get('tool_call_id')}): {repair.get('action')}",
            3,
        )
    demo.expect(repairs == "1", f"expected 1 repair, cachegate reported {repairs}")

    demo.advance(TURN_GAP_S)
    messages = [*messages, reply, _user("Thanks. Go on with the fix.")]
    headers, reply = demo.chat(session, messages)
    row = demo.rows(session)[-1]
    demo.say(
        f"the conversation goes on: {row.status}  X-Cachegate-Repairs: "
        f"{headers.get('x-cachegate-repairs', '?')} (the same repair, byte-identical), "
        f"{_tokens(row.cache_read)} of {_tokens(row.tokens_in)} prompt tokens read from cache",
        3,
    )
    demo.expect(row.status == 200, "the next turn should succeed")
    demo.expect(bool(row.cache_read), "the repaired prefix should hit the provider's cache")


# --------------------------------------------------------------------------------------------------
# 2. A timestamp in the system prompt


QUESTIONS = (
    "Where does the proxy decide how long to wait before retrying a request?",
    "Does it honour the Retry-After header of a 429?",
    "What happens when the upstream closes the stream halfway?",
    "Which test covers that case?",
)


def _session_of_turns(
    demo: _Demo, session: str, system: Callable[[], dict[str, Any]], questions: tuple[str, ...]
) -> None:
    """A streamed question-and-answer session, ``TURN_GAP_S`` apart; the system prompt is rebuilt
    for every request, as agents do."""
    history: list[dict[str, Any]] = []
    for i, question in enumerate(questions):
        if i:
            demo.advance(TURN_GAP_S)
        history.append(_user(question))
        _, reply = demo.chat(session, [system(), *history], stream=True)
        history.append(reply)


def _sums(rows: list[report.ExchangeRow]) -> tuple[int, int, int]:
    return (
        sum(r.tokens_in or 0 for r in rows),
        sum(r.cache_read or 0 for r in rows),
        sum(r.cache_waste or 0 for r in rows),
    )


def timestamp_in_system_prompt(demo: _Demo) -> None:
    """The same session twice: a stable system prompt, then one that starts with the current time."""
    stable, stamped = "demo-stable", "demo-timestamp"
    demo.say(f"2. A timestamp in the system prompt (sessions {stable}, {stamped})")
    demo.say(
        f"{len(QUESTIONS)} streamed turns, {TURN_GAP_S:.0f} s apart; system prompt + 3 tools, "
        "once as is, once starting with the current time.",
        3,
    )

    def stamped_system() -> dict[str, Any]:
        now = datetime.fromtimestamp(demo.clock(), UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return _system(f"Current time: {now}\n\n")

    _session_of_turns(demo, stable, _system, QUESTIONS)
    demo.advance(TURN_GAP_S)
    _session_of_turns(demo, stamped, stamped_system, QUESTIONS)

    costs = {s: report.session_cost(demo.log_dir, s) for s in (stable, stamped)}
    for label, session in (("stable system prompt", stable), ("with the current time", stamped)):
        prompt, read, waste = _sums(demo.rows(session))
        cost = costs[session]
        demo.say(
            f"{label:<22} {_tokens(prompt)} prompt tokens, {_tokens(read)} read from cache, "
            f"{_tokens(waste)} wasted; cost {_money(cost.actual)} (uncached {_money(cost.uncached)})",
            3,
        )
    wasteful = [r for r in demo.rows(stamped) if r.cache_waste]
    demo.expect(bool(wasteful), "the timestamped session should waste cache tokens")
    if not wasteful:
        return
    row = wasteful[0]
    divergence = next(
        (
            e.get("divergence") or {}
            for e in demo.events(stamped, "response")
            if e.get("exchange") == row.exchange
        ),
        {},
    )
    volatile = bool(divergence.get("volatile"))
    kind = divergence.get("volatile_kind")
    demo.say(
        f"waste per turn: {_tokens(row.cache_waste)} tokens, cause {row.waste_cause} at "
        f"{row.waste_location}"
        + (f", flagged as a volatile token ({kind})" if volatile else ", not flagged as volatile"),
        3,
    )
    demo.say(f"  before: {_clip(divergence.get('old', ''), 70)}", 3)
    demo.say(f"  after:  {_clip(divergence.get('new', ''), 70)}", 3)
    extra = costs[stamped].actual - costs[stable].actual
    if costs[stable].actual > 0:
        demo.say(
            f"the timestamp cost {_money(extra)} more over {len(QUESTIONS)} turns "
            f"({100 * extra / costs[stable].actual:+.0f}%)",
            3,
        )
    demo.expect(row.waste_cause == "prefix_rewrite", f"cause should be prefix_rewrite, is {row.waste_cause}")
    demo.expect(row.waste_location == "system", f"location should be system, is {row.waste_location}")
    demo.expect(volatile, "the rewrite should be flagged as a volatile token")


# --------------------------------------------------------------------------------------------------
# 3. An idle gap past the TTL


def idle_gap(demo: _Demo) -> None:
    """A warm session, a pause longer than the cache TTL, and the miss it costs."""
    session = "demo-idle"
    demo.say(f"3. An idle gap past the cache TTL (session {session})")
    questions = (
        "Summarize what the retry module does.",
        "List its public functions.",
        "Which of them are untested?",
    )
    history: list[dict[str, Any]] = []
    for question in questions:
        history.append(_user(question))
        _, reply = demo.chat(session, [_system(), *history], stream=True)
        history.append(reply)
        demo.advance(TURN_GAP_S)
    warm = demo.rows(session)[-1]
    demo.advance(IDLE_GAP_S - TURN_GAP_S)
    history.append(_user("Back from lunch. Write the missing tests."))
    demo.chat(session, [_system(), *history], stream=True)
    row = demo.rows(session)[-1]
    demo.say(
        f"turn {len(questions)}: {_tokens(warm.cache_read)} of {_tokens(warm.tokens_in)} prompt "
        "tokens read from cache",
        3,
    )
    demo.say(
        f"{IDLE_GAP_S / 60:.0f} min idle (the cache TTL of {DEMO_MODEL} is "
        f"{CACHE_TTL_S / 60:.0f} min), then turn {len(questions) + 1}: "
        f"{_tokens(row.cache_read)} read, {_tokens(row.cache_waste)} wasted, cause {row.waste_cause}",
        3,
    )
    demo.expect(bool(warm.cache_read), "the warm session should hit the cache")
    demo.expect(bool(row.cache_waste), "the turn after the idle gap should waste cache tokens")
    demo.expect(row.waste_cause == "ttl_expired", f"cause should be ttl_expired, is {row.waste_cause}")


# --------------------------------------------------------------------------------------------------
# 4. Compaction


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


def _tool_round(demo: _Demo, session: str, history: list[dict[str, Any]], path: str) -> dict[str, str]:
    """One agent step: the (scripted) model asks to read ``path``; the agent runs the tool."""
    script = {
        "content": f"Reading {path}.",
        "tool_calls": [{"name": "read_file", "arguments": {"path": path}}],
    }
    headers, reply = demo.chat(session, [_system(), *history], script=script)
    history.append(reply)
    for call in reply.get("tool_calls") or []:
        history.append({"role": "tool", "tool_call_id": call["id"], "content": _fake_file(path)})
    demo.advance(TURN_GAP_S)
    return headers


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
SECOND_TASK_FILES = tuple(f"proxy/cli_part{i}.py" for i in range(1, 12))


def compaction_scenario(demo: _Demo) -> None:
    """A long session: cachegate compacts it before the threshold, and the cache hits again after."""
    session = "demo-compaction"
    threshold = int(CONTEXT_WINDOW * TRIGGER_PERCENT / 100)
    demo.say(f"4. A history that crosses the compaction threshold (session {session})")
    demo.say(
        f"context window of {DEMO_MODEL}: {_tokens(CONTEXT_WINDOW)} tokens; compaction at "
        f"{TRIGGER_PERCENT:.0f}% = {_tokens(threshold)}",
        3,
    )
    history: list[dict[str, Any]] = [_user("test_retry fails since yesterday's merge. Fix it.")]
    for path in FIRST_TASK_FILES:
        _tool_round(demo, session, history, path)
    _, reply = demo.chat(session, [_system(), *history], script={"content": "Fixed: budget_s was ignored."})
    history.append(reply)
    demo.advance(TURN_GAP_S)
    history.append(_user("Good. Now add a --max-retries option to the CLI, with a test."))
    compacted = False
    for path in SECOND_TASK_FILES:
        headers = _tool_round(demo, session, history, path)
        if headers.get("x-cachegate-compacted") == "1":
            compacted = True
            break
    if not compacted:
        demo.expect(False, "cachegate never compacted the session")
        return
    _tool_round(demo, session, history, "proxy/cli.py")
    rows = {r.exchange: r for r in demo.rows(session) if r.exchange}
    made = [
        e
        for e in demo.events(session, "request")
        if "source" in ((e.get("transforms") or {}).get("compacted") or {})
    ]
    if not made:
        demo.expect(False, "no request event records the new compaction")
        return
    at_id = made[0]["exchange"]
    info = made[0]["transforms"]["compacted"]
    before, at, after = rows.get(at_id - 1), rows.get(at_id), rows.get(at_id + 1)
    if before is None or at is None or after is None:
        demo.expect(False, f"exchanges {at_id - 1}..{at_id + 1} are missing from the log")
        return
    demo.say(
        f"request {at_id - 1}: {_tokens(before.tokens_in)} prompt + {_tokens(before.tokens_out)} "
        "completion tokens; the client appends a tool result",
        3,
    )
    demo.say(
        f"request {at_id}: X-Cachegate-Compacted: 1, {info['covered'] - info['start']} messages "
        f"replaced by one summary ({info['source']}); estimate {_tokens(info['tokens_before'])} "
        f"-> {_tokens(info['tokens_after'])} tokens; provider: {_tokens(at.tokens_in)} prompt "
        f"tokens, {_tokens(at.cache_read)} read from cache (the one expected miss)",
        3,
    )
    demo.say(
        f"request {at_id + 1}: X-Cachegate-Compacted: 1 (the same summary, byte-identical); "
        f"{_tokens(after.cache_read)} of {_tokens(after.tokens_in)} prompt tokens read from cache, "
        f"{_tokens(after.cache_waste)} wasted",
        3,
    )
    demo.expect(info["tokens_before"] > info["tokens_after"], "compaction should shrink the history")
    demo.expect(
        (at.tokens_in or 0) < (before.tokens_in or 0),
        "the compacted request should be smaller than the one before",
    )
    demo.expect(
        (after.cache_read or 0) > (at.cache_read or 0), "the request after compaction should hit"
    )


# --------------------------------------------------------------------------------------------------


SCENARIOS: tuple[Callable[[_Demo], None], ...] = (
    interrupted_turn,
    timestamp_in_system_prompt,
    idle_gap,
    compaction_scenario,
)


@contextlib.contextmanager
def _running(log_dir: str) -> Iterator[_Demo]:
    start = float(int(time.time()))
    clock = DemoClock(start)
    sim_config = SimConfig(ttft_ms=2, chunk_ms=1, cache_ttl_s=CACHE_TTL_S, start_time=start)
    with run_simulator(sim_config) as running:
        settings = demo_settings(running.api_base, log_dir)
        app = create_app(settings, registry=CollectorRegistry(), clock=clock, environ={})
        with ServerThread(app) as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="demo", max_retries=0, timeout=30)
            direct = OpenAI(base_url=running.api_base, api_key="demo", max_retries=0, timeout=30)
            try:
                yield _Demo(
                    client=client,
                    direct=direct,
                    running=running,
                    clock=clock,
                    gateway=app.state.gateway,
                    settings=settings,
                    log_dir=log_dir,
                    out=sys.stdout,
                )
            finally:
                client.close()
                direct.close()


def run_demo(*, log_dir: str | None = None, out: TextIO = sys.stdout) -> int:
    """Play the four scenarios and print their report to ``out``; 0 when each showed what it should.

    ``log_dir`` None: a fresh temporary directory, left in place so the logs can be opened after.
    """
    started = time.perf_counter()
    log_dir = log_dir or tempfile.mkdtemp(prefix="cachegate-demo-")
    with _running(log_dir) as demo:
        demo.out = out
        demo.say(
            f"cachegate demo: provider simulator at {demo.running.url}, cachegate at "
            f"{demo.client.base_url}"
        )
        demo.say(
            f"model {DEMO_MODEL}: {_tokens(CONTEXT_WINDOW)}-token window, cache TTL "
            f"{CACHE_TTL_S:.0f} s, ${PRICES['price_input']:.2f} per 1M input tokens, "
            f"${PRICES['price_cached_input']:.3f} cached, ${PRICES['price_output']:.2f} output"
        )
        for scenario in SCENARIOS:
            demo.say()
            try:
                scenario(demo)
            except Exception as exc:  # the report goes on; the exit code says it went wrong
                log.debug("demo scenario failed", exc_info=True)
                demo.expect(False, f"{scenario.__name__} failed: {type(exc).__name__}: {exc}")
        demo.flush()
        problems = list(demo.problems)
    out.write(f"\nSession logs: {log_dir}\n")
    out.write(f"  cachegate sessions list --log-dir {log_dir}\n")
    out.write(f"  cachegate sessions show demo-timestamp --log-dir {log_dir}\n")
    out.write(f"  cachegate sessions cost demo-timestamp --log-dir {log_dir}\n")
    elapsed = time.perf_counter() - started
    if problems:
        out.write(f"{len(problems)} unexpected result(s); done in {elapsed:.1f} s\n")
        return 1
    out.write(f"All {len(SCENARIOS)} scenarios behaved as expected; done in {elapsed:.1f} s\n")
    return 0
