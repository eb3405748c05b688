"""Hash chain and first divergence of forwarded requests (proxy/prefix.py)."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.prefix import (
    Divergence,
    _kept_pieces,
    canonical_message,
    claude_blocks,
    dropped_elements,
    find_divergence,
    fingerprint,
    has_cache_marker,
    longer_lived_share,
    lookback_reach,
    marked_share,
    marked_ttl_s,
    retimed_messages,
    same_conversation,
    shared_links,
    shared_prefix_len,
    volatile_kind,
)

SYSTEM = "You are a careful coding agent. Work in the repository at /src."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
]


def call(call_id: str, cmd: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "shell", "arguments": orjson.dumps({"cmd": cmd}).decode()},
            }
        ],
    }


def result(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def conversation() -> dict[str, Any]:
    return {
        "model": "gpt-4o",
        "stream": True,
        "tools": TOOLS,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Run the tests and fix what fails."},
            call("call_1", "pytest -q"),
            result("call_1", "3 passed, 1 failed: test_parse - AssertionError"),
            call("call_2", "cat proxy/parse.py"),
            result("call_2", "def parse(x):\n    return x.split(',')\n"),
        ],
    }


def diverge(old: dict[str, Any], new: dict[str, Any]) -> Divergence | None:
    return find_divergence(fingerprint(old), fingerprint(new), old, new)


def test_chain_lists_params_tools_system_then_each_message() -> None:
    fp = fingerprint(conversation())
    assert [location for location, _ in fp.chain] == [
        "params",
        "tools",
        "system",
        "messages[1]",
        "messages[2]",
        "messages[3]",
        "messages[4]",
        "messages[5]",
    ]
    assert len({digest for _, digest in fp.chain}) == len(fp.chain)
    assert all(len(digest) == 16 for digest in fp.digests)


def test_next_turn_that_appends_reply_and_new_messages_is_no_divergence() -> None:
    old = conversation()
    new = copy.deepcopy(old)
    new["messages"] += [
        call("call_3", "pytest -q"),
        result("call_3", "4 passed"),
        {"role": "assistant", "content": "All tests pass now."},
        {"role": "user", "content": "Thanks, commit it."},
    ]
    assert diverge(old, new) is None
    assert shared_prefix_len(fingerprint(old), fingerprint(new)) == 6


def test_retry_that_drops_the_last_messages_is_no_divergence() -> None:
    old = conversation()
    new = copy.deepcopy(old)
    del new["messages"][4:]
    assert diverge(old, new) is None
    assert shared_prefix_len(fingerprint(old), fingerprint(new)) == 4


def test_key_order_null_keys_and_streamed_index_never_read_as_rewrite() -> None:
    old = conversation()
    new = copy.deepcopy(old)
    # What a client rebuilding the history from a streamed reply typically sends instead.
    new["messages"][2] = {
        "tool_calls": [
            {
                "index": 0,
                "function": {"arguments": '{"cmd":"pytest -q"}', "name": "shell"},
                "type": "function",
                "id": "call_1",
            }
        ],
        "role": "assistant",
    }
    new["messages"][1] = {"content": "Run the tests and fix what fails.", "role": "user"}
    new["tools"] = [dict(reversed(list(tool.items()))) for tool in TOOLS]
    assert diverge(old, new) is None
    assert fingerprint(old).head == fingerprint(new).head
    assert canonical_message(new["messages"][2])["tool_calls"][0].keys() == {
        "id",
        "type",
        "function",
    }
    assert "index" in new["messages"][2]["tool_calls"][0]  # the input is not mutated


def test_index_inside_content_parts_is_not_content() -> None:
    old = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    new = {"messages": [{"role": "user", "content": [{"index": 0, "type": "text", "text": "hi"}]}]}
    assert diverge(old, new) is None


def test_one_character_trimmed_from_an_old_tool_output_is_located_exactly() -> None:
    old = conversation()
    old["messages"][3]["content"] = "A" * 50 + "B" + "C" * 50
    new = copy.deepcopy(old)
    new["messages"][3]["content"] = "A" * 50 + "C" * 50
    assert diverge(old, new) == Divergence(
        location="messages",
        index=3,
        role="tool",
        field="content",
        old_excerpt="…" + "A" * 30 + "B" + "C" * 49 + "…",
        new_excerpt="…" + "A" * 30 + "C" * 50,
        volatile=False,
        volatile_kind=None,
    )


def test_changed_tool_call_arguments_name_the_field_and_label() -> None:
    old = conversation()
    new = copy.deepcopy(old)
    new["messages"][4] = call("call_2", "cat proxy/parse.py | head")
    divergence = diverge(old, new)
    assert divergence is not None
    assert (divergence.location, divergence.index, divergence.role, divergence.field) == (
        "messages",
        4,
        "assistant",
        "tool_calls",
    )
    assert divergence.label == "messages[4].tool_calls"
    assert "parse.py | head" in divergence.new_excerpt


def test_reasoning_effort_change_is_a_params_divergence() -> None:
    old = {**conversation(), "reasoning_effort": "medium"}
    new = {**conversation(), "reasoning_effort": "high", "temperature": 0.2}
    assert diverge(old, new) == Divergence(
        "params", None, None, "reasoning_effort", "medium", "high"
    )
    divergence = diverge(old, new)
    assert divergence is not None and divergence.label == "params.reasoning_effort"


def test_sampling_parameters_are_not_cache_relevant() -> None:
    old = {**conversation(), "temperature": 0.0, "max_tokens": 100}
    new = {**conversation(), "temperature": 1.0, "stream": False}
    assert diverge(old, new) is None


def test_a_tool_choice_that_says_the_default_is_no_divergence() -> None:
    """The Node SDK's runTools sends tool_choice "auto"; the same history sent again without
    it counted as a rewrite of the parameters."""
    base = conversation()
    assert base.get("tools")
    assert diverge({**base, "tool_choice": "auto", "parallel_tool_calls": True}, base) is None
    no_tools = {k: v for k, v in base.items() if k != "tools"}
    assert diverge({**no_tools, "tool_choice": "none"}, no_tools) is None
    required = diverge(base, {**base, "tool_choice": "required"})
    assert required is not None and required.label == "params.tool_choice"
    serial = diverge(base, {**base, "parallel_tool_calls": False})
    assert serial is not None and serial.label == "params.parallel_tool_calls"
    # plain text is what no response_format asks for (a client that sets it on some calls)
    assert diverge({**base, "response_format": {"type": "text"}}, base) is None
    assert diverge(base, {**base, "response_format": {"type": "text"}}) is None
    as_json = diverge(base, {**base, "response_format": {"type": "json_object"}})
    assert as_json is not None and as_json.label == "params.response_format"


def test_model_change_is_a_params_divergence() -> None:
    old = conversation()
    new = {**conversation(), "model": "gpt-4o-mini"}
    divergence = diverge(old, new)
    assert divergence is not None
    assert (divergence.location, divergence.field, divergence.label) == (
        "params",
        "model",
        "params.model",
    )


def test_reordered_tools_diverge_at_tools_naming_the_first_moved_tool() -> None:
    old = conversation()
    new = {**conversation(), "tools": list(reversed(TOOLS))}
    divergence = diverge(old, new)
    assert divergence is not None
    assert (divergence.location, divergence.index, divergence.field, divergence.label) == (
        "tools",
        None,
        "read_file",
        "tools",
    )


def test_a_tool_removed_from_the_middle_is_named_not_the_one_after_it() -> None:
    """An MCP server disconnects: [write, read, bash] becomes [write, bash]; the location named
    bash, which is still there."""

    def tool(name: str) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "parameters": {}}}

    old = {**conversation(), "tools": [tool("write"), tool("read"), tool("bash")]}
    new = {**conversation(), "tools": [tool("write"), tool("bash")]}
    divergence = diverge(old, new)
    assert divergence is not None and (divergence.location, divergence.field) == ("tools", "read")
    assert divergence.new_excerpt == ""
    added = diverge(new, old)  # read put back: named as the tool at its place
    assert added is not None and added.field == "read"


def test_tools_removed_together_are_named_by_the_first_gone() -> None:
    """An MCP server with two tools disconnects: the location named the tool after them, still
    there and unchanged, and compared two tools' texts (it read as that tool rewritten)."""

    def tool(name: str) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "parameters": {}}}

    names = ["read", "mcp__create_issue", "mcp__list_prs", "write"]
    old = {**conversation(), "tools": [tool(n) for n in names]}
    new = {**conversation(), "tools": [tool("read"), tool("write")]}
    divergence = diverge(old, new)
    assert divergence is not None
    assert (divergence.field, divergence.new_excerpt) == ("mcp__create_issue", "")
    assert "mcp__create_issue" in divergence.old_excerpt
    # gone, and the one moved up into its place edited too: still the one gone
    edited_next = {**conversation(), "tools": [tool("read"), tool("write")]}
    edited_next["tools"][1]["function"]["description"] = "Write a file."
    both = diverge(old, edited_next)
    assert both is not None and (both.field, both.new_excerpt) == ("mcp__create_issue", "")
    # one edited and the next gone: an edit of the first, named by its new text
    edited = {**conversation(), "tools": [tool("read"), tool("mcp__create_pr"), tool("write")]}
    changed = diverge(old, edited)
    assert changed is not None and changed.field == "mcp__create_pr"
    assert "mcp__create_pr" in changed.new_excerpt


def test_a_system_message_dropped_from_the_block_is_named_as_gone() -> None:
    """Of three system messages (instructions, memory, a repo map) the middle one dropped: it
    read as the memory message edited into the repo map."""
    old = conversation()
    system = old["messages"][0]
    memory = {"role": "system", "content": "Memory: the user prefers tabs."}
    repo_map = {"role": "system", "content": "Repo map: src/, tests/"}
    old["messages"][0:1] = [system, memory, repo_map]
    new = copy.deepcopy(old)
    del new["messages"][1]
    divergence = diverge(old, new)
    assert divergence is not None
    assert (divergence.location, divergence.index, divergence.field) == ("system", 1, None)
    assert (divergence.old_excerpt, divergence.new_excerpt) == (memory["content"], "")
    put_back = diverge(new, old)  # and put in again: the one that appeared
    assert put_back is not None and (put_back.index, put_back.field) == (1, None)
    assert (put_back.old_excerpt, put_back.new_excerpt) == ("", memory["content"])
    edited = copy.deepcopy(old)  # an edit in place is still an edit
    edited["messages"][1]["content"] = "Memory: the user prefers spaces."
    assert (diverge(old, edited) or divergence).field == "content"


def test_a_call_with_no_text_trimmed_from_a_history_shows_its_calls() -> None:
    """The oldest turn dropped where its first message is an assistant's calls with no text:
    the divergence's ``old`` was empty (a Responses API request shows the item's type), and
    the user could not see what was dropped."""
    old = conversation()
    old["messages"].append({"role": "user", "content": "Now run them again."})
    new = copy.deepcopy(old)
    del new["messages"][2:4]  # the first call and its result
    divergence = diverge(old, new)
    assert divergence is not None
    assert (divergence.location, divergence.index, divergence.field) == ("messages", 2, None)
    assert divergence.role == "assistant"
    assert "pytest -q" in divergence.old_excerpt and "call_1" in divergence.old_excerpt


def test_a_history_trimmed_at_its_start_names_the_message_gone_not_an_edit() -> None:
    """A client drops its oldest turn (a sliding window near the context limit): the message
    now at that place is one the previous request sent later. The location is the message that
    vanished (no field), not an edit of the one that moved up into its place."""
    old = conversation()
    old["messages"].append({"role": "user", "content": "Now run them again."})
    new = copy.deepcopy(old)
    del new["messages"][1:3]  # the task and the first call: the first result now follows system
    divergence = diverge(old, new)
    assert divergence is not None
    assert (divergence.location, divergence.index, divergence.field) == ("messages", 1, None)
    assert divergence.role == "user"
    assert divergence.old_excerpt == "Run the tests and fix what fails."
    assert divergence.new_excerpt == ""
    # A message put in before the ones read: named as the one that appeared
    inserted = diverge(new, old)
    assert inserted is not None
    assert (inserted.index, inserted.field, inserted.role) == (1, None, "user")
    assert (inserted.old_excerpt, inserted.new_excerpt) == ("", "Run the tests and fix what fails.")
    # An edit in place is still an edit of its field, even into the text of a later message
    edited = copy.deepcopy(old)
    edited["messages"][1]["content"] = "Run the tests."
    assert (diverge(old, edited) or divergence).field == "content"
    edited["messages"][1]["content"] = "Now run them again."  # (what messages[6] says)
    assert (diverge(old, edited) or divergence).field == "content"
    # The first message kept made anew (cachegate's repair of a result whose call was trimmed,
    # a user message in its place): what follows it lines up, so still the message that vanished
    repaired = copy.deepcopy(new)
    repaired["messages"][1] = {"role": "user", "content": "[tool result for call_1]"}
    made = diverge(old, repaired)
    assert made is not None and (made.index, made.field) == (1, None)
    assert made.old_excerpt == "Run the tests and fix what fails."
    # A message put in before the previous request's last one: that one follows it
    reminder = copy.deepcopy(old)
    reminder["messages"].insert(6, {"role": "user", "content": "<reminder>Use pytest</reminder>"})
    reminder["messages"].append({"role": "user", "content": "Commit it."})
    put = diverge(old, reminder)
    assert put is not None and (put.index, put.field, put.old_excerpt) == (6, None, "")
    reminder["messages"].insert(7, {"role": "assistant", "content": "Noted."})  # and its reply
    put = diverge(old, reminder)
    assert put is not None and (put.index, put.field, put.old_excerpt) == (6, None, "")
    # A dated message dropped is a message gone, not a timestamp changed
    dated = copy.deepcopy(old)
    dated["messages"].insert(1, {"role": "user", "content": "Current time: 2025-03-14T09:26Z"})
    gone = diverge(dated, old)
    assert gone is not None and (gone.index, gone.field) == (1, None)
    assert (gone.volatile, gone.volatile_kind) == (False, None)


@pytest.mark.parametrize("parallel", [2, 3, 4])
def test_a_trim_that_cut_a_round_of_parallel_calls_names_the_messages_gone(parallel: int) -> None:
    """A sliding window cut after an assistant message of parallel calls: each result left
    without its call is repaired into a user message of cachegate's own, and with two or more
    of them the trim read as an edit of the task (``messages[1].content``, "Run the tests…"
    against "[tool result for call_a…]") where one of them read as the messages gone."""
    calls = [f"call_{c}" for c in "abcd"[:parallel]]
    round_ = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": c, "type": "function", "function": {"name": "shell", "arguments": "{}"}}
            for c in calls
        ],
    }
    old = conversation()
    old["messages"][2:2] = [round_, *(result(c, f"output of {c}") for c in calls)]
    old["messages"].append({"role": "user", "content": "Now run them again."})
    new = copy.deepcopy(old)
    kept = old["messages"][3 + parallel :]
    made = [{"role": "user", "content": f"[tool result for {c}] output of {c}"} for c in calls]
    new["messages"] = [old["messages"][0], *made, *kept]
    divergence = diverge(old, new)
    assert divergence is not None
    assert (divergence.location, divergence.index, divergence.field) == ("messages", 1, None)
    assert (divergence.old_excerpt, divergence.new_excerpt) == (
        "Run the tests and fix what fails.",
        "",
    )
    # an edit in place stays one: the same made-anew messages with nothing trimmed before them
    edited = copy.deepcopy(old)
    edited["messages"][1:2] = made[:1]
    assert (diverge(old, edited) or divergence).field == "content"


def test_timestamp_added_to_system_prompt_is_a_volatile_system_rewrite() -> None:
    old = conversation()
    new = copy.deepcopy(old)
    new["messages"][0]["content"] = SYSTEM + "\nCurrent time: 2025-03-14T09:26:53Z"
    divergence = diverge(old, new)
    assert divergence == Divergence(
        location="system",
        index=0,
        role="system",
        field="content",
        old_excerpt="…" + SYSTEM[-30:],
        new_excerpt="…" + SYSTEM[-30:] + "\nCurrent time: 2025-03-14T09:26:53Z",
        volatile=True,
        volatile_kind="timestamp",
    )
    assert divergence.label == "system"


def test_added_developer_message_diverges_at_system() -> None:
    old = conversation()
    new = copy.deepcopy(old)
    new["messages"].insert(1, {"role": "developer", "content": "Be brief."})
    divergence = diverge(old, new)
    assert divergence is not None
    assert (divergence.location, divergence.index, divergence.role, divergence.field) == (
        "system",
        1,
        "developer",
        None,
    )
    assert (divergence.old_excerpt, divergence.new_excerpt) == ("", "Be brief.")


@pytest.mark.parametrize(
    ("old", "new", "kind"),
    [
        ("Now: 2025-03-14T09:26:53Z.", "Now: 2025-03-14T09:31:02Z.", "timestamp"),
        ("Now: 2025-03-14 09:26:53 UTC.", "Now: 2025-03-14 10:00:00 UTC.", "timestamp"),
        ("It is 9:26 AM.", "It is 11:05 AM.", "timestamp"),
        ("epoch=1741944413 ok", "epoch=1741944999 ok", "timestamp"),
        ("Today is 2025-03-14.", "Today is 2025-03-15.", "date"),
        ("Today is March 14, 2025.", "Today is March 15, 2025.", "date"),
        ("Today is 03/14/2025.", "Today is 03/15/2025.", "date"),
        ("It is Friday.", "It is Saturday.", "date"),
        # a day's end in the formats that write the weekday short (it changed with the day)
        ("Now: Mon Jan  6 23:58:00 2025.", "Now: Tue Jan  7 00:01:00 2025.", "timestamp"),
        ("Now: Mon Jan  6 23:58:00 UTC 2025.", "Now: Tue Jan  7 00:01:00 UTC 2025.", "timestamp"),
        (
            "Now: Mon Jan 06 2025 23:58:00 GMT+0000 (Coordinated Universal Time)",
            "Now: Tue Jan 07 2025 00:01:00 GMT+0000 (Coordinated Universal Time)",
            "timestamp",
        ),
        ("Date: Mon, 06 Jan 2025 23:58:00 GMT", "Date: Tue, 07 Jan 2025 00:01:00 GMT", "timestamp"),
        ("Today is Mon Jan 06 2025.", "Today is Tue Jan 07 2025.", "date"),
        # `date` and `date +%c` in en_US (a 12-hour clock: noon and midnight) and in en_GB
        (
            "Now: Mon Jan  6 11:58:05 AM UTC 2025",
            "Now: Mon Jan  6 12:03:09 PM UTC 2025",
            "timestamp",
        ),
        (
            "Now: Mon 06 Jan 2025 11:58:05 PM UTC",
            "Now: Tue 07 Jan 2025 12:03:09 AM UTC",
            "timestamp",
        ),
        ("Now: Mon  6 Jan 23:58:05 UTC 2025", "Now: Tue  7 Jan 00:03:05 UTC 2025", "timestamp"),
        ("Today is Sat, 31 May 2025.", "Today is Sun, 1 Jun 2025.", "date"),
        ("You are helpful.", "You are helpful.\nNow: Tue Jan  7 00:01:00 2025", "timestamp"),
        (
            "request 9f1c2d3e-4b5a-4c6d-8e7f-0a1b2c3d4e5f done",
            "request 0b1c2d3e-4b5a-4c6d-8e7f-0a1b2c3d4e5f done",
            "uuid",
        ),
        ("trace 3fa9c0d2e4b61a7f in", "trace 77aa10d2e4b61a7f in", "id"),
        ("This is turn 7 of the session.", "This is turn 8 of the session.", "counter"),
        ("You are helpful.", "You are helpful.\nToday's date: 2025-03-14", "date"),
        (
            "You are helpful.",
            "Session 9f1c2d3e-4b5a-4c6d-8e7f-0a1b2c3d4e5f. You are helpful.",
            "uuid",
        ),
    ],
)
def test_volatile_token_changes_are_named(old: str, new: str, kind: str) -> None:
    assert volatile_kind(old, new) == kind


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("Indent with tabs.", "Indent with spaces."),
        ("Sun Microsystems made Java.", "Sat Microsystems made Java."),  # a word, not a date
        # a capital word after a weekday's date and time is no time zone
        ("Status: Mon Jan 6 10:00 TODO list", "Status: Mon Jan 6 10:00 DONE list"),
        ("Status: Mon, 6 Jan 2025 10:00 TODO list", "Status: Mon, 6 Jan 2025 10:00 DONE list"),
        ("Run the tests.", "Run 3 tests."),  # a number alone added is editing, not a counter
        (
            "Notes:",
            "Notes: on 2025-03-14 we decided to drop Python 3.9 support and move CI to the new "
            "runners, see the thread for details.",
        ),
        ("Today is 2025-03-14. Use tabs.", "Today is 2025-03-15. Use spaces."),
        # another prompt with the time in it, not the same one with the time added (a
        # sub-agent's against its main agent's)
        ("You summarize the code.", "main agent\nCurrent time: 2026-12-02T10:00:00Z"),
    ],
)
def test_real_edits_are_not_volatile(old: str, new: str) -> None:
    assert volatile_kind(old, new) is None


def test_a_long_log_whose_every_timestamp_changed_is_an_edit_not_a_token() -> None:
    old = "".join(f"2025-03-14T10:{m:02d}:00Z build step {m} ok\n" for m in range(60)) * 3
    new = old.replace("T10:", "T11:")
    few = len("2025-03-14T10:00:00Z build step 0 ok\n") * 3
    assert volatile_kind(old[:few], new[:few]) == "timestamp"
    assert volatile_kind(old, new) is None


def test_non_volatile_rewrite_says_so() -> None:
    old = conversation()
    new = copy.deepcopy(old)
    new["messages"][1]["content"] = "Run the tests and fix what fails. Be quick."
    divergence = diverge(old, new)
    assert divergence is not None
    assert (divergence.volatile, divergence.volatile_kind) == (False, None)


@pytest.mark.parametrize(
    "secret",
    [
        "sk-proj-Abcdefghijklmnopqrstuvwx0123456789",
        "AKIAIOSFODNN7EXAMPLE",
        "Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
    ],
)
def test_excerpts_redact_secrets_even_when_cut_by_the_window(secret: str) -> None:
    old = conversation()
    new = copy.deepcopy(old)
    # The secret starts before the excerpt window and runs into it.
    old["messages"][3]["content"] = f"env: {secret}XYZ tail"
    new["messages"][3]["content"] = f"env: {secret}XYW tail"
    divergence = diverge(old, new)
    assert divergence is not None
    for excerpt in (divergence.old_excerpt, divergence.new_excerpt):
        assert "[REDACTED]" in excerpt
        assert secret[-12:] not in excerpt
        assert secret.split()[-1][:12] not in excerpt


@pytest.mark.parametrize(
    "armour", ["RSA PRIVATE KEY", "PGP PRIVATE KEY BLOCK", "OPENSSH PRIVATE KEY"]
)
def test_a_long_private_key_cut_differently_shows_none_of_its_body(armour: str) -> None:
    """An 8192-bit RSA key or a PGP secret key (~6-7 KB) read twice with another cut: the
    excerpts showed its body where the cuts differed, past the window's margin, which no
    longer held the armour line that says what the base64 is."""
    import base64
    import random

    rng = random.Random(7)
    body = base64.encodebytes(bytes(rng.randrange(256) for _ in range(4800))).decode()
    block = f"-----BEGIN {armour}-----\n{body}-----END {armour}-----\n"
    lines = [line for line in body.splitlines() if len(line) > 20]
    # cut anywhere: so that the window begins before the armour line, inside it, or after it
    for cut in (5200, *range(4126, 4170)):
        text = "cat key\n" + block
        old = {"messages": [{"role": "tool", "content": text[:cut] + "\n[cut]"}]}
        new = {"messages": [{"role": "tool", "content": text}]}
        divergence = diverge(old, new)
        assert divergence is not None
        for excerpt in (divergence.old_excerpt, divergence.new_excerpt):
            assert not [line for line in lines if line[:16] in excerpt], (cut, excerpt)


_CLAIMS = base64.urlsafe_b64encode(json.dumps({"sub": "x" * 6000}).encode()).decode()
_SIGNATURE = "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
_JWT = "eyJhbGciOiJIUzI1NiJ9." + _CLAIMS.rstrip("=") + "." + _SIGNATURE


@pytest.mark.parametrize(
    "secret",
    [
        f"Use this token: {_JWT}",
        _JWT,
        f"AWS_SESSION_TOKEN={_JWT}",
        "export AWS_SESSION_TOKEN=FwoGZXIvYXdzE" + "Ab1/" * 1600 + _SIGNATURE,
        # after 100 KB with no white space: compact JSON, a text of written-out escapes
        json.dumps({f"k{i}": f"v{i}" for i in range(9000)}, separators=(",", ":"))[:-1]
        + f',"token":"{_JWT}',
        "line\\n" * 20000 + _JWT,
    ],
    ids=["jwt-after-words", "jwt-first", "jwt-as-a-setting", "sts-token", "json", "escapes"],
)
def test_a_token_longer_than_the_margin_shows_none_of_its_tail(secret: str) -> None:
    """A JWT of 8 KB (claims of a few KB) or an STS session token just before a system prompt's
    change: the window's start cut it, its tail no longer read as a secret, and the excerpt
    put its last ~30 characters, the signature, in the log."""
    old = {"messages": [{"role": "system", "content": f"{secret}\nA: run the tests"}]}
    new = {"messages": [{"role": "system", "content": f"{secret}\nB: run the tests"}]}
    divergence = diverge(old, new)
    assert divergence is not None
    for excerpt, line in ((divergence.old_excerpt, "A"), (divergence.new_excerpt, "B")):
        assert _SIGNATURE[-8:] not in excerpt and "[REDACTED]" in excerpt
        assert excerpt.endswith(f"\n{line}: run the tests")  # (the change still shown)


def test_a_change_inside_a_long_token_points_at_its_marker() -> None:
    """A system prompt whose bearer token (a JWT, its header and claims' start the same) was
    refreshed: both excerpts quoted the same text ~140 characters past the token, nowhere near
    the change, with no sign of it."""
    head = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJhZ2VudCIsImV4cCI6MTc2NTEy"
    body = " ".join(f"rule {n}: keep the tests green." for n in range(80))

    def prompt(tail: str) -> dict[str, Any]:
        conv = conversation()
        conv["messages"][0] = {
            "role": "system",
            "content": f"API token: Bearer {head}{tail}\nYou are a deploy agent. {body}",
        }
        return conv

    old = prompt("MDAwMH0.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c")
    new = prompt("MzYwMH0.Q1w2e3r4t5y6u7i8o9p0aSdFgHjKlZxCvBnM1234567")
    divergence = diverge(old, new)
    assert divergence is not None and divergence.location == "system"
    for excerpt in (divergence.old_excerpt, divergence.new_excerpt):
        assert "Bearer [REDACTED]" in excerpt, excerpt
        assert "SflKx" not in excerpt and "Q1w2e" not in excerpt


def test_another_item_in_an_items_place_is_named_by_its_type() -> None:
    """A Responses API history whose reasoning items were dropped: a call where a reasoning
    item was. The difference was named by the first field the call has (``name``: old "",
    new "shell"), which read as a call that gained a name."""
    from proxy.resview import responses_location

    reasoning = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB" + "x" * 40}
    call_item = {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"}
    user_item = {"role": "user", "content": "go"}
    old = {"messages": [user_item, reasoning, call_item]}
    new = {"messages": [user_item, call_item]}
    divergence = diverge(old, new)
    assert divergence is not None
    assert (divergence.index, divergence.field) == (1, "type")
    assert (divergence.old_excerpt, divergence.new_excerpt) == ("reasoning", "function_call")
    assert responses_location(divergence.label, 0, None) == "input[1].type"
    # items of one type keep their first differing field
    edited = {"messages": [user_item, {**reasoning, "summary": [{"text": "s"}]}, call_item]}
    changed = diverge(old, edited)
    assert changed is not None and changed.field == "summary"


def test_an_item_without_content_that_went_is_shown_by_its_type() -> None:
    """A reasoning item dropped from a longer history (what follows it lines up a place
    earlier): the item vanished, its excerpt was empty on both sides; it is its type."""
    from proxy.resview import responses_location

    reasoning = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB" + "x" * 40}
    call_item = {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    user_item, more = {"role": "user", "content": "go"}, {"role": "user", "content": "more"}
    old = {"messages": [user_item, reasoning, call_item, output, more]}
    new = {"messages": [user_item, call_item, output, more, {"role": "user", "content": "on"}]}
    divergence = diverge(old, new)
    assert divergence is not None and divergence.vanished
    assert (divergence.index, divergence.field) == (1, None)
    assert (divergence.old_excerpt, divergence.new_excerpt) == ("reasoning", "")
    assert responses_location(divergence.label, 0, None) == "input[1]"


KEY = "Zx9Qm4Lr8Tn2Vb6Hc1Kd5Wp7Ys3Fg0Jh4Nm8Rt2U"  # a key of no known shape


def _in_message(body: dict[str, Any], minute: str) -> None:
    body["messages"][3]["content"] = f"Time {minute}. Use the value that follows: VALUE={KEY}"


def _in_tool(body: dict[str, Any], minute: str) -> None:
    body["tools"][0]["function"]["description"] = f"At {minute} call with VALUE={KEY}"


def _in_param(body: dict[str, Any], minute: str) -> None:
    body["response_format"] = {"type": "json_object", "note": f"{minute} VALUE={KEY}"}


@pytest.mark.parametrize("put", [_in_message, _in_tool, _in_param])
def test_no_piece_of_a_known_secret_is_left_where_an_excerpt_cuts_through_it(
    put: Callable[[dict[str, Any], str], None],
) -> None:
    """Pattern redaction knows shapes; the operator's own key may have none. Cut by the excerpt
    and then looked for whole, it was found nowhere and 26 of its 40 characters stayed."""
    old, new = conversation(), conversation()
    old["tools"] = copy.deepcopy(old["tools"])
    new["tools"] = copy.deepcopy(new["tools"])
    put(old, "10:00")
    put(new, "10:01")
    shown = find_divergence(fingerprint(old), fingerprint(new), old, new)
    assert shown is not None and KEY[:8] in shown.old_excerpt + shown.new_excerpt  # the leak
    divergence = find_divergence(fingerprint(old), fingerprint(new), old, new, (KEY,))
    assert divergence is not None
    assert (divergence.location, divergence.volatile) == (shown.location, shown.volatile)
    for excerpt in (divergence.old_excerpt, divergence.new_excerpt):
        assert "VALUE=[REDACTED]" in excerpt
        assert not [KEY[i : i + 6] for i in range(len(KEY) - 5) if KEY[i : i + 6] in excerpt]


def test_difference_inside_a_secret_shows_no_secret() -> None:
    old = {"messages": [{"role": "user", "content": "key sk-aaaaaaaaaaaaaaaaaaaaaaaaaaaa1"}]}
    new = {"messages": [{"role": "user", "content": "key sk-aaaaaaaaaaaaaaaaaaaaaaaaaaaa2"}]}
    divergence = diverge(old, new)
    assert divergence is not None
    assert divergence.old_excerpt == divergence.new_excerpt == "key [REDACTED]"


def test_excerpts_stay_short_on_big_messages() -> None:
    old = {"messages": [{"role": "tool", "content": "x" * 50_000 + "old" + "y" * 50_000}]}
    new = {"messages": [{"role": "tool", "content": "x" * 50_000 + "new" + "y" * 50_000}]}
    divergence = diverge(old, new)
    assert divergence is not None
    assert divergence.old_excerpt == "…" + "x" * 30 + "old" + "y" * 47 + "…"
    assert len(divergence.new_excerpt) == 82


def test_incremental_fingerprint_reuses_unchanged_messages() -> None:
    old = conversation()
    fp_old = fingerprint(old)
    # Parsed afresh, as every request is: equal objects, not the same ones.
    new = orjson.loads(orjson.dumps(old))
    new["messages"].append({"role": "user", "content": "next"})
    fp_new = fingerprint(new, previous=fp_old)
    assert fp_new.chain == fingerprint(new).chain
    assert fp_new.chain[: len(fp_old.chain)] == fp_old.chain
    # The same message objects, as when the caller keeps the previous parse.
    same = {**old, "messages": [*old["messages"], {"role": "user", "content": "next"}]}
    assert fingerprint(same, previous=fp_old).chain == fp_new.chain


_json_text = st.text(alphabet="ab 1:-", max_size=6)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": _json_text}
)


@settings(max_examples=150, deadline=None)
@given(
    old_messages=st.lists(_message, max_size=8),
    edits=st.lists(
        st.tuples(st.sampled_from(["append", "replace", "drop", "params"]), st.integers(0, 9)),
        max_size=4,
    ),
    appended=st.lists(_message, min_size=1, max_size=3),
    same_objects=st.booleans(),
    order=st.sampled_from([(False, None), (True, None), (True, 0), (True, 1)]),
)
def test_incremental_fingerprint_equals_fresh_and_divergence_is_first_change(
    old_messages: list[dict[str, Any]],
    edits: list[tuple[str, int]],
    appended: list[dict[str, Any]],
    same_objects: bool,
    order: tuple[bool, int | None],
) -> None:
    """(``order``: the system block hashed before the tools or after them, as OpenAI's and
    Claude's chat requests; of that many leading messages, as a Responses API request's
    instructions are.)"""
    first, block = order
    old = {"model": "m", "tools": TOOLS, "messages": old_messages}
    # Parsed afresh (equal objects), or spliced onto the previous parse (the very same ones).
    new = (
        {**old, "messages": list(old_messages)} if same_objects else orjson.loads(orjson.dumps(old))
    )
    for op, at in edits:
        if op == "append":
            new["messages"] += appended
        elif op == "replace" and new["messages"]:
            new["messages"][at % len(new["messages"])] = appended[0]
        elif op == "drop" and new["messages"]:
            del new["messages"][at % len(new["messages"])]
        elif op == "params":
            new["reasoning_effort"] = "high" if at % 2 else "low"
    fp_old = fingerprint(old, system_first=first, system_block=block)
    fp_new = fingerprint(new, previous=fp_old, system_first=first, system_block=block)
    fresh = fingerprint(new, system_first=first, system_block=block)
    assert fp_new.chain == fresh.chain
    assert fp_new.digests == fresh.digests == tuple(digest for _, digest in fresh.chain)
    assert fp_new.element_digests == fresh.element_digests
    assert fp_new.message_digests == fresh.message_digests
    assert fp_new.system_count == fresh.system_count
    # and a next turn on top of it (the digests kept from a kept run of a kept run)
    later = {**new, "messages": [*new["messages"], *appended]}
    assert (
        fingerprint(later, previous=fp_new, system_first=first, system_block=block).digests
        == fingerprint(later, system_first=first, system_block=block).digests
    )

    divergence = find_divergence(fp_old, fp_new, old, new)
    shared = shared_prefix_len(fp_old, fp_new)
    n_old, n_new = len(old["messages"]), len(new["messages"])
    assert shared == next(
        (i for i in range(min(n_old, n_new)) if old["messages"][i] != new["messages"][i]),
        min(n_old, n_new),
    )
    if new.get("reasoning_effort"):
        assert divergence is not None and divergence.location == "params"
    elif shared == min(n_old, n_new):
        assert divergence is None
    else:
        assert divergence is not None
        assert divergence.location in ("system", "messages")
        if divergence.location == "messages":
            assert divergence.index == shared


def test_a_parameter_changed_only_in_its_json_type_is_a_params_divergence() -> None:
    """``true`` -> ``1`` or ``1024`` -> ``1024.0`` renders differently to the provider: the
    fingerprint reusing the previous request's work must not read them as equal."""
    for key, old_value, new_value in (
        ("parallel_tool_calls", True, 1),
        (
            "thinking",
            {"type": "enabled", "budget_tokens": 1024},
            {"type": "enabled", "budget_tokens": 1024.0},
        ),
    ):
        old = {"model": "m", key: old_value, "messages": [{"role": "user", "content": "hi"}]}
        new = {**old, key: new_value}
        fp_old = fingerprint(old)
        fp_new = fingerprint(new, previous=fp_old)
        assert fp_new.chain == fingerprint(new).chain
        divergence = find_divergence(fp_old, fp_new, old, new)
        assert divergence is not None and divergence.location == "params"


def test_a_system_block_read_before_the_tools_is_hashed_and_named_in_that_order() -> None:
    """A Responses API request's instructions are read before its tools (OpenAI's order): its
    chain is params, system, tools, then the messages, a leading developer message among them;
    the first of the two that differs is named, each kept where the other changed."""
    old = {
        "model": "gpt-5",
        "tools": TOOLS,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "developer", "content": "Sandbox: read-only."},
            user_message("Fix the test."),
        ],
    }
    fp_old = fingerprint(old, system_first=True, system_block=1)
    assert [name for name, _ in fp_old.chain] == [
        "params",
        "system",
        "tools",
        "messages[1]",
        "messages[2]",
    ]
    assert (fp_old.system_count, fp_old.system_at, fp_old.tools_at) == (1, 1, 2)
    chat = fingerprint(old)  # (a chat request to Claude: tools first, the block both messages)
    assert [name for name, _ in chat.chain] == ["params", "tools", "system", "messages[2]"]
    openai = fingerprint(old, system_first=True)  # (to OpenAI: the block first)
    assert [name for name, _ in openai.chain] == ["params", "system", "tools", "messages[2]"]
    retimed = copy.deepcopy(old)
    retimed["messages"][0]["content"] = "Current time: 10:01\n" + SYSTEM
    no_tools = {**old, "tools": []}
    both = {**retimed, "tools": []}
    developer = copy.deepcopy(old)
    developer["messages"][1]["content"] = "Sandbox: write."
    for body, location, shared in (
        (retimed, "system", 1),
        (no_tools, "tools", 2),
        (both, "system", 1),
        (developer, "messages", 3),
    ):
        fp = fingerprint(body, previous=fp_old, system_first=True, system_block=1)
        assert fp.chain == fingerprint(body, system_first=True, system_block=1).chain
        divergence = find_divergence(fp_old, fp, old, body)
        assert divergence is not None and divergence.location == location, body
        assert shared_links(fp_old, fp) == shared
        # as a chat request, the tools come first
        chat_divergence = find_divergence(chat, fingerprint(body), old, body)
        assert chat_divergence is not None
        assert chat_divergence.location == (
            "tools" if body is both else location.replace("messages", "system")
        )
    assert find_divergence(
        fp_old, fingerprint(no_tools, system_first=True, system_block=1), old, no_tools
    ).field == ("shell")
    # a chat request compared with a Responses one (each in its own order): the first of
    # the two that differs in the new one's order, nothing where only the order differs
    assert (
        find_divergence(
            chat, fingerprint(both, system_first=True, system_block=1), old, both
        ).location
        == "system"
    )
    assert find_divergence(fp_old, fingerprint(both), old, both).location == "tools"
    plain = {**old, "messages": [old["messages"][0], *old["messages"][2:]]}
    plain_chat, plain_responses = (
        fingerprint(plain),
        fingerprint(plain, system_first=True, system_block=1),
    )
    assert plain_chat.chain != plain_responses.chain
    assert find_divergence(plain_chat, plain_responses, plain, plain) is None
    longer = {**plain, "messages": [*plain["messages"], user_message("and then?")]}
    assert (
        find_divergence(
            plain_chat, fingerprint(longer, system_first=True, system_block=1), plain, longer
        )
        is None
    )


def test_a_fingerprint_reused_across_the_two_rules_of_a_system_block_equals_a_fresh_one() -> None:
    """A Responses API request's fingerprint (its system block its instructions alone) reused
    for a chat request of the same message objects (its leading developer message its system
    block): the chat request's block was taken to be the Responses request's."""
    messages = [{"role": "developer", "content": "Sandbox: read-only."}, user_message("Fix it.")]
    responses = fingerprint({"model": "gpt-5", "messages": messages}, None, True, 0)
    chat = {"model": "gpt-5", "messages": [*messages, user_message("and then?")]}
    reused = fingerprint(chat, previous=responses, system_first=True)
    fresh = fingerprint(chat, system_first=True)
    assert reused.system_count == fresh.system_count == 1
    assert reused.chain == fresh.chain
    again = fingerprint({"model": "gpt-5", "messages": messages}, reused, True, 0)
    assert again.chain == responses.chain


# --- which request a request continues ----------------------------------------------------------


def test_shared_links_counts_the_leading_links_two_chains_share() -> None:
    old = conversation()
    fp_old = fingerprint(old)
    links = len(fp_old.chain)  # params, tools, system, then one per message after the system
    assert shared_links(fp_old, fingerprint(old)) == links
    longer = {**old, "messages": [*old["messages"], user_message("and then?")]}
    assert shared_links(fp_old, fingerprint(longer)) == links
    for i in range(1, len(old["messages"])):
        edited = copy.deepcopy(old)
        edited["messages"][i]["content"] = "edited"
        assert shared_links(fp_old, fingerprint(edited)) == 3 + i - 1, i
    assert shared_links(fp_old, fingerprint({**old, "model": "gpt-4.1"})) == 0
    assert shared_links(fp_old, fingerprint({**old, "tools": []})) == 1


def user_message(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


@pytest.mark.parametrize(
    ("change", "same"),
    [
        ("system rewritten", True),
        ("tools changed", True),
        ("model switched", True),
        ("first message rewritten, the rest kept", True),
        ("a sub-agent: its own prompt and task", False),
        ("a title request: another model and prompt, the user's first message", False),
        ("the same prompt, another task", False),
    ],
)
def test_same_conversation_tells_a_rewrite_from_another_conversation(
    change: str, same: bool
) -> None:
    old = conversation()
    task = old["messages"][1]["content"]
    new: dict[str, Any] = copy.deepcopy(old)
    if change == "system rewritten":
        new["messages"][0]["content"] = "Current time: 10:01\n" + SYSTEM
    elif change == "tools changed":
        new["tools"] = TOOLS[:0]
    elif change == "model switched":
        new["model"] = "gpt-4.1"
    elif change.startswith("first message"):
        new["messages"][1]["content"] = task + " Quickly."
    elif change.startswith("a sub-agent"):
        new = {**old, "messages": [{"role": "system", "content": "Search."}, user_message("Find")]}
    elif change.startswith("a title"):
        title = [{"role": "system", "content": "Write a title."}, user_message(task)]
        new = {"model": "gpt-4o-mini", "messages": title}
    else:
        new["messages"] = [old["messages"][0], user_message("Another task.")]
    assert same_conversation(fingerprint(old), fingerprint(new)) is same


def _marked(text: str) -> dict[str, Any]:
    part = {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}
    return {"role": "user", "content": [part]}


def _plain(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def test_a_cache_control_marker_moved_to_the_latest_message_rewrites_nothing() -> None:
    """Anthropic-style clients (opencode, Cline, OpenRouter's users) mark the latest message with
    ``cache_control`` and take the mark off the one before: every turn read as a rewrite."""
    old = {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, _marked("one")]}
    reply = {"role": "assistant", "content": "ok"}
    new = {
        "model": "m",
        "messages": [
            {"role": "system", "content": SYSTEM, "cache_control": {"type": "ephemeral"}},
            _plain("one"),
            reply,
            _marked("two"),
        ],
    }
    assert diverge(old, new) is None
    assert same_conversation(fingerprint(old), fingerprint(new))
    edited = copy.deepcopy(new)
    edited["messages"][1]["content"][0]["text"] = "one, edited"
    divergence = diverge(old, edited)
    assert divergence is not None and (divergence.index, divergence.field) == (1, "content")


def test_a_tools_cache_control_marker_moved_or_dropped_rewrites_nothing() -> None:
    """A breakpoint on the last tool (Anthropic's advice), taken off or moved to the function:
    the same prompt to the provider, no ``prefix_rewrite@tools`` (a message's mark was already
    left out; a tool's was compared)."""
    first = {**TOOLS[0], "cache_control": {"type": "ephemeral"}}
    old = {"model": "m", "tools": [first, *TOOLS[1:]], "messages": [_plain("one")]}
    reply = {"role": "assistant", "content": "ok"}
    inner = {**TOOLS[0], "function": {**TOOLS[0]["function"], "cache_control": {"type": "x"}}}
    for tools in (TOOLS, [inner, *TOOLS[1:]]):
        new = {"model": "m", "tools": tools, "messages": [_plain("one"), reply, _plain("two")]}
        assert diverge(old, new) is None
    # a property named cache_control in a tool's parameters is the tool's text
    renamed = copy.deepcopy(TOOLS)
    properties = renamed[0]["function"]["parameters"]["properties"]
    renamed[0]["function"]["parameters"]["properties"] = {"cache_control": {"type": "string"}}
    changed = {"model": "m", "tools": renamed, "messages": [_plain("one"), reply]}
    assert properties != {"cache_control": {"type": "string"}}
    divergence = diverge({**old, "tools": TOOLS}, changed)
    assert divergence is not None and divergence.location == "tools"
    assert first["cache_control"] == {"type": "ephemeral"}  # not mutated


@pytest.mark.parametrize(
    ("body", "ttl"),
    [
        ({"messages": [_marked("one")]}, None),  # no ttl named: the model's own
        (
            {
                "tools": [{**TOOLS[0], "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
                "messages": [{**_plain("one"), "cache_control": {"type": "ephemeral"}}],
            },
            None,  # the last breakpoint (the message's) names none
        ),
        (
            {
                "tools": [{**TOOLS[0], "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
                "messages": [_plain("one")],
            },
            3600.0,
        ),
        (
            {
                "messages": [
                    {"role": "system", "content": "s", "cache_control": {"type": "x", "ttl": "1h"}},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a", "cache_control": {"ttl": "5m"}},
                            {"type": "text", "text": "b"},
                        ],
                    },
                ]
            },
            300.0,  # the latest message's mark, not the system prompt's
        ),
        ({"cache_control": {"type": "ephemeral", "ttl": "1h"}, "messages": []}, 3600.0),
        ({"messages": [{**_plain("one"), "cache_control": {"ttl": 3600}}]}, None),
        ({"messages": [_plain("one")]}, None),
    ],
)
def test_the_cache_life_a_request_asks_for_is_its_last_breakpoints(
    body: dict[str, Any], ttl: float | None
) -> None:
    assert marked_ttl_s(body) == ttl


def test_one_text_part_and_its_string_are_the_same_message() -> None:
    """A provider renders them alike; Cline-style clients switch a message from one form to the
    other as it stops being one of the latest two. Every turn used to log a divergence."""
    marked = [{"type": "text", "text": "fix it", "cache_control": {"type": "ephemeral"}}]
    before = {"model": "m", "messages": [{"role": "user", "content": marked}]}
    after = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "fix it"},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": [{**marked[0], "text": "thanks"}]},
        ],
    }
    old = fingerprint(before)
    assert find_divergence(old, fingerprint(after), before, after) is None
    assert find_divergence(old, fingerprint(after, old), before, after) is None
    # an image beside the text is another message
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    other = {"model": "m", "messages": [{"role": "user", "content": [*marked, image]}]}
    assert find_divergence(old, fingerprint(other), before, other) is not None


def test_reordered_parameters_of_a_tool_are_a_rewrite_of_the_tools() -> None:
    """A provider renders a schema's ``properties`` as the function's parameters, in the order
    sent: a client that rebuilds them in another order misses the cache. Keys sorted for the
    comparison hid it ("unexplained"); other keys, read by name, may still come in any order."""
    params = {
        "type": "object",
        "properties": {"path": {"type": "string"}, "n": {"type": "integer"}},
    }
    tool = {"type": "function", "function": {"name": "read_file", "parameters": params}}
    old = {"model": "m", "tools": [tool], "messages": [{"role": "user", "content": "hi"}]}
    flipped = {**params, "properties": dict(reversed(list(params["properties"].items())))}
    new = copy.deepcopy(old)
    new["tools"][0]["function"]["parameters"] = flipped
    found = diverge(old, new)
    assert found is not None
    assert (found.location, found.field) == ("tools", "read_file")
    assert found.old_excerpt != found.new_excerpt  # the excerpts show the order as sent
    assert diverge(old, new) == find_divergence(
        fingerprint(old), fingerprint(new, fingerprint(old)), old, new
    )
    # the schema's other keys, and the tool's, in another order: the same prompt
    same = copy.deepcopy(old)
    same["tools"][0] = {
        "function": dict(reversed(list(tool["function"].items()))),
        "type": "function",
    }
    same["tools"][0]["function"]["parameters"] = dict(reversed(list(params.items())))
    assert diverge(old, same) is None


def test_legacy_functions_are_tools_to_the_cache_and_function_call_a_parameter() -> None:
    """A client on the legacy ``functions`` (LangChain's ``bind_functions``, older agents):
    OpenAI renders them as tools, so an edited function's description missed the cache, and
    cachegate, which read only ``tools``, called the miss ``unexplained``; a changed
    ``function_call`` (the legacy ``tool_choice``) too. ``"auto"`` with functions is what
    leaving it out says."""
    read = {"name": "read_file", "description": "Read a file", "parameters": {"type": "object"}}
    grep = {"name": "grep", "description": "Search files", "parameters": {"type": "object"}}
    old = {"model": "m", "functions": [read, grep], "messages": [{"role": "user", "content": "hi"}]}
    edited = copy.deepcopy(old)
    edited["functions"][1]["description"] = "Search files by a regular expression"
    found = diverge(old, edited)
    assert found is not None
    assert (found.location, found.field) == ("tools", "grep")
    assert "regular expression" in found.new_excerpt
    assert diverge(old, edited) == find_divergence(
        fingerprint(old), fingerprint(edited, fingerprint(old)), old, edited
    )
    assert diverge(old, copy.deepcopy(old)) is None
    # beside tools, after them
    both = {**old, "tools": [{"type": "function", "function": read}]}
    assert fingerprint(both).tools_digest != fingerprint({**old, "functions": [read]}).tools_digest
    assert diverge(both, {**both, "functions": [read]}) is not None
    # the legacy tool_choice
    assert diverge(old, {**old, "function_call": "auto"}) is None
    forced = diverge(old, {**old, "function_call": {"name": "grep"}})
    assert forced is not None and forced.label == "params.function_call"
    without = {k: v for k, v in old.items() if k != "functions"}
    assert diverge(without, {**without, "function_call": "none"}) is None


def test_a_response_format_schema_reordered_is_a_change_of_the_parameters() -> None:
    """A JSON schema's ``properties`` are rendered into the prompt in the order sent, as a
    tool's are: reordered, the cache misses. Keys sorted for the digest hid it
    (``unexplained``); the schema's other keys may still come in any order."""
    schema = {
        "type": "object",
        "properties": {"alpha": {"type": "string"}, "beta": {"type": "string"}},
        "required": ["alpha", "beta"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    old = {"model": "m", "response_format": fmt, "messages": [{"role": "user", "content": "hi"}]}
    flipped = copy.deepcopy(old)
    props = flipped["response_format"]["json_schema"]["schema"]["properties"]
    flipped["response_format"]["json_schema"]["schema"]["properties"] = dict(
        reversed(list(props.items()))
    )
    found = diverge(old, flipped)
    assert found is not None and found.label == "params.response_format"
    assert fingerprint(old).params_digest != fingerprint(flipped).params_digest
    same = copy.deepcopy(old)
    same["response_format"]["json_schema"] = dict(reversed(list(fmt["json_schema"].items())))
    assert diverge(old, same) is None
    assert fingerprint(old).params_digest == fingerprint(same).params_digest


def test_tools_parsed_again_as_sent_are_not_canonicalized_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body parsed in full (its first bytes changed: the time in its system prompt) holds
    tools in new objects. Sent as before, they keep their digest: a dozen tools' canonical
    form cost ~0.2 ms a request, at 600 KB ~5% of such a request. A schema number that
    changed only in its JSON type (``1`` -> ``1.0``) is another tools array all the same."""
    import proxy.prefix as prefix_module

    old = conversation()
    fp_old = fingerprint(old)
    canonicalized: list[Any] = []
    real = prefix_module.tools_json
    monkeypatch.setattr(
        prefix_module, "tools_json", lambda tools: canonicalized.append(tools) or real(tools)
    )
    again = orjson.loads(orjson.dumps({**old, "messages": [*old["messages"], user_message("go")]}))
    fp_again = fingerprint(again, fp_old)
    assert canonicalized == []
    assert fp_again.chain == fingerprint(again).chain
    assert find_divergence(fp_old, fp_again, old, again) is None

    typed = copy.deepcopy(old)
    typed["tools"][1]["function"]["parameters"]["properties"]["path"]["maxLength"] = 1
    fp_typed = fingerprint(typed)
    retyped = copy.deepcopy(typed)
    retyped["tools"][1]["function"]["parameters"]["properties"]["path"]["maxLength"] = 1.0
    fp_retyped = fingerprint(retyped, fp_typed)
    assert fp_retyped.chain == fingerprint(retyped).chain
    found = find_divergence(fp_typed, fp_retyped, typed, retyped)
    assert found is not None and (found.location, found.field) == ("tools", "read_file")


@pytest.mark.parametrize(
    ("body", "marked"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, False),
        (
            {
                "messages": [
                    {"role": "system", "content": "s", "cache_control": {"type": "ephemeral"}}
                ]
            },
            True,
        ),
        (
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a"},
                            {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}},
                        ],
                    },
                ]
            },
            True,
        ),
        ({"messages": [], "tools": [{**TOOLS[0], "cache_control": {"type": "ephemeral"}}]}, True),
        ({"messages": "not a list", "tools": "nor this"}, False),
        ({"cache_control": {"type": "ephemeral"}, "messages": []}, True),  # automatic caching
        ({"messages": [{"role": "user", "content": "hi", "cache_control": None}]}, False),
    ],
)
def test_a_request_marks_a_prefix_for_the_cache_on_a_message_a_part_or_a_tool(
    body: dict, marked: bool
) -> None:
    assert has_cache_marker(body) is marked


def test_the_marked_share_is_the_prompt_up_to_the_last_breakpoint() -> None:
    mark = {"type": "ephemeral"}
    short = {"role": "system", "content": [{"type": "text", "text": "x", "cache_control": mark}]}
    long = {"role": "user", "content": "y" * 1000}
    share = marked_share({"messages": [short, long]})
    assert share is not None and 0 < share < 0.1
    assert marked_share({"messages": [short, {**long, "cache_control": mark}]}) == 1.0
    assert marked_share({"messages": [long]}) is None
    assert marked_share({"cache_control": mark, "messages": [long]}) == 1.0
    tool_share = marked_share({"tools": [{**TOOLS[0], "cache_control": mark}], "messages": [long]})
    assert tool_share is not None and 0 < tool_share < 1


def test_what_a_request_dropped_of_the_previous_one() -> None:
    """A trimmed start and a rewind's abandoned turns are dropped whole; a message edited in
    place (ids made anew each request, a timestamp in each message) only for what changed of
    it, a tool output cut to a stub for nearly all of it; a rewritten system prompt for what
    changed of its text (the lines between its first and last change that it no longer holds
    too: the time at its top and the open file at its bottom are two lines)."""

    def say(role: str, text: str) -> dict[str, Any]:
        return {"role": role, "content": text}

    system = say("system", "You are an agent.")
    turns = [say("user" if i % 2 == 0 else "assistant", f"turn {i} " + "x" * 400) for i in range(6)]
    old = {"model": "m", "messages": [system, *turns]}

    def dropped(messages: list[dict[str, Any]]) -> list[tuple[Any, float]]:
        new = {"model": "m", "messages": messages}
        return dropped_elements(fingerprint(old), fingerprint(new))

    def whole(messages: list[dict[str, Any]]) -> list[tuple[Any, float]]:
        return [(m, 1.0) for m in messages]

    assert dropped([system, *turns[2:], say("user", "more")]) == whole(turns[:2])  # trimmed
    assert dropped([system, *turns[:3], say("user", "instead")]) == whole(turns[3:])  # rewind
    assert dropped([system, *turns[:5], say("user", "edited last")]) == whole([turns[5]])
    stamped = [say(t["role"], "[10:02] " + t["content"]) for t in turns]
    assert dropped([system, *stamped, say("user", "next")]) == []  # each edited in place
    restamped = [say(t["role"], "[10:03] " + t["content"]) for t in turns]
    old_stamped = {"model": "m", "messages": [system, *stamped]}
    shares = [
        share
        for _, share in dropped_elements(
            fingerprint(old_stamped),
            fingerprint({"model": "m", "messages": [system, *restamped, say("user", "next")]}),
        )
    ]
    assert len(shares) == 6 and max(shares) < 0.01  # a character of each changed
    stub = [*turns[:3], say("assistant", "[output trimmed]"), *turns[4:], say("user", "next")]
    [(cut, share)] = dropped([system, *stub])
    assert cut == turns[3] and share > 0.9  # only its JSON's frame is left of it
    assert dropped([say("system", "Now 12:00. You are an agent."), *turns]) == []
    assert dropped([system, *turns, say("user", "next")]) == []  # no difference at all
    rules = "\n".join(f"rule {i}: keep invariant {i}." for i in range(300))
    timed = {"model": "m", "messages": [say("system", f"Time: 10:00\n{rules}\nOpen: a.py"), *turns]}
    retimed = {"model": "m", "messages": [say("system", f"Time: 10:01\n{rules}\nOpen: b.py")]}
    [(_, share)] = dropped_elements(
        fingerprint(timed), fingerprint({**retimed, "messages": [*retimed["messages"], *turns]})
    )
    assert share < 0.005  # two short lines of ~7,500 characters
    other = {"model": "m", "messages": [say("system", rules.replace("rule", "law")), *turns]}
    [(_, share)] = dropped_elements(fingerprint(timed), fingerprint(other))
    assert share > 0.9  # another text: only the line ends and digits match

    def block(text: str) -> dict[str, Any]:
        return {"model": "m", "messages": [say("system", text), *turns]}

    # one line changed in two places (an f-string paragraph, JSON context on one line)
    para = " ".join(f"Rule {i}: keep the {i}th invariant." for i in range(300))
    [(_, share)] = dropped_elements(
        fingerprint(block(f"It is 10:01. {para} Open: a.py.")),
        fingerprint(block(f"It is 10:02. {para} Open: b.py.")),
    )
    assert share < 0.01
    # an unchanged code block: its repeated and short lines are kept with their neighbours
    code = "\n".join(
        f"def f{i}(x):\n    if x is None:\n        return None\n    return g(x, {i})"
        for i in range(100)
    )
    [(_, share)] = dropped_elements(
        fingerprint(block(f"Time 10:01\n```\n{code}\n```\nOpen a.py")),
        fingerprint(block(f"Time 10:02\n```\n{code}\n```\nOpen b.py")),
    )
    assert share < 0.01
    # a run of repeated lines cut short between two kept lines: each line of the new text
    # pairs with one of the old at most (both ends' runs took the one line left)
    assert (
        _kept_pieces(["anchorAAA", "x", "x", "x", "anchorBBB"], ["anchorAAA", "x", "anchorBBB"])
        == 22
    )
    # documents of one format share many lines (braces, repeated fields): none is theirs
    records = [
        "[\n" + ",\n".join(f'  {{\n    "id": {k}{i},\n    "active": true\n  }}' for i in range(200))
        for k in (1, 2)
    ]
    [(_, share)] = dropped_elements(fingerprint(block(records[0])), fingerprint(block(records[1])))
    assert share > 0.9


def test_a_message_nested_a_thousand_levels_deep_is_compared_as_any_other() -> None:
    """A turn sent again a minute later with the time in it, and a tool call's arguments
    nested 1,000 levels: the comparison of the rest of the message raised RecursionError, and
    the exchange was left without its cost and cache accounting."""

    def turn(stamp: str) -> dict[str, Any]:
        deep: Any = {}
        for _ in range(1000):
            deep = {"a": deep}
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
        return {
            "messages": [
                {"role": "assistant", "content": f"At {stamp}: calling", "tool_calls": [call]}
            ]
        }

    assert retimed_messages(turn("2026-12-04 10:00:00"), turn("2026-12-04 10:01:00"))


def test_a_deep_call_never_waits_for_another_threads_and_the_limit_comes_back() -> None:
    """The recursion limit is the interpreter's: a deep call raises it and the last to end puts
    it back. A lock held for the whole call made the event loop wait for the log writer's deep
    redaction (0.9 s of a stalled loop)."""
    import sys
    import threading
    import time

    from proxy.prefix import deep_call

    limit = sys.getrecursionlimit()
    inside = threading.Event()

    def dive(n: int, pause: float = 0.0) -> int:
        if n == 0:
            if pause:
                inside.set()
                time.sleep(pause)
            return 0
        return dive(n - 1, pause) + 1

    writer = threading.Thread(target=deep_call, args=(dive, 1500, 1.0))
    writer.start()
    assert inside.wait(10)
    t0 = time.monotonic()
    assert deep_call(dive, 1500) == 1500  # meanwhile, on another thread: at once
    with pytest.raises(RecursionError):  # deeper than any raise takes: said at once too
        deep_call(dive, 10_000)
    assert time.monotonic() - t0 < 0.5
    writer.join(10)
    assert sys.getrecursionlimit() == limit
    with pytest.raises(RecursionError):  # a recursion without end still ends
        deep_call(dive, 10**6)
    assert sys.getrecursionlimit() == limit


def test_an_hour_breakpoints_share_is_none_for_a_change_past_it() -> None:
    """The split of a miss into what a longer-lived breakpoint kept and what expired is made
    for a change within that prefix: one past it (an edited message after the system prompt
    marked for an hour) lost nothing the hour kept, and the estimate's overshoot on dense text
    was charged to it."""
    hour = {"type": "ephemeral", "ttl": "1h"}
    body = {
        "messages": [
            {
                "role": "system",
                "content": [{"type": "text", "text": "rules", "cache_control": hour}],
            },
            {"role": "user", "content": "task " * 100},
            {"role": "assistant", "content": "done " * 100},
            {
                "role": "user",
                "content": [{"type": "text", "text": "go", "cache_control": {"type": "ephemeral"}}],
            },
        ]
    }

    def change(location: str, index: int | None) -> Divergence:
        return Divergence(location, index, "user", "content", "", "")  # type: ignore[arg-type]

    assert longer_lived_share(body, 300.0) is not None
    assert longer_lived_share(body, 300.0, change=change("system", 0)) is not None
    assert longer_lived_share(body, 300.0, change=change("params", None)) is not None
    assert longer_lived_share(body, 300.0, change=change("messages", 1)) is None


def test_a_message_inserted_before_a_recurring_one_is_found_in_linear_time() -> None:
    """An agent's fixed nudge recurs through a long history; a message inserted early (or a
    block replaced by a notice) made each later place of the nudge compare a copy of the whole
    rest: quadratic, 0.35 s of the event loop for 16,000 messages. Counted in elements copied,
    not timed."""
    from proxy.prefix import _carried_later

    class Counted(list[bytes]):
        copied = 0

        def __getitem__(self, at: Any) -> Any:
            got = super().__getitem__(at)
            if isinstance(at, slice):
                Counted.copied += len(got)
            return got

    nudge = b"continue"
    old = [b"system", b"task"]
    for i in range(8_000):
        old += [f"step {i}".encode(), nudge]
    new = [*old[:3], b"(note)", *old[3:]]
    Counted.copied = 0
    assert not _carried_later(Counted(old), Counted(new), 3)  # (not carried on later: inserted)
    assert Counted.copied < 50 * len(old)
    # a stuck agent: the nudge answered alike every time, a run that repeats whole
    stuck = [b"system", *([b"waiting for the build", nudge] * 8_000), b"question"]
    later = [stuck[0], b"(note)", *stuck[1:], b"answer", b"next"]
    Counted.copied = 0
    _carried_later(Counted(stuck), Counted(later), 1)
    assert Counted.copied < 50 * len(stuck)


def _function_tool(name: str, description: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description}}


def test_dropped_tools_take_each_tool_by_its_name_or_its_place() -> None:
    """Tools that are no longer sent, for the share of each that changed: one renamed keeps
    all but its name (an MCP server's tools renamed with it were counted as gone whole, the
    waste of the history after them hidden); one of a name given twice, reordered or kept
    beside another added, is held; hosted tools without names by equality."""
    from proxy.prefix import dropped_tools

    a, b = _function_tool("a", "x" * 300), _function_tool("b", "y" * 300)
    a2 = _function_tool("a", "z" * 300)
    assert dropped_tools([a, a2, b], [a2, a, b]) == []
    assert dropped_tools([a, a2, b], [a, a2, b, _function_tool("c", "w")]) == []
    renamed = dropped_tools([a, b], [_function_tool("mcp__server__a2", "x" * 300), b])
    assert len(renamed) == 1 and renamed[0][1] < 0.05  # (its name alone changed)
    moved = [b, _function_tool("mcp__fs__a", "x" * 300)]  # (renamed, and sorted by name)
    assert [share < 0.05 for _, share in dropped_tools([a, b], moved)] in ([], [True])
    swapped = dropped_tools([a, b], [_function_tool("c", "w" * 300), b])
    assert len(swapped) == 1 and swapped[0][1] > 0.8  # (its description, all but the keys)
    assert dropped_tools([a, b], [b]) == [(a, 1.0)]
    hosted = {"type": "web_search"}
    assert dropped_tools([hosted, a], [a]) == [(hosted, 1.0)]
    assert dropped_tools([hosted, a], [a, hosted]) == []


def test_a_responses_item_replaced_by_another_kind_is_named_by_its_type() -> None:
    """A regenerated turn whose answer changed kind (a message where a call was): its type
    first, for a message item written with its type or without (the type is optional)."""
    from proxy.prefix import message_divergence

    call = {"type": "function_call", "call_id": "call_1", "name": "ls", "arguments": "{}"}
    text = [{"type": "output_text", "text": "Done."}]
    for message in (
        {"type": "message", "role": "assistant", "content": text},
        {"role": "assistant", "content": text},
    ):
        found = message_divergence(3, call, message)
        assert (found.field, found.old_excerpt, found.new_excerpt) == (
            "type",
            "function_call",
            "message",
        ), message
    # a chat message's edit is still named by its field
    found = message_divergence(
        1, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}
    )
    assert found.field == "content"
    # and a typed item against the same message untyped is no change of type
    typed = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]}
    found = message_divergence(0, typed, {"role": "user", "content": "b"})
    assert found.field == "content"


def test_a_number_changed_in_data_is_an_edit_and_in_a_prompt_a_counter() -> None:
    """Any integer that changed read as a volatile counter: a value edited in a tool's output
    (``value=2100`` to ``2101``) was shown as a token the client changes each turn, as a
    timestamp is."""
    system = {"role": "system", "content": "This is turn 7 of the session."}
    tool_call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "read", "arguments": "{}"}}],
    }  # fmt: skip
    output = {"role": "tool", "tool_call_id": "c1", "content": "line 300: value=2100"}
    old = {"model": "m", "messages": [system, {"role": "user", "content": "go"}, tool_call, output]}
    edited = {
        **old,
        "messages": [*old["messages"][:3], {**output, "content": "line 300: value=2101"}],
    }
    found = find_divergence(fingerprint(old), fingerprint(edited), old, edited)
    assert found is not None and found.index == 3
    assert (found.volatile, found.volatile_kind) == (False, None)
    turned = {**old, "messages": [{**system, "content": "This is turn 8 of the session."},
                                  *old["messages"][1:]]}  # fmt: skip
    found = find_divergence(fingerprint(old), fingerprint(turned), old, turned)
    assert found is not None and (found.volatile, found.volatile_kind) == (True, "counter")
    # a time in a tool's output still reads as a time
    timed = {**old, "messages": [*old["messages"][:3],
                                 {**output, "content": "line 300: value=2100 at 10:04:05"}]}  # fmt: skip
    old_timed = {**old, "messages": [*old["messages"][:3],
                                     {**output, "content": "line 300: value=2100 at 10:04:01"}]}  # fmt: skip
    found = find_divergence(fingerprint(old_timed), fingerprint(timed), old_timed, timed)
    assert found is not None and found.volatile_kind == "timestamp"


def test_claude_blocks_count_texts_parts_calls_and_results() -> None:
    call = {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert claude_blocks({"role": "user", "content": "hi"}) == 1
    assert claude_blocks({"role": "user", "content": [{"type": "text", "text": "a"}] * 3}) == 3
    assert claude_blocks({"role": "assistant", "content": None, "tool_calls": [call] * 4}) == 4
    assert claude_blocks({"role": "assistant", "content": "ok", "tool_calls": [call]}) == 2
    assert claude_blocks({"role": "tool", "tool_call_id": "t1", "content": [{}, {}]}) == 1


def test_lookback_reach_finds_the_last_entry_a_breakpoint_reaches() -> None:
    """Claude reads an entry only ~20 blocks back from a breakpoint: past that, the latest
    earlier entry that a breakpoint reaches (the system prompt's, by its share), or none."""
    mark = {"type": "ephemeral"}
    system = {
        "role": "system",
        "content": [{"type": "text", "text": "s" * 300, "cache_control": mark}],
    }
    task = {"role": "user", "content": "t" * 100, "cache_control": mark}
    old = {"messages": [system, task]}
    step = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]

    def marked_last(extra: list[dict[str, Any]]) -> dict[str, Any]:
        last = {**extra[-1], "cache_control": mark}
        return {"messages": [system, {**task, "cache_control": None}, *extra[:-1], last]}

    assert lookback_reach(old, marked_last(step * 10), 20) is None  # 20 blocks: in reach
    share = lookback_reach(old, marked_last(step * 10 + step[:1]), 20)
    assert share is not None and 0.7 < share < 0.8  # (the system prompt's share: 300 of ~400)
    alone = {"messages": [{**system, "content": "s" * 300}, task]}
    assert lookback_reach(alone, marked_last(step * 11), 20) == 0.0
    # a breakpoint kept where it was (or any within reach of it) reaches it
    kept = marked_last(step * 11)
    kept["messages"][1] = task
    assert lookback_reach(old, kept, 20) is None
    unmarked = {"messages": [{**system, "content": "s" * 300}]}
    assert lookback_reach(unmarked, marked_last(step * 11), 20) is None  # (no marks)
    assert lookback_reach(marked_last(step * 3), old, 20) is None  # (fewer items: not judged)
