"""End to end with the official openai SDK through cachegate to the simulator, over loopback."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.simulator import RunningSimulator, SimConfig, run_simulator
from proxy.simulator.reply import parse_script
from tests.e2e_support import wait_for

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    },
]


@pytest.fixture
def sim() -> Iterator[RunningSimulator]:
    with run_simulator(SimConfig(chunk_ms=1)) as running:
        yield running


def test_non_streaming_same_answer_as_direct(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    messages = [{"role": "user", "content": "Say hello to the proxy please"}]
    direct = sdk(sim.api_base).chat.completions.create(model="gpt-4o", messages=messages)
    raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
        model="gpt-4o", messages=messages
    )
    via = raw.parse()
    assert via.choices[0].message.content == direct.choices[0].message.content
    assert via.usage is not None and direct.usage is not None
    assert via.usage.prompt_tokens == direct.usage.prompt_tokens
    assert raw.headers["x-cachegate-session"]
    assert raw.headers["x-cachegate-repairs"] == "0"


def test_streaming_text(sim: RunningSimulator, sdk: Any, proxy_factory: Any) -> None:
    proxy = proxy_factory(sim.api_base)
    sim.sim.enqueue([parse_script("The quick brown fox jumps over the lazy dog, twice. ünïcødé ✓")])
    stream = sdk(proxy.base_url).chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "go"}], stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The quick brown fox jumps over the lazy dog, twice. ünïcødé ✓"
    # the client did not ask for usage: it sees no usage-only chunk, though cachegate recorded usage
    assert all(c.choices for c in chunks)
    assert sim.sim.requests[-1].body["stream_options"] == {"include_usage": True}
    assert proxy.metric("cachegate_tokens_total", {"model": "gpt-4o", "kind": "completion"}) > 0


@pytest.mark.parametrize("usage", [False, True])
def test_a_stream_with_logprobs_reaches_the_client_as_the_provider_sent_it(
    usage: bool, sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Chunks that carry each token's log probabilities (``logprobs: true``) are larger and
    put ``logprobs`` before ``finish_reason``: relayed, with the usage cachegate asked for
    taken out where the client did not ask, they are the bytes a direct connection gets; the
    log has the answer's text and usage."""
    from proxy.eventlog import read_events

    proxy = proxy_factory(sim.api_base)
    body = {
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "tell me about ünïcødé, briefly"}],
        "stream": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    got = {}
    for name, base in (("direct", sim.api_base), ("proxied", proxy.base_url)):
        sim.sim.reset()  # (the same ids, the same cache: the same bytes)
        answer = httpx.post(base + "/chat/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        got[name] = answer.content
    assert got["proxied"] == got["direct"]
    assert got["direct"].count(b'"top_logprobs":[{') > 3
    assert (b'"usage":{' in got["direct"]) is usage
    assert sim.sim.requests[-1].body["stream_options"] == {"include_usage": True}
    proxy.settle()
    (path,) = proxy.log_dir.glob("*.jsonl")
    (response,) = [e for e in read_events(path).events if e["type"] == "response"]
    assert response["message"]["content"] == "You said: tell me about ünïcødé, briefly"
    assert response["usage"]["completion"] > 0


@pytest.mark.parametrize("interleave", [False, True])
def test_streaming_parallel_tool_calls(interleave: bool, sdk: Any, proxy_factory: Any) -> None:
    """Each call whole in turn, as OpenAI sends them, or interleaved by index, as some compatible
    servers do: relayed as they came and recorded whole either way."""
    with run_simulator(SimConfig(chunk_ms=1, interleave_tool_calls=interleave)) as sim:
        proxy = proxy_factory(sim.api_base)
        sim.sim.enqueue(
            [
                parse_script(
                    {
                        "content": None,
                        "tool_calls": [
                            {"name": "read_file", "arguments": {"path": "src/app.py"}},
                            {"name": "run", "arguments": {"cmd": "pytest -q tests/test_app.py"}},
                        ],
                        "finish_reason": "tool_calls",
                    }
                )
            ]
        )
        stream = sdk(proxy.base_url).chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": "read and test"}],
            tools=TOOLS,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
        calls: dict[int, dict[str, str]] = {}
        finish = None
        usage_seen = False
        for c in stream:
            if c.usage is not None:
                usage_seen = True
            for choice in c.choices:
                finish = choice.finish_reason or finish
                for tc in choice.delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    if tc.id:
                        entry["id"] = tc.id
                    if tc.function and tc.function.name:
                        entry["name"] += tc.function.name
                    if tc.function and tc.function.arguments:
                        entry["arguments"] += tc.function.arguments
        assert finish == "tool_calls"
        assert usage_seen  # the client asked for usage: it gets it untouched
        assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
            ("read_file", '{"path":"src/app.py"}'),
            ("run", '{"cmd":"pytest -q tests/test_app.py"}'),
        ]
        proxy.settle()
        events = [
            e
            for p in proxy.log_dir.glob("*.jsonl")
            for e in __import__("proxy.eventlog", fromlist=["read_events"]).read_events(p).events
            if e["type"] == "response"
        ]
        message = events[-1]["message"]
        assert [tc["function"]["name"] for tc in message["tool_calls"]] == ["read_file", "run"]
        assert (
            message["tool_calls"][1]["function"]["arguments"]
            == '{"cmd":"pytest -q tests/test_app.py"}'
        )


def test_provider_errors_reach_the_sdk_unchanged(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    import openai

    with pytest.raises(openai.RateLimitError) as info:
        sdk(proxy.base_url).chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"X-Sim-Fault": "429"},
        )
    assert info.value.response.headers.get("retry-after")


def test_models_and_embeddings_relayed(sim: RunningSimulator, sdk: Any, proxy_factory: Any) -> None:
    proxy = proxy_factory(sim.api_base)
    c = sdk(proxy.base_url)
    assert [m.id for m in c.models.list()] == [m.id for m in sdk(sim.api_base).models.list()]
    emb = c.embeddings.create(model="text-embedding-3-small", input="hello")
    assert (
        emb.data[0].embedding
        == sdk(sim.api_base)
        .embeddings.create(model="text-embedding-3-small", input="hello")
        .data[0]
        .embedding
    )


def test_healthz_and_metrics(sim: RunningSimulator, sdk: Any, proxy_factory: Any) -> None:
    proxy = proxy_factory(sim.api_base)
    assert httpx.get(proxy.url + "/healthz").json()["status"] == "ok"
    sdk(proxy.base_url).chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "x"}]
    )
    text = httpx.get(proxy.url + "/metrics").text
    for name in (
        "cachegate_requests_total",
        "cachegate_request_duration_seconds",
        "cachegate_time_to_first_byte_seconds",
        "cachegate_tokens_total",
    ):
        assert name in text
    assert (
        proxy.metric(
            "cachegate_requests_total", {"route": "chat", "model": "gpt-4o", "status": "200"}
        )
        == 1
    )


def test_what_cachegate_answers_itself_carries_a_date_and_a_relayed_answer_the_upstreams(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """uvicorn's Date is off so that a relayed answer carries the upstream's alone; cachegate's
    own answers (its errors, /healthz, /metrics) then had none (RFC 9110 6.6.1)."""
    import email.utils
    import time

    proxy = proxy_factory(sim.api_base)
    own = [
        httpx.get(proxy.url + "/healthz"),
        httpx.get(proxy.url + "/metrics"),
        httpx.post(proxy.url + "/chat/completions", json={}),  # 404, no /v1
        httpx.post(proxy.url + "/healthz"),  # 405
        httpx.post(proxy.base_url + "/chat/completions", content=b"{bad"),  # 400 invalid_json
    ]
    assert [r.status_code for r in own] == [200, 200, 404, 405, 400]
    for r in own:
        assert len(r.headers.get_list("date")) == 1, r.request.url
        when = email.utils.parsedate_to_datetime(r.headers["date"]).timestamp()
        assert abs(when - time.time()) < 60
    relayed = httpx.get(proxy.base_url + "/models")
    assert relayed.status_code == 200
    direct = httpx.get(sim.api_base + "/models")
    assert len(relayed.headers.get_list("date")) == len(direct.headers.get_list("date"))


def test_a_base_url_without_v1_gets_an_openai_shaped_404_that_says_so(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    import openai

    proxy = proxy_factory(sim.api_base)
    with pytest.raises(openai.NotFoundError) as info:  # the SDK reads the error's message
        sdk(proxy.url).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x"}]
        )
    # the address to use, with the port this cachegate listens on
    assert f"OPENAI_BASE_URL={proxy.url}/v1." in info.value.message
    r = httpx.post(proxy.url + "/chat/completions", json={})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"
    wrong = httpx.post(proxy.url + "/healthz")
    assert wrong.status_code == 405
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    assert "GET" in wrong.headers["allow"]
    assert sim.sim.requests == []
    # counted, so that a misdirected agent shows on a dashboard (it showed nowhere)
    labels = {"route": "passthrough", "model": "other"}
    assert proxy.metric("cachegate_requests_total", {**labels, "status": "404"}) == 2
    assert proxy.metric("cachegate_requests_total", {**labels, "status": "405"}) == 1
    # so are refusals there before any route: a foreign page's, a WebSocket handshake
    page = httpx.post(proxy.url + "/chat/completions", headers={"Origin": "https://evil.example"})
    socket_ = httpx.get(proxy.url + "/realtime", headers={"Upgrade": "websocket", "Connection": "Upgrade"})  # fmt: skip
    assert (page.status_code, socket_.status_code) == (403, 426)
    assert proxy.metric("cachegate_requests_total", {**labels, "status": "403"}) == 1
    assert proxy.metric("cachegate_requests_total", {**labels, "status": "426"}) == 1
    # ``/s/x/v1`` is no route (its 404 names no session), and its refusal names none either
    for headers in ({}, {"Origin": "https://evil.example"}):
        r = httpx.get(proxy.url + "/s/x/v1", headers=headers)
        assert r.status_code in (403, 404) and "x-cachegate-session" not in r.headers


def test_the_bare_v1_path_is_a_counted_404_not_a_redirect(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """``POST /v1``: Starlette's slash redirect answered 307 to ``/v1/`` (uncounted, its address
    built from the Host header, and a client following it reached the upstream's ``/v1/``)."""
    proxy = proxy_factory(sim.api_base)
    for method in ("POST", "GET"):
        r = httpx.request(method, proxy.url + "/v1?x=1", follow_redirects=False)
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "not_found"
        assert "/v1 is the base URL" in r.json()["error"]["message"]
    assert sim.sim.requests == []
    labels = {"route": "passthrough", "model": "other", "status": "404"}
    assert proxy.metric("cachegate_requests_total", labels) == 2
    # cachegate's own routes keep their slash redirect (a scrape of /metrics/ still works)
    for path in ("/healthz/", "/metrics/"):
        r = httpx.get(proxy.url + path, follow_redirects=True)
        assert r.status_code == 200, path


def test_a_session_base_url_without_v1_gets_a_404_that_says_so(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """``/s/abc/chat/completions``: the id is valid, /v1 is missing; it was a 400 saying the
    id was invalid."""
    import openai

    proxy = proxy_factory(sim.api_base)
    with pytest.raises(openai.NotFoundError) as info:
        sdk(proxy.url + "/s/abc").chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "x"}]
        )
    assert "/s/abc/v1/chat/completions" in info.value.message
    r = httpx.get(proxy.url + "/s/abc/healthz")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
    # the session's base URL itself: told it is one (it was told to end in /v1, which it does)
    r = httpx.post(proxy.url + "/s/abc/v1")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
    assert r.json()["error"]["message"] == (
        "Nothing is served at POST /s/abc/v1. /s/abc/v1 is the session's base URL: requests go"
        " under it (/s/abc/v1/chat/completions)."
    )
    # an id that reads as a key is refused here as on the routes (it was told its base URL
    # was right, and every request under it was refused)
    for path in (
        "/s/sk-proj-AbCdEfGhIjKlMnOpQrStUvWx1234/v1",
        "/s/sk-proj-AbCdEfGhIjKlMnOpQrStUvWx1234",
    ):
        r = httpx.get(proxy.url + path)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_session_id")
        assert "reads as an API key" in r.json()["error"]["message"]
    bad = httpx.get(proxy.url + "/s/a%2Fb/healthz")  # an id that is none: still a 400
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_session_id")
    assert sim.sim.requests == []


def test_a_failure_on_cachegates_own_routes_is_an_openai_shaped_500(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)

    class Broken:
        def collect(self) -> Any:
            raise RuntimeError("collector bug")

    proxy.registry.register(Broken())
    r = httpx.get(proxy.url + "/metrics")
    assert r.status_code == 500
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["code"] == "internal_error" and "RuntimeError" in error["message"]


def test_requests_refused_for_their_session_id_are_counted(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}
    refused = [
        httpx.post(proxy.url + "/s/bad%20id/v1/chat/completions", json=body),  # in the path
        httpx.post(proxy.url + "/s/a%2Fb/v1/chat/completions", json=body),  # a slash smuggled in
        httpx.post(
            proxy.base_url + "/chat/completions", json=body, headers={"X-Session-Id": "a b"}
        ),
        httpx.get(proxy.url + "/s/bad%20id/v1/models"),
        httpx.get(proxy.base_url + "/models", headers={"X-Session-Id": "a b"}),
        httpx.get(proxy.base_url + "/%2E%2E/admin"),  # invalid_path
    ]
    assert [r.status_code for r in refused] == [400] * 6
    proxy.settle()
    labels = {"route": "chat", "model": "other", "status": "400"}
    assert proxy.metric("cachegate_requests_total", labels) == 2  # refused before the body is read
    labels["model"] = "gpt-4o"
    assert proxy.metric("cachegate_requests_total", labels) == 1  # the header's: after it
    labels = {"route": "passthrough", "model": "other", "status": "400"}
    assert proxy.metric("cachegate_requests_total", labels) == 3
    assert sim.sim.requests == []


def test_a_failing_observer_never_breaks_the_response(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)

    class Broken:
        def on_request(self, ex: Any) -> None:
            raise RuntimeError("observer bug")

        def on_response(self, ex: Any) -> None:
            raise RuntimeError("observer bug")

    proxy.gateway.observers.insert(0, Broken())
    out = sdk(proxy.base_url).chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "still works"}]
    )
    assert out.choices[0].message.content


def test_retention_runs_at_start_and_spares_recent_logs(
    sim: RunningSimulator, tmp_path: Any
) -> None:
    import os
    import time as clock

    from tests.conftest import run_proxy

    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    old, recent = log_dir / "old-session.jsonl", log_dir / "recent-session.jsonl"
    old.write_text('{"ts":1,"type":"session_meta"}\n')
    recent.write_text('{"ts":2,"type":"session_meta"}\n')
    ten_days_ago = clock.time() - 10 * 86400
    os.utime(old, (ten_days_ago, ten_days_ago))
    with run_proxy(sim.api_base, log_dir, {"logging": {"max_age_days": 1}}):
        deadline = clock.monotonic() + 5
        while old.exists() and clock.monotonic() < deadline:
            clock.sleep(0.02)
        assert not old.exists()
        assert recent.exists()


def test_a_scrape_forgets_idle_sessions_so_the_gauges_fall_when_agents_stop(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    now = [1_800_000_000.0]
    proxy = proxy_factory(sim.api_base, {"sessions": {"idle_ttl_s": 60}}, clock=lambda: now[0])
    c = sdk(proxy.base_url)
    c.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "hi " * 20_000}],  # kept for the next turn too
        extra_headers={"X-Session-Id": "quiet-agent"},
    )
    memos = proxy.gateway.chat.memos

    def scrape() -> tuple[float, float, float]:
        assert httpx.get(proxy.url + "/metrics").status_code == 200
        return (
            proxy.metric("cachegate_sessions"),
            proxy.metric("cachegate_sessions_memory_bytes"),
            proxy.metric("cachegate_session_evictions_total", {"reason": "idle"}),
        )

    held, held_bytes, forgotten = scrape()
    assert held == 1 and held_bytes > 0 and forgotten == 0 and memos.bytes > 60_000
    now[0] += 61  # no request since: only the scrape can notice
    assert scrape() == (0, 0, 1)
    assert memos.bytes == 0  # the body kept for the session's next turn went with it


@pytest.mark.parametrize("named", [True, False], ids=["x-session-id", "inferred"])
def test_a_session_back_after_its_idle_time_is_weighed_whole_on_its_first_turn(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, named: bool
) -> None:
    """An agent back after ``sessions.idle_ttl_s`` with no scrape between (no Prometheus on
    a laptop): its body was spliced onto the one kept for the idle session, then read as held
    by another session, and its first turn weighed ~6 KB for a 400 KB history, the memory
    budget blind to it until its next turn."""
    now = [1_800_000_000.0]
    proxy = proxy_factory(sim.api_base, {"sessions": {"idle_ttl_s": 60}}, clock=lambda: now[0])
    client = sdk(proxy.base_url)
    headers = {"X-Session-Id": "back-later"} if named else {}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "repro " + "q" * 200_000},
    ]
    weighed = []
    for pause in (0, 0, 61, 0):
        now[0] += pause
        answer = client.chat.completions.create(
            model="gpt-4o", messages=messages, extra_headers=headers
        )
        assert httpx.get(proxy.url + "/metrics").status_code == 200
        weighed.append(proxy.metric("cachegate_sessions_memory_bytes"))
        messages += [
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": "more"},
        ]
    assert proxy.metric("cachegate_session_evictions_total", {"reason": "idle"}) == 1
    # the third turn, the first of the session that came back, as the one before it
    assert weighed[2] >= 0.9 * weighed[1] and weighed[3] >= 0.9 * weighed[1]


def test_a_session_whose_answers_take_long_keeps_its_bodies_between_turns(
    proxy_factory: Any,
) -> None:
    """Each answer takes 50 s, the agent comes back 15 s after it ends, the TTL is 60 s: the
    session is never idle that long, but its kept body aged from its request's start (65 s
    by the next turn) and was forgotten before every parse, each turn parsed whole (~2 ms
    more at 300 KB) and weighed afresh. Kept bodies age from their request's end, as the
    session does."""
    import asyncio

    from proxy.serving import ServerThread
    from tests.conftest import ScriptedUpstream

    now = [1_800_000_000.0]
    answer = (
        b'{"id":"c","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index"'
        b':0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":'
        b'{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}'
    )

    class SlowProvider(ScriptedUpstream):
        async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                now[0] += 50  # (the answer takes 50 s of the clock)
                await asyncio.sleep(0)
            await super().__call__(scope, receive, send)

    provider = SlowProvider(chunks=[answer], content_type=b"application/json")
    with ServerThread(provider) as server:
        proxy = proxy_factory(
            server.url + "/v1", {"sessions": {"idle_ttl_s": 60}}, clock=lambda: now[0]
        )
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "repro " + "q" * 200_000},
        ]
        chat = proxy.gateway.chat
        for turn in range(4):
            now[0] += 15  # (the agent's pause)
            reply = httpx.post(
                proxy.base_url + "/chat/completions",
                json={"model": "gpt-4o", "messages": messages},
                headers={"X-Session-Id": "slow-answers"},
            )
            assert reply.status_code == 200
            assert chat.spliced_parses == turn  # (each turn after the first spliced)
            messages += [
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": f"more {turn}"},
            ]
    assert proxy.metric("cachegate_session_evictions_total", {"reason": "idle"}) == 0


def test_a_history_of_many_short_messages_is_weighed_by_its_messages(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """~40-byte messages hold ~750 bytes each (their objects, not their bytes): counted at 4
    bytes per body byte, 100,000 of them read as 16 MB against sessions.max_memory_mb while
    they held ~75 MB."""
    from proxy.sessions import BYTES_HELD_PER_MESSAGE

    proxy = proxy_factory(sim.api_base)
    history = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"short {i}"}
        for i in range(2001)
    ]
    sdk(proxy.base_url).chat.completions.create(
        model="gpt-4o", messages=history, extra_headers={"X-Session-Id": "chatty"}
    )
    assert httpx.get(proxy.url + "/metrics").status_code == 200
    assert proxy.metric("cachegate_sessions_memory_bytes") >= 2001 * BYTES_HELD_PER_MESSAGE


def test_a_history_of_many_content_parts_is_weighed_by_its_parts(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """Messages of ten short text parts each: every part is a dict of its own (parsed,
    fingerprinted, copied), ~360 bytes more a part by tracemalloc; counted by message alone,
    a 20 MiB budget held ~63 MiB of such sessions. Turn after turn, what the history carries
    on is counted as it was, the appended messages' parts counted anew, whatever other
    requests of the session came between (a title request's none were carried onto it)."""
    from proxy.sessions import BYTES_HELD_PER_MESSAGE, BYTES_HELD_PER_PART, SIZES_KEPT

    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)

    def message(i: int) -> dict[str, Any]:
        parts = [{"type": "text", "text": f"p{i}.{k}"} for k in range(10)]
        return {"role": "user" if i % 2 == 0 else "assistant", "content": parts}

    history = [message(i) for i in range(501)]
    for turn in range(SIZES_KEPT + 2):  # (past the requests the estimate looks back on)
        client.chat.completions.create(
            model="gpt-4o", messages=history, extra_headers={"X-Session-Id": "parts"}
        )
        # a title request between the turns (another history: its parts are its own)
        client.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": f"A title for this, please ({turn})."}],
            extra_headers={"X-Session-Id": "parts"},
        )
        assert httpx.get(proxy.url + "/metrics").status_code == 200
        held = proxy.metric("cachegate_sessions_memory_bytes")
        parts = sum(len(m["content"]) - 1 for m in history if isinstance(m["content"], list))
        floor = len(history) * BYTES_HELD_PER_MESSAGE + parts * BYTES_HELD_PER_PART
        assert held >= floor, (turn, held, floor)
        history += [{"role": "assistant", "content": "ok"}, message(len(history) + 1)]


@pytest.mark.parametrize("spliced", [True, False], ids=["memo-spliced", "parsed-whole"])
def test_histories_that_do_not_continue_one_another_each_count_toward_the_memory_budget(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, spliced: bool
) -> None:
    """A history rewritten each turn (every message re-rendered): each turn's history shares
    no message objects with the last, and the log's bases and the accounting's baselines hold
    each one whole. Weighed by the largest alone, 4 sessions of 4.7 MB (a system prompt with
    the time in it, before what follows it was shared) held 285 MB of RSS under
    sessions.max_memory_mb = 100 and none was forgotten. An agent that appends (its history
    shared, or spliced onto the last body) weighs its largest."""
    from proxy.sessions import (
        BYTES_HELD_PER_BODY_BYTE,
        BYTES_HELD_PER_OWN_BYTE,
        SESSION_BASE_BYTES,
    )

    proxy = proxy_factory(sim.api_base)
    c = sdk(proxy.base_url)
    rounds = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"step {i} " + "x" * 2000}
        for i in range(40)
    ]

    def weight(sid: str) -> int:
        return proxy.gateway.chat.sessions.get(sid).weight  # type: ignore[no-any-return]

    sizes = []
    for turn in range(3):
        rendered = [{**m, "content": f"(turn {turn}) {m['content']}"} for m in rounds]
        messages = [{"role": "system", "content": "You are an agent."}, *rendered]
        raw = c.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=messages, extra_headers={"X-Session-Id": "rewritten"}
        )
        assert raw.http_response.status_code == 200
        sizes.append(len(orjson.dumps({"model": "gpt-4o", "messages": messages})))
    whole = BYTES_HELD_PER_BODY_BYTE * max(sizes)
    # the largest whole, and each other turn's history for its own (a byte or two apart)
    assert weight("rewritten") >= whole + 2 * BYTES_HELD_PER_OWN_BYTE * min(sizes) * 0.99
    appended: list[dict[str, Any]] = []
    for turn in range(3):
        appended = [{"role": "system", "content": "You are an agent."}, *rounds[: 34 + 2 * turn]]
        # (a field after the messages that changes each turn: the body is parsed whole, and
        # only the shared prefix of its history makes it light)
        extra = {} if spliced else {"user": f"turn-{turn}"}
        c.chat.completions.create(
            model="gpt-4o", messages=appended, extra_headers={"X-Session-Id": "appending"}, **extra
        )
    assert proxy.gateway.chat.spliced_parses == (2 if spliced else 0)
    largest = len(orjson.dumps({"model": "gpt-4o", "messages": appended}))
    assert weight("appending") < 1.1 * BYTES_HELD_PER_BODY_BYTE * largest + SESSION_BASE_BYTES


def test_a_websocket_handshake_is_refused_plainly_not_relayed_as_a_get(
    sim: RunningSimulator, proxy_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The Realtime API's client builds ws://<base URL>/realtime: cachegate does not relay
    WebSockets, and says so, where the upstream got a plain GET and the client a failed
    handshake (and the terminal advice to install a WebSocket library)."""
    import socket

    proxy = proxy_factory(sim.api_base)
    seen = len(sim.sim.requests)
    with (
        caplog.at_level(logging.WARNING),
        socket.create_connection((proxy.server.host, proxy.server.port)) as conn,
    ):
        conn.sendall(
            b"GET /v1/realtime?model=gpt-realtime HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"upgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-version: 13\r\n"
            b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        answer = b""
        while b"}}" not in answer:
            piece = conn.recv(65536)
            if not piece:
                break
            answer += piece
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 426 ")
    assert json.loads(body)["error"]["code"] == "websocket_not_supported"
    assert len(sim.sim.requests) == seen  # nothing went upstream
    assert not [r for r in caplog.records if "WebSocket library" in r.getMessage()]
    assert b"x-cachegate-session" not in head.lower()
    # under an explicit session, the refusal says the session, as its other answers do
    r = httpx.get(
        f"{proxy.url}/s/agent-7/v1/realtime",
        headers={"upgrade": "websocket", "connection": "Upgrade"},
    )
    assert r.status_code == 426
    assert r.headers["x-cachegate-session"] == "agent-7"


def test_the_first_refusal_of_each_status_cachegate_answers_itself_shows_in_a_rate(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Prometheus cannot see a series' first value as an increase: a series created by the
    first 415 (a chat body in a coding cachegate cannot read) or 426 (a WebSocket upgrade)
    read 1 but moved no ``rate()`` or ``increase()``, so the error panels missed it. Every
    status cachegate answers itself exists at zero before its first answer."""
    proxy = proxy_factory(sim.api_base)
    chat_415 = {"route": "chat", "model": "other", "status": "415"}
    relayed_426 = {"route": "passthrough", "model": "other", "status": "426"}
    for labels in (chat_415, relayed_426):  # (a series, at zero: not merely none)
        assert proxy.registry.get_sample_value("cachegate_requests_total", labels) == 0
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        content=b"\x0b\x02\x80{}\x03",
        headers={"content-type": "application/json", "content-encoding": "br"},
    )
    assert r.status_code == 415
    r = httpx.get(
        proxy.base_url + "/realtime", headers={"upgrade": "websocket", "connection": "Upgrade"}
    )
    assert r.status_code == 426
    assert proxy.metric("cachegate_requests_total", chat_415) == 1
    assert proxy.metric("cachegate_requests_total", relayed_426) == 1


def test_a_role_or_part_type_that_is_no_string_gets_the_providers_answer_not_a_500(
    sim: RunningSimulator, proxy_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``"role": ["system"]`` once in a session: the next request of that session was compared
    with it, hashed the list (TypeError), and every later request got cachegate's 500 "failed
    to process this request" where the provider would answer (a 400 for the bad role, a 200
    for a text part whose type is a list); the first one's accounting failed too."""
    proxy = proxy_factory(sim.api_base)
    url, headers = proxy.base_url + "/chat/completions", {"X-Session-Id": "odd-roles"}
    bodies = [
        [{"role": ["system"], "content": "x"}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": [{"type": ["text"], "text": "hi"}]}],
        [{"role": {"a": 1}, "content": "hi"}],
        [{"role": "user", "content": "hello"}],
    ]
    with caplog.at_level(logging.ERROR):
        answers = [
            httpx.post(url, json={"model": "gpt-4o", "messages": m}, headers=headers)
            for m in bodies
        ]
        proxy.settle()
    assert [a.status_code for a in answers] == [400, 200, 400, 200]
    assert "Invalid value" in answers[0].json()["error"]["message"]  # the provider's words
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def _post_chunked_with_late_trailers(url: str, path: str, body: bytes, trailers: bytes) -> bytes:
    """A chunked request whose trailer fields arrive 0.3 s after its body; the raw answer."""
    import socket
    import time
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (path.encode(), len(body), body)
        )
        time.sleep(0.3)
        sock.sendall(b"0\r\n" + trailers + b"\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        return answer


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings"])
def test_a_chunked_request_s_trailer_fields_are_not_forwarded_as_headers(
    sim: RunningSimulator, proxy_factory: Any, path: str
) -> None:
    """uvicorn appends trailer fields to the request's header list as they arrive: a late
    ``X-Session-Id`` or ``Authorization`` reached the upstream as a header (RFC 9110, 6.5.1
    forbids it) while the request was accounted under another session."""
    proxy = proxy_factory(sim.api_base)
    body = json.dumps(
        {"model": "gpt-4o", "input": "x", "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    trailers = b"X-Session-Id: late-trailer\r\nAuthorization: Bearer trailerQZX9\r\n"
    answer = _post_chunked_with_late_trailers(proxy.url, path, body, trailers)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert b"late-trailer" not in answer
    received = httpx.get(sim.url + "/_sim/requests").json()["requests"][-1]["headers"]
    assert "x-session-id" not in received
    assert "QZX9" not in received.get("authorization", "")


def test_a_session_id_given_twice_with_two_values_is_refused_not_guessed(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """cachegate took the last value, while a framework upstream (Starlette, the simulator)
    reads the first: the two disagreed on whose session the request was. Repeated fields are
    combined as HTTP combines them; the same value twice is that value."""
    proxy = proxy_factory(sim.api_base)
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json=body,
        headers=[("X-Session-Id", "first"), ("X-Session-Id", "second")],
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id"
    assert sim.sim.requests == []
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json=body,
        headers=[("X-Session-Id", "same"), ("X-Session-Id", "same")],
    )
    assert r.status_code == 200 and r.headers["x-cachegate-session"] == "same"


_CHUNKED = (
    b" HTTP/1.1\r\nhost: 127.0.0.1\r\ntransfer-encoding: chunked\r\nx-session-id: cut\r\n\r\n"
)


@pytest.mark.parametrize(
    ("request_head", "route"),
    [
        (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n", "chat"),
        (b"GET /v1/models HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n", "passthrough"),
        # pipelined behind a whole request: a request of its own, the first counted too
        (
            b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
            b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\nbad header\r\n\r\n",
            "passthrough",
        ),
        # refused in its body (a bad chunk, first or after one): the app began it, and counts
        # it once, with the 400 (it was a 499, and a client disconnect), on every route
        (b"POST /v1/chat/completions" + _CHUNKED + b"ZZZ\r\nabc\r\n", "chat"),
        (b"POST /v1/chat/completions" + _CHUNKED + b'5\r\n{"a":\r\nzz\r\n', "chat"),
        (b"POST /v1/responses" + _CHUNKED + b'5\r\n{"a":\r\nzz\r\n', "responses"),
        (b"POST /v1/embeddings" + _CHUNKED + b"ZZZ\r\nabc\r\n", "passthrough"),
        (b"POST /v1/embeddings" + _CHUNKED + b'5\r\n{"a":\r\nzz\r\n', "passthrough"),
        # a transfer coding cachegate does not read (a 501), with an upgrade offer (h2c) too
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: Upgrade\r\n"
            b"upgrade: h2c\r\ntransfer-encoding: gzip\r\n\r\n",
            "chat",
        ),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"transfer-encoding: gzip, chunked\r\n\r\n",
            "chat",
        ),
        # a CONNECT (cachegate set as a client's HTTPS_PROXY): a 405
        (
            b"CONNECT api.openai.com:443 HTTP/1.1\r\nhost: api.openai.com:443\r\n\r\n",
            "passthrough",
        ),
    ],
)
def test_a_request_the_parser_refuses_is_counted_in_the_metrics(
    request_head: bytes, route: str, proxy_factory: Any
) -> None:
    """uvicorn's parser answers these itself (400 ``invalid_http``), before the app: no
    dashboard or error ratio showed a client that sent malformed requests. Each is counted
    once, as the 400 it was answered with, and none as a client that left."""
    import socket

    proxy = proxy_factory("http://127.0.0.1:9/v1")
    before_total = 0.0  # (a new proxy: nothing counted yet)
    with socket.create_connection(("127.0.0.1", proxy.server.port)) as s:
        s.settimeout(10)
        s.sendall(request_head)
        answer = b""
        while chunk := s.recv(65536):  # (closed after it)
            answer += chunk
    status = b"501" if b"transfer-encoding: gzip" in request_head else b"400"
    status = b"405" if request_head.startswith(b"CONNECT") else status
    assert answer.startswith(b"HTTP/1.1 %s " % status)
    assert {b"400": b"invalid_http", b"405": b"method_not_allowed"}.get(
        status, b"unsupported_transfer_coding"
    ) in answer
    counted = {"route": route, "model": "other"}

    def total(status: str | None = None) -> float:  # (every status: a request before it may
        proxy.settle()  # be a 502)
        return sum(
            sample.value
            for family in proxy.registry.collect()
            for sample in family.samples
            if sample.name == "cachegate_requests_total"
            and {k: sample.labels[k] for k in counted} == counted
            and sample.labels["status"] == (status or sample.labels["status"])
        )

    requests = request_head.count(b"HTTP/1.1\r\n")
    # (a request the app was answering counts it once its task sees it)
    wait_for(lambda: total() >= before_total + requests, timeout=5)
    time.sleep(0.2)  # (and no second count of one refused body comes after it)
    assert total() == before_total + requests  # (each once: a refused body was a 400 and a 499)
    assert total(status.decode()) == 1  # (the refused one: it was counted a 499)
    assert proxy.metric("cachegate_client_disconnects_total") == 0


def test_a_pipelined_request_refused_in_its_body_is_counted_by_the_server(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Behind a whole request, one whose body the parser refuses never reaches the app: the
    server counts its 400 (it was counted nowhere)."""
    import socket

    proxy = proxy_factory(sim.api_base)
    body = b'{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}'
    whole = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
        b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    )
    refused = b"POST /v1/chat/completions" + _CHUNKED + b"10\r\n" + b"x" * 16 + b"\r\nZZ\r\n"
    with socket.create_connection(("127.0.0.1", proxy.server.port)) as s:
        s.settimeout(10)
        s.sendall(whole + refused)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert b"invalid_http" in answer
    wait_for(
        lambda: (
            proxy.metric(
                "cachegate_requests_total", {"route": "chat", "model": "other", "status": "400"}
            )
            == 1
        ),
        timeout=5,
    )


def test_a_request_answered_before_its_refused_body_is_counted_once(proxy_factory: Any) -> None:
    """cachegate answers an unknown path (404) without reading its body; the rest of the body,
    refused by the parser, was counted again as a 400 of its own: one request, two counts."""
    import socket

    proxy = proxy_factory("http://127.0.0.1:9/v1")
    with socket.create_connection(("127.0.0.1", proxy.server.port)) as s:
        s.settimeout(10)
        s.sendall(
            b"POST /nosuch HTTP/1.1\r\nhost: 127.0.0.1\r\ntransfer-encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n"
        )
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 404 ")
        s.sendall(b"zz\r\nxx\r\n")
        while chunk := s.recv(65536):
            answer += chunk

    def counted() -> list[str]:
        proxy.settle()
        return [
            sample.labels["status"]
            for family in proxy.registry.collect()
            for sample in family.samples
            if sample.name == "cachegate_requests_total" and sample.value
        ]

    wait_for(lambda: counted() == ["404"], timeout=5)
    time.sleep(0.2)
    assert counted() == ["404"]


def test_retention_deletes_the_log_of_a_session_idle_past_its_ttl_on_a_quiet_server(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session idle past ``sessions.idle_ttl_s`` was still held until a request or a scrape
    came (a laptop with no Prometheus): retention took it for live and kept its old file for
    good. It is forgotten first, as a scrape would."""
    import asyncio
    import os
    import time as clock

    from proxy import eventlog

    monkeypatch.setattr(eventlog, "IDLE_CLOSE_S", 0.05)  # (the writer closes idle files soon)
    now = [clock.time()]
    proxy = proxy_factory(
        sim.api_base,
        {"sessions": {"idle_ttl_s": 60}, "logging": {"max_age_days": 1}},
        clock=lambda: now[0],
    )
    sdk(proxy.base_url).chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-Session-Id": "quiet"},
    )
    proxy.settle()
    path = proxy.log_dir / "quiet.jsonl"
    writer = proxy.gateway.writer
    deadline = clock.monotonic() + 5
    while writer.holds_open("quiet") and clock.monotonic() < deadline:
        writer.flush()
        clock.sleep(0.02)
    assert not writer.holds_open("quiet")
    ten_days_ago = clock.time() - 10 * 86400
    os.utime(path, (ten_days_ago, ten_days_ago))
    now[0] += 61  # idle past its TTL; no request, no scrape since
    retain = proxy.gateway.retain_once()
    asyncio.run_coroutine_threadsafe(retain, proxy.gateway.loop).result(timeout=10)
    assert not path.exists()
