"""The relay over real loopback sockets: byte identity, headers, errors, disconnects."""

from __future__ import annotations

import contextlib
import functools
import itertools
import socket
import time
from typing import Any

import httptools
import httpx
import orjson
import pytest

from proxy.assemble import StreamRecorder
from proxy.config import sends_usage_unasked
from proxy.eventlog import read_events
from proxy.pipeline import STREAM_FOR_WHOLE, WHOLE_FOR_STREAM, Exchange
from proxy.relay import DisconnectWatch, _sink
from proxy.simulator import SimConfig, run_simulator
from proxy.upstream import UpstreamPool
from tests.e2e_support import events, wait_for

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}


def sse(obj: dict[str, Any], sep: bytes = b"\n\n") -> bytes:
    return b"data: " + orjson.dumps(obj) + sep


def chunk(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}, **extra}],
    }


USAGE_EVENT = sse(
    {
        "id": "c1",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"prompt_tokens": 9, "completion_tokens": 3},
    }
)
STREAM = (
    sse(
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        }
    )
    + b": keep-alive\n\n"
    + sse(chunk("Grüße, 世界 "))
    + sse(chunk("🙂 done"), sep=b"\r\n\r\n")
    + sse(chunk("", finish_reason="stop"))
)


def cut_every(data: bytes, step: int) -> list[bytes]:
    return [data[i : i + step] for i in range(0, len(data), step)]


def read_stream(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[httpx.Response, bytes]:
    with httpx.stream(
        "POST", url + "/chat/completions", json=body, headers=headers, timeout=10
    ) as r:
        data = b"".join(r.iter_raw())
    return r, data


def timed_pieces(base_url: str) -> list[tuple[float, bytes]]:
    """A stream (the client asked for usage itself), each piece with when it arrived."""
    arrivals = []
    with httpx.stream(
        "POST",
        base_url + "/chat/completions",
        json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        t0 = time.monotonic()
        for piece in r.iter_raw():
            arrivals.append((time.monotonic() - t0, piece))
    return arrivals


def test_a_successful_status_with_a_body_that_is_not_json_is_relayed_and_logged_as_an_error(
    scripted: Any, proxy_factory: Any
) -> None:
    """A provider's answer cut short (or an HTML page from a captive portal) under a 200: the
    client gets it as it came, and the log says it was not a chat completion, where it used to
    record a clean exchange with no message."""
    from proxy.eventlog import read_events

    cut = b'{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"ha'
    _upstream, url = scripted(chunks=[cut], content_type=b"application/json")
    proxy = proxy_factory(url)
    via = httpx.post(
        proxy.base_url + "/chat/completions", json=CHAT, headers={"X-Session-Id": "cut"}
    )
    assert via.status_code == 200 and via.content == cut
    proxy.settle()
    response = read_events(proxy.log_dir / "cut.jsonl").events[-1]
    assert response["type"] == "response" and response["status"] == 200
    assert response["message"] is None
    assert response["error"].startswith("upstream answered 200 with a body that is not JSON")
    # the client's SDK fails on it: counted as a stream's event that is no JSON is
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "invalid"}) == 1


@pytest.mark.parametrize(("status", "kind"), [(204, "invalid"), (304, None)])
@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_of_a_status_without_a_body_is_logged_as_such(
    status: int, kind: str | None, stream: bool, scripted: Any, proxy_factory: Any
) -> None:
    """A 204 to a streamed chat request was logged as a stream cut before ``[DONE]`` and
    counted as ``midstream`` (an answer that broke off), and a 304 as a redirect: neither has
    a body by its status, nor an answer in it."""
    _upstream, url = scripted(chunks=[], status=status)
    proxy = proxy_factory(url)
    via = httpx.post(
        proxy.base_url + "/chat/completions",
        json={**CHAT, "stream": stream},
        headers={"X-Session-Id": "empty"},
    )
    assert via.status_code == status and via.content == b""
    proxy.settle()
    response = read_events(proxy.log_dir / "empty.jsonl").events[-1]
    assert response["type"] == "response" and response["status"] == status
    said = {204: "No Content", 304: "Not Modified"}[status]
    assert response["error"] == f"upstream answered {status} ({said}): no answer in it"
    for counted in ("invalid", "midstream"):
        labels = {"kind": counted}
        assert proxy.metric("cachegate_upstream_errors_total", labels) == (counted == kind)


def test_an_answer_the_sdks_read_though_orjson_refuses_it_is_logged_and_counted(
    scripted: Any, proxy_factory: Any
) -> None:
    """A lone surrogate escape (an emoji cut) in a 200 answer: the openai SDKs read it, but the
    log said it was no JSON (no message, no tokens, an error) where the same content streamed
    was read. A ``-Infinity`` logprob, which the Node SDK's parser refuses, stays invalid."""
    from proxy.eventlog import read_events

    def answer(logprob: bytes) -> bytes:
        return (
            b'{"id":"x","object":"chat.completion","model":"gpt-4o","choices":[{"index":0,'
            b'"message":{"role":"assistant","content":"cut \\ud83d"},"finish_reason":"stop",'
            b'"logprobs":{"content":[{"token":"cut","logprob":' + logprob + b"}]}}],"
            b'"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}'
        )

    for logprob, session in ((b"-0.5", "cut"), (b"-Infinity", "infinite")):
        _upstream, url = scripted(chunks=[answer(logprob)], content_type=b"application/json")
        proxy = proxy_factory(url)
        via = httpx.post(
            proxy.base_url + "/chat/completions", json=CHAT, headers={"X-Session-Id": session}
        )
        assert via.status_code == 200 and via.content == answer(logprob)  # (as it came)
        proxy.settle()
        response = read_events(proxy.log_dir / f"{session}.jsonl").events[-1]
        invalid = proxy.metric("cachegate_upstream_errors_total", {"kind": "invalid"})
        if session == "cut":
            assert response["error"] is None and invalid == 0
            assert response["message"]["content"] == "cut \ufffd"
            assert (response["usage"]["prompt"], response["usage"]["completion"]) == (12, 3)
        else:
            assert response["error"].startswith("upstream answered 200 with a body that is not")
            assert invalid == 1


def test_a_client_leaving_halfway_through_an_answer_is_not_blamed_on_the_upstream(
    scripted: Any, proxy_factory: Any
) -> None:
    from proxy.eventlog import read_events

    body = b'{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}'
    _upstream, url = scripted(
        chunks=[body[:40], body[40:]], content_type=b"application/json", delay_s=3.0
    )
    proxy = proxy_factory(url)
    with socket.create_connection((proxy.server.host, proxy.server.port)) as conn:
        payload = orjson.dumps(CHAT)
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nx-session-id: left\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (len(payload), payload)
        )
        received = b""
        while body[:40] not in received:
            received += conn.recv(65536)
    proxy.settle()
    response = read_events(proxy.log_dir / "left.jsonl").events[-1]
    assert response["type"] == "response" and response["interrupted"] is True
    assert response["error"] is None  # the client left: the upstream did nothing wrong


def test_a_client_that_leaves_before_any_answer_is_a_499_and_a_disconnect(
    proxy_factory: Any,
) -> None:
    """Whether it leaves while the upstream thinks or while it is still sending its body: no
    status was sent, so none is recorded but nginx's 499, and each counts as a disconnect."""
    silent = socket.socket()  # takes connections (the kernel's backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        proxy = proxy_factory(f"http://127.0.0.1:{silent.getsockname()[1]}/v1")
        payload = orjson.dumps(CHAT)

        def leave(path: str, sid: str, sent: bytes, length: int) -> None:
            with socket.create_connection((proxy.server.host, proxy.server.port)) as conn:
                conn.sendall(
                    b"POST /v1/%s HTTP/1.1\r\nhost: 127.0.0.1\r\nx-session-id: %s\r\n"
                    b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                    % (path.encode(), sid.encode(), length, sent)
                )
                time.sleep(0.3)  # the upstream has the request (or cachegate waits for the rest)

        leave("chat/completions", "waiting", payload, len(payload))
        leave("chat/completions", "uploading", payload[:10], len(payload))
        leave("embeddings", "uploading-elsewhere", payload[:10], len(payload))
        leave("embeddings", "waiting-elsewhere", payload, len(payload))
        # gone after its headers, before any byte of its body (httpx writes them apart): read
        # as an empty body, it was a 400 invalid_json, the client's own error on a dashboard
        leave("chat/completions", "headers-only", b"", len(payload))
        deadline = time.monotonic() + 5
        while (
            proxy.metric("cachegate_client_disconnects_total") < 5 and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert proxy.metric("cachegate_client_disconnects_total") == 5
        unread = {"route": "chat", "model": "other"}  # (no whole body: no model)
        assert proxy.metric("cachegate_requests_total", {**unread, "status": "499"}) == 2
        assert proxy.metric("cachegate_requests_total", {**unread, "status": "400"}) == 0
        for route in ("chat", "passthrough"):
            labels = {"route": route, "model": "other" if route == "passthrough" else "gpt-4o"}
            assert proxy.metric("cachegate_requests_total", {**labels, "status": "499"}) == (
                2 if route == "passthrough" else 1
            )
            assert proxy.metric("cachegate_requests_total", {**labels, "status": "0"}) == 0
        (waited,) = events(proxy.log_dir, "waiting", "response")
        assert waited["status"] == 499 and waited["interrupted"] is True
        assert waited["error"] is None  # the upstream did nothing wrong
    finally:
        silent.close()


def test_a_client_that_leaves_while_held_headers_wait_for_their_body_is_a_499(
    scripted: Any, proxy_factory: Any
) -> None:
    """The upstream sent a whole answer's headers and none of its body yet: cachegate holds
    them to go out with the first bytes, so a client that leaves then was sent no status (it
    was logged as a 200)."""
    answer = orjson.dumps({"choices": []})
    upstream, url = scripted(
        chunks=[answer],
        first_delay_s=30,
        content_type=b"application/json",
        extra_headers=[(b"content-length", b"%d" % len(answer))],
    )
    proxy = proxy_factory(url)
    payload = orjson.dumps(CHAT)
    with socket.create_connection((proxy.server.host, proxy.server.port)) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nx-session-id: held\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (len(payload), payload)
        )
        wait_for(lambda: upstream.in_flight == 1, what="the request upstream")
        time.sleep(0.3)  # the upstream's headers reach cachegate
    wait_for(lambda: upstream.disconnects, what="the upstream to see the close", timeout=5)
    proxy.settle()
    (response,) = events(proxy.log_dir, "held", "response")
    assert (response["status"], response["interrupted"]) == (499, True)
    assert response["error"] is None  # the client left: the upstream did nothing wrong
    labels = {"route": "chat", "model": "gpt-4o"}
    assert proxy.metric("cachegate_requests_total", {**labels, "status": "499"}) == 1
    assert proxy.metric("cachegate_requests_total", {**labels, "status": "200"}) == 0


def test_an_error_event_mid_stream_is_logged_as_its_message_not_a_python_repr(
    scripted: Any, proxy_factory: Any
) -> None:
    from proxy.eventlog import read_events

    error = {"error": {"message": "The server had an error", "type": "server_error"}}
    _upstream, url = scripted(chunks=[sse(chunk("a")), sse(error)])
    proxy = proxy_factory(url)
    with httpx.stream(
        "POST",
        proxy.base_url + "/chat/completions",
        json={**CHAT, "stream": True},
        headers={"X-Session-Id": "errs"},
    ) as r:
        r.read()
    proxy.settle()
    response = read_events(proxy.log_dir / "errs.jsonl").events[-1]
    assert response["error"] == "The server had an error"
    # a provider failing inside its 200 answers is an upstream error on the dashboard too
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "error_event"}) == 1
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "midstream"}) == 0
    ok = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)  # the same answer again
    assert ok.status_code == 200
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "error_event"}) == 2


def completion(content: Any, prompt_tokens: int, completion_tokens: int) -> bytes:
    """A chat completion's body, as OpenAI writes it (``content`` a text, or a list of parts)."""
    return orjson.dumps(
        {
            "id": "c1",
            "object": "chat.completion",
            "model": "gpt-4o",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
        }
    )


def test_non_streaming_body_status_and_headers_unchanged(scripted: Any, proxy_factory: Any) -> None:
    body = completion("hé", 3, 1)
    upstream, url = scripted(
        chunks=[body[:7], body[7:]],
        content_type=b"application/json",
        extra_headers=[(b"x-request-id", b"req-1"), (b"openai-processing-ms", b"12")],
    )
    proxy = proxy_factory(url)
    direct = httpx.post(url + "/chat/completions", json=CHAT)
    via = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
    assert via.status_code == direct.status_code == 200
    assert via.content == direct.content == body
    assert via.headers["x-request-id"] == "req-1"
    assert via.headers["openai-processing-ms"] == "12"
    assert via.headers["content-type"] == "application/json"
    assert via.headers["x-cachegate-repairs"] == "0"
    assert via.headers["x-cachegate-session"]
    # nothing to change: the upstream received the client's exact bytes
    assert upstream.requests[-1]["body"] == upstream.requests[0]["body"] == orjson.dumps(CHAT)


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 64, 10_000])
def test_stream_bytes_identical_for_any_chunking_when_client_asked_for_usage(
    scripted: Any, proxy_factory: Any, step: int
) -> None:
    stream = STREAM + USAGE_EVENT + b"data: [DONE]\n\n"
    upstream, url = scripted(chunks=cut_every(stream, step))
    proxy = proxy_factory(url)
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    r, data = read_stream(proxy.base_url, body)
    assert r.status_code == 200
    assert data == stream
    assert orjson.loads(upstream.requests[-1]["body"]) == body


@pytest.mark.parametrize("step", [1, 3, 7, 10_000])
def test_usage_event_cachegate_asked_for_is_hidden_from_the_client(
    scripted: Any, proxy_factory: Any, step: int
) -> None:
    stream = STREAM + USAGE_EVENT + b"data: [DONE]\n\n"
    upstream, url = scripted(chunks=cut_every(stream, step))
    proxy = proxy_factory(url)
    body = {**CHAT, "stream": True}
    r, data = read_stream(proxy.base_url, body)
    assert data == STREAM + b"data: [DONE]\n\n"
    sent = orjson.loads(upstream.requests[-1]["body"])
    assert sent == {**body, "stream_options": {"include_usage": True}}
    assert "content-length" not in r.headers


def test_keep_alive_comment_lines_reach_the_client_while_the_model_thinks(
    scripted: Any, proxy_factory: Any
) -> None:
    """A server that writes ``: ping`` and a line end every 0.3 s while the model thinks, with
    no blank line after it: while cachegate took out the usage it had asked for, it held every
    ping until the first event ended, and a client reading with a 1 s timeout (the openai SDK)
    timed out through cachegate where it read the stream directly."""
    import openai

    pings = [b": ping\n"] * 6
    upstream, url = scripted(
        chunks=[*pings, STREAM + USAGE_EVENT + b"data: [DONE]\n\n"], delay_s=0.3
    )
    proxy = proxy_factory(url)
    client = openai.OpenAI(base_url=proxy.base_url, api_key="cachegate", max_retries=0, timeout=1.0)
    chunks = list(client.chat.completions.create(**CHAT, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Grüße, 世界 🙂 done"
    assert orjson.loads(upstream.requests[-1]["body"])["stream_options"] == {"include_usage": True}
    # what the client got: the pings, the stream, no usage event
    _, data = read_stream(proxy.base_url, {**CHAT, "stream": True})
    assert data == b"".join(pings) + STREAM + b"data: [DONE]\n\n"


@pytest.mark.parametrize("dialect", ["openai", "deepseek"])
@pytest.mark.parametrize("tools", [False, True])
def test_a_stream_without_usage_is_what_the_provider_sends_directly(
    proxy_factory: Any, dialect: str, tools: bool
) -> None:
    """cachegate asks for usage on the client's behalf; OpenAI then sends a usage event and a
    null usage on every other chunk. Two simulators started alike answer one request each
    identically, so the client's bytes can be compared: with and without cachegate, the same."""
    body: dict[str, Any] = {
        "model": "gpt-4o",
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me about byte-identical relays, please."}],
    }
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": "read_file", "parameters": {"type": "object"}},
            }
        ]
        body["messages"][0]["content"] = "read two files"
    config = SimConfig(dialect=dialect, chunk_ms=0)
    with run_simulator(config) as direct_sim, run_simulator(config) as proxied_sim:
        _, direct = read_stream(direct_sim.api_base, body)
        proxy = proxy_factory(proxied_sim.api_base)
        r, via = read_stream(proxy.base_url, body)
        asked = proxied_sim.sim.requests[-1].body
    assert r.status_code == 200
    assert asked["stream_options"] == {"include_usage": True}  # cachegate did ask for usage
    assert via == direct
    assert b'"usage":null' not in via
    assert (b'"obfuscation":"' in via) is (dialect == "openai")  # OpenAI pads its chunks
    proxy.settle()
    [response] = events(proxy.log_dir, r.headers["x-cachegate-session"], "response")
    assert response["usage"]["completion"] > 0  # and it has the usage it asked for
    # A client that asks for usage itself gets everything the provider sends, nulls included.
    body["stream_options"] = {"include_usage": True}
    with run_simulator(config) as direct_sim, run_simulator(config) as proxied_sim:
        _, direct = read_stream(direct_sim.api_base, body)
        _, via = read_stream(proxy_factory(proxied_sim.api_base).base_url, body)
    assert via == direct
    assert via.count(b'"usage":null') >= 2


@pytest.mark.parametrize("fails_in", ["decode", "finish"])
def test_a_failing_recorder_costs_the_log_its_message_not_the_client_its_stream(
    scripted: Any, proxy_factory: Any, monkeypatch: pytest.MonkeyPatch, fails_in: str
) -> None:
    """Decoding mid-stream (every ``KEEP_BYTES``, here a few bytes) or at the end."""

    def broken(self: StreamRecorder, *args: Any) -> Any:
        raise RuntimeError("recorder bug")

    monkeypatch.setattr(StreamRecorder, fails_in, broken)
    monkeypatch.setattr(StreamRecorder, "KEEP_BYTES", 50)
    stream = STREAM + USAGE_EVENT + b"data: [DONE]\n\n"
    _upstream, url = scripted(chunks=cut_every(stream, 40))
    proxy = proxy_factory(url)
    r, data = read_stream(proxy.base_url, {**CHAT, "stream": True})
    assert r.status_code == 200
    assert data == STREAM + b"data: [DONE]\n\n"  # the usage event is still taken out
    proxy.settle()
    [response] = events(proxy.log_dir, r.headers["x-cachegate-session"], "response")
    assert response["status"] == 200
    assert response["message"] is None and response["usage"] is None


def test_the_relay_writes_no_empty_chunk() -> None:
    """An empty piece would end a chunked body early (``0\\r\\n\\r\\n``): it is not written."""
    written: list[bytes] = []

    def write(out: bytes) -> bool:
        written.append(out)
        return True

    ex = Exchange("chat", "POST", "chat/completions", 0.0, time.perf_counter())
    sink = _sink(ex, None, None, write)
    assert sink(b"") is True
    assert sink(b"data: x\n\n") is True
    assert written == [b"data: x\n\n"]
    assert ex.ttfb_s is not None


def test_the_relays_short_path_strips_as_the_stripper_does() -> None:
    """Reads of whole events take the sink's inline path; any read must give what the stripper
    gives: a run of three line ends ending a read leaves its third for the next event."""
    from proxy.strip import UsageEventStripper
    from tests.test_strip import CHUNK, DONE, PADDED, USAGE, reference

    for blank, chunk in itertools.product((b"", b"\n", b"\n\n\n", b"\r\n"), (CHUNK, PADDED)):
        reads = [chunk % b"a" + blank, USAGE, chunk % b"b" + blank + USAGE, DONE]
        written: list[bytes] = []
        ex = Exchange("chat", "POST", "chat/completions", 0.0, time.perf_counter())
        stripper = UsageEventStripper()
        sink = _sink(ex, stripper, None, lambda out, kept=written: kept.append(out) or True)
        for read in reads:
            sink(read)
        got = b"".join(written) + stripper.flush()
        assert (got, stripper.stripped) == reference(b"".join(reads)), blank


def test_usage_request_can_be_turned_off(scripted: Any, proxy_factory: Any) -> None:
    upstream, url = scripted(chunks=[STREAM, b"data: [DONE]\n\n"])
    proxy = proxy_factory(url, {"upstream": {"request_usage": False}})
    read_stream(proxy.base_url, {**CHAT, "stream": True})
    assert upstream.requests[-1]["body"] == orjson.dumps({**CHAT, "stream": True})


def test_an_upstream_that_always_streams_usage_is_not_asked_and_keeps_it(
    proxy_factory: Any,
) -> None:
    """OpenRouter sends a stream's usage to every client (``include_usage`` has no effect): the
    client must get that event as it would directly, and the exchange is still accounted."""
    usage = {
        "prompt_tokens": 6000,
        "completion_tokens": 20,
        "cost": 0.0019,
        "prompt_tokens_details": {"cached_tokens": 4992, "cache_write_tokens": 896},
    }
    answer = (
        sse(chunk("ok", finish_reason="stop"))
        + sse({"id": "c1", "object": "chat.completion.chunk", "choices": [], "usage": usage})
        + b"data: [DONE]\n\n"
    )
    sent: list[bytes] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=answer)

    proxy = proxy_factory("https://openrouter.ai/api/v1", transport=httpx.MockTransport(upstream))
    body = {**CHAT, "stream": True}
    _, got = read_stream(proxy.base_url, body, {"X-Session-Id": "openrouter"})
    assert got == answer
    assert orjson.loads(sent[-1]) == body  # no stream_options added
    proxy.settle()
    (log,) = proxy.log_dir.glob("openrouter*.jsonl")
    (response,) = [e for e in read_events(log).events if e["type"] == "response"]
    assert response["usage"] == {
        "prompt": 6000,
        "completion": 20,
        "cache_read": 4992,
        "cache_write": 896,
        "reported_cache": True,
    }


@pytest.mark.parametrize(
    ("url", "unasked"),
    [
        ("https://openrouter.ai/api/v1", True),
        ("https://eu.openrouter.ai/api/v1", True),
        ("https://OpenRouter.ai./api/v1", True),
        ("https://api.openai.com/v1", False),
        ("https://notopenrouter.ai/v1", False),
        ("https://openrouter.ai.example.com/v1", False),
        ("http://127.0.0.1:8000/v1", False),
        ("http://[::1", False),
    ],
)
def test_which_upstreams_stream_usage_unasked(url: str, unasked: bool) -> None:
    assert sends_usage_unasked(url) is unasked


def test_stream_arrives_piece_by_piece(scripted: Any, proxy_factory: Any) -> None:
    events = [sse(chunk(str(i))) for i in range(5)]
    _upstream, url = scripted(chunks=events, delay_s=0.2)
    proxy = proxy_factory(url)
    arrivals = timed_pieces(proxy.base_url)
    assert [p for _, p in arrivals] == events
    assert arrivals[0][0] < arrivals[-1][0] - 0.5


def test_upstream_errors_relayed_verbatim(scripted: Any, proxy_factory: Any) -> None:
    err = b'{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}'
    _upstream, url = scripted(
        chunks=[err],
        status=429,
        content_type=b"application/json",
        extra_headers=[(b"retry-after", b"7")],
    )
    proxy = proxy_factory(url)
    r = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
    assert r.status_code == 429
    assert r.content == err
    assert r.headers["retry-after"] == "7"


@pytest.mark.parametrize(
    ("status", "body", "content_type", "logged"),
    [
        (
            429,
            b'{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit"}}',
            b"application/json",
            "Rate limit reached",
        ),
        (400, b'{"error":"model not found"}', b"application/json", "model not found"),
        (
            502,
            b"<html>\n<head><title>502 Bad Gateway</title></head>\n</html>\n",
            b"text/html",
            "upstream answered 502: <html> <head><title>502 Bad Gateway</title></head> </html>",
        ),
        (503, b"", b"text/plain", "upstream answered 503 with an empty body"),
    ],
)
def test_an_upstream_error_is_logged_with_what_its_body_says(
    scripted: Any,
    proxy_factory: Any,
    status: int,
    body: bytes,
    content_type: bytes,
    logged: str,
) -> None:
    """The client gets the error as it came; the log (and ``sessions show``) says why the
    request failed, where its response line used to hold ``"error": null``."""
    from proxy.eventlog import read_events

    _upstream, url = scripted(
        chunks=[body] if body else [], status=status, content_type=content_type
    )
    proxy = proxy_factory(url)
    for stream in (False, True):
        r = httpx.post(
            proxy.base_url + "/chat/completions",
            json={**CHAT, "stream": stream},
            headers={"X-Session-Id": "refused"},
        )
        assert (r.status_code, r.content) == (status, body)
    proxy.settle()
    responses = [
        e for e in read_events(proxy.log_dir / "refused.jsonl").events if e["type"] == "response"
    ]
    assert [(e["status"], e["error"]) for e in responses] == [(status, logged)] * 2


@pytest.mark.parametrize(
    ("content", "status", "code", "said"),
    [
        (b"{not json", 400, "invalid_json", "not valid JSON"),
        # (the value's JSON name, as OpenAI says it: not Python's "list", "NoneType", "str")
        (b"[1, 2]", 400, "invalid_body", "must be a JSON object, got an array."),
        (b"null", 400, "invalid_body", "must be a JSON object, got null."),
        (b'"hi"', 400, "invalid_body", "must be a JSON object, got a string."),
        (b'{"messages": 3}', 400, "invalid_messages", "'messages' must be an array."),
    ],
)
def test_bad_input_is_refused_in_openai_shape_and_not_forwarded(
    scripted: Any, proxy_factory: Any, content: bytes, status: int, code: str, said: str
) -> None:
    upstream, url = scripted(chunks=[b"{}"])
    proxy = proxy_factory(url)
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        content=content,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and said in error["message"]
    assert upstream.requests == []
    assert r.headers["x-cachegate-repairs"] == "0"  # a chat answer's header, as documented


@pytest.mark.parametrize("route", ["chat/completions", "embeddings"])
def test_a_413_reaches_a_client_still_uploading_its_body(
    scripted: Any, proxy_factory: Any, route: str
) -> None:
    """The async SDK sends a body over the limit: cachegate answered 413 before reading it and
    closed the connection with the client's bytes unread, so the kernel reset it and the SDK,
    still uploading, raised a connection error (13 of 20 requests here) instead of the 413.
    The rest of the upload is now read and dropped before the connection closes."""
    import asyncio

    import openai

    upstream, url = scripted(chunks=[b"{}"])
    proxy = proxy_factory(url, {"server": {"max_body_bytes": 2 * 1024 * 1024}})

    async def send_all() -> list[str]:
        seen = []
        async with openai.AsyncOpenAI(
            base_url=proxy.base_url, api_key="sk-test", max_retries=0
        ) as client:
            for _ in range(10):
                try:
                    if route == "chat/completions":
                        await client.chat.completions.create(
                            model="gpt-4o", messages=[{"role": "user", "content": "z" * 2_300_000}]
                        )
                    else:
                        await client.embeddings.create(model="e", input="z" * 2_300_000)
                    seen.append("answered")
                except openai.APIStatusError as exc:
                    seen.append(f"{exc.status_code} {exc.code}")
                except openai.APIConnectionError as exc:
                    seen.append(f"connection error: {exc.__cause__!r}")
        return seen

    assert asyncio.run(send_all()) == ["413 request_too_large"] * 10
    assert upstream.requests == []


def test_body_over_limit_is_413(scripted: Any, proxy_factory: Any) -> None:
    upstream, url = scripted(chunks=[b"{}"])
    proxy = proxy_factory(url, {"server": {"max_body_bytes": 1000}})
    r = httpx.post(proxy.base_url + "/chat/completions", json={**CHAT, "pad": "x" * 2000})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert upstream.requests == []


def test_unreachable_upstream_is_502_and_said_on_the_terminal_now_and_then(
    proxy_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proxy = proxy_factory(f"http://127.0.0.1:{port}/v1")
    with caplog.at_level("WARNING", logger="proxy.relay"):
        for _ in range(3):
            r = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
            assert r.status_code == 502
            assert r.json()["error"]["code"] == "upstream_unreachable"
    warnings = [r.getMessage() for r in caplog.records if r.name == "proxy.relay"]
    assert len(warnings) == 1  # not one per request
    assert warnings[0].startswith(f"upstream http://127.0.0.1:{port}/v1: cachegate could not reach")
    assert "Connection refused" in warnings[0]
    assert "(requests since start-up: 1 answered 502; next such warning in 30 s" in warnings[0]


def test_upstream_silent_before_headers_is_504(scripted: Any, proxy_factory: Any) -> None:
    _upstream, url = scripted(chunks=[b"{}"], header_delay_s=5, content_type=b"application/json")
    proxy = proxy_factory(url, {"upstream": {"timeout_s": 0.3}})
    r = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"
    # which limit ran out, and the setting to raise (it said "ReadTimeout" alone)
    assert r.json()["error"]["message"] == (
        "The upstream provider did not answer in time: ReadTimeout (nothing for 0.3 s,"
        " upstream.timeout_s)"
    )


@pytest.mark.parametrize("transport", ["native", "httpx"])
def test_a_stream_whose_upstream_goes_quiet_is_cut_and_counted_as_a_timeout(
    scripted: Any, proxy_factory: Any, transport: str
) -> None:
    """``upstream.timeout_s`` running out mid-stream (the headers came, then nothing) was
    counted as ``midstream`` and logged as "upstream broke off": the Failures panel showed
    no timeout for the limit the user set, and the log named no setting to raise."""
    sent = [sse(chunk("a")), sse(chunk("b"))]
    _upstream, url = scripted(chunks=sent, delay_s=2.0)
    config = {"upstream": {"timeout_s": 0.4, "transport": transport}}
    proxy = proxy_factory(url, config)
    body = {**CHAT, "stream": True}
    headers = {"X-Session-Id": "quiet"}
    with (
        httpx.stream("POST", proxy.base_url + "/chat/completions", json=body, headers=headers) as r,
        pytest.raises(httpx.HTTPError),
    ):
        assert r.status_code == 200
        r.read()
    proxy.settle()
    (line,) = events(proxy.log_dir, "quiet", "response")
    assert line["error"] == (
        "upstream sent nothing mid-response: ReadTimeout (nothing for 0.4 s, upstream.timeout_s)"
    )
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "timeout"}) == 1
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "midstream"}) == 0


def test_no_free_upstream_connection_is_cachegates_own_503_not_the_providers_timeout(
    scripted: Any, proxy_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A healthy upstream, every connection of ``upstream.max_connections`` busy: the wait
    was reported as a 504 "The upstream provider did not answer in time: PoolTimeout" and
    counted as the upstream's timeout."""
    events = [sse(chunk(str(i))) for i in range(8)]
    _upstream, url = scripted(chunks=events, delay_s=0.15)  # ~1.2 s, a chunk well within 0.5
    proxy = proxy_factory(url, {"upstream": {"max_connections": 1, "timeout_s": 0.5}})
    with httpx.stream(
        "POST", proxy.base_url + "/chat/completions", json={**CHAT, "stream": True}
    ) as held:
        pieces = held.iter_raw()
        got = next(pieces)
        assert got.startswith(b"data: ")
        with caplog.at_level("WARNING", logger="proxy.relay"):
            r = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, timeout=10)
        got += b"".join(pieces)
    assert got == b"".join(events)  # the stream that held the slot is whole
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == "upstream_connections_busy"
    assert error["message"] == (
        "cachegate had no free upstream connection: all 1 upstream connections"
        " (upstream.max_connections) stayed in use for 0.5 s; raise upstream.max_connections"
        " or send fewer requests at once"
    )
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "timeout"}) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "proxy.relay"]
    assert len(warnings) == 1 and "no free upstream connection" in warnings[0]


def test_direct_body_knows_whether_done_reached_the_socket_and_what_was_dropped() -> None:
    """A client that hangs up once the whole stream, [DONE] included, is in its socket had the
    whole answer (as nginx judges a request complete); one whose bytes were still in cachegate's
    buffer, or came after it left, did not."""
    from types import SimpleNamespace

    from proxy.relay import DirectBody

    class Transport:
        def __init__(self, left: int) -> None:
            self.left, self.written = left, b""

        def write(self, data: bytes) -> None:
            self.written += data

        def get_write_buffer_size(self) -> int:
            return self.left

    def cycle(left: int) -> Any:
        return SimpleNamespace(
            disconnected=False,
            response_complete=False,
            chunked_encoding=True,  # framed as uvicorn frames a stream: judged before that
            expected_content_length=10**9,
            transport=Transport(left),
            flow=SimpleNamespace(write_paused=False),
        )

    sent = DirectBody(cycle(0))
    sent.write(sse(chunk("a")))
    assert not sent.done_handed_over
    sent.write(sse(chunk("b")) + b"data: [DONE]\n\n")
    assert sent.done_handed_over and not sent.dropped
    sent.write(b'data: {"choices":[{"index":0,"delta":{"content":"Step 1 [DONE]"}}]}')
    assert not sent.done_handed_over  # a model's text saying it, then more: not the end
    said = DirectBody(cycle(0))
    said.write(b'data: {"choices":[{"index":0,"delta":{"content":"Step 1 [DONE]"}}]}\n\n')
    assert not said.done_handed_over
    # any of SSE's line ends, with or without the space; split across reads by a gateway
    for pieces in (
        [b"data:[DONE]\r\n\r\n"],
        [b"data: [DONE]\r\r"],
        [sse(chunk("a")) + b"data: [DO", b"NE]\n\n"],
        [sse(chunk("a")), b"da", b"ta: [DONE]\n", b"\n"],
        # dispatched at the CR of its blank line: the LF after it not come yet
        [sse(chunk("a")) + b"data: [DONE]\r\n\r"],
        [b"data: [DONE]\n\r"],
        [b"data: [DONE]\r\n", b"\n"],
        [b"data: [DONE]\r", b"\r\n"],
    ):
        split = DirectBody(cycle(0))
        for piece in pieces:
            split.write(piece)
        assert split.done_handed_over, pieces
    for pieces in ([b"data: [DONE]\r\n"], [b"data: [DONE]\r"], [b"data: [DONE]\n"]):
        one = DirectBody(cycle(0))  # one line end: the event not dispatched yet
        for piece in pieces:
            one.write(piece)
        assert not one.done_handed_over, pieces
    glued = DirectBody(cycle(0))
    glued.write(b'data: {"x":"data: [DO')  # text that looks like the start of one
    glued.write(b'NE]"}\n\n')
    assert not glued.done_handed_over
    held = DirectBody(cycle(70_000))  # the socket took part of it: the rest waits in the buffer
    held.write(b"data: [DONE]\n\n")
    assert not held.done_handed_over
    gone = DirectBody(cycle(0))
    gone._cycle.disconnected = True
    gone.write(sse(chunk("c")))
    assert gone.dropped and gone._cycle.transport.written == b""
    assert b"data: [DONE]\n\n\r\n" in sent._cycle.transport.written  # (framed)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ends", [b"\r", b"\r\n"])
def test_a_stream_of_cr_line_ends_reaches_the_client_as_each_event_ends(
    scripted: Any, proxy_factory: Any, ends: bytes
) -> None:
    """Line ends of CR (or a CRLF stream cut between its last CR and LF): with cachegate's usage
    request to take out, each event was held until the next one began (a byte that is not a
    CRLF's LF), so the client got every event one late, and [DONE] at the stream's end. Here
    the next event comes a minute later: the first must come before it."""
    sep = b"\r\r" if ends == b"\r" else b"\r\n\r"  # CRLF: each read cut before its last LF
    event = sse(chunk("a"), sep)
    with_null = sse({**chunk("a"), "usage": None}, sep)  # OpenAI's null, to be taken out
    second = (b"\n" if ends == b"\r\n" else b"") + with_null
    _upstream, url = scripted(chunks=[with_null, second], delay_s=60)
    proxy = proxy_factory(url)
    got = b""
    with httpx.stream(
        "POST", proxy.base_url + "/chat/completions", json={**CHAT, "stream": True}, timeout=60
    ) as r:
        for piece in r.iter_raw():
            got += piece
            if len(got) >= len(event):
                break
    assert got == event  # its null usage taken out, the bytes otherwise as sent


def test_a_cr_ended_event_keeps_its_lf_when_the_usage_event_follows(
    scripted: Any, proxy_factory: Any
) -> None:
    """Reads of whole CR-ended events pass the relay's short path, which did not note that an
    LF opening the next read was the event's own (a CRLF): before the usage event, that LF went
    out with it."""
    usage = USAGE_EVENT.replace(b"\n\n", b"\r\r")
    reads = [sse(chunk("A"), b"\r\r"), b"\n" + usage, b"\ndata: [DONE]\r\r"]
    _upstream, url = scripted(chunks=reads, delay_s=0.2)  # (each its own read)
    proxy = proxy_factory(url)
    with httpx.stream(
        "POST", proxy.base_url + "/chat/completions", json={**CHAT, "stream": True}
    ) as r:
        got = b"".join(r.iter_raw())
    assert got == sse(chunk("A"), b"\r\r\n") + b"data: [DONE]\r\r"


def test_upstream_stalling_mid_body_cuts_the_client(scripted: Any, proxy_factory: Any) -> None:
    _upstream, url = scripted(chunks=[sse(chunk("a")), sse(chunk("b"))], delay_s=5)
    proxy = proxy_factory(url, {"upstream": {"timeout_s": 0.3}})
    got = b""
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream(
            "POST", proxy.base_url + "/chat/completions", json={**CHAT, "stream": True}
        ) as r,
    ):
        for piece in r.iter_raw():
            got += piece
    assert got == sse(chunk("a"))


def test_upstream_dying_mid_stream_cuts_the_client_the_same_way(
    scripted: Any, proxy_factory: Any
) -> None:
    events = [sse(chunk(str(i))) for i in range(6)]
    _upstream, url = scripted(chunks=events, abort_after=2)
    proxy = proxy_factory(url)
    got = b""
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", url + "/chat/completions", json=CHAT) as r,
    ):
        for piece in r.iter_raw():
            got += piece
    assert got == b"".join(events[:2])
    got = b""
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream(
            "POST", proxy.base_url + "/chat/completions", json={**CHAT, "stream": True}
        ) as r,
    ):
        for piece in r.iter_raw():
            got += piece
    assert got == b"".join(events[:2])


def test_a_refusal_that_breaks_off_is_relayed_as_it_came_on_a_stream_too(
    scripted: Any, proxy_factory: Any
) -> None:
    """A streamed chat request's 400 is read whole before it is relayed (a refusal of the usage
    option is retried without it): one whose body broke off became cachegate's 502 "could not
    reach the upstream provider", its status, request id and retry-after lost, and the SDK
    retried it. It is relayed as it came, then cut, as the same answer to a plain request is."""
    pieces = [b'{"error": {"message": "Invalid ', b'value for messages"}}']
    headers = [(b"x-request-id", b"req_p"), (b"retry-after", b"5")]
    _upstream, url = scripted(
        chunks=pieces,
        status=400,
        content_type=b"application/json",
        extra_headers=headers,
        abort_after=1,
    )
    proxy = proxy_factory(url)
    for stream in (False, True):
        got = b""
        with (
            pytest.raises(httpx.RemoteProtocolError),
            httpx.stream(
                "POST", proxy.base_url + "/chat/completions", json={**CHAT, "stream": stream}
            ) as r,
        ):
            assert r.status_code == 400, stream
            assert (r.headers["x-request-id"], r.headers["retry-after"]) == ("req_p", "5")
            for piece in r.iter_raw():
                got += piece
        assert got == pieces[0], stream
    labels = {"kind": "midstream"}
    assert proxy.metric("cachegate_upstream_errors_total", labels) == 2


def test_a_redirect_on_the_chat_and_responses_routes_is_no_invalid_answer(
    scripted: Any, proxy_factory: Any
) -> None:
    """A provider that redirects (``http://`` to ``https://``, an old path) answered a chat or
    Responses API request with a 3xx: relayed, but counted in
    ``cachegate_upstream_errors_total{kind="invalid"}`` and logged as a body that is not JSON,
    which the dashboard shows as a broken provider. A redirect is valid HTTP the SDKs follow."""
    from proxy.eventlog import read_events

    location = [(b"location", b"/v1/elsewhere")]
    _upstream, url = scripted(
        chunks=[b"<html>moved</html>"],
        status=308,
        content_type=b"text/html",
        extra_headers=location,
    )
    proxy = proxy_factory(url)
    headers = {"X-Session-Id": "moved"}
    for path, body in (("/chat/completions", CHAT), ("/responses", {"model": "m", "input": "hi"})):
        answer = httpx.post(proxy.base_url + path, json=body, headers=headers)
        assert answer.status_code == 308 and answer.content == b"<html>moved</html>"
        assert answer.headers["location"].endswith("/v1/elsewhere")
    proxy.settle()
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "invalid"}) == 0
    log = read_events(proxy.log_dir / "moved.jsonl")
    errors = [e["error"] for e in log.events if e["type"] == "response"]
    assert errors == ["upstream redirected the request (308): no answer of its own"] * 2


def test_authorization_forwarded_unchanged_or_added_from_env(
    scripted: Any, proxy_factory: Any
) -> None:
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url, environ={"OPENAI_API_KEY": "sk-from-env"})
    httpx.post(
        proxy.base_url + "/chat/completions",
        json=CHAT,
        headers={"Authorization": "Bearer sk-client"},
    )
    httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
    auth = [dict(r["headers"]).get(b"authorization") for r in upstream.requests]
    assert auth == [b"Bearer sk-client", b"Bearer sk-from-env"]


def test_a_browsers_cors_preflight_is_relayed_without_the_servers_key(
    scripted: Any, proxy_factory: Any
) -> None:
    """A preflight carries no key and asks for none: the server's key was added to it as to any
    request without one. A plain OPTIONS request still gets it."""
    upstream, url = scripted(chunks=[b""], content_type=b"text/plain")
    proxy = proxy_factory(url, environ={"OPENAI_API_KEY": "sk-from-env"})
    preflight = {
        "Origin": "http://localhost:3000",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    httpx.request("OPTIONS", proxy.base_url + "/responses", headers=preflight)
    httpx.request("OPTIONS", proxy.base_url + "/responses")
    auth = [dict(r["headers"]).get(b"authorization") for r in upstream.requests]
    assert auth == [None, b"Bearer sk-from-env"]


def test_the_placeholder_key_cachegate_stands_for_the_configured_key(
    scripted: Any, proxy_factory: Any
) -> None:
    """The OpenAI SDKs refuse to start without a key: an agent given OPENAI_API_KEY=cachegate
    has the key in cachegate's environment used, on the pipeline and on the generic relay."""
    import openai

    upstream, url = scripted(
        chunks=[b'{"object":"list","data":[]}'], content_type=b"application/json"
    )
    proxy = proxy_factory(url, environ={"OPENAI_API_KEY": "sk-from-env"})
    client = openai.OpenAI(base_url=proxy.base_url, api_key="cachegate", max_retries=0)
    client.chat.completions.with_raw_response.create(model="gpt-4o", messages=[])
    client.models.list()
    # as RFC 9110 allows it too: the scheme in any case, more spaces
    httpx.get(proxy.base_url + "/models", headers={"Authorization": "bearer  cachegate"})
    auth = [dict(r["headers"]).get(b"authorization") for r in upstream.requests]
    assert auth == [b"Bearer sk-from-env"] * 3

    # without a key of its own, cachegate forwards the placeholder: the provider says it is wrong
    # (a key of white space only, OPENAI_API_KEY=" " from a .env file, is none: the request
    # went with no key at all)
    for environ in ({}, {"OPENAI_API_KEY": "   "}):
        upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
        bare = proxy_factory(url, environ=environ)
        httpx.post(
            bare.base_url + "/chat/completions",
            json=CHAT,
            headers={"Authorization": "Bearer cachegate"},
        )
        assert dict(upstream.requests[0]["headers"])[b"authorization"] == b"Bearer cachegate"


@pytest.mark.parametrize(
    ("path", "header"),
    [
        ("/chat/completions", "api-key"),  # Azure OpenAI
        ("/chat/completions", "X-Api-Key"),  # Anthropic and many gateways
        ("/models", "x-goog-api-key"),  # Google, on the generic relay
    ],
)
def test_the_configured_key_is_not_sent_beside_a_key_the_client_brought(
    scripted: Any, proxy_factory: Any, path: str, header: str
) -> None:
    """A client with its own key for another provider must not have the user's OpenAI key sent
    to that provider too."""
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url, environ={"OPENAI_API_KEY": "sk-from-env"})
    send = httpx.post if path == "/chat/completions" else httpx.get
    kwargs: dict[str, Any] = {"json": CHAT} if send is httpx.post else {}
    r = send(proxy.base_url + path, headers={header: "client-own-key"}, **kwargs)
    assert r.status_code == 200
    sent = dict(upstream.requests[0]["headers"])
    assert sent[header.lower().encode()] == b"client-own-key"
    assert b"authorization" not in sent


def test_a_key_header_the_client_declares_hop_by_hop_is_dropped_not_replaced(
    scripted: Any, proxy_factory: Any
) -> None:
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url, environ={"OPENAI_API_KEY": "sk-from-env"})
    headers = {"Authorization": "Bearer sk-client", "Connection": "authorization"}
    httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers=headers)
    assert b"authorization" not in dict(upstream.requests[0]["headers"])


def test_a_key_read_with_its_line_end_is_trimmed(scripted: Any, proxy_factory: Any) -> None:
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url, environ={"OPENAI_API_KEY": " sk-from-file\n"})
    assert httpx.post(proxy.base_url + "/chat/completions", json=CHAT).status_code == 200
    assert dict(upstream.requests[0]["headers"])[b"authorization"] == b"Bearer sk-from-file"


@pytest.mark.parametrize("key", ["sk-a\r\nX-Injected: 1", "sk-\u2026", "sk-a\x00b"])
def test_a_key_no_header_can_carry_is_a_500_naming_the_setting_never_the_key(
    scripted: Any, proxy_factory: Any, key: str
) -> None:
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url, environ={"OPENAI_API_KEY": key})
    for r in (
        httpx.post(proxy.base_url + "/chat/completions", json=CHAT),
        httpx.get(proxy.base_url + "/models"),
    ):
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["code"] == "internal_error"
        assert "upstream.api_key_env" in error["message"]
        assert "sk-" not in r.text
    assert upstream.requests == []  # nothing went out with a broken header
    # a client's own key needs none of it
    ok = httpx.get(proxy.base_url + "/models", headers={"Authorization": "Bearer sk-client"})
    assert ok.status_code == 200


def test_hop_by_hop_and_encoding_headers_are_not_forwarded(
    scripted: Any, proxy_factory: Any
) -> None:
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url)
    httpx.post(
        proxy.base_url + "/chat/completions",
        json=CHAT,
        headers={
            "Connection": "keep-alive, x-foo",
            "X-Foo": "1",
            "Accept-Encoding": "gzip",
            "X-Custom": "kept",
            "Prompt-Cache-Key": "k",
        },
    )
    headers = dict(upstream.requests[0]["headers"])
    assert headers[b"accept-encoding"] == b"identity"
    assert headers[b"x-custom"] == b"kept"
    assert headers.get(b"connection") != b"keep-alive, x-foo"  # the pool sets its own
    assert b"x-foo" not in headers  # named hop-by-hop by the client's Connection header


def test_a_clients_expectation_of_100_continue_is_not_passed_on(
    scripted: Any, proxy_factory: Any
) -> None:
    """curl asks a large POST's server for ``Expect: 100-continue``; cachegate has the whole
    body when it forwards the request, so the upstream is not asked to wait for it (a server
    that does not meet expectations answers 417)."""
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url)
    r = httpx.post(
        proxy.base_url + "/chat/completions", json=CHAT, headers={"Expect": "100-continue"}
    )
    assert r.status_code == 200
    headers = dict(upstream.requests[0]["headers"])
    assert b"expect" not in headers


def test_other_v1_paths_are_relayed_generically(scripted: Any, proxy_factory: Any) -> None:
    upstream, url = scripted(chunks=[b'{"data":[]}'], content_type=b"application/json")
    proxy = proxy_factory(url)
    r = httpx.get(proxy.base_url + "/models?limit=2&after=x")
    assert r.status_code == 200 and r.content == b'{"data":[]}'
    big = b"a" * 300_000

    def gen() -> Any:
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = httpx.post(
        proxy.base_url + "/files",
        content=gen(),
        headers={"content-type": "application/octet-stream"},
    )
    assert r.status_code == 200
    assert [(q["method"], q["path"], q["query"]) for q in upstream.requests] == [
        ("GET", "/v1/models", b"limit=2&after=x"),
        ("POST", "/v1/files", b""),
    ]
    assert upstream.requests[1]["body"] == big


def test_client_disconnect_mid_stream_closes_upstream_at_once(
    scripted: Any, proxy_factory: Any
) -> None:
    events = [sse(chunk(str(i))) for i in range(100)]
    upstream, url = scripted(chunks=events, delay_s=0.1)
    proxy = proxy_factory(url)
    watches = DisconnectWatch.taskless
    with httpx.stream(
        "POST", proxy.base_url + "/chat/completions", json={**CHAT, "stream": True}
    ) as r:
        it = r.iter_raw()
        next(it)
        hung_up = time.monotonic()
    deadline = time.monotonic() + 5
    while not upstream.disconnects and time.monotonic() < deadline:
        time.sleep(0.01)
    assert upstream.disconnects, "upstream never saw the connection close"
    assert upstream.disconnects[0] - hung_up < 1.0
    # (the upstream's handler notes the close on its own loop's thread, then ends: its end is
    # waited for, not raced by this thread)
    while upstream.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert upstream.in_flight == 0
    assert DisconnectWatch.taskless == watches + 1  # noticed with no watching task (uvicorn)


def test_client_disconnect_before_first_byte_closes_upstream(
    scripted: Any, proxy_factory: Any
) -> None:
    upstream, url = scripted(chunks=[sse(chunk("late"))], first_delay_s=30)
    proxy = proxy_factory(url)
    watches = DisconnectWatch.taskless
    with socket.create_connection(("127.0.0.1", proxy.server.port)) as s:
        body = orjson.dumps({**CHAT, "stream": True})
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        s.recv(4096)  # response headers arrive before the first token
        hung_up = time.monotonic()
    deadline = time.monotonic() + 5
    while not upstream.disconnects and time.monotonic() < deadline:
        time.sleep(0.01)
    assert upstream.disconnects and upstream.disconnects[0] - hung_up < 1.0
    assert DisconnectWatch.taskless == watches + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_pipelined_a_request_and_hung_up_cancels_the_upstream(
    scripted: Any, proxy_factory: Any, stream: bool
) -> None:
    """A request sent behind the one being answered, on the same connection, then the client
    gone: uvicorn marked only the queued request's cycle as disconnected, so the upstream
    request ran on to its end (a provider's generation, billed) and the exchange was logged as
    the upstream's failure."""
    upstream, url = scripted(chunks=[sse(chunk("late"))], header_delay_s=30)
    proxy = proxy_factory(url)
    body = orjson.dumps({**CHAT, "stream": stream})
    with socket.create_connection(("127.0.0.1", proxy.server.port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nx-session-id: piped\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % len(body)
            + body
            + b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
        )
        wait_for(lambda: upstream.in_flight == 1, what="the request upstream")
        hung_up = time.monotonic()
    wait_for(lambda: upstream.disconnects, what="the upstream to see the close", timeout=5)
    assert upstream.disconnects[0] - hung_up < 1.0
    proxy.settle()
    (response,) = events(proxy.log_dir, "piped", "response")
    assert (response["status"], response["interrupted"]) == (499, True)
    assert proxy.metric("cachegate_client_disconnects_total") == 1
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "midstream"}) == 0


def test_two_hundred_interrupted_streams_leave_nothing_behind(
    scripted: Any, proxy_factory: Any
) -> None:
    events = [sse(chunk(str(i))) for i in range(50)]
    upstream, url = scripted(chunks=events, delay_s=0.05)
    proxy = proxy_factory(url)

    def tasks() -> int:
        import asyncio

        for _ in range(10):  # read from another thread: retry if the set changes meanwhile
            try:
                return len(asyncio.all_tasks(proxy.gateway.loop))
            except RuntimeError:
                time.sleep(0.01)
        raise AssertionError("could not count the proxy's tasks")

    baseline = tasks()
    with httpx.Client(base_url=proxy.base_url, timeout=10) as client:
        for _ in range(200):
            with client.stream("POST", "/chat/completions", json={**CHAT, "stream": True}) as r:
                next(r.iter_raw())
    deadline = time.monotonic() + 10
    while (upstream.in_flight or len(upstream.disconnects) < 200) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert upstream.in_flight == 0
    assert len(upstream.disconnects) == 200
    transport = proxy.gateway.upstream
    assert isinstance(transport, UpstreamPool)  # the default pool: nothing still checked out
    deadline = time.monotonic() + 5
    while transport.in_use and time.monotonic() < deadline:
        time.sleep(0.02)
    assert transport.in_use == 0
    proxy.settle()
    deadline = time.monotonic() + 5
    while tasks() > baseline and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tasks() <= baseline  # no watcher, relay or writer task left behind


def test_a_compressed_chat_request_is_read_and_forwarded_decoded(
    scripted: Any, proxy_factory: Any
) -> None:
    """Some clients gzip large request bodies (Codex CLI zstd's them): the pipeline reads it as
    JSON (it answered "not valid UTF-8: byte 0x8b"), and the upstream gets it decoded, without
    the coding."""
    import gzip
    import zlib

    import zstandard

    zstd = zstandard.ZstdCompressor()
    unsized = zstd.compressobj()  # (a streaming encoder's frame: its size not said)

    upstream, url = scripted(chunks=[completion("ok", 5, 1)], content_type=b"application/json")
    proxy = proxy_factory(url, {"server": {"max_body_bytes": 100_000}})
    payload = orjson.dumps(CHAT)
    unsized_payload = unsized.compress(payload) + unsized.flush()
    unsized = zstd.compressobj()
    for coding, body in (
        ("gzip", gzip.compress(payload)),
        ("deflate", zlib.compress(payload)),
        ("Deflate", zlib.compress(payload)[2:-4]),  # raw deflate, as some clients send it
        ("zstd", zstd.compress(payload)),
        ("zstd", unsized_payload),
    ):
        r = httpx.post(
            proxy.base_url + "/chat/completions",
            content=body,
            headers={"content-encoding": coding, "content-type": "application/json"},
        )
        assert r.status_code == 200, (coding, r.text)
        seen = upstream.requests[-1]
        assert seen["body"] == payload
        assert b"content-encoding" not in dict(seen["headers"])
    # gzip members one after another are one body, as gzip reads them (RFC 1952)
    halves = gzip.compress(payload[:20]) + gzip.compress(payload[20:])
    r = httpx.post(
        proxy.base_url + "/chat/completions", content=halves, headers={"content-encoding": "gzip"}
    )
    assert r.status_code == 200 and upstream.requests[-1]["body"] == payload
    refusals = [
        ("br", 415, "unsupported_content_encoding", b"\x0b\x02\x80{}\x03"),
        ("gzip", 400, "invalid_content_encoding", b"not gzip at all"),
        ("gzip", 400, "invalid_content_encoding", gzip.compress(payload) + b"GARBAGE"),
        ("gzip", 400, "invalid_content_encoding", gzip.compress(payload)[:-3]),
        ("zstd", 400, "invalid_content_encoding", zstd.compress(payload)[:-3]),
        ("zstd", 400, "invalid_content_encoding", zstd.compress(payload) + b"GARBAGE"),
        ("zstd", 400, "invalid_content_encoding", b"\x28\xb5\x2f\xfd not really zstd"),
        # two frames, the first not saying its size (as streaming encoders write): the second
        # was dropped without a word
        (
            "zstd",
            400,
            "invalid_content_encoding",
            unsized.compress(payload) + unsized.flush() + zstd.compress(b" "),
        ),
        # empty gzip members by the thousand: each copied the rest of the body, and 160,000
        # held the event loop (every other client) for 9 s
        ("gzip", 400, "invalid_content_encoding", gzip.compress(payload) + gzip.compress(b"") * 65),
        # few, but before a large one: each copied the large rest (63 before 64 MB: 4 s)
        (
            "gzip",
            400,
            "invalid_content_encoding",
            gzip.compress(b"") * 8 + gzip.compress(payload + b" " * 90_000, compresslevel=0),
        ),
    ]
    for coding, status, code, body in refusals:
        r = httpx.post(
            proxy.base_url + "/chat/completions", content=body, headers={"content-encoding": coding}
        )
        assert (r.status_code, r.json()["error"]["code"]) == (status, code)
    unsized = zstd.compressobj()  # (a frame's encoder ends with it)
    for coding, bomb in (  # ~1 KB each that decodes past the body limit
        ("gzip", gzip.compress(b" " * 1_000_000)),
        ("zstd", zstd.compress(b" " * 1_000_000)),  # (its size said: refused before decoding)
        ("zstd", unsized.compress(b" " * 1_000_000) + unsized.flush()),
    ):
        r = httpx.post(
            proxy.base_url + "/chat/completions", content=bomb, headers={"content-encoding": coding}
        )
        assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large"), coding
    assert len(upstream.requests) == 6  # none of the refused went upstream


@pytest.mark.parametrize("transport", ["native", "httpx"])
def test_an_upload_keeps_the_length_its_client_announced(
    scripted: Any, proxy_factory: Any, transport: str
) -> None:
    """A file or audio upload arrives in many reads and is streamed on as it comes, with the
    client's Content-Length, not chunked: a server that takes no chunked request body (or sizes
    an upload by its length) sees what it would see directly."""
    upstream, url = scripted(chunks=[b'{"id":"file-1"}'], content_type=b"application/json")
    proxy = proxy_factory(url, {"upstream": {"transport": transport}})
    data = bytes(range(256)) * 4096  # 1 MiB: many reads
    r = httpx.post(proxy.base_url + "/files", content=data, headers={"x-kind": "upload"})
    assert r.status_code == 200
    seen = upstream.requests[-1]
    headers = dict(seen["headers"])
    assert headers.get(b"content-length") == str(len(data)).encode()
    assert b"transfer-encoding" not in headers
    assert seen["body"] == data

    # a client that sends its body chunked, with no length, is relayed whole all the same
    r = httpx.post(proxy.base_url + "/files", content=iter([data[:1000], data[1000:]]))
    assert r.status_code == 200 and upstream.requests[-1]["body"] == data


@pytest.mark.parametrize("transport", ["native", "httpx"])
def test_both_upstream_transports_relay_and_cancel(
    scripted: Any, proxy_factory: Any, transport: str
) -> None:
    stream = STREAM + USAGE_EVENT + b"data: [DONE]\n\n"
    _upstream, url = scripted(chunks=cut_every(stream, 5))
    proxy = proxy_factory(url, {"upstream": {"transport": transport}})
    _, data = read_stream(proxy.base_url, {**CHAT, "stream": True})
    assert data == STREAM + b"data: [DONE]\n\n"
    slow, slow_url = scripted(chunks=[sse(chunk(str(i))) for i in range(50)], delay_s=0.1)
    proxy = proxy_factory(slow_url, {"upstream": {"transport": transport}})
    with httpx.stream(
        "POST", proxy.base_url + "/chat/completions", json={**CHAT, "stream": True}
    ) as r:
        next(r.iter_raw())
        hung_up = time.monotonic()
    deadline = time.monotonic() + 5
    while not slow.disconnects and time.monotonic() < deadline:
        time.sleep(0.01)
    assert slow.disconnects and slow.disconnects[0] - hung_up < 1.0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proxy = proxy_factory(f"http://127.0.0.1:{port}/v1", {"upstream": {"transport": transport}})
    assert httpx.post(proxy.base_url + "/chat/completions", json=CHAT).status_code == 502


def test_upstream_death_mid_stream_is_logged_and_counted(scripted: Any, proxy_factory: Any) -> None:
    from proxy.eventlog import read_events

    events = [sse(chunk(str(i))) for i in range(6)]
    _upstream, url = scripted(chunks=events, abort_after=2)
    proxy = proxy_factory(url)
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream(
            "POST",
            proxy.base_url + "/chat/completions",
            json={**CHAT, "stream": True},
            headers={"X-Session-Id": "dies"},
        ) as r,
    ):
        for _ in r.iter_raw():
            pass
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "midstream"}) == 1
    response = [
        e for e in read_events(proxy.log_dir / "dies.jsonl").events if e["type"] == "response"
    ][-1]
    assert "mid-response" in response["error"]
    assert response["message"]["content"] == "01"  # what arrived before the upstream died
    assert proxy.metric("cachegate_active_streams") == 0


def test_passthrough_body_over_limit_is_413(scripted: Any, proxy_factory: Any) -> None:
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url, {"server": {"max_body_bytes": 1000}})
    r = httpx.post(proxy.base_url + "/embeddings", content=b"x" * 5000)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert upstream.requests == []


@pytest.mark.parametrize("path", ["chat/completions", "files"])
def test_a_body_announced_past_the_limit_is_refused_before_any_of_it_is_sent(
    scripted: Any, proxy_factory: Any, path: str
) -> None:
    """The 413 came once the limit's worth had arrived, and a relayed upload had sent that much
    upstream, with the client's key, before it was cut."""
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url, {"server": {"max_body_bytes": 1000}})
    with socket.create_connection((proxy.server.host, proxy.server.port)) as conn:
        conn.sendall(
            b"POST /v1/%s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: 5000\r\n\r\n" % path.encode()
        )  # and not a byte of the body
        conn.settimeout(5)
        head = conn.recv(65536)
    assert head.startswith(b"HTTP/1.1 413 ")
    assert b"request_too_large" in head
    assert upstream.requests == []


@pytest.mark.parametrize("path", ["chat/completions", "files"])
def test_a_413_closes_the_connection_whose_body_it_did_not_read(
    scripted: Any, proxy_factory: Any, path: str
) -> None:
    """``Expect: 100-continue`` and a length past the limit: the 413 left the connection open,
    waiting for the body, and the client's next request on it was taken for that body (never
    answered)."""
    _upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url, {"server": {"max_body_bytes": 1000}})
    with socket.create_connection((proxy.server.host, proxy.server.port)) as conn:
        conn.sendall(
            b"POST /v1/%s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"expect: 100-continue\r\ncontent-length: 5000\r\n\r\n" % path.encode()
        )
        conn.settimeout(5)
        answer = b""
        while chunk := conn.recv(65536):  # to the close
            answer += chunk
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 413 ") and b"\r\nconnection: close" in head


def test_a_relayed_request_whose_client_leaves_before_its_body_is_not_sent(
    scripted: Any, proxy_factory: Any
) -> None:
    """Gone after its headers: its empty body went upstream all the same, a request the client
    never made (with cachegate's key where the client sent none)."""
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url)
    with socket.create_connection((proxy.server.host, proxy.server.port)) as conn:
        conn.sendall(b"POST /v1/files HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 500\r\n\r\n")
    deadline = time.monotonic() + 5
    while proxy.metric("cachegate_client_disconnects_total") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    labels = {"route": "passthrough", "model": "other", "status": "499"}
    assert proxy.metric("cachegate_requests_total", labels) == 1
    assert proxy.metric("cachegate_client_disconnects_total") == 1
    time.sleep(0.2)
    assert upstream.requests == []


@pytest.mark.parametrize("transport", ["native", "httpx"])
def test_streamed_upload_over_limit_is_413_not_502(
    scripted: Any, proxy_factory: Any, transport: str
) -> None:
    _upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(
        url, {"server": {"max_body_bytes": 100_000}, "upstream": {"transport": transport}}
    )

    def gen() -> Any:
        for _ in range(10):
            yield b"x" * 65536

    r = httpx.post(proxy.base_url + "/files", content=gen())
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("raw_path", "forwarded"),
    [
        (b"/v1/files/abc%2Fdef", b"/v1/files/abc%2Fdef"),
        (b"/v1/models/a%3Fb", b"/v1/models/a%3Fb"),
        (b"/s/sess-1/v1/files/x%20y", b"/v1/files/x%20y"),
        (b"/v1/models/..%2F..%2Fadmin%2Fkeys", None),
        (b"/v1/models/%2E%2E/admin", None),
        (b"/s/sess-1/v1/..%2Fadmin", None),
        # a prefix that routes only once decoded: its raw segments do not line up with the route
        (b"/v1%2Fmodels%2Fgpt-4o", None),
        (b"/v1%2F..%2Fadmin", None),
        (b"/s/abc%2Fv1/models/gpt-4o", None),
        (b"/s/a%3Ab/v1/models", b"/v1/models"),  # an id's ':' percent-encoded is still the id
        # routed, decoded, as session "zz" asking for "v1/chat/completions": the upstream's
        # chat endpoint, past cachegate's chat route (no repair, no log)
        (b"/s/zz%2Fv1/v1/chat/completions", None),
        # a dot segment with a path parameter, which Tomcat and Spring read as the dots
        (b"/v1/..;/admin", None),
        (b"/v1/%2e%2e;x=1/admin", None),
        (b"/s/a%3Ab/v1/.;/%2E%2E;/admin", None),  # (its refusal names the session, a:b)
        (b"/v1/models;v=1", b"/v1/models;v=1"),
    ],
)
def test_paths_are_relayed_as_encoded_and_never_climb_out_of_v1(
    scripted: Any, proxy_factory: Any, raw_path: bytes, forwarded: bytes | None
) -> None:
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url, environ={"OPENAI_API_KEY": "sk-server-key"})
    with httpx.Client() as c:
        r = c.get(httpx.URL(proxy.url).copy_with(raw_path=raw_path))
    if forwarded is None:
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "invalid_path"
        assert upstream.requests == []
        # an explicit session's refusal says it, as its other answers do
        session = {b"/s/sess-1/": "sess-1", b"/s/a%3Ab/": "a:b"}.get(
            raw_path[: raw_path.find(b"/v1") + 1]
        )
        assert r.headers.get("x-cachegate-session") == session
        with httpx.Client() as c:  # (named by its header: as explicit)
            url = httpx.URL(proxy.url).copy_with(raw_path=raw_path)
            r = c.get(url, headers={"X-Session-Id": "hdr-1"})
        assert r.status_code == 400
        # (under /s/, the path's session, or none where the path names none as routed)
        header = session if raw_path.startswith(b"/s/") else "hdr-1"
        assert r.headers.get("x-cachegate-session") == header
    else:
        assert r.status_code == 200
        assert upstream.requests[0]["raw_path"] == forwarded


@pytest.mark.parametrize("method", ["TRACE", "PROPFIND", "PURGE"])
@pytest.mark.parametrize("prefix", ["/v1", "/s/sess-1/v1", "/s/sess%2D1/v1"])
def test_methods_no_api_uses_are_refused_not_relayed_with_the_key(
    scripted: Any, proxy_factory: Any, method: str, prefix: str
) -> None:
    """TRACE asks the upstream to echo the request back, the key cachegate adds with it; WebDAV's
    and caches' methods have no use in a provider's API. Refused, nothing sent upstream. (The
    refusal names the path's session, also percent-encoded: its other answers did.)"""
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url, environ={"OPENAI_API_KEY": "sk-server-key"})
    with httpx.Client() as c:
        r = c.request(method, proxy.url + prefix + "/models")
    assert r.status_code == 405
    assert r.json()["error"]["code"] == "method_not_allowed"
    assert method in r.json()["error"]["message"]
    assert r.headers["allow"] == "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"
    assert r.headers.get("x-cachegate-session") == ("sess-1" if prefix.startswith("/s/") else None)
    with httpx.Client() as c:  # a session named by its header is as explicit
        r = c.request(method, proxy.url + prefix + "/models", headers={"X-Session-Id": "hdr-1"})
    assert r.status_code == 405
    assert r.headers["x-cachegate-session"] == ("sess-1" if prefix.startswith("/s/") else "hdr-1")
    assert upstream.requests == []
    with httpx.Client() as c:  # the methods an API uses still go
        assert c.request("OPTIONS", proxy.url + prefix + "/models").status_code == 200
        assert c.request("PATCH", proxy.url + prefix + "/models").status_code == 200
    assert [r["method"] for r in upstream.requests] == ["OPTIONS", "PATCH"]


class RawUpstream:
    """A raw-socket upstream answering every request with fixed bytes, for answers no server sends.

    It closes each connection after its answer: an answer a client may read whole on a kept
    connection says ``connection: close``, else the next request may race the close (the proxy
    reuses the connection, finds it closed unanswered, and answers 502, as it should)."""

    def __init__(self, answer: bytes, hold_s: float = 0.0) -> None:
        import threading

        self.answer = answer
        self.hold_s = hold_s  # (then it stalls this long after its answer, before it closes)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.hold_s:  # (the next connection is answered meanwhile)
                threading.Thread(target=self._answer, args=(conn,), daemon=True).start()
            else:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                conn.sendall(self.answer)
                time.sleep(self.hold_s)
            except OSError:
                pass


@pytest.mark.parametrize("transport", ["native", "httpx"])
@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 abc OK\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nbad header line\r\n\r\n{}",
        b"SSH-2.0-OpenSSH_9.6\r\nno http here\r\n\r\n",  # a port of another service
    ],
)
def test_a_malformed_upstream_answer_is_a_502(
    proxy_factory: Any, transport: str, answer: bytes
) -> None:
    """The upstream was reached: its answer could not be read, which the error and the metric
    say (it used to be "could not reach the upstream", counted as a connect failure)."""
    upstream = RawUpstream(answer)
    try:
        proxy = proxy_factory(upstream.url, {"upstream": {"transport": transport}})
        for path in ("/chat/completions", "/embeddings"):
            r = httpx.post(proxy.base_url + path, json=CHAT)
            assert r.status_code == 502, (path, r.text)
            assert r.json()["error"]["code"] == "upstream_invalid_answer"
            message = r.json()["error"]["message"]
            assert "could not be read as HTTP" in message
            # the words a user reads, not Python's repr of h11's buffer (bytearray(b'SSH-2.0…'))
            assert "bytearray" not in message and "b'" not in message, message
        assert proxy.metric("cachegate_upstream_errors_total", {"kind": "invalid"}) == 2
        assert proxy.metric("cachegate_upstream_errors_total", {"kind": "connect"}) == 0
    finally:
        upstream.sock.close()


@pytest.mark.parametrize("transport", ["native", "httpx"])
@pytest.mark.parametrize(
    "answer",
    [
        # headers that never end: they used to be held whole (1.5 GB in 10 s from a hostile
        # upstream), waiting for an end that never came
        b"HTTP/1.1 200 OK\r\n" + b"x-a: " + b"b" * 1000 + b"\r\n" * 1 + b"x-a: b\r\n" * 20000,
        # a switch of protocols nobody asked for: it used to reach the client as a 101 with a body
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
        b"raw bytes of another protocol",
        # three digits the parsers take, but no HTTP status: the client's connection was closed
        # with no byte (the server's status-line table has none), the log said "empty body"
        b"HTTP/1.1 999 Weird\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1 600 Nope\r\ncontent-length: 2\r\n\r\n{}",
        # a control character in a header's value: h11 takes it, the server does not send it
        # on (with httpx, the client's connection was dropped with no answer)
        b"HTTP/1.1 200 OK\r\nx-odd: a\x01b\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nx-odd: a\x7fb\r\ncontent-length: 2\r\n\r\n{}",
    ],
    ids=["endless-headers", "unasked-101", "status-999", "status-600", "ctl-01", "ctl-del"],
)
def test_an_answer_no_client_should_take_is_a_502(
    proxy_factory: Any, transport: str, answer: bytes
) -> None:
    upstream = RawUpstream(answer)
    try:
        proxy = proxy_factory(upstream.url, {"upstream": {"transport": transport}})
        for path in ("/chat/completions", "/models"):
            send = httpx.post if path == "/chat/completions" else httpx.get
            kwargs: dict[str, Any] = {"json": CHAT} if send is httpx.post else {}
            r = send(proxy.base_url + path, **kwargs)
            assert r.status_code == 502, (path, r.status_code, r.content[:200])
            assert r.json()["error"]["code"] == "upstream_invalid_answer"
    finally:
        upstream.sock.close()


@pytest.mark.parametrize("pad", [250, 262, 270, 280])
def test_a_refusal_that_echoes_the_key_leaves_no_piece_of_it_in_the_log(
    scripted: Any, proxy_factory: Any, pad: int
) -> None:
    """The log keeps 300 characters of a refusal: cut inside an echoed key, the piece left was
    neither the whole key nor a key's pattern, and went to the log as it was."""
    from proxy.eventlog import read_events

    key = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb7cDe0f"
    message = "." * pad + f" Incorrect API key provided: {key}. You can find your API key at …"
    _upstream, url = scripted(
        chunks=[orjson.dumps({"error": {"message": message, "code": "invalid_api_key"}})],
        content_type=b"application/json",
        status=401,
    )
    proxy = proxy_factory(url, environ={"OPENAI_API_KEY": key})
    r = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers={"X-Session-Id": "k"})
    assert r.status_code == 401  # relayed verbatim to the client, whose key it is
    proxy.settle()
    logged = (proxy.log_dir / "k.jsonl").read_text()
    response = read_events(proxy.log_dir / "k.jsonl").events[-1]
    assert response["error"].startswith("." * pad)
    for n in range(8, len(key) + 1):
        assert key[:n] not in logged, key[:n]


def test_a_stream_past_the_recording_limit_is_relayed_whole_its_text_not_recorded(
    scripted: Any, proxy_factory: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """An upstream that never ends its answer used to have every byte recorded: 4 GB of
    cachegate's memory, then one 725 MB log line. Past the limit the text is let go; the usage
    at the end is still read (a long answer of ~100k tokens reaches the limit: it is priced)."""
    from proxy import assemble
    from proxy.eventlog import read_events

    monkeypatch.setattr(assemble, "MAX_RECORDED_STREAM", 256 * 1024)
    delta = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 1000 + b'"}}]}\n\n'
    usage = (
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}],"usage":'
        b'{"prompt_tokens":20000,"completion_tokens":150000,'
        b'"prompt_tokens_details":{"cached_tokens":18000}}}\n\n'
    )
    events = [delta] * 600 + [usage, b"data: [DONE]\n\n"]  # ~620 KB
    _upstream, url = scripted(chunks=events)
    proxy = proxy_factory(url)
    with caplog.at_level("WARNING"):
        r = httpx.post(
            proxy.base_url + "/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
            headers={"X-Session-Id": "endless"},
        )
        proxy.settle()
    assert r.status_code == 200 and r.content == b"".join(events)  # the client lost nothing
    response = read_events(proxy.log_dir / "endless.jsonl").events[-1]
    assert response["type"] == "response" and response["status"] == 200
    assert response["message"] is None  # its text not recorded: no 600 KB line
    assert response["usage"]["prompt"] == 20000 and response["usage"]["completion"] == 150000
    assert response["finish_reason"] == "length"
    assert (
        "stream longer than 262,144 bytes: its text not recorded (its usage and finish are)"
        in caplog.text
    )
    assert caplog.text.count("stream longer than") == 1


def test_a_stream_line_that_never_ends_is_let_go_past_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tracemalloc

    from proxy import assemble

    monkeypatch.setattr(assemble, "MAX_RECORDED_STREAM", 64 * 1024)
    monkeypatch.setattr(assemble, "_MAX_PENDING_EVENT", 1024 * 1024)
    recorder = assemble.StreamRecorder()
    recorder.feed(b'data: {"choices":[{"index":0,"delta":{"content":"')
    tracemalloc.start()
    try:
        for _ in range(2000):  # 32 MB of one line
            recorder.feed(b"y" * 16384)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024
    recorder.feed(
        b'"}}]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9}}\n\n'
    )
    result = recorder.finish()
    assert result.usage is not None and result.usage.completion == 9


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\ncontent-type: application/json\ncontent-length: 2\n\n{}",  # bare LF
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
        b"content-length: 99\r\n\r\n2\r\n{}\r\n0\r\n\r\n",  # chunks beside a length
    ],
)
def test_answers_other_http_clients_read_are_read(proxy_factory: Any, answer: bytes) -> None:
    """A bare LF line end, or chunked framing beside a length (the chunks win, as in httpx): the
    native pool refused these with a 502 that the SDK then retried."""
    upstream = RawUpstream(answer)
    try:
        proxy = proxy_factory(upstream.url)
        r = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
        assert (r.status_code, r.content) == (200, b"{}")
    finally:
        upstream.sock.close()


@pytest.mark.parametrize("transport", ["native", "httpx"])
def test_no_cookie_from_one_client_reaches_another(
    scripted: Any, proxy_factory: Any, transport: str
) -> None:
    upstream, url = scripted(
        chunks=[b"{}"],
        content_type=b"application/json",
        extra_headers=[(b"set-cookie", b"__cf_bm=client-a-secret; Path=/")],
    )
    proxy = proxy_factory(
        url.replace("127.0.0.1", "localhost"), {"upstream": {"transport": transport}}
    )
    httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers={"User-Agent": "client-a"})
    httpx.get(proxy.base_url + "/models", headers={"User-Agent": "client-b"})
    second = dict(upstream.requests[1]["headers"])
    assert b"cookie" not in second
    assert dict(upstream.requests[0]["headers"])[b"user-agent"] == b"client-a"
    assert second[b"user-agent"] == b"client-b"  # the pool adds no headers of its own


def test_client_leaving_after_a_streamed_upload_cancels_the_upstream(
    scripted: Any, proxy_factory: Any
) -> None:
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json", header_delay_s=10)
    proxy = proxy_factory(url)

    def gen() -> Any:
        for _ in range(8):
            yield b"a" * 65536

    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(proxy.base_url + "/audio/transcriptions", content=gen(), timeout=0.5)
    deadline = time.monotonic() + 5
    while not upstream.disconnects and time.monotonic() < deadline:
        time.sleep(0.01)
    assert upstream.disconnects and upstream.disconnects[0] - t0 < 2.0
    assert upstream.requests[0]["body"] == b"a" * 8 * 65536


@pytest.mark.parametrize("transport", ["native", "httpx"])
def test_a_repeated_request_header_stays_repeated(
    scripted: Any, proxy_factory: Any, transport: str
) -> None:
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url, {"upstream": {"transport": transport}})
    httpx.post(
        proxy.base_url + "/chat/completions", json=CHAT, headers=[("x-dup", "a"), ("x-dup", "b")]
    )
    assert [v for k, v in upstream.requests[0]["headers"] if k == b"x-dup"] == [b"a", b"b"]


def test_streams_go_from_upstream_socket_to_client_socket_directly(
    scripted: Any, proxy_factory: Any
) -> None:
    """Under uvicorn with the native pool, chunks are written to the client from the upstream
    connection's callback (``DirectBody`` + ``UpstreamResponse.pipe``), still byte for byte and
    still as they arrive; with a content length the body keeps its length framing."""
    events = [sse(chunk(str(i))) for i in range(4)]
    _upstream, url = scripted(chunks=events, delay_s=0.15)
    proxy = proxy_factory(url)
    relay = proxy.gateway.relay
    before = relay.direct_relays
    arrivals = timed_pieces(proxy.base_url)
    assert [p for _, p in arrivals] == events
    assert arrivals[-1][0] - arrivals[0][0] > 0.3
    assert relay.direct_relays == before + 1
    body = orjson.dumps({"id": "x", "choices": [], "usage": {"prompt_tokens": 1}})
    _upstream, url = scripted(
        chunks=cut_every(body, 7),
        content_type=b"application/json",
        extra_headers=[(b"content-length", str(len(body)).encode())],
    )
    proxy = proxy_factory(url)
    r = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
    assert r.content == body
    assert r.headers["content-length"] == str(len(body))
    assert proxy.gateway.relay.direct_relays == 1


def test_a_client_that_stops_reading_stops_the_upstream_too(
    scripted: Any, proxy_factory: Any
) -> None:
    """Back-pressure through the direct path: while the client reads nothing, the upstream can
    only get as far as the socket buffers allow; then every byte still arrives, in order."""
    piece = sse(chunk("x" * 16000))
    upstream, url = scripted(chunks=[piece] * 4000)  # ~64 MB
    proxy = proxy_factory(url)
    with socket.create_connection(("127.0.0.1", proxy.server.port)) as sock:
        body = orjson.dumps({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        first = sock.recv(65536)  # the head and the first bytes: the stream is flowing
        time.sleep(1.0)  # the client reads nothing for a second
        stalled_at = upstream.sent
        assert stalled_at < 2000  # 32 MB would have gone through without back-pressure
        time.sleep(0.3)
        assert upstream.sent - stalled_at < 50  # and it stays stalled
        raw = bytearray(first)  # on a loaded machine that first read can be a whole 64 KiB
        sock.settimeout(10)
        while not raw.endswith(b"\r\n0\r\n\r\n"):
            data = sock.recv(1 << 20)
            if not data:
                break
            raw += data
    assert upstream.sent == 4000
    payload = bytearray()
    done: list[bool] = []

    class Body:  # httptools (the pool's own parser) undoes the chunked framing
        def on_body(self, data: bytes) -> None:
            payload.extend(data)

        def on_message_complete(self) -> None:
            done.append(True)

    httptools.HttpResponseParser(Body()).feed_data(bytes(raw))
    assert done  # every byte the upstream sent, in order, nothing else
    assert len(payload) == 4000 * len(piece)
    assert payload == piece * 4000


def _cyclic_garbage(proxy: Any, requests: Any) -> Any:
    """What of cachegate's (and its stack's) ``requests()`` left in reference cycles: run with
    the collector off, then found by one collection (by type name)."""
    import gc
    from collections import Counter

    proxy.settle()
    gc.collect()
    gc.disable()
    try:
        requests()
        proxy.settle()
        time.sleep(0.2)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        return Counter(
            type(o).__qualname__
            for o in gc.garbage
            if type(o).__module__.startswith(("proxy.", "uvicorn.", "asyncio", "httptools"))
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_relayed_requests_leave_no_reference_cycles(scripted: Any, proxy_factory: Any) -> None:
    """Everything a relayed request allocates is freed by reference counting the moment it is
    done: nothing of cachegate's waits for a full garbage collection (with a thousand streams in
    flight those walk every live object)."""
    _upstream, url = scripted(chunks=[STREAM, USAGE_EVENT, b"data: [DONE]\n\n"])
    proxy = proxy_factory(url)
    with httpx.Client(base_url=proxy.base_url, timeout=10) as client:
        client.post("/chat/completions", json={**CHAT, "stream": True}).read()  # warm

        def requests() -> None:
            for i in range(10):
                body = {**CHAT, "stream": i % 2 == 0}
                client.post("/chat/completions", json=body).read()
                with client.stream("POST", "/chat/completions", json=body) as r:
                    next(r.iter_raw())  # a client that leaves early: cancelled, disconnected

        ours = _cyclic_garbage(proxy, requests)
    assert not ours, ours


@pytest.mark.parametrize("failure", ["refused", "error answer"])
def test_failed_upstream_requests_leave_no_reference_cycles(
    failure: str, scripted: Any, proxy_factory: Any
) -> None:
    """An upstream that refuses the connection, or answers 500 (the connection is then closed,
    not reused): the connection's parser, which holds its methods, is let go with it, not left
    in a cycle for a collection, which runs seldom (``cachegate serve`` collects the young
    generation past 10,000 objects)."""
    from tests.e2e_support import free_port

    if failure == "refused":
        url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    else:
        _upstream, url = scripted(chunks=[b'{"error":{"message":"boom"}}'], status=500)
    proxy = proxy_factory(url)
    with httpx.Client(base_url=proxy.base_url, timeout=10) as client:
        client.post("/chat/completions", json=CHAT)  # warm

        def requests() -> None:
            for _ in range(5):
                status = client.post("/chat/completions", json=CHAT).status_code
                assert status == (502 if failure == "refused" else 500)

        ours = _cyclic_garbage(proxy, requests)
    assert not ours, ours


def test_refused_requests_leave_no_reference_cycles(scripted: Any, proxy_factory: Any) -> None:
    """A request refused before it is forwarded (not JSON, over the body limit, a broken
    history in strict mode) left its error in a cycle with the handler's frame, and the body
    with them: 64 MiB held for each refused upload until a collection, which runs seldom."""
    _upstream, url = scripted(chunks=[STREAM, USAGE_EVENT, b"data: [DONE]\n\n"])
    proxy = proxy_factory(url, {"server": {"max_body_bytes": 2**20}})
    dangling = {
        **CHAT,
        "messages": [
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
        ],
    }
    with httpx.Client(base_url=proxy.base_url, timeout=10) as client:
        assert client.post("/chat/completions", content=b"{not json").status_code == 400  # warm

        def requests() -> None:
            for _ in range(3):
                assert client.post("/chat/completions", content=b"{not json").status_code == 400
                big = b'{"model":"m","messages":[{"role":"user","content":"' + b"a" * 2**21
                assert client.post("/chat/completions", content=big).status_code == 413
                strict = client.post(
                    "/chat/completions", json=dangling, headers={"X-Cachegate-Strict": "1"}
                )
                assert strict.status_code == 400

        ours = _cyclic_garbage(proxy, requests)
    assert not ours, ours


_CUT_ANSWERS = {
    "cut mid-body": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b'content-length: 100\r\n\r\n{"id":',
    "cut mid-stream": b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b'transfer-encoding: chunked\r\n\r\n10\r\ndata: {"a":1}\n\n\r\n',
    "malformed status": b"HTTP/1.1 abc OK\r\ncontent-length: 2\r\n\r\n{}",
    "headers cut": b"HTTP/1.1 200 OK\r\ncontent-le",
    "until close": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n"
    b'{"id":"x","choices":[]}',
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("answer", [*_CUT_ANSWERS, "stalled mid-body", "stalled mid-stream"])
def test_cut_or_malformed_answers_leave_no_reference_cycles(
    answer: str, stream: bool, proxy_factory: Any
) -> None:
    """An answer cut mid-body or mid-stream, one with a malformed status line, headers cut by
    the close, one that stalls mid-way past the read timeout: the error each becomes is raised
    where the relay waits for it, so its traceback holds that frame, and the frame the
    connection or response that stored the error. Once the request is done, the stored error is
    let go: a 600 KB request is not kept (~1.2 MB with its copies) until a collection."""
    stalled = answer.startswith("stalled")
    upstream = RawUpstream(_CUT_ANSWERS[answer.replace("stalled", "cut")], 0.5 if stalled else 0)
    try:
        proxy = proxy_factory(upstream.url, {"upstream": {"timeout_s": 0.2}} if stalled else None)
        body = {**CHAT, "stream": stream}
        with httpx.Client(base_url=proxy.base_url, timeout=10) as client:

            def post() -> None:
                with contextlib.suppress(httpx.HTTPError):  # a cut stream: the client sees it
                    client.post("/chat/completions", json=body).read()

            post()  # warm

            def requests() -> None:
                for _ in range(5):
                    post()

            ours = _cyclic_garbage(proxy, requests)
        assert not ours, ours
    finally:
        upstream.sock.close()


def test_a_304_with_a_length_is_relayed_without_a_body(proxy_factory: Any) -> None:
    upstream = RawUpstream(  # (it closes after each answer: it says so, see RawUpstream)
        b'HTTP/1.1 304 Not Modified\r\ncontent-length: 12\r\netag: "v1"\r\nconnection: close\r\n\r\n'
    )
    try:
        proxy = proxy_factory(upstream.url)
        with httpx.Client(base_url=proxy.base_url, timeout=5) as client:
            for _ in range(2):  # and the client's connection is still good afterwards
                r = client.get("/files/file-1/content", headers={"if-none-match": '"v1"'})
                assert r.status_code == 304
                assert r.headers["etag"] == '"v1"'
                assert r.content == b""
    finally:
        upstream.sock.close()


def test_a_client_leaving_after_an_early_answer_to_its_upload_cancels_the_upstream(
    proxy_factory: Any,
) -> None:
    """The upstream answers (and streams) before the client's chunked upload is complete; the
    client then hangs up. cachegate must notice and close the upstream socket at once. (A 2xx
    sent early does not end the upload: cachegate goes on sending it, as httpx does, and the
    answer follows once it has all left; the client leaves before that.)"""
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    closed_at: list[float] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
            conn.settimeout(0.1)
            for i in range(100):  # 10 s of events unless the proxy goes away
                event = b"data: %d\n\n" % i
                try:
                    conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
                    while conn.recv(65536):  # the upload so far; b"" once the proxy closed
                        pass
                    closed_at.append(time.monotonic())
                    return
                except TimeoutError:
                    continue
                except OSError:
                    closed_at.append(time.monotonic())
                    return

    threading.Thread(target=serve, daemon=True).start()
    try:
        proxy = proxy_factory(f"http://127.0.0.1:{listener.getsockname()[1]}/v1")
        with socket.create_connection(("127.0.0.1", proxy.server.port)) as client:
            client.sendall(b"POST /v1/uploads/u1/parts HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                           b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")  # fmt: skip
            time.sleep(0.3)  # the upstream has answered meanwhile; it shows between chunks
            client.sendall(b"5\r\nworld\r\n")  # and the upload never ends
            time.sleep(0.3)  # the upstream streams meanwhile
            left = time.monotonic()
        deadline = time.monotonic() + 5
        while not closed_at and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closed_at and closed_at[0] - left < 1.0
    finally:
        listener.close()


class _WriteLog:
    """Wraps a server connection's transport: every write it is asked for, in order."""

    def __init__(self, transport: Any, writes: list[bytes]) -> None:
        self._transport = transport
        self.writes = writes

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


@pytest.fixture
def server_writes(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[bytes]]:
    """The writes of every uvicorn (httptools) connection accepted from now on, by local port."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    made = HttpToolsProtocol.connection_made
    seen: dict[int, list[bytes]] = {}

    def connection_made(self: Any, transport: Any) -> None:
        port = transport.get_extra_info("sockname")[1]
        made(self, _WriteLog(transport, seen.setdefault(port, [])))

    monkeypatch.setattr(HttpToolsProtocol, "connection_made", connection_made)
    return seen


def test_an_answer_goes_out_with_its_headers_in_one_write(
    scripted: Any, proxy_factory: Any, server_writes: dict[int, list[bytes]]
) -> None:
    """A non-streamed answer and its status line and headers reach the client in one write (one
    system call and one segment, not two); bytes and framing as before."""
    body = orjson.dumps({"id": "x", "choices": [], "usage": {"prompt_tokens": 1}})
    _upstream, url = scripted(
        chunks=[body],
        content_type=b"application/json",
        extra_headers=[(b"content-length", str(len(body)).encode())],
    )
    proxy = proxy_factory(url)
    port = int(proxy.base_url.split(":")[2].split("/")[0])
    with httpx.Client() as client:
        for _ in range(2):  # and the connection stays good for the next request
            r = client.post(proxy.base_url + "/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.content == body
    writes = [w for w in server_writes[port] if w]  # uvicorn's end of a length-framed body: b""
    assert len(writes) == 2
    assert all(
        w.startswith(b"HTTP/1.1 200 OK\r\n") and w.endswith(b"\r\n\r\n" + body) for w in writes
    )


def test_the_headers_of_a_body_of_unknown_length_are_not_held(
    scripted: Any, proxy_factory: Any
) -> None:
    """Only a whole answer (with its length) waits to go out with its headers: a chunked one
    may be streamed (ndjson, audio), and its client gets the headers when the upstream sends
    them."""
    body = orjson.dumps({"id": "x", "choices": [], "usage": {"prompt_tokens": 1}})
    _upstream, url = scripted(
        chunks=[body[:10], body[10:]], content_type=b"application/json", first_delay_s=1.0
    )
    proxy = proxy_factory(url)
    t0 = time.monotonic()
    with httpx.stream("POST", proxy.base_url + "/chat/completions", json=CHAT) as r:
        headers_after = time.monotonic() - t0
        assert r.status_code == 200
        assert r.read() == body
    assert headers_after < 0.8


def test_a_streams_headers_are_not_held_for_its_first_event(
    scripted: Any, proxy_factory: Any
) -> None:
    """A client may wait on a stream's headers (the SDKs do before iterating): they go out when
    the upstream's do, not with the first event."""
    _upstream, url = scripted(chunks=[sse(chunk("a")), b"data: [DONE]\n\n"], first_delay_s=1.0)
    proxy = proxy_factory(url)
    t0 = time.monotonic()
    with httpx.stream(
        "POST", proxy.base_url + "/chat/completions", json={**CHAT, "stream": True}
    ) as r:
        headers_after = time.monotonic() - t0
        assert r.status_code == 200
        assert r.read() == sse(chunk("a")) + b"data: [DONE]\n\n"
    assert headers_after < 0.8


@pytest.mark.parametrize("transport", ["native", "httpx"])
def test_an_answer_whose_upstream_dies_before_its_body_reaches_the_client_as_it_would_directly(
    proxy_factory: Any, transport: str
) -> None:
    """The held headers are written before the client is cut: it sees the status, then the
    break (as from the upstream itself); an empty answer still gets its headers."""
    upstream = RawUpstream(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 40\r\n\r\n"
    )
    try:
        proxy = proxy_factory(upstream.url, {"upstream": {"transport": transport}})
        for target in (upstream.url, proxy.base_url):
            # directly, the raw upstream's close may come as a reset; through cachegate, the
            # client's connection is cut after the headers
            with httpx.stream("POST", target + "/chat/completions", json=CHAT) as r:
                assert r.status_code == 200
                with pytest.raises(httpx.TransportError):
                    r.read()
    finally:
        upstream.sock.close()
    empty = RawUpstream(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 0\r\n"
        b"connection: close\r\n\r\n"
    )
    try:
        proxy = proxy_factory(empty.url, {"upstream": {"transport": transport}})
        with httpx.Client(timeout=5) as client:
            for _ in range(2):
                r = client.post(proxy.base_url + "/chat/completions", json=CHAT)
                assert r.status_code == 200 and r.content == b""
    finally:
        empty.sock.close()


def _stream_with_usage() -> bytes:
    """An OpenAI stream as it comes when usage was asked for: text, then the usage event."""
    base = {"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o"}
    parts = [
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]},
        {**base, "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
        {**base, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}},
    ]
    return b"".join(sse(p) for p in parts) + b"data: [DONE]\n\n"


def _client_sees(proxy: Any, session: str) -> tuple[httpx.Response, list[dict[str, Any]]]:
    """A streamed chat request as the openai SDK makes it (no usage asked for), read whole;
    the data events the client got."""
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json={**CHAT, "stream": True},
        headers={"X-Session-Id": session},
    )
    data = [orjson.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return r, data


@pytest.mark.parametrize(
    ("content_type", "encoding", "transport"),
    [
        (b"Text/Event-Stream; charset=utf-8", None, "native"),  # media types: any case
        # a stream that does not say it is one: the SDKs read it as SSE all the same
        (b"text/plain; charset=utf-8", None, "native"),
        (b"application/x-ndjson", None, "httpx"),
        (b"application/stream+json", None, "native"),
        (b"", None, "native"),
        (b"text/event-stream", b"gzip", "native"),  # compressed though asked for identity
        (b"text/event-stream", b"gzip", "httpx"),
        (b"text/event-stream", b"Identity", "native"),  # codings are case-insensitive
    ],
)
def test_a_stream_in_an_unusual_dress_still_loses_the_usage_event_and_is_recorded(
    scripted: Any,
    proxy_factory: Any,
    content_type: bytes,
    encoding: bytes | None,
    transport: str,
) -> None:
    """cachegate asked for the usage event on the client's behalf: it must not reach a client
    that did not ask (the SDK fails on its empty ``choices``), and the log must hold the answer.
    Both were skipped for a capitalized media type or any ``Content-Encoding``."""
    import zlib

    from proxy.eventlog import read_events

    stream = _stream_with_usage()
    body = stream
    headers: list[tuple[bytes, bytes]] = []
    if encoding == b"gzip":
        packer = zlib.compressobj(wbits=zlib.MAX_WBITS | 16)
        body = packer.compress(stream) + packer.flush()
    if encoding is not None:
        headers.append((b"content-encoding", encoding))
    half = len(body) // 2
    _upstream, url = scripted(
        chunks=[body[:half], body[half:]], content_type=content_type, extra_headers=headers
    )
    proxy = proxy_factory(url, {"upstream": {"transport": transport}})
    r, data = _client_sees(proxy, "dressed")
    assert r.status_code == 200
    if encoding == b"gzip":  # decoded for the client, as its HTTP client would have
        assert "content-encoding" not in r.headers
    assert [d["choices"][0]["delta"].get("content") for d in data] == ["Hel", "lo"]
    assert all("usage" not in d for d in data)
    proxy.settle()
    [response] = [
        e for e in read_events(proxy.log_dir / "dressed.jsonl").events if e["type"] == "response"
    ]
    assert response["message"]["content"] == "Hello"
    assert response["usage"]["prompt"] == 9 and response["error"] is None


@pytest.mark.parametrize("read_size", [7, 1, 4096])
def test_a_gzip_stream_of_several_members_is_decoded_whole(
    scripted: Any, proxy_factory: Any, read_size: int
) -> None:
    """A server that compresses each flush on its own sends gzip members one after another
    (RFC 1952): only the first was decoded, the rest dropped, and the client saw a clean end
    after a cut event."""
    import gzip

    from proxy.eventlog import read_events

    stream = _stream_with_usage()
    body = b"".join(gzip.compress(stream[i : i + 40]) for i in range(0, len(stream), 40))
    pieces = [body[i : i + read_size] for i in range(0, len(body), read_size)]
    _upstream, url = scripted(chunks=pieces, extra_headers=[(b"content-encoding", b"gzip")])
    proxy = proxy_factory(url)
    r, data = _client_sees(proxy, "members")
    assert r.status_code == 200
    assert [d["choices"][0]["delta"].get("content") for d in data] == ["Hel", "lo"]
    assert r.text.endswith("data: [DONE]\n\n") and all("usage" not in d for d in data)
    proxy.settle()
    [response] = [
        e for e in read_events(proxy.log_dir / "members.jsonl").events if e["type"] == "response"
    ]
    assert response["message"]["content"] == "Hello"
    assert response["usage"]["prompt"] == 9 and response["error"] is None


def test_a_gzip_stream_that_does_not_decode_is_said_to_be_so(
    scripted: Any, proxy_factory: Any
) -> None:
    """A stream whose gzip is corrupt (its first member good, then bytes that are no deflate):
    cut for the client after what decoded, as ever, but logged as ``upstream broke off
    mid-response: error`` (zlib's exception's class) and counted as a break, though the
    upstream sent its whole body."""
    import gzip

    from proxy.eventlog import read_events

    stream = _stream_with_usage()
    good = gzip.compress(stream[:40])
    corrupt = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03" + b"garbage" * 8
    _upstream, url = scripted(
        chunks=[good, corrupt], extra_headers=[(b"content-encoding", b"gzip")]
    )
    proxy = proxy_factory(url)
    with pytest.raises(httpx.RemoteProtocolError):  # (cut: no clean end after what decoded)
        httpx.post(
            proxy.base_url + "/chat/completions",
            json={**CHAT, "stream": True},
            headers={"X-Session-Id": "corrupt"},
        )
    proxy.settle()
    [response] = [
        e for e in read_events(proxy.log_dir / "corrupt.jsonl").events if e["type"] == "response"
    ]
    assert response["error"].startswith("upstream's gzip stream does not decode: "), response
    assert "broke off" not in response["error"]
    errors = {
        s.labels["kind"]: s.value
        for f in proxy.registry.collect()
        for s in f.samples
        if s.name == "cachegate_upstream_errors_total"
    }
    assert errors.get("invalid") == 1 and not errors.get("midstream"), errors


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_a_json_answer_that_does_not_decode_is_no_answer_in_the_log(
    scripted: Any, proxy_factory: Any, coding: str
) -> None:
    """A whole answer sent plain under a ``gzip`` label (a broken gateway): relayed as it came,
    and the SDK fails on it (``DecodingError``) and retries; it was logged and counted as a
    clean 200, its message, tokens and cost each time, no upstream error."""
    from proxy.eventlog import read_events

    answer = completion("hello", 5, 1)
    _upstream, url = scripted(
        chunks=[answer],
        content_type=b"application/json",
        extra_headers=[(b"content-encoding", coding.encode())],
    )
    proxy = proxy_factory(url)
    with httpx.stream(
        "POST",
        proxy.base_url + "/chat/completions",
        json=CHAT,
        headers={"X-Session-Id": "plain-gzip"},
    ) as raw:  # (read raw: an SDK's client fails on it, httpx.DecodingError)
        assert raw.status_code == 200 and raw.headers["content-encoding"] == coding
        assert b"".join(raw.iter_raw()) == answer  # (relayed as it came)
    proxy.settle()
    [response] = [
        e for e in read_events(proxy.log_dir / "plain-gzip.jsonl").events if e["type"] == "response"
    ]
    assert response["error"].startswith(f"upstream's {coding} answer does not decode: "), response
    assert response["usage"] is None and response["message"] is None
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "invalid"}) == 1


def test_a_stream_compressed_beyond_reading_is_relayed_as_it_came_and_said_in_the_log(
    scripted: Any, proxy_factory: Any
) -> None:
    from proxy.eventlog import read_events

    _upstream, url = scripted(
        chunks=[b"\x1b\x00\xf8"], extra_headers=[(b"content-encoding", b"br")]
    )
    proxy = proxy_factory(url)
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json={**CHAT, "stream": True},
        headers={"X-Session-Id": "brotli", "accept-encoding": "identity"},
    )
    assert (r.headers["content-encoding"], r.content) == ("br", b"\x1b\x00\xf8")
    proxy.settle()
    [response] = [
        e for e in read_events(proxy.log_dir / "brotli.jsonl").events if e["type"] == "response"
    ]
    assert response["error"].startswith("upstream compressed its stream (br) though asked not to")


@pytest.mark.parametrize(
    ("body", "encoding", "error"),
    [
        ("gzip", b"gzip", None),  # the client gets it as it came; the log reads it decoded
        ("bom", None, None),  # a byte order mark, which JSON readers skip
        ("empty", None, "upstream answered 200 with an empty body"),
    ],
)
def test_an_answer_body_is_read_for_the_log_as_a_json_reader_would(
    scripted: Any, proxy_factory: Any, body: str, encoding: bytes | None, error: str | None
) -> None:
    import zlib

    from proxy.eventlog import read_events

    answer = completion("Hello", 9, 2)
    if body == "gzip":
        packer = zlib.compressobj(wbits=zlib.MAX_WBITS | 16)
        raw = packer.compress(answer) + packer.flush()
    else:
        raw = {"bom": b"\xef\xbb\xbf" + answer, "empty": b""}[body]
    headers = [(b"content-encoding", encoding)] if encoding else []
    _upstream, url = scripted(
        chunks=[raw] if raw else [], content_type=b"application/json", extra_headers=headers
    )
    proxy = proxy_factory(url)
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json=CHAT,
        headers={"X-Session-Id": "plain", "accept-encoding": "identity"},
    )
    if encoding:  # relayed compressed, as it came (httpx decodes it here)
        assert (r.headers["content-encoding"], r.content) == ("gzip", answer)
    else:
        assert r.content == raw  # verbatim
    proxy.settle()
    [response] = [
        e for e in read_events(proxy.log_dir / "plain.jsonl").events if e["type"] == "response"
    ]
    assert response["error"] == error
    if error is None:
        assert response["message"]["content"] == "Hello" and response["usage"]["prompt"] == 9


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (  # cut inside an event: only the connection's end framed it
            b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
            b'data: {"id":"c1","choices":[{"index":0,"delta":{"cont',
            "upstream ended the stream inside an event, before [DONE]",
        ),
        (  # whole, even without the last blank line after [DONE]
            b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
            b"data: [DONE]\n",
            None,
        ),
        (  # an event that is no JSON, then the cut: both said, the cut counted as one
            b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
            b"data: {broken\n\n"
            b'data: {"id":"c1","choices":[{"index":0,"delta":{"cont',
            "upstream ended the stream inside an event, before [DONE]; upstream sent 1 stream"
            " event whose data was not a JSON object (the openai SDKs fail on it; the Vercel AI SDK reads on past it)",
        ),
    ],
)
def test_a_stream_framed_by_the_connections_end_and_cut_short_is_logged_as_cut(
    proxy_factory: Any, body: bytes, error: str | None
) -> None:
    """An HTTP/1.0-style answer (no length, no chunks) ends when the connection does: a cut is
    then a clean end to HTTP. The client gets the bytes as they came; the log used to record a
    clean success."""
    from proxy.eventlog import read_events

    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    upstream = RawUpstream(head + body)
    try:
        proxy = proxy_factory(upstream.url, {"upstream": {"request_usage": False}})
        r = httpx.post(
            proxy.base_url + "/chat/completions",
            json={**CHAT, "stream": True},
            headers={"X-Session-Id": "closed"},
        )
        assert (r.status_code, r.content) == (200, body)
        proxy.settle()
        [response] = [
            e for e in read_events(proxy.log_dir / "closed.jsonl").events if e["type"] == "response"
        ]
        assert response["message"]["content"] == "Hel"
        assert response["error"] == error
        cut = proxy.metric("cachegate_upstream_errors_total", {"kind": "midstream"})
        assert cut == (1 if error else 0)
    finally:
        upstream.sock.close()


def test_a_compressed_body_is_decoded_for_the_log_only_up_to_the_recorded_size() -> None:
    """100 KB of gzip can hold 100 MB: decoding it whole for the log would take that memory."""
    import zlib

    from proxy.relay import MAX_RECORDED_BODY, _decode

    packer = zlib.compressobj(wbits=zlib.MAX_WBITS | 16)
    bomb = packer.compress(b"\0" * (MAX_RECORDED_BODY + 1)) + packer.flush()
    assert _decode("gzip", bomb) is bomb  # left as it came: not read
    packer = zlib.compressobj(wbits=zlib.MAX_WBITS | 16)
    assert _decode("GZIP".lower(), packer.compress(b'{"a":1}') + packer.flush()) == b'{"a":1}'


def test_a_compressed_stream_is_decoded_piece_by_piece_and_cut_past_the_limit() -> None:
    import zlib

    from proxy import relay

    pieces: list[int] = []

    def sink(chunk: bytes) -> bool:
        pieces.append(len(chunk))
        return True

    packer = zlib.compressobj(wbits=zlib.MAX_WBITS | 16)
    bomb = packer.compress(b"\0" * (relay.MAX_DECODED_STREAM + 1)) + packer.flush()
    decoding = relay._decoding(relay._Decoder("gzip"), sink)
    with pytest.raises(relay.DecodedTooLarge, match="decodes to over"):
        decoding(bomb)  # one small chunk: ~64 KB of gzip
    assert max(pieces) <= relay._DECODE_PIECE  # never one allocation of the whole
    assert sum(pieces) == relay.MAX_DECODED_STREAM  # (to the limit exactly)


@pytest.mark.parametrize("transport", ["native", "httpx"])
def test_a_stream_cut_past_the_decoding_limit_says_cachegate_cut_it(
    scripted: Any, proxy_factory: Any, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gzip stream that decodes past the limit is cut by cachegate: its log line said the
    upstream broke off (``ValueError``), counted as an upstream failure; and through httpx's
    pool the pieces decoded before the limit, in the read that crossed it, were dropped."""
    import zlib

    from proxy import relay

    limit = 3 * relay._DECODE_PIECE
    monkeypatch.setattr(relay, "MAX_DECODED_STREAM", limit)
    event = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"a" * 900 + b'"}}]}\n\n'
    packer = zlib.compressobj(wbits=zlib.MAX_WBITS | 16)
    first = packer.compress(event * 1650) + packer.flush(zlib.Z_SYNC_FLUSH)  # ~1.5 MiB decoded
    second = packer.compress(event * 4500) + packer.flush()  # the read that crosses the limit
    _upstream, url = scripted(
        chunks=[first, second], delay_s=0.2, extra_headers=[(b"content-encoding", b"gzip")]
    )
    proxy = proxy_factory(url, {"upstream": {"transport": transport}})
    got = b""
    with (
        httpx.stream(
            "POST",
            proxy.base_url + "/chat/completions",
            json={**CHAT, "stream": True},
            headers={"X-Session-Id": "bomb"},
        ) as r,
        pytest.raises(httpx.RemoteProtocolError),  # (cut, as the upstream's failures are)
    ):
        for piece in r.iter_raw():
            got += piece
    # what was decoded before the limit: the first read's, and the crossing read's first piece
    assert len(first) < 2 * relay._DECODE_PIECE
    assert limit - 2_000 < len(got) <= limit  # (to the limit, but an event it cut)
    proxy.settle()
    (response,) = events(proxy.log_dir, "bomb", "response")
    assert response["error"] == (
        f"cut by cachegate: the compressed stream decodes to over {limit} bytes, as a"
        " compression bomb"
    )
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "midstream"}) == 0


def test_a_raw_deflate_stream_is_read_as_http_clients_read_it(
    scripted: Any, proxy_factory: Any
) -> None:
    """Some servers send "deflate" without zlib's header; HTTP clients read both. The stream was
    cut after its headers."""
    import zlib

    stream = _stream_with_usage()
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    body = packer.compress(stream) + packer.flush()
    _upstream, url = scripted(chunks=[body], extra_headers=[(b"content-encoding", b"deflate")])
    proxy = proxy_factory(url)
    r, data = _client_sees(proxy, "raw-deflate")
    assert r.status_code == 200
    assert [d["choices"][0]["delta"].get("content") for d in data] == ["Hel", "lo"]


def test_an_upstream_that_closes_without_answering_is_unreachable_not_invalid(
    proxy_factory: Any,
) -> None:
    upstream = RawUpstream(b"")  # reads the request, answers nothing, closes
    try:
        proxy = proxy_factory(upstream.url)
        r = httpx.post(proxy.base_url + "/chat/completions", json=CHAT)
        assert (r.status_code, r.json()["error"]["code"]) == (502, "upstream_unreachable")
        assert proxy.metric("cachegate_upstream_errors_total", {"kind": "invalid"}) == 0
    finally:
        upstream.sock.close()


@pytest.mark.parametrize("coding", ["deflate", "gzip"])
def test_a_compressed_stream_is_decoded_whatever_its_first_reads_hold(coding: str) -> None:
    """One byte first: zlib waits on it, then the next read tells the framing (raw deflate was
    cut as soon as its second read came)."""
    import zlib

    from proxy import relay

    plain = _stream_with_usage()
    wbits = -zlib.MAX_WBITS if coding == "deflate" else zlib.MAX_WBITS | 16
    packer = zlib.compressobj(wbits=wbits)
    packed = packer.compress(plain) + packer.flush()
    for split in (1, 2, 3):
        got: list[bytes] = []
        decoding = relay._decoding(relay._Decoder(coding), functools.partial(_kept, got))
        decoding(packed[:split])
        decoding(packed[split:])
        assert b"".join(got) == plain, split


def _kept(into: list[bytes], chunk: bytes) -> bool:
    into.append(chunk)
    return True


def test_past_the_limit_new_tool_calls_on_every_delta_are_not_kept_either(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broken upstream that opens a new tool call on every delta: past the limit their
    arguments were let go but the calls themselves kept, 66 MB for 13 MB streamed."""
    import tracemalloc

    from proxy import assemble

    monkeypatch.setattr(assemble, "MAX_RECORDED_STREAM", 64 * 1024)
    recorder = assemble.StreamRecorder()
    tracemalloc.start()
    try:
        for i in range(40_000):  # ~5 MB
            recorder.feed(
                b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":%d,"id":"c%d",'
                b'"function":{"name":"f","arguments":"{}"}}]}}]}\n\n' % (i, i)
            )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * 1024


def test_past_the_limit_a_last_event_of_megabytes_still_gives_its_usage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A provider that sends a whole tool call in one last chunk, with the finish reason and the
    usage: past the limit, an unfinished event was dropped at 1 MiB, and the exchange went
    unpriced."""
    from proxy import assemble

    monkeypatch.setattr(assemble, "MAX_RECORDED_STREAM", 64 * 1024)
    recorder = assemble.StreamRecorder()
    delta = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 1000 + b'"}}]}\n\n'
    for _ in range(130):
        recorder.feed(delta)
    last = (
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c","function":'
        b'{"name":"write","arguments":"' + b"y" * (3 * 1024 * 1024) + b'"}}]},'
        b'"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":7,"completion_tokens":9}}\n\n'
    )
    for start in range(0, len(last), 16384):
        recorder.feed(last[start : start + 16384])
    result = recorder.finish()
    assert result.usage is not None and result.usage.completion == 9
    assert result.finish_reason == "tool_calls"
    assert result.text_dropped


def test_an_upstream_that_does_not_accept_in_time_is_a_504_naming_the_connect_timeout(
    proxy_factory: Any,
) -> None:
    from tests.test_upstream import _full_accept_queue

    listener, port, filler = _full_accept_queue()  # the next connect waits ~1 s for its SYN
    try:
        config = {"upstream": {"connect_timeout_s": 0.3}}
        proxy = proxy_factory(f"http://127.0.0.1:{port}/v1", config)
        r = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 504
        assert r.json()["error"]["message"] == (
            "The upstream provider did not answer in time: ConnectTimeout (no connection within"
            " 0.3 s, upstream.connect_timeout_s)"
        )
    finally:
        filler.close()
        listener.close()


@pytest.mark.parametrize(
    ("content_type", "chunked"),
    [(b"text/plain", False), (b"application/problem+json", True), (b"text/json", True)],
)
def test_a_stream_request_answered_whole_under_another_type_is_recorded_as_an_answer(
    scripted: Any, proxy_factory: Any, content_type: bytes, chunked: bool
) -> None:
    """A server that ignores "stream" and answers a whole completion (with its length, or as
    JSON of any kind): read as a stream, its message, usage and cost were lost."""
    from proxy.eventlog import read_events

    answer = orjson.dumps(
        {
            "id": "c1",
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hello"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
        }
    )
    pieces = [answer[:20], answer[20:]] if chunked else [answer]
    length = [] if chunked else [(b"content-length", b"%d" % len(answer))]
    _upstream, url = scripted(chunks=pieces, content_type=content_type, extra_headers=length)
    proxy = proxy_factory(url)
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json={**CHAT, "stream": True},
        headers={"X-Session-Id": "whole"},
    )
    assert r.content == answer
    proxy.settle()
    [response] = [
        e for e in read_events(proxy.log_dir / "whole.jsonl").events if e["type"] == "response"
    ]
    assert response["message"]["content"] == "hello"
    assert response["usage"]["prompt"] == 10
    # the SDKs read no chunk of it: the client's answer was empty, and the log said nothing
    assert response["error"] == WHOLE_FOR_STREAM


def test_a_request_for_no_stream_answered_with_a_stream_is_noted(
    scripted: Any, proxy_factory: Any
) -> None:
    """The Python SDK hands such an answer over as a str, not a completion: logged as answered,
    with no note."""
    from proxy.eventlog import read_events

    events = [
        b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
        b'"delta":{"content":"Hello"},"finish_reason":null}]}\n\n',
        b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
        b'"delta":{},"finish_reason":"stop"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    _upstream, url = scripted(chunks=events, content_type=b"text/event-stream")
    proxy = proxy_factory(url)
    r = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers={"X-Session-Id": "sse"})
    assert r.content == b"".join(events)
    proxy.settle()
    [response] = [
        e for e in read_events(proxy.log_dir / "sse.jsonl").events if e["type"] == "response"
    ]
    assert response["message"]["content"] == "Hello"
    assert response["error"] == STREAM_FOR_WHOLE
    # a whole completion under the stream's type, which the SDK reads: no such note
    whole = b'{"id":"c2","object":"chat.completion","choices":[]}'
    _upstream, url = scripted(chunks=[whole], content_type=b"text/event-stream")
    proxy = proxy_factory(url)
    httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers={"X-Session-Id": "j"})
    proxy.settle()
    [line] = [e for e in read_events(proxy.log_dir / "j.jsonl").events if e["type"] == "response"]
    assert line["error"] != STREAM_FOR_WHOLE


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_whole_completion_labelled_as_an_event_stream_is_read_as_the_answer_it_is(
    scripted: Any, proxy_factory: Any, stream: bool, chunked: bool
) -> None:
    """A gateway that labels every answer ``text/event-stream``: a whole completion under that
    type, which the Python SDK reads as JSON for a request without ``stream``, was read as an
    event stream of none: logged with no message or usage (no tokens, no cost) and noted as
    ``upstream ended the stream inside an event``. For a streamed request, the SDKs read no
    chunk of it: the note says so."""
    from proxy.eventlog import read_events

    answer = completion("hello", 10, 2)
    pieces = [b"\n" + answer[:20], answer[20:]] if chunked else [answer]
    _upstream, url = scripted(chunks=pieces, content_type=b"text/event-stream; charset=utf-8")
    proxy = proxy_factory(url)
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json={**CHAT, "stream": True} if stream else CHAT,
        headers={"X-Session-Id": "labelled"},
    )
    assert r.content == b"".join(pieces)  # relayed as it came
    proxy.settle()
    [response] = [
        e for e in read_events(proxy.log_dir / "labelled.jsonl").events if e["type"] == "response"
    ]
    assert response["message"]["content"] == "hello"
    assert response["usage"]["prompt"] == 10 and response["usage"]["completion"] == 2
    assert response["error"] == (WHOLE_FOR_STREAM if stream else None)
    # and a Responses API answer so labelled, which the SDK reads too
    whole = orjson.dumps(
        {
            "id": "resp_1",
            "object": "response",
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "hello"}],
                }
            ],
            "usage": {"input_tokens": 10, "output_tokens": 2, "total_tokens": 12},
        }
    )
    _upstream, url = scripted(chunks=[whole[:9], whole[9:]], content_type=b"text/event-stream")
    proxy = proxy_factory(url)
    r = httpx.post(
        proxy.base_url + "/responses",
        json={"model": "gpt-4o", "input": "hi"},
        headers={"X-Session-Id": "labelled-r"},
    )
    assert r.content == whole
    proxy.settle()
    [response] = [
        e for e in read_events(proxy.log_dir / "labelled-r.jsonl").events if e["type"] == "response"
    ]
    assert response["usage"]["prompt"] == 10 and response["error"] is None, response


def test_a_large_responses_answer_labelled_as_an_event_stream_is_read_whole(
    scripted: Any, proxy_factory: Any
) -> None:
    """Past 1 MiB (the part of a cut stream kept for its text), a Responses API body so
    labelled was logged with no usage, no cost and no error."""
    from proxy.eventlog import read_events

    text = "word " * 400_000  # ~2 MB
    whole = orjson.dumps(
        {
            "id": "resp_big",
            "object": "response",
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text}],
                }
            ],
            "usage": {"input_tokens": 1000, "output_tokens": 400_000, "total_tokens": 401_000},
        }
    )
    pieces = [whole[i : i + 65536] for i in range(0, len(whole), 65536)]
    _upstream, url = scripted(chunks=pieces, content_type=b"text/event-stream")
    proxy = proxy_factory(url)
    r = httpx.post(
        proxy.base_url + "/responses",
        json={"model": "gpt-4o", "input": "hi"},
        headers={"X-Session-Id": "big-r"},
    )
    assert r.content == whole
    proxy.settle()
    [response] = [
        e for e in read_events(proxy.log_dir / "big-r.jsonl").events if e["type"] == "response"
    ]
    assert response["usage"]["prompt"] == 1000 and response["error"] is None


def test_a_newline_delimited_json_stream_is_said_to_be_one(
    scripted: Any, proxy_factory: Any
) -> None:
    """A chat stream sent as NDJSON (one chunk object a line, no ``data:``): not read by the
    SDKs, and logged as "a body that is not JSON", which sent the user after a syntax error."""
    from proxy.eventlog import read_events

    line = orjson.dumps(
        {
            "id": "c1",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}],
        }
    )
    _upstream, url = scripted(
        chunks=[line + b"\n", line + b"\n"], content_type=b"application/x-ndjson"
    )
    proxy = proxy_factory(url)
    httpx.post(
        proxy.base_url + "/chat/completions",
        json={**CHAT, "stream": True},
        headers={"X-Session-Id": "ndjson"},
    )
    proxy.settle()
    [response] = [
        e for e in read_events(proxy.log_dir / "ndjson.jsonl").events if e["type"] == "response"
    ]
    assert response["error"].startswith("upstream sent newline-delimited JSON, not an event stream")


@pytest.mark.parametrize(
    ("location", "prefix", "expected"),
    [
        (b"http://up:8000/v1/chat/completions", b"/v1", b"/v1/chat/completions"),
        (b"HTTP://UP:8000/v1/models?x=1", b"/s/agent-1/v1", b"/s/agent-1/v1/models?x=1"),
        (b"/v1/chat/completions", b"/s/a/v1", b"/s/a/v1/chat/completions"),  # a path on its host
        (b"https://elsewhere.example/v1/x", b"/v1", b"https://elsewhere.example/v1/x"),
        (b"http://up:8000/v10/x", b"/v1", b"http://up:8000/v10/x"),  # not under the base
        (b"//up:8000/v1/x", b"/v1", b"/v1/x"),  # scheme-relative, the same host
        (b"//other:8000/v1/x", b"/v1", b"//other:8000/v1/x"),  # scheme-relative, another
        # http to https: the upstream asks for TLS; pointed back at cachegate, which would ask
        # over http again, the client went round in circles (TooManyRedirects)
        (b"https://up:8000/v1/x", b"/v1", b"https://up:8000/v1/x"),
        (b"http://[bad/v1/x", b"/v1", b"http://[bad/v1/x"),  # no URL: relayed, not a 500
        (b"http://[zz]/v1", b"/v1", b"http://[zz]/v1"),
        (b"http://up:8000/V1/models", b"/v1", b"http://up:8000/V1/models"),  # paths by case
        (b"http://up:8000/v1/../admin", b"/v1", b"http://up:8000/v1/../admin"),  # out of it
        (b"http://up:8000/v1", b"/s/a/v1", b"/s/a/v1"),
        (b"http://up:8000/v1/x#part", b"/v1", b"/v1/x#part"),
        (b"relative/x", b"/v1", b"relative/x"),
        (b"ftp://up:8000/v1/x", b"/v1", b"ftp://up:8000/v1/x"),
        (b"http://up:9000/v1/x", b"/v1", b"http://up:9000/v1/x"),  # another port
        (b"http://up:8000x/v1/x", b"/v1", b"http://up:8000x/v1/x"),  # no port
        # a path outside the base, or out of it by ``..``: on the upstream's origin (as a path,
        # the client resolved it against cachegate, which put the base's path before it)
        (b"/login?next=/v1", b"/v1", b"http://up:8000/login?next=/v1"),
        (b"/v1/../admin", b"/v1", b"http://up:8000/v1/../admin"),
    ],
)
def test_an_upstream_redirect_into_its_base_url_points_at_cachegate(
    location: bytes, prefix: bytes, expected: bytes
) -> None:
    from proxy.relay import client_location

    assert client_location(location, "http://up:8000/v1/", prefix) == expected


def test_a_path_redirect_outside_the_base_names_the_upstreams_origin_without_its_user() -> None:
    """An upstream under a path (``/api/v1``) redirecting to ``/v1/echo``: the client, given
    the path, came back to cachegate, which sent it to ``/api/v1/echo``, another resource."""
    from proxy.relay import client_location

    base = "https://user:pw@[::1]:8443/api/v1"
    assert client_location(b"/v1/echo", base, b"/v1") == b"https://[::1]:8443/v1/echo"
    assert client_location(b"/api/v1/echo", base, b"/v1") == b"/v1/echo"  # (inside: as before)


@pytest.mark.parametrize(
    ("base", "location"),
    [
        # a base URL with credentials in it: the upstream's Location names the host alone
        ("http://user:pw@up:8000/v1", b"http://up:8000/v1/models"),
        # the default port, said or not, on either side
        ("https://up/v1", b"https://up:443/v1/models"),
        ("https://up:443/v1", b"https://UP/v1/models"),
        ("http://up/v1", b"//up:80/v1/models"),
    ],
)
def test_a_redirect_to_the_upstream_named_another_way_points_at_cachegate(
    base: str, location: bytes
) -> None:
    """Compared as written, these pointed the client at the provider directly."""
    from proxy.relay import client_location

    assert client_location(location, base, b"/v1") == b"/v1/models"


@pytest.mark.parametrize("prefix", ["/v1", "/s/slash-agent/v1"])
def test_a_trailing_slash_redirect_is_followed_through_cachegate(
    prefix: str, proxy_factory: Any
) -> None:
    """FastAPI-style upstreams (vLLM, LiteLLM, the simulator) redirect ``/chat/completions/`` to
    their own absolute URL: relayed as it was, the client (which follows redirects) went to the
    provider directly, past the log, the repair and the key."""
    with run_simulator(SimConfig()) as sim:
        proxy = proxy_factory(sim.api_base)
        with httpx.Client(follow_redirects=True, timeout=10) as client:
            response = client.post(
                proxy.url + prefix + "/chat/completions/",
                json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
            )
        assert [r.status_code for r in response.history] == [307]
        assert response.history[0].headers["location"] == prefix + "/chat/completions"
        assert response.status_code == 200 and response.url.port == proxy.server.port
        assert "x-cachegate-session" in response.headers  # the chat route's, not the provider's


def test_an_answer_httpx_decoded_already_is_not_decoded_again() -> None:
    """httpx's ``aread`` undoes the coding itself: a JSON answer read again as raw deflate came
    out as a byte of nothing (a paid summary thrown away), pretty-printed as OpenAI sends it."""
    import zlib

    from proxy.relay import decoded_answer

    plain = b'{\n  "id": "x"}'
    response = httpx.Response(
        200, headers={"content-encoding": "deflate"}, content=zlib.compress(plain)
    )
    assert response.read() == plain  # (httpx's own decoding)
    assert decoded_answer(response, plain) == plain


def test_an_x_gzip_answer_httpx_left_encoded_is_decoded() -> None:
    """httpx undoes gzip and deflate, not ``x-gzip``, which cachegate's decoding reads: such a
    summary was thrown away once httpx's answers were no longer decoded again."""
    import gzip

    from proxy.relay import decoded_answer

    plain = b'{"id": "x"}'
    response = httpx.Response(200, headers={"content-encoding": "x-gzip"}, content=b"")
    assert decoded_answer(response, gzip.compress(plain)) == plain


def test_cachegates_own_headers_win_over_an_upstreams(scripted: Any, proxy_factory: Any) -> None:
    """One cachegate in front of another: the client got two X-Cachegate-Session and two
    X-Cachegate-Repairs headers, with different values."""
    answer = (
        b'{"id":"c","object":"chat.completion","model":"gpt-4o","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}'
    )
    upstream, url = scripted(chunks=[answer], content_type=b"application/json")
    upstream.extra_headers = [
        (b"x-cachegate-session", b"inner-session"),
        (b"x-cachegate-repairs", b"3"),
        (b"x-request-id", b"req_1"),
    ]
    proxy = proxy_factory(url)
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]},
        headers={"X-Session-Id": "outer"},
    )
    assert r.status_code == 200
    assert r.headers.get_list("x-cachegate-session") == ["outer"]
    assert r.headers.get_list("x-cachegate-repairs") == ["0"]
    assert r.headers["x-request-id"] == "req_1"


def test_a_zstd_body_is_decoded_whatever_the_limit_and_bombs_stop_at_it() -> None:
    """The limit is what is decoded at most, not a buffer asked for first: with a limit larger
    than the machine's memory, a frame that does not say its size failed every request
    (MemoryError: a 500 on the chat route); a bomb of either kind is refused once past it."""
    import zstandard

    from proxy.errors import ProxyError
    from proxy.relay import decoded_request

    payload = orjson.dumps(CHAT)
    unsized = zstandard.ZstdCompressor(write_content_size=False)
    assert decoded_request("zstd", unsized.compress(payload), 1 << 50) == payload
    for compressor in (unsized, zstandard.ZstdCompressor()):
        bomb = compressor.compress(b"\0" * 5_000_000)
        with pytest.raises(ProxyError) as refused:
            decoded_request("zstd", bomb, 1_000_000)
        assert refused.value.status == 413
        assert decoded_request("zstd", bomb, 5_000_000) == b"\0" * 5_000_000


@pytest.mark.parametrize(
    "usage",
    [
        # an unsigned -1 of 32 bits: ~$10,700 of gpt-4o input, for good, in the cost counter
        b'{"prompt_tokens":4294967295,"completion_tokens":4294967295}',
        b'{"prompt_tokens":9007199254740992,"completion_tokens":3}',
        # the completion alone: the prompt is unknown, not a free 0 in the per-request averages
        b'{"prompt_tokens":null,"completion_tokens":10,"prompt_tokens_details":{"cached_tokens":0}}',
        b'{"completion_tokens":10}',
    ],
)
def test_a_usage_that_cannot_be_real_is_unknown_not_counted(
    usage: bytes, scripted: Any, proxy_factory: Any
) -> None:
    """An answer whose usage holds a count beyond any request, or no count of its prompt, is
    relayed as it came and counted as of unknown usage: no tokens, no cost, no 0-token prompt in
    the GenAI histogram; the next sound answer counts exactly (counters that large lose a later
    answer's units in their floats)."""
    answer = (
        b'{"id":"x","object":"chat.completion","model":"gpt-4o","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":'
    )
    upstream, url = scripted(chunks=[answer + usage + b"}"], content_type=b"application/json")
    proxy = proxy_factory(url)
    via = httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers={"X-Session-Id": "s"})
    assert via.status_code == 200 and via.content == answer + usage + b"}"
    proxy.settle()
    assert read_events(proxy.log_dir / "s.jsonl").events[-1]["usage"] is None
    model = {"model": "gpt-4o"}
    for kind in ("prompt", "completion"):
        assert proxy.metric("cachegate_tokens_total", {**model, "kind": kind}) == 0
    assert proxy.metric("cachegate_cost_usd_total", {**model, "kind": "actual"}) == 0
    inputs = {"gen_ai_token_type": "input", "gen_ai_request_model": "gpt-4o"}
    inputs["gen_ai_operation_name"] = "chat"
    assert proxy.metric("gen_ai_client_token_usage_count", inputs) == 0
    upstream.chunks = [answer + b'{"prompt_tokens":1200,"completion_tokens":3}}']
    httpx.post(proxy.base_url + "/chat/completions", json=CHAT, headers={"X-Session-Id": "s"})
    assert proxy.metric("cachegate_tokens_total", {**model, "kind": "prompt"}) == 1200
    assert proxy.metric("cachegate_tokens_total", {**model, "kind": "completion"}) == 3
    assert proxy.metric("gen_ai_client_token_usage_count", inputs) == 1
    assert proxy.metric("gen_ai_client_token_usage_sum", inputs) == 1200


@pytest.mark.parametrize(
    ("content_type", "sandboxed"),
    [
        (b"text/html; charset=utf-8", True),
        (b"image/svg+xml", True),
        (b"", True),  # (no type: a browser may sniff one)
        (b"application/json", False),
        (b"application/problem+json", False),
        (b"text/event-stream", False),
    ],
)
def test_an_upstream_page_is_sandboxed_on_cachegates_origin(
    scripted: Any, proxy_factory: Any, content_type: bytes, sandboxed: bool
) -> None:
    """A page an upstream serves on a relayed path (a file's content, an error page) is shown
    on cachegate's own origin, which the guard against web pages trusts: its scripts could call
    cachegate with the user's key. It goes with ``Content-Security-Policy: sandbox`` (no script,
    an opaque origin) and ``nosniff``; JSON and event streams, which a browser runs nothing of,
    go as they came."""
    page = b"<html><script>fetch('/v1/models')</script></html>"
    _upstream, url = scripted(chunks=[page], content_type=content_type)
    proxy = proxy_factory(url)
    answers = [
        httpx.get(proxy.base_url + "/files/file-abc/content"),
        httpx.post(proxy.base_url + "/chat/completions", json=CHAT),
    ]
    for answer in answers:
        assert answer.content == page
        assert answer.headers.get("content-security-policy") == ("sandbox" if sandboxed else None)
        assert answer.headers.get("x-content-type-options") == ("nosniff" if sandboxed else None)


def test_an_upstreams_own_nosniff_is_not_said_twice(scripted: Any, proxy_factory: Any) -> None:
    _upstream, url = scripted(
        chunks=[b"<p>hi</p>"],
        content_type=b"text/html",
        extra_headers=[(b"x-content-type-options", b"nosniff")],
    )
    proxy = proxy_factory(url)
    answer = httpx.get(proxy.base_url + "/files/file-abc/content")
    assert answer.headers.get_list("x-content-type-options") == ["nosniff"]
    assert answer.headers.get_list("content-security-policy") == ["sandbox"]


def test_a_long_refusal_of_a_stream_is_relayed_as_it_comes_not_held(
    scripted: Any, proxy_factory: Any
) -> None:
    """A 400 to a streamed chat request is read whole to judge a retry (a ``stream_options``
    refusal): one of 150 MB (a broken gateway's) was held whole, ~270 MB of memory, before any
    of it reached the client. Past ``REFUSAL_READ_MAX`` it goes as it comes, whole and
    verbatim."""
    import time

    from proxy.relay import REFUSAL_READ_MAX

    head = b'{"error":{"message":"' + b"x" * (REFUSAL_READ_MAX + 10)
    _upstream, url = scripted(
        chunks=[head, b'"}}'], status=400, content_type=b"application/json", delay_s=3.0
    )
    proxy = proxy_factory(url)
    started = time.monotonic()
    with httpx.stream(
        "POST", proxy.base_url + "/chat/completions", json={**CHAT, "stream": True}, timeout=30
    ) as answer:
        pieces = answer.iter_raw()
        first = next(pieces)
        waited = time.monotonic() - started
        rest = b"".join(pieces)
    assert answer.status_code == 400 and first + rest == head + b'"}}'
    assert waited < 2.5, waited  # (the last piece comes 3 s after the first)


@pytest.mark.parametrize(
    ("content_type", "more"),
    [
        (b"application/json", [(b"content-type", b"text/html")]),  # (two: a browser reads the last)
        (b"text/html,json", []),  # (a list: its last valid type, text/html)
    ],
)
def test_a_page_whose_content_type_only_looks_like_json_is_sandboxed(
    scripted: Any, proxy_factory: Any, content_type: bytes, more: list[tuple[bytes, bytes]]
) -> None:
    """The first ``Content-Type`` alone was read, and a value ending in ``json`` taken for
    JSON: a page with its type given twice, or as a list, went unsandboxed, where a browser
    reads the last valid type and runs it as HTML."""
    page = b"<script>fetch('/v1/models')</script>"
    _upstream, url = scripted(chunks=[page], content_type=content_type, extra_headers=more)
    answer = httpx.get(proxy_factory(url).base_url + "/files/file-abc/content")
    assert answer.content == page
    assert answer.headers.get("content-security-policy") == "sandbox"
    assert answer.headers.get("x-content-type-options") == "nosniff"
