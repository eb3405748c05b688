"""The usage-event stripper: the client gets the upstream's bytes minus that one event, any chunking."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.strip import UsageEventStripper, is_usage_only

CHUNK = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"%s"}}],"usage":null}\n\n'
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


def test_usage_only_event_is_removed_and_nothing_else() -> None:
    stream = (
        CHUNK % b"he"
        + b": keep-alive\n\n"
        + CHUNK % "llo \xc3\xa9".encode("latin-1")
        + USAGE
        + DONE
    )
    assert run(stream, []) == stream.replace(USAGE, b"")


def test_every_byte_offset_two_cuts() -> None:
    stream = (
        (CHUNK % b"a").replace(b"\n\n", b"\r\n\r\n") + USAGE.replace(b"\n\n", b"\r\n\r\n") + DONE
    )
    expected = stream.replace(USAGE.replace(b"\n\n", b"\r\n\r\n"), b"")
    for i in range(len(stream) + 1):
        for j in range(i, len(stream) + 1, 7):
            assert run(stream, [i, j]) == expected


def test_content_chunks_are_forwarded_before_they_complete() -> None:
    stripper = UsageEventStripper()
    event = CHUNK % b"hello"
    cut = event.index(b'"delta"') + 10
    assert stripper.feed(event[:cut]) == event[:cut]
    assert stripper.feed(event[cut:]) == event[cut:]


def test_whole_chunk_is_forwarded_as_the_same_object() -> None:
    stripper = UsageEventStripper()
    event = CHUNK % b"x"
    assert stripper.feed(event) is event


def test_chunk_with_choices_and_usage_is_not_stripped() -> None:
    final = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":1}}\n\n'
    assert not is_usage_only(final)
    assert run(final + DONE, []) == final + DONE


def test_truncated_stream_keeps_its_partial_tail() -> None:
    stream = CHUNK % b"a" + b'data: {"id":"c1","choi'
    assert run(stream, [5]) == stream


@settings(max_examples=200, deadline=None)
@given(
    texts=st.lists(st.text(max_size=12), min_size=1, max_size=6),
    usage_at_end=st.booleans(),
    sep=st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12),
)
def test_any_chunking_gives_upstream_bytes_minus_usage(
    texts: list[str], usage_at_end: bool, sep: bytes, cuts: list[int]
) -> None:
    import orjson

    events = [
        b'data: {"choices":[{"index":0,"delta":{"content":' + orjson.dumps(t) + b"}}]}" + sep
        for t in texts
    ]
    usage = USAGE.replace(b"\n\n", sep)
    stream = b"".join(events) + (usage if usage_at_end else b"") + DONE.replace(b"\n\n", sep)
    expected = b"".join(events) + DONE.replace(b"\n\n", sep)
    assert run(stream, [c % (len(stream) + 1) for c in cuts]) == expected


def test_usage_only_event_with_any_spacing_is_stripped_whole_or_split() -> None:
    spaced = b'data: {"id":"c1","choices" : [],"usage" : {"prompt_tokens":9}}\n\n'
    stream = CHUNK % b"a" + spaced + DONE
    assert run(stream, []) == CHUNK % b"a" + DONE
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
    assert out + stripper.flush() == b"".join(events) + DONE
    assert stripper.stripped == 1 and not stripper.pending
