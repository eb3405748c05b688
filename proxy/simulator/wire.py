"""The provider's wire shapes: usage, completion objects, stream chunks, errors (pure).

Everything is serialized compactly (no spaces), as OpenAI does. Streams follow OpenAI's order: a
role chunk, content deltas, tool-call deltas (the first delta of a call carries its id, type and
name with empty arguments; the arguments follow in pieces; parallel calls come each whole in
turn, as OpenAI sends them and the openai SDKs' stream helpers expect: they take a new ``index``
for the end of the call before; or, with ``interleave``, round-robin by ``index``, as some
compatible servers send them), a finish chunk, then with ``stream_options.include_usage`` a usage-only chunk with
``"choices": []`` (every other chunk then carries ``"usage": null``), then ``data: [DONE]``.
As OpenAI has since August 2025, the openai dialect ends each chunk with an ``obfuscation``
padding string (unless ``stream_options.include_obfuscation`` is false); its padding is derived
from the chunk's delta, so the same reply pads alike whether or not usage was asked for.
The deepseek dialect puts the usage on its finish chunk instead, whether asked or not.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from itertools import zip_longest
from typing import Any

import orjson

from proxy.simulator.cache import CacheResult
from proxy.simulator.reply import Reply

SYSTEM_FINGERPRINT = "fp_cachegate_sim"
DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
# Leading whitespace plus up to 8 visible characters, or trailing whitespace: pieces that
# concatenate back to the exact text.
_PIECE = re.compile(r"\s*\S{1,8}|\s+")


def pieces(text: str) -> list[str]:
    """``text`` cut into stream-sized pieces whose concatenation is ``text``."""
    return _PIECE.findall(text)


def token_logprobs(text: str, top: int) -> list[dict[str, Any]]:
    """``logprobs.content`` for ``text``, as OpenAI's chat completions give it when asked
    (``logprobs: true``): an entry per stream piece (a token, here), each with its ``token``,
    a ``logprob`` in (-4, 0], its UTF-8 ``bytes`` and ``top`` alternatives (``top_logprobs``),
    the token itself first; the same text gets the same figures."""
    return [_logprob_entry(piece, top) for piece in pieces(text)]


def _logprob_entry(token: str, top: int) -> dict[str, Any]:
    raw = token.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(raw, digest_size=4).digest()
    logprob = -round(int.from_bytes(digest, "big") / 2**32 * 4, 6)
    entry: dict[str, Any] = {"token": token, "logprob": logprob, "bytes": list(raw)}
    others = [(token, logprob)] + [(f"{token}{k}", logprob - 2.0 * k) for k in range(1, top)]
    entry["top_logprobs"] = [
        {"token": t, "logprob": round(lp, 6), "bytes": list(t.encode("utf-8", "surrogatepass"))}
        for t, lp in others[:top]
    ]
    return entry


def encode_event(obj: Any) -> bytes:
    """One SSE ``data:`` event carrying ``obj`` as compact JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def error_object(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An error body in the OpenAI shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage_object(
    dialect: str, prompt: int, completion: int, cache: CacheResult, reasoning: int = 0
) -> dict[str, Any]:
    """Usage in the dialect's fields; ``prompt_tokens`` always counts every input token, and
    ``completion_tokens`` the ``reasoning`` ones too (OpenAI's details name them)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if dialect == "deepseek":
        usage["prompt_cache_hit_tokens"] = cache.read
        usage["prompt_cache_miss_tokens"] = prompt - cache.read
        if reasoning:  # (deepseek-reasoner names its thinking so)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    elif dialect == "anthropic-compat":
        usage["cache_read_input_tokens"] = cache.read
        usage["cache_creation_input_tokens"] = cache.written
        # as Claude splits its writes, both always (gateways that pass it on, LiteLLM's; a
        # usage without it, OpenRouter's, is estimated from the breakpoints by cachegate)
        usage["cache_creation"] = {
            "ephemeral_5m_input_tokens": cache.written - cache.written_long,
            "ephemeral_1h_input_tokens": cache.written_long,
        }
    else:
        usage["prompt_tokens_details"] = {"cached_tokens": cache.read, "audio_tokens": 0}
        usage["completion_tokens_details"] = {
            "reasoning_tokens": reasoning,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        }
    return usage


def _calls_json(reply: Reply) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in reply.tool_calls
    ]


def completion_object(
    *,
    dialect: str,
    completion_id: str,
    created: int,
    model: str,
    reply: Reply,
    usage: dict[str, Any],
    service_tier: str | None = None,
    replies: Sequence[Reply] | None = None,
    logprobs: int | None = None,
) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` body (``service_tier``: as ``stream_chunks``), a
    choice for each of ``replies`` (``n``), else for ``reply``; with ``logprobs`` (the number of
    alternatives asked, ``top_logprobs``), each choice's tokens' log probabilities."""

    def choice(index: int, said: Reply) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": said.content}
        if said.tool_calls:
            message["tool_calls"] = _calls_json(said)
        if dialect == "openai":
            message["refusal"] = None
            message["annotations"] = []
        chances = None
        if logprobs is not None:
            text = said.content
            content = token_logprobs(text, logprobs) if text is not None else None
            chances = {"content": content, "refusal": None}
        return {
            "index": index,
            "message": message,
            "logprobs": chances,
            "finish_reason": said.finish_reason,
        }

    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice(i, said) for i, said in enumerate(replies or [reply])],
        "usage": usage,
    }
    if dialect == "openai":
        body["service_tier"] = service_tier or "default"
    body["system_fingerprint"] = SYSTEM_FINGERPRINT
    return body


def _call_deltas(reply: Reply, interleave: bool = False) -> list[dict[str, Any]]:
    """Tool-call deltas: each call's head and argument pieces in turn; with ``interleave``, the
    heads first, then the argument pieces round-robin across calls by index."""
    per_call: list[list[dict[str, Any]]] = []
    for index, call in enumerate(reply.tool_calls):
        head = {
            "index": index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        rest = [{"index": index, "function": {"arguments": p}} for p in pieces(call.arguments)]
        per_call.append([head, *rest])
    if not interleave:
        return [{"tool_calls": [d]} for deltas in per_call for d in deltas]
    out = []
    for step in range(max((len(d) for d in per_call), default=0)):
        out += [{"tool_calls": [d[step]]} for d in per_call if step < len(d)]
    return out


def stream_chunks(
    *,
    dialect: str,
    completion_id: str,
    created: int,
    model: str,
    reply: Reply,
    usage: dict[str, Any],
    include_usage: bool,
    obfuscation: bool = True,
    interleave: bool = False,
    service_tier: str | None = None,
    replies: Sequence[Reply] | None = None,
    index: int = 0,
    logprobs: int | None = None,
) -> list[dict[str, Any]]:
    """Every ``chat.completion.chunk`` of a streamed reply, in order ([DONE] not included);
    ``service_tier``: the processing tier each chunk names (a request's ``flex`` or
    ``priority``, as OpenAI names the tier it used). With ``replies`` (``n`` of them), each
    choice's chunks by its index, the choices' taken in turn. With ``logprobs`` (as
    ``completion_object``'s), each content chunk carries its token's."""
    nulls = include_usage
    pad = obfuscation and dialect == "openai"
    if replies is not None and len(replies) > 1:
        each = [
            stream_chunks(
                dialect=dialect,
                completion_id=completion_id,
                created=created,
                model=model,
                reply=said,
                usage=usage,
                include_usage=False,
                obfuscation=obfuscation,
                interleave=interleave,
                service_tier=service_tier,
                index=i,
                logprobs=logprobs,
            )
            for i, said in enumerate(replies)
        ]
        if include_usage or dialect == "deepseek":
            for chunks in each:  # (the usage once, in the last chunk: as for one choice)
                chunks[-1].pop("usage", None)
        merged = [c for turn in zip_longest(*each) for c in turn if c is not None]
        if nulls:
            for c in merged:
                c["usage"] = None
                if pad:
                    c["obfuscation"] = c.pop("obfuscation")
        if dialect == "deepseek":
            merged[-1]["usage"] = usage
        elif include_usage:
            tail = {k: v for k, v in merged[-1].items() if k != "obfuscation"}
            tail["choices"] = []
            tail["usage"] = usage
            if pad:
                tail["obfuscation"] = padding({})
            merged.append(tail)
        return merged

    def chunk(
        delta: dict[str, Any], finish: str | None = None, chances: Any = None
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [
                {"index": index, "delta": delta, "logprobs": chances, "finish_reason": finish}
            ],
        }
        if service_tier is not None:
            out["service_tier"] = service_tier
        if nulls:
            out["usage"] = None
        if pad:
            out["obfuscation"] = padding(delta)
        return out

    role: dict[str, Any] = {
        "role": "assistant",
        "content": "" if reply.content is not None else None,
    }
    if dialect == "openai":
        role["refusal"] = None
    chunks = [chunk(role)]
    if logprobs is None:
        chunks += [chunk({"content": p}) for p in pieces(reply.content or "")]
    else:
        chunks += [
            chunk({"content": p}, None, {"content": [_logprob_entry(p, logprobs)], "refusal": None})
            for p in pieces(reply.content or "")
        ]
    chunks += [chunk(d) for d in _call_deltas(reply, interleave)]
    if dialect == "deepseek":
        final = chunk({"content": ""}, reply.finish_reason)
        final["usage"] = usage
        return [*chunks, final]
    chunks.append(chunk({}, reply.finish_reason))
    if include_usage:
        tail = chunk({})
        tail["choices"] = []
        tail["usage"] = usage
        if pad:
            tail["obfuscation"] = tail.pop("obfuscation")  # still the last member
        chunks.append(tail)
    return chunks


_PAD_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def padding(delta: dict[str, Any]) -> str:
    """An ``obfuscation`` value for a chunk with ``delta``: letters and digits, 1-16 of them."""
    digest = hashlib.blake2b(orjson.dumps(delta), digest_size=17).digest()
    return bytes(_PAD_CHARS[b % len(_PAD_CHARS)] for b in digest[1 : 2 + digest[0] % 16]).decode()


def response_message(message_id: str, text: str) -> dict[str, Any]:
    """A Responses API output item: an assistant message of ``text``."""
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "id": message_id,
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [part],
    }


def compacted_user_message(item_id: str, content: Any) -> dict[str, Any]:
    """A user message as a compaction keeps it: its text as an ``input_text`` part."""
    parts = content if isinstance(content, list) else [{"type": "input_text", "text": content}]
    return {
        "id": item_id,
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": parts,
    }


def response_call(item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A Responses API output item: a function call."""
    return {
        "id": item_id,
        "type": "function_call",
        "status": "completed",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def response_object(
    *,
    response_id: str,
    created: int,
    model: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    request: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A completed Responses API ``response`` object of ``output`` items, echoing the
    ``request``'s ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as OpenAI does."""
    asked = request or {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": asked.get("parallel_tool_calls", True),
        "tool_choice": asked.get("tool_choice", "auto"),
        "tools": asked.get("tools") or [],
        "usage": usage,
    }


def response_usage(
    input_tokens: int, output_tokens: int, cached: int = 0, reasoning: int = 0
) -> dict[str, Any]:
    """A Responses API ``usage`` object, ``cached`` of its input tokens read from the cache and
    ``reasoning`` of its output tokens the model's reasoning (counted in them, as OpenAI does)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": input_tokens + output_tokens,
    }


def _item_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of one output item, from its announcement to its ``done``: a message's text
    in ``response.output_text.delta`` pieces, a call's arguments in
    ``response.function_call_arguments.delta`` ones."""
    events: list[dict[str, Any]] = []
    if item["type"] == "message":
        at = {"item_id": item["id"], "output_index": index, "content_index": 0}
        text = item["content"][0]["text"]
        empty = {"type": "output_text", "text": "", "annotations": []}
        events += [
            {
                "type": "response.output_item.added",
                "output_index": index,
                "item": {**item, "status": "in_progress", "content": []},
            },
            {"type": "response.content_part.added", **at, "part": empty},
            *(
                {"type": "response.output_text.delta", **at, "delta": piece, "logprobs": []}
                for piece in pieces(text)
            ),
            {"type": "response.output_text.done", **at, "text": text, "logprobs": []},
            {"type": "response.content_part.done", **at, "part": item["content"][0]},
        ]
    else:
        at = {"item_id": item["id"], "output_index": index}
        events += [
            {
                "type": "response.output_item.added",
                "output_index": index,
                "item": {**item, "status": "in_progress", "arguments": ""},
            },
            *(
                {"type": "response.function_call_arguments.delta", **at, "delta": piece}
                for piece in pieces(item["arguments"])
            ),
            {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]},
        ]
    events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    return events


def response_events(done: dict[str, Any]) -> list[bytes]:
    """The SSE stream of the Responses API for ``done`` (a completed ``response_object``), an
    event each: ``event:`` and ``data:`` lines, each output item's text or arguments in pieces."""
    started = {**done, "status": "in_progress", "output": [], "usage": None}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
    ]
    for index, item in enumerate(done["output"]):
        events += _item_events(index, item)
    events.append({"type": "response.completed", "response": done})
    out = []
    for number, event in enumerate(events):
        event = {"type": event["type"], "sequence_number": number, **event}
        out.append(b"event: " + event["type"].encode() + b"\n" + encode_event(event))
    return out
