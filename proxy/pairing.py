"""Tool-pairing diagnosis and repair of a chat-completions message list (pure).

A provider refuses a history in which an assistant ``tool_calls`` message is not followed, before
any other message, by exactly one ``tool`` result per call. Interrupted turns (Ctrl+C while tools
ran), "steer" messages typed between results, stray or repeated results and arguments cut off
mid-stream all break that rule; ``repair_messages`` fixes them deterministically, and ``diagnose``
/ ``format_strict_error`` explain them instead in strict mode.

Matching reads the list once, in order, and decides each ``tool`` message from the messages before
it only. That keeps the repaired form of a prefix stable when the client appends to it: later
messages can only answer a call that was still unanswered (its synthetic result then disappears).

Rules, for a ``tool`` message answering id ``t``: the latest earlier assistant message with a call
``t`` owns it. If that call is still unanswered the result is paired with it — in place when it sits
in the run of ``tool`` messages right after the owner, otherwise it is *displaced* and moved back
into the owner's block. If every call ``t`` of the owner is already answered it is a *duplicate*; if
no earlier call has id ``t`` it is an *orphan*. Duplicates and orphans follow ``orphan_policy``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import operator
import re
from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import orjson

from proxy.prefix import cache_mark, carried_past_prompt, deep_dumps, leading_system_count

logger = logging.getLogger(__name__)

RepairKind = Literal[
    "dangling_call",
    "orphan_result",
    "displaced_result",
    "duplicate_result",
    "invalid_arguments",
    "missing_id",
    "empty_tool_calls",
    "missing_type",
    "duplicate_call_id",
    "empty_assistant",
    "user_after_tool",
    "blank_text",
    "null_result",
]
OrphanPolicy = Literal["downgrade", "drop"]

DEFAULT_INTERRUPTED_NOTE: Final = (
    "[cachegate] This turn was interrupted before a result of the {name} tool was recorded: no "
    "result exists, and the tool may not have run, or may have run only in part. This is not a "
    "tool failure. If the result is still needed, check what the tool would have changed, then "
    "call it again."
)
"""Content of the synthetic result of a dangling call; ``{name}`` becomes the tool's name. A proxy
cannot know whether an interrupted tool ran (Ctrl+C while it wrote a file, a push half done): the
note says what is known, and leads the model to look before it repeats the call."""

DOWNGRADE_PREFIXES: Final = ("[tool result ", "[duplicate tool result ")
"""How the text of every downgraded orphan or duplicate result starts (to recognize cachegate's)."""


@dataclass(frozen=True, slots=True)
class Repair:
    """One defect and what was done about it.

    ``index`` is the position in the *input* list: the assistant message for ``dangling_call``,
    ``invalid_arguments``, ``missing_type`` and ``missing_id`` (whose ``tool_call_id`` is the id
    assigned), the tool
    message for the other kinds, and for ``missing_id`` on a result without an id that was given
    its call's assigned id.
    """

    kind: RepairKind
    index: int
    tool_call_id: str | None
    action: str
    # For ``missing_id`` and ``duplicate_call_id``, in strict mode's words: the id the client
    # sent (a number, a repeated id; None when it sent none), and whether the message is a
    # tool result (else its assistant message)
    sent: Any = None
    result: bool = False
    # For ``duplicate_call_id`` on a call: the id it repeats is an earlier message's call's
    across: bool = False


@dataclass(frozen=True, slots=True)
class PairingResult:
    """The history to forward and the repairs made; ``messages`` is the input list if unchanged."""

    messages: list[dict[str, Any]]
    repairs: list[Repair]

    @property
    def changed(self) -> bool:
        """True when the forwarded history differs from the client's."""
        return bool(self.repairs)


@dataclass(slots=True)
class _Block:
    """An assistant ``tool_calls`` message being paired: its calls and the results found so far."""

    index: int
    ids: list[str]
    names: list[str]
    unanswered: dict[str, list[int]]  # id -> positions of its unanswered calls, ascending
    results: list[int]  # input indices of the tool messages paired with it, in input order
    # ids assigned to calls sent without one and still unanswered, in order (taken from the
    # left as results come: a deque, so that 40,000 of them are not moved up 40,000 times)
    idless: deque[str]
    # id -> the ids given to later calls of this message that had it too, in call order
    renamed: dict[str, deque[str]]
    # the tool messages of its run kept in their place unpaired (orphans or duplicates made
    # user messages) that no result of its has come after yet: one that does goes before them
    kept: list[int] = dataclasses.field(default_factory=list)

    def dangling(self) -> list[int]:
        """Positions of the calls still without a result, in call order."""
        return sorted(p for positions in self.unanswered.values() for p in positions)


# Verdicts on long argument strings, by the string object (kept, so its id stays its own). An
# agent resends its whole history every turn with the very same objects (``resolve_session``
# shares them), and a history that keeps a repaired defect is repaired again every turn: without
# this, every call's arguments in it would be parsed again on every request.
_MEMO_MIN_CHARS: Final = 512
_MEMO_MAX_CHARS: Final = 4 * 1024 * 1024  # in all (4-16 MB held); the oldest go first
_json_verdicts: dict[int, tuple[str, bool]] = {}
_memo_chars = 0


def _valid_json(text: str) -> bool:
    global _memo_chars
    if not _MEMO_MIN_CHARS <= len(text) <= _MEMO_MAX_CHARS // 4:  # short, or would crowd out
        return _parses(text)
    held = _json_verdicts.get(id(text))
    if held is not None and held[0] is text:
        return held[1]
    verdict = _parses(text)
    _json_verdicts[id(text)] = (text, verdict)  # no other string has this id: each is held
    _memo_chars += len(text)
    while _memo_chars > _MEMO_MAX_CHARS:
        old_id = next(iter(_json_verdicts))
        _memo_chars -= len(_json_verdicts.pop(old_id)[0])
    return verdict


def _parses(text: str) -> bool:
    """Whether ``text`` is JSON as the grammar has it. orjson refuses two things the grammar
    allows and providers accept: a lone UTF-16 surrogate escape (``"\\ud83d"``: JavaScript's
    ``JSON.stringify`` of a text cut inside an emoji) and a number beyond a double (``1e400``);
    the standard parser settles those (the text is forwarded as it is, never re-serialized).
    Nesting deeper than orjson's 1,024 levels is not JSON here, whatever the Python: the
    standard parser's own limit followed the recursion limit until 3.12, and none since."""
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit"):
            return False
        try:
            json.loads(text, parse_constant=_not_json)
        except (ValueError, RecursionError):  # and NaN/Infinity; nesting past the stack
            return False
    return True


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _has_id(call: dict[str, Any]) -> bool:
    call_id = call.get("id")
    return isinstance(call_id, str) and call_id != ""


def _number_id(value: Any, mistral: bool = False) -> str | None:
    """An id sent as a JSON number (``"id": 7``, ``"tool_call_id": 7``: a local model's
    template, a hand-built history) written as the string the provider takes; else None. The
    call and its result keep their pairing: each is given the same string (a whole number as
    an integer's digits, ``7.0`` and ``7`` alike, and an integer beyond 64 bits, which the
    parser reads as a double, as that double's). For a Mistral model (``mistral``), nine
    letters and digits, as Mistral requires (``Tool call id was call_… but must be a-z, A-Z,
    0-9, with a length of 9``), and so is any other id sent as a string (a session begun on
    another model: ``call_…``, ``toolu_…``, ``"7"``: the same call's result may have the
    number): the first nine hex digits of its SHA-256. The same id gives the same nine
    wherever it is: a call and its result stay a pair, and every turn's history is rewritten
    alike."""
    if isinstance(value, str):
        return _mistral_id(value) if mistral and _unfit_for_mistral(value) else None
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
    elif isinstance(value, float) and math.isfinite(value):
        text = str(int(value)) if value.is_integer() else repr(value)
    else:
        return None
    return _mistral_id(text) if mistral and _unfit_for_mistral(text) else text


def _mistral_id(text: str) -> str:
    # (not the digits with zeros before them: "7" and "07" would be one id, and a client's
    # own "000000007" too, their results then matched in order, each to another call)
    return hashlib.sha256(text.encode()).hexdigest()[:9]


_MISTRAL_ID: Final = re.compile(r"[A-Za-z0-9]{9}")


def _unfit_for_mistral(value: str) -> bool:
    """An id Mistral refuses: not nine letters and digits (an empty one is a missing id)."""
    return value != "" and _MISTRAL_ID.fullmatch(value) is None


def _missing_type(call: dict[str, Any]) -> bool:
    """A function call without its ``"type": "function"`` (LangChain's Azure integration sends
    these; Azure OpenAI refuses them: "Missing required parameter: …tool_calls[0].type")."""
    return not call.get("type") and isinstance(call.get("function"), dict) and "custom" not in call


def _bad_arguments(call: dict[str, Any]) -> str | None:
    """The arguments text of ``call`` when it is a string that is not valid JSON, else None."""
    function = call.get("function")
    if not isinstance(function, dict):
        return None
    arguments = function.get("arguments")
    if isinstance(arguments, str) and not _valid_json(arguments):
        return arguments
    return None


def _tool_calls(message: Any) -> list[Any] | None:
    """The call list of an assistant message that opens a block (as the provider sees it)."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return None
    calls = message.get("tool_calls")
    return calls if isinstance(calls, list) and calls else None


def _empty_calls(message: Any) -> bool:
    """An assistant message with ``"tool_calls": []``, which OpenAI refuses (some SDKs and
    agents write one on every plain answer)."""
    return (
        isinstance(message, dict)
        and message.get("role") == "assistant"
        and message.get("tool_calls") == []
    )


MISTRAL_NO_ANSWER: Final = "[cachegate] (no answer was recorded)"
"""The content an assistant message cachegate puts in, or finds empty, gets for a Mistral model:
Mistral's validator for its older models' tokenizers (v1 to v3) refuses an assistant message with
neither content nor tool calls (``""`` is none), where OpenAI takes ``""``."""


def _mistral_blank(message: Any) -> bool:
    """An assistant message with no content (``null``, none, ``""``, ``[]``) and no tool calls
    (a legacy ``function_call`` is none to Mistral): Mistral refuses it (``must have either
    content or tool_calls``). Not a prefill the client asked for (``"prefix": true``): its
    text would become the start of the answer."""
    return (
        isinstance(message, dict)
        and message.get("role") == "assistant"
        and not message.get("content")
        and message.get("tool_calls") is None
        and not message.get("prefix")
    )


def _contentless(message: Any) -> bool:
    """An assistant message with no content at all (``null``, or none) and nothing else: no tool
    calls, refusal, legacy ``function_call`` or audio. OpenAI refuses it ("expected a string,
    got null") and takes ``""``; an interrupted stream leaves one (the Vercel AI SDK's current
    versions write ``""`` there)."""
    return (
        isinstance(message, dict)
        and message.get("role") == "assistant"
        and message.get("content") is None
        and message.get("tool_calls") is None
        and not any(message.get(key) for key in ("refusal", "function_call", "audio"))
    )


def _blank_text(content: Any, spaces: bool = True) -> bool:
    """Content that says nothing to Claude: ``null``, ``""``, white space, or a list of
    nothing but text parts of such text (``[]`` too: Claude refuses a text block that is empty
    or white space, as gateways make one of ``""``). Without ``spaces`` (Gemini's reading),
    white space is text."""
    if content is None or (isinstance(content, str) and _no_text(content, spaces)):
        return True
    return isinstance(content, list) and all(
        isinstance(part, dict)
        and part.get("type") == "text"
        and isinstance(part.get("text", ""), str)
        and _no_text(part.get("text", ""), spaces)
        for part in content
    )


def _no_text(text: str, spaces: bool) -> bool:
    """``text`` is none: empty, or (``spaces``) white space only."""
    return not text.strip() if spaces else not text


def _blank(message: Any, spaces: bool = True) -> bool:
    """An assistant message that Claude refuses anywhere but last (``must have non-empty
    content``): content ``null``, none, ``""``, white space, ``[]`` or blank text parts
    (``_blank_text``), and nothing else: no tool calls, refusal, legacy ``function_call``, audio
    or signed reasoning (a gateway makes Claude's thinking blocks of ``reasoning_details`` and
    ``thinking_blocks`` only: a ``reasoning`` or ``reasoning_content`` text, which Ctrl+C in a
    thinking turn leaves, reaches Claude as nothing, and the message empty). Without
    ``spaces`` (Gemini's reading), white space is text and signed reasoning is nothing: Gemini
    refuses a message of no text whatever reasoning it carries (a thought signature goes with
    a text or a call)."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return False
    if not _blank_text(message.get("content"), spaces):
        return False
    refusal = message.get("refusal")
    if refusal and not (isinstance(refusal, str) and not refusal.strip()):  # (a blank one: none)
        return False
    return message.get("tool_calls") is None and not any(
        message.get(key)
        for key in ("function_call", "audio", *(_SIGNED_REASONING_KEYS if spaces else ()))
    )


def _blank_text_in(message: dict[str, Any], spaces: bool = True) -> bool:
    """An assistant message whose content is white space (not ``""``, which gateways leave
    out) or holds a text part of no text but white space, beside what else it says (tool
    calls, text, signed reasoning): a gateway makes each a text block of Claude's, which
    Claude refuses (``text content blocks must be non-empty``). Without ``spaces`` (Gemini's
    reading), a text part of no text at all."""
    content = message.get("content")
    if isinstance(content, str):
        return spaces and content != "" and not content.strip()
    return isinstance(content, list) and any(_blank_part(part, spaces) for part in content)


def _blank_part(part: Any, spaces: bool = True) -> bool:
    if not isinstance(part, dict) or part.get("type") != "text":
        return False
    text = part.get("text", "")
    return isinstance(text, str) and _no_text(text, spaces)


def _without_blank_text(message: dict[str, Any], spaces: bool = True) -> dict[str, Any]:
    """``message`` (``_blank_text_in``) without its blank text: no content where nothing
    else was in it (``""`` beside no calls: OpenAI's form refuses ``null`` there); a
    ``cache_control`` mark of a part taken out goes on the message, unless a part kept or the
    message has one (a breakpoint lost would cost the cache every turn)."""
    content = message.get("content")
    kept = [p for p in content if not _blank_part(p, spaces)] if isinstance(content, list) else []
    fixed = {**message, "content": kept or (None if message.get("tool_calls") else "")}
    gone = [
        p["cache_control"]
        for p in (content if isinstance(content, list) else ())
        if _blank_part(p, spaces) and p.get("cache_control") is not None
    ]
    if gone and cache_mark(fixed, "content") is None:
        fixed["cache_control"] = gone[-1]
    return fixed


NO_OUTPUT: Final = "(no output)"
"""The content a tool result of nothing but blank text parts gets for a Claude model: Claude
refuses an empty text block (``text content blocks must be non-empty``), and an empty result too
(``content cannot be empty``, through some gateways)."""

_PARTS_ROLES: Final = frozenset({"tool", "user", "system", "developer"})


def _blank_parts_to_take(message: Any) -> bool:
    """A tool, user, system or developer message whose content is a list holding a text part
    of no text but white space, which Claude refuses in any message (``text content blocks must
    be non-empty``, an MCP tool that printed nothing, an image sent with an empty caption): a
    tool result whatever else it holds, the others where another part is left (a user or
    system message of nothing but blank parts is the client's to write; it is left as sent)."""
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if not isinstance(content, list) or not any(_blank_part(part) for part in content):
        return False
    role = message.get("role")
    if role == "tool":
        return True
    return role in _PARTS_ROLES and not all(_blank_part(part) for part in content)


def _without_blank_parts(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` (``_blank_parts_to_take``) without its blank text parts; a tool result left
    with none gets ``NO_OUTPUT``; a ``cache_control`` mark of a part taken out goes on the
    message, unless a part kept or the message has one."""
    fixed = _without_blank_text(message)
    if fixed.get("content") in ("", None):
        fixed["content"] = NO_OUTPUT
    return fixed


def _refusal_only(message: Any, spaces: bool = True) -> str | None:
    """The text of an OpenAI model's refusal that an assistant message holds in place of its
    content (``"content": null, "refusal": "I can't help with that."``), with nothing else:
    Claude refuses it as an empty message anywhere but last (``refusal`` is OpenAI's field,
    not Anthropic's), where the refusal is what the model said. None for any other message."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return None
    refusal = message.get("refusal")
    if not isinstance(refusal, str) or not refusal.strip():
        return None
    if not _blank_text(message.get("content"), spaces) or message.get("tool_calls") is not None:
        return None
    signed = _SIGNED_REASONING_KEYS if spaces else ()  # (Gemini's reading: nothing, as above)
    if any(message.get(key) for key in ("function_call", "audio", *signed)):
        return None
    return refusal


def _refusal_content(content: Any, refusal: str) -> Any:
    """The content a refusal's message gets for Claude: its text (without trailing white
    space, which Claude refuses in a last assistant message), in a text part that keeps the
    ``cache_control`` mark one of its blank parts had (a breakpoint lost would cost the cache
    every turn); the message's own mark stays on it."""
    text = refusal.rstrip()
    if isinstance(content, list):
        marks = [
            p["cache_control"] for p in content if isinstance(p, dict) and p.get("cache_control")
        ]
        if marks:
            return [{"type": "text", "text": text, "cache_control": marks[-1]}]
    return text


# Where servers put a model's reasoning in an assistant message (DeepSeek, vLLM and SGLang's
# ``reasoning_content``; OpenRouter's and Ollama's ``reasoning``, ``reasoning_details``;
# LiteLLM's ``thinking_blocks``): a message that holds one says something.
_REASONING_KEYS: Final = ("reasoning_content", "reasoning", "reasoning_details", "thinking_blocks")
# Of those, the ones a gateway gives Claude back as thinking blocks (signed: OpenRouter's
# ``reasoning_details``, LiteLLM's ``thinking_blocks``); Claude never sees the others' text
_SIGNED_REASONING_KEYS: Final = ("reasoning_details", "thinking_blocks")


def _says_nothing(message: dict[str, Any]) -> bool:
    """An assistant message (its empty ``tool_calls`` taken out) with no content, refusal,
    legacy ``function_call``, audio or reasoning."""
    return not message.get("content") and not any(
        message.get(key) for key in ("refusal", "function_call", "audio", *_REASONING_KEYS)
    )


def needs_repair(
    messages: list[dict[str, Any]],
    drop_empty: bool = False,
    mistral: bool = False,
    unique_ids: bool | None = None,
    blank_spaces: bool = True,
) -> bool:
    """Cheap check for every request: True exactly when ``repair_messages`` would change anything
    (with ``drop_empty``: a Claude model's history, in which a blank assistant message is one;
    with ``mistral``: a Mistral model's, in which a user message right after a tool result is
    one). ``unique_ids`` (by default ``drop_empty``): an id a call of an earlier message had is
    one (Claude's rule; a Gemini model's history is read with ``drop_empty`` alone).

    One pass, one small dict of the open block's call ids; only ``arguments`` strings are parsed.
    """
    return needs_repair_from(messages, (), drop_empty, mistral, unique_ids, blank_spaces)[0]


@dataclass(slots=True)
class Checkpoint:
    """Where ``needs_repair`` stood after ``messages`` (which had no defect before their end).
    A value, never mutated (not frozen: a frozen dataclass sets each field through
    ``object.__setattr__``, and one is made per request)."""

    messages: tuple[Any, ...]
    pending: tuple[tuple[str, int], ...]
    in_block: bool
    # Where it stood before the last message: a client that takes a cache_control mark off its
    # last message the next turn sends that one anew (parsed again, another object), and the
    # whole history was checked again every turn.
    before_last: Checkpoint | None = None
    # The call ids of its messages, for a Claude model's check (Claude refuses an id any
    # earlier call of the request has); empty otherwise
    seen: frozenset[str] = frozenset()

    def precedes(self, messages: Sequence[Any]) -> bool:
        """``messages`` starts with the very same objects (an agent's next turn, shared)."""
        n = len(self.messages)
        return n <= len(messages) and all(map(operator.is_, self.messages, messages))


_NO_IDS: Final[frozenset[str]] = frozenset()


def needs_repair_from(
    messages: list[dict[str, Any]],
    checkpoints: Sequence[Checkpoint] = (),
    drop_empty: bool = False,
    mistral: bool = False,
    unique_ids: bool | None = None,
    blank_spaces: bool = True,
) -> tuple[bool, Checkpoint | None, Checkpoint | None]:
    """``needs_repair``, resumed after the first of ``checkpoints`` that ``precedes`` ``messages``:
    the work is in proportion to what was appended. Returns the answer, a checkpoint at the end of
    ``messages`` (None when a defect stopped the scan) and the checkpoint resumed from. The
    checkpoints must have been made with the same ``drop_empty``, ``mistral``, ``unique_ids``
    and ``blank_spaces`` (white space is no text, as Claude reads it; Gemini reads it as
    text)."""
    if unique_ids is None:
        unique_ids = drop_empty
    spaces = blank_spaces
    parts = drop_empty and spaces  # (Claude: blank text parts in any message)
    if parts and any(
        _blank_parts_to_take(m) for m in messages[: leading_system_count(messages)]
    ):  # (a new system prompt is passed over below, unread)
        return True, None, None
    resumed = next(
        (
            c
            for checkpoint in checkpoints
            for c in (checkpoint, checkpoint.before_last)
            if c is not None and c.precedes(messages)
        ),
        None,
    ) or _past_new_prompt(messages, checkpoints)
    pending: dict[str, int] = dict(resumed.pending) if resumed else {}  # id -> results expected
    in_block = resumed.in_block if resumed else False
    # (Claude: every call id so far, an id reused across turns is a defect there)
    seen: set[str] | None = (set(resumed.seen) if resumed else set()) if unique_ids else None
    start = len(resumed.messages) if resumed else 0
    last = len(messages) - 1
    before_last: Checkpoint | None = None
    if resumed is not None and start >= last:  # (a chain of them held no more than one)
        held = resumed if start == last else resumed.before_last
        if held is not None:
            before_last = Checkpoint(held.messages, held.pending, held.in_block, None, held.seen)
    for at, message in enumerate(itertools.islice(messages, start, None), start):
        if at == last and before_last is None:
            before_last = Checkpoint(
                tuple(messages[:at]),
                tuple(pending.items()),
                in_block,
                None,
                _NO_IDS if not seen else frozenset(seen),
            )
        role = message.get("role") if isinstance(message, dict) else None
        if role == "tool":
            tool_call_id = message.get("tool_call_id")
            if not in_block or not isinstance(tool_call_id, str) or tool_call_id not in pending:
                return True, None, resumed
            left = pending.pop(tool_call_id) - 1
            if left:
                pending[tool_call_id] = left
            if message.get("content") is None:
                return True, None, resumed  # (OpenAI: "expected a string, got null")
            if parts and _blank_parts_to_take(message):
                return True, None, resumed  # (Claude: an empty text block)
            continue
        if pending:
            return True, None, resumed
        if in_block and mistral and role == "user":
            return True, None, resumed  # (Mistral: "Unexpected role 'user' after role 'tool'")
        in_block = False
        if role != "assistant":
            if parts and _blank_parts_to_take(message):
                return True, None, resumed  # (Claude: an empty text block)
            continue
        calls = message.get("tool_calls")
        if not isinstance(calls, list):
            if calls is None and (
                _contentless(message)
                or (
                    drop_empty
                    and (
                        _blank(message, spaces)
                        or _refusal_only(message, spaces) is not None
                        or _blank_text_in(message, spaces)
                    )
                )
                or (mistral and _mistral_blank(message))
            ):
                return True, None, resumed
            continue
        if not calls:  # OpenAI refuses an empty array ("empty_array")
            return True, None, resumed
        if drop_empty and _blank_text_in(message, spaces):  # (Claude: an empty text block)
            return True, None, resumed
        in_block = True
        for call in calls:
            if not isinstance(call, dict):
                continue
            call_id = call.get("id")
            if (
                not isinstance(call_id, str)
                or not call_id
                or call_id in pending  # an id repeated in one message
                or (seen is not None and call_id in seen)  # (Claude: or in another)
                or (mistral and _unfit_for_mistral(call_id))  # (Mistral: nine characters)
                or _bad_arguments(call) is not None
                or _missing_type(call)
            ):
                return True, None, resumed
            pending[call_id] = 1
            if seen is not None:
                seen.add(call_id)
    # Calls still open at the end need a repair now, but the next turn's results may close them.
    after = Checkpoint(
        tuple(messages),
        tuple(pending.items()),
        in_block,
        before_last,
        _NO_IDS if not seen else frozenset(seen),
    )
    return bool(pending), after, resumed


def _past_new_prompt(
    messages: Sequence[Any], checkpoints: Sequence[Checkpoint]
) -> Checkpoint | None:
    """Where the check stood after the very same messages past another system prompt (the
    time in it; the bytes before the messages changed), moved to where they are in
    ``messages``: after any system prompt nothing is pending and no block of calls is open,
    so the check stands alike after the same messages that follow it. (Each such turn was
    checked from the start: ~0.2 ms at 400 messages.)"""
    for checkpoint in checkpoints:
        for c in (checkpoint, checkpoint.before_last):
            if c is None:
                continue
            n = carried_past_prompt(c.messages, messages)
            if n:
                start = leading_system_count(messages)
                return Checkpoint(tuple(messages[: start + n]), c.pending, c.in_block, None, c.seen)
    return None


def _derived_id(index: int, position: int, call: dict[str, Any], mistral: bool = False) -> str:
    """A stable id for a call sent without one, from its position (``index`` counted past the
    leading system messages: one added or dropped there, an environment message, leaves every
    id, and the prefix the provider cached, as it was) and its canonical JSON (for a Mistral
    model nine letters and digits: Mistral refuses any other, ``Tool call id was … but must be
    a-z, A-Z, 0-9, with a length of 9``)."""
    canonical = deep_dumps(call, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    digest = hashlib.sha256(f"{index}.{position}:{canonical}".encode()).hexdigest()
    return digest[:9] if mistral else "call_" + digest[:24]


def _tool_name(call: dict[str, Any]) -> str:
    function = call.get("function")
    if not isinstance(function, dict):
        function = call.get("custom")  # a custom tool's call
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) and name else "unknown"


def orphan_label(tool_call_id: str | None) -> str:
    """The text a downgraded orphan result starts with (a chat tool message's, a Responses API
    output item's)."""
    shown = f"for call {tool_call_id}" if tool_call_id is not None else "without a tool_call_id"
    return f"[tool result {shown} (no matching tool call)]"


def _downgrade(message: dict[str, Any], label: str) -> dict[str, Any]:
    """A user message carrying a tool message's content under ``label``, so nothing is lost,
    and its ``cache_control`` breakpoint (a Claude-style client marks its latest message: the
    mark gone, that turn asked nothing of the cache). Blank text parts are left out (a tool
    that printed nothing, as parts: beside the label, Claude refuses an empty text block on
    every later turn, ``text content blocks must be non-empty``), a mark of theirs going on
    the message."""
    content = message.get("content")
    new_content: str | list[Any]
    gone: list[Any] = []  # (the marks of blank parts left out)
    if content is None or content == "":
        new_content = label
    elif isinstance(content, str):
        new_content = f"{label}\n{content}"
    elif isinstance(content, list):
        new_content = [{"type": "text", "text": label}]
        for part in content:
            if not _blank_part(part):
                new_content.append(part)
            elif part.get("cache_control") is not None:
                gone.append(part["cache_control"])
    else:
        dumped = deep_dumps(content, sort_keys=True, ensure_ascii=False)
        new_content = f"{label}\n{dumped}"
    downgraded: dict[str, Any] = {"role": "user", "content": new_content}
    mark = message.get("cache_control")
    if mark is not None:
        downgraded["cache_control"] = mark
    elif gone and cache_mark(downgraded, "content") is None:
        downgraded["cache_control"] = gone[-1]
    return downgraded


def _fix_calls(
    index: int,
    message: dict[str, Any],
    calls: list[Any],
    repairs: list[Repair],
    mistral: bool = False,
    earlier: Container[str] | None = None,
    past: int = 0,
) -> tuple[dict[str, Any], list[str], list[str], list[str], dict[str, deque[str]]]:
    """Assign missing ids, new ids to repeats of an id in the message (and, given ``earlier``,
    the ids of earlier messages' calls: a Claude model's history), types and blank invalid
    arguments; copies the message only when it changes. Returns the message, its calls' ids
    and names, the ids it assigned, and the ids given to repeats (by the id they repeated)."""
    ids: list[str] = []
    seen: set[str] = set()  # (``ids`` as a set: a message of 40,000 calls took 8 s, the loop's)
    names: list[str] = []
    assigned: list[str] = []
    renamed: dict[str, deque[str]] = {}
    new_calls: list[Any] | None = None
    for position, call in enumerate(calls):
        if not isinstance(call, dict):
            continue
        fixed = call
        number = _number_id(call.get("id"), mistral)
        if not _has_id(call) and number is None:
            call_id = _derived_id(index - past, position, call, mistral)
            assigned.append(call_id)
            fixed = {**call, "id": call_id}
            repairs.append(
                Repair(
                    "missing_id", index, call_id, f"assigned id {call_id} to tool_calls[{position}]"
                )
            )
        else:
            call_id = call["id"] if number is None else number
            across = earlier is not None and call_id not in seen and call_id in earlier
            if call_id in seen or across:
                # Claude refuses a request whose tool_use ids repeat ("tool_use ids must be
                # unique"), in one message or across turns (clients that number calls per
                # message: call_0 every turn); its results are then matched in order
                # (``_pair_result``)
                repeated, call_id = call_id, _derived_id(index - past, position, call, mistral)
                renamed.setdefault(repeated, deque()).append(call_id)
                fixed = {**call, "id": call_id}
                repairs.append(
                    Repair(
                        "duplicate_call_id",
                        index,
                        call_id,
                        f"gave tool_calls[{position}] the id {call_id}: "
                        + (
                            "a call of an earlier assistant message"
                            if across
                            else "an earlier call of this message"
                        )
                        + f" has {repeated}",
                        sent=repeated,
                        across=across,
                    )
                )
            elif number is not None:
                fixed = {**call, "id": call_id}
                was = "Mistral takes no other" if isinstance(call["id"], str) else "it was a number"
                repairs.append(
                    Repair(
                        "missing_id",
                        index,
                        call_id,
                        f'wrote the id of tool_calls[{position}] as a string, "{call_id}" ({was})',
                        sent=call["id"],
                    )
                )
        if _missing_type(call):
            fixed = {**fixed, "type": "function"}
            repairs.append(
                Repair(
                    "missing_type",
                    index,
                    call_id,
                    f'set "type": "function" on tool_calls[{position}]',
                )
            )
        bad = _bad_arguments(call)
        if bad is not None:
            fixed = {**fixed, "function": {**call["function"], "arguments": "{}"}}
            repairs.append(
                Repair(
                    "invalid_arguments",
                    index,
                    call_id,
                    f"replaced arguments that are not valid JSON (likely truncated, {len(bad)} "
                    'chars) with "{}"',
                )
            )
        if fixed is not call:
            if new_calls is None:
                new_calls = list(calls)
            new_calls[position] = fixed
        ids.append(call_id)
        seen.add(call_id)
        names.append(_tool_name(call))
    if new_calls is None:
        return message, ids, names, assigned, renamed
    return {**message, "tool_calls": new_calls}, ids, names, assigned, renamed


def repair_messages(
    messages: list[dict[str, Any]],
    *,
    orphan_policy: OrphanPolicy = "downgrade",
    interrupted_note: str = DEFAULT_INTERRUPTED_NOTE,
    drop_empty: bool = False,
    mistral: bool = False,
    unique_ids: bool | None = None,
    blank_spaces: bool = True,
) -> PairingResult:
    """Return a history every call of which is answered right after it, and what was repaired.

    Deterministic and idempotent; the input is never mutated and unchanged messages are the same
    objects. With nothing to repair the input list itself comes back, with no repairs. An empty
    ``interrupted_note`` means the default one.
    """
    result, _ = repair_messages_from(
        messages,
        None,
        orphan_policy=orphan_policy,
        interrupted_note=interrupted_note,
        drop_empty=drop_empty,
        mistral=mistral,
        unique_ids=unique_ids,
        blank_spaces=blank_spaces,
    )
    return result


@dataclass(slots=True)
class RepairState:
    """Where ``repair_messages`` stood after ``messages`` (by object), to resume from.

    A history that keeps a repaired defect (an interrupted turn) is repaired again on every
    request; the next request resends the same message objects plus a few. Their repair is final
    unless an appended result answers a call left open in them (then a result moves back and a
    synthetic one goes away): ``repair_messages_from`` resumes only when none does.
    """

    messages: tuple[Any, ...]
    # (orphan policy, note, drop_empty, mistral, unique_ids, blank_spaces) the repair was made with
    policy: tuple[str, str, bool, bool, bool, bool]
    blocks: dict[int, _Block]
    owner_of_id: dict[str, _Block]
    paired: set[int]
    removed: set[int]
    fixed: dict[int, dict[str, Any]]
    scanned: list[Repair]  # found message by message, in order
    dangling: list[Repair]  # calls left without a result, block by block
    run: _Block | None
    out: tuple[Any, ...]  # the repaired history of ``messages``
    # the cache_control marks of removed messages (empty assistant messages), by index: each
    # goes on the message before it in the repaired history, which ends the same prefix
    marks: dict[int, Any] = field(default_factory=dict)
    # where each message (as sent, or its ``fixed`` entry) is in ``out`` (-1: removed), so
    # that one sent anew can take its place
    at: list[int] = field(default_factory=list)

    def resumes(
        self, messages: Sequence[Any], policy: tuple[str, str, bool, bool, bool, bool]
    ) -> list[int] | None:
        """Whether ``messages`` extends this state's messages, with the same policy, and appends
        no result for a call still open in them: None when not, else the indexes of its
        messages sent anew (the ones to put in ``out`` in their place). A system block of as
        many messages in place of theirs (the time in the system prompt) still does: nothing in
        a system block is repaired (but a Claude model's blank text parts, repaired afresh),
        and nothing is pending after one (``repair_messages_from``
        puts it in). So do a few messages sent anew, equal but for their ``cache_control``
        marks (a client that moves its mark each turn), that the repair left as they were."""
        done = len(self.messages)
        if policy != self.policy or len(messages) < done:
            return None
        anew: list[int] = []
        if not all(map(operator.is_, self.messages, messages)):
            same = list(map(operator.is_, self.messages, messages))
            system = leading_system_count(self.messages)
            at = same.index(False)
            if at < system:  # another system block
                if system == done or leading_system_count(messages) != system:
                    return None
                if self.marks:  # (a mark moved onto the old system block: repaired afresh)
                    return None
                if (
                    policy[2]
                    and policy[5]
                    and (  # (Claude: blank text parts, read afresh)
                        any(i in self.fixed for i in range(system))
                        or any(_blank_parts_to_take(m) for m in messages[:system])
                    )
                ):
                    return None
                at = _next_false(same, system)
            while at < done:
                if len(anew) == _MOST_SENT_ANEW or not self._takes_anew(at, messages[at]):
                    return None
                anew.append(at)
                at = _next_false(same, at + 1)
        owner_of_id = self.owner_of_id
        appended_ids: set[str] = set()  # calls of appended blocks: theirs, not earlier ones
        for message in itertools.islice(messages, done, None):
            if isinstance(message, dict) and message.get("role") == "tool":
                call_id = message.get("tool_call_id")
                if (call_id is None or call_id == "") and self.run is not None and self.run.idless:
                    return None  # it may answer a call sent without an id: repair afresh
                # (a number: its string, as a call's; for Mistral, a string of a few digits too)
                mapped = _number_id(call_id, policy[3])
                if mapped is not None or not isinstance(call_id, str):
                    call_id = mapped
                if call_id is None or call_id in appended_ids:
                    continue
                owner = owner_of_id.get(call_id)
                if owner is not None and (
                    owner.unanswered.get(call_id) or owner.renamed.get(call_id)
                ):
                    return None  # it may answer an earlier call: repair afresh
                continue
            calls = _tool_calls(message)
            if calls is not None:
                for call in calls:
                    if isinstance(call, dict):
                        call_id = _number_id(call.get("id"), policy[3])
                        if call_id is None and _has_id(call):
                            call_id = call.get("id")
                        if call_id is not None:
                            appended_ids.add(call_id)
        return anew

    def _takes_anew(self, index: int, message: Any) -> bool:
        """Whether ``message``, sent in the place of message ``index``, can take its place in
        ``out`` as it is: the old one is there as it was sent, no removed message's mark went
        (or did not go) on anything, and they differ in their cache marks only (all the repair
        reads of them is the same)."""
        position = self.at[index] if index < len(self.at) else -1
        was = self.messages[index]
        entry = self.fixed.get(index, was)
        return (
            position >= 0
            and self.out[position] is entry
            and not self.marks  # (a removed message's mark went, or not, on what came before
            # it in ``out``, which is not what came before it in the history: repaired afresh)
            and _same_but_marks(was, message)
            and (entry is was or _fix_of(was, entry) is not None)
        )

    def take_anew(self, index: int, message: dict[str, Any]) -> Any:
        """What ``out`` holds for ``message`` sent anew for message ``index``
        (``_takes_anew``): itself, or the same fix made to it (its call ids renamed, say)."""
        was = self.messages[index]
        entry = self.fixed.get(index)
        if entry is None:
            return message
        fix = _fix_of(was, entry)
        assert fix is not None  # (``_takes_anew``)
        renewed = {k: fix.get(k, v) for k, v in message.items() if k in entry or k not in fix}
        renewed.update((k, v) for k, v in entry.items() if k in fix and k not in message)
        self.fixed[index] = renewed
        return renewed


_MOST_SENT_ANEW: Final = 8  # (more: a history edited, repaired afresh)
_MISSING: Final = object()


def _fix_of(was: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any] | None:
    """The keys the repair set on message ``was`` to make ``entry`` (a key it took out:
    ``_MISSING``), when none of them is one a cache mark is in or the message's role (its
    content left as it was): the same fix is then made to the same message with its marks
    moved. None otherwise."""
    fix = {
        k: entry.get(k, _MISSING)
        for k in entry.keys() | was.keys()
        if entry.get(k, _MISSING) is not was.get(k, _MISSING)
    }
    if "content" in fix or "cache_control" in fix or "role" in fix:
        return None
    return fix


def _next_false(flags: list[bool], start: int) -> int:
    """The index of the first False in ``flags`` from ``start``, or its length."""
    try:
        return flags.index(False, start)
    except ValueError:
        return len(flags)


def _without_mark(item: Any) -> Any:
    if isinstance(item, dict) and "cache_control" in item:
        return {k: v for k, v in item.items() if k != "cache_control"}
    return item


def _same_but_marks(old: Any, new: Any) -> bool:
    """Whether two messages are equal but for ``cache_control`` on them or their content's
    parts."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return False
    if old.keys() - {"cache_control"} != new.keys() - {"cache_control"}:
        return False
    for key, value in new.items():
        if key == "cache_control":
            continue
        was = old[key]
        if value == was:
            continue
        if key != "content" or not isinstance(value, list) or not isinstance(was, list):
            return False
        if len(value) != len(was) or any(
            a != b and _without_mark(a) != _without_mark(b) for a, b in zip(was, value, strict=True)
        ):
            return False
    return True


def repair_messages_from(
    messages: list[dict[str, Any]],
    previous: RepairState | None,
    *,
    orphan_policy: OrphanPolicy = "downgrade",
    interrupted_note: str = DEFAULT_INTERRUPTED_NOTE,
    drop_empty: bool = False,
    mistral: bool = False,
    unique_ids: bool | None = None,
    blank_spaces: bool = True,
) -> tuple[PairingResult, RepairState | None]:
    """``repair_messages``, resumed from ``previous`` when ``messages`` extends its messages
    (``RepairState.resumes``): the work is in proportion to what was appended. Returns the result
    and the state to resume the next request from (None when nothing needed repair). ``previous``
    is taken over: do not use it again. With ``drop_empty`` (a Claude model's history), an
    assistant message with no content and nothing else in it is removed, not given ``""``:
    Claude refuses an empty assistant message anywhere but last, and joins the user turns
    around it. With ``mistral`` (a Mistral model's history), a user message right after a tool
    result (the user's own, a downgraded orphan's) gets an assistant message before it
    (``MISTRAL_BRIDGE``: Mistral refuses ``Unexpected role 'user' after role 'tool'``; a system
    message there is left, as Mistral refuses one after an assistant's too), and an id cachegate
    gives a call is nine letters and digits, as Mistral requires. ``unique_ids`` (by default
    ``drop_empty``): a call whose id an earlier message's call had gets another (Claude's rule;
    a Gemini model's history is repaired with ``drop_empty`` alone). Without ``blank_spaces``
    (Gemini's reading), white space is text: only what has none is blank."""
    note = interrupted_note or DEFAULT_INTERRUPTED_NOTE
    if unique_ids is None:
        unique_ids = drop_empty
    spaces = blank_spaces
    parts = drop_empty and spaces  # (Claude: blank text parts in any message)
    policy = (orphan_policy, note, drop_empty, mistral, unique_ids, spaces)
    anew = previous.resumes(messages, policy) if previous is not None else None
    if previous is not None and anew is not None:
        state = previous
        start = len(previous.messages)
        system = leading_system_count(messages)
        if not all(map(operator.is_, previous.messages[:system], messages[:system])):
            # Another system block (``resumes``): its messages in the place of the old ones,
            # which no repair touched (the repaired history starts with them, as they were).
            state.out = (*messages[:system], *state.out[system:])
        if anew:  # (messages sent anew, their marks moved: each in the old one's place)
            renewed = list(state.out)
            for index in anew:
                renewed[state.at[index]] = state.take_anew(index, messages[index])
            state.out = tuple(renewed)
    else:
        if not needs_repair(messages, drop_empty, mistral, unique_ids, spaces):
            return PairingResult(messages, []), None
        state = RepairState((), policy, {}, {}, set(), set(), {}, [], [], None, (), {}, [])
        start = 0
    blocks, owner_of_id, fixed = state.blocks, state.owner_of_id, state.fixed
    past = leading_system_count(messages)  # (derived ids counted past them: ``_derived_id``)
    paired, removed, scanned = state.paired, state.removed, state.scanned
    run = state.run  # block whose run of tool messages we are in

    for i in range(start, len(messages)):
        message = messages[i]
        if isinstance(message, dict) and message.get("role") == "tool":
            _pair_result(
                i,
                message,
                run,
                owner_of_id,
                orphan_policy,
                paired,
                removed,
                fixed,
                scanned,
                state.marks,
                mistral,
            )
            if i in paired and (entry := fixed.get(i, message)).get("content") is None:
                # A tool that returned nothing (None), its result written as null or without
                # content: every provider refuses it ("expected a string, got null")
                given = NO_OUTPUT if parts else ""  # (Claude: not "", as ``blank_text``)
                fixed[i] = {**entry, "content": given}
                action = f"gave a result of no content the content {json.dumps(given)}"
                scanned.append(Repair("null_result", i, entry.get("tool_call_id"), action))
            elif parts and i in paired and _blank_parts_to_take(entry := fixed.get(i, message)):
                fixed[i] = _without_blank_parts(entry)
                action = "removed blank text parts (Claude refuses an empty text block)"
                if fixed[i]["content"] == NO_OUTPUT:
                    action = f'gave a result of blank text parts "{NO_OUTPUT}" (Claude refuses an'
                    action += " empty text block)"
                scanned.append(Repair("blank_text", i, entry.get("tool_call_id"), action))
            continue
        run = None
        calls = _tool_calls(message)
        if calls is None:
            if _empty_calls(message):
                kept = {k: v for k, v in message.items() if k != "tool_calls"}
                if drop_empty and (_says_nothing(kept) or _blank(kept, spaces)):
                    # Nothing else in it: Claude refuses an empty assistant message but the last
                    # ("must have non-empty content"); elsewhere it stays, given "" below (as
                    # for ``empty_assistant``: removed, two user turns met, which strict chat
                    # templates refuse, Gemma's, Llama 2's, Mistral 7B's on vLLM or llama.cpp)
                    removed.add(i)
                    action = "removed an assistant message with nothing but an empty tool_calls"
                    mark = cache_mark(message, "content")  # (its own, or its last part's)
                    if mark is not None:  # a breakpoint: the message before ends that prefix
                        state.marks[i] = mark
                else:
                    refusal = _refusal_only(kept, spaces) if drop_empty or mistral else None
                    if refusal is not None:  # (Claude, Mistral: the refusal's words, as below)
                        kept["content"] = _refusal_content(kept.get("content"), refusal)
                    elif drop_empty and _blank_text_in(kept, spaces):  # (Claude: as below)
                        kept = _without_blank_text(kept, spaces)
                    elif mistral and _mistral_blank(kept):
                        kept["content"] = MISTRAL_NO_ANSWER  # (Mistral refuses "" there)
                    elif kept.get("content") is None or kept.get("content") == []:
                        kept["content"] = ""  # (OpenAI refuses null and [] there alike)
                    fixed[i] = kept
                    action = "removed an empty tool_calls array"
                scanned.append(Repair("empty_tool_calls", i, None, action))
            elif drop_empty and _blank(message, spaces):
                removed.add(i)
                action = (
                    "removed an assistant message with no content (Claude refuses an empty one)"
                )
                mark = cache_mark(message, "content")  # (its own, or its last blank part's)
                if mark is not None:  # a breakpoint: the message before ends that prefix
                    state.marks[i] = mark
                scanned.append(Repair("empty_assistant", i, None, action))
            elif (drop_empty or mistral) and (
                refusal := _refusal_only(message, spaces)
            ) is not None:
                # An OpenAI model's refusal in a history sent to Claude or Mistral: its words
                # are the message's content (neither reads ``refusal``, and both refuse an
                # empty message; Mistral's note would say no answer was recorded).
                fixed[i] = {**message, "content": _refusal_content(message.get("content"), refusal)}
                action = "gave a refusal's text as the assistant message's content"
                scanned.append(Repair("empty_assistant", i, None, action))
            elif drop_empty and _role(message) == "assistant" and _blank_text_in(message, spaces):
                fixed[i] = _without_blank_text(message, spaces)
                action = "removed blank text parts (Claude refuses an empty text block)"
                scanned.append(Repair("empty_assistant", i, None, action))
            elif mistral and _mistral_blank(message):
                fixed[i] = {**message, "content": MISTRAL_NO_ANSWER}
                action = (
                    "gave an assistant message with no content a note (Mistral refuses an empty"
                    " one)"
                )
                scanned.append(Repair("empty_assistant", i, None, action))
            elif parts and _role(message) != "assistant" and _blank_parts_to_take(message):
                fixed[i] = _without_blank_text(message)
                action = "removed blank text parts (Claude refuses an empty text block)"
                scanned.append(Repair("blank_text", i, None, action))
            elif _contentless(message):
                # Given an empty content, not removed: the turns keep alternating (chat
                # templates that require it refuse two user messages in a row), and what else
                # it holds (a cut stream's reasoning, a cache mark) stays where it was.
                fixed[i] = {**message, "content": ""}
                action = "gave an assistant message with no content an empty one"
                scanned.append(Repair("empty_assistant", i, None, action))
            continue
        new_message, ids, names, assigned, renamed = _fix_calls(
            i, message, calls, scanned, mistral, owner_of_id if unique_ids else None, past
        )
        if drop_empty and _blank_text_in(new_message, spaces):
            new_message = _without_blank_text(new_message, spaces)
            action = "removed blank text beside the calls (Claude refuses an empty text block)"
            scanned.append(Repair("empty_assistant", i, None, action))
        if new_message is not message:
            fixed[i] = new_message
        unanswered: dict[str, list[int]] = {}
        for position, call_id in enumerate(ids):
            unanswered.setdefault(call_id, []).append(position)
        run = blocks[i] = _Block(i, ids, names, unanswered, [], deque(assigned), renamed)
        for call_id in ids:
            owner_of_id[call_id] = run
        for call_id in renamed:  # (an id of an earlier message's, renamed here: its results
            owner_of_id[call_id] = run  # after this message are this one's, in order)
    state.run = run

    # Blocks before ``start`` are as they were: no appended result answered one (``resumes``).
    for index in itertools.islice(blocks, _first_block_at(blocks, start), None):
        block = blocks[index]
        for position in block.dangling():
            call_id, name = block.ids[position], block.names[position]
            state.dangling.append(
                Repair(
                    "dangling_call", block.index, call_id, f"added a synthetic result for {name}"
                )
            )
    if not scanned and not state.dangling and not mistral:
        return PairingResult(messages, []), None
    out = list(state.out)
    marks = state.marks
    at = state.at
    at.extend(itertools.repeat(-1, len(messages) - len(at)))
    for i in range(start, len(messages)):
        if (
            mistral
            and out
            and i not in paired
            and i not in removed
            and isinstance(out[-1], dict)
            and out[-1].get("role") == "tool"
            and _role(fixed.get(i, messages[i])) == "user"
        ):
            out.append(dict(MISTRAL_BRIDGE))
            scanned.append(
                Repair(
                    "user_after_tool",
                    i,
                    None,
                    "inserted an assistant message before it (Mistral refuses a user"
                    " message right after a tool result)",
                )
            )
        if i in paired or i in removed:
            mark = marks.get(i) if marks else None
            if (
                mark is not None
                and out
                and isinstance(out[-1], dict)  # (not a message: the provider refuses it)
                and cache_mark(out[-1], "content") is None
            ):
                out[-1] = {**out[-1], "cache_control": mark}
                _say_mark_moved(scanned, i)
            continue
        at[i] = len(out)
        out.append(fixed.get(i, messages[i]))
        own = blocks.get(i)
        if own is None:
            continue
        for j in own.results:
            at[j] = len(out)
            out.append(fixed.get(j, messages[j]))
        for position in own.dangling():
            call_id, name = own.ids[position], own.names[position]
            note_text = note.replace("{name}", name)
            out.append({"role": "tool", "tool_call_id": call_id, "content": note_text})
    if not scanned and not state.dangling:  # (Mistral's check found nothing either)
        return PairingResult(messages, []), None
    state.messages = tuple(messages)
    state.out = tuple(out)
    # Found message by message, then the dangling calls, in index order (a stable sort).
    repairs = sorted([*scanned, *state.dangling], key=operator.attrgetter("index"))
    logger.debug("repaired %d pairing defects in %d messages", len(repairs), len(messages))
    return PairingResult(out, repairs), state


MISTRAL_BRIDGE: Final = {"role": "assistant", "content": MISTRAL_NO_ANSWER}
"""The assistant message put between a tool result and a user message for a Mistral model: its
content not empty (Mistral's validator for its older models' tokenizers, v1 to v3, refuses an
assistant message with neither content nor tool calls)."""


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def _say_more(repairs: list[Repair], index: int, more: str, action: str = "") -> None:
    """The latest repair of message ``index`` (whose action starts with ``action``) says
    ``more``."""
    for at in range(len(repairs) - 1, -1, -1):
        repair = repairs[at]
        if repair.index == index and repair.action.startswith(action):
            repairs[at] = dataclasses.replace(repair, action=repair.action + more)
            return


def _say_mark_moved(scanned: list[Repair], index: int) -> None:
    """The repair of removed message ``index`` says its ``cache_control`` mark was moved."""
    _say_more(scanned, index, " (its cache_control moved to the message before)")


def _say_moved_after(repairs: list[Repair], block: _Block) -> None:
    """The repairs of ``block.kept``, the tool messages of its run kept as user messages, say
    that they now follow its results: a result of its came after them, and went before them
    with the others (the move was said nowhere)."""
    moved = f", moved after the results of messages[{block.index}]"
    for index in block.kept:
        _say_more(repairs, index, moved, "kept as a user message")
    block.kept.clear()


def _first_block_at(blocks: dict[int, _Block], start: int) -> int:
    """How many of ``blocks`` (in index order) are before message ``start``."""
    if not start:
        return 0
    for after, index in enumerate(reversed(blocks)):  # appended blocks are few: count back
        if index < start:
            return len(blocks) - after
    return 0


def _pair_result(
    i: int,
    message: dict[str, Any],
    run: _Block | None,
    owner_of_id: dict[str, _Block],
    orphan_policy: OrphanPolicy,
    paired: set[int],
    removed: set[int],
    fixed: dict[int, dict[str, Any]],
    repairs: list[Repair],
    marks: dict[int, Any],
    mistral: bool = False,
) -> None:
    """Decide tool message ``i``: pair it with its call, or handle it as a duplicate or orphan
    (one dropped leaves its ``cache_control`` mark, if any, in ``marks``; ``mistral``: a number
    id is written as its call's is for a Mistral model).

    Some servers (Gemini's OpenAI-compatible API, some local ones) send tool calls with an empty
    id, and their clients answer with an empty ``tool_call_id``. Such a result, in the run of
    results right after its calls, answers the first call of the run still unanswered that came
    without an id, and is given the id assigned to that call: matched by order, as such a server
    does. Anywhere else it answers nothing (an orphan)."""
    raw_id = message.get("tool_call_id")
    while (raw_id is None or raw_id == "") and run is not None and run.idless:
        call_id = run.idless.popleft()
        positions = run.unanswered.get(call_id)  # an assigned id is its call's only
        if not positions:
            continue  # answered by its assigned id, by a client that knew it
        del run.unanswered[call_id]
        fixed[i] = {**message, "tool_call_id": call_id}
        repairs.append(
            Repair(
                "missing_id",
                i,
                call_id,
                f"gave the result the id {call_id} of its call",
                None,
                True,
            )
        )
        run.results.append(i)
        paired.add(i)
        if run.kept:
            _say_moved_after(repairs, run)
        return
    number = _number_id(raw_id, mistral)
    tool_call_id = number if number is not None else raw_id if isinstance(raw_id, str) else None
    owner = owner_of_id.get(tool_call_id) if tool_call_id is not None else None
    if owner is not None and tool_call_id is not None:
        positions = owner.unanswered.get(tool_call_id)
        if positions:
            positions.pop(0)
            if not positions:
                del owner.unanswered[tool_call_id]
            if owner is not run:
                repairs.append(
                    Repair(
                        "displaced_result",
                        i,
                        tool_call_id,
                        f"moved back into the results of messages[{owner.index}]",
                    )
                )
            if number is not None:
                fixed[i] = {**message, "tool_call_id": number}
                repairs.append(
                    Repair(
                        "missing_id",
                        i,
                        number,
                        f'wrote the tool_call_id of the result as a string, "{number}" ('
                        + (
                            "Mistral takes no other"
                            if isinstance(raw_id, str)
                            else "it was a number"
                        )
                        + ")",
                        raw_id,
                        True,
                    )
                )
            owner.results.append(i)
            paired.add(i)
            if owner.kept:
                _say_moved_after(repairs, owner)
            return
        repeats = owner.renamed.get(tool_call_id) or deque()
        while repeats:  # the next call of its message that repeated the id, renamed: in order
            new_id = repeats.popleft()
            if owner.unanswered.pop(new_id, None) is None:
                continue
            fixed[i] = {**message, "tool_call_id": new_id}
            repairs.append(
                Repair(
                    "duplicate_call_id",
                    i,
                    new_id,
                    f"gave the result the id {new_id} of its call",
                    tool_call_id,
                    True,
                )
            )
            if owner is not run:
                repairs.append(
                    Repair(
                        "displaced_result",
                        i,
                        new_id,
                        f"moved back into the results of messages[{owner.index}]",
                    )
                )
            owner.results.append(i)
            paired.add(i)
            if owner.kept:
                _say_moved_after(repairs, owner)
            return
        kind: RepairKind = "duplicate_result"
        label = f"[duplicate tool result for call {tool_call_id}]"
    else:
        kind = "orphan_result"
        label = orphan_label(tool_call_id)
    if orphan_policy == "drop":
        removed.add(i)
        mark = cache_mark(message, "content")
        if mark is not None:  # a breakpoint: the message before ends that prefix
            marks[i] = mark
        repairs.append(Repair(kind, i, tool_call_id, "dropped"))
    else:
        fixed[i] = _downgrade(message, label)
        repairs.append(Repair(kind, i, tool_call_id, "kept as a user message"))
        if run is not None:  # (its run's results after it go before it: ``_say_moved_after``)
            run.kept.append(i)


def diagnose(
    messages: list[dict[str, Any]],
    drop_empty: bool = False,
    mistral: bool = False,
    unique_ids: bool | None = None,
    blank_spaces: bool = True,
) -> list[Repair]:
    """What ``repair_messages`` would repair, changing nothing: strict mode's list of defects."""
    return repair_messages(
        messages,
        drop_empty=drop_empty,
        mistral=mistral,
        unique_ids=unique_ids,
        blank_spaces=blank_spaces,
    ).repairs


_DESCRIPTIONS: Final[dict[str, str]] = {
    "dangling_call": "messages[{index}] assistant tool_call {id} has no result",
    "orphan_result": "messages[{index}] tool result for {id} answers no tool call",
    "displaced_result": (
        "messages[{index}] tool result for {id} is separated from the tool_calls it answers"
    ),
    "duplicate_result": "messages[{index}] tool result for {id} repeats an earlier result",
    "invalid_arguments": "messages[{index}] assistant tool_call {id} has invalid JSON arguments",
    "missing_id": "messages[{index}] assistant tool_call has no id (repair would assign {id})",
    "empty_tool_calls": "messages[{index}] assistant message has an empty tool_calls array",
    "missing_type": 'messages[{index}] assistant tool_call {id} has no "type"',
    "duplicate_call_id": (
        "messages[{index}] assistant tool_calls repeat the id {sent} (repair would give the"
        " repeat {id})"
    ),
    "empty_assistant": "messages[{index}] assistant message has no content and no tool_calls",
    "user_after_tool": (
        "messages[{index}] user message follows a tool result with no assistant message between"
        " (Mistral refuses it)"
    ),
    "blank_text": (
        "messages[{index}] has a text part of no text (Claude refuses an empty text block)"
    ),
    "null_result": "messages[{index}] tool result for {id} has no content (null or none)",
}


# Where ``missing_id`` and ``duplicate_call_id`` differ: a number sent as an id, a tool result's
_NUMBER_ID: Final = (
    'messages[{index}] assistant tool_call id is a number, {sent} (repair would write it as "{id}")'
)
_ON_RESULTS: Final[dict[str, str]] = {
    "missing_id": (
        "messages[{index}] tool result has no tool_call_id (repair would give it {id}, its call's)"
    ),
    "duplicate_call_id": (
        "messages[{index}] tool result for {sent} answers a call whose id repeats an earlier"
        " call's (repair would give it {id})"
    ),
}
_NUMBER_RESULT_ID: Final = (
    "messages[{index}] tool result's tool_call_id is a number, {sent} (repair would write it as"
    ' "{id}")'
)


_MISTRAL_ID_TEXT: Final = (
    "messages[{index}] assistant tool_call id {sent} is not nine letters and digits (Mistral"
    ' refuses it; repair would write it as "{id}")'
)
_MISTRAL_RESULT_ID: Final = (
    "messages[{index}] tool result's tool_call_id {sent} is not nine letters and digits"
    ' (Mistral refuses it; repair would write it as "{id}")'
)


_ACROSS_TURNS: Final = (
    "messages[{index}] assistant tool_call repeats the id {sent} of an earlier assistant"
    " message's call (Claude refuses it; repair would give it {id})"
)


def _describe(r: Repair) -> str:
    if r.kind == "missing_id" and isinstance(r.sent, str):  # (Mistral's nine characters)
        text = _MISTRAL_RESULT_ID if r.result else _MISTRAL_ID_TEXT
    elif r.kind == "missing_id" and r.sent is not None:
        text = _NUMBER_RESULT_ID if r.result else _NUMBER_ID
    elif r.kind == "duplicate_call_id" and r.across:
        text = _ACROSS_TURNS
    elif r.result and r.kind in _ON_RESULTS:
        text = _ON_RESULTS[r.kind]
    else:
        text = _DESCRIPTIONS[r.kind]
    return text.format(index=r.index, id=r.tool_call_id or "(no id)", sent=r.sent) + f" ({r.kind})"


def format_strict_error(repairs: list[Repair]) -> str:
    """One error message naming every defect with its message index and tool_call_id (the id
    the client sent, and the one repair would give it, where they differ)."""
    count = len(repairs)
    parts = [_describe(r) for r in repairs]
    head = f"cachegate strict pairing: {count} defect{'' if count == 1 else 's'}"
    return f"{head}: {'; '.join(parts)}" if parts else head
