"""``sessions list`` keeps each log's summary under the file's key: a repeated listing reads only
the logs written since, and prints exactly what reading them all would."""

import json
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy import listmemo, report
from tests.e2e_support import run_cli
from tests.test_report import T0, resp, write_logs


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    write_logs(tmp_path / "logs")
    return tmp_path / "logs"


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the log files ``list`` reads."""
    seen: list[str] = []
    real = report.read_events

    def counted(path: Any, **kw: Any) -> Any:
        seen.append(os.path.basename(path))
        return real(path, **kw)

    monkeypatch.setattr(report, "read_events", counted)
    return seen


def listed(log_dir: Path, *extra: str) -> str:
    result = run_cli("sessions", "--log-dir", str(log_dir), *extra, "list")
    assert result.code == 0, result.err
    assert result.err == ""
    return result.out


def unmemoized(log_dir: Path) -> list[dict[str, Any]]:
    return [s.to_json() for s in report.list_sessions(log_dir)]


def memo_files(cache: Path) -> list[Path]:
    return sorted((cache / "cachegate").glob("list-*.json"))


def test_a_repeated_listing_reads_no_unchanged_log_and_prints_the_same(
    log_dir: Path, reads: list[str]
) -> None:
    first = listed(log_dir)
    first_json = listed(log_dir, "--json")
    assert sorted(reads) == ["alpha.jsonl", "beta.jsonl"]  # (the second listing read nothing)
    reads.clear()
    assert listed(log_dir) == first
    assert listed(log_dir, "--json") == first_json
    assert reads == []
    assert json.loads(first_json) == unmemoized(log_dir)


def test_an_appended_log_is_read_again_and_its_new_figures_shown(
    log_dir: Path, reads: list[str]
) -> None:
    listed(log_dir)
    reads.clear()
    line = resp(
        T0 + 800, 4, prompt=5000, completion=10, cache_read=4096, ttfb=0.1, duration=0.2,
        actual=0.01, uncached=0.02,
    )  # fmt: skip
    with open(log_dir / "beta.jsonl", "ab") as f:
        f.write(orjson.dumps(line) + b"\n")
    out = json.loads(listed(log_dir, "--json"))
    assert reads == ["beta.jsonl"]
    beta = next(s for s in out if s["session"] == "beta")
    assert beta["tokens_in"] == 5000
    assert out == unmemoized(log_dir)


def test_the_line_being_written_when_listed_counts_once_it_is_whole(
    log_dir: Path, reads: list[str]
) -> None:
    """alpha's last line had no end yet: once the writer finishes it, the listing says so."""
    before = next(s for s in json.loads(listed(log_dir, "--json")) if s["session"] == "alpha")
    with open(log_dir / "alpha.jsonl", "ab") as f:
        f.write(b'onse", "exchange": 9}\n')
    after = next(s for s in json.loads(listed(log_dir, "--json")) if s["session"] == "alpha")
    assert after["last_seen"] == T0 + 704 != before["last_seen"]


@pytest.mark.parametrize("change", ["chmod", "touch", "replace"])
def test_a_log_whose_file_changed_in_any_way_is_read_again(
    log_dir: Path, reads: list[str], change: str
) -> None:
    """A rewrite that keeps the size, or the time set back with ``touch -d``, changes the
    file's change time or inode: the memo's key."""
    listed(log_dir)
    reads.clear()
    path = log_dir / "beta.jsonl"
    st = path.stat()
    if change == "chmod":
        path.chmod(0o644)
    elif change == "touch":
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same times again
    else:  # another file of the same size and times renamed over it
        data = path.read_bytes().replace(b"gpt-4o-mini", b"gpt-4o-nano")
        (log_dir / "new.tmp").write_bytes(data)
        os.utime(log_dir / "new.tmp", ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(log_dir / "new.tmp", path)
    out = json.loads(listed(log_dir, "--json"))
    assert reads == ["beta.jsonl"]
    assert out == unmemoized(log_dir)
    if change == "replace":
        assert next(s for s in out if s["session"] == "beta")["model"] == "gpt-4o-nano"


def test_a_file_that_is_no_log_is_remembered_as_none(log_dir: Path, reads: list[str]) -> None:
    (log_dir / "other.jsonl").write_text('{"level": "info", "msg": "started"}\n')
    first = listed(log_dir)
    assert "other.jsonl" in reads
    reads.clear()
    assert listed(log_dir) == first
    assert reads == []
    assert "other" not in first


def test_a_log_appended_while_it_was_read_is_not_kept(
    log_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary of what was read is not kept under the key of a file that grew meanwhile."""
    real = report.read_events
    grown = resp(
        T0 + 900, 5, prompt=7000, completion=1, cache_read=0, ttfb=0.1, duration=0.1,
        actual=0.0, uncached=0.0,
    )  # fmt: skip

    def racing(path: Any, **kw: Any) -> Any:
        log = real(path, **kw)
        if str(path).endswith("beta.jsonl"):
            with open(path, "ab") as f:
                f.write(orjson.dumps(grown) + b"\n")
        return log

    monkeypatch.setattr(report, "read_events", racing)
    listed(log_dir)
    monkeypatch.setattr(report, "read_events", real)
    out = json.loads(listed(log_dir, "--json"))
    assert next(s for s in out if s["session"] == "beta")["tokens_in"] == 7000
    assert out == unmemoized(log_dir)


def test_a_removed_log_leaves_the_listing_and_the_memo(log_dir: Path, tmp_path: Path) -> None:
    listed(log_dir)
    (log_dir / "beta.jsonl").unlink()
    assert [s["session"] for s in json.loads(listed(log_dir, "--json"))] == ["alpha"]
    (memo,) = memo_files(Path(os.environ["XDG_CACHE_HOME"]))
    assert set(orjson.loads(memo.read_bytes())["files"]) == {"alpha.jsonl"}


def test_the_cache_directorys_missing_parents_are_private_too(
    log_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``XDG_CACHE_HOME`` that does not exist yet: its directories were made 0777 under
    ``umask 000`` (the XDG specification asks 0700)."""
    cache = tmp_path / "xdg" / "deep" / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    old = os.umask(0)
    try:
        listed(log_dir)
    finally:
        os.umask(old)
    for made in (tmp_path / "xdg", tmp_path / "xdg" / "deep", cache, cache / "cachegate"):
        assert made.stat().st_mode & 0o777 == 0o700, made
    assert memo_files(cache)


def test_the_memo_is_private_and_holds_no_message_text(log_dir: Path) -> None:
    listed(log_dir)
    cache = Path(os.environ["XDG_CACHE_HOME"])
    (memo,) = memo_files(cache)
    assert memo.stat().st_mode & 0o777 == 0o600
    assert (cache / "cachegate").stat().st_mode & 0o777 == 0o700
    assert b'"content"' not in memo.read_bytes()
    assert [p.name for p in (cache / "cachegate").iterdir()] == [memo.name]  # no temp file left


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b"not json",
        b"[]",
        b'{"format": 1}',
    ],
)
def test_a_damaged_memo_is_passed_over_and_written_anew(
    log_dir: Path, reads: list[str], damage: bytes
) -> None:
    first = listed(log_dir)
    (memo,) = memo_files(Path(os.environ["XDG_CACHE_HOME"]))
    memo.write_bytes(damage)
    reads.clear()
    assert listed(log_dir) == first
    assert sorted(reads) == ["alpha.jsonl", "beta.jsonl"]
    reads.clear()
    assert listed(log_dir) == first
    assert reads == []


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.update(tokens_in="many"),
        lambda s: s.update(exchanges=True),
        lambda s: s.update(session="alpha"),
        lambda s: s.pop("repairs"),
        lambda s: s.update(extra=1),
        lambda s: s.update(first_seen=1e20),  # (no date a report can show: it stopped them)
        lambda s: s.update(last_seen=-1e12),
        lambda s: s.update(tokens_in=-5),
    ],
)
def test_an_entry_of_the_wrong_shape_is_read_from_the_log(
    log_dir: Path, reads: list[str], edit: Any
) -> None:
    first = listed(log_dir, "--json")
    (memo,) = memo_files(Path(os.environ["XDG_CACHE_HOME"]))
    data = orjson.loads(memo.read_bytes())
    edit(data["files"]["beta.jsonl"][1])
    memo.write_bytes(orjson.dumps(data))
    reads.clear()
    assert listed(log_dir, "--json") == first
    assert reads == ["beta.jsonl"]


def test_a_memo_of_other_code_is_not_used(
    log_dir: Path, reads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another version of cachegate may summarize a log otherwise."""
    listed(log_dir)
    monkeypatch.setattr(listmemo, "_code_digest", lambda: "another version")
    reads.clear()
    listed(log_dir)
    assert sorted(reads) == ["alpha.jsonl", "beta.jsonl"]


def test_without_a_writable_cache_directory_the_listing_is_the_same(
    log_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: list[str]
) -> None:
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # (cachegate/ cannot be made inside)
    first = listed(log_dir)  # (no error said: the memo only saves time)
    assert listed(log_dir) == first
    assert sorted(reads) == ["alpha.jsonl", "alpha.jsonl", "beta.jsonl", "beta.jsonl"]


def test_a_home_that_does_not_exist_is_not_made(
    log_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service user's home is ``/nonexistent`` (Debian's convention), never to exist: a
    read-only `sessions list` made it, and ``.cache/cachegate`` in it. No memo then; the listing
    is the same."""
    home = tmp_path / "nonexistent"
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(home))
    assert listmemo.cache_dir() is None
    first = listed(log_dir)
    assert listed(log_dir) == first and "alpha" in first
    assert not home.exists()
    home.mkdir()  # (a home that exists has its cache made in it)
    listed(log_dir)
    assert memo_files(home / ".cache")


def test_the_cache_directory_follows_xdg(tmp_path: Path) -> None:
    assert listmemo.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "cachegate")
    home = os.path.expanduser("~")
    # a relative XDG_CACHE_HOME is invalid (the specification): the default instead
    for value in ("", "relative/dir"):
        assert listmemo.cache_dir({"XDG_CACHE_HOME": value}) == os.path.join(
            home, ".cache", "cachegate"
        )


def test_two_log_directories_keep_apart_memos(tmp_path: Path, reads: list[str]) -> None:
    write_logs(tmp_path / "a")
    write_logs(tmp_path / "b")
    (tmp_path / "b" / "beta.jsonl").unlink()
    assert "beta" in listed(tmp_path / "a")
    assert "beta" not in listed(tmp_path / "b")
    assert "beta" in listed(tmp_path / "a")
    assert len(memo_files(Path(os.environ["XDG_CACHE_HOME"]))) == 2


@pytest.mark.timeout(30)
def test_a_fifo_where_the_memo_goes_does_not_hang_the_listing(log_dir: Path) -> None:
    first = listed(log_dir)
    (memo,) = memo_files(Path(os.environ["XDG_CACHE_HOME"]))
    memo.unlink()
    os.mkfifo(memo)
    assert listed(log_dir) == first


def test_a_log_directory_whose_path_is_not_utf8_is_listed(tmp_path: Path) -> None:
    """The memo names its directory: a path of other bytes made the listing fail when the
    memo was written (``str is not valid UTF-8``), before anything was printed."""
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9-logs")
    write_logs(Path(odd))
    first = listed(Path(odd))
    assert "alpha" in first and "beta" in first
    assert listed(Path(odd)) == first
    assert len(memo_files(Path(os.environ["XDG_CACHE_HOME"]))) == 1


def test_counts_past_what_json_readers_take_are_listed_and_not_kept(
    tmp_path: Path, reads: list[str]
) -> None:
    """Two lines of 10^19 prompt tokens each: the memo could not write the sum, and the
    listing failed where it used to print."""
    huge = [
        resp(
            T0 + n,
            n,
            prompt=10**19,
            completion=1,
            cache_read=0,
            ttfb=0.1,
            duration=0.1,
            actual=0.0,
            uncached=0.0,
        )
        for n in (1, 2)
    ]
    (tmp_path / "huge.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in huge))
    out = listed(tmp_path)
    assert "20,000,000,000,000,000,000" in out
    assert listed(tmp_path) == out
    assert reads == ["huge.jsonl", "huge.jsonl"]  # (read each time: not kept)


def test_memos_unused_for_a_month_are_deleted_and_one_in_use_is_kept(
    log_dir: Path, tmp_path: Path
) -> None:
    """Each log directory listed left a memo for good, its directory long gone (each ``demo``
    lists one of its own): one not used for 30 days goes when another is written; one read
    since is kept, however old its logs."""
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "cachegate"
    listed(log_dir)
    (used,) = memo_files(cache.parent)
    month = listmemo.MEMO_KEPT_S + 3600
    old = os.path.getmtime(used) - month
    os.utime(used, (old, old))
    listed(log_dir)  # (read, unchanged: used again, not written)
    assert os.path.getmtime(used) > old + month - 60
    gone, stray = cache / "list-0123456789abcdef0123456789abcdef.json", cache / ".list-x.tmp"
    recent = cache / "list-fedcba9876543210fedcba9876543210.json"
    for path in (gone, stray, recent):
        path.write_bytes(b"{}")
    for path in (gone, stray):
        os.utime(path, (old, old))
    other = tmp_path / "other-logs"
    write_logs(other)
    listed(other)  # (a memo written: the others looked at)
    assert not gone.exists() and not stray.exists()
    assert used.exists() and recent.exists()
    assert len(memo_files(cache.parent)) == 3
