"""Observers wired by the app: cache accounting and cost, and the session event log.

Both run after the client has its response (``on_response``) or when a request is forwarded
(``on_request``), and neither can break the relay (``proxy.pipeline.notify`` swallows their errors).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import itertools
import logging
import math
import operator
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, NamedTuple

from proxy import __version__, cache, compaction, prefix, resview
from proxy.cache import CacheState, ModelPricing
from proxy.config import Settings, display_url, priority_factor
from proxy.errors import CLIENT_CLOSED
from proxy.eventlog import Delta, EventLogWriter, choose_delta
from proxy.metrics import Metrics
from proxy.pipeline import Exchange, clip_words
from proxy.redact import (
    SCHEMED_KEY_HEADERS,
    credential_keys,
    known_secrets,
    query_keys,
    redact_text,
    without_values,
)
from proxy.relay import CLIENT_KEY_HEADERS, GATEWAY_KEY_HEADERS
from proxy.sessions import CONVERSATIONS_KEPT, SessionState, SessionStore
from proxy.usage import Usage, added, less

_MAX_MODEL_TERMS = 256
_MAX_IN_FLIGHT = 64  # of those, the latest whose prefixes another's idle time may be read from
_MAX_UNANSWERED = 4096  # a session's requests forwarded and not yet accounted, kept by start
_UNPRICED_SAID = 64  # model names said on stderr to have no prices, at most
_NAME_KEPT = 256  # a longer model name (a client's: up to its body's size) is not kept
# The shortest prefix Claude caches (Sonnet, Opus 4 and 4.1; a model's ``cache_min_tokens`` may
# say more): a marked prefix shorter than this is not cached, and nothing is read or written.
CLAUDE_MIN_CACHED: Final = 1024
log = logging.getLogger(__name__)


def _state_of(ex: Exchange, sessions: SessionStore) -> SessionState | None:
    """The exchange's session state: the one it was served with (kept even if the store has
    forgotten the session since), else the store's, for an exchange made without one."""
    if ex.session is not None:
        return ex.session
    return sessions.get(ex.session_id) if ex.session_id is not None else None


# Top-level request keys the request line gives fields of their own (not ``params``).
_NOT_PARAMS: Final = frozenset({"messages", "tools", "model", "stream"})
# ...of a Responses API request, whose ``input`` items are logged as a chat request's messages
# are (an ``input`` that is one string stays among its parameters)
_NOT_RESPONSES_PARAMS: Final = frozenset({"input", "tools", "model", "stream"})
_NOT_PARAMS_BUT: Final = frozenset({"tools", "model", "stream"})


def _text_bytes(messages: list[Any]) -> int:
    """About the bytes ``messages`` hold: their strings, and those of their content parts and
    tool calls (two levels down: a text part's text, an image's URL, a call's arguments)."""
    total = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        for value in message.values():
            if type(value) is str:
                total += len(value)
            elif type(value) is list:
                for part in value:
                    if type(part) is dict:
                        for inner in part.values():
                            if type(inner) is str:
                                total += len(inner)
                            elif type(inner) is dict:
                                total += sum(len(v) for v in inner.values() if type(v) is str)
    return total


def _unrelated_first_turns(old: _Baseline, fp: prefix.Fingerprint, body: Any) -> bool:
    """``prefix.unrelated_first_turns``, where nothing the provider reads before the system
    prompt is shared: a Claude model reads the tools first, which the same tools keep
    readable (a rewrite's expected read)."""
    if not fp.system_first and fp.tools_digest == old.fp.tools_digest:
        return False
    return prefix.unrelated_first_turns(old.body, body)


def _forwarded_at(ex: Exchange) -> float:
    """When ``ex`` went to the provider, on the wall clock: when it came, and the time it
    waited on the provider before it went out (a compaction's summary call, a first try refused
    as too long). The provider's cache life of its prefixes starts there: a summary call of a
    minute counted as idle time blamed the next turn's rewrite on an expiry."""
    return ex.started_at + ex.upstream_wait_s


class _Baseline:
    """A request a later one of its session may continue: its fingerprint, body, prompt tokens
    (None when unknown) and model; ``copies``: how many requests sent it as it is (a retry, or
    sub-agents fanned out with one task: each of those may go on in its own way); ``ready_at``:
    when the provider had read its prompt (its first byte, on the monotonic clock of
    ``Exchange.t0``), so could serve it from the cache; ``turns``: how many requests of its
    conversation it stands for (a one-shot sub-agent's is 1); ``cached``: where the provider
    caches only marked prefixes (Claude), the tokens it read or wrote for it, the most a next
    request could read (None elsewhere, or unknown); ``held``: a longer prefix an earlier turn
    of its conversation had cached, and when (its tokens, on the wall clock of ``started``,
    as the provider's cache life is timed: the monotonic clock stops while a laptop sleeps), which
    the provider holds until its TTL ends, though this turn marked less, and how many messages it
    held (None: none); ``earlier``: while other requests of its session sent before it was
    accounted were not yet accounted themselves, the request it went on from as that one was
    (``_as_was``), which those sent before it was read are accounted against, and that one's
    own in turn (the request a fan-out went on from, for those sent before both were read;
    None otherwise); ``started``: when it was forwarded."""

    __slots__ = (
        "answer",
        "body",
        "cached",
        "copies",
        "counted",
        "earlier",
        "fp",
        "held",
        "left_behind",
        "model",
        "places",
        "prompt",
        "read",
        "ready_at",
        "reprompted_from",
        "reprompts",
        "resent",
        "started",
        "superseded",
        "turns",
    )

    def __init__(
        self,
        fp: prefix.Fingerprint,
        body: Any,
        prompt: int | None,
        model: str | None,
        ready_at: float,
        started: float,
    ) -> None:
        self.fp, self.body, self.prompt, self.model = fp, body, prompt, model
        # when it was forwarded (``Exchange.started_at``): where the prefixes it shares were
        # stamped since by a request that started after the one compared with it (a sibling
        # fanned out beside it and answered first), the last use known before that one
        self.started = started
        # the request ``prompt`` was counted for: its own, or, interrupted before its usage,
        # the one it continued, whose count it took (what it added is not in that count)
        self.counted = fp
        self.ready_at = ready_at
        self.copies = 1
        self.turns = 1
        self.cached: int | None = None
        # of ``cached``, what it read: an entry the provider held at an earlier breakpoint
        # (``_read_within``)
        self.read: int | None = None
        self.held: tuple[int, float, int] | None = None
        # what its answer said (its text's digest, its tool call ids): a request that carries
        # it on is of its conversation, whatever it changed before it
        self.answer: _Answer | None = None
        # the baseline it branched off under another system prompt (``_takes_place``) and that
        # one's turns then, until it goes on: if its own next turn changes the prompt again and
        # that one has not gone on either, that one is superseded (or, a copy, forgotten)
        self.reprompted_from: tuple[_Baseline, int] | None = None
        # how many baselines kept beside one another under new prompts, each gone no further
        # since, lead to it from one that came otherwise (0: it came otherwise, or went on)
        self.reprompts = 0
        # a stale copy, by the look of it (``reprompted_from``): the first to be forgotten
        self.superseded = False
        # sent more than once, and one of those went on: the others may go on too (sub-agents
        # fanned out with one task), or never (a client's re-send after a hang-up), so it is
        # forgotten after the one-shots and before the conversations that go on
        self.left_behind = False
        # a copy came after the one before was answered (a client's re-send after a hang-up,
        # not sub-agents sent alike, which go out together)
        self.resent = False
        self.earlier: _Baseline | None = None
        # where a repair made its forwarded messages differ from its client's: the client's
        # index of each forwarded one (-1: cachegate's own), for a later request's divergence
        # where one of them vanished (``_in_client_terms``); None otherwise
        self.places: tuple[int, ...] | None = None


# How many requests back a baseline's ``earlier`` goes at most (``_as_was``).
_EARLIER_KEPT: Final = 8


def _as_was(baseline: _Baseline, oldest: float) -> _Baseline:
    """A copy of ``baseline`` as it is now, for requests sent before the one that goes on from
    it was read (``_Baseline.earlier``), with the requests it went on from in turn: a sibling of
    a fan-out may be compared with another answered before it went out, and the first sent,
    answered last, then needs the request the fan-out went on from, two or more back. The
    chain ends at the first request read before the oldest one of the session still
    unanswered went out (``oldest``: none of those still to come needs one before it), and
    ``_EARLIER_KEPT`` back at most (a request unanswered for long, and many turns meanwhile:
    their bodies are not all held)."""
    was = copy.copy(baseline)
    node, depth = was, 1
    while node.earlier is not None:
        if node.ready_at <= oldest or depth >= _EARLIER_KEPT:
            node.earlier = None  # (copies, shared by the chains of one session alone)
            break
        node, depth = node.earlier, depth + 1
    return was


def _has_tools(body: Any) -> bool:
    """Whether a request offers tools (an agent's turn; a title request offers none), or the
    legacy ``functions``."""
    return isinstance(body, dict) and bool(body.get("tools") or body.get("functions"))


def _protected(baseline: _Baseline, extra: dict[str, Any]) -> bool:
    """Whether ``baseline`` is the session's first conversation, or its first with tools where
    the first had none (``_prune``)."""
    return baseline is extra.get("opening") or baseline is extra.get("agent")


def _prune(baselines: list[_Baseline], kept: tuple[_Baseline | None, ...]) -> None:
    """Keep ``CONVERSATIONS_KEPT`` baselines: past them, the least recently seen one-shot
    conversation goes first (a sub-agent or a title request, seen once), but never the session's
    first, nor its first with tools where the first had none (``kept``: the main agent's, which
    may fan out sub-agents from its first turn; a title request or a start-up probe may be
    answered before it), else the least recently seen. A fan-out of one-shot sub-agents
    evicted the main agent's own, whose next turn then read as a new conversation, its miss
    unreported. Before those, the
    least recently seen of those superseded: an early turn of an agent whose system prompt
    changes every turn (or a main agent waiting for its sub-agent). After the one-shots, those
    left behind by a copy that went on (re-sends of a sub-agent's turns filled the 32, and a
    lagging sub-agent's own conversation was forgotten)."""
    while len(baselines) > CONVERSATIONS_KEPT:
        victim = None
        for stale in (
            lambda b: b.superseded,
            # sent again once answered, one gone on: a re-send, which no other goes on from
            lambda b: b.left_behind and b.copies == 1 and b.resent,
            lambda b: b.turns == 1 and not b.left_behind,
            lambda b: b.left_behind,  # (sub-agents sent alike, more of them to go on)
        ):
            victim = next(
                (
                    at
                    for at in range(len(baselines) - 1, 0, -1)
                    if stale(baselines[at]) and not any(baselines[at] is k for k in kept)
                ),
                None,
            )
            if victim is not None:
                break
        del baselines[len(baselines) - 1 if victim is None else victim]


def _dropped_tokens(
    old: prefix.Fingerprint,
    new: prefix.Fingerprint,
    prompt: int,
    held: Iterable[bytes] = (),
    carried: int = 0,
) -> int:
    """Of the previous request's ``prompt`` tokens, those of what ``new`` no longer holds
    (``prefix.dropped_elements``): its share of the previous request's estimate, so that a
    tokenizer denser or sparser than the estimate's 4 bytes a token is the same on both sides.
    A message whose digest is in ``held`` is held (``_repaired_away``: the client sent it, and
    a repair changed it): a sliding window that cut a round of parallel calls keeps their
    results, repaired into user messages (counted as gone, such a trim's waste read about half
    of what it was). ``carried``: as ``prefix.dropped_elements``. Tools that ``new`` no longer
    sends (an MCP server disconnected, or swapped for another; the tools left out for a turn;
    descriptions shortened) are gone, each for the share of it that changed
    (``prefix.dropped_tools``): counted as held, their schemas were charged as waste, ~3,400
    tokens for ten MCP tools, though no request could read them."""
    dropped = prefix.dropped_elements(old, new, compaction.media_part_tokens, held, carried)
    old_tools = compaction.estimate_tokens(old.tools) if old.tools else 0
    tools_gone = 0.0
    if old_tools and old.tools_digest != new.tools_digest:  # (by each tool: one swapped out too)
        tools_gone = sum(
            compaction.estimate_tokens([tool]) * share
            for tool, share in prefix.dropped_tools(old.tools, new.tools)
        )
    if not dropped and not tools_gone:
        return 0
    whole = compaction.estimate_tokens(list(old.messages)) + old_tools
    gone = sum(compaction.estimate_tokens([message]) * share for message, share in dropped)
    return int(prompt * (gone + tools_gone)) // max(whole, 1)


def _carried(compared: prefix.Fingerprint | None, fp: prefix.Fingerprint) -> int:
    """How many leading elements of ``fp`` are those of ``compared``, an interrupted request
    whose prompt count is another's, where ``fp`` carries all its messages on (its system
    prompt, tools or parameters may differ: the time in the prompt): the provider read them, so
    what ``compared`` changed of the request it borrowed the count from is held as changed (an
    edited message for what it kept), and a message sent again after them is not held (a paste
    a rewind dropped, pasted again after the interruption: it cannot be read there); 0
    otherwise."""
    if compared is None:
        return 0
    theirs = compared.element_digests[3:]  # (its messages: past params, tools and system)
    if fp.element_digests[3 : 3 + len(theirs)] != theirs:
        return 0
    return len(compared.element_digests)


def _repaired_away(ex: Exchange) -> list[bytes]:
    """Digests of the client's messages that its repaired request sends changed (a result
    kept as a user message, moved back to its call, given its call's id), not those a repair
    took out (an orphan ``dropped``, an empty assistant message removed)."""
    client, sent = ex.client_body, ex.body
    if not ex.repairs or ex.compacted or not isinstance(client, dict) or not isinstance(sent, dict):
        return []
    ours, theirs = sent.get("messages"), client.get("messages")
    if not isinstance(ours, list) or not isinstance(theirs, list) or ours is theirs:
        return []
    forwarded = {id(message) for message in ours}
    gone = {
        r.get("index")
        for r in ex.repairs
        if str(r.get("action")).startswith(("dropped", "removed an assistant"))
    }
    return [
        prefix.message_digest(m)
        for i, m in enumerate(theirs)
        if id(m) not in forwarded and i not in gone
    ]


def _tokens_before(
    old: prefix.Fingerprint, new: prefix.Fingerprint, divergence: prefix.Divergence, prompt: int
) -> int:
    """Of the previous request's ``prompt`` tokens, those before the point where the request
    compared with it differs (its tools, the messages before the one that differs and, where
    that one's text content was edited, the text before the edit; nothing for a change of the
    parameters, or of the tools or system block read first; in a chain whose system block
    comes first, that block before the tools): their share of its estimate, as
    ``_dropped_tokens`` counts. Media before the point count nothing (an image's tokens depend
    on its size and the model, 85 to thousands): a lower bound."""
    location = divergence.location
    if location == "tools" and old.system_first:
        at, tools_before = old.system_count, False
    elif location in ("system", "messages") and divergence.index is not None:
        at = divergence.index
        tools_before = location == "messages" or not old.system_first
    else:
        return 0
    messages = list(old.messages)
    tools = compaction.estimate_tokens(old.tools) if old.tools else 0
    whole = max(compaction.estimate_tokens(messages) + tools, 1)
    unchanged = sum(
        compaction.estimate_tokens([message])
        for message in messages[:at]
        if not _has_media(message)
    )
    if location == "tools":
        return int(prompt * unchanged) // whole
    if divergence.field == "content" and at < len(messages) and at < len(new.messages):
        # (a line added at the end of a long system prompt, the date there: what comes before
        # it was the provider's to read, as a whole message before it is)
        was, now = messages[at], new.messages[at]
        text = was.get("content") if isinstance(was, dict) else None
        edited = now.get("content") if isinstance(now, dict) else None
        if isinstance(text, str) and isinstance(edited, str) and text:
            share = prefix.common_prefix_length(text, edited) / len(text)
            unchanged += int(compaction.estimate_tokens([was]) * share)
    return int(prompt * (unchanged + (tools if tools_before else 0))) // whole


def _has_media(message: Any) -> bool:
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") not in (None, "text") for part in content
    )


def _marked_nothing(
    body: Any, extra: dict[str, Any], prompt: int | None = None, least: int = 0
) -> bool:
    """Whether the previous request, ``body``, marked nothing for a provider that caches only
    marked prefixes (and has not been seen caching without marks): its successor could read
    nothing (an agent that turns on prompt caching mid-session, Cline's and Roo's setting); or,
    of its ``prompt`` tokens, marked only a prefix shorter than ``least``, the model's minimum,
    which is not cached (a system prompt marked alone, the request a compaction's summary
    made short)."""
    if extra.get("caches_unmarked"):
        return False
    if not prefix.has_cache_marker(body):
        return True
    share = (  # (an image weighs what the estimate counts for it, not its base64)
        prefix.marked_share(body, compaction.estimate_tokens)
        if isinstance(body, dict) and prompt
        else None
    )
    return share is not None and prompt is not None and share * prompt < least


# Claude looks for an earlier cache entry up to about 20 content blocks before a breakpoint:
# a prefix held further back than this many messages is out of its reach.
CLAUDE_LOOKBACK_BLOCKS: Final = 20


def _held_on(
    baseline: _Baseline, cached: int | None, divergence: prefix.Divergence | None
) -> tuple[int, float, int] | None:
    """What ``baseline``'s conversation cached beyond ``cached``, which the request that takes
    its place cached (Claude: a turn that marked only its system prompt reads and writes that
    alone, and the longer prefix the turn before wrote stays cached until its TTL ends), when,
    and how many messages it held: only for a request that carries it on whole (no
    ``divergence``). (One that had expired when that request went out, and was charged to it
    as its expiry, is let go once it is accounted: a later turn's miss of it is no expiry.)"""
    if divergence is not None or cached is None:
        return None
    held = baseline.held
    if baseline.cached is not None and (held is None or baseline.cached >= held[0]):
        held = (baseline.cached, baseline.started, len(baseline.fp.message_digests))
    return held if held is not None and held[0] > cached else None


def _longer_lived(
    body: dict[str, Any], ttl_s: float, prompt: int, change: prefix.Divergence | None
) -> tuple[float, int] | None:
    """For ``cache.account``: the longer life an earlier breakpoint of the previous request
    (``body``, of ``prompt`` tokens) asked for than ``ttl_s``, and the tokens it covers; None
    when ``change``, where this request differs from it, lies past that breakpoint."""
    # (an image weighs what the estimate counts for it, not its base64)
    found = prefix.longer_lived_share(body, ttl_s, compaction.estimate_tokens, change)
    return None if found is None else (found[0], int(found[1] * prompt))


def _cached_before(baseline: _Baseline, now: float, ttl_s: float, messages: int = 0) -> int | None:
    """The most of its prompt a request of ``messages`` continuing ``baseline`` could read from
    a cache of marked prefixes: what it cached, or a longer prefix its conversation still holds
    (within its TTL, and within Claude's look back from the request's end)."""
    held = baseline.held
    if held is not None and now - held[1] <= ttl_s and messages - held[2] <= CLAUDE_LOOKBACK_BLOCKS:
        return held[0] if baseline.cached is None else max(baseline.cached, held[0])
    return baseline.cached


def _in_reach(baseline: _Baseline, body: dict[str, Any], usage: Usage) -> int | None:
    """Where ``body`` continues ``baseline`` and adds more than Claude's look back (~20 content
    blocks) past its last breakpoint before a breakpoint of its own (an agent that marks only
    its latest message, after a turn of 24 parallel tool calls and their results): the tokens
    of the longest entry it can still read, an earlier breakpoint's (its system prompt's, by
    its share of ``baseline``'s prompt; what the request read, where that is near it: the
    share is an estimate), 0 for none. None where the last entry is within its reach."""
    old = baseline.body
    if not isinstance(old, dict) or not baseline.prompt:
        return None
    share = prefix.lookback_reach(old, body, CLAUDE_LOOKBACK_BLOCKS, compaction.estimate_tokens)
    if share is None:
        return None
    reach = int(share * baseline.prompt)
    if reach and 0.8 * reach <= usage.cache_read <= 1.25 * reach:
        reach = usage.cache_read  # (the entry it read: the estimate is off by a little)
    return reach


def _nothing_in_reach() -> bool:
    """``cache.account``'s ``nothing_marked_before`` for a request that could reach none of
    the entries before it (``_in_reach``): nothing could be read."""
    return True


def _read_within(baseline: _Baseline, body: Any, prompt: int) -> int | None:
    """Where a request of ``prompt`` tokens (``body``) holds only a leading part of the
    messages of ``baseline``, the request it continues, and ``baseline``'s last breakpoint lies
    past them, the most of it a cache of marked prefixes (Claude) could serve: the entry that
    ``baseline`` read, which lay at an earlier request's breakpoint (where that is within this
    prompt), or one ``baseline`` wrote at a breakpoint among the messages they share (its
    system prompt's, say), by its share of this prompt. None where it holds ``baseline``'s
    whole marked prefix (what ``baseline`` cached is then its to read), and where what
    ``baseline`` read is not known or lies past this prompt (the entries within it are not
    known then: the request as it was expected before)."""
    old, new = baseline.body, body
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return None
    messages, held = old.get("messages"), new.get("messages")
    if not (isinstance(messages, list) and isinstance(held, list)) or len(held) >= len(messages):
        return None
    if old.get("cache_control") is not None:
        last = len(messages)  # (automatic caching: its breakpoint at its end)
    else:
        last = next(
            (
                at
                for at in reversed(range(len(messages)))
                if prefix.cache_mark(messages[at], "content") is not None
            ),
            -1,
        )
    if last < len(held):
        return None
    read = baseline.read
    if read is None or read > prompt:
        # (unknown, or the entry it read lies past this prompt: a turn two back sent again,
        # whose own entry the provider may still hold, where it is not known)
        return None
    shared = {"tools": old.get("tools"), "messages": messages[: len(held)]}
    share = prefix.marked_share(shared, compaction.estimate_tokens)
    return max(read, int(share * prompt)) if share else read


def _expired_held(baseline: _Baseline, now: float, ttl_s: float) -> int | None:
    """Where ``baseline`` cached less (its turn marked nothing, or its system prompt alone),
    the longer prefix an earlier turn of its conversation cached, when it had expired since:
    what the expiry took, the rest past it never cached (a pause after unmarked turns, or
    unmarked turns over more than the TTL, charged all of it to the expiry, or as unexplained;
    after turns that marked a system prompt long enough to be cached, all of it was named
    ``not_requested``)."""
    held = baseline.held
    if held is not None and now - held[1] > ttl_s:
        return held[0]
    return None


def _hour_writes(usage: Usage, body: Any, least: int = CLAUDE_MIN_CACHED) -> Usage:
    """``usage`` with the share of its cache writes made for an hour, where its provider gave
    the writes as one total (OpenRouter in front of Claude) and ``body``'s breakpoints ask for
    an hour: all of them when its last one does (Anthropic takes longer lives before shorter
    ones only), else those up to its last hour-long breakpoint, by the share of the prompt it
    covers (``prefix.longer_lived_share``), unless that is under ``least``, the model's
    shortest cached prefix (Claude caches none shorter: the write is the five minutes'). Priced
    at the five-minute rate, a one-hour write cost 37% less than billed."""
    if not isinstance(body, dict) or prefix.last_cache_marker(body) is None:
        return usage
    last = prefix.marked_ttl_s(body) or 300.0  # (a breakpoint that names none: five minutes)
    if last >= 3600:
        hour = usage.cache_write
    else:
        # (weighed as the provider counts: an image by its pixels, not by its base64, which
        # took the hour's share of a screenshot's turn from ~90% to 6%; a document, whose
        # pages are not known, by its bytes)
        longer = prefix.longer_lived_share(body, last, compaction.image_weighed_tokens)
        if longer is None or longer[0] < 3600:
            return usage
        # (the share of the whole prompt: a tail past the last breakpoint, neither read nor
        # written, is in it; over reads and writes alone the hour's share was taken twice)
        covered = round(longer[1] * usage.prompt)
        if covered < least:  # (tools of 300 tokens marked for an hour: not cached so)
            return usage
        hour = min(usage.cache_write, max(0, covered - usage.cache_read))
    return dataclasses.replace(usage, cache_write_1h=hour) if hour else usage


def _to_front(baselines: list[_Baseline], baseline: _Baseline) -> None:
    """``baseline`` the most recently seen of its session's."""
    if baseline is not baselines[0]:
        baselines.remove(baseline)
        baselines.insert(0, baseline)


def _hash_base(baselines: list[_Baseline], body: Any) -> prefix.Fingerprint | None:
    """The fingerprint to reuse digests from: the baseline that shares the longest run of the
    very same message objects (an agent resends its history as the same objects), else the
    latest."""
    if len(baselines) < 2:
        return baselines[0].fp if baselines else None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return baselines[0].fp
    runs = [prefix.leading_run(operator.is_, b.fp.messages, messages) for b in baselines]
    return baselines[runs.index(max(runs))].fp


def _ranked(baselines: list[_Baseline], fp: prefix.Fingerprint, body: Any) -> list[_Baseline]:
    """The baselines by the length of the prefix they share with ``fp``, longest first: a main
    agent's turn is compared with its previous turn, not with a sub-agent's or a title request
    sent in between. Of equals, one that ``fp`` carries on whole comes first (two agents that
    open alike share only the opening with each other's turns: each extends its own), then one
    that holds more of ``fp``'s messages (an agent's edit of its own task keeps its messages
    after it; another agent that opened alike holds the opening alone), then the latest."""
    if len(baselines) < 2:
        return baselines
    shared = [prefix.shared_links(b.fp, fp) for b in baselines]
    rank = _carried_past_params(baselines, fp, body, shared)
    most = max(shared)
    tied = shared.count(most) > 1

    def carried(i: int) -> tuple[bool, int]:
        """Whether ``fp`` carries baseline ``i`` on whole: its links, or, of the closest, its
        messages past a system block that changed (the time in it: every baseline then shares
        the parameters and tools alone, and the latest won, another agent's that opened alike),
        and of those, the most messages first; of the closest carried on in part, the one that
        holds the most of ``fp``'s messages first (an edit of A's task just after B's turn, two
        agents that opened alike, was compared with B's)."""
        old = baselines[i].fp
        if shared[i] == len(old.chain):
            return False, 0
        if shared[i] == most and _leading(fp, old):  # (its messages the first of fp's)
            return False, old.system_count - len(old.message_digests)
        if tied and shared[i] == most:
            return True, -_messages_held(old, fp)
        return True, 0

    order = sorted(  # stable: the latest of equals first; of equal ranks, one that shares
        # links of its chain before one of other parameters (a title request sent beside the
        # first turn, of its prompt and message and tool_choice "none", is no turn's previous)
        range(len(baselines)),
        key=lambda i: (-rank[i], rank[i] != shared[i], *carried(i)),
    )
    return [baselines[i] for i in order]


def _carried_past_params(
    baselines: list[_Baseline], fp: prefix.Fingerprint, body: Any, shared: list[int]
) -> list[int]:
    """``shared``, but for a baseline of the same model whose parameters alone differ that
    ``fp`` carries on whole otherwise, its answer too (the turn before forced a tool: no link of
    its chain is equal), ranked by its whole chain, where no baseline of ``fp``'s parameters is carried on
    whole and none carries more of ``fp``'s messages: an older request of its parameters, one
    a hand-edited system prompt left, came first, and a rewrite made turns before was logged
    against it. (Not a title or a classifier request of other parameters beside the turns: the
    previous turn carries more messages on, or is carried whole; another model's cache is
    another.)"""
    model = (fp.params or {}).get("model")
    others = [
        i
        for i, b in enumerate(baselines)
        if not shared[i]
        and b.fp.params_digest != fp.params_digest
        and (b.fp.params or {}).get("model") == model
    ]
    if not others:
        return shared
    own = [i for i in range(len(baselines)) if i not in others]
    if any(shared[i] == len(baselines[i].fp.chain) for i in own):
        return shared

    def messages_carried(old: prefix.Fingerprint) -> int:
        return prefix.leading_run(
            operator.eq,
            old.message_digests[old.system_count :],
            fp.message_digests[fp.system_count :],
        )

    most = max((messages_carried(baselines[i].fp) for i in own), default=0)
    rank = list(shared)
    for i in others:
        old = baselines[i].fp
        whole = len(old.chain)
        if (
            whole - 3 > most  # (its messages past the system block: more than any own carries)
            and prefix.shared_past_params(old, fp) == whole
            # (a classifier of the whole history beside each turn: its answer is no turn's)
            and _carries_answer(baselines[i], body)
        ):
            rank[i] = whole
    return rank


def _takes_place(
    chosen: _Baseline,
    fp: prefix.Fingerprint,
    divergence: prefix.Divergence | None,
    model: str | None,
) -> bool:
    """Whether a request of ``chosen``'s conversation takes its place rather than branch off: it
    extends it (no divergence); it rewrites what comes before the messages
    (parameters, tools, the time in its system prompt; not another system prompt, which may be
    a sub-agent's given the history) and its messages carry the baseline's on (not only a first
    request's messages again, which may be another agent's that opens alike under its own
    prompt); or it changes a message and keeps the baseline's last one after the change
    (an old tool output trimmed in place). Anything else is a branch, the baseline kept: a fork,
    a retry or a rewind (the undone turns may be another agent's that opened alike and goes on),
    or another agent's conversation that opens alike (its own tools, its own task). A request
    on another model never takes its place: a summary or a sub-agent on a small model given
    the history cannot warm this model's cache, and the agent's next turn is compared with its
    own previous one (a switch of model for good goes on from the first turn on the new one)."""
    if model != chosen.model:
        return False
    if divergence is None:
        # Longer: its next turn. Shorter: a rewind, or another agent that opens alike: kept
        # beside it, so that each one's next turn finds its own. (The same: counted on it.)
        return len(fp.message_digests) > len(chosen.fp.message_digests)
    old = chosen.fp.message_digests
    if divergence.location != "messages" and (
        prefix.prompt_and_tools_differ(chosen.fp, fp) or (chosen.fp.tools and not fp.tools)
    ):
        # Another prompt and other tools at once, or no tools at all: a side request that
        # carries the history on (a summary of it, without the agent's tools, under its own
        # prompt or the agent's), or a turn with the tools switched off. Kept beside it: the
        # agent's next turn finds its own previous one (one that goes on with no tools finds
        # this one).
        return False
    if divergence.location == "system" and not divergence.volatile:
        # Another system prompt (not the time in it) over the baseline's messages: a sub-agent
        # under its own prompt given a copy of the history, whose main agent comes back with
        # its next turn, or a prompt edited by hand, whose next turn carries this one on. Kept
        # beside it: each next turn finds its own whole.
        return False
    if divergence.location != "messages":
        # Its messages carry the baseline's on (the next turn, the time in its system prompt
        # changed). Fewer of them, under a rewritten prompt, is a side request that starts
        # alike (a title), or a rewind with a rewrite: a branch either way, the baseline kept.
        old_messages = old[chosen.fp.system_count :]
        new_messages = fp.message_digests[fp.system_count :]
        kept = len(old_messages)
        if chosen.turns == 1 and len(new_messages) == kept:
            # A first request's messages again, none added, under another prompt: that one
            # sent again (its prompt edited, the time in it), or another agent's first that
            # opens alike (the same task under a prompt of its own: its working directory).
            # Kept beside it: each one's next turn carries its own on whole and finds it.
            return False
        return len(new_messages) >= kept and old_messages == new_messages[:kept]
    after = fp.message_digests[(divergence.index or 0) + 1 :]
    return bool(old) and old[-1] in after


def _messages_held(old: prefix.Fingerprint, new: prefix.Fingerprint) -> int:
    """How many of ``new``'s messages past its system block ``old`` holds, wherever."""
    held = set(old.message_digests[old.system_count :])
    return sum(1 for digest in new.message_digests[new.system_count :] if digest in held)


def _leading(old: prefix.Fingerprint, new: prefix.Fingerprint) -> bool:
    """Whether ``new``'s messages past its system block are the first of ``old``'s."""
    new_messages = new.message_digests[new.system_count :]
    old_messages = old.message_digests[old.system_count :]
    return 0 < len(new_messages) <= len(old_messages) and (
        old_messages[: len(new_messages)] == new_messages
    )


class _Answer(NamedTuple):
    """An answer as ``_carries_answer`` looks for it: its text by length and digest (a text of
    up to 32 MiB, held by every baseline of every session, is not the session's memory
    estimate's, which counts requests), or 0 and b"" for none; its tool call ids."""

    length: int
    digest: bytes
    ids: frozenset[str]

    def said(self, text: str) -> bool:
        """Whether ``text`` is the answer's text."""
        return bool(self.length) and len(text) == self.length and _text_digest(text) == self.digest


# Answers by id whose conversation a stored turn may go on from (``_answered``): a session's
# latest, the oldest let go past them
_ANSWERS_KEPT: Final = 32


def _answered(extra: dict[str, Any], answer: str, fp: prefix.Fingerprint) -> None:
    """Keep that the Responses API answer ``answer`` ended the conversation ``fp`` is the
    fingerprint of (a full turn's, or the one a stored turn went on from)."""
    answered: dict[str, prefix.Fingerprint] = extra.setdefault("answered", {})
    answered.pop(answer, None)
    answered[answer] = fp
    while len(answered) > _ANSWERS_KEPT:
        del answered[next(iter(answered))]


def _text_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _answer_of(ex: Exchange) -> _Answer | None:
    """The answer's text and tool call ids, for ``_carries_answer``: a text of
    ``_ANSWER_TEXT_MIN`` characters or more, ids that look random (OpenAI's ``call_`` and 24
    characters, Mistral's 9, Ollama's ``call_`` and 8; not a name and a counter, as
    ``functions.read:0`` or ``function-call-1``, which another conversation gives too)."""
    message = ex.assembled.message if ex.assembled is not None else None
    if not isinstance(message, dict):
        return None
    content = message.get("content")
    text = content if isinstance(content, str) and len(content) >= _ANSWER_TEXT_MIN else ""
    calls = message.get("tool_calls")
    ids = frozenset(
        call["id"]
        for call in (calls if isinstance(calls, list) else ())
        if isinstance(call, dict) and isinstance(call.get("id"), str) and _random_id(call)
    )
    if not (text or ids):
        return None
    return _Answer(len(text), _text_digest(text) if text else b"", ids)


_ANSWER_TEXT_MIN: Final = 200  # characters: "I'll look into it and report back." is no one's own
_COUNTER = re.compile(r"[._:-]\d{1,3}\Z")


def _random_id(call: dict[str, Any]) -> bool:
    """Whether a tool call's id looks made at random: without a short trailing counter, 6
    characters or more of two kinds (lower case, upper case, digits), not holding the call's
    function name (Kimi's ``functions.s3_list:0`` is a name and a counter, which another
    conversation's first call has too)."""
    rest = _COUNTER.sub("", call["id"])
    function = call.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if len(rest) < 6:
        return False
    if isinstance(name, str) and name:  # the name as a word of the id
        at = rest.find(name)
        while at >= 0:
            end = at + len(name)
            if (at == 0 or rest[at - 1] in "._:-") and (end == len(rest) or rest[end] in "._:-"):
                return False
            at = rest.find(name, at + 1)
    kinds = (
        any(c.islower() for c in rest),
        any(c.isupper() for c in rest),
        any(c.isdigit() for c in rest),
    )
    return sum(kinds) >= 2


_ITEMS_AHEAD: Final = 4


def _carries_answer(baseline: _Baseline, body: Any) -> bool:
    """Whether ``body`` holds ``baseline``'s answer where its next turn would: right after the
    messages it sent (its first message edited at the second turn, where no message is left
    that both share, still carries the first answer on)."""
    answer = baseline.answer
    messages = body.get("messages") if isinstance(body, dict) else None
    if answer is None or not isinstance(messages, list):
        return False
    at = len(baseline.fp.messages)
    # A Responses API request's items: the answer's calls and message after its reasoning items
    for item in messages[at : at + _ITEMS_AHEAD]:
        kind = item.get("type") if isinstance(item, dict) else None
        if not isinstance(kind, str):  # (a chat message)
            continue
        call_id = item.get("call_id")
        if isinstance(call_id, str) and not kind.endswith("_output") and call_id in answer.ids:
            return True
        if kind == "message" and item.get("role") == "assistant" and answer.length:
            parts = item.get("content")
            if any(
                isinstance(part, dict)
                and isinstance(part.get("text"), str)
                and answer.said(part["text"])
                for part in (parts if isinstance(parts, list) else ())
            ):
                return True
    for message in messages[max(0, at - 1) : at + 1]:  # (a system message more or fewer)
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        ids = answer.ids
        content = message.get("content")
        if answer.length and (
            (isinstance(content, str) and answer.said(content))
            or (
                isinstance(content, list)
                and any(
                    isinstance(p, dict)
                    and isinstance(p.get("text"), str)
                    and answer.said(p["text"])
                    for p in content
                )
            )
        ):
            return True
        calls = message.get("tool_calls")
        if (
            ids
            and isinstance(calls, list)
            and any(
                isinstance(c, dict) and isinstance(c.get("id"), str) and c["id"] in ids
                for c in calls
            )
        ):
            return True
    return False


def _continues_stored(ex: Exchange) -> bool:
    """A Responses API request that continues what the provider stores (a
    ``previous_response_id``, a ``conversation``): it sends only its new items, the rest is
    read from what is stored, which cachegate does not see; or a compaction of a conversation
    (``/v1/responses/compact``), no turn of it. No cache is expected of it and it is no turn
    for a later one to be compared with: only its cost is counted."""
    body = ex.body
    return (
        ex.route != "chat"
        and isinstance(body, dict)
        and (
            bool(body.get("previous_response_id"))
            or body.get("conversation") is not None
            or ex.path != "responses"
        )
    )


def _location_label(divergence: prefix.Divergence) -> str:
    return "messages" if divergence.location == "messages" else divergence.location


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string: quoted, with every character that is not printable (C0,
    DEL, C1 controls: a terminal acts on some), the quote and the backslash escaped."""
    out = []
    for c in text:
        if c.isprintable() and c not in '"\\':
            out.append(c)
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
    return '"' + "".join(out) + '"'


class _Terms(NamedTuple):
    """What accounting needs of a model's configured entry: its name, cache TTL and prices,
    whether it caches only marked prefixes (Claude, by its entry's dialect or its name:
    ``anthropic/claude-…`` of OpenRouter, whose usage has no Anthropic fields), and the
    shortest prefix it caches."""

    name: str
    ttl_s: float
    pricing: ModelPricing
    marked_only: bool
    min_cached: int
    ttl_floor_s: float  # (``cache.cache_ttl_floor``)
    # what its priority tier costs (``cache.tier_factor``), or None where the tiers an answer
    # names are not OpenAI's (Groq's "flex" costs what its on-demand does): a model named as
    # OpenAI's, or one whose entry sets its ``priority_factor``
    priority_factor: float | None
    # a prompt past this is billed at its long-context rates (``cache.long_context``); 0: none
    long_context_tokens: int = 0
    # known to cache: a provider whose caching rules cachegate knows (OpenAI, Claude, DeepSeek)
    # or an entry with a cached price or a cache TTL; another's read of 0 says nothing until the
    # session has read or written the cache (OpenRouter, vLLM report one for models that never
    # cache: each turn's whole prompt was an unexplained waste)
    caches: bool = True


def _tier(terms: _Terms, ex: Exchange) -> str | None:
    """The processing tier ``ex``'s answer names, where its model is billed by OpenAI's."""
    if terms.priority_factor is None or ex.assembled is None:
        return None
    return ex.assembled.service_tier


def _billed(terms: _Terms, ex: Exchange) -> ModelPricing:
    """The prices ``ex``'s answer was billed at: its model's, at the processing tier its
    answer names (OpenAI's ``service_tier``: ``flex`` half, ``priority`` more), and at its
    long-context rates for a prompt past them."""
    factor = cache.tier_factor(_tier(terms, ex), terms.priority_factor or 0.0)
    return _at_length(terms, ex.usage, cache.tiered(terms.pricing, factor))


def _long(terms: _Terms, usage: Usage | None) -> bool:
    """Whether a prompt of ``usage`` is past its model's long-context threshold."""
    limit = terms.long_context_tokens
    return bool(limit) and usage is not None and usage.prompt > limit


def _at_length(terms: _Terms, usage: Usage | None, pricing: ModelPricing) -> ModelPricing:
    """``pricing`` at the model's long-context rates where ``usage``'s prompt is past them."""
    return cache.long_context(pricing) if _long(terms, usage) else pricing


def _tier_of(terms: _Terms, ex: Exchange) -> dict[str, Any]:
    """``{"tier": …}`` for a cost priced at a tier other than the standard prices, and
    ``{"long_context": true}`` for one at the long-context rates; else {}."""
    tier = _tier(terms, ex)
    said: dict[str, Any] = {}
    if tier is not None and cache.tier_factor(tier) != 1.0:
        said["tier"] = tier
    if _long(terms, ex.usage):
        said["long_context"] = True
    return said


class AccountingObserver:
    """Prefix diagnosis for every request; cache waste, its cause and cost for every response."""

    def __init__(
        self,
        settings: Settings,
        sessions: SessionStore,
        metrics: Metrics,
        secrets: Iterable[str] = (),
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.metrics = metrics
        # Exact values no excerpt may show a piece of (the operator's key), as the event log's.
        self.secrets = known_secrets(secrets)
        # Per model name: (configured entry's name, cache TTL, pricing); looked up once.
        self._terms: dict[str | None, _Terms] = {}
        # Model names said on stderr to have no prices, once each (the terms above are
        # forgotten when full: a client cycling through names made a line each time)
        self._unpriced_said: set[str] = set()
        self._audio_said: set[str] = set()  # (models whose audio tokens were priced as text)

    def _first_unpriced(self, model_name: str | None, pricing: ModelPricing) -> bool:
        """Whether to say that ``model_name`` has no prices: the first time for each name, for
        the first ``_UNPRICED_SAID`` names; past them one line says there are more."""
        if not model_name or pricing.price_input or pricing.price_output:
            return False
        said = self._unpriced_said
        model_name = model_name[:_NAME_KEPT]  # (a client's: up to its body's size)
        if model_name in said or len(said) > _UNPRICED_SAID:
            return False
        said.add(model_name)
        if len(said) > _UNPRICED_SAID:
            log.info(
                "more than %d models have no prices: not each said here (cachegate sessions cost"
                " names those of a session)",
                _UNPRICED_SAID,
            )
            return False
        return True

    def _shown(self, model_name: str | None, ex: Exchange | None) -> str:
        """A model's name as said on stderr: a client's text, as in the log; its start only,
        redacted before it is clipped (a key cut at the clip would not be known), the event
        loop's work bounded (a name of 100 KB, redacted on the event loop)."""
        shown = redact_text((model_name or "")[:_MODEL_REDACTED])
        own = exchange_keys(ex) if ex is not None else ()
        return clip_words(without_values(shown, (*self.secrets, *own)), _MODEL_SHOWN)

    def _audio_as_text(self, ex: Exchange, usage: Usage, terms: _Terms) -> None:
        """Say once for each model (the first ``_UNPRICED_SAID``) whose answer counted audio
        tokens with no audio prices set: they are priced as text (OpenAI's audio tokens cost 8
        to 16 times as much), not silently."""
        pricing = terms.pricing
        if not (pricing.price_input or pricing.price_output):
            return  # (no prices at all: said so, ``_first_unpriced``)
        if not (usage.audio_in and not pricing.price_audio_input) and not (
            usage.audio_out and not pricing.price_audio_output
        ):
            return
        said = self._audio_said
        model_name = (ex.model or "")[:_NAME_KEPT]
        if model_name in said or len(said) >= _UNPRICED_SAID:
            return
        said.add(model_name)
        shown = self._shown(ex.model, ex)
        log.info(
            "model %r answered with audio tokens (%d in, %d out) and has no audio prices: they"
            " are priced as text; set price_audio_input and price_audio_output in [models.%s]"
            " of the config file",
            shown,
            usage.audio_in,
            usage.audio_out,
            _toml_string(shown if terms.name == "*" else terms.name),
        )

    def _model_terms(self, model_name: str | None, ex: Exchange | None = None) -> _Terms:
        """The accounting terms of ``model_name``'s configured entry (``_Terms``); ``ex``, the
        exchange that named it, whose own keys its note on stderr leaves out."""
        terms = self._terms.get(model_name)
        if terms is None:
            name, model = self.settings.model(model_name)
            ttl = model.cache_ttl_s or cache.default_cache_ttl(model_name or "", model.dialect)
            pricing = ModelPricing(
                model.price_input,
                model.price_cached_input,
                model.price_cache_write,
                model.price_output,
                model.price_audio_input,
                model.price_audio_output,
            )
            if len(self._terms) >= _MAX_MODEL_TERMS:  # model names come from clients: bounded
                self._terms.clear()
            if self._first_unpriced(model_name, pricing):
                shown = self._shown(model_name, ex)
                # the table to add them to: the configured entry the name matched (a new table
                # of its own would start from "*" and lose that entry's window), else its own
                table = shown if name == "*" else name
                log.info(
                    "model %r has no prices (the configured entry %r): its cost counts as $0; "
                    "set price_input and price_output in [models.%s] of the config file",
                    shown,
                    name,
                    _toml_string(table),
                )
            # (a name the rules know keeps its provider's, under a "*" entry's dialect too:
            # gpt-4-turbo is no Claude model there, as the pairing repair reads it)
            marked_only = cache.caching_provider(model_name or "", model.dialect) == "anthropic"
            floor = cache.cache_ttl_floor(model_name or "", ttl, model.dialect)
            openai = cache.provider_of(model_name or "") == "openai" or model.priority_factor > 0
            factor = priority_factor(model_name, model)
            terms = _Terms(
                name,
                ttl,
                pricing,
                marked_only,
                model.cache_min_tokens,
                floor,
                factor if openai else None,
                model.long_context_tokens,
                cache.caching_provider(model_name or "", model.dialect) != "*"
                or model.price_cached_input > 0
                or model.cache_ttl_s > 0,
            )
            if model_name is None or len(model_name) <= _NAME_KEPT:  # (a longer one: each time)
                self._terms[model_name] = terms
        return terms

    def on_request(self, ex: Exchange) -> None:
        """Accounting runs once the client has its answer; before it, the request is counted
        among its session's unanswered ones (``_Baseline.earlier``)."""
        # (a chat request's, or a Responses API request's: no other has a body read)
        if ex.body is not None and ex.session_id is not None and not _continues_stored(ex):
            state = _state_of(ex, self.sessions)
            if state is not None:
                extra = state.extra
                extra["unanswered"] = extra.get("unanswered", 0) + 1
                sent: dict[int, float] | None = extra.get("sent")
                if sent is None or len(sent) >= _MAX_UNANSWERED:
                    sent = extra["sent"] = {}  # (bounded: one never answered is forgotten)
                sent[id(ex)] = ex.t0
                # (its prefixes, for another's idle time: ``_in_flight``)
                flying: dict[int, list[Any]] = extra.setdefault("flying", {})
                flying[id(ex)] = [ex, None, None]  # (and its fingerprint, of that body)
                if len(flying) > _MAX_IN_FLIGHT:
                    del flying[next(iter(flying))]

    def on_response(self, ex: Exchange) -> None:
        if ex.route != "chat":
            if ex.body is not None and ex.session_id is not None and not _continues_stored(ex):
                self._account_responses(ex)  # (a Responses API request of a session)
                return
            if ex.usage is not None and ex.status < 400:  # a Responses API answer's
                self._price_answer(ex)
            if ex.body is not None and ex.session_id is not None and ex.status < 400:
                self._touch_stored(ex)
            return
        if ex.body is None or ex.session_id is None:
            return
        state = _state_of(ex, self.sessions)
        if state is None:
            return
        extra = state.extra
        # Others of the session sent and not yet accounted (answered, their observers still to
        # run, or in flight: one still in a compaction's summary call has not been forwarded):
        # some may have gone out before this one was read, and are accounted against what it
        # went on from (``_Baseline.earlier``).
        unanswered = extra.get("unanswered", 1) - 1
        extra["unanswered"] = max(unanswered, 0)
        fanned = unanswered > 0 or state.requests > 0
        out: dict[int, float] | None = extra.get("sent")
        if out:
            out.pop(id(ex), None)
        flying = extra.get("flying")
        early = flying.pop(id(ex), None) if flying else None  # (fingerprinted for another)
        oldest = min(out.values()) if out else math.inf  # (when the oldest of them went out)
        held = extra.get("cache")
        # (a summary call without cache fields after the session's answers or summary calls
        # had them: a read of 0 in a hit ratio, as sessions list counts it; this exchange's own
        # answer comes after it)
        reported_before = (held is not None and held.has_reported) or "summary_reported" in extra
        body = ex.body
        baselines: list[_Baseline] = extra.get("baselines") or []
        terms = self._model_terms(ex.model, ex)
        if early is not None and early[1] is not None and early[2] is body:
            fp = early[1]
        else:
            fp = self._fingerprint(body, baselines, ex.system_block, ex)
        chosen, continues, divergence = self._compare(_ranked(baselines, fp, body), fp, body)
        compared = chosen.fp if chosen is not None else None  # (before this one takes its place)
        forwarded = divergence  # (where the forwarded histories differ: the tokens before it)
        kept = (chosen, divergence)  # (what the baselines go on from: below)
        if chosen is not None and continues and chosen.ready_at > ex.t0:
            # Sent before ``chosen`` was read (sub-agents fanned out together: ``chosen`` is a
            # sibling answered first): what the provider had read when this went out is the
            # request ``chosen`` went on from, the history they share. Only the first sibling
            # answered was compared with it; the others, whatever they missed of it, showed no
            # waste.
            earlier = chosen.earlier
            while earlier is not None and earlier.ready_at > ex.t0:
                earlier = earlier.earlier  # (the one the fan-out went on from: ``_as_was``)
            if earlier is not None:
                chosen = earlier
                compared = chosen.fp
                divergence = forwarded = prefix.find_divergence(
                    chosen.fp, fp, chosen.body, body, self.secrets
                )
        if (
            divergence is not None
            and ex.compaction_undone is not None
            and chosen is not None
            and _summary_at(chosen.body, divergence.index)
        ):
            # The previous request went with cachegate's summary where this one, whose client
            # changed a message the summary covered, goes without: the change the client made
            # is the one to show (the summary against a message it never sent is cachegate's).
            index, old, new = ex.compaction_undone
            divergence = prefix.message_divergence(index, old, new, self.secrets)
            if kept[0] is chosen:  # (the client's change is the one its baseline goes on by)
                kept = (chosen, divergence)
        shown = divergence  # (where the client's own history has it)
        if divergence is not None:
            # A refused attempt's retry counts it; a compaction's summary in place of the
            # history is cachegate's own (an expected miss, as in the waste), not the agent's.
            if ex.status < 400 and not ex.compaction_made:
                self.metrics.observe_prefix_rewrite(_location_label(divergence))
            shown = _in_client_terms(
                divergence,
                ex,
                compared.message_digests if compared is not None else (),
                chosen if chosen is not None and chosen.fp is compared else None,
                self.secrets,
            )
            ex.divergence = _divergence_dict(shown)
            if compared is not None and compared.messages:
                ex.compared_first = compared.messages[0]
        usage = ex.usage
        name, ttl_s, _, marked_only, min_cached, ttl_floor_s, _, _, caches = terms
        pricing = _billed(terms, ex)  # (at the processing tier the answer was billed at)
        # A provider keeps a prefix as long as the request that wrote it asked: the one this
        # request continues, whose entries it reads (a turn that asks for longer after shorter
        # ones expired is no rewrite, nor one that asks for less a miss of the longer-lived)
        writer = chosen.body if chosen is not None and isinstance(chosen.body, dict) else body
        if marked_only or (usage is not None and usage.explicit_cache):
            # Claude: as its breakpoints ask, "1h" or "5m"
            marked_ttl_s = prefix.marked_ttl_s(writer)
            if marked_ttl_s:
                ttl_s = ttl_floor_s = marked_ttl_s
        elif writer.get("prompt_cache_retention") == "24h":  # OpenAI's extended retention
            ttl_s = ttl_floor_s = max(ttl_s, 86_400.0)
        model = ex.model or name
        # What this request is accounted against (before its baseline is replaced by it).
        base: tuple[int | None, bytes | None, str | None] = (None, None, None)
        cached_before: int | None = None
        body_before: Any = None  # (the baseline takes this request's body below)
        held_before: tuple[int, float, int] | None = None
        held_expired: int | None = None  # what an earlier marked turn cached, expired since
        unreached = False  # no entry it continues was within Claude's look back
        counted_before: prefix.Fingerprint | None = None  # the request base's count is for
        # (on the wall clock, as the provider's cache life runs: ``_Baseline.held``)
        now = _forwarded_at(ex)
        if chosen is not None and continues and chosen.ready_at <= ex.t0:
            # (one the provider had not read yet when this went out, a request fanned out
            # beside it that was answered first, could not have warmed the cache for it)
            base = (chosen.prompt, chosen.fp.params_digest, chosen.model)
            counted_before = chosen.counted
            cached_before = _cached_before(chosen, now, ttl_s, len(fp.message_digests))
            if cached_before is not None:
                expired_held = _expired_held(chosen, now, ttl_s)
                if expired_held is not None and expired_held > cached_before:
                    held_expired = cached_before = expired_held
            body_before, held_before = chosen.body, chosen.held
            if (
                (marked_only or (usage is not None and usage.explicit_cache))
                and divergence is None
                and usage is not None
                and usage.prompt > 0
            ):
                within = _read_within(chosen, body, usage.prompt)
                if within is not None:
                    # It stops short of the one it continues, before that one's last breakpoint
                    # (the main agent's turn after a sub-agent forked from its history one
                    # message on, or a rewind): that entry is past its end, and what it could
                    # read is an entry at a breakpoint within it (all of its prompt was
                    # expected, and the part past the entry it read called unexplained)
                    base = (within, base[1], base[2])
                    if cached_before is not None:
                        cached_before = min(cached_before, within)
            if (  # (asked only of a miss: it reads the history where the last entry is far)
                cached_before
                and usage is not None
                # (a miss as the waste reads it: of the prompt it continues, where that one
                # left a tail past its last entry; one just over the floor was "unexplained")
                and max(cached_before, base[0] or 0) - usage.cache_read
                > self.settings.cache.noise_floor_tokens
                and (marked_only or usage.explicit_cache)
                and divergence is None
                and isinstance(chosen.body, dict)
                and isinstance(body, dict)
            ):
                reach = _in_reach(chosen, body, usage)
                if reach is not None:
                    cached_before = min(cached_before, reach)
                    unreached = reach == 0
        # (the compared request's start, before this one takes its place and its start below)
        compared_started = chosen.started if chosen is not None and continues else None
        ready_at = ex.t0 + (ex.ttfb_s if ex.ttfb_s is not None else ex.duration_s)
        # The baselines go on from the one this request was compared with (``kept``), the
        # accounting above and below from the one it could read (``ref``).
        ref, ref_divergence = chosen, divergence
        chosen, divergence = kept
        mine: _Baseline | None = None  # (the baseline this request is, or is counted on)
        if ex.status < 400:  # a refused request is no baseline: the provider may not have seen it
            cached: int | None
            counted = fp  # (the request its prompt count is for: ``_Baseline.counted``)
            if usage is not None and usage.prompt > 0:
                prompt: int | None = usage.prompt
                # (what it read and wrote: known from Anthropic's fields, or from a write count
                # for a model that caches marked prefixes only, Claude through OpenRouter)
                known = usage.explicit_cache or (marked_only and usage.reported_cache_write)
                cached = usage.cache_read + usage.cache_write if known else None
                # (what it read, where reads are reported: through a gateway that gives no
                # writes too, the entry it read lay at a breakpoint all the same)
                read = usage.cache_read if usage.reported_cache else None
            else:  # interrupted before its usage: the prompt count of what it continued
                prompt = chosen.prompt if continues and chosen is not None else None
                cached = chosen.cached if continues and chosen is not None else None
                read = chosen.read if continues and chosen is not None else None
                if prompt is not None and chosen is not None:
                    counted = chosen.counted
            if (
                continues
                and chosen is not None
                and divergence is None
                and chosen.fp.chain == fp.chain
            ):
                # The very same request again (a retry, a sub-agent fanned out with one task):
                # counted on its baseline, which each of them may carry on in its own way.
                chosen.copies += 1
                chosen.resent = chosen.resent or ex.t0 > chosen.ready_at
                if usage is not None and usage.prompt > 0:  # (else the count it had stays)
                    chosen.prompt, chosen.counted = usage.prompt, chosen.fp
                chosen.cached = cached if cached is not None else chosen.cached
                chosen.read = read if read is not None else chosen.read
                chosen.ready_at = min(chosen.ready_at, ready_at)
                chosen.started = max(chosen.started, _forwarded_at(ex))
                chosen.superseded = chosen.left_behind = False
                _to_front(baselines, chosen)
                mine = chosen
            elif continues and chosen is not None and _takes_place(chosen, fp, divergence, model):
                if chosen.copies > 1:  # one of several that sent it: the others may go on too
                    chosen.copies -= 1
                    chosen.left_behind = True  # (till another goes on from it: ``_prune``)
                    went_on = _Baseline(fp, body, prompt, model, ready_at, _forwarded_at(ex))
                    went_on.counted = counted
                    went_on.answer = _answer_of(ex)
                    went_on.cached, went_on.read = cached, read
                    went_on.held = _held_on(chosen, cached, divergence)
                    went_on.turns = chosen.turns + 1
                    went_on.earlier = _as_was(ref, oldest) if fanned and ref is not None else None
                    baselines.insert(0, went_on)
                    mine = went_on
                else:  # it extends or rewrites its baseline: it takes that one's place
                    chosen.earlier = _as_was(ref, oldest) if fanned and ref is not None else None
                    chosen.fp, chosen.body, chosen.prompt, chosen.model = fp, body, prompt, model
                    chosen.counted = counted
                    chosen.held = _held_on(chosen, cached, divergence)
                    chosen.cached, chosen.read = cached, read
                    chosen.answer = _answer_of(ex)
                    chosen.ready_at = ready_at
                    chosen.started = _forwarded_at(ex)
                    chosen.turns += 1
                    chosen.reprompted_from = None
                    chosen.superseded = chosen.left_behind = False
                    chosen.reprompts = 0
                    _to_front(baselines, chosen)
                    mine = chosen
            else:
                # A new conversation, or a branch: another conversation that opens alike (two
                # agents with the same boilerplate first message), a fork, a rewind. Both are
                # kept: each next turn finds its own. (A branch goes on with its conversation's
                # turns: after a rewind it is the live one, not a one-shot to forget first.)
                started = _Baseline(fp, body, prompt, model, ready_at, _forwarded_at(ex))
                started.counted = counted
                started.answer = _answer_of(ex)
                started.cached, started.read = cached, read
                if continues and chosen is not None:
                    started.earlier = _as_was(ref, oldest) if fanned and ref is not None else None
                    # (the same messages again beside it, under another prompt: another
                    # agent's first request, or that one sent again: a first one too)
                    same = len(fp.message_digests) == len(chosen.fp.message_digests)
                    started.turns = chosen.turns + (0 if same else 1)
                    if (
                        not same
                        and divergence is not None
                        and divergence.location == "system"
                        and not divergence.volatile
                    ):
                        # Its next turn kept beside it under another prompt (``_takes_place``):
                        # a sub-agent given the history, whose main agent comes back to
                        # ``chosen``. When ``chosen`` came so itself and went no further, this
                        # is its next turn under a prompt that changes every turn (the open
                        # files in it): the one before it is no one's to come back to.
                        origin = chosen.reprompted_from
                        if origin is not None:
                            stale, turns = origin
                            # (one that went on since is a main agent back from its sub-agent;
                            # one that did not may be one waiting for it: the first two of such
                            # a run are kept, the first to go past 32 (a main agent may follow a
                            # title request, under its own prompt); the later ones are copies
                            # of an agent whose prompt changes every turn, forgotten at once)
                            if stale.turns == turns:
                                if stale.reprompts >= 2 and not _protected(stale, extra):
                                    if stale in baselines:
                                        baselines.remove(stale)
                                else:
                                    stale.superseded = True
                        chosen.reprompted_from = None
                        started.reprompted_from = (chosen, chosen.turns)
                        started.reprompts = chosen.reprompts + 1
                if not baselines and "opening" not in extra:
                    extra["opening"] = started  # the session's first conversation
                elif (
                    "agent" not in extra
                    and _has_tools(body)
                    and not _has_tools(getattr(extra.get("opening"), "body", None))
                ):
                    # (the first with tools, where the first had none: a title request or a
                    # start-up probe answered before the main agent's first turn)
                    extra["agent"] = started
                baselines.insert(0, started)
                mine = started
            if mine is not None:
                mine.places = _client_places(ex)
            _prune(baselines, (extra.get("opening"), extra.get("agent")))
            extra["baselines"] = baselines
        chosen, divergence = ref, ref_divergence
        if ex.compaction_digest is not None and ex.status < 400:  # (the provider has read it)
            unserved: set[str] | None = extra.get(compaction.UNSERVED)
            if unserved:
                unserved.discard(ex.compaction_digest)
        if usage is None or ex.status >= 400:
            if usage is None and not ex.unread and (ex.status < 400 or ex.status == CLIENT_CLOSED):
                # The provider read this prompt (the client left, or the answer broke off,
                # before any usage): its prefixes' cache life starts again from this request.
                extra["cache"] = cache.touch(
                    extra.get("cache") or CacheState(), fp, _forwarded_at(ex)
                )
            self._price_summary(ex, None, reported_before)
            return
        # For the compaction trigger: the provider's count, and the client history it was of,
        # as compaction was given it (repaired) (its length, first and last message: a turn of
        # another conversation of the session, a sub-agent's or a title request's, is not
        # counted on the numbers of this one).
        client = ex.client_body if isinstance(ex.client_body, dict) else {}
        sent = ex.compaction_input
        if sent is None:
            sent = client.get("messages")
        sent = sent if isinstance(sent, list) and sent else None
        answered_usage = compaction.LastUsage(
            prompt=usage.prompt,
            completion=usage.completion,
            messages=len(sent) if sent else 0,
            head=sent[0] if sent else None,
            tail=sent[-1] if sent else None,
            compaction=ex.compaction_digest,
            tools=prefix.request_tools(client),  # (the legacy ``functions`` too)
            # (the messages themselves only where compaction may read them: a session holds
            # its latest request's anyway, but not kept past it for nothing)
            sent=(sent or ()) if self.settings.compaction.enabled else (),
        )
        # One a conversation, the latest first: a main agent's numbers stay its own while its
        # sub-agents and title requests are answered (with one for the session, the trigger fell
        # back to the estimate, which under-counts code and CSV, and histories went out at 97%
        # of the window, or over it and refused). One this history carries on is replaced.
        # (its first and the last message of one, not all between: the trigger checks those)
        if self.settings.compaction.enabled:
            extra["last_usages"] = [
                answered_usage,
                *itertools.islice(
                    (
                        u
                        for u in extra.get("last_usages", ())
                        if not (sent and compaction.carries_on(sent, u, between=False))
                    ),
                    CONVERSATIONS_KEPT - 1,
                ),
            ]
        after_compaction = ex.compaction_made
        cache_state: CacheState = extra.get("cache") or CacheState()
        if base != (cache_state.prev_prompt, cache_state.params_digest, cache_state.model):
            # Compared with another request than the session's latest (interleaved
            # conversations), or with none (a new conversation: nothing was expected).
            cache_state = dataclasses.replace(
                cache_state, prev_prompt=base[0], params_digest=base[1], model=base[2]
            )
        judged, held_state = usage, cache_state
        unjudged = (
            not caches and not cache_state.used and not (usage.cache_read or usage.cache_write)
        )
        if unjudged:
            # a model not known to cache, whose session has read and written nothing: its read
            # of 0 is no sign that it caches (``_Terms.caches``), nor another model's read of 0
            # before it (a title request to gpt-4o-mini in its session): judged as unreported
            judged = dataclasses.replace(usage, reported_cache=False)
            if cache_state.has_reported:
                held_state = dataclasses.replace(cache_state, has_reported=False)
        new_state, result = cache.account(
            held_state,
            usage=judged,
            fingerprint=fp,
            divergence=shown,
            # After a rewrite, what the previous request sent that this one dropped (a
            # trimmed start, a rewind's abandoned turns) could not be read; so too what an
            # interrupted request dropped of the one whose count it borrowed (a rewind, then
            # Ctrl+C), though this one only carries it on (``_carried``)
            dropped=(
                _dropped_tokens(
                    counted_before,
                    fp,
                    base[0],
                    _repaired_away(ex),
                    _carried(compared, fp) if counted_before is not compared else 0,
                )
                if (divergence is not None or counted_before is not compared)
                and counted_before is not None
                and base[0] is not None
                else 0
            ),
            started_at=_forwarded_at(ex),
            cached_before=(
                cached_before
                if usage.explicit_cache or (marked_only and usage.reported_cache_write)
                else None
            ),
            ttl_floor_s=ttl_floor_s,
            ttl_s=ttl_s,
            held_expired=bool(held_expired)
            and (usage.explicit_cache or (marked_only and usage.reported_cache_write)),
            compared=compared if divergence is not None else None,
            # (the prefixes' stamps may be of a sibling that started after this one: the
            # compared request's start is the last use known before it)
            since=compared_started,
            in_flight=(
                functools.partial(self._in_flight, flying, ex, baselines, cache_state)
                if flying
                else None
            ),
            before=(
                functools.partial(
                    # (the request its count is for: an interrupted one borrows the count of the
                    # one it continued, whose share before the edit is the count's)
                    _tokens_before,
                    counted_before if counted_before is not None else compared,
                    fp,
                    forwarded,
                    base[0],
                )
                if forwarded is not None
                and compared is not None
                and base[0] is not None
                and not marked_only
                # (a write reported: a provider caching only what is marked, whatever its name;
                # a write field alone is no sign of it: OpenRouter gives every model's usage one)
                and not (usage.explicit_cache or (usage.reported_cache_write and usage.cache_write))
                else None
            ),
            longer_lived=(
                functools.partial(_longer_lived, body_before, ttl_s, base[0], divergence)
                if isinstance(body_before, dict)
                and base[0] is not None
                and (marked_only or usage.explicit_cache)
                else None
            ),
            nothing_marked_before=(
                _nothing_in_reach
                if unreached
                else functools.partial(
                    _marked_nothing,
                    body_before,
                    extra,
                    base[0],
                    max(min_cached, CLAUDE_MIN_CACHED),
                )
                if body_before is not None
                and cached_before == 0
                # (no earlier turn's prefix held, or one still within its TTL that Claude's
                # look back did not reach: an expired one is the expiry's)
                and (held_before is None or now - held_before[1] <= ttl_s)
                else None
            ),
            noise_floor=self.settings.cache.noise_floor_tokens,
            min_cached=min_cached,
            model=model,
            after_compaction=after_compaction,
            unmarked=(
                self._unmarked(extra, usage, body, min_cached)
                if usage.explicit_cache or marked_only
                else None
            ),
        )
        ex.cache_known = new_state.has_reported
        if held_state is not cache_state:  # (the session's other answers had the fields)
            new_state = dataclasses.replace(new_state, has_reported=True)
        extra["cache"] = new_state
        ex.cache = {
            "expected": result.expected,
            "read": result.read,
            "write": result.write,
            "waste": result.waste,
            "cause": result.cause,
            "location": result.location,
        }
        if result.waste and result.cause:
            self.metrics.observe_cache_waste(ex.model, result.cause, result.waste)
        if result.unrequested:
            ex.cache["not_requested"] = result.unrequested
            self.metrics.observe_cache_waste(ex.model, "not_requested", result.unrequested)
        if result.expired:
            ex.cache["expired"] = result.expired
            self.metrics.observe_cache_waste(ex.model, "ttl_expired", result.expired)
        if (
            mine is not None
            and mine.held is not None
            and (result.cause == "ttl_expired" or result.expired)
            and now - mine.held[1] > ttl_s
        ):
            mine.held = None  # (its expiry is charged here: a later turn's miss of it is not)
        if marked_only and usage.cache_write and not usage.write_lives_known:
            # (OpenRouter gives Claude's writes as one total)
            usage = _hour_writes(usage, body, max(min_cached, CLAUDE_MIN_CACHED))
        cost = cache.compute_cost(usage, pricing)
        if usage.audio_in or usage.audio_out:
            self._audio_as_text(ex, usage, terms)
        # What the shortfall cost over reading it (the tokens above, in dollars; none said for
        # a model with no prices: unknown, not $0)
        if pricing.price_input:
            if result.waste:
                ex.cache["waste_usd"] = round(cache.waste_cost(usage, pricing, result.waste), 10)
            if result.expired:
                ex.cache["expired_usd"] = round(
                    cache.waste_cost(usage, pricing, result.expired, after=result.waste), 10
                )
            if result.unrequested:
                ex.cache["not_requested_usd"] = round(
                    cache.waste_cost(
                        usage, pricing, result.unrequested, after=result.waste + result.expired
                    ),
                    10,
                )
        self.metrics.observe_cost(ex.model, cost.actual, cost.uncached)
        self._price_summary(ex, cost, reported_before)

    @staticmethod
    def _unmarked(
        extra: dict[str, Any], usage: Usage, body: Any, min_cached: int = 0
    ) -> Callable[[], bool] | None:
        """For a provider that reports Anthropic's cache fields (Claude, which caches only marked
        prefixes): whether this request asked nothing of the cache, looked at when the answer is
        a waste (its cause is then ``not_requested``), or marked only a prefix it read whole, or
        one under the model's minimum. Once an unmarked request of the session has read or
        written the cache, the provider (or a gateway marking for the client: LiteLLM, Bifrost)
        caches without marks, and its misses get their usual causes."""
        if extra.get("caches_unmarked"):
            return None
        if usage.cache_read or usage.cache_write:
            if not prefix.has_cache_marker(body):
                extra["caches_unmarked"] = True
                return None
            if (usage.explicit_cache or usage.reported_cache_write) and not usage.cache_write:
                # Marked, and all that was marked was read (a marked prefix the cache lacked is
                # written): what was not read lies past the last mark, which asked nothing of
                # the cache (an agent that marks only its system prompt).
                return lambda: True
            return None
        if usage.explicit_cache or usage.reported_cache_write:
            # Nothing read, nothing written: what it marked, if anything, is shorter than the
            # model's minimum, which Claude does not cache (a longer one the provider would
            # have written: its marks did not reach it, a gateway's doing, say).
            least = max(min_cached, CLAUDE_MIN_CACHED)

            def too_short() -> bool:
                share = prefix.marked_share(body, compaction.estimate_tokens)
                return share is None or share * usage.prompt < least

            return too_short
        return lambda: not prefix.has_cache_marker(body)

    def _price_summary(
        self, ex: Exchange, cost: cache.Cost | None, reported_before: bool = False
    ) -> None:
        """``ex.cost``: the exchange's ``cost`` plus, when a compaction's summary call reported
        its usage, that call's, at its model's prices. Its tokens and cost count in the metrics
        under its model (its cache read known where it reported one, or where the session's
        answers or summary calls had reported theirs before it: ``reported_before``)."""
        actual, uncached = (cost.actual, cost.uncached) if cost is not None else (0.0, 0.0)
        summary = ex.summary_usage
        if summary is not None:
            if summary.reported_cache and ex.session is not None:  # (its session's, as list's)
                ex.session.extra["summary_reported"] = True
            terms = self._model_terms(ex.summary_model)
            calls = ex.summary_calls
            if not calls:  # (the summed usage alone: as one call, its metered part apart)
                then = ex.summary_metered
                rest = less(summary, then) if then is not None else summary
                calls = [(u, m) for u, m in ((rest, False), (then, True)) if u is not None]
            # Each call at its own prompt's rates (two calls under a long-context threshold
            # were priced as one prompt past it); the metrics count those not counted when
            # their summary was done
            extra = cache.Cost(0.0, 0.0)
            once: cache.Cost | None = None
            counted: Usage | None = None
            for usage, metered in calls:
                priced = cache.compute_cost(usage, _at_length(terms, usage, terms.pricing))
                extra = extra + priced
                if not metered:
                    once = priced if once is None else once + priced
                    counted = added(counted, usage)
            if counted is not None and once is not None:
                self.metrics.observe_usage(ex.summary_model, counted, reported_before)
                self.metrics.observe_cost(ex.summary_model, once.actual, once.uncached)
            ex.summary_cost = {"actual": extra.actual, "uncached": extra.uncached}
            actual += extra.actual
            uncached += extra.uncached
        elif cost is None:
            return
        ex.cost = {"actual": actual, "uncached": uncached}
        if cost is not None:
            ex.cost.update(_tier_of(self._model_terms(ex.model, ex), ex))

    def _touch_stored(self, ex: Exchange) -> None:
        """A Responses API request that continues a stored response (``previous_response_id``,
        ``conversation``), answered: no turn to compare, but the provider read its instructions
        and tools, and the stored conversation after them where those are the full turn's,
        whose cache life starts again there. Counted from the full turn before it, the idle
        time made the next full turn's rewrite (the time in its instructions, a tool or an item
        edited) read as ``ttl_expired`` where the provider had read the prefix 14 s before."""
        if ex.path != "responses" or not isinstance(ex.body, dict):
            return  # (a compaction, /v1/responses/compact: no turn of the conversation)
        state = _state_of(ex, self.sessions)
        held: CacheState | None = state.extra.get("cache") if state is not None else None
        if state is None or held is None:  # (nothing to refresh: nothing read before)
            return
        view, offset = resview.chat_shaped(ex.body, state.extra.get("instructions_message"))
        fp = prefix.fingerprint(view, None, system_first=True, system_block=offset)
        at = _forwarded_at(ex)
        held = cache.touch(held, fp, at)
        previous = ex.body.get("previous_response_id")
        answered: dict[str, prefix.Fingerprint] = state.extra.get("answered") or {}
        went_on = answered.get(previous) if isinstance(previous, str) else None
        # The full turn it goes on from, where it sends the same parameters and the same
        # instructions but for the time in them (a client that puts the time in every request):
        # the provider read that turn's instructions up to the time (and its tools, where the
        # same), which the next full turn reads too (counted from the full turn, its rewrite of
        # the time read as an expiry)
        base = next(  # (the latest full turn of these parameters)
            (
                b
                for b in state.extra.get("baselines") or ()
                if b.fp.params_digest == fp.params_digest
            ),
            None,
        )
        if (
            went_on is not None
            and went_on.system_digest == fp.system_digest
            and went_on.tools_digest == fp.tools_digest
            and went_on.system_block == fp.system_block
        ):
            # The full turn whose answer (or a stored turn's after it) it goes on from, with
            # the same instructions and tools: its conversation read whole again with them
            # (counted from the full turn, a later full turn's edit of a tool or an item read
            # as an expiry, its cause hidden); and this one's answer goes on from it too
            held = cache.touch(held, went_on, at)
            answer = ex.assembled.id if ex.assembled is not None else None
            if answer:
                _answered(state.extra, answer, went_on)
        elif (
            base is not None
            and offset
            and base.fp.system_block
            and base.fp.system_digest != fp.system_digest
            and isinstance(base.body, dict)
            and prefix.volatile_kind(
                compaction.message_text(base.body["messages"][0]),
                compaction.message_text(view["messages"][0]),
            )
            is not None
        ):
            # (its instructions, read before the tools; its tools too where the same)
            old = base.fp
            read = 3 if old.tools_digest == fp.tools_digest else 2
            held = cache.touch(held, dataclasses.replace(old, digests=old.digests[:read]), at)
        state.extra["cache"] = held

    def _fingerprint(
        self, body: Any, baselines: list[_Baseline], system_block: int | None, ex: Exchange
    ) -> prefix.Fingerprint:
        """``body``'s fingerprint, digests reused from the baseline it shares most with: a
        Responses API request's instructions (``system_block``) read before its tools, a chat
        request's system block too, but Claude's, which renders the tools first."""
        terms = self._model_terms(ex.model, ex)
        return prefix.fingerprint(
            body,
            _hash_base(baselines, body),
            system_first=system_block is not None or not terms.marked_only,
            system_block=system_block,
        )

    def _in_flight(
        self,
        flying: dict[int, list[Any]],
        ex: Exchange,
        baselines: list[_Baseline],
        state: CacheState,
    ) -> CacheState:
        """``state`` with the prefixes of the session's requests still in flight that went
        to the provider before ``ex`` (their answers begun: it took them) stamped as used then,
        for ``ex``'s idle time: a sub-agent's or a side request's stream over the history kept
        that warm while it ran, and ``ex``'s rewrite was called an expiry, its stamps written
        only once it was answered. Not kept: each is stamped when it is accounted itself.
        Asked only of a waste (``cache.account``): others' bodies are fingerprinted for it."""
        went = _forwarded_at(ex)
        stamps: list[tuple[prefix.Fingerprint, float]] = []
        for held in list(flying.values()):
            other, fp, of = held
            if other is ex or not 200 <= other.status < 400 or not isinstance(other.body, dict):
                continue
            at = _forwarded_at(other)
            if at >= went:
                continue
            if fp is None or of is not other.body:  # (once a body: a retry's is another)
                held[2] = other.body
                if other.route == "chat":
                    fp = self._fingerprint(other.body, baselines, other.system_block, other)
                else:  # a Responses API request: its chat-shaped view, as it is accounted
                    view, offset = resview.chat_shaped(other.body)
                    fp = self._fingerprint(view, baselines, offset, other)
                held[1] = fp
            stamps.append((fp, at))
        return cache.stamped_in_flight(state, stamps) if stamps else state

    def _account_responses(self, ex: Exchange) -> None:
        """A Responses API exchange of a session, accounted as a chat exchange is, on its
        request's chat-shaped view (``resview``): expected reads, waste, cause and where its
        prefix changed, said back in its own terms (``input[4]``, ``instructions``)."""
        state = _state_of(ex, self.sessions)
        extra = state.extra if state is not None else {}
        body, client, repairs = ex.body, ex.client_body, ex.repairs
        assert body is not None
        view, offset = resview.chat_shaped(body, extra.get("instructions_message"))
        made: list[Any] = extra.setdefault("instructions_made", [])
        if offset:
            held = extra["instructions_message"] = view["messages"][0]
            if not any(m is held for m in made):  # (the views' instructions messages: the
                made.append(held)  # request compared with may have had some, this one none)
                del made[:-8]
        seen = view
        if client is not None and client is not body:
            seen = resview.chat_shaped(client, view["messages"][0] if offset else None)[0]
        ex.route, ex.body, ex.client_body, ex.system_block = "chat", view, seen, offset
        if offset and repairs:  # (their indices are in ``input``: in the view, one further)
            ex.repairs = [
                {**r, "index": r["index"] + offset} if isinstance(r.get("index"), int) else r
                for r in repairs
            ]
        try:
            self.on_response(ex)
        finally:
            ex.route, ex.body, ex.client_body, ex.repairs = "passthrough", body, client, repairs
            ex.system_block = None
        answer = ex.assembled.id if ex.assembled is not None else None
        if answer and ex.status < 400 and state is not None:
            # (its answer's id, by which a stored turn says which conversation it goes on
            # from: ``_touch_stored``)
            turn = next((b for b in extra.get("baselines") or () if b.body is view), None)
            if turn is not None:
                _answered(extra, answer, turn.fp)
        divergence = ex.divergence
        if (
            not offset
            and divergence is not None
            and divergence.get("index") == 0
            and any(m is ex.compared_first for m in made)
        ):
            offset = 1  # (instructions gone: the request compared with had them first)
        if ex.cache is not None and ex.cache.get("location") is not None:
            ex.cache["location"] = resview.responses_location(
                ex.cache["location"],
                offset,
                divergence.get("index") if divergence else None,
                divergence.get("field") if divergence else None,
            )
        if divergence is not None:
            ex.divergence = resview.responses_divergence(divergence, offset)

    def _price_answer(self, ex: Exchange) -> None:
        """A Responses API answer's cost at its model's prices, counted in the metrics and
        kept in ``ex.cost`` (no session accounting: its cache reads are the provider's word,
        nothing is compared with the request before)."""
        assert ex.usage is not None
        terms = self._model_terms(ex.model, ex)
        cost = cache.compute_cost(ex.usage, _billed(terms, ex))
        if ex.usage.audio_in or ex.usage.audio_out:
            self._audio_as_text(ex, ex.usage, terms)
        self.metrics.observe_cost(ex.model, cost.actual, cost.uncached)
        ex.cost = {"actual": cost.actual, "uncached": cost.uncached, **_tier_of(terms, ex)}

    def on_summary_usage(self, ex: Exchange, model: str, usage: Usage) -> None:
        """A compaction's summary that no request was waiting for when it was done (its client
        left): its tokens and cost count in the metrics now, under its model. The request that
        goes out with it later carries it in its log line (``Exchange.summary_metered``)."""
        terms = self._model_terms(model)
        extra = cache.compute_cost(usage, _at_length(terms, usage, terms.pricing))
        self.metrics.observe_usage(model, usage)
        self.metrics.observe_cost(model, extra.actual, extra.uncached)

    def _compare(
        self, ranked: list[_Baseline], fp: prefix.Fingerprint, body: Any
    ) -> tuple[_Baseline | None, bool, prefix.Divergence | None]:
        """The baseline this request is compared with, whether it continues that baseline's
        conversation, and its first difference from it. The closest baseline unless the request
        differs from it and is not of its conversation; then the closest one of its own
        conversation; failing that, the request starts another (nothing rewritten)."""
        if not ranked:
            return None, False, None
        top = ranked[0]
        divergence = prefix.find_divergence(top.fp, fp, top.body, body, self.secrets)
        if divergence is not None and divergence.location == "messages":
            # It differs inside the messages from the closest: if it carries another request
            # of the session on whole, it is that one's next turn (two agents that opened
            # alike, their first answers alike too), not an edit of the closest. Where it keeps
            # the closest's last message after the change, an edit in place of the closest's
            # history (an old tool output cleared, as ``_takes_place`` reads it), which carries
            # on whole an older request of that history the session sent again (its first
            # turn, as a warm-up or a replay), only if that one was sent alike by several of
            # which another went on (sub-agents fanned out alike, whose parallel calls ended
            # on the same output), or if it carries that one's answer next
            last = top.fp.message_digests[-1:]
            in_place = bool(last) and last[0] in fp.message_digests[(divergence.index or 0) + 1 :]
            for other in ranked[1:]:
                if prefix.shared_links(other.fp, fp) == len(other.fp.chain) and (
                    not in_place or other.left_behind or _carries_answer(other, body)
                ):
                    return other, True, None
            if not _carries_answer(top, body):
                # ...or carries it on whole but for the time in the system prompt, its answer
                # next (sub-agents fanned out under one session, the time in their prompt: a
                # sibling's turn of the same minute was the closest, and each one's own
                # rewrite went unseen)
                for other in ranked[1:]:
                    if (
                        _leading(fp, other.fp)
                        and _carries_answer(other, body)
                        and prefix.retimed_system(other.body, body)
                    ):
                        found = prefix.find_divergence(other.fp, fp, other.body, body, self.secrets)
                        return other, True, found
        if (
            divergence is not None
            and divergence.location == "messages"
            and not divergence.volatile
            and not prefix.same_opening(top.fp, fp)
        ):
            # It opens otherwise than the closest: one that opens as it does and holds more of
            # its messages is of its own conversation, where the closest may share only a
            # message anyone says (two agents under one session and one prompt, the time in
            # it, that both answered "ok": the second one's turn was blamed on its own task,
            # the first one's). (A history trimmed at its start shares most with the closest:
            # a one-shot request that opened as it now does is no better.)
            held = _messages_held(top.fp, fp)
            for other in ranked[1:]:
                if (
                    prefix.same_opening(other.fp, fp)
                    and _messages_held(other.fp, fp) > held
                    and prefix.same_conversation(other.fp, fp)
                ):
                    found = prefix.find_divergence(other.fp, fp, other.body, body, self.secrets)
                    return other, True, found
        if (
            divergence is None
            # (a volatile token in a message: the only message of a first turn, dated; one in
            # the system prompt says nothing of the messages: another agent's under the same
            # prompt, the time in it, shares none of them, where a first turn sent again has
            # the same ones, maybe with the time in them too)
            or (divergence.volatile and divergence.location == "messages")
            # (the time in the system prompt, the messages a leading run of the compared
            # request's: a first answer regenerated, or a new chat that opens alike, which the
            # provider could have served but for the time: a rewrite, not another conversation)
            or (
                divergence.volatile
                and divergence.location == "system"
                and _leading(top.fp, fp)
                and prefix.retimed_system(top.body, body)
            )
            or (
                prefix.same_conversation(top.fp, fp)
                # (two first turns alike under prompts that share next to nothing: a
                # sub-agent handed the user's request word for word, not a rewrite of it)
                and not _unrelated_first_turns(top, fp, body)
            )
            or (divergence.volatile and prefix.retimed_messages(top.body, body))
        ):
            return top, True, divergence
        for other in ranked[1:]:
            if prefix.same_conversation(other.fp, fp) and not _unrelated_first_turns(
                other, fp, body
            ):
                found = prefix.find_divergence(other.fp, fp, other.body, body, self.secrets)
                return other, True, found
        # None shares a message: one whose answer it carries on, if only one's (a generic
        # answer two sub-agents gave alike names neither)
        answered = [b for b in ranked if _carries_answer(b, body)]
        if len(answered) == 1:
            other = answered[0]
            if other is top:
                return top, True, divergence
            found = prefix.find_divergence(other.fp, fp, other.body, body, self.secrets)
            return other, True, found
        return top, False, None

    def on_compaction(self, ex: Exchange, comp: Any, source: str) -> None:
        result = {"model": "summary", "extractive": "extractive"}.get(source, "reused")
        self.metrics.observe_compaction(ex.model, result)


def _summary_at(body: Any, index: int | None) -> bool:
    """Whether ``body``'s message at ``index`` is a summary of cachegate's compaction."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if index is None or not isinstance(messages, list) or not 0 <= index < len(messages):
        return False
    message = messages[index]
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, str) and content.startswith(compaction.SUMMARY_MARKER)


# How the text of a message cachegate adds to a repaired history starts (a synthetic result of
# the built-in note, Mistral's note between a result and a user message)
_OWN_TEXT: Final = "[cachegate] "


def _own(message: Any) -> bool:
    """Whether ``message`` is one cachegate added to a repaired history (``_OWN_TEXT``)."""
    content = message.get("content") if isinstance(message, dict) else None
    return isinstance(content, str) and content.startswith(_OWN_TEXT)


def _repaired_lists(ex: Exchange) -> tuple[list[Any], list[Any]] | None:
    """The messages ``ex`` forwarded and its client's, where a repair made them differ (not a
    compacted history: its summary stands for many of the client's); None otherwise."""
    if not ex.repairs or ex.compacted:
        return None
    forwarded = ex.body.get("messages") if isinstance(ex.body, dict) else None
    client = ex.client_body.get("messages") if isinstance(ex.client_body, dict) else None
    if not isinstance(forwarded, list) or not isinstance(client, list) or forwarded is client:
        return None
    return forwarded, client


def _client_places(ex: Exchange) -> tuple[int, ...] | None:
    """For each message ``ex`` forwarded, its index in the client's history (-1: cachegate's
    own, a synthetic result or a note), where a repair moved or added messages; None otherwise,
    and where it sent a changed copy of one (which of the client's it stands for is not told)."""
    lists = _repaired_lists(ex) if ex.route == "chat" else None
    if lists is None:
        return None
    forwarded, client = lists
    position = {id(message): i for i, message in enumerate(client)}
    places = []
    for message in forwarded:
        at = position.get(id(message))
        if at is None:
            # cachegate's own (a synthetic result, Mistral's note), or a copy of a client's
            # message that a repair changed (a call's arguments fixed, an orphan result sent as
            # a user message): which one it stands for is not told here, so none are given
            if not _own(message):
                return None
            at = -1
        places.append(at)
    return tuple(places)


def _in_client_terms(
    divergence: prefix.Divergence,
    ex: Exchange,
    before: Sequence[bytes] = (),
    compared: _Baseline | None = None,
    secrets: tuple[str, ...] = (),
) -> prefix.Divergence:
    """``divergence`` with its message index in the client's history, where a repair made the
    forwarded one differ from it (a synthetic result inserted, an orphan dropped: the repair
    notes of the same row count in the client's): the message at the index if it is one of the
    client's, else the place after the nearest one before it that is. Where messages vanished
    just before a result the repair dropped as an orphan, they vanished before that result if
    the compared request (``before``: its forwarded messages' digests) still sent it, its call
    with it (the trim made it an orphan), else after it (an orphan all along). A compacted
    history keeps the forwarded index (a summary stands for many of the client's messages).
    Where messages vanished from ``compared``, whose own repair had moved or added some
    (``_Baseline.places``), and this request needed none, the place is where its client had
    the first of the client's own that vanished (a message typed while tools ran, moved after
    their results, then deleted: named after the results, or, for Mistral, as cachegate's note
    before it)."""
    index = divergence.index
    if (
        divergence.vanished
        and divergence.location == "messages"
        and index is not None
        and not ex.repairs
        and not ex.compacted
        and compared is not None
        and compared.places is not None
        and isinstance(compared.body, dict)
    ):
        places = compared.places
        old_messages = compared.body.get("messages")
        first = next((k for k in range(index, len(places)) if places[k] >= 0), None)
        if first is not None and isinstance(old_messages, list) and first < len(old_messages):
            if first == index:
                return dataclasses.replace(divergence, index=places[first])
            named = prefix.message_divergence(places[first], old_messages[first], None, secrets)
            return dataclasses.replace(named, vanished=True, volatile=False, volatile_kind=None)
    if divergence.location != "messages" or index is None:
        return divergence
    lists = _repaired_lists(ex)
    if lists is None:
        return divergence
    forwarded, client = lists
    position = {id(message): i for i, message in enumerate(client)}
    if (
        not divergence.vanished
        and index + 1 < len(forwarded)
        and position.get(id(forwarded[index])) is None
        and _own(forwarded[index])
        and forwarded[index].get("role") == "assistant"  # (a note; not a synthetic result)
    ):
        # cachegate's note before a message the client put in (Mistral's, before a message
        # typed while tools ran, which the repair moved after their results): that message
        # is the difference, where the client put it
        after = position.get(id(forwarded[index + 1]))
        if after is not None and prefix.message_digest(forwarded[index + 1]) not in before:
            named = prefix.message_divergence(after, None, forwarded[index + 1], secrets)
            return dataclasses.replace(named, volatile=False, volatile_kind=None)
    at = 0
    start = index
    if divergence.vanished and index < len(forwarded):
        i = position.get(id(forwarded[index]))
        if i:  # (a client message, not the first)
            dropped = client[i - 1]
            if all(m is not dropped for m in forwarded) and (
                prefix.message_digest(dropped) in before[index:]
            ):
                start = index - 1
    for k in range(min(start, len(forwarded) - 1), -1, -1):
        i = position.get(id(forwarded[k]))
        if i is not None:
            at = i if k == index else i + 1
            break
    field = divergence.field
    if (
        field == "content"
        and index < len(forwarded)
        and at < len(client)
        and position.get(id(forwarded[index])) is None
    ):
        # a Responses API output the repair sent as a user message (an orphan): its text is
        # the client's item's ``output`` (a tool search's ``tools``), which it changed
        item = client[at]
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind.endswith("_output"):
            field = "tools" if kind == "tool_search_output" else "output"
    if at == index and field == divergence.field:
        return divergence
    return dataclasses.replace(divergence, index=at, field=field)


def _divergence_dict(d: prefix.Divergence) -> dict[str, Any]:
    return {
        "location": d.location,
        "index": d.index,
        "role": d.role,
        "field": d.field,
        "old": d.old_excerpt,
        "new": d.new_excerpt,
        "volatile": d.volatile,
        "volatile_kind": d.volatile_kind,
    }


class EventLogObserver:
    """Writes the session's JSONL audit log through the background writer (never waits on disk)."""

    def __init__(
        self,
        settings: Settings,
        sessions: SessionStore,
        writer: EventLogWriter,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.writer = writer
        self.clock = clock
        # A client's key headers -> its keys (``_emit_scrubbed``), for the next requests
        self._client_keys: dict[tuple[tuple[bytes, bytes], ...], tuple[str, ...]] = {}

    def _emit(
        self, session_id: str, event: dict[str, Any], first_in_file: bool = False, weight: int = 0
    ) -> bool:
        """Queue ``event``, which starts with ``ts`` and ``type`` (the writer then takes the dict as
        it is, where it would copy one with another key order); False when the writer refused
        it (a full queue, say). ``first_in_file``, ``weight``: see ``EventLogWriter.emit``."""
        return self.writer.emit(session_id, event, first_in_file, weight=weight)

    def _emit_scrubbed(
        self,
        session_id: str,
        event: dict[str, Any],
        ex: Exchange,
        first_in_file: bool = False,
        weight: int = 0,
    ) -> bool:
        """``_emit``, the client's own keys (``client_keys``) never written in the line: an
        upstream's error may quote the key it refused (``Incorrect API key provided: …``), a
        tool's output or the answer may hold it (an agent that ran ``env``)."""
        keys = ex.client_secrets
        if keys is None:
            # (by the key headers' values: the same few clients, request after request; ASGI
            # names are lower case, as ``upstream_request_headers`` reads them too)
            sent = tuple(h for h in ex.upstream_headers if h[0] in _KEY_HEADERS)
            keys = self._client_keys.get(sent)
            if keys is None:
                if len(self._client_keys) >= _CLIENT_KEYS_KEPT:
                    self._client_keys.clear()
                keys = self._client_keys[sent] = client_keys(sent)
            if ex.query:  # (a key in the URL, ?key=…: an upstream's error may quote the URL)
                keys = known_secrets((*keys, *query_keys(ex.query)))
            ex.client_secrets = keys
        if not keys:
            return self._emit(session_id, event, first_in_file, weight)
        return self.writer.emit(session_id, event, first_in_file, keys, weight)

    def _meta(self, ex: Exchange) -> None:
        state = _state_of(ex, self.sessions)
        if state is None or state.meta_written:
            return
        # Marked written only when the writer took it: a meta line refused (a full queue) is
        # tried again with the session's next event. (Its user agent is the client's: a key
        # of its own may be there too.)
        state.meta_written = self._emit_scrubbed(
            state.id,
            {
                "ts": self.clock(),
                "type": "session_meta",
                "session": state.id,
                "created": _iso(state.created),
                "model": ex.model,
                "upstream": display_url(self.settings.upstream.base_url),
                "user_agent": ex.user_agent,
                "version": __version__,
            },
            ex,
            # One meta line per file: not again for an explicit id an earlier process logged
            # (the writer looks at the file, off the event loop).
            first_in_file=True,
        )

    def on_request(self, ex: Exchange) -> None:
        # (a chat request's, or a Responses API request's: no other has a body read)
        if ex.session_id is None or ex.body is None:
            return
        self._meta(ex)
        state = _state_of(ex, self.sessions)
        if self.writer.broken and self.writer.take_broken(ex.session_id) and state is not None:
            # A line of this session never reached its file (a full disk, say): the lines kept
            # as bases may be that one, or coded against it. This line goes in full, and
            # replay recovers from here on.
            state.recent.clear()
            state.extra.pop("logged_tools", None)
            state.extra.pop("logged_instructions", None)
        body = ex.body
        chat = ex.route == "chat"
        sent = body.get("messages" if chat else "input")
        listed = isinstance(sent, list)
        messages: list[Any] = sent if isinstance(sent, list) else []
        not_params = _NOT_PARAMS if chat else _NOT_RESPONSES_PARAMS if listed else _NOT_PARAMS_BUT
        candidates = [
            # exchanges whose request lines were emitted before this one's: an exchange joins
            # the session's recent ones right after its own line (below), so a line is only
            # ever delta-coded against one written before it, in whatever order the requests
            # were forwarded or their observers batched
            (eid, msgs)
            for eid, msgs in (state.recent if state else [])
            if eid != ex.exchange_id
        ]
        delta = choose_delta(candidates, messages) if candidates else Delta(None, 0)
        params = {k: v for k, v in body.items() if k not in not_params}
        base_exchange, base, head = delta.base_exchange, delta.base, delta.head
        event = {
            "ts": self.clock(),
            "type": "request",
            "exchange": ex.exchange_id,
            "model": ex.model,
            "stream": body.get("stream"),  # as sent: null when the body had none (replay)
            "path": "/v1/" + ex.path,
            "params": params,
            "base_exchange": base_exchange,
            "base": base,
        }
        own: list[Any] = []  # the messages the line holds (its weight in the writer's queue)
        if head or delta.replaces:  # its own messages (a system block with the time in it,
            # say, or none: messages dropped) before the base's from ``replaces`` on
            own = event["head"] = messages[delta.kept : head]
            event["replaces"] = delta.replaces
            if delta.kept:
                event["kept"] = delta.kept
        appended = event["appended"] = messages[head + base - delta.replaces :]
        event["repairs"] = ex.repairs
        event["transforms"] = dict(ex.transforms)
        event["bytes"] = ex.request_bytes
        if ex.client_retry:  # the client's own retry of an earlier exchange (its SDK's)
            event["client_retry"] = ex.client_retry
        if not chat and "input" not in body:  # (replayed without one, not as an empty list)
            event["no_input"] = True
        # A Responses API request's instructions (Codex CLI's are ~10 KB, sent every turn), as
        # its tools: written when they differ from those the session's last line had, else
        # named by the number of the line that wrote them.
        instructions = body.get("instructions") if not chat else None
        written_instructions: tuple[int, str] | None = None
        if isinstance(instructions, str):
            held = state.extra.get("logged_instructions") if state else None
            if held is not None and held[1] == instructions and held[0] != ex.exchange_id:
                event["params"] = {k: v for k, v in params.items() if k != "instructions"}
                event["instructions_from"] = held[0]
                written_instructions = held
            else:
                written_instructions = (ex.exchange_id, instructions)
        # The tools, when they differ from those of the session's last line (an agent sends
        # the same tools every turn; a body continued from the last one holds the same object).
        tools = body.get("tools")
        logged: list[tuple[int, Any]] = state.extra.get("logged_tools", []) if state else []
        keep = logged
        if not logged:
            event["tools"] = tools  # a session's first line in this process (null: none)
            keep = [(ex.exchange_id, tools)]
        elif prefix.same_as_sent(tools, logged[0][1]):
            if tools is not logged[0][1]:
                # The same tools in another object (each parse makes its own): this one is held
                # instead, so that the next turn's, the very same object, is told at once.
                keep = [(logged[0][0], tools), *logged[1:]]
        else:
            # Other tools than the last line's: those of another conversation of the session
            # (a sub-agent's), logged already by an earlier line, are named by its number.
            earlier = next(
                (i for i, (_, held) in enumerate(logged) if prefix.same_as_sent(tools, held)), None
            )
            if earlier is not None:
                event["tools_ref"] = logged[earlier][0]
                keep = [logged[earlier], *logged[:earlier], *logged[earlier + 1 :]]
            else:
                event["tools"] = tools
                keep = [(ex.exchange_id, tools), *logged[: CONVERSATIONS_KEPT - 1]]
        # (about the bytes of the client's body the line holds: all of a first turn's; of a
        # turn coded against an earlier line, its own messages' texts: a 2 MB tool output)
        weight = ex.request_bytes
        if len(own) + len(appended) < len(messages):
            weight = _text_bytes(own) + _text_bytes(appended)
        written = self._emit_scrubbed(ex.session_id, event, ex, weight=weight)
        if state is not None and written:  # a line that was refused is no base
            carried = next((m for eid, m in candidates if eid == base_exchange), None)
            whole = carried is not None and base == len(carried)  # it carries that one on whole
            state.remember(ex.exchange_id, messages, continues=base_exchange if whole else None)
            state.extra["logged_tools"] = keep
            if written_instructions is not None:
                state.extra["logged_instructions"] = written_instructions

    def on_retry(self, ex: Exchange) -> None:
        """The request was compacted and re-sent: log it again under the same exchange id (replay
        takes the latest), so the log holds what was actually forwarded."""
        self.on_request(ex)

    def on_response(self, ex: Exchange) -> None:
        if ex.session_id is None or (ex.route != "chat" and ex.body is None):
            return
        # A meta line refused with the request (a burst past the writer's queue) goes with the
        # response: else a session of one exchange had a file that did not say it was
        # cachegate's log.
        self._meta(ex)
        assembled = ex.assembled
        usage = ex.usage
        event: dict[str, Any] = {
            "ts": self.clock(),
            "type": "response",
            "exchange": ex.exchange_id,
            "status": ex.status,
            "message": assembled.message if assembled and not assembled.text_dropped else None,
            "finish_reason": assembled.finish_reason if assembled else None,
            "usage": _usage_dict(usage) if usage else None,
            "ttfb_s": round(ex.ttfb_s, 6) if ex.ttfb_s is not None else None,
            "duration_s": round(ex.duration_s, 6),
            "interrupted": ex.interrupted,
            "error": ex.error,
        }
        if ex.cache is not None:
            event["cache"] = ex.cache
        if ex.cost is not None:
            event["cost"] = ex.cost
        if ex.divergence is not None:
            event["divergence"] = ex.divergence
        if ex.summary_usage is not None:
            # a compaction's summary call made for this request (billed with it): its model,
            # tokens and cost apart from the main call's (``cost`` includes it)
            summary: dict[str, Any] = {
                "model": ex.summary_model,
                "usage": _usage_dict(ex.summary_usage),
            }
            if ex.summary_cost is not None:
                summary["cost"] = ex.summary_cost
            event["summary"] = summary
        self._emit_scrubbed(ex.session_id, event, ex)

    def on_compaction(self, ex: Exchange, comp: Any, source: str) -> None:
        if ex.session_id is None:
            return
        self._meta(ex)  # a compaction is noted before the request: the meta line comes first
        self._emit_scrubbed(
            ex.session_id,
            {
                "ts": self.clock(),
                "type": "compacted",
                "exchange": ex.exchange_id,
                "start": comp.start,
                "covered": comp.covered,
                # a reused compaction only points at the one logged when it was made
                "summary": None if source == "reused" else comp.message.get("content"),
                "tokens_before": comp.tokens_before,
                "tokens_after": comp.tokens_after,
                "source": source,
                # made for a retry after the provider refused the request as too long (its
                # request line was written): the reports tell it from another request
                "retry": ex.request_noted,
                **(
                    {}
                    if source == "reused"
                    else {"prefix_digest": comp.prefix_digest, "opening": comp.opening}
                ),
                # (carried to a history edited in place, or cut for a retry: how its summary
                # was made)
                **({"made": comp.source} if source in ("carried", "cut") else {}),
            },
            ex,
        )

    def on_error(self, ex: Exchange) -> None:
        if ex.session_id is None:
            return
        self._meta(ex)
        self._emit_scrubbed(
            ex.session_id,
            {
                "ts": self.clock(),
                "type": "error",
                "exchange": ex.exchange_id,
                "model": ex.model,
                "status": ex.status,
                "message": ex.error,
                "forwarded": False,  # answered by cachegate: nothing went upstream
            },
            ex,
        )


_KEY_HEADERS: Final = CLIENT_KEY_HEADERS | GATEWAY_KEY_HEADERS
_SCHEMED: Final = frozenset(name.encode() for name in SCHEMED_KEY_HEADERS)
_CLIENT_KEYS_KEPT: Final = 64


def client_keys(headers: Iterable[tuple[bytes, bytes]] | None) -> tuple[str, ...]:
    """The values of the key headers a request went upstream with (``Authorization``'s without
    its scheme, ``api-key``, ``x-api-key``, ``x-goog-api-key``, and a gateway's,
    ``GATEWAY_KEY_HEADERS``: ``credential_keys``), but cachegate's placeholder and those too
    short to search for (``known_secrets``): a key of the client's own, which the redaction's
    patterns need not know."""
    keys: list[str] = []
    for name, value in headers or ():
        name = name.lower()
        if name in _KEY_HEADERS:
            keys += credential_keys(name in _SCHEMED, value.decode("latin-1"))
    return known_secrets(keys)


def exchange_keys(ex: Exchange) -> tuple[str, ...]:
    """The client's own keys ``ex`` went upstream with: in its key headers (``client_keys``)
    and in its URL's query (``query_keys``), for text said on stderr."""
    return known_secrets((*client_keys(ex.upstream_headers), *query_keys(ex.query)))


def _usage_dict(usage: Usage) -> dict[str, Any]:
    said = {
        "prompt": usage.prompt,
        "completion": usage.completion,
        "cache_read": usage.cache_read,
        "cache_write": usage.cache_write,
        "reported_cache": usage.reported_cache,
    }
    if usage.audio_in or usage.audio_out:  # (an audio model's: priced apart)
        said["audio_in"], said["audio_out"] = usage.audio_in, usage.audio_out
    return said


def _iso(ts: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat().replace("+00:00", "Z")


_MODEL_SHOWN = 200  # characters of a model's name said on stderr
_MODEL_REDACTED = 4096  # ...of the name redacted first (a key cut at the clip is whole there)
