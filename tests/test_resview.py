"""A Responses API request as the cache accounting reads it, and its places said back."""

from __future__ import annotations

from proxy import prefix
from proxy.resview import chat_shaped, responses_divergence, responses_location

ITEMS = [
    {"role": "developer", "content": "repo rules"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix it"}]},
    {"type": "function_call", "call_id": "c1", "name": "sh", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
]


def test_instructions_lead_the_items_which_are_the_very_objects() -> None:
    body = {
        "model": "gpt-5",
        "instructions": "be brief",
        "input": ITEMS,
        "tools": [],
        "store": False,
    }
    view, offset = chat_shaped(body)
    assert offset == 1
    assert view["messages"][0] == {"role": "system", "content": "be brief"}
    assert all(a is b for a, b in zip(view["messages"][1:], ITEMS, strict=True))
    assert {k: view[k] for k in ("model", "tools", "store")} == {
        "model": "gpt-5",
        "tools": [],
        "store": False,
    }
    assert "input" not in view and "instructions" not in view
    # the system block is the instructions, read before the tools; the leading developer
    # item comes after them, an item as any other
    fp = prefix.fingerprint(view, system_first=True, system_block=offset)
    assert fp.system_count == 1
    assert [name for name, _ in fp.chain] == [
        "params",
        "system",
        "tools",
        "messages[1]",
        "messages[2]",
        "messages[3]",
        "messages[4]",
    ]


def test_the_same_instructions_reuse_the_held_message_and_new_ones_do_not() -> None:
    first, _ = chat_shaped({"instructions": "be brief", "input": ITEMS})
    held = first["messages"][0]
    again, _ = chat_shaped({"instructions": "be brief", "input": ITEMS}, held)
    assert again["messages"][0] is held
    other, _ = chat_shaped({"instructions": "be verbose", "input": ITEMS}, held)
    assert other["messages"][0] == {"role": "system", "content": "be verbose"}


def test_a_string_input_is_one_user_message_and_no_instructions_no_offset() -> None:
    view, offset = chat_shaped(
        {"model": "gpt-5", "input": "hi", "text": {"format": {"type": "json_object"}}}
    )
    assert offset == 0
    assert view["messages"] == [{"role": "user", "content": "hi"}]
    assert view["response_format"] == {"type": "json_object"}
    assert chat_shaped({"model": "gpt-5"})[0]["messages"] == []


def test_places_are_said_in_the_requests_own_terms() -> None:
    assert responses_location("messages[5].output", 1, None) == "input[4].output"
    assert responses_location("messages[0]", 0, None) == "input[0]"
    assert responses_location("system", 1, 0) == "instructions"
    assert responses_location("system", 1, None) == "instructions"
    assert responses_location("system", 1, 1) == "input[0]"  # a leading developer item
    assert responses_location("system", 0, 0) == "input[0]"
    # its edit named as any item's (``input[0]`` alone reads as an item that came or went)
    assert responses_location("system", 1, 1, "content") == "input[0].content"
    assert responses_location("system", 0, 2, "content") == "input[2].content"
    assert responses_location("system", 1, 0, "content") == "instructions"
    assert responses_location("tools", 1, None) == "tools"
    assert responses_location("params.model", 1, None) == "params.model"
    assert responses_location(None, 1, None) is None
    assert responses_location("params.response_format", 1, None) == "params.text.format"
    f = {"location": "params", "index": None, "role": None, "field": "response_format"}
    assert responses_divergence(f, 1) == {**f, "field": "text.format"}
    d = {"location": "messages", "index": 3, "role": None, "field": "output"}
    assert responses_divergence(d, 1) == {**d, "location": "input", "index": 2}
    s = {"location": "system", "index": 0, "role": "system", "field": "content"}
    assert responses_divergence(s, 1) == {**s, "location": "instructions", "index": None}
    t = {"location": "tools", "index": None, "role": None, "field": "sh"}
    assert responses_divergence(t, 1) == t
