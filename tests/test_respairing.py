"""Tool-pairing repair of Responses API requests: the pure repair, and ``POST /v1/responses``
end to end (the official SDK through cachegate to the simulator, which refuses a broken pairing
with OpenAI's texts)."""

from __future__ import annotations

import copy
import gzip
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import respairing
from proxy.pairing import DEFAULT_INTERRUPTED_NOTE
from proxy.simulator import RunningSimulator, SimConfig, run_simulator
from proxy.simulator.validate import ValidationError, validate_response_input

NOTE = "interrupted: {name}"


def call(call_id: str, name: str = "shell", kind: str = "function_call") -> dict[str, Any]:
    item: dict[str, Any] = {"type": kind, "call_id": call_id, "name": name}
    if kind == "function_call":
        item["arguments"] = '{"cmd":"ls"}'
    elif kind == "custom_tool_call":
        item["input"] = "*** Begin Patch"
    return item


def output(call_id: str, text: Any = "ok", kind: str = "function_call_output") -> dict[str, Any]:
    return {"type": kind, "call_id": call_id, "output": text}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def repaired(body: dict[str, Any], **kw: Any) -> respairing.PairingResult:
    kw.setdefault("interrupted_note", NOTE)
    return respairing.repair_input(body, **kw)


def accepted(body: dict[str, Any]) -> bool:
    try:
        validate_response_input(body)
    except ValidationError:
        return False
    return True


# -- the pure repair -------------------------------------------------------------------------------


def test_a_sound_history_is_the_same_list() -> None:
    items = [user("hi"), call("c1"), output("c1"), {"type": "reasoning", "id": "rs_1"}]
    result = repaired({"input": items})
    assert result.messages is items and result.repairs == []
    assert not respairing.needs_repair({"input": items})
    assert not respairing.needs_repair({"input": "just text"})


def test_an_interrupted_call_gets_a_synthetic_output_after_its_turn() -> None:
    items = [user("run it"), call("c1", "exec_command"), user("never mind, stop")]
    body = {"model": "gpt-5", "input": items}
    assert not accepted(body)
    result = repaired(body)
    assert result.messages == [
        user("run it"),
        call("c1", "exec_command"),
        {"type": "function_call_output", "call_id": "c1", "output": "interrupted: exec_command"},
        user("never mind, stop"),
    ]
    assert [(r.kind, r.index, r.tool_call_id) for r in result.repairs] == [
        ("dangling_call", 1, "c1")
    ]
    assert accepted({**body, "input": result.messages})
    assert items == [user("run it"), call("c1", "exec_command"), user("never mind, stop")]


def test_an_interrupted_calls_output_stays_in_place_when_the_next_turn_calls_at_once() -> None:
    """The review's case: gpt-4.1's next call and its output right after the interrupted turn's
    outputs; the synthetic output stays where the turn before had it."""
    turn = [user("go"), call("A"), call("B"), output("A")]
    first = repaired({"input": turn}).messages
    assert [i.get("call_id") for i in first[1:]] == ["A", "B", "A", "B"]
    for n in range(3):
        turn = [*turn, call(f"C{n}"), output(f"C{n}")]
        later = repaired({"input": turn}).messages
        assert later[: len(first)] == first
        assert accepted({"input": later})
        first = later


def test_a_call_with_an_empty_call_id_is_answered() -> None:
    """A call whose ``call_id`` is ``""`` (a gateway's, for a model that gave none) was taken
    for no call: the provider's refusal reached the client every turn of its session."""
    items = [user("go on"), call(""), user("go on")]
    assert not accepted({"input": items})
    result = repaired({"input": items})
    assert [(r.kind, r.index, r.tool_call_id) for r in result.repairs] == [("dangling_call", 1, "")]
    assert accepted({"input": result.messages})
    answered = [user("go on"), call(""), output("")]  # (and its own output answers it)
    assert repaired({"input": answered}).messages is answered
    orphan = [user("go on"), output("")]
    assert not accepted({"input": orphan})
    assert accepted({"input": repaired({"input": orphan}).messages})
    body = {"input": items}  # (strict mode names it: "")
    assert respairing.format_strict_error(body, respairing.diagnose(body)) == (
        'cachegate strict pairing: 1 defect: input[1] function_call "" has no output'
        " (dangling_call)"
    )


def test_parallel_calls_keep_their_block_and_call_order() -> None:
    items = [call("a"), call("b"), call("c"), output("b"), user("steer"), call("d"), output("d")]
    result = repaired({"input": items})
    assert [(i.get("type"), i.get("call_id")) for i in result.messages] == [
        ("function_call", "a"),
        ("function_call", "b"),
        ("function_call", "c"),
        ("function_call_output", "b"),
        ("function_call_output", "a"),
        ("function_call_output", "c"),
        (None, None),
        ("function_call", "d"),
        ("function_call_output", "d"),
    ]
    assert [r.index for r in result.repairs] == [0, 2]


def test_a_synthetic_output_goes_before_an_orphan_in_its_run() -> None:
    """An orphan output in a dangling call's run becomes a user message: the synthetic output
    went after it, the message parting the call from its output."""
    items = [call("a"), output("zz", "stray"), user("next")]
    result = repaired({"input": items})
    assert [(i.get("type"), i.get("call_id")) for i in result.messages] == [
        ("function_call", "a"),
        ("function_call_output", "a"),
        ("message", None),
        (None, None),
    ]


def test_a_history_ending_with_a_call_is_answered_at_its_end() -> None:
    result = repaired({"input": [user("go"), call("c9")]})
    assert result.messages[-1] == {
        "type": "function_call_output",
        "call_id": "c9",
        "output": "interrupted: shell",
    }


def test_custom_and_local_shell_calls_get_the_output_type_they_take() -> None:
    items = [
        call("p1", "apply_patch", "custom_tool_call"),
        {"type": "local_shell_call", "call_id": "s1", "action": {"type": "exec"}},
        user("next"),
    ]
    result = repaired({"input": items})
    assert result.messages[2:4] == [
        {"type": "custom_tool_call_output", "call_id": "p1", "output": "interrupted: apply_patch"},
        {"type": "function_call_output", "call_id": "s1", "output": "interrupted: shell"},
    ]
    assert accepted({"input": result.messages})


@pytest.mark.parametrize(
    "answer",
    [
        {"type": "local_shell_call_output", "call_id": "call_1", "output": "a"},
        {"type": "local_shell_call_output", "id": "call_1", "output": "a"},
        {"type": "local_shell_call_output", "id": "lsh_1", "output": "a"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a"},
    ],
)
def test_a_local_shell_call_is_answered_in_each_form_the_sdks_write(answer: dict[str, Any]) -> None:
    shell = {"type": "local_shell_call", "id": "lsh_1", "call_id": "call_1", "action": {}}
    items = [shell, answer, user("next")]
    assert accepted({"input": items})
    result = repaired({"input": items})
    assert result.repairs == [] and result.messages is items


def test_a_local_shell_output_that_answers_no_call_is_left_alone() -> None:
    items = [user("hi"), {"type": "local_shell_call_output", "id": "lsh_9", "output": "a"}]
    assert repaired({"input": items}).messages is items


def test_a_long_run_of_calls_gets_its_outputs_after_it_in_call_order() -> None:
    items = [call(f"c{i}") for i in range(3000)] + [output("c7"), user("then")]
    result = repaired({"input": items})
    assert len(result.repairs) == 2999
    tail = result.messages[3001:-1]
    assert [item["call_id"] for item in tail] == [f"c{i}" for i in range(3000) if i != 7]
    assert result.messages[-1] == user("then") and accepted({"input": result.messages})


def test_shell_and_patch_calls_get_outputs_of_their_own_shape() -> None:
    """A ``shell_call`` and an ``apply_patch_call`` (the Responses API's own shell and patch
    tools) without an output were sent on: OpenAI's "No tool output found for shell call". Their
    outputs are structures: the note goes where the SDK's types take text."""
    from openai.types.responses import ResponseInputItemParam
    from pydantic import TypeAdapter

    shell = {
        "type": "shell_call",
        "call_id": "sh_1",
        "action": {"commands": ["pytest -x"]},
        "status": "completed",
    }
    patch = {
        "type": "apply_patch_call",
        "call_id": "ap_1",
        "status": "completed",
        "operation": {"type": "update_file", "path": "a.py", "diff": "@@\n-a\n+b\n"},
    }
    items = [user("fix it"), shell, patch, user("stop")]
    assert not accepted({"input": items})
    result = repaired({"input": items})
    assert result.messages[3:5] == [
        {
            "type": "shell_call_output",
            "call_id": "sh_1",
            "output": [
                {
                    "stdout": "",
                    "stderr": "interrupted: shell",
                    "outcome": {"type": "exit", "exit_code": 130},
                }
            ],
        },
        {
            "type": "apply_patch_call_output",
            "call_id": "ap_1",
            "status": "failed",
            "output": "interrupted: apply_patch",
        },
    ]
    assert accepted({"input": result.messages})
    TypeAdapter(list[ResponseInputItemParam]).validate_python(result.messages)
    # an orphan shell output is kept as text (its list is no message's parts)
    stray = {"type": "shell_call_output", "call_id": "sh_9", "output": [{"stdout": "ok"}]}
    kept = repaired({"input": [user("hi"), stray]}).messages[1]
    assert kept["content"] == [
        {
            "type": "input_text",
            "text": '[tool result for call sh_9 (no matching tool call)]\n[{"stdout": "ok"}]',
        }
    ]


def test_an_output_answering_a_call_of_another_type_is_no_orphan() -> None:
    """An output answers whatever item has its ``call_id`` (a client answers a call of another
    type with a ``function_call_output``, as Codex CLI does a local shell call): a tool search
    the client ran, a program item."""
    for answered in (
        {"type": "tool_search_call", "call_id": "ts_1", "arguments": {}, "execution": "client"},
        {"type": "program", "id": "pg_1", "call_id": "ts_1", "code": "1", "fingerprint": "f"},
    ):
        items = [user("hi"), answered, output("ts_1")]
        assert repaired({"input": items}).messages is items and accepted({"input": items})


def test_a_call_answered_by_an_output_of_a_type_not_paired_here_is_no_dangling_call() -> None:
    """A ``tool_search`` function call answered by Codex CLI's ``tool_search_output``: its
    answer is there, so no synthetic output goes beside it (one did: a second, made-up
    answer to a call the model had its result for)."""
    answer = {"type": "tool_search_output", "call_id": "ts_1", "execution": "client", "tools": []}
    items = [user("find a tool"), call("ts_1", "tool_search"), answer, user("go on")]
    assert repaired({"input": items}).messages is items


def search(call_id: str | None, execution: str = "client") -> dict[str, Any]:
    """A ``tool_search_call`` as the provider returns one (Codex CLI's tool search runs at the
    client; a hosted one, ``server``, carries its results in the response)."""
    item = {"type": "tool_search_call", "id": "ts_x", "execution": execution, "status": "completed"}
    return {**item, "call_id": call_id, "arguments": {"query": "calendar"}}


def found(call_id: str, execution: str = "client") -> dict[str, Any]:
    tool = {"type": "function", "name": "create_event", "parameters": {"type": "object"}}
    item = {"type": "tool_search_output", "call_id": call_id, "execution": execution}
    return {**item, "status": "completed", "tools": [tool]}


def test_a_tool_search_the_client_ran_and_was_interrupted_in_gets_an_output() -> None:
    """Codex CLI's tool search runs at the client: a search with no ``tool_search_output`` (the
    user pressed Ctrl+C while it ran) is refused by OpenAI (``No tool output found for tool
    search call …``); it gets one that loaded no tools, as Codex CLI gives it, after its run.
    It was relayed as it came, and ``X-Cachegate-Repairs: 0`` said the history was sound."""
    items = [user("book a meeting"), search("call_ts"), call("c2"), user("stop")]
    assert not accepted({"input": items})
    result = repaired({"input": items})
    assert result.messages == [
        user("book a meeting"),
        search("call_ts"),
        call("c2"),
        {
            "type": "tool_search_output",
            "call_id": "call_ts",
            "execution": "client",
            "status": "completed",
            "tools": [],
        },
        output("c2", "interrupted: shell"),
        user("stop"),
    ]
    assert [(r.kind, r.index, r.tool_call_id) for r in result.repairs] == [
        ("dangling_call", 1, "call_ts"),
        ("dangling_call", 2, "c2"),
    ]
    assert result.repairs[0].action == "added a synthetic output for tool_search"
    assert accepted({"input": result.messages})
    text = respairing.format_strict_error({"input": items}, respairing.diagnose({"input": items}))
    assert "input[1] tool_search_call call_ts has no output" in text
    # answered, it is sound; a hosted search (run by the provider) carries its own results
    sound = [user("book"), search("call_ts"), found("call_ts"), user("go")]
    assert repaired({"input": sound}).messages is sound and accepted({"input": sound})
    hosted = [user("book"), search(None, "server"), found("x", "server"), search("s2", "server")]
    assert repaired({"input": hosted}).messages is hosted and accepted({"input": hosted})


def test_an_orphan_tool_search_output_is_kept_as_a_user_message_with_its_tools() -> None:
    """A client-run search's output whose call the agent's own trimming dropped is refused by
    OpenAI (``No tool call found for tool search output …``): it becomes a user message that
    keeps the tools it loaded, as JSON text. A hosted search's output is left alone."""
    items = [user("hi"), found("gone"), user("go on")]
    assert not accepted({"input": items})
    result = repaired({"input": items})
    tools = '[{"name": "create_event", "parameters": {"type": "object"}, "type": "function"}]'
    label = "[tool result for call gone (no matching tool call)]"
    assert result.messages[1] == {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": f"{label}\n{tools}"}],
    }
    assert [(r.kind, r.index, r.action) for r in result.repairs] == [
        ("orphan_result", 1, "kept as a user message")
    ]
    assert accepted({"input": result.messages})
    hosted = [user("hi"), found("gone", "server")]
    assert repaired({"input": hosted}).messages is hosted and accepted({"input": hosted})


def test_an_orphan_computer_call_output_keeps_its_screenshot_and_a_lone_call_is_left() -> None:
    """A computer-use agent's screenshot whose ``computer_call`` was trimmed away is refused by
    OpenAI (``No tool call found for computer call output …``): it becomes a user message with
    the screenshot as its image. A ``computer_call`` with no output is relayed as it is: its
    output is a screenshot cachegate cannot make up (the provider refuses it, as documented)."""
    shot = {"type": "computer_screenshot", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    orphan = {"type": "computer_call_output", "call_id": "cu_1", "output": shot}
    items = [user("open the settings"), orphan, user("now the display tab")]
    assert not accepted({"input": items})
    result = repaired({"input": items})
    assert result.messages[1] == {
        "type": "message",
        "role": "user",
        "content": [
            {"type": "input_text", "text": "[tool result for call cu_1 (no matching tool call)]"},
            {"type": "input_image", "image_url": shot["image_url"], "detail": "auto"},
        ],
    }
    assert accepted({"input": result.messages})
    by_file = {**orphan, "output": {"type": "computer_screenshot", "file_id": "file_9"}}
    image = repaired({"input": [by_file]}).messages[0]["content"][1]
    assert image == {"type": "input_image", "file_id": "file_9", "detail": "auto"}
    action = {"type": "click", "button": "left", "x": 10, "y": 20}
    computer = {"type": "computer_call", "id": "cu_x", "call_id": "cu_1", "action": action}
    answered = [user("open"), computer, orphan, user("next")]
    assert repaired({"input": answered}).messages is answered and accepted({"input": answered})
    lone = [user("open"), computer]
    assert repaired({"input": lone}).messages is lone and not accepted({"input": lone})


def test_an_orphan_output_is_kept_as_a_user_message_or_dropped() -> None:
    items = [
        user("hi"),
        output("gone", "stray text"),
        output("gone2", [{"type": "input_text", "text": "t"}]),
    ]
    body = {"input": items}
    assert not accepted(body)
    kept = repaired(body)
    assert kept.messages[1:] == [
        {
            "type": "message",
            "role": "user",
            "content": [
                {
                    "type": "input_text",
                    "text": "[tool result for call gone (no matching tool call)]\nstray text",
                }
            ],
        },
        {
            "type": "message",
            "role": "user",
            "content": [
                {
                    "type": "input_text",
                    "text": "[tool result for call gone2 (no matching tool call)]",
                },
                {"type": "input_text", "text": "t"},
            ],
        },
    ]
    assert [(r.kind, r.action) for r in kept.repairs] == [
        ("orphan_result", "kept as a user message"),
        ("orphan_result", "kept as a user message"),
    ]
    # an image among its parts is given the detail a message's image needs
    image = output("gone3", [{"type": "input_image", "image_url": "https://x/a.png"}])
    from openai.types.responses import ResponseInputItemParam
    from pydantic import TypeAdapter

    TypeAdapter(list[ResponseInputItemParam]).validate_python(repaired({"input": [image]}).messages)
    dropped = repaired(body, orphan_policy="drop")
    assert dropped.messages == [user("hi")]
    assert accepted({"input": kept.messages}) and accepted({"input": dropped.messages})


@pytest.mark.parametrize(
    "extra",
    [
        {"previous_response_id": "resp_1"},
        {"conversation": "conv_1"},
        {"input_reference": True},
        {"input_reference": "untyped"},
    ],
)
def test_outputs_of_calls_stored_at_the_provider_are_not_orphans(extra: dict[str, Any]) -> None:
    items: list[Any] = [output("stored_call", "42"), user("and now?")]
    reference = extra.pop("input_reference", False)
    if reference:  # (an item_reference's type is optional)
        items.insert(
            0,
            {"id": "fc_1"} if reference == "untyped" else {"type": "item_reference", "id": "fc_1"},
        )
    body = {"input": items, **extra}
    result = repaired(body)
    assert result.repairs == [] and result.messages is items
    # a call in the list itself still needs its output there
    dangling = {**body, "input": [*items, call("fresh")]}
    assert [r.kind for r in repaired(dangling).repairs] == ["dangling_call"]


def test_repair_is_deterministic_and_idempotent() -> None:
    items = [user("a"), call("c1"), call("c2"), output("c2"), output("zz"), user("b")]
    first = repaired({"input": copy.deepcopy(items)})
    second = repaired({"input": copy.deepcopy(items)})
    assert orjson.dumps(first.messages) == orjson.dumps(second.messages)
    again = repaired({"input": first.messages})
    assert again.repairs == [] and again.messages is first.messages


_ITEM_KINDS = [
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "tool_search_call",
    "tool_search_output",
    "computer_call",
    "computer_call_output",
    "item_reference",
    "message",
    "reasoning",
]


@st.composite
def item_lists(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Items of every kind the pairing reads, their ids drawn from a few (so that outputs
    answer calls, or none, and local shell outputs answer by ``call_id`` or ``id``)."""
    ids = st.sampled_from(["c1", "c2", "c3", "ls_1", "ls_2"])
    items: list[dict[str, Any]] = []
    for kind in draw(st.lists(st.sampled_from(_ITEM_KINDS), max_size=14)):
        if kind == "message":
            items.append(user("hi"))
        elif kind == "reasoning":
            items.append({"type": "reasoning", "summary": []})
        elif kind == "item_reference":
            items.append({"type": "item_reference", "id": "msg_1"})
        else:
            item: dict[str, Any] = {"type": kind}
            if draw(st.booleans()) or not kind.startswith("local_shell"):
                item["call_id"] = draw(ids)
            if kind.startswith("local_shell") and draw(st.booleans()):
                item["id"] = draw(ids)
            if kind.startswith("tool_search"):
                item["execution"] = draw(st.sampled_from(["client", "server"]))
            items.append(item)
    return items


@settings(max_examples=400, deadline=None)
@given(
    earlier=item_lists(),
    appended=item_lists(),
    stored=st.sampled_from([{}, {"previous_response_id": "resp_1"}, {"conversation": "conv_1"}]),
)
def test_a_check_resumed_from_the_last_turn_answers_as_a_whole_one(
    earlier: list[dict[str, Any]], appended: list[dict[str, Any]], stored: dict[str, Any]
) -> None:
    """An agent's next turn (the same item objects, then more) is checked from where the last
    one's check ended: the answer is the check of the whole list's, which is the repair's."""
    body = {"input": earlier, **stored}
    needed, scan, resumed = respairing.check(body)
    assert scan is not None and resumed is None
    assert needed == bool(respairing.repair_input(body, interrupted_note="x").repairs)
    later = {"input": [*earlier, *appended], **stored}
    again, after, resumed = respairing.check(later, [scan])
    assert resumed is scan  # read past the last turn's items only
    assert again == respairing.needs_repair(later)
    assert again == bool(respairing.repair_input(later, interrupted_note="x").repairs)
    assert after is not None and after.items == tuple(later["input"])
    # A list that holds the same items, but not the very objects, is read whole
    copied = {"input": copy.deepcopy(later["input"]), **stored}
    assert respairing.check(copied, [scan])[2] is (scan if not earlier else None)


@settings(max_examples=400, deadline=None)
@given(earlier=item_lists(), turns=st.integers(1, 3), parallel=st.integers(1, 2))
def test_a_repaired_turn_is_the_start_of_the_next_turns_repair(
    earlier: list[dict[str, Any]], turns: int, parallel: int
) -> None:
    """A model that does not reason (gpt-4.1) puts its next calls right after the last outputs:
    they joined the run of an interrupted call, whose synthetic output moved behind them every
    turn, the prefix the provider had cached with it (a review read 6,016 of 6,300 cached where
    6,144 were the same, and cachegate's own log named the client's rewrite at input[4]). A
    turn that continues a repaired one after an output, or after anything that is no call,
    repairs to the previous turn's repair and more."""
    if earlier and earlier[-1].get("type") in respairing.OUTPUT_OF:
        earlier = [*earlier, user("go on")]  # (calls right after calls: one turn's, parallel)
    history = earlier
    before = repaired({"input": history}).messages
    for turn in range(turns):
        ids = [f"t{turn}_{k}" for k in range(parallel)]
        history = [*history, *(call(i) for i in ids), *(output(i) for i in ids)]
        after = repaired({"input": history}).messages
        assert orjson.dumps(after[: len(before)]) == orjson.dumps(before)
        before = after


@settings(max_examples=400, deadline=None)
@given(
    earlier=item_lists(),
    turns=st.integers(1, 3),
    parallel=st.integers(1, 2),
    answered=st.booleans(),
)
def test_a_call_made_after_an_interrupted_one_leaves_its_output_where_it_was(
    earlier: list[dict[str, Any]], turns: int, parallel: int, answered: bool
) -> None:
    """The model, told by the synthetic output that its call was interrupted, calls again: in
    the client's list, which never had that output, the new call comes right after the
    interrupted one, joined its run, and the synthetic output moved behind it, a rewrite of
    the prefix the provider had cached every such turn (a review: ``[user, call_1]``, then
    ``[user, call_1, call_2]``, forwarded as ``call_1 call_2 output_1``). With where the
    session's last repair put each output (``placed``), each turn repairs to the previous
    turn's repair and more, whether or not the new calls are answered."""
    history, placed = earlier, {}
    record: dict[str, int] = {}
    before = repaired({"input": history}, placed=placed, record=record).messages
    for turn in range(turns):
        placed = {**{k: v for k, v in placed.items() if k not in record}, **record}
        record = {}
        ids = [f"t{turn}_{k}" for k in range(parallel)]
        history = [*history, *(call(i) for i in ids)]
        if answered:
            history += [output(i) for i in ids]
        after = repaired({"input": history}, placed=placed, record=record).messages
        assert orjson.dumps(after[: len(before)]) == orjson.dumps(before)
        assert accepted({"input": after}) or not accepted({"input": before})
        before = after


def test_a_place_from_another_history_is_not_taken() -> None:
    """A place kept for a call id that is not where it was (another history, a call edited
    away) outside the call's run is not taken: the run's end is."""
    items = [user("go"), call("c1"), user("stop"), call("c2")]
    result = repaired({"input": items}, placed={"c1": 4, "c2": 1})
    assert [i.get("call_id") for i in result.messages] == [None, "c1", "c1", None, "c2", "c2"]


def test_the_strict_diagnosis_names_each_item() -> None:
    body = {"input": [call("c1"), output("c7", kind="custom_tool_call_output")]}
    text = respairing.format_strict_error(body, respairing.diagnose(body))
    assert text == (
        "cachegate strict pairing: 2 defects: input[0] function_call c1 has no output"
        " (dangling_call); input[1] custom_tool_call_output for c7 answers no call (orphan_result)"
    )


# -- end to end: the official SDK, cachegate, the simulator ---------------------------------------


@pytest.fixture
def sim() -> Iterator[RunningSimulator]:
    with run_simulator(SimConfig()) as running:
        yield running


INTERRUPTED: list[dict[str, Any]] = [
    {"role": "user", "content": "list the files"},
    {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_ls",
        "name": "exec_command",
        "arguments": '{"cmd":"ls"}',
    },
    {"role": "user", "content": "stop, show me the README instead"},
]


def test_the_provider_refuses_an_interrupted_turn_that_cachegate_repairs(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(sim.api_base).responses.create(model="gpt-5", input=INTERRUPTED)
    assert "No tool output found for function call call_ls." in str(refused.value)

    proxy = proxy_factory(sim.api_base)
    raw = sdk(proxy.base_url).responses.with_raw_response.create(model="gpt-5", input=INTERRUPTED)
    assert raw.status_code == 200
    assert raw.headers["x-cachegate-repairs"] == "1"
    assert raw.parse().output_text == "Done."
    sent = sim.sim.requests[-1].body["input"]
    assert sent[:2] == INTERRUPTED[:2] and sent[3] == INTERRUPTED[2]
    assert sent[2] == {
        "type": "function_call_output",
        "call_id": "call_ls",
        "output": DEFAULT_INTERRUPTED_NOTE.replace("{name}", "exec_command"),
    }
    assert proxy.metric("cachegate_pairing_repairs_total", {"kind": "dangling_call"}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_made_again_after_an_interrupted_one_keeps_the_forwarded_prefix(
    stream: bool, sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """gpt-4.1, told its call was interrupted, calls again; the client's list has the new call
    right after the interrupted one (it never had cachegate's output). The synthetic output
    moved behind the new call: each forwarded input rewrote the one before at its third item."""
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url, default_headers={"X-Session-Id": "called-again"})
    turns = [
        [user("fix the test"), call("call_1")],
        [user("fix the test"), call("call_1"), call("call_2")],
        [
            user("fix the test"),
            call("call_1"),
            call("call_2"),
            call("call_3"),
            output("call_3"),
            {"role": "assistant", "content": "done"},
            user("thanks"),
        ],
    ]
    for items in turns:
        if stream:
            with client.responses.with_streaming_response.create(
                model="gpt-4.1", input=items, stream=True
            ) as raw:
                assert raw.headers["x-cachegate-repairs"] in ("1", "2")
                assert list(raw.parse())[-1].type == "response.completed"
        else:
            raw = client.responses.with_raw_response.create(model="gpt-4.1", input=items)
            assert raw.status_code == 200
    sent = [r.body["input"] for r in sim.sim.requests]
    assert [(i.get("type"), i.get("call_id")) for i in sent[1]] == [
        (None, None),
        ("function_call", "call_1"),
        ("function_call_output", "call_1"),
        ("function_call", "call_2"),
        ("function_call_output", "call_2"),
    ]
    assert sent[1][: len(sent[0])] == sent[0] and sent[2][: len(sent[1])] == sent[1]


def test_codex_tool_search_interrupted_and_a_trimmed_screenshot_are_accepted_through_cachegate(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """The two Responses API pairings a review found relayed to a 400: a client-run tool search
    cut by Ctrl+C, a computer call's screenshot whose call was trimmed. Both streamed."""
    shot = {"type": "computer_screenshot", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    screenshot = {"type": "computer_call_output", "call_id": "cu_old", "output": shot}
    items = [user("book a meeting"), screenshot, search("call_ts"), user("stop")]
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(sim.api_base).responses.create(model="gpt-5", input=items)
    assert "No tool output found for tool search call call_ts." in str(refused.value)

    proxy = proxy_factory(sim.api_base)
    with sdk(proxy.base_url).responses.with_streaming_response.create(
        model="gpt-5", input=items, stream=True
    ) as raw:
        assert raw.headers["x-cachegate-repairs"] == "2"
        events = list(raw.parse())
    assert events[-1].type == "response.completed"
    sent = sim.sim.requests[-1].body["input"]
    assert [item.get("type") for item in sent] == [
        None,
        "message",
        "tool_search_call",
        "tool_search_output",
        None,
    ]
    assert sent[1]["content"][1]["image_url"] == shot["image_url"]
    assert sent[3]["call_id"] == "call_ts" and sent[3]["tools"] == []


def test_a_repaired_streamed_request_streams_the_providers_events(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    proxy = proxy_factory(sim.api_base, {"pairing": {"interrupted_note": "cut: {name}"}})
    sim.sim.enqueue(["The README says hello."])
    events = list(
        sdk(proxy.base_url).responses.create(model="gpt-5", input=INTERRUPTED, stream=True)
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        "The README says hello."
    )
    assert events[-1].type == "response.completed"
    assert sim.sim.requests[-1].body["input"][2]["output"] == "cut: exec_command"


def test_a_sound_request_is_forwarded_byte_for_byte(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    body = {
        "model": "gpt-5",
        "input": [
            *INTERRUPTED[:2],
            {"type": "function_call_output", "call_id": "call_ls", "output": "a\nb"},
        ],
        "stream": True,
    }
    raw = orjson.dumps(body, option=orjson.OPT_INDENT_2)  # (not how cachegate would write it)
    with httpx.Client() as client:
        through = client.post(proxy.base_url + "/responses", content=raw)
        direct = client.post(sim.api_base + "/responses", content=raw)
    assert through.status_code == 200 and through.headers["x-cachegate-repairs"] == "0"
    assert [r.raw for r in sim.sim.requests] == [raw, raw]
    # the same stream both ways, ids aside (each answer draws its own)
    assert (
        len(through.content) == len(direct.content)
        and b"event: response.completed" in through.content
    )


def test_an_orphan_output_is_downgraded_or_dropped_as_configured(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    items = [
        {"role": "user", "content": "hi"},
        {"type": "function_call_output", "call_id": "call_old", "output": "stale result"},
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(sim.api_base).responses.create(model="gpt-5", input=items)
    assert "No tool call found for function call output with call_id call_old." in str(
        refused.value
    )
    kept = proxy_factory(sim.api_base)
    assert sdk(kept.base_url).responses.create(model="gpt-5", input=items).output_text == "Done."
    assert sim.sim.requests[-1].body["input"][1]["content"][0]["text"] == (
        "[tool result for call call_old (no matching tool call)]\nstale result"
    )
    dropping = proxy_factory(sim.api_base, {"pairing": {"orphan_policy": "drop"}})
    sdk(dropping.base_url).responses.create(model="gpt-5", input=items)
    assert sim.sim.requests[-1].body["input"] == items[:1]
    assert kept.metric("cachegate_pairing_repairs_total", {"kind": "orphan_result"}) == 1
    # outputs alone (a client that lost its previous_response_id): dropped, nothing was left,
    # and they went as sent, refused with 400 and X-Cachegate-Repairs: 0; downgraded instead
    alone = items[1:]
    raw = sdk(dropping.base_url).responses.with_raw_response.create(model="gpt-5", input=alone)
    assert raw.parse().output_text == "Done."
    assert raw.headers["x-cachegate-repairs"] == "1"
    assert sim.sim.requests[-1].body["input"][0]["content"][0]["text"] == (
        "[tool result for call call_old (no matching tool call)]\nstale result"
    )
    assert dropping.metric("cachegate_pairing_repairs_total", {"kind": "orphan_result"}) == 2


def test_strict_mode_refuses_with_a_diagnosis_and_forwards_nothing(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url, default_headers={"X-Cachegate-Strict": "1"})
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="gpt-5", input=INTERRUPTED)
    err = refused.value.body
    assert isinstance(err, dict)
    assert err["code"] == "strict_pairing" and err["param"] == "input"
    assert err["message"] == (
        "cachegate strict pairing: 1 defect: input[1] function_call call_ls has no output"
        " (dangling_call)"
    )
    assert sim.sim.requests == []
    assert refused.value.response.headers["x-cachegate-repairs"] == "0"  # (as on the chat route)
    assert proxy.metric("cachegate_strict_rejections_total") == 1
    assert proxy.metric("cachegate_pairing_repairs_total", {"kind": "dangling_call"}) == 0


def test_with_repair_off_the_providers_refusal_comes_back(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    proxy = proxy_factory(sim.api_base, {"pairing": {"repair": False}})
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(proxy.base_url).responses.create(model="gpt-5", input=INTERRUPTED)
    assert "No tool output found for function call call_ls." in str(refused.value)
    assert sim.sim.requests[-1].body["input"] == INTERRUPTED


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
def test_a_compressed_request_is_repaired_and_sent_decoded(
    sim: RunningSimulator, proxy_factory: Any, coding: str
) -> None:
    """Codex CLI signed in with ChatGPT compresses every request with zstd: a body cachegate
    cannot read is not repaired (it went as it came, and said ``X-Cachegate-Repairs: 0``)."""
    import zstandard

    proxy = proxy_factory(sim.api_base)
    body = orjson.dumps({"model": "gpt-5", "input": INTERRUPTED})
    packed = gzip.compress(body) if coding == "gzip" else zstandard.ZstdCompressor().compress(body)
    with httpx.Client() as client:
        answer = client.post(
            proxy.base_url + "/responses",
            content=packed,
            headers={"content-encoding": coding, "content-type": "application/json"},
        )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-cachegate-repairs"] == "1"
    received = sim.sim.requests[-1]
    assert "content-encoding" not in received.headers
    assert received.body["input"][2]["call_id"] == "call_ls"


def test_a_body_cachegate_cannot_read_goes_to_the_provider_as_it_came(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    raw = b'{"model": "gpt-5", "input": [{"type": "function_call", "call_id": "c1",'
    with httpx.Client() as client:
        answer = client.post(proxy.base_url + "/responses", content=raw)
        brotli = client.post(
            proxy.base_url + "/responses", content=raw, headers={"content-encoding": "br"}
        )
    assert answer.status_code == 400 and "parse the JSON body" in answer.text
    assert [r.raw for r in sim.sim.requests] == [raw, raw]
    # not read, so not checked: no count of repairs is said for either
    assert "x-cachegate-repairs" not in answer.headers
    assert "x-cachegate-repairs" not in brotli.headers


@pytest.mark.parametrize("kind", [[], ["message"], {"a": 1}])
def test_an_item_whose_type_is_no_string_is_checked_without_a_traceback(
    sim: RunningSimulator, proxy_factory: Any, caplog: pytest.LogCaptureFixture, kind: Any
) -> None:
    """An item whose ``type`` is a list, beside a call: the check raised (unhashable), each such
    request left a traceback on stderr, and strict mode let it through unchecked. The call's
    pairing is checked as ever; the provider refuses the type with its own 400."""
    proxy = proxy_factory(sim.api_base)
    body = {
        "model": "gpt-5",
        "input": [{"role": "user", "content": "hi", "type": kind}, *INTERRUPTED[1:2]],
    }
    with caplog.at_level(logging.ERROR), httpx.Client() as client:
        plain = client.post(proxy.base_url + "/responses", json=body)
        strict = client.post(
            proxy.base_url + "/responses", json=body, headers={"X-Cachegate-Strict": "1"}
        )
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert plain.headers["x-cachegate-repairs"] == "1"  # the call given its output
    assert plain.status_code == 400  # the provider's, on the type
    assert plain.json()["error"]["param"] == "input[0].type"
    assert strict.status_code == 400 and strict.json()["error"]["code"] == "strict_pairing"
    assert len(sim.sim.requests) == 1  # the strict one went nowhere


def test_a_local_shell_history_goes_through_untouched(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    raw = orjson.dumps(
        {
            "model": "gpt-5",
            "input": [
                {"type": "local_shell_call", "id": "lsh_1", "call_id": "call_1", "action": {}},
                {"type": "local_shell_call_output", "id": "call_1", "output": "README.md"},
            ],
        }
    )
    answer = httpx.post(proxy.base_url + "/responses", content=raw)
    assert answer.status_code == 200 and answer.headers["x-cachegate-repairs"] == "0"
    assert sim.sim.requests[-1].raw == raw


def test_a_body_with_a_lone_surrogate_is_repaired_as_chat_bodies_are(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """JavaScript writes a text cut inside an emoji as a lone surrogate escape, which orjson
    refuses: such a body was forwarded unrepaired (and unjudged in strict mode)."""
    proxy = proxy_factory(sim.api_base)
    raw = (
        b'{"model":"gpt-5","input":[{"role":"user","content":"cut emoji \\ud83d"},'
        b'{"type":"function_call","call_id":"c1","name":"f","arguments":"{}"}]}'
    )
    with httpx.Client() as client:
        answer = client.post(proxy.base_url + "/responses", content=raw)
        strict = client.post(
            proxy.base_url + "/responses", content=raw, headers={"x-cachegate-strict": "1"}
        )
    assert answer.status_code == 200 and answer.headers["x-cachegate-repairs"] == "1"
    sent = sim.sim.requests[-1].body["input"]
    assert sent[0]["content"] == "cut emoji \ufffd" and sent[2]["call_id"] == "c1"
    assert strict.status_code == 400 and strict.json()["error"]["code"] == "strict_pairing"
    assert len(sim.sim.requests) == 1


@pytest.mark.parametrize("big", [2**128 - 1, -(2**63) - 1, -9999999999999999999])
@pytest.mark.parametrize("surrogate", [False, True])
def test_a_repaired_body_keeps_an_integer_beyond_64_bits(
    sim: RunningSimulator, proxy_factory: Any, big: int, surrogate: bool
) -> None:
    """orjson reads an integer beyond 64 bits as a double (a negative one has 19 digits);
    with a lone surrogate in the body too, the lenient reading refused it, and the body went
    unrepaired."""
    proxy = proxy_factory(sim.api_base)
    text = "cut \\ud83d" if surrogate else "plain"
    raw = orjson.dumps({"model": "gpt-5", "input": INTERRUPTED, "user": "@"}).replace(
        b'"@"', b'"%s"' % text.encode()
    )[:-1] + (b',"tools":[{"type":"function","name":"f","parameters":{"maximum":%d}}]}' % big)
    answer = httpx.post(proxy.base_url + "/responses", content=raw)
    assert answer.status_code == 200 and answer.headers["x-cachegate-repairs"] == "1"
    assert b'"maximum":%d' % big in sim.sim.requests[-1].raw


def test_a_refusal_naming_a_session_cachegate_does_not_hold_makes_no_log(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Refused before its body was read (too large): no session is made for it, as on the chat
    route (a flood of refusals would push real sessions out)."""
    proxy = proxy_factory(sim.api_base, {"server": {"max_body_bytes": 1000}})
    answer = httpx.post(
        proxy.url + "/s/never-seen/v1/responses",
        json={"model": "gpt-5", "input": [{"role": "user", "content": "x" * 2000}]},
    )
    assert answer.status_code == 413 and answer.headers["x-cachegate-session"] == "never-seen"
    proxy.settle()
    assert not (proxy.log_dir / "never-seen.jsonl").exists()
    assert sim.sim.requests == []


def test_a_strict_refusal_is_logged_in_the_requests_session_as_on_the_chat_route(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    answer = httpx.post(
        proxy.url + "/s/strict-1/v1/responses",
        json={"model": "gpt-5", "input": INTERRUPTED},
        headers={"x-cachegate-strict": "1"},
    )
    assert answer.status_code == 400 and answer.headers["x-cachegate-session"] == "strict-1"
    proxy.settle()
    lines = [
        orjson.loads(line) for line in (proxy.log_dir / "strict-1.jsonl").read_bytes().splitlines()
    ]
    assert [e["type"] for e in lines] == ["session_meta", "error"]
    assert lines[1]["status"] == 400 and lines[1]["forwarded"] is False
    assert "input[1] function_call call_ls has no output" in lines[1]["message"]
    assert proxy.metric("cachegate_strict_rejections_total") == 1
    assert sim.sim.requests == []


def test_an_agent_loop_interrupted_between_a_call_and_its_output_goes_on(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """An agent's tool loop over the Responses API, as the SDK's users write it: the model's
    output items appended to the input, each call's output after them. Interrupted while its
    tool ran (no output recorded), the user types on: the provider refuses that input, and
    cachegate repairs it, turn after turn, the same way."""
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)
    call = {"tool_calls": [{"name": "run", "arguments": {"cmd": "pytest"}, "id": "call_t"}]}
    sim.sim.enqueue([call, "Stopped; reading the README.", "It says hello."])
    items: list[Any] = [{"role": "user", "content": "run the tests"}]
    first = client.responses.create(model="gpt-5", input=items)
    items += [o.model_dump(exclude_none=True) for o in first.output]
    assert [i["type"] for i in items[1:]] == ["function_call"]
    # Ctrl+C while pytest ran: no output, and the user's next message
    items.append({"role": "user", "content": "stop, read the README instead"})
    for _ in range(2):
        answer = client.responses.with_raw_response.create(model="gpt-5", input=items)
        assert answer.status_code == 200 and answer.headers["x-cachegate-repairs"] == "1"
        sent = sim.sim.requests[-1].body["input"]
        assert sent[2] == {
            "type": "function_call_output",
            "call_id": "call_t",
            "output": DEFAULT_INTERRUPTED_NOTE.replace("{name}", "run"),
        }
        assert sent[3] == items[2]
        items += [o.model_dump(exclude_none=True) for o in answer.parse().output]
        items.append({"role": "user", "content": "and now?"})
    # the repaired history is the next turn's prefix: the provider's cache keeps hitting
    once, twice = (r.body["input"] for r in sim.sim.requests[1:])
    assert twice[: len(once)] == once and len(twice) == len(once) + 2


@pytest.mark.parametrize("paired", [False, True])
def test_a_streamed_responses_request_counts_among_the_streams_in_flight(
    scripted: Any, proxy_factory: Any, paired: bool
) -> None:
    """``cachegate_active_streams`` ("responses being streamed to clients right now") read 0
    all through a Responses API stream: only chat's were counted. The body is parsed where it
    has calls to pair, else looked through for its ``stream`` key."""
    events = [b"event: response.output_text.delta\ndata: {}\n\n"] * 6
    upstream, base = scripted(chunks=events, delay_s=0.15)
    proxy = proxy_factory(base)
    items: list[Any] = [{"role": "user", "content": "hi"}]
    if paired:
        items += [call("c1"), output("c1")]
    body = {"model": "gpt-5", "stream": True, "input": items}
    with (
        httpx.Client() as client,
        client.stream("POST", proxy.base_url + "/responses", json=body) as answer,
    ):
        chunks = answer.iter_bytes()
        next(chunks)
        # (read now: ``proxy.metric`` waits for the exchanges in flight, this one too)
        assert proxy.registry.get_sample_value("cachegate_active_streams") == 1
        assert b"".join(chunks)
    assert proxy.metric("cachegate_active_streams") == 0
    plain = httpx.post(proxy.base_url + "/responses", json={**body, "stream": False})
    assert plain.status_code == 200 and len(upstream.requests) == 2
    assert proxy.metric("cachegate_active_streams") == 0


def test_a_slow_upload_is_not_counted_as_cachegates_overhead(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The time a client took to send its body counted as cachegate's overhead on the chat and
    Responses routes (2 s for a client that paused mid-upload), where other relayed requests
    start forwarding at its first byte."""
    import socket
    import time

    proxy = proxy_factory(sim.api_base)
    host, port = proxy.url.removeprefix("http://").split(":")
    for path, body in (
        ("/v1/responses", {"model": "gpt-5", "input": INTERRUPTED}),
        (
            "/v1/chat/completions",
            {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
        ),
    ):
        raw = orjson.dumps(body)
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(
                f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(raw)}\r\n\r\n".encode()
                + raw[:10]
            )
            time.sleep(1.0)
            conn.sendall(raw[10:])
            assert conn.recv(65536).startswith(b"HTTP/1.1 200")
    route = {"route": "chat"}
    assert proxy.metric("cachegate_proxy_overhead_seconds_count", route) == 1
    assert proxy.metric("cachegate_proxy_overhead_seconds_sum", route) < 0.5
    route = {"route": "responses"}
    assert proxy.metric("cachegate_proxy_overhead_seconds_count", route) == 1
    assert proxy.metric("cachegate_proxy_overhead_seconds_sum", route) < 0.5


def test_the_stored_answers_calls_left_unanswered_get_outputs() -> None:
    """The calls of the answer a ``previous_response_id`` continues (as cachegate relayed it)
    that the input gives no output for: each a synthetic output, a custom tool's its own kind;
    one the input answers (anywhere in it) keeps its own."""
    stored = [call("c1", "shell"), call("c2", "apply", "custom_tool_call"), call("c3", "read")]
    body = {
        "previous_response_id": "resp_1",
        "input": [
            {"type": "function_call_output", "call_id": "c3", "output": "ok"},
            {"role": "user", "content": "stop"},
        ],
    }
    made = respairing.stored_call_outputs(body, stored, NOTE)
    assert [(output, call_id, name) for output, call_id, name in made] == [
        (
            {"type": "function_call_output", "call_id": "c1", "output": "interrupted: shell"},
            "c1",
            "shell",
        ),
        (
            {"type": "custom_tool_call_output", "call_id": "c2", "output": "interrupted: apply"},
            "c2",
            "apply",
        ),
    ]
    answered = {**body, "input": [*(o for o, _, _ in made), *body["input"]]}
    assert respairing.stored_call_outputs(answered, stored, NOTE) == []
    assert respairing.stored_call_outputs({"input": "go on"}, stored[:1], NOTE)[0][1] == "c1"
