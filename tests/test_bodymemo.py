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
    if style == "go":  # encoding/json: compact, <, > and & escaped
        text = orjson.dumps(body).decode()
        return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()
    if style == "php":  # json_encode: compact, ASCII escapes, "/" escaped
        return json.dumps(body, separators=(",", ":")).replace("/", "\\/").encode()
    raise AssertionError(style)


def body_of(messages: list[Any], order: str, **extra: Any) -> dict[str, Any]:
    rest = {"model": "gpt-4o", "stream": True, "tools": [{"type": "function", "x": "ü"}], **extra}
    if order == "first":  # openai-python
        return {"messages": messages, **rest}
    if order == "last":
        return {**rest, "messages": messages}
    return {"model": rest.pop("model"), "messages": messages, **rest}


def remember(raw: bytes, parsed: Parsed, field: str = "messages") -> BodyMemo | None:
    if parsed.close is None:
        return None
    body = parsed.body
    return BodyMemo(
        raw,
        parsed.close,
        tuple(body),
        {k: v for k, v in body.items() if k != field},
        tuple(body[field]),
        marks=parsed.marks,
        style=parsed.style,
        candidates=parsed.candidates,
        head=parsed.head,
        head_checked=parsed.head_checked,
        field=field,
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


def test_a_change_is_parsed_from_where_the_message_it_changed_begins() -> None:
    """A change in one of the last messages (an edit, a rewind) is parsed from the start of
    that message, the messages before it taken as they were; a change after the messages (a
    field changed or added) is parsed in full."""
    history = turns(3)
    base = orjson.dumps(body_of(history[2], "first"))
    memo = remember(base, bodymemo.parse(base, []))
    assert memo is not None
    edited = [dict(m) for m in history[3]]
    edited[1]["content"] = "Fix the tests, please"
    for body, kept in (
        (body_of(edited, "first"), 1),  # an earlier message edited: the system prompt kept
        (body_of(history[1], "first"), len(history[1])),  # a rewind: nothing parsed anew
        (body_of(history[3], "first", model="gpt-4o-mini"), None),  # a field after messages
        (body_of(history[3], "first", temperature=0), None),  # a field added
    ):
        raw = orjson.dumps(body)
        parsed = bodymemo.parse(raw, [memo])
        assert parsed.body == body
        assert list(parsed.body) == list(body)
        if kept is None:
            assert parsed.source is None
            continue
        assert parsed.source is memo and parsed.kept[1] == kept
        assert all(
            a is b
            for a, b in zip(parsed.body["messages"][:kept], memo.messages[:kept], strict=True)
        )


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


def _one_shot(n: int, system: str = "") -> bytes:
    messages = [{"role": "user", "content": f"Task {n} " + FILLER}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return orjson.dumps(body_of(messages, "first"))


def _feed(memos: BodyMemos, key: str, raw: bytes) -> Parsed:
    """What ``ChatPipeline.remember_body`` does with a parse."""
    parsed = bodymemo.parse(raw, memos.get(key))
    memo = remember(raw, parsed)
    if memo is None:
        memos.note_miss(key, parsed.misses, parsed.firsts)
    else:
        spliced = parsed.source is not None and not parsed.resent
        kept = (0, 0) if spliced else (parsed.misses, parsed.firsts)
        memos.put(key, dataclasses.replace(memo, misses=kept[0], firsts=kept[1]), parsed.source)
    return parsed


def test_sub_agents_fanned_out_after_a_run_of_misses_are_remembered() -> None:
    """After a run of full parses (a main agent that rewrites its prompt and its task each
    turn, a dozen sub-agents' first bodies), the next sub-agents' first bodies were no longer
    remembered, and each of their next turns was parsed whole."""
    memos = BodyMemos()
    main: list[dict[str, Any]] = [{}]
    for minute in range(6):  # the main agent: its prompt and its task say the time
        system = {"role": "system", "content": f"You are the main agent. It is 10:{minute:02d}."}
        main[0] = {"role": "user", "content": f"At 10:{minute:02d}: fix the tests. " + FILLER}
        main += [
            {"role": "assistant", "content": f"step {minute}"},
            {"role": "user", "content": "go"},
        ]
        assert _feed(memos, "s:fan", orjson.dumps(body_of([system, *main], "first"))).source is None
    for n in range(12):  # a dozen sub-agents, each its own prompt: nothing to splice onto
        parsed = _feed(memos, "s:fan", _one_shot(n, f"You are sub-agent {n}."))
        assert parsed.source is None and parsed.close is not None, n
    assert parsed.misses > 3  # (counted all the same)
    for n in range(12):  # then each one's next turn: spliced onto its own
        body = orjson.loads(_one_shot(n, f"You are sub-agent {n}."))
        body["messages"] += [{"role": "assistant", "content": "ok"}]
        parsed = _feed(memos, "s:fan", orjson.dumps(body))
        assert parsed.source is not None, n
        assert parsed.source.raw == _one_shot(n, f"You are sub-agent {n}."), n


def test_a_client_whose_bodies_never_continue_backs_off_and_checks_now_and_then() -> None:
    """One-shot requests under one key (a batch), or a history trimmed at its start each turn:
    no body continues another. After three full parses in a row they are verified (a second
    parse) only every sixteenth time, but for the first requests of 32 conversations (sub-agents
    fanned out); the count goes on (it had stopped at the first back-off, and no body was
    checked again)."""
    memos = BodyMemos()
    remembered = [_feed(memos, "h:batch", _one_shot(n)).close is not None for n in range(80)]
    # the first four, then 32 first requests (and the checks at 16 and 32 in between)
    assert remembered[:38] == [True] * 38
    assert [n for n, r in enumerate(remembered) if r and n >= 38] == [48, 64]
    trimmed = BodyMemos()
    window = [{"role": "user", "content": "step 0 " + FILLER}]
    for i in range(1, 40):
        window = [
            *window[-3:],
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"step {i} " + FILLER},
        ]
        _feed(trimmed, "s:trim", orjson.dumps(body_of(window, "first")))
    assert len(trimmed.get("s:trim")) < 8


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


_TRICKY = st.text(alphabet=st.sampled_from('a"\\,[]{}: \n\u00e9\u2713<>&/'), max_size=12)
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | _TRICKY,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY, inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    elements=st.lists(_VALUES, min_size=1, max_size=12),
    style=st.sampled_from(["orjson", "python", "python-utf8", "go", "php", "indent"]),
)
def test_marks_are_where_the_last_messages_begin(elements: list[Any], style: str) -> None:
    """Found walking back from the end, each message's bytes as the client writes them
    (escaped quotes and backslashes in its strings, brackets, non-ASCII text): each mark is a
    comma between two elements of the messages array, the bytes before it those of the
    elements before it. An indented body has none (its messages are not written alone as
    they are in it)."""
    body = {"messages": [{"role": "user", "content": "x" * 100}, *elements], "model": "m"}
    raw = dumps(body, style)
    parsed = bodymemo.parse(raw + b" " * bodymemo.MIN_BYTES, [])
    assert parsed.close is not None
    opened = raw.index(b"[")
    count = len(body["messages"])
    if style != "indent":
        assert [n for _, n in parsed.marks] == list(range(max(1, count - 8), count))
    for at, n in parsed.marks:
        assert raw[at : at + 1] == b","
        assert orjson.loads(b"[" + raw[opened + 1 : at] + b"]") == body["messages"][:n]


@settings(max_examples=150, deadline=None)
@given(
    contents=st.lists(_TRICKY, min_size=6, max_size=14),
    style=st.sampled_from(["orjson", "python", "python-utf8", "go", "php"]),
    part=st.booleans(),
)
def test_a_cache_mark_moved_to_the_newest_message_is_parsed_from_the_one_it_left(
    contents: list[str], style: str, part: bool
) -> None:
    """A client that marks its newest message for caching (``cache_control`` on the message,
    or on its text part) takes the mark off the one before each turn: the body no longer
    continued the last one's bytes, and each turn was parsed whole (~7 ms at 640 KB, against
    ~2 for an appending agent). Now only from the message whose mark moved."""

    def marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        last = dict(messages[-1])
        if part:
            last["content"] = [
                {"type": "text", "text": last["content"], "cache_control": {"type": "ephemeral"}}
            ]
        else:
            last["cache_control"] = {"type": "ephemeral"}
        return [*messages[:-1], last]

    history: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. " + FILLER}]
    memos: list[BodyMemo] = []
    for turn, text in enumerate(contents):
        history.append({"role": "user" if turn % 2 == 0 else "assistant", "content": text})
        body = body_of(marked(history), "first")
        raw = dumps(body, style)
        parsed = bodymemo.parse(raw, memos)
        assert parsed.body == body and list(parsed.body) == list(body)
        if memos:
            assert parsed.source is memos[0], f"turn {turn} was parsed in full"
            assert parsed.kept[1] == len(history) - 2  # the one whose mark moved, and the new
        memo = remember(raw, parsed)
        assert memo is not None
        memos = [memo]


def test_a_body_cut_short_after_a_message_of_parts_is_refused_as_a_full_parse_would() -> None:
    """Messages last in the body, a message of content parts (ending ``]}``) cut off after it:
    the bytes kept and those after the messages (``]}``) overlap, nothing was left to parse,
    and the body was taken for the first messages, forwarded and logged as valid."""

    def part(text: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": text}]}

    messages = [
        {"role": "system", "content": FILLER},
        part("one"),
        {"role": "assistant", "content": "ok"},
        part("two"),
    ]
    raw = orjson.dumps(body_of(messages, "last"))
    memo = remember(raw, bodymemo.parse(raw, []))
    assert memo is not None and memo.marks
    cut = raw.index(b',{"role":"assistant"')
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw[:cut])
    with pytest.raises(orjson.JSONDecodeError):
        bodymemo.parse(raw[:cut], [memo])


def test_the_same_body_sent_again_keeps_the_marks_it_had() -> None:
    """A retry adds no mark (it appended nothing): three of them had pushed out three of the
    places where the last messages begin."""
    history = turns(4)
    raw = orjson.dumps(body_of(history[4], "first"))
    memo = remember(raw, bodymemo.parse(raw, []))
    assert memo is not None and len(memo.marks) == bodymemo.MARKS_KEPT
    for _ in range(3):
        parsed = bodymemo.parse(raw, [memo])
        assert parsed.source is memo and parsed.marks == memo.marks


def test_marks_are_found_whatever_the_text_and_within_a_bound() -> None:
    """A last message of many escaped quotes (a tool's JSON output) or of numbers: its bytes
    are compared whole (a walk over them had cost ~30 times their parse). Past
    ``_MARK_BYTES`` walked, no earlier mark is looked for."""
    quoted = json.dumps({f"key {i}": [f"value {i}", '\\"'] for i in range(5_000)})
    for last in (
        {"role": "tool", "content": quoted},
        {"role": "tool", "data": list(range(20_000))},
    ):
        messages = [{"role": "user", "content": "read it"}, {"role": "assistant", "content": "ok"}]
        body = body_of([*messages, last], "first")
        raw = orjson.dumps(body)
        parsed = bodymemo.parse(raw, [])
        assert parsed.body == body and parsed.close is not None
        assert [n for _, n in parsed.marks] == [1, 2]
    big = [{"role": "tool", "content": f"{i} " + "y" * 200_000} for i in range(3)]
    body = body_of([{"role": "user", "content": "go"}, *big], "first")
    parsed = bodymemo.parse(orjson.dumps(body), [])
    assert [n for _, n in parsed.marks] == [2, 3]  # (400 KB walked: no further)


def test_a_retry_does_not_set_the_back_off_back() -> None:
    """One-shot requests under one key, each sent again now and then (a 429, a timeout): the
    retry spliced onto its own first send and set the counts back to nothing, so the batch
    was checked (a second parse) nearly every time."""
    memos = BodyMemos()
    checked = 0
    retried = 0
    for n in range(120):
        remembered = _feed(memos, "h:batch", _one_shot(n)).close is not None
        checked += remembered
        if n % 3 == 0 and remembered:  # retried at once: spliced onto its first send
            assert _feed(memos, "h:batch", _one_shot(n)).source is not None
            retried += 1
    assert retried >= 12
    assert checked <= 4 + 32 + 120 // 16 + 1


def test_a_client_none_of_the_styles_writes_is_not_serialized_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An indented body: none of the styles writes its last message as it is there, so it has
    no marks, and its key's next bodies are not serialized in Python's forms again (each such
    attempt costs ~4 ms per MB of the newest message), only in those orjson writes."""
    history = turns(2)
    raw = dumps(body_of(history[1], "first"), "indent")
    parsed = bodymemo.parse(raw, [])
    assert parsed.close is not None and parsed.marks == ()
    memo = remember(raw, parsed)
    assert memo is not None and memo.style == bodymemo._NO_STYLE
    calls: list[int] = []

    def counting(style: Any) -> Any:
        def write(value: Any) -> bytes:
            calls.append(1)
            return style(value)  # type: ignore[no-any-return]

        return write

    monkeypatch.setattr(bodymemo, "_STYLES", tuple(counting(s) for s in bodymemo._STYLES))
    edited = [{"role": "system", "content": "Other rules. " + FILLER}, *history[2][1:]]
    again = bodymemo.parse(dumps(body_of(edited, "first"), "indent"), [memo])
    assert again.source is None and again.marks == ()
    assert len(calls) == len(bodymemo._FAST_STYLES)  # the last message, in each of those


def test_one_message_no_style_writes_does_not_end_the_marks() -> None:
    """A Go client before 1.22 writes a backspace as \\u0008, which none of the forms does:
    the body with it last had no marks, and from then on none was looked for under the key,
    so a client moving its cache mark was parsed further back every turn (and whole after any
    full parse). The next bodies' messages are looked for again."""
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent. " + FILLER},
        {"role": "user", "content": "go"},
        {"role": "tool", "content": "bold\bb"},
    ]

    def go_before_1_22(messages: list[dict[str, Any]]) -> bytes:
        return orjson.dumps(body_of(messages, "first")).replace(b"\\b", b"\\u0008")

    raw = go_before_1_22(history)
    parsed = bodymemo.parse(raw, [])
    assert parsed.marks == () and parsed.style == bodymemo._NO_STYLE
    memo = remember(raw, parsed)
    assert memo is not None
    history.append({"role": "assistant", "content": "ok"})
    raw = go_before_1_22(history)
    parsed = bodymemo.parse(raw, [memo])  # an append: spliced
    memo = remember(raw, parsed)
    assert parsed.source is not None and memo is not None
    marked = {**history[-1], "cache_control": {"type": "ephemeral"}}
    raw = go_before_1_22([*history[:-1], marked, {"role": "user", "content": "on"}])
    parsed = bodymemo.parse(raw, [memo])  # the mark added: parsed from that message on
    assert parsed.source is memo and parsed.body == orjson.loads(raw)
    assert parsed.style == 0 and [n for _, n in parsed.marks] == [3, 4]
    # and after a full parse (the system prompt edited)
    edited = [{"role": "system", "content": "Other rules. " + FILLER}, *history[1:]]
    tired = dataclasses.replace(memo, style=bodymemo._NO_STYLE)
    parsed = bodymemo.parse(go_before_1_22(edited), [tired])
    assert parsed.source is None and parsed.marks and parsed.style == 0


@pytest.fixture
def parsed_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes each ``orjson.loads`` call was given, call by call."""
    sizes: list[int] = []
    loads = orjson.loads

    def counting(data: Any) -> Any:
        sizes.append(len(data))
        return loads(data)

    monkeypatch.setattr(orjson, "loads", counting)
    return sizes


def test_a_body_nothing_continues_is_parsed_once(parsed_bytes: list[int]) -> None:
    """Where a body's messages close was checked right after its full parse: a second parse of
    the whole body (~1.4 ms at 600 KB, more than the parse itself). A client whose bodies never
    continue one another paid it every turn: without a session id and with the time in its
    system prompt and its task, each body is filed under a key of its own; with one, three
    times in a row before the back-off. Now the check waits for a body that continues it."""
    history = turns(8)
    memos = BodyMemos()
    for minute, messages in enumerate(history):
        system = {"role": "system", "content": f"It is 10:{minute:02d}. " + FILLER}
        task = {"role": "user", "content": f"At 10:{minute:02d}: fix the tests."}
        raw = orjson.dumps(body_of([system, task, *messages[2:]], "first"))
        for key in (bodymemo.memo_key(raw, None), "s:timed"):
            parsed_bytes.clear()
            parsed = _feed(memos, key, raw)
            assert sum(parsed_bytes) == len(raw), (minute, key)  # one parse, nothing more
            assert parsed.body == orjson.loads(raw) and parsed.source is None
    assert len(memos.get("s:timed")) == 4  # (remembered, until the back-off: no check made)


def test_a_body_is_checked_once_when_the_next_one_continues_it(parsed_bytes: list[int]) -> None:
    """The check is made, once, by the first body that continues a full parse's bytes where
    its messages seem to close (an append, a moved cache mark, a retry); after that each turn
    parses what it appended. A body it proves wrong for is parsed in full."""
    history = turns(6)
    memos = BodyMemos()
    raws = [orjson.dumps(body_of(messages, "first")) for messages in history]
    first = _feed(memos, "s:a", raws[0])
    assert first.source is None and sum(parsed_bytes) == len(raws[0])
    memo = memos.get("s:a")[0]
    assert memo.candidates  # not checked yet
    for turn in range(1, len(raws)):
        parsed_bytes.clear()
        parsed = _feed(memos, "s:a", raws[turn])
        parsed_here = sum(parsed_bytes)
        assert parsed.body == orjson.loads(raws[turn]) and parsed.source is not None, turn
        appended = len(raws[turn]) - len(raws[turn - 1])
        if turn == 1:  # the check: the first body again, then what was appended
            assert parsed.source is memo and not memo.candidates and memo.close > 0
            assert len(raws[0]) <= parsed_here <= len(raws[0]) + 2 * appended + 64
        else:
            assert parsed_here <= appended + 16, turn
    # A layout that misleads (a key on both sides of the messages, the last an array): the
    # check proves the place wrong, the next body is parsed in full and remembered so.
    a, b = ({"type": "function", "function": {"name": n}} for n in "ab")
    misled = b'{"tools":[%s],"messages":%s,"tools":[%s]}' % (
        orjson.dumps(a),
        orjson.dumps(history[1]),
        orjson.dumps(b),
    )
    wrong = _feed(memos, "s:b", misled)
    assert wrong.candidates and misled[wrong.candidates[0]] == ord("]")
    grown = misled[: wrong.close] + b"," + orjson.dumps(a) + misled[wrong.close :]
    parsed = _feed(memos, "s:b", grown)
    assert parsed.source is None and parsed.body == orjson.loads(grown)
    assert parsed.body["tools"] == [b, a] and parsed.body["messages"] == history[1]
    assert memos.get("s:b")[1].close == -1  # proved wrong: never checked again


def test_a_side_request_of_another_layout_under_the_key_does_not_stop_the_splices() -> None:
    """A request without tools under the session id (a title, a sub-agent) ends as
    ``],"stream":true}``, as the main agent's tools array does: that tail, taken first, put the
    main agent's messages closing at its tools, no body continued them there, and no turn was
    spliced again (the place was never checked, nor the right one tried)."""
    system = {"role": "system", "content": "You are a coding agent. " + FILLER}
    tools = [{"type": "function", "function": {"name": "sh", "parameters": {}}}]

    def body(messages: list[Any], with_tools: bool) -> bytes:
        fields = {"model": "gpt-4o", "messages": messages}
        return orjson.dumps({**fields, **({"tools": tools} if with_tools else {}), "stream": True})

    memos = BodyMemos()
    _feed(memos, "s:one", body([system, {"role": "user", "content": "A title?"}], False))
    main = [system, {"role": "user", "content": "Fix it"}]
    spliced = 0
    for turn in range(8):
        spliced += _feed(memos, "s:one", body(main, True)).source is not None
        main += [
            {"role": "assistant", "content": f"step {turn}"},
            {"role": "user", "content": "on"},
        ]
    assert spliced == 7
    # ...nor a layout whose first place found is not where the messages close (a later body
    # continues the body at another of its places)
    metadata = {"tags": ["agent"], "tools": "on"}  # ("tools" found last: after "tags": [...])
    nested = {"model": "m", "messages": main, "tools": tools, "metadata": metadata}
    raw = json.dumps(nested, indent=2).encode()
    first = _feed(memos, "s:two", raw)
    assert len(first.candidates) > 1
    nested["messages"] = [*main, {"role": "assistant", "content": "done"}]
    grown = json.dumps(nested, indent=2).encode()
    parsed = _feed(memos, "s:two", grown)
    assert parsed.source is not None and parsed.body == orjson.loads(grown)


def _timed_turns(n: int, order: str, style: str, changes: str) -> list[bytes]:
    """An agent's bodies whose first bytes change each turn: the time in its system prompt
    (``changes="prompt"``), or a field before its messages (``"field"``); a tool output of
    ~8 KB appended each turn."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the tests ✓"}]
    out = []
    for minute in range(n):
        prompt = "You are an agent. " + "Rules. " * 200
        if changes == "prompt":
            prompt = f"It is 10:{minute:02d}. " + prompt
        extra = {"user": f"turn-{minute}"} if changes == "field" else {}
        body = body_of([{"role": "system", "content": prompt}, *history], order, **extra)
        out.append(dumps(body, style))
        call = {"id": f"call_{minute}", "type": "function", "function": {"name": "sh"}}
        call["function"]["arguments"] = '{"cmd": "make test"}'
        history += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{minute}", "content": f"{minute} ]}}}}" * 2000},
        ]
    return out


@pytest.mark.parametrize("style", ["orjson", "python", "python-utf8", "go", "php", "indent"])
@pytest.mark.parametrize(
    ("order", "changes"),
    [("first", "prompt"), ("middle", "prompt"), ("last", "prompt"), ("last", "field")],
)
@pytest.mark.parametrize("key", ["own", "session"])
def test_a_body_whose_first_bytes_changed_is_parsed_in_those_and_what_it_appended(
    style: str, order: str, changes: str, key: str, parsed_bytes: list[int]
) -> None:
    """A system prompt with the time in it, or a field before the messages that changes each
    turn: no body continued the one before, so each was parsed whole (~0.7 ms at 600 KB), its
    history then compared with the last one's again (~0.6 ms). Now what comes before the
    first message after the prompt is parsed, then what was appended; the messages between
    are the previous parse's objects. Without a session id such a body is filed under a key
    of its own (``own``): the recent memos of other keys are looked at."""
    memos = BodyMemos()
    previous: BodyMemo | None = None
    for turn, raw in enumerate(_timed_turns(8, order, style, changes)):
        filed_as = "s:agent" if key == "session" else bodymemo.memo_key(raw, None)
        mine = memos.get(filed_as)
        others = memos.recent(mine) if key == "own" else []
        parsed_bytes.clear()
        parsed = bodymemo.parse(raw, mine, others)
        parsed_here = sum(parsed_bytes)
        full = orjson.loads(raw)
        assert parsed.body == full and list(parsed.body) == list(full), turn
        if style == "indent" or turn < 3:  # (kept from turn 2 on: 16 KiB or more)
            assert parsed.source is None, turn
        else:
            assert previous is not None and parsed.source is previous, turn
            kept = parsed.body["messages"][1 : len(previous.messages)]
            assert all(a is b for a, b in zip(kept, previous.messages[1:], strict=True))
            assert parsed.own is not None and parsed.own[1] == 3  # the prompt, a call, a result
            if turn > 3:  # (the first time, the bytes kept are checked: a parse of them)
                before = raw.index(b"Fix the tests")
                appended = len(raw) - len(previous.raw)
                assert parsed_here <= before + appended + 64, turn
        memo = remember(raw, parsed)
        assert (memo is None) == (turn < 2), turn
        previous = memos.put(filed_as, memo, source=parsed.source) if memo else None


def test_a_cut_in_an_earlier_array_under_the_messages_key_is_never_taken_for_them() -> None:
    """``{"model":…,"messages":[a,b,c],"messages":[a2,b,c]}``: a parse keeps the last array.
    The place found for the first message after the prompt (``b``'s bytes, first found in the
    first array) must not be taken for where the kept messages begin: the body with a new
    first array's prompt would then have been read with it (``a`` where ``a2`` is)."""
    b = {"role": "user", "content": "Fix it. " + FILLER}
    c = {"role": "assistant", "content": "done"}

    def raw_of(first: str, last: str, more: list[Any]) -> bytes:
        winner = [{"role": "system", "content": last}, b, c, *more]
        return (
            b'{"model":"m","messages":'
            + orjson.dumps([{"role": "system", "content": first}, b, c])
            + b',"\\u006dessages":'
            + orjson.dumps(winner)
            + b"}"
        )

    old = raw_of("one", "two", [])
    memo = remember(old, bodymemo.parse(old, []))
    assert memo is not None
    assert bodymemo._head_of(old, memo.close, memo.messages, memo.style)[0] < old.index(
        b"\\u006d"
    )  # b's bytes are found first in the first array
    new = raw_of("three", "two", [{"role": "user", "content": "more"}])
    parsed = bodymemo.parse(new, [], [memo])
    assert parsed.body == orjson.loads(new)
    assert parsed.body["messages"][0]["content"] == "two"
    assert memo.head == (-1, 0) and memo.head_checked  # found, checked, proved wrong


def test_a_key_written_again_after_the_messages_never_takes_the_kept_messages() -> None:
    """``{"x":1,"messages":[prompt,null],"x":[<kept bytes>…``: the null that closes the bytes
    before the kept messages lands in x's array (the key written last), while the messages end
    in a null of their own; a parse keeps x at its first place, so the messages looked last
    and were taken to end there (found by a review's fuzzing)."""
    raws = _timed_turns(5, "first", "orjson", "prompt")
    memo = None
    for raw in raws[2:4]:
        memo = remember(raw, bodymemo.parse(raw, [], [memo] if memo else []))
    assert memo is not None and memo.head_checked
    kept, tail = memo.raw[memo.head[0] : memo.close], memo.raw[memo.close :]
    system = orjson.dumps({"role": "system", "content": "It is 11:00."})
    raw = b'{"x":1,"messages":[' + system + b',null],"x":[' + kept + tail
    parsed = bodymemo.parse(raw, [], [memo])
    assert parsed.body == orjson.loads(raw)
    assert parsed.body["messages"][-1] is None and len(parsed.body["x"]) == len(memo.messages) - 1


@settings(max_examples=300, deadline=None)
@given(
    style=st.sampled_from(["orjson", "python"]),
    order=st.sampled_from(["first", "middle", "last"]),
    cut=st.integers(min_value=0, max_value=10**9),
    insert=st.binary(min_size=0, max_size=12),
    drop=st.integers(min_value=0, max_value=3),
)
def test_any_byte_edit_of_a_body_continued_past_new_first_bytes_parses_as_a_full_parse_would(
    style: str, order: str, cut: int, insert: bytes, drop: int
) -> None:
    """A body that continued its previous one past other first bytes is remembered as parsed
    (its places known, not checked again): any edit of the next body, anywhere, parses as a
    full parse would."""
    raws = _timed_turns(5, order, style, "prompt")
    memo = None
    for raw in raws[2:4]:
        parsed = bodymemo.parse(raw, [], [memo] if memo else [])
        memo = remember(raw, parsed)
    assert memo is not None and memo.head_checked and not memo.candidates
    nxt = raws[4]
    position = cut % (len(nxt) + 1)
    candidate = nxt[:position] + insert + nxt[position + drop :]
    try:
        expected = orjson.loads(candidate)
    except orjson.JSONDecodeError:
        with pytest.raises(orjson.JSONDecodeError):
            bodymemo.parse(candidate, [], [memo])
        return
    parsed = bodymemo.parse(candidate, [], [memo])
    assert parsed.body == expected
    assert list(parsed.body) == list(expected) if isinstance(expected, dict) else True


@pytest.mark.parametrize("agents", [1, 5, 12])
@pytest.mark.parametrize("opening", ["task", "context", "few-shot"])
def test_sub_agents_with_the_time_in_their_prompts_under_one_id_are_each_continued(
    agents: int, opening: str
) -> None:
    """Sub-agents taking turns under one session id, each with the time in its prompt: each
    one's newest memo is tried, whichever came last (only the key's four newest were: from
    five agents on, every turn was parsed whole again). An opening they share (a task and its
    context, a few-shot example) is another agent's too: each goes on from its own (the newest
    was taken, and every agent's turns were spliced onto one agent's opening). Their second
    turns cannot continue an opening that holds no reply yet, but are kept though the misses
    back off (every later turn was parsed whole until the back-off let a body be kept)."""
    memos = BodyMemos()
    task = {"role": "user", "content": "Fix the tests. " + FILLER}
    shared = {
        "context": [task, {"role": "user", "content": "<context>the layout</context>"}],
        "few-shot": [
            {"role": "user", "content": "Example: fix a typo."},
            {"role": "assistant", "content": "Fixed it, and ran the tests."},
            task,
        ],
    }
    histories: list[list[dict[str, Any]]] = [
        list(shared.get(opening, [{"role": "user", "content": f"Agent {a}: " + FILLER}]))
        for a in range(agents)
    ]
    # An opening with a reply in it is continued from the second turn on; but from the fifth
    # agent on, the misses back off and such an opening is no first request (which is kept
    # all the same): those agents' bodies are kept again only as the back-off lets them.
    continued = [2 if opening == "few-shot" and a < 4 else 3 for a in range(agents)]
    if opening == "few-shot":
        continued[4:] = [6] * len(continued[4:])
    for minute in range(1, 7):
        for a, history in enumerate(histories):
            prompt = {"role": "system", "content": f"It is 10:{minute:02d}. You are agent {a}."}
            raw = orjson.dumps(body_of([prompt, *history], "first"))
            parsed = _feed(memos, "s:team", raw)
            assert parsed.body == orjson.loads(raw), (minute, a)
            if parsed.source is not None:  # onto its own previous turn, never another's
                assert f"You are agent {a}.".encode() in parsed.source.raw, (minute, a)
            if minute < continued[a] and continued[a] < 6:
                assert parsed.source is None, (minute, a)
            elif minute >= continued[a]:
                assert parsed.own is not None, (minute, a)
            history += [
                {"role": "assistant", "content": f"step {minute} of {a}"},
                {"role": "user", "content": f"go on, {a}"},
            ]


def test_one_shot_requests_of_one_document_under_other_prompts_still_back_off() -> None:
    """A batch of one-shot requests under one key, the same document under prompts of their
    own: no body continues another (none appends anything to the document), so they are kept
    as any batch's are, not all (each was taken for a conversation's next turn and kept, and
    its bytes compared with every memo's)."""
    memos = BodyMemos()
    document = {"role": "user", "content": "Grade this essay. " + FILLER}
    remembered = []
    for n in range(80):
        raw = orjson.dumps(
            body_of([{"role": "system", "content": f"Rubric {n}: be strict."}, document], "first")
        )
        remembered.append(_feed(memos, "s:batch", raw).close is not None)
    assert remembered[:38] == [True] * 38  # the first four, then 32 first requests
    assert [n for n, r in enumerate(remembered) if r and n >= 38] == [48, 64]


def test_a_step_redone_after_the_time_changed_is_continued_from_the_turn_before() -> None:
    """A client with the time in its prompt goes back one step and redoes it: its body goes on
    past the turn before the newest one (kept for a retry or a regeneration), which was not
    looked at, so it was parsed whole."""
    memos = BodyMemos()
    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the tests. " + FILLER}]
    snapshots = []
    for minute in range(1, 6):
        snapshots.append(list(history))
        prompt = {"role": "system", "content": f"It is 10:{minute:02d}."}
        _feed(memos, "s:one", orjson.dumps(body_of([prompt, *history], "first")))
        history += [
            {"role": "assistant", "content": f"step {minute}"},
            {"role": "user", "content": f"out {minute}"},
        ]
    redone = [  # the history the 10:04 turn sent, another step after it
        *snapshots[-2],
        {"role": "assistant", "content": "step 4, redone"},
        {"role": "user", "content": "out 4b"},
    ]
    prompt = {"role": "system", "content": "It is 10:07."}
    raw = orjson.dumps(body_of([prompt, *redone], "first"))
    parsed = _feed(memos, "s:one", raw)
    assert parsed.body == orjson.loads(raw)
    assert parsed.own is not None and parsed.source is not None
    assert b"It is 10:04." in parsed.source.raw  # the turn before the newest


def test_agents_without_an_id_with_the_time_in_their_prompts_are_each_continued() -> None:
    """A dozen agents without a session id, each with the time in its prompt, taking turns:
    each body is filed under a key of its own, so the memos filed last by other keys are
    looked at; eight were, and a dozen agents' turns came between two of one agent's."""
    memos = BodyMemos()
    histories: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": f"Agent {a}: fix the tests. " + FILLER}] for a in range(12)
    ]
    for minute in range(1, 5):  # (the first two turns at 10:01: the second one appends)
        for a, history in enumerate(histories):
            prompt = {"role": "system", "content": f"It is 10:{minute:02d}. You are agent {a}."}
            for _ in range(2 if minute == 1 else 1):
                raw = orjson.dumps(body_of([prompt, *history], "first"))
                key = bodymemo.memo_key(raw, None)
                mine = memos.get(key)
                parsed = bodymemo.parse(raw, mine, lambda mine=mine: memos.recent(mine))
                assert parsed.body == orjson.loads(raw), (minute, a)
                if minute > 1:
                    assert parsed.own is not None, (minute, a)
                    assert parsed.source is not None
                    assert parsed.source.raw.find(f"Agent {a}:".encode()) > 0
                memo = remember(raw, parsed)
                assert memo is not None
                memos.put(key, memo, source=parsed.source)
                history += [
                    {"role": "assistant", "content": f"step {minute} of {a}"},
                    {"role": "user", "content": f"go on, {a}"},
                ]


@settings(max_examples=300, deadline=None)
@given(
    common=st.binary(max_size=40),
    old_mid=st.binary(max_size=20),
    new_mid=st.binary(max_size=20),
    end=st.binary(max_size=40),
    old_after=st.binary(max_size=10),
    new_after=st.binary(max_size=10),
)
def test_the_bytes_changed_before_the_kept_messages_are_counted_as_a_plain_comparison_would(
    common: bytes, old_mid: bytes, new_mid: bytes, end: bytes, old_after: bytes, new_after: bytes
) -> None:
    """How far two heads differ (``_changed``, which ranks the memos a body is respliced on:
    the one whose system prompt changed least first), against a byte-by-byte reference."""
    from proxy.bodymemo import _changed

    old_head, new_head = common + old_mid + end, common + new_mid + end
    old, raw = old_head + old_after, new_head + new_after
    at, where = len(old_head), len(new_head)
    limit = min(at, where)
    start = 0
    while start < limit and old_head[start] == new_head[start]:
        start += 1
    tail = 0
    while tail < limit - start and old_head[at - 1 - tail] == new_head[where - 1 - tail]:
        tail += 1
    assert _changed(old, at, raw, where) == max(at, where) - start - tail


# A Responses API request (Codex CLI's layout): ``instructions`` before the items, tools and
# flags after them; each turn appends a call and its output.
def responses_turns(n: int) -> list[list[dict[str, Any]]]:
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix ✓"}]}
    ]
    out = [list(items)]
    for i in range(n):
        items += [
            {"type": "reasoning", "summary": [], "encrypted_content": f"gAAA{i}"},
            {"type": "function_call", "name": "shell", "arguments": "{}", "call_id": f"call_{i}"},
            {"type": "function_call_output", "call_id": f"call_{i}", "output": f'out {i} ]}}",['},
        ]
        out.append(list(items))
    return out


def responses_body(items: list[Any], **extra: Any) -> dict[str, Any]:
    return {
        "model": "gpt-5.1-codex",
        "instructions": "You are Codex. " + FILLER,
        "input": items,
        "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
        "stream": True,
        "store": False,
        **extra,
    }


def remember_items(raw: bytes, parsed: Parsed) -> BodyMemo | None:
    return remember(raw, parsed, "input")


@pytest.mark.parametrize("style", ["orjson", "python", "indent"])
def test_a_responses_agent_is_parsed_in_what_each_turn_appended_to_its_input(style: str) -> None:
    memo: BodyMemo | None = None
    for i, items in enumerate(responses_turns(5)):
        raw = dumps(responses_body(items), style)
        parsed = bodymemo.parse(raw, [memo] if memo else [], field="input")
        assert parsed.body == orjson.loads(raw)
        assert list(parsed.body) == list(orjson.loads(raw))  # key order kept
        if i >= 1:
            assert memo is not None and parsed.source is memo, f"turn {i} was parsed in full"
            kept = parsed.body["input"][: len(memo.messages)]
            assert all(a is b for a, b in zip(kept, memo.messages, strict=True))
            assert parsed.body["tools"] is memo.values["tools"]
        memo = remember_items(raw, parsed) or memo


@given(
    cut=st.integers(min_value=0, max_value=10**9),
    insert=st.binary(min_size=0, max_size=12),
    extra=st.lists(st.text(max_size=20), max_size=3),
)
def test_any_byte_edit_of_a_remembered_responses_body_parses_as_a_full_parse_would(
    cut: int, insert: bytes, extra: list[str]
) -> None:
    items = responses_turns(2)[2]
    raw = orjson.dumps(responses_body(items))
    memo = remember_items(raw, bodymemo.parse(raw, [], field="input"))
    assert memo is not None
    more = [{"type": "message", "role": "user", "content": e} for e in extra]
    appended = orjson.dumps(responses_body(items + more))
    position = cut % (len(appended) + 1)
    candidate = appended[:position] + insert + appended[position:]
    try:
        expected = orjson.loads(candidate)
    except orjson.JSONDecodeError:
        with pytest.raises(orjson.JSONDecodeError):
            bodymemo.parse(candidate, [memo], field="input")
        return
    parsed = bodymemo.parse(candidate, [memo], field="input")
    assert parsed.body == expected
    assert list(parsed.body) == list(expected) if isinstance(expected, dict) else True


def test_a_responses_body_after_new_first_bytes_is_continued_from_its_items() -> None:
    """Instructions with the time in them: the items after them are the last turn's objects,
    parsed again only in what was appended; a chat body's memo is never offered for it."""
    items = responses_turns(3)
    first = orjson.dumps(responses_body(items[2], instructions="It is 10:00. " + FILLER))
    memo = remember_items(first, bodymemo.parse(first, [], field="input"))
    assert memo is not None
    memos = BodyMemos()
    filed = memos.put(bodymemo.memo_key(first, None, "input"), memo)
    chat = orjson.dumps(body_of(turns(2)[2], "first"))
    chat_memo = remember(chat, bodymemo.parse(chat, []))
    assert chat_memo is not None
    memos.put(bodymemo.memo_key(chat, None), chat_memo)
    later = orjson.dumps(responses_body(items[3], instructions="It is 10:05. " + FILLER))
    key = bodymemo.memo_key(later, None, "input")
    assert key.startswith("rh:") and not memos.get(key)
    others = memos.recent((), "input")
    assert others == [filed] and memos.recent() == [memos.get(bodymemo.memo_key(chat, None))[0]]
    parsed = bodymemo.parse(later, [], others, field="input")
    assert parsed.body == orjson.loads(later) and parsed.source is filed
    kept = parsed.body["input"][: len(items[2])]
    assert all(a is b for a, b in zip(kept, filed.messages, strict=True))


def test_a_responses_conversations_first_request_is_one_with_nothing_from_the_model() -> None:
    first_request = bodymemo._first_request
    assert first_request(responses_turns(0)[0])
    assert not first_request(responses_turns(1)[1])  # a reasoning item, a call
    assert not first_request([{"type": "web_search_call", "id": "ws_1", "status": "completed"}])
    assert first_request([{"type": "message", "role": "developer", "content": "x"}])
    assert first_request([{"type": "item_reference", "id": "msg_1"}])
    assert first_request([{"role": "user", "content": "chat messages have no type"}])
    assert not first_request([{"role": "assistant", "content": "hi"}])
