"""Prompt-cache accounting, attribution and cost (proxy/cache.py)."""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.cache import (
    CacheResult,
    CacheState,
    Cost,
    ModelPricing,
    _remember,
    account,
    cache_ttl_floor,
    compute_cost,
    default_cache_ttl,
    idle_seconds,
    mark_compacted,
    provider_of,
    stamped_in_flight,
    tier_factor,
    tiered,
    waste_cost,
)
from proxy.prefix import Divergence, Fingerprint, find_divergence, fingerprint
from proxy.usage import Usage

TTL = 600.0
FLOOR = 1024
MODEL = "gpt-4o"
SYSTEM = "You are a careful coding agent. Work in the repository at /src."


def block(tokens: int) -> int:
    """What an OpenAI-style cache serves of a processed prefix: whole 128-token blocks."""
    return tokens // 128 * 128


def tool_round(n: int, output: str | None = None) -> list[dict[str, Any]]:
    call_id = f"call_{n}"
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "shell", "arguments": orjson.dumps({"n": n}).decode()},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": output or f"output of step {n}"},
    ]


def opening(system: str = SYSTEM) -> dict[str, Any]:
    return {
        "model": MODEL,
        "tools": [{"type": "function", "function": {"name": "shell", "parameters": {}}}],
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Fix the failing test."},
        ],
    }


@dataclass
class Session:
    """Drives the pure modules the way the proxy does: fingerprint, diverge, account."""

    state: CacheState
    body: dict[str, Any] | None = None
    fp: Fingerprint | None = None
    divergence: Divergence | None = None

    def exchange(
        self,
        body: dict[str, Any],
        usage: Usage,
        started_at: float,
        *,
        after_compaction: bool = False,
        unmarked: bool = False,
        min_cached: int = 0,
        cached_before: int | None = None,
        ttl_floor_s: float | None = None,
        before: int | None = None,
        longer_lived: tuple[float, int] | None = None,
    ) -> CacheResult:
        body = orjson.loads(orjson.dumps(body))  # every request arrives parsed afresh
        fp = fingerprint(body, previous=self.fp)
        divergence = (
            find_divergence(self.fp, fp, self.body, body) if self.fp and self.body else None
        )
        self.divergence = divergence
        self.state, result = account(
            self.state,
            usage=usage,
            fingerprint=fp,
            divergence=divergence,
            started_at=started_at,
            ttl_s=TTL,
            noise_floor=FLOOR,
            model=body["model"],
            after_compaction=after_compaction,
            unmarked=(lambda: True) if unmarked else None,
            min_cached=min_cached,
            cached_before=cached_before,
            ttl_floor_s=ttl_floor_s,
            before=None if before is None else (lambda: before),
            longer_lived=None if longer_lived is None else (lambda: longer_lived),
        )
        self.body, self.fp = body, fp
        return result


def reported(prompt: int, read: int, completion: int = 200) -> Usage:
    return Usage(prompt=prompt, completion=completion, cache_read=read, reported_cache=True)


def test_reference_scenario_six_rounds() -> None:
    session = Session(CacheState())
    body = opening()
    big_output = "line\n" * 400

    # 1. First exchange: nothing to compare with.
    body["messages"] += tool_round(1, big_output)
    r1 = session.exchange(body, reported(12_000, 0), started_at=0.0)
    assert r1 == CacheResult(expected=0, read=0, write=0, waste=0, cause=None, location=None)

    # 2. Normal: the cache serves the previous 12 000 tokens in whole blocks (11 904).
    body["messages"] += tool_round(2)
    r2 = session.exchange(body, reported(13_500, block(12_000)), started_at=60.0)
    assert r2 == CacheResult(12_000, 11_904, 0, 0)
    assert session.divergence is None

    # 3. The user comes back 38 minutes after the last request started: everything missed.
    body["messages"] += tool_round(3)
    r3 = session.exchange(body, reported(15_000, 0), started_at=60.0 + 38 * 60)
    assert r3 == CacheResult(13_500, 0, 0, 13_500, "ttl_expired", None)

    # 4. Normal again.
    body["messages"] += tool_round(4)
    r4 = session.exchange(body, reported(16_200, block(15_000)), started_at=2_400.0)
    assert r4 == CacheResult(15_000, 14_976, 0, 0)

    # 5. The agent trims the old tool output of round 1 (messages[3]): the cache serves only the
    #    prefix before it (~1 000 tokens: 896 in blocks), the prompt shrinks to 15 100.
    body["messages"][3]["content"] = "line\n" * 20 + "[… output trimmed …]"
    body["messages"] += tool_round(5)
    r5 = session.exchange(body, reported(15_100, 896), started_at=2_460.0)
    assert r5 == CacheResult(15_100, 896, 0, 15_100 - 896, "prefix_rewrite", "messages[3].content")
    assert session.divergence is not None
    assert (session.divergence.role, session.divergence.volatile) == ("tool", False)

    # 6. A timestamp appears in the system prompt: nothing after the tools is served.
    body["messages"][0]["content"] = SYSTEM + "\nCurrent time: 2025-03-14T10:07:41Z"
    body["messages"] += tool_round(6)
    r6 = session.exchange(body, reported(15_900, 0), started_at=2_520.0)
    assert r6 == CacheResult(15_100, 0, 0, 15_100, "prefix_rewrite", "system")
    assert session.divergence is not None
    assert (session.divergence.volatile, session.divergence.volatile_kind) == (True, "timestamp")

    total = sum(r.waste for r in (r1, r2, r3, r4, r5, r6))
    assert total == 13_500 + 14_204 + 15_100 == 42_804


def test_long_warm_session_with_many_tool_rounds_has_no_false_waste() -> None:
    session = Session(CacheState())
    body = opening()
    prompt = 8_000
    results = []
    for n in range(80):
        body["messages"] += tool_round(n)
        previous = prompt
        prompt += 300 + (n * 37) % 1_500  # tool outputs of varying size
        read = 0 if n == 0 else block(previous)
        results.append(session.exchange(body, reported(prompt, read), started_at=n * 45.0))
    assert [r.waste for r in results] == [0] * 80
    assert [r.cause for r in results] == [None] * 80
    assert all(r.expected > 0 for r in results[1:])


def test_provider_that_never_reports_cache_fields_shows_no_waste() -> None:
    session = Session(CacheState())
    body = opening()
    results = []
    for n, started in enumerate((0.0, 60.0, 3_000.0, 3_060.0)):
        body["messages"] += tool_round(n)
        if n == 3:
            body["messages"][0]["content"] = SYSTEM + " Today is 2025-03-14."
        results.append(session.exchange(body, Usage(prompt=10_000 + n * 1_000), started))
    assert [(r.expected, r.waste, r.cause) for r in results] == [(0, 0, None)] * 4
    assert session.state.has_reported is False


def test_has_reported_is_sticky_so_a_later_zero_is_a_real_miss() -> None:
    session = Session(CacheState())
    body = opening()
    session.exchange(body, reported(10_000, 0), 0.0)
    body["messages"] += tool_round(1)
    # The provider omits the cache fields this time, yet it has reported before: a miss.
    result = session.exchange(body, Usage(prompt=11_000), 30.0)
    assert result == CacheResult(10_000, 0, 0, 10_000, "unexplained", None)


def test_exchange_after_a_compaction_is_not_counted() -> None:
    session = Session(CacheState())
    body = opening()
    session.exchange(body, reported(50_000, 0), 0.0)
    compacted = opening()
    compacted["messages"].insert(1, {"role": "user", "content": "[summary of earlier work]"})
    # The compacted request itself (flagged by the caller): a bought miss.
    bought = session.exchange(compacted, reported(9_000, 0), 30.0, after_compaction=True)
    assert bought == CacheResult(0, 0, 0, 0)
    compacted["messages"] += tool_round(1)
    after = session.exchange(compacted, reported(10_000, block(9_000)), 60.0)
    assert after == CacheResult(9_000, 8_960, 0, 0)


def test_mark_compacted_skips_exactly_the_next_exchange() -> None:
    session = Session(CacheState())
    body = opening()
    session.exchange(body, reported(20_000, 0), 0.0)
    session.state = mark_compacted(session.state)
    body["messages"][1]["content"] = "[summary] Fix the failing test."
    skipped = session.exchange(body, reported(6_000, 0), 10.0)
    assert (skipped.expected, skipped.waste) == (0, 0)
    body["messages"] += tool_round(1)
    counted = session.exchange(body, reported(7_000, 0), 20.0)
    assert counted == CacheResult(6_000, 0, 0, 6_000, "unexplained", None)


def test_a_miss_of_a_request_that_marked_nothing_where_marks_are_needed_is_not_requested() -> None:
    """Claude caches only marked prefixes: an agent that sends no ``cache_control`` misses on
    every turn. That is no eviction ("unexplained"), nor a rewrite, nor the idle time: nothing
    was asked of the cache, whatever else changed."""
    session = Session(CacheState())
    body = opening()
    session.exchange(body, reported(20_000, 0), 0.0, unmarked=True)
    body["messages"] += tool_round(1)
    grown = session.exchange(body, reported(21_000, 0), 10.0, unmarked=True)
    assert grown == CacheResult(20_000, 0, 0, 20_000, "not_requested", None)
    body["messages"][0]["content"] = SYSTEM + " Today is 2025-03-14."
    rewritten = session.exchange(body, reported(21_000, 0), 20.0 + TTL, unmarked=True)
    assert (rewritten.cause, rewritten.location) == ("not_requested", None)
    body["messages"] += tool_round(2)
    # A turn that hits anyway (under the noise floor) is no waste at all.
    assert session.exchange(body, reported(22_000, 20_500), 30.0 + TTL, unmarked=True).waste == 0


def test_a_rewrite_where_only_marked_prefixes_are_cached_costs_what_was_cached() -> None:
    """Claude caches up to the last mark: an agent marking only its system prompt (8,000
    tokens) had only that cached. A rewrite of the system prompt loses those 8,000, not the
    whole 20,000-token history: the rest was never cached, a miss of every turn, counted apart
    (not_requested). A rewrite past the last mark (here: of a message after the system prompt)
    loses nothing that was cached: its miss is what was never asked of the cache."""
    session = Session(CacheState())
    body = opening()
    session.exchange(body, reported(20_000, 8_000), 0.0)
    body["messages"][0]["content"] = SYSTEM + " Today is 2025-03-14."
    rewritten = session.exchange(body, reported(20_500, 0), 10.0, cached_before=8_000)
    assert rewritten == CacheResult(20_000, 0, 0, 8_000, "prefix_rewrite", "system", 12_000)
    body["messages"][1]["content"] = "Fix the failing test, then run the linter."
    past_mark = session.exchange(body, reported(20_600, 8_000), 20.0, cached_before=8_000)
    assert (past_mark.expected, past_mark.waste) == (20_500, 12_500)
    assert (past_mark.cause, past_mark.location) == ("not_requested", None)
    # Where caching is automatic (no marks: OpenAI), the whole previous prompt was expected
    session = Session(CacheState())
    body = opening()
    session.exchange(body, reported(20_000, 8_000), 0.0)
    body["messages"][0]["content"] = SYSTEM + " Today is 2025-03-14."
    assert session.exchange(body, reported(20_500, 0), 10.0).waste == 20_000


@pytest.mark.parametrize(
    ("read", "unchanged", "idle", "cause"),
    [
        (0, 10_000, 10.0, "unexplained"),  # nothing read of 10,000 unchanged tokens: evicted
        (0, 10_000, 400.0, "ttl_expired"),  # ...past the TTL floor: expired
        # read some: where the edit lies by the estimate (dense or sparse text, a big head of
        # tools) does not say whether the read stopped short of it
        (2_944, 15_900, 10.0, "prefix_rewrite"),
        (9_344, 16_363, 10.0, "prefix_rewrite"),
        (0, 3_000, 10.0, "prefix_rewrite"),  # too little before the edit to tell
    ],
)
def test_an_edit_after_the_provider_lost_the_prefix_before_it_is_not_the_edits(
    read: int, unchanged: int, idle: float, cause: str
) -> None:
    """A provider that caches every prefix read nothing of a long prefix the edit left as it
    was: it had lost it (an eviction, an expiry), and the edit did not cost it."""
    session = Session(CacheState())
    body = opening()
    body["messages"] += tool_round(1) + tool_round(2)
    session.exchange(body, reported(20_000, 0), 0.0)
    body["messages"][-1] = {**body["messages"][-1], "content": "edited"}
    result = session.exchange(
        body, reported(19_000, read), idle, before=unchanged, ttl_floor_s=300.0
    )
    assert (result.cause, result.waste) == (cause, 19_000 - read)  # (the waste as before)
    # nothing counted apart as the hour breakpoint's expired share (a Claude split): the log
    # wrote "expired": true, and the waste metric counted it as one more token than the log
    assert result.expired == 0 and type(result.expired) is int
    if cause != "prefix_rewrite":
        assert result.location is None
        assert session.divergence is not None  # (the edit is still the request's divergence)


def test_a_prefix_shorter_than_the_models_minimum_is_expected_to_miss() -> None:
    """Claude Haiku 4.5 caches nothing under 4,096 tokens: a 3,000-token history that missed on
    every turn was charged 3,000 tokens of waste a turn it could never have read."""
    session = Session(CacheState())
    body = opening()
    session.exchange(body, reported(3_000, 0), 0.0, min_cached=4_096)
    body["messages"] += tool_round(1)
    short = session.exchange(body, reported(3_500, 0), 10.0, min_cached=4_096)
    assert short == CacheResult(0, 0, 0, 0, None, None)
    body["messages"] += tool_round(2)
    long = session.exchange(body, reported(5_000, 0), 20.0, min_cached=4_096)
    assert (long.expected, long.waste) == (0, 0)  # 3,500 of the last: under it still
    body["messages"] += tool_round(3)
    past = session.exchange(body, reported(6_000, 0), 30.0, min_cached=4_096)
    assert (past.expected, past.waste) == (5_000, 5_000)


@pytest.mark.parametrize(("shortfall", "waste"), [(0, 0), (1_024, 0), (1_025, 1_025)])
def test_noise_floor(shortfall: int, waste: int) -> None:
    session = Session(CacheState())
    body = opening()
    session.exchange(body, reported(20_000, 0), 0.0)
    body["messages"] += tool_round(1)
    result = session.exchange(body, reported(21_000, 20_000 - shortfall), 10.0)
    assert (result.expected, result.waste) == (20_000, waste)
    assert result.cause == ("unexplained" if waste else None)


def test_changed_reasoning_effort_is_params_changed() -> None:
    session = Session(CacheState())
    body = {**opening(), "reasoning_effort": "low"}
    session.exchange(body, reported(20_000, 0), 0.0)
    body = {**copy.deepcopy(body), "reasoning_effort": "high"}
    body["messages"] += tool_round(1)
    result = session.exchange(body, reported(21_000, 0), 10.0)
    assert result == CacheResult(20_000, 0, 0, 20_000, "params_changed", "params.reasoning_effort")


def test_a_rewrite_after_a_long_idle_is_blamed_on_the_ttl() -> None:
    session = Session(CacheState())
    body = opening()
    session.exchange(body, reported(20_000, 0), 0.0)
    body["messages"][0]["content"] = SYSTEM + " Be brief."
    result = session.exchange(body, reported(21_000, 0), 601.0)
    assert (result.cause, result.location, result.waste) == ("ttl_expired", None, 20_000)


def test_idle_runs_from_the_start_of_the_previous_request_not_its_end() -> None:
    session = Session(CacheState())
    body = opening()
    # A long generation: the request started at 0 and its reply ended at 400.
    session.exchange(body, reported(20_000, 0), 0.0)
    body["messages"] += tool_round(1)
    result = session.exchange(body, reported(21_000, 0), 401.0 + 200.0)
    assert result.cause == "ttl_expired"


def test_idle_is_judged_per_prefix_across_forks() -> None:
    session = Session(CacheState())
    main = opening()
    main["messages"] += tool_round(1) + tool_round(2)
    session.exchange(main, reported(30_000, 0), 0.0)
    # A sub-agent shares only the system prompt; it refreshes that short prefix alone.
    fork = opening()
    fork["messages"][1]["content"] = "Summarize the repository layout."
    session.exchange(fork, reported(4_000, block(1_000)), 400.0)
    # Back on the main line, 700 s after its own last request started.
    main["messages"] += tool_round(3)
    fp = fingerprint(main)
    assert idle_seconds(session.state, fp, 700.0) == 700.0
    result = session.exchange(main, reported(31_000, block(1_000)), 700.0)
    assert (result.cause, result.waste) == ("ttl_expired", 4_000 - 896)


def test_a_pause_whose_prefixes_another_conversation_pushed_out_runs_from_its_own_turn() -> None:
    """The session keeps a bounded map of prefixes: another agent's long histories, new every
    turn, pushed out every stamp of a paused agent's, and its pause was measured from the
    session's latest start (the other agent's turn 100 s before): 700 s idle read as 100, an
    expiry as ``unexplained``. The compared request's start is the last use known."""
    a = opening()
    a["messages"] += tool_round(1)
    fp = fingerprint(a)
    state = dataclasses.replace(CacheState(), prefixes={}, last_started=600.0)  # (all pushed out)
    assert idle_seconds(state, fp, 700.0, since=0.0) == 700.0
    assert idle_seconds(state, fp, 700.0) == 100.0  # (nothing compared: the session's latest)
    # the other agent, under a system prompt of its own, shares the parameters and the tools:
    # their stamps are its, not this conversation's
    b = opening("You keep notes. Time: 10:11:00")
    shared = {d: 600.0 for d in fingerprint(b).digests if d in set(fp.digests)}
    assert [kind for kind, _ in fp.chain[: len(shared)]] == ["params", "tools"]
    state = dataclasses.replace(state, prefixes=shared)
    assert idle_seconds(state, fp, 700.0, since=0.0) == 700.0
    # where the system prompt's stamp is known, it is the last use, as before
    state = dataclasses.replace(state, prefixes={**shared, fp.digests[2]: 650.0})
    assert idle_seconds(state, fp, 700.0, since=0.0) == 50.0


def test_requests_in_flight_are_read_from_a_copy_where_their_stamps_are_later() -> None:
    session = Session(CacheState())
    main = opening()
    main["messages"] += tool_round(1)
    session.exchange(main, reported(30_000, 0), 0.0)
    session.exchange(opening(), reported(20_000, block(20_000)), 500.0)  # (a title request)
    # Still streaming: a side request over the whole history that went at 300, and a sub-agent
    # under the same system prompt that went at 100, before the title request stamped it.
    side = opening()
    side["messages"] = [*main["messages"], {"role": "user", "content": "Summarize."}]
    sub = opening()
    sub["messages"][1]["content"] = "Summarize the repository layout."
    seen = stamped_in_flight(session.state, [(fingerprint(side), 300.0), (fingerprint(sub), 100.0)])
    main["messages"] += tool_round(2)
    assert idle_seconds(seen, fingerprint(main), 700.0) == 400.0  # (the side request's)
    assert idle_seconds(session.state, fingerprint(main), 700.0) == 700.0  # (not kept)
    system = fingerprint(sub).digests[-2]  # (its system prompt, the title request's too)
    assert fingerprint(opening()).digests[-2] == system
    assert seen.prefixes[system] == 500.0  # (not moved back to the sub-agent's 100)
    assert seen.last_started == 500.0


def test_usage_less_exchange_keeps_the_baseline() -> None:
    session = Session(CacheState())
    body = opening()
    session.exchange(body, reported(20_000, 0), 0.0)
    interrupted = session.exchange(body, Usage(), 10.0)
    assert interrupted == CacheResult(0, 0, 0, 0)
    body["messages"] += tool_round(1)
    result = session.exchange(body, reported(21_000, 0), 20.0)
    assert (result.expected, result.waste) == (20_000, 20_000)


def test_state_round_trips_through_json() -> None:
    session = Session(CacheState())
    body = opening()
    session.exchange(body, reported(20_000, 0), 0.0)
    body["messages"] += tool_round(1)
    session.exchange(body, reported(21_000, block(20_000)), 12.5)
    state = mark_compacted(session.state)
    restored = CacheState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert restored == state
    with pytest.raises(ValueError, match="malformed cache state"):
        CacheState.from_dict({"prefixes": [["zz", 1.0]]})


def test_prefix_memory_is_bounded_and_keeps_the_longest_prefixes() -> None:
    body = opening()
    for n in range(20):
        body["messages"] += tool_round(n)

    def turn(state: CacheState, fp: Fingerprint, usage: Usage, started_at: float) -> CacheState:
        new_state, _ = account(
            state,
            usage=usage,
            fingerprint=fp,
            divergence=None,
            started_at=started_at,
            ttl_s=TTL,
            noise_floor=FLOOR,
            model=MODEL,
            max_prefixes=10,
        )
        return new_state

    fp = fingerprint(body)
    state = turn(CacheState(), fp, reported(1_000, 0), 5.0)
    assert list(state.prefixes) == list(fp.digests[-10:])
    assert set(state.prefixes.values()) == {5.0}
    # the next turn, at capacity: the oldest go, the state before is left as it was
    before = dict(state.prefixes)
    body["messages"] += tool_round(20)
    fp2 = fingerprint(body, fp)
    state2 = turn(state, fp2, reported(1_100, 1_000), 6.0)
    assert list(state2.prefixes) == list(fp2.digests[-10:])
    assert set(state2.prefixes.values()) == {6.0}
    assert state.prefixes == before


def test_cost_openai() -> None:
    # prompt_tokens 10 000 (cached_tokens 8 192 included), completion_tokens 500.
    usage = Usage(prompt=10_000, completion=500, cache_read=8_192, reported_cache=True)
    cost = compute_cost(usage, ModelPricing(2.50, 1.25, 0.0, 10.00))
    # (1 808 × 2.50 + 8 192 × 1.25 + 500 × 10) / 1e6 and (10 000 × 2.50 + 500 × 10) / 1e6
    assert cost.actual == pytest.approx(0.019_76, rel=1e-12)
    assert cost.uncached == pytest.approx(0.030, rel=1e-12)
    assert cost.saved == pytest.approx(0.010_24, rel=1e-12)


def test_an_audio_models_audio_tokens_cost_its_audio_prices() -> None:
    """gpt-4o-audio-preview: $2.50 / $10 a million text tokens in and out, $40 / $80 audio. Its
    audio tokens were priced as text: $0.015 logged for a $0.134 answer."""
    usage = Usage(
        prompt=2_000, completion=1_000, reported_cache=True, audio_in=1_500, audio_out=900
    )
    cost = compute_cost(usage, ModelPricing(2.50, 1.25, 0.0, 10.00, 40.00, 80.00))
    # (500 × 2.50 + 1 500 × 40 + 100 × 10 + 900 × 80) / 1e6
    assert cost.actual == pytest.approx(0.134_25, rel=1e-12)
    assert cost.uncached == pytest.approx(0.134_25, rel=1e-12)
    # 800 of its input read from the cache (the read's split between text and audio is not
    # reported): the audio is counted in the fresh rest, up to all of it
    read = Usage(
        prompt=2_000, completion=1_000, cache_read=800, reported_cache=True, audio_in=1_500
    )
    cost = compute_cost(read, ModelPricing(2.50, 1.25, 0.0, 10.00, 40.00, 80.00))
    # the 1 200 fresh: audio (1 200 × 40), the read 800 × 1.25, the output text at 10
    assert cost.actual == pytest.approx((1_200 * 40 + 800 * 1.25 + 1_000 * 10) / 1e6, rel=1e-12)
    # no audio prices: as text, as before
    cost = compute_cost(usage, ModelPricing(2.50, 1.25, 0.0, 10.00))
    assert cost.actual == pytest.approx(0.015, rel=1e-12)


def test_cost_deepseek() -> None:
    # prompt_cache_hit_tokens 6 400, prompt_cache_miss_tokens 1 600, completion_tokens 1 000.
    usage = Usage(prompt=8_000, completion=1_000, cache_read=6_400, reported_cache=True)
    cost = compute_cost(usage, ModelPricing(0.28, 0.028, 0.0, 0.42))
    # (1 600 × 0.28 + 6 400 × 0.028 + 1 000 × 0.42) / 1e6 = 1 047.2e-6
    assert cost.actual == pytest.approx(0.001_047_2, rel=1e-12)
    assert cost.uncached == pytest.approx(0.002_66, rel=1e-12)


def test_cost_anthropic_style_with_cache_write() -> None:
    # input_tokens 200 (uncached rest), cache_read_input_tokens 9 000,
    # cache_creation_input_tokens 800, output_tokens 400 → prompt 10 000.
    usage = Usage(
        prompt=10_000, completion=400, cache_read=9_000, cache_write=800, reported_cache=True
    )
    cost = compute_cost(usage, ModelPricing(3.00, 0.30, 3.75, 15.00))
    # (200 × 3 + 9 000 × 0.30 + 800 × 3.75 + 400 × 15) / 1e6 = 12 300e-6
    assert cost.actual == pytest.approx(0.012_3, rel=1e-12)
    assert cost.uncached == pytest.approx(0.036, rel=1e-12)


def test_one_hour_cache_writes_cost_twice_the_input_price() -> None:
    usage = Usage(
        prompt=10_000,
        completion=400,
        cache_read=9_000,
        cache_write=800,
        reported_cache=True,
        cache_write_1h=500,
    )
    cost = compute_cost(usage, ModelPricing(3.00, 0.30, 3.75, 15.00))
    # (200 × 3 + 9 000 × 0.30 + 300 × 3.75 + 500 × 6 + 400 × 15) / 1e6 = 13 425e-6
    assert cost.actual == pytest.approx(0.013_425, rel=1e-12)
    assert cost.uncached == pytest.approx(0.036, rel=1e-12)


def test_cache_write_without_its_own_price_costs_plain_input() -> None:
    usage = Usage(prompt=1_000, completion=0, cache_write=1_000, reported_cache=True)
    cost = compute_cost(usage, ModelPricing(2.00, 0.50, 0.0, 8.00))
    assert cost == Cost(0.002, 0.002)
    assert cost.saved == 0.0


def test_cache_reads_without_their_own_price_cost_plain_input_not_nothing() -> None:
    """A model priced as the $0 hint says, by price_input and price_output alone: its 9,000
    cached tokens were free, and "saved by cache" counted them all."""
    usage = Usage(prompt=10_000, completion=100, cache_read=9_000, reported_cache=True)
    cost = compute_cost(usage, ModelPricing(1.00, 0.0, 0.0, 2.00))
    assert cost == Cost(0.0102, 0.0102)
    assert cost.saved == 0.0


def test_costs_add_up_per_session() -> None:
    total = Cost(0.01, 0.03) + Cost(0.002, 0.004)
    assert total.actual == pytest.approx(0.012)
    assert total.saved == pytest.approx(0.022)


@pytest.mark.parametrize(
    ("model", "ttl"),
    [
        ("gpt-4o", 600.0),
        ("o3-mini", 600.0),
        ("openai/gpt-oss-120b", 300.0),  # (OpenAI's open weights: its host's, unknown)
        ("claude-sonnet-4", 300.0),
        ("anthropic/claude-3-5-haiku", 300.0),
        ("deepseek-chat", 3_600.0),
        ("llama-3.1-70b", 300.0),
    ],
)
def test_default_cache_ttl_per_provider(model: str, ttl: float) -> None:
    assert default_cache_ttl(model) == ttl


@pytest.mark.parametrize(
    ("model", "dialect", "ttl"),
    [
        ("my-ds", "deepseek", 3_600.0),
        ("sonnet-via-gateway", "anthropic", 300.0),
        ("my-ds", "openai", 300.0),  # the default dialect: by the name
        ("deepseek-chat", "openai", 3_600.0),
        # a name the rules know wins (a "*" entry's dialect names every other model's)
        ("claude-3-5-haiku-latest", "deepseek", 300.0),
    ],
)
def test_a_configured_dialect_names_the_provider_whose_ttl_applies(
    model: str, dialect: str, ttl: float
) -> None:
    assert default_cache_ttl(model, dialect) == ttl
    assert cache_ttl_floor(model, ttl, dialect) == ttl


@pytest.mark.parametrize(
    ("model", "provider"),
    [
        ("databricks-claude-sonnet-4", "anthropic"),  # Databricks
        ("anthropic--claude-4-sonnet", "anthropic"),  # SAP AI Core
        ("us.anthropic.claude-sonnet-4-5-20250929-v1:0", "anthropic"),
        ("claude-sonnet-4-5@20250929", "anthropic"),
        ("gpt-4-turbo", "openai"),
        # OpenAI's models without "gpt" in their names: their misses are judged from the
        # first turn (a model not known to cache is judged only once it reads the cache)
        ("codex-mini-latest", "openai"),
        ("computer-use-preview", "openai"),
        ("openai/codex-mini-latest", "openai"),
        ("unclaude-7b", "*"),  # (not the word)
        ("llama-3.3-70b", "*"),
        ("deepseek/deepseek-chat", "deepseek"),
        ("deepseek.r1-v1:0", "*"),  # Bedrock's, by its rules
        ("us.deepseek.r1-v1:0", "*"),
        # DeepSeek's open weights served by others: their hosts' rules, not DeepSeek's API's
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "*"),
        ("deepseek/deepseek-r1-distill-llama-70b", "*"),
        ("together_ai/deepseek-ai/DeepSeek-V3", "*"),
        ("deepseek-ai/deepseek-v4-pro", "*"),  # (NVIDIA NIM's spelling)
        ("deepseek-reasoner", "deepseek"),
    ],
)
def test_a_claude_model_is_known_however_a_gateway_spelled_it_around(
    model: str, provider: str
) -> None:
    assert provider_of(model) == provider


@settings(max_examples=200, deadline=None)
@given(
    old=st.lists(st.tuples(st.binary(min_size=1, max_size=2), st.floats(0, 100)), max_size=30),
    chain=st.lists(st.binary(min_size=1, max_size=2), max_size=30, unique=True),
    later=st.floats(0, 50),
    cap=st.integers(1, 40),
)
def test_remembering_a_later_request_in_c_gives_the_same_prefixes_in_the_same_order(
    old: list[tuple[bytes, float]], chain: list[bytes], later: float, cap: int
) -> None:
    prefixes = dict(old)
    latest = max(prefixes.values(), default=0.0)
    started = latest + later
    fast = _remember(prefixes, tuple(chain), started, cap, latest)
    slow = _remember(prefixes, tuple(chain), started, cap, latest + 1e9)  # forces the general path
    assert list(fast.items()) == list(slow.items())


@settings(max_examples=200, deadline=None)
@given(
    old=st.lists(st.tuples(st.binary(min_size=1, max_size=2), st.floats(0, 100)), max_size=30),
    chain=st.lists(st.binary(min_size=1, max_size=2), max_size=30, unique=True),
    started=st.floats(0, 100),
    cap=st.integers(1, 40),
)
def test_a_request_that_finished_after_a_later_one_moves_no_prefix_back_in_time(
    old: list[tuple[bytes, float]], chain: list[bytes], started: float, cap: int
) -> None:
    prefixes = dict(old)
    latest = max(prefixes.values(), default=0.0) + 1.0  # a later request was stamped already
    out = _remember(prefixes, tuple(chain), started, cap, latest)
    # What it must be: the other digests as they were, in their order, then the chain's, each
    # at the later of its two times; the oldest past ``cap`` evicted.
    expected = [(d, t) for d, t in prefixes.items() if d not in chain]
    expected += [(d, max(started, prefixes.get(d, started))) for d in chain]
    assert list(out.items()) == expected[max(0, len(expected) - cap) :]


@pytest.mark.parametrize(
    ("model", "ttl", "floor"),
    [
        ("gpt-4o", 600.0, 300.0),  # OpenAI's 5 to 10 minutes
        ("o3-mini", 600.0, 300.0),
        ("gpt-4o", 900.0, 900.0),  # a TTL set in the config is one figure
        ("gpt-4o", 86_400.0, 86_400.0),  # the 24 h retention
        ("claude-sonnet-4", 300.0, 300.0),
        ("deepseek-chat", 3_600.0, 3_600.0),
        ("llama-3.1-70b", 300.0, 300.0),
    ],
)
def test_the_ttl_floor_is_the_low_end_of_a_documented_range(
    model: str, ttl: float, floor: float
) -> None:
    assert cache_ttl_floor(model, ttl) == floor


def test_a_miss_within_openais_five_to_ten_minutes_with_no_other_cause_is_an_expiry() -> None:
    """OpenAI keeps an idle prefix "generally" 5 to 10 minutes: a miss after 7 idle minutes,
    with nothing rewritten, was reported as unexplained."""
    floor = cache_ttl_floor(MODEL, TTL)
    session = Session(CacheState())
    body = opening()
    body["messages"] += tool_round(1, "line\n" * 400)
    session.exchange(body, reported(12_000, 0), started_at=0.0, ttl_floor_s=floor)
    body["messages"] += tool_round(2)
    r2 = session.exchange(body, reported(13_500, 0), started_at=7 * 60.0, ttl_floor_s=floor)
    assert (r2.cause, r2.waste) == ("ttl_expired", 12_000)
    # Under 5 minutes it is not: nothing explains that miss.
    body["messages"] += tool_round(3)
    r3 = session.exchange(body, reported(15_000, 0), started_at=11 * 60.0, ttl_floor_s=floor)
    assert (r3.cause, r3.waste) == ("unexplained", 13_500)
    # Within the range, a rewrite is named rather than the idle time (the cache may have been
    # there: the rewrite missed it either way)...
    body["messages"][0] = {"role": "system", "content": SYSTEM + " Be brief."}
    body["messages"] += tool_round(4)
    r4 = session.exchange(body, reported(16_500, 0), started_at=19 * 60.0, ttl_floor_s=floor)
    assert (r4.cause, r4.location) == ("prefix_rewrite", "system")
    # ...and past 10 minutes the idle time comes first, as before.
    body["messages"][0] = {"role": "system", "content": SYSTEM}
    body["messages"] += tool_round(5)
    r5 = session.exchange(body, reported(18_000, 0), started_at=31 * 60.0, ttl_floor_s=floor)
    assert (r5.cause, r5.location) == ("ttl_expired", None)


def test_waste_is_priced_at_what_the_missed_tokens_cost_over_a_read() -> None:
    """``sessions cost`` says what a waste cost: each missed token billed as this exchange's
    unread input was (fresh, or written again), less the read price."""
    openai = ModelPricing(2.50, 1.25, 0.0, 10.00)
    usage = Usage(prompt=10_000, completion=10, cache_read=2_000, reported_cache=True)
    assert waste_cost(usage, openai, 5_000) == pytest.approx(5_000 * (2.50 - 1.25) / 1e6)
    claude = ModelPricing(3.00, 0.30, 3.75, 15.00)
    written = Usage(
        prompt=10_000, completion=10, cache_write=10_000, reported_cache=True,
        reported_cache_write=True, explicit_cache=True,
    )  # fmt: skip
    assert waste_cost(written, claude, 6_000) == pytest.approx(6_000 * (3.75 - 0.30) / 1e6)
    hour = Usage(
        prompt=10_000, completion=10, cache_write=10_000, cache_write_1h=10_000,
        reported_cache=True, reported_cache_write=True, explicit_cache=True,
    )  # fmt: skip
    assert waste_cost(hour, claude, 6_000) == pytest.approx(6_000 * (6.00 - 0.30) / 1e6)
    half = Usage(
        prompt=10_000, completion=10, cache_write=5_000, reported_cache=True,
        reported_cache_write=True, explicit_cache=True,
    )  # fmt: skip
    # The unread input lies as Claude bills it, writes first: the first 4,000 missed tokens
    # are writes; 4,000 more after them are 1,000 writes and 3,000 fresh tokens
    assert waste_cost(half, claude, 4_000) == pytest.approx(4_000 * (3.75 - 0.30) / 1e6)
    rest = (1_000 * (3.75 - 0.30) + 3_000 * (3.00 - 0.30)) / 1e6
    assert waste_cost(half, claude, 4_000, after=4_000) == pytest.approx(rest)
    both = Usage(
        prompt=12_000, completion=10, cache_read=2_000, cache_write=6_000, cache_write_1h=2_000,
        reported_cache=True, reported_cache_write=True, explicit_cache=True,
    )  # fmt: skip
    layered = (2_000 * (6.00 - 0.30) + 4_000 * (3.75 - 0.30) + 1_000 * (3.00 - 0.30)) / 1e6
    assert waste_cost(both, claude, 7_000) == pytest.approx(layered)
    # never more tokens than were not read; nothing for no waste or a model with no prices
    assert waste_cost(usage, openai, 50_000) == pytest.approx(8_000 * 1.25 / 1e6)
    assert waste_cost(usage, openai, 0) == 0.0
    assert waste_cost(usage, ModelPricing(0.0, 0.0, 0.0, 0.0), 5_000) == 0.0


def test_a_miss_between_two_breakpoints_lives_splits_the_rewrite_from_the_expiry() -> None:
    """An earlier breakpoint kept 6,000 tokens for an hour, the last one the rest for the TTL:
    after a pause between the two, a system rewrite lost the hour's part (its cause), the rest
    had expired (``expired``), and past what the previous turn cached, nothing had been asked
    (``unrequested``). Without the longer life, or within the TTL, it is as before."""
    body = opening()
    body["messages"] += tool_round(1, "line\n" * 400)
    rewritten = opening(SYSTEM + " Today is Friday.")
    rewritten["messages"] += tool_round(1, "line\n" * 400) + tool_round(2)

    def second(longer: tuple[float, int] | None, at: float, cached: int | None) -> CacheResult:
        session = Session(CacheState())
        session.exchange(body, reported(12_000, 0), started_at=0.0)
        usage = reported(13_000, 0)
        return session.exchange(
            rewritten, usage, started_at=at, longer_lived=longer, cached_before=cached
        )

    split = second((3600.0, 6_000), TTL + 60, 10_000)
    assert (split.cause, split.location) == ("prefix_rewrite", "system")
    assert (split.waste, split.expired, split.unrequested) == (6_000, 4_000, 2_000)
    whole = second((3600.0, 6_000), TTL + 60, None)  # (every prefix cached: nothing apart)
    assert (whole.waste, whole.expired, whole.unrequested) == (6_000, 6_000, 0)
    expired = second(None, TTL + 60, None)
    assert (expired.cause, expired.waste, expired.expired) == ("ttl_expired", 12_000, 0)
    past_both = second((3600.0, 6_000), 4000.0, None)
    assert (past_both.cause, past_both.waste, past_both.expired) == ("ttl_expired", 12_000, 0)
    within = second((3600.0, 6_000), 60.0, None)
    assert (within.cause, within.waste, within.expired) == ("prefix_rewrite", 12_000, 0)
    # Nothing rewritten: the hour's share is an estimate (by size), and a miss of part of it
    # was read as unexplained where all of it had expired: no split without a difference.
    session = Session(CacheState())
    session.exchange(body, reported(12_000, 0), started_at=0.0)
    extended = {**body, "messages": [*body["messages"], *tool_round(2)]}
    plain = session.exchange(
        extended, reported(13_000, 4_000), started_at=TTL + 60, longer_lived=(3600.0, 6_000)
    )
    assert (plain.cause, plain.waste, plain.expired) == ("ttl_expired", 8_000, 0)


def test_a_processing_tier_scales_every_price() -> None:
    """OpenAI's flex tier is half the standard prices; priority the model's ratio (else 2);
    the others, and none said, the standard prices."""
    pricing = ModelPricing(2.0, 0.5, 0.0, 8.0)
    assert tiered(pricing, tier_factor("flex", 1.75)) == ModelPricing(1.0, 0.25, 0.0, 4.0)
    assert tiered(pricing, tier_factor("priority", 1.75)) == ModelPricing(3.5, 0.875, 0.0, 14.0)
    assert tier_factor("priority") == 2.0
    for tier in ("default", "auto", "scale", None, "something new"):
        assert tiered(pricing, tier_factor(tier, 1.75)) is pricing
