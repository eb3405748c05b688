"""What the simulated model answers: a scripted reply, or one derived from the request (pure).

A script entry is a string (the content) or an object ``{"content" | "text": str, "tool_calls":
[{"name": str, "arguments": str | JSON value, "id"?: str}], "finish_reason"?: str, "fault"?: str}``
(``{"function": {"name", "arguments"}}`` is accepted for a call too). Without a script the reply
echoes a short summary of the last message; when tools are offered and the last message is a user
message containing "use tool", the reply calls the first tool with arguments built from its schema.
``tool_choice`` rules over that as it does at OpenAI: ``"none"`` never calls, ``"required"`` always
calls (the first tool), a named function is the one called, whatever the last message says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import orjson

from proxy.simulator.config import FAULTS
from proxy.simulator.tokens import content_text, count_tokens, token_spans

SUMMARY_WORDS = 12


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call of the reply; ``id`` is empty until the simulator assigns one."""

    name: str
    arguments: str
    id: str = ""


@dataclass(frozen=True, slots=True)
class Reply:
    """An assistant reply: text and/or tool calls, why it ended, and an optional scripted fault."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str = "stop"
    fault: str | None = None
    # A reasoning model's thinking: billed in the completion, never in the answer's text
    reasoning_tokens: int = 0

    def with_call_ids(self, ids: list[str]) -> Reply:
        """This reply with ``ids`` given to the calls that have none, in order."""
        fresh = iter(ids)
        calls = tuple(c if c.id else replace(c, id=next(fresh)) for c in self.tool_calls)
        return replace(self, tool_calls=calls)


def completion_tokens(reply: Reply) -> int:
    """Tokens the reply costs (see ``proxy.simulator.tokens``)."""
    total = count_tokens(reply.content or "") + reply.reasoning_tokens
    for call in reply.tool_calls:
        total += count_tokens(call.name) + count_tokens(call.arguments)
    return total


def _arguments_text(value: Any) -> str:
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def _parse_call(obj: Any) -> ToolCall:
    if not isinstance(obj, Mapping):
        raise ValueError("a scripted tool call must be an object")
    function = obj.get("function")
    source = function if isinstance(function, Mapping) else obj
    name = source.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a scripted tool call needs a 'name'")
    call_id = obj.get("id", "")
    if not isinstance(call_id, str):
        raise ValueError("a scripted tool call 'id' must be a string")
    return ToolCall(name=name, arguments=_arguments_text(source.get("arguments", {})), id=call_id)


def parse_script(obj: Any) -> Reply:
    """One scripted reply from its JSON form; ``ValueError`` names what is wrong."""
    if isinstance(obj, str):
        return Reply(content=obj)
    if not isinstance(obj, Mapping):
        raise ValueError("a scripted reply must be a string or an object")
    unknown = set(obj) - {
        "content",
        "text",
        "tool_calls",
        "finish_reason",
        "fault",
        "reasoning_tokens",
    }
    if unknown:
        raise ValueError(f"unknown scripted reply keys: {', '.join(sorted(unknown))}")
    content = obj.get("content", obj.get("text"))
    if content is not None and not isinstance(content, str):
        raise ValueError("a scripted reply's content must be a string")
    raw_calls = obj.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise ValueError("'tool_calls' must be a list")
    calls = tuple(_parse_call(c) for c in raw_calls)
    if content is None and not calls:
        content = ""
    finish = obj.get("finish_reason") or ("tool_calls" if calls else "stop")
    if not isinstance(finish, str):
        raise ValueError("'finish_reason' must be a string")
    fault = obj.get("fault")
    if fault is not None and str(fault) not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    reasoning = obj.get("reasoning_tokens", 0)
    if type(reasoning) is not int or not 0 <= reasoning <= 10_000_000:
        raise ValueError("'reasoning_tokens' must be an integer from 0 to 10,000,000")
    return Reply(
        content=content,
        tool_calls=calls,
        finish_reason=finish,
        fault=None if fault is None else str(fault),
        reasoning_tokens=reasoning,
    )


def _summary(text: str) -> str:
    words = text.split()
    head = " ".join(words[:SUMMARY_WORDS])
    return head + (" …" if len(words) > SUMMARY_WORDS else "")


def _example_value(schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    enum = schema.get("enum") if isinstance(schema, Mapping) else None
    if isinstance(enum, list) and enum:
        return enum[0]
    examples: dict[str, Any] = {
        "integer": 1,
        "number": 1,
        "boolean": True,
        "array": [],
        "null": None,
    }
    if kind == "object":
        return _example_arguments(schema)
    return examples.get(kind, "sim") if isinstance(kind, str) else "sim"


def _example_arguments(schema: Any) -> dict[str, Any]:
    if not isinstance(schema, Mapping):
        return {}
    properties = schema.get("properties")
    if not isinstance(properties, Mapping):  # (a schema the provider would refuse: no example)
        properties = {}
    required = schema.get("required")
    if not isinstance(required, list):
        required = list(properties)
    return {n: _example_value(properties.get(n)) for n in required if isinstance(n, str)}


def _forced_tool(tools: list[Mapping[str, Any]], choice: Any) -> Mapping[str, Any] | None:
    """The tool ``tool_choice`` makes the model call whatever the message says: the one it
    names (``{"type": "function", "function": {"name": …}}``), the first for ``"required"``;
    ``None`` where the model chooses (``"auto"``, ``"none"``, no choice)."""
    if not tools:
        return None
    if choice == "required":
        return tools[0]
    named = choice.get("function") if isinstance(choice, Mapping) else None
    if isinstance(named, Mapping):
        for tool in tools:
            function = tool.get("function")
            if isinstance(function, Mapping) and function.get("name") == named.get("name"):
                return tool
    return None


def cut_to(reply: Reply, limit: int) -> Reply:
    """``reply`` as a completion of at most ``limit`` tokens ends (``max_completion_tokens``,
    ``max_tokens``): its reasoning first, then its text cut at a token's end, ``finish_reason``
    ``"length"``. A reply within the limit, or one with tool calls, is returned as it is."""
    if reply.tool_calls or completion_tokens(reply) <= limit:
        return reply
    reasoning = min(reply.reasoning_tokens, limit)
    room = limit - reasoning
    raw = (reply.content or "").encode("utf-8", "surrogatepass")
    ends = [m.end() for m in token_spans(raw)]
    cut = raw[: ends[room - 1]] if room > 0 else b""
    text = cut.decode("utf-8", "ignore")  # (a token may end inside a character)
    return replace(reply, content=text, reasoning_tokens=reasoning, finish_reason="length")


def derive_reply(body: Mapping[str, Any]) -> Reply:
    """The deterministic unscripted answer to a (valid) chat-completions request."""
    messages = body.get("messages") or []
    last = messages[-1] if messages and isinstance(messages[-1], Mapping) else {}
    role = last.get("role")
    text = content_text(last.get("content"))
    tools = [t for t in body.get("tools") or [] if isinstance(t, Mapping)]
    choice = body.get("tool_choice")
    forced = _forced_tool(tools, choice)
    if (
        tools
        and choice != "none"
        and (forced is not None or (role == "user" and "use tool" in text.lower()))
    ):
        function = (forced if forced is not None else tools[0]).get("function")
        if not isinstance(function, Mapping):
            function = {}
        name = str(function.get("name", "tool"))
        arguments = orjson.dumps(_example_arguments(function.get("parameters"))).decode()
        return Reply(
            content=None, tool_calls=(ToolCall(name, arguments),), finish_reason="tool_calls"
        )
    if role == "tool":
        return Reply(content=f"Tool result received: {_summary(text)}")
    if role == "user":
        return Reply(content=f"You said: {_summary(text)}")
    return Reply(content="OK.")
