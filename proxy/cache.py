"""Per-session prompt-cache accounting: expected hits, waste, its cause, and cost (pure).

Each finished exchange is fed to ``account`` with its normalized ``Usage``, the request's
``Fingerprint``, its ``Divergence`` from the session's previous request, and the time it started.

Rule: everything the previous request sent should now be a cache read, so
``expected = min(previous prompt tokens, this prompt tokens)`` and
``waste = expected - cache_read`` when that exceeds the noise floor (partial misses count as much as
full ones; below the floor they are block-granularity noise). When the prefix was rewritten,
what the previous request sent that this one no longer holds (a trimmed start, the turns a
rewind abandons: ``dropped``, estimated) comes off the previous prompt: this request could not
read it. What it still holds, edited or behind the rewrite, is reported as waste with its cause
and location, which is what a user must see.

Not counted (expected 0, waste 0, cause None): the first exchange of a session; every exchange
while the provider has never reported a cache field in this session (a 0 from a provider that never
reports means nothing; the flag is sticky once it has); the exchange right after a compaction (an
expected, bought miss).

Cause of a waste, in this order of precedence:

1. ``ttl_expired`` — the idle time since the last request sharing the longest common prefix
   *started* (a provider keeps an entry from when it processed the prefix) exceeds the model's TTL.
   First, because the cache would have missed anyway, rewrite or not.
2. ``params_changed`` — the divergence is in ``params`` (model or a cache-relevant parameter).
3. ``prefix_rewrite`` — the divergence is in ``system``, ``tools`` or a message; the location says
   where (``system``, ``tools``, ``messages[12].content``).
4. ``ttl_expired`` again, where the provider documents a range rather than one TTL (OpenAI: 5 to
   10 minutes) and the idle time is within it: the likeliest cause when there is no other.
5. ``unexplained`` — none of these: provider eviction or routing.

Before all of them, ``not_requested``: the provider caches only the prefixes a request marks
(Anthropic's ``cache_control``), and this request marked none.

The dataclasses here are values, never mutated once built (``dataclasses.replace`` makes a changed
copy). They are not declared frozen because a frozen dataclass costs ~1 µs more to build, and a few
are built for every exchange.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import islice, repeat
from types import MappingProxyType
from typing import Any, Final, Literal

from proxy.config import gateway_alias
from proxy.prefix import Divergence, Fingerprint, shared_links
from proxy.usage import Usage

logger = logging.getLogger(__name__)

Cause = Literal["ttl_expired", "prefix_rewrite", "params_changed", "unexplained", "not_requested"]

# How long a provider keeps an idle prompt-cache entry, in seconds; a model's ``cache_ttl_s`` in the
# config overrides it. OpenAI: in-memory cache, evicted after 5–10 minutes of inactivity (up to an
# hour off-peak). Anthropic: 5 minutes by default (the 1-hour option must be configured). DeepSeek:
# a disk cache cleared "usually within a few hours to a few days" of disuse; one hour is the
# conservative bound. Unknown providers get the shortest, so a long idle is not blamed on others.
DEFAULT_CACHE_TTL_S: Final[Mapping[str, float]] = MappingProxyType(
    {"openai": 600.0, "anthropic": 300.0, "deepseek": 3600.0, "*": 300.0}
)
# Where a provider documents a range, its shortest: OpenAI's cache "generally" keeps an idle
# prefix 5 to 10 minutes. A miss past it with no other cause is named ``ttl_expired``; the
# default TTL above (the longest) still decides when the idle time comes first, before a rewrite.
CACHE_TTL_FLOOR_S: Final[Mapping[str, float]] = MappingProxyType({"openai": 300.0})
DEFAULT_NOISE_FLOOR_TOKENS: Final = 1024
# Prefix digests kept per session with their last start time: a 400-message conversation needs
# ~400, the rest covers forks, sub-agents and retries. The oldest are evicted first.
DEFAULT_MAX_PREFIXES: Final = 4096
_MODEL_PROVIDERS: Final = (
    ("claude", "anthropic"),
    # Bedrock's DeepSeek (``deepseek.r1-v1:0``, ``us.deepseek.r1-v1:0``): Bedrock's rules, not
    # DeepSeek's (whose cache keeps a prefix for hours)
    ("deepseek.", "*"),
    ("deepseek", "deepseek"),
    # OpenAI's open-weight models, which OpenAI does not serve: their host's rules (Groq's
    # flex at its on-demand prices, its cache's life)
    ("gpt-oss", "*"),
    ("gpt-", "openai"),
    ("chatgpt", "openai"),
    ("codex-mini", "openai"),
    ("computer-use", "openai"),
    ("o1", "openai"),
    ("o3", "openai"),
    ("o4", "openai"),
)


def provider_of(model: str) -> str:
    """The provider of a model name: ``openai``, ``anthropic``, ``deepseek``, else ``*``. A
    name that holds ``claude`` as a word is Claude's, however a gateway spelled it around
    (Databricks' ``databricks-claude-sonnet-4``, SAP AI Core's ``anthropic--claude-4-sonnet``).
    DeepSeek's open weights served by others are not DeepSeek's: its distills (Qwen and Llama
    models, ``deepseek-r1-distill-…``) and a name under its Hugging Face organization
    (``deepseek-ai/DeepSeek-V3`` on vLLM or Together), whose hosts' caches have their own rules."""
    lowered = model.lower()
    name = gateway_alias(lowered)
    found = next((p for prefix, p in _MODEL_PROVIDERS if name.startswith(prefix)), "*")
    if found == "*" and _CLAUDE_WORD.search(name) is not None:
        return "anthropic"
    if found == "deepseek" and ("distill" in name or "deepseek-ai/" in lowered):
        return "*"
    return found


_CLAUDE_WORD: Final = re.compile(r"(?:^|[-_./:])claude(?:[-_.@:]|$)")
# (the words of Mistral's model families: mistral, mixtral, codestral, devstral, magistral,
# ministral, pixtral, voxtral)
MISTRAL_NAME: Final = re.compile(
    r"mistral|mixtral|codestral|devstral|magistral|ministral|pixtral|voxtral"
)
GEMINI_WORD: Final = re.compile(r"(?:^|[-_./:])gemini(?:[-_.@:]|$)")


def named_elsewhere(model: str) -> bool:
    """Whether ``model``'s name is a Gemini or a Mistral model's (``gemini`` a word in it, a
    word of Mistral's families): a configured ``dialect`` does not make it another provider's."""
    lowered = model.lower()
    return GEMINI_WORD.search(lowered) is not None or MISTRAL_NAME.search(lowered) is not None


def caching_provider(model: str, dialect: str = "openai") -> str:
    """Whose caching rules ``model`` follows: its name's provider (``provider_of``), else, for a
    name those rules do not know, its configured entry's ``dialect`` where that names one (a
    DeepSeek or Claude model under a name of the user's; a ``"*"`` entry's dialect does not
    turn a Claude model into DeepSeek's, nor a Gemini or a Mistral model into either)."""
    provider = provider_of(model)
    if provider == "*" and dialect in ("anthropic", "deepseek") and not named_elsewhere(model):
        return dialect
    return provider


def default_cache_ttl(model: str, dialect: str = "openai") -> float:
    """The documented default cache TTL for ``model``'s provider, in seconds."""
    provider = caching_provider(model, dialect)
    return DEFAULT_CACHE_TTL_S.get(provider, DEFAULT_CACHE_TTL_S["*"])


def cache_ttl_floor(model: str, ttl_s: float, dialect: str = "openai") -> float:
    """The shortest idle time after which ``model``'s provider may have let a prefix go, given
    ``ttl_s``, the TTL accounting uses: the low end of the provider's documented range when
    ``ttl_s`` is that range's high end, its default (OpenAI: 300 s of 600); else ``ttl_s``
    itself (a TTL set in the config, a 24 h retention, a Claude breakpoint's: one figure)."""
    provider = caching_provider(model, dialect)
    floor = CACHE_TTL_FLOOR_S.get(provider)
    if floor is None or ttl_s != DEFAULT_CACHE_TTL_S.get(provider):
        return ttl_s
    return min(floor, ttl_s)


# --- cost -------------------------------------------------------------------------------------


@dataclass(slots=True)
class ModelPricing:
    """Prices in USD per 1M tokens. A ``price_cache_write`` of 0 means writes cost plain input."""

    price_input: float = 0.0
    price_cached_input: float = 0.0
    price_cache_write: float = 0.0
    price_output: float = 0.0
    # an audio model's audio tokens (``Usage.audio_in``, ``audio_out``); 0: priced as text
    price_audio_input: float = 0.0
    price_audio_output: float = 0.0


@dataclass(slots=True)
class Cost:
    """What an exchange cost (``actual``) and would have cost with no cache (``uncached``), USD."""

    actual: float = 0.0
    uncached: float = 0.0

    @property
    def saved(self) -> float:
        """What the cache saved; negative when cache writes cost more than they saved yet."""
        return self.uncached - self.actual

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.actual + other.actual, self.uncached + other.uncached)


FLEX_FACTOR: Final = 0.5  # OpenAI's "flex" tier: the Batch API's prices, half the standard ones
DEFAULT_PRIORITY_FACTOR: Final = 2.0  # its "priority" tier where a model's ratio is not known


def tier_factor(tier: str | None, priority_factor: float = 0.0) -> float:
    """What the processing tier an answer was billed at (its ``service_tier``) costs, as a
    multiple of the model's standard prices: ``flex`` half, ``priority`` the model's
    ``priority_factor`` (else ``DEFAULT_PRIORITY_FACTOR``), any other (``default``, ``auto``,
    ``scale``: reserved capacity, paid apart) the standard prices."""
    if tier == "flex":
        return FLEX_FACTOR
    if tier == "priority":
        return priority_factor or DEFAULT_PRIORITY_FACTOR
    return 1.0


# What a prompt past a model's ``long_context_tokens`` costs over its prices: Anthropic's and
# OpenAI's long-context rates alike (Sonnet 4.5: $6 / $22.50 a million for $3 / $15; GPT-5.4
# "2x input and 1.5x output for the full session"), cache reads and writes as input
LONG_CONTEXT_INPUT_FACTOR: Final = 2.0
LONG_CONTEXT_OUTPUT_FACTOR: Final = 1.5


def long_context(pricing: ModelPricing) -> ModelPricing:
    """``pricing`` at a model's long-context rates (``LONG_CONTEXT_*_FACTOR``)."""
    factor = LONG_CONTEXT_INPUT_FACTOR
    return ModelPricing(
        pricing.price_input * factor,
        pricing.price_cached_input * factor,
        pricing.price_cache_write * factor,
        pricing.price_output * LONG_CONTEXT_OUTPUT_FACTOR,
        pricing.price_audio_input * factor,
        pricing.price_audio_output * LONG_CONTEXT_OUTPUT_FACTOR,
    )


def tiered(pricing: ModelPricing, factor: float) -> ModelPricing:
    """``pricing`` at ``factor`` times its prices (``tier_factor``)."""
    if factor == 1.0:
        return pricing
    return ModelPricing(
        pricing.price_input * factor,
        pricing.price_cached_input * factor,
        pricing.price_cache_write * factor,
        pricing.price_output * factor,
        pricing.price_audio_input * factor,
        pricing.price_audio_output * factor,
    )


def compute_cost(usage: Usage, pricing: ModelPricing) -> Cost:
    """Price one exchange.

    ``actual = (prompt - cache_read - cache_write) × input + cache_read × cached_input
    + cache_write × cache_write_price + completion × output`` (a read or write price of 0 is the
    input price), where the
    writes for an hour (``cache_write_1h``, Anthropic's) cost twice the input price;
    ``uncached = prompt × input + completion × output``. An audio model's audio tokens
    (``audio_in`` of the fresh input, ``audio_out`` of the output) cost its audio prices in
    both, where it has them (else they are priced as text).

    ``usage.prompt`` is the whole input in every dialect (``proxy.usage`` normalizes it): OpenAI's
    ``prompt_tokens`` already includes ``cached_tokens`` (no writes are reported); DeepSeek's is
    hit + miss (``prompt_cache_hit_tokens`` is the read); Anthropic-style ``input_tokens`` counts
    only the uncached rest, so ``prompt = input_tokens + cache_read_input_tokens +
    cache_creation_input_tokens`` and ``cache_write = cache_creation_input_tokens``.
    """
    fresh = max(usage.prompt - usage.cache_read - usage.cache_write, 0)
    # A price of 0 for reads or writes is one not given: those tokens cost the input price (a
    # model priced by its input and output alone made every cached token free).
    read_price = pricing.price_cached_input or pricing.price_input
    write_price = pricing.price_cache_write or pricing.price_input
    hour = usage.cache_write_1h  # (Anthropic's one-hour writes: twice the input price)
    actual = (
        fresh * pricing.price_input
        + usage.cache_read * read_price
        + (usage.cache_write - hour) * write_price
        + hour * 2 * pricing.price_input
        + usage.completion * pricing.price_output
    )
    uncached = usage.prompt * pricing.price_input + usage.completion * pricing.price_output
    if usage.audio_in or usage.audio_out:
        # (audio input read from the cache is not told apart: it is counted as fresh input,
        # up to the fresh part, at the audio price over the text one)
        heard = min(usage.audio_in, fresh) if pricing.price_audio_input else 0
        said = usage.audio_out if pricing.price_audio_output else 0
        audio = heard * (pricing.price_audio_input - pricing.price_input) + said * (
            pricing.price_audio_output - pricing.price_output
        )
        actual += audio
        uncached += (
            (usage.audio_in * (pricing.price_audio_input - pricing.price_input))
            if pricing.price_audio_input
            else 0.0
        ) + said * (pricing.price_audio_output - pricing.price_output)
    return Cost(actual / 1_000_000, uncached / 1_000_000)


def waste_cost(usage: Usage, pricing: ModelPricing, tokens: int, after: int = 0) -> float:
    """What ``tokens`` of this exchange's input that should have been read from the cache cost
    over a read, USD, ``after`` tokens past the part it read (a waste's cause comes first, a
    ``not_requested`` rest after it). The unread input lies as Claude bills it: what was written
    for an hour (its breakpoints come first), then for five minutes, then the fresh rest; each
    token costs its own price less the read price. 0 for a model with no prices."""
    unread = usage.prompt - usage.cache_read
    if tokens <= 0 or unread <= 0:
        return 0.0
    hour = min(usage.cache_write_1h, unread)
    five = min(usage.cache_write - usage.cache_write_1h, unread - hour)
    read_price = pricing.price_cached_input or pricing.price_input
    layers = (
        (hour, 2 * pricing.price_input),
        (five, pricing.price_cache_write or pricing.price_input),
        (unread - hour - five, pricing.price_input),
    )
    total = 0.0
    at = 0
    for count, price in layers:
        overlap = min(after + tokens, at + count) - max(after, at)
        if overlap > 0:
            total += overlap * (price - read_price)
        at += count
    return max(0.0, total) / 1_000_000


# --- accounting -------------------------------------------------------------------------------


@dataclass(slots=True)
class CacheState:
    """What a session remembers between exchanges for cache accounting.

    ``prefixes`` maps each chain digest of recent requests to the time the last request containing
    that prefix started; ordered oldest first and bounded, so it can judge any TTL as long as its
    entries survive. ``compacted`` says the next exchange follows a compaction. Serializable with
    ``to_dict``/``from_dict`` (JSON-safe) for a shared store.
    """

    prev_prompt: int | None = None
    has_reported: bool = False
    prefixes: Mapping[bytes, float] = dataclasses.field(default_factory=dict)
    params_digest: bytes | None = None
    model: str | None = None
    last_started: float | None = None
    compacted: bool = False
    # an answer of the session read or wrote the cache (a read of 0 is no use: ``used``)
    used: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (digests as hex)."""
        return {
            "prev_prompt": self.prev_prompt,
            "has_reported": self.has_reported,
            "prefixes": [[digest.hex(), started] for digest, started in self.prefixes.items()],
            "params_digest": self.params_digest.hex() if self.params_digest is not None else None,
            "model": self.model,
            "last_started": self.last_started,
            "compacted": self.compacted,
            "used": self.used,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheState:
        """The state ``to_dict`` produced; raises ``ValueError`` on a malformed dict."""
        try:
            params_digest = data.get("params_digest")
            prev_prompt = data.get("prev_prompt")
            last_started = data.get("last_started")
            return cls(
                prev_prompt=int(prev_prompt) if prev_prompt is not None else None,
                has_reported=bool(data.get("has_reported", False)),
                prefixes={
                    bytes.fromhex(digest): float(started)
                    for digest, started in data.get("prefixes", ())
                },
                params_digest=bytes.fromhex(params_digest) if params_digest is not None else None,
                model=data.get("model"),
                last_started=float(last_started) if last_started is not None else None,
                compacted=bool(data.get("compacted", False)),
                used=bool(data.get("used", False)),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed cache state: {exc}") from exc


@dataclass(slots=True)
class CacheResult:
    """One exchange's cache figures: tokens that should have been read (``expected``), were read and
    written, the shortfall counted as ``waste``, its ``cause`` and, for a rewrite, its ``location``;
    ``unrequested``: where only marked prefixes are cached, the part of a shortfall with another
    cause that lay past what the previous turn had cached (``not_requested``, counted apart:
    ``waste + unrequested`` is the whole shortfall). ``expired``: where an earlier breakpoint
    kept its prefix longer than the last one (tools and system for an hour, the latest message
    for five minutes) and the idle time lay between the two, the part of the shortfall past the
    longer-lived prefix, which had expired (``ttl_expired``, counted apart: the ``waste`` is
    then what was lost of the prefix still cached, with its own cause).
    """

    expected: int
    read: int
    write: int
    waste: int
    cause: Cause | None = None
    location: str | None = None
    unrequested: int = 0
    expired: int = 0


def mark_compacted(state: CacheState) -> CacheState:
    """``state`` with the next exchange marked as following a compaction (not counted)."""
    return dataclasses.replace(state, compacted=True)


def account(
    state: CacheState,
    *,
    usage: Usage,
    fingerprint: Fingerprint,
    divergence: Divergence | None,
    started_at: float,
    ttl_s: float,
    noise_floor: int,
    model: str,
    after_compaction: bool = False,
    max_prefixes: int = DEFAULT_MAX_PREFIXES,
    unmarked: Callable[[], bool] | None = None,
    min_cached: int = 0,
    dropped: int = 0,
    cached_before: int | None = None,
    ttl_floor_s: float | None = None,
    compared: Fingerprint | None = None,
    before: Callable[[], int] | None = None,
    nothing_marked_before: Callable[[], bool] | None = None,
    longer_lived: Callable[[], tuple[float, int] | None] | None = None,
    held_expired: bool = False,
    since: float | None = None,
    in_flight: Callable[[], CacheState] | None = None,
) -> tuple[CacheState, CacheResult]:
    """Account one finished exchange; return the session's new state and the exchange's figures.

    ``divergence`` is ``find_divergence`` against the session's previous request (None when this
    one extends it); ``started_at`` is when this request was forwarded; ``ttl_s`` the model's cache
    TTL. An exchange with no usage (``prompt == 0``, e.g. interrupted) keeps the previous prompt
    count as the baseline for the next one. ``unmarked``, asked only of a waste: whether the
    provider caches only marked prefixes and the request marked none (the waste is then
    ``not_requested``). A prefix shorter than ``min_cached`` (the model's minimum) was no more
    to be read than nothing. ``dropped``: tokens the previous request sent that this one no
    longer holds, off the expected read (given for a rewritten prefix). ``cached_before``: where
    the provider caches only marked prefixes, what it read or wrote for the previous request,
    the most this one could have read: a miss with a cause (a rewrite, an expiry) is charged to
    it up to that, the part past the previous request's last mark, which was never cached,
    counted apart as ``unrequested``; a miss of that part alone is ``not_requested``. (0: the
    previous request cached nothing, marked or not, which tells no extent: its marks may not
    have reached the provider.) ``ttl_floor_s`` (``cache_ttl_floor``; None: ``ttl_s``): past
    it, a miss with no other cause is ``ttl_expired``, not ``unexplained``. ``compared``: the
    fingerprint of the request this one is compared with; after a rewrite, the idle time is
    that of its system prompt or history past the difference (``_attribute``), which another
    conversation of the session sharing only the parameters and tools does not keep warm.
    ``before``, asked only of a rewrite's waste where the provider caches every prefix and
    read nothing: the previous request's tokens before the point of difference (estimated, a
    lower bound). Nothing read of an unchanged prefix of at least ``LOST_BEFORE_AT_LEAST``
    tokens means the provider had lost it before the rewrite (evicted, or expired): the rewrite
    is not what the provider missed first, and the miss gets the cause of a prefix lost
    unchanged (``ttl_expired`` past the TTL floor, else ``unexplained``); the rewrite is still
    the request's logged divergence. (A read that stopped at the system prompt another
    conversation kept warm is no sign cachegate can read: where an edit lies in tokens is an
    estimate, off by half on dense or sparse text, and reads near it were taken for losses.) ``nothing_marked_before``, asked of a miss where the previous
    request cached nothing (``cached_before`` 0): whether it marked nothing for a provider that
    caches only marked prefixes, so that nothing could be read (``not_requested``).
    ``longer_lived``, asked only of a miss past ``ttl_s``: where the previous request's earlier
    breakpoint asked for a longer life than its last, that life and the tokens of the prefix it
    covers (``CacheResult.expired``). ``held_expired``: ``cached_before`` is what an earlier
    turn cached, which had expired since (the turns after it marked nothing): what was missed
    of it is the expiry's. ``since``: when the request this one is compared with started, the
    idle time's start where the prefixes' stamps are of requests that started after this one
    (a sibling fanned out beside it, answered first: the idle time read negative, an expiry
    ``unexplained``). ``in_flight``, asked only of a waste: ``state`` with the prefixes of the
    session's requests still in flight that went to the provider before this one stamped as
    used then, the state the idle times are read from (it is not kept: each of those requests
    is stamped when it is accounted itself).
    """
    has_reported = state.has_reported or usage.reported_cache
    counted = (
        state.prev_prompt is not None
        and has_reported
        and not after_compaction
        and not state.compacted
    )
    unrequested = expired = 0
    if counted and state.prev_prompt is not None:
        expected = max(0, min(state.prev_prompt - dropped, usage.prompt))
        if expected < min_cached:
            expected = 0
        shortfall = expected - usage.cache_read
        waste = shortfall if shortfall > noise_floor else 0
        cause: Cause | None
        # (the stamps idle times are read from: only a waste has a cause to find)
        seen = in_flight() if waste and in_flight is not None else state
        alive = (
            _longer_lived(
                seen, fingerprint, divergence, compared, started_at, ttl_s, longer_lived, since
            )
            if waste and longer_lived is not None and divergence is not None
            else None
        )
        if not waste:
            cause, location = None, None
        elif unmarked is not None and unmarked():  # nothing was asked of the cache
            cause, location = "not_requested", None
        elif alive is not None and min(expected, alive[1]) - usage.cache_read > noise_floor:
            # Past the last breakpoint's life, within an earlier one's: what was lost of the
            # prefix still cached has its own cause (a rewrite of the system prompt an hour's
            # breakpoint kept), the rest had expired (it was all the expiry's).
            held = min(expected, alive[1])
            top = max(held, min(expected, cached_before)) if cached_before else expected
            if expected - top <= noise_floor:
                top = expected
            waste = held - usage.cache_read
            expired = max(0, top - held)
            unrequested = expected - top
            cause, location = _attribute(
                seen,
                fingerprint,
                divergence,
                started_at,
                alive[0],
                model,
                alive[0],
                compared,
                since,
            )
            if cause == "ttl_expired" or location == "params.model":
                # (all of it the expiry's after all, or the other model's, whose cache never
                # held the prefix, expired or not: one figure; a switch between two Claude
                # models after a pause charged the expiry again on the way back)
                waste, expired = waste + expired, 0
        else:
            cause, location = _attribute(
                seen,
                fingerprint,
                divergence,
                started_at,
                ttl_s,
                model,
                ttl_floor_s,
                compared,
                since,
            )
            if (
                cause == "prefix_rewrite"
                and before is not None
                and usage.cache_read < LOST_READ
                and before() >= max(noise_floor, LOST_BEFORE_AT_LEAST)
            ):
                idle = idle_seconds(seen, fingerprint, started_at, since)
                floor = ttl_s if ttl_floor_s is None else ttl_floor_s
                # (``expired`` is a count of tokens, the hour breakpoint's split above: not this)
                lapsed = idle is not None and idle > floor
                cause, location = ("ttl_expired" if lapsed else "unexplained"), None
            if held_expired and cause != "not_requested":
                cause, location = "ttl_expired", None  # (it would have missed anyway)
            if cached_before == 0 and nothing_marked_before is not None and nothing_marked_before():
                cause, location = "not_requested", None  # the turn before marked nothing
            elif cached_before and expected - cached_before > noise_floor:
                within = cached_before - usage.cache_read
                if within > noise_floor:  # the cause's part; the rest was never cached
                    unrequested, waste = waste - within, within
                else:  # all it missed lies past the previous request's last mark
                    cause, location = "not_requested", None
        result = CacheResult(
            expected,
            usage.cache_read,
            usage.cache_write,
            waste,
            cause,
            location,
            unrequested,
            expired,
        )
    else:
        result = CacheResult(0, usage.cache_read, usage.cache_write, 0)

    prefixes, last_started = _stamped(state, fingerprint, started_at, max_prefixes)
    new_state = CacheState(  # positional, in field order: prev_prompt, has_reported, prefixes, …
        usage.prompt if usage.prompt > 0 else state.prev_prompt,
        has_reported,
        prefixes,
        fingerprint.params_digest,
        model,
        last_started,
        False,
        state.used or bool(usage.cache_read or usage.cache_write),
    )
    return new_state, result


def _longer_lived(
    state: CacheState,
    fingerprint: Fingerprint,
    divergence: Divergence | None,
    compared: Fingerprint | None,
    started_at: float,
    ttl_s: float,
    longer_lived: Callable[[], tuple[float, int] | None],
    since: float | None = None,
) -> tuple[float, int] | None:
    """The longer life and the tokens it covers (``account``'s ``longer_lived``) when the idle
    time of the compared request's whole prefix, the part past the longer-lived one (no other
    conversation keeps it warm, where a sub-agent under the same prompt keeps the system prompt
    so), lies past ``ttl_s`` and within that life; else None."""
    idle = (
        idle_seconds(state, compared, started_at, since)
        if compared is not None
        else _lost_idle(state, fingerprint, divergence, compared, started_at, since)
    )
    if idle is None or idle <= ttl_s:
        return None
    alive = longer_lived()
    return alive if alive is not None and idle <= alive[0] else None


def _stamped(
    state: CacheState, fingerprint: Fingerprint, started_at: float, max_prefixes: int
) -> tuple[dict[bytes, float], float]:
    """``state``'s prefixes with ``fingerprint``'s stamped ``started_at``, and its latest start."""
    last = state.last_started
    prefixes = _remember(state.prefixes, fingerprint.digests, started_at, max_prefixes, last)
    return prefixes, started_at if last is None or started_at > last else last


def touch(
    state: CacheState,
    fingerprint: Fingerprint,
    started_at: float,
    max_prefixes: int = DEFAULT_MAX_PREFIXES,
) -> CacheState:
    """``state`` once a request the provider received but that reported no usage (the client
    hung up mid-answer, the stream broke off) has refreshed its prefixes: the provider read
    its prompt, and the cache entry's life runs from that request's start. Nothing else
    changes: with no usage, it is no baseline for the next request's count."""
    prefixes, last_started = _stamped(state, fingerprint, started_at, max_prefixes)
    return dataclasses.replace(state, prefixes=prefixes, last_started=last_started)


def stamped_in_flight(state: CacheState, stamps: Iterable[tuple[Fingerprint, float]]) -> CacheState:
    """``state`` with each fingerprint's prefixes stamped at its time where that is later (the
    requests still in flight, for ``account``'s ``in_flight``): one copy of the map, none
    evicted, as it is not kept."""
    prefixes = dict(state.prefixes)
    last = state.last_started
    get = prefixes.get
    for fingerprint, started_at in stamps:
        for digest in fingerprint.digests:
            if get(digest, started_at) <= started_at:
                prefixes[digest] = started_at
        if last is None or started_at > last:
            last = started_at
    return dataclasses.replace(state, prefixes=prefixes, last_started=last)


def idle_seconds(
    state: CacheState, fingerprint: Fingerprint, started_at: float, since: float | None = None
) -> float | None:
    """Seconds since the last request sharing this request's longest known prefix started.

    Where no prefix of its system prompt or history is known (their stamps pushed out of the
    session's map by another conversation's newer ones), since ``since``, the compared
    request's start, where given: the parameters and tools, or the session's latest start, are
    any conversation's, and measured a paused agent's pause from another agent's turn. Else
    since the session's latest start; None on a fresh session. A prefix stamped by a request that started after this one (requests finish out of
    order: only the latest start is kept) tells nothing of the time before this one: ``since``,
    where given, does.
    """
    prefixes = state.prefixes
    digests = fingerprint.digests
    for at in range(len(digests) - 1, -1, -1):
        last = prefixes.get(digests[at])
        if last is not None:
            if (
                since is not None
                and since <= started_at
                and fingerprint.chain[at][0] in _NOT_CONTENT_LINKS
            ):
                break  # (the parameters and tools alone: any agent of the session's, not its)
            return _idle(started_at, last, since)
    if since is not None and since <= started_at:
        return started_at - since
    return started_at - state.last_started if state.last_started is not None else None


def _idle(started_at: float, last: float, since: float | None) -> float:
    """The idle time before ``started_at`` from a prefix's stamp ``last`` (``idle_seconds``)."""
    if last > started_at and since is not None and since <= started_at:
        return started_at - since
    return started_at - last


# Links of a request's chain before its system prompt and history (``Fingerprint.chain``).
_NOT_CONTENT_LINKS: Final = frozenset({"params", "tools"})


def _lost_idle(
    state: CacheState,
    fingerprint: Fingerprint,
    divergence: Divergence | None,
    compared: Fingerprint | None,
    started_at: float,
    since: float | None = None,
) -> float | None:
    """How long what a miss lost had been idle. After a rewrite, the compared request's prefix
    past the point of difference: it had expired if no request that shared its system prompt
    or history past that point (the shortest such prefix is the most recently used) came
    within the TTL. The parameters and tools alone, which another agent of the session may
    keep warm under a prompt of its own, are not what was lost; a sub-agent forked from the
    history keeps the history warm (the loss is then the rewrite's). Else the request's longest
    known prefix's (``idle_seconds``)."""
    if divergence is not None and compared is not None:
        chain = compared.chain
        at = shared_links(compared, fingerprint)
        while at < len(chain) and chain[at][0] in _NOT_CONTENT_LINKS:
            at += 1
        last = state.prefixes.get(compared.digests[at]) if at < len(chain) else None
        idle = (
            _idle(started_at, last, since)
            if last is not None
            else idle_seconds(state, compared, started_at, since)
        )
        if idle is not None:
            return idle
    return idle_seconds(state, fingerprint, started_at, since)


def _attribute(
    state: CacheState,
    fingerprint: Fingerprint,
    divergence: Divergence | None,
    started_at: float,
    ttl_s: float,
    model: str,
    ttl_floor_s: float | None = None,
    compared: Fingerprint | None = None,
    since: float | None = None,
) -> tuple[Cause, str | None]:
    if (
        divergence is not None
        and divergence.location == "params"
        and divergence.field == "model"
        and gateway_alias(divergence.old_excerpt) != gateway_alias(divergence.new_excerpt)
    ):
        # (another model's cache never held it, idle or not: a side call on a small model after
        # a pause was charged the main agent's expiry, which its next turn was charged again;
        # a gateway's spelling of the same model, ``openai/gpt-4o``, is the same model's)
        return "params_changed", divergence.label
    idle = _lost_idle(state, fingerprint, divergence, compared, started_at, since)
    if idle is not None and idle > ttl_s:
        return "ttl_expired", None
    if divergence is not None:
        cause: Cause = "params_changed" if divergence.location == "params" else "prefix_rewrite"
        return cause, divergence.label
    # No divergence against the previous request, yet the parameters differ from the ones the
    # state last saw (the caller compared with another request): still a parameter change.
    if state.model is not None and state.model != model:
        return "params_changed", "params.model"
    if state.params_digest is not None and state.params_digest != fingerprint.params_digest:
        return "params_changed", "params"
    if idle is not None and ttl_floor_s is not None and idle > ttl_floor_s:
        return "ttl_expired", None  # within the provider's documented range, and nothing else
    return "unexplained", None


# A rewrite's unchanged prefix counts as lost before it when nothing was read (less than the
# smallest prefix such providers cache: OpenAI's 1,024 tokens) of an unchanged prefix this long
# by cachegate's estimate: four times that least read, for an estimate off by half on dense or
# sparse text (a CSV, pretty-printed JSON, a log)
LOST_READ: Final = 1024
LOST_BEFORE_AT_LEAST: Final = 4096

_SHORT_CHAIN: Final = 24  # (~1.2 µs saved at 4 digests; the same cost at ~32)


def _remember(
    prefixes: Mapping[bytes, float],
    chain: tuple[bytes, ...],
    started_at: float,
    max_prefixes: int,
    latest: float | None = None,
) -> dict[bytes, float]:
    """``prefixes`` with every digest of ``chain`` stamped ``started_at``, oldest evicted first.

    ``latest`` is the newest time already in ``prefixes``: when ``started_at`` is not older, every
    chain digest simply takes ``started_at`` and the work is done by dict operations in C.
    """
    if (latest is None and not prefixes) or (latest is not None and started_at >= latest):
        out = dict(prefixes)
        # The chain's digests taken out and put back at the end, so insertion order stays time
        # order; each step a loop in C (~45 us for 400 digests in a map of 4,096, where a set
        # of them, their intersection and a loop of deletes in Python took ~120). A short
        # chain's (a one-shot request's few) in a loop here: the C loops' set-up costs more.
        if len(chain) <= _SHORT_CHAIN:
            pop = out.pop
            for digest in chain:
                pop(digest, None)
        else:
            deque(map(out.pop, chain, repeat(None)), maxlen=0)
        out.update(dict.fromkeys(chain, started_at))
    else:
        # Requests finish out of order; a prefix's time only moves forward. The map is copied
        # in C and only the chain's digests are moved, not every other digest filtered in a
        # loop here (one exchange in ten at concurrency 32 finishes after a later one started).
        out = dict(prefixes)
        pop = out.pop
        for digest in chain:
            started = pop(digest, started_at)
            out[digest] = started if started > started_at else started_at
    if len(out) > max_prefixes:
        # Insertion order is time order; for an over-long chain this keeps its longest prefixes.
        # The oldest are deleted in place: a full map of a long session (thousands of digests,
        # a few new per exchange) is not rebuilt every exchange.
        for digest in list(islice(out, len(out) - max_prefixes)):
            del out[digest]
    return out
