"""Per-element hash chain of a forwarded chat request, and where two requests diverge (pure).

A provider's prefix cache serves the longest prefix of a request it has processed before. To say
*why* it missed, cachegate hashes each forwarded request as a chain of elements, in the order a
provider renders them::

    params ─▶ tools ─▶ system ─▶ messages[k] ─▶ messages[k+1] ─▶ …

(Anthropic's order: Claude renders the tools first), or, as OpenAI, DeepSeek and the chat
templates of open models render a request (OpenAI's Harmony format: the instructions, then the
tools), the system block first (``fingerprint(…, system_first=True)``)::

    params ─▶ system ─▶ tools ─▶ messages[k] ─▶ messages[k+1] ─▶ …

A Responses API request's system block is its ``instructions`` alone (``system_block``).
``params`` holds the cache-relevant parameters (``CACHE_PARAMS``), ``tools`` the whole tools array,
``system`` the leading system/developer messages, and every later message is one element. Each
element's digest is blake2b-128 of its canonical JSON; each chain digest hashes the previous chain
digest with the element's digest, so equal chain digests mean equal prefixes.

Canonical form: keys sorted (``orjson.OPT_SORT_KEYS``); in messages, keys whose value is ``null``
are dropped (absent and ``null`` mean the same to the API), the ``index`` key of ``tool_calls``
entries and of content parts and ``cache_control`` markers are dropped (not message content), and
a content of one text part is that text. In the tools, the ``properties`` of a schema keep the
order sent: a provider renders them into the prompt as parameters, in that order. Everything else
counts: one changed character is a rewrite.

The first divergence between two requests is reported as a ``Divergence``: where (``params``,
``tools``, ``system`` or a message index with its role and field), a short redacted excerpt of old
vs new, and whether the only change is a volatile token (timestamp, date, uuid, id, counter) — the
classic "current time in the system prompt".
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import operator
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

import orjson

from proxy.redact import REDACTED, redact_text

# Request parameters that change what the provider renders or where it routes the request, so a
# change to any of them misses the cache: the model; reasoning settings (OpenAI ``reasoning_effort``
# and ``reasoning``, Anthropic-style ``thinking``); ``response_format`` (a JSON schema is rendered
# into the prompt); ``tool_choice`` and ``parallel_tool_calls`` (rendered with the tools);
# ``prompt_cache_key`` (OpenAI routes cache lookups by it); the Responses API's ``prompt`` (a
# stored prompt template, its version and variables: rendered before the instructions); the
# legacy ``function_call`` (``tool_choice`` of the legacy ``functions``).
# Sampling parameters (temperature, max_tokens, …) are not here: they do not touch the prompt.
CACHE_PARAMS: Final = (
    "model",
    "reasoning_effort",
    "reasoning",
    "thinking",
    "response_format",
    "tool_choice",
    "parallel_tool_calls",
    "prompt_cache_key",
    "prompt",
    "function_call",
)
_PARAM_SET: Final = frozenset(CACHE_PARAMS)
SYSTEM_ROLES: Final = frozenset({"system", "developer"})
DIGEST_SIZE: Final = 16
EXCERPT_CHARS: Final = 80
# How many characters of context an excerpt shows before the first differing character.
_EXCERPT_LEAD: Final = 30
# An insertion counts as "only a volatile token" when, besides the token, it adds no more than a
# short label ("Current time: ").
_VOLATILE_LABEL_CHARS: Final = 48
# ...and removes no more than a few characters besides tokens ("Date: Monday" -> "Date: …").
_VOLATILE_LOST_CHARS: Final = 12
# A change longer than this is an edit, whatever tokens it holds; bounds the regex work.
_VOLATILE_SCAN_CHARS: Final = 4096
# Context kept around a changed region so tokens crossing its edges are seen whole.
_TOKEN_MARGIN: Final = 64
# Context redacted around an excerpt, so a secret that starts before the excerpt is still caught.
_SECRET_MARGIN: Final = 4096
_KEY_BLOCK_MAX: Final = 64 * 1024  # the longest private key block looked back for (PEM, PGP)
# The character before the run of a token's characters (a JWT's, base64's, an STS token's) that
# ends at a search's end (``_excerpts``): white space, a quote, a comma, a backslash (a text of
# written-out ``\n`` escapes), anything a token does not hold.
_TOKEN_START: Final = re.compile(r"[^A-Za-z0-9_.+/=-](?=[A-Za-z0-9_.+/=-]*\Z)")
# Fixed element positions in the chain (tools and system swap places in a chain whose system
# block comes first: ``Fingerprint.tools_at``, ``system_at``); the messages after the system
# block follow.
_PARAMS, _TOOLS, _SYSTEM = 0, 1, 2
_FIRST_MESSAGE: Final = 3

Location = Literal["params", "tools", "system", "messages"]


@dataclass(slots=True, eq=False)
class Fingerprint:
    """The hash chain of one forwarded request (a value: never mutated once built; not frozen
    because a frozen dataclass costs ~1 µs more to build, once per request).

    ``chain`` is the list of ``(location, chain_digest)``: ``params``, ``tools``, ``system``
    (``system`` before ``tools`` where ``system_first``), then ``messages[i]`` for each message
    after the system block (``i`` indexes ``body["messages"]``); ``element_digests`` are in
    the chain's order.
    The other fields let the next request's fingerprint reuse work (``fingerprint(…, previous=)``)
    and let ``find_divergence`` locate a change. ``messages`` and ``tools`` are the request's own
    objects, kept by reference: do not mutate a body after fingerprinting it.
    """

    chain: tuple[tuple[str, bytes], ...]
    digests: tuple[bytes, ...]  # the chain digests alone, in order
    element_digests: tuple[bytes, ...]
    message_digests: tuple[bytes, ...]
    system_count: int
    messages: tuple[Any, ...]
    tools: Any
    params: dict[str, Any] | None = None  # the cache parameters hashed (``cache_params``)
    system_first: bool = False  # the system block hashed before the tools
    system_block: int | None = None  # its system block's length as given (``fingerprint``)

    @property
    def params_digest(self) -> bytes:
        """Digest of the cache-relevant parameters (not chained)."""
        return self.element_digests[_PARAMS]

    @property
    def tools_at(self) -> int:
        """The tools' place in the chain."""
        return _SYSTEM if self.system_first else _TOOLS

    @property
    def system_at(self) -> int:
        """The system block's place in the chain."""
        return _TOOLS if self.system_first else _SYSTEM

    @property
    def tools_digest(self) -> bytes:
        """Digest of the tools (not chained)."""
        return self.element_digests[_SYSTEM if self.system_first else _TOOLS]

    @property
    def system_digest(self) -> bytes:
        """Digest of the system block (not chained)."""
        return self.element_digests[_TOOLS if self.system_first else _SYSTEM]

    @property
    def head(self) -> bytes:
        """The chain digest of the whole request."""
        return self.chain[-1][1]


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first point where a request stopped repeating the previous one.

    ``location`` is ``params``, ``tools``, ``system`` or ``messages``; ``index`` the message index
    in ``body["messages"]`` (also set for ``system``: the first differing system message), else
    None. ``role`` is the message's role; ``field`` the first differing message key (``content``,
    ``tool_calls``, ``name``, …), the parameter name for ``params``, the tool's name for ``tools``;
    None when a whole element appeared or disappeared. Excerpts are ~80 characters around the first
    differing character, secrets redacted. ``volatile`` is true when the only change is a volatile
    token (or a short label plus one), ``volatile_kind`` then names it: ``timestamp``, ``date``,
    ``uuid``, ``id`` or ``counter``.
    """

    location: Location
    index: int | None
    role: str | None
    field: str | None
    old_excerpt: str
    new_excerpt: str
    volatile: bool = False
    volatile_kind: str | None = None
    vanished: bool = False  # the old messages from ``index`` on are gone (a trimmed history)

    @property
    def label(self) -> str:
        """One string: ``system``, ``tools``, ``params.model``, ``messages[12].content``."""
        if self.location == "messages":
            where = f"messages[{self.index}]"
            return f"{where}.{self.field}" if self.field else where
        if self.location == "params" and self.field:
            return f"params.{self.field}"
        return self.location


def fingerprint(
    body: Mapping[str, Any],
    previous: Fingerprint | None = None,
    system_first: bool = False,
    system_block: int | None = None,
) -> Fingerprint:
    """Hash ``body`` into a chain; with ``previous``, reuse its digests of unchanged elements.

    ``system_first``: the system block is hashed before the tools, as every provider but
    Anthropic renders a request (else after them, as Claude does). ``system_block``: the system block is
    that many leading messages (a Responses API request's ``instructions``, 1 or 0; the
    messages after it are messages whatever their role: a leading ``developer`` item comes
    after the tools); None: the leading system and developer messages.

    A message at the same index that is the same object as, or equal to, the previous request's is
    not hashed again, nor are equal tools, an equal system block or equal string-valued
    parameters, so a growing conversation costs in proportion to what was appended. (Equality is
    Python's: ``true``/``1``/``1.0`` inside a reused message or tools array would read as equal.)
    """
    raw_messages = body.get("messages")
    messages: tuple[Any, ...] = (
        tuple(raw_messages) if isinstance(raw_messages, list | tuple) else ()
    )
    count = len(messages)
    tools = request_tools(body)
    params = cache_params(body)
    if previous is not None and (
        previous.system_first is not system_first
        or (previous.system_block is None) is not (system_block is None)
    ):
        previous = None  # (its elements are in another order, or its block by another rule)
    chain: list[tuple[str, bytes]]
    if previous is None:
        message_digests = tuple([message_digest(message) for message in messages])
        system_count = (
            leading_system_count(messages) if system_block is None else min(system_block, count)
        )
        params_digest = _params_digest(params)
        tools_digest = _tools_digest(tools)
        system_digest = _system_digest(message_digests[:system_count])
        chain = []
    else:
        old_messages = previous.messages
        old_digests = previous.message_digests
        before = previous.element_digests
        # The leading run of the very same objects is found at C speed; past it, equal messages
        # still reuse their digest.
        same = leading_run(operator.is_, old_messages, messages)
        if same == count == len(old_messages):
            message_digests = old_digests
        else:
            digests = list(old_digests[:same])
            for i in range(same, count):
                message = messages[i]
                if i < len(old_messages):
                    old = old_messages[i]
                    try:
                        alike = old is message or old == message
                    except RecursionError:  # (nested past ~990 levels)
                        alike = deep_equal(old, message)
                    if alike:
                        digests.append(old_digests[i])
                        continue
                digests.append(message_digest(message))
            message_digests = tuple(digests)
        if same > previous.system_count and system_block is None:
            # The system block and the message after it are the very same objects: same block.
            system_count = previous.system_count
            system_digest = previous.system_digest
        else:
            system_count = (
                leading_system_count(messages) if system_block is None else min(system_block, count)
            )
            if previous.system_count == system_count and (
                old_digests[:system_count] == message_digests[:system_count]
            ):
                system_digest = previous.system_digest
            else:
                system_digest = _system_digest(message_digests[:system_count])
        # Elements equal to the previous request's keep their digests. Only parameters that are
        # all strings are compared (the usual model and effort): Python equality would take true
        # for 1 or 1024 for 1024.0, which hash differently.
        if previous.params == params and all(type(v) is str for v in params.values()):
            params_digest = before[_PARAMS]
        else:
            params_digest = _params_digest(params)
        # Other objects (each full parse makes its own: a body whose first bytes changed) are
        # compared as sent, in ~5 µs where the digest's canonical form takes ~0.2 ms for a
        # dozen tools (not by Python's equality alone, which takes reordered properties for
        # equal: a provider does not).
        if same_as_sent(previous.tools, tools):
            tools_digest = previous.tools_digest
        else:
            tools_digest = _tools_digest(tools)
    if system_first:
        elements = (params_digest, system_digest, tools_digest, *message_digests[system_count:])
    else:
        elements = (params_digest, tools_digest, system_digest, *message_digests[system_count:])

    links: tuple[bytes, ...] = ()  # the chain digests kept
    if previous is not None:
        # Chain digests depend only on element digests (and locations, fixed by the number of
        # system messages), so an unchanged run is copied as is.
        old_elements = previous.element_digests
        if previous.system_count != system_count:
            kept = min(leading_run(operator.eq, old_elements, elements), _FIRST_MESSAGE)
        elif same > system_count and old_elements[:_FIRST_MESSAGE] == elements[:_FIRST_MESSAGE]:
            # The digests of the leading run of the very same messages are the previous
            # request's own objects (copied above): the comparison starts past them.
            known = _FIRST_MESSAGE + same - system_count
            kept = known + leading_run(operator.eq, old_elements[known:], elements[known:])
        else:
            kept = leading_run(operator.eq, old_elements, elements)
        if kept == len(elements) == len(previous.chain):
            return Fingerprint(
                previous.chain,
                previous.digests,
                previous.element_digests,
                message_digests,
                system_count,
                messages,
                tools,
                params,
                system_first,
                system_block,
            )
        chain = list(previous.chain[:kept])
        links = previous.digests[:kept]
    if len(_LOCATION_NAMES) < count:
        _grow_locations(count)
    link = chain[-1][1] if chain else b""
    kept = len(chain)
    # Each link hashes the one before: a copy of a hasher made once costs less than a new one
    # with its parameters (~0.36 against ~0.6 us a link: a system prompt with the time in it
    # rehashes them all, ~460 at 460 messages).
    new_links: list[bytes] = []
    append, fresh = new_links.append, _BLANK_LINK.copy
    for element in elements[kept:]:
        hasher = fresh()
        hasher.update(link + element)
        link = hasher.digest()
        append(link)
    first = system_count + max(kept, _FIRST_MESSAGE) - _FIRST_MESSAGE  # (messages[first] on)
    names = _SYSTEM_FIRST_NAMES if system_first else _ELEMENT_NAMES
    locations = [*names[kept:], *_LOCATION_NAMES[first:count]]
    chain.extend(zip(locations, new_links, strict=True))

    return Fingerprint(
        tuple(chain),
        links + tuple(new_links),
        elements,
        message_digests,
        system_count,
        messages,
        tools,
        params,
        system_first,
        system_block,
    )


def leading_system_count(messages: Sequence[Any]) -> int:
    """How many leading messages are system (or developer) messages."""
    count = 0
    while count < len(messages):
        role = _role(messages[count])
        if type(role) is not str or role not in SYSTEM_ROLES:  # (a list there: not hashed)
            break
        count += 1
    return count


def carried_past_prompt(older: Sequence[Any], newer: Sequence[Any]) -> int:
    """How many messages ``older`` has past its system block, when ``newer`` holds those very
    objects right past its own (whatever either system block holds: the time in it); else 0."""
    since, start = leading_system_count(older), leading_system_count(newer)
    n = len(older) - since
    if n <= 0 or start + n > len(newer) or older[since] is not newer[start]:
        return 0
    return n if all(map(operator.is_, older[since:], newer[start : start + n])) else 0


def _system_digest(message_digests: Sequence[bytes]) -> bytes:
    return hashlib.blake2b(b"".join(message_digests), digest_size=DIGEST_SIZE).digest()


_ELEMENT_NAMES: Final = ("params", "tools", "system")
_SYSTEM_FIRST_NAMES: Final = ("params", "system", "tools")
_BLANK_LINK: Final = hashlib.blake2b(digest_size=DIGEST_SIZE)  # (copied for each chain link)
_LOCATION_NAMES: list[str] = []  # "messages[0]", "messages[1]", …, grown on demand


def _grow_locations(count: int) -> None:
    while len(_LOCATION_NAMES) < count:
        _LOCATION_NAMES.extend(
            f"messages[{i}]" for i in range(len(_LOCATION_NAMES), len(_LOCATION_NAMES) + 1024)
        )


def leading_run(test: Callable[[Any, Any], Any], old: Sequence[Any], new: Sequence[Any]) -> int:
    """How many leading pairs of ``old`` and ``new`` pass ``test`` (compared at C speed)."""
    if not old or not new or not test(old[0], new[0]):
        return 0  # the first pair decides it: no list of every pair's answer
    flags = list(map(test, old, new))
    # all() first: the common answer is "every pair", and a ValueError from index() costs more
    # than the comparisons.
    return len(flags) if all(flags) else list(map(bool, flags)).index(False)


def request_tools(body: Mapping[str, Any]) -> Any:
    """The tools a chat request's provider renders into the prompt: its ``tools``, and the legacy
    ``functions`` (LangChain's ``bind_functions``, older agents) after them, which OpenAI
    renders as it does tools (an edit of one misses the cache as a tool's does)."""
    tools = body.get("tools")
    functions = body.get("functions")
    if not isinstance(functions, list) or not functions:
        return tools
    if tools is None:
        return functions
    return [*tools, *functions] if isinstance(tools, list) else tools


def cache_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """The cache-relevant parameters present (and not null) in ``body``, but for those that say
    what leaving them out says: ``tool_choice`` ``"auto"`` with tools (``"none"`` without; the
    legacy ``function_call`` so with ``functions``),
    ``parallel_tool_calls`` true (the openai Node SDK's ``runTools`` sends ``"auto"``; the same
    history sent again without it is no rewrite), ``response_format`` ``{"type": "text"}``."""
    # One pass over the body's few keys (the digest sorts them; order does not matter).
    params = {key: value for key, value in body.items() if key in _PARAM_SET and value is not None}
    if params.get("parallel_tool_calls") is True:
        del params["parallel_tool_calls"]
    choice = params.get("tool_choice")
    if choice == ("auto" if body.get("tools") else "none"):
        del params["tool_choice"]
    if "function_call" in params and params["function_call"] == (
        "auto" if body.get("functions") else "none"
    ):
        del params["function_call"]
    if params.get("response_format") == _PLAIN_TEXT:  # (the default: nothing in the prompt)
        del params["response_format"]
    return params


_PLAIN_TEXT: Final = {"type": "text"}


# Keys that are no part of the prompt a provider caches: a streaming parser's ``index`` of tool
# calls and content parts, and the ``cache_control`` breakpoints Anthropic-style clients (and
# OpenRouter's) move to the latest message every turn; the cache holds the prefix before a
# breakpoint whatever marks it.
_NOT_PROMPT: Final = frozenset({"index", "cache_control"})


def canonical_message(message: Any) -> Any:
    """``message`` without null-valued keys, without a ``cache_control`` marker, and without the
    ``index`` or ``cache_control`` of its tool calls / content parts; a content of one text part
    as that text; a Responses API message item as the message it stands for (without its
    ``"type": "message"``, one ``input_text`` part as its text).

    Returns a shallow copy; the input is never mutated. Key order is left to the serializer.
    """
    if not isinstance(message, Mapping):
        return message
    out = {
        key: value for key, value in message.items() if value is not None and key != "cache_control"
    }
    for key in ("tool_calls", "content"):
        entries = out.get(key)
        if isinstance(entries, list) and any(
            isinstance(entry, Mapping) and not _NOT_PROMPT.isdisjoint(entry) for entry in entries
        ):
            out[key] = [
                {k: v for k, v in entry.items() if k not in _NOT_PROMPT}
                if isinstance(entry, Mapping)
                else entry
                for entry in entries
            ]
    # One text part is the text (a provider renders them alike): clients that mark their
    # latest messages for the cache send those as parts and the older ones as strings.
    text = single_text(out.get("content"))
    if out.get("type") == "message":
        del out["type"]
    if text is None:
        # A Responses API message item (typed or not: the type is optional) is the message it
        # stands for, its one ``input_text`` part its text, as OpenAI reads them: a
        # conversation opened with a one-string ``input`` (one user message) and sent on as
        # items (``input_text``) read as a new one, its misses unreported.
        text = single_text(out.get("content"), "input_text")
    if text is not None:
        out["content"] = text
    return out


def _item_type(message: Mapping[str, Any]) -> Any:
    """An item's type: a message (a role, no type: a chat message, or a Responses API message
    item, whose type is optional) is ``"message"``."""
    kind = message.get("type")
    return "message" if kind is None and "role" in message else kind


def single_text(content: Any, kind: str = "text") -> str | None:
    """The text of a content that is one text part of type ``kind`` and nothing else (a chat
    message's ``text``, a Responses API item's ``input_text``); None otherwise."""
    if type(content) is not list or len(content) != 1:
        return None
    part = content[0]
    if (
        isinstance(part, Mapping)
        and part.keys() == {"type", "text"}
        and part["type"] == kind
        and type(part["text"]) is str
    ):
        return part["text"]
    return None


def has_cache_marker(body: Mapping[str, Any]) -> bool:
    """Whether the request asks the provider's cache for anything: a ``cache_control`` (not
    null) on the request itself (automatic caching), a message, one of its content parts, or a
    tool (Anthropic-style breakpoints)."""
    return last_cache_marker(body) is not None


def last_cache_marker(body: Mapping[str, Any]) -> Any:
    """The ``cache_control`` that covers the longest prefix (None when there is none): the
    request's own (automatic caching marks the end), else the last in the order a provider
    renders the prompt, messages from the latest back (where clients put their moving
    breakpoint), then the tools."""
    marker = body.get("cache_control")
    if marker is not None:
        return marker
    for key, inner in (("messages", "content"), ("tools", "function")):
        items = body.get(key)
        if isinstance(items, list):
            for item in reversed(items):
                marker = cache_mark(item, inner)
                if marker is not None:
                    return marker
    return None


def cache_mark(item: Any, inner: str) -> Any:
    """``item``'s own ``cache_control``, else the last of its ``inner``'s (a message's content
    parts, a tool's function); None when it has none."""
    if not isinstance(item, dict):
        return None
    marker = item.get("cache_control")
    if marker is not None:
        return marker
    nested = item.get(inner)
    for part in reversed(nested) if isinstance(nested, list) else (nested,):
        if isinstance(part, dict) and part.get("cache_control") is not None:
            return part["cache_control"]
    return None


def marked_share(body: Mapping[str, Any], size: Callable[[Any], int] | None = None) -> float | None:
    """The share of the prompt (by the compact JSON of its tools and messages, or each one's
    ``size``: an image's tokens, not its base64; in the order Claude renders them) up to and
    including its last breakpoint; None when it marks nothing, 1.0 for the request's own
    ``cache_control`` (automatic caching)."""
    if body.get("cache_control") is not None:
        return 1.0
    tools = body.get("tools")
    messages = body.get("messages")
    tools = tools if isinstance(tools, list) else []
    messages = messages if isinstance(messages, list) else []
    weigh = size if size is not None else (lambda item: len(canonical_json(item)))
    sizes = [weigh(item) for item in (*tools, *messages)]
    total = sum(sizes)
    if not total:
        return None
    for at in range(len(messages) - 1, -1, -1):
        if cache_mark(messages[at], "content") is not None:
            return sum(sizes[: len(tools) + at + 1]) / total
    for at in range(len(tools) - 1, -1, -1):
        if cache_mark(tools[at], "function") is not None:
            return sum(sizes[: at + 1]) / total
    return None


def claude_blocks(item: Any) -> int:
    """The content blocks a chat message is to Claude, as a gateway renders it: its text (or
    each of its parts) and each of its tool calls; a tool result is one."""
    if not isinstance(item, Mapping):
        return 1
    if item.get("role") == "tool":
        return 1
    content = item.get("content")
    blocks = len(content) if isinstance(content, list) else 1 if content else 0
    calls = item.get("tool_calls")
    return blocks + (len(calls) if isinstance(calls, list) else 0)


def _marked_items(body: Mapping[str, Any]) -> tuple[list[Any], int]:
    """``body``'s tools and messages in the order Claude renders them, and how many of them
    are tools."""
    tools = body.get("tools")
    messages = body.get("messages")
    tools = tools if isinstance(tools, list) else []
    messages = messages if isinstance(messages, list) else []
    return [*tools, *messages], len(tools)


def _marked(body: Mapping[str, Any], items: list[Any], tools: int, at: int) -> bool:
    """Whether ``body``'s item ``at`` (of ``_marked_items``) carries a breakpoint (the
    request's own ``cache_control`` is one on its last)."""
    if at == len(items) - 1 and body.get("cache_control") is not None:
        return True
    return cache_mark(items[at], "function" if at < tools else "content") is not None


def lookback_reach(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    blocks: int,
    size: Callable[[Any], int] | None = None,
) -> float | None:
    """Claude reads an entry only where one of the request's breakpoints lies at most
    ``blocks`` content blocks (``claude_blocks``; a tool is one) after its end. Where ``new``
    carries ``old``'s tools and messages on, and more: the share of ``old``'s prompt (by each
    item's ``size``, else its compact JSON) up to the last of ``old``'s breakpoints that one of
    ``new``'s reaches; 0.0 when none does; None when ``old``'s last one is reached (all it
    cached may be read), and where there is nothing to judge (``old`` marks nothing, ``new``
    holds fewer items, or marks nothing past ``old``'s last breakpoint: a turn that marks only
    its system prompt asks for less, which is another rule's). (Only the items after ``old``'s
    last breakpoint are read where that one is reached: what a turn appended, not the
    history.)"""
    old_items, old_tools = _marked_items(old)
    new_items, new_tools = _marked_items(new)
    if len(new_items) < len(old_items):
        return None
    last = next(
        (at for at in reversed(range(len(old_items))) if _marked(old, old_items, old_tools, at)),
        -1,
    )
    if last < 0:
        return None

    def weight(at: int) -> int:
        return 1 if at < new_tools else claude_blocks(new_items[at])

    def reached(mark: int) -> bool:
        between = 0  # blocks after ``mark``'s item, up to and including ``at``
        for at in range(mark, len(new_items)):
            if at > mark:
                between += weight(at)
                if between > blocks:
                    return False
            if _marked(new, new_items, new_tools, at):
                return True
        return False

    if reached(last) or not any(
        _marked(new, new_items, new_tools, at) for at in range(last + 1, len(new_items))
    ):
        return None  # (reached, or it marks nothing past it: it asked for less, not too far)
    weigh = size if size is not None else (lambda item: len(canonical_json(item)))
    for mark in reversed(range(last)):
        if _marked(old, old_items, old_tools, mark) and reached(mark):
            sizes = [weigh(item) for item in old_items]
            total = sum(sizes)
            return sum(sizes[: mark + 1]) / total if total else 0.0
    return 0.0


_MARKER_TTLS: Final = {"5m": 300.0, "1h": 3600.0}


def longer_lived_share(
    body: Mapping[str, Any],
    last_ttl_s: float,
    size: Callable[[Any], int] | None = None,
    change: Divergence | None = None,
) -> tuple[float, float] | None:
    """Where a breakpoint before the last asks for a longer cache life than ``last_ttl_s``, the
    last one's (tools and system marked for an hour, the latest message for five minutes): the
    longest such life, in seconds, and the share of the whole prompt that the breakpoint which
    asks for it covers, each tool and message weighed by ``size`` (by default, as ``marked_share``
    measures: its compact JSON); None otherwise (a request's own ``cache_control`` covers it
    all), and when ``change`` (a difference from ``body``) lies past that breakpoint: the
    longer-lived prefix is then whole, whatever the estimate of its share says."""
    if body.get("cache_control") is not None:
        return None
    tools = body.get("tools")
    messages = body.get("messages")
    items = [
        *((tool, "function") for tool in (tools if isinstance(tools, list) else ())),
        *((message, "content") for message in (messages if isinstance(messages, list) else ())),
    ]
    longest, at = last_ttl_s, -1
    for i, (item, inner) in enumerate(items):
        marker = cache_mark(item, inner)
        ttl = marker.get("ttl") if isinstance(marker, dict) else None
        life = _MARKER_TTLS.get(ttl) if isinstance(ttl, str) else None
        if life is not None and life > last_ttl_s and life >= longest:
            longest, at = life, i
    if at < 0:
        return None
    if change is not None and change.location != "params":
        tools_count = len(items) - len(messages if isinstance(messages, list) else ())
        where = 0 if change.location == "tools" else tools_count + (change.index or 0)
        if where > at:
            return None
    weigh = size if size is not None else (lambda item: len(canonical_json(item)))
    sizes = [weigh(item) for item, _ in items]
    total = sum(sizes)
    return (longest, sum(sizes[: at + 1]) / total) if total else None


def marked_ttl_s(body: Mapping[str, Any]) -> float | None:
    """The cache life the request's last breakpoint asks for (Anthropic's ``"ttl": "1h"`` or
    ``"5m"``), in seconds; None when it names none."""
    marker = last_cache_marker(body)
    ttl = marker.get("ttl") if isinstance(marker, dict) else None
    return _MARKER_TTLS.get(ttl) if isinstance(ttl, str) else None


_DEEP_LOCK = threading.Lock()
# orjson reads up to 1,024 levels and writes 254; the standard library's encoder and decoder,
# and cachegate's own walks of a body (two frames a level where a comprehension recurses), stop
# at the interpreter's recursion limit (1,000 frames: ~490 or ~990 levels).
_DEEP_FRAMES = 2_400

_T = TypeVar("_T")
_deep_calls = 0  # deep calls under way, in all threads
_usual_limit = 1000  # the recursion limit before the first of them raised it


_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def without_surrogates(value: Any) -> Any:
    """``value`` (parsed JSON) with each lone UTF-16 surrogate in its strings as U+FFFD: a JSON
    text may escape one (``"\\ud83d"``, JavaScript's text cut inside an emoji), which Python's
    parser keeps and no UTF-8 writer (orjson, the log) takes."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {without_surrogates(k): without_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_surrogates(v) for v in value]
    return value


def deep_call(function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``function(*args, **kwargs)``, also for a value nested as deep as orjson reads (1,024
    levels, a few more where the log wraps it): when the first try meets the recursion limit,
    the limit is raised for one more try. (Python calls do not take the C stack in 3.11; the
    standard library's JSON encoder and decoder take a few hundred bytes of it a level.)"""
    try:
        return function(*args, **kwargs)
    except RecursionError:
        pass
    global _deep_calls, _usual_limit
    # The limit is the interpreter's, not a thread's: raised by the first deep call, put back
    # by the last one to end (the lock is held only for that; a thread never waits for another
    # thread's deep call to end: the event loop would stall meanwhile).
    with _DEEP_LOCK:
        if _deep_calls == 0:
            _usual_limit = sys.getrecursionlimit()
            sys.setrecursionlimit(_usual_limit + _DEEP_FRAMES)
        _deep_calls += 1
    try:
        return function(*args, **kwargs)
    finally:
        with _DEEP_LOCK:
            _deep_calls -= 1
            if _deep_calls == 0:
                sys.setrecursionlimit(_usual_limit)


def deep_dumps(value: Any, **options: Any) -> str:
    """``json.dumps(value, **options)`` for a value as deep as cachegate reads (``deep_call``):
    where orjson refuses to write (past 254 levels), the standard library's encoder writes it."""
    return deep_call(json.dumps, value, **options)


def json_size(value: Any) -> int:
    """How many bytes ``value`` takes as compact JSON: orjson's count, or the standard library's
    for what orjson does not write (content nested deeper than 254 levels, which a client may
    send; an integer beyond 64 bits)."""
    try:
        return len(orjson.dumps(value))
    except TypeError:
        return len(
            deep_dumps(value, ensure_ascii=False, separators=(",", ":"), default=str).encode()
        )


def canonical_json(value: Any) -> bytes:
    """Canonical JSON bytes of ``value``: sorted keys, compact, UTF-8."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        # orjson refuses integers beyond 64 bits, which a stdlib-parsed body may hold.
        return deep_dumps(
            value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str
        ).encode()


def find_divergence(
    old: Fingerprint,
    new: Fingerprint,
    old_body: Mapping[str, Any],
    new_body: Mapping[str, Any],
    secrets: tuple[str, ...] = (),
) -> Divergence | None:
    """The first element of ``new`` that differs from ``old``; None when one prefixes the other.

    A request that extends the previous one (its messages plus the assistant reply plus new
    messages) is no divergence, and neither is one that stops early (a retry or rewind): no element
    the provider processed was rewritten. ``secrets`` are exact values (the operator's API key)
    replaced in the texts before an excerpt is cut from them, so that no part of one is shown
    whatever its shape: a cut through a value leaves a piece no later search for it can find.
    """
    # (location, link) pairs: equal links at a position mean equal locations too (a different
    # system block changes the link before the first message's).
    shared = min(len(old.chain), len(new.chain))
    if old.chain[:shared] == new.chain[:shared]:
        return None
    position = leading_run(operator.eq, old.chain, new.chain)
    if position == _PARAMS:
        return _params_divergence(old_body, new_body, secrets)
    if position < _FIRST_MESSAGE and old.system_first is not new.system_first:
        # (a chat request and a Responses API one, each hashed in its order: the first of
        # the two that differs, in the new one's)
        tools = old.tools_digest != new.tools_digest
        system = old.system_digest != new.system_digest or old.system_count != new.system_count
        if tools and (not system or not new.system_first):
            position = new.tools_at
        elif system:
            position = new.system_at
        else:  # (alike but for the order: the messages after)
            old_rest, new_rest = old.element_digests, new.element_digests
            position = _FIRST_MESSAGE + leading_run(
                operator.eq, old_rest[_FIRST_MESSAGE:], new_rest[_FIRST_MESSAGE:]
            )
            if position >= min(len(old_rest), len(new_rest)):
                return None
    if position == new.tools_at:
        return _tools_divergence(old.tools, new.tools, secrets)
    if position == new.system_at:
        shorter, longer = sorted((old, new), key=lambda fp: fp.system_count)
        if (
            len(shorter.messages) == shorter.system_count
            and longer.message_digests[: shorter.system_count] == shorter.message_digests
        ):
            # A request of system messages only, which the other one's system block extends.
            return None
        index = next(
            (
                i
                for i in range(max(old.system_count, new.system_count))
                if i >= old.system_count
                or i >= new.system_count
                or old.message_digests[i] != new.message_digests[i]
            ),
            0,
        )
        old_message = old.messages[index] if index < old.system_count else None
        new_message = new.messages[index] if index < new.system_count else None
        # One or more system messages gone (the rest moved up in their place), or put in
        # before the rest: no edit of the one that moved (a memory message dropped was named
        # an edit of it into the repo map after it)
        old_block = old.message_digests[index : old.system_count]
        new_block = new.message_digests[index : new.system_count]
        if old_message is not None and new_message is not None:
            if len(old_block) > len(new_block) and old_block[-len(new_block) :] == new_block:
                new_message = None
            elif len(new_block) > len(old_block) and new_block[-len(old_block) :] == old_block:
                old_message = None
        return _message_divergence("system", index, old_message, new_message, secrets)
    index = new.system_count + position - _FIRST_MESSAGE
    old_message = old.messages[index] if index < len(old.messages) else None
    new_message = new.messages[index] if index < len(new.messages) else None
    moved = _moved(old.message_digests, new.message_digests, index)
    if moved is None:
        return _message_divergence("messages", index, old_message, new_message, secrets)
    if moved == "vanished":  # (a history trimmed at its start or in its middle)
        new_message = None
    else:  # (a message put in before the ones the provider had read)
        old_message = None
    found = _message_divergence("messages", index, old_message, new_message, secrets)
    # A whole message, not a token in one (a dated message dropped is no timestamp changed)
    return dataclasses.replace(
        found, volatile=False, volatile_kind=None, vanished=moved == "vanished"
    )


def _moved(old: Sequence[bytes], new: Sequence[bytes], index: int) -> str | None:
    """Whether the messages differ at ``index`` because ``old``'s messages from there vanished
    (what ``new`` has from ``index`` on is what ``old`` sent later, as far as both go: a history
    trimmed at its start or in its middle), or because ``new``'s appeared (the other way round);
    None for an edit in place (what follows lines up as it was). The first message kept may be
    one of cachegate's own in place of the client's (a result whose call was trimmed, repaired
    into a user message), or a few of them (the results of parallel calls): then what follows
    them must line up, two messages at least."""
    if index >= len(old) or index >= len(new):
        return None
    if index + 1 >= min(len(old), len(new)):  # the last message of either: nothing follows
        if len(old) == index + 1 < len(new) and old[index] in new[index + 1 : index + 3]:
            return "appeared"  # (one or two put in before the previous request's last message)
        return None  # (a rewind whose retyped text is a later message's stays an edit)
    if new[index + 1 : len(old)] == old[index + 1 : len(new)]:
        return None  # the rest lines up where it was: an edit of this one
    if _carried_later(old, new, index):
        return "vanished"
    if _carried_later(new, old, index):
        return "appeared"
    return None


def _carried_later(longer: Sequence[bytes], other: Sequence[bytes], index: int) -> bool:
    """Whether ``other`` from ``index`` on is ``longer`` from a later place on (as far as both
    go), or, with ``other``'s messages from ``index`` on ones ``longer`` never had (up to
    ``_MADE_ANEW``), whether what follows them is (two messages at least). (The places are
    found by ``index``, at C speed: this runs for every request that differs from the closest
    of its session, a sub-agent's beside a long history too.)"""
    rest = other[index:]
    count = len(longer)
    at = index
    while True:  # each later place of other's message there
        try:
            at = longer.index(rest[0], at + 1)
        except ValueError:
            break
        span = min(len(rest), count - at)
        # (a short head first: a message that recurs through a long history, an agent's fixed
        # nudge, made each place a copy of the rest, quadratic: 0.35 s for 16,000 messages)
        head = min(span, _HEAD)
        if (
            longer[at : at + head] == rest[:head]
            and longer[at + span - 1] == rest[span - 1]  # (and its last: a run that repeats)
            and longer[at : at + span] == rest[:span]
        ):
            return True
    for made in range(1, _MADE_ANEW + 1):  # messages of other's own first, then what follows
        if len(rest) < made + 2 or rest[made - 1] in longer:
            return False
        at = index + made  # (where it would be, had nothing vanished: not a place later)
        while True:  # each later place of the first message after them
            try:
                at = longer.index(rest[made], at + 1)
            except ValueError:
                break
            span = min(len(rest) - made, count - at)
            head = min(span, _HEAD)
            if (
                span >= 2
                and longer[at : at + head] == rest[made : made + head]
                and longer[at + span - 1] == rest[made + span - 1]
                and longer[at : at + span] == rest[made : made + span]
            ):
                return True
    return False


_HEAD: Final = 8  # (``_carried_later``: the messages compared before the rest is)

# Messages of its own a request may start its kept history with, where a trim cut a tool round
# in two: each result of parallel calls whose call was trimmed, repaired into a user message
_MADE_ANEW: Final = 4


def shared_links(old: Fingerprint, new: Fingerprint) -> int:
    """How many leading links of their chains the two requests share: ``params``, ``tools``,
    ``system`` (or ``system``, ``tools``), then one per message. A link's digest covers every
    element before it, so equal links at a position mean equal chains up to it: a binary
    search, ~10 comparisons for a history of 400 messages."""
    old_chain, new_chain = old.chain, new.chain
    lo, hi = 0, min(len(old_chain), len(new_chain))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if old_chain[mid - 1][1] == new_chain[mid - 1][1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def shared_past_params(old: Fingerprint, new: Fingerprint) -> int:
    """``shared_links`` as if the two requests' parameters were alike: the tools, the system
    prompt and the leading messages they share (a turn after one that forced a tool or asked
    for more reasoning carries that one's history on, though no link of its chain is equal)."""
    tools = old.tools_digest == new.tools_digest
    system = old.system_digest == new.system_digest and old.system_count == new.system_count
    first, second = (system, tools) if new.system_first else (tools, system)
    if not first:
        return 1
    if not second:
        return 2
    return 3 + leading_run(
        operator.eq,
        old.message_digests[old.system_count :],
        new.message_digests[new.system_count :],
    )


def prompt_and_tools_differ(old: Fingerprint, new: Fingerprint) -> bool:
    """Whether the two requests differ in both their system prompt and their tools."""
    return old.system_digest != new.system_digest and old.tools_digest != new.tools_digest


def side_request(old: Fingerprint, new: Fingerprint) -> bool:
    """Whether ``new`` is a request an agent sends beside ``old``'s conversation, not in it: a
    title request, under a system prompt of its own, on another model, or on the same one with
    other tools and a single message (see ``same_conversation``)."""
    if old.system_digest == new.system_digest:
        return False
    if (old.params or {}).get("model") != (new.params or {}).get("model"):
        return True
    return old.tools_digest != new.tools_digest and len(new.message_digests) - new.system_count == 1


def same_conversation(old: Fingerprint, new: Fingerprint) -> bool:
    """Whether ``new`` continues or rewrites ``old``'s conversation rather than starting another:
    one of its messages after the system block is one of ``old``'s, wherever (or neither has
    any). A sub-agent, a title or summary request, or a conversation started afresh under the
    same session begins with a message of its own and shares none; a rewritten system prompt,
    tools or parameters leave the messages as they were, and a history trimmed at its start or
    compacted keeps its later ones. (The caller also takes a change of a volatile token alone as
    a rewrite: a date in the only message of a first turn.) A request with another model and
    another system prompt is another conversation whatever its messages: a title request sends
    the user's first message to a small model under a prompt of its own. So is one on the same
    model with another system prompt and other tools that holds a single message (a title
    request on the main model). A history rewound or trimmed while the tools changed (an MCP
    server connected), or a turn with the tools switched off, is still the conversation.
    """
    if side_request(old, new):
        return False
    old_messages = old.message_digests[old.system_count :]
    new_messages = new.message_digests[new.system_count :]
    if not old_messages or not new_messages:
        return not old_messages and not new_messages
    if len(new_messages) == 1 < len(old_messages) and old.system_digest != new.system_digest:
        # Its opening alone under a prompt of its own, where ``old``'s conversation went on
        # past it: a new chat that opens alike ("hi"), a title request with the agent's own
        # tools; it carries nothing of ``old``'s but the opening. Read as a rewrite, its whole
        # prompt was charged as waste. (Two first turns alike under two prompts stay a
        # rewrite: a first message resent under an edited prompt looks the same.)
        return False
    if old_messages[0] == new_messages[0]:  # the usual case: the same opening
        return True
    held = set(old_messages)
    return any(digest in held for digest in new_messages)


def same_opening(old: Fingerprint, new: Fingerprint) -> bool:
    """Whether both open their messages, past the system block, with the same one."""
    old_messages = old.message_digests[old.system_count :]
    new_messages = new.message_digests[new.system_count :]
    return bool(old_messages and new_messages) and old_messages[0] == new_messages[0]


def retimed_messages(old_body: Mapping[str, Any], new_body: Mapping[str, Any]) -> bool:
    """Whether the messages of ``new_body`` past its system block are those of ``old_body``, as
    many, each the same or differing in a volatile token alone (a first turn sent again with
    the time in its only message: a retry a minute later). Only what ``same_conversation``
    could not tell: histories that share no message are short."""
    old_messages, new_messages = old_body.get("messages"), new_body.get("messages")
    if not isinstance(old_messages, list) or not isinstance(new_messages, list):
        return False
    old_rest = old_messages[leading_system_count(old_messages) :]
    new_rest = new_messages[leading_system_count(new_messages) :]
    if not old_rest or len(old_rest) != len(new_rest) or len(new_rest) > _RETIMED_MAX:
        return False
    return _each_same_or_retimed(old_rest, new_rest)


_RETIMED_MAX: Final = 8  # messages compared so at most (a longer history shares one untouched)


def dropped_elements(
    old: Fingerprint,
    new: Fingerprint,
    media_tokens: Callable[[Any], int] | None = None,
    held: Iterable[bytes] = (),
    carried: int = 0,
) -> list[tuple[Any, float]]:
    """What ``old`` sent, past its first difference from ``new``, that ``new`` no longer holds,
    as ``(message, share)``: its messages found nowhere in ``new`` (a trimmed start, a rewind's
    abandoned turns) whole, and those edited in place for the share of them that changed. A
    message of ``old`` is edited in place where ``new`` has, at its position, a message ``old``
    never sent and ``new`` goes on past it (a message ``old`` sent follows, or ``new`` is the
    longer: a timestamp in every message, tool call ids made anew each request), not where
    ``new`` ends there (a rewind to that message, an edited last message: a branch). The share
    kept of an edited message is the start and end its compact JSON shares with its new
    version (a timestamp put in keeps nearly all; a tool output cut to "[trimmed]", or another
    message in its place, nearly none), an image or other media part weighing what
    ``media_tokens`` says it costs, not its base64 (a screenshot taken out of a message keeps
    the message's text). The tools and parameters are at fixed places: a changed one is edited,
    never dropped; a changed system block's messages are dropped for the share of its text
    that changed (``_kept_block_share``). A message whose digest is in ``held`` is held too
    (the client sent it, and cachegate's repair changed it). ``carried``: ``new``'s first ``carried``
    elements (``element_digests``) are those of a request the provider read, which ``new``
    carries on (an interrupted one, whose count was ``old``'s): only what they hold is held
    (a message ``new`` sends again after them cannot be read there), and a message of theirs
    in the place of one of ``old``'s is its edit, wherever they end (no branch of ``new``'s)."""
    shared = shared_links(old, new)
    old_elements, new_elements = old.element_digests, new.element_digests
    if shared >= len(old_elements):
        return []
    in_new = set(new_elements[_PARAMS + 1 : carried or None])  # (the tools, system and on)
    in_new.update(held)
    in_old = set(old_elements[_PARAMS + 1 :])
    first = max(shared, _FIRST_MESSAGE)
    kept = [p for p in range(first, len(old_elements)) if old_elements[p] in in_new]
    last_kept = kept[-1] if kept else -1
    longer = len(new_elements) > len(old_elements)
    old_offset = old.system_count - _FIRST_MESSAGE
    new_offset = new.system_count - _FIRST_MESSAGE
    dropped: list[tuple[Any, float]] = []
    if shared <= old.system_at and old.system_count and old.system_digest != new.system_digest:
        # What changed of the system block could not be read either: a prompt that keeps its
        # text and changes the time keeps nearly all of it, another document in its place
        # (a batch of documents asked the same question) nearly none.
        old_block, new_block = old.messages[: old.system_count], new.messages[: new.system_count]
        kept_share = _kept_block_share(old_block, new_block)
        if kept_share < 1.0:
            dropped.extend((message, 1.0 - kept_share) for message in old_block)
    for position in range(first, len(old_elements)):
        if old_elements[position] in in_new:
            continue
        message = old.messages[old_offset + position]
        share = 1.0
        if position < len(new_elements) and new_elements[position] not in in_old:
            other = new.messages[new_offset + position]
            if position < carried or longer or position < last_kept or _retimed(message, other):
                share = 1.0 - _kept_share(message, other, media_tokens)
        if share > 0:
            dropped.append((message, share))
    return dropped


def retimed_system(old_body: Mapping[str, Any], new_body: Mapping[str, Any]) -> bool:
    """Whether the system blocks of two requests are as many messages, each the same or
    differing in a volatile token alone (the time in a prompt), so that the requests differ
    before their messages by the time alone: not a role or task system message of another
    agent's after a dated one."""
    old_messages, new_messages = old_body.get("messages"), new_body.get("messages")
    if not isinstance(old_messages, list) or not isinstance(new_messages, list):
        return False
    count = leading_system_count(old_messages)
    if not count or leading_system_count(new_messages) != count:
        return False
    return _each_same_or_retimed(old_messages[:count], new_messages[:count])


def unrelated_first_turns(old_body: Mapping[str, Any], new_body: Mapping[str, Any]) -> bool:
    """Whether two requests are first turns (one message past the system block each) under
    system prompts that share next to nothing: less than half of the shorter one's text, at
    their start and end together, and in the lines both hold, and no start a provider could
    read (``_READABLE_HEAD``). Two agents given one task under
    prompts of their own (a sub-agent handed the user's request word for word, persona
    reviewers given one task): not a first turn sent again under an edited prompt, which keeps
    most of it (the time changed at its top, the open file at its bottom, a line added)."""
    old_messages, new_messages = old_body.get("messages"), new_body.get("messages")
    if not isinstance(old_messages, list) or not isinstance(new_messages, list):
        return False
    old_count, new_count = leading_system_count(old_messages), leading_system_count(new_messages)
    if len(old_messages) - old_count != 1 or len(new_messages) - new_count != 1:
        return False
    a = _prompt_text(old_messages[:old_count])
    b = _prompt_text(new_messages[:new_count])
    if a is None or b is None or a == b:
        return False
    shorter = min(len(a), len(b))
    head = common_prefix_length(a, b)
    if head >= _READABLE_HEAD:  # (a provider may read that much of the prompt: a rewrite)
        return False
    tail = common_prefix_length(a[::-1], b[::-1]) if head < shorter else 0
    if min(head + tail, shorter) * 2 >= shorter:
        return False
    lines = set(a.split("\n"))
    shared = sum(len(line) + 1 for line in set(b.split("\n")) if line in lines)
    return shared * 2 < shorter


# The most of a prompt two unrelated ones may share at their start (``unrelated_first_turns``):
# ~256 tokens, under any provider's least cached prefix (OpenAI's 1,024 tokens).
_READABLE_HEAD: Final = 1024


def _prompt_text(system: Sequence[Any]) -> str | None:
    """The text of a system block (its messages' string contents and text parts), or None
    where it holds anything else."""
    texts: list[str] = []
    for message in system:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, Mapping) else None
                if not isinstance(text, str):
                    return None
                texts.append(text)
        else:
            return None
    return "\n".join(texts)


def _each_same_or_retimed(old: Sequence[Any], new: Sequence[Any]) -> bool:
    """Whether each message of ``new`` is the one of ``old`` at its place (the same JSON) or
    differs from it in a volatile token alone (``_retimed``); as many of each."""
    return all(
        a is b
        or canonical_json(canonical_message(a)) == canonical_json(canonical_message(b))
        or _retimed(a, b)
        for a, b in zip(old, new, strict=True)
    )


def _retimed(old: Any, new: Any) -> bool:
    """Whether ``new`` is ``old`` with a volatile token changed in its content and nothing else
    (the last message sent again a minute later with the time in it: the same message, not a
    rewind to an edited one)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return False
    old_c, new_c = canonical_message(old), canonical_message(new)
    if not deep_equal(  # (a tool call's arguments nested ~1,000 levels: the comparison recurses)
        {k: v for k, v in old_c.items() if k != "content"},
        {k: v for k, v in new_c.items() if k != "content"},
    ):
        return False
    return (
        volatile_kind(_text(old_c.get("content", _MISSING)), _text(new_c.get("content", _MISSING)))
        is not None
    )


def dropped_tools(old: Any, new: Any) -> list[tuple[Any, float]]:
    """What of the tools ``old`` that ``new`` no longer sends, as ``(tool, share)``: each tool
    of a list for the share of it that ``new`` changed, its start and end kept as an edited
    message's (a shortened description), compared with ``new``'s tool of its name, else (a tool
    renamed, an MCP server's tools swapped for another's) with the one of ``new``'s tools of
    names none of ``old``'s had that keeps the most of it, wherever it is (a renamed tool keeps
    all but its name; another's tools keep next to nothing), else gone whole. Tools without
    names (a Responses API hosted tool), and anything but a list, by equality."""
    if old == new or not old:
        return []
    if not isinstance(old, list):
        return [(old, 1.0)]
    fresh = new if isinstance(new, list) else []
    old_names = [_tool_name(tool) for tool in old]
    named = set(old_names)
    by_name: dict[Any, list[Any]] = {}  # name -> new's tools of it, in order
    for tool in fresh:
        by_name.setdefault(_tool_name(tool), []).append(tool)
    # new's tools of names none of old's had: those a renamed tool may be (compared with each,
    # only where a tool's name is gone: a few tools, and only when the tools changed)
    unnamed = [t for t in fresh if _tool_name(t) is not None and _tool_name(t) not in named]
    taken: list[Any] = []
    seen: dict[Any, int] = {}
    gone: list[tuple[Any, float]] = []
    for tool, name in zip(old, old_names, strict=True):
        nth = seen[name] = seen.get(name, -1) + 1
        if name is None:
            if tool not in fresh:
                gone.append((tool, 1.0))
            continue
        same = by_name.get(name, [])
        if tool in same:  # (sent as it was: a name given twice, reordered, too)
            continue
        if nth < len(same):  # (its name's nth: a name given twice, each in its turn)
            other: Any = same[nth]
        else:  # (renamed, perhaps moved too: the new tool of a new name that keeps most of it)
            other = max(
                (t for t in unnamed if t not in taken),
                key=lambda t: _kept_share(tool, t),
                default=None,
            )
            if other is None:
                gone.append((tool, 1.0))
                continue
            taken.append(other)
        if other != tool:
            share = 1.0 - _kept_share(tool, other)
            if share > 0:
                gone.append((tool, share))
    return gone


def _kept_share(old: Any, new: Any, media_tokens: Callable[[Any], int] | None = None) -> float:
    """The share of ``old``'s compact JSON that ``new`` keeps as its start and its end (of
    their text when both are plain text messages of one role: nothing to serialize; with each
    media part as long as ``media_tokens`` weighs it, when given)."""
    a: str | bytes
    b: str | bytes
    if (
        isinstance(old, dict)
        and isinstance(new, dict)
        and type(old.get("content")) is str
        and type(new.get("content")) is str
        and old.keys() == new.keys()
        and old.get("role") == new.get("role")
        and all(old[k] == new[k] for k in old if k != "content")
    ):
        a, b = old["content"], new["content"]
    elif media_tokens is not None and (_has_media(old) or _has_media(new)):
        a, b = _weighed(old, media_tokens), _weighed(new, media_tokens)
    else:
        a, b = canonical_json(canonical_message(old)), canonical_json(canonical_message(new))
    if not a:
        return 1.0
    most = min(len(a), len(b))
    head = _common_run(most, lambda n: a[:n] == b[:n])
    tail = _common_run(most - head, lambda n: a[len(a) - n :] == b[len(b) - n :])
    return (head + tail) / len(a)


def _weighed(message: Any, media_tokens: Callable[[Any], int]) -> bytes:
    """``message``'s compact JSON as parts, each media part of its content (an image's base64)
    replaced by a run of its digest as many bytes long as ``media_tokens`` says it costs (four a
    token), so that shares of it are shares of what the provider counts; a content of text is
    its one text part."""
    if not isinstance(message, Mapping):
        return canonical_json(message)
    content = message.get("content")
    head = {k: v for k, v in message.items() if k != "content" and v is not None}
    pieces = [canonical_json(canonical_message(head))]
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    for part in parts if isinstance(parts, list) else []:
        if _is_media(part):
            size = 4 * media_tokens(part)
            mark = _digest(part).hex().encode()
            pieces.append((mark * (size // len(mark) + 1))[:size])
        elif isinstance(part, Mapping):
            pieces.append(canonical_json({k: v for k, v in part.items() if k not in _NOT_PROMPT}))
        else:
            pieces.append(canonical_json(part))
    return b"\x00".join(pieces)


def _has_media(message: Any) -> bool:
    content = message.get("content") if isinstance(message, Mapping) else None
    return isinstance(content, list) and any(_is_media(part) for part in content)


# A message's parts that are no text: an image, audio or a file (the compaction's estimate
# counts them by what they cost, not by their base64, as the kept shares here do)
MEDIA_PART_TYPES: Final = frozenset({"image_url", "input_image", "image", "input_audio", "file"})


def _is_media(part: Any) -> bool:
    if not isinstance(part, Mapping):
        return False
    kind = part.get("type")  # (a list or an object there: not hashed, no media)
    return type(kind) is str and kind in MEDIA_PART_TYPES


def _kept_block_share(old: Sequence[Any], new: Sequence[Any]) -> float:
    """The share of the old system block's text that the new one keeps: the start and end
    they share and, between them, the pieces of the old middle (lines, or sentences of a long
    line: JSON text's escaped line ends split it too) the new middle holds in the same order
    (``_kept_pieces``). A prompt with the time at its top and the open files at its bottom
    keeps all but those two; another document in its place nearly nothing (the lines
    documents of one format share, braces, repeated fields, page headers, anchor nothing).
    Past ``_BLOCK_PIECES_MAX`` characters of middle, the start and end alone (the pieces cost
    ~90 ms a megabyte of lines on the event loop, ~280 of blank lines)."""
    a, b = _block_text(old), _block_text(new)
    if not a:
        return 1.0
    head = common_prefix_length(a, b)
    tail = _common_suffix_len(a, b, min(len(a), len(b)) - head)
    middle = a[head : len(a) - tail]
    found = 0
    if middle and len(middle) <= _BLOCK_PIECES_MAX:
        found = _kept_pieces(_PIECE_END.split(middle), _PIECE_END.split(b[head : len(b) - tail]))
    return min(1.0, (head + tail + found) / len(a))


_PIECE_END: Final = re.compile(r"\n|\\n|(?<=[.!?;])[ \t]+")
_PIECE_MIN: Final = 8


def _kept_pieces(old: list[str], new: list[str]) -> int:
    """The characters of ``old``'s pieces that ``new`` holds in the same order: pieces each holds
    exactly once (of ``_PIECE_MIN`` characters or more) are anchors, those in the same order in
    both are kept (the longest such run of them, as patience diff takes them), and each kept
    anchor keeps the equal pieces next to it on either side, repeated or short ones too (an
    unchanged code block's ``return None`` lines). Two documents of one format share lines
    (braces, fields) but few anchors, and those seldom next to one another."""
    ours, theirs = Counter(old), Counter(new)
    at = {piece: j for j, piece in enumerate(new) if theirs[piece] == 1}
    anchors = [
        (i, at[piece])
        for i, piece in enumerate(old)
        if ours[piece] == 1 and len(piece) >= _PIECE_MIN and piece in at
    ]
    kept = [False] * len(old)
    used = -1  # the last piece of ``new`` paired so far: none is paired twice
    for i, j in _in_order(anchors):
        kept[i] = True
        back_i, back_j = i - 1, j - 1
        while back_i >= 0 and back_j > used and not kept[back_i] and old[back_i] == new[back_j]:
            kept[back_i] = True
            back_i, back_j = back_i - 1, back_j - 1
        on_i, on_j = i + 1, j + 1
        while on_i < len(old) and on_j < len(new) and not kept[on_i] and old[on_i] == new[on_j]:
            kept[on_i] = True
            on_i, on_j = on_i + 1, on_j + 1
        used = on_j - 1
    # (and the line end or blank after each)
    return sum(len(piece) + 1 for piece, held in zip(old, kept, strict=True) if held)


def _in_order(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The longest run of ``pairs`` (in increasing first order) whose second items increase
    too (patience sorting: ``n log n``)."""
    tops: list[int] = []  # the smallest last second item of a run of each length
    ends: list[int] = []  # the index in ``pairs`` of that run's last pair
    before = [-1] * len(pairs)
    for k, (_, j) in enumerate(pairs):
        length = bisect.bisect_left(tops, j)
        if length == len(tops):
            tops.append(j)
            ends.append(k)
        else:
            tops[length], ends[length] = j, k
        before[k] = ends[length - 1] if length else -1
    run = []
    k = ends[-1] if ends else -1
    while k >= 0:
        run.append(pairs[k])
        k = before[k]
    return run[::-1]


_BLOCK_PIECES_MAX: Final = 512 * 1024


def _block_text(messages: Sequence[Any]) -> str:
    """A system block's text: its messages' contents one after another (text parts as their
    text, anything else as its JSON)."""
    out = []
    for message in messages:
        content = message.get("content", _MISSING) if isinstance(message, Mapping) else message
        if isinstance(content, list) and all(
            isinstance(part, Mapping) and isinstance(part.get("text"), str) for part in content
        ):
            out.append("\n".join(part["text"] for part in content))
        else:
            out.append(_text(content))
    return "\n".join(out)


def _common_run(most: int, same: Callable[[int], bool]) -> int:
    """The longest ``n`` up to ``most`` for which ``same(n)`` holds (a binary search of slice
    comparisons, at C speed, where a loop over the bytes would not be)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if same(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def shared_prefix_len(old: Fingerprint, new: Fingerprint) -> int:
    """How many leading messages of ``body["messages"]`` the two requests share (system included).

    Compares messages only, in canonical form, whatever the params and tools; for the cache
    question (does the whole prefix match?) use ``find_divergence``.
    """
    shared = 0
    for old_digest, new_digest in zip(old.message_digests, new.message_digests, strict=False):
        if old_digest != new_digest:
            break
        shared += 1
    return shared


def _digest(value: Any) -> bytes:
    return hashlib.blake2b(canonical_json(value), digest_size=DIGEST_SIZE).digest()


def message_digest(message: Any) -> bytes:
    """A message's digest, as ``Fingerprint.message_digests`` holds it."""
    return _digest(canonical_message(message))


def tools_json(tools: Any) -> bytes:
    """The canonical JSON of tools (an array, or one tool): keys sorted, but for the
    ``properties`` of their schemas, which a provider renders into the prompt as parameters in
    the order sent (reordered, the cache misses; other keys are read by name); without a tool's
    ``cache_control`` breakpoint, no part of the prompt (as a message's is not)."""
    if type(tools) is list:
        tools = [_unmarked_tool(tool) for tool in tools]
    else:
        tools = _unmarked_tool(tools)
    return schema_json(tools)


def schema_json(value: Any) -> bytes:
    """The JSON of ``value`` with its keys sorted, but for the ``properties`` of schemas (a
    tool's parameters, a ``response_format``'s JSON schema), which a provider renders into the
    prompt in the order sent."""
    ordered = deep_call(schema_order, value)  # (a schema may be nested as deep as JSON is read)
    try:
        return orjson.dumps(ordered)
    except TypeError:  # integers beyond 64 bits, content deeper than orjson writes
        return deep_dumps(ordered, ensure_ascii=False, separators=(",", ":"), default=str).encode()


def _params_digest(params: Mapping[str, Any]) -> bytes:
    """The cache parameters' digest: a ``response_format`` schema's properties reordered miss
    the cache, as a tool's do (``schema_json``)."""
    return hashlib.blake2b(schema_json(params), digest_size=DIGEST_SIZE).digest()


def _unmarked_tool(tool: Any) -> Any:
    """``tool`` without a ``cache_control`` of its own or of its ``function`` (the same object
    when it has none)."""
    if not isinstance(tool, Mapping):
        return tool
    function = tool.get("function")
    if not isinstance(function, Mapping) or "cache_control" not in function:
        function = None
    if "cache_control" not in tool and function is None:
        return tool
    out = {key: value for key, value in tool.items() if key != "cache_control"}
    if function is not None:
        out["function"] = {key: value for key, value in function.items() if key != "cache_control"}
    return out


def schema_order(value: Any) -> Any:
    """``value`` (tools) with its keys sorted, but for the ``properties`` of schemas."""
    if isinstance(value, Mapping):
        return {
            key: (
                {name: schema_order(v) for name, v in item.items()}
                if key == "properties" and isinstance(item, Mapping)
                else schema_order(item)
            )
            for key, item in sorted(value.items(), key=operator.itemgetter(0))
        }
    if isinstance(value, list):
        return [schema_order(item) for item in value]
    return value


def _tools_digest(tools: Any) -> bytes:
    return hashlib.blake2b(tools_json(tools), digest_size=DIGEST_SIZE).digest()


def same_as_sent(a: Any, b: Any) -> bool:
    """Whether two parsed JSON values (tools arrays, runs of messages) are the same as sent,
    keys in the same order: Python's equality ignores the order (a replay must not, nor a
    provider, for a schema's properties) and takes ``true``, ``1`` and ``1.0`` for equal."""
    if a is b:
        return True
    try:
        equal = a == b
    except RecursionError:  # (nested past ~990 levels)
        equal = deep_equal(a, b)
    if not equal:
        return False
    try:
        return orjson.dumps(a) == orjson.dumps(b)
    except TypeError:  # past the 254 levels orjson writes, or integers beyond 64 bits
        return _same_dumps(a, b)


def deep_equal(a: Any, b: Any) -> bool:
    """``a == b`` for values nested as deep as cachegate reads (``deep_call``): Python's
    comparison recurses (past ~990 levels: a session whose history held such a message answered
    every later request with a 500)."""
    return deep_call(operator.eq, a, b)


def _same_dumps(a: Any, b: Any, sort_keys: bool = False) -> bool:
    """Whether the standard library writes ``a`` and ``b`` alike (what orjson cannot write)."""
    try:
        return deep_dumps(a, sort_keys=sort_keys) == deep_dumps(b, sort_keys=sort_keys)
    except (TypeError, ValueError):
        return False


def same_json(a: Any, b: Any) -> bool:
    """Whether two parsed JSON values are the same JSON in any key order (number types
    included: ``1``, ``1.0`` and ``true`` are equal to Python)."""
    try:
        equal = a == b
    except RecursionError:  # (nested past ~990 levels)
        equal = deep_equal(a, b)
    if not equal:
        return False
    try:  # equal to Python: the same when serialized (C speed, where a walk would be Python's)
        sort = orjson.OPT_SORT_KEYS
        return bool(orjson.dumps(a, option=sort) == orjson.dumps(b, option=sort))
    except TypeError:  # past the 254 levels orjson writes, or integers beyond 64 bits
        return _same_dumps(a, b, sort_keys=True)


def _role(message: Any) -> Any:
    if type(message) is dict:  # what a parsed body holds; skips the ABC check
        return message.get("role")
    return message.get("role") if isinstance(message, Mapping) else None


def _tools_text(value: Any) -> str:
    """Tools as the text an excerpt is cut from: in the order sent, as they are compared."""
    if value is _MISSING:
        return ""
    return tools_json(value).decode("utf-8", "replace")


def _text(value: Any) -> str:
    """A field's value as the text an excerpt is cut from."""
    if value is _MISSING:
        return ""
    if isinstance(value, str):
        return value
    return canonical_json(value).decode("utf-8", "replace")


_MISSING: Final = object()
# Message keys are compared in this order first, the rest alphabetically.
_FIELD_ORDER: Final = ("role", "content", "tool_calls", "tool_call_id", "name")


def message_divergence(
    index: int, old_message: Any, new_message: Any, secrets: tuple[str, ...] = ()
) -> Divergence:
    """The difference of two versions of the message at ``index`` of ``messages``."""
    return _message_divergence("messages", index, old_message, new_message, secrets)


def _message_divergence(
    location: Location, index: int, old_message: Any, new_message: Any, secrets: tuple[str, ...]
) -> Divergence:
    role = _role(new_message) if new_message is not None else _role(old_message)
    role_text = role if isinstance(role, str) else None
    if not isinstance(old_message, Mapping) or not isinstance(new_message, Mapping):
        # A message appeared or vanished (or is not an object): show the content that is there.
        def content(message: Any) -> str:
            if message is None:
                return ""
            if isinstance(message, Mapping):
                canonical = canonical_message(message)
                found = canonical.get("content", _MISSING)
                kind = _item_type(message)
                if found is _MISSING and isinstance(kind, str) and kind != "message":
                    return kind  # (an item with no content, a reasoning item: its type)
                if (found is _MISSING or found is None or found == "") and canonical.get(
                    "tool_calls"
                ):
                    return _text(canonical["tool_calls"])  # (an assistant's calls, no text)
                return _text(found)
            return _text(message)

        return _divergence(
            location, index, role_text, None, content(old_message), content(new_message), secrets
        )

    old_c, new_c = canonical_message(old_message), canonical_message(new_message)
    # (a Responses API message item's type, which its canonical form leaves out, is "message")
    old_type, new_type = _item_type(old_message), _item_type(new_message)
    if old_type is not None and new_type is not None and old_type != new_type:
        # Another item in its place (a Responses API request whose reasoning items were
        # dropped: a call where one was): its type first, not the first field the other has
        return _divergence(
            location, index, role_text, "type", _text(old_type), _text(new_type), secrets
        )
    keys = [k for k in _FIELD_ORDER if k in old_c or k in new_c]
    keys += sorted((set(old_c) | set(new_c)) - set(_FIELD_ORDER), key=str)
    for key in keys:
        old_value, new_value = old_c.get(key, _MISSING), new_c.get(key, _MISSING)
        if (
            old_value is _MISSING
            or new_value is _MISSING
            or canonical_json(old_value) != canonical_json(new_value)
        ):
            return _divergence(
                location, index, role_text, str(key), _text(old_value), _text(new_value), secrets
            )
    # Equal canonical forms yet different digests cannot happen; report the whole message.
    return _divergence(location, index, role_text, None, _text(old_c), _text(new_c), secrets)


def _params_divergence(
    old_body: Mapping[str, Any], new_body: Mapping[str, Any], secrets: tuple[str, ...]
) -> Divergence:
    old_params, new_params = cache_params(old_body), cache_params(new_body)
    for key in CACHE_PARAMS:
        old_value, new_value = old_params.get(key, _MISSING), new_params.get(key, _MISSING)
        if (old_value is _MISSING) != (new_value is _MISSING) or (
            old_value is not _MISSING and schema_json(old_value) != schema_json(new_value)
        ):
            old_excerpt, new_excerpt = _excerpts(_text(old_value), _text(new_value), secrets)
            return Divergence("params", None, None, key, old_excerpt, new_excerpt)
    old_excerpt, new_excerpt = _excerpts(_text(old_params), _text(new_params), secrets)
    return Divergence("params", None, None, None, old_excerpt, new_excerpt)


def _tools_divergence(old_tools: Any, new_tools: Any, secrets: tuple[str, ...]) -> Divergence:
    if not isinstance(old_tools, list) or not isinstance(new_tools, list):
        old_text, new_text = _tools_text(old_tools), _tools_text(new_tools)
        return _divergence("tools", None, None, None, old_text, new_text, secrets)
    for i in range(max(len(old_tools), len(new_tools))):
        old_tool = old_tools[i] if i < len(old_tools) else _MISSING
        new_tool = new_tools[i] if i < len(new_tools) else _MISSING
        if (
            old_tool is _MISSING
            or new_tool is _MISSING
            or tools_json(old_tool) != tools_json(new_tool)
        ):
            # the old tool gone, or a few (an MCP server left), the next moved up in its place
            removed = False
            if new_tool is not _MISSING:
                moved = tools_json(new_tool)
                for k in range(i + 1, len(old_tools)):
                    if tools_json(old_tools[k]) == moved:
                        later = {tools_json(t) for t in new_tools[i + 1 :]}
                        removed = all(tools_json(t) not in later for t in old_tools[i:k])
                        break
                else:  # (by name: the tool moved up into its place was edited too)
                    gone, moved_up = _tool_name(old_tool), _tool_name(new_tool)
                    removed = (
                        gone is not None
                        and moved_up is not None
                        and moved_up in {_tool_name(t) for t in old_tools[i + 1 :]}
                        and gone not in {_tool_name(t) for t in new_tools}
                    )
            if removed:
                name = _tool_name(old_tool)
                old_text, new_text = _tools_text(old_tool), ""
            else:
                name = _tool_name(new_tool) or _tool_name(old_tool)
                old_text, new_text = _tools_text(old_tool), _tools_text(new_tool)
            return _divergence("tools", None, None, name, old_text, new_text, secrets)
    return _divergence(
        "tools", None, None, None, _tools_text(old_tools), _tools_text(new_tools), secrets
    )


def _tool_name(tool: Any) -> str | None:
    if not isinstance(tool, Mapping):
        return None
    function = tool.get("function")
    name = function.get("name") if isinstance(function, Mapping) else tool.get("name")
    return name if isinstance(name, str) else None


# Where a client writes a counter of its own (a turn's number, what is left of a budget): its
# system prompt, a note in a user message. A number changed elsewhere is data that was edited.
_COUNTING_ROLES: Final = frozenset({"system", "developer", "user"})


def _divergence(
    location: Location,
    index: int | None,
    role: str | None,
    field: str | None,
    old_text: str,
    new_text: str,
    secrets: tuple[str, ...],
) -> Divergence:
    old_excerpt, new_excerpt = _excerpts(old_text, new_text, secrets)
    kind = volatile_kind(old_text, new_text)
    if kind == "counter" and (location == "tools" or role not in _COUNTING_ROLES):
        kind = None  # (a number changed in a tool's output, an answer, a tool: an edit)
    return Divergence(
        location, index, role, field, old_excerpt, new_excerpt, kind is not None, kind
    )


# --- excerpts ---------------------------------------------------------------------------------


def common_prefix_length(a: str, b: str) -> int:
    """Length of the common prefix, by binary search on slices (C-speed comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix_len(a: str, b: str, limit: int) -> int:
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid : len(a) - lo] == b[len(b) - mid : len(b) - lo]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _excerpts(old_text: str, new_text: str, secrets: tuple[str, ...] = ()) -> tuple[str, str]:
    """Redacted excerpts of both texts around their first differing character.

    Only a window around the difference is redacted, wide enough to hold any realistic secret
    that runs into the excerpt, so a 300 KB tool output costs no more than a short one. The exact
    ``secrets`` go first, from the whole texts (a substring search each).
    """
    for secret in secrets:
        if secret in old_text:
            old_text = old_text.replace(secret, REDACTED)
        if secret in new_text:
            new_text = new_text.replace(secret, REDACTED)
    at = common_prefix_length(old_text, new_text)
    lo = max(0, at - _EXCERPT_LEAD - _SECRET_MARGIN)
    hi = at + EXCERPT_CHARS + _SECRET_MARGIN
    # A private key's block longer than the margin (an 8192-bit RSA key, a PGP secret key: ~6-7
    # KB) is known by its armour line, which must be in the window: from there, when the window
    # begins inside such a block (its body was shown where two cuts of it differed).
    marker = "-----BEGIN "  # (one that begins before the window and ends in it too)
    begin = old_text.rfind(marker, max(0, lo - _KEY_BLOCK_MAX), lo + len(marker) - 1)
    if 0 <= begin < lo and "-----END " not in old_text[begin:lo]:
        lo = begin
    elif 0 < lo < len(old_text) and _TOKEN_START.match(old_text, lo - 1, lo + 1) is None:
        # A token longer than the margin (a JWT, an STS session token of several KB) cut by the
        # window's start: its tail no longer reads as a secret. From the character before it
        # (a written-out escape's backslash, which the key patterns read past), when that is
        # within a key block's reach (a longer run is a blob: base64 data, not a secret).
        reach = max(0, lo - _KEY_BLOCK_MAX)
        found = _TOKEN_START.search(old_text, reach, lo)
        if found is not None:
            lo = found.start()
        elif reach == 0:
            lo = 0  # (the text begins with it)
    old_red, new_red = redact_text(old_text[lo:hi]), redact_text(new_text[lo:hi])
    # Redaction changes lengths: find the difference again, in the redacted windows. Equal windows
    # mean the texts differ only inside a secret: point near there, and show no secret.
    if old_red != new_red:
        at = common_prefix_length(old_red, new_red)
    else:  # (at the marker of the secret the change is in: the text before it, redacted, is
        # shorter than it was; a long token's, a JWT's, by more than the excerpt's lead)
        at = min(len(redact_text(old_text[lo:at])), len(old_red))
        hidden = old_red.rfind(REDACTED, 0, at + len(REDACTED))
        if hidden >= 0:
            at = hidden
    return (
        _excerpt(old_red, at, lo > 0, hi < len(old_text)),
        _excerpt(new_red, at, lo > 0, hi < len(new_text)),
    )


def _excerpt(window: str, at: int, more_before: bool, more_after: bool) -> str:
    # The same start in both texts, so the two excerpts line up character for character.
    start = max(0, min(at - _EXCERPT_LEAD, len(window)))
    end = min(len(window), start + EXCERPT_CHARS)
    # Never cut a redaction marker in two: widen the excerpt to hold it whole.
    width = len(REDACTED)
    marker = window.rfind(REDACTED, max(0, start - width + 1), start + width - 1)
    if marker >= 0:
        start = marker
    marker = window.find(REDACTED, max(0, end - width + 1), end + width - 1)
    if marker >= 0:
        end = marker + width
    before = "…" if start > 0 or more_before else ""
    after = "…" if end < len(window) or more_after else ""
    return before + window[start:end] + after


# --- volatile tokens --------------------------------------------------------------------------

_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
# A weekday, whole or short ("Mon", "Tue", "Thurs"): a token only beside a date or a time
_WEEKDAY = r"(?:Mon|Tues?|Wed(?:nes)?|Thu(?:rs?)?|Fri|Sat(?:ur)?|Sun)(?:day)?"
_CLOCK = r"\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:\s?[AaPp][Mm]\b)?"
# Alternatives are tried in order at each position, most specific first; a group's name before the
# first underscore is the token's kind. A date written with its weekday is one token, so that a
# day's end changes one token, not a word and a number ("Mon Jan  6 23:58:00 2025": C's ctime and
# `date`, "Mon Jan  6 11:58:05 AM UTC 2025" and "Mon  6 Jan 23:58:05 UTC 2025" in other locales;
# "Mon Jan 06 2025 23:58:00 GMT+0000": JavaScript's Date; "Mon, 06 Jan 2025 23:58:00 GMT": RFC
# 2822 and HTTP).
_VOLATILE = re.compile(
    r"(?P<uuid>(?<![0-9A-Fa-f])[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}"
    r"-[0-9A-Fa-f]{12}(?![0-9A-Fa-f]))"
    rf"|(?P<timestamp_ctime>\b{_WEEKDAY},?\s+(?:{_MONTH}\s+\d{{1,2}}|\d{{1,2}}\s+{_MONTH})"
    rf"(?:\s+\d{{4}})?\s+{_CLOCK}"
    r"(?:\s+GMT[+-]\d{4}|\s+[A-Z]{2,5}(?=\s+\d{4}\b))?(?:\s+\d{4})?\b)"
    rf"|(?P<timestamp_rfc>\b{_WEEKDAY},?\s+\d{{1,2}}\s+{_MONTH}\s+\d{{4}}\s+{_CLOCK}"
    r"(?:\s+(?:UTC?|GMT|[ECMP][SD]T|[+-]\d{4}))?\b)"
    rf"|(?P<date_weekday_named>\b{_WEEKDAY},?\s+(?:{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}"
    rf"|\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH},?\s+\d{{4}})\b)"
    r"|(?P<timestamp_iso>\b\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?"
    r"(?:Z|[+-]\d{2}:?\d{2}\b|\s?(?:UTC|GMT)\b)?)"
    r"|(?P<date_iso>\b\d{4}[-/]\d{2}[-/]\d{2}\b)"
    r"|(?P<date_slash>\b\d{1,2}/\d{1,2}/\d{2,4}\b)"
    rf"|(?P<date_named>\b{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}\b"
    rf"|\b\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH},?\s+\d{{4}}\b)"
    r"|(?P<date_weekday>\b(?:Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day\b)"
    r"|(?P<timestamp_time>\b\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?\b(?:\s?[AaPp][Mm]\b)?)"
    r"|(?P<timestamp_epoch>\b1\d{9}(?:\d{3})?\b)"
    r"|(?P<id_hex>\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{16,}\b)"
    r"|(?P<counter>\b\d+\b)"
)
# One private-use character per kind, so a placeholder can never be split by a prefix comparison.
_PLACEHOLDER: Final = {
    "uuid": "\ue000",
    "timestamp": "\ue001",
    "date": "\ue002",
    "id": "\ue003",
    "counter": "\ue004",
}
_KIND_OF_PLACEHOLDER: Final = {char: kind for kind, char in _PLACEHOLDER.items()}


def _kind(match: re.Match[str]) -> str:
    return (match.lastgroup or "counter").split("_", 1)[0]


def _normalize(text: str) -> tuple[str, list[re.Match[str]]]:
    matches = list(_VOLATILE.finditer(text))
    pieces: list[str] = []
    position = 0
    for match in matches:
        pieces.append(text[position : match.start()])
        pieces.append(_PLACEHOLDER[_kind(match)])
        position = match.end()
    pieces.append(text[position:])
    return "".join(pieces), matches


def volatile_kind(old_text: str, new_text: str) -> str | None:
    """The kind of volatile token that is the only difference between the texts, else None.

    Both texts are normalized (each volatile token replaced by a placeholder of its kind). Equal
    normalized texts mean a token changed value: its kind is returned. Otherwise the one changed
    region is accepted when it holds a timestamp, date, uuid or id and at most a short label
    besides — "Current time: 2025-03-14T09:26:53Z" added to a system prompt. A number alone added
    is not enough: that is ordinary editing far more often than a counter.
    """
    if old_text == new_text:
        return None
    # Outside the changed region the texts are equal: normalize only that region plus a margin
    # that holds any token running across its edges (same cut on both sides).
    head = common_prefix_length(old_text, new_text)
    tail = _common_suffix_len(old_text, new_text, min(len(old_text), len(new_text)) - head)
    if max(len(old_text), len(new_text)) - head - tail > _VOLATILE_SCAN_CHARS:
        return None  # far more changed than a token and a label
    lo = max(0, head - _TOKEN_MARGIN)
    old_norm, old_tokens = _normalize(old_text[lo : len(old_text) - tail + _TOKEN_MARGIN])
    new_norm, new_tokens = _normalize(new_text[lo : len(new_text) - tail + _TOKEN_MARGIN])
    if old_norm == new_norm:
        for old_token, new_token in zip(old_tokens, new_tokens, strict=True):
            if old_token.group() != new_token.group():
                return _kind(new_token)
        return None
    head = common_prefix_length(old_norm, new_norm)
    tail = _common_suffix_len(old_norm, new_norm, min(len(old_norm), len(new_norm)) - head)
    # The new side first, so an inserted token names the kind.
    changed = new_norm[head : len(new_norm) - tail] + old_norm[head : len(old_norm) - tail]
    kinds = [_KIND_OF_PLACEHOLDER[c] for c in changed if c in _KIND_OF_PLACEHOLDER]
    label = sum(1 for c in changed if c not in _KIND_OF_PLACEHOLDER and not c.isspace())
    # What the old side lost besides tokens: a label replaced, not only a token added ("You
    # search the code." -> "Current time: …" is another prompt, not the same with the time in)
    removed = old_norm[head : len(old_norm) - tail]
    lost = sum(1 for c in removed if c not in _KIND_OF_PLACEHOLDER and not c.isspace())
    significant = [kind for kind in kinds if kind != "counter"]
    if significant and label <= _VOLATILE_LABEL_CHARS and lost <= _VOLATILE_LOST_CHARS:
        return significant[0]
    return None
