"""What ``cachegate sessions list | show | cost | replay`` print, computed from the audit logs.

Each command has a data function (values the ``--json`` form serializes with ``to_json()``) and a
renderer that turns those values into aligned text. Session ids are validated before any path is
built from them; torn lines are counted, never fatal; unknown event types are ignored.
"""

from __future__ import annotations

import math
import os
import re
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import orjson

from proxy.errors import CLIENT_CLOSED, SHUTTING_DOWN, STOPPED_CUT
from proxy.eventlog import (
    BODY_FIELDS,
    LOG_SUFFIX,
    LOST_TYPE,
    LogRead,
    NotALogFile,
    iter_replay_requests,
    lost_lines,
    read_events,
    replay_requests,
    session_log_path,
)
from proxy.listmemo import SummaryMemo, file_key
from proxy.prefix import deep_dumps
from proxy.redact import redact_text
from proxy.resanswers import BACKGROUND_STATES
from proxy.sessions import valid_session_id

# --------------------------------------------------------------------------------------------------
# Values


@dataclass(slots=True)
class ExchangeRow:
    """One exchange of a session's timeline (``None`` where the log holds no value)."""

    exchange: int | None
    ts: float | None
    model: str | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    cache_read: int | None = None
    cache_waste: int | None = None
    waste_cause: str | None = None
    waste_location: str | None = None
    unrequested: int = 0  # of a miss with a cause, what was never cached (not_requested)
    # of a miss with a cause, what had expired past a longer-lived breakpoint (ttl_expired)
    expired: int = 0
    # what the waste and the not_requested and expired parts cost over reading them from the
    # cache, USD (None: a model with no prices, or a log written before cachegate priced them)
    waste_usd: float | None = None
    unrequested_usd: float | None = None
    expired_usd: float | None = None
    repairs: int = 0
    compacted: bool = False
    ttfb_s: float | None = None
    duration_s: float | None = None
    status: int | None = None
    interrupted: bool = False
    error: str | None = None
    cache_reported: bool = False
    # its cache read was measured: the provider reported its cache fields, or left them out of
    # a miss the accounting counted all the same (Gemini's OpenAI endpoint, once it has reported
    # them in the session: a read of 0)
    cache_measured: bool = False
    cost_actual: float | None = None
    cost_uncached: float | None = None
    client_retry: int = 0  # the client's retry of an earlier exchange (its SDK's count)
    # what was repaired, as logged: {kind, index, tool_call_id, action} each
    repaired: list[dict[str, Any]] = field(default_factory=list)
    # A compaction's summary call billed with this exchange (its ``cost_*`` include it; the
    # ``tokens_*`` above are the main call's): its model, tokens and cost
    summary_model: str | None = None
    summary_tokens_in: int | None = None
    summary_tokens_out: int | None = None
    summary_cache_read: int | None = None
    summary_cache_reported: bool = False
    summary_cost_actual: float | None = None
    summary_cost_uncached: float | None = None
    answered: bool = False  # a response line came (the request was forwarded)
    # a Responses API ``background`` request, answered "queued": its usage comes with a later
    # GET of the response, which cachegate relays unread
    background: bool = False
    path: str | None = None  # the request line's (``/v1/responses`` for the Responses API)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in _MONEY_FIELDS:  # (a sum of floats: 0.0058200000000000005)
            if out[key] is not None:
                out[key] = round(out[key], 10)
        return out

    @property
    def main_cost_uncached(self) -> float | None:
        """The main call's uncached cost, without the summary call's."""
        if self.cost_uncached is None:
            return None
        return self.cost_uncached - (self.summary_cost_uncached or 0.0)


_MONEY_FIELDS: Final = (
    "cost_actual",
    "cost_uncached",
    "waste_usd",
    "unrequested_usd",
    "expired_usd",
    "summary_cost_actual",
    "summary_cost_uncached",
)


@dataclass(frozen=True, slots=True)
class SessionDetail:
    """A session's metadata and timeline, one row per exchange in log order."""

    session: str
    meta: dict[str, Any] | None
    rows: list[ExchangeRow]
    torn: int
    first_seen: float | None = None
    last_seen: float | None = None
    lost: int = 0  # lines cachegate could not write, as its ``lines_lost`` lines tell

    def to_json(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "model": main_model(self),  # (as the text's header and `list` name it)
            "meta": self.meta,
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
            "torn": self.torn,
            "lost": self.lost,
            "exchanges": [row.to_json() for row in self.rows],
        }


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """One line of ``sessions list``. ``cache_hit_pct`` is cached input over input, counted over
    the responses whose provider reported cache usage (None when none did)."""

    session: str
    first_seen: float | None
    last_seen: float | None
    model: str | None
    exchanges: int
    tokens_in: int | None  # None: no response reported usage
    tokens_out: int | None
    cache_read: int | None
    cache_hit_pct: float | None
    interruptions: int
    repairs: int
    errors: int
    torn: int
    lost: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class CostReport:
    """What a session cost, what it would have cost without the prompt cache, and the cache
    tokens it wasted, by cause."""

    session: str
    actual: float
    uncached: float
    saved: float
    priced_exchanges: int
    waste_tokens: int
    waste_by_cause: dict[str, int] = field(default_factory=dict)
    # the waste in dollars, over reading it from the cache (None: a row without a price of it,
    # its model's prices unknown or its log written before cachegate priced waste)
    waste_usd: float | None = None
    waste_usd_by_cause: dict[str, float] = field(default_factory=dict)
    torn: int = 0
    lost: int = 0  # lines the log could not hold: the figures may miss exchanges
    # priced at $0 though tokens were used: their models have no prices in the configuration
    unpriced: dict[str, int] = field(default_factory=dict)  # model -> exchanges
    # compactions' summary calls priced at $0 so: summarizer model -> calls
    unpriced_summaries: dict[str, int] = field(default_factory=dict)
    # exchanges forwarded and answered (or cut) with no usage: not counted, maybe billed
    no_usage: int = 0
    # Responses API background requests answered "queued": billed, their usage unread
    background: int = 0

    @property
    def saved_pct(self) -> float | None:
        if self.uncached <= 0:
            return None
        return 0.0 if abs(self.saved) < _NO_MONEY else 100.0 * self.saved / self.uncached

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["saved_pct"] = self.saved_pct
        for key in ("actual", "uncached", "saved"):  # sums of floats: 0.0031669999999999997
            out[key] = round(out[key], 10)  # (a ten-billionth of a dollar: no price is finer)
        if self.waste_usd is not None:
            out["waste_usd"] = round(self.waste_usd, 10)
        out["waste_usd_by_cause"] = {k: round(v, 10) for k, v in self.waste_usd_by_cause.items()}
        return out


# --------------------------------------------------------------------------------------------------
# Data


def show_session(log_dir: str | os.PathLike[str], session_id: str) -> SessionDetail:
    """The timeline of one session. Raises ``ValueError`` for an invalid id and
    ``FileNotFoundError`` when the session has no log."""
    return build_detail(session_id, _load(log_dir, session_id, drop=BODY_FIELDS))


def list_sessions(
    log_dir: str | os.PathLike[str],
    unreadable: list[tuple[str, str]] | None = None,
    *,
    since: float | None = None,
    limit: int | None = None,
    memo: SummaryMemo | None = None,
) -> list[SessionSummary]:
    """Every session logged in ``log_dir``, most recently seen first. A file that cannot be
    read (another user's permissions, a socket, an I/O error) is left out and its path and the
    reason added to ``unreadable`` (raised when that is None); a ``.jsonl`` file that does not
    begin as cachegate's lines do (another tool's, an empty one) is no session.

    ``since`` (a time) leaves out the files last written before it, and ``limit`` reads only
    the most recently written files until that many sessions are found: both are judged by the
    files' modification times before any is read, so days of logs are not read to list the
    latest few.

    With ``memo`` (``proxy.listmemo``), a file whose key is unchanged since a listing that kept
    its summary is not read again, and the summaries read are kept for the next (the caller
    saves the memo)."""
    directory = os.fspath(log_dir)
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            raise NotADirectoryError(f"log directory {directory!r} is not a directory")
        raise FileNotFoundError(f"log directory {directory!r} does not exist")
    candidates: list[tuple[float, str, str]] = []  # (modified, session id, path)
    present: set[str] = set()
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            session_id = name[: -len(LOG_SUFFIX)]
            if not name.endswith(LOG_SUFFIX) or not valid_session_id(session_id):
                continue
            present.add(name)
            modified = 0.0
            if since is not None or limit is not None:
                try:
                    modified = entry.stat(follow_symlinks=False).st_mtime
                except OSError:
                    modified = float("inf")  # (read below, where its error is said)
                if since is not None and modified < since:
                    continue
            candidates.append((modified, session_id, entry.path))
    candidates.sort(key=lambda c: (-c[0], c[1]))
    taken: list[tuple[float, SessionSummary]] = []  # (its file's modification time, summary)
    cutoff: float | None = None  # (the time of the file that gave the limit's last summary)
    for modified, session_id, path in candidates:
        if limit is not None and len(taken) >= limit:
            # The files written in the same tick of the file system's clock as the last one
            # taken are read too (a writer's batch of many sessions leaves them all one time):
            # which of them come in is then said by the times of their last lines.
            cutoff = taken[-1][0] if cutoff is None else cutoff
            if modified != cutoff:
                break
        key = file_key(path) if memo is not None else None
        if memo is not None:
            known, held = memo.get(session_id + LOG_SUFFIX, key)
            if known:
                if held is not None:  # (None: a file that is no cachegate log)
                    taken.append((modified, SessionSummary(**held)))
                continue
        try:
            log = read_events(path, drop=BODY_FIELDS)
        except (FileNotFoundError, NotALogFile):  # removed meanwhile; a directory, a link
            continue
        except OSError as exc:  # one file must not hide the others
            if unreadable is None:
                raise
            reason = "permission denied" if isinstance(exc, PermissionError) else exc.strerror
            unreadable.append((path, reason or type(exc).__name__))
            continue
        summary = summarize(build_detail(session_id, log)) if log.starts_as_log else None
        # Kept only if the file did not change while it was read (an append, a rename over it):
        # the summary is then that of the bytes the key names.
        if memo is not None and key is not None and file_key(path) == key:
            memo.put(session_id + LOG_SUFFIX, key, summary.to_json() if summary else None)
        if summary is not None:
            taken.append((modified, summary))
    if memo is not None:
        memo.keep_only(present)
    summaries = [summary for _, summary in taken]
    if limit is not None and len(taken) > limit:
        # Every file written after the tied ones stays; the places left go to the tied files
        # whose last lines came last.
        newer = [summary for modified, summary in taken if modified != cutoff]
        tied = [summary for modified, summary in taken if modified == cutoff]
        tied.sort(key=lambda s: (-(s.last_seen or 0.0), s.session))
        summaries = newer + tied[: max(0, limit - len(newer))]
    summaries.sort(key=lambda s: (-(s.last_seen or 0.0), s.session))
    return summaries


def session_cost(log_dir: str | os.PathLike[str], session_id: str) -> CostReport:
    """The cost of one session, from the ``cost`` and ``cache`` fields of its responses."""
    detail = show_session(log_dir, session_id)
    actual = uncached = 0.0
    priced = waste = 0
    by_cause: dict[str, int] = {}
    usd_by_cause: dict[str, float] = {}
    priced_waste = True  # every wasted row says what it cost
    unpriced: dict[str, int] = {}
    unpriced_summaries: dict[str, int] = {}
    no_usage = background = 0
    for row in detail.rows:
        if row.cost_actual is not None and row.cost_uncached is not None:
            actual += row.cost_actual
            uncached += row.cost_uncached
            # (the main call's own cost: a summary call at its model's prices is apart; one
            # whose main call reported no usage is not priced by its summary call's, but counted
            # in no_usage)
            main_reported = row.tokens_in is not None or row.tokens_out is not None
            if (row.tokens_in or row.tokens_out) and not row.main_cost_uncached:
                model = row.model or "-"
                unpriced[model] = unpriced.get(model, 0) + 1
            elif main_reported or not (row.summary_tokens_in or row.summary_tokens_out):
                priced += 1  # (a usage of 0 tokens is reported usage: priced, at $0)
            if not row.summary_cost_uncached and (row.summary_tokens_in or row.summary_tokens_out):
                model = row.summary_model or "-"
                unpriced_summaries[model] = unpriced_summaries.get(model, 0) + 1
        if _unbilled(row):
            no_usage += 1
        elif row.background and row.tokens_in is None:
            background += 1
        for tokens, cause, usd in (
            (row.cache_waste, row.waste_cause or "unexplained", row.waste_usd),
            (row.expired, "ttl_expired", row.expired_usd),
            (row.unrequested, "not_requested", row.unrequested_usd),
        ):
            if tokens:
                waste += tokens
                by_cause[cause] = by_cause.get(cause, 0) + tokens
                if usd is None:
                    priced_waste = False
                else:
                    usd_by_cause[cause] = usd_by_cause.get(cause, 0.0) + usd
    return CostReport(
        session=session_id,
        actual=actual,
        uncached=uncached,
        # (what two sums of the same prices leave of a float's error, however large they are)
        saved=0.0 if abs(uncached - actual) < _NO_MONEY * max(1.0, uncached) else uncached - actual,
        priced_exchanges=priced,
        waste_tokens=waste,
        waste_by_cause=dict(sorted(by_cause.items(), key=lambda kv: (-kv[1], kv[0]))),
        waste_usd=sum(usd_by_cause.values()) if priced_waste else None,
        waste_usd_by_cause=(
            {cause: usd_by_cause.get(cause, 0.0) for cause in by_cause} if priced_waste else {}
        ),
        torn=detail.torn,
        unpriced=unpriced,
        unpriced_summaries=unpriced_summaries,
        no_usage=no_usage,
        background=background,
        lost=detail.lost,
    )


def _unbilled(row: ExchangeRow) -> bool:
    """Whether ``row`` went to the provider and was answered, or cut, with no usage: a stream
    cut before its usage event, a client that left, a provider that reports none. The provider
    may have billed it; its cost is not known."""
    if not row.answered or row.tokens_in is not None or row.tokens_out is not None:
        return False
    if row.background:  # (counted apart: ``CostReport.background``)
        return False
    if row.error and not row.interrupted:
        # (an error object in a 200 body, a provider's failure: not billed as a rule; a
        # request refused as too long: its retry is the exchange)
        return False
    status = row.status or 0
    # (a 503 of cachegate's stop, for a request forwarded and not yet answered: the provider
    # was at work on it, as for one its client left)
    return 200 <= status < 300 or status == CLIENT_CLOSED or _stopped(row)


def replayed(
    log_dir: str | os.PathLike[str], session_id: str, skipped: list[int] | None = None
) -> list[dict[str, Any]]:
    """Every forwarded request (``replay_requests``: ``exchange_id``, ``model``, ``stream``,
    ``params``, ``tools``, ``messages``), in log order; those that cannot be rebuilt are added
    to ``skipped``."""
    return replay_requests(_load(log_dir, session_id).events, skipped)


def replayed_whole(
    log_dir: str | os.PathLike[str], session_id: str
) -> tuple[Iterator[dict[str, Any]], list[int], LogRead]:
    """``replayed``, each request as it is rebuilt (the file read at call time), the exchanges
    it could not rebuild (filled in as they come), and the log as read: how many of its torn
    lines were requests, or were cut before their type (``torn_requests``: none of those is in
    either list, its exchange is not known), and whether the last is its last line, with no
    line end yet (``torn_at_end``)."""
    read = _load(log_dir, session_id)
    skipped: list[int] = []
    return iter_replay_requests(read.events, skipped), skipped, read


def replay_lines(log_dir: str | os.PathLike[str], session_id: str) -> Iterator[str]:
    """One JSON object per forwarded request (``replayed``), in log order. The id is checked and
    the file read at call time, so errors surface before the first line."""
    return request_lines(replayed(log_dir, session_id))


def request_lines(requests: Iterable[dict[str, Any]]) -> Iterator[str]:
    """``replay``'s output: each replayed request as one line of JSON (the standard library's
    for a body nested deeper than orjson writes, as the log holds it), U+2028 and U+2029
    escaped: a reader that splits lines as Python's ``str.splitlines`` does (and JavaScript
    before ES2019 reads a string) broke a request at them."""
    for request in requests:
        try:
            line = orjson.dumps(request).decode()
        except TypeError:
            line = deep_dumps(request, ensure_ascii=False, separators=(",", ":"))
        yield line.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def metadata_only(request: dict[str, Any]) -> bool:
    """Whether a replayed request comes from a log written with ``logging.bodies = "metadata"``:
    its messages are ``{role, chars, sha256}`` and its tools ``{count, sha256}``, not text."""
    tools = request.get("tools")
    if isinstance(tools, dict) and "sha256" in tools:
        return True
    params = request.get("params")
    if isinstance(params, dict) and any(  # (a free-text one: a Responses API one-string input)
        isinstance(v, dict) and v.keys() == {"sha256"} for v in params.values()
    ):
        return True
    messages = request.get("messages", request.get("input"))
    return isinstance(messages, list) and any(
        isinstance(m, dict) and "sha256" in m and "content" not in m for m in messages
    )


def _load(
    log_dir: str | os.PathLike[str],
    session_id: str,
    *,
    drop: Mapping[str, frozenset[str]] | None = None,
) -> LogRead:
    path = session_log_path(log_dir, session_id)  # validates the id first
    if not os.path.isdir(log_dir):  # (said as `list` says it, not as a session not there)
        if os.path.exists(log_dir):
            raise NotADirectoryError(f"log directory {os.fspath(log_dir)!r} is not a directory")
        raise FileNotFoundError(f"log directory {os.fspath(log_dir)!r} does not exist")
    try:
        log = read_events(path, drop=drop)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no log for session {redact_text(session_id)!r} in {os.fspath(log_dir)!r}"
        ) from None
    if not log.starts_as_log:  # (no session for ``list`` either: an empty file, another tool's)
        said = (
            "is empty"
            if not log.events and not log.torn
            else "is not a cachegate log (its first line is not a cachegate event)"
        )
        raise NotALogFile(f"{os.fspath(path)} {said}: no session")
    return log


# The note of a request the provider refused as too long, compacted and sent again (the log has
# no response line for it: the retry's answer is the exchange's).
RESENT_COMPACTED = "refused as too long for the context window; compacted and re-sent"


def build_detail(session_id: str, log: LogRead) -> SessionDetail:
    """Fold a session's events into one row per exchange (pure; unknown event types ignored)."""
    meta: dict[str, Any] | None = None
    rows: list[ExchangeRow] = []
    # An exchange id may repeat (a restarted process numbers from 1 again): the latest row wins.
    latest: dict[int, ExchangeRow] = {}
    requested: set[int] = set()  # id() of the rows that already hold their request
    displaced: dict[int, ExchangeRow] = {}  # a compaction's row: the exchange's row before it
    pending: dict[int, list[ExchangeRow]] = {}  # per exchange number, the rows sent, in order
    first_sent: dict[int, float] = {}  # id() of a retried row: when its exchange's first went
    retries: dict[int, list[ExchangeRow]] = {}  # id() of a refused attempt's row: its retry's

    def new_row(ev: dict[str, Any]) -> ExchangeRow:
        row = ExchangeRow(exchange=_int(ev.get("exchange")), ts=_stamp(ev.get("ts")))
        rows.append(row)
        if row.exchange is not None:
            latest[row.exchange] = row
        return row

    def row_for(ev: dict[str, Any]) -> ExchangeRow:
        exchange = _int(ev.get("exchange"))
        row = latest.get(exchange) if exchange is not None else None
        return new_row(ev) if row is None else row

    def answered_row(ev: dict[str, Any]) -> ExchangeRow:
        """The row a response answers: its exchange's request still waiting for one. Two can
        wait under one number (a session forgotten while a request was in flight, then numbered
        from 1 again; a process restarted): the one sent closest to when this response's
        exchange began."""
        exchange = _int(ev.get("exchange"))
        sent = pending.get(exchange) if exchange is not None else None
        if sent:
            sent[:] = [r for r in sent if r.status is None and not r.error]
        if not sent:
            row = row_for(ev)
            # Every request under its number answered: its own request's line was lost (a full
            # disk) under a number used before (a session forgotten and back, a restart): a
            # row of its own, not the earlier exchange's (its figures were overwritten).
            return new_row(ev) if row.answered or row.status is not None else row
        ts, duration = _stamp(ev.get("ts")), _float(ev.get("duration_s"))
        if len(sent) == 1 or ts is None or duration is None:
            return sent[-1]
        began = ts - duration
        return min(reversed(sent), key=lambda r: abs(first_sent.get(id(r), r.ts or 0.0) - began))

    for ev in log.events:
        kind = ev.get("type")
        if kind == "session_meta":
            if meta is None:
                meta = ev
        elif kind == "request":
            row = row_for(ev)
            transforms = ev.get("transforms")
            compacted = isinstance(transforms, dict) and "compacted" in transforms
            resent = (  # sent again at once without the stream_options the upstream refused
                isinstance(transforms, dict)
                and "usage_not_asked" in transforms
                and id(row) in requested
                and row.status is None
                and not row.error
            )
            if resent:
                requested.discard(id(row))  # the same row: its line is the one re-sent
                if row.exchange is not None and row.exchange in pending:
                    pending[row.exchange] = [r for r in pending[row.exchange] if r is not row]
            if id(row) in requested or row.status is not None:
                row = new_row(ev)
            earlier = displaced.pop(id(row), None)  # the attempt before this one's compaction
            if compacted and earlier is not None and earlier.status is None and not earlier.error:
                earlier.error = RESENT_COMPACTED  # the provider refused it: re-sent compacted
            # else: a fresh row, or one opened by a compaction announced just before forwarding
            row.ts = _stamp(ev.get("ts"))
            if earlier is not None:  # a retry: its exchange began with the refused attempt
                first_sent[id(row)] = first_sent.get(id(earlier), earlier.ts or 0.0)
                retries.setdefault(id(earlier), []).append(row)
            requested.add(id(row))
            if row.exchange is not None:
                pending.setdefault(row.exchange, []).append(row)
            row.model = _str(ev.get("model"))
            repairs = ev.get("repairs")
            row.repairs = len(repairs) if isinstance(repairs, list) else 0
            row.repaired = _repairs(repairs)
            row.path = _str(ev.get("path"))
            row.compacted |= compacted
            retry = ev.get("client_retry")
            row.client_retry = retry if type(retry) is int and retry > 0 else 0
        elif kind == "response":
            _apply_response(answered_row(ev), ev)
        elif kind == "compacted":
            # announced before the request it shapes: a row of its own when the exchange's
            # latest row already went out: the attempt a compaction is retried after (a line
            # with "retry": true; older logs do not say) or, with "retry": false, another
            # request under the same number (its session forgotten while that one waited)
            row = row_for(ev)
            if id(row) in requested or row.status is not None:
                earlier, row = row, new_row(ev)
                if ev.get("retry") is not False:
                    displaced[id(row)] = earlier
            row.compacted = True
        elif kind == "error":
            # cachegate's own answer to a request it did not forward ("forwarded": false; older
            # logs do not say): never the row of one that went out, which may still wait for
            # its answer under the same number
            row = row_for(ev)
            if ev.get("forwarded") is False and (id(row) in requested or row.status is not None):
                row = new_row(ev)
            row.status = _int(ev.get("status")) if row.status is None else row.status
            row.error = _str(ev.get("message"))
            row.model = row.model or _str(ev.get("model"))
            # the client left while its request was prepared (or compacted), or cachegate's
            # stop cut it (its upload, say): an interruption
            row.interrupted |= row.status == CLIENT_CLOSED or (row.error or "").startswith(
                _STOPPED_SAID
            )
    if retries:
        # A retry's row right after the attempt it re-sent (requests in flight together log
        # other exchanges between them): two rows under one number, read as one exchange.
        retried = {id(r) for held in retries.values() for r in held}
        ordered: list[ExchangeRow] = []

        def place(row: ExchangeRow) -> None:
            ordered.append(row)
            for retry in retries.get(id(row), ()):
                place(retry)

        for row in rows:
            if id(row) not in retried:
                place(row)
        rows = ordered
    # A provider that leaves its cache fields out of an answer that read nothing (Gemini's
    # OpenAI endpoint): once the session's answers have had them, a read left out is a read of
    # 0, a new conversation's first request's too (the accounting's own rule, ``has_reported``).
    reported = False
    for row in rows:
        if row.cache_reported:
            reported = True
        elif reported and row.answered and row.tokens_in:
            row.cache_measured = True
    stamps = [  # (a lines_lost line's time is the loss's: no exchange was seen then)
        ts
        for ev in log.events
        if ev.get("type") != LOST_TYPE and (ts := _stamp(ev.get("ts"))) is not None
    ]
    return SessionDetail(
        session=session_id,
        meta=meta,
        rows=rows,
        torn=log.torn,
        first_seen=min(stamps, default=None),
        last_seen=max(stamps, default=None),
        lost=lost_lines(log.events),
    )


def _apply_response(row: ExchangeRow, ev: dict[str, Any]) -> None:
    row.status = _int(ev.get("status"))
    row.ttfb_s = _float(ev.get("ttfb_s"))
    row.duration_s = _float(ev.get("duration_s"))
    row.interrupted = bool(ev.get("interrupted"))
    row.error = _str(ev.get("error"))
    row.background = ev.get("finish_reason") in BACKGROUND_STATES
    usage = ev.get("usage")
    if isinstance(usage, dict):
        row.tokens_in = _int(usage.get("prompt"))
        row.tokens_out = _int(usage.get("completion"))
        row.cache_read = _int(usage.get("cache_read"))
        row.cache_reported = row.cache_measured = bool(usage.get("reported_cache"))
    cache = ev.get("cache")
    if isinstance(cache, dict):
        if (_int(cache.get("expected")) or 0) > 0:
            row.cache_measured = True
        row.cache_waste = _int(cache.get("waste"))
        row.waste_cause = _str(cache.get("cause"))
        location = cache.get("location")
        row.waste_location = None if location is None else _location(location)
        row.unrequested = max(0, _int(cache.get("not_requested")) or 0)
        row.waste_usd = _float(cache.get("waste_usd"))
        row.unrequested_usd = _float(cache.get("not_requested_usd"))
        row.expired = max(0, _int(cache.get("expired")) or 0)
        row.expired_usd = _float(cache.get("expired_usd"))
    cost = ev.get("cost")
    if isinstance(cost, dict):
        row.cost_actual = _float(cost.get("actual"))
        row.cost_uncached = _float(cost.get("uncached"))
        if row.waste_usd is None and not row.cache_waste and row.cost_uncached:
            row.waste_usd = 0.0  # (priced, with no waste: $0, where null says "no price")
    row.answered = True
    summary = ev.get("summary")
    if isinstance(summary, dict):
        row.summary_model = _str(summary.get("model"))
        used = summary.get("usage")
        if isinstance(used, dict):
            row.summary_tokens_in = _int(used.get("prompt"))
            row.summary_tokens_out = _int(used.get("completion"))
            row.summary_cache_read = _int(used.get("cache_read"))
            row.summary_cache_reported = bool(used.get("reported_cache"))
        paid = summary.get("cost")
        if isinstance(paid, dict):
            row.summary_cost_actual = _float(paid.get("actual"))
            row.summary_cost_uncached = _float(paid.get("uncached"))


def main_model(detail: SessionDetail) -> str | None:
    """The model most of the session's exchanges asked for (of equals, the one that appeared
    first): an agent that opens with a title request on a small model is shown by its own. The
    meta line's (the first request's) when no exchange names one."""
    counts: dict[str, int] = {}
    for row in detail.rows:
        if row.model and row.error != RESENT_COMPACTED:
            counts[row.model] = counts.get(row.model, 0) + 1
    if counts:
        return max(counts, key=counts.__getitem__)
    return _str(detail.meta.get("model")) if detail.meta else None


def summarize(detail: SessionDetail) -> SessionSummary:
    """One ``sessions list`` line from a session's timeline."""
    reported_in = reported_read = 0
    reported = False  # the session's answers have had cache fields (``cache_measured``)
    for row in detail.rows:
        # A summary call is a response as any other: one without cache fields once the
        # session's answers have had them is a read of 0 (Gemini's OpenAI endpoint)
        if row.summary_tokens_in and (row.summary_cache_reported or reported):
            reported_in += row.summary_tokens_in
            reported_read += row.summary_cache_read or 0
        reported = reported or row.summary_cache_reported
        if row.cache_measured and row.tokens_in:
            reported_in += row.tokens_in
            reported_read += row.cache_read or 0
        reported = reported or row.cache_reported
    # The attempt a compaction was retried after is no exchange of its own (its retry is).
    answered = [row for row in detail.rows if row.error != RESENT_COMPACTED]
    model = main_model(detail)
    return SessionSummary(
        session=detail.session,
        first_seen=detail.first_seen,
        last_seen=detail.last_seen,
        model=model,
        exchanges=sum(1 for row in answered if row.exchange is not None),
        # (a compaction's summary call counted too: the provider bills it in the session)
        tokens_in=_total(
            _with_summary(row.tokens_in, row.summary_tokens_in) for row in detail.rows
        ),
        tokens_out=_total(
            _with_summary(row.tokens_out, row.summary_tokens_out) for row in detail.rows
        ),
        cache_read=_total(
            _with_summary(row.cache_read, row.summary_cache_read) for row in detail.rows
        ),
        cache_hit_pct=100.0 * reported_read / reported_in if reported_in else None,
        interruptions=sum(1 for row in answered if row.interrupted),
        repairs=sum(row.repairs for row in answered),
        # (a client that left before any answer, 499, is INTERRUPTED, as one that left after;
        # so is one cut by cachegate stopping, its 503 or a stream its grace period cut: not
        # the provider's error, which a client's hang-up after it does not hide)
        errors=sum(
            1
            for row in answered
            if (row.error or (row.status or 0) >= 400)
            and row.status != CLIENT_CLOSED
            and not _stopped(row)
        ),
        torn=detail.torn,
        lost=detail.lost,
    )


# How cachegate's own lines say an exchange its stop cut (a stream cut, the 503 of
# ``errors.shutting_down``): the start of each message, as a line may hold it clipped
_STOPPED_SAID: Final = (
    STOPPED_CUT[: STOPPED_CUT.index(" before")],
    SHUTTING_DOWN[: SHUTTING_DOWN.index(" and")],
)


def _stopped(row: ExchangeRow) -> bool:
    """Whether ``row`` was cut by cachegate stopping (an interruption, not an error)."""
    return row.interrupted and row.error is not None and row.error.startswith(_STOPPED_SAID)


def _with_summary(main: int | None, summary: int | None) -> int | None:
    """A row's tokens with its summary call's, None when neither is known."""
    return main if summary is None else (main or 0) + summary


def _total(values: Iterable[int | None]) -> int | None:
    """The sum of the values known, None when none is (``-`` in a table, as in ``show``)."""
    known = [value for value in values if value is not None]
    return sum(known) if known else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# No dollar amount, time or duration a log holds comes near this: a larger value is a corrupted
# or hand-edited line's (``1e308``, whose sum printed ``$inf``, and ``Infinity`` in --json).
_FLOAT_MAX: Final = 1e15


def _float(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        # (compared before float(): an integer beyond a double would raise there)
        return float(value) if -_FLOAT_MAX <= value <= _FLOAT_MAX else None
    return None


LAST_STAMP: Final = 253_402_300_799.0  # 9999-12-31 23:59:59 UTC, the last a date can show


def _stamp(value: Any) -> float | None:
    """A line's ``ts`` as a time the reports can show, or None: a hand-edited or corrupted
    line's ``1e20`` or ``-1e12`` is no time (it stopped the whole listing)."""
    ts = _float(value)
    return ts if ts is not None and 0.0 <= ts <= LAST_STAMP else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _location(value: Any) -> str:
    if isinstance(value, str):
        return value
    return orjson.dumps(value, default=str).decode()


# --------------------------------------------------------------------------------------------------
# Text


def render_list(sessions: Sequence[SessionSummary]) -> str:
    """``sessions list`` as an aligned table (no trailing newline)."""
    if not sessions:
        return "no sessions"
    headers = ["SESSION", "FIRST SEEN", "LAST SEEN", "MODEL", "EXCH", "IN", "OUT", "CACHE HIT"]
    headers += ["INTERRUPTED", "REPAIRS", "ERRORS", "TORN", "LOST"]
    rows = [
        [
            s.session,
            _time(s.first_seen),
            _time(s.last_seen),
            _model(s.model),
            str(s.exchanges),
            _tokens(s.tokens_in),
            _tokens(s.tokens_out),
            _pct(s.cache_hit_pct),
            str(s.interruptions),
            str(s.repairs),
            str(s.errors),
            str(s.torn),
            str(s.lost),
        ]
        for s in sessions
    ]
    return _table(headers, rows, left={0, 1, 2, 3})


def _repairs(logged: Any) -> list[dict[str, Any]]:
    """A request line's ``repairs``, each with the fields a report shows (odd values as null)."""
    if not isinstance(logged, list):
        return []
    out = []
    for repair in logged:
        if isinstance(repair, dict):
            index = repair.get("index")
            out.append(
                {
                    "kind": _str(repair.get("kind")),
                    "index": index if type(index) is int else None,
                    "tool_call_id": _str(repair.get("tool_call_id")),
                    "action": _str(repair.get("action")),
                }
            )
    return out


def _repair_note(
    repaired: list[dict[str, Any]],
    seen: dict[tuple[Any, ...], int],
    resent: bool = False,
    listed_in: str = "messages",
) -> str | None:
    """NOTES of a row's repairs: each one not made on an earlier row of the session, where and
    which call (an interrupted turn stays in the history, and is repaired again on every later
    request: those are counted, not listed again); ``seen`` is updated.

    A repair is told by its kind and call id (its kind and action without one), not by where it
    is, which moves when a client trims its oldest turns; a row with more of one than any row
    before it (clients that number calls per message send ``call_0`` every turn) has the later
    ones, the history's newest, as new. (A heuristic: a trimmed history, or sub-agents reusing
    ids, can have a new one counted as repaired again; REPAIRS is the exact count.) ``resent``:
    the row is its exchange's attempt sent again (compacted after the provider refused it as too
    long), whose repairs are the refused attempt's, not made again. ``listed_in``: what the
    indices are of (a Responses API request's ``input``)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for repair in repaired:
        call = repair["tool_call_id"]
        key = (repair["kind"], call) if call else (repair["kind"], None, repair["action"])
        groups.setdefault(key, []).append(repair)
    new: list[dict[str, Any]] = []
    for key, items in groups.items():
        places: list[dict[str, Any]] = []  # (one per message: a duplicate line is no new one)
        at: set[Any] = set()
        for repair in items:
            if repair["index"] not in at:
                at.add(repair["index"])
                places.append(repair)
        before = seen.get(key, 0)
        new += places[before:]
        seen[key] = max(before, len(places))
    again = 0 if resent else len(repaired) - len(new)
    if not new:
        return f"{again} repaired again" if again else None
    new.sort(key=lambda repair: (repair["index"] is None, repair["index"] or 0))  # message order
    named = []
    for repair in new[:_REPAIRS_LISTED]:
        call = repair["tool_call_id"]
        where = f" at {listed_in}[{repair['index']}]" if repair["index"] is not None else ""
        kind = _clip(repair["kind"], 32) if repair["kind"] else "repair"
        named.append(f"{kind}{where}" + (f" ({_clip(call, 40)})" if call else ""))
    listed = ", ".join(named)
    if len(new) > _REPAIRS_LISTED:  # (a history resumed with many defects: one cell, not a page)
        listed += f" and {len(new) - _REPAIRS_LISTED} more"
    return "repaired " + listed + (f" (+{again} again)" if again else "")


_REPAIRS_LISTED: Final = 3


def render_show(detail: SessionDetail) -> str:
    """``sessions show``: a header line, then one line per exchange (no trailing newline)."""
    meta = detail.meta or {}
    head = [f"session {detail.session}"]
    model = main_model(detail)
    if model is not None:
        head.append(f"model {_model(model)}")  # one line, as a cell
    for key in ("upstream", "created"):
        if isinstance(meta.get(key), str):
            head.append(f"{key} {meta[key].translate(_CELL_BREAKS)}")
    if isinstance(meta.get("version"), str):
        head.append(f"cachegate {meta['version'].translate(_CELL_BREAKS)}")
    lines = ["  ".join(head)]
    headers = ["#", "TIME", "MODEL", "IN", "OUT", "CACHED", "WASTE", "REPAIRS"]
    headers += ["TTFB", "DURATION", "STATUS", "NOTES"]
    rows = []
    repaired: dict[tuple[Any, ...], int] = {}  # the repairs made on earlier rows (most in one)
    refused: set[int] = set()  # exchanges whose latest row was refused as too long, re-sent
    for r in detail.rows:
        notes = []
        resent = r.exchange in refused
        if r.exchange is not None:
            refused.discard(r.exchange)
        if r.error == RESENT_COMPACTED and r.exchange is not None:
            refused.add(r.exchange)
        listed_in = "input" if (r.path or "").startswith("/v1/responses") else "messages"
        repair_note = _repair_note(r.repaired, repaired, resent, listed_in)
        if repair_note:
            notes.append(repair_note)
        if r.client_retry:  # (the exchange before it failed or timed out at the client)
            notes.append(f"client retry {r.client_retry}")
        if r.compacted:
            notes.append("compacted")
        if r.summary_tokens_in is not None or r.summary_tokens_out is not None:
            # (its tokens are not in IN and OUT, which are the main call's; its cost is in the
            # exchange's; sessions list's IN and OUT add them)
            cached = f" ({_tokens(r.summary_cache_read)} cached)" if r.summary_cache_read else ""
            notes.append(
                f"summary call {_tokens(r.summary_tokens_in)} in{cached},"
                f" {_tokens(r.summary_tokens_out)} out on {_model(r.summary_model)}"
            )
        if r.interrupted:
            notes.append("interrupted")
        elif r.background and r.tokens_in is None:
            notes.append("background: usage comes later, unread")
        elif r.tokens_in is None and not r.error and r.status is not None and 200 <= r.status < 300:
            notes.append("no usage reported")
        if r.error:  # (cachegate's own note whole; an upstream's error text clipped)
            notes.append(r.error if r.error == RESENT_COMPACTED else _clip(r.error, 60))
        elif r.status is None and r.exchange is not None:
            # its request line, no response line: still in flight, or cachegate was killed
            notes.append("no response logged")
        rows.append(
            [
                "-" if r.exchange is None else str(r.exchange),
                _time(r.ts),
                _model(r.model),
                _tokens(r.tokens_in),
                _tokens(r.tokens_out),
                # (a provider that reports no cache fields: unknown, not a measured 0)
                _tokens(r.cache_read) if r.cache_measured or r.cache_read else "-",
                _waste(r) if r.cache_measured or r.cache_waste else "-",
                str(r.repairs),
                _seconds(r.ttfb_s),
                _seconds(r.duration_s),
                "-" if r.status is None else str(r.status),
                ", ".join(notes),
            ]
        )
    if rows:
        lines.append(_table(headers, rows, left={1, 2, 6, 11}))
    else:
        lines.append("no exchanges")
    if detail.torn:
        lines.append(f"{detail.torn} torn line{'s' if detail.torn != 1 else ''} skipped")
    if detail.lost:
        lines.append(_lost_note(detail.lost))
    return "\n".join(lines)


def _lost_note(lost: int) -> str:
    return (
        f"{lost} line{'s' if lost != 1 else ''} of this session could not be written (a full"
        " disk, a write error, a full queue: cachegate's log and cachegate_event_log_lost_total"
        " say which); exchanges may be missing from this view"
    )


def render_cost(report: CostReport) -> str:
    """``sessions cost`` as labelled lines (no trailing newline)."""
    saved = _money(report.saved)
    if report.saved_pct is not None:
        saved += f" ({report.saved_pct:.1f}%)"
    pairs = [
        ("session", report.session),
        ("priced exchanges", str(report.priced_exchanges)),
        ("actual cost", _money(report.actual)),
        ("without cache", _money(report.uncached)),
        ("saved by cache", saved),
        (
            "wasted cache tokens",
            _tokens(report.waste_tokens)
            + _cost_of(report.waste_usd if report.waste_tokens else None),
        ),
    ]
    pairs += [
        (f"  {cause}", _tokens(tokens) + _cost_of(report.waste_usd_by_cause.get(cause)))
        for cause, tokens in report.waste_by_cause.items()
    ]
    if report.torn:
        pairs.append(("torn lines skipped", str(report.torn)))
    if report.lost:
        pairs.append(("lines lost", f"{report.lost} (the figures may miss exchanges)"))
    width = max(len(label) for label, _ in pairs)
    lines = [f"{label.ljust(width)}  {value}" for label, value in pairs]
    for what, unpriced in (
        (("exchange", "exchanges"), report.unpriced),
        (("compaction summary", "compaction summaries"), report.unpriced_summaries),
    ):
        for model, count in unpriced.items():
            lines.append(
                f"{count} {what[count > 1]} on {_model(model)} counted as $0: its prices are 0"
                " (unless it is free, set price_input and price_output in its [models] table)"
            )
    if report.no_usage:
        many = report.no_usage > 1
        lines.append(
            f"{report.no_usage} exchange{'s' if many else ''} reported no usage (the client left"
            " before it, cachegate stopped before it, or a provider that gives none): not"
            " counted, though the provider may"
            f" have billed {'them' if many else 'it'}"
        )
    if report.background:
        many = report.background > 1
        lines.append(
            f"{report.background} background response{'s' if many else ''} (Responses API,"
            " answered queued): the usage comes with a later GET /v1/responses/{id}, which"
            f" cachegate relays unread: not counted, though the provider bills"
            f" {'them' if many else 'it'}"
        )
    return "\n".join(lines)


# A table cell is one line: a tab or line end in a client's string (a model name) would shift
# the columns, or start a line that reads as another row.
_CELL_BREAKS = {9: "\ufffd", 10: "\ufffd", 11: "\ufffd", 12: "\ufffd", 13: "\ufffd"}
_CELL_BREAKS.update({0x85: "\ufffd", 0x2028: "\ufffd", 0x2029: "\ufffd"})


def _cost_of(usd: float | None) -> str:
    """`` ($0.0123)`` after a count of wasted tokens: what they cost over a read."""
    return "" if usd is None else f" ({_money(usd)})"


def _model(name: str | None) -> str:
    return "-" if not name else _clip(name.translate(_CELL_BREAKS), 40)


def _table(headers: list[str], rows: list[list[str]], *, left: set[int]) -> str:
    rows = [[c.translate(_CELL_BREAKS) for c in row] for row in rows]
    widths = [max(_width(h), *(_width(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        out = []
        for i, (c, w) in enumerate(zip(cells, widths, strict=True)):
            pad = " " * (w - _width(c))
            out.append(c + pad if i in left else pad + c)
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), *(line(row) for row in rows)])


# Control characters a terminal would act on (escape sequences can recolour, retitle or rewrite
# the screen), from a client's model name or an upstream's error text: shown as U+FFFD.
# Also the bidirectional overrides and isolates, which reorder how the rest of a line displays
# ("Trojan Source"): a model name ending in U+202E could make a row read as another.
_BIDI = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_CONTROLS = {
    c: "\ufffd" for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), *_BIDI) if c not in (9, 10)
}


# In JSON, C0 controls are already escaped; C1 controls (a terminal acts on U+009B as on ESC [)
# may only stand inside strings, where their \u escapes mean exactly the same.
_C1_ESCAPED = {c: f"\\u{c:04x}" for c in (*range(0x80, 0xA0), *_BIDI)}


def _class_of(codes: Iterable[int]) -> re.Pattern[str]:
    """A regular expression that finds any of ``codes`` (a search at C speed: ``str.translate``
    looks every character of a line up once one is not ASCII, ~0.1 µs each)."""
    return re.compile("[" + "".join(re.escape(chr(c)) for c in sorted(codes)) + "]")


_C1_FOUND = _class_of(_C1_ESCAPED)
_CONTROL_FOUND = _class_of(_CONTROLS)


def json_terminal_safe(line: str) -> str:
    """A JSON line with the C1 control characters and the bidirectional controls escaped: the
    same JSON, inert on a terminal. (Translated only where it holds one: ``replay`` of a
    history with one em dash in it spent 11.2 s on 94 MB, 1.2 s with the search first.)"""
    return line.translate(_C1_ESCAPED) if _C1_FOUND.search(line) else line


def terminal_safe(text: str) -> str:
    """``text`` with the control characters a terminal would act on replaced (tab and newline
    kept): what the reports print comes from logs whose strings clients and upstreams chose."""
    return text.translate(_CONTROLS) if _CONTROL_FOUND.search(text) else text


def _time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _tokens(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _pct(p: float | None) -> str:
    return "-" if p is None else f"{p:.1f}%"


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f}s"


def _money(usd: float) -> str:
    """Dollars to four decimals, or to two significant digits for an amount under a tenth of a
    cent (a cheap model's session: $0.000042, not $0.0000)."""
    size = abs(usd)
    if size < _NO_MONEY:  # (what two sums of the same prices leave of a float's error)
        return "$0.0000"
    text = f"{size:.4f}"
    if size < 0.001:
        digits = min(12, 1 - math.floor(math.log10(size)))
        small = f"{size:.{digits}f}"
        if float(small) < 0.001:  # (0.00099996 rounds to a tenth of a cent: $0.0010)
            text = small
    return f"-${text}" if usd < 0 else f"${text}"


_NO_MONEY: Final = 5e-10  # dollars below which an amount shows as $0.0000


def _waste(r: ExchangeRow) -> str:
    if not r.cache_waste:
        return "-" if r.cache_waste is None else "0"
    text = _tokens(r.cache_waste)
    if r.waste_cause:
        text += f" {r.waste_cause}"
    if r.waste_location:
        text += f"@{r.waste_location}"
    if r.expired:
        text += f" +{_tokens(r.expired)} ttl_expired"
    if r.unrequested:
        text += f" +{_tokens(r.unrequested)} not_requested"
    return text


def _width(text: str) -> int:
    """Columns ``text`` takes on a terminal: two for a wide character (CJK, most emoji), none
    for a combining mark (a provider's Chinese error text lined up as ASCII does)."""
    if text.isascii():
        return len(text)
    return sum(_char_width(c) for c in text)


def _char_width(char: str) -> int:
    if ord(char) in _CONTROLS:  # shown as U+FFFD (``terminal_safe``): one column
        return 1
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def _clip(text: str, limit: int) -> str:
    """``text`` on one line, in at most ``limit`` columns (an ellipsis where it was cut)."""
    text = " ".join(text.split())
    if _width(text) <= limit:
        return text
    used, end = 1, 0  # (the ellipsis's column)
    for end, char in enumerate(text):  # noqa: B007 - ``end`` is read after the loop
        used += _char_width(char)
        if used > limit:
            break
    return text[:end] + "…"
