"""The provider's prefix cache, simulated (pure: time is an argument).

A request's token sequence is cut into fixed blocks whose hashes are chained (each block's hash
covers everything before it), so "this request shares its first k blocks with some cached request"
is k successive dictionary hits — linear in the request's length, whatever is cached. Only whole
blocks are cached, and nothing below the dialect's minimum. Every block of a processed request is
stored or refreshed at the request's time; a block idle for ``ttl_s`` or more is gone.
"""

from __future__ import annotations

from collections.abc import Sequence
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


@dataclass(frozen=True, slots=True)
class CacheResult:
    """What one request did to the cache: tokens ``read`` from it and newly ``written`` to it."""

    read: int
    written: int


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
    """Block-hash → last-used time, with a TTL measured on the caller's clock."""

    def __init__(self, policy: CachePolicy, ttl_s: float) -> None:
        self.policy = policy
        self.ttl_s = ttl_s
        self._last_used: dict[bytes, float] = {}
        self._pruned_at: float | None = None

    def __len__(self) -> int:
        return len(self._last_used)

    def clear(self) -> None:
        self._last_used.clear()
        self._pruned_at = None

    def _fresh(self, digest: bytes, now: float) -> bool:
        last = self._last_used.get(digest)
        return last is not None and now - last < self.ttl_s

    def _prune(self, now: float) -> None:
        if self._pruned_at == now:
            return
        self._pruned_at = now
        expired = [d for d, last in self._last_used.items() if now - last >= self.ttl_s]
        for digest in expired:
            del self._last_used[digest]

    def peek(self, tokens: Sequence[bytes], now: float, scope: str = "") -> int:
        """Tokens a request would read from the cache at ``now``, without touching it."""
        matched = 0
        for digest in block_hashes(tokens, self.policy.block, scope):
            if not self._fresh(digest, now):
                break
            matched += 1
        return self.policy.round(matched * self.policy.block)

    def process(
        self, tokens: Sequence[bytes], now: float, scope: str = "", limit: int | None = None
    ) -> CacheResult:
        """Serve a request's prompt at ``now``: read its cached prefix, store/refresh the rest;
        with a ``limit``, only its first ``limit`` tokens are looked up and stored (Claude's
        last breakpoint)."""
        self._prune(now)
        if limit is not None:
            tokens = tokens[:limit]
        hashes = block_hashes(tokens, self.policy.block, scope)
        matched = 0
        for digest in hashes:
            if not self._fresh(digest, now):
                break
            matched += 1
        read = self.policy.round(matched * self.policy.block)
        cacheable = self.policy.round(len(hashes) * self.policy.block)
        for digest in hashes[: cacheable // self.policy.block]:
            self._last_used[digest] = now
        return CacheResult(read=read, written=cacheable - read)
