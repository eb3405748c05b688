"""Provider usage objects normalized into one ``Usage`` value (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final


@dataclass(slots=True)
class Usage:
    """Token usage of one exchange, whatever dialect the provider spoke. A value: never mutated
    (not frozen only because a frozen dataclass costs ~1 µs more to build, once per exchange).

    ``prompt`` counts every input token, cached or not. ``reported_cache`` is true when the provider
    sent any cache field at all, so a 0 from a provider that never reports can be told apart from a
    real miss; ``reported_cache_write`` when it sent a cache-write field (Anthropic-style
    ``cache_creation_input_tokens``, OpenRouter's ``cache_write_tokens``): OpenAI reports reads
    only, and its writes are unknown, not 0.
    """

    prompt: int = 0
    completion: int = 0
    cache_read: int = 0
    cache_write: int = 0
    reported_cache: bool = False
    reported_cache_write: bool = False
    # Anthropic's own ``cache_creation_input_tokens`` was there: a provider that caches only the
    # prefixes a request marks with ``cache_control`` (Claude, behind LiteLLM and the like)
    explicit_cache: bool = False
    # of ``cache_write``, the tokens written for an hour (Anthropic's
    # ``cache_creation.ephemeral_1h_input_tokens``), billed at twice the input price
    cache_write_1h: int = 0
    # the writes were given by cache life (Anthropic's ``cache_creation``, LiteLLM's details):
    # else an hour's share is the request's to tell (OpenRouter gives the total alone)
    write_lives_known: bool = False
    # of ``prompt`` and ``completion``, the audio tokens (OpenAI's ``prompt_tokens_details`` and
    # ``completion_tokens_details`` ``audio_tokens``: an audio model's, billed at audio prices)
    audio_in: int = 0
    audio_out: int = 0


def added(earlier: Usage | None, usage: Usage) -> Usage:
    """``earlier`` and ``usage`` together (two calls billed as one: a compaction's summaries)."""
    if earlier is None:
        return usage
    return Usage(
        earlier.prompt + usage.prompt,
        earlier.completion + usage.completion,
        earlier.cache_read + usage.cache_read,
        earlier.cache_write + usage.cache_write,
        earlier.reported_cache or usage.reported_cache,
        earlier.reported_cache_write or usage.reported_cache_write,
        earlier.explicit_cache or usage.explicit_cache,
        earlier.cache_write_1h + usage.cache_write_1h,
        earlier.write_lives_known and usage.write_lives_known,
        earlier.audio_in + usage.audio_in,
        earlier.audio_out + usage.audio_out,
    )


def less(usage: Usage, counted: Usage) -> Usage | None:
    """``usage`` without what ``counted`` holds of it; None when nothing is left."""
    rest = Usage(
        max(0, usage.prompt - counted.prompt),
        max(0, usage.completion - counted.completion),
        max(0, usage.cache_read - counted.cache_read),
        max(0, usage.cache_write - counted.cache_write),
        usage.reported_cache,
        usage.reported_cache_write,
        usage.explicit_cache,
        max(0, usage.cache_write_1h - counted.cache_write_1h),
        usage.write_lives_known,
        max(0, usage.audio_in - counted.audio_in),
        max(0, usage.audio_out - counted.audio_out),
    )
    if not (rest.prompt or rest.completion or rest.cache_read or rest.cache_write):
        return None
    return rest


# ``cached_tokens`` at the top level: Moonshot (Kimi).
_CACHE_READ_FIELDS = ("cache_read_input_tokens", "prompt_cache_hit_tokens", "cached_tokens")
_CACHE_FIELDS = (
    "cache_read_input_tokens",
    "cached_tokens",
    "cache_creation_input_tokens",
    "prompt_cache_hit_tokens",
    "prompt_cache_miss_tokens",
)
# What sends a usage past the OpenAI shortcut to the general rules: a cache field of another
# dialect, or the Responses API's counts beside OpenAI's (one that is no count, ``false``,
# makes the usage unknown there)
_NOT_OPENAI_ONLY: Final = frozenset((*_CACHE_FIELDS, "input_tokens", "output_tokens"))
_DETAIL_FIELDS = ("prompt_tokens_details", "input_tokens_details")
_DETAIL_COUNTS = ("cached_tokens", "cache_write_tokens", "cache_creation_tokens")
_TOKEN_FIELDS = (
    "prompt_tokens",
    "completion_tokens",
    "input_tokens",
    "output_tokens",
    *_CACHE_FIELDS,
)


# No request holds more tokens than this (the largest context windows are ~10 million tokens, a
# Responses API call that runs many model turns counts them all, still far below): a larger
# number is a broken answer (an unsigned -1 of 32 bits, 4,294,967,295, is one), read as unknown.
# Taken, one such answer added billions of dollars to the cost counters for good, and counters
# that large lose a later answer's units in their floats.
MAX_COUNT: Final = 10**9


def _count(raw: Mapping[str, Any], key: str) -> int | None:
    """A token count, or None when the field is absent, null or not an integer from 0 to
    ``MAX_COUNT``."""
    value = raw.get(key)
    if type(value) is int:  # the common case, first
        return value if 0 <= value <= MAX_COUNT else None
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and 0 <= value <= MAX_COUNT:
        return value
    return None


def normalize_usage(raw: Mapping[str, Any] | None) -> Usage | None:
    """Normalize one provider ``usage`` object; None when it holds no token count at all.

    Dialects: OpenAI (``prompt_tokens``, ``completion_tokens``,
    ``prompt_tokens_details.cached_tokens``; also ``input_tokens_details`` of the Responses API),
    DeepSeek (``prompt_cache_hit_tokens`` / ``prompt_cache_miss_tokens``), Moonshot (a top-level
    ``cached_tokens``), OpenRouter (``prompt_tokens_details.cache_write_tokens`` beside
    OpenAI's ``cached_tokens``) and Anthropic-style fields on OpenAI-compatible endpoints
    (``input_tokens``, ``output_tokens``, ``cache_read_input_tokens``,
    ``cache_creation_input_tokens``, as LiteLLM and other gateways write them).

    ``prompt`` is the total input: ``prompt_tokens`` when present (OpenAI semantics, cached tokens
    included; when it is less than cache read + cache write, the parts it left out are added);
    otherwise DeepSeek's hit + miss; otherwise ``input_tokens`` + cache read + cache
    creation, because Anthropic's ``input_tokens`` counts only the uncached remainder (for the
    Responses API, which has no such fields, that is just ``input_tokens``). ``cache_read`` is the
    largest of the cache-read fields present (providers that send several mean the same number);
    ``cache_write`` the largest of ``cache_creation_input_tokens`` and the details'
    ``cache_write_tokens``. ``reported_cache`` is true iff any cache field was present, even as 0.

    ``completion`` is ``completion_tokens`` (else ``output_tokens``), plus the reasoning tokens
    a provider counts outside it (``_reasoning_apart``: xAI's Grok, gateways in front of
    Gemini), which are billed as output.
    """
    if type(raw) is not dict and not isinstance(raw, Mapping):
        return None
    prompt_tokens, completion_tokens = raw.get("prompt_tokens"), raw.get("completion_tokens")
    if (
        type(prompt_tokens) is int
        and type(completion_tokens) is int
        and 0 <= prompt_tokens <= MAX_COUNT
        and 0 <= completion_tokens <= MAX_COUNT
        and raw.keys().isdisjoint(_NOT_OPENAI_ONLY)
    ):
        # OpenAI's dialect, by far the most common: the same answer as below, sooner.
        cached: int | None = None
        written: int | None = None
        for key in _DETAIL_FIELDS:
            details = raw.get(key)
            if details is not None and (type(details) is dict or isinstance(details, Mapping)):
                if "cache_creation_tokens" in details or "cache_creation_token_details" in details:
                    return _normalize(raw)  # LiteLLM's Anthropic writes, in the details alone
                n = _count(details, "cached_tokens")
                if n is not None and (cached is None or n > cached):
                    cached = n
                if "cache_write_tokens" in details:  # OpenRouter
                    n = _count(details, "cache_write_tokens")
                    if n is not None and (written is None or n > written):
                        written = n
        if "completion_tokens_details" in raw:
            completion_tokens += _reasoning_apart(raw, prompt_tokens, completion_tokens)
        prompt = prompt_tokens
        if (cached or written) and prompt < (cached or 0) + (written or 0):
            prompt += (written or 0) if prompt >= (cached or 0) else (cached or 0) + (written or 0)
        usage = Usage(
            prompt,
            completion_tokens,
            cached or 0,
            written or 0,
            cached is not None or written is not None,
            written is not None,
        )
        return _with_audio(raw, usage)
    return _normalize(raw)


# The main counts: one given, not null, and no count (a fraction, a negative number, a string,
# past ``MAX_COUNT``: a 32-bit unsigned -1) is a broken answer, not a free 0 nor a fallback's
_MAIN_COUNTS: Final = ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")


def _normalize(raw: Mapping[str, Any]) -> Usage | None:
    for key in _MAIN_COUNTS:
        if raw.get(key) is not None and _count(raw, key) is None:
            return None
    details = [d for d in (raw.get(k) for k in _DETAIL_FIELDS) if isinstance(d, Mapping)]
    if not any(_count(raw, k) is not None for k in _TOKEN_FIELDS) and not any(
        _count(d, k) is not None for d in details for k in _DETAIL_COUNTS
    ):
        return None  # no count at all (nulls, negatives, strings): unknown, never a free 0

    reads = [c for c in (_count(raw, k) for k in _CACHE_READ_FIELDS) if c is not None]
    reads += [c for c in (_count(d, "cached_tokens") for d in details) if c is not None]
    created = _count(raw, "cache_creation_input_tokens")
    if created is None:  # LiteLLM's Anthropic writes, in the prompt details alone
        created = max(
            (c for c in (_count(d, "cache_creation_tokens") for d in details) if c is not None),
            default=None,
        )
    writes = [c for c in (_count(d, "cache_write_tokens") for d in details) if c is not None]
    reported_cache = bool(reads or writes) or any(_count(raw, k) is not None for k in _CACHE_FIELDS)
    cache_read = max(reads, default=0)
    cache_write = max([*writes, created or 0])

    prompt = _count(raw, "prompt_tokens")
    if prompt is not None and prompt < cache_read + cache_write:
        # A total is never less than its parts: some LiteLLM releases in front of Claude write
        # input + cache reads, leaving the writes out (a whole miss read as a 10-token prompt);
        # below the reads too, it is Anthropic's input_tokens alone.
        prompt += cache_write if prompt >= cache_read else cache_read + cache_write
    if prompt is None:
        hit = _count(raw, "prompt_cache_hit_tokens")
        miss = _count(raw, "prompt_cache_miss_tokens")
        if hit is not None or miss is not None:
            prompt = (hit or 0) + (miss or 0)
        else:
            given = _count(raw, "input_tokens")
            read = _count(raw, "cache_read_input_tokens")
            if given is None and read is None and created is None:
                # No count of the prompt at all (a null or missing prompt_tokens beside a
                # completion): unknown, never a free 0 in the per-request averages and the cost
                return None
            prompt = (given or 0) + (read or 0) + (created or 0)
    completion = _count(raw, "completion_tokens")
    if completion is None:
        completion = _count(raw, "output_tokens") or 0
    elif (tokens := _count(raw, "prompt_tokens")) is not None:
        completion += _reasoning_apart(raw, tokens, completion)
    reported_write = created is not None or bool(writes)
    # Anthropic's writes by cache life: its own ``cache_creation``, or LiteLLM's
    # ``prompt_tokens_details.cache_creation_token_details``
    splits = [raw.get("cache_creation")]
    splits += [d.get("cache_creation_token_details") for d in details]
    hour = max(
        (
            _count(split, "ephemeral_1h_input_tokens") or 0
            for split in splits
            if isinstance(split, Mapping)
        ),
        default=0,
    )
    usage = Usage(
        prompt,
        completion,
        cache_read,
        cache_write,
        reported_cache,
        reported_write,
        created is not None,
        min(hour or 0, cache_write),
        any(isinstance(split, Mapping) for split in splits),
    )
    return _with_audio(raw, usage)


def _with_audio(raw: Mapping[str, Any], usage: Usage) -> Usage:
    """``usage`` with the audio tokens its details count (an audio model's: OpenAI's
    ``prompt_tokens_details.audio_tokens`` and ``completion_tokens_details.audio_tokens``), at
    most the counts they are part of; ``usage`` itself where there are none (a text model's
    details give 0)."""
    heard = raw.get("prompt_tokens_details")
    said = raw.get("completion_tokens_details")
    audio_in = (_count(heard, "audio_tokens") or 0) if isinstance(heard, Mapping) else 0
    audio_out = (_count(said, "audio_tokens") or 0) if isinstance(said, Mapping) else 0
    if not (audio_in or audio_out):
        return usage
    usage.audio_in = min(audio_in, usage.prompt)
    usage.audio_out = min(audio_out, usage.completion)
    return usage


def _reasoning_apart(raw: Mapping[str, Any], prompt: int, completion: int) -> int:
    """Reasoning tokens a provider counts outside ``completion_tokens`` (xAI's Grok; gateways in
    front of Gemini): ``completion_tokens_details.reasoning_tokens``, when the total is exactly
    prompt + completion + those (OpenAI counts them inside: its total is prompt + completion).
    Only the reasoning tokens: a total's other surplus (Gemini's grounding tool-use prompt,
    a gateway's cache writes) is input, not output. 0 when they are inside, or not said."""
    details = raw.get("completion_tokens_details")
    if not isinstance(details, Mapping):
        return 0
    reasoning = _count(details, "reasoning_tokens")
    total = _count(raw, "total_tokens")
    # (exactly: a total with another surplus as well, a gateway's cache writes, says nothing)
    return reasoning if reasoning and prompt + completion + reasoning == total else 0


def _is_empty(usage: Usage) -> bool:
    return not (usage.prompt or usage.completion or usage.cache_read or usage.cache_write)


class UsageTracker:
    """The usage of a stream, whether the provider reports once at the end or on every chunk.

    The answer is the last report with any non-zero count, never a sum: providers that report on
    every chunk send running totals (or zeros until the end), so a later all-zero report must not
    erase earlier numbers. When every report was all-zero, the first one is the answer; with no
    report at all, None.
    """

    def __init__(self) -> None:
        self._last: Usage | None = None
        self._zero: Usage | None = None

    def update(self, raw: Mapping[str, Any] | None) -> None:
        """Take one chunk's ``usage`` object (None and empty objects are ignored)."""
        usage = normalize_usage(raw)
        if usage is None:
            return
        if not _is_empty(usage):
            self._last = usage
        elif self._zero is None:
            self._zero = usage

    def result(self) -> Usage | None:
        """The usage to report for the stream so far."""
        return self._last if self._last is not None else self._zero
