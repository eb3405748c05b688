"""The append-only JSONL audit log: a background writer, a torn-line-tolerant reader, replay.

One file per session, ``<log_dir>/<session_id>.jsonl``, one JSON object per line. The relay hands
events to :class:`EventLogWriter` and never waits on disk: a bounded queue feeds one thread that
serializes, redacts and appends (``O_APPEND``, one ``os.write`` per line, so a crash can at worst
tear the last line). A ``request`` event carries only the messages after the prefix it shares
with an earlier exchange of the session (``base_exchange``, ``base``, ``appended``); :func:`replay`
rebuilds every forwarded message list from those deltas, so a log grows with the conversation, not
with its square.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

import orjson

from proxy.prefix import deep_call, deep_dumps
from proxy.redact import (
    KEY_PIECE,
    REDACTED,
    known_secrets,
    line_may_hold_secret,
    prepare_scan,
    redact,
    redact_text,
)
from proxy.sessions import realigned, shared_prefix, valid_session_id

logger = logging.getLogger(__name__)

LOG_SUFFIX: Final = ".jsonl"
_REDACTED_BYTES: Final = REDACTED.encode()
_BROKEN_LIMIT: Final = 10000
_NOT_BROKEN: Final = object()

FsyncMode = Literal["none", "line", "interval"]
BodiesMode = Literal["full", "metadata"]

_FSYNC_MODES: Final = ("none", "line", "interval")
_BODIES_MODES: Final = ("full", "metadata")
_WARN_EVERY_S: Final = 30.0
CLAIM_RETRY_S: Final = 5.0  # the writer's next try at a log directory's lock it could not take
_OPT_ANY_KEYS: Final = orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS
_OPEN_FLAGS: Final = (
    os.O_RDWR  # read too: the last byte of a reopened file is checked on the same descriptor
    | os.O_APPEND
    | os.O_CREAT
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NOFOLLOW", 0)
)


def session_log_path(log_dir: str | os.PathLike[str], session_id: str) -> str:
    """The log file of ``session_id``; a bad id raises ``ValueError`` before any path is built."""
    if not valid_session_id(session_id):
        raise ValueError(
            f"invalid session id {redact_text(session_id)!r}: expected 1-128 characters of A-Z a-z 0-9 . _ : -"
            " (and not '.' or '..')"
        )
    return os.path.join(os.fspath(log_dir), session_id + LOG_SUFFIX)


# --------------------------------------------------------------------------------------------------
# Writer

# A line in a batch, for the secret scan: session id, the session's lines, the line's index
# there, and the object it was serialized from.
_Made = tuple[str, list[bytes], int, Any]


@dataclass(slots=True)
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


_STOP: Final = object()


@dataclass(slots=True)
class _FirstInFile:
    """An event to write only as the first line of its file (``emit(..., first_in_file=True)``)."""

    event: dict[str, Any]


@dataclass(slots=True)
class _Scrubbed:
    """An event whose line must not hold ``secrets`` (``emit(..., secrets=...)``)."""

    event: Any
    secrets: tuple[str, ...]


def _unwrapped(event: Any) -> Any:
    """A queued event without the wrappers ``emit`` put around it."""
    while type(event) in (_FirstInFile, _Weighed, _Scrubbed):
        event = event.event
    return event


@dataclass(slots=True)
class _Weighed:
    """An event that holds ``weight`` bytes of a request's body (``emit(..., weight=...)``)."""

    event: Any
    weight: int


# The most bytes of request bodies the queue holds (``emit``'s ``weight``): the writer's secret
# scan reads a few MB of text a second, and a burst of large first turns (sub-agents starting,
# each with a 300 KB history) queued up to ~1 GB past the sessions' memory budget, minutes of
# writing that a stop then left unwritten. Past it, lines are dropped and counted as a full
# queue's. A lighter event (under ``_WEIGHED_FROM``) is not weighed: the common turn appends
# a few KB, and its emit takes no lock.
MAX_QUEUE_BYTES: Final = 32 * 1024 * 1024
_WEIGHED_FROM: Final = 64 * 1024

# How long the writer sleeps when it has nothing to write; events reach the disk within this.
POLL_S: Final = 0.05
_META_TYPE: Final = b'"type":"session_meta"'
_WRITTEN_KEYS_KEPT: Final = 256
_METAS_KEPT: Final = 4096
_BATCH_SESSIONS: Final = 64  # sessions gathered into one batch of writes
# Lines looked through for secrets at once: a literal found sends only its group line by line.
_SCAN_GROUP: Final = 16
_VALID_IDS_KEPT: Final = 4096  # session ids remembered as checked by emit()
# A session file not written for this long is closed: it no longer counts as being written, so
# retention may delete it once the session is forgotten too.
IDLE_CLOSE_S: Final = 600.0
# How often the writer, when idle, looks for files removed while held open (``rm`` of old logs
# on a full disk frees nothing while a descriptor holds the file): closed, their space freed.
REMOVED_CHECK_S: Final = 5.0


def _dumps_line(out: Any, default: Callable[[Any], Any]) -> bytes:
    """An event's line where orjson's fast path refused it: keys that are not strings (none of
    cachegate's own events has any) take orjson's slower path; content nested deeper than
    orjson writes (254 levels, which a request may hold) the standard library's (ASCII, as
    valid). A line that fails even so raises (its caller counts it lost)."""
    try:
        return orjson.dumps(out, default=default, option=_OPT_ANY_KEYS)
    except orjson.JSONEncodeError:
        return deep_dumps(out, default=default, separators=(",", ":")).encode() + b"\n"


class EventLogWriter:
    """Appends events to per-session JSONL files from one background thread.

    ``emit`` only enqueues (thread-safe, never blocks), so it is safe on the asyncio loop. Losses
    never raise: a full queue, a refused session id or a closed writer count in ``dropped``; a
    failed serialization or write (disk full, unwritable directory) counts in ``errors``. Each loss
    also calls ``on_loss(kind)`` with ``kind`` one of ``queue_full``, ``invalid_session``,
    ``closed``, ``serialize``, ``io``, and is logged (rate-limited).

    Callers must not mutate an event (or the lists it holds) after emitting it: it is serialized
    later, on the writer thread.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        fsync: FsyncMode = "none",
        fsync_interval_s: float = 1.0,
        max_queue: int = 10000,
        max_queue_bytes: int = MAX_QUEUE_BYTES,
        bodies: BodiesMode = "full",
        redact_secrets: bool = True,
        max_open_files: int | None = None,
        on_loss: Callable[[str], None] | None = None,
        secrets: Iterable[str] = (),
        metas_kept: int = _METAS_KEPT,
    ) -> None:
        if fsync not in _FSYNC_MODES:
            raise ValueError(f"fsync must be one of {', '.join(_FSYNC_MODES)}, not {fsync!r}")
        if bodies not in _BODIES_MODES:
            raise ValueError(f"bodies must be one of {', '.join(_BODIES_MODES)}, not {bodies!r}")
        if fsync_interval_s <= 0:
            raise ValueError("fsync_interval_s must be positive")
        if max_open_files is None:
            max_open_files = default_max_open_files()
        if max_queue < 1 or max_open_files < 1:
            raise ValueError("max_queue and max_open_files must be at least 1")
        self.log_dir = os.fspath(log_dir)
        self.fsync: FsyncMode = fsync
        self.fsync_interval_s = fsync_interval_s
        self.bodies: BodiesMode = bodies
        self.redact_secrets = redact_secrets
        if redact_secrets:
            prepare_scan()  # (before the first request, not on the event loop's time)
        # Exact values never written, whatever they look like and with or without redaction
        # (cachegate's own upstream key): as they appear inside a JSON string. Short ones would
        # take words out of the text and are not taken.
        self._secrets = _as_written(secrets)
        # A client's own keys as written (``_keys_written``): the same few keys, request after request
        self._written_keys: dict[tuple[str, ...], tuple[bytes, ...]] = {}
        self.on_loss = on_loss
        # Sessions that lost a line since their observer last looked (``take_broken``): its next
        # request line must not be coded against one that never reached the file. Shared with
        # the event loop: a dict (in the order of the losses, the oldest evicted first past the
        # bound) whose single operations are atomic under the GIL.
        self.broken: dict[str, None] = {}
        self._max_open = max_open_files
        self._shared_dir = True  # others may write into the log directory (known at start)
        # A deque and an Event rather than queue.Queue: emitting on the event loop then costs an
        # append, and the writer is woken only when it sleeps (no lock and notify per event).
        self._items: deque[Any] = deque()
        # Set while the writer thread takes events off the queue and writes them (an event it
        # took is in neither the queue nor a file meanwhile: ``flush_session``)
        self._writing = False
        self._max_queue = max_queue
        self._max_queue_bytes = max_queue_bytes
        self._queued_bytes = 0  # the weights queued (``_Weighed``), guarded by ``_lock``
        self._valid_ids: set[str] = set()  # ids emit() has checked (a set lookup, not a regex)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()  # guards the counters touched by emitting threads
        self._dropped = 0
        self._written = 0
        self._errors = 0
        # Per session, lines lost to write errors since its last line written (bounded: the
        # oldest go first)
        self._unwritten: OrderedDict[str, int] = OrderedDict()
        # Per session, lines lost for any reason (a full queue, a write error, a line that could
        # not be serialized or redacted) not yet told in its file: a ``lines_lost`` line goes
        # before its next lines (guarded by ``_lock``: the event loop counts a full queue's).
        # (``_Lost``: lines, requests, when the latest was lost, the request lines' numbers)
        self._lost_lines: OrderedDict[str, _Lost] = OrderedDict()
        self._syncs = 0
        # Owned by the writer thread only.
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._dirty: set[str] = set()
        self._written_at: dict[str, float] = {}  # monotonic time of each open file's last write
        self._last_sync = time.monotonic()
        self._last_warn: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        # Each session's meta line as last written, or lost, to its file: a file created anew
        # (its first line lost, or the directory gone and made again) starts with it all the same.
        # Kept for the sessions written most recently, as many as cachegate holds in memory (a
        # session it forgot writes its meta line again when it comes back).
        self._metas: OrderedDict[str, bytes] = OrderedDict()
        self._metas_kept = max(metas_kept, 1)
        self._fresh: set[str] = set()  # sessions whose file was empty when opened
        # New files whose directory entry is not synced yet (fsync = "line" or "interval": a
        # file's own fsync does not make its name durable; the directory's does, once)
        self._unsynced_names: set[str] = set()
        # The directory's own name, synced once it is made or found (``_check_dir``); False
        # where the file system refuses a directory's fsync
        self._parent_unsynced = True
        self._dir_sync = True
        # Each open file's (device, inode) and the size it had after the writer's last write:
        # a file removed, replaced or truncated by hand meanwhile is noticed before the next.
        self._files: dict[str, tuple[tuple[int, int], int]] = {}
        self._dir_id: tuple[int, int] | None = None  # the log directory's (device, inode)
        self._abs_dir = os.path.abspath(self.log_dir)
        self._claim_tried: tuple[tuple[int, int] | None, float] = (None, 0.0)  # (dir, when)
        # The pid another cachegate wrote in the lock of the log directory as it is now, which
        # it holds: this writer writes nothing there until it has the lock (``_claim``).
        self._locked_out: str | None = None
        self._removed_checked = time.monotonic()

    # -- counters -----------------------------------------------------------------------------

    @property
    def written(self) -> int:
        """Lines appended so far."""
        return self._written

    @property
    def dropped(self) -> int:
        """Events refused by ``emit`` (queue full, invalid session id, writer closed)."""
        return self._dropped

    @property
    def errors(self) -> int:
        """Events lost on the writer thread (serialization or OS errors)."""
        return self._errors

    @property
    def syncs(self) -> int:
        """``fsync`` calls made (0 with ``fsync="none"``)."""
        return self._syncs

    def open_sessions(self) -> frozenset[str]:
        """Session ids whose files the writer holds open: pass them to retention as active."""
        with self._lock:  # the writer changes ``_fds`` under it
            return frozenset(self._fds)

    def holds_open(self, session_id: str) -> bool:
        """Whether the writer holds the session's file open (asked from retention's thread)."""
        with self._lock:
            return session_id in self._fds

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Create the log directory (a failure is only logged) and start the writer thread."""
        if self._thread is not None:
            return
        self._shared_dir = _prepare_log_dir(self.log_dir, self._warn)
        if os.path.abspath(self.log_dir) in _GITIGNORE_OWED:  # (claim_log_dir said nothing)
            _write_gitignore(self.log_dir, self._warn)
        self._dir_id = _dir_id(self.log_dir)
        self._thread = threading.Thread(target=self._run, name="cachegate-eventlog", daemon=True)
        self._thread.start()

    def emit(
        self,
        session_id: str,
        event: dict[str, Any],
        first_in_file: bool = False,
        secrets: tuple[str, ...] = (),
        weight: int = 0,
    ) -> bool:
        """Queue ``event`` for ``session_id``'s file; False (and a counted drop) when refused.

        With ``first_in_file``, the event is written only if the file holds nothing yet when its
        turn comes (a session's meta line: one per file, also when an earlier process started
        the file); the writer thread looks, so the caller's thread makes no system call. With
        ``secrets``, those exact values are replaced in its line as the configured ones are (a
        key of the client's own that the upstream's error quotes). ``weight``: about how many
        bytes of a request's body the line holds (``MAX_QUEUE_BYTES``)."""
        if self._closed:
            self._drop("closed")
            return False
        if session_id not in self._valid_ids:
            if not valid_session_id(session_id):
                self._drop("invalid_session")
                return False
            if len(self._valid_ids) >= _VALID_IDS_KEPT:
                self._valid_ids.clear()
            self._valid_ids.add(session_id)
        queued = len(self._items)
        # A session's meta line (one per file, the line that names the file cachegate's log) may
        # go past the bound, up to twice it: a burst of new sessions dropped it.
        if queued >= self._max_queue and (not first_in_file or queued >= 2 * self._max_queue):
            if first_in_file:
                # Not lost: the observer offers it again with the session's next line (one
                # refused then is counted), and it is no gap in the file (counted once per
                # request of a burst, the metric read more lines lost than the files said).
                return False
            return self._refuse_full(session_id, event)
        # No wake-up call: waking a sleeping thread per event cost the event loop ~15% of its
        # CPU in the benchmark (GIL hand-offs). The writer polls instead (POLL_S), except with
        # fsync = "line", asked for durability: each line goes to the disk at once (a crash
        # took the exchanges of the last poll, answered and never written).
        item: Any = _Scrubbed(event, secrets) if secrets else event
        if weight >= _WEIGHED_FROM:
            with self._lock:
                # (one alone past the bound still goes: the queue is empty of such lines)
                full = self._queued_bytes and self._queued_bytes + weight > self._max_queue_bytes
                if not full:
                    self._queued_bytes += weight
            if full:
                return self._refuse_full(session_id, event)
            item = _Weighed(item, weight)
        self._items.append((session_id, time.time(), _FirstInFile(item) if first_in_file else item))
        if self.fsync == "line":
            self._wake.set()
        return True

    def _refuse_full(self, session_id: str, event: dict[str, Any]) -> bool:
        """A line the full queue refuses: dropped, counted, and told in its file later."""
        self._drop("queue_full")
        self._count_lost(session_id, 1, _is_request(event))
        return False

    def _put_control(self, item: Any) -> None:
        self._items.append(item)
        self._wake.set()

    @property
    def backlog(self) -> tuple[int, int]:
        """How many lines are queued, and about how many bytes of request bodies they hold."""
        return len(self._items), self._queued_bytes

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every event emitted before this call is written; False on timeout."""
        if self._thread is None or not self._thread.is_alive():
            return False
        marker = _Flush()
        self._put_control(marker)
        return marker.done.wait(timeout)

    def flush_session(self, session_id: str, timeout: float = 5.0) -> bool:
        """``flush``, when lines of ``session_id`` are queued or being written (else at once:
        True). For a reader of that session's file (compactions read back), which should not
        wait for the lines of every other session under load."""
        # The queue first, then the writer's hands: a line taken off the queue after the look
        # is in its hands until it is written (a line that is in neither was written)
        if any(type(item) is tuple and item[0] == session_id for item in list(self._items)):
            return self.flush(timeout)
        if self._writing:
            return self.flush(timeout)
        return True

    def close(self, timeout: float = 5.0) -> bool:
        """Stop accepting events, write what is queued, sync and close files; False on timeout."""
        self._closed = True
        thread = self._thread
        if thread is None:
            self._discard_queued()
            return True
        deadline = time.monotonic() + timeout
        self._put_control(_STOP)
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            # What is still queued goes with the process (the writer is a daemon thread): said,
            # and counted, where it went unsaid (answered exchanges missing from their files)
            left = [item for item in list(self._items) if isinstance(item, tuple)]
            for _ in left:
                self._loss("closed")
            logger.warning(
                "event log writer did not drain within %.1fs: %d queued line(s) of %d"
                " session(s), %d of them request line(s), were not written, and their files"
                " do not say so",
                timeout,
                len(left),
                len({item[0] for item in left}),
                sum(_is_request(_unwrapped(item[2])) for item in left),
            )
            return False
        self._discard_queued()
        with self._lock:
            untold = list(self._lost_lines.values())
            self._lost_lines.clear()  # (said once: close() is called again at exit)
        if untold:
            # Losses no file could be told of, even as the writer stopped (a disk still full, a
            # directory that cannot be made): said once more, in all (the warnings while it
            # ran came at most every 30 s)
            logger.warning(
                "event log: %d line(s) of %d session(s), %d of them request line(s), could not"
                " be written, and their files do not say so (a full disk, or a log directory"
                " that could not be written: see the warnings above)",
                sum(lost.lines for lost in untold),
                len(untold),
                sum(lost.requests for lost in untold),
            )
        return True

    # -- emitting side ------------------------------------------------------------------------

    def _drop(self, kind: str) -> None:
        with self._lock:
            self._dropped += 1
        self._loss(kind)
        self._warn(kind, "event log: event dropped (%s)", kind)

    def _count_lost(
        self, session_id: str, lines: int, requests: int, exchanges: Sequence[int] = ()
    ) -> None:
        """``lines`` of ``session_id``, ``requests`` of them request lines, will not reach its
        file: its next lines say so. ``exchanges``: the numbers of the request lines among them
        that were lost after they were queued, which later lines may have been coded against
        (a line the queue refused never was: the observer knew)."""
        now = time.time()
        with self._lock:
            lost = self._lost_lines
            held = lost.pop(session_id, _NO_LOSS)
            numbers = held.exchanges
            if exchanges and len(numbers) <= _LOST_NUMBERS_SAID:  # (one past them says "more")
                numbers = (*numbers, *exchanges)[: _LOST_NUMBERS_SAID + 1]
            lost[session_id] = _Lost(held.lines + lines, held.requests + requests, now, numbers)
            if len(lost) > _METAS_KEPT:
                del lost[next(iter(lost))]

    def _lost_told(self, session_id: str, told: _Lost) -> None:
        """``told`` of ``session_id``'s lost lines are in its file now (more may have come)."""
        with self._lock:
            held = self._lost_lines.pop(session_id, _NO_LOSS)
            if held.lines - told.lines > 0:
                self._lost_lines[session_id] = _Lost(
                    held.lines - told.lines,
                    held.requests - told.requests,
                    held.at,
                    held.exchanges[len(told.exchanges) :],
                )

    def _tell_lost(self) -> None:
        """Before the writer stops: the losses no later line of their session told (a line
        that could not be serialized, a full queue: the disk may take this one)."""
        with self._lock:
            pending = list(self._lost_lines)
        for session_id in pending:
            # (not into a file written, then removed meanwhile, by hand or by retention: not
            # made again for this line alone; one never made, its first lines lost, is)
            path = session_log_path(self.log_dir, session_id)
            if session_id not in self._metas or os.path.exists(path):
                self._write_lines(session_id, [])

    def _release(self, weight: int) -> None:
        with self._lock:
            self._queued_bytes -= weight

    def _discard_queued(self) -> None:
        """Count events that raced with ``close`` and can no longer be written."""
        while True:
            try:
                item = self._items.popleft()
            except IndexError:
                return
            if isinstance(item, tuple):
                if type(item[2]) is _Weighed:
                    self._release(item[2].weight)
                self._drop("closed")
            elif isinstance(item, _Flush):
                item.done.set()

    def _loss(self, kind: str) -> None:
        if self.on_loss is None:
            return
        try:
            self.on_loss(kind)
        except Exception:  # a metrics hook must not break logging, let alone the relay
            logger.exception("event log on_loss callback failed")

    def _warn(self, kind: str, msg: str, *args: object) -> None:
        """Log a loss at most once per kind every 30 s, with the number suppressed meanwhile."""
        now = time.monotonic()
        with self._lock:
            last = self._last_warn.get(kind)
            if last is not None and now - last < _WARN_EVERY_S:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last_warn[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            msg += " (%d similar suppressed)"
            args = (*args, suppressed)
        logger.warning(msg, *args)

    # -- writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        in_hand: dict[str, list[bytes]] = {}  # the batch being written, until it is
        try:
            while True:
                timeout = POLL_S
                if self.fsync == "interval" and self._dirty:
                    timeout = min(
                        POLL_S,
                        max(0.0, self._last_sync + self.fsync_interval_s - time.monotonic()),
                    )
                if not self._items:
                    self._wake.clear()
                    if not self._items:  # flush() and close() wake the writer; events wait a poll
                        self._wake.wait(timeout)
                    if (
                        self.fsync == "interval"
                        and self._dirty
                        and self._last_sync + self.fsync_interval_s <= time.monotonic()
                    ):
                        self._sync_dirty()
                    if self._fds:
                        self._close_idle()
                        if time.monotonic() - self._removed_checked >= REMOVED_CHECK_S:
                            self._close_removed()
                    if not self._items:
                        continue
                # Before every batch, a stat: is the log directory still the one written
                # into? (lines to files in a directory removed meanwhile go nowhere)
                self._check_dir()
                self._writing = True
                item = self._items.popleft()
                if item is _STOP:
                    self._tell_lost()
                    break
                if isinstance(item, _Flush):
                    self._writing = False
                    item.done.set()
                    continue
                # The events queued now, up to a control item: one write per session for all of
                # its lines (in order), not one system call per event. fsync "line": one at a time.
                batch: dict[str, list[bytes]] = {}
                in_hand = batch  # what a crash below would lose, to be counted
                made: list[_Made] = []  # what the secret scan may have to redact
                # lines to take exact values out of, with their own keys (a client's)
                exact: list[tuple[list[bytes], int, tuple[str, ...]]] = []
                # Meta lines not written (the file, an earlier process's, has its own): kept
                # all the same, to begin the file anew should it go (removed, rotated).
                kept_metas: dict[str, list[bytes]] = {}
                while True:
                    session_id, ts, event = item
                    target = batch
                    secrets: tuple[str, ...] = ()
                    if type(event) is _FirstInFile:
                        event = event.event
                        if not self._file_is_empty(session_id, batch):
                            target = kept_metas
                    if type(event) is _Weighed:
                        self._release(event.weight)
                        event = event.event
                    if type(event) is _Scrubbed:  # (a meta line may be both)
                        event, secrets = event.event, event.secrets
                    encoded = self._line(session_id, ts, event)
                    if encoded is not None:
                        lines = target.setdefault(session_id, [])
                        if self.redact_secrets:
                            made.append((session_id, lines, len(lines), encoded[1]))
                        if secrets or self._secrets:
                            exact.append((lines, len(lines), secrets))
                        lines.append(encoded[0])
                    if (
                        self.fsync == "line"
                        or len(batch) >= _BATCH_SESSIONS
                        or not self._items
                        or not isinstance(self._items[0], tuple)
                    ):
                        break
                    item = self._items.popleft()
                # The exact values first: a pattern that took only a part of one (a key with a
                # ``:`` or ``!`` in it, after ``Bearer``) would leave the rest to be written.
                # A line's own keys with the configured ones, longest first (one may hold
                # another: the shorter replaced first would leave the rest of the longer);
                # each line searched once.
                for lines, at, secrets in exact:
                    keys = self._keys_written(secrets) if secrets else self._secrets
                    lines[at] = _without(lines[at], keys)
                if made:
                    self._redact(made)
                for session_id, lines in kept_metas.items():
                    if lines:
                        self._remember_meta(session_id, lines[-1])
                for session_id, lines in batch.items():
                    if lines:
                        if lines[0].find(_META_TYPE, 0, 64) >= 0:
                            self._remember_meta(session_id, lines[0])
                        elif session_id in self._metas:  # (kept by when last written)
                            self._metas.move_to_end(session_id)
                        self._write_lines(session_id, lines)
                        lines.clear()  # written: no longer in hand
                self._writing = False
                if (
                    self.fsync == "interval"
                    and time.monotonic() - self._last_sync >= self.fsync_interval_s
                ):
                    self._sync_dirty()
        except Exception:  # never die silently: what it had in hand or queued, and everything
            # emitted from now on, is counted as lost at once (not held until close(), unseen)
            logger.exception("event log writer crashed")
            self._closed = True
            for lines in in_hand.values():
                for _ in lines:
                    self._drop("closed")
            self._discard_queued()
        finally:
            if self.fsync != "none":
                self._sync_dirty()
            for sid in list(self._fds):
                self._close_fd(sid)

    def _line(self, session_id: str, ts: float, event: Any) -> tuple[bytes, Any] | None:
        """The serialized line, not yet scanned for secrets, and the object it was made from."""
        try:
            return self._serialize(ts, event)
        except Exception as exc:  # orjson.JSONEncodeError, a non-dict event, a hostile __str__
            self._mark_broken(session_id)
            self._count_lost(session_id, 1, _is_request(event), _request_number(event))
            self._lose("serialize", "event log: cannot serialize event for %s: %s", session_id, exc)
            return None

    def _redact(self, made: list[_Made]) -> None:
        """Redact the batch's lines that need it, in place.

        The lines are looked through for the literals every secret pattern and credential key
        contains (``line_may_hold_secret``) a group at a time (a line ends in a newline, so no
        literal spans two lines): a group without one, the usual case, costs one look where
        each line would cost its own, and a group with one is looked through line by line. A
        line that has a literal is serialized again from its object, redacted field by field;
        one that cannot be redacted is dropped, never written as it was."""
        dropped: list[list[bytes]] = []
        for first in range(0, len(made), _SCAN_GROUP):
            group = made[first : first + _SCAN_GROUP]
            if not line_may_hold_secret(b"".join([lines[at] for _, lines, at, _ in group])):
                continue
            for session_id, lines, at, out in group:
                if not line_may_hold_secret(lines[at]):
                    continue
                try:
                    # From the line as it stands (exact secrets taken out already), not from
                    # the event: a secret's value must not come back with the rest of it.
                    event = _read_back(lines[at])
                    lines[at] = _dumps_line(deep_call(redact, event), _redacted_str)
                except Exception as exc:  # a hostile __str__, say
                    self._mark_broken(session_id)
                    self._count_lost(session_id, 1, _is_request(out), _request_number(out))
                    self._lose(
                        "serialize", "event log: cannot redact event for %s: %s", session_id, exc
                    )
                    lines[at] = b""
                    dropped.append(lines)
        for lines in dropped:
            lines[:] = [line for line in lines if line]

    def _mark_broken(self, session_id: str) -> None:
        broken = self.broken
        broken.pop(session_id, None)  # to the end: the most recent loss
        if len(broken) >= _BROKEN_LIMIT:  # sessions never seen again: bounded, oldest out
            # (the event loop may take an entry meanwhile: the iteration can then fail)
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                del broken[next(iter(broken))]
        broken[session_id] = None

    def take_broken(self, session_id: str) -> bool:
        """Whether ``session_id`` lost a line since the last call that said so (then forgotten)."""
        return self.broken.pop(session_id, _NOT_BROKEN) is not _NOT_BROKEN

    def _keys_written(self, secrets: tuple[str, ...]) -> tuple[bytes, ...]:
        """``_as_written(secrets)``, kept for the next lines with the same keys."""
        written = self._written_keys.get(secrets)
        if written is None:
            if len(self._written_keys) >= _WRITTEN_KEYS_KEPT:
                self._written_keys.clear()
            both = set(_as_written(secrets)) | set(self._secrets)
            written = self._written_keys[secrets] = tuple(sorted(both, key=len, reverse=True))
        return written

    def _file_is_empty(self, session_id: str, batch: dict[str, list[bytes]]) -> bool:
        """Whether ``session_id``'s file holds no line, written or in ``batch``. A file that
        cannot be opened counts as empty: the write will fail and count the loss."""
        if batch.get(session_id):
            return False
        if self._locked_out is not None and session_id not in self._fds:
            # Another cachegate holds the directory: its file is looked at, never made there
            # (the lines go nowhere unless the lock is this one's again when they are written).
            try:
                fd = os.open(  # (not waiting on a FIFO planted there: read as no file)
                    session_log_path(self.log_dir, session_id),
                    os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                )
            except OSError:
                return True
            try:
                return not stat.S_ISREG(os.fstat(fd).st_mode) or not _holds_lines(fd)
            except OSError:
                return True
            finally:
                os.close(fd)
        try:
            return not _holds_lines(self._fd(session_id))
        except OSError:
            return True

    def _remember_meta(self, session_id: str, line: bytes) -> None:
        metas = self._metas
        # (a copy its size: orjson's result keeps its 4 KiB buffer, 16 MiB for the 4,096 kept;
        # bytes() of bytes is the same object)
        metas[session_id] = bytes(memoryview(line))
        metas.move_to_end(session_id)
        if len(metas) > self._metas_kept:
            del metas[next(iter(metas))]

    def _write_lines(self, session_id: str, lines: list[bytes]) -> None:
        if self._locked_out is not None:
            now = _dir_id(self.log_dir)
            if now is not None:
                self._claim(now)  # (at most every CLAIM_RETRY_S)
            if self._locked_out is not None:
                # Another cachegate took the directory while it was gone (removed and made
                # again) or its lock file was: two processes writing one session's file
                # interleave their exchange numbers, so this one's lines are lost, and said so,
                # until the lock is its own.
                self._close_fd(session_id)
                self._mark_broken(session_id)
                events, requests, numbers = _lost_in(lines)
                if events:
                    self._count_lost(session_id, events, requests, numbers)
                for _ in range(events):  # (a meta line is no loss: written again, as the file's)
                    self._lose(
                        "locked_out",
                        "event log: another cachegate (pid %s) holds %s now; this one's lines"
                        " are lost until it stops (cachegate_event_log_lost_total)",
                        self._locked_out,
                        self.log_dir,
                    )
                return
        count = len(lines)
        told = _NO_LOSS  # lost lines (and requests) this write tells of (``_count_lost``)
        if self._lost_lines:
            with self._lock:
                told = self._lost_lines.get(session_id, told)
            if told.lines:  # at the start of its next lines (after a meta line: it opens the file)
                at = 1 if lines and lines[0].find(_META_TYPE, 0, 64) >= 0 else 0
                lines = [*lines[:at], _lost_line(told), *lines[at:]]
        if not lines:
            return
        data = lines[0] if len(lines) == 1 else b"".join(lines)
        try:
            if session_id in self._fds:
                self._check_file(session_id)
            fd = self._fd(session_id)
            if session_id in self._fresh:  # a new file: its meta line first, lost or not
                self._fresh.discard(session_id)
                meta = self._metas.get(session_id)
                if meta is not None and lines[0].find(_META_TYPE, 0, 64) < 0:
                    data = meta + data
                    self._mark_broken(session_id)  # its earlier lines are not in this file
            view = memoryview(data)
            done = 0
            try:
                while view:  # one write for the lines; the loop only runs again on a short write
                    n = os.write(fd, view)
                    done += n
                    view = view[n:]
            except OSError:
                if done:  # a full disk took part of the lines: no torn line left mid-file
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, os.fstat(fd).st_size - done)
                raise
        except OSError as exc:
            self._close_fd(session_id)  # reopen next time: the directory may come back
            if exc.errno in (errno.ENOSPC, errno.EDQUOT) and self._fds:
                self._close_removed()  # space may have been freed by hand already
            self._mark_broken(session_id)
            # (this write's marker and meta line aside)
            # (counted as the file will tell of them: its meta line is no loss, written again
            # at the file's start; the metric and the message counted it, one more than the file)
            events, requests, numbers = _lost_in(lines)
            if events:
                self._count_lost(session_id, events, requests, numbers)
            for _ in range(events):
                self._lose("io", "event log: cannot write %s: %s", session_id, exc)
            if not events:
                self._warn("io", "event log: cannot write %s: %s", session_id, exc)
            if events:
                unwritten = self._unwritten
                unwritten[session_id] = unwritten.pop(session_id, 0) + events
                if len(unwritten) > _METAS_KEPT:
                    del unwritten[next(iter(unwritten))]
            return
        if told.lines:
            self._lost_told(session_id, told)
        lost = self._unwritten.pop(session_id, 0) if self._unwritten else 0
        if _GITIGNORE_OWED or _PID_OWED:
            mend_log_dir(self.log_dir)
        if lost:  # (a full disk, an unwritable file or directory: said once it is over for it)
            self._warn(
                "io_again",
                "event log: writing %s again; %d line(s) of it were lost meanwhile"
                " (cachegate_event_log_lost_total)",
                session_id,
                lost,
            )
        self._written += count
        self._written_at[session_id] = time.monotonic()
        held = self._files.get(session_id)
        if held is not None:
            self._files[session_id] = (held[0], held[1] + len(data))
        if self.fsync == "line":
            self._sync(session_id, fd)
        elif self.fsync == "interval":
            self._dirty.add(session_id)

    def _serialize(self, ts: float, event: Any) -> tuple[bytes, Any]:
        if not isinstance(event, dict):
            raise TypeError(f"an event must be a dict, not {type(event).__name__}")
        keys = iter(event)
        if next(keys, None) == "ts" and next(keys, None) == "type":
            out = event  # already in line order (cachegate's own events): no copy
        else:
            out = {"ts": event.get("ts", ts), "type": event.get("type")}
            out.update(event)
        if self.bodies == "metadata":
            out = strip_bodies(out)
        default = _redacted_str if self.redact_secrets else str
        try:
            line = orjson.dumps(out, default=default, option=orjson.OPT_APPEND_NEWLINE)
        except orjson.JSONEncodeError:
            line = _dumps_line(out, default)
        # Serialized first; with redact_secrets, the batch's lines are then looked through for
        # secrets (``_redact``).
        return line, out

    def _lose(self, kind: str, msg: str, *args: object) -> None:
        self._errors += 1
        self._loss(kind)
        self._warn(kind, msg, *args)

    def _fd(self, session_id: str) -> int:
        fd = self._fds.get(session_id)
        if fd is not None:
            with self._lock:
                self._fds.move_to_end(session_id)
            return fd
        while len(self._fds) >= self._max_open:
            self._close_fd(next(iter(self._fds)))
        path = session_log_path(self.log_dir, session_id)
        try:
            fd = os.open(path, _OPEN_FLAGS, 0o600)
        except FileNotFoundError:  # the directory is gone (or never was): made again, once
            self._check_dir()
            fd = os.open(path, _OPEN_FLAGS, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or not self._fds:
                raise
            # Out of file descriptors (the connections took them, ``ulimit -n`` is low): the
            # files held longest without a write are given back, and fewer held from now on;
            # else every new session's lines were lost until files idled out, ten minutes on.
            self._max_open = max(1, len(self._fds) // 2)
            while len(self._fds) >= self._max_open:
                self._close_fd(next(iter(self._fds)))
            fd = os.open(path, _OPEN_FLAGS, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (_UID is not None and st.st_uid != _UID):
                # A hard link (or a device, a FIFO) planted under a session's name would have
                # the log appended to a file elsewhere: O_NOFOLLOW stops only symbolic links.
                # Another user's file never; a second link to one of the user's own (a snapshot
                # backup's) only where nobody else can write into the directory.
                raise OSError(f"{path} is not a regular file of this user's own")
            if st.st_nlink > 1 and (self._shared_dir or _others_may_write(self.log_dir)):
                # (the directory's mode looked at again: a chmod since start counts)
                raise OSError(
                    f"{path} has {st.st_nlink} links, and others may write into {self.log_dir}"
                )
            if st.st_size and not _begins_as_log(fd):
                # Another tool's file of the same name (an agent's own transcript, named by the
                # session id it sends): lines appended to it were in no report, which judges a
                # file by its first line, and the other tool's file had cachegate's in it.
                raise OSError(
                    f"{path} is another program's file (its first line is not a cachegate"
                    " event): not written into; move it, or give cachegate its own log directory"
                )
            size = _terminate_torn_line(fd)
            if size == 0:
                self._fresh.add(session_id)
                if self.fsync != "none" and self._dir_sync:
                    self._unsynced_names.add(session_id)
        except OSError:
            os.close(fd)
            raise
        with self._lock:
            self._fds[session_id] = fd
        self._files[session_id] = ((st.st_dev, st.st_ino), size)
        return fd

    def _check_file(self, session_id: str) -> None:
        """Before writing to a file held open: was it removed or replaced (``rm``, logrotate's
        rename), or truncated (``: > file``, logrotate's ``copytruncate``) meanwhile? Lines
        written on would go to no file, or after a hole with no meta line and no bases for the
        delta coding. A new file is started (its meta line first), or the truncated one goes
        on as a new one; either way the session's next request line is written in full."""
        held = self._files.get(session_id)
        try:
            st = os.stat(session_log_path(self.log_dir, session_id), follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        except OSError:  # cannot be looked at (a directory made unreadable, chmod 000): the
            return  # file held open is still written, and was not removed
        if held is None or (st is not None and (st.st_dev, st.st_ino) == held[0]):
            if held is None or st is None or st.st_size >= held[1]:
                return
            fd = self._fds[session_id]
            self._warn(  # (its own kind: a removal elsewhere does not silence it)
                "file_truncated",
                "event log: %s was truncated while cachegate wrote it; writing on from its end",
                session_id + ".jsonl",
            )
            meta = self._metas.get(session_id)
            if st.st_size < (len(meta) if meta is not None else 1):  # its meta line gone too
                self._fresh.add(session_id)
            size = _terminate_torn_line(fd)
            self._files[session_id] = (held[0], size)
            self._mark_broken(session_id)
            return
        self._warn(
            "file_replaced",
            "event log: %s was removed or replaced while cachegate wrote it; a new one is started",
            session_id + ".jsonl",
        )
        self._mark_broken(session_id)
        self._close_fd(session_id)

    def _check_dir(self) -> None:
        """Make the log directory again when it is gone, as at start (0700, ``.gitignore``), and
        drop the files held open in one that was removed or replaced: their lines would go to
        files no directory names any more."""
        now = _dir_id(self.log_dir)
        if now is not None and now == self._dir_id:
            if self._abs_dir in _WANTED and (
                _CLAIMED.get(self._abs_dir) != now or _lock_removed(self._abs_dir)
            ):
                # not writable when serve started: the lock, once it is; or the lock file was
                # deleted (a retention job's ``find -delete``): a second cachegate would be let in
                self._claim(now)
            return
        for session_id in list(self._fds):
            self._close_fd(session_id)
        changed = self._dir_id is not None
        if changed:
            # Each session's next request line goes in full: the lines its delta coding
            # would name went with the directory.
            for session_id in self._metas:
                self._mark_broken(session_id)
        # Made again when gone; looked at again when replaced (another directory, maybe of
        # another owner or open to others: what the writer refuses there depends on it).
        self._shared_dir = _prepare_log_dir(self.log_dir, self._warn)
        self._parent_unsynced = True  # (made again: its name to be made durable too)
        now = _dir_id(self.log_dir)
        self._dir_id = now
        if now is not None and self._abs_dir in _WANTED and _CLAIMED.get(self._abs_dir) != now:
            self._claim(now)  # the lock went with the directory it was in

    def _claim(self, now: tuple[int, int]) -> None:
        """Take the lock ``serve`` took at start on the log directory as it is now (made again,
        replaced, or not writable at start); say so when another cachegate has it. Tried again
        at most every ``CLAIM_RETRY_S`` for one directory (the lock file cannot be made there,
        or another process holds it until it exits)."""
        tried, at = self._claim_tried
        clock = time.monotonic()
        if tried == now and clock - at < CLAIM_RETRY_S:
            return
        self._claim_tried = (now, clock)
        try:
            holder = claim_log_dir(self.log_dir)
        except UnsafeLockFile as exc:  # planted since: no line goes there until it is gone
            self._warn("claim", "event log: %s: this cachegate writes no line there", exc)
            self._locked_out = UNKNOWN_HOLDER
            return
        if holder is not None and self._locked_out is None:
            self._warn(
                "claim",
                "log directory %s was made again, replaced or made writable, and another"
                " cachegate (pid %s) holds it now: this one writes no line there until it stops",
                self.log_dir,
                holder,
            )
        elif holder is None and self._locked_out is not None:
            logger.warning("event log: %s is this cachegate's again; writing on", self.log_dir)
        self._locked_out = holder

    def _close_idle(self) -> None:
        """Close the files not written for ``IDLE_CLOSE_S`` (the least recently written come
        first in ``_fds``)."""
        oldest = time.monotonic() - IDLE_CLOSE_S
        while self._fds:
            session_id = next(iter(self._fds))
            if self._written_at.get(session_id, 0.0) > oldest:
                return
            # (what happens to it until the session writes again goes unseen: logrotate's
            # nightly run. Its next request line goes in full, one line per idle ten minutes;
            # marked before the file is let go, so that no one sees it closed and not marked)
            self._mark_broken(session_id)
            self._close_fd(session_id)

    def _close_removed(self) -> None:
        """Close the files removed while held open (no name left): a user who deletes old logs
        to free a full disk gets the space back now, not when each session writes again or
        its file has been idle for ``IDLE_CLOSE_S``. A session written again starts a new file
        with its meta line, its next request line in full, as after ``_check_file``; which
        also runs here for the others, so that a file renamed or truncated (logrotate) between
        a session's bursts is noticed before the next: its lines, coded against lines of the
        old file as they come, were each skipped by ``replay``, a burst of sub-agents whole."""
        self._removed_checked = time.monotonic()
        for session_id, fd in list(self._fds.items()):
            try:
                removed = os.fstat(fd).st_nlink == 0
            except OSError:
                removed = True
            if removed:
                self._mark_broken(session_id)
                self._close_fd(session_id)
            else:
                self._check_file(session_id)

    def _close_fd(self, session_id: str) -> None:
        with self._lock:
            fd = self._fds.pop(session_id, None)
        self._written_at.pop(session_id, None)
        self._files.pop(session_id, None)
        self._fresh.discard(session_id)
        if fd is None:
            return
        if session_id in self._dirty:
            self._sync(session_id, fd)
        self._unsynced_names.discard(session_id)
        with contextlib.suppress(OSError):
            os.close(fd)

    def _sync(self, session_id: str, fd: int) -> None:
        self._dirty.discard(session_id)
        try:
            os.fsync(fd)
        except OSError as exc:
            self._warn("fsync", "event log: fsync failed for %s: %s", session_id, exc)
            return
        self._syncs += 1
        if self._dir_sync and session_id in self._unsynced_names and self._sync_names():
            self._unsynced_names.discard(session_id)  # (tried again with its next line if not)

    def _sync_names(self) -> bool:
        """Make a new file's name durable: its directory synced, and the directory's own parent
        once after the writer made or found it (a directory made anew has a name too)."""
        targets = [self.log_dir]
        if self._parent_unsynced:
            targets.append(os.path.dirname(self._abs_dir) or os.sep)
        for target in targets:
            try:
                dir_fd = os.open(target, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            except OSError as exc:
                if exc.errno in _NO_DIR_SYNC and target != self.log_dir:
                    # (the parent on a file system that syncs no directory, the log directory
                    # a mount point on another that does: its own files' names still synced)
                    self._parent_unsynced = False
                    continue
                if exc.errno in _NO_DIR_SYNC:  # (a file system that syncs no directory: some
                    # network ones; not tried again with every line, nor warned of every 30 s)
                    self._unsynced_names.clear()
                    self._dir_sync = False
                    return True
                self._warn("fsync", "event log: fsync failed for %s: %s", target, exc)
                return False
        self._parent_unsynced = False
        return True

    def _sync_dirty(self) -> None:
        for sid in list(self._dirty):
            fd = self._fds.get(sid)
            if fd is None:
                self._dirty.discard(sid)
            else:
                self._sync(sid, fd)
        self._last_sync = time.monotonic()


LOCK_NAME: Final = ".cachegate.lock"
# The lock file this process holds in each directory it claimed, open until it exits (or
# until the directory, made again, is claimed again: the old one locks nothing still written).
_CLAIMS: dict[str, int] = {}
# The directories they lock (absolute paths), each with the (device, inode) it had then, or
# that have no locks to take; and those this process asked for (its writer takes the lock again
# once the directory is made again, or writable).
_CLAIMED: dict[str, tuple[int, int] | None] = {}
_WANTED: set[str] = set()
# Directories whose lock file's process id, or whose ``.gitignore``, could not be written (a
# full disk): written once lines can be written again (``mend_log_dir``).
_PID_OWED: set[str] = set()
_GITIGNORE_OWED: set[str] = set()


def _write_pid(fd: int) -> bool:
    """This process's id into its lock file, written over what was there and then cut to its
    length: a failed write leaves the old text, not an empty file."""
    pid = b"%d\n" % os.getpid()
    try:
        if os.pwrite(fd, pid, 0) != len(pid):
            return False
        os.ftruncate(fd, len(pid))
    except OSError:
        return False
    return True


def mend_log_dir(log_dir: str) -> None:
    """What a full disk kept from being written in ``log_dir`` when it was prepared or claimed
    (its ``.gitignore``, the lock file's process id), written now: the writer calls it once a
    line could be written there again."""
    path = os.path.abspath(log_dir)
    if path in _PID_OWED:
        fd = _CLAIMS.get(path)
        if fd is None or _write_pid(fd):
            _PID_OWED.discard(path)
    if path in _GITIGNORE_OWED:
        _write_gitignore(log_dir, lambda *_: None)


def claim_log_dir(log_dir: str | os.PathLike[str]) -> str | None:
    """Claim ``log_dir`` for this process: an exclusive ``flock`` on its ``.cachegate.lock``,
    held until the process exits (the kernel lets go of it even after a crash). Two processes
    writing one directory number a session's exchanges each on its own, and its log no longer
    reads as one conversation. Returns None when claimed, or when it cannot be looked at (no
    directory can be made there, no ``flock`` on this system: the writer then says what is
    wrong); else what the holder wrote, as text: its process id, followed by ``stopping`` once
    it is stopping (``mark_stopping``)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        return None
    path = os.path.abspath(log_dir)
    _WANTED.add(path)
    shared = _prepare_log_dir(log_dir, lambda *_: None)  # the writer warns, when it starts
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    lock = os.path.join(log_dir, LOCK_NAME)
    made = True
    try:
        fd = os.open(lock, flags | os.O_EXCL, 0o600)  # made by this call: its own, whatever
    except FileExistsError:  # (a file system may say of its owner) ...or found there: judged
        made = False
        try:
            fd = os.open(lock, flags, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP and os.path.islink(lock):  # planted under its name
                raise UnsafeLockFile(f"{lock} is a symbolic link; remove it") from None
            return None
    except OSError:
        return None
    st = None
    with contextlib.suppress(OSError):
        st = os.fstat(fd)
    if made and st is not None and _UID is not None and st.st_uid != _UID:
        # Made just now, and said to be another user's: the file system gives every file one
        # owner (a network or Windows share); its session files would be refused the same way.
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(lock)
        raise UnsafeLockFile(
            f"{lock} is on a file system that says the files cachegate makes are another user's"
            f" (uid {st.st_uid}, this process is {_UID}): a network or Windows share? give"
            " cachegate a log directory on a local disk"
        )
    problem = _lock_file_problem(st, shared) if st is not None and not made else None
    if problem is not None:
        # Planted by another user of a shared directory (a hard link to one of the user's
        # files, which the pid written below would have overwritten): refused, as a session's
        # file would be (``EventLogWriter._fd``).
        os.close(fd)
        raise UnsafeLockFile(f"{lock} {problem}; remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.read(fd, 32).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        return holder or UNKNOWN_HOLDER
    except OSError:  # a file system without locks: nothing to say (nor to ask again)
        os.close(fd)
        _CLAIMED[path] = _dir_id(path)
        return None
    if _write_pid(fd):
        _PID_OWED.discard(path)
    else:  # (a full disk: written once there is room, ``mend_log_dir``)
        _PID_OWED.add(path)
    old = _CLAIMS.pop(path, None)
    _CLAIMS[path] = fd
    if old is not None:
        with contextlib.suppress(OSError):
            os.close(old)
    _CLAIMED[path] = _dir_id(path)
    return None


class UnsafeLockFile(Exception):
    """The log directory's lock file is not one cachegate may write (``claim_log_dir``)."""


def _lock_file_problem(st: os.stat_result, shared: bool) -> str | None:
    """What is wrong with a lock file found so, or None: not a regular file, another user's,
    or, in a directory others may write into (``shared``), a file with another name too (a
    hard link: a snapshot backup's own links elsewhere are no danger)."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if _UID is not None and st.st_uid != _UID:
        return f"belongs to another user (uid {st.st_uid}, this process is {_UID})"
    if st.st_nlink > 1 and shared:
        return "has another name too (a hard link to another file)"
    return None


STOPPING: Final = "stopping"  # after the holder's process id in a lock file: it is stopping
UNKNOWN_HOLDER: Final = "?"  # a held lock file with nothing in it (its holder's disk full)


def mark_stopping() -> None:
    """Say in the lock file of every log directory this process claimed that it is stopping
    (``<pid> stopping``): a cachegate started meanwhile on the same directory, a restart, waits
    for the lock while this one's answers in flight finish (see ``claim_log_dir``)."""
    mark = b"%d %s\n" % (os.getpid(), STOPPING.encode())
    _PID_OWED.clear()  # (the mark says the id: a later line's mend must not write over it)
    for fd in list(_CLAIMS.values()):
        with contextlib.suppress(OSError):
            # written over the process id, then cut to its length: never read empty
            os.pwrite(fd, mark, 0)
            os.ftruncate(fd, len(mark))


def _lock_removed(path: str) -> bool:
    """Whether the lock file this process holds for ``path`` was deleted (no name left)."""
    fd = _CLAIMS.get(path)
    if fd is None:
        return False
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


def _dir_id(path: str) -> tuple[int, int] | None:
    """A directory's (device, inode), or None when there is no directory there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _redacted_str(obj: Any) -> str:
    return redact_text(str(obj))


_UID: Final = os.geteuid() if hasattr(os, "geteuid") else None
GITIGNORE: Final = "# cachegate's session logs: prompts, tool outputs, answers. Not for git.\n*\n"


def _others_may_write(directory: str) -> bool:
    """Whether users other than this one may write into ``directory`` (or it cannot be told)."""
    try:
        return _writable_by_others(os.stat(directory))
    except OSError:
        return True


def _writable_by_others(st: os.stat_result) -> bool:
    return bool(st.st_mode & 0o022) or (_UID is not None and st.st_uid != _UID)


def make_private_dirs(path: str | os.PathLike[str]) -> None:
    """``os.makedirs(path, exist_ok=True)``, each directory it makes 0700 (``makedirs`` gives
    the mode to the last one only, its parents the umask's: 0777 under ``umask 000``, where any
    user could rename the log directory away and put one of theirs in its place)."""
    path = os.path.abspath(path)
    missing: list[str] = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # (made meanwhile by another process)
            os.mkdir(directory, 0o700)


def _prepare_log_dir(log_dir: str | os.PathLike[str], warn: Callable[..., None]) -> bool:
    """Create the log directory (0700) with a ``.gitignore`` that ignores everything in it: the
    default directory is relative, often inside the repository an agent works in, and the logs
    hold its prompts and tool outputs. An existing directory is left as it is, with a warning
    when other users may read it. Failures are only logged (the writer counts lost lines).
    Returns whether others may write into the directory (another owner, or group or world
    write permission)."""
    try:
        try:
            os.mkdir(log_dir, 0o700)
        except FileNotFoundError:  # its parents first, then the directory itself, as here
            make_private_dirs(os.path.dirname(os.path.abspath(log_dir)))
            os.mkdir(log_dir, 0o700)
    except FileExistsError:  # (also when another process made it meanwhile)
        try:
            st = os.stat(log_dir)
        except OSError:
            return True
        mode = st.st_mode
        if not stat.S_ISDIR(mode):  # said at start, not at the first lost line
            warn(
                "mkdir",
                "cannot create log directory %s: a file of that name is in the way",
                log_dir,
            )
            return True
        if os.name == "posix" and mode & 0o077:
            warn(
                "mode",
                "log directory %s can be read by other users (mode %o): the logs hold prompts "
                "and tool outputs; chmod 700 it",
                log_dir,
                stat.S_IMODE(mode),
            )
        return _writable_by_others(st)
    except OSError as exc:
        warn("mkdir", "cannot create log directory %s: %s", log_dir, exc)
        return True
    _write_gitignore(log_dir, warn)
    return False


def _write_gitignore(log_dir: str | os.PathLike[str], warn: Callable[..., None]) -> None:
    """The log directory's ``.gitignore``, made with it. One that could not be written whole (a
    full disk) is removed, not left empty (git would list the logs), and written once lines
    can be written there again (``mend_log_dir``)."""
    path = os.path.join(log_dir, ".gitignore")
    owed = os.path.abspath(log_dir)
    data = GITIGNORE.encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # (made meanwhile, by the user or another cachegate)
        _GITIGNORE_OWED.discard(owed)
        return
    except OSError as exc:
        _GITIGNORE_OWED.add(owed)
        warn("gitignore", "cannot write %s/.gitignore: %s", log_dir, exc)
        return
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        _GITIGNORE_OWED.add(owed)
        warn(
            "gitignore",
            "cannot write %s/.gitignore: %s; the logs are not kept out of git until it is",
            log_dir,
            exc.strerror or exc,
        )
    else:
        _GITIGNORE_OWED.discard(owed)
    finally:
        os.close(fd)


def log_dir_problem(log_dir: str) -> str | None:
    """Why nothing could be written in ``log_dir`` (made as the writer makes it, when missing),
    or None when a file can be created there: for ``demo``, which has nothing to show without
    its logs."""
    said: list[str] = []

    def note(kind: str, msg: str, *args: object) -> None:
        if kind == "mkdir":
            said.append(msg % args)

    _prepare_log_dir(log_dir, note)
    if said:
        return said[0]
    try:
        fd, probe = tempfile.mkstemp(dir=log_dir, prefix=".probe-")
    except OSError as exc:
        return f"cannot write in log directory {log_dir}: {exc.strerror or exc}"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


LOST_TYPE: Final = "lines_lost"


def lost_lines(events: Iterable[dict[str, Any]]) -> int:
    """How many lines a session's log says it lost (its ``lines_lost`` lines)."""
    return _lost_sum(events, "lines")


def lost_requests(events: Iterable[dict[str, Any]]) -> int:
    """How many of the lines a session's log says it lost were request lines (``replay``
    misses those); a ``lines_lost`` line that does not say counts all of its lines."""
    return _lost_sum(events, "requests")


def _lost_sum(events: Iterable[dict[str, Any]], field: str) -> int:
    total = 0
    for ev in events:
        if ev.get("type") == LOST_TYPE:
            value = ev.get(field, ev.get("lines"))
            if type(value) is int and value > 0:
                total += value
    return total


def _read_back(line: bytes) -> Any:
    """An event from the line it was written as (deeper than orjson reads: the standard
    library's reader). Raises ``ValueError`` if it is no JSON (its caller counts it lost)."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        event = _deep_line(line)
        if event is None:
            raise ValueError("a line written cannot be read back") from None
        return event


# Escapes JSON writers use where none is needed, in a key's alphabet: PHP's ``json_encode``
# writes "/" as ``\/``, Gson's HTML-safe mode "=" as ``\u003d`` (a base64 key in a tool's JSON
# output, a container's environment), then written again, escaped, as the line's string.
_NEEDLESS_ESCAPES: Final = (("/", "\\/"), ("=", "\\u003d"))


def _as_written(secrets: Iterable[str]) -> tuple[bytes, ...]:
    """Exact secret values (``known_secrets``) as a line writes them: JSON-escaped (also as
    text holding JSON writes them where its writer escapes more than it must,
    ``_NEEDLESS_ESCAPES``), longest first (one may hold another)."""
    written: set[bytes] = set()
    for secret in known_secrets(secrets):
        written.add(orjson.dumps(secret)[1:-1])
        for character, escaped in _NEEDLESS_ESCAPES:
            if character in secret:
                written.add(orjson.dumps(secret.replace(character, escaped))[1:-1])
    return tuple(sorted(written, key=len, reverse=True))


def _without(line: bytes, secrets: Iterable[bytes]) -> bytes:
    """``line`` with each of ``secrets`` replaced (a search in place, at memory speed; a copy
    only where one is found), and a piece of one where a text was cut through it: its first
    ``KEY_PIECE`` bytes or more at the end of a text (a provider's error cut at 300 characters,
    the extractive summary's quotes, an answer whose client left mid-key, which its agent sends
    back in its next request), its last ones at a start (an excerpt's), ``_CUT_EDGES`` marking
    the ends. A piece inside a text is no cut: other keys of a provider share a key's first
    characters (``sk-ant-api03-``), and the patterns take those whole. (Each line searched
    twice more for each key: ~0.4 ms of the writer for an agent's request line of 600 KB.)"""
    for secret in secrets:
        if line.find(secret) >= 0:
            line = line.replace(secret, _REDACTED_BYTES)
        if len(secret) > KEY_PIECE and secret.isascii():
            if line.find(secret[:KEY_PIECE]) >= 0:
                line = _without_pieces(line, secret, True)
            if line.find(secret[-KEY_PIECE:]) >= 0:
                line = _without_pieces(line, secret, False)
    return line


# What ends a text cachegate cut, or starts one, in a line: a JSON string's quote, the
# ellipsis it puts at a cut, a line end (``_clip_middle``'s note, a summary's next line)
_CUT_EDGES: Final = (b'"', "…".encode(), b"\\n")


def _without_pieces(line: bytes, secret: bytes, head: bool) -> bytes:
    """``line`` with each run of ``secret``'s start (``head``) of ``KEY_PIECE`` bytes or more that
    ends at a cut's edge (``_CUT_EDGES``), or each run of its end that starts at one, replaced.
    (ASCII keys only: a run then ends at a character's edge; at an escape's, where the key is
    written with escapes, or it is no cut: a run that ends on the backslash of the line's own
    ``\\"`` is not cut there, so the line stays JSON.) The first
    ``_PIECES_LOOKED`` places of the needle are looked at (a line of the same 16 characters
    over and over costs no more than that)."""
    needle = secret[:KEY_PIECE] if head else secret[-KEY_PIECE:]
    out: list[bytes] = []
    at = done = 0
    for _ in range(_PIECES_LOOKED):
        found = line.find(needle, at)
        if found < 0:
            break
        if head:  # as far as the line goes on as the key does
            most = min(len(secret), len(line) - found)
            start = found
            end = found + _common_run(line, found, secret, most, True)
            if line[end - 1] == 0x5C and not _escaped(line, end - 1, found):
                end -= 1  # (the key's escape and the line's own, ``\n``, share a backslash)
            cut = line.startswith(_CUT_EDGES, end) and not _escaped(line, end, found)
        else:
            most = min(len(secret), found + KEY_PIECE - done)
            stop = found + KEY_PIECE
            end = stop
            start = stop - _common_run(line, stop, secret, most, False)
            cut = line.endswith(_CUT_EDGES, done, start)
        if cut and _escaped(line, start, done):  # (the letter of ``\n``: the key's first
            cut = False  # character is no character of the text there)
        if cut:
            out += (line[done:start], _REDACTED_BYTES)
            done = end
        at = end if cut else found + 1
    if not out:
        return line
    out.append(line[done:])
    return b"".join(out)


_PIECES_LOOKED: Final = 256


def _escaped(line: bytes, at: int, floor: int) -> bool:
    """Whether ``line[at]`` is the letter of a JSON escape (an odd run of backslashes before
    it, from ``floor`` on)."""
    back = at
    while back > floor and line[back - 1] == 0x5C:
        back -= 1
    return (at - back) % 2 == 1


def _common_run(line: bytes, at: int, secret: bytes, most: int, head: bool) -> int:
    """How far, up to ``most``, ``line`` goes on from ``at`` as ``secret`` starts (``head``),
    or goes back from ``at`` as it ends; ``KEY_PIECE`` at least, found there already (a binary
    search of slice comparisons, at C speed)."""
    lo, hi = KEY_PIECE, max(KEY_PIECE, most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if line[at : at + mid] == secret[:mid] if head else line[at - mid : at] == secret[-mid:]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Lost(NamedTuple):
    """A session's lost lines not yet told in its file: how many, how many of them request
    lines, the latest loss's time, and the numbers of the request lines lost after they were
    queued (``EventLogWriter._count_lost``)."""

    lines: int
    requests: int
    at: float
    exchanges: tuple[int, ...]


_NO_LOSS: Final = _Lost(0, 0, 0.0, ())
# The most exchange numbers a ``lines_lost`` line lists; past them it says there were more.
_LOST_NUMBERS_SAID: Final = 1024


def _lost_line(lost: _Lost) -> bytes:
    """The line that tells of ``lines`` of a session lost (``requests`` of them request lines)
    among or before the lines that follow it, the latest at ``at`` (``sessions show`` notes
    them, ``sessions replay`` fails on lost requests): an audit log says it has a hole. With
    ``exchanges``, the request lines lost after later lines may have been coded against them:
    ``replay`` takes no earlier line of such a number for their base (numbers start at 1 again
    with a session forgotten and back, or a restart)."""
    event: dict[str, Any] = {
        "ts": lost.at,
        "type": LOST_TYPE,
        "lines": lost.lines,
        "requests": lost.requests,
    }
    if lost.exchanges:
        event["exchanges"] = list(lost.exchanges[:_LOST_NUMBERS_SAID])
        if len(lost.exchanges) > _LOST_NUMBERS_SAID:
            event["more_exchanges"] = True
    return orjson.dumps(event, option=orjson.OPT_APPEND_NEWLINE)


_REQUEST_TYPE: Final = b'"type":"request"'
_LOST_TYPE_BYTES: Final = b'"type":"lines_lost"'


def _is_request(event: Any) -> int:
    """1 for a request event, else 0."""
    return int(isinstance(event, dict) and event.get("type") == "request")


def _request_number(event: Any) -> tuple[int, ...]:
    """The exchange number of a request event, as ``_count_lost`` takes it (none otherwise)."""
    if _is_request(event) and type(event.get("exchange")) is int:
        return (event["exchange"],)
    return ()


_REQUEST_NUMBER: Final = re.compile(rb'"type":"request","exchange":(\d{1,18})[,}]')


def _lost_in(lines: Sequence[bytes]) -> tuple[int, int, tuple[int, ...]]:
    """The events among ``lines`` a failed write lost, the requests among them and their
    exchange numbers: a meta line is written again at its file's start, and a ``lines_lost``
    line's count stays held."""
    events = requests = 0
    numbers: list[int] = []
    for line in lines:
        head = line[:64]
        if _META_TYPE in head or _LOST_TYPE_BYTES in head:
            continue
        events += 1
        if _REQUEST_TYPE in head:
            requests += 1
            found = _REQUEST_NUMBER.search(line, 0, 128)
            if found is not None:
                numbers.append(int(found.group(1)))
    return events, requests, tuple(numbers)


def _holds_lines(fd: int) -> bool:
    """Whether the session file open as ``fd`` holds its lines: not empty, and its meta line
    among them (``_file_is_empty``'s reading)."""
    if os.fstat(fd).st_size == 0:
        return False
    # (a file that begins with a line of lost lines, its meta line among them, told when an
    # earlier process stopped, and holds no meta line yet: the meta line goes in)
    head = os.pread(fd, 4096, 0)
    if head.find(_LOST_TYPE_BYTES, 0, 64) >= 0:
        return head.find(_META_TYPE) >= 0
    # (and one whose meta line a crash cut, or left as NULs: it goes in after them, where the
    # reports find it; without, the file never had one)
    return _begins_with_meta(fd, head)


def _begins_with_meta(fd: int, head: bytes) -> bool:
    """Whether the file open at ``fd``, whose first bytes are ``head``, begins with a whole meta
    line: its first line past the NUL bytes, blank lines and byte-order mark a crash or an
    editor may leave (as the reports read it), or the line after a first one a crash cut (where
    the next cachegate wrote one). Its last line is terminated (``_terminate_torn_line``): a
    cut one ends in a newline too, and is told by not being JSON."""
    data = bytearray(head)
    start = _content_start(data, 0)
    for _ in range(2):
        while True:
            end = data.find(b"\n", start)
            if end >= 0 or len(data) >= _META_READ_MAX:
                break
            more = os.pread(fd, 65536, len(data))  # (NULs, or a long model name or user agent)
            if not more:
                break
            data += more
            start = _content_start(data, start)
        if start >= len(data):
            return False
        if data.find(_META_TYPE, start, start + 64) >= 0:
            if end < 0:
                return len(data) >= _META_READ_MAX  # (not read to its end: taken as one)
            try:
                if isinstance(orjson.loads(data[start:end]), dict):
                    return True
            except orjson.JSONDecodeError:
                pass
        if end < 0:
            return False
        start = _content_start(data, end + 1)
    return False


def _content_start(data: bytearray, at: int) -> int:
    """Where the bytes from ``at`` on begin to be a line's: past NULs, blanks, a BOM."""
    while True:
        skipped = len(data) - at - len(data[at:].lstrip(b"\0\r\n\t "))
        at += skipped
        if data.startswith(b"\xef\xbb\xbf", at):
            at += 3
        elif not skipped:
            return at


# How much of a file's first line is read to judge it a whole meta line.
_META_READ_MAX: Final = 1 << 20


def _begins_as_log(fd: int) -> bool:
    """Whether the file ``fd`` begins as a cachegate log, as the reports judge one
    (``_judge_start``): its first line with content. True where its first 64 KiB do not say
    (NULs or white space only: a crash's, or a file cachegate began)."""
    if hasattr(os, "pread"):
        head = os.pread(fd, 65536, 0)
    else:  # Windows: the offset does not matter to appends
        os.lseek(fd, 0, os.SEEK_SET)
        head = os.read(fd, 65536)
    passed_cut = False
    for raw in head.splitlines(keepends=True):
        verdict = _judge_start(raw, passed_cut)
        if verdict == _CUT:
            passed_cut = True
        elif verdict != _BLANK:
            return verdict == _OURS
    return True


def _terminate_torn_line(fd: int) -> int:
    """Append a newline when an earlier process died mid-line, so its fragment stays one torn line
    instead of swallowing the first event written now. Returns the file's size then."""
    size = os.fstat(fd).st_size
    if not size:
        return 0
    if hasattr(os, "pread"):
        last = os.pread(fd, 1, size - 1)
    else:  # Windows: the offset does not matter to appends
        os.lseek(fd, size - 1, os.SEEK_SET)
        last = os.read(fd, 1)
    if last != b"\n":
        size += os.write(fd, b"\n")
    return size


def default_max_open_files() -> int:
    """How many session files the writer keeps open: enough that hundreds of sessions in flight
    are not reopened on every write (a reopen costs more than the write); a quarter of the
    process's file descriptor limit (the connections need the rest), at most 1,024."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 64
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(4, min(1024, soft // 4))


# --------------------------------------------------------------------------------------------------
# Body stripping (logging.bodies = metadata)


# String parameters that carry free text or identify someone, not a setting's value.
_TEXT_PARAMS: Final = frozenset(
    {
        "user",
        "safety_identifier",
        "stop",
        "instructions",
        "prompt_cache_key",
        "prompt",
        "suffix",
        "input",  # (a Responses API request's ``input`` that is one string)
    }
)


# String parameters that are a setting's value or an id, kept as sent: any other string may be
# text (a gateway's top-level ``system``, a server's own field), hashed as ``_TEXT_PARAMS`` are.
_SETTING_PARAMS: Final = frozenset(
    {
        "model",
        "reasoning_effort",
        "service_tier",
        "tool_choice",
        "verbosity",
        "truncation",
        "prompt_cache_retention",
        "previous_response_id",
        "conversation",
    }
)


def _holds_text(param: tuple[str, Any]) -> bool:
    key, value = param
    return isinstance(value, dict | list) or (
        isinstance(value, str) and (key in _TEXT_PARAMS or key not in _SETTING_PARAMS)
    )


def strip_bodies(event: dict[str, Any]) -> dict[str, Any]:
    """The event with message text replaced by ``{role, chars, sha256}`` (summaries by chars and
    sha256), for logs that must keep sizes and identities but no content."""
    kind = event.get("type")
    if kind == "request" and isinstance(event.get("appended"), list):
        stripped = {**event, "appended": [message_metadata(m) for m in event["appended"]]}
        if isinstance(event.get("head"), list):
            stripped["head"] = [message_metadata(m) for m in event["head"]]
        tools = event.get("tools")
        if isinstance(tools, list):
            stripped["tools"] = {"count": len(tools), "sha256": _sha256_json(tools)}
        params = event.get("params")
        if isinstance(params, dict) and any(map(_holds_text, params.items())):
            # A structured parameter may carry text (a prediction's content, a schema), a
            # free-text one names or says something (an end user's e-mail in ``user``): their
            # hash only; numbers, booleans and settings (temperature, reasoning_effort) as sent.
            stripped["params"] = {
                k: {"sha256": _sha256_json(v)} if _holds_text((k, v)) else v
                for k, v in params.items()
            }
        return stripped
    if kind == "response":
        stripped = event
        if event.get("message") is not None:
            stripped = {**stripped, "message": message_metadata(event["message"])}
        divergence = event.get("divergence")
        if isinstance(divergence, dict):
            # its excerpts are of the changed text (a tool output, a system prompt): hashed too
            stripped = {
                **stripped,
                "divergence": {
                    k: {"chars": len(v), "sha256": _sha256(v)}
                    if k in ("old", "new") and isinstance(v, str)
                    else v
                    for k, v in divergence.items()
                },
            }
        return stripped
    if kind == "compacted" and isinstance(event.get("summary"), str):
        summary = event["summary"]
        return {**event, "summary": {"chars": len(summary), "sha256": _sha256(summary)}}
    return event


def message_metadata(message: Any) -> dict[str, Any]:
    """``{role, chars, sha256}`` of a message: chars counts every string it carries but the role;
    the hash is over its canonical JSON, so the same message hashes the same in every request."""
    role = message.get("role") if isinstance(message, dict) else None
    body = (
        {k: v for k, v in message.items() if k != "role"} if isinstance(message, dict) else message
    )
    return {"role": role, "chars": _count_chars(body), "sha256": _sha256_json(message)}


def _sha256_json(value: Any) -> str:
    """The sha256 of ``value``'s canonical JSON (keys sorted); of the standard library's, for
    what orjson does not write (nested past 254 levels, as cachegate reads up to 1,024)."""
    try:
        data = orjson.dumps(
            value, default=str, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS
        )
    except orjson.JSONEncodeError:
        text = deep_dumps(
            value, default=str, sort_keys=True, ensure_ascii=False, separators=(",", ":")
        )
        data = text.encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()


def _count_chars(obj: Any) -> int:
    """The characters of every string in ``obj`` (its values, not its keys), at any depth."""
    count = 0
    pending = [obj]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            count += len(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return count


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# --------------------------------------------------------------------------------------------------
# Reading and replay


@dataclass(frozen=True, slots=True)
class LogRead:
    """The events of one log file, and how many lines were skipped because they did not parse."""

    events: list[dict[str, Any]]
    torn: int
    starts_as_log: bool = True  # its first line begins as cachegate's do (``EVENT_START``)
    # Of the torn lines, those that were requests, or cut before their type (``_torn_request``);
    # and whether the last of those is the file's last line, with no line end yet (being
    # written as it was read, or cut by a crash).
    torn_requests: int = 0
    torn_at_end: bool = False


class NotALogFile(ValueError):
    """A session's log path names something that is not a regular file (a directory, a FIFO, a
    symbolic link): never read, as the writer never writes through one."""


# The fields a report of exchanges (``sessions list``, ``show``, ``cost``) never reads, by event
# type: the messages, tools and summaries, which are nearly all of a log's bytes.
BODY_FIELDS: Mapping[str, frozenset[str]] = {
    "request": frozenset({"head", "appended", "tools", "params"}),
    "response": frozenset({"message", "divergence"}),
    "compacted": frozenset({"summary"}),
}


def read_events(
    path: str | os.PathLike[str], *, drop: Mapping[str, frozenset[str]] | None = None
) -> LogRead:
    """Read a log file: torn (unparseable) lines skipped and counted, non-object lines ignored,
    the fields ``drop`` names for an event's type left out (``BODY_FIELDS``: a report holds a
    large log in a fraction of its size). Raises ``NotALogFile`` for anything but a regular
    file (a FIFO would block the reader)."""
    with open(_open_log(path), "rb") as f:
        return parse_lines(f, drop=drop)


_COMPACTED_TYPE: Final = b'"type":"compacted"'


def logged_compactions(
    path: str | os.PathLike[str], last: int | None = None
) -> list[dict[str, Any]]:
    """The compactions a session's log says were made, in log order (the ``last`` ones of
    them, if given, one per history covered: the others are not kept while the log is read):
    its ``compacted`` lines
    with their summary's text and the digests of the history they cover (those of an earlier
    process too). A session cachegate forgot (a restart, an idle eviction) takes them up again
    instead of summarizing its history anew. Only the lines that hold the event's type are
    parsed (a 200 MB log is read in ~0.25 s); a line with no end, a
    summary logged as metadata, a reused compaction's line are passed over. Raises
    ``OSError`` (no file) and ``NotALogFile`` as ``read_events``."""
    # (by the history each covers: one made twice, forgotten and made again, is one of them)
    found: dict[tuple[str, str], dict[str, Any]] = {}
    buf = bytearray()
    with open(_open_log(path), "rb", buffering=0) as f:
        # Read in large chunks and searched by ``find`` in C: a loop over the lines took ~1 s
        # of the interpreter (and the event loop's turns) per 200 MB; this, a quarter of it.
        while chunk := f.read(_SCAN_CHUNK):
            buf += chunk
            end = buf.rfind(b"\n") + 1  # (the complete lines; the rest waits for more)
            at = buf.find(_COMPACTED_TYPE, 0, end)
            while at >= 0:
                start = buf.rfind(b"\n", 0, at) + 1
                stop = buf.find(b"\n", at, end) + 1
                event = _compacted_event(bytes(buf[start:stop]))
                if event is not None:
                    key = (event["opening"], event["prefix_digest"])
                    found.pop(key, None)  # (the latest of equals, in its place)
                    found[key] = event
                    if last is not None and len(found) > last:
                        del found[next(iter(found))]
                at = buf.find(_COMPACTED_TYPE, stop, end)
            del buf[:end]
    return list(found.values())


_SCAN_CHUNK: Final = 4 * 1024 * 1024


def _compacted_event(line: bytes) -> dict[str, Any] | None:
    """A ``compacted`` line's event, if it records a compaction made, with what reusing it
    takes (its summary's text, its digests, its range); else None."""
    try:
        event = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if (
        isinstance(event, dict)
        and event.get("type") == "compacted"
        and event.get("source") in ("model", "extractive", "carried", "cut")
        and isinstance(event.get("summary"), str)
        and isinstance(event.get("prefix_digest"), str)
        and isinstance(event.get("opening"), str)
        and all(
            type(event.get(k)) is int and event[k] >= 0
            for k in ("start", "covered", "tokens_before", "tokens_after")
        )
    ):
        return event
    return None


def _open_log(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of the log file at ``path``: no symbolic link followed, nothing
    but a regular file (a FIFO would block the reader)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotALogFile(f"{os.fspath(path)} is a symbolic link, not a log file") from None
        if exc.errno == errno.ENXIO:  # (a socket: no file to open; "No such device" said)
            raise NotALogFile(f"{os.fspath(path)} is not a log file (not a regular file)") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotALogFile(f"{os.fspath(path)} is not a log file (not a regular file)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _deep_line(line: bytes) -> Any:
    """A line nested deeper than orjson reads (a body at its limit, wrapped by the log's own
    event one or two levels more), read by the standard library; None if it is no JSON."""
    try:
        return deep_call(json.loads, line)
    except (ValueError, RecursionError):
        return None


_BOM: Final = b"\xef\xbb\xbf"
_BLANK, _CUT, _OURS, _OTHER = "blank", "cut", "ours", "other"


def _judge_start(raw: bytes, passed_cut: bool) -> str:
    """What a line says of whether its file is cachegate's log, while none has said yet:
    ``_BLANK`` (no content: NULs, white space, a byte-order mark), ``_OURS`` (it begins as
    cachegate's lines do), ``_CUT`` (NUL bytes, then a line's tail: a crash zeroed a file's
    first blocks up to the middle of a line; the next line decides, once) or ``_OTHER``. The
    reports (``parse_lines``) and retention (``_is_event_log``) judge a file by this alone, so
    retention deletes no file the reports do not show as a session."""
    head = raw.strip(b"\0 \t\r\n").removeprefix(_BOM)
    if not head:
        return _BLANK
    if head.startswith(EVENT_START):
        return _OURS
    if not passed_cut and raw.startswith(b"\0"):
        return _CUT
    return _OTHER


def parse_lines(
    lines: Iterable[bytes], *, drop: Mapping[str, frozenset[str]] | None = None
) -> LogRead:
    """A log's events from its lines as a file yields them: torn lines counted, non-object
    lines ignored, and nothing read past a line with no line end (the file's end, inside a line
    cut by a crash or being written as it is read: were it read on, the rest of that line,
    appended meanwhile, would count as a second torn line)."""
    events: list[dict[str, Any]] = []
    torn = torn_requests = 0
    torn_at_end = False
    starts_as_log: bool | None = None
    judged_cut = False  # a first line a crash cut was passed over: the next one decides
    for raw in lines:
        if starts_as_log is None:  # (``_judge_start``: retention judges a file alike)
            verdict = _judge_start(raw, judged_cut)
            if verdict != _BLANK:
                raw = raw.removeprefix(_BOM)
                if verdict == _CUT:
                    judged_cut = True
                else:
                    starts_as_log = verdict == _OURS
        line = raw  # (orjson reads white space around a value: no copy of a long line stripped)
        obj: Any = None
        if line[:1] == b"\0" and (obj := _after_nuls(line)) is not None:
            # NULs, then a whole line: a crash zeroed the blocks before it up to where it
            # begins. The NULs stand for lines lost (of a request, or it cannot say); the line
            # is read.
            torn += 1
            torn_requests += 1
        elif line and not line.isspace():
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                obj = _deep_line(line) if str(exc).startswith("depth limit") else None
                if obj is None:
                    torn += 1
                    if _torn_request(line):
                        torn_requests += 1
                        torn_at_end = not raw.endswith(b"\n")
        if isinstance(obj, dict):
            kind = obj.get("type")
            fields = drop.get(kind) if drop and isinstance(kind, str) else None
            if fields:
                for key in fields.intersection(obj):
                    del obj[key]
            events.append(obj)
        if not raw.endswith(b"\n"):
            break
    return LogRead(
        events=events,
        torn=torn,
        starts_as_log=bool(starts_as_log),
        torn_requests=torn_requests,
        torn_at_end=torn_at_end,
    )


def _after_nuls(line: bytes) -> dict[str, Any] | None:
    """The event a line holds after a run of NUL bytes; None where none is whole there (NULs
    alone, or a line's tail: a crash zeroed it up to its middle)."""
    rest = line.lstrip(b"\0")
    if not rest.startswith(b"{"):
        return None
    try:
        obj = orjson.loads(rest)
    except orjson.JSONDecodeError as exc:  # (a body nested deeper than orjson reads, too)
        obj = _deep_line(rest) if str(exc).startswith("depth limit") else None
    return obj if isinstance(obj, dict) else None


_TYPE_AT: Final = re.compile(rb'"type": ?"([a-z_]*)"')


def _torn_request(line: bytes) -> bool:
    """Whether a line that did not parse was a request's, or was cut before its type said what
    it was (a crash's last line, a block of NULs): cachegate writes ``{"ts":…,"type":"…"`` first."""
    found = _TYPE_AT.search(line, 0, 96)
    return found is None or found.group(1) == b"request"


def choose_base(
    candidates: Sequence[tuple[int, Sequence[dict[str, Any]]]], messages: Sequence[dict[str, Any]]
) -> tuple[int | None, int]:
    """The earlier exchange whose forwarded messages share the longest prefix with ``messages``,
    and that prefix's length; ``(None, 0)`` when none shares anything. Ties go to the later
    candidate. Cost is one comparison per shared message per candidate compared, so keep the list
    short (the session's few most recent exchanges)."""
    best: int | None = None
    best_len = 0
    # Newest first, skipping candidates too short to beat the best so far: in an agent's growing
    # history the newest exchange shares everything and the others are never compared.
    for exchange, previous in reversed(candidates):
        if min(len(previous), len(messages)) <= best_len:
            continue
        shared = shared_prefix(previous, messages)
        if shared > best_len:
            best, best_len = exchange, shared
    return best, best_len


class Delta(NamedTuple):
    """How a request line is coded (``choose_delta``): the forwarded messages are
    ``base[:kept] + messages[kept:head] + base[replaces:base_len] + appended`` where ``base`` is
    the messages of ``base_exchange`` and ``base_len`` is ``Delta.base``: with ``head`` or
    ``replaces``, the request parts from the base after ``kept`` messages, and its own
    ``messages[kept:head]`` take the place of the base's up to ``replaces`` (a system block
    with the time in it in place of the base's; none in place of dropped messages)."""

    base_exchange: int | None
    base: int
    head: int = 0
    replaces: int = 0
    kept: int = 0


def choose_delta(
    candidates: Sequence[tuple[int, Sequence[dict[str, Any]]]], messages: Sequence[dict[str, Any]]
) -> Delta:
    """``choose_base``, or, when the request parts from an earlier exchange's messages and
    meets them again further on, that exchange with what differs in between written in full:
    its system block changed (a client that puts the time in its system prompt resends an
    unchanged history behind a new one every turn, which was logged whole each time: the log
    grew with the square of the conversation), or messages were dropped from the history's
    start or middle (a sliding window, a client's truncation near the context limit: each
    turn's line held the whole window). Of the codings, the one that writes the fewest
    messages (the plain one on a tie)."""
    base_exchange, base = choose_base(candidates, messages)
    best = Delta(base_exchange, base)
    best_written = len(messages) - base
    carried = next((p for e, p in candidates if e == base_exchange), None)
    if carried is not None and base == len(carried):
        return best  # it carries that one on whole (an agent's next turn): nothing better
    for exchange, previous in reversed(candidates):
        if len(messages) - len(previous) >= best_written:
            continue  # (cannot write fewer, even sharing all it could)
        kept = shared_prefix(previous, messages)
        head, replaces, shared = realigned(previous, messages, kept)
        written = len(messages) - shared - kept
        if shared and written < best_written:
            best = Delta(exchange, replaces + shared, head, replaces, kept)
            best_written = written
    return best


def replay(events: Iterable[dict[str, Any]]) -> list[tuple[int, list[dict[str, Any]]]]:
    """Every ``request``'s full forwarded message list, rebuilt from the deltas, in log order.

    A request whose base cannot be found (its line was torn) cannot be rebuilt exactly; it is left
    out with a warning, and so is anything delta-coded against it.
    """
    return [
        (r["exchange_id"], r.get("messages", r.get("input", []))) for r in replay_requests(events)
    ]


def replay_requests(
    events: Iterable[dict[str, Any]], skipped: list[int] | None = None
) -> list[dict[str, Any]]:
    """``replay``, as the requests that were forwarded (``iter_replay_requests``), in a list."""
    return list(iter_replay_requests(events, skipped))


def iter_replay_requests(
    events: Iterable[dict[str, Any]], skipped: list[int] | None = None
) -> Iterator[dict[str, Any]]:
    """``replay``, as the requests that were forwarded: ``{exchange_id, model, stream, params,
    tools, messages}`` (``params`` and ``tools`` as far as the log records them: a line carries
    the tools only when they changed, or names the earlier line that carried them
    (``tools_ref``), and logs written before cachegate recorded them have neither; ``tools`` is
    left out while none are known), each as it is rebuilt. The exchanges left out for want of
    their base are added to ``skipped`` as they come. An exchange's messages are held only
    until the last line based on it (numbers included that a restart used again): a long
    session's requests, each a list of its whole history, are not all held at once."""
    events = events if isinstance(events, list) else list(events)
    last_use: dict[int, int] = {}  # an exchange number -> the last event based on it by number
    for at, ev in enumerate(events):
        if (
            ev.get("type") == "request"
            and isinstance(ev.get("base_exchange"), int)
            and (ev.get("base") or 0) != 0  # (a line of its own does not read its base)
        ):
            last_use[ev["base_exchange"]] = at
    rebuilt: dict[int, list[dict[str, Any]]] = {}
    last: list[dict[str, Any]] | None = None
    tools: Any = _NO_TOOLS_SEEN
    tools_of: dict[int, Any] = {}  # the tools each exchange's line carried or named
    # a Responses API line's instructions, by its exchange (``instructions_from`` names one)
    instructions_of: dict[int, Any] = {}
    last_exchange: int | None = None
    for at, ev in enumerate(events):
        if ev.get("type") != "request":
            if ev.get("type") == LOST_TYPE:
                # Request lines lost after later lines may have been coded against them: their
                # numbers may be earlier lines' too (numbers start again with a session
                # forgotten and back, or a restart), and a line based on a lost one was rebuilt
                # on that other one. No earlier line of those numbers is a base now (what is
                # based on them is left out, with a warning); past a list cut short, none is.
                numbers = ev.get("exchanges")
                if ev.get("more_exchanges"):
                    rebuilt.clear()
                    tools_of.clear()
                    instructions_of.clear()
                    tools, last, last_exchange = _NO_TOOLS_SEEN, None, None
                elif isinstance(numbers, list) and numbers:
                    for number in numbers:
                        if type(number) is int:
                            rebuilt.pop(number, None)
                            tools_of.pop(number, None)
                            instructions_of.pop(number, None)
                            if number == last_exchange:
                                last = last_exchange = None
                    tools = _NO_TOOLS_SEEN  # (a lost line may have changed them)
            continue
        exchange = ev.get("exchange")
        appended = ev.get("appended") or []
        base = ev.get("base") or 0
        base_exchange = ev.get("base_exchange")
        if type(exchange) is not int or not isinstance(appended, list):
            # (a damaged or hand-edited line: left out, and said, as a line that cannot be
            # built is; an earlier line of its number is no base for what follows)
            logger.warning(
                "replay: a request line of exchange %s is malformed; skipped",
                exchange if type(exchange) is int else "(no number)",
            )
            if type(exchange) is int:
                rebuilt.pop(exchange, None)
                if exchange == last_exchange:
                    last = last_exchange = None
            if skipped is not None:
                skipped.append(exchange if type(exchange) is int else -1)
            continue
        if "tools" in ev:  # what the next lines carry forward, even from a line left out
            tools = ev["tools"]
        elif isinstance(ev.get("tools_ref"), int):  # those an earlier line of this process had
            tools = tools_of.get(ev["tools_ref"], _NO_TOOLS_SEEN)
        tools_of[exchange] = tools
        head = ev.get("head") if "head" in ev else []
        replaces = ev.get("replaces") or 0
        kept = ev.get("kept") or 0
        if (
            not isinstance(head, list)
            or type(replaces) is not int
            or type(kept) is not int
            or not 0 <= kept <= replaces
        ):
            logger.warning("replay: exchange %s has a malformed system block; skipped", exchange)
            rebuilt.pop(exchange, None)
            if skipped is not None:
                skipped.append(exchange)
            continue
        if base == 0:
            messages = head + appended
        else:
            # Without a base_exchange, a request extends the session's previous one.
            previous = rebuilt.get(base_exchange) if isinstance(base_exchange, int) else last
            if (
                previous is None
                or not isinstance(base, int)
                or base > len(previous)
                or replaces > base
            ):
                logger.warning(
                    "replay: exchange %s is based on exchange %s, which is missing; skipped",
                    exchange,
                    base_exchange,
                )
                rebuilt.pop(exchange, None)
                if skipped is not None:
                    skipped.append(exchange)
                continue
            messages = previous[:kept] + head + previous[replaces:base] + appended
            if isinstance(base_exchange, int) and last_use.get(base_exchange) == at:
                del last_use[base_exchange]  # the last line based on it: not held past it
                if rebuilt.get(base_exchange) is previous:
                    del rebuilt[base_exchange]
        last = messages
        if exchange in last_use:  # (a later line is based on it by its number)
            rebuilt[exchange] = messages
        else:
            rebuilt.pop(exchange, None)  # (an earlier one of that number: none is based on it)
        last_exchange = exchange
        params = ev.get("params")
        path = ev.get("path")
        responses = path == RESPONSES_PATH or path == RESPONSES_PATH + "/compact"
        if responses:
            named = ev.get("instructions_from")
            if type(named) is int:  # the instructions of that earlier line
                said = instructions_of.get(named)
                if said is None:
                    logger.warning(
                        "replay: exchange %s has the instructions of exchange %s, which is"
                        " missing; skipped",
                        exchange,
                        named,
                    )
                    if skipped is not None:
                        skipped.append(exchange)
                    continue
                params = {**params, "instructions": said} if isinstance(params, dict) else params
            if isinstance(params, dict) and "instructions" in params:
                # (a metadata log's are ``{"sha256": …}``: named so as well)
                instructions_of[exchange] = params["instructions"]
            else:
                instructions_of.pop(exchange, None)
        request: dict[str, Any] = {"exchange_id": exchange}
        if responses:  # (its items are its ``input``)
            request["path"] = path
        request["model"] = ev.get("model")
        if isinstance(ev.get("stream"), bool):
            request["stream"] = ev["stream"]
        if isinstance(params, dict):
            request["params"] = params
        if tools is not _NO_TOOLS_SEEN and tools is not None:
            request["tools"] = tools
        if not responses:
            request["messages"] = messages
        elif not ev.get("no_input") and not (isinstance(params, dict) and "input" in params):
            request["input"] = messages  # (none sent, or one string: a param)
        yield request


RESPONSES_PATH: Final = "/v1/responses"


_NO_TOOLS_SEEN: Final = object()


# --------------------------------------------------------------------------------------------------
# Retention


def enforce_retention(
    log_dir: str | os.PathLike[str],
    *,
    max_age_days: float | None,
    max_total_mb: float | None,
    active: Collection[str],
    now: float,
    previous: tuple[float, float] | None = None,
    live: Callable[[str], bool] | None = None,
) -> list[str]:
    """Delete whole log files older than ``max_age_days`` (by mtime), then the oldest until the
    directory fits ``max_total_mb``; never the file of a session in ``active``, nor, with
    ``previous=(started_at, idle_s)``, one written before this process started and less than
    ``idle_s`` ago (a session the process before a restart held: its agent may carry on, and
    its log, kept in one process, was deleted on a restart). Returns the paths removed. Only cachegate's own logs are candidates: a file named as a session's log whose
    first bytes are an event's (a directory shared with other ``.jsonl`` files keeps them).
    Files that vanish meanwhile are ignored; other errors are logged and skipped. A scan of
    thousands of files takes a while, and a session may be resumed meanwhile (an agent retrying
    as cachegate restarts): each file is looked at again just before it is deleted, and kept
    when ``live`` says its session is held now or when it was written since the scan."""
    try:
        entries = list(os.scandir(log_dir))
    except FileNotFoundError:
        return []
    files: list[tuple[float, int, str, str]] = []  # mtime, size, path, session id
    spared: set[str] = set()
    for entry in entries:
        name = entry.name
        if not name.endswith(LOG_SUFFIX) or not valid_session_id(name[: -len(LOG_SUFFIX)]):
            continue
        if not entry.is_file(follow_symlinks=False) or not _is_event_log(entry.path):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        sid = entry.name[: -len(LOG_SUFFIX)]
        if previous is not None and st.st_mtime <= previous[0] and now - st.st_mtime < previous[1]:
            spared.add(sid)  # (counted, not deleted: as a session's held in memory)
        files.append((st.st_mtime, st.st_size, entry.path, sid))
    files.sort()
    active = spared.union(active) if spared else active
    removed: list[str] = []
    kept: list[tuple[float, int, str, str]] = []

    def deleted(item: tuple[float, int, str, str]) -> bool:
        mtime, size, path, sid = item
        if sid in active or (live is not None and live(sid)):
            return False
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        if (st.st_mtime, st.st_size) != (mtime, size):  # written since the scan
            return False
        return _unlink(path)

    for item in files:
        expired = max_age_days is not None and now - item[0] > max_age_days * 86400.0
        if expired and deleted(item):
            removed.append(item[2])
        else:
            kept.append(item)
    if max_total_mb is not None:
        limit = max_total_mb * 1024 * 1024
        total = sum(size for _, size, _, _ in kept)
        for item in kept:
            if total <= limit:
                break
            if deleted(item):
                removed.append(item[2])
                total -= item[1]
    return removed


EVENT_START: Final = b'{"ts":'  # every line cachegate writes begins so


def _is_event_log(path: str) -> bool:
    """Whether the file begins as cachegate's event lines do (read without following a link),
    judged as the reports judge it (``parse_lines``): by its first line with content, past the
    NUL bytes a crash can leave at a file's start, white space and a byte-order mark. Such a
    file is listed as a session, so retention must count it and may delete it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        passed_cut = False
        blank = 0  # bytes of lines without content before the first with some
        for raw, whole in _line_heads(fd, _LEADING_BLANK_LIMIT):
            verdict = _judge_start(raw, passed_cut)
            if verdict == _BLANK:
                blank += len(raw)
                if not whole or blank > _LEADING_BLANK_LIMIT:
                    return False  # (what follows in it is not known: kept, never deleted)
            elif verdict == _CUT:
                passed_cut = True
            else:
                return verdict == _OURS
        return False
    except OSError:
        return False
    finally:
        os.close(fd)


# What a file system that cannot fsync a directory says (EINVAL on some network file systems)
_NO_DIR_SYNC: Final = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EISDIR})


def _line_heads(fd: int, cap: int) -> Iterator[tuple[bytes, bool]]:
    """The lines read from ``fd``, each as its first ``cap`` bytes and whether that is all of
    it (the rest of a longer one read past, not kept); the last one without its line end if it
    has none."""
    buf = bytearray()
    full = False  # this line's first ``cap`` bytes given already
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            if buf and not full:
                yield bytes(buf), True
            return
        pos = 0
        while pos < len(chunk):
            nl = chunk.find(b"\n", pos)
            end = len(chunk) if nl < 0 else nl + 1
            if not full:
                buf += chunk[pos:end]
                if len(buf) > cap:
                    yield bytes(buf[:cap]), False
                    full = True
            if nl >= 0:
                if not full:
                    yield bytes(buf), True
                buf.clear()
                full = False
            pos = end


# How far into a file retention looks past leading NUL bytes for its first line.
_LEADING_BLANK_LIMIT: Final = 1 << 20


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        logger.warning("retention: cannot remove %s: %s", path, exc)
        return False
    return True
