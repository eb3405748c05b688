"""A Responses API request as the cache accounting reads a chat request, and the places the
accounting names put back in the Responses API's terms (pure).

OpenAI's prompt cache reads a Responses API request as a prefix: its ``instructions``, its tools,
then each ``input`` item in turn. The accounting (``observers.AccountingObserver``, ``prefix``,
``cache``) hashes a chat request's tools, system block and messages; so a Responses request is
given to it as ``{"messages": [instructions as a system message, *input]}`` with its other
fields, its system block the instructions alone, hashed before the tools
(``prefix.fingerprint(…, system_first=True, system_block=offset)``), and what it finds (``messages[5].content``,
``system``) is said back as ``input[4].content`` or ``instructions``. Items are hashed whole, as
they are: a leading ``developer`` or ``system`` message item is an item as any other, after the
tools.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

_NOT_VIEWED: Final = frozenset({"input", "instructions", "messages", "text"})


def chat_shaped(
    body: Mapping[str, Any], held: dict[str, Any] | None = None
) -> tuple[dict[str, Any], int]:
    """``body`` as a chat request, and how many messages come before its first ``input`` item
    (1 with ``instructions``, else 0). ``input`` items are the messages, the very objects (a
    one-string ``input`` is one user message); ``text.format`` is ``response_format``, the
    other fields are as sent. ``held``: the system message of an earlier view, used again
    when its content is these ``instructions`` (the same object turn after turn: the
    fingerprint finds an unchanged prefix by identity)."""
    view = {k: v for k, v in body.items() if k not in _NOT_VIEWED}
    items = body.get("input")
    if isinstance(items, str):
        messages: list[Any] = [{"role": "user", "content": items}]
    else:
        messages = list(items) if isinstance(items, list) else []
    instructions = body.get("instructions")
    offset = 0
    if isinstance(instructions, str) and instructions:
        if held is None or held.get("content") != instructions:
            held = {"role": "system", "content": instructions}
        messages.insert(0, held)
        offset = 1
    text = body.get("text")
    if isinstance(text, Mapping) and text.get("format") is not None:
        view["response_format"] = text["format"]
    view["messages"] = messages
    return view, offset


_MESSAGE: Final = re.compile(r"messages\[(\d+)\]")


def responses_location(
    label: str | None, offset: int, system_index: int | None, field: str | None = None
) -> str | None:
    """A location the accounting named in the chat view (``messages[5].content``, ``system``)
    in the request's own terms: ``input[4].content``; ``instructions`` for the system block's
    first message where the request has instructions (``system_index``: the index in the view
    of the system message that differs, when known), else the ``input`` item it is, with the
    ``field`` that differs (``input[0].content``: a leading developer item edited, as any item's
    edit is named; ``input[0]`` alone reads as an item that came or went);
    ``params.text.format`` for the ``response_format`` the view made of it."""
    if label is None:
        return None
    if label == "params.response_format":
        return "params.text.format"
    if label == "system":
        if offset and (system_index is None or system_index < offset):
            return "instructions"
        if system_index is None:
            return label
        return f"input[{system_index - offset}]" + (f".{field}" if field else "")
    match = _MESSAGE.match(label)
    if match is None:
        return label  # (tools, params)
    return f"input[{int(match.group(1)) - offset}]{label[match.end() :]}"


def responses_divergence(divergence: dict[str, Any], offset: int) -> dict[str, Any]:
    """A response line's ``divergence`` (``observers._divergence_dict``) in the request's own
    terms: ``location`` ``input`` with the item's index, or ``instructions``."""
    location, index = divergence.get("location"), divergence.get("index")
    if location == "params" and divergence.get("field") == "response_format":
        return {**divergence, "field": "text.format"}
    if location not in ("system", "messages") or not isinstance(index, int):
        return divergence
    if index < offset:
        return {**divergence, "location": "instructions", "index": None}
    return {**divergence, "location": "input", "index": index - offset}
