"""Session identity: explicit ids, agent headers, inference by shared history, bounded store."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.sessions import (
    BYTES_HELD_PER_BODY_BYTE,
    BYTES_HELD_PER_MESSAGE,
    BYTES_HELD_PER_OWN_BYTE,
    SESSION_BASE_BYTES,
    SIZES_KEPT,
    MemorySessionStore,
    SessionState,
    anchor_of,
    credential_tag,
    explicit_session_id,
    new_session_id,
    valid_session_id,
)

SYSTEM = {"role": "system", "content": "agent"}


def convo(task: str, turns: int) -> list[dict[str, str]]:
    msgs = [SYSTEM, {"role": "user", "content": task}]
    for i in range(turns):
        msgs += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"u{i}"}]
    return msgs


def test_a_history_sent_under_another_key_never_joins_the_session() -> None:
    """Two users of one cachegate, the same agent, the same task: two sessions."""
    alice = credential_tag({"authorization": "Bearer sk-alice"})
    bob = credential_tag({"authorization": "Bearer sk-bob"})
    azure_bob = credential_tag({"api-key": "sk-bob"})
    assert len({alice, bob, azure_bob}) == 3 and None not in {alice, bob, azure_bob}
    assert credential_tag({"authorization": "Bearer sk-bob"}) == bob  # (the same each time)
    assert credential_tag({"content-type": "application/json"}) is None
    assert "sk-bob" not in repr(bob)  # (a keyed hash, not the key)
    store = MemorySessionStore()
    a = store.create("a", 0.0)
    store.index(a, convo("fix the test", 1), credential=alice)
    assert store.infer_shared(convo("fix the test", 2), credential=alice) == (a, 4)
    assert store.infer_shared(convo("fix the test", 2), credential=bob) == (None, 0)
    assert store.infer_shared(convo("fix the test", 2)) == (None, 0)  # (nor with none)
    b = store.create("b", 1.0)
    store.index(b, convo("fix the test", 1), credential=bob)
    assert store.infer_shared(convo("fix the test", 2), credential=alice) == (a, 4)
    assert store.infer_shared(convo("fix the test", 2), credential=bob) == (b, 4)


@pytest.mark.parametrize("sid", ["abc", "A.b_c:d-1", "x" * 128, "2026-11-30T10:00:00"])
def test_valid_ids(sid: str) -> None:
    assert valid_session_id(sid)
    assert explicit_session_id({"x-session-id": sid}, None) == sid


@pytest.mark.parametrize(
    "sid", ["", "../../x", "..", ".", "x" * 129, "a\x00b", "sess ion", "ünï", "a/b", "a\nb"]
)
def test_hostile_ids_are_refused(sid: str) -> None:
    assert not valid_session_id(sid)
    with pytest.raises(ValueError, match="session id"):
        explicit_session_id({"x-session-id": sid}, None)
    with pytest.raises(ValueError):
        explicit_session_id({}, sid)


@pytest.mark.parametrize(
    "key",
    [
        "sk-proj-ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
        "sk-Ab3_dE-9fGhIjKlMnOpQrS",  # (an sk- key of URL-safe characters)
        "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",  # (letters alone)
        "glpat-abcdefghij-klmnopqrst",
        "AKIAIOSFODNN7EXAMPLE",
        "ghp_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8",
    ],
)
def test_a_key_names_no_session(key: str) -> None:
    """Its log file would be named by it, and `sessions list` and the session header show it."""
    with pytest.raises(ValueError, match="reads as an API key"):
        explicit_session_id({"x-session-id": key}, None)
    with pytest.raises(ValueError, match="reads as an API key"):
        explicit_session_id({}, key)
    assert explicit_session_id({"session_id": key, "langfuse-session-id": "lf-1"}, None) == "lf-1"


@pytest.mark.parametrize(
    "name",
    [
        "sk-learn-pipeline-debugging",
        "eval_sk-learn_regression_2024_run_07",
        "user-42-sk-SK-2024-11-01-run-0042",
        "0199a213-81c0-7800-8aa1-bbab2a035a53",
        "01JD3Y7W9N4Q8T2K6M5R0XZABC",
    ],
)
def test_a_name_the_sk_pattern_takes_too_is_a_name(name: str) -> None:
    """The redaction's generic ``sk-`` pattern takes ``sk-learn-…`` (scikit-learn): no key's
    shape in it, so it names its session."""
    assert explicit_session_id({"x-session-id": name}, None) == name


@pytest.mark.parametrize(
    ("sid", "on_windows"),
    [
        ("D:x", False),  # ntpath.join(dir, "D:x.jsonl") is D:x.jsonl, outside the directory
        ("a:b", False),  # an alternate data stream of file "a"
        ("CON", False),
        ("nul.txt", False),
        ("com1", False),
        ("console", True),
        ("2026-11-30T10-00-00", True),
    ],
)
def test_ids_that_name_no_file_on_windows_are_refused_there(
    monkeypatch: pytest.MonkeyPatch, sid: str, on_windows: bool
) -> None:
    from proxy import sessions

    assert valid_session_id(sid)  # elsewhere: any file name
    monkeypatch.setattr(sessions, "WINDOWS_FILE_NAMES", True)
    assert valid_session_id(sid) is on_windows


def test_path_wins_then_x_session_id_then_agent_headers() -> None:
    headers = {"x-claude-code-session-id": "claude-1", "helicone-session-id": "h-1"}
    assert explicit_session_id(headers, None) == "claude-1"
    assert explicit_session_id({**headers, "x-session-id": "mine"}, None) == "mine"
    assert explicit_session_id({**headers, "x-session-id": "mine"}, "from-path") == "from-path"
    assert explicit_session_id({"helicone-session-id": "h-1"}, None) == "h-1"
    assert explicit_session_id({}, None) is None
    # A path's id wins: the header beside it is not read, so not refused (README, "Sessions").
    assert explicit_session_id({"x-session-id": "bad id"}, "from-path") == "from-path"


def test_other_tools_ids_that_are_not_ids_are_passed_over_ours_are_refused() -> None:
    # langfuse allows any string: an e-mail address must not break the request
    assert explicit_session_id({"langfuse-session-id": "alice@example.com"}, None) is None
    headers = {"x-portkey-trace-id": "trace/with/slashes", "langfuse-session-id": "lf-1"}
    assert explicit_session_id(headers, None) == "lf-1"  # the next valid one
    assert explicit_session_id({"helicone-session-id": "../../etc/passwd"}, None) is None
    with pytest.raises(ValueError, match="x-session-id"):
        explicit_session_id({"x-session-id": "bad id", "langfuse-session-id": "lf-1"}, None)
    with pytest.raises(ValueError, match="path"):
        explicit_session_id({"x-session-id": "fine"}, "..")


def test_inference_follows_a_growing_conversation_and_separates_others() -> None:
    store = MemorySessionStore()
    a = store.create("a", 0.0)
    store.index(a, convo("fix the bug", 0))
    for turns in range(1, 5):
        msgs = convo("fix the bug", turns)
        found = store.infer(msgs)
        assert found is a
        store.index(a, msgs)
    assert store.infer(convo("write the docs", 1)) is None


def test_inference_follows_a_conversation_whose_cache_marker_moves_on() -> None:
    """The first message marked with ``cache_control`` on turn 1 and unmarked on turn 2 (the
    marker moved to the latest message) is the same opening: one session, not two."""
    marker = {"type": "ephemeral"}
    store = MemorySessionStore()
    a = store.create("a", 0.0)
    first = [{"type": "text", "text": "fix the bug", "cache_control": marker}]
    store.index(a, [SYSTEM, {"role": "user", "content": first}])
    turn_2 = [
        SYSTEM,
        {"role": "user", "content": [{"type": "text", "text": "fix the bug"}]},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": [{"type": "text", "text": "thanks", "cache_control": marker}]},
    ]
    assert store.infer(turn_2) is a
    other = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "write docs"}]}]
    assert store.infer(other) is None
    # A plain-text first message with the marker (or a null field) on it, then without.
    b = store.create("b", 1.0)
    store.index(b, [SYSTEM, {"role": "user", "content": "hi", "cache_control": marker}])
    assert store.infer([SYSTEM, {"role": "user", "content": "hi"}, *turn_2[2:]]) is b
    store.index(b, [SYSTEM, {"role": "user", "content": "yo", "name": None}])
    assert store.infer([SYSTEM, {"role": "user", "content": "yo"}]) is b


def test_a_text_part_and_a_string_are_the_same_opening() -> None:
    """Cline-style clients send their latest two user messages as text parts (to mark them for
    the cache) and older ones as strings: the first message changes form on turn 2. The session
    used to split in two there."""
    store = MemorySessionStore()
    a = store.create("a", 0.0)
    marked = {"type": "text", "text": "fix the bug", "cache_control": {"type": "ephemeral"}}
    store.index(a, [SYSTEM, {"role": "user", "content": [marked]}])
    later = [
        SYSTEM,
        {"role": "user", "content": "fix the bug"},
        {"role": "assistant", "content": "on it"},
        {"role": "user", "content": [{**marked, "text": "go on"}]},
    ]
    assert store.infer(later) is a
    # two parts are no single text: another opening
    two = [{"type": "text", "text": "fix the"}, {"type": "text", "text": " bug"}]
    assert store.infer([SYSTEM, {"role": "user", "content": two}]) is None


def test_a_named_session_is_never_inferred_for_a_request_without_an_id() -> None:
    """A client that sends no id, with the same opening as a named session, gets a session of
    its own: it used to land in the other client's named session (and its log)."""
    store = MemorySessionStore()
    named = store.create("alice-claude-code", 0.0)
    store.index(named, convo("hello", 0), inferable=False)
    assert store.infer(convo("hello", 1)) is None
    inferred = store.create("20261201-000000-aaaaaaaa", 1.0)
    store.index(inferred, convo("hello", 0))
    assert store.infer(convo("hello", 1)) is inferred


def test_an_inferred_session_once_named_is_no_longer_inferred() -> None:
    """A client copies X-Cachegate-Session into X-Session-Id after its first turn: from then on
    the session is named, and another client that sends no id with the same opening gets one
    of its own (it kept joining the named session)."""
    store = MemorySessionStore()
    inferred = store.create("20261201-000000-bbbbbbbb", 0.0)
    store.index(inferred, convo("hello", 0))
    assert store.infer(convo("hello", 1)) is inferred
    store.index(inferred, convo("hello", 1), inferable=False)  # named from now on
    assert store.infer(convo("hello", 2)) is None


def test_inference_picks_the_longest_shared_history() -> None:
    store = MemorySessionStore()
    a = store.create("a", 0.0)
    b = store.create("b", 1.0)
    store.index(a, convo("same start", 3))
    fork = [*convo("same start", 1), {"role": "assistant", "content": "other path"}]
    store.index(b, fork)
    assert store.infer([*convo("same start", 3), {"role": "assistant", "content": "x"}]) is a
    assert store.infer([*fork, {"role": "user", "content": "y"}]) is b


def test_store_is_bounded_and_forgets_idle_sessions() -> None:
    store = MemorySessionStore(max_sessions=3, idle_ttl_s=100)
    for i in range(5):
        store.create(f"s{i}", float(i))
    assert sorted(store.active_ids()) == ["s2", "s3", "s4"]
    store.create("late", 500.0)
    assert list(store.active_ids()) == ["late"]


def test_a_session_idle_past_the_limit_is_forgotten_when_it_is_looked_up() -> None:
    store = MemorySessionStore(idle_ttl_s=100)
    a = store.create("a", 0.0)
    store.index(a, convo("hello", 3))
    a.last_seen = 50.0
    assert store.get("a", 150.0) is a  # idle 100 s: still there
    assert store.get("a") is a  # without a time, as the observers look it up: no judgement
    assert store.get("a", 150.5) is None  # no session was created meanwhile
    assert list(store.active_ids()) == []
    assert store.infer(convo("hello", 4)) is None  # and it left the inference index

    b = store.create("b", 200.0)
    store.index(b, convo("hi", 3))
    c = store.create("c", 260.0)
    store.index(c, [*convo("hi", 1), {"role": "assistant", "content": "elsewhere"}])
    assert store.infer_shared(convo("hi", 4), 290.0) == (b, 8)  # the longest shared history
    # b idle past the limit: not joined, forgotten; c, still fresh, is the one that continues
    assert store.infer_shared(convo("hi", 4), 300.5) == (c, 4)
    assert list(store.active_ids()) == ["c"]


def held(request_bytes: int) -> int:
    return SESSION_BASE_BYTES + BYTES_HELD_PER_BODY_BYTE * request_bytes


def test_sessions_past_the_memory_budget_are_forgotten_least_recently_seen_first() -> None:
    reasons: list[str] = []
    store = MemorySessionStore(max_bytes=3 * held(100_000), on_evict=reasons.append)
    states = {}
    for i, sid in enumerate(("a", "b", "c")):
        states[sid] = store.create(sid, float(i))
        store.index(states[sid], convo(f"task {sid}", 3))
        store.weigh(states[sid], 100_000)
    assert store.bytes == 3 * held(100_000) and reasons == []
    assert store.get("a", 3.0) is states["a"]  # a seen again: b is now the least recent
    store.weigh(states["a"], 100_100)  # a grew past the budget: b goes, not a
    assert sorted(store.active_ids()) == ["a", "c"]
    assert store.bytes == held(100_100) + held(100_000)
    assert reasons == ["memory"]
    assert store.infer(convo("task b", 4)) is None  # b also left the inference index
    assert store.infer(convo("task c", 4)) is states["c"]

    store.weigh(states["a"], 100_100)  # the same size again: counted once, nothing forgotten
    assert store.bytes == held(100_100) + held(100_000) and reasons == ["memory"]

    big = store.create("big", 5.0)
    store.weigh(big, 10 * 100_000)  # alone over the budget: the others go, it stays
    assert list(store.active_ids()) == ["big"]
    assert store.bytes == held(10 * 100_000)
    assert reasons == ["memory"] * 3


def test_the_budgets_hold_again_once_a_burst_of_requests_in_flight_is_done() -> None:
    """Sessions with a request in flight are kept past the memory budget and the count; once
    the burst was done, 8 sessions held 6 times the budget until the next request came (hours
    on a quiet proxy). The one that left last stays: its client is the likeliest back."""
    reasons: list[str] = []
    store = MemorySessionStore(max_bytes=2 * held(100_000), max_sessions=3, on_evict=reasons.append)
    states = []
    for i in range(8):
        state = store.create(f"s{i}", float(i))
        store.enter(state)
        store.weigh(state, 100_000)
        states.append(state)
    assert len(store) == 8 and store.bytes == 8 * held(100_000)  # all in flight: all kept
    for i, state in enumerate(states):
        store.leave(state, 10.0 + i)
    assert store.bytes <= 2 * held(100_000)
    assert list(store.active_ids()) == ["s6", "s7"]
    assert reasons == ["memory"] * 6
    # the count alone, on a store without a memory budget
    counted = MemorySessionStore(max_sessions=2, on_evict=reasons.append)
    burst = []
    for i in range(5):
        burst.append(counted.create(f"c{i}", float(i)))
        counted.enter(burst[-1])
    for i, state in enumerate(burst):
        counted.leave(state, 10.0 + i)
    assert list(counted.active_ids()) == ["c3", "c4"]
    # a scrape with nothing in flight trims the memory too (forget_idle)
    scraped = MemorySessionStore(max_bytes=held(100_000))
    kept = []
    for i in range(3):
        kept.append(scraped.create(f"k{i}", float(i)))
        scraped.enter(kept[-1])
        scraped.weigh(kept[-1], 100_000)
    for state in kept:
        state.requests = 0  # (as if left without the store's leave: an older caller)
    scraped.forget_idle(20.0)
    assert scraped.bytes <= held(100_000)
    # ...but not the session that finished last, when what is over is held by requests still
    # in flight (as ``leave`` keeps it; the scrape forgot it, the next turn of an agent at work)
    busy = MemorySessionStore(max_bytes=held(100_000))
    working = busy.create("working", 0.0)
    busy.enter(working)
    busy.weigh(working, 200_000)
    done = busy.create("done", 1.0)
    busy.enter(done)
    busy.weigh(done, 1_000)
    busy.leave(done, 2.0)
    busy.forget_idle(3.0)
    assert list(busy.active_ids()) == ["working", "done"]
    # ...also when another request came in since (its session now the last seen: in flight,
    # never at risk; the one kept was it, and the one that had finished was forgotten)
    other = busy.create("other", 2.5)
    busy.enter(other)
    busy.forget_idle(3.0)
    assert list(busy.active_ids()) == ["working", "done", "other"]


def test_a_small_side_request_does_not_hide_the_history_its_session_still_holds() -> None:
    """A title or summary call under the agent's session id: the agent's last history is still
    held (as a base of the log's delta coding, by the body memos), so it still counts."""
    store = MemorySessionStore()
    agent = store.create("agent", 0.0)
    store.weigh(agent, 250_000)
    store.weigh(agent, 1_000)
    assert agent.weight == held(250_000) and store.bytes == held(250_000)
    for _ in range(SIZES_KEPT - 2):
        store.weigh(agent, 1_000)
    assert agent.weight == held(250_000)  # the accounting may still hold it as a baseline
    store.weigh(agent, 1_000)
    assert agent.weight == held(1_000) and store.bytes == held(1_000)  # as many small ones since


def test_every_history_the_log_still_holds_counts_past_the_last_eight_requests() -> None:
    """A dozen sub-agents taking turns under one id, each turn appending 10 KB to its own
    history (the same objects from turn to turn): only the last eight requests were looked
    at, and the other histories, still held as the log's bases, went uncounted (~25 times
    less than held with 32 of them). Once the log lets one go, it is no longer counted."""
    store = MemorySessionStore()
    state = store.create("fan", 0.0)
    histories: list[list[dict[str, str]]] = [
        [SYSTEM, {"role": "user", "content": f"task {n}"}] for n in range(12)
    ]
    for turn in range(5):
        for n, history in enumerate(histories):
            history.append({"role": "assistant", "content": f"step {turn}"})
            size = 10_000 * (turn + 1)
            store.weigh(state, size, len(history), (10_000, 1), history[1])
            # (as the log does: an exchange replaces the one of its history it carries on)
            state.remember(100 * turn + n, list(history), continues=100 * (turn - 1) + n)
    own = BYTES_HELD_PER_OWN_BYTE * 10_000 * 5  # what each history appended, all five turns
    largest = BYTES_HELD_PER_BODY_BYTE * 50_000
    assert state.weight == SESSION_BASE_BYTES + largest + 11 * own
    state.recent = state.recent[1:]  # the log no longer holds the oldest history
    store.weigh(state, 100, 1)
    assert state.weight == SESSION_BASE_BYTES + largest + 10 * own


def test_a_request_of_many_short_messages_weighs_by_its_messages() -> None:
    store = MemorySessionStore()
    chat = store.create("chat", 0.0)
    store.weigh(chat, 40_000, 1_000)  # 1,000 messages of 40 bytes
    assert chat.weight == SESSION_BASE_BYTES + 1_000 * BYTES_HELD_PER_MESSAGE
    agent = store.create("agent", 0.0)
    store.weigh(agent, 600_000, 400)  # an agent's turn: its bytes outweigh its messages
    assert agent.weight == held(600_000)
    assert store.bytes == chat.weight + agent.weight


def test_forgetting_for_idle_time_or_count_gives_back_the_memory_and_says_why() -> None:
    reasons: list[str] = []
    store = MemorySessionStore(max_sessions=2, idle_ttl_s=100, on_evict=reasons.append)
    for i, sid in enumerate(("a", "b", "c")):
        store.weigh(store.create(sid, float(i)), 1000)
    assert sorted(store.active_ids()) == ["b", "c"] and reasons == ["count"]
    assert store.bytes == 2 * held(1000)
    assert store.get("b", 150.0) is None  # idle 149 s
    assert reasons == ["count", "idle"] and store.bytes == held(1000)
    store.create("d", 300.0)  # c idle too: forgotten as d arrives
    assert reasons == ["count", "idle", "idle"] and store.bytes == 0

    e = store.create("e", 400.0)
    store.index(e, convo("task e", 2))
    store.weigh(e, 5000)
    assert store.infer_shared(convo("task e", 3), 501.0) == (None, 0)  # idle: not joined
    assert reasons[-1] == "idle" and "e" not in store.active_ids() and store.bytes == 0


def test_forgetting_for_memory_is_logged_now_and_then(caplog: pytest.LogCaptureFixture) -> None:
    store = MemorySessionStore(max_bytes=1024 * 1024)
    with caplog.at_level("WARNING", logger="proxy.sessions"):
        for i in range(5):
            store.weigh(store.create(f"s{i}", float(i)), 200_000)
    assert len(store) == 1
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1  # four sessions forgotten, one warning (at most every 5 minutes)
    assert "sessions.max_memory_mb (1 MiB) reached" in warnings[0]
    assert "(session s0, last seen 1 s ago)" in warnings[0]


def test_no_memory_budget_keeps_every_session_and_a_failing_observer_breaks_nothing() -> None:
    def broken(reason: str) -> None:
        raise RuntimeError("metrics down")

    store = MemorySessionStore(max_bytes=0, on_evict=broken)
    for i in range(50):
        store.weigh(store.create(f"s{i}", float(i)), 10_000_000)
    assert len(store) == 50 and store.bytes == 50 * held(10_000_000)
    capped = MemorySessionStore(max_bytes=held(10), on_evict=broken)
    capped.weigh(capped.create("x", 0.0), 10)
    capped.weigh(capped.create("y", 1.0), 10)  # x forgotten; the observer's failure is logged
    assert list(capped.active_ids()) == ["y"]


def test_new_ids_are_valid_and_unique() -> None:
    ids = {new_session_id(1_790_000_000.0) for _ in range(100)}
    assert len(ids) == 100
    assert all(valid_session_id(i) for i in ids)
    assert all(i.startswith("20260921-141320-") and len(i) == 24 for i in ids)
    # the time stamp follows the clock, back and forth, though one second is formatted once
    assert new_session_id(1_790_000_061.9).startswith("20260921-141421-")
    assert new_session_id(1_790_000_000.2).startswith("20260921-141320-")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_process_makes_other_ids_than_its_parent() -> None:
    """Ids come from a keyed hash of a counter (no system call per id): a forked child gets a
    key of its own, so parent and child do not hand out the same ids (with the parent's key,
    counting on from the same counter, all 500 would be the same)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, "\n".join(new_session_id(1.0) for _ in range(500)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        child = set(f.read().decode().split("\n"))
    parent = {new_session_id(1.0) for _ in range(500)}
    assert len(child) == len(parent) == 500
    # (two 32-bit suffixes alike by chance: about one run in 17,000 has one, as a CI run did)
    assert len(child & parent) <= 2


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ({"role": "user", "content": "hi", "n": 1}, {"role": "user", "content": "hi", "n": True}),
        ({"role": "user", "content": "hi", "n": 1.0}, {"role": "user", "content": "hi", "n": 1}),
        ({"role": "user", "content": [1]}, {"role": "user", "content": [True]}),
    ],
)
def test_a_message_equal_only_to_python_is_not_shared(old: dict, new: dict) -> None:
    """1, 1.0 and true are equal to Python: the session shared the previous request's message
    for the edited one, so the log and a repaired body kept the old value."""
    from proxy.sessions import shared_prefix

    first = {"role": "system", "content": "s"}
    assert shared_prefix([first, old], [dict(first), new, {"role": "user", "content": "x"}]) == 1
    assert shared_prefix([first, old], [first, dict(old)]) == 2


def test_a_message_sent_again_in_another_key_order_is_shared() -> None:
    """A serializer that orders keys anew each turn: no message was shared, and every log line
    held the whole history (a log growing with the conversation's square)."""
    from proxy.sessions import shared_prefix

    old = [{"role": "user", "content": "hi", "meta": {"a": 1, "b": 2}}]
    new = [{"meta": {"b": 2, "a": 1}, "content": "hi", "role": "user"}, {"role": "user"}]
    assert shared_prefix(old, new) == 1
    # among others sent as they were (those are compared at once, as sent, then one by one)
    same = [{"role": "assistant", "content": f"step {i}"} for i in range(3)]
    old = [*same, *old, *same]
    new = [*(dict(m) for m in same), new[0], *(dict(m) for m in same), {"role": "user"}]
    assert shared_prefix(old, new) == 7


def test_a_history_is_found_again_after_its_system_prompt_changed_or_it_was_trimmed() -> None:
    """Where a history meets the previous request's again past a change: its messages after
    the system prompt (the time in it), those it kept of a sliding window or of a cut, those
    after an edited message; nothing for another conversation, nor for 1 where 1.0 was."""
    from proxy.sessions import REALIGN_PROBES, realigned

    s1, s2 = ({"role": "system", "content": f"It is {t}:00."} for t in (9, 10))
    m = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(30)]
    old = [s1, *m[:10]]
    assert realigned(old, [s2, *m[:12]], 0) == (1, 1, 10)  # the time changed
    assert realigned(old, [s1, *m[3:12]], 1) == (1, 4, 7)  # three dropped from the start
    assert realigned(old, [s1, m[0], *m[6:12]], 2) == (2, 7, 4)  # a run cut after the task
    edited = [s1, *m[:4], {"role": "assistant", "content": "other"}, *m[5:12]]
    assert realigned(old, edited, 5) == (6, 6, 5)  # what follows the edit
    rewound = [s2, *m[:6]]  # the time changed and two turns undone: up to where it parts
    assert realigned(old, rewound, 0) == (1, 1, 6)
    assert realigned(old, [s2, *m[:6], {"role": "user", "content": "no"}], 0) == (1, 1, 6)
    assert realigned(old, [s1, *m[10:20]], 1)[2] == 0  # another conversation
    many = [s1, *m[3:10], *m[10 : 10 + REALIGN_PROBES]]  # more appended than is looked at
    assert realigned(old, many, 1)[2] == 0
    assert realigned(old, [s1, *m[3:10], *m[10 : 9 + REALIGN_PROBES]], 1) == (1, 4, 7)
    floats, ints = ([{**message, "n": n} for message in m[:10]] for n in (1.0, 1))
    assert realigned([s1, *floats], [s2, *ints, m[10]], 0)[2] == 0  # equal to Python only
    assert realigned(old, old[:5], 5) == (5, 5, 0)  # nothing past the parting
    # the user says the same again ("continue"): the message appended is not the one it kept
    go = {"role": "user", "content": "continue"}
    said = [s1, *m[:9], go]
    assert realigned(said, [s1, *m[4:9], go, m[9], go], 1) == (1, 5, 6)


def test_sub_agents_sharing_their_main_agents_session_count_their_own_histories() -> None:
    """Each sub-agent's body continues its own last one (a few KB appended a turn): weighed by
    what each turn appended, a main agent and four sub-agents read as the main agent alone, at
    ~0.4 of what they held."""
    from proxy.sessions import BYTES_HELD_PER_OWN_BYTE

    store = MemorySessionStore()
    state = store.create("agents", 0.0)
    anchors = [{"role": "user", "content": f"task {i}"} for i in range(5)]  # main, 4 sub-agents
    sizes = [0] * 5
    for turn in range(20):
        for agent, anchor in enumerate(anchors):
            grown = 30_000 if agent == 0 else 15_000
            new = (sizes[agent] + grown, 10) if turn == 0 else (grown, 2)
            sizes[agent] += grown
            store.weigh(state, sizes[agent], 10 + 2 * turn, new, anchor)
    expected = BYTES_HELD_PER_BODY_BYTE * sizes[0] + BYTES_HELD_PER_OWN_BYTE * sum(sizes[1:])
    assert state.weight >= 0.95 * expected
    # an agent alone that appends weighs its largest, as before
    alone = store.create("alone", 0.0)
    anchor = anchors[0]
    for turn in range(20):
        store.weigh(alone, 30_000 * (turn + 1), 10 + 2 * turn, (30_000, 2), anchor)
    assert alone.weight <= held(30_000 * 20) * 1.05


def test_a_session_a_summary_is_written_for_is_not_forgotten_until_it_is_done() -> None:
    reasons: list[str] = []
    store = MemorySessionStore(max_bytes=2 * held(100_000), max_sessions=3, on_evict=reasons.append)
    busy = store.create("busy", 0.0)
    store.weigh(busy, 100_000)
    busy.busy = 1  # (a summary being written: Compactor)
    idle = store.create("idle", 1.0)
    store.weigh(idle, 100_000)
    store.weigh(store.create("new", 2.0), 100_000)  # over the budget: idle goes, not busy
    assert sorted(store.active_ids()) == ["busy", "new"]
    store.create("x", 3.0)
    store.create("y", 4.0)  # over max_sessions: the oldest not busy goes
    assert "busy" in store.active_ids() and len(store) == 3
    busy.busy = 0
    store.touch(busy)  # done: as just seen
    store.create("z", 5.0)
    assert "busy" in store.active_ids()
    assert reasons == ["memory", "count", "count"]


def test_a_session_with_a_request_in_flight_is_not_idle_and_its_idle_time_runs_from_the_end() -> (
    None
):
    reasons: list[str] = []
    store = MemorySessionStore(max_sessions=2, idle_ttl_s=100, on_evict=reasons.append)
    working = store.create("working", 0.0)
    store.enter(working)  # a request of it in flight from 0 to 150
    assert store.get("working", 150.0) is working  # not idle under its own request
    store.create("b", 150.0)
    store.create("c", 150.0)  # over max_sessions: b goes, not the session at work
    assert sorted(store.active_ids()) == ["c", "working"]
    store.leave(working, 150.0)
    assert working.requests == 0
    store.create("d", 200.0)  # now the least recently seen is c
    assert sorted(store.active_ids()) == ["d", "working"]
    assert store.get("working", 249.0) is working  # 99 s after its request ended
    assert store.get("working", 251.0) is None  # 101 s: idle, forgotten
    assert reasons == ["count", "count", "idle"]


def test_a_session_at_work_does_not_keep_the_idle_ones_after_it() -> None:
    """The least recently seen session has a request in flight: the idle ones seen after it
    are still forgotten (by a scrape too), so the sessions gauges fall."""
    store = MemorySessionStore(idle_ttl_s=100)
    working = store.create("working", 0.0)
    store.enter(working)
    store.create("idle", 10.0)
    store.create("recent", 450.0)
    store.forget_idle(500.0)
    assert sorted(store.active_ids()) == ["recent", "working"]
    store.leave(working, 600.0)
    store.forget_idle(651.0)  # recent: idle 201 s; working: 51 s since its request ended
    assert sorted(store.active_ids()) == ["working"]


def test_the_session_just_created_is_not_the_one_forgotten_for_count_when_the_others_are_busy() -> (
    None
):
    store = MemorySessionStore(max_sessions=2)
    a, b = store.create("a", 0.0), store.create("b", 1.0)
    a.busy = b.busy = 1  # summaries being written for both
    c = store.create("c", 2.0)
    assert store.get("c") is c  # over the count until they are done, rather than c forgotten
    assert sorted(store.active_ids()) == ["a", "b", "c"]
    a.busy = 0
    store.create("d", 3.0)
    assert sorted(store.active_ids()) == ["b", "d"]  # the oldest not busy go: a, then c


def _weight_by_definition(
    sizes: list[tuple[int, int, object]],
    owns: dict[int, tuple[int, object]],
    recent: list[tuple[int, list[object]]],
    request_bytes: int,
    messages: int,
    new: tuple[int, int],
    anchor: object,
) -> int:
    """``weigh``'s estimate as it is defined, every history looked at each time: the largest of
    the last SIZES_KEPT requests, plus each one's own, plus the own of every other history whose
    opening one of the log's recent bases still holds (the others forgotten)."""
    whole = max(BYTES_HELD_PER_BODY_BYTE * request_bytes, BYTES_HELD_PER_MESSAGE * messages)
    own = min(whole, max(BYTES_HELD_PER_OWN_BYTE * new[0], BYTES_HELD_PER_MESSAGE * new[1]))
    if anchor is not None:
        latest = [at for at, (_, _, a) in enumerate(sizes) if a is anchor]
        if latest:
            w, carried, a = sizes[latest[-1]]
            sizes[latest[-1]] = (w, 0, a)
        else:
            carried = owns.get(id(anchor), (0, None))[0]
        own = min(whole, own + carried) if carried else own
        owns[id(anchor)] = (own, anchor)
    sizes.append((whole, own, anchor))
    del sizes[:-SIZES_KEPT]
    largest = max(sizes, key=lambda entry: entry[0])[0]
    own_of_largest = [o for w, o, _ in sizes if w == largest][-1]
    weight = SESSION_BASE_BYTES + largest + sum(o for _, o, _ in sizes) - own_of_largest
    if len(owns) > 1:
        looked_at = {id(a) for _, _, a in sizes if a is not None}
        live = {id(anchor_of(m)) for _, m in recent}
        for key, (o, _) in list(owns.items()):
            if key in looked_at:
                continue
            if key in live:
                weight += o
            else:
                del owns[key]
    return weight


@settings(max_examples=500, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(-2, 4),  # a history (of 5), a new one each time (-1), none (-2)
            st.integers(1, 400_000),  # the request's bytes
            st.integers(0, 300_000),  # its own bytes
            st.booleans(),  # its line becomes one of the log's recent bases
            st.integers(1, 8),  # how many bases the log keeps by then
        ),
        max_size=80,
    )
)
def test_the_memory_estimate_of_many_histories_is_the_one_defined(
    steps: list[tuple[int, int, int, bool, int]],
) -> None:
    """However histories interleave, come back after SIZES_KEPT other requests, or leave the
    log's recent bases, the estimate ``weigh`` keeps as it goes equals the one computed from
    everything each time (sub-agents, one-shot requests with a new history each)."""
    store = MemorySessionStore()
    state = store.create("s", 0.0)
    openings = [{"role": "user", "content": f"task {i}"} for i in range(5)]
    sizes: list[tuple[int, int, object]] = []
    owns: dict[int, tuple[int, object]] = {}
    for n, (which, size, own, remembered, kept) in enumerate(steps):
        anchor = None if which == -2 else {"role": "user"} if which == -1 else openings[which]
        history = [SYSTEM, anchor] if anchor is not None else [SYSTEM]
        expected = _weight_by_definition(
            sizes, owns, state.recent, size, 2, (min(own, size), 1), anchor
        )
        store.weigh(state, size, 2, (min(own, size), 1), anchor_of(history))
        assert state.weight == expected
        if remembered:
            state.recent.append((n, history))
        del state.recent[:-kept]


def test_a_retry_of_the_same_body_is_not_counted_twice() -> None:
    """The same history sent again (an SDK's retry): of equal sizes the latest counts whole, and
    what the first held is carried on to it, not counted beside it."""
    store = MemorySessionStore()
    state = store.create("s", 0.0)
    anchor = {"role": "user", "content": "task"}
    store.weigh(state, 100_000, 20, (100_000, 20), anchor)  # a first request: all its own
    store.weigh(state, 100_000, 20, (0, 0), anchor)  # the retry: all shared
    assert state.weight == held(100_000)


def test_recent_keeps_one_base_per_conversation_and_an_exchanges_latest_attempt() -> None:
    state = SessionState(id="s", created=0.0, last_seen=0.0)
    a1, b1 = [{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]
    state.remember(1, a1)
    state.remember(2, b1)
    a2 = [*a1, {"role": "assistant", "content": "x"}]
    state.remember(3, a2, continues=1)  # carries exchange 1 on whole: takes its place
    assert state.recent == [(2, b1), (3, a2)]
    retried = [*a2, {"role": "user", "content": "again"}]
    state.remember(3, retried)  # the same exchange's retry replaces its refused attempt
    assert state.recent == [(2, b1), (3, retried)]
    for n in range(4, 8):
        state.remember(n, [{"role": "user", "content": str(n)}], keep=3)
    assert [eid for eid, _ in state.recent] == [5, 6, 7]  # the oldest go past ``keep``


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ([{"a": "x"}], [{"a": "x"}, {"b": 1}]),  # carried on whole
        ([{"a": "x"}, {"b": 1}], [{"a": "x"}, {"b": 1}]),  # sent again
        ([1], [10]),  # a number that goes on past the old one's end
        ([{"a": "x"}], [{"a": 'x",{'}]),  # a string whose text looks like JSON
        ([{"n": 1}], [{"n": 1.0}, {}]),  # equal to Python, another JSON
        ([{"n": True}], [{"n": 1}, {}]),
        ([{"a": 1, "b": 2}], [{"b": 2, "a": 1}, {}]),  # another key order: shared, as without
        ([{"a": "x"}, {"b": 1}], [{"a": "x"}]),  # cut short
        ([], [{"a": "x"}]),
        ([{"a": "x"}, {"b": 2}], [{"a": "x"}, {"b": 3}, {"c": 4}]),  # edited
    ],
)
def test_items_told_by_their_json_share_what_a_comparison_finds(
    old: list[object], new: list[object]
) -> None:
    """A Responses API session's items, parsed anew each turn, are told to carry the last
    request's on by their compact JSON: the same answer as comparing them."""
    from proxy.sessions import dump_items, shared_prefix

    assert shared_prefix(old, new, (dump_items(old), dump_items(new))) == shared_prefix(old, new)


def _held_per_message(messages: list[Any]) -> float:
    """What a chat body of ``messages`` holds per message, parsed and fingerprinted (by
    tracemalloc), with its raw bytes (the body memo's copy)."""
    import gc
    import tracemalloc

    import orjson

    from proxy import prefix

    raw = orjson.dumps({"model": "gpt-4o", "messages": messages})
    gc.collect()
    tracemalloc.start()
    try:
        body = orjson.loads(raw)
        fingerprint = prefix.fingerprint(body)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert fingerprint is not None
    return (held + len(raw)) / len(messages)


def test_the_estimate_per_part_covers_what_a_history_of_many_parts_holds() -> None:
    """Messages of ten short text parts: what their parse and fingerprint hold, with the body's
    bytes, is within what a message and its nine parts past the first are counted at."""
    from proxy.sessions import BYTES_HELD_PER_PART

    messages: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": f"p{i}.{k}"} for k in range(10)]}
        for i in range(2000)
    ]
    per_message = _held_per_message(messages)
    assert per_message <= BYTES_HELD_PER_MESSAGE + 9 * BYTES_HELD_PER_PART, per_message


def test_parts_are_counted_in_what_a_turn_appends_and_carried_for_the_rest() -> None:
    from proxy.sessions import SessionState, extra_parts

    state = SessionState("s", 0.0, 0.0)
    three = {"role": "user", "content": [{"type": "text", "text": "a"}] * 3}
    one = {"role": "assistant", "content": "ok"}
    history: list[object] = [three] * 10
    assert extra_parts(history, 10, state) == (20, 20)
    history += [one, three]
    assert extra_parts(history, 2, state) == (22, 2)  # 20 carried, 2 counted
    assert extra_parts(history[:6], 0, state) == (11, 0)  # a rewind: the share carried
    assert extra_parts("not a list", 3, state) == (0, 0)
    # per history: a title request between two turns carries nothing onto the next turn
    state = SessionState("s", 0.0, 0.0)
    anchor: dict[str, object] = {"role": "user", "content": [{"type": "text", "text": "t"}] * 3}
    history = [anchor, *[three] * 9]
    assert extra_parts(history, 10, state, anchor) == (20, 20)
    title = {"role": "user", "content": "a title, please"}
    assert extra_parts([title], 1, state, title) == (0, 0)
    history += [one, three]
    assert extra_parts(history, 2, state, anchor) == (22, 2)  # (the title's 0 not carried)
    # parsed anew (its anchor another object), it shares what it shares with the last request
    again = [dict(anchor), *history[1:], one, three]
    assert extra_parts(again, 2, state, again[0]) == (24, 2)
    # a dozen sub-agents of plain text, two turns each, between two turns of the main agent:
    # they take no place among the histories kept (the eighth pushed the main one's out)
    main = again[0]
    for k in range(12):
        task = {"role": "user", "content": f"sub-task {k}"}
        assert extra_parts([task], 1, state, task) == (0, 0)
        assert extra_parts([task, one, one], 2, state, task) == (0, 0)
    assert extra_parts([*again, one, three], 2, state, main) == (26, 2)


def test_the_estimate_per_message_covers_what_a_tool_call_history_holds() -> None:
    """An agent's history of tool calls and short results (~120 bytes a message): its parse and
    its fingerprint alone, measured by tracemalloc, with the body memo's copy of its bytes,
    held more per message than the estimate counted (768 bytes), so a 100 MiB
    ``sessions.max_memory_mb`` held ~150 MiB of such sessions."""
    import orjson

    messages: list[Any] = [{"role": "system", "content": "You are an agent."}]
    for i in range(3000):
        arguments = orjson.dumps({"path": f"src/m{i}.py"}).decode()
        call = {"id": f"call_{i:06d}", "type": "function"}
        call["function"] = {"name": "read_file", "arguments": arguments}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"ok: {i} lines"})
    per_message = _held_per_message(messages)
    assert per_message <= BYTES_HELD_PER_MESSAGE, per_message
