"""Compaction of long histories: the split point, the summary prompt, the extractive fallback and
sticky substitution (pure).

The lead wires one upstream call (the summarizer) around these functions; everything here is values
in, values out. How the pieces compose on every request (``plan`` does steps 1–3):

1. ``apply_compaction(client_messages, existing)``: if the session already holds a compaction whose
   covered prefix the client resent unchanged, substitute it (byte-identical every time, so the
   provider's prefix cache keeps hitting). ``None`` means the user rewound or forked before the
   covered prefix: forget that compaction and treat the request afresh.
2. ``should_compact(...)`` on what would be forwarded: the provider's numbers for the previous
   exchange plus an estimate of what the client appended, or the estimate of the whole history when
   there are no provider numbers.
3. ``find_cut(client_messages, ...)`` over the CLIENT history, never over a substituted one. When a
   compaction already applies, the new cut must extend its covered prefix; only
   ``messages[existing.covered:cut.end]`` is new material and the existing summary text goes in as
   ``previous_summary`` (rolling compaction).
4. The caller sends ``build_summary_request(middle, ...)`` upstream; on any failure it falls back to
   ``extractive_summary(middle, ...)``. Compaction never breaks a session.
5. ``build_compaction(client_messages, cut, text, source=...)`` gives the ``Compaction`` to store
   for the session; ``apply_compaction`` with it gives the list to forward.

``is_context_length_error`` recognizes the provider's refusal so the caller can compact (``plan``
with ``force=True``) and retry once.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

import orjson

from proxy.media import image_tokens
from proxy.pipeline import clip_words, key_run
from proxy.prefix import (
    MEDIA_PART_TYPES,
    canonical_json,
    json_size,
    request_tools,
    volatile_kind,
)

Message = dict[str, Any]
Source = Literal["model", "extractive"]

# Starts every summary message cachegate writes; also how cachegate recognizes its own summaries.
SUMMARY_MARKER = "[cachegate summary]"
# Labels of messages cachegate itself injects. The caller adds pairing's labels (the synthetic
# "interrupted" result text, the downgraded-orphan label) through ``synthetic_prefixes``.
DEFAULT_SYNTHETIC_PREFIXES: tuple[str, ...] = (SUMMARY_MARKER,)

# Characters per token of canonical JSON, and tokens of framing per message (role, separators).
BYTES_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4

LEADING_ROLES = frozenset({"system", "developer"})

# Chained prefix digests start from this value, so the digest of an empty prefix is well defined.
GENESIS_DIGEST = hashlib.sha256(b"cachegate-compaction-prefix-v1").hexdigest()

ROLLING_INSTRUCTION = (
    "A previous summary of the conversation before this transcript is given below. Copy its still "
    "relevant parts verbatim into your new summary (keep the quoted task exactly), drop only what "
    "the transcript shows is obsolete, and add what the transcript adds."
)

SUMMARIZER_SYSTEM_PROMPT = """\
You compact the history of an AI agent's working session. The agent will continue the work with \
your summary in place of the messages you are shown, so anything you leave out is lost to it.

Write the summary in exactly these sections, in this order, with these headings:

## Task
The user's request(s), quoted in the user's own words as "> " block quotes. Do not paraphrase; \
quote the latest request in full.

## Done
What has been completed so far, with the concrete results (what was changed, what passed).

## Left
What remains to be done, in order, as a numbered list. Say which step was in progress.

## Files and commands
Every file path, command, URL, identifier and error message that matters, verbatim, in backticks.

## Decisions and dead ends
Choices made and why; approaches that were tried and failed, and why, so they are not repeated.

Rules: do not invent anything that is not in the transcript; if something is unclear, say so. Do \
not call tools. Do not address the user; write notes for the agent. Be concise but complete."""

_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
_PATH_KEYS = frozenset(
    {"path", "paths", "file", "files", "file_path", "filepath", "filename", "target_file", "dir"}
)
_COMMAND_KEYS = frozenset({"command", "cmd", "commands", "script", "shell_command"})
_FILE_EXTENSIONS = (
    "py|pyi|js|jsx|ts|tsx|mjs|cjs|json|jsonl|toml|yaml|yml|ini|cfg|conf|md|rst|txt|csv|html|css|"
    "scss|sh|bash|zsh|go|rs|java|kt|c|h|cc|cpp|hpp|cs|rb|php|swift|sql|lock|xml|proto|tf|env|"
    "ipynb|vue|svelte|dockerfile|mk|gradle"
)
# Paths: anchored ones (/x, ./x, ../x, ~/x), slash paths ending in a file name with an extension,
# and bare file names with a known extension. Not URLs: the lookbehind refuses "://" tails.
_PATH_RE = re.compile(
    r"(?<![\w/.:@~-])"
    r"(?:"
    r"(?:~|\.{1,2})?/(?:[\w.@+-]+/)*[\w.@+-]+"
    r"|(?:[\w.@+-]+/)+[\w@+-]+\.[A-Za-z0-9]+"
    rf"|[\w-]+(?:\.[\w-]+)*\.(?:{_FILE_EXTENSIONS})(?![\w])"
    r")"
)
_FENCE_RE = re.compile(r"```(?:bash|sh|shell|console|zsh|terminal)[^\n]*\n(.*?)```", re.DOTALL)


UNSERVED: Final = "compactions_unserved"
"""A session's ``extra`` key: the prefix digests of the compactions made that no request has
had an answer with yet (a retry of one refused with a 500 misses as that one did)."""


class LastUsage(NamedTuple):
    """What the compaction trigger keeps of a session's last answered exchange: the provider's
    count of it, the client history it was of (its length, first and last message: a turn of
    another conversation is not counted on the numbers of this one; and the messages
    themselves, ``sent``: one changed in place since, an old tool output cleared, makes the
    count another history's), the compaction it went out with (its prefix digest, or None) and
    its tools."""

    prompt: int
    completion: int
    messages: int  # how many the client sent
    head: Any
    tail: Any
    compaction: str | None
    tools: Any
    sent: Sequence[Any] = ()


def same_message(a: Any, b: Any) -> bool:
    """The same message: the very object (an agent's next turn resends its history as the
    objects cachegate holds), an equal one, or one that differs only by its ``cache_control``
    marks (clients that mark their latest messages move the marks on every turn: the previous
    request's last message comes back unmarked, and the provider's numbers for the history it
    ended were dropped every turn, the trigger left to the estimate)."""
    return a is b or a == b or unmarked(a) == unmarked(b)


def _unchanged(messages: list[Any], sent: Sequence[Any], count: int) -> bool:
    """Whether ``messages[1 : count - 1]`` are those of ``sent`` (the very objects, as a
    continued body holds them, or equal ones; a system message retimed, as the first may be:
    a second one with the time or the environment in it); True where ``sent`` was not kept."""
    if len(sent) != count:
        return not sent
    return all(
        same_message(messages[i], sent[i]) or retimed(messages[i], sent[i])
        for i in range(1, count - 1)
    )


def retimed(new: Any, old: Any) -> bool:
    """Two system prompts that differ only by a volatile token, the current time in it: the
    same conversation, whose provider numbers still count (another system prompt is another
    conversation's: a title request opening with the task)."""
    if not (isinstance(new, dict) and isinstance(old, dict)):
        return False
    role = new.get("role")
    if type(role) is not str or role not in LEADING_ROLES or role != old.get("role"):
        return False
    before, after = message_text(old), message_text(new)
    return volatile_kind(before, after) is not None


def carries_on(messages: list[Any], last: LastUsage, *, between: bool = True) -> bool:
    """Whether ``messages`` carries on the history ``last`` was counted for: its first message
    (or it retimed), its last at the same place, and (``between``) those between unchanged
    (``_unchanged``)."""
    count = last.messages
    return (
        0 < count <= len(messages)
        and (same_message(messages[0], last.head) or retimed(messages[0], last.head))
        and same_message(messages[count - 1], last.tail)
        and (not between or _unchanged(messages, last.sent, count))
    )


@dataclass(frozen=True, slots=True)
class Cut:
    """A split of a client history: ``messages[:start]`` are the leading system/developer
    messages, kept unchanged; ``messages[start:end]`` is the middle to compact; ``messages[end:]``
    is the kept tail."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Compaction:
    """A session's sticky compaction: the summary ``message`` replaces ``messages[start:covered]``
    of every later client history whose first ``covered`` messages hash to ``prefix_digest``."""

    prefix_digest: str
    covered: int
    start: int
    message: Message
    source: Source
    tokens_before: int
    tokens_after: int
    # The digest of the history's opening (its leading messages and the first after them): the
    # caller keeps a session's compactions by it, and tries for a history only those that
    # opened as it did (a sub-agent's history neither gets the main agent's nor undoes it).
    opening: str = ""


# A summarizer's answer may run this much over the length asked for before it is cut: models
# miss a word count by a little (the plan reserves the length asked for; the margin between a
# compaction's aim and the trigger takes the rest).
SUMMARY_OVERRUN = 1.25


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do with one request (see ``plan``).

    ``messages`` is what to forward when no new compaction is made (the client history, or the
    history with ``reused`` substituted). ``discarded`` is true when the session's compaction no
    longer matches (rewind or fork): drop it from the session. ``cut`` (over the client history) is
    set when a new compaction should be made: summarize ``middle``, passing ``previous_summary``.
    ``triggered``: the history reached the trigger (or ``force``), whether or not a cut was found.
    ``overrun``: how far past the length asked for a model's summary may run before it is cut
    (none for a retry after a refusal, which is planned on the length asked for, to the token).
    ``room``: where set, the bytes left for the summary beside what the compaction keeps, less
    than the length it would be asked for: it is asked for and cut at that (overrun none).
    """

    messages: list[Message]
    reused: Compaction | None
    discarded: bool
    cut: Cut | None
    middle: list[Message]
    previous_summary: str | None
    triggered: bool = False
    overrun: float = SUMMARY_OVERRUN
    room: int = 0


# --- estimates and trigger ------------------------------------------------------------------


def body_estimate(body: Any) -> int:
    """``estimate_tokens`` of a chat request body's messages and tools (0 for no body)."""
    if not isinstance(body, dict):
        return 0
    messages, tools = body.get("messages"), request_tools(body)  # (legacy ``functions`` too)
    estimate = estimate_tokens(messages) if isinstance(messages, list) else 0
    return estimate + (estimate_tokens(tools) if isinstance(tools, list) else 0)


def estimate_tokens(obj: Any) -> int:
    """A cheap deterministic token estimate: bytes of compact JSON / 4, rounded up.

    A list is taken as a message list: each element is estimated alone and gets
    ``MESSAGE_OVERHEAD_TOKENS`` for its framing. Four bytes per token over-counts JSON punctuation
    and escapes a little, which is the safe side for a trigger. An image (or audio, or a file)
    part counts what ``media_part_tokens`` says, not its base64: a 1 MB screenshot is ~1,000
    tokens to a provider, not the 250,000 its bytes would say.
    """
    if isinstance(obj, list):
        return sum(_json_tokens(m) + MESSAGE_OVERHEAD_TOKENS for m in obj)
    return _json_tokens(obj)


# What a media part of unknown size costs at most, roughly: Anthropic's ~1,600 tokens for 1.15
# megapixels, OpenAI's 765-1,105 for a high-detail image of usual sizes (an inline image's size
# is read: ``proxy.media``).
MEDIA_PART_TOKENS = 1600


def _json_tokens(obj: Any, media: frozenset[str] = MEDIA_PART_TYPES) -> int:
    """One element's estimate: its compact JSON's bytes, a part of a type in ``media`` counted
    at what ``media_part_tokens`` says instead, any other media part (``MEDIA_PART_TYPES``) by
    its bytes but no less than ``MEDIA_PART_TOKENS``."""
    size = json_size(obj)  # (a message nested deeper than orjson writes failed the estimate)
    content = obj.get("content") if isinstance(obj, dict) else None
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in MEDIA_PART_TYPES:
                if kind in media:
                    size += media_part_tokens(part) * BYTES_PER_TOKEN - json_size(part)
                else:
                    size += max(0, MEDIA_PART_TOKENS * BYTES_PER_TOKEN - json_size(part))
    return -(-max(size, 0) // BYTES_PER_TOKEN)


_IMAGE_PART_TYPES: Final = frozenset({"image_url", "input_image", "image"})


def image_weighed_tokens(obj: Any) -> int:
    """``estimate_tokens`` of one tool or message with its images alone counted by their size
    (``media_part_tokens``), a file or audio part by its bytes, but no less than
    ``MEDIA_PART_TOKENS`` (one by URL or file id has few bytes): a document of unknown pages
    counted at a flat 1,600 tokens, where a PDF of 25 pages is ~50,000, made a share of the
    prompt weighed so read the rest of it as 80% where it was 12%."""
    return _json_tokens(obj, _IMAGE_PART_TYPES)


# OpenAI's price of an image sent with "detail": "low", whatever its size
LOW_DETAIL_IMAGE_TOKENS = 85


def media_part_tokens(part: Any) -> int:
    """What an image, audio or file part of a message is estimated to cost: an inline image's
    tokens by its size (``proxy.media.image_tokens``: a 1280 x 800 screenshot 1,105, a 320 x 200
    one 255), ``LOW_DETAIL_IMAGE_TOKENS`` for an image sent with ``"detail": "low"``, else
    ``MEDIA_PART_TOKENS``."""
    if isinstance(part, dict):
        tokens = image_tokens(part)
        if tokens is not None:
            return tokens
        image = part.get("image_url")
        detail = image.get("detail") if isinstance(image, dict) else part.get("detail")
        if detail == "low":
            return LOW_DETAIL_IMAGE_TOKENS
    return MEDIA_PART_TOKENS


def should_compact(
    *,
    window: int,
    trigger_percent: float,
    last_prompt: int | None,
    last_completion: int | None,
    appended_estimate: int,
    full_estimate: int,
    asked: int = 0,
) -> bool:
    """True when the request would fill ``trigger_percent`` of the context ``window`` or more,
    or leave less of it than the ``asked`` completion (``max_completion_tokens``: most
    providers count it in the window with the prompt and refuse past it, and the rest cut the
    answer short there). A completion that fills the window by itself is not counted: no
    history would fit beside it, and a provider that counts the prompt alone serves it (it
    compacted every history however short, a summary paid every turn).

    Provider numbers come first: the previous exchange's prompt + completion plus the estimate of
    what the client appended since (the previous reply is already in ``last_completion``).
    ``full_estimate`` (the whole history) is used only without provider numbers, i.e. on a
    session's first request or after the numbers stopped describing the history (a rewind).
    """
    if window <= 0:
        raise ValueError(f"context window must be positive, got {window}")
    if not 0 < trigger_percent <= 100:
        raise ValueError(f"trigger_percent must be in (0, 100], got {trigger_percent}")
    if last_prompt is not None:
        used = last_prompt + (last_completion or 0) + appended_estimate
    else:
        used = full_estimate
    return used * 100 >= window * trigger_percent or (0 < asked < window and used + asked >= window)


# --- message helpers ------------------------------------------------------------------------


def message_text(message: Message) -> str:
    """The text of a message's ``content``: a string, or the text parts of a part list joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, dict) and _is_text_part(part) and isinstance(part.get("text"), str)
        ]
        return "\n".join(texts)
    return ""


def _is_text_part(part: dict[str, Any]) -> bool:
    kind = part.get("type")  # (a list or an object there is no text: not hashed)
    return type(kind) is str and kind in _TEXT_PART_TYPES


def content_chars(message: Message) -> int:
    """Characters of a message's content, counting tool-call names and arguments too (that is
    where an assistant message's weight is)."""
    total = len(message_text(message))
    for call in _tool_calls(message):
        total += len(_call_name(call)) + len(_call_arguments(call))
    return total


def is_synthetic(message: Message, prefixes: Sequence[str] = DEFAULT_SYNTHETIC_PREFIXES) -> bool:
    """True for messages cachegate wrote itself: its summaries and injected notes (pass pairing's
    labels in ``prefixes``). Such a message is never the user's launching message."""
    text = message_text(message)
    return any(text.startswith(prefix) for prefix in prefixes if prefix)


def _tool_calls(message: Message) -> list[dict[str, Any]]:
    if not isinstance(message, dict):  # (null, a number: the provider's to refuse)
        return []
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return []
    return [c for c in calls if isinstance(c, dict)]


def _call_body(call: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """A tool call's named part and the field of its input: ``function`` and ``arguments``, or
    a custom tool's ``custom`` and ``input`` (OpenAI's free-form tools: ``apply_patch``)."""
    function = call.get("function")
    if isinstance(function, dict):
        return function, "arguments"
    custom = call.get("custom")
    if isinstance(custom, dict):
        return custom, "input"
    return None, "arguments"


def _call_name(call: dict[str, Any]) -> str:
    body, _ = _call_body(call)
    name = body.get("name") if body is not None else None
    return name if isinstance(name, str) else ""


def _call_arguments(call: dict[str, Any]) -> str:
    body, field = _call_body(call)
    arguments = body.get(field) if body is not None else None
    if isinstance(arguments, str):
        return arguments
    if arguments is None:
        return ""
    return orjson.dumps(arguments).decode()


# --- the cut --------------------------------------------------------------------------------


def find_cut(
    messages: Sequence[Message],
    *,
    keep_recent: int,
    max_anchor_chars: int,
    synthetic_prefixes: Sequence[str] = DEFAULT_SYNTHETIC_PREFIXES,
) -> Cut | None:
    """Where to split ``messages`` for compaction, or None when the middle would hold < 2 messages.

    The tail keeps at least ``keep_recent`` messages. The cut is pulled back to the last real
    (non-synthetic) user message, the one that launched the current task, so that it survives
    verbatim — unless the tail would then hold more than ``max_anchor_chars`` characters of content.
    Where that message opens the conversation (fewer than two messages before it to compact), it
    is kept with the leading messages instead, unless it alone holds more than
    ``max_anchor_chars``, and the middle starts after it.
    The tail never starts with a ``tool`` message and never holds a result whose call is compacted:
    the cut moves earlier so the whole pair is kept.
    """
    if keep_recent < 1:
        raise ValueError(f"keep_recent must be at least 1, got {keep_recent}")
    n = len(messages)
    start = leading_count(messages)
    end = n - keep_recent
    if end - start < 2:
        return None

    anchor = _last_real_user(messages, start, synthetic_prefixes)
    if anchor is not None and anchor < end:
        if _pair_safe(messages, anchor, start) - start >= 2:
            tail_chars = sum(content_chars(m) for m in messages[anchor:])
            if tail_chars <= max_anchor_chars:
                end = anchor
        elif content_chars(messages[anchor]) <= max_anchor_chars:
            # The launching message opens the conversation (one task, then its tool loop, the
            # usual agent session): it stays verbatim with the leading messages, however long
            # the rounds after it, which are compacted.
            start = anchor + 1

    end = _pair_safe(messages, end, start)
    if end - start < 2:
        return None
    return Cut(start, end)


def launching_message(
    messages: Sequence[Message], prefixes: Sequence[str] = DEFAULT_SYNTHETIC_PREFIXES
) -> int | None:
    """The index of the message that launched the current task (``find_cut``'s anchor): the
    latest user message that is the user's, past the leading system/developer ones."""
    return _last_real_user(messages, leading_count(messages), prefixes)


def _last_real_user(messages: Sequence[Message], start: int, prefixes: Sequence[str]) -> int | None:
    """The latest user message that is the user's: not cachegate's own, and not a screenshot a
    tool loop sends as a user message of images (or other media) alone (browser agents)."""
    for i in range(len(messages) - 1, start - 1, -1):
        message = messages[i]
        if (
            message.get("role") == "user"
            and not _media_only(message)
            and not is_synthetic(message, prefixes)
        ):
            return i
    return None


def _media_only(message: Message) -> bool:
    """Whether a message's content is parts none of which is text (images, audio, files)."""
    content = message.get("content")
    return (
        isinstance(content, list)
        and bool(content)
        and not any(isinstance(part, dict) and _is_text_part(part) for part in content)
    )


def _pair_safe(messages: Sequence[Message], end: int, floor: int) -> int:
    """Move ``end`` earlier until no tool result in ``messages[end:]`` answers a call before it
    and ``messages[end]`` is not a ``tool`` message (an orphan result stays with what precedes
    it)."""
    n = len(messages)
    # The assistant message that declared each call id, as seen by the results that follow it.
    owner_of_id: dict[str, int] = {}
    earliest_owner = [n] * (n + 1)  # earliest owner among the tool results in messages[i:]
    owners: list[int] = [n] * n
    for i, message in enumerate(messages):
        for call in _tool_calls(message):
            call_id = call.get("id")
            if isinstance(call_id, str):
                owner_of_id[call_id] = i
        if isinstance(message, dict) and message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            if isinstance(call_id, str) and call_id in owner_of_id:
                owners[i] = owner_of_id[call_id]
    for i in range(n - 1, -1, -1):
        earliest_owner[i] = min(owners[i], earliest_owner[i + 1])
    while end > floor:
        if messages[end].get("role") == "tool":
            end -= 1
        elif earliest_owner[end] < end:
            end = earliest_owner[end]
        else:
            break
    return end


# --- the summary ----------------------------------------------------------------------------


def build_summary_request(
    middle: Sequence[Message],
    *,
    previous_summary: str | None,
    model: str,
    max_tool_chars: int = 2000,
    max_chars: int | None = None,
    words: int | None = None,
) -> dict[str, Any]:
    """A chat-completions body (no tools, not streamed) asking ``model`` to summarize ``middle``.

    Tool calls and results are rendered as text so the summarizer needs no tools; tool outputs
    longer than ``max_tool_chars`` keep their head and tail with a note of what was cut, and a
    transcript longer than ``max_chars`` keeps its head and tail likewise. With a
    ``previous_summary`` the compaction is rolling: the old summary goes in with the instruction
    to copy its still relevant parts verbatim. ``words``: the length to ask for.
    """
    parts: list[str] = []
    if previous_summary is not None:
        parts += [
            ROLLING_INSTRUCTION,
            "",
            "<previous_summary>",
            previous_summary,
            "</previous_summary>",
            "",
        ]
    transcript = render_transcript(middle, max_tool_chars=max_tool_chars)
    parts += [
        f"Summarize the following {len(middle)} messages of the session, as instructed.",
        "",
        "<transcript>",
        _clip_middle(transcript, max_chars) if max_chars is not None else transcript,
        "</transcript>",
    ]
    if words is not None:
        parts += ["", f"Keep the summary under about {words} words."]
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": SUMMARIZER_SYSTEM_PROMPT},
            {"role": "user", "content": "\n".join(parts)},
        ],
        "stream": False,
    }


_NON_TEXT: Final = "[non-text content omitted]"


def render_transcript(messages: Sequence[Message], *, max_tool_chars: int = 2000) -> str:
    """Messages as readable text: one block per message, tool calls as ``name(arguments)``."""
    names = _call_names(messages)
    blocks: list[str] = []
    for i, message in enumerate(messages):
        role = str(message.get("role", "?"))
        text = message_text(message)
        media = isinstance(message.get("content"), list) and any(
            isinstance(p, dict) and not _is_text_part(p) for p in message["content"]
        )
        if role == "tool":  # (a screenshot tool's result is an image: no blank result)
            call_id = str(message.get("tool_call_id", ""))
            header = f"[{i}] tool result of {names.get(call_id, '?')} (id {call_id}):"
            said = [_clip_middle(text, max_tool_chars)] if text or not media else []
            blocks.append("\n".join([header, *said, *([_NON_TEXT] if media else [])]))
            continue
        lines = [f"[{i}] {role}:"]
        if text:
            lines.append(text)
        if media:
            lines.append(_NON_TEXT)
        for call in _tool_calls(message):
            arguments = _clip_middle(_call_arguments(call), max_tool_chars)
            lines.append(f"-> tool call {_call_name(call)}({arguments}) (id {call.get('id', '')})")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _call_names(messages: Iterable[Message]) -> dict[str, str]:
    names: dict[str, str] = {}
    for message in messages:
        for call in _tool_calls(message):
            call_id = call.get("id")
            if isinstance(call_id, str):
                names[call_id] = _call_name(call)
    return names


def _clip_middle(text: str, limit: int) -> str:
    """Keep the head and the tail (where errors and test results land) of a long text, neither
    cut inside a key (``_clip``)."""
    if len(text) <= limit:
        return text
    head = limit * 3 // 4
    start = len(text) - (limit - head)  # where the tail begins
    run = key_run(text, head)
    if run is not None:
        head = run[0]
    run = key_run(text, start) if start < len(text) else None
    if run is not None:
        start = run[1]
    omitted = start - head
    return f"{text[:head]}\n[… {omitted} characters omitted by cachegate …]\n{text[start:]}"


def _clip(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters, never cut inside a key (``clip_words``): an
    extractive summary is logged and replayed, and a key's piece is one the log's redaction no
    longer knows (38 characters of a Google key's 39 were written)."""
    return text if len(text) <= limit else clip_words(text, max(limit - 1, 0))


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


EXTRACTIVE_HEADER = "(Extractive skeleton of the compacted messages, built without a model.)"
_PREVIOUS = "## Previous summary\n"
_TASK = "## Task (the user's words)\n"
_STEPS = "## Steps\n"
_FILES = "## Files\n"
_COMMANDS = "## Commands\n"
_TASKS_OMITTED = re.compile(r"\((\d+) of the user's messages omitted\)")
_STEPS_OMITTED = re.compile(r"- \((\d+) earlier steps omitted\)")


def summary_chars(window: int) -> int:
    """How long a summary may be for a model with a context ``window`` (tokens): an eighth of
    the window, between 1,000 and 12,000 characters. The extractive summary keeps to it and the
    summarizer is asked to; the cut counts on it when it judges whether a compaction fits."""
    return max(1000, min(12000, window * BYTES_PER_TOKEN // 8))


def clip_summary(text: str, max_chars: int) -> str:
    """A model-written summary at most ``max_chars`` long: a longer one (a verbose or echoing
    summarizer) is cut at the end of a line where one is near, else of a word, and says so.
    Used as it came, it could leave the compacted history over the window, and every later
    turn with it."""
    if len(text) <= max_chars:
        return text
    note = f"\n[… summary cut by cachegate: {len(text):,} characters, over the room for it]"
    keep = text[: max(0, max_chars - len(note))]
    line_end = keep.rfind("\n")
    if line_end >= len(keep) * 3 // 4:
        keep = keep[:line_end]
    elif not text[len(keep) : len(keep) + 1].isspace():  # (inside a word: to its start)
        word_end = max(keep.rfind(" "), keep.rfind("\t"))
        if word_end >= len(keep) * 9 // 10:
            keep = keep[:word_end]
    return keep.rstrip() + note


@dataclass(slots=True)
class _Skeleton:
    """The parts of an extractive summary, as built or as read back from an earlier one."""

    previous: str | None = None  # a model-written summary it carries along
    tasks: list[str] = field(default_factory=list)  # the user's messages, quoted
    tasks_omitted: int = 0
    steps: list[str] = field(default_factory=list)
    steps_omitted: int = 0
    files: dict[str, None] = field(default_factory=dict)  # insertion-ordered sets
    commands: dict[str, None] = field(default_factory=dict)


def _read_skeleton(text: str) -> _Skeleton | None:
    """An extractive summary's parts, so that a rolling one extends them rather than nesting
    the whole (each layer cut to half of the last: the user's later instructions fell out);
    None for any other text: a model's summary, also one that copied the skeleton's header
    (every line after the Task heading must be one the skeleton writes)."""
    if not text.startswith(EXTRACTIVE_HEADER):
        return None
    head, found, body = text.rpartition("\n\n" + _TASK)  # quotes start "> ": never a heading
    if not found:
        return None
    skeleton = _Skeleton()
    if head.startswith(EXTRACTIVE_HEADER + "\n\n" + _PREVIOUS):
        skeleton.previous = head[len(EXTRACTIVE_HEADER + "\n\n" + _PREVIOUS) :]
    elif head != EXTRACTIVE_HEADER:
        return None
    task, _, rest = body.partition("\n\n" + _STEPS)  # lines below start "- ": no heading
    steps, found, rest = rest.partition("\n\n" + _FILES)
    if found:
        files, _, commands = rest.partition("\n\n" + _COMMANDS)
    else:
        files = ""
        steps, _, commands = steps.partition("\n\n" + _COMMANDS)
    for block in task.split("\n\n"):
        if (omitted := _TASKS_OMITTED.fullmatch(block)) is not None:
            skeleton.tasks_omitted += int(omitted.group(1))
        elif all(line.startswith(">") or line == "…" for line in block.split("\n")):
            skeleton.tasks.append(block)  # (``…``: a quote the length cut after a line end)
        elif block != "(none)":
            return None
    for line in steps.splitlines():
        if (omitted := _STEPS_OMITTED.fullmatch(line)) is not None:
            skeleton.steps_omitted += int(omitted.group(1))
        elif line.startswith("- "):
            skeleton.steps.append(line)
        elif line != "(none)" and not line.endswith("…"):  # (a last line the length cut)
            return None
    for section, into in ((files, skeleton.files), (commands, skeleton.commands)):
        for line in section.splitlines():
            if line.startswith("- `") and line.endswith("`"):
                into.setdefault(line[3:-1], None)
            elif not line.endswith("…"):
                return None
    return skeleton


def extractive_summary(
    middle: Sequence[Message],
    *,
    previous_summary: str | None,
    max_chars: int = 12000,
    synthetic_prefixes: Sequence[str] = DEFAULT_SYNTHETIC_PREFIXES,
    fits: Callable[[str], bool] | None = None,
) -> str:
    """A deterministic skeleton of ``middle`` built without a model, at most ``max_chars`` long,
    and the longest that ``fits`` accepts where it is given and refuses that one (a room in
    bytes, which text in Chinese fills in a third of its characters), 200 characters at least.

    Sections: a model-written previous summary (rolling), the user's messages quoted, the steps
    (assistant first lines, each tool call as ``name(args…) -> first line of its result``), then
    the file paths and shell commands found, verbatim. A previous summary that is itself such a
    skeleton is extended, section by section, not nested. When too long, the user's first
    message and the latest ones are kept (the ones between are counted), and the earliest steps
    go first.
    """
    results = {  # (a result of media alone, a screenshot, is named so, not left blank)
        str(m.get("tool_call_id")): message_text(m)
        or ("(non-text result)" if _media_only(m) else "")
        for m in middle
        if m.get("role") == "tool"
    }
    skeleton = _read_skeleton(previous_summary) if previous_summary is not None else None
    if skeleton is None:
        skeleton = _Skeleton(previous=previous_summary)
    quote_limit = max(200, min(2000, max_chars // 4))
    files, commands = skeleton.files, skeleton.commands

    for message in middle:
        role = message.get("role")
        text = message_text(message)
        if role == "tool":
            continue
        if role == "user" and _media_only(message):
            continue  # (a browser agent's screenshot: no words of the user's to quote)
        if role == "user" and not is_synthetic(message, synthetic_prefixes):
            lines = _clip(text, quote_limit).splitlines() or [""]
            skeleton.tasks.append("\n".join(f"> {line}" for line in lines))
            _collect(text, files, commands)
        elif role == "assistant":
            if first := _first_line(text):
                skeleton.steps.append(f"- assistant: {_clip(first, 200)}")
            _collect(text, files, commands)
            for call in _tool_calls(message):
                arguments = _call_arguments(call)
                result = results.get(str(call.get("id")))
                outcome = "(no result)" if result is None else _clip(_first_line(result), 160)
                shown = _clip(" ".join(arguments.split()), 120)  # one line: read back whole
                skeleton.steps.append(f"- {_call_name(call)}({shown}) -> {outcome}")
                _collect_arguments(arguments, files, commands)
        elif first := _first_line(text):
            skeleton.steps.append(f"- {role}: {_clip(first, 200)}")

    text = _assembled(skeleton, max_chars)
    if fits is None or fits(text):
        return text
    # (each section keeps its share of the room: the search is over the assembly alone; one so
    # short that the final cut crossed its sections would not be read back, and the next
    # compaction would nest it whole)
    low, high = 200, max_chars
    best = _assembled(skeleton, low)
    while high - low > 1:
        middle_limit = (low + high) // 2
        text = _assembled(skeleton, middle_limit)
        if fits(text) and _read_skeleton(text) is not None:
            low, best = middle_limit, text
        else:
            high = middle_limit
    return best


def _assembled(skeleton: _Skeleton, max_chars: int) -> str:
    """The extractive summary of ``skeleton`` in ``max_chars`` characters."""
    files, commands = skeleton.files, skeleton.commands
    fixed: list[str] = [EXTRACTIVE_HEADER]
    if skeleton.previous is not None:
        fixed.append(_PREVIOUS + _clip(skeleton.previous, max_chars * 3 // 10))
    fixed.append(_TASK + _kept_tasks(skeleton, max_chars * 4 // 10))
    tail_sections: list[str] = []
    for heading, found, most in ((_FILES, files, 60), (_COMMANDS, commands, 40)):
        if found:
            lines = _latest(list(found)[-most:], max_chars // 10)
            tail_sections.append(heading + "\n".join(lines))

    budget = max_chars - sum(len(s) + 2 for s in (*fixed, *tail_sections)) - len(_STEPS)
    kept: list[str] = []
    used = 0
    for step in reversed(skeleton.steps):
        if used + len(step) + 1 > budget - 40:
            break
        kept.append(step)
        used += len(step) + 1
    kept.reverse()
    omitted = skeleton.steps_omitted + len(skeleton.steps) - len(kept)
    step_lines = ([f"- ({omitted} earlier steps omitted)"] if omitted else []) + kept
    sections = [*fixed, _STEPS + ("\n".join(step_lines) or "(none)"), *tail_sections]
    return _clip("\n\n".join(sections), max_chars)


def _latest(items: list[str], limit: int) -> list[str]:
    """``items`` as ``- `item``` lines: the latest of them that fit ``limit`` characters."""
    lines: list[str] = []
    used = 0
    for item in reversed(items):
        line = f"- `{_clip(' ⏎ '.join(item.splitlines()), 300)}`"  # one line: read back whole
        if lines and used + len(line) + 1 > limit:
            break
        lines.append(line)
        used += len(line) + 1
    lines.reverse()
    return lines


def _kept_tasks(skeleton: _Skeleton, limit: int) -> str:
    """The Task section: every quote when they fit ``limit``; else the first (the task that
    opened the session), the latest (both cut to share ``limit`` when they alone do not fit),
    and as many of those between, latest first, as fit, with a count of the others."""
    tasks = skeleton.tasks
    if not tasks:
        return "(none)"
    if skeleton.tasks_omitted == 0 and sum(len(t) + 2 for t in tasks) <= limit:
        return "\n\n".join(tasks)
    first, later = tasks[0], tasks[1:]
    room = max(200, limit - 60)  # the count's line
    if not later:
        return _clip(first, room)
    latest, between = later[-1], later[:-1]
    if len(first) + len(latest) + 2 > room:
        first = _clip(first, max(room // 2, room - len(latest) - 2))
        latest = _clip(latest, room - len(first) - 2)
    used = len(first) + len(latest) + 4
    kept: list[str] = []
    for task in reversed(between):
        if used + len(task) + 2 > room:
            break
        kept.append(task)
        used += len(task) + 2
    kept.reverse()
    omitted = skeleton.tasks_omitted + len(between) - len(kept)
    count = [f"({omitted} of the user's messages omitted)"] if omitted else []
    return "\n\n".join([first, *count, *kept, latest])


def _collect(text: str, files: dict[str, None], commands: dict[str, None]) -> None:
    for match in _PATH_RE.finditer(text):
        path = match.group(0).rstrip(".")
        if len(path) > 1:
            files.setdefault(path, None)
    for block in _FENCE_RE.findall(text):
        for line in block.splitlines():
            if line.strip():
                commands.setdefault(line.strip().removeprefix("$ "), None)
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("$ ") and len(stripped) > 2:
            commands.setdefault(stripped[2:], None)


def _collect_arguments(arguments: str, files: dict[str, None], commands: dict[str, None]) -> None:
    try:
        parsed = json.loads(arguments) if arguments else None
    except ValueError:
        _collect(arguments, files, commands)
        return
    if not isinstance(parsed, dict):
        return
    for key, value in parsed.items():
        values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        strings = [v for v in values if isinstance(v, str)]
        if key in _COMMAND_KEYS and strings:
            # ["bash", "-lc", "pytest -q"] is one command; a list of commands has several.
            if key == "commands":
                for command in strings:
                    commands.setdefault(command, None)
            else:
                commands.setdefault(" ".join(strings), None)
        if key in _PATH_KEYS:
            for path in strings:
                files.setdefault(path, None)
        for string in strings:
            _collect(string, files, {})


def summary_message(text: str, *, covered: int, source: Source) -> Message:
    """The message that stands for ``covered`` compacted messages.

    Role ``user``: an assistant message first after the system prompt, or a system message in the
    middle of a conversation, is refused or rewritten by some providers and gateways (those that
    require the first turn to be the user's or hoist system text to the top); every provider
    accepts a user message there. The text says it is a summary, not a new request.
    """
    writer = "a model" if source == "model" else "cachegate without a model (extractive)"
    header = (
        f"{SUMMARY_MARKER} This message replaces the {covered} earlier messages of this "
        f"conversation, compacted by cachegate to stay within the context window; the summary was "
        f"written by {writer}. It is context, not a new request: continue the task from where "
        "the conversation below resumes."
    )
    return {"role": "user", "content": f"{header}\n\n{text}"}


def summary_text(message: Message) -> str:
    """The summary body of a ``summary_message`` (for a rolling compaction's previous summary)."""
    text = message_text(message)
    if text.startswith(SUMMARY_MARKER):
        _, _, body = text.partition("\n\n")
        return body
    return text


# --- sticky substitution --------------------------------------------------------------------


def chain_digest(previous: str, message: Message) -> str:
    """The digest of a prefix extended by one message: sha256 of the previous digest and the
    message's canonical JSON (sorted keys, no ``cache_control``: ``unmarked``), so digests can be
    computed incrementally."""
    h = hashlib.sha256(previous.encode())
    h.update(b"\n")
    h.update(canonical_json(unmarked(message)))
    return h.hexdigest()


def unmarked(message: Message) -> Message:
    """``message`` without the ``cache_control`` breakpoints on it and on its content parts, and
    a content of one text part as that text (the input itself when it has neither). Clients that
    mark their latest user messages (Cline, Roo Code through OpenRouter) move the marks every
    turn, sending a marked message as a text part and the others as strings: a history is the
    same without them, and a compaction that covers a message whose mark has moved on still
    applies."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    parts = isinstance(content, list) and any(
        isinstance(part, dict) and ("cache_control" in part or len(content) == 1)
        for part in content
    )
    if "cache_control" not in message and not parts:
        return message
    out = {key: value for key, value in message.items() if key != "cache_control"}
    if parts:
        assert isinstance(content, list)
        bare = [
            {k: v for k, v in part.items() if k != "cache_control"}
            if isinstance(part, dict)
            else part
            for part in content
        ]
        one = bare[0] if len(bare) == 1 else None
        if (
            isinstance(one, dict)
            and one.keys() == {"type", "text"}
            and one["type"] == "text"
            and isinstance(one["text"], str)
        ):
            out["content"] = one["text"]
        else:
            out["content"] = bare
    return out


def prefix_digest(
    messages: Sequence[Message],
    end: int,
    *,
    known: tuple[int, str] | None = None,
) -> str:
    """The chained digest of ``messages[:end]`` past its leading system/developer messages
    (``leading_count``): a compaction keeps the system prompt as the request sends it, so one
    that changes every turn (the time in it) keeps the compaction, whose summary was made again
    on every turn.

    ``known=(k, digest_of_first_k)`` resumes the chain from a digest the caller computed before
    (e.g. for an unchanged prefix of the previous request), hashing only ``messages[k:end]``.
    """
    if end > len(messages):
        raise ValueError(f"prefix of {end} messages asked of a list of {len(messages)}")
    index, digest = known if known is not None else (leading_count(messages), GENESIS_DIGEST)
    if index > end:
        raise ValueError(f"known digest covers {index} messages, more than {end}")
    for message in messages[index:end]:
        digest = chain_digest(digest, message)
    return digest


def leading_count(messages: Sequence[Message]) -> int:
    """How many system/developer messages open ``messages``."""
    lead = 0
    while (
        lead < len(messages)
        and isinstance(messages[lead], dict)
        and type(role := messages[lead].get("role")) is str
        and role in LEADING_ROLES
    ):
        lead += 1
    return lead


def opening_digest(messages: Sequence[Message]) -> str:
    """The digest of a history's opening: the first message after its leading system/developer
    messages (which a compaction keeps as each request sends them), and how many those are."""
    lead = leading_count(messages)
    return f"{lead}:" + prefix_digest(messages, min(lead + 1, len(messages)))


def apply_compaction(
    messages: Sequence[Message], compaction: Compaction, *, digest: str | None = None
) -> list[Message] | None:
    """``messages[:start] + [summary] + messages[covered:]`` when the first ``covered`` messages
    are the ones the compaction was made from; None when the history is shorter or diverges before
    ``covered`` (a rewind or fork: the summary would leak a future the user undid).

    ``digest`` is ``prefix_digest(messages, covered)`` if the caller already has it.
    """
    if len(messages) <= compaction.covered:  # (no message after it: the summary would be the
        return None  # last, the client's own last message, its question, hidden in it)
    if digest is None:
        digest = prefix_digest(messages, compaction.covered)
    if digest != compaction.prefix_digest:
        return None
    return [*messages[: compaction.start], compaction.message, *messages[compaction.covered :]]


def build_compaction(
    messages: Sequence[Message],
    cut: Cut,
    text: str,
    *,
    source: Source,
    tokens_before: int | None = None,
    digest: str | None = None,
) -> Compaction:
    """The compaction of ``messages`` (the CLIENT history) at ``cut`` with summary ``text``.

    ``tokens_before`` defaults to the estimate of ``messages``; ``tokens_after`` is the estimate
    of the substituted history. ``digest`` is ``prefix_digest(messages, cut.end)`` if the caller
    already has it.
    """
    message = summary_message(text, covered=cut.end - cut.start, source=source)
    after = [*messages[: cut.start], message, *messages[cut.end :]]
    return Compaction(
        opening=opening_digest(messages),
        prefix_digest=prefix_digest(messages, cut.end) if digest is None else digest,
        covered=cut.end,
        start=cut.start,
        message=message,
        source=source,
        tokens_before=estimate_tokens(list(messages)) if tokens_before is None else tokens_before,
        tokens_after=estimate_tokens(after),
    )


def plan(
    messages: list[Message],
    *,
    existing: Compaction | None,
    window: int,
    trigger_percent: float,
    keep_recent: int,
    max_anchor_chars: int,
    last_prompt: int | None = None,
    last_completion: int | None = None,
    appended_estimate: int = 0,
    force: bool = False,
    synthetic_prefixes: Sequence[str] = DEFAULT_SYNTHETIC_PREFIXES,
    existing_digest: str | None = None,
    tools_estimate: int = 0,
    asked: int = 0,
) -> Plan:
    """Steps 1–3 of the module docstring for one request's CLIENT history ``messages``.

    ``tools_estimate`` is the request's tools, counted with the history where there are no
    provider numbers (which include them). ``force`` skips the trigger (the provider just refused with ``context_length_exceeded``).
    When ``existing`` no longer matches, the provider numbers describe another history and are
    ignored in favour of the estimate. ``existing_digest`` is ``prefix_digest(messages,
    existing.covered)`` when the caller already knows it. ``asked``: the completion the request
    asks for (``should_compact``).
    """
    forwarded: list[Message] = messages
    reused: Compaction | None = None
    discarded = False
    if existing is not None:
        substituted = apply_compaction(messages, existing, digest=existing_digest)
        if substituted is not None:
            forwarded, reused = substituted, existing
        else:  # a rewind or a fork of the compacted conversation
            discarded = True
            last_prompt = last_completion = None

    def nothing(triggered: bool = True) -> Plan:
        return Plan(forwarded, reused, discarded, None, [], None, triggered)

    if not force and not should_compact(
        window=window,
        trigger_percent=trigger_percent,
        last_prompt=last_prompt,
        last_completion=last_completion,
        appended_estimate=appended_estimate,
        full_estimate=estimate_tokens(forwarded) + tools_estimate if last_prompt is None else 0,
        asked=asked,
    ):
        return nothing(triggered=False)
    cut = find_cut(
        messages,
        keep_recent=keep_recent,
        max_anchor_chars=max_anchor_chars,
        synthetic_prefixes=synthetic_prefixes,
    )
    if cut is None:
        return nothing()
    if reused is None:
        middle = list(messages[cut.start : cut.end])
        return Plan(forwarded, None, discarded, cut, middle, None, True)
    if cut.end <= reused.covered:
        return nothing()
    # What the previous compaction kept verbatim before its summary (a task that opened the
    # conversation) and this one covers is summarized too, or it would be lost.
    earlier = messages[cut.start : reused.start] if cut.start < reused.start else []
    return Plan(
        forwarded,
        reused,
        discarded,
        cut,
        [*earlier, *messages[reused.covered : cut.end]],
        summary_text(reused.message),
        True,
    )


# --- provider refusal -----------------------------------------------------------------------

# The wordings of the servers agents use, lower-cased: OpenAI, Azure, DeepSeek, vLLM and Mistral
# ("maximum context length"), Anthropic ("prompt is too long"), llama.cpp and Ollama, which passes
# llama.cpp's text on ("exceeds the available context size", type "exceed_context_size_error"),
# Together and SGLang ("longer than the model's context length"), Gemini ("exceeds the maximum
# number of tokens allowed"), xAI ("maximum prompt length"), LM Studio ("greater than the context
# length"), Bedrock ("input is too long"); those that count the completion asked for in
# (``max_tokens``): Anthropic ("input length and `max_tokens` exceed context limit: N + M > W")
# and Hugging Face's TGI, Together's dedicated endpoints ("`inputs` tokens + `max_new_tokens`
# must be <= W").
_CONTEXT_PHRASES = (
    b"context_length_exceeded",
    b"maximum context length",
    b"context window",
    b"prompt is too long",
    b"too many tokens",
    b"exceeds the available context size",
    b"exceed_context_size_error",
    b"model's context length",
    b"exceeds the maximum number of tokens allowed",
    b"maximum prompt length",
    b"exceed context limit",
    b"tokens + `max_new_tokens` must be <=",
    # LM Studio: 0.3's "Trying to keep the first N tokens when context the overflows. However,
    # the model is loaded with context length of only W tokens", 0.4's "Cannot truncate prompt
    # with n_keep (N) >= n_ctx (W)"
    b"when context the overflows",
    b"when context overflows",
    b"context length of only",
    b"cannot truncate prompt with n_keep",
)
_BROAD_CONTEXT_PHRASES = (
    b"exceeds context length",
    b"exceeds the context length",
    b"than the context length",
    b"input is too long",
)


def is_context_length_error(status: int, body: bytes) -> bool:
    """True for a provider's refusal of a prompt longer than the model's context window
    (OpenAI's ``code: context_length_exceeded`` and the wordings of compatible servers).

    A JSON body is judged by what its error says (``message``, ``error``, ``detail``, ``code``,
    ``type``), not by what it echoes of the request: a validation error quoting a message that
    says "the input is too long" is no refusal of the history's length. The broader wordings do
    not count where the message is about ``max_tokens`` (too large for the window by itself:
    compacting the history would not help)."""
    if status not in (400, 413, 422):
        return False
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        said = body.lower()
    else:
        said = "\n".join(_error_words(parsed)).lower().encode()
        if isinstance(parsed, dict):
            error = parsed.get("error")
            if isinstance(error, dict) and error.get("code") == "context_length_exceeded":
                # (OpenAI's older models say so of a max_tokens that fills the window alone)
                return not _output_alone_too_large(said)
    if any(phrase in said for phrase in _CONTEXT_PHRASES):
        return not _output_alone_too_large(said)
    if any(word in said for word in _OUTPUT_LIMIT_WORDS):
        return False
    return any(phrase in said for phrase in _BROAD_CONTEXT_PHRASES)


# What a refusal says the completion asked for: vLLM's "'max_tokens' … is too large: N" and
# "(M in the messages, N in the completion)", OpenRouter's "(M of text input, N in the output)",
# Anthropic's "exceed context limit: M + N > W",
# TGI's "Given: M `inputs` tokens and N `max_new_tokens`", SGLang's "N tokens for the completion".
_OUTPUT_ASKED = re.compile(
    rb"is too large: (\d+)|(\d+) in the (?:completion|output)|context limit: \d+ \+ (\d+) >"
    rb"|and (\d+) `max_new_tokens`|(\d+) tokens for the completion"
)


def output_requested(body: Any) -> int:
    """The completion tokens a request body asks for at most (``max_completion_tokens``, or the
    older ``max_tokens``; 0 when it names none)."""
    if not isinstance(body, dict):
        return 0
    for key in ("max_completion_tokens", "max_tokens"):
        asked = body.get(key)
        if type(asked) is int and asked > 0:
            return asked
    return 0


# Refusals of servers that count the completion asked for in the window with the prompt, where
# they say only the prompt's count (OpenAI's family, vLLM and DeepSeek, "maximum context length
# is N tokens"; Anthropic; SGLang and Together): the request's own max_tokens is reserved.
# Others (llama.cpp, Ollama, Gemini, Mistral) count the prompt alone: reserving it there gave up
# retries that would fit.
_COUNTS_COMPLETION = (
    b"maximum context length is",
    b"prompt is too long",
    b"exceed context limit",
    b"model's maximum context length of",  # SGLang
    b"longer than the model's context length",  # SGLang, Together
)


def reserved_output(error_body: bytes, body: Any) -> int:
    """The completion tokens a compaction after ``error_body`` leaves room for: what the refusal
    says the request asked for, else the request's own ``max_tokens`` where the refusal is of a
    server that counts it (0 otherwise)."""
    asked = output_asked(error_body)
    if asked is not None:
        return asked
    said = error_body.lower()
    return output_requested(body) if any(w in said for w in _COUNTS_COMPLETION) else 0


def output_asked(error_body: bytes) -> int | None:
    """The completion tokens a refusal says the request asked for (its ``max_tokens``), which
    the provider counts in its window with the prompt."""
    return _stated(_OUTPUT_ASKED, error_body)


def _output_alone_too_large(said: bytes) -> bool:
    """Whether the refusal says the completion asked for fills the window by itself (a
    ``max_tokens`` as large as the window): compacting the history would not help, and each
    retry would cost a summary call for the same refusal."""
    asked = output_asked(said)
    window = provider_window(said)
    if asked is None or window is None:
        return False
    return asked >= window


_ERROR_KEYS = frozenset({"message", "msg", "error", "detail", "code", "type"})
_OUTPUT_LIMIT_WORDS = (b"max_tokens", b"max_completion_tokens", b"max_new_tokens")


def _error_words(value: Any, depth: int = 0) -> list[str]:
    """The strings an error body says under its error keys (also nested: ``{"error":
    {"message": …}}``, a list of errors), never under others (``input``, ``loc``: echoes)."""
    if depth > 4:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [w for item in value[:20] for w in _error_words(item, depth + 1)]
    if isinstance(value, dict):
        words = [
            w
            for key, item in value.items()
            if key in _ERROR_KEYS
            for w in _error_words(item, depth + 1)
        ]
        metadata = value.get("metadata")
        raw = metadata.get("raw") if isinstance(metadata, dict) else None
        if isinstance(raw, str):  # OpenRouter: the provider's own error body, as a string
            try:
                words += _error_words(orjson.loads(raw), depth + 1)
            except orjson.JSONDecodeError:
                words.append(raw)
        return words
    return []


# Where those refusals state the window: OpenAI's family, llama.cpp (its text and "n_ctx"),
# Together/SGLang, Gemini, xAI, Mistral ("… too large for model with N maximum context length")
# and Anthropic ("prompt is too long: M tokens > N maximum").
_WINDOW_RE = re.compile(
    rb"maximum context length is (\d+)"
    rb"|available context size \((\d+) tokens?\)"
    rb'|"n_ctx"\s*:\s*(\d+)'
    rb"|model's context length \((\d+) tokens?\)"
    rb"|maximum number of tokens allowed \((\d+)\)"
    rb"|maximum prompt length is (\d+)"
    rb"|(\d+) maximum context length"
    rb"|tokens > (\d+) maximum"
    rb"|context limit: \d+ \+ \d+ > (\d+)"
    rb"|`max_new_tokens` must be <= (\d+)"
    rb"|maximum context length of (\d+)"
    rb"|context length of only (\d+)"
    rb"|>= n_ctx \((\d+)\)",
    re.IGNORECASE,
)


# Where they state how many tokens the refused prompt held: OpenAI's family ("your messages
# resulted in N tokens", "(N in the messages, …)"), Anthropic ("prompt is too long: N tokens"),
# llama.cpp ("the request (N tokens) exceeds …"), SGLang and Together ("The input (N tokens) is
# longer than …", "N tokens from the input messages"), Gemini ("The input token count (N)"), xAI
# ("the request contains N tokens") and Mistral ("Prompt contains N tokens").
_PROMPT_RE = re.compile(
    rb"messages resulted in (\d+) tokens?"
    rb"|\((\d+) in the messages"
    rb"|prompt is too long: (\d+) tokens?"
    rb"|request \((\d+) tokens?\) exceeds"
    rb"|context limit: (\d+) \+"
    rb"|given: (\d+) `inputs` tokens"
    rb"|(\d+) tokens from the input messages"
    rb"|input \((\d+) tokens?\) is longer than"
    rb"|input token count \((\d+)\)"
    rb"|(?:request|prompt) contains (\d+) tokens",
    re.IGNORECASE,
)


def provider_prompt_tokens(error_body: bytes) -> int | None:
    """How many tokens a provider's ``context_length_exceeded`` message says the prompt held."""
    return _stated(_PROMPT_RE, error_body)


def provider_window(error_body: bytes) -> int | None:
    """The context window a provider's ``context_length_exceeded`` message states, if it does."""
    return _stated(_WINDOW_RE, error_body)


def _stated(pattern: re.Pattern[bytes], error_body: bytes) -> int | None:
    """The positive number the first of ``pattern``'s wordings found in ``error_body`` holds."""
    match = pattern.search(error_body)
    if match is None:
        return None
    number = int(next(group for group in match.groups() if group is not None))
    return number if number > 0 else None
