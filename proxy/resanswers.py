"""The Responses API's answers read for what they cost (pure): a ``response`` object, whole or
as the last event of a stream, into an ``AssembledResponse`` with its usage and model.

``POST /v1/responses`` is relayed byte for byte; the relay tees its bytes here as it tees a
chat stream to ``assemble.StreamRecorder``. A Responses stream repeats the whole response in
its last event (``response.completed``, ``response.incomplete`` or ``response.failed``), usage
included, so only that event, and an ``error`` event, are read: the events before them are
not parsed (a search for a few markers per 16 KB kept, no step per event), which keeps the
relay's per-event cost unchanged. Their bytes are kept until that event comes, and read only
for a stream cut before it (``partial_message``: the part of the answer the client had).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

import orjson

from proxy.assemble import MAX_RECORDED_STREAM, AssembledResponse
from proxy.sse import SSEDecoder
from proxy.usage import normalize_usage

logger = logging.getLogger(__name__)

# The events that end a Responses stream, each with the whole response.
TERMINAL_EVENTS: Final = frozenset(("response.completed", "response.incomplete", "response.failed"))
# Bytes of an event that may matter: a terminal event's type, or an error's key or type (a JSON
# string's own quotes are escaped, so ``"error"`` is never inside a text delta).
_MARKERS: Final = (b"response.completed", b"response.incomplete", b"response.failed", b'"error"')
_TEXT_MARKERS: Final = tuple(marker.decode() for marker in _MARKERS)
# Two bytes that hold a blank line's start, whichever line ends a server writes (LF LF, LF
# then a CR or CRLF, CR CR; a CRLF CRLF holds the second): an SSE event ends in one.
_BLANK_LINES: Final = (b"\n\n", b"\n\r", b"\r\r")
# The events read (their ``event:`` line's name): others are let go unkept.
_MATTERING_EVENTS: Final = frozenset(
    (b"response.completed", b"response.incomplete", b"response.failed", b"error")
)
# A stream's first event, which names the response: read until it has been (a stream the client
# cuts has no last event, and a later request may continue it by ``previous_response_id``).
_CREATED: Final = b"response.created"
# Its id, where the event starts as OpenAI writes it (else the event is parsed whole)
_CREATED_ID: Final = re.compile(
    r'\{"type":"response\.created","sequence_number":\d+,"response":\{"id":"([^"\\]{1,256})"'
)
# An event kept while its end has not come: a terminal one holds the whole response (its
# output's text included), so up to the size of a whole answer cachegate reads.
MAX_PENDING_EVENT: Final = 32 * 1024 * 1024
# A stream's bytes held while its last event has not come, for a cut stream's part of the
# answer: ~4,000 deltas (events are ~250 bytes for a few characters of text). Past them they
# are let go: a stream cut later logs no part (``text_dropped``), as one too large to keep.
MAX_SEEN: Final = 1024 * 1024


def _blank_lines(data: bytes) -> tuple[bytes, ...]:
    """The blank lines to look for in ``data``: LF LF only where it has no CR (most streams;
    a search for one byte is ~50 times as fast as one for two that are not there)."""
    return _BLANK_LINES if data.find(b"\r") >= 0 else _BLANK_LINES[:1]


def _skippable(head: bytes, created: bool = True) -> bool:
    """Whether an event starting with ``head`` (at its ``event:`` line) cannot matter: its
    line has ended, naming one of the Responses API's own events other than the last ones
    (``response.output_text.delta``, ``response.output_item.done`` …). A name of another
    form (``message``, upper case) is kept: the SDKs read an event's type in its data.
    ``created``: whether the response's id is known (else ``response.created`` matters)."""
    ends = [at for at in (head.find(b"\n"), head.find(b"\r")) if at >= 0]
    if not ends:
        return False  # (its name may not have come whole)
    name = head[6 : min(ends)].strip(b" \t")
    return (
        name.startswith(b"response.")
        and name not in _MATTERING_EVENTS
        and (created or name != _CREATED)
    )


def _first_end(data: bytes) -> int:
    """Where the first blank line's two bytes end in ``data``; -1 when it has none."""
    first = len(data)
    for end in _blank_lines(data):
        at = data.find(end, 0, first + 1)  # (only before the first found so far)
        if 0 <= at < first:
            first = at
    return first + 2 if first < len(data) else -1


BACKGROUND_STATES: Final = ("queued", "in_progress")
"""The status of a ``background`` request's answer, logged as its ``finish_reason``: the
response runs on at the provider, and its usage comes with a later ``GET
/v1/responses/{id}``, which cachegate relays unread."""


def assemble_response(body: Any, last_event: str | None = None) -> AssembledResponse:
    """A Responses API ``response`` object (a non-streamed answer's body, or a terminal event's
    ``response``) as cachegate records an answer: its output's text as the assistant message's
    ``content`` (its refusal parts' as ``refusal``), its ``function_call`` and
    ``custom_tool_call`` items as ``tool_calls``, its
    usage, model and id, and its ``error`` (a failed response's). ``finish_reason`` is chat's
    word for its status: ``stop`` or ``tool_calls`` when completed, the reason it is
    incomplete (``length`` for ``max_output_tokens``), None when it failed, its status when it
    runs on in the background (``BACKGROUND_STATES``). ``last_event``: the
    stream's last event that carried it (its type says what the body is, and its status where
    the body has none). Raises ``TypeError`` for a whole answer's body that is no response
    object."""
    if not isinstance(body, Mapping):
        raise TypeError("a Responses API answer is a JSON object")
    error = body.get("error")
    status = body.get("status")
    if last_event is not None and not isinstance(status, str):
        status = last_event.removeprefix("response.")
    if not error or not isinstance(error, Mapping | str) or status == "completed":
        error = None  # (an empty one, as on the chat route, is none; a completed one has none)
    shaped = last_event is not None or body.get("object") == "response" or "output" in body
    if error is None and not shaped:
        raise TypeError("not a Responses API response object")
    texts: list[str] = []
    refusals: list[str] = []
    calls: list[dict[str, Any]] = []
    output = body.get("output")
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type")
        if kind == "message":
            content = item.get("content")
            for part in content if isinstance(content, list) else ():
                if isinstance(part, Mapping) and part.get("type") == "output_text":
                    text = part.get("text")
                    if isinstance(text, str):
                        texts.append(text)
                elif isinstance(part, Mapping) and part.get("type") == "refusal":
                    said = part.get("refusal")
                    if isinstance(said, str):
                        refusals.append(said)
        elif kind == "function_call":
            calls.append(
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                }
            )
        elif kind == "custom_tool_call":
            calls.append(
                {
                    "id": item.get("call_id"),
                    "type": "custom",
                    "custom": {"name": item.get("name"), "input": item.get("input")},
                }
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if refusals:  # (as a chat answer's ``refusal``)
        message["refusal"] = "".join(refusals)
    if calls:
        message["tool_calls"] = calls
    finish: str | None = None
    if status == "completed":
        finish = "tool_calls" if calls else "stop"
    elif status == "incomplete":
        details = body.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, Mapping) else None
        finish = "length" if reason == "max_output_tokens" else str(reason or "incomplete")
    elif status in BACKGROUND_STATES:  # (a ``background`` request's answer: not run yet)
        finish = status
    if status == "failed" and error is None:
        error = {"message": "the response failed"}
    usage = body.get("usage")
    model = body.get("model")
    ident = body.get("id")
    tier = body.get("service_tier")
    return AssembledResponse(
        message=message,
        finish_reason=finish,
        usage=normalize_usage(usage) if isinstance(usage, Mapping) else None,
        error={"error": error} if error is not None else None,
        done=error is None,
        model=model if isinstance(model, str) else None,
        id=ident if isinstance(ident, str) else None,
        service_tier=tier if isinstance(tier, str) and tier else None,
    )


def partial_message(data: bytes) -> dict[str, Any]:
    """What the events of a stream cut before its last one said of the answer (``data``, the
    stream's bytes, its last event perhaps cut), as ``assemble_response`` gives a whole one:
    the text its deltas carried, its refusal, its function and custom tool calls with the
    arguments that came (partial, as an interrupted chat stream's are)."""
    decoder = SSEDecoder()
    texts: list[str] = []
    refusals: list[str] = []
    calls: dict[Any, dict[str, Any]] = {}  # by the item's id, else its place in the output
    for event in decoder.decode(data):
        try:
            payload = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            break  # (the openai SDKs raise there: what follows, the client never had)
        if not isinstance(payload, dict):
            break
        kind = payload.get("type")
        delta = payload.get("delta")
        if kind == "response.output_text.delta" and isinstance(delta, str):
            texts.append(delta)
        elif kind == "response.refusal.delta" and isinstance(delta, str):
            refusals.append(delta)
        elif kind in ("response.output_item.added", "response.output_item.done"):
            item = payload.get("item")
            if not isinstance(item, Mapping) or item.get("type") not in _CALL_FIELDS:
                continue
            key = item.get("id") or payload.get("output_index")
            field = _CALL_FIELDS[item["type"]]
            said = item.get(field)
            call = calls.get(key)
            if call is None:
                kind_of = "function" if item["type"] == "function_call" else "custom"
                call = calls[key] = {
                    "id": item.get("call_id"),
                    "type": kind_of,
                    kind_of: {"name": item.get("name"), field: ""},
                }
            if isinstance(said, str) and (said or kind == "response.output_item.done"):
                call[call["type"]][field] = said  # (the whole of it, where the item has it)
        elif kind in _CALL_DELTAS and isinstance(delta, str):
            call = calls.get(payload.get("item_id")) or calls.get(payload.get("output_index"))
            if call is not None:
                body = call[call["type"]]
                body[_CALL_DELTAS[kind]] = body.get(_CALL_DELTAS[kind], "") + delta
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if refusals:
        message["refusal"] = "".join(refusals)
    if calls:
        message["tool_calls"] = list(calls.values())
    return message


# The output items that are calls, and the field their input is in; the events that stream it.
_CALL_FIELDS: Final = {"function_call": "arguments", "custom_tool_call": "input"}
_CALL_DELTAS: Final = {
    "response.function_call_arguments.delta": "arguments",
    "response.custom_tool_call_input.delta": "input",
}


class ResponsesRecorder:
    """The relay's side channel for a Responses API stream: raw chunks in (the relay appends to
    ``chunks`` and calls ``decode`` every ``StreamRecorder.KEEP_BYTES``), the terminal event's
    response out (``finish``). Each byte is looked at a bounded number of times: the new bytes
    are searched for the events' ends, an event named by its ``event:`` line as one that cannot
    matter (a delta, an item's ``done`` repeating its text) is let go as it arrives, and the
    whole events kept are read only when they hold a marker. An event over
    ``MAX_PENDING_EVENT`` is let go too (``oversize``: its usage, if it was the last, unread).
    The bytes decoded are kept (``seen``, up to ``MAX_SEEN``) until a last event comes, for a
    stream cut before one (``partial_message``). A body that opens a JSON object and holds no
    event is no stream (a gateway that labels every answer ``text/event-stream``): ``finish``
    sets ``json_body`` and leaves its bytes in ``whole`` (None past ``MAX_RECORDED_STREAM``), for the
    relay to read as a body, as ``StreamRecorder`` does."""

    __slots__ = (
        "chunks",
        "created",
        "error",
        "events",
        "inflate",
        "json_body",
        "last",
        "last_event",
        "opened",
        "oversize",
        "pending",
        "pending_size",
        "response",
        "seen",
        "seen_size",
        "skipping",
        "torn",
        "whole",
    )

    def __init__(self, inflate: Callable[[bytes], bytes] | None = None) -> None:
        self.chunks: list[bytes] = []
        # what the raw chunks decode to, where the stream is compressed (relayed as it came)
        self.inflate = inflate
        self.pending: list[bytes] = []  # the pieces of an event whose blank line has not come
        self.pending_size = 0
        self.skipping = False  # the event arriving is let go, up to its blank line
        self.last = b""  # the last byte decoded (a blank line may begin in it)
        self.response: Mapping[str, Any] | None = None  # the last terminal event's response
        self.last_event: str | None = None  # and its type
        self.error: Any = None  # an ``error`` event's payload
        self.events = 0  # terminal and error events read
        self.torn = False  # the last such event was cut by the stream's end (no blank line)
        self.oversize = False  # an event past ``MAX_PENDING_EVENT`` was let go unread
        self.created: str | None = None  # the response's id, from the stream's first event
        # The bytes decoded while no terminal event has come, unread: a stream cut before one
        # (the client hung up, Esc in Codex) is read for the part of the answer it carried
        self.seen: list[bytes] = []
        self.seen_size = 0
        self.opened = b""  # the body's first byte past white space
        self.json_body = False
        self.whole: list[bytes] | None = None

    def decode(self) -> None:
        """Read the whole events kept so far that may matter; keep an unfinished one."""
        data = b"".join(self.chunks)
        self.chunks.clear()  # the same list: the relay holds its append
        if self.inflate is not None:
            data = self.inflate(data)
        if not data:
            return
        if not self.opened:
            self.opened = data.lstrip()[:1]
        # (a body that opens a JSON object, read whole if it is one: as a body is, further)
        most = MAX_RECORDED_STREAM if self.opened == b"{" else MAX_SEEN
        if self.response is None and self.seen_size <= most:
            self.seen_size += len(data)
            if self.seen_size <= most:
                self.seen.append(data)
            else:  # (past it, a cut stream's part is not read: let go, said as dropped)
                self.seen = []
        probe = self.last + data  # (a blank line's first byte may be the last one decoded)
        shift = len(self.last)
        self.last = data[-1:]
        if self.skipping:  # the end of the event let go, then what follows it
            first = _first_end(probe)
            if first < 0:
                return
            self.skipping = False
            data = data[max(first - shift, 0) :]
            probe, shift = data, 0
        cut = -1
        for end in _blank_lines(probe):
            cut = max(cut, probe.rfind(end, cut + 1))  # (only after the last found so far)
        if cut < 0:
            self._keep(data)
            return
        cut = max(cut + 2 - shift, 0)
        whole = b"".join(self.pending) + data[:cut] if self.pending else data[:cut]
        self.pending, self.pending_size = [], 0
        if any(marker in whole for marker in _MARKERS) or (
            self.created is None and _CREATED in whole
        ):
            self._read(whole, at_end=False)
        self._keep(data[cut:])

    def _keep(self, data: bytes) -> None:
        """Keep ``data``, the start or more of an event not ended yet, unless it cannot matter."""
        if not data:
            return
        if not self.pending:
            head = data.lstrip(b"\r\n")
            if not head:
                return
            if head.startswith(b"event:") and _skippable(head, self.created is not None):
                self.skipping = True  # a delta, a part done: let go as it arrives
                return
        self.pending.append(data)
        self.pending_size += len(data)
        if self.pending_size > MAX_PENDING_EVENT:
            if not self.oversize:
                logger.warning(
                    "Responses API stream event over %s bytes: not read (if it was the "
                    "response's last event, its usage is not counted)",
                    f"{MAX_PENDING_EVENT:,}",
                )
            self.oversize = True
            self.pending, self.pending_size, self.skipping = [], 0, True

    def _read(self, data: bytes, at_end: bool) -> bool:
        """Read the events of ``data`` that may matter; whether the stream's end cut one
        (``at_end``: no blank line after the last, which the SDKs never dispatch)."""
        decoder = SSEDecoder()
        events = [(event, False) for event in decoder.decode(data)]
        if at_end:
            events += [(event, True) for event in decoder.flush()]
        for event, torn in events:
            text = event.data
            if self.created is None and "response.created" in text:
                self._created(text)
            if not any(marker in text for marker in _TEXT_MARKERS):
                continue
            try:
                payload = orjson.loads(text)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(payload, dict):
                continue
            kind = payload.get("type")
            if kind in TERMINAL_EVENTS:
                response = payload.get("response")
                self.response = response if isinstance(response, Mapping) else {}
                self.last_event = kind
                self.seen, self.seen_size = [], 0  # (it holds the whole answer)
            elif kind == "error" or (kind is None and "error" in payload):
                self.error = payload.get("error", payload) if kind is None else payload
            else:
                continue
            self.events += 1
            self.torn = torn
        return bool(events) and events[-1][1]

    def _created(self, text: str) -> None:
        """The response's id, from its ``response.created`` event."""
        match = _CREATED_ID.match(text)
        if match is not None:
            self.created = match[1]
            return
        try:
            payload = orjson.loads(text)
        except orjson.JSONDecodeError:
            return
        if isinstance(payload, dict) and payload.get("type") == "response.created":
            response = payload.get("response")
            ident = response.get("id") if isinstance(response, dict) else None
            if isinstance(ident, str) and ident:
                self.created = ident

    def ended(self) -> bool:
        """Whether the bytes so far end with a whole terminal event, after which the API sends
        nothing: a client that leaves then had the whole answer (Codex CLI stops reading at
        ``response.completed``), whatever the upstream's last bytes (its chunked stream's end)."""
        self.decode()
        return (
            self.response is not None and not self.torn and not self.pending and not self.skipping
        )

    def finish(self) -> AssembledResponse:
        """End of stream (complete or not): what its terminal event said. A stream cut before
        one has no usage and is ``unfinished`` (inside an event) or not ``done``."""
        self.decode()
        data = b"".join(self.pending)
        self.pending, self.pending_size = [], 0
        cut = self._read(data, at_end=True) if data.strip() else False
        cut = cut or self.skipping  # (an event let go unkept that the end cut)
        if self.opened == b"{" and self.response is None and self.error is None and not self.events:
            self.json_body = True
            self.whole = self.seen if self.seen_size <= MAX_RECORDED_STREAM else None
            self.seen, self.seen_size = [], 0
            return AssembledResponse({"role": "assistant", "content": None})  # (read: ``whole``)
        if self.response is not None:
            result = assemble_response(self.response, self.last_event)
            if self.error is not None and result.error is None:
                result.error = {"error": self.error}
                result.done = False
        else:
            result = AssembledResponse(message=partial_message(b"".join(self.seen)))
            if self.error is not None:
                result.error = {"error": self.error}
        if self.torn or (self.response is None and self.error is None and cut):
            result.unfinished = True  # (the SDKs never dispatch an event the end cut)
            result.done = False
        elif self.response is None and self.error is None and self.oversize:
            result.done = True  # (its last event was perhaps the one let go: no error said)
        if result.id is None:  # (a stream cut before its last event: a client may continue it)
            result.id = self.created
        # (a cut stream's part past the limit: let go, as an answer too large to keep is)
        result.text_dropped = self.oversize or (self.response is None and self.seen_size > MAX_SEEN)
        self.seen, self.seen_size = [], 0
        result.events = self.events
        return result
