"""Provider usage objects normalized into one ``Usage`` value (pure)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage of one exchange, whatever dialect the provider spoke.

    ``prompt`` counts every input token, cached or not. ``reported_cache`` is true when the provider
    sent any cache field at all, so a 0 from a provider that never reports can be told apart from a
    real miss.
    """

    prompt: int = 0
    completion: int = 0
    cache_read: int = 0
    cache_write: int = 0
    reported_cache: bool = False
