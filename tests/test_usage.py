"""Usage normalization across provider dialects, and usage tracking over a stream."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.usage import Usage, UsageTracker, normalize_usage


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(None, None, id="none"),
        pytest.param({}, None, id="empty"),
        pytest.param({"total_tokens": 12}, None, id="no-token-fields"),
        pytest.param(
            {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
            Usage(100, 20, 0, 0, False),
            id="openai-no-cache-field",
        ),
        pytest.param(
            {
                "prompt_tokens": 2006,
                "completion_tokens": 300,
                "total_tokens": 2306,
                "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0},
            },
            Usage(2006, 300, 1920, 0, True),
            id="openai-cached",
        ),
        pytest.param(
            {
                "prompt_tokens": 50,
                "completion_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
            Usage(50, 5, 0, 0, True),
            id="openai-cache-miss-is-reported",
        ),
        pytest.param(
            {"prompt_tokens": 50, "completion_tokens": 5, "prompt_tokens_details": None},
            Usage(50, 5, 0, 0, False),
            id="openai-null-details",
        ),
        pytest.param(
            {
                "prompt_tokens": 1500,
                "completion_tokens": 40,
                "total_tokens": 1540,
                "prompt_cache_hit_tokens": 1280,
                "prompt_cache_miss_tokens": 220,
            },
            Usage(1500, 40, 1280, 0, True),
            id="deepseek",
        ),
        pytest.param(
            {
                "completion_tokens": 40,
                "prompt_cache_hit_tokens": 1280,
                "prompt_cache_miss_tokens": 220,
            },
            Usage(1500, 40, 1280, 0, True),
            id="deepseek-prompt-from-hit-plus-miss",
        ),
        pytest.param(
            {"completion_tokens": 7, "prompt_cache_hit_tokens": 0, "prompt_cache_miss_tokens": 64},
            Usage(64, 7, 0, 0, True),
            id="deepseek-full-miss",
        ),
        pytest.param(
            {
                "input_tokens": 12,
                "output_tokens": 85,
                "cache_read_input_tokens": 4000,
                "cache_creation_input_tokens": 600,
            },
            Usage(4612, 85, 4000, 600, True, True, True),  # Claude's own field: marks needed
            id="anthropic-style-prompt-includes-cache",
        ),
        pytest.param(
            {
                "prompt_tokens": 4612,
                "completion_tokens": 85,
                "cache_read_input_tokens": 4000,
                "cache_creation_input_tokens": 600,
                "prompt_tokens_details": {"cached_tokens": 4000},
            },
            Usage(4612, 85, 4000, 600, True, True, True),
            id="anthropic-fields-with-openai-prompt-total",
        ),
        pytest.param(
            {"input_tokens": 30, "output_tokens": 3, "cache_creation_input_tokens": 0},
            Usage(30, 3, 0, 0, True, True, True),
            id="anthropic-style-zero-cache-is-reported",
        ),
        pytest.param(
            {
                "input_tokens": 900,
                "output_tokens": 10,
                "input_tokens_details": {"cached_tokens": 512},
            },
            Usage(900, 10, 512, 0, True),
            id="responses-api",
        ),
        pytest.param(
            {
                "prompt_tokens": 6000,
                "completion_tokens": 20,
                "total_tokens": 6020,
                "cached_tokens": 4992,
            },
            Usage(6000, 20, 4992, 0, True),
            id="moonshot-top-level-cached-tokens",
        ),
        pytest.param(
            {"prompt_tokens": 7000, "completion_tokens": 20, "cached_tokens": 0},
            Usage(7000, 20, 0, 0, True),
            id="moonshot-miss-is-reported",
        ),
        pytest.param(
            {
                "prompt_tokens": 6000,
                "completion_tokens": 20,
                "cost": 0.0019,
                "prompt_tokens_details": {
                    "cached_tokens": 4992,
                    "cache_write_tokens": 896,
                    "audio_tokens": 0,
                },
            },
            Usage(6000, 20, 4992, 896, True, True),
            id="openrouter-cache-writes",
        ),
        pytest.param(
            {
                "prompt_tokens": 5000,
                "completion_tokens": 20,
                "prompt_tokens_details": {"cache_write_tokens": 4992},
            },
            Usage(5000, 20, 0, 4992, True, True),
            id="openrouter-write-only",
        ),
        pytest.param(
            {"prompt_tokens": True, "completion_tokens": "5", "prompt_cache_hit_tokens": -1},
            None,  # no count at all: unknown, not a free exchange of 0 tokens
            id="non-counts-ignored",
        ),
        pytest.param(
            {
                "prompt_tokens": None,
                "completion_tokens": None,
                "prompt_tokens_details": {"cached_tokens": None},
            },
            None,  # a provider that sends nulls did not look free
            id="null-counts-unknown",
        ),
        pytest.param(
            {"prompt_tokens": -5, "completion_tokens": -3}, None, id="negative-counts-unknown"
        ),
        pytest.param(
            {
                "prompt_tokens": 10**30,
                "completion_tokens": 10**30,
                "prompt_tokens_details": {"cached_tokens": 10**29},
            },
            None,  # beyond any request: a broken answer, never billions in the cost panel
            id="counts-beyond-any-request-unknown",
        ),
        pytest.param(  # an unsigned -1 of 32 bits: ~$10,700 of gpt-4o input, if taken
            {"prompt_tokens": 2**32 - 1, "completion_tokens": 7}, None, id="wrapped-minus-one"
        ),
        pytest.param({"prompt_tokens": 2**53, "completion_tokens": 7}, None, id="2**53-unknown"),
        pytest.param(
            {"prompt_tokens": 10**9, "completion_tokens": 7},
            Usage(10**9, 7, 0, 0, False),
            id="a-billion-still-a-count",
        ),
        pytest.param(  # the completion alone says nothing of the prompt: not a free 0
            {"prompt_tokens": None, "completion_tokens": 10}, None, id="null-prompt-unknown"
        ),
        pytest.param({"completion_tokens": 10}, None, id="missing-prompt-unknown"),
        pytest.param(
            {
                "prompt_tokens": 1000.5,
                "completion_tokens": 10,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
            None,
            id="fractional-prompt-unknown",
        ),
        pytest.param({"output_tokens": 3}, None, id="output-alone-unknown"),
        pytest.param(  # a broken count beside a sound one: the answer is broken, not its
            {"prompt_tokens": 10, "completion_tokens": 2**32 - 1},  # output free
            None,
            id="broken-completion-unknown",
        ),
        pytest.param(  # nor a fallback's prompt
            {"prompt_tokens": -1, "input_tokens": 9, "completion_tokens": 1},
            None,
            id="broken-prompt-beside-input-unknown",
        ),
        pytest.param(  # xAI's Grok: reasoning apart from the completion, in the total
            {
                "prompt_tokens": 663,
                "completion_tokens": 50,
                "total_tokens": 837,
                "prompt_tokens_details": {"cached_tokens": 654},
                "completion_tokens_details": {"reasoning_tokens": 124},
            },
            Usage(663, 174, 654, 0, True),
            id="xai-reasoning-outside-completion",
        ),
        pytest.param(  # a gateway in front of Gemini: thoughts beside the completion
            {
                "prompt_tokens": 21,
                "completion_tokens": 0,
                "total_tokens": 81,
                "completion_tokens_details": {"reasoning_tokens": 60},
            },
            Usage(21, 60, 0, 0, False),
            id="gemini-thoughts-beside-completion",
        ),
        pytest.param(  # OpenAI: reasoning inside the completion, the total their sum
            {
                "prompt_tokens": 100,
                "completion_tokens": 500,
                "total_tokens": 600,
                "completion_tokens_details": {"reasoning_tokens": 448},
            },
            Usage(100, 500, 0, 0, False),
            id="openai-reasoning-inside-completion",
        ),
        pytest.param(  # reasoning inside, and a gateway's cache writes in the total: no sum
            {
                "prompt_tokens": 1000,
                "completion_tokens": 500,
                "total_tokens": 3500,
                "completion_tokens_details": {"reasoning_tokens": 300},
                "cache_creation_input_tokens": 2000,
            },
            Usage(3000, 500, 0, 2000, True, True, True),  # (the writes were left out of 1000)
            id="reasoning-inside-beside-a-cache-write-surplus",
        ),
        pytest.param(  # Anthropic's writes by cache life, as a gateway passes them on
            {
                "prompt_tokens": 7000,
                "completion_tokens": 5,
                "cache_read_input_tokens": 1000,
                "cache_creation_input_tokens": 6000,
                "cache_creation": {
                    "ephemeral_5m_input_tokens": 2000,
                    "ephemeral_1h_input_tokens": 4000,
                },
            },
            Usage(7000, 5, 1000, 6000, True, True, True, 4000, True),
            id="anthropic-one-hour-writes",
        ),
        pytest.param(  # LiteLLM's OpenAI-shaped usage: the split inside the prompt details
            {
                "prompt_tokens": 100_010,
                "completion_tokens": 5,
                "cache_creation_input_tokens": 100_000,
                "prompt_tokens_details": {
                    "cached_tokens": 0,
                    "cache_creation_tokens": 100_000,
                    "cache_creation_token_details": {
                        "ephemeral_5m_input_tokens": 0,
                        "ephemeral_1h_input_tokens": 100_000,
                    },
                },
            },
            Usage(100_010, 5, 0, 100_000, True, True, True, 100_000, True),
            id="litellm-one-hour-writes",
        ),
        pytest.param(  # LiteLLM's Usage built with the details alone
            {
                "prompt_tokens": 5000,
                "completion_tokens": 10,
                "prompt_tokens_details": {
                    "cached_tokens": 0,
                    "cache_creation_tokens": 4000,
                    "cache_creation_token_details": {"ephemeral_1h_input_tokens": 4000},
                },
            },
            Usage(5000, 10, 0, 4000, True, True, True, 4000, True),
            id="litellm-writes-in-the-details-alone",
        ),
        pytest.param(  # never more of them than the writes
            {
                "input_tokens": 10,
                "output_tokens": 5,
                "cache_creation_input_tokens": 100,
                "cache_creation": {"ephemeral_1h_input_tokens": 900},
            },
            Usage(110, 5, 0, 100, True, True, True, 100, True),
            id="one-hour-writes-capped",
        ),
        pytest.param(  # LiteLLM releases in front of Claude: input + reads, the writes left out
            {
                "prompt_tokens": 10,
                "completion_tokens": 5,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 4990,
            },
            Usage(5000, 5, 0, 4990, True, True, True),
            id="prompt-without-the-cache-writes",
        ),
        pytest.param(
            {
                "prompt_tokens": 5110,
                "completion_tokens": 5,
                "cache_read_input_tokens": 5100,
                "cache_creation_input_tokens": 0,
            },
            Usage(5110, 5, 5100, 0, True, True, True),
            id="prompt-without-the-cache-writes-a-hit",
        ),
        pytest.param(
            {
                "prompt_tokens": 10,
                "completion_tokens": 5,
                "cache_read_input_tokens": 4000,
                "cache_creation_input_tokens": 900,
            },
            Usage(4910, 5, 4000, 900, True, True, True),
            id="prompt-without-any-cache-part",
        ),
        pytest.param(  # Gemini with grounding: the tool-use prompt in the total is input
            {"prompt_tokens": 151, "completion_tokens": 2209, "total_tokens": 20689},
            Usage(151, 2209, 0, 0, False),
            id="gemini-grounding-surplus-is-no-output",
        ),
        pytest.param(  # a total below the sum (a provider's own rounding) changes nothing
            {"prompt_tokens": 758, "completion_tokens": 102, "total_tokens": 800},
            Usage(758, 102, 0, 0, False),
            id="total-below-the-sum",
        ),
        pytest.param(  # OpenAI's fields, a prompt that leaves out what it read from the cache
            {
                "prompt_tokens": 100,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 900},
            },
            Usage(1000, 2, 900, 0, True),
            id="openai-fields-prompt-without-the-reads",
        ),
        pytest.param(
            {"prompt_tokens": 10.0, "completion_tokens": 2},
            Usage(10, 2, 0, 0, False),
            id="integral-float",
        ),
        pytest.param(  # an audio model's: its audio tokens counted apart, priced apart
            {
                "prompt_tokens": 2000,
                "completion_tokens": 1000,
                "total_tokens": 3000,
                "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 1500},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 900},
            },
            Usage(2000, 1000, 0, 0, True, audio_in=1500, audio_out=900),
            id="openai-audio-tokens",
        ),
        pytest.param(  # the same through a gateway's Anthropic-style fields beside them
            {
                "input_tokens": 2000,
                "output_tokens": 1000,
                "prompt_tokens_details": {"audio_tokens": 1500},
                "completion_tokens_details": {"audio_tokens": 9000},  # (past the count: cut)
            },
            Usage(2000, 1000, 0, 0, False, audio_in=1500, audio_out=1000),
            id="audio-tokens-at-most-their-counts",
        ),
        pytest.param(  # a text model's details say 0: no audio
            {
                "prompt_tokens": 20,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                "completion_tokens_details": {"audio_tokens": 0},
            },
            Usage(20, 2, 0, 0, True),
            id="text-model-audio-zero",
        ),
    ],
)
def test_normalizes_provider_usage(raw: dict[str, Any] | None, expected: Usage | None) -> None:
    assert normalize_usage(raw) == expected


def track(reports: list[dict[str, Any] | None]) -> Usage | None:
    tracker = UsageTracker()
    for report in reports:
        tracker.update(report)
    return tracker.result()


def test_no_report_gives_none() -> None:
    assert track([]) is None
    assert track([None, None]) is None


def test_usage_once_at_the_end() -> None:
    final = {"prompt_tokens": 10, "completion_tokens": 3}
    assert track([None, None, final]) == Usage(10, 3)


def test_zeros_mid_stream_then_real_numbers() -> None:
    zero = {"prompt_tokens": 0, "completion_tokens": 0}
    final = {"prompt_tokens": 10, "completion_tokens": 3}
    assert track([zero, zero, final]) == Usage(10, 3)


def test_running_totals_are_not_summed() -> None:
    reports = [{"prompt_tokens": 10, "completion_tokens": n} for n in (1, 2, 3, 4)]
    assert track(reports) == Usage(10, 4)


def test_later_all_zero_report_does_not_erase_real_numbers() -> None:
    real = {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    zero = {"prompt_tokens": 0, "completion_tokens": 0}
    assert track([real, zero, None, {}]) == Usage(10, 3, 8, 0, True)


def test_only_zero_reports_give_a_zero_usage() -> None:
    zero = {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert track([zero, zero]) == Usage(0, 0, 0, 0, True)


@settings(max_examples=200, deadline=None)
@given(
    totals=st.lists(
        st.tuples(st.integers(0, 10**6), st.integers(0, 10**5), st.integers(0, 10**6)),
        min_size=1,
        max_size=8,
    ),
    noise=st.lists(st.sampled_from([None, "zero"]), max_size=8),
)
def test_last_non_empty_report_wins(
    totals: list[tuple[int, int, int]], noise: list[str | None]
) -> None:
    totals = [(p, c, min(r, p)) for p, c, r in totals]  # a total holds its reads
    reports: list[dict[str, Any] | None] = [
        {"prompt_tokens": p, "completion_tokens": c, "prompt_tokens_details": {"cached_tokens": r}}
        for p, c, r in totals
    ]
    zero = {"prompt_tokens": 0, "completion_tokens": 0}
    reports += [zero if n == "zero" else None for n in noise]
    non_empty = [t for t in totals if any(t)]
    if non_empty:
        p, c, r = non_empty[-1]
        expected = Usage(p, c, r, 0, True)
    else:
        expected = Usage(0, 0, 0, 0, True)
    assert track(reports) == expected


_counts = st.one_of(
    st.none(),
    st.integers(-3, 10**6),
    st.floats(allow_nan=False, allow_infinity=False, min_value=-2, max_value=1e6),
    st.booleans(),
    st.text(max_size=3),
)
_usage_keys = [
    "prompt_tokens",
    "completion_tokens",
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
    "prompt_cache_hit_tokens",
    "prompt_cache_miss_tokens",
    "cached_tokens",
    "total_tokens",
    "completion_tokens_details",
]


@settings(max_examples=400, deadline=None)
@given(
    fields=st.dictionaries(st.sampled_from(_usage_keys), _counts, max_size=5),
    details=st.dictionaries(
        st.sampled_from(["prompt_tokens_details", "input_tokens_details"]),
        st.one_of(
            st.none(),
            st.text(max_size=2),
            st.fixed_dictionaries({"cached_tokens": _counts}),
            st.fixed_dictionaries(
                {}, optional={"cached_tokens": _counts, "cache_write_tokens": _counts}
            ),
        ),
        max_size=2,
    ),
    openai=st.booleans(),
)
@example(  # (a count of the Responses API's that is none: the usage is unknown either way)
    fields={"prompt_tokens": 0, "completion_tokens": 0, "input_tokens": False},
    details={},
    openai=False,
)
def test_the_openai_shortcut_answers_as_the_general_rules_do(
    fields: dict[str, Any], details: dict[str, Any], openai: bool
) -> None:
    from proxy.usage import _normalize

    raw = {**fields, **details}
    if openai:  # make the common shape likely: both counts present and valid
        raw = {"prompt_tokens": 412, "completion_tokens": 64, **details}
    assert normalize_usage(raw) == _normalize(raw)


def test_usages_add_up_and_what_was_counted_comes_off() -> None:
    """Two summary calls billed with one exchange, and the part the metrics counted already."""
    from proxy.usage import added, less

    first = Usage(3000, 10, 100, 50, True, True, True, 20)
    second = Usage(5000, 20, 0, 0, False, False, False, 0)
    both = added(first, second)
    assert both == Usage(8000, 30, 100, 50, True, True, True, 20)
    assert added(None, second) is second
    assert less(both, first) == Usage(5000, 20, 0, 0, True, True, True, 0)
    assert less(first, first) is None
