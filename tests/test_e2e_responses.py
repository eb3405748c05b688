"""The Responses API's sessions and audit log end to end: the openai SDK → cachegate → the
simulator, over sockets. A Codex-style agent loop found as one session, its log delta-coded and
replayed to what the provider was sent, stored conversations, Codex CLI's own session header,
the reports, metadata mode and the client's key."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.pairing import DEFAULT_INTERRUPTED_NOTE
from proxy.report import replay_lines
from proxy.simulator import RunningSimulator, SimConfig, run_simulator
from tests.e2e_support import (
    FILE_TEXT,
    PYTEST_OUTPUT,
    asgi_body,
    events,
    run_cli,
    wait_for,
)

TOOLS = [
    {
        "type": "function",
        "name": "exec_command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    }
]
INSTRUCTIONS = "You are a coding agent. Be brief."


@pytest.fixture
def sim() -> Iterator[RunningSimulator]:
    with run_simulator(SimConfig()) as running:
        yield running


def call_reply(call_id: str, cmd: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": cmd}, "id": call_id}]}


def agent_turns(client: Any, sim: RunningSimulator, task: str, rounds: int) -> list[Any]:
    """A Codex-style loop: instructions, tools, the whole ``input`` resent each turn with the
    model's output items and each call's output appended; streamed and not, in turn."""
    sim.sim.enqueue([call_reply(f"call_{task[:3]}_{i}", f"ls {i}") for i in range(rounds)])
    items: list[Any] = [{"type": "message", "role": "user", "content": task}]
    answers = []
    for turn in range(rounds):
        raw = client.responses.with_raw_response.create(
            model="gpt-5",
            instructions=INSTRUCTIONS,
            tools=TOOLS,
            input=items,
            stream=bool(turn % 2),
        )
        answers.append(raw)
        if turn % 2:
            response = next(e.response for e in raw.parse() if e.type == "response.completed")
        else:
            response = raw.parse()
        items += [o.model_dump(exclude_none=True) for o in response.output]
        call = items[-1]
        items.append(
            {"type": "function_call_output", "call_id": call["call_id"], "output": "a\n" * 50}
        )
    return answers


def sent_bodies(sim: RunningSimulator) -> list[dict[str, Any]]:
    return [r.body for r in sim.sim.requests if r.path.endswith("/responses")]


def replayed(log_dir: Any, sid: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in replay_lines(log_dir, sid)]


def test_an_agent_loop_is_one_session_logged_as_deltas_and_replayed_as_sent(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)
    answers = agent_turns(client, sim, "fix the failing test", rounds=4)
    sids = {a.headers["x-cachegate-session"] for a in answers}
    assert len(sids) == 1
    (sid,) = sids
    proxy.settle()
    lines = events(proxy.log_dir, sid)
    assert [e["type"] for e in lines] == ["session_meta"] + ["request", "response"] * 4
    requests = [e for e in lines if e["type"] == "request"]
    assert [r["exchange"] for r in requests] == [1, 2, 3, 4]
    assert all(r["path"] == "/v1/responses" for r in requests)
    # each line after the first carries only what its turn appended: a call and its output
    assert [len(r["appended"]) for r in requests] == [1, 2, 2, 2]
    assert [r["base"] for r in requests[1:]] == [1, 3, 5]
    assert requests[0]["tools"] == TOOLS and "tools" not in requests[1]
    # the instructions, sent every turn, are written once and named after that
    assert requests[0]["params"] == {"instructions": INSTRUCTIONS}
    assert all(r["params"] == {} and r["instructions_from"] == 1 for r in requests[1:])
    responses = [e for e in lines if e["type"] == "response"]
    assert all(r["status"] == 200 and r["finish_reason"] == "tool_calls" for r in responses)
    assert responses[0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"cmd":"ls 0"}'
    assert all(r["usage"]["prompt"] > 0 and r["cost"]["actual"] > 0 for r in responses)
    # replay rebuilds every body the provider was sent
    sent = sent_bodies(sim)
    rebuilt = replayed(proxy.log_dir, sid)
    assert len(rebuilt) == len(sent) == 4
    for again, body in zip(rebuilt, sent, strict=True):
        assert again["path"] == "/v1/responses" and "messages" not in again
        assert again["input"] == body["input"]
        assert {"model": again["model"], **again["params"], "tools": again["tools"]} == {
            k: body[k] for k in ("model", "instructions", "tools")
        }


@pytest.mark.parametrize("shape", ["plain", "typed", "parts"])
def test_a_conversation_opened_with_one_string_goes_on_in_its_session(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any, shape: str
) -> None:
    """``input="…"``, then the same task as an item with the answer and a new message: the
    provider read the first turn's prefix from its cache, but the second turn began a new
    session (no item to be found by), its cost and history split from the first's."""
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)
    task = "Explain what the function parse_config does in this repository. " * 120
    first = client.responses.with_raw_response.create(
        model="gpt-5", instructions=INSTRUCTIONS, input=task, store=False
    )
    answer = [item.model_dump(exclude_none=True) for item in first.parse().output]
    opening: dict[str, Any] = {"role": "user", "content": task}
    if shape == "typed":  # (the item as the SDKs' types write it)
        opening = {"type": "message", **opening}
    elif shape == "parts":
        opening = {"role": "user", "content": [{"type": "input_text", "text": task}]}
    items = [opening, *answer, {"role": "user", "content": "more"}]
    second = client.responses.with_raw_response.create(
        model="gpt-5",
        instructions=INSTRUCTIONS,
        input=items,
        store=False,  # type: ignore[arg-type]
    )
    sid = first.headers["x-cachegate-session"]
    assert second.headers["x-cachegate-session"] == sid
    if shape == "plain":  # (the simulator reads the string as this item)
        assert second.parse().usage.input_tokens_details.cached_tokens > 0
    proxy.settle()
    assert [e["exchange"] for e in events(proxy.log_dir, sid, "request")] == [1, 2]
    # another conversation opened with another string is another session
    other = client.responses.with_raw_response.create(model="gpt-5", input="write the changelog")
    assert other.headers["x-cachegate-session"] != sid


def test_two_agents_at_once_are_two_sessions(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)
    first = agent_turns(client, sim, "fix the failing test", rounds=2)
    second = agent_turns(client, sim, "write the changelog", rounds=2)
    a = {r.headers["x-cachegate-session"] for r in first}
    b = {r.headers["x-cachegate-session"] for r in second}
    assert len(a) == len(b) == 1 and a != b
    proxy.settle()
    for sid in (*a, *b):
        assert [e["exchange"] for e in events(proxy.log_dir, sid, "request")] == [1, 2]


def test_the_same_agent_under_two_keys_is_two_sessions(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """Two users running the same task through one cachegate, each with their own key."""
    proxy = proxy_factory(sim.api_base)
    one = agent_turns(sdk(proxy.base_url, api_key="sk-user-one-0000"), sim, "fix it", rounds=2)
    two = agent_turns(sdk(proxy.base_url, api_key="sk-user-two-1111"), sim, "fix it", rounds=2)
    a = {r.headers["x-cachegate-session"] for r in one}
    b = {r.headers["x-cachegate-session"] for r in two}
    assert len(a) == len(b) == 1 and a != b


def test_the_repaired_input_is_what_the_log_holds_and_replay_gives(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    items = [
        {"role": "user", "content": "list the files"},
        {"type": "function_call", "call_id": "call_ls", "name": "exec_command", "arguments": "{}"},
        {"role": "user", "content": "stop, show me the README instead"},
    ]
    raw = sdk(proxy.base_url).responses.with_raw_response.create(model="gpt-5", input=items)
    assert raw.headers["x-cachegate-repairs"] == "1"
    sid = raw.headers["x-cachegate-session"]
    proxy.settle()
    (request,) = events(proxy.log_dir, sid, "request")
    assert request["repairs"] == [
        {
            "kind": "dangling_call",
            "index": 1,
            "tool_call_id": "call_ls",
            "action": "added a synthetic output for exec_command",
        }
    ]
    note = DEFAULT_INTERRUPTED_NOTE.replace("{name}", "exec_command")
    assert request["appended"][2] == {
        "type": "function_call_output",
        "call_id": "call_ls",
        "output": note,
    }
    (again,) = replayed(proxy.log_dir, sid)
    assert again["input"] == sim.sim.requests[-1].body["input"]
    shown = run_cli("sessions", "show", sid, "--log-dir", str(proxy.log_dir))
    assert "repaired dangling_call at input[1] (call_ls)" in shown.out, shown.out
    rows = run_cli("sessions", "show", sid, "--log-dir", str(proxy.log_dir), "--json")
    assert [r["path"] for r in rows.json()["exchanges"]] == ["/v1/responses"]


def test_a_stored_conversation_stays_in_the_session_of_the_response_it_continues(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """``previous_response_id`` (LangChain's ``use_previous_response_id``, the Agents SDK's
    server-side state): each request carries only what is new, so no history finds the session;
    the response it continues does. A one-string ``input`` is logged and replayed as sent."""
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)
    sim.sim.enqueue(["one", "two", "three", "other"])
    first = client.responses.with_raw_response.create(model="gpt-5", input="hi")
    second = client.responses.with_raw_response.create(
        model="gpt-5", input="and then?", previous_response_id=first.parse().id
    )
    with client.responses.with_streaming_response.create(
        model="gpt-5",
        input=[{"role": "user", "content": "last"}],
        previous_response_id=second.parse().id,
        stream=True,
    ) as third:
        assert b"response.completed" in third.read()
    other = client.responses.with_raw_response.create(model="gpt-5", input="hello")
    sid = first.headers["x-cachegate-session"]
    assert second.headers["x-cachegate-session"] == third.headers["x-cachegate-session"] == sid
    # another opening, no continuation: another conversation
    assert other.headers["x-cachegate-session"] != sid
    proxy.settle()
    assert [e["exchange"] for e in events(proxy.log_dir, sid, "request")] == [1, 2, 3]
    rebuilt = replayed(proxy.log_dir, sid)
    assert rebuilt[0]["params"] == {"input": "hi"} and "input" not in rebuilt[0]
    assert rebuilt[1]["params"] == {
        "input": "and then?",
        "previous_response_id": first.parse().id,
    }
    assert rebuilt[2]["input"] == [{"role": "user", "content": "last"}]
    assert [r["message"]["content"] for r in events(proxy.log_dir, sid, "response")] == [
        "one",
        "two",
        "three",
    ]


def test_a_conversation_opened_with_one_string_is_found_by_its_retry_and_next_turns(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """A one-string ``input`` never joined a session, and its session kept no history: the
    SDK's retry after a 500 began a second session; of two agents that opened with the same
    task, the first one's next turn went on in the second's (the latest seen of two that
    shared nothing with it). Now it is found as chat's one user message is: the retry in its
    attempt's session, agents that open with the same task in one (as on chat)."""
    proxy = proxy_factory(sim.api_base, clock=lambda: sim.sim.now)
    retrying = sdk(proxy.base_url, max_retries=1)
    sim.sim.enqueue([{"fault": "500"}, "Retried."])
    answer = retrying.responses.with_raw_response.create(
        model="gpt-5", instructions=LONG_INSTRUCTIONS, input="Fix the failing test."
    )
    assert answer.parse().output_text == "Retried." and len(sim.sim.requests) == 2
    proxy.settle()
    sid = answer.headers["x-cachegate-session"]
    assert [e["status"] for e in events(proxy.log_dir, sid, "response")] == [500, 200]
    assert len([p for p in proxy.log_dir.iterdir() if p.suffix == ".jsonl"]) == 1

    client = sdk(proxy.base_url)
    task = "What does this repository do?"
    first = client.responses.with_raw_response.create(
        model="gpt-5", instructions=LONG_INSTRUCTIONS, input=task
    )
    other = client.responses.with_raw_response.create(
        model="gpt-5", instructions="You plan. " + LONG_INSTRUCTIONS, input=task
    )
    agent = first.headers["x-cachegate-session"]
    assert agent != sid and other.headers["x-cachegate-session"] == agent
    items = [
        {"role": "user", "content": task},
        *(o.model_dump(exclude_none=True) for o in first.parse().output),
        {"role": "user", "content": "go on"},
    ]
    later = client.responses.with_raw_response.create(
        model="gpt-5", instructions=LONG_INSTRUCTIONS, input=items
    )
    assert later.headers["x-cachegate-session"] == agent
    proxy.settle()
    assert len(events(proxy.log_dir, agent, "response")) == 3


def test_instructions_dropped_in_a_turn_are_named_as_such(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """A turn that sends no ``instructions`` where the one before had them: the change was
    named ``input[0]`` (a user message that had not changed, with the instructions as its old
    text); it is the instructions."""
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url, default_headers={"X-Session-Id": "dropped"})
    items: list[Any] = [{"role": "user", "content": "Fix the failing test.\n" + FILE_TEXT}]
    for turn, instructions in enumerate((LONG_INSTRUCTIONS, LONG_INSTRUCTIONS, None)):
        extra = {"instructions": instructions} if instructions else {}
        answer = client.responses.create(model="gpt-5", input=items, **extra)
        items = [
            *items,
            *(o.model_dump(exclude_none=True) for o in answer.output),
            {"role": "user", "content": f"go on {turn}"},
        ]
    proxy.settle()
    last = events(proxy.log_dir, "dropped", "response")[-1]
    assert last["divergence"]["location"] == "instructions"
    assert last["divergence"]["index"] is None
    assert (last["cache"]["cause"], last["cache"]["location"]) == (
        "prefix_rewrite",
        "instructions",
    )


def test_a_stored_prompts_variables_changed_are_named_as_the_miss(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """A reusable prompt (``prompt``: a template's id, version and variables, rendered before
    the instructions) whose variables changed between turns: the miss from the prompt's start
    was ``unexplained``, with no divergence; it is that parameter."""
    proxy = proxy_factory(sim.api_base, clock=lambda: sim.sim.now)
    client = sdk(proxy.base_url, default_headers={"X-Session-Id": "stored-prompt"})
    items: list[Any] = [{"role": "user", "content": "Fix the failing test.\n" + FILE_TEXT}]
    for customer in ("Alice", "Alice", "Bob"):
        prompt = {"id": "pmpt_abc123", "version": "2", "variables": {"customer": customer}}
        answer = client.responses.create(
            model="gpt-5", prompt=prompt, instructions=LONG_INSTRUCTIONS, input=items
        )
        items = [
            *items,
            *(o.model_dump(exclude_none=True) for o in answer.output),
            {"role": "user", "content": "go on"},
        ]
        sim.sim.advance(10)
    usages = [r.usage for r in sim.sim.requests]
    assert usages[1]["input_tokens_details"]["cached_tokens"] > 2000
    assert usages[2]["input_tokens_details"]["cached_tokens"] == 0  # (the scenario's miss)
    proxy.settle()
    last = events(proxy.log_dir, "stored-prompt", "response")[-1]
    assert (last["cache"]["cause"], last["cache"]["location"]) == (
        "params_changed",
        "params.prompt",
    )
    assert last["cache"]["waste"] > 2000
    assert (last["divergence"]["location"], last["divergence"]["field"]) == ("params", "prompt")
    assert "Alice" in last["divergence"]["old"] and "Bob" in last["divergence"]["new"]
    show = run_cli("sessions", "show", "stored-prompt", "--log-dir", str(proxy.log_dir)).out
    assert f"{last['cache']['waste']:,} params_changed@params.prompt" in show


@pytest.mark.parametrize("form", ["plain", "typed", "input_text", "untyped_input_text"])
def test_a_conversation_opened_with_one_string_is_accounted_as_it_goes_on_in_items(
    form: str, sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """Opened with ``input="…"``, sent on as items, the opening one typed (``"type":
    "message"``, an ``input_text`` part, or that part alone: the type is optional, and the
    Vercel AI SDK leaves it out): the turn was accounted as a new conversation, nothing
    expected, its miss (its instructions rewritten, an expiry) unreported."""
    proxy = proxy_factory(sim.api_base, clock=lambda: sim.sim.now)
    client = sdk(proxy.base_url)
    task = "Fix the failing test."
    first = client.responses.create(model="gpt-5", instructions=LONG_INSTRUCTIONS, input=task)
    opening: dict[str, Any] = {"role": "user", "content": task}
    if form in ("typed", "input_text"):
        opening["type"] = "message"
    if form.endswith("input_text"):
        opening["content"] = [{"type": "input_text", "text": task}]
    items = [
        opening,
        *(o.model_dump(exclude_none=True) for o in first.output),
        {"role": "user", "content": "go on"},
    ]
    sim.sim.advance(15)
    for instructions in (LONG_INSTRUCTIONS, "Now: 12:01. " + LONG_INSTRUCTIONS):
        client.responses.create(model="gpt-5", instructions=instructions, input=items)
        items = [*items, {"role": "user", "content": "and then?"}]
        sim.sim.advance(15)
    proxy.settle()
    (log,) = [p for p in proxy.log_dir.iterdir() if p.suffix == ".jsonl"]
    _first, carried, rewritten = (
        r.get("cache") for r in events(proxy.log_dir, log.stem, "response")
    )
    assert carried is not None and carried["expected"] > 1000 and carried["waste"] == 0, carried
    assert rewritten is not None and rewritten["waste"] > 1000, rewritten
    assert (rewritten["cause"], rewritten["location"]) == ("prefix_rewrite", "instructions")


def test_a_stream_the_client_cut_is_continued_in_its_session(proxy_factory: Any) -> None:
    """A ``background`` stream cut once its first event came (OpenAI's way to resume a long
    reasoning run), then continued by ``previous_response_id``, with no session header: the
    response's id was read only from the stream's last event, which never came, so the
    continuation began a session of its own (its log, its accounting)."""
    with run_simulator(SimConfig(chunk_ms=200)) as slow:
        proxy = proxy_factory(slow.api_base)
        body = {
            "model": "gpt-5",
            "input": [{"role": "user", "content": "Think long about the failing test."}],
            "stream": True,
            "store": True,
            "background": True,
        }
        slow.sim.enqueue(["a long answer " * 20])
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", proxy.base_url + "/responses", json=body) as r:
                session = r.headers["x-cachegate-session"]
                seen = b""
                for piece in r.iter_raw():
                    seen += piece
                    if b"response.created" in seen and b"\n\n" in seen:
                        break
            first = orjson.loads(seen.split(b"data: ", 1)[1].split(b"\n", 1)[0])
            assert first["type"] == "response.created"
            wait_for(lambda: proxy.metric("cachegate_client_disconnects_total") == 1)
            again = client.post(
                proxy.base_url + "/responses",
                json={
                    "model": "gpt-5",
                    "previous_response_id": first["response"]["id"],
                    "input": [{"role": "user", "content": "go on"}],
                },
            )
        assert again.headers["x-cachegate-session"] == session


@pytest.mark.parametrize("cut_at", ["response.created", "function_call", None])
def test_a_turn_after_ctrl_c_in_a_streamed_answer_with_calls_is_answered_not_refused(
    cut_at: str | None, proxy_factory: Any, sdk: Any
) -> None:
    """Ctrl+C while a streamed answer with two parallel calls came, then the next turn by
    ``previous_response_id`` (the Agents SDK's way): cachegate knew only the calls the client
    had seen before it left (none, cut at the first event), and the provider, which stored the
    whole answer, refused the turn (``No tool output found for function call …``) and every
    one after. The calls it stored are asked of it: each gets a synthetic output."""
    tools = [
        {"type": "function", "name": name, "parameters": {"type": "object", "properties": {}}}
        for name in ("run_shell", "read_file")
    ]
    calls = [{"name": "run_shell", "arguments": {}}, {"name": "read_file", "arguments": {}}]
    with run_simulator(SimConfig(chunk_ms=30)) as slow:
        proxy = proxy_factory(slow.api_base)
        client = sdk(proxy.base_url)
        slow.sim.enqueue([{"content": "Let me check. " * 20, "tool_calls": calls}])
        stream = client.responses.create(model="gpt-4o", input="fix it", tools=tools, stream=True)
        response_id = None
        for event in stream:
            if event.type == "response.created":
                response_id = event.response.id
            item = getattr(event, "item", None)
            if cut_at is not None and cut_at in (event.type, getattr(item, "type", None)):
                break
        stream.close()
        if cut_at is not None:
            wait_for(lambda: proxy.metric("cachegate_client_disconnects_total") == 1)
        proxy.settle()
        for text in ("never mind, do X", "and Y"):  # (the answer continued twice)
            asked = client.responses.with_raw_response.create(
                model="gpt-4o",
                previous_response_id=response_id,
                tools=tools,
                input=[{"role": "user", "content": text}],
            )
            assert asked.status_code == 200
            assert asked.headers["x-cachegate-repairs"] == "2"
            sent = slow.sim.requests[-1].body["input"]
            assert [item.get("type") for item in sent] == [
                "function_call_output",
                "function_call_output",
                None,
            ]
            # the answer was asked of the provider only where its stream was cut, and once
            asked_for = [r for r in slow.sim.requests if r.method == "GET"]
            assert len(asked_for) == (0 if cut_at is None else 1)


def test_a_cut_answer_the_provider_does_not_give_back_leaves_the_turn_as_it_was(
    proxy_factory: Any, sdk: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the provider does not give back the answer whose stream was cut (a gateway with
    no such route, an answer not stored: a 404), the turn goes on paired on the calls relayed,
    said on stderr, and the provider is not asked again for it."""
    caplog.set_level(logging.INFO, logger="proxy.app")
    with run_simulator(SimConfig(chunk_ms=30)) as slow:
        proxy = proxy_factory(slow.api_base)
        client = sdk(proxy.base_url)
        slow.sim.enqueue([{"content": "Let me check. " * 20, "tool_calls": [{"name": "f"}]}])
        stream = client.responses.create(model="gpt-4o", input="fix it", stream=True)
        response_id = next(iter(stream)).response.id  # type: ignore[union-attr]
        stream.close()
        wait_for(lambda: proxy.metric("cachegate_client_disconnects_total") == 1)
        proxy.settle()
        slow.sim.reset()  # (the provider keeps nothing of it now)
        for text in ("go on", "and on"):
            asked = client.responses.with_raw_response.create(
                model="gpt-4o", previous_response_id=response_id, input=text
            )
            assert asked.status_code == 200
        gets = [r.status for r in slow.sim.requests if r.method == "GET"]
        assert gets == [404]
    said = [r.message for r in caplog.records if "stream its client cut" in r.message]
    assert len(said) == 1 and "answered 404" in said[0]


class _SlowToGiveBack:
    """An upstream that streams an answer's first event, then holds the rest (its client cuts
    it there), and gives the stored answer back on ``GET /v1/responses/{id}`` only after
    ``delay_s``; it records the requests it saw."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.seen: list[tuple[str, str, float]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        import asyncio
        import time

        if scope["type"] != "http":
            return
        body = await asgi_body(receive)
        self.seen.append((scope["method"], scope["path"], time.monotonic()))
        calls = [
            {"type": "function_call", "id": f"fc_{n}", "call_id": f"call_{n}", "name": "f",
             "arguments": "{}", "status": "completed"}
            for n in ("a", "b")
        ]  # fmt: skip
        answer = {"id": "resp_cut", "object": "response", "status": "completed", "output": calls}
        if scope["method"] == "GET":
            await asyncio.sleep(self.delay_s)
            head = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": orjson.dumps(answer)})
            return
        head = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        if orjson.loads(body).get("previous_response_id"):
            done = {"type": "response.completed", "response": {**answer, "output": []}}
            await send(
                {"type": "http.response.body", "body": b"data: " + orjson.dumps(done) + b"\n\n"}
            )
            return
        created = {"type": "response.created", "response": {**answer, "status": "in_progress"}}
        event = b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n"
        await send({"type": "http.response.body", "body": event, "more_body": True})
        await asyncio.sleep(30)  # (the rest never comes before the client cuts it)


@pytest.mark.parametrize("patient", [False, True])
def test_a_turn_that_waits_on_a_cut_answer_s_calls_is_the_providers_wait(
    patient: bool, proxy_factory: Any
) -> None:
    """While cachegate asked the provider for a cut answer's calls, a client that gave up was
    not heard: its turn went to the provider seconds after it left (a billed turn nobody
    reads). And a client that waited had that wait counted as cachegate's own overhead."""
    import time

    from proxy.serving import ServerThread

    upstream = _SlowToGiveBack(delay_s=2.0)
    with ServerThread(upstream) as server:
        proxy = proxy_factory(server.url + "/v1")
        body = {"model": "gpt-4o", "input": "fix it", "stream": True}
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", proxy.base_url + "/responses", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break
            wait_for(lambda: proxy.metric("cachegate_client_disconnects_total") == 1)
            proxy.settle()
            turn = {"model": "gpt-4o", "previous_response_id": "resp_cut", "input": "go on"}
            if patient:
                answer = client.post(proxy.base_url + "/responses", json={**turn, "stream": True})
                assert answer.status_code == 200
                assert answer.headers["x-cachegate-repairs"] == "2"
                proxy.settle()
                overhead = proxy.metric(
                    "cachegate_proxy_overhead_seconds_sum", {"route": "responses"}
                )
                assert overhead < 1.0  # (the 2 s the provider took is not cachegate's)
                return
            with pytest.raises(httpx.ReadTimeout):
                client.post(proxy.base_url + "/responses", json=turn, timeout=0.5)
        time.sleep(3.0)  # (past the provider's answer to the GET)
        assert [method for method, _, _ in upstream.seen] == ["POST", "GET"]
        wait_for(lambda: proxy.metric("cachegate_client_disconnects_total") == 2)


def test_a_stream_the_client_cut_logs_the_part_of_the_answer_it_had(
    proxy_factory: Any, sdk: Any
) -> None:
    """The openai SDK's stream closed after a few words (Esc in Codex): the log's message was
    ``null``, where an interrupted chat stream's holds what the client had."""
    with run_simulator(SimConfig(chunk_ms=30)) as slow:
        proxy = proxy_factory(slow.api_base)
        client = sdk(proxy.base_url, default_headers={"X-Session-Id": "cut-words"})
        slow.sim.enqueue(["alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"])
        stream = client.responses.create(model="gpt-5", input="say the letters", stream=True)
        had = ""
        for event in stream:
            if event.type == "response.output_text.delta":
                had += event.delta
            if len(had) > 20:
                break
        stream.close()
        wait_for(lambda: proxy.metric("cachegate_client_disconnects_total") == 1)
        proxy.settle()
        (line,) = events(proxy.log_dir, "cut-words", "response")
    assert line["interrupted"] is True
    logged = line["message"]["content"]
    assert isinstance(logged, str) and logged.startswith(had), (logged, had)
    assert len(logged) < len("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu")


def test_a_continuation_leaves_the_history_its_session_was_found_by(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """With no session header: a turn, a ``previous_response_id`` turn (in the first's session),
    then the whole history sent again (a client that falls back from stored responses). The
    continuation had made the session a named one, its history the continuation's one item:
    the whole-history turn began another session, with nothing expected of the cache."""
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)
    sim.sim.enqueue(["one", "two", "three"])
    opening = [{"role": "user", "content": "Fix the failing test in parser.py, one change only."}]
    first = client.responses.with_raw_response.create(model="gpt-5", input=opening)
    answer = first.parse()
    second = client.responses.with_raw_response.create(
        model="gpt-5",
        input=[{"role": "user", "content": "and then?"}],
        previous_response_id=answer.id,
    )
    history = [
        *opening,
        *(item.model_dump(exclude_none=True) for item in answer.output),
        {"role": "user", "content": "and then?"},
        *(item.model_dump(exclude_none=True) for item in second.parse().output),
        {"role": "user", "content": "now run the tests"},
    ]
    third = client.responses.with_raw_response.create(model="gpt-5", input=history)
    sid = first.headers["x-cachegate-session"]
    assert second.headers["x-cachegate-session"] == sid
    assert third.headers["x-cachegate-session"] == sid


@pytest.mark.parametrize("conversation", ["conv_68a1b2", {"id": "conv_68a1b2"}])
def test_a_conversation_object_names_the_session(
    scripted: Any, proxy_factory: Any, conversation: Any
) -> None:
    """The Conversations API: the conversation's id is the session's (across restarts, and
    whatever the items of each request)."""
    answer = {"id": "resp_1", "object": "response", "status": "completed", "output": []}
    upstream, base = scripted(chunks=[orjson.dumps(answer)], content_type=b"application/json")
    proxy = proxy_factory(base)
    for text in ("first", "second"):
        sent = httpx.post(
            proxy.base_url + "/responses",
            json={"model": "gpt-5", "conversation": conversation, "input": text},
        )
        assert sent.status_code == 200 and sent.headers["x-cachegate-session"] == "conv_68a1b2"
    proxy.settle()
    assert len(upstream.requests) == 2
    assert [e["exchange"] for e in events(proxy.log_dir, "conv_68a1b2", "request")] == [1, 2]


def test_codex_clis_session_header_names_the_session(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """Codex CLI sends its session's UUID as ``session_id`` on every request: two of its
    conversations that start alike stay apart, and a chat request with it joins too."""
    proxy = proxy_factory(sim.api_base)
    uuid = "019a7c2e-5b7d-7a31-9c4e-2f0d1e8a6b55"
    client = sdk(proxy.base_url, default_headers={"session_id": uuid})
    raw = client.responses.with_raw_response.create(model="gpt-5", input="hi")
    assert raw.headers["x-cachegate-session"] == uuid
    chat = client.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.headers["x-cachegate-session"] == uuid
    proxy.settle()
    assert [e["path"] for e in events(proxy.log_dir, uuid, "request")] == [
        "/v1/responses",
        "/v1/chat/completions",
    ]


def test_the_reports_show_a_responses_session(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    answers = agent_turns(sdk(proxy.base_url), sim, "fix the failing test", rounds=3)
    sid = answers[0].headers["x-cachegate-session"]
    proxy.settle()
    usages = [e["usage"] for e in events(proxy.log_dir, sid, "response")]
    listed = run_cli("sessions", "list", "--log-dir", str(proxy.log_dir), "--json")
    assert listed.code == 0, listed.err
    (row,) = json.loads(listed.out)
    assert row["session"] == sid and row["exchanges"] == 3 and row["model"] == "gpt-5"
    assert row["tokens_in"] == sum(u["prompt"] for u in usages) > 0
    assert row["tokens_out"] == sum(u["completion"] for u in usages) > 0
    shown = run_cli("sessions", "show", sid, "--log-dir", str(proxy.log_dir), "--json")
    assert shown.code == 0, shown.err
    rows = json.loads(shown.out)["exchanges"]
    assert [r["exchange"] for r in rows] == [1, 2, 3]
    cost = run_cli("sessions", "cost", sid, "--log-dir", str(proxy.log_dir), "--json")
    assert cost.code == 0, cost.err
    paid = [e["cost"]["actual"] for e in events(proxy.log_dir, sid, "response")]
    said = json.loads(cost.out)
    assert said["priced_exchanges"] == 3 and said["no_usage"] == 0
    assert said["actual"] == pytest.approx(sum(paid)) and said["actual"] > 0


def test_metadata_mode_keeps_no_text_of_a_responses_session(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    proxy = proxy_factory(sim.api_base, {"logging": {"bodies": "metadata"}})
    client = sdk(proxy.base_url)
    sim.sim.enqueue(["the secret plan is ready", "noted"])
    first = client.responses.with_raw_response.create(
        model="gpt-5",
        instructions="confidential instructions",
        input=[{"role": "user", "content": "confidential task"}],
    )
    client.responses.create(
        model="gpt-5", input="confidential follow-up", previous_response_id=first.parse().id
    )
    proxy.settle()
    text = (proxy.log_dir / f"{first.headers['x-cachegate-session']}.jsonl").read_text()
    assert "confidential" not in text and "secret plan" not in text
    assert text.count('"sha256"') >= 4  # the items, instructions, string input, answer


@pytest.mark.parametrize("stream", [False, True])
def test_the_clients_own_key_in_an_item_is_never_written(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any, stream: bool
) -> None:
    """An agent that ran ``env``: its tool output holds the key it sends cachegate."""
    key = "sk-own-" + "Zq7" * 12
    proxy = proxy_factory(sim.api_base, {"logging": {"redact_secrets": False}})
    client = sdk(proxy.base_url, api_key=key)
    items = [
        {"role": "user", "content": "print the environment"},
        {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": f"OPENAI_API_KEY={key}\n"},
    ]
    raw = client.responses.with_raw_response.create(model="gpt-5", input=items, stream=stream)
    assert sim.sim.requests[-1].body["input"][2]["output"].endswith(key + "\n")
    proxy.settle()
    written = (proxy.log_dir / f"{raw.headers['x-cachegate-session']}.jsonl").read_text()
    assert '"function_call_output"' in written and key not in written


def test_a_key_in_the_query_or_a_refused_requests_headers_is_never_written(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """The client's own key, with no pattern any secret scan knows, in the URL's query
    (Gemini's ``?key=``) or in its headers: taken out of its chat exchanges' lines, but the
    Responses route's were written with it whole (its request's items and user agent, and a
    strict refusal's diagnosis of a call id holding it, logged before its keys were known)."""
    key = "QSKEYabcd1234efgh5678ijkl9012mnop"
    proxy = proxy_factory(sim.api_base, {"logging": {"redact_secrets": False}})
    said = {"model": "gpt-5", "input": f"my key is {key}"}
    headers = {"X-Session-Id": "by-query", "User-Agent": f"tool/1 ({key})"}
    answer = httpx.post(f"{proxy.base_url}/responses?key={key}", json=said, headers=headers)
    assert answer.status_code == 200
    assert sim.sim.requests[-1].body["input"] == f"my key is {key}"  # (sent as it was)
    call = {"type": "function_call", "call_id": f"call_{key}", "name": "f", "arguments": "{}"}
    refused = httpx.post(
        f"{proxy.base_url}/responses",
        json={"model": "gpt-5", "input": [call]},
        headers={
            "Authorization": f"Bearer {key}",
            "User-Agent": f"agent/1.0 (token {key})",
            "X-Session-Id": "by-header",
            "X-Cachegate-Strict": "true",
        },
    )
    assert refused.status_code == 400 and "strict pairing" in refused.text
    proxy.settle()
    for sid in ("by-query", "by-header"):
        written = (proxy.log_dir / f"{sid}.jsonl").read_text()
        assert key not in written and "[REDACTED]" in written


def test_with_repair_off_a_responses_request_is_relayed_unread_and_logged_nowhere(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    proxy = proxy_factory(sim.api_base, {"pairing": {"repair": False}})
    raw = sdk(proxy.base_url).responses.with_raw_response.create(model="gpt-5", input="hi")
    assert raw.status_code == 200 and "x-cachegate-session" not in raw.headers
    proxy.settle()
    assert [p.name for p in proxy.log_dir.iterdir() if p.suffix == ".jsonl"] == []
    assert proxy.metric("cachegate_tokens_total", {"model": "gpt-5", "kind": "prompt"}) > 0
    # counted under the model its answer names; an error answer names none: under "other"
    # (its request's model is not read), as the README says
    refused = httpx.post(
        proxy.base_url + "/responses",
        json={"model": "gpt-5", "input": "hi"},
        headers={"X-Sim-Fault": "429"},
    )
    assert refused.status_code == 429
    requests = "cachegate_requests_total"
    assert proxy.metric(requests, {"route": "responses", "model": "gpt-5", "status": "200"}) == 1
    assert proxy.metric(requests, {"route": "responses", "model": "gpt-5", "status": "429"}) == 0
    assert proxy.metric(requests, {"route": "responses", "model": "other", "status": "429"}) == 1


def test_a_compressed_history_counts_in_the_sessions_memory_as_decoded(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Codex CLI signed in with ChatGPT sends every request in zstd: its history is held
    decoded (the session's items, the log's bases), ~100 times its bytes on the wire here."""
    import zstandard

    proxy = proxy_factory(sim.api_base)
    items = [{"role": "user", "content": "fix it"}]
    items += [
        {"type": "function_call_output", "call_id": f"c{i}", "output": "line of output\n" * 200}
        for i in range(40)
    ]
    items[1:1] = [{"type": "function_call", "call_id": "c0", "name": "f", "arguments": "{}"}]
    body = orjson.dumps({"model": "gpt-5", "input": items})
    packed = zstandard.ZstdCompressor().compress(body)
    assert len(packed) * 50 < len(body)
    answer = httpx.post(
        proxy.base_url + "/responses",
        content=packed,
        headers={"content-encoding": "zstd", "content-type": "application/json"},
    )
    assert answer.status_code == 200, answer.text
    proxy.settle()
    assert httpx.get(proxy.url + "/metrics").is_success  # (the gauges are set as scraped)
    assert proxy.metric("cachegate_sessions") == 1
    assert proxy.metric("cachegate_sessions_memory_bytes") >= 2 * len(body)


# --- cache accounting -----------------------------------------------------------------------------

LONG_INSTRUCTIONS = "You are Codex, a coding agent working in a repository. " + " ".join(
    f"Rule {i}: keep the change small, run the tests, and say what you did." for i in range(120)
)


def test_a_codex_sessions_cache_misses_are_accounted_with_their_cause_and_place(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """The chat route's reference scenario, over the Responses API: an expiry after an idle
    gap, an earlier tool output trimmed by the client, the time put into the instructions.
    Each miss is named as the provider's cache missed it, in the request's own terms."""
    proxy = proxy_factory(
        sim.api_base,
        {"models": {"gpt-5": {"cache_ttl_s": 300}}},
        clock=lambda: sim.sim.now,
    )
    client = sdk(proxy.base_url, default_headers={"X-Session-Id": "codex-ref"})
    sim.sim.enqueue(
        [
            call_reply("call_read", "cat app.py"),
            "The bug is in handler_7.",
            call_reply("call_test", "pytest"),
            "All tests pass now.",
            "Changelog updated.",
            "Summary: fixed handler_7.",
        ]
    )
    items: list[Any] = [{"role": "user", "content": "Fix the failing handler."}]
    instructions = LONG_INSTRUCTIONS

    def turn(*follow: dict[str, Any], stream: bool) -> None:
        raw = client.responses.with_raw_response.create(
            model="gpt-5", instructions=instructions, tools=TOOLS, input=items, stream=stream
        )
        assert raw.headers["x-cachegate-session"] == "codex-ref"
        if stream:
            response = next(e.response for e in raw.parse() if e.type == "response.completed")
        else:
            response = raw.parse()
        items.extend(o.model_dump(exclude_none=True) for o in response.output)
        items.extend(follow)

    output = {"type": "function_call_output", "call_id": "call_read", "output": FILE_TEXT}
    turn(output, stream=False)  # 1
    sim.sim.advance(20)
    turn({"role": "user", "content": "Go ahead and fix it."}, stream=True)  # 2
    sim.sim.advance(38 * 60)
    turn(  # 3, after a 38-minute idle: the provider's 300 s cache is gone
        {"type": "function_call_output", "call_id": "call_test", "output": PYTEST_OUTPUT},
        stream=False,
    )
    sim.sim.advance(20)
    turn({"role": "user", "content": "Now update the changelog."}, stream=True)  # 4
    sim.sim.advance(20)
    assert items[2]["call_id"] == "call_read"  # 5, the read_file output trimmed by the client
    items[2] = {**items[2], "output": FILE_TEXT[:1500] + "\n[... output trimmed ...]"}
    turn({"role": "user", "content": "Summarize what you did."}, stream=False)
    sim.sim.advance(20)
    instructions = LONG_INSTRUCTIONS + "\nCurrent time: 2025-03-14T09:26:53Z"  # 6
    turn(stream=True)

    usages = [r.usage for r in sim.sim.requests]
    assert len(usages) == 6 and all(u is not None for u in usages)
    reads = [u["input_tokens_details"]["cached_tokens"] for u in usages]
    # The scenario is what it claims to be: rounds 3, 5 and 6 miss much of their prefix.
    assert reads[0] == 0 and reads[1] > 2000 and reads[3] > 2000
    assert reads[2] == 0 and reads[4] + 1024 < usages[3]["input_tokens"]
    assert reads[5] + 1024 < usages[4]["input_tokens"]  # (the instructions' start still read)

    proxy.settle()
    responses = events(proxy.log_dir, "codex-ref", "response")
    caches = [r["cache"] for r in responses]
    assert [c["read"] for c in caches] == reads
    assert [(c["cause"], c["location"]) for c in caches] == [
        (None, None),
        (None, None),
        ("ttl_expired", None),
        (None, None),
        ("prefix_rewrite", "input[2].output"),
        ("prefix_rewrite", "instructions"),
    ]
    assert caches[2]["waste"] == usages[1]["input_tokens"]  # all it had sent before
    assert caches[0]["waste"] == caches[1]["waste"] == caches[3]["waste"] == 0
    assert caches[4]["waste"] > 1024 and caches[5]["waste"] > 1024
    trimmed, timed = responses[4]["divergence"], responses[5]["divergence"]
    assert (trimmed["location"], trimmed["index"], trimmed["field"]) == ("input", 2, "output")
    assert timed["location"] == "instructions" and timed["index"] is None
    assert timed["volatile"] is True and timed["volatile_kind"] == "timestamp"
    assert "divergence" not in responses[2]  # an idle gap rewrites nothing

    show = run_cli("sessions", "show", "codex-ref", "--log-dir", str(proxy.log_dir)).out
    assert f"{caches[4]['waste']:,} prefix_rewrite@input[2].output" in show
    assert f"{caches[5]['waste']:,} prefix_rewrite@instructions" in show
    cost = run_cli("sessions", "cost", "codex-ref", "--log-dir", str(proxy.log_dir), "--json")
    assert cost.json()["waste_by_cause"] == {
        "ttl_expired": caches[2]["waste"],
        "prefix_rewrite": caches[4]["waste"] + caches[5]["waste"],
    }
    m = proxy.metric
    waste = {"model": "gpt-5", "cause": "prefix_rewrite"}
    assert m("cachegate_cache_waste_tokens_total", waste) == caches[4]["waste"] + caches[5]["waste"]
    assert m("cachegate_prefix_rewrites_total", {"location": "messages"}) == 1
    assert m("cachegate_prefix_rewrites_total", {"location": "system"}) == 1
    paid = sum(r["cost"]["actual"] for r in responses)
    assert m("cachegate_cost_usd_total", {"model": "gpt-5", "kind": "actual"}) == pytest.approx(
        paid
    )


def test_an_edited_orphan_output_is_named_by_its_own_field(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """An output that answers no call (the repair sends it as a user message), edited by the
    client: the miss was placed at ``input[2].content``, the user message's field; the
    client's item has no ``content``, it changed its ``output``."""
    proxy = proxy_factory(sim.api_base, clock=lambda: sim.sim.now)
    client = sdk(proxy.base_url, default_headers={"X-Session-Id": "orphan-edit"})
    items: list[Any] = [
        {"role": "user", "content": "Fix the failing handler."},
        {"role": "user", "content": "Here is what the last run printed."},
        {"type": "function_call_output", "call_id": "call_lost", "output": FILE_TEXT},
        {"role": "user", "content": "Go on."},
    ]
    for turn in range(3):
        if turn == 2:
            items[2] = {**items[2], "output": "(re-run) " + FILE_TEXT}  # (as long: a miss)
        raw = client.responses.with_raw_response.create(
            model="gpt-5", instructions=LONG_INSTRUCTIONS, input=items
        )
        assert raw.headers["x-cachegate-repairs"] == "1"
        items += [o.model_dump(exclude_none=True) for o in raw.parse().output]
        items.append({"role": "user", "content": f"And then ({turn})?"})
        sim.sim.advance(15)
    proxy.settle()
    edited = events(proxy.log_dir, "orphan-edit", "response")[-1]
    assert edited["cache"]["cause"] == "prefix_rewrite"
    assert edited["cache"]["location"] == "input[2].output"
    divergence = edited["divergence"]
    assert (divergence["location"], divergence["index"], divergence["field"]) == (
        "input",
        2,
        "output",
    )


def test_a_long_codex_session_with_tool_rounds_wastes_nothing(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    proxy = proxy_factory(sim.api_base, clock=lambda: sim.sim.now)
    client = sdk(proxy.base_url)
    rounds = 12
    sim.sim.enqueue([call_reply(f"call_{i}", f"ls {i}") for i in range(rounds)])
    items: list[Any] = [{"role": "user", "content": "explore the repository"}]
    for turn in range(rounds):
        response = client.responses.create(
            model="gpt-5", instructions=LONG_INSTRUCTIONS, tools=TOOLS, input=items
        )
        items += [o.model_dump(exclude_none=True) for o in response.output]
        items.append(
            {"type": "function_call_output", "call_id": f"call_{turn}", "output": FILE_TEXT}
        )
        sim.sim.advance(15)
    proxy.settle()
    (log,) = [p for p in proxy.log_dir.iterdir() if p.suffix == ".jsonl"]
    caches = [r["cache"] for r in events(proxy.log_dir, log.stem, "response")]
    assert len(caches) == rounds, caches
    assert all(c["waste"] == 0 and c["cause"] is None for c in caches), caches
    # (the provider reads in blocks of 128 tokens: up to 127 of what was sent are not)
    assert all(c["expected"] > 0 and c["read"] > c["expected"] - 128 for c in caches[1:]), caches


# Tools as a large agent sends them (~24 KB: thirty functions, each with a long description):
# more than the instructions, so an order read wrong shows.
MANY_TOOLS = [
    {
        "type": "function",
        "name": f"tool_{i}",
        "description": f"Tool {i}. " + "Reads the repository and reports what it found. " * 14,
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    for i in range(30)
]


def test_a_responses_prompt_is_read_instructions_then_tools_then_input(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """OpenAI reads a Responses request as its instructions, its tools, then its input. With
    many tools, the time changed at the start of the instructions loses everything: it was
    named ``unexplained`` (the accounting read the tools first, an unchanged prefix of
    thousands of tokens nothing was read of). A tool changed after that loses what follows
    the instructions, which are read; a handoff that changes both is the instructions'."""
    proxy = proxy_factory(sim.api_base, clock=lambda: sim.sim.now)
    client = sdk(proxy.base_url, default_headers={"X-Session-Id": "many-tools"})
    items: list[Any] = [{"role": "user", "content": "Fix the failing test.\n" + FILE_TEXT}]
    steps = [
        ("09:00", MANY_TOOLS),
        ("09:00", MANY_TOOLS),
        ("09:01", MANY_TOOLS),  # the time in the instructions
        ("09:01", [{**MANY_TOOLS[0], "description": "Edited."}, *MANY_TOOLS[1:]]),  # a tool
        ("09:02", TOOLS),  # both: a handoff to another agent
    ]
    for turn, (time, tools) in enumerate(steps):
        client.responses.create(
            model="gpt-5",
            instructions=f"Current time: {time}.\n" + LONG_INSTRUCTIONS,
            tools=tools,
            input=items,
        )
        items = [*items, {"role": "user", "content": f"go on {turn}"}]
        sim.sim.advance(20)
    reads = [r.usage["input_tokens_details"]["cached_tokens"] for r in sim.sim.requests]
    # The scenario is what it claims to be: the third and fifth read nothing, the fourth
    # the instructions (~1,900 tokens) and not the tools after them.
    assert reads[1] > 6000 and reads[2] == 0 and reads[4] == 0
    assert 1024 <= reads[3] < 2500
    proxy.settle()
    responses = events(proxy.log_dir, "many-tools", "response")
    caches = [r["cache"] for r in responses]
    assert [(c["cause"], c["location"]) for c in caches] == [
        (None, None),
        (None, None),
        ("prefix_rewrite", "instructions"),
        ("prefix_rewrite", "tools"),
        ("prefix_rewrite", "instructions"),
    ]
    assert [c["read"] for c in caches] == reads
    assert caches[2]["waste"] == caches[2]["expected"] > 6000  # all of it, to the rewrite
    assert caches[3]["waste"] > 5000
    assert responses[2]["divergence"]["volatile_kind"] == "timestamp"
    assert responses[3]["divergence"]["location"] == "tools"
    assert responses[3]["divergence"]["field"] == "tool_0"
    m = proxy.metric
    assert m("cachegate_prefix_rewrites_total", {"location": "system"}) == 2
    assert m("cachegate_prefix_rewrites_total", {"location": "tools"}) == 1


# --- the log's lines, and the review's findings ----------------------------------------------------


def test_changed_instructions_are_written_again_and_replayed_whatever_a_line_names(
    scripted: Any, proxy_factory: Any
) -> None:
    answer = {"id": "resp_1", "object": "response", "status": "completed", "output": []}
    _, base = scripted(chunks=[orjson.dumps(answer)], content_type=b"application/json")
    proxy = proxy_factory(base)
    sent = [
        {"model": "gpt-5", "instructions": "rules v1", "input": [{"role": "user", "content": "a"}]},
        {"model": "gpt-5", "instructions": "rules v1", "input": [{"role": "user", "content": "b"}]},
        {"model": "gpt-5", "instructions": "rules v2", "input": [{"role": "user", "content": "c"}]},
        {"model": "gpt-5", "instructions": "rules v2", "input": [{"role": "user", "content": "d"}]},
        {"model": "gpt-5", "input": [{"role": "user", "content": "e"}]},
        {"model": "gpt-5", "instructions": "rules v2", "prompt": {"id": "pmpt_1"}},
    ]
    for body in sent:
        answer_ = httpx.post(
            proxy.base_url + "/responses", json=body, headers={"x-session-id": "instr"}
        )
        assert answer_.status_code == 200
    proxy.settle()
    lines = events(proxy.log_dir, "instr", "request")
    assert [line.get("instructions_from") for line in lines] == [None, 1, None, 3, None, 3]
    assert [line["params"].get("instructions") for line in lines] == [
        "rules v1",
        None,
        "rules v2",
        None,
        None,
        None,
    ]
    assert lines[5]["no_input"] is True and "no_input" not in lines[4]
    rebuilt = replayed(proxy.log_dir, "instr")
    assert [
        {"model": r["model"], **r["params"], **({"input": r["input"]} if "input" in r else {})}
        for r in rebuilt
    ] == sent


def test_a_strict_refusal_names_the_session_it_was_logged_in(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    items = [
        {"role": "user", "content": "list the files"},
        {"type": "function_call", "call_id": "c1", "name": "sh", "arguments": "{}"},
        {"role": "user", "content": "stop"},
    ]
    answer = httpx.post(
        proxy.base_url + "/responses",
        json={"model": "gpt-5", "input": items},
        headers={"x-cachegate-strict": "1"},
    )
    assert answer.status_code == 400
    sid = answer.headers["x-cachegate-session"]
    proxy.settle()
    assert [e["type"] for e in events(proxy.log_dir, sid)] == ["session_meta", "error"]


def test_a_metadata_log_of_one_string_inputs_is_replayed_with_the_warning(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    proxy = proxy_factory(sim.api_base, {"logging": {"bodies": "metadata"}})
    client = sdk(proxy.base_url, default_headers={"session_id": "meta"})
    for text in ("a secret question", "a secret follow-up"):
        client.responses.create(model="gpt-5", instructions="secret rules", input=text)
    proxy.settle()
    replay = run_cli("sessions", "replay", "meta", "--log-dir", str(proxy.log_dir))
    assert replay.code == 0 and "secret" not in replay.out
    assert "metadata" in replay.err
    # the second names the first's instructions, hashed: both are replayed, none is lost
    assert [json.loads(line)["exchange_id"] for line in replay.out.splitlines()] == [1, 2]
    assert "could not be rebuilt" not in replay.err


def test_an_sdk_retry_is_logged_as_the_clients_retry(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """The SDK retries a 429 on its own: two exchanges for one call of the agent's."""
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url, max_retries=1, default_headers={"x-session-id": "retry-r"})
    sim.sim.enqueue([{"fault": "429"}, "fine"])
    assert client.responses.create(model="gpt-5", input="hi").output_text == "fine"
    proxy.settle()
    lines = events(proxy.log_dir, "retry-r", "request")
    assert [line.get("client_retry") for line in lines] == [None, 1]
    shown = run_cli("sessions", "show", "retry-r", "--log-dir", str(proxy.log_dir), "--json")
    assert [r["client_retry"] for r in shown.json()["exchanges"]] == [0, 1]


def test_a_refusal_and_a_compressed_bodys_size_are_logged_as_on_the_chat_route(
    scripted: Any, proxy_factory: Any
) -> None:
    import zstandard

    refused = {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "output": [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "refusal", "refusal": "I can't help with that."}],
            }
        ],
    }
    _, base = scripted(chunks=[orjson.dumps(refused)], content_type=b"application/json")
    proxy = proxy_factory(base)
    body = orjson.dumps({"model": "gpt-5", "input": [{"role": "user", "content": "x" * 5000}]})
    answer = httpx.post(
        proxy.base_url + "/responses",
        content=zstandard.ZstdCompressor().compress(body),
        headers={"content-encoding": "zstd", "x-session-id": "refused"},
    )
    assert answer.status_code == 200
    proxy.settle()
    (request,) = events(proxy.log_dir, "refused", "request")
    assert request["bytes"] == len(body)
    (response,) = events(proxy.log_dir, "refused", "response")
    assert response["message"] == {
        "role": "assistant",
        "content": None,
        "refusal": "I can't help with that.",
    }


def test_a_stored_response_chain_of_parallel_calls_is_no_rewrite_and_no_waste(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """Each request of a ``previous_response_id`` chain sends only the outputs of the calls the
    last answer made: it continues what the provider stores, which cachegate does not see. It
    was compared with the turn before, as a rewrite of its first item, and charged waste."""
    proxy = proxy_factory(
        sim.api_base, {"models": {"gpt-5": {"cache_ttl_s": 300}}}, clock=lambda: sim.sim.now
    )
    client = sdk(proxy.base_url, default_headers={"x-session-id": "chain"})
    calls = [
        {
            "tool_calls": [
                {"name": "sh", "arguments": {"n": i}, "id": f"call_{t}x{i}Yz"} for i in range(2)
            ]
        }
        for t in range(3)
    ]
    sim.sim.enqueue([*calls, "done"])
    response = client.responses.create(
        model="gpt-5", instructions=LONG_INSTRUCTIONS, tools=TOOLS, input="go"
    )
    for _ in range(3):
        sim.sim.advance(400)  # (past the cache's life: an expiry would be charged)
        outputs = [
            {"type": "function_call_output", "call_id": o.call_id, "output": "ok"}
            for o in response.output
        ]
        response = client.responses.create(
            model="gpt-5",
            instructions=LONG_INSTRUCTIONS,
            tools=TOOLS,
            input=outputs,
            previous_response_id=response.id,
        )
    assert response.output_text == "done"
    proxy.settle()
    lines = events(proxy.log_dir, "chain", "response")
    assert len(lines) == 4 and all(r["cost"]["actual"] > 0 for r in lines)
    assert all("divergence" not in r for r in lines)
    assert all("cache" not in r for r in lines[1:])
    assert proxy.metric("cachegate_prefix_rewrites_total", {"location": "messages"}) == 0
    waste = proxy.metric(
        "cachegate_cache_waste_tokens_total", {"model": "gpt-5", "cause": "ttl_expired"}
    )
    assert waste == 0


def test_an_orphan_the_repair_dropped_is_not_expected_from_the_cache(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """A sliding window cut the task and the first call, leaving that call's output an orphan,
    which ``orphan_policy = "drop"`` takes out: the provider gets what it would have got had
    the client cut the output too, and cachegate expects as much of the cache either way. The
    repair's index is of ``input``, where the accounting's view has the instructions first:
    the item after the orphan was taken for the one dropped, and the orphan's share expected."""
    proxy = proxy_factory(
        sim.api_base, {"pairing": {"orphan_policy": "drop"}}, clock=lambda: sim.sim.now
    )
    expected = {}
    for sid, cut in (("window", 2), ("control", 3)):
        client = sdk(proxy.base_url, default_headers={"x-session-id": sid})
        sim.sim.enqueue([call_reply(f"call_C{i}xYz", f"ls {i}") for i in range(5)])
        items: list[Any] = [{"role": "user", "content": "task"}]
        for turn in range(5):
            if turn == 4:
                del items[0:cut]  # the task and the first call (and, by the client, its output)
            response = client.responses.create(
                model="gpt-5", instructions=LONG_INSTRUCTIONS, tools=TOOLS, input=items
            )
            items += [o.model_dump(exclude_none=True) for o in response.output]
            output = FILE_TEXT[: 2000 + 10 * turn]
            items.append(
                {"type": "function_call_output", "call_id": f"call_C{turn}xYz", "output": output}
            )
            sim.sim.advance(10)
        proxy.settle()
        last = events(proxy.log_dir, sid, "request")[-1]
        assert len(last["repairs"]) == (1 if sid == "window" else 0)
        expected[sid] = events(proxy.log_dir, sid, "response")[-1]["cache"]["expected"]
    first, second = (
        [{k: v for k, v in item.items() if k != "id"} for item in r.body["input"]]
        for r in sim.sim.requests[4::5]
    )
    assert first == second  # the same request went out either way (the answers' ids aside)
    assert expected["window"] == expected["control"] > 0


def _completed(text: str) -> dict[str, Any]:
    """A ``response.completed`` event of one assistant message of ``text``."""
    message = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }
    response = {"id": "resp_1", "object": "response", "status": "completed", "model": "gpt-5"}
    usage = {"input_tokens": 10, "output_tokens": 1}
    return {
        "type": "response.completed",
        "response": {**response, "output": [message], "usage": usage},
    }


@pytest.mark.parametrize("transport", ["native", "httpx"])
def test_a_client_that_stops_at_the_last_event_got_a_whole_answer(
    scripted: Any, proxy_factory: Any, transport: str
) -> None:
    """Codex CLI stops reading a Responses stream at ``response.completed`` and drops the
    connection; an upstream whose chunked stream ends a moment later had the exchange logged as
    interrupted (INTERRUPTED in ``sessions list``, a client disconnect in the metrics)."""
    done = _completed("whole")
    delta = {"type": "response.output_text.delta", "delta": "whole"}
    chunks = [
        b"event: response.output_text.delta\ndata: " + orjson.dumps(delta) + b"\n\n",
        b"event: response.completed\ndata: " + orjson.dumps(done) + b"\n\n",
        b"",  # the upstream's end comes a moment after its last event
    ]
    _upstream, base = scripted(chunks=chunks, delay_s=0.4)
    proxy = proxy_factory(base, {"upstream": {"transport": transport}})
    body = {"model": "gpt-5", "stream": True, "input": "hi"}
    with (
        httpx.Client() as client,
        client.stream(
            "POST", proxy.base_url + "/responses", json=body, headers={"x-session-id": "stop"}
        ) as answer,
    ):
        seen = b""
        for piece in answer.iter_raw():
            seen += piece
            if seen.endswith(b"}\n\n") and b"response.completed" in seen:
                break  # (and the connection is closed with the stream)
    proxy.settle()

    def response_logged() -> list[dict[str, Any]]:
        proxy.settle()
        return events(proxy.log_dir, "stop", "response")

    from tests.e2e_support import wait_for

    (response,) = wait_for(response_logged, what="the response event")
    assert response["interrupted"] is False, response
    assert response["message"]["content"] == "whole" and response["usage"]["prompt"] == 10
    assert proxy.metric("cachegate_client_disconnects_total") == 0


def test_a_last_event_of_megabytes_read_whole_by_a_slow_client_is_no_cut(
    proxy_factory: Any,
) -> None:
    """200 deltas of 10 KB, then a ``response.completed`` of 2 MB (the answer whole again); a
    client slower than its socket reads it all, stops there and hangs up before the upstream's
    end: the last write had left bytes in cachegate's buffer, the flag said so and was never
    looked at again once they had gone, and the whole answer was logged as interrupted (a
    client disconnect in the metrics)."""
    import asyncio
    from time import sleep

    from proxy.serving import ServerThread

    text = "x" * 10_000

    def event(kind: str, data: dict[str, Any]) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    done = _completed(text * 200)

    async def upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        delta = event("response.output_text.delta", {"type": "x", "delta": text})
        for _ in range(200):
            await send({"type": "http.response.body", "body": delta, "more_body": True})
        last = event("response.completed", done)
        await send({"type": "http.response.body", "body": last, "more_body": True})
        await asyncio.sleep(3)  # the upstream's end comes well after its last event
        await send({"type": "http.response.body", "body": b""})

    with ServerThread(upstream) as server:
        proxy = proxy_factory(server.url + "/v1")
        body = {"model": "gpt-5", "stream": True, "input": "hi"}
        with (
            httpx.Client(timeout=30) as client,
            client.stream(
                "POST", proxy.base_url + "/responses", json=body, headers={"x-session-id": "big"}
            ) as answer,
        ):
            seen = b""
            for piece in answer.iter_raw():
                seen += piece
                sleep(0.02)  # (slower than the socket: cachegate's buffer fills)
                if b"response.completed" in seen[-3_000_000:] and seen.endswith(b"}\n\n"):
                    break
        assert seen.count(text.encode()) == 400  # (the deltas and the last event, whole)

        def response_logged() -> list[dict[str, Any]]:
            proxy.settle()
            return events(proxy.log_dir, "big", "response")

        (response,) = wait_for(response_logged, timeout=20, what="the response event")
    assert response["interrupted"] is False, {k: response[k] for k in ("status", "error")}
    assert proxy.metric("cachegate_client_disconnects_total") == 0


def test_a_remote_compaction_is_counted_logged_and_no_turn_of_the_conversation(
    scripted: Any, proxy_factory: Any
) -> None:
    """Codex CLI compacts a long history with ``POST /v1/responses/compact``: its answer, a
    ``response.compaction`` object, has the usage the provider bills; it was relayed unread."""
    compacted = {
        "id": "resp_c1",
        "object": "response.compaction",
        "created_at": 1,
        "output": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]},
            {"type": "compaction", "encrypted_content": "gAAAA"},
        ],
        "usage": {
            "input_tokens": 5000,
            "input_tokens_details": {"cached_tokens": 4096},
            "output_tokens": 300,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 5300,
        },
    }
    upstream, base = scripted(chunks=[orjson.dumps(compacted)], content_type=b"application/json")
    proxy = proxy_factory(base)
    history = [
        {"role": "user", "content": "fix the tests"},
        {"type": "function_call", "call_id": "c1", "name": "sh", "arguments": "{}"},
    ]
    answer = httpx.post(
        proxy.base_url + "/responses/compact",
        json={"model": "gpt-5", "instructions": "rules", "input": history},
        headers={"session_id": "codex-compact"},
    )
    assert answer.status_code == 200 and answer.content == orjson.dumps(compacted)
    assert answer.headers["x-cachegate-repairs"] == "1"  # (its input repaired as a turn's)
    assert upstream.requests[-1]["path"] == "/v1/responses/compact"
    m = proxy.metric
    assert m("cachegate_tokens_total", {"model": "gpt-5", "kind": "prompt"}) == 5000
    assert m("cachegate_tokens_total", {"model": "gpt-5", "kind": "cache_read"}) == 4096
    assert m("cachegate_cost_usd_total", {"model": "gpt-5", "kind": "actual"}) > 0
    (request,) = events(proxy.log_dir, "codex-compact", "request")
    (response,) = events(proxy.log_dir, "codex-compact", "response")
    assert request["path"] == "/v1/responses/compact"
    assert response["usage"]["prompt"] == 5000 and response["cost"]["actual"] > 0
    assert "cache" not in response  # (no turn: nothing expected of the cache, no baseline)
    (again,) = replayed(proxy.log_dir, "codex-compact")
    assert again["path"] == "/v1/responses/compact" and again["input"][:2] == history


def test_codex_compacts_an_interrupted_history_through_cachegate_and_goes_on(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """The SDK's ``responses.compact`` against the simulator through cachegate: an interrupted
    history, which the provider refuses to compact, is repaired as a turn's; the compaction's
    tokens are counted as the provider billed them, its exchange is logged and replayed; the
    session goes on from the compacted items."""
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)
    direct = sdk(sim.api_base)
    history: list[Any] = [
        {"role": "user", "content": "fix the tests " * 300},
        {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{}"},
    ]
    with pytest.raises(Exception, match="No tool output found for function call c1"):
        direct.responses.compact(model="gpt-5", input=history, instructions=INSTRUCTIONS)
    headers = {"session_id": "codex-compacting"}
    raw = client.responses.with_raw_response.compact(
        model="gpt-5", input=history, instructions=INSTRUCTIONS, extra_headers=headers
    )
    assert raw.headers["x-cachegate-repairs"] == "1"
    compacted = raw.parse()
    assert compacted.output[-1].type == "compaction"
    billed = sim.sim.requests[-1].usage
    assert sim.sim.requests[-1].body["input"][2]["call_id"] == "c1"  # (the synthetic output)
    m = proxy.metric
    assert (
        m("cachegate_tokens_total", {"model": "gpt-5", "kind": "prompt"})
        == (billed["input_tokens"])
    )
    assert (
        m("cachegate_tokens_total", {"model": "gpt-5", "kind": "completion"})
        == (billed["output_tokens"])
    )
    items = raw.http_response.json()["output"]
    items.append({"role": "user", "content": "go on"})
    after = client.responses.create(
        model="gpt-5", input=items, instructions=INSTRUCTIONS, extra_headers=headers
    )
    assert after.output_text == "Done."
    proxy.settle()
    (response, turn) = events(proxy.log_dir, "codex-compacting", "response")
    assert response["usage"]["prompt"] == billed["input_tokens"] and "cache" not in response
    assert turn["status"] == 200
    paths = [r["path"] for r in replayed(proxy.log_dir, "codex-compacting")]
    assert paths == ["/v1/responses/compact", "/v1/responses"]


def test_a_refusal_before_the_body_is_read_is_in_the_held_sessions_log_numbered(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A body over ``server.max_body_bytes`` in a session cachegate holds: its 413 is in that
    session's log under the next exchange number, as on the chat route (announced by its
    Content-Length it was in no log; sent chunked, it was logged as exchange 0)."""
    proxy = proxy_factory(sim.api_base, {"server": {"max_body_bytes": 20000}})
    headers = {"x-session-id": "held"}
    small = {"model": "gpt-5", "input": [{"role": "user", "content": "hi"}]}
    assert httpx.post(proxy.base_url + "/responses", json=small, headers=headers).is_success
    large = orjson.dumps({**small, "input": [{"role": "user", "content": "x" * 30000}]})
    announced = httpx.post(proxy.base_url + "/responses", content=large, headers=headers)
    chunked = httpx.post(
        proxy.base_url + "/responses", content=iter([large[:10000], large[10000:]]), headers=headers
    )
    for answer in (announced, chunked):
        assert answer.status_code == 413 and answer.headers["x-cachegate-session"] == "held"
        assert answer.json()["error"]["code"] == "request_too_large"
    proxy.settle()
    errors = events(proxy.log_dir, "held", "error")
    assert [(e["exchange"], e["status"]) for e in errors] == [(2, 413), (3, 413)]
    labels = {"route": "responses", "model": "other", "status": "413"}
    assert proxy.metric("cachegate_requests_total", labels) == 2
    assert len(sim.sim.requests) == 1


def test_a_long_codex_session_is_read_in_what_each_turn_appended_and_repaired_all_the_same(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A Codex-style session past 16 KiB: each turn after the first is parsed only in the items
    it appended (spliced onto the last turn's parse, as chat bodies are), and its pairing
    checked from where the last turn's check ended. A turn interrupted between a call and its
    output is repaired all the same, every other turn goes to the provider byte for byte, and
    the log replays each as it was sent."""
    proxy = proxy_factory(sim.api_base)
    rounds = 6
    sim.sim.enqueue([call_reply(f"call_{i}", f"cat file{i}.py") for i in range(rounds)])
    # (Codex CLI puts the repository's AGENTS.md first: the first body is past 16 KiB too)
    agents_md = {"type": "message", "role": "user", "content": "# AGENTS.md\n" + FILE_TEXT * 4}
    items: list[Any] = [agents_md, {"type": "message", "role": "user", "content": "explore"}]
    headers = {"session_id": "0199a213-81c0-7800-8aa1-bbab2a035a53"}
    sent: list[bytes] = []
    repairs: list[str] = []
    with httpx.Client(base_url=proxy.base_url, headers=headers) as client:
        for turn in range(rounds):
            if turn == 3:  # the agent was stopped while its tool ran: no output for the call
                interrupted = items.pop()
            body = {
                "model": "gpt-5",
                "instructions": LONG_INSTRUCTIONS,
                "input": items,
                "tools": TOOLS,
                "store": False,
            }
            sent.append(orjson.dumps(body))
            answer = client.post("/responses", content=sent[-1])
            assert answer.status_code == 200, answer.text
            repairs.append(answer.headers["x-cachegate-repairs"])
            if turn == 3:  # the agent goes on: the call's output, then the next call's
                items.append(interrupted)
            items += answer.json()["output"]
            items.append(
                {"type": "function_call_output", "call_id": f"call_{turn}", "output": FILE_TEXT}
            )
    assert len(sent[0]) > 16 * 1024
    assert repairs == ["0", "0", "0", "1", "0", "0"]
    assert proxy.gateway.chat.spliced_parses == rounds - 1  # every turn after the first
    received = [r for r in sim.sim.requests if r.path.endswith("/responses")]
    assert [r.raw for i, r in enumerate(received) if i != 3] == sent[:3] + sent[4:]
    synthetic = received[3].body["input"][-1]
    assert synthetic["call_id"] == "call_2" and synthetic["type"] == "function_call_output"
    proxy.settle()
    rebuilt = replayed(proxy.log_dir, headers["session_id"])
    assert [again["input"] for again in rebuilt] == [r.body["input"] for r in received]


@pytest.mark.parametrize("explicit", [True, False])
def test_the_bodies_kept_for_a_forgotten_responses_session_are_let_go(
    sim: RunningSimulator, proxy_factory: Any, explicit: bool
) -> None:
    """Responses sessions forgotten for count (4 held), with or without a session id: the
    bodies kept for their next turn go with them (without an id, all 40 stayed: ~41 MB for
    2,000 sessions of 22 KB, none of it in ``cachegate_sessions_memory_bytes``)."""
    proxy = proxy_factory(sim.api_base, {"sessions": {"max_sessions": 4}})
    for i in range(40):
        task = f"task {i} " + "lorem ipsum dolor " * 1200
        body = {
            "model": "gpt-5",
            "instructions": "sys",
            "input": [{"role": "user", "content": task}],
        }
        headers = {"session_id": f"s{i}"} if explicit else {}
        assert httpx.post(proxy.base_url + "/responses", json=body, headers=headers).is_success
    proxy.settle()
    kept = proxy.gateway.chat.memos.bytes
    assert kept <= 4 * 2 * 23_000, kept  # (the held sessions' bodies)
    assert kept > 0  # (those of the sessions held stay, for their next turn)


def test_a_responses_agent_with_the_time_in_its_instructions_keeps_one_body_a_turn(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Instructions with the time in them, no session id: each turn's first bytes differ, so
    each is filed under a key of its own; the turn it carries on is let go (every turn's whole
    body was kept: memory with the square of the session), and its items are still spliced."""
    proxy = proxy_factory(sim.api_base)
    rules = "Rules. " * 3000
    items: list[Any] = [{"type": "message", "role": "user", "content": "Fix the failing test"}]
    sizes = []
    before = proxy.gateway.chat.memos.bytes
    rounds = 12
    sim.sim.enqueue([call_reply(f"c{turn}", f"ls {turn}") for turn in range(rounds)])
    for turn in range(rounds):
        body = {
            "model": "gpt-5",
            "instructions": f"It is 10:{turn:02d}. You are a coding agent. " + rules,
            "input": items,
        }
        answer = httpx.post(proxy.base_url + "/responses", json=body)
        assert answer.is_success, answer.text
        sizes.append(len(sim.sim.requests[-1].raw))
        items += answer.json()["output"]
        items.append(
            {"type": "function_call_output", "call_id": f"c{turn}", "output": f"{turn} " * 3000}
        )
    proxy.settle()
    assert proxy.gateway.chat.spliced_parses == rounds - 2  # (as on the chat route)
    # its last body (and its first: a one-item history tells no conversation from another)
    assert proxy.gateway.chat.memos.bytes - before == sizes[0] + sizes[-1]


@pytest.mark.parametrize(
    ("stored_time", "tools"), [("10:00", False), ("10:03", False), ("10:03", True)]
)
def test_a_stored_response_turn_keeps_the_cache_alive_for_the_idle_time(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any, stored_time: str, tools: bool
) -> None:
    """A full turn, a ``previous_response_id`` turn 200 s later, a full turn 200 s after that
    with the time in its instructions changed (a 300 s cache life): the provider had read the
    prefix at the stored turn, but the idle time was counted from the full turn before it, and
    the rewrite's miss was called ``ttl_expired``: the user told to keep the session warm where
    the timestamp was to go. So too where the stored turn's instructions carry their own time
    (a client that puts it in every request): the provider read the instructions up to it;
    and where it sends no tools where the full turns send some (the instructions come first)."""
    proxy = proxy_factory(
        sim.api_base, {"models": {"gpt-5": {"cache_ttl_s": 300}}}, clock=lambda: sim.sim.now
    )
    client = sdk(proxy.base_url, default_headers={"x-session-id": "stored-warm"})
    items: list[Any] = [{"role": "user", "content": "Plan the refactor. " * 200}]
    full: dict[str, Any] = {"tools": TOOLS} if tools else {}
    first = client.responses.create(
        model="gpt-5",
        instructions=LONG_INSTRUCTIONS + "\nCurrent time: 10:00",
        input=items,
        **full,
    )
    sim.sim.advance(200)
    stored = client.responses.create(
        model="gpt-5",
        instructions=LONG_INSTRUCTIONS + f"\nCurrent time: {stored_time}",
        input="and then?",
        previous_response_id=first.id,
    )
    sim.sim.advance(200)
    items += [
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": stored.output_text},
        {"role": "user", "content": "go on"},
    ]
    client.responses.create(
        model="gpt-5",
        instructions=LONG_INSTRUCTIONS + "\nCurrent time: 10:07",
        input=items,
        **full,
    )
    proxy.settle()
    last = events(proxy.log_dir, "stored-warm", "response")[-1]
    assert last["cache"]["cause"] == "prefix_rewrite", last["cache"]
    assert last["cache"]["location"] == "instructions"
    expired = {"model": "gpt-5", "cause": "ttl_expired"}
    assert proxy.metric("cachegate_cache_waste_tokens_total", expired) == 0


@pytest.mark.parametrize("edit", ["tools", "input"])
def test_a_full_turn_after_a_stored_one_names_its_rewrite_not_an_expiry(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any, edit: str
) -> None:
    """A full turn, a ``previous_response_id`` turn 200 s later with the same instructions and
    tools, then a full turn 200 s after that which edits a tool or an item (a 300 s cache
    life). The provider had read the whole stored conversation at the stored turn, but only
    its instructions and tools were counted as read there: the edit's miss was measured from
    the first full turn and called ``ttl_expired``, the real cause hidden (a client that mixes
    stored and full turns: LangChain, the Agents SDK falling back from stored responses)."""
    proxy = proxy_factory(
        sim.api_base, {"models": {"gpt-5": {"cache_ttl_s": 300}}}, clock=lambda: sim.sim.now
    )
    client = sdk(proxy.base_url, default_headers={"x-session-id": "stored-edit"})
    items: list[Any] = [
        {"role": "user", "content": "Plan the refactor. " * 200},
        {"role": "user", "content": "Mind the parser. " * 200},
    ]
    first = client.responses.create(
        model="gpt-5", instructions=LONG_INSTRUCTIONS, input=items, tools=TOOLS
    )
    sim.sim.advance(200)
    stored = client.responses.create(
        model="gpt-5",
        instructions=LONG_INSTRUCTIONS,
        input="and then?",
        previous_response_id=first.id,
        tools=TOOLS,
    )
    sim.sim.advance(200)
    tools = TOOLS
    if edit == "tools":
        tools = [{**TOOLS[0], "description": "Run a shell command."}]
    else:
        items[1] = {"role": "user", "content": "Mind the lexer. " * 200}
    items += [
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": stored.output_text},
        {"role": "user", "content": "go on"},
    ]
    client.responses.create(model="gpt-5", instructions=LONG_INSTRUCTIONS, input=items, tools=tools)
    proxy.settle()
    last = events(proxy.log_dir, "stored-edit", "response")[-1]
    assert last["cache"]["waste"] > 0
    assert last["cache"]["cause"] == "prefix_rewrite", last["cache"]
    assert last["cache"]["location"] == ("tools" if edit == "tools" else "input[1].content")
    expired = {"model": "gpt-5", "cause": "ttl_expired"}
    assert proxy.metric("cachegate_cache_waste_tokens_total", expired) == 0


def test_a_stored_turn_keeps_alive_only_the_conversation_it_goes_on_from(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any
) -> None:
    """Two conversations of one session with the same instructions and tools (a main agent and
    a sub-agent), and stored turns that go on from the first, one from the other's answer: the
    first's history was read again at each, the second's not since its own turn. The second
    conversation's next full turn, past the cache's life, is an expiry (it was taken for read
    at the stored turns, its miss ``unexplained``); the first's, with an item edited, a rewrite
    (its chain of stored turns followed by their answers' ids)."""
    proxy = proxy_factory(
        sim.api_base, {"models": {"gpt-5": {"cache_ttl_s": 300}}}, clock=lambda: sim.sim.now
    )
    client = sdk(proxy.base_url, default_headers={"x-session-id": "two"})
    first: list[Any] = [
        {"role": "user", "content": "Plan the refactor. " * 200},
        {"role": "user", "content": "Mind the parser. " * 200},
    ]
    other: list[Any] = [{"role": "user", "content": "Write the release notes. " * 200}]

    def full(items: list[Any]) -> Any:
        return client.responses.create(
            model="gpt-5", instructions=LONG_INSTRUCTIONS, input=items, tools=TOOLS
        )

    answer = full(first)
    sim.sim.advance(10)
    answer_other = full(other)
    previous = answer.id
    for _ in range(2):  # (the second goes on from the first's answer)
        sim.sim.advance(190)
        stored = client.responses.create(
            model="gpt-5",
            instructions=LONG_INSTRUCTIONS,
            input="and then?",
            previous_response_id=previous,
            tools=TOOLS,
        )
        previous = stored.id
    sim.sim.advance(200)
    full(
        [
            *other,
            {"role": "assistant", "content": answer_other.output_text},
            {"role": "user", "content": "go on"},
        ]
    )
    first[1] = {"role": "user", "content": "Mind the lexer. " * 200}
    full(
        [
            *first,
            {"role": "assistant", "content": answer.output_text},
            {"role": "user", "content": "go on"},
        ]
    )
    proxy.settle()
    expired, edited = events(proxy.log_dir, "two", "response")[-2:]
    assert expired["cache"]["cause"] == "ttl_expired", expired["cache"]
    assert edited["cache"]["cause"] == "prefix_rewrite", edited["cache"]
    assert edited["cache"]["location"] == "input[1].content"


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_interrupted_after_a_stored_responses_calls_is_not_refused(
    sim: RunningSimulator, proxy_factory: Any, sdk: Any, stream: bool
) -> None:
    """The Agents SDK's way (``previous_response_id``): the stored answer made two calls, the
    user interrupted them and typed on, and the next request carries that message alone. The
    provider refuses it, ``No tool output found for function call …``, on every turn after:
    cachegate, which relayed the answer, knows its calls and puts a synthetic output for each
    not answered first in the input (one answered by the client keeps its own)."""
    import openai

    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url, default_headers={"x-session-id": "stored-calls"})
    sim.sim.enqueue(
        [
            {
                "tool_calls": [
                    {"name": "exec_command", "arguments": {"cmd": "ls"}, "id": "call_ls"},
                    {"name": "read_file", "arguments": {"path": "a.py"}, "id": "call_read"},
                ]
            }
        ]
    )
    first: Any = client.responses.create(
        model="gpt-5", instructions=INSTRUCTIONS, input="Look around.", tools=TOOLS, stream=stream
    )
    if stream:
        first = next(e.response for e in first if e.type == "response.completed")
    # directly, the provider refuses the turn: the stored answer's calls have no output
    with pytest.raises(openai.BadRequestError, match="No tool output found for function call"):
        sdk(sim.api_base).responses.create(
            model="gpt-5", input="Stop, do something else.", previous_response_id=first.id
        )
    raw = client.responses.with_raw_response.create(
        model="gpt-5",
        input=[
            {"type": "function_call_output", "call_id": "call_read", "output": "print(1)"},
            {"role": "user", "content": "Stop, do something else."},
        ],
        previous_response_id=first.id,
        tools=TOOLS,
    )
    assert raw.status_code == 200 and raw.headers["x-cachegate-repairs"] == "1"
    sent = sim.sim.requests[-1].body["input"]
    note = DEFAULT_INTERRUPTED_NOTE.replace("{name}", "exec_command")
    assert sent[0] == {"type": "function_call_output", "call_id": "call_ls", "output": note}
    assert sent[1:] == [
        {"type": "function_call_output", "call_id": "call_read", "output": "print(1)"},
        {"role": "user", "content": "Stop, do something else."},
    ]
    # one string for an input: the user's message, after the outputs
    again = client.responses.create(
        model="gpt-5", input="And now?", previous_response_id=first.id, tools=TOOLS
    )
    assert again.output_text
    assert [i.get("call_id") for i in sim.sim.requests[-1].body["input"]] == [
        "call_ls",
        "call_read",
        None,
    ]
    proxy.settle()
    (repair,) = events(proxy.log_dir, "stored-calls", "request")[1]["repairs"]
    assert repair["kind"] == "dangling_call" and repair["tool_call_id"] == "call_ls"
    assert repair["index"] is None and first.id in repair["action"]
    # strict pairing refuses it instead, naming the call, with a defect of the input's own
    own = {"type": "function_call", "call_id": "own1", "name": "exec_command", "arguments": "{}"}
    strict = httpx.post(
        proxy.base_url + "/responses",
        json={"model": "gpt-5", "input": [own], "previous_response_id": first.id},
        headers={"x-cachegate-strict": "1"},
    )
    assert strict.status_code == 400
    said = strict.json()["error"]["message"]
    assert said.startswith("cachegate strict pairing: 3 defects: call call_ls of the stored")
    assert "call_read" in said and "input[0] function_call own1 has no output" in said
    # an input the API does not take (one object) is the provider's to refuse, as it was sent
    sent_before = len(sim.sim.requests)
    odd = {"model": "gpt-5", "input": {"role": "user"}, "previous_response_id": first.id}
    httpx.post(proxy.base_url + "/responses", json=odd)
    assert sim.sim.requests[sent_before].body["input"] == {"role": "user"}
