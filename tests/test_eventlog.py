import contextlib
import hashlib
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy import eventlog
from proxy.eventlog import (
    GITIGNORE,
    Delta,
    EventLogWriter,
    LogRead,
    NotALogFile,
    _as_written,
    _without,
    choose_base,
    choose_delta,
    enforce_retention,
    iter_replay_requests,
    logged_compactions,
    lost_lines,
    lost_requests,
    read_events,
    replay,
    replay_requests,
    session_log_path,
    strip_bodies,
)

Message = dict[str, Any]


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "logs"


@pytest.fixture
def writers() -> Iterator[list[EventLogWriter]]:
    """Writers created by a test, closed at teardown even when the test fails."""
    made: list[EventLogWriter] = []
    yield made
    for w in made:
        w.close()


def started(writers: list[EventLogWriter], log_dir: Path, **kwargs: Any) -> EventLogWriter:
    w = EventLogWriter(log_dir, **kwargs)
    w.start()
    writers.append(w)
    return w


def request_event(exchange: int, base_exchange: int | None, base: int, appended: list[Message]):
    return {
        "type": "request",
        "exchange": exchange,
        "model": "gpt-4o",
        "stream": True,
        "path": "/v1/chat/completions",
        "base_exchange": base_exchange,
        "base": base,
        "appended": appended,
        "repairs": [],
        "transforms": {},
        "bytes": 1000,
    }


# ------------------------------------------------------------------------------------------------
# Writing and reading


def test_a_sessions_flush_waits_only_when_that_session_has_lines_queued(
    tmp_path: Path, writers: list[EventLogWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session's compactions are read back from its file after its queued lines are written;
    a session with none queued does not wait for every other session's lines (2 s of them under
    load, on the request's path)."""
    from proxy import eventlog

    monkeypatch.setattr(eventlog, "POLL_S", 5.0)  # (events wait a poll: here, a long one)
    w = started(writers, tmp_path)
    time.sleep(0.1)  # (the writer asleep in its poll)
    w.emit("busy", {"type": "request", "exchange": 1})
    started_at = time.monotonic()
    assert w.flush_session("idle", 3.0)
    assert time.monotonic() - started_at < 0.5
    assert not (tmp_path / "busy.jsonl").exists()  # nothing was written for it
    assert w.flush_session("busy", 3.0)
    assert (tmp_path / "busy.jsonl").read_bytes().count(b"\n") == 1


def test_a_sessions_flush_waits_for_a_line_the_writer_has_taken_but_not_written(
    tmp_path: Path, writers: list[EventLogWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line taken off the queue and not yet written is in neither the queue nor the file: the
    look at the queue missed it, and the compaction line read back was not there."""
    import threading

    inside, release = threading.Event(), threading.Event()
    serialize = EventLogWriter._serialize

    def held(self: EventLogWriter, ts: float, event: Any) -> Any:
        if isinstance(event, dict) and event.get("type") == "compacted":
            inside.set()
            release.wait(5)
        return serialize(self, ts, event)

    monkeypatch.setattr(EventLogWriter, "_serialize", held)
    w = started(writers, tmp_path)
    w.emit("s", {"type": "compacted", "exchange": 1})
    assert inside.wait(5)  # the writer holds the line
    threading.Timer(0.2, release.set).start()
    assert w.flush_session("s", 3.0)
    assert b"compacted" in (tmp_path / "s.jsonl").read_bytes()


def test_a_kept_meta_line_costs_its_own_size(tmp_path: Path) -> None:
    """The meta lines kept for sessions whose files may be made again (4,096 of them) held
    orjson's whole 4 KiB buffer each: ~16 MiB outside the memory budget, for ~100-byte lines."""
    import tracemalloc

    import orjson

    w = EventLogWriter(tmp_path)  # not started: only its store of meta lines is used
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1_000):
            meta = {"type": "session_meta", "session": f"s{i}", "upstream": "http://x/v1"}
            w._remember_meta(f"s{i}", orjson.dumps(meta, option=orjson.OPT_APPEND_NEWLINE))
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 400_000, kept  # ~4.1 MB before


def test_events_round_trip_one_object_per_line(log_dir: Path, writers) -> None:
    w = started(writers, log_dir)
    meta = {"ts": 1700000000.5, "type": "session_meta", "session": "s1", "model": "gpt-4o"}
    req = request_event(1, None, 0, [{"role": "user", "content": "héllo ☃"}])
    resp = {"type": "response", "exchange": 1, "status": 200, "message": None, "usage": None}
    assert w.emit("s1", meta) and w.emit("s1", req) and w.emit("s1", resp)
    before = time.time()
    assert w.close()

    path = log_dir / "s1.jsonl"
    raw = path.read_bytes()
    assert raw.endswith(b"\n") and raw.count(b"\n") == 3
    log = read_events(path)
    assert log.torn == 0
    assert log.events[0] == meta
    assert {k: v for k, v in log.events[1].items() if k != "ts"} == req
    assert list(log.events[2])[:2] == ["ts", "type"]  # ts and type lead every line
    assert before - 5 < log.events[2]["ts"] <= time.time()
    assert (w.written, w.dropped, w.errors) == (3, 0, 0)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_emit_never_mutates_the_callers_event(log_dir: Path, writers) -> None:
    w = started(writers, log_dir)
    event = {"type": "error", "exchange": 1, "status": 502, "message": "upstream unreachable"}
    w.emit("s", event)
    assert w.flush()
    assert event == {
        "type": "error",
        "exchange": 1,
        "status": 502,
        "message": "upstream unreachable",
    }


def conversation_turn(i: int) -> tuple[Message, Message]:
    reply = {"role": "assistant", "content": f"Answer number {i:04d}. " + "detail " * 30}
    follow_up = {"role": "user", "content": f"Follow-up question {i:04d}? " + "context " * 30}
    return reply, follow_up


def test_a_first_in_file_event_is_written_only_to_a_file_with_no_line_yet(
    log_dir: Path, writers
) -> None:
    """A session's meta line is written once per file: to a new file, not to one an earlier
    process started (nor a second time when emitted twice in one batch); the events after it
    are written either way."""
    log_dir.mkdir()
    earlier = log_dir / "old.jsonl"
    earlier.write_bytes(b'{"ts":1.0,"type":"session_meta","session":"old"}\n')
    w = started(writers, log_dir)
    for sid in ("old", "new"):
        w.emit(sid, {"type": "session_meta", "session": sid}, first_in_file=True)
        w.emit(sid, {"type": "session_meta", "session": sid, "again": 1}, first_in_file=True)
        w.emit(sid, {"type": "error", "exchange": 1, "status": 400, "message": "m"})
    assert w.flush()
    w.emit("new", {"type": "session_meta", "session": "new", "later": 1}, first_in_file=True)
    assert w.close()
    old = [e["type"] for e in read_events(earlier).events]
    assert old == ["session_meta", "error"]
    new = read_events(log_dir / "new.jsonl").events
    assert [e["type"] for e in new] == ["session_meta", "error"]
    assert "again" not in new[0] and w.written == 3 and w.errors == 0


def test_200_exchanges_grow_the_log_linearly_and_replay_exactly(log_dir: Path, writers) -> None:
    w = started(writers, log_dir)
    path = log_dir / "conv.jsonl"
    w.emit("conv", {"type": "session_meta", "session": "conv", "model": "gpt-4o"})
    messages: list[Message] = [
        {"role": "system", "content": "You are a careful coding agent. " * 40},
        {"role": "user", "content": "Start the task."},
    ]
    sent: list[tuple[int, list[Message]]] = []
    sizes: dict[int, int] = {}
    for exchange in range(1, 201):
        window = sent[-8:]
        base_exchange, base = choose_base(window, messages)
        w.emit("conv", request_event(exchange, base_exchange, base, messages[base:]))
        sent.append((exchange, messages))
        reply, follow_up = conversation_turn(exchange)
        w.emit("conv", {"type": "response", "exchange": exchange, "status": 200, "message": reply})
        messages = [*messages, reply, follow_up]  # a new list: the emitted one is never mutated
        if exchange in (20, 40, 180, 200):
            assert w.flush()
            sizes[exchange] = path.stat().st_size
    assert w.close()

    early = (sizes[40] - sizes[20]) / 20
    late = (sizes[200] - sizes[180]) / 20
    assert late < early * 1.1  # linear: a late exchange costs what an early one did
    assert sizes[200] < 300 * 1024  # not quadratic: the last request alone holds ~100 KB of text

    log = read_events(path)
    assert log.torn == 0
    assert replay(log.events) == sent


def test_interleaved_sub_agents_and_retries_replay_exactly(log_dir: Path, writers) -> None:
    def agent(system: str, task: str) -> list[Message]:
        return [{"role": "system", "content": system}, {"role": "user", "content": task}]

    threads = {
        "main": agent("You are the lead agent.", "Refactor the parser."),
        "sub-a": agent("You are a search sub-agent.", "Find usages of parse()."),
        "sub-b": agent("You are a search sub-agent.", "Find the tests of parse()."),
    }
    order = ["main", "sub-a", "sub-b", "sub-a", "main", "sub-b", "sub-b", "sub-a", "main"]
    order += ["main", "sub-a", "main"]
    retry_after = {4, 9}  # these exchanges are resent unchanged, as a client retry would
    w = started(writers, log_dir)
    sent: list[tuple[int, list[Message]]] = []
    exchange = 0
    for step, name in enumerate(order):
        repeats = 2 if step in retry_after else 1
        for _ in range(repeats):
            exchange += 1
            messages = threads[name]
            base_exchange, base = choose_base(sent, messages)
            w.emit("multi", request_event(exchange, base_exchange, base, messages[base:]))
            sent.append((exchange, messages))
        reply = {"role": "assistant", "content": f"{name} step {step}"}
        threads[name] = [*messages, reply, {"role": "user", "content": f"go on {step}"}]
    assert w.close()

    log = read_events(log_dir / "multi.jsonl")
    requests = [e for e in log.events if e["type"] == "request"]
    assert requests[5]["appended"] == [] and requests[5]["base_exchange"] == 5  # the retry
    assert replay(log.events) == sent


def test_torn_last_line_is_counted_and_skipped(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    good = [{"ts": 1.0, "type": "session_meta", "session": "s"}, {"ts": 2.0, "type": "error"}]
    path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in good) + b'{"ts": 3.0, "type": "req')
    # (cut in its type: it may have been a request, which replay says)
    assert read_events(path) == LogRead(events=good, torn=1, torn_requests=1, torn_at_end=True)


def test_a_line_being_written_while_it_is_read_counts_once_at_most() -> None:
    """A reader that reaches the file's end inside a line stops there: the rest of that line,
    appended meanwhile, is not read as a second torn line (a report run during a session
    showed 2 torn lines in a file that had none)."""
    from proxy.eventlog import parse_lines

    as_read = [b'{"ts":1.0,"type":"error"}\n', b'{"ts":2.0,"ty', b'pe":"error"}\n']
    assert parse_lines(as_read) == LogRead(
        events=[{"ts": 1.0, "type": "error"}], torn=1, torn_requests=1, torn_at_end=True
    )
    whole = [b'{"ts":1.0,"type":"error"}\n', b'{"ts":2.0,"type":"error"}']  # no line end yet
    assert len(parse_lines(whole).events) == 2


def test_a_new_writer_does_not_glue_its_first_line_to_a_torn_one(log_dir: Path, writers) -> None:
    log_dir.mkdir()
    path = log_dir / "s.jsonl"
    path.write_bytes(b'{"ts": 1.0, "type": "session_meta"}\n{"ts": 2.0, "type": "requ')
    w = started(writers, log_dir)
    w.emit("s", {"ts": 3.0, "type": "error", "status": 500, "message": "boom"})
    assert w.close()
    log = read_events(path)
    assert log.torn == 1
    assert [e["ts"] for e in log.events] == [1.0, 3.0]
    assert path.read_bytes().startswith(b'{"ts": 1.0, "type": "session_meta"}\n{"ts": 2.0')


def test_unknown_types_and_non_object_lines_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    lines = [
        {"ts": 1.0, "type": "session_meta", "session": "s"},
        {"ts": 1.5, "type": "from_the_future", "exchange": 1, "appended": [{"x": 1}]},
        request_event(1, None, 0, [{"role": "user", "content": "hi"}]),
        [1, 2, 3],
        "just a string",
        request_event(2, 1, 1, [{"role": "user", "content": "again"}]),
    ]
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines) + b"\n")
    log = read_events(path)
    assert log.torn == 0
    assert len(log.events) == 4
    assert replay(log.events) == [
        (1, [{"role": "user", "content": "hi"}]),
        (2, [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]),
    ]


def test_replay_skips_a_request_whose_base_was_lost(caplog) -> None:
    m1, m2, m3 = ({"role": "user", "content": str(i)} for i in range(3))
    events = [
        request_event(2, 1, 1, [m2]),  # exchange 1 was torn away
        request_event(3, 2, 2, [m3]),  # built on the unrebuildable 2
        request_event(4, None, 0, [m1]),
        {"type": "request", "exchange": 5, "base": 1, "appended": [m3]},  # no base_exchange
    ]
    with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
        assert replay(events) == [(4, [m1]), (5, [m1, m3])]
    assert "exchange 2 is based on exchange 1" in caplog.text


def test_replay_after_a_lost_request_line_never_takes_another_runs_line_for_its_base(
    caplog,
) -> None:
    """Exchange numbers start at 1 again with a session forgotten and back (or a restart): a
    line based on the new run's first one, whose line was lost after the next was coded
    against it (a full disk), was rebuilt on the first run's exchange 1 (a body the upstream
    never received). The loss names the numbers: no earlier line of them is a base now."""
    first, second = ({"role": "system", "content": x} for x in ("A", "C"))
    ask, more = {"role": "user", "content": "task"}, {"role": "user", "content": "more"}
    events = [
        request_event(1, None, 0, [first, ask]),
        request_event(2, 1, 2, [more]),
        {"type": "lines_lost", "lines": 1, "requests": 1, "exchanges": [1]},  # the new run's 1
        request_event(2, 1, 2, [more]),  # the new run's exchange 2, on its own exchange 1
        request_event(3, None, 0, [second, ask]),
        request_event(4, 3, 2, [more]),
        {"type": "lines_lost", "lines": 2, "requests": 0},  # responses only: nothing to forget
        request_event(5, 4, 3, [more]),
        # a loss the queue refused (never a base: no numbers) forgets nothing either
        {"type": "lines_lost", "lines": 1, "requests": 1},
        request_event(7, 5, 4, [more]),
    ]
    skipped: list[int] = []
    with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
        got = [(r["exchange_id"], r["messages"]) for r in replay_requests(events, skipped)]
    assert got == [
        (1, [first, ask]),
        (2, [first, ask, more]),
        (3, [second, ask]),
        (4, [second, ask, more]),
        (5, [second, ask, more, more]),
        (7, [second, ask, more, more, more]),
    ]
    assert skipped == [2] and "exchange 2 is based on exchange 1" in caplog.text
    # a list cut short (more numbers lost than a line says): no earlier line is a base
    cut = [*events[:2], {"type": "lines_lost", "lines": 9, "requests": 9, "more_exchanges": True}]
    skipped = []
    rebuilt = replay_requests([*cut, request_event(3, 2, 3, [more])], skipped)
    assert [r["exchange_id"] for r in rebuilt] == [1, 2] and skipped == [3]


def test_a_write_error_names_the_request_lines_it_lost_a_full_queue_none(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines the queue refused were never a base (the observer knew); lines a write lost may
    have been (the next ones were coded against them as they were queued)."""
    import errno

    w = started(writers, log_dir)
    w.emit("s", {"type": "session_meta", "session": "s"}, first_in_file=True)
    w.emit("s", request_event(1, None, 0, [{"role": "user", "content": "a"}]))
    assert w.flush()
    real_write = os.write

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    w.emit("s", request_event(2, 1, 1, [{"role": "user", "content": "b"}]))
    w.emit("s", {"type": "response", "exchange": 2, "status": 200})
    assert w.flush()
    monkeypatch.setattr(os, "write", real_write)
    w.emit("s", request_event(3, 2, 2, [{"role": "user", "content": "c"}]))
    assert w.flush()
    told = [e for e in read_events(log_dir / "s.jsonl").events if e["type"] == "lines_lost"]
    assert [(e["lines"], e["requests"], e.get("exchanges")) for e in told] == [(2, 1, [2])]
    # a full queue: counted, no number
    q = EventLogWriter(log_dir / "q", max_queue=1)  # queued before the writer starts
    writers.append(q)
    assert q.emit("q", request_event(1, None, 0, []))
    assert not q.emit("q", request_event(2, 1, 0, []))
    q.start()
    assert q.close()
    (told_q,) = [
        e for e in read_events(log_dir / "q" / "q.jsonl").events if e["type"] == "lines_lost"
    ]
    assert (told_q["lines"], told_q["requests"], told_q.get("exchanges")) == (1, 1, None)


class Strict(dict):
    """A message that refuses ``==``: proves identical objects are matched by identity."""

    def __eq__(self, other: object) -> bool:
        raise AssertionError("compared by value")


def test_choose_base_prefers_the_longest_shared_prefix() -> None:
    a, b, c, d = ({"role": "user", "content": x} for x in "abcd")
    assert choose_base([], [a]) == (None, 0)
    assert choose_base([(1, [b])], [a, b]) == (None, 0)
    assert choose_base([(1, [a, b]), (2, [a, c]), (3, [a, b, c])], [a, b, c, d]) == (3, 3)
    assert choose_base([(1, [a, b]), (2, [a, b])], [a, b, c]) == (2, 2)  # ties: the later one
    assert choose_base([(1, [a, b, c])], [a, b]) == (1, 2)  # a shorter request (e.g. compacted)
    s = Strict(role="system", content="x")
    assert choose_base([(1, [s, a])], [s, dict(a)]) == (1, 2)


def test_a_history_trimmed_at_its_start_or_in_its_middle_is_coded_against_what_it_kept() -> None:
    """A sliding window (the oldest messages dropped each turn) or a client's truncation near
    the context limit (the first request kept, a run after it dropped): each turn's line held
    the whole history, as nothing was shared from its start on. Now the base's messages from
    where the history meets them again, and only what follows them."""
    s = {"role": "system", "content": "rules"}
    m = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(12)]
    window = [s, *m[0:8]]
    slid = [s, *m[2:10]]  # two dropped from the start, two appended
    assert choose_delta([(1, window)], slid) == Delta(1, 9, 1, 3, kept=1)
    cut = [s, m[0], *m[5:8], *m[8:10]]  # the task kept, four after it dropped
    assert choose_delta([(1, window)], cut) == Delta(1, 9, 2, 6, kept=2)
    bare = [*m[3:8], m[8]]  # no system block at all
    assert choose_delta([(1, m[0:8])], bare) == Delta(1, 8, 0, 3)
    added = [s, *m[0:9]]  # a system prompt where there was none
    assert choose_delta([(1, m[0:8])], added) == Delta(1, 8, 1, 0)
    # a note put in where the messages were dropped: written, the history after it kept
    note = {"role": "user", "content": "(earlier turns left out)"}
    assert choose_delta([(1, window)], [s, note, *m[4:9]]) == Delta(1, 9, 2, 5, kept=1)
    # sub-agents of one task under one prompt: each one's own base, not only the newest's
    other = [s, m[0], *({"role": "assistant", "content": f"x{i}"} for i in range(6))]
    assert choose_delta([(1, window), (2, other)], [s, m[0], *m[5:9]]) == Delta(1, 9, 2, 6, 2)
    # an edit is no trim: nothing after it is found again, the plain prefix
    edited = [s, m[0], {"role": "assistant", "content": "other"}, *m[8:10]]
    assert choose_delta([(1, window)], edited) == Delta(1, 2)
    events = [
        request_event(1, None, 0, window),
        {**request_event(2, 1, 9, slid[7:]), "head": [], "replaces": 3, "kept": 1},
        {**request_event(3, 1, 9, cut[5:]), "head": [], "replaces": 6, "kept": 2},
        request_event(4, None, 0, m[0:8]),
        {**request_event(5, 4, 8, [m[8]]), "head": [], "replaces": 3},
        {**request_event(6, 4, 8, [m[8]]), "head": [s], "replaces": 0},
    ]
    assert [messages for _, messages in replay(events)] == [window, slid, cut, m[0:8], bare, added]


def test_a_changed_system_block_is_written_ahead_of_the_shared_history() -> None:
    """The time in a system prompt: the new system block in full, the history after it coded
    against the exchange it continues; taken only where it writes fewer messages."""
    a, b, c = ({"role": "user", "content": x} for x in "abc")
    s1, s2 = ({"role": "system", "content": f"time {t}"} for t in (1, 2))
    dev = {"role": "developer", "content": "d"}
    assert choose_delta([(1, [s1, a, b])], [s2, a, b, c]) == Delta(1, 3, head=1, replaces=1)
    # a system block that grows: it replaces the base's one message
    assert choose_delta([(1, [s1, a, b])], [s2, dev, a, b, c]) == Delta(1, 3, 2, 1)
    # the system block unchanged, or none: the plain prefix
    assert choose_delta([(1, [s1, a, b])], [s1, a, b, c]) == Delta(1, 3)
    # no system block, and the first message dropped: the base's second, then the appended
    assert choose_delta([(1, [a, b])], [b, a]) == Delta(1, 2, 0, 1)
    # nothing after the system block is shared: written whole, no head
    assert choose_delta([(1, [s1, a])], [s2, b]) == Delta(None, 0)
    # of two candidates, the one sharing more after the system block
    assert choose_delta([(1, [s1, a, b]), (2, [s1, a])], [s2, a, b]) == Delta(1, 3, 1, 1)
    # a static system message, then one with the time: only the changed one is written
    big = {"role": "system", "content": "rules " * 1000}
    assert choose_delta([(1, [big, s1, a, b])], [big, s2, a, b, c]) == Delta(1, 4, 2, 2, kept=1)
    # never more messages than the plain coding: here it shares the two system messages
    assert choose_delta([(1, [big, s1, a])], [big, s1, dev, b]) == Delta(1, 2)
    # replayed: what the base kept of its system block, the head, then the base's messages after
    # its system block, then the appended
    events = [
        request_event(1, None, 0, [s1, a, b]),
        {**request_event(2, 1, 3, [c]), "head": [s2, dev], "replaces": 1},
        request_event(3, None, 0, [big, s1, a]),
        {**request_event(4, 3, 3, [c]), "head": [s2], "replaces": 2, "kept": 1},
    ]
    assert replay(events) == [
        (1, [s1, a, b]),
        (2, [s2, dev, a, b, c]),
        (3, [big, s1, a]),
        (4, [big, s2, a, c]),
    ]


def test_replay_leaves_out_a_line_whose_head_cannot_be_applied(caplog) -> None:
    s1, s2, a = {"role": "system", "content": "1"}, {"role": "system", "content": "2"}, {"x": 1}
    first = request_event(1, None, 0, [s1, a])
    with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
        assert replay([first, {**request_event(2, 1, 1, []), "head": [s2], "replaces": 2}]) == [
            (1, [s1, a])
        ]
    assert "exchange 2 is based on exchange 1" in caplog.text
    for bad in ({"head": "x", "replaces": 1}, {"head": [], "replaces": 1, "kept": 2}):
        skipped: list[int] = []
        lines = [first, {**request_event(2, 1, 2, []), **bad}]
        assert [r["messages"] for r in replay_requests(lines, skipped)] == [[s1, a]]
        assert skipped == [2]


# ------------------------------------------------------------------------------------------------
# Refusals and losses


HOSTILE_IDS = ["../../x", "a" * 200, "a\x00b", "séance", "ℌ", "..", ".", "", "a/b", "a\n", "/etc/x"]


def test_the_parents_a_new_log_directory_needs_are_private_too(tmp_path: Path, writers) -> None:
    """``--log-dir a/b/logs`` made ``a`` and ``a/b`` with the umask's mode, 0777 under ``umask
    000``: any user could then rename the log directory away and put one of theirs there."""
    old = os.umask(0)
    try:
        w = started(writers, tmp_path / "a" / "b" / "logs")
        assert w.emit("s1", {"type": "error", "message": "x"})
        assert w.close()
    finally:
        os.umask(old)
    for made in ("a", "a/b", "a/b/logs"):
        assert stat.S_IMODE((tmp_path / made).stat().st_mode) == 0o700, made


def test_a_new_log_directory_is_private_and_kept_out_of_git(tmp_path: Path, writers) -> None:
    """The default directory (``./cachegate-logs``) is relative: started in a repository, the
    logs (prompts, tool outputs) would show up in ``git status`` and go out with ``git add -A``."""
    import shutil
    import subprocess

    git = shutil.which("git")
    assert git is not None
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run([git, "init", "-q", str(repo)], check=True)
    w = started(writers, repo / "cachegate-logs")
    assert w.emit("s1", {"type": "error", "message": "x"})
    assert w.close()
    log_dir = repo / "cachegate-logs"
    assert (log_dir / "s1.jsonl").exists()
    assert stat.S_IMODE(log_dir.stat().st_mode) == 0o700
    status = subprocess.run(
        [git, "-C", str(repo), "status", "--porcelain", "--untracked-files=all"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert status.stdout == ""


def test_an_existing_log_directory_is_left_as_it_is_with_a_word_if_others_can_read_it(
    tmp_path: Path, writers, caplog: pytest.LogCaptureFixture
) -> None:
    log_dir = tmp_path / "shared"
    log_dir.mkdir()
    log_dir.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
        w = started(writers, log_dir)
        assert w.emit("s1", {"type": "error", "message": "x"})
        assert w.close()
    assert [p.name for p in log_dir.iterdir()] == ["s1.jsonl"]  # nothing else written there
    assert stat.S_IMODE(log_dir.stat().st_mode) == 0o755
    assert any("can be read by other users (mode 755)" in r.getMessage() for r in caplog.records)


def test_another_programs_file_under_a_sessions_name_is_not_written_into(
    tmp_path: Path, writers, caplog: pytest.LogCaptureFixture
) -> None:
    """Claude Code keeps its transcript as ``<session-uuid>.jsonl`` and sends the same id in
    ``x-claude-code-session-id``: in a log directory shared with it, cachegate appended its
    lines to the transcript, which every ``sessions`` command then refused as another tool's
    file (the audit trail written, and in no report), and counted nothing lost. A file
    cachegate began (its first line its own, or one a crash cut, or only NULs) is written on."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir(mode=0o700)
    sid = "0b6f3c1e-1111-2222-3333-444455556666"
    transcript = '{"type":"user","message":{"role":"user","content":"hi"},"sessionId":"x"}\n'
    (log_dir / f"{sid}.jsonl").write_text(transcript)
    (log_dir / "ours.jsonl").write_text('{"ts":1.0,"type":"session_meta","session":"ours"}\n')
    (log_dir / "zeroed.jsonl").write_bytes(b"\0" * 300 + b'me","x":1}\n{"ts":2.0,"type":"e"}\n')
    (log_dir / "nuls.jsonl").write_bytes(b"\0" * 4096)
    losses: list[str] = []
    with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
        w = started(writers, log_dir, on_loss=losses.append)
        for session in (sid, "ours", "zeroed", "nuls"):
            assert w.emit(session, {"type": "error", "message": f"to {session}"})
        assert w.close()
    assert (log_dir / f"{sid}.jsonl").read_text() == transcript  # untouched
    assert losses == ["io"]  # counted: cachegate_event_log_lost_total{kind="write_error"}
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "is another program's file" in said and sid in said
    for session in ("ours", "zeroed", "nuls"):
        assert f'"message":"to {session}"' in (log_dir / f"{session}.jsonl").read_text()


def test_a_hard_link_to_another_users_file_is_not_written_through(
    tmp_path: Path, writers, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``O_NOFOLLOW`` stops a symbolic link, not a hard link: in a directory others can write
    to, one under a session's name to their own file would have the log (prompts, tool outputs)
    appended there. A hard link to a file of the user's own (a snapshot backup's) is written."""
    from proxy import eventlog

    log_dir = tmp_path / "logs"
    log_dir.mkdir(mode=0o700)
    theirs = tmp_path / "theirs.txt"
    theirs.write_text("collecting\n")
    os.link(theirs, log_dir / "s1.jsonl")
    snapshot = tmp_path / "snapshot-s2.jsonl"
    (log_dir / "s2.jsonl").write_text("")
    os.link(log_dir / "s2.jsonl", snapshot)
    # The file's owner is this process's user; the writer is made to run as another one.
    monkeypatch.setattr(eventlog, "_UID", theirs.stat().st_uid + 1)
    losses: list[str] = []
    w = started(writers, log_dir, on_loss=losses.append)
    assert w.emit("s1", {"type": "error", "message": "x"})
    assert w.close()
    assert theirs.read_text() == "collecting\n"
    assert losses == ["io"]  # counted as lost: cachegate_event_log_lost_total{kind="write_error"}
    monkeypatch.setattr(eventlog, "_UID", theirs.stat().st_uid)
    w = started(writers, log_dir, on_loss=losses.append)
    assert w.emit("s2", {"type": "error", "message": "y"})
    assert w.close()
    assert '"message":"y"' in snapshot.read_text()  # the same file, linked twice
    assert losses == ["io"]
    # In a directory others may write into, a second link to the user's own file is refused
    # too (a planted link to ~/.zshrc on a system that lets users link others' files).
    log_dir.chmod(0o777)
    w = started(writers, log_dir, on_loss=losses.append)
    assert w.emit("s2", {"type": "error", "message": "z"})
    assert w.close()
    assert '"message":"z"' not in snapshot.read_text()
    assert losses == ["io", "io"]
    # made so after the writer started (a chmod while cachegate runs): refused the same (it was
    # judged at start alone), and said as it is, not as a file of another user's
    log_dir.chmod(0o700)
    (log_dir / "s3.jsonl").write_text("")
    os.link(log_dir / "s3.jsonl", tmp_path / "snapshot-s3.jsonl")
    w = started(writers, log_dir, on_loss=losses.append)
    log_dir.chmod(0o777)
    with caplog.at_level(logging.WARNING):
        assert w.emit("s3", {"type": "error", "message": "w"})
        assert w.close()
    assert (tmp_path / "snapshot-s3.jsonl").read_text() == ""
    assert losses == ["io", "io", "io"]
    assert any("has 2 links, and others may write" in r.getMessage() for r in caplog.records)


def test_hostile_session_ids_are_refused_and_touch_nothing(tmp_path: Path, writers) -> None:
    log_dir = tmp_path / "logs"
    losses: list[str] = []
    w = started(writers, log_dir, on_loss=losses.append)
    for bad in HOSTILE_IDS:
        assert w.emit(bad, {"type": "error", "message": "x"}) is False
        with pytest.raises(ValueError, match="invalid session id"):
            session_log_path(log_dir, bad)
    assert w.emit(123, {"type": "error"}) is False  # type: ignore[arg-type]
    assert w.close()
    assert w.dropped == len(HOSTILE_IDS) + 1
    with pytest.raises(ValueError) as said:  # ("..": of the characters it names, but refused)
        session_log_path(log_dir, "..")
    assert str(said.value).endswith("(and not '.' or '..')")
    assert losses == ["invalid_session"] * (len(HOSTILE_IDS) + 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    assert [p.name for p in log_dir.iterdir()] == [".gitignore"]  # written with the directory
    assert not (tmp_path.parent / "x.jsonl").exists()


def test_longest_valid_id_is_accepted(log_dir: Path, writers) -> None:
    sid = "A-z_0.9:" * 16
    w = started(writers, log_dir)
    assert w.emit(sid, {"type": "error"})
    assert w.close()
    assert (log_dir / f"{sid}.jsonl").exists()


def test_unwritable_directory_counts_losses_and_warns_once(tmp_path: Path, writers, caplog) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    losses: list[str] = []
    with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
        w = started(writers, blocker / "logs", on_loss=losses.append)
        results = [w.emit("s", {"type": "error", "message": str(i)}) for i in range(50)]
        assert w.flush()
    assert all(results)
    assert (w.written, w.errors, w.dropped) == (0, 50, 0)
    assert losses.count("io") == 50
    io_warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(io_warnings) == 1  # rate-limited
    assert w.close()


def test_a_log_directory_removed_while_running_is_made_again_with_each_files_meta_line(
    log_dir: Path, writers, caplog: pytest.LogCaptureFixture
) -> None:
    """Removed (an rm -rf of old logs) or replaced by something else for a while: logging
    resumes once a directory can be made there, private and kept out of git as at start, and
    each file begins with its session's meta line, lost with the directory or not."""
    import shutil

    losses: list[str] = []
    w = started(writers, log_dir, on_loss=losses.append)
    w.emit("a", {"type": "session_meta", "session": "a"}, first_in_file=True)
    w.emit("a", {"type": "error", "exchange": 1, "status": 400, "message": "one"})
    assert w.flush()
    shutil.rmtree(log_dir)
    w.emit("a", {"type": "error", "exchange": 2, "status": 400, "message": "two"})
    assert w.flush()
    assert stat.S_IMODE(log_dir.stat().st_mode) == 0o700
    assert (log_dir / ".gitignore").exists()
    assert [e.get("message") for e in read_events(log_dir / "a.jsonl").events] == [None, "two"]
    assert w.take_broken("a")  # its next request line goes in full: the earlier ones are gone
    # A file where the directory should be: the lines are lost (counted), then it comes back.
    shutil.rmtree(log_dir)
    log_dir.write_text("not a directory")
    w.emit("b", {"type": "session_meta", "session": "b"}, first_in_file=True)
    w.emit("b", {"type": "error", "exchange": 1, "status": 400, "message": "lost"})
    assert w.flush()
    # One line lost, as b's file will tell: its meta line is no loss, written again at its
    # start (the metric and the message counted it: one more than the file, per new session)
    assert (w.errors, losses) == (1, ["io"])
    log_dir.unlink()
    with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
        for sid in ("a", "b"):
            w.emit(sid, {"type": "error", "exchange": 3, "status": 400, "message": "back"})
        assert w.flush()
    said = [r.getMessage() for r in caplog.records if " again; " in r.getMessage()]
    assert said == [
        "event log: writing b again; 1 line(s) of it were lost meanwhile"
        " (cachegate_event_log_lost_total)"
    ]  # once, when it is over
    for sid in ("a", "b"):
        events = read_events(log_dir / f"{sid}.jsonl").events
        assert [(e["type"], e.get("message")) for e in events] == [
            ("session_meta", None),
            *([("lines_lost", None)] if sid == "b" else []),  # b's error line "lost"
            ("error", "back"),
        ]
        assert events[0]["session"] == sid
        assert lost_lines(events) == (sid == "b")  # (its meta line is written again: no gap)
        if sid == "b":
            assert events[1]["lines"] == 1


@pytest.mark.parametrize("how", ["removed", "renamed", "emptied", "cut mid-line"])
def test_a_session_file_removed_or_truncated_while_running_starts_again_with_its_meta_line(
    log_dir: Path, writers, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """``rm logs/*.jsonl``, logrotate's rename or ``copytruncate``: the writer appended on to a
    file no directory named (every later line lost, unseen) or after a hole, with no meta line
    and request lines coded against bases that were gone (replay skipped every one)."""
    w = started(writers, log_dir)
    w.emit("a", {"type": "session_meta", "session": "a"}, first_in_file=True)
    w.emit("a", {"type": "error", "exchange": 1, "status": 400, "message": "one"})
    assert w.flush()
    path = log_dir / "a.jsonl"
    if how == "removed":
        path.unlink()
    elif how == "renamed":
        path.rename(log_dir / "a.jsonl.1")
    elif how == "emptied":
        path.write_bytes(b"")
    else:
        with path.open("r+b") as f:
            f.truncate(20)
    with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
        w.emit("a", {"type": "error", "exchange": 2, "status": 400, "message": "two"})
        assert w.flush()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "a.jsonl was " + ("truncated" if "cut" in how or how == "emptied" else "removed") in said
    log = read_events(path)
    messages = [(e["type"], e.get("message")) for e in log.events]
    assert messages == [("session_meta", None), ("error", "two")]
    assert log.torn == (1 if how == "cut mid-line" else 0)  # the fragment left, one torn line
    assert w.take_broken("a")  # its next request line goes in full: its bases are gone
    w.emit("a", {"type": "error", "exchange": 3, "status": 400, "message": "three"})
    assert w.flush()
    assert [e.get("message") for e in read_events(path).events][-2:] == ["two", "three"]
    assert not w.take_broken("a")  # written on as usual: nothing noticed again
    if how == "renamed":  # the renamed file kept what was written before
        assert [e.get("message") for e in read_events(log_dir / "a.jsonl.1").events] == [
            None,
            "one",
        ]


def test_a_session_still_writing_keeps_its_meta_line_past_newer_sessions(
    log_dir: Path, writers
) -> None:
    """The meta lines kept to start a file anew went by when each was written: a long-lived
    session lost its own once 4,096 newer sessions had begun (also while it wrote on), and its
    file, removed or rotated, began again without one. They now go by the last write, as many
    as cachegate holds sessions."""
    w = started(writers, log_dir, metas_kept=3)
    w.emit("old", {"type": "session_meta", "session": "old"}, first_in_file=True)
    assert w.flush()
    for n in range(6):  # newer sessions begin, twice the kept number, while "old" writes on
        w.emit(f"new{n}", {"type": "session_meta", "session": f"new{n}"}, first_in_file=True)
        w.emit("old", {"type": "error", "exchange": n + 1, "status": 400, "message": str(n)})
        assert w.flush()
    (log_dir / "old.jsonl").unlink()
    w.emit("old", {"type": "error", "exchange": 7, "status": 400, "message": "after"})
    assert w.flush()
    events = read_events(log_dir / "old.jsonl").events
    assert [(e["type"], e.get("message")) for e in events] == [
        ("session_meta", None),
        ("error", "after"),
    ]


def test_a_file_removed_does_not_silence_another_sessions_truncation(
    log_dir: Path, writers, caplog: pytest.LogCaptureFixture
) -> None:
    """``rm logs/a.jsonl; : > logs/b.jsonl``: only a's warning was said, the two shared one
    rate limit of one warning in 30 s, and b's truncation went unsaid."""
    w = started(writers, log_dir)
    for sid in ("a", "b"):
        w.emit(sid, {"type": "session_meta", "session": sid}, first_in_file=True)
        w.emit(sid, {"type": "error", "exchange": 1, "status": 400, "message": "one"})
    assert w.flush()
    (log_dir / "a.jsonl").unlink()
    (log_dir / "b.jsonl").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
        for sid in ("a", "b"):
            w.emit(sid, {"type": "error", "exchange": 2, "status": 400, "message": "two"})
        assert w.flush()
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "event log: a.jsonl was removed or replaced while cachegate wrote it; a new one is started",
        "event log: b.jsonl was truncated while cachegate wrote it; writing on from its end",
    ]


def test_a_file_that_cannot_be_looked_at_is_written_on_not_taken_for_removed(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``chmod 000`` on the log directory: its files cannot be looked at by name, but the one
    held open is still written. It was said to be "removed or replaced", closed, and the next
    lines lost (no new file can be made there)."""
    w = started(writers, log_dir)
    w.emit("a", {"type": "session_meta", "session": "a"}, first_in_file=True)
    w.emit("a", {"type": "error", "exchange": 1, "status": 400, "message": "one"})
    assert w.flush()
    real_stat = os.stat

    def denied(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path).endswith("a.jsonl"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", denied)
    with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
        w.emit("a", {"type": "error", "exchange": 2, "status": 400, "message": "two"})
        assert w.flush()
    monkeypatch.setattr(os, "stat", real_stat)
    assert not caplog.records
    assert [e.get("message") for e in read_events(log_dir / "a.jsonl").events] == [
        None,
        "one",
        "two",
    ]
    assert not w.take_broken("a")


def test_a_log_directory_replaced_while_running_is_judged_again(
    tmp_path: Path, writers, caplog: pytest.LogCaptureFixture
) -> None:
    """A private directory swapped for one others may write into: the writer kept its judgement
    from the start, gave no warning, and appended the log through a hard link planted there."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir(mode=0o700)
    losses: list[str] = []
    w = started(writers, log_dir, on_loss=losses.append)
    w.emit("s1", {"type": "error", "message": "before"})
    assert w.flush()
    shutil.rmtree(log_dir)
    log_dir.mkdir()
    log_dir.chmod(0o777)
    own = tmp_path / "own.txt"
    own.write_text("mine\n")
    os.link(own, log_dir / "s3.jsonl")
    with caplog.at_level("WARNING", logger="proxy.eventlog"):
        w.emit("s3", {"type": "error", "message": "MARKER-s3"})
        assert w.flush()
    assert own.read_text() == "mine\n"  # not written through the planted link
    assert losses == ["io"]
    assert "can be read by other users (mode 777)" in caplog.text


def test_the_claim_on_a_log_directory_is_taken_again_when_the_directory_is_made_again(
    log_dir: Path, writers
) -> None:
    from proxy.eventlog import LOCK_NAME, claim_log_dir

    assert claim_log_dir(log_dir) is None
    assert claim_log_dir(log_dir) == str(os.getpid())  # held: a second claim is refused
    w = started(writers, log_dir)
    shutil.rmtree(log_dir)
    w.emit("a", {"type": "error", "exchange": 1, "status": 400, "message": "m"})
    assert w.flush()
    assert (log_dir / LOCK_NAME).exists()
    assert claim_log_dir(log_dir) == str(os.getpid())  # still held, on the new directory


def test_a_disk_full_at_start_leaves_no_empty_gitignore_or_lock_and_both_are_written_later(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk when serve starts: the .gitignore was made empty and never written again
    (git listed the logs, which hold prompts and secrets), silently, and the lock file stayed
    empty (a second cachegate was told of "pid ?")."""
    import errno

    from proxy.eventlog import LOCK_NAME, claim_log_dir

    monkeypatch.setattr(eventlog, "_CLAIMS", {})  # (closed at the end: this test's alone)
    real_write, real_pwrite = os.write, os.pwrite
    full = True

    def write(fd: int, data: Any) -> int:
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "pwrite", pwrite)
    with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
        assert claim_log_dir(log_dir) is None
        w = started(writers, log_dir)
        w.emit("a", {"type": "session_meta", "session": "a"}, first_in_file=True)
        assert w.flush()
    assert not (log_dir / ".gitignore").exists()  # not empty: gone until it can be written
    assert "cannot write" in caplog.text and ".gitignore" in caplog.text
    assert "not kept out of git" in caplog.text
    full = False  # space freed
    w.emit("a", {"type": "error", "exchange": 1, "status": 400, "message": "m"})
    assert w.flush()
    assert (log_dir / ".gitignore").read_text() == GITIGNORE
    assert (log_dir / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    for fd in eventlog._CLAIMS.values():
        os.close(fd)


def test_a_stopping_mark_is_not_written_over_by_the_process_id_a_full_disk_owed(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The id owed since a full disk at start was written over ``<pid> stopping`` by the first
    line logged in the grace period: the restarting cachegate was refused, not made to wait."""
    import errno

    from proxy.eventlog import LOCK_NAME, claim_log_dir, mark_stopping

    monkeypatch.setattr(eventlog, "_CLAIMS", {})  # (this test's claim alone is marked)
    real_pwrite = os.pwrite
    full = True

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    try:
        assert claim_log_dir(log_dir) is None
        full = False  # space freed; then SIGTERM, and an answer in flight is logged
        mark_stopping()
        w = started(writers, log_dir)
        w.emit("a", {"type": "error", "exchange": 1, "status": 400, "message": "m"})
        assert w.flush()
        assert (log_dir / LOCK_NAME).read_text() == f"{os.getpid()} stopping\n"
    finally:
        for fd in eventlog._CLAIMS.values():
            os.close(fd)


def test_the_claim_is_taken_again_after_something_else_stood_in_the_directory_s_place(
    log_dir: Path, writers
) -> None:
    """A directory removed, a file put in its place, then removed: the writer made the
    directory again without its lock, and a second cachegate could then write it too."""
    from proxy.eventlog import claim_log_dir

    assert claim_log_dir(log_dir) is None
    w = started(writers, log_dir)
    shutil.rmtree(log_dir)
    log_dir.write_text("in the way")
    w.emit("a", {"type": "error", "exchange": 1, "status": 400, "message": "m"})
    assert w.flush()  # (the line is lost: no directory)
    log_dir.unlink()
    w.emit("a", {"type": "error", "exchange": 2, "status": 400, "message": "m"})
    assert w.flush()
    assert (log_dir / "a.jsonl").exists()
    assert claim_log_dir(log_dir) == str(os.getpid())  # held again, on the new directory


def test_a_directory_made_again_many_times_keeps_one_lock_file_open(log_dir: Path, writers) -> None:
    from proxy.eventlog import LOCK_NAME, claim_log_dir

    assert claim_log_dir(log_dir) is None
    w = started(writers, log_dir)
    for n in range(5):
        shutil.rmtree(log_dir)
        w.emit("a", {"type": "error", "exchange": n, "status": 400, "message": "m"})
        assert w.flush()
    fds = Path("/proc/self/fd")
    mine = str(log_dir / LOCK_NAME)  # (other tests' claims stay held for the process's life)
    locks = [t for t in map(_target, (fds / fd for fd in os.listdir(fds))) if t.startswith(mine)]
    assert locks == [mine], locks  # one, and not a deleted directory's


def _target(link: Path) -> str:
    try:
        return os.readlink(link)
    except OSError:  # (the listing's own descriptor, closed since)
        return ""


@contextlib.contextmanager
def another_cachegate(log_dir: Path) -> Iterator[Any]:
    """Another process that has claimed ``log_dir`` (as a second ``cachegate serve`` would) and
    holds it until it is killed."""
    import subprocess
    import sys

    with subprocess.Popen(
        [sys.executable, "-c", "import sys; from proxy.eventlog import claim_log_dir;"
         f" print(claim_log_dir({str(log_dir)!r}), flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as other:  # fmt: skip
        assert other.stdout is not None and other.stdout.readline().strip() == "None"
        yield other


def test_the_claim_is_taken_back_once_another_process_that_held_it_is_gone(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """The directory was made again by a second cachegate, which took the lock, then stopped:
    the first wrote on without taking the lock back, and a third was let in. While the second
    held it, the first wrote on into it too."""

    from proxy.eventlog import claim_log_dir

    monkeypatch.setattr(eventlog, "CLAIM_RETRY_S", 0.0)
    assert claim_log_dir(log_dir) is None
    w = started(writers, log_dir)
    shutil.rmtree(log_dir)
    with another_cachegate(log_dir) as other:
        try:
            with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
                w.emit("a", {"type": "error", "exchange": 1, "status": 400, "message": "m"})
                assert w.flush()
            assert f"another cachegate (pid {other.pid})" in caplog.text
            # the other writes there now: this one's lines are lost, not interleaved with its
            # (both numbered a session's exchanges from 1 in one file)
            assert not (log_dir / "a.jsonl").exists()
            assert "this one's lines are lost" in caplog.text
            # a new session's first line (its meta line) made no file there either: an empty
            # one the reports called "no session", held open by this process
            w.emit("b", {"type": "session_meta", "session": "b"}, first_in_file=True)
            w.emit("b", {"type": "error", "exchange": 1, "status": 400, "message": "m"})
            assert w.flush()
            assert sorted(p.name for p in log_dir.iterdir() if p.suffix == ".jsonl") == []
            # nor does a FIFO planted under a session's name stop the writer (it waited on it
            # for a writer for good: no line of any session written again)
            os.mkfifo(log_dir / "c.jsonl")
            w.emit("c", {"type": "session_meta", "session": "c"}, first_in_file=True)
            assert w.flush()
            (log_dir / "c.jsonl").unlink()
        finally:
            other.kill()
    w.emit("a", {"type": "error", "exchange": 2, "status": 400, "message": "m"})
    assert w.flush()
    w.emit("b", {"type": "error", "exchange": 2, "status": 400, "message": "m"})
    assert w.flush()
    assert claim_log_dir(log_dir) == str(os.getpid())  # taken back: a third is refused
    assert [e["type"] for e in read_events(log_dir / "b.jsonl").events] == [
        "session_meta",  # (its file begins with it still)
        "lines_lost",
        "error",
    ]
    events = read_events(log_dir / "a.jsonl").events
    assert [(e["type"], e.get("exchange"), e.get("lines")) for e in events] == [
        ("lines_lost", None, 1),  # exchange 1's line: the file says it has a hole
        ("error", 2, None),
    ]


def test_a_deleted_lock_file_is_claimed_again_before_another_cachegate_writes_alongside(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """A retention job (``find DIR -mtime +N -delete``) deleted the lock file of a long-running
    cachegate: a second one started on the directory then, and both wrote one session's file,
    their exchange numbers interleaved, with no word from either."""

    from proxy.eventlog import LOCK_NAME, claim_log_dir

    monkeypatch.setattr(eventlog, "CLAIM_RETRY_S", 0.0)
    assert claim_log_dir(log_dir) is None
    w = started(writers, log_dir)
    w.emit("a", {"type": "error", "exchange": 1, "status": 400, "message": "m"})
    assert w.flush()
    (log_dir / LOCK_NAME).unlink()
    with another_cachegate(log_dir) as other:
        try:
            with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
                w.emit("a", {"type": "error", "exchange": 2, "status": 400, "message": "m"})
                assert w.flush()
            assert f"another cachegate (pid {other.pid})" in caplog.text
        finally:
            other.kill()
    assert [e["exchange"] for e in read_events(log_dir / "a.jsonl").events] == [1]
    w.emit("a", {"type": "error", "exchange": 3, "status": 400, "message": "m"})
    assert w.flush()
    events = read_events(log_dir / "a.jsonl").events
    assert [e.get("exchange", e["type"]) for e in events] == [1, "lines_lost", 3]
    assert lost_lines(events) == 1
    assert claim_log_dir(log_dir) == str(os.getpid())


def test_the_claim_is_taken_once_the_directory_lets_the_lock_be_made(
    log_dir: Path, writers
) -> None:
    """A log directory where the lock could not be made at start (not writable then: simulated
    by a directory in the lock file's place, since root writes anywhere) stayed unclaimed for
    good, and a second cachegate started later wrote it too."""
    from proxy.eventlog import LOCK_NAME, claim_log_dir

    (log_dir / LOCK_NAME).mkdir(parents=True)
    assert claim_log_dir(log_dir) is None  # could not be taken: nothing said at start
    w = started(writers, log_dir)
    (log_dir / LOCK_NAME).rmdir()
    w.emit("a", {"type": "error", "exchange": 1, "status": 400, "message": "m"})
    assert w.flush()
    assert claim_log_dir(log_dir) == str(os.getpid())  # taken by the writer since


@pytest.mark.parametrize("removed", ["directory", "file"])
def test_a_file_an_earlier_process_began_starts_with_its_meta_line_when_made_anew(
    log_dir: Path, writers: list[EventLogWriter], removed: str
) -> None:
    """After a restart the session's meta line is not written (the file has one), and was not
    kept either: a file made anew once the directory or the file was removed began without it,
    and with the directory gone its request lines stayed coded against lines gone with it."""
    import shutil

    meta = {"type": "session_meta", "session": "a", "upstream": "http://up/v1"}
    first = started(writers, log_dir)
    first.emit("a", meta, first_in_file=True)
    first.emit("a", {"type": "error", "exchange": 1, "status": 400, "message": "one"})
    assert first.close()
    second = started(writers, log_dir)  # cachegate started again
    second.emit("a", meta, first_in_file=True)  # not written: the file has its own
    second.emit("a", {"type": "error", "exchange": 1, "status": 400, "message": "two"})
    assert second.flush()
    assert [e["type"] for e in read_events(log_dir / "a.jsonl").events] == [
        "session_meta",
        "error",
        "error",
    ]
    assert not second.take_broken("a")
    if removed == "directory":
        shutil.rmtree(log_dir)
    else:
        (log_dir / "a.jsonl").unlink()
    second.emit("a", {"type": "error", "exchange": 2, "status": 400, "message": "three"})
    assert second.flush()
    events = read_events(log_dir / "a.jsonl").events
    assert [(e["type"], e.get("message")) for e in events] == [
        ("session_meta", None),
        ("error", "three"),
    ]
    assert events[0]["upstream"] == "http://up/v1"
    assert second.take_broken("a")  # its next request line goes in full


def test_writing_again_is_said_of_the_session_that_lost_lines_not_of_every_other(
    log_dir: Path, writers: list[EventLogWriter], caplog: pytest.LogCaptureFixture
) -> None:
    """One session's file cannot be written (a directory in its place) while the others can:
    "writing again" came after every batch of the others, while its lines were still lost."""
    w = started(writers, log_dir)
    w.emit("ok", {"type": "error", "exchange": 1, "status": 400, "message": "m"})
    assert w.flush()
    (log_dir / "stuck.jsonl").mkdir()
    with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
        for i in range(10):
            w.emit("stuck", {"type": "error", "exchange": i, "status": 400, "message": "m"})
            w.emit("ok", {"type": "error", "exchange": i, "status": 400, "message": "m"})
            assert w.flush()
        said = [r.getMessage() for r in caplog.records if " again; " in r.getMessage()]
        assert said == []
        assert w.errors == 10
        (log_dir / "stuck.jsonl").rmdir()
        w.emit("stuck", {"type": "error", "exchange": 11, "status": 400, "message": "m"})
        assert w.flush()
    said = [r.getMessage() for r in caplog.records if " again; " in r.getMessage()]
    assert said == [
        "event log: writing stuck again; 10 line(s) of it were lost meanwhile"
        " (cachegate_event_log_lost_total)"
    ]


@pytest.mark.parametrize("redacting", [True, False])
def test_the_writer_makes_its_secret_scan_when_it_is_created(
    log_dir: Path, redacting: bool
) -> None:
    """The one-pass scan's database takes ~55 ms of CPU to compile: made for the first line
    written, it competed with the event loop during the first burst of requests. A writer
    makes it when created (before cachegate serves); one that does not redact never needs
    it."""
    from proxy import redact

    redact._multi_scan.cache_clear()
    w = EventLogWriter(log_dir, redact_secrets=redacting)  # not started
    assert redact._multi_scan.cache_info().currsize == (1 if redacting else 0)
    assert w.close()


def test_a_full_queue_drops_without_blocking(log_dir: Path) -> None:
    losses: list[str] = []
    w = EventLogWriter(log_dir, max_queue=2, on_loss=losses.append)  # not started: nothing drains
    assert [w.emit("s", {"type": "error"}) for _ in range(4)] == [True, True, False, False]
    assert w.dropped == 2 and losses == ["queue_full", "queue_full"]
    assert w.close()
    assert w.dropped == 4  # the two queued events could never be written
    assert w.emit("s", {"type": "error"}) is False
    assert losses[-1] == "closed"


def test_the_queue_holds_a_bounded_weight_of_request_bodies(log_dir: Path, writers) -> None:
    """A burst of large first turns (sub-agents starting, 300 KB of history each) held ~1 GB in
    the queue, past the sessions' memory budget, while the writer's secret scan read a few MB a
    second. Past the bound, request lines are dropped and counted as a full queue's, and the
    session's next line says so; lines written give their weight back."""
    losses: list[str] = []
    mb = 1024 * 1024
    w = EventLogWriter(log_dir, max_queue_bytes=4 * mb, on_loss=losses.append)  # not started
    heavy = [request_event(i, None, 0, [{"role": "user", "content": "x"}]) for i in (1, 2, 3)]
    assert w.emit("a", heavy[0], weight=3 * mb)
    assert not w.emit("a", heavy[1], weight=2 * mb)  # 5 MB queued: over the bound
    assert w.emit("a", {"type": "response", "exchange": 1}, weight=60_000)  # (light: not weighed)
    assert w.emit("b", heavy[2], weight=mb)  # 4 MB: within it
    assert losses == ["queue_full"] and w.backlog == (3, 4 * mb)
    w.start()
    writers.append(w)
    assert w.flush() and w.backlog == (0, 0)
    assert w.emit("a", request_event(4, None, 0, []), weight=4 * mb)  # the weight came back
    assert w.emit("a", {"type": "response", "exchange": 4})
    assert w.flush()
    lines = read_events(log_dir / "a.jsonl").events
    # (the loss is told before the session's next lines written: the first request's)
    kinds = [e["type"] for e in lines]
    assert kinds == ["lines_lost", "request", "response", "request", "response"]
    assert (lines[0]["lines"], lines[0]["requests"]) == (1, 1)


def test_a_stop_that_cannot_write_the_queue_says_how_much_is_lost(
    log_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop that gave the writer 5 s and went on dropped what was still queued (answered
    exchanges missing from their files), with no count: the metric counts each line as
    ``closed``, and the warning says how many of which sessions."""
    import threading

    losses: list[str] = []
    w = EventLogWriter(log_dir, on_loss=losses.append)
    release = threading.Event()
    written = w._write_lines

    def stuck(session_id: str, lines: list[bytes]) -> None:  # a disk that does not answer
        release.wait(10)
        written(session_id, lines)

    w._write_lines = stuck  # type: ignore[method-assign]
    w.start()
    try:
        assert w.emit("a", {"type": "error", "n": 0})
        deadline = time.monotonic() + 5
        while w.backlog[0] and time.monotonic() < deadline:  # (the writer has it in hand)
            time.sleep(0.01)
        for i in range(3):
            assert w.emit("a", request_event(i + 1, None, 0, []))
        assert w.emit("b", {"type": "response", "exchange": 1})
        with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
            assert w.close(0.3) is False
        assert losses == ["closed"] * 4
        assert (
            "event log writer did not drain within 0.3s: 4 queued line(s) of 2 session(s), 3 of"
            " them request line(s), were not written" in caplog.text
        )
    finally:
        release.set()


def test_a_burst_of_new_sessions_keeps_each_files_meta_line(log_dir: Path, writers) -> None:
    """With the queue full, a new session's meta line still goes in (up to twice the bound):
    dropped, its file began with a response line, no longer marked as cachegate's log."""
    losses: list[str] = []
    w = EventLogWriter(log_dir, max_queue=4, on_loss=losses.append)  # not started yet
    for i in range(4):
        assert w.emit(f"s{i}", {"type": "session_meta", "session": f"s{i}"}, True)
    assert w.emit("late", {"type": "session_meta", "session": "late"}, True)  # past the bound
    assert w.emit("late", {"type": "response", "exchange": 1}) is False
    for i in range(3):
        assert w.emit(f"m{i}", {"type": "session_meta", "session": f"m{i}"}, True)
    assert w.emit("over", {"type": "session_meta", "session": "over"}, True) is False  # 2 x 4
    # the response line is lost; the refused meta line is not (its observer offers it again
    # with the session's next line) and is not counted as lost
    assert losses == ["queue_full"]
    w.start()
    writers.append(w)
    assert w.flush()
    line = (log_dir / "late.jsonl").read_bytes().splitlines()
    # its response line was refused: the file says so after its meta line
    assert [orjson.loads(x)["type"] for x in line] == ["session_meta", "lines_lost"]
    assert orjson.loads(line[1])["lines"] == 1
    assert "lines_lost" not in (log_dir / "s0.jsonl").read_text()  # (lost nothing)


def test_unserializable_events_are_counted_not_raised(log_dir: Path, writers) -> None:
    losses: list[str] = []
    w = started(writers, log_dir, on_loss=losses.append)
    # beyond what orjson writes (an integer past 64 bits, 255 levels deep): the standard
    # library writes it, where the line was lost
    w.emit("s", {"type": "error", "status": 2**70})
    w.emit("s", ["not", "a", "dict"])  # type: ignore[arg-type]
    w.emit("s", {"type": "error", "message": {1, 2}})  # a set: falls back to str()
    assert w.close()
    assert (w.written, w.errors) == (2, 1)
    assert losses == ["serialize"]
    assert b'"status":1180591620717411303424' in (log_dir / "s.jsonl").read_bytes()


def test_non_string_keys_are_written_as_strings_and_still_redacted(log_dir: Path, writers) -> None:
    w = started(writers, log_dir)
    w.emit("s", {"type": "request", "transforms": {1: "one", None: "none"}})
    w.emit("s", {"type": "request", "transforms": {2: "key sk-" + "aB3" * 10}})
    assert w.close() and (w.written, w.errors) == (2, 0)
    first, second = read_events(log_dir / "s.jsonl").events
    assert first["transforms"] == {"1": "one", "null": "none"}
    assert second["transforms"] == {"2": "key [REDACTED]"}


def test_a_failing_loss_callback_does_not_break_the_writer(log_dir: Path, writers) -> None:
    def explode(kind: str) -> None:
        raise RuntimeError(kind)

    w = started(writers, log_dir, on_loss=explode)
    assert w.emit("..", {"type": "error"}) is False
    assert w.emit("s", {"type": "error"})
    assert w.close() and w.written == 1


def test_many_threads_and_sessions_with_few_open_files(log_dir: Path, writers) -> None:
    w = started(writers, log_dir, max_open_files=2)

    def produce(t: int) -> None:
        for i in range(200):
            w.emit(f"s{i % 5}", {"type": "error", "status": 500, "message": f"{t}-{i}"})

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert w.flush()
    assert len(w.open_sessions()) <= 2
    assert w.close()
    assert w.written == 800
    seen = set()
    for sid in range(5):
        log = read_events(log_dir / f"s{sid}.jsonl")
        assert log.torn == 0 and len(log.events) == 160
        seen.update(e["message"] for e in log.events)
    assert len(seen) == 800


def test_hundreds_of_sessions_in_flight_keep_their_files_open(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reopen costs more than the write (open, size, last byte, close): with the default
    limit (a descriptor limit of 2048), 300 sessions written in turn stay open, and each
    file gets its lines in order."""
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda _which: (2048, 2048))
    w = started(writers, log_dir)
    for turn in range(3):
        for sid in range(300):
            assert w.emit(f"s{sid}", {"type": "error", "status": 500, "message": str(turn)})
        assert w.flush()
    assert len(w.open_sessions()) == 300
    assert w.close()
    for sid in (0, 150, 299):
        log = read_events(log_dir / f"s{sid}.jsonl")
        assert [e["message"] for e in log.events] == ["0", "1", "2"] and log.torn == 0


def test_a_file_not_written_for_a_while_is_closed(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files stay open only while their session is written: an idle one is closed (and so no
    longer kept from retention), and reopened, lines in order, when its session comes back."""
    import proxy.eventlog as eventlog

    monkeypatch.setattr(eventlog, "IDLE_CLOSE_S", 0.2)
    w = started(writers, log_dir)
    assert w.emit("quiet", {"type": "error", "status": 500, "message": "1"})
    assert w.flush()
    assert w.open_sessions() == {"quiet"}
    deadline = time.monotonic() + 5
    while w.open_sessions() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w.open_sessions() == frozenset()
    # what happens to it while closed goes unseen (logrotate's nightly run: the next burst's
    # lines, coded against lines of the file rotated away, were all skipped by replay): the
    # session's next request line goes in full
    assert w.take_broken("quiet")
    assert w.emit("quiet", {"type": "error", "status": 500, "message": "2"})
    assert w.close()
    log = read_events(log_dir / "quiet.jsonl")
    assert [e["message"] for e in log.events] == ["1", "2"] and log.torn == 0


def test_out_of_file_descriptors_the_writer_gives_back_the_files_it_holds(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ulimit -n 64`` with many clients: the writer held its files and every new session's
    lines were lost (EMFILE) until files idled out, ten minutes on."""
    import errno

    w = started(writers, log_dir, max_open_files=8)
    for n in range(6):
        w.emit(f"s{n}", {"type": "session_meta", "session": f"s{n}"}, first_in_file=True)
    assert w.flush()
    real_open = os.open
    held = w.open_sessions()
    assert len(held) == 6

    def scarce(path: Any, flags: int, *args: Any) -> int:
        # the process's descriptors taken by connections: one more only once some are closed
        if str(path).endswith("new.jsonl") and len(w.open_sessions()) >= 6:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", scarce)
    w.emit("new", {"type": "session_meta", "session": "new"}, first_in_file=True)
    w.emit("new", {"type": "error", "exchange": 1, "status": 400, "message": "kept"})
    assert w.flush()
    monkeypatch.setattr(os, "open", real_open)
    assert w.errors == 0
    assert [e.get("message") for e in read_events(log_dir / "new.jsonl").events] == [None, "kept"]
    assert len(w.open_sessions()) <= 4  # the oldest given back, fewer held from now on
    assert "s5" in w.open_sessions() and "s0" not in w.open_sessions()


def test_the_open_file_limit_follows_the_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    from proxy.eventlog import default_max_open_files

    # (a quarter, at least 4: ``ulimit -n 32`` held 16 of its 32 for files)
    cases = ((1024, 256), (100, 25), (32, 8), (8, 4), (8192, 1024), (1_000_000, 1024))
    for soft, expected in cases:
        monkeypatch.setattr(resource, "getrlimit", lambda _which, soft=soft: (soft, soft))
        assert default_max_open_files() == expected
    monkeypatch.setattr(
        resource, "getrlimit", lambda _which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    )
    assert default_max_open_files() == 1024


# ------------------------------------------------------------------------------------------------
# Durability, bodies, secrets


def test_fsync_none_never_syncs(log_dir: Path, writers) -> None:
    w = started(writers, log_dir, fsync="none")
    for _ in range(5):
        w.emit("s", {"type": "error"})
    assert w.close()
    assert (w.written, w.syncs) == (5, 0)


def test_fsync_line_syncs_every_line(log_dir: Path, writers) -> None:
    w = started(writers, log_dir, fsync="line")
    for _ in range(5):
        w.emit("s", {"type": "error"})
    assert w.close()
    assert (w.written, w.syncs) == (5, 5)


def test_fsync_line_writes_each_line_at_once_not_at_the_next_poll(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fsync = "line" the lines waited for the writer's next poll (50 ms, more when it
    was behind): a kill -9 then took exchanges the client had been answered, file and all."""
    monkeypatch.setattr(eventlog, "POLL_S", 30.0)  # (a poll would come too late to pass)
    w = started(writers, log_dir, fsync="line")
    time.sleep(0.1)  # the writer asleep, with nothing to write
    w.emit("s", {"type": "error"})
    deadline = time.monotonic() + 5
    while w.syncs == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert (w.written, w.syncs) == (1, 1)
    assert read_events(log_dir / "s.jsonl").events[0]["type"] == "error"


def test_a_new_file_has_its_name_synced_with_fsync_line_or_interval(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file's fsync does not make its directory entry durable: after a power loss a new
    session's file, every line synced, could be gone. Its directory is synced once, at the
    file's first sync (the directory's parent too, the first time: the writer may have made
    it); never with fsync = "none". A directory sync that failed is tried again."""
    synced_dirs: list[tuple[int, int]] = []
    real_fsync = os.fsync
    failures = [0]

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            if failures[0]:
                failures[0] -= 1
                raise OSError(5, "Input/output error")
            synced_dirs.append((st.st_dev, st.st_ino))
        real_fsync(fd)

    def ids(*paths: Path) -> list[tuple[int, int]]:
        return [(os.stat(p).st_dev, os.stat(p).st_ino) for p in paths]

    monkeypatch.setattr(os, "fsync", fsync)
    for mode in ("line", "interval", "none"):
        synced_dirs.clear()
        w = started(writers, log_dir / mode, fsync=mode, fsync_interval_s=0.05)
        for sid in ("a", "b", "a", "b"):  # two new files, each written twice
            w.emit(sid, {"type": "error"})
            assert w.flush()
        assert w.close()
        here = log_dir / mode
        expected = [] if mode == "none" else ids(here, log_dir, here)
        assert synced_dirs == expected, mode
    # a failed directory sync (EIO) is tried again with the file's next line
    synced_dirs.clear()
    w = started(writers, log_dir / "again", fsync="line")
    failures[0] = 1
    for _ in range(2):
        w.emit("c", {"type": "error"})
        assert w.flush()
    assert w.close()
    assert synced_dirs == ids(log_dir / "again", log_dir)
    # a file system that syncs no directory (EINVAL: some network ones) is not asked again
    # with every line, nor warned of every 30 s
    tries = [0]

    def refused(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            tries[0] += 1
            raise OSError(22, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", refused)
    w = started(writers, log_dir / "nfs", fsync="line")
    for sid in ("d", "d", "e", "e"):
        w.emit(sid, {"type": "error"})
        assert w.flush()
    assert w.close()
    assert (tries[0], w.syncs) == (1, 4)
    # the parent alone refusing (the log directory a mount point of another file system): the
    # log directory's own files still have their names synced (they were not, after the first)
    mount = log_dir / "mount"
    mount.mkdir()
    synced_dirs.clear()

    def parent_refuses(fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == ids(log_dir)[0]:
            raise OSError(22, "Invalid argument")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", parent_refuses)
    w = started(writers, mount, fsync="line")
    for sid in ("f", "g"):
        w.emit(sid, {"type": "error"})
        assert w.flush()
    assert w.close()
    assert synced_dirs == ids(mount, mount)


def test_fsync_interval_syncs_a_burst_once_it_settles(log_dir: Path, writers) -> None:
    w = started(writers, log_dir, fsync="interval", fsync_interval_s=0.05)
    for _ in range(20):
        w.emit("s", {"type": "error"})
    deadline = time.monotonic() + 5
    while w.syncs == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.written == 20 and 1 <= w.syncs < 20
    time.sleep(0.2)  # a sync due for lines written after the first one happens within a poll
    settled = w.syncs
    assert settled < 20
    time.sleep(0.15)
    assert w.syncs == settled  # nothing new written, nothing to sync
    assert w.close()


@pytest.mark.parametrize(
    "kwargs", [{"fsync": "always"}, {"bodies": "none"}, {"fsync_interval_s": 0}, {"max_queue": 0}]
)
def test_bad_settings_are_refused(log_dir: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        EventLogWriter(log_dir, **kwargs)


def test_metadata_mode_keeps_sizes_and_hashes_but_no_text(log_dir: Path, writers) -> None:
    user = {"role": "user", "content": "PRIVATE-QUESTION about the merger"}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "PRIVATE-RESULT"}
    reply = {
        "role": "assistant",
        "content": "PRIVATE-ANSWER",
        "tool_calls": [{"id": "c2", "function": {"name": "grep", "arguments": '{"q":"PRIVATE"}'}}],
    }
    w = started(writers, log_dir, bodies="metadata")
    w.emit("s", request_event(1, None, 0, [user, tool]))
    w.emit("s", {"type": "response", "exchange": 1, "status": 200, "message": reply})
    w.emit("s", {"type": "compacted", "exchange": 2, "covered": 2, "summary": "PRIVATE-SUMMARY"})
    assert w.close()

    raw = (log_dir / "s.jsonl").read_bytes()
    assert b"PRIVATE" not in raw

    def digest(m: Message) -> str:
        return hashlib.sha256(orjson.dumps(m, option=orjson.OPT_SORT_KEYS)).hexdigest()

    req, resp, compacted = read_events(log_dir / "s.jsonl").events
    assert req["appended"] == [
        {"role": "user", "chars": 33, "sha256": digest(user)},
        {"role": "tool", "chars": 6 + 14, "sha256": digest(tool)},
    ]
    assert resp["message"] == {
        "role": "assistant",
        "chars": 14 + 2 + 4 + 15,
        "sha256": digest(reply),
    }
    assert compacted["summary"] == {
        "chars": 15,
        "sha256": hashlib.sha256(b"PRIVATE-SUMMARY").hexdigest(),
    }
    assert req["bytes"] == 1000 and resp["status"] == 200


KEY = "sk-proj-T3stK3yThatMustNeverBeLogged0123"


def test_a_secret_never_reaches_the_file(log_dir: Path, writers) -> None:
    w = started(writers, log_dir)
    leaky = {"role": "user", "content": f"use OPENAI_API_KEY={KEY} please"}
    w.emit("s", {"type": "session_meta", "session": "s", "user_agent": f"agent Bearer {KEY}"})
    w.emit("s", request_event(1, None, 0, [leaky]))
    w.emit("s", {"type": "response", "exchange": 1, "status": 401, "error": f"bad key {KEY}"})
    w.emit("s", {"type": "error", "exchange": 1, "status": 401, "message": {KEY: KEY}})
    assert w.close()
    raw = (log_dir / "s.jsonl").read_bytes()
    assert KEY.encode() not in raw
    assert b"T3stK3y" not in raw
    assert raw.count(b"[REDACTED]") == 5
    assert leaky["content"] == f"use OPENAI_API_KEY={KEY} please"  # the caller's copy untouched


def test_a_history_of_screenshots_is_written_without_a_field_by_field_redaction(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random base64 spells "xox" or "eyJ" by chance: a whole history with screenshots in it was
    redacted field by field (and serialized again) on every line, ~60 ms per 8 MB on the writer
    thread, the interpreter's lock held from the event loop. A key beside them is still caught."""
    import base64
    import random

    import proxy.eventlog as eventlog

    walks: list[int] = []
    real = eventlog.redact

    def counted(obj: Any) -> Any:
        walks.append(1)
        return real(obj)

    monkeypatch.setattr(eventlog, "redact", counted)
    rnd = random.Random(3)
    shots = [base64.b64encode(rnd.randbytes(60_000)).decode() for _ in range(30)]
    assert any("xox" in s or "eyJ" in s for s in shots)
    history: list[Message] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"step {i}"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + s}},
            ],
        }
        for i, s in enumerate(shots)
    ]
    w = started(writers, log_dir)
    w.emit("s", request_event(1, None, 0, history))
    assert w.close()
    assert walks == []
    [line] = (log_dir / "s.jsonl").read_bytes().splitlines()
    assert orjson.loads(line)["appended"] == history
    w = started(writers, log_dir)
    w.emit("s", request_event(2, None, 0, [*history, {"role": "user", "content": f"key {KEY}"}]))
    assert w.close()
    assert walks
    assert KEY.encode() not in (log_dir / "s.jsonl").read_bytes()


def test_a_line_that_cannot_be_redacted_is_dropped_and_the_batch_still_written(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proxy import eventlog

    real = eventlog.redact

    def flaky(value: Any) -> Any:
        """Fails on the one line whose redaction must break."""
        if isinstance(value, dict) and value.get("n") == 1:
            raise RuntimeError("cannot redact this one")
        return real(value)

    monkeypatch.setattr(eventlog, "redact", flaky)
    w = EventLogWriter(log_dir)  # queued before the writer starts: one batch
    writers.append(w)
    w.emit("s", {"type": "error", "n": 0, "message": "fine"})
    w.emit("s", {"type": "error", "n": 1, "message": f"key {KEY}"})
    w.emit("s", {"type": "error", "n": 2, "message": f"key {KEY}"})
    w.emit("s", {"type": "error", "n": 3, "message": "fine"})
    w.start()
    assert w.close()
    raw = (log_dir / "s.jsonl").read_bytes()
    assert KEY.encode() not in raw
    events = read_events(log_dir / "s.jsonl").events
    # the batch's lines, after the line that tells of the one dropped
    assert [e.get("n", e["type"]) for e in events] == ["lines_lost", 0, 2, 3]
    assert events[2]["message"] == "key [REDACTED]"
    assert w.written == 3 and w.errors == 1 and lost_lines(events) == 1


def test_redaction_can_be_turned_off(log_dir: Path, writers) -> None:
    w = started(writers, log_dir, redact_secrets=False)
    w.emit("s", request_event(1, None, 0, [{"role": "user", "content": KEY}]))
    assert w.close()
    assert KEY.encode() in (log_dir / "s.jsonl").read_bytes()


@pytest.mark.parametrize("redact_secrets", [True, False])
def test_known_secrets_are_never_written_whatever_their_shape(
    log_dir: Path, writers, redact_secrets: bool
) -> None:
    plain = "Zq8vN2mXw4Lr7TgY1bKc"  # no pattern knows it: a provider key of its own shape
    quoted = 'pa"ss\\word-0123'  # characters JSON escapes: found as they appear in the line
    w = started(
        writers, log_dir, redact_secrets=redact_secrets, secrets=[f" {plain}\n", quoted, "short"]
    )
    w.emit("s", request_event(1, None, 0, [{"role": "tool", "content": f"KEY={plain} {quoted}"}]))
    w.emit("t", {"ts": 1.0, "type": "error", plain: "as a key too", "message": "short words stay"})
    assert w.close()
    for name in ("s", "t"):
        raw = (log_dir / f"{name}.jsonl").read_bytes()
        assert plain.encode() not in raw and b"ss\\\\word" not in raw
    content = read_events(log_dir / "s.jsonl").events[0]["appended"][0]["content"]
    assert content == "KEY=[REDACTED] [REDACTED]"
    event = read_events(log_dir / "t.jsonl").events[0]
    assert event["[REDACTED]"] == "as a key too"
    assert event["message"] == "short words stay"  # values under 8 characters are not taken


@pytest.mark.parametrize("redact_secrets", [True, False])
def test_a_known_secret_in_json_that_escapes_more_than_it_must_is_not_written(
    log_dir: Path, writers, redact_secrets: bool
) -> None:
    """A key of the base64 alphabet in a tool's JSON output: PHP's ``json_encode`` writes its
    "/" as ``\\/``, Gson's HTML-safe mode its "=" as ``\\u003d``. The key was written whole
    (the same output without the escapes was redacted)."""
    own = "AbC/dEf+GhI123456789/xyzQRS=="
    client = "Cl1ent/Key+abcdef0123456789/ZZ=="
    w = started(writers, log_dir, redact_secrets=redact_secrets, secrets=[own])
    php = '{"env":{"LLM_GATEWAY":"' + own.replace("/", "\\/") + '"}}'
    gson = '{"Env":["LLM_GATEWAY\\u003d' + own.replace("=", "\\u003d") + '"]}'
    theirs = '{"cfg":{"credential":"' + client.replace("/", "\\/") + '"}}'
    for n, content in enumerate((php, gson)):
        w.emit("s", request_event(n, None, 0, [{"role": "tool", "content": content}]))
    w.emit("s", request_event(2, None, 0, [{"role": "tool", "content": theirs}]), False, (client,))
    assert w.close()
    raw = (log_dir / "s.jsonl").read_bytes()
    for key in (own, client):
        for piece in ("GhI123456789", "abcdef0123456789"):
            if piece in key:
                assert piece.encode() not in raw, raw
    contents = [e["appended"][0]["content"] for e in read_events(log_dir / "s.jsonl").events]
    assert contents[0] == '{"env":{"LLM_GATEWAY":"[REDACTED]"}}'
    assert contents[1] == '{"Env":["LLM_GATEWAY\\u003d[REDACTED]"]}'
    assert contents[2] == '{"cfg":{"credential":"[REDACTED]"}}'


def test_a_known_secret_a_pattern_would_take_only_part_of_is_taken_whole(
    log_dir: Path, writers
) -> None:
    """``Bearer`` followed by a key with a ``:`` in it: the pattern took the part before it and
    the rest of the key was written (``Bearer [REDACTED]:Zz99Yy88Xx77Ww66``). The same for a
    client's own key with a ``!`` in a line that must not hold it."""
    configured = "Ab12Cd34Ef56Gh78:Zz99Yy88Xx77Ww66"
    own = "tok:en0123456789!abcdefghij"
    w = started(writers, log_dir, secrets=[configured])
    text = f"curl -H 'Authorization: Bearer {configured}' and Bearer {own}"
    w.emit("s", request_event(1, None, 0, [{"role": "tool", "content": text}]))
    w.emit("s", {"ts": 1.0, "type": "error", "message": text}, False, (own,))
    assert w.close()
    raw = (log_dir / "s.jsonl").read_bytes()
    assert b"Zz99Yy88Xx77Ww66" not in raw and b"Ab12Cd34" not in raw
    assert b"abcdefghij" not in raw[raw.index(b'"type":"error"') :]
    events = read_events(log_dir / "s.jsonl").events
    assert events[1]["message"] == (
        "curl -H 'Authorization: Bearer [REDACTED]' and Bearer [REDACTED]"
    )


def test_a_piece_of_a_known_key_where_a_text_was_cut_through_it_is_taken_out(
    log_dir: Path, writers
) -> None:
    """Texts cachegate cuts itself cut keys with them, and the piece left was written: a
    provider's error cut at 300 characters (a client's key with a ``:`` echoed near the end, an
    HTML page echoing the server's key past the bytes read), the extractive summary's quotes of
    a tool's output, an answer whose client hung up mid-key. No pattern knows these keys."""
    configured = "SRVTOKENoaXmI63JozGw82KwD6rQJM9UayY20948VGZiHXJn"
    own = "PARTONEabcd1234:PARTTWOefgh5678xyz"
    w = started(writers, log_dir, secrets=[configured])
    cut = {
        "error": f"upstream answered 401: Invalid key {own[:16]}…",
        "summary": f"- tool output: dashboard value: {configured[:39]}…",
        "answer": f"Writing .env: GATEWAY_TOKEN is {configured[:30]}",
        "excerpt": f"…{configured[20:]} is the token",
    }
    for n, text in enumerate(cut.values()):
        w.emit("s", {"ts": 1.0 + n, "type": "error", "message": text}, False, (own,))
    w.emit("s", {"ts": 9.0, "type": "error", "message": f"short {configured[:15]} stays"})
    # The agent keeps the answer its client cut and sends it back in its next request
    said = [{"role": "assistant", "content": cut["answer"]}]
    w.emit("r", request_event(1, None, 0, said))
    assert w.close()
    (request,) = read_events(log_dir / "r.jsonl").events
    assert request["appended"][0]["content"] == "Writing .env: GATEWAY_TOKEN is [REDACTED]"
    raw = (log_dir / "s.jsonl").read_bytes()
    for piece in (configured[:16], configured[-16:], own[:16]):
        assert piece.encode() not in raw
    messages = [e["message"] for e in read_events(log_dir / "s.jsonl").events]
    assert messages == [
        "upstream answered 401: Invalid key [REDACTED]…",
        "- tool output: dashboard value: [REDACTED]…",
        "Writing .env: GATEWAY_TOKEN is [REDACTED]",
        "…[REDACTED] is the token",
        f"short {configured[:15]} stays",  # (15 of its 48 characters: the rest unguessable)
    ]


def test_a_piece_of_a_known_key_cut_in_json_that_escapes_more_than_it_must_is_taken_out(
    log_dir: Path, writers
) -> None:
    """A tool's PHP-written JSON that ends partway through a key with a "/" in it (its
    ``\\/``): the whole escaped key was taken out, a cut one was written, 30 of its
    characters, though the same cut without the escape was taken out. A run that ends on an
    escaped quote's backslash is no cut: the line stays readable."""
    key = "Zx9Qv2Lp7Rt4Wm8Nk3Bd/Hf6Js1Yc5Ug0Ie7Oa2Xe="
    w = started(writers, log_dir, secrets=[key])
    texts = [
        '{"env":{"TOKEN":"' + key[:30].replace("/", "\\/"),  # cut, escaped
        '{"env":{"TOKEN":"' + key[:34],  # cut, as it is
        "quoted " + key[:20] + '" and on',  # the key's start, then a quote (escaped): no cut
    ]
    for n, text in enumerate(texts):
        w.emit("s", request_event(n, None, 0, [{"role": "tool", "content": text}]))
    assert w.close()
    raw = (log_dir / "s.jsonl").read_bytes()
    assert b"Zx9Qv2Lp7Rt4Wm8N" not in raw[: raw.index(b"quoted")], raw
    contents = [e["appended"][0]["content"] for e in read_events(log_dir / "s.jsonl").events]
    assert contents[:2] == ['{"env":{"TOKEN":"[REDACTED]', '{"env":{"TOKEN":"[REDACTED]']
    assert contents[2] == texts[2]  # (read back whole: the line was not broken)


@pytest.mark.parametrize("kind", ['"', "\\"])
@pytest.mark.parametrize("after", ["\n", "…"])
def test_a_piece_of_a_key_with_a_quote_or_backslash_cut_before_it_is_taken_out(
    kind: str, after: str
) -> None:
    """A key whose written form has an escape (``\\"``, ``\\\\``), cut just before it and
    followed by a line end: the run went on through the line's own ``\\n`` (both open with a
    backslash), ended on its letter, and the piece was left."""
    key = "kA1b2C3d4E5f6G7h8" + kind + "I9j0K1l2M3n4"
    line = orjson.dumps({"c": "summary: " + key[:17] + after + "next"})
    out = _without(line, _as_written([key]))
    assert b"kA1b2C3d4E5f6G7h" not in out, out
    assert orjson.loads(out)["c"] == "summary: [REDACTED]" + after + "next"


def test_a_key_piece_that_would_start_on_an_escapes_letter_is_left_and_the_line_readable(
    tmp_path: Path, writers
) -> None:
    """A key that starts with ``n`` (NVIDIA's ``nvapi-…``) after a line end in a text: its
    first characters matched from the ``n`` of ``\\n``, the escape's backslash was left before
    ``[REDACTED]`` and the line was no JSON (torn: the event gone from show and replay)."""
    key = "nvapi-Qw3rTy7uIoP1aSdFgHjKlZxCvBnMm12345"
    w = started(writers, tmp_path, secrets=[key])
    w.emit("s", {"ts": 1.0, "type": "error", "message": "line one\n" + key[1:20]})
    w.emit("s", {"ts": 2.0, "type": "error", "message": "a\\" + key[:20]})
    assert w.close()
    read = read_events(tmp_path / "s.jsonl")
    assert read.torn == 0
    assert [e["message"] for e in read.events] == ["line one\n" + key[1:20], "a\\[REDACTED]"]


def test_a_piece_inside_a_text_is_no_cut_and_other_keys_of_its_provider_go_whole(
    tmp_path: Path, writers
) -> None:
    """Every Anthropic key starts with the same 13 characters: taking out the configured key's
    first 12 wherever they stood turned another key's start into ``[REDACTED]``, its pattern
    no longer matched, and its ~95-character secret body was written in clear."""
    configured = "sk-ant-api03-" + "Qw3rTy7uIo9pAs1dFg5hJk2lZx8cVb4nMm6QqWwEeRrTtYyUuIiOoPp-AA"
    other = "sk-ant-api03-" + "9bKZI2JMKPSQpDI7hd63jfKe0ZzLq8XwVn4Rt5Yu1Io2Pa3Sd4Fg5Hj6Kl-_AA"
    w = started(writers, tmp_path, secrets=[configured])
    text = f"BACKUP={other}\ncheck startswith('sk-ant-api03') first"
    w.emit("s", {"ts": 1.0, "type": "error", "message": text})
    named = "Anthropic API keys begin with sk-ant-api03-"  # (the start all its keys share)
    w.emit("s", {"ts": 2.0, "type": "error", "message": named})
    assert w.close()
    raw = (tmp_path / "s.jsonl").read_bytes()
    assert other[13:40].encode() not in raw
    first, second = read_events(tmp_path / "s.jsonl").events
    assert first["message"] == "BACKUP=[REDACTED]\ncheck startswith('sk-ant-api03') first"
    assert second["message"] == named


def test_a_clients_key_that_holds_the_configured_one_is_taken_whole(log_dir: Path, writers) -> None:
    """The configured key replaced first left the rest of a client's longer key that holds it
    (``[REDACTED]-DDDDEEEEFFFF``); the other way round as well. Longest first."""
    configured = "Ab12Cd34Ef56Gh78"
    longer = configured + "-DDDDEEEEFFFF"
    shorter = "Zz99Yy88Xx77"
    outer = "Qq11" + shorter + "Ww22Ee33"
    w = started(writers, log_dir, secrets=[configured, outer])
    w.emit("s", {"ts": 1.0, "type": "error", "message": f"a {longer} b"}, False, (longer,))
    w.emit("s", {"ts": 2.0, "type": "error", "message": f"c {outer} d"}, False, (shorter,))
    w.emit("s", {"ts": 3.0, "type": "session_meta", "ua": f"x/{longer}"}, True, (longer,))
    assert w.close()
    raw = (log_dir / "s.jsonl").read_bytes()
    for piece in (b"DDDDEEEEFFFF", b"Qq11", b"Ww22Ee33", configured.encode()):
        assert piece not in raw
    events = read_events(log_dir / "s.jsonl").events
    messages = [e["message"] for e in events if e["type"] == "error"]
    assert messages == ["a [REDACTED] b", "c [REDACTED] d"]
    (meta,) = [e for e in events if e["type"] == "session_meta"]
    assert meta["ua"] == "x/[REDACTED]"


def test_a_crashed_writer_counts_every_later_event_as_lost_at_once(log_dir: Path) -> None:
    lost: list[str] = []
    w = EventLogWriter(log_dir, on_loss=lost.append)

    def bug(*args: Any) -> None:
        raise RuntimeError("writer bug")

    w._write_lines = bug  # type: ignore[method-assign]
    w.start()
    assert w.emit("s", {"ts": 1.0, "type": "error", "message": "first"})
    assert w._thread is not None
    w._thread.join(5)
    assert not w._thread.is_alive()
    assert w.emit("s", {"ts": 2.0, "type": "error", "message": "later"}) is False
    # the line it was writing and the later one: counted now, not when the server stops
    assert lost == ["closed", "closed"]


# ------------------------------------------------------------------------------------------------
# Retention


def make_log(log_dir: Path, sid: str, size: int, mtime: float) -> Path:
    path = log_dir / f"{sid}.jsonl"
    line = b'{"ts":1,"type":"session_meta"}\n'
    path.write_bytes(line + b"x" * (size - len(line)))
    os.utime(path, (mtime, mtime))
    return path


def test_retention_removes_old_files_but_never_active_ones(tmp_path: Path) -> None:
    now = 1_700_000_000.0
    day = 86400.0
    old = make_log(tmp_path, "old", 10, now - 10 * day)
    old_active = make_log(tmp_path, "old-active", 10, now - 20 * day)
    fresh = make_log(tmp_path, "fresh", 10, now - 1 * day)
    other = tmp_path / "notes.txt"
    other.write_text("keep")
    os.utime(other, (now - 30 * day, now - 30 * day))

    removed = enforce_retention(
        tmp_path, max_age_days=7, max_total_mb=None, active={"old-active"}, now=now
    )
    assert removed == [str(old)]
    assert old_active.exists() and fresh.exists() and other.exists()


@pytest.mark.parametrize("limit", ["age", "size"])
def test_retention_keeps_a_session_resumed_while_it_scanned(tmp_path: Path, limit: str) -> None:
    """Thousands of logs take a while to scan, and an agent resumes its session as cachegate
    restarts: its file, old at the scan, was deleted with the exchange written to it since,
    silently. Each file is looked at again just before it goes."""
    now = 1_700_000_000.0
    day = 86400.0
    gone = make_log(tmp_path, "gone", 10, now - 30 * day)
    written = make_log(tmp_path, "written", 10, now - 20 * day)
    resumed = make_log(tmp_path, "resumed", 10, now - 10 * day)
    asked: list[str] = []

    def live(sid: str) -> bool:
        asked.append(sid)
        if sid == "gone":  # meanwhile: a request of "written" is logged, "resumed" is held
            with written.open("ab") as fh:
                fh.write(b'{"ts":1,"type":"request","exchange":1}\n')
        return sid == "resumed"

    removed = enforce_retention(
        tmp_path,
        max_age_days=7 if limit == "age" else None,
        max_total_mb=0 if limit == "size" else None,
        active=(),
        now=now,
        live=live,
    )
    assert removed == [str(gone)]
    assert written.exists() and resumed.exists()
    assert asked == ["gone", "written", "resumed"]


def test_retention_leaves_other_jsonl_files_in_a_shared_directory_alone(tmp_path: Path) -> None:
    """``--log-dir .`` or a shared data directory: only cachegate's own logs are removed."""
    now = 1_700_000_000.0
    old = now - 30 * 86400.0
    ours = make_log(tmp_path, "old-session", 100, old)
    results = tmp_path / "results.jsonl"  # a valid session id as a name, but not an event log
    results.write_bytes(b'{"epoch": 1, "loss": 0.5}\n' * 4)
    spaced = tmp_path / "my data.jsonl"  # not a session id at all, though it looks like ours
    spaced.write_bytes(b'{"ts":1,"type":"x"}\n')
    link = tmp_path / "linked.jsonl"  # a link to one of ours is not followed
    link.symlink_to(ours)
    for path in (results, spaced):
        os.utime(path, (old, old))
    removed = enforce_retention(tmp_path, max_age_days=7, max_total_mb=0, active=(), now=now)
    assert removed == [str(ours)]
    assert results.exists() and spaced.exists() and link.is_symlink()


def test_retention_judges_a_log_as_the_reports_do_past_a_crash_s_leading_nuls(
    tmp_path: Path,
) -> None:
    """A crash can leave a log's first blocks as NUL bytes (XFS, ext4's delayed allocation):
    ``sessions list`` shows such a log, but retention took it for another tool's file and kept
    it past ``max_age_days``, uncounted in ``max_total_mb``, for ever."""
    now = 1_700_000_000.0
    old = now - 30 * 86400.0
    line = b'{"ts":1,"type":"session_meta"}\n'
    cases = {
        "nul-block": b"\0" * 4096 + line,
        "past-a-chunk": b"\0" * 65533 + line,  # (its start cut by the first read's end)
        "bom-cut": b"\0" * 65535 + b"\xef\xbb\xbf" + line,  # (the mark cut there too)
        "bom-line": b"\xef\xbb\xbf\n" + line,  # (a line of the mark alone: the next judged)
        "bom-blank": b"\xef\xbb\xbf \r\n\n" + line,
        "far": b"\0" * 200_000 + line,
        "bom": b"\xef\xbb\xbf" + line,
        "blank-first": b"\n\n" + line,
        # (the NULs end inside a line the crash cut: the line after it decides, as for list)
        "nul-to-mid-line": b"\0" * 4096 + b'ession","model":"gpt-4o"}\n' + line,
        "nul-to-mid-long-line": b"\0" * 4096 + b"x" * 100_000 + b"\n" + line,
        "nul-to-mid-2mb-line": b"\0" * 4096 + b"x" * 2_000_000 + b"\n" + line,  # (past 1 MiB)
    }
    paths = []
    for name, data in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(data)
        os.utime(path, (old, old))
        paths.append(path)
    nuls_only = tmp_path / "nuls-only.jsonl"  # nothing but a crash's NULs: no log of ours
    nuls_only.write_bytes(b"\0" * 8192)
    other = tmp_path / "other.jsonl"
    other.write_bytes(b"\0" * 10 + b'{"epoch": 1}\n')
    other_cut = tmp_path / "other-cut.jsonl"  # (a cut first line, then no line of ours)
    other_cut.write_bytes(b"\0" * 10 + b'och": 1}\n{"epoch": 2}\n' + line)
    # another tool's file whose first line is text, not a crash's NULs and a cut line's tail:
    # never taken for ours, whatever follows (it was deleted, and listed as a session)
    other_text = tmp_path / "metrics.jsonl"
    other_text.write_bytes(b"# exported by another tool\n" + line)
    for path in (nuls_only, other, other_cut, other_text):
        os.utime(path, (old, old))
    from proxy.report import list_sessions

    assert {s.session for s in list_sessions(tmp_path)} == set(cases)  # each is listed
    removed = enforce_retention(tmp_path, max_age_days=7, max_total_mb=None, active=(), now=now)
    assert sorted(removed) == sorted(str(p) for p in paths)
    assert nuls_only.exists() and other.exists() and other_cut.exists() and other_text.exists()


@pytest.mark.parametrize(
    ("data", "ours"),
    [
        # another tool's files: a first line of text, or blanks and NULs before its text
        (b" " + b"\0" * 64 + b"# header\n", False),
        (b"\t\0\0\0text\n", False),
        (b" " * 65536 + b"\0text\n", False),
        (b"\xef\xbb\xbf\xef\xbb\xbf", False),  # (two marks: the second is content)
        (b"\xef\xbb\xbf \r\n", True),  # (a mark, blanks, a line end: the next line decides)
        (b"\x0b\n", False),
        # a crash's NULs up to the middle of a line, at a read's edge or not
        (b"\0" * 65536 + b'ession"}\n', True),
        (b"\0" * 131072 + b'ession"}\n', True),
        (b"\0" * 4096 + b"\r" + b'ession"}\n', True),
        (b"\0" * 4096 + b"\xef\xbb\xbf" + b'ession"}\n', True),
        (b"\0" * 4096 + b"x" * 2_000_000 + b"\n", True),
        # past the first MiB of a line without content, retention does not know: never deleted
        (b" " * (1 << 20) + b"text\n", False),
        (b"\0" * ((1 << 20) + 5) + b"text\n", None),
    ],
    ids=lambda value: repr(value[:12]) if isinstance(value, bytes) else str(value),
)
def test_retention_deletes_only_what_the_reports_show_as_a_session(
    tmp_path: Path, data: bytes, ours: bool | None
) -> None:
    """Retention and the reports judged a file's start each its own way: files another tool
    wrote (a blank, then NULs, then text) were deleted by retention and never listed; logs a
    crash zeroed to a 64 KiB boundary were listed and never deleted."""
    path = tmp_path / "f.jsonl"
    path.write_bytes(data + b'{"ts":1.5,"type":"session_meta","session":"f"}\n')
    listed = read_events(path).starts_as_log
    deletable = eventlog._is_event_log(str(path))
    assert listed is (ours is not False)
    assert deletable is bool(ours)  # (None: listed, but never taken for one: kept)


def test_retention_trims_the_oldest_until_the_total_fits(tmp_path: Path) -> None:
    now = 1_700_000_000.0
    mb = 1024 * 1024
    a = make_log(tmp_path, "a", mb, now - 500)  # oldest, but active
    b = make_log(tmp_path, "b", mb, now - 400)
    c = make_log(tmp_path, "c", mb, now - 300)
    d = make_log(tmp_path, "d", mb, now - 200)
    removed = enforce_retention(
        tmp_path, max_age_days=None, max_total_mb=2.5, active={"a"}, now=now
    )
    assert removed == [str(b), str(c)]
    assert a.exists() and d.exists()
    assert enforce_retention(
        tmp_path, max_age_days=None, max_total_mb=0, active={"a"}, now=now
    ) == [str(d)]
    assert a.exists()


def test_retention_of_a_missing_directory_removes_nothing(tmp_path: Path) -> None:
    assert (
        enforce_retention(tmp_path / "nope", max_age_days=1, max_total_mb=1, active=(), now=0.0)
        == []
    )


def test_a_burst_is_written_in_order_with_few_system_calls(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch
) -> None:
    import proxy.eventlog as eventlog

    calls: list[int] = []
    real_write = os.write

    def counting_write(fd: int, data: Any) -> int:
        calls.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(eventlog.os, "write", counting_write)
    w = EventLogWriter(log_dir)  # queued before the writer starts: one burst
    writers.append(w)
    for i in range(300):
        for sid in ("a", "b", "c"):
            assert w.emit(sid, {"type": "error", "n": i, "secret": "sk-" + "xY7" * 10 * (i == 7)})
    w.start()
    assert w.close()
    assert w.written == 900
    for sid in ("a", "b", "c"):
        events = read_events(log_dir / f"{sid}.jsonl").events
        assert [e["n"] for e in events] == list(range(300))
        assert "sk-" + "xY7" * 10 not in (log_dir / f"{sid}.jsonl").read_text()
        assert events[7]["secret"] == "[REDACTED]"  # still redacted within a batch
    assert len(calls) < 30  # batched: not one write per event


def test_metadata_mode_logs_a_body_nested_as_deep_as_cachegate_reads(
    log_dir: Path, writers
) -> None:
    """Full mode logs a 300-level schema through the standard library's encoder; metadata mode
    hashed it with orjson alone (254 levels), and the request line was lost."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    deep_text: Any = "PRIVATE"
    for _ in range(300):
        deep_text = [deep_text]
    message = {"role": "user", "content": [{"type": "text", "text": "x", "extra": deep_text}]}
    losses: list[str] = []
    w = started(writers, log_dir, bodies="metadata", on_loss=losses.append)
    w.emit("s", {**request_event(1, None, 0, [message]), "tools": tools})
    assert w.close() and (w.written, w.errors, losses) == (1, 0, [])
    (req,) = read_events(log_dir / "s.jsonl").events
    assert req["tools"]["count"] == 1 and len(req["tools"]["sha256"]) == 64
    assert req["appended"][0]["chars"] == len("text") + 1 + len("PRIVATE")
    assert b"PRIVATE" not in (log_dir / "s.jsonl").read_bytes()


def test_metadata_mode_keeps_the_tools_count_and_hash_not_their_text() -> None:
    tools = [{"type": "function", "function": {"name": "deploy", "description": "Ship it."}}]
    same = [{"function": {"description": "Ship it.", "name": "deploy"}, "type": "function"}]
    event = {"ts": 1.0, "type": "request", "appended": [], "tools": tools, "params": {"n": 1}}
    stripped = strip_bodies(event)
    assert stripped["tools"]["count"] == 1
    assert stripped["tools"] == strip_bodies({**event, "tools": same})["tools"]  # key order
    assert "Ship it" not in orjson.dumps(stripped).decode()
    assert stripped["params"] == {"n": 1}
    assert strip_bodies({**event, "tools": None})["tools"] is None


def test_metadata_mode_keeps_no_text_of_a_changed_system_block() -> None:
    system = {"role": "system", "content": "Current time: 08:15. Secret plan."}
    event = {"ts": 1.0, "type": "request", "head": [system], "replaces": 1, "appended": []}
    stripped = strip_bodies(event)
    assert stripped["head"] == [
        {"role": "system", "chars": 33, "sha256": stripped["head"][0]["sha256"]}
    ]
    assert "Secret" not in orjson.dumps(stripped).decode() and stripped["replaces"] == 1


def test_replay_carries_the_tools_of_a_line_it_has_to_leave_out() -> None:
    def line(exchange: int, base_exchange: int | None, base: int, **more: Any) -> dict[str, Any]:
        return {
            "type": "request",
            "exchange": exchange,
            "model": "m",
            "stream": False,
            "params": {},
            "base_exchange": base_exchange,
            "base": base,
            "appended": [{"role": "user", "content": str(exchange)}],
            **more,
        }

    events = [
        line(1, None, 0, tools=["T1"]),
        line(2, 7, 1, tools=["T2"]),  # its base is missing: left out, its tools still hold
        line(3, None, 0),
    ]
    replayed = replay_requests(events)
    assert [r["exchange_id"] for r in replayed] == [1, 3]
    assert replayed[1]["tools"] == ["T2"]


def test_metadata_mode_keeps_structured_parameters_as_hashes() -> None:
    prediction = {"type": "content", "content": "def secret_plan(): ..."}
    event = {
        "ts": 1.0,
        "type": "request",
        "appended": [],
        "params": {"temperature": 0.2, "prediction": prediction, "reasoning_effort": "low"},
    }
    params = strip_bodies(event)["params"]
    assert params["temperature"] == 0.2 and params["reasoning_effort"] == "low"
    assert set(params["prediction"]) == {"sha256"}
    assert "secret_plan" not in orjson.dumps(params).decode()


def test_metadata_mode_hashes_free_text_parameters_and_keeps_settings() -> None:
    """The README said such a log "keeps no text", but ``user`` (an end user's e-mail),
    ``stop``, ``instructions`` and ``prompt_cache_key`` were written as sent."""
    params = {
        "user": "alice@corp.example",
        "safety_identifier": "alice-hash-1",
        "stop": "PRIVATESTOP",
        "instructions": "PRIVATE instructions",
        "prompt_cache_key": "PRIVATE-project",
        "service_tier": "auto",
        "reasoning_effort": "high",
        "temperature": 0.2,
    }
    stripped = strip_bodies({"ts": 1.0, "type": "request", "appended": [], "params": params})
    text = orjson.dumps(stripped).decode()
    assert "alice" not in text and "PRIVATE" not in text
    kept = stripped["params"]
    assert (kept["service_tier"], kept["reasoning_effort"], kept["temperature"]) == (
        "auto",
        "high",
        0.2,
    )
    assert (
        kept["user"]
        == strip_bodies(
            {"ts": 2.0, "type": "request", "appended": [], "params": {"user": "alice@corp.example"}}
        )["params"]["user"]
    )  # the same value hashes the same: who is still told apart


def test_metadata_mode_hashes_a_string_parameter_it_does_not_know() -> None:
    """A string of a parameter that is no known setting (a gateway's top-level ``system``, a
    server's own field) may be text: it was written as sent in a log that keeps none."""
    params = {"system": "SYSTEMSECRET", "x_extra": "EXTRASECRET", "model": "gpt-4o"}
    stripped = strip_bodies({"ts": 1.0, "type": "request", "appended": [], "params": params})
    text = orjson.dumps(stripped).decode()
    assert "SECRET" not in text
    assert stripped["params"]["model"] == "gpt-4o"


def test_an_azure_data_source_key_is_not_written(log_dir: Path, writers) -> None:
    """Azure OpenAI's ``data_sources`` carry a search service's key in an ``authentication``
    object (``"key"``, which elsewhere names no credential): it was written as sent."""
    w = started(writers, log_dir)
    key = "Xy7PqR2sT9uV4wZ1aB3cD5eF7gH9iJ1kL3mN5oP7qR9sT1uV3w"
    source = {
        "type": "azure_search",
        "parameters": {
            "endpoint": "https://mysearch.search.windows.net",
            "authentication": {"type": "api_key", "key": key},
        },
    }
    elastic = {"type": "key_and_key_id", "key": "ELASTICKEY", "key_id": "KEYID1"}
    params = {"data_sources": [source, {"parameters": {"authentication": elastic}}]}
    w.emit("s", {"type": "request", "params": params})
    assert w.close() and w.written == 1
    text = (log_dir / "s.jsonl").read_text()
    assert key not in text and "ELASTICKEY" not in text and "KEYID1" not in text
    (event,) = read_events(log_dir / "s.jsonl").events
    written = event["params"]["data_sources"][0]["parameters"]
    assert written["authentication"] == {"type": "api_key", "key": "[REDACTED]"}
    assert written["endpoint"] == "https://mysearch.search.windows.net"


def test_metadata_mode_hashes_the_divergence_excerpts() -> None:
    """The excerpts are of the changed text (a tool output, a system prompt): written as they
    were, they kept text the mode promises to keep out."""
    divergence = {
        "location": "messages",
        "index": 3,
        "role": "tool",
        "field": "content",
        "old": "NPM_TOKEN npm_abcdefgh",
        "new": "NPM_TOKEN npm_ZZZZefgh",
        "volatile": False,
        "volatile_kind": None,
    }
    event = {"ts": 1.0, "type": "response", "message": None, "divergence": divergence}
    stripped = strip_bodies(event)["divergence"]
    assert {k: stripped[k] for k in ("location", "index", "role", "field")} == {
        "location": "messages",
        "index": 3,
        "role": "tool",
        "field": "content",
    }
    assert stripped["old"]["chars"] == 22 and len(stripped["new"]["sha256"]) == 64
    assert "npm_" not in orjson.dumps(stripped).decode()


def _held_deleted(name: str) -> bool:
    """Whether this process holds a descriptor of a removed file named ``name``."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith(f"/{name} (deleted)"):
            return True
    return False


def test_a_session_file_removed_while_held_open_is_closed_without_waiting_for_a_write(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk, and the user deletes old logs: the space came back only once each session
    wrote again or its file had been idle for ten minutes (the writer held the descriptors)."""
    monkeypatch.setattr(eventlog, "REMOVED_CHECK_S", 0.05, raising=False)
    w = started(writers, log_dir)
    for sid in ("old", "kept"):
        w.emit(sid, {"type": "session_meta", "session": sid}, first_in_file=True)
        w.emit(sid, {"type": "error", "exchange": 1, "status": 400, "message": "x" * 1000})
    assert w.flush()
    (log_dir / "old.jsonl").unlink()
    assert _held_deleted("old.jsonl")
    deadline = time.monotonic() + 10
    while _held_deleted("old.jsonl") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _held_deleted("old.jsonl")  # closed by the writer's idle pass: space freed
    w.emit("old", {"type": "error", "exchange": 2, "status": 400, "message": "two"})
    w.emit("kept", {"type": "error", "exchange": 2, "status": 400, "message": "two"})
    assert w.flush()
    assert [e.get("message") for e in read_events(log_dir / "old.jsonl").events] == [None, "two"]
    assert w.take_broken("old")  # its next request line goes in full: its bases are gone
    assert not w.take_broken("kept")
    assert [e.get("message") for e in read_events(log_dir / "kept.jsonl").events][-1] == "two"


@pytest.mark.parametrize("rotation", ["renamed", "truncated"])
def test_a_session_file_rotated_between_bursts_is_noticed_before_the_next(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch, rotation: str
) -> None:
    """logrotate renames a session's file (or copytruncate empties it) while the session is
    idle: only a removal was noticed then, so the next burst's request lines, coded against
    lines of the old file as they came, were each skipped by replay. Now the session's next
    request line goes in full."""
    monkeypatch.setattr(eventlog, "REMOVED_CHECK_S", 0.05, raising=False)
    w = started(writers, log_dir)
    for sid in ("rot", "kept"):
        w.emit(sid, {"type": "session_meta", "session": sid}, first_in_file=True)
        w.emit(sid, {"type": "error", "exchange": 1, "status": 400, "message": "one"})
    assert w.flush()
    path = log_dir / "rot.jsonl"
    if rotation == "renamed":
        path.rename(log_dir / "rot.jsonl.1")
    else:
        os.truncate(path, 0)
    deadline = time.monotonic() + 10
    while not w.take_broken("rot") and time.monotonic() < deadline:
        time.sleep(0.05)  # (the writer's idle pass: no line written meanwhile)
    assert time.monotonic() < deadline  # noticed with no write to the session
    assert not w.take_broken("kept")


def test_a_full_disk_mid_write_leaves_no_torn_line(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills in the middle of a batch: what got onto it is taken back, so the file
    holds whole lines only (the reports skipped the fragment as a torn line, and the next line
    went on after it)."""
    import errno

    w = started(writers, log_dir)
    w.emit("s", {"type": "session_meta", "session": "s"}, first_in_file=True)
    w.emit("s", {"type": "error", "exchange": 1, "status": 400, "message": "one"})
    assert w.flush()
    real_write = os.write
    calls = 0

    def filling(fd: int, data: Any) -> int:
        nonlocal calls
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) != "s.jsonl":
            return real_write(fd, data)
        calls += 1
        if calls == 1:  # half of the lines go onto the disk...
            return real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")  # ...and then it is full

    monkeypatch.setattr(os, "write", filling)
    w.emit("s", {"type": "error", "exchange": 2, "status": 400, "message": "lost " * 50})
    assert w.flush()
    monkeypatch.setattr(os, "write", real_write)
    w.emit("s", {"type": "error", "exchange": 3, "status": 400, "message": "three"})
    assert w.flush()
    log = read_events(log_dir / "s.jsonl")
    assert log.torn == 0
    # and a line in its place tells of the one the full disk took
    assert [e.get("message", e["type"]) for e in log.events] == [
        "session_meta",
        "one",
        "lines_lost",
        "three",
    ]
    assert w.errors == 1 and lost_lines(log.events) == 1


def test_losses_no_file_could_be_told_of_are_said_when_the_writer_stops(
    log_dir: Path, writers, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """The disk full until cachegate stops: the files cannot say what they lost, and stderr
    had only the first warning of it (at most one every 30 s). Stopping says it all."""
    import errno

    w = started(writers, log_dir)
    w.emit("a", {"type": "session_meta", "session": "a"}, first_in_file=True)
    assert w.flush()

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    for sid in ("a", "b"):
        w.emit(sid, {"type": "request", "exchange": 1})
        w.emit(sid, {"type": "response", "exchange": 1})
    assert w.flush()
    with caplog.at_level(logging.WARNING, logger="proxy.eventlog"):
        assert w.close()
        assert w.close()  # (again at exit, as serve's atexit does: said once)
    said = [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()]
    assert said == [
        "event log: 4 line(s) of 2 session(s), 2 of them request line(s), could not be"
        " written, and their files do not say so (a full disk, or a log directory that could"
        " not be written: see the warnings above)"
    ]


def test_lines_lost_say_how_many_were_requests_and_are_told_when_the_writer_stops(
    log_dir: Path, writers
) -> None:
    """A session's last line could not be serialized: no later line of it would tell, so the
    writer tells when it stops; a lost response line is no lost request (replay is whole)."""
    w = EventLogWriter(log_dir, max_queue=2)  # queued before the writer starts
    writers.append(w)
    assert w.emit("s", {"type": "request", "exchange": 1})
    assert w.emit("s", {"type": "response", "exchange": 1})
    assert not w.emit("s", {"type": "request", "exchange": 2})  # the queue is full
    assert not w.emit("s", {"type": "response", "exchange": 2})
    w.start()
    assert w.flush()
    w.emit("s", ["not", "a", "dict"])  # type: ignore[arg-type]  # cannot be serialized
    assert w.close()
    events = read_events(log_dir / "s.jsonl").events
    told = [e for e in events if e["type"] == "lines_lost"]
    assert [(e["lines"], e["requests"]) for e in told] == [(2, 1), (1, 0)]
    assert events[-1]["type"] == "lines_lost"  # written as the writer stopped
    assert (lost_lines(events), lost_requests(events)) == (3, 1)


def test_a_line_nested_deeper_than_orjson_reads_is_read_not_counted_torn() -> None:
    """A body at orjson's limit (1,024 levels) is logged one or two levels deeper (the event
    wraps it): the reader took that line for a torn one, and replay printed nothing."""
    from proxy.eventlog import parse_lines

    deep = b"[" * 1030 + b'"x"' + b"]" * 1030
    line = b'{"ts":1.0,"type":"request","exchange":1,"params":{"m":' + deep + b"}}\n"
    log = parse_lines([line, b'{"ts":2.0,"type":"error"}\n', b"{torn\n"])
    assert [e["type"] for e in log.events] == ["request", "error"]
    assert log.torn == 1


def test_retention_after_a_restart_spares_the_logs_the_process_before_still_held(
    tmp_path: Path,
) -> None:
    """At start no session is in memory and no file open: a restart (an upgrade, a crash under
    systemd) deleted the logs of agents that were running seconds before, with max_total_mb
    set, where one process would have kept them for ``sessions.idle_ttl_s``."""
    now = 1_700_000_000.0
    started = now - 60
    mb = 1024 * 1024
    stale = make_log(tmp_path, "stale", mb, now - 8 * 3600)  # idle past idle_ttl_s (6 h)
    live = make_log(tmp_path, "live", mb, now - 120)  # written just before the restart
    mine = make_log(tmp_path, "mine", mb, now - 30)  # this process's, its session forgotten
    removed = enforce_retention(
        tmp_path,
        max_age_days=None,
        max_total_mb=0,
        active=(),
        now=now,
        previous=(started, 6 * 3600.0),
    )
    assert removed == [str(stale), str(mine)]
    assert live.exists()
    # once idle longer than idle_ttl_s, it goes as any other
    later = now + 6 * 3600
    assert enforce_retention(
        tmp_path,
        max_age_days=None,
        max_total_mb=0,
        active=(),
        now=later,
        previous=(started, 6 * 3600.0),
    ) == [str(live)]


def test_the_compactions_a_log_records_are_read_back_for_a_restart(tmp_path: Path) -> None:
    made = {
        "type": "compacted",
        "exchange": 3,
        "start": 1,
        "covered": 30,
        "summary": "[cachegate summary] …",
        "tokens_before": 9000,
        "tokens_after": 3000,
        "source": "model",
        "prefix_digest": "ab" * 16,
        "opening": "1:" + "cd" * 16,
    }
    lines = [
        {"type": "request", "exchange": 1, "appended": [{"role": "user", "content": "compacted"}]},
        made,
        {**made, "source": "reused", "summary": None},  # points at the one made
        {**made, "summary": {"chars": 20, "sha256": "00"}},  # metadata mode: no text to reuse
        {**made, "prefix_digest": None},  # an older cachegate's line: no digests
        {**made, "covered": "30"},
        {**made, "source": "extractive", "prefix_digest": "ef" * 16},
    ]
    path = tmp_path / "s.jsonl"
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    path.write_bytes(data + orjson.dumps({**made, "prefix_digest": "99" * 16}))  # no end yet
    found = logged_compactions(path)
    assert [(e["source"], e["prefix_digest"]) for e in found] == [
        ("model", "ab" * 16),
        ("extractive", "ef" * 16),
    ]
    # one made twice (forgotten, then made again) is one of the last ones asked for
    again = tmp_path / "again.jsonl"
    older = {**made, "prefix_digest": "11" * 16}
    again.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in (older, made, made, made)))
    assert [e["prefix_digest"] for e in logged_compactions(again, 2)] == ["11" * 16, "ab" * 16]
    with pytest.raises(FileNotFoundError):
        logged_compactions(tmp_path / "none.jsonl")
    (tmp_path / "link.jsonl").symlink_to(path)
    with pytest.raises(NotALogFile):
        logged_compactions(tmp_path / "link.jsonl")


def test_a_lock_file_with_a_second_name_in_a_private_directory_is_taken(tmp_path: Path) -> None:
    """A snapshot backup hard-links the files it keeps: in a directory only the user may write
    into, a second name is no danger, and cachegate starts (in a shared one it is refused:
    tests/test_cli.py)."""
    from proxy.eventlog import LOCK_NAME, claim_log_dir

    private = tmp_path / "logs"
    private.mkdir(mode=0o700)
    (private / LOCK_NAME).write_text("")
    os.link(private / LOCK_NAME, tmp_path / "snapshot.lock")
    assert claim_log_dir(private) is None
    assert (tmp_path / "snapshot.lock").read_text() == f"{os.getpid()}\n"  # (the same file)


def test_a_loss_is_told_with_its_own_time_and_not_into_a_file_removed_meanwhile(
    log_dir: Path, writers
) -> None:
    """Told when the writer stops, a loss's line carried the stop's time (a session's last
    seen moved to it) and made a removed file again for that line alone."""
    w = started(writers, log_dir)
    for sid in ("kept", "gone"):
        w.emit(sid, {"type": "session_meta", "session": sid}, first_in_file=True)
        w.emit(sid, {"type": "request", "exchange": 1})
        w.emit(sid, ["not", "a", "dict"])  # type: ignore[arg-type]  # cannot be serialized
    assert w.flush()
    lost_at = time.time()
    (log_dir / "gone.jsonl").unlink()
    time.sleep(0.2)
    assert w.close()
    assert not (log_dir / "gone.jsonl").exists()
    (told,) = [e for e in read_events(log_dir / "kept.jsonl").events if e["type"] == "lines_lost"]
    assert told["ts"] <= lost_at  # when it was lost, not when the writer stopped


def test_a_session_whose_first_lines_were_all_lost_gets_a_file_that_says_so(
    log_dir: Path, writers
) -> None:
    """A burst dropped a new session's meta and request lines: its loss was told nowhere."""
    w = EventLogWriter(log_dir, max_queue=1)  # queued before the writer starts
    writers.append(w)
    assert w.emit("a", {"type": "request", "exchange": 1})
    assert not w.emit("c", {"type": "request", "exchange": 1})  # the queue is full
    w.start()
    assert w.close()
    events = read_events(log_dir / "c.jsonl").events
    assert [(e["type"], e["lines"], e["requests"]) for e in events] == [("lines_lost", 1, 1)]
    # the next process, the session going on under its id: its meta line goes in all the same
    w2 = started(writers, log_dir)
    w2.emit("c", {"type": "session_meta", "session": "c", "model": "gpt-4o"}, first_in_file=True)
    w2.emit("c", {"type": "request", "exchange": 1})
    assert w2.close()
    kinds = [e["type"] for e in read_events(log_dir / "c.jsonl").events]
    assert kinds == ["lines_lost", "session_meta", "request"]
    w3 = started(writers, log_dir)  # and only once: not again by each later process
    w3.emit("c", {"type": "session_meta", "session": "c", "model": "gpt-4o"}, first_in_file=True)
    w3.emit("c", {"type": "request", "exchange": 1})
    assert w3.close()
    kinds = [e["type"] for e in read_events(log_dir / "c.jsonl").events]
    assert kinds == ["lines_lost", "session_meta", "request", "request"]


@pytest.mark.parametrize("crash", ["meta line cut", "NUL bytes", "long meta line", "BOM"])
def test_a_file_whose_meta_line_a_crash_cut_gets_one_from_the_next_process(
    log_dir: Path, writers: list[EventLogWriter], crash: str
) -> None:
    """A crash in the middle of a session's first line, or one that left its file as NUL
    bytes: the file was not empty, so no later process wrote a meta line, and `show` never
    said the session's upstream, version or client. A whole meta line, however long (a long
    model name), is still not written twice."""
    path = log_dir / "a.jsonl"
    meta = {"type": "session_meta", "session": "a", "upstream": "http://up/v1", "model": "m"}
    if crash == "long meta line":
        first = started(writers, log_dir)
        first.emit("a", {**meta, "model": "m" * 200_000}, first_in_file=True)
        assert first.close()
    else:
        log_dir.mkdir(mode=0o700, exist_ok=True)
        path.write_bytes(
            {
                "meta line cut": b'{"ts":"2026-12-04T10:00:00.000Z","type":"session_meta","s',
                "NUL bytes": b"\0" * 8192,  # (a delayed allocation's blocks)
                "BOM": b'\xef\xbb\xbf{"ts":1796390000.0,"type":"session_meta","session":"a",'
                b'"upstream":"http://up/v1","model":"m"}\n',
            }[crash]
        )
    for n in (1, 2, 3):  # and not again by each later cachegate
        w = started(writers, log_dir)
        w.emit("a", meta, first_in_file=True)
        w.emit("a", {"type": "error", "exchange": n, "status": 400, "message": "one"})
        assert w.close()
    log = read_events(path)
    metas = [e for e in log.events if e["type"] == "session_meta"]
    assert [e["type"] for e in log.events] == ["session_meta", "error", "error", "error"]
    assert metas[0]["upstream"] == "http://up/v1"
    assert metas[0]["model"] == ("m" * 200_000 if crash == "long meta line" else "m")


def test_a_share_that_gives_every_file_one_owner_is_named_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A share that gives every file one owner (sshfs without idmap, CIFS): the lock file just
    made was called another user's, to be removed, which could not help (and the session files
    would be refused the same way). Said as what it is, the file made taken back; a lock file
    found there that is another user's (a cachegate run with sudo) is named with its uid."""
    from proxy.eventlog import LOCK_NAME, UnsafeLockFile, claim_log_dir

    monkeypatch.setattr(eventlog, "_UID", os.geteuid() + 1)  # every file "another user's"
    fresh = tmp_path / "fresh"
    with pytest.raises(UnsafeLockFile, match="a log directory on a local disk"):
        claim_log_dir(fresh)
    assert not (fresh / LOCK_NAME).exists()
    found = tmp_path / "found"
    found.mkdir(mode=0o700)
    (found / LOCK_NAME).write_text("")
    with pytest.raises(UnsafeLockFile, match=r"another user \(uid \d+, this process is \d+\)"):
        claim_log_dir(found)


def test_a_whole_line_after_a_crash_s_nuls_is_read_and_the_nuls_count_as_lost_lines(
    tmp_path: Path,
) -> None:
    """A crash zeroed a log's first blocks up to where a line begins: that line, whole, was
    counted torn and lost with them (a request's model missing from ``show``, the request left
    out of ``replay``). It is read; the NULs count as one torn line that may have held a
    request. NULs up to a line's middle stay one torn line, and NULs alone one too."""
    meta = b'{"ts":1,"type":"session_meta","session":"z","upstream":"http://u"}\n'
    request = b'{"ts":2,"type":"request","exchange":1,"model":"gpt-4o","base":0,"appended":[]}\n'
    cases = {
        "to-a-line": (b"\0" * 4096 + meta + request, ["session_meta", "request"], 1),
        "to-mid-line": (
            b"\0" * 4096 + b'"x":1}\n' + meta + request,
            ["session_meta", "request"],
            1,
        ),
        "alone": (meta + b"\0" * 100 + b"\n" + request, ["session_meta", "request"], 1),
        # a body nested deeper than orjson reads, right after the NULs: read all the same
        "to-a-deep-line": (
            b"\0" * 4096 + request[:-2] + b',"params":' + b"[" * 1100 + b"]" * 1100 + b"}\n",
            ["request"],
            1,
        ),
    }
    for name, (data, kinds, torn) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(data)
        read = read_events(path)
        assert [e["type"] for e in read.events] == kinds, name
        assert (read.torn, read.torn_requests, read.starts_as_log) == (torn, torn, True), name


def test_replay_holds_a_long_session_s_histories_only_while_later_lines_are_based_on_them() -> None:
    """Every rebuilt request, each a list of its whole history, was held until the last was
    built: ``replay`` of 8,000 exchanges took 838 MB. Each is now given as it is rebuilt and
    held only until the last line based on it; a number a restart used again is still told
    apart, and a line based on an early exchange still finds it."""
    import tracemalloc

    turns = 2000
    events: list[dict[str, Any]] = [request_event(1, None, 0, [{"role": "user", "content": "t0"}])]
    for n in range(2, turns + 1):
        base = 2 * n - 3  # the previous request's messages and its answer
        turn = [{"role": "assistant", "content": f"a{n}"}, {"role": "user", "content": f"t{n}"}]
        events.append(request_event(n, n - 1, base, turn))
    events.append(
        request_event(turns + 1, 1, 1, [{"role": "user", "content": "a branch off the first"}])
    )
    events.append(
        request_event(1, None, 0, [{"role": "user", "content": "after a restart"}])
    )  # (number 1 again)
    events.append(
        request_event(turns + 2, 1, 1, [{"role": "user", "content": "based on the new 1"}])
    )

    tracemalloc.start()
    try:
        out = iter_replay_requests(events)
        first = next(out)
        lengths = [len(first["messages"])]
        tails = []
        for request in out:
            lengths.append(len(request["messages"]))
            tails.append(request["messages"][-1]["content"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert lengths[:turns] == [2 * n - 1 for n in range(1, turns + 1)]
    assert tails[-3:] == ["a branch off the first", "after a restart", "based on the new 1"]
    assert lengths[-3:] == [2, 1, 2]
    # held all at once, the lists alone take ~2,000 * 2,000 * 8 bytes = 32 MB
    assert peak < 4_000_000, peak


def test_responses_lines_replay_with_their_instructions_and_input_or_are_skipped() -> None:
    """A Responses API line names the earlier line that wrote its instructions: a line lost
    leaves the ones naming it out, with their number, rather than replay them without."""

    def line(n: int, **kw: Any) -> dict[str, Any]:
        return {
            "type": "request",
            "exchange": n,
            "model": "gpt-5",
            "path": "/v1/responses",
            "base_exchange": None,
            "base": 0,
            "appended": [{"role": "user", "content": str(n)}],
            **kw,
        }

    events = [
        line(1, params={"instructions": "rules"}),
        line(2, params={}, instructions_from=1),
        {"type": "lines_lost", "lines": 1, "requests": 1, "exchanges": [3]},
        line(4, params={}, instructions_from=3),
        line(5, params={"input": "hi"}, appended=[]),
        line(6, params={}, appended=[], no_input=True),
        # a metadata log's instructions, their hash: named as well
        line(7, params={"instructions": {"sha256": "ab12"}}),
        line(8, params={}, instructions_from=7),
    ]
    skipped: list[int] = []
    rebuilt = eventlog.replay_requests(events, skipped)
    assert skipped == [4]
    assert [(r["exchange_id"], r["params"], r.get("input")) for r in rebuilt] == [
        (1, {"instructions": "rules"}, [{"role": "user", "content": "1"}]),
        (2, {"instructions": "rules"}, [{"role": "user", "content": "2"}]),
        (5, {"input": "hi"}, None),
        (6, {}, None),
        (7, {"instructions": {"sha256": "ab12"}}, [{"role": "user", "content": "7"}]),
        (8, {"instructions": {"sha256": "ab12"}}, [{"role": "user", "content": "8"}]),
    ]
    assert all(r["path"] == "/v1/responses" and "messages" not in r for r in rebuilt)
