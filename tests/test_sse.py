"""The SSE decoder: WHATWG line rules, chunk boundaries anywhere, truncated streams."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.sse import SSEDecoder, SSEEvent


def decode_all(chunks: list[bytes]) -> tuple[list[SSEEvent], SSEDecoder]:
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events += decoder.decode(chunk)
    events += decoder.flush()
    return events, decoder


def decode(stream: bytes) -> list[SSEEvent]:
    return decode_all([stream])[0]


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        pytest.param(b"data: hi\n\n", [SSEEvent(None, "hi")], id="lf"),
        pytest.param(b"data: hi\r\n\r\n", [SSEEvent(None, "hi")], id="crlf"),
        pytest.param(b"data: hi\r\r", [SSEEvent(None, "hi")], id="cr"),
        pytest.param(b"data: a\r\ndata: b\rdata: c\n\r\n", [SSEEvent(None, "a\nb\nc")], id="mixed"),
        pytest.param(b"data: a\ndata: b\n\n", [SSEEvent(None, "a\nb")], id="multi-line-data"),
        pytest.param(b"data:hi\n\n", [SSEEvent(None, "hi")], id="no-space"),
        pytest.param(b"data:  hi \n\n", [SSEEvent(None, " hi ")], id="only-one-space-stripped"),
        pytest.param(b"data\n\n", [SSEEvent(None, "")], id="field-without-colon"),
        pytest.param(b"data:\ndata:\n\n", [SSEEvent(None, "\n")], id="empty-data-lines"),
        pytest.param(b"data: a: b\n\n", [SSEEvent(None, "a: b")], id="colon-in-value"),
        pytest.param(
            b": keep-alive\n\n:\ndata: x\n: between\n\n", [SSEEvent(None, "x")], id="comments"
        ),
        pytest.param(
            b"event: error\ndata: {}\n\ndata: next\n\n",
            [SSEEvent("error", "{}"), SSEEvent(None, "next")],
            id="event-type-resets",
        ),
        pytest.param(
            b"id: 7\ndata: a\n\ndata: b\n\nid\ndata: c\n\n",
            [SSEEvent(None, "a", "7"), SSEEvent(None, "b", "7"), SSEEvent(None, "c", "")],
            id="id-persists",
        ),
        pytest.param(b"id: a\x00b\ndata: x\n\n", [SSEEvent(None, "x")], id="id-with-nul-ignored"),
        pytest.param(
            b"retry: 3000\ndata: a\n\nretry: 3s\ndata: b\n\n",
            [SSEEvent(None, "a", None, 3000), SSEEvent(None, "b")],
            id="retry",
        ),
        pytest.param(b"event: ping\n\nretry: 10\n\n", [], id="block-without-data"),
        pytest.param(b"unknown: 1\ndata: x\n\n", [SSEEvent(None, "x")], id="unknown-field"),
        pytest.param(b"\xef\xbb\xbfdata: x\n\n", [SSEEvent(None, "x")], id="bom"),
        pytest.param(b"data: caf\xc3\xa9 \xe2\x82\xac\n\n", [SSEEvent(None, "café €")], id="utf8"),
        pytest.param(b"data: \xff\n\n", [SSEEvent(None, "\ufffd")], id="invalid-utf8-replaced"),
        pytest.param(b"data: [DONE]", [SSEEvent(None, "[DONE]")], id="flush-partial-line"),
        pytest.param(b"data: a\ndata: b\n", [SSEEvent(None, "a\nb")], id="flush-no-blank-line"),
        pytest.param(b"event: x\n", [], id="flush-without-data"),
    ],
)
def test_decodes_event_stream(stream: bytes, expected: list[SSEEvent]) -> None:
    assert decode(stream) == expected
    assert decode_all([bytes([b]) for b in stream])[0] == expected


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        (
            b"event: ping\n\nretry: 10\n\n",
            [SSEEvent("ping", "", no_data=True), SSEEvent(None, "", None, 10, True)],
        ),
        (b"event:\n\n: keep-alive\n\n", []),  # an empty event name: nothing, as in the SDKs
        (
            b"id: 7\ndata: a\n\n\n: keep-alive\n\n",
            [
                SSEEvent(None, "a", "7"),
                SSEEvent(None, "", "7", no_data=True),
                SSEEvent(None, "", "7", no_data=True),
            ],
        ),
        (b"event: x\n", []),  # unfinished at the end: the SDKs dispatch nothing either
    ],
)
def test_sdk_events_dispatches_the_data_less_blocks_the_openai_sdks_dispatch(
    stream: bytes, expected: list[SSEEvent]
) -> None:
    """The openai SDKs dispatch a block with an event name or a retry but no data, and any
    blank line after an id was given, then fail to parse its empty data as JSON."""
    for chunks in ([stream], [bytes([b]) for b in stream]):
        decoder = SSEDecoder(sdk_events=True)
        events = [e for chunk in chunks for e in decoder.decode(chunk)] + decoder.flush()
        assert events == expected


def test_events_returned_as_soon_as_their_blank_line_arrives() -> None:
    decoder = SSEDecoder()
    assert decoder.decode(b"data: a\n") == []
    assert decoder.decode(b"\ndata: b\n\ndata: c") == [SSEEvent(None, "a"), SSEEvent(None, "b")]
    assert decoder.decode(b"\n\n") == [SSEEvent(None, "c")]
    assert decoder.flush() == []


def test_crlf_split_across_chunks_is_one_line_ending() -> None:
    decoder = SSEDecoder()
    assert decoder.decode(b"data: a\r") == []
    # The "\n" completes the "\r\n" above; only the "\r\n" after it is the blank line.
    assert decoder.decode(b"\ndata: b\r") == []
    assert decoder.decode(b"\n\r") == [SSEEvent(None, "a\nb")]
    assert decoder.decode(b"\n") == []
    assert decoder.flush() == []


def test_cr_then_lf_in_a_later_chunk_after_an_empty_chunk() -> None:
    decoder = SSEDecoder()
    assert decoder.decode(b"data: a\r") == []
    assert decoder.decode(b"") == []
    assert decoder.decode(b"\n") == []
    assert decoder.decode(b"\r\n") == [SSEEvent(None, "a")]


def test_multibyte_character_split_across_chunks() -> None:
    euro = "€".encode()
    decoder = SSEDecoder()
    assert decoder.decode(b"data: " + euro[:1]) == []
    assert decoder.decode(euro[1:2]) == []
    assert decoder.decode(euro[2:] + b"\n\n") == [SSEEvent(None, "€")]


def test_counts_comments_and_remembers_retry_and_last_id() -> None:
    events, decoder = decode_all([b": keep-alive\n\n: ping\nid: 9\nretry: 250\n\n: x\n"])
    assert events == []
    assert decoder.comments == 3
    assert decoder.retry == 250
    assert decoder.last_event_id == "9"


def test_every_two_piece_cut_of_a_stream_decodes_the_same() -> None:
    stream = (
        b": keep-alive\r\n\r\n"
        b'event: message\r\nid: 1\r\ndata: {"content": "h\xc3\xa9llo \xf0\x9f\x98\x80"}\r\n\r\n'
        b"data: line one\rdata: \xe4\xb8\xad\xe6\x96\x87\r\r"
        b"data: [DONE]\n\n"
    )
    expected = [
        SSEEvent("message", '{"content": "héllo 😀"}', "1"),
        SSEEvent(None, "line one\n中文", "1"),
        SSEEvent(None, "[DONE]", "1"),
    ]
    for cut in range(len(stream) + 1):
        assert decode_all([stream[:cut], stream[cut:]])[0] == expected, cut


# Values never hold line terminators; data values include multi-byte characters.
_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n\x00"),
    max_size=12,
) | st.sampled_from(["€", "😀 ok", "中文", " leading", "a:b", ""])
_ending = st.sampled_from(["\n", "\r\n", "\r"])


Stream = tuple[bytes, list[SSEEvent], bytes]


@st.composite
def _streams(draw: st.DrawFn, min_events: int = 0) -> Stream:
    """A rendered event stream with random line endings, comments and fields; its events; and the
    same stream without its final blank line (a truncated stream)."""
    out: list[str] = []
    expected: list[SSEEvent] = []
    last_id: str | None = None
    previous_ending = "\n"

    def line(text: str) -> None:
        nonlocal previous_ending
        ending = draw(_ending)
        if not text and previous_ending == "\r" and ending == "\n":
            ending = "\r\n"  # "\r" then "\n" would read as one "\r\n", not an empty line
        out.append(text + ending)
        previous_ending = ending

    for _ in range(draw(st.integers(min_events, 5))):
        event_type = draw(st.none() | _text)
        event_id = draw(st.none() | _text)
        retry = draw(st.none() | st.integers(0, 10**6))
        data = draw(st.lists(_text, min_size=1, max_size=3))
        fields: list[str] = [f"data: {value}" for value in data]
        if event_type is not None:
            fields.append(f"event: {event_type}")
        if event_id is not None:
            fields.append(f"id: {event_id}")
            last_id = event_id
        if retry is not None:
            fields.append(f"retry: {retry}")
        if draw(st.booleans()):
            fields.append(": keep-alive")
        order = draw(st.permutations(range(len(fields))))
        data_lines = [fields[i] for i in order if fields[i].startswith("data")]
        for i in order:
            line(fields[i])
        line("")
        expected.append(
            SSEEvent(event_type, "\n".join(d[len("data: ") :] for d in data_lines), last_id, retry)
        )
    truncated = "".join(out[:-1]) if expected else ""
    return "".join(out).encode(), expected, truncated.encode()


def _cut(raw: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(raw)]
    return [raw[a:b] for a, b in pairwise(bounds)]


@settings(max_examples=300, deadline=None)
@given(stream=_streams(), data=st.data())
def test_random_streams_decode_the_same_for_any_chunking(
    stream: Stream, data: st.DataObject
) -> None:
    raw, expected, _ = stream
    assert decode(raw) == expected
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=8))
    assert decode_all(_cut(raw, cuts))[0] == expected


@settings(max_examples=60, deadline=None)
@given(stream=_streams())
def test_random_streams_decode_the_same_byte_by_byte(stream: Stream) -> None:
    raw, expected, _ = stream
    assert decode_all([raw[i : i + 1] for i in range(len(raw))])[0] == expected


@settings(max_examples=100, deadline=None)
@given(stream=_streams(min_events=1), data=st.data())
def test_truncated_stream_flushes_its_last_event(stream: Stream, data: st.DataObject) -> None:
    _, expected, truncated = stream
    cuts = data.draw(st.lists(st.integers(0, len(truncated)), max_size=4))
    assert decode_all(_cut(truncated, cuts))[0] == expected


# --- the fast path for plain data events ----------------------------------------------------


def decode_all_fast(chunks: list[bytes]) -> tuple[list[SSEEvent], int]:
    """Like ``decode_all``, taking ``decode_data`` whenever it applies; also how often it did."""
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    fast = 0
    for chunk in chunks:
        payloads = decoder.decode_data(chunk)
        if payloads is None:
            events += decoder.decode(chunk)
        else:
            fast += 1
            events += [
                SSEEvent(None, p.decode("utf-8", "replace"), decoder.last_event_id)
                for p in payloads
            ]
    events += decoder.flush()
    return events, fast


def test_fast_path_returns_plain_data_payloads_and_keeps_a_partial_event() -> None:
    decoder = SSEDecoder()
    assert decoder.decode_data(b'data: {"a":1}\n\ndata: [DONE]\n\ndata: par') == [
        b'{"a":1}',
        b"[DONE]",
    ]
    # The partial event waits for its end like any other; the decoder is then mid-event.
    assert decoder.decode_data(b"tial\n\n") is None
    assert decoder.decode(b"tial\n\n") == [SSEEvent(None, "partial")]
    assert decoder.decode_data(b"data: next\n\n") == [b"next"]


@pytest.mark.parametrize(
    "chunk",
    [
        b"event: error\ndata: {}\n\n",
        b"data: a\ndata: b\n\n",
        b"data:no-space\n\n",
        b": keep-alive\n\ndata: x\n\n",
        b"data: x\r\n\r\n",
        b"id: 1\ndata: x\n\n",
        b"\xef\xbb\xbfdata: x\n\n",
        b"data: x\n\n\n\n",
        # a block that is not a data line, with an extra blank line before the tail
        b"data: a\n\n: keep-alive\n\n\ndata: b\n",
        b"data: a\n\nevent: ping\n\n\ndata: b",
        b'data: a\n\ndata:{"x":1}\n\n\ndata: b',
    ],
)
def test_fast_path_declines_anything_else_and_consumes_nothing(chunk: bytes) -> None:
    decoder = SSEDecoder()
    assert decoder.decode_data(chunk) is None
    assert decoder.decode(chunk) + decoder.flush() == decode(chunk)


@settings(max_examples=300, deadline=None)
@given(stream=_streams(), data=st.data())
def test_fast_path_decodes_random_streams_the_same(stream: Stream, data: st.DataObject) -> None:
    raw, expected, _ = stream
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=8))
    assert decode_all_fast(_cut(raw, cuts))[0] == expected


def test_fast_path_takes_a_typical_completion_stream() -> None:
    raw = b"".join(b'data: {"choices":[{"delta":{"content":"%d"}}]}\n\n' % i for i in range(9))
    raw += b"data: [DONE]\n\n"
    size = raw.index(b"\n\n") + 2  # one event (all but [DONE] have this length)
    events, fast = decode_all_fast(_cut(raw, [2 * size, 3 * size + 10, 5 * size]))
    assert [e.data for e in events][-2:] == ['{"choices":[{"delta":{"content":"8"}}]}', "[DONE]"]
    assert len(events) == 10
    # Chunks that start between events take it (the second ends mid-event and keeps its tail);
    # the one that starts mid-event falls back, and the decoder is between events after it.
    assert fast == 3


def test_shaped_run_gives_the_middles_and_keeps_a_partial_event() -> None:
    decoder = SSEDecoder()
    taken: list[list[bytes]] = []

    def accept(middles: list[bytes]) -> bool:
        taken.append(middles)
        return True

    chunk = b'data: {"t":"a"}\n\ndata: {"t":"bc"}\n\ndata: {"t":"'
    assert decoder.decode_shaped(chunk, b'{"t":"', b'"}', accept)
    assert taken == [[b"a", b"bc"]]
    assert decoder.decode(b'd"}\n\n') == [SSEEvent(None, '{"t":"d"}')]


@pytest.mark.parametrize(
    "chunk",
    [
        b'data: {"t":"a\nb"}\n\n',  # a line break in a middle: two lines, not one event
        b'data: {"t":"a\rb"}\n\n',
        b'data: {"t":"a"}\n\ndata: {"u":"b"}\n\n',  # one event of another shape
        b'data: {"t":"a"}\n\nevent: x\ndata: {"t":"b"}\n\n',
        b'data: {"t":"a"}\n\n\n\ndata: {"t":"b"}\n\n',
        b'data: {"t":"a',  # no whole event
    ],
)
def test_shaped_run_declines_anything_else_and_consumes_nothing(chunk: bytes) -> None:
    decoder = SSEDecoder()
    assert not decoder.decode_shaped(chunk, b'{"t":"', b'"}', lambda middles: True)
    assert decoder.decode(chunk) + decoder.flush() == decode(chunk)


def test_shaped_run_needs_the_decoder_between_events_and_an_accepted_run() -> None:
    decoder = SSEDecoder()
    decoder.decode(b"event: error\n")
    chunk = b'data: {"t":"a"}\n\n'
    assert not decoder.decode_shaped(chunk, b'{"t":"', b'"}', lambda middles: True)
    assert decoder.decode(chunk) == [SSEEvent("error", '{"t":"a"}')]
    refused = SSEDecoder()
    assert not refused.decode_shaped(chunk + b"data: x", b'{"t":"', b'"}', lambda m: False)
    assert refused.decode(chunk) == [SSEEvent(None, '{"t":"a"}')]  # nothing was kept
