"""The provider's prefix cache, simulated (pure: time is an argument).

A request's token sequence is cut into fixed blocks whose hashes are chained (each block's hash
covers everything before it), so "this request shares its first k blocks with some cached request"
is k successive dictionary hits — linear in the request's length, whatever is cached. Only whole
blocks are cached, and nothing below the dialect's minimum. Every block of a processed request is
stored or refreshed at the request's time; a block idle for ``ttl_s`` or more is gone, or for
``LONG_TTL_S`` when a request asked for it (Claude's ``"ttl": "1h"`` breakpoints: the blocks up to
the last of them). Claude keeps entries only for prefixes that end at a request's breakpoint, and
reads only those: with ``entries``, a read ends at the last block of such a prefix, not at any
block a longer prefix holds (a request whose tools changed read the tools' first blocks);
and, given where its content blocks end (``bounds``), only an entry that ends at most
``CLAUDE_LOOKBACK_BLOCKS`` blocks before one of its breakpoints (Claude's look back).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """Cache granularity of a provider: ``block`` tokens per entry, nothing below ``minimum``."""

    block: int
    minimum: int

    def round(self, tokens: int) -> int:
        """``tokens`` rounded down to whole blocks; 0 when that is below the minimum."""
        rounded = tokens // self.block * self.block
        return rounded if rounded >= self.minimum else 0


POLICIES: dict[str, CachePolicy] = {
    "openai": CachePolicy(block=128, minimum=1024),
    "deepseek": CachePolicy(block=64, minimum=64),
    "anthropic-compat": CachePolicy(block=128, minimum=1024),
}


# Claude checks for an entry at a breakpoint and ~20 content blocks before it, no further
# (Anthropic's prompt caching docs; cachegate's ``proxy.observers.CLAUDE_LOOKBACK_BLOCKS``)
CLAUDE_LOOKBACK_BLOCKS = 20
LONG_TTL_S = 3600.0  # Claude's one-hour cache, asked for by a breakpoint's ``"ttl": "1h"``
EXTENDED_TTL_S = 86400.0  # OpenAI's extended retention, ``"prompt_cache_retention": "24h"``


def claude_minimum(model: str) -> int:
    """The shortest prefix Claude caches for ``model``: 4,096 tokens for Opus 4.5 to 4.7 and
    Haiku 4.5, 2,048 for the Haiku 3 models, else 1,024 (Anthropic's prompt caching docs)."""
    name = model.lower()
    if any(m in name for m in ("opus-4-5", "opus-4-6", "opus-4-7", "haiku-4-5", "opus-4.5",
                               "opus-4.6", "opus-4.7", "haiku-4.5")):  # fmt: skip
        return 4096
    if "haiku-3" in name or "3-haiku" in name or "3-5-haiku" in name or "3.5-haiku" in name:
        return 2048
    return 1024


@dataclass(frozen=True, slots=True)
class CacheResult:
    """What one request did to the cache: tokens ``read`` from it and newly ``written`` to it,
    of which ``written_long`` for ``LONG_TTL_S``."""

    read: int
    written: int
    written_long: int = 0


def block_hashes(tokens: Sequence[bytes], block: int, scope: str = "") -> list[bytes]:
    """Chained hashes of each whole ``block`` of ``tokens``; ``scope`` (a model) seeds the chain."""
    digest = blake2b(scope.encode(), digest_size=16).digest()
    out = []
    for start in range(0, len(tokens) - block + 1, block):
        # Tokens never contain NUL, so joining with it is unambiguous.
        digest = blake2b(
            digest + b"\0" + b"\0".join(tokens[start : start + block]), digest_size=16
        ).digest()
        out.append(digest)
    return out


class PrefixCache:
    """Block-hash → when it expires, with TTLs measured on the caller's clock."""

    def __init__(self, policy: CachePolicy, ttl_s: float) -> None:
        self.policy = policy
        self.ttl_s = ttl_s
        self._expires: dict[bytes, float] = {}
        # blocks a Claude-style entry ends with, and the token counts such entries end at
        self._ends: dict[bytes, set[int]] = {}
        self._pruned_at: float | None = None

    def __len__(self) -> int:
        return len(self._expires)

    def clear(self) -> None:
        self._expires.clear()
        self._ends.clear()
        self._pruned_at = None

    def _fresh(self, digest: bytes, now: float) -> bool:
        expires = self._expires.get(digest)
        return expires is not None and now < expires

    def _prune(self, now: float) -> None:
        if self._pruned_at == now:
            return
        self._pruned_at = now
        expired = [d for d, expires in self._expires.items() if now >= expires]
        for digest in expired:
            del self._expires[digest]
            self._ends.pop(digest, None)

    def peek(self, tokens: Sequence[bytes], now: float, scope: str = "") -> int:
        """Tokens a request would read from the cache at ``now``, without touching it."""
        matched = 0
        for digest in block_hashes(tokens, self.policy.block, scope):
            if not self._fresh(digest, now):
                break
            matched += 1
        return self.policy.round(matched * self.policy.block)

    def process(
        self,
        tokens: Sequence[bytes],
        now: float,
        scope: str = "",
        limit: int | None = None,
        long_limit: int = 0,
        entries: Sequence[int] | None = None,
        long_ttl_s: float = LONG_TTL_S,
        minimum: int | None = None,
        bounds: Mapping[int, int] | None = None,
    ) -> CacheResult:
        """Serve a request's prompt at ``now``: read its cached prefix, store/refresh the rest;
        with a ``limit``, only its first ``limit`` tokens are looked up and stored (Claude's
        last breakpoint); the blocks within its first ``long_limit`` tokens are kept for
        ``long_ttl_s`` (its last one-hour breakpoint; OpenAI's extended retention, the whole
        prompt for a day), the others for ``ttl_s``; ``minimum``: the model's own shortest
        cached prefix, in place of the policy's. A block keeps
        the later of its expiries. With ``entries`` (the token counts its breakpoints end at),
        the read is the longest cached prefix that an earlier request's entry ends with, and
        this request's entries end at the last whole block of each; with ``bounds`` too (the
        content blocks ending at or before each token count a block ends at), only an entry
        ending at most ``CLAUDE_LOOKBACK_BLOCKS`` blocks before one of ``entries`` is read."""
        self._prune(now)
        if limit is not None:
            tokens = tokens[:limit]
        policy = self.policy
        if minimum is not None and minimum != policy.minimum:
            policy = CachePolicy(policy.block, minimum)
        hashes = block_hashes(tokens, policy.block, scope)
        matched = 0
        for digest in hashes:
            if not self._fresh(digest, now):
                break
            matched += 1
        if entries is not None:
            reach: set[int] | None = None
            if bounds is not None:  # (the block boundaries within the look back of a breakpoint)
                marks = sorted(end for end in entries if end in bounds)
                reach, next_mark = set(), 0
                for at in sorted(bounds):  # (the nearest breakpoint at or after it looks back most)
                    while next_mark < len(marks) and marks[next_mark] < at:
                        next_mark += 1
                    if next_mark == len(marks):
                        break
                    if bounds[marks[next_mark]] - bounds[at] <= CLAUDE_LOOKBACK_BLOCKS:
                        reach.add(at)
            while matched and not (
                hashes[matched - 1] in self._ends
                and (reach is None or not reach.isdisjoint(self._ends[hashes[matched - 1]]))
            ):
                matched -= 1
            for end in entries:
                end = min(end, len(tokens))
                if policy.round(end):
                    self._ends.setdefault(hashes[end // policy.block - 1], set()).add(end)
        block = policy.block
        read = policy.round(matched * block)
        cacheable = policy.round(len(hashes) * block)
        # (a breakpoint under the minimum caches nothing: Claude's, as any)
        long_blocks = policy.round(min(long_limit, cacheable)) // block
        expires = self._expires
        for at, digest in enumerate(hashes[: cacheable // block]):
            until = now + (long_ttl_s if at < long_blocks else self.ttl_s)
            if expires.get(digest, until) <= until:
                expires[digest] = until
        written_long = max(0, long_blocks * block - read) if cacheable > read else 0
        return CacheResult(read=read, written=cacheable - read, written_long=written_long)
