"""The I/O side of compaction: decide per request, call the summarizer once, keep it sticky.

The pure decisions live in ``proxy.compaction``; this module adds the one upstream call (the
summarizer, without tools) and the session state. Compaction never breaks a session: when the
summarizer fails or times out, the extractive summary is used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import operator
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import httpx
import orjson

from proxy import compaction, pairing
from proxy.assemble import read_answer
from proxy.config import ModelSettings, Settings
from proxy.eventlog import NotALogFile, logged_compactions, session_log_path
from proxy.observers import exchange_keys
from proxy.pipeline import Exchange, Observer, clip_words, error_message, notify
from proxy.prefix import request_tools
from proxy.redact import redact_text, without_values
from proxy.relay import Relay, decoded_answer, open_error_kind
from proxy.sessions import CONVERSATIONS_KEPT, SessionState, SessionStore
from proxy.usage import added, normalize_usage

log = logging.getLogger(__name__)

# Labels of the messages pairing repair writes; they never count as the user's launching message.
SYNTHETIC_PREFIXES: tuple[str, ...] = (
    compaction.SUMMARY_MARKER,
    "[cachegate]",
    *pairing.DOWNGRADE_PREFIXES,
)


_MAX_MODELS = 256
_OWN_REQUEST_HEADERS = frozenset({b"content-type", b"accept", b"idempotency-key"})
_FLUSH_WAIT_S = 2.0  # the most a session's first long history waits for the log's queue
MAX_COMPACTIONS = CONVERSATIONS_KEPT  # conversations of one session with a compaction each

# A compaction aims below this share of the trigger (60% of the window at the default 75%): a
# history compacted to just under the trigger reaches it again with the next turn's round.
TARGET_SHARE = 0.8
# Where the provider counted the previous request at more than this many times cachegate's
# estimate of it (dense text: CSV, minified JSON, long numbers), a compaction planned on the
# estimate would keep more than the trigger: it is planned as after a refusal, on the window
# divided by that factor (``_compact``).
REPLAN_OVERCOUNT = 1 / TARGET_SHARE
# The most the kept messages are taken to count, in times cachegate's estimate, where the
# provider's count that shrank the window was of a history that held what the compaction
# summarizes (a dense tool output there, not in the kept messages: ``_compact``); the provider's
# refusal of the compaction, should they count more, is measured on them alone.
KEPT_OVERCOUNT = 1.5
# Where no plan comes under the aim, a launching message of at most this share of the window is
# kept verbatim all the same (the cost of a short task is in the estimate's noise; a long one's
# may not be: 4 bytes a token is a guess, and dense text runs over it).
ANCHOR_SHARE = 0.02


@dataclasses.dataclass(slots=True)
class _Summary:
    """A summary being written (or written) for a session: its task, the history prefix it
    covers (``start``, ``end``, the digest of ``messages[:end]``), the requests waiting for it,
    whether an exchange has been sent with it (which records it and its bill: once), and
    whether its tokens and cost were counted in the metrics already (none waited when it was
    done)."""

    task: asyncio.Future[tuple[compaction.Compaction, str, Any, float]]
    start: int
    end: int
    digest: str
    origin: Exchange | None  # the request it was written for (until it is billed)
    # The summary of the compaction this one was made on (rolled into it), when no request was
    # sent with that one: the first request sent with this one carries both bills.
    rolled: _Summary | None = None
    waiting: int = 0
    claimed: bool = False
    metered: bool = False
    # How many leading system/developer messages the history it was made of had: its places
    # past them are the ones a history with another count of them waits for and is sent with
    lead: int = 0

    @property
    def key(self) -> str:
        return _summary_key(self.start - self.lead, self.end - self.lead, self.digest)

    @property
    def failed(self) -> bool:
        """Cancelled (cachegate stopping) or failed (cachegate's defect): made again if asked."""
        task = self.task
        return task.done() and (task.cancelled() or task.exception() is not None)

    @property
    def upstream_s(self) -> float:
        """The provider's time in the task (the summary call): not cachegate's overhead."""
        task = self.task
        if task.done() and not task.cancelled() and task.exception() is None:
            return float(task.result()[3])
        return 0.0


class NotAChatCompletion(ValueError):
    """A summarizer's 200 whose JSON is no chat completion (a gateway's own shape, a list)."""


def _shape(value: Any) -> str:
    """What a JSON value is, for a warning: an object's first keys, else its type (never its
    values: a provider's echo may hold a key)."""
    if isinstance(value, dict):
        keys = [str(k)[:40] for k in list(value)[:6]]
        return "an object with " + (", ".join(keys) if keys else "no keys")
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _summary_key(start: int, end: int, digest: str) -> str:
    """Where a session keeps the summary of ``messages[start:end]`` (``_Summary``), its places
    counted past the leading system/developer messages, by the digest of ``messages[:end]``
    (which begins past them too)."""
    return f"{start}:{end}:{digest}"


def _comp_summary_key(comp: compaction.Compaction) -> str:
    """``_summary_key`` of the summary ``comp`` was made from."""
    lead = _lead_of(comp)
    return _summary_key(comp.start - lead, comp.covered - lead, comp.prefix_digest)


def _lead_of(comp: compaction.Compaction) -> int:
    """How many leading system/developer messages ``comp``'s places count (its opening's
    ``"N:"``)."""
    made = comp.opening.partition(":")[0]
    return int(made) if made.isdigit() else 0


def _key(comp: compaction.Compaction) -> str:
    """Where a session holds ``comp``: by its opening and covered prefix, past the leading
    messages (the same compaction moved to another count of them, ``_at_lead``, is held in
    its place)."""
    return comp.opening.partition(":")[2] + comp.prefix_digest


def _at_lead(comp: compaction.Compaction, lead: int) -> compaction.Compaction:
    """``comp`` as it applies to a history that opens with ``lead`` system/developer messages:
    its places moved by the difference from the count it was made with (its opening's
    ``"N:"``); its digests, which begin past them, are the same."""
    made = _lead_of(comp)
    if made == lead or not comp.opening[:1].isdigit():
        return comp
    shift = lead - made
    opened = comp.opening.partition(":")[2]
    return dataclasses.replace(
        comp, start=comp.start + shift, covered=comp.covered + shift, opening=f"{lead}:{opened}"
    )


def _cut_output(new: Any, old: Any) -> bool:
    """``new`` is tool result ``old`` cut in place: the same call's, nothing else of it
    changed, its text shorter and a cut of the old one (``_cut_text``) (``Compactor._pruned``).
    Another text, shorter or not (a result corrected, a sub-agent's own), is no cut: the
    summary would contradict it."""
    if not (isinstance(new, dict) and isinstance(old, dict)):
        return False
    if new.get("role") != "tool" or old.get("role") != "tool":
        return False
    if {k: v for k, v in new.items() if k != "content"} != {
        k: v for k, v in old.items() if k != "content"
    }:
        return False
    return _cut_text(compaction.message_text(new), compaction.message_text(old))


def _cut_text(text: str, was: str) -> bool:
    """Whether ``text`` is ``was`` cut: a note in brackets that says so in its place
    (opencode's ``[Old tool result content cleared]``), or its start kept (64 characters or
    more), perhaps its end too, with nothing but the mark of the cut between or after them: an
    ellipsis, a note in brackets that says so, or both (``… [output truncated]``, OpenClaw's
    ``[Tool result trimmed: kept first 1500 chars and last 1500 chars of N chars.]``). A
    result in brackets that says no cut (``[1, 2, 3]``, ``(no output)``), or one that keeps the
    old start and goes on otherwise (``Compiling 3 files...``), is another text."""
    if len(text) >= len(was):
        return False
    if _cut_mark(text) and _CUT_NOTE.fullmatch(text.strip()):
        return True
    body = text.rstrip()
    last = body[body.rfind("\n") + 1 :]  # (a note on a line of its own at the end)
    note = len(last) <= _CUT_NOTE_CHARS and _cut_mark(last) and _CUT_NOTE.fullmatch(last.strip())
    if note:
        body = body[: len(body) - len(last)]
    head = _common_run(body, was, from_end=False)
    if head < _CUT_KEPT_CHARS:
        return False
    rest = body[head:].rstrip()
    tail = _common_run(rest, was[head:].rstrip(), from_end=True)
    mark = rest[: len(rest) - tail]
    if len(mark) > _CUT_NOTE_CHARS or not (note or _cut_mark(mark)):
        return False
    return all(  # (nothing between the kept start and end but the mark: no new text)
        not piece or _CUT_ELLIPSIS.fullmatch(piece) or _CUT_NOTE.fullmatch(piece)
        for piece in (p.strip() for p in mark.splitlines())
    )


def _cut_mark(text: str) -> bool:
    """Whether ``text`` says a cut: an ellipsis, or a word of a note's (cleared, truncated …)."""
    return "..." in text or "\u2026" in text or _CUT_WORDS.search(text) is not None


def _common_run(a: str, b: str, *, from_end: bool) -> int:
    """How many characters ``a`` and ``b`` share at their start (or their end)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # (halving: a few slice compares, each in C)
        mid = (lo + hi + 1) // 2
        same = a[len(a) - mid :] == b[len(b) - mid :] if from_end else a[:mid] == b[:mid]
        if same:
            lo = mid
        else:
            hi = mid - 1
    return lo


# A note in brackets (one line, short); an ellipsis alone, or one before or after a note; the
# words a note says a cut with; how much of the start a trimmed output keeps at least, and how
# long the mark of the cut may be.
_CUT_NOTE: Final = re.compile(r"(?:\.\.\.|\u2026)?\s*[\[(<][^\n]{1,200}[\])>]\s*(?:\.\.\.|\u2026)?")
_CUT_ELLIPSIS: Final = re.compile(r"(?:\.\.\.|\u2026)+")
_CUT_WORDS: Final = re.compile(
    r"(?i)clear|prun|trunc|omit|omission|elid|remov|trim|redact|compact|shorten|hidden|\bdrop|"
    r"\bcut\b|\bskip|more lines|\bchars\b|\bcharacters\b|\bbytes\b|\blines\b"
)
_CUT_NOTE_CHARS: Final = 200
_CUT_KEPT_CHARS: Final = 64


def _within_bytes(text: str, clipped: str, budget: int) -> str:
    """``clipped`` (``text`` cut at ``budget`` characters), cut further until its JSON takes no
    more than ``budget`` bytes: the room a retry planned for its summary is in the estimate's
    bytes, and a summary in Chinese or Japanese (three bytes a character) or full of escapes,
    within its characters, was twice that and the retry refused again."""
    if _json_size(clipped) <= budget:
        return clipped
    # The longest cut that fits (a search: an English summary whose end is in Chinese takes
    # more bytes a character at its end than on average); 100 characters and the cut's note
    # fit any budget (a summary is asked for 1,000 characters at least).
    fits, over = 100, len(clipped)
    best = compaction.clip_summary(text, fits)
    while over - fits > 1:
        middle = (fits + over) // 2
        cut = compaction.clip_summary(text, middle)
        if _json_size(cut) <= budget:
            fits, best = middle, cut
        else:
            over = middle
    return best


def _extractive(plan: compaction.Plan, chars: int, *, exact: bool) -> str:
    """The extractive summary of ``plan``'s middle in ``chars`` characters; ``exact`` (a
    retry's, planned on that length to the token): in ``chars`` bytes of JSON too, where its
    text takes more (a history in Chinese, three bytes a character: the retry was refused
    again), each section keeping its share."""
    text = compaction.extractive_summary(
        plan.middle,
        previous_summary=plan.previous_summary,
        max_chars=chars,
        synthetic_prefixes=SYNTHETIC_PREFIXES,
        fits=(lambda text: _json_size(text) <= chars) if exact else None,
    )
    if exact and _json_size(text) > chars:  # (200 characters of escapes: cut as a model's is)
        return _within_bytes(text, text, chars)
    return text


def _json_size(text: str) -> int:
    """The bytes ``text`` takes as a JSON string (the standard library's, escaped, for one
    orjson refuses: a lone surrogate)."""
    try:
        return len(orjson.dumps(text))
    except orjson.JSONEncodeError:
        return len(json.dumps(text))


def _without_trailing_results(ex: Exchange, messages: list[Any]) -> list[Any]:
    """``messages`` without the results the repair added at its end, for the last message's
    unanswered calls: the client sends the real ones there next turn, which the trigger would
    take for another history's end. A copy the repair made of a client's own result (its id
    given, a blank part taken out) stays: the provider counted it, and the client sends it
    again next turn, where the trigger would count it twice (and the provider's count read
    as 1.3 times cachegate's estimate)."""
    client = ex.client_body.get("messages") if isinstance(ex.client_body, dict) else None
    if not isinstance(client, list) or messages is client:
        return messages
    block = len(client) - 1  # (the client's last message with calls: its results follow it)
    while block >= 0 and isinstance(client[block], dict) and client[block].get("role") == "tool":
        block -= 1
    made = {  # (ids an earlier interrupted call shares, reused or rewritten alike, are not)
        r.get("tool_call_id")
        for r in ex.repairs
        if r.get("kind") == "dangling_call" and r.get("index") == block
    }
    if not made:
        return messages
    tail = client[-8:]
    end = len(messages)
    while end > 1:
        last = messages[end - 1]
        if not isinstance(last, dict) or last.get("role") != "tool":
            break
        if any(last is own for own in tail) or last.get("tool_call_id") not in made:
            break
        end -= 1
    return messages if end == len(messages) else messages[:end]


def _provider_overcount(forwarded: list[Any], appended: int, last: compaction.LastUsage) -> float:
    """How many times cachegate's estimate the provider counted the previous request at: its
    prompt tokens against the estimate of what went out (``forwarded`` without the ``appended``
    messages since, which come last; with its tools). 1.0 where nothing is known."""
    previous = forwarded[: len(forwarded) - appended] if appended > 0 else forwarded
    estimate = compaction.estimate_tokens(previous)
    if last.tools:
        estimate += compaction.estimate_tokens(last.tools)
    return last.prompt / estimate if estimate > 0 and last.prompt > 0 else 1.0


class Compactor:
    """Per-request compaction transform; ``force=True`` after a ``context_length_exceeded``."""

    def __init__(
        self,
        settings: Settings,
        relay: Relay,
        observers: list[Observer],
        sessions: SessionStore | None = None,
        log_dir: str | None = None,
        flush_log: Callable[[str, float], bool] | None = None,
    ) -> None:
        self.settings = settings
        self.relay = relay
        self.observers = observers
        self.sessions = sessions  # (a session a summary is written for is kept meanwhile)
        # The event log's directory: a session cachegate forgot (a restart, an eviction) takes
        # up the compactions its log records (``_restore``) rather than pay for new summaries.
        self.log_dir = log_dir
        # Waits (up to the seconds given) until the lines of a session emitted so far are in
        # its log: a session forgotten for the count or the memory budget comes back at once,
        # its compaction's line still queued (the writer writes every 50 ms).
        self.flush_log = flush_log
        # Per model name, its configured entry: looked up once (a snapshot's name scans them all).
        self._models: dict[str | None, ModelSettings] = {}
        self._tasks: set[asyncio.Future[Any]] = set()  # summaries being written (``_made``)
        # cachegate is stopping (``Gateway.stopping``): a summary a request left is not kept
        self.stopping = False

    def _model(self, name: str | None) -> ModelSettings:
        found = self._models.get(name)
        if found is None:
            if len(self._models) >= _MAX_MODELS:  # model names come from clients: bounded
                self._models.clear()
            found = self._models[name] = self.settings.model(name)[1]
        return found

    async def apply(
        self,
        ex: Exchange,
        state: SessionState,
        body: dict[str, Any],
        *,
        force: bool = False,
        window: int | None = None,
        overcount: float = 1.0,
        reserved: int = 0,
        counted: int | None = None,
    ) -> dict[str, Any]:
        """The body to forward. ``force`` compacts whatever the trigger says (the provider just
        refused the history as too long); ``window`` is the provider's real limit when it said so,
        ``overcount`` how many times cachegate's estimate the provider counted the refused body
        (the window is planned as that much smaller: dense text, code), ``reserved`` the
        completion tokens the request asked for, which such a provider counts in the window (it
        is planned as that much smaller too: a compacted retry that fitted the window by itself
        was refused again, after a summary call paid for), ``counted`` the prompt tokens the
        refusal says the refused body held, where it says (``_cut_summary``).
        A compaction that fails before forwarding lets the request go as it is (compaction never
        breaks a request); one for a retry raises (the caller answers it in OpenAI's shape)."""
        if force:
            return await self._apply(
                ex,
                state,
                body,
                force=True,
                window=window,
                overcount=overcount,
                reserved=reserved,
                counted=counted,
            )
        try:
            return await self._apply(ex, state, body, force=False, window=window)
        except Exception:
            log.exception("compaction failed; the request is forwarded as the client sent it")
            return body

    async def _apply(
        self,
        ex: Exchange,
        state: SessionState,
        body: dict[str, Any],
        *,
        force: bool,
        window: int | None,
        overcount: float = 1.0,
        reserved: int = 0,
        counted: int | None = None,
    ) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return body
        if not all(type(m) is dict for m in messages):  # (null, a number: no message to plan
            return body  # with; the provider's to refuse, as without cachegate)
        # (the next turn's trigger compares its history with this one, both as repaired: a
        # synthetic result shifts the client's messages, and the provider's numbers went unused)
        ex.compaction_input = _without_trailing_results(ex, messages)
        pending: dict[str, _Summary] | None = state.extra.get("summaries")
        running = self._running_for(pending, messages) if pending else None
        if running is None:
            return await self._compact(
                ex, state, body, messages, force, window, overcount, reserved, counted
            )
        return await self._after(
            ex, state, body, messages, force, window, overcount, reserved, running, counted
        )

    async def _after(
        self,
        ex: Exchange,
        state: SessionState,
        body: dict[str, Any],
        messages: list[Any],
        force: bool,
        window: int | None,
        overcount: float,
        reserved: int,
        running: _Summary,
        counted: int | None = None,
    ) -> dict[str, Any]:
        """A retry, or the agent's next turn, while its history's summary is written (its client
        left, or it came while the session's log was read): it waits for that one, then goes out
        with it (``_claim``), rather than pay for another; or, should its history need more,
        with a compaction made on it."""
        log.info("session %s: waiting for the summary of its history", state.id)
        await self._wait(ex, state, running)
        try:
            forwarded = await self._compact(
                ex, state, body, messages, force, window, overcount, reserved, counted
            )
        except BaseException:
            self._meter(running)  # (no response of this one's prices it)
            raise
        if not running.claimed and not running.failed:
            # not sent with it, nor a compaction made on it (another cut): a later request sent
            # with it records it; the metrics count it now
            self._meter(running)
        return forwarded

    async def _compact(
        self,
        ex: Exchange,
        state: SessionState,
        body: dict[str, Any],
        messages: list[Any],
        force: bool,
        window: int | None,
        overcount: float,
        reserved: int = 0,
        counted: int | None = None,
    ) -> dict[str, Any]:
        cfg = self.settings.compaction
        model_cfg = self._model(ex.model)
        stated = window  # (as given: a plan made again starts from it)
        if window is not None:
            model_cfg = dataclasses.replace(model_cfg, context_window=window)
        if force and reserved >= model_cfg.context_window:
            # The completion asked for fills the window by itself: no history would fit beside
            # it, so no summary is paid for; the refusal is the client's answer.
            log.info(
                "session %s: the %d completion tokens asked for fill the %d-token window; "
                "nothing to compact",
                state.id,
                reserved,
                model_cfg.context_window,
            )
            return body
        if reserved > 0:  # (the completion's share of it: the prompt's)
            model_cfg = dataclasses.replace(
                model_cfg, context_window=model_cfg.context_window - reserved
            )
        # (the summary's length: the prompt's share of the real window, its count the provider's)
        summary_window = model_cfg.context_window
        if overcount > 1:  # plan against the window as cachegate's estimate counts
            shrunk_window = max(1, int(model_cfg.context_window / overcount))
            model_cfg = dataclasses.replace(model_cfg, context_window=shrunk_window)
        # The provider's numbers for the history this one carries on, of the conversations the
        # session's latest answers were of (a sub-agent's or a title request's answer since is
        # another's; none: a rewind, a history changed in place since, opencode clearing its
        # old tool outputs: the estimate decides)
        usages: Sequence[compaction.LastUsage] = state.extra.get("last_usages", ())
        last = next((u for u in usages if compaction.carries_on(messages, u)), None)
        held: dict[str, list[Any]] = state.extra.setdefault("compactions", {})
        existing, known = self._existing(held, messages)
        if (
            existing is None
            and len(messages) > compaction.leading_count(messages) + cfg.keep_recent
            and await self._restore(state)
        ):
            # The session's first history in this process long enough to have been compacted:
            # a compaction an earlier process made (or this one, before it forgot the session)
            # may cover it. Tried whatever the trigger says, as a held one is reused: after a
            # restart the provider's counts are gone, and cachegate's estimate of dense text
            # (code, JSON) can be under the trigger the provider's count had reached.
            held = state.extra["compactions"]
            existing, known = self._existing(held, messages)
        carried: compaction.Compaction | None = None
        if held:
            # (also where an older compaction covers a prefix of it: the agent cleared outputs
            # again, those the older one covers cleared already, and the one used last, which
            # covers more, is carried; the older one was reused, the newer summary lost)
            carried = self._pruned(held, messages, existing.covered if existing else 0)
            if carried is not None:  # (the same summary, under this history's digest)
                existing, known = carried, carried.prefix_digest
            elif existing is None:
                ex.compaction_undone = self._undone(held, messages)
        if last is not None and last.compaction != (existing.prefix_digest if existing else None):
            # The provider counted a history with another summary in it, or with one where
            # this goes without (a message it covers was changed: an old tool output cleared),
            # or none where this one would have one: the estimate decides.
            last = None
        tools = request_tools(body)  # (the legacy ``functions`` too)
        tools_tokens = compaction.estimate_tokens(tools) if tools else 0
        appended = messages[last.messages :] if last else []
        completion = 0  # the previous answer, as the history holds it
        if appended and isinstance(appended[0], dict) and appended[0].get("role") == "assistant":
            # the previous answer: its completion tokens count it, but no more than its bytes
            # (a token is a byte or more): a reasoning model's thinking, most of its completion
            # tokens, is not in the history (7,000 of them a turn compacted a history at a
            # third of the window)
            size = compaction.estimate_tokens(appended[:1]) * compaction.BYTES_PER_TOKEN
            completion = min(last.completion, size) if last else 0
            appended = appended[1:]
        grown = 0  # tools added since (an MCP server connected): the provider's numbers lack them
        if last is not None and last.tools is not tools and last.tools != tools:
            before = compaction.estimate_tokens(last.tools) if last.tools else 0
            grown = max(0, tools_tokens - before)
        appended_estimate = compaction.estimate_tokens(appended) + grown
        plan = compaction.plan(
            messages,
            existing=existing,
            existing_digest=known,
            window=model_cfg.context_window,
            trigger_percent=cfg.trigger_percent,
            keep_recent=cfg.keep_recent,
            max_anchor_chars=cfg.max_anchor_chars,
            last_prompt=last.prompt if last else None,
            last_completion=completion if last else None,
            appended_estimate=appended_estimate,
            force=force,
            synthetic_prefixes=SYNTHETIC_PREFIXES,
            tools_estimate=tools_tokens,
            asked=compaction.output_requested(body) if not force else 0,
        )

        if plan.triggered and not force and overcount <= 1 and last is not None:
            ratio = _provider_overcount(plan.messages, len(messages) - last.messages, last)
            if ratio > REPLAN_OVERCOUNT:
                # Planned on the estimate, the kept tail (a dense tool output in it) would be
                # near the window by the provider's count: compacted again every turn, a
                # summary paid and the cache lost each time, and the history no smaller.
                log.info(
                    "session %s: the provider counts this history at %.1f times cachegate's"
                    " estimate; compacting on its count",
                    state.id,
                    ratio,
                )
                return await self._compact(
                    ex, state, body, messages, force, window, ratio, reserved, counted
                )

        def shrunk(keep_recent: int, anchor: bool) -> compaction.Plan:
            """The plan that keeps ``keep_recent`` messages, the launching one verbatim or not,
            whatever the trigger says."""
            return compaction.plan(
                messages,
                existing=existing,
                existing_digest=known,
                window=model_cfg.context_window,
                trigger_percent=cfg.trigger_percent,
                keep_recent=keep_recent,
                max_anchor_chars=cfg.max_anchor_chars if anchor else 0,
                force=True,
                synthetic_prefixes=SYNTHETIC_PREFIXES,
            )

        window = model_cfg.context_window
        asked = compaction.output_requested(body) if plan.triggered and not force else 0
        if 0 < asked < summary_window:
            # The completion the request asks for, which most providers count in the window
            # with the prompt (OpenAI, vLLM, Anthropic): the compaction leaves room for it, as
            # a retry's does (planned against the whole window, it went out over it with the
            # completion, was refused, and a second summary was paid for the retry).
            summary_window -= asked
            window = max(1, int(summary_window / overcount)) if overcount > 1 else summary_window
        extra = 0  # what a compacted request holds besides the kept messages: the summary, tools
        if plan.triggered:
            extra = compaction.summary_chars(window) // compaction.BYTES_PER_TOKEN + 100
            extra += tools_tokens
        aim = window * cfg.trigger_percent / 100 * TARGET_SHARE
        # The system prompt and tools (with the summary's room) reach the trigger by themselves:
        # no compaction brings the request under it, and one made on every turn paid a summary
        # each time for a few percent of the prompt and kept only the latest round (a
        # 12,600-token system prompt in a 16,000-token window). The trigger then applies to the
        # room they leave in the window (the answer keeps its share of it): only a request past
        # that edge is compacted, as a history too short to compact is past the window.
        system = (
            compaction.estimate_tokens(messages[: compaction.leading_count(messages)])
            if plan.triggered and not force and (plan.cut is not None or plan.reused is not None)
            else None
        )
        # (``extra``: the summary's room and the tools)
        beyond = system is not None and system + extra >= window * cfg.trigger_percent / 100
        edge = float(window)  # (on the estimate's scale, as ``window``)
        if system is not None and beyond:
            fixed = system + tools_tokens
            edge = fixed + max(0, window - fixed) * cfg.trigger_percent / 100
        if beyond and not state.extra.get("warned_fixed"):
            state.extra["warned_fixed"] = True
            log.warning(
                "session %s: the system prompt and tools alone are over compaction's trigger"
                " (%g%% of the %d-token window, with the summary's room): compacted only where"
                " a request goes past %g%% of the room they leave",
                state.id,
                cfg.trigger_percent,
                model_cfg.context_window,
                cfg.trigger_percent,
            )
        if not beyond and plan.cut is not None and not self._fits(messages, plan.cut, aim, extra):
            # Keeping the launching message verbatim with as many latest messages leaves the
            # history over its aim: fewer of them with it (half, then half again) where that
            # comes under it, else give up the anchor rather than forward a compaction that
            # does not compact (a long pasted task was summarized where it fitted beside the
            # latest four messages).
            keep, fewer = cfg.keep_recent, None
            while keep > 1 and fewer is None:
                keep //= 2
                smaller = shrunk(keep, anchor=True)
                if smaller.cut is not None and self._fits(messages, smaller.cut, aim, extra):
                    fewer = smaller
            plan = fewer if fewer is not None else shrunk(cfg.keep_recent, anchor=False)
        if plan.triggered and plan.cut is None and plan.reused is not None:
            # The cut pulled back to the launching message ends where the reused compaction
            # ends: nothing more to compact with it verbatim. Without it, at the full
            # ``keep_recent`` first (the loops below halve before they try: a later
            # instruction's session kept half its latest messages at each compaction after
            # the first, though all of them were far under the aim).
            whole = shrunk(cfg.keep_recent, anchor=False)
            if whole.cut is not None:
                plan = whole
        # The latest messages alone fill the aim (large tool outputs, a small window): keep
        # fewer of them, the launching message still verbatim where that fits, rather than
        # compact again on the next turn. Where a session not compacted yet has too little
        # history to compact at all, only what would not fit the window is shrunk (a pasted
        # document that fits stays). After a refusal, always: a retry that does not fit is
        # refused again.
        if not plan.triggered:
            limit = 0.0
        elif (force or plan.cut is not None or plan.reused is not None) and not beyond:
            limit = aim
        else:
            # As it is, with no summary in it (the summary's room is no part): over the window
            # by cachegate's estimate, or by the provider's count of the previous request and
            # of what came since (dense tool outputs: the estimate alone let a history over the
            # window go, refused, and compacted only on the retry). The answer's completion
            # tokens only where the history holds the answer, and no more than its bytes (a
            # reasoning model's count its thinking); tools dropped since are taken off. The
            # limit is the window on the estimate's scale.
            estimate = compaction.estimate_tokens(plan.messages) + tools_tokens
            counted = 0
            if last is not None and (plan.reused is None or beyond) and not plan.discarded:
                # (the provider's count of the request with the summary it reuses, when beyond)
                had = compaction.estimate_tokens(last.tools) if last.tools else 0
                tail = messages[last.messages :]
                answer = 0
                if tail and isinstance(tail[0], dict) and tail[0].get("role") == "assistant":
                    # the previous answer, as the provider counted it, but no more than its
                    # bytes (a token is a byte or more): a reasoning model's thinking, in its
                    # completion tokens, is not in the history
                    size = compaction.estimate_tokens(tail[:1]) * compaction.BYTES_PER_TOKEN
                    answer, tail = min(last.completion, size), tail[1:]
                # (on the provider's scale where it counts more than the estimate: a dense
                # tool output)
                ratio = _provider_overcount(messages, len(messages) - last.messages, last)
                since = int(compaction.estimate_tokens(tail) * max(1.0, ratio))
                counted = last.prompt + answer + since + tools_tokens - had
            past = summary_window * edge / window  # (the edge on the provider's scale)
            if estimate > edge:
                limit = edge
            elif counted > past:
                limit = min(edge, past * estimate / counted)
            else:
                limit = 0.0
                if beyond:  # (it fits: it goes as it is, or with the summary it had)
                    plan = dataclasses.replace(plan, cut=None, middle=[], previous_summary=None)
        keep = cfg.keep_recent
        if limit and (plan.cut is None or not self._fits(messages, plan.cut, limit, extra)):
            # The launching message verbatim beside fewer of the latest messages first, then
            # (below) fewer without it: a compaction that reused a summary gave the task up
            # beside four where it fitted beside two, and took it back the next time.
            while keep > 1:
                keep //= 2
                smaller = shrunk(keep, anchor=True)
                if smaller.cut is not None and self._fits(messages, smaller.cut, limit, extra):
                    plan = smaller
                    break
            keep = cfg.keep_recent
        anchored: compaction.Plan | None = None  # the last that kept it and fits the window
        # (kept: a plan asked to keep it does not where the messages after it are over
        # ``max_anchor_chars``; the launching message summarized was taken for kept)
        launching = compaction.launching_message(messages, SYNTHETIC_PREFIXES)
        while (
            limit
            and keep > 1
            and (plan.cut is None or not self._fits(messages, plan.cut, limit, extra))
        ):
            keep //= 2
            for anchor in (True, False):
                smaller = shrunk(keep, anchor)
                if smaller.cut is not None:
                    plan = smaller
                    if self._fits(messages, smaller.cut, limit, extra):
                        break
                    if (
                        anchor
                        and launching is not None
                        and not smaller.cut.start <= launching < smaller.cut.end
                        and self._fits(messages, smaller.cut, window, extra)
                    ):
                        anchored = smaller
        if (
            limit
            and cfg.keep_recent == 1  # (the loops above halve from two: none ran)
            and (plan.cut is None or not self._fits(messages, plan.cut, limit, extra))
        ):
            # Only the launching message kept beside the latest one, and no smaller plan: the
            # launching message goes too, as it would beside fewer of the latest (a summary
            # reused up to a launching message it kept made no new one: the history grew past
            # the window, refused on every turn).
            smaller = shrunk(1, anchor=False)
            if smaller.cut is not None:
                plan = smaller
        retry_extra = 0
        if force:  # (the summary as it will be asked for, to the token: a prose text, counted
            # at the estimate's rate where the history's overcount shrank the window)
            summary = self._asked(ex, summary_window)[2] // compaction.BYTES_PER_TOKEN + 100
            retry_extra = int(summary / max(overcount, 1.0)) + tools_tokens
        if (
            anchored is not None
            and anchored.cut is not None
            and plan.cut is not None
            and not self._fits(messages, plan.cut, limit, extra)
            and self._kept(messages, anchored.cut) - self._kept(messages, plan.cut)
            <= window * ANCHOR_SHARE
            and (not force or self._fits(messages, anchored.cut, window, retry_extra))
        ):
            # Nothing came under the aim (the latest round alone is over it): a short launching
            # message stays verbatim where the history still fits the window with it (a long
            # one is estimated no better than the rest: the provider may count it over); after
            # a refusal, where it fits with the summary's room as it will be asked for (on the
            # provider's count of the refused history: the retry's one-line task was summarized
            # where the compaction on the trigger kept it).
            plan = anchored
        if force:
            extra = retry_extra
            plan = dataclasses.replace(plan, overrun=1.0)
        room, kept_extra = window, extra if force else tools_tokens
        if (
            plan.cut is not None
            and overcount > KEPT_OVERCOUNT
            and not self._fits(messages, plan.cut, room, kept_extra)
            and (
                not ex.compacted  # (a compaction's count is of the kept messages)
                if force
                else last is not None
                and last.prompt + completion + appended_estimate > summary_window
            )
        ):
            # The provider's count that shrank the window was of a history holding what the
            # compaction summarizes, and the request as it is goes over the window (a history
            # that fits goes as it is, not compacted on each turn for a dense output in its
            # latest round): the kept messages are judged at ``KEPT_OVERCOUNT``, the provider's
            # refusal of the compaction to say otherwise (a CSV of digits read first made the
            # history count 3.6 times the estimate, and the code kept 1.4 times: the refusal
            # was relayed on every try, where the compaction fitted with room to spare).
            room = int(summary_window / KEPT_OVERCOUNT)
            kept_extra = int(summary / KEPT_OVERCOUNT) + tools_tokens if force else tools_tokens
            log.info(
                "session %s: the provider counts this history at %.1f times cachegate's "
                "estimate; its latest messages are taken at %.1f",
                state.id,
                overcount,
                KEPT_OVERCOUNT,
            )
        if plan.cut is not None and not self._fits(messages, plan.cut, room, kept_extra):
            # What the smallest compaction keeps is over the window by itself (one message too
            # long for it): no summary makes it fit, so none is paid for; the request goes as it
            # would without a new one (after a refusal, the refusal is the client's answer; and
            # there with the summary's room as asked for: a summary was paid for and the retry
            # refused again).
            log.info(
                "session %s: the latest messages alone are over the %d-token window; "
                "nothing to compact",
                state.id,
                room,
            )
            plan = dataclasses.replace(plan, cut=None, middle=[], previous_summary=None)
        if plan.cut is not None and not force:
            # At the edge (an agent asking half the window for its answer, its latest round near
            # the rest of it), a summary as long as asked for left the compacted history over
            # the prompt's share of the window by the provider's count: refused, and the retry
            # cut the summary, a refused request on every turn. The summary is planned on the
            # room the kept messages leave, on the provider's count of the previous request (the
            # retry's, after a refusal), and asked for and cut at that length, as a retry's is.
            scale = max(1.0, overcount)
            if last is not None:
                scale = _provider_overcount(plan.messages, len(messages) - last.messages, last)
            # (no more than the kept messages are taken to count: a dense output the compaction
            # summarizes, a CSV of digits, made the history count 3.7 times the estimate, and
            # the summary was asked short and cut with half the window free)
            scale = min(scale, KEPT_OVERCOUNT)
            left = summary_window / scale - self._kept(messages, plan.cut) - tools_tokens
            # (less its header, and a margin: a summary may count more tokens a byte than the
            # rest, numbers and punctuation, as a retry's cut allows)
            chars = int((left - 100) / 1.25 * compaction.BYTES_PER_TOKEN)
            if 200 <= chars < self._asked(ex, summary_window)[2] * plan.overrun:
                plan = dataclasses.replace(plan, overrun=1.0, room=chars)
        # (``plan`` never discards ``existing``: ``_existing`` gives only one that covers this
        # history; one a rewind left is evicted in its turn.)
        if plan.cut is None:
            if plan.reused is None:
                return body
            if force and ex.compaction_digest == plan.reused.prefix_digest:
                # The refused request had this very one, and nothing after it can be compacted
                # (its latest round alone near the room): its summary cut by what the refusal's
                # count was over, no summary call paid (it went out whole on every turn, refused
                # each time: an agent asking half the window for its answer). Where the summary
                # cannot give that much, nothing new is sent (the caller relays the refusal),
                # so no second reuse is counted or logged.
                cut = self._cut_summary(plan.reused, summary_window, counted)
                if cut is None:
                    return {**body, "messages": plan.messages}
                forwarded = compaction.apply_compaction(messages, cut, digest=known)
                if forwarded is None:  # (cannot happen: the history it was made on)
                    return {**body, "messages": plan.messages}
                self._hold(held, cut, messages)
                self._made_for(ex, cut, "cut")
                return {**body, "messages": forwarded}
            self._hold(held, plan.reused, messages)
            if not self._claim(state, ex, plan.reused):  # (else made for a try the client left)
                self._reused_by(ex, plan.reused, carried=plan.reused is carried)
            return {**body, "messages": plan.messages}
        if existing is None and await self._restore(state):
            # A summary is to be made for a history too short for the try above (the latest
            # messages so large that fewer of them were kept): one made before may cover it.
            return await self._compact(
                ex, state, body, messages, force, stated, overcount, reserved, counted
            )
        pending: dict[str, _Summary] | None = state.extra.get("summaries")
        running = self._running_for(pending, messages) if pending else None
        if running is not None:
            # Another request of the history began its summary while this one waited (for the
            # session's log, the session's first long history in this process): it waits for
            # that one too, rather than pay for a second summary of the same prefix.
            return await self._after(
                ex, state, body, messages, force, stated, overcount, reserved, running, counted
            )
        # (made on ``existing``: its summary, if no request was sent with it, is billed with
        # this one's: ``_Summary.rolled``)
        comp, first = await self._made(
            ex, state, messages, plan, summary_window, overcount, existing
        )
        restored: set[str] | None = state.extra.get("restored")
        if restored and existing is not None:
            restored.discard(_key(existing))  # (rolled into a new one: never used as restored)
        forwarded = compaction.apply_compaction(messages, comp, digest=comp.prefix_digest)
        if forwarded is None:  # cannot happen for the history it was built from; stay safe
            return body
        self._hold(held, comp, messages)
        if first:
            self._made_for(ex, comp)
        else:  # another request of the same history was sent with it first
            self._reused_by(ex, comp)
        return {**body, "messages": forwarded}

    def _reused_by(
        self, ex: Exchange, comp: compaction.Compaction, *, carried: bool = False
    ) -> None:
        """``ex`` goes out with ``comp``, made before; ``carried``: carried to a history that
        changed messages it covers in place (``_pruned``), logged with its summary (a
        cachegate that forgets the session takes it up by its new digest)."""
        ex.compacted = True
        ex.compaction_digest = comp.prefix_digest
        unserved: set[str] | None = (
            ex.session.extra.get(compaction.UNSERVED) if ex.session else None
        )
        if unserved and comp.prefix_digest in unserved:
            # The request made with it got no answer (a 500, a 429: the SDK's retry comes
            # now): the provider has cached none of it yet, and this one's miss is expected as
            # that one's was (it was counted as a rewrite of a message that had not changed)
            ex.compaction_made = True
        ex.transforms["compacted"] = {"reused": True, "covered": comp.covered}
        restored: set[str] | None = ex.session.extra.get("restored") if ex.session else None
        if restored and _key(comp) in restored:
            restored.discard(_key(comp))  # (said on its first use)
            ex.transforms["compacted"]["restored"] = True
            log.info(
                "session %s: reusing a compaction of %d messages made before (from its log)",
                ex.session_id,
                comp.covered - comp.start,
            )
        notify(self.observers, "on_compaction", ex, comp, "carried" if carried else "reused")

    async def _restore(self, state: SessionState) -> bool:
        """Take up the compactions ``state``'s log records (``eventlog.logged_compactions``),
        once per session held: True when one was added to those ``_existing`` tries. Each is
        still checked against the history by its digests before it is used. The log is read in
        a thread; the session's other requests that come meanwhile (sub-agents, a retry) wait
        for that read rather than each pay for a new summary."""
        if self.log_dir is None:
            return False
        pending: asyncio.Future[bool] | None = state.extra.get("restoring")
        if pending is None:
            pending = asyncio.ensure_future(self._read_log(state, self.log_dir))
            state.extra["restoring"] = pending
        elif pending.done():
            return False  # read for an earlier request: what it found is held already
        # (shielded: a client leaving does not cancel the read the others wait for)
        return await asyncio.shield(pending)

    async def _read_log(self, state: SessionState, log_dir: str) -> bool:
        restored: set[str] = set()
        state.extra["restored"] = restored
        try:
            path = session_log_path(log_dir, state.id)
            if self.flush_log is not None:
                await asyncio.to_thread(self.flush_log, state.id, _FLUSH_WAIT_S)
            logged = await asyncio.to_thread(logged_compactions, path, MAX_COMPACTIONS)
        except (OSError, ValueError, NotALogFile):  # (no log yet: a new session)
            return False
        except Exception:  # (a defect: compaction goes on as if the log had none)
            log.exception("session %s: its log's compactions could not be read", state.id)
            return False
        held: dict[str, list[Any]] = state.extra.setdefault("compactions", {})
        taken: dict[str, list[Any]] = {}
        for event in logged:
            comp = compaction.Compaction(
                prefix_digest=event["prefix_digest"],
                covered=event["covered"],
                start=event["start"],
                message={"role": "user", "content": event["summary"]},
                # (a carried one's: the summary's own, as it was made)
                source="extractive"
                if "extractive" in (event["source"], event.get("made"))
                else "model",
                tokens_before=event["tokens_before"],
                tokens_after=event["tokens_after"],
                opening=event["opening"],
            )
            key = _key(comp)
            if key not in held and 0 <= comp.start < comp.covered:
                taken.pop(key, None)
                taken[key] = [comp, None]
                restored.add(key)
        # before those used in this process, as less recently used: the first to go past
        # MAX_COMPACTIONS
        merged = {**taken, **held}
        held.clear()
        held.update(merged)
        while len(held) > MAX_COMPACTIONS:
            oldest = next(iter(held))
            restored.discard(oldest)
            del held[oldest]
        return bool(restored)

    def _made_for(
        self, ex: Exchange, comp: compaction.Compaction, source: str | None = None
    ) -> None:
        """``ex`` goes out with ``comp``, made for it (or for a try of it the client left);
        ``source``: how it was made where that is not ``comp.source`` (``cut``: a summary made
        before, cut for a retry, with no summary call)."""
        source = source or comp.source
        ex.compacted = ex.compaction_made = True  # (its miss is expected: not waste)
        ex.compaction_digest = comp.prefix_digest
        if ex.session is not None:  # (until an answer of the provider's to it: ``_reused_by``)
            unserved: set[str] = ex.session.extra.setdefault(compaction.UNSERVED, set())
            if len(unserved) >= MAX_COMPACTIONS:
                unserved.clear()
            unserved.add(comp.prefix_digest)
        ex.transforms["compacted"] = {
            "start": comp.start,
            "covered": comp.covered,
            "source": source,
            "tokens_before": comp.tokens_before,
            "tokens_after": comp.tokens_after,
        }
        notify(self.observers, "on_compaction", ex, comp, source)

    async def _made(
        self,
        ex: Exchange,
        state: SessionState,
        messages: list[Any],
        plan: compaction.Plan,
        window: int,
        overcount: float,
        existing: compaction.Compaction | None = None,
    ) -> tuple[compaction.Compaction, bool]:
        """The compaction ``plan`` cuts (on ``existing``, if any), summarized once however often
        the client asks, and whether ``ex`` is the first request sent with it (which records it
        and its bill).

        The summary is written in a task of its own: a client that hangs up while it is being
        written (its timeout shorter than the summary call) does not cancel it. It is finished,
        held for the session, and its retry or the agent's next turn (``_apply`` waits for a
        summary of a prefix of its history) goes out with it, rather than pay for another that
        its timeout would cut short in turn, which failed every turn."""
        assert plan.cut is not None
        cut = plan.cut
        digest = compaction.prefix_digest(messages, cut.end)
        lead = compaction.leading_count(messages)
        key = _summary_key(cut.start - lead, cut.end - lead, digest)
        pending: dict[str, _Summary] = state.extra.setdefault("summaries", {})
        entry = pending.pop(key, None)
        if entry is None or entry.failed:
            task = asyncio.ensure_future(
                self._summarized(ex, state, messages, plan, window, overcount, digest)
            )
            entry = _Summary(task, cut.start, cut.end, digest, ex, lead=lead)
            if existing is not None:
                entry.rolled = self._unsent(pending, existing)
            self._tasks.add(task)
            state.busy += 1  # (not forgotten for memory or count until it is done)
            task.add_done_callback(functools.partial(self._done, entry, state))
        pending[key] = entry  # (the latest last: the oldest go first)
        while len(pending) > MAX_COMPACTIONS:  # (one still being written is billed when done)
            del pending[next(iter(pending))]
        comp, model, answer = await self._wait(ex, state, entry)
        comp = _at_lead(comp, lead)  # (one made of this history with another count of them)
        if entry.claimed:
            return comp, False
        self._bill(ex, state, entry, model, answer)
        return comp, True

    async def _wait(
        self, ex: Exchange, state: SessionState, entry: _Summary
    ) -> tuple[compaction.Compaction, str, Any]:
        """The summary of ``entry``, waited for by ``ex`` (whose client may leave meanwhile: the
        summary goes on)."""
        entry.waiting += 1
        waited = time.perf_counter()
        try:
            comp, model, answer, _ = await asyncio.shield(entry.task)
        except asyncio.CancelledError:
            entry.waiting -= 1
            if not entry.task.done() and self.stopping:
                # (cut by the shutdown, or its client left in the grace period: either way the
                # summary is cancelled with the summaries still being written, as cachegate stops)
                log.warning(
                    "session %s: cachegate stopped while its history was being summarized; the "
                    "summary is not kept, and the conversation's next turn asks for another",
                    state.id,
                )
            elif not entry.task.done():
                log.warning(
                    "session %s: the client left while its history was being summarized; the "
                    "summary goes on, kept for a retry or the next turn (is the client's timeout "
                    "shorter than compaction.summary_timeout_s?)",
                    state.id,
                )
            elif not entry.waiting:
                self._meter(entry)  # (it left as the summary was done: its bill is counted)
            raise
        except BaseException:
            entry.waiting -= 1
            raise
        finally:
            # the provider's time (at most the summary call's, when it is done), not
            # cachegate's overhead
            spent = time.perf_counter() - waited
            ex.upstream_wait_s += min(spent, entry.upstream_s) if entry.task.done() else spent
        entry.waiting -= 1
        return comp, model, answer

    @staticmethod
    def _running_for(pending: dict[str, _Summary], messages: list[Any]) -> _Summary | None:
        """A summary being written of a prefix of ``messages``, if any (by the places past the
        leading system/developer messages: a history with another count of them waits too)."""
        lead = compaction.leading_count(messages)
        for entry in reversed(pending.values()):
            end = entry.end - entry.lead + lead
            if (
                not entry.task.done()
                and len(messages) >= end
                and compaction.prefix_digest(messages, end) == entry.digest
            ):
                return entry
        return None

    def _bill(
        self, ex: Exchange, state: SessionState, entry: _Summary, model: str, answer: Any
    ) -> None:
        """``ex`` is the first request sent with ``entry``'s summary: it carries its bill (in
        its log line's cost; in the metrics too unless they counted it when it was done)."""
        entry.claimed = True
        entry.origin = None
        pending: dict[str, _Summary] = state.extra.get("summaries", {})
        key = entry.key
        if pending.get(key) is entry:
            del pending[key]
        self._count_summary(ex, model, answer, entry.metered)
        rolled, entry.rolled = entry.rolled, None
        if rolled is not None and not rolled.claimed and not rolled.failed and rolled.task.done():
            _, model, answer, _ = rolled.task.result()
            self._bill(ex, state, rolled, model, answer)  # (no request was sent with it)

    def _done(self, entry: _Summary, state: SessionState, task: asyncio.Future[Any]) -> None:
        """A summary's task is done: its session counts as just seen (its client's retry is on
        its way: the session is not the first forgotten for memory meanwhile); a failure is
        logged (not left to asyncio's "exception was never retrieved"); a summary no request
        is waiting for has its bill counted in the metrics now (the request that goes out with
        it later records it in the log)."""
        self._tasks.discard(task)
        state.busy -= 1
        if self.sessions is not None:
            self.sessions.touch(state)
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("writing a summary failed", exc_info=task.exception())
            return
        if not entry.waiting:
            self._meter(entry)

    def _meter(self, entry: _Summary) -> None:
        """Count the bill of a summary no request is waiting for in the metrics, under its
        model (``on_summary_usage``): its client left, and no request may ever go out with it."""
        origin = entry.origin
        if entry.metered or entry.claimed or entry.failed or origin is None:
            return
        entry.metered = True
        entry.origin = None
        _, model, answer, _ = entry.task.result()
        usage = normalize_usage(answer.get("usage")) if isinstance(answer, dict) else None
        if usage is not None:
            notify(self.observers, "on_summary_usage", origin, model, usage)

    async def _summarized(
        self,
        ex: Exchange,
        state: SessionState,
        messages: list[Any],
        plan: compaction.Plan,
        window: int,
        overcount: float,
        digest: str,
    ) -> tuple[compaction.Compaction, str, Any, float]:
        """The summary and the compaction built from it, held for the session (whether or not
        anyone waits for it now), with what billing and overhead need."""
        assert plan.cut is not None
        text, source, model, answer, upstream_s = await self._summarize(ex, plan, window, overcount)
        comp = compaction.build_compaction(
            messages,
            plan.cut,
            text,
            source=source,
            tokens_before=compaction.estimate_tokens(messages),
            digest=digest,
        )
        self._hold(state.extra.setdefault("compactions", {}), comp, messages)
        return comp, model, answer, upstream_s

    def _claim(self, state: SessionState, ex: Exchange, comp: compaction.Compaction) -> bool:
        """Whether ``comp``, reused by ``ex``, was made for a request whose client left before it
        was sent: ``ex`` is then the first sent with it, and records its making and its bill."""
        pending: dict[str, _Summary] | None = state.extra.get("summaries")
        if not pending:
            return False
        entry = pending.get(_comp_summary_key(comp))
        if entry is None or not entry.task.done() or entry.task.cancelled() or entry.claimed:
            return False
        made, model, answer, _ = entry.task.result()
        if made.message is not comp.message:  # (``comp`` may be it moved: ``_at_lead``)
            return False
        self._bill(ex, state, entry, model, answer)
        self._made_for(ex, comp)
        return True

    @staticmethod
    def _unsent(pending: dict[str, _Summary], comp: compaction.Compaction) -> _Summary | None:
        """The summary ``comp`` was made from, if it was made for a request whose client left
        and no request has been sent with it yet."""
        entry = pending.get(_comp_summary_key(comp))
        if entry is None or not entry.task.done() or entry.failed or entry.claimed:
            return None
        # (``comp`` may be it moved: ``_at_lead``)
        return entry if entry.task.result()[0].message is comp.message else None

    async def stop(self) -> None:
        """Cancel the summaries still being written (cachegate is stopping)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _undone(held: dict[str, list[Any]], messages: list[Any]) -> tuple[int, Any, Any] | None:
        """Where this history, of the conversation of the compaction used last, changed a
        message that compaction covers: its index, the message before and after. None for
        another conversation (another first message) and for a history that only stops
        early (a rewind)."""
        for comp, verified in held.values():
            if verified is None:
                continue
            lead = compaction.leading_count(messages)
            if (
                compaction.leading_count(verified) != lead
                or len(messages) <= lead
                or len(verified) <= lead
                or not compaction.same_message(messages[lead], verified[lead])
            ):
                return None
            for index in range(lead + 1, min(len(messages), comp.covered)):
                if not compaction.same_message(messages[index], verified[index]):
                    return index, verified[index], messages[index]
            return None
        return None

    @staticmethod
    def _pruned(
        held: dict[str, list[Any]], messages: list[Any], beyond: int
    ) -> compaction.Compaction | None:
        """The compaction used last, if it covers more than ``beyond`` messages (what one
        found by its digest covers), carried to this history, where the client cut tool
        outputs it covers in place and changed nothing else of them: the same messages, the
        model's own the very same, tool results of the same calls, one or more shorter than
        they were (opencode clears old tool outputs, other agents trim them: none of that
        reaches the provider, for which the summary stands). Held under this history's digest
        in place of the old one's. None where the history does not go on as that one did (a
        rewind, a fork, another conversation, sub-agents fanned out with one task whose
        outputs differ, a message put in or taken out or otherwise changed)."""
        for key, (comp, verified) in list(held.items()):
            if verified is None:
                continue
            if comp.covered <= beyond:
                return None
            lead = compaction.leading_count(messages)
            if (
                compaction.leading_count(verified) != lead
                or len(verified) != comp.covered
                or comp.covered >= len(messages)  # (apply_compaction's: one message past it)
                or comp.covered <= lead
                or not compaction.same_message(messages[lead], verified[lead])
            ):
                return None
            changed = False
            for index in range(lead + 1, comp.covered):
                new, old = messages[index], verified[index]
                if compaction.same_message(new, old):
                    continue
                if not _cut_output(new, old):
                    return None
                changed = True
            if not changed:
                return None
            digest = compaction.prefix_digest(messages, comp.covered)
            del held[key]
            carried = dataclasses.replace(comp, prefix_digest=digest)
            held[_key(carried)] = [carried, None]
            return carried
        return None

    @staticmethod
    def _existing(
        held: dict[str, list[Any]], messages: list[Any]
    ) -> tuple[compaction.Compaction | None, str | None]:
        """The session's compaction of this history's conversation, and its prefix digest.

        Each conversation of a session (a main agent's, its sub-agents', fanned out with one
        task or not) has its own. The one used last keeps the message objects it was checked
        against: an agent's next turn resends them (``resolve_session`` shares them), so its
        covered prefix, the bulk of a long history, is not serialized and hashed again. Else
        the compactions made from a history that opened as this one are tried, latest first,
        by their covered prefix. None when none covers it: another conversation that opens
        alike, or this one rewound or forked before what its compaction covers, goes on without
        one (and the summary of a future the user undid never reaches the provider)."""
        if not held:
            return None, None
        known: tuple[int, str] | None = None  # a prefix of ``messages`` whose digest is known
        best: tuple[compaction.Compaction, str] | None = None
        opening: str | None = None
        lead = compaction.leading_count(messages)  # (its digests begin past them: the system
        for comp, verified in held.values():  # prompt may change from turn to turn)
            if (
                verified is not None
                and len(messages) > len(verified)  # (apply_compaction's: one message past it)
                and compaction.leading_count(verified) == lead
                and all(map(operator.is_, verified[lead:], messages[lead:]))
            ):
                known, opening = (comp.covered, comp.prefix_digest), comp.opening
                best = (comp, comp.prefix_digest)
        if opening is None:
            opening = compaction.opening_digest(messages)
        # Of those that cover a prefix of this history, the one that covers the most (after a
        # rewind and a return to the branch undone, not the one the rewind used). Tried from
        # the least covered on, each digest resumed from the one before: sub-agents fanned out
        # with one task, taking turns, each had the history hashed again from its start per
        # compaction tried (25 ms a request with 32 of 272 KB histories; now one pass). One
        # made where the history had more or fewer leading system/developer messages (an
        # environment message added after the system prompt) is moved by as many places: its
        # digests begin past them (a new summary was paid for, the cache lost).
        opened = opening.partition(":")[2]
        tried = sorted(
            (
                comp
                for comp in (
                    _at_lead(comp, lead)
                    for comp, _ in held.values()
                    if comp.opening.partition(":")[2] == opened
                )
                if comp.covered < len(messages) and (best is None or comp.covered > best[0].covered)
            ),
            key=lambda comp: comp.covered,
        )
        for comp in tried:  # (all cover more than ``known``: ``best`` is set with it)
            if known is None or known[0] != comp.covered:
                known = (
                    comp.covered,
                    compaction.prefix_digest(messages, comp.covered, known=known),
                )
            if known[1] == comp.prefix_digest:
                best = (comp, known[1])
        return best if best is not None else (None, None)

    @staticmethod
    def _hold(held: dict[str, list[Any]], comp: compaction.Compaction, messages: list[Any]) -> None:
        """Keep ``comp`` as the session's most recently used compaction (the least recently used
        goes past ``MAX_COMPACTIONS``), with the message objects it was checked against; the
        others let go of theirs (one covered prefix held, as with one compaction)."""
        key = _key(comp)
        held.pop(key, None)
        for entry in held.values():
            entry[1] = None
        held[key] = [comp, tuple(messages[: comp.covered])]
        while len(held) > MAX_COMPACTIONS:
            del held[next(iter(held))]

    @staticmethod
    def _cut_summary(
        comp: compaction.Compaction, room: int, counted: int | None
    ) -> compaction.Compaction | None:
        """``comp``, with which the refused request went out, its summary cut by as much as the
        refusal's count of that request (``counted``) was over ``room`` (the prompt's share of
        the window), and a margin (prose may count a token in more than 4 bytes). None where
        the refusal says no count (an older llama.cpp's: a cut by the margin alone was refused
        again, and the next attempt cut the summary again), or less than 200 bytes of it would
        be left."""
        if counted is None:
            return None
        over = max(0, counted - room)
        text = compaction.summary_text(comp.message)
        budget = _json_size(text) - int((over * 1.25 + 32) * compaction.BYTES_PER_TOKEN)
        if budget < 200:
            return None
        shorter = _within_bytes(text, compaction.clip_summary(text, budget), budget)
        source: compaction.Source = "extractive" if comp.source == "extractive" else "model"
        message = compaction.summary_message(
            shorter, covered=comp.covered - comp.start, source=source
        )
        saved = compaction.estimate_tokens([comp.message]) - compaction.estimate_tokens([message])
        return dataclasses.replace(comp, message=message, tokens_after=comp.tokens_after - saved)

    @staticmethod
    def _kept(messages: list[Any], cut: compaction.Cut) -> int:
        """The estimated tokens of the messages a compaction at ``cut`` keeps."""
        return compaction.estimate_tokens([*messages[: cut.start], *messages[cut.end :]])

    @classmethod
    def _fits(cls, messages: list[Any], cut: compaction.Cut, limit: float, extra: int) -> bool:
        """Whether the history compacted at ``cut`` comes under ``limit`` tokens: the kept
        messages and ``extra`` (the summary's allowance, the tools)."""
        return cls._kept(messages, cut) + extra < limit

    @staticmethod
    def _count_summary(ex: Exchange, model: str, answer: Any, metered: bool = False) -> None:
        """The summary call's usage, as its answer reports it, on the exchange: the provider
        bills it, so it is priced with the exchange (``AccountingObserver``); ``metered``: the
        metrics counted it already (``_meter``), so only the exchange's log line carries it."""
        usage = normalize_usage(answer.get("usage")) if isinstance(answer, dict) else None
        if usage is None:
            return
        same = ex.summary_model == model  # (a retry's compaction after the first one's)
        ex.summary_usage = added(ex.summary_usage if same else None, usage)
        ex.summary_calls = [*(ex.summary_calls if same else ()), (usage, metered)]
        if metered:
            ex.summary_metered = added(ex.summary_metered if same else None, usage)
        elif not same:
            ex.summary_metered = None
        ex.summary_model = model

    def _asked(self, ex: Exchange, window: int) -> tuple[str, int, int]:
        """The summarizer model, its window and the summary's length asked for (characters)
        for a compaction of ``ex`` planned on ``window``: the request must fit the summarizer's
        window (half of it for what goes in: the previous summary, the instructions, the
        transcript, whose tool outputs share it), and the summary asked for no longer than the
        compacted model's window allows."""
        model = self.settings.compaction.summarizer_model or ex.model or ""
        writer = self._model(model).context_window if model != ex.model else window
        return (
            model,
            writer,
            min(compaction.summary_chars(window), compaction.summary_chars(writer)),
        )

    async def _summarize(
        self, ex: Exchange, plan: compaction.Plan, window: int, overcount: float = 1.0
    ) -> tuple[str, compaction.Source, str, Any, float]:
        """The summary's text and source, the model that wrote it, its answer (for the bill:
        ``_count_summary``) and the seconds the call took, or the extractive summary when the
        call failed."""
        model, writer, chars = self._asked(ex, window)
        if plan.room:  # (the room beside the kept messages: less than asked for)
            chars = min(chars, plan.room)
        tools = sum(1 for m in plan.middle if isinstance(m, dict) and m.get("role") == "tool")

        def build(writer: int, overcount: float) -> dict[str, Any]:
            # (the transcript is the history's text: as dense as the provider found it)
            budget = int(min(window, writer) * compaction.BYTES_PER_TOKEN // 2 / overcount)
            previous = plan.previous_summary
            if previous is not None and len(previous) > budget // 2:
                previous = previous[: budget // 2 - 1] + "…"
            fixed = len(compaction.SUMMARIZER_SYSTEM_PROMPT) + len(previous or "") + 600
            return compaction.build_summary_request(
                plan.middle,
                previous_summary=previous,
                model=model,
                max_tool_chars=max(200, min(2000, budget // max(1, tools))),
                max_chars=max(1000, budget - fixed),
                words=chars // 6,
            )

        request = build(writer, overcount)
        # the client's headers (its key, organization, project), but not what it said of its
        # own request: a body of another type, a stream accepted, its idempotency key (a gateway
        # that honours one would answer the client's request with the summary, or refuse it)
        headers = [(k, v) for k, v in ex.upstream_headers if k not in _OWN_REQUEST_HEADERS]
        headers += ((b"content-type", b"application/json"), (b"accept", b"application/json"))
        stage = "connect"  # what a failure was, for cachegate_upstream_errors_total
        billed: Any = None  # the answer whose usage the provider bills
        started = time.perf_counter()
        upstream_s = 0.0
        try:
            async with asyncio.timeout(self.settings.compaction.summary_timeout_s):
                url = self.relay.url("chat/completions", ex.query)  # keeps e.g. ?api-version=
                for again in (False, True):
                    stage = "connect"
                    try:
                        content = orjson.dumps(request)
                        response = await self.relay.open("POST", url, headers, content)
                        stage = "midstream"
                        try:
                            # (compressed by an upstream that compresses whatever it is asked:
                            # decoded, as the relay decodes an answer for the log)
                            body = decoded_answer(response, await response.aread())
                        finally:
                            await response.aclose()
                    finally:
                        upstream_s = time.perf_counter() - started
                    status = response.status_code
                    if again or not compaction.is_context_length_error(status, body):
                        break
                    # Refused as too long itself (dense text: a CSV, minified code, counts 2-3
                    # times the 4 bytes a token planned): once more, as small as its refusal
                    # says it must be, within the same timeout.
                    counted = compaction.provider_prompt_tokens(body)
                    planned = compaction.estimate_tokens(request["messages"])
                    factor = counted / planned if counted and planned else 2.0
                    stated = compaction.provider_window(body)
                    writer = min(writer, stated) if stated else writer
                    log.info(
                        "summarizer answered %s: its request was too long (%s); sending it"
                        " again smaller",
                        status,
                        f"{counted} tokens, {planned} planned" if counted else "no count said",
                    )
                    notify(self.observers, "on_summary_error", ex, "status")
                    # (the refusal's count against the plain estimate is the text's density
                    # itself: not on top of what the first plan already took)
                    overcount = max(overcount * 1.25, factor * 1.1)
                    request = build(writer, overcount)
            stage = "status" if response.status_code >= 400 else "invalid"
            if response.status_code == 200:
                answer = read_answer(body)  # (a lone surrogate escape too)
                error = answer.get("error") if isinstance(answer, dict) else None
                if error is not None and not answer.get("choices"):
                    # a failure reported inside a 200, as an exchange's error_event is counted
                    stage = "error_event"
                    # (said on stderr: a provider's "Incorrect API key provided: …" names the
                    # key it was sent, taken out before the text is cut, which could split it)
                    said = without_values(error_message(answer), exchange_keys(ex))
                    said = clip_words(redact_text(said), 300)
                    raise ValueError(f"the provider reported: {said}")
                billed = answer
                choices = answer.get("choices") if isinstance(answer, dict) else None
                message = (
                    choices[0].get("message")
                    if isinstance(choices, list) and choices and isinstance(choices[0], dict)
                    else None
                )
                if not isinstance(message, dict):
                    raise NotAChatCompletion(
                        "answered 200 with a body that is no chat completion (no"
                        f" choices[0].message: {_shape(answer)})"
                    )
                # (a list of parts too, as Mistral's reasoning models answer: its text parts)
                text = compaction.message_text(message)
                if text.strip():
                    limit = int(chars * plan.overrun)
                    summary = compaction.clip_summary(text.strip(), limit)
                    # ... in the bytes the plan kept room in, too: one in Chinese, three bytes
                    # a character, took three times that, the history was still at the
                    # trigger, and every later turn paid a summary call of its own
                    summary = _within_bytes(
                        text.strip(), summary, chars if plan.overrun <= 1.0 else limit
                    )
                    return summary, "model", model, answer, upstream_s
            log.warning(
                "summarizer answered %s%s; using the extractive summary",
                response.status_code,
                " without text" if response.status_code == 200 else "",
            )
            if response.status_code >= 400:
                notify(self.observers, "on_summary_error", ex, "status")
        except Exception as exc:
            log.warning(
                "summarizer failed after %.1fs (%s%s); using the extractive summary",
                time.perf_counter() - started,
                type(exc).__name__,
                f": {exc}" if stage == "error_event" or isinstance(exc, NotAChatCompletion) else "",
            )
            if isinstance(exc, httpx.PoolTimeout):
                stage = ""  # cachegate's own pool, full: no upstream error
            elif isinstance(exc, TimeoutError):
                stage = "timeout"
            elif stage == "connect" and isinstance(exc, httpx.HTTPError):
                stage = open_error_kind(exc)  # as an exchange's is counted
            if stage:
                notify(self.observers, "on_summary_error", ex, stage)
        return (
            _extractive(plan, chars, exact=plan.overrun <= 1.0),
            "extractive",
            model,
            billed,  # (a 200 without text is billed all the same)
            upstream_s,
        )
