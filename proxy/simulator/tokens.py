"""A deterministic stand-in for a provider's tokenizer (pure).

Real tokenizers are model-specific and large; the simulator needs counts of the right order and,
above all, stable token boundaries, so that a request that extends another yields a token sequence
that extends the other's (which is what a prefix cache keys on).

Rules:

- Text is read as UTF-8. A token is a run of ASCII letters, digits and ``_``; or a run of non-ASCII
  bytes; or a run of other ASCII punctuation — each run cut into pieces of at most 4 bytes.
  Whitespace and control characters separate tokens and are not counted:
  ``"hello, world"`` → ``hell o , worl d`` = 5 tokens; ``"abcd " * 10`` = 10 tokens.
- A chat request is its leading system (or developer) messages, then its ``tools`` (their
  compact JSON, keys sorted but for a schema's ``properties``, which a provider renders as
  parameters in the order sent; a ``cache_control`` mark is no text), then each other message
  in order, as OpenAI renders a request (its Harmony format: the instructions, then the
  tools) and DeepSeek does (the system prompt, then the tools); Claude (``anthropic-compat``)
  renders the tools first, then every message. A message is a fixed overhead of
  3 tokens (start, role, end) around its ``name``, its content (a string, or the text of a list's
  text parts, an image as OpenAI bills it for its size, ``proxy.media``: 1,105 tokens for a 1280
  x 800 screenshot, not its base64; 765 where the size is not read, an image by URL; other parts,
  audio and files among them, as compact JSON), its tool calls (id, function name, arguments)
  and its ``tool_call_id``.
  ``prompt_tokens`` is the length of that sequence.
- A reply costs the tokens of its content plus, per tool call, those of its name and arguments.
- Claude (``anthropic-compat``) caches a request's tokens only up to its last ``cache_control``
  breakpoint (``marked_request_tokens``), and reads an entry only within
  ``CLAUDE_LOOKBACK_BLOCKS`` content blocks before one of its breakpoints, counted as cachegate
  counts them (``proxy.prefix.claude_blocks``: a tool is one; a message, its text or each of
  its parts, and each of its tool calls; a tool result, one).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any, Final

import orjson

from proxy.media import image_tokens
from proxy.prefix import (  # tools as a provider renders them
    cache_mark,
    claude_blocks,
    deep_dumps,
    leading_system_count,
    request_tools,
    tools_json,
)

MESSAGE_OVERHEAD = 3
UNKNOWN_IMAGE_TOKENS = 765  # an image whose size is not read (one by URL): a 1024 x 1024 one's
_TOKEN = re.compile(
    rb"[A-Za-z0-9_]{1,4}|[\x80-\xff]{1,4}|[\x21-\x2f\x3a-\x40\x5b-\x5e\x60\x7b-\x7e]{1,4}"
)
# Markers are longer than any text token, so no text can produce one.
_START = b"<|start|>"
_END = b"<|end|>"


def tokenize(text: str) -> list[bytes]:
    """Split ``text`` into tokens by the rules in the module docstring."""
    return _TOKEN.findall(text.encode("utf-8", "surrogatepass"))


def token_spans(raw: bytes) -> Iterator[re.Match[bytes]]:
    """The tokens of UTF-8 ``raw``, each with where it ends (to cut a text after N of them)."""
    return _TOKEN.finditer(raw)


def count_tokens(text: str) -> int:
    """How many tokens ``text`` costs."""
    return len(tokenize(text))


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # nested past orjson's 254 levels, as a client may send (a 500 here)
        return deep_dumps(value, ensure_ascii=False, separators=(",", ":"))


def content_text(content: Any) -> str:
    """The text of a message ``content``: a string, or the joined text of a list's text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(_as_text(part.get("text", "")))
            else:
                parts.append(_as_text(part))
        return "\n".join(parts)
    return _as_text(content)


def _part_tokens(part: Any) -> list[bytes]:
    """The tokens of one part of a content list: a text part's text, an image by its size (as
    OpenAI bills it: ``proxy.media.image_tokens``), anything else as compact JSON."""
    if isinstance(part, Mapping):
        kind = part.get("type")
        if kind == "text":
            return tokenize(_as_text(part.get("text", "")))
        if type(kind) is str and kind in _IMAGE_TYPES:
            count = image_tokens(part)
            if count is None:  # by URL, or no image format read: what a usual one costs
                count = UNKNOWN_IMAGE_TOKENS
            try:  # (one mark per image, repeated: the same image, the same tokens)
                mark = b"<|image:%x|>" % (hash(_identity(part)) & 0xFFFFFFFFFFFFFFFF)
            except RecursionError:  # (a part nested past the interpreter's stack)
                return tokenize(_as_text(part))
            return [mark] * count
    return tokenize(_as_text(part))


_IMAGE_TYPES: Final = frozenset({"image_url", "input_image", "image"})


def _identity(value: Any) -> Any:
    """What makes an image part that image: its values, without a ``cache_control`` mark (a
    client moves it on to a later part each turn: the image stays the same tokens); its
    strings hashed as they are (a data URL of megabytes is neither serialized nor copied)."""
    if isinstance(value, Mapping):
        return tuple(
            sorted((str(k), _identity(v)) for k, v in value.items() if k != "cache_control")
        )
    if isinstance(value, list):
        return tuple(_identity(v) for v in value)
    return value


def message_tokens(message: Mapping[str, Any]) -> list[bytes]:
    """The tokens of one chat message, overhead included."""
    out = [_START, f"<|{message.get('role')}|>".encode()]
    if message.get("name") is not None:
        out += tokenize(_as_text(message["name"]))
    content = message.get("content")
    if isinstance(content, list):
        for part in content:
            out += _part_tokens(part)
    else:
        out += tokenize(content_text(content))
    for call in message.get("tool_calls") or ():
        if not isinstance(call, Mapping):
            out += tokenize(_as_text(call))
            continue
        function = call.get("function") or {}
        out += tokenize(_as_text(call.get("id", "")))
        if isinstance(function, Mapping):
            out += tokenize(_as_text(function.get("name", "")))
            out += tokenize(_as_text(function.get("arguments", "")))
    if message.get("tool_call_id") is not None:
        out += tokenize(_as_text(message["tool_call_id"]))
    out.append(_END)
    return out


def request_tokens(body: Mapping[str, Any], system_first: bool = True) -> list[bytes]:
    """The prompt of a chat-completions request as one token sequence: the system block, tools,
    then the other messages (``system_first``, OpenAI's order), or tools, then messages."""
    return marked_request_tokens(body, system_first)[0]


def response_tokens(body: Mapping[str, Any]) -> list[bytes]:
    """The prompt of a Responses API request as one token sequence, in the order the cache
    reads it: a stored ``prompt`` (its id, version and variables stand for the template it
    renders), ``instructions``, ``tools``, then each ``input`` item (an input text as the
    user message it stands for, as OpenAI reads it: a next turn that sends it as an item reads
    it from the cache)."""
    out: list[bytes] = []
    prompt = body.get("prompt")
    if isinstance(prompt, dict):
        out += tokenize(deep_dumps(prompt, sort_keys=True))
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        out += tokenize(instructions)
    tools = body.get("tools")
    if tools:
        out += tokenize(tools_json(tools).decode())
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items if isinstance(items, list) else ():
        out.append(_START)
        out += tokenize(deep_dumps(item, sort_keys=True))
        out.append(_END)
    return out


def marked_request_tokens(
    body: Mapping[str, Any], system_first: bool = True
) -> tuple[list[bytes], int, int, list[int], dict[int, int]]:
    """``request_tokens``, how many of them end at the request's last ``cache_control``
    breakpoint (0 when there is none; all of them for one on the request itself), how many
    at its last breakpoint with ``"ttl": "1h"`` (0 for none), where each breakpoint ends
    (Claude writes a cache entry there, and reads only entries), and, for the end of the tools
    and of each message, how many content blocks end there or before it (Claude's look back,
    ``CLAUDE_LOOKBACK_BLOCKS``). A mark on a tool counts at the end of the tools, on a content
    part at the end of its message."""
    out: list[bytes] = []
    marked = hour = 0
    ends: list[int] = []
    bounds: dict[int, int] = {}
    blocks = 0
    short = False  # a five-minute breakpoint seen: Claude takes no one-hour one after it

    def add(messages: Any) -> None:
        nonlocal marked, hour, short, blocks
        for message in messages:
            blocks += claude_blocks(message)
            if isinstance(message, Mapping):
                out.extend(message_tokens(message))
                mark = cache_mark(message, "content")
                if mark is not None:
                    marked = len(out)
                    ends.append(marked)
                    if (_hour(mark) or _hour_in_parts(message)) and not short:
                        hour = len(out)
                    short = short or not _hour(mark)
            else:
                out.extend(tokenize(_as_text(message)))
            bounds[len(out)] = blocks

    messages = body.get("messages") or []
    if not isinstance(messages, list):
        messages = list(messages)
    lead = leading_system_count(messages) if system_first else 0
    add(messages[:lead])
    tools = request_tools(body)  # (the legacy ``functions`` too, rendered as tools are)
    if tools:
        out += tokenize(tools_json(tools).decode())
        blocks += len(tools) if isinstance(tools, list) else 1
        bounds[len(out)] = blocks
        if isinstance(tools, list):
            marks = [cache_mark(t, "function") for t in tools]
            if any(m is not None for m in marks):
                marked = len(out)
                ends.append(marked)
            if any(_hour(m) for m in marks) and not short:
                hour = len(out)
            short = short or any(m is not None and not _hour(m) for m in marks)
    add(messages[lead:])
    request_mark = body.get("cache_control")
    if request_mark is not None:  # automatic caching: up to the end
        marked = len(out)
        ends.append(marked)
        if _hour(request_mark) and not short:
            hour = len(out)
    return out, marked, hour, ends, bounds


def _hour(mark: Any) -> bool:
    """Whether a ``cache_control`` asks for Claude's one-hour cache."""
    return isinstance(mark, Mapping) and mark.get("ttl") == "1h"


def _hour_in_parts(message: Mapping[str, Any]) -> bool:
    """Whether any content part of ``message`` carries a one-hour mark."""
    parts = message.get("content")
    return isinstance(parts, list) and any(
        isinstance(p, Mapping) and _hour(p.get("cache_control")) for p in parts
    )
