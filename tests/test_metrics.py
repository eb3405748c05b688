"""Metrics: exact sample values and labels after scripted exchanges, on a fresh registry each."""

from __future__ import annotations

import itertools
import logging
import random
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from proxy.metrics import (
    COMPACTION_RESULTS,
    DURATION_BUCKETS,
    LOG_LOSS_KINDS,
    OVERHEAD_BUCKETS,
    REPAIR_KINDS,
    REQUEST_STATUSES,
    REWRITE_LOCATIONS,
    TOKEN_USAGE_BUCKETS,
    TTFB_BUCKETS,
    UPSTREAM_ERROR_KINDS,
    WASTE_CAUSES,
    Metrics,
    MetricsObserver,
    _Collector,
    _Family,
)
from proxy.pipeline import Exchange
from proxy.usage import Usage

MODELS = ("gpt-4o", "claude-sonnet-4", "*")


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> Metrics:
    return Metrics(registry, MODELS)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_model_label_passes_configured_names_and_bounds_the_rest(metrics: Metrics) -> None:
    assert metrics.model_label("gpt-4o") == "gpt-4o"
    assert metrics.model_label("claude-sonnet-4") == "claude-sonnet-4"
    assert metrics.model_label("gpt-4o-2024-08-06") == "gpt-4o"
    assert metrics.model_label("claude-sonnet-4-20250514") == "claude-sonnet-4"
    assert metrics.model_label("gpt-4") == "other"
    assert metrics.model_label("llama-3") == "other"
    assert metrics.model_label("*") == "other"
    assert metrics.model_label("") == "other"
    assert metrics.model_label(None) == "other"


def test_requests_count_by_route_model_and_status(
    metrics: Metrics, registry: CollectorRegistry
) -> None:
    metrics.observe_request("chat", "gpt-4o", 200, 1.5)
    metrics.observe_request("chat", "gpt-4o", 200, 0.2)
    metrics.observe_request("chat", "mystery-model", 400, 0.003)

    name = "cachegate_requests_total"
    assert value(registry, name, route="chat", model="gpt-4o", status="200") == 2.0
    assert value(registry, name, route="chat", model="other", status="400") == 1.0
    assert value(registry, name, route="chat", model="mystery-model", status="400") is None

    hist = "cachegate_request_duration_seconds"
    labels = {"route": "chat", "model": "gpt-4o"}
    assert value(registry, f"{hist}_count", **labels) == 2.0
    assert value(registry, f"{hist}_sum", **labels) == pytest.approx(1.7)
    assert value(registry, f"{hist}_bucket", le="0.25", **labels) == 1.0
    assert value(registry, f"{hist}_bucket", le="2.5", **labels) == 2.0
    assert value(registry, f"{hist}_bucket", le="600.0", **labels) == 2.0
    # A refusal is counted, but its few milliseconds are not a request's duration
    other = {"route": "chat", "model": "other"}
    assert value(registry, f"{hist}_count", **other) == 0


def test_request_duration_leaves_out_refusals_and_errors_but_not_a_client_leaving(
    metrics: Metrics, registry: CollectorRegistry
) -> None:
    """A storm of 429s (answered within milliseconds), or of clients giving up before any answer
    (499), must not pull the duration percentiles down just when the provider is in trouble; a
    stream the client cut short keeps its 200 and its time."""
    metrics.observe_request("chat", "gpt-4o", 200, 2.0)
    for status in (400, 429, 500, 502, 504):
        metrics.observe_request("chat", "gpt-4o", status, 0.002)
    metrics.observe_exchange("chat", "gpt-4o", 429, 0.001, 0.0001, 0.001, None)
    metrics.observe_exchange("chat", "gpt-4o", 499, 0.2, 0.0001, None, None)
    metrics.observe_exchange("chat", "gpt-4o", 200, 7.0, 0.0001, 0.4, None)  # cut mid-stream
    metrics.observe_exchange("passthrough", None, 404, 0.001, 0.0001, 0.001, None)
    metrics.observe_exchange("passthrough", None, 200, 0.3, 0.0001, 0.01, None)

    hist = "cachegate_request_duration_seconds"
    chat = {"route": "chat", "model": "gpt-4o"}
    assert value(registry, f"{hist}_count", **chat) == 2.0
    assert value(registry, f"{hist}_sum", **chat) == pytest.approx(9.0)
    assert value(registry, "cachegate_requests_total", status="429", **chat) == 2.0
    passthrough = {"route": "passthrough", "model": "other"}
    assert value(registry, f"{hist}_count", **passthrough) == 1.0
    assert value(registry, "cachegate_requests_total", status="404", **passthrough) == 1.0


def test_latency_buckets_read_a_typical_first_byte_closely(
    metrics: Metrics, registry: CollectorRegistry
) -> None:
    """First bytes of 0.30-0.41 s (an ordinary chat answer): the panel's interpolated p50 must
    land near 0.31 s, not at 0.375 as with buckets of 0.25, 0.5, 1."""
    rng = random.Random(7)
    samples = sorted(0.302 + rng.random() * 0.107 for _ in range(200))
    for s in samples:
        metrics.observe_ttfb("gpt-4o", s)
        metrics.observe_request("chat", "gpt-4o", 200, s + 2.8)
    true_p50 = samples[100]

    def p50(name: str, labels: dict[str, str]) -> float:
        bounds = TTFB_BUCKETS if "first_byte" in name else DURATION_BUCKETS
        counts = [value(registry, f"{name}_bucket", le=str(b), **labels) or 0 for b in bounds]
        rank = counts[-1] / 2
        lower, below = 0.0, 0.0
        for bound, count in zip(bounds, counts, strict=True):
            if count >= rank:  # Prometheus's linear interpolation inside the bucket
                return lower + (bound - lower) * (rank - below) / (count - below)
            lower, below = bound, count
        raise AssertionError("no bucket holds the median")

    ttfb = p50("cachegate_time_to_first_byte_seconds", {"model": "gpt-4o"})
    duration = p50("cachegate_request_duration_seconds", {"route": "chat", "model": "gpt-4o"})
    assert abs(ttfb - true_p50) / true_p50 < 0.2
    assert abs(duration - (true_p50 + 2.8)) / (true_p50 + 2.8) < 0.2
    for bounds in (TTFB_BUCKETS, DURATION_BUCKETS):
        inside = [b for b in bounds if 0.25 <= b <= 10.0]
        assert all(b / a <= 2.0 for a, b in itertools.pairwise(inside))


def test_histogram_buckets_suit_each_quantity(
    metrics: Metrics, registry: CollectorRegistry
) -> None:
    metrics.observe_overhead("chat", 0.00004)
    metrics.observe_overhead("chat", 0.0003)
    metrics.observe_ttfb("gpt-4o", 90.0)
    metrics.observe_request("chat", "gpt-4o", 200, 420.0)

    overhead = "cachegate_proxy_overhead_seconds_bucket"
    assert value(registry, overhead, route="chat", le="5e-05") == 1.0
    assert value(registry, overhead, route="chat", le="0.0005") == 2.0
    assert value(registry, overhead, route="chat", le="0.1") == 2.0
    ttfb = "cachegate_time_to_first_byte_seconds_bucket"
    assert value(registry, ttfb, model="gpt-4o", le="60.0") == 0.0
    assert value(registry, ttfb, model="gpt-4o", le="120.0") == 1.0
    # a non-streamed answer of a reasoning model: its first byte is its last, minutes on (past
    # 120 s, each was read as 120 s in a percentile)
    metrics.observe_ttfb("gpt-4o", 210.0)
    assert value(registry, ttfb, model="gpt-4o", le="120.0") == 1.0
    assert value(registry, ttfb, model="gpt-4o", le="300.0") == 2.0
    assert value(registry, ttfb, model="gpt-4o", le="600.0") == 2.0
    duration = "cachegate_request_duration_seconds_bucket"
    assert value(registry, duration, route="chat", model="gpt-4o", le="300.0") == 0.0
    assert value(registry, duration, route="chat", model="gpt-4o", le="600.0") == 1.0


def test_usage_counts_tokens_and_the_gen_ai_histogram(
    metrics: Metrics, registry: CollectorRegistry
) -> None:
    metrics.observe_usage(
        "gpt-4o",
        Usage(prompt=12000, completion=300, cache_read=10240, cache_write=0, reported_cache=True),
    )
    metrics.observe_usage("gpt-4o", Usage(prompt=500, completion=20))
    metrics.observe_usage(
        "unknown",
        Usage(
            prompt=7, completion=1, cache_write=5, reported_cache=True, reported_cache_write=True
        ),
    )

    tokens = "cachegate_tokens_total"
    assert value(registry, tokens, model="gpt-4o", kind="prompt") == 12500.0
    assert value(registry, tokens, model="gpt-4o", kind="completion") == 320.0
    assert value(registry, tokens, model="gpt-4o", kind="cache_read") == 10240.0
    assert value(registry, tokens, model="gpt-4o", kind="cache_write") == 0.0
    assert value(registry, tokens, model="other", kind="cache_write") == 5.0
    # a hit ratio's denominator: the prompt tokens of answers that said what was read from the
    # cache (the second, without cache fields, is no miss: vLLM's, Ollama's answers)
    reported = "cachegate_cache_reported_prompt_tokens_total"
    assert value(registry, reported, model="gpt-4o") == 12000.0
    assert value(registry, reported, model="other") == 7.0
    assert value(registry, reported, model="claude-sonnet-4") == 0.0

    usage = "gen_ai_client_token_usage"
    gpt = {"gen_ai_operation_name": "chat", "gen_ai_request_model": "gpt-4o"}
    assert value(registry, f"{usage}_count", gen_ai_token_type="input", **gpt) == 2.0
    assert value(registry, f"{usage}_sum", gen_ai_token_type="input", **gpt) == 12500.0
    assert value(registry, f"{usage}_sum", gen_ai_token_type="output", **gpt) == 320.0
    # The second exchange reported no cache fields: only the first counts as a cache observation.
    assert value(registry, f"{usage}_count", gen_ai_token_type="cached_input", **gpt) == 1.0
    assert value(registry, f"{usage}_sum", gen_ai_token_type="cached_input", **gpt) == 10240.0
    # OpenAI's usage has no cache-write field: no zeros that a p95 panel would draw as ~0.95
    assert value(registry, f"{usage}_count", gen_ai_token_type="cache_creation_input", **gpt) == 0
    assert value(registry, f"{usage}_bucket", le="16384.0", gen_ai_token_type="input", **gpt) == 2.0
    assert value(registry, f"{usage}_bucket", le="4096.0", gen_ai_token_type="input", **gpt) == 1.0
    other = {"gen_ai_operation_name": "chat", "gen_ai_request_model": "other"}
    assert value(registry, f"{usage}_sum", gen_ai_token_type="cache_creation_input", **other) == 5.0


def test_cache_waste_rewrites_repairs_and_compactions(
    metrics: Metrics, registry: CollectorRegistry
) -> None:
    metrics.observe_cache_waste("gpt-4o", "ttl_expired", 20000)
    metrics.observe_cache_waste("gpt-4o", "prefix_rewrite", 3000)
    metrics.observe_cache_waste("gpt-4o", "ttl_expired", 1500)
    metrics.observe_prefix_rewrite("tools")
    metrics.observe_prefix_rewrite("messages")
    metrics.observe_prefix_rewrite("messages")
    metrics.observe_repairs(["dangling_call", "dangling_call", "orphan_result"])
    metrics.observe_repairs([])
    metrics.observe_strict_rejection()
    metrics.observe_compaction("gpt-4o", "summary")
    metrics.observe_compaction("gpt-4o", "reused")
    metrics.observe_compaction("gpt-4o", "reused")

    waste = "cachegate_cache_waste_tokens_total"
    assert value(registry, waste, model="gpt-4o", cause="ttl_expired") == 21500.0
    assert value(registry, waste, model="gpt-4o", cause="prefix_rewrite") == 3000.0
    assert value(registry, waste, model="gpt-4o", cause="unexplained") == 0.0
    rewrites = "cachegate_prefix_rewrites_total"
    assert value(registry, rewrites, location="tools") == 1.0
    assert value(registry, rewrites, location="messages") == 2.0
    assert value(registry, rewrites, location="system") == 0.0
    repairs = "cachegate_pairing_repairs_total"
    assert value(registry, repairs, kind="dangling_call") == 2.0
    assert value(registry, repairs, kind="orphan_result") == 1.0
    assert value(registry, repairs, kind="invalid_arguments") == 0.0
    assert value(registry, "cachegate_strict_rejections_total") == 1.0
    compactions = "cachegate_compactions_total"
    assert value(registry, compactions, model="gpt-4o", result="summary") == 1.0
    assert value(registry, compactions, model="gpt-4o", result="reused") == 2.0
    assert value(registry, compactions, model="gpt-4o", result="extractive") == 0.0


def test_cost_streams_disconnects_upstream_errors_and_log_loss(
    metrics: Metrics, registry: CollectorRegistry
) -> None:
    metrics.observe_cost("gpt-4o", 0.0125, 0.05)
    metrics.observe_cost("gpt-4o", 0.0025, 0.0025)
    metrics.observe_cost("gpt-5-preview", 1.0, 2.0)
    metrics.observe_cost("gpt-4o-2024-08-06", 0.001, 0.001)  # a snapshot: gpt-4o's series
    for _ in range(3):
        metrics.stream_started()
    metrics.stream_finished()
    metrics.observe_client_disconnect()
    metrics.observe_upstream_error("timeout")
    metrics.observe_upstream_error("midstream")
    metrics.observe_upstream_error("midstream")
    metrics.observe_log_loss("queue_full")
    metrics.observe_log_loss("queue_full", 4)

    cost = "cachegate_cost_usd_total"
    assert value(registry, cost, model="gpt-4o", kind="actual") == pytest.approx(0.016)
    assert value(registry, cost, model="gpt-4o", kind="uncached") == pytest.approx(0.0535)
    assert value(registry, cost, model="other", kind="uncached") == 2.0
    assert value(registry, "cachegate_active_streams") == 2.0
    assert value(registry, "cachegate_client_disconnects_total") == 1.0
    errors = "cachegate_upstream_errors_total"
    assert value(registry, errors, kind="timeout") == 1.0
    assert value(registry, errors, kind="midstream") == 2.0
    assert value(registry, errors, kind="connect") == 0.0
    assert value(registry, "cachegate_event_log_lost_total", kind="queue_full") == 5.0
    assert value(registry, "cachegate_event_log_lost_total", kind="write_error") == 0.0


def test_every_status_cachegate_answers_itself_starts_at_zero() -> None:
    """The README's table of cachegate's own errors: the first of each shows in a rate (431,
    a head too large, was missing: its first counted nowhere in the dashboards)."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    own = set(re.findall(r"^\| (\d{3}) \| `", readme, flags=re.MULTILINE))
    assert {"400", "413", "431", "502", "504"} <= own
    assert own - {"405"} <= set(REQUEST_STATUSES)  # (405: the passthrough route's, seeded there)


def test_finite_label_sets_start_at_zero(metrics: Metrics, registry: CollectorRegistry) -> None:
    for model in ("gpt-4o", "claude-sonnet-4", "other"):
        for cause in WASTE_CAUSES:
            assert (
                value(registry, "cachegate_cache_waste_tokens_total", model=model, cause=cause) == 0
            )
        for result in COMPACTION_RESULTS:
            assert value(registry, "cachegate_compactions_total", model=model, result=result) == 0
        for kind in ("prompt", "completion", "cache_read", "cache_write"):
            assert value(registry, "cachegate_tokens_total", model=model, kind=kind) == 0
        assert value(registry, "cachegate_cache_reported_prompt_tokens_total", model=model) == 0
        for kind in ("actual", "uncached"):
            assert value(registry, "cachegate_cost_usd_total", model=model, kind=kind) == 0
        assert value(registry, "cachegate_time_to_first_byte_seconds_count", model=model) == 0
        for route in ("chat", "passthrough"):
            labels = {"route": route, "model": model}
            assert value(registry, "cachegate_proxy_overhead_seconds_count", route=route) == 0
            if route == "passthrough" and model != "other":
                # passthrough is labelled "other" (its body is not read for a model): a model's
                # series would never move, and took a counter and a histogram each in a scrape
                assert value(registry, "cachegate_requests_total", status="200", **labels) is None
                assert value(registry, "cachegate_request_duration_seconds_count", **labels) is None
                continue
            for status in ("200", "400", "402", "415", "422", "426", "429", "499", "500", "502"):
                # (the first error of each shows in a rate: 402, a provider's credits gone)
                assert value(registry, "cachegate_requests_total", status=status, **labels) == 0
            for status in ("503", "504", "529"):
                assert value(registry, "cachegate_requests_total", status=status, **labels) == 0
            # cachegate's own 405 (a method a relayed path does not take) is a passthrough's
            seeded = value(registry, "cachegate_requests_total", status="405", **labels)
            assert seeded == (0 if route == "passthrough" else None)
            assert value(registry, "cachegate_request_duration_seconds_count", **labels) == 0
    for location in REWRITE_LOCATIONS:
        assert value(registry, "cachegate_prefix_rewrites_total", location=location) == 0
    for kind in REPAIR_KINDS:
        assert value(registry, "cachegate_pairing_repairs_total", kind=kind) == 0
    for kind in UPSTREAM_ERROR_KINDS:
        assert value(registry, "cachegate_upstream_errors_total", kind=kind) == 0
    for kind in LOG_LOSS_KINDS:
        assert value(registry, "cachegate_event_log_lost_total", kind=kind) == 0
    assert value(registry, "cachegate_strict_rejections_total") == 0
    assert value(registry, "cachegate_client_disconnects_total") == 0
    assert value(registry, "cachegate_active_streams") == 0
    # "*" is the configuration fallback, never a label value.
    assert b'model="*"' not in generate_latest(registry)


def test_the_metric_set_and_label_names_match_the_design(
    metrics: Metrics, registry: CollectorRegistry
) -> None:
    expected = {
        ("cachegate_requests", "counter"): {"route", "model", "status"},
        ("cachegate_request_duration_seconds", "histogram"): {"route", "model"},
        ("cachegate_time_to_first_byte_seconds", "histogram"): {"model"},
        ("cachegate_proxy_overhead_seconds", "histogram"): {"route"},
        ("cachegate_tokens", "counter"): {"model", "kind"},
        # (added to the design's set: a hit ratio's denominator without the answers that say
        # nothing of the cache)
        ("cachegate_cache_reported_prompt_tokens", "counter"): {"model"},
        ("cachegate_cache_waste_tokens", "counter"): {"model", "cause"},
        ("cachegate_prefix_rewrites", "counter"): {"location"},
        ("cachegate_pairing_repairs", "counter"): {"kind"},
        ("cachegate_strict_rejections", "counter"): set(),
        ("cachegate_compactions", "counter"): {"model", "result"},
        ("cachegate_cost_usd", "counter"): {"model", "kind"},
        ("cachegate_active_streams", "gauge"): set(),
        ("cachegate_client_disconnects", "counter"): set(),
        ("cachegate_upstream_errors", "counter"): {"kind"},
        ("cachegate_event_log_lost", "counter"): {"kind"},
        ("cachegate_sessions", "gauge"): set(),
        ("cachegate_sessions_memory_bytes", "gauge"): set(),
        ("cachegate_session_evictions", "counter"): {"reason"},
        ("gen_ai_client_token_usage", "histogram"): {
            "gen_ai_operation_name",
            "gen_ai_request_model",
            "gen_ai_token_type",
        },
    }
    families = {(f.name, f.type): f for f in registry.collect()}
    assert set(families) == set(expected)
    for key, labels in expected.items():
        seen = {name for s in families[key].samples for name in s.labels if name != "le"}
        assert seen == labels, key
        assert not any("session" in name for name in seen), key


def test_bad_values_are_logged_never_raised_and_add_no_series(
    metrics: Metrics, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    before = generate_latest(registry)
    with caplog.at_level(logging.ERROR, logger="proxy.metrics"):
        metrics.observe_cache_waste("gpt-4o", "cosmic_rays", 10)
        metrics.observe_prefix_rewrite("sess-1234")
        metrics.observe_repairs(["dangling_call", "made_up"])
        metrics.observe_compaction("gpt-4o", "magic")
        metrics.observe_upstream_error("dns")
        metrics.observe_log_loss("eaten")
        metrics.observe_cost("gpt-4o", -1.0, 1.0)
        metrics.observe_usage("gpt-4o", Usage(prompt=-5))
        metrics.observe_cache_waste("gpt-4o", "ttl_expired", -3)
    assert len(caplog.records) == 9
    assert all(r.name == "proxy.metrics" for r in caplog.records)
    assert generate_latest(registry) == before


def exchange(**fields: object) -> Exchange:
    ex = Exchange(route="chat", method="POST", path="chat/completions", started_at=0.0, t0=0.0)
    for name, v in fields.items():
        setattr(ex, name, v)
    return ex


def test_a_hit_ratios_denominator_counts_what_sessions_list_counts(
    metrics: Metrics, registry: CollectorRegistry
) -> None:
    """Gemini's OpenAI endpoint leaves the cache fields out of a miss: the accounting counts it
    a read of 0 once the session's answers had them (``cache_known``), as `sessions list`
    does. Counting answers with fields only, the panels read 8,000 of 12,000 (66.7%) where the
    session read 8,000 of 26,000 (30.8%)."""
    observer = MetricsObserver(metrics)
    first = exchange(model="gpt-4o", status=200, usage=Usage(prompt=10_000, completion=5))
    hit = Usage(prompt=12_000, completion=5, cache_read=8_000, reported_cache=True)
    second = exchange(model="gpt-4o", status=200, usage=hit)
    third = exchange(model="gpt-4o", status=200, usage=Usage(prompt=14_000, completion=5))
    third.cache_known = True  # (the accounting's verdict: the session's answers had the fields)
    for ex in (first, second, third):
        observer.on_response(ex)
    reported = value(registry, "cachegate_cache_reported_prompt_tokens_total", model="gpt-4o")
    read = value(registry, "cachegate_tokens_total", model="gpt-4o", kind="cache_read")
    assert (read, reported) == (8_000, 26_000)


def test_a_responses_answer_without_cache_fields_counts_in_the_hit_ratio_as_chats_do(
    metrics: Metrics, registry: CollectorRegistry
) -> None:
    """A Responses API answer without ``input_tokens_details`` after answers of its session
    that had them is a read of 0 in the denominator, as on the chat route and in `sessions
    list` (the dashboard's Responses hit ratio read 51.2% where the session's was 25.6%)."""
    observer = MetricsObserver(metrics)
    hit = Usage(prompt=2_000, completion=5, cache_read=1_024, reported_cache=True)
    miss = Usage(prompt=2_000, completion=5)
    for usage in (hit, miss, hit, miss):
        ex = exchange(route="passthrough", path="responses", method="POST", model="gpt-4o")
        ex.status, ex.usage, ex.cache_known = 200, usage, True
        observer.on_response(ex)
    reported = value(registry, "cachegate_cache_reported_prompt_tokens_total", model="gpt-4o")
    assert reported == 8_000


def test_a_responses_api_request_is_counted_under_its_model_and_route(
    metrics: Metrics, registry: CollectorRegistry
) -> None:
    """A Responses API request (Codex CLI's every request) was counted as a passthrough of the
    model "other": its model's request rate, error ratio, duration and overhead panels showed
    nothing of it, where its tokens and cost were its model's."""
    observer = MetricsObserver(metrics)
    for path, status in (("responses", 200), ("responses/compact", 200), ("responses", 429)):
        ex = exchange(route="passthrough", path=path, method="POST", model="gpt-4o")
        ex.status, ex.duration_s, ex.overhead_s = status, 2.0, 0.0004
        ex.usage = Usage(prompt=1_000, completion=10) if status == 200 else None
        observer.on_response(ex)
    gone = exchange(route="passthrough", path="responses", method="POST", model="gpt-4o")
    gone.status = 499  # the client left before the answer
    observer.on_error(gone)
    retrieve = exchange(route="passthrough", path="responses/resp_1", method="GET", model=None)
    retrieve.status = 200
    observer.on_response(retrieve)
    labels = {"route": "responses", "model": "gpt-4o"}
    requests = "cachegate_requests_total"
    assert value(registry, requests, status="200", **labels) == 2.0
    assert value(registry, requests, status="429", **labels) == 1.0
    assert value(registry, requests, status="499", **labels) == 1.0
    assert value(registry, "cachegate_request_duration_seconds_count", **labels) == 2.0
    assert value(registry, "cachegate_proxy_overhead_seconds_count", route="responses") == 3.0
    assert value(registry, "cachegate_tokens_total", model="gpt-4o", kind="prompt") == 2_000
    # another path of the Responses API (a stored response read back) is a passthrough's
    assert value(registry, requests, route="passthrough", model="other", status="200") == 1.0
    # the route's counts of every model start at zero (seeded on a model's first request, the
    # requests until the next scrape were in no rate(): a Codex session's first burst); its
    # duration histogram with its first request, not before: a chat client's scrape keeps
    # 24 series a model fewer
    assert value(registry, requests, status="500", **labels) == 0.0
    unused = {"route": "responses", "model": "claude-sonnet-4"}
    assert value(registry, requests, status="200", **unused) == 0.0
    assert value(registry, requests, status="429", route="responses", model="other") == 0.0
    assert value(registry, "cachegate_request_duration_seconds_count", **unused) is None


def test_a_remote_compactions_first_byte_is_timed_as_a_responses_answer(
    metrics: Metrics, registry: CollectorRegistry
) -> None:
    observer = MetricsObserver(metrics)
    for path in ("responses", "responses/compact", "models"):
        ex = exchange(route="passthrough", path=path, method="POST", model="gpt-4o")
        ex.status, ex.ttfb_s = 200, 0.4
        observer.on_response(ex)
    assert value(registry, "cachegate_time_to_first_byte_seconds_count", model="gpt-4o") == 2.0


def test_long_model_names_are_not_kept_by_the_label_caches(metrics: Metrics) -> None:
    """A client's model name can be as long as its body: 600 distinct names of 1 MB held 1.2 GB
    in the metrics' caches, though each was labelled ``other`` (bounded in count only)."""
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(50):
            name = f"m{i}" + "x" * 200_000
            metrics.observe_exchange("chat", name, 200, 0.1, 0.001, 0.05, None)
            metrics.observe_cost(name, 0.0, 0.0)
            assert metrics.model_label(name) == "other"
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1_000_000, held  # (10 MB of names went by: none kept)
    assert metrics.model_label("gpt-4o") == "gpt-4o"


def test_observer_turns_exchanges_into_metrics(
    metrics: Metrics, registry: CollectorRegistry
) -> None:
    observer = MetricsObserver(metrics)
    streamed = exchange(
        model="gpt-4o-2024-08-06",
        stream=True,
        status=200,
        duration_s=2.0,
        ttfb_s=0.3,
        overhead_s=0.0002,
        usage=Usage(prompt=2000, completion=50, cache_read=1024, reported_cache=True),
        repairs=[{"kind": "dangling_call"}, {"kind": "missing_id"}],
    )
    observer.on_request(streamed)
    assert value(registry, "cachegate_active_streams") == 1.0
    observer.on_response(streamed)
    cut = exchange(model="gpt-4o", stream=True, status=200, duration_s=1.0, interrupted=True)
    observer.on_request(cut)
    observer.on_response(cut)
    stopped = exchange(model="gpt-4o", stream=True, status=200, interrupted=True, stopped=True)
    observer.on_request(stopped)  # cut by cachegate's own shutdown: no client disconnect
    observer.on_response(stopped)
    failed = exchange(route="passthrough", path="models", method="GET", status=504)
    failed.upstream_error = "timeout"
    observer.on_request(failed)
    observer.on_response(failed)
    observer.on_error(exchange(model="llama", status=400))

    assert value(registry, "cachegate_active_streams") == 0.0
    requests = "cachegate_requests_total"
    assert value(registry, requests, route="chat", model="gpt-4o", status="200") == 3.0
    assert value(registry, requests, route="passthrough", model="other", status="504") == 1.0
    assert value(registry, requests, route="chat", model="other", status="400") == 1.0
    assert value(registry, "cachegate_time_to_first_byte_seconds_count", model="gpt-4o") == 1.0
    overhead = "cachegate_proxy_overhead_seconds_bucket"
    assert value(registry, overhead, route="chat", le="0.00025") == 3.0
    assert value(registry, "cachegate_tokens_total", model="gpt-4o", kind="cache_read") == 1024.0
    assert value(registry, "cachegate_pairing_repairs_total", kind="dangling_call") == 1.0
    assert value(registry, "cachegate_pairing_repairs_total", kind="missing_id") == 1.0
    assert value(registry, "cachegate_upstream_errors_total", kind="timeout") == 1.0
    assert value(registry, "cachegate_client_disconnects_total") == 1.0


def _exposition(registry: CollectorRegistry) -> list[str]:
    """The text exposition with the ``_created`` timestamps (creation times) masked."""
    lines = generate_latest(registry).decode().splitlines()
    return [
        line.rsplit(" ", 1)[0] + " T" if "_created" in line and not line.startswith("#") else line
        for line in lines
    ]


@pytest.mark.parametrize(
    ("bounds", "values"),
    [
        (TOKEN_USAGE_BUCKETS, [0, 1, 3, 4, 16777216, 10**9, 65536.5]),
        (OVERHEAD_BUCKETS, [0.0, 0.00005, 0.000051, 0.1, 0.2, 1e-9]),
        (DURATION_BUCKETS, [600.0, 600.0001, 0.01, 2.5, 3]),
    ],
)
def test_plain_families_expose_what_prometheus_client_would(
    bounds: tuple[float, ...], values: list[float]
) -> None:
    """cachegate keeps its series as plain numbers; the scrape must read exactly as
    prometheus_client's own Counter, Gauge and Histogram would for the same updates, bucket
    edges (``le`` is inclusive) and ``le`` spellings included."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    hist = _Family("histogram", "x_seconds", "Help.", ["route"], bounds)
    count = _Family("counter", "x_events", "Help.", ["kind"])
    gauge = _Family("gauge", "x_open", "Help.")
    ours.register(_Collector([hist, count, gauge]))
    ref_hist = Histogram("x_seconds", "Help.", ["route"], buckets=bounds, registry=theirs)
    ref_count = Counter("x_events", "Help.", ["kind"], registry=theirs)
    ref_gauge = Gauge("x_open", "Help.", registry=theirs)
    for v in values:
        hist.observe(hist.child("chat"), v)
        ref_hist.labels("chat").observe(v)
        count.child("a")[0] += v
        ref_count.labels("a").inc(v)
    count.child("b")
    ref_count.labels("b")
    gauge.child()[0] += 2
    gauge.child()[0] -= 1
    ref_gauge.inc(2)
    ref_gauge.dec()
    assert _exposition(ours) == _exposition(theirs)


def test_nan_and_the_created_switch_behave_as_in_prometheus_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prometheus_client import metrics as prometheus_metrics

    for created in (True, False):
        monkeypatch.setattr(prometheus_metrics, "_use_created", created)
        ours, theirs = CollectorRegistry(), CollectorRegistry()
        hist = _Family("histogram", "y_seconds", "Help.", ["route"], OVERHEAD_BUCKETS)
        count = _Family("counter", "y_events", "Help.", ["kind"])
        ours.register(_Collector([hist, count]))
        ref_hist = Histogram(
            "y_seconds", "Help.", ["route"], buckets=OVERHEAD_BUCKETS, registry=theirs
        )
        ref_count = Counter("y_events", "Help.", ["kind"], registry=theirs)
        for v in (0.0001, float("nan"), 0.2):
            hist.observe(hist.child("chat"), v)
            ref_hist.labels("chat").observe(v)
        count.child("a")[0] += 1
        ref_count.labels("a").inc()
        assert _exposition(ours) == _exposition(theirs)
        assert any("_created" in line for line in _exposition(ours)) is created


def test_observe_exchange_is_the_four_separate_observations() -> None:
    """The per-exchange shortcut the observer takes exposes exactly what observe_request,
    observe_overhead, observe_ttfb and observe_usage would, for every kind of exchange."""
    cases = [
        ("chat", "gpt-4o", 200, 0.8, 0.0003, 0.2, Usage(1200, 80, 1024, 0, True)),
        ("chat", "gpt-4o-2024-08-06", 200, 2.5, 0.0001, 0.05, Usage(10, 5, 0, 0, False)),
        ("chat", "mystery", 502, 0.01, 0.00002, None, None),
        ("chat", "mystery", 429, 0.002, 0.00002, 0.001, None),  # the provider's instant refusal
        ("passthrough", None, 200, 0.004, 0.00001, 0.003, None),
        ("chat", "gpt-4o", 200, float("nan"), 0.0, 0.1, Usage(5, 1, 0, 7, True)),
        ("chat", "gpt-4o", 200, 0.3, 0.0002, 0.1, Usage(-1, 3, 0, 0, True)),  # refused usage
        ("chat", "gpt-4o", 200, 1.0, 0.0004, 0.6, Usage(99999999, 3, 5, 0, True)),
    ]
    a_reg, b_reg = CollectorRegistry(), CollectorRegistry()
    a, b = Metrics(a_reg, ["gpt-4o", "*"]), Metrics(b_reg, ["gpt-4o", "*"])
    for _ in range(2):  # the second time through, from the kept series
        for route, model, status, duration, overhead, ttfb, usage in cases:
            a.observe_exchange(route, model, status, duration, overhead, ttfb, usage)
            b.observe_request(route, model, status, duration)
            b.observe_overhead(route, overhead)
            if ttfb is not None and route == "chat" and status < 400:  # an answer's only
                b.observe_ttfb(model, ttfb)
            if usage is not None:
                b.observe_usage(model, usage)

    def exposition(registry: CollectorRegistry) -> list[str]:
        lines = generate_latest(registry).decode().splitlines()
        return [line for line in lines if "_created" not in line]

    assert exposition(a_reg) == exposition(b_reg)
    assert 'cachegate_requests_total{model="gpt-4o",route="chat",status="200"} 10.0' in (
        exposition(a_reg)
    )
    # the passthrough request's first byte is no model's answer: not in the TTFB histogram
    assert 'cachegate_time_to_first_byte_seconds_count{model="other"} 0.0' in exposition(a_reg)
    # nor is an error answer's (a storm of instant 429s would read as a faster provider)
    assert value(a_reg, "cachegate_requests_total", route="chat", model="other", status="429") == 2


@pytest.mark.parametrize("created", [True, False])
def test_the_scrape_is_exactly_what_prometheus_client_writes(
    monkeypatch: pytest.MonkeyPatch, created: bool
) -> None:
    """``/metrics`` is written by cachegate itself (prometheus_client's writer took ~50 ms on the
    event loop for the built-in models' ~4,000 lines): byte for byte the same text, escapes,
    float spellings, bucket order and ``_created`` blocks included."""
    from prometheus_client import metrics as prometheus_metrics

    from proxy.config import DEFAULT_MODELS

    monkeypatch.setattr(prometheus_metrics, "_use_created", created)
    registry = CollectorRegistry()
    models = [*DEFAULT_MODELS, 'we"ird\\model\nname']
    metrics = Metrics(registry, models)
    assert metrics.exposition() == generate_latest(registry)  # every series at zero
    observer = MetricsObserver(metrics)
    cases = [
        ("gpt-4o-2024-08-06", 200, 0.8, 0.0003, Usage(1200, 80, 1024, 0, True)),
        ('we"ird\\model\nname', 429, 1e-7, float("nan"), None),
        ("mystery", 502, 12_345_678.9, 0.5, Usage(3_000_000, 2_000_000, 0, 0, False)),
    ]
    for model, status, duration, overhead, usage in cases:
        ex = exchange(
            model=model, status=status, duration_s=duration, overhead_s=overhead, usage=usage
        )
        observer.on_request(ex)
        observer.on_response(ex)
    metrics.observe_cost("gpt-4o", 0.1 + 0.2, 1e-9)
    metrics.observe_cache_waste("gpt-4o", "ttl_expired", 2_000_001)
    metrics.observe_sessions(3, 7_340_032)
    scrape = metrics.exposition()
    assert scrape == generate_latest(registry)
    other = Counter("other_things", "Another collector's.", registry=registry)
    other.inc()
    assert metrics.scrape(registry) == generate_latest(registry)  # ours first, then the rest
    assert b'cachegate_request_duration_seconds_count{model="gpt-4o",route="chat"} 1.0' in scrape
    assert b'cachegate_tokens_total{kind="prompt",model="other"} 3e+06' in scrape
    assert b'model="we\\"ird\\\\model\\nname"' in scrape
