"""The incremental body parse: whatever the bytes, the result equals a full parse; an append is
spliced."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import bodymemo
from proxy.bodymemo import BodyMemo, BodyMemos, Parsed

FILLER = "x" * bodymemo.MIN_BYTES


def dumps(body: dict[str, Any], style: str) -> bytes:
    if style == "orjson":
        return orjson.dumps(body)
    if style == "python":  # json.dumps defaults: ", " and ": ", ASCII escapes
        return json.dumps(body).encode()
    if style == "python-utf8":
        return json.dumps(body, ensure_ascii=False).encode()
    if style == "indent":
        return json.dumps(body, indent=2).encode()
    raise AssertionError(style)


def body_of(messages: list[Any], order: str, **extra: Any) -> dict[str, Any]:
    rest = {"model": "gpt-4o", "stream": True, "tools": [{"type": "function", "x": "ü"}], **extra}
    if order == "first":  # openai-python
        return {"messages": messages, **rest}
    if order == "last":
        return {**rest, "messages": messages}
    return {"model": rest.pop("model"), "messages": messages, **rest}


def remember(raw: bytes, parsed: Parsed) -> BodyMemo | None:
    if parsed.close is None:
        return None
    body = parsed.body
    return BodyMemo(
        raw,
        parsed.close,
        tuple(body),
        {k: v for k, v in body.items() if k != "messages"},
        tuple(body["messages"]),
    )


def turns(n: int) -> list[list[dict[str, Any]]]:
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent. " + FILLER},
        {"role": "user", "content": "Fix the tests ✓"},
    ]
    out = [list(history)]
    for i in range(n):
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "sh", "arguments": "{}"},
        }
        history += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f'output {i} ]}}",['},
        ]
        out.append(list(history))
    return out


@pytest.mark.parametrize("style", ["orjson", "python", "python-utf8", "indent"])
@pytest.mark.parametrize("order", ["first", "middle", "last"])
def test_an_appending_agent_is_parsed_in_proportion_to_what_it_appended(
    style: str, order: str
) -> None:
    memo: BodyMemo | None = None
    spliced = 0
    for i, messages in enumerate(turns(6)):
        raw = dumps(body_of(messages, order), style)
        parsed = bodymemo.parse(raw, [memo] if memo else [])
        assert parsed.body == orjson.loads(raw)
        assert list(parsed.body) == list(orjson.loads(raw))  # key order kept
        if i >= 1:
            assert memo is not None and parsed.source is memo, f"turn {i} was parsed in full"
            kept = parsed.body["messages"][: len(memo.messages)]
            assert all(a is b for a, b in zip(kept, memo.messages, strict=True))
            spliced += 1
        memo = remember(raw, parsed) or memo
    assert spliced == 6


def test_every_change_that_is_not_an_append_is_parsed_in_full() -> None:
    history = turns(3)
    base = orjson.dumps(body_of(history[2], "first"))
    memo = remember(base, bodymemo.parse(base, []))
    assert memo is not None
    edited = [dict(m) for m in history[3]]
    edited[1]["content"] = "Fix the tests, please"
    for body in (
        body_of(edited, "first"),  # an earlier message edited
        body_of(history[3], "first", model="gpt-4o-mini"),  # a field after messages changed
        body_of(history[1], "first"),  # a rewind
        body_of(history[3], "first", temperature=0),  # a field added
    ):
        raw = orjson.dumps(body)
        parsed = bodymemo.parse(raw, [memo])
        assert parsed.source is None
        assert parsed.body == body


def test_bytes_that_only_look_like_an_append_are_not_spliced() -> None:
    messages = turns(1)[1]
    raw = orjson.dumps(body_of(messages, "first"))
    memo = remember(raw, bodymemo.parse(raw, []))
    assert memo is not None
    head, tail = raw[: memo.close], raw[memo.close :]
    for middle in (b",", b",1],[2", b"]", b',{"a":1}]', b' "x"', b",1,]", b',1],"t":[2'):
        forged = head + middle + tail
        try:
            expected = orjson.loads(forged)
        except orjson.JSONDecodeError:
            with pytest.raises(orjson.JSONDecodeError):
                bodymemo.parse(forged, [memo])
            continue
        assert bodymemo.parse(forged, [memo]).body == expected


@pytest.mark.parametrize("style", ["orjson", "python", "indent"])
def test_fields_added_after_messages_are_never_taken_for_an_append(style: str) -> None:
    """The previous body ended with its messages; the next adds fields after them, the last an
    array (``"tools":[…]}`` ends as ``messages`` did). The splice took ``],"temperature":…,
    "tools":[…`` for more messages and kept none of those fields: the log had no tools, and a
    repaired body went to the provider without them."""
    history = turns(2)
    first = {"model": "gpt-4o", "messages": history[1]}
    raw = dumps(first, style)
    memo = remember(raw, bodymemo.parse(raw, []))
    assert memo is not None
    tools = [{"type": "function", "function": {"name": "sh", "parameters": {}}}]
    for extra in (
        {"temperature": 0.2, "tools": tools},
        {"stream": True, "tools": tools},
        {"stop": ["\n"]},
        {"messages_2": [], "tools": []},
    ):
        body = {**first, "messages": history[2], **extra}
        grown = dumps(body, style)
        parsed = bodymemo.parse(grown, [memo])
        assert parsed.body == body
        assert list(parsed.body) == list(body)
        assert parsed.source is None  # no append: parsed in full


@settings(max_examples=300, deadline=None)
@given(
    style=st.sampled_from(["orjson", "python", "indent"]),
    order=st.sampled_from(["first", "middle", "last"]),
    cut=st.integers(min_value=0, max_value=10**9),
    insert=st.binary(min_size=0, max_size=12),
    extra=st.lists(st.text(max_size=20), max_size=3),
)
def test_any_byte_edit_of_a_remembered_body_parses_as_a_full_parse_would(
    style: str, order: str, cut: int, insert: bytes, extra: list[str]
) -> None:
    messages = turns(2)[2]
    raw = dumps(body_of(messages, order), style)
    memo = remember(raw, bodymemo.parse(raw, []))
    assert memo is not None
    appended = dumps(
        body_of(messages + [{"role": "user", "content": e} for e in extra], order), style
    )
    position = cut % (len(appended) + 1)
    candidate = appended[:position] + insert + appended[position:]
    try:
        expected = orjson.loads(candidate)
    except orjson.JSONDecodeError:
        with pytest.raises(orjson.JSONDecodeError):
            bodymemo.parse(candidate, [memo])
        return
    parsed = bodymemo.parse(candidate, [memo])
    assert parsed.body == expected
    assert list(parsed.body) == list(expected) if isinstance(expected, dict) else True


def test_a_duplicate_messages_key_is_never_remembered() -> None:
    messages = turns(1)[1]
    raw = (
        b'{"messages":[{"role":"user","content":"decoy"}],"model":"m","\\u006dessages":'
        + orjson.dumps(messages)
        + b"}"
    )
    parsed = bodymemo.parse(raw, [])
    assert parsed.body["messages"] == messages  # the last one wins, as in a full parse
    memo = remember(raw, parsed)
    if memo is not None:  # only if the position found is the array that won
        more = raw[: memo.close] + b',{"role":"user","content":"more"}' + raw[memo.close :]
        assert bodymemo.parse(more, [memo]).body == orjson.loads(more)


def test_a_key_on_both_sides_of_messages_is_never_taken_for_them() -> None:
    """``{"tools":[a],"messages":[…],"tools":[b]}``: the parse keeps the first place of the key
    and the last value, so a cut inside the second array read as the end of the messages, and
    a tool added there next turn became an appended message (the new tool lost)."""
    messages = turns(1)[1]
    a, b, c = ({"type": "function", "function": {"name": n}} for n in "abc")

    def raw_of(tools: list[Any]) -> bytes:
        return (
            b'{"model":"m","tools":['
            + orjson.dumps(a)
            + b'],"messages":'
            + orjson.dumps(messages)
            + b',"tools":'
            + orjson.dumps(tools)
            + b"}"
        )

    first = raw_of([b])
    memo = remember(first, bodymemo.parse(first, []))
    grown = raw_of([b, c])
    parsed = bodymemo.parse(grown, [memo] if memo else [])
    assert parsed.body == orjson.loads(grown)
    assert parsed.body["tools"] == [b, c] and parsed.body["messages"] == messages


def test_small_bodies_are_not_remembered_and_misses_back_off() -> None:
    small = orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})
    assert bodymemo.parse(small, []).close is None
    messages = turns(1)[1]
    raw = orjson.dumps(body_of(messages, "first"))
    memo = remember(raw, bodymemo.parse(raw, []))
    assert memo is not None
    # its next turn, with the system prompt rewritten: it cannot be spliced
    edited = [{"role": "system", "content": "You are another agent. " + FILLER}, *messages[1:]]
    other = orjson.dumps(body_of([*edited, {"role": "user", "content": "go on"}], "first"))
    tired = BodyMemo(memo.raw, memo.close, memo.keys, memo.values, memo.messages, misses=5)
    parsed = bodymemo.parse(other, [tired])
    assert parsed.close is None and parsed.misses == 6  # not verified again for a while
    assert bodymemo.parse(other, [memo]).close is not None


def test_new_conversations_under_one_key_are_not_misses_unless_none_ever_continues() -> None:
    """Sub-agents fanned out under one session id: each one's first large body continues no
    memo, and each was counted a miss: past three, the rest were no longer remembered, and
    their next turns were parsed whole. One-shot requests under one key (a batch) still back
    off once the key is full and none was ever continued."""

    def opening(n: int) -> bytes:
        messages = [
            {"role": "system", "content": "You are a sub-agent. " + FILLER},
            {"role": "user", "content": f"Task {n}"},
        ]
        return orjson.dumps(body_of(messages, "first"))

    memos = BodyMemos()
    for n in range(12):  # a dozen sub-agents' first bodies, in a row
        raw = opening(n)
        parsed = bodymemo.parse(raw, memos.get("s:fan"))
        assert parsed.close is not None and parsed.misses == 0, n
        memo = remember(raw, parsed)
        assert memo is not None
        memos.put("s:fan", memo)
    for n in range(12):  # then each one's next turn: spliced onto its own
        body = orjson.loads(opening(n))
        body["messages"] += [{"role": "assistant", "content": "ok"}]
        parsed = bodymemo.parse(orjson.dumps(body), memos.get("s:fan"))
        assert parsed.source is not None and parsed.source.raw == opening(n), n
    # a batch: more one-shot requests under one key than it keeps memos, none continued
    batch = BodyMemos()
    misses = []
    for n in range(bodymemo.MEMOS_PER_KEY + 8):
        raw = opening(n)
        parsed = bodymemo.parse(raw, batch.get("h:batch"))
        misses.append(parsed.misses)
        memo = remember(raw, parsed)
        if memo is None:
            batch.note_miss("h:batch", parsed.misses)
        else:
            batch.put("h:batch", dataclasses.replace(memo, misses=parsed.misses))
    assert misses[: bodymemo.MEMOS_PER_KEY] == [0] * bodymemo.MEMOS_PER_KEY
    assert misses[-1] > 3  # no longer verified


def test_a_key_whose_bodies_were_continued_takes_new_conversations_past_its_memos() -> None:
    """While the key holds a body that continued another, new conversations' bodies are
    remembered, the key full or not."""
    memos = BodyMemos()
    history = turns(1)
    first = orjson.dumps(body_of(history[0], "first"))
    memo = remember(first, bodymemo.parse(first, []))
    assert memo is not None
    memos.put("s:k", memo)
    grown = orjson.dumps(body_of(history[1], "first"))
    parsed = bodymemo.parse(grown, memos.get("s:k"))
    assert parsed.source is not None
    continued = remember(grown, parsed)
    assert continued is not None
    memos.put("s:k", continued, source=parsed.source)
    for n in range(bodymemo.MEMOS_PER_KEY):  # (the last two find the key full)
        raw = orjson.dumps(body_of([{"role": "user", "content": f"Task {n} " + FILLER}], "first"))
        parsed = bodymemo.parse(raw, memos.get("s:k"))
        assert parsed.close is not None and parsed.misses == 0, n
        fresh = remember(raw, parsed)
        assert fresh is not None
        memos.put("s:k", fresh)


def test_memos_are_bounded_by_bytes_and_per_key() -> None:
    memos = BodyMemos(max_bytes=3 * 100_010)
    blobs = [bytes([i]) * (100_000 + i) for i in range(8)]  # a continuation is longer

    def memo(raw: bytes) -> BodyMemo:
        return BodyMemo(raw, 1, ("messages",), {}, ())

    for i in range(6):
        memos.put("k", memo(blobs[i]))
    # Over the byte budget, the key keeps its newest memos that fit, not nothing.
    assert [m.raw for m in memos.get("k")] == [blobs[5], blobs[4], blobs[3]]
    assert memos.bytes == sum(len(b) for b in blobs[3:6]) <= memos.max_bytes
    newest = memos.get("k")[0]
    replacement = memo(blobs[7])
    memos.put("k", replacement, source=newest)
    assert memos.get("k")[0].raw is replacement.raw
    assert memos.get("k")[1] is newest  # kept: a regeneration from there still splices
    third = memo(blobs[5])
    memos.put("k", third, source=memos.get("k")[0])
    lineage = [m.raw for m in memos.get("k") if m.lineage == newest.lineage]
    assert lineage == [third.raw, replacement.raw]  # the lineage keeps its last two
    memos.put("other", memo(blobs[6]))
    assert memos.bytes <= memos.max_bytes
    assert [m.raw for m in memos.get("other")] == [blobs[6]]
    assert memos.get("k") == []  # the least recently used key went first


def test_memos_are_forgotten_with_the_sessions_once_idle() -> None:
    """A burst of large agent sessions left up to a quarter of the sessions' memory budget held
    in memos after every session had gone idle (the sessions gauge read 0)."""
    memos = BodyMemos(idle_s=60.0)

    def memo(raw: bytes) -> BodyMemo:
        return BodyMemo(raw, 1, ("messages",), {}, ())

    memos.put("a", memo(b"a" * 1000), now=100.0)
    memos.put("b", memo(b"b" * 1000), now=130.0)
    memos.forget_idle(160.0)  # "a" idle for exactly the limit: kept
    assert memos.bytes == 2000 and memos.get("a") and memos.get("b")
    memos.put("a", memo(b"A" * 1000), now=150.0)  # filed again: "a" is the newer key now
    memos.forget_idle(200.5)
    assert memos.get("b") == [] and [m.raw for m in memos.get("a")] == [b"A" * 1000, b"a" * 1000]
    memos.put("c", memo(b"c" * 10), now=300.0)  # filing forgets the idle ones too
    assert memos.get("a") == [] and memos.bytes == 10
    forever = BodyMemos()  # no idle limit: kept until the byte bound
    forever.put("k", memo(b"k"), now=0.0)
    forever.forget_idle(1e9)
    assert forever.bytes == 1


def test_an_append_nested_past_the_parsers_limit_is_refused_as_a_full_parse_would() -> None:
    messages = turns(1)[1]
    raw = orjson.dumps(body_of(messages, "first"))
    memo = remember(raw, bodymemo.parse(raw, []))
    assert memo is not None
    for depth in (1000, 1021, 1022, 1023, 1024):
        nested = b"[" * depth + b"]" * depth
        candidate = raw[: memo.close] + b"," + nested + raw[memo.close :]
        try:
            expected = orjson.loads(candidate)
        except orjson.JSONDecodeError:
            with pytest.raises(orjson.JSONDecodeError):
                bodymemo.parse(candidate, [memo])
            continue
        parsed = bodymemo.parse(candidate, [memo])  # (too deep for == to compare)
        assert parsed.source is memo
        assert len(parsed.body["messages"]) == len(expected["messages"]) == len(messages) + 1
