"""Prompt-cache accounting end to end: the openai SDK → cachegate → the simulator's prefix cache.

Waste figures are derived from what the simulator itself reported (its ``prompt_tokens`` and cache
reads), with the rule of issue 6: ``expected = min(previous prompt, this prompt)`` (less, after a
rewrite, what the previous request sent that this one no longer holds, as cachegate estimates
it), ``waste = expected - cache_read`` when above the 1024-token noise floor.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.prefix import fingerprint
from proxy.sessions import CONVERSATIONS_KEPT
from proxy.simulator import RunningSimulator, SimConfig, run_simulator
from proxy.simulator.reply import parse_script
from proxy.simulator.tokens import message_tokens
from tests.e2e_support import (
    FILE_TEXT,
    PYTEST_OUTPUT,
    SYSTEM_PROMPT,
    TOOLS,
    asgi_body,
    asgi_lifespan,
    chat,
    events,
    make_client,
    run_cli,
    run_no_cache_upstream,
)

NOISE_FLOOR = 1024
# Configured prices (USD per 1M tokens) the cost assertions are computed from by hand.
PRICES: dict[str, dict[str, float]] = {
    "gpt-4o": {
        "price_input": 2.0,
        "price_cached_input": 0.5,
        "price_cache_write": 0.0,
        "price_output": 8.0,
    },
    "deepseek-chat": {
        "price_input": 0.27,
        "price_cached_input": 0.07,
        "price_cache_write": 0.0,
        "price_output": 1.1,
    },
    "claude-sonnet-4-5": {
        "price_input": 3.0,
        "price_cached_input": 0.3,
        "price_cache_write": 3.75,
        "price_output": 15.0,
    },
}


def config(ttl_s: float = 300.0) -> dict[str, Any]:
    return {"models": {name: {**p, "cache_ttl_s": ttl_s} for name, p in PRICES.items()}}


def flush(proxy: Any) -> None:
    proxy.settle()


def cache_read(usage: dict[str, Any]) -> int:
    """The cache read of a simulator usage object, whatever its dialect."""
    details = usage.get("prompt_tokens_details") or {}
    return int(
        details.get("cached_tokens")
        or usage.get("prompt_cache_hit_tokens")
        or usage.get("cache_read_input_tokens")
        or 0
    )


def expected_read(prev: dict[str, Any], this: dict[str, Any], dropped: int = 0) -> int:
    """What cachegate expects read: what the previous request sent, less what this one no
    longer holds (``dropped``, estimated, after a rewrite), of this one's prompt."""
    return min(prev["prompt_tokens"] - dropped, this["prompt_tokens"])


def expected_waste(prev: dict[str, Any] | None, this: dict[str, Any], dropped: int = 0) -> int:
    if prev is None:
        return 0
    shortfall = expected_read(prev, this, dropped) - cache_read(this)
    return shortfall if shortfall > NOISE_FLOOR else 0


def cut_tokens(prev: dict[str, Any], this: dict[str, Any], prompt: int) -> int:
    """The tokens of ``prev``'s ``prompt`` that ``this`` body no longer holds, as cachegate
    estimates them (its share of ``prev`` by the compaction estimate)."""
    from proxy.observers import _dropped_tokens

    return _dropped_tokens(fingerprint(prev), fingerprint(this), prompt)


def hand_cost(usage: dict[str, Any], prices: dict[str, float]) -> tuple[float, float]:
    """(actual, uncached) USD of one exchange from the provider's own usage object."""
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    read = cache_read(usage)
    write = int(usage.get("cache_creation_input_tokens") or 0)
    write_price = prices["price_cache_write"] or prices["price_input"]
    actual = (
        (prompt - read - write) * prices["price_input"]
        + read * prices["price_cached_input"]
        + write * write_price
        + completion * prices["price_output"]
    ) / 1e6
    uncached = (prompt * prices["price_input"] + completion * prices["price_output"]) / 1e6
    return actual, uncached


# --- the reference scenario -------------------------------------------------------------------


@pytest.fixture
def sim() -> Iterator[RunningSimulator]:
    with run_simulator(SimConfig(cache_ttl_s=300)) as running:
        yield running


@pytest.mark.parametrize(
    ("route", "edit"), [("chat", "system"), ("chat", "message"), ("responses", "system")]
)
def test_a_request_still_streaming_keeps_the_history_warm_for_the_next_turns_idle_time(
    sim: RunningSimulator, proxy_factory: Any, route: str, edit: str
) -> None:
    """A side request over the history (a sub-agent forked from it, a summary or title
    request) whose answer still streams when the agent's next turn, a rewrite, is answered:
    its prefixes were stamped only once it was answered itself, so the idle time ran from the
    turn before it, past the cache's life, and the rewrite's miss was called ``ttl_expired``
    (the same turns with the side request answered first: ``prefix_rewrite``). So on the
    Responses API too (Codex CLI's summary of its history, beside its next turn)."""
    import threading

    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "side"})
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Fix the failing handler."},
    ]

    def call(messages: list[dict[str, Any]], stall: bool = False) -> Any:
        faults = {"X-Sim-Fault": "stall", "X-Sim-Stall-S": "3"} if stall else {}
        if route == "chat":
            if stall:
                return client.chat.completions.with_streaming_response.create(
                    model="gpt-4o",
                    messages=messages,  # type: ignore[arg-type]
                    stream=True,
                    extra_headers=faults,
                )
            return chat(client, messages, stream=False)[0]
        items = [{"role": m["role"], "content": m["content"]} for m in messages[1:]]
        asked: dict[str, Any] = {
            "model": "gpt-4o",
            "instructions": messages[0]["content"],
            "input": items,
            "store": False,
        }
        if stall:
            return client.responses.with_streaming_response.create(
                stream=True, extra_headers=faults, **asked
            )
        return {"role": "assistant", "content": client.responses.create(**asked).output_text}

    for turn in range(3):
        reply = call(convo)
        convo += [reply, {"role": "user", "content": f"Go on ({turn}). " + FILE_TEXT}]
    sim.sim.advance(200)
    side = [*convo, {"role": "user", "content": "Summarize the conversation so far."}]
    opened = threading.Event()

    def summarize() -> None:
        with call(side, stall=True) as response:
            opened.set()
            for _ in response.iter_lines():
                pass

    streaming = threading.Thread(target=summarize)
    streaming.start()
    try:
        assert opened.wait(10)
        sim.sim.advance(200)  # 400 s after the last turn, 200 after the side request began
        edited = list(convo)
        if edit == "system":
            edited[0] = {"role": "system", "content": "Now: 12:00. " + SYSTEM_PROMPT}
        else:
            edited[3] = {"role": "user", "content": "Go on (0), edited. " + FILE_TEXT}
        call(edited)
        flush(proxy)
        lines = events(proxy.log_dir, "side", "response")
        rewrite = max(lines, key=lambda line: line["exchange"])  # (the side request's is 4th)
        assert rewrite["exchange"] == 5
        assert rewrite["cache"]["waste"] > 0
        assert rewrite["cache"]["cause"] == "prefix_rewrite", rewrite["cache"]
        where = {"system": "system", "message": "messages"}[edit]
        if route == "responses":
            where = "instructions"
        assert rewrite["divergence"]["location"] == where
    finally:
        streaming.join(15)
        client.close()  # (its pooled sockets, else closed by a later test's garbage collection)


def test_reference_scenario_waste_cause_location_and_cost(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "ref-1"})
    sim.sim.enqueue(
        [
            parse_script(
                {
                    "tool_calls": [
                        {"id": "call_read", "name": "read_file", "arguments": {"path": "app.py"}}
                    ]
                }
            ),
            parse_script("The bug is in handler_7."),
            parse_script(
                {"tool_calls": [{"id": "call_test", "name": "run", "arguments": {"cmd": "pytest"}}]}
            ),
            parse_script("All tests pass now."),
            parse_script("Changelog updated."),
            parse_script("Summary: fixed handler_7, tests green."),
        ]
    )
    system = {"role": "system", "content": SYSTEM_PROMPT}
    convo: list[dict[str, Any]] = [system, {"role": "user", "content": "Fix the failing handler."}]

    def turn(*follow: dict[str, Any], stream: bool) -> None:
        reply, headers = chat(client, convo, stream=stream, tools=TOOLS)
        assert headers["x-cachegate-session"] == "ref-1"
        convo.append(reply)
        convo.extend(follow)

    # 1 normal (first exchange: nothing to expect yet)
    turn({"role": "tool", "tool_call_id": "call_read", "content": FILE_TEXT}, stream=False)
    sim.sim.advance(20)
    # 2 normal
    turn({"role": "user", "content": "Go ahead and fix it."}, stream=True)
    sim.sim.advance(38 * 60)
    # 3 after a 38-minute idle: the provider's 300 s cache is gone
    turn({"role": "tool", "tool_call_id": "call_test", "content": PYTEST_OUTPUT}, stream=False)
    sim.sim.advance(20)
    # 4 normal
    turn({"role": "user", "content": "Now update the changelog."}, stream=True)
    sim.sim.advance(20)
    # 5 an old tool output trimmed by the client (messages[3] is the read_file result)
    assert convo[3]["role"] == "tool"
    convo[3] = {**convo[3], "content": FILE_TEXT[:1500] + "\n[... output trimmed ...]"}
    turn({"role": "user", "content": "Summarize what you did."}, stream=False)
    sim.sim.advance(20)
    # 6 the client puts the current time into its system prompt
    convo[0] = {"role": "system", "content": SYSTEM_PROMPT + "\nCurrent time: 2025-03-14T09:26:53Z"}
    chat(client, convo, stream=True, tools=TOOLS)

    usages = [r.usage for r in sim.sim.requests]
    assert len(usages) == 6 and all(u is not None for u in usages)
    assert all(u["prompt_tokens"] > NOISE_FLOOR for u in usages)
    # Round 5 cut the read_file output to its first 1,500 characters: what it cut, the previous
    # request's share of it by cachegate's estimate, could not be read.
    bodies = [r.body for r in sim.sim.requests]
    dropped = [0, 0, 0, 0, cut_tokens(bodies[3], bodies[4], usages[3]["prompt_tokens"]), 0]
    waste = [
        expected_waste(prev, this, gone)
        for prev, this, gone in zip([None, *usages[:-1]], usages, dropped, strict=True)
    ]
    # The scenario is what it claims to be: only rounds 3, 5 and 6 miss, and by more than noise.
    assert waste[0] == waste[1] == waste[3] == 0
    assert cache_read(usages[2]) == 0 and waste[2] == usages[1]["prompt_tokens"]
    assert waste[4] > NOISE_FLOOR and waste[5] > NOISE_FLOOR

    flush(proxy)
    responses = events(proxy.log_dir, "ref-1", "response")
    assert [r["exchange"] for r in responses] == [1, 2, 3, 4, 5, 6]
    caches = [r["cache"] for r in responses]
    for i, (c, u) in enumerate(zip(caches, usages, strict=True)):
        assert c["read"] == cache_read(u), i
        assert c["waste"] == waste[i], i
        if i:
            assert c["expected"] == expected_read(usages[i - 1], u, dropped[i]), i
    assert caches[0]["expected"] == 0
    assert [(c["cause"], c["location"]) for c in caches] == [
        (None, None),
        (None, None),
        ("ttl_expired", None),
        (None, None),
        ("prefix_rewrite", "messages[3].content"),
        ("prefix_rewrite", "system"),
    ]
    divergence = responses[5]["divergence"]
    assert divergence["location"] == "system"
    assert divergence["volatile"] is True
    assert divergence["volatile_kind"] == "timestamp"
    assert "2025-03-14T09:26:53Z" in divergence["new"]
    assert responses[4]["divergence"]["location"] == "messages"
    assert responses[4]["divergence"]["index"] == 3
    assert responses[4]["divergence"]["role"] == "tool"
    assert responses[4]["divergence"]["volatile"] is False
    assert "divergence" not in responses[2]  # an idle gap rewrites nothing

    # Cost per exchange, by hand from the configured prices.
    hand = [hand_cost(u, PRICES["gpt-4o"]) for u in usages]
    for r, (actual, uncached) in zip(responses, hand, strict=True):
        assert r["cost"]["actual"] == pytest.approx(actual, rel=1e-9)
        assert r["cost"]["uncached"] == pytest.approx(uncached, rel=1e-9)

    report = run_cli("sessions", "cost", "ref-1", "--log-dir", str(proxy.log_dir), "--json")
    assert report.code == 0, report.err
    cost = report.json()
    assert cost["waste_tokens"] == sum(waste)
    assert cost["waste_by_cause"] == {
        "ttl_expired": waste[2],
        "prefix_rewrite": waste[4] + waste[5],
    }
    assert cost["priced_exchanges"] == 6
    assert cost["actual"] == pytest.approx(sum(a for a, _ in hand), rel=1e-9)
    assert cost["uncached"] == pytest.approx(sum(u for _, u in hand), rel=1e-9)
    assert cost["saved"] == pytest.approx(sum(u - a for a, u in hand), rel=1e-9)

    text = run_cli("sessions", "cost", "ref-1", "--log-dir", str(proxy.log_dir))
    assert f"{waste[2]:,}" in text.out and "ttl_expired" in text.out
    show = run_cli("sessions", "show", "ref-1", "--log-dir", str(proxy.log_dir)).out
    assert f"{waste[4]:,} prefix_rewrite@messages[3].content" in show
    assert f"{waste[5]:,} prefix_rewrite@system" in show
    assert f"{waste[2]:,} ttl_expired" in show

    m = proxy.metric
    assert (
        m("cachegate_cache_waste_tokens_total", {"model": "gpt-4o", "cause": "ttl_expired"})
        == waste[2]
    )
    assert (
        m("cachegate_cache_waste_tokens_total", {"model": "gpt-4o", "cause": "prefix_rewrite"})
        == waste[4] + waste[5]
    )
    for cause in ("params_changed", "unexplained"):
        assert m("cachegate_cache_waste_tokens_total", {"model": "gpt-4o", "cause": cause}) == 0
    assert m("cachegate_prefix_rewrites_total", {"location": "messages"}) == 1
    assert m("cachegate_prefix_rewrites_total", {"location": "system"}) == 1
    assert m("cachegate_cost_usd_total", {"model": "gpt-4o", "kind": "actual"}) == pytest.approx(
        sum(a for a, _ in hand), rel=1e-9
    )
    assert m("cachegate_cost_usd_total", {"model": "gpt-4o", "kind": "uncached"}) == pytest.approx(
        sum(u for _, u in hand), rel=1e-9
    )
    assert m("cachegate_tokens_total", {"model": "gpt-4o", "kind": "cache_read"}) == sum(
        cache_read(u) for u in usages
    )


# --- no false waste ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_is_priced_at_the_processing_tier_it_was_billed_at(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any, stream: bool
) -> None:
    """OpenAI bills ``flex`` at half its prices and ``priority`` at more (gpt-5: twice), and
    says which it used in the answer's ``service_tier``: every answer was priced at the
    standard prices (a flex agent's cost read twice what it was, a priority one's half). The
    log's cost, ``sessions cost`` and the metrics now price each at its tier; a model of the
    user's own takes its ``priority_factor``."""
    config = {"models": {"house": {"price_input": 1.0, "price_output": 4.0, "priority_factor": 3}}}
    proxy = proxy_factory(sim.api_base, config)
    client = sdk(proxy.base_url, default_headers={"X-Session-Id": "tiers"})
    tiers = ("default", "flex", "priority")
    for model in ("gpt-5", "house"):
        for tier in tiers:
            messages = [{"role": "user", "content": f"{model} at {tier}: say something"}]
            answer = client.chat.completions.create(
                model=model,
                messages=messages,
                service_tier=tier,
                stream=stream,  # type: ignore[arg-type]
            )
            if stream:
                list(answer)  # type: ignore[arg-type]
    proxy.settle()
    lines = events(proxy.log_dir, "tiers", "response")
    assert len(lines) == 6
    for model, factors, line_group in (
        ("gpt-5", (1.0, 0.5, 2.0), lines[:3]),
        ("house", (1.0, 0.5, 3.0), lines[3:]),
    ):
        prices = (1.25, 10.0) if model == "gpt-5" else (1.0, 4.0)
        for tier, factor, line in zip(tiers, factors, line_group, strict=True):
            usage = line["usage"]
            standard = (usage["prompt"] * prices[0] + usage["completion"] * prices[1]) / 1e6
            assert line["cost"]["uncached"] == pytest.approx(standard * factor), (model, tier)
            assert line["cost"].get("tier") == (None if tier == "default" else tier)
    total = sum(line["cost"]["actual"] for line in lines[:3])
    metric = proxy.metric("cachegate_cost_usd_total", {"model": "gpt-5", "kind": "actual"})
    assert metric == pytest.approx(total)
    shown = run_cli("sessions", "cost", "tiers", "--log-dir", str(proxy.log_dir), "--json")
    assert shown.json()["actual"] == pytest.approx(sum(line["cost"]["actual"] for line in lines))


def test_a_table_that_sets_priority_factor_0_keeps_the_built_in_ratio(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """The example config's ``[models."gpt-4o"]`` says ``priority_factor = 0`` ("0: built in
    (gpt-4o 1.7)"): a table written so, for gpt-4o or a snapshot of it, replaced the built-in
    1.7 with 0, which priced every priority answer at 2 (18% over what OpenAI bills)."""
    config = {
        "models": {
            "gpt-4o": {"priority_factor": 0},
            "gpt-4o-2024-08-06": {"price_input": 2.5, "price_output": 10.0, "priority_factor": 0},
        }
    }
    proxy = proxy_factory(sim.api_base, config)
    client = sdk(proxy.base_url, default_headers={"X-Session-Id": "prio"})
    for model in ("gpt-4o", "gpt-4o-2024-08-06"):
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"{model} at priority: say something"}],
            service_tier="priority",
        )
    proxy.settle()
    lines = events(proxy.log_dir, "prio", "response")
    assert len(lines) == 2
    for line in lines:
        usage = line["usage"]
        standard = (usage["prompt"] * 2.5 + usage["completion"] * 10.0) / 1e6
        assert line["cost"]["tier"] == "priority"
        assert line["cost"]["uncached"] == pytest.approx(standard * 1.7)


@pytest.mark.parametrize("model", ["llama-3.3-70b", "openai/gpt-oss-120b"])
def test_a_tier_another_provider_names_is_not_priced_as_openais(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any, model: str
) -> None:
    """Groq names ``"service_tier": "flex"`` too, at its on-demand prices: a model that is not
    OpenAI's (and whose entry sets no ``priority_factor``) was priced at half. So too OpenAI's
    open-weight gpt-oss, which OpenAI does not serve (Groq's own flex examples use it): its
    ``gpt-`` name made it OpenAI's."""
    config = {"models": {model: {"price_input": 1.0, "price_output": 2.0}}}
    proxy = proxy_factory(sim.api_base, config)
    client = sdk(proxy.base_url, default_headers={"X-Session-Id": "groq"})
    for tier in ("default", "flex"):
        messages = [{"role": "user", "content": "say something"}]
        client.chat.completions.create(
            model=model,
            messages=messages,
            service_tier=tier,  # type: ignore[arg-type]
        )
    proxy.settle()
    standard, flex = events(proxy.log_dir, "groq", "response")
    assert flex["cost"] == standard["cost"] and "tier" not in flex["cost"]


def test_sub_agents_handed_the_users_request_word_for_word_are_no_rewrites(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A main agent's first turn, then sub-agents under prompts of their own, each given the
    user's request as it came, one session id and the same tools: each sub-agent's first turn
    was charged as a system rewrite of the turn before (~90% of its prompt wasted, where the
    provider could read nothing: its prompt differs from its first token). A first turn sent
    again under an edited prompt (the time at its top) is still a rewrite."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "fan"})
    task = {"role": "user", "content": "Fix the failing handler."}
    main = [{"role": "system", "content": SYSTEM_PROMPT}, task]
    chat(client, main, stream=False, tools=TOOLS)
    for i, role in enumerate(("an explorer", "a reviewer", "a test writer")):
        sim.sim.advance(5)
        rules = "\n".join(
            f"Rule {k} for {role}: check step {k * (i + 2)} first." for k in range(300)
        )
        prompt = f"You are {role} sub-agent.\n{rules}"
        chat(client, [{"role": "system", "content": prompt}, task], stream=True, tools=TOOLS)
    sim.sim.advance(5)
    main[0] = {"role": "system", "content": "Today is 2026-12-01.\n" + SYSTEM_PROMPT}
    chat(client, main, stream=False, tools=TOOLS)  # the main agent's turn, its prompt dated
    flush(proxy)
    responses = events(proxy.log_dir, "fan", "response")
    for sub in responses[1:4]:
        assert (sub["cache"]["cause"], sub["cache"]["waste"]) == (None, 0)
        assert "divergence" not in sub
    last = responses[4]
    assert (last["cache"]["cause"], last["divergence"]["location"]) == ("prefix_rewrite", "system")
    assert last["cache"]["waste"] > NOISE_FLOOR


def test_a_sub_agent_and_a_title_request_in_the_session_neither_waste_nor_hide_waste(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """One session id for a main agent, its sub-agent and a title request on a small model (as
    coding agents send them). Each request was compared with whichever finished last: the
    sub-agent's first request was charged the main agent's whole prompt as a system rewrite, the
    main agent's next, fully cached turn showed a divergence, and a real rewrite after the title
    request was compared with the title's 25 tokens and hidden."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "shared-1"})
    main: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Fix the failing handler."},
    ]

    def main_turn(follow: str, *, stream: bool) -> None:
        reply, _ = chat(client, main, stream=stream, tools=TOOLS)
        main.extend([reply, {"role": "user", "content": follow}])
        sim.sim.advance(20)

    main_turn("Go on.", stream=False)
    main_turn("And the tests?", stream=True)
    sub = [
        {"role": "system", "content": "You are a search sub-agent.\n" + FILE_TEXT},
        {"role": "user", "content": "Find where handler_7 is defined."},
    ]
    chat(client, sub, stream=True)  # 3: the sub-agent's first request
    sim.sim.advance(20)
    main_turn("Now the changelog.", stream=False)  # 4: the main agent again, all cached
    title = [
        {"role": "system", "content": "Write a five-word title for this conversation."},
        {"role": "user", "content": "Fix the failing handler."},
    ]
    chat(client, title, stream=False, model="gpt-4o-mini")  # 5
    sim.sim.advance(20)
    main[0] = {"role": "system", "content": "Today is 2026-12-01.\n" + SYSTEM_PROMPT}
    chat(client, main, stream=True, tools=TOOLS)  # 6: a real rewrite of the main agent's prompt
    flush(proxy)

    usages = [r.usage for r in sim.sim.requests]
    assert len(usages) == 6 and all(u is not None for u in usages)
    responses = events(proxy.log_dir, "shared-1", "response")
    caches = [r["cache"] for r in responses]
    # The sub-agent's and the title's first requests: nothing was expected of them.
    for i in (2, 4):
        assert caches[i]["expected"] == caches[i]["waste"] == 0, i
        assert "divergence" not in responses[i], i
    # The main agent after the sub-agent: compared with its own previous turn, all cached.
    assert "divergence" not in responses[3]
    assert caches[3]["read"] == cache_read(usages[3]) > NOISE_FLOOR
    assert caches[3]["expected"] == min(usages[1]["prompt_tokens"], usages[3]["prompt_tokens"])
    assert caches[3]["waste"] == 0
    # The rewrite after the title request: the main agent's turn 4 is its baseline.
    expected = expected_read(usages[3], usages[5])
    assert caches[5]["expected"] == expected
    assert caches[5]["waste"] == expected - cache_read(usages[5]) > NOISE_FLOOR
    assert (caches[5]["cause"], caches[5]["location"]) == ("prefix_rewrite", "system")
    assert responses[5]["divergence"]["volatile_kind"] == "date"
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "system"}) == 1
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "params"}) == 0


def test_a_rewind_to_an_earlier_turn_with_a_new_question_wastes_nothing(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The client goes back to after its first turn and asks something new: the provider read
    all the branch shared with what it had; the new question, never sent, was charged as
    thousands of tokens of waste at the place it replaced."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "rewind-1"})
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Read the handler. " + FILE_TEXT},
    ]
    for follow in ("Go on.", "And the tests?", "Now the changelog."):
        reply, _ = chat(client, convo, stream=False)
        convo += [reply, {"role": "user", "content": follow + " " + PYTEST_OUTPUT}]
        sim.sim.advance(20)
    branch = [*convo[:3], {"role": "user", "content": "Instead: " + FILE_TEXT[::-1]}]
    chat(client, branch, stream=True)
    flush(proxy)
    last = events(proxy.log_dir, "rewind-1", "response")[-1]["cache"]
    assert last["read"] > NOISE_FLOOR  # the shared turn was read
    assert (last["waste"], last["cause"]) == (0, None)
    assert last["expected"] < sim.sim.requests[-1].usage["prompt_tokens"] - NOISE_FLOOR


def test_cache_markers_moved_on_each_turn_keep_one_session_and_rewrite_nothing(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """An Anthropic-style client with no session header marks its latest message with
    ``cache_control`` each turn. Turn 1 went to one inferred session and turns 2 and 3 to
    another, and each turn counted a rewrite of the message that lost its marker."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url)
    marker = {"type": "ephemeral"}

    def marked(text: str) -> dict[str, Any]:
        return {
            "role": "user",
            "content": [{"type": "text", "text": text, "cache_control": marker}],
        }

    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        marked("Fix the failing handler."),
    ]
    sessions = []
    for i, follow in enumerate(("Go on.", "And the tests?", "Done?")):
        reply, headers = chat(client, convo, stream=i % 2 == 1, tools=TOOLS)
        sessions.append(headers["x-cachegate-session"])
        for message in convo[1:]:  # the client moves the marker to the new message
            if isinstance(message.get("content"), list):
                message["content"] = [{"type": "text", "text": message["content"][0]["text"]}]
        convo += [reply, marked(follow)]
        sim.sim.advance(20)
    flush(proxy)
    assert len(set(sessions)) == 1
    responses = events(proxy.log_dir, sessions[0], "response")
    assert len(responses) == 3
    assert not [r for r in responses if "divergence" in r]
    assert all(r["cache"]["waste"] == 0 for r in responses)
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "messages"}) == 0


def test_a_refused_request_does_not_move_the_baseline_of_its_retry(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A rewritten prompt refused with a 429, then retried as it was (the openai SDK does so by
    itself): the retry's miss is the rewrite's, not "unexplained" against the refused copy."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "retry-1"})
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Fix the failing handler."},
    ]
    reply, _ = chat(client, convo, stream=False, tools=TOOLS)
    convo += [reply, {"role": "user", "content": "Go on."}]
    sim.sim.advance(20)
    convo[0] = {"role": "system", "content": "Current time: 2026-12-01T10:00:00Z\n" + SYSTEM_PROMPT}
    with pytest.raises(openai.RateLimitError):
        chat(client, convo, stream=False, tools=TOOLS, extra_headers={"X-Sim-Fault": "429"})
    chat(client, convo, stream=True, tools=TOOLS)
    flush(proxy)
    responses = events(proxy.log_dir, "retry-1", "response")
    assert [r["status"] for r in responses] == [200, 429, 200]
    retried = responses[2]
    assert (retried["cache"]["cause"], retried["cache"]["location"]) == ("prefix_rewrite", "system")
    assert retried["cache"]["waste"] > NOISE_FLOOR
    assert retried["divergence"]["volatile_kind"] == "timestamp"


@pytest.mark.parametrize(
    ("forked", "change"),
    [(False, "system"), (False, "params"), (False, "tools"), (True, "system")],
    ids=["own-prompt", "own-prompt-params", "own-prompt-tools", "forked"],
)
def test_a_sub_agent_between_turns_decides_between_an_expiry_and_a_rewrite(
    sim: RunningSimulator, proxy_factory: Any, forked: bool, change: str
) -> None:
    """The main agent waits past the TTL while a sub-agent of its session works, then changes
    its prompt (the time in it), a parameter or its tools. A sub-agent under the same tools and
    parameters and a prompt of its own keeps only those warm: the main agent's prefix had
    expired either way (it read as a rewrite, then as one again for a parameter or a tool). One
    forked from the main agent's history keeps that history warm: the rewrite lost it (a fix
    of the first case read this one as an expiry)."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "idle-sub"})

    def prompt(minute: int) -> dict[str, Any]:
        return {"role": "system", "content": f"Time: 09:{minute:02d}.\n" + SYSTEM_PROMPT}

    main: list[dict[str, Any]] = [
        prompt(0),
        {"role": "user", "content": "Read the handlers.\n" + FILE_TEXT},
    ]
    reply, _ = chat(client, main, stream=False, tools=TOOLS)
    main += [reply, {"role": "user", "content": "Go on."}]
    reply, _ = chat(client, main, stream=False, tools=TOOLS)
    main += [reply, {"role": "user", "content": "Now fix them."}]
    sub: list[dict[str, Any]] = (
        [*main[:3], {"role": "user", "content": "Sub-task: find every caller of handler_7."}]
        if forked
        else [
            {"role": "system", "content": "You search the code. " + SYSTEM_PROMPT[::-1]},
            {"role": "user", "content": "Find every caller of handler_7."},
        ]
    )
    for _ in range(2):  # the sub-agent, while the main agent waits
        sim.sim.advance(190)
        reply, _ = chat(client, sub, stream=False, tools=TOOLS)
        sub += [reply, {"role": "user", "content": "And the next one?"}]
    sim.sim.advance(20)  # 400 s after the main agent's last request, 20 s after the sub-agent's
    extra: dict[str, Any] = {"tools": TOOLS}
    if change == "system":
        main[0] = prompt(7)
    elif change == "params":
        extra["tool_choice"] = "required"
    else:
        extra["tools"] = [*TOOLS, {**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "x"}}]
    chat(client, main, stream=False, **extra)
    flush(proxy)
    last = events(proxy.log_dir, "idle-sub", "response")[-1]
    assert last["divergence"]["location"] == change  # (the change is shown either way)
    assert last["cache"]["waste"] > NOISE_FLOOR
    cause = (last["cache"]["cause"], last["cache"]["location"])
    assert cause == (("prefix_rewrite", "system") if forked else ("ttl_expired", None))


def test_an_idle_gap_inside_openais_five_to_ten_minutes_is_named_as_the_expiry(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """With the default TTL of OpenAI's models (the top of their documented 5 to 10 minutes),
    an agent left 7 minutes whose provider had let the prefix go (the simulator's TTL is 300 s)
    got ``unexplained``: the idle time is the cause. The log, the metric and ``sessions show``
    say so."""
    models = {"gpt-4o": PRICES["gpt-4o"]}  # no cache_ttl_s: the built-in default
    proxy = proxy_factory(sim.api_base, {"models": models}, clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "idle-7"})
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Read the handlers.\n" + FILE_TEXT},
    ]
    for idle in (20, 7 * 60, 20):
        reply, _ = chat(client, convo, stream=True, tools=TOOLS)
        convo += [reply, {"role": "user", "content": "Go on."}]
        sim.sim.advance(idle)
    chat(client, convo, stream=False, tools=TOOLS)
    usages = [r.usage for r in sim.sim.requests]
    assert cache_read(usages[2]) == 0 < cache_read(usages[1])  # the provider's 300 s passed
    flush(proxy)
    caches = [r["cache"] for r in events(proxy.log_dir, "idle-7", "response")]
    assert [c["cause"] for c in caches] == [None, None, "ttl_expired", None]
    assert caches[2]["waste"] == expected_waste(usages[1], usages[2]) > NOISE_FLOOR
    labels = {"model": "gpt-4o", "cause": "ttl_expired"}
    assert proxy.metric("cachegate_cache_waste_tokens_total", labels) == caches[2]["waste"]
    show = run_cli("sessions", "show", "idle-7", "--log-dir", str(proxy.log_dir)).out
    assert f"{caches[2]['waste']:,} ttl_expired" in show


def test_a_paused_agent_whose_prefixes_another_agent_pushed_out_is_charged_its_expiry(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Two agents under one session id: while the first paused past the TTL, the second,
    its history of 400 short messages under a system prompt with the time in it, took a dozen
    turns whose prefixes, new every turn, pushed every one of the first's out of the session's
    map. The first's expiry was measured from the second's latest turn (100 s, not 700) and
    named ``unexplained``; with a history of 40 it was ``ttl_expired`` already."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=600), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "two-agents"})
    first: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Read the handlers.\n" + FILE_TEXT},
    ]
    reply, _ = chat(client, first, stream=False)
    first += [reply, {"role": "user", "content": "Go on."}]
    notes: list[dict[str, Any]] = []
    for i in range(200):
        notes += [{"role": "user", "content": f"note {i}"}, {"role": "assistant", "content": "ok"}]
    for turn in range(12):
        sim.sim.advance(50)
        clock = {"role": "system", "content": f"You keep notes. Time: 10:{turn:02d}:00"}
        chat(client, [clock, *notes, {"role": "user", "content": f"turn {turn}"}], stream=False)
    sim.sim.advance(100)  # (the first agent idle 700 s, past the 600 s TTL)
    chat(client, first, stream=False)
    assert cache_read(sim.sim.requests[-1].usage) == 0  # (the simulator's 300 s passed)
    flush(proxy)
    last = events(proxy.log_dir, "two-agents", "response")[-1]["cache"]
    assert (last["cause"], last["location"]) == ("ttl_expired", None)
    assert last["waste"] > NOISE_FLOOR


def test_long_warm_session_with_tool_rounds_wastes_nothing(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url)  # no explicit id: the session is inferred every turn
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Refactor the handlers, use tool as needed."},
    ]
    sessions = set()
    for i in range(24):
        calls = [
            {"name": "read_file", "arguments": {"path": f"src/mod_{i}.py"}},
            {"name": "run", "arguments": {"cmd": f"pytest -k case_{i}"}},
        ][: 1 + i % 2]  # one call, or two parallel ones
        sim.sim.enqueue([parse_script({"tool_calls": calls})])
        reply, headers = chat(client, convo, stream=i % 2 == 0, tools=TOOLS)
        sessions.add(headers["x-cachegate-session"])
        convo.append(reply)
        for call in reply["tool_calls"]:
            convo.append(
                {"role": "tool", "tool_call_id": call["id"], "content": f"ok {i}: " + "x " * 40}
            )
        sim.sim.advance(30)  # well inside the 300 s TTL
    reply, _ = chat(client, convo, stream=True, tools=TOOLS)
    assert len(sessions) == 1
    (sid,) = sessions
    flush(proxy)
    responses = events(proxy.log_dir, sid, "response")
    assert len(responses) == 25
    assert all(r["cache"]["waste"] == 0 for r in responses)
    assert all(r["cache"]["cause"] is None for r in responses)
    # Accounting was live: every later exchange expected (and got) cache reads.
    assert all(r["cache"]["expected"] > NOISE_FLOOR for r in responses[1:])
    assert all(r["cache"]["read"] > 0 for r in responses[1:])
    assert "divergence" not in str(responses)
    for cause in ("ttl_expired", "prefix_rewrite", "params_changed", "unexplained"):
        labels = {"model": "gpt-4o", "cause": cause}
        assert proxy.metric("cachegate_cache_waste_tokens_total", labels) == 0
    for location in ("system", "tools", "messages", "params"):
        assert proxy.metric("cachegate_prefix_rewrites_total", {"location": location}) == 0
    assert (
        run_cli("sessions", "cost", sid, "--log-dir", str(proxy.log_dir), "--json").json()[
            "waste_tokens"
        ]
        == 0
    )


def test_provider_without_cache_fields_is_never_charged_waste(proxy_factory: Any) -> None:
    with run_no_cache_upstream() as (upstream, base):
        proxy = proxy_factory(base, config(ttl_s=300))
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "nocache-1"})
        convo: list[dict[str, Any]] = [{"role": "user", "content": "start"}]
        for i in range(6):
            reply, _ = chat(client, convo, stream=i % 2 == 1)
            convo += [reply, {"role": "user", "content": f"next {i}"}]
        # An idle gap and a rewritten history on top: still nothing to charge.
        convo[0] = {"role": "user", "content": "start, rewritten"}
        chat(client, convo, stream=False)
        flush(proxy)
    responses = events(proxy.log_dir, "nocache-1", "response")
    assert len(responses) == 7
    assert [r["usage"]["prompt"] for r in responses] == [
        3000 + 50 * len(b["messages"]) for b in upstream.requests
    ]
    assert all(r["usage"]["reported_cache"] is False for r in responses)
    assert all(r["cache"]["expected"] == 0 and r["cache"]["waste"] == 0 for r in responses)
    assert all(r["cache"]["cause"] is None for r in responses)
    for cause in ("ttl_expired", "prefix_rewrite", "params_changed", "unexplained"):
        labels = {"model": "gpt-4o", "cause": cause}
        assert proxy.metric("cachegate_cache_waste_tokens_total", labels) == 0
    # The rewrite is still diagnosed (prefix diagnosis runs whatever the provider reports).
    assert responses[-1]["divergence"]["location"] == "messages"
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "messages"}) == 1
    # Without cache fields, cost is plain input + output, actual equal to uncached.
    prices = PRICES["gpt-4o"]
    for r in responses:
        plain = (r["usage"]["prompt"] * prices["price_input"] + 2 * prices["price_output"]) / 1e6
        assert r["cost"]["actual"] == pytest.approx(plain, rel=1e-9)
        assert r["cost"]["uncached"] == pytest.approx(plain, rel=1e-9)


# --- cost per usage dialect --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dialect", "model"),
    [
        ("openai", "gpt-4o"),
        ("deepseek", "deepseek-chat"),
        ("anthropic-compat", "claude-sonnet-4-5"),
    ],
)
def test_cost_matches_hand_computed_figures_for_each_usage_dialect(
    proxy_factory: Any, tmp_path: Path, dialect: str, model: str
) -> None:
    with run_simulator(SimConfig(dialect=dialect)) as sim:
        proxy = proxy_factory(sim.api_base, config(), clock=lambda: sim.sim.now)
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": f"cost-{dialect}"})
        convo: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "Explain the design. " * 60},
        ]
        for i in range(3):
            sent = convo
            if dialect == "anthropic-compat":  # Claude caches what is marked: the latest turn
                sent = [*convo[:-1], {**convo[-1], "cache_control": {"type": "ephemeral"}}]
            reply, _ = chat(client, sent, stream=i == 1, model=model, tools=TOOLS)
            convo += [reply, {"role": "user", "content": f"And part {i}? " * 20}]
        usages = [r.usage for r in sim.sim.requests]
        flush(proxy)
    responses = events(proxy.log_dir, f"cost-{dialect}", "response")
    prices = PRICES[model]
    hand = [hand_cost(u, prices) for u in usages]
    assert cache_read(usages[0]) == 0 and cache_read(usages[2]) > 0  # a miss, then hits
    if dialect == "anthropic-compat":
        assert usages[0]["cache_creation_input_tokens"] > 0  # the write price is exercised
    for r, u, (actual, uncached) in zip(responses, usages, hand, strict=True):
        assert r["usage"]["prompt"] == u["prompt_tokens"]
        assert r["usage"]["cache_read"] == cache_read(u)
        assert r["cost"]["actual"] == pytest.approx(actual, rel=1e-9)
        assert r["cost"]["uncached"] == pytest.approx(uncached, rel=1e-9)
        assert r["cache"]["waste"] == 0
    assert proxy.metric("cachegate_cost_usd_total", {"model": model, "kind": "actual"}) == (
        pytest.approx(sum(a for a, _ in hand), rel=1e-9)
    )
    assert proxy.metric("cachegate_cost_usd_total", {"model": model, "kind": "uncached"}) == (
        pytest.approx(sum(u for _, u in hand), rel=1e-9)
    )
    assert proxy.metric("cachegate_tokens_total", {"model": model, "kind": "cache_read"}) == sum(
        cache_read(u) for u in usages
    )
    report = run_cli(
        "sessions", "cost", f"cost-{dialect}", "--log-dir", str(proxy.log_dir), "--json"
    ).json()
    assert report["actual"] == pytest.approx(sum(a for a, _ in hand), rel=1e-9)
    assert report["saved"] == pytest.approx(sum(u - a for a, u in hand), rel=1e-9)
    assert report["saved"] > 0 or dialect == "anthropic-compat"


def test_a_title_request_on_the_main_model_neither_wastes_nor_takes_the_main_agents_place(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A title request on the same model as the main agent (the user's first message under a
    prompt of its own, no tools): it was charged as a tools rewrite, and the main agent's next
    turn, which rewrote its system prompt, was compared with the title's few tokens and
    reported as a tools rewrite too."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "title-1"})
    first = {"role": "user", "content": "Fix the failing handler. " + FILE_TEXT[:2000]}
    main: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}, first]
    for follow in ("Go on.", "And the tests?"):
        reply, _ = chat(client, main, stream=False, tools=TOOLS)
        main.extend([reply, {"role": "user", "content": follow}])
        sim.sim.advance(20)
    title = [{"role": "system", "content": "Write a five-word title."}, first]
    chat(client, title, stream=False)  # 3: the same model, no tools
    sim.sim.advance(20)
    main[0] = {"role": "system", "content": "Current time: 2026-12-01T10:00:00Z\n" + SYSTEM_PROMPT}
    chat(client, main, stream=True, tools=TOOLS)  # 4: a real rewrite of the main prompt
    flush(proxy)

    usages = [r.usage for r in sim.sim.requests]
    responses = events(proxy.log_dir, "title-1", "response")
    caches = [r["cache"] for r in responses]
    assert caches[2]["expected"] == caches[2]["waste"] == 0
    assert "divergence" not in responses[2]
    expected = expected_read(usages[1], usages[3])
    assert caches[3]["expected"] == expected > NOISE_FLOOR
    assert caches[3]["waste"] == expected - cache_read(usages[3]) > NOISE_FLOOR
    assert (caches[3]["cause"], caches[3]["location"]) == ("prefix_rewrite", "system")
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "tools"}) == 0
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "system"}) == 1


def test_two_agents_that_open_alike_without_session_ids_are_each_compared_with_their_own(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """B's first request, a prefix of A's history, took A's place as a rewind; A's next turn
    took it back, and B's second request was then compared with A's: B's own reply and tool
    output, which the provider had never seen, were charged as a rewrite."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url)
    opening = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Fix the failing tests in this repository."},
    ]
    a, b = list(opening), list(opening)
    sessions = set()

    def turn(convo: list[dict[str, Any]], output: str) -> None:
        reply, headers = chat(client, convo, stream=False, tools=TOOLS)
        sessions.add(headers["x-cachegate-session"])
        convo.extend([reply, {"role": "user", "content": output}])
        sim.sim.advance(10)

    turn(a, "A's output: " + FILE_TEXT[:3000])
    turn(a, "next")
    turn(b, "B's output: " + PYTEST_OUTPUT * 3)
    turn(a, "next again")
    turn(b, "next")
    turn(a, "and again")
    turn(b, "and again")
    flush(proxy)
    (session,) = sessions  # one inferred session: the collision this is about
    responses = events(proxy.log_dir, session, "response")
    assert len(responses) == 7
    for i, r in enumerate(responses):
        assert r["cache"]["waste"] == 0, (i, r["cache"], r.get("divergence"))
        assert "divergence" not in r, i


def test_a_loop_over_documents_in_the_system_prompt_wastes_nothing(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A batch script puts each document in the system prompt and asks the same question, with
    no session id: one session (the same first message), each request compared with the one
    before. Nothing of a document could be read by the next, which holds another: each was
    charged its whole previous prompt as a system rewrite, the session's waste ~100% of its
    input. Only what both share past the change (the question) was expected; a prompt that
    keeps its text and changes a line (the time) still loses all of it."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url)
    question = {"role": "user", "content": "Summarize the document in three bullet points."}
    sessions = set()
    for n in range(4):
        document = " ".join(f"doc{n} paragraph {i} says {i * n} things." for i in range(900))
        messages = [{"role": "system", "content": "Document:\n" + document}, question]
        _, headers = chat(client, messages, stream=False)
        sessions.add(headers["x-cachegate-session"])
        sim.sim.advance(5)
    flush(proxy)
    (session,) = sessions
    responses = events(proxy.log_dir, session, "response")
    assert [r["cache"]["waste"] for r in responses] == [0, 0, 0, 0]
    assert all(r["cache"]["expected"] < 100 for r in responses)
    # one prompt with the time at its top and the open file at its bottom: that loses it all
    # (measured by the start and end they share alone, it kept nearly nothing: no waste)
    proxy2 = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client2 = make_client(proxy2.base_url, default_headers={"X-Session-Id": "timed"})
    document = " ".join(f"paragraph {i} says {i} things." for i in range(900))
    for minute in range(3):
        text = f"Time: 10:0{minute}\nDocument:\n{document}\n<env>open: a{minute}.py</env>"
        system = {"role": "system", "content": text}
        chat(client2, [system, question], stream=False)
        sim.sim.advance(5)
    flush(proxy2)
    timed = events(proxy2.log_dir, "timed", "response")
    assert [r["cache"]["cause"] for r in timed] == [None, "prefix_rewrite", "prefix_rewrite"]
    assert all(r["cache"]["waste"] > 0.95 * r["usage"]["prompt"] for r in timed[1:])


def interrupted(
    sim: RunningSimulator, client: Any, proxy: Any, convo: list[Any], **kw: Any
) -> None:
    """A streamed turn the client leaves after its first bytes (Ctrl+C): no usage reported.
    (The answer stalls after its first chunks: a whole one, handed to the client's socket
    before it closed, would count as complete, as it should, on a busy machine.)"""
    sim.sim.enqueue([parse_script("A long answer " * 400)])
    stall = {"X-Sim-Fault": "stall", "X-Sim-Stall-S": "5"}
    with client.chat.completions.with_streaming_response.create(
        model="gpt-4o", messages=convo, stream=True, extra_headers=stall, **kw
    ) as response:
        next(response.iter_bytes())  # the first bytes, then Ctrl+C
    flush(proxy)


def test_a_request_the_client_left_mid_answer_still_refreshes_its_prefix(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Ctrl+C during an answer, then the user types on with the time in the system prompt: the
    provider had read the interrupted request's prompt, so its cache was alive, and the miss
    is the rewrite. It was reported as ttl_expired (counted from the turn before)."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "ctrl-c"})
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Fix the failing handler."},
    ]
    reply, _ = chat(client, convo, stream=False, tools=TOOLS)
    convo.extend([reply, {"role": "user", "content": "Go on. " + FILE_TEXT[:1000]}])
    sim.sim.advance(200)
    interrupted(sim, client, proxy, convo, tools=TOOLS)
    sim.sim.advance(200)  # 400 s after the first turn, 200 s after the interrupted one
    convo[0] = {"role": "system", "content": "Current time: 2026-12-01T10:00:00Z\n" + SYSTEM_PROMPT}
    convo.append({"role": "user", "content": "Sorry, carry on."})
    chat(client, convo, stream=False, tools=TOOLS)
    flush(proxy)
    responses = events(proxy.log_dir, "ctrl-c", "response")
    assert [r["interrupted"] for r in responses] == [False, True, False]
    last = responses[-1]["cache"]
    assert last["waste"] > NOISE_FLOOR
    assert (last["cause"], last["location"]) == ("prefix_rewrite", "system")


def test_a_long_paste_interrupted_then_replaced_is_not_taken_off_what_was_expected(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A turn pastes a long log and is interrupted (no usage), then the user replaces the paste
    and the time in the system prompt moves on: the provider had held the prompt before the
    paste, all of which was expected of the next turn. The interrupted request took the count
    of the one before it, and the paste's share came off that count, which never held it: the
    waste read a third of what it was (nothing, for a larger paste)."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "paste"})
    system = "Current time: 10:01\n" + SYSTEM_PROMPT + " Keep to the style." * 700
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "hi"},
    ]
    reply, _ = chat(client, convo, stream=False)
    log = "\n".join(f"2026-12-01 INFO worker {i} finished job {i * 7}" for i in range(900))
    convo += [reply, {"role": "user", "content": "Review this log:\n" + log}]
    sim.sim.advance(10)
    interrupted(sim, client, proxy, convo)
    sim.sim.advance(10)
    convo[0] = {"role": "system", "content": system.replace("10:01", "10:02")}
    convo[-1] = {"role": "user", "content": "Forget the log: what is 2 + 2?"}
    chat(client, convo, stream=False)
    flush(proxy)
    responses = events(proxy.log_dir, "paste", "response")
    assert [r["interrupted"] for r in responses] == [False, True, False]
    held = sim.sim.requests[0].usage["prompt_tokens"]  # (the prompt before the paste)
    last = responses[-1]["cache"]
    assert cache_read(sim.sim.requests[-1].usage) == 0  # (the time comes first)
    assert abs(last["expected"] - held) < 0.02 * held, (last, held)
    assert last["waste"] == last["expected"]


def test_a_lost_cache_after_an_interrupted_paste_is_not_the_replacements_doing(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A long conversation; a turn adds a much longer paste and is interrupted; the provider
    loses its cache (its clock moved, cachegate's did not); the next turn replaces the paste.
    Nothing of the long prefix before the paste was read: the loss's, not the edit's (the edit
    was charged it all: the prefix before it measured on the interrupted request's size, with
    the count of the one it continued, came out under the 4,096 tokens the rule asks)."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300))
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "lost-paste"})
    log = "\n".join(f"2026-12-05 INFO worker {i} finished job {i * 7}" for i in range(400))
    paste = "\n".join(f"2026-12-05 DEBUG shard {i} sent block {i * 31}" for i in range(2500))
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Review:\n" + log},
    ]
    for follow in ("More:\n" + log.replace("INFO", "WARN"), "A big one:\n" + paste):
        reply, _ = chat(client, convo, stream=False)
        convo += [reply, {"role": "user", "content": follow}]
    interrupted(sim, client, proxy, convo)
    sim.sim.advance(7200)  # the provider's cache is gone; cachegate saw a few ms
    convo[-1] = {"role": "user", "content": "Forget the big one: sum up the first two."}
    chat(client, convo, stream=False)
    flush(proxy)
    last = events(proxy.log_dir, "lost-paste", "response")[-1]
    assert cache_read(sim.sim.requests[-1].usage) == 0
    assert last["cache"]["waste"] > 5000
    assert (last["cache"]["cause"], last["cache"]["location"]) == ("unexplained", None)
    assert last["divergence"]["index"] == len(convo) - 1  # (the edit is logged still)


def test_a_long_paste_interrupted_then_kept_is_no_waste(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A turn pastes a pretty-printed JSON and is interrupted; the next turn keeps it and adds
    a long note. Nothing was lost: the provider read all it had (a count scaled by
    cachegate's estimate, four bytes a token, took the paste's white space for tokens and
    charged thousands of them as unexplained waste)."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "kept"})
    items = [{"id": i, "name": f"item{i}", "tags": ["a", "b"], "at": {"x": i}} for i in range(150)]
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "hi"},
    ]
    reply, _ = chat(client, convo, stream=False)
    convo += [reply, {"role": "user", "content": "Review:\n" + json.dumps(items, indent=4)}]
    interrupted(sim, client, proxy, convo)
    sim.sim.advance(10)
    convo.append({"role": "user", "content": "What I think of the items above. " * 200})
    chat(client, convo, stream=False)
    flush(proxy)
    last = events(proxy.log_dir, "kept", "response")[-1]["cache"]
    assert cache_read(sim.sim.requests[-1].usage) > NOISE_FLOOR
    assert (last["waste"], last["cause"]) == (0, None)


def test_a_rewind_interrupted_then_carried_on_is_not_expected_to_read_what_it_dropped(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The user rewinds past a long tool output and asks again, then interrupts the answer
    (no usage), then pastes something longer. The interrupted request borrowed the count of
    the one before the rewind, which held the dropped output: the next turn, longer than that
    count, was expected to read all of it, and showed the dropped output as waste."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "rewound"})
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Read the handler."},
    ]
    reply, _ = chat(client, convo, stream=False)
    convo += [reply, {"role": "user", "content": "Here it is:\n" + FILE_TEXT[:2000]}]
    sim.sim.advance(10)
    reply, _ = chat(client, convo, stream=False)
    kept = len(convo)
    dump = "\n".join(f"2026-12-05 DEBUG shard {i} sent block {i * 31}" for i in range(2500))
    convo += [reply, {"role": "user", "content": "And the full trace:\n" + dump}]
    sim.sim.advance(10)
    chat(client, convo, stream=False)  # (its count holds the trace)
    sim.sim.advance(10)
    del convo[kept:]  # the rewind: back to before the trace
    convo.append({"role": "user", "content": "Forget the trace: what does the handler do?"})
    interrupted(sim, client, proxy, convo)
    sim.sim.advance(10)
    convo.append({"role": "user", "content": "Sorry, here is the new trace:\n" + dump * 2})
    chat(client, convo, stream=False)
    flush(proxy)
    responses = events(proxy.log_dir, "rewound", "response")
    assert [r["interrupted"] for r in responses] == [False, False, False, True, False]
    read = cache_read(sim.sim.requests[-1].usage)
    assert read > NOISE_FLOOR  # (the provider read all the rewound request had)
    last = responses[-1]["cache"]
    assert (last["waste"], last["cause"]) == (0, None), (last, read)


def test_an_edit_interrupted_then_sent_again_after_the_ttl_is_expected_whole(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The user goes back to a long paste, fixes its heading (the turns after it dropped), and
    interrupts the answer; back after the cache's TTL, the request goes again. The provider had
    read the edited paste: all of it was lost to the expiry. The interrupted request's edit,
    measured against the next turn, which ends at the edited message, was taken for a branch
    and the whole paste for dropped: ~8,000 of 11,000 tokens of waste went unseen."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "edited"})
    paste = "\n".join(f"2026-12-05 DEBUG shard {i} sent block {i * 31}" for i in range(2000))
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Read the handler."},
    ]
    reply, _ = chat(client, convo, stream=False)
    convo += [reply, {"role": "user", "content": "Here is the log:\n" + paste}]
    for follow in ("Now fix it.", "And the tests."):
        sim.sim.advance(10)
        reply, _ = chat(client, convo, stream=False)
        convo += [reply, {"role": "user", "content": follow}]
    sim.sim.advance(10)
    chat(client, convo, stream=False)
    edited = [*convo[:3], {"role": "user", "content": "Here is the log (v2):\n" + paste}]
    interrupted(sim, client, proxy, edited)
    sim.sim.advance(400)  # past the TTL
    chat(client, edited, stream=False)
    flush(proxy)
    last = events(proxy.log_dir, "edited", "response")[-1]["cache"]
    prompt = sim.sim.requests[-1].usage["prompt_tokens"]
    assert cache_read(sim.sim.requests[-1].usage) == 0
    assert (last["cause"], last["waste"] > 0.95 * prompt) == ("ttl_expired", True), (last, prompt)


def _before_an_interruption(
    sim: RunningSimulator, client: Any, system: Callable[[int], dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Four turns, the second a long paste: the history and the paste."""
    text = "\n".join(f"2026-12-05 DEBUG shard {i} sent block {i * 31}" for i in range(2000))
    paste = {"role": "user", "content": "Here is the log:\n" + text}
    convo: list[dict[str, Any]] = [{"role": "user", "content": "Read:\n" + FILE_TEXT[:6000]}]
    for follow in (paste, {"role": "user", "content": "Now fix it."}, None):
        reply, _ = chat(client, [system(1), *convo], stream=False)
        convo.append(reply)
        if follow is not None:
            convo.append(follow)
        sim.sim.advance(10)
    return convo, paste


def test_a_paste_a_rewind_dropped_sent_again_after_the_interruption_is_no_waste(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Rewind to before a long paste, ask something else, Ctrl+C, then paste the same log
    again: the provider read all of the interrupted request (nothing lost), but the paste,
    sent again after it, was taken for held where the request it borrowed the count from had
    it: ~8,000 tokens of "unexplained" waste."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "repaste"})

    def system(minute: int) -> dict[str, Any]:
        return {"role": "system", "content": SYSTEM_PROMPT}

    convo, paste = _before_an_interruption(sim, client, system)
    asked = [*convo[:2], {"role": "user", "content": "Wait, first: which file is it in?"}]
    interrupted(sim, client, proxy, [system(1), *asked])
    sim.sim.advance(10)
    chat(
        client, [system(1), *asked, {"role": "assistant", "content": "(cut)"}, paste], stream=False
    )
    flush(proxy)
    last = events(proxy.log_dir, "repaste", "response")[-1]["cache"]
    usage = sim.sim.requests[-1].usage
    assert cache_read(usage) > NOISE_FLOOR and cache_read(usage) < usage["prompt_tokens"] / 2
    assert (last["waste"], last["cause"]) == (0, None), last


def test_an_edit_interrupted_then_carried_on_under_a_new_time_costs_all_it_read(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The time in the system prompt: rewind to a long paste and fix its heading, Ctrl+C, then
    go on a minute later. The new time lost the provider all it had read of the interrupted
    request, the edited paste included; the edit was taken off whole (a branch), as where the
    prompt had not changed, and two thirds of the rewrite's cost went unseen."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "timed-edit"})

    def system(minute: int) -> dict[str, Any]:
        return {"role": "system", "content": f"Current time: 10:{minute:02d}\n{SYSTEM_PROMPT}"}

    convo, paste = _before_an_interruption(sim, client, system)
    edited = [*convo[:2], {**paste, "content": paste["content"].replace("log:", "log (v2):")}]
    interrupted(sim, client, proxy, [system(1), *edited])
    sim.sim.advance(10)
    chat(client, [system(2), *edited, {"role": "user", "content": "go on"}], stream=False)
    flush(proxy)
    last = events(proxy.log_dir, "timed-edit", "response")[-1]["cache"]
    read_before = sim.sim.requests[-2].usage["prompt_tokens"]  # (the interrupted one's)
    assert cache_read(sim.sim.requests[-1].usage) == 0
    assert last["cause"] == "prefix_rewrite" and last["waste"] > 0.95 * read_before, last


def _tool_turn(client: Any, convo: list[dict[str, Any]], output: str, **kw: Any) -> None:
    """One agent step: the model's reply, then the tool's (or the user's) answer to it."""
    reply, _ = chat(client, convo, stream=False, **kw)
    convo.append(reply)
    calls = reply.get("tool_calls") or []
    if calls:
        convo.extend({"role": "tool", "tool_call_id": c["id"], "content": output} for c in calls)
    else:
        convo.append({"role": "user", "content": output})


def test_sub_agents_fanned_out_with_one_task_are_each_compared_with_their_own(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Three sub-agents sent the same first request before any second turn (the usual fan-out):
    each took the previous one's place, and the second and third agents' second turns were
    compared with the first agent's, their own replies and outputs charged as a rewrite."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "fan-out"})
    opening = [
        {"role": "system", "content": "You are a search sub-agent. " + SYSTEM_PROMPT},
        {"role": "user", "content": "Explore the code and report where handlers live."},
    ]
    subs = [list(opening) for _ in range(3)]
    for step in range(3):
        for k, sub in enumerate(subs):
            _tool_turn(client, sub, f"sub {k} step {step}: " + FILE_TEXT[:1500], tools=TOOLS)
            sim.sim.advance(2)
    flush(proxy)
    responses = events(proxy.log_dir, "fan-out", "response")
    assert len(responses) == 9
    assert [r["cache"]["waste"] for r in responses] == [0] * 9
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "messages"}) == 0


@pytest.mark.parametrize("prompt", ["its own", "the main agent's"])
def test_title_and_summary_requests_on_the_main_model_leave_the_main_agent_its_own(
    sim: RunningSimulator, proxy_factory: Any, prompt: str
) -> None:
    """A title request at the first turn was charged as a tools rewrite and took the main
    agent's place; a summary request later (the history and a request to sum it up, no tools)
    took it too, and the main agent's turn after a long pause was then counted against the
    summary request, or not at all. (Under the main agent's prompt, the summary, which
    changes only the tools, still took its place.)"""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "side"})
    first = {"role": "user", "content": "Fix the failing handler. Log:\n" + PYTEST_OUTPUT * 4}
    main: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}, first]
    _tool_turn(client, main, "output 0: " + FILE_TEXT[:2000], tools=TOOLS)
    title = [{"role": "system", "content": "Write a five-word title."}, first]
    chat(client, title, stream=False)  # the first turn's title: one message, no tools
    sim.sim.advance(5)
    for i in (1, 2):
        _tool_turn(client, main, f"output {i}: " + FILE_TEXT[:2000], tools=TOOLS)
        sim.sim.advance(5)
    own = prompt == "its own"
    summary = [
        {"role": "system", "content": "Summarize this coding session." if own else SYSTEM_PROMPT},
        *main[1:],
        {"role": "user", "content": "Summarize the session so far."},
    ]
    chat(client, summary, stream=False)  # the whole history, no tools
    sim.sim.advance(700)  # past the 300 s TTL
    _tool_turn(client, main, "output 3", tools=TOOLS)
    flush(proxy)
    responses = events(proxy.log_dir, "side", "response")
    caches = [r["cache"] for r in responses]
    assert len(caches) == 6
    # the title: another conversation, nothing expected of it
    assert caches[1]["expected"] == caches[1]["waste"] == 0
    # the summary request under its own prompt: the provider misses it all, and it reads as a
    # rewrite (it carries the history on); it does not take the main agent's place
    assert caches[4]["cause"] == "prefix_rewrite"
    for i in (2, 3):  # the main agent's turns: compared with its own, all cached
        assert caches[i]["waste"] == 0 and caches[i]["read"] > NOISE_FLOOR, i
    usages = [r.usage for r in sim.sim.requests]
    assert caches[5]["expected"] == usages[3]["prompt_tokens"]  # its own previous turn
    assert caches[5]["waste"] == caches[5]["expected"] - caches[5]["read"] > NOISE_FLOOR
    assert caches[5]["cause"] == "ttl_expired"
    assert "divergence" not in responses[5]  # (it carries that one on: it rewrote nothing)


def test_a_summary_on_a_small_model_with_the_main_prompt_leaves_the_main_agent_its_own(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A framework's summary request on a small model, with the agent's own prompt and tools,
    the history and a request to sum it up: it took the main agent's place, and the main
    agent's next turn, all of it read from the cache, was compared with it: a change of model
    in its log line and in the rewrites metric, and what the summary held past the turn's own
    history charged as ``params_changed`` (~2,800 tokens a turn in a review's run)."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "small-summary"})
    main: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Fix the failing handler. Log:\n" + PYTEST_OUTPUT * 4},
    ]
    for i in range(2):
        _tool_turn(client, main, f"output {i}: " + FILE_TEXT[:2000], tools=TOOLS)
        sim.sim.advance(5)
    summary = [*main, {"role": "user", "content": "Summarize the session so far."}]
    chat(client, summary, stream=False, model="gpt-4o-mini", tools=TOOLS)
    sim.sim.advance(5)
    for i in (2, 3):
        _tool_turn(client, main, f"output {i}: " + FILE_TEXT[:2000], tools=TOOLS)
        sim.sim.advance(5)
    flush(proxy)
    responses = events(proxy.log_dir, "small-summary", "response")
    assert [r["cache"]["cause"] for r in responses][2] == "params_changed"  # (its own miss)
    for i in (3, 4):  # the main agent's turns after it: compared with its own, all cached
        cache = responses[i]["cache"]
        assert cache["waste"] == 0 and cache["cause"] is None, (i, cache)
        assert cache["read"] > NOISE_FLOOR and "divergence" not in responses[i]
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "params"}) == 1


def test_retries_do_not_crowd_out_the_other_conversations_of_a_session(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A sub-agent that sends each step several times (an answer it rejected, best-of-N): each
    identical retry was kept as one more copy of its baseline, a session's worth of them pushed
    the main agent's out, and the main agent's miss after a long pause was not reported."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "retries"})
    main = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Fix the handler. " + FILE_TEXT[:2000]},
    ]
    _tool_turn(client, main, "output 0: " + FILE_TEXT[:2000], tools=TOOLS)
    sub = [
        {"role": "system", "content": "You check one file at a time."},
        {"role": "user", "content": "Check app.py."},
    ]
    for step in range(4):
        for _ in range(CONVERSATIONS_KEPT // 4 + 1):  # the same request, again and again
            chat(client, sub, stream=False, tools=TOOLS)
        sub += [
            {"role": "assistant", "content": f"Checked {step}."},
            {"role": "user", "content": "Next."},
        ]
        sim.sim.advance(100)  # 400 s in all: past the 300 s TTL
    _tool_turn(client, main, "output 1", tools=TOOLS)
    flush(proxy)
    last = events(proxy.log_dir, "retries", "response")[-1]["cache"]
    assert last["expected"] == sim.sim.requests[0].usage["prompt_tokens"]  # its own last turn
    assert (last["cause"], last["waste"]) == ("ttl_expired", last["expected"] - last["read"])


def test_a_dozen_sub_agents_taking_turns_in_one_session_are_each_judged_against_their_own(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Twelve sub-agents under one session id (one system prompt, a task each) taking turns:
    past eight conversations they pushed one another out, so every turn read as a new
    conversation (nothing expected, the misses after a pause past the TTL unreported), its
    request line was logged against another agent's turn, and its body was parsed whole."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "dozen"})
    agents = [
        [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Sub-agent {n}: check part {n}.\n" + FILE_TEXT},
        ]
        for n in range(12)
    ]
    for turn in range(4):
        if turn == 3:
            sim.sim.advance(400)  # past the 300 s TTL
        for n, convo in enumerate(agents):
            _tool_turn(client, convo, f"output {turn} of {n}:\n" + FILE_TEXT, tools=TOOLS)
        sim.sim.advance(5)
    flush(proxy)
    responses = events(proxy.log_dir, "dozen", "response")
    usages = [r.usage for r in sim.sim.requests]
    assert len(responses) == len(usages) == 48
    for i in range(12, 48):  # each compared with its own previous turn
        cache = responses[i]["cache"]
        assert cache["expected"] == usages[i - 12]["prompt_tokens"], i
        if i < 36:
            assert cache["waste"] == 0 and cache["read"] > NOISE_FLOOR, i
        else:
            assert cache["waste"] == cache["expected"] - cache["read"] > NOISE_FLOOR, i
            assert cache["cause"] == "ttl_expired", i
    requests = events(proxy.log_dir, "dozen", "request")
    for number, line in enumerate(requests[12:], start=13):
        assert line["base_exchange"] == number - 12, number  # its own agent's last turn
        assert line["base"] == len(sim.sim.requests[number - 13].body["messages"]), number
    # Every body large enough to keep (each agent's second on) but the first: the others'
    # second bodies are parsed from the end of the system prompt they share with it on.
    assert proxy.gateway.chat.spliced_parses == 12 * 3 - 1


def test_switching_a_chats_tools_off_is_still_its_conversation(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A chat whose user turns a search tool off (the tool gone, and its mention from the
    system prompt): the turn was taken for a side request, a new conversation, and its miss
    was not reported. (OpenAI renders the system prompt before the tools: the first change.)"""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "toggle"})
    search = [
        {"type": "function", "function": {"name": "web_search", "parameters": {"type": "object"}}}
    ]
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT + "\nYou can search the web."},
        {"role": "user", "content": "Explain this log:\n" + PYTEST_OUTPUT * 3},
    ]
    for follow in ("Go on.", "And then?"):
        reply, _ = chat(client, convo, stream=False, tools=search)
        convo += [reply, {"role": "user", "content": follow}]
        sim.sim.advance(10)
    convo[0] = {"role": "system", "content": SYSTEM_PROMPT}
    reply, _ = chat(client, convo, stream=False)  # search switched off: no tools
    convo += [reply, {"role": "user", "content": "Shorter, please."}]
    sim.sim.advance(10)
    reply, _ = chat(client, convo, stream=False)  # still off: it goes on from that one
    convo += [reply, {"role": "user", "content": "Now search for the fix."}]
    sim.sim.advance(10)
    convo[0] = {"role": "system", "content": SYSTEM_PROMPT + "\nYou can search the web."}
    chat(client, convo, stream=False, tools=search)  # on again: the provider still has that
    flush(proxy)
    responses = events(proxy.log_dir, "toggle", "response")
    off = responses[2]["cache"]
    assert off["waste"] == off["expected"] - off["read"] > NOISE_FLOOR
    assert (off["cause"], off["location"]) == ("prefix_rewrite", "system")
    # the next turn with search off goes on from it, the one with search on from the last
    # turn with it (each prefix still cached: no waste, nothing rewritten)
    usages = [r.usage for r in sim.sim.requests]
    for i in (3, 4):
        assert responses[i]["cache"]["waste"] == 0 and "divergence" not in responses[i], i
    assert responses[3]["cache"]["expected"] == usages[2]["prompt_tokens"]
    assert responses[4]["cache"]["expected"] == usages[1]["prompt_tokens"]
    assert cache_read(usages[4]) > usages[1]["prompt_tokens"] - 128


def test_a_rewind_after_an_mcp_server_connected_still_reports_the_miss(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """An agent that rebuilds its system prompt and tools each turn, rewound after another MCP
    server connected: fewer messages, another prompt and other tools, but its own conversation
    (its tools and its messages): the provider missed, and that is a rewrite of its system
    prompt (OpenAI renders it before the tools)."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "mcp"})
    servers: list[str] = []

    def system() -> dict[str, Any]:
        extra = "".join(f"\nMCP server {s}: use it for {s} work." for s in servers)
        return {"role": "system", "content": SYSTEM_PROMPT + extra}

    def tools() -> list[dict[str, Any]]:
        more = [
            {"type": "function", "function": {"name": f"mcp_{s}", "parameters": {"type": "object"}}}
            for s in servers
        ]
        return [*TOOLS, *more]

    convo = [system(), {"role": "user", "content": "Fix the handler. " + FILE_TEXT[:1500]}]
    snapshots = []
    for i in range(4):
        convo[0] = system()
        snapshots.append(list(convo))
        _tool_turn(client, convo, f"output {i}: " + FILE_TEXT[:3000], tools=tools())
        sim.sim.advance(10)
    servers.append("late")  # connected meanwhile; then the user rewinds two turns
    convo = [system(), *snapshots[2][1:], {"role": "user", "content": "Undo that; try again."}]
    _tool_turn(client, convo, "output again", tools=tools())
    flush(proxy)
    last = events(proxy.log_dir, "mcp", "response")[-1]["cache"]
    assert last["expected"] > NOISE_FLOOR
    assert last["waste"] == last["expected"] - last["read"] > NOISE_FLOOR
    assert (last["cause"], last["location"]) == ("prefix_rewrite", "system")


def test_a_repeated_request_keeps_its_conversation_the_most_recently_seen(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The main agent resends a turn as it was (a dropped stream), then as many sub-agents run
    as a session keeps conversations: the repeat was counted but did not make the main agent
    recent, a sub-agent's arrival pushed it out, and its miss after a long pause was not
    reported."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "recent"})
    main = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Fix the handler. " + FILE_TEXT[:2000]},
    ]
    _tool_turn(client, main, "output 0: " + FILE_TEXT[:2000], tools=TOOLS)
    sent = list(main)
    _tool_turn(client, main, "output 1: " + FILE_TEXT[:2000], tools=TOOLS)
    for k in range(CONVERSATIONS_KEPT - 1):
        sub = [
            {"role": "system", "content": f"Sub-agent {k}."},
            {"role": "user", "content": f"Look at part {k}."},
        ]
        chat(client, sub, stream=False)
    chat(client, sent, stream=False, tools=TOOLS)  # the main agent's last turn, sent again
    sub = [{"role": "system", "content": "Sub-agent, last."}, {"role": "user", "content": "Look."}]
    chat(client, sub, stream=False)
    sim.sim.advance(400)
    _tool_turn(client, main, "output 2", tools=TOOLS)
    flush(proxy)
    last = events(proxy.log_dir, "recent", "response")[-1]["cache"]
    assert last["expected"] > NOISE_FLOOR
    assert (last["cause"], last["waste"]) == ("ttl_expired", last["expected"] - last["read"])


_LITELLM_USAGE = b'"cache_read_input_tokens":0,"cache_creation_input_tokens":0'
_OPENROUTER_USAGE = b'"prompt_tokens_details":{"cached_tokens":0,"cache_write_tokens":0}'


@pytest.mark.parametrize("priced", [True, False, None])
def test_an_audio_models_answer_costs_its_audio_prices_or_is_said_to_be_priced_as_text(
    scripted: Any, proxy_factory: Any, caplog: pytest.LogCaptureFixture, priced: bool
) -> None:
    """An answer of gpt-4o-audio-preview, 1,500 of its 2,000 input tokens and 900 of its 1,000
    output tokens audio: priced as text it logged $0.015 for a $0.134 answer, in the log, the
    metrics and ``sessions cost`` alike, and nothing said so."""
    import logging

    answer = (
        b'{"id":"a1","object":"chat.completion","model":"gpt-4o-audio-preview","choices":[{'
        b'"index":0,"message":{"role":"assistant","content":null,"audio":{"id":"audio_1",'
        b'"expires_at":1,"data":"","transcript":"Hi."}},"finish_reason":"stop"}],"usage":{'
        b'"prompt_tokens":2000,"completion_tokens":1000,"total_tokens":3000,'
        b'"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":1500},'
        b'"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":900}}}'
    )
    _upstream, url = scripted(chunks=[answer], content_type=b"application/json")
    prices = {"price_input": 2.5, "price_output": 10.0}
    if priced:
        prices |= {"price_audio_input": 40.0, "price_audio_output": 80.0}
    elif priced is None:  # (no prices at all: said as such, not as priced as text)
        prices = {"context_window": 128000}
    proxy = proxy_factory(url, {"models": {"gpt-4o-audio-preview": prices}})
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "voice"})
    with caplog.at_level(logging.INFO, logger="proxy.observers"):
        for _ in range(2):
            client.chat.completions.create(
                model="gpt-4o-audio-preview",
                modalities=["text", "audio"],
                audio={"voice": "alloy", "format": "wav"},
                messages=[{"role": "user", "content": "Say hi."}],
            )
        flush(proxy)
    lines = events(proxy.log_dir, "voice", "response")
    expected = (500 * 2.5 + 1500 * 40 + 100 * 10 + 900 * 80) / 1e6 if priced else 0.015
    expected = 0.0 if priced is None else expected
    for line in lines:
        assert line["usage"]["audio_in"] == 1500 and line["usage"]["audio_out"] == 900
        assert line["cost"]["actual"] == pytest.approx(expected)
    assert proxy.metric(
        "cachegate_cost_usd_total", {"model": "gpt-4o-audio-preview", "kind": "actual"}
    ) == pytest.approx(2 * expected)
    said = [r.getMessage() for r in caplog.records if "audio tokens" in r.getMessage()]
    if priced or priced is None:
        assert said == []
        if priced is None:
            assert any("has no prices" in r.getMessage() for r in caplog.records)
    else:  # once for the model, with the keys to set
        assert len(said) == 1, said
        assert "priced as text; set price_audio_input and price_audio_output" in said[0]
        assert '[models."gpt-4o-audio-preview"]' in said[0]


@pytest.mark.parametrize(
    ("marked", "model", "fields"),
    [
        (False, "claude-sonnet-4-5", _LITELLM_USAGE),
        (True, "claude-sonnet-4-5", _LITELLM_USAGE),
        # OpenRouter: OpenAI's usage fields, the model told by its name alone
        (False, "anthropic/claude-sonnet-4.5", _OPENROUTER_USAGE),
        (True, "anthropic/claude-sonnet-4.5", _OPENROUTER_USAGE),
    ],
)
def test_claude_behind_a_gateway_without_cache_marks_is_told_apart_from_an_eviction(
    scripted: Any, proxy_factory: Any, marked: bool, model: str, fields: bytes
) -> None:
    """Claude caches only the prefixes a request marks, and its gateways report its cache
    fields (zeros) all the same: an agent that marks nothing misses every turn. That was
    charged as "unexplained" (the provider evicted the entry or routed elsewhere); it is
    "not_requested", which says what to do. A marked request that misses stays unexplained.
    OpenRouter's name for the model is priced and labelled as Anthropic's."""
    answer = (
        b'{"id":"m1","object":"chat.completion","model":"claude-sonnet-4-5","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":'
        b'{"prompt_tokens":6000,"completion_tokens":5,' + fields + b"}}"
    )
    _upstream, url = scripted(chunks=[answer], content_type=b"application/json")
    proxy = proxy_factory(url, config())
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "unmarked"})
    task: dict[str, Any] = {"role": "user", "content": "Fix the failing test."}
    if marked:
        task = {
            "role": "user",
            "content": [{"type": "text", "text": task["content"]}],
            "cache_control": {"type": "ephemeral"},
        }
    convo: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}, task]
    reply, _ = chat(client, convo, model=model, stream=False)
    convo += [reply, {"role": "user", "content": "Go on."}]
    chat(client, convo, model=model, stream=False)
    flush(proxy)
    second = events(proxy.log_dir, "unmarked", "response")[1]
    assert second["cost"]["actual"] == pytest.approx((6000 * 3.00 + 5 * 15.00) / 1e6)
    cause = "unexplained" if marked else "not_requested"
    # (the 6,000 missed tokens cost the input price, $3.00 a million, where a read costs $0.30)
    wasted_usd = 6000 * (3.00 - 0.30) / 1e6
    assert second["cache"] == {
        "expected": 6000,
        "read": 0,
        "write": 0,
        "waste": 6000,
        "cause": cause,
        "location": None,
        "waste_usd": pytest.approx(wasted_usd),
    }
    labels = {"model": "claude-sonnet-4-5", "cause": cause}
    assert proxy.metric("cachegate_cache_waste_tokens_total", labels) == 6000
    show = run_cli("sessions", "show", "unmarked", "--log-dir", str(proxy.log_dir))
    assert f"6,000 {cause}" in show.out
    cost = run_cli("sessions", "cost", "unmarked", "--log-dir", str(proxy.log_dir))
    assert f"wasted cache tokens  6,000 (${wasted_usd:.4f})" in cost.out
    assert f"  {cause}" in cost.out and cost.out.count(f"6,000 (${wasted_usd:.4f})") == 2


@pytest.mark.parametrize("evicted", [False, True], ids=["kept", "evicted"])
def test_an_edit_is_not_charged_with_a_prefix_the_provider_lost_before_it(
    sim: RunningSimulator, proxy_factory: Any, evicted: bool
) -> None:
    """An agent edits one of its latest tool outputs; the provider had lost the whole prefix
    before it meanwhile (evicted: its own clock moved, cachegate's did not). The edit was charged all
    11,000 tokens, ~10,000 of them before it and unchanged: the miss is the eviction's, and the
    edit is still the request's divergence. A provider that kept the prefix reads up to the
    edit, and what follows is the edit's, as before."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300))  # (its own clock: seconds pass)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "lost"})
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Fix the failing handler."},
    ]
    for n in range(5):
        sim.sim.enqueue(
            [parse_script({"tool_calls": [{"id": f"c{n}", "name": "run", "arguments": {}}]})]
        )
        reply, _ = chat(client, convo, stream=False, tools=TOOLS)
        convo += [reply, {"role": "tool", "tool_call_id": f"c{n}", "content": FILE_TEXT}]
        sim.sim.advance(20)
    if evicted:
        sim.sim.advance(600)  # the provider's 300 s are gone; cachegate saw a few ms
    edited = len(convo) - 3  # (the fourth tool output of five: most of the prompt before it)
    convo[edited] = {**convo[edited], "content": "(edited by the agent)\n" + FILE_TEXT}
    chat(client, convo, stream=False, tools=TOOLS)
    flush(proxy)
    last = events(proxy.log_dir, "lost", "response")[-1]
    read = cache_read(sim.sim.requests[-1].usage)
    assert last["cache"]["waste"] > 1000
    if evicted:
        assert read == 0
        assert (last["cache"]["cause"], last["cache"]["location"]) == ("unexplained", None)
    else:
        assert read > 5000
        assert (last["cache"]["cause"], last["cache"]["location"]) == (
            "prefix_rewrite",
            f"messages[{edited}].content",
        )
    assert last["divergence"]["index"] == edited  # the edit is logged either way


@pytest.mark.parametrize("evicted", [False, True], ids=["kept", "evicted"])
def test_a_line_added_to_a_long_system_prompt_is_not_charged_with_a_prefix_already_lost(
    sim: RunningSimulator, proxy_factory: Any, evicted: bool
) -> None:
    """A line added at the end of a long system prompt ("Be brief.", the date there) after the
    provider lost the prefix: the ~8,000 tokens of the prompt before it were charged to the
    edit (only whole messages before an edit were counted as the prefix it left unchanged)."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300))
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "sysend"})
    system = SYSTEM_PROMPT + " Keep to the repository's style." * 900
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Fix the failing handler."},
    ]
    for turn in range(2):
        reply, _ = chat(client, convo, stream=False)
        convo += [reply, {"role": "user", "content": f"Go on ({turn})."}]
        sim.sim.advance(20)
    if evicted:
        sim.sim.advance(600)  # the provider's 300 s are gone; cachegate saw a few ms
    convo[0] = {"role": "system", "content": system + " Be brief."}
    chat(client, convo, stream=False)
    flush(proxy)
    last = events(proxy.log_dir, "sysend", "response")[-1]
    read = cache_read(sim.sim.requests[-1].usage)
    if evicted:
        assert read == 0 and last["cache"]["waste"] > 5000
        assert (last["cache"]["cause"], last["cache"]["location"]) == ("unexplained", None)
    else:  # (the provider read up to the edit: what follows it is under the noise floor)
        assert read > 5000 and last["cache"]["waste"] == 0
    assert last["divergence"]["location"] == "system"  # the edit is logged either way


# Thirty tools as a large agent sends them (~24 KB), more than the system prompt
MANY_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": f"Tool {i}. " + "Reads the repository and reports what it found. " * 14,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
    for i in range(30)
]


@pytest.mark.parametrize("case", ["open-file-edited", "claude-same-tools"])
def test_first_turns_whose_prompts_keep_a_readable_prefix_stay_rewrites(
    proxy_factory: Any, case: str
) -> None:
    """Two first turns alike are two conversations only where nothing before their messages
    could be read: a first turn sent again with another large open file at the bottom of its
    prompt keeps a 9 KB head the provider reads (its miss of the rest was hidden: expected 0,
    read 2,304); a Claude model reads the tools before the system prompt, and the same marked
    tools under a sub-agent's own prompt are a prefix it reads (expected 0, read 2,944)."""
    claude = case == "claude-same-tools"
    dialect = "anthropic-compat" if claude else "openai"
    with run_simulator(SimConfig(dialect=dialect)) as sim:
        proxy = proxy_factory(sim.api_base, config(), clock=lambda: sim.sim.now)
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": case})
        task = {"role": "user", "content": "Fix the failing handler."}
        tools = MANY_TOOLS
        if claude:  # (the tools marked for Claude's cache: they end a prefix it writes)
            tools = [*MANY_TOOLS[:-1], {**MANY_TOOLS[-1], "cache_control": {"type": "ephemeral"}}]
            prompts = [SYSTEM_PROMPT, "You are a search sub-agent. Find what is asked. " * 40]
        else:
            head = "Instructions: be careful and run the tests. " * 200
            files = ["\n".join(f"line {i} of a.py: x = {i}" for i in range(900)), FILE_TEXT * 6]
            prompts = [f"{head}\n<open>\n{text}\n</open>" for text in files]
        model = "claude-sonnet-4-5" if claude else "gpt-4o"
        for prompt in prompts:
            system = {"role": "system", "content": prompt}
            chat(client, [system, task], stream=False, model=model, tools=tools)
            sim.sim.advance(5)
        usages = [r.usage for r in sim.sim.requests]
        flush(proxy)
    second = events(proxy.log_dir, case, "response")[1]
    assert cache_read(usages[1]) > 1000  # the provider read the shared prefix
    assert second["divergence"]["location"] == "system"
    assert second["cache"]["expected"] >= cache_read(usages[1])


@pytest.mark.parametrize("model", ["gpt-4o", "deepseek-chat", "llama-3.3-70b", "azure-prod"])
def test_an_openai_prompt_is_read_system_then_tools_and_its_rewrites_named_so(
    proxy_factory: Any, sdk: Any, model: str
) -> None:
    """OpenAI (and DeepSeek, and open models' chat templates) render a chat request's system
    prompt before its tools, whatever the model is named (an Azure deployment's, a server's
    own). With many tools, the time at the start of the system prompt loses all of the
    prompt: it was named ``unexplained`` (read in Claude's order, the tools were an unchanged
    prefix of thousands of tokens of which nothing was read, so the provider had seemed to
    lose it first). A tool edited then loses the tools and what follows, the system prompt
    read."""
    dialect = "deepseek" if model.startswith("deepseek") else "openai"
    with run_simulator(SimConfig(dialect=dialect)) as sim:
        proxy = proxy_factory(sim.api_base, config(), clock=lambda: sim.sim.now)
        client = sdk(proxy.base_url, default_headers={"X-Session-Id": "many-tools"})
        convo: list[dict[str, Any]] = [
            {"role": "system", "content": ""},
            {"role": "user", "content": "Fix the failing test.\n" + FILE_TEXT},
        ]
        edited = [
            {**MANY_TOOLS[0], "function": {**MANY_TOOLS[0]["function"], "description": "Edited."}}
        ]
        steps = [
            ("09:00", MANY_TOOLS),
            ("09:00", MANY_TOOLS),
            ("09:01", MANY_TOOLS),  # the time in the system prompt
            ("09:01", [*edited, *MANY_TOOLS[1:]]),  # a tool
        ]
        for turn, (time, tools) in enumerate(steps):
            convo[0] = {"role": "system", "content": f"Current time: {time}.\n" + SYSTEM_PROMPT * 2}
            reply, _ = chat(client, convo, stream=bool(turn % 2), model=model, tools=tools)
            convo += [reply, {"role": "user", "content": f"Go on ({turn})."}]
            sim.sim.advance(20)
        usages = [r.usage for r in sim.sim.requests]
        reads = [cache_read(u) for u in usages]
        # The scenario is what it claims to be: the third reads nothing, the fourth the system
        # prompt (~2,000 tokens) and not the tools after it.
        assert reads[1] > 6000 and reads[2] == 0
        assert 1024 <= reads[3] < 3000
        flush(proxy)
        responses = events(proxy.log_dir, "many-tools", "response")
        caches = [r["cache"] for r in responses]
        assert [(c["cause"], c["location"]) for c in caches] == [
            (None, None),
            (None, None),
            ("prefix_rewrite", "system"),
            ("prefix_rewrite", "tools"),
        ]
        assert [c["read"] for c in caches] == reads
        assert caches[2]["waste"] == caches[2]["expected"] == usages[1]["prompt_tokens"]
        assert caches[3]["waste"] == caches[3]["expected"] - reads[3] > 5000
        assert responses[2]["divergence"]["volatile_kind"] == "timestamp"
        assert (responses[3]["divergence"]["location"], responses[3]["divergence"]["field"]) == (
            "tools",
            "tool_0",
        )


def test_a_legacy_function_edited_is_named_as_a_tool_is(proxy_factory: Any, sdk: Any) -> None:
    """An agent on the legacy ``functions`` (LangChain's ``bind_functions``): the provider
    renders them as tools, so an edited description loses them and what follows. cachegate
    read only ``tools``: the miss was ``unexplained``, with no place. Now it is a rewrite of
    the tools, the function named; and a forced ``function_call`` a change of parameters."""
    functions = [tool["function"] for tool in MANY_TOOLS]
    edited = [*functions[:3], {**functions[3], "description": "Edited."}, *functions[4:]]
    with run_simulator(SimConfig()) as sim:
        proxy = proxy_factory(sim.api_base, config(), clock=lambda: sim.sim.now)
        client = sdk(proxy.base_url, default_headers={"X-Session-Id": "legacy"})
        convo: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "Fix the failing test.\n" + FILE_TEXT},
        ]
        for turn, (funcs, extra) in enumerate(
            [(functions, {}), (functions, {}), (edited, {}), (edited, {"name": "tool_1"})]
        ):
            call = {"function_call": extra} if extra else {}
            reply, _ = chat(
                client, convo, stream=bool(turn % 2), extra_body={"functions": funcs, **call}
            )
            convo += [reply, {"role": "user", "content": f"Go on ({turn})."}]
            sim.sim.advance(20)
        reads = [cache_read(r.usage) for r in sim.sim.requests]
        # The scenario is what it claims: the functions are in the prompt the provider caches
        # (the system prompt before them is read, the functions not)
        assert reads[1] > 5000 and 0 < reads[2] < 2500
        flush(proxy)
        responses = events(proxy.log_dir, "legacy", "response")
        causes = [(r["cache"]["cause"], r["cache"]["location"]) for r in responses]
        assert causes[:3] == [(None, None), (None, None), ("prefix_rewrite", "tools")]
        assert (responses[2]["divergence"]["location"], responses[2]["divergence"]["field"]) == (
            "tools",
            "tool_3",
        )
        assert responses[2]["cache"]["waste"] > 5000
        assert responses[3]["divergence"]["field"] == "function_call"


@pytest.mark.parametrize(
    ("dialect", "model", "location"),
    [
        ("openai", "gpt-4-turbo", "system"),  # a "*" entry's dialect anthropic: still OpenAI's
        ("anthropic-compat", "databricks-claude-sonnet-4", "tools"),  # Databricks' Claude
    ],
)
def test_whose_model_it_is_decides_the_order_whatever_a_gateway_or_a_star_entry_says(
    proxy_factory: Any, sdk: Any, dialect: str, model: str, location: str
) -> None:
    """The time in the system prompt and a tool changed in one turn: an OpenAI model under a
    ``"*"`` entry of ``dialect = "anthropic"`` was read as Claude's (its miss ``not_requested``,
    its change in the tools, where OpenAI read the system prompt first); Claude under
    Databricks' name was read system prompt first (Claude renders the tools first)."""
    mark = {"type": "ephemeral"}
    settings = {"models": {"*": {"dialect": "anthropic", "price_input": 1.0, "price_output": 2.0}}}
    with run_simulator(SimConfig(dialect=dialect)) as sim:  # type: ignore[arg-type]
        proxy = proxy_factory(sim.api_base, settings, clock=lambda: sim.sim.now)
        client = sdk(proxy.base_url, default_headers={"X-Session-Id": "whose"})
        convo: list[dict[str, Any]] = [
            {"role": "system", "content": "", "cache_control": mark},
            {
                "role": "user",
                "content": "Fix the failing test.\n" + FILE_TEXT,
                "cache_control": mark,
            },
        ]
        for turn, (time, tools) in enumerate((("09:00", TOOLS), ("09:01", TOOLS[1:]))):
            convo[0] = {**convo[0], "content": f"Current time: {time}.\n" + SYSTEM_PROMPT * 2}
            marked = [{**t, "cache_control": mark} for t in tools]
            reply, _ = chat(client, convo, stream=False, model=model, tools=marked)
            convo += [reply, {"role": "user", "content": "Go on.", "cache_control": mark}]
            sim.sim.advance(20)
            assert turn or cache_read(sim.sim.requests[-1].usage) == 0
        assert cache_read(sim.sim.requests[-1].usage) == 0  # (all of it missed)
        flush(proxy)
        last = events(proxy.log_dir, "whose", "response")[-1]
        assert (last["cache"]["cause"], last["cache"]["location"]) == ("prefix_rewrite", location)
        assert last["divergence"]["location"] == location
        assert last["cache"]["waste"] == last["cache"]["expected"] > NOISE_FLOOR


CALL_ID = "call_Xq3vT9pLm2RzK8wYb4NcD7hF"  # (as OpenAI's look: a turn carrying it is that one's)


def test_a_turn_after_one_that_forced_a_tool_is_compared_with_that_one(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A system prompt edited by hand, later a turn that forces a tool (``tool_choice``), then
    an ordinary turn: no link of the forced turn's chain is the ordinary one's (parameters come
    first), so the request from before the edit, of the same parameters, was taken as its
    previous one: a rewrite of the system prompt logged and counted again, three turns after
    it was made, and that request's prompt expected."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "forced"})
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "hello"},
    ]

    def turn(**kw: Any) -> dict[str, Any]:
        reply, _ = chat(client, convo, stream=False, tools=TOOLS, **kw)
        sim.sim.advance(5)
        return reply

    for n in range(4):
        if n == 2:
            convo[0] = {"role": "system", "content": SYSTEM_PROMPT + " Be careful."}
        convo += [turn(), {"role": "user", "content": f"step {n}"}]
    sim.sim.enqueue(
        [
            parse_script(
                {
                    "tool_calls": [
                        {"id": CALL_ID, "name": TOOLS[0]["function"]["name"], "arguments": {}}
                    ]
                }
            )
        ]
    )
    forced = {"type": "function", "function": {"name": TOOLS[0]["function"]["name"]}}
    convo += [turn(tool_choice=forced), {"role": "tool", "tool_call_id": CALL_ID, "content": "ok"}]
    turn()
    flush(proxy)
    responses = events(proxy.log_dir, "forced", "response")
    last = responses[-1]
    assert last["divergence"]["location"] == "params"
    assert last["divergence"]["field"] == "tool_choice"
    assert last["cache"]["expected"] == responses[-2]["usage"]["prompt"]
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "system"}) == 1


@pytest.mark.parametrize(
    "side", [{"tool_choice": "none"}, {"response_format": {"type": "json_object"}}]
)
def test_a_side_request_of_other_parameters_is_no_turns_previous_one_when_the_turn_has_its_own(
    sim: RunningSimulator, proxy_factory: Any, side: dict[str, Any]
) -> None:
    """A title request on the main model, of the main prompt, tools and first messages and
    parameters of its own, ties with the main conversation's previous turn by what they share:
    the turn must still be compared with its own previous one (the first fix for forced-tool
    turns took the side request, and logged a change of parameters that never happened)."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "side"})
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Fix the failing test."},
    ]
    reply, _ = chat(client, convo, stream=False, tools=TOOLS)
    chat(client, convo, stream=False, tools=TOOLS, **side)  # (the same messages: a title)
    convo += [reply, {"role": "user", "content": "step 1 " + "details " * 300}]
    reply, _ = chat(client, convo, stream=False, tools=TOOLS)  # extends the first turn
    convo += [reply, {"role": "user", "content": "step 2 " + "details " * 300}]
    chat(client, convo, stream=False, tools=TOOLS)
    side_question = [*convo[:4], {"role": "user", "content": "Give the session a title."}]
    chat(client, side_question, stream=False, tools=TOOLS, **side)
    rewound = [*convo[:3], {"role": "user", "content": "Actually, do something else."}]
    chat(client, rewound, stream=False, tools=TOOLS)  # a rewind of the main conversation
    flush(proxy)
    responses = events(proxy.log_dir, "side", "response")
    assert "divergence" not in responses[2]
    assert responses[5]["divergence"]["location"] == "messages"
    assert responses[5]["divergence"]["index"] == 3
    # (the first side request's own change of parameters only, against the first turn, the
    # session's one request then; the second carries the first on: none for the turns)
    assert [
        r["exchange"] for r in responses if r.get("divergence", {}).get("location") == "params"
    ] == [2]
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "params"}) == 1


def test_a_title_request_after_the_time_moved_is_not_the_next_turns_previous_one(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The time in the system prompt; a title request on the main model ([system, first
    message], tool_choice none) after the minute changed; then the main agent's turn. The
    title shares the new prompt and tools, the previous turn neither: the turn is still its
    previous turn's, a rewrite of the system prompt (the first fix for forced-tool turns took
    the title, and logged a change of tool_choice)."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "timed-title"})

    def system(minute: int) -> dict[str, Any]:
        return {"role": "system", "content": f"Current time: 10:{minute:02d}\n" + SYSTEM_PROMPT}

    first = {"role": "user", "content": "Fix the failing test."}
    convo: list[dict[str, Any]] = [first]
    for follow in ("Now add a docstring.", "And run the linter."):
        reply, _ = chat(client, [system(0), *convo], stream=False, tools=TOOLS)
        convo += [reply, {"role": "user", "content": follow}]
    chat(client, [system(1), first], stream=False, tools=TOOLS, tool_choice="none")
    chat(client, [system(1), *convo], stream=False, tools=TOOLS)
    flush(proxy)
    last = events(proxy.log_dir, "timed-title", "response")[-1]
    assert last["divergence"]["location"] == "system"
    assert last["cache"]["expected"] == sim.sim.requests[1].usage["prompt_tokens"]
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "params"}) == 0


def test_a_classifier_of_the_whole_history_beside_each_turn_is_no_turns_previous_one(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The time in the system prompt; before each turn a JSON classifier on the main model of
    the very history the turn sends. The turn carries the classifier on whole but its answer:
    it is its previous turn's next (the last fix compared it with the classifier, and the next
    classifier's miss, the time's, was charged as a change of response_format)."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "classified"})
    convo: list[dict[str, Any]] = [{"role": "system"}, {"role": "user", "content": "hello"}]
    for n in range(4):
        convo[0] = {"role": "system", "content": f"Current time: 10:{n:02d}\n" + SYSTEM_PROMPT}
        chat(client, convo, stream=False, tools=TOOLS, response_format={"type": "json_object"})
        reply, _ = chat(client, convo, stream=False, tools=TOOLS)
        convo += [reply, {"role": "user", "content": f"step {n}"}]
    flush(proxy)
    responses = events(proxy.log_dir, "classified", "response")
    params = [
        r["exchange"] for r in responses if r.get("divergence", {}).get("location") == "params"
    ]
    assert params == [2]  # (the first classifier, against the first turn: the one request)
    assert all(r["cache"]["cause"] in (None, "prefix_rewrite") for r in responses)
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "params"}) == 1


def test_sub_agents_of_one_task_and_their_own_cache_keys_are_each_compared_with_their_own(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Two sub-agents fanned out with one task, each with its own ``prompt_cache_key``, whose
    first answers come out alike (counter call ids): each turn is its own agent's next (the
    first fix for forced-tool turns compared each with the other's, a change of the key logged
    every turn)."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "keys"})
    task = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Find it."}]
    convos = {"a": list(task), "b": list(task)}
    paths = {"a": ["config.py", "loader.py", None], "b": ["config.py", "loader.py", "schema.py"]}
    for turn in range(3):
        for who in ("a", "b"):
            path = paths[who][turn]
            reply = {"tool_calls": [{"id": f"functions.read:{turn}", "name": "read_file",
                                      "arguments": {"path": path}}]} if path else f"done {who}"  # fmt: skip
            sim.sim.enqueue([parse_script(reply)])
            message, _ = chat(
                client, convos[who], stream=False, tools=TOOLS, prompt_cache_key=f"sub-{who}"
            )
            convos[who].append(message)
            for call in message.get("tool_calls") or []:
                convos[who].append(
                    {"role": "tool", "tool_call_id": call["id"], "content": f"text of {path}"}
                )
            if not message.get("tool_calls"):
                convos[who].append({"role": "user", "content": f"go on {who}"})
    flush(proxy)
    responses = events(proxy.log_dir, "keys", "response")
    params = [
        r["exchange"] for r in responses if r.get("divergence", {}).get("location") == "params"
    ]
    assert params == [2]  # (b's first request against a's, the session's one request then)
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "params"}) == 1


# A Claude agent's system prompt long enough for the simulator to cache it
CLAUDE_SYSTEM = SYSTEM_PROMPT + " Follow the style guide." * 700


@contextlib.contextmanager
def claude_session(proxy_factory: Any, session: str) -> Iterator[tuple[Any, Any, list[Any]]]:
    """A cachegate before a Claude-like simulator, a client of the session, and its opening
    history (system prompt and task), for a test to play turns on."""
    with run_simulator(SimConfig(dialect="anthropic-compat")) as claude:
        proxy = proxy_factory(claude.api_base, config())
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": session})
        convo: list[Any] = [
            {"role": "system", "content": CLAUDE_SYSTEM},
            {"role": "user", "content": "Fix the failing test."},
        ]
        yield proxy, client, convo


def test_a_claude_agent_that_starts_marking_is_not_charged_for_what_no_turn_marked(
    proxy_factory: Any,
) -> None:
    """Turns that marked nothing cached nothing (Claude caches only marked prefixes); the first
    marked turn after them (prompt caching turned on mid-session, Cline's and Roo's setting)
    could read nothing: it was charged the whole prompt as "unexplained"."""
    system = CLAUDE_SYSTEM
    with claude_session(proxy_factory, "starts-marking") as (proxy, client, convo):
        for turn in range(3):
            if turn == 2:  # marks from now on
                convo[0] = {
                    "role": "system",
                    "content": [
                        {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}
                    ],
                }
            reply, _ = chat(client, convo, model="claude-sonnet-4-5", stream=False)
            convo += [reply, {"role": "user", "content": f"Go on ({turn})."}]
        flush(proxy)
    caches = [r["cache"] for r in events(proxy.log_dir, "starts-marking", "response")]
    assert [c["read"] for c in caches] == [0, 0, 0]
    assert caches[2]["write"] > 1000  # (it marked: the simulator wrote the prefix)
    assert [c["cause"] for c in caches] == [None, "not_requested", "not_requested"]


def test_a_claude_turn_after_one_that_marked_only_a_short_prefix_is_not_requested(
    proxy_factory: Any,
) -> None:
    """A turn that marked only a system prompt shorter than Claude's minimum (1,024 tokens)
    cached nothing, as one that marked nothing; the marked turn after it could read nothing
    and was charged the whole prompt as "unexplained" (a review met it after each compaction:
    the compacted request, its last message unmarked, cached nothing either)."""
    mark = {"type": "ephemeral"}
    with claude_session(proxy_factory, "short-mark") as (proxy, client, convo):
        convo[0] = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
        convo[0]["content"][0]["cache_control"] = mark
        convo[1] = {"role": "user", "content": "Fix the failing test.\n" + FILE_TEXT}
        reply, _ = chat(client, convo, model="claude-sonnet-4-5", stream=False)
        convo += [reply, {"role": "user", "content": "Go on.", "cache_control": mark}]
        chat(client, convo, model="claude-sonnet-4-5", stream=False)
        flush(proxy)
    caches = [r["cache"] for r in events(proxy.log_dir, "short-mark", "response")]
    assert (caches[0]["read"], caches[0]["write"]) == (0, 0)  # (nothing it could cache)
    assert caches[1]["read"] == 0 and caches[1]["write"] > NOISE_FLOOR
    assert caches[1]["waste"] == caches[1]["expected"] > NOISE_FLOOR
    assert caches[1]["cause"] == "not_requested"


def system_marked(messages: list[dict[str, Any]], system: str, last: bool) -> list[dict[str, Any]]:
    """``messages`` as a Claude agent sends them: ``system`` its system prompt, marked for the
    cache, and, where ``last``, its last message marked too."""
    mark = {"type": "ephemeral"}
    out = [dict(m) for m in messages]
    out[0] = {"role": "system", "content": [{"type": "text", "text": system}]}
    out[0]["content"][0]["cache_control"] = mark
    if last:
        part = {"type": "text", "text": out[-1]["content"], "cache_control": mark}
        out[-1] = {**out[-1], "content": [part]}
    return out


def marked_turns(
    claude: RunningSimulator, client: Any, system: str, schedule: list[tuple[int, bool]]
) -> list[dict[str, Any]]:
    """A Claude agent's turns at the simulator's times (seconds from its start) given by
    ``schedule``, each with its system prompt marked and, where said, its last message too
    (``system_marked``): the conversation so far, its next user message last."""
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Fix the test.\n" + FILE_TEXT},
    ]
    for at, last in schedule:
        claude.sim.advance(at - (claude.sim.now - claude.sim.config.start_time))
        sent = system_marked(convo, system, last)
        reply, _ = chat(client, sent, model="claude-sonnet-4-5", stream=False)
        convo += [reply, {"role": "user", "content": f"Go on. {'lorem ipsum ' * 200}"}]
    return convo


@pytest.mark.parametrize("prompt_length", ["short", "long"])
def test_a_pause_on_the_wall_clock_is_the_expirys_whatever_the_turns_between_marked(
    proxy_factory: Any, prompt_length: str
) -> None:
    """Marked turns, then turns that mark only the system prompt, spread past the TTL (each
    gap under it), then a marked turn: what the marked turns had cached expired; what the
    turns between added was never cached. cachegate timed what a turn cached on the monotonic
    clock, which stops while a laptop sleeps (here its clock is the simulator's, which jumps
    as a woken laptop's wall clock does): the miss was unexplained. And where the system
    prompt marked alone was long enough to be cached, all of it was named not_requested."""
    long = prompt_length == "long"
    system = CLAUDE_SYSTEM if long else "Be brief."

    with run_simulator(SimConfig(dialect="anthropic-compat", cache_ttl_s=300)) as claude:
        proxy = proxy_factory(claude.api_base, config(ttl_s=300), clock=lambda: claude.sim.now)
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "spread"})
        schedule = [(0, True), (30, True), (230, False), (430, False), (460, True)]
        marked_turns(claude, client, system, schedule)
        flush(proxy)
    caches = [r["cache"] for r in events(proxy.log_dir, "spread", "response")]
    cached = caches[1]["read"] + caches[1]["write"]  # what the last marked turn cached
    assert caches[1]["read"] > NOISE_FLOOR
    system_read = caches[3]["read"] + caches[3]["write"]  # the system prompt, if cached
    assert (system_read > NOISE_FLOOR) is long
    last = caches[-1]
    assert last["read"] == system_read  # (what the turns between cached)
    assert last["cause"] == "ttl_expired"
    assert last["waste"] == cached - system_read  # the expiry took what had been cached
    assert last["not_requested"] == last["expected"] - cached > NOISE_FLOOR  # never cached


def test_an_expiry_is_charged_once_whatever_the_turns_after_it_marked(
    proxy_factory: Any,
) -> None:
    """A pause past the TTL, then turns that mark only a long system prompt, then a marked
    turn: the first turn after the pause is charged the expiry; the marked turn's miss of
    the history, which the turns between never asked to cache, was charged to the expiry a
    second time (its tokens counted twice in the metrics and ``sessions cost``)."""
    with run_simulator(SimConfig(dialect="anthropic-compat", cache_ttl_s=300)) as claude:
        proxy = proxy_factory(claude.api_base, config(ttl_s=300), clock=lambda: claude.sim.now)
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "once"})
        schedule = [(0, True), (10, True), (410, False), (420, False), (430, False)]
        convo = marked_turns(claude, client, CLAUDE_SYSTEM, schedule)
        claude.sim.advance(10)
        chat(
            client,
            system_marked(convo, CLAUDE_SYSTEM, True),
            model="claude-sonnet-4-5",
            stream=False,
        )
        flush(proxy)
        lines = events(proxy.log_dir, "once", "response")
        expired = [
            (c["waste"] if c["cause"] == "ttl_expired" else 0) + c.get("expired", 0)
            for c in (r["cache"] for r in lines)
        ]
        waste = {"model": "claude-sonnet-4-5", "cause": "ttl_expired"}
        charged = proxy.metric("cachegate_cache_waste_tokens_total", waste)
    caches = [r["cache"] for r in lines]
    cached = caches[1]["read"] + caches[1]["write"]  # what the marked turns had cached
    assert caches[2]["cause"] == "ttl_expired" and caches[2]["waste"] >= cached
    assert expired == [0, 0, caches[2]["waste"], 0, 0, 0]  # charged once, by the first after
    assert charged == caches[2]["waste"]
    last = caches[-1]
    assert last["read"] > NOISE_FLOOR  # (the system prompt the turns between cached)
    assert last["cause"] == "not_requested"
    assert last["waste"] == last["expected"] - last["read"]


def test_a_short_marked_prefix_with_an_image_in_it_is_short_by_the_images_tokens(
    proxy_factory: Any,
) -> None:
    """A turn whose only mark ends after a screenshot (detail low, 85 tokens) and a line: its
    marked prefix is ~100 tokens, which Claude does not cache; weighed by its base64, it read
    as almost all the prompt, and the marked turn after it was charged as unexplained."""
    from tests.test_media import png

    mark = {"type": "ephemeral"}
    shot = base64.b64encode(png(1280, 800, noisy_rows=100)).decode()
    with claude_session(proxy_factory, "image-mark") as (proxy, client, convo):
        convo[0] = {"role": "system", "content": "Be brief."}
        convo[1] = {
            "role": "user",
            "content": [
                {
                    "type": "image_url",
                    "image_url": {"url": f"data:image/png;base64,{shot}", "detail": "low"},
                },
                {"type": "text", "text": "What is on the screen?", "cache_control": mark},
            ],
        }
        chat(client, convo, model="claude-sonnet-4-5", stream=False)
        # (the simulator's answer echoes the image's JSON: an agent's would be short)
        answer = {"role": "assistant", "content": "A failing test."}
        convo += [answer, {"role": "user", "content": "Fix the test.\n" + FILE_TEXT}]
        reply, _ = chat(client, convo, model="claude-sonnet-4-5", stream=False)
        convo += [reply, {"role": "user", "content": "Go on.", "cache_control": mark}]
        chat(client, convo, model="claude-sonnet-4-5", stream=False)
        flush(proxy)
    assert len(shot) > 200_000
    caches = [r["cache"] for r in events(proxy.log_dir, "image-mark", "response")]
    assert all((c["read"], c["write"]) == (0, 0) for c in caches[:2])  # (nothing cached)
    assert caches[2]["waste"] == caches[2]["expected"] > NOISE_FLOOR
    assert caches[2]["cause"] == "not_requested"


def test_a_claude_agent_that_marks_again_after_many_unmarked_turns_is_not_requested(
    proxy_factory: Any,
) -> None:
    """Marked turns, caching switched off for 22 messages (within the TTL, past the ~20
    content blocks Claude looks back), then marked again: what the marked turn misses lies past
    what the last marked turn wrote, which no unmarked turn asked to cache."""
    system = CLAUDE_SYSTEM
    note = "lorem ipsum " * 40

    def marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = [dict(m) for m in messages]
        out[0] = {
            "role": "system",
            "content": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        }
        out[-1] = {
            **out[-1],
            "content": [
                {"type": "text", "text": out[-1]["content"], "cache_control": {"type": "ephemeral"}}
            ],
        }
        return out

    with claude_session(proxy_factory, "off-on") as (proxy, client, convo):
        for turn in range(15):
            sent = marked(convo) if turn < 3 or turn == 14 else convo
            reply, _ = chat(client, sent, model="claude-sonnet-4-5", stream=False)
            convo += [reply, {"role": "user", "content": f"Go on ({turn}). {note}"}]
        flush(proxy)
    caches = [r["cache"] for r in events(proxy.log_dir, "off-on", "response")]
    assert caches[2]["read"] > 1000  # (the marked turns read what the turn before wrote)
    assert {c["cause"] for c in caches[3:14]} == {"not_requested"}  # (unmarked)
    assert caches[14]["read"] > 1000 and caches[14]["waste"] > 1000
    assert caches[14]["cause"] == "not_requested"


def test_a_marked_claude_turn_after_an_unmarked_one_past_the_ttl_is_the_expiry(
    proxy_factory: Any,
) -> None:
    """Marked turns, one that went out unmarked, then a pause past the TTL: what the marked
    turns wrote had expired whatever the unmarked turn did; it is not "not_requested", which
    tells an agent that marks its prompts to mark them."""
    system = SYSTEM_PROMPT + " Follow the style guide." * 700
    marked = {
        "role": "system",
        "content": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
    }
    with run_simulator(SimConfig(dialect="anthropic-compat", cache_ttl_s=300)) as claude:
        # (a TTL of 1 s for cachegate, which times what the turns wrote on its own clock)
        proxy = proxy_factory(claude.api_base, config(ttl_s=1))
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "paused"})
        convo: list[dict[str, Any]] = [marked, {"role": "user", "content": "Fix the test."}]
        for turn in range(4):
            convo[0] = {"role": "system", "content": system} if turn == 2 else marked
            if turn == 3:  # past the TTL, for both
                claude.sim.advance(400)
                time.sleep(1.5)
            reply, _ = chat(client, convo, model="claude-sonnet-4-5", stream=False)
            convo += [reply, {"role": "user", "content": f"Go on ({turn})."}]
            claude.sim.advance(5)
        flush(proxy)
    caches = [r["cache"] for r in events(proxy.log_dir, "paused", "response")]
    assert caches[0]["write"] > 1000 and caches[1]["read"] > 1000  # marked: written, then read
    assert caches[2]["cause"] == "not_requested"  # (unmarked)
    assert caches[3]["read"] == 0 and caches[3]["write"] > 1000
    assert caches[3]["cause"] == "ttl_expired"


@pytest.mark.parametrize("unmarked", ["then a pause", "spread past the TTL", "past the look back"])
def test_a_pause_after_unmarked_turns_charges_the_expiry_only_what_was_cached(
    proxy_factory: Any, unmarked: str
) -> None:
    """Marked turns, unmarked ones with long outputs, then a pause past the TTL: what the
    marked turns had cached expired, but what the unmarked turns added was never cached by
    anyone: not_requested, where the whole miss was charged to the expiry. So too when the
    unmarked turns alone take longer than the TTL, no pause between them that long (the miss
    was unexplained), and when they add more than Claude's look back of ~20 blocks (all of
    it was the expiry's)."""
    system = SYSTEM_PROMPT + " Follow the style guide." * 300
    note = "lorem ipsum " * (400 if unmarked != "past the look back" else 60)
    plain = 12 if unmarked == "past the look back" else 3  # unmarked turns

    def marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = [dict(m) for m in messages]
        out[0] = {
            "role": "system",
            "content": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        }
        text = out[-1]["content"]
        part = {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}
        out[-1] = {**out[-1], "content": [part]}
        return out

    with run_simulator(SimConfig(dialect="anthropic-compat", cache_ttl_s=300)) as claude:
        # (a TTL of 1 s for cachegate, which times what the turns wrote on its own clock)
        proxy = proxy_factory(claude.api_base, config(ttl_s=1))
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "off-paused"})
        convo: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": "Fix the test."},
        ]
        turns = 2 + plain + 1
        for turn in range(turns):
            if turn == turns - 1:  # past the TTL, for both
                claude.sim.advance(400)
                time.sleep(1.5 if unmarked != "spread past the TTL" else 0.6)
            elif turn >= 2 and unmarked == "spread past the TTL":
                time.sleep(0.6)  # (each gap under cachegate's 1 s, all of them over it)
            sent = marked(convo) if turn in (0, 1, turns - 1) else convo
            reply, _ = chat(client, sent, model="claude-sonnet-4-5", stream=False)
            convo += [reply, {"role": "user", "content": f"Go on ({turn}). {note}"}]
            claude.sim.advance(5)
        flush(proxy)
    caches = [r["cache"] for r in events(proxy.log_dir, "off-paused", "response")]
    assert caches[1]["read"] > 1000  # the marked turns: written, then read
    cached = caches[1]["read"] + caches[1]["write"]  # what the last marked turn cached
    last = caches[-1]
    assert last["read"] == 0 and last["cause"] == "ttl_expired"
    assert last["waste"] == cached  # the expiry took what had been cached
    assert last["not_requested"] == last["expected"] - cached > 1000  # never cached


@pytest.mark.parametrize("calls", [24, 2])
@pytest.mark.parametrize("system_marked", [True, False])
def test_a_claude_turn_past_the_look_back_reads_what_cachegate_expects(
    proxy_factory: Any, calls: int, system_marked: bool
) -> None:
    """Claude finds an entry only within ~20 content blocks before one of a request's
    breakpoints: after 24 parallel tool calls and their results (48 blocks), only the latest
    result marked, the task's entry is out of reach. The simulator read it (it looked back
    without end), so cachegate's ``not_requested`` for such a turn was never seen end to end.
    Now the simulator reads only the system prompt's entry (where that is marked) or nothing,
    and cachegate expects just that: nothing of the miss is the provider's. Two calls are
    within reach: all of it is read."""
    system = SYSTEM_PROMPT + " Follow the style guide." * 300
    mark = {"type": "ephemeral"}

    def marked_last(message: dict[str, Any]) -> dict[str, Any]:
        part = {"type": "text", "text": message["content"], "cache_control": mark}
        return {**message, "content": [part]}

    head = {"role": "system", "content": system}
    if system_marked:
        head = marked_last(head)
    task = {"role": "user", "content": "Fix the failing tests. " + "lorem ipsum " * 300}
    with run_simulator(SimConfig(dialect="anthropic-compat", cache_ttl_s=300)) as claude:
        proxy = proxy_factory(claude.api_base, config())
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": f"far{calls}"})
        paths = [
            {"name": "read_file", "arguments": {"path": f"src/mod_{i}.py"}} for i in range(calls)
        ]
        claude.sim.enqueue([parse_script({"tool_calls": paths})])
        model = "claude-sonnet-4-5"
        reply, _ = chat(client, [head, marked_last(task)], model=model, stream=False, tools=TOOLS)
        results = [
            {"role": "tool", "tool_call_id": call["id"], "content": f"ok {i}: " + "x " * 40}
            for i, call in enumerate(reply["tool_calls"])
        ]
        assert len(results) == calls
        claude.sim.advance(10)
        convo = [head, task, reply, *results[:-1], marked_last(results[-1])]
        chat(client, convo, model=model, stream=False, tools=TOOLS)
        flush(proxy)
        usages = [r.usage for r in claude.sim.requests if r.usage is not None]
    caches = [r["cache"] for r in events(proxy.log_dir, f"far{calls}", "response")]
    first, last = caches
    assert first["write"] > 1000 and last["read"] == cache_read(usages[-1])
    assert last["expected"] == usages[0]["prompt_tokens"]  # (all the turn before sent)
    if calls == 2:  # (20 blocks or fewer: the task's entry is read whole)
        assert last["read"] == first["read"] + first["write"]
        assert (last["waste"], last["cause"]) == (0, None), last
        return
    # out of reach: the system prompt's entry, where it is marked, else nothing; the miss is
    # named not_requested whole (before, the simulator read the task's entry: no miss at all)
    assert (last["read"] > 1000) is system_marked
    assert last["read"] < first["read"] + first["write"] - NOISE_FLOOR
    assert last["cause"] == "not_requested", last
    assert last["waste"] + last.get("not_requested", 0) == last["expected"] - last["read"]
    wasted = "cachegate_cache_waste_tokens_total"
    assert proxy.metric(wasted, {"model": model, "cause": "not_requested"}) == (
        last["expected"] - last["read"]
    )
    for cause in ("unexplained", "ttl_expired", "prefix_rewrite"):
        assert not proxy.metric(wasted, {"model": model, "cause": cause})


def test_turns_past_the_look_back_each_just_over_the_floor_are_not_the_providers_miss(
    proxy_factory: Any,
) -> None:
    """Twelve parallel calls a turn (25 content blocks with their results and the next
    message, past Claude's look back), the system prompt and the latest message marked: each
    turn reads the system prompt's entry alone. Where the turn before had a small tail past
    its last entry, what was looked back for was within the noise floor of the read, the
    look-back never checked, and a miss just over the floor was ``unexplained``, the
    provider blamed, where the next turn's same miss was ``not_requested``."""
    system = "You are a careful coding agent. " + " ".join(
        f"Rule {i}: always check file number {i} before editing anything." for i in range(200)
    )
    mark = {"type": "ephemeral"}
    history: list[dict[str, Any]] = [{"role": "user", "content": "task " + "ctx " * 300}]
    with run_simulator(SimConfig(dialect="anthropic-compat")) as claude:
        proxy = proxy_factory(claude.api_base, config(), clock=lambda: claude.sim.now)
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "wide"})
        for turn in range(5):
            head = {
                "role": "system",
                "content": [{"type": "text", "text": system, "cache_control": mark}],
            }
            last = history[-1]
            marked = {
                **last,
                "content": [{"type": "text", "text": last["content"], "cache_control": mark}],
            }
            chat(
                client,
                [head, *history[:-1], marked],
                model="claude-sonnet-4-5",
                stream=False,
                tools=TOOLS,
            )
            calls = [
                {
                    "id": f"toolu_{turn}_{i}",
                    "type": "function",
                    "function": {
                        "name": "read_file",
                        "arguments": json.dumps({"path": f"{turn}/{i}"}),
                    },
                }
                for i in range(12)
            ]
            history.append({"role": "assistant", "content": None, "tool_calls": calls})
            history += [
                {"role": "tool", "tool_call_id": c["id"], "content": "R " * 30} for c in calls
            ]
            history.append({"role": "user", "content": "go " + "g " * 100})
            claude.sim.advance(5)
        flush(proxy)
    caches = [r["cache"] for r in events(proxy.log_dir, "wide", "response")]
    missed = [c for c in caches[2:] if c["waste"]]
    assert len(missed) == 3 and missed[0]["waste"] < 1500  # (the first just over the floor)
    assert [c["cause"] for c in missed] == ["not_requested"] * 3, caches


@pytest.mark.parametrize("rewrite", [False, True])
def test_a_rewrite_of_an_hours_prefix_after_five_minutes_is_the_rewrites_not_the_expirys(
    proxy_factory: Any, rewrite: bool
) -> None:
    """System prompt marked for an hour, the latest message for five minutes (the default),
    then a pause past five minutes with the date in the system prompt changed: the hour-long
    prefix was still cached and the rewrite lost it, where all of the miss was charged to the
    expiry and the timestamp never named. What the messages added had expired: counted apart."""
    rules = SYSTEM_PROMPT + " Follow the style guide." * 500
    note = "lorem ipsum " * 500

    def sent(day: int, convo: list[dict[str, Any]]) -> list[dict[str, Any]]:
        text = f"Current date: 2026-12-0{day}\n{rules}"
        hour = {"type": "ephemeral", "ttl": "1h"}
        system = {
            "role": "system",
            "content": [{"type": "text", "text": text, "cache_control": hour}],
        }
        last = {
            "type": "text",
            "text": convo[-1]["content"],
            "cache_control": {"type": "ephemeral"},
        }
        return [system, *convo[:-1], {**convo[-1], "content": [last]}]

    with run_simulator(SimConfig(dialect="anthropic-compat", cache_ttl_s=300)) as claude:
        # (a TTL of 1 s for cachegate's clock, the messages' breakpoint naming none)
        proxy = proxy_factory(claude.api_base, config(ttl_s=1))
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": f"hour{rewrite}"})
        convo: list[dict[str, Any]] = [{"role": "user", "content": f"Fix the test. {note}"}]
        for turn in range(3):
            day = 2 if rewrite and turn == 2 else 1
            if turn == 2:  # past the five minutes, within the hour, for both
                claude.sim.advance(400)
                time.sleep(1.5)
            reply, _ = chat(client, sent(day, convo), model="claude-sonnet-4-5", stream=False)
            convo += [reply, {"role": "user", "content": f"Go on ({turn}). {note}"}]
            claude.sim.advance(5)
        flush(proxy)
    responses = events(proxy.log_dir, f"hour{rewrite}", "response")
    last = responses[2]["cache"]
    hour_part = len(message_tokens(sent(1, convo)[0]))  # the system prompt, as counted
    assert hour_part > 1000
    if not rewrite:  # the hour part read, the rest expired
        assert hour_part - 128 < last["read"] <= hour_part  # (in the simulator's blocks)
        assert last["cause"] == "ttl_expired"
        assert "expired" not in last
        return
    assert last["read"] == 0
    assert (last["cause"], last["location"]) == ("prefix_rewrite", "system")
    assert responses[2]["divergence"]["volatile_kind"] == "date"
    # the rewrite lost about the hour part (estimated by its share of the prompt)
    assert abs(last["waste"] - hour_part) < hour_part * 0.1
    assert last["expired"] > 1000 and last["waste"] + last["expired"] == last["expected"]
    assert last["expired_usd"] > 0 and last["waste_usd"] > 0
    cost = run_cli("sessions", "cost", f"hour{rewrite}", "--json", "--log-dir", str(proxy.log_dir))
    by_cause = json.loads(cost.out)["waste_by_cause"]
    assert by_cause == {"prefix_rewrite": last["waste"], "ttl_expired": last["expired"]}
    show = run_cli("sessions", "show", f"hour{rewrite}", "--log-dir", str(proxy.log_dir))
    assert f"prefix_rewrite@system +{last['expired']:,} ttl_expired" in show.out
    for cause, tokens in by_cause.items():
        labels = {"model": "claude-sonnet-4-5", "cause": cause}
        assert proxy.metric("cachegate_cache_waste_tokens_total", labels) == tokens


def test_another_claude_model_after_five_minutes_is_charged_the_switch_not_the_expiry_too(
    proxy_factory: Any,
) -> None:
    """System prompt marked for an hour, the latest message for five minutes; after a pause
    past five minutes a turn on another Claude model: that model's cache never held the
    prefix, so all of its miss is the switch's. The part past the hour's breakpoint was
    charged as expired on it, and again on the main model's next turn (twice in the metric
    and the session's cost)."""
    rules = SYSTEM_PROMPT + " Follow the style guide." * 500
    note = "lorem ipsum " * 500
    hour = {"type": "ephemeral", "ttl": "1h"}

    def sent(convo: list[dict[str, Any]]) -> list[dict[str, Any]]:
        system = {
            "role": "system",
            "content": [{"type": "text", "text": rules, "cache_control": hour}],
        }
        last = {
            "type": "text",
            "text": convo[-1]["content"],
            "cache_control": {"type": "ephemeral"},
        }
        return [system, *convo[:-1], {**convo[-1], "content": [last]}]

    models = ["claude-sonnet-4-5", "claude-sonnet-4-5", "claude-haiku-4-5", "claude-sonnet-4-5"]
    with run_simulator(SimConfig(dialect="anthropic-compat", cache_ttl_s=300)) as claude:
        proxy = proxy_factory(claude.api_base, config(), clock=lambda: claude.sim.now)
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "switch"})
        convo: list[dict[str, Any]] = [{"role": "user", "content": f"Fix the test. {note}"}]
        for turn, model in enumerate(models):
            if turn == 2:  # past the five minutes, within the hour
                claude.sim.advance(600)
            reply, _ = chat(client, sent(convo), model=model, stream=False)
            if turn != 2:  # (a side call: its answer no part of the history)
                convo += [reply, {"role": "user", "content": f"Go on ({turn}). {note}"}]
            claude.sim.advance(5)
        flush(proxy)
    responses = events(proxy.log_dir, "switch", "response")
    side, back = responses[2]["cache"], responses[3]["cache"]
    assert side["read"] == 0 and side["expected"] > 3000
    assert (side["cause"], side["location"]) == ("params_changed", "params.model")
    assert side["waste"] == side["expected"] and "expired" not in side
    assert back["cause"] == "ttl_expired" and back["waste"] > 1000  # (what expired, once)
    assert (
        proxy.metric(
            "cachegate_cache_waste_tokens_total",
            {"model": "claude-haiku-4-5", "cause": "ttl_expired"},
        )
        == 0
    )


def test_sub_agents_fanned_out_under_a_timed_prompt_are_each_compared_with_their_own(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Two sub-agents under one session id, one task, the minute in their system prompt, taking
    turns: B's turns were compared with A's of the same minute, the closest, and B's own
    rewrites (the minute) went unseen: 0 waste where B missed thousands of tokens. (B's second
    turn still is: the turn both sent alike keeps the first answer, A's.)"""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300))
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "team"})
    base = "You are a coding sub-agent. " + " ".join(f"rule{i} keep it stable" for i in range(300))
    task = {"role": "user", "content": "Team task: please use tool read_file on README.md"}
    history: dict[str, list[dict[str, Any]]] = {"A": [task], "B": [task]}
    for minute in range(1, 5):
        for agent in "AB":
            system = {"role": "system", "content": f"Current time: 10:{minute:02d}\n{base}"}
            reply, _ = chat(client, [system, *history[agent]], stream=False, tools=TOOLS)
            (call,) = reply["tool_calls"]
            history[agent] += [
                reply,
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": f"output {minute} for agent {agent}: " + "lorem ipsum " * 300,
                },
                {"role": "user", "content": f"Agent {agent}: please use tool read_file again"},
            ]
    flush(proxy)
    responses = events(proxy.log_dir, "team", "response")
    b_turns = responses[1::2]  # A1 B1 A2 B2 ...: B's
    reads = [cache_read(r.usage) for r in sim.sim.requests[1::2]]
    prompts = [r.usage["prompt_tokens"] for r in sim.sim.requests[1::2]]
    # B's third and fourth turns continue its own, under a minute that changed: the rewrite,
    # what B missed of its own previous turn's prompt (A kept the system prompt warm)
    for i in (2, 3):
        assert b_turns[i]["divergence"]["location"] == "system"
        assert b_turns[i]["cache"]["cause"] == "prefix_rewrite"
        assert b_turns[i]["cache"]["waste"] == prompts[i - 1] - reads[i] > 1000


def test_an_unmarked_claude_session_against_the_simulator_is_not_requested(
    proxy_factory: Any,
) -> None:
    """The simulator caches for Claude only what a request marks, as Claude does: an agent that
    marks nothing reads nothing, and cachegate says why."""
    with run_simulator(SimConfig(dialect="anthropic-compat")) as claude:
        proxy = proxy_factory(claude.api_base, config())
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "plain-claude"})
        _three_turns_the_last_with_the_time_in_its_prompt(client, "claude-sonnet-4-5")
        flush(proxy)
    responses = events(proxy.log_dir, "plain-claude", "response")
    assert [r["cache"]["read"] for r in responses] == [0, 0, 0]
    assert [r["cache"]["cause"] for r in responses] == [None, "not_requested", "not_requested"]


@pytest.mark.parametrize(
    ("ttl", "then", "cause"),
    [
        ("1h", "1h", "prefix_rewrite"),
        ("5m", "5m", "ttl_expired"),
        ("1h", "5m", "prefix_rewrite"),  # written for an hour: the edit is the miss
        ("5m", "1h", "ttl_expired"),  # written for five minutes: gone, whatever is asked now
    ],
)
def test_claudes_one_hour_breakpoints_keep_the_prefix_for_an_hour_and_cost_twice_the_input(
    scripted: Any, proxy_factory: Any, ttl: str, then: str, cause: str
) -> None:
    """A client that marks its breakpoints ``"ttl": "1h"``: ten minutes idle, then an edited
    system prompt. The miss was charged to an expired cache (the model's five minutes) and the
    one-hour writes priced as five-minute ones (1.25x the input price, where Anthropic bills
    2x). The life is that of the marks that wrote the prefix, not of the next turn's (which
    decided before)."""
    answer = (
        b'{"id":"m1","object":"chat.completion","model":"claude-sonnet-4-5","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":'
        b'{"prompt_tokens":6000,"completion_tokens":5,"cache_read_input_tokens":0,'
        b'"cache_creation_input_tokens":6000,"cache_creation":{"ephemeral_5m_input_tokens":0,'
        b'"ephemeral_1h_input_tokens":6000}}}'
    )
    _upstream, url = scripted(chunks=[answer], content_type=b"application/json")
    now = [1_800_000_000.0]
    proxy = proxy_factory(url, config(), clock=lambda: now[0])
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": f"ttl-{ttl}"})
    mark: dict[str, Any] = {"type": "ephemeral", "ttl": ttl}
    system = {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}
    convo: list[dict[str, Any]] = [system, {"role": "user", "content": "Fix the failing test."}]

    def marked(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        last = history[-1]
        return [
            *history[:-1],
            {**last, "content": [{"type": "text", "text": last["content"]}], "cache_control": mark},
        ]

    reply, _ = chat(client, marked(convo), model="claude-sonnet-4-5", stream=False)
    convo += [reply, {"role": "user", "content": "Go on."}]
    now[0] += 600  # ten minutes: past five, within the hour
    convo[0] = {
        "role": "system",
        "content": [{"type": "text", "text": "Now: 12:00. " + SYSTEM_PROMPT}],
    }
    mark = {"type": "ephemeral", "ttl": then}
    chat(client, marked(convo), model="claude-sonnet-4-5", stream=False)
    flush(proxy)
    first, second = events(proxy.log_dir, f"ttl-{ttl}", "response")
    assert (second["cache"]["waste"], second["cache"]["cause"]) == (6000, cause)
    written_for_an_hour = 6000 * 2 * 3.00  # the usage says so, whatever the mark
    assert first["cost"]["actual"] == pytest.approx((written_for_an_hour + 5 * 15.00) / 1e6)


@pytest.mark.parametrize(
    ("marks", "hour_share"),
    [
        (("1h", "1h"), 1.0),  # every breakpoint an hour's: every write too
        (("5m", "5m"), 0.0),
        ((None, "5m"), 0.0),
        (("1h", "5m"), None),  # the system prompt's hour, the task's five minutes: a share
        (("1h", "plain"), None),  # (a breakpoint that names no life: five minutes)
    ],
)
def test_claudes_one_hour_writes_through_openrouter_are_priced_as_an_hours(
    scripted: Any, proxy_factory: Any, marks: tuple[str | None, str], hour_share: float | None
) -> None:
    """OpenRouter gives Claude's cache writes as one total (``cache_write_tokens``), without
    Anthropic's split by cache life: every write was priced at the five-minute rate (1.25x the
    input price), 37% under the bill for a request whose breakpoints ask for an hour (2x). The
    request's own marks tell the hour's share."""
    answer = (
        b'{"id":"gen-1","object":"chat.completion","model":"anthropic/claude-sonnet-4.5",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'
        b'"finish_reason":"stop"}],"usage":{"prompt_tokens":6179,"completion_tokens":10,'
        b'"prompt_tokens_details":{"cached_tokens":0,"cache_write_tokens":6179}}}'
    )
    _upstream, url = scripted(chunks=[answer], content_type=b"application/json")
    proxy = proxy_factory(url, config())
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "or-claude"})

    def part(text: str, ttl: str | None) -> dict[str, Any]:
        marked: dict[str, Any] = {"type": "text", "text": text}
        if ttl == "plain":
            marked["cache_control"] = {"type": "ephemeral"}
        elif ttl is not None:
            marked["cache_control"] = {"type": "ephemeral", "ttl": ttl}
        return marked

    system, task = marks
    messages = [
        {"role": "system", "content": [part("one hour rules. " * 1500, system)]},
        {"role": "user", "content": [part("hello " * 100, task)]},
    ]
    chat(client, messages, model="anthropic/claude-sonnet-4.5", stream=False)
    flush(proxy)
    (line,) = events(proxy.log_dir, "or-claude", "response")
    five, hour, output = 6179 * 3.75, 6179 * 6.00, 10 * 15.00  # claude-sonnet-4-5's prices
    if hour_share is not None:
        expected = (hour_share * hour + (1 - hour_share) * five + output) / 1e6
        assert line["cost"]["actual"] == pytest.approx(expected)
    else:  # the system prompt (an hour's) is nearly all of it
        assert (0.9 * hour + output) / 1e6 < line["cost"]["actual"] < (hour + output) / 1e6


_HOUR = {"type": "ephemeral", "ttl": "1h"}


def _hour_system(text: str) -> dict[str, Any]:
    """A system prompt marked for an hour."""
    return {"role": "system", "content": [{"type": "text", "text": text, "cache_control": _HOUR}]}


def _marked(*parts: dict[str, Any], text: str) -> dict[str, Any]:
    """A user message of ``parts`` and ``text``, marked for five minutes at its end."""
    last = {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}
    return {"role": "user", "content": [*parts, last]}


def _priced_through_openrouter(
    scripted: Any, proxy_factory: Any, messages: list[Any], prompt: int, written: int
) -> float:
    """The logged cost of ``messages`` sent to Claude through an OpenRouter-like upstream that
    answers ``prompt`` tokens, ``written`` of them written to the cache as one total."""
    answer = (
        b'{"id":"gen-1","object":"chat.completion","model":"anthropic/claude-sonnet-4.5",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'
        b'"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":10,'
        b'"prompt_tokens_details":{"cached_tokens":0,"cache_write_tokens":%d}}}'
    ) % (prompt, written)
    _upstream, url = scripted(chunks=[answer], content_type=b"application/json")
    proxy = proxy_factory(url, config())
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "or-share"})
    chat(client, messages, model="anthropic/claude-sonnet-4.5", stream=False)
    flush(proxy)
    (line,) = events(proxy.log_dir, "or-share", "response")
    return float(line["cost"]["actual"])


def _bill(written: int, hour_share: float, fresh: int) -> float:
    """Claude Sonnet 4.5's bill (USD) for ``written`` cache writes, ``hour_share`` of them an
    hour's, ``fresh`` input tokens and 10 of output."""
    five, hour = written * (1 - hour_share) * 3.75, written * hour_share * 6.00
    return (five + hour + fresh * 3.00 + 10 * 15.00) / 1e6


def test_claudes_one_hour_writes_through_openrouter_with_a_tail_past_the_last_breakpoint(
    scripted: Any, proxy_factory: Any
) -> None:
    """A system prompt marked for an hour, the task for five minutes, then a long message no
    breakpoint covers (written to no cache): the hour's share of the writes was taken of the
    reads and writes alone, not of the whole prompt, so the tail halved it here (3,050 of the
    6,179 tokens written taken as an hour's, where ~6,030 were: the answer 8% under its bill)."""
    messages = [
        _hour_system("one hour rules. " * 1500),
        _marked(text="hello " * 100),
        {"role": "assistant", "content": "Reading the log."},
        {"role": "user", "content": "tail text. " * 2180},
    ]
    cost = _priced_through_openrouter(scripted, proxy_factory, messages, 12207, 6179)
    # the system prompt is ~97% of what was written: so, about, of the hour's writes
    assert _bill(6179, 0.9, 12207 - 6179) < cost <= _bill(6179, 1.0, 12207 - 6179)


def test_an_hour_breakpoint_under_claudes_minimum_through_openrouter_is_no_hours_write(
    scripted: Any, proxy_factory: Any
) -> None:
    """A system prompt of ~300 tokens marked for an hour (under Sonnet's 1,024, which Claude
    caches not at all, so not for an hour), the task for five minutes: the writes are all the
    five minutes', as Anthropic's own split says. Its share was priced as an hour's (2x the
    input where 1.25x was billed)."""
    messages = [
        _hour_system("Rules. " * 300),
        _marked(text="hello " * 2000),
    ]
    cost = _priced_through_openrouter(scripted, proxy_factory, messages, 2400, 2390)
    assert cost == pytest.approx(_bill(2390, 0.0, 10))


def test_claudes_one_hour_writes_through_openrouter_beside_a_screenshot(
    scripted: Any, proxy_factory: Any
) -> None:
    """A system prompt marked for an hour, then a screenshot and a question marked for five
    minutes: the hour's share was weighed by the JSON's bytes, the image's base64 (300 KB)
    among them, so 6% of the writes were an hour's where ~90% were (the answer ~30% under its
    bill). Weighed as the provider counts, an image by its pixels."""
    from tests.test_media import png, url_part

    screenshot = url_part(png(1000, 800, noisy_rows=800))
    assert len(screenshot["image_url"]["url"]) > 200_000
    messages = [
        _hour_system("You follow the rules. " * 1200),
        _marked(screenshot, text="What is wrong here?"),
    ]
    cost = _priced_through_openrouter(scripted, proxy_factory, messages, 7100, 7090)
    # the system prompt is ~90% of the prompt by the provider's count (the image ~765 tokens)
    assert _bill(7090, 0.8, 10) < cost <= _bill(7090, 1.0, 10)


def test_claudes_one_hour_writes_through_openrouter_beside_a_document(
    scripted: Any, proxy_factory: Any
) -> None:
    """A system prompt marked for an hour, then a PDF of ~25 pages and a question marked for
    five minutes: a document's pages are not known, and weighed at a flat 1,600 tokens its
    message made the hour's share of the writes 80% where it was ~12% (that turn's writes
    ~38% over their bill). A document is weighed by its bytes."""
    import base64
    import random

    document = base64.b64encode(random.Random(7).randbytes(500_000)).decode()
    pdf = {
        "type": "file",
        "file": {"filename": "spec.pdf", "file_data": f"data:application/pdf;base64,{document}"},
    }
    messages = [_hour_system("You follow the rules. " * 1200), _marked(pdf, text="Summarize it.")]
    cost = _priced_through_openrouter(scripted, proxy_factory, messages, 56700, 56690)
    # the system prompt is ~6,600 tokens of the 56,700: a quarter of the writes an hour's, at most
    assert _bill(56690, 0.0, 10) <= cost < _bill(56690, 0.25, 10)


def _three_turns_the_last_with_the_time_in_its_prompt(client: Any, model: str) -> None:
    """A conversation of three turns on a system prompt well past 1,024 tokens; the third turn
    puts the time at its start (a rewrite the provider misses)."""
    system = SYSTEM_PROMPT + " Follow the style guide." * 700
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Fix the failing test."},
    ]
    for turn in range(3):
        if turn == 2:
            convo[0] = {"role": "system", "content": "Now: 12:00. " + system}
        reply, _ = chat(client, convo, model=model, stream=False)
        convo += [reply, {"role": "user", "content": f"Go on ({turn})."}]


@pytest.mark.parametrize("edited", [False, True])
def test_a_claude_agent_that_marks_only_its_system_prompt_is_told_what_it_did_not_ask(
    proxy_factory: Any, edited: bool
) -> None:
    """Claude caches up to the last mark: an agent marking only its system prompt reads that
    and misses the conversation after it every turn. The miss read as "unexplained" (an
    eviction); it is "not_requested". A marked system prompt the cache lacked (edited) is
    written again: that miss keeps its cause, for what had been cached."""
    system = SYSTEM_PROMPT + " Follow the style guide." * 700
    marked = {
        "role": "system",
        "content": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
    }
    with run_simulator(SimConfig(dialect="anthropic-compat")) as claude:
        proxy = proxy_factory(claude.api_base, config())
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "system-mark"})
        convo: list[dict[str, Any]] = [marked, {"role": "user", "content": "Fix the test. " * 400}]
        for turn in range(3):
            if turn == 2 and edited:
                convo[0] = {
                    **marked,
                    "content": [{**marked["content"][0], "text": "Now: 12:00. " + system}],
                }
            reply, _ = chat(client, convo, model="claude-sonnet-4-5", stream=False)
            convo += [reply, {"role": "user", "content": f"Go on ({turn}). " * 400}]
        flush(proxy)
    caches = [r["cache"] for r in events(proxy.log_dir, "system-mark", "response")]
    assert caches[0]["write"] > 1024 and caches[1]["read"] == caches[0]["write"]
    assert caches[1]["write"] == 0 and caches[1]["waste"] > 1000
    assert caches[1]["cause"] == "not_requested"
    if edited:
        assert caches[2]["write"] > 0
        assert (caches[2]["cause"], caches[2]["location"]) == ("prefix_rewrite", "system")
        # The rewrite lost what was cached, the marked system prompt; the history after it,
        # which no turn could read, is counted apart, as on the turns before (it was all
        # charged to the rewrite)
        assert caches[2]["waste"] == caches[1]["read"] + caches[1]["write"] - caches[2]["read"]
        rest = caches[2]["expected"] - caches[2]["read"] - caches[2]["waste"]
        assert rest > 1000 and caches[2]["not_requested"] == rest
        labels = {"model": "claude-sonnet-4-5", "cause": "not_requested"}
        assert proxy.metric("cachegate_cache_waste_tokens_total", labels) == (
            caches[1]["waste"] + rest
        )
        cost = run_cli("sessions", "cost", "system-mark", "--log-dir", str(proxy.log_dir))
        by_cause = dict(line.split()[:2] for line in cost.out.splitlines() if line.startswith("  "))
        assert by_cause["not_requested"] == f"{caches[1]['waste'] + rest:,}"
        assert by_cause["prefix_rewrite"] == f"{caches[2]['waste']:,}"
        show = run_cli("sessions", "show", "system-mark", "--log-dir", str(proxy.log_dir))
        assert f"prefix_rewrite@system +{rest:,} not_requested" in show.out
    else:
        assert caches[2]["cause"] == "not_requested"


@pytest.mark.parametrize("short", [False, True], ids=["read-all-marked", "marked-too-short"])
def test_claude_through_openrouter_marking_only_its_system_prompt_is_told_the_same(
    scripted: Any, proxy_factory: Any, short: bool
) -> None:
    """The same agent as above through OpenRouter, whose usage says ``cached_tokens`` and
    ``cache_write_tokens`` (not Anthropic's fields): every turn's miss read "unexplained", when
    it read all it marked, and when what it marked was too short to be cached at all."""
    cached = 0 if short else 2000
    answer = (
        b'{"id":"g1","object":"chat.completion","model":"anthropic/claude-sonnet-4.5","choices":'
        b'[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":3600,"completion_tokens":5,"prompt_tokens_details":'
        b'{"cached_tokens":%d,"cache_write_tokens":0}}}' % cached
    )
    _upstream, url = scripted(chunks=[answer], content_type=b"application/json")
    proxy = proxy_factory(url, config())
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "or-system-mark"})
    system = "Be brief." if short else SYSTEM_PROMPT + " Follow the style guide." * 700
    marked = {
        "role": "system",
        "content": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
    }
    convo: list[dict[str, Any]] = [marked, {"role": "user", "content": "Fix the test. " * 500}]
    for turn in range(2):
        reply, _ = chat(client, convo, model="anthropic/claude-sonnet-4.5", stream=False)
        convo += [reply, {"role": "user", "content": f"Go on ({turn})."}]
    flush(proxy)
    caches = [r["cache"] for r in events(proxy.log_dir, "or-system-mark", "response")]
    assert caches[1]["read"] == cached and caches[1]["waste"] == 3600 - cached
    assert caches[1]["cause"] == "not_requested"


class _OpenRouterUsage:
    """Raw ASGI: chat requests sent on to an Anthropic-style simulator, its answers' usage given
    as OpenRouter gives Claude's (``prompt_tokens_details``: ``cached_tokens`` and
    ``cache_write_tokens``), and the model named as OpenRouter names it."""

    def __init__(self, target: str) -> None:
        self.target = target

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        import httpx
        import orjson

        if scope["type"] == "lifespan":
            await asgi_lifespan(receive, send)
            return
        body = orjson.loads(await asgi_body(receive))
        body["model"] = "claude-sonnet-4-5"
        async with httpx.AsyncClient() as client:
            answer = (await client.post(self.target + "/chat/completions", json=body)).json()
        usage = answer["usage"]
        usage["prompt_tokens_details"] = {
            "cached_tokens": usage.pop("cache_read_input_tokens"),
            "cache_write_tokens": usage.pop("cache_creation_input_tokens"),
        }
        usage.pop("cache_creation", None)
        answer["model"] = "anthropic/claude-sonnet-4.5"
        payload = orjson.dumps(answer)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})


def test_claude_through_openrouter_splits_a_rewrite_from_what_was_never_cached(
    proxy_factory: Any,
) -> None:
    """An edit deep in the history of an agent that marks its latest message, then a turn that
    marked only its system prompt: with OpenRouter's usage fields the whole shortfall was the
    rewrite's, where Anthropic's own fields (the same tokens) split off what the previous turn
    never cached, as ``not_requested``."""
    from proxy.serving import ServerThread

    system = SYSTEM_PROMPT + " Follow the style guide." * 300
    marked = {"type": "ephemeral"}

    def sent(history: list[dict[str, Any]], mark: bool = True) -> list[dict[str, Any]]:
        if not mark:
            return history
        last = history[-1]
        content = [{"type": "text", "text": last["content"], "cache_control": marked}]
        return [*history[:-1], {**last, "content": content}]

    caches: dict[str, list[dict[str, Any]]] = {}
    for route in ("anthropic", "openrouter"):
        with run_simulator(SimConfig(dialect="anthropic-compat")) as claude:
            if route == "openrouter":
                stack = ServerThread(_OpenRouterUsage(claude.api_base))
                url = stack.__enter__().url + "/v1"
                model = "anthropic/claude-sonnet-4.5"
            else:
                stack, url, model = None, claude.api_base, "claude-sonnet-4-5"
            try:
                proxy = proxy_factory(url, config())
                client = make_client(proxy.base_url, default_headers={"X-Session-Id": route})
                convo: list[dict[str, Any]] = [
                    {"role": "system", "content": [{"type": "text", "text": system}]},
                    {"role": "user", "content": "Fix the test. " * 300},
                ]
                for turn in range(4):
                    if turn == 3:
                        convo[1] = {**convo[1], "content": convo[1]["content"] + " (edited)"}
                    reply, _ = chat(client, sent(convo, mark=turn != 2), model=model, stream=False)
                    convo += [reply, {"role": "user", "content": f"Go on ({turn}). " * 300}]
                flush(proxy)
            finally:
                if stack is not None:
                    stack.__exit__(None, None, None)
        caches[route] = [r["cache"] for r in events(proxy.log_dir, route, "response")]
    last = caches["anthropic"][3]
    assert last["cause"] == "prefix_rewrite" and last["not_requested"] > 1000
    assert caches["openrouter"] == caches["anthropic"]


@pytest.mark.parametrize(
    ("model", "read_later"),
    [
        ("meta-llama/llama-3.3-70b-instruct", 0),
        ("meta-llama/llama-3.3-70b-instruct", 2000),
        ("gpt-4o", 0),
    ],
)
def test_a_model_not_known_to_cache_is_judged_once_its_session_reads_the_cache(
    scripted: Any, proxy_factory: Any, model: str, read_later: int
) -> None:
    """OpenRouter writes ``cached_tokens: 0`` in the usage of every model, those that never
    cache too (Llama, Qwen on hosts without a cache; vLLM with token details but no prefix
    caching): each turn's whole previous prompt was an ``unexplained`` waste, blamed on the
    provider. A model cachegate does not know to cache is judged once its session has read
    the cache; OpenAI's misses are judged from the first."""
    usages = [(2000, 0), (3200, 0), (4400, read_later), (5600, 0)]
    answers = [
        b'{"id":"o%d","object":"chat.completion","model":"m","choices":[{"index":0,"message":'
        b'{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":'
        b'%d,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":%d,'
        b'"cache_write_tokens":0}}}' % (n, prompt, read)
        for n, (prompt, read) in enumerate(usages)
    ]
    upstream, url = scripted(chunks=[answers[0]], content_type=b"application/json")
    proxy = proxy_factory(url, config())
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "or"})
    convo: list[dict[str, Any]] = [{"role": "user", "content": "Fix the test. " * 500}]
    for turn in range(4):
        upstream.chunks = [answers[turn]]
        reply, _ = chat(client, convo, model=model, stream=False)
        convo += [reply, {"role": "user", "content": f"Go on ({turn}). " * 300}]
    flush(proxy)
    wastes = [(r["cache"] or {}).get("waste", 0) for r in events(proxy.log_dir, "or", "response")]
    if model == "gpt-4o":
        assert wastes == [0, 2000, 3200, 4400]
    elif read_later:
        assert wastes == [0, 0, 1200, 4400]  # (judged from its first read on)
    else:
        assert wastes == [0, 0, 0, 0]


def test_another_models_read_of_0_does_not_start_judging_one_not_known_to_cache(
    scripted: Any, proxy_factory: Any
) -> None:
    """An agent's title request on gpt-4o-mini (opencode sends one) in the session of a model
    not known to cache, through OpenRouter (``cached_tokens: 0`` in every usage): the small
    model's read of 0 made every later turn of the other an ``unexplained`` or rewrite waste,
    where the session had read and written nothing."""
    usages = [("gpt-4o-mini", 10), *(("qwen/qwen3-coder", p) for p in (2000, 3200, 4400))]
    answers = [
        b'{"id":"o%d","object":"chat.completion","model":"m","choices":[{"index":0,"message":'
        b'{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":'
        b'%d,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":0,'
        b'"cache_write_tokens":0}}}' % (n, prompt)
        for n, (_, prompt) in enumerate(usages)
    ]
    upstream, url = scripted(chunks=[answers[0]], content_type=b"application/json")
    proxy = proxy_factory(url, config())
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "titled"})
    title = [{"role": "user", "content": "A title for: fix the test"}]
    chat(client, title, model="gpt-4o-mini", stream=False)
    convo: list[dict[str, Any]] = [{"role": "user", "content": "Fix the test. " * 500}]
    for turn in (1, 2, 3):
        upstream.chunks = [answers[turn]]
        reply, _ = chat(client, convo, model=usages[turn][0], stream=False)
        convo += [reply, {"role": "user", "content": f"Go on ({turn}). " * 300}]
    flush(proxy)
    lines = events(proxy.log_dir, "titled", "response")
    assert [(r["cache"] or {}).get("waste", 0) for r in lines] == [0, 0, 0, 0]


@pytest.mark.parametrize("retention", ["24h", None])
def test_an_agent_back_after_an_hour_under_extended_retention_reads_its_prefix(
    sim: RunningSimulator, proxy_factory: Any, retention: str | None
) -> None:
    """``prompt_cache_retention: "24h"``: an agent back after an hour reads its prefix, and
    nothing is wasted; without it the hour is past OpenAI's cache life, an expiry. (The
    simulator kept every prefix its own few minutes, and cachegate, expecting the read, named
    the miss ``unexplained``.)"""
    proxy = proxy_factory(sim.api_base, config(), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "kept-a-day"})
    extra = {"prompt_cache_retention": retention} if retention else {}
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT * 3},  # (past the 1,024 tokens cached)
        {"role": "user", "content": "Fix the failing handler."},
    ]
    for turn in range(2):
        if turn:
            sim.sim.advance(3_600)
        answer = client.chat.completions.create(
            model="gpt-4o",
            messages=convo,  # type: ignore[arg-type]
            extra_body=extra,
        )
        convo += [
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": "Go on."},
        ]
    flush(proxy)
    last = events(proxy.log_dir, "kept-a-day", "response")[-1]["cache"]
    if retention:
        assert last["read"] > 1000 and last["waste"] == 0
    else:
        assert last["read"] == 0 and last["cause"] == "ttl_expired"


@pytest.mark.parametrize("model", ["claude-3-5-haiku-20241022", "claude-sonnet-4-5"])
def test_a_prompt_under_a_haiku_3_models_minimum_is_no_waste(
    proxy_factory: Any, model: str
) -> None:
    """Claude's Haiku 3 models cache nothing shorter than 2,048 tokens: cachegate had no entry
    for them, and a marked prompt of ~1,560 tokens, rightly never read, was an unexplained
    waste every turn (Sonnet caches it: read, no waste either)."""
    mark = {"type": "ephemeral"}

    def marked(message: dict[str, Any]) -> dict[str, Any]:
        part = {"type": "text", "text": message["content"], "cache_control": mark}
        return {**message, "content": [part]}

    head = marked({"role": "system", "content": SYSTEM_PROMPT + " Follow the guide." * 120})
    with run_simulator(SimConfig(dialect="anthropic-compat", cache_ttl_s=300)) as claude:
        proxy = proxy_factory(claude.api_base)
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "haiku"})
        convo = [head, marked({"role": "user", "content": "Fix it."})]
        for _turn in range(2):
            reply, _ = chat(client, convo, model=model, stream=False)
            claude.sim.advance(5)
            convo = [head, convo[1], reply, marked({"role": "user", "content": "Go on."})]
        flush(proxy)
    last = events(proxy.log_dir, "haiku", "response")[-1]["cache"]
    assert last["waste"] == 0, last
    assert (last["read"] > 1000) is (model == "claude-sonnet-4-5")


def test_the_waste_of_a_model_with_no_prices_has_no_price(
    scripted: Any, proxy_factory: Any
) -> None:
    """A local model with no prices (one that caches: its entry gives its cache's life): its
    waste is in tokens, with no dollars (it said $0.0000, as if the waste had cost nothing)."""
    answer = (
        b'{"id":"l1","object":"chat.completion","model":"my-local-llm","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":'
        b'{"prompt_tokens":3600,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":0}}}'
    )
    _upstream, url = scripted(chunks=[answer], content_type=b"application/json")
    settings = config()
    settings["models"]["my-local-llm"] = {"cache_ttl_s": 300}
    proxy = proxy_factory(url, settings)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "local"})
    convo: list[dict[str, Any]] = [{"role": "user", "content": "Fix the test. " * 500}]
    for turn in range(2):
        reply, _ = chat(client, convo, model="my-local-llm", stream=False)
        convo += [reply, {"role": "user", "content": f"Go on ({turn})."}]
    flush(proxy)
    second = events(proxy.log_dir, "local", "response")[1]
    assert second["cache"]["waste"] == 3600 and "waste_usd" not in second["cache"]
    cost = run_cli("sessions", "cost", "local", "--log-dir", str(proxy.log_dir), "--json").json()
    assert (cost["waste_tokens"], cost["waste_usd"]) == (3600, None)


def test_a_rewrite_after_a_turn_that_marked_less_loses_what_the_turns_before_cached(
    proxy_factory: Any,
) -> None:
    """Claude: marked turns cache the whole history; one turn marks only its system prompt
    (its latest message sent unmarked), the next marks its latest and edits the first message.
    What the turns before cached was still held: the edit lost it, a prefix rewrite. It read
    as "not_requested" (only the turn just before was looked at, and it had cached the system
    prompt alone), with advice to mark the latest message, which that turn did."""
    system = SYSTEM_PROMPT + " Follow the style guide." * 700

    def marked(role: str, text: str) -> dict[str, Any]:
        part = {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}
        return {"role": role, "content": [part]}

    with run_simulator(SimConfig(dialect="anthropic-compat")) as claude:
        proxy = proxy_factory(claude.api_base, config())
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "marked-less"})
        convo: list[dict[str, Any]] = [
            marked("system", system),
            {"role": "user", "content": "Fix the test. " * 400},
        ]
        for turn in range(4):
            sent = [*convo[:-1], marked("user", convo[-1]["content"])] if turn != 2 else convo
            if turn == 3:
                sent[1] = {"role": "user", "content": "Fix the tests. " * 400}
            reply, _ = chat(client, sent, model="claude-sonnet-4-5", stream=False)
            convo += [reply, {"role": "user", "content": f"Go on ({turn}). " * 400}]
        flush(proxy)
    caches = [r["cache"] for r in events(proxy.log_dir, "marked-less", "response")]
    assert caches[1]["read"] > 0 and caches[1]["cause"] is None
    assert caches[2]["write"] == 0 and caches[2]["cause"] == "not_requested"
    last = caches[3]
    assert (last["cause"], last["location"]) == ("prefix_rewrite", "messages[1].content")
    # the second turn's whole prompt was cached: all of it past the system prompt was lost
    assert caches[1]["read"] + caches[1]["write"] > last["expected"] - 1024
    assert last["waste"] == last["expected"] - last["read"] > 3000
    assert not last.get("not_requested")


def test_a_claude_agent_whose_marked_prefix_is_too_short_to_cache_is_told_so(
    proxy_factory: Any,
) -> None:
    """A marked system prompt under Claude's 1,024-token minimum: nothing is read or written,
    every turn. That read as "unexplained" (an eviction); nothing cacheable was asked."""
    marked = {
        "role": "system",
        "content": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    }
    with run_simulator(SimConfig(dialect="anthropic-compat")) as claude:
        proxy = proxy_factory(claude.api_base, config())
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "short-mark"})
        convo: list[dict[str, Any]] = [marked, {"role": "user", "content": "Fix the test. " * 400}]
        for turn in range(3):
            reply, _ = chat(client, convo, model="claude-sonnet-4-5", stream=False)
            convo += [reply, {"role": "user", "content": f"Go on ({turn}). " * 400}]
        flush(proxy)
    caches = [r["cache"] for r in events(proxy.log_dir, "short-mark", "response")]
    assert [(c["read"], c["write"]) for c in caches] == [(0, 0)] * 3
    assert [c["cause"] for c in caches] == [None, "not_requested", "not_requested"]
    assert caches[2]["waste"] > 2000


def _sent_and_cut(
    proxy_factory: Any,
    policy: str,
    session: str,
    task: str,
    rounds: list[list[dict[str, Any]]],
) -> tuple[Any, list[dict[str, Any]]]:
    """A history of a system prompt, a task and tool rounds sent through cachegate (with
    ``orphan_policy``), then sent again with the task and the first round's call cut by a
    sliding window: the proxy, its log flushed, and the first history."""
    with run_simulator(SimConfig()) as sim:
        proxy = proxy_factory(sim.api_base, {**config(), "pairing": {"orphan_policy": policy}})
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": session})
        convo: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT * 20},
            {"role": "user", "content": task},
        ]
        for messages in rounds:
            convo += messages
        chat(client, convo, stream=False)
        chat(client, [convo[0], *convo[3:]], stream=False)  # the task and the first call cut
        flush(proxy)
    return proxy, convo


@pytest.mark.parametrize("policy", ["downgrade", "drop"])
def test_a_history_trimmed_past_a_call_names_the_first_message_dropped(
    proxy_factory: Any, policy: str
) -> None:
    """A sliding window that cuts between a call and its result: the result left is an orphan,
    which cachegate repairs (a user message in its place, or dropped). The location is where
    the client's history lost its messages, messages[1], under either policy: not an edit of
    the repaired message, nor the place after the one a repair dropped."""

    def call(i: int) -> dict[str, Any]:
        fn = {"name": "read", "arguments": "{}"}
        return {"role": "assistant", "content": None,
                "tool_calls": [{"id": f"call_{i:024d}", "type": "function", "function": fn}]}  # fmt: skip

    def result(i: int) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": f"call_{i:024d}", "content": f"file {i} " * 300}

    rounds = [[call(i), result(i)] for i in range(4)]
    proxy, _ = _sent_and_cut(proxy_factory, policy, "window", "Task " * 300, rounds)
    second = events(proxy.log_dir, "window", "response")[1]
    divergence = second["divergence"]
    assert (divergence["index"], divergence["field"], divergence["new"]) == (1, None, "")
    assert divergence["old"].startswith("Task Task")
    assert second["cache"]["location"] == "messages[1]"


@pytest.mark.parametrize("policy", ["downgrade", "drop"])
def test_a_trim_that_cut_a_round_of_parallel_calls_counts_the_results_kept_as_expected(
    proxy_factory: Any, policy: str
) -> None:
    """A sliding window that cuts the task and an assistant message of three parallel calls,
    keeping their results: cachegate repairs each into a user message, and counted them as
    messages gone too, so what should have been read (and the waste) came out ~2,400 tokens
    short, the same as a trim that drops the results as well. Under the ``drop`` policy they
    are gone from what the provider gets: not expected."""

    def round_(turn: int) -> list[dict[str, Any]]:
        ids = [f"call_{turn}{k}" + "0" * 20 for k in range(3)]
        fn = {"name": "read", "arguments": "{}"}
        calls = [{"id": i, "type": "function", "function": fn} for i in ids]
        results = [{"role": "tool", "tool_call_id": i, "content": f"file {i} " * 200} for i in ids]
        return [{"role": "assistant", "content": None, "tool_calls": calls}, *results]

    rounds = [round_(turn) for turn in range(3)]
    proxy, convo = _sent_and_cut(proxy_factory, policy, "cut-round", "Task " * 100, rounds)
    first, second = events(proxy.log_dir, "cut-round", "response")
    gone = convo[1:3] if policy == "downgrade" else convo[1:6]  # (dropped: its results too)
    should = first["usage"]["prompt"] - sum(len(message_tokens(m)) for m in gone)
    assert abs(second["cache"]["expected"] - should) < 0.05 * should, (second["cache"], should)
    assert second["cache"]["waste"] == second["cache"]["expected"] - second["usage"]["cache_read"]


@pytest.mark.parametrize("policy", ["downgrade", "drop"])
def test_messages_cut_after_an_orphan_all_along_are_named_after_it(
    proxy_factory: Any, policy: str
) -> None:
    """An orphaned result (its call long gone) the client keeps sending, repaired every turn;
    the client then deletes the turn after it: the messages vanished after the orphan, at the
    client's messages[4], not before it."""

    def text(role: str, words: str) -> dict[str, Any]:
        return {"role": role, "content": words * 200}

    orphan = {"role": "tool", "tool_call_id": "call_" + "7" * 24, "content": "file 7 " * 300}
    with run_simulator(SimConfig()) as sim:
        proxy = proxy_factory(sim.api_base, {**config(), "pairing": {"orphan_policy": policy}})
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "kept-orphan"})
        first = [
            {"role": "system", "content": SYSTEM_PROMPT * 20},
            text("user", "Task "),
            text("assistant", "Sure. "),
            orphan,
            text("user", "Second "),
            text("assistant", "Second answer "),
            text("user", "Third "),
        ]
        chat(client, first, stream=False)
        chat(client, [*first[:4], first[6], text("assistant", "Third answer "),
                      text("user", "Fourth ")], stream=False)  # fmt: skip
        flush(proxy)
    divergence = events(proxy.log_dir, "kept-orphan", "response")[1]["divergence"]
    assert (divergence["index"], divergence["field"]) == (4, None)
    assert divergence["old"].startswith("Second Second")


def test_claude_behind_a_gateway_that_marks_for_the_client_gets_the_usual_causes(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A gateway that adds the breakpoints itself (LiteLLM's cache_control_injection_points,
    Bifrost): the client marks nothing, yet the cache is read. Its system-prompt rewrite is a
    prefix_rewrite, not "nothing was asked of the cache" (the simulator's ``cache_unmarked``
    caches unmarked prefixes, as such a gateway makes Claude do)."""
    with run_simulator(SimConfig(dialect="anthropic-compat", cache_unmarked=True)) as claude:
        proxy = proxy_factory(claude.api_base, config())
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "injected"})
        _three_turns_the_last_with_the_time_in_its_prompt(client, "claude-sonnet-4-5")
        flush(proxy)
    responses = events(proxy.log_dir, "injected", "response")
    assert responses[1]["cache"]["read"] > 0 and responses[1]["cache"]["waste"] == 0
    assert responses[2]["cache"]["cause"] == "prefix_rewrite"
    assert responses[2]["cache"]["location"] == "system"


def test_a_copy_answered_first_is_no_baseline_for_the_one_sent_before_it(
    proxy_factory: Any,
) -> None:
    """Two sub-agents fanned out with one task: the first sent streams slowly, the second is
    answered first. The first could not have read a prefix the second wrote after it went out,
    yet it was charged its whole prompt as "unexplained" waste."""
    import threading

    with run_simulator(SimConfig(chunk_ms=30)) as sim:
        proxy = proxy_factory(sim.api_base, config())
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "fanned"})
        task: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT + " Follow the style guide." * 600},
            {"role": "user", "content": "Fix the failing test."},
        ]
        sim.sim.enqueue([parse_script("word " * 40)])  # the first one's answer: ~1.2 s
        started = threading.Event()

        def first() -> None:
            stream = client.chat.completions.create(model="gpt-4o", messages=task, stream=True)
            for _chunk in stream:
                started.set()

        slow = threading.Thread(target=first)
        slow.start()
        assert started.wait(20)
        chat(client, task, stream=False)  # sent second, answered first
        slow.join(20)
        flush(proxy)
    second, first_sent = events(proxy.log_dir, "fanned", "response")
    assert first_sent["exchange"] == 1 and second["exchange"] == 2
    assert first_sent["cache"]["expected"] == 0 and first_sent["cache"]["waste"] == 0
    assert (
        proxy.metric(
            "cachegate_cache_waste_tokens_total", {"model": "gpt-4o", "cause": "unexplained"}
        )
        == 0
    )


def test_a_clock_that_stands_still_hides_no_rewrite(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Whether a baseline was read before a request went out is judged on the monotonic clock:
    with an injected clock that does not move (an embedder's, a test's), every turn read as sent
    before its baseline was read, and a system-prompt rewrite went unreported."""
    proxy = proxy_factory(sim.api_base, config(), clock=lambda: 1_800_000_000.0)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "frozen"})
    _three_turns_the_last_with_the_time_in_its_prompt(client, "gpt-4o")
    flush(proxy)
    third = events(proxy.log_dir, "frozen", "response")[2]
    assert (third["cache"]["cause"], third["cache"]["location"]) == ("prefix_rewrite", "system")


def test_a_rewrite_in_a_repaired_history_is_located_in_the_clients_own_messages(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The repair inserts a synthetic result for an interrupted call; the client then edits a
    message after it. The waste's location and the divergence count in the client's history, as
    the repair notes of the same row do: they named the message after the one it edited."""
    proxy = proxy_factory(sim.api_base, config())
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "repaired-edit"})
    call = {
        "id": "call_a",
        "type": "function",
        "function": {"name": "read_file", "arguments": "{}"},
    }
    long_tail = " ".join(f"word{i}" for i in range(2000))
    history: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "read a"},
        {"role": "assistant", "content": None, "tool_calls": [call]},  # interrupted: no result
        {"role": "user", "content": "steer"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "EDIT ME: original"},
        {"role": "assistant", "content": "k"},
        {"role": "user", "content": long_tail},
    ]
    _, first = chat(client, history, stream=False, tools=TOOLS)
    edited = [*history[:5], {"role": "user", "content": "EDIT ME: changed"}, *history[6:]]
    _, second = chat(client, edited, stream=True, tools=TOOLS)
    assert first["x-cachegate-repairs"] == second["x-cachegate-repairs"] == "1"
    assert len(sim.sim.requests[1].body["messages"]) == 9  # (the synthetic result forwarded)
    flush(proxy)
    response = events(proxy.log_dir, "repaired-edit", "response")[1]
    assert response["cache"]["cause"] == "prefix_rewrite"
    assert response["cache"]["location"] == "messages[5].content"
    assert response["divergence"]["index"] == 5
    assert response["divergence"]["role"] == "user"
    assert "EDIT ME: changed" in response["divergence"]["new"]
    request = events(proxy.log_dir, "repaired-edit", "request")[1]
    assert [r["index"] for r in request["repairs"]] == [2]  # the same history's numbering


def test_a_browser_agent_keeping_only_its_latest_screenshot_wastes_nothing(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Each turn a browser agent sends a screenshot and replaces the one before by a line of
    text: the provider reads everything up to that image again, and what it no longer holds is
    the image alone. The simulator billed an image by its base64 (~10,000 tokens for a 30 KB
    PNG, where OpenAI bills a 1280 x 800 one 1,105) and cachegate estimated 1,600 whatever its
    size: ~6,000-8,500 tokens of waste a turn, where none was wasted."""
    from tests.test_media import png

    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "browser-1"})
    elements = "\n".join(
        f'[{i}] <button aria-label="Add item {i}">Item {i}</button>' for i in range(40)
    )

    def page(step: int) -> dict[str, Any]:
        shot = base64.b64encode(png(1280 + step, 800, noisy_rows=8)).decode()
        return {
            "role": "user",
            "content": [
                {"type": "text", "text": f"Step {step}. Interactive elements:\n{elements}"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{shot}"}},
            ],
        }

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Find the cheapest USB-C cable and add it to the cart."},
        page(0),
    ]
    for step in range(1, 6):
        reply, _ = chat(client, messages, stream=True)
        latest = messages[-1]
        latest["content"] = [latest["content"][0], {"type": "text", "text": "[screenshot omitted]"}]
        messages += [{"role": "assistant", "content": reply["content"]}, page(step)]
    flush(proxy)
    answers = events(proxy.log_dir, "browser-1", "response")
    assert len(answers) == 5
    for answer in answers[1:]:
        usage = answer["usage"]
        # the image the previous turn sent is all it no longer holds: ~1,105 tokens, not 10,000
        assert usage["prompt"] - usage["cache_read"] < 4_000, usage
        assert answer["cache"]["waste"] == 0, answer["cache"]


def _mcp_tool(name: str, words: int) -> dict[str, Any]:
    description = " ".join(f"{name}-word{i}" for i in range(words))
    parameters = {"type": "object", "properties": {"path": {"type": "string"}}}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def _asked(client: Any, messages: list[dict[str, Any]], tools: Any) -> tuple[Any, dict[str, Any]]:
    """One exchange through the SDK: the assistant message as an agent appends it, and the
    usage as the provider reported it."""
    answer = client.chat.completions.create(model="gpt-4o", messages=messages, tools=tools)
    message = answer.choices[0].message.model_dump(exclude_none=True)
    return message, answer.usage.model_dump()


@pytest.mark.parametrize("after", ["gone", "swapped", "shortened"])
def test_tools_no_longer_sent_are_not_charged_as_waste(
    sim: RunningSimulator, proxy_factory: Any, after: str
) -> None:
    """An MCP server disconnected (its ten tools gone), swapped for another of the same size,
    or its tools' descriptions shortened, between two turns: the provider cannot read what is
    no longer sent, but those schemas were counted as held, and charged as waste (6,977
    reported where 3,610 were lost; a swap, netting to nothing, was charged whole)."""
    proxy = proxy_factory(sim.api_base, config(ttl_s=300), clock=lambda: sim.sim.now)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": f"mcp-{after}"})
    core = [_mcp_tool(n, 40) for n in ("read_file", "write_file", "bash")]
    mcp = [_mcp_tool(f"mcp_gh_{i}", 120) for i in range(10)]
    later = {
        "gone": core,
        "swapped": core + [_mcp_tool(f"mcp_gl_{i}", 120) for i in range(10)],
        "shortened": core + [_mcp_tool(f"mcp_gh_{i}", 10) for i in range(10)],
    }[after]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Read a.py:\n" + FILE_TEXT * 3},
    ]
    usages = []
    for turn in range(3):
        message, usage = _asked(client, messages, core + mcp)
        usages.append(usage)
        messages += [message, {"role": "user", "content": f"Go on {turn}."}]
    messages[-1] = {"role": "user", "content": FILE_TEXT * 3}  # (a large turn appended)
    _message, last = _asked(client, messages, later)
    # what the tools no longer sent weighed, by the provider's count
    probe = make_client(sim.api_base)
    whole = _asked(probe, messages, core + mcp)[1]["prompt_tokens"]
    kept = core if after == "swapped" else later  # (of the old tools, what is still sent)
    removed = whole - _asked(probe, messages, kept)[1]["prompt_tokens"]
    assert removed > 1000
    flush(proxy)
    (logged,) = [
        e["cache"] for e in events(proxy.log_dir, f"mcp-{after}", "response") if e["exchange"] == 4
    ]
    truth = usages[-1]["prompt_tokens"] - removed - cache_read(last)
    assert truth > NOISE_FLOOR  # (the history after the tools, which no request could read)
    assert logged["cause"] == "prefix_rewrite" and logged["location"] == "tools"
    assert abs(logged["waste"] - truth) <= 0.1 * removed, (logged, truth, removed)


_CLAUDE = "claude-sonnet-4-5"


def _marked_last(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with a Claude breakpoint on the last, as Claude Code marks them."""
    return [*messages[:-1], {**messages[-1], "cache_control": {"type": "ephemeral"}}]


def _claude_turns(sim: RunningSimulator, client: Any, turns: int) -> list[dict[str, Any]]:
    """A Claude conversation of ``turns`` marked turns, 5 s apart, each answered and followed
    by a tool output: the history its next turn sends."""
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Fix the failing handler. " + FILE_TEXT},
    ]
    for turn in range(turns):
        reply, _ = chat(client, _marked_last(convo), model=_CLAUDE, tools=TOOLS, stream=False)
        convo += [reply, {"role": "user", "content": f"Output {turn}: " + FILE_TEXT}]
        sim.sim.advance(5)
    return convo


@pytest.mark.parametrize("fork", [True, False])
def test_claudes_next_turn_after_a_sub_agent_forked_one_message_on_wastes_nothing(
    proxy_factory: Any, fork: bool
) -> None:
    """Claude: a sub-agent forked from the main agent's history one message past its next turn
    (the tool result in, its own task after it), then the main agent's turn. That turn stops
    before the sub-agent's breakpoint, so Claude reads the main agent's last entry, not the
    sub-agent's: nothing more could be read. It was compared with the sub-agent's request,
    all of its prompt expected, and the tool result's tokens called ``unexplained`` waste."""
    model = _CLAUDE
    with run_simulator(SimConfig(dialect="anthropic-compat")) as sim:
        proxy = proxy_factory(sim.api_base, config(), clock=lambda: sim.sim.now)
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "fork"})
        convo = _claude_turns(sim, client, 2)
        previous = sim.sim.requests[-1].usage  # (the main agent's turn before)
        if fork:
            task = {"role": "user", "content": "Sub-agent: list what the output names. " * 40}
            chat(client, _marked_last([*convo, task]), model=model, tools=TOOLS, stream=False)
            sim.sim.advance(5)
        chat(client, _marked_last(convo), model=model, tools=TOOLS, stream=False)
        last = sim.sim.requests[-1].usage
        flush(proxy)
    turn = events(proxy.log_dir, "fork", "response")[-1]
    # (the main agent's previous entry, before the tool result: the sub-agent's lies past it)
    assert 0 < cache_read(last) <= previous["prompt_tokens"] < last["prompt_tokens"]
    assert turn["cache"]["expected"] <= previous["prompt_tokens"], turn["cache"]
    assert turn["cache"]["waste"] == 0 and turn["cache"]["cause"] is None
    assert (
        proxy.metric("cachegate_cache_waste_tokens_total", {"model": model, "cause": "unexplained"})
        == 0
    )


def test_claudes_first_turn_sent_again_after_two_more_keeps_its_expiry(
    proxy_factory: Any,
) -> None:
    """Claude: a chat's first turn sent again as it was ("regenerate" on an earlier message),
    after two longer turns and a pause past the cache's life. Its entry had expired: an
    expiry. Read as a turn that stops before the latest one's breakpoint, it was expected to
    read only what that one read, which lay past it: nothing expected, the expiry hidden."""
    with run_simulator(SimConfig(dialect="anthropic-compat")) as sim:
        proxy = proxy_factory(sim.api_base, config(), clock=lambda: sim.sim.now)
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "again"})
        first = _claude_turns(sim, client, 3)[:2]  # (its opening: the first turn's request)
        sim.sim.advance(400)
        chat(client, _marked_last(first), model=_CLAUDE, tools=TOOLS, stream=False)
        again = sim.sim.requests[-1].usage
        flush(proxy)
    turn = events(proxy.log_dir, "again", "response")[-1]
    assert cache_read(again) == 0  # (its entry expired)
    assert turn["cache"]["expected"] == again["prompt_tokens"], turn["cache"]
    assert turn["cache"]["waste"] == again["prompt_tokens"]
    assert turn["cache"]["cause"] == "ttl_expired"


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_past_the_long_context_threshold_is_priced_at_the_long_context_rates(
    proxy_factory: Any, stream: bool
) -> None:
    """GPT-5.4 bills a prompt of more than 272K tokens at twice its input price and 1.5 times
    its output price, the whole request (Claude Sonnet 4.5 likewise past 200K): such a turn was
    priced at the standard rates, about half its bill. A shorter one keeps them."""
    with run_no_cache_upstream() as (upstream, base_url):
        proxy = proxy_factory(base_url, {})  # (gpt-5.4's built-in entry: $2.50 / $15)
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "long"})
        for base in (3_000, 300_000):
            upstream.base_prompt = base
            chat(client, [{"role": "user", "content": "go"}], stream=stream, model="gpt-5.4")
        flush(proxy)
    short, long = events(proxy.log_dir, "long", "response")
    assert short["usage"]["prompt"] == 3_050 and long["usage"]["prompt"] == 300_050
    assert short["cost"] == {
        "actual": pytest.approx((3_050 * 2.5 + 2 * 15) / 1e6),
        "uncached": pytest.approx((3_050 * 2.5 + 2 * 15) / 1e6),
    }
    expected = (300_050 * 2.5 * 2 + 2 * 15 * 1.5) / 1e6
    assert long["cost"]["actual"] == pytest.approx(expected)
    assert long["cost"]["long_context"] is True and "long_context" not in short["cost"]
    total = proxy.metric("cachegate_cost_usd_total", {"model": "gpt-5.4", "kind": "actual"})
    assert total == pytest.approx(expected + (3_050 * 2.5 + 2 * 15) / 1e6)
    report = run_cli("sessions", "cost", "long", "--log-dir", str(proxy.log_dir), "--json").json()
    assert report["actual"] == pytest.approx(total)


_LONG_PROMPT = "You are an agent. " + " ".join(
    f"rule {i}: do thing number {i} carefully" for i in range(300)
)
_MODELS_AND_IDS = pytest.mark.parametrize(
    ("model", "ids"),
    [("gpt-4o", ("call_1", "call_2")), ("mistral-large-latest", ("abcdefghi", "bcdefghij"))],
)


def _read_call(call_id: str, arguments: str = "{}") -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "read", "arguments": arguments},
    }


def _second_turns_divergence(
    proxy_factory: Any, model: str, first: list[dict[str, Any]], second: list[dict[str, Any]]
) -> dict[str, Any]:
    """The divergence logged for ``second``, sent after ``first`` in one session through
    cachegate to a simulator (of Mistral's rules for a Mistral model)."""
    with run_simulator(SimConfig(mistral_rules=model.startswith("mistral"))) as upstream:
        proxy = proxy_factory(upstream.api_base, config())
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "turns"})
        for messages in (first, second):
            client.chat.completions.create(model=model, messages=messages)  # type: ignore[arg-type]
        flush(proxy)
    divergence: dict[str, Any] = events(proxy.log_dir, "turns", "response")[1]["divergence"]
    return divergence


@_MODELS_AND_IDS
def test_a_message_the_repair_had_moved_then_deleted_is_named_where_the_client_had_it(
    proxy_factory: Any, model: str, ids: tuple[str, str]
) -> None:
    """The user typed while two tools ran: the repair moved that message after the results
    (for Mistral, with its note before it). The user then deleted it: the miss was named at
    ``messages[5]`` (the unchanged "done" in the new list), for Mistral as cachegate's note
    vanishing, the user's own text nowhere."""
    first = [
        {"role": "system", "content": _LONG_PROMPT},
        {"role": "user", "content": "run both"},
        {"role": "assistant", "content": None, "tool_calls": [_read_call(i) for i in ids]},
        {"role": "tool", "tool_call_id": ids[0], "content": "R1"},
        {"role": "user", "content": "STEER: also check the docs"},
        {"role": "tool", "tool_call_id": ids[1], "content": "R2"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "next"},
    ]
    second = [*first[:4], *first[5:], {"role": "assistant", "content": "ok"}]
    second.append({"role": "user", "content": "more"})
    divergence = _second_turns_divergence(proxy_factory, model, first, second)
    assert (divergence["location"], divergence["index"], divergence["role"]) == (
        "messages",
        4,
        "user",
    ), divergence
    assert divergence["old"] == "STEER: also check the docs" and divergence["new"] == ""


@_MODELS_AND_IDS
def test_a_message_typed_while_tools_ran_is_named_where_the_client_put_it(
    proxy_factory: Any, model: str, ids: tuple[str, str]
) -> None:
    """A turn whose client put the user's message between a call and its results: the repair
    moves it after them, for Mistral with its note before it; the new message was named as
    cachegate's note appearing after the results (``messages[5]``, an assistant's), the
    user's own text nowhere."""
    first = [
        {"role": "system", "content": _LONG_PROMPT},
        {"role": "user", "content": "run both"},
        {"role": "assistant", "content": None, "tool_calls": [_read_call(i) for i in ids]},
        {"role": "tool", "tool_call_id": ids[0], "content": "R1"},
        {"role": "tool", "tool_call_id": ids[1], "content": "R2"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "next"},
    ]
    second = [*first[:3], {"role": "user", "content": "STEER: also check the docs"}, *first[3:]]
    divergence = _second_turns_divergence(proxy_factory, model, first, second)
    assert (divergence["index"], divergence["role"]) == (3, "user"), divergence
    assert divergence["new"] == "STEER: also check the docs" and divergence["old"] == ""


@pytest.mark.parametrize("variant", ["bad arguments", "no type"])
def test_a_call_a_repair_fixed_in_place_then_deleted_is_named_where_the_client_had_it(
    proxy_factory: Any, variant: str
) -> None:
    """A repair that sends a fixed copy of the client's call (its arguments, its type): the
    copy was taken for cachegate's own message, and, deleted with its result, the result was
    named as the message gone, one place on."""
    call = _read_call("call_1", "{bad" if variant == "bad arguments" else "{}")
    if variant == "no type":
        del call["type"]
    first = [
        {"role": "system", "content": _LONG_PROMPT},
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "R1"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "next"},
    ]
    second = [*first[:2], *first[4:], {"role": "assistant", "content": "ok"}]
    second.append({"role": "user", "content": "more"})
    divergence = _second_turns_divergence(proxy_factory, "gpt-4o", first, second)
    assert (divergence["index"], divergence["role"]) == (2, "assistant"), divergence
