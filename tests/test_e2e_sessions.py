"""Sessions and the audit log end to end: the openai SDK → cachegate → the simulator, over sockets.

Identity (header, path, inference, agent headers, hostile ids), the log as a user reads it back
(linear growth, exact replay, interruptions), crash safety under kill -9, secrets, metadata mode.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import secrets
import signal
import socket
import string
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy.eventlog import read_events
from proxy.prefix import deep_dumps
from proxy.report import replay_lines
from proxy.serving import ServerThread
from proxy.simulator import RunningSimulator, SimConfig, run_simulator
from proxy.simulator.reply import parse_script
from tests.conftest import run_proxy
from tests.e2e_support import (
    cachegate_process,
    chat,
    events,
    make_client,
    post_chat,
    run_cli,
    tree,
    wait_for,
)

HELLO = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture
def sim() -> Iterator[RunningSimulator]:
    with run_simulator(SimConfig()) as running:
        yield running


def flush(proxy: Any) -> None:
    proxy.settle()  # observers run after the client has its answer; wait for them, then the disk


# --- identity --------------------------------------------------------------------------------


def test_x_session_id_header_names_the_session_and_its_file(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "build-42"})
    _, h1 = chat(client, [{"role": "user", "content": "one"}], stream=False)
    _, h2 = chat(client, [{"role": "user", "content": "something unrelated"}], stream=True)
    assert h1["x-cachegate-session"] == h2["x-cachegate-session"] == "build-42"
    flush(proxy)
    assert sorted(p.name for p in proxy.log_dir.iterdir()) == [".gitignore", "build-42.jsonl"]
    kinds = [e["type"] for e in events(proxy.log_dir, "build-42")]
    assert kinds == ["session_meta", "request", "response", "request", "response"]


def test_an_sdk_retry_is_logged_as_the_clients_retry_and_shown_so(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """The SDK retries a 429 on its own: two exchanges for one call of the agent's, which read
    as two turns (EXCH counted attempts, nothing linked them). The retry's request line says
    which try it is (the SDK's x-stainless-retry-count), and `sessions show` notes it."""
    proxy = proxy_factory(sim.api_base)
    sim.sim.enqueue([parse_script({"content": "unused", "fault": "429"}), parse_script("ok")])
    client = sdk(proxy.base_url, max_retries=1, default_headers={"X-Session-Id": "retried"})
    answer = client.chat.completions.create(model="gpt-4o", messages=HELLO["messages"])
    assert answer.choices[0].message.content == "ok"
    flush(proxy)
    requests = events(proxy.log_dir, "retried", "request")
    assert [r.get("client_retry") for r in requests] == [None, 1]
    shown = run_cli("sessions", "show", "retried", "--log-dir", str(proxy.log_dir))
    assert shown.code == 0
    rows = [line for line in shown.out.splitlines() if "client retry 1" in line]
    assert len(rows) == 1 and rows[0].split()[0] == "2"
    listed = run_cli("sessions", "show", "retried", "--json", "--log-dir", str(proxy.log_dir))
    assert [row["client_retry"] for row in orjson.loads(listed.out)["exchanges"]] == [0, 1]


def test_a_session_resumed_by_a_later_process_keeps_one_meta_line(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """cachegate restarted (or a second instance on the same log directory): the session the
    agent names again gets its new exchanges appended, not a second session_meta line."""
    for _ in range(2):
        proxy = proxy_factory(sim.api_base)
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "build-43"})
        chat(client, [{"role": "user", "content": "one"}], stream=False)
        flush(proxy)
    kinds = [e["type"] for e in events(proxy.log_dir, "build-43")]
    assert kinds == ["session_meta", "request", "response", "request", "response"]


def test_session_in_the_path_for_clients_that_only_set_a_base_url(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    client = make_client(proxy.url + "/s/my-id/v1")
    messages = [{"role": "user", "content": "hi"}]
    reply, headers = chat(client, messages, stream=True)
    assert headers["x-cachegate-session"] == "my-id"
    assert reply["content"] == "You said: hi"
    models = client.models.with_raw_response.list()
    assert models.headers["x-cachegate-session"] == "my-id"  # other routes carry it too
    assert [m.id for m in models.parse().data] == [
        "gpt-4o",
        "gpt-4o-mini",
        "text-embedding-3-small",
    ]
    flush(proxy)
    assert sorted(p.name for p in proxy.log_dir.iterdir()) == [".gitignore", "my-id.jsonl"]
    # The path prefix is cachegate's: the provider sees the plain /v1 route.
    assert [r.path for r in sim.sim.requests] == ["/v1/chat/completions", "/v1/models"]


def test_growing_conversation_stays_one_session_unrelated_one_gets_its_own(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    client = make_client(proxy.base_url)
    system = {"role": "system", "content": "You are terse."}
    convo: list[dict[str, Any]] = [system, {"role": "user", "content": "first question"}]
    seen = []
    for turn in range(6):
        reply, headers = chat(client, convo, stream=turn % 2 == 1)
        seen.append(headers["x-cachegate-session"])
        convo += [reply, {"role": "user", "content": f"follow-up {turn}"}]
    other = [system, {"role": "user", "content": "a different task entirely"}]
    _, other_headers = chat(client, other, stream=False)
    reply, again = chat(client, convo, stream=False)  # the first conversation carries on
    assert len(set(seen)) == 1
    assert other_headers["x-cachegate-session"] not in seen
    assert again["x-cachegate-session"] == seen[0]
    flush(proxy)
    files = sorted(p.name for p in proxy.log_dir.iterdir())
    sessions = [seen[0] + ".jsonl", other_headers["x-cachegate-session"] + ".jsonl"]
    assert files == [".gitignore", *sorted(sessions)]
    assert len(events(proxy.log_dir, seen[0], "request")) == 7
    assert len(events(proxy.log_dir, other_headers["x-cachegate-session"], "request")) == 1


def test_conversations_sent_under_other_keys_are_other_sessions(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """Two users of one cachegate (each client sends its own key) running the same agent on the
    same task were one session: one log of both users' prompts and answers, and the second
    user's cold start read as the first's cache wasted."""
    proxy = proxy_factory(sim.api_base)
    keys = ("sk-proj-AAAAbbbbCCCCdddd1111222233334444", "sk-proj-ZZZZyyyyXXXXwwww9999888877776666")
    alice, bob = (sdk(proxy.base_url, api_key=key) for key in keys)
    system = {"role": "system", "content": "You are terse."}
    convos: dict[Any, list[dict[str, Any]]] = {
        c: [system, {"role": "user", "content": "fix the failing test"}] for c in (alice, bob)
    }
    seen: dict[Any, list[str]] = {c: [] for c in convos}
    for turn in range(2):
        for c, convo in convos.items():
            reply, headers = chat(c, convo, stream=turn == 1)
            seen[c].append(headers["x-cachegate-session"])
            convo += [reply, {"role": "user", "content": f"follow-up {turn}"}]
    ids = [set(v) for v in seen.values()]
    assert all(len(one) == 1 for one in ids), seen  # each conversation goes on in its session
    assert len(set.union(*ids)) == 2, seen  # neither joined the other key's
    # the same key again, with the same history: that user's session
    _, again = chat(bob, convos[bob], stream=False)
    assert again["x-cachegate-session"] == seen[bob][0]
    flush(proxy)
    for sid in set.union(*ids):
        assert len(events(proxy.log_dir, sid, "request")) >= 2
    written = b"".join(p.read_bytes() for p in proxy.log_dir.rglob("*") if p.is_file())
    assert keys[0].encode() not in written and keys[1].encode() not in written


def test_a_session_idle_past_its_limit_is_forgotten_when_it_comes_back(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """README: after ``sessions.idle_ttl_s`` without a request a session is forgotten, even when
    no other session was created meanwhile (eviction by idle time used to run only then)."""
    now = [1_790_000_000.0]
    proxy = proxy_factory(sim.api_base, {"sessions": {"idle_ttl_s": 600}}, clock=lambda: now[0])
    client = make_client(proxy.base_url)
    convo: list[dict[str, Any]] = [{"role": "user", "content": "a long task"}]
    reply, first = chat(client, convo, stream=False)
    convo += [reply, {"role": "user", "content": "go on"}]
    proxy.settle()  # (the request's end, as cachegate saw it, before the clock jumps)
    now[0] += 599
    reply, second = chat(client, convo, stream=True)
    convo += [reply, {"role": "user", "content": "and on"}]
    proxy.settle()
    now[0] += 601
    _, third = chat(client, convo, stream=False)
    sid = "x-cachegate-session"
    assert first[sid] == second[sid]
    assert third[sid] != second[sid]  # not joined to the forgotten session: a new one

    named = make_client(proxy.base_url, default_headers={"X-Session-Id": "night-shift"})
    chat(named, [{"role": "user", "content": "one"}], stream=False)
    proxy.settle()
    now[0] += 300
    chat(named, [{"role": "user", "content": "two"}], stream=False)
    proxy.settle()
    now[0] += 601
    _, back = chat(named, [{"role": "user", "content": "three"}], stream=True)
    assert back[sid] == "night-shift"
    flush(proxy)
    # the same file; the forgotten session's exchange numbers start again, as after a restart
    requests = events(proxy.log_dir, "night-shift", "request")
    assert [r["exchange"] for r in requests] == [1, 2, 1]
    assert requests[2]["base"] == 0  # logged in full: nothing to code it against


def test_a_session_at_work_is_not_idle_however_long_its_answers_take(
    proxy_factory: Any,
) -> None:
    """Idle time runs from a session's last request's end, and not while one is in flight: a
    session whose answer outlasted ``sessions.idle_ttl_s`` was forgotten as idle under its own
    request (a second request of it started the numbering again, its accounting too), and so
    was its next turn, sent as soon as that answer ended."""
    now = [1_790_000_000.0]
    with run_simulator(SimConfig(ttft_ms=800)) as slow:
        proxy = proxy_factory(
            slow.api_base, {"sessions": {"idle_ttl_s": 600}}, clock=lambda: now[0]
        )
        busy = make_client(proxy.base_url, default_headers={"X-Session-Id": "long-answer"})
        convo: list[dict[str, Any]] = [{"role": "user", "content": "think hard"}]
        first = threading.Thread(target=chat, args=(busy, convo), kwargs={"stream": True})
        first.start()
        time.sleep(0.3)  # the first answer in flight, ten minutes and more since it was asked
        now[0] += 601
        chat(busy, [{"role": "user", "content": "meanwhile"}], stream=False)
        first.join()

        turns = make_client(proxy.base_url, default_headers={"X-Session-Id": "slow-turn"})
        done = threading.Thread(target=chat, args=(turns, convo), kwargs={"stream": False})
        done.start()
        time.sleep(0.3)
        now[0] += 700  # the answer ends 700 s after it was asked
        done.join()
        now[0] += 500  # the next turn: 500 s after that answer, 1,200 after its request
        chat(turns, [{"role": "user", "content": "next"}], stream=True)
        flush(proxy)
        assert [r["exchange"] for r in events(proxy.log_dir, "long-answer", "request")] == [1, 2]
        assert [r["exchange"] for r in events(proxy.log_dir, "slow-turn", "request")] == [1, 2]
        assert proxy.metric("cachegate_session_evictions_total", {"reason": "idle"}) == 0

        now[0] += 601  # idle now, with nothing in flight: forgotten as before
        chat(turns, [{"role": "user", "content": "after a break"}], stream=False)
        flush(proxy)
        assert [r["exchange"] for r in events(proxy.log_dir, "slow-turn", "request")] == [1, 2, 1]


def agent_history(seed: int, rounds: int, output_chars: int = 4000) -> list[dict[str, Any]]:
    """An agent's history: a task, then ``rounds`` tool calls with their outputs."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": f"task {seed}"},
    ]
    for i in range(rounds):
        call = f"call_{seed}_{i}"
        fn = {"name": "read_file", "arguments": '{"path": "x.py"}'}
        messages.append(
            {"role": "assistant", "tool_calls": [{"id": call, "type": "function", "function": fn}]}
        )
        output = (f"line {i} of session {seed}; " * (output_chars // 20 + 1))[:output_chars]
        messages.append({"role": "tool", "tool_call_id": call, "content": output})
    return messages


COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt-4o",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
    }
)


async def forgetful_upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers every chat request with one small completion and keeps nothing of it."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": COMPLETION})


def test_the_memory_sessions_hold_stays_within_the_budget(tmp_path: Path) -> None:
    """README, "Memory": what cachegate keeps between requests (parsed histories, and the last
    bodies kept so that a next turn is parsed only in what it appended) stays within
    ``sessions.max_memory_mb``, the least recently seen sessions forgotten; without a budget it
    grows with every session. Measured with tracemalloc: the bytes still allocated after ten
    ~250 KB agent sessions (the upstream, in this process too, keeps nothing)."""

    def run(upstream: str, budget_mb: int) -> tuple[int, dict[str, float], list[int]]:
        config = {"sessions": {"max_memory_mb": budget_mb}}
        with run_proxy(upstream, tmp_path / f"logs-{budget_mb}", config) as proxy:
            client = make_client(proxy.base_url)
            post_chat(client, {"model": "gpt-4o", "messages": agent_history(99, 1)})  # warm up
            flush(proxy)
            gc.collect()
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                for seed in range(10):
                    named = client.with_options(default_headers={"X-Session-Id": f"agent-{seed}"})
                    for rounds in (60, 61):  # a turn, then the next one (parsed in its append)
                        post_chat(
                            named, {"model": "gpt-4o", "messages": agent_history(seed, rounds)}
                        )
                flush(proxy)
                gc.collect()
                held = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
            again = client.with_options(default_headers={"X-Session-Id": "agent-0"})
            post_chat(again, {"model": "gpt-4o", "messages": agent_history(0, 62)})
            text = httpx.get(proxy.url + "/metrics").text
            flush(proxy)
            numbers = [r["exchange"] for r in events(proxy.log_dir, "agent-0", "request")]
        wanted = (
            "cachegate_sessions ",
            "cachegate_sessions_memory_bytes ",
            'cachegate_session_evictions_total{reason="memory"} ',
        )
        scraped = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(wanted)
        }
        return held, scraped, numbers

    mib = 1024 * 1024
    with ServerThread(forgetful_upstream) as upstream:
        held, scraped, numbers = run(upstream.url + "/v1", 2)
        unbounded, scraped_unbounded, numbers_unbounded = run(upstream.url + "/v1", 0)
    assert held <= 2.5 * mib, f"held {held / mib:.1f} MiB with a 2 MiB budget"
    assert scraped["cachegate_sessions_memory_bytes"] <= 2 * mib
    assert 1 <= scraped["cachegate_sessions"] < 10
    assert scraped['cachegate_session_evictions_total{reason="memory"}'] >= 8
    assert numbers == [1, 2, 1]  # forgotten, then back: numbers start again, as after a restart

    assert unbounded > 6 * mib and unbounded > 3 * held, f"{unbounded / mib:.1f} MiB unbounded"
    assert scraped_unbounded["cachegate_sessions"] == 11  # the warm-up's inferred session too
    assert scraped_unbounded['cachegate_session_evictions_total{reason="memory"}'] == 0
    assert numbers_unbounded == [1, 2, 3]


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-claude-code-session-id", "0f8fad5b-d9cb-469f-a165-70867728950e"),
        ("Helicone-Session-Id", "helicone:run.7"),
        ("x-litellm-session-id", "litellm_1"),
    ],
)
def test_session_headers_agents_already_send_are_honoured(
    sim: RunningSimulator, proxy_factory: Any, header: str, value: str
) -> None:
    proxy = proxy_factory(sim.api_base)
    client = make_client(proxy.base_url, default_headers={header: value})
    _, h1 = chat(client, [{"role": "user", "content": "a"}], stream=False)
    _, h2 = chat(client, [{"role": "user", "content": "b"}], stream=True)
    assert h1["x-cachegate-session"] == h2["x-cachegate-session"] == value
    flush(proxy)
    assert sorted(p.name for p in proxy.log_dir.iterdir()) == [".gitignore", value + ".jsonl"]


def test_another_tools_session_value_that_is_no_id_does_not_break_the_request(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A tracing tool's session value may be any string: such a request works without cachegate,
    so it works through it too (the value is passed over, the session inferred)."""
    proxy = proxy_factory(sim.api_base)
    client = make_client(
        proxy.base_url, default_headers={"langfuse-session-id": "alice@example.com/run 1"}
    )
    convo: list[dict[str, Any]] = [{"role": "user", "content": "traced task"}]
    reply, h1 = chat(client, convo, stream=False)
    _, h2 = chat(client, [*convo, reply, {"role": "user", "content": "more"}], stream=True)
    assert h1["x-cachegate-session"] == h2["x-cachegate-session"]  # one inferred session
    assert httpx.get(proxy.base_url + "/models", headers={"langfuse-session-id": "a b"}).is_success
    flush(proxy)
    names = sorted(p.name for p in proxy.log_dir.iterdir())
    assert names == [".gitignore", h1["x-cachegate-session"] + ".jsonl"]


def test_x_session_id_wins_over_agent_headers_and_path_wins_over_both(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    both = {"X-Session-Id": "explicit", "x-claude-code-session-id": "agent"}
    r = httpx.post(proxy.base_url + "/chat/completions", json=HELLO, headers=both)
    assert r.headers["x-cachegate-session"] == "explicit"
    r = httpx.post(proxy.url + "/s/from-path/v1/chat/completions", json=HELLO, headers=both)
    assert r.headers["x-cachegate-session"] == "from-path"


def _raw_request(host: str, port: int, head: bytes, body: bytes) -> tuple[int, bytes, bytes]:
    """Send exact bytes on a fresh socket; (status, raw headers, body) of the answer."""
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head_out, _, body_out = data.partition(b"\r\n\r\n")
    return int(head_out.split(b" ", 2)[1]), head_out, body_out


def _assert_openai_error(body: bytes, code: str) -> None:
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code
    assert "[A-Za-z0-9._:-]{1,128}" in error["message"]


HOSTILE_HEADER_IDS = [
    b"../../x",
    b"..",
    b".",
    b"a" * 200,
    b"a" * 129,
    "sessi\u00f6n-\u4e16\u754c".encode(),  # raw UTF-8 bytes on the wire
    b"a/b",
    b"a b",
    b"%2e%2e",
]


@pytest.fixture
def deep_proxy(sim: RunningSimulator, tmp_path: Path) -> Iterator[Any]:
    """cachegate logging three levels below ``tmp_path``: "../../x" from there is still inside
    ``tmp_path``, so listing ``tmp_path`` would show any escape."""
    with run_proxy(sim.api_base, tmp_path / "a" / "b" / "logs") as proxy:
        yield proxy


def test_hostile_ids_are_400_in_openai_shape_and_touch_no_path(
    sim: RunningSimulator, deep_proxy: Any, tmp_path: Path
) -> None:
    proxy = deep_proxy
    before = tree(tmp_path)
    host, port = proxy.server.host, proxy.server.port
    body = orjson.dumps(HELLO)
    for value in HOSTILE_HEADER_IDS:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nX-Session-Id: " + value + b"\r\n"
        )
        status, _, out = _raw_request(host, port, head, body)
        assert status == 400, value
        _assert_openai_error(out, "invalid_session_id")
    # In the path, as exact bytes (an HTTP client would normalize "/s/../v1" away itself).
    for segment in [b"..", b"%2E%2E", b"a%00b", b"%C3%A9t%C3%A9", b"a" * 200, b"x%20y"]:
        head = b"POST /s/" + segment + b"/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        head += b"Connection: close\r\nContent-Type: application/json\r\n"
        status, _, out = _raw_request(host, port, head, body)
        assert status == 400, segment
        _assert_openai_error(out, "invalid_session_id")
        if segment in (b"..", b"%2E%2E"):  # (the rule said matches it: say what it breaks)
            assert b"not be '.' or '..'" in out
    # httpx sends a NUL in the path percent-encoded; it never becomes part of a file name.
    r = httpx.post(proxy.url + "/s/a%00b/v1/chat/completions", json=HELLO)
    assert r.status_code == 400
    _assert_openai_error(r.content, "invalid_session_id")
    # A NUL in a header value: uvicorn refuses the request line itself, before cachegate.
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nX-Session-Id: a\x00b\r\n"
    )
    status, _, _ = _raw_request(host, port, head, body)
    assert status == 400
    # Other routes through the path are refused the same way.
    r = httpx.get(f"{proxy.url}/s/%2E%2E/v1/models")
    assert r.status_code == 400
    _assert_openai_error(r.content, "invalid_session_id")
    flush(proxy)
    assert sim.sim.requests == []  # nothing was forwarded
    assert tree(tmp_path) == before == {"a", "a/b", "a/b/logs", "a/b/logs/.gitignore"}


def test_a_key_sent_as_a_session_id_names_no_file_and_no_session(
    sim: RunningSimulator, deep_proxy: Any, tmp_path: Path
) -> None:
    """A client that put its API key where the session id goes: the log's lines had it
    redacted, but the log file was named by it and `sessions list` printed it whole. In
    cachegate's own headers and the path it is a 400 naming why; in another tool's header it is
    passed over (the session found as without one)."""
    proxy = deep_proxy
    key = "sk-proj-ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    for headers, url in (
        ({"X-Session-Id": key}, proxy.base_url),
        ({}, f"{proxy.url}/s/{key}/v1"),
    ):
        r = httpx.post(url + "/chat/completions", json=HELLO, headers=headers)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == "invalid_session_id" and "reads as an API key" in error["message"]
        assert key.encode() not in r.content
    r = httpx.post(proxy.base_url + "/chat/completions", json=HELLO, headers={"session_id": key})
    assert r.status_code == 200 and r.headers["x-cachegate-session"] != key
    # nor a Responses API conversation's id (it names its session)
    body = {"model": "gpt-4o", "conversation": key, "input": "hi"}
    r = httpx.post(proxy.base_url + "/responses", json=body)
    assert r.status_code == 200 and r.headers["x-cachegate-session"] != key
    # a name the redaction's sk- pattern takes too, with no key's random run in it, is a name
    for name in ("sk-learn-pipeline-debugging", "eval_sk-learn_regression_2024_run_07"):
        r = httpx.post(
            proxy.base_url + "/chat/completions", json=HELLO, headers={"X-Session-Id": name}
        )
        assert r.status_code == 200 and r.headers["x-cachegate-session"] == name
    flush(proxy)
    for name in ("sk-learn-pipeline-debugging", "eval_sk-learn_regression_2024_run_07"):
        # its own name in its log, not [REDACTED] (the redaction took it for a key)
        (meta,) = events(tmp_path / "a" / "b" / "logs", name, "session_meta")
        assert meta["session"] == name
    logs = [p.name for p in (tmp_path / "a" / "b" / "logs").iterdir()]
    assert logs and not any(key in name for name in logs), logs
    assert all(
        key.encode() not in p.read_bytes() for p in (tmp_path / "a" / "b" / "logs").iterdir()
    )


def test_the_clients_own_key_of_no_known_shape_names_no_session(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A gateway's key (``gw-…``: no family the redaction knows) sent as the session id too:
    the log's lines took it out as the client's own key, but the log file was named by it."""
    proxy = proxy_factory(sim.api_base)
    key = "gw-Custom7Key9Alpha3Beta5Gamma"
    auth = {"Authorization": f"Bearer {key}"}
    for headers, url in (
        ({**auth, "X-Session-Id": key}, proxy.base_url),
        (auth, f"{proxy.url}/s/{key}/v1"),
        ({"api-key": key, "X-Session-Id": key}, proxy.base_url),
    ):
        r = httpx.post(url + "/chat/completions", json=HELLO, headers=headers)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_session_id" and "reads as an API key" in error["message"]
    r = httpx.post(
        proxy.base_url + "/chat/completions", json=HELLO, headers={**auth, "session_id": key}
    )
    assert r.status_code == 200 and r.headers["x-cachegate-session"] != key
    body = {"model": "gpt-4o", "conversation": key, "input": "hi"}
    r = httpx.post(proxy.base_url + "/responses", json=body, headers=auth)
    assert r.status_code == 200 and r.headers["x-cachegate-session"] != key
    flush(proxy)
    names = [p.name for p in proxy.log_dir.iterdir()]
    assert len(names) > 1 and not any(key in name for name in names), names


def test_a_key_in_any_header_the_log_takes_it_from_or_cachegates_own_names_no_session(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The log's lines took these out as the client's keys (or cachegate's), but the id check
    looked only at ``Authorization`` split at a space and the provider's key headers: a tab
    after ``Bearer``, ``Basic``'s password, a gateway's key header, cachegate's own key (sent
    with the placeholder) and an id that holds the key each named a log file after the key."""
    import base64

    own = "SERVERopaqueKEY0123456789abcdef"
    proxy = proxy_factory(sim.api_base, environ={"OPENAI_API_KEY": own})
    key = "gwTabKey0123456789abcdefXYZ"
    password = "BasicPw0rd12345678"
    basic = base64.b64encode(f"bob:{password}".encode()).decode()
    for headers in (
        {"Authorization": f"Bearer\t{key}", "X-Session-Id": key},
        {"Authorization": f"Basic {basic}", "X-Session-Id": password},
        {"Helicone-Auth": f"Bearer {key}", "X-Session-Id": key},
        {"x-portkey-api-key": key, "X-Session-Id": key},
        {"Authorization": f"Bearer {key}", "X-Session-Id": f"run-{key}"},
        {"Authorization": "Bearer cachegate", "X-Session-Id": own},
        {"X-Session-Id": f"{own}.2"},
        # a piece of a key, 16 characters or more of its start at the id's end or of its end
        # at the id's start, as the log takes it out (the file was named by it, its own lines
        # saying "[REDACTED]")
        {"Authorization": f"Bearer {key}", "X-Session-Id": key[:20]},
        {"X-Session-Id": own[-20:]},
        {"X-Session-Id": f"run-{own[:16]}"},
        {"X-Session-Id": f"{own[-16:]}.2"},
    ):
        r = httpx.post(proxy.base_url + "/chat/completions", json=HELLO, headers=headers)
        assert r.status_code == 400, (headers, r.text)
        error = r.json()["error"]
        assert error["code"] == "invalid_session_id" and "reads as an API key" in error["message"]
    # a key sent in the URL's query (Google's ``?key=``, Azure's ``?api-key=``): taken out of
    # the log's lines as the client's, it named the log file
    query_key = "a1b2c3d4e5f60718293a4b5c6d7e8f90"
    for url, headers in (
        (proxy.base_url + "/chat/completions?api-key=" + query_key, {"X-Session-Id": query_key}),
        (f"{proxy.url}/s/run-{query_key}/v1/chat/completions?key={query_key}", {}),
    ):
        r = httpx.post(url, json=HELLO, headers=headers)
        assert r.status_code == 400, (url, r.text)
        assert "reads as an API key" in r.json()["error"]["message"]
    # (the placeholder and a short key are no keys: the names they are in are names)
    for headers, sid in (
        ({"Authorization": "Bearer cachegate"}, "cachegate-run-1"),
        ({"Authorization": "Bearer short"}, "short-run-2"),
        ({"Authorization": f"Bearer {key}"}, key[:12] + "-run-3"),  # (fewer: no piece)
        # (a piece the id goes on past, which the log leaves: a key made of words, a Basic
        # user's name, "local-dev-key-for-testing-only" and "local-dev-key-for-testing-run2")
        ({"Authorization": f"Bearer {key}"}, key[:20] + "-run-4"),
        (
            {
                "Authorization": "Basic "
                + base64.b64encode(b"project-frontend:hunter2hunter2").decode()
            },
            "project-frontend-refactor",
        ),
    ):
        r = httpx.post(
            proxy.base_url + "/chat/completions",
            json=HELLO,
            headers={**headers, "X-Session-Id": sid},
        )
        assert r.status_code == 200 and r.headers["x-cachegate-session"] == sid, r.text
    flush(proxy)
    names = [p.name for p in proxy.log_dir.iterdir()]
    assert not any(k in name for name in names for k in (key, password, own, query_key)), names
    assert not any(
        name.removesuffix(".jsonl").endswith(k[:16]) or name.startswith(k[-16:])
        for name in names
        for k in (key, own)
    ), names
    # (another session header's id that holds a piece is no id: the request gets one of its own)
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json=HELLO,
        headers={"langfuse-session-id": own[-20:]},
    )
    assert r.status_code == 200 and r.headers["x-cachegate-session"] != own[-20:]


def test_cachegates_own_key_set_to_the_placeholder_is_no_secret(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """``OPENAI_API_KEY=cachegate`` in cachegate's own shell (the agent's setting, which `serve`
    notes; a keyless local upstream works with it): every id with "cachegate" in it was refused
    as a key, and the log took the word out of its lines (``"[REDACTED]-dev"``)."""
    proxy = proxy_factory(sim.api_base, environ={"OPENAI_API_KEY": "cachegate"})
    headers = {"Authorization": "Bearer cachegate", "X-Session-Id": "cachegate-dev"}
    r = httpx.post(proxy.base_url + "/chat/completions", json=HELLO, headers=headers)
    assert r.status_code == 200 and r.headers["x-cachegate-session"] == "cachegate-dev", r.text
    flush(proxy)
    line = (proxy.log_dir / "cachegate-dev.jsonl").read_text().splitlines()[0]
    assert json.loads(line)["session"] == "cachegate-dev"


def test_a_slash_smuggled_into_the_path_id_is_a_400_not_a_file(
    sim: RunningSimulator, deep_proxy: Any, tmp_path: Path
) -> None:
    proxy = deep_proxy
    before = tree(tmp_path)
    body = orjson.dumps(HELLO)
    for segment in [b"..%2F..%2Fx", b"..%2Fescape", b"a%2Fb"]:
        head = b"POST /s/" + segment + b"/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        head += b"Connection: close\r\nContent-Type: application/json\r\n"
        status, _, out = _raw_request(proxy.server.host, proxy.server.port, head, body)
        assert tree(tmp_path) == before
        assert sim.sim.requests == []
        assert status == 400, (segment, status, out)
        _assert_openai_error(out, "invalid_session_id")


def test_every_chat_response_names_its_session_even_errors(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    bad = {"model": "gpt-4o", "messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json=bad,
        headers={"X-Session-Id": "err-1", "X-Cachegate-Strict": "1"},
    )
    assert r.status_code == 400
    assert r.headers["x-cachegate-session"] == "err-1"
    r = httpx.post(proxy.base_url + "/chat/completions", json=HELLO)
    assert r.status_code == 200
    assert r.headers["x-cachegate-session"]
    # Refused before the body says anything: the session the request named, if valid.
    for url, headers in (
        (proxy.base_url + "/chat/completions", {"X-Session-Id": "err-2"}),
        (proxy.url + "/s/err-2/v1/chat/completions", {}),
    ):
        r = httpx.post(url, content=b'{"model": "gpt-4o", "messages": [', headers=headers)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json")
        assert r.headers["x-cachegate-session"] == "err-2"
    r = httpx.post(
        proxy.base_url + "/chat/completions", content=b"[1]", headers={"X-Session-Id": "bad id"}
    )
    assert r.status_code == 400 and "x-cachegate-session" not in r.headers


def test_a_request_refused_before_its_session_was_known_is_in_the_session_it_named(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A body that is no JSON, a body too large, messages that are no array: a user looking into
    the 400 their agent got found nothing in `sessions show`, though the answer named the
    session (and the metrics counted it). A session cachegate does not hold is not made for a
    refusal: refusals cost nothing, and a flood of them pushed real sessions out."""
    proxy = proxy_factory(sim.api_base, {"server": {"max_body_bytes": 4096}})
    url = proxy.base_url + "/chat/completions"
    named = {"X-Session-Id": "refused-1"}
    client = make_client(proxy.base_url, default_headers=named)
    assert post_chat(client, HELLO)
    not_json = httpx.post(url, content=b'{"model": "gpt-4o", "messages": [', headers=named)
    assert not_json.status_code == 400
    no_array = httpx.post(url, json={"model": "gpt-4o", "messages": {}}, headers=named)
    assert no_array.status_code == 400
    big = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x" * 5000}]}
    assert httpx.post(url, json=big, headers=named).status_code == 413
    assert post_chat(client, HELLO)
    # one that named no session, or one cachegate does not hold, is in none
    assert httpx.post(url, content=b"[", headers={}).status_code == 400
    unheld = httpx.post(url, content=b"[", headers={"X-Session-Id": "never-seen"})
    assert unheld.status_code == 400 and unheld.headers["x-cachegate-session"] == "never-seen"
    flush(proxy)
    show = run_cli("sessions", "show", "refused-1", "--log-dir", str(proxy.log_dir), "--json")
    rows = show.json()["exchanges"]
    assert [(r["exchange"], r["status"]) for r in rows] == [
        (1, 200),
        (2, 400),
        (3, 400),
        (4, 413),
        (5, 200),
    ]
    assert (
        "not valid JSON" in rows[1]["error"] and "'messages' must be an array" in rows[2]["error"]
    )
    assert sorted(p.name for p in proxy.log_dir.glob("*.jsonl")) == ["refused-1.jsonl"]
    assert len(sim.sim.requests) == 2


# --- the log through HTTP ----------------------------------------------------------------------


def test_two_hundred_exchanges_log_grows_linearly_and_replays_exactly(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "long-1"})
    log = proxy.log_dir / "long-1.jsonl"
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "turn 0"},
    ]
    sizes: dict[int, int] = {}
    for i in range(1, 201):
        body = {"model": "gpt-4o", "messages": convo, "stream": i % 3 == 0}
        reply = post_chat(client, body)
        convo = [*convo, reply, {"role": "user", "content": f"turn {i}"}]
        if i in (20, 60, 160, 200):
            flush(proxy)
            sizes[i] = log.stat().st_size
    early = (sizes[60] - sizes[20]) / 40
    late = (sizes[200] - sizes[160]) / 40
    # Each exchange logs only what it added: a late exchange costs about what an early one did
    # (a log that repeated the history would cost ~4x more per exchange late than early).
    assert late < 1.5 * early, (early, late)

    result = run_cli("sessions", "replay", "long-1", "--log-dir", str(proxy.log_dir))
    assert result.code == 0, result.err
    lines = [orjson.loads(line) for line in result.out.splitlines()]
    assert [line["exchange_id"] for line in lines] == list(range(1, 201))
    sent = [r.body["messages"] for r in sim.sim.requests]
    assert len(sent) == 200
    for line, messages in zip(lines, sent, strict=True):
        assert line["messages"] == messages, line["exchange_id"]
    # The last request is the whole conversation, as the client sent it.
    assert lines[-1]["messages"] == convo[:-2]


def test_a_system_prompt_with_the_time_in_it_still_grows_the_log_linearly_and_replays_exactly(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """An agent that puts the time in its system prompt resends its whole history behind a new
    system prompt every turn: each request line holds the new system block and what was
    appended, not the history again (the log grew with the square of the conversation), and
    replay gives back every request as it was forwarded, a system block that grows a developer
    message, a rewound history, and a static system message kept before the one that changes
    included."""
    proxy = proxy_factory(sim.api_base)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "clock-1"})
    log = proxy.log_dir / "clock-1.jsonl"

    def system(i: int) -> list[dict[str, Any]]:
        if i >= 57:  # then a static system message, and the time in a developer message after it
            return [
                {"role": "system", "content": "Be brief. " * 100},
                {"role": "developer", "content": f"Current time: 2026-12-03T08:{i:02d}:00Z"},
            ]
        block = [
            {"role": "system", "content": f"Current time: 2026-12-03T08:{i:02d}:00Z. Be brief."}
        ]
        if i >= 50:  # the agent adds a developer message to its system block
            block.append({"role": "developer", "content": "Prefer small diffs."})
        return block

    history: list[dict[str, Any]] = [{"role": "user", "content": "task: " + "x" * 2000}]
    sizes: dict[int, int] = {}
    for i in range(1, 61):
        if i == 55:  # a rewind: the last two turns are dropped
            history = history[:-4]
        reply = post_chat(client, {"model": "gpt-4o", "messages": [*system(i), *history]})
        history = [*history, reply, {"role": "user", "content": f"turn {i}: " + "y" * 2000}]
        if i in (10, 20, 40, 60):
            flush(proxy)
            sizes[i] = log.stat().st_size
    early = (sizes[20] - sizes[10]) / 10
    late = (sizes[60] - sizes[40]) / 20
    # ~2.2 KB appended a turn: a line that repeated the history would cost ~45 KB late on
    assert late < 1.5 * early, (early, late)
    lines = events(proxy.log_dir, "clock-1", "request")
    assert lines[1]["head"] == system(2) and lines[1]["replaces"] == 1
    assert lines[49]["head"] == system(50) and lines[49]["replaces"] == 1
    assert lines[50]["head"] == system(51) and lines[50]["replaces"] == 2
    assert "kept" not in lines[50] and lines[57]["kept"] == 1
    assert lines[57]["head"] == system(58)[1:]  # the static system message is not written again

    result = run_cli("sessions", "replay", "clock-1", "--log-dir", str(proxy.log_dir))
    assert result.code == 0, result.err
    replayed = [orjson.loads(line)["messages"] for line in result.out.splitlines()]
    sent = [r.body["messages"] for r in sim.sim.requests]
    assert len(sent) == 60 and replayed == sent


def test_a_sliding_window_still_grows_the_log_linearly_and_replays_exactly(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A client that keeps a window of its last messages (the oldest dropped each turn), and
    one that cuts a run out after its first request near the context limit: each request line
    held the whole history again (~90 KB a line here, where a turn appends ~4.3 KB). Now what
    was appended, coded against the base's messages it kept; replay gives back every request
    as it was forwarded."""
    proxy = proxy_factory(sim.api_base)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "window-1"})
    log = proxy.log_dir / "window-1.jsonl"
    system = {"role": "system", "content": "Be brief. " * 50}
    task = {"role": "user", "content": "task: " + "x" * 2000}
    history: list[dict[str, Any]] = [task]
    sizes: dict[int, int] = {}
    for i in range(1, 61):
        if i <= 40 and len(history) > 40:  # a sliding window of 40 messages
            history = history[-40:]
        if i == 45:  # its first message kept, a run of turns after it cut out
            history = [history[0], *history[21:]]
        reply = post_chat(client, {"model": "gpt-4o", "messages": [system, *history]})
        history = [*history, reply, {"role": "user", "content": f"turn {i}: " + "y" * 2000}]
        if i in (25, 35, 50, 60):
            flush(proxy)
            sizes[i] = log.stat().st_size
    # ~7 KB a turn (its request and response lines): one that repeated the window, ~90 KB
    assert (sizes[35] - sizes[25]) / 10 < 15_000, sizes
    assert (sizes[60] - sizes[50]) / 10 < 15_000, sizes
    lines = events(proxy.log_dir, "window-1", "request")
    assert lines[30]["head"] == [] and lines[30]["replaces"] == 3 and lines[30]["kept"] == 1
    assert lines[44]["head"] == [] and lines[44]["kept"] == 2
    result = run_cli("sessions", "replay", "window-1", "--log-dir", str(proxy.log_dir))
    assert result.code == 0, result.err
    replayed = [orjson.loads(line)["messages"] for line in result.out.splitlines()]
    sent = [r.body["messages"] for r in sim.sim.requests]
    assert len(sent) == 60 and replayed == sent


def test_client_closing_mid_stream_logs_an_interrupted_response(proxy_factory: Any) -> None:
    with run_simulator(SimConfig(chunk_ms=30)) as sim:
        sim.sim.enqueue([parse_script("word " * 300)])
        proxy = proxy_factory(sim.api_base)
        client = make_client(proxy.base_url, default_headers={"X-Session-Id": "cut-1"})
        stream = client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "talk"}], stream=True
        )
        received = ""
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received += chunk.choices[0].delta.content
                if received.count("word") >= 3:
                    break
        stream.close()

        def response_logged() -> list[dict[str, Any]]:
            flush(proxy)
            return events(proxy.log_dir, "cut-1", "response")

        (response,) = wait_for(response_logged, what="the response event")
    assert response["interrupted"] is True
    assert response["exchange"] == 1
    assert response["finish_reason"] is None
    show = run_cli("sessions", "show", "cut-1", "--log-dir", str(proxy.log_dir), "--json")
    assert show.json()["exchanges"][0]["interrupted"] is True


def test_a_stream_with_an_event_that_is_not_json_is_logged_as_failed_not_clean(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The upstream sends a data line that is no JSON: relayed as it came, the SDK raises on it,
    so the log must not show a clean answer (it had the full message, "stop" and no error)."""
    proxy = proxy_factory(sim.api_base)
    client = make_client(
        proxy.base_url,
        default_headers={"X-Session-Id": "torn-event", "X-Sim-Fault": "malformed"},
    )
    stream = client.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "a message long enough for several chunks"}],
        stream=True,
    )
    with pytest.raises(json.JSONDecodeError):
        for _ in stream:
            pass
    flush(proxy)
    (response,) = events(proxy.log_dir, "torn-event", "response")
    assert response["status"] == 200
    assert response["error"] == (
        "upstream sent 1 stream event whose data was not a JSON object"
        " (the openai SDKs fail on it; the Vercel AI SDK reads on past it)"
    )
    show = run_cli("sessions", "show", "torn-event", "--log-dir", str(proxy.log_dir))
    assert "upstream sent 1 stream event" in show.out
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "invalid"}) == 1


@pytest.mark.parametrize(
    "odd",
    [
        b"data: \n\n",
        # blocks WHATWG dispatches nothing for, but the openai SDKs do, with empty data
        b"event: ping\n\n",
        b"retry: 3000\n\n",
        b"id: 7\ndata: {}\n\n\n",  # a blank line more, once an id was given
    ],
    ids=["empty-data", "event-only", "retry-only", "blank-after-id"],
)
def test_a_stream_with_an_empty_data_line_is_logged_as_failed_not_clean(
    scripted: Any, proxy_factory: Any, odd: bytes
) -> None:
    """``data: `` with nothing after it, or a block the SDK dispatches without data: the openai
    SDK parses it as JSON and raises, so the log must not show the clean answer it otherwise
    had."""
    chunks = [
        b'data: {"id":"c1","object":"chat.completion.chunk","model":"gpt-4o","choices":'
        b'[{"index":0,"delta":{"role":"assistant","content":"half"},"finish_reason":null}]}\n\n',
        odd,
        b'data: {"id":"c1","object":"chat.completion.chunk","model":"gpt-4o","choices":'
        b'[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    _upstream, url = scripted(chunks=chunks)
    proxy = proxy_factory(url)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "empty-data"})
    stream = client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    with pytest.raises(json.JSONDecodeError):
        for _ in stream:
            pass
    stream.close()

    def response_logged() -> list[dict[str, Any]]:
        flush(proxy)
        return events(proxy.log_dir, "empty-data", "response")

    (response,) = wait_for(response_logged, what="the response event")
    assert response["error"] == (
        "upstream sent 1 stream event whose data was not a JSON object"
        " (the openai SDKs fail on it; the Vercel AI SDK reads on past it)"
    )
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "invalid"}) == 1


@pytest.mark.parametrize("finished", [False, True])
def test_a_stream_that_ends_early_between_events_is_logged_as_cut(
    scripted: Any, proxy_factory: Any, sdk: Any, finished: bool
) -> None:
    """A chunked stream properly ended after a few events, with neither [DONE] nor a
    finish_reason: the SDK ends quietly with half an answer, and the log showed a clean one. A
    stream with its finish_reason but no [DONE] (some providers leave it out) is whole."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        payload = {"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o"}
        return b"data: " + json.dumps({**payload, "choices": [choice]}).encode() + b"\n\n"

    chunks = [chunk({"role": "assistant", "content": "w0 "}), chunk({"content": "w1 "})]
    if finished:
        chunks.append(chunk({}, "stop"))
    _upstream, url = scripted(chunks=chunks)
    proxy = proxy_factory(url)
    client = sdk(proxy.base_url, default_headers={"X-Session-Id": "ended-early"})
    stream = client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "w0 w1 "  # no exception: the SDK cannot tell

    def response_logged() -> list[dict[str, Any]]:
        flush(proxy)
        return events(proxy.log_dir, "ended-early", "response")

    (response,) = wait_for(response_logged, what="the response event")
    assert response["status"] == 200 and response["interrupted"] is False
    if finished:
        assert response["error"] is None and response["finish_reason"] == "stop"
        assert proxy.metric("cachegate_upstream_errors_total", {"kind": "midstream"}) == 0
    else:
        assert response["error"] == (
            "upstream ended the stream before [DONE], with no finish_reason"
        )
        assert proxy.metric("cachegate_upstream_errors_total", {"kind": "midstream"}) == 1
        show = run_cli("sessions", "show", "ended-early", "--log-dir", str(proxy.log_dir))
        assert "before [DONE]" in show.out


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            b'{"error":{"message":"Rate limit reached for requests"}}\n',
            "Rate limit reached for requests",
        ),
        (b"data: overloaded\n\n", "upstream answered 429: data: overloaded"),
    ],
)
def test_a_refusal_declared_as_an_event_stream_is_logged_with_its_words(
    scripted: Any, proxy_factory: Any, sdk: Any, body: bytes, error: str
) -> None:
    """A gateway that sets its stream's content type before it knows the outcome: the 429's
    words were lost, and the log said the stream was cut."""
    _upstream, url = scripted(chunks=[body], status=429)
    proxy = proxy_factory(url)
    client = sdk(proxy.base_url, default_headers={"X-Session-Id": "sse-refusal"})
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True
        )

    def response_logged() -> list[dict[str, Any]]:
        flush(proxy)
        return events(proxy.log_dir, "sse-refusal", "response")

    (response,) = wait_for(response_logged, what="the response event")
    assert (response["status"], response["error"]) == (429, error)
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "status"}) == 1
    assert proxy.metric("cachegate_upstream_errors_total", {"kind": "midstream"}) == 0


@pytest.mark.parametrize("transport", ["native", "httpx"])
@pytest.mark.parametrize("crlf", [False, True])
def test_a_client_that_closes_at_done_before_the_upstreams_last_bytes_got_a_whole_answer(
    scripted: Any, proxy_factory: Any, transport: str, crlf: bool
) -> None:
    """The openai SDK stops reading at ``[DONE]`` and closes; an upstream whose chunked
    stream ends a moment later had the exchange logged as interrupted (and in INTERRUPTED);
    with ``transport = "httpx"`` (whose answers go through the server's ``send``) until later.
    With CRLF line ends, the SDK dispatches ``[DONE]`` at the CR of its blank line: a stream
    whose last LF came in a read of its own was logged as interrupted."""
    end = b"\r\n\r\n" if crlf else b"\n\n"
    chunks = [
        b'data: {"id":"c1","object":"chat.completion.chunk","model":"gpt-4o","choices":'
        b'[{"index":0,"delta":{"role":"assistant","content":"whole"},"finish_reason":null}]}' + end,
        b'data: {"id":"c1","object":"chat.completion.chunk","model":"gpt-4o","choices":'
        b'[{"index":0,"delta":{},"finish_reason":"stop"}]}' + end,
        *([b"data: [DONE]\r\n\r", b"\n"] if crlf else [b"data: [DONE]\n\n"]),
        b"",  # the upstream's end comes a moment after [DONE]
    ]
    _upstream, url = scripted(chunks=chunks, delay_s=0.3)
    proxy = proxy_factory(url, {"upstream": {"transport": transport}})
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "closed-at-done"})
    stream = client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "whole"

    def response_logged() -> list[dict[str, Any]]:
        flush(proxy)
        return events(proxy.log_dir, "closed-at-done", "response")

    (response,) = wait_for(response_logged, what="the response event")
    assert response["interrupted"] is False, response
    assert response["finish_reason"] == "stop"
    assert response["message"]["content"] == "whole"
    listed = run_cli("sessions", "list", "--log-dir", str(proxy.log_dir), "--json").json()
    assert listed[0]["interruptions"] == 0


def test_sub_agents_interleaved_in_one_session_are_each_coded_against_their_own_turn(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Eight conversations taking turns under one session id: each request line names its own
    conversation's previous turn as its base, so the log grows with the conversations, not
    with their squares (with four bases kept, most lines were logged whole), and replay gives
    back what was sent."""
    proxy = proxy_factory(sim.api_base)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "fan-8"})
    agents = [
        [
            {"role": "system", "content": f"You are sub-agent {n}."},
            {"role": "user", "content": f"Task {n}: " + "read the code. " * 40},
        ]
        for n in range(8)
    ]
    sent: list[list[dict[str, Any]]] = []
    for turn in range(4):
        for convo in agents:
            reply, _ = chat(client, convo, stream=False)
            sent.append([dict(m) for m in convo])
            convo += [reply, {"role": "user", "content": f"tool output {turn}: " + "x" * 400}]
    flush(proxy)
    requests = events(proxy.log_dir, "fan-8", "request")
    assert len(requests) == 32
    for number, line in enumerate(requests[8:], start=9):
        assert line["base_exchange"] == number - 8, number  # its own conversation's last turn
        assert line["base"] == len(sent[number - 9]), number  # all of it carried on
    replayed = run_cli("sessions", "replay", "fan-8", "--log-dir", str(proxy.log_dir))
    assert [orjson.loads(x)["messages"] for x in replayed.out.splitlines()] == [
        r.body["messages"] for r in sim.sim.requests
    ]


def test_tools_added_to_a_large_history_reach_the_provider_and_the_log(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The SDK puts ``messages`` last when nothing follows it; the next turn adds tools and a
    temperature after them. Those bytes were spliced as appended messages (over 16 KiB, the
    body is parsed in proportion to what was appended): the log lost the fields, and when
    the turn needed a repair, the provider got the body without its tools."""
    proxy = proxy_factory(sim.api_base)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "grown"})
    convo: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent. " + "Follow the guide. " * 1200},
        {"role": "user", "content": "Look at the repository."},
    ]
    client.chat.completions.create(model="gpt-4o", messages=convo)  # type: ignore[arg-type]
    call = {"id": "call_1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}
    convo += [
        {"role": "assistant", "content": None, "tool_calls": [call]},  # interrupted: no result
        {"role": "user", "content": "Go on."},
    ]
    tools = [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object"}}}]
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=convo,  # type: ignore[arg-type]
        tools=tools,  # type: ignore[arg-type]
        temperature=0.2,
    )
    assert raw.headers["x-cachegate-repairs"] == "1"
    received = sim.sim.requests[-1].body
    assert received["tools"] == tools and received["temperature"] == 0.2
    flush(proxy)
    request = events(proxy.log_dir, "grown", "request")[-1]
    assert request["params"].get("temperature") == 0.2
    replayed = run_cli("sessions", "replay", "grown", "--log-dir", str(proxy.log_dir))
    last = orjson.loads(replayed.out.splitlines()[-1])
    assert last["tools"] == tools and last["params"]["temperature"] == 0.2


def test_an_earlier_message_edited_from_1_to_true_is_logged_as_sent(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Python holds 1 == True: the session kept the previous turn's message for the edited one,
    and replay gave back a body that was never sent."""
    proxy = proxy_factory(sim.api_base)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "typed"})
    first = [{"role": "user", "content": "hi", "weight": 1}]
    post_chat(client, {"model": "gpt-4o", "messages": first})
    edited = [
        {"role": "user", "content": "hi", "weight": True},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    post_chat(client, {"model": "gpt-4o", "messages": edited})
    assert sim.sim.requests[-1].body["messages"][0]["weight"] is True
    flush(proxy)
    replayed = run_cli("sessions", "replay", "typed", "--log-dir", str(proxy.log_dir))
    last = orjson.loads(replayed.out.splitlines()[-1])
    assert last["messages"][0]["weight"] is True


def test_a_history_resent_in_new_key_orders_is_logged_as_deltas(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A client whose serializer orders keys anew each turn: once messages had to be the same
    JSON to be shared, each line logged the whole history. Key order is no change."""
    proxy = proxy_factory(sim.api_base)
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "shuffled"})
    history: list[dict[str, Any]] = []
    for turn in range(6):
        history.append({"role": "user", "content": f"step {turn}: " + "x" * 300})
        sent = [
            dict(reversed(list(m.items()))) if turn % 2 else dict(m)  # another order each turn
            for m in history
        ]
        reply = post_chat(client, {"model": "gpt-4o", "messages": sent})
        history.append({"role": reply["role"], "content": reply["content"]})
    flush(proxy)
    requests = events(proxy.log_dir, "shuffled", "request")
    for number, line in enumerate(requests[1:], start=2):
        assert line["base_exchange"] == number - 1, number
        assert len(line["appended"]) == 2, number  # the answer and the new step, not it all


def test_content_nested_deeper_than_orjson_writes_is_repaired_forwarded_and_logged(
    sim: RunningSimulator, proxy_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """orjson reads 1,024 levels and writes 254: a body nested 300 deep that needed a repair
    was a 500 of cachegate's, and without one its log lines were lost."""
    proxy = proxy_factory(sim.api_base)
    deep: Any = "x"
    for _ in range(300):
        deep = [deep]
    call = {"id": "call_1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "look", "metadata": deep},
        {"role": "assistant", "content": None, "tool_calls": [call]},  # no result: repaired
        {"role": "user", "content": "go on"},
    ]
    raw = json.dumps({"model": "gpt-4o", "messages": messages}).encode()
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        content=raw,
        headers={"X-Session-Id": "deep", "content-type": "application/json"},
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-cachegate-repairs"] == "1"
    assert sim.sim.requests[-1].body["messages"][0]["metadata"] == deep
    flush(proxy)
    (request,) = events(proxy.log_dir, "deep", "request")
    (response,) = events(proxy.log_dir, "deep", "response")
    assert request["appended"][0]["metadata"] == deep
    assert response["usage"] is not None and "cost" in response
    # the accounting weighed it (its estimate failed: no cache line), replay writes it again
    # (it stopped there with a traceback), and the simulator still lists what it received
    assert response["cache"] is not None
    (replayed,) = [orjson.loads(line) for line in replay_lines(proxy.log_dir, "deep")]
    assert replayed["messages"] == sim.sim.requests[-1].body["messages"]
    listed = httpx.get(sim.url + "/_sim/requests")
    assert listed.status_code == 200
    assert listed.json()["requests"][-1]["body"]["messages"][0]["metadata"] == deep
    # a line the secret scan looks through ("disk-usage" holds "sk-") is redacted as deep
    messages[2] = {"role": "user", "content": "check the disk-usage sk-" + "aB3" * 10}
    raw = json.dumps({"model": "gpt-4o", "messages": messages}).encode()
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        content=raw,
        headers={"X-Session-Id": "deep-secret", "content-type": "application/json"},
    )
    assert r.status_code == 200, r.text
    flush(proxy)
    (request,) = events(proxy.log_dir, "deep-secret", "request")
    assert request["appended"][-1]["content"] == "check the disk-usage [REDACTED]"
    # As deep as orjson reads (1,024 levels in all), past what the standard library writes by
    # default (~990): repaired, forwarded, accounted, logged and replayed all the same (it was
    # a 400 of cachegate's; the accounting, the log and replay failed on it)
    messages[0] = {"role": "user", "content": "look", "metadata": "DEEP"}
    messages[2] = {"role": "user", "content": "go on"}
    raw = orjson.dumps({"model": "gpt-4o", "messages": messages})
    raw = raw.replace(b'"DEEP"', b"[" * 1000 + b'"x"' + b"]" * 1000)
    r = httpx.post(
        proxy.base_url + "/chat/completions", content=raw, headers={"X-Session-Id": "d1k"}
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-cachegate-repairs"] == "1"
    sent = sim.sim.requests[-1].body["messages"]
    flush(proxy)
    (response,) = events(proxy.log_dir, "d1k", "response")
    assert response["cache"] is not None
    (replayed,) = [orjson.loads(line) for line in replay_lines(proxy.log_dir, "d1k")]
    assert deep_dumps(replayed["messages"]) == deep_dumps(sent)  # (== recurses too deep)
    assert httpx.get(sim.url + "/_sim/requests").status_code == 200
    # The same body again in its session (a retry; a next turn resends the message): compared
    # with the last request's messages to share them, which recursed too deep (every later
    # request of the session was a 500 of cachegate's, nothing forwarded)
    r = httpx.post(
        proxy.base_url + "/chat/completions", content=raw, headers={"X-Session-Id": "d1k"}
    )
    assert r.status_code == 200, r.text
    flush(proxy)
    assert len(events(proxy.log_dir, "d1k", "response")) == 2
    *_, again = [orjson.loads(line) for line in replay_lines(proxy.log_dir, "d1k")]
    assert deep_dumps(again["messages"]) == deep_dumps(sim.sim.requests[-1].body["messages"])
    # A tool schema as deep (its digest walked it in Python, two frames a level: every request
    # lost its accounting and wrote ~225 KB of traceback), a secret in a body that deep (the
    # redaction walked it: the request line was lost), and a lone surrogate in one (refused as
    # invalid_json past ~490 levels): each taken as any other.
    tool = {"type": "function", "function": {"name": "f", "parameters": {"x": "DEEP"}}}
    raw = orjson.dumps(
        {"model": "gpt-4o", "tools": [tool], "messages": [{"role": "user", "content": "hi"}]}
    ).replace(b'"DEEP"', b"[" * 1010 + b'"x"' + b"]" * 1010)
    with caplog.at_level(logging.ERROR):
        r = httpx.post(
            proxy.base_url + "/chat/completions", content=raw, headers={"X-Session-Id": "dtool"}
        )
        assert r.status_code == 200, r.text
        secret = {
            "role": "user",
            "content": "my key sk-proj-" + "Ab3dEf6hIj9kLm2nOp5qRs8t",
            "m": "DEEP",
        }
        raw = orjson.dumps({"model": "gpt-4o", "messages": [secret]})
        raw = raw.replace(b'"DEEP"', b"[" * 1000 + b'"x"' + b"]" * 1000)
        r = httpx.post(
            proxy.base_url + "/chat/completions", content=raw, headers={"X-Session-Id": "dsecret"}
        )
        assert r.status_code == 200, r.text
        flush(proxy)
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text
    assert events(proxy.log_dir, "dtool", "response")[0]["cache"] is not None
    (request,) = events(proxy.log_dir, "dsecret", "request")
    assert request["appended"][0]["content"] == "my key [REDACTED]"
    surrogate = orjson.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "DEEP"}]})
    surrogate = surrogate.replace(b'"DEEP"', b"[" * 985 + b'"a \\ud83d b"' + b"]" * 985)
    forwarded = len(sim.sim.requests)
    r = httpx.post(proxy.base_url + "/chat/completions", content=surrogate)
    assert "Request body is not valid JSON" not in r.text  # not cachegate's refusal...
    assert len(sim.sim.requests) == forwarded + 1  # ...the provider's to judge (it refused it)
    assert r.json()["error"]["message"].startswith("We could not parse the JSON body")
    # past what orjson reads: not JSON cachegate can take, said as such, nothing forwarded
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        content=raw.replace(b"[" * 1000, b"[" * 1030).replace(b"]" * 1000, b"]" * 1030),
    )
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json")


# --- crash safety --------------------------------------------------------------------------------


@contextlib.contextmanager
def _stalled_stream(log_dir: Path, sid: str) -> Iterator[Any]:
    """cachegate in a process, relaying a stream the upstream holds after its first events;
    yields the process once the client has them."""
    with (
        run_simulator(SimConfig(chunk_ms=20)) as sim,
        cachegate_process(sim.api_base, log_dir) as (proc, url),
    ):
        started = threading.Semaphore(0)
        stalled = {"X-Sim-Fault": "stall", "X-Sim-Stall-S": "60"}
        client = threading.Thread(target=_stream_until_killed, args=(url, sid, started, stalled))
        client.start()
        assert started.acquire(timeout=20), "the stream should be under way"
        yield proc
        client.join(20)
        assert not client.is_alive()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGHUP])
def test_a_stream_cut_by_ctrl_c_is_logged_as_interrupted_not_as_a_clean_answer(
    tmp_path: Path, stop: signal.Signals
) -> None:
    """Ctrl+C lets answers in flight finish for 5 s (README, "Command line"), then cuts them:
    the log must say the answer was cut, where it recorded a 200 with no error. A closed
    terminal (SIGHUP) stops it the same way, where it used to end the process with no line."""
    log_dir = tmp_path / "logs"
    with _stalled_stream(log_dir, "stopped") as proc:
        proc.send_signal(stop)
        assert proc.wait(20) == 0  # a clean exit, after the grace period
        assert proc.stderr is not None
        said = proc.stderr.read().decode()
    # The cut is said in cachegate's words, not as uvicorn's "ERROR: Cancel 1 running task(s)".
    assert "ERROR" not in said and "Cancel" not in said, said
    assert "cachegate: stopping: 1 request(s) still in flight after the 5 s grace period" in said
    kinds = [e["type"] for e in events(log_dir, "stopped")]
    assert kinds == ["session_meta", "request", "response"]  # written before the exit
    response = events(log_dir, "stopped", "response")[0]
    assert response["interrupted"] is True
    assert response["error"] == "cut: cachegate stopped before the response was complete"
    show = run_cli("sessions", "show", "stopped", "--log-dir", str(log_dir))
    assert "interrupted" in show.out


def test_a_stream_cut_by_a_shutdown_keeps_the_part_of_an_event_cachegate_held_back(
    tmp_path: Path, scripted: Any
) -> None:
    """A chat stream whose usage cachegate asked for (and strips): the upstream stalls inside an
    event, and cachegate's shutdown cuts the stream. The part of that event it held back (to
    tell whether it was the usage event) never reached the client, which had every byte the
    upstream sent when the upstream itself cut the stream."""
    first = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
    half = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"ind'
    _upstream, url = scripted(chunks=[first + half, b'ex":0}]}\n\n'], delay_s=60)
    got = bytearray()
    started = threading.Event()

    def read(base: str) -> None:
        body = {"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.stream("POST", base + "/chat/completions", json=body, timeout=30) as r,
        ):
            for chunk in r.iter_raw():
                got.extend(chunk)
                started.set()

    with cachegate_process(url, tmp_path / "logs") as (proc, base):
        client = threading.Thread(target=read, args=(base,))
        client.start()
        assert started.wait(20), "the stream should be under way"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
        client.join(20)
    assert bytes(got) == first + half


@pytest.mark.parametrize("upstream_sends", [b"", b"HTTP/1.1 200 OK\r\nContent-Length: 300\r\n\r\n"])
def test_a_request_the_upstream_has_not_answered_gets_a_503_when_cachegate_stops(
    tmp_path: Path, upstream_sends: bytes
) -> None:
    """Cut by the shutdown before any answer: the client is told why in OpenAI's shape (it got
    the server's bare "Internal Server Error"), and the log and metrics say 503, not 0. Also
    when the upstream sent the headers of a whole answer and none of its body: cachegate held
    them for its first bytes, then sent them, and the client had a 200 with no body."""
    silent = socket.socket()  # takes the connection, never answers (or only its headers)
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    held: list[socket.socket] = []

    def answer_headers() -> None:
        with contextlib.suppress(OSError):
            conn, _ = silent.accept()
            held.append(conn)
            conn.recv(65536)
            conn.sendall(upstream_sends)

    if upstream_sends:
        threading.Thread(target=answer_headers, daemon=True).start()
    log_dir = tmp_path / "logs"
    try:
        upstream = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        with cachegate_process(upstream, log_dir) as (proc, url):
            answers: list[httpx.Response] = []

            def ask() -> None:
                body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
                answers.append(
                    httpx.post(
                        url + "/chat/completions",
                        json=body,
                        headers={"X-Session-Id": "unanswered"},
                        timeout=30,
                    )
                )

            client = threading.Thread(target=ask)
            client.start()
            wait_for(
                lambda: (
                    (log_dir / "unanswered.jsonl").exists()
                    and bool(events(log_dir, "unanswered", "request"))
                ),
                what="the request line",
            )
            if upstream_sends:
                wait_for(lambda: bool(held), what="the upstream's headers")
                time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(20) == 0
            client.join(10)
    finally:
        silent.close()
        for conn in held:
            conn.close()
    (answer,) = answers
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    (response,) = events(log_dir, "unanswered", "response")
    assert response["status"] == 503 and response["interrupted"] is True
    assert response["error"] == error["message"]  # what the client was told


@pytest.mark.parametrize("path", ["chat/completions", "responses"])
def test_a_request_stopped_during_its_upload_is_logged_in_the_session_it_named(
    tmp_path: Path, path: str
) -> None:
    """cachegate stopping while a request's body still arrives: the client gets the 503, and the
    held session the request named has it in its log, as it has a refusal or the client leaving
    at that point (the line was missing: nothing had resolved the session yet). A Responses
    API request got uvicorn's plain-text 500, and no line."""
    log_dir = tmp_path / "logs"
    with (
        run_simulator(SimConfig()) as sim,
        cachegate_process(sim.api_base, log_dir) as (proc, url),
    ):
        first = httpx.post(
            url + "/chat/completions", json=HELLO, headers={"X-Session-Id": "held"}, timeout=30
        )
        assert first.status_code == 200
        port = int(url.split(":")[2].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
            client.sendall(
                f"POST /v1/{path} HTTP/1.1\r\n".encode() + b"host: 127.0.0.1\r\n"
                b"x-session-id: held\r\ncontent-type: application/json\r\n"
                b'content-length: 500\r\n\r\n{"model"'
            )
            time.sleep(0.5)  # the handler is reading the body
            proc.send_signal(signal.SIGINT)
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
        assert proc.wait(20) == 0
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    assert b"server_shutting_down" in answer
    (stopped,) = events(log_dir, "held", "error")
    assert stopped["exchange"] == 2 and stopped["status"] == 503
    assert stopped["forwarded"] is False and "shutting down" in stopped["message"]


def test_a_second_ctrl_c_exits_at_once_cleanly_with_the_cut_stream_logged(
    tmp_path: Path,
) -> None:
    log_dir = tmp_path / "logs"
    with _stalled_stream(log_dir, "twice") as proc:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        began = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
        assert time.monotonic() - began < 4  # not the 5 s grace
        assert proc.stderr is not None
        assert "Traceback" not in proc.stderr.read().decode()
    assert [e["type"] for e in events(log_dir, "twice")] == ["session_meta", "request", "response"]
    response = events(log_dir, "twice", "response")[0]
    assert response["interrupted"] is True and response["error"].startswith(
        "cut: cachegate stopped"
    )


def _stream_until_killed(
    url: str, sid: str, started: threading.Semaphore, headers: dict[str, str] | None = None
) -> int:
    got = 0
    try:
        with httpx.stream(
            "POST",
            url + "/chat/completions",
            json={
                "model": "gpt-4o",
                "stream": True,
                "messages": [{"role": "user", "content": sid}],
            },
            headers={"X-Session-Id": sid, **(headers or {})},
            timeout=30,
        ) as r:
            for chunk in r.iter_raw():
                got += len(chunk)
                if got == len(chunk):
                    started.release()
    except httpx.HTTPError:
        pass
    return got


def test_kill_9_during_32_streams_leaves_every_log_readable(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    sids = [f"crash-{i:02d}" for i in range(32)]
    with run_simulator(SimConfig(chunk_ms=50)) as sim:
        sim.sim.enqueue([parse_script("token " * 400) for _ in sids])
        with cachegate_process(sim.api_base, log_dir) as (proc, url):
            started = threading.Semaphore(0)
            results: dict[str, int] = {}
            threads = [
                threading.Thread(
                    target=lambda s=sid: results.__setitem__(
                        s, _stream_until_killed(url, s, started)
                    )
                )
                for sid in sids
            ]
            for t in threads:
                t.start()
            for _ in sids:
                assert started.acquire(timeout=20), "every stream should be under way"
            # Every session's request line is on disk (the writer is asynchronous).
            wait_for(
                lambda: all(
                    (log_dir / f"{s}.jsonl").exists()
                    and b'"type":"request"' in (log_dir / f"{s}.jsonl").read_bytes()
                    for s in sids
                ),
                what="every request event",
            )
            proc.kill()  # SIGKILL: no shutdown, no flush
            proc.wait(10)
            for t in threads:
                t.join(20)
            assert not any(t.is_alive() for t in threads)
    assert all(results[s] > 0 for s in sids)
    assert sorted(f.name for f in log_dir.iterdir()) == [".cachegate.lock", ".gitignore"] + [
        f"{s}.jsonl" for s in sids
    ]
    files = sorted(log_dir.glob("*.jsonl"))
    torn_total = 0
    for f in files:
        read = read_events(f)
        lines = f.read_bytes().split(b"\n")
        complete, last = lines[:-1], lines[-1]
        for line in complete:
            orjson.loads(line)  # every complete line parses: only a trailing fragment may not
        torn_total += read.torn
        assert read.torn <= 1
        assert last == b"" or read.torn == 1  # a fragment can only be at the very end
        kinds = [e["type"] for e in read.events]
        assert kinds[:2] == ["session_meta", "request"]
        assert "response" not in kinds  # killed mid-stream: nothing finished

    show = run_cli("sessions", "show", "crash-00", "--log-dir", str(log_dir))
    assert show.code == 0, show.err
    assert "crash-00" in show.out
    if torn_total == 0:
        # One os.write per line leaves no torn line; make one as a crash inside a write would.
        with open(log_dir / "crash-00.jsonl", "ab") as fh:
            fh.write(b'{"ts":1700000000.5,"type":"response","exchange":1,"sta')
    show = run_cli("sessions", "show", "crash-00", "--log-dir", str(log_dir))
    assert show.code == 0, show.err
    assert show.out.rstrip().endswith("1 torn line skipped")
    assert (
        run_cli("sessions", "show", "crash-00", "--log-dir", str(log_dir), "--json").json()["torn"]
        == 1
    )
    listing = run_cli("sessions", "list", "--log-dir", str(log_dir), "--json")
    assert listing.code == 0
    assert {s["session"] for s in listing.json()} == set(sids)

    # A new process appending to the torn file starts on a fresh line: nothing more is lost.
    with run_simulator(SimConfig()) as sim2, run_proxy(sim2.api_base, log_dir) as proxy:
        r = httpx.post(
            proxy.base_url + "/chat/completions", json=HELLO, headers={"X-Session-Id": "crash-00"}
        )
        assert r.status_code == 200
        flush(proxy)
    read = read_events(log_dir / "crash-00.jsonl")
    assert read.torn == 1
    assert [e["type"] for e in read.events][-2:] == ["request", "response"]
    assert read.events[-1]["status"] == 200


# --- secrets and metadata mode -------------------------------------------------------------------


def _random(n: int) -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(n))


def test_no_key_or_secret_reaches_any_log_file(sim: RunningSimulator, proxy_factory: Any) -> None:
    api_key = "sk-test-" + _random(40)
    pasted_key = "sk-proj-" + _random(32)
    aws_id = "AKIA" + "".join(secrets.choice(string.ascii_uppercase + "234567") for _ in range(16))
    bearer = _random(24)
    proxy = proxy_factory(sim.api_base)
    client = make_client(
        proxy.base_url, api_key=api_key, default_headers={"X-Session-Id": "secrets-1"}
    )
    text = f"deploy with {pasted_key} and {aws_id} then curl -H 'Authorization: Bearer {bearer}'"
    convo: list[dict[str, Any]] = [{"role": "user", "content": text}]
    reply, _ = chat(client, convo, stream=False)
    assert pasted_key in reply["content"]  # the simulator echoes it back: responses are tested too
    convo += [reply, {"role": "user", "content": f"again: {aws_id}"}]
    reply, _ = chat(client, convo, stream=True)
    assert aws_id in reply["content"]
    # A request the provider refuses is logged too, and redacted the same way.
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": pasted_key}]},
        headers={
            "Authorization": f"Bearer {api_key}",
            "X-Sim-Fault": "500",
            "X-Session-Id": "secrets-1",
        },
    )
    assert r.status_code == 500
    # The simulator did get the key: cachegate forwards it, it only never writes it.
    assert sim.sim.requests[0].headers["authorization"] == f"Bearer {api_key}"
    flush(proxy)
    files = [p for p in proxy.log_dir.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == [".gitignore", "secrets-1.jsonl"]
    for path in (p for p in files if p.suffix == ".jsonl"):
        data = path.read_text()
        for needle in (api_key, api_key[8:], pasted_key, pasted_key[8:], aws_id, bearer):
            assert needle not in data, (path.name, needle[:12])
        assert "[REDACTED]" in data
    requests = events(proxy.log_dir, "secrets-1", "request")
    assert "deploy with [REDACTED] and [REDACTED]" in json.dumps(requests[0]["appended"])
    responses = events(proxy.log_dir, "secrets-1", "response")
    assert [r["status"] for r in responses] == [200, 200, 500]
    assert "[REDACTED]" in responses[0]["message"]["content"]  # the echoed reply, non-streamed
    assert "[REDACTED]" in responses[1]["message"]["content"]  # and assembled from a stream


@pytest.mark.parametrize(
    "header",
    [
        *("x-api-key", "api-key", "x-goog-api-key", "authorization", "?key=", "?code="),
        # a gateway's key (Helicone's, Portkey's, Cloudflare AI Gateway's), which a gateway
        # that refuses it quotes as well
        *("helicone-auth", "x-portkey-api-key", "cf-aig-authorization"),
    ],
)
def test_a_key_of_the_clients_own_that_the_upstream_quotes_is_never_written(
    header: str, scripted: Any, proxy_factory: Any
) -> None:
    """A client with a key of its own in another provider's header (Anthropic's, Azure's,
    Gemini's) or under another scheme, or in the URL's query (Google's ``?key=``, Azure
    Functions' ``?code=``), refused by an upstream that quotes it: no pattern knows the key,
    and the response line wrote it. It is the client's: relayed to it as it came. (A digit in
    it: a query's value is a key only with a letter and a digit, README's rule; a random key of
    letters alone, one run in ~60, read as a word and failed the test.)"""
    key = "k7" + _random(22)
    refusal = {
        "error": {"message": f"Incorrect API key provided: {key}.", "code": "invalid_api_key"}
    }
    _, url = scripted(
        chunks=[json.dumps(refusal).encode()], status=401, content_type=b"application/json"
    )
    proxy = proxy_factory(url)
    in_query = header.startswith("?")
    r = httpx.post(
        proxy.base_url + "/chat/completions" + (header + key if in_query else ""),
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
        headers={
            **({} if in_query else {header: _SCHEMES.get(header, "") + key}),
            "X-Session-Id": "k",
        },
    )
    assert r.status_code == 401 and key in r.text
    flush(proxy)
    data = (proxy.log_dir / "k.jsonl").read_text()
    assert key not in data
    (response,) = events(proxy.log_dir, "k", "response")
    assert response["error"] == "Incorrect API key provided: [REDACTED]."


_SCHEMES = {
    "authorization": "Token ",
    "helicone-auth": "Bearer ",
    "cf-aig-authorization": "Bearer ",
}


def test_a_query_key_is_taken_out_as_sent_and_a_query_word_is_left_alone(
    scripted: Any, proxy_factory: Any
) -> None:
    """An Azure Functions key ends in "==", which a client sends as %3D%3D and the upstream
    quotes so: the decoded key was taken out and the sent one written. And ?token=response
    (no key) took the word out of every line, the log's own field names with it."""
    key = "dKLz9" + _random(40) + "=="  # (a digit in it: a query key has one)
    refusal = {"error": {"message": f"Invalid key in /v1/chat/completions?code={key}"}}
    refusal["error"]["message"] = refusal["error"]["message"].replace("==", "%3D%3D")
    _, url = scripted(
        chunks=[json.dumps(refusal).encode()], status=401, content_type=b"application/json"
    )
    proxy = proxy_factory(url)
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        params={"code": key},
        json=body,
        headers={"X-Session-Id": "q1"},
    )
    assert r.status_code == 401
    dated = {
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "due 2026-12-05T10:00:00Z"}],
    }
    r = httpx.post(
        proxy.base_url + "/chat/completions?token=response&code=2026-12-05T10:00:00Z",
        json=dated,
        headers={"X-Session-Id": "q2"},
    )
    flush(proxy)
    data = (proxy.log_dir / "q1.jsonl").read_text()
    assert key.rstrip("=") not in data and "[REDACTED]" in data
    assert len(events(proxy.log_dir, "q2", "response")) == 1  # (its type still "response")
    assert "[REDACTED]" not in (proxy.log_dir / "q2.jsonl").read_text()


@pytest.mark.parametrize("stream", [False, True])
def test_a_clients_own_key_in_a_tool_output_or_an_answer_is_never_written(
    sim: RunningSimulator, proxy_factory: Any, stream: bool
) -> None:
    """An agent that ran ``env`` sends its own key back (a tool's output, pasted text), and the
    model repeats it: a key of no known shape was written in the request and response lines of
    an exchange that succeeded (only a failed exchange's line was kept clean of it)."""
    key = "Kx" + _random(14) + ":" + _random(16)  # (with a ':' no pattern passes over)
    proxy = proxy_factory(sim.api_base)
    client = make_client(
        proxy.base_url,
        api_key=key,
        # (a client that put its key in its user agent: the meta line records that)
        default_headers={"X-Session-Id": "own", "User-Agent": f"my-agent/1.0 ({key})"},
    )
    convo: list[dict[str, Any]] = [{"role": "user", "content": f"env printed {key} here"}]
    reply, _ = chat(client, convo, stream=stream)
    assert key in reply["content"]  # the simulator echoes it: the answer holds it too
    assert sim.sim.requests[0].headers["authorization"] == f"Bearer {key}"
    flush(proxy)
    data = (proxy.log_dir / "own.jsonl").read_text()
    assert key[:16] not in data and key[17:] not in data
    (request,) = events(proxy.log_dir, "own", "request")
    assert request["appended"][0]["content"] == "env printed [REDACTED] here"
    (response,) = events(proxy.log_dir, "own", "response")
    assert "[REDACTED]" in response["message"]["content"]


@pytest.mark.parametrize("redact_secrets", [True, False])
def test_the_configured_key_of_any_shape_is_never_written(
    sim: RunningSimulator, proxy_factory: Any, redact_secrets: bool
) -> None:
    """A provider key no pattern knows (Groq's ``gsk_``, Gemini's ``AIza``, a plain string),
    echoed by a tool's output: cachegate knows its own key exactly and never writes it, even
    with pattern redaction off; a base URL's user and password are not written either."""
    key = "gsk_" + _random(40)
    base = sim.api_base.replace("http://", "http://someone:hunter2-password@")
    proxy = proxy_factory(
        base,
        {"logging": {"redact_secrets": redact_secrets}},
        environ={"OPENAI_API_KEY": key + "\n"},
    )
    tool_output = f"OPENAI_API_KEY={key}\nHOME=/home/dev"
    r = httpx.post(  # no Authorization: cachegate adds its own key
        proxy.base_url + "/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": tool_output}]},
        headers={"X-Session-Id": "env-dump"},
    )
    assert key in r.json()["choices"][0]["message"]["content"]  # echoed: in the response too
    assert sim.sim.requests[0].headers["authorization"] == f"Bearer {key}"
    flush(proxy)
    data = (proxy.log_dir / "env-dump.jsonl").read_text()
    assert key not in data and key[4:] not in data
    assert "OPENAI_API_KEY=[REDACTED]" in data
    assert "hunter2" not in data and "someone" not in data
    meta = events(proxy.log_dir, "env-dump", "session_meta")[0]
    assert meta["upstream"] == sim.api_base


@pytest.mark.parametrize("bodies", ["full", "metadata"])
def test_no_piece_of_the_configured_key_is_shown_where_an_excerpt_cuts_through_it(
    sim: RunningSimulator, proxy_factory: Any, bodies: str
) -> None:
    """A changed timestamp just before the key in a system prompt: the cache diagnosis's excerpt
    of ~80 characters ends inside the key. Removing the whole key after the cut found nothing to
    remove, and 26 of its 40 characters were written (in either body mode)."""
    key = _random(40)
    proxy = proxy_factory(
        sim.api_base, {"logging": {"bodies": bodies}}, environ={"OPENAI_API_KEY": key}
    )
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "cut-key"})
    for minute in ("10:00", "10:01"):
        system = f"Time {minute}. Deploy with the value that follows: VALUE={key}"
        convo = [{"role": "system", "content": system}, {"role": "user", "content": "go"}]
        chat(client, convo, stream=minute == "10:01")
    flush(proxy)
    data = (proxy.log_dir / "cut-key.jsonl").read_text()
    divergence = events(proxy.log_dir, "cut-key", "response")[1]["divergence"]
    assert divergence["location"] == "system"
    if bodies == "full":
        assert "VALUE=[REDACTED]" in divergence["old"]
    else:  # no text at all: the excerpts' sizes and hashes
        assert set(divergence["old"]) == {"chars", "sha256"}
    pieces = [key[i : i + 8] for i in range(len(key) - 7)]
    assert not [piece for piece in pieces if piece in data]


def test_metadata_mode_keeps_sizes_and_hashes_but_no_message_text(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base, {"logging": {"bodies": "metadata"}})
    client = make_client(proxy.base_url, default_headers={"X-Session-Id": "meta-1"})
    system = {"role": "system", "content": "zanzibar quokka protocol"}
    convo: list[dict[str, Any]] = [system, {"role": "user", "content": "periwinkle marmalade"}]
    reply, _ = chat(client, convo, stream=False)
    convo += [reply, {"role": "user", "content": "obsidian tangerine"}]
    chat(client, convo, stream=True)
    flush(proxy)
    data = (proxy.log_dir / "meta-1.jsonl").read_text()
    for word in (
        "zanzibar",
        "quokka",
        "periwinkle",
        "marmalade",
        "obsidian",
        "tangerine",
        "You said",
    ):
        assert word not in data
    requests = events(proxy.log_dir, "meta-1", "request")
    assert [m["role"] for m in requests[0]["appended"]] == ["system", "user"]
    assert requests[0]["appended"][1]["chars"] == len("periwinkle marmalade")
    assert len(requests[0]["appended"][1]["sha256"]) == 64
    responses = events(proxy.log_dir, "meta-1", "response")
    assert [r["status"] for r in responses] == [200, 200]
    assert responses[1]["message"]["role"] == "assistant"
    assert responses[1]["usage"]["prompt"] == sim.sim.requests[1].usage["prompt_tokens"]
    # replay prints what it has, and says that these are no requests to send again
    replayed = run_cli("sessions", "replay", "meta-1", "--log-dir", str(proxy.log_dir))
    assert replayed.code == 0 and len(replayed.out.splitlines()) == 2
    assert 'logging.bodies = "metadata"' in replayed.err and "cannot be sent again" in replayed.err
