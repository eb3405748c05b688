"""Settings of one simulated provider."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

Dialect = Literal["openai", "deepseek", "anthropic-compat"]
DIALECTS: tuple[str, ...] = get_args(Dialect)
# Faults answered with an HTTP error before the request is processed.
STATUS_FAULTS = ("429", "500", "503")
# Faults that break a response already under way.
STREAM_FAULTS = ("reset", "stall", "malformed", "error_event")
FAULTS: tuple[str, ...] = STATUS_FAULTS + STREAM_FAULTS
DEFAULT_MODELS: dict[str, tuple[str, ...]] = {
    "openai": ("gpt-4o", "gpt-4o-mini", "text-embedding-3-small"),
    "deepseek": ("deepseek-chat", "deepseek-reasoner"),
    "anthropic-compat": ("claude-sonnet-4-5", "claude-haiku-4-5"),
}


@dataclass(frozen=True, slots=True)
class SimConfig:
    """How the simulated provider behaves. Invalid values raise ``ValueError`` at construction.

    Times in ``*_ms`` are real time (``anyio.sleep``); ``cache_ttl_s`` runs on the simulator's own
    clock, which only moves when told to, starting at ``start_time`` (a Unix time). ``fault_rate``
    is the chance that a chat request gets a fault drawn from ``faults``, with ``seed``.
    """

    dialect: Dialect = "openai"
    ttft_ms: float = 0.0
    chunk_ms: float = 0.0
    cache_ttl_s: float = 300.0
    context_window: int = 128_000
    seed: int = 0
    keepalive: bool = False
    keepalive_interval_ms: float = 1000.0
    fault_rate: float = 0.0
    faults: tuple[str, ...] = FAULTS
    stall_s: float = 30.0
    retry_after_s: int = 1
    start_time: float = 1_700_000_000.0
    embedding_dimensions: int = 1536
    models: tuple[str, ...] = ()
    # anthropic-compat caches only up to a request's last cache_control breakpoint, as Claude
    # does; this caches unmarked requests whole, as a gateway that marks for its clients makes
    # it (LiteLLM's cache_control_injection_points, Bifrost)
    cache_unmarked: bool = False
    # refuse any request with stream_options, as Mistral does (422, extra_forbidden) and Azure
    # OpenAI's older API versions (400)
    refuse_stream_options: bool = False
    # refuse a message other than an assistant's right after a tool result, and tool call ids
    # other than nine letters and digits, as Mistral's API does
    mistral_rules: bool = False
    # refuse an assistant message with an empty text (no text and no tool calls), as Gemini's
    # OpenAI-compatible endpoint does
    gemini_rules: bool = False
    # stream parallel tool calls' argument pieces round-robin by index, as some compatible
    # servers do (OpenAI, and by default the simulator, stream each call whole in turn)
    interleave_tool_calls: bool = False

    def __post_init__(self) -> None:
        if self.dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {', '.join(DIALECTS)}, not {self.dialect!r}")
        for name in ("ttft_ms", "chunk_ms", "cache_ttl_s", "stall_s"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:  # nan too; inf: every request would hang
                raise ValueError(f"{name} must be a finite number >= 0")
        if self.keepalive_interval_ms <= 0:
            raise ValueError("keepalive_interval_ms must be > 0")
        if self.context_window < 1:
            raise ValueError("context_window must be >= 1")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError("fault_rate must be between 0 and 1")
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown or not self.faults:
            raise ValueError(f"faults must be a non-empty subset of {', '.join(FAULTS)}")
        if self.embedding_dimensions < 1:
            raise ValueError("embedding_dimensions must be >= 1")

    @property
    def model_ids(self) -> tuple[str, ...]:
        """The models ``GET /v1/models`` lists (any model name is accepted on requests)."""
        return self.models or DEFAULT_MODELS[self.dialect]
