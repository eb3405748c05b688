"""The offline provider simulator, over real loopback sockets."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from proxy.simulator import RunningSimulator, SimConfig, Simulator, run_simulator
from proxy.simulator.cache import POLICIES, PrefixCache
from proxy.simulator.cli import add_arguments, config_from_args
from proxy.simulator.config import FAULTS
from proxy.simulator.tokens import count_tokens, request_tokens

DANGLING = (
    "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
    "'tool_call_id'. The following tool_call_ids did not have response messages: call_b"
)
ORPHAN = (
    "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with "
    "'tool_calls'."
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}


# -- helpers ------------------------------------------------------------------------------------


def parse_sse(raw: bytes) -> list[tuple[str, str]]:
    """A tiny SSE reader: ("comment" | "data", text) per event; the body must end on a boundary."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    events = []
    for block in raw[:-2].split(b"\n\n"):
        line = block.decode()
        assert "\n" not in line, line
        if line.startswith(":"):
            events.append(("comment", line[1:].strip()))
        else:
            assert line.startswith("data: "), line
            events.append(("data", line[len("data: ") :]))
    return events


def data_chunks(raw: bytes) -> list[dict[str, Any]]:
    """The JSON chunks of a complete stream, which must end with [DONE]."""
    payloads = [text for kind, text in parse_sse(raw) if kind == "data"]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def assemble(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Content, tool calls (merged by index), finish reason and usage of a stream."""
    content = ""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    usage = None
    for chunk in chunks:
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                slot["id"] += call.get("id", "")
                slot["name"] += call.get("function", {}).get("name", "")
                slot["arguments"] += call.get("function", {}).get("arguments", "")
            finish = choice["finish_reason"] or finish
    return {
        "content": content,
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
        "usage": usage,
    }


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o", "messages": messages, **extra}


def words(n: int, word: str = "abcd") -> str:
    """n tokens of text (a 4-letter word is one token)."""
    return f"{word} " * n


def long_chat(n_user_tokens: int) -> list[dict[str, Any]]:
    """A system message (4 tokens) and a user message of n + 3 tokens."""
    return [{"role": "system", "content": "hi"}, {"role": "user", "content": words(n_user_tokens)}]


def post(
    running: RunningSimulator, body: Any, headers: dict[str, str] | None = None, **kw: Any
) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        running.url + "/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json", **(headers or {})},
        timeout=kw.pop("timeout", 10),
        **kw,
    )


def usage_of(
    running: RunningSimulator, messages: list[dict[str, Any]], **headers: str
) -> dict[str, Any]:
    response = post(running, chat_body(messages), headers)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def cached(usage: dict[str, Any]) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def stream(
    running: RunningSimulator, body: dict[str, Any], headers: dict[str, str] | None = None
) -> bytes:
    response = post(running, {**body, "stream": True}, headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return response.content


def script(running: RunningSimulator, *replies: Any) -> None:
    response = httpx.post(running.url + "/_sim/script", json=list(replies))
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def openai_server() -> Iterator[RunningSimulator]:
    with run_simulator(SimConfig()) as running:
        yield running


@pytest.fixture(scope="module")
def deepseek_server() -> Iterator[RunningSimulator]:
    with run_simulator(SimConfig(dialect="deepseek")) as running:
        yield running


@pytest.fixture(scope="module")
def anthropic_server() -> Iterator[RunningSimulator]:
    with run_simulator(SimConfig(dialect="anthropic-compat")) as running:
        yield running


@pytest.fixture
def sim(openai_server: RunningSimulator) -> RunningSimulator:
    openai_server.sim.reset()
    return openai_server


@pytest.fixture
def deepseek(deepseek_server: RunningSimulator) -> RunningSimulator:
    deepseek_server.sim.reset()
    return deepseek_server


@pytest.fixture
def anthropic(anthropic_server: RunningSimulator) -> RunningSimulator:
    anthropic_server.sim.reset()
    return anthropic_server


# -- validation ---------------------------------------------------------------------------------


def test_dangling_tool_call_is_refused_with_the_providers_text(sim: RunningSimulator) -> None:
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "call_b", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "done"},
        {"role": "user", "content": "and?"},
    ]
    response = post(sim, chat_body(messages))
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": DANGLING,
            "type": "invalid_request_error",
            "param": "messages",
            "code": None,
        }
    }


def test_orphan_tool_result_is_refused_with_the_providers_spelling(sim: RunningSimulator) -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "tool", "tool_call_id": "call_x", "content": "?"},
    ]
    response = post(sim, chat_body(messages))
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": ORPHAN,
            "type": "invalid_request_error",
            "param": "messages.[1].role",
            "code": None,
        }
    }


def test_prompt_over_the_context_window_is_refused(sim: RunningSimulator) -> None:
    response = post(sim, chat_body([{"role": "user", "content": words(127_998)}]))
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "This model's maximum context length is 128000 tokens. However, your messages resulted in "
        "128001 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    assert post(sim, chat_body([{"role": "user", "content": words(127_997)}])).status_code == 200


def test_fields_of_the_wrong_type_are_refused_with_openais_texts(sim: RunningSimulator) -> None:
    """Refused by OpenAI, accepted by the simulator: a test against it would pass on a request
    the provider refuses (a stream asked for with the string "false", stream_options on a
    request that does not stream, a model that is a number, stream options that are no object
    or whose flags are no booleans); and texts or codes that differed from OpenAI's."""
    user = [{"role": "user", "content": "x"}]
    cases: list[tuple[dict[str, Any], str, str | None, str | None]] = [
        (
            {"model": "gpt-4o", "messages": user, "stream": "false"},
            "Invalid type for 'stream': expected a boolean, but got a string instead.",
            "stream",
            "invalid_type",
        ),
        (
            {"model": 5, "messages": user},
            "Invalid type for 'model': expected a string, but got an integer instead.",
            "model",
            "invalid_type",
        ),
        (
            {"model": "gpt-4o", "messages": user, "stream_options": {"include_usage": True}},
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options",
            None,
        ),
        (
            {"model": "gpt-4o", "messages": []},
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an"
            " empty array instead.",
            "messages",
            "empty_array",
        ),
        (
            {"model": "gpt-4o", "messages": [{"content": "x"}]},
            "Missing required parameter: 'messages[0].role'.",
            "messages[0].role",
            "missing_required_parameter",
        ),
        (
            {"model": "gpt-4o", "messages": ["hi"]},
            "Invalid type for 'messages[0]': expected an object, but got a string instead.",
            "messages[0]",
            "invalid_type",
        ),
        (
            {"model": "gpt-4o", "messages": user, "stream": True, "stream_options": "usage"},
            "Invalid type for 'stream_options': expected an object, but got a string instead.",
            "stream_options",
            "invalid_type",
        ),
        (
            {
                "model": "gpt-4o",
                "messages": user,
                "stream": True,
                "stream_options": {"include_usage": "true"},
            },
            "Invalid type for 'stream_options.include_usage': expected a boolean, but got a"
            " string instead.",
            "stream_options.include_usage",
            "invalid_type",
        ),
        (
            {
                "model": "gpt-4o",
                "messages": user,
                "stream": True,
                "stream_options": {"include_obfuscation": 0},
            },
            "Invalid type for 'stream_options.include_obfuscation': expected a boolean, but got"
            " an integer instead.",
            "stream_options.include_obfuscation",
            "invalid_type",
        ),
    ]
    for body, message, param, code in cases:
        refused = post(sim, body)
        assert refused.status_code == 400, body
        error = refused.json()["error"]
        assert (error["message"], error["param"], error["code"]) == (message, param, code)
    fine = {"model": "gpt-4o", "messages": user, "stream": None, "stream_options": None}
    assert post(sim, fine).status_code == 200


def test_tools_the_example_arguments_cannot_read_get_an_answer_not_a_500(
    sim: RunningSimulator,
) -> None:
    """A tool call made up for "use tool" read the first tool's schema as well-formed: a
    function that is a string, properties that are no object, required names that are no
    strings or an enum that is no list answered a plain-text 500."""
    ask = [{"role": "user", "content": "use tool"}]
    for tool in (
        {"type": "function", "function": "x"},
        {"type": "function", "function": {"name": "f", "parameters": {"properties": "abc"}}},
        {"type": "function", "function": {"name": "f", "parameters": {"properties": [1, 2]}}},
        {"type": "function", "function": {"name": "f", "parameters": {"required": [1]}}},
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"a": {"enum": {"k": 1}}}},
            },
        },
    ):
        answer = post(sim, {"model": "gpt-4o", "messages": ask, "tools": [tool]})
        assert answer.status_code == 200, (tool, answer.text)
        (call,) = answer.json()["choices"][0]["message"]["tool_calls"]
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_invalid_json_and_missing_model_are_400(sim: RunningSimulator) -> None:
    bad = post(sim, b'{"model": "gpt-4o", "messages": [')
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert bad.json()["error"]["message"].startswith(
        "We could not parse the JSON body of your request."
    )
    missing = post(sim, {"messages": [{"role": "user", "content": "x"}]})
    assert missing.status_code == 400
    assert missing.json()["error"]["message"] == "you must provide a model parameter"
    no_messages = post(sim, {"model": "gpt-4o"})
    assert no_messages.status_code == 400
    assert no_messages.json()["error"]["message"] == "Missing required parameter: 'messages'."
    not_a_list = post(sim, {"model": "gpt-4o", "messages": "hi"})
    assert not_a_list.json()["error"]["code"] == "invalid_type"
    # a role that is no string: refused as OpenAI does (it was a plain-text 500)
    odd_role = post(sim, {"model": "gpt-4o", "messages": [{"role": ["tool"], "content": "x"}]})
    assert odd_role.status_code == 400
    assert odd_role.json()["error"]["code"] == "invalid_value"
    # tools or tool_calls of another type, a call id that is no string: a TypeError, a 500
    call = {"id": 7, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for body, param in (
        ({"messages": [{"role": "user", "content": "x"}], "tools": 5}, "tools"),
        (
            {"messages": [{"role": "assistant", "content": "x", "tool_calls": 4}]},
            "messages[0].tool_calls",
        ),
        # (refused as a call's field, OpenAI's "Invalid type for ...id": it was refused as an
        # unanswered call)
        (
            {"messages": [{"role": "assistant", "tool_calls": [call]}]},
            "messages[0].tool_calls[0].id",
        ),
    ):
        refused = post(sim, {"model": "gpt-4o", **body})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param
    for call, param, code in (
        ({"type": "function", "function": {"name": "f"}}, "id", "missing_required_parameter"),
        ({"id": "c", "function": {"name": "f"}}, "type", "missing_required_parameter"),
        ({"id": "c", "type": ["function"], "function": {"name": "f"}}, "type", "invalid_type"),
        ("c", "", "invalid_type"),
    ):
        body = {"model": "gpt-4o", "messages": [{"role": "assistant", "tool_calls": [call]}]}
        refused = post(sim, body).json()["error"]
        where = "messages[0].tool_calls[0]" + (f".{param}" if param else "")
        assert (refused["param"], refused["code"]) == (where, code)
        assert where in refused["message"]


def test_unknown_paths_and_methods_answer_in_the_openai_error_shape(sim: RunningSimulator) -> None:
    unknown = httpx.post(sim.api_base + "/audio/speech", json={})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "Invalid URL (POST /v1/audio/speech)"
    wrong = httpx.get(sim.api_base + "/chat/completions")
    assert wrong.status_code == 405
    assert wrong.json()["error"]["message"] == "Invalid method for URL (GET /v1/chat/completions)"
    assert set(wrong.json()["error"]) == {"message", "type", "param", "code"}


# -- tokens and the prefix cache ----------------------------------------------------------------


def test_tokenizer_counts_by_the_documented_rules() -> None:
    assert count_tokens("hello, world") == 5
    assert count_tokens(words(10)) == 10
    assert count_tokens("日本") == 2  # 6 UTF-8 bytes: 4 + 2
    body = chat_body(
        [{"role": "system", "content": "hi"}, {"role": "user", "content": "abcd efgh"}]
    )
    assert len(request_tokens(body)) == (3 + 1) + (3 + 2)


def test_an_image_costs_what_openai_bills_for_its_size_not_its_base64() -> None:
    """A 30 KB screenshot counted as ~10,000 tokens of base64 text; OpenAI bills a 1280 x 800
    image 1,105. The same image is the same tokens (a cache hit), another image other ones."""
    import base64

    from tests.test_media import png

    def shot(seed_rows: int) -> dict[str, Any]:
        data = base64.b64encode(png(1280, 800, noisy_rows=seed_rows)).decode()
        return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}

    def body(*parts: Any) -> dict[str, Any]:
        return chat_body([{"role": "user", "content": [{"type": "text", "text": "abcd"}, *parts]}])

    assert len(request_tokens(body(shot(8)))) == 3 + 1 + 1105
    assert (
        len(request_tokens(body({"type": "image_url", "image_url": {"url": "https://x/a.png"}})))
        == 3 + 1 + 765
    )
    same, other = request_tokens(body(shot(8))), request_tokens(body(shot(9)))
    assert request_tokens(body(shot(8))) == same and same[:3] == other[:3] and same[3] != other[3]


def test_an_images_tokens_stay_when_a_cache_mark_moves_off_it() -> None:
    """Claude-style clients move their breakpoint on to the latest message each turn: an image
    that lost its ``cache_control`` became other tokens, a miss of it and all after it
    (~1,500 tokens of "unexplained" waste through cachegate). A part whose ``type`` is a
    list is text, not a 500."""
    import base64

    from tests.test_media import png

    url = "data:image/png;base64," + base64.b64encode(png(768, 2000, noisy_rows=4)).decode()
    marked = {
        "type": "image_url",
        "image_url": {"url": url},
        "cache_control": {"type": "ephemeral"},
    }
    plain = {"type": "image_url", "image_url": {"url": url}}

    def tokens(part: Any) -> list[bytes]:
        return request_tokens(chat_body([{"role": "user", "content": [part]}]))

    assert tokens(marked) == tokens(plain)
    assert len(tokens({"type": ["image_url"], "image_url": {"url": url}})) > 3


def test_the_tokenizer_counts_a_body_as_deep_as_cachegate_forwards() -> None:
    """Arguments nested past orjson's 254 levels (cachegate forwards up to 1,024): the
    simulator answered 500 (orjson's "Recursion limit reached") to a body cachegate had
    repaired."""
    deep: Any = {}
    for _ in range(990):
        deep = {"a": deep}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    shallow = {**message, "tool_calls": [{**call, "function": {"name": "f", "arguments": {}}}]}
    extra = len(request_tokens(chat_body([message]))) - len(request_tokens(chat_body([shallow])))
    assert extra == count_tokens('{"a":' * 990 + "{}" + "}" * 990) - count_tokens("{}")


def test_second_request_extending_the_first_reads_whole_blocks(sim: RunningSimulator) -> None:
    first = long_chat(1100)
    usage = usage_of(sim, first)
    assert usage["prompt_tokens"] == 1107
    assert cached(usage) == 0
    second = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    usage = usage_of(sim, second)
    assert usage["prompt_tokens"] == 1115
    assert cached(usage) == 1024
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_cached_tokens_round_down_to_128_token_blocks(sim: RunningSimulator) -> None:
    first = long_chat(1400)  # 1407 tokens
    usage_of(sim, first)
    assert cached(usage_of(sim, [*first, {"role": "user", "content": "again"}])) == 1280


def test_prefix_below_1024_tokens_is_never_cached(sim: RunningSimulator) -> None:
    first = long_chat(1000)  # 1007 tokens
    usage_of(sim, first)
    assert cached(usage_of(sim, [*first, {"role": "user", "content": words(200)}])) == 0


def test_a_rewritten_prefix_or_another_model_misses(sim: RunningSimulator) -> None:
    first = long_chat(1400)
    usage_of(sim, first)
    rewritten = [{"role": "system", "content": "hi at 12:00"}, *first[1:]]
    assert cached(usage_of(sim, rewritten)) == 0
    other_model = post(sim, {**chat_body(first), "model": "gpt-4o-mini"})
    assert cached(other_model.json()["usage"]) == 0
    assert cached(usage_of(sim, first)) == 1280


def test_deepseek_caches_64_token_blocks_and_reports_hit_and_miss(
    deepseek: RunningSimulator,
) -> None:
    first = long_chat(1000)  # 1007 tokens
    usage = usage_of(deepseek, first)
    assert usage == {
        "prompt_tokens": 1007,
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": 1007 + usage["completion_tokens"],
        "prompt_cache_hit_tokens": 0,
        "prompt_cache_miss_tokens": 1007,
    }
    usage = usage_of(deepseek, [*first, {"role": "user", "content": "again"}])
    assert usage["prompt_tokens"] == 1012
    assert (usage["prompt_cache_hit_tokens"], usage["prompt_cache_miss_tokens"]) == (
        960,
        1012 - 960,
    )
    small = [{"role": "user", "content": words(100)}]  # 103 tokens
    usage_of(deepseek, small)
    assert (
        usage_of(deepseek, [*small, {"role": "user", "content": "x"}])["prompt_cache_hit_tokens"]
        == 64
    )


def _marked(message: dict[str, Any]) -> dict[str, Any]:
    return {**message, "cache_control": {"type": "ephemeral"}}


def test_anthropic_compat_reports_cache_read_and_creation(anthropic: RunningSimulator) -> None:
    first = long_chat(1100)  # 1107 tokens
    usage = usage_of(anthropic, [first[0], _marked(first[1])])
    assert (usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]) == (0, 1024)
    assert usage["prompt_tokens"] == 1107
    second = [
        *first,
        {"role": "assistant", "content": "ok"},
        _marked({"role": "user", "content": words(200)}),
    ]
    usage = usage_of(anthropic, second)  # 1107 + 4 + 203 = 1314 tokens
    assert usage["prompt_tokens"] == 1314
    assert (usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]) == (1024, 256)


def test_anthropic_compat_caches_only_up_to_the_last_breakpoint(
    anthropic: RunningSimulator,
) -> None:
    """Claude caches nothing of a request that marks nothing, and of a marked one nothing past
    its last mark (a gateway's clients that mark nothing miss every turn: ``not_requested``)."""
    big = long_chat(1100)
    longer = [*big, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    for _ in range(2):
        usage = usage_of(anthropic, longer)
        assert (usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]) == (0, 0)
    # the mark on the long message: its 1,024-token blocks, not the turn after it
    marked = [big[0], _marked(big[1]), *longer[2:]]
    usage = usage_of(anthropic, marked)
    assert (usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]) == (0, 1024)
    # a request-level mark (automatic caching): up to its end
    anthropic.sim.reset()
    body = {**chat_body(longer), "cache_control": {"type": "ephemeral"}}
    first = post(anthropic, body).json()["usage"]
    again = post(anthropic, body).json()["usage"]
    assert first["cache_creation_input_tokens"] == 1024
    assert again["cache_read_input_tokens"] == 1024


def test_anthropic_compat_reads_only_prefixes_that_ended_at_a_breakpoint(
    anthropic: RunningSimulator,
) -> None:
    """Claude writes an entry where a breakpoint ends and reads only such entries: a long
    message marked after another grows a prefix whose first blocks a later request shares,
    but no entry ends there. The simulator read those blocks (1,024 of a changed request's
    tools), which Claude would not: its waste came out smaller than a provider's."""
    chat = long_chat(2300)  # (its second message: ~2,300 tokens, 17 blocks and more)
    first = [chat[0], _marked(chat[1])]
    assert usage_of(anthropic, first)["cache_creation_input_tokens"] > 2000
    # the same long message cut short: its first blocks are cached, but no entry ends there
    cut = {**chat[1], "content": chat[1]["content"][: len(chat[1]["content"]) // 2]}
    usage = usage_of(anthropic, [chat[0], _marked(cut)])
    assert usage["cache_read_input_tokens"] == 0
    # the whole prefix an entry ends with is read, and one ending at its own breakpoint after it
    usage = usage_of(anthropic, [*first, {"role": "assistant", "content": "ok"}])
    assert usage["cache_read_input_tokens"] > 2000


def _tool_rounds(rounds: int) -> list[dict[str, Any]]:
    """``rounds`` tool calls, each with its result: two content blocks a round, to Claude."""
    out: list[dict[str, Any]] = []
    for i in range(rounds):
        function = {"name": "read", "arguments": json.dumps({"path": f"src/file_{i}.py"})}
        call = {"id": f"toolu_{i:02d}", "type": "function", "function": function}
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        out.append({"role": "tool", "tool_call_id": call["id"], "content": words(40)})
    return out


@pytest.mark.parametrize(("rounds", "reads"), [(24, False), (11, False), (10, True)])
def test_anthropic_compat_reads_an_entry_only_within_the_look_back_of_a_breakpoint(
    anthropic: RunningSimulator, rounds: int, reads: bool
) -> None:
    """Claude checks for an entry at a breakpoint and ~20 content blocks before it, no further
    (Anthropic's docs; cachegate's ``CLAUDE_LOOKBACK_BLOCKS``): an agent that marks only its
    latest message, after 24 tool calls and their results (48 blocks), reads nothing of the
    entry the turn before wrote; the simulator read it all, as if Claude looked back without
    end. Ten rounds (20 blocks) are within reach, eleven (22) are not."""
    task = {"role": "user", "content": words(1500)}
    first = usage_of(anthropic, [_marked(task)])
    assert (first["cache_read_input_tokens"], first["cache_creation_input_tokens"]) == (0, 1408)
    history = [task, *_tool_rounds(rounds)]
    usage = usage_of(anthropic, [*history[:-1], _marked(history[-1])])
    assert usage["cache_read_input_tokens"] == (1408 if reads else 0)
    written = usage["prompt_tokens"] // 128 * 128 - usage["cache_read_input_tokens"]
    assert usage["cache_creation_input_tokens"] == written  # (the rest, to its breakpoint)


def test_a_gateways_mark_at_the_end_is_read_past_twenty_blocks() -> None:
    """``--cache-unmarked`` (a gateway marks the end of a client's request): the look-back
    applied from that end made a turn that added 24 tool rounds read nothing, a miss cachegate
    can only call unexplained; the look-back is the request's own breakpoints'."""
    with run_simulator(SimConfig(dialect="anthropic-compat", cache_unmarked=True)) as sim:
        task = {"role": "user", "content": words(1500)}
        usage_of(sim, [task])
        usage = usage_of(sim, [task, *_tool_rounds(24)])
        assert usage["cache_read_input_tokens"] >= 1408


def test_openai_keeps_a_responses_prompt_for_a_day_with_extended_retention(
    sim: RunningSimulator,
) -> None:
    """The Responses API under ``"prompt_cache_retention": "24h"`` kept its prefix the
    simulator's few minutes, as chat's did (a Codex agent back after an hour read nothing)."""
    body = {"model": "gpt-5", "input": words(1100)}
    for retention, read in (("24h", 1024), (None, 0)):
        sim.sim.reset()
        asked = {**body, "prompt_cache_retention": retention} if retention else body
        httpx.post(sim.url + "/v1/responses", json=asked, timeout=10)
        sim.sim.advance(3_600)
        again = httpx.post(sim.url + "/v1/responses", json=asked, timeout=10).json()
        assert again["usage"]["input_tokens_details"]["cached_tokens"] == read, retention


def test_anthropic_compat_keeps_a_one_hour_breakpoints_prefix_for_an_hour(
    anthropic: RunningSimulator,
) -> None:
    """A ``"ttl": "1h"`` mark was kept for the simulator's 300 s like any other: a client that
    asked for an hour saw a miss after a 400 s pause through the simulator, and its writes were
    reported (and priced) as five-minute ones. Claude splits its writes by TTL."""
    chat = long_chat(1100)
    hour = {**chat[1], "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    first = usage_of(anthropic, [chat[0], hour])
    assert (first["cache_read_input_tokens"], first["cache_creation_input_tokens"]) == (0, 1024)
    assert first["cache_creation"] == {
        "ephemeral_5m_input_tokens": 0,
        "ephemeral_1h_input_tokens": 1024,
    }
    anthropic.sim.advance(400)
    assert usage_of(anthropic, [chat[0], hour])["cache_read_input_tokens"] == 1024
    anthropic.sim.advance(3_601)
    assert usage_of(anthropic, [chat[0], hour])["cache_read_input_tokens"] == 0
    # a five-minute mark is gone after 400 s, and its usage's split says so (both kinds, a zero
    # too, as Claude's usage always has them)
    anthropic.sim.reset()
    five = usage_of(anthropic, [chat[0], _marked(chat[1])])
    assert five["cache_creation"] == {
        "ephemeral_5m_input_tokens": five["cache_creation_input_tokens"],
        "ephemeral_1h_input_tokens": 0,
    }
    anthropic.sim.advance(400)
    assert usage_of(anthropic, [chat[0], _marked(chat[1])])["cache_read_input_tokens"] == 0


def test_anthropic_compat_caches_nothing_under_the_models_own_minimum(
    anthropic: RunningSimulator,
) -> None:
    """Claude Haiku 4.5 and Opus 4.5 cache nothing shorter than 4,096 tokens (Anthropic's
    prompt caching docs), Haiku 3.5 nothing under 2,048: the simulator cached 1,024 for every
    model, and a ~1.7k prefix read through it that Claude would have missed."""
    chat = long_chat(1700)
    first = [chat[0], _marked(chat[1])]
    for model, read in (
        ("claude-sonnet-4-5", 1664),
        ("claude-haiku-4-5", 0),
        ("claude-opus-4-5-20251101", 0),
        ("claude-3-5-haiku-20241022", 0),
    ):
        body = chat_body(first, model=model)
        post(anthropic, body)
        usage = post(anthropic, body).json()["usage"]
        assert usage["cache_read_input_tokens"] == read, model
    longer = [chat[0], _marked({**chat[1], "content": chat[1]["content"] + " " + words(2600)})]
    for _ in range(2):
        usage = post(anthropic, chat_body(longer, model="claude-haiku-4-5")).json()["usage"]
    assert usage["cache_read_input_tokens"] >= 4096


def test_openai_keeps_a_prompt_for_a_day_with_extended_retention(sim: RunningSimulator) -> None:
    """``"prompt_cache_retention": "24h"``: OpenAI keeps the prefix up to a day; the simulator
    kept it for its own TTL, so an agent back after an hour missed what OpenAI would read."""
    chat = long_chat(1100)
    kept = chat_body(chat, prompt_cache_retention="24h")
    for body, read_after_an_hour in ((kept, 1024), (chat_body(chat), 0)):
        sim.sim.reset()
        post(sim, body)
        sim.sim.advance(3_600)
        assert post(sim, body).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (
            read_after_an_hour
        )
    sim.sim.reset()
    post(sim, kept)
    sim.sim.advance(86_401)
    assert post(sim, kept).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_one_hour_breakpoint_after_a_five_minute_one_or_under_the_minimum_is_five_minutes(
    anthropic: RunningSimulator,
) -> None:
    """Claude takes one-hour breakpoints only before five-minute ones, and caches no prefix
    under its minimum: the simulator kept such prefixes an hour and reported them (and so had
    them priced) as one-hour writes."""
    big = long_chat(1100)
    five = {"type": "ephemeral"}
    hour = {"type": "ephemeral", "ttl": "1h"}
    after = [
        {**big[0], "cache_control": five},
        {**big[1], "cache_control": hour},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": words(1200), "cache_control": hour},
    ]
    usage = usage_of(anthropic, after)
    assert usage["cache_creation_input_tokens"] > 0
    assert usage["cache_creation"]["ephemeral_1h_input_tokens"] == 0  # (all five minutes')
    anthropic.sim.reset()
    short = [
        {"role": "system", "content": words(150), "cache_control": hour},  # under 1,024 tokens
        {"role": "user", "content": words(2300), "cache_control": five},
    ]
    usage = usage_of(anthropic, short)
    assert usage["cache_creation_input_tokens"] > 0
    assert usage["cache_creation"]["ephemeral_1h_input_tokens"] == 0  # (all five minutes')


def test_a_gateway_that_marks_for_its_clients_leaves_a_clients_own_marks_as_they_are() -> None:
    """``cache_unmarked`` cached every request whole: a client that marks only its system prompt
    read its whole history, where a gateway marks only requests that carry no mark."""
    system = _marked({"role": "system", "content": words(1100)})  # 1,107 tokens
    history = [system, {"role": "user", "content": words(1200)}]
    with run_simulator(SimConfig(dialect="anthropic-compat", cache_unmarked=True)) as gateway:
        usage_of(gateway, history)
        again = usage_of(gateway, history)
        # the system prompt's blocks, up to its mark; not the 1,200 tokens after it
        assert (again["cache_read_input_tokens"], again["cache_creation_input_tokens"]) == (1024, 0)


def test_anthropic_compat_caches_unmarked_requests_when_a_gateway_marks_them() -> None:
    with run_simulator(SimConfig(dialect="anthropic-compat", cache_unmarked=True)) as gateway:
        usage_of(gateway, long_chat(1100))
        assert usage_of(gateway, long_chat(1100))["cache_read_input_tokens"] == 1024


def test_entries_expire_after_the_ttl_on_the_simulated_clock(sim: RunningSimulator) -> None:
    first = long_chat(1100)
    usage_of(sim, first)
    sim.sim.advance(299)
    assert cached(usage_of(sim, first)) == 1024  # a hit refreshes the entry
    advanced = httpx.post(sim.url + "/_sim/clock", json={"advance_s": 299})
    assert advanced.json() == {"now": sim.sim.config.start_time + 598}
    assert cached(usage_of(sim, first)) == 1024
    assert cached(usage_of(sim, first, **{"X-Sim-Time-Advance": "300"})) == 0
    assert cached(usage_of(sim, first)) == 1024  # the miss wrote it again


def test_a_clock_moved_past_any_time_is_refused_and_the_simulator_goes_on(
    sim: RunningSimulator,
) -> None:
    """An infinite advance (a header's ``inf``, or ``1e308`` twice) made the clock no time:
    every chat request after it answered 500 until a reset."""
    for value in ("inf", "1e309", "nan"):
        refused = post(sim, chat_body(long_chat(10)), {"X-Sim-Time-Advance": value})
        assert (
            refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_sim_control"
        )
    past = httpx.post(sim.url + "/_sim/clock", json={"advance_s": 1e308})
    assert past.status_code == 400
    assert past.json()["error"]["message"] == "the clock would move past any time"
    now = httpx.get(sim.url + "/_sim/clock").json()["now"]
    assert now == sim.sim.config.start_time
    assert post(sim, chat_body(long_chat(10))).status_code == 200


def test_prefix_cache_handles_150k_token_prompts_quickly() -> None:
    body = chat_body(
        [
            {"role": "system", "content": "x"},
            {"role": "user", "content": words(75_000)},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": words(75_000, "wxyz")},
        ]
    )
    changed = {
        **body,
        "messages": [*body["messages"][:3], {"role": "user", "content": "zz " + words(75_000)}],
    }
    cache = PrefixCache(POLICIES["openai"], ttl_s=300)
    started = time.perf_counter()
    tokens = request_tokens(body)
    assert len(tokens) == 4 + 75_003 + 4 + 75_003
    assert cache.process(tokens, now=0.0).read == 0
    assert cache.process(tokens, now=1.0).read == len(tokens) // 128 * 128
    # Shared: the first three messages (75011 tokens) and the start of the fourth (2 tokens).
    assert cache.process(request_tokens(changed), now=2.0).read == 75_013 // 128 * 128
    assert time.perf_counter() - started < 5.0


# -- responses and the streaming wire format ----------------------------------------------------


def test_stream_assembles_to_the_scripted_text_with_openai_usage_chunks(
    sim: RunningSimulator,
) -> None:
    text = "The answer is 42, as computed by the  deep thought machine.\n"
    script(sim, {"content": text})
    raw = stream(
        sim, chat_body([{"role": "user", "content": "q"}], stream_options={"include_usage": True})
    )
    chunks = data_chunks(raw)
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    for event in raw.split(b"\n\n")[:-2]:
        payload = json.loads(event[len(b"data: ") :])
        assert (
            event
            == b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        )
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 3
    result = assemble(chunks)
    assert result["content"] == text
    assert result["finish_reason"] == "stop"
    assert result["usage"]["completion_tokens"] == count_tokens(text)


def test_stream_without_include_usage_has_no_usage_field(sim: RunningSimulator) -> None:
    chunks = data_chunks(stream(sim, chat_body([{"role": "user", "content": "hello there"}])))
    assert all("usage" not in c for c in chunks)
    assert assemble(chunks)["content"] == "You said: hello there"


_PARALLEL = {
    "tool_calls": [
        {"name": "read_file", "arguments": {"path": "src/main.py", "limit": 200}},
        {"name": "grep", "arguments": '{"pattern": "def main", "dir": "src"}'},
    ]
}


@pytest.mark.parametrize("interleave", [False, True])
def test_parallel_tool_calls_stream_split_each_in_turn_or_interleaved(interleave: bool) -> None:
    """As OpenAI sends them, each call whole before the next; with ``interleave_tool_calls``,
    round-robin by index, as some compatible servers do. Either assembles to the same calls."""
    with run_simulator(SimConfig(interleave_tool_calls=interleave)) as running:
        script(running, _PARALLEL)
        chunks = data_chunks(stream(running, chat_body([{"role": "user", "content": "look"}])))
    assert chunks[0]["choices"][0]["delta"] == {
        "role": "assistant",
        "content": None,
        "refusal": None,
    }
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert all(len(c["choices"][0]["delta"].get("tool_calls", [])) <= 1 for c in chunks)
    for index, name in ((0, "read_file"), (1, "grep")):
        mine = [d for d in deltas if d["index"] == index]
        assert mine[0]["id"].startswith("call_") and mine[0]["function"] == {
            "name": name,
            "arguments": "",
        }
        assert len(mine) > 2
        assert all("id" not in d and "name" not in d["function"] for d in mine[1:])
    order = [d["index"] for d in deltas]
    last_of_0 = len(order) - 1 - order[::-1].index(0)
    # interleaved: call 1 starts before call 0 ends; in turn: all of call 0, then all of call 1
    assert (order.index(1) < last_of_0) is interleave
    result = assemble(chunks)
    assert [(c["name"], c["arguments"]) for c in result["tool_calls"]] == [
        ("read_file", '{"path":"src/main.py","limit":200}'),
        ("grep", '{"pattern": "def main", "dir": "src"}'),
    ]
    assert result["finish_reason"] == "tool_calls"


def test_the_sdks_stream_helper_reads_parallel_tool_calls(sim: RunningSimulator, sdk: Any) -> None:
    """The openai SDK's ``chat.completions.stream()`` parses a call's arguments when the next
    index begins: on the simulator's interleaved calls it failed (empty arguments), with or
    without cachegate in between."""
    script(sim, _PARALLEL)
    client = sdk(sim.api_base)
    tool = {"type": "function", "function": {"name": "read_file", "parameters": {}}}
    with client.chat.completions.stream(
        model="gpt-4o",
        messages=[{"role": "user", "content": "look"}],
        tools=[tool, {"type": "function", "function": {"name": "grep", "parameters": {}}}],
    ) as events:
        done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
        final = events.get_final_completion()
    assert [(e.name, e.arguments) for e in done] == [
        ("read_file", '{"path":"src/main.py","limit":200}'),
        ("grep", '{"pattern": "def main", "dir": "src"}'),
    ]
    calls = final.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["read_file", "grep"]


def test_deepseek_stream_carries_usage_on_its_finish_chunk(deepseek: RunningSimulator) -> None:
    body = chat_body([{"role": "user", "content": "hi"}], model="deepseek-chat")
    for options, nulls in (({}, False), ({"stream_options": {"include_usage": True}}, True)):
        chunks = data_chunks(stream(deepseek, {**body, **options}))
        assert all(c["choices"] for c in chunks)
        last = chunks[-1]
        assert last["choices"][0]["finish_reason"] == "stop"
        assert last["usage"]["prompt_cache_miss_tokens"] == last["usage"]["prompt_tokens"]
        assert all(("usage" in c) is nulls for c in chunks[:-1])


def test_keepalive_comments_come_before_the_first_token() -> None:
    config = SimConfig(keepalive=True, ttft_ms=120, keepalive_interval_ms=40)
    with run_simulator(config) as running:
        started = time.perf_counter()
        with httpx.stream(
            "POST",
            running.url + "/v1/chat/completions",
            json=chat_body([{"role": "user", "content": "x"}], stream=True),
        ) as response:
            first_data = None
            raw = b""
            for piece in response.iter_bytes():
                if first_data is None and b"data: " in piece:
                    first_data = time.perf_counter() - started
                raw += piece
    events = parse_sse(raw)
    assert events[:3] == [("comment", "keep-alive")] * 3
    assert events[3][0] == "data"
    assert first_data is not None and first_data >= 0.12


def test_chunk_cadence_is_paced_in_real_time() -> None:
    with run_simulator(SimConfig(chunk_ms=25)) as running:
        started = time.perf_counter()
        chunks = data_chunks(
            stream(running, chat_body([{"role": "user", "content": "one two three"}]))
        )
        elapsed = time.perf_counter() - started
    # role, 5 content pieces ("You said: one two three"), finish, [DONE]: 7 pauses of 25 ms.
    assert len(chunks) == 7
    assert elapsed >= 7 * 0.025


def test_unscripted_replies_are_derived_from_the_input(sim: RunningSimulator) -> None:
    plain = post(
        sim, chat_body([{"role": "user", "content": "what is the weather like in Paris today?"}])
    )
    message = plain.json()["choices"][0]["message"]
    assert message["content"] == "You said: what is the weather like in Paris today?"
    assert plain.json()["choices"][0]["finish_reason"] == "stop"
    asked = post(
        sim, chat_body([{"role": "user", "content": "Please use tool now"}], tools=[WEATHER_TOOL])
    )
    choice = asked.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"sim","days":1}'}
    followed = chat_body(
        [
            {"role": "user", "content": "Please use tool now"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 24 C"},
        ],
        tools=[WEATHER_TOOL],
    )
    answer = post(sim, followed).json()["choices"][0]["message"]["content"]
    assert answer == "Tool result received: sunny, 24 C"


def test_a_header_script_in_utf8_is_read_as_utf8(sim: RunningSimulator) -> None:
    """curl sends a header's text as UTF-8; it was read as Latin-1 (``hÃ©llo``)."""
    answer = post(
        sim,
        chat_body(long_chat(10)),
        {"X-Sim-Script": '"héllo wörld"'.encode()},  # type: ignore[dict-item]
    )
    assert answer.json()["choices"][0]["message"]["content"] == "héllo wörld"


def test_a_scripted_reasoning_models_thinking_is_billed_not_said(sim: RunningSimulator) -> None:
    """A reasoning model's answer: its thinking in the completion's tokens, named as such, and
    not in its text (compaction's trigger is tested against it)."""
    plain = post(sim, chat_body(long_chat(10)), {"X-Sim-Script": '"ok"'}).json()
    script_ = json.dumps({"content": "ok", "reasoning_tokens": 7000})
    thought = post(sim, chat_body(long_chat(10)), {"X-Sim-Script": script_}).json()
    assert thought["choices"][0]["message"]["content"] == "ok"
    usage = thought["usage"]
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"] + 7000
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 7000
    bad = post(sim, chat_body(long_chat(10)), {"X-Sim-Script": '{"reasoning_tokens": -1}'})
    assert bad.status_code == 400 and "reasoning_tokens" in bad.text


def test_scripts_are_consumed_in_order_and_a_header_script_wins(sim: RunningSimulator) -> None:
    script(sim, "first", {"text": "second", "finish_reason": "length"})
    ask = chat_body([{"role": "user", "content": "hello"}])
    header = {"X-Sim-Script": json.dumps({"content": "from header"})}
    assert post(sim, ask, header).json()["choices"][0]["message"]["content"] == "from header"
    assert (
        post(sim, {"model": "gpt-4o", "messages": []}).status_code == 400
    )  # invalid: not consumed
    assert post(sim, ask).json()["choices"][0]["message"]["content"] == "first"
    second = post(sim, ask).json()["choices"][0]
    assert (second["message"]["content"], second["finish_reason"]) == ("second", "length")
    assert post(sim, ask).json()["choices"][0]["message"]["content"] == "You said: hello"
    bad = httpx.post(
        sim.url + "/_sim/script", json={"responses": [{"tool_calls": [{"arguments": "{}"}]}]}
    )
    assert bad.status_code == 400


def test_requests_are_recorded_and_reset_clears_everything(sim: RunningSimulator) -> None:
    body = chat_body(long_chat(1100))
    key = "sk-proj-" + "k" * 40 + "WXYZ"
    gateway = {"Helicone-Auth": f"Bearer {key}", "x-portkey-api-key": key}
    post(sim, body, {"X-Trace": "t-1", "Authorization": f"Bearer {key}", "api-key": key, **gateway})
    recorded = httpx.get(sim.url + "/_sim/requests").json()["requests"]
    assert len(recorded) == 1
    assert recorded[0]["body"] == body
    assert recorded[0]["headers"]["x-trace"] == "t-1"
    # keys are not served to any local client (a cachegate in front sends the user's real one)
    assert recorded[0]["headers"]["authorization"] == "Bearer …WXYZ"
    assert recorded[0]["headers"]["api-key"] == "…WXYZ"
    assert recorded[0]["headers"]["helicone-auth"] == "Bearer …WXYZ"  # (a gateway's key too)
    assert recorded[0]["headers"]["x-portkey-api-key"] == "…WXYZ"
    assert key not in httpx.get(sim.url + "/_sim/requests").text
    # nor to a page whose name was re-pointed at this machine (DNS rebinding: it could read)
    rebound = httpx.get(sim.url + "/_sim/requests", headers={"Host": "evil.example:8788"})
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "forbidden_host"
    said = rebound.json()["error"]["message"]  # (its own words: it has no server.allowed_hosts)
    assert "refused by the simulator" in said and "allowed_hosts" not in said
    # (on its API, an Origin is a cachegate's in front passing on a page it lets through)
    assert httpx.get(sim.url + "/v1/models", headers={"Origin": "https://a.example"}).is_success
    # but its own routes are no page's: a cross-site POST (no preflight) queued a tool call an
    # agent then ran, reset it, or moved its clock
    page = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
    for route, payload in (("/_sim/script", '"x"'), ("/_sim/reset", ""), ("/_sim/clock", "{}")):
        refused = httpx.post(sim.url + route, content=payload, headers=page)
        assert refused.status_code == 403, route
        assert refused.json()["error"]["code"] == "forbidden_origin"
        assert "allowed_origins" not in refused.text  # (cachegate's setting: none here)
    assert sim.sim.requests  # (not reset)
    local = {"Origin": sim.url}  # (a page of this machine's: a local dashboard)
    assert httpx.get(sim.url + "/_sim/requests", headers=local).is_success
    assert (recorded[0]["path"], recorded[0]["status"]) == ("/v1/chat/completions", 200)
    assert sim.sim.requests[0].usage == recorded[0]["usage"]
    sim.sim.advance(10)
    assert httpx.post(sim.url + "/_sim/reset").status_code == 200
    assert httpx.get(sim.url + "/_sim/requests").json() == {"requests": []}
    assert httpx.get(sim.url + "/_sim/clock").json() == {"now": sim.sim.config.start_time}
    assert len(sim.sim.cache) == 0
    assert cached(usage_of(sim, body["messages"])) == 0
    # nor a cookie's values, any of them (only the last word was hidden: a session's was shown)
    post(sim, body, {"Cookie": "session=SECRETSESSIONTOKEN123456; theme=dark; nameless-SECRET"})
    shown = httpx.get(sim.url + "/_sim/requests").json()["requests"][-1]["headers"]["cookie"]
    assert shown == "session=…; theme=…; …"


def test_models_and_deterministic_embeddings(sim: RunningSimulator, sdk: Any) -> None:
    models = httpx.get(sim.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["gpt-4o", "gpt-4o-mini", "text-embedding-3-small"]
    request = {"model": "text-embedding-3-small", "input": ["alpha", "beta"], "dimensions": 8}
    one = httpx.post(sim.url + "/v1/embeddings", json=request).json()
    two = httpx.post(sim.url + "/v1/embeddings", json=request).json()
    assert one == two
    vectors = [d["embedding"] for d in one["data"]]
    assert len(vectors) == 2 and vectors[0] != vectors[1] and len(vectors[0]) == 8
    assert sum(v * v for v in vectors[0]) == pytest.approx(1.0)
    client = sdk(sim.api_base)
    via_client = client.embeddings.create(
        model="text-embedding-3-small", input=["alpha", "beta"], dimensions=8
    )
    for got, want in zip(via_client.data, vectors, strict=True):
        assert got.embedding == pytest.approx(want)
    client.close()


def test_the_openai_client_reads_a_stream(sim: RunningSimulator, sdk: Any) -> None:
    script(sim, "streamed through the official client")
    client = sdk(sim.api_base)
    events = client.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    text = ""
    usage = None
    for event in events:
        text += "".join(c.delta.content or "" for c in event.choices)
        usage = event.usage or usage
    client.close()
    assert text == "streamed through the official client"
    assert usage is not None and usage.prompt_tokens == 4


# -- faults -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "error_type"), [("429", "requests"), ("500", "server_error"), ("503", "server_error")]
)
def test_status_faults_answer_in_the_openai_error_shape(
    sim: RunningSimulator, fault: str, error_type: str
) -> None:
    response = post(sim, chat_body([{"role": "user", "content": "x"}]), {"X-Sim-Fault": fault})
    assert response.status_code == int(fault)
    assert response.json()["error"]["type"] == error_type
    assert ("retry-after" in response.headers) is (fault == "429")
    if fault == "429":
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "rate_limit_exceeded"


def test_reset_drops_the_connection_mid_stream(sim: RunningSimulator) -> None:
    received = b""
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream(
            "POST",
            sim.url + "/v1/chat/completions",
            json=chat_body([{"role": "user", "content": words(40)}], stream=True),
            headers={"X-Sim-Fault": "reset"},
        ) as response,
    ):
        assert response.status_code == 200
        for piece in response.iter_bytes():
            received += piece
    assert received.count(b"data: ") == 3
    assert b"[DONE]" not in received
    with pytest.raises(httpx.RemoteProtocolError):
        post(sim, chat_body([{"role": "user", "content": "x"}]), {"X-Sim-Fault": "reset"})
    assert post(sim, chat_body([{"role": "user", "content": "x"}])).status_code == 200


def test_stall_goes_silent_then_finishes(sim: RunningSimulator) -> None:
    body = chat_body([{"role": "user", "content": words(20)}], stream=True)
    received = b""
    with (
        pytest.raises(httpx.ReadTimeout),
        httpx.stream(
            "POST",
            sim.url + "/v1/chat/completions",
            json=body,
            headers={"X-Sim-Fault": "stall", "X-Sim-Stall-S": "30"},
            timeout=httpx.Timeout(5, read=0.3),
        ) as response,
    ):
        for piece in response.iter_bytes():
            received += piece
    assert received.count(b"data: ") == 3
    state = sim.server.server.server_state  # the stalled response ends when its client leaves
    deadline = time.monotonic() + 2
    while state.tasks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not state.tasks
    started = time.perf_counter()
    raw = stream(sim, body, {"X-Sim-Fault": "stall", "X-Sim-Stall-S": "0.3"})
    assert time.perf_counter() - started >= 0.3
    assert assemble(data_chunks(raw))["content"] == "You said: " + " ".join(["abcd"] * 12) + " …"


def test_malformed_inserts_one_broken_data_line(sim: RunningSimulator) -> None:
    script(sim, "a reply long enough to be cut into several pieces")
    events = parse_sse(
        stream(sim, chat_body([{"role": "user", "content": "x"}]), {"X-Sim-Fault": "malformed"})
    )
    broken = []
    good = []
    for _, text in events:
        try:
            good.append(json.loads(text) if text != "[DONE]" else None)
        except json.JSONDecodeError:
            broken.append(text)
    assert len(broken) == 1 and broken[0].startswith('{"id":"chatcmpl-')
    assert events[-1] == ("data", "[DONE]")
    assert (
        assemble([g for g in good if g])["content"]
        == "a reply long enough to be cut into several pieces"
    )


def test_error_event_ends_the_stream_without_done(sim: RunningSimulator) -> None:
    events = parse_sse(
        stream(
            sim, chat_body([{"role": "user", "content": words(30)}]), {"X-Sim-Fault": "error_event"}
        )
    )
    payloads = [json.loads(text) for _, text in events]
    assert "error" not in payloads[0]
    assert payloads[-1] == {
        "error": {
            "message": "The server had an error while processing your request. Sorry about that!",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    assert len(payloads) == 4


def test_fault_rate_draws_faults_from_the_seed() -> None:
    def draws(seed: int) -> list[str | None]:
        sim = Simulator(SimConfig(fault_rate=0.5, seed=seed))
        return [sim.draw_fault() for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    drawn = set(draws(7))
    assert None in drawn and len(drawn - {None}) >= 3 and drawn - {None} <= set(FAULTS)
    with run_simulator(SimConfig(fault_rate=1.0, faults=("503",))) as running:
        assert post(running, chat_body([{"role": "user", "content": "x"}])).status_code == 503


def test_unknown_fault_header_is_a_400(sim: RunningSimulator) -> None:
    response = post(sim, chat_body([{"role": "user", "content": "x"}]), {"X-Sim-Fault": "teapot"})
    assert response.status_code == 400
    assert "teapot" in response.json()["error"]["message"]
    late = post(sim, chat_body([{"role": "user", "content": "x"}]), {"X-Sim-Time-Advance": "-5"})
    assert late.status_code == 400
    assert sim.sim.now == sim.sim.config.start_time


# -- determinism and the command line ------------------------------------------------------------


def test_same_seed_gives_byte_identical_responses(sim: RunningSimulator) -> None:
    def exchange(running: RunningSimulator) -> list[bytes]:
        running.sim.reset()
        asked = chat_body([{"role": "user", "content": "use tool please"}], tools=[WEATHER_TOOL])
        return [
            post(running, asked).content,
            stream(running, asked),
            post(running, chat_body(long_chat(5))).content,
        ]

    first = exchange(sim)
    assert exchange(sim) == first
    with run_simulator(SimConfig(seed=1)) as other:
        different = exchange(other)
    assert different != first
    assert [json.loads(b)["usage"] for b in (different[0], different[2])] == [
        json.loads(b)["usage"] for b in (first[0], first[2])
    ]


def test_cli_options_build_a_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(
        [
            *(
                "--dialect",
                "deepseek",
                "--ttft-ms",
                "250",
                "--chunk-ms",
                "5",
                "--cache-ttl-s",
                "600",
            ),
            *("--context-window", "64000", "--seed", "9", "--keepalive", "--port", "9000"),
        ]
    )
    assert config_from_args(ns) == SimConfig(
        dialect="deepseek",
        ttft_ms=250,
        chunk_ms=5,
        cache_ttl_s=600,
        context_window=64000,
        seed=9,
        keepalive=True,
    )
    assert (ns.host, ns.port) == ("127.0.0.1", 9000)
    assert config_from_args(parser.parse_args([])) == SimConfig()
    # the config file's spelling of the dialect is taken too
    anthropic = config_from_args(parser.parse_args(["--dialect", "anthropic"]))
    assert anthropic.dialect == "anthropic-compat"
    assert not anthropic.cache_unmarked
    gateway = config_from_args(parser.parse_args(["--dialect", "anthropic", "--cache-unmarked"]))
    assert gateway.cache_unmarked
    assert config_from_args(parser.parse_args(["--refuse-stream-options"])).refuse_stream_options
    assert config_from_args(parser.parse_args(["--interleave-tool-calls"])).interleave_tool_calls
    assert not config_from_args(parser.parse_args([])).interleave_tool_calls
    with pytest.raises(ValueError, match="fault_rate"):
        config_from_args(parser.parse_args(["--fault-rate", "2"]))


def test_tools_are_rendered_as_a_provider_renders_them() -> None:
    """Fields are read by name (their order changes nothing); a schema's properties are the
    function's parameters, in the order sent (reordered, another prompt)."""
    from proxy.simulator.tokens import request_tokens

    params = {
        "type": "object",
        "properties": {"path": {"type": "string"}, "n": {"type": "integer"}},
    }
    tool = {"type": "function", "function": {"name": "read", "parameters": params}}
    body = {"tools": [tool], "messages": [{"role": "user", "content": "hi"}]}
    fields_moved = {
        **body,
        "tools": [{"function": {"parameters": params, "name": "read"}, "type": "function"}],
    }
    assert request_tokens(fields_moved) == request_tokens(body)
    flipped = {**params, "properties": {"n": {"type": "integer"}, "path": {"type": "string"}}}
    reordered = {**body, "tools": [{**tool, "function": {"name": "read", "parameters": flipped}}]}
    assert request_tokens(reordered) != request_tokens(body)


def test_a_long_running_simulator_keeps_only_the_latest_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Left running as an agent's upstream for a day, it kept every body (3 GB): the latest
    requests are kept, by count and by their bodies' bytes; the newest always."""
    from proxy.simulator import state

    monkeypatch.setattr(state, "KEEP_REQUESTS", 3)
    monkeypatch.setattr(state, "KEEP_BYTES", 7000)  # 1,000 bytes of bodies, at 7 a byte
    sim = state.Simulator()
    for n in range(5):
        sim.record("POST", "/v1/chat/completions", {}, b"%d" % n * 10)
    assert [r.raw[:1] for r in sim.requests] == [b"2", b"3", b"4"]  # by count
    sim.record("POST", "/v1/chat/completions", {}, b"x" * 900)
    assert [len(r.raw) for r in sim.requests] == [10, 10, 900]
    sim.record("POST", "/v1/chat/completions", {}, b"w" * 95)
    assert [len(r.raw) for r in sim.requests] == [900, 95]  # by bytes: 1,000 at most
    sim.record("POST", "/v1/chat/completions", {}, b"y" * 5000)
    assert [len(r.raw) for r in sim.requests] == [5000]  # a larger one alone is still kept
    sim.reset()
    sim.record("POST", "/v1/chat/completions", {}, b"z" * 990)
    assert len(sim.requests) == 1  # the count of bytes starts again


def test_replies_enqueued_in_their_json_form_are_served() -> None:
    """The README's ``.sim.enqueue(replies)`` with a reply as the README writes one (a string,
    ``{"content": …}``): it was queued as it was, and the next request got an empty 500 and a
    traceback on the simulator's stderr. A wrong one is refused when it is enqueued."""
    with run_simulator(SimConfig()) as sim:
        assert sim.sim.enqueue(["hello", {"content": "there", "finish_reason": "length"}]) == 2
        said = []
        for _ in range(2):
            r = httpx.post(
                sim.api_base + "/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
            )
            assert r.status_code == 200
            choice = r.json()["choices"][0]
            said.append((choice["message"]["content"], choice["finish_reason"]))
        assert said == [("hello", "stop"), ("there", "length")]
        with pytest.raises(ValueError, match="a scripted reply must be a string or an object"):
            sim.sim.enqueue(["fine", 42])
        assert sim.sim.take_scripted() is None  # (none of them queued)


# -- the Responses API -------------------------------------------------------------------------


def test_responses_answers_the_sdk_plain_and_streamed(sim: RunningSimulator, sdk: Any) -> None:
    client = sdk(sim.api_base)
    sim.sim.enqueue(["First answer.", "Second answer."])
    plain = client.responses.create(model="gpt-5", input="hello")
    assert plain.output_text == "First answer." and plain.status == "completed"
    assert plain.usage is not None and plain.usage.output_tokens == count_tokens("First answer.")
    with client.responses.stream(model="gpt-5", input=[{"role": "user", "content": "hi"}]) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == "Second answer." == final.output_text
    assert [r.path for r in sim.sim.requests] == ["/v1/responses", "/v1/responses"]


def test_a_responses_request_moves_the_clock_first_as_a_chat_request_does(
    sim: RunningSimulator,
) -> None:
    """``X-Sim-Time-Advance`` was read on the chat route alone: a Responses API turn after a
    pause past the TTL was served from the cache (an expiry could not be simulated there), and
    a bad value was taken."""
    body = {"model": "gpt-5", "input": [{"role": "user", "content": words(1100)}]}

    def cached_of(headers: dict[str, str]) -> int:
        answer = httpx.post(sim.url + "/v1/responses", json=body, headers=headers)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["input_tokens_details"]["cached_tokens"]

    start = sim.sim.config.start_time
    assert cached_of({}) == 0
    assert cached_of({"X-Sim-Time-Advance": "299"}) == 1024
    assert cached_of({"X-Sim-Time-Advance": "301"}) == 0
    assert httpx.get(sim.url + "/_sim/clock").json()["now"] == start + 600
    for path in ("/v1/responses", "/v1/responses/compact"):
        refused = httpx.post(sim.url + path, json=body, headers={"X-Sim-Time-Advance": "soon"})
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "invalid_sim_control"


def test_responses_usage_reads_its_prefix_from_the_cache_and_is_recorded(
    sim: RunningSimulator,
    sdk: Any,
) -> None:
    """The second turn resends the first's input: its ``cached_tokens`` are the prefix cache's
    read, as a chat request's are; a scripted reply's reasoning is in ``output_tokens`` and its
    details; each request's usage is in the simulator's record."""
    client = sdk(sim.api_base)
    items: list[Any] = [{"role": "user", "content": "Plan the refactor. " * 400}]
    sim.sim.enqueue([{"content": "Planned.", "reasoning_tokens": 7}, "Done."])
    first = client.responses.create(model="gpt-5", input=items, instructions="Be brief.")
    items += [{"role": "assistant", "content": "Planned."}, {"role": "user", "content": "go"}]
    second = client.responses.create(model="gpt-5", input=items, instructions="Be brief.")
    assert first.usage is not None and second.usage is not None
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert first.usage.output_tokens_details.reasoning_tokens == 7
    assert first.usage.output_tokens == count_tokens("Planned.") + 7
    cached = second.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens - 128 < cached <= first.usage.input_tokens
    recorded = [r.usage for r in sim.sim.requests]
    assert recorded == [u.model_dump(exclude_none=True) for u in (first.usage, second.usage)]


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (
            [{"type": "custom_tool_call", "call_id": "c_p", "name": "apply_patch", "input": ""}],
            "No tool output found for custom tool call c_p.",
        ),
        (
            [{"type": "function_call_output", "call_id": "c_x", "output": "x"}],
            "No tool call found for function call output with call_id c_x.",
        ),
    ],
)
def test_responses_refuses_a_broken_pairing_as_openai_does(
    sim: RunningSimulator, items: list[Any], message: str
) -> None:
    answer = httpx.post(sim.api_base + "/responses", json={"model": "gpt-5", "input": items})
    assert answer.status_code == 400
    assert answer.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": "input",
        "code": None,
    }


def test_responses_compact_keeps_the_user_messages_and_seals_the_rest(
    sim: RunningSimulator, sdk: Any
) -> None:
    """``POST /v1/responses/compact`` as the SDK's ``responses.compact`` reads it: the user
    messages, then one compaction item (the same input, the same token: a Fernet-shaped one),
    its usage from the prefix cache; its input's pairing judged as a turn's."""
    client = sdk(sim.api_base)
    items: list[Any] = [
        {"role": "user", "content": "fix the failing test " * 200},
        {"type": "function_call", "call_id": "c1", "name": "sh", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "FAILED test_x"},
        {"role": "assistant", "content": "Fixed."},
        {"role": "user", "content": [{"type": "input_text", "text": "now the docs"}]},
    ]
    raw = client.responses.with_raw_response.compact(
        model="gpt-5", input=items, instructions="rules"
    )
    first, again = (
        raw.parse(),
        client.responses.compact(model="gpt-5", input=items, instructions="rules"),
    )
    assert first.object == "response.compaction"
    assert [(o.type, getattr(o, "role", None)) for o in first.output] == [
        ("message", "user"),
        ("message", "user"),
        ("compaction", None),
    ]
    dumped = raw.http_response.json()["output"]  # (what Codex CLI resends: its user messages
    # are no output message the SDK's types know)
    assert dumped[0]["content"] == [{"type": "input_text", "text": "fix the failing test " * 200}]
    assert dumped[1]["content"] == items[4]["content"]
    sealed = dumped[2]["encrypted_content"]
    assert sealed.startswith("gAAAAA") and len(sealed) > 1024
    assert again.output[-1].type == "compaction"
    assert again.output[-1].encrypted_content == sealed
    assert first.usage.input_tokens == again.usage.input_tokens > 400
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert again.usage.input_tokens_details.cached_tokens > 400
    assert 16 <= first.usage.output_tokens <= 2000
    assert [r.usage for r in sim.sim.requests] == [
        u.model_dump(exclude_none=True) for u in (first.usage, again.usage)
    ]
    # the next turn goes on from the compacted items
    follow = client.responses.create(
        model="gpt-5", input=[*dumped, {"role": "user", "content": "go"}]
    )
    assert follow.output_text == "Done."
    with pytest.raises(openai.BadRequestError, match="No tool output found for function call c1"):
        client.responses.compact(model="gpt-5", input=items[:2])


def test_responses_takes_outputs_of_a_stored_response(sim: RunningSimulator) -> None:
    items = [{"type": "function_call_output", "call_id": "c_x", "output": "x"}]
    answer = httpx.post(
        sim.api_base + "/responses",
        json={"model": "gpt-5", "input": items, "previous_response_id": "resp_1"},
    )
    assert answer.status_code == 200, answer.text


def test_responses_refuses_a_continuation_that_leaves_its_stored_calls_unanswered(
    sim: RunningSimulator, sdk: Any
) -> None:
    """As OpenAI: the answer's calls are stored with it, and a request that continues it must
    give their outputs (the Agents SDK's interrupted turn, its next message alone)."""
    client = sdk(sim.api_base)
    calls = {"tool_calls": [{"name": "read_file", "arguments": {"path": "a.py"}, "id": "call_a"}]}
    sim.sim.enqueue([calls])
    stored = client.responses.create(model="gpt-5", input="read a.py")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="gpt-5", input="go on", previous_response_id=stored.id)
    assert refused.value.message.endswith("No tool output found for function call call_a.")
    output = {"type": "function_call_output", "call_id": "call_a", "output": "x = 1"}
    answered = client.responses.create(
        model="gpt-5", input=[output], previous_response_id=stored.id
    )
    assert answered.output_text == "Done."
    sim.sim.reset()  # (forgotten, as a response past its provider's storage: not judged)
    client.responses.create(model="gpt-5", input="go on", previous_response_id=stored.id)


def test_responses_answers_a_scripted_call_as_function_call_items(
    sim: RunningSimulator, sdk: Any
) -> None:
    client = sdk(sim.api_base)
    calls = {"tool_calls": [{"name": "read_file", "arguments": {"path": "a.py"}, "id": "call_a"}]}
    sim.sim.enqueue([calls, {"content": "Reading.", **calls}])
    plain = client.responses.create(model="gpt-5", input="read a.py")
    (item,) = plain.output
    assert item.type == "function_call" and item.call_id == "call_a"
    assert (item.name, item.arguments) == ("read_file", '{"path":"a.py"}')
    with client.responses.stream(model="gpt-5", input="read a.py") as stream:
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    assert [e.arguments for e in done] == ['{"path":"a.py"}']
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output_text == "Reading."


@pytest.mark.parametrize(
    ("part", "said"),
    [
        ({"type": "text", "text": ""}, "messages: text content blocks must be non-empty"),
        (
            {"type": "text", "text": " \n"},
            "messages: text content blocks must contain non-whitespace text",
        ),
    ],
)
def test_anthropic_compat_refuses_a_blank_text_block_in_any_message(
    anthropic_server: RunningSimulator, part: dict[str, Any], said: str
) -> None:
    """Claude refuses a text block that is empty or white space, in any message (gateways make
    one of an assistant message's ``""``)."""
    for role in ("user", "assistant"):
        messages = [{"role": "user", "content": "hi"}, {"role": role, "content": [part]}]
        answer = httpx.post(
            anthropic_server.api_base + "/chat/completions",
            json={"model": "claude-sonnet-4-5", "messages": messages},
        )
        assert answer.status_code == 400 and answer.json()["error"]["message"] == said


def test_responses_streams_are_paced_and_faulted_as_chat_answers(sdk: Any) -> None:
    """The Responses API's events came all at once, whatever --ttft-ms and --chunk-ms said, and
    X-Sim-Fault was not read there."""
    import time

    with run_simulator(SimConfig(ttft_ms=300, chunk_ms=20)) as sim:
        client = sdk(sim.api_base)
        sim.sim.enqueue(["one two three four five six"])
        began = time.monotonic()
        stream = client.responses.create(model="gpt-5", input="hi", stream=True)
        times = [time.monotonic() - began for _ in stream]
        assert times[0] >= 0.3 and times[-1] - times[0] >= 0.02 * (len(times) - 2)
        with pytest.raises(openai.InternalServerError):
            client.responses.create(model="gpt-5", input="hi", extra_headers={"X-Sim-Fault": "500"})
        with pytest.raises(openai.APIError):
            list(
                client.responses.create(
                    model="gpt-5", input="hi", stream=True, extra_headers={"X-Sim-Fault": "reset"}
                )
            )
        assert [r.fault for r in sim.sim.requests] == [None, "500", "reset"]
        # a reply of this request's own, and a scripted reply's fault, as for chat
        said = client.responses.create(
            model="gpt-5", input="hi", extra_headers={"X-Sim-Script": '"scripted hello"'}
        )
        assert said.output_text == "scripted hello"
        sim.sim.enqueue([{"content": "never", "fault": "503"}])
        with pytest.raises(openai.InternalServerError):
            client.responses.create(model="gpt-5", input="hi")


@pytest.mark.parametrize(
    ("content", "refused"),
    [
        ("", True),
        ([], True),
        ([{"type": "text", "text": ""}], True),
        (" ", False),  # (white space is text to Gemini)
        ("ok", False),
    ],
)
def test_gemini_rules_refuse_an_empty_assistant_text(content: Any, refused: bool) -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": content},
        {"role": "user", "content": "again"},
    ]
    with run_simulator(SimConfig(gemini_rules=True)) as gemini:
        response = post(gemini, chat_body(messages))
        beside_calls = [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "done"},
        ]
        assert post(gemini, chat_body(beside_calls)).status_code == 200
    if refused:
        assert response.status_code == 400
        (error,) = response.json()  # (Gemini's OpenAI endpoint: a list of one error)
        assert error["error"]["status"] == "INVALID_ARGUMENT"
        assert error["error"]["message"].startswith(
            "Unable to submit request because it has an empty text parameter."
        )
    else:
        assert response.status_code == 200


@pytest.mark.parametrize("reference", [{"type": "item_reference", "id": "fc_1"}, {"id": "fc_1"}])
def test_responses_takes_an_output_that_may_answer_a_referenced_stored_call(
    sim: RunningSimulator, reference: dict[str, Any]
) -> None:
    """An item referenced by id may be a stored call, which an output answers (as cachegate's
    repair reads it): it was refused as an orphan, as if nothing were stored."""
    items = [
        {"role": "user", "content": "list files"},
        reference,
        {"type": "function_call_output", "call_id": "call_X", "output": "a.txt"},
    ]
    answer = httpx.post(sim.api_base + "/responses", json={"model": "gpt-5", "input": items})
    assert answer.status_code == 200


# -- what OpenAI does that agents meet: forced tools, cut answers, overflow, ids ------------------

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}


def test_tool_choice_rules_over_what_the_message_asks(sim: RunningSimulator) -> None:
    """tool_choice was ignored: "none" with "use tool" in the message called a tool, a named
    function was not the one called, "required" answered with text. An agent's forced first
    call could not be tried against the simulator."""
    tools = [WEATHER_TOOL, SEARCH_TOOL]
    asks = [{"role": "user", "content": "please use tool"}]
    hello = [{"role": "user", "content": "hi"}]

    def choice(messages: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any]:
        response = post(sim, chat_body(messages, tools=tools, tool_choice=tool_choice))
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    none = choice(asks, "none")
    assert none["finish_reason"] == "stop" and "tool_calls" not in none["message"]
    assert none["message"]["content"] == "You said: please use tool"
    named = choice(asks, {"type": "function", "function": {"name": "search"}})
    assert named["finish_reason"] == "tool_calls"
    assert named["message"]["tool_calls"][0]["function"]["name"] == "search"
    required = choice(hello, "required")
    assert required["finish_reason"] == "tool_calls"
    assert required["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert choice(hello, "auto")["message"]["content"] == "You said: hi"
    streamed = assemble(
        data_chunks(
            stream(
                sim,
                chat_body(
                    hello,
                    tools=tools,
                    tool_choice={"type": "function", "function": {"name": "search"}},
                ),
            )
        )
    )
    assert [c["name"] for c in streamed["tool_calls"]] == ["search"]


def test_an_answer_longer_than_max_tokens_is_cut_with_finish_reason_length(
    sim: RunningSimulator,
) -> None:
    """max_tokens and max_completion_tokens only sized the context check: a 16-token answer came
    whole under max_tokens=3, so a cut answer (finish_reason "length") never reached a test."""
    long_text = "alpha beta gamma delta epsilon zeta"  # alph a beta gamm a delt a epsi lon zeta
    assert count_tokens(long_text) == 10
    for key in ("max_tokens", "max_completion_tokens"):
        script(sim, long_text)
        body = post(sim, chat_body([{"role": "user", "content": "hi"}], **{key: 3})).json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length", key
        assert choice["message"]["content"] == "alpha beta"  # alph a beta
        assert body["usage"]["completion_tokens"] == 3
    script(sim, long_text)
    streamed = assemble(
        data_chunks(
            stream(
                sim,
                chat_body(
                    [{"role": "user", "content": "hi"}],
                    max_tokens=4,
                    stream_options={"include_usage": True},
                ),
            )
        )
    )
    assert streamed["content"] == "alpha beta gamm" and streamed["finish_reason"] == "length"
    assert streamed["usage"]["completion_tokens"] == 4
    # a reasoning model's thinking spends the budget first: no text is left
    script(sim, {"content": long_text, "reasoning_tokens": 50})
    body = post(sim, chat_body([{"role": "user", "content": "hi"}], max_completion_tokens=20))
    choice = body.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert body.json()["usage"]["completion_tokens"] == 20
    # within the limit: untouched
    script(sim, long_text)
    body = post(sim, chat_body([{"role": "user", "content": "hi"}], max_tokens=10)).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == long_text


def test_an_empty_tools_array_and_messages_without_content_are_refused(
    sim: RunningSimulator,
) -> None:
    """OpenAI refuses tools [] and a null or missing content in a user, system or tool message;
    the simulator answered 200, so a proxy that empties a request's tools (or a repair that
    gives a tool message no content) passed every test and failed against OpenAI."""
    user = [{"role": "user", "content": "x"}]
    refused = post(sim, chat_body(user, tools=[]))
    assert refused.status_code == 400
    assert refused.json()["error"] == {
        "message": "Invalid 'tools': empty array. Expected an array with minimum length 1, but "
        "got an empty array instead.",
        "type": "invalid_request_error",
        "param": "tools",
        "code": "empty_array",
    }
    call = {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    cases: list[tuple[list[dict[str, Any]], str, str, str]] = [
        (
            [{"role": "user", "content": None}],
            "Invalid value for 'content': expected a string, got null.",
            "messages.[0].content",
            "invalid_value",
        ),
        (
            [{"role": "system", "content": "s"}, {"role": "user"}],
            "Missing required parameter: 'messages[1].content'.",
            "messages[1].content",
            "missing_required_parameter",
        ),
        (
            [{"role": "user", "content": 42}],
            "Invalid type for 'messages[0].content': expected one of a string or array of "
            "objects, but got an integer instead.",
            "messages[0].content",
            "invalid_type",
        ),
        (
            [
                *user,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_a", "content": None},
            ],
            "Invalid value for 'content': expected a string, got null.",
            "messages.[2].content",
            "invalid_value",
        ),
    ]
    for messages, message, param, code in cases:
        response = post(sim, chat_body(messages))
        assert response.status_code == 400, messages
        error = response.json()["error"]
        assert (error["message"], error["param"], error["code"]) == (message, param, code)
    # what stays valid: parts, an assistant's null content beside its calls, an empty string
    ok = [
        {"role": "user", "content": [{"type": "text", "text": "x"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_a", "content": ""},
    ]
    assert post(sim, chat_body(ok)).status_code == 200


def test_a_responses_input_over_the_context_window_is_refused_as_openai_does(
    sdk: Any,
) -> None:
    """The Responses route took any input (480,014 tokens in a 128,000 window): Codex CLI's
    compaction on context_length_exceeded could never be reached against the simulator."""
    with run_simulator(SimConfig(context_window=2_000)) as small:
        client = sdk(small.api_base)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="gpt-5", input=words(2_100))
        assert refused.value.status_code == 400
        assert refused.value.body == {
            "message": "Your input exceeds the context window of this model. Please adjust "
            "your input and try again.",
            "type": "invalid_request_error",
            "param": "input",
            "code": "context_length_exceeded",
        }
        compact = httpx.post(
            small.api_base + "/responses/compact", json={"model": "gpt-5", "input": words(2_100)}
        )
        assert compact.status_code == 400
        assert compact.json()["error"]["code"] == "context_length_exceeded"
        assert client.responses.create(model="gpt-5", input=words(1_000)).status == "completed"


def test_a_response_echoes_the_tools_and_tool_choice_it_was_sent(
    sim: RunningSimulator, sdk: Any
) -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    answer = sdk(sim.api_base).responses.create(
        model="gpt-5", input="x", tools=[tool], tool_choice="required", parallel_tool_calls=False
    )
    assert [t.name for t in answer.tools] == ["f"]  # type: ignore[union-attr]
    assert answer.tool_choice == "required" and answer.parallel_tool_calls is False


def test_a_single_model_is_served_for_the_sdks_retrieve(sim: RunningSimulator, sdk: Any) -> None:
    model = sdk(sim.api_base).models.retrieve("ft:gpt-4o:org/custom")
    assert model.id == "ft:gpt-4o:org/custom" and model.object == "model"


def test_mistral_rules_give_the_ids_mistral_takes_back() -> None:
    """With --mistral-rules the simulator called tools with call_... ids of 29 characters, and
    refused them on the next turn (Tool call id was call_... but must be a-z, A-Z, 0-9, with a
    length of 9): every tool loop failed on its second turn."""
    with run_simulator(SimConfig(mistral_rules=True)) as mistral:
        first = [{"role": "user", "content": "please use tool"}]
        answer = post(mistral, chat_body(first, tools=[WEATHER_TOOL])).json()
        call = answer["choices"][0]["message"]["tool_calls"][0]
        assert len(call["id"]) == 9 and call["id"].isalnum()
        history = [
            *first,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
        ]
        again = post(mistral, chat_body(history, tools=[WEATHER_TOOL]))
        assert again.status_code == 200, again.text


def test_n_choices_plain_and_streamed_as_openai_gives_them(sim: RunningSimulator, sdk: Any) -> None:
    """n was ignored: one choice came, whatever n asked, so what a proxy does with the others
    (relays them; logs the first) could not be tried. Each choice is the reply, its calls with
    ids of their own; the completion is billed n times; n outside 1-128 is refused."""
    client = sdk(sim.api_base)
    asks = [{"role": "user", "content": "please use tool"}]
    plain = client.chat.completions.create(model="gpt-4o", messages=asks, tools=[WEATHER_TOOL], n=3)
    assert [c.index for c in plain.choices] == [0, 1, 2]
    ids = [c.message.tool_calls[0].id for c in plain.choices]  # type: ignore[index]
    assert len(set(ids)) == 3
    one = count_tokens("get_weather") + count_tokens('{"city":"sim","days":1}')
    assert plain.usage is not None and plain.usage.completion_tokens == 3 * one
    hello = [{"role": "user", "content": "hi"}]
    raw = stream(sim, chat_body(hello, n=2, stream_options={"include_usage": True}))
    chunks = data_chunks(raw)
    texts = ["", ""]
    finishes: dict[int, str] = {}
    for c in chunks[:-1]:
        assert c["usage"] is None and len(c["choices"]) == 1
        choice = c["choices"][0]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == ["You said: hi", "You said: hi"] and finishes == {0: "stop", 1: "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2 * (
        count_tokens("You said: hi")
    )
    for n, code in ((0, "integer_below_min_value"), (129, "integer_above_max_value")):
        refused = post(sim, chat_body(hello, n=n))
        assert refused.status_code == 400 and refused.json()["error"]["code"] == code
    assert post(sim, chat_body(hello, n="2")).json()["error"]["code"] == "invalid_type"


def test_logprobs_are_given_when_asked_plain_and_streamed(sim: RunningSimulator, sdk: Any) -> None:
    """``logprobs`` was ignored (null in every choice), so a client that reads token
    probabilities could not be tried, nor what a proxy does with chunks that carry them. Asked,
    each token of the text comes with its log probability, its bytes and ``top_logprobs``
    alternatives, the token first; the same text gets the same figures, plain or streamed;
    values OpenAI refuses are refused."""
    client = sdk(sim.api_base)
    asks = [{"role": "user", "content": "héllo there"}]
    plain = client.chat.completions.create(
        model="gpt-4o", messages=asks, logprobs=True, top_logprobs=3
    )
    choice = plain.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    tokens = choice.logprobs.content
    assert "".join(t.token for t in tokens) == choice.message.content == "You said: héllo there"
    for t in tokens:
        assert bytes(t.bytes or []) == t.token.encode() and -4 < t.logprob <= 0
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert [a.logprob for a in t.top_logprobs] == sorted(
            (a.logprob for a in t.top_logprobs), reverse=True
        )
    unasked = client.chat.completions.create(model="gpt-4o", messages=asks)
    assert unasked.choices[0].logprobs is None
    streamed = list(
        client.chat.completions.create(
            model="gpt-4o", messages=asks, logprobs=True, top_logprobs=3, stream=True
        )
    )
    entries = [
        t for c in streamed if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]  # fmt: skip
    assert [t.model_dump() for t in entries] == [t.model_dump() for t in tokens]
    no_top = client.chat.completions.create(model="gpt-4o", messages=asks, logprobs=True)
    assert [t.top_logprobs for t in no_top.choices[0].logprobs.content or []] == [[]] * len(tokens)
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"logprobs": "yes"}, "logprobs", "invalid_type"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "integer_above_max_value"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "integer_below_min_value"),
        ({"logprobs": True, "top_logprobs": "2"}, "top_logprobs", "invalid_type"),
    ]
    for extra, param, code in cases:
        error = post(sim, chat_body(asks, **extra)).json()["error"]
        assert (error["param"], error["code"]) == (param, code), extra
