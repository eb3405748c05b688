"""``cachegate demo`` end to end: each scenario's report shows the figures cachegate recorded."""

from __future__ import annotations

import io
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy import report
from proxy.demo import DEMO_SESSIONS, run_demo
from proxy.eventlog import read_events


@dataclass(frozen=True)
class DemoRun:
    code: int
    text: str  # the report as printed
    flat: str  # the report with every run of whitespace made one space (lines are wrapped)
    seconds: float
    log_dir: Path


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _section(flat: str, number: int) -> str:
    """The report of scenario ``number``, up to the next one (or the closing lines)."""
    start = flat.index(f" {number}. ")
    end = flat.find(f" {number + 1}. ", start)
    return flat[start : end if end > 0 else flat.index("Session logs")]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    log_dir = tmp_path_factory.mktemp("demo-logs")
    out = io.StringIO()
    started = time.perf_counter()
    code = run_demo(log_dir=str(log_dir), out=out)
    seconds = time.perf_counter() - started
    text = out.getvalue()
    return DemoRun(code, text, " ".join(text.split()), seconds, log_dir)


def test_the_demo_succeeds_offline_in_under_20_seconds(demo: DemoRun) -> None:
    assert demo.code == 0, demo.text
    assert "unexpected" not in demo.text
    assert "All 5 scenarios showed what they should" in demo.text
    assert demo.seconds < 20


def test_the_demo_runs_on_loopback_whatever_proxy_the_environment_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its clients took HTTP_PROXY and ALL_PROXY from the environment (a corporate shell's, a
    CI's) and every scenario failed to connect."""
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # (nothing listens there)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    out = io.StringIO()
    assert run_demo(log_dir=str(tmp_path / "logs"), out=out) == 0, out.getvalue()


def test_the_demos_fake_time_stays_in_the_past(demo: DemoRun) -> None:
    """Its sessions must not sort above the user's real ones, dated in the future."""
    from proxy.eventlog import read_events

    stamps = [
        event["ts"] for log in demo.log_dir.glob("*.jsonl") for event in read_events(log).events
    ]
    assert stamps and max(stamps) < time.time()
    assert min(stamps) > time.time() - 2 * 3600


def test_interrupted_turn_is_refused_directly_and_repaired_through_cachegate(
    demo: DemoRun,
) -> None:
    s = _section(demo.flat, 1)
    assert re.search(
        r"direct to the provider: 400 An assistant message with 'tool_calls' must be followed by "
        r"tool messages responding to each 'tool_call_id'\. The following tool_call_ids did not "
        r"have response messages: call_read_retry",
        s,
    ), s
    assert re.search(r"through cachegate: 200 X-Cachegate-Repairs: 1 ", s), s
    assert "dangling_call at messages[2] (call_read_retry)" in s
    # The conversation goes on, and the repaired prefix is served from the provider's cache.
    m = re.search(r"next turn: 200 X-Cachegate-Repairs: 1 .*?([\d,]+) of ([\d,]+) prompt tokens", s)
    assert m, s
    assert 0 < _number(m[1]) <= _number(m[2])


def test_timestamp_in_the_system_prompt_shows_waste_its_cause_and_cost(demo: DemoRun) -> None:
    s = _section(demo.flat, 2)
    stable = re.search(r"as is: ([\d,]+) prompt tokens, ([\d,]+) cached, ([\d,]+) wasted", s)
    stamped = re.search(
        r"with the time: ([\d,]+) prompt tokens, ([\d,]+) cached, ([\d,]+) wasted", s
    )
    assert stable and stamped, s
    assert _number(stable[2]) > 0 and _number(stable[3]) == 0
    assert _number(stamped[3]) > 0
    m = re.search(
        r"wasted on turns ([\d, ]+): ([\d,+ ]+) tokens; cause prefix_rewrite at system, "
        r"a volatile token \(timestamp\)",
        s,
    )
    assert m, s
    turns = [int(t) for t in m[1].split(",")]
    wastes = [_number(w) for w in m[2].split("+")]
    assert turns == [2, 3, 4]  # every turn after the first
    assert all(w > 0 for w in wastes) and sum(wastes) == _number(stamped[3])
    stamp = r"time: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC You are Forge"
    old, new = re.search(rf"before: .{{0,16}}{stamp}", s), re.search(rf"after: .{{0,16}}{stamp}", s)
    assert old and new and old[1] != new[1], s
    costs = re.search(r"the timestamp cost \$(\d+\.\d{4}) more over 4 turns \(\+(\d+)%\)", s)
    assert costs and float(costs[1]) > 0 and int(costs[2]) > 0, s


def test_idle_gap_past_the_ttl_is_attributed_to_ttl_expired(demo: DemoRun) -> None:
    s = _section(demo.flat, 3)
    warm = re.search(r"turn 3: ([\d,]+) of ([\d,]+) prompt tokens cached; then 10 min idle", s)
    cold = re.search(r"turn 4: ([\d,]+) cached, ([\d,]+) wasted, cause ttl_expired", s)
    assert warm and cold, s
    assert _number(warm[1]) > 0
    assert _number(cold[1]) == 0 and _number(cold[2]) > 0


def test_compaction_shrinks_the_history_and_the_next_request_hits(demo: DemoRun) -> None:
    s = _section(demo.flat, 4)
    made = re.search(
        r"request (\d+): X-Cachegate-Compacted: 1; (\d+) messages -> 1 summary \((model|extractive)\), "
        r"messages estimated at ([\d,]+) -> ([\d,]+) tokens",
        s,
    )
    assert made, s
    assert int(made[2]) >= 2
    assert _number(made[4]) > _number(made[5])
    before = re.search(rf"request {int(made[1]) - 1}: ([\d,]+) prompt", s)
    counted = re.search(r"the provider counted ([\d,]+) prompt tokens, ([\d,]+) cached", s)
    after = re.search(
        rf"request {int(made[1]) + 1}: X-Cachegate-Compacted: 1 \(the same summary\); "
        r"([\d,]+) of ([\d,]+) prompt tokens cached, 0 wasted",
        s,
    )
    assert before and counted and after, s
    assert _number(counted[1]) < _number(before[1])
    assert _number(after[1]) > _number(counted[2])  # the cache hits again after the one miss


def test_a_codex_style_agent_is_repaired_and_its_instructions_rewrite_named(demo: DemoRun) -> None:
    s = _section(demo.flat, 5)
    assert "direct to the provider: 400 No tool output found for function call call_run_tests" in s
    assert "through cachegate: 200 X-Cachegate-Repairs: 1" in s
    assert "session demo-codex from Codex's session_id header" in s
    warm = re.search(r"turn 2: ([\d,]+) of ([\d,]+) prompt tokens cached", s)
    stamped = re.search(
        r"turn 3, the time first in its instructions: ([\d,]+) cached, ([\d,]+) wasted, "
        r"prefix_rewrite at instructions",
        s,
    )
    assert warm and stamped, s
    assert _number(warm[1]) > 0 and _number(stamped[2]) > 0
    (request, *_) = [
        e
        for e in read_events(demo.log_dir / "demo-codex.jsonl").events
        if e.get("type") == "request"
    ]
    assert request["path"] == "/v1/responses" and request["repairs"][0]["kind"] == "dangling_call"


def test_the_report_ends_with_the_logs_and_the_commands_that_open_them(demo: DemoRun) -> None:
    assert f"Session logs in {demo.log_dir}" in demo.text
    for command in ("list", "show demo-timestamp", "cost demo-timestamp"):
        assert f"cachegate sessions {command} --log-dir {demo.log_dir}" in demo.text
    sessions = {s.session for s in report.list_sessions(demo.log_dir)}
    assert sessions == {
        "demo-interrupted",
        "demo-stable",
        "demo-timestamp",
        "demo-idle",
        "demo-compaction",
        "demo-codex",
    }
    cost = report.session_cost(demo.log_dir, "demo-timestamp")
    assert cost.waste_by_cause.keys() == {"prefix_rewrite"}


def test_without_a_log_dir_the_demo_writes_to_a_fresh_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = io.StringIO()
    assert run_demo(out=out) == 0, out.getvalue()
    (made,) = tmp_path.iterdir()
    assert made.name.startswith("cachegate-demo-")
    assert f"Session logs in {made}" in out.getvalue()
    assert (made / "demo-compaction.jsonl").is_file()


def test_a_second_demo_in_the_same_directory_replaces_the_first_ones_logs(
    demo: DemoRun,
) -> None:
    """Both runs' exchanges, on fake clocks, used to interleave in one session, and the cost
    the demo suggests looking up added the two runs up."""
    first = report.session_cost(demo.log_dir, "demo-timestamp")
    out = io.StringIO()
    assert run_demo(log_dir=str(demo.log_dir), out=out) == 0
    assert f"(replaced the logs of an earlier demo in {demo.log_dir})" in out.getvalue()
    again = report.session_cost(demo.log_dir, "demo-timestamp")
    assert again.priced_exchanges == first.priced_exchanges
    assert again.actual == pytest.approx(first.actual)


@pytest.mark.parametrize("kind", ["another_sessions_log", "directory"])
def test_a_file_of_a_demo_sessions_name_that_no_demo_wrote_is_left_and_said(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log of the user's own session named ``demo-stable`` was deleted (and called an earlier
    demo's); a directory of such a name stopped the demo with a traceback."""
    tmp_path.chmod(0o700)
    in_way = tmp_path / "demo-stable.jsonl"
    own = b'{"ts":1,"type":"session_meta","session":"demo-stable","model":"gpt-4o"}\n'
    if kind == "directory":
        in_way.mkdir()
    else:
        in_way.write_bytes(own)
    out = io.StringIO()
    assert run_demo(log_dir=str(tmp_path), out=out) == 1
    err = capsys.readouterr().err
    assert f"{in_way} is in the way: it is no log of an earlier demo" in err
    assert in_way.is_dir() if kind == "directory" else in_way.read_bytes() == own
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-stable.jsonl"]  # (nothing run)


def test_the_demo_runs_with_cachegates_own_dependencies_only(tmp_path: Path) -> None:
    """``pip install .`` (the README's first line, the Docker image) has no openai SDK: the demo,
    the Quick start's first command, stopped with ModuleNotFoundError."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['openai'] = None\n"  # an import of it now fails
        "from proxy.cli import main\n"
        f"sys.exit(main(['demo', '--log-dir', {str(tmp_path)!r}]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "scenarios showed what they should" in result.stdout


def test_a_reader_that_stops_early_leaves_the_demo_to_finish_its_logs(tmp_path: Path) -> None:
    """``cachegate demo --log-dir D | head``: the earlier demo's logs were removed, the next
    write broke the pipe, and the demo stopped with none written (exit 0)."""
    import subprocess
    import sys

    (tmp_path / "demo-stable.jsonl").write_text("")  # an earlier demo's, replaced
    code = f"from proxy.cli import main; raise SystemExit(main(['demo', '--log-dir', {str(tmp_path)!r}]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # as head does after its lines
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err
    logs = sorted(p.name for p in tmp_path.glob("*.jsonl"))
    assert len(logs) == len(DEMO_SESSIONS) and all(
        (tmp_path / name).stat().st_size > 0 for name in logs
    )


def test_a_report_the_disk_cannot_take_is_said_in_a_line_and_the_logs_still_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``cachegate demo > /dev/full``: a traceback (OSError) and exit 1, the earlier demo's logs
    removed and none written; the sessions commands say it in one line."""
    import errno
    import io

    class FullDisk(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    assert run_demo(log_dir=str(tmp_path), out=FullDisk()) == 1
    assert capsys.readouterr().err == (
        "cachegate demo: cannot write its report: No space left on device"
        f" (its logs are in {tmp_path})\n"
    )
    logs = sorted(p.name for p in tmp_path.glob("*.jsonl"))
    assert len(logs) == len(DEMO_SESSIONS) and all(
        (tmp_path / name).stat().st_size > 0 for name in logs
    )


def test_a_closed_stdout_is_no_traceback(tmp_path: Path) -> None:
    """``cachegate demo >&-`` (and ``serve``, ``simulate``): uvicorn's log set-up failed on
    the missing stream, a traceback, exit 1 and no logs written."""
    import subprocess
    import sys

    code = f"from proxy.cli import main; raise SystemExit(main(['demo', '--log-dir', {str(tmp_path)!r}]))"
    closed = ["sh", "-c", 'exec >&-; exec "$0" "$@"', sys.executable, "-c", code]  # as `>&-`
    result = subprocess.run(closed, stderr=subprocess.PIPE, timeout=120)
    assert result.returncode == 0 and b"Traceback" not in result.stderr, result.stderr
    assert len(list(tmp_path.glob("*.jsonl"))) == len(DEMO_SESSIONS)


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_the_demo_succeeds_where_stdout_cannot_write_an_ellipsis(
    tmp_path: Path, terminal: bool
) -> None:
    """A Latin-1 pipe or an ASCII terminal: the timestamp scenario's excerpt ends in "…", and
    the demo reported it failed (UnicodeEncodeError, exit 1) where the Quick start promises
    that every scenario shows what it should. Piped, the output is UTF-8; on a terminal, what
    it cannot show is a ``?``."""
    import os
    import pty
    import subprocess
    import sys

    code = f"from proxy.cli import main; raise SystemExit(main(['demo', '--log-dir', {str(tmp_path)!r}]))"
    env = {**os.environ, "PYTHONIOENCODING": "ascii" if terminal else "latin-1"}
    if not terminal:
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, env=env, timeout=120
        )
        assert result.returncode == 0, result.stdout.decode("utf-8", "replace")
        assert "…" in result.stdout.decode("utf-8")
        return
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=follower, stderr=subprocess.PIPE, env=env
    )
    os.close(follower)
    shown = b""
    while True:
        try:
            piece = os.read(leader, 65536)
        except OSError:  # (the terminal's other end closed: Linux says EIO)
            break
        if not piece:
            break
        shown += piece
    os.close(leader)
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 0, shown.decode("ascii", "replace") + err
    assert "scenarios showed what they should" in shown.decode("ascii")
