"""Prometheus collectors for cachegate, and the cheap, never-raising calls the relay makes on them.

Every label is bounded: ``model`` takes configured model names or ``other``, every other label takes
a value from a fixed set below, and no label ever carries a session id. Label combinations that are
finite and meaningful are created at zero up front, so a fresh dashboard shows zeros, not "no data".
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any, Final, ParamSpec

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.pipeline import Exchange
from proxy.usage import Usage

logger = logging.getLogger(__name__)

OTHER_MODEL: Final = "other"
"""The ``model`` label of every model that is not configured (and of requests without a model)."""

ROUTES: Final = ("chat", "passthrough")
"""The ``route`` label: the chat-completions pipeline, or the generic relay of any other path."""
TOKEN_KINDS: Final = ("prompt", "completion", "cache_read", "cache_write")
WASTE_CAUSES: Final = ("ttl_expired", "prefix_rewrite", "params_changed", "unexplained")
REWRITE_LOCATIONS: Final = ("system", "tools", "messages", "params")
REPAIR_KINDS: Final = (
    "dangling_call",
    "orphan_result",
    "displaced_result",
    "duplicate_result",
    "invalid_arguments",
    "missing_id",
)
COMPACTION_RESULTS: Final = ("summary", "extractive", "reused")
COST_KINDS: Final = ("actual", "uncached")
UPSTREAM_ERROR_KINDS: Final = ("connect", "timeout", "status", "midstream")
LOG_LOSS_KINDS: Final = ("queue_full", "write_error")
GEN_AI_TOKEN_TYPES: Final = ("input", "output", "cached_input", "cache_creation_input")
GEN_AI_OPERATION: Final = "chat"

# Proxy overhead is what cachegate adds on top of the provider: tens of microseconds when healthy.
OVERHEAD_BUCKETS: Final = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
)  # fmt: skip
# A long agent turn streams for minutes; the upstream timeout defaults to 600 s.
DURATION_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
TTFB_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
# The explicit bucket boundaries the OpenTelemetry GenAI conventions give gen_ai.client.token.usage.
TOKEN_USAGE_BUCKETS: Final = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip

_P = ParamSpec("_P")


def _safe(method: Callable[_P, None]) -> Callable[_P, None]:
    """Log and swallow any error: a metrics bug must never cost a user their response."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            method(*args, **kwargs)
        except Exception:
            logger.exception("metrics: %s failed", method.__name__)

    return wrapper


def _check(value: str, allowed: tuple[str, ...], label: str) -> str:
    """Refuse a label value outside its fixed set, so a caller's bug cannot add series."""
    if value not in allowed:
        raise ValueError(f"unknown {label} {value!r}; expected one of {', '.join(allowed)}")
    return value


class Metrics:
    """The cachegate metric set, registered on ``registry`` (a fresh one per app or test).

    ``models`` are the configured model names; ``*`` (the configuration fallback) is not a model.
    """

    def __init__(self, registry: CollectorRegistry, models: Collection[str]) -> None:
        self._models = frozenset(m for m in models if m != "*")
        self._label_cache: dict[str, str] = {}
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = registry
        self.requests = Counter(
            "cachegate_requests",
            "Requests answered, by route, model and HTTP status.",
            ["route", "model", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "cachegate_request_duration_seconds",
            "Time from request received to the last byte relayed to the client.",
            ["route", "model"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            "cachegate_time_to_first_byte_seconds",
            "Time from request received to the first response byte relayed to the client.",
            ["model"],
            buckets=TTFB_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "cachegate_proxy_overhead_seconds",
            "Time cachegate itself spends on a request (parsing, repair, accounting), not waiting.",
            ["route"],
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "cachegate_tokens",
            "Tokens reported by the provider; kind=prompt counts all prompt tokens, cached or not.",
            ["model", "kind"],
            registry=r,
        )
        self.cache_waste = Counter(
            "cachegate_cache_waste_tokens",
            "Prompt tokens that should have been read from the provider cache but were not.",
            ["model", "cause"],
            registry=r,
        )
        self.prefix_rewrites = Counter(
            "cachegate_prefix_rewrites",
            "Requests whose prefix differs from the session's previous request, by first location.",
            ["location"],
            registry=r,
        )
        self.pairing_repairs = Counter(
            "cachegate_pairing_repairs",
            "Tool-pairing repairs applied to forwarded histories, by kind.",
            ["kind"],
            registry=r,
        )
        self.strict_rejections = Counter(
            "cachegate_strict_rejections",
            "Requests rejected with 400 because strict pairing found a broken history.",
            registry=r,
        )
        self.compactions = Counter(
            "cachegate_compactions",
            "Histories compacted before forwarding, by how the summary was obtained.",
            ["model", "result"],
            registry=r,
        )
        self.cost = Counter(
            "cachegate_cost_usd",
            "Cost in USD: actual (with cache discounts) and uncached (had nothing been cached).",
            ["model", "kind"],
            registry=r,
        )
        self.active_streams = Gauge(
            "cachegate_active_streams",
            "Responses being streamed to clients right now.",
            registry=r,
        )
        self.client_disconnects = Counter(
            "cachegate_client_disconnects",
            "Clients that hung up before the response was complete.",
            registry=r,
        )
        self.upstream_errors = Counter(
            "cachegate_upstream_errors",
            "Upstream failures: connect, timeout, error status, or a stream broken midway.",
            ["kind"],
            registry=r,
        )
        self.log_lost = Counter(
            "cachegate_event_log_lost",
            "Event log lines lost: the writer queue was full, or writing failed.",
            ["kind"],
            registry=r,
        )
        self.gen_ai_token_usage = Histogram(
            "gen_ai_client_token_usage",
            "Tokens per request, as OpenTelemetry GenAI gen_ai.client.token.usage.",
            ["gen_ai_operation_name", "gen_ai_request_model", "gen_ai_token_type"],
            buckets=TOKEN_USAGE_BUCKETS,
            registry=r,
        )
        self._preinitialize()

    def _preinitialize(self) -> None:
        for route in ROUTES:
            self._child(self.overhead, route)
        for label in (*sorted(self._models), OTHER_MODEL):
            for route in ROUTES:
                # 200 stands for the normal answer; other statuses appear when they happen.
                self._child(self.requests, route, label, "200")
                self._child(self.request_duration, route, label)
            self._child(self.ttfb, label)
            for kind in TOKEN_KINDS:
                self._child(self.tokens, label, kind)
            for cause in WASTE_CAUSES:
                self._child(self.cache_waste, label, cause)
            for result in COMPACTION_RESULTS:
                self._child(self.compactions, label, result)
            for kind in COST_KINDS:
                self._child(self.cost, label, kind)
            for token_type in GEN_AI_TOKEN_TYPES:
                self._child(self.gen_ai_token_usage, GEN_AI_OPERATION, label, token_type)
        for location in REWRITE_LOCATIONS:
            self._child(self.prefix_rewrites, location)
        for kind in REPAIR_KINDS:
            self._child(self.pairing_repairs, kind)
        for kind in UPSTREAM_ERROR_KINDS:
            self._child(self.upstream_errors, kind)
        for kind in LOG_LOSS_KINDS:
            self._child(self.log_lost, kind)

    def _child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, memoized: ``labels()`` takes a lock and validates on every
        call, and an exchange records a dozen series."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = metric.labels(*values)
            self._children[key] = child
        return child

    def model_label(self, model: str | None) -> str:
        """The ``model`` label for ``model``: the configured name it resolves to, else ``other``.

        Resolution follows the configuration's rule: the exact name, else the longest configured
        prefix (a dated snapshot such as ``gpt-4o-2024-08-06`` is priced, and labelled, as
        ``gpt-4o``).
        """
        if not model:
            return OTHER_MODEL
        label = self._label_cache.get(model)
        if label is None:
            best = model if model in self._models else ""
            if not best:
                for name in self._models:
                    if model.startswith(name) and len(name) > len(best):
                        best = name
            label = best or OTHER_MODEL
            if len(self._label_cache) < 4096:  # clients choose model names: stay bounded
                self._label_cache[model] = label
        return label

    @_safe
    def observe_request(
        self, route: str, model: str | None, status: int, duration_s: float
    ) -> None:
        """Count one answered request and its total duration."""
        label = self.model_label(model)
        self._child(self.requests, route, label, str(status)).inc()
        self._child(self.request_duration, route, label).observe(duration_s)

    @_safe
    def observe_ttfb(self, model: str | None, s: float) -> None:
        """Record the time to the first byte relayed to the client."""
        self._child(self.ttfb, self.model_label(model)).observe(s)

    @_safe
    def observe_overhead(self, route: str, s: float) -> None:
        """Record the time cachegate itself spent on one request."""
        self._child(self.overhead, route).observe(s)

    @_safe
    def observe_usage(self, model: str | None, usage: Usage) -> None:
        """Count the tokens of one exchange, in cachegate's and in the OpenTelemetry GenAI form.

        Cache token types enter the GenAI histogram only when the provider reported cache fields,
        so a provider that never reports does not read as a stream of misses.
        """
        label = self.model_label(model)
        counts = {
            "prompt": usage.prompt,
            "completion": usage.completion,
            "cache_read": usage.cache_read,
            "cache_write": usage.cache_write,
        }
        if any(n < 0 for n in counts.values()):
            raise ValueError(f"negative token count in {usage!r}")
        for kind, n in counts.items():
            self._child(self.tokens, label, kind).inc(n)
        gen_ai = {"input": usage.prompt, "output": usage.completion}
        if usage.reported_cache:
            gen_ai["cached_input"] = usage.cache_read
            gen_ai["cache_creation_input"] = usage.cache_write
        for token_type, n in gen_ai.items():
            self._child(self.gen_ai_token_usage, GEN_AI_OPERATION, label, token_type).observe(n)

    @_safe
    def observe_cache_waste(self, model: str | None, cause: str, tokens: int) -> None:
        """Count prompt tokens that missed the provider cache, by cause."""
        self._child(
            self.cache_waste, self.model_label(model), _check(cause, WASTE_CAUSES, "cause")
        ).inc(tokens)

    @_safe
    def observe_prefix_rewrite(self, location: str) -> None:
        """Count one request whose prefix was rewritten, at its first differing location."""
        self._child(self.prefix_rewrites, _check(location, REWRITE_LOCATIONS, "location")).inc()

    @_safe
    def observe_repairs(self, kinds: Iterable[str]) -> None:
        """Count pairing repairs, one per item of ``kinds`` (repeat a kind to count it again)."""
        checked = [_check(kind, REPAIR_KINDS, "repair kind") for kind in kinds]
        for kind in checked:
            self._child(self.pairing_repairs, kind).inc()

    @_safe
    def observe_strict_rejection(self) -> None:
        """Count one request rejected by strict pairing."""
        self.strict_rejections.inc()

    @_safe
    def observe_compaction(self, model: str | None, result: str) -> None:
        """Count one compaction, by how its summary was obtained."""
        self._child(
            self.compactions,
            self.model_label(model),
            _check(result, COMPACTION_RESULTS, "compaction result"),
        ).inc()

    @_safe
    def observe_cost(self, model: str | None, actual: float, uncached: float) -> None:
        """Add one exchange's cost in USD, as billed and as it would have been without the cache."""
        label = self.model_label(model)
        if actual < 0 or uncached < 0:
            raise ValueError(f"negative cost actual={actual!r} uncached={uncached!r}")
        self._child(self.cost, label, "actual").inc(actual)
        self._child(self.cost, label, "uncached").inc(uncached)

    @_safe
    def stream_started(self) -> None:
        """Mark one more response streaming to a client."""
        self.active_streams.inc()

    @_safe
    def stream_finished(self) -> None:
        """Mark one stream ended, however it ended (call exactly once per ``stream_started``)."""
        self.active_streams.dec()

    @_safe
    def observe_client_disconnect(self) -> None:
        """Count one client that hung up before its response was complete."""
        self.client_disconnects.inc()

    @_safe
    def observe_upstream_error(self, kind: str) -> None:
        """Count one upstream failure: connect, timeout, status or midstream."""
        self._child(
            self.upstream_errors, _check(kind, UPSTREAM_ERROR_KINDS, "upstream error kind")
        ).inc()

    @_safe
    def observe_log_loss(self, kind: str, lines: int = 1) -> None:
        """Count event log lines lost: queue_full or write_error."""
        self._child(self.log_lost, _check(kind, LOG_LOSS_KINDS, "log loss kind")).inc(lines)


class MetricsObserver:
    """Feeds ``Metrics`` from the exchanges the pipeline reports (a ``proxy.pipeline.Observer``).

    Covers what an ``Exchange`` already carries: requests, durations, TTFB, overhead, usage,
    repairs, upstream errors, client disconnects and chat streams in flight. Strict rejections,
    cache waste, prefix rewrites, compactions, cost and log loss are reported by their owners
    through the ``observe_*`` methods directly.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def on_request(self, ex: Exchange) -> None:
        if ex.stream:
            self.metrics.stream_started()

    def on_response(self, ex: Exchange) -> None:
        m = self.metrics
        if ex.stream:
            m.stream_finished()
        m.observe_request(ex.route, ex.model, ex.status, ex.duration_s)
        m.observe_overhead(ex.route, ex.overhead_s)
        if ex.ttfb_s is not None:
            m.observe_ttfb(ex.model, ex.ttfb_s)
        if ex.usage is not None:
            m.observe_usage(ex.model, ex.usage)
        if ex.repairs:
            m.observe_repairs(str(r.get("kind")) for r in ex.repairs)
        if ex.upstream_error is not None:
            m.observe_upstream_error(ex.upstream_error)
        if ex.interrupted:
            m.observe_client_disconnect()

    def on_error(self, ex: Exchange) -> None:
        self.metrics.observe_request(
            ex.route, ex.model, ex.status, max(0.0, time.perf_counter() - ex.t0)
        )
