"""Prometheus collectors for cachegate, and the cheap, never-raising calls the relay makes on them.

Every label is bounded: ``model`` takes configured model names or ``other``, every other label takes
a value from a fixed set below, and no label ever carries a session id. Label combinations that are
finite and meaningful are created at zero up front, so a fresh dashboard shows zeros, not "no data".
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import accumulate
from typing import Any, Final, ParamSpec

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from proxy.config import configured_model
from proxy.pipeline import Exchange
from proxy.usage import Usage

logger = logging.getLogger(__name__)

OTHER_MODEL: Final = "other"
"""The ``model`` label of every model that is not configured (and of requests without a model)."""

ROUTES: Final = ("chat", "responses", "passthrough")
"""The ``route`` label: the chat-completions pipeline, the Responses API's (``POST
/v1/responses`` and ``/v1/responses/compact``), or the generic relay of any other path."""
RESPONSES_PATHS: Final = ("responses", "responses/compact")


def route_label(ex: Exchange) -> str:
    """The ``route`` label of an exchange: a Responses API request goes through the relay of
    other paths (its ``route``), with its ``input`` repaired and its answer accounted."""
    if ex.route == "passthrough" and ex.method == "POST" and ex.path in RESPONSES_PATHS:
        return "responses"
    return ex.route


REQUEST_STATUSES: Final = (
    *("200", "400", "401", "402", "403", "404", "413", "415", "422", "426", "429", "431", "499"),
    *("500", "501", "502", "503", "504", "529"),
)
"""Statuses whose series exist from the start (at zero), so that the first one of each shows in a
rate: Prometheus cannot tell a series' first value from its creation. 200, then what clients and
providers answer most (402: OpenRouter's and DeepSeek's credits run out; 422: Mistral's and
vLLM's refusal of a request; 529: Anthropic's overload, through a gateway), and every status
cachegate answers itself (415: a chat body in an encoding it cannot read; 426: a WebSocket
upgrade; 431: a request head too large); others appear when they happen."""
TOKEN_KINDS: Final = ("prompt", "completion", "cache_read", "cache_write")
WASTE_CAUSES: Final = (
    "ttl_expired",
    "prefix_rewrite",
    "params_changed",
    "unexplained",
    "not_requested",
)
REWRITE_LOCATIONS: Final = ("system", "tools", "messages", "params")
REPAIR_KINDS: Final = (
    "dangling_call",
    "orphan_result",
    "displaced_result",
    "duplicate_result",
    "invalid_arguments",
    "missing_id",
    "empty_tool_calls",
    "missing_type",
    "duplicate_call_id",
    "empty_assistant",
    "user_after_tool",
    "blank_text",
    "null_result",
)
COMPACTION_RESULTS: Final = ("summary", "extractive", "reused")
COST_KINDS: Final = ("actual", "uncached")
UPSTREAM_ERROR_KINDS: Final = (
    *("connect", "timeout", "status", "midstream", "invalid", "error_event"),
)
LOG_LOSS_KINDS: Final = ("queue_full", "write_error")
SESSION_EVICTION_REASONS: Final = ("idle", "count", "memory")
GEN_AI_TOKEN_TYPES: Final = ("input", "output", "cached_input", "cache_creation_input")
GEN_AI_OPERATION: Final = "chat"

# Proxy overhead is what cachegate adds on top of the provider: tens of microseconds when healthy.
# (up to seconds: an extractive compaction of a history of megabytes is cachegate's own work)
OVERHEAD_BUCKETS: Final = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# A long agent turn streams for minutes; the upstream timeout defaults to 600 s.
# Between 0.25 s and 10 s, where most answers' first bytes and short answers' ends fall, no bucket
# is more than twice the one before it: an interpolated percentile is off by less than that step
# (with 0.5 and 1.0 next to each other, a p50 of 0.31 s read as 0.375).
DURATION_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
    60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# A non-streamed answer's first byte is its last: a reasoning model's takes minutes, up to the
# upstream timeout (past 120 s every one read as 120 s in a percentile).
TTFB_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.5, 10.0, 20.0,
    30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# The explicit bucket boundaries the OpenTelemetry GenAI conventions give gen_ai.client.token.usage.
TOKEN_USAGE_BUCKETS: Final = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip

_P = ParamSpec("_P")
# Model names are the clients' (up to a body's size): a longer one is looked up each time, not
# kept (600 names of 1 MB held 1.2 GB of RSS in the caches below, though labelled "other").
_NAME_KEPT: Final = 256


def timed(status: int) -> bool:
    """Whether a request's duration goes into ``cachegate_request_duration_seconds``: an answer
    (below 400; a stream its client cut short keeps its 200 and counts). Refusals, errors and
    requests whose client left before any answer (499: the time until it gave up) are counted in
    ``cachegate_requests_total`` only: a 429 or a strict-mode 400 comes within milliseconds, and
    a storm of them, or of client timeouts, would read as requests getting faster."""
    return status < 400


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


class _Family:
    """One metric family and its series, kept as plain Python numbers and turned into
    prometheus_client's families only when scraped.

    prometheus_client's own metric objects take a lock, check the label values and (for a
    histogram) walk the buckets in Python on every update; an exchange makes about twenty updates,
    which cost ~10% of cachegate's CPU per request. Here an update is a list index and an add, on
    the event loop's thread (log-loss counts from the writer thread take ``lock``). The exposition
    is the same: names, help, label sets, ``le`` strings, ``_created``.
    """

    __slots__ = ("_text", "buckets", "doc", "kind", "labelnames", "le", "lock", "name", "series")

    def __init__(
        self,
        kind: str,
        name: str,
        doc: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = (),
    ) -> None:
        self.kind = kind  # counter | gauge | histogram
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self.buckets = tuple(float(b) for b in buckets)
        self.le = (*(floatToGoString(b) for b in self.buckets), "+Inf")
        self.lock = threading.Lock()
        # label values -> [value, created] (counter, gauge) or [sum, created, *bucket counts]
        self.series: dict[tuple[str, ...], list[float]] = {}
        # label values -> the text of their label sets, made at the first scrape (``render``)
        self._text: dict[tuple[str, ...], tuple[str, ...]] = {}

    def child(self, *values: str) -> list[float]:
        """The series for ``values``, created at zero the first time."""
        cell = self.series.get(values)
        if cell is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            cell = [0.0, time.time()]
            if self.kind == "histogram":
                cell += [0] * len(self.le)
            cell = self.series.setdefault(values, cell)
        return cell

    def observe(self, cell: list[float], amount: float) -> None:
        """Add one observation to a histogram series (NaN, as prometheus_client does, only
        to the sum)."""
        cell[0] += amount
        if amount == amount:
            cell[bisect_left(self.buckets, amount) + 2] += 1

    def _labels(self, values: tuple[str, ...]) -> tuple[str, ...]:
        """The label sets of a series as the exposition writes them, names sorted: ``{…}`` (or
        nothing), then for a histogram one per bucket with its ``le``."""
        text = self._text.get(values)
        if text is None:
            pairs = [(k, _escape_value(v)) for k, v in zip(self.labelnames, values, strict=True)]

            def joined(extra: list[tuple[str, str]]) -> str:
                items = sorted(pairs + extra)
                return "{" + ",".join(f'{k}="{v}"' for k, v in items) + "}" if items else ""

            text = (joined([]), *(joined([("le", le)]) for le in self.le))
            if self.kind != "histogram":
                text = text[:1]
            self._text[values] = text
        return text

    def render(self, out: list[str], created: bool) -> None:
        """Append this family in Prometheus' text format, exactly as ``generate_latest`` writes
        what ``family()`` returns, without building prometheus_client's objects (which cost
        ~12 µs a line: ~50 ms on the event loop for a scrape of 4,000 lines)."""
        name, doc, go = self.name, _escape_help(self.doc), _go_float
        items = list(self.series.items())
        if self.kind == "gauge":
            out.append(f"# HELP {name} {doc}\n# TYPE {name} gauge\n")
            out.extend(f"{name}{self._labels(v)[0]} {go(cell[0])}\n" for v, cell in items)
            return
        if self.kind == "counter":
            total = name + "_total"
            out.append(f"# HELP {total} {doc}\n# TYPE {total} counter\n")
            out.extend(f"{total}{self._labels(v)[0]} {go(cell[0])}\n" for v, cell in items)
        else:
            out.append(f"# HELP {name} {doc}\n# TYPE {name} histogram\n")
            bucket, count, total_sum = name + "_bucket", name + "_count", name + "_sum"
            for values, cell in items:
                text = self._labels(values)
                cumulative = list(accumulate(cell[2:]))
                out.extend(
                    f"{bucket}{le} {go(n)}\n" for le, n in zip(text[1:], cumulative, strict=True)
                )
                out.append(f"{count}{text[0]} {go(cumulative[-1])}\n")
                out.append(f"{total_sum}{text[0]} {go(cell[0])}\n")
        if created and items:
            out.append(f"# HELP {name}_created {doc}\n# TYPE {name}_created gauge\n")
            out.extend(f"{name}_created{self._labels(v)[0]} {go(cell[1])}\n" for v, cell in items)

    def family(self) -> Metric:
        created = _created_series()
        if self.kind == "counter":
            counter = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
            for values, cell in list(self.series.items()):
                counter.add_metric(values, cell[0], created=cell[1] if created else None)
            return counter
        if self.kind == "gauge":
            gauge = GaugeMetricFamily(self.name, self.doc, labels=self.labelnames)
            for values, cell in list(self.series.items()):
                gauge.add_metric(values, cell[0])
            return gauge
        hist = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, cell in list(self.series.items()):
            cumulative = list(accumulate(cell[2:]))
            hist.add_metric(values, list(zip(self.le, cumulative, strict=True)), cell[0])
            if created:
                labels = dict(zip(self.labelnames, values, strict=True))
                hist.samples.append(Sample(f"{self.name}_created", labels, cell[1]))
        return hist


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(doc: str) -> str:
    return doc.replace("\\", r"\\").replace("\n", r"\n")


def _go_float(value: float) -> str:
    """``floatToGoString``: below a million in size (and not NaN) it is Python's ``repr``."""
    if -1_000_000.0 < value < 1_000_000.0:
        return repr(float(value))
    return floatToGoString(value)


def _created_series() -> bool:
    """Whether ``_created`` series are exposed: prometheus_client's own switch
    (``PROMETHEUS_DISABLE_CREATED_SERIES``, ``disable_created_metrics()``) decides."""
    return bool(getattr(prometheus_metrics, "_use_created", True))


class _Collector(Collector):
    """Exposes the families to a ``CollectorRegistry``."""

    def __init__(self, families: list[_Family]) -> None:
        self.families = families
        self.silent = False  # while ``Metrics.scrape`` writes the families itself

    def collect(self) -> Iterable[Metric]:
        return [] if self.silent else [f.family() for f in self.families]

    def describe(self) -> Iterable[Metric]:
        return [_Family(f.kind, f.name, f.doc, f.labelnames).family() for f in self.families]


class Metrics:
    """The cachegate metric set, registered on ``registry`` (a fresh one per app or test).

    ``models`` are the configured model names; ``*`` (the configuration fallback) is not a model.
    """

    def __init__(self, registry: CollectorRegistry, models: Collection[str]) -> None:
        self._models = frozenset(m for m in models if m != "*")
        self._label_cache: dict[str, str] = {}
        self._exchange_cells: dict[tuple[str, str | None, int], tuple[Any, ...]] = {}
        self._cost_cells: dict[str | None, tuple[list[float], list[float]]] = {}
        self._responses_seeded: set[str] = set()  # (model labels: bounded as they are)
        f = _Family
        self.requests = f(
            "counter",
            "cachegate_requests",
            "Requests answered, by route, model and HTTP status.",
            ["route", "model", "status"],
        )
        self.request_duration = f(
            "histogram",
            "cachegate_request_duration_seconds",
            "Time from request received to the last byte relayed to the client.",
            ["route", "model"],
            DURATION_BUCKETS,
        )
        self.ttfb = f(
            "histogram",
            "cachegate_time_to_first_byte_seconds",
            "Time from request received to the first response byte relayed to the client.",
            ["model"],
            TTFB_BUCKETS,
        )
        self.overhead = f(
            "histogram",
            "cachegate_proxy_overhead_seconds",
            "Time cachegate itself spends on a request until it is sent upstream (parsing, session, "
            "repair, compaction), not waiting; accounting and logging come after the answer.",
            ["route"],
            OVERHEAD_BUCKETS,
        )
        self.tokens = f(
            "counter",
            "cachegate_tokens",
            "Tokens reported by the provider; kind=prompt counts all prompt tokens, cached or not.",
            ["model", "kind"],
        )
        self.reported_prompt = f(
            "counter",
            "cachegate_cache_reported_prompt_tokens",
            "Prompt tokens of answers whose usage said what was read from the cache: a hit"
            " ratio's denominator (an answer without cache fields is no miss).",
            ["model"],
        )
        self.cache_waste = f(
            "counter",
            "cachegate_cache_waste_tokens",
            "Prompt tokens that should have been read from the provider cache but were not.",
            ["model", "cause"],
        )
        self.prefix_rewrites = f(
            "counter",
            "cachegate_prefix_rewrites",
            "Requests whose prefix differs from the session's previous request, by first location.",
            ["location"],
        )
        self.pairing_repairs = f(
            "counter",
            "cachegate_pairing_repairs",
            "Tool-pairing repairs applied to forwarded histories, by kind.",
            ["kind"],
        )
        self.strict_rejections = f(
            "counter",
            "cachegate_strict_rejections",
            "Requests rejected with 400 because strict pairing found a broken history.",
        )
        self.compactions = f(
            "counter",
            "cachegate_compactions",
            "Histories compacted before forwarding, by how the summary was obtained.",
            ["model", "result"],
        )
        self.cost = f(
            "counter",
            "cachegate_cost_usd",
            "Cost in USD: actual (with cache discounts) and uncached (had nothing been cached).",
            ["model", "kind"],
        )
        self.active_streams = f(
            "gauge",
            "cachegate_active_streams",
            "Responses being streamed to clients right now.",
        )
        self.client_disconnects = f(
            "counter",
            "cachegate_client_disconnects",
            "Clients that hung up before the response was complete.",
        )
        self.upstream_errors = f(
            "counter",
            "cachegate_upstream_errors",
            "Upstream failures: connect, timeout, error status, a stream broken midway, an"
            " invalid answer, or an error event inside a 200.",
            ["kind"],
        )
        self.log_lost = f(
            "counter",
            "cachegate_event_log_lost",
            "Event log lines lost: the writer queue was full, or writing failed.",
            ["kind"],
        )
        self.sessions = f(
            "gauge",
            "cachegate_sessions",
            "Sessions held in memory (as of this scrape).",
        )
        self.sessions_memory = f(
            "gauge",
            "cachegate_sessions_memory_bytes",
            "Memory the sessions hold, as estimated from their latest requests' sizes.",
        )
        self.session_evictions = f(
            "counter",
            "cachegate_session_evictions",
            "Sessions forgotten: idle past sessions.idle_ttl_s, over sessions.max_sessions, or "
            "over sessions.max_memory_mb.",
            ["reason"],
        )
        self.gen_ai_token_usage = f(
            "histogram",
            "gen_ai_client_token_usage",
            "Tokens per request, as OpenTelemetry GenAI gen_ai.client.token.usage.",
            ["gen_ai_operation_name", "gen_ai_request_model", "gen_ai_token_type"],
            TOKEN_USAGE_BUCKETS,
        )
        for family in (
            self.strict_rejections,
            self.active_streams,
            self.client_disconnects,
            self.sessions,
            self.sessions_memory,
        ):
            family.child()  # series without labels exist from the start, as prometheus_client's
        self._preinitialize()
        self._families = [v for v in vars(self).values() if isinstance(v, _Family)]
        self._collector = _Collector(self._families)
        registry.register(self._collector)

    def exposition(self) -> bytes:
        """These metrics in Prometheus' text format: what ``generate_latest`` writes of them,
        about ten times faster (~6 ms for the built-in model entries' ~4,000 lines, on the event
        loop, where prometheus_client's writer took ~50 ms)."""
        out: list[str] = []
        created = _created_series()
        for family in self._families:
            family.render(out, created)
        return "".join(out).encode()

    def scrape(self, registry: CollectorRegistry) -> bytes:
        """``generate_latest(registry)`` for the registry these metrics were registered on
        first: their text from ``exposition``, then whatever else is registered there."""
        self._collector.silent = True
        try:
            rest = generate_latest(registry)
        finally:
            self._collector.silent = False
        return self.exposition() + rest

    def _preinitialize(self) -> None:
        for route in ROUTES:
            self.overhead.child(route)
        for label in (*sorted(self._models), OTHER_MODEL):
            self._seed_model(label)
        for location in REWRITE_LOCATIONS:
            self.prefix_rewrites.child(location)
        for kind in REPAIR_KINDS:
            self.pairing_repairs.child(kind)
        for kind in UPSTREAM_ERROR_KINDS:
            self.upstream_errors.child(kind)
        for kind in LOG_LOSS_KINDS:
            self.log_lost.child(kind)
        for reason in SESSION_EVICTION_REASONS:
            self.session_evictions.child(reason)

    def _seed_model(self, label: str) -> None:
        """Create every series of a model label at zero."""
        for route in ("chat", "passthrough"):
            # Passthrough requests are labelled "other" (their bodies are not read for a model):
            # a model's passthrough series would never move
            if route == "passthrough" and label != OTHER_MODEL:
                continue
            for status in REQUEST_STATUSES:
                self.requests.child(route, label, status)
            if route == "passthrough":  # cachegate's own answer to a method a path does not take
                self.requests.child(route, label, "405")
            self.request_duration.child(route, label)
        # The Responses API's counts too (Codex CLI's every request): seeded on its first
        # request, every request until the next scrape was in the counts and in no rate()
        for status in REQUEST_STATUSES:
            self.requests.child("responses", label, status)
        self.ttfb.child(label)
        for kind in TOKEN_KINDS:
            self.tokens.child(label, kind)
        self.reported_prompt.child(label)
        for cause in WASTE_CAUSES:
            self.cache_waste.child(label, cause)
        for result in COMPACTION_RESULTS:
            self.compactions.child(label, result)
        for kind in COST_KINDS:
            self.cost.child(label, kind)
        for token_type in GEN_AI_TOKEN_TYPES:
            self.gen_ai_token_usage.child(GEN_AI_OPERATION, label, token_type)

    def model_label(self, model: str | None) -> str:
        """The ``model`` label for ``model``: the configured name it resolves to, else ``other``.

        Resolution follows the configuration's rule (``configured_model``): a dated snapshot
        such as ``gpt-4o-2024-08-06`` is priced, and labelled, as ``gpt-4o``; ``gpt-4o-mini``
        is not.
        """
        if not model:
            return OTHER_MODEL
        label = self._label_cache.get(model)
        if label is None:
            label = configured_model(model, self._models) or OTHER_MODEL
            if len(self._label_cache) < 4096 and len(model) <= _NAME_KEPT:  # (clients choose
                self._label_cache[model] = label  # model names: bounded, in count and bytes)
        return label

    def observe_exchange(
        self,
        route: str,
        model: str | None,
        status: int,
        duration_s: float,
        overhead_s: float,
        ttfb_s: float | None,
        usage: Usage | None,
        measured: bool = False,
    ) -> None:
        """``observe_request``, ``observe_overhead``, ``observe_ttfb`` and ``observe_usage`` for
        one exchange at once (``measured``: its cache read is known though its usage had no
        cache fields, a miss the accounting counted as a read of 0 after the session's answers
        had them: Gemini's OpenAI endpoint sends none on a miss). The series an exchange updates
        depend only on its route, model and
        status, so they are looked up once per combination and kept (a few dozen combinations in
        practice, bounded as the model labels are)."""
        try:
            key = (route, model, status)
            cells = self._exchange_cells.get(key)
            if cells is None:
                cells = self._cells_for(route, model, status)
            requests, duration, overhead, ttfb, usage_cells = cells
            requests[0] += 1
            if timed(status):
                self.request_duration.observe(duration, duration_s)
            self.overhead.observe(overhead, overhead_s)
            # A model's answer: not /v1/models, nor an error answer (a 429 comes at once, and
            # a storm of them would read as the provider getting faster).
            if ttfb_s is not None and route != "passthrough" and status < 400:
                self.ttfb.observe(ttfb, ttfb_s)
        except Exception:
            logger.exception("metrics: observe_exchange failed")
            return
        if usage is None:
            return
        if min(usage.prompt, usage.completion, usage.cache_read, usage.cache_write) < 0:
            self.observe_usage(model, usage)  # refuses and logs, as it always has
            return
        self._count_usage(usage_cells, usage, measured)

    def _seed_responses(self, label: str) -> None:
        """Create a model's duration histogram of the ``responses`` route at zero when its first
        Responses API request comes (24 series a model in every scrape, ~13% more, for a route
        a chat client never takes; its request counts are seeded at start, ``_seed_model``)."""
        if label in self._responses_seeded:
            return
        self._responses_seeded.add(label)
        self.request_duration.child("responses", label)

    def _cells_for(self, route: str, model: str | None, status: int) -> tuple[Any, ...]:
        label = self.model_label(model)
        if route == "responses":
            self._seed_responses(label)
        cells = (
            self.requests.child(route, label, str(status)),
            self.request_duration.child(route, label),
            self.overhead.child(route),
            self.ttfb.child(label),
            self._usage_cells(label),
        )
        if len(self._exchange_cells) < 4096 and (model is None or len(model) <= _NAME_KEPT):
            self._exchange_cells[(route, model, status)] = cells  # (clients choose models)
        return cells

    @_safe
    def observe_request(
        self, route: str, model: str | None, status: int, duration_s: float
    ) -> None:
        """Count one answered request and, for an answer (``timed``), its total duration."""
        label = self.model_label(model)
        if route == "responses":
            self._seed_responses(label)
        self.requests.child(route, label, str(status))[0] += 1
        if timed(status):
            duration = self.request_duration
            duration.observe(duration.child(route, label), duration_s)

    @_safe
    def observe_ttfb(self, model: str | None, s: float) -> None:
        """Record the time to the first byte relayed to the client."""
        ttfb = self.ttfb
        ttfb.observe(ttfb.child(self.model_label(model)), s)

    @_safe
    def observe_overhead(self, route: str, s: float) -> None:
        """Record the time cachegate itself spent on one request."""
        overhead = self.overhead
        overhead.observe(overhead.child(route), s)

    @_safe
    def observe_usage(self, model: str | None, usage: Usage, measured: bool = False) -> None:
        """Count the tokens of one exchange, in cachegate's and in the OpenTelemetry GenAI form.

        Cache token types enter the GenAI histogram only when the provider reported cache fields,
        so a provider that never reports does not read as a stream of misses.
        """
        if min(usage.prompt, usage.completion, usage.cache_read, usage.cache_write) < 0:
            raise ValueError(f"negative token count in {usage!r}")
        self._count_usage(self._usage_cells(self.model_label(model)), usage, measured)

    def _usage_cells(self, label: str) -> tuple[tuple[list[float], ...], tuple[list[float], ...]]:
        """The token counters (``TOKEN_KINDS`` order, then the prompt tokens of answers that
        reported their cache reads) and GenAI histogram series
        (``GEN_AI_TOKEN_TYPES`` order) of one model label."""
        gen_ai = self.gen_ai_token_usage
        return (
            (
                *(self.tokens.child(label, kind) for kind in TOKEN_KINDS),
                self.reported_prompt.child(label),
            ),
            tuple(gen_ai.child(GEN_AI_OPERATION, label, kind) for kind in GEN_AI_TOKEN_TYPES),
        )

    def _count_usage(
        self,
        cells: tuple[tuple[list[float], ...], tuple[list[float], ...]],
        usage: Usage,
        measured: bool = False,
    ) -> None:
        tokens, gen_ai = cells
        prompt, completion = usage.prompt, usage.completion
        read, write = usage.cache_read, usage.cache_write
        tokens[0][0] += prompt
        tokens[1][0] += completion
        tokens[2][0] += read
        tokens[3][0] += write
        observe = self.gen_ai_token_usage.observe
        observe(gen_ai[0], prompt)
        observe(gen_ai[1], completion)
        if usage.reported_cache or measured:  # (a hit ratio's denominator, as sessions list's)
            tokens[4][0] += prompt
        if usage.reported_cache:
            observe(gen_ai[2], read)
        if usage.reported_cache_write:  # OpenAI reports no writes: not a stream of zeros
            observe(gen_ai[3], write)

    @_safe
    def observe_cache_waste(self, model: str | None, cause: str, tokens: int) -> None:
        """Count prompt tokens that missed the provider cache, by cause."""
        cell = self.cache_waste.child(self.model_label(model), _check(cause, WASTE_CAUSES, "cause"))
        _add(cell, tokens)

    @_safe
    def observe_prefix_rewrite(self, location: str) -> None:
        """Count one request whose prefix was rewritten, at its first differing location."""
        self.prefix_rewrites.child(_check(location, REWRITE_LOCATIONS, "location"))[0] += 1

    @_safe
    def observe_repairs(self, kinds: Iterable[str]) -> None:
        """Count pairing repairs, one per item of ``kinds`` (repeat a kind to count it again)."""
        checked = [_check(kind, REPAIR_KINDS, "repair kind") for kind in kinds]
        for kind in checked:
            self.pairing_repairs.child(kind)[0] += 1

    @_safe
    def observe_strict_rejection(self) -> None:
        """Count one request rejected by strict pairing."""
        self.strict_rejections.child()[0] += 1

    @_safe
    def observe_compaction(self, model: str | None, result: str) -> None:
        """Count one compaction, by how its summary was obtained."""
        self.compactions.child(
            self.model_label(model), _check(result, COMPACTION_RESULTS, "compaction result")
        )[0] += 1

    @_safe
    def observe_cost(self, model: str | None, actual: float, uncached: float) -> None:
        """Add one exchange's cost in USD, as billed and as it would have been without the cache."""
        if actual < 0 or uncached < 0:
            raise ValueError(f"negative cost actual={actual!r} uncached={uncached!r}")
        cells = self._cost_cells.get(model)
        if cells is None:  # looked up once per model name (bounded, as the labels are)
            label = self.model_label(model)
            cells = (self.cost.child(label, "actual"), self.cost.child(label, "uncached"))
            if len(self._cost_cells) < 4096 and (model is None or len(model) <= _NAME_KEPT):
                self._cost_cells[model] = cells  # (model names come from clients: bounded)
        cells[0][0] += actual
        cells[1][0] += uncached

    @_safe
    def stream_started(self) -> None:
        """Mark one more response streaming to a client."""
        self.active_streams.child()[0] += 1

    @_safe
    def stream_finished(self) -> None:
        """Mark one stream ended, however it ended (call exactly once per ``stream_started``)."""
        self.active_streams.child()[0] -= 1

    @_safe
    def observe_client_disconnect(self) -> None:
        """Count one client that hung up before its response was complete."""
        self.client_disconnects.child()[0] += 1

    @_safe
    def observe_upstream_error(self, kind: str) -> None:
        """Count one upstream failure: connect, timeout, status, midstream, invalid or
        error_event."""
        self.upstream_errors.child(_check(kind, UPSTREAM_ERROR_KINDS, "upstream error kind"))[
            0
        ] += 1

    @_safe
    def observe_log_loss(self, kind: str, lines: int = 1) -> None:
        """Count event log lines lost: queue_full or write_error (from any thread)."""
        cell = self.log_lost.child(_check(kind, LOG_LOSS_KINDS, "log loss kind"))
        with self.log_lost.lock:
            _add(cell, lines)

    def observe_session_eviction(self, reason: str) -> None:
        """Count a session forgotten: idle, count or memory."""
        cell = self.session_evictions.child(
            _check(reason, SESSION_EVICTION_REASONS, "session eviction reason")
        )
        with self.session_evictions.lock:
            _add(cell, 1)

    def observe_sessions(self, held: int, held_bytes: int) -> None:
        """Set the sessions gauges (at scrape time)."""
        self.sessions.child()[0] = float(held)
        self.sessions_memory.child()[0] = float(held_bytes)


def _add(cell: list[float], amount: float) -> None:
    if amount < 0:
        raise ValueError(f"counters only go up; refusing {amount!r}")
    cell[0] += amount


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
        route = route_label(ex)
        if route != "passthrough":  # (a chat or Responses API answer: its model's)
            m.observe_exchange(
                route,
                ex.model,
                ex.status,
                ex.duration_s,
                ex.overhead_s,
                ex.ttfb_s,
                ex.usage if ex.status < 400 or route == "chat" else None,
                ex.cache_known,  # (the accounting's, which runs first)
            )
        else:  # (labelled "other": its body is not read for a model)
            m.observe_exchange(route, None, ex.status, ex.duration_s, ex.overhead_s, None, None)
        if ex.repairs:
            m.observe_repairs(str(r.get("kind")) for r in ex.repairs)
        if ex.upstream_error is not None:
            m.observe_upstream_error(ex.upstream_error)
        if ex.interrupted and not ex.stopped:  # the client left (not a shutdown's cut)
            m.observe_client_disconnect()

    def on_refused(self, ex: Exchange) -> None:
        """The provider refused an attempt as too long for its window, which cachegate then
        compacts and sends again (or answers with that refusal): an upstream answer >= 400."""
        self.metrics.observe_upstream_error("status")

    def on_summary_error(self, ex: Exchange, kind: str) -> None:
        """A compaction's summary call failed (``kind`` as for an exchange): the extractive
        summary stands in, and the failure is the upstream's all the same."""
        self.metrics.observe_upstream_error(kind)

    def on_error(self, ex: Exchange) -> None:
        route = route_label(ex)
        model = ex.model if route != "passthrough" else None  # (passthrough requests: "other")
        self.metrics.observe_request(route, model, ex.status, max(0.0, time.perf_counter() - ex.t0))
        if ex.interrupted and not ex.stopped:  # the client left before the request was forwarded
            self.metrics.observe_client_disconnect()
