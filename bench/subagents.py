"""Many conversations taking turns under one session id: a main agent's sub-agents.

    python -m bench.subagents [--agents 32] [--rounds 20] [--output-kb 10] [--marked]

cachegate (pinned to CPU 0) in front of the provider simulator (CPU 1); ``--agents`` sub-agents,
one system prompt (~18 KB) and a task each, send one turn each in turn under one
``X-Session-Id``, through the openai SDK, each turn appending the model's answer and a tool
output of ``--output-kb``. ``--marked``: each turn's newest message carries a ``cache_control``
mark, taken off the one before (Claude's prompt caching through an OpenAI-compatible gateway).

Printed per round: the history's size, cachegate's CPU per request (``/proc``), its RSS growth,
the memory its sessions are estimated to hold (``cachegate_sessions_memory_bytes``, what
``sessions.max_memory_mb`` bounds), and how many turns so far (from each agent's third) were
compared with their own agent's previous turn (``expected`` in the log's response line at least
90% of that turn's prompt; a conversation pushed out of the session's memory is compared with
another agent's request instead, which shares only the system prompt and tools).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import procs

HOST = "127.0.0.1"
_LOREM = (
    "Read the code before you change it. Prefer small commits. Run the tests after each change. "
)
SYSTEM = "You are a careful coding agent. " + _LOREM * 200
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": _LOREM * 4,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def _metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else None


def _marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [*messages[:-1], {**messages[-1], "cache_control": {"type": "ephemeral"}}]


def _own_turns(log_dir: Path, agents: int) -> tuple[int, int]:
    """Of the answers from each agent's third turn on, how many had at least 90% of that
    agent's previous prompt expected from the cache: compared with its own previous turn, not
    with another agent's request, which shares only the system prompt and tools (at the second
    turn the previous prompt is little more than those, and either comparison passes)."""
    responses = []
    for path in log_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("type") == "response":
                responses.append(event)
    responses.sort(key=lambda event: event["exchange"])
    own = 0
    for j in range(2 * agents, len(responses)):
        cache, before = responses[j].get("cache") or {}, responses[j - agents].get("usage") or {}
        own += cache.get("expected", 0) >= 0.9 * (before.get("prompt") or 0) > 0
    return own, max(0, len(responses) - 2 * agents)


def run(agents: int, rounds: int, output_kb: int, marked: bool) -> list[dict[str, Any]]:
    from openai import OpenAI

    work = Path(tempfile.mkdtemp(prefix="cachegate-subagents-"))
    sim_port, port = procs.free_port(), procs.free_port()
    env = procs.bench_env()
    sim = procs.start(
        "simulator",
        [procs.python(), "-m", "proxy.cli", "simulate", "--port", str(sim_port)],
        port=sim_port,
        cpu=1,
        log_dir=work,
        env=env,
    )
    logs = work / "logs"
    proxy = procs.start(
        "cachegate",
        [
            procs.python(),
            "-m",
            "proxy.cli",
            "serve",
            "--port",
            str(port),
            "--upstream",
            f"http://{HOST}:{sim_port}/v1",
            "--log-dir",
            str(logs),
        ],
        port=port,
        cpu=0,
        log_dir=work,
        env=env,
    )
    rows: list[dict[str, Any]] = []
    try:
        sim.wait_ready("/v1/models", 30)
        proxy.wait_ready("/healthz", 30)
        client = OpenAI(
            base_url=f"http://{HOST}:{port}/v1",
            api_key="sk-bench",
            max_retries=0,
            timeout=120,
            default_headers={"X-Session-Id": "subagents"},
        )
        histories = [
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Sub-agent {k}: check part {k} of the code."},
            ]
            for k in range(agents)
        ]
        rss0 = proxy.rss()
        for r in range(rounds):
            cpu0 = proxy.cpu()
            for k, history in enumerate(histories):
                sent = _marked(history) if marked else history
                answer = client.chat.completions.create(
                    model="gpt-4o",
                    messages=sent,  # type: ignore[arg-type]
                    tools=TOOLS,  # type: ignore[arg-type]
                )
                message = answer.choices[0].message.model_dump(exclude_none=True)
                history.append(message)
                output = f"output {r} of {k}: " + f"x{r * 1000 + k} " * (output_kb * 1024 // 6)
                calls = message.get("tool_calls") or []
                if calls:
                    history.extend(
                        {"role": "tool", "tool_call_id": c["id"], "content": output} for c in calls
                    )
                else:
                    history.append({"role": "user", "content": output})
            cpu = (proxy.cpu() - cpu0) / agents
            time.sleep(0.3)  # the observers and the log writer catch up
            judged, answered = _own_turns(logs, agents)
            row = {
                "round": r,
                "history_kb": round(len(json.dumps({"messages": histories[0]})) / 1000),
                "cpu_ms_per_request": round(1000 * cpu, 2),
                "rss_growth_mb": round((proxy.rss() - rss0) / 1024, 1),
                "estimated_mb": round(
                    (_metric(port, "cachegate_sessions_memory_bytes") or 0) / 1e6, 1
                ),
                "judged": f"{judged}/{answered}",
            }
            rows.append(row)
            print(
                f"round {r:3d}  history {row['history_kb']:5d} KB  "
                f"cpu {row['cpu_ms_per_request']:6.2f} ms/request  "
                f"RSS +{row['rss_growth_mb']:6.1f} MB  estimated {row['estimated_mb']:6.1f} MB  "
                f"turns compared with their own {row['judged']}",
                flush=True,
            )
    finally:
        proxy.stop()
        sim.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m bench.subagents", description=__doc__)
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--output-kb", type=int, default=10)
    parser.add_argument("--marked", action="store_true")
    args = parser.parse_args(argv)
    return run(args.agents, args.rounds, args.output_kb, args.marked)


if __name__ == "__main__":
    main(sys.argv[1:])
