"""The chat pipeline end to end: pairing repair and strict mode through cachegate to the simulator."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from proxy.chat import PairingRepair, splice_usage_option
from proxy.config import settings_from_mapping
from proxy.pipeline import Exchange
from proxy.sessions import SessionState
from proxy.simulator import RunningSimulator, SimConfig, run_simulator
from tests.e2e_support import events

INTERRUPTED = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the failing test"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
            },
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "run", "arguments": '{"cmd": "pytest'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "print('a')"},
    {"role": "user", "content": "Stop, look at b.py instead"},
]


@pytest.fixture
def sim() -> Iterator[RunningSimulator]:
    with run_simulator(SimConfig()) as running:
        yield running


def test_interrupted_turn_400_directly_200_through_cachegate(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    with pytest.raises(openai.BadRequestError) as info:
        sdk(sim.api_base).chat.completions.create(model="gpt-4o", messages=INTERRUPTED)  # type: ignore[arg-type]
    assert "did not have response messages: call_b" in str(info.value)
    for stream in (False, True):
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model="gpt-4o",
            messages=INTERRUPTED,  # type: ignore[arg-type]
            stream=stream,
        )
        assert raw.http_response.status_code == 200
        assert raw.headers["x-cachegate-repairs"] == "2"  # a dangling call and truncated arguments
        if stream:
            assert any(c.choices and c.choices[0].delta.content for c in raw.parse())
    forwarded = sim.sim.requests[-1].body["messages"]
    assert [m["role"] for m in forwarded] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert forwarded[4]["tool_call_id"] == "call_b"
    assert "interrupted" in forwarded[4]["content"]
    assert forwarded[2]["tool_calls"][1]["function"]["arguments"] == "{}"
    assert proxy.metric("cachegate_pairing_repairs_total", {"kind": "dangling_call"}) == 2
    assert proxy.metric("cachegate_pairing_repairs_total", {"kind": "invalid_arguments"}) == 2


def _refused_directly_answered_through(
    sdk: Any, sim: RunningSimulator, proxy: Any, history: list[Any], refusal: str
) -> Any:
    """``history`` sent to the simulator directly is refused with ``refusal`` in its message
    (as OpenAI words it); through cachegate it is answered: the raw response."""
    with pytest.raises(openai.BadRequestError) as info:
        sdk(sim.api_base).chat.completions.create(model="gpt-4o", messages=history)
    assert refusal in str(info.value)
    raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
        model="gpt-4o", messages=history
    )
    assert raw.http_response.status_code == 200
    return raw


@pytest.mark.parametrize("ids", ["", None])
def test_gemini_style_histories_400_directly_200_through_cachegate(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, ids: str | None
) -> None:
    """What OpenAI-compatible servers such as Gemini's send back: calls with empty (or no) ids,
    answered with empty ids, and a plain answer with ``"tool_calls": []``. Forwarded to OpenAI,
    the empty array is a 400; the results stay results, with their calls' assigned ids."""
    call: dict[str, Any] = {
        "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
    }
    result: dict[str, Any] = {"role": "tool", "content": "print('a')"}
    if ids is not None:
        call["id"], result["tool_call_id"] = ids, ids
    history = [
        {"role": "user", "content": "Read a.py"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        result,
        {"role": "assistant", "content": "It prints a.", "tool_calls": []},
        {"role": "user", "content": "Thanks"},
    ]
    proxy = proxy_factory(sim.api_base)
    # (calls without an id are refused first: the provider reads the list in order)
    refusal = "empty array" if ids == "" else "Missing required parameter: 'messages[1].tool_calls"
    raw = _refused_directly_answered_through(sdk, sim, proxy, history, refusal)
    assert raw.headers["x-cachegate-repairs"] == "3"  # two ids given, one empty array removed
    forwarded = sim.sim.requests[-1].body["messages"]
    assert [m["role"] for m in forwarded] == ["user", "assistant", "tool", "assistant", "user"]
    assigned = forwarded[1]["tool_calls"][0]["id"]
    assert assigned.startswith("call_")
    assert forwarded[2] == {"role": "tool", "tool_call_id": assigned, "content": "print('a')"}
    assert "tool_calls" not in forwarded[3]
    assert proxy.metric("cachegate_pairing_repairs_total", {"kind": "missing_id"}) == 2
    assert proxy.metric("cachegate_pairing_repairs_total", {"kind": "empty_tool_calls"}) == 1


MISTRAL_INTERRUPTED = [
    {"role": "user", "content": "Fix the failing test"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "Ab3dE6gH9",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
            },
            {"type": "function", "function": {"name": "run", "arguments": '{"cmd": "pytest"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "Ab3dE6gH9", "content": "print('a')"},
    {"role": "user", "content": "Stop, look at b.py instead"},
]


def test_a_mistral_model_gets_its_interrupted_turn_repaired_as_mistral_takes_it(
    sdk: Any, proxy_factory: Any
) -> None:
    """Mistral refuses a user message right after a tool result (``Unexpected role 'user' after
    role 'tool'``) and an id other than nine letters and digits: the repaired turn of an
    interrupted session (a call given an id, a synthetic result, then the user's message) was
    refused on every turn. For a Mistral model an assistant message goes between, and
    the id given is nine characters; a sound Mistral history goes as it came (another model's
    is repaired as before: ``test_pairing``)."""
    with run_simulator(SimConfig(mistral_rules=True)) as mistral:
        proxy = proxy_factory(mistral.api_base)
        with pytest.raises(openai.BadRequestError):  # (no id: refused as OpenAI would)
            sdk(mistral.api_base).chat.completions.create(
                model="mistral-large-latest",
                messages=MISTRAL_INTERRUPTED,  # type: ignore[arg-type]
            )
        for stream in (False, True):
            raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
                model="mistral-large-latest",
                messages=MISTRAL_INTERRUPTED,  # type: ignore[arg-type]
                stream=stream,
            )
            assert raw.http_response.status_code == 200
            assert raw.headers["x-cachegate-repairs"] == "3"  # an id, a result, the order
            if stream:
                assert any(c.choices and c.choices[0].delta.content for c in raw.parse())
        forwarded = mistral.sim.requests[-1].body["messages"]
        roles = [m["role"] for m in forwarded]
        assert roles == ["user", "assistant", "tool", "tool", "assistant", "user"]
        given = forwarded[1]["tool_calls"][1]["id"]
        assert len(given) == 9 and given.isalnum() and forwarded[3]["tool_call_id"] == given
        assert forwarded[4] == {
            "role": "assistant",
            "content": "[cachegate] (no answer was recorded)",
        }
        kind = {"kind": "user_after_tool"}
        assert proxy.metric("cachegate_pairing_repairs_total", kind) == 2
        sound = [*MISTRAL_INTERRUPTED[:3], {"role": "assistant", "content": "a prints a"}]
        sound[1] = {**sound[1], "tool_calls": sound[1]["tool_calls"][:1]}
        sound.append({"role": "user", "content": "and b?"})
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model="mistral-large-latest",
            messages=sound,  # type: ignore[arg-type]
        )
        assert raw.headers["x-cachegate-repairs"] == "0"
        assert mistral.sim.requests[-1].body["messages"] == sound


def test_a_session_begun_on_another_model_goes_on_on_mistral(sdk: Any, proxy_factory: Any) -> None:
    """A session begun on GPT (``call_…`` ids) moved to a Mistral model: Mistral refused every
    turn (``Tool call id was call_… but must be a-z, A-Z, 0-9, with a length of 9``), and the
    ids were left as the client sent them. Each is written as nine letters and digits, its
    result's with it, the same every turn (the provider's cached prefix stays)."""
    call_id = "call_Xb3kQ9LmN2pR7sT1vW4yZ6aC"
    history = [
        {"role": "user", "content": "Read a.py"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "print('a')"},
        {"role": "assistant", "content": "It prints a."},
        {"role": "user", "content": "And b.py?"},
    ]
    with run_simulator(SimConfig(mistral_rules=True)) as mistral:
        with pytest.raises(openai.BadRequestError, match="Tool call id was call_"):
            sdk(mistral.api_base).chat.completions.create(
                model="mistral-large-latest",
                messages=history,  # type: ignore[arg-type]
            )
        proxy = proxy_factory(mistral.api_base)
        client = sdk(proxy.base_url, default_headers={"X-Session-Id": "moved"})
        sent = []
        for turn in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model="mistral-large-latest",
                messages=history,  # type: ignore[arg-type]
            )
            assert raw.http_response.status_code == 200
            assert raw.headers["x-cachegate-repairs"] == "2"  # the call's id, its result's
            sent.append(mistral.sim.requests[-1].body["messages"])
            history = [*history, raw.parse().choices[0].message.model_dump(exclude_none=True)]
            history.append({"role": "user", "content": f"more {turn}"})
        given = sent[0][1]["tool_calls"][0]["id"]
        assert len(given) == 9 and given.isalnum() and sent[0][2]["tool_call_id"] == given
        assert sent[1][: len(sent[0])] == sent[0]  # (the same ids next turn)


def test_a_mistral_model_under_a_name_of_the_users_is_repaired_as_mistral_takes_it(
    sdk: Any, proxy_factory: Any
) -> None:
    """A Mistral model served under a name of the user's own (vLLM's ``--served-model-name``)
    was repaired as OpenAI's, and Mistral refused the repaired turn; its entry's
    ``dialect = "mistral"`` says whose it is. A model whose name says another provider's stays
    that provider's under a ``"*"`` entry with that dialect."""
    with run_simulator(SimConfig(mistral_rules=True)) as mistral:
        config = {"models": {"house-coder": {"dialect": "mistral"}, "*": {"dialect": "mistral"}}}
        proxy = proxy_factory(mistral.api_base, config)
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model="house-coder",
            messages=MISTRAL_INTERRUPTED,  # type: ignore[arg-type]
        )
        assert raw.http_response.status_code == 200
        roles = [m["role"] for m in mistral.sim.requests[-1].body["messages"]]
        assert roles == ["user", "assistant", "tool", "tool", "assistant", "user"]
    settings = settings_from_mapping(
        {"upstream": {"base_url": "http://127.0.0.1:9/v1"}, "models": config["models"]}
    )
    repair = PairingRepair(settings, None)
    # (claude, gemini, mistral)
    assert repair.family("house-coder")[:3] == (False, False, True)
    assert repair.family("another-name")[:3] == (False, False, True)  # (the "*" entry's)
    assert repair.family("gpt-4o")[:3] == (False, False, False)
    assert repair.family("claude-sonnet-4-5")[:3] == (True, False, False)
    assert repair.family("gemini-2.5-pro")[:3] == (False, True, False)


def test_claude_takes_call_ids_numbered_per_message_through_cachegate_turn_after_turn(
    sdk: Any, proxy_factory: Any
) -> None:
    """A client that numbers calls per message (``call_0`` every turn) in front of Claude: from
    the second turn on every request was refused (``tool_use ids must be unique``: Claude
    checks the whole request). Through cachegate each turn is answered, and each forwarded
    history starts with the one before it (the ids it gave are stable: the cache still reads)."""
    with run_simulator(SimConfig(dialect="anthropic-compat")) as claude:
        proxy = proxy_factory(claude.api_base)
        history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the tests"}]
        sent: list[list[Any]] = []
        for turn in range(3):
            call = {"id": "call_0", "type": "function"}
            call["function"] = {"name": "run", "arguments": f'{{"step": {turn}}}'}
            history += [
                {"role": "assistant", "content": f"Step {turn}.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": f"ran {turn}"},
            ]
            if turn:
                with pytest.raises(openai.BadRequestError, match="ids must be unique"):
                    sdk(claude.api_base).chat.completions.create(
                        model="claude-sonnet-4-5",
                        messages=history,  # type: ignore[arg-type]
                    )
            raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
                model="claude-sonnet-4-5",
                messages=history,  # type: ignore[arg-type]
                extra_headers={"X-Session-Id": "numbered"},
            )
            assert raw.http_response.status_code == 200
            assert raw.headers["x-cachegate-repairs"] == str(2 * turn)  # (a call, its result)
            sent.append(claude.sim.requests[-1].body["messages"])
            history.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
        for before, after in itertools.pairwise(sent):
            assert after[: len(before)] == before


def test_an_interrupted_answer_left_with_no_content_is_a_400_directly_200_through_cachegate(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """A stream cut before its first token leaves ``{"role": "assistant", "content": null}``
    in an agent's history: OpenAI refuses it every turn
    after, and cachegate forwarded it as it was."""
    history = [
        {"role": "user", "content": "Summarise a.py"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Go on"},
    ]
    proxy = proxy_factory(sim.api_base)
    raw = _refused_directly_answered_through(sdk, sim, proxy, history, "got null")
    assert raw.headers["x-cachegate-repairs"] == "1"
    assert sim.sim.requests[-1].body["messages"] == [
        history[0],
        {"role": "assistant", "content": ""},
        history[2],
    ]
    assert proxy.metric("cachegate_pairing_repairs_total", {"kind": "empty_assistant"}) == 1


@pytest.mark.parametrize("model", ["claude-sonnet-4-5", "anthropic/claude-opus-4.5", "house-model"])
def test_an_empty_assistant_message_is_removed_for_claude_which_refuses_an_empty_one(
    sdk: Any, proxy_factory: Any, model: str
) -> None:
    """For a Claude model the repair gave the contentless message ``""``, which Claude refuses
    as well ("all messages must have non-empty content except for the optional final assistant
    message"): the client was told of a repair and got the 400 every turn. It is removed there
    (Claude joins the user turns around it), its cache mark on the message before; a model of
    the user's configured with ``dialect = "anthropic"`` is Claude's too."""
    mark = {"type": "ephemeral"}
    history = [
        {"role": "user", "content": "Summarise a.py", "cache_control": mark},
        {"role": "assistant", "content": None, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"role": "user", "content": "Go on"},
    ]
    with run_simulator(SimConfig(dialect="anthropic-compat")) as claude:
        given = {**history[1], "content": ""}
        with pytest.raises(openai.BadRequestError) as info:  # what the repair made before
            sdk(claude.api_base).chat.completions.create(
                model=model, messages=[history[0], given, history[2]]
            )
        assert "must have non-empty content" in str(info.value)
        proxy = proxy_factory(
            claude.api_base, {"models": {"house-model": {"dialect": "anthropic"}}}
        )
        for _turn in range(2):  # (the next turn resumes the repair: removed again)
            raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
                model=model, messages=history, extra_headers={"X-Session-Id": "claude-empty"}
            )
            assert raw.http_response.status_code == 200
            assert raw.headers["x-cachegate-repairs"] == "1"
            forwarded = claude.sim.requests[-1].body["messages"]
            # the client's own mark on the message before stays (its own, not the removed one's)
            assert forwarded == [history[0], *history[2:]]
            history += [raw.parse().choices[0].message.model_dump(exclude_none=True)]
            history += [{"role": "user", "content": "More"}]
            assert proxy.metric("cachegate_pairing_repairs_total", {"kind": "empty_assistant"})
    # a model of another provider keeps the message, given "" (OpenAI takes it; strict chat
    # templates want the turns alternating)
    with run_simulator(SimConfig()) as sim:
        proxy = proxy_factory(sim.api_base)
        sdk(proxy.base_url).chat.completions.create(model="gpt-4o", messages=history[:3])
        assert sim.sim.requests[-1].body["messages"][1] == given


@pytest.mark.parametrize(
    ("content", "calls"),
    [("", None), (" ", None), ([], None), ("\n", []), ([{"type": "text", "text": ""}], None)],
)
def test_a_blank_assistant_message_a_client_wrote_is_removed_for_claude(
    sdk: Any, proxy_factory: Any, content: Any, calls: Any
) -> None:
    """A client that writes an empty assistant message itself (``""``: the Vercel AI SDK, a
    stream cut before its first token) got Claude's 400 on every turn through cachegate, as
    directly: only a ``null`` one was repaired. For a Claude model it is removed (also one with
    an empty ``tool_calls`` array, whose repair ran first and kept it, and one of blank text
    parts, which Claude refuses as blocks); another provider's model gets it as it was sent
    (OpenAI takes ``""``)."""
    blank: dict[str, Any] = {"role": "assistant", "content": content}
    history = [
        {"role": "user", "content": "Summarise a.py"},
        blank,
        {"role": "user", "content": "Go on"},
    ]
    with run_simulator(SimConfig(dialect="anthropic-compat")) as claude:
        with pytest.raises(openai.BadRequestError) as info:
            sdk(claude.api_base).chat.completions.create(
                model="claude-sonnet-4-5", messages=history
            )
        said = str(info.value)
        assert "must have non-empty content" in said or "text content blocks must be" in said
        if calls is not None:  # (an SDK's empty array on a plain answer)
            blank["tool_calls"] = calls
        proxy = proxy_factory(claude.api_base)
        for _turn in range(2):  # (the next turn resumes the check: removed again)
            raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
                model="claude-sonnet-4-5", messages=history, extra_headers={"X-Session-Id": "blank"}
            )
            assert raw.http_response.status_code == 200
            assert raw.headers["x-cachegate-repairs"] == "1"
            assert claude.sim.requests[-1].body["messages"] == [history[0], *history[2:]]
            history += [raw.parse().choices[0].message.model_dump(exclude_none=True)]
            history += [{"role": "user", "content": "More"}]
    if calls is None:
        with run_simulator(SimConfig()) as sim:
            proxy = proxy_factory(sim.api_base)
            raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
                model="gpt-4o", messages=history[:3]
            )
            assert raw.headers["x-cachegate-repairs"] == "0"
            assert sim.sim.requests[-1].body["messages"] == history[:3]


def test_a_tool_that_returned_none_no_longer_gets_the_provider_s_400(
    sdk: Any, proxy_factory: Any
) -> None:
    """An agent whose tool returned None (a retriever that found nothing) writes its result
    with ``"content": null``: OpenAI refuses the request, ``Invalid value for 'content':
    expected a string, got null.``, and every later turn of the session that resends it.
    Through cachegate the result is given ``""``, on every turn, logged and counted as
    ``null_result``."""
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Find the release notes"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": None},
    ]
    with run_simulator(SimConfig()) as sim:
        with pytest.raises(openai.BadRequestError, match="expected a string, got null"):
            sdk(sim.api_base).chat.completions.create(model="gpt-4o", messages=history)
        proxy = proxy_factory(sim.api_base)
        for turn in range(2):
            raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
                model="gpt-4o", messages=history, extra_headers={"X-Session-Id": "retriever"}
            )
            assert raw.http_response.status_code == 200
            assert raw.headers["x-cachegate-repairs"] == "1"
            sent = sim.sim.requests[-1].body["messages"]
            assert sent[2] == {"role": "tool", "tool_call_id": "call_1", "content": ""}
            assert sent[:2] == history[:2] and sent[3:] == history[3:]
            assert proxy.metric("cachegate_pairing_repairs_total", {"kind": "null_result"}) == (
                turn + 1
            )
            history += [raw.parse().choices[0].message.model_dump(exclude_none=True)]
            history += [{"role": "user", "content": "Try the changelog"}]
        proxy.settle()
        logged = events(proxy.log_dir, "retriever", "request")[-1]["repairs"]
        assert [(r["kind"], r["index"], r["tool_call_id"]) for r in logged] == [
            ("null_result", 2, "call_1")
        ]


def test_an_empty_tool_output_as_parts_no_longer_makes_claude_refuse_every_turn(
    sdk: Any, proxy_factory: Any
) -> None:
    """An MCP tool that printed nothing (``touch``): its result a list of one empty text part.
    Claude refused the request (``text content blocks must be non-empty``), and every later
    turn of the session that sent it. For a Claude model the result says ``(no output)``, an
    empty text part beside an image is taken out, both logged and counted as ``blank_text``;
    OpenAI's model gets the history as sent."""
    blank = {"type": "text", "text": ""}
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    call = {"id": "toolu_1", "type": "function", "function": {"name": "touch", "arguments": "{}"}}
    history: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "Create a.txt"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": [blank]},
        {"role": "user", "content": [image, blank]},
    ]
    with run_simulator(SimConfig(dialect="anthropic-compat")) as claude:
        with pytest.raises(openai.BadRequestError, match="text content blocks must be non-empty"):
            sdk(claude.api_base).chat.completions.create(
                model="claude-sonnet-4-5", messages=history
            )
        proxy = proxy_factory(claude.api_base)
        for turn in range(2):  # (the next turn resumes the repair: taken out again)
            raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
                model="claude-sonnet-4-5", messages=history, extra_headers={"X-Session-Id": "mcp"}
            )
            assert raw.http_response.status_code == 200
            assert raw.headers["x-cachegate-repairs"] == "2"
            sent = claude.sim.requests[-1].body["messages"]
            assert sent[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "(no output)"}
            assert sent[3] == {"role": "user", "content": [image]}
            assert sent[4:] == history[4:] and sent[:2] == history[:2]
            assert proxy.metric("cachegate_pairing_repairs_total", {"kind": "blank_text"}) == (
                2 * (turn + 1)
            )
            history += [raw.parse().choices[0].message.model_dump(exclude_none=True)]
            history += [{"role": "user", "content": "And b.txt"}]
        proxy.settle()
        logged = events(proxy.log_dir, "mcp", "request")[-1]["repairs"]
        assert [(r["kind"], r["index"]) for r in logged] == [("blank_text", 2), ("blank_text", 3)]
        assert logged[0]["tool_call_id"] == "toolu_1"
    with run_simulator(SimConfig()) as sim:
        proxy = proxy_factory(sim.api_base)
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model="gpt-4o", messages=history[:4]
        )
        assert raw.headers["x-cachegate-repairs"] == "0"
        assert sim.sim.requests[-1].body["messages"] == history[:4]


def test_an_openai_refusal_in_a_history_sent_to_claude_is_its_content(
    sdk: Any, proxy_factory: Any
) -> None:
    """A session that moves from an OpenAI model to Claude (a model picker, a gateway's
    fallback): GPT's refusal (``content: null``, ``refusal``) made Claude refuse every later
    turn as an empty message. For Claude its words are the content; for OpenAI it stays."""
    said = "I can't help with that."
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Write the exploit"},
        {"role": "assistant", "content": None, "refusal": said},
        {"role": "user", "content": "Then explain the bug instead"},
    ]
    with run_simulator(SimConfig(dialect="anthropic-compat")) as claude:
        with pytest.raises(openai.BadRequestError) as info:
            sdk(claude.api_base).chat.completions.create(
                model="claude-sonnet-4-5", messages=history
            )
        assert "must have non-empty content" in str(info.value)
        proxy = proxy_factory(claude.api_base)
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model="claude-sonnet-4-5", messages=history
        )
        assert raw.http_response.status_code == 200 and raw.headers["x-cachegate-repairs"] == "1"
        sent = claude.sim.requests[-1].body["messages"]
        assert sent[1] == {**history[1], "content": said} and sent[::2] == history[::2]
    with run_simulator(SimConfig()) as sim:
        proxy = proxy_factory(sim.api_base)
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model="gpt-4o", messages=history
        )
        assert raw.headers["x-cachegate-repairs"] == "0"
        assert sim.sim.requests[-1].body["messages"] == history


def test_a_model_named_as_another_providers_is_no_claude_under_a_claude_catch_all() -> None:
    """Under a ``"*"`` entry with ``dialect = "anthropic"``, a model whose name says OpenAI's
    or DeepSeek's was taken as Claude's by the repair (its empty assistant message removed),
    where the accounting keeps such a name with its own provider; a name no provider's is
    Claude's there, as a ``claude-…`` name is anywhere."""
    settings = settings_from_mapping(
        {
            "upstream": {"base_url": "http://127.0.0.1:9/v1"},
            "models": {"*": {"dialect": "anthropic"}},
        }
    )
    repair = PairingRepair(settings, None)
    history = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "b"},
    ]
    for model, claude in (
        ("gpt-3.5-turbo", False),
        ("deepseek-coder", False),
        ("house-model", True),
        ("claude-sonnet-4-5", True),
    ):
        ex = Exchange("chat", "POST", "chat/completions", 0.0, 0.0)
        forwarded = repair.repair(ex, {"model": model, "messages": history})["messages"]
        assert len(forwarded) == (2 if claude else 3), model


def test_a_claude_catch_all_leaves_gemini_and_mistral_models_their_own_rules(
    sdk: Any, proxy_factory: Any
) -> None:
    """Under a ``"*"`` entry with ``dialect = "anthropic"`` (a gateway in front of Claude
    first), a Mistral model got Claude's repair: its interrupted turn forwarded with ids
    Mistral refuses and no bridge, a 400 every turn; a Gemini model had its white-space message
    removed and reused ids renamed, which Gemini takes. A name of the user's own with
    ``dialect = "gemini"`` (a gateway's alias of a Gemini model) gets Gemini's rules: its
    contentless assistant message, refused by Gemini as ``""``, is removed."""
    interrupted = [
        {"role": "user", "content": "do it"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_abc", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "user", "content": "stop"},
    ]
    config = {"models": {"*": {"dialect": "anthropic"}, "smart": {"dialect": "gemini"}}}
    with run_simulator(SimConfig(mistral_rules=True)) as mistral:
        proxy = proxy_factory(mistral.api_base, config)
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model="mistral-large-latest", messages=interrupted
        )
        assert raw.http_response.status_code == 200
        sent = mistral.sim.requests[-1].body["messages"]
        assert len(sent[1]["tool_calls"][0]["id"]) == 9 and sent[3]["role"] == "assistant"
    spaced = [
        {"role": "user", "content": "do it"},
        {"role": "assistant", "content": " "},
        {"role": "user", "content": "again"},
    ]
    with run_simulator(SimConfig(gemini_rules=True)) as gemini:
        proxy = proxy_factory(gemini.api_base, config)
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model="gemini-2.5-pro", messages=spaced
        )
        assert raw.headers["x-cachegate-repairs"] == "0"
        assert gemini.sim.requests[-1].body["messages"] == spaced
        cut = [spaced[0], {"role": "assistant", "content": None}, spaced[2]]
        with pytest.raises(openai.BadRequestError) as info:
            sdk(gemini.api_base).chat.completions.create(
                model="smart", messages=[cut[0], {**cut[1], "content": ""}, cut[2]]
            )
        assert "empty text parameter" in info.value.response.text
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model="smart", messages=cut
        )
        assert raw.http_response.status_code == 200 and raw.headers["x-cachegate-repairs"] == "1"
        assert gemini.sim.requests[-1].body["messages"] == [cut[0], cut[2]]


def test_repaired_prefix_is_identical_on_every_turn(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    c = sdk(proxy.base_url)
    c.chat.completions.create(model="gpt-4o", messages=INTERRUPTED)  # type: ignore[arg-type]
    first = sim.sim.requests[-1].body["messages"]
    later = [
        *INTERRUPTED,
        {"role": "assistant", "content": "Looking at b.py"},
        {"role": "user", "content": "go on"},
    ]
    c.chat.completions.create(model="gpt-4o", messages=later)  # type: ignore[arg-type]
    second = sim.sim.requests[-1].body["messages"]
    assert orjson.dumps(second[: len(first)]) == orjson.dumps(first)


def test_valid_history_is_forwarded_as_the_clients_exact_bytes(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    body = b'{"model": "gpt-4o",  "messages": [{"role": "user", "content": "caf\\u00e9"}], "unknown_field": {"x": 1}, "prompt_cache_key": "k"}'
    import httpx

    r = httpx.post(
        proxy.base_url + "/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200
    assert sim.sim.requests[-1].raw == body


@pytest.mark.parametrize("value", ["1", "true", "Yes", "on"])
def test_strict_mode_rejects_with_a_diagnosis_and_contacts_nobody(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, value: str
) -> None:
    proxy = proxy_factory(sim.api_base)
    before = len(sim.sim.requests)
    with pytest.raises(openai.BadRequestError) as info:
        sdk(proxy.base_url).chat.completions.create(
            model="gpt-4o",
            messages=INTERRUPTED,  # type: ignore[arg-type]
            extra_headers={"X-Cachegate-Strict": value},  # the values the config file takes
        )
    body = info.value.body
    assert isinstance(body, dict)
    assert body["code"] == "strict_pairing"
    assert "messages[2]" in body["message"] and "call_b" in body["message"]
    assert "dangling_call" in body["message"] and "invalid_arguments" in body["message"]
    assert len(sim.sim.requests) == before
    assert proxy.metric("cachegate_strict_rejections_total") == 1
    # the headers of every chat answer, cachegate's own refusals too
    assert info.value.response.headers["x-cachegate-repairs"] == "0"
    assert info.value.response.headers["x-cachegate-session"]


def test_no_repairs_header_where_nothing_was_checked(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """With the repair and strict mode off, a chat answer said ``X-Cachegate-Repairs: 0`` of a
    history never checked, and so did a refusal (the README says it is sent while either is
    on: then on every chat answer, cachegate's own refusals too)."""
    import httpx

    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    big = {**body, "messages": [{"role": "user", "content": "x" * 500}]}
    limit = {"server": {"max_body_bytes": 100}}
    off = proxy_factory(sim.api_base, {"pairing": {"repair": False}, **limit})
    answer = httpx.post(off.base_url + "/chat/completions", json=body)
    assert answer.status_code == 200 and "x-cachegate-repairs" not in answer.headers
    assert answer.headers["x-cachegate-session"]
    refused = httpx.post(off.base_url + "/chat/completions", json=big)
    assert refused.status_code == 413 and "x-cachegate-repairs" not in refused.headers
    # strict mode asked by the request's header: on, for it
    strict = {"X-Cachegate-Strict": "1"}
    answer = httpx.post(off.base_url + "/chat/completions", json=body, headers=strict)
    assert answer.status_code == 200 and answer.headers["x-cachegate-repairs"] == "0"
    on = proxy_factory(sim.api_base, limit)  # (the repair on, by default)
    refused = httpx.post(on.base_url + "/chat/completions", json=big)
    assert refused.status_code == 413 and refused.headers["x-cachegate-repairs"] == "0"
    answer = httpx.post(on.base_url + "/chat/completions", json=body)
    assert answer.status_code == 200 and answer.headers["x-cachegate-repairs"] == "0"


def test_strict_mode_from_config_lets_valid_histories_through(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base, {"pairing": {"strict": True}})
    ok = sdk(proxy.base_url).chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
    )
    assert ok.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        sdk(proxy.base_url).chat.completions.create(model="gpt-4o", messages=INTERRUPTED)  # type: ignore[arg-type]


def test_orphan_policy_drop(sim: RunningSimulator, sdk: Any, proxy_factory: Any) -> None:
    proxy = proxy_factory(sim.api_base, {"pairing": {"orphan_policy": "drop"}})
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "tool", "tool_call_id": "ghost", "content": "stale output"},
        {"role": "user", "content": "again"},
    ]
    sdk(proxy.base_url).chat.completions.create(model="gpt-4o", messages=messages)  # type: ignore[arg-type]
    assert [m["content"] for m in sim.sim.requests[-1].body["messages"]] == ["hi", "again"]


@pytest.mark.parametrize("content", [None, "", []])
def test_a_cut_answer_with_an_empty_tool_calls_keeps_the_turns_alternating(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any, content: Any
) -> None:
    """A stream cut before its first token, by an SDK that writes ``"tool_calls": []`` on every
    plain answer, leaves an assistant message of nothing else. It was removed for every model:
    two user messages in a row, which strict chat templates refuse (Gemma's, Llama 2's,
    Mistral 7B's on vLLM or llama.cpp: "Conversation roles must alternate"), on every turn."""
    proxy = proxy_factory(sim.api_base)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": content, "tool_calls": []},
        {"role": "user", "content": "again"},
    ]
    raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
        model="google/gemma-2-9b-it",
        messages=messages,  # type: ignore[arg-type]
    )
    assert raw.headers["x-cachegate-repairs"] == "1"
    forwarded = sim.sim.requests[-1].body["messages"]
    assert forwarded == [messages[0], {"role": "assistant", "content": ""}, messages[2]]


def test_a_repair_that_would_leave_no_message_is_not_made(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """A history of one empty assistant message (for a Claude model, which has it removed)
    went as ``messages: []``: the provider's 400 spoke of an empty array the client never
    sent, with a repair counted. The provider now answers what the client sent."""
    messages = [{"role": "assistant", "content": None, "tool_calls": []}]
    proxy = proxy_factory(sim.api_base, {"pairing": {"orphan_policy": "downgrade"}})
    with pytest.raises(openai.BadRequestError) as info:
        sdk(proxy.base_url).chat.completions.create(
            model="claude-sonnet-4-5",
            messages=messages,  # type: ignore[arg-type]
        )
    assert sim.sim.requests[-1].body["messages"] == messages
    assert "'messages': empty array" not in str(info.value)  # (the simulator's, as OpenAI's)
    assert info.value.response.headers["x-cachegate-repairs"] == "0"


def test_orphans_alone_under_drop_are_downgraded_not_sent_as_they_were(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """Under ``orphan_policy = "drop"``, a history of orphan results alone (an agent that
    trimmed its history to its last results) would be left empty: it went as the client sent
    it, and the provider's 400 came back (the Responses route downgrades them there). They are
    downgraded, as under ``downgrade``, and answered."""
    proxy = proxy_factory(sim.api_base, {"pairing": {"orphan_policy": "drop"}})
    messages = [{"role": "tool", "tool_call_id": "ghost", "content": "stale output"}]
    raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
        model="gpt-4o",
        messages=messages,  # type: ignore[arg-type]
    )
    assert raw.headers["x-cachegate-repairs"] == "1"
    assert raw.parse().choices[0].message.content
    forwarded = sim.sim.requests[-1].body["messages"]
    assert [m["role"] for m in forwarded] == ["user"]
    assert "stale output" in forwarded[0]["content"]
    assert "(no matching tool call)" in forwarded[0]["content"]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"a":1}', b'{"stream_options":{"include_usage":true},"a":1}'),
        (b'  {\n "a": 1}', b'  {"stream_options":{"include_usage":true},\n "a": 1}'),
        (b"{}", b'{"stream_options":{"include_usage":true}}'),
    ],
)
def test_usage_option_is_spliced_into_the_raw_bytes(raw: bytes, expected: bytes) -> None:
    assert splice_usage_option(raw) == expected
    assert orjson.loads(expected)["stream_options"] == {"include_usage": True}


def test_stream_options_null_still_gets_usage_recorded(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    import httpx

    proxy = proxy_factory(sim.api_base)
    body = {
        "model": "gpt-4o",
        "stream": True,
        "stream_options": None,
        "messages": [{"role": "user", "content": "count me"}],
    }
    with httpx.stream("POST", proxy.base_url + "/chat/completions", json=body) as r:
        data = b"".join(r.iter_raw())
    assert b'"choices":[]' not in data  # the usage-only event cachegate asked for stays hidden
    assert sim.sim.requests[-1].body["stream_options"] == {"include_usage": True}
    assert proxy.metric("cachegate_tokens_total", {"model": "gpt-4o", "kind": "prompt"}) > 0


@pytest.mark.parametrize("options", [b'"x"', b"[]", b"true"])
def test_stream_options_that_are_no_object_reach_the_provider_as_sent(
    options: bytes, scripted: Any, proxy_factory: Any
) -> None:
    """``{"include_usage": true}`` took their place: a request the provider refuses (a client's
    bug) was answered, and the bug stayed hidden."""
    import httpx

    upstream, url = scripted(chunks=[b"data: [DONE]\n\n"])
    proxy = proxy_factory(url)
    raw = (
        b'{"model":"gpt-4o","stream":true,"stream_options":' + options
        + b',"messages":[{"role":"user","content":"hi"}]}'
    )  # fmt: skip
    headers = {"content-type": "application/json"}
    with httpx.stream(
        "POST", proxy.base_url + "/chat/completions", content=raw, headers=headers
    ) as r:
        r.read()
    assert upstream.requests[-1]["body"] == raw


def test_vllms_continuous_usage_option_is_left_as_sent_and_its_usage_relayed(
    scripted: Any, proxy_factory: Any
) -> None:
    """vLLM and SGLang send usage for any ``stream_options`` object (``include_usage`` defaults
    to true there): ``{"continuous_usage_stats": true}`` got ``include_usage`` added, and the
    usage events the client would have had directly were taken out of its stream."""
    import httpx

    chunk = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    events = [
        chunk + b'"delta":{"content":"hi"},"finish_reason":null}],'
        b'"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}\n\n',
        chunk + b'"delta":{},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}\n\n',
        b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
        b'"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}\n\n',
        b"data: [DONE]\n\n",
    ]
    upstream, url = scripted(chunks=events)
    proxy = proxy_factory(url)
    raw = (
        b'{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":true},'
        b'"messages":[{"role":"user","content":"hi"}]}'
    )
    headers = {"content-type": "application/json", "X-Session-Id": "vllm"}
    with httpx.stream(
        "POST", proxy.base_url + "/chat/completions", content=raw, headers=headers
    ) as r:
        got = r.read()
    assert upstream.requests[-1]["body"] == raw
    assert got == b"".join(events)
    proxy.settle()
    assert proxy.metric("cachegate_tokens_total", {"model": "other", "kind": "prompt"}) == 9


def test_vllms_continuous_usage_beside_include_usage_false_is_not_turned_on(
    scripted: Any, proxy_factory: Any
) -> None:
    """``{"include_usage": false, "continuous_usage_stats": true}``: vLLM sends no usage (the
    second needs the first). cachegate asked for usage with the second kept, and vLLM put usage
    in every chunk, which the client had refused; it asks for the last event's alone (taken
    out of the stream, as ever)."""
    import httpx

    upstream, url = scripted(chunks=[b"data: [DONE]\n\n"])
    proxy = proxy_factory(url)
    body = {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": False, "continuous_usage_stats": True},
        "messages": [{"role": "user", "content": "hi"}],
    }
    httpx.post(proxy.base_url + "/chat/completions", json=body).read()
    assert json.loads(upstream.requests[-1]["body"])["stream_options"] == {"include_usage": True}


def test_an_unexpected_failure_is_a_500_in_openai_shape_and_nothing_is_forwarded(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    import httpx

    proxy = proxy_factory(sim.api_base)

    class Broken:
        async def apply(self, ex: Any, state: Any, body: Any) -> Any:
            raise KeyError("bug in a transform")

    proxy.gateway.chat.transforms.append(Broken())
    before = len(sim.sim.requests)
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"
    assert r.headers["x-cachegate-session"]
    assert len(sim.sim.requests) == before


def test_a_growing_agent_history_is_spliced_and_still_repaired_and_relayed_exactly(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " + "Rules. " * 4000},
        {"role": "user", "content": "Fix the failing test"},
    ]
    for turn in range(4):
        raw = client.chat.completions.with_raw_response.create(model="gpt-4o", messages=history)
        assert raw.http_response.status_code == 200
        assert raw.headers["x-cachegate-repairs"] == "0"
        sent = sim.sim.requests[-1].raw
        assert orjson.loads(sent) == {"messages": history, "model": "gpt-4o"}
        call = {
            "id": f"call_{turn}",
            "type": "function",
            "function": {"name": "run", "arguments": '{"cmd": "pytest"}'},
        }
        history += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"{turn} failed"},
        ]
    assert proxy.gateway.chat.spliced_parses == 3  # every turn after the first
    # An interrupted turn on top of a spliced history is still repaired.
    dangling = {
        "id": "call_x",
        "type": "function",
        "function": {"name": "run", "arguments": "{}"},
    }
    history += [
        {"role": "assistant", "content": None, "tool_calls": [dangling]},
        {"role": "user", "content": "stop"},
    ]
    raw = client.chat.completions.with_raw_response.create(model="gpt-4o", messages=history)
    assert raw.http_response.status_code == 200
    assert raw.headers["x-cachegate-repairs"] == "1"
    assert proxy.gateway.chat.spliced_parses == 4
    forwarded = sim.sim.requests[-1].body["messages"]
    assert forwarded[-2]["role"] == "tool" and forwarded[-2]["tool_call_id"] == "call_x"
    assert forwarded[: len(history) - 1] == history[:-1]


def test_a_client_with_the_time_in_its_system_prompt_holds_one_history_not_one_per_turn(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """A client without a session id whose system prompt opens with the time: each turn's
    first 16 KiB differ, so each body was filed under a key of its own and kept, though no
    later body continues it; and, its system message changed, none of its history was shared
    with the turn before, so every turn's history was a copy of its own, held by the log's
    bases and the memos (~160 MB more RSS over 200 turns of up to ~600 KB). The history after
    the system prompt is shared, and only the last body is kept (and the first). Its bodies
    are parsed in what changed and what was appended, as an appending agent's are."""
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)
    rules = "Rules. " * 3000

    def run(timed: bool) -> tuple[float, list[int]]:
        task = {"role": "user", "content": f"Fix the failing test (timed: {timed})"}
        history: list[dict[str, Any]] = [task]
        sizes = []
        for turn in range(12):
            clock = f"It is 10:{turn:02d}. " if timed else ""
            system = {"role": "system", "content": clock + "You are a coding agent. " + rules}
            messages = [system, *history]
            client.chat.completions.create(model="gpt-4o", messages=messages)
            assert sim.sim.requests[-1].body["messages"] == messages
            sizes.append(len(sim.sim.requests[-1].raw))
            call = {"id": f"c{turn}", "type": "function", "function": {"name": "run"}}
            call["function"]["arguments"] = "{}"
            history += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"c{turn}", "content": f"{turn} " * 3000},
            ]
        proxy.settle()
        assert httpx.get(proxy.url + "/metrics").status_code == 200
        return proxy.metric("cachegate_sessions_memory_bytes"), sizes

    plain, _ = run(timed=False)
    memos = proxy.gateway.chat.memos.bytes
    spliced = proxy.gateway.chat.spliced_parses
    both, sizes = run(timed=True)
    # its first bytes change every turn, its history is spliced all the same: each turn after
    # the second (the first keeps one message after the prompt: a task other conversations
    # may open with too)
    assert proxy.gateway.chat.spliced_parses - spliced == 12 - 2
    # its last body (and its first: a one-message history tells no conversation from another)
    assert proxy.gateway.chat.memos.bytes - memos == sizes[0] + sizes[-1]
    assert both - plain <= 1.25 * plain  # about what the same history without the time holds
    assert len(proxy.gateway.chat.sessions) == 2  # (one session each)


def test_conversations_that_open_alike_taking_turns_without_an_id_are_each_spliced(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """Conversations without a session id, one task under six system prompts or six models
    (found to be one session, each filed under a key of its own), taking turns: each one's
    bodies are kept for its next turn, though the others' come in between (kept for the last
    four keys only, none of six was ever spliced)."""
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)
    task = {"role": "user", "content": "Fix the failing test"}
    rules = "Rules. " * 3000
    histories: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": f"You are agent {n % 3}. " + rules}, task] for n in range(6)
    ]
    for turn in range(5):
        for n, history in enumerate(histories):
            client.chat.completions.create(model=f"gpt-4o-{n // 3}", messages=history)
            assert sim.sim.requests[-1].body["messages"] == history
            history += [
                {"role": "assistant", "content": f"step {turn} of {n}"},
                {"role": "user", "content": f"go on {turn}"},
            ]
    assert len(proxy.gateway.chat.sessions) == 1
    assert proxy.gateway.chat.spliced_parses == 6 * 4  # each turn after each one's first


def test_one_shot_requests_that_share_a_long_prompt_are_weighed_by_what_each_holds(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """A classifier loop beside an agent, no session ids: each call a session of its own, its
    18 KB prompt parsed once (the calls are spliced onto the body before: its objects). Each
    was weighed as four times its body, ~80 KB where it held ~7: 6,700 calls reached the
    default 512 MiB budget with 98 MB of RSS, and the agent's session was forgotten (its next
    turn a new session)."""
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)
    system = {"role": "system", "content": "Classify the ticket as billing, bug or other. " * 400}
    assert len(system["content"]) > 18_000
    sessions = proxy.gateway.chat.sessions
    for k in range(40):
        ticket = {"role": "user", "content": f"Ticket {k}: my invoice {k} is wrong."}
        client.chat.completions.create(model="gpt-4o", messages=[system, ticket])
    assert len(sessions) == 40
    assert proxy.gateway.chat.spliced_parses >= 38  # (the prompt's objects shared)
    per_session = sessions.bytes / len(sessions)
    assert per_session < 8 * 1024, per_session  # (the first holds the prompt: ~72 KB of it)


def test_conversations_of_one_task_under_other_prompts_are_each_weighed(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """Sub-agents given one task under their own role prompts, taking turns in one session:
    each holds its own history, and the memory estimate counts each (sharing what follows a
    changed system prompt had shared their task message, and the estimate took them for
    turns of one history: ~0.7 MB for six, where they held ~2 MB)."""
    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)
    task = {"role": "user", "content": "Review the change"}

    def run(sid: str, roles: int) -> int:
        histories = [
            [{"role": "system", "content": f"You are reviewer {n} of {sid}."}, task]
            for n in range(roles)
        ]
        for turn in range(6):
            for n, history in enumerate(histories):
                client.chat.completions.create(
                    model="gpt-4o", messages=history, extra_headers={"X-Session-Id": sid}
                )
                history += [
                    {"role": "assistant", "content": f"note {turn} of {n}: " + "z" * 20_000},
                    {"role": "user", "content": "go on"},
                ]
        return proxy.gateway.chat.sessions.get(sid).weight  # type: ignore[no-any-return]

    one = run("alone", 1)
    four = run("team", 4)
    assert four > 2 * one, (one, four)  # (the others are counted for what they hold alone)


def test_an_agent_that_moves_its_cache_mark_each_turn_is_parsed_from_the_message_it_left(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """A client that marks its newest message for the provider's cache (``cache_control`` on
    its text part, as Claude through an OpenAI-compatible gateway takes it) and takes the mark
    off the message before: its bytes never continued the last body's, so each turn was parsed
    whole, and its history compared and hashed anew (~7 ms of CPU a request at 640 KB,
    against ~2 for an agent that appends). The body is parsed from the message that lost its
    mark on, relayed as sent, repaired and logged as before."""
    from tests.e2e_support import run_cli

    proxy = proxy_factory(sim.api_base)
    client = sdk(proxy.base_url)
    mark = {"type": "ephemeral"}

    def marked(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        last = dict(history[-1])
        last["content"] = [{"type": "text", "text": last["content"], "cache_control": mark}]
        return [*history[:-1], last]

    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " + "Rules. " * 4000},
        {"role": "user", "content": "Fix the failing test"},
    ]
    for turn in range(5):
        messages = marked(history)
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=messages, extra_headers={"X-Session-Id": "marks"}
        )
        assert raw.http_response.status_code == 200
        assert orjson.loads(sim.sim.requests[-1].raw) == {"messages": messages, "model": "gpt-4o"}
        history += [
            {"role": "assistant", "content": f"Ran step {turn}."},
            {"role": "user", "content": f"step {turn} output: " + "ok " * 200},
        ]
    assert proxy.gateway.chat.spliced_parses == 4  # every turn after the first
    dangling = {"id": "call_x", "type": "function", "function": {"name": "run", "arguments": "{}"}}
    history += [
        {"role": "assistant", "content": None, "tool_calls": [dangling]},
        {"role": "user", "content": "stop"},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o", messages=marked(history), extra_headers={"X-Session-Id": "marks"}
    )
    assert raw.headers["x-cachegate-repairs"] == "1"
    assert proxy.gateway.chat.spliced_parses == 5
    forwarded = sim.sim.requests[-1].body["messages"]
    assert forwarded[-2]["role"] == "tool" and forwarded[-2]["tool_call_id"] == "call_x"
    proxy.settle()
    replayed = run_cli("sessions", "replay", "marks", "--log-dir", str(proxy.log_dir))
    assert [orjson.loads(x)["messages"] for x in replayed.out.splitlines()] == [
        r.body["messages"] for r in sim.sim.requests
    ]


def test_observers_of_finished_exchanges_run_in_order_in_short_slices() -> None:
    """Many exchanges finishing in one turn of the loop: their observers run in the order the
    exchanges finished, in slices, and the loop gets to other work (a socket, a timer) between
    slices instead of after all of them; in_flight counts them until they have run."""
    import asyncio
    import time

    import httpx

    from proxy.chat import OBSERVER_SLICE_S, ChatPipeline
    from proxy.config import settings_from_mapping
    from proxy.pipeline import Exchange
    from proxy.relay import Relay
    from proxy.sessions import MemorySessionStore

    seen: list[int] = []

    class Slow:
        def on_request(self, ex: Exchange) -> None: ...

        def on_response(self, ex: Exchange) -> None:
            time.sleep(0.0005)  # an expensive observer: 0.5 ms per exchange
            seen.append(ex.exchange_id)

    async def run() -> None:
        settings = settings_from_mapping({"upstream": {"base_url": "http://127.0.0.1:9/v1"}})
        relay = Relay(httpx.AsyncHTTPTransport(), "http://127.0.0.1:9/v1", httpx.Timeout(5.0))
        chat = ChatPipeline(settings, relay, MemorySessionStore(), [Slow()], api_key=lambda: None)
        between: list[int] = []
        loop = asyncio.get_running_loop()
        for i in range(100):  # a hundred exchanges finish in the same turn
            chat._after_response(
                Exchange("chat", "POST", "chat/completions", 0.0, 0.0, exchange_id=i)
            )
        loop.call_soon(lambda: between.append(len(seen)))  # other work, queued after them
        assert chat.in_flight == 100 and not chat.idle.is_set()
        await asyncio.wait_for(chat.idle.wait(), 5)
        assert seen == list(range(100))
        assert chat.in_flight == 0
        # the other work ran after the first slice (~2 ms of observers), not after all hundred
        assert OBSERVER_SLICE_S <= 0.005
        assert between and 1 <= between[0] <= 20

    asyncio.run(run())


def test_an_inferred_id_drawn_twice_in_one_second_makes_no_session_replace_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inferred ids are the second and 8 hex digits: two conversations starting in one second
    may draw the same digits, and the second replaced the first in the store (one log for
    both, the first one's accounting lost). The id is drawn again."""
    import httpx

    from proxy import sessions
    from proxy.chat import ChatPipeline
    from proxy.relay import Relay
    from proxy.sessions import MemorySessionStore

    drawn = iter(["0badcafe", "0badcafe", "0badcafe", "5eed5eed"])
    monkeypatch.setattr(sessions._id_bits, "take", lambda: next(drawn))
    settings = settings_from_mapping({"upstream": {"base_url": "http://127.0.0.1:9/v1"}})
    relay = Relay(httpx.AsyncHTTPTransport(), "http://127.0.0.1:9/v1", httpx.Timeout(5.0))
    store = MemorySessionStore()
    chat = ChatPipeline(settings, relay, store, [], api_key=lambda: None)
    now = 1_790_000_000.0
    first, _ = chat.resolve_session({}, None, {"messages": [{"role": "user", "content": "a"}]}, now)
    other, _ = chat.resolve_session({}, None, {"messages": [{"role": "user", "content": "b"}]}, now)
    assert first.id == "20260921-141320-0badcafe" and other.id == "20260921-141320-5eed5eed"
    assert store.get(first.id) is first and store.get(other.id) is other
    # and each goes on in its own (an inferred session's opening is indexed)
    turn = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "ok"}]
    again, _ = chat.resolve_session({}, None, {"messages": [*turn, *turn[:1]]}, now + 1)
    assert again is first


def test_request_observers_run_after_the_forward_and_before_the_response_observers() -> None:
    """An exchange's request observers (its log line) are queued when it is forwarded, not run
    before it: they run on the next turn of the loop, ahead of that exchange's response
    observers, once each, and a retry runs them at once if they have not run yet."""
    import asyncio

    import httpx

    from proxy.chat import ChatPipeline
    from proxy.config import settings_from_mapping
    from proxy.pipeline import Exchange
    from proxy.relay import Relay
    from proxy.sessions import MemorySessionStore

    seen: list[tuple[str, int]] = []

    class Recording:
        def on_request(self, ex: Exchange) -> None:
            seen.append(("request", ex.exchange_id))

        def on_response(self, ex: Exchange) -> None:
            seen.append(("response", ex.exchange_id))

    async def run() -> None:
        settings = settings_from_mapping({"upstream": {"base_url": "http://127.0.0.1:9/v1"}})
        relay = Relay(httpx.AsyncHTTPTransport(), "http://127.0.0.1:9/v1", httpx.Timeout(5.0))
        chat = ChatPipeline(
            settings, relay, MemorySessionStore(), [Recording()], api_key=lambda: None
        )
        a, b, c = (
            Exchange("chat", "POST", "chat/completions", 0.0, 0.0, exchange_id=i) for i in (1, 2, 3)
        )
        chat._before_forward(a)
        chat._before_forward(b)
        assert seen == []  # nothing ran before the forward
        chat._after_response(b)  # b ends first
        chat._before_forward(c)
        chat._request_observers(c)  # a retry of c: its request line goes first, now
        assert seen == [("request", 3)]
        chat._after_response(a)
        chat._after_response(c)
        assert chat.in_flight == 6  # three request and three response entries queued
        await asyncio.wait_for(chat.idle.wait(), 5)
        assert seen == [
            ("request", 3),
            ("request", 1),
            ("request", 2),
            ("response", 2),
            ("response", 1),
            ("response", 3),
        ]
        assert chat.in_flight == 0

    asyncio.run(run())


def test_observers_of_many_exchanges_each_see_them_in_order_after_the_observers_before_them() -> (
    None
):
    """Forty exchanges due at once run observer by observer in batches: every observer sees
    every exchange's request and response once, in the order they became due, and always after
    the observers before it in the list (the event log reads what accounting noted)."""
    import asyncio

    import httpx

    from proxy.chat import OBSERVER_FIRST_GUESS_S, OBSERVER_SLICE_S, ChatPipeline
    from proxy.config import settings_from_mapping
    from proxy.pipeline import Exchange
    from proxy.relay import Relay
    from proxy.sessions import MemorySessionStore

    class Noting:
        def on_request(self, ex: Exchange) -> None:
            ex.transforms["noted"] = "request"

        def on_response(self, ex: Exchange) -> None:
            ex.cache = {"noted": ex.exchange_id}

    class Reading:
        def __init__(self) -> None:
            self.seen: list[tuple[str, int, object]] = []

        def on_request(self, ex: Exchange) -> None:
            self.seen.append(("request", ex.exchange_id, ex.transforms.get("noted")))

        def on_response(self, ex: Exchange) -> None:
            self.seen.append(("response", ex.exchange_id, ex.cache))

    async def run() -> None:
        settings = settings_from_mapping({"upstream": {"base_url": "http://127.0.0.1:9/v1"}})
        relay = Relay(httpx.AsyncHTTPTransport(), "http://127.0.0.1:9/v1", httpx.Timeout(5.0))
        reading = Reading()
        chat = ChatPipeline(
            settings, relay, MemorySessionStore(), [Noting(), reading], api_key=lambda: None
        )
        count = 20
        assert 2 * count > OBSERVER_SLICE_S / OBSERVER_FIRST_GUESS_S  # more than one batch
        exchanges = [
            Exchange("chat", "POST", "chat/completions", 0.0, 0.0, exchange_id=i)
            for i in range(count)
        ]
        expected = []
        for ex in exchanges:  # each request, then the previous exchange's response
            chat._before_forward(ex)
            expected.append(("request", ex.exchange_id, "request"))
            if ex.exchange_id:
                chat._after_response(exchanges[ex.exchange_id - 1])
                i = ex.exchange_id - 1
                expected.append(("response", i, {"noted": i}))
        chat._after_response(exchanges[-1])
        expected.append(("response", count - 1, {"noted": count - 1}))
        await asyncio.wait_for(chat.idle.wait(), 5)
        assert reading.seen == expected
        assert chat.in_flight == 0

    asyncio.run(run())


def test_costly_observers_after_cheap_ones_get_short_slices_again_at_once() -> None:
    """Batches are sized by the cost measured per entry: after hundreds of cheap entries
    (requests), costly ones (streams ending) may fill one batch sized by the cheap ones, but the
    next slices are short again (the estimate goes up at once, down gradually)."""
    import asyncio
    import collections
    import time

    import httpx

    from proxy.chat import OBSERVER_BATCH, OBSERVER_SLICE_S, ChatPipeline
    from proxy.config import settings_from_mapping
    from proxy.pipeline import Exchange
    from proxy.relay import Relay
    from proxy.sessions import MemorySessionStore

    turn = 0
    per_turn: collections.Counter[int] = collections.Counter()

    class Costly:
        def on_request(self, ex: Exchange) -> None: ...

        def on_response(self, ex: Exchange) -> None:
            time.sleep(0.0005)
            per_turn[turn] += 1

    async def run() -> None:
        nonlocal turn
        settings = settings_from_mapping({"upstream": {"base_url": "http://127.0.0.1:9/v1"}})
        relay = Relay(httpx.AsyncHTTPTransport(), "http://127.0.0.1:9/v1", httpx.Timeout(5.0))
        chat = ChatPipeline(settings, relay, MemorySessionStore(), [Costly()], api_key=lambda: None)
        loop = asyncio.get_running_loop()

        def tick() -> None:  # counts turns of the loop while observers are due
            nonlocal turn
            turn += 1
            if chat.in_flight:
                loop.call_soon(tick)

        exchanges = [
            Exchange("chat", "POST", "chat/completions", 0.0, 0.0, exchange_id=i)
            for i in range(400)
        ]
        for ex in exchanges:
            chat._before_forward(ex)
        await asyncio.wait_for(chat.idle.wait(), 5)  # the cheap ones: the estimate goes down
        for ex in exchanges[:150]:
            chat._after_response(ex)
        loop.call_soon(tick)
        await asyncio.wait_for(chat.idle.wait(), 10)
        counts = [per_turn[t] for t in sorted(per_turn)]
        assert sum(counts) == 150 and len(counts) > 2
        assert counts[0] <= OBSERVER_BATCH
        fit = OBSERVER_SLICE_S / 0.0005
        assert all(n <= 2 * fit for n in counts[1:]), counts

    asyncio.run(run())


def test_request_lines_forwarded_out_of_order_are_coded_only_against_lines_already_written() -> (
    None
):
    """Exchange 2 of a session is forwarded before exchange 1 (which waited, e.g. in a
    compaction): each request line may only name a base whose own line came before it, so the
    log replays both histories exactly."""
    import asyncio

    import httpx

    from proxy.chat import ChatPipeline
    from proxy.config import settings_from_mapping
    from proxy.eventlog import replay
    from proxy.observers import EventLogObserver
    from proxy.pipeline import Exchange
    from proxy.relay import Relay
    from proxy.sessions import MemorySessionStore

    class Lines:
        def __init__(self) -> None:
            self.events: list[dict[str, Any]] = []
            self.broken: dict[str, None] = {}

        def emit(
            self, session_id: str, event: dict[str, Any], first_in_file: bool = False, **kw: Any
        ) -> bool:
            self.events.append(event)
            return True

    async def run() -> None:
        settings = settings_from_mapping({"upstream": {"base_url": "http://127.0.0.1:9/v1"}})
        relay = Relay(httpx.AsyncHTTPTransport(), "http://127.0.0.1:9/v1", httpx.Timeout(5.0))
        store = MemorySessionStore()
        store.create("s1", 0.0).meta_written = True
        lines = Lines()
        log = EventLogObserver(settings, store, lines)  # type: ignore[arg-type]
        chat = ChatPipeline(settings, relay, store, [log], api_key=lambda: None)
        first = [{"role": "user", "content": "a"}]
        second = [*first, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
        exchanges = []
        for i, messages in (
            (2, second),
            (1, first),
            (3, [*second, {"role": "user", "content": "d"}]),
        ):
            ex = Exchange("chat", "POST", "chat/completions", 0.0, 0.0, exchange_id=i)
            ex.session_id, ex.body = "s1", {"messages": messages}
            exchanges.append(ex)
            chat._before_forward(ex)
        await asyncio.wait_for(chat.idle.wait(), 5)
        written = [e["exchange"] for e in lines.events]
        assert written == [2, 1, 3]
        for event in lines.events:
            base = event["base_exchange"]
            assert base is None or written.index(base) < written.index(event["exchange"])
        assert lines.events[2]["base_exchange"] == 2 and lines.events[2]["base"] == 3
        rebuilt = dict(replay(lines.events))
        assert rebuilt == {ex.exchange_id: ex.body["messages"] for ex in exchanges}

    asyncio.run(run())


def test_the_repair_state_lives_while_the_session_keeps_a_defect() -> None:
    """Kept between turns to resume from, and let go once a turn needs no repair (it could
    never be resumed from again, and it holds a copy of the history)."""
    repair = PairingRepair(settings_from_mapping({}), None)
    state = SessionState(id="s", created=0.0, last_seen=0.0)

    def turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ex = Exchange(route="chat", method="POST", path="chat/completions", started_at=0, t0=0)
        return repair.repair(ex, {"messages": messages}, state)["messages"]

    call = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    history = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "stop, go on"},
    ]
    first = turn(history)
    assert [m["role"] for m in first] == ["user", "assistant", "tool", "user"]
    assert "pairing_repair" in state.extra
    history = [*history, {"role": "tool", "tool_call_id": "c1", "content": "late"}]
    assert turn(history) == [history[0], history[1], history[3], history[2]]  # moved back
    assert "pairing_repair" in state.extra
    clean = [*history[:2], history[3]]
    assert turn(clean) == clean
    assert "pairing_repair" not in state.extra


@pytest.mark.parametrize(("budget_mb", "memo_mib"), [(512, 128), (64, 16), (0, 128)])
def test_the_bodies_kept_for_the_next_turn_are_bounded_with_or_without_a_memory_budget(
    budget_mb: int, memo_mib: int
) -> None:
    """The parsed bodies kept so that a next turn is parsed only in what it appended take ~4
    bytes per byte kept: a quarter of the budget. Without a budget (0) they keep their own
    bound, since they outlive the sessions they came from."""
    import httpx

    from proxy.chat import ChatPipeline
    from proxy.relay import Relay
    from proxy.sessions import MemorySessionStore

    settings = settings_from_mapping(
        {
            "upstream": {"base_url": "http://127.0.0.1:9/v1"},
            "sessions": {"max_memory_mb": budget_mb},
        }
    )
    relay = Relay(httpx.AsyncHTTPTransport(), "http://127.0.0.1:9/v1", httpx.Timeout(5.0))
    chat = ChatPipeline(settings, relay, MemorySessionStore(), [], api_key=lambda: None)
    assert chat.memos.max_bytes == memo_mib * 1024 * 1024


@pytest.mark.parametrize("explicit", [True, False])
def test_the_bodies_kept_for_a_forgotten_session_are_let_go(
    sim: RunningSimulator, proxy_factory: Any, explicit: bool
) -> None:
    """Sessions forgotten for count (16 held): the bodies kept for their next turn stayed until
    the memos' own bound, a quarter of the budget in raw bytes (~270 MB of RSS for 8,000
    sessions of 22 KB), none of it in ``cachegate_sessions_memory_bytes``."""
    proxy = proxy_factory(sim.api_base, {"sessions": {"max_sessions": 4}})
    for i in range(40):
        body = {
            "model": "gpt-4o",
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": f"task {i} " + "lorem ipsum dolor " * 1200},
            ],
        }
        headers = {"X-Session-Id": f"s{i}"} if explicit else {}
        assert httpx.post(
            proxy.base_url + "/chat/completions", json=body, headers=headers
        ).is_success
    proxy.settle()
    kept = proxy.gateway.chat.memos.bytes
    assert kept <= 4 * 2 * 23_000, kept  # (the held sessions' bodies: before, 40 of them)
    assert kept > 0  # (those of the sessions held stay, for their next turn)


def test_a_lone_surrogate_is_the_providers_to_judge_not_a_400(
    scripted: Any, proxy_factory: Any
) -> None:
    """A JavaScript agent that cuts a tool's output in the middle of an emoji sends ``"\\ud83d"``
    (what ``JSON.stringify`` writes) in every later request of the session; orjson refuses it,
    and cachegate answered 400 ``invalid_json`` on every turn. The body goes as sent, and its log
    lines are written (with U+FFFD)."""
    upstream, url = scripted(chunks=[b"{}"], content_type=b"application/json")
    proxy = proxy_factory(url)
    cut = b'{"role":"tool","tool_call_id":"c1","content":"done \\ud83d"}'
    call = b'{"id":"c1","type":"function","function":{"name":"run","arguments":"{}"}}'
    history = (
        b'{"model":"gpt-4o","messages":[{"role":"user","content":"go"},'
        b'{"role":"assistant","content":null,"tool_calls":[' + call + b"]}," + cut
    )
    headers = {"X-Session-Id": "lone-1", "Content-Type": "application/json"}
    as_is = history + b"]}"
    r = httpx.post(proxy.base_url + "/chat/completions", content=as_is, headers=headers)
    assert r.status_code == 200
    assert r.headers["x-cachegate-repairs"] == "0"
    assert upstream.requests[0]["body"] == as_is  # byte for byte
    # A turn that needs a repair (a call left without a result) is serialized again: valid JSON
    # (UTF-8), the lone surrogate as U+FFFD.
    broken = (
        history
        + b',{"role":"assistant","content":null,"tool_calls":['
        + call.replace(b"c1", b"c2")
        + b"]}]}"
    )
    r = httpx.post(proxy.base_url + "/chat/completions", content=broken, headers=headers)
    assert r.status_code == 200
    assert r.headers["x-cachegate-repairs"] == "1"
    forwarded = orjson.loads(upstream.requests[1]["body"])
    assert forwarded["messages"][2]["content"] == "done \ufffd"
    assert forwarded["messages"][4]["tool_call_id"] == "c2"
    proxy.settle()
    lines = (proxy.log_dir / "lone-1.jsonl").read_text().splitlines()
    assert [orjson.loads(line)["type"] for line in lines] == [
        "session_meta",
        "request",
        "response",
        "request",
        "response",
    ]
    assert proxy.metric("cachegate_event_log_lost_total", {"kind": "write_error"}) == 0
    # Not JSON by any reading, or not JSON's (it would be written back otherwise): still a 400
    # in OpenAI's shape, nothing forwarded.
    for bad in (
        b'{"a": "\\ud83d',
        b'{"model": "m", "n": 1e400, "x": "\\ud83d"}',
        b'{"model": "m", "temperature": NaN, "x": "\\ud83d"}',
        b'{"model": "m", "seed": 1' + b"0" * 400 + b', "x": "\\ud83d"}',
        '{"model": "m", "x": "\\ud83d"}'.encode("utf-16"),
    ):
        r = httpx.post(proxy.base_url + "/chat/completions", content=bad, headers=headers)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json"), bad
    # bytes that are no UTF-8 are said to be so (orjson calls them "surrogates not allowed")
    latin1 = '{"model": "m", "messages": [{"role": "user", "content": "café"}]}'.encode("latin-1")
    r = httpx.post(proxy.base_url + "/chat/completions", content=latin1, headers=headers)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "Request body is not valid UTF-8: byte 0xe9 at position 60."
    )
    assert len(upstream.requests) == 2


def test_a_request_without_an_id_never_joins_another_clients_named_session(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base)
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    url = proxy.base_url + "/chat/completions"
    named = httpx.post(url, json=body, headers={"X-Session-Id": "alice-claude-code"})
    assert named.headers["x-cachegate-session"] == "alice-claude-code"
    anonymous = httpx.post(url, json=body)
    assert anonymous.status_code == 200
    assert anonymous.headers["x-cachegate-session"] != "alice-claude-code"
    # ...while requests without an id still find each other
    again = httpx.post(
        url,
        json={
            **body,
            "messages": [
                *body["messages"],
                {"role": "assistant", "content": "You said: hi"},
                {"role": "user", "content": "more"},
            ],
        },
    )
    assert again.headers["x-cachegate-session"] == anonymous.headers["x-cachegate-session"]


def test_an_upstream_that_refuses_stream_options_gets_the_stream_as_the_client_sent_it(
    sdk: Any, proxy_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Mistral answers 422 to ``stream_options``: with cachegate asking for usage by default,
    every stream of a client that never sent it failed. The refused request goes again at once
    as the client sent it; the model is not asked again; the log holds one exchange, whose
    request line is the body sent."""
    from tests.e2e_support import events, run_cli, wait_for

    with run_simulator(SimConfig(refuse_stream_options=True)) as mistral:
        with pytest.raises(openai.UnprocessableEntityError):  # the client's own option: refused
            sdk(mistral.api_base).chat.completions.create(
                model="mistral-small",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
        proxy = proxy_factory(mistral.api_base)
        client = sdk(proxy.base_url, default_headers={"X-Session-Id": "mistral"})
        history: list[dict[str, Any]] = [{"role": "user", "content": "Say hello"}]
        for turn in range(2):
            before = len(mistral.sim.requests)
            stream = client.chat.completions.create(
                model="mistral-small",
                messages=history,  # type: ignore[arg-type]
                stream=True,
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text
            sent = [r.body for r in mistral.sim.requests[before:]]
            # The first turn: refused with the option, then sent as the client did; the second
            # goes as the client sent it at once.
            assert [("stream_options" in b) for b in sent] == (
                [True, False] if turn == 0 else [False]
            )
            history += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        proxy.settle()
        said = [r for r in caplog.records if "answered 422 to the stream_options" in r.message]
        assert len(said) == 1 and "model 'mistral-small'" in said[0].message
        requests = wait_for(lambda: events(proxy.log_dir, "mistral", "request"), what="requests")
        assert [r["exchange"] for r in requests] == [1, 1, 2]
        assert "stream_options" not in requests[1]["params"]
        assert "usage_not_asked" in requests[1]["transforms"]
        show = run_cli("sessions", "show", "mistral", "--log-dir", str(proxy.log_dir), "--json")
        rows = show.json()["exchanges"]
        assert [(r["exchange"], r["status"], r["error"]) for r in rows] == [
            (1, 200, None),
            (2, 200, None),
        ]
        replay = run_cli("sessions", "replay", "mistral", "--log-dir", str(proxy.log_dir))
        replayed = [orjson.loads(line) for line in replay.out.splitlines()]
        # every request as forwarded: the refused attempt, then the one that was answered
        assert [(r["exchange_id"], "stream_options" in r["params"]) for r in replayed] == [
            (1, True),
            (1, False),
            (2, False),
        ]
        # Mistral puts the usage in its last chunk unasked: each answer's tokens are counted
        answered = events(proxy.log_dir, "mistral", "response")
        assert len(answered) == 2 and all(r["usage"]["prompt"] > 0 for r in answered)
        assert proxy.metric("cachegate_tokens_total", {"model": "other", "kind": "prompt"}) == sum(
            r["usage"]["prompt"] for r in answered
        )


def test_a_refusal_of_stream_options_from_a_server_that_closes_after_it_is_sent_again(
    sdk: Any, proxy_factory: Any
) -> None:
    """A server that closes its connection a moment after the refusal, without saying so (no
    ``connection: close``): the request sent again at once went on that connection, and the
    client got cachegate's 502 ("closed the connection before answering") for a stream the
    server serves the client as it sends it."""
    import socket
    import threading
    import time

    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "hello"}, "finish_reason": "stop"}]}  # fmt: skip
    stream = b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"
    refusal = b'{"detail": "stream_options: extra inputs are not permitted"}'
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                head, _, data = data.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(data) < length:
                    data += conn.recv(65536)
                body, data = data[:length], data[length:]
                if b"stream_options" in body:
                    conn.sendall(b"HTTP/1.1 422 Unprocessable Entity\r\ncontent-type: "
                                 b"application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(refusal), refusal))  # fmt: skip
                    time.sleep(0.005)
                    return  # (closed, unsaid)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(stream), stream))  # fmt: skip

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        port = listener.getsockname()[1]
        proxy = proxy_factory(f"http://127.0.0.1:{port}/v1")
        client = sdk(proxy.base_url)
        for n in range(5):  # (a model each: each asked with the option first)
            parts = client.chat.completions.create(
                model=f"model-{n}", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == "hello"
        assert proxy.metric("cachegate_upstream_errors_total", {"kind": "connect"}) == 0
    finally:
        listener.close()


def test_the_note_of_a_refused_stream_options_shows_the_model_name_safely(
    sdk: Any, proxy_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The model name, a client's text, went raw to stderr: a line break in it forged a log
    line, and the client's key in it was shown."""
    import secrets
    import string

    key = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(40))
    with run_simulator(SimConfig(refuse_stream_options=True)) as mistral:
        proxy = proxy_factory(mistral.api_base)
        client = sdk(proxy.base_url, api_key=key)
        stream = client.chat.completions.create(
            model=f"m-{key}\nWARNING forged",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    said = [r.getMessage() for r in caplog.records if "to the stream_options" in r.getMessage()]
    assert len(said) == 1
    assert "for model 'm-[REDACTED]\\nWARNING forged'" in said[0]
    assert key not in caplog.text and "\n" not in said[0]


def test_a_refusal_of_the_clients_own_stream_options_reaches_it_and_is_not_remembered(
    sdk: Any, proxy_factory: Any
) -> None:
    """The client sent stream_options of its own, without include_usage: cachegate added it,
    the upstream refused the option, and the request went again as the client sent it, refused
    again: the client gets that refusal, and the model is still asked next time."""
    with run_simulator(SimConfig(refuse_stream_options=True)) as mistral:
        proxy = proxy_factory(mistral.api_base)
        client = sdk(proxy.base_url, max_retries=0)
        with pytest.raises(openai.UnprocessableEntityError):
            client.chat.completions.create(
                model="mistral-small",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_obfuscation": False},
            )
        sent = [r.body["stream_options"] for r in mistral.sim.requests]
        assert sent == [
            {"include_obfuscation": False, "include_usage": True},
            {"include_obfuscation": False},
        ]
        assert "mistral-small" not in proxy.gateway.chat.usage_refused
        stream = client.chat.completions.create(
            model="mistral-small", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert [("stream_options" in r.body) for r in mistral.sim.requests[2:]] == [True, False]
        assert "mistral-small" in proxy.gateway.chat.usage_refused


def test_a_history_too_long_for_an_upstream_that_refuses_stream_options_is_compacted(
    sdk: Any, proxy_factory: Any
) -> None:
    """The first stream of a model: refused for the option cachegate added, sent again without
    it, refused as too long, compacted and sent again: the compacted request went with the
    option again and the client got a 422 about an option it never sent."""
    config = {"compaction": {"enabled": True, "keep_recent": 4}}
    with run_simulator(SimConfig(refuse_stream_options=True, context_window=3000)) as mistral:
        proxy = proxy_factory(mistral.api_base, config)
        history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the tests."}]
        for i in range(12):
            history += [
                {"role": "assistant", "content": f"Step {i}: " + "looked " * 150},
                {"role": "user", "content": f"Go on {i}: " + "more " * 150},
            ]
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model="mistral-small",
            messages=history,  # type: ignore[arg-type]
            stream=True,
        )
        assert raw.headers["x-cachegate-compacted"] == "1"
        assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        statuses = [(r.status, "stream_options" in r.body) for r in mistral.sim.requests]
        assert statuses[:2] == [(422, True), (400, False)]
        assert statuses[-1] == (200, False)  # (a summary call between them)


def test_a_refusal_that_only_echoes_stream_options_is_not_taken_for_one(
    scripted: Any, proxy_factory: Any
) -> None:
    """A validation error that quotes the request (a message about stream_options) is no
    refusal of the option: the client gets it, and nothing is sent again."""
    refusal = {
        "detail": [
            {
                "type": "string_type",
                "loc": ["body", "messages", 0, "content"],
                "msg": "Input should be a valid string",
                "input": {"text": "what does stream_options do?"},
            }
        ]
    }
    upstream, url = scripted(
        status=422, content_type=b"application/json", chunks=[json.dumps(refusal).encode()]
    )
    proxy = proxy_factory(url)
    r = httpx.post(
        proxy.base_url + "/chat/completions",
        json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 422 and r.json() == refusal
    assert len(upstream.requests) == 1


def test_a_body_with_a_lone_surrogate_is_read_no_deeper_than_orjson_reads() -> None:
    """The lenient read (a lone surrogate) took bodies deeper than orjson's 1,024 levels while
    another thread had the recursion limit raised, and past it blamed the surrogate."""
    import sys

    from proxy.chat import ORJSON_MAX_DEPTH, parse_request
    from proxy.errors import ProxyError

    def body(depth: int) -> bytes:
        inner = b"[" * (depth - 3) + b'"a \\ud83d b"' + b"]" * (depth - 3)
        return b'{"model":"m","messages":[{"role":"user","content":' + inner + b"}]}"

    parsed = parse_request(body(ORJSON_MAX_DEPTH), [])  # as deep as orjson reads: taken
    assert parsed.body["model"] == "m"
    limit = sys.getrecursionlimit()
    for raised in (False, True):
        if raised:  # (as while the log writer re-runs a deep redaction)
            sys.setrecursionlimit(limit + 5000)
        try:
            for depth in (ORJSON_MAX_DEPTH + 1, 1500):
                with pytest.raises(ProxyError) as info:
                    parse_request(body(depth), [])
                assert info.value.code == "invalid_json"
                assert "nested deeper than 1024 levels" in info.value.message
        finally:
            sys.setrecursionlimit(limit)


@pytest.mark.parametrize("depth", [254, 980])
def test_a_body_nested_as_deep_as_cachegate_reads_is_answered_on_every_turn(
    sim: RunningSimulator, proxy_factory: Any, depth: int
) -> None:
    """A body of 16 KiB or more with a field after ``messages`` nested 254 levels deep (past
    what orjson writes) was a 500 ``internal_error``, nothing forwarded; one nested ~980
    levels inside a message was answered on its first turn and a 500 on its next (the memo's
    check of the spliced body met the recursion limit). The README: bodies nested up to 1,024
    levels are read as any other."""
    proxy = proxy_factory(sim.api_base)
    nested = "[" * depth + "]" * depth
    messages = (
        '[{"role":"user","content":"' + "x" * 17_000 + '"},'
        '{"role":"assistant","content":"ok","x":' + nested + "}"
    )
    for turn in range(2):
        raw = (
            '{"model":"gpt-4o","messages":' + messages + '],"metadata":{"deep":' + nested + "}}"
        ).encode()
        r = httpx.post(
            proxy.base_url + "/chat/completions",
            content=raw,
            headers={"content-type": "application/json", "x-session-id": f"deep-{depth}"},
            timeout=30,
        )
        assert r.status_code == 200, (turn, r.text)
        assert sim.sim.requests[-1].raw == raw  # forwarded as it came
        messages += ',{"role":"assistant","content":"a"},{"role":"user","content":"go on"}'


def test_cachegates_refusals_before_the_chat_route_say_its_repairs(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """A chat request refused before the chat route (a web page's: 403 ``forbidden_origin``; an
    invalid session id in its path: 400) said no ``X-Cachegate-Repairs`` with the repair on,
    where every other answer to a chat request says it (``0`` on cachegate's refusals)."""
    import httpx

    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    on = proxy_factory(sim.api_base)
    root = on.base_url.removesuffix("/v1")
    page = httpx.post(
        on.base_url + "/chat/completions", json=body, headers={"Origin": "https://evil.example"}
    )
    bad_id = httpx.post(root + "/s/a%20b/v1/chat/completions", json=body)
    assert (page.status_code, bad_id.status_code) == (403, 400)
    assert page.headers["x-cachegate-repairs"] == bad_id.headers["x-cachegate-repairs"] == "0"
    models = httpx.get(on.base_url + "/models", headers={"Origin": "https://evil.example"})
    assert models.status_code == 403 and "x-cachegate-repairs" not in models.headers
    off = proxy_factory(sim.api_base, {"pairing": {"repair": False}})
    page = httpx.post(
        off.base_url + "/chat/completions", json=body, headers={"Origin": "https://evil.example"}
    )
    assert page.status_code == 403 and "x-cachegate-repairs" not in page.headers
    strict = {"Origin": "https://evil.example", "X-Cachegate-Strict": "1"}
    page = httpx.post(off.base_url + "/chat/completions", json=body, headers=strict)
    assert page.status_code == 403 and page.headers["x-cachegate-repairs"] == "0"


def _call(call_id: str, name: str = "read_file") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


@pytest.mark.parametrize("model", ["gemini-2.5-pro", "google/gemini-2.5-flash"])
def test_an_empty_assistant_text_is_repaired_for_gemini_which_refuses_one(
    sdk: Any, proxy_factory: Any, model: str
) -> None:
    """Gemini's OpenAI endpoint refuses an empty text ("Unable to submit request because it
    has an empty text parameter"): a stream cut before its first token leaves ``""`` (the
    Vercel AI SDK writes it; the repair gave ``""`` to a contentless one), and every later turn
    of the session was refused. The message is removed (Gemini takes two user turns in a
    row); ids reused across turns, which Gemini takes, are left as they are (Claude's are
    renamed), and so is ``""`` beside calls."""
    history = [
        {"role": "user", "content": "Summarise a.py"},
        {"role": "assistant", "content": ""},  # (a stream cut before its first token)
        {"role": "user", "content": "Go on"},
        {"role": "assistant", "content": "", "tool_calls": [_call("call_0")]},
        {"role": "tool", "tool_call_id": "call_0", "content": "print(1)"},
        {"role": "assistant", "content": None, "tool_calls": [_call("call_0")]},  # (reused)
        {"role": "tool", "tool_call_id": "call_0", "content": "print(2)"},
    ]
    with run_simulator(SimConfig(gemini_rules=True)) as gemini:
        with pytest.raises(openai.BadRequestError) as info:
            sdk(gemini.api_base).chat.completions.create(model=model, messages=history)
        assert "empty text parameter" in info.value.response.text
        proxy = proxy_factory(gemini.api_base)
        for _turn in range(2):  # (the next turn resumes the repair)
            raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
                model=model, messages=history, extra_headers={"X-Session-Id": "gemini-empty"}
            )
            assert raw.http_response.status_code == 200
            assert raw.headers["x-cachegate-repairs"] == "1"
            forwarded = gemini.sim.requests[-1].body["messages"]
            assert forwarded == [history[0], *history[2:]]
            history += [raw.parse().choices[0].message.model_dump(exclude_none=True)]
            history += [{"role": "user", "content": "More"}]


def test_gemma_and_other_models_keep_an_empty_assistant_turn(
    sim: RunningSimulator, sdk: Any, proxy_factory: Any
) -> None:
    """Gemma (Google's open model, served by vLLM or llama.cpp with a chat template that wants
    the turns alternating) is no Gemini: its empty assistant message stays, as for OpenAI."""
    proxy = proxy_factory(sim.api_base)
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "again"},
    ]
    for model in ("gemma-3-27b-it", "gpt-4o", "supergemini-7b"):
        sdk(proxy.base_url).chat.completions.create(model=model, messages=history)
        assert sim.sim.requests[-1].body["messages"] == history


def test_white_space_is_text_to_gemini_and_left_as_it_is(sdk: Any, proxy_factory: Any) -> None:
    """Gemini takes white space as text (the fix others give its empty-text refusal is a
    space): an assistant message of a space was removed as for Claude, and strict mode refused
    the history, where Gemini takes it as sent."""
    history = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": " "},
        {"role": "user", "content": "b"},
    ]
    with run_simulator(SimConfig(gemini_rules=True)) as gemini:
        proxy = proxy_factory(gemini.api_base)
        for headers in ({}, {"X-Cachegate-Strict": "1"}):
            raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
                model="gemini-2.5-pro", messages=history, extra_headers=headers
            )
            assert raw.http_response.status_code == 200
            assert raw.headers["x-cachegate-repairs"] == "0"
            assert gemini.sim.requests[-1].body["messages"] == history


@pytest.mark.parametrize("content", [None, "", []])
def test_a_gemini_thinking_turn_cut_before_its_text_is_removed(
    sdk: Any, proxy_factory: Any, content: Any
) -> None:
    """A stream of a Gemini model stopped after its thinking, before its first text, leaves
    an assistant message of no text with its ``reasoning_details`` (OpenRouter asks clients to
    send them back). It was kept, as Claude's signed thinking is, and Gemini refused it as an
    empty text on every later turn; it is removed."""
    reasoning = [{"type": "reasoning.encrypted", "data": "CiQB0e2K", "format": "google-gemini-v1"}]
    history = [
        {"role": "user", "content": "fix the bug"},
        {"role": "assistant", "content": content, "reasoning_details": reasoning},
        {"role": "user", "content": "continue"},
    ]
    with run_simulator(SimConfig(gemini_rules=True)) as gemini:
        proxy = proxy_factory(gemini.api_base)
        raw = sdk(proxy.base_url).chat.completions.with_raw_response.create(
            model="google/gemini-2.5-flash", messages=history
        )
        assert raw.http_response.status_code == 200
        assert raw.headers["x-cachegate-repairs"] == "1"
        assert gemini.sim.requests[-1].body["messages"] == [history[0], history[2]]
