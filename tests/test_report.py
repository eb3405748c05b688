import dataclasses
import tracemalloc
import unicodedata
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.errors import SHUTTING_DOWN
from proxy.eventlog import NotALogFile
from proxy.report import (
    RESENT_COMPACTED,
    CostReport,
    list_sessions,
    render_cost,
    render_list,
    render_show,
    replay_lines,
    session_cost,
    show_session,
    terminal_safe,
)
from tests.e2e_support import run_cli

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC


def req(
    ts, ex, model="gpt-4o", base_exchange=None, base=0, appended=(), repairs=(), transforms=None
):
    return {
        "ts": ts,
        "type": "request",
        "exchange": ex,
        "model": model,
        "stream": True,
        "path": "/v1/chat/completions",
        "base_exchange": base_exchange,
        "base": base,
        "appended": list(appended),
        "repairs": list(repairs),
        "transforms": transforms or {},
        "bytes": 100,
    }


def resp(
    ts,
    ex,
    *,
    prompt,
    completion,
    cache_read,
    ttfb,
    duration,
    waste=0,
    cause=None,
    location=None,
    actual,
    uncached,
    interrupted=False,
    status=200,
):
    return {
        "ts": ts,
        "type": "response",
        "exchange": ex,
        "status": status,
        "message": {"role": "assistant", "content": "ok"},
        "finish_reason": "stop",
        "usage": {
            "prompt": prompt,
            "completion": completion,
            "cache_read": cache_read,
            "cache_write": 0,
            "reported_cache": True,
        },
        "ttfb_s": ttfb,
        "duration_s": duration,
        "interrupted": interrupted,
        "error": None,
        "cache": {
            "expected": cache_read + waste,
            "read": cache_read,
            "write": 0,
            "waste": waste,
            "cause": cause,
            "location": location,
        },
        "cost": {"actual": actual, "uncached": uncached},
    }


SYS = {"role": "system", "content": "be brief"}
U1 = {"role": "user", "content": "hi"}
A1 = {"role": "assistant", "content": "ok"}
U2 = {"role": "user", "content": "more"}
REPAIR = {"kind": "dangling_call", "index": 2, "tool_call_id": "call_1", "action": "synthesized"}

ALPHA = [
    {
        "ts": T0 - 0.5,
        "type": "session_meta",
        "session": "alpha",
        "created": "2023-11-14T22:13:19Z",
        "model": "gpt-4o",
        "upstream": "https://api.openai.com/v1",
        "user_agent": "agent/1.0",
        "version": "0.1.0",
    },
    req(T0, 1, appended=[SYS, U1], repairs=[REPAIR]),
    resp(
        T0 + 2.25,
        1,
        prompt=10000,
        completion=500,
        cache_read=0,
        ttfb=0.5,
        duration=2.25,
        actual=0.25,
        uncached=0.25,
    ),
    req(T0 + 60, 2, base_exchange=1, base=2, appended=[A1, U2], repairs=[REPAIR, REPAIR]),
    {"ts": T0 + 60.5, "type": "from_a_later_version", "exchange": 2},
    resp(
        T0 + 63,
        2,
        prompt=12000,
        completion=300,
        cache_read=8000,
        ttfb=0.25,
        duration=3.0,
        waste=2048,
        cause="prefix_rewrite",
        location="messages[3]",
        actual=0.125,
        uncached=0.375,
    ),
    {
        "ts": T0 + 700,
        "type": "compacted",
        "exchange": 3,
        "covered": 3,
        "summary": "s",
        "tokens_before": 12000,
        "tokens_after": 4000,
        "source": "model",
    },
    req(T0 + 700, 3, base_exchange=2, base=1, appended=[{"role": "user", "content": "summary"}]),
    resp(
        T0 + 703,
        3,
        prompt=4000,
        completion=100,
        cache_read=0,
        ttfb=1.0,
        duration=3.0,
        waste=4000,
        cause="ttl_expired",
        actual=0.0625,
        uncached=0.0625,
        interrupted=True,
    ),
]

BETA = [
    # two lines cachegate could not write (a full disk) before this one, one a request's
    {"ts": T0 + 999, "type": "lines_lost", "lines": 2, "requests": 1},
    req(T0 + 1000, 1, model="gpt-4o-mini", appended=[U1]),
    {
        "ts": T0 + 1001,
        "type": "error",
        "exchange": 1,
        "status": 502,
        "message": "upstream unreachable: connection refused",
    },
]


def write_logs(log_dir: Path) -> None:
    log_dir.mkdir(exist_ok=True)
    (log_dir / "alpha.jsonl").write_bytes(
        b"".join(orjson.dumps(e) + b"\n" for e in ALPHA) + b'{"ts": 1700000704.0, "type": "resp'
    )
    (log_dir / "beta.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in BETA))
    (log_dir / "notes.txt").write_text("not a log")
    (log_dir / "bad id.jsonl").write_text("{}\n")


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    write_logs(tmp_path / "logs")
    return tmp_path / "logs"


def test_list_sessions_summarizes_every_log_most_recent_first(log_dir: Path) -> None:
    beta, alpha = list_sessions(log_dir)
    assert alpha.to_json() == {
        "session": "alpha",
        "first_seen": T0 - 0.5,
        "last_seen": T0 + 703,
        "model": "gpt-4o",
        "exchanges": 3,
        "tokens_in": 26000,
        "tokens_out": 900,
        "cache_read": 8000,
        "cache_hit_pct": pytest.approx(100 * 8000 / 26000),
        "interruptions": 1,
        "repairs": 3,
        "errors": 0,
        "torn": 1,
        "lost": 0,
    }
    assert (beta.session, beta.exchanges, beta.errors, beta.cache_hit_pct) == ("beta", 1, 1, None)
    assert beta.lost == 2
    assert beta.model == "gpt-4o-mini"  # no session_meta: taken from the requests
    # no response reported usage: unknown, not 0 (as ``sessions show`` prints it)
    assert (beta.tokens_in, beta.tokens_out, beta.cache_read) == (None, None, None)


def test_files_that_are_not_cachegates_logs_are_no_sessions(log_dir: Path) -> None:
    """Another tool's JSONL, an empty file or random bytes named ``*.jsonl`` each got a row
    (415 torn lines, a first seen of 1970)."""
    (log_dir / "other.jsonl").write_text('{"level": "info", "msg": "started"}\n')
    (log_dir / "empty.jsonl").write_bytes(b"")
    (log_dir / "noise.jsonl").write_bytes(bytes(range(256)) * 8)
    assert [s.session for s in list_sessions(log_dir)] == ["beta", "alpha"]


def test_one_unreadable_file_is_named_and_the_others_are_listed(
    log_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log directory shared with a container's user: one file we may not read made ``list``
    print nothing at all."""
    from proxy import report

    real = report.read_events

    def guarded(path: Any, **kw: Any) -> Any:  # root reads anything: the refusal is simulated
        if str(path).endswith("alpha.jsonl"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, **kw)

    monkeypatch.setattr(report, "read_events", guarded)
    unreadable: list[tuple[str, str]] = []
    assert [s.session for s in list_sessions(log_dir, unreadable)] == ["beta"]
    assert unreadable == [(str(log_dir / "alpha.jsonl"), "permission denied")]
    with pytest.raises(PermissionError):  # with no list to name it in
        list_sessions(log_dir)


def test_render_list(log_dir: Path) -> None:
    assert render_list(list_sessions(log_dir)) == "\n".join(
        [
            "SESSION  FIRST SEEN           LAST SEEN            MODEL        EXCH      IN  OUT"
            "  CACHE HIT  INTERRUPTED  REPAIRS  ERRORS  TORN  LOST",
            "beta     2023-11-14 22:30:00  2023-11-14 22:30:01  gpt-4o-mini     1       -    -"
            "          -            0        0       1     0     2",
            "alpha    2023-11-14 22:13:19  2023-11-14 22:25:03  gpt-4o          3  26,000  900"
            "      30.8%            1        3       0     1     0",
        ]
    )
    assert render_list([]) == "no sessions"


def test_show_session_has_one_row_per_exchange(log_dir: Path) -> None:
    detail = show_session(log_dir, "alpha")
    assert detail.torn == 1
    assert [r.exchange for r in detail.rows] == [1, 2, 3]
    second, third = detail.rows[1], detail.rows[2]
    assert (second.tokens_in, second.cache_read, second.cache_waste) == (12000, 8000, 2048)
    assert (second.waste_cause, second.waste_location, second.repairs) == (
        "prefix_rewrite",
        "messages[3]",
        2,
    )
    assert (third.ts, third.compacted, third.interrupted, third.status) == (
        T0 + 700,
        True,
        True,
        200,
    )
    assert (third.ttfb_s, third.duration_s) == (1.0, 3.0)
    assert (
        orjson.loads(orjson.dumps(detail.to_json()))["exchanges"][2]["waste_cause"] == "ttl_expired"
    )
    # what was repaired, for --json
    assert orjson.loads(orjson.dumps(detail.to_json()))["exchanges"][0]["repaired"] == [REPAIR]
    assert second.repaired == [REPAIR, REPAIR] and third.repaired == []


def test_show_lists_each_new_repair_where_it_was_made(tmp_path: Path) -> None:
    """Two defects in one request, then one more two turns later: NOTES names each where it
    was first repaired, and counts those repaired again."""
    cut = {"kind": "invalid_arguments", "index": 4, "tool_call_id": "call_b", "action": "closed"}
    # a client that numbers its calls per message: the same id, another interrupted turn
    later = {**REPAIR, "index": 9}
    empties = [
        {"kind": "empty_tool_calls", "index": i, "tool_call_id": None, "action": "dropped"}
        for i in (11, 13, 15, 17)
    ]
    odd = {"kind": "orphan_result\n", "index": "x", "tool_call_id": None, "action": "kept"}
    path = tmp_path / "rep.jsonl"
    lines = [
        req(T0, 1, repairs=[REPAIR, cut]),
        req(T0 + 1, 2, repairs=[REPAIR, cut]),
        req(T0 + 2, 3, repairs=[REPAIR, cut, odd, "junk"]),
        req(T0 + 3, 4, repairs=[REPAIR, cut, later]),
        req(T0 + 4, 5, repairs=[REPAIR, cut, later, *empties]),
        # the client trimmed its oldest turn: the same repairs, one message earlier each
        req(T0 + 5, 6, repairs=[{**r, "index": r["index"] - 1} for r in (REPAIR, cut, later)]),
    ]
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    rows = render_show(show_session(tmp_path, "rep")).splitlines()[2:]
    # (no response lines: each row also says so)
    assert rows[0].endswith(
        "  repaired dangling_call at messages[2] (call_1), invalid_arguments at messages[4]"
        " (call_b), no response logged"
    )
    assert rows[1].endswith("  2 repaired again, no response logged")
    assert rows[2].endswith("  repaired orphan_result (+2 again), no response logged")
    assert rows[3].endswith(
        "  repaired dangling_call at messages[9] (call_1) (+2 again), no response logged"
    )
    assert rows[4].endswith(
        "  repaired empty_tool_calls at messages[11], empty_tool_calls at messages[13],"
        " empty_tool_calls at messages[15] and 1 more (+3 again), no response logged"
    )
    assert rows[5].endswith("  3 repaired again, no response logged")


def test_new_repairs_are_named_in_message_order(tmp_path: Path) -> None:
    def dangling(index: int, call: str) -> dict[str, Any]:
        return {"kind": "dangling_call", "index": index, "tool_call_id": call, "action": "x"}

    path = tmp_path / "order.jsonl"
    lines = [
        req(T0, 1, repairs=[dangling(2, "call_0")]),
        req(
            T0 + 1, 2, repairs=[dangling(2, "call_0"), dangling(5, "call_x"), dangling(9, "call_0")]
        ),
    ]
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    rows = render_show(show_session(tmp_path, "order")).splitlines()[2:]
    assert rows[1].endswith(
        "  repaired dangling_call at messages[5] (call_x), dangling_call at messages[9] (call_0)"
        " (+1 again), no response logged"
    )


def test_render_show(log_dir: Path) -> None:
    assert render_show(show_session(log_dir, "alpha")) == "\n".join(
        [
            "session alpha  model gpt-4o  upstream https://api.openai.com/v1"
            "  created 2023-11-14T22:13:19Z  cachegate 0.1.0",
            "#  TIME                 MODEL       IN  OUT  CACHED  WASTE                          "
            "   REPAIRS   TTFB  DURATION  STATUS  NOTES",
            "1  2023-11-14 22:13:20  gpt-4o  10,000  500       0  0                              "
            "         1  0.50s     2.25s     200  repaired dangling_call at messages[2] (call_1)",
            # (the interrupted turn is still in the history: repaired again, not listed again)
            "2  2023-11-14 22:14:20  gpt-4o  12,000  300   8,000  2,048 prefix_rewrite@messages[3]"
            "        2  0.25s     3.00s     200  2 repaired again",
            "3  2023-11-14 22:25:00  gpt-4o   4,000  100       0  4,000 ttl_expired              "
            "         0  1.00s     3.00s     200  compacted, interrupted",
            "1 torn line skipped",
        ]
    )


def test_render_show_of_a_failed_exchange(log_dir: Path) -> None:
    assert render_show(show_session(log_dir, "beta")) == "\n".join(
        [
            "session beta  model gpt-4o-mini",  # (no meta line: the model its exchange named)
            "#  TIME                 MODEL        IN  OUT  CACHED  WASTE  REPAIRS  TTFB  DURATION"
            "  STATUS  NOTES",
            "1  2023-11-14 22:30:00  gpt-4o-mini   -    -       -  -            0     -         -"
            "     502  upstream unreachable: connection refused",
            "2 lines of this session could not be written (a full disk, a write error, a full"
            " queue: cachegate's log and cachegate_event_log_lost_total say which); exchanges may"
            " be missing from this view",
        ]
    )


def test_lines_the_log_lost_are_told_by_show_cost_and_replay(log_dir: Path) -> None:
    """A full disk took lines of a session: cachegate knew (its stderr, a metric) but the
    session's file had no trace, and ``replay`` printed the rest as the whole session."""
    cost = session_cost(log_dir, "beta")
    assert cost.lost == 2 and cost.to_json()["lost"] == 2
    assert "lines lost" in render_cost(cost) and "lines lost" not in render_cost(
        session_cost(log_dir, "alpha")
    )
    assert show_session(log_dir, "beta").to_json()["lost"] == 2
    result = run_cli("sessions", "replay", "beta", "--log-dir", str(log_dir))
    assert result.code == 1
    assert "1 request line of this session could not be written" in result.err
    assert len(result.out.splitlines()) == 1  # what the log holds is still printed
    # Response lines lost lose no request: replay is whole (show and cost still say it).
    path = log_dir / "beta.jsonl"
    path.write_text(path.read_text().replace('"requests":1', '"requests":0'))
    result = run_cli("sessions", "replay", "beta", "--log-dir", str(log_dir))
    assert (result.code, result.err) == (0, "")
    assert show_session(log_dir, "beta").lost == 2


def _compacted(ts: float, ex: int, retry: bool) -> dict[str, Any]:
    return {
        "ts": ts,
        "type": "compacted",
        "exchange": ex,
        "covered": 3,
        "summary": "s",
        "tokens_before": 9000,
        "tokens_after": 2000,
        "source": "model",
        "retry": retry,
    }


def _logged(tmp_path: Path, sid: str, events: list[dict[str, Any]]) -> Path:
    (tmp_path / f"{sid}.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    return tmp_path


def _rows(tmp_path: Path, sid: str, events: list[dict[str, Any]]) -> list[Any]:
    return show_session(_logged(tmp_path, sid, events), sid).rows


def test_an_exchange_whose_main_call_reported_no_usage_is_not_priced_by_its_summary_call(
    tmp_path: Path,
) -> None:
    """A provider that reports no usage in streams, and a compaction whose summary call did:
    ``cost`` said "priced exchanges 1" beside "1 exchanges reported no usage" for the same
    exchange, the summary call's dollars taken for its main call's."""
    answered = resp(
        T0 + 2, 1, prompt=0, completion=0, cache_read=0, ttfb=0.1, duration=1, actual=0.004,
        uncached=0.004,
    )  # fmt: skip
    answered["usage"] = None
    answered["summary"] = {
        "model": "gpt-4o",
        "usage": {"prompt": 1451, "completion": 32, "cache_read": 0, "cache_write": 0},
        "cost": {"actual": 0.004, "uncached": 0.004},
    }
    events = [req(T0, 1), _compacted(T0 + 1, 1, retry=False), answered]
    cost = session_cost(_logged(tmp_path, "s", events), "s")
    assert (cost.priced_exchanges, cost.no_usage) == (0, 1)
    assert cost.actual == pytest.approx(0.004)  # (the summary call's dollars are counted)
    assert cost.unpriced == {} and cost.unpriced_summaries == {}
    # a main call with its own usage beside its summary call's is priced, once
    answered["usage"] = {"prompt": 900, "completion": 10, "cache_read": 0, "cache_write": 0}
    answered["cost"] = {"actual": 0.0065, "uncached": 0.0065}
    cost = session_cost(_logged(tmp_path, "s", events), "s")
    assert (cost.priced_exchanges, cost.no_usage) == (1, 0)
    # ...and so is one that reported a usage of 0 tokens (it was counted nowhere)
    answered["usage"] = {"prompt": 0, "completion": 0, "cache_read": 0, "cache_write": 0}
    answered["cost"] = {"actual": 0.004, "uncached": 0.004}
    cost = session_cost(_logged(tmp_path, "s", events), "s")
    assert (cost.priced_exchanges, cost.no_usage, cost.unpriced) == (1, 0, {})


def _answer(
    ts: float, prompt: int, completion: int, duration: float, cost: float, exchange: int = 1
) -> dict[str, Any]:
    """A response line, ``duration`` after its exchange began."""
    return resp(
        ts,
        exchange,
        prompt=prompt,
        completion=completion,
        cache_read=0,
        ttfb=duration - 0.1,
        duration=duration,
        actual=cost,
        uncached=cost,
    )


def test_a_complete_answer_without_usage_says_so(tmp_path: Path) -> None:
    """A provider that ignores ``stream_options`` leaves IN/OUT blank; the row says why."""
    bare = {**_answer(T0 + 1, 1, 1, duration=0.2, cost=0), "usage": None}
    bare.pop("cache")
    bare.pop("cost", None)
    cut = {**bare, "exchange": 2, "interrupted": True}
    failed = {**bare, "exchange": 3, "error": "upstream broke off mid-response"}
    events = [req(T0, 1, appended=[U1]), bare, req(T0 + 2, 2, appended=[U1]), cut]
    events += [req(T0 + 3, 3, appended=[U1]), failed]
    rows = render_show(show_session(_logged(tmp_path, "quiet", events), "quiet")).splitlines()[2:]
    assert rows[0].endswith("200  no usage reported")
    assert rows[1].endswith("200  interrupted")
    assert rows[2].endswith("200  upstream broke off mid-response")


def test_a_session_is_listed_by_the_model_most_of_it_asked_for(tmp_path: Path) -> None:
    """A coding agent opens with a title request on a small model: the session was listed as
    gpt-4o-mini, the meta line's (its first request's), for 46 exchanges on gpt-4o."""
    meta = {"ts": T0, "type": "session_meta", "session": "titled", "model": "gpt-4o-mini"}
    events: list[dict[str, Any]] = [meta, req(T0, 1, model="gpt-4o-mini", appended=[U1])]
    events.append(_answer(T0 + 0.5, 50, 5, duration=0.2, cost=0))
    for n in range(2, 5):
        events += [req(T0 + n, n, appended=[U1]), _answer(T0 + n + 0.5, 900, 9, 0.2, 0, n)]
    (summary,) = list_sessions(_logged(tmp_path, "titled", events))
    assert summary.model == "gpt-4o"
    detail = show_session(tmp_path, "titled")
    head = render_show(detail).splitlines()[0]
    assert "model gpt-4o " in head + " "  # the show header names the same one
    shown = detail.to_json()  # and so does `show --json`, which had the meta line's alone
    assert shown["model"] == "gpt-4o" and shown["meta"]["model"] == "gpt-4o-mini"


def test_a_provider_that_reports_no_cache_fields_shows_unknown_not_zero(tmp_path: Path) -> None:
    """vLLM, llama.cpp, Mistral: CACHED and WASTE read "0  0", like a measured full miss."""
    silent = _answer(T0 + 1, 900, 10, duration=0.2, cost=0)
    silent["usage"]["reported_cache"] = False
    measured = _answer(T0 + 3, 900, 10, duration=0.2, cost=0, exchange=2)
    events = [req(T0, 1, appended=[U1]), silent, req(T0 + 2, 2, appended=[U1]), measured]
    rows = render_show(show_session(_logged(tmp_path, "vllm", events), "vllm")).splitlines()[2:]
    assert rows[0].split()[6:8] == ["-", "-"]  # CACHED, WASTE (after #, date, time, model, in, out)
    assert rows[1].split()[6:8] == ["0", "0"]


def test_a_request_with_no_response_line_says_so(tmp_path: Path) -> None:
    """cachegate killed mid-stream (or the answer still in flight): the row was all dashes."""
    events = [req(T0, 1, appended=[U1]), _answer(T0 + 1, 1, 1, duration=0.2, cost=0)]
    events += [req(T0 + 2, 2, appended=[U1])]
    rows = render_show(show_session(_logged(tmp_path, "killed", events), "killed")).splitlines()
    assert rows[-1].endswith("-  no response logged")
    assert "no response logged" not in rows[-2]


def test_a_client_that_left_is_an_interruption_not_an_error_whenever_it_left(
    tmp_path: Path,
) -> None:
    """Ctrl+C before the provider's headers is logged 499, after them 200 and interrupted: the
    same act, so neither counts in ERRORS; both count in INTERRUPTED. So too an exchange cut by
    cachegate stopping."""
    early = {**_answer(T0 + 1, 1, 1, duration=0.2, cost=0), "usage": None, "status": 499}
    early.update(interrupted=True, error="client disconnected before the response started")
    late = {**_answer(T0 + 3, 1, 1, duration=0.2, cost=0, exchange=2), "interrupted": True}
    failed = {**_answer(T0 + 5, 1, 1, duration=0.2, cost=0, exchange=3), "status": 500}
    events = [req(T0, 1, appended=[U1]), early, req(T0 + 2, 2, appended=[U1]), late]
    events += [req(T0 + 4, 3, appended=[U1]), failed]
    # ... and one that left while its request was being prepared (a compaction's summary call):
    # an "error" line, cachegate's own answer
    gone = {"ts": T0 + 7, "type": "error", "exchange": 4, "model": "gpt-4o", "status": 499}
    gone["forwarded"] = False
    events += [{**gone, "message": "client disconnected"}]  # (never forwarded: no request line)
    # ... and two cut by cachegate stopping: a stream its grace period cut (200, its error
    # said), and a request not yet answered (503): INTERRUPTED alone (they counted in both)
    stopped = {**_answer(T0 + 9, 1, 1, duration=0.2, cost=0, exchange=5), "interrupted": True}
    stopped["error"] = "cut: cachegate stopped before the response was complete"
    unanswered = {**_answer(T0 + 11, 1, 1, duration=0.2, cost=0, exchange=6), "status": 503}
    unanswered.update(usage=None, interrupted=True, error="cachegate is shutting down")
    events += [req(T0 + 8, 5, appended=[U1]), stopped, req(T0 + 10, 6, appended=[U1])]
    events += [unanswered]
    # ... and a provider's error mid-stream, after which the client hung up: still an error
    failed_then_left = {**_answer(T0 + 13, 1, 1, duration=0.2, cost=0, exchange=7)}
    failed_then_left.update(interrupted=True, error="Provider returned error: overloaded")
    events += [req(T0 + 12, 7, appended=[U1]), failed_then_left]
    # ... and one whose upload cachegate's stop cut: its "error" line, never forwarded
    upload = {"ts": T0 + 15, "type": "error", "exchange": 8, "model": None, "status": 503}
    upload.update(forwarded=False, message="cachegate is shutting down and stopped this request")
    events += [upload]
    (summary,) = list_sessions(_logged(tmp_path, "cut", events))
    assert (summary.exchanges, summary.interruptions, summary.errors) == (8, 7, 2)
    rows = render_show(show_session(tmp_path, "cut")).splitlines()
    assert rows[-5].endswith("499  interrupted, client disconnected")
    assert rows[-5].split()[3] == "gpt-4o"  # the model it asked for (was "-")
    assert rows[-3].endswith("503  interrupted, cachegate is shutting down")


def test_a_model_name_with_line_breaks_cannot_forge_a_row(tmp_path: Path) -> None:
    forged = "gpt-4o\nfake-session  2026-01-01 00:00:00  gpt-4o  99\tx" + "y" * 200
    meta = {"ts": T0, "type": "session_meta", "session": "odd", "model": forged}
    events = [meta, req(T0, 1, model=forged, appended=[U1])]
    events.append(_answer(T0 + 1, 10, 1, duration=0.2, cost=0))
    _logged(tmp_path, "odd", events)
    for text in (render_show(show_session(tmp_path, "odd")), render_list(list_sessions(tmp_path))):
        lines = text.splitlines()
        assert not any(line.startswith("fake-session") for line in lines)
        assert "gpt-4o\ufffdfake-session" in text and "\t" not in text
        assert max(len(line) for line in lines) < 250  # the name is clipped, not 200+ wide


@pytest.mark.parametrize("slow_first", [False, True])
def test_two_requests_under_one_number_each_get_their_own_response(
    tmp_path: Path, slow_first: bool
) -> None:
    """A session forgotten while a request was in flight numbers from 1 again: each response
    goes to the request its exchange began with, whichever finishes first."""
    slow = _answer(T0 + 2.0, 17, 17, duration=2.0, cost=0.2)
    fast = _answer(T0 + 0.6, 11, 11, duration=0.1, cost=0.1)
    events = [req(T0, 1, appended=[U1]), req(T0 + 0.5, 1, appended=[U2])]
    events += [slow, fast] if slow_first else [fast, slow]
    rows = _rows(tmp_path, "again", events)
    assert [(r.tokens_in, r.duration_s) for r in rows] == [(17, 2.0), (11, 0.1)]
    assert session_cost(tmp_path, "again").priced_exchanges == 2
    (listed,) = list_sessions(tmp_path)
    assert listed.tokens_in == 28


def test_an_answer_whose_request_line_was_lost_is_a_row_of_its_own(tmp_path: Path) -> None:
    """Exchange 1 answered; the session forgotten and back (numbered from 1 again), its first
    request's line lost (a full disk) and its answer written: that answer overwrote the first
    run's row (its tokens, cost and time gone from show and cost)."""
    first = _answer(T0 + 1, 40_016, 5, duration=0.5, cost=0.05)
    again = _answer(T0 + 9, 20_015, 5, duration=0.3, cost=0.025)
    lost = {"ts": T0 + 8, "type": "lines_lost", "lines": 1, "requests": 1}
    rows = _rows(tmp_path, "twice", [req(T0, 1, appended=[U1]), first, lost, again])
    assert [(r.exchange, r.tokens_in, r.cost_actual) for r in rows] == [
        (1, 40_016, 0.05),
        (1, 20_015, 0.025),
    ]
    assert session_cost(tmp_path, "twice").actual == pytest.approx(0.075)


def test_a_compacted_or_refused_request_under_a_waiting_number_is_a_row_of_its_own(
    tmp_path: Path,
) -> None:
    """A waits; its session is forgotten; B comes under the same number, compacted (not a
    retry of A's) or refused by cachegate itself: each keeps its own answer."""
    slow = _answer(T0 + 4.0, 6, 6, duration=4.0, cost=0.1)
    fast = _answer(T0 + 2.5, 240, 16, duration=0.5, cost=0.2)
    compacted = [req(T0, 1, appended=[U1]), _compacted(T0 + 2.0, 1, retry=False)]
    compacted += [req(T0 + 2.0, 1, appended=[U2], transforms={"compacted": {}}), fast, slow]
    rows = _rows(tmp_path, "both", compacted)
    assert [(r.tokens_in, r.error, r.compacted) for r in rows] == [
        (6, None, False),
        (240, None, True),
    ]
    refused = {
        "ts": T0 + 2.0,
        "type": "error",
        "exchange": 1,
        "status": 400,
        "message": "strict pairing",
        "forwarded": False,
    }
    rows = _rows(tmp_path, "refused", [req(T0, 1, appended=[U1]), refused, slow])
    assert [(r.status, r.tokens_in, r.error) for r in rows] == [
        (200, 6, None),
        (400, None, "strict pairing"),
    ]


def test_a_retried_request_is_matched_by_when_its_exchange_began(tmp_path: Path) -> None:
    """A crashed process left #2 waiting; the new one's #2 was refused as too long and re-sent
    compacted 30 s later: its answer began with the refused attempt, not the crashed one."""
    events = [req(T0 + 95, 2, appended=[U1]), req(T0 + 100, 2, appended=[U2])]
    events += [_compacted(T0 + 130, 2, retry=True)]
    events += [req(T0 + 130, 2, appended=[U2], transforms={"compacted": {}})]
    events += [_answer(T0 + 140, 5000, 9, duration=40.0, cost=0.3, exchange=2)]
    rows = _rows(tmp_path, "crash", events)
    assert [(r.tokens_in, r.error) for r in rows] == [
        (None, None),  # the crashed process's: never answered
        (None, RESENT_COMPACTED),
        (5000, None),
    ]
    shown = render_show(show_session(tmp_path, "crash"))
    assert shown.splitlines()[3].endswith(RESENT_COMPACTED)  # cachegate's own note, whole


def test_a_request_resent_compacted_does_not_count_its_repairs_again(tmp_path: Path) -> None:
    """The provider refused #1 as too long; it went again compacted, with the same repairs: one
    exchange, repaired once (its second row read "1 repaired again"). The next request repeats
    them: again, as usual."""
    events = [req(T0, 1, appended=[U1], repairs=[REPAIR]), _compacted(T0 + 1, 1, retry=True)]
    events += [req(T0 + 1, 1, appended=[U2], repairs=[REPAIR], transforms={"compacted": {}})]
    events += [_answer(T0 + 2, 900, 9, duration=2.0, cost=0.3)]
    events += [req(T0 + 3, 2, appended=[U2], repairs=[REPAIR])]
    events += [_answer(T0 + 4, 950, 9, duration=1.0, cost=0.3, exchange=2)]
    path = tmp_path / "resent.jsonl"
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in events))
    rows = render_show(show_session(tmp_path, "resent")).splitlines()[2:]
    assert rows[0].endswith("  repaired dangling_call at messages[2] (call_1), " + RESENT_COMPACTED)
    assert rows[1].endswith("  200  compacted")
    assert rows[2].endswith("  200  1 repaired again")


def test_a_request_sent_again_without_the_usage_option_is_one_row(tmp_path: Path) -> None:
    """The upstream refused the stream_options cachegate added: the request went again without
    it, one more line of the exchange, in either order with a compaction after a refusal as too
    long (a third line made a row that never got its answer, and the answer went to the
    attempt refused)."""
    resent = {"usage_not_asked": "Extra inputs are not permitted"}
    plain = [req(T0, 1, appended=[U1]), req(T0 + 0.1, 1, appended=[U1], transforms=resent)]
    plain += [_answer(T0 + 1, 700, 7, duration=1.0, cost=0.1)]
    assert [(r.tokens_in, r.error) for r in _rows(tmp_path, "plain", plain)] == [(700, None)]
    both = [req(T0, 1, appended=[U1]), _compacted(T0 + 1, 1, retry=True)]
    both += [req(T0 + 1, 1, appended=[U2], transforms={"compacted": {}})]
    both += [req(T0 + 1.1, 1, appended=[U2], transforms={"compacted": {}, **resent})]
    both += [_answer(T0 + 2, 900, 9, duration=2.0, cost=0.3)]
    rows = _rows(tmp_path, "both", both)
    assert [(r.tokens_in, r.error, r.compacted) for r in rows] == [
        (None, RESENT_COMPACTED, False),
        (900, None, True),
    ]


def test_a_retry_row_follows_the_attempt_it_resent(tmp_path: Path) -> None:
    """Requests in flight together: #2 was refused and re-sent compacted while #3 went and came
    back; the retry's row came after #3's, and read as #3's retry."""
    events = [req(T0, 2, appended=[U1]), req(T0 + 1, 3, appended=[U2])]
    events += [_answer(T0 + 2, 100, 5, duration=1.0, cost=0.1, exchange=3)]
    events += [_compacted(T0 + 3, 2, retry=True)]
    events += [req(T0 + 3, 2, appended=[U2], transforms={"compacted": {}})]
    events += [_answer(T0 + 4, 900, 9, duration=4.0, cost=0.3, exchange=2)]
    rows = _rows(tmp_path, "interleaved", events)
    assert [(r.exchange, r.tokens_in, r.error) for r in rows] == [
        (2, None, RESENT_COMPACTED),
        (2, 900, None),
        (3, 100, None),
    ]


def test_session_cost_prices_the_waste_by_cause(tmp_path: Path) -> None:
    """Responses that carry what their waste cost: ``cost`` sums it, overall and by cause; one
    row of an older log without it leaves the dollars unknown rather than short."""

    def priced(ts: float, ex: int, waste: int, cause: str, usd: float, **more: Any) -> Any:
        event = resp(
            ts, ex, prompt=9000, completion=10, cache_read=1000, ttfb=0.1, duration=0.2,
            waste=waste, cause=cause, actual=0.02, uncached=0.03,
        )  # fmt: skip
        event["cache"]["waste_usd"] = usd
        event["cache"].update(more)
        return event

    events = [
        req(T0, 1), priced(T0 + 1, 1, 4000, "ttl_expired", 0.005),
        req(T0 + 2, 2), priced(T0 + 3, 2, 2000, "prefix_rewrite", 0.0025,
                               not_requested=1000, not_requested_usd=0.00125),
        req(T0 + 4, 3), priced(T0 + 5, 3, 1000, "ttl_expired", 0.00125),
    ]  # fmt: skip
    _logged(tmp_path, "usd", events)
    report = session_cost(tmp_path, "usd")
    assert report.waste_tokens == 8000
    assert report.waste_usd == pytest.approx(0.01)
    assert report.waste_usd_by_cause == pytest.approx(
        {"ttl_expired": 0.00625, "prefix_rewrite": 0.0025, "not_requested": 0.00125}
    )
    text = render_cost(report)
    assert "wasted cache tokens  8,000 ($0.0100)" in text
    assert "  ttl_expired        5,000 ($0.0063)" in text
    assert "  not_requested      1,000 ($0.0013)" in text
    assert report.to_json()["waste_usd_by_cause"]["prefix_rewrite"] == 0.0025
    # an older line with no price of its waste: the dollars are not summed short
    del events[-1]["cache"]["waste_usd"]
    _logged(tmp_path, "usd", events)
    older = session_cost(tmp_path, "usd")
    assert (older.waste_tokens, older.waste_usd, older.waste_usd_by_cause) == (8000, None, {})
    assert "wasted cache tokens  8,000\n" in render_cost(older)


def test_a_priced_row_with_no_waste_wasted_nothing_not_an_unknown(tmp_path: Path) -> None:
    """``show --json``: a row of a priced model that wasted nothing read ``waste_usd: null``, as
    one whose waste has no price; it is $0."""
    events = [
        req(T0, 1),
        resp(T0 + 1, 1, prompt=900, completion=10, cache_read=0, ttfb=0.1, duration=0.2,
             actual=0.02, uncached=0.03),
        req(T0 + 2, 2),
        resp(T0 + 3, 2, prompt=900, completion=10, cache_read=0, ttfb=0.1, duration=0.2,
             actual=0.0, uncached=0.0),
    ]  # fmt: skip
    rows = _rows(tmp_path, "zero-waste", events)
    assert [row.waste_usd for row in rows] == [0.0, None]  # (the second is unpriced)


def test_session_cost(log_dir: Path) -> None:
    report = session_cost(log_dir, "alpha")
    assert report == CostReport(
        session="alpha",
        actual=0.4375,
        uncached=0.6875,
        saved=0.25,
        priced_exchanges=3,
        waste_tokens=6048,
        waste_by_cause={"ttl_expired": 4000, "prefix_rewrite": 2048},
        torn=1,
    )
    assert report.to_json()["saved_pct"] == pytest.approx(100 * 0.25 / 0.6875)
    # --json amounts without a float sum's noise (0.0031669999999999997)
    noisy = dataclasses.replace(report, actual=0.0011 + 0.002, saved=0.1 + 0.2)
    assert (repr(noisy.actual), repr(noisy.saved)) == (
        "0.0031000000000000003",
        "0.30000000000000004",
    )
    assert (noisy.to_json()["actual"], noisy.to_json()["saved"]) == (0.0031, 0.3)
    assert render_cost(report) == "\n".join(
        [
            "session              alpha",
            "priced exchanges     3",
            "actual cost          $0.4375",
            "without cache        $0.6875",
            "saved by cache       $0.2500 (36.4%)",
            "wasted cache tokens  6,048",
            "  ttl_expired        4,000",
            "  prefix_rewrite     2,048",
            "torn lines skipped   1",
        ]
    )


def test_cost_of_a_session_without_prices(log_dir: Path) -> None:
    report = session_cost(log_dir, "beta")
    assert (report.actual, report.uncached, report.priced_exchanges, report.saved_pct) == (
        0.0,
        0.0,
        0,
        None,
    )
    assert "saved by cache       $0.0000\n" in render_cost(report)


def test_cost_says_which_models_had_no_prices(tmp_path: Path) -> None:
    """An unpriced model's exchanges are logged with a $0 cost: ``cost`` printed $0.0000 and
    "priced exchanges 2" with no word of why."""
    usage = {"prompt": 1000, "completion": 50, "cache_read": 0, "cache_write": 0}
    events = [
        {"ts": T0, "type": "session_meta", "session": "free"},
        *(
            event
            for n, model, cost in (
                (1, "my-local-model", {"actual": 0.0, "uncached": 0.0}),
                (2, "my-local-model", {"actual": 0.0, "uncached": 0.0}),
                (3, "gpt-4o", {"actual": 0.003, "uncached": 0.003}),
            )
            for event in (
                {"ts": T0 + n, "type": "request", "exchange": n, "model": model},
                {
                    "ts": T0 + n,
                    "type": "response",
                    "exchange": n,
                    "status": 200,
                    "usage": usage,
                    "cost": cost,
                },
            )
        ),
    ]
    _logged(tmp_path, "free", events)
    report = session_cost(tmp_path, "free")
    assert report.priced_exchanges == 1 and report.unpriced == {"my-local-model": 2}
    assert "priced exchanges     1\n" in render_cost(report)
    assert render_cost(report).endswith(
        "\n2 exchanges on my-local-model counted as $0: its prices are 0 (unless it is free, "
        "set price_input and price_output in its [models] table)"
    )
    assert report.to_json()["unpriced"] == {"my-local-model": 2}


def test_cost_says_how_many_exchanges_reported_no_usage(tmp_path: Path) -> None:
    """Answers cut before their usage (a stream, a client that left) add nothing to the total,
    though the provider usually billed them: ``cost`` said nothing of them. Refusals (an upstream
    error, a request cachegate answered itself) are not among them."""
    usage = {"prompt": 1000, "completion": 50, "cache_read": 0, "cache_write": 0}
    priced = {"actual": 0.003, "uncached": 0.003}
    answers: list[tuple[int, dict[str, Any]]] = [
        (1, {"status": 200, "usage": usage, "cost": priced}),
        (2, {"status": 200, "usage": None, "interrupted": True}),  # a stream cut
        (3, {"status": 499, "usage": None, "interrupted": True}),  # left before any answer
        (4, {"status": 200, "usage": None}),  # a provider that gives no usage
        # forwarded, not yet answered when cachegate's stop cut it (its 503)
        (8, {"status": 503, "usage": None, "interrupted": True, "error": SHUTTING_DOWN}),
        (5, {"status": 429, "usage": None, "error": "rate limited"}),  # refused: not billed
        # an error object in a 200 body (OpenRouter's "Provider returned error"): not billed
        (7, {"status": 200, "usage": None, "error": "Provider returned error"}),
    ]
    events: list[dict[str, Any]] = [{"ts": T0, "type": "session_meta", "session": "cut"}]
    for n, answer in answers:
        events.append({"ts": T0 + n, "type": "request", "exchange": n, "model": "gpt-4o"})
        events.append({"ts": T0 + n, "type": "response", "exchange": n, **answer})
    # answered by cachegate itself, nothing forwarded
    events.append({"ts": T0 + 6, "type": "request", "exchange": 6, "model": "gpt-4o"})
    events.append(
        {"ts": T0 + 6, "type": "error", "exchange": 6, "status": 400, "message": "strict"}
    )
    _logged(tmp_path, "cut", events)
    report = session_cost(tmp_path, "cut")
    assert (report.priced_exchanges, report.no_usage) == (1, 4)
    assert report.to_json()["no_usage"] == 4
    assert render_cost(report).endswith(
        "\n4 exchanges reported no usage (the client left before it, cachegate stopped before"
        " it, or a provider that gives none): not counted, though the provider may have billed"
        " them"
    )


def test_a_miss_whose_provider_left_out_its_cache_fields_counts_in_the_hit_rate(
    tmp_path: Path,
) -> None:
    """Gemini's OpenAI endpoint sends no cache fields when it read nothing: the accounting
    counts such a miss (the session reported them before), but `list` left it out of CACHE HIT
    (50% here, for 17%) and `show` printed CACHED `-` beside its counted waste."""
    events: list[dict[str, Any]] = [{"ts": T0, "type": "session_meta", "session": "gem"}]
    answers = [
        ({"prompt": 2000, "completion": 5, "cache_read": 1000, "reported_cache": True}, None),
        (
            {"prompt": 2500, "completion": 5, "cache_read": 0, "reported_cache": False},
            {"expected": 2000, "read": 0, "write": 0, "waste": 2000, "cause": "ttl_expired"},
        ),
        # a new conversation's first request: nothing expected, no fields, nothing read
        ({"prompt": 1500, "completion": 5, "cache_read": 0, "reported_cache": False}, None),
    ]
    for n, (usage, cache) in enumerate(answers, 1):
        events.append({"ts": T0 + n, "type": "request", "exchange": n, "model": "gemini-2.5-pro"})
        line = {"ts": T0 + n, "type": "response", "exchange": n, "status": 200, "usage": usage}
        if cache is not None:
            line["cache"] = cache
        events.append(line)
    _logged(tmp_path, "gem", events)
    (summary,) = list_sessions(tmp_path)
    assert summary.to_json()["cache_hit_pct"] == pytest.approx(100 * 1000 / 6000, abs=0.1)
    second = show_session(tmp_path, "gem").rows[1]
    assert second.cache_measured and not second.cache_reported
    row = render_show(show_session(tmp_path, "gem")).splitlines()[3]
    assert row.split()[4:7] == ["2,500", "5", "0"], row


def test_a_summary_calls_cached_input_counts_in_cached_and_cache_hit(tmp_path: Path) -> None:
    """A compaction's summary call is in IN (the provider bills it), and its provider's cache
    read it as any other response: CACHE HIT left it out of both sides (70.6% shown where the
    session's cached input over its input, and the metrics, read 59.9%), and the cached total
    left its read out while IN had its input."""
    summary = {"model": "gpt-4o-mini", "usage": {"prompt": 3000, "completion": 40}}
    summary["usage"] |= {"cache_read": 2800, "reported_cache": True}
    events: list[dict[str, Any]] = [
        {"ts": T0, "type": "session_meta", "session": "sum"},
        req(T0 + 1, 1),
        resp(
            T0 + 2,
            1,
            prompt=4000,
            completion=10,
            cache_read=0,
            ttfb=0.1,
            duration=1,
            actual=0.01,
            uncached=0.01,
        ),
        req(T0 + 3, 2, base_exchange=1, base=0),
        resp(
            T0 + 4,
            2,
            prompt=2000,
            completion=10,
            cache_read=1000,
            ttfb=0.1,
            duration=1,
            actual=0.01,
            uncached=0.01,
        )
        | {"summary": summary},
    ]
    _logged(tmp_path, "sum", events)
    (listed,) = list_sessions(tmp_path)
    assert listed.tokens_in == 9000
    assert listed.cache_read == 3800
    assert listed.cache_hit_pct == pytest.approx(100 * 3800 / 9000)
    row = show_session(tmp_path, "sum").rows[1]
    assert (row.summary_cache_read, row.summary_cache_reported) == (2800, True)
    assert show_session(tmp_path, "sum").rows[1].to_json()["summary_cache_read"] == 2800
    shown = render_show(show_session(tmp_path, "sum"))
    assert "summary call 3,000 in (2,800 cached), 40 out on gpt-4o-mini" in shown
    # one without cache fields, once the session's answers have had them, is a read of 0
    # (Gemini's OpenAI endpoint leaves them out of a miss), as a main call's is
    del summary["usage"]["reported_cache"], summary["usage"]["cache_read"]
    _logged(tmp_path, "sum", events)
    (listed,) = list_sessions(tmp_path)
    assert listed.cache_hit_pct == pytest.approx(100 * 1000 / 9000)
    assert "summary call 3,000 in, 40 out" in render_show(show_session(tmp_path, "sum"))
    # ...and stays out while no answer of the session has had any (nothing is known)
    for line in events[2:]:
        if line["type"] == "response":
            line["usage"] = {"prompt": line["usage"]["prompt"], "completion": 10}
            del line["cache"]
    _logged(tmp_path, "sum", events)
    (listed,) = list_sessions(tmp_path)
    assert listed.cache_hit_pct is None


def test_a_corrupted_cost_is_no_figure_and_the_json_stays_json(tmp_path: Path) -> None:
    """Two exchanges of a damaged log costing 1e308 each: ``cost`` printed ``$inf`` and
    ``$nan (nan%)``, and ``--json`` ``Infinity`` and ``NaN``, which no JSON reader takes."""
    usage = {"prompt": 5, "completion": 1, "cache_read": 0, "cache_write": 0}
    events: list[dict[str, Any]] = [{"ts": T0, "type": "session_meta", "session": "inf"}]
    for n, cost in ((1, 1e308), (2, 1e308), (3, 0.25)):
        events.append({"ts": T0 + n, "type": "request", "exchange": n, "model": "gpt-4o"})
        events.append(
            {
                "ts": T0 + n,
                "type": "response",
                "exchange": n,
                "status": 200,
                "usage": usage,
                "cost": {"actual": cost, "uncached": cost},
            }
        )
    _logged(tmp_path, "inf", events)
    report = session_cost(tmp_path, "inf")
    assert report.actual == 0.25
    text = render_cost(report)
    assert "inf" not in text.replace("session              inf", "") and "nan" not in text
    result = run_cli("sessions", "--log-dir", str(tmp_path), "cost", "inf", "--json")
    assert result.code == 0
    orjson.loads(result.out)  # (refuses NaN and Infinity)
    shown = run_cli("sessions", "--log-dir", str(tmp_path), "show", "inf", "--json")
    assert [row["cost_actual"] for row in orjson.loads(shown.out)["exchanges"]] == [
        None,
        None,
        0.25,
    ]


def test_show_json_gives_costs_without_a_float_sums_tail(tmp_path: Path) -> None:
    """``show --json`` gave ``0.0058200000000000005``, where ``cost --json`` rounds."""
    events = [
        {"ts": T0, "type": "session_meta", "session": "sum"},
        {"ts": T0 + 1, "type": "request", "exchange": 1, "model": "gpt-4o"},
        {
            "ts": T0 + 1,
            "type": "response",
            "exchange": 1,
            "status": 200,
            "usage": {"prompt": 10, "completion": 1, "cache_read": 0, "cache_write": 0},
            "cost": {"actual": 0.0058200000000000005, "uncached": 0.009400799999999999},
        },
    ]
    _logged(tmp_path, "sum", events)
    (row,) = show_session(tmp_path, "sum").to_json()["exchanges"]
    assert (row["cost_actual"], row["cost_uncached"]) == (0.00582, 0.0094008)


def test_replay_lines_give_the_full_forwarded_messages(log_dir: Path) -> None:
    lines = list(replay_lines(log_dir, "alpha"))
    head = {"model": "gpt-4o", "stream": True}  # a log from before params and tools were kept
    assert [orjson.loads(line) for line in lines] == [
        {"exchange_id": 1, **head, "messages": [SYS, U1]},
        {"exchange_id": 2, **head, "messages": [SYS, U1, A1, U2]},
        {"exchange_id": 3, **head, "messages": [SYS, {"role": "user", "content": "summary"}]},
    ]
    assert all("\n" not in line for line in lines)


def test_replay_lines_stay_lines_where_a_text_holds_a_line_separator() -> None:
    """U+2028 and U+2029 went out raw: valid JSON, but a reader that splits lines as
    ``str.splitlines`` does (and JavaScript before ES2019) broke a request at them."""
    from proxy.report import request_lines

    text = "first\u2028second\u2029third"
    request = {"exchange_id": 1, "messages": [{"role": "user", "content": text}]}
    (line,) = request_lines([request])
    assert line.splitlines() == [line]
    assert orjson.loads(line) == request


@pytest.mark.parametrize("bad", ["../alpha", "..", "a" * 129, "al\x00pha", "álpha", ""])
def test_hostile_ids_are_refused_before_any_path_is_built(log_dir: Path, bad: str) -> None:
    for command in (show_session, session_cost, replay_lines):
        with pytest.raises(ValueError, match="invalid session id"):
            command(log_dir, bad)


def test_missing_session_and_directory_say_so(log_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no log for session 'gamma'"):
        show_session(log_dir, "gamma")
    with pytest.raises(FileNotFoundError, match="no log for session 'gamma'"):
        replay_lines(log_dir, "gamma")  # raised at the call, not at the first line
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_sessions(tmp_path / "nowhere")


def compacted_retry_log(tmp_path: Path, repairs: list[dict[str, Any]]) -> Path:
    """A request refused as too long (no response line), its compaction and its retry under
    the same exchange number, then the retry's answer; the log directory."""
    compacted = {"start": 1, "covered": 20}
    answer = dict(ttfb=0.5, duration=1.0, actual=0.01, uncached=0.01)
    events = [
        req(T0, 1, appended=[U1], repairs=repairs),
        {"ts": T0 + 1, "type": "compacted", "exchange": 1, **compacted},
        req(T0 + 2, 1, repairs=repairs, transforms={"compacted": compacted}),
        resp(T0 + 3, 1, prompt=900, completion=10, cache_read=0, **answer),
    ]
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    (log_dir / "ctx.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    return log_dir


def test_a_request_compacted_and_retried_after_a_refusal_shows_both_attempts_rightly(
    tmp_path: Path,
) -> None:
    """The refused attempt has no response line; the compaction and the retry follow it under
    the same exchange number. The compaction is the retry's, and the first attempt says why it
    has no answer (it used to be shown as the compacted one, with no status)."""
    log_dir = compacted_retry_log(tmp_path, [])
    refused, retried = show_session(log_dir, "ctx").rows
    assert (refused.compacted, refused.status) == (False, None)
    assert refused.error is not None and "compacted and re-sent" in refused.error
    assert (retried.compacted, retried.status, retried.tokens_in) == (True, 200, 900)
    [summary] = list_sessions(log_dir)
    assert (summary.exchanges, summary.errors) == (1, 0)  # one exchange, answered


def test_a_compacted_retrys_repairs_count_once(tmp_path: Path) -> None:
    repair = {"kind": "dangling_call", "index": 2, "tool_call_id": "c1", "action": "added"}
    [summary] = list_sessions(compacted_retry_log(tmp_path, [repair]))
    assert (summary.exchanges, summary.repairs, summary.errors) == (1, 1, 0)


def test_reports_hold_a_large_log_in_a_fraction_of_its_size(tmp_path: Path) -> None:
    # a long agent session: every turn appends tool outputs (the bulk of any real log)
    events: list[dict[str, Any]] = [
        {"ts": T0, "type": "session_meta", "session": "big", "model": "gpt-4o"}
    ]
    output = "line of a build log\n" * 2500  # ~50 KB
    for ex in range(1, 401):
        appended = [{"role": "tool", "tool_call_id": f"c{ex}", "content": output}]
        events.append(req(T0 + ex, ex, base_exchange=ex - 1 or None, base=ex, appended=appended))
        events.append(
            resp(
                T0 + ex + 0.5,
                ex,
                prompt=1000 * ex,
                completion=10,
                cache_read=900 * ex,
                ttfb=0.1,
                duration=0.5,
                actual=0.01,
                uncached=0.02,
            )
        )
    size = (_logged(tmp_path, "big", events) / "big.jsonl").stat().st_size
    assert size > 20_000_000

    tracemalloc.start()
    try:
        (summary,) = list_sessions(tmp_path)
        detail = show_session(tmp_path, "big")
        cost = session_cost(tmp_path, "big")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (summary.exchanges, len(detail.rows), cost.priced_exchanges) == (400, 400, 400)
    assert summary.tokens_in == sum(1000 * ex for ex in range(1, 401))
    # the messages are read a line at a time and let go: never the whole log at once
    assert peak < size / 5


def test_a_cheap_sessions_cost_is_shown_to_two_significant_digits() -> None:
    """A session on a cheap model cost $0.000042: four decimals showed $0.0000, as if free."""
    report = CostReport("cheap", 0.000042, 0.000056, 0.000014, 1, 0)
    assert render_cost(report).splitlines()[2:5] == [
        "actual cost          $0.000042",
        "without cache        $0.000056",
        "saved by cache       $0.000014 (25.0%)",
    ]
    assert "actual cost          $0.00073\n" in render_cost(CostReport("x", 0.00073, 0, 0, 1, 0))
    big = CostReport("big", 12.5, 20.0, 7.5, 3, 0)
    assert "actual cost          $12.5000\n" in render_cost(big)
    lost = CostReport("lost", 0.000001, 0.0, -0.000001, 1, 0)
    assert "saved by cache       -$0.0000010" in render_cost(lost)
    # just under a tenth of a cent: four decimals, not three significant digits
    assert "actual cost          $0.0010\n" in render_cost(CostReport("y", 0.00099996, 0, 0, 1, 0))
    # what two sums of the same prices leave of a float's error is no money
    noise = CostReport("noise", 0.1, 0.1, -5.5e-17, 1, 0)
    assert "saved by cache       $0.0000 (0.0%)\n" in render_cost(noise)


def test_a_session_without_a_cache_discount_saved_nothing_not_a_floats_error(
    tmp_path: Path,
) -> None:
    """Input and output prices alone (cached reads at the input price): actual and uncached are
    the same amount summed two ways, and "saved by cache" showed -$0.000000000000 (-0.0%)."""
    events: list[dict[str, Any]] = [{"ts": T0, "type": "session_meta", "session": "flat"}]
    for n, (actual, uncached) in enumerate([(0.1, 0.1), (0.2, 0.2), (0.30000000000000004, 0.3)]):
        events += [
            {"ts": T0 + n, "type": "request", "exchange": n + 1, "model": "io"},
            {
                "ts": T0 + n,
                "type": "response",
                "exchange": n + 1,
                "status": 200,
                "usage": {"prompt": 10, "completion": 1, "cache_read": 5, "cache_write": 0},
                "cost": {"actual": actual, "uncached": uncached},
            },
        ]
    _logged(tmp_path, "flat", events)
    report = session_cost(tmp_path, "flat")
    assert report.saved == 0.0
    assert "saved by cache       $0.0000 (0.0%)" in render_cost(report)


def test_wide_characters_keep_the_columns_in_line(tmp_path: Path) -> None:
    """CJK and emoji take two columns each: padded by their count of characters, a row with
    one pushed every column after it out of line (a Chinese model name, a provider's Chinese
    error text), and a 40-character clip took 80 columns."""
    models = ["\u6a21\u578b-\u6d4b\u8bd5-\u4e2d\u6587\u540d\u5b57", "gpt-4o-\U0001f600\U0001f389",
              "gpt-4o", "\u6a21" * 50]  # fmt: skip
    events = []
    for n, model in enumerate(models, 1):
        events += [req(T0 + n, n, model=model), _answer(T0 + n + 1, 9, 9, 1.0, 0.01, exchange=n)]
    shown = render_show(show_session(_logged(tmp_path, "intl", events), "intl")).splitlines()
    rows = [line for line in shown if line[:1].isdigit()]
    assert len(rows) == 4
    widths = {sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in r) for r in rows}
    assert len(widths) == 1, rows  # every row as wide as the others: the columns line up
    assert "\u6a21" * 19 + "\u2026" in rows[3]  # clipped to 40 columns, not 40 characters
    _logged(tmp_path, "ascii", [req(T0 + 1, 1, model="gpt-4o"), _answer(T0 + 9, 9, 9, 1.0, 0.01)])
    listed = render_list(list_sessions(tmp_path)).splitlines()[1:]
    assert (
        len({sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in r) for r in listed})
        == 1
    )


def test_a_control_or_bidi_character_keeps_the_columns_in_line(tmp_path: Path) -> None:
    """A bidirectional override (U+202E) was measured as no column, then printed as U+FFFD,
    which takes one: every column after it moved by one."""
    models = ["gpt-4o\u202eevil", "gpt-4o\x1b[31mRED", "gpt-4o-\u2066x\u2069", "gpt-4o"]
    events = []
    for n, model in enumerate(models, 1):
        events += [req(T0 + n, n, model=model), _answer(T0 + n + 1, 9, 9, 1.0, 0.01, exchange=n)]
    shown = terminal_safe(render_show(show_session(_logged(tmp_path, "bidi", events), "bidi")))
    lines = shown.splitlines()
    header = next(line for line in lines if line.startswith("#"))
    rows = [line for line in lines if line[:1].isdigit()]
    assert len(rows) == 4
    # every row puts its STATUS column where the header does
    assert {row.index("200") + 3 for row in rows} == {header.index("STATUS") + len("STATUS")}


@pytest.mark.parametrize(
    ("start", "torn"),
    [
        (b"\0" * 3000 + b"\n", 1),
        # (the NULs end inside a line: its cut tail, then the lines cachegate wrote on)
        (b"\0" * 4096 + b'del":"gpt-4o","stream":true,"path":"/v1/chat/completions"}\n', 1),
        (b"\xef\xbb\xbf", 0),
    ],
    ids=["nul-blocks", "nul-blocks-to-mid-line", "bom"],
)
def test_a_log_whose_start_a_crash_zeroed_or_an_editor_marked_is_still_listed(
    tmp_path: Path, start: bytes, torn: int
) -> None:
    """A power loss can leave a file's first blocks as NUL bytes, which cachegate then writes
    on after; a Windows editor adds a byte-order mark. ``list`` judged a file by its first
    bytes and left such a session out for good; where the NULs ended inside a line, ``show``,
    ``cost`` and ``replay`` refused it as no cachegate log (the writer takes it for one)."""
    events = [req(T0 + 1, 1), _answer(T0 + 2, 9, 9, 1.0, 0.01)]
    (tmp_path / "zeroed.jsonl").write_bytes(
        start + b"".join(orjson.dumps(e) + b"\n" for e in events)
    )
    (listed,) = list_sessions(tmp_path)
    assert (listed.session, listed.exchanges, listed.torn) == ("zeroed", 1, torn)
    assert [row.exchange for row in show_session(tmp_path, "zeroed").rows] == [1]
    assert session_cost(tmp_path, "zeroed").priced_exchanges == 1
    # another tool's file is still none, its first line cut or not
    (tmp_path / "other.jsonl").write_bytes(b"\0" * 100 + b'cut"}\n{"epoch": 1}\n{"ts": 1}\n')
    (tmp_path / "text.jsonl").write_bytes(b"not json\n" + orjson.dumps(events[0]) + b"\n")
    assert [s.session for s in list_sessions(tmp_path)] == ["zeroed"]
    with pytest.raises(NotALogFile):
        show_session(tmp_path, "text")


def test_terminal_escaping_changes_only_lines_that_hold_a_control() -> None:
    """``replay`` printed a history's every turn through a translation that looks every
    character up once one is not ASCII (an em dash: 11 s for 94 MB); lines are now searched
    first. Same output for every control, alone or among other text, and for none."""
    from proxy.report import _C1_ESCAPED, _CONTROLS, json_terminal_safe, terminal_safe

    texts = ["", "plain", "caf\u00e9 \u2014 \u4e2d\u6587 \U0001f600", "tab\tand\nline"]
    for code in sorted({*_C1_ESCAPED, *_CONTROLS}):
        texts += [chr(code), f"caf\u00e9 {chr(code)} \u2014 end", f"{chr(code)}x{chr(code)}"]
    for text in texts:
        assert json_terminal_safe(text) == text.translate(_C1_ESCAPED), repr(text)
        assert terminal_safe(text) == text.translate(_CONTROLS), repr(text)
    unchanged = "caf\u00e9 \u2014 " * 1000
    assert json_terminal_safe(unchanged) is unchanged and terminal_safe(unchanged) is unchanged


def test_list_limit_takes_the_sessions_seen_last_among_files_written_in_one_tick(
    tmp_path: Path,
) -> None:
    """The log writer writes a batch of many sessions within one tick of the file system's
    clock: their files share one modification time, and ``list --limit N`` took N of them by
    id (the earliest ids), not the N whose last lines came last."""
    import os

    for i in range(8):
        meta = {"ts": T0, "type": "session_meta", "session": f"s{i}", "model": "gpt-4o"}
        _logged(tmp_path, f"s{i}", [meta, req(T0 + i, 1)])
        os.utime(tmp_path / f"s{i}.jsonl", (T0 + 100, T0 + 100))
    os.utime(tmp_path / "s0.jsonl", (T0 + 50, T0 + 50))  # written before the others' tick
    listed = list_sessions(tmp_path, limit=3)
    assert [s.session for s in listed] == ["s7", "s6", "s5"]
    assert [s.session for s in list_sessions(tmp_path)][:3] == ["s7", "s6", "s5"]
    assert [s.session for s in list_sessions(tmp_path, limit=7)][-1] == "s1"  # (s0: not read)
    # a file written after the tied ones (copied since: its lines older) stays among them
    meta = {"ts": T0, "type": "session_meta", "session": "copied", "model": "gpt-4o"}
    _logged(tmp_path, "copied", [meta, req(T0 - 500, 1)])
    os.utime(tmp_path / "copied.jsonl", (T0 + 200, T0 + 200))
    assert [s.session for s in list_sessions(tmp_path, limit=2)] == ["s7", "copied"]
    # ... and alike from a memo of an earlier listing: its summaries, with a file read again
    # among the tied ones (touched: another key), took part in the choice (it was a crash,
    # ``zip() argument 2 is shorter``, or the first tied by name)
    from proxy.listmemo import SummaryMemo

    memo = SummaryMemo(None, str(tmp_path), "test")
    first = [s.session for s in list_sessions(tmp_path, limit=3, memo=memo)]
    os.utime(tmp_path / "s3.jsonl", (T0 + 100, T0 + 100))  # (its mtime the same, its ctime new)
    again = [s.session for s in list_sessions(tmp_path, limit=3, memo=memo)]
    assert first == again == ["s7", "s6", "copied"]
