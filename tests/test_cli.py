"""``cachegate`` on the command line: ``sessions list | show | cost | replay`` on logs written
through HTTP, ``serve`` refusing bad configuration, ``--version``."""

from __future__ import annotations

import platform
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy import __version__
from proxy.simulator import SimConfig, run_simulator
from proxy.simulator.reply import parse_script
from tests.conftest import run_proxy
from tests.e2e_support import (
    REPO,
    SYSTEM_PROMPT,
    TOOLS,
    cachegate_process,
    chat,
    clean_env,
    free_port,
    make_client,
    post_chat,
    run_cli,
    wait_for,
    wait_until_healthy,
)

PRICES = {"price_input": 2.0, "price_cached_input": 0.5, "price_output": 8.0}


@dataclass
class Logged:
    """A log directory written through HTTP, and what the provider saw for each session."""

    log_dir: Path
    sent: dict[str, list[dict[str, Any]]]  # session -> simulator requests (body, usage)
    inferred: str


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Logged]:
    log_dir = tmp_path_factory.mktemp("cli") / "logs"
    with (
        run_simulator(SimConfig()) as sim,
        run_proxy(sim.api_base, log_dir, {"models": {"gpt-4o": PRICES}}) as proxy,
    ):
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "cli-a"})
        sim.sim.enqueue([parse_script("First answer."), parse_script("Second answer.")])
        convo: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "Start."},
        ]
        reply, _ = chat(client, convo, stream=False, tools=TOOLS)
        convo += [reply, {"role": "user", "content": "Continue."}]
        reply, _ = chat(client, convo, stream=True, tools=TOOLS)
        # An interrupted turn: a tool call never answered. cachegate repairs it before forwarding.
        convo += [
            reply,
            {"role": "user", "content": "Check the file."},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "call_dangling",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
                    }
                ],
            },
            {"role": "user", "content": "Never mind, finish up."},
        ]
        _, headers = chat(client, convo, stream=False, tools=TOOLS)
        assert headers["x-cachegate-repairs"] == "1"
        cli_a = [{"body": r.body, "usage": r.usage} for r in sim.sim.requests]

        other = make_client(proxy.base_url)
        _, headers = chat(other, [{"role": "user", "content": "unrelated"}], stream=False)
        inferred = headers["x-cachegate-session"]
        proxy.settle()
        sent = {
            "cli-a": cli_a,
            inferred: [{"body": sim.sim.requests[-1].body, "usage": sim.sim.requests[-1].usage}],
        }
    yield Logged(log_dir, sent, inferred)


def cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


# --- sessions list -----------------------------------------------------------------------------


def test_list_json_totals_match_what_the_provider_reported(logged: Logged) -> None:
    result = run_cli("sessions", "list", "--log-dir", str(logged.log_dir), "--json")
    assert result.code == 0, result.err
    by_id = {s["session"]: s for s in result.json()}
    assert set(by_id) == {"cli-a", logged.inferred}
    a = by_id["cli-a"]
    usages = [x["usage"] for x in logged.sent["cli-a"]]
    prompt = sum(u["prompt_tokens"] for u in usages)
    read = sum(cached(u) for u in usages)
    assert a["exchanges"] == 3
    assert a["model"] == "gpt-4o"
    assert a["tokens_in"] == prompt
    assert a["tokens_out"] == sum(u["completion_tokens"] for u in usages)
    assert a["cache_read"] == read > 0
    assert a["cache_hit_pct"] == pytest.approx(100.0 * read / prompt)
    assert (a["interruptions"], a["repairs"], a["errors"], a["torn"]) == (0, 1, 0, 0)
    assert a["first_seen"] <= a["last_seen"]
    assert by_id[logged.inferred]["exchanges"] == 1


def test_list_text_is_a_table_with_one_row_per_session(logged: Logged) -> None:
    result = run_cli("sessions", "list", "--log-dir", str(logged.log_dir))
    assert result.code == 0, result.err
    header, *rows = result.out.rstrip("\n").splitlines()
    assert header.split() == [
        "SESSION", "FIRST", "SEEN", "LAST", "SEEN", "MODEL", "EXCH", "IN", "OUT", "CACHE", "HIT",
        "INTERRUPTED", "REPAIRS", "ERRORS", "TORN", "LOST",
    ]  # fmt: skip
    assert sorted(row.split()[0] for row in rows) == sorted(["cli-a", logged.inferred])
    row = next(r for r in rows if r.startswith("cli-a "))
    prompt = sum(x["usage"]["prompt_tokens"] for x in logged.sent["cli-a"])
    assert f"{prompt:,}" in row.split()
    # interrupted, repairs, errors, torn, lost
    assert row.split()[-5:] == ["0", "1", "0", "0", "0"]


def test_list_since_and_limit_read_only_the_logs_written_lately(
    logged: Logged, tmp_path: Path
) -> None:
    """Days of logs: the latest few are listed without reading the rest (chosen by when each
    file was last written)."""
    import os
    import shutil
    import time

    logs = tmp_path / "logs"
    shutil.copytree(logged.log_dir, logs)
    now = time.time()
    for name, age in (("cli-a", 10 * 86400), (logged.inferred, 7200)):
        os.utime(logs / f"{name}.jsonl", (now - age, now - age))
    (logs / "fresh.jsonl").write_bytes((logs / "cli-a.jsonl").read_bytes())  # written now
    (logs / "zz-unreadable.jsonl").write_text("")  # new and no log: passed over, not counted

    def listed(*extra: str) -> list[str]:
        result = run_cli("sessions", "list", "--log-dir", str(logs), "--json", *extra)
        assert result.code == 0, result.err
        return sorted(row["session"] for row in result.json())  # (listed by time last seen)

    everything = sorted(["fresh", logged.inferred, "cli-a"])
    assert listed() == everything
    assert listed("--since", "1d") == sorted(["fresh", logged.inferred])
    assert listed("--since", "3h", "--limit", "5") == sorted(["fresh", logged.inferred])
    assert listed("--since", "30m") == ["fresh"]
    assert listed("--limit", "2") == sorted(["fresh", logged.inferred])
    assert listed("--since", "11d", "--limit", "1") == ["fresh"]
    assert listed("--since", "1000000") == everything  # (a plain number: seconds)
    os.utime(logs / "fresh.jsonl", (now - 7200, now - 7200))
    os.utime(logs / "zz-unreadable.jsonl", (now - 7200, now - 7200))
    quiet = run_cli("sessions", "list", "--log-dir", str(logs), "--since", "1.5m")
    assert (quiet.code, quiet.out) == (0, "no sessions written in the last 90s\n")  # (not empty)
    quiet = run_cli("sessions", "list", "--log-dir", str(logs), "--since", "60m")
    assert quiet.out == "no sessions written in the last 1h\n"
    # (as the user wrote it, not rounded in an exponent: "1.23457e+06s", "1e+06m")
    for path in logs.iterdir():  # (all written some seven years ago)
        os.utime(path, (now - 2e8, now - 2e8))
    for since, said in (("1234567", "1234567s"), ("1000000m", "1000000m"), ("2.5s", "2.5s")):
        quiet = run_cli("sessions", "list", "--log-dir", str(logs), "--since", since)
        assert quiet.out == f"no sessions written in the last {said}\n"
    # (Python's own spellings of numbers, "1_0", other scripts' digits: a typo, refused)
    for bad, word in (
        ("--since", "soon"),
        ("--since", "-2h"),
        ("--limit", "0"),
        ("--limit", "1_0"),
        ("--since", "1_000"),
        ("--since", "\u0664\u0662m"),
    ):
        result = run_cli("sessions", "list", "--log-dir", str(logs), f"{bad}={word}")
        assert result.code == 2
        assert f"argument {bad}: expected" in result.err and repr(word) in result.err


def test_log_dir_from_the_group_option_or_the_environment(
    logged: Logged, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = run_cli("sessions", "list", "--log-dir", str(logged.log_dir), "--json").out
    assert run_cli("sessions", "--log-dir", str(logged.log_dir), "--json", "list").out == expected
    monkeypatch.setenv("CACHEGATE_LOG_DIR", str(logged.log_dir))
    assert run_cli("sessions", "list", "--json").out == expected
    # an empty --log-dir (a script's unset "$DIR") is refused, as serve refuses it: it read
    # $CACHEGATE_LOG_DIR's directory (or ./cachegate-logs) instead, without a word
    for empty in ("", " "):
        for action in (["list"], ["show", "x"], ["cost", "x"], ["replay", "x"]):
            failed = run_cli("sessions", "--log-dir", empty, *action)
            assert failed.code == 2 and failed.out == ""
            assert failed.err.startswith("cachegate: --log-dir: empty;")
    # a variable of spaces alone is refused as serve refuses it (a directory named " " was
    # read); one the flags stand in for is not read
    for name in ("CACHEGATE_LOG_DIR", "CACHEGATE_CONFIG"):
        monkeypatch.delenv("CACHEGATE_LOG_DIR")
        monkeypatch.setenv(name, "  ")
        failed = run_cli("sessions", "list")
        assert (
            failed.code == 2
            and failed.err == f"cachegate: {name}: only spaces; give a path, or unset it\n"
        )
        assert (
            run_cli("sessions", "list", "--log-dir", str(logged.log_dir), "--json").out == expected
        )
        monkeypatch.setenv("CACHEGATE_LOG_DIR", str(logged.log_dir))
    monkeypatch.delenv("CACHEGATE_CONFIG")


def test_log_dir_from_the_config_file_serve_was_given(
    logged: Logged, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A user who sets logging.dir in the config file: sessions looked in ./cachegate-logs."""
    expected = run_cli("sessions", "list", "--log-dir", str(logged.log_dir), "--json").out
    config = tmp_path / "cachegate.toml"
    config.write_text(f"[logging]\ndir = {str(logged.log_dir)!r}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CACHEGATE_LOG_DIR", raising=False)
    assert run_cli("sessions", "--config", str(config), "list", "--json").out == expected
    assert run_cli("sessions", "list", "--config", str(config), "--json").out == expected
    monkeypatch.setenv("CACHEGATE_CONFIG", str(config))
    assert run_cli("sessions", "list", "--json").out == expected
    # the flag and the variable still come first
    other = tmp_path / "other"
    other.mkdir()
    assert run_cli("sessions", "list", "--log-dir", str(other), "--json").out.strip() == "[]"
    broken = tmp_path / "broken.toml"
    broken.write_text("[logging\n")
    failed = run_cli("sessions", "--config", str(broken), "list")
    assert failed.code == 2 and failed.err.startswith("cachegate: config file")
    # an empty --config (an unset shell variable's "$X") is refused, as serve refuses it: it
    # read $CACHEGATE_CONFIG's file instead, or the default directory, without a word
    failed = run_cli("sessions", "list", "--config", "")
    assert failed.code == 2
    assert failed.err == "cachegate: --config: empty; give a TOML file, or leave the flag out\n"
    # serve's variables are serve's to judge: a bad one failed sessions with exit code 2
    monkeypatch.setenv("CACHEGATE_PORT", "abc")
    monkeypatch.setenv("CACHEGATE_UPSTREAM", "not a url")
    assert run_cli("sessions", "--config", str(config), "list", "--json").out == expected


# --- sessions show -----------------------------------------------------------------------------


def test_show_json_has_one_row_per_exchange(logged: Logged) -> None:
    result = run_cli("sessions", "show", "cli-a", "--log-dir", str(logged.log_dir), "--json")
    assert result.code == 0, result.err
    detail = result.json()
    assert detail["session"] == "cli-a"
    assert detail["torn"] == 0
    assert detail["meta"]["type"] == "session_meta"
    assert detail["meta"]["version"] == __version__
    rows = detail["exchanges"]
    usages = [x["usage"] for x in logged.sent["cli-a"]]
    assert [r["exchange"] for r in rows] == [1, 2, 3]
    assert [r["status"] for r in rows] == [200, 200, 200]
    assert [r["tokens_in"] for r in rows] == [u["prompt_tokens"] for u in usages]
    assert [r["tokens_out"] for r in rows] == [u["completion_tokens"] for u in usages]
    assert [r["cache_read"] for r in rows] == [cached(u) for u in usages]
    assert [r["repairs"] for r in rows] == [0, 0, 1]
    assert [r["interrupted"] for r in rows] == [False, False, False]
    assert all(r["duration_s"] >= r["ttfb_s"] > 0 for r in rows)


def test_show_text_is_a_timeline(logged: Logged) -> None:
    result = run_cli("sessions", "show", "cli-a", "--log-dir", str(logged.log_dir))
    assert result.code == 0, result.err
    head, columns, *rows = result.out.rstrip("\n").splitlines()
    assert head.startswith("session cli-a  model gpt-4o  upstream http://127.0.0.1:")
    assert head.endswith(f"cachegate {__version__}")
    assert columns.split() == [
        "#", "TIME", "MODEL", "IN", "OUT", "CACHED", "WASTE", "REPAIRS", "TTFB", "DURATION",
        "STATUS", "NOTES",
    ]  # fmt: skip
    assert [r.split()[0] for r in rows] == ["1", "2", "3"]
    usages = [x["usage"] for x in logged.sent["cli-a"]]
    for row, usage in zip(rows, usages, strict=True):
        cells = row.split()
        assert cells[3] == "gpt-4o"  # after the date and the time
        assert cells[4] == f"{usage['prompt_tokens']:,}"
        assert cells[6] == f"{cached(usage):,}"
        assert "200" in cells
    assert "torn" not in result.out


# --- sessions cost -----------------------------------------------------------------------------


def _hand_cost(usage: dict[str, Any]) -> tuple[float, float]:
    p, c, r = usage["prompt_tokens"], usage["completion_tokens"], cached(usage)
    actual = ((p - r) * 2.0 + r * 0.5 + c * 8.0) / 1e6
    return actual, (p * 2.0 + c * 8.0) / 1e6


def test_cost_json_and_text(logged: Logged) -> None:
    hand = [_hand_cost(x["usage"]) for x in logged.sent["cli-a"]]
    actual, uncached = sum(a for a, _ in hand), sum(u for _, u in hand)
    result = run_cli("sessions", "cost", "cli-a", "--log-dir", str(logged.log_dir), "--json")
    assert result.code == 0, result.err
    cost = result.json()
    assert cost["session"] == "cli-a"
    assert cost["priced_exchanges"] == 3
    assert cost["actual"] == pytest.approx(actual, rel=1e-9)
    assert cost["uncached"] == pytest.approx(uncached, rel=1e-9)
    assert cost["saved"] == pytest.approx(uncached - actual, rel=1e-9)
    assert cost["saved_pct"] == pytest.approx(100 * (uncached - actual) / uncached, rel=1e-9)
    assert cost["waste_tokens"] == 0
    assert cost["waste_by_cause"] == {}

    text = run_cli("sessions", "cost", "cli-a", "--log-dir", str(logged.log_dir))
    assert text.code == 0, text.err
    lines = dict(
        (label.strip(), value.strip())
        for label, value in (line.split("  ", 1) for line in text.out.rstrip("\n").splitlines())
    )
    assert lines["session"] == "cli-a"
    assert lines["priced exchanges"] == "3"
    assert lines["actual cost"] == f"${actual:.4f}"
    assert lines["without cache"] == f"${uncached:.4f}"
    assert lines["saved by cache"].startswith(f"${uncached - actual:.4f} (")
    assert lines["wasted cache tokens"] == "0"


# --- sessions replay ---------------------------------------------------------------------------


def test_replay_prints_every_forwarded_message_list(logged: Logged) -> None:
    plain = run_cli("sessions", "replay", "cli-a", "--log-dir", str(logged.log_dir))
    assert plain.code == 0 and plain.err == "", plain.err  # a full log: no word of metadata
    with_json = run_cli("sessions", "replay", "cli-a", "--log-dir", str(logged.log_dir), "--json")
    assert with_json.out == plain.out  # replay is JSON lines either way
    lines = [orjson.loads(line) for line in plain.out.splitlines()]
    assert [line["exchange_id"] for line in lines] == [1, 2, 3]
    assert [line["messages"] for line in lines] == [
        x["body"]["messages"] for x in logged.sent["cli-a"]
    ]
    # What was forwarded, not what the client sent: the dangling call got its synthetic result.
    third = lines[2]["messages"]
    assert [m["role"] for m in third[-3:]] == ["assistant", "tool", "user"]
    assert third[-2]["tool_call_id"] == "call_dangling"
    # Each line is the request as it was forwarded, resendable: model, stream, the other
    # parameters and the tools (logged when they change, carried forward by replay).
    for line, sent in zip(lines, logged.sent["cli-a"], strict=True):
        rebuilt = {"model": line["model"], **line["params"], "messages": line["messages"]}
        if "tools" in line:
            rebuilt["tools"] = line["tools"]
        if "stream" in line:  # only when the request had it (the SDK sends none unstreamed)
            rebuilt["stream"] = line["stream"]
        assert rebuilt == sent["body"]
    assert all(line["tools"] == TOOLS for line in lines)


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["show", "cost", "replay"])
def test_unknown_and_invalid_session_ids_exit_1_with_a_message(logged: Logged, action: str) -> None:
    missing = run_cli("sessions", action, "no-such-session", "--log-dir", str(logged.log_dir))
    assert missing.code == 1
    assert missing.out == ""
    assert "no log for session 'no-such-session'" in missing.err
    hostile = run_cli("sessions", action, "../cli-a", "--log-dir", str(logged.log_dir))
    assert hostile.code == 1
    assert hostile.out == ""
    assert "invalid session id" in hostile.err
    # a key pasted where the id goes (the wrong column copied) is not printed back to a terminal
    # a screen share or a CI log may show: cachegate's own messages carry no keys
    key = "sk-proj-" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"
    for session in (key, key + "/../x"):
        pasted = run_cli("sessions", action, session, "--log-dir", str(logged.log_dir))
        assert pasted.code == 1 and pasted.out == ""
        assert "session" in pasted.err and key[8:16] not in pasted.err, pasted.err


@pytest.mark.parametrize("action", ["show", "cost", "replay"])
def test_a_session_id_that_starts_with_a_dash_is_read_as_the_id(
    logged: Logged, tmp_path: Path, action: str
) -> None:
    """The server takes ``X-Session-Id: -dash`` and writes ``-dash.jsonl``; ``show -dash`` said
    "the following arguments are required: id"."""
    shutil.copy(logged.log_dir / "cli-a.jsonl", tmp_path / "-dash.jsonl")
    config = tmp_path / "c.toml"  # (its value was taken for the action: "id is required")
    config.write_text(f"[logging]\ndir = {str(tmp_path)!r}\n")
    expected = run_cli("sessions", action, "cli-a", "--log-dir", str(logged.log_dir))
    assert expected.code == 0, expected.err
    for argv in (
        ["sessions", action, "-dash", "--log-dir", str(tmp_path)],
        ["sessions", "--log-dir", str(tmp_path), action, "-dash"],
        ["sessions", action, "--log-dir", str(tmp_path), "-dash"],
        ["sessions", "--log-dir", str(tmp_path), action, "--", "-dash"],
        # (options after "--" and the id: "unrecognized arguments: --log-dir")
        ["sessions", action, "--", "-dash", "--log-dir", str(tmp_path)],
        ["sessions", "--config", str(config), action, "-dash"],
        ["sessions", action, "--config", str(config), "-dash"],
        ["sessions", "--conf", str(config), action, "-dash"],  # (argparse's abbreviations)
        ["sessions", "--log", str(tmp_path), action, "-dash"],
    ):
        result = run_cli(*argv)
        assert result.code == 0, (argv, result.err)
        assert result.out.replace("-dash", "cli-a") == expected.out, argv
    typo = run_cli("sessions", action, "cli-a", "--jsn", "--log-dir", str(tmp_path))
    assert typo.code == 2 and "--jsn" in typo.err  # a mistyped option is no id
    # a word too many is the one named, not the id ("unrecognized arguments: -dash")
    extra = run_cli("sessions", "--log-dir", str(tmp_path), action, "-dash", "extra")
    assert extra.code == 2 and "unrecognized arguments: extra" in extra.err, extra.err
    # a dash word after the id is the word too many, as typed (no mark of cachegate's in it)
    after = run_cli("sessions", "--log-dir", str(tmp_path), action, "extra", "-dash")
    assert after.code == 2 and after.err.endswith("unrecognized arguments: -dash\n"), after.err
    again = run_cli("sessions", action, "cli-a", "--", "-x", "--log-dir", str(tmp_path))
    assert again.code == 2 and "\x00" not in again.err, again.err


@pytest.mark.parametrize(
    ("argv", "usage", "unknown"),
    [
        (["serve", "--logdir", "x"], "usage: cachegate serve", "--logdir x"),
        (["demo", "extra"], "usage: cachegate demo", "extra"),
        (["simulate", "--prot", "9"], "usage: cachegate simulate", "--prot 9"),
        (["sessions", "list", "--jsn"], "usage: cachegate sessions list", "--jsn"),
    ],
)
def test_an_unknown_argument_is_said_with_its_subcommands_usage(
    argv: list[str], usage: str, unknown: str
) -> None:
    """A mistyped flag (``--logdir`` for ``--log-dir``) was said with the top level's usage,
    which shows none of the subcommand's options."""
    result = run_cli(*argv)
    assert result.code == 2
    assert result.err.startswith(usage), result.err
    assert result.err.endswith(f"error: unrecognized arguments: {unknown}\n"), result.err


@pytest.mark.parametrize("ts", [1e20, -1e12])
def test_a_line_with_a_time_no_date_can_show_does_not_stop_the_reports(
    logged: Logged, tmp_path: Path, ts: float
) -> None:
    """A hand-edited or corrupted line's ``"ts":1e20`` stopped ``list`` for the whole directory
    with a traceback (``-1e12``: "year -29719 is out of range"); it is no time, like a NaN."""
    shutil.copy(logged.log_dir / "cli-a.jsonl", tmp_path / "cli-a.jsonl")
    with (tmp_path / "cli-a.jsonl").open("ab") as f:
        f.write(b'{"ts":%r,"type":"response","exchange":2,"status":200}\n' % ts)
        f.write(b'{"ts":%r,"type":"request","exchange":3,"model":"gpt-4o"}\n' % ts)
    for action in (["list"], ["show", "cli-a"], ["cost", "cli-a"], ["list", "--json"]):
        result = run_cli("sessions", *action, "--log-dir", str(tmp_path))
        assert result.code == 0, (action, result.err)
        assert "Traceback" not in result.err and "out of range" not in result.err
    listed = run_cli("sessions", "list", "--log-dir", str(tmp_path), "--json").json()
    assert [row["session"] for row in listed] == ["cli-a"]
    assert listed[0]["last_seen"] < 4e9  # the session's own times, not the line's


def test_a_demo_log_directory_that_cannot_be_written_is_said_at_once(tmp_path: Path) -> None:
    """It played its four scenarios for ~20 s, each failing, and then named commands for a
    directory that did not exist."""
    import time

    t0 = time.monotonic()
    result = run_cli("demo", "--log-dir", "/proc/cachegate-no-such-dir")
    assert result.code == 1
    assert result.err.startswith("cachegate: cannot create log directory /proc/cachegate-no")
    assert result.out == ""
    assert time.monotonic() - t0 < 10


def test_a_demo_given_an_empty_log_directory_is_refused_as_serve_refuses_it() -> None:
    """A script's unset variable (``--log-dir "$DIR"``): the demo went on into a temporary
    directory, where serve and sessions refuse it."""
    result = run_cli("demo", "--log-dir", "")
    assert result.code == 2 and result.out == ""
    assert result.err.startswith("cachegate: --log-dir: empty")


def test_list_of_a_missing_directory_exits_1(tmp_path: Path) -> None:
    result = run_cli("sessions", "list", "--log-dir", str(tmp_path / "nowhere"))
    assert result.code == 1
    assert "does not exist" in result.err


@pytest.mark.parametrize("command", ["show", "cost", "replay"])
def test_a_session_in_a_missing_directory_is_said_to_be_in_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """``show x`` in a directory that is not there said "no log for session 'x'", and told a
    user who gave --log-dir to give --log-dir."""
    nowhere = tmp_path / "nowhere"
    result = run_cli("sessions", "--log-dir", str(nowhere), command, "x")
    assert result.code == 1
    assert result.err == f"cachegate: log directory '{nowhere}' does not exist\n"
    monkeypatch.chdir(tmp_path)
    relative = run_cli("sessions", "--log-dir", "nowhere", command, "x")
    assert relative.err == (
        "cachegate: log directory 'nowhere' does not exist (from --log-dir: a relative"
        f" directory is taken from the current one, {tmp_path}; run from where cachegate serve"
        " runs)\n"
    )


def test_sessions_reads_the_log_directory_of_a_file_that_leaves_the_port_to_a_flag(
    tmp_path: Path,
) -> None:
    """``port = 0`` in the file, which serve's --port replaces (as the README's example does):
    serve started, and ``sessions --config`` refused the same file ("0 is not a TCP port")."""
    logs = tmp_path / "logs"
    logs.mkdir()
    config = tmp_path / "cachegate.toml"
    config.write_text(f'[server]\nport = 0\n[logging]\ndir = "{logs}"\n')
    result = run_cli("sessions", "--config", str(config), "list")
    assert (result.code, result.out.lower(), result.err) == (0, "no sessions\n", "")
    config.write_text("[server]\nprot = 8787\n")  # a mistyped key is still said
    assert run_cli("sessions", "--config", str(config), "list").code == 2


def test_a_relative_log_directory_from_a_config_file_that_is_not_there_is_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve takes a relative ``logging.dir`` from where it runs, not from its config file: a
    user who passed the right --config from another directory was told only that
    './cfglogs' does not exist."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "cachegate.toml").write_text('[logging]\ndir = "./cfglogs"\n')
    (project / "cfglogs").mkdir()
    monkeypatch.chdir(tmp_path)
    result = run_cli("sessions", "list", "--config", "proj/cachegate.toml")
    assert result.code == 1
    assert result.err.startswith("cachegate: log directory './cfglogs' does not exist")
    assert "from config file proj/cachegate.toml" in result.err
    assert str(tmp_path) in result.err and "--log-dir" in result.err
    monkeypatch.chdir(project)  # from where serve ran: found
    assert run_cli("sessions", "list", "--config", "cachegate.toml").code == 0
    # a session that is not there, in a directory that is: no word of directories
    missing = run_cli("sessions", "show", "nosuch", "--config", "cachegate.toml")
    assert missing.code == 1
    assert missing.err == "cachegate: no log for session 'nosuch' in './cfglogs'\n"
    # a config file that sets no directory: the default's
    (project / "other.toml").write_text("[server]\nport = 8790\n")
    other = run_cli("sessions", "list", "--config", "other.toml")
    assert "(from the default:" in other.err
    # one that sets the default's own value, as the example config does: the file is named
    # (the user was told the default was used, as if the file were not read)
    (project / "example.toml").write_text('[logging]\ndir = "./cachegate-logs"\n')
    example = run_cli("sessions", "list", "--config", "example.toml")
    assert example.code == 1 and "(from config file example.toml:" in example.err, example.err


@pytest.mark.parametrize(
    "command",
    [
        ["sessions", "list"],
        ["sessions", "show", "x"],
        ["sessions", "cost", "x"],
        ["sessions", "replay", "x"],
        ["demo"],
    ],
)
def test_a_log_directory_that_is_a_file_is_said_in_one_line(
    tmp_path: Path, command: list[str]
) -> None:
    """``show`` used to print "[Errno 20] Not a directory: '…/x.jsonl'", and ``demo`` ran its
    four scenarios into it, failing each."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    result = run_cli(*command, "--log-dir", str(a_file))
    assert result.code == 1
    assert result.err == f"cachegate: log directory {str(a_file)!r} is not a directory\n"
    assert result.out == ""


def test_a_log_path_that_is_no_regular_file_is_refused_in_one_line_never_read(
    tmp_path: Path,
) -> None:
    """A directory, a FIFO (reading one would hang), a socket or a link named like a session's
    log: show says so and exits 1, list passes over them; a --log-dir that is a file says what it is."""
    import os

    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    (log_dir / "adir.jsonl").mkdir()
    os.mkfifo(log_dir / "pipe.jsonl")
    secret = tmp_path / "elsewhere.txt"
    secret.write_text('{"ts":1.0,"type":"session_meta","session":"x"}\n')
    (log_dir / "link.jsonl").symlink_to(secret)
    import socket

    listening = socket.socket(socket.AF_UNIX)  # (open() of one: "No such device or address")
    listening.bind(str(log_dir / "sock.jsonl"))
    for sid in ("adir", "pipe", "link", "sock"):
        result = run_cli("sessions", "show", sid, "--log-dir", str(log_dir))
        assert result.code == 1, sid
        assert "not a log file" in result.err and "Traceback" not in result.err
    listed = run_cli("sessions", "list", "--log-dir", str(log_dir), "--json")
    assert listed.code == 0 and orjson.loads(listed.out) == []
    not_dir = run_cli("sessions", "list", "--log-dir", str(secret))
    assert not_dir.code == 1 and "is not a directory" in not_dir.err
    listening.close()


def _cli_process(*args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", *args],
        cwd=REPO,
        env=clean_env(**env),
        capture_output=True,
        timeout=60,
    )


def test_a_socket_named_like_a_log_is_named_and_passed_over(tmp_path: Path) -> None:
    """A socket (open() fails with ENXIO) was a traceback, and list then printed no session at
    all; then "No such device or address" (a review: misleading): it is no log file, as a FIFO
    is not, passed over by list and named so by show."""
    import socket

    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    (log_dir / "ok.jsonl").write_bytes(
        b'{"ts":1.0,"type":"session_meta","session":"ok","model":"gpt-4o"}\n'
    )
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(log_dir / "sock.jsonl"))
        listed = run_cli("sessions", "list", "--log-dir", str(log_dir), "--json")
        assert listed.code == 0 and [s["session"] for s in orjson.loads(listed.out)] == ["ok"]
        assert listed.err == ""  # (as for a FIFO or a directory named like a log)
        shown = run_cli("sessions", "show", "sock", "--log-dir", str(log_dir))
        assert shown.code == 1 and "Traceback" not in shown.err
        assert "sock.jsonl is not a log file (not a regular file)" in shown.err


def test_output_to_a_full_disk_is_one_line_not_a_traceback(logged: Logged) -> None:
    for action in (["sessions", "list"], ["sessions", "replay", "cli-a"], ["--version"]):
        with open("/dev/full", "wb") as full:
            proc = subprocess.run(
                [sys.executable, "-m", "proxy.cli", *action],
                cwd=REPO,
                # (buffered as a user's shell has it: the write fails at the flush)
                env={
                    k: v
                    for k, v in clean_env(CACHEGATE_LOG_DIR=str(logged.log_dir)).items()
                    if k != "PYTHONUNBUFFERED"
                },
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                timeout=60,
            )
        assert proc.returncode == 1, action
        assert proc.stderr == "cachegate: No space left on device\n", proc.stderr


def test_replay_says_which_requests_hold_a_secret_the_log_took_out(tmp_path: Path) -> None:
    """The log redacts secrets by default: a request that carried one replays with
    ``[REDACTED]`` in its place, and a script re-sending the session sent other requests
    without a word (``metadata`` logs are said on stderr)."""
    log_dir = tmp_path / "logs"
    with run_simulator(SimConfig()) as sim, run_proxy(sim.api_base, log_dir) as proxy:
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "redacted"})
        convo: list[dict[str, Any]] = [{"role": "user", "content": "What does this do?"}]
        reply, _ = chat(client, convo, stream=False)
        convo += [reply, {"role": "user", "content": "It reads DB_URL=postgres://app:hunter2@db/x"}]
        chat(client, convo, stream=False)
        proxy.settle()
    result = run_cli("sessions", "replay", "redacted", "--log-dir", str(log_dir))
    assert result.code == 0
    lines = [orjson.loads(line) for line in result.out.splitlines()]
    assert len(lines) == 2 and "hunter2" not in result.out
    assert "[REDACTED]" in lines[1]["messages"][-1]["content"]
    assert result.err == (
        "cachegate: 1 request holds [REDACTED]: where the log took out a secret"
        " (logging.redact_secrets), sent again it is not what was sent (where the client sent"
        " that text itself, it is)\n"
    )


def test_reports_and_replay_write_utf8_whatever_the_output_encoding(tmp_path: Path) -> None:
    """Windows writes a redirected stdout in its ANSI code page: "→" or an emoji in a request
    made ``replay > file`` fail part way (a model name outside it, a report)."""
    text = "fix \u2192 caf\u00e9 \U0001f389 \u65e5\u672c\u8a9e"
    line = {
        "ts": 1.0,
        "type": "request",
        "exchange": 1,
        "model": "\u6a21\u578b-\u2192",
        "base_exchange": None,
        "base": 0,
        "appended": [{"role": "user", "content": text}],
    }
    (tmp_path / "uni.jsonl").write_bytes(orjson.dumps(line) + b"\n")
    out = {}
    for action in ("replay", "show", "list"):
        args = [action] if action == "list" else [action, "uni"]
        proc = _cli_process(
            "sessions", *args, "--log-dir", str(tmp_path), PYTHONIOENCODING="cp1252"
        )
        assert proc.returncode == 0 and proc.stderr == b"", (action, proc.stderr)
        out[action] = proc.stdout.decode("utf-8")
    assert orjson.loads(out["replay"])["messages"][0]["content"] == text
    assert "\u6a21\u578b-\u2192" in out["show"] and "\u6a21\u578b-\u2192" in out["list"]


def test_escape_sequences_from_a_log_never_reach_the_terminal(tmp_path: Path) -> None:
    """A client chooses its model name and an upstream its error text: a report prints them,
    and a terminal would act on an escape sequence (retitle, recolour, rewrite the screen)."""
    model, error = "\x1b[31mred\x1b[0m\u202e", "\x1b]0;owned\x07boom\x9b2J\u2066"
    events = [
        {
            "ts": 1.0,
            "type": "session_meta",
            "session": "esc-1",
            "created": "2026-12-01T00:00:00Z",
            "model": model,
            "upstream": "http://x/v1",
            "user_agent": "",
            "version": "0",
        },
        {
            "ts": 2.0,
            "type": "request",
            "exchange": 1,
            "model": model,
            "stream": False,
            "path": "/v1/chat/completions",
            "base_exchange": None,
            "base": 0,
            "appended": [{"role": "user", "content": "hi\x9b2J"}],
            "repairs": [],
            "transforms": {},
            "bytes": 10,
        },
        {
            "ts": 3.0,
            "type": "response",
            "exchange": 1,
            "status": 500,
            "message": None,
            "finish_reason": None,
            "usage": None,
            "ttfb_s": None,
            "duration_s": 0.1,
            "interrupted": False,
            "error": error,
        },
    ]
    (tmp_path / "esc-1.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    for argv in (("list",), ("show", "esc-1"), ("cost", "esc-1"), ("replay", "esc-1")):
        result = run_cli("sessions", *argv, "--log-dir", str(tmp_path))
        assert result.code == 0, result.err
        # (U+202E, U+2066: bidirectional controls reorder how the rest of a row displays)
        assert not any(c in result.out for c in "\x1b\x07\x9b\u202e\u2066"), argv
    shown = run_cli("sessions", "show", "esc-1", "--log-dir", str(tmp_path)).out
    assert "\ufffd[31mred" in shown  # visible as what it was, inert
    shown_json = run_cli("sessions", "show", "esc-1", "--json", "--log-dir", str(tmp_path)).json()
    assert shown_json["meta"]["model"] == model  # JSON escapes it and keeps it exact
    assert shown_json["exchanges"][0]["error"] == error
    replayed = run_cli("sessions", "replay", "esc-1", "--log-dir", str(tmp_path)).out
    assert orjson.loads(replayed)["messages"][0]["content"] == "hi\x9b2J"  # the same JSON, inert


def test_a_log_directory_of_another_user_is_a_message_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proxy import report

    def denied(log_dir: str, unreadable: Any = None, **kw: Any) -> Any:  # (root reads all)
        raise PermissionError(13, "Permission denied", str(tmp_path / "a.jsonl"))

    monkeypatch.setattr(report, "list_sessions", denied)
    result = run_cli("sessions", "list", "--log-dir", str(tmp_path))
    assert result.code == 1
    assert "permission denied" in result.err and "a.jsonl" in result.err
    assert "Traceback" not in result.err


def test_an_unreadable_log_file_is_named_and_the_rest_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proxy import report

    def some(log_dir: str, unreadable: list[tuple[str, str]], **kw: Any) -> list[Any]:
        unreadable.append((str(tmp_path / "secret.jsonl"), "permission denied"))
        return []

    monkeypatch.setattr(report, "list_sessions", some)
    result = run_cli("sessions", "list", "--log-dir", str(tmp_path))
    assert result.code == 0 and result.out == "no sessions\n"
    assert "cannot read" in result.err and "secret.jsonl: permission denied" in result.err


def test_empty_log_directory_lists_no_sessions(tmp_path: Path) -> None:
    assert run_cli("sessions", "list", "--log-dir", str(tmp_path)).out == "no sessions\n"
    assert run_cli("sessions", "list", "--log-dir", str(tmp_path), "--json").json() == []


def test_a_file_that_is_no_cachegate_log_is_no_session_for_any_command(tmp_path: Path) -> None:
    """``list`` leaves out an empty file or another tool's lines; ``show``, ``cost`` and
    ``replay`` showed them as a session with no exchanges (an empty timeline, a $0 cost, nothing
    replayed: exit 0), as if cachegate had logged one."""
    (tmp_path / "other.jsonl").write_text('{"foo": 1}\n')
    (tmp_path / "empty.jsonl").write_text("")
    assert run_cli("sessions", "list", "--log-dir", str(tmp_path)).out == "no sessions\n"
    for action in ("show", "cost", "replay"):
        for name, said in (("other", "is not a cachegate log"), ("empty", "is empty")):
            for json_flag in ((), ("--json",)) if action != "replay" else ((),):
                result = run_cli("sessions", action, name, "--log-dir", str(tmp_path), *json_flag)
                assert (result.code, result.out) == (1, ""), (action, name)
                assert result.err.startswith(f"cachegate: {tmp_path / name}.jsonl {said}")
                assert result.err.endswith(": no session\n")


# --- serve and --version -------------------------------------------------------------------------


@pytest.mark.timeout(20)  # a key wrongly accepted would start a server that never returns
@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[server]\nprot = 8787\n", "server.prot"),
        ("[logging]\nbodies = 'everything'\n", "logging.bodies"),
        ('[models."gpt-4o"]\nprice_inptu = 1.0\n', 'models."gpt-4o".price_inptu'),
        ("[upstreams]\nbase_url = 'http://x'\n", "upstreams"),
    ],
)
def test_serve_with_a_bad_config_key_exits_non_zero_naming_it(
    tmp_path: Path, toml: str, key: str
) -> None:
    config = tmp_path / "cachegate.toml"
    config.write_text(toml)
    result = run_cli("serve", "--config", str(config))
    assert result.code != 0
    assert f"'{key}'" in result.err
    assert result.err.startswith("cachegate: ")


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[server]\nprot = 8787\n", "unknown config key 'server.prot' (did you mean 'port'?)"),
        ("[sesions]\nmax_sessions = 5\n", "unknown config section 'sesions' (did you mean "),
        (
            "max_memory_mb = 5\n",
            "unknown config section 'max_memory_mb' (keys go under a section: put it under "
            "[sessions])",
        ),
        ("max_sessions = 5\n", "unknown config section 'max_sessions' (keys go under a "),
        ("enabled = false\n", "unknown config section 'enabled' (keys go under a section: put "),
        # a model's key above every table: it said "a section such as [server]"
        (
            "price_input = 1.0\n",
            "unknown config section 'price_input' (keys go under a section: put it under"
            ' [models."<model name>"])',
        ),
        (
            "context_window = 8000\n",
            "unknown config section 'context_window' (keys go under a section: put it under"
            ' [models."<model name>"])',
        ),
    ],
)
def test_a_misspelt_or_misplaced_key_gets_a_hint(tmp_path: Path, toml: str, message: str) -> None:
    config = tmp_path / "cachegate.toml"
    config.write_text(toml)
    result = run_cli("serve", "--config", str(config))
    assert result.code == 2
    assert result.err.startswith("cachegate: " + message)


@pytest.mark.timeout(20)
def test_a_config_file_that_cannot_be_read_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    result = run_cli("serve", "--config", str(tmp_path))  # a directory
    assert result.code == 2
    assert result.err == f"cachegate: config file {tmp_path}: cannot read it: Is a directory\n"
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b"# caf\xe9\n[server]\nport = 8787\n")
    result = run_cli("serve", "--config", str(latin))
    assert result.code == 2
    assert result.err.startswith(f"cachegate: config file {latin}: not UTF-8 text")


@pytest.mark.timeout(20)
def test_serve_with_a_bad_environment_value_or_flag_names_the_one_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CACHEGATE_PORT", "eighty")
    result = run_cli("serve")
    assert result.code == 2
    assert result.err == (
        "cachegate: CACHEGATE_PORT: config key 'server.port': expected an integer, got 'eighty'\n"
    )
    monkeypatch.delenv("CACHEGATE_PORT")
    result = run_cli("serve", "--port", "abc")
    assert result.code == 2
    assert result.err.startswith("cachegate: --port: config key 'server.port'")
    monkeypatch.setenv("CACHEGATE_STRICT_PAIRING", "maybe")
    result = run_cli("serve")
    assert result.err.startswith("cachegate: CACHEGATE_STRICT_PAIRING: config key 'pairing.strict'")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", ["serve", "simulate"])
def test_a_port_in_use_is_said_in_one_line_and_creates_nothing(
    tmp_path: Path, command: str
) -> None:
    """The port is bound before anything else: no "listening" line, no log directory, exit code
    1 (``simulate`` gave uvicorn's "[Errno 98]" and exit code 3)."""
    import socket

    script = shutil.which("cachegate")
    assert script is not None
    extra = ["--log-dir", str(tmp_path / "logs")] if command == "serve" else []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [script, command, "--port", str(port), *extra],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
    prog = "cachegate" if command == "serve" else "cachegate simulate"
    assert proc.returncode == 1
    assert proc.stderr == f"{prog}: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert not (tmp_path / "logs").exists()


@pytest.mark.timeout(60)
def test_a_second_cachegate_on_the_same_log_directory_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    """Two processes writing one directory number a session's exchanges each on its own and
    garble its log: the second says so and exits 1; the first keeps serving."""
    script = shutil.which("cachegate")
    assert script is not None
    log_dir = tmp_path / "logs"
    with cachegate_process("http://127.0.0.1:9/v1", log_dir) as (first, url):
        second = subprocess.run(
            [script, "serve", "--port", str(free_port()), "--log-dir", str(log_dir)],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 1
        assert second.stderr == (
            f"cachegate: log directory {log_dir} is being written by another cachegate "
            f"(pid {first.pid}); give this one its own --log-dir\n"
        )
        assert httpx.get(url.removesuffix("/v1") + "/healthz").status_code == 200
    # once the first has exited, the directory is free again
    with cachegate_process("http://127.0.0.1:9/v1", log_dir) as (_, url):
        assert httpx.get(url.removesuffix("/v1") + "/healthz").status_code == 200
        # and `serve` answers a WebSocket handshake itself, a WebSocket library installed or not
        realtime = httpx.get(
            url + "/realtime?model=gpt-realtime",
            headers={
                "connection": "Upgrade",
                "upgrade": "websocket",
                "sec-websocket-version": "13",
                "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
            },
        )
        assert realtime.status_code == 426
        assert realtime.json()["error"]["code"] == "websocket_not_supported"


@pytest.mark.timeout(60)
def test_a_restart_while_an_answer_is_in_flight_waits_for_the_cachegate_that_is_stopping(
    tmp_path: Path,
) -> None:
    """ "Stop; start" while a stream runs: the stopping cachegate keeps the log directory for its
    grace period, and the new one refused to start, telling the user to take another directory
    (a session's log then in two). It waits, says so, and starts once the other has exited; the
    session's log holds the whole answer, then the new process's lines."""
    import contextlib
    import os
    import signal

    import openai

    log_dir = tmp_path / "logs"

    def serve(port: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "proxy.cli", "serve", "--port", str(port)),
                *("--upstream", sim.api_base, "--log-dir", str(log_dir)),
            ],
            cwd=REPO,
            env=clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def healthy(port: int) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    with run_simulator(SimConfig()) as sim:
        first_port, second_port = free_port(), free_port()
        first = serve(first_port)
        second: subprocess.Popen[str] | None = None
        try:
            wait_for(lambda: healthy(first_port), timeout=20, what="the first cachegate")
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{first_port}/v1",
                api_key="sk-test",
                max_retries=0,
                default_headers={
                    "X-Session-Id": "restarted",
                    "X-Sim-Fault": "stall",
                    # (3 s: the second must find the first still stopping, a loaded machine
                    # slow to start it; 2 s left of the 5 s grace for the rest of the answer)
                    "X-Sim-Stall-S": "3",
                },
            )
            stream = client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            chunks = iter(stream)
            next(chunks)  # the answer has begun
            first.send_signal(signal.SIGINT)
            lock = log_dir / ".cachegate.lock"
            wait_for(
                lambda: lock.read_text().strip() == f"{first.pid} stopping",
                timeout=10,
                what="the stopping cachegate's mark",
            )
            second = serve(second_port)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text  # the rest of the answer, after the stall: within the grace period
            assert first.wait(20) == 0
            wait_for(lambda: healthy(second_port), timeout=20, what="the second cachegate")
            assert lock.read_text().strip() == str(second.pid)  # its own, once it holds it
            again = openai.OpenAI(
                base_url=f"http://127.0.0.1:{second_port}/v1",
                api_key="sk-test",
                max_retries=0,
                default_headers={"X-Session-Id": "restarted"},
            )
            again.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "again"}]
            )
            wait_for(
                lambda: len(read_log(log_dir / "restarted.jsonl", "response")) == 2,
                timeout=10,
                what="the second response line",
            )
        finally:
            for proc in (first, second):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        os.kill(proc.pid, signal.SIGKILL)
                        proc.wait()
        assert second is not None and second.stderr is not None
        with second.stderr, first.stderr or contextlib.nullcontext():
            said = second.stderr.read()
            first_said = first.stderr.read() if first.stderr else ""
        # the one stopping says what it waits for
        assert (
            "cachegate: stopping: 1 request(s) in flight have up to 5 s to finish (Ctrl+C again"
            " cuts them now)\n"
        ) in first_said
        assert said.startswith(
            f"cachegate: waiting for the cachegate that is stopping (pid {first.pid}) to finish"
            f" writing log directory {log_dir}\n"
        )
        responses = read_log(log_dir / "restarted.jsonl", "response")
        assert [(r["exchange"], r["status"], r["interrupted"]) for r in responses] == [
            (1, 200, False),
            (1, 200, False),
        ]
        assert responses[0]["message"]["content"] == text


def test_a_restart_stops_waiting_for_a_stopping_cachegate_that_does_not_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    from proxy import cli, eventlog

    monkeypatch.setattr(eventlog, "_CLAIMS", {})  # (this test's claim alone is marked)
    monkeypatch.setattr(cli, "SHUTDOWN_GRACE_S", 0)
    monkeypatch.setattr(cli, "STOPPING_WAIT_S", 0.3)
    log_dir = tmp_path / "held"
    assert eventlog.claim_log_dir(log_dir) is None  # as a cachegate that is stopping holds it
    eventlog.mark_stopping()
    try:
        assert (log_dir / ".cachegate.lock").read_text() == f"{os.getpid()} stopping\n"
        assert cli._log_dir_taken(str(log_dir)) is True
    finally:
        for fd in eventlog._CLAIMS.values():
            os.close(fd)
    assert capsys.readouterr().err == (
        f"cachegate: waiting for the cachegate that is stopping (pid {os.getpid()}) to finish"
        f" writing log directory {log_dir}\n"
        f"cachegate: log directory {log_dir} is still being written by the cachegate that is"
        f" stopping (pid {os.getpid()}); start this one once it has exited\n"
    )


def test_a_restart_waits_for_a_cachegate_that_wrote_no_pid_and_starts_once_it_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A disk full when the cachegate before started, and when it stopped: its lock file held
    nothing, "stopping" neither, and a restart while its answers finished was refused at once,
    told to take another --log-dir (a session's log then in two)."""
    import fcntl
    import os
    import threading

    from proxy import cli, eventlog

    monkeypatch.setattr(cli, "SHUTDOWN_GRACE_S", 0)
    monkeypatch.setattr(cli, "STOPPING_WAIT_S", 5)
    log_dir = tmp_path / "full"
    log_dir.mkdir(mode=0o700)
    fd = os.open(log_dir / ".cachegate.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held, empty: as by a holder that could write nothing
    released = threading.Timer(0.5, os.close, (fd,))  # it exits half a second on
    released.start()
    monkeypatch.setattr(eventlog, "_CLAIMS", {})
    try:
        assert cli._log_dir_taken(str(log_dir)) is False  # it waited, then took it
    finally:
        released.join()
        for claimed in eventlog._CLAIMS.values():
            os.close(claimed)
    assert capsys.readouterr().err == (
        f"cachegate: log directory {log_dir} is held by a cachegate that wrote no pid in its"
        " lock file (its disk full?): waiting for it, in case it is stopping\n"
    )


def read_log(path: Path, kind: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return [line for line in lines if line.get("type") == kind]


def test_a_demo_into_a_log_directory_another_cachegate_writes_is_refused(tmp_path: Path) -> None:
    from proxy.eventlog import claim_log_dir

    log_dir = tmp_path / "taken"
    assert claim_log_dir(log_dir) is None  # as a running `serve` holds it
    result = run_cli("demo", "--log-dir", str(log_dir))
    assert result.code == 1
    assert "is being written by another cachegate" in result.err
    assert not list(log_dir.glob("*.jsonl"))


@pytest.mark.timeout(30)
def test_simulate_serves_on_the_port_it_bound(tmp_path: Path) -> None:
    import signal
    import socket
    import time

    script = shutil.which("cachegate")
    assert script is not None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [script, "simulate", "--port", str(port), "--dialect", "anthropic"],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert r.status_code == 200 and "claude" in r.text
    finally:
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0 and "Traceback" not in err  # Ctrl+C: a clean stop
    # it says where it listens, as serve does
    assert err.startswith(f"cachegate simulate: anthropic-compat on http://127.0.0.1:{port}/v1\n")


@pytest.mark.timeout(30)
def test_simulate_says_where_it_listens_once_it_accepts_connections() -> None:
    """A script that waits for the line, then connects (as the README says of serve's): the
    line came before the simulator listened, and the connection was refused."""
    import signal

    script = shutil.which("cachegate")
    assert script is not None
    port = free_port()
    proc = subprocess.Popen(
        [script, "simulate", "--port", str(port)],
        env=clean_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line == f"cachegate simulate: openai on http://127.0.0.1:{port}/v1\n"
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=10)
    assert proc.returncode == 0


@pytest.mark.timeout(30)
def test_serve_says_where_it_listens_and_which_config_file_it_read(tmp_path: Path) -> None:
    import signal

    script = shutil.which("cachegate")
    assert script is not None
    config = tmp_path / "cachegate.toml"
    config.write_text("[sessions]\nmax_memory_mb = 64\n")
    port = free_port()
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        [script, "serve", "--config", str(config), "--port", str(port), "--log-dir", str(logs)],
        env=clean_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    with proc:
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            # the line comes once it accepts connections: a script that waits for it may connect
            assert _healthy(f"http://127.0.0.1:{port}/healthz")
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(20)
        rest = proc.stderr.read()
    assert proc.returncode == 0 and rest == ""  # Ctrl+C: a clean exit, no traceback
    assert line == (
        f"cachegate {__version__} listening on http://127.0.0.1:{port}/v1 -> "
        f"https://api.openai.com/v1 (config: {config}; logs: {logs})\n"
    )


@pytest.mark.timeout(60)
def test_serve_keeps_an_idle_client_connection_past_the_clients_own_expiry(
    tmp_path: Path,
) -> None:
    """An idle connection is kept past the clients' own 5 s (httpx's, the openai SDKs'):
    closed at the same 5 s (uvicorn's), a request a client sent on it as cachegate closed it
    failed (a ReadError the SDKs' retries hid)."""
    import signal

    script = shutil.which("cachegate")
    assert script is not None
    port = free_port()
    argv = [script, "serve", "--port", str(port), "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.Popen(argv, env=clean_env(), stderr=subprocess.PIPE, text=True)
    with proc:
        try:
            assert proc.stderr is not None
            proc.stderr.readline()  # (once it accepts connections)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
                ask = b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
                for pause in (0.0, 6.0):
                    time.sleep(pause)
                    conn.sendall(ask)
                    assert _whole_answer(conn).startswith(b"HTTP/1.1 200 "), pause
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(20)
    assert proc.returncode == 0


def _whole_answer(conn: socket.socket) -> bytes:
    """One content-length framed answer read from ``conn`` to its end (its head and body may
    come in more than one read)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        chunk = conn.recv(65536)
        assert chunk, data
        body += chunk
    return head + b"\r\n\r\n" + body


def _serve_first_lines(tmp_path: Path, *args: str, env: dict[str, str], count: int) -> list[str]:
    """The first ``count`` lines ``cachegate serve ARGS`` writes to stderr; then Ctrl+C."""
    import signal

    script = shutil.which("cachegate")
    assert script is not None
    argv = [script, "serve", "--port", str(free_port()), "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.Popen([*argv, *args], env=env, stderr=subprocess.PIPE, text=True)
    with proc:
        try:
            assert proc.stderr is not None
            return [proc.stderr.readline() for _ in range(count)]
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(20)


@pytest.mark.timeout(30)
def test_serve_notes_the_placeholder_given_as_its_own_key(tmp_path: Path) -> None:
    (note,) = _serve_first_lines(tmp_path, env=clean_env(OPENAI_API_KEY="cachegate"), count=1)
    assert note == (
        "cachegate: note: $OPENAI_API_KEY here is the placeholder 'cachegate', which stands for"
        " this key: give cachegate the real key, and the agent the placeholder\n"
    )


@pytest.mark.timeout(30)
def test_serve_notes_a_log_dir_given_while_logging_is_off(tmp_path: Path) -> None:
    """``--log-dir`` beside ``logging.enabled = false`` in the file: it started without a
    word, and a user who gave a directory found none made."""
    config = tmp_path / "off.toml"
    config.write_text("[logging]\nenabled = false\n")
    note, line = _serve_first_lines(tmp_path, "--config", str(config), env=clean_env(), count=2)
    assert note == (
        "cachegate: note: --log-dir is set, but logging.enabled = false: no session logs are"
        " written\n"
    )
    assert line.startswith(f"cachegate {__version__} listening on") and "session logs off" in line
    assert not (tmp_path / "logs").exists()


@pytest.mark.timeout(30)
def test_serve_notes_an_upstream_url_without_a_path(tmp_path: Path) -> None:
    """``--upstream https://api.openai.com`` (no /v1) is the usual slip: every request would get
    the provider's 404."""
    upstream = ("--upstream", "http://127.0.0.1:9")
    note, line = _serve_first_lines(tmp_path, *upstream, env=clean_env(), count=2)
    assert note == (
        "cachegate: note: the upstream URL http://127.0.0.1:9 has no path; an OpenAI-compatible"
        " base URL usually ends in /v1 (https://api.openai.com/v1), or the provider's 404 answers"
        " every request\n"
    )
    assert line.startswith(f"cachegate {__version__} listening on")


@pytest.mark.timeout(30)
def test_a_key_in_the_upstream_url_is_not_printed_at_start_or_in_the_upstream_s_warnings(
    tmp_path: Path,
) -> None:
    """A gateway whose key goes in the path (``…/sk-proj-…/v1``): the log's lines had it
    redacted, while the start-up line and the "could not reach" warning printed it whole."""
    import signal

    key = "sk-proj-" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z" * 2
    script = shutil.which("cachegate")
    assert script is not None
    port = free_port()
    argv = [script, "serve", "--port", str(port), "--log-dir", str(tmp_path / "logs")]
    argv += ["--upstream", f"http://127.0.0.1:9/{key}/v1"]
    proc = subprocess.Popen(argv, env=clean_env(), stderr=subprocess.PIPE, text=True)
    with proc:
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert line.startswith(f"cachegate {__version__} listening on")
            assert "http://127.0.0.1:9/[REDACTED]/v1" in line
            answer = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert answer.status_code == 502  # (nothing listens on port 9)
            warning = proc.stderr.readline()
            assert "could not reach the upstream" in warning
            assert "http://127.0.0.1:9/[REDACTED]/v1" in warning
        finally:
            proc.send_signal(signal.SIGINT)
            rest = proc.communicate(timeout=20)[1]
    assert key[8:30] not in line + warning + rest


@pytest.mark.timeout(30)
def test_a_stop_does_not_wait_for_a_refused_upload_being_read(tmp_path: Path) -> None:
    """After a 413 the rest of the upload is read and dropped (up to 10 s): Ctrl+C then spent
    its 5 s grace period on it and said a request in flight was cut, though it was answered."""
    import signal
    import socket as socketlib
    import time

    script = shutil.which("cachegate")
    assert script is not None
    port = free_port()
    config = tmp_path / "small.toml"
    config.write_text("[server]\nmax_body_bytes = 1000\n")
    argv = [script, "serve", "--port", str(port), "--config", str(config)]
    argv += ["--log-dir", str(tmp_path / "logs"), "--upstream", "http://127.0.0.1:9/v1"]
    proc = subprocess.Popen(argv, env=clean_env(), stderr=subprocess.PIPE, text=True)
    with proc:
        assert proc.stderr is not None
        assert "listening on" in proc.stderr.readline()
        with socketlib.create_connection(("127.0.0.1", port)) as client:
            client.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n{"
            )
            assert client.recv(4096).startswith(b"HTTP/1.1 413 ")
            client.sendall(b" " * 1000)  # (still uploading: drained)
            started = time.monotonic()
            proc.send_signal(signal.SIGINT)
            rest = proc.communicate(timeout=20)[1]
            took = time.monotonic() - started
    assert proc.returncode == 0
    assert took < 4.5, took  # (not the grace period's 5 s)
    assert "in flight" not in rest


@pytest.mark.timeout(30)
def test_serve_says_at_start_that_its_log_directory_cannot_be_written(tmp_path: Path) -> None:
    """A directory there that cannot be written into (a bind mount the container's user cannot
    write; /proc here, which not even root can): serve started without a word and warned at
    the first request only, where README promised it said so at start."""
    note, *_ = _serve_first_lines(tmp_path, "--log-dir", "/proc", env=clean_env(), count=3)
    assert note.startswith("cachegate: note: cannot write in log directory /proc: ")
    assert note.endswith(": cachegate serves, and its session logs are lost"
                         " (cachegate_event_log_lost_total) until it can write there\n")  # fmt: skip


@pytest.mark.timeout(20)  # (accepted, it would serve on until stopped)
@pytest.mark.parametrize("upstream", ["http://127.0.0.1:{port}/v1", "http://localhost:{port}"])
def test_serve_refuses_an_upstream_url_that_is_itself(upstream: str) -> None:
    """``--upstream http://127.0.0.1:8787/v1`` on cachegate's own port: each request was sent
    back in, a thousand in flight and 2,000 descriptors held within seconds, not a word said."""
    port = free_port()
    result = run_cli("serve", "--port", str(port), "--upstream", upstream.format(port=port))
    assert result.code == 2
    assert result.err == (
        f"cachegate: the upstream URL {upstream.format(port=port)} is this cachegate itself (it"
        f" listens on 127.0.0.1:{port}): each request would be sent back to it, without end;"
        " give the provider's URL (--upstream, upstream.base_url)\n"
    )


def test_an_upstream_url_is_itself_only_at_the_address_and_port_listened_on() -> None:
    from proxy.cli import _upstream_is_self

    assert _upstream_is_self("http://127.0.0.1:8787/v1", "127.0.0.1", 8787)
    assert _upstream_is_self("http://LOCALHOST:8787/v1", "127.0.0.1", 8787)
    assert _upstream_is_self("http://127.0.0.1:8787/v1", "0.0.0.0", 8787)  # (every address)
    assert _upstream_is_self("http://[::1]:8787/v1", "::", 8787)
    assert _upstream_is_self("http://127.0.0.1:80/v1", "127.0.0.1", 80)
    assert _upstream_is_self("http://127.0.0.1/v1", "127.0.0.1", 80)  # (http's own port)
    assert not _upstream_is_self("http://127.0.0.1:8788/v1", "127.0.0.1", 8787)
    assert not _upstream_is_self("http://127.0.0.2:8787/v1", "127.0.0.1", 8787)  # (another)
    assert not _upstream_is_self("https://127.0.0.1:8787/v1", "127.0.0.1", 8787)  # (no loop)
    assert not _upstream_is_self("http://api.example.com:8787/v1", "127.0.0.1", 8787)
    # "::" listens on IPv6 alone and "0.0.0.0" on IPv4 alone: the other family's is another
    # server (it was refused); no host listens on both
    assert not _upstream_is_self("http://127.0.0.1:8787/v1", "::", 8787)
    assert not _upstream_is_self("http://[::1]:8787/v1", "0.0.0.0", 8787)
    assert _upstream_is_self("http://127.0.0.1:8787/v1", "", 8787)
    # an upstream at the unspecified address is reached on this machine's own
    assert _upstream_is_self("http://0.0.0.0:8787/v1", "127.0.0.1", 8787)
    assert _upstream_is_self("http://0.0.0.0:8787/v1", "0.0.0.0", 8787)
    # the other ways of writing those addresses the socket layer takes (each looped)
    assert _upstream_is_self("http://[::ffff:127.0.0.1]:8787/v1", "0.0.0.0", 8787)
    assert _upstream_is_self("http://[::ffff:127.0.0.1]:8787/v1", "127.0.0.1", 8787)
    assert not _upstream_is_self("http://[::ffff:127.0.0.1]:8787/v1", "::", 8787)  # (IPv4's)
    assert _upstream_is_self("http://0:8787/v1", "127.0.0.1", 8787)
    assert _upstream_is_self("http://0x7f000001:8787/v1", "0.0.0.0", 8787)
    assert _upstream_is_self("http://127.1:8787/v1", "127.0.0.1", 8787)
    assert _upstream_is_self("http://[::0]:8787/v1", "::1", 8787)
    assert _upstream_is_self("http://[0:0::1]:8787/v1", "[::1]", 8787)
    # a name's trailing dot (the root's) names the same
    assert _upstream_is_self("http://127.0.0.1.:8787/v1", "127.0.0.1", 8787)
    assert _upstream_is_self("http://localhost.:8787/v1", "localhost", 8787)
    assert not _upstream_is_self("http://0x7f000002:8787/v1", "127.0.0.1", 8787)
    assert not _upstream_is_self("http://cafe:8787/v1", "127.0.0.1", 8787)  # (a name)


def test_an_upstream_is_itself_by_the_bound_name_and_the_machine_s_other_addresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bound by the machine's own name (``--host vm``, 127.0.0.1 in /etc/hosts), an upstream of
    127.0.0.1 looped; listening on every address, so did one at the machine's own other
    address (192.0.2.2). A provider's name is still not looked up."""
    import proxy.cli as cli

    assert cli._is_own_address(socket.AF_INET, "127.0.0.1")
    assert not cli._is_own_address(socket.AF_INET, "198.51.100.7")  # (TEST-NET-2: nobody's)
    real = socket.getaddrinfo
    asked: list[str] = []

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        asked.append(host)
        return real("127.0.0.1" if host == "myhost" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(cli, "_is_own_address", lambda family, a: a in ("192.0.2.2", "fd00::2"))
    assert cli._upstream_is_self("http://127.0.0.1:8787/v1", "myhost", 8787)
    assert cli._upstream_is_self("http://localhost:8787/v1", "myhost", 8787)
    assert cli._upstream_is_self("http://0x7f000001:8787/v1", "myhost", 8787)
    assert not cli._upstream_is_self("http://127.0.0.2:8787/v1", "myhost", 8787)
    for host in ("0.0.0.0", "", "0"):
        assert cli._upstream_is_self("http://192.0.2.2:8787/v1", host, 8787), host
        assert cli._upstream_is_self("http://[::ffff:192.0.2.2]:8787/v1", host, 8787), host
        assert not cli._upstream_is_self("http://192.0.2.3:8787/v1", host, 8787), host
    assert cli._upstream_is_self("http://[fd00::2]:8787/v1", "::", 8787)
    assert not cli._upstream_is_self("http://[fd00::2]:8787/v1", "0.0.0.0", 8787)  # (IPv6's)
    assert not cli._upstream_is_self("http://192.0.2.2:8787/v1", "127.0.0.1", 8787)
    asked.clear()
    assert not cli._upstream_is_self("http://api.example.com:8787/v1", "0.0.0.0", 8787)
    assert not cli._upstream_is_self("http://api.example.com:8787/v1", "myhost", 8787)
    assert "api.example.com" not in asked


def test_a_key_written_as_a_variable_s_name_is_told_from_a_long_variable_name() -> None:
    from proxy.cli import _key_like_name

    for key in ("A1B2C3D4E5F60718293A4B5C6D7E8F90", "AKIAIOSFODNN7EXAMPLE", "ASIA2345ABCDEFGHIJKL"):
        assert _key_like_name(key), key
    # variables' names with a long word and a digit or two in it (they were hidden, and the
    # note said a key had been written there)
    for name in ("LLM_KEY_EASTUS2PRODUCTION", "CLAUDE35SONNETAPIKEY", "AZUREOPENAIGPT4O_KEY",
                 "OPENAI_API_KEY", "MY_GATEWAY_KEY_V2"):  # fmt: skip
        assert not _key_like_name(name), name


@pytest.mark.timeout(30)
def test_serve_notes_an_upstream_url_that_ends_in_an_endpoint(tmp_path: Path) -> None:
    """A provider's page shows the whole endpoint URL: pasted as the base URL, every request
    went to .../chat/completions/chat/completions and got the provider's 404, with no word."""
    upstream = ("--upstream", "HTTP://127.0.0.1:9/v1/chat/completions/")
    note, line = _serve_first_lines(tmp_path, *upstream, env=clean_env(), count=2)
    assert note == (
        "cachegate: note: the upstream URL http://127.0.0.1:9/v1/chat/completions/ ends in an"
        " endpoint, /chat/completions: each request's path under /v1 is appended to it"
        " (.../chat/completions/chat/completions); give the base URL, which usually ends in /v1\n"
    )
    # (a scheme in upper case is the same URL, as the rest of cachegate reads it)
    assert " -> http://127.0.0.1:9/v1/chat/completions/ (logs: " in line


@pytest.mark.timeout(30)
def test_serve_says_at_start_that_a_file_is_where_its_log_directory_should_be(
    tmp_path: Path,
) -> None:
    """It said so only at the first request, as a lost line. (Before the line that says it
    listens: that one comes once it accepts connections.)"""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    warning, line = _serve_first_lines(
        tmp_path, "--log-dir", str(blocker), env=clean_env(), count=2
    )
    assert line.startswith(f"cachegate {__version__} listening on")
    assert warning.rstrip("\n").endswith(
        f"cannot create log directory {blocker}: a file of that name is in the way"
    )


@pytest.mark.timeout(30)
def test_serve_notes_a_mistyped_variable(tmp_path: Path) -> None:
    env = clean_env(CACHEGATE_LOGDIR=str(tmp_path / "elsewhere"))
    note, line = _serve_first_lines(tmp_path, env=env, count=2)
    assert note == (
        "cachegate: note: CACHEGATE_LOGDIR is set, but cachegate reads no such variable"
        " (did you mean CACHEGATE_LOG_DIR?)\n"
    )
    assert line.startswith(f"cachegate {__version__} listening on")


@pytest.mark.timeout(30)
def test_serve_notes_a_key_no_header_can_carry(tmp_path: Path) -> None:
    """A key pasted with a line break inside: each request got a 500 naming the setting, and
    nothing was said at start."""
    env = clean_env(OPENAI_API_KEY="sk-test-first\nsecond-half")
    note, line = _serve_first_lines(tmp_path, env=env, count=2)
    assert note == (
        "cachegate: note: $OPENAI_API_KEY has a character an HTTP header cannot carry (a line"
        " break, a control or a non-Latin-1 character): requests without a key of their own get"
        " a 500 until it is fixed\n"
    )
    assert "sk-test" not in note + line and "second-half" not in note + line
    assert line.startswith(f"cachegate {__version__} listening on")


@pytest.mark.timeout(30)
def test_serve_notes_a_key_offered_beyond_this_machine(tmp_path: Path) -> None:
    """``--host 0.0.0.0`` with $OPENAI_API_KEY set: anyone on the network could spend the key;
    said at start. Not said on loopback, nor when clients must bring their own key."""
    env = clean_env(OPENAI_API_KEY="sk-test-not-printed")
    note, line = _serve_first_lines(tmp_path, "--host", "0.0.0.0", env=env, count=2)
    assert note.startswith(
        "cachegate: note: listening on 0.0.0.0, beyond this machine, with $OPENAI_API_KEY set:"
    )
    assert "sk-test" not in note + line
    assert line.startswith(f"cachegate {__version__} listening on http://0.0.0.0:")
    (line,) = _serve_first_lines(tmp_path, "--host", "localhost", env=env, count=1)
    assert line.startswith(f"cachegate {__version__} listening on")
    (line,) = _serve_first_lines(tmp_path, "--host", "0.0.0.0", env=clean_env(), count=1)
    assert line.startswith(f"cachegate {__version__} listening on")


@pytest.mark.timeout(30)
def test_serve_notes_that_an_upstream_url_s_user_and_password_are_not_sent(
    tmp_path: Path,
) -> None:
    """An upstream behind basic authentication, given as ``http://user:pass@host/v1``, would
    otherwise answer every request 401 with nothing said; the password is not printed."""
    upstream = ("--upstream", "http://bob:hunter2pass@127.0.0.1:9/v1")
    note, line = _serve_first_lines(tmp_path, *upstream, env=clean_env(), count=2)
    assert note == (
        "cachegate: note: the upstream URL's user:password is not sent: cachegate forwards the"
        " client's key headers (or adds Bearer $OPENAI_API_KEY); an upstream behind basic"
        " authentication needs the client to send it (an Authorization header)\n"
    )
    assert line.startswith(f"cachegate {__version__} listening on")
    assert "hunter2pass" not in note + line and "http://127.0.0.1:9/v1" in line
    # with no key of cachegate's own, it names none
    config = tmp_path / "no-key.toml"
    config.write_text('[upstream]\napi_key_env = ""\n')
    note, _ = _serve_first_lines(
        tmp_path, *upstream, "--config", str(config), env=clean_env(), count=2
    )
    assert note == (
        "cachegate: note: the upstream URL's user:password is not sent: cachegate forwards the"
        " client's key headers; an upstream behind basic authentication needs the client to send"
        " it (an Authorization header)\n"
    )


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (["--fault-rate", "2"], "--fault-rate must be between 0 and 1"),
        (["--context-window", "-5"], "--context-window must be >= 1"),
    ],
)
def test_simulate_with_a_bad_value_names_the_flag(flag: list[str], message: str) -> None:
    result = run_cli("simulate", *flag)
    assert result.code == 2
    assert result.err == f"cachegate simulate: {message}\n"


@pytest.mark.parametrize("port", ["106659", "-1", "0"])
def test_simulate_refuses_a_port_that_is_no_tcp_port(port: str) -> None:
    # 106659 used to listen on 106659 - 65536 = 41123, silently
    result = run_cli("simulate", "--port", port)
    assert result.code == 2
    assert result.err.endswith(f"argument --port: {port} is not a TCP port\n")


def test_simulate_refuses_a_ttl_that_is_not_a_number() -> None:
    result = run_cli("simulate", "--cache-ttl-s", "nan")
    assert result.code == 2
    assert result.err == "cachegate simulate: --cache-ttl-s must be a finite number >= 0\n"


@pytest.mark.parametrize("flag", ["--ttft-ms", "--chunk-ms"])
def test_simulate_refuses_an_endless_delay(flag: str) -> None:
    """``inf`` was taken (``-1`` and ``nan`` were refused): every request then hung."""
    result = run_cli("simulate", flag, "inf")
    assert result.code == 2
    assert result.err == f"cachegate simulate: {flag} must be a finite number >= 0\n"


@pytest.mark.parametrize(("host", "said"), [("", "empty"), ("  ", "only spaces"), ("[]", "'[]'")])
def test_simulate_refuses_an_empty_host_as_serve_does(host: str, said: str) -> None:
    """The socket layer reads "" as every interface: the simulator listened on 0.0.0.0. (A
    host of spaces is said to be so, not "empty".)"""
    result = run_cli("simulate", "--host", host, "--port", str(free_port()))
    assert result.code == 2
    assert result.err.startswith(f"cachegate simulate: --host: {said}; give an address")
    served = run_cli("serve", "--host", host, "--port", str(free_port()))
    assert served.code == 2 and f"config key 'server.host': {said}; give" in served.err


@pytest.mark.parametrize(
    ("host", "said"),
    [
        ("127.0.0.1 ", "has white space or a control character in it"),
        ("localhost:80", "is not an address: give the address alone"),
        ("sk-proj-abcDEF1234567890abcdefXYZ1234567890", "is no address but a 43-character token"),
    ],
)
def test_simulate_refuses_a_host_serve_refuses_alike(host: str, said: str) -> None:
    """The simulator checked only for an empty host: these failed once listening, exit 1
    ("cannot listen on [localhost:80]:…: Name or service not known"), a key in clear."""
    result = run_cli("simulate", "--host", host, "--port", str(free_port()))
    assert result.code == 2 and result.err.startswith("cachegate simulate: --host: ")
    assert said in result.err and "sk-proj" not in result.err
    served = run_cli("serve", "--host", host, "--port", str(free_port()))
    assert served.code == 2 and said in served.err and "sk-proj" not in served.err
    if ":" in host:  # (the simulator has no server.port: its port is its --port alone)
        assert "(the port is --port)" in result.err
        assert "(the port is server.port, --port)" in served.err


def test_console_script_serve_refuses_a_bad_config_and_reports_its_version(
    tmp_path: Path,
) -> None:
    script = shutil.which("cachegate")
    assert script is not None, "the cachegate console script is installed with the package"
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nprot = 8787\n")
    proc = subprocess.run(
        [script, "serve", "--config", str(config)],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "unknown config key 'server.prot'" in proc.stderr
    version = subprocess.run(
        [script, "--version"], env=clean_env(), capture_output=True, text=True, timeout=30
    )
    assert version.returncode == 0
    assert version.stdout == f"cachegate {__version__}\n"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["native", "httpx"])
@pytest.mark.parametrize("bundle", ["missing", "no certificate"])
def test_serve_says_in_one_line_that_the_ca_file_for_an_https_upstream_cannot_be_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport: str, bundle: str
) -> None:
    """A stale SSL_CERT_FILE: the httpx transport failed the start with a traceback, and the
    native pool answered every request 502 'invalid answer (FileNotFoundError)'."""
    cafile = tmp_path / "ca.pem"
    if bundle == "no certificate":
        cafile.write_text("not a certificate\n")
    monkeypatch.setenv("SSL_CERT_FILE", str(cafile))
    config = tmp_path / "c.toml"
    config.write_text(f'[upstream]\ntransport = "{transport}"\n')
    args = ["--config", str(config), "--port", str(free_port()), "--log-dir", str(tmp_path / "l")]
    result = run_cli("serve", *args, "--upstream", "https://127.0.0.1:9/v1")
    assert result.code == 2
    reason = "No such file or directory" if bundle == "missing" else "no certificate or crl found"
    first, *rest = result.err.splitlines()
    assert first.startswith(
        f"cachegate: cannot load the CA certificates for the https upstream from"
        f" SSL_CERT_FILE={cafile}: "
    )
    assert reason in first and rest == [] and "Traceback" not in result.err
    assert not (tmp_path / "l").exists()  # nothing was started


def test_version_in_process() -> None:
    result = run_cli("--version")
    assert result.code == 0
    assert result.out == f"cachegate {__version__}\n"


def test_serve_keeps_start_up_objects_out_of_garbage_collection() -> None:
    """``cachegate serve`` freezes what exists at start-up, collects the young generation only
    past 10,000 objects and runs full collections a tenth as often (in a child process:
    freezing pytest's own heap would change other tests)."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import gc; before = gc.get_threshold(); from proxy.cli import tune_gc; tune_gc(); "
            "print(gc.get_freeze_count(), *before, *gc.get_threshold())",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    frozen, *thresholds = map(int, out)
    before, after = thresholds[:3], thresholds[3:]
    assert frozen > 10000  # the modules and the app, imported before serving
    # The young threshold is raised from the interpreter's (700 up to 3.12, 2000 in 3.13:
    # requests in flight passed it every few requests), the middle one kept; full collections
    # run a tenth as often as by default (10 -> 100).
    assert before[0] < 10_000 and before[2] == 10
    assert after == [10_000, before[1], 100]


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize(
    ("host", "shown"),
    [("127.0.0.1", "127.0.0.1"), ("::1", "[::1]"), ("[::1]", "[::1]"), ("localhost", "localhost")],
)
def test_the_start_up_line_writes_the_host_as_a_url_does(host: str, shown: str) -> None:
    from proxy.config import url_host

    assert url_host(host) == shown


def test_ctrl_c_while_cachegate_is_starting_is_no_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl+C in the first half second of ``serve`` (its imports) printed a KeyboardInterrupt
    traceback; once serving, it is a clean stop."""
    from proxy import cli

    def interrupted() -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["serve"]) == 130


def test_sessions_read_a_log_directory_under_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CACHEGATE_LOG_DIR", "~/cg-logs")
    (tmp_path / "cg-logs").mkdir()
    assert run_cli("sessions", "list").out == "no sessions\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "key",
    [
        "sk-proj-RealKeyInTheWrongPlace",
        "gsk_8Qw3RealKeyInTheWrongPlace1234567890abcd",  # Groq's: the shape of a variable name
        "abcdef0123456789abcdef0123456789",  # a hex key (Azure's)
        # keys of capitals and digits read as variables' names, and were printed whole
        "A1B2C3D4E5F60718293A4B5C6D7E8F90",  # (a hex key in capitals)
        "AKIAIOSFODNN7EXAMPLE",  # (an AWS access key id)
    ],
)
def test_serve_notes_a_key_given_where_its_variable_s_name_goes(tmp_path: Path, key: str) -> None:
    """``api_key_env = "sk-..."``: every request went without a key (the provider's 401s), with
    nothing said; the note does not show what was written there."""
    config = tmp_path / "key.toml"
    config.write_text(f'[upstream]\napi_key_env = "{key}"\n')
    note, line = _serve_first_lines(tmp_path, "--config", str(config), env=clean_env(), count=2)
    assert note == (
        "cachegate: note: upstream.api_key_env names no variable set here (what it holds is not"
        " shown: a key belongs in a variable it names): requests without a key of their own go"
        " without one\n"
    )
    assert key not in note + line and "RealKey" not in note + line and "abcdef" not in note + line
    assert line.startswith(f"cachegate {__version__} listening on")


@pytest.mark.timeout(30)
def test_serve_notes_a_key_variable_of_its_own_name_that_is_not_set(tmp_path: Path) -> None:
    config = tmp_path / "key.toml"
    config.write_text('[upstream]\napi_key_env = "MY_GATEWAY_KEY"\n')
    note, line = _serve_first_lines(tmp_path, "--config", str(config), env=clean_env(), count=2)
    assert note == (
        "cachegate: note: upstream.api_key_env names $MY_GATEWAY_KEY, which is not set here:"
        " requests without a key of their own go without one\n"
    )
    assert line.startswith(f"cachegate {__version__} listening on")
    # set to white space: no key either, and said so
    env = clean_env(MY_GATEWAY_KEY="   ")
    note, line = _serve_first_lines(tmp_path, "--config", str(config), env=env, count=2)
    assert note == (
        "cachegate: note: upstream.api_key_env names $MY_GATEWAY_KEY, which is not set here"
        " (it holds only white space): requests without a key of their own go without one\n"
    )
    # set: nothing to say; and $OPENAI_API_KEY unset is the usual setup (clients bring keys)
    env = clean_env(MY_GATEWAY_KEY="sk-test-x")
    (line,) = _serve_first_lines(tmp_path, "--config", str(config), env=env, count=1)
    assert line.startswith(f"cachegate {__version__} listening on")
    (line,) = _serve_first_lines(tmp_path, env=clean_env(), count=1)
    assert line.startswith(f"cachegate {__version__} listening on")


@pytest.mark.timeout(30)
def test_serve_notes_a_cache_ttl_longer_than_the_sessions_are_kept(tmp_path: Path) -> None:
    """idle_ttl_s must outlive the longest cache TTL it judges: a session forgotten before its
    cache expired has its miss after the pause go unjudged."""
    config = tmp_path / "ttl.toml"
    config.write_text('[sessions]\nidle_ttl_s = 3600\n[models."my-model"]\ncache_ttl_s = 86400\n')
    note, line = _serve_first_lines(tmp_path, "--config", str(config), env=clean_env(), count=2)
    assert note == (
        "cachegate: note: the cache TTL of my-model is longer than sessions.idle_ttl_s (3600 s):"
        " a session idle between the two is forgotten, and the miss after its pause not judged;"
        " raise sessions.idle_ttl_s\n"
    )
    assert line.startswith(f"cachegate {__version__} listening on")
    # the built-in tables (deepseek's 3600 s) are no model the user named: not said
    config.write_text("[sessions]\nidle_ttl_s = 1000\n")
    (line,) = _serve_first_lines(tmp_path, "--config", str(config), env=clean_env(), count=1)
    assert line.startswith(f"cachegate {__version__} listening on")
    # one the file names as it is built in (the example config's gpt-4o) is the user's: said
    config.write_text(
        '[sessions]\nidle_ttl_s = 100\n[models."gpt-4o"]\ncontext_window = 128000\n'
        "cache_ttl_s = 600\nprice_input = 2.50\nprice_cached_input = 1.25\n"
        "price_output = 10.00\n"
    )
    note, line = _serve_first_lines(tmp_path, "--config", str(config), env=clean_env(), count=2)
    assert note.startswith("cachegate: note: the cache TTL of gpt-4o is longer than")
    # a table that leaves the TTL to its provider's default (a DeepSeek model's hour, by its
    # name or its dialect) outlives the sessions as one that sets it: said too (it was not)
    config.write_text(
        '[sessions]\nidle_ttl_s = 1800\n[models."deepseek-v3.1"]\nprice_input = 0.28\n'
        '[models."my-ds"]\ndialect = "deepseek"\n[models."my-model"]\nprice_input = 1.0\n'
    )
    note, line = _serve_first_lines(tmp_path, "--config", str(config), env=clean_env(), count=2)
    assert note.startswith(
        "cachegate: note: the cache TTL of deepseek-v3.1, my-ds is longer than"
        " sessions.idle_ttl_s (1800 s)"
    )


def test_serve_answers_a_chat_request_that_offers_an_http2_upgrade(tmp_path: Path) -> None:
    """``curl --http2`` and Java's HttpClient offer ``Upgrade: h2c`` on a plain-http POST:
    ``cachegate serve`` answered ``invalid_json`` (the body never reached it) and logged
    nothing. It answers in HTTP/1.1, with the body and the session's log line."""
    import socket

    body = b'{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}'
    with (
        run_simulator(SimConfig()) as sim,
        cachegate_process(sim.api_base, tmp_path) as (_, url),
    ):
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                b"content-type: application/json\r\nx-session-id: h2c-1\r\n"
                b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABk\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            answer = b""
            while b"You said: hi" not in answer:
                chunk = sock.recv(65536)
                assert chunk, answer
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        # (the log is written after the answer: waited for)
        wait_for(
            lambda: (
                "gpt-4o  " in run_cli("sessions", "show", "h2c-1", "--log-dir", str(tmp_path)).out
            ),
            timeout=10,
            what="the exchange in the session log",
        )


def test_replay_of_a_session_it_cannot_wholly_rebuild_exits_1_after_what_it_could(
    tmp_path: Path,
) -> None:
    """One damaged request line loses every request coded against it: replay printed the rest
    (or nothing) and exited 0, so a script re-sending the session took it for the whole."""

    def request(exchange: int, base: int, text: str) -> bytes:
        return orjson.dumps(
            {"ts": 1.0 + exchange, "type": "request", "exchange": exchange, "model": "m",
             "base_exchange": exchange - 1 if base else None, "base": base,
             "appended": [{"role": "user", "content": text}]}
        ) + b"\n"  # fmt: skip

    first, second, third = request(1, 0, "one"), request(2, 1, "two"), request(3, 2, "three")
    (tmp_path / "cut.jsonl").write_bytes(first + second[:40] + b"\n" + third)
    result = run_cli("sessions", "replay", "cut", "--log-dir", str(tmp_path))
    assert result.code == 1
    assert [orjson.loads(line)["exchange_id"] for line in result.out.splitlines()] == [1]
    assert "cachegate: 1 request could not be rebuilt" in result.err
    (tmp_path / "whole.jsonl").write_bytes(first + second + third)
    whole = run_cli("sessions", "replay", "whole", "--log-dir", str(tmp_path))
    assert whole.code == 0 and len(whole.out.splitlines()) == 3


def test_replay_of_a_session_with_a_malformed_request_line_exits_1_and_says_so(
    tmp_path: Path,
) -> None:
    """A request line whose ``appended`` is no list, or whose ``exchange`` is no number (a
    damaged or hand-edited log), was passed over without a word, and replay exited 0 while
    ``show`` listed the exchange: a script re-sending the session took it for the whole. The
    line after it, coded against it, cannot be rebuilt either."""
    lines = [
        {"exchange": 1, "base": 0, "appended": [{"role": "user", "content": "one"}]},
        {"exchange": 2, "base": 1, "base_exchange": 1, "appended": {"role": "user"}},
        {"exchange": 3, "base": 2, "base_exchange": 2, "appended": [{"role": "user"}]},
        {"exchange": "4", "base": 0, "appended": [{"role": "user", "content": "four"}]},
    ]
    (tmp_path / "odd.jsonl").write_bytes(
        b"".join(
            orjson.dumps({"ts": 1.0, "type": "request", "model": "m", **line}) + b"\n"
            for line in lines
        )
    )
    result = run_cli("sessions", "replay", "odd", "--log-dir", str(tmp_path))
    assert result.code == 1
    assert [orjson.loads(line)["exchange_id"] for line in result.out.splitlines()] == [1]
    assert "cachegate: 3 requests could not be rebuilt" in result.err


def test_replay_of_a_log_whose_last_request_line_is_torn_exits_1_and_says_so(
    tmp_path: Path,
) -> None:
    """A crash (or a full disk) while the last request line was written: replay printed the
    others and exited 0, its count of skipped requests leaving the torn one out, so a script
    re-sending the session took it for the whole. A torn response line loses no request."""

    def line(kind: str, exchange: int, **fields: object) -> bytes:
        event = {"ts": 1.0 + exchange, "type": kind, "exchange": exchange, **fields}
        return orjson.dumps(event) + b"\n"

    first = line("request", 1, model="m", base_exchange=None, base=0, appended=[{"role": "user",
                 "content": "one"}])  # fmt: skip
    answer = line("response", 1, status=200)
    second = line("request", 2, model="m", base_exchange=1, base=1, appended=[{"role": "user",
                  "content": "two"}])  # fmt: skip
    cases = {
        "torn-request": (first + answer + second[:60] + b"\n", 1),
        "cut-before-its-type": (first + answer + b'{"ts":17\n', 1),
        "torn-response": (first + answer[:30] + b"\n" + second, 0),
    }
    for name, (data, code) in cases.items():
        (tmp_path / f"{name}.jsonl").write_bytes(data)
        result = run_cli("sessions", "replay", name, "--log-dir", str(tmp_path))
        assert result.code == code, (name, result.err)
        assert ("1 line of the log was torn (a crash" in result.err) == bool(code), name
    # a last line with no end yet: being written as replay reads (or a crash's): said so, not
    # blamed on a crash alone
    (tmp_path / "being-written.jsonl").write_bytes(first + answer + second[:60])
    result = run_cli("sessions", "replay", "being-written", "--log-dir", str(tmp_path))
    assert result.code == 1
    assert "its last line has no end yet (being written as it was read" in result.err
    whole = run_cli("sessions", "replay", "torn-response", "--log-dir", str(tmp_path))
    assert [orjson.loads(x)["exchange_id"] for x in whole.out.splitlines()] == [1, 2]


GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="page faults are read from /proc; mallopt is glibc's")
def test_serve_takes_a_growing_agent_body_from_reused_memory_not_new_pages(
    tmp_path: Path,
) -> None:
    """An agent's body grows every turn, past the largest freed before: glibc mapped each
    turn's 600 KB body anew for it alone (~150 page faults a request, ~0.4 ms of its CPU).
    ``cachegate serve`` keeps such blocks in its heap (``tune_malloc``): the server takes a
    few faults a turn, not a body's worth of pages."""
    import random

    rng = random.Random(5)
    words = [f"w{i}" for i in range(500)]

    def text(size: int) -> str:
        return " ".join(rng.choice(words) for _ in range(size // 4))[:size]

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": text(6000)},
        {"role": "user", "content": text(800)},
    ]
    with (
        run_simulator(SimConfig()) as sim,
        cachegate_process(sim.api_base, tmp_path) as (proc, url),
    ):
        client = make_client(url)

        def faults() -> int:
            stat = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return int(stat[7])  # minflt

        for turn in range(75):  # ~8 KB appended a turn, to ~600 KB: the last 20 turns counted
            if turn == 55:
                before = faults()
            post_chat(client, {"model": "gpt-4o", "messages": messages})
            messages += [{"role": "assistant", "content": text(60)}]
            messages += [{"role": "user", "content": text(8000)}]
        per_turn = (faults() - before) / 20
    assert len(orjson.dumps(messages)) > 550_000
    assert per_turn < 40, f"{per_turn:.0f} page faults a turn for a ~600 KB body"


def test_tune_malloc_leaves_malloc_settings_in_the_environment_to_decide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from proxy.cli import tune_malloc

    for name, value in [
        ("MALLOC_TRIM_THRESHOLD_", "131072"),
        ("MALLOC_MMAP_THRESHOLD_", "131072"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072"),
    ]:
        with monkeypatch.context() as env:
            env.setenv(name, value)
            assert tune_malloc() is False
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.rtld.optional_static_tls=1024")  # not malloc's
    with monkeypatch.context() as modules:  # a Python built without libffi: serve still starts
        modules.setitem(sys.modules, "ctypes", None)
        assert tune_malloc() is False
    # Set in a process of its own: mallopt's settings would stay with the test run's
    tuned = subprocess.run(
        [sys.executable, "-c", "from proxy.cli import tune_malloc; print(tune_malloc())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert tuned.stdout.strip() == str(GLIBC)


@pytest.mark.parametrize("planted", ["hard link", "symbolic link"])
def test_a_lock_file_planted_in_a_shared_log_directory_is_refused_not_written(
    tmp_path: Path, planted: str
) -> None:
    """Another user of a world-writable log directory links ``.cachegate.lock`` to one of the
    user's files: starting cachegate emptied it and wrote a process id into it (a symbolic link
    let it start with no lock at all)."""
    import os

    from proxy.eventlog import LOCK_NAME

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    victim = tmp_path / "victim.txt"
    victim.write_text("IMPORTANT USER DATA\n")
    if planted == "hard link":
        os.link(victim, shared / LOCK_NAME)
    else:
        (shared / LOCK_NAME).symlink_to(victim)
    result = run_cli("demo", "--log-dir", str(shared))
    assert result.code == 1
    assert f"{LOCK_NAME} is a symbolic link" in result.err or "hard link" in result.err
    assert victim.read_text() == "IMPORTANT USER DATA\n"
    assert not list(shared.glob("*.jsonl"))


def test_the_grace_periods_note_to_a_closed_terminal_does_not_stop_the_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The terminal closed (SIGHUP), stderr fails with EIO: the note, written from a logging
    filter on uvicorn's record, raised out of uvicorn's shutdown before it cut the requests in
    flight, and the process exited 1 with a traceback."""
    import errno
    import logging

    from proxy.cli import _grace_note

    class ClosedTerminal:
        def write(self, text: str) -> int:
            raise OSError(errno.EIO, "Input/output error")

        def flush(self) -> None:
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sys, "stderr", ClosedTerminal())
    record = logging.LogRecord(
        "uvicorn.error", logging.ERROR, __file__, 1, "Cancel %s running task(s)", (2,), None
    )
    assert _grace_note(record) is False  # said (or not: no terminal), never raised
    other = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Started", (), None)
    assert _grace_note(other) is True


def test_the_grace_period_running_out_with_no_request_in_flight_says_nothing_was_cut(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """uvicorn's grace period also runs out on connections whose requests never began (a
    client that sent half its headers): its "Cancel 0 running task(s)" was said as "0
    request(s) still in flight ... were cut (a stream ends short ...)"."""
    import logging

    from proxy.cli import _grace_note

    def note(count: int) -> str:
        record = logging.LogRecord(
            "uvicorn.error", logging.ERROR, __file__, 1, "Cancel %s running task(s)", (count,), None
        )
        assert _grace_note(record) is False  # (uvicorn's own line never shown)
        return capsys.readouterr().err

    assert note(0) == ""
    assert "2 request(s) still in flight" in note(2)


def _serve_with_open_files(
    upstream: str, log_dir: Path, soft: int, hard: int
) -> tuple[subprocess.Popen[str], str]:
    """``cachegate serve`` started under an open-files limit of ``soft``/``hard`` (set by a
    process that then becomes it: a ``preexec_fn`` is unsafe beside the simulator's thread)."""
    port = free_port()
    argv = [
        *(sys.executable, "-m", "proxy.cli", "serve", "--port", str(port)),
        *("--upstream", upstream, "--log-dir", str(log_dir)),
    ]
    limit = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
        "os.execv(sys.executable, sys.argv[1:])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", limit, *argv],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url)
    return proc, url + "/v1"


@pytest.mark.timeout(120)
def test_serve_takes_the_open_files_its_streams_need(tmp_path: Path) -> None:
    """Each stream in flight holds two sockets. Started with the soft limit most systems give a
    process (1,024; here 160, scaled down), cachegate failed the connections past it: a
    hundred concurrent streams, which a fan-out of sub-agents makes, got 502s and refused
    connections though the hard limit allowed ten times as many files."""
    import asyncio

    stream = {
        "model": "gpt-4o",
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }

    async def one(client: httpx.AsyncClient, base: str) -> bytes:
        async with client.stream("POST", base + "/chat/completions", json=stream) as r:
            body = await r.aread()
            return body if r.status_code == 200 else f"{r.status_code}".encode() + body

    async def many(base: str, count: int) -> list[bytes | BaseException]:
        limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
        timeout = httpx.Timeout(30.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            return await asyncio.gather(
                *(one(client, base) for _ in range(count)), return_exceptions=True
            )

    with run_simulator(SimConfig(chunk_ms=20)) as sim:
        proc, base = _serve_with_open_files(sim.api_base, tmp_path / "logs", 160, 4096)
        try:
            answers = asyncio.run(many(base, 120))
        finally:
            proc.terminate()
            _out, err = proc.communicate(timeout=40)
    failed = [a for a in answers if not (isinstance(a, bytes) and a.endswith(b"data: [DONE]\n\n"))]
    assert not failed, f"{len(failed)} of 120 streams failed: {failed[:3]}"
    assert "may open" not in err  # (the hard limit lets it take what it needs: nothing to say)


def test_serve_says_when_the_hard_limit_on_open_files_is_too_low(tmp_path: Path) -> None:
    with run_simulator(SimConfig()) as sim:
        proc, _base = _serve_with_open_files(sim.api_base, tmp_path / "logs", 150, 300)
        proc.terminate()
        _out, err = proc.communicate(timeout=40)
    assert (
        "cachegate: note: this process may open 300 files (ulimit -n, its hard limit), and"
        " each request in flight holds two sockets: past ~118 at once, new connections fail;"
        " raise the hard limit (ulimit -Hn, LimitNOFILE=, docker --ulimit nofile=) or lower"
        " upstream.max_connections\n"
    ) in err
