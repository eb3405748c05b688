"""A memo of ``sessions list``'s summaries: a repeated listing reads only the logs written since.

One JSON file per log directory under the user's cache directory (``$XDG_CACHE_HOME/cachegate``,
else ``~/.cache/cachegate``), named by a digest of the directory's real path. Each summary is
kept under its log file's device, inode, size, and modification and change times in
nanoseconds: an append, a truncation, a file renamed over it, even a ``chmod`` or ``touch``
changes the key and the log is read again. The memo is also keyed by the code that reads the
logs (a digest of cachegate's version, ``report.py`` and ``eventlog.py``): another version of
cachegate starts it afresh.

The memo only ever saves time. A missing, corrupt or foreign memo file, an entry of the wrong
shape, an unwritable cache directory: the logs are read as without it, and nothing is said.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import stat
import tempfile
import time
from dataclasses import fields
from typing import Any, Final

import orjson

from proxy import eventlog

FORMAT: Final = 1
# A memo not used for this long is deleted when another is written: the memo of a log directory
# long gone (each ``cachegate demo`` lists one of its own) stayed for good. One still in use is
# made again at its next listing, which reads the logs once.
MEMO_KEPT_S: Final = 30 * 86400

# A summary field's JSON types (``None`` allowed where the dataclass allows it).
_NULLABLE_INT = (int, type(None))
_NULLABLE_NUMBER = (int, float, type(None))
_NULLABLE_STR = (str, type(None))

Key = tuple[int, int, int, int, int]


def cache_dir(environ: dict[str, str] | None = None) -> str | None:
    """Where memos go: ``$XDG_CACHE_HOME/cachegate`` (an absolute path only, as the XDG
    specification says), else ``~/.cache/cachegate``; None with no home directory, or one
    that does not exist (a service user's ``/nonexistent``, which is never to be made)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        home = os.path.expanduser("~")
        if not os.path.isabs(home) or not os.path.isdir(home):
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "cachegate")


def file_key(path: str) -> Key | None:
    """The key a log's summary is kept under (None: no regular file there, or no stat)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _code_digest() -> str:
    """A digest of the code a summary comes from: a memo of another version is not used."""
    from proxy import __version__, report

    digest = hashlib.blake2b(__version__.encode(), digest_size=16)
    for module in (report, eventlog):
        path = module.__file__
        if path is None:
            return ""
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


class SummaryMemo:
    """The summaries of one log directory's files, by file name; ``save`` writes them back.

    ``get`` answers ``(True, summary)`` for a file whose key matches (``summary`` None for a
    file that is no cachegate log), ``(False, None)`` otherwise."""

    def __init__(self, path: str | None, log_dir: str, code: str) -> None:
        self.path = path
        self.log_dir = log_dir
        self.code = code
        self._entries: dict[str, tuple[Key, dict[str, Any] | None]] = {}
        self._changed = False

    @classmethod
    def load(
        cls, log_dir: str | os.PathLike[str], environ: dict[str, str] | None = None
    ) -> SummaryMemo:
        """The memo of ``log_dir`` (empty when none is usable)."""
        real = os.path.realpath(os.fspath(log_dir))
        directory = cache_dir(environ)
        name = hashlib.blake2b(os.fsencode(real), digest_size=16).hexdigest()
        path = os.path.join(directory, f"list-{name}.json") if directory else None
        try:
            code = _code_digest()
        except OSError:
            code = ""
        memo = cls(path if code else None, real, code)
        if memo.path is None:
            return memo
        try:
            data = orjson.loads(_read_regular(memo.path))
        except (OSError, ValueError):  # (orjson.JSONDecodeError is a ValueError)
            return memo
        if (
            not isinstance(data, dict)
            or data.get("format") != FORMAT
            or data.get("code") != code
            or data.get("dir") != _dir_key(real)
            or not isinstance(data.get("files"), dict)
        ):
            return memo
        for file_name, entry in data["files"].items():
            parsed = _entry(file_name, entry)
            if parsed is not None:
                memo._entries[file_name] = parsed
        with contextlib.suppress(OSError):
            os.utime(memo.path)  # (used: kept past MEMO_KEPT_S from now)
        return memo

    def get(self, file_name: str, key: Key | None) -> tuple[bool, dict[str, Any] | None]:
        if key is None:
            return False, None
        held = self._entries.get(file_name)
        if held is None or held[0] != key:
            return False, None
        return True, held[1]

    def put(self, file_name: str, key: Key, summary: dict[str, Any] | None) -> None:
        if summary is not None and not _summary_shaped(file_name, summary):
            return  # (a count past what JSON's readers take, say: read again next time)
        self._entries[file_name] = (key, summary)
        self._changed = True

    def keep_only(self, file_names: set[str]) -> None:
        """Forget the files no longer in the directory."""
        gone = [name for name in self._entries if name not in file_names]
        for name in gone:
            del self._entries[name]
        self._changed = self._changed or bool(gone)

    def save(self) -> None:
        """Write the memo back if it changed: atomically, readable by this user only. Any
        failure is passed over (the next listing reads the logs again)."""
        if self.path is None or not self._changed:
            return
        data = {
            "format": FORMAT,
            "code": self.code,
            "dir": _dir_key(self.log_dir),
            "files": {name: [list(key), summary] for name, (key, summary) in self._entries.items()},
        }
        directory = os.path.dirname(self.path)
        tmp = None
        try:
            eventlog.make_private_dirs(directory)  # (each one it makes 0700)
            fd, tmp = tempfile.mkstemp(prefix=".list-", suffix=".tmp", dir=directory)
            with open(fd, "wb") as f:
                f.write(orjson.dumps(data))
            os.replace(tmp, self.path)
            tmp = None
            self._changed = False
            _prune(directory, self.path)
        except (OSError, TypeError, ValueError):  # (what orjson cannot write: passed over too)
            pass
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


def _prune(directory: str, kept: str) -> None:
    """Delete the memos in ``directory`` not used for ``MEMO_KEPT_S`` (but ``kept``), and
    temporary files left by a listing cut off as long ago."""
    old = time.time() - MEMO_KEPT_S
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            if entry.path == kept or not (
                (name.startswith("list-") and name.endswith(".json"))
                or (name.startswith(".list-") and name.endswith(".tmp"))
            ):
                continue
            with contextlib.suppress(OSError):
                if (
                    entry.is_file(follow_symlinks=False)
                    and entry.stat(follow_symlinks=False).st_mtime < old
                ):
                    os.unlink(entry.path)


def _dir_key(real: str) -> str:
    """The log directory as the memo names it: its path's bytes in hex (a path need not be
    UTF-8, which JSON text must be)."""
    return os.fsencode(real).hex()


def _read_regular(path: str) -> bytes:
    """The bytes of the regular file at ``path``; ``OSError`` for anything else (a FIFO would
    block the reader; a symbolic link is not followed)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        with open(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


# The largest count a memo holds: what JSON's readers take whole.
_MAX_COUNT: Final = 2**63 - 1


def _entry(file_name: str, entry: Any) -> tuple[Key, dict[str, Any] | None] | None:
    """A memo entry as read, if it has the shape ``save`` writes (else None: read the log)."""
    if not (isinstance(entry, list) and len(entry) == 2):
        return None
    raw_key, summary = entry
    if not (
        isinstance(raw_key, list)
        and len(raw_key) == 5
        and all(type(part) is int for part in raw_key)
    ):
        return None
    key: Key = (raw_key[0], raw_key[1], raw_key[2], raw_key[3], raw_key[4])
    if summary is None:
        return key, None
    if not isinstance(summary, dict) or not _summary_shaped(file_name, summary):
        return None
    return key, summary


def _summary_shaped(file_name: str, summary: dict[str, Any]) -> bool:
    from proxy.report import LAST_STAMP, SessionSummary

    names = {f.name for f in fields(SessionSummary)}
    if set(summary) != names:
        return False
    if summary["session"] + eventlog.LOG_SUFFIX != file_name:
        return False
    checks: dict[str, tuple[type, ...]] = {
        "first_seen": _NULLABLE_NUMBER,
        "last_seen": _NULLABLE_NUMBER,
        "model": _NULLABLE_STR,
        "tokens_in": _NULLABLE_INT,
        "tokens_out": _NULLABLE_INT,
        "cache_read": _NULLABLE_INT,
        "cache_hit_pct": _NULLABLE_NUMBER,
    }
    for name in names - {"session"}:
        value = summary[name]
        if isinstance(value, bool):
            return False
        if not isinstance(value, checks.get(name, (int,))):
            return False
        if isinstance(value, int) and not 0 <= value <= _MAX_COUNT:
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if (
            name in ("first_seen", "last_seen")
            and isinstance(value, int | float)
            and not 0.0 <= value <= LAST_STAMP  # (a time a report can show)
        ):
            return False
    return True
