"""The Responses API's answers read for their usage: the pure reader (``proxy.resanswers``), and
``POST /v1/responses`` end to end, the official SDK through cachegate to the simulator, its
tokens, cache reads and cost in the metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.resanswers import MAX_SEEN, ResponsesRecorder, assemble_response
from proxy.simulator import RunningSimulator, SimConfig, run_simulator
from proxy.simulator.wire import (
    response_call,
    response_events,
    response_message,
    response_object,
    response_usage,
)
from tests.e2e_support import events, run_cli


def completed(text: str = "Hello there.", *, calls: int = 0, **usage: int) -> dict[str, Any]:
    output = [response_message("msg_1", text)] if text else []
    output += [response_call(f"fc_{n}", f"call_{n}", "run", f'{{"n":{n}}}') for n in range(calls)]
    return response_object(
        response_id="resp_1",
        created=1,
        model="gpt-5-2025-08-07",
        output=output,
        usage=response_usage(usage.get("prompt", 2000), usage.get("out", 40), usage.get("hit", 0)),
    )


def recorded(stream: bytes, piece: int, decode_every: int = 3) -> Any:
    """What the recorder makes of ``stream`` fed in ``piece``-byte reads, decoded (as the relay
    does every 16 KB) after every ``decode_every`` reads."""
    recorder = ResponsesRecorder()
    for n, at in enumerate(range(0, len(stream), piece)):
        recorder.chunks.append(stream[at : at + piece])
        if n % decode_every == decode_every - 1:
            recorder.decode()
    return recorder.finish()


def test_the_tier_a_response_was_billed_at_is_read() -> None:
    """A Responses API answer names its processing tier as a chat one does (priced by it)."""
    body = {**completed(), "service_tier": "flex"}
    assert assemble_response(body).service_tier == "flex"
    stream = b"".join(response_events(body))
    assert recorded(stream, 100).service_tier == "flex"
    assert assemble_response(completed()).service_tier is None


@pytest.mark.parametrize("piece", [1, 7, 100, 10**9])
@pytest.mark.parametrize("spaced", [False, True])
def test_a_stream_cut_before_its_last_event_still_names_its_response(
    piece: int, spaced: bool
) -> None:
    """The id is in the stream's first event: a stream the client cut (a background run it
    resumes by ``previous_response_id``) had none, read only from the last event."""
    events = list(response_events(completed()))
    if spaced:  # another server's JSON: the event is parsed whole
        first = orjson.loads(events[0].split(b"data: ", 1)[1])
        events[0] = b"event: response.created\ndata: " + json.dumps(first).encode() + b"\n\n"
    cut = b"".join(events[:3])
    result = recorded(cut, piece)
    assert result.id == "resp_1" and result.usage is None and not result.done
    whole = recorded(b"".join(events), piece)
    assert whole.id == "resp_1" and whole.usage is not None


@pytest.mark.parametrize("piece", [1, 7, 100, 16384, 10**9])
def test_a_stream_is_read_for_its_usage_model_text_and_calls(piece: int) -> None:
    stream = b"".join(response_events(completed(calls=2, prompt=3000, hit=2048, out=55)))
    result = recorded(stream, piece)
    usage = result.usage
    assert usage is not None
    assert (usage.prompt, usage.cache_read, usage.completion) == (3000, 2048, 55)
    assert usage.reported_cache
    assert result.model == "gpt-5-2025-08-07" and result.id == "resp_1"
    assert result.message["content"] == "Hello there."
    assert [c["function"]["arguments"] for c in result.message["tool_calls"]] == [
        '{"n":0}',
        '{"n":1}',
    ]
    assert result.finish_reason == "tool_calls" and result.done and not result.unfinished
    assert result.error is None


@pytest.mark.parametrize(
    "ends", [(b"\n", b"\r\n"), (b"\n", b"\r"), (b"\n\n", b"\n\r\n"), (b"\n\n", b"\r\n\n")]
)
def test_a_stream_with_other_line_ends_is_read(ends: tuple[bytes, bytes]) -> None:
    """CRLF or CR line ends, or a blank line of another kind than the lines' (SSE allows
    each line its own)."""
    stream = b"".join(response_events(completed(prompt=1500, hit=1024))).replace(*ends)
    result = recorded(stream, 50)
    assert result.usage is not None and result.usage.cache_read == 1024
    assert result.done and result.finish_reason == "stop"


def test_text_that_names_the_last_event_or_an_error_is_no_last_event() -> None:
    """An answer whose text is about the Responses API (``response.completed``, ``"error"``,
    written in a delta as JSON escapes them) is read for its real last event only."""
    text = 'On `response.completed`, check {"error": null} and "type":"response.failed".\n\n'
    stream = b"".join(response_events(completed(text, prompt=1200, hit=0)))
    result = recorded(stream, 64)
    assert result.message["content"] == text
    assert result.usage is not None and result.usage.prompt == 1200
    assert result.done and result.error is None


def test_a_long_stream_is_not_kept_whole() -> None:
    """Events before the last are not parsed as they arrive: the deltas of a 2 MB text, and
    the three events that repeat it whole (a part's, an item's ``done``), keep at most an
    unfinished event's start between decodings. Their bytes are held, unread, for a stream cut
    before its last event, up to 1 MiB (past it let go, and a cut stream's line says its part
    was: as an answer too large to keep), and let go once the last event comes."""
    text = "word " * 40_000
    stream = b"".join(response_events(completed(text)))
    last = stream.index(b"event: response.completed")
    assert last > 4 * MAX_SEEN
    for cut in (False, True):
        recorder = ResponsesRecorder()
        most = held = 0
        for at in range(0, last, 16384):
            recorder.chunks.append(stream[at : min(at + 16384, last)])
            recorder.decode()
            most = max(most, recorder.pending_size)
            held = max(held, sum(map(len, recorder.seen)))
        assert most < 1024 and MAX_SEEN - 16384 < held <= MAX_SEEN
        assert not recorder.seen  # (past the limit: let go)
        if cut:
            result = recorder.finish()
            assert result.message["content"] is None and result.text_dropped
            assert not result.done and result.usage is None
            continue
        recorder.chunks.append(stream[last:])
        result = recorder.finish()
        assert result.message["content"] == text and result.usage is not None
        assert not result.text_dropped
    # a shorter one: held until its last event, then let go
    stream = b"".join(response_events(completed("word " * 1000)))
    last = stream.index(b"event: response.completed")
    recorder = ResponsesRecorder()
    recorder.chunks.append(stream[:last])
    recorder.decode()
    assert sum(map(len, recorder.seen)) == last
    recorder.chunks.append(stream[last:])
    recorder.decode()
    assert not recorder.seen


def _split_arguments(events: list[bytes]) -> list[bytes]:
    """``events`` with each call's one arguments delta sent as two (``{"n"`` then ``:N}``)."""
    out = []
    for event in events:
        if not event.startswith(b"event: response.function_call_arguments.delta"):
            out.append(event)
            continue
        data = orjson.loads(event.split(b"data: ", 1)[1])
        whole = data["delta"]
        for piece in (whole[:4], whole[4:]):
            payload = orjson.dumps({**data, "delta": piece})
            out.append(b"event: response.function_call_arguments.delta\ndata: " + payload + b"\n\n")
    return out


@pytest.mark.parametrize("piece", [1, 7, 100, 10**9])
def test_a_stream_cut_before_its_last_event_logs_the_part_the_client_had(piece: int) -> None:
    """The client hung up (Esc in Codex) or cachegate stopped: the log's message was null,
    where an interrupted chat stream's holds what came."""
    events = _split_arguments(
        response_events(completed("Let me look at the failing test first.", calls=2))
    )
    # the text's deltas, then the first call's arguments streamed, the stream cut in them
    first = next(i for i, e in enumerate(events) if b"arguments.delta" in e)
    result = recorded(b"".join(events[: first + 1]), piece)
    assert result.usage is None and not result.done and not result.text_dropped
    message = result.message
    assert message["content"] == "Let me look at the failing test first."
    (call,) = message["tool_calls"]
    assert call["id"] == "call_0" and call["function"]["name"] == "run"
    assert call["function"]["arguments"] == '{"n"'  # (what came of them)
    # cut in the second call's: the first is whole (its item done), the second as it came
    second = max(i for i, e in enumerate(events) if b"arguments.delta" in e) - 1
    result = recorded(b"".join(events[: second + 1]), piece)
    calls = result.message["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == ['{"n":0}', '{"n"']
    assert [c["id"] for c in calls] == ["call_0", "call_1"]
    # an event whose data is no JSON: the SDKs raise there, and what follows it the client
    # never had
    text = [i for i, e in enumerate(events) if b"output_text.delta" in e]
    broken = b'event: response.output_text.delta\ndata: {"type":"response.outp\n\n'
    result = recorded(b"".join([*events[: text[0]], broken, *events[text[0] : first]]), piece)
    assert result.message["content"] is None and "tool_calls" not in result.message


@pytest.mark.parametrize(
    "names",
    [
        (b"event: ", b"event: "),
        (b"event: ", b"event:  "),  # (two spaces: SSE strips one, the SDKs read the data's type)
        (b"event: ", b"event:\t "),
        (b"event: response.", b"event: message\ndata-was: response."),  # (every event named so)
        (b"event: ", b"event: RESPONSE."),
    ],
)
def test_every_split_of_a_stream_reads_the_same(names: tuple[bytes, bytes]) -> None:
    """Wherever a read ends, in an event's name too: an event is let go unread only once its
    ``event:`` line has ended, naming one of the API's own events that cannot matter."""
    stream = b"".join(response_events(completed(prompt=1300, hit=1280, calls=1)))
    stream = stream.replace(*names)
    last = stream.rindex(b"event:")
    for at in range(last - 40, len(stream)):
        recorder = ResponsesRecorder()
        for piece in (stream[:at], stream[at:]):
            recorder.chunks.append(piece)
            recorder.decode()
        result = recorder.finish()
        assert result.usage is not None and result.usage.cache_read == 1280, at
        assert result.done and not result.unfinished, at


def test_a_last_event_past_the_limit_is_let_go_without_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A last event larger than cachegate keeps (32 MiB: an answer of many generated images)
    is not read: no usage, and no error said of a stream that ended as it should."""
    monkeypatch.setattr("proxy.resanswers.MAX_PENDING_EVENT", 50_000)
    stream = b"".join(response_events(completed("word " * 20_000)))
    result = recorded(stream, 4096, decode_every=1)
    assert result.usage is None and result.done and not result.unfinished
    assert result.error is None and result.text_dropped
    cut = recorded(stream[:-100], 4096, decode_every=1)
    assert cut.unfinished and not cut.done


def test_an_incomplete_answer_says_why_and_keeps_its_usage() -> None:
    body = completed(prompt=900, out=128)
    body.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    events = response_events(body)
    events[-1] = events[-1].replace(b"response.completed", b"response.incomplete")
    result = recorded(b"".join(events), 33)
    assert result.finish_reason == "length" and result.done
    assert result.usage is not None and result.usage.completion == 128


def test_a_failed_answer_and_an_error_event_are_errors() -> None:
    body = completed(prompt=900)
    body.update(status="failed", error={"code": "server_error", "message": "overloaded"})
    events = response_events(body)
    events[-1] = events[-1].replace(b"response.completed", b"response.failed")
    failed = recorded(b"".join(events), 100)
    assert failed.error == {"error": {"code": "server_error", "message": "overloaded"}}
    assert not failed.done and failed.usage is not None

    error = b'event: error\ndata: {"type":"error","code":"rate_limit_exceeded","message":"slow down"}\n\n'
    cut = b"".join(response_events(completed())[:4]) + error
    result = recorded(cut, 100)
    assert result.error is not None and result.error["error"]["message"] == "slow down"
    assert result.usage is None and not result.done


def test_a_last_event_is_read_for_what_its_type_says_whatever_its_responses_shape() -> None:
    """A gateway's last event whose response has no ``object`` or ``output`` (only what it
    counted) is still the response: its usage is read; a ``response.failed`` with nothing in it
    is an error; a last event whose response is no object ends the stream with no usage."""
    usage = {
        "input_tokens": 1200,
        "output_tokens": 30,
        "input_tokens_details": {"cached_tokens": 1024},
    }

    def stream(kind: str, response: Any) -> bytes:
        data = orjson.dumps({"type": kind, "response": response})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    bare = recorded(stream("response.completed", {"id": "r", "usage": usage}), 7)
    assert bare.usage is not None and (bare.usage.prompt, bare.usage.cache_read) == (1200, 1024)
    assert bare.done and bare.error is None and bare.finish_reason == "stop"
    failed = recorded(stream("response.failed", {}), 7)
    assert failed.error is not None and not failed.done
    odd = recorded(stream("response.completed", [1]), 7)
    assert odd.usage is None and odd.done and not odd.unfinished


def test_a_stream_cut_before_its_last_event_has_no_usage_and_is_not_done() -> None:
    events = response_events(completed())
    between = recorded(b"".join(events[:-1]), 100)
    assert between.usage is None and not between.done and not between.unfinished
    assert between.finish_reason is None
    # cut inside the last event: the SDKs never dispatch it, but the provider bills its usage
    torn = recorded(b"".join(events)[:-2], 100)
    assert torn.unfinished and not torn.done
    assert torn.usage is not None and torn.usage.prompt == 2000


def test_a_whole_answer_is_read_and_a_body_that_is_no_response_refused() -> None:
    result = assemble_response(completed(prompt=4000, hit=3968, out=7))
    assert result.usage is not None and result.usage.cache_read == 3968
    assert result.finish_reason == "stop" and result.done
    for empty in ({}, "", None):  # (written so by some servers: no error, as on chat's route)
        assert assemble_response({**completed(), "error": empty}).error is None
    with pytest.raises(TypeError):
        assemble_response({"object": "list", "data": []})
    with pytest.raises(TypeError):
        assemble_response([1, 2])


# -- end to end ---------------------------------------------------------------------------


@pytest.fixture
def sim() -> Iterator[RunningSimulator]:
    with run_simulator(SimConfig()) as running:
        yield running


LONG_TASK = "Refactor the payment module. " * 300  # (past the 1,024 tokens a cache starts at)


@pytest.mark.parametrize("repair", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_an_agents_turns_count_their_tokens_cache_reads_and_cost(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any, stream: bool, repair: bool
) -> None:
    """Codex CLI's turns, as the SDK sends them: the second resends the first's input and its
    answer, which the provider reads from its cache. The metrics count each answer's tokens
    and cache reads under its model, and what it cost at the model's prices (gpt-5: $1.25 a
    million input tokens, $0.125 cached, $10 output), with or without the pairing repair."""
    proxy = proxy_factory(sim.api_base, {"pairing": {"repair": repair}})
    client = sdk(proxy.base_url)
    items: list[Any] = [{"role": "user", "content": LONG_TASK}]
    usages = []
    for turn in range(2):
        sim.sim.enqueue([f"Step {turn} done."])
        if stream:
            with client.responses.stream(model="gpt-5", input=items) as events:
                answer = events.get_final_response()
        else:
            answer = client.responses.create(model="gpt-5", input=items)
        usages.append(answer.usage)
        items += [o.model_dump(exclude_none=True) for o in answer.output]
        items.append({"role": "user", "content": "go on"})
    first, second = usages
    assert first is not None and second is not None
    assert first.input_tokens_details.cached_tokens == 0
    assert second.input_tokens_details.cached_tokens >= 1024  # (the simulator's cache read)

    def tokens(kind: str) -> float:
        return proxy.metric("cachegate_tokens_total", {"model": "gpt-5", "kind": kind})

    assert tokens("prompt") == first.input_tokens + second.input_tokens
    assert tokens("completion") == first.output_tokens + second.output_tokens
    assert tokens("cache_read") == second.input_tokens_details.cached_tokens
    reported = proxy.metric("cachegate_cache_reported_prompt_tokens_total", {"model": "gpt-5"})
    assert reported == tokens("prompt")
    cached = second.input_tokens_details.cached_tokens
    uncached = (tokens("prompt") * 1.25 + tokens("completion") * 10.0) / 1e6
    actual = uncached - cached * (1.25 - 0.125) / 1e6
    cost = proxy.metric("cachegate_cost_usd_total", {"model": "gpt-5", "kind": "actual"})
    assert cost == pytest.approx(actual)
    assert proxy.metric(
        "cachegate_cost_usd_total", {"model": "gpt-5", "kind": "uncached"}
    ) == pytest.approx(uncached)
    assert proxy.metric("cachegate_time_to_first_byte_seconds_count", {"model": "gpt-5"}) == 2
    # the requests themselves count under their route and model (they were a passthrough's,
    # model "other": the model's request rate and latency panels had nothing of them)
    labels = {"route": "responses", "model": "gpt-5", "status": "200"}
    assert proxy.metric("cachegate_requests_total", labels) == 2
    duration = {"route": "responses", "model": "gpt-5"}
    assert proxy.metric("cachegate_request_duration_seconds_count", duration) == 2


def test_an_answers_bytes_reach_the_client_as_the_provider_sent_them(
    scripted: Any, proxy_factory: Any
) -> None:
    """Reading the answer changes nothing of it: the stream's bytes, split as the provider
    split them or not, and its usage counted under the model of its request."""
    events = response_events(completed(prompt=5000, hit=4096, out=12))
    chunks = [b"".join(events)[n : n + 37] for n in range(0, len(b"".join(events)), 37)]
    _upstream, base = scripted(chunks=chunks)
    proxy = proxy_factory(base)
    body = {"model": "gpt-5-mini", "stream": True, "input": [{"role": "user", "content": "hi"}]}
    with httpx.Client() as client:
        answer = client.post(proxy.base_url + "/responses", json=body)
    assert answer.content == b"".join(events)
    labels = {"model": "gpt-5-mini", "kind": "cache_read"}
    assert proxy.metric("cachegate_tokens_total", labels) == 4096
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "midstream"}) == 0


def test_a_stream_cut_short_or_failed_counts_as_the_providers_error(
    scripted: Any, proxy_factory: Any
) -> None:
    events = response_events(completed(prompt=5000))
    failed = completed(prompt=700)
    failed.update(status="failed", error={"code": "server_error", "message": "overloaded"})
    failed_events = response_events(failed)
    failed_events[-1] = failed_events[-1].replace(b"response.completed", b"response.failed")
    body = {"model": "gpt-5", "stream": True, "input": [{"role": "user", "content": "hi"}]}
    kinds = []
    for chunks in (events[:-1], failed_events):
        _upstream, base = scripted(chunks=chunks)
        proxy = proxy_factory(base)
        with httpx.Client() as client:
            answer = client.post(proxy.base_url + "/responses", json=body)
        assert answer.status_code == 200 and answer.content == b"".join(chunks)
        kinds.append(
            {
                kind: proxy.metric("cachegate_upstream_errors_total", {"kind": kind})
                for kind in ("midstream", "error_event")
            }
        )
    assert kinds == [{"midstream": 1, "error_event": 0}, {"midstream": 0, "error_event": 1}]
    # the failed one's usage, which the provider bills, is counted
    prompt = proxy.metric("cachegate_tokens_total", {"model": "gpt-5", "kind": "prompt"})
    assert prompt == 700


def test_an_answer_that_is_no_json_is_counted_invalid_and_relayed(
    scripted: Any, proxy_factory: Any
) -> None:
    _upstream, base = scripted(chunks=[b"<html>bad gateway</html>"], content_type=b"text/html")
    proxy = proxy_factory(base)
    body = orjson.dumps({"model": "gpt-5", "input": "hi"})
    answer = httpx.post(proxy.base_url + "/responses", content=body)
    assert answer.content == b"<html>bad gateway</html>"
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "invalid"}) == 1
    # a model's answer all the same, as a chat one that is no JSON: its first byte is timed
    assert proxy.metric("cachegate_time_to_first_byte_seconds_count", {"model": "gpt-5"}) == 1


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_a_compressed_stream_goes_as_it_came_and_is_read_for_its_usage(
    scripted: Any, proxy_factory: Any, coding: str
) -> None:
    """An upstream that compresses a Responses API stream though asked not to: the client gets
    it as it came, and its log line said no usage was reported (``sessions cost`` blamed the
    provider), its tokens and cost uncounted. A copy is decoded for the record."""
    import gzip
    import zlib

    stream = b"".join(response_events(completed(prompt=2000, hit=1024, out=7)))
    packed = gzip.compress(stream) if coding == "gzip" else zlib.compress(stream)
    pieces = [packed[at : at + 50] for at in range(0, len(packed), 50)]
    _upstream, base = scripted(
        chunks=pieces, extra_headers=[(b"content-encoding", coding.encode())]
    )
    proxy = proxy_factory(base)
    body = {"model": "gpt-5", "input": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"X-Session-Id": "packed", "Accept-Encoding": "identity"}
    with httpx.stream("POST", proxy.base_url + "/responses", json=body, headers=headers) as got:
        assert got.headers["content-encoding"] == coding
        raw = b"".join(got.iter_raw())
    assert raw == packed
    proxy.settle()
    (line,) = events(proxy.log_dir, "packed", "response")
    assert line["usage"]["prompt"] == 2000 and line["error"] is None
    labels = {"model": "gpt-5", "kind": "cache_read"}
    assert proxy.metric("cachegate_tokens_total", labels) == 1024


def test_a_stream_compressed_in_a_coding_cachegate_does_not_read_says_so(
    scripted: Any, proxy_factory: Any
) -> None:
    """A ``br`` stream goes as it came, unread, and its log line says why (it said nothing, and
    read as a provider that reports no usage)."""
    _upstream, base = scripted(
        chunks=[b"\x8b\x00\x80"], extra_headers=[(b"content-encoding", b"br")]
    )
    proxy = proxy_factory(base)
    body = {"model": "gpt-5", "input": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream(
        "POST", proxy.base_url + "/responses", json=body, headers={"X-Session-Id": "br"}
    ) as got:
        assert b"".join(got.iter_raw()) == b"\x8b\x00\x80"
    proxy.settle()
    (line,) = events(proxy.log_dir, "br", "response")
    assert "compressed its stream (br)" in line["error"] and "not recorded" in line["error"]


def test_a_background_request_is_shown_as_one_whose_usage_comes_later(
    scripted: Any, proxy_factory: Any, sdk: Any
) -> None:
    """A ``background`` request is answered "queued", with no usage: its usage comes with a later
    GET of the response, which cachegate relays unread. `sessions show` said "no usage
    reported" and `sessions cost` blamed a provider that gives none; both now say what it is."""
    queued = orjson.dumps(
        {
            "id": "resp_bg",
            "object": "response",
            "created_at": 1,
            "status": "queued",
            "model": "gpt-5",
            "output": [],
            "usage": None,
        }
    )
    _upstream, base = scripted(chunks=[queued], content_type=b"application/json")
    proxy = proxy_factory(base)
    client = sdk(proxy.base_url, default_headers={"X-Session-Id": "bg"})
    answer = client.responses.create(model="gpt-5", input="write an essay", background=True)
    assert answer.status == "queued"
    proxy.settle()
    (line,) = events(proxy.log_dir, "bg", "response")
    assert line["finish_reason"] == "queued" and line["usage"] is None
    shown = run_cli("sessions", "show", "bg", "--log-dir", str(proxy.log_dir))
    assert "background: usage comes later, unread" in shown.out
    assert "no usage reported" not in shown.out
    cost = run_cli("sessions", "cost", "bg", "--log-dir", str(proxy.log_dir))
    assert "1 background response (Responses API, answered queued)" in cost.out
    assert "reported no usage" not in cost.out


def test_usage_and_requests_count_under_the_top_level_model(
    scripted: Any, proxy_factory: Any
) -> None:
    """A body's own ``model``, not one nested before it (a client that sorts its keys writes
    ``metadata`` first), whether or not the body has calls to pair; the request itself counts
    under it and the ``responses`` route, a strict refusal too."""
    events = response_events(completed(prompt=3000, hit=2048))
    _upstream, base = scripted(chunks=events)
    proxy = proxy_factory(base)
    pair = [
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a"},
    ]
    for items in ([{"role": "user", "content": "hi"}], pair):
        body = {"metadata": {"model": "o3"}, "model": "gpt-5-mini", "input": items, "stream": True}
        sent = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
        assert httpx.post(proxy.base_url + "/responses", content=sent).status_code == 200
    labels = {"model": "gpt-5-mini", "kind": "cache_read"}
    assert proxy.metric("cachegate_tokens_total", labels) == 2 * 2048
    assert proxy.metric("cachegate_tokens_total", {"model": "o3", "kind": "prompt"}) == 0
    refused = httpx.post(
        proxy.base_url + "/responses",
        json={"model": "gpt-5-mini", "input": pair[:1]},
        headers={"x-cachegate-strict": "1"},
    )
    assert refused.status_code == 400
    for status, count in (("200", 2), ("400", 1)):
        labels = {"route": "responses", "model": "gpt-5-mini", "status": status}
        assert proxy.metric("cachegate_requests_total", labels) == count
    labels = {"route": "responses", "model": "o3", "status": "200"}
    assert proxy.metric("cachegate_requests_total", labels) == 0


def test_a_body_with_a_lone_surrogate_counts_under_its_own_model(
    scripted: Any, proxy_factory: Any
) -> None:
    """A lone surrogate escape (a text JavaScript cut inside an emoji), which orjson refuses,
    is read as the chat route reads it: its model still names the usage's series."""
    _upstream, base = scripted(chunks=response_events(completed(prompt=900)))
    proxy = proxy_factory(base)
    sent = b'{"model":"gpt-5-mini","input":"hi \\ud83d","stream":true}'
    assert httpx.post(proxy.base_url + "/responses", content=sent).status_code == 200
    assert proxy.metric("cachegate_tokens_total", {"model": "gpt-5-mini", "kind": "prompt"}) == 900
