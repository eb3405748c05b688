"""Compaction: the split point, the summaries, sticky substitution and the trigger."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.compaction import (
    EXTRACTIVE_HEADER,
    ROLLING_INSTRUCTION,
    SUMMARIZER_SYSTEM_PROMPT,
    SUMMARY_MARKER,
    Compaction,
    Cut,
    apply_compaction,
    build_compaction,
    build_summary_request,
    content_chars,
    estimate_tokens,
    extractive_summary,
    find_cut,
    is_context_length_error,
    is_synthetic,
    plan,
    prefix_digest,
    provider_prompt_tokens,
    provider_window,
    should_compact,
    summary_chars,
    summary_message,
    summary_text,
)
from proxy.simulator.validate import validate_messages

Message = dict[str, Any]

# Labels as pairing writes them (pairing is another module; these stand in for its constants).
ORPHAN_LABEL = "[cachegate: orphaned tool result]"
INTERRUPTED_LABEL = "[cachegate: interrupted]"
PREFIXES = (SUMMARY_MARKER, ORPHAN_LABEL, INTERRUPTED_LABEL)

SYSTEM: Message = {"role": "system", "content": "You are a coding agent."}
EARLIER_TASK: Message = {"role": "user", "content": "Rename the package to cachegate."}
EARLIER_DONE: Message = {"role": "assistant", "content": "Done: the package is now cachegate."}
LAUNCH: Message = {
    "role": "user",
    "content": "Fix the failing test in tests/test_app.py.\nRun `pytest -q` when done.",
}


def call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": orjson.dumps(arguments).decode()},
    }


def tool_round(k: int) -> list[Message]:
    call_id = f"call_{k}"
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call(call_id, "shell", {"command": f"pytest -q tests/test_{k}.py"})],
        },
        {"role": "tool", "tool_call_id": call_id, "content": f"{k} passed in 0.1s\n(more)"},
    ]


def reference() -> list[Message]:
    """A system message, a finished earlier task, the launching message, ten tool rounds."""
    rounds = [m for k in range(10) for m in tool_round(k)]
    return [SYSTEM, EARLIER_TASK, EARLIER_DONE, LAUNCH, *rounds]


# --- the cut --------------------------------------------------------------------------------


def test_cut_falls_exactly_on_the_launching_message() -> None:
    history = reference()
    assert len(history) == 24

    cut = find_cut(history, keep_recent=8, max_anchor_chars=40000)

    assert cut == Cut(start=1, end=3)
    assert history[cut.end] is LAUNCH


def test_a_task_that_opens_the_conversation_stays_and_its_tool_loop_is_compacted() -> None:
    """The usual agent session: one task, then only tool rounds. Pulling the cut back to the task
    would leave nothing to compact; the task is kept with the system prompt instead."""
    rounds = [m for k in range(10) for m in tool_round(k)]
    history = [SYSTEM, LAUNCH, *rounds]

    cut = find_cut(history, keep_recent=4, max_anchor_chars=40000)

    assert cut == Cut(start=2, end=18)
    assert history[cut.start - 1] is LAUNCH  # kept verbatim, before the summary
    assert history[cut.end]["role"] == "assistant" and len(history[cut.end :]) == 4
    # without the anchor (too long to keep, or the compactor's fallback), the task is compacted
    assert find_cut(history, keep_recent=4, max_anchor_chars=0) == Cut(1, 18)
    # the same with no system prompt
    assert find_cut(history[1:], keep_recent=4, max_anchor_chars=40000) == Cut(1, 17)


def test_a_screenshot_sent_as_a_user_message_is_not_the_launching_message() -> None:
    """Browser agents send each screenshot as a user message of an image alone: it was taken for
    the message that launched the task, and the task was summarized with the rest."""
    shot = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
    }
    rounds = [m for k in range(10) for m in (*tool_round(k), shot)]
    history = [SYSTEM, LAUNCH, *rounds]
    cut = find_cut(history, keep_recent=4, max_anchor_chars=40000)
    assert cut is not None and cut.start == 2  # the task kept verbatim, before the summary
    assert history[cut.start - 1] is LAUNCH
    # a task written as Responses-style parts, its text and a screenshot, is the task
    task = {
        "role": "user",
        "content": [{"type": "input_text", "text": "Book the flight."}, shot["content"][0]],
    }
    cut = find_cut([SYSTEM, task, *rounds], keep_recent=4, max_anchor_chars=40000)
    assert cut is not None and cut.start == 2


def test_a_rolling_compaction_that_moves_its_start_earlier_still_summarizes_the_task() -> None:
    """A compaction kept the task verbatim (start after it); a new user message then becomes the
    anchor and the next compaction starts right after the system prompt: the old task, no longer
    kept verbatim, must reach the summarizer."""
    first = [SYSTEM, LAUNCH, *[m for k in range(6) for m in tool_round(k)]]
    cut = find_cut(first, keep_recent=4, max_anchor_chars=40000)
    assert cut == Cut(2, 10)
    done = build_compaction(first, cut, "Ran tests 0-3.", source="extractive")
    follow_up = {"role": "user", "content": "Now update the changelog."}
    later = [*first, {"role": "assistant", "content": "All pass."}, follow_up]
    later += [m for k in range(6, 12) for m in tool_round(k)]

    p = plan(
        later, existing=done, window=100, trigger_percent=50, keep_recent=4, max_anchor_chars=40000
    )

    assert p.cut == Cut(1, 15) and later[15] is follow_up
    assert p.middle[0] is LAUNCH  # the task the earlier compaction had kept
    assert p.middle[1:] == later[done.covered : 15]
    assert p.previous_summary == "Ran tests 0-3."


def test_cut_does_not_pull_back_beyond_max_anchor_chars() -> None:
    history = reference()
    anchored_tail = sum(content_chars(m) for m in history[3:])

    at_limit = find_cut(history, keep_recent=8, max_anchor_chars=anchored_tail)
    below_limit = find_cut(history, keep_recent=8, max_anchor_chars=anchored_tail - 1)

    assert at_limit == Cut(1, 3)
    assert below_limit == Cut(1, 16)
    assert history[16]["role"] == "assistant"
    assert len(history[16:]) == 8


def test_cut_moves_earlier_rather_than_start_the_tail_with_a_tool_result() -> None:
    history = reference()

    cut = find_cut(history, keep_recent=9, max_anchor_chars=0)

    # 24 - 9 = 15 is a tool result: its assistant call (14) is kept with it.
    assert cut == Cut(1, 14)
    assert history[14]["tool_calls"][0]["id"] == "call_5"


def test_cut_keeps_parallel_calls_with_all_their_results() -> None:
    parallel: list[Message] = [
        {
            "role": "assistant",
            "content": "Reading both.",
            "tool_calls": [
                call("a", "read_file", {"path": "a.py"}),
                call("b", "read_file", {"path": "b.py"}),
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "assistant", "content": "Both read."},
    ]
    history = [SYSTEM, EARLIER_TASK, EARLIER_DONE, LAUNCH, *parallel]

    # keep_recent=2 would start the tail at the second result.
    assert find_cut(history, keep_recent=2, max_anchor_chars=0) == Cut(1, 4)


def test_cut_keeps_a_displaced_result_with_its_call() -> None:
    # Pairing normally moves such a result back; the cut must not split the pair regardless.
    displaced: list[Message] = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                call("x", "shell", {"command": "ls"}),
                call("y", "shell", {"command": "pwd"}),
            ],
        },
        {"role": "tool", "tool_call_id": "x", "content": "a.py"},
        {"role": "user", "content": "Also check b.py."},
        {"role": "tool", "tool_call_id": "y", "content": "/work"},
    ]
    history = [SYSTEM, EARLIER_TASK, EARLIER_DONE, LAUNCH, *displaced]

    assert find_cut(history, keep_recent=1, max_anchor_chars=0) == Cut(1, 4)


def test_no_cut_when_the_middle_would_hold_fewer_than_two_messages() -> None:
    assert find_cut([SYSTEM, EARLIER_TASK, EARLIER_DONE], keep_recent=1, max_anchor_chars=0) is None
    short = [SYSTEM, EARLIER_TASK, EARLIER_DONE, LAUNCH]
    assert find_cut(short, keep_recent=2, max_anchor_chars=0) is None
    assert find_cut(short, keep_recent=1, max_anchor_chars=0) == Cut(1, 3)
    assert find_cut([], keep_recent=1, max_anchor_chars=0) is None


def test_synthetic_messages_are_never_the_launching_message() -> None:
    orphan = {"role": "user", "content": f"{ORPHAN_LABEL} tool said: done"}
    summary = summary_message("Earlier work.", covered=3, source="model")
    rounds = [m for k in range(3) for m in tool_round(k)]
    history = [SYSTEM, EARLIER_TASK, EARLIER_DONE, LAUNCH, *rounds, orphan, summary, *tool_round(9)]

    with_labels = find_cut(
        history, keep_recent=3, max_anchor_chars=40000, synthetic_prefixes=PREFIXES
    )
    without_orphan_label = find_cut(history, keep_recent=3, max_anchor_chars=40000)

    assert with_labels == Cut(1, 3)
    assert history[3] is LAUNCH
    # Only the summary marker is known by default: the orphan note would pass for the user.
    assert without_orphan_label == Cut(1, 10)
    assert history[10] is orphan


def test_is_synthetic_reads_text_parts_and_labels() -> None:
    assert is_synthetic({"role": "user", "content": f"{SUMMARY_MARKER} x"})
    assert is_synthetic(
        {"role": "user", "content": [{"type": "text", "text": f"{ORPHAN_LABEL} y"}]}, PREFIXES
    )
    assert is_synthetic(
        {"role": "tool", "tool_call_id": "a", "content": INTERRUPTED_LABEL}, PREFIXES
    )
    assert not is_synthetic(LAUNCH, PREFIXES)
    assert not is_synthetic({"role": "user", "content": f"see {SUMMARY_MARKER}"})


@st.composite
def histories(draw: st.DrawFn) -> list[Message]:
    """Valid histories: leading system messages, then user (real or synthetic) and assistant
    messages and tool blocks (1–3 calls, results in any order) in random sequence."""
    texts = st.text(alphabet="abc xyz/.\n", max_size=300)
    messages: list[Message] = [dict(SYSTEM) for _ in range(draw(st.integers(0, 2)))]
    for block in range(draw(st.integers(0, 14))):
        kind = draw(st.sampled_from(["user", "synthetic", "assistant", "tools", "tools"]))
        if kind == "user":
            messages.append({"role": "user", "content": draw(texts)})
        elif kind == "synthetic":
            label = draw(st.sampled_from(PREFIXES))
            messages.append({"role": "user", "content": label + draw(texts)})
        elif kind == "assistant":
            messages.append({"role": "assistant", "content": draw(texts)})
        else:
            ids = [f"c{block}_{j}" for j in range(draw(st.integers(1, 3)))]
            messages.append(
                {
                    "role": "assistant",
                    "content": draw(st.none() | texts),
                    "tool_calls": [call(i, "shell", {"command": draw(texts)}) for i in ids],
                }
            )
            for i in draw(st.permutations(ids)):
                messages.append({"role": "tool", "tool_call_id": i, "content": draw(texts)})
    return messages


@settings(max_examples=300, deadline=None)
@given(histories(), st.integers(1, 10), st.integers(0, 3000))
def test_a_cut_never_splits_a_tool_pair(
    history: list[Message], keep_recent: int, max_anchor_chars: int
) -> None:
    cut = find_cut(
        history,
        keep_recent=keep_recent,
        max_anchor_chars=max_anchor_chars,
        synthetic_prefixes=PREFIXES,
    )
    if cut is None:
        return
    leading = next((i for i, m in enumerate(history) if m["role"] != "system"), len(history))
    real_users = [
        i for i, m in enumerate(history) if m["role"] == "user" and not is_synthetic(m, PREFIXES)
    ]
    # The middle starts after the leading messages, or right after a launching message that
    # opens the conversation (kept verbatim with them).
    assert cut.start == leading or (
        real_users and cut.start == real_users[-1] + 1 and real_users[-1] - leading < 2
    )
    assert cut.end - cut.start >= 2
    assert len(history) - cut.end >= keep_recent
    tail = history[cut.end :]
    assert tail[0]["role"] != "tool"
    tail_call_ids = {c["id"] for m in tail for c in m.get("tool_calls") or []}
    assert all(m["tool_call_id"] in tail_call_ids for m in tail if m["role"] == "tool")
    middle = history[cut.start : cut.end]
    middle_call_ids = {c["id"] for m in middle for c in m.get("tool_calls") or []}
    assert all(m["tool_call_id"] in middle_call_ids for m in middle if m["role"] == "tool")
    # The launching message is kept, unless keeping it would exceed the anchor budget.
    if real_users and cut.start <= real_users[-1] < cut.end:
        assert sum(content_chars(m) for m in history[real_users[-1] :]) > max_anchor_chars
    # What is forwarded after substitution is a history the provider accepts.
    compaction = build_compaction(history, cut, "summary", source="extractive")
    substituted = apply_compaction(history, compaction)
    assert substituted is not None
    validate_messages(substituted)


# --- estimates and trigger ------------------------------------------------------------------


def test_estimate_tokens_is_json_bytes_over_four_plus_message_overhead() -> None:
    message = {"role": "user", "content": "abcd"}  # 32 bytes of JSON
    assert estimate_tokens(message) == 8
    assert estimate_tokens([message]) == 12
    assert estimate_tokens([message, message]) == 24
    assert estimate_tokens({"a": 1}) == 2  # 7 bytes, rounded up
    assert estimate_tokens([]) == 0


@pytest.mark.parametrize("depth", [300, 1_010])
def test_a_message_nested_deeper_than_orjson_writes_is_estimated_and_digested(
    depth: int,
) -> None:
    """A client may send content nested up to 1,024 levels (what orjson reads); orjson writes
    254 and the standard library ~990. The estimate and the compaction's digests raised: the
    compaction failed (an error in cachegate's log) and the accounting's estimate with it."""
    deep: Any = "x"
    for _ in range(depth):
        deep = [deep]
    message = {"role": "user", "content": "look", "metadata": deep}
    flat = {"role": "user", "content": "look", "metadata": "x"}
    assert estimate_tokens(message) >= estimate_tokens(flat) + depth // 2  # ~2 bytes a level
    assert prefix_digest([message], 1) != prefix_digest([flat], 1)
    assert prefix_digest([message], 1) == prefix_digest([dict(message)], 1)


def test_should_compact_prefers_provider_numbers() -> None:
    common = {"window": 1000, "trigger_percent": 75.0}
    assert should_compact(
        **common, last_prompt=700, last_completion=40, appended_estimate=10, full_estimate=0
    )
    assert not should_compact(
        **common, last_prompt=700, last_completion=40, appended_estimate=9, full_estimate=10**6
    )
    assert should_compact(
        **common, last_prompt=None, last_completion=None, appended_estimate=0, full_estimate=750
    )
    assert not should_compact(
        **common, last_prompt=None, last_completion=None, appended_estimate=10**6, full_estimate=749
    )
    # the completion asked for counts with the prompt, unless it fills the window by itself:
    # compaction leaves no room for it then (a prompt-only provider serves it as it is)
    short = {"last_prompt": 200, "last_completion": 10, "appended_estimate": 0, "full_estimate": 0}
    assert should_compact(**common, **short, asked=800)
    assert not should_compact(**common, **short, asked=700)
    assert not should_compact(**common, **short, asked=1000)
    assert not should_compact(**common, **short, asked=9000)
    assert should_compact(**common, **{**short, "last_prompt": 800}, asked=9000)  # (75%)
    with pytest.raises(ValueError, match="trigger_percent"):
        should_compact(
            window=1000,
            trigger_percent=0,
            last_prompt=1,
            last_completion=1,
            appended_estimate=0,
            full_estimate=0,
        )


# --- summaries ------------------------------------------------------------------------------


def work_middle() -> list[Message]:
    return [
        LAUNCH,
        {
            "role": "assistant",
            "content": "Let me look at the test first.\nThen the module.",
            "tool_calls": [call("r1", "read_file", {"path": "tests/test_app.py"})],
        },
        {"role": "tool", "tool_call_id": "r1", "content": "def test_app():\n    assert app()"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("s1", "shell", {"command": "pytest -q tests/test_app.py -x"})],
        },
        {"role": "tool", "tool_call_id": "s1", "content": "1 failed\nAssertionError"},
        {"role": "assistant", "content": "The bug is in proxy/app.py; I ran\n$ git diff --stat"},
    ]


def test_extractive_summary_quotes_the_task_and_lists_files_and_commands() -> None:
    text = extractive_summary(work_middle(), previous_summary=None)

    assert "> Fix the failing test in tests/test_app.py.\n> Run `pytest -q` when done." in text
    assert '- read_file({"path":"tests/test_app.py"}) -> def test_app():' in text
    assert '- shell({"command":"pytest -q tests/test_app.py -x"}) -> 1 failed' in text
    assert "- assistant: Let me look at the test first." in text
    assert "Then the module." not in text
    assert "- `tests/test_app.py`" in text
    assert "- `proxy/app.py`" in text
    assert "- `pytest -q tests/test_app.py -x`" in text
    assert "- `git diff --stat`" in text
    assert text == extractive_summary(work_middle(), previous_summary=None)


def test_calls_of_custom_tools_are_summarized_with_their_name_and_input() -> None:
    """OpenAI's custom (free-form) tools send ``{"type": "custom", "custom": {"name", "input"}}``:
    only ``function`` was read, so every such call read ``() (id …)`` in both summaries, and
    the files a patch touched were in neither."""
    patch = "*** Begin Patch\n*** Update File: src/module_7.py\n@@\n-x = 1\n+x = 2\n*** End Patch"
    middle: list[dict[str, Any]] = [
        {"role": "user", "content": "Bump x in module 7."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "custom",
                    "custom": {"name": "apply_patch", "input": patch},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Success. Updated 1 file."},
    ]
    text = extractive_summary(middle, previous_summary=None)
    assert "- apply_patch(*** Begin Patch *** Update File: src/module_7.py" in text
    assert "-> Success. Updated 1 file." in text
    assert "- `src/module_7.py`" in text
    prompt = build_summary_request(middle, previous_summary=None, model="m")["messages"][1]
    assert "-> tool call apply_patch(*** Begin Patch" in prompt["content"]
    assert "tool result of apply_patch (id c1):" in prompt["content"]
    assert content_chars(middle[1]) == len("apply_patch") + len(patch)


def test_extractive_summary_is_rolling_and_bounded() -> None:
    many = [m for k in range(400) for m in tool_round(k)]
    text = extractive_summary(
        [LAUNCH, *many], previous_summary="## Task\n> Rename the package.", max_chars=3000
    )

    assert len(text) <= 3000
    assert "## Previous summary\n## Task\n> Rename the package." in text
    assert "> Fix the failing test in tests/test_app.py." in text
    assert "earlier steps omitted)" in text
    assert "shell(" in text


def test_rolling_extractive_summaries_keep_the_users_instructions_without_nesting() -> None:
    """Each rolling extractive summary nested the one before, cut to half: after 40 compactions
    the user's instructions 6 to 38 were gone."""
    previous: str | None = None
    for i in range(40):
        middle = [
            {"role": "user", "content": f"Instruction {i}: also handle case {i}."},
            *tool_round(i),
        ]
        previous = extractive_summary(middle, previous_summary=previous, max_chars=4000)
    assert previous is not None and len(previous) <= 4000
    assert "## Previous summary" not in previous
    assert previous.count("## Task (the user's words)") == 1
    kept = [i for i in range(40) if f"> Instruction {i}: also handle case {i}." in previous]
    assert kept == list(range(40))  # they fit: every one of them, in order
    assert previous.index("Instruction 0:") < previous.index("Instruction 39:")
    assert "(none)" not in previous


def test_rolling_extractive_summaries_keep_the_first_and_latest_when_they_do_not_fit() -> None:
    previous: str | None = None
    for i in range(60):
        middle = [{"role": "user", "content": f"Instruction {i}: " + "details " * 30}]
        previous = extractive_summary(middle, previous_summary=previous, max_chars=3000)
    assert previous is not None and len(previous) <= 3000
    kept = [i for i in range(60) if f"> Instruction {i}: " in previous]
    assert kept[0] == 0 and kept[-1] == 59  # the task that opened it, and the latest
    assert kept == [0, *range(60 - len(kept) + 1, 60)]
    assert f"({60 - len(kept)} of the user's messages omitted)" in previous


def test_multi_line_quotes_cut_after_a_line_end_are_read_back_without_nesting() -> None:
    """The first and latest user messages, multi-line and together over the Task section's
    room, are cut; a cut just after a line end left a line of ``…`` alone, not quoted, and the
    next rolling summary could not read the skeleton back: it nested it whole, cut, and the
    user's later instructions fell out."""
    first = "\n".join(f"step {i} do thing" for i in range(21))
    later = "\n".join(f"later {i} a" for i in range(40))
    middle = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": later},
        {"role": "assistant", "content": "done"},
    ]
    text = extractive_summary(middle, previous_summary=None, max_chars=2000)
    assert "\n…\n\n## Steps" in text  # (the case: the cut right after a line end)
    rolled = extractive_summary(middle[:2], previous_summary=text, max_chars=2000)
    assert "## Previous summary" not in rolled and rolled.count(EXTRACTIVE_HEADER) == 1


def test_a_retry_s_summary_shrunk_to_its_bytes_is_still_read_back_as_a_skeleton() -> None:
    """A retry's extractive summary in a small room (Chinese, three bytes a character) was
    searched down to a length whose sections' floors no longer fit: the final cut crossed
    them, the next compaction could not read it back and nested it whole."""
    from proxy.compactor import _json_size

    middle: list[dict[str, Any]] = []
    for i in range(2):
        middle.append(
            {"role": "user", "content": f"第{i}条：" + ("请修改文件并运行测试" * 20)[:76]}
        )
        middle.append({"role": "assistant", "content": "好的"})
    text = extractive_summary(
        middle,
        previous_summary="模型写的摘要。" * 300,
        max_chars=1000,
        fits=lambda t: _json_size(t) <= 1000,
    )
    assert _json_size(text) <= 1000
    rolled = extractive_summary(middle[:2], previous_summary=text, max_chars=1000)
    assert rolled.count(EXTRACTIVE_HEADER) == 1  # extended, not nested


def test_a_model_written_previous_summary_is_carried_along_once() -> None:
    model_summary = "## Task\n> Rename the package.\n\n## Done\nRenamed the modules."
    first = extractive_summary(work_middle(), previous_summary=model_summary)
    second = extractive_summary(work_middle(), previous_summary=first)
    for text in (first, second):
        assert text.count("## Previous summary") == 1
        assert "## Previous summary\n" + model_summary in text
    assert second.count("> Fix the failing test in tests/test_app.py.") == 2  # both compactions


def test_the_latest_user_message_is_kept_when_it_and_the_first_are_long() -> None:
    """At an 8k window's 4,000 characters, a first task of ~1,100 characters and a latest
    message of ~1,600 left the latest out."""
    first = [{"role": "user", "content": "The task: " + "rename the module. " * 58}]
    latest = [{"role": "user", "content": "Now also: " + "check the edge cases. " * 72}]
    middle = [*first, *tool_round(1), *latest, *tool_round(2)]
    for limit in (1000, 4000):
        text = extractive_summary(middle, previous_summary=None, max_chars=limit)
        assert len(text) <= limit
        assert "> The task: rename the module." in text
        assert "> Now also: check the edge cases." in text


def test_a_multi_line_command_and_pretty_arguments_survive_a_rolling_summary() -> None:
    heredoc = "cat > /repo/conf.ini <<'EOF'\n[main]\nx = 1\nEOF"
    pretty = orjson.dumps({"command": "pytest -q"}, option=orjson.OPT_INDENT_2).decode()
    middle = [
        {"role": "user", "content": "Configure it."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "h",
                    "type": "function",
                    "function": {
                        "name": "run",
                        "arguments": orjson.dumps({"command": heredoc}).decode(),
                    },
                },
                {"id": "p", "type": "function", "function": {"name": "run", "arguments": pretty}},
            ],
        },
        {"role": "tool", "tool_call_id": "h", "content": "written"},
        {"role": "tool", "tool_call_id": "p", "content": "1 passed"},
    ]
    first = extractive_summary(middle, previous_summary=None)
    second = extractive_summary([{"role": "user", "content": "Go on."}], previous_summary=first)
    for text in (first, second):
        assert "- `cat > /repo/conf.ini <<'EOF' ⏎ [main] ⏎ x = 1 ⏎ EOF`" in text
        assert '- run({ "command": "pytest -q" }) -> 1 passed' in text


def test_a_command_with_any_line_break_survives_a_rolling_summary() -> None:
    for command in ("cd /repo\r\npytest -q", "cd /repo\u2028pytest -q", "cd /repo\rpytest -q"):
        call = {
            "id": "c",
            "type": "function",
            "function": {"name": "run", "arguments": orjson.dumps({"command": command}).decode()},
        }
        middle = [
            {"role": "user", "content": "Run it."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"},
        ]
        previous: str | None = None
        for i in range(4):
            step = [{"role": "user", "content": f"Instruction {i}."}, *middle[1:]] if i else middle
            previous = extractive_summary(step, previous_summary=previous)
        assert previous is not None
        assert "## Previous summary" not in previous, repr(command)
        assert "- `cd /repo ⏎ pytest -q`" in previous
        assert all(f"> Instruction {i}." in previous for i in (1, 2, 3))


def test_a_model_summary_that_copied_the_skeletons_header_is_carried_whole() -> None:
    from proxy.compaction import EXTRACTIVE_HEADER

    model_summary = (
        f"{EXTRACTIVE_HEADER}\n\n## Task (the user's words)\n> Rename the package.\n\n"
        "## Done\nRenamed the modules.\n\n## Left\n1. Update the imports."
    )
    text = extractive_summary(work_middle(), previous_summary=model_summary)
    assert "## Previous summary\n" + model_summary in text
    assert "1. Update the imports." in text


def test_summaries_are_sized_to_the_window() -> None:
    assert summary_chars(3000) == 1500
    assert summary_chars(8192) == 4096
    assert summary_chars(1000) == 1000
    assert summary_chars(200000) == 12000
    long = [m for k in range(200) for m in tool_round(k)]
    assert len(extractive_summary(long, previous_summary=None, max_chars=1500)) <= 1500


def test_an_image_counts_as_an_image_not_as_its_base64() -> None:
    """A 1 MB screenshot in the history read as 250,000 tokens: compaction fired on a session's
    first request, and a window of 128k looked full."""
    screenshot = "data:image/png;base64," + "iVBORw0KGgo" * 100_000
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is wrong on this page?"},
            {"type": "image_url", "image_url": {"url": screenshot}},
        ],
    }
    assert 1600 < estimate_tokens([message]) < 1700
    by_url = {
        **message,
        "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}],
    }
    assert 1600 < estimate_tokens([by_url]) < 1650  # an image costs as much whichever way it comes
    text = {"role": "user", "content": "x" * 4000}  # text alone: 4,028 bytes of JSON / 4, + 4
    assert estimate_tokens([text]) == 1007 + 4
    odd = {"role": "user", "content": [{"type": ["image_url"]}, {"type": {"a": 1}}, "text", None]}
    assert estimate_tokens([odd]) > 0  # a malformed part is counted as it is, never an error
    low = {"type": "image_url", "image_url": {"url": screenshot, "detail": "low"}}
    assert 85 < estimate_tokens([{**message, "content": [low]}]) < 100  # OpenAI's 85


def test_the_hour_shares_weight_counts_images_by_pixels_and_documents_by_bytes_or_more() -> None:
    """The weight the hour's share of Claude's cache writes is read by: an image by its size,
    an inline document by its bytes (a flat 1,600 made a ~25-page PDF's share 80% where it was
    ~12%), a document by URL or file id no less than 1,600 (its few bytes made it weigh ~40
    tokens: the share ~99%)."""
    from proxy.compaction import MEDIA_PART_TOKENS, image_weighed_tokens

    def user(part: dict[str, Any]) -> dict[str, Any]:
        return {"role": "user", "content": [part, {"type": "text", "text": "Summarize it."}]}

    inline = "data:application/pdf;base64," + "JVBERi0xLjcK" * 50_000  # ~600 KB
    by_bytes = image_weighed_tokens(user({"type": "file", "file": {"file_data": inline}}))
    assert 600_000 // 4 < by_bytes < 600_000 // 4 + 100
    for referenced in (
        {"type": "file", "file": {"file_data": "https://example.com/spec.pdf"}},
        {"type": "file", "file": {"file_id": "file-abc123"}},
    ):
        weight = image_weighed_tokens(user(referenced))
        assert MEDIA_PART_TOKENS <= weight < MEDIA_PART_TOKENS + 30, referenced
    screenshot = "data:image/png;base64," + "iVBORw0KGgo" * 100_000
    image = image_weighed_tokens(user({"type": "image_url", "image_url": {"url": screenshot}}))
    assert image == estimate_tokens(user({"type": "image_url", "image_url": {"url": screenshot}}))
    text = {"role": "user", "content": "x" * 4000}
    assert image_weighed_tokens(text) == estimate_tokens(text)


def test_a_summary_request_keeps_its_transcript_within_its_budget_and_asks_for_a_length() -> None:
    long = [m for k in range(300) for m in tool_round(k)]
    body = build_summary_request(
        long, previous_summary=None, model="m", max_tool_chars=200, max_chars=5000, words=250
    )
    prompt = body["messages"][1]["content"]
    transcript = prompt.split("<transcript>\n", 1)[1].split("\n</transcript>", 1)[0]
    assert len(transcript) <= 5000 + 60
    assert "characters omitted by cachegate" in transcript
    assert transcript.startswith("[0] assistant:")  # its head and its tail are kept
    assert transcript.rstrip().endswith(long[-1]["content"][-20:])
    assert prompt.endswith("Keep the summary under about 250 words.")


def test_summary_request_renders_tools_as_text_and_asks_for_the_sections() -> None:
    middle = work_middle()
    middle[4] = {"role": "tool", "tool_call_id": "s1", "content": "x" * 5000 + "TAIL"}

    body = build_summary_request(middle, previous_summary=None, model="gpt-4o")

    assert body["model"] == "gpt-4o"
    assert "tools" not in body and body["stream"] is False
    system, user = body["messages"]
    assert system == {"role": "system", "content": SUMMARIZER_SYSTEM_PROMPT}
    for heading in ("## Task", "## Done", "## Left", "## Files and commands", "## Decisions"):
        assert heading in SUMMARIZER_SYSTEM_PROMPT
    prompt = user["content"]
    assert ROLLING_INSTRUCTION not in prompt
    assert '-> tool call read_file({"path":"tests/test_app.py"}) (id r1)' in prompt
    assert "tool result of shell (id s1):" in prompt
    clipped = "x" * 1500 + "\n[… 3004 characters omitted by cachegate …]\n" + "x" * 496 + "TAIL"
    assert f"tool result of shell (id s1):\n{clipped}\n\n[5] assistant:" in prompt
    assert LAUNCH["content"] in prompt


def test_rolling_summary_request_carries_the_previous_summary_to_copy() -> None:
    body = build_summary_request(
        work_middle(), previous_summary="## Task\n> Rename the package.", model="m"
    )

    prompt = body["messages"][1]["content"]
    assert ROLLING_INSTRUCTION in prompt
    assert "Copy its still relevant parts verbatim" in ROLLING_INSTRUCTION
    assert "<previous_summary>\n## Task\n> Rename the package.\n</previous_summary>" in prompt


def test_summary_message_is_a_marked_user_message() -> None:
    message = summary_message("## Task\n> x", covered=5, source="extractive")

    assert message["role"] == "user"
    assert message["content"].startswith(SUMMARY_MARKER)
    assert "replaces the 5 earlier messages" in message["content"]
    assert is_synthetic(message)
    assert summary_text(message) == "## Task\n> x"


# --- sticky substitution --------------------------------------------------------------------


def compacted_reference() -> tuple[list[Message], Compaction]:
    history = reference()
    cut = find_cut(history, keep_recent=8, max_anchor_chars=0)
    assert cut == Cut(1, 16)
    return history, build_compaction(history, cut, "## Task\n> fix it", source="model")


def test_substitution_is_byte_identical_as_the_history_grows() -> None:
    history, compaction = compacted_reference()
    first = apply_compaction(history, compaction)
    later_history = orjson.loads(orjson.dumps([*history, *tool_round(10), *tool_round(11)]))
    later = apply_compaction(later_history, compaction)

    assert first is not None and later is not None
    assert first == [SYSTEM, compaction.message, *history[16:]]
    assert orjson.dumps(later[: len(first)]) == orjson.dumps(first)
    assert later[len(first) :] == [*tool_round(10), *tool_round(11)]
    assert compaction.covered == 16 and compaction.start == 1
    assert compaction.tokens_after < compaction.tokens_before


def test_rewind_before_the_covered_prefix_drops_the_summary() -> None:
    history, compaction = compacted_reference()
    rewound = [*history[:10], {"role": "user", "content": "No, do it differently."}]
    forked = [*history]
    forked[15] = {"role": "tool", "tool_call_id": "call_5", "content": "other output"}

    assert apply_compaction(rewound, compaction) is None
    assert apply_compaction(forked, compaction) is None
    assert apply_compaction(history[:15], compaction) is None
    # the covered prefix and nothing after it (a regenerate of the answer at that point): the
    # summary would be the last message, the client's own last one hidden in it
    assert compaction.covered == 16
    assert apply_compaction(history[:16], compaction) is None


def test_rewind_after_the_covered_prefix_keeps_the_summary() -> None:
    history, compaction = compacted_reference()
    steer = {"role": "user", "content": "Stop, try another way."}
    rewound = [*history[:18], steer]

    assert apply_compaction(rewound, compaction) == [
        SYSTEM,
        compaction.message,
        *history[16:18],
        steer,
    ]


def test_prefix_digest_resumes_from_a_known_digest_and_ignores_key_order() -> None:
    history = reference()
    known = (10, prefix_digest(history, 10))
    reordered = [dict(reversed(list(m.items()))) for m in history]

    assert prefix_digest(history, 20, known=known) == prefix_digest(history, 20)
    assert prefix_digest(reordered, 20) == prefix_digest(history, 20)
    assert prefix_digest(history, 20) != prefix_digest(history, 19)


# --- the per-request plan -------------------------------------------------------------------


SETTINGS: dict[str, Any] = {
    "window": 100_000,
    "trigger_percent": 75.0,
    "keep_recent": 8,
    "max_anchor_chars": 0,
}


def test_plan_does_nothing_below_the_trigger() -> None:
    history = reference()
    result = plan(history, existing=None, **SETTINGS, last_prompt=1000, last_completion=100)

    assert result.messages is history
    assert result.cut is None and result.middle == [] and not result.discarded


def test_plan_compacts_over_the_trigger_then_rolls() -> None:
    history = reference()
    first = plan(history, existing=None, **SETTINGS, last_prompt=80_000, last_completion=0)
    assert first.cut == Cut(1, 16)
    assert first.middle == history[1:16] and first.previous_summary is None

    compaction = build_compaction(history, first.cut, "FIRST SUMMARY", source="model")
    grown = [*history, *(m for k in range(10, 14) for m in tool_round(k))]
    second = plan(grown, existing=compaction, **SETTINGS, force=True)

    assert second.reused is compaction
    assert second.messages == apply_compaction(grown, compaction)
    assert second.cut == Cut(1, 24)
    assert second.middle == grown[16:24]
    assert second.previous_summary == "FIRST SUMMARY"


def test_plan_discards_a_compaction_after_a_rewind_and_ignores_stale_numbers() -> None:
    history, compaction = compacted_reference()
    rewound = [*history[:5], {"role": "user", "content": "Start over."}]

    result = plan(rewound, existing=compaction, **SETTINGS, last_prompt=99_000, last_completion=0)

    assert result.discarded and result.reused is None
    assert result.messages is rewound
    assert result.cut is None


# --- provider refusal -----------------------------------------------------------------------


def test_is_context_length_error() -> None:
    body = orjson.dumps(
        {
            "error": {
                "message": "This model's maximum context length is 128000 tokens. However, ...",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        }
    )
    assert is_context_length_error(400, body)
    assert is_context_length_error(400, b"prompt is too long: 210000 tokens > 200000 maximum")
    assert not is_context_length_error(429, body)
    assert not is_context_length_error(400, b'{"error": {"message": "Invalid value: \'x\'."}}')


def test_a_history_too_long_beside_its_max_tokens_is_still_a_context_refusal() -> None:
    body = (
        b'{"object":"error","message":"This model\'s maximum context length is 4096 tokens.'
        b' However, you requested 5000 tokens (3000 in the messages, 2000 in the completion)."}'
    )
    assert is_context_length_error(400, body) and provider_window(body) == 4096


@pytest.mark.parametrize(
    ("body", "window", "prompt"),
    [
        pytest.param(
            b'{"error":{"message":"This model\'s maximum context length is 128000 tokens. However,'
            b' your messages resulted in 130412 tokens.","type":"invalid_request_error",'
            b'"param":"messages","code":"context_length_exceeded"}}',
            128000,
            130412,
            id="openai",
        ),
        pytest.param(
            b'{"error":{"code":400,"message":"request (9412 tokens) exceeds the available context'
            b' size (8192 tokens), try increasing it","type":"exceed_context_size_error",'
            b'"n_prompt_tokens":9412,"n_ctx":8192}}',
            8192,
            9412,
            id="llama.cpp-and-ollama",
        ),
        pytest.param(
            b'{"error":{"message":"the request exceeds the available context size, try increasing'
            b' it","type":"exceed_context_size_error","n_ctx":4096}}',
            4096,
            None,
            id="llama.cpp-older",
        ),
        pytest.param(
            b'{"object":"error","message":"The input (150000 tokens) is longer than the model\'s'
            b' context length (128000 tokens).","type":"BadRequestError","code":400}',
            128000,
            150000,
            id="together-sglang",
        ),
        pytest.param(
            b'[{"error":{"code":400,"message":"The input token count (1200000) exceeds the maximum'
            b' number of tokens allowed (1048576).","status":"INVALID_ARGUMENT"}}]',
            1048576,
            1200000,
            id="gemini",
        ),
        pytest.param(
            b'{"code":"Client specified an invalid argument","error":"This model\'s maximum prompt'
            b' length is 131072 but the request contains 140000 tokens."}',
            131072,
            140000,
            id="xai",
        ),
        pytest.param(
            b'{"object":"error","message":"Prompt contains 40000 tokens and 0 draft tokens, too'
            b' large for model with 32768 maximum context length","type":"invalid_request_error"}',
            32768,
            40000,
            id="mistral",
        ),
        pytest.param(
            b'{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too'
            b' long: 210000 tokens > 200000 maximum"}}',
            200000,
            210000,
            id="anthropic",
        ),
        pytest.param(
            b'{"type":"error","error":{"type":"invalid_request_error","message":"input length and'
            b" `max_tokens` exceed context limit: 178959 + 64000 > 200000, decrease input length"
            b' or `max_tokens` and try again"}}',
            200000,
            178959,
            id="anthropic-with-max-tokens",
        ),
        pytest.param(
            b'{"object":"error","message":"Requested token count exceeds the model\'s maximum'
            b" context length of 32768 tokens. You requested a total of 35435 tokens: 19051"
            b" tokens from the input messages and 16384 tokens for the completion. Please reduce"
            b" the number of tokens in the input messages or the completion to fit within the"
            b' limit.","type":"BadRequestError","param":null,"code":400}',
            32768,
            19051,
            id="sglang-with-completion",
        ),
        pytest.param(
            b'{"error":"Input validation error: `inputs` tokens + `max_new_tokens` must be <='
            b' 32769. Given: 40000 `inputs` tokens and 2048 `max_new_tokens`",'
            b'"error_type":"validation"}',
            32769,
            40000,
            id="tgi-together-dedicated",
        ),
        pytest.param(
            b'{"error":{"message":"Provider returned error","code":400,"metadata":{"raw":"{\\"type'
            b'\\":\\"error\\",\\"error\\":{\\"type\\":\\"invalid_request_error\\",'
            b'\\"message\\":\\"prompt is too long: 210000 tokens > 200000 maximum\\"}}",'
            b'"provider_name":"Anthropic"}}}',
            200000,
            210000,
            id="openrouter-relaying-anthropic",
        ),
        pytest.param(
            b'{"error":"The number of tokens to keep from the initial prompt is greater than the'
            b' context length. Try to load the model with a larger context length."}',
            None,
            None,
            id="lm-studio",
        ),
        pytest.param(
            b'{"error":"Trying to keep the first 15857 tokens when context the overflows.'
            b" However, the model is loaded with context length of only 7500 tokens, which is"
            b" not enough. Try to load the model with a larger context length, or provide a"
            b' shorter input"}',
            7500,
            None,
            id="lm-studio-0.3",
        ),
        pytest.param(
            b'{"error":"Cannot truncate prompt with n_keep (14169) >= n_ctx (4096)"}',
            4096,
            None,
            id="lm-studio-0.4",
        ),
        pytest.param(
            b'{"message":"Input is too long for requested model."}',
            None,
            None,
            id="bedrock",
        ),
    ],
)
def test_the_context_refusals_of_the_usual_servers_are_recognised_with_their_window(
    body: bytes, window: int | None, prompt: int | None
) -> None:
    assert is_context_length_error(400, body)
    assert provider_window(body) == window
    # the count a forced retry cuts its reused summary by (none stated: the refusal is relayed)
    assert provider_prompt_tokens(body) == prompt


def test_other_refusals_are_not_taken_for_context_length() -> None:
    for body in (
        # vLLM: max_tokens fills the window alone; a compaction cannot help, and each retry
        # cost a summary call for the same refusal
        b'{"object":"error","message":"\'max_tokens\' or \'max_completion_tokens\' is too large:'
        b" 5000. This model's maximum context length is 4096 tokens and your request has 896"
        b' input tokens (5000 > 4096 - 896).","type":"BadRequestError","code":400}',
        b'{"object":"error","message":"This model\'s maximum context length is 4096 tokens.'
        b' However, you requested 5896 tokens (896 in the messages, 5000 in the completion)."}',
        # (OpenAI's older models, with their code: a summary was paid for, the retry refused)
        b'{"error":{"message":"This model\'s maximum context length is 4096 tokens. However,'
        b" you requested 5896 tokens (896 in the messages, 5000 in the completion). Please reduce"
        b' the length of the messages or completion.","type":"invalid_request_error",'
        b'"param":"messages","code":"context_length_exceeded"}}',
        b'{"error":{"message":"Invalid type for \'messages[2].content\'","code":null}}',
        b'{"error":{"message":"max_tokens is too large: 9000. Use at most 4096.","code":null}}',
        b'{"error":{"message":"Rate limit reached for tokens per min (TPM)"}}',
        # a validation error that echoes the request: what the request says is not the error
        b'{"detail":[{"type":"literal_error","loc":["body","messages",0,"content",0,"type"],'
        b'"msg":"Input should be \'text\'","input":{"type":"note","text":"the input is too long'
        b' for one buffer"}}]}',
        # the output limit alone is too large for the window: compacting would not help
        b'{"error":{"message":"max_tokens (200000) exceeds context length (131072)"}}',
        b'{"type":"error","error":{"type":"invalid_request_error","message":"input length and'
        b" `max_tokens` exceed context limit: 1000 + 200000 > 200000, decrease input length or"
        b' `max_tokens` and try again"}}',
        b'{"error":"Input validation error: `inputs` tokens + `max_new_tokens` must be <= 32769.'
        b' Given: 10 `inputs` tokens and 40000 `max_new_tokens`"}',
        b'{"error":"max_tokens is greater than the context length"}',
    ):
        assert not is_context_length_error(400, body)


def test_one_task_stays_however_long_its_tool_loop() -> None:
    """The task's own size decides, not the whole loop's: a session long enough to reach a real
    trigger (hundreds of KB) used to have its task summarized."""
    rounds = [m for k in range(600) for m in tool_round(k)]
    history = [SYSTEM, LAUNCH, *rounds]
    assert sum(content_chars(m) for m in history[1:]) > 40000
    assert find_cut(history, keep_recent=8, max_anchor_chars=40000) == Cut(2, 1194)
    assert history[1] is LAUNCH  # kept verbatim, before the summary
    # a task longer than the budget is summarized with the rest
    huge = {"role": "user", "content": "x" * 50000}
    assert find_cut([SYSTEM, huge, *rounds], keep_recent=8, max_anchor_chars=40000) == Cut(1, 1194)


def test_a_summary_over_its_length_is_cut_at_a_line_end_and_says_so() -> None:
    from proxy.compaction import clip_summary

    text = "\n".join(f"line {i} of the summary" for i in range(400))
    clipped = clip_summary(text, 1000)
    assert len(clipped) <= 1000
    kept, note = clipped.rsplit("\n", 1)
    assert text.startswith(kept + "\n")  # whole lines, cut at one's end
    assert "summary cut by cachegate" in note and f"{len(text):,} characters" in note
    assert clip_summary("short", 1000) == "short"
    one_line = "x" * 5000  # no line end near the limit: cut where the limit falls
    assert len(clip_summary(one_line, 1000)) <= 1000
    # no line end near it, but words: cut at one's end, not inside it (a retry's summary, cut to
    # its room, lost half a word and more)
    prose = " ".join(f"word{i}" for i in range(2000))
    kept = clip_summary(prose, 1000).rsplit("\n", 1)[0]
    assert prose.startswith(kept + " ") and len(kept) > 800


def test_an_extractive_summary_never_keeps_a_piece_of_a_key() -> None:
    """The skeleton's lines are cut at 120, 160, 200 characters: a key across the cut left a
    piece the log's redaction no longer knows (38 of a Google key's 39 characters were logged
    and replayed); the key is kept whole or left out, and what is kept is redacted."""
    from proxy.redact import redact_text

    key = "AIzaSyD4f8kL2mN9pQ3rS7tU1vW5xY0zA6bC3dE"
    npm = "npm_Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zA7bC"
    middle: list[dict[str, Any]] = [
        {"role": "user", "content": "Set it up. " + "a " * 95 + key},
        {"role": "assistant", "content": "Using " + "b " * 95 + key},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "env", "arguments": '{"t": "' + "c " * 52 + npm + '"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "d " * 70 + npm},
    ]
    text = extractive_summary(middle, previous_summary=None)
    redacted = redact_text(text)
    assert "AIz" not in redacted and "npm_" not in redacted  # (the cuts came at "AIz…" too)
    assert "a a" in text and "b b" in text and "c c" in text and "d d" in text


def test_a_long_tool_output_sent_to_the_summarizer_is_not_cut_inside_a_key() -> None:
    """The summarizer's transcript keeps a long output's head and tail: neither is cut inside
    a key (the model may quote what it is given, into the summary the log keeps)."""
    from proxy.compaction import _clip_middle

    key = "sk-proj-Ab3dEf6hIj9kL0mN1oP2qR3sT4uV5wX6yZ7aB8cD9e"
    text = "x " * 1480 + key + " " + "y " * 1000 + key + " " + "z " * 490
    clipped = _clip_middle(text, 4000)  # the head ends and the tail begins inside a key
    assert 2960 < 4000 * 3 // 4 < 2960 + len(key)
    assert len(text) - 1031 < len(text) - 1000 < len(text) - 981
    assert "sk-" not in clipped and "9e" not in clipped
    assert clipped.startswith("x x") and clipped.endswith(" z ") and "omitted" in clipped


def test_the_completion_a_refusal_counts_is_reserved_where_its_server_counts_it() -> None:
    """What the refusal says the request asked for; else the request's own max_tokens where
    the server counts it in the window (OpenAI's family, SGLang), not where it counts the
    prompt alone (llama.cpp): a retry there was given up, or refused again here."""
    from proxy.compaction import reserved_output

    body = {"max_tokens": 16384}
    sglang = (
        b'{"object":"error","message":"Requested token count exceeds the model\'s maximum'
        b" context length of 32768 tokens. You requested a total of 35435 tokens: 19051 tokens"
        b' from the input messages and 16384 tokens for the completion."}'
    )
    assert reserved_output(sglang, {"max_tokens": 1}) == 16384  # (the refusal's word)
    longer = b'{"message":"The input (36560 tokens) is longer than the model\'s context length"}'
    assert reserved_output(longer, body) == 16384
    assert provider_prompt_tokens(longer) == 36560  # (what it counted: dense text)
    openai_family = b'{"error":{"message":"This model\'s maximum context length is 8192 tokens.'
    openai_family += b' However, your messages resulted in 9000 tokens."}}'
    assert reserved_output(openai_family, body) == 16384
    llama = (
        b'{"error":{"code":400,"message":"request (9412 tokens) exceeds the available context'
        b' size (8192 tokens), try increasing it","type":"exceed_context_size_error"}}'
    )
    assert reserved_output(llama, body) == 0


def test_a_screenshot_in_the_summarized_range_is_named_not_left_blank() -> None:
    """A computer-use agent's screenshot tool returns an image: the summarizer was shown a
    blank result (as if the tool returned nothing), and the extractive summary `screenshot({})
    -> ` with nothing after it; a browser agent's screenshot-only user messages were quoted as
    empty "user's words", filling the slots of the user's latest messages."""
    shot = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    call = {
        "id": "shot1",
        "type": "function",
        "function": {"name": "screenshot", "arguments": "{}"},
    }
    middle: list[Message] = [
        {"role": "user", "content": "Open the settings page"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "shot1", "content": [shot]},
        {"role": "user", "content": [shot]},
        {"role": "assistant", "content": "The settings page is open."},
    ]
    prompt = build_summary_request(middle, previous_summary=None, model="m")["messages"][1]
    assert "tool result of screenshot (id shot1):\n[non-text content omitted]" in prompt["content"]
    text = extractive_summary(middle, previous_summary=None)
    assert "- screenshot({}) -> (non-text result)" in text
    assert "> Open the settings page" in text
    assert "> \n" not in text + "\n" and not text.rstrip().endswith(">")
    quotes = [line for line in text.splitlines() if line.startswith(">")]
    assert quotes == ["> Open the settings page"]
