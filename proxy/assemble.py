"""Chat-completion deltas assembled into one assistant message and its usage (pure).

The relay tees every upstream byte into a ``StreamRecorder``; what it returns at the end is what
observers receive. Only choice index 0 is assembled: agents ask for one choice, and an ``n > 1``
request is rare enough that its other choices are not worth the bookkeeping on the hot path.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

from proxy import prefix
from proxy.sse import SSEDecoder, SSEEvent
from proxy.usage import Usage, UsageTracker, normalize_usage

logger = logging.getLogger(__name__)

# Bytes a text slot of a learned chunk shape may not hold: a quote or backslash (the string would
# end there or hold an escape) or a control character (not valid JSON).
_UNSAFE = re.compile(rb'["\\\x00-\x1f]')
_CONTENT_KEY = b'"content":"'
# OpenAI pads each chunk with a random string to hide token lengths; it is the chunk's last key.
_PADDING_KEY = b',"obfuscation":"'
_LEARN_TRIES = 4  # chunk shapes learned per stream before the recorder stops learning


# What the log keeps of an audio answer: its id (the client sends it back on its next turn) and
# expiry, and its transcript; not its base64 data.
_AUDIO_FIELDS: tuple[str, ...] = ("id", "expires_at")


@dataclass(slots=True)
class AssembledResponse:
    """What one exchange produced.

    ``message`` is ``{"role": "assistant", "content": str | None}``, plus ``"tool_calls"`` (each
    ``{"id", "type", "function": {"name", "arguments"}}``, ordered by stream index) when any,
    plus ``"reasoning_content"`` when the provider sent non-empty reasoning. ``error`` is an
    ``{"error": …}`` payload seen in the body or mid-stream; ``done`` is true once ``[DONE]`` was
    seen (for a non-streaming body: when it held no error). ``events`` counts SSE events fed and
    ``malformed`` the data payloads that were neither ``[DONE]`` nor a JSON object (of a stream
    that ended inside an event, ``unfinished``, the torn last one is not counted).
    """

    message: dict[str, Any]
    finish_reason: str | None = None
    usage: Usage | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    model: str | None = None
    id: str | None = None
    # the processing tier the provider says it billed the answer at (OpenAI's ``service_tier``:
    # ``default``, ``flex``, ``priority``, ``scale``); None when it says none
    service_tier: str | None = None
    events: int = 0
    malformed: int = 0
    unfinished: bool = False  # a stream that ended inside an event, with no [DONE] seen
    text_dropped: bool = False  # past MAX_RECORDED_STREAM: the message's text was let go


class _ToolCalls:
    """Tool-call deltas merged by ``index``.

    A delta carrying an id different from the one already held at its index starts a new call
    (providers that put every parallel call at index 0); a function name identical to the one
    already held is a repeat, not a fragment (providers that resend the full name on every chunk).
    A delta without ``index`` is treated as one more index of its own, by the same rules; there,
    a name without an id starts a new call once the held call's arguments are a whole JSON
    value, or after none under another name (Gemini: each call whole in a chunk of its own).
    ``ordered()`` lists calls by index, as the message's ``tool_calls`` array would hold them;
    calls sharing an index keep the order in which they started.
    """

    __slots__ = ("_arguments", "_by_index", "_order", "_scans", "calls")

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []  # arguments filled in by ordered()
        # Each call's argument fragments, joined once by ordered(): a long argument (a file
        # written by a tool) arrives in thousands of deltas, and a string grown by += is copied
        # whole on every one of them.
        self._arguments: list[list[str]] = []
        self._by_index: dict[object, int] = {}  # index -> position of its latest call
        self._order: list[float] = []  # each call's index; calls without one go last
        self._scans: dict[int, _JsonScan] = {}  # calls without an index: how far their JSON is

    def _another(self, delta: Mapping[str, Any], position: int | None) -> bool:
        """Whether a delta with another id than the call held at its index starts a call of its
        own: it names one (parallel calls all at index 0), or the held call's arguments are
        whole, or it carries no piece of arguments (its name may follow); not a piece of
        arguments under a new id (a provider that changes the id after the first delta, as
        the SDKs read it: one call)."""
        named = delta.get("function")
        if not isinstance(named, Mapping):
            named = delta.get("custom")
        name = named.get("name") if isinstance(named, Mapping) else None
        if (isinstance(name, str) and name) or position is None:
            return True
        piece = named.get("arguments", named.get("input")) if isinstance(named, Mapping) else None
        if not (isinstance(piece, str) and piece):  # (a call's id first, its name to come)
            return True
        pieces = self._arguments[position]
        return bool(pieces) and self._scans.setdefault(position, _JsonScan()).whole(pieces)

    def add(self, delta: Mapping[str, Any]) -> None:
        index = delta.get("index")
        key = index if isinstance(index, int) else None
        position = self._by_index.get(key)
        call = self.calls[position] if position is not None else None
        call_id = delta.get("id")
        if isinstance(call_id, str) and call_id:
            if call is None or (
                call["id"] and call["id"] != call_id and self._another(delta, position)
            ):
                call = None
            else:  # (an id changed in mid-call, with no name: the same call, Poolside's)
                call["id"] = call_id
        elif call is not None and key is None and call["function"]["name"]:
            # Without an index or an id (Gemini's OpenAI endpoint sends each parallel call whole
            # in a chunk of its own, with no index; a gateway in front of it, an empty id): a
            # name starts the next call once the held call's arguments are whole, or after one
            # with no arguments under another name; not while its arguments still stream, each
            # piece with the name repeated (each piece scanned once: ``_JsonScan``).
            named = delta.get("function")
            if not isinstance(named, Mapping):
                named = delta.get("custom")
            name = named.get("name") if isinstance(named, Mapping) else None
            if isinstance(name, str) and name:
                assert position is not None
                pieces = self._arguments[position]
                scan = self._scans.setdefault(position, _JsonScan())
                if (pieces and scan.whole(pieces)) or (
                    not pieces and name != call["function"]["name"]
                ):
                    call = None
        if call is None:
            call = {
                "id": call_id if isinstance(call_id, str) else "",
                "type": "function",
                "function": {"name": "", "arguments": ""},
            }
            position = self._by_index[key] = len(self.calls)
            self.calls.append(call)
            self._arguments.append([])
            self._order.append(key if key is not None else float("inf"))
        assert position is not None
        kind = delta.get("type")
        if isinstance(kind, str) and kind:
            call["type"] = kind
        function = delta.get("function")
        argument_key = "arguments"
        if not isinstance(function, Mapping):  # a custom tool's call: its input is free text
            function, argument_key = delta.get("custom"), "input"
        if isinstance(function, Mapping):
            held = call["function"]
            name = function.get("name")
            if isinstance(name, str) and name and name != held["name"]:
                held["name"] += name
            arguments = function.get(argument_key)
            if isinstance(arguments, str) and arguments:
                self._arguments[position].append(arguments)

    def ordered(self) -> list[dict[str, Any]]:
        """Copies of the calls, by index, in the message's ``tool_calls`` shape."""
        positions = sorted(range(len(self.calls)), key=self._order.__getitem__)
        out: list[dict[str, Any]] = []
        for i in positions:
            call = self.calls[i]
            text = "".join(self._arguments[i])
            if (
                not text
                and not call["id"]
                and self._order[i] == float("inf")
                and out
                and out[-1]["function" if "function" in out[-1] else "custom"]["name"]
                == call["function"]["name"]
            ):
                continue  # the name alone again, after a call's arguments: a closing chunk
            if call["type"] == "custom":
                custom = {"name": call["function"]["name"], "input": text}
                out.append({"id": call["id"], "type": "custom", "custom": custom})
                continue
            function = {**call["function"], "arguments": text}
            out.append({"id": call["id"], "type": call["type"], "function": function})
        return out


_INVALID: Final = object()
# What orjson refuses and Python's parser reads: an escaped UTF-16 surrogate, NaN or Infinity.
_LENIENT_ONLY: Final = re.compile(r"\\u[dD][89a-fA-F]|NaN|Infinity")
_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89a-fA-F]")
_LENIENT_MAX: Final = 1 << 20
ANSWER_LENIENT_MAX: Final = 8 << 20  # (a whole answer: ~13 ms a MiB of escapes to mend)


def read_answer(body: bytes) -> Any:
    """A whole answer's JSON (a completion, a summarizer's), read as the SDKs read it: by orjson,
    or where orjson alone refuses it for a lone surrogate escape, by ``read_leniently`` (up to
    ``ANSWER_LENIENT_MAX``). Raises ``orjson.JSONDecodeError`` for anything else: bytes that are
    not UTF-8, ``NaN`` or ``Infinity`` (which the Node SDK's parser refuses: an invalid answer,
    as before), no JSON."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        # (no name kept for the error: its traceback holds this frame, a reference cycle that
        # kept the caller's exchange alive until a full collection)
        try:
            text: str | None = body.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None:
            value, odd = read_leniently(text, ANSWER_LENIENT_MAX)
            if not odd and value is not None and value is not _INVALID:
                return value
        raise


def read_leniently(data: str, limit: int | None = None) -> tuple[Any, bool]:
    """A payload orjson refused, read as the Python SDK reads it (``json.loads``): a lone UTF-16
    surrogate escaped in a string (``"\\ud83d"``, an emoji cut between two chunks) as U+FFFD,
    as cachegate reads one in a request; with whether it held ``NaN`` or ``Infinity`` (Python-
    based servers write a logprob of -inf so), which the Node SDK's parser refuses. ``_INVALID``
    where it is no JSON (tried only where it has what orjson alone refuses: a payload of
    megabytes of anything else is not parsed twice). A payload past ``limit`` (a stream's,
    ``_LENIENT_MAX``) is not read, ``None`` (a chunk is a few hundred bytes; parsing and mending
    megabytes held the event loop for a second): a stream counts it as malformed, not a cut."""
    if len(data) > (_LENIENT_MAX if limit is None else limit):
        return None, False
    if _LENIENT_ONLY.search(data) is None:
        return _INVALID, False
    constants: list[str] = []

    def constant(name: str) -> float:
        constants.append(name)
        return float(name)

    try:
        value = json.loads(data, parse_constant=constant)
        if _SURROGATE_ESCAPE.search(data) is not None:
            value = prefix.deep_call(prefix.without_surrogates, value)
    except (ValueError, RecursionError):
        return _INVALID, False
    return value, bool(constants)


class StreamAssembler:
    """Feed it the SSE events of a streamed chat completion; ``result()`` is the message so far.

    Never raises on provider data: malformed payloads are counted, unknown fields ignored, and
    ``result()`` can be taken at any time (an interrupted stream yields its partial message).
    """

    def __init__(self) -> None:
        self._content: list[str] = []
        self._has_content = False
        self._reasoning: list[str] = []
        self._refusal: list[str] | None = None  # set once a delta carries ``refusal``
        self._function: tuple[list[str], list[str]] | None = None  # legacy function_call
        # an audio answer (``modalities: ["audio"]``): its id and transcript, not its data
        self._audio: tuple[dict[str, Any], list[str]] | None = None
        self._tools = _ToolCalls()
        self._usage = UsageTracker()
        self._finish_reason: str | None = None
        self._error: dict[str, Any] | None = None
        self._done = False
        self._model: str | None = None
        self._id: str | None = None
        self._tier: str | None = None
        self._events = 0
        self._malformed = 0
        self._cut = False  # past an event no SDK reads past (``cut_here``)
        # (bytes before the text, bytes after it, padded, finish_reason) of a text-only chunk
        self._shape: tuple[bytes, bytes, bool, str | None] | None = None
        self._learn_tries = _LEARN_TRIES
        self._text_dropped = False

    @property
    def malformed(self) -> int:
        """Data payloads so far that were neither ``[DONE]`` nor a JSON object."""
        return self._malformed

    @property
    def text_dropped(self) -> bool:
        """Whether ``drop_text`` was called: the message's text is not all there."""
        return self._text_dropped

    def drop_text(self) -> None:
        """Let go of the text gathered so far (content, reasoning, a refusal, arguments): a
        stream past the recording limit keeps its usage, finish reason and error, not its text."""
        self._content.clear()
        self._reasoning.clear()
        if self._refusal is not None:
            self._refusal.clear()
        self._function = None
        if self._audio is not None:
            self._audio[1].clear()
        self._tools = _ToolCalls()  # a new call per delta would be kept without end
        self._text_dropped = True

    def feed(self, event: SSEEvent) -> None:
        """Take one SSE event of the stream."""
        self._events += 1
        if self._done:
            # (the SDKs read nothing after [DONE]: what follows is no part of the answer the
            # client got, nor a malformed event any client fails on)
            return
        data = event.data
        if data == "[DONE]" or data.strip() == "[DONE]":
            self._done = True
            return
        if not data or data.isspace():
            # (the Python SDK parses every data line but [DONE]: an empty one raises in it; the
            # Node SDK skips a block of only ``retry:``, or a blank line after an ``id:``, and
            # reads on. Both raise on a block with an ``event:`` and no data, and on an empty
            # ``data:`` line, whatever its ``id:`` or ``retry:``: the client's message ends
            # before it.)
            self._malformed += 1
            if not event.no_data or event.event is not None:
                self.cut_here()
            return
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            chunk, odd = read_leniently(data)
            if chunk is _INVALID:  # no SDK reads past it
                logger.debug("invalid stream payload: %.80r", data)
                if event.event == "error" and self._error is None:
                    self._error = {"error": {"message": data}}
                self._malformed += 1
                self.cut_here()
                return
            if odd and isinstance(chunk, dict):  # (NaN or Infinity: the Node SDK fails on it)
                self._malformed += 1
                self._chunk(chunk, event.event)
                return
        if not isinstance(chunk, dict):
            logger.debug("malformed stream payload: %.80r", data)
            if event.event == "error" and self._error is None:
                self._error = {"error": {"message": data}}
            self._malformed += 1
            return
        self._chunk(chunk, event.event)

    def cut_here(self) -> None:
        """A payload that is no JSON: the openai SDKs raise there, so the message the client
        got ends before it, and what follows is not assembled into it (its usage is still
        taken: the provider bills it; and an error event it sends)."""
        self._cut = True
        self._shape = None  # (the text lanes assemble; everything goes through ``_chunk`` now)
        self._learn_tries = 0

    def feed_data(self, payloads: list[bytes]) -> None:
        """Take the raw data payloads of plain events (no ``event:``, ``id:`` or ``retry:``), as
        ``SSEDecoder.decode_data`` gives them: the same result as ``feed`` on each, without the
        per-event decoding. Consecutive chunks of the learned text-only shape are not parsed:
        their texts go to ``feed_texts`` together. Anything but a JSON object or ``[DONE]`` goes
        through ``feed``."""
        run: list[bytes] = []  # payloads of the learned shape not taken yet, and their texts
        texts: list[bytes] = []
        for data in payloads:
            if self._done:  # (nothing after [DONE] is the answer's: ``feed``)
                self._events += 1
                continue
            if self._shape is not None:
                text = self._shaped_text(data)
                if text is not None:
                    run.append(data)
                    texts.append(text)
                    continue
            if run:
                self._take_run(run, texts)
                run, texts = [], []
            self._parse(data)
        if run:
            self._take_run(run, texts)

    def _take_run(self, run: list[bytes], texts: list[bytes]) -> None:
        """Texts of consecutive chunks of the learned shape; should one of them not stand
        verbatim in a JSON string, each chunk is taken on its own (parsed, if it must be)."""
        if self.feed_texts(texts):
            return
        for data, text in zip(run, texts, strict=True):
            if not self.feed_texts([text]):
                self._parse(data)

    def _parse(self, data: bytes) -> None:
        """One payload through the JSON parser (and ``feed`` for what is not a JSON object)."""
        if data == b"[DONE]":  # before the parser: its error is a costly Python exception
            self._events += 1
            self._done = True
            return
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.feed(SSEEvent(None, data.decode("utf-8", "replace")))
            return
        if type(chunk) is dict:
            self._events += 1
            if self._chunk(chunk, None) and self._learn_tries:
                self._learn(data, chunk)
        else:
            self.feed(SSEEvent(None, data.decode("utf-8", "replace")))

    def _shaped_text(self, data: bytes) -> bytes | None:
        """The raw text of ``data`` when it is the learned text-only chunk with other text (and
        other padding): the same bytes before the text and after it, and a text with no quote
        (so it ends where the learned one did). Parsing it would then give that chunk with this
        text, if the text needs no unescaping (``feed_texts`` checks). None for anything else."""
        head, tail, padded, _ = self._shape  # type: ignore[misc]
        if not data.startswith(head):
            return None
        start = len(head)
        end = data.find(b'"', start)  # the text's closing quote: the text has no escapes
        if end < 0 or not data.startswith(tail, end):
            return None
        rest = end + len(tail)
        if padded:
            stop = len(data) - 2
            # Any padding but a quote, backslash or control character is a string nothing
            # reads (not UTF-8, the general path replaces it: still a string).
            if stop < rest or not data.endswith(b'"}') or _UNSAFE.search(data, rest, stop):
                return None
        elif rest != len(data):
            return None
        return data[start:end]

    @property
    def text_shape(self) -> tuple[bytes, bytes] | None:
        """The learned text-only chunk as (bytes before the text, bytes after it), when its
        chunks differ only in the text (no padding); None before one is learned, and after
        [DONE] (what follows it goes through ``feed_data``, which takes none of it)."""
        shape = self._shape
        return None if shape is None or shape[2] or self._done else (shape[0], shape[1])

    def feed_texts(self, texts: list[bytes]) -> bool:
        """Take a run of chunks of the learned shape by their raw texts (what stands between its
        two parts), as ``feed_data`` would take the whole payloads; all or nothing: False, with
        nothing taken, if any text would not stand verbatim in a JSON string (the general path
        then decides; it replaces what is not UTF-8)."""
        if self._shape is None:  # (a malformed one of the run ended the text lanes)
            return False
        finish = self._shape[3]
        joined = b"".join(texts)
        if _UNSAFE.search(joined) is not None:
            return False
        if joined.isascii():
            text = joined.decode("ascii")
        else:
            try:
                # each text on its own, as parsing each chunk would: a character split across
                # two chunks is not the character (the general path replaces its parts)
                text = "".join([t.decode() for t in texts])
            except UnicodeDecodeError:
                return False
        self._events += len(texts)
        self._has_content = True
        if text:
            self._content.append(text)
        if finish is not None:
            self._finish_reason = finish
        return True

    def _learn(self, data: bytes, chunk: dict[str, Any]) -> None:
        """Remember the shape of a chunk the text lane took, when its text stands in ``data``
        verbatim under the only ``"content"`` key and nothing around it is escaped (a key could
        hide behind an escape). ``_shaped_text`` then finds chunks that differ only in the text
        and in a trailing ``obfuscation`` string, which nothing reads."""
        choice = chunk["choices"][0]  # the text lane checked this shape
        at = data.find(_CONTENT_KEY)
        if at < 0 or data.count(b'"content"') != 1:
            return
        start = at + len(_CONTENT_KEY)
        try:
            raw = choice["delta"]["content"].encode()
        except UnicodeEncodeError:
            return
        end = start + len(raw)
        if data[start:end] != raw or data[end : end + 1] != b'"':
            return
        head, tail = data[:start], data[end:]
        if any(part.find(c) >= 0 for part in (head, tail) for c in (b"\\", b"\n", b"\r")):
            return
        padded = False
        if tail.endswith(b'"}'):
            pad = tail.rfind(_PADDING_KEY)
            if pad >= 0 and _UNSAFE.search(tail, pad + len(_PADDING_KEY), len(tail) - 2) is None:
                tail = tail[: pad + len(_PADDING_KEY)]
                padded = True
        finish = choice.get("finish_reason")
        self._shape = (head, tail, padded, finish if isinstance(finish, str) and finish else None)
        self._learn_tries -= 1

    def _chunk(self, chunk: dict[str, Any], event_name: str | None) -> bool:
        """Apply one parsed chunk; True when it took the text lane (one choice, text only)."""
        choices = chunk.get("choices")
        if (
            self._id is not None
            and not self._cut
            and event_name is None
            and type(choices) is list
            and len(choices) == 1
            and chunk.get("usage") is None
            and chunk.get("error") is None
        ):
            # The bulk of a stream: one choice whose delta carries only text. Same outcome as
            # the general path below, with fewer lookups.
            choice = choices[0]
            if (
                type(choice) is dict
                and choice.get("index") in (0, None)
                and choice.get("usage") is None
            ):
                delta = choice.get("delta")
                if type(delta) is dict and len(delta) == 1:
                    content = delta.get("content")
                    if type(content) is str:
                        self._has_content = True
                        if content:
                            self._content.append(content)
                        finish_reason = choice.get("finish_reason")
                        if isinstance(finish_reason, str) and finish_reason:
                            self._finish_reason = finish_reason
                        if self._model is None:
                            model = chunk.get("model")
                            if isinstance(model, str) and model:
                                self._model = model
                        return True
        error = chunk.get("error")
        if (error or event_name == "error") and self._error is None:
            # (an error event the provider sent is noted)
            self._error = chunk if error else {"error": chunk}
        if error:
            # The SDKs raise on an error that is something: what follows is no part of the
            # client's message. (An ``event: error`` with none in it the Python SDK reads on
            # past as any chunk, its delta too: read as the rest below.)
            usage = chunk.get("usage")  # (billed with it: counted, as the provider bills it)
            if isinstance(usage, dict):
                self._usage.update(usage)
            # OpenRouter's mid-stream error also ends its choice: ``"finish_reason": "error"``
            choices = chunk.get("choices")
            if not self._cut and type(choices) is list and choices and type(choices[0]) is dict:
                reason = choices[0].get("finish_reason")
                if isinstance(reason, str) and reason:
                    self._finish_reason = reason
            self.cut_here()
            return False
        if self._id is None and isinstance(chunk.get("id"), str) and chunk["id"]:
            self._id = chunk["id"]
        tier = chunk.get("service_tier")
        if isinstance(tier, str) and tier:  # (each chunk says it; the last one's is kept)
            self._tier = tier
        if self._model is None and isinstance(chunk.get("model"), str) and chunk["model"]:
            self._model = chunk["model"]
        usage = chunk.get("usage")
        if usage is None:
            # Groq puts a stream's usage in ``x_groq`` when it was not asked for it
            extension = chunk.get("x_groq")
            if isinstance(extension, dict):
                usage = extension.get("usage")
        if usage is not None:
            self._usage.update(usage)
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return False
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index") in (0, None):
                if not self._cut:  # (past an event no SDK reads past: the client has no more)
                    self._choice(choice)
                if usage is None and choice.get("usage") is not None:
                    # Moonshot (Kimi) streams its usage inside the last chunk's choice
                    self._usage.update(choice["usage"])
        return False

    def _choice(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            content = delta.get("content")
            if type(content) is list:  # content parts (Mistral's reasoning models): their text
                content = _text(content)
            if isinstance(content, str):
                self._has_content = True
                if content:
                    self._content.append(content)
            reasoning = _reasoning(delta)
            if reasoning:
                self._reasoning.append(reasoning)
            refusal = delta.get("refusal")
            if isinstance(refusal, str):
                if self._refusal is None:
                    self._refusal = []
                self._refusal.append(refusal)
            audio = delta.get("audio")
            if isinstance(audio, dict):
                if self._audio is None:
                    self._audio = ({}, [])
                fields, transcript = self._audio
                fields.update({k: audio[k] for k in _AUDIO_FIELDS if k in audio})
                if isinstance(audio.get("transcript"), str):
                    transcript.append(audio["transcript"])
            function = delta.get("function_call")
            if isinstance(function, dict):
                if self._function is None:
                    self._function = ([], [])
                for part, key in zip(self._function, ("name", "arguments"), strict=True):
                    value = function.get(key)
                    if isinstance(value, str):
                        part.append(value)
            tool_calls = delta.get("tool_calls")
            if isinstance(tool_calls, list):
                for tool_call in tool_calls:
                    if isinstance(tool_call, dict):
                        self._tools.add(tool_call)
        finish_reason = choice.get("finish_reason")
        if isinstance(finish_reason, str) and finish_reason:
            self._finish_reason = finish_reason

    def result(self) -> AssembledResponse:
        """The assembled message, finish reason, usage and stream facts seen so far."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self._content) if self._has_content else None,
        }
        if self._refusal is not None:
            message["refusal"] = "".join(self._refusal)
        if self._function is not None:
            name, arguments = self._function
            message["function_call"] = {"name": "".join(name), "arguments": "".join(arguments)}
        if self._tools.calls:
            message["tool_calls"] = self._tools.ordered()
        if self._reasoning:
            message["reasoning_content"] = "".join(self._reasoning)
        if self._audio is not None:
            fields, transcript = self._audio
            message["audio"] = {**fields, "transcript": "".join(transcript)}
        return AssembledResponse(
            message=message,
            finish_reason=self._finish_reason,
            usage=self._usage.result(),
            error=self._error,
            done=self._done,
            model=self._model,
            id=self._id,
            service_tier=self._tier,
            events=self._events,
            malformed=self._malformed,
            text_dropped=self._text_dropped,
        )


def _text(content: Any) -> str | None:
    """Message content as text: a string as is, a list of content parts joined by their text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return None


def assemble_completion(body: Mapping[str, Any]) -> AssembledResponse:
    """The same summary for a non-streaming chat completion body (choice index 0).

    Tool calls are normalized to the shape the stream assembler produces, so observers see one
    shape whether the client streamed or not.
    """
    error = body.get("error")
    message: dict[str, Any] = {"role": "assistant", "content": None}
    finish_reason: str | None = None
    choices = body.get("choices")
    first = choices[0] if type(choices) is list and choices else None
    if type(first) is dict and first.get("index") in (0, None):
        choice: Any = first  # the usual answer: one choice, index 0
    else:
        choice = next(
            (
                c
                for c in (choices if isinstance(choices, list) else [])
                if isinstance(c, dict) and c.get("index") in (0, None)
            ),
            None,
        )
    if choice is not None:
        raw = choice.get("message")
        if isinstance(raw, dict):
            message["content"] = _text(raw.get("content"))
            refusal = raw.get("refusal")
            if isinstance(refusal, str):
                message["refusal"] = refusal
            function = raw.get("function_call")
            if isinstance(function, dict):
                message["function_call"] = {
                    key: function[key]
                    for key in ("name", "arguments")
                    if isinstance(function.get(key), str)
                }
            calls = raw.get("tool_calls")
            if calls and isinstance(calls, list):
                tools = _ToolCalls()
                for position, call in enumerate(calls):
                    if isinstance(call, dict):
                        tools.add({**call, "index": position})
                if tools.calls:
                    message["tool_calls"] = tools.ordered()
            reasoning = _reasoning(raw)
            if reasoning:
                message["reasoning_content"] = reasoning
            audio = raw.get("audio")
            if isinstance(audio, dict):
                message["audio"] = {
                    k: audio[k] for k in (*_AUDIO_FIELDS, "transcript") if k in audio
                }
        if isinstance(choice.get("finish_reason"), str) and choice["finish_reason"]:
            finish_reason = choice["finish_reason"]
    model, response_id, tier = body.get("model"), body.get("id"), body.get("service_tier")
    return AssembledResponse(
        message=message,
        finish_reason=finish_reason,
        usage=normalize_usage(body.get("usage")),
        error=dict(body) if error is not None else None,
        done=error is None,
        model=model if isinstance(model, str) and model else None,
        id=response_id if isinstance(response_id, str) and response_id else None,
        service_tier=tier if isinstance(tier, str) and tier else None,
    )


# Past this many bytes of a stream, its text is no longer kept (an upstream that never ends its
# answer, or one line of it, must not take cachegate's memory with it): its usage, finish reason
# and error still are. ~100k output tokens of OpenAI's chunks, ~300 bytes a token with usage
# asked for and the padding.
MAX_RECORDED_STREAM = 32 * 1024 * 1024
# An event not ended past this many bytes, once the text is no longer kept, is let go (a line
# that never ends). A last chunk holding a whole tool call beside the usage can be megabytes.
_MAX_PENDING_EVENT = 16 * 1024 * 1024


class StreamRecorder:
    """The relay's side channel: raw upstream byte chunks in, one ``AssembledResponse`` out.

    Feeding a chunk only keeps it. Chunks are decoded when ``result`` or ``finish`` is asked
    for, which the relay leaves to the observers, after the client has its response, and every
    ``KEEP_BYTES`` of a long stream (counting ``CHUNK_COST`` more per chunk, so that a stream of
    tiny reads is not kept whole either). What is kept is decoded in batches of whole events of
    about ``_BATCH_BYTES``: a batch of events that differ from a learned one only in their text
    (``StreamAssembler.text_shape``) is split off with no Python step per event; other batches
    take the decoder's short path or the general one.

    A body whose first bytes open a JSON object is no event stream, whatever its type says (a
    gateway that labels every answer ``text/event-stream``; the Python SDK reads such a body
    as JSON where it asked for no stream): ``json_body`` is set and its bytes are kept whole in
    ``whole``, up to ``MAX_RECORDED_STREAM`` (None past it), for the relay to read as a body.
    """

    __slots__ = ("_size", "assembler", "chunks", "decoder", "json_body", "recorded", "whole")

    _BATCH_BYTES = 2048
    KEEP_BYTES = 16 * 1024
    CHUNK_COST = 64  # what keeping one chunk costs beyond its bytes, roughly

    def __init__(self) -> None:
        self.decoder = SSEDecoder(sdk_events=True)
        self.assembler = StreamAssembler()
        # The chunks kept since the last decoding. The relay appends to this list itself and
        # calls ``decode`` as ``feed`` would: the same, without a call per chunk.
        self.chunks: list[bytes] = []
        self._size = 0
        self.recorded = 0  # bytes decoded so far
        self.json_body = False  # the body opened a JSON object: no event stream
        self.whole: list[bytes] | None = None  # its bytes (None: not kept, past the limit)

    def feed(self, chunk: bytes) -> None:
        """Take one chunk exactly as the upstream sent it."""
        self.chunks.append(chunk)
        self._size += len(chunk) + self.CHUNK_COST
        if self._size >= self.KEEP_BYTES:
            self.decode()

    def decode(self) -> None:
        """Decode the chunks kept so far (an event they leave unfinished waits for the rest).
        Past ``MAX_RECORDED_STREAM`` bytes, the text is let go (``StreamAssembler.drop_text``)
        after each decoding, with one warning."""
        data = b"".join(self.chunks)
        self.chunks.clear()  # the same list: the relay holds its append
        self._size = 0
        if (not self.recorded or self.json_body) and self._kept_whole(data):
            return
        self.recorded += len(data)
        over = self.recorded > MAX_RECORDED_STREAM
        if over and not self.assembler.text_dropped:
            logger.warning(
                "stream longer than %s bytes: its text not recorded (its usage and finish are)",
                f"{MAX_RECORDED_STREAM:,}",
            )
        start = 0
        while start < len(data):
            # Cut after a blank line, so that batches start between events; when an event was
            # left unfinished, the first batch is only its end.
            ahead = 0 if start == 0 and not self.decoder.idle else self._BATCH_BYTES
            cut = data.find(b"\n\n", start + ahead)
            end = len(data) if cut < 0 else cut + 2
            self._decode_batch(data[start:end])
            start = end
        if over:
            self.assembler.drop_text()
            if self.decoder.pending_bytes > _MAX_PENDING_EVENT:  # a line that never ends
                self.decoder = SSEDecoder(sdk_events=True)

    def _kept_whole(self, data: bytes) -> bool:
        """Whether ``data``, the body's first bytes or what follows them, is no event stream:
        (a piece of) a whole JSON body, kept, not decoded. Only white space so far: kept until
        what opens the body comes."""
        if not self.json_body:
            head = data.lstrip()
            if not head:
                if data:
                    self.chunks.append(data)
                return True
            if head[:1] != b"{":  # (no event stream opens so: its first line would be ignored)
                return False
            self.json_body, self.whole = True, []
        self.recorded += len(data)
        if self.whole is not None:
            self.whole.append(data)
            if self.recorded > MAX_RECORDED_STREAM:
                self.whole = None
        return True

    def _decode_batch(self, data: bytes) -> None:
        shape = self.assembler.text_shape
        if shape is not None and self.decoder.decode_shaped(
            data, *shape, self.assembler.feed_texts
        ):
            return
        payloads = self.decoder.decode_data(data)
        if payloads is not None:
            self.assembler.feed_data(payloads)
            return
        for event in self.decoder.decode(data):
            self.assembler.feed(event)

    def result(self) -> AssembledResponse:
        """The message so far, mid-stream (an event whose blank line has not arrived is left out)."""
        self.decode()
        return self.assembler.result()

    def finish(self) -> AssembledResponse:
        """End of stream (complete or not): decode what is kept, flush, return the result."""
        self.decode()
        cut = not self.decoder.idle
        whole = self.assembler.malformed
        flushed = self.decoder.flush()
        if flushed:
            # An event torn by the stream's end (no blank line after it): the SDKs never
            # dispatch it, so the client's message has none of it; its usage, which the
            # provider bills, is still taken.
            self.assembler.cut_here()
        for event in flushed:
            self.assembler.feed(event)
        result = self.assembler.result()
        result.unfinished = cut and not result.done
        if result.unfinished:  # an event torn by the stream's end is that, not a malformed one
            result.malformed = whole
        return result


def _reasoning(message: Mapping[str, Any]) -> str | None:
    """A message's or delta's reasoning text: ``reasoning_content`` (DeepSeek, vLLM, SGLang),
    else ``reasoning`` (Ollama, OpenRouter, Groq); None when it has none."""
    for key in ("reasoning_content", "reasoning"):
        text = message.get(key)
        if isinstance(text, str) and text:
            return text
    return None


class _JsonScan:
    """How far a call's arguments, arriving in pieces, are a whole JSON value: each piece is
    scanned once, for the brackets outside strings (a call's arguments are an object)."""

    __slots__ = ("depth", "escaped", "in_string", "pieces", "scalar", "started")

    def __init__(self) -> None:
        self.pieces = 0  # pieces scanned
        self.depth = 0
        self.in_string = False
        self.escaped = False  # the last piece ended inside a string, on a backslash
        self.started = False
        self.scalar = False  # the value is no object or array: judged by parsing it all

    def whole(self, pieces: list[str]) -> bool:
        """Whether ``pieces`` (those scanned before, and any more) are a whole JSON value."""
        for piece in pieces[self.pieces :]:
            self._scan(piece)
        self.pieces = len(pieces)
        if self.scalar:
            return _whole_json("".join(pieces))
        return self.started and self.depth == 0 and not self.in_string

    def _scan(self, piece: str) -> None:
        skip = 0 if self.escaped else -1  # the position of a character a backslash escapes
        self.escaped = False
        if not self.started and not self.scalar:
            head = piece.lstrip()
            if head and head[0] not in '{["':  # (a string is scanned too: double-encoded)
                self.scalar = True
        if self.scalar:
            return
        for found in _JSON_MARKS.finditer(piece):
            at = found.start()
            mark = piece[at]
            if self.in_string:
                if at == skip:
                    continue
                if mark == "\\":
                    skip = at + 1
                    self.escaped = skip == len(piece)
                elif mark == '"':
                    self.in_string = False
            elif mark == '"':
                self.in_string = True
                self.started = True
            elif mark in "{[":
                self.depth += 1
                self.started = True
            elif mark in "}]":
                self.depth -= 1


_JSON_MARKS = re.compile(r'["\\{}\[\]]')


def _whole_json(text: str) -> bool:
    """Whether ``text`` is a whole JSON value (a call's arguments all come)."""
    if not text:
        return False
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True
