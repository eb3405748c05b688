"""The providers' own checks of a chat-completions message list, with their exact texts (pure).

The simulator answers 400 with these messages; the pairing tests use ``validate_messages`` as the
oracle that a repaired history would be accepted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

DANGLING_TEXT = (
    "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
    "'tool_call_id'. The following tool_call_ids did not have response messages: {ids}"
)
# "preceeding" is the provider's own spelling; clients match on this text.
ORPHAN_TEXT = (
    "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with "
    "'tool_calls'."
)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class ValidationError(ValueError):
    """A request the provider would refuse with a 400; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = "messages", code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def json_kind(value: Any) -> str:
    """A value's JSON type as OpenAI's refusals name it: ``an object``, ``a string``."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "an object"
    return "an array" if isinstance(value, list) else "null"


def _call_ids(message: dict[str, Any]) -> list[str]:
    calls = message.get("tool_calls") or []
    return [c.get("id", "") for c in calls if isinstance(c, dict)]


def validate_claude_messages(messages: list[Any]) -> None:
    """Raise ``ValidationError`` where Claude would refuse ``messages`` past OpenAI's rules
    (``validate_messages`` passed first): a text part whose text is empty or white space, in
    any message; an assistant message with no content (``""``, ``[]``, blanks) and nothing else
    to say, anywhere but last; a tool call id that an earlier call of the request has (in its
    message or another: Claude's ``tool_use`` ids must be unique in a request), as Anthropic's
    API refuses them."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            text = (
                part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            )
            if isinstance(text, str) and not text.strip():  # (a block of any message)
                raise ValidationError(
                    "messages: text content blocks must be non-empty"
                    if not text
                    else "messages: text content blocks must contain non-whitespace text",
                    f"messages.[{i}].content",
                    "invalid_request_error",
                )
    seen: set[Any] = set()  # (every tool_use id of the request: Claude refuses a repeat)
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for j, call in enumerate(calls if isinstance(calls, list) else ()):
            call_id = call.get("id") if isinstance(call, dict) else None
            if call_id in seen:
                raise ValidationError(
                    f"messages.{i}.content.{j}: `tool_use` ids must be unique",
                    f"messages.[{i}].tool_calls",
                    "invalid_request_error",
                )
            seen.add(call_id)
    for i, message in enumerate(messages[:-1]):
        if (
            isinstance(message, dict)
            and message.get("role") == "assistant"
            and not message.get("tool_calls")
            and not message.get("function_call")
            # (a gateway gives Claude signed reasoning back as thinking blocks; a reasoning text
            # alone it drops)
            and not message.get("reasoning_details")
            and not message.get("thinking_blocks")
            and (
                message.get("content") in ("", [], None)
                or (isinstance(message.get("content"), str) and not message["content"].strip())
            )
        ):
            raise ValidationError(
                f"messages.{i}: all messages must have non-empty content except for the"
                " optional final assistant message",
                f"messages.[{i}].content",
                "invalid_request_error",
            )


_CONTENT_ROLES = frozenset({"system", "developer", "user", "tool"})  # (content required)


def _check_content(message: dict[str, Any], i: int) -> None:
    """OpenAI's checks of a message's ``content``: present and not null in a system, developer,
    user or tool message, and a string or an array wherever it is given."""
    content = message.get("content")
    role = message.get("role")
    if isinstance(role, str) and role in _CONTENT_ROLES:
        if "content" not in message:
            raise ValidationError(
                f"Missing required parameter: 'messages[{i}].content'.",
                f"messages[{i}].content",
                "missing_required_parameter",
            )
        if content is None:
            raise ValidationError(
                "Invalid value for 'content': expected a string, got null.",
                f"messages.[{i}].content",
                "invalid_value",
            )
    if content is not None and not isinstance(content, (str, list)):
        raise ValidationError(
            f"Invalid type for 'messages[{i}].content': expected one of a string or array of"
            f" objects, but got {json_kind(content)} instead.",
            f"messages[{i}].content",
            "invalid_type",
        )


def validate_messages(messages: Any) -> None:
    """Raise ``ValidationError`` where a provider would refuse ``messages``; return None if valid.

    Rules, in the order a provider applies them while reading the list:
    no ``tool_calls`` array may be empty, and each call is an object with a string ``id`` and
    ``type``; no assistant message may lack content where it has no
    tool calls (nor a refusal, legacy ``function_call`` or audio), nor any system, developer,
    user or tool message (``_check_content``); content is a string or an array; every
    assistant ``tool_calls`` message must be followed, before any other kind of message, by
    one ``tool`` message per call id; a ``tool`` message must answer a not-yet-answered call of the
    assistant message that opened its block.
    """
    if messages is None:  # as OpenAI words it
        raise ValidationError(
            "Missing required parameter: 'messages'.", code="missing_required_parameter"
        )
    if not isinstance(messages, list):
        raise ValidationError(
            f"Invalid type for 'messages': expected an array, but got {json_kind(messages)}"
            " instead.",
            code="invalid_type",
        )
    if not messages:
        raise ValidationError(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an"
            " empty array instead.",
            code="empty_array",
        )
    for i, message in enumerate(messages):  # the schema is checked before the pairing
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if calls is not None and not isinstance(calls, list):  # (a TypeError, a 500, before)
            raise ValidationError(
                f"Invalid type for 'messages[{i}].tool_calls': expected an array, but got"
                f" {json_kind(calls)} instead.",
                f"messages[{i}].tool_calls",
                "invalid_type",
            )
        if isinstance(message, dict) and message.get("tool_calls") == []:
            raise ValidationError(
                f"Invalid 'messages[{i}].tool_calls': empty array. Expected an array with minimum "
                "length 1, but got an empty array instead.",
                f"messages[{i}].tool_calls",
                "empty_array",
            )
        for j, call in enumerate(calls or ()):  # (each call's own fields, as OpenAI and Azure)
            where = f"messages[{i}].tool_calls[{j}]"
            if not isinstance(call, dict):
                raise ValidationError(
                    f"Invalid type for '{where}': expected an object, but got {json_kind(call)}"
                    " instead.",
                    where,
                    "invalid_type",
                )
            for key in ("id", "type"):
                if key not in call:
                    raise ValidationError(
                        f"Missing required parameter: '{where}.{key}'.",
                        f"{where}.{key}",
                        "missing_required_parameter",
                    )
                if not isinstance(call[key], str):
                    raise ValidationError(
                        f"Invalid type for '{where}.{key}': expected a string, but got"
                        f" {json_kind(call[key])} instead.",
                        f"{where}.{key}",
                        "invalid_type",
                    )
        if (  # an assistant message's content may be null only beside what else it says
            isinstance(message, dict)
            and message.get("role") == "assistant"
            and message.get("content") is None
            and not any(message.get(k) for k in ("tool_calls", "function_call", "audio", "refusal"))
        ):
            raise ValidationError(
                "Invalid value for 'content': expected a string, got null.",
                f"messages.[{i}].content",
                "invalid_value",
            )
        if isinstance(message, dict):
            _check_content(message, i)
    pending: list[str] = []  # ids of the open block not yet answered, in call order
    open_block = False
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValidationError(
                f"Invalid type for 'messages[{i}]': expected an object, but got"
                f" {json_kind(message)} instead.",
                f"messages[{i}]",
                "invalid_type",
            )
        role = message.get("role")
        if role is None:
            raise ValidationError(
                f"Missing required parameter: 'messages[{i}].role'.",
                f"messages[{i}].role",
                "missing_required_parameter",
            )
        if not isinstance(role, str) or role not in ROLES:
            raise ValidationError(
                f"Invalid value: '{role}'. Supported values are: 'system', 'assistant', 'user', "
                "'function', 'tool', and 'developer'.",
                f"messages[{i}].role",
                "invalid_value",
            )
        if role == "tool":
            tool_call_id = message.get("tool_call_id")
            if not open_block or tool_call_id not in pending:
                raise ValidationError(ORPHAN_TEXT, f"messages.[{i}].role")
            pending.remove(tool_call_id)
            continue
        if pending:
            raise ValidationError(
                DANGLING_TEXT.format(ids=", ".join(map(str, pending))), "messages"
            )
        open_block = False
        if role == "assistant" and message.get("tool_calls"):
            pending = _call_ids(message)
            open_block = True
    if pending:
        raise ValidationError(DANGLING_TEXT.format(ids=", ".join(map(str, pending))), "messages")


_MISTRAL_ID = re.compile(r"[a-zA-Z0-9]{9}")


GEMINI_EMPTY_TEXT_ERROR: Final = [
    {
        "error": {
            "code": 400,
            "message": "Unable to submit request because it has an empty text parameter. Add a"
            " value to the parameter and try again. Learn more:"
            " https://cloud.google.com/vertex-ai/generative-ai/docs/model-reference/gemini",
            "status": "INVALID_ARGUMENT",
        }
    }
]
"""Gemini's OpenAI-compatible endpoint's refusal of an empty text (a list of one error)."""


def gemini_refusal(messages: list[Any]) -> bool:
    """Whether Gemini's OpenAI endpoint refuses ``messages`` (``validate_messages`` passed
    first) for an empty text: an assistant message whose content is ``""``, ``null``, ``[]``
    or text parts of no text, and no tool calls. White space is text to it."""
    for message in messages:
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        if message.get("tool_calls"):
            continue
        content = message.get("content")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if not any(texts):
                return True
        elif not content:
            return True
    return False


def mistral_refusal(messages: list[Any]) -> dict[str, Any] | None:
    """Mistral's 400 for ``messages`` (``validate_messages`` passed first), or None: a message
    other than an assistant's right after a tool result, a tool call id other than nine letters
    and digits (in its call or its result), an assistant message with neither content nor tool
    calls (its validator for older models' tokenizers, v1 to v3)."""
    previous = None
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if (
            role == "assistant"
            and not message.get("content")
            and not message.get("tool_calls")
            and not message.get("prefix")  # (a prefill: the model's answer's start, not judged)
        ):
            return {
                "object": "error",
                "message": "Assistant message must have either content or tool_calls, but not"
                " both.",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        if previous == "tool" and role not in ("assistant", "tool"):
            return {
                "object": "error",
                "message": f"Unexpected role '{role}' after role 'tool'",
                "type": "invalid_request_message_order",
                "param": None,
                "code": "3230",
            }
        ids = [message.get("tool_call_id")] if role == "tool" else []
        calls = message.get("tool_calls") if role == "assistant" else None
        ids += [c.get("id") for c in calls or () if isinstance(c, dict)]
        for call_id in ids:
            if not (isinstance(call_id, str) and _MISTRAL_ID.fullmatch(call_id)):
                return {
                    "object": "error",
                    "message": f"Tool call id was {call_id} but must be a-z, A-Z, 0-9, with a"
                    " length of 9.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
        previous = role
    return None


# The Responses API's refusals of a broken pairing (OpenAI's texts; ``param`` is "input")
NO_OUTPUT_TEXT = "No tool output found for {what} {id}."
NO_CALL_TEXT = "No tool call found for {what} output with call_id {id}."
_RESPONSE_CALLS = {
    "function_call": "function call",
    "custom_tool_call": "custom tool call",
    "local_shell_call": "local shell call",
    "shell_call": "shell call",
    "apply_patch_call": "apply patch call",
    "tool_search_call": "tool search call",
    "computer_call": "computer call",
}
_RESPONSE_OUTPUTS = {
    "function_call_output": "function call",
    "custom_tool_call_output": "custom tool call",
    "shell_call_output": "shell call",
    "apply_patch_call_output": "apply patch call",
    "tool_search_output": "tool search",
    "computer_call_output": "computer call",
}


def _response_kind(item: dict[str, Any]) -> Any:
    """A tool search the provider ran (``execution`` ``server``) carries its own results: it is
    neither a call to answer nor an output that must answer one."""
    kind = item.get("type")
    if item.get("execution") == "server" and kind in ("tool_search_call", "tool_search_output"):
        return "hosted"
    return kind


_JSON_KINDS: dict[type, str] = {
    list: "an array",
    dict: "an object",
    int: "an integer",
    float: "a decimal",
    bool: "a boolean",
}


def _stored_item(item: Any) -> bool:
    """An item that names a stored one by id (``item_reference``, or only an ``id``)."""
    if not isinstance(item, dict):
        return False
    kind = item.get("type")
    return kind == "item_reference" or (kind is None and item.keys() == {"id"})


def validate_stored_calls(body: dict[str, Any], stored: Sequence[tuple[str, str]]) -> None:
    """Raise ``ValidationError`` as OpenAI does where a request continues a stored response
    (``previous_response_id``) whose calls (``stored``: ``call_id`` and what OpenAI names its
    kind) its ``input`` gives no output for."""
    items = body.get("input")
    answered = {
        item.get("call_id")
        for item in (items if isinstance(items, list) else ())
        if isinstance(item, dict) and str(item.get("type")).endswith("_output")
    }
    for call_id, what in stored:
        if call_id not in answered:
            raise ValidationError(NO_OUTPUT_TEXT.format(what=what, id=call_id), "input")


def validate_response_input(body: dict[str, Any]) -> None:
    """Raise ``ValidationError`` where OpenAI would refuse a Responses API request's ``input``
    items: a call with no output in the list, or (unless the request continues a stored
    response or conversation, or references a stored item, whose call an output may answer)
    an output whose ``call_id`` no other item in the list has. A call
    the client runs (a function, custom tool, shell, patch, a client-run tool search, a computer
    action) needs an output; a hosted tool's call carries its results."""
    items = body.get("input")
    if not isinstance(items, list):
        return
    calls: dict[str, str] = {}
    answered: set[str] = set()
    known: set[str] = set()  # the call_id of every item but an output: what an output may answer
    shell_ids: dict[Any, str] = {}  # a local shell call's id -> its call_id
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        if item.get("type") is not None and not isinstance(item["type"], str):
            got = _JSON_KINDS.get(type(item["type"]), "a value")
            raise ValidationError(
                f"Invalid type for 'input[{i}].type': expected a string, but got {got} instead.",
                f"input[{i}].type",
            )
        kind = _response_kind(item)
        if kind == "local_shell_call_output":  # (its call's call_id, or id, as its call_id or id)
            for value in (item.get("call_id"), item.get("id")):
                if isinstance(value, str):
                    answered.add(shell_ids.get(value, value))
        if not isinstance(item.get("call_id"), str):
            continue
        if not str(kind).endswith("_output"):
            known.add(item["call_id"])
        if kind in _RESPONSE_CALLS:
            calls.setdefault(item["call_id"], _RESPONSE_CALLS[kind])
            if kind == "local_shell_call":
                shell_ids[item.get("id")] = item["call_id"]
        elif kind in _RESPONSE_OUTPUTS:
            answered.add(item["call_id"])
    for call_id, what in calls.items():
        if call_id not in answered:
            raise ValidationError(NO_OUTPUT_TEXT.format(what=what, id=call_id), "input")
    if body.get("previous_response_id") or body.get("conversation"):
        return
    if any(_stored_item(item) for item in items):  # (an output may answer the stored call)
        return
    for item in items:
        if isinstance(item, dict) and _response_kind(item) in _RESPONSE_OUTPUTS:
            answers = item.get("call_id")
            if isinstance(answers, str) and answers not in known:
                what = _RESPONSE_OUTPUTS[item["type"]]
                raise ValidationError(NO_CALL_TEXT.format(what=what, id=answers), "input")
