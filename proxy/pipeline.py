"""The seams: one ``Exchange`` value that flows from request to response, and the observers.

Request transforms (pairing repair, compaction, usage request) change the forwarded body and note what
they did on the exchange; observers (accounting, event log, metrics) receive the exchange when it is
forwarded and when it is finished. An observer cannot break the relay: its exceptions are logged and
swallowed (mitmproxy's ``safecall``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import orjson

from proxy.assemble import AssembledResponse
from proxy.sessions import SessionState
from proxy.sse import SSEDecoder
from proxy.usage import Usage

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Exchange:
    """One request through cachegate and what came back."""

    route: str  # "chat" for the full pipeline, else "passthrough" ("responses": a refusal of
    # a Responses API request before its work began, for the metrics' label)
    method: str
    path: str  # the upstream path after /v1, e.g. "chat/completions"
    started_at: float  # wall clock, seconds
    t0: float  # perf_counter when the request arrived
    user_agent: str = ""
    query: bytes = b""  # the client's query string (e.g. Azure's api-version), forwarded as is
    session_id: str | None = None
    # The session's state, for the observers: an exchange in flight keeps it even when the store
    # forgets the session meanwhile (its memory budget), so its accounting and log lines complete.
    session: SessionState | None = field(default=None, repr=False)
    exchange_id: int = 0
    model: str | None = None
    model_label: str = "other"
    stream: bool = False
    request_bytes: int = 0
    # Which try of the client's this is (the openai SDKs' ``x-stainless-retry-count``: 1 for
    # their first retry of a request that failed or timed out; 0 when not said).
    client_retry: int = 0
    client_body: dict[str, Any] | None = None
    body: dict[str, Any] | None = None  # as forwarded
    base_exchange: int | None = None
    base: int = 0
    repairs: list[dict[str, Any]] = field(default_factory=list)
    transforms: dict[str, Any] = field(default_factory=dict)
    strict: bool = False  # strict pairing for this request (config or X-Cachegate-Strict)
    # the key cachegate adds is among them: never in a printed Exchange (a log, a traceback)
    upstream_headers: list[tuple[bytes, bytes]] = field(default_factory=list, repr=False)
    # the client's own keys among them (``observers.client_keys``), once the log has looked
    client_secrets: tuple[str, ...] | None = field(default=None, repr=False)
    strip_usage: bool = False
    compacted: bool = False
    # a new compaction (not one reused): the provider's cache misses this request where the
    # summary stands, an expected, paid-for miss that is neither waste nor the agent's rewrite
    compaction_made: bool = False
    # the compaction the forwarded body carries (its prefix digest), new or reused: the
    # provider's count of this request is of a history with that summary in it
    compaction_digest: str | None = None
    # the history compaction was given (the client's, as pairing repaired it): what the
    # provider's count of this request is recorded against, for the next turn's trigger
    compaction_input: list[Any] | None = field(default=None, repr=False)
    # the session's compaction no longer applies because the client changed a message it
    # covered (opencode clears old tool outputs): that message's index, before and after
    compaction_undone: tuple[int, Any, Any] | None = None
    request_noted: bool = False  # the request's observers have run
    # filled in as the response arrives
    status: int = 0
    ttfb_s: float | None = None
    duration_s: float = 0.0
    overhead_s: float = 0.0
    # Time spent waiting on the upstream before the forwarded request went out (a summarizer
    # call, a first attempt refused as too long): not cachegate's overhead
    upstream_wait_s: float = 0.0
    # Time spent waiting for the client's body to arrive (a slow upload): not cachegate's either
    client_wait_s: float = 0.0
    assembled: AssembledResponse | None = None
    usage: Usage | None = None
    # A compaction's summary call (its usage and model), priced with the exchange
    summary_usage: Usage | None = None
    summary_model: str | None = None
    # Of ``summary_usage``, what the metrics counted when its summary was done (no request
    # waited for it: ``Compactor._meter``): this exchange's log line carries it, the metrics
    # count only the rest.
    summary_metered: Usage | None = None
    # Each summary call of ``summary_usage`` and whether the metrics counted it then: the
    # provider bills each on its own prompt (a model's long-context rates: per call)
    summary_calls: list[tuple[Usage, bool]] = field(default_factory=list)
    # ``summary_usage`` priced at ``summary_model``'s prices: ``{actual, uncached}`` in USD
    # (the accounting's, included in ``cost``; the log line gives it apart)
    summary_cost: dict[str, float] | None = None
    interrupted: bool = False
    stopped: bool = False  # interrupted by cachegate's own shutdown, not by the client
    # the provider read none of it: its try was refused as too long, and the client left
    # while it was compacted for a retry that never went (its prefixes' cache life not renewed)
    unread: bool = False
    error: str | None = None
    upstream_error: str | None = None  # connect, timeout, status, midstream, invalid, error_event
    cache: dict[str, Any] | None = None
    # Its cache read known (the accounting's): reported, or left out after the session's answers
    # had the fields, a read of 0 (Gemini's OpenAI endpoint leaves them out of a miss)
    cache_known: bool = False
    cost: dict[str, Any] | None = None
    # Where the forwarded prefix first differs from the session's previous request (accounting
    # notes it for the response's log line; the request's transforms stay as the request had them)
    divergence: dict[str, Any] | None = None
    # the first message of the request the accounting compared this one with, where it
    # differs (a Responses API view's instructions message, read back by ``resview``)
    compared_first: Any = None
    # A Responses API view's system block (its instructions: 1, or 0), which the accounting
    # hashes before the tools (``prefix.fingerprint``); None for a chat request
    system_block: int | None = None
    # The relay keeps the response's bytes (a long stream's are decoded every few KiB, after
    # the write) and leaves the rest of the decoding to ``assemble``, which runs with the
    # observers, after the client has its response.
    recorded: Recorded | None = None

    def assemble(self) -> None:
        """Assemble the recorded response, once: ``assembled``, ``usage`` and an error it
        carries. Never raises (a recorder that fails leaves the response unassembled)."""
        recorded, self.recorded = self.recorded, None
        if recorded is None:
            return
        try:
            assembled = recorded.assemble(self.status)
        except UnreadableAnswer as exc:  # relayed as it came; the log says what was wrong
            if self.error is None and not self.interrupted:  # (cut short by the client: not it)
                self.error = str(exc)
                if exc.invalid and self.upstream_error is None:
                    self.upstream_error = "invalid"  # as a stream's event that is no JSON
            return
        except RefusedAnswer as exc:  # the provider's own words for a status >= 400
            if self.error is None:
                self.error = str(exc)
            return
        except Exception:
            log.exception("assembling the recorded response failed")
            return
        if assembled is None:
            return
        self.assembled = assembled
        self.usage = assembled.usage
        if assembled.error is not None and self.error is None:
            self.error = error_message(assembled.error)
            if self.upstream_error is None:  # a failure the provider reported inside a 200
                self.upstream_error = "error_event"
            return
        if self.error is not None:
            return
        if self.route == "chat" and self.status < 400 and not self.interrupted:
            streamed = recorded.recorder is not None
            if self.stream is True and not streamed:
                self.error = WHOLE_FOR_STREAM
                return
            if not self.stream and streamed and assembled.events:  # (events read: a stream)
                self.error = STREAM_FOR_WHOLE
                return
        # A stream that ended with neither [DONE] nor a finish_reason was cut short where its
        # framing could not tell (chunked encoding ended early, a body framed by the
        # connection's end): the client's SDK ends quietly with half an answer. (A body that is
        # not a stream is ``done`` unless it held an error.)
        early = not assembled.done and assembled.finish_reason is None
        if not self.interrupted and self.status < 400 and (assembled.unfinished or early):
            if self.route != "chat":  # a Responses API stream: no [DONE], a last event
                self.error = (
                    "upstream ended the stream inside an event, before its last event"
                    " (response.completed, response.incomplete or response.failed)"
                    if assembled.unfinished
                    else "upstream ended the stream before its last event (response.completed,"
                    " response.incomplete or response.failed)"
                )
            else:
                self.error = (
                    "upstream ended the stream inside an event, before [DONE]"
                    if assembled.unfinished
                    else "upstream ended the stream before [DONE], with no finish_reason"
                )
            if self.upstream_error is None:
                self.upstream_error = "midstream"  # counted as a cut chunked stream is
        if assembled.malformed:
            # Relayed as they came; the openai SDKs raise on a data line that is not JSON, so
            # the exchange is no clean answer for their clients (the Vercel AI SDK gives an
            # error part and reads on: the message logged is the part before it).
            count = assembled.malformed
            said = (
                f"upstream sent {count} stream event{'s' if count > 1 else ''} whose data was"
                " not a JSON object (the openai SDKs fail on it; the Vercel AI SDK reads on past it)"
            )
            self.error = f"{self.error}; {said}" if self.error else said
            if self.upstream_error is None:
                self.upstream_error = "invalid"


class UnreadableAnswer(ValueError):
    """A successful status with a body that is no JSON (cut short, say): ``Recorded.assemble``
    raises it with what was wrong, for the exchange's ``error``. ``invalid``: the client's SDK
    fails on it too (not so for a coding cachegate cannot undo: its client may)."""

    def __init__(self, message: str, *, invalid: bool = True) -> None:
        super().__init__(message)
        self.invalid = invalid


class RefusedAnswer(Exception):
    """A status of 400 or more: ``Recorded.assemble`` raises it with what the body says (its
    error message, or the start of a body that is no JSON), for the exchange's ``error``."""


# The most of an error body's text an exchange keeps (an HTML error page is cut here).
MAX_ERROR_TEXT = 300


def refusal_text(status: int, body: bytes) -> str:
    """What a body answered with ``status`` (>= 400) says, as one line for the log."""
    try:
        return clip_words(error_message(orjson.loads(body)), MAX_ERROR_TEXT)
    except orjson.JSONDecodeError:
        pass
    data = _first_data(body)
    if data is not None:  # (an error sent as an event stream: its event's JSON, if it is)
        with contextlib.suppress(orjson.JSONDecodeError):
            return clip_words(error_message(orjson.loads(data)), MAX_ERROR_TEXT)
    # (cut as clip_words cuts, never inside a key the page echoes, before its white space
    # goes: a page indented with spaces is short once collapsed, and kept a key's piece)
    start = body[: MAX_ERROR_TEXT * 4 + _MAX_KEY_CHARS].decode("utf-8", "replace")
    text = " ".join(clip_words(start, MAX_ERROR_TEXT * 4).split())
    if not text:
        return f"upstream answered {status} with an empty body"
    return f"upstream answered {status}: {clip_words(text, MAX_ERROR_TEXT)}"


def _first_data(body: bytes) -> str | None:
    """The first event's data of a body that reads as an event stream (a server that streams
    its 429 as an event: ``data: {"error": …}``); None for any other body."""
    head = body[:65536].lstrip()
    if not head.startswith((b"data:", b"event:", b":", b"id:")):
        return None
    decoder = SSEDecoder()
    events = decoder.decode(head) + decoder.flush()
    return events[0].data if events else None


# The characters keys are made of.
_KEY_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.~+/=-")
_MAX_KEY_CHARS = 512  # no key is longer: a longer run cut is no key's piece


def key_run(text: str, at: int) -> tuple[int, int] | None:
    """The run of key characters that a cut of ``text`` at ``at`` would split (one on each
    side of it), as ``(start, end)``, when it is no longer than any key; else None. Linear in
    the run, at most ``_MAX_KEY_CHARS`` steps each way (a regex search for the run ending at
    the cut took seconds behind a long run of base64)."""
    if not 0 < at < len(text) or text[at - 1] not in _KEY_CHARS or text[at] not in _KEY_CHARS:
        return None
    start, floor = at - 1, max(0, at - _MAX_KEY_CHARS - 1)
    while start > floor and text[start - 1] in _KEY_CHARS:
        start -= 1
    end, ceiling = at + 1, min(len(text), start + _MAX_KEY_CHARS + 1)
    while end < ceiling and text[end] in _KEY_CHARS:
        end += 1
    return (start, end) if end - start <= _MAX_KEY_CHARS else None


def clip_words(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, never inside a run of the characters keys are
    made of: a provider that echoes the key it refused (``Incorrect API key provided: sk-…``)
    must not leave a piece of it that the log's redaction, which looks for the whole key or a
    key's pattern, no longer recognises. A run longer than any key, and text in other scripts,
    are cut where the limit falls."""
    if len(text) <= limit:
        return text
    run = key_run(text, limit)
    return text[: run[0] if run is not None else limit] + "…"


def error_message(payload: Any) -> str:
    """An error payload as one line of text: its ``message`` (inside ``{"error": …}`` as
    OpenAI-compatible APIs nest it), else its JSON (never a Python repr)."""
    error = payload
    for _ in range(3):  # {"error": {"error": {...}}} from some gateways
        if isinstance(error, dict) and isinstance(error.get("error"), dict | str):
            error = error["error"]
    if isinstance(error, str):
        return error
    if isinstance(error, dict):
        message = error.get("message")
        if isinstance(message, str) and message:
            return message
    try:
        return orjson.dumps(payload, default=str).decode()
    except (TypeError, orjson.JSONEncodeError):
        return str(payload)


class Recorded(Protocol):
    """A response's bytes as the relay kept them, assembled when the observers need them;
    ``recorder`` is None where they were a whole body, not a stream."""

    @property
    def recorder(self) -> object | None: ...

    def assemble(self, status: int) -> AssembledResponse | None: ...


# An answer of the other shape than the request asked for: relayed as it came, but no answer an
# openai SDK reads (its tokens and cost are still counted: the provider billed them)
WHOLE_FOR_STREAM: Final = (
    'upstream answered the streamed request with a whole JSON body, ignoring "stream": the'
    " openai SDKs read no chunk of it (the client got an empty answer)"
)
STREAM_FOR_WHOLE: Final = (
    "upstream answered a request that asked for no stream with a stream: the openai SDKs"
    " return it unread, as text, not a completion"
)


class Transform(Protocol):
    """A request transform: the parsed body in, the body to forward out (the same object when it
    changed nothing), with what it did noted on the exchange. May raise ``ProxyError``."""

    async def apply(
        self, ex: Exchange, state: SessionState, body: dict[str, Any]
    ) -> dict[str, Any]: ...


class Observer(Protocol):
    """Receives exchanges; must not block (hand slow work to a background writer)."""

    def on_request(self, ex: Exchange) -> None: ...

    def on_response(self, ex: Exchange) -> None: ...

    # Optional hooks, called when an observer defines them:
    #   on_compaction(ex, comp, source): a compaction was made (source model|extractive) or reused.
    #   on_retry(ex): the request was transformed again and re-sent (context length exceeded).
    #   on_error(ex): cachegate answered itself (bad input, strict rejection); nothing forwarded.


def notify_each(observers: list[Observer], calls: list[tuple[bool, Exchange]]) -> None:
    """``on_request`` (``True``) or ``on_response`` (``False``) on every observer for each
    ``(request, ex)`` of ``calls``, observer by observer: every observer sees the calls in their
    order, and an observer's calls follow those of the observers before it in the list (the
    event log reads what accounting noted on the exchange).

    The same calls as ``notify`` for each in turn, run in another order: one observer's code and
    state stay in the processor's caches across a batch of exchanges, where going through every
    observer for one exchange at a time evicted them (``ChatPipeline._drain``). One failing call
    never stops the others or the relay."""
    for observer in observers:
        on_request = getattr(observer, "on_request", None)
        on_response = getattr(observer, "on_response", None)
        for request, ex in calls:
            method = on_request if request else on_response
            if method is None:
                continue
            try:
                method(ex)
            except Exception:
                _failed(observer, "on_request" if request else "on_response")


def notify(observers: list[Observer], hook: str, ex: Exchange, *args: Any) -> None:
    """Call ``hook`` on every observer; one failing observer never stops the others or the relay."""
    for observer in observers:
        try:
            method = getattr(observer, hook, None)
            if method is not None:
                method(ex, *args)
        except Exception:
            _failed(observer, hook)


def _failed(observer: Observer, hook: str) -> None:
    """Log the exception being handled: an observer's ``hook`` failed. A ``RecursionError`` (a
    body nested deeper than some walk of it takes) in one line: its traceback, ~1,000 frames of
    two functions in turn, was ~225 KB a request, which a client could send on every one."""
    error = sys.exc_info()[1]
    if isinstance(error, RecursionError):
        frames = traceback.extract_tb(error.__traceback__)
        where = (
            f" in {frames[-1].name} ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        )
        log.error(
            "observer %s.%s failed; the response is unaffected: %s%s (a body nested deeper than"
            " that walk takes, or a bug)",
            type(observer).__name__,
            hook,
            error,
            where,
        )
        return
    log.exception(
        "observer %s.%s failed; the response is unaffected", type(observer).__name__, hook
    )
