"""Tool-pairing repair: one exact case per rule, then random histories against the provider."""

from __future__ import annotations

import copy
import hashlib
import itertools
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.pairing import (
    DEFAULT_INTERRUPTED_NOTE,
    DOWNGRADE_PREFIXES,
    MISTRAL_BRIDGE,
    MISTRAL_NO_ANSWER,
    NO_OUTPUT,
    PairingResult,
    Repair,
    diagnose,
    format_strict_error,
    needs_repair,
    needs_repair_from,
    repair_messages,
    repair_messages_from,
)
from proxy.prefix import cache_mark
from proxy.simulator.validate import (
    ValidationError,
    mistral_refusal,
    validate_claude_messages,
    validate_messages,
)

Message = dict[str, Any]


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def call(call_id: str | None, name: str = "read", arguments: str = '{"path": "a.txt"}') -> Message:
    made: Message = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return made if call_id is None else {"id": call_id, **made}


def asst(*calls: Message, content: str | None = None) -> Message:
    message: Message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def tool(call_id: str | None, content: Any = "ok") -> Message:
    message: Message = {"role": "tool", "content": content}
    if call_id is not None:
        message["tool_call_id"] = call_id
    return message


def synthetic(call_id: str, name: str = "read") -> Message:
    return {
        "role": "tool",
        "tool_call_id": call_id,
        "content": DEFAULT_INTERRUPTED_NOTE.replace("{name}", name),
    }


def kinds_of(repairs: list[Repair]) -> list[tuple[str, int, str | None]]:
    return [(r.kind, r.index, r.tool_call_id) for r in repairs]


def kinds(result: PairingResult) -> list[tuple[str, int, str | None]]:
    return kinds_of(result.repairs)


CASES: list[tuple[str, list[Message], list[Message], list[tuple[str, int, str | None]]]] = [
    (
        "dangling call: synthetic result after the real ones, in call order",
        [user("go"), asst(call("a"), call("b", "write"), call("c")), tool("a"), user("next")],
        [
            user("go"),
            asst(call("a"), call("b", "write"), call("c")),
            tool("a"),
            synthetic("b", "write"),
            synthetic("c"),
            user("next"),
        ],
        [("dangling_call", 1, "b"), ("dangling_call", 1, "c")],
    ),
    (
        "history ending with tool_calls: synthetic results appended",
        [user("go"), asst(call("a"), call("b"))],
        [user("go"), asst(call("a"), call("b")), synthetic("a"), synthetic("b")],
        [("dangling_call", 1, "a"), ("dangling_call", 1, "b")],
    ),
    (
        "displaced result: steer message moved after the block",
        [user("go"), asst(call("a"), call("b")), tool("a", "A"), user("steer"), tool("b", "B")],
        [user("go"), asst(call("a"), call("b")), tool("a", "A"), tool("b", "B"), user("steer")],
        [("displaced_result", 4, "b")],
    ),
    (
        "displaced results keep the client's order; other messages follow in order",
        [
            asst(call("a"), call("b")),
            user("s1"),
            asst(content="hm"),
            tool("b", "B"),
            tool("a", "A"),
        ],
        [
            asst(call("a"), call("b")),
            tool("b", "B"),
            tool("a", "A"),
            user("s1"),
            asst(content="hm"),
        ],
        [("displaced_result", 3, "b"), ("displaced_result", 4, "a")],
    ),
    (
        "displaced result answering an earlier assistant message than the current block",
        [asst(call("a")), user("s"), asst(call("b")), tool("a", "A"), tool("b", "B")],
        [asst(call("a")), tool("a", "A"), user("s"), asst(call("b")), tool("b", "B")],
        [("displaced_result", 3, "a")],
    ),
    (
        "orphan result: downgraded to a labelled user message",
        [user("go"), tool("x", "stray output"), asst(content="done")],
        [
            user("go"),
            user("[tool result for call x (no matching tool call)]\nstray output"),
            asst(content="done"),
        ],
        [("orphan_result", 1, "x")],
    ),
    (
        "orphan result inside a block: the block closes first",
        [asst(call("a")), tool("x", "X"), tool("a", "A")],
        [
            asst(call("a")),
            tool("a", "A"),
            user("[tool result for call x (no matching tool call)]\nX"),
        ],
        [("orphan_result", 1, "x")],
    ),
    (
        "orphan result without a tool_call_id",
        [user("go"), tool(None, "X")],
        [user("go"), user("[tool result without a tool_call_id (no matching tool call)]\nX")],
        [("orphan_result", 1, None)],
    ),
    (
        "orphan result with content parts keeps the parts",
        [user("go"), tool("x", [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}])],
        [
            user("go"),
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "[tool result for call x (no matching tool call)]"},
                    {"type": "text", "text": "p1"},
                    {"type": "text", "text": "p2"},
                ],
            },
        ],
        [("orphan_result", 1, "x")],
    ),
    (
        "duplicate result: first kept, the later one downgraded",
        [asst(call("a")), tool("a", "first"), tool("a", "second"), user("s"), tool("a", "third")],
        [
            asst(call("a")),
            tool("a", "first"),
            user("[duplicate tool result for call a]\nsecond"),
            user("s"),
            user("[duplicate tool result for call a]\nthird"),
        ],
        [("duplicate_result", 2, "a"), ("duplicate_result", 4, "a")],
    ),
    (
        "invalid arguments: replaced by {}",
        [asst(call("a", "write", '{"path": "x.py", "text": "def f(')), tool("a")],
        [asst(call("a", "write", "{}")), tool("a")],
        [("invalid_arguments", 0, "a")],
    ),
    (
        "empty arguments string is not JSON either",
        [asst(call("a", "now", "")), tool("a")],
        [asst(call("a", "now", "{}")), tool("a")],
        [("invalid_arguments", 0, "a")],
    ),
    (
        "a result of content null or none (a tool that gave None): given an empty one",
        [
            asst(call("a"), call("b")),
            tool("a", None),
            {"role": "tool", "tool_call_id": "b"},
            tool("zz", None),
        ],
        [
            asst(call("a"), call("b")),
            tool("a", ""),
            tool("b", ""),
            user("[tool result for call zz (no matching tool call)]"),
        ],
        [("null_result", 1, "a"), ("null_result", 2, "b"), ("orphan_result", 3, "zz")],
    ),
]


def test_a_result_of_no_content_says_no_output_to_claude_and_is_counted_once() -> None:
    """For a Claude model the empty result is ``(no output)`` (as a result of blank text
    parts: Claude refuses an empty one through some gateways); a repaired history needs no
    more repair, and strict mode names the result."""
    history = [user("go"), asst(call("a")), tool("a", None), user("next")]
    result = repair_messages(history, drop_empty=True)
    assert result.messages[2] == tool("a", "(no output)")
    assert kinds(result) == [("null_result", 2, "a")]
    assert repair_messages(result.messages, drop_empty=True).repairs == []
    assert format_strict_error(diagnose(history)) == (
        "cachegate strict pairing: 1 defect: messages[2] tool result for a has no content"
        " (null or none) (null_result)"
    )


@pytest.mark.parametrize(
    "arguments",
    [
        '{"text": "Hi \\ud83d"}',  # JavaScript's JSON.stringify of a text cut inside an emoji
        '{"limit": 1e400}',  # beyond a double: JSON all the same
        '{"text": "Hi \\ud83d\\ude00"}',
    ],
)
def test_arguments_that_are_json_but_not_to_orjson_are_left_alone(arguments: str) -> None:
    history = [user("go"), asst(call("a", "say", arguments)), tool("a")]
    result = repair_messages(history)
    assert result.repairs == []
    assert result.messages[1]["tool_calls"][0]["function"]["arguments"] == arguments
    assert diagnose(history) == []


@pytest.mark.parametrize(
    "arguments",
    [
        '{"limit": NaN}',
        '{"limit": Infinity}',
        '{"a": 1',
        # a small model looping on brackets, cut at max_tokens: past the parser's stack (it
        # raised, and every request of the session got a 500)
        "[" * 3000,
        "[" * 1100 + "]" * 1100,
        '{"a":' * 2000,
    ],
    ids=["nan", "infinity", "cut", "open-brackets", "deep-brackets", "deep-objects"],
)
def test_arguments_that_are_not_json_are_still_repaired(arguments: str) -> None:
    result = repair_messages([user("go"), asst(call("a", "say", arguments)), tool("a")])
    assert [r.kind for r in result.repairs] == ["invalid_arguments"]


@pytest.mark.parametrize(
    ("given_messages", "expected", "expected_repairs"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_each_rule_gives_the_exact_history(
    given_messages: list[Message],
    expected: list[Message],
    expected_repairs: list[tuple[str, int, str | None]],
) -> None:
    before = copy.deepcopy(given_messages)
    result = repair_messages(given_messages)
    assert result.messages == expected
    assert kinds(result) == expected_repairs
    assert result.changed
    assert given_messages == before
    validate_messages(result.messages)


def test_call_without_id_gets_a_pinned_stable_id_and_its_result_the_same_id() -> None:
    messages = [user("go"), asst(call(None, "ls", '{"dir": "."}')), tool(None, "X")]
    result = repair_messages(messages)
    # pinned: a derived id that changed between releases would break the provider's prefix cache
    new_id = "call_00622dc8fe112383b575e21c"
    assert result.messages == [
        user("go"),
        asst(
            {
                "type": "function",
                "function": {"name": "ls", "arguments": '{"dir": "."}'},
                "id": new_id,
            }
        ),
        tool(new_id, "X"),
    ]
    assert kinds(result) == [("missing_id", 1, new_id), ("missing_id", 2, new_id)]
    assert repair_messages(copy.deepcopy(messages)).messages == result.messages
    assert repair_messages(result.messages).messages is result.messages  # nothing left to do
    validate_messages(result.messages)


def test_empty_ids_are_matched_by_order_as_the_servers_that_send_them_do() -> None:
    """Gemini's OpenAI-compatible API and some local servers send calls with ``"id": ""`` and
    their clients answer with ``"tool_call_id": ""``. The results were downgraded to user
    messages and every call got a synthetic "interrupted" result, on every turn."""
    messages = [
        user("go"),
        asst(call("", "read"), call("", "ls")),
        tool("", "file contents"),
        tool("", "a.txt b.txt"),
        asst(content="done"),
        user("next"),
    ]
    result = repair_messages(messages)
    calls = result.messages[1]["tool_calls"]
    first, second = calls[0]["id"], calls[1]["id"]
    assert first.startswith("call_") and second.startswith("call_") and first != second
    assert result.messages[2:] == [
        tool(first, "file contents"),
        tool(second, "a.txt b.txt"),
        asst(content="done"),
        user("next"),
    ]
    assert {r.kind for r in result.repairs} == {"missing_id"}
    assert len(result.repairs) == 4
    validate_messages(result.messages)


def test_a_custom_tools_dangling_call_is_named_in_its_synthetic_result() -> None:
    custom = {"id": "c1", "type": "custom", "custom": {"name": "apply_patch", "input": "*** x"}}
    result = repair_messages([user("go"), {"role": "assistant", "tool_calls": [custom]}])
    assert result.messages[2] == synthetic("c1", "apply_patch")
    assert kinds(result) == [("dangling_call", 1, "c1")]  # free-text input is no bad JSON


def test_a_function_call_without_its_type_gets_it() -> None:
    """LangChain's Azure integration writes calls without ``"type"``; Azure OpenAI refuses the
    history on every later turn ("Missing required parameter: …tool_calls[0].type")."""
    untyped = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "function": {"name": "grep", "arguments": "{}"}}],
    }
    custom = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c2", "custom": {"name": "patch", "input": "x"}}],
    }
    messages = [user("go"), untyped, tool("c1", "found"), custom, tool("c2", "ok"), user("next")]
    result = repair_messages(messages)
    assert result.messages[1]["tool_calls"] == [{**untyped["tool_calls"][0], "type": "function"}]
    assert result.messages[3] is custom  # a custom tool's call has no function type to add
    assert kinds(result) == [("missing_type", 1, "c1")]
    assert "type" not in untyped["tool_calls"][0]  # not mutated
    assert repair_messages(result.messages).repairs == []  # idempotent
    assert format_strict_error(diagnose(messages)) == (
        'cachegate strict pairing: 1 defect: messages[1] assistant tool_call c1 has no "type" '
        "(missing_type)"
    )


def test_an_empty_tool_calls_array_is_removed() -> None:
    """Some SDKs write ``"tool_calls": []`` on every plain answer; OpenAI refuses it with a 400
    (``empty_array``) the history then carries on every later turn."""
    empty = {"role": "assistant", "content": "Done.", "tool_calls": []}
    messages = [user("go"), empty, user("thanks")]
    with pytest.raises(ValidationError) as refused:
        validate_messages(messages)
    assert refused.value.code == "empty_array"
    assert refused.value.param == "messages[1].tool_calls"
    result = repair_messages(messages)
    assert result.messages == [
        user("go"),
        {"role": "assistant", "content": "Done."},
        user("thanks"),
    ]
    assert kinds(result) == [("empty_tool_calls", 1, None)]
    validate_messages(result.messages)
    assert empty == {"role": "assistant", "content": "Done.", "tool_calls": []}  # not mutated
    assert format_strict_error(diagnose(messages)) == (
        "cachegate strict pairing: 1 defect: messages[1] assistant message has an empty "
        "tool_calls array (empty_tool_calls)"
    )
    # with nothing else in it (a stream cut before its first token, by such an SDK), the
    # message stays with an empty content, as under empty_assistant: removed, it left two user
    # messages in a row, which strict chat templates refuse ("Conversation roles must
    # alternate": Gemma, Llama 2, Mistral 7B served by vLLM or llama.cpp) on every later turn
    for said in (None, "", []):
        bare = {"role": "assistant", "content": said, "tool_calls": []}
        result = repair_messages([user("go"), bare, user("again")])
        assert result.messages == [user("go"), {"role": "assistant", "content": ""}, user("again")]
        assert [(r.kind, r.index, r.action) for r in result.repairs] == [
            ("empty_tool_calls", 1, "removed an empty tool_calls array")
        ]
        validate_messages(result.messages)
        # for a Mistral model, the note (Mistral refuses "" there too)
        noted = repair_messages([user("go"), bare, user("again")], mistral=True).messages[1]
        assert noted == {"role": "assistant", "content": MISTRAL_NO_ANSWER}
        # for a Claude model, it goes: Claude refuses an empty assistant message ("all messages
        # must have non-empty content except for the optional final assistant message") and
        # joins the user turns around it
        result = repair_messages([user("go"), bare, user("again")], drop_empty=True)
        assert result.messages == [user("go"), user("again")]
        assert [(r.kind, r.index, r.action) for r in result.repairs] == [
            (
                "empty_tool_calls",
                1,
                "removed an assistant message with nothing but an empty tool_calls",
            )
        ]
        validate_claude_messages(result.messages)
    # a refusal is something said: the message stays, with an empty content
    refusal = {"role": "assistant", "content": None, "refusal": "No.", "tool_calls": []}
    assert repair_messages([user("go"), refusal]).messages[1] == {
        "role": "assistant",
        "content": "",
        "refusal": "No.",
    }
    # so is reasoning: a cut stream's reasoning_content stays, as in empty_assistant's repair
    for key in ("reasoning_content", "reasoning"):
        thought = {"role": "assistant", "content": None, key: "Let me see", "tool_calls": []}
        assert repair_messages([user("go"), thought, user("again")]).messages[1] == {
            "role": "assistant",
            "content": "",
            key: "Let me see",
        }
    # a result after it answers nothing: no block was opened
    assert kinds(repair_messages([user("go"), empty, tool("a")])) == [
        ("empty_tool_calls", 1, None),
        ("orphan_result", 2, "a"),
    ]


def test_a_call_and_its_result_with_a_number_for_an_id_stay_a_pair() -> None:
    """``"id": 7`` and ``"tool_call_id": 7`` (a local model's template, a hand-built history):
    the call got a new id and a synthetic "interrupted" result, and the real result went as a
    user message without its id: the model was told the tool had not run."""
    numbered = asst(call("7"))
    numbered["tool_calls"][0]["id"] = 7
    answer = {"role": "tool", "tool_call_id": 7, "name": "read", "content": "a.txt b.txt"}
    messages = [user("go"), numbered, answer, user("thanks")]
    assert needs_repair(messages)
    result = repair_messages(messages)
    assert result.messages == [
        user("go"),
        asst(call("7")),
        {**answer, "tool_call_id": "7"},
        user("thanks"),
    ]
    assert kinds(result) == [("missing_id", 1, "7"), ("missing_id", 2, "7")]
    validate_messages(result.messages)
    assert not needs_repair(result.messages)
    assert numbered["tool_calls"][0]["id"] == 7 and answer["tool_call_id"] == 7  # not mutated
    assert format_strict_error(diagnose(messages)) == (
        "cachegate strict pairing: 2 defects: messages[1] assistant tool_call id is a number, 7"
        ' (repair would write it as "7") (missing_id); messages[2] tool result\'s tool_call_id'
        ' is a number, 7 (repair would write it as "7") (missing_id)'
    )
    # a string result answers a number call, and a number beside its own string is a repeat
    assert repair_messages([user("go"), numbered, tool("7")]).messages[2] == tool("7")
    twice = asst(call("7"), call("7", "write"))
    twice["tool_calls"][0]["id"] = 7
    repaired = repair_messages([user("go"), twice, {**answer, "content": "x"}, tool("7")])
    renamed = repaired.messages[1]["tool_calls"][1]["id"]
    assert renamed.startswith("call_")
    assert [m.get("tool_call_id") for m in repaired.messages[2:]] == ["7", renamed]
    validate_messages(repaired.messages)
    # any JSON number: 7.0 (or 1e3) and 7 are one id; an integer past 64 bits, read as a double
    parsed = orjson.loads(b'[{"id":7.0},{"id":1e3},{"id":1208925819614629174706176},{"id":2.5}]')
    for number, answer_id, written in zip(
        [p["id"] for p in parsed],
        [7, 1000, parsed[2]["id"], 2.5],
        ["7", "1000", "1208925819614629174706176", "2.5"],
        strict=True,
    ):
        odd = asst(call(written))
        odd["tool_calls"][0]["id"] = number
        result = repair_messages([user("go"), odd, {**tool(written), "tool_call_id": answer_id}])
        assert result.messages[1:] == [asst(call(written)), tool(written)], number
        assert kinds(result) == [("missing_id", 1, written), ("missing_id", 2, written)]


def test_a_history_nested_as_deep_as_cachegate_reads_is_repaired() -> None:
    """A call without an id whose arguments are an object ~990 levels deep, or an orphan
    result whose content is: a RecursionError, answered 500 instead of repaired."""
    deep: Any = []
    for _ in range(990):
        deep = [deep]
    idless = asst(call(None))
    idless["tool_calls"][0]["function"]["arguments"] = deep
    result = repair_messages([user("go"), idless, user("next")])
    assert [r.kind for r in result.repairs] == ["missing_id", "dangling_call"]
    output: Any = {}
    for _ in range(990):
        output = {"a": output}
    orphan = repair_messages([user("go"), tool("x", output), user("next")])
    assert kinds(orphan) == [("orphan_result", 1, "x")]
    label, dumped = orphan.messages[1]["content"].split("\n", 1)
    assert label == "[tool result for call x (no matching tool call)]"
    assert dumped == '{"a": ' * 990 + "{}" + "}" * 990


def test_a_mark_is_not_moved_onto_what_is_not_a_message() -> None:
    """A removed message's cache mark went onto the entry before it, a ``null`` there: a
    TypeError, answered 500, where the provider would have said what is wrong."""
    mark = {"type": "ephemeral"}
    emptied = {"role": "assistant", "content": "", "tool_calls": [], "cache_control": mark}
    result = repair_messages(
        [user("go"), None, emptied, user("next")],  # type: ignore[list-item]
        drop_empty=True,  # (a Claude model's history, which has it removed)
    )
    assert result.messages == [user("go"), None, user("next")]
    assert kinds(result) == [("empty_tool_calls", 2, None)]


def test_an_assistant_message_with_no_content_and_no_tool_calls_gets_an_empty_one() -> None:
    """An interrupted stream leaves ``{"role": "assistant", "content": null}`` (the Vercel AI
    SDK writes one too); OpenAI refuses it ("expected a string, got null") on every later turn,
    and it was forwarded as it was. It gets ``""`` (not removed: the turns keep alternating, as
    strict chat templates require, and its reasoning and cache mark stay). Content ``""`` is
    content: left alone."""
    mark = {"type": "ephemeral"}
    for bare in (
        {"role": "assistant", "content": None},
        {"role": "assistant"},
        {"role": "assistant", "content": None, "tool_calls": None},
        {"role": "assistant", "content": None, "reasoning_content": "Let me see"},
    ):
        messages = [user("go"), bare, user("again")]
        with pytest.raises(ValidationError) as refused:
            validate_messages(messages)
        assert refused.value.param == "messages.[1].content"
        assert needs_repair(messages)
        result = repair_messages(messages)
        assert result.messages == [user("go"), {**bare, "content": ""}, user("again")]
        assert [(r.kind, r.index, r.action) for r in result.repairs] == [
            ("empty_assistant", 1, "gave an assistant message with no content an empty one")
        ]
        validate_messages(result.messages)
        assert format_strict_error(diagnose(messages)) == (
            "cachegate strict pairing: 1 defect: messages[1] assistant message has no content "
            "and no tool_calls (empty_assistant)"
        )
        assert bare.get("content") is None  # (not mutated)
        # its cache_control mark stays on it
        marked = repair_messages([user("go"), {**bare, "cache_control": mark}, user("again")])
        assert marked.messages[1] == {**bare, "cache_control": mark, "content": ""}
    for kept in (
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": None, "refusal": "No."},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "assistant", "content": None, "audio": {"id": "audio_1"}},
    ):
        messages = [user("go"), kept, user("again")]
        assert not needs_repair(messages)
        assert repair_messages(messages).messages is messages
        validate_messages(messages)
    # the check resumed from the previous turn's checkpoint finds one in the appended turn
    earlier = [user("go"), asst(content="ok"), user("more")]
    needed, after, _ = needs_repair_from(earlier)
    assert not needed and after is not None
    later = [*earlier, {"role": "assistant"}, user("on")]
    needed, _, resumed = needs_repair_from(later, [after])
    assert needed and resumed is after
    assert repair_messages(later).messages == [*earlier, asst(content=""), user("on")]


def test_a_mistral_history_gets_an_assistant_message_between_a_tool_result_and_the_user() -> None:
    """For a Mistral model (``mistral``): a user message right after a tool result (a synthetic
    one, the client's own, a downgraded orphan's) gets an assistant message before it, not an
    empty one (Mistral's validator for its v1-v3 tokenizers refuses that); ids cachegate gives are nine letters and digits. Deterministic, resumed
    as a whole repair, and what Mistral's checks and OpenAI's accept; another model's history
    is repaired as before."""
    idless = {"type": "function", "function": {"name": "run", "arguments": "{}"}}
    steer = [user("go"), asst(call("aaaaaaaa1")), tool("aaaaaaaa1"), user("now b")]
    interrupted = [user("go"), {"role": "assistant", "content": None, "tool_calls": [idless]}]
    interrupted.append(user("stop"))
    orphan = [user("go"), asst(call("aaaaaaaa2")), tool("aaaaaaaa2"), tool("gone00001")]
    orphan.append(user("next"))  # (the orphan, kept as a user message, follows a result)
    for history in (steer, interrupted, orphan):
        assert needs_repair(history, mistral=True)
        result = repair_messages(history, mistral=True)
        validate_messages(result.messages)
        assert mistral_refusal(result.messages) is None, result.messages
        assert repair_messages(history, mistral=True).messages == result.messages
        assert "user_after_tool" in [r.kind for r in result.repairs]
        assert repair_messages(result.messages, mistral=True).repairs == []
    assert repair_messages(steer).messages is steer  # (another model: nothing to repair)
    fixed = repair_messages(interrupted, mistral=True).messages
    given = fixed[1]["tool_calls"][0]["id"]
    assert len(given) == 9 and given.isalnum()
    assert [m["role"] for m in fixed] == ["user", "assistant", "tool", "assistant", "user"]
    assert fixed[3] == MISTRAL_BRIDGE and fixed[3]["content"]  # (v1-v3 refuse an empty one)
    # a system message there is left: Mistral refuses one after an assistant's too
    system = [*steer[:3], {"role": "system", "content": "be brief"}, user("now b")]
    assert repair_messages(system, mistral=True).messages is system
    (bridged,) = [r for r in repair_messages(steer, mistral=True).repairs]
    assert (bridged.kind, bridged.index) == ("user_after_tool", 3)
    text = format_strict_error(diagnose(steer, mistral=True))
    assert "messages[3] user message follows a tool result with no assistant message" in text
    # resumed next turn from the repair state: the same as a repair of the whole
    first, state = repair_messages_from(steer, None, mistral=True)
    later = [*steer, asst(content="b is fine"), user("thanks")]
    again, _ = repair_messages_from(later, state, mistral=True)
    assert again.messages == repair_messages(later, mistral=True).messages
    assert again.messages[: len(first.messages)] == first.messages
    sound = [user("go"), asst(call("aaaaaaaa1")), tool("aaaaaaaa1"), asst(content="done")]
    assert repair_messages([*sound, user("more")], mistral=True).repairs == []
    # an assistant message with no content is given the note, not "" (which Mistral refuses
    # as none: "must have either content or tool_calls"), the client's own "" too
    for blank in (asst(content=None), asst(content="")):
        history = [user("go"), blank, user("again")]
        assert needs_repair(history, mistral=True)
        fixed = repair_messages(history, mistral=True).messages
        assert mistral_refusal(fixed) is None, fixed
        assert fixed[1]["content"] == MISTRAL_BRIDGE["content"]
        assert repair_messages(history).messages[1].get("content") == ""  # (another model's)
    # a legacy function_call is nothing to Mistral; a prefill the client asked for is its own
    legacy = {**asst(content=None), "function_call": {"name": "f", "arguments": "{}"}}
    for history in (
        [user("go"), legacy, user("again")],
        [user("go"), {**legacy, "tool_calls": []}],
    ):
        fixed = repair_messages(history, mistral=True).messages
        assert fixed[1]["content"] == MISTRAL_BRIDGE["content"] and mistral_refusal(fixed) is None
    prefill = [user("go"), {"role": "assistant", "content": "", "prefix": True}]
    assert repair_messages(prefill, mistral=True).messages is prefill


@pytest.mark.parametrize(("sent", "answered"), [(7, "7"), ("7", 7), ("7", "7")])
def test_a_number_id_and_its_digits_as_a_string_stay_a_pair_for_mistral(
    sent: Any, answered: Any
) -> None:
    """A call's number id and its result's string of the same digits (or the other way) pair
    on every other model; for Mistral the number became nine digits and the string stayed:
    the real result went as an orphan and a synthetic one said the tool had not run. A string
    of fewer than nine digits is nine characters there too (Mistral refuses ``"7"``)."""
    call_ = {"id": sent, "type": "function", "function": {"name": "read", "arguments": "{}"}}
    history = [user("go"), asst(call_), {**tool(None, "the output"), "tool_call_id": answered}]
    history.append(asst(content="done"))
    assert needs_repair(history, mistral=True)
    result = repair_messages(history, mistral=True)
    assert [r.kind for r in result.repairs] == ["missing_id", "missing_id"]
    given = hashlib.sha256(b"7").hexdigest()[:9]
    assert result.messages[1]["tool_calls"][0]["id"] == given
    assert result.messages[2] == {**history[2], "tool_call_id": given}
    assert mistral_refusal(result.messages) is None, result.messages
    _resumed_as_whole(history[:2], history, result, "downgrade", mistral=True)


@pytest.mark.parametrize("ids", [("7", "07", "000000007"), ("1", "01", "001", "x")])
def test_ids_written_anew_for_mistral_never_become_another_calls(ids: tuple[str, ...]) -> None:
    """Written as their digits with zeros before them, "7" and "07" were one id (and a
    client's own "000000007" too): the results, matched in order, each went to another call.
    Each call keeps its own result. (A hash's nine can still meet a client's own nine, one
    chance in 2^36 a pair of ids: not looked for.)"""
    calls = [call(i, "read", f'{{"n": {n}}}') for n, i in enumerate(ids)]
    results = [tool(i, f"result {n}") for n, i in enumerate(ids)]
    history = [user("go"), asst(*calls), *reversed(results)]  # (in any order)
    result = repair_messages(history, mistral=True)
    assert mistral_refusal(result.messages) is None, result.messages
    given = [c["id"] for c in result.messages[1]["tool_calls"]]
    assert len(set(given)) == len(ids)
    answered = {m["tool_call_id"]: m["content"] for m in result.messages[2:]}
    assert [answered[g] for g in given] == [f"result {n}" for n in range(len(ids))]


def test_strict_mode_names_an_id_mistral_refuses_as_such() -> None:
    history = [user("go"), asst(call("call_abc")), tool("call_abc"), asst(content="ok")]
    text = format_strict_error(diagnose(history, mistral=True))
    assert "tool_call id call_abc is not nine letters and digits (Mistral refuses it" in text
    assert "is a number" not in text


@pytest.mark.parametrize("number", [0, 7, 123456789, 12345678901, -3, 2.5])
def test_a_number_id_is_written_as_nine_letters_and_digits_for_mistral(number: Any) -> None:
    """An id sent as a number was written as its digits (``"0"``) whatever the model: Mistral
    refuses any id but nine letters and digits (``Tool call id was 0 but must be a-z, A-Z, 0-9,
    with a length of 9``). For a Mistral model the call and its result get the same nine;
    another model's keep the digits."""
    call_ = {"id": number, "type": "function", "function": {"name": "read", "arguments": "{}"}}
    history = [user("read a"), asst(call_), tool(None, "hello"), user("and b?")]
    history[2]["tool_call_id"] = number
    result = repair_messages(history, mistral=True)
    given = result.messages[1]["tool_calls"][0]["id"]
    assert len(given) == 9 and given.isalnum()
    assert result.messages[2]["tool_call_id"] == given
    assert mistral_refusal(result.messages) is None, result.messages
    assert repair_messages(result.messages, mistral=True).repairs == []
    _resumed_as_whole(history[:2], history, result, "downgrade", mistral=True)
    assert repair_messages(history).messages[1]["tool_calls"][0]["id"] == str(number)


def test_an_openai_refusal_reads_as_its_words_for_mistral() -> None:
    """A session moved from GPT to Mistral: an OpenAI refusal (``content`` null, ``refusal``
    its words) was given the note "no answer was recorded", which told the model something
    false; its words are its content, as for Claude."""
    refusal = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    for history in (
        [user("x"), refusal, user("why?")],
        [user("x"), {**refusal, "tool_calls": []}, user("why?")],
    ):
        assert needs_repair(history, mistral=True)
        fixed = repair_messages(history, mistral=True).messages
        assert fixed[1]["content"] == "I can't help with that."
        assert mistral_refusal(fixed) is None, fixed


def test_call_ids_reused_across_turns_are_renamed_for_claude_alone() -> None:
    """Clients that number calls per message (``call_0`` every turn) reuse an id across turns:
    Claude refuses a request whose ``tool_use`` ids repeat anywhere (``tool_use ids must be
    unique``), every turn from the second on. For a Claude model a later call of a used id gets
    a stable id of its own, its results with it; another model's history is sent as it came.
    Turn by turn (resumed from the last turn's repair and check) as a whole."""
    history: list[Message] = [user("go")]
    for turn in range(3):
        history += [asst(call("call_0"), call("call_1"), content=f"step {turn}")]
        history += [tool("call_0", f"a{turn}"), tool("call_1", f"b{turn}"), user(f"next {turn}")]
    assert repair_messages(history).messages is history  # (OpenAI takes it)
    assert needs_repair(history, drop_empty=True)
    result = repair_messages(history, drop_empty=True)
    with pytest.raises(ValidationError, match=r"`tool_use` ids must be unique"):
        validate_claude_messages(history)
    validate_messages(result.messages)
    validate_claude_messages(result.messages)
    ids = [c["id"] for m in result.messages for c in m.get("tool_calls") or ()]
    assert ids[:2] == ["call_0", "call_1"] and len(set(ids)) == 6
    for block in (1, 5, 9):  # each result follows its own call, renamed with it
        calls = [c["id"] for c in result.messages[block]["tool_calls"]]
        assert [m["tool_call_id"] for m in result.messages[block + 1 : block + 3]] == calls
    assert [m.get("content") for m in result.messages] == [m.get("content") for m in history]
    assert [(r.kind, r.index) for r in result.repairs] == [
        ("duplicate_call_id", i) for i in (5, 5, 6, 7, 9, 9, 10, 11)
    ]
    assert "a call of an earlier assistant message has call_0" in result.repairs[0].action
    text = format_strict_error(diagnose(history, drop_empty=True))
    assert (
        "messages[5] assistant tool_call repeats the id call_0 of an earlier assistant message's"
        " call (Claude refuses it;" in text
    )
    assert repair_messages(result.messages, drop_empty=True).repairs == []
    assert kinds_of(diagnose(history, drop_empty=True)) == kinds_of(result.repairs)
    # turn by turn: the same repair, the same check
    state, checkpoint = None, None
    for end in (5, 9, len(history)):
        turn = history[:end]
        needed, checkpoint, _ = needs_repair_from(
            turn, [checkpoint] if checkpoint else [], drop_empty=True
        )
        assert needed == needs_repair(turn, drop_empty=True)
        repaired, state = repair_messages_from(turn, state, drop_empty=True)
        assert repaired.messages == repair_messages(turn, drop_empty=True).messages
    assert repaired.messages == result.messages


def test_drop_empty_removes_a_contentless_assistant_message_as_claude_needs() -> None:
    """With ``drop_empty`` (a Claude model's history) the contentless assistant message is
    removed, not given ``""`` (Claude refuses an empty one anywhere but last); its mark goes on
    the message before; one holding signed reasoning keeps it, given ``""`` (a gateway makes
    Claude's thinking blocks of it); a reasoning text alone, which a gateway cannot give Claude
    back (no signature: the message reached Claude empty, refused on every turn), does not. A
    state made with the other setting is not resumed from (the next turn's model may be
    another provider's)."""
    mark = {"type": "ephemeral"}
    bare = {"role": "assistant", "content": None, "cache_control": mark}
    messages = [user("go"), bare, user("again")]
    result, state = repair_messages_from(messages, None, drop_empty=True)
    assert result.messages == [{**user("go"), "cache_control": mark}, user("again")]
    assert [(r.kind, r.index) for r in result.repairs] == [("empty_assistant", 1)]
    assert result.repairs[0].action.startswith("removed an assistant message with no content")
    # resumed with the same setting: removed still; with the other: repaired afresh, kept
    later = [*messages, asst(content="ok"), user("more")]
    again, state = repair_messages_from(later, state, drop_empty=True)
    assert again.messages == [*result.messages, asst(content="ok"), user("more")]
    other, _ = repair_messages_from(later, state, drop_empty=False)
    assert other.messages[1] == {**bare, "content": ""}
    for key, value in (
        ("reasoning_details", [{"type": "reasoning.text", "text": "Let me", "signature": "x"}]),
        ("thinking_blocks", [{"type": "thinking", "thinking": "Let me", "signature": "x"}]),
    ):
        thinking = {"role": "assistant", "content": None, key: value}
        kept, _ = repair_messages_from([user("go"), thinking, user("again")], None, drop_empty=True)
        assert kept.messages[1] == {**thinking, "content": ""}
    for key in ("reasoning_content", "reasoning"):
        cut = {"role": "assistant", "content": None, key: "Let me see"}
        gone, _ = repair_messages_from([user("go"), cut, user("again")], None, drop_empty=True)
        assert gone.messages == [user("go"), user("again")]
        validate_claude_messages(gone.messages)
        with pytest.raises(ValidationError, match="must have non-empty content"):
            validate_claude_messages([user("go"), {**cut, "content": ""}, user("again")])


def test_a_refusal_in_a_history_sent_to_claude_becomes_its_content() -> None:
    """An OpenAI model's refusal (``"content": null``, ``"refusal": "…"``) in a history that
    then goes to a Claude model: Claude reads no ``refusal`` and refused the message as empty.
    For Claude its words become the content (also in one with an empty ``tool_calls``
    array); another model gets it as sent. The cheap check and strict mode's diagnosis agree."""
    said = "I can't help with that."
    refused = {"role": "assistant", "content": None, "refusal": said}
    messages = [user("do the thing"), refused, user("then explain why")]
    assert needs_repair(messages, drop_empty=True) and not needs_repair(messages)
    result = repair_messages(messages, drop_empty=True)
    assert result.messages == [messages[0], {**refused, "content": said}, messages[2]]
    assert [(r.kind, r.index) for r in result.repairs] == [("empty_assistant", 1)]
    assert [r.kind for r in diagnose(messages, drop_empty=True)] == ["empty_assistant"]
    assert repair_messages(messages).messages is messages
    emptied = [messages[0], {**refused, "tool_calls": []}, messages[2]]
    fixed = repair_messages(emptied, drop_empty=True).messages
    assert fixed[1] == {**refused, "content": said}
    # a blank refusal says nothing: removed, as any blank message for Claude
    blank = [messages[0], {**refused, "refusal": " "}, messages[2]]
    assert repair_messages(blank, drop_empty=True).messages == [messages[0], messages[2]]
    # a mark on one of its blank parts stays, on the part that holds the words; trailing
    # white space, which Claude refuses in a last assistant message, is not kept
    mark = {"type": "ephemeral"}
    parted = {
        **refused,
        "refusal": said + "\n",
        "content": [{"type": "text", "text": " ", "cache_control": mark}],
    }
    for history in ([messages[0], parted, messages[2]], [messages[0], parted]):
        got = repair_messages(history, drop_empty=True).messages[1]
        assert got["content"] == [{"type": "text", "text": said, "cache_control": mark}]


@pytest.mark.parametrize(
    "content", ["", "  \n", [], [{"type": "text", "text": ""}, {"type": "text", "text": " "}]]
)
def test_drop_empty_removes_a_blank_assistant_message_claude_refuses_too(content: Any) -> None:
    """Claude refuses an assistant message whose content is ``""``, white space or ``[]``
    anywhere but last, as one with none; a client writes one itself (the Vercel AI SDK, a
    stream cut before its first token): it got Claude's 400 every turn. For a Claude model it
    is removed wherever it is (an empty last one prefills nothing); for another model it is
    content, and stays. The cheap check and strict mode's diagnosis say so too."""
    blank = asst(content=content)
    messages = [user("go"), blank, user("again"), asst(content=content)]
    assert needs_repair(messages, drop_empty=True) and not needs_repair(messages)
    result = repair_messages(messages, drop_empty=True)
    assert result.messages == [user("go"), user("again")]
    assert [(r.kind, r.index) for r in result.repairs] == [
        ("empty_assistant", 1),
        ("empty_assistant", 3),
    ]
    assert repair_messages(messages).messages is messages
    assert [r.kind for r in diagnose(messages, drop_empty=True)] == ["empty_assistant"] * 2
    # resumed next turn: the same repair, and the checkpoint of one setting is not the other's
    _, after, _ = needs_repair_from(messages[:3], (), drop_empty=False)
    assert after is not None
    assert not needs_repair_from(messages[:3], [after], drop_empty=False)[0]
    assert needs_repair_from(messages[:3], (), drop_empty=True)[0]
    # with an empty tool_calls array too (that repair ran first, and kept a blank one)
    emptied = [user("go"), {**asst(content=content), "tool_calls": []}, user("again")]
    assert repair_messages(emptied, drop_empty=True).messages == [user("go"), user("again")]
    # a mark on one of its blank parts goes on the message before, as its own would
    mark = {"type": "ephemeral"}
    parted = {"role": "assistant", "content": [{"type": "text", "text": "", "cache_control": mark}]}
    moved = repair_messages([user("go"), parted, user("again")], drop_empty=True).messages
    assert moved == [{**user("go"), "cache_control": mark}, user("again")]
    signed = [{"type": "thinking", "thinking": "hm", "signature": "s"}]
    said = {**asst(content="  "), "thinking_blocks": signed}  # (it says something to Claude)
    kept = repair_messages([user("go"), said, user("on")], drop_empty=True)
    assert kept.messages[1] == {**said, "content": ""}  # (its blank text, a block, taken out)
    unsigned = {**asst(content="  "), "reasoning_content": "thinking"}  # (it says nothing there)
    assert kinds(repair_messages([user("go"), unsigned, user("on")], drop_empty=True)) == [
        ("empty_assistant", 1, None)
    ]


@pytest.mark.parametrize(
    ("content", "calls", "left"),
    [
        ([{"type": "text", "text": ""}, {"type": "text", "text": "hi"}], [], "hi"),
        ([{"type": "text", "text": ""}], True, None),
        ("  ", True, None),
        ([{"type": "text", "text": " "}, {"type": "text", "text": "on it"}], True, "on it"),
        ([{"type": "text", "text": ""}, {"type": "text", "text": "on it"}], False, "on it"),
    ],
)
def test_blank_text_beside_what_else_a_message_says_is_taken_out_for_claude(
    content: Any, calls: Any, left: str | None
) -> None:
    """A gateway makes each text part (and a content of white space) a text block of Claude's,
    which Claude refuses empty beside tool calls or other text as anywhere (``text content
    blocks must be non-empty``): a message that says something else kept it, and every later
    turn was refused. For a Claude model the blank text is taken out; a mark on it goes on
    the message; another model's history is left."""
    mark = {"type": "ephemeral"}
    if isinstance(content, list):
        content = [{**content[0], "cache_control": mark}, *content[1:]]
    message = asst(call("toolu_1"), content=content) if calls is True else asst(content=content)
    if calls == []:  # (an SDK's on every plain answer: that repair runs first)
        message["tool_calls"] = []
    history = [user("go"), message]
    if calls is True:
        history.append(tool("toolu_1"))
    history.append(user("on"))
    if isinstance(content, list):  # (Claude's refusal, as the simulator has it)
        with pytest.raises(ValidationError, match="text content blocks must"):
            validate_claude_messages(history)
    assert needs_repair(history, drop_empty=True) and needs_repair(history) == (calls == [])
    result = repair_messages(history, drop_empty=True)
    validate_messages(result.messages)
    validate_claude_messages(result.messages)
    fixed = result.messages[1]
    texts = [p["text"] for p in fixed["content"]] if isinstance(fixed["content"], list) else []
    assert texts == ([left] if left else [])
    assert fixed["content"] is not None or calls is True  # (OpenAI's form: "" beside no calls)
    if isinstance(content, list):
        assert fixed.get("cache_control") == mark
    kind = "empty_tool_calls" if calls == [] else "empty_assistant"
    assert [r.kind for r in result.repairs] == [kind]
    assert repair_messages(result.messages, drop_empty=True).repairs == []
    if calls != []:
        assert repair_messages(history).messages is history


def test_an_empty_assistant_messages_cache_mark_goes_on_the_message_before_it() -> None:
    """A removed empty assistant message took its client's ``cache_control`` breakpoint with it:
    Claude then cached nothing past the mark before (or nothing at all). The message before it
    ends the same prefix; one already marked keeps its own."""
    mark = {"type": "ephemeral"}
    bare = {"role": "assistant", "content": "", "tool_calls": [], "cache_control": mark}
    result = repair_messages([user("go"), bare, user("again")], drop_empty=True)
    assert result.messages == [{**user("go"), "cache_control": mark}, user("again")]
    (repair,) = result.repairs
    assert repair.action.endswith("(its cache_control moved to the message before)")
    validate_messages(result.messages)
    # after a repaired turn: on the synthetic result that ends it
    history = [user("go"), asst(call("c1")), bare, user("again")]
    result = repair_messages(history, drop_empty=True)
    assert result.messages[2] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": result.messages[2]["content"],
        "cache_control": mark,
    }
    # a message marked already keeps its own mark
    own = {"type": "ephemeral", "ttl": "1h"}
    result = repair_messages(
        [{**user("go"), "cache_control": own}, bare, user("again")], drop_empty=True
    )
    assert result.messages == [{**user("go"), "cache_control": own}, user("again")]
    # resumed from the previous request's repair (the next turn, the same objects), the same
    earlier = [user("go"), bare, user("again")]
    first, state = repair_messages_from(earlier, None, drop_empty=True)
    assert state is not None
    later = [*earlier, asst(content="ok"), user("more")]
    again, _ = repair_messages_from(later, state, drop_empty=True)
    assert again.messages == [*first.messages, asst(content="ok"), user("more")]
    assert again.messages[0] == {**user("go"), "cache_control": mark}
    # the mark of a message removed in an appended turn goes on that turn's message before it
    first, state = repair_messages_from(earlier, None, drop_empty=True)
    again, _ = repair_messages_from(
        [*earlier, asst(content="ok"), bare, user("more")], state, drop_empty=True
    )
    assert again.messages[-2] == {**asst(content="ok"), "cache_control": mark}


def test_a_moved_mark_is_said_only_where_it_moved_and_kept_under_a_new_system_prompt() -> None:
    """The repair said the mark moved where the message before kept its own (the removed one's
    was dropped); resumed under a system prompt with a new time, the mark moved onto the old
    prompt was lost (a fresh repair of the same messages kept it). (A Claude model's history,
    which has the message removed.)"""
    mark, own = {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}
    bare = {"role": "assistant", "content": "", "tool_calls": [], "cache_control": mark}
    result = repair_messages(
        [{**user("go"), "cache_control": own}, bare, user("again")], drop_empty=True
    )
    (repair,) = result.repairs
    assert repair.action == "removed an assistant message with nothing but an empty tool_calls"
    # right after the system block: the mark goes on the system message, and stays there when
    # the next turn comes under a new time
    first = [{"role": "system", "content": "time 10:00"}, bare, user("go")]
    _, state = repair_messages_from(first, None, drop_empty=True)
    later = [{"role": "system", "content": "time 10:01"}, *first[1:], asst(content="ok")]
    resumed, _ = repair_messages_from(later, state, drop_empty=True)
    assert resumed.messages == repair_messages(later, drop_empty=True).messages
    assert resumed.messages[0] == {"role": "system", "content": "time 10:01", "cache_control": mark}


def test_a_dropped_orphans_cache_mark_goes_on_the_message_before_it() -> None:
    """``orphan_policy = "drop"`` took a marked orphan's breakpoint with it (a Claude-style client
    that marks its latest message then asked nothing of the cache)."""
    mark = {"type": "ephemeral"}
    orphan = {**tool("zz", "stale"), "cache_control": mark}
    result = repair_messages([user("go"), asst(content="ok"), orphan], orphan_policy="drop")
    assert result.messages == [user("go"), {**asst(content="ok"), "cache_control": mark}]
    (repair,) = result.repairs
    assert (repair.kind, repair.action) == (
        "orphan_result",
        "dropped (its cache_control moved to the message before)",
    )
    # a mark on a content part counts too
    parts = {**tool("zz"), "content": [{"type": "text", "text": "x", "cache_control": mark}]}
    result = repair_messages([user("go"), parts], orphan_policy="drop")
    assert result.messages == [{**user("go"), "cache_control": mark}]


def test_a_result_without_an_id_away_from_its_calls_answers_nothing() -> None:
    messages = [user("go"), asst(call("")), user("steer"), tool("", "late")]
    result = repair_messages(messages)
    new_id = result.messages[1]["tool_calls"][0]["id"]
    assert result.messages[2:] == [
        synthetic(new_id),
        user("steer"),
        user("[tool result for call  (no matching tool call)]\nlate"),
    ]
    validate_messages(result.messages)


def test_results_without_ids_appended_on_the_next_turn_answer_the_calls_left_open() -> None:
    """The resumed repair must not keep the synthetic results of the turn before."""
    first = [user("go"), asst(call("", "read"), call("", "ls"))]
    result, state = repair_messages_from(first, None)
    assert [m["role"] for m in result.messages] == ["user", "assistant", "tool", "tool"]
    assert state is not None
    second = [*first, tool("", "R"), tool("", "L"), user("next")]
    resumed, _ = repair_messages_from(second, state)
    assert resumed.messages == repair_messages(second).messages
    assert [m["content"] for m in resumed.messages[2:]] == ["R", "L", "next"]


def test_same_call_at_another_position_gets_another_id() -> None:
    first = repair_messages([asst(call(None))]).messages[0]["tool_calls"][0]["id"]
    moved = repair_messages([user("go"), asst(call(None))]).messages[1]["tool_calls"][0]["id"]
    twice = repair_messages([asst(call(None), call(None))]).messages[0]["tool_calls"]
    assert first != moved
    assert twice[0]["id"] != twice[1]["id"]


def test_a_downgraded_result_keeps_its_cache_control_breakpoint() -> None:
    """A Claude-style client marks its latest message; an orphan or duplicate result so marked
    lost the mark in its downgrade, and the request asked nothing of the cache."""
    mark = {"type": "ephemeral", "ttl": "5m"}
    marked = {**tool("zzz", "output"), "cache_control": mark}
    out = repair_messages([user("go"), asst(content="ok"), marked])
    assert out.messages[2] == {
        "role": "user",
        "content": "[tool result for call zzz (no matching tool call)]\noutput",
        "cache_control": mark,
    }
    duplicate = repair_messages(
        [asst(call("a")), tool("a", "A"), {**tool("a", "again"), "cache_control": mark}]
    )
    assert duplicate.messages[2]["cache_control"] == mark
    assert "cache_control" not in repair_messages([user("go"), tool("x", "y")]).messages[1]


def test_a_downgraded_result_of_blank_parts_holds_no_empty_text_block() -> None:
    """A tool that printed nothing (``touch a``), its result written as parts: the orphan's or
    duplicate's downgrade kept its empty text part beside the label, and Claude refused the
    message on every later turn (``text content blocks must be non-empty``). A blank part's
    mark goes on the message."""
    mark = {"type": "ephemeral"}
    empty = [{"type": "text", "text": ""}]
    orphan = {**tool("cz"), "content": empty}
    out = repair_messages([user("go"), asst(content="ok"), orphan], drop_empty=True)
    assert out.messages[2] == {
        "role": "user",
        "content": [{"type": "text", "text": "[tool result for call cz (no matching tool call)]"}],
    }
    validate_claude_messages(out.messages)
    marked = {**tool("a"), "content": [{"type": "text", "text": " ", "cache_control": mark}]}
    twice = repair_messages([asst(call("a")), tool("a", "A"), marked], drop_empty=True)
    assert twice.messages[2]["cache_control"] == mark
    assert all(p["text"].strip() for p in twice.messages[2]["content"])
    validate_claude_messages(twice.messages)


def test_blank_text_parts_of_a_result_a_user_or_a_system_message_are_taken_out_for_claude() -> None:
    """An MCP tool that printed nothing (its result a list of one empty text part), an image
    sent with an empty caption, a system prompt built of parts one of which is empty: Claude
    refuses an empty text block in any message (``text content blocks must be non-empty``), and
    refused every later turn of the session. For a Claude model the blank parts are taken out
    (a result left with none says ``(no output)``), a mark of theirs going on the message;
    another provider's model gets them as sent (OpenAI takes them)."""
    mark = {"type": "ephemeral"}
    blank = {"type": "text", "text": ""}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}
    system = {
        "role": "system",
        "content": [{"type": "text", "text": "You are a coder."}, {**blank, "text": " \n"}],
    }
    history = [
        system,
        {"role": "user", "content": [blank, image]},
        asst(call("a", "touch"), call("b", "cat")),
        tool("a", [{**blank, "cache_control": mark}]),
        tool("b", [{"type": "text", "text": "x = 1"}, blank]),
        user("go on"),
    ]
    with pytest.raises(ValidationError, match="text content blocks must"):
        validate_claude_messages(history)
    result = repair_messages(history, drop_empty=True)
    out = result.messages
    validate_claude_messages(out)
    assert out[0] == {**system, "content": system["content"][:1]}
    assert out[1] == {"role": "user", "content": [image]}
    assert out[2] is history[2] and out[5] is history[5]
    assert out[3] == {
        "role": "tool",
        "tool_call_id": "a",
        "content": NO_OUTPUT,
        "cache_control": mark,
    }
    assert out[4] == {
        "role": "tool",
        "tool_call_id": "b",
        "content": [{"type": "text", "text": "x = 1"}],
    }
    assert [(r.kind, r.index, r.tool_call_id) for r in result.repairs] == [
        ("blank_text", 0, None),
        ("blank_text", 1, None),
        ("blank_text", 3, "a"),
        ("blank_text", 4, "b"),
    ]
    assert needs_repair(history, drop_empty=True) and not needs_repair(out, drop_empty=True)
    assert repair_messages(out, drop_empty=True).messages is out  # (idempotent)
    said = format_strict_error(diagnose(history, drop_empty=True))
    assert "messages[3] has a text part of no text" in said and "(blank_text)" in said
    # a displaced result is moved back and its blank parts taken out
    displaced = [asst(call("a")), user("wait"), tool("a", [blank])]
    moved = repair_messages(displaced, drop_empty=True).messages
    assert moved[1] == {"role": "tool", "tool_call_id": "a", "content": NO_OUTPUT}
    validate_claude_messages(moved)
    # OpenAI's and Gemini's (white space is text to Gemini) models: as sent
    for options in ({}, {"drop_empty": True, "blank_spaces": False}):
        assert not needs_repair(history, **options)
        assert repair_messages(history, **options).messages is history
    # a user or system message of nothing but blank parts is the client's: left as sent
    empty_user = [user("a"), asst(content="b"), {"role": "user", "content": [blank]}]
    assert not needs_repair(empty_user, drop_empty=True)


def test_blank_text_parts_in_a_new_system_prompt_are_taken_out_on_a_resumed_turn() -> None:
    """The time in the system prompt, in a part beside an empty one: each turn a new system
    block, which the resumed check and repair passed over unread (nothing in a system block
    was theirs). Each turn's blank part is taken out, and the resumed repair equals a whole
    one; one without a blank part after it resumes as before."""
    blank = {"type": "text", "text": ""}
    history = [user("go"), asst(call("a")), tool("a", "done"), asst(call("b"))]  # b: interrupted
    state = None
    checkpoints: list[Any] = []
    for minute in range(4):
        prompt = {"role": "system", "content": [{"type": "text", "text": f"10:0{minute}"}]}
        if minute in (1, 2):
            prompt["content"].append(blank)
        turn = [prompt, *history, user(f"turn {minute}")]
        needed, after, _ = needs_repair_from(turn, checkpoints, drop_empty=True, unique_ids=True)
        assert needed
        checkpoints = [after] if after is not None else checkpoints
        result, state = repair_messages_from(turn, state, drop_empty=True, unique_ids=True)
        whole = repair_messages(turn, drop_empty=True, unique_ids=True)
        assert result.messages == whole.messages and result.repairs == whole.repairs
        validate_claude_messages(result.messages)
        kinds = [r.kind for r in result.repairs]
        assert kinds == (["blank_text", "dangling_call"] if minute in (1, 2) else ["dangling_call"])
    # the check alone: a checkpoint past a system prompt without blank parts does not pass over
    # a new one that has one
    answered = [user("go"), asst(call("a")), tool("a", "done")]
    plain = [{"role": "system", "content": [{"type": "text", "text": "10:00"}]}, *answered]
    needed, after, _ = needs_repair_from(plain, [], drop_empty=True, unique_ids=True)
    assert not needed and after is not None
    marked = [{"role": "system", "content": [{"type": "text", "text": "10:01"}, blank]}, *answered]
    assert needs_repair_from(marked, [after], drop_empty=True, unique_ids=True)[0]


@pytest.mark.parametrize("claude", [False, True])
def test_ids_the_repair_gives_stay_when_a_leading_message_is_added(claude: bool) -> None:
    """Calls without ids (Gemini's) or numbered per message (``call_0`` every turn, which a
    Claude model's repair renames): the ids were derived from each call's index in the whole
    list, so an environment message put after the system prompt on a later turn changed every
    one of them, and with them the prefix the provider had cached and a compaction's covered
    prefix (a new summary bought). They are counted past the leading system messages."""
    history = [user("Fix the failing test")]
    for n in range(3):
        sent = "call_0" if claude else None
        history += [asst(call(sent, arguments=f'{{"n": {n}}}')), tool(sent, f"out {n}")]
    system = {"role": "system", "content": "You are a coding agent."}
    env = {"role": "developer", "content": "Environment: cwd=/repo"}
    before = repair_messages([system, *history], drop_empty=claude)
    after = repair_messages([system, env, *history], drop_empty=claude)
    assert before.repairs and len(before.repairs) == len(after.repairs)
    assert after.messages[2:] == before.messages[1:]  # (the same ids, the same messages)
    assert [r.tool_call_id for r in after.repairs] == [r.tool_call_id for r in before.repairs]


def test_orphan_policy_drop_removes_orphans_and_duplicates() -> None:
    messages = [asst(call("a")), tool("a", "A"), tool("a", "again"), user("s"), tool("x", "X")]
    result = repair_messages(messages, orphan_policy="drop")
    assert result.messages == [asst(call("a")), tool("a", "A"), user("s")]
    assert [(r.kind, r.index, r.action) for r in result.repairs] == [
        ("duplicate_result", 2, "dropped"),
        ("orphan_result", 4, "dropped"),
    ]


def test_interrupted_note_is_configurable_with_the_tool_name() -> None:
    result = repair_messages([asst(call("a", "grep"))], interrupted_note="{name} was cancelled")
    assert result.messages[1] == {
        "role": "tool",
        "tool_call_id": "a",
        "content": "grep was cancelled",
    }
    empty = repair_messages([asst(call("a", "grep"))], interrupted_note="")
    assert empty.messages[1] == synthetic("a", "grep")


def test_default_note_says_interrupted_maybe_run_in_part_not_a_failure_check_and_retry() -> None:
    """A proxy cannot know whether an interrupted tool ran: the note must not say it did not."""
    note = DEFAULT_INTERRUPTED_NOTE.lower()
    for phrase in (
        "interrupted",
        "no result exists",
        "may not have run, or may have run only in part",
        "not a tool failure",
        "check what the tool would have changed, then call it again",
    ):
        assert phrase in note
    assert "did not run" not in note


def test_invalid_arguments_action_gives_length_and_keeps_no_original_text() -> None:
    arguments = '{"path": "secret.txt", "content": "abc'
    result = repair_messages([asst(call("a", "write", arguments)), tool("a")])
    (repair,) = result.repairs
    assert f"{len(arguments)} chars" in repair.action
    assert "truncated" in repair.action
    assert "secret" not in orjson.dumps(result.messages).decode()


def test_mixed_defects_in_one_history() -> None:
    messages = [
        {"role": "system", "content": "sys"},  # 0
        user("fix the bug"),  # 1
        asst(call("a", "read"), call("b", "write", '{"path": "m.py", "te'), content="on it"),  # 2
        tool("a", "file text"),  # 3
        user("also run the tests"),  # 4 steer typed while tools ran
        tool("b", "written"),  # 5 displaced
        tool("b", "written again"),  # 6 duplicate
        asst(call("c", "test")),  # 7 interrupted: no result
        user("stop"),  # 8
        tool("zzz", [{"type": "text", "text": "late"}]),  # 9 orphan
        asst(call("d", "read"), call("e", "grep")),  # 10 history ends with tool_calls
    ]
    result = repair_messages(messages)
    assert result.messages == [
        {"role": "system", "content": "sys"},
        user("fix the bug"),
        asst(call("a", "read"), call("b", "write", "{}"), content="on it"),
        tool("a", "file text"),
        tool("b", "written"),
        user("also run the tests"),
        user("[duplicate tool result for call b]\nwritten again"),
        asst(call("c", "test")),
        synthetic("c", "test"),
        user("stop"),
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "[tool result for call zzz (no matching tool call)]"},
                {"type": "text", "text": "late"},
            ],
        },
        asst(call("d", "read"), call("e", "grep")),
        synthetic("d", "read"),
        synthetic("e", "grep"),
    ]
    assert kinds(result) == [
        ("invalid_arguments", 2, "b"),
        ("displaced_result", 5, "b"),
        ("duplicate_result", 6, "b"),
        ("dangling_call", 7, "c"),
        ("orphan_result", 9, "zzz"),
        ("dangling_call", 10, "d"),
        ("dangling_call", 10, "e"),
    ]
    unchanged = (0, 1, 3, 4, 5, 7, 8, 10)
    assert all(any(m is messages[i] for m in result.messages) for i in unchanged)
    validate_messages(result.messages)


def test_valid_history_comes_back_as_the_same_object() -> None:
    messages = [
        {"role": "system", "content": "sys"},
        user("go"),
        asst(call("a"), call("b")),
        tool("b", "B"),
        tool("a", "A"),
        asst(content="done"),
        user("again"),
        asst(call("a")),  # ids reused across turns, as some servers do
        tool("a", "A2"),
    ]
    assert not needs_repair(messages)
    result = repair_messages(messages)
    assert result.messages is messages
    assert result.repairs == []
    assert not result.changed
    assert diagnose(messages) == []


def test_repeated_call_id_in_one_message_is_made_unique_one_result_per_call() -> None:
    """Some frameworks number calls per message and repeat an id (``call_0`` twice): Claude
    refuses such a message ("tool_use ids must be unique"), and the synthetic result for the
    unanswered one repeated it a third time. The repeat gets an id of its own, and the results
    are matched to the calls in order."""
    messages = [asst(call("a"), call("a")), tool("a", "1")]
    result = repair_messages(messages)
    (renamed,) = [r.tool_call_id for r in result.repairs if r.kind == "duplicate_call_id"]
    assert renamed is not None and renamed.startswith("call_")
    assert result.messages == [
        asst(call("a"), call(renamed)),
        tool("a", "1"),
        synthetic(renamed),
    ]
    assert kinds(result) == [("duplicate_call_id", 0, renamed), ("dangling_call", 0, renamed)]
    validate_messages(result.messages)
    assert repair_messages(result.messages).repairs == []  # idempotent
    # both answered, in order: the second result answers the second call
    answered = [asst(call("a"), call("a")), tool("a", "1"), tool("a", "2"), user("next")]
    again = repair_messages(answered)
    assert again.messages == [
        asst(call("a"), call(renamed)),
        tool("a", "1"),
        tool(renamed, "2"),
        user("next"),
    ]
    assert kinds(again) == [("duplicate_call_id", 0, renamed), ("duplicate_call_id", 2, renamed)]
    assert repair_messages(answered).messages == again.messages  # the same id every time
    moved = repair_messages([*answered[:2], user("wait"), tool("a", "2"), user("next")])
    assert moved.messages[:4] == [*again.messages[:3], user("wait")]
    assert ("displaced_result", 3, renamed) in kinds(moved)


def test_strict_error_lists_every_defect() -> None:
    messages = [user("go"), asst(call("a")), user("s"), tool("x", "X"), asst(call(None))]
    text = format_strict_error(diagnose(messages))
    new_id = repair_messages(messages).repairs[-1].tool_call_id
    assert text == (
        "cachegate strict pairing: 4 defects: "
        "messages[1] assistant tool_call a has no result (dangling_call); "
        "messages[3] tool result for x answers no tool call (orphan_result); "
        f"messages[4] assistant tool_call has no id (repair would assign {new_id}) (missing_id); "
        f"messages[4] assistant tool_call {new_id} has no result (dangling_call)"
    )
    assert format_strict_error([Repair("duplicate_result", 2, "a", "dropped")]) == (
        "cachegate strict pairing: 1 defect: "
        "messages[2] tool result for a repeats an earlier result (duplicate_result)"
    )


def test_strict_error_names_the_id_a_client_repeated_and_where() -> None:
    """Two calls of one message with one id, and their results: the 400 named only the id
    repair would assign, one the client never saw, and said "a call, or a result answering
    it" of each; the id the client sent was nowhere. A result without an id likewise."""
    messages = [
        user("go"),
        asst(call("call_0"), call("call_0", "write")),
        tool("call_0", "1"),
        tool("call_0", "2"),
        asst(call(None)),
        {"role": "tool", "content": "3"},
        user("next"),
    ]
    repairs = diagnose(messages)
    new_id = repairs[0].tool_call_id
    text = format_strict_error(repairs)
    assert (
        f"messages[1] assistant tool_calls repeat the id call_0 (repair would give the repeat"
        f" {new_id}) (duplicate_call_id)" in text
    )
    assert (
        f"messages[3] tool result for call_0 answers a call whose id repeats an earlier call's"
        f" (repair would give it {new_id}) (duplicate_call_id)" in text
    )
    assert "messages[5] tool result has no tool_call_id" in text


def test_diagnose_changes_nothing() -> None:
    messages = [asst(call("a", arguments="{")), user("s"), tool("a")]
    before = copy.deepcopy(messages)
    assert [r.kind for r in diagnose(messages)] == ["invalid_arguments", "displaced_result"]
    assert messages == before


def test_needs_repair_agrees_with_the_provider_on_plain_defects() -> None:
    assert needs_repair([asst(call("a"))])
    assert needs_repair([user("go"), tool("a")])
    assert needs_repair([asst(call("a")), user("s"), tool("a")])
    assert needs_repair([asst(call("a")), tool("a"), tool("a")])
    assert needs_repair([asst(call("a", arguments='{"x": ')), tool("a")])
    assert needs_repair([asst(call(None)), tool(None)])
    assert not needs_repair([asst(call("a")), tool("a"), user("thanks")])


# ---------------------------------------------------------------------------------------------
# Random histories

IDS = ("a", "b", "c", "d")
NAMES = ("read", "write", "grep")


@st.composite
def random_histories(draw: st.DrawFn) -> list[Message]:
    """Any mix of user, assistant and tool messages over a few reused ids: every defect at once."""
    calls = st.builds(
        lambda call_id, name, good, n: call(
            call_id, name, f'{{"n": {n}}}' if good else f'{{"n": "{n}'
        ),
        st.one_of(st.none(), st.just(""), st.sampled_from(IDS)),
        st.sampled_from(NAMES),
        st.booleans(),
        st.integers(0, 9),
    )
    kinds_ = draw(
        st.lists(
            st.sampled_from(["user", "text", "calls", "tool", "tool", "tool", "empty"]),
            min_size=0,
            max_size=24,
        )
    )
    messages: list[Message] = [user("u-start")]
    for i, kind in enumerate(kinds_):
        if kind == "user":
            messages.append(user(f"u{i}"))
        elif kind == "text":
            messages.append(asst(content=f"t{i}"))
        elif kind == "empty":
            messages.append({**asst(content=f"t{i}"), "tool_calls": []})
        elif kind == "calls":
            messages.append(asst(*draw(st.lists(calls, min_size=1, max_size=3)), content=f"t{i}"))
        else:
            call_id = draw(st.one_of(st.sampled_from(IDS), st.just("zz"), st.none(), st.just("")))
            shape = draw(st.sampled_from(["text", "parts", "null", "none"]))
            content: Any = f"o{i}" if shape == "text" else None
            if shape == "parts":
                content = [{"type": "text", "text": f"o{i}"}]
            messages.append(tool(call_id, content))
            if shape == "none":  # (a result written without its content: a tool that gave None)
                del messages[-1]["content"]
    return messages


@st.composite
def damaged_histories(draw: st.DrawFn) -> tuple[list[Message], bool]:
    """A realistic valid agent history, then a few typical defects; returns it and 'was damaged'."""
    messages: list[Message] = [{"role": "system", "content": "sys"}]
    for turn in range(draw(st.integers(1, 5))):
        messages.append(user(f"u{turn}"))
        for step in range(draw(st.integers(0, 3))):
            n = draw(st.integers(1, 3))
            # ids restart every step, as servers numbering calls call_0, call_1 ... do
            ids = [f"call_{k}" for k in range(n)]
            messages.append(asst(*(call(i, "read", f'{{"s": {step}}}') for i in ids)))
            order = draw(st.permutations(ids))
            messages.extend(tool(i, f"o{turn}.{step}.{i}") for i in order)
        messages.append(asst(content=f"t{turn}"))
    valid = copy.deepcopy(messages)
    defects = draw(
        st.lists(
            st.sampled_from(["drop", "orphan", "displace", "duplicate", "args", "no_id", "cut"]),
            max_size=4,
        )
    )
    for defect in defects:
        tools = [i for i, m in enumerate(messages) if m["role"] == "tool"]
        assistants = [i for i, m in enumerate(messages) if m.get("tool_calls")]
        if defect == "drop" and tools:
            del messages[draw(st.sampled_from(tools))]
        elif defect == "orphan":
            at = draw(st.integers(1, len(messages)))
            messages.insert(at, tool("ghost", f"g{at}"))
        elif defect == "displace" and tools:
            j = draw(st.sampled_from(tools))
            moved = messages.pop(j)
            messages.insert(j, user(f"steer{j}"))
            messages.insert(draw(st.integers(j + 1, len(messages))), moved)
        elif defect == "duplicate" and tools:
            j = draw(st.sampled_from(tools))
            dup = {**messages[j], "content": f"dup{j}"}
            messages.insert(draw(st.integers(j + 1, len(messages))), dup)
        elif defect == "args" and assistants:
            a = draw(st.sampled_from(assistants))
            calls = copy.deepcopy(messages[a]["tool_calls"])
            calls[0]["function"]["arguments"] = calls[0]["function"]["arguments"][:-2]
            messages[a] = {**messages[a], "tool_calls": calls}
        elif defect == "no_id" and assistants:
            a = draw(st.sampled_from(assistants))
            calls = copy.deepcopy(messages[a]["tool_calls"])
            calls[-1].pop("id", None)
            messages[a] = {**messages[a], "tool_calls": calls}
        elif defect == "cut" and assistants:
            del messages[draw(st.sampled_from(assistants)) + 1 :]
    return messages, messages != valid


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [part["text"] for part in content if isinstance(part, dict) and "text" in part]
    return []


def _check_properties(messages: list[Message], policy: Any) -> PairingResult:
    before = copy.deepcopy(messages)
    result = repair_messages(messages, orphan_policy=policy)
    out = result.messages

    assert messages == before, "input mutated"
    validate_messages(out)
    assert not needs_repair(out)
    again = repair_messages(out, orphan_policy=policy)
    assert again.messages is out and again.repairs == [], "not idempotent"
    twin = repair_messages(copy.deepcopy(messages), orphan_policy=policy)
    assert orjson.dumps(twin.messages) == orjson.dumps(out), "not deterministic"
    assert twin.repairs == result.repairs
    assert kinds_of(diagnose(messages)) == kinds_of(result.repairs)

    assert result.changed == (out is not messages)
    assert _accepted(messages) == (not result.repairs), (
        "repaired a valid history or missed a defect"
    )
    if not needs_repair(messages):
        assert out is messages and result.repairs == []

    touched = {r.index for r in result.repairs}
    for i, message in enumerate(messages):
        if i not in touched:
            assert any(m is message for m in out), f"messages[{i}] was copied though untouched"

    out_texts = [t for m in out for t in _texts(m.get("content"))]
    removed = {r.index for r in result.repairs if r.action.startswith("dropped")}
    for i, message in enumerate(messages):
        if i in removed:
            continue
        for text in _texts(message.get("content")):
            found = any(o == text or o.endswith("\n" + text) for o in out_texts)
            assert found, f"content of messages[{i}] lost"
    non_tool_in = [m.get("content") for m in messages if m["role"] != "tool"]
    non_tool_out = [m.get("content") for m in out if m["role"] != "tool" and not _downgraded(m)]
    assert non_tool_out == non_tool_in, "user/assistant messages lost or reordered"
    return result


def _downgraded(message: Message) -> bool:
    texts = _texts(message.get("content"))
    return bool(texts) and texts[0].startswith(DOWNGRADE_PREFIXES)


def _accepted(messages: list[Message]) -> bool:
    """The provider's check, plus the three defects it cannot see: missing ids, an id repeated
    by calls of one message (Claude refuses it; the simulator, as OpenAI, answers each) and bad
    arguments."""
    try:
        validate_messages(messages)
    except ValidationError:
        return False
    for m in messages:
        ids = [c.get("id") for c in m.get("tool_calls") or []]
        if len(set(ids)) < len(ids):
            return False
        for c in m.get("tool_calls") or []:
            if not c.get("id"):
                return False
            try:
                orjson.loads(c["function"]["arguments"])
            except orjson.JSONDecodeError:
                return False
    return True


@settings(max_examples=300, deadline=None)
@given(random_histories(), st.sampled_from(["downgrade", "drop"]))
@example(
    [
        user("u-start"),
        asst(call("c", "read", '{"n": 0}'), call("c", "read", '{"n": 0}'), content="t0"),
        tool("c", "o1"),
        tool("c", "o2"),
    ],
    "downgrade",
)  # (an id repeated in one message, each call answered: the one defect; CI found it)
def test_random_histories_satisfy_every_property(messages: list[Message], policy: Any) -> None:
    _check_properties(messages, policy)


@settings(max_examples=300, deadline=None)
@given(damaged_histories(), st.sampled_from(["downgrade", "drop"]))
def test_damaged_agent_histories_satisfy_every_property(
    damaged: tuple[list[Message], bool], policy: Any
) -> None:
    messages, was_damaged = damaged
    result = _check_properties(messages, policy)
    if not was_damaged:
        assert result.messages is messages


@settings(max_examples=300, deadline=None)
@given(random_histories(), random_histories(), st.sampled_from(["downgrade", "drop"]))
def test_random_histories_repaired_for_mistral_keep_its_order_resumed_or_not(
    first: list[Message], appended: list[Message], policy: Any
) -> None:
    """For a Mistral model: the repaired history has an assistant message after every run of
    tool results that another message follows (what Mistral checks; the ids are the
    client's), is accepted as OpenAI's, needs no more repair, and the cheap check, strict
    mode's diagnosis, the check resumed from a checkpoint and the repair resumed from the last
    turn's state all agree with a repair of the whole."""
    later = [*first, *appended]
    result = repair_messages(later, orphan_policy=policy, mistral=True)
    validate_messages(result.messages)
    refused = mistral_refusal(result.messages)
    assert refused is None or refused["message"].startswith(
        "Unexpected role 'system'"  # (a system message there: documented, left)
    ), refused
    if policy == "downgrade":  # (strict mode's diagnosis: an orphan kept needs its bridge)
        assert kinds_of(diagnose(later, mistral=True)) == kinds_of(result.repairs)
    _resumed_as_whole(first, later, result, policy, mistral=True)


def _resumed_as_whole(
    first: list[Message], later: list[Message], result: PairingResult, policy: Any, **mode: bool
) -> None:
    """The cheap check resumed from ``first``'s checkpoint, and the repair resumed from its
    state, answer for ``later`` as ``result``, its whole repair, in the same ``mode``."""
    assert repair_messages(result.messages, orphan_policy=policy, **mode).repairs == []
    assert needs_repair(later, **mode) == bool(result.repairs)
    _, checkpoint, _ = needs_repair_from(first, (), **mode)
    resumed = needs_repair_from(later, [checkpoint] if checkpoint else [], **mode)[0]
    assert resumed == bool(result.repairs)
    _, state = repair_messages_from(first, None, orphan_policy=policy, **mode)
    again, _ = repair_messages_from(later, state, orphan_policy=policy, **mode)
    assert orjson.dumps(again.messages) == orjson.dumps(result.messages)
    assert kinds_of(again.repairs) == kinds_of(result.repairs)


@settings(max_examples=300, deadline=None)
@given(random_histories(), random_histories(), st.sampled_from(["downgrade", "drop"]))
def test_random_histories_repaired_for_claude_have_unique_ids_resumed_or_not(
    first: list[Message], appended: list[Message], policy: Any
) -> None:
    """For a Claude model (``drop_empty``): no call id of the repaired history repeats one
    before it, it needs no more repair, and the cheap check, the check resumed from a
    checkpoint and the repair resumed from the last turn's state agree with a whole repair."""
    later = [*first, *appended]
    result = repair_messages(later, orphan_policy=policy, drop_empty=True)
    validate_messages(result.messages)
    ids = [c.get("id") for m in result.messages for c in m.get("tool_calls") or ()]
    assert len(ids) == len(set(ids)), ids
    _resumed_as_whole(first, later, result, policy, drop_empty=True)


def _call_ids(messages: list[Message]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or [] if c.get("id")}


@settings(max_examples=300, deadline=None)
@given(random_histories(), st.data())
def test_extending_a_history_keeps_its_repaired_prefix(
    messages: list[Message], data: st.DataObject
) -> None:
    cut = data.draw(st.integers(1, len(messages)))
    old, new = messages[:cut], messages[cut:]
    repaired_old = repair_messages(old).messages
    repaired_all = repair_messages(messages).messages
    answered_later = {m.get("tool_call_id") for m in new if m["role"] == "tool"} & _call_ids(old)
    # results without an id right after the cut may answer the last block's calls without one
    leading = itertools.takewhile(lambda m: m["role"] == "tool", new)
    last = next((m for m in reversed(old) if m["role"] != "tool"), {})
    idless_later = any(not m.get("tool_call_id") for m in leading) and any(
        not c.get("id") for c in last.get("tool_calls") or []
    )
    if not answered_later and not idless_later:
        assert repaired_all[: len(repaired_old)] == repaired_old
        return
    # a later result may answer a call that had a synthetic result: only that block may change
    blocks = [i for i, m in enumerate(repaired_old) if m.get("tool_calls")]
    first = next(
        (
            i
            for i in blocks
            if any(c.get("id") in answered_later for c in repaired_old[i]["tool_calls"])
        ),
        len(repaired_old),
    )
    if idless_later:
        first = min(first, blocks[-1])
    assert repaired_all[: first + 1] == repaired_old[: first + 1]


def _time_needs_repair() -> None:
    """Timing sanity check, run by hand: ``python -m tests.test_pairing``."""
    import timeit

    messages: list[Message] = [{"role": "system", "content": "s" * 20_000}]
    for turn in range(100):
        messages.append(user(f"please do step {turn} " + "x" * 1_000))
        args = orjson.dumps({"path": f"src/mod{turn}.py", "text": "y" * 400}).decode()
        messages.append(asst(call(f"call_{turn}_0", "write", args), content="working"))
        messages.append(tool(f"call_{turn}_0", "z" * 3_000))
        messages.append(asst(content="done " + "w" * 800))
    body = orjson.dumps({"model": "m", "messages": messages})
    assert not needs_repair(messages)
    runs = 2_000
    seconds = timeit.timeit(lambda: needs_repair(messages), number=runs) / runs
    whole = timeit.timeit(lambda: repair_messages(messages), number=runs) / runs
    print(f"{len(messages)} messages, {len(body) / 1024:.0f} KB body")
    print(f"needs_repair: {seconds * 1e6:.1f} µs; repair_messages (valid): {whole * 1e6:.1f} µs")
    broken = [*messages[:-2], user("steer"), messages[-2]]  # a result displaced by a steer
    once = timeit.timeit(lambda: repair_messages(broken), number=200) / 200
    print(f"repair_messages with defects: {once * 1e6:.1f} µs")


if __name__ == "__main__":
    _time_needs_repair()


@settings(max_examples=300, deadline=None)
@given(random_histories(), random_histories(), st.integers(min_value=0, max_value=40))
def test_the_check_resumed_from_a_checkpoint_answers_as_a_full_check(
    first: list[Message], appended: list[Message], cut: int
) -> None:
    # Turn N is checked; turn N+1 resends the same message objects (prefix sharing) and more.
    earlier = first[: cut % (len(first) + 1)]
    _, checkpoint, _ = needs_repair_from(earlier)
    later = earlier + appended
    kept = [checkpoint] if checkpoint else []
    resumed, after, used = needs_repair_from(later, kept)
    assert resumed == needs_repair(later)
    assert used is checkpoint  # resumed whenever the earlier turn had a checkpoint
    assert after is None or after.messages == tuple(later)
    # A history that only looks like the checkpointed one (equal, not the same objects) is
    # checked from the start.
    copied = [dict(m) if isinstance(m, dict) else m for m in later]
    full, _, used = needs_repair_from(copied, kept)
    assert full == needs_repair(copied)
    assert used is None or not used.messages  # equal copies never resume past a message


@settings(max_examples=300, deadline=None)
@given(random_histories(), random_histories(), st.integers(min_value=1, max_value=40))
def test_a_turn_that_sends_its_last_message_anew_resumes_from_before_it(
    first: list[Message], appended: list[Message], cut: int
) -> None:
    """A client that moves a cache_control mark sends the previous turn's last message anew
    (another object, parsed again): the whole history was checked again every turn. The check
    resumes from before that message, and answers as a full check."""
    earlier = first[: max(1, cut % (len(first) + 1))]
    _, checkpoint, _ = needs_repair_from(earlier)
    last = earlier[-1]
    anew = {**last, "cache_control": {"type": "ephemeral"}} if isinstance(last, dict) else last
    later = [*earlier[:-1], anew, *appended]
    kept = [checkpoint] if checkpoint else []
    resumed, after, used = needs_repair_from(later, kept)
    assert resumed == needs_repair(later)
    if checkpoint is not None and anew is not last:
        assert checkpoint.before_last is not None
        assert used is checkpoint.before_last
    assert after is None or after.messages == tuple(later)


@settings(max_examples=300, deadline=None)
@given(
    random_histories(),
    random_histories(),
    st.integers(min_value=0, max_value=40),
    st.integers(min_value=0, max_value=2),
)
def test_a_turn_whose_system_prompt_changed_resumes_past_it(
    first: list[Message], appended: list[Message], cut: int, prompts: int
) -> None:
    """A system prompt with the time in it: the messages after it are the previous turn's
    objects, but the prompt is another, and the whole history was checked again every turn.
    After any prompt the check stands alike: it resumes past the same messages, and answers
    as a full check."""
    earlier = [{"role": "system", "content": "It is 10:00."}, *first[: cut % (len(first) + 1)]]
    _, checkpoint, _ = needs_repair_from(earlier)
    since = 1
    while since < len(earlier) and isinstance(earlier[since], dict):
        if earlier[since].get("role") not in ("system", "developer"):
            break
        since += 1
    prompt = [{"role": "developer", "content": f"It is 10:0{n + 1}."} for n in range(prompts)]
    later = [*prompt, *earlier[since:], *appended]
    kept = [checkpoint] if checkpoint else []
    resumed, after, used = needs_repair_from(later, kept)
    assert resumed == needs_repair(later)
    if checkpoint is not None and since < len(earlier) and (prompts or since > 1):
        assert used is not None and used.messages == tuple(later[: prompts + len(earlier) - since])
    assert after is None or after.messages == tuple(later)


def test_long_arguments_are_parsed_once_per_string_and_the_memo_stays_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A history that keeps a repaired defect is repaired again on every turn; the arguments of
    its calls (the very same string objects each turn) are parsed once, not once per turn."""
    import proxy.pairing as pairing_module

    parsed: list[str] = []
    real = pairing_module._parses

    def counting(text: str) -> bool:
        parsed.append(text)
        return real(text)

    monkeypatch.setattr(pairing_module, "_parses", counting)
    good = '{"content": "' + "x" * 2000 + '"}'
    bad = good[:-2]  # cut off: not JSON
    history = [
        user("go"),
        asst({"id": "c1", "type": "function", "function": {"name": "w", "arguments": good}}),
        tool("c1"),
        asst({"id": "c2", "type": "function", "function": {"name": "w", "arguments": bad}}),
        tool("c2"),
        asst(call("c3")),  # interrupted: no result
        user("continue"),
    ]
    first = repair_messages(history)
    assert [r.kind for r in first.repairs] == ["invalid_arguments", "dangling_call"]
    assert sorted(t for t in parsed if len(t) > 100) == sorted([good, bad])
    parsed.clear()
    again = repair_messages([*history, user("and more")])  # the next turn: the same objects
    assert again.messages[: len(first.messages)] == first.messages
    assert all(len(t) < 100 for t in parsed)  # no long argument parsed again (short ones are)
    # A copy of the same text is another object: parsed on its own, same verdict.
    copied = "".join(list(bad))
    assert copied is not bad and not pairing_module._valid_json(copied)
    # Bounded by the characters it holds, the oldest verdicts dropped first.
    monkeypatch.setattr(pairing_module, "_MEMO_MAX_CHARS", 10_000)
    texts = ['{"k": "' + str(i) * 600 + '"}' for i in range(50)]
    assert all(pairing_module._valid_json(t) for t in texts)
    assert pairing_module._memo_chars <= 10_000
    assert sum(len(t) for t, _ in pairing_module._json_verdicts.values()) == (
        pairing_module._memo_chars
    )
    # A string too long to be worth a quarter of the memo is parsed, not kept: it cannot empty it.
    held = dict(pairing_module._json_verdicts)
    huge = '{"k": "' + "z" * 9000 + '"}'
    assert pairing_module._valid_json(huge)
    assert pairing_module._json_verdicts == held


@pytest.mark.parametrize("later", ["after_a_turn", "at_once"])
def test_a_late_result_for_a_number_id_resumes_no_repair_that_would_lose_it(later: str) -> None:
    """Call ids sent as JSON numbers (a local model's template): a result for call 7 left open
    an earlier turn was skipped by the resume check (it looked at string ids only), the repair
    went on from the old state, and the real result was in no message forwarded, the
    synthetic "interrupted" note in its place, on that turn and every later one."""
    open_call = {"role": "assistant", "content": None, "tool_calls": [{**call(None), "id": 7}]}
    history = [user("read a"), open_call]
    if later == "after_a_turn":
        history.append(user("and hurry"))
    _, state = repair_messages_from(history, None)
    assert state is not None
    turn = [*history, asst(content="working"), {**tool(None, "CONTENTS OF a"), "tool_call_id": 7}]
    result, _ = repair_messages_from(turn, state)
    assert result.messages == repair_messages(turn).messages
    assert any(m.get("content") == "CONTENTS OF a" for m in result.messages)


@settings(max_examples=300, deadline=None)
@given(
    history=st.one_of(random_histories(), damaged_histories().map(lambda d: d[0])),
    cuts=st.lists(st.integers(0, 40), max_size=3),
    policy=st.sampled_from(["downgrade", "drop"]),
)
def test_a_repair_resumed_turn_by_turn_equals_a_repair_from_scratch(
    history: list[Message], cuts: list[int], policy: Any
) -> None:
    """The same history sent in growing turns (each the very objects of the last plus a few), a
    repair resumed from the previous turn's gives exactly what repairing it whole gives."""
    state = None
    for end in [*sorted(c % (len(history) + 1) for c in cuts), len(history)]:
        turn = history[:end]
        resumed, state = repair_messages_from(turn, state, orphan_policy=policy)
        whole = repair_messages(turn, orphan_policy=policy)
        assert resumed.messages == whole.messages
        assert resumed.repairs == whole.repairs


def _kept_defect_history() -> list[Message]:
    """An interrupted turn, then 50 tool rounds."""
    history = [user("go"), asst(call("int")), user("interrupted; go on")]
    for k in range(50):
        history += [asst(call(f"c{k}")), tool(f"c{k}")]
    return history


def _count_looks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time the repair looks at a message for its calls."""
    import proxy.pairing as pairing_module

    looked_at: list[int] = []
    real = pairing_module._tool_calls

    def counting(message: Any) -> Any:
        looked_at.append(1)
        return real(message)

    monkeypatch.setattr(pairing_module, "_tool_calls", counting)
    return looked_at


def test_a_kept_defect_costs_each_turn_only_what_it_appended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interrupted turn stays in the history; each later turn is repaired from where the last
    one stopped, and a result that answers an open call sends it back to a whole repair."""
    history = _kept_defect_history()
    result, state = repair_messages_from(history, None)
    assert state is not None and [r.kind for r in result.repairs] == ["dangling_call"]
    looked_at = _count_looks(monkeypatch)
    turn = [*history, asst(call("n1")), tool("n1"), user("more")]
    result, state = repair_messages_from(turn, state)
    # The two appended non-tool messages, each looked at twice (the resume check, the repair);
    # none of the 100 before them.
    assert len(looked_at) == 4
    assert result.messages == repair_messages(turn).messages
    late = [*turn, tool("int", "the result after all")]  # answers the interrupted call
    result, state = repair_messages_from(late, state)
    assert len(looked_at) > 50  # repaired whole
    assert result.messages == repair_messages(late).messages
    assert [r.kind for r in result.repairs] == ["displaced_result"]


@settings(max_examples=200, deadline=None)
@given(
    base=random_histories(),
    other=random_histories(),
    fork_at=st.integers(0, 30),
    requests=st.lists(st.tuples(st.booleans(), st.integers(0, 60)), min_size=1, max_size=8),
)
def test_a_resumed_repair_is_exact_across_forks_retries_and_rewinds(
    base: list[Message],
    other: list[Message],
    fork_at: int,
    requests: list[tuple[bool, int]],
) -> None:
    """One session's requests come from two branches that share their first messages (the very
    objects), in any order, longer, shorter or the same again: each repair, resumed from whatever
    the last request left, equals the whole repair of its history."""
    fork = [*base[: fork_at % (len(base) + 1)], *other[1:]]
    state = None
    for on_fork, end in requests:
        branch = fork if on_fork else base
        turn = branch[: end % (len(branch) + 1)]
        resumed, state = repair_messages_from(turn, state)
        whole = repair_messages(turn)
        assert (resumed.messages, resumed.repairs) == (whole.messages, whole.repairs)


def test_a_call_id_used_again_by_an_appended_call_does_not_stop_the_resume() -> None:
    """Servers that number calls call_0, call_1 … in every turn reuse the interrupted call's id:
    the appended result is for the appended call, and the repair still resumes."""
    history = [user("go"), asst(call("call_0")), user("interrupted; go on")]
    _, state = repair_messages_from(history, None)
    assert state is not None
    turn = [*history, asst(call("call_0")), tool("call_0")]
    assert state.resumes(turn, state.policy) is not None
    result, _ = repair_messages_from(turn, state)
    assert result.messages == repair_messages(turn).messages


@settings(max_examples=300, deadline=None)
@given(
    history=st.one_of(random_histories(), damaged_histories().map(lambda d: d[0])),
    cuts=st.lists(st.integers(0, 40), max_size=4),
    system=st.integers(1, 2),
    policy=st.sampled_from(["downgrade", "drop"]),
)
def test_a_repair_resumes_past_a_system_prompt_with_the_time_in_it(
    history: list[Message], cuts: list[int], system: int, policy: Any
) -> None:
    """The time in the system prompt: each turn a new system block before the very same
    messages. The repair resumes (it started over every turn: ~1.6 ms a turn at 100 turns where
    a fixed prompt took ~0.05) and still equals the whole repair of each turn."""
    state = None
    for turn_no, end in enumerate([*sorted(c % (len(history) + 1) for c in cuts), len(history)]):
        prompt = [
            {"role": "system", "content": f"Agent {k}. Time: 10:{turn_no:02d}"}
            for k in range(system)
        ]
        turn = [*prompt, *history[:end]]
        resumed, state = repair_messages_from(turn, state, orphan_policy=policy)
        whole = repair_messages(turn, orphan_policy=policy)
        assert resumed.messages == whole.messages
        assert resumed.repairs == whole.repairs
        assert all(a is b for a, b in zip(resumed.messages[:system], prompt, strict=False))


def test_a_kept_defect_behind_a_changing_system_prompt_is_repaired_from_where_it_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    history = _kept_defect_history()
    first = [{"role": "system", "content": "Time: 10:00"}, *history]
    _, state = repair_messages_from(first, None)
    assert state is not None
    looked_at = _count_looks(monkeypatch)
    turn = [{"role": "system", "content": "Time: 10:01"}, *history, asst(call("n1")), tool("n1")]
    result, state = repair_messages_from(turn, state)
    assert len(looked_at) == 2  # the appended call, twice; none of the 100 before it
    assert result.messages == repair_messages(turn).messages
    assert result.messages[0] is turn[0]
    # another number of system messages: repaired whole, and right
    looked_at.clear()
    two = [{"role": "system", "content": "a"}, {"role": "developer", "content": "b"}, *history]
    result, _ = repair_messages_from(two, state)
    assert len(looked_at) > 50
    assert result.messages == repair_messages(two).messages


def _marked(message: Any, mark: Any) -> Any:
    """``message`` sent anew (another object) with ``mark`` as its cache mark (None: none): on
    its last content part where its content is a list of them, else on the message."""
    if not isinstance(message, dict):
        return message
    sent = {k: v for k, v in message.items() if k != "cache_control"}
    content = sent.get("content")
    if isinstance(content, list) and content and isinstance(content[-1], dict):
        last = {k: v for k, v in content[-1].items() if k != "cache_control"}
        sent["content"] = [*content[:-1], last if mark is None else {**last, "cache_control": mark}]
    elif mark is not None:
        sent["cache_control"] = mark
    return sent


def _as_parts(message: Message) -> Message:
    content = message.get("content")
    if isinstance(content, str) and message.get("role") in ("user", "tool"):
        return {**message, "content": [{"type": "text", "text": content}]}
    return message


EPHEMERAL = {"type": "ephemeral"}


@settings(max_examples=300, deadline=None)
@given(
    history=st.one_of(random_histories(), damaged_histories().map(lambda d: d[0])),
    cuts=st.lists(st.integers(0, 40), max_size=4),
    marks=st.integers(1, 3),
    parts=st.booleans(),
    mode=st.sampled_from([{}, {"drop_empty": True}, {"mistral": True}]),
    policy=st.sampled_from(["downgrade", "drop"]),
)
def test_a_repair_resumes_past_messages_sent_anew_with_their_cache_marks_moved(
    history: list[Message],
    cuts: list[int],
    marks: int,
    parts: bool,
    mode: dict[str, bool],
    policy: Any,
) -> None:
    """A client that marks its last messages for the prompt cache (Cline, Roo Code, opencode
    for Claude) moves the marks each turn: the messages that lose or gain one are sent anew
    (parsed again: other objects), and a history that keeps a repaired defect was repaired
    whole every turn (~0.8 ms at 400 messages). Each turn, resumed from the last, still equals
    the whole repair of that turn, marks included."""
    if parts:
        history = [_as_parts(m) for m in history]
    state = None
    for end in [*sorted(c % (len(history) + 1) for c in cuts), len(history)]:
        turn = [
            _marked(m, EPHEMERAL) if k >= end - marks else m for k, m in enumerate(history[:end])
        ]
        resumed, state = repair_messages_from(turn, state, orphan_policy=policy, **mode)
        whole = repair_messages(turn, orphan_policy=policy, **mode)
        assert orjson.dumps(resumed.messages) == orjson.dumps(whole.messages)
        assert resumed.repairs == whole.repairs


@pytest.mark.parametrize("mode", [{}, {"drop_empty": True}, {"mistral": True}])
@pytest.mark.parametrize("parts", [False, True])
@pytest.mark.parametrize("numbered", [False, True])
def test_a_kept_defect_with_moving_cache_marks_costs_each_turn_only_what_changed(
    monkeypatch: pytest.MonkeyPatch, mode: dict[str, bool], parts: bool, numbered: bool
) -> None:
    """The last two messages marked each turn: the turn after, the older one is sent without
    its mark and the newer keeps it (both anew). The repair takes them in the old ones' places
    and looks at the appended messages only; the repaired history carries the marks as sent.
    So with calls numbered per message (``call_0`` every turn), whose ids and results are
    renamed for a Claude model: the renamed result sent anew gets the same new id."""
    history = [user("go"), asst(call("int")), user("interrupted; go on")]
    for k in range(50):
        call_id = "call_0" if numbered else f"c{k}"
        history += [asst(call(call_id)), tool(call_id, f"out {k}")]
    if parts:
        history = [_as_parts(m) for m in history]
    sent = [*history[:-2], *(_marked(m, EPHEMERAL) for m in history[-2:])]
    result, state = repair_messages_from(sent, None, **mode)
    assert state is not None and "dangling_call" in [r.kind for r in result.repairs]
    looked_at = _count_looks(monkeypatch)
    new = (
        [asst(call("call_0")), tool("call_0", "new")]
        if numbered
        else [asst(call("n1")), tool("n1", "new")]
    )
    if parts:
        new = [_as_parts(m) for m in new]
    # (parsed again from the first message that changed on, as the body memo does)
    turn = [
        *history[:-2],
        _marked(history[-2], None),
        _marked(history[-1], EPHEMERAL),
        *(_marked(m, EPHEMERAL) for m in new),
    ]
    result, state = repair_messages_from(turn, state, **mode)
    assert len(looked_at) == 2  # the appended call, twice; none of the 100 before it
    whole = repair_messages(turn, **mode)
    assert orjson.dumps(result.messages) == orjson.dumps(whole.messages)
    marks = [cache_mark(m, "content") for m in result.messages[-4:]]
    assert marks == [None, EPHEMERAL, EPHEMERAL, EPHEMERAL]
    # an edit that is more than a mark (the text of one of them changed): repaired whole
    looked_at.clear()
    edited = [*turn[:-1], {**turn[-1], "content": "edited"}]
    result, _ = repair_messages_from(edited, state, **mode)
    assert len(looked_at) > 50
    assert result.messages == repair_messages(edited, **mode).messages


@pytest.mark.parametrize("calls", [False, True])
def test_a_message_sent_anew_beside_a_removed_messages_mark_is_repaired_afresh(
    calls: bool,
) -> None:
    """A removed empty message's mark goes on what comes before it in the repaired history, a
    result moved back there: the result sent anew without its own mark then takes the moved
    one in a whole repair, and the resumed one left it out (a breakpoint lost). With such a
    mark kept, a message sent anew is repaired afresh. (A Claude model's history, which has
    an empty assistant message removed, with an empty tool_calls array or without.)"""
    mode = {"drop_empty": True}
    mark = {"type": "ephemeral"}
    empty = {"role": "assistant", "content": "", "cache_control": mark}
    if calls:
        empty = {"role": "assistant", "content": "", "tool_calls": [], "cache_control": mark}
    first = [user("go"), asst(call("c1")), empty, {**tool("c1", "r"), "cache_control": mark}]
    _, state = repair_messages_from(first, None, **mode)
    later = [*first[:3], tool("c1", "r"), {**user("next"), "cache_control": mark}]
    resumed, _ = repair_messages_from(later, state, **mode)
    whole = repair_messages(later, **mode)
    assert orjson.dumps(resumed.messages) == orjson.dumps(whole.messages)
    assert cache_mark(whole.messages[2], "content") == mark  # (the moved mark, on the result)


class _CountedId(str):
    """A call id that counts how often it is compared for equality with another."""

    compared = 0
    __hash__ = str.__hash__

    def __eq__(self, other: object) -> bool:
        _CountedId.compared += 1
        return str.__eq__(self, other)


def test_a_message_of_many_parallel_calls_is_repaired_in_time_that_grows_with_it() -> None:
    """Each call's id was looked for among the message's earlier ones in a list: a request of
    40,000 calls and no results held the event loop, every session's streams, 8 s (the 64 MiB
    body limit allows ~700,000: hours). Now compared a bounded number of times per call."""
    n = 2000
    calls = [call(_CountedId(f"call_{i}")) for i in range(n)]
    history = [user("go"), {"role": "assistant", "content": None, "tool_calls": calls}]
    _CountedId.compared = 0
    result = repair_messages(history)
    assert [r.kind for r in result.repairs] == ["dangling_call"] * n
    assert _CountedId.compared < 10 * n  # (a list's search: ~n * n / 2, two million)
    validate_messages(result.messages)


def test_an_orphan_kept_between_two_results_of_one_call_says_the_results_went_before_it() -> None:
    """An orphan among the results of a parallel call, kept as a user message: the result
    after it moves up with the others, before it. The repair said only "kept as a user
    message", and the move showed nowhere: not in the log, the header or the repairs' count."""
    history = [user("x"), asst(call("a"), call("b")), tool("a"), tool("zz"), tool("b"), user("y")]
    result = repair_messages(history)
    assert [m.get("tool_call_id") or (m["content"] or "")[:24] for m in result.messages] == [
        "x",
        "",
        "a",
        "b",
        "[tool result for call zz",
        "y",
    ]
    (orphan,) = result.repairs
    assert (orphan.kind, orphan.index) == ("orphan_result", 3)
    assert orphan.action == "kept as a user message, moved after the results of messages[1]"
    # an orphan after the last result moves nothing: said as before
    history = [user("x"), asst(call("a")), tool("a"), tool("zz"), user("y")]
    (orphan,) = repair_messages(history).repairs
    assert orphan.action == "kept as a user message"
    # resumed from the state of the request before (the history one turn on): the same
    longer = [user("x"), asst(call("a"), call("b")), tool("a"), tool("zz"), tool("b")]
    first, state = repair_messages_from(longer[:4], None)  # (b not answered yet)
    assert [r.action for r in first.repairs if r.kind == "orphan_result"] == [
        "kept as a user message"
    ]
    again, _ = repair_messages_from(longer, state)
    assert again.messages == result.messages[:5]
    # calls sent without ids (Gemini's endpoint), their results paired by order: the same
    idless = [user("x"), asst(call(""), call("")), tool("", "r1"), tool("zz"), tool("", "r2")]
    (orphan,) = [r for r in repair_messages(idless).repairs if r.kind == "orphan_result"]
    assert orphan.action == "kept as a user message, moved after the results of messages[1]"
    assert [(r.kind, r.action) for r in again.repairs] == [
        ("orphan_result", "kept as a user message, moved after the results of messages[1]")
    ]
