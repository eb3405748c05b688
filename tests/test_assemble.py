"""The stream assembler and recorder: deltas to one assistant message, for any chunking."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.assemble import (
    AssembledResponse,
    StreamAssembler,
    StreamRecorder,
    assemble_completion,
)
from proxy.sse import SSEEvent
from proxy.usage import Usage


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> bytes:
    """One OpenAI ``chat.completion.chunk`` rendered as an SSE event."""
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "gpt-4o-2024-08-06",
        "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    body.update(extra)
    return b"data: " + orjson.dumps(body) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def record(chunks: list[bytes]) -> AssembledResponse:
    recorder = StreamRecorder()
    for piece in chunks:
        recorder.feed(piece)
    return recorder.finish()


def tool(
    index: int, id: str | None = None, name: str | None = None, args: str | None = None
) -> Any:
    call: dict[str, Any] = {"index": index}
    if id is not None:
        call["id"] = id
        call["type"] = "function"
    function: dict[str, str] = {}
    if name is not None:
        function["name"] = name
    if args is not None:
        function["arguments"] = args
    if function:
        call["function"] = function
    return call


# A parallel tool call stream as OpenAI sends it, here with the two calls' argument fragments
# interleaved by index (some compatible servers interleave; OpenAI itself sends them in turn).
PARALLEL_TOOLS_STREAM = b"".join(
    [
        b": keep-alive\n\n",
        chunk({"role": "assistant", "content": None, "refusal": None}),
        chunk({"tool_calls": [tool(0, "call_A", "get_weather", "")]}),
        chunk({"tool_calls": [tool(1, "call_B", "get_time", "")]}),
        chunk({"tool_calls": [tool(0, args='{"city": ')]}),
        chunk({"tool_calls": [tool(1, args='{"tz": "Europe/')]}),
        chunk({"tool_calls": [tool(0, args='"Zürich"}')]}),
        chunk({"tool_calls": [tool(1, args='Paris"}')]}),
        chunk({}, "tool_calls"),
        chunk(
            None,
            usage={
                "prompt_tokens": 2100,
                "completion_tokens": 48,
                "total_tokens": 2148,
                "prompt_tokens_details": {"cached_tokens": 1920},
            },
        ),
        DONE,
    ]
)

PARALLEL_TOOLS_MESSAGE = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_A",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
        },
        {
            "id": "call_B",
            "type": "function",
            "function": {"name": "get_time", "arguments": '{"tz": "Europe/Paris"}'},
        },
    ],
}


def test_parallel_tool_calls_interleaved_by_index() -> None:
    assert record([PARALLEL_TOOLS_STREAM]) == AssembledResponse(
        message=PARALLEL_TOOLS_MESSAGE,
        finish_reason="tool_calls",
        usage=Usage(2100, 48, 1920, 0, True),
        error=None,
        done=True,
        model="gpt-4o-2024-08-06",
        id="chatcmpl-1",
        events=10,
        malformed=0,
    )


def test_a_long_argument_in_thousands_of_deltas_is_assembled_whole() -> None:
    """A file written by a tool arrives a few characters per delta; every one is kept, in order,
    also when the result is read midway (an interrupted stream) and the stream goes on."""
    text = orjson.dumps({"path": "big.py", "content": "x = 1\n" * 4000}).decode()
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    recorder = StreamRecorder()
    recorder.feed(chunk({"role": "assistant", "tool_calls": [tool(0, "call_w", "write", "")]}))
    for n, piece in enumerate(pieces):
        recorder.feed(chunk({"tool_calls": [tool(0, args=piece)]}))
        if n == len(pieces) // 2:
            midway = recorder.result().message["tool_calls"][0]["function"]["arguments"]
            assert midway == "".join(pieces[: n + 1])
    recorder.feed(chunk({}, "tool_calls") + DONE)
    [call] = recorder.finish().message["tool_calls"]
    assert call == {
        "id": "call_w",
        "type": "function",
        "function": {"name": "write", "arguments": text},
    }


def test_every_two_piece_cut_assembles_the_same() -> None:
    expected = record([PARALLEL_TOOLS_STREAM])
    stream = PARALLEL_TOOLS_STREAM.replace(b"\n", b"\r\n")
    for cut in range(len(stream) + 1):
        assert record([stream[:cut], stream[cut:]]) == expected, cut


def test_text_stream() -> None:
    stream = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo, "}),
        chunk({"content": "wörld 😀"}),
        chunk({}, "stop"),
        DONE,
    ]
    result = record(stream)
    assert result.message == {"role": "assistant", "content": "Hello, wörld 😀"}
    assert result.finish_reason == "stop"
    assert result.done is True
    assert result.usage is None


def test_repeated_full_function_name_is_not_concatenated() -> None:
    stream = [
        chunk({"tool_calls": [tool(0, "call_1", "read_file", '{"pa')]}),
        chunk({"tool_calls": [tool(0, "call_1", "read_file", 'th": "a.py"}')]}),
        chunk({"tool_calls": [tool(0, name="read_file", args="")]}),
        chunk({}, "tool_calls"),
    ]
    assert record(stream).message["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
        }
    ]


def test_function_name_streamed_in_fragments_is_concatenated() -> None:
    stream = [
        chunk({"tool_calls": [tool(0, "call_1", "get_", "")]}),
        chunk({"tool_calls": [tool(0, name="weather", args="{}")]}),
    ]
    assert record(stream).message["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": "{}",
    }


def test_index_zero_reused_for_parallel_calls_with_different_ids() -> None:
    stream = [
        chunk({"tool_calls": [tool(0, "call_1", "ls", '{"dir": ')]}),
        chunk({"tool_calls": [tool(0, args='"src"}')]}),
        chunk({"tool_calls": [tool(0, "call_2", "ls", '{"dir": ')]}),
        chunk({"tool_calls": [tool(0, args='"tests"}')]}),
        chunk({}, "tool_calls"),
        DONE,
    ]
    assert record(stream).message["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "ls", "arguments": '{"dir": "src"}'},
        },
        {
            "id": "call_2",
            "type": "function",
            "function": {"name": "ls", "arguments": '{"dir": "tests"}'},
        },
    ]


@pytest.mark.parametrize("first_args", ["", None])
def test_an_id_changed_in_mid_call_is_the_same_call(first_args: str | None) -> None:
    """A provider that sends the call's name under one id and its arguments under another
    (Poolside's): logged as two calls, the named one without arguments, where the SDKs read
    one (the Node SDK with the later id, as here)."""
    stream = [
        chunk({"role": "assistant", "content": None}),
        chunk({"tool_calls": [tool(0, "call_AAA", "read_file", first_args)]}),
        chunk({"tool_calls": [tool(0, "call_BBB", args='{"pa')]}),
        chunk({"tool_calls": [tool(0, "call_BBB", args='th": "a')]}),
        chunk({"tool_calls": [tool(0, "call_BBB", args='.py"}')]}),
        chunk({}, "tool_calls"),
        DONE,
    ]
    assert record(stream).message["tool_calls"] == [
        {
            "id": "call_BBB",
            "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
        }
    ]
    # parallel calls at index 0, the second one's id before its name: two calls, as before
    parallel = [
        chunk({"tool_calls": [tool(0, "call_A", "get_time", "")]}),
        chunk({"tool_calls": [tool(0, "call_B")]}),
        chunk({"tool_calls": [tool(0, name="get_weather", args="")]}),
        chunk({"tool_calls": [tool(0, args='{"city":"Paris"}')]}),
        chunk({}, "tool_calls"),
        DONE,
    ]
    assert [(c["id"], c["function"]["name"]) for c in record(parallel).message["tool_calls"]] == [
        ("call_A", "get_time"),
        ("call_B", "get_weather"),
    ]
    # a new id once the arguments are whole, unnamed: a call of its own, as before
    whole = [*stream[:2], chunk({"tool_calls": [tool(0, "call_BBB", args="{}")]})]
    whole += [chunk({"tool_calls": [tool(0, "call_CCC", args='{"x": 1}')]}), DONE]
    assert [c["id"] for c in record(whole).message["tool_calls"]] == ["call_BBB", "call_CCC"]


def test_an_empty_finish_reason_is_none_as_the_sdks_read_it() -> None:
    """SGLang 0.4 and older Ollama send ``"finish_reason": ""`` on every chunk: a stream cut
    before its last chunk was logged as finished (``""``), with no note of the cut."""
    stream = [chunk({"content": "Hel"}, ""), chunk({"content": "lo, wor"}, "")]
    cut = record(stream)
    assert cut.message["content"] == "Hello, wor" and cut.finish_reason is None
    done = record([*stream, chunk({}, "stop"), DONE])
    assert done.finish_reason == "stop"
    message = {"role": "assistant", "content": "x"}
    whole = assemble_completion(
        {"choices": [{"index": 0, "message": message, "finish_reason": ""}]}
    )
    assert whole.finish_reason is None


@pytest.mark.parametrize("ids", [None, ""])
@pytest.mark.parametrize("names", [("get_weather", "get_time"), ("read", "read")])
def test_parallel_calls_without_index_or_id_are_each_a_call(
    ids: str | None, names: tuple[str, str]
) -> None:
    """Gemini's OpenAI endpoint sends each parallel call whole in a chunk of its own, with no
    index and no id (a gateway before it: an empty id): the calls were logged as one, named
    ``get_weatherget_time`` with both arguments run together."""

    def whole(name: str, args: str) -> dict[str, Any]:
        call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
        if ids is not None:
            call["id"] = ids
        return call

    stream = [
        chunk({"role": "assistant", "tool_calls": [whole(names[0], '{"p": "a"}')]}),
        chunk({"tool_calls": [whole(names[1], '{"p": "b"}')]}),
        chunk({}, "tool_calls"),
        DONE,
    ]
    calls = record(stream).message["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (names[0], '{"p": "a"}'),
        (names[1], '{"p": "b"}'),
    ]


def test_one_call_without_index_whose_name_comes_on_every_chunk_stays_one_call() -> None:
    def piece(args: str) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "get_weather", "arguments": args}}

    stream = [
        chunk({"role": "assistant", "tool_calls": [{**piece(""), "id": "call_1"}]}),
        chunk({"tool_calls": [piece('{"city": ')]}),
        chunk({"tool_calls": [piece('"Paris"}')]}),
        chunk({}, "tool_calls"),
        DONE,
    ]
    calls = record(stream).message["tool_calls"]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("call_1", "get_weather", '{"city": "Paris"}')
    ]


@pytest.mark.parametrize("repeat_name", [False, True])
def test_calls_without_index_or_id_streamed_in_pieces_are_split_where_each_ends(
    repeat_name: bool,
) -> None:
    """Arguments in pieces, without index or id (a gateway before Gemini), the name on the
    first piece or on every one: a call ends where its arguments are a whole JSON value (a
    quote escaped across two pieces, brackets inside a string included)."""

    def piece(name: str, args: str, first: bool) -> dict[str, Any]:
        function = {"arguments": args}
        if first or repeat_name:
            function["name"] = name
        return {"type": "function", "function": function}

    plan = [
        ("read", ['{"path": ', '"a.py"}']),
        ("write", ['{"text": "a\\', '"}{[ "', ", ", '"end": 1}']),
        ("write", ['{"path": "c.py"}']),
    ]
    deltas = [piece(name, p, i == 0) for name, parts in plan for i, p in enumerate(parts)]
    stream = [chunk({"role": "assistant", "tool_calls": [deltas[0]]})]
    stream += [chunk({"tool_calls": [d]}) for d in deltas[1:]] + [chunk({}, "tool_calls"), DONE]
    calls = record(stream).message["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (name, "".join(parts)) for name, parts in plan
    ]
    assert orjson.loads(calls[1]["function"]["arguments"]) == {"text": 'a"}{[ ', "end": 1}


def test_index_less_calls_with_double_encoded_arguments_and_a_closing_name_chunk() -> None:
    """Arguments sent as a JSON string (double-encoded) end where the string does; a last chunk
    that repeats the name with no arguments is no call of its own."""

    def piece(name: str, args: str) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "arguments": args}}

    deltas = [piece("w", '"{\\"a\\": '), piece("w", '1}"'), piece("v", "{}"), piece("v", "")]
    stream = [chunk({"role": "assistant", "tool_calls": [deltas[0]]})]
    stream += [chunk({"tool_calls": [d]}) for d in deltas[1:]] + [chunk({}, "tool_calls"), DONE]
    calls = record(stream).message["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("w", '"{\\"a\\": 1}"'),
        ("v", "{}"),
    ]


def test_same_named_calls_without_index_or_id_each_opened_by_a_name_only_delta() -> None:
    """OpenAI's shape with the index and ids taken out by a gateway: each call opens with its
    name (and empty arguments), then its arguments; two calls to one function were merged."""

    def opening() -> dict[str, Any]:
        return {"type": "function", "function": {"name": "read", "arguments": ""}}

    def args(text: str) -> dict[str, Any]:
        return {"function": {"arguments": text}}

    deltas = [opening(), args('{"p":'), args('"a"}'), opening(), args('{"p":"b"}')]
    stream = [chunk({"role": "assistant", "tool_calls": [deltas[0]]})]
    stream += [chunk({"tool_calls": [d]}) for d in deltas[1:]] + [chunk({}, "tool_calls"), DONE]
    calls = record(stream).message["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == ['{"p":"a"}', '{"p":"b"}']


def test_parallel_calls_without_arguments_index_or_id_are_each_a_call() -> None:
    def bare(name: str) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "arguments": ""}}

    stream = [
        chunk({"role": "assistant", "tool_calls": [bare("list_tabs")]}),
        chunk({"tool_calls": [bare("get_time")]}),
        chunk({}, "tool_calls"),
        DONE,
    ]
    calls = record(stream).message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["list_tabs", "get_time"]


def test_reasoning_under_the_name_ollama_and_openrouter_give_it_is_logged() -> None:
    stream = [
        chunk({"role": "assistant", "content": "", "reasoning": "Think "}),
        chunk({"content": "", "reasoning": "first."}),
        chunk({"content": "Hi"}, "stop"),
        DONE,
    ]
    assert record(stream).message == {
        "role": "assistant",
        "content": "Hi",
        "reasoning_content": "Think first.",
    }
    body = {
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hi", "reasoning": "Hm."}}
        ]
    }
    assembled = assemble_completion(body)
    assert assembled is not None and assembled.message["reasoning_content"] == "Hm."


def test_content_and_tool_call_together() -> None:
    stream = [
        chunk({"role": "assistant", "content": "Let me look."}),
        chunk({"tool_calls": [tool(0, "call_9", "grep", '{"q": "x"}')]}),
        chunk({}, "tool_calls"),
    ]
    message = record(stream).message
    assert message["content"] == "Let me look."
    assert [c["id"] for c in message["tool_calls"]] == ["call_9"]


def test_reasoning_content_and_deepseek_usage() -> None:
    stream = [
        chunk({"role": "assistant", "content": None, "reasoning_content": ""}),
        chunk({"content": None, "reasoning_content": "The user wants "}),
        chunk({"content": None, "reasoning_content": "a greeting."}),
        chunk({"content": "Hi!", "reasoning_content": None}),
        chunk(
            {"content": ""},
            "stop",
            usage={
                "prompt_tokens": 1500,
                "completion_tokens": 40,
                "total_tokens": 1540,
                "prompt_cache_hit_tokens": 1280,
                "prompt_cache_miss_tokens": 220,
            },
        ),
        DONE,
    ]
    result = record(stream)
    assert result.message == {
        "role": "assistant",
        "content": "Hi!",
        "reasoning_content": "The user wants a greeting.",
    }
    assert result.usage == Usage(1500, 40, 1280, 0, True)


def test_usage_on_every_chunk_keeps_the_last_real_report() -> None:
    zero = {"prompt_tokens": 0, "completion_tokens": 0}
    stream = [
        chunk({"content": "a"}, usage=zero),
        chunk({"content": "b"}, usage={"prompt_tokens": 10, "completion_tokens": 1}),
        chunk({"content": "c"}, usage={"prompt_tokens": 10, "completion_tokens": 2}),
        chunk({}, "stop", usage=zero),
    ]
    assert record(stream).usage == Usage(10, 2)


def test_anthropic_style_usage_on_an_openai_stream() -> None:
    usage = {
        "input_tokens": 12,
        "output_tokens": 85,
        "cache_read_input_tokens": 4000,
        "cache_creation_input_tokens": 600,
    }
    assert record([chunk({"content": "ok"}, "stop"), chunk(None, usage=usage)]).usage == Usage(
        4612, 85, 4000, 600, True, True, True
    )


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def test_moonshot_usage_inside_the_last_choice_is_read() -> None:
    usage = {"prompt_tokens": 6000, "completion_tokens": 20, "cached_tokens": 4992}
    last = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "kimi-k2.6",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "usage": usage}],
    }
    # the same chunk with text too, which must not take the text-only lane
    with_text = {**last, "choices": [{**last["choices"][0], "delta": {"content": "!"}}]}
    for stream in (
        [chunk({"content": "ok"}), sse(last)],
        [chunk({"content": "ok"}), sse(with_text)],
    ):
        result = record([*stream, b"data: [DONE]\n\n"])
        assert result.usage == Usage(6000, 20, 4992, 0, True)
        assert result.finish_reason == "stop"


def test_groq_usage_in_x_groq_is_read() -> None:
    usage = {"prompt_tokens": 300, "completion_tokens": 9, "total_tokens": 309}
    last = orjson.loads(chunk({}, "stop")[6:])
    last["x_groq"] = {"id": "req_01", "usage": usage}
    assert record([chunk({"content": "ok"}), sse(last)]).usage == Usage(300, 9)


def test_top_level_usage_wins_over_a_choices_copy() -> None:
    top = {"prompt_tokens": 10, "completion_tokens": 2}
    last = orjson.loads(chunk({}, "stop", usage=top)[6:])
    last["choices"][0]["usage"] = {"prompt_tokens": 99, "completion_tokens": 99}
    assert record([chunk({"content": "ok"}), sse(last)]).usage == Usage(10, 2)


def test_error_event_mid_stream_is_captured() -> None:
    error = {"error": {"message": "Overloaded", "type": "server_error", "code": "overloaded"}}
    stream = [
        chunk({"role": "assistant", "content": "Partial "}),
        chunk({"content": "answer"}),
        b"data: " + orjson.dumps(error) + b"\n\n",
    ]
    result = record(stream)
    assert result.error == error
    assert result.done is False
    assert result.finish_reason is None
    assert result.message == {"role": "assistant", "content": "Partial answer"}


def test_an_error_chunk_that_ends_its_choice_gives_the_finish_reason() -> None:
    """OpenRouter's mid-stream error: the error and a choice with ``finish_reason: "error"``."""
    error = {"code": 502, "message": "Provider disconnected"}
    stream = [
        chunk({"role": "assistant", "content": "Partial"}),
        chunk({"content": ""}, finish="error", error=error),
    ]
    result = record(stream)
    assert result.error is not None and result.error["error"] == error
    assert result.finish_reason == "error"
    assert result.message == {"role": "assistant", "content": "Partial"}


def test_error_typed_event_without_error_key_is_wrapped() -> None:
    stream = [b'event: error\ndata: {"message": "rate limited"}\n\n']
    assert record(stream).error == {"error": {"message": "rate limited"}}


def test_error_typed_event_with_plain_text_data() -> None:
    result = record([b"event: error\ndata: upstream went away\n\n"])
    assert result.error == {"error": {"message": "upstream went away"}}
    assert result.malformed == 1
    said = record([b'event: error\ndata: "Service overloaded"\n\n'])  # JSON, no object
    assert said.error == {"error": {"message": '"Service overloaded"'}}


def test_malformed_data_is_counted_not_raised() -> None:
    stream = [
        chunk({"content": "a"}),
        b"data: {not json\n\n",
        b"data: [1, 2]\n\n",
        b'data: "text"\n\n',
        chunk({"content": "b"}),
        b"data: \n\n",
        DONE,
    ]
    result = record(stream)
    assert result.malformed == 4  # the empty data line too: the openai SDKs raise on it
    # the SDKs raise at the first of them: the client's answer, and the log's, ends before it
    assert result.message["content"] == "a"
    assert result.events == 7


def test_the_answer_ends_where_the_sdks_raise_on_a_malformed_event() -> None:
    """A malformed event mid-answer: the openai SDKs raise there, and the agent's next turn
    carries the calls as it had them (one with cut arguments), but the log recorded the whole
    answer past it, every call complete and ``finish_reason`` "tool_calls". The usage after it
    is still taken: the provider bills it."""
    usage = {"prompt_tokens": 900, "completion_tokens": 40, "total_tokens": 940}
    calls = [
        chunk({"role": "assistant", "tool_calls": [tool(0, "call_a", "read", "")]}),
        chunk({"tool_calls": [tool(0, args='{"path":')]}),
        b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"ind\n\n',
        chunk({"tool_calls": [tool(0, args='"a.py"}')]}),
        chunk({"tool_calls": [tool(1, "call_b", "read", '{"path":"b.py"}')]}),
        chunk({}, finish="tool_calls"),
        chunk(None, usage=usage),
        DONE,
    ]
    for pieces in (calls, [b"".join(calls)]):  # event by event, and in one read
        result = record(pieces)
        assert result.malformed == 1
        assert result.message["tool_calls"] == [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "read", "arguments": '{"path":'},
            }
        ]
        assert result.finish_reason is None
        assert result.usage is not None and result.usage.prompt == 900
    # text: many chunks of one shape (the lanes that skip parsing them), then a malformed one
    text = [chunk({"content": f"w{i} "}) for i in range(12)]
    later = [chunk({"content": "more "}) for _ in range(12)]
    stream = [*text, b"data: {oops\n\n", *later, chunk({}, finish="stop"), DONE]
    for pieces in (stream, [b"".join(stream)]):
        result = record(pieces)
        assert result.message["content"] == "".join(f"w{i} " for i in range(12))
        assert result.finish_reason is None and result.malformed == 1


def test_what_the_sdks_read_past_is_assembled_past() -> None:
    """Only a payload that is no JSON at all ends the answer: one orjson refuses but the Python
    SDK reads (a lone surrogate escape, an emoji cut between two chunks; a logprob written as
    ``-Infinity``), and the blocks the Node SDK skips (only ``retry:``; a blank line after an
    ``id:``), were taken for one and cut the logged answer there."""
    head = (
        b'data: {"id":"c1","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,'
    )
    cut_emoji = [
        head + b'"delta":{"content":"\\ud83d"},"finish_reason":null}]}\n\n',
        head + b'"delta":{"content":"\\ude00 world"},"finish_reason":null}]}\n\n',
    ]
    infinite = head + (
        b'"delta":{"content":"world"},"logprobs":{"content":[{"token":"world",'
        b'"logprob":-Infinity}]},"finish_reason":null}]}\n\n'
    )
    first, end = chunk({"role": "assistant", "content": "Hello "}), chunk({}, finish="stop") + DONE
    for middle, content, malformed in (
        (cut_emoji, "Hello \ufffd\ufffd world", 0),  # (as a request's surrogate reads)
        ([infinite], "Hello world", 1),  # (counted: the Node SDK's parser refuses it)
        ([b"retry: 3000\n\n", chunk({"content": "world"})], "Hello world", 1),
        ([b"id: 2\n", chunk({"content": "world"}), b": keep-alive\n\n"], "Hello world", 1),
    ):
        stream = [first, *middle, end]
        for pieces in (stream, [b"".join(stream)]):
            result = record(pieces)
            assert (result.message["content"], result.finish_reason) == (content, "stop")
            assert result.malformed == malformed, middle
    # no JSON though it holds a NaN before its fault: the SDKs raise there, once counted
    for bad in (b'data: {"x": NaN, oops\n\n', b"data: [-Infinity\n\n"):
        result = record([first, bad, chunk({"content": "world"}), end])
        assert (result.message["content"], result.finish_reason) == ("Hello ", None)
        assert result.malformed == 1, bad


def test_an_empty_data_line_after_done_is_no_fault() -> None:
    """The SDKs stop reading at ``[DONE]``: what comes after it cannot fail them."""
    result = record([chunk({"content": "a"}), DONE, b"data: \n\n"])
    assert result.malformed == 0 and result.done


def test_only_choice_zero_is_assembled() -> None:
    body = {
        "choices": [
            {"index": 1, "delta": {"content": "other"}, "finish_reason": "length"},
            {"index": 0, "delta": {"content": "mine"}, "finish_reason": "stop"},
        ]
    }
    result = record([b"data: " + orjson.dumps(body) + b"\n\n"])
    assert result.message["content"] == "mine"
    assert result.finish_reason == "stop"


def test_interrupted_stream_gives_the_partial_message() -> None:
    stream = [
        chunk({"tool_calls": [tool(0, "call_1", "write_file", '{"path": "a.py", "cont')]}),
        b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function"',
    ]
    result = record(stream)
    assert result.done is False
    assert result.finish_reason is None
    assert result.unfinished is True  # the torn last event, flushed at the end...
    assert result.malformed == 0  # ...is no malformed one: the stream was cut inside it
    assert result.message["tool_calls"][0]["function"]["arguments"] == '{"path": "a.py", "cont'


def test_final_event_without_blank_line_is_flushed() -> None:
    stream = [chunk({"content": "x"}), b"data: [DONE]"]
    assert record(stream).done is True


def test_assembler_takes_sse_events_directly() -> None:
    assembler = StreamAssembler()
    assembler.feed(SSEEvent(None, '{"choices": [{"index": 0, "delta": {"content": "hi"}}]}'))
    assembler.feed(SSEEvent(None, "[DONE]"))
    result = assembler.result()
    assert result.message == {"role": "assistant", "content": "hi"}
    assert (result.done, result.events) == (True, 2)


def test_result_can_be_taken_mid_stream() -> None:
    recorder = StreamRecorder()
    recorder.feed(chunk({"content": "a"}))
    assert recorder.result().message["content"] == "a"
    recorder.feed(chunk({"content": "b"}))
    assert recorder.finish().message["content"] == "ab"


def test_assemble_completion_with_tool_calls() -> None:
    body = {
        "id": "chatcmpl-9",
        "object": "chat.completion",
        "model": "gpt-4o",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_A",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                        },
                        {
                            "id": "call_B",
                            "type": "function",
                            "function": {"name": "get_time", "arguments": '{"tz": "Europe/Paris"}'},
                        },
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {
            "prompt_tokens": 2100,
            "completion_tokens": 48,
            "prompt_tokens_details": {"cached_tokens": 1920},
        },
    }
    assert assemble_completion(body) == AssembledResponse(
        message=PARALLEL_TOOLS_MESSAGE,
        finish_reason="tool_calls",
        usage=Usage(2100, 48, 1920, 0, True),
        error=None,
        done=True,
        model="gpt-4o",
        id="chatcmpl-9",
    )


def test_assemble_completion_text_and_reasoning() -> None:
    body = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi!", "reasoning_content": "Greet."},
                "finish_reason": "stop",
            }
        ]
    }
    result = assemble_completion(body)
    assert result.message == {"role": "assistant", "content": "Hi!", "reasoning_content": "Greet."}
    assert result.usage is None


def test_a_refusal_a_legacy_function_call_and_a_custom_tool_call_are_logged_as_sent() -> None:
    """They were logged as ``{"role": "assistant", "content": null}``: the audit log lost what
    the model answered."""
    refusal = "I can't help with that."
    streamed = record(
        [
            chunk({"role": "assistant", "content": None, "refusal": ""}),
            chunk({"refusal": "I can't "}),
            chunk({"refusal": "help with that."}, "stop"),
            DONE,
        ]
    )
    plain = assemble_completion(
        {"choices": [{"index": 0, "message": {"role": "assistant", "refusal": refusal}}]}
    )
    for result in (streamed, plain):
        assert result.message == {"role": "assistant", "content": None, "refusal": refusal}
    function_call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    streamed = record(
        [
            chunk({"role": "assistant", "function_call": {"name": "get_weather", "arguments": ""}}),
            chunk({"function_call": {"arguments": '{"city": '}}),
            chunk({"function_call": {"arguments": '"Paris"}'}}, "function_call"),
            DONE,
        ]
    )
    plain = assemble_completion(
        {
            "choices": [
                {"index": 0, "message": {"role": "assistant", "function_call": function_call}}
            ]
        }
    )
    for result in (streamed, plain):
        assert result.message["function_call"] == function_call
    custom = {"index": 0, "id": "call_1", "type": "custom", "custom": {"name": "apply_patch"}}
    streamed = record(
        [
            chunk({"role": "assistant", "tool_calls": [custom]}),
            chunk({"tool_calls": [{"index": 0, "custom": {"input": "*** Begin Patch\n"}}]}),
            chunk(
                {"tool_calls": [{"index": 0, "custom": {"input": "*** End Patch"}}]}, "tool_calls"
            ),
            DONE,
        ]
    )
    call = {
        "id": "call_1",
        "type": "custom",
        "custom": {"name": "apply_patch", "input": "*** Begin Patch\n*** End Patch"},
    }
    plain = assemble_completion(
        {"choices": [{"index": 0, "message": {"role": "assistant", "tool_calls": [call]}}]}
    )
    for result in (streamed, plain):
        assert result.message["tool_calls"] == [call]


def test_assemble_completion_error_body() -> None:
    body = {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
    }
    result = assemble_completion(body)
    assert result.error == body
    assert result.done is False
    assert result.message == {"role": "assistant", "content": None}


# --- property tests -------------------------------------------------------------------------

_piece = st.text(max_size=6) | st.sampled_from(["€", "😀", "中文", "\r\n", '"', "\\"])


@st.composite
def _conversations(draw: st.DrawFn) -> tuple[bytes, dict[str, Any]]:
    """A random stream of content and parallel tool calls interleaved by index, and its message."""
    content = draw(st.lists(_piece, max_size=5))
    calls = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["read", "write", "run_tests"]), st.lists(_piece, max_size=4)
            ),
            max_size=3,
        )
    )
    events: list[bytes] = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": piece}) for piece in content]
    # Per call: its opening delta, then its argument fragments; calls interleave at random.
    queues = [
        [tool(i, f"call_{i}", name, "")] + [tool(i, args=a) for a in args]
        for i, (name, args) in enumerate(calls)
    ]
    while any(queues):
        live = [q for q in queues if q]
        queue = live[draw(st.integers(0, len(live) - 1))]
        events.append(chunk({"tool_calls": [queue.pop(0)]}))
    events += [chunk({}, "tool_calls" if calls else "stop"), DONE]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": name, "arguments": "".join(args)},
            }
            for i, (name, args) in enumerate(calls)
        ]
    return b"".join(events), message


@settings(max_examples=150, deadline=None)
@given(conversation=_conversations(), data=st.data())
def test_any_chunking_assembles_the_expected_message(
    conversation: tuple[bytes, dict[str, Any]], data: st.DataObject
) -> None:
    raw, message = conversation
    if data.draw(st.booleans()):
        raw = raw.replace(b"\n", b"\r\n")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=10)))
    chunks = [raw[a:b] for a, b in pairwise([0, *cuts, len(raw)])]
    whole = record([raw])
    assert whole.message == message
    assert whole.done is True
    assert whole.malformed == 0
    assert record(chunks) == whole


@settings(max_examples=20, deadline=None)
@given(conversation=_conversations())
def test_byte_by_byte_assembles_the_same(conversation: tuple[bytes, dict[str, Any]]) -> None:
    raw, message = conversation
    assert record([raw[i : i + 1] for i in range(len(raw))]).message == message


def test_fast_path_counts_odd_payloads_as_the_event_by_event_path_does() -> None:
    """Malformed data, an error object, spaces around [DONE], a JSON array: the recorder's fast
    path (plain ``data:`` events, LF endings) must give what feeding decoded events gives."""
    raw = b"".join(
        [
            chunk({"role": "assistant", "content": ""}),
            b"data: not json\n\n",
            chunk({"content": "Hi"}),
            b"data: [1, 2]\n\n",
            b'data: {"error":{"message":"overloaded"}}\n\n',
            b"data:  [DONE] \n\n",
            b"data: \xff\n\n",
            DONE,
        ]
    )
    assembler = StreamAssembler()
    for event in decode_stream(raw):
        assembler.feed(event)
    slow = assembler.result()
    fast = record([raw])
    assert fast == slow
    assert fast.message["content"] == ""  # ("Hi" came after an event the SDKs raise on)
    assert fast.malformed == 2  # (not the bytes after [DONE]: no SDK reads them)
    assert fast.error == {"error": {"message": "overloaded"}}
    assert fast.done is True


def test_what_follows_done_is_no_part_of_the_answer() -> None:
    """The SDKs stop reading at [DONE]: a chunk after it was recorded in the answer, and data
    that is not JSON after it as an event "a client that parses events fails on"."""
    raw = b"".join(
        [
            chunk({"role": "assistant", "content": "visible"}),
            DONE,
            chunk({"content": " AFTER-DONE"}),
            b"data: not json\n\n",
        ]
    )
    assembler = StreamAssembler()
    for event in decode_stream(raw):
        assembler.feed(event)
    for got in (assembler.result(), record([raw]), record([raw[:40], raw[40:]])):
        assert got.message["content"] == "visible"
        assert got.malformed == 0 and got.error is None and got.done


def test_a_streamed_content_of_parts_is_recorded_as_its_text() -> None:
    """Deltas whose content is a list of parts (Mistral's reasoning models: a thinking part,
    then text parts): the log said ``"content": null``, where the same answer not streamed
    gave its text."""
    thinking = {"type": "thinking", "thinking": [{"type": "text", "text": "hmm"}]}
    raw = b"".join(
        [
            chunk({"role": "assistant", "content": [thinking]}),
            chunk({"content": [{"type": "text", "text": "Hello "}]}),
            chunk({"content": [{"type": "text", "text": "world"}]}, "stop"),
            DONE,
        ]
    )
    assert record([raw]).message["content"] == "Hello world"
    body = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": [thinking, {"type": "text", "text": "Hello world"}],
                },
                "finish_reason": "stop",
            }
        ]
    }
    assert assemble_completion(body).message["content"] == "Hello world"


def decode_stream(raw: bytes) -> list[SSEEvent]:
    from proxy.sse import SSEDecoder

    decoder = SSEDecoder()
    return decoder.decode(raw) + decoder.flush()


# --- learned chunk shapes -------------------------------------------------------------------
# Once a text-only chunk has been parsed, chunks that differ from it only in their text (and in
# OpenAI's trailing obfuscation padding) are taken without parsing. The outcome must be the
# general path's for any bytes: escapes, quotes that change the JSON's structure, control
# characters, bytes that are not UTF-8, a character split across two chunks, a second content
# key, a key spelled with an escape, another id.

_HEAD = (
    b'{"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"'
)
_TAIL = b'"},"logprobs":null,"finish_reason":null}]'
_SAFE = [b"w", b" hello", b"", "\u20ac".encode(), "\U0001f600".encode()]
_ODD = [b"\xe2\x82", b"\xac", b"\xff", b"\\n", b'\\"', b"\\\\", b"\\u00e9", b"\t", b'"']
_ODD += [b'a","x":"', b"\\", b"\n", b"\r", b"\n\ndata: x"]
_PADS = [b"Ab3", b"xxxxxxxxx", b"", b"\xc3\xa9", b"\xff", b'q"', b"\\n", b"\x01", b'","z":"']
_HEADS = [
    _HEAD.replace(b"chatcmpl-9", b"chatcmpl-8"),
    _HEAD.replace(b'"content"', b'"cont\\u0065nt"'),
    _HEAD.replace(b'"index":0', b'"index":1'),
    _HEAD.replace(b'"delta":{', b'"delta":{"role":"assistant",'),
]
# a second content key after the text: literal (the last one wins) or spelled with an escape
_SECOND_KEYS = [b'","content":"', b'","cont\\u0065nt":"', b'","reasoning_content":"']


@st.composite
def _shaped_payloads(draw: st.DrawFn) -> list[bytes]:
    """A stream of mostly typical text chunks (with or without padding) and, at a drawn rate,
    odd ones: odd bytes in the text or the padding, other heads, a second content key, padding
    where there was none and the reverse, other chunks."""
    payloads = [chunk({"role": "assistant", "content": ""})[6:-2]]
    padded = draw(st.booleans())
    odd_percent = draw(st.sampled_from([0, 5, 20, 50, 100]))

    def pad() -> bytes:
        return b',"obfuscation":"' + draw(st.sampled_from(_PADS[:2])) + b'"}' if padded else b"}"

    kinds = draw(st.lists(st.integers(0, 9), min_size=1, max_size=2))  # the odd kinds here
    for _ in range(draw(st.integers(0, 40))):
        if draw(st.integers(0, 99)) >= odd_percent:
            payloads.append(_HEAD + draw(st.sampled_from(_SAFE)) + _TAIL + pad())
            continue
        kind = draw(st.sampled_from(kinds))
        text = b"".join(draw(st.lists(st.sampled_from(_SAFE + _ODD), min_size=1, max_size=3)))
        if kind == 0:
            payloads.append(_HEAD + text + _TAIL + pad())
        elif kind == 1:
            payloads.append(draw(st.sampled_from(_HEADS)) + text + _TAIL + pad())
        elif kind == 2:
            first, second = draw(st.sampled_from(_SAFE[:2])), draw(st.sampled_from(_SAFE[:2]))
            key = draw(st.sampled_from(_SECOND_KEYS))
            payloads.append(_HEAD + first + key + second + _TAIL + pad())
        elif kind == 3:  # padding where there was none, and the reverse
            payloads.append(_HEAD + text + _TAIL + (b"}" if padded else b',"obfuscation":"x"}'))
        elif kind == 4:
            odd_pad = b',"obfuscation":"' + draw(st.sampled_from(_PADS)) + b'"}'
            trailer = draw(st.sampled_from([b"", b" ", b"}", b',"obfuscation":"x"}']))
            payloads.append(_HEAD + text + _TAIL + odd_pad + trailer)
        elif kind == 5:
            payloads.append(chunk({}, "stop")[6:-2])
        elif kind == 6:
            payloads.append(_HEAD + text + _TAIL.replace(b"null}", b'"length"}') + pad())
        elif kind == 7:
            payloads.append(b"not json")
        elif kind == 8:
            payloads.append(chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 1})[6:-2])
        else:
            payloads.append(b"[DONE]")
    return payloads


@settings(max_examples=400, deadline=None)
@given(payloads=_shaped_payloads(), data=st.data())
def test_learned_shapes_give_what_parsing_every_event_gives(
    payloads: list[bytes], data: st.DataObject
) -> None:
    raw = b"".join(b"data: " + p + b"\n\n" for p in payloads)
    if data.draw(st.booleans()):
        # one event per chunk, as providers send them; else cut anywhere
        chunks = [b"data: " + p + b"\n\n" for p in payloads]
    else:
        cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
        chunks = [raw[a:b] for a, b in pairwise([0, *cuts, len(raw)])]
    assembler = StreamAssembler()
    for event in decode_stream(raw):
        assembler.feed(event)  # the general path: every event parsed
    assert record(chunks) == assembler.result()


def _events(*payloads: bytes) -> list[bytes]:
    return [b"data: " + p + b"\n\n" for p in payloads]


def _text(text: bytes, end: bytes = b"}", tail: bytes = _TAIL) -> bytes:
    return _HEAD + text + tail + end


_ROLE = chunk({"role": "assistant", "content": ""})[6:-2]
_LENGTH = _TAIL.replace(b"null}", b'"length"}')
_STOP = chunk({}, "stop")[6:-2]
_PAD = b',"obfuscation":"%s"}'


@pytest.mark.parametrize(
    "chunks",
    [
        # a second content key, spelled with an escape, then literally: the last one wins
        _events(
            _ROLE,
            *[_text(b"w")] * 2,
            *[_text(t + b'","cont\\u0065nt":"w') for t in (b"w", b"v", b"u")],
        ),
        _events(
            _ROLE, *[_text(b"w")] * 2, *[_text(t + b'","content":"w') for t in (b"w", b"v", b"u")]
        ),
        # a character split across two chunks of one batch is not that character
        _events(_ROLE, *[_text(b"w")] * 8, _text(b"\xe2\x82"), _text(b"\xac"), *[_text(b"w")] * 6),
        # more after the learned chunk's end; padding that is no JSON string; padding not UTF-8
        _events(_ROLE, *[_text(b"w")] * 3, _text(b"v", b"}}"), _text(b"u", b"} ")),
        _events(
            _ROLE,
            *[_text(b"w", _PAD % b"ab")] * 3,
            _text(b"v", _PAD % b'q"'),
            _text(b"u", _PAD % b"\x01"),
        ),
        _events(_ROLE, *[_text(b"w", _PAD % b"ab")] * 3, _text(b"v", _PAD % b"\xff")),
        # the learned chunk carries a finish reason; a later chunk changes it, a batch of the
        # learned shape (or one chunk of it, padded) restores it; a tail of the same length
        _events(_ROLE, *[_text(b"w", tail=_LENGTH)] * 6, _STOP, *[_text(b"w", tail=_LENGTH)] * 8),
        _events(
            _ROLE,
            *[_text(b"w", _PAD % b"a", _LENGTH)] * 2,
            _STOP,
            _text(b"w", _PAD % b"b", _LENGTH),
        ),
        _events(_ROLE, *[_text(b"w")] * 3, _text(b"v", tail=_TAIL.replace(b"null}", b'"ab"}'))),
        # padding without its closing quote and brace
        _events(_ROLE, *[_text(b"w", _PAD % b"ab")] * 3, _text(b"v", b',"obfuscation":"abcxy')),
        # a batch that starts inside an event (its "event: error" line came with the last batch)
        [*_events(_ROLE, *[_text(b"w")] * 6), b"event: error\n", *_events(*[_text(b"v")] * 8)],
    ],
    ids=[
        "escaped-key",
        "second-key",
        "split-char",
        "trailer",
        "odd-padding",
        "padding-not-utf8",
        "finish-batch",
        "finish-padded",
        "tail-same-length",
        "padding-cut",
        "mid-event",
    ],
)
def test_learned_shapes_decline_what_parsing_reads_differently(chunks: list[bytes]) -> None:
    assembler = StreamAssembler()
    for event in decode_stream(b"".join(chunks)):
        assembler.feed(event)
    assert record(chunks) == assembler.result()


def _openai_stream(padded: bool) -> list[bytes]:
    pad = b',"obfuscation":"%s"}' if padded else b"}"
    events = [b"data: " + _HEAD + b"Hi" + _TAIL + (pad % b"abc" if padded else pad) + b"\n\n"]
    for i in range(64):
        end = pad % (b"x" * (i % 7)) if padded else pad
        events.append(b"data: " + _HEAD + b" w%d" % i + _TAIL + end + b"\n\n")
    return [*events, DONE]


@pytest.mark.parametrize("cut", [None, 37, 1000])
@pytest.mark.parametrize("padded", [False, True])
def test_a_typical_stream_is_parsed_a_few_events_only(
    padded: bool, cut: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenAI's streams, with and without obfuscation padding, one event per read or cut
    anywhere: after the first text chunks, the text of the rest is taken without parsing."""
    parsed = 0
    loads = orjson.loads

    def counting(data: bytes | str) -> Any:
        nonlocal parsed
        parsed += 1
        return loads(data)

    monkeypatch.setattr("proxy.assemble.orjson.loads", counting)
    chunks = _openai_stream(padded)
    if cut is not None:
        raw = b"".join(chunks)
        chunks = [raw[i : i + cut] for i in range(0, len(raw), cut)]
    result = record(chunks)
    assert result.message["content"] == "Hi" + "".join(f" w{i}" for i in range(64))
    assert result.events == 66 and result.done and result.malformed == 0
    # the role chunk, the first text chunk (its shape learned), the finish chunk, and each
    # event that a decoding every KEEP_BYTES cut in two
    kept = sum(len(c) + StreamRecorder.CHUNK_COST for c in chunks)
    assert parsed <= 3 + kept // StreamRecorder.KEEP_BYTES


def test_a_stream_of_tiny_reads_is_not_kept_whole() -> None:
    """Kept chunks are decoded every ``KEEP_BYTES``, counting each chunk's own cost: a stream
    read byte by byte holds a bounded number of them."""
    raw = b"".join(_openai_stream(False))
    recorder = StreamRecorder()
    most = 0
    for i in range(len(raw)):
        recorder.feed(raw[i : i + 1])
        most = max(most, len(recorder.chunks))
    assert most <= StreamRecorder.KEEP_BYTES // StreamRecorder.CHUNK_COST
    assert recorder.finish().message["content"] == "Hi" + "".join(f" w{i}" for i in range(64))


def test_chunks_appended_to_the_recorders_list_survive_a_decoding() -> None:
    """The relay appends to ``recorder.chunks`` through a bound ``append``: decoding (every
    ``KEEP_BYTES``, or a ``result`` mid-stream) must keep that list, not replace it."""
    raw = _openai_stream(False)
    recorder = StreamRecorder()
    keep = recorder.chunks.append
    for i, piece in enumerate(raw):
        keep(piece)
        if i == 10:
            assert recorder.result().message["content"] == "Hi" + "".join(
                f" w{i}" for i in range(10)
            )
    assert recorder.finish().message["content"] == "Hi" + "".join(f" w{i}" for i in range(64))


def test_assemble_completion_takes_choice_zero_wherever_it_is() -> None:
    def body(*choices: dict[str, Any]) -> dict[str, Any]:
        return {"choices": list(choices)}

    other = {
        "index": 1,
        "message": {"role": "assistant", "content": "other"},
        "finish_reason": "length",
    }
    mine = {
        "index": 0,
        "message": {"role": "assistant", "content": "mine"},
        "finish_reason": "stop",
    }
    for choices in ((other, mine), (mine, other), ({**mine, "index": None},)):
        result = assemble_completion(body(*choices))
        assert result.message["content"] == "mine" and result.finish_reason == "stop"
    assert assemble_completion(body(other)).message["content"] is None


def test_an_audio_answer_keeps_its_id_and_transcript_not_its_data() -> None:
    """``modalities: ["text", "audio"]``: the answer is an audio message, which the log showed
    as ``{"content": null}``, an empty answer (the client sends its id back next turn)."""
    stream = [
        chunk({"role": "assistant", "audio": {"id": "audio_1", "expires_at": 1700000000}}),
        chunk({"audio": {"transcript": "Hello ", "data": "UklGRiQA"}}),
        chunk({"audio": {"transcript": "world", "data": "AAAAAAAA"}}),
        chunk({}, "stop"),
        DONE,
    ]
    expected = {
        "role": "assistant",
        "content": None,
        "audio": {"id": "audio_1", "expires_at": 1700000000, "transcript": "Hello world"},
    }
    assert record(stream).message == expected
    whole = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "audio": {
                        "id": "audio_1",
                        "expires_at": 1700000000,
                        "data": "UklGRiQAAAAAAAAA",
                        "transcript": "Hello world",
                    },
                },
                "finish_reason": "stop",
            }
        ]
    }
    assert assemble_completion(whole).message == expected


def test_an_event_with_no_data_ends_the_message_where_the_sdks_raise() -> None:
    """``event: ping`` with no data (both SDKs dispatch it with empty data and fail to parse
    it), and an empty ``data:`` line: the log's message ran on past them, to a finish the
    client never saw."""
    first = chunk({"role": "assistant", "content": "Hel"})
    rest = [chunk({"content": "lo world"}), chunk({}, finish="stop"), DONE]
    for odd in (b"event: ping\n\n", b"data:\n\n", b"data: \n\n", b"id: 2\ndata:\n\n"):
        stream = [first, odd, *rest]
        for pieces in (stream, [b"".join(stream)]):
            result = record(pieces)
            assert result.message["content"] == "Hel", odd
            assert (result.finish_reason, result.malformed) == (None, 1), odd
    # (with an id: or a retry: in its block, an empty data line too)
    stream = [first, b"retry: 3000\ndata:\n\n", *rest]
    assert record(stream).message["content"] == "Hel"


def test_a_blank_line_more_after_an_id_counts_wherever_the_reads_fall() -> None:
    """Once a stream gave an ``id:``, a blank line more is an event the Python SDK fails on: it
    was dropped where it ended a batch the fast path decoded (a read ending in it)."""
    first = b"id: 1\n" + chunk({"role": "assistant", "content": "A"})
    second = chunk({"content": "B"}) + b"\n"
    third = chunk({"content": "C"}) + DONE
    for pieces in ([first, second, third], [first + second + third]):
        recorder = StreamRecorder()
        for piece in pieces:
            recorder.feed(piece)
            recorder.decode()  # (each read decoded as it comes, as a long stream's are)
        result = recorder.finish()
        assert result.message["content"] == "ABC" and result.malformed == 1


def test_an_event_torn_by_the_streams_end_is_no_part_of_the_message() -> None:
    """The SDKs dispatch an event at its blank line: one the stream's end cut before it (a
    close-delimited answer ending ``…}\\n``) never reaches the client; its text was logged,
    and its finish reason. Its usage, which the provider bills, is still taken."""
    last = chunk({"content": " world"}, finish="stop", usage={"prompt_tokens": 9})[:-1]
    result = record([chunk({"role": "assistant", "content": "Hello"}), last])
    assert result.message["content"] == "Hello"
    assert result.finish_reason is None and result.unfinished is True
    assert result.usage is not None and result.usage.prompt == 9


def test_an_error_chunk_mid_stream_ends_the_message() -> None:
    """The SDKs raise on a chunk that carries an ``error`` (an overloaded provider mid-stream):
    the log's message ran on past it to a finish the client never saw."""
    error = b'data: {"error": {"message": "overloaded", "type": "server_error"}}\n\n'
    stream = [
        chunk({"role": "assistant", "content": "Hel"}),
        error,
        chunk({"content": "lo"}),
        chunk({}, finish="stop"),
        DONE,
    ]
    for pieces in (stream, [b"".join(stream)]):
        result = record(pieces)
        assert result.message["content"] == "Hel" and result.finish_reason is None
        assert result.error is not None


@pytest.mark.parametrize("odd", [b',"error":{}', b',"error":""', b',"error":false'])
def test_a_chunk_whose_error_is_nothing_is_read_on_as_the_sdks_do(odd: bytes) -> None:
    """The SDKs raise only on an ``error`` that is something: one empty or false is a chunk
    like any other; it cut the log's message, and was noted as an error. An ``event: error``
    with no ``error`` in it is noted (the provider sent an error event), but the SDKs read on
    past it: the message goes on too."""
    middle = chunk({"content": " x"})
    middle = middle[: middle.rindex(b"}")] + odd + b"}\n\n"
    stream = [chunk({"role": "assistant", "content": "Hello"}), middle]
    stream += [chunk({"content": " after"}, finish="stop"), DONE]
    result = record(stream)
    assert result.message["content"] == "Hello x after" and result.finish_reason == "stop"
    assert result.error is None
    named = [stream[0], b'event: error\ndata: {"message": "hmm"}\n\n', *stream[2:]]
    result = record(named)
    assert result.message["content"] == "Hello after" and result.finish_reason == "stop"
    assert result.error == {"error": {"message": "hmm"}}
    # (one that is a chunk: the Python SDK gives it to the client as one, its delta too)
    named = [stream[0], b"event: error\n" + chunk({"content": " two"}), *stream[2:]]
    result = record(named)
    assert result.message["content"] == "Hello two after" and result.finish_reason == "stop"
    assert result.error is not None


def test_usage_carried_by_an_error_chunk_is_counted() -> None:
    """The provider bills what an errored stream used: usage in the error chunk itself was
    dropped (the SDK raises there; the accounting should not)."""
    error = (
        b'data: {"error": {"message": "late", "type": "server_error"},'
        b' "usage": {"prompt_tokens": 10, "completion_tokens": 5}}\n\n'
    )
    result = record([chunk({"role": "assistant", "content": "Hi"}), error, DONE])
    assert result.usage is not None and (result.usage.prompt, result.usage.completion) == (10, 5)
    assert result.error is not None and result.message["content"] == "Hi"


def test_a_stream_that_opens_with_blank_lines_is_still_read_as_a_stream() -> None:
    """A recorder sets a body that opens a JSON object aside whole (a gateway's whole
    completion under the stream's type); blank lines before a stream's first event (a server's
    keep-alive while the model thinks) keep it a stream, whatever reads they come in."""
    stream = [b"\n", b"\r\n\n", chunk({"role": "assistant", "content": "Hi"}), DONE]
    recorder = StreamRecorder()
    for piece in stream:
        recorder.feed(piece)
        recorder.decode()  # (each read decoded on its own, as a long stream's are)
    result = recorder.finish()
    assert not recorder.json_body and recorder.whole is None
    assert result.message["content"] == "Hi" and result.done
    # and a whole body after white space, in pieces, is kept whole, not decoded as events
    body = b'{"id": "c1", "choices": []}'
    recorder = StreamRecorder()
    for piece in (b" \n", body[:5], body[5:]):
        recorder.feed(piece)
        recorder.decode()
    recorder.finish()
    assert recorder.json_body and recorder.whole is not None
    assert b"".join(recorder.whole) == b" \n" + body
