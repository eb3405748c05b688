"""Compaction end to end: trigger, summarizer failure, stickiness with cache hits, rewind, retry."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy import compaction
from proxy.compaction import SUMMARIZER_SYSTEM_PROMPT, SUMMARY_MARKER
from proxy.compactor import MAX_COMPACTIONS
from proxy.eventlog import read_events
from proxy.report import list_sessions, render_cost, render_show, session_cost, show_session
from proxy.serving import ServerThread
from proxy.simulator import RunningSimulator, SimConfig, run_simulator
from proxy.simulator.reply import parse_script
from proxy.simulator.tokens import request_tokens
from tests.e2e_support import (
    NoCacheUpstream,
    asgi_body,
    asgi_lifespan,
    cachegate_process,
    wait_for,
)

MODEL = "gpt-4o"


def history(
    rounds: int, *, output_chars: int = 1200, system_repeat: int = 200
) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful coding agent. " * system_repeat},
        {"role": "user", "content": "Earlier task: rename the config loader."},
        {"role": "assistant", "content": "Done: renamed load_config to read_settings."},
        {
            "role": "user",
            "content": "Now make the parser handle CRLF line endings in proxy/sse.py.",
        },
    ]
    for i in range(rounds):
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {
                            "name": "run",
                            "arguments": orjson.dumps({"cmd": f"pytest -k case{i}"}).decode(),
                        },
                    }
                ],
            }
        )
        messages.append(
            {
                "role": "tool",
                "tool_call_id": f"call_{i}",
                "content": f"output {i}: " + "x" * output_chars,
            }
        )
    return messages


@pytest.fixture
def sim() -> Iterator[RunningSimulator]:
    with run_simulator(SimConfig(context_window=200000)) as running:
        yield running


CONFIG = {
    "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 4},
    "models": {MODEL: {"context_window": 6000, "cache_ttl_s": 300}},
}


def summary_requests(sim: RunningSimulator) -> list[Any]:
    """The requests ``sim`` received that were compaction's summary calls."""
    return [
        r
        for r in sim.sim.requests
        if SUMMARIZER_SYSTEM_PROMPT in str(r.body["messages"][0].get("content"))
    ]


def browse_tool(description: str) -> dict[str, Any]:
    """A tool as large as its ``description``."""
    return {
        "type": "function",
        "function": {
            "name": "browse",
            "description": description,
            "parameters": {"type": "object", "properties": {}},
        },
    }


def compacted_events(proxy: Any) -> list[dict[str, Any]]:
    proxy.settle()
    return [
        e
        for p in proxy.log_dir.glob("*.jsonl")
        for e in read_events(p).events
        if e["type"] == "compacted"
    ]


def test_history_over_the_trigger_is_compacted_and_stays_sticky(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base, CONFIG)
    c = sdk(proxy.base_url)
    msgs = history(18)
    sim.sim.enqueue([parse_script("TASK: handle CRLF. DONE: cases 0-13 pass. LEFT: cases 14-17.")])
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "long"}
    )
    assert raw.headers["x-cachegate-compacted"] == "1"
    summary_call = sim.sim.requests[-2].body
    assert "tools" not in summary_call
    forwarded = sim.sim.requests[-1].body["messages"]
    assert forwarded[0] == msgs[0]
    assert forwarded[1]["content"].startswith(SUMMARY_MARKER)
    assert "TASK: handle CRLF" in forwarded[1]["content"]
    # the launching user message survives verbatim when it fits max_anchor_chars; here the tail is kept
    assert forwarded[-1] == msgs[-1]
    assert len(forwarded) < len(msgs)
    event = compacted_events(proxy)[0]
    assert event["source"] == "model" and event["tokens_before"] > event["tokens_after"]

    # the next turns resend the full history: the same substitution, byte for byte, and cache hits
    for turn in range(2):
        msgs = [
            *msgs,
            {"role": "assistant", "content": f"step {turn}"},
            {"role": "user", "content": f"continue {turn}"},
        ]
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "long"}
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        now = sim.sim.requests[-1].body["messages"]
        assert orjson.dumps(now[: len(forwarded)]) == orjson.dumps(forwarded)
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens >= 1024
        forwarded = now
    proxy.settle()
    responses = [
        e
        for p in proxy.log_dir.glob("*.jsonl")
        for e in read_events(p).events
        if e["type"] == "response"
    ]
    assert [r["cache"]["waste"] for r in responses] == [0, 0, 0]  # the bought miss is not waste
    assert proxy.metric("cachegate_compactions_total", {"model": MODEL, "result": "summary"}) == 1
    assert proxy.metric("cachegate_compactions_total", {"model": MODEL, "result": "reused"}) == 2


def next_turn_reuses_the_summary(
    sim: RunningSimulator, client: Any, msgs: list[dict[str, Any]], forwarded: list[Any]
) -> Any:
    """Send session "long"'s next turn after ``msgs``: it goes out with the summary it went out
    with before (``forwarded``), byte for byte, and no summary call. Returns the raw response."""
    turn = [*msgs, {"role": "assistant", "content": "step"}, {"role": "user", "content": "go"}]
    sent = len(sim.sim.requests)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=turn, extra_headers={"X-Session-Id": "long"}
    )
    assert len(sim.sim.requests) == sent + 1  # no summary call
    assert raw.headers["x-cachegate-compacted"] == "1"
    now = sim.sim.requests[-1].body["messages"]
    assert orjson.dumps(now[: len(forwarded)]) == orjson.dumps(forwarded)
    return raw


def _first_compaction(
    sdk: Any,
    proxy_factory: Any,
    model: str,
    sim_config: SimConfig,
    call_id: Callable[[int], Any],
    interrupted: bool = False,
) -> int:
    """The turn of an agent's tool loop (a call and its ~600-token result a turn, a 6,000-token
    window, the trigger at 75%) whose request is compacted first; ``interrupted``: the history
    opens with a call left unanswered (Ctrl+C) and a message typed after it."""
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    with run_simulator(sim_config) as upstream:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 4},
            "models": {model: {"context_window": 6000}},
        }
        proxy = proxy_factory(upstream.api_base, config)
        client = sdk(proxy.base_url, default_headers={"X-Session-Id": "loop"})
        history: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Fix the failing test in repo foo."},
        ]
        if interrupted:
            arguments = '{"path": "x.py"}'
            call = {"name": "read_file", "arguments": arguments}
            history += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": call_id(99), "type": "function", "function": call}],
                },
                {"role": "user", "content": "Stop that, read the m files instead."},
            ]
        for i in range(8):
            arguments = orjson.dumps({"path": f"m{i}.py"}).decode()
            call = {"name": "read_file", "arguments": arguments}
            history += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": call_id(i), "type": "function", "function": call}],
                },
                {"role": "tool", "tool_call_id": call_id(i), "content": f"Step {i}. " + LINE * 40},
            ]
            raw = client.chat.completions.with_raw_response.create(
                model=model,
                messages=history,  # type: ignore[arg-type]
                tools=tools,  # type: ignore[arg-type]
            )
            assert raw.http_response.status_code == 200
            if raw.headers.get("x-cachegate-compacted") == "1":
                return i
    raise AssertionError("never compacted")


def test_a_result_the_repair_copied_is_counted_once_by_the_trigger(
    sdk: Any, proxy_factory: Any
) -> None:
    """Gemini's calls without ids (the repair gives each one, and a copy of its result the
    call's id): the trigger dropped the copied last result from what the provider counted,
    then estimated it again with the next turn's appended messages. Compaction came at ~61%
    of the window, not 75, its provider factor read 1.3, and the session paid for three
    summaries where unique ids paid for one. So with Mistral's ids rewritten (``call_0``
    every turn, an earlier interrupted call's among them) and ids sent as numbers: an earlier
    unanswered call of the same id made the last result look like its synthetic one."""
    gemini = SimConfig(context_window=8000, gemini_rules=True)
    unique = _first_compaction(sdk, proxy_factory, "gemini-2.5-pro", gemini, "call_{:024d}".format)
    idless = _first_compaction(sdk, proxy_factory, "gemini-2.5-pro", gemini, lambda i: "")
    assert idless == unique
    mistral = SimConfig(context_window=8000, mistral_rules=True)
    for model, config, reused in (
        ("mistral-large-latest", mistral, lambda i: "call_0"),
        ("gpt-4o", SimConfig(context_window=8000), lambda i: 0),
    ):
        own = _first_compaction(sdk, proxy_factory, model, config, "c{:08d}".format, True)
        assert _first_compaction(sdk, proxy_factory, model, config, reused, True) == own, model


LINE = "The quick brownish foxes jumped overly lazy dogs repeatedly. "


def test_a_restarted_cachegate_takes_up_the_compaction_its_log_records(
    sim: RunningSimulator, sdk: Any, tmp_path: Path
) -> None:
    """Stickiness across a restart: the session's log holds the summary and the digests of the
    history it covers, and the next turn after the restart gets the identical substitution,
    byte for byte, with no summary call and a cache hit, where it was summarized anew (another
    call, another wording for the agent, the cache missed). A history that differs inside what
    the summary covers does not get it."""
    from tests.conftest import run_proxy

    logs = tmp_path / "logs"
    msgs = history(18)
    sim.sim.enqueue([parse_script("TASK: handle CRLF. DONE: cases 0-13 pass. LEFT: 14-17.")])
    with run_proxy(sim.api_base, logs, CONFIG) as before:
        c = sdk(before.base_url)
        c.chat.completions.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "long"}
        )
        forwarded = sim.sim.requests[-1].body["messages"]
        assert forwarded[1]["content"].startswith(SUMMARY_MARKER)
        made = compacted_events(before)
        assert [e["source"] for e in made] == ["model"]
        assert made[0]["prefix_digest"] and made[0]["opening"]

    with run_proxy(sim.api_base, logs, CONFIG) as after:  # the same log directory: a restart
        c = sdk(after.base_url)
        # a history changed under the summary (an old tool output cleared) is summarized anew
        edited = [*msgs[:6], {**msgs[6], "content": "[cleared]"}, *msgs[7:]]
        sent = len(sim.sim.requests)
        sim.sim.enqueue([parse_script("TASK: handle CRLF, another summary.")])
        c.chat.completions.create(
            model=MODEL, messages=edited, extra_headers={"X-Session-Id": "long"}
        )
        assert len(sim.sim.requests) == sent + 2  # the summary call, then the request
        assert "another summary" in sim.sim.requests[-1].body["messages"][1]["content"]

        raw = next_turn_reuses_the_summary(sim, c, msgs, forwarded)
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens >= 1024  # the cache, across the restart
        after.settle()
        lines = read_events(logs / "long.jsonl").events
        requests = [e for e in lines if e["type"] == "request"]
        assert requests[-1]["transforms"]["compacted"] == {
            "reused": True,
            "covered": made[0]["covered"],
            "restored": True,
        }
        assert (
            after.metric("cachegate_compactions_total", {"model": MODEL, "result": "reused"}) == 1
        )


def test_a_session_forgotten_for_the_count_and_back_at_once_takes_up_its_compaction(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session pushed out by ``sessions.max_sessions`` whose next turn came before the log's
    writer had written its compaction's line (it writes every 50 ms) read no compaction in its
    log: another summary call, another wording, the provider's cache missed from then on. The
    writer here waits longer, as a loaded machine's may; the log is flushed before it is read."""
    from proxy import eventlog

    monkeypatch.setattr(eventlog, "POLL_S", 2.0)
    proxy = proxy_factory(sim.api_base, {**CONFIG, "sessions": {"max_sessions": 1}})
    c = sdk(proxy.base_url)
    msgs = history(18)
    sim.sim.enqueue([parse_script("TASK: handle CRLF. DONE: cases 0-13 pass. LEFT: 14-17.")])
    c.chat.completions.create(model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "long"})
    forwarded = sim.sim.requests[-1].body["messages"]
    assert forwarded[1]["content"].startswith(SUMMARY_MARKER)
    c.chat.completions.create(  # another session: "long" is forgotten (max_sessions 1)
        model=MODEL, messages=history(2), extra_headers={"X-Session-Id": "other"}
    )
    next_turn_reuses_the_summary(sim, c, msgs, forwarded)


def test_after_a_restart_a_history_the_estimate_puts_under_the_trigger_keeps_its_summary(
    sdk: Any, tmp_path: Path
) -> None:
    """The provider refused a dense history as too long and cachegate compacted it; after a
    restart cachegate's estimate (4 bytes a token) put the next turn under the trigger, so the
    log was not read: the whole history went out, was refused again and summarized anew (a
    refused round trip, another summary call, another wording). Now the compaction comes back."""
    from tests.conftest import run_proxy

    logs = tmp_path / "logs"
    config = {
        "compaction": {"enabled": True, "trigger_percent": 100, "keep_recent": 4},
        "models": {MODEL: {"context_window": 1000000}},  # the estimate never triggers
    }
    msgs = history(10, output_chars=2000, system_repeat=10)
    headers = {"X-Session-Id": "dense"}
    with run_simulator(SimConfig(context_window=3000)) as small:
        small.sim.enqueue([parse_script("short summary")])
        with run_proxy(small.api_base, logs, config) as before:
            sdk(before.base_url).chat.completions.create(
                model=MODEL, messages=msgs, extra_headers=headers
            )
            assert [r.status for r in small.sim.requests] == [400, 200, 200]
            forwarded = small.sim.requests[-1].body["messages"]
        with run_proxy(small.api_base, logs, config) as after:
            turn = [
                *msgs,
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "go"},
            ]
            raw = sdk(after.base_url).chat.completions.with_raw_response.create(
                model=MODEL, messages=turn, extra_headers=headers
            )
            assert raw.headers["x-cachegate-compacted"] == "1"
            assert [r.status for r in small.sim.requests] == [400, 200, 200, 200]  # one more
            now = small.sim.requests[-1].body["messages"]
            assert orjson.dumps(now[: len(forwarded)]) == orjson.dumps(forwarded)


def _few_large_messages(output_repeat: int) -> tuple[list[Any], list[Any]]:
    """A short history of large messages (docs, notes, a tool's output of ``output_repeat``
    words times five) and its next turn."""
    call = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{}"}}
    msgs = [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": "Read these docs: " + "lorem ipsum dolor sit amet " * 200},
        {"role": "assistant", "content": "Notes: " + "lorem ipsum dolor sit amet " * 200},
        {"role": "user", "content": "Now run the tests."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": "out " + "lorem ipsum dolor sit amet " * output_repeat,
        },
    ]
    return msgs, [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]


def test_after_a_restart_a_short_history_of_large_messages_keeps_its_summary(
    sim: RunningSimulator, sdk: Any, tmp_path: Path
) -> None:
    """Few, large messages: the compaction kept fewer than keep_recent of them, and after a
    restart the history, no longer than keep_recent, was summarized anew."""
    from tests.conftest import run_proxy

    logs = tmp_path / "logs"
    config = {**CONFIG, "compaction": {"enabled": True, "trigger_percent": 75}}  # keep 8
    msgs, turn = _few_large_messages(500)
    assert len(turn) <= 1 + 8
    headers = {"X-Session-Id": "short"}
    with run_proxy(sim.api_base, logs, config) as before:
        sim.sim.enqueue([parse_script("FIRST SUMMARY")])
        c = sdk(before.base_url)
        c.chat.completions.create(model=MODEL, messages=msgs, extra_headers=headers)
        forwarded = sim.sim.requests[-1].body["messages"]
        assert "FIRST SUMMARY" in forwarded[1]["content"]
        sent = len(sim.sim.requests)
        c.chat.completions.create(model=MODEL, messages=turn, extra_headers=headers)
        assert len(sim.sim.requests) == sent + 1  # in the same process: reused
    with run_proxy(sim.api_base, logs, config) as after:
        sent = len(sim.sim.requests)
        sdk(after.base_url).chat.completions.create(
            model=MODEL, messages=turn, extra_headers=headers
        )
        assert len(sim.sim.requests) == sent + 1  # no summary call
        now = sim.sim.requests[-1].body["messages"]
        assert orjson.dumps(now[: len(forwarded)]) == orjson.dumps(forwarded)


def test_after_a_restart_a_refused_short_history_is_planned_on_the_window_less_its_completion(
    sdk: Any, tmp_path: Path
) -> None:
    """After a restart, a short history of large messages refused for the completion it asks
    for besides its prompt: the compaction its log records is taken up and the plan made
    again, on the window less that completion once. It took the window already shrunk and
    took the completion off twice: the latest tool output, which fitted, was summarized too."""
    from tests.conftest import run_proxy

    logs = tmp_path / "logs"
    config = {
        "compaction": {"enabled": True, "trigger_percent": 100},  # keep 8
        "models": {MODEL: {"context_window": 1000000}},  # only refusals compact
    }
    msgs, turn = _few_large_messages(300)
    headers = {"X-Session-Id": "short-refused"}
    with run_simulator(SimConfig(context_window=5000)) as small:
        small.sim.enqueue([parse_script("FIRST SUMMARY")])
        with run_proxy(small.api_base, logs, config) as before:
            sdk(before.base_url).chat.completions.create(
                model=MODEL, messages=msgs, extra_headers=headers
            )
            assert [r.status for r in small.sim.requests] == [400, 200, 200]
            assert "FIRST SUMMARY" in small.sim.requests[-1].body["messages"][1]["content"]
        sent = len(small.sim.requests)
        with run_proxy(small.api_base, logs, config) as after:
            sdk(after.base_url).chat.completions.create(
                model=MODEL, messages=turn, extra_headers=headers, max_tokens=1000
            )
        # refused for prompt + max_tokens; the summary rolled on from the restored one
        assert [r.status for r in small.sim.requests[sent:]] == [400, 200, 200]
        assert "FIRST SUMMARY" in str(small.sim.requests[-2].body["messages"])
        retry = small.sim.requests[-1].body["messages"]
        assert retry[-4:] == turn[-4:]  # the tool call and its output kept verbatim


def test_requests_of_a_session_arriving_together_after_a_restart_each_get_their_summary(
    sim: RunningSimulator, sdk: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sub-agents of one session, each compacted, send their next turns at once after a
    restart, on a slow disk: the second found the log being read for the first, took it for
    read, and paid for a new summary. Both wait for the one read and get their own back."""
    import threading

    from proxy import compactor as compactor_module
    from tests.conftest import run_proxy

    logs = tmp_path / "logs"
    headers = {"X-Session-Id": "fan-out"}
    agents = []
    for k in range(2):
        msgs = history(18)
        msgs[1] = {"role": "user", "content": f"Sub-agent {k}: rename the config loader."}
        agents.append(msgs)
    with run_proxy(sim.api_base, logs, CONFIG) as before:
        c = sdk(before.base_url)
        for k, msgs in enumerate(agents):
            sim.sim.enqueue([parse_script(f"Summary of sub-agent {k}.")])
            c.chat.completions.create(model=MODEL, messages=msgs, extra_headers=headers)
        summaries = [
            r.body["messages"][1]["content"]
            for r in sim.sim.requests
            if str(r.body["messages"][1].get("content")).startswith(SUMMARY_MARKER)
        ]
        assert len(summaries) == 2 and "Summary of sub-agent 0." in summaries[0]
        assert "Summary of sub-agent 1." in summaries[1]

    read = compactor_module.logged_compactions
    calls: list[int] = []

    def slow_read(*args: Any) -> Any:
        calls.append(1)
        time.sleep(0.5)  # a slow disk: the other request arrives during the read
        return read(*args)

    monkeypatch.setattr(compactor_module, "logged_compactions", slow_read)
    with run_proxy(sim.api_base, logs, CONFIG) as after:
        c = sdk(after.base_url)
        sent = len(sim.sim.requests)
        turns = [
            [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
            for msgs in agents
        ]
        threads = [
            threading.Thread(
                target=c.chat.completions.create,
                kwargs={"model": MODEL, "messages": turn, "extra_headers": headers},
            )
            for turn in turns
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(sim.sim.requests) == sent + 2  # no summary call
        got = sorted(r.body["messages"][1]["content"] for r in sim.sim.requests[sent:])
        assert got == sorted(summaries)
        assert calls == [1]  # the log read once


def test_each_model_is_compacted_by_its_own_window(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    big = "local-llama"  # no configured entry covers it: sized by "*"
    config = {**CONFIG, "models": {**CONFIG["models"], "*": {"context_window": 1000000}}}
    proxy = proxy_factory(sim.api_base, config)
    c = sdk(proxy.base_url)
    msgs = history(18)
    for model, session, compacted in [
        (big, "wide-1", None),
        (MODEL, "narrow", "1"),
        (big, "wide-2", None),
        (MODEL + "-2024-08-06", "narrow-snapshot", "1"),
    ]:
        raw = c.chat.completions.with_raw_response.create(
            model=model, messages=msgs, extra_headers={"X-Session-Id": session}
        )
        assert raw.headers.get("x-cachegate-compacted") == compacted, model


def test_the_wait_for_the_summarizer_is_not_counted_as_cachegates_overhead(
    sdk: Any, proxy_factory: Any
) -> None:
    # (waits of a second each, far above what a busy machine's stall adds to cachegate's own
    # few ms: with 300 ms and a 0.2 s bound, one CI run read 0.212)
    with run_simulator(SimConfig(context_window=200000, ttft_ms=1000)) as slow:
        proxy = proxy_factory(slow.api_base, CONFIG)
        slow.sim.enqueue([parse_script("TASK: t. DONE: d. LEFT: l.")])
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=history(18), extra_headers={"X-Session-Id": "slow-summary"}
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        labels = {"route": "chat"}
        assert proxy.metric("cachegate_proxy_overhead_seconds_count", labels) == 1
        # the summary call and the answer each waited 1 s (either counted: over 1 s);
        # cachegate's own part is a few ms
        assert proxy.metric("cachegate_proxy_overhead_seconds_sum", labels) < 0.5
        duration = {"route": "chat", "model": MODEL}
        assert proxy.metric("cachegate_request_duration_seconds_sum", duration) > 1.9


def test_the_summary_call_is_priced_with_its_exchange(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """The provider bills the summary call: its cost is in the exchange's (log, sessions cost)
    and in the metrics, where "Spent" came out below the bill with compaction on."""
    prices = {"price_input": 1.0, "price_cached_input": 0.5, "price_output": 2.0}
    config = {**CONFIG, "models": {MODEL: {**CONFIG["models"][MODEL], **prices}}}
    proxy = proxy_factory(sim.api_base, config)
    sim.sim.enqueue([parse_script("TASK: t. DONE: d. LEFT: l.")])
    raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
        model=MODEL, messages=history(18), extra_headers={"X-Session-Id": "priced"}
    )
    assert raw.headers["x-cachegate-compacted"] == "1"
    summary, answer = sim.sim.requests[-2].usage, sim.sim.requests[-1].usage
    assert "tools" not in sim.sim.requests[-2].body  # (the summary call)

    def cost(usage: dict[str, Any]) -> float:
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        fresh = usage["prompt_tokens"] - cached
        return (fresh * 1.0 + cached * 0.5 + usage["completion_tokens"] * 2.0) / 1e6

    proxy.settle()
    (response,) = [
        e for e in read_events(proxy.log_dir / "priced.jsonl").events if e["type"] == "response"
    ]
    assert response["cost"]["actual"] == pytest.approx(cost(summary) + cost(answer))
    assert response["usage"]["prompt"] == answer["prompt_tokens"]  # the answer's own usage
    labels = {"model": MODEL, "kind": "actual"}
    assert proxy.metric("cachegate_cost_usd_total", labels) == pytest.approx(
        cost(summary) + cost(answer)
    )
    prompt = {"model": MODEL, "kind": "prompt"}
    assert proxy.metric("cachegate_tokens_total", prompt) == (
        summary["prompt_tokens"] + answer["prompt_tokens"]
    )
    # The log gives the summary call apart (its model, tokens and cost), so that the reports'
    # tokens add up to what the provider billed, as the metrics' do.
    assert response["summary"]["model"] == MODEL
    assert response["summary"]["usage"]["prompt"] == summary["prompt_tokens"]
    assert response["summary"]["usage"]["completion"] == summary["completion_tokens"]
    assert response["summary"]["cost"]["actual"] == pytest.approx(cost(summary))
    (listed,) = list_sessions(proxy.log_dir)
    assert listed.tokens_in == summary["prompt_tokens"] + answer["prompt_tokens"]
    assert listed.tokens_out == summary["completion_tokens"] + answer["completion_tokens"]
    (row,) = show_session(proxy.log_dir, "priced").rows
    assert (row.tokens_in, row.summary_tokens_in) == (
        answer["prompt_tokens"],
        summary["prompt_tokens"],
    )
    shown = render_show(show_session(proxy.log_dir, "priced"))
    assert f"summary call {summary['prompt_tokens']:,} in" in shown


def test_an_unpriced_model_compacted_by_a_priced_summarizer_is_said_to_be_unpriced(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """The summary call's cost on the row did not make a $0 main call look priced: `sessions
    cost` said nothing of the model without prices."""
    config = {
        "compaction": {**CONFIG["compaction"], "summarizer_model": "summ"},
        "models": {
            "local-x": {"context_window": 6000},
            "summ": {"price_input": 1.0, "price_output": 4.0},
        },
    }
    proxy = proxy_factory(sim.api_base, config)
    sim.sim.enqueue([parse_script("TASK: t. DONE: d. LEFT: l.")])
    raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
        model="local-x", messages=history(18), extra_headers={"X-Session-Id": "local"}
    )
    assert raw.headers["x-cachegate-compacted"] == "1"
    proxy.settle()
    report = session_cost(proxy.log_dir, "local")
    assert report.unpriced == {"local-x": 1}
    assert report.priced_exchanges == 0
    assert report.actual > 0  # (the summary call, at its model's prices)
    assert "1 exchange on local-x counted as $0" in render_cost(report)


@pytest.mark.parametrize(
    ("fault", "kind"),
    [("429", "status"), ("reset", "midstream"), ("error_event", "error_event")],
)
def test_summarizer_failure_falls_back_to_extractive(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, fault: str, kind: str
) -> None:
    """The client's request still succeeds; the failed summary call counts as the upstream's
    error (a summarizer model that always fails was seen only on stderr)."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    sim.sim.enqueue([parse_script({"content": "never used", "fault": fault})])
    msgs = history(18)
    raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(model=MODEL, messages=msgs)
    assert raw.http_response.status_code == 200
    assert raw.headers["x-cachegate-compacted"] == "1"
    forwarded = sim.sim.requests[-1].body["messages"]
    assert forwarded[1]["content"].startswith(SUMMARY_MARKER)
    assert "CRLF" in forwarded[1]["content"]  # the task, quoted by the extractive skeleton
    assert compacted_events(proxy)[0]["source"] == "extractive"
    assert (
        proxy.metric("cachegate_compactions_total", {"model": MODEL, "result": "extractive"}) == 1
    )
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": kind}) == 1


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (b"[1, 2, 3]", "an array"),
        (b'{"choices": "nope", "id": "x"}', "an object with choices, id"),
        (b'{"choices": [{"text": "a legacy completion"}]}', "an object with choices"),
    ],
)
def test_a_summarizer_answer_that_is_no_completion_is_said_to_be_so(
    scripted: Any,
    proxy_factory: Any,
    caplog: pytest.LogCaptureFixture,
    answer: bytes,
    said: str,
) -> None:
    """A summarizer behind a gateway that answers 200 with another shape: the request still
    goes, with the extractive summary, but the warning said only ``(TypeError)``."""
    _upstream, url = scripted(chunks=[answer], content_type=b"application/json")
    proxy = proxy_factory(url, CONFIG)
    with caplog.at_level(logging.WARNING, logger="proxy.compactor"):
        r = httpx.post(
            proxy.base_url + "/chat/completions",
            json={"model": MODEL, "messages": history(18)},
            headers={"X-Session-Id": "odd-summary"},
        )
        assert r.status_code == 200 and r.headers["x-cachegate-compacted"] == "1"
        assert compacted_events(proxy)[0]["source"] == "extractive"
    [warned] = [r.getMessage() for r in caplog.records if "summarizer failed" in r.getMessage()]
    assert "no chat completion (no choices[0].message: " + said in warned, warned
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "invalid"}) == 1


def test_a_summary_answer_with_a_lone_surrogate_escape_is_the_summary(
    scripted: Any, proxy_factory: Any
) -> None:
    """A summarizer's answer the SDKs read (an emoji cut in it, ``"\\ud83d"``) was no JSON to
    orjson: the paid summary was thrown away for the extractive one, and counted as invalid."""
    answer = (
        b'{"id":"s","object":"chat.completion","model":"gpt-4o","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"SUMMARY of the work \\ud83d"},'
        b'"finish_reason":"stop"}],"usage":{"prompt_tokens":3000,"completion_tokens":40}}'
    )
    upstream, url = scripted(chunks=[answer], content_type=b"application/json")
    proxy = proxy_factory(url, CONFIG)
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json={"model": MODEL, "messages": history(18)},
        headers={"X-Session-Id": "cut-summary"},
    )
    assert r.status_code == 200 and r.headers["x-cachegate-compacted"] == "1"
    forwarded = orjson.loads(upstream.requests[-1]["body"])["messages"]
    assert "SUMMARY of the work \ufffd" in forwarded[1]["content"]
    assert compacted_events(proxy)[0]["source"] == "model"
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "invalid"}) == 0


@pytest.mark.parametrize("shape", ["parts", "gzip"])
def test_a_summary_answered_in_parts_or_compressed_is_the_summary(
    scripted: Any, proxy_factory: Any, shape: str
) -> None:
    """A summarizer's message whose content is a list of parts (Mistral's reasoning models),
    or an answer gzipped by an upstream that compresses whatever it is asked: the paid summary
    was thrown away for the extractive one (the gzipped one counted as an invalid answer)."""
    import gzip

    from tests.test_relay import completion

    content: Any = "SUMMARY of the work"
    if shape == "parts":
        content = [
            {"type": "thinking", "thinking": [{"type": "text", "text": "hmm, THOUGHTS"}]},
            {"type": "text", "text": "SUMMARY of the work"},
        ]
    answer = completion(content, 3000, 40)
    headers: list[tuple[bytes, bytes]] = []
    if shape == "gzip":
        answer, headers = gzip.compress(answer), [(b"content-encoding", b"gzip")]
    upstream, url = scripted(chunks=[answer], content_type=b"application/json")
    upstream.extra_headers = headers
    proxy = proxy_factory(url, CONFIG)
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json={"model": MODEL, "messages": history(18)},
        headers={"X-Session-Id": f"summary-{shape}"},
    )
    assert r.status_code == 200 and r.headers["x-cachegate-compacted"] == "1"
    forwarded = orjson.loads(upstream.requests[-1]["body"])["messages"]
    assert "SUMMARY of the work" in forwarded[1]["content"]
    assert "THOUGHTS" not in forwarded[1]["content"]
    assert compacted_events(proxy)[0]["source"] == "model"
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "invalid"}) == 0


@pytest.mark.parametrize(
    ("before", "sent"), [(0, "bearer"), (263, "bearer"), (0, "query"), (0, "tab"), (0, "basic")]
)
def test_a_summarizer_error_that_names_the_key_is_said_without_it(
    scripted: Any, proxy_factory: Any, caplog: pytest.LogCaptureFixture, before: int, sent: str
) -> None:
    """A 200 carrying ``{"error": {"message": "Incorrect API key provided: …"}}``: the
    message went to stderr with the client's key in it (a key no pattern knows); and, where the
    300 characters said cut the key (after 263 of prose), with most of it. So too a key sent
    in the URL's query (Gemini's ``?key=``), after a tab in Authorization, or as Basic's
    password, quoted decoded."""
    import base64
    import secrets
    import string

    key = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(40))
    prose = ("x" * (before - 1) + " ") if before else ""
    refused = {"error": {"message": f"{prose}Incorrect API key provided: {key}. Check it."}}
    _upstream, url = scripted(chunks=[orjson.dumps(refused)], content_type=b"application/json")
    proxy = proxy_factory(url, CONFIG)
    auth = {
        "bearer": f"Bearer {key}",
        "query": "Bearer placeholder-of-the-client",
        "tab": f"Bearer\t{key}",
        "basic": "Basic " + base64.b64encode(f"user-name:{key}".encode()).decode(),
    }[sent]
    query = f"?key={key}" if sent == "query" else ""
    with caplog.at_level(logging.WARNING):
        httpx.post(
            proxy.base_url + "/chat/completions" + query,
            json={"model": MODEL, "messages": history(18)},
            headers={"Authorization": auth},
            timeout=30,
        )
    said = [r.getMessage() for r in caplog.records if "summarizer" in r.getMessage()]
    assert len(said) == 1 and "Incorrect API key provided: [REDACTED" in said[0]
    assert not any(key[:n] in caplog.text for n in range(6, len(key) + 1))


def test_the_summary_call_carries_the_client_s_key_but_not_its_idempotency_key(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The summary call is a request of its own: it went with the client's Idempotency-Key (a
    gateway that honours one would answer the client's request with the summary, or refuse it
    as a key reused with another body) and its Accept of an event stream."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    sim.sim.enqueue([parse_script("TASK: summary.")])
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json={"model": MODEL, "messages": history(18)},
        headers={
            "Authorization": "Bearer sk-test-key-of-the-client-0123456789",
            "OpenAI-Project": "proj_abc",
            "Idempotency-Key": "stainless-python-retry-7f3c",
            "Accept": "text/event-stream",
            "X-Session-Id": "headers",
        },
    )
    assert r.status_code == 200 and r.headers["x-cachegate-compacted"] == "1"
    summary, forwarded = sim.sim.requests[-2], sim.sim.requests[-1]
    assert summary.body["messages"][0]["content"] == SUMMARIZER_SYSTEM_PROMPT
    said = {k.lower(): v for k, v in summary.headers.items()}
    assert said["authorization"] == "Bearer sk-test-key-of-the-client-0123456789"
    assert said["openai-project"] == "proj_abc"
    assert "idempotency-key" not in said
    assert said["accept"] == "application/json"
    # the client's own request goes on with all it said
    told = {k.lower(): v for k, v in forwarded.headers.items()}
    assert told["idempotency-key"] == "stainless-python-retry-7f3c"
    assert told["accept"] == "text/event-stream"


def test_a_summarizer_answer_without_text_falls_back_and_says_so(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A 200 whose message has no text (tool calls): stderr said only "answered 200"."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    sim.sim.enqueue([parse_script({"tool_calls": [{"name": "grep", "arguments": "{}"}]})])
    with caplog.at_level(logging.WARNING):
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=history(18)
        )
    assert raw.headers["x-cachegate-compacted"] == "1"
    assert compacted_events(proxy)[0]["source"] == "extractive"
    said = [r.getMessage() for r in caplog.records if "summarizer" in r.getMessage()]
    assert said == ["summarizer answered 200 without text; using the extractive summary"]


def test_a_summarizer_answer_that_is_no_http_counts_as_invalid(proxy_factory: Any) -> None:
    """As an exchange's is: the summary call's was counted as a failure to connect."""
    from tests.test_relay import RawUpstream

    upstream = RawUpstream(b"SSH-2.0-OpenSSH_9.2\r\n")
    try:
        proxy = proxy_factory(upstream.url, CONFIG)
        r = httpx.post(
            proxy.base_url + "/chat/completions",
            json={"model": MODEL, "messages": history(18)},
            headers={"X-Session-Id": "garbage"},
        )
        assert r.status_code == 502
        assert proxy.metric("cachegate_upstream_errors_total", {"kind": "invalid"}) == 2
        assert proxy.metric("cachegate_upstream_errors_total", {"kind": "connect"}) == 0
    finally:
        upstream.sock.close()


def test_a_summarizer_slower_than_its_timeout_falls_back_and_counts_a_timeout(
    sdk: Any, proxy_factory: Any
) -> None:
    with run_simulator(SimConfig(context_window=200000, ttft_ms=1200)) as slow:
        config = {**CONFIG, "compaction": {**CONFIG["compaction"], "summary_timeout_s": 0.3}}
        proxy = proxy_factory(slow.api_base, config)
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=history(18)
        )
        assert raw.http_response.status_code == 200
        assert raw.headers["x-cachegate-compacted"] == "1"
        assert compacted_events(proxy)[0]["source"] == "extractive"
        assert proxy.metric("cachegate_upstream_errors_total", {"kind": "timeout"}) == 1


def test_rewind_before_the_covered_prefix_drops_the_stale_summary(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base, CONFIG)
    c = sdk(proxy.base_url)
    msgs = history(18)
    sim.sim.enqueue([parse_script("SUMMARY OF THE FUTURE")])
    c.chat.completions.create(model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "rw"})
    covered = compacted_events(proxy)[0]["covered"]
    # rewind after the covered prefix (drop only the last round): the summary is kept
    c.chat.completions.create(model=MODEL, messages=msgs[:-2], extra_headers={"X-Session-Id": "rw"})
    assert "SUMMARY OF THE FUTURE" in orjson.dumps(sim.sim.requests[-1].body).decode()
    # rewind before it: edit an early message; the stale summary must not leak
    rewound = [*msgs[:4], {"role": "user", "content": "Actually, do something else."}]
    assert len(rewound) < covered
    c.chat.completions.create(model=MODEL, messages=rewound, extra_headers={"X-Session-Id": "rw"})
    sent = orjson.dumps(sim.sim.requests[-1].body).decode()
    assert "SUMMARY OF THE FUTURE" not in sent
    assert sim.sim.requests[-1].body["messages"] == rewound


def test_a_history_that_ends_where_the_summary_ends_keeps_its_last_message(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """A regenerate of the answer at the point a compaction covers up to sends exactly its
    covered prefix: it went as [system, summary], the user's pending message hidden in the
    summary and the model answering the summary."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    c = sdk(proxy.base_url)
    msgs = history(18)
    sim.sim.enqueue([parse_script("SUMMARY OF THE FUTURE")])
    c.chat.completions.create(model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "rg"})
    covered = compacted_events(proxy)[0]["covered"]
    for client in (c, sdk(proxy.base_url)):  # (and again, with what the first left held)
        client.chat.completions.create(
            model=MODEL, messages=msgs[:covered], extra_headers={"X-Session-Id": "rg"}
        )
        sent = sim.sim.requests[-1].body["messages"]
        assert sent[-1] == msgs[covered - 1]
        assert "SUMMARY OF THE FUTURE" not in orjson.dumps(sent).decode()


def test_context_length_exceeded_is_compacted_and_retried_once(
    sdk: Any, proxy_factory: Any
) -> None:
    with run_simulator(SimConfig(context_window=3000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 100, "keep_recent": 4},
            "models": {MODEL: {"context_window": 1000000}},
        }
        proxy = proxy_factory(small.api_base, config)
        msgs = history(10, output_chars=2000, system_repeat=10)
        import openai

        with pytest.raises(openai.BadRequestError) as info:
            sdk(small.api_base).chat.completions.create(model=MODEL, messages=msgs)  # type: ignore[arg-type]
        assert "maximum context length" in str(info.value)
        small.sim.enqueue([parse_script("short summary")])
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs
        )
        assert raw.http_response.status_code == 200
        assert raw.headers["x-cachegate-compacted"] == "1"
        statuses = [r.status for r in small.sim.requests[-3:]]
        assert statuses == [400, 200, 200]  # refused, the summary call, the compacted retry
        # the refused attempt is an upstream answer >= 400 too
        assert proxy.metric("cachegate_upstream_errors_total", {"kind": "status"}) == 1


def assert_refused_then_compacted(raw: Any, upstream: Any) -> None:
    """The client's answer came from a compacted retry: the upstream saw the refused request,
    the summary call and the retry, and the answer says it was compacted."""
    assert raw.http_response.status_code == 200
    assert raw.headers["x-cachegate-compacted"] == "1"
    statuses = [r.status for r in upstream.sim.requests]
    assert statuses == [400, 200, 200]  # refused, the summary call, the compacted retry


def _dense_history(pairs: int) -> list[dict[str, Any]]:
    """Ten tool rounds whose outputs are ``pairs`` times "a,": dense text (CSV, minified JSON),
    a token a byte to the simulator where the estimate counts one per four."""
    msgs = history(10, output_chars=0, system_repeat=10)
    for message in msgs:
        if message["role"] == "tool":
            message["content"] = "a," * pairs
    return msgs


def test_a_retry_plans_against_the_tokens_the_provider_counted(
    sdk: Any, proxy_factory: Any
) -> None:
    """Tool outputs of dense text (CSV, minified JSON) cost the provider a token a byte or two,
    not four: a retry planned on the estimate kept what it took for a quarter of the window and
    was refused again. The provider's refusal says how many tokens it counted; the retry plans
    that much smaller."""
    with run_simulator(SimConfig(context_window=3000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 100, "keep_recent": 8},
            "models": {MODEL: {"context_window": 1000000}},
        }
        proxy = proxy_factory(small.api_base, config)
        msgs = _dense_history(600)  # 300 estimated tokens an output, 1,200 to the provider
        small.sim.enqueue([parse_script("short summary")])
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "dense-tail"}
        )
        assert_refused_then_compacted(raw, small)


def test_a_compaction_the_provider_refuses_is_compacted_further_for_the_retry(
    sdk: Any, proxy_factory: Any
) -> None:
    """The compaction made before forwarding was itself over the window (dense tool outputs, and
    the extractive summary, as long as a model's may be: the summarizer is slower than its
    timeout): the retry, which finds it in use, keeps fewer messages and rolls it on."""
    with run_simulator(SimConfig(context_window=4000, ttft_ms=400)) as small:
        config = {
            "compaction": {
                "enabled": True,
                "trigger_percent": 50,
                "keep_recent": 6,
                "summary_timeout_s": 0.1,
            },
            "models": {MODEL: {"context_window": 4000}},
        }
        proxy = proxy_factory(small.api_base, config)
        msgs = _dense_history(700)  # 350 estimated tokens an output, 1,400 to the provider
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "refused-compaction"}
        )
        assert raw.http_response.status_code == 200
        chats = [
            r.status
            for r in small.sim.requests
            if r.body["messages"][0]["content"] != SUMMARIZER_SYSTEM_PROMPT
        ]
        assert chats == [400, 200]  # the first compaction refused, the one made afresh taken


def test_a_summary_call_refused_as_too_long_is_sent_again_smaller(
    sdk: Any, proxy_factory: Any
) -> None:
    """A session's first history of dense tool outputs (CSV digits, a token a byte or two to
    the provider): the summary call, planned at 4 bytes a token to fit half the window, was
    itself refused as too long, and the extractive summary stood in for the model's. It is sent
    once more, as much smaller as the refusal's count says."""
    csv = ",".join(str(i % 10) for i in range(300))
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a data agent."},
        {"role": "user", "content": "Analyse the data files."},
    ]
    for i in range(14):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "cat", "arguments": "{}"}}
        msgs += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": csv},
        ]
    with run_simulator(SimConfig(context_window=4000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 50, "keep_recent": 4},
            "models": {MODEL: {"context_window": 4000}},
        }
        proxy = proxy_factory(small.api_base, config)
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "dense-summary"}
        )
        assert raw.http_response.status_code == 200
        assert raw.headers.get("x-cachegate-compacted") == "1"
        summaries = [
            r.status
            for r in small.sim.requests
            if r.body["messages"][0]["content"] == SUMMARIZER_SYSTEM_PROMPT
        ]
        assert summaries == [400, 200]
    assert [e["source"] for e in compacted_events(proxy)] == ["model"]


def test_a_compressed_refusal_is_read_and_relayed_with_its_coding(
    scripted: Any, sdk: Any, proxy_factory: Any
) -> None:
    """An upstream that gzips its 400 though identity was asked for: the window it states was
    not read (the retry was planned on the configured window and refused again), and when
    nothing could be compacted the client got the gzip bytes with no Content-Encoding."""
    import gzip

    import openai

    error = {
        "error": {
            "message": "This model's maximum context length is 3000 tokens. However, your "
            "messages resulted in 9000 tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
        }
    }
    upstream, url = scripted(
        chunks=[gzip.compress(orjson.dumps(error))],
        status=400,
        content_type=b"application/json",
        extra_headers=[(b"content-encoding", b"gzip")],
    )
    config = {"compaction": {"enabled": True}, "models": {MODEL: {"context_window": 1000000}}}
    proxy = proxy_factory(url, config)
    msgs = [history(0)[0], {"role": "user", "content": "word " * 4000}]  # nothing to compact
    with pytest.raises(openai.BadRequestError) as info:
        sdk(proxy.base_url).chat.completions.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "gz"}
        )
    assert info.value.code == "context_length_exceeded"
    assert "maximum context length is 3000" in str(info.value)
    assert len(upstream.requests) == 1
    proxy.settle()
    responses = [
        e for e in read_events(proxy.log_dir / "gz.jsonl").events if e["type"] == "response"
    ]
    assert "maximum context length is 3000" in responses[0]["error"]


def test_the_prompt_size_a_refusal_states_is_read() -> None:
    said = compaction.provider_prompt_tokens
    assert said(b"However, your messages resulted in 4542 tokens. Please reduce") == 4542
    assert said(b"you requested 5000 tokens (4000 in the messages, 1000 in the completion)") == 4000
    assert said(b'"message":"prompt is too long: 210000 tokens > 200000 maximum"') == 210000
    assert said(b"the request (9000 tokens) exceeds the available context size") == 9000
    assert said(b"maximum context length is 4000 tokens") is None


def test_a_refused_history_with_nothing_to_compact_is_not_sent_again(
    sdk: Any, proxy_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """One message too long for the window: nothing can be compacted, and the very body refused
    was sent a second time, refused again, and shown as two exchanges, one never answered.
    (Said on stderr so: it said "compacting and retrying", and nothing was retried.)"""
    import logging

    import openai

    caplog.set_level(logging.INFO, logger="proxy")

    with run_simulator(SimConfig(context_window=3000)) as small:
        config = {"compaction": {"enabled": True}, "models": {MODEL: {"context_window": 1000000}}}
        proxy = proxy_factory(small.api_base, config)
        msgs = [history(0)[0], {"role": "user", "content": "word " * 4000}]
        with pytest.raises(openai.BadRequestError) as info:
            sdk(proxy.base_url).chat.completions.create(
                model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "one-big"}
            )
        assert "maximum context length" in str(info.value)  # the provider's refusal, as it came
        assert [r.status for r in small.sim.requests] == [400]  # sent once
        proxy.settle()
        responses = [
            e
            for e in read_events(proxy.log_dir / "one-big.jsonl").events
            if e["type"] == "response"
        ]
        assert [(r["exchange"], r["status"]) for r in responses] == [(1, 400)]
        from proxy.report import show_session

        rows = show_session(proxy.log_dir, "one-big").rows
        assert [(r.exchange, r.status) for r in rows] == [(1, 400)]
        assert proxy.metric("cachegate_upstream_errors_total", {"kind": "status"}) == 1
    said = [r.getMessage() for r in caplog.records if "one-big" in r.getMessage()]
    assert said == [
        "session one-big: context length exceeded; compacting",
        "session one-big: nothing to compact; the refusal is relayed",
    ]


def test_a_client_leaving_during_a_retrys_compaction_is_logged_with_its_whole_wait(
    proxy_factory: Any,
) -> None:
    """Refused as too long, then compacted for the retry while the summarizer thinks: the
    client gives up. Its line says 499 and how long it waited (it said the refusal's few ms);
    the refusal counts among the upstream's errors."""
    with run_simulator(SimConfig(context_window=3000, ttft_ms=3000)) as small:
        proxy = proxy_factory(
            small.api_base,
            {"compaction": {"enabled": True}, "models": {MODEL: {"context_window": 1000000}}},
        )
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                proxy.base_url + "/chat/completions",
                json={"model": MODEL, "messages": history(18)},
                headers={"X-Session-Id": "gave-up"},
                timeout=1.0,
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            proxy.settle()
            logged = [
                e
                for e in read_events(proxy.log_dir / "gave-up.jsonl").events
                if e["type"] == "response"
            ]
            if logged:
                break
            time.sleep(0.05)
        # the provider's refusal is an upstream error, as when the retry goes (it was not
        # counted when the client left first)
        refusals = proxy.metric("cachegate_upstream_errors_total", {"kind": "status"})
    (response,) = logged
    assert response["status"] == 499 and response["interrupted"] is True
    assert response["duration_s"] >= 0.9
    assert refusals == 1


def one_task(rounds: int, output_chars: int) -> list[dict[str, Any]]:
    """The usual agent session: a system prompt, one task, then only tool rounds."""
    full = history(rounds, output_chars=output_chars, system_repeat=10)
    return [full[0], full[3], *full[4:]]


def test_one_task_and_its_tool_loop_are_compacted_keeping_the_task(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """Pulling the cut back to the task would leave nothing to compact: the task is kept
    verbatim after the system prompt and the rounds after it are summarized (the history
    used to be forwarded over the trigger, uncompacted, on every turn)."""
    config = {
        "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 4},
        "models": {MODEL: {"context_window": 2000}},
    }
    proxy = proxy_factory(sim.api_base, config)
    msgs = one_task(12, output_chars=400)
    assert compaction.estimate_tokens(msgs) > 1500  # over the trigger
    sim.sim.enqueue([parse_script("Read the files of rounds 0-9.")])
    raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "one-task"}
    )
    assert raw.headers["x-cachegate-compacted"] == "1"
    forwarded = sim.sim.requests[-1].body["messages"]
    assert forwarded[:2] == msgs[:2]  # the system prompt and the task, verbatim
    assert forwarded[2]["content"].startswith(SUMMARY_MARKER)
    assert forwarded[3:] == msgs[-4:]
    assert compaction.estimate_tokens(forwarded) < 1500


def test_a_compaction_is_not_counted_as_the_agents_rewrite_of_its_history(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """The summary in place of the rounds it covers diverges from the previous turn inside the
    messages: the log says where, but the agent rewrote nothing, so the dashboard's "Prefix
    rewrites by location" must not count it (nor is the miss waste)."""
    config = {
        "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 4},
        "models": {MODEL: {"context_window": 2000}},
    }
    proxy = proxy_factory(sim.api_base, config)
    client = sdk(proxy.base_url)
    head = {"X-Session-Id": "own-rewrite"}
    first = one_task(6, output_chars=400)
    assert compaction.estimate_tokens(first) < 1500  # under the trigger
    client.chat.completions.create(model=MODEL, messages=first, extra_headers=head)
    sim.sim.enqueue([parse_script("Read the files of rounds 0-9.")])
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=one_task(12, output_chars=400), extra_headers=head
    )
    assert raw.headers["x-cachegate-compacted"] == "1"
    proxy.settle()
    compacted = [
        e
        for e in read_events(proxy.log_dir / "own-rewrite.jsonl").events
        if e["type"] == "response"
    ][-1]
    assert compacted["divergence"]["location"] == "messages"  # the log says where
    assert compacted["cache"]["waste"] == 0
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "messages"}) == 0


def test_a_retry_after_a_refusal_keeps_fewer_messages_until_it_fits(
    sdk: Any, proxy_factory: Any
) -> None:
    """Keeping ``keep_recent`` messages would still be over the window the provider stated:
    the retry keeps fewer (the client used to get the provider's 400 again)."""
    with run_simulator(SimConfig(context_window=3000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 100, "keep_recent": 8},
            "models": {MODEL: {"context_window": 1000000}},
        }
        proxy = proxy_factory(small.api_base, config)
        msgs = one_task(10, output_chars=3000)
        small.sim.enqueue([parse_script("short summary")])
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs
        )
        assert raw.http_response.status_code == 200
        assert [r.status for r in small.sim.requests[-3:]] == [400, 200, 200]
        retried = small.sim.requests[-1].body["messages"]
        assert retried[-1] == msgs[-1] and len(retried) < 2 + 1 + 8


@pytest.mark.parametrize("output_chars", [6000, 9000])
def test_a_small_window_with_large_tool_outputs_is_never_sent_over_it(
    sdk: Any, proxy_factory: Any, output_chars: int
) -> None:
    """A local model's 8k window, each round's output a quarter of it: the compaction used to
    keep ``keep_recent`` messages whatever they held, so every turn went out over the window,
    was refused, and was compacted again for the retry (three calls a turn; with a server whose
    refusal was not recognised, a 400 every turn). The tail now keeps fewer messages when they
    alone fill the window, and the compacted history leaves room for the next turns."""
    with run_simulator(SimConfig(context_window=8000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 8},
            "models": {MODEL: {"context_window": 8000}},
        }
        proxy = proxy_factory(small.api_base, config)
        client = sdk(proxy.base_url)
        msgs = one_task(0, output_chars=0)
        turns = 14
        for turn in range(turns):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=msgs,
                extra_headers={"X-Session-Id": "local", "X-Sim-Script": '"Next step."'},
            )
            assert raw.http_response.status_code == 200, turn
            msgs += history(turn + 1, output_chars=output_chars)[-2:]  # 1,500 or 2,250 tokens
        refused = [r for r in small.sim.requests if r.status != 200]
        assert refused == []  # nothing sent over the window, nothing retried
        chats = [
            r.body["messages"]
            for r in small.sim.requests
            if r.body["messages"][0]["content"] != SUMMARIZER_SYSTEM_PROMPT
        ]
        # the task that opened the session stays verbatim after the system prompt, however
        # few of the latest messages are kept (it used to be summarized whenever they were)
        assert all(sent[:2] == msgs[:2] for sent in chats)
        summaries = [
            r
            for r in small.sim.requests
            if r.body["messages"][0]["content"] == SUMMARIZER_SYSTEM_PROMPT
        ]
        assert 2 <= len(summaries) <= turns // 2  # not a compaction on every turn


def _parallel_round(i: int, calls: int, output_chars: int) -> list[dict[str, Any]]:
    ids = [f"call_{i}_{k}" for k in range(calls)]
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": id_, "type": "function", "function": {"name": "read", "arguments": "{}"}}
                for id_ in ids
            ],
        },
        *({"role": "tool", "tool_call_id": id_, "content": "y" * output_chars} for id_ in ids),
    ]


def test_the_task_stays_verbatim_when_the_latest_round_alone_is_over_the_aim(
    sdk: Any, proxy_factory: Any
) -> None:
    """Five parallel calls a round, their outputs together over the compacted history's aim
    (2,400 tokens of a 4,000 window): no plan comes under it, and the one without the task
    was taken, so the 20-token task was summarized on every turn from the second on."""
    with run_simulator(SimConfig(context_window=4000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 4},
            "models": {MODEL: {"context_window": 4000}},
        }
        proxy = proxy_factory(small.api_base, config)
        client = sdk(proxy.base_url)
        msgs = one_task(0, output_chars=0)
        for turn in range(5):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=msgs,
                extra_headers={"X-Session-Id": "wide", "X-Sim-Script": '"Next step."'},
            )
            assert raw.http_response.status_code == 200, turn
            msgs += _parallel_round(turn, 5, 2000)
        chats = [
            r.body["messages"]
            for r in small.sim.requests
            if r.body["messages"][0]["content"] != SUMMARIZER_SYSTEM_PROMPT
        ]
    assert [r.status for r in small.sim.requests] == [200] * len(small.sim.requests)
    assert any(str(sent[2]["content"]).startswith(SUMMARY_MARKER) for sent in chats[1:])
    assert all(sent[:2] == msgs[:2] for sent in chats)


def test_a_later_instruction_stays_verbatim_when_large_outputs_follow_it(
    sdk: Any, proxy_factory: Any
) -> None:
    """The user's latest instruction, then one round of two 22 KB outputs: no plan comes under
    the aim, and the plan taken as keeping the instruction verbatim was one that kept only the
    round (the outputs after it over ``max_anchor_chars``, the instruction was summarized): a
    62-character instruction the history fitted the window with was lost to the summary."""
    with run_simulator(SimConfig(context_window=16_000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 8},
            "models": {MODEL: {"context_window": 16_000}},
        }
        proxy = proxy_factory(small.api_base, config)
        code = "def function_name(argument): return argument.value\n"
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Refactor the module to use dataclasses."},
        ]
        for i in range(6):
            msgs += _parallel_round(i, 1, 0)
            msgs[-1]["content"] = f"F{i} " + code * 58
        instruction = "IMPORTANT: do not touch legacy.py. Now read the two big files."
        msgs += [
            {"role": "assistant", "content": "Done with the small files."},
            {"role": "user", "content": instruction},
            *_parallel_round(6, 2, 0),
        ]
        msgs[-2]["content"] = msgs[-1]["content"] = "F6 " + code * 423  # (22 KB each)
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "later"}
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        forwarded = small.sim.requests[-1].body["messages"]
        assert str(forwarded[1]["content"]).startswith(SUMMARY_MARKER)
        assert forwarded[2:] == msgs[-4:]  # the instruction, then the round, verbatim


def test_a_long_task_stays_verbatim_beside_fewer_latest_messages_where_that_fits(
    sdk: Any, proxy_factory: Any
) -> None:
    """A 30,000-character task pasted as the launching message: with the eight latest messages
    beside it the compacted history was 65 tokens over its aim, and the task was summarized
    at once, though it fitted beside the latest four (the README's promise: verbatim wherever
    that fits)."""
    task = "TASK: port the CLI to click, keeping every flag. " + "Spec line. " * 2700
    with run_simulator(SimConfig(context_window=20_000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 8},
            "models": {MODEL: {"context_window": 20_000}},
        }
        proxy = proxy_factory(small.api_base, config)
        msgs = [{"role": "system", "content": "You are a careful agent."}]
        msgs.append({"role": "user", "content": task})
        for i in range(16):  # the latest four rounds over the aim beside it, two under
            msgs += _parallel_round(i, 1, 2400)
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "long-task"}
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        forwarded = small.sim.requests[-1].body["messages"]
        assert forwarded[1] == {"role": "user", "content": task}
        assert any(str(m.get("content", "")).startswith("[cachegate summary]") for m in forwarded)


def test_the_task_stays_verbatim_at_each_compaction_of_a_session(
    sdk: Any, proxy_factory: Any
) -> None:
    """A session compacted three times: at the second, which starts from the first's summary,
    the task beside the four latest messages was over the aim and was given up to the summary
    (it fitted beside the latest two), then came back verbatim at the third: the agent lost its
    task's words for three turns, and the provider's cache a prefix."""
    task = "TASK: migrate the billing module to the new API. " + " ".join(
        f"Step {i}: update call site {i} in billing/x{i}.py carefully." for i in range(60)
    )
    with run_simulator(SimConfig(context_window=6000)) as small:
        config = {
            "compaction": {"enabled": True, "keep_recent": 8},
            "models": {MODEL: {"context_window": 6000}},
        }
        proxy = proxy_factory(small.api_base, config)
        client = sdk(proxy.base_url)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}]
        msgs.append({"role": "user", "content": task})
        tools = [
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": description,
                    "parameters": {
                        "type": "object",
                        "properties": {arg: {"type": "string"}},
                        "required": [arg],
                    },
                },
            }
            for name, description, arg in (
                ("read_file", "Read a file", "path"),
                ("run_shell", "Run a shell command", "cmd"),
            )
        ]
        compacted = 0
        for i in range(13):
            path = orjson.dumps({"path": f"billing/x{i}.py"}).decode()
            script = {"tool_calls": [{"name": "read_file", "arguments": path, "id": f"call_c{i}"}]}
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=msgs,  # type: ignore[arg-type]
                tools=tools,  # type: ignore[arg-type]
                stream=i % 2 == 0,
                stream_options={"include_usage": True} if i % 2 == 0 else openai.NOT_GIVEN,
                extra_headers={
                    "X-Session-Id": "billing",
                    "X-Sim-Script": orjson.dumps(script).decode(),
                },
            )
            raw.http_response.read()
            if raw.headers.get("x-cachegate-compacted") == "1":
                compacted += 1
                forwarded = small.sim.requests[-1].body["messages"]
                assert forwarded[1] == {"role": "user", "content": task}, i
            call = {"id": f"call_c{i}", "type": "function"}
            call["function"] = {"name": "read_file", "arguments": path}
            output = f"line {i}: def charge(amount): return api.charge(amount)\n" * 40
            msgs += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_c{i}", "content": output},
            ]
        assert compacted >= 6  # (the first compaction and the turns after it, reused or new)


def test_a_long_launching_message_gives_way_when_nothing_comes_under_the_aim(
    sdk: Any, proxy_factory: Any
) -> None:
    """Dense text (a CSV) costs the provider more tokens than 4 bytes each: keeping such a task
    verbatim because the estimate said the window held it sent a body over the window, and the
    retry reused that very compaction, so the client got the provider's 400."""
    with run_simulator(SimConfig(context_window=4000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 50, "keep_recent": 4},
            "models": {MODEL: {"context_window": 4000}},
        }
        proxy = proxy_factory(small.api_base, config)
        msgs = [
            {"role": "system", "content": "You are a careful agent."},
            {"role": "user", "content": "TASK: " + "a," * 1500},  # ~750 estimated, 3,000 real
            *_parallel_round(0, 1, 100),
            *_parallel_round(1, 1, 100),
            *_parallel_round(2, 1, 0),
        ]
        msgs[-1]["content"] = "word " * 1400  # the latest round alone over the aim
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "dense"}
        )
        assert raw.http_response.status_code == 200
        assert raw.headers["x-cachegate-compacted"] == "1"


def _summaries_over_turns(
    sim: RunningSimulator,
    sdk: Any,
    proxy_factory: Any,
    tag: str,
    clock_in_system: bool,
    marks: bool = False,
) -> int:
    config = {
        "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 2},
        "models": {MODEL: {"context_window": 6000}},
    }
    proxy = proxy_factory(sim.api_base, config)
    client = sdk(proxy.base_url)
    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    before = len(sim.sim.requests)
    for turn in range(12):
        now = f" Current time: 2026-12-02T10:{turn:02d}:00Z." if clock_in_system else ""
        system = "You are an agent." + now
        sent = history
        if marks:  # the last two user messages marked for the cache, as Cline and Roo Code do
            users = [i for i, m in enumerate(history) if m["role"] == "user"][-2:]
            sent = [
                {
                    **m,
                    "content": [{"type": "text", "text": m["content"], "cache_control": EPHEMERAL}],
                }
                if i in users
                else m
                for i, m in enumerate(history)
            ]
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, *sent],  # type: ignore[arg-type]
            extra_headers={"X-Session-Id": tag, "X-Sim-Script": '"Looked."'},
        )
        history += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"step {turn}: " + "word " * 600},
        ]
    return sum(
        1
        for r in sim.sim.requests[before:]
        if r.body["messages"][0]["content"] == SUMMARIZER_SYSTEM_PROMPT
    )


def test_the_time_in_the_system_prompt_does_not_undo_a_compaction(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """A compaction keeps the system prompt as each request sends it; keyed on it too, one
    that changes every turn (the current time) made a new summary call on every turn."""
    steady = _summaries_over_turns(sim, sdk, proxy_factory, "steady", clock_in_system=False)
    ticking = _summaries_over_turns(sim, sdk, proxy_factory, "ticking", clock_in_system=True)
    assert 1 <= steady <= 3
    assert ticking == steady


EPHEMERAL = {"type": "ephemeral"}


def test_cache_marks_that_move_every_turn_do_not_undo_a_compaction(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """A client that marks its last two user messages moves a mark off an older one each turn,
    often one the summary covers: the compaction stopped applying, and every new user message
    cost a summary call made from scratch and a full cache miss."""
    steady = _summaries_over_turns(sim, sdk, proxy_factory, "unmarked", clock_in_system=False)
    marked = _summaries_over_turns(sim, sdk, proxy_factory, "marked", False, marks=True)
    assert 1 <= steady <= 3
    assert marked == steady


def test_a_message_changed_under_the_summary_lets_the_estimate_decide(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """After a compaction, the agent clears an old tool output the summary covers (opencode's
    pruning): no compaction applies, and the provider's count of the compacted request, far
    below this history, said it was under the trigger; the whole history went out, over it."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    c = sdk(proxy.base_url, default_headers={"X-Session-Id": "pruned"})
    msgs = history(18)
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs)
    assert raw.headers["x-cachegate-compacted"] == "1"
    proxy.settle()  # (the provider's count of it noted)
    assert msgs[5]["role"] == "tool"  # the first round's output, under the summary
    msgs[5] = {**msgs[5], "content": "[Old tool result content cleared]"}
    msgs += [{"role": "assistant", "content": "Next."}, {"role": "user", "content": "Go on."}]
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs)
    assert raw.headers.get("x-cachegate-compacted") == "1"
    forwarded = sim.sim.requests[-1].body["messages"]
    assert compaction.estimate_tokens(forwarded) < 6000 * 0.75
    assert compaction.estimate_tokens(msgs) > 6000 * 0.75  # (what went out before)


def test_a_history_shrunk_in_place_is_not_compacted_on_its_old_count(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """The agent clears its old tool outputs in place (opencode's pruning) before any
    compaction: the provider's count of the previous request, a much larger history with the
    same first and last messages, was taken for this one, and a paid summary made of a history
    at a quarter of the window ("counts this history at 3.6 times cachegate's estimate")."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    c = sdk(proxy.base_url, default_headers={"X-Session-Id": "shrunk"})
    msgs = history(10, output_chars=1400, system_repeat=20)
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs)
    assert raw.headers.get("x-cachegate-compacted") is None
    usage = raw.parse().usage
    assert usage is not None and 3500 < usage.prompt_tokens < 4500  # near the trigger (4,500)
    proxy.settle()  # (the provider's count of it noted)
    for i, message in enumerate(msgs[:-4]):
        if message["role"] == "tool":  # all but the last two outputs cleared, in place
            msgs[i] = {**message, "content": "[Old tool result content cleared]"}
    msgs += [
        {"role": "assistant", "content": "Next."},
        {"role": "user", "content": "Go on with " + "the next case, " * 80},
    ]
    assert compaction.estimate_tokens(msgs) < 6000 * 0.75 / 2
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs)
    assert raw.headers.get("x-cachegate-compacted") is None
    assert sim.sim.requests[-1].body["messages"] == msgs
    assert compacted_events(proxy) == []


def _dense_round(i: int) -> list[dict[str, Any]]:
    """A tool round whose output the provider counts at a token a byte (digits and commas),
    four times cachegate's estimate."""
    call = {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "run", "arguments": orjson.dumps({"cmd": f"dump {i}"}).decode()},
    }
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": "0," * 200},
    ]


def test_a_second_system_message_with_the_time_keeps_the_providers_count(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """A client whose second system message holds the time (or the environment): the check
    that the messages between the first and last are unchanged took it for another history,
    and the trigger fell back on the estimate, a quarter of the provider's count of dense tool
    outputs: no compaction until the provider refused the history as too long."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    c = sdk(proxy.base_url, default_headers={"X-Session-Id": "retimed"})
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "system", "content": "Current time: 2026-12-05 10:00:01"},
        {"role": "user", "content": "Dump the tables and check them."},
    ]
    for i in range(10):
        msgs += _dense_round(i)
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs)
    assert raw.headers.get("x-cachegate-compacted") is None
    usage = raw.parse().usage
    assert usage is not None and 4000 < usage.prompt_tokens < 4500  # under the trigger
    assert compaction.estimate_tokens(msgs) < 4500 / 2  # (by the estimate, far under it)
    proxy.settle()  # (the provider's count of it noted)
    msgs[1] = {"role": "system", "content": "Current time: 2026-12-05 10:00:31"}
    # (three rounds: the provider's count over the trigger by them alone, the previous
    # answer's completion counted no further than the history holds it)
    msgs += [*_dense_round(10), *_dense_round(11), *_dense_round(12)]
    assert compaction.estimate_tokens(msgs) < 4500 * 0.6  # (by the estimate, still under it)
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs)
    assert raw.headers.get("x-cachegate-compacted") == "1"


def test_tools_added_mid_session_count_toward_the_trigger(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """An MCP server connected mid-session adds a large tool: the trigger took the provider's
    count of the last request (without it) plus the messages appended, and went over the
    window to a refusal, or past the trigger, unseen."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    c = sdk(proxy.base_url, default_headers={"X-Session-Id": "mcp"})
    msgs = history(6, system_repeat=60)
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs)
    assert raw.headers.get("x-cachegate-compacted") is None
    usage = raw.parse().usage
    # under the trigger (4,500) by less than the tool below (~1,900 tokens by the estimate),
    # which with the system prompt and the summary's room stays under the trigger (else the
    # trigger is of the room they leave: ``test_tools_over_the_trigger_…``)
    assert usage is not None and 4500 - 1900 < usage.total_tokens < 4500 - 1500
    proxy.settle()  # (the provider's count of it noted)
    tool = browse_tool("Browse the web. " * 475)  # ~1,900 tokens by the estimate
    msgs += [{"role": "assistant", "content": "Next."}, {"role": "user", "content": "Go on."}]
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=msgs,  # type: ignore[arg-type]
        tools=[tool],  # type: ignore[list-item]
    )
    assert raw.headers.get("x-cachegate-compacted") == "1"


def test_tools_over_the_trigger_leave_a_request_as_it_is_in_most_of_the_room_they_leave(
    sdk: Any, proxy_factory: Any
) -> None:
    """A ~4,500-token tool in an 8,000-token window: with the system prompt and the summary's
    room it is over the trigger (6,000) by itself, so no compaction brings the request under
    it. It was summarized on every turn; now only a request past 75% of the room the tool
    and the system prompt leave is compacted, before it goes, never refused."""
    config = {
        "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 4},
        "models": {MODEL: {"context_window": 8000}},
    }
    tool = browse_tool("abcdabcdabcdabcd " * 1060)  # ~4,500 tokens by the estimate
    with run_simulator(SimConfig(context_window=8000)) as sim:
        proxy = proxy_factory(sim.api_base, config)
        c = sdk(proxy.base_url, default_headers={"X-Session-Id": "big-tool"})
        msgs = history(4, system_repeat=60)
        headers = []
        for turn in range(14):
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=msgs,  # type: ignore[arg-type]
                tools=[tool],  # type: ignore[list-item]
            )
            headers.append(raw.headers.get("x-cachegate-compacted"))
            if turn == 0:  # (over the trigger, under the window)
                usage = raw.parse().usage
                assert usage is not None and 6000 < usage.prompt_tokens < 7000
            msgs = [*msgs, *history(turn + 5, system_repeat=60)[-2:]]
        assert all(r.usage is not None for r in sim.sim.requests)  # (none refused)
        summaries = summary_requests(sim)
    assert headers[:2] == [None, None] and "1" in headers, headers
    assert 1 <= len(summaries) <= 6, len(summaries)  # (14 turns)


def test_legacy_functions_are_compacted_as_the_same_tools_are(sdk: Any, proxy_factory: Any) -> None:
    """An agent on the legacy ``functions`` (LangChain's ``bind_functions``): counted once
    more on every turn beside the provider's count, which holds them, its history was
    compacted long before the trigger (at 4,525 of 6,000 tokens), a summary paid more often
    than for the same definitions sent as ``tools``."""
    function = browse_tool("abcdabcdabcdabcd " * 350)["function"]  # ~1,500 tokens estimated
    config = {
        "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 4},
        "models": {MODEL: {"context_window": 8000}},
    }
    runs: dict[str, tuple[list[bool], int]] = {}
    for kind in ("tools", "functions"):
        with run_simulator(SimConfig(context_window=8000)) as sim:
            proxy = proxy_factory(sim.api_base, config)
            c = sdk(proxy.base_url, default_headers={"X-Session-Id": kind})
            offered = (
                {"tools": [{"type": "function", "function": function}]}
                if kind == "tools"
                else {"functions": [function]}
            )
            compacted = []
            for turn in range(16):
                raw = c.chat.completions.with_raw_response.create(
                    model=MODEL, messages=history(turn, system_repeat=60), extra_body=offered
                )
                compacted.append(raw.headers.get("x-cachegate-compacted") is not None)
            summaries = len(summary_requests(sim))
            runs[kind] = (compacted, summaries)
    assert any(runs["tools"][0]) and runs["tools"][1] >= 1
    assert runs["functions"] == runs["tools"]


def test_a_sub_agent_in_a_compacted_session_is_neither_compacted_nor_undoes_the_compaction(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """One session id for a main agent over the trigger and a sub-agent's small requests: the
    trigger counted the main agent's tokens for the sub-agent (whose task was then replaced by
    a summary, a summary call billed each time), and the sub-agent's requests, which the main
    agent's compaction does not fit, dropped it: the main agent was summarized again."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    client = sdk(proxy.base_url)
    headers = {"X-Session-Id": "mixed"}

    def send(messages: list[dict[str, Any]]) -> Any:
        return client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, extra_headers=headers
        )

    main = history(18)
    assert send(main).headers["x-cachegate-compacted"] == "1"
    summaries = len(sim.sim.requests) - 1
    sub: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a search sub-agent."},
        {"role": "user", "content": "Find where handler_7 is defined."},
    ]
    for turn in range(3):
        raw = send(sub)
        assert "x-cachegate-compacted" not in raw.headers, turn
        assert sim.sim.requests[-1].body["messages"] == sub
        sub += [{"role": "assistant", "content": f"Looked in file {turn}."}]
        sub += [{"role": "user", "content": "Look further."}]
        main = history(19 + turn)  # the main agent's next turn, between the sub-agent's
        before = len(sim.sim.requests)
        assert send(main).headers["x-cachegate-compacted"] == "1"
        assert len(sim.sim.requests) == before + 1  # the compaction reused: no summary call
    assert summaries == 1


@pytest.mark.parametrize("same_opening", [False, True])
def test_two_conversations_of_a_session_each_keep_their_own_compaction(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, same_opening: bool
) -> None:
    """A main agent and a sub-agent, both past the trigger, taking turns under one session id:
    one slot per session held one compaction, each overwrote the other's, and every request
    made a summary call and missed the cache."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    client = sdk(proxy.base_url)

    def send(messages: list[dict[str, Any]]) -> Any:
        return client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, extra_headers={"X-Session-Id": "two"}
        )

    def sub_history(rounds: int) -> list[dict[str, Any]]:
        main = history(rounds)
        if same_opening:  # fanned out with one task: the same opening, then its own rounds
            return [
                *main[:4],
                *(
                    {**m, "content": f"other {m['content']}"} if m["role"] == "tool" else m
                    for m in main[4:]
                ),
            ]
        return [{"role": "system", "content": "You are a sub-agent. " * 200}, *main[3:]]

    summaries_before = 0
    for turn in range(4):
        for messages in (history(18 + turn), sub_history(18 + turn)):
            assert send(messages).headers["x-cachegate-compacted"] == "1"
        if turn == 0:
            summaries_before = len(sim.sim.requests)
    calls = [
        r for r in sim.sim.requests if r.body["messages"][0]["content"] == SUMMARIZER_SYSTEM_PROMPT
    ]
    assert len(calls) == 2  # one for each conversation, then reused turn after turn
    assert len(sim.sim.requests) == summaries_before + 6


def test_the_compaction_in_use_outlives_many_others(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """More sub-agents compacted between the main agent's turns than a session keeps
    compactions: the oldest compaction went first, the main agent's too though it was reused on
    every turn."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    client = sdk(proxy.base_url)

    def send(messages: list[dict[str, Any]]) -> None:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, extra_headers={"X-Session-Id": "many"}
        )
        assert raw.headers["x-cachegate-compacted"] == "1"

    send(history(18))
    for k in range(MAX_COMPACTIONS + 1):
        sub = history(18)
        sub[0] = {"role": "system", "content": f"You are sub-agent {k}. " * 200}
        sub[1] = {"role": "user", "content": f"Sub-task {k}: rename the config loader."}
        send(sub)
        send(history(18))  # the main agent again (a retry): its compaction reused
    calls = [
        r for r in sim.sim.requests if r.body["messages"][0]["content"] == SUMMARIZER_SYSTEM_PROMPT
    ]
    assert len(calls) == 1 + MAX_COMPACTIONS + 1


def test_back_on_the_branch_a_rewind_left_its_latest_compaction_is_reused(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """Compacted twice (rolling), rewound to before the second compaction, then back on the
    original branch: the compaction the rewind used was taken, and the history summarized
    again."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    client = sdk(proxy.base_url)

    def send(messages: list[dict[str, Any]]) -> None:
        client.chat.completions.create(
            model=MODEL, messages=messages, extra_headers={"X-Session-Id": "branches"}
        )

    send(history(18))  # compacted
    send(history(40))  # compacted again, rolling on the first
    rewound = [*history(18), {"role": "user", "content": "Undo the last steps."}]
    send(rewound)  # back before the second compaction: the first applies
    before = [
        r for r in sim.sim.requests if r.body["messages"][0]["content"] == SUMMARIZER_SYSTEM_PROMPT
    ]
    send(history(41))  # the original branch again
    after = [
        r for r in sim.sim.requests if r.body["messages"][0]["content"] == SUMMARIZER_SYSTEM_PROMPT
    ]
    assert len(after) == len(before)  # the second compaction reused: no summary call
    sent = sim.sim.requests[-1].body["messages"]
    assert sent[-2:] == history(41)[-2:] and len(sent) < 20


def test_a_title_request_ending_like_the_main_history_does_not_feed_its_trigger(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """A title request [its prompt, the user's task] ends with the main history's second
    message: its small prompt count was taken for the main agent's, plus an estimate of the
    whole raw history after it, and every main turn went over the trigger and was compacted
    again."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    client = sdk(proxy.base_url)
    headers = {"X-Session-Id": "titled"}
    main = history(18)
    task = main[1]
    for turn in range(4):
        main = history(18 + turn)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=main, extra_headers=headers
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        title = [{"role": "system", "content": "Generate a short title."}, task]
        client.chat.completions.create(model=MODEL, messages=title, extra_headers=headers)
    calls = [
        r for r in sim.sim.requests if r.body["messages"][0]["content"] == SUMMARIZER_SYSTEM_PROMPT
    ]
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("repeat", "low", "high"),
    [
        (1330, 7500, 8500),  # over 75% of 10,000, well under it all
        # within the room a summary would take (1,350 tokens) of the window: no summary is in
        # a request that goes as it is, yet the document was summarized
        (1750, 9000, 10000),
    ],
)
def test_a_pasted_document_that_fits_the_window_is_not_summarized(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, repeat: int, low: int, high: int
) -> None:
    """Over the trigger, but with too little history to compact and within the window: it
    goes as the client sent it (shrinking the kept messages to compact it summarized the
    document, which the window could hold)."""
    config = {
        "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 8},
        "models": {MODEL: {"context_window": 10000}},
    }
    proxy = proxy_factory(sim.api_base, config)
    document = {"role": "user", "content": "Review this design:\n" + "The parser reads. " * repeat}
    msgs = [history(0)[0], document, *history(2, output_chars=200)[-4:]]
    assert low < compaction.estimate_tokens(msgs) < high
    raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "doc"}
    )
    assert raw.http_response.status_code == 200
    assert "x-cachegate-compacted" not in raw.headers
    assert sim.sim.requests[-1].body["messages"] == msgs


def test_a_system_prompt_over_the_trigger_is_not_summarized_around_on_every_turn(
    sdk: Any, proxy_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A system prompt of ~13,000 tokens in a 16,000-token window (a large agent prompt on a
    local model): with the summary's room it is over the trigger by itself, so no compaction
    brings the request under it. One was made on every turn, a summary paid each time for a
    few percent of the prompt, the agent left its latest round alone. Now the trigger applies
    to the room the system prompt leaves: the request goes as it is (with the summary it has)
    until it is past 75% of that room, the rest kept for the answer, and that is said once."""
    window = 16_000

    def counted(messages: list[dict[str, Any]]) -> int:  # (as the provider counts them)
        return len(request_tokens({"messages": messages}))

    config = {
        "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 4},
        "models": {MODEL: {"context_window": window}},
    }
    with run_simulator(SimConfig(context_window=window)) as sim:
        proxy = proxy_factory(sim.api_base, config)
        client = sdk(proxy.base_url)
        base = history(0, system_repeat=1300)
        compacted, sizes = [], []
        for turn in range(26):
            messages = [*base, *history(turn, output_chars=1200)[len(base) :]]
            with caplog.at_level(logging.WARNING, logger="proxy.compactor"):
                raw = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, extra_headers={"X-Session-Id": "big-system"}
                )
            assert raw.http_response.status_code == 200  # (never over the window)
            compacted.append("x-cachegate-compacted" in raw.headers)
            sizes.append(counted(messages))
        summaries = summary_requests(sim)
        prompts = [r.usage["prompt_tokens"] for r in sim.sim.requests if r not in summaries]
    # The scenario: over the trigger from the first turn by the provider's count, far past
    # the window by the last
    assert counted(base) > window * 0.8 and sizes[-1] > window * 1.2
    # the system prompt leaves ~3,000 tokens: not compacted below ~3/4 of them
    first = compacted.index(True)
    assert sizes[first - 1] > window * 0.88, (sizes, compacted)
    assert max(prompts) < window * 0.95  # (a share of the room kept for the answer)
    # one summary every few turns (the room's quarter and what compaction frees), not on
    # every turn from the trigger on (21 of 26 before)
    assert 1 <= len(summaries) <= 7, len(summaries)
    said = [r for r in caplog.records if "alone are over compaction's trigger" in r.getMessage()]
    assert len(said) == 1


@pytest.mark.parametrize("keep_recent", [8, 100])
def test_a_short_history_the_providers_count_puts_over_the_window_is_shrunk_before_sending(
    proxy_factory: Any, sdk: Any, keep_recent: int
) -> None:
    """Too few messages to compact with ``keep_recent`` kept (or a ``keep_recent`` larger than
    the history), dense tool outputs the provider counts at ~1.2 times cachegate's estimate: the
    estimate alone put the next request within the window, the provider's numbers past it. It
    went as it was, was refused as too long, and was compacted only on the retry."""
    config = {
        "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": keep_recent},
        "models": {MODEL: {"context_window": 8000}},
    }
    line = "def func_%04d(x): return x + %d  # line of file module_%d\n"
    with run_simulator(SimConfig(context_window=8000)) as running:
        proxy = proxy_factory(running.api_base, config)
        client = sdk(proxy.base_url)
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Fix the bug in the parser."},
        ]
        compacted = False
        for turn in range(1, 8):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=msgs, extra_headers={"X-Session-Id": f"dense{keep_recent}"}
            )
            assert raw.http_response.status_code == 200
            if raw.headers.get("x-cachegate-compacted") == "1":
                compacted = True
                break
            call = {"id": f"call_{turn}", "type": "function"}
            call["function"] = {"name": "read_file", "arguments": f'{{"path": "m{turn}.py"}}'}
            output = "".join(line % (k, k, turn) for k in range(200))[:7000]
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            msgs.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": output})
        assert compacted
        refused = [r for r in running.sim.requests if r.status == 400]
        assert refused == []  # shrunk before it went, not after the provider's refusal
        last = running.sim.requests[-1]
        assert last.usage is not None and last.usage["prompt_tokens"] <= 8000


@pytest.mark.parametrize("case", ["sent again", "tools dropped"])
def test_a_short_history_that_fits_is_not_shrunk_on_a_count_of_what_it_no_longer_holds(
    proxy_factory: Any, sdk: Any, case: str
) -> None:
    """The provider's count of the previous request and its answer's completion tokens put a
    short history over the window where it fits: a request sent again after a long answer
    holds no answer (a reasoning model's completion counts its thinking, which no history
    holds either), and tools sent then and dropped since are in that count. It was summarized
    (the document lost, a summary paid) where it goes as it is."""
    config = {"compaction": {"enabled": True}, "models": {MODEL: {"context_window": 8000}}}
    doc = " ".join(f"word{i} alpha beta gamma" for i in range(640))
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Please review this document:\n" + doc},
        {"role": "assistant", "content": "It is a list of words."},
        {"role": "user", "content": "Write a detailed report on it."},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": " ".join(f"does thing{j} well" for j in range(40)),
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
        for i in range(16)
    ]
    answer = " ".join(f"point{i} here" for i in range(1200 if case == "sent again" else 150))
    with run_simulator(SimConfig(context_window=8000)) as running:
        proxy = proxy_factory(running.api_base, config)
        client = sdk(proxy.base_url)
        headers = {"X-Session-Id": case.replace(" ", "-")}
        first = client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            extra_headers={**headers, "X-Sim-Script": orjson.dumps(answer).decode()},
            **({"tools": tools} if case == "tools dropped" else {}),
        )
        assert first.usage is not None
        if case == "sent again":
            assert first.usage.prompt_tokens + first.usage.completion_tokens > 8000
        else:
            msgs += [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Now sum up your review, without tools."},
            ]
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": headers["X-Session-Id"]}
        )
        assert "x-cachegate-compacted" not in raw.headers
        assert running.sim.requests[-1].body["messages"] == msgs  # as it was sent
        assert len(running.sim.requests) == 2  # and no summary call
        assert running.sim.requests[-1].usage["prompt_tokens"] < 8000  # (it fits)


def test_a_short_history_with_a_long_dense_answer_in_it_is_shrunk_before_it_goes(
    proxy_factory: Any, sdk: Any
) -> None:
    """A pasted document and the agent's long answer in dense code (~0.9 token a character,
    where the estimate says 0.25): the answer's estimate put the next request within the
    window, the provider's count of it past it. It went, was refused, and was compacted only
    on the retry; the answer's completion tokens count it (no more than its bytes, which a
    reasoning model's thinking does not reach)."""
    config = {"compaction": {"enabled": True}, "models": {MODEL: {"context_window": 10000}}}
    doc = "Please review this document:\n" + " ".join(
        f"word{i} alpha beta gamma" for i in range(800)
    )
    code = "".join(f"v[{i % 10}]=x+{i % 7};" for i in range(700))
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": doc},
    ]
    with run_simulator(SimConfig(context_window=10000)) as running:
        proxy = proxy_factory(running.api_base, config)
        client = sdk(proxy.base_url)
        headers = {"X-Session-Id": "dense-answer"}
        first = client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            extra_headers={**headers, "X-Sim-Script": orjson.dumps(code).decode()},
        )
        assert first.usage is not None
        assert first.usage.prompt_tokens + first.usage.completion_tokens > 10000
        msgs += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Now explain the code."},
        ]
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers=headers
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        assert [r.status for r in running.sim.requests].count(400) == 0  # not after a refusal


def test_a_first_requests_estimate_counts_its_tools(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """With no provider numbers yet (a session's first request, after a restart or a rewind)
    the trigger estimated the history alone; the provider's numbers on later turns hold the
    tools, so an agent with large tool schemas was under-counted by them on those requests."""
    config = {
        "compaction": {"enabled": True, "trigger_percent": 80, "keep_recent": 4},
        "models": {MODEL: {"context_window": 6000}},
    }
    proxy = proxy_factory(sim.api_base, config)
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "Reads a file. " * 40,
                "parameters": {"type": "object", "properties": {}},
            },
        }
        for i in range(4)
    ]
    msgs = history(8)
    assert compaction.estimate_tokens(msgs) < 4800 < compaction.estimate_tokens([*msgs, *tools])
    client = sdk(proxy.base_url)
    plain = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "no-tools"}
    )
    assert "x-cachegate-compacted" not in plain.headers  # under the trigger without them
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, tools=tools, extra_headers={"X-Session-Id": "tools"}
    )
    assert raw.headers["x-cachegate-compacted"] == "1"


def test_a_compaction_that_fails_lets_the_request_go_as_it_is(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compaction never breaks a request: a malformed part (``"type": ["image_url"]``) made
    the estimate raise, and the client got a 500 for a request the provider would take."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("unhashable type: 'list'")

    proxy = proxy_factory(sim.api_base, CONFIG)
    monkeypatch.setattr(compaction, "plan", broken)
    msgs = history(18)
    raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(model=MODEL, messages=msgs)
    assert raw.http_response.status_code == 200
    assert sim.sim.requests[-1].body["messages"] == msgs


def test_a_part_whose_type_is_a_list_is_compacted_with_the_rest(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """``{"type": ["text"], …}`` in a history over the trigger: the text check hashed the list
    (TypeError), the compaction failed and the request went as it was, over the window."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    msgs = history(18)
    msgs[3] = {**msgs[3], "content": [{"type": ["text"], "text": "odd part"}]}
    raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(model=MODEL, messages=msgs)
    assert raw.http_response.status_code == 200
    assert raw.headers["x-cachegate-compacted"] == "1"


@pytest.mark.parametrize(
    "odd",
    [{"role": ["system"], "content": "x"}, {"role": {"a": 1}, "content": "x"}, None, 7, "text"],
    ids=["role-list", "role-object", "null", "number", "string"],
)
def test_a_message_of_the_wrong_shape_fails_no_compaction(
    sim: RunningSimulator, proxy_factory: Any, odd: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A role that is a list or an object, a message that is null, a number or a string, in a
    history over the trigger: compaction raised (hashing the role, ``.get`` of no object) and
    logged a traceback every turn. The request goes on to the provider, whose answer it is."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    msgs: list[Any] = history(18)
    msgs.insert(3, odd)
    with caplog.at_level(logging.ERROR):
        for _ in range(2):  # (the next turn compares with this one)
            httpx.post(
                proxy.base_url + "/chat/completions",
                json={"model": MODEL, "messages": msgs},
                headers={"X-Session-Id": "odd"},
            )
        proxy.settle()
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def test_the_summary_request_fits_the_summarizer_models_own_window(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    config = {
        "compaction": {
            "enabled": True,
            "trigger_percent": 75,
            "keep_recent": 4,
            "summarizer_model": "small",
        },
        "models": {MODEL: {"context_window": 128000}, "small": {"context_window": 8000}},
    }
    proxy = proxy_factory(sim.api_base, config)
    msgs = history(60, output_chars=8000)  # ~120k tokens
    raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(model=MODEL, messages=msgs)
    assert raw.headers["x-cachegate-compacted"] == "1"
    (summary,) = [r for r in sim.sim.requests if r.body["model"] == "small"]
    assert compaction.estimate_tokens(summary.body["messages"]) < 8000 // 2 + 500
    assert summary.body["messages"][1]["content"].endswith("under about 666 words.")


def test_a_refusal_nothing_can_shorten_is_relayed_with_the_providers_headers(
    scripted: Any, proxy_factory: Any
) -> None:
    """A context-length refusal of a history nothing can compact (one message over the window)
    is relayed as it came: its body and content type, and, now, the provider's other headers
    (its Date, its request id: they were dropped)."""
    refusal = orjson.dumps(
        {
            "error": {
                "message": "This model's maximum context length is 6000 tokens.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        }
    )
    upstream, url = scripted(chunks=[refusal], content_type=b"application/json")
    upstream.status = 400
    upstream.extra_headers = [
        (b"date", b"Sat, 05 Dec 2026 11:00:00 GMT"),
        (b"x-request-id", b"req_abc123"),
    ]
    proxy = proxy_factory(url, CONFIG)
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "word " * 40000}]},
        headers={"X-Session-Id": "too-long"},
    )
    assert r.status_code == 400 and r.content == refusal
    assert r.headers.get_list("date") == ["Sat, 05 Dec 2026 11:00:00 GMT"]
    assert r.headers["x-request-id"] == "req_abc123"
    assert r.headers["x-cachegate-session"] == "too-long"
    assert len(upstream.requests) == 1  # (nothing sent again)


def test_a_failure_while_compacting_for_a_retry_relays_the_providers_refusal(
    proxy_factory: Any,
) -> None:
    """The retry path runs after the relay: an unexpected error there used to reach uvicorn,
    which answered a plain-text 500; then it was a 500 of cachegate's, and an agent that
    compacts on ``context_length_exceeded`` itself never saw the provider's refusal."""
    import httpx

    with run_simulator(SimConfig(context_window=3000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 100, "keep_recent": 4},
            "models": {MODEL: {"context_window": 1000000}},
        }
        proxy = proxy_factory(small.api_base, config)
        compactor = proxy.gateway.chat.compactor
        original = compactor.apply

        async def broken(*args: Any, force: bool = False, **kw: Any) -> Any:
            if force:  # only the compaction after the provider's refusal
                raise RuntimeError("compactor bug")
            return await original(*args, force=force, **kw)

        compactor.apply = broken
        msgs = history(10, output_chars=2000, system_repeat=10)
        r = httpx.post(
            proxy.base_url + "/chat/completions",
            json={"model": MODEL, "messages": msgs},
            headers={"X-Session-Id": "broken-retry"},
        )
        assert r.status_code == 400
        assert r.headers["content-type"] == "application/json"
        assert r.json()["error"]["code"] == "context_length_exceeded"  # the provider's, as it came
        assert r.headers["x-cachegate-session"] == "broken-retry"
        # with the provider's own headers (its Date, its request id: they were dropped)
        assert [q.status for q in small.sim.requests] == [400]  # refused, then nothing re-sent
        proxy.settle()
        events = read_events(proxy.log_dir / "broken-retry.jsonl").events
        responses = [e for e in events if e["type"] == "response"]
        assert [(e["status"], "maximum context length" in e["error"]) for e in responses] == [
            (400, True)
        ]


def test_other_upstream_errors_pass_verbatim_with_compaction_on(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    import httpx

    proxy = proxy_factory(sim.api_base, {**CONFIG, "pairing": {"repair": False}})
    dangling = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
    ]
    body = {"model": MODEL, "messages": dangling}
    direct = httpx.post(sim.api_base + "/chat/completions", json=body)
    via = httpx.post(proxy.base_url + "/chat/completions", json=body)
    assert direct.status_code == via.status_code == 400
    assert via.content == direct.content
    proxy.settle()
    responses = [
        e
        for p in proxy.log_dir.glob("*.jsonl")
        for e in read_events(p).events
        if e["type"] == "response"
    ]
    assert [r["status"] for r in responses] == [400]


def test_retried_request_is_logged_as_sent_and_the_next_exchange_is_not_waste(
    sdk: Any, proxy_factory: Any
) -> None:
    from proxy.report import replay_lines

    with run_simulator(SimConfig(context_window=3000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 100, "keep_recent": 4},
            "models": {MODEL: {"context_window": 1000000}},
        }
        proxy = proxy_factory(small.api_base, config)
        msgs = history(10, output_chars=2000, system_repeat=10)
        small.sim.enqueue([parse_script("short summary")])
        c = sdk(proxy.base_url)
        c.chat.completions.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "retry"}
        )
        msgs = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
        c.chat.completions.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "retry"}
        )
        proxy.settle()
        replayed = [orjson.loads(line) for line in replay_lines(str(proxy.log_dir), "retry")]
        sent = [
            r.body["messages"]
            for r in small.sim.requests
            if r.status == 200
            and r.body.get("messages", [{}])[0].get("role") == "system"
            and "tools" not in r.body
            and len(r.body["messages"]) > 2
        ]
        # both attempts of exchange 1 were forwarded: the refused original, then the compacted retry
        assert [r["exchange_id"] for r in replayed] == [1, 1, 2]
        assert replayed[0]["messages"] == msgs[:-2]
        assert replayed[1]["messages"] == sent[-2]
        assert replayed[2]["messages"] == sent[-1]
        responses = [
            e for e in read_events(proxy.log_dir / "retry.jsonl").events if e["type"] == "response"
        ]
        assert responses[-1]["cache"]["waste"] == 0


def test_a_compressed_error_answer_passes_intact_with_compaction_on(
    scripted: Any, proxy_factory: Any
) -> None:
    import gzip

    import httpx

    error = b'{"error":{"message":"Invalid value for temperature","code":"invalid_value"}}'
    _up, url = scripted(
        chunks=[gzip.compress(error)],
        status=400,
        content_type=b"application/json",
        extra_headers=[(b"content-encoding", b"gzip")],
    )
    proxy = proxy_factory(url, CONFIG)
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 400
    assert r.content == error  # httpx decoded the upstream's gzip bytes, relayed untouched


def test_the_miss_a_compaction_buys_is_not_counted_as_waste(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base, CONFIG)
    c = sdk(proxy.base_url)
    short = history(4, output_chars=3000, system_repeat=10)
    c.chat.completions.create(model=MODEL, messages=short, extra_headers={"X-Session-Id": "bought"})
    long = history(
        18, output_chars=3000, system_repeat=10
    )  # the same conversation, grown past the trigger
    sim.sim.enqueue([parse_script("SUMMARY")])
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=long, extra_headers={"X-Session-Id": "bought"}
    )
    assert raw.headers["x-cachegate-compacted"] == "1"
    proxy.settle()
    responses = [
        e for e in read_events(proxy.log_dir / "bought.jsonl").events if e["type"] == "response"
    ]
    _first, compacted = responses
    assert compacted["cache"]["expected"] == 0  # not counted at all …
    usage = compacted["usage"]
    assert (
        min(_first["usage"]["prompt"], usage["prompt"]) - usage["cache_read"] > 1024
    )  # … though it missed
    assert compacted["cache"]["waste"] == 0 and compacted["cache"]["cause"] is None  # … not waste
    assert (
        proxy.metric(
            "cachegate_cache_waste_tokens_total", {"model": MODEL, "cause": "prefix_rewrite"}
        )
        == 0
    )


def test_a_compaction_in_flight_leaves_another_conversations_miss_counted(
    sdk: Any, proxy_factory: Any
) -> None:
    """Sub-agents under one session id: a compacted turn of one is still streaming when another
    rewrites its system prompt and is answered first. The compaction's expected miss was a flag
    on the session, taken by whichever exchange finished next: the rewrite went uncounted, and
    the compaction's own miss was charged as a prefix_rewrite."""
    import threading

    with run_simulator(SimConfig(context_window=200000, chunk_ms=25)) as slow:
        proxy = proxy_factory(slow.api_base, CONFIG)
        c = sdk(proxy.base_url)
        head = {"X-Session-Id": "two-agents"}
        reviewer = [
            {"role": "system", "content": "You review diffs line by line. " * 250},
            {"role": "user", "content": "Review the change to proxy/sse.py."},
        ]
        c.chat.completions.create(model=MODEL, messages=reviewer, extra_headers=head)
        short = history(4, output_chars=3000, system_repeat=10)
        c.chat.completions.create(model=MODEL, messages=short, extra_headers=head)
        slow.sim.enqueue([parse_script("SUMMARY"), parse_script("word " * 60)])
        started = threading.Event()

        def compacted_turn() -> None:
            long = history(18, output_chars=3000, system_repeat=10)
            stream = c.chat.completions.create(
                model=MODEL, messages=long, extra_headers=head, stream=True
            )
            for _chunk in stream:
                started.set()

        agent = threading.Thread(target=compacted_turn)
        agent.start()
        assert started.wait(20), "the compacted turn should be streaming"
        rewritten = [{"role": "system", "content": "Now: 12:00. " + reviewer[0]["content"]}]
        c.chat.completions.create(
            model=MODEL, messages=[*rewritten, reviewer[1]], extra_headers=head
        )
        agent.join(20)
        proxy.settle()
    responses = [
        e for e in read_events(proxy.log_dir / "two-agents.jsonl").events if e["type"] == "response"
    ]
    *_, rewrite, compacted = responses  # the rewrite was answered first
    assert rewrite["cache"]["cause"] == "prefix_rewrite" and rewrite["cache"]["waste"] > 1024
    assert rewrite["cache"]["location"] == "system"
    assert compacted["cache"]["expected"] == 0 and compacted["cache"]["waste"] == 0
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "system"}) == 1
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "messages"}) == 0


def test_the_summary_call_keeps_the_clients_query_string(scripted: Any, proxy_factory: Any) -> None:
    import httpx

    answer = orjson.dumps(
        {
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "SUMMARY"},
                    "finish_reason": "stop",
                }
            ]
        }
    )
    upstream, url = scripted(chunks=[answer], content_type=b"application/json")
    proxy = proxy_factory(url, CONFIG)
    r = httpx.post(
        proxy.base_url + "/chat/completions?api-version=2024-10-21",
        json={"model": MODEL, "messages": history(18)},
    )
    assert r.headers["x-cachegate-compacted"] == "1"
    assert [q["query"] for q in upstream.requests] == [b"api-version=2024-10-21"] * 2
    assert "tools" not in orjson.loads(upstream.requests[0]["body"])  # the summary call
    assert SUMMARY_MARKER in orjson.loads(upstream.requests[1]["body"])["messages"][1]["content"]


def test_a_reused_compaction_does_not_hash_its_covered_prefix_again(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each later turn resends the covered prefix as the very objects the session holds: the
    compaction is reused without serializing and hashing that prefix again (the bulk of a long
    history, every request), and still with the same substitution."""
    hashed: list[int] = []
    real = compaction.prefix_digest

    def counting(messages: Any, end: int, **kw: Any) -> str:
        hashed.append(end)
        return real(messages, end, **kw)

    monkeypatch.setattr(compaction, "prefix_digest", counting)
    proxy = proxy_factory(sim.api_base, CONFIG)
    c = sdk(proxy.base_url)
    msgs = history(18)
    c.chat.completions.create(model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "h"})
    first = sim.sim.requests[-1].body["messages"]
    assert first[1]["content"].startswith(SUMMARY_MARKER)
    hashed.clear()
    for turn in range(3):
        msgs = [*msgs, {"role": "user", "content": f"continue {turn}"}]
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "h"}
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        now = sim.sim.requests[-1].body["messages"]
        assert now[: len(first)] == first  # the same substitution
    assert hashed == []

    # A history edited inside the covered prefix is checked, and the summary is not reused.
    def made() -> float:
        return sum(
            proxy.metric("cachegate_compactions_total", {"model": MODEL, "result": result})
            for result in ("summary", "extractive")
        )

    before = made()
    edited = [*msgs[:5], {"role": "user", "content": "edited"}, *msgs[6:]]
    c.chat.completions.create(model=MODEL, messages=edited, extra_headers={"X-Session-Id": "h"})
    assert hashed  # the covered prefix was hashed: its objects were not the ones checked
    assert made() == before + 1  # a new compaction, not the stale one reused


@pytest.mark.parametrize(
    "line",
    ["- step {}: ran the tests and read the output", "- 第{}步：运行了测试并阅读了输出，结果正常"],
)
def test_a_summary_far_longer_than_asked_is_cut_and_the_session_goes_on(
    sdk: Any, proxy_factory: Any, line: str
) -> None:
    """A verbose summarizer answers 40,000 characters where ~3,000 were asked for: used as it
    came, the compacted history was over the window, refused, and every later turn with it. In
    Chinese (three bytes a character) it was cut in characters only, three times the room the
    plan kept for it in bytes: the history was still at the trigger, and every later turn paid
    a summary call of its own and read nothing from the cache."""
    with run_simulator(SimConfig(context_window=6000)) as small:
        proxy = proxy_factory(small.api_base, CONFIG)
        c = sdk(proxy.base_url)
        text = "\n".join(line.format(i) for i in range(1800))
        assert len(text) > 40000
        small.sim.enqueue([parse_script(text)])
        msgs = history(18)
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "verbose"}
        )
        assert raw.status_code == 200 and raw.headers["x-cachegate-compacted"] == "1"
        summary = small.sim.requests[-1].body["messages"][1]["content"]
        assert summary.startswith(SUMMARY_MARKER)
        assert line.format(0) in summary  # the model's text, not the extractive one
        assert "summary cut by cachegate" in summary
        assert len(orjson.dumps(summary)) < compaction.summary_chars(6000) * 1.25 + 400
        assert [r.status for r in small.sim.requests] == [200, 200]  # summary, answer
        # the next turn reuses it: no second summary, no refusal
        msgs = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "verbose"}
        )
        assert raw.status_code == 200 and raw.headers["x-cachegate-compacted"] == "1"
        assert [r.status for r in small.sim.requests] == [200, 200, 200]


def test_a_history_whose_latest_message_alone_is_over_the_window_is_not_summarized(
    sdk: Any, proxy_factory: Any
) -> None:
    """Rounds that could be compacted, then one message too long for the window by itself: no
    compaction can fit, so no summary is paid for and the refusal reaches the client as it
    came (a summary was bought, the request sent again, refused again, shown as two rows)."""
    import openai

    with run_simulator(SimConfig(context_window=3000)) as small:
        config = {"compaction": {"enabled": True}, "models": {MODEL: {"context_window": 1000000}}}
        proxy = proxy_factory(small.api_base, config)
        msgs = [*history(6, system_repeat=5), {"role": "user", "content": "word " * 4000}]
        with pytest.raises(openai.BadRequestError) as info:
            sdk(proxy.base_url).chat.completions.create(
                model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "big-tail"}
            )
        assert "maximum context length" in str(info.value)
        assert [r.status for r in small.sim.requests] == [400]  # no summary call, no re-send
        from proxy.report import show_session

        proxy.settle()
        rows = show_session(proxy.log_dir, "big-tail").rows
        assert [(r.exchange, r.status) for r in rows] == [(1, 400)]


def test_a_compaction_undone_by_the_client_s_edit_names_the_message_the_client_changed(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """The agent changes a message the summary covered otherwise than in place (a call given
    another id, as clients that make ids anew do): the compaction no longer applies, and the
    miss was put on messages[N].role, cachegate's own summary against a message the client
    never changed. (An output cleared in place keeps the compaction: ``…cleared_under…``.)"""
    proxy = proxy_factory(sim.api_base, CONFIG)
    c = sdk(proxy.base_url)
    msgs = history(18)
    sim.sim.enqueue([parse_script("TASK: handle CRLF. DONE: cases 0-13 pass. LEFT: 14-17.")])
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "cleared"}
    )
    assert raw.headers["x-cachegate-compacted"] == "1"
    assert msgs[5]["role"] == "tool"
    call = {**msgs[4]["tool_calls"][0], "id": "call_renamed"}
    cleared = [
        *msgs[:4],
        {**msgs[4], "tool_calls": [call]},
        {**msgs[5], "tool_call_id": "call_renamed", "content": "[cleared]"},
        *msgs[6:],
    ]
    c.chat.completions.create(
        model=MODEL, messages=cleared, extra_headers={"X-Session-Id": "cleared"}
    )
    proxy.settle()
    responses = [
        e for e in read_events(proxy.log_dir / "cleared.jsonl").events if e["type"] == "response"
    ]
    divergence = responses[-1]["divergence"]
    assert (divergence["index"], divergence["role"], divergence["field"]) == (
        4,
        "assistant",
        "tool_calls",
    )
    assert "call_renamed" in divergence["new"] and "call_0" in divergence["old"]


def test_a_refusal_of_a_reused_compaction_with_nothing_more_to_compact_is_relayed_once(
    sdk: Any, proxy_factory: Any
) -> None:
    """Compacted, then a turn whose new message alone is over the window: the reuse goes out,
    is refused, and the forced retry finds only the same reuse. The refusal is relayed, and the
    log and metrics counted a second reuse and a "compacted" retry line though nothing was
    sent again."""
    import openai

    with run_simulator(SimConfig(context_window=6000)) as small:
        proxy = proxy_factory(small.api_base, CONFIG)
        c = sdk(proxy.base_url)
        small.sim.enqueue([parse_script("TASK: t. DONE: d. LEFT: l.")])
        msgs = history(18)
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "reuse-refused"}
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        huge = [
            *msgs,
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "data " * 8000},
        ]
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(
                model=MODEL, messages=huge, extra_headers={"X-Session-Id": "reuse-refused"}
            )
        assert [r.status for r in small.sim.requests] == [200, 200, 400]  # sent once
        events = compacted_events(proxy)
        assert [(e["exchange"], e.get("retry", False)) for e in events] == [(1, False), (2, False)]
        labels = {"model": MODEL, "result": "reused"}
        assert proxy.metric("cachegate_compactions_total", labels) == 1


class _Reworded:
    """A relay to the simulator that words its too-long refusal as an older llama.cpp does: no
    count of the prompt in it."""

    def __init__(self, base: str) -> None:
        self.base = base  # (the simulator's root)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await asgi_body(receive)
        headers = {
            k.decode(): v.decode()
            for k, v in scope["headers"]
            if k.lower() not in (b"host", b"content-length")
        }
        async with httpx.AsyncClient() as client:
            r = await client.request(
                scope["method"], self.base + scope["path"], content=body, headers=headers
            )
        out = r.content
        if r.status_code == 400 and b"context_length_exceeded" in out:
            out = orjson.dumps(
                {
                    "error": {
                        "code": 400,
                        "message": "the request exceeds the available context size, try"
                        " increasing it",
                        "type": "exceed_context_size_error",
                    }
                }
            )
        await send(
            {
                "type": "http.response.start",
                "status": r.status_code,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": out})


def _edge_agent() -> tuple[Callable[[int], str], dict[str, Any], list[dict[str, Any]]]:
    """An agent at the compaction edge: its words (seeded), its scripted answer (a call and a
    text of 2,800 characters, which the summary call gets too: a summary as long as a
    model's), its one tool."""
    import json
    import random

    rng = random.Random(7)
    vocabulary = ["alpha", "beta", "gamma", "delta", "config", "value", "error", "line", "path"]

    def words(n: int) -> str:
        return " ".join(rng.choice(vocabulary) for _ in range(n))

    lines = ["Task: fix the failing build as the user asked.", "Done:"]
    while sum(len(x) + 1 for x in lines) < 2800:
        lines.append(f"- step {len(lines)}: ran the build, {words(8)}")
    script = {
        "content": "\n".join(lines)[:2800],
        "tool_calls": [{"name": "run", "arguments": json.dumps({"cmd": "make test"})}],
    }
    tools = [
        {
            "type": "function",
            "function": {
                "name": "run",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
            },
        }
    ]
    return words, script, tools


def _edge_round(messages: list[dict[str, Any]], call_id: str, arguments: str, output: str) -> None:
    """The edge agent's round appended: its call of ``run`` and the call's output."""
    function = {"name": "run", "arguments": arguments}
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call_id, "content": output})


@pytest.mark.parametrize("wording", ["openai", "no count"])
def test_a_retry_whose_summary_keeps_it_over_the_room_goes_with_the_summary_cut(
    sdk: Any, proxy_factory: Any, wording: str
) -> None:
    """An agent asking half of a 12,000-token window for its answer (max_completion_tokens
    6,000), its tool outputs growing to ~5,200 tokens: the system prompt, the task, a summary
    of ~2,800 characters and the latest round were over the room by a few dozen tokens. The
    forced retry had nothing new to compact, and the refusal was relayed on every turn after
    (the agent stuck). The retry now goes with the summary cut by what the refusal's count was
    over, with no summary call for it; every turn is answered. A refusal that says no count
    (an older llama.cpp's) is relayed as it was, the summary left whole: cut by a margin alone, the
    retry was refused again, and each attempt cut the summary again. The session's first
    request is at the edge (no count of the provider's yet: planned on the estimate, refused);
    the turns after plan their summary on the provider's count of the retry and are not refused
    (a refused request and a cut on every turn before)."""
    import json

    words, script, tools = _edge_agent()
    refused = 0
    with contextlib.ExitStack() as stack:
        sim = stack.enter_context(run_simulator(SimConfig(context_window=12000)))
        upstream = sim.api_base
        if wording == "no count":
            root = sim.api_base.removesuffix("/v1")
            upstream = stack.enter_context(ServerThread(_Reworded(root))).url + "/v1"
        config = {
            "compaction": {"enabled": True, "keep_recent": 8},
            "models": {"agent-model": {"context_window": 12000}},
        }
        proxy = proxy_factory(upstream, config)
        headers = {"X-Session-Id": "stuck", "X-Sim-Script": json.dumps(script)}
        client = sdk(proxy.base_url, default_headers=headers)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent. Use the tools."},
            {"role": "user", "content": "Task: fix the failing build. Details: " + words(20)},
        ]
        for turn in range(1, 14):  # (the rounds before the edge, sent at once)
            arguments = json.dumps({"cmd": "make test"})
            _edge_round(messages, f"call_{turn}", arguments, words(min(3220, 2500 + 40 * turn)))
        for turn in range(14, 23):
            try:
                answer = client.chat.completions.create(
                    model="agent-model", messages=messages, tools=tools, max_completion_tokens=6000
                )
            except openai.BadRequestError:
                refused += 1
                if refused == 3:  # (the same history, sent again and again)
                    break
                continue
            call = answer.choices[0].message.tool_calls[0]
            _edge_round(
                messages, call.id, call.function.arguments, words(min(3220, 2500 + 40 * turn))
            )
        statuses = [r.status for r in sim.sim.requests]
        summary_calls = sum(1 for r in sim.sim.requests if "tools" not in r.body)
    events = compacted_events(proxy)
    cuts = [e for e in events if e["source"] == "cut"]
    # one summary call per compaction made: none for a retry's cut
    assert summary_calls == sum(1 for e in events if e["source"] == "model")
    assert 400 in statuses  # (the refusals came)
    if wording == "no count":
        assert refused == 3 and cuts == []  # (relayed each time; the summary whole)
        assert statuses.count(400) == 3  # (each sent once: nothing new to send again)
        return
    assert refused == 0
    assert statuses.count(400) == 1 and statuses[1] == 400  # (the first request's alone)
    assert len(cuts) == 1 and all(e["retry"] and e["made"] == "model" for e in cuts)
    assert all("summary cut by cachegate" in e["summary"] for e in cuts)
    assert all(e["prefix_digest"] and e["opening"] for e in cuts)  # (a restart takes it up)
    assert all(b == 200 for a, b in itertools.pairwise(statuses) if a == 400)  # (none relayed)
    # (counted as reused, not as a summary: no summary call was made for it)
    made = {"model": "agent-model", "result": "summary"}
    assert proxy.metric("cachegate_compactions_total", made) == summary_calls
    reused = sum(1 for e in events if e["source"] in ("reused", "cut"))
    labels = {"model": "agent-model", "result": "reused"}
    assert proxy.metric("cachegate_compactions_total", labels) == reused


def test_an_agent_at_the_edge_has_its_summary_planned_on_the_room_left(
    sdk: Any, proxy_factory: Any
) -> None:
    """The agent above from its first turn (max_completion_tokens 6,000 of a 12,000-token
    window, tool outputs growing to ~5,200 tokens): once its latest round left less room than
    the summary asked for, every turn's new summary went out whole, was refused, and the retry
    cut it (10 refused requests in 22 turns, a cache miss each). The summary is now planned on
    the room the kept messages leave, on the provider's count of the previous request: no turn
    is refused, and no summary call is added."""
    import json

    words, script, tools = _edge_agent()
    with run_simulator(SimConfig(context_window=12000)) as sim:
        config = {
            "compaction": {"enabled": True, "keep_recent": 8},
            "models": {"agent-model": {"context_window": 12000}},
        }
        proxy = proxy_factory(sim.api_base, config)
        headers = {"X-Session-Id": "edge", "X-Sim-Script": json.dumps(script)}
        client = sdk(proxy.base_url, default_headers=headers)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent. Use the tools."},
            {"role": "user", "content": "Task: fix the failing build. Details: " + words(20)},
        ]
        for turn in range(1, 23):
            answer = client.chat.completions.create(
                model="agent-model", messages=messages, tools=tools, max_completion_tokens=6000
            )
            call = answer.choices[0].message.tool_calls[0]
            _edge_round(
                messages, call.id, call.function.arguments, words(min(3220, 2500 + 40 * turn))
            )
        statuses = [r.status for r in sim.sim.requests]
        summary_calls = sum(1 for r in sim.sim.requests if "tools" not in r.body)
    events = compacted_events(proxy)
    assert statuses.count(400) == 0  # (10 before: one refused request a turn past the edge)
    assert [e["source"] for e in events] == ["model"] * summary_calls == ["model"] * 20
    planned = [e for e in events if "summary cut by cachegate" in e["summary"]]
    assert len(planned) >= 8  # (the turns past the edge: cut to the room, not refused)


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_a_completion_asked_for_that_fills_the_window_compacts_no_short_history(
    sdk: Any, proxy_factory: Any, key: str
) -> None:
    """An agent that asks for a completion as long as the model's window or longer (a local
    model given a small window, the agent's own max_tokens large). No history fits beside it,
    yet every history, however short, was compacted: a summary paid every turn and the cache
    lost, where a provider that counts the prompt alone (llama.cpp, Ollama) served it whole."""
    upstream = NoCacheUpstream()  # (answers whatever it is sent, as such a provider)
    with ServerThread(upstream) as server:
        proxy = proxy_factory(server.url + "/v1", CONFIG)  # (a 6,000-token window)
        client = sdk(proxy.base_url)
        messages = history(2)  # (~2,300 tokens: under the trigger)
        sent = []
        for turn in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=messages,
                extra_headers={"X-Session-Id": "large-completion"},
                **{key: 8192 if turn else 6000},
            )
            assert "x-cachegate-compacted" not in raw.headers
            sent.append(messages)
            reply = raw.parse().choices[0].message.content
            messages = [*messages, {"role": "assistant", "content": reply}]
            messages.append({"role": "user", "content": f"Go on ({turn})."})
    assert [r["messages"] for r in upstream.requests] == sent  # (no summary call among them)
    assert not compacted_events(proxy)


@dataclass
class _LongSummaries:
    """An upstream whose summary calls read 150,000 prompt tokens each (under GPT-5.4's
    272K long-context threshold) and that refuses the agent's first try as too long: the
    exchange pays two summary calls, a compaction and its retry's."""

    main: int = 0
    summaries: int = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await asgi_lifespan(receive, send)
            return
        body = orjson.loads(await asgi_body(receive))
        status, usage = 200, {"prompt_tokens": 3_000, "completion_tokens": 10}
        text = "Done."
        if SUMMARIZER_SYSTEM_PROMPT in str(body["messages"][0].get("content")):
            self.summaries += 1
            usage = {"prompt_tokens": 150_000, "completion_tokens": 1_000}
            text = "TASK: handle CRLF. DONE: cases 0-13 pass. LEFT: cases 14-17."
        else:
            self.main += 1
        if self.main == 1 and text == "Done.":  # (the agent's first try)
            status = 400
        if status == 400:
            message = (
                "This model's maximum context length is 8000 tokens. However, your messages"
                " resulted in 9000 tokens."
            )
            payload = {"error": {"message": message, "code": "context_length_exceeded"}}
        else:
            message_out = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message_out, "finish_reason": "stop"}
            payload = {"id": "c", "object": "chat.completion", "created": 1, "choices": [choice]}
            payload.update(model=body["model"], usage=usage)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": orjson.dumps(payload)})


def test_two_summary_calls_of_one_exchange_are_each_priced_at_their_own_prompts_rates(
    sdk: Any, proxy_factory: Any
) -> None:
    """A compaction and its retry's: two summary calls of 150,000 prompt tokens, each under
    GPT-5.4's 272K threshold. Their usages were added and priced as one prompt of 300,000
    past it: twice the input price, 1.5 times the output, the summary ~2x over its bill."""
    upstream = _LongSummaries()
    config = {**CONFIG, "models": {"gpt-5.4": {"context_window": 8000}}}
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(20):
        messages.append({"role": "user", "content": f"Question {i}: " + "look at the file " * 90})
        messages.append(
            {"role": "assistant", "content": f"Answer {i}: " + "it has functions " * 90}
        )
    messages.append({"role": "user", "content": "final question"})
    with ServerThread(upstream) as server:
        proxy = proxy_factory(server.url + "/v1", config)
        client = sdk(proxy.base_url)
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-5.4", messages=messages, extra_headers={"X-Session-Id": "two-calls"}
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
    assert (upstream.summaries, upstream.main) == (2, 2)
    proxy.settle()
    logged = read_events(proxy.log_dir / "two-calls.jsonl").events
    (answered,) = [e for e in logged if e["type"] == "response" and e["status"] == 200]
    summary = answered["summary"]
    assert summary["usage"]["prompt"] == 300_000
    each = (150_000 * 2.5 + 1_000 * 15) / 1e6
    assert summary["cost"]["actual"] == pytest.approx(2 * each)
    main = (3_000 * 2.5 + 10 * 15) / 1e6
    assert answered["cost"]["actual"] == pytest.approx(2 * each + main)
    labels = {"model": "gpt-5.4", "kind": "actual"}
    assert proxy.metric("cachegate_cost_usd_total", labels) == pytest.approx(2 * each + main)


@dataclass
class SlowSummaries(NoCacheUpstream):
    """An upstream that writes summaries slowly (``summary_s``) and answers the agent at once:
    a summary call longer than the agent's client timeout."""

    summary_s: float = 1.5
    summaries: int = 0

    async def before_answer(self, body: dict[str, Any]) -> None:
        messages = body.get("messages") or [{}]
        if SUMMARIZER_SYSTEM_PROMPT in str(messages[0].get("content")):
            self.summaries += 1
            await asyncio.sleep(self.summary_s)


PRICED = {
    **CONFIG,
    "models": {MODEL: {**CONFIG["models"][MODEL], "price_input": 1.0, "price_output": 2.0}},
}


def test_a_client_timeout_shorter_than_the_summary_call_gets_its_retry_answered(
    sdk: Any, proxy_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent's client gives up (0.8 s) while the summary is written (1.5 s), and its SDK
    retries. The hang-up used to cancel the summary, and each retry's new summary was cut short
    in turn: the turn failed after three paid summary calls, every turn past the trigger. Now
    the summary is finished and the retry is answered with it: one summary call, billed once."""
    upstream = SlowSummaries()
    with ServerThread(upstream) as server:
        proxy = proxy_factory(server.url + "/v1", PRICED)
        client = sdk(proxy.base_url, timeout=0.8, max_retries=2)
        with caplog.at_level(logging.WARNING):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=history(18), extra_headers={"X-Session-Id": "short-timeout"}
            )
        assert raw.headers["x-cachegate-compacted"] == "1"
        assert upstream.summaries == 1
        summary_call, answered = upstream.requests[0], upstream.requests[-1]
        assert SUMMARIZER_SYSTEM_PROMPT in summary_call["messages"][0]["content"]
        assert any(SUMMARY_MARKER in str(m.get("content")) for m in answered["messages"])
        said = [r.getMessage() for r in caplog.records]
        assert any("the client left while its history was being summarized" in m for m in said)
        proxy.settle()
        logged = read_events(proxy.log_dir / "short-timeout.jsonl").events
        (made,) = [e for e in logged if e["type"] == "compacted"]
        assert made["source"] == "model"
        answers = [e for e in logged if e["type"] == "response" and e["status"] == 200]
        (response,) = answers
        summary_prompt = 3000 + 50 * len(summary_call["messages"])
        answer_prompt = 3000 + 50 * len(answered["messages"])
        # the summary's bill (its prompt, 2 output tokens) once, with the answer's
        expected = (summary_prompt + answer_prompt + 4 * 2.0) / 1e6
        assert response["cost"]["actual"] == pytest.approx(expected)


def test_a_summary_cut_by_a_shutdown_is_said_as_the_shutdowns(tmp_path: Path) -> None:
    """cachegate stops (Ctrl+C) while a history is being summarized: the summary is not kept,
    and stderr said that the request left "(its client, or cachegate stopping)" and asked about
    the client's timeout. It now says cachegate stopped, and nothing of a client that left."""
    upstream = SlowSummaries(summary_s=8.0)
    config = tmp_path / "cachegate.toml"
    config.write_text(
        "[compaction]\nenabled = true\ntrigger_percent = 75\nkeep_recent = 4\n\n"
        f'[models."{MODEL}"]\ncontext_window = 6000\n'
    )
    answers: list[httpx.Response] = []
    logs = tmp_path / "logs"
    with (
        ServerThread(upstream) as server,
        cachegate_process(server.url + "/v1", logs, "--config", str(config)) as (proc, url),
    ):

        def ask() -> None:
            answers.append(
                httpx.post(
                    url + "/chat/completions",
                    json={"model": MODEL, "messages": history(18)},
                    headers={"X-Session-Id": "stopped"},
                    timeout=30,
                )
            )

        client = threading.Thread(target=ask)
        client.start()
        wait_for(lambda: upstream.summaries == 1, what="the summary call")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
        client.join(10)
        assert proc.stderr is not None
        said = proc.stderr.read().decode()
    (answer,) = answers
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "server_shutting_down"
    assert "cachegate stopped while its history was being summarized" in said, said
    assert "client left" not in said and "timeout" not in said, said


_ENVIRONMENT = {"role": "system", "content": "<env>cwd=/repo</env>"}


@pytest.mark.parametrize("lead", ["same", "environment added"])
def test_a_summary_whose_client_left_is_used_and_billed_by_the_next_turn(
    sdk: Any, proxy_factory: Any, lead: str
) -> None:
    """No retry (max_retries=0): the turn fails at the client's timeout, the summary is finished
    anyway, and the agent's next turn goes out with it, recorded there as made and billed.
    (Also where the next turn adds a system message after the first: it went out with the
    summary, but as a reuse, the summary neither logged as made nor billed.)"""
    upstream = SlowSummaries(summary_s=1.0)
    with ServerThread(upstream) as server:
        proxy = proxy_factory(server.url + "/v1", PRICED)
        client = sdk(proxy.base_url, timeout=0.4, max_retries=0)
        messages = history(18)
        headers = {"X-Session-Id": "next-turn"}
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model=MODEL, messages=messages, extra_headers=headers)
        time.sleep(1.2)  # the summary is finished meanwhile
        messages.append({"role": "user", "content": "Go on."})
        if lead != "same":
            messages.insert(1, _ENVIRONMENT)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, extra_headers=headers
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        assert upstream.summaries == 1
        assert len(upstream.requests) == 2  # the summary call, then the next turn's
        proxy.settle()
        logged = read_events(proxy.log_dir / "next-turn.jsonl").events
        (made,) = [e for e in logged if e["type"] == "compacted"]
        assert made["source"] == "model"
        (response,) = [e for e in logged if e["type"] == "response" and e["status"] == 200]
        summary_prompt = 3000 + 50 * len(upstream.requests[0]["messages"])
        answer_prompt = 3000 + 50 * len(upstream.requests[1]["messages"])
        expected = (summary_prompt + answer_prompt + 4 * 2.0) / 1e6
        assert response["cost"]["actual"] == pytest.approx(expected)


def assert_billed_as_the_provider_billed(proxy: Any, upstream: NoCacheUpstream, sid: str) -> None:
    """Every call the upstream priced (summaries and answers) is in the metrics once, and in
    the session's logged response costs once."""
    total = sum(_cost(upstream, i) for i in range(len(upstream.requests)))
    labels = {"model": MODEL, "kind": "actual"}
    assert proxy.metric("cachegate_cost_usd_total", labels) == pytest.approx(total)
    proxy.settle()
    logged = read_events(proxy.log_dir / f"{sid}.jsonl").events
    costs = [e["cost"]["actual"] for e in logged if e["type"] == "response" and e["cost"]]
    assert sum(costs) == pytest.approx(total)


def _cost(upstream: NoCacheUpstream, index: int) -> float:
    """What the NoCacheUpstream's ``index``-th request cost at PRICED's prices."""
    prompt = 3000 + 50 * len(upstream.requests[index]["messages"])
    return (prompt * 1.0 + 2 * 2.0) / 1e6


@pytest.mark.parametrize("lead", ["same", "environment added"])
def test_the_next_turn_while_the_summary_is_written_waits_for_it_and_pays_once(
    sdk: Any, proxy_factory: Any, lead: str
) -> None:
    """The client left (its timeout), and the agent's next turn, its history longer (the cut
    would move), came while the summary was still written: it started a second summary, and
    the first, paid for, was recorded nowhere. (And a next turn with a system message added
    after the first did not see the summary being written: a second one was paid for.)"""
    upstream = SlowSummaries(summary_s=2.0)
    with ServerThread(upstream) as server:
        proxy = proxy_factory(server.url + "/v1", PRICED)
        messages = history(18)
        headers = {"X-Session-Id": "next-turn-early"}
        with pytest.raises(openai.APITimeoutError):
            sdk(proxy.base_url, timeout=0.4).chat.completions.create(
                model=MODEL, messages=messages, extra_headers=headers
            )
        messages += [
            {"role": "assistant", "content": "Still working on it."},
            {"role": "user", "content": "Go on."},
        ]
        if lead != "same":
            messages.insert(1, _ENVIRONMENT)
        raw = sdk(proxy.base_url, timeout=10).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, extra_headers=headers
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        assert upstream.summaries == 1
        assert len(upstream.requests) == 2
        proxy.settle()
        logged = read_events(proxy.log_dir / "next-turn-early.jsonl").events
        (made,) = [e for e in logged if e["type"] == "compacted"]
        assert made["source"] == "model"
        (response,) = [e for e in logged if e["type"] == "response" and e["status"] == 200]
        total = _cost(upstream, 0) + _cost(upstream, 1)
        assert response["cost"]["actual"] == pytest.approx(total)
        labels = {"model": MODEL, "kind": "actual"}
        assert proxy.metric("cachegate_cost_usd_total", labels) == pytest.approx(total)


def test_a_summary_nobody_waits_for_is_counted_in_the_metrics_once(
    sdk: Any, proxy_factory: Any
) -> None:
    """The client left and no request has gone out with the summary yet (the user quit, say):
    the provider billed it, so the metrics count it when it is done; the next turn that goes
    out with it carries it in its log line, and the metrics do not count it twice."""
    upstream = SlowSummaries(summary_s=0.8)
    with ServerThread(upstream) as server:
        proxy = proxy_factory(server.url + "/v1", PRICED)
        client = sdk(proxy.base_url, timeout=0.3)
        messages = history(18)
        headers = {"X-Session-Id": "unclaimed"}
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model=MODEL, messages=messages, extra_headers=headers)
        labels = {"model": MODEL, "kind": "actual"}
        wait_for(
            lambda: proxy.metric("cachegate_cost_usd_total", labels),
            what="the summary's cost in the metrics",
        )
        summary = _cost(upstream, 0)
        assert proxy.metric("cachegate_cost_usd_total", labels) == pytest.approx(summary)
        prompt = {"model": MODEL, "kind": "prompt"}
        assert proxy.metric("cachegate_tokens_total", prompt) == 3000 + 50 * len(
            upstream.requests[0]["messages"]
        )
        messages.append({"role": "user", "content": "Go on."})
        sdk(proxy.base_url, timeout=10).chat.completions.create(
            model=MODEL, messages=messages, extra_headers=headers
        )
        assert upstream.summaries == 1
        total = summary + _cost(upstream, 1)
        assert proxy.metric("cachegate_cost_usd_total", labels) == pytest.approx(total)
        proxy.settle()
        logged = read_events(proxy.log_dir / "unclaimed.jsonl").events
        (response,) = [e for e in logged if e["type"] == "response" and e["status"] == 200]
        assert response["cost"]["actual"] == pytest.approx(total)


@pytest.mark.parametrize("done_first", [False, True], ids=["while-written", "once-done"])
def test_a_turn_that_needs_a_compaction_on_top_of_a_summary_its_client_left_pays_for_both(
    sdk: Any, proxy_factory: Any, done_first: bool
) -> None:
    """The agent's next turn (a large tool output in it) came while the summary its timed-out
    try started was written (it waited), or once it was done (counted in the metrics then), and
    needed a compaction of its own on top of it: the first summary was in no log line (and, in
    the first order, no metric), though the provider billed it."""
    upstream = SlowSummaries(summary_s=1.5 if not done_first else 1.0)
    with ServerThread(upstream) as server:
        proxy = proxy_factory(server.url + "/v1", PRICED)
        messages = history(18)
        headers = {"X-Session-Id": "then-more"}
        with pytest.raises(openai.APITimeoutError):
            sdk(proxy.base_url, timeout=0.3).chat.completions.create(
                model=MODEL, messages=messages, extra_headers=headers
            )
        if done_first:
            wait_for(lambda: upstream.summaries == 1 and not proxy.gateway.chat.compactor._tasks)
        messages += history(19)[-2:]  # one more tool round...
        messages[-1] = {**messages[-1], "content": "output: " + "y" * 9000}  # ...a large one
        raw = sdk(proxy.base_url, timeout=20).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, extra_headers=headers
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        assert upstream.summaries == 2
        assert_billed_as_the_provider_billed(proxy, upstream, "then-more")


def test_a_session_whose_summary_is_written_is_not_forgotten_for_memory_meanwhile(
    sdk: Any, proxy_factory: Any
) -> None:
    """Near sessions.max_memory_mb, the session waiting on its summary is the least recently
    seen (its request came when the call began): it was forgotten, with the summary kept for
    its client's retry, which then paid for another and timed out again."""
    upstream = SlowSummaries(summary_s=1.5)
    with ServerThread(upstream) as server:
        config = {**PRICED, "sessions": {"max_memory_mb": 1}}
        proxy = proxy_factory(server.url + "/v1", config)
        messages = history(18)
        with pytest.raises(openai.APITimeoutError):
            sdk(proxy.base_url, timeout=0.5).chat.completions.create(
                model=MODEL, messages=messages, extra_headers={"X-Session-Id": "victim"}
            )
        others = sdk(proxy.base_url, timeout=10)
        for i in range(6):  # ~150 KB each: over the budget, sessions are forgotten
            others.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"other {i} " + "z" * 150_000}],
                extra_headers={"X-Session-Id": f"other-{i}"},
            )
        assert proxy.metric("cachegate_session_evictions_total", {"reason": "memory"}) >= 1
        wait_for(lambda: upstream.summaries == 1 and not proxy.gateway.chat.compactor._tasks)
        raw = sdk(proxy.base_url, timeout=1.0).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, extra_headers={"X-Session-Id": "victim"}
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        assert upstream.summaries == 1


def test_a_summary_rolled_into_one_whose_client_left_too_is_billed_with_it(
    sdk: Any, proxy_factory: Any
) -> None:
    """Both clients left: the first while its summary was written, the next turn (a large tool
    output in it) while the compaction on top of it was. The turn after went out with the
    second: its line carried that summary's bill, and the first one's was in no log line."""
    upstream = SlowSummaries(summary_s=1.0)
    with ServerThread(upstream) as server:
        proxy = proxy_factory(server.url + "/v1", PRICED)
        messages = history(18)
        headers = {"X-Session-Id": "both-left"}
        short = sdk(proxy.base_url, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            short.chat.completions.create(model=MODEL, messages=messages, extra_headers=headers)
        wait_for(lambda: upstream.summaries == 1 and not proxy.gateway.chat.compactor._tasks)
        messages += history(19)[-2:]
        messages[-1] = {**messages[-1], "content": "output: " + "y" * 9000}
        with pytest.raises(openai.APITimeoutError):
            short.chat.completions.create(model=MODEL, messages=messages, extra_headers=headers)
        wait_for(lambda: upstream.summaries == 2 and not proxy.gateway.chat.compactor._tasks)
        messages.append({"role": "user", "content": "Go on."})
        raw = sdk(proxy.base_url, timeout=20).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, extra_headers=headers
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        assert upstream.summaries == 2
        assert_billed_as_the_provider_billed(proxy, upstream, "both-left")


def test_finding_a_conversations_compaction_hashes_its_history_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sub-agents fanned out with one task (one opening), each compacted at its own point and
    taking turns: none is the compaction used last, so each of them was tried by hashing the
    history from its start again (25 ms a request with 32 of 272 KB histories). The history is
    now hashed once, each digest resumed from the one before."""
    from proxy.compactor import Compactor, _key

    system = {"role": "system", "content": "You are a sub-agent."}
    task = {"role": "user", "content": "Rename the config loader."}
    history = [system, task]
    history += [{"role": "assistant", "content": f"step {i}"} for i in range(3 * MAX_COMPACTIONS)]
    opening = compaction.opening_digest(history)

    def made(covered: int, messages: list[Any]) -> compaction.Compaction:
        return compaction.Compaction(
            prefix_digest=compaction.prefix_digest(messages, covered),
            covered=covered,
            start=1,
            message={"role": "user", "content": f"summary to {covered}"},
            source="model",
            tokens_before=1000,
            tokens_after=100,
            opening=opening,
        )

    other = [system, task, *({"role": "assistant", "content": f"other {i}"} for i in range(99))]
    held: dict[str, list[Any]] = {}
    for k in range(MAX_COMPACTIONS - 1):  # the others' compactions, at points of their own
        comp = made(3 + 2 * k, other)
        held[_key(comp)] = [comp, None]
    mine = made(2 * MAX_COMPACTIONS, history)
    held[_key(mine)] = [mine, None]
    calls = []
    real = compaction.chain_digest
    monkeypatch.setattr(compaction, "chain_digest", lambda d, m: calls.append(1) or real(d, m))
    found, digest = Compactor._existing(held, history)
    assert found is mine and digest == mine.prefix_digest
    assert len(calls) <= 2 * MAX_COMPACTIONS  # the longest covered prefix, once


def _tool_turns(
    c: Any,
    sim: RunningSimulator,
    sid: str,
    turns: int,
    output: Any,
    model: str = MODEL,
    mark: bool = False,
    interrupted: bool = False,
) -> list[tuple[str | None, int]]:
    """An agent's tool loop of ``turns`` turns (``output(turn)``, each tool result); each turn's
    ``X-Cachegate-Compacted`` and the prompt tokens the provider counted. With ``mark``, the
    latest message carries a ``cache_control`` mark, taken off the one before (Claude Code's
    way, opencode's). With ``interrupted``, the history opens with a call the user interrupted,
    which the repair answers with a synthetic result on every turn."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Investigate data/big.csv and report the anomaly."},
    ]
    if interrupted:
        cut = {"id": "call_cut", "type": "function", "function": {"name": "run", "arguments": "{}"}}
        msgs += [
            {"role": "assistant", "content": None, "tool_calls": [cut]},
            {"role": "user", "content": "Stop that; go on with the CSV."},
        ]
    seen: list[tuple[str | None, int]] = []
    for turn in range(turns):
        call = {"tool_calls": [{"id": f"call_{turn}", "name": "run", "arguments": {"n": turn}}]}
        sim.sim.enqueue([parse_script(call)])
        sent = msgs
        if mark:
            last = {**msgs[-1], "cache_control": {"type": "ephemeral"}}
            sent = [*msgs[:-1], last]
        raw = c.chat.completions.with_raw_response.create(
            model=model, messages=sent, tools=TOOLS, extra_headers={"X-Session-Id": sid}
        )
        reply = raw.parse()
        assert reply.usage is not None
        seen.append((raw.headers.get("x-cachegate-compacted"), reply.usage.prompt_tokens))
        message = reply.choices[0].message.model_dump(exclude_none=True)
        msgs += [message, {"role": "tool", "tool_call_id": f"call_{turn}", "content": output(turn)}]
    return seen


TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
WINDOW_8000 = {
    "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 8},
    "models": {MODEL: {"context_window": 8000}},
}


def test_a_dense_tool_output_is_compacted_once_on_the_providers_count(
    sdk: Any, proxy_factory: Any
) -> None:
    """A CSV of digits counts a token a byte or two to the provider, a quarter of that to the
    estimate: planned on the estimate, the compaction kept the output in its tail, the history
    stayed at ~95% of the window, and it compacted again on each of the next four turns (a
    summary paid and the cache lost each time; the first one larger than before)."""
    dense = ",".join(str(i % 10) for i in range(3500))
    with run_simulator(SimConfig(context_window=200_000)) as big:
        proxy = proxy_factory(big.api_base, WINDOW_8000)
        seen = _tool_turns(
            sdk(proxy.base_url), big, "dense", 10, lambda t: dense if t == 4 else f"ok {t} " * 30
        )
    made = [e for e in compacted_events(proxy) if e["source"] != "reused"]
    assert len(made) == 1, made  # compacted once...
    crossed = next(i for i, (_, prompt) in enumerate(seen) if prompt > 6000)
    after = [prompt for flag, prompt in seen[crossed + 1 :]]
    assert all(flag == "1" for flag, _ in seen[crossed + 1 :])
    assert max(after) < 0.6 * 8000  # ...under its aim by the provider's count, and stays so


def _code(seed: int, chars: int) -> str:
    """``chars`` characters of ordinary code (the simulator counts it at ~1.4 times the
    estimate)."""
    lines = [
        f"def func_{seed}_{i}(arg{i}, value=None):  # line {i}\n"
        f"    return compute(arg{i}, {i * 7919 % 9973}) + helper_{i * 31 % 97}(value)"
        for i in range(1, chars // 60 + 2)
    ]
    return "\n".join(lines)[:chars]


def test_a_dense_output_summarized_away_does_not_make_the_kept_round_too_long(
    sdk: Any, proxy_factory: Any
) -> None:
    """A CSV of digits read first (a token a byte to the provider, four times the estimate),
    then a round of two code files, the next turn asking for 2,000 completion tokens: the
    provider's count of the whole history, 3.6 times the estimate, was taken for the kept
    round's too (code, ~1.4 times), which came out "over the window": nothing compacted, the
    refusal relayed on every try, where the compaction fits with room to spare. It is compacted
    (the provider's refusal to say otherwise), on the first try and after a restart's refusal."""
    dense = ",".join(str(i % 10) for i in range(3000))
    for restart in (False, True):
        with run_simulator(SimConfig(context_window=8000)) as small:
            proxy = proxy_factory(small.api_base, WINDOW_8000)
            c = sdk(proxy.base_url, default_headers={"X-Session-Id": f"dense-first-{restart}"})
            msgs: list[dict[str, Any]] = [
                {"role": "system", "content": "You are a coding agent. Be terse."},
                {"role": "user", "content": "Find why the checksum of data/ids.txt is wrong."},
            ]
            for turn, outputs in enumerate(([dense], [_code(1, 3500), _code(2, 5000)])):
                calls = [
                    {"id": f"call_{turn}_{k}", "name": "read_file", "arguments": {"k": k}}
                    for k in range(len(outputs))
                ]
                small.sim.enqueue([parse_script({"tool_calls": calls})])
                reply = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
                msgs.append(reply.choices[0].message.model_dump(exclude_none=True))
                msgs += [
                    {"role": "tool", "tool_call_id": f"call_{turn}_{k}", "content": output}
                    for k, output in enumerate(outputs)
                ]
            assert 6000 < reply.usage.prompt_tokens < 6500  # (3.6 times the estimate)
            if restart:  # (the provider's count forgotten: the estimate lets it go, refused)
                proxy = proxy_factory(small.api_base, WINDOW_8000)
                c = sdk(proxy.base_url, default_headers={"X-Session-Id": f"dense-first-{restart}"})
            before = len(small.sim.requests)
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=msgs, tools=TOOLS, max_completion_tokens=2000
            )
            assert raw.headers.get("x-cachegate-compacted") == "1"
            sent = [r.status for r in small.sim.requests[before:]]
            assert sent == ([400] if restart else []) + [200, 200], sent  # a summary, the turn
            usage = raw.parse().usage
            assert usage is not None and usage.prompt_tokens + 2000 < 8000


def test_a_dense_output_summarized_away_does_not_shorten_the_new_summary(
    sdk: Any, proxy_factory: Any
) -> None:
    """A CSV of digits read first, a round of code after it, the next turn asking for 3,000
    completion tokens: the room for the summary was planned on the provider's count of the
    whole history (3.7 times the estimate, the CSV's, which the summary replaces), and the
    summary was asked for in 264 words and cut, with half the window free."""
    dense = ",".join(str(i % 10) for i in range(2400))
    summary = " ".join(
        f"Step {i}: the agent read file_{i}.py and found the checksum loop skips the last id."
        for i in range(1, 31)
    )
    with run_simulator(SimConfig(context_window=8000)) as small:
        proxy = proxy_factory(small.api_base, WINDOW_8000)
        c = sdk(proxy.base_url, default_headers={"X-Session-Id": "dense-room"})
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent. Be terse."},
            {"role": "user", "content": "Find why the checksum of data/ids.txt is wrong."},
        ]
        for turn, output in enumerate((dense, _code(1, 2500))):
            call = {"id": f"call_{turn}", "name": "read_file", "arguments": {"k": turn}}
            small.sim.enqueue([parse_script({"tool_calls": [call]})])
            reply = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
            msgs.append(reply.choices[0].message.model_dump(exclude_none=True))
            msgs.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": output})
        small.sim.enqueue([parse_script(summary)])
        before = len(small.sim.requests)
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, tools=TOOLS, max_completion_tokens=3000
        )
        assert raw.headers.get("x-cachegate-compacted") == "1"
        sent = small.sim.requests[before:]
        assert [r.status for r in sent] == [200, 200]  # (a summary, the turn: none refused)
        forwarded = sent[-1].body["messages"]
    (made,) = [
        m["content"]
        for m in forwarded
        if isinstance(m.get("content"), str) and m["content"].startswith(SUMMARY_MARKER)
    ]
    assert "summary cut by cachegate" not in made and summary in made


def test_a_repaired_history_keeps_the_providers_count_for_the_trigger(
    sdk: Any, proxy_factory: Any
) -> None:
    """An interrupted call early in the history, answered by a synthetic result every turn: the
    provider's numbers were recorded against the client's messages and compared with the
    repaired ones, one longer, so they were never used. Left to the estimate (half the
    provider's count of this text), turns went out past the trigger and on up to the window,
    refused there, compacted and sent again. It compacts as a history with nothing to repair
    does: on the provider's count, with at most one turn past the trigger (the growth of the
    turn itself is estimated)."""
    for interrupted in (False, True):
        with run_simulator(SimConfig(context_window=200_000)) as big:
            proxy = proxy_factory(big.api_base, WINDOW_8000)
            seen = _tool_turns(
                sdk(proxy.base_url),
                big,
                f"cut-{interrupted}",
                16,
                lambda t: "a," * 350,
                interrupted=interrupted,
            )
        compacted = [flag == "1" for flag, _ in seen]
        assert True in compacted, (interrupted, seen)
        first = compacted.index(True)
        assert all(compacted[first:]), seen
        assert len([p for _, p in seen[:first] if p >= 6000]) <= 1, (interrupted, seen)
        assert max(p for _, p in seen[:first]) < 0.85 * 8000


def test_a_history_that_ends_in_an_unanswered_call_keeps_the_providers_count(
    sdk: Any, proxy_factory: Any
) -> None:
    """A turn that ends in a call with no result (the agent stopped there), which the repair
    answers at the end; the next turn sends the real result in that place. The provider's count
    was recorded with the synthetic result as the history's last message, the next turn's
    differs there, and the trigger fell back to the estimate (a quarter of the provider's
    count of this text): it went out uncompacted, past the trigger."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Investigate data/big.csv and report the anomaly."},
    ]
    for i in range(9):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "run", "arguments": "{}"}}
        msgs += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "a," * 350},
        ]
    last = {"id": "c50", "type": "function", "function": {"name": "run", "arguments": "{}"}}
    msgs.append({"role": "assistant", "content": None, "tool_calls": [last]})
    with run_simulator(SimConfig(context_window=200_000)) as big:
        proxy = proxy_factory(big.api_base, WINDOW_8000)
        client = sdk(proxy.base_url)
        headers = {"X-Session-Id": "ends-in-a-call"}
        first = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers=headers
        )
        assert first.headers.get("x-cachegate-repairs") == "1"
        assert first.headers.get("x-cachegate-compacted") is None
        usage = first.parse().usage
        assert usage is not None and usage.prompt_tokens > 6000  # over the trigger, to them
        msgs += [
            {"role": "tool", "tool_call_id": "c50", "content": "done"},
            {"role": "user", "content": "Continue."},
        ]
        second = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers=headers
        )
        assert second.headers.get("x-cachegate-compacted") == "1"


def test_a_moving_cache_mark_keeps_the_providers_count_for_the_trigger(
    sdk: Any, proxy_factory: Any
) -> None:
    """A client that marks its latest message sends the previous one unmarked next turn: the
    provider's numbers were taken for another history's, every turn, and the trigger left to
    the estimate (later than the provider's count by the estimate's error: 86% of the window
    here, ~90% with a real tokenizer on code). It compacts on the same turn as without marks."""
    first: dict[bool, int] = {}
    for mark in (False, True):
        with run_simulator(SimConfig(context_window=200_000)) as big:
            proxy = proxy_factory(big.api_base, WINDOW_8000)
            # text the simulator counts at about twice the estimate (a token a 2 bytes)
            seen = _tool_turns(
                sdk(proxy.base_url),
                big,
                f"mark-{mark}",
                16,
                lambda t: "a," * 350,
                mark=mark,
            )
        first[mark] = next(i for i, (flag, _) in enumerate(seen) if flag == "1")
        crossed = next(i for i, (_, prompt) in enumerate(seen) if prompt >= 6000)
        assert first[mark] == crossed + 1, seen  # the turn after the count reached the trigger
    assert first[True] == first[False]


def test_a_retry_leaves_room_for_the_completion_the_request_asks_for(
    sdk: Any, proxy_factory: Any
) -> None:
    """A provider that counts the completion asked for in the window (vLLM, OpenAI's older
    models, Anthropic): the retry was planned against the window alone, and refused again after
    the summary call had been paid for."""
    with run_simulator(SimConfig(context_window=4000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 100, "keep_recent": 4},
            "models": {MODEL: {"context_window": 1000000}},
        }
        proxy = proxy_factory(small.api_base, config)
        msgs = history(12, output_chars=2000, system_repeat=10)
        small.sim.enqueue([parse_script(" ".join(["summary"] * 150))])  # (as long as asked)
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, max_tokens=2800, extra_headers={"X-Session-Id": "room"}
        )
        assert_refused_then_compacted(raw, small)


def test_a_retry_s_summary_is_sized_for_the_room_the_completion_leaves(
    sdk: Any, proxy_factory: Any
) -> None:
    """With a max_tokens of three quarters of the window (Qwen3's advised share), the summary
    was asked for, and clipped to, the whole window's length, where the plan left room for the
    prompt's share only: a summarizer using its allowed overrun had the retry refused again."""
    with run_simulator(SimConfig(context_window=16384)) as small:
        config = {
            "compaction": {"enabled": True, "keep_recent": 8},
            "models": {MODEL: {"context_window": 1000000}},
        }
        proxy = proxy_factory(small.api_base, config)
        words = " ".join(["fixed", "the", "parser", "in", "sse", "for", "CRLF", "lines"] * 300)
        small.sim.enqueue([parse_script(words[: 2100 * 5])])  # a long-winded summarizer
        msgs = history(40, output_chars=1500, system_repeat=10)
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, max_tokens=12288, extra_headers={"X-Session-Id": "share"}
        )
        assert_refused_then_compacted(raw, small)


@pytest.mark.parametrize(
    ("max_tokens", "rounds"),
    [(7900, 40), (7950, 40), (20000, 80)],  # (80 rounds: the prompt alone over the window)
)
def test_a_completion_that_leaves_no_room_for_a_summary_is_relayed_unpaid(
    sdk: Any, proxy_factory: Any, max_tokens: int, rounds: int
) -> None:
    """A max_tokens that leaves less room than the smallest summary (7,900 of 8,000), or fills
    the window where the refusal does not say what it asked for (a prompt over the window by
    itself; OpenRouter's "N in the output"): a summary was paid for and the retry refused
    again. The refusal is relayed, no summary asked for."""
    import openai

    with run_simulator(SimConfig(context_window=8000)) as small:
        config = {"compaction": {"enabled": True}, "models": {MODEL: {"context_window": 1000000}}}
        proxy = proxy_factory(small.api_base, config)
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a helpful agent."},
            {"role": "user", "content": "Refactor the module please."},
        ]
        for i in range(rounds):  # short turns: the latest few fit the room left, not a summary
            words = " ".join(f"word{i}_{j}" for j in range(5))
            msgs += [
                {"role": "assistant", "content": f"step {i} {words}"},
                {"role": "user", "content": f"continue {i} {words}"},
            ]
        if rounds > 40:  # (the prompt alone over the window: the refusal says nothing more)
            msgs[1]["content"] += " Context: " + "lorem ipsum " * 3000
        with pytest.raises(openai.BadRequestError):
            sdk(proxy.base_url).chat.completions.create(
                model=MODEL,
                messages=msgs,
                max_tokens=max_tokens,
                extra_headers={"X-Session-Id": "full"},
            )
        assert [r.status for r in small.sim.requests] == [400]  # no summary call, no retry


def _sent(proxy: Any, messages: list[Any], session: str, **params: Any) -> httpx.Response:
    """The history ``messages`` (and ``params``) posted through ``proxy`` under ``session``."""
    return httpx.post(
        proxy.base_url + "/chat/completions",
        json={"model": MODEL, "messages": messages, **params},
        headers={"X-Session-Id": session},
        timeout=30,
    )


@contextlib.contextmanager
def _llama_cpp(
    n_ctx: int,
    summary_share: float = 0.0,
    chinese: bool = False,
    summary_fails: bool = False,
    density: float = 1.0,
) -> Iterator[tuple[str, list[int]]]:
    """An upstream that refuses as llama.cpp does, counting the prompt alone (a token for four
    bytes of its messages) against ``n_ctx``, whatever max_tokens asks; its base URL and the
    statuses it answered. With ``summary_share``, a summary call is answered with that share of
    the length it asks for (its words at six characters each; ``chinese``: three characters a
    word, three bytes a character), else with a few words; ``summary_fails``: with a 500.
    ``density``: the prompt counted that many times four bytes a token (dense text)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[int] = []

    class LlamaCpp(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None: ...

        def do_POST(self) -> None:
            body = orjson.loads(self.rfile.read(int(self.headers["content-length"])))
            tokens = int(len(orjson.dumps(body["messages"])) * density) // 4
            summary = body["messages"][0]["content"] == SUMMARIZER_SYSTEM_PROMPT
            if summary and summary_fails:
                status, answer = 500, {"error": {"message": "overloaded", "type": "server_error"}}
            elif tokens >= n_ctx and not summary:
                status, answer = (
                    400,
                    {
                        "error": {
                            "code": 400,
                            "message": f"request ({tokens} tokens) exceeds the available context"
                            f" size ({n_ctx} tokens), try increasing it",
                            "type": "exceed_context_size_error",
                            "n_prompt_tokens": tokens,
                            "n_ctx": n_ctx,
                        }
                    },
                )
            else:
                text = "a short summary"
                asked = re.search(r"under about (\d+) words", body["messages"][-1]["content"])
                if summary and summary_share and asked:
                    text = ("word " * int(asked[1]))[: int(int(asked[1]) * 6 * summary_share)]
                    if chinese:
                        text = "字" * int(int(asked[1]) * 3 * summary_share)
                status, answer = (
                    200,
                    {
                        "id": "chatcmpl-1",
                        "object": "chat.completion",
                        "created": 1,
                        "model": MODEL,
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": text},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {
                            "prompt_tokens": tokens,
                            "completion_tokens": 4,
                            "total_tokens": 9,
                        },
                    },
                )
            seen.append(status)
            data = orjson.dumps(answer)
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), LlamaCpp)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_counts_the_prompt_alone_keeps_its_retry_whatever_max_tokens(
    proxy_factory: Any,
) -> None:
    """llama.cpp refuses a prompt over its n_ctx whatever max_tokens asks (it counts the prompt
    alone): reserving the request's max_tokens (8,192 of an 8,192 window) gave the retry up,
    where a compacted one is taken."""
    with _llama_cpp(8192) as (url, seen):
        config = {"compaction": {"enabled": True}, "models": {MODEL: {"context_window": 1000000}}}
        proxy = proxy_factory(url, config)
        msgs = history(60, output_chars=600, system_repeat=2)
        answer = _sent(proxy, msgs, "llama", max_tokens=8192)
        assert answer.status_code == 200, answer.text
        assert seen == [400, 200, 200]  # refused, the summary call, the compacted retry


def test_a_retry_with_no_room_for_the_summary_beside_the_last_round_is_not_paid_for(
    proxy_factory: Any,
) -> None:
    """The last tool output alone nearly fills the window: kept whole, it fits, but not with
    the summary asked for beside it. A summary was paid for and the retry refused again (the
    client then got the second refusal, with the compacted request's numbers)."""
    with _llama_cpp(4096) as (url, seen):
        config = {"compaction": {"enabled": True}, "models": {MODEL: {"context_window": 1000000}}}
        proxy = proxy_factory(url, config)
        msgs = history(4, output_chars=2000, system_repeat=1)
        msgs[-1]["content"] = "x" * 15800
        answer = _sent(proxy, msgs, "no-room")
        assert answer.status_code == 400
        assert seen == [400]  # no summary call, no retry


def _tool_rounds(last: int) -> list[dict[str, Any]]:
    """A task and seven tool rounds, the last one's output ``last`` characters long."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Task: " + "t" * 200},
    ]
    for n in range(7):
        arguments = orjson.dumps({"path": f"f{n}.csv"}).decode()
        call = {"id": f"call_{n}", "type": "function"}
        call["function"] = {"name": "read", "arguments": arguments}
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        size = last if n == 6 else 2000
        msgs.append({"role": "tool", "tool_call_id": f"call_{n}", "content": "x" * size})
    return msgs


@pytest.mark.parametrize("chinese", [False, True])
def test_a_retry_s_summary_longer_than_asked_is_cut_to_the_room_planned_for_it(
    proxy_factory: Any, chinese: bool
) -> None:
    """After a refusal the retry is planned on the summary's length as asked for, to the token;
    a summarizer writing a fifth more (words of technical text run long) went out whole, as
    any summary may run a quarter over, and the retry was refused again. So did one in Chinese
    within the characters asked for, at three bytes each: the room is the estimate's bytes."""
    with _llama_cpp(4096, summary_share=1.2, chinese=chinese) as (url, seen):
        config = {"compaction": {"enabled": True}, "models": {MODEL: {"context_window": 1000000}}}
        proxy = proxy_factory(url, config)
        answer = _sent(proxy, _tool_rounds(13400), "long-summary")
        assert answer.status_code == 200, answer.text
        assert seen == [400, 200, 200]  # refused, the summary call, the compacted retry


def test_a_retry_s_extractive_summary_of_a_history_in_chinese_keeps_to_its_bytes(
    proxy_factory: Any,
) -> None:
    """A retry whose summary call fails goes with the extractive summary, as long as a
    model's may be in characters: of a history in Chinese (three bytes a character) it was
    three times the room the retry was planned on, and the retry was refused again. It is built
    again shorter, its sections kept."""
    task = "任务：把所有的测试修好，并且解释每一个失败的原因。" * 40
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": task},
    ]
    for n in range(8):
        arguments = orjson.dumps({"path": f"文件{n}.csv"}).decode()
        call = {"id": f"call_{n}", "type": "function"}
        call["function"] = {"name": "read", "arguments": arguments}
        msgs.append({"role": "assistant", "content": "我先读这个文件。" * 30, "tool_calls": [call]})
        output = "x" * 11000 if n == 7 else "数据" * 700
        msgs.append({"role": "tool", "tool_call_id": f"call_{n}", "content": output})

    with _llama_cpp(4096, summary_fails=True) as (url, seen):
        config = {"compaction": {"enabled": True}, "models": {MODEL: {"context_window": 1000000}}}
        proxy = proxy_factory(url, config)
        answer = _sent(proxy, msgs, "extractive-chinese")
        assert answer.status_code == 200, answer.text
        assert seen == [400, 500, 200]  # refused, the failed summary call, the compacted retry

    # built again shorter: each section kept, the latest steps with them; a proactive
    # compaction's (not planned to the token) as long as its characters allow
    from types import SimpleNamespace

    from proxy.compactor import _extractive, _json_size

    plan: Any = SimpleNamespace(middle=msgs[1:-2], previous_summary=None)
    exact, loose = _extractive(plan, 2048, exact=True), _extractive(plan, 2048, exact=False)
    assert 0.8 * 2048 < _json_size(exact) <= 2048 < _json_size(loose)
    for heading in ("## Task", "## Steps", "## Files", 'read({"path":"文件6.csv"})'):
        assert heading in exact


def test_a_retry_reserves_the_summary_as_the_summarizer_models_window_asks_it(
    proxy_factory: Any,
) -> None:
    """A summarizer model with a smaller window is asked for a shorter summary; the retry
    after a refusal reserved the length the compacted model's window would ask for, and gave
    up (the refusal relayed) where the shorter summary left room for the latest messages."""
    with _llama_cpp(16384) as (url, seen):
        config = {
            "compaction": {"enabled": True, "summarizer_model": "small"},
            "models": {MODEL: {"context_window": 1000000}, "small": {"context_window": 8192}},
        }
        proxy = proxy_factory(url, config)
        answer = _sent(proxy, _tool_rounds(59000), "small-summarizer")
        assert answer.status_code == 200, answer.text
        assert seen == [400, 200, 200]  # refused, the summary call, the compacted retry


def test_a_retry_of_dense_text_reserves_the_summary_at_the_estimates_rate(
    proxy_factory: Any,
) -> None:
    """A provider counting the history at twice cachegate's estimate (dense text): the retry
    is planned on the window shrunk by that, and the summary, prose asked for in characters,
    was reserved as if it were as dense: a false give-up, the refusal relayed where a
    compaction fitted."""
    with _llama_cpp(16384, density=2.0) as (url, seen):
        config = {"compaction": {"enabled": True}, "models": {MODEL: {"context_window": 1000000}}}
        proxy = proxy_factory(url, config)
        answer = _sent(proxy, _tool_rounds(27000), "dense")
        assert answer.status_code == 200, answer.text
        assert seen == [400, 200, 200]  # refused, the summary call, the compacted retry


def test_openrouters_wording_of_the_output_asked_for_is_read() -> None:
    from proxy.compaction import is_context_length_error, output_asked

    said = (
        b'{"error":{"message":"This endpoint\'s maximum context length is 131072 tokens. However,'
        b" you requested about 138956 tokens (7884 of text input, 131072 in the output). Please"
        b' reduce the length of either one.","code":400,"metadata":{"provider_name":null}}}'
    )
    assert output_asked(said) == 131072
    assert not is_context_length_error(400, said)  # the output alone fills the window


def test_a_history_and_its_continuation_sent_together_during_the_log_read_share_one_summary(
    sim: RunningSimulator, sdk: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session's first long history in this process and a sub-agent's continuation of it
    arrive together: both waited for the session's log to be read, then each paid for its own
    summary of the same prefix (two summaries held, the provider's cache split between them).
    The second now waits for the first one's summary and goes out with it."""
    import threading

    from proxy import compactor as compactor_module
    from tests.conftest import run_proxy

    read = compactor_module.logged_compactions

    def slow_read(*args: Any) -> Any:
        time.sleep(0.5)  # a slow disk: the other request arrives during the read
        return read(*args)

    monkeypatch.setattr(compactor_module, "logged_compactions", slow_read)
    main = history(18)
    sub = [*main, {"role": "assistant", "content": "spawning"}, {"role": "user", "content": "go"}]
    headers = {"X-Session-Id": "cold-burst"}
    with run_proxy(sim.api_base, tmp_path / "logs", CONFIG) as proxy:
        c = sdk(proxy.base_url)
        sent = len(sim.sim.requests)
        threads = [
            threading.Thread(
                target=c.chat.completions.create,
                kwargs={"model": MODEL, "messages": msgs, "extra_headers": headers},
            )
            for msgs in (main, sub)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        summary_calls = [
            r
            for r in sim.sim.requests[sent:]
            if r.body["messages"][0]["content"] == SUMMARIZER_SYSTEM_PROMPT
        ]
        assert len(sim.sim.requests) == sent + 3  # one summary call, two answers
        assert len(summary_calls) == 1
        sent_summaries = {
            r.body["messages"][1]["content"]
            for r in sim.sim.requests[sent:]
            if str(r.body["messages"][1].get("content")).startswith(SUMMARY_MARKER)
        }
        assert len(sent_summaries) == 1  # the same summary in both


def test_a_retry_s_summary_is_cut_to_its_bytes_in_any_script() -> None:
    """The cut to the estimate's bytes holds for text JSON writes longer than its characters
    (Chinese, escapes) and for a lone surrogate orjson refuses; it keeps the cut's note."""
    from proxy.compaction import clip_summary
    from proxy.compactor import _json_size, _within_bytes

    for text in ("字" * 3000, 'say "x"\\n\t' * 400, "a\ud83db" * 2000, "plain words " * 400):
        cut = _within_bytes(text, clip_summary(text, 2048), 2048)
        assert 100 < len(cut) <= 2048 and _json_size(cut) <= 2048
        assert cut.endswith("over the room for it]")  # (the cut's note, kept)
    assert _json_size("字") == len('"字"'.encode())  # (UTF-8 as sent, not escaped)
    # denser at its end than on average: the room is used, not half of it
    mixed = (
        "The build fails in module X because of Y.\n" * 150
        + "修复了构建中的错误，测试通过。\n" * 400
    )
    cut = _within_bytes(mixed, clip_summary(mixed, 12000), 12000)
    assert 0.9 * 12000 < _json_size(cut) <= 12000 and "修复" in cut


def test_with_keep_recent_1_a_kept_later_instruction_does_not_stop_compaction(
    sdk: Any, proxy_factory: Any
) -> None:
    """``keep_recent = 1``: a compaction keeps the user's later instruction verbatim after its
    summary; then the cut was pulled back to that instruction on every later turn, so no new
    compaction was made (the loops that give the instruction up halve from two), the history
    grew past the window and every turn was refused, the refusal relayed."""
    import random

    config = {
        "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 1},
        "models": {MODEL: {"context_window": 8000}},
    }
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]

    def output(i: int) -> str:
        r = random.Random(i)
        words = ("def", "x", "return", "self")
        return f"file_{i}.py:\n" + " ".join(
            r.choice(words) + str(r.randint(0, 99)) for _ in range(250)
        )

    with run_simulator(SimConfig(context_window=8000)) as small:
        proxy = proxy_factory(small.api_base, config)
        client = sdk(proxy.base_url, default_headers={"X-Session-Id": "keep-one"})
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent. " * 20},
            {"role": "user", "content": "Fix the bug in parser.py."},
        ]
        prompts = []
        for turn in range(40):
            if turn == 12:  # the user's second instruction, mid-session
                msgs += [
                    {"role": "assistant", "content": "Done with the parser."},
                    {"role": "user", "content": "Now port the lexer to the new API."},
                ]
            script = {
                "content": f"step {turn}",
                "tool_calls": [
                    {"name": "read_file", "arguments": {"path": f"f{turn}.py"}, "id": f"c{turn}"}
                ],
            }
            answer = client.chat.completions.create(
                model=MODEL,
                messages=msgs,
                tools=tools,
                extra_headers={"X-Sim-Script": orjson.dumps(script).decode()},
            )  # (refused past the window: openai.BadRequestError)
            assert answer.usage is not None
            prompts.append(answer.usage.prompt_tokens)
            call = answer.choices[0].message.tool_calls[0]
            msgs += [
                {
                    "role": "assistant",
                    "content": answer.choices[0].message.content,
                    "tool_calls": [
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {"name": "read_file", "arguments": call.function.arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call.id, "content": output(turn)},
            ]
        assert max(prompts[20:]) < 6000  # compacted again each time it reached the trigger


@pytest.mark.parametrize("keep_recent", [4, 8])
def test_after_a_later_instruction_each_compaction_keeps_keep_recent_messages(
    sdk: Any, proxy_factory: Any, keep_recent: int
) -> None:
    """A task, tool rounds, then the user's new instruction, then more tool rounds: the first
    compaction kept the instruction verbatim; from the second on, the cut pulled back to it
    ended where the reused compaction ended (nothing more to compact with it), and the loops
    that give it up halve before they try: half of ``keep_recent`` went verbatim (the model
    lost its latest tool outputs) though all of them were far under the aim."""
    config = {
        "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": keep_recent},
        "models": {MODEL: {"context_window": 8000}},
    }
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]

    def tool_round(msgs: list[dict[str, Any]], t: int) -> None:
        msgs.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{t}",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": f'{{"path": "f{t}.py"}}'},
                    }
                ],
            }
        )
        msgs.append(
            {
                "role": "tool",
                "tool_call_id": f"call_{t}",
                "content": f"line {t} of file content x=1\n" * 60,
            }
        )

    with run_simulator(SimConfig(context_window=8000)) as small:
        proxy = proxy_factory(small.api_base, config)
        client = sdk(proxy.base_url, default_headers={"X-Session-Id": "later"})
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Fix the bug in foo.py."},
        ]
        for t in range(4):
            tool_round(msgs, t)
        msgs.append({"role": "user", "content": "Actually, do it differently."})
        kept: list[int] = []  # the client's messages that went verbatim after each summary
        for t in range(24):
            client.chat.completions.create(model=MODEL, messages=msgs, tools=tools)
            sent = small.sim.requests[-1].body["messages"]
            at = next(
                (
                    i
                    for i, m in enumerate(sent)
                    if str(m.get("content") or "").startswith(SUMMARY_MARKER)
                ),
                None,
            )
            if at is not None:
                tail = sent[at + 1 :]
                if tail and tail[0].get("content") == "Actually, do it differently.":
                    tail = tail[1:]  # (the instruction, kept as an anchor)
                kept.append(len(tail))
            tool_round(msgs, 100 + t)
        compactions = compacted_events(proxy)
        assert len(compactions) >= 2, compactions  # (a second compaction, reusing the first)
        assert kept and min(kept) >= keep_recent, kept


@pytest.mark.parametrize("change", ["added", "removed"])
def test_a_leading_message_added_or_removed_keeps_the_compaction(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, change: str
) -> None:
    """An agent that adds an environment message after its system prompt (or drops one) on a
    later turn: the compaction's places counted from the history's start, so it no longer
    matched, and a new summary was paid for (and the provider's cache lost) though the
    messages it covers were the same."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    c = sdk(proxy.base_url, default_headers={"X-Session-Id": f"lead-{change}"})
    msgs = history(18)
    environment = {"role": "system", "content": "<env>cwd=/repo</env>"}
    if change == "removed":
        msgs.insert(1, environment)
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs)
    assert raw.headers["x-cachegate-compacted"] == "1"
    summary = sim.sim.requests[-1].body["messages"][2 if change == "removed" else 1]
    assert str(summary["content"]).startswith(SUMMARY_MARKER)
    if change == "removed":
        del msgs[1]
    else:
        msgs.insert(1, environment)
    msgs += [{"role": "assistant", "content": "Next."}, {"role": "user", "content": "Go on."}]
    summaries = _summary_calls(sim)
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs)
    assert raw.headers["x-cachegate-compacted"] == "1"
    assert _summary_calls(sim) == summaries  # no new summary call
    lead = 2 if change == "added" else 1
    forwarded = sim.sim.requests[-1].body["messages"]
    assert forwarded[:lead] == msgs[:lead] and forwarded[lead] == summary
    assert forwarded[-4:] == msgs[-4:]


def _summary_calls(sim: RunningSimulator) -> int:
    return sum(
        1 for r in sim.sim.requests if r.body["messages"][0]["content"] == SUMMARIZER_SYSTEM_PROMPT
    )


def test_a_reasoning_models_thinking_does_not_trigger_a_compaction(
    sdk: Any, proxy_factory: Any
) -> None:
    """A reasoning model bills its thinking in the completion (7,000 tokens a turn here), which
    the history never holds: counted whole with the prompt, a history at a third of the
    window was compacted (a summary paid for, the user's pasted task summarized, the cache
    lost)."""
    with run_simulator(SimConfig(context_window=16_000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 4},
            "models": {MODEL: {"context_window": 16_000}},
        }
        proxy = proxy_factory(small.api_base, config)
        client = sdk(proxy.base_url)
        script = orjson.dumps({"content": "Point noted.", "reasoning_tokens": 7000}).decode()
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": "You review designs."},
            {"role": "user", "content": "Review this design: " + "The cache layer. " * 1000},
        ]
        for turn in range(8):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=msgs,  # type: ignore[arg-type]
                extra_headers={"X-Session-Id": "thinking", "X-Sim-Script": script},
            )
            reply = raw.parse()
            assert reply.usage is not None and reply.usage.completion_tokens > 7000
            assert raw.headers.get("x-cachegate-compacted") is None, turn
            msgs += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": f"And point {turn}?"},
            ]
        assert _summary_calls(small) == 0
        assert compaction.estimate_tokens(msgs) < 16_000 * 0.75 / 2  # (a third of the window)


def _task_then_rounds(outputs: list[int]) -> list[dict[str, Any]]:
    """A system prompt, a short task, then one tool round per entry of ``outputs`` (its output
    three quarters of that many characters)."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Refactor module foo; run the tests after each change."},
    ]
    for i, size in enumerate(outputs):
        call = {"id": f"call_{i}", "type": "function"}
        call["function"] = {"name": "run", "arguments": orjson.dumps({"cmd": f"step {i}"}).decode()}
        msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        output = f"result {i}.0 " + f"x{i} " * (size // 4)
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": output})
    return msgs


def test_a_retry_keeps_a_short_task_verbatim_where_it_fits_as_the_trigger_does(
    sdk: Any, proxy_factory: Any
) -> None:
    """A model left at the default window in front of an 8k local one: the provider refuses, and
    the retry's compaction summarized the one-line task though it fitted beside the latest round
    (the trigger's compaction of the same history keeps it). The agent lost its task's words."""
    with run_simulator(SimConfig(context_window=8000)) as small:
        config = {"compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 4}}
        proxy = proxy_factory(small.api_base, config)
        msgs = _task_then_rounds([2000] * 10 + [14000])
        small.sim.enqueue([parse_script("Ran steps 0-9; all green.")])
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL, messages=msgs, extra_headers={"X-Session-Id": "retry-task"}
        )
        assert_refused_then_compacted(raw, small)
        retried = small.sim.requests[-1].body["messages"]
        assert retried[:2] == msgs[:2]  # the system prompt, then the task as the user wrote it
        assert retried[-2:] == msgs[-2:]
        assert SUMMARY_MARKER in retried[2]["content"]


def test_a_compaction_on_the_trigger_leaves_room_for_the_completion_asked_for(
    sdk: Any, proxy_factory: Any
) -> None:
    """``max_completion_tokens`` of 3,400 on an 8k window: the compaction made on the trigger
    was planned against the whole window, went out over it with the completion, was refused, and
    a second summary was paid for the retry (which also gave up the task)."""
    with run_simulator(SimConfig(context_window=8000)) as small:
        config = {
            "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 4},
            "models": {MODEL: {"context_window": 8000}},
        }
        proxy = proxy_factory(small.api_base, config)
        msgs = _task_then_rounds([9000] * 6)
        small.sim.enqueue([parse_script("Ran steps 0-3; all green.")])
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model=MODEL,
            messages=msgs,
            max_completion_tokens=3400,
            extra_headers={"X-Session-Id": "room-on-trigger"},
        )
        assert raw.http_response.status_code == 200
        assert raw.headers["x-cachegate-compacted"] == "1"
        assert [r.status for r in small.sim.requests] == [200, 200]  # the summary, the turn
        sent = small.sim.requests[-1]
        assert sent.usage is not None and sent.usage["prompt_tokens"] + 3400 <= 8000
        assert sent.body["messages"][:2] == msgs[:2] and sent.body["messages"][-2:] == msgs[-2:]


def _code_round(turn: int, tag: str) -> list[dict[str, Any]]:
    """A tool round whose output is code, which the provider counts at ~1.4 times cachegate's
    estimate of 4 bytes a token."""
    call_id = f"call_{tag}{turn}"
    code = "".join(f"def f{turn}_{i}(x): return x*{i} + {turn}\n" for i in range(40))[:1200]
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "read_file", "arguments": f'{{"path": "f{turn}.py"}}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": code},
    ]


def _main_prompts(sim: RunningSimulator, opening: str) -> list[tuple[int, int]]:
    """(status, prompt tokens) of each request of the conversation that opens with
    ``opening`` (not a summary call), in order."""
    out = []
    for r in sim.sim.requests:
        messages = r.body.get("messages") if isinstance(r.body, dict) else None
        if not messages or len(messages) < 2 or opening not in str(messages[1].get("content")):
            continue
        prompt = (r.usage or {}).get("prompt_tokens", 0)
        out.append((r.status or 0, prompt))
    return out


@pytest.mark.parametrize("subagents", [0, 2])
def test_the_trigger_keeps_a_conversations_own_count_while_its_sub_agents_are_answered(
    sdk: Any, proxy_factory: Any, subagents: int
) -> None:
    """The trigger counts a history with the provider's numbers for the request it carries on.
    A session kept one such count, the latest answer's: with sub-agents (or title requests)
    answered between the main agent's turns it was always another conversation's, the trigger
    fell back to cachegate's estimate (which under-counts code 1.4 times), and the main
    agent's history went out at up to 97% of the window before it was compacted, or over it and
    refused."""
    window = 8000
    config = {
        "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 8},
        "models": {MODEL: {"context_window": window}},
    }
    system = {"role": "system", "content": "You are a coding agent."}
    opening = "Refactor the parser module and make the tests pass."
    main = [system, {"role": "user", "content": opening}]
    subs = [
        [system, {"role": "user", "content": f"Sub-task {j}: find the callers of parse()."}]
        for j in range(subagents)
    ]
    with run_simulator(SimConfig(context_window=window)) as sim:
        client = sdk(proxy_factory(sim.api_base, config).base_url)
        headers = {"X-Session-Id": "agent-and-subagents"}
        for turn in range(26):
            client.chat.completions.create(model=MODEL, messages=main, extra_headers=headers)
            main += _code_round(turn, "m")
            for j, sub in enumerate(subs):
                client.chat.completions.create(model=MODEL, messages=sub, extra_headers=headers)
                sub += _code_round(turn, f"s{j}_")
        prompts = _main_prompts(sim, opening)
    assert len(prompts) >= 26
    assert all(status == 200 for status, _ in prompts), prompts  # (none refused as too long)
    largest = max(prompt for _, prompt in prompts)
    assert largest <= 0.8 * window, (largest, prompts)  # (at the trigger, 75%, or just past it)


def test_the_trigger_leaves_room_for_the_completion_a_request_asks_for(
    sdk: Any, proxy_factory: Any
) -> None:
    """The trigger compared the prompt with ``trigger_percent`` of the window alone: with a
    ``max_completion_tokens`` of more than a quarter of it (a reasoning model's, a local
    server's 4,096 in an 8k window), each history past the window less the completion was
    refused by the provider and compacted only on the retry (where the refusal's wording is
    known: else the client had the 400)."""
    window = 8000
    config = {
        "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 8},
        "models": {MODEL: {"context_window": window}},
    }
    opening = "Refactor the parser module and make the tests pass."
    main = [{"role": "system", "content": "You are a coding agent."}]
    main += [{"role": "user", "content": opening}]
    with run_simulator(SimConfig(context_window=window)) as sim:
        client = sdk(proxy_factory(sim.api_base, config).base_url)
        for turn in range(24):
            client.chat.completions.create(
                model=MODEL,
                messages=main,
                max_completion_tokens=3000,
                extra_headers={"X-Session-Id": "long-answers"},
            )
            main += _code_round(turn, "m")
        prompts = _main_prompts(sim, opening)
    refused = [prompt for status, prompt in prompts if status != 200]
    assert len(prompts) == 24 and not refused, prompts


def test_a_retry_of_a_compacted_request_the_provider_failed_is_no_cache_waste(
    sdk: Any, proxy_factory: Any
) -> None:
    """A compaction's first request misses the cache, as expected. Refused with a 500, it was
    sent again by the SDK with the same compaction, and that retry's miss (the provider had
    cached none of it) was counted as waste from a rewrite of a message that had not changed
    (``old ""``, ``new ""``: 1,712 tokens)."""
    window = 8000
    config = {
        "compaction": {"enabled": True, "trigger_percent": 75, "keep_recent": 8},
        "models": {MODEL: {"context_window": window}},
    }
    messages = [{"role": "system", "content": "You are a coding agent."}]
    messages += [{"role": "user", "content": "Refactor the parser module."}]
    headers = {"X-Session-Id": "retried-compaction"}
    with run_simulator(SimConfig(context_window=window)) as sim:
        proxy = proxy_factory(sim.api_base, config)
        client = sdk(proxy.base_url, max_retries=2)
        for turn in range(14):
            if turn == 12:  # (the turn the history reaches the trigger)
                sim.sim.enqueue([parse_script("TASK: refactor."), parse_script({"fault": "500"})])
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, extra_headers=headers
            )
            assert raw.http_response.status_code == 200
            if turn == 12:
                assert raw.headers.get("x-cachegate-compacted") == "1"
                assert [r.status for r in sim.sim.requests[-3:]] == [200, 500, 200]
            messages += _code_round(turn, "r")
        proxy.settle()
    responses = [
        e
        for e in read_events(proxy.log_dir / "retried-compaction.jsonl").events
        if e["type"] == "response"
    ]
    retried, later = responses[-2:]
    assert retried["status"] == 200 and not retried["cache"]["waste"], retried["cache"]
    waste = {"model": MODEL, "cause": "prefix_rewrite"}
    assert proxy.metric("cachegate_cache_waste_tokens_total", waste) == 0
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "messages"}) == 0
    # the next turn, the provider having cached the compacted history, is compared as ever
    assert later["cache"]["expected"] > 0 and later["cache"]["read"] > 0


def _cleared(content: str) -> str:
    return "[Old tool result content cleared]"


def _trimmed(content: str) -> str:
    return content[:100] + "\n... [output truncated]"


@pytest.mark.parametrize("cut", [_cleared, _trimmed])
def test_old_tool_outputs_cleared_under_the_summary_keep_the_compaction(
    sim: RunningSimulator, sdk: Any, tmp_path: Path, cut: Callable[[str], str]
) -> None:
    """An agent that clears old tool outputs in place (opencode's pruning, every turn past a
    budget) changes messages the summary covers, none of which reaches the provider: each
    such turn undid the compaction and paid for a new summary, its cache lost (a summary call
    of ~4,400 tokens every turn). The summary is carried to the edited history, the forwarded
    body the same, the provider's cache read; its log line lets a restart take it up."""
    from tests.conftest import run_proxy

    logs = tmp_path / "logs"
    msgs = history(18)
    headers = {"X-Session-Id": "pruning"}
    sim.sim.enqueue([parse_script("TASK: handle CRLF. DONE: cases 0-13 pass. LEFT: 14-17.")])
    with run_proxy(sim.api_base, logs, CONFIG) as proxy:
        client = sdk(proxy.base_url)
        client.chat.completions.create(model=MODEL, messages=msgs, extra_headers=headers)
        first = sim.sim.requests[-1].body["messages"]
        assert first[1]["content"].startswith(SUMMARY_MARKER)
        covered = compacted_events(proxy)[0]["covered"]
        pruned = [
            {**m, "content": cut(m["content"])}
            if m.get("role") == "tool" and i < covered - 4
            else m
            for i, m in enumerate(msgs)
        ]
        pruned += [
            {"role": "assistant", "content": "Cases 14-17 next."},
            {"role": "user", "content": "Go on."},
        ]
        sent = len(sim.sim.requests)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=pruned, extra_headers=headers
        )
        assert len(sim.sim.requests) == sent + 1  # no summary call
        assert raw.headers["x-cachegate-compacted"] == "1"
        forwarded = sim.sim.requests[-1].body["messages"]
        assert forwarded[: len(first)] == first  # the provider's cache holds
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens >= 1024
        events = compacted_events(proxy)
        assert [e["source"] for e in events] == ["model", "carried"]
        assert events[1]["summary"] == events[0]["summary"] and events[1]["made"] == "model"
        assert (
            proxy.metric("cachegate_compactions_total", {"model": MODEL, "result": "reused"}) == 1
        )
        # a history that puts a message in under the summary is another: not given it (this
        # one, its outputs cleared, is under the trigger: sent as it is)
        inserted = [*pruned[:4], {"role": "user", "content": "(note)"}, *pruned[4:]]
        client.chat.completions.create(model=MODEL, messages=inserted, extra_headers=headers)
        assert sim.sim.requests[-1].body["messages"] == inserted
    with run_proxy(sim.api_base, logs, CONFIG) as after:  # a restart takes the carried one up
        sent = len(sim.sim.requests)
        more = [
            *pruned,
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "Next."},
        ]
        sdk(after.base_url).chat.completions.create(
            model=MODEL, messages=more, extra_headers=headers
        )
        assert len(sim.sim.requests) == sent + 1
        assert sim.sim.requests[-1].body["messages"][: len(first)] == first


def test_outputs_cleared_a_second_time_carry_the_latest_summary_not_an_older_one(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """opencode clears old tool outputs again and again. After a second clear, the older
    compaction, all of whose outputs the first clear had cleared, still matched its prefix and
    was reused: the newer summary, which covered 8 messages more, was lost, those rounds sent
    verbatim again, and the next summary rolled the older one. The one used last is carried."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    client = sdk(proxy.base_url)
    headers = {"X-Session-Id": "pruning-twice"}
    messages = history(0)

    def clear() -> None:  # all tool outputs but the latest three
        tools = [i for i, m in enumerate(messages) if m.get("role") == "tool"]
        for i in tools[:-3]:
            messages[i] = {**messages[i], "content": _cleared(messages[i]["content"])}

    for turn in range(18):
        if turn in (11, 17):  # (at 11 every output the compaction made at 9 covers)
            clear()
        sent = len(sim.sim.requests)
        client.chat.completions.create(model=MODEL, messages=messages, extra_headers=headers)
        if turn == 17:
            assert len(sim.sim.requests) == sent + 1  # no summary call
            count = len(messages)
        messages += _code_round(turn, "p")
    events = compacted_events(proxy)
    made = [e for e in events if e["source"] == "model"]
    assert len(made) >= 2 and made[-1]["covered"] > made[-2]["covered"]
    assert [e["source"] for e in events].count("carried") == 2
    second = events[-1]
    assert second["source"] == "carried" and second["exchange"] == 18
    assert second["covered"] == made[-1]["covered"] and second["summary"] == made[-1]["summary"]
    forwarded = sim.sim.requests[-1].body["messages"]
    assert forwarded[1]["content"] == made[-1]["summary"]  # (not the older one's)
    # the system prompt, the summary and what it does not cover (27 messages, not 12, before)
    assert len(forwarded) == 2 + count - made[-1]["covered"] == 12


def test_tool_outputs_under_the_summary_replaced_by_other_texts_do_not_keep_it(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """Outputs under the summary replaced by other, shorter texts (a result corrected, a
    sub-agent's own outputs under the same calls) are no cut: the summary, which says what the
    old ones said, would contradict them. It was carried to such a history."""
    proxy = proxy_factory(sim.api_base, CONFIG)
    client = sdk(proxy.base_url)
    msgs = history(18)
    headers = {"X-Session-Id": "corrected"}
    sim.sim.enqueue([parse_script("TASK: handle CRLF. DONE: cases 0-13 pass. LEFT: 14-17.")])
    client.chat.completions.create(model=MODEL, messages=msgs, extra_headers=headers)
    assert sim.sim.requests[-1].body["messages"][1]["content"].startswith(SUMMARY_MARKER)
    other = [
        {**m, "content": f"FAILED: exit 1 ({i})"} if m.get("role") == "tool" else m
        for i, m in enumerate(msgs)
    ]
    other += [{"role": "assistant", "content": "Failing."}, {"role": "user", "content": "Fix."}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=other, extra_headers=headers
    )
    assert "x-cachegate-compacted" not in raw.headers  # (under the trigger now: sent as it is)
    assert sim.sim.requests[-1].body["messages"] == other


_OLD_OUTPUT = "".join(f"line {i}: some output text of the tool\n" for i in range(150))


@pytest.mark.parametrize(
    ("text", "cut"),
    [
        ("[Old tool result content cleared]", True),  # opencode's
        (_OLD_OUTPUT[:100] + "\n... [output truncated]", True),
        (  # OpenClaw's soft trim: the start and the end kept, a note after them
            _OLD_OUTPUT[:1500]
            + "\n...\n"
            + _OLD_OUTPUT[-1500:]
            + "\n\n[Tool result trimmed: kept first 1500 chars and last 1500 chars of 5940 chars.]",
            True,
        ),
        (_OLD_OUTPUT[:300] + "\n...\n" + _OLD_OUTPUT[-300:], True),
        (_OLD_OUTPUT[:1000] + "\n[4000 chars truncated]\n" + _OLD_OUTPUT[-1000:], True),
        (_OLD_OUTPUT[:500] + "\n[... omitted 80 of 150 lines ...]\n" + _OLD_OUTPUT[-500:], True),
        (_OLD_OUTPUT[:300] + "\n... (120 more lines)", True),
        ("[1, 2, 3]", False),  # (a result in brackets that says no cut)
        ("[executed successfully]", False),
        ("(no output)", False),
        ("<none>", False),
        (_OLD_OUTPUT[:100] + "Compiling 3 files...\nBuild finished in 2.1s.\n", False),
        (_OLD_OUTPUT[:100] + "OK: 100 tests passed\n\n[Process exited with code 0]", False),
        ("FAILED: 3 files removed (3)", False),  # (a word of a placeholder's in a result)
        ("1 failed: tests/test_compactor.py::case3", False),
        ("No hidden files found.", False),
        (_OLD_OUTPUT[:70] + " -- rerun: FAILED case3 (exit 1)", False),  # (its start, then another)
        (_OLD_OUTPUT + "more", False),  # (longer: no cut)
    ],
)
def test_a_cut_tool_output_is_told_from_another_text(text: str, cut: bool) -> None:
    """The outputs a compaction is carried over (``_pruned``): a note in brackets that says a
    cut, or the old text's start (and end) kept with nothing but the mark of the cut; a result
    in brackets (a JSON list, ``(no output)``), one that merely holds a word placeholders use
    (removed, compactor, hidden), or one that keeps the old start and goes on otherwise, is
    another text, which the summary would contradict."""
    from proxy.compactor import _cut_text

    assert _cut_text(text, _OLD_OUTPUT) is cut
