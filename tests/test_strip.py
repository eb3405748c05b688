"""The usage-event stripper: the client gets the upstream's bytes minus that one event, any chunking."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.strip import UsageEventStripper, is_usage_only

# A content chunk as OpenAI sends it when usage was asked for, and as it sends it otherwise.
CHUNK = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"%s"}}],"usage":null}\n\n'
PLAIN = CHUNK.replace(b',"usage":null', b"")
# The same as OpenAI has sent them since August 2025: a padding member ends each chunk.
PADDED = CHUNK.replace(b"null}", b'null,"obfuscation":"Rm9xQ2"}')
PADDED_PLAIN = PLAIN.replace(b"}]}", b'}],"obfuscation":"Rm9xQ2"}')
USAGE = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"


def run(stream: bytes, cuts: list[int]) -> bytes:
    stripper = UsageEventStripper()
    out = b""
    prev = 0
    for cut in [*sorted(set(cuts)), len(stream)]:
        out += stripper.feed(stream[prev:cut])
        prev = cut
    return out + stripper.flush()


def test_what_the_usage_request_added_is_removed_and_nothing_else() -> None:
    """The usage-only event and each chunk's null usage: the client gets what it would have
    got without cachegate's usage request."""
    stream = (
        CHUNK % b"he"
        + b": keep-alive\n\n"
        + CHUNK % "llo \xc3\xa9".encode("latin-1")
        + USAGE
        + DONE
    )
    direct = PLAIN % b"he" + b": keep-alive\n\n" + PLAIN % "llo \xc3\xa9".encode("latin-1") + DONE
    assert run(stream, []) == direct
    assert all(run(stream, [cut]) == direct for cut in range(len(stream) + 1))


def test_openais_padded_chunks_lose_their_null_usage_and_keep_their_padding() -> None:
    stream = (
        PADDED % b"he" + PADDED % b"llo" + USAGE.replace(b"}}\n", b'},"obfuscation":"x"}\n') + DONE
    )
    direct = PADDED_PLAIN % b"he" + PADDED_PLAIN % b"llo" + DONE
    assert all(run(stream, [cut]) == direct for cut in range(len(stream) + 1))
    crlf = stream.replace(b"\n", b"\r\n")
    assert run(crlf, [len(crlf) // 2]) == direct.replace(b"\n", b"\r\n")


def test_a_null_usage_before_padding_that_does_not_end_the_chunk_is_left() -> None:
    """Only the null right before the chunk's last member, the padding, is OpenAI's."""
    escaped = PADDED.replace(b"Rm9xQ2", b'Rm\\"x') % b"a"  # a quote escaped in the padding
    not_last = PADDED.replace(b'Q2"}', b'Q2","x":1}') % b"a"
    nested = b'data: {"choices":[{"index":0,"usage":null,"obfuscation":"a"}]}\n\n'
    for event in (escaped, not_last, nested):
        assert run(event + USAGE + DONE, []) == event + DONE


def test_every_byte_offset_two_cuts() -> None:
    def crlf(event: bytes) -> bytes:
        return event.replace(b"\n\n", b"\r\n\r\n")

    stream = crlf(CHUNK % b"a") + crlf(USAGE) + crlf(DONE)
    expected = crlf(PLAIN % b"a") + crlf(DONE)
    for i in range(len(stream) + 1):
        for j in range(i, len(stream) + 1, 7):
            assert run(stream, [i, j]) == expected


def test_an_event_cut_by_a_read_is_forwarded_whole_at_its_end() -> None:
    stripper = UsageEventStripper()
    event = CHUNK % b"hello"
    cut = event.index(b'"delta"') + 10
    assert stripper.feed(event[:cut]) == b""  # a client can use no part of an event
    assert stripper.feed(event[cut:]) == PLAIN % b"hello"
    assert not stripper.pending


def test_an_event_whose_end_is_cut_between_its_line_ends_is_forwarded_once_it_has_ended() -> None:
    """LF line ends: after the first LF the event has not ended, and waits. CRLF ones: after
    "\r\n\r" it has (an SSE reader dispatches it at that CR), and goes at once; the LF that
    follows is its own, forwarded as it comes."""
    for event in (PLAIN % b"a", CHUNK % b"a"):
        stripper = UsageEventStripper()
        assert stripper.feed(event[:-1]) == b""
        assert stripper.feed(event[-1:]) == event.replace(b',"usage":null', b"")
        assert not stripper.pending
    for event in (PLAIN % b"a", CHUNK % b"a"):
        event = event.replace(b"\n", b"\r\n")
        stripper = UsageEventStripper()
        assert stripper.feed(event[:-1]) == event[:-1].replace(b',"usage":null', b"")
        assert stripper.feed(b"\n") == b"\n"
        assert stripper.feed(USAGE.replace(b"\n", b"\r\n")) == b""  # (no blank line before it)
        assert not stripper.pending and stripper.stripped == 1


def test_whole_chunk_is_forwarded_as_the_same_object() -> None:
    stripper = UsageEventStripper()
    event = PLAIN % b"x"
    assert stripper.feed(event) is event


def test_chunk_with_choices_and_usage_is_not_stripped() -> None:
    final = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":1}}\n\n'
    assert not is_usage_only(final)
    assert run(final + DONE, []) == final + DONE


def test_a_null_usage_written_otherwise_is_left_as_it_is() -> None:
    """Only OpenAI's own form (the last member of the data line) is known to come from the usage
    request; a provider that writes a null usage elsewhere may write it unasked too."""
    first = b'data: {"usage":null,"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    spaced = b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}], "usage": null}\n\n'
    nested = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"usage":null}]}\n\n'
    for event in (first, spaced, nested):
        assert run(event + USAGE + DONE, []) == event + DONE
        assert run(event + USAGE + DONE, [7]) == event + DONE


def test_truncated_stream_keeps_its_partial_tail() -> None:
    tail = b'data: {"id":"c1","choi'
    assert run(CHUNK % b"a" + tail, [5]) == PLAIN % b"a" + tail


def test_a_last_event_without_a_line_end_loses_the_null_usage_as_a_whole_one_would() -> None:
    """A stream whose last event has no line end (a server that writes none after its last
    chunk; a stream cut right after a chunk's closing brace): its null usage, which cachegate's
    usage request added, reached the client, padded or not; and a usage event so cut was
    relayed whole."""
    for padding in (b"", b',"obfuscation":"aZ09"'):
        last = b'data: {"id":"c1","choices":[{"delta":{"content":"b"}}],"usage":null' + padding
        plain = last.replace(b',"usage":null', b"") + b"}"
        for cuts in ([], [7], [len(last) - 3]):
            assert run(CHUNK % b"a" + last + b"}", cuts) == PLAIN % b"a" + plain
            assert run(CHUNK % b"a" + last + b"}\r", cuts) == PLAIN % b"a" + plain + b"\r"
    usage = b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1}}'
    assert run(CHUNK % b"a" + usage, [3]) == PLAIN % b"a"


# Every way an SSE event can end: two line ends in a row, each CRLF, LF or CR.
EVENT_ENDINGS = [
    b"\n\n",
    b"\r\n\r\n",
    b"\r\r",
    b"\n\r\n",
    b"\r\n\n",
    b"\r\r\n",
    b"\n\r",
    b"\r\n\r",
]


@settings(max_examples=300, deadline=None)
@given(
    texts=st.lists(st.text(max_size=12), min_size=1, max_size=6),
    usage_at_end=st.booleans(),
    nulls=st.booleans(),
    padding=st.sampled_from([b"", b',"obfuscation":""', b',"obfuscation":"aZ09"']),
    ends=st.lists(st.sampled_from(EVENT_ENDINGS), min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12),
)
def test_any_chunking_gives_the_direct_stream(
    texts: list[str],
    usage_at_end: bool,
    nulls: bool,
    padding: bytes,
    ends: list[bytes],
    cuts: list[int],
) -> None:
    """Any chunking of a stream with the usage event at its end and (as OpenAI sends them) null
    usages on the other chunks gives the stream the upstream sends when usage is not asked for,
    whatever line ends its events use, mixed or not."""
    import orjson

    def end(i: int) -> bytes:
        return ends[i % len(ends)]

    direct = [
        b'data: {"choices":[{"index":0,"delta":{"content":'
        + orjson.dumps(t)
        + b"}}]"
        + padding
        + b"}"
        + end(i)
        for i, t in enumerate(texts)
    ]
    asked = [
        event.replace(b"}]" + padding + b"}" + end(i), b'}],"usage":null' + padding + b"}" + end(i))
        for i, event in enumerate(direct)
    ]
    last = end(len(texts))
    usage = USAGE.replace(b"\n\n", last)
    stream = b"".join(asked if nulls else direct) + (usage if usage_at_end else b"")
    stream += DONE.replace(b"\n\n", last)
    expected = b"".join(direct) + DONE.replace(b"\n\n", last)
    assert run(stream, [c % (len(stream) + 1) for c in cuts]) == expected


def test_events_with_mixed_line_ends_are_forwarded_as_they_end() -> None:
    """Not held to the stream's end: an LF then a CRLF ends an event as surely as two LFs. An
    end whose last byte is a CR is known once the next byte is (it could be a CRLF's)."""
    stripper = UsageEventStripper()
    first = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\r\n'
    second = first.replace(b'"a"', b'"b"')
    assert stripper.feed(first) == first
    assert stripper.feed(second) == second
    cr_end = first.replace(b"\n\r\n", b"\n\r")
    assert stripper.feed(cr_end) == cr_end  # ended: not held for the LF that may follow
    assert stripper.feed(second) == second
    assert stripper.feed(cr_end) == cr_end
    assert stripper.feed(b"\n" + second) == b"\n" + second  # (its LF, then the next event)
    # CR line ends: each event goes as it ends, not once the next one begins
    cr_only = PLAIN.replace(b"\n", b"\r")
    for text in (b"a", b"b"):
        assert stripper.feed(cr_only % text) == cr_only % text
    assert stripper.feed(DONE.replace(b"\n", b"\r")) == DONE.replace(b"\n", b"\r")
    # the usage event alone waits to know whether an LF is its own, to go with it
    usage_cr = USAGE.replace(b"\n\n", b"\n\r")
    assert stripper.feed(usage_cr) == b""
    assert stripper.feed(b"\n" + DONE) == DONE
    assert stripper.flush() == b"" and stripper.stripped == 1
    # a blank line after an ended event, cut at its CR, goes with the usage event after it, as
    # when the same bytes come in one read
    crlf = (PLAIN % b"a").replace(b"\n", b"\r\n")
    usage = USAGE.replace(b"\n", b"\r\n")
    for cut in (len(crlf) + 1, len(crlf) + 2):
        stream = crlf + b"\r\n" + usage + DONE
        stripper = UsageEventStripper()
        out = stripper.feed(stream[:cut]) + stripper.feed(stream[cut:]) + stripper.flush()
        assert out == crlf + DONE, cut


def test_usage_only_event_with_any_spacing_is_stripped_whole_or_split() -> None:
    spaced = b'data: {"id":"c1","choices" : [],"usage" : {"prompt_tokens":9}}\n\n'
    stream = CHUNK % b"a" + spaced + DONE
    assert run(stream, []) == PLAIN % b"a" + DONE
    stripper = UsageEventStripper()
    assert stripper.feed(spaced) == b""


def test_a_long_stream_read_in_large_pieces_loses_only_the_usage_event() -> None:
    """A fast upstream (or a loaded machine) delivers hundreds of events per read, cut anywhere:
    every event but the usage one passes, in order, and the stripper keeps nothing back."""
    events = [CHUNK % str(i).encode() for i in range(3000)]
    events[1000] = events[1000].replace(b"\n\n", b"\r\n\r\n")  # terminators can differ by event
    stream = b"".join(events) + USAGE + DONE
    stripper = UsageEventStripper()
    out = b"".join(stripper.feed(stream[at : at + 65536]) for at in range(0, len(stream), 65536))
    assert out + stripper.flush() == b"".join(events).replace(b',"usage":null', b"") + DONE
    assert stripper.stripped == 1 and not stripper.pending


KEPT_USAGE = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":1}}\n\n'


@settings(max_examples=300, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["chunk", "comment", "blank", "kept_usage"]), max_size=12),
    usage_at=st.integers(min_value=0, max_value=12),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=16),
)
def test_lf_streams_cut_anywhere_lose_only_what_the_usage_request_added(
    kinds: list[str], usage_at: int, cuts: list[int]
) -> None:
    """LF line ends, the usual case (whole events taken together): the usage event anywhere in
    a read, blank lines between events, comments, a chunk that carries choices and a usage of
    its own (kept), text that mentions "usage": only the usage event and the nulls go."""
    asked: list[bytes] = []
    direct: list[bytes] = []
    for i, kind in enumerate(kinds):
        if i == usage_at:
            asked.append(USAGE)
        if kind == "chunk":
            text = b'say \\"usage\\" %d' % i
            asked.append(CHUNK % text)
            direct.append(PLAIN % text)
        else:
            event = {"comment": b": ping\n\n", "blank": b"\n", "kept_usage": KEPT_USAGE}[kind]
            if kind == "blank" and i + 1 == min(usage_at, len(kinds)):
                event = b": ping\n\n"  # a blank line opens the next event: keep it out of USAGE
            asked.append(event)
            direct.append(event)
    if usage_at >= len(kinds):
        asked.append(USAGE)
    stream = b"".join(asked) + DONE
    expected = b"".join(direct) + DONE
    assert run(stream, [c % (len(stream) + 1) for c in cuts]) == expected


def reference(stream: bytes) -> tuple[bytes, int]:
    """The stripper's rule on a whole stream at once: events end at two line ends in a row,
    taken from the left as an SSE reader takes them; each event loses the null usages ending its
    lines, a usage-only event goes whole; a tail that never ended is the flush's."""
    import re

    ends = re.compile(rb"\r\n\r\n|\n\r\n|\r\r\n|\n\n|\r\r(?=[^\n])|\n\r(?=[^\n])|\r\n\r(?=[^\n])")
    null = re.compile(rb',"usage":null(}[\r\n]|,"obfuscation":"[a-zA-Z0-9]*"}[\r\n])')
    out, stripped, start = b"", 0, 0
    for found in ends.finditer(stream):
        event = stream[start : found.end()]
        start = found.end()
        if is_usage_only(event):
            stripped += 1
        else:
            out += null.sub(rb"\1", event)
    tail = stream[start:]
    if tail and is_usage_only(tail):
        return out, stripped + 1
    return out + null.sub(rb"\1", tail), stripped


@settings(max_examples=500, deadline=None)
@given(
    pieces=st.lists(
        st.sampled_from(
            [
                CHUNK % b"a",
                PLAIN % b"b",
                PADDED % b"c",
                PADDED_PLAIN % b"d",
                USAGE,
                b"\n",
                b"\r",
                b"\r\n",
                b": ping\n\n",
                b"data: x",
            ]
        ),
        max_size=10,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=12),
)
def test_any_stream_cut_anywhere_is_stripped_as_a_whole_reading_would(
    pieces: list[bytes], cuts: list[int]
) -> None:
    """Blank lines, runs of three line ends or more, CR and LF streams handing over in the
    middle of a read, the usage event anywhere: however the stream is cut, the client gets what
    reading it whole gives, and the same usage events are counted."""
    stream = b"".join(pieces) + DONE
    stripper = UsageEventStripper()
    out, prev = b"", 0
    for cut in [*sorted({c % (len(stream) + 1) for c in cuts}), len(stream)]:
        out += stripper.feed(stream[prev:cut])
        prev = cut
    out += stripper.flush()
    assert (out, stripper.stripped) == reference(stream)


def test_a_run_of_three_line_ends_cut_anywhere_pairs_from_its_start() -> None:
    """Of three LFs, the first two end the event and the third opens the next: a blank line
    before the usage event goes with it, wherever a read cuts the run."""
    for before in (CHUNK % b"a", PLAIN % b"a"):
        for blank in (b"\n", b"\n\n\n"):
            stream = before + blank + USAGE + DONE
            expected = reference(stream)
            for cut in range(len(stream) + 1):
                stripper = UsageEventStripper()
                out = stripper.feed(stream[:cut]) + stripper.feed(stream[cut:])
                assert (out + stripper.flush(), stripper.stripped) == expected, cut


def test_an_event_that_never_ends_is_passed_on_past_the_limit_not_held_whole() -> None:
    """A stream with no event ends (or one event of many MB) was held until its end: memory in
    proportion to the stream. Past the limit it is passed on as it came (no usage event is that
    long)."""
    from proxy.strip import MAX_PENDING

    stripper = UsageEventStripper()
    piece = b"data: " + b"x" * (1024 * 1024)
    out = b""
    for _ in range(MAX_PENDING // len(piece) + 2):
        out += stripper.feed(piece)
        assert len(stripper.pending) <= MAX_PENDING
    assert out and out == piece * (len(out) // len(piece))  # passed on, bytes unchanged
    rest = stripper.feed(b"\n\ndata: [DONE]\n\n")
    assert (out + rest).endswith(b"\n\ndata: [DONE]\n\n")


def test_a_usage_event_with_an_id_a_name_or_a_comment_goes_whole() -> None:
    """Servers and gateways that give every event an ``id:`` (or a name, or a comment line):
    the usage event reached a client that never asked for it (the SDK failed on its empty
    choices). An event named "error" is never taken for one."""
    for extra in (b"id: 7\n", b"event: chunk\n", b": ping\n", b"retry: 3000\n", b"id: 7\r\n"):
        stream = extra + CHUNK % b"hi" + extra + USAGE + extra + DONE
        direct = extra + PLAIN % b"hi" + extra + DONE
        assert run(stream, []) == direct, extra
        assert all(run(stream, [cut]) == direct for cut in range(len(stream) + 1)), extra
    error = (
        b'id: 3\ndata: {"error":{"message":"boom"},"choices":[],"usage":{"prompt_tokens":9}}\n\n'
    )
    assert run(error, []) == error  # an error that carries usage is the client's to see
    no_error = USAGE.replace(b'"choices":[]', b'"error":null,"choices":[]')
    assert run(no_error, []) == b""  # (a gateway's "error": null in every chunk is no error)
    named_error = b"event: error\n" + USAGE
    assert not is_usage_only(named_error.strip())
    assert run(named_error, []) == named_error
    assert not is_usage_only(b"x-custom: 1\n" + USAGE.strip())  # a line SSE does not know


def test_keep_alive_comment_lines_go_on_as_the_next_one_comes() -> None:
    """``: ping`` and a line end each second, with no blank line after it, were held until the
    first event ended (past a client's read timeout). Each goes on once another comment line
    follows it; the last waits for its event, and goes with a usage event as a server that
    writes a comment in every event wrote it there."""
    stripper = UsageEventStripper()
    assert stripper.feed(b": ping\n") == b""
    assert stripper.feed(b": ping\n") == b": ping\n"
    assert stripper.feed(b": ping\n: pi") == b": ping\n: ping\n"  # (a line still coming)
    assert stripper.feed(b"ng\n") == b""
    assert stripper.feed(CHUNK % b"a") == b": ping\n" + PLAIN % b"a"
    assert stripper.feed(b": ping\n") == b""
    assert stripper.feed(USAGE + DONE) == DONE  # (its comment went with it)
    assert stripper.stripped == 1
    # a comment before another field of its event goes with that event; so does one whose CR
    # is the last byte come, its LF maybe the next
    for held in (b": ping\nid: 7\n", b": ping\ndata: {", b": ping\r"):
        stripper = UsageEventStripper()
        assert stripper.feed(held) == b"", held
        assert bytes(stripper.pending) == held
    # CRLF and CR line ends alike (a CR followed by anything but an LF ends its line)
    for end in (b"\r\n", b"\r"):
        stripper = UsageEventStripper()
        assert [stripper.feed(b": ping" + end) for _ in range(3)] == [b"", *[b": ping" + end] * 2]
    stripper = UsageEventStripper()
    assert stripper.feed(b": ping\r: pong\r") == b": ping\r"
