"""Dashboards: load, unique panel ids, every query names only metrics cachegate exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.metrics import Metrics

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
DASHBOARD_FILES = sorted(DASHBOARDS.glob("*.json"))
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# PromQL words that look like identifiers but are not metric names.
KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "inf", "nan",
}  # fmt: skip
# Parts of an expression that hold no metric name: strings, label matchers, ranges, grouping lists.
NOT_NAMES = re.compile(
    r'"(?:[^"\\]|\\.)*"|\{[^}]*\}|\[[^\]]*\]'
    r"|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
)
IDENTIFIER = re.compile(r"(?<![\w.:$])([A-Za-z_:][\w:]*)(\s*\()?")


def exported_series() -> dict[str, set[str]]:
    """Every series name a ``Metrics`` exposes, with the label names of its family."""
    registry = CollectorRegistry()
    Metrics(registry, ["gpt-4o"])
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    series: dict[str, set[str]] = {}
    for family in registry.collect():
        labels = {name for s in family.samples for name in s.labels if name != "le"}
        for suffix in suffixes[family.type]:
            series[family.name + suffix] = labels
    return series


SERIES = exported_series()


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (function names and keywords excluded)."""
    stripped = NOT_NAMES.sub(" ", expr)
    return {
        m.group(1)
        for m in IDENTIFIER.finditer(stripped)
        if m.group(2) is None and m.group(1) not in KEYWORDS
    }


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def targets(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for p in panels(dashboard) for t in p.get("targets", [])]


def test_both_dashboards_exist() -> None:
    assert [p.name for p in DASHBOARD_FILES] == ["cachegate.json", "laptop.json"]


def test_metric_name_parser() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, kind) (rate(cachegate_x_bucket{model=~"$model", '
        'kind="a b"}[$__rate_interval]))) / on (kind) group_left (status) (up or vector(1e-9))'
    )
    assert metric_names(expr) == {"cachegate_x_bucket", "up"}


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_dashboard_shape(path: Path) -> None:
    dashboard = load(path)
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"].startswith("cachegate")
    assert dashboard["id"] is None
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["description"].strip(), panel["title"]
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_coloured_panels_set_their_own_thresholds(path: Path) -> None:
    """A stat or bar gauge panel colours its value by thresholds, and Grafana's default ones
    (green, red from 80) were in force: a day's 80th request, $80 saved or 80 streams turned
    red, and a hit ratio (0 to 1) stayed green at 0%. Each sets its own: a ratio's steps
    within 0 to 1, red below a half; a count's and an amount's one colour."""
    for panel in panels(load(path)):
        if panel["type"] not in ("stat", "bargauge", "gauge"):
            continue
        defaults = panel["fieldConfig"]["defaults"]
        steps = defaults["thresholds"]["steps"]
        assert steps and steps[0]["value"] is None, panel["title"]
        if defaults.get("unit") == "percentunit":
            assert steps[0]["color"] == "red", panel["title"]
            assert all(0 < s["value"] <= 1 for s in steps[1:]), panel["title"]
        else:
            assert len(steps) == 1, panel["title"]


def test_dashboard_uids_differ() -> None:
    assert len({load(p)["uid"] for p in DASHBOARD_FILES}) == len(DASHBOARD_FILES)


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_every_query_uses_only_exported_metrics(path: Path) -> None:
    for target in targets(load(path)):
        names = metric_names(target["expr"])
        assert names, target["expr"]
        assert names <= set(SERIES), (target["expr"], names - set(SERIES))


def test_overview_has_a_model_variable_that_every_model_labelled_query_honours() -> None:
    dashboard = load(DASHBOARDS / "cachegate.json")
    model = {v["name"]: v for v in dashboard["templating"]["list"]}["model"]
    assert model["type"] == "query"
    assert model["datasource"] == DATASOURCE
    assert model["query"]["query"] == "label_values(cachegate_requests_total, model)"
    assert model["includeAll"] is True
    assert model["allValue"] == ".*"
    for target in targets(dashboard):
        expr = target["expr"]
        for name in metric_names(expr):
            if "model" in SERIES[name]:
                assert re.search(rf'{name}{{(route=~"chat\|responses", )?model=~"\$model"', expr), (
                    expr
                )
            elif "gen_ai_request_model" in SERIES[name]:
                assert f'{name}{{gen_ai_request_model=~"$model"' in expr, expr


def test_overview_shows_every_metric_family() -> None:
    queried = {
        n for t in targets(load(DASHBOARDS / "cachegate.json")) for n in metric_names(t["expr"])
    }
    families = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in SERIES}
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in queried}
    assert shown == families


def test_histogram_quantiles_aggregate_rates_by_le() -> None:
    for path in DASHBOARD_FILES:
        for target in targets(load(path)):
            expr = target["expr"]
            if "histogram_quantile" in expr:
                assert re.search(r"sum by \(le\b[^)]*\) \(rate\(\w+_bucket[{\[]", expr), expr


def test_counts_over_time_are_bars_of_their_own_interval() -> None:
    """A graph of how many of something happened: each point a count over the window before it
    (``increase`` over ``$__rate_interval``, the panel's interval not fixed), one event showed at
    four points in a row, as the windows overlapped, and differently at each zoom; ``increase``
    over ``$__interval`` lost what happened between one bar's last scrape and the next one's
    first (a quarter of single events at 15 s scrapes); the counter less its value an interval
    before lost what a restart reset and drew a counter's whole total after a gap in scraping.
    Bars of a fixed minute (or more, zoomed out) over ``$__rate_interval``, the interval and one
    scrape more: consecutive windows share one sample, so each increment falls in one bar
    (Grafana's $__rate_interval is the interval and the data source's scrape interval, unless
    the query sets a minimum step of its own, which it takes for the scrape interval)."""
    bars = 0
    for path in DASHBOARD_FILES:
        for panel in panels(load(path)):
            for target in panel.get("targets", []):
                expr = target["expr"]
                if "increase(" not in expr or "[$__range]" in expr:
                    continue  # (over the whole range: a stat, one figure)
                bars += 1
                assert "[$__rate_interval]" in expr, (panel["title"], expr)
                assert "offset" not in expr, (panel["title"], expr)
                assert panel["fieldConfig"]["defaults"]["custom"]["drawStyle"] == "bars"
                # The panel's minimum interval, a minute (4 scrapes at least). Not the query's
                # own (its "Min step"): Grafana takes that for the scrape interval, and
                # $__rate_interval came to 4 minutes, each event drawn in four bars.
                assert panel["interval"] == "1m" and "interval" not in target
    assert bars >= 2


def test_latency_panels_show_model_requests_only() -> None:
    """/v1/models and embeddings answer in a millisecond: mixed in, they would pull a chat
    model's percentiles down (passthrough requests carry the model label "other"). Chat and
    Responses API requests are both a model's (a Codex CLI user's panels showed no data)."""
    dashboard = load(DASHBOARDS / "cachegate.json")
    for target in targets(dashboard):
        for name in metric_names(target["expr"]):
            if name.startswith(("cachegate_request_duration", "cachegate_proxy_overhead")):
                assert f'{name}{{route=~"chat|responses"' in target["expr"], target["expr"]


def test_the_session_memory_panel_gives_the_estimate_the_code_makes() -> None:
    """The panel's description, and the example configuration's comment, said 768 bytes a
    message after the estimate became 1,152."""
    from proxy.sessions import BYTES_HELD_PER_MESSAGE, BYTES_HELD_PER_PART

    figure = f"{BYTES_HELD_PER_MESSAGE:,} bytes"
    part = f"{BYTES_HELD_PER_PART:,}"
    panels = [
        p
        for p in load(DASHBOARDS / "cachegate.json")["panels"]
        if any("cachegate_sessions_memory_bytes" in t.get("expr", "") for t in p.get("targets", []))
    ]
    assert panels and all(figure in p["description"] for p in panels)
    assert all(f"{part} per content part" in p["description"] for p in panels)
    example = (DASHBOARDS.parent / "config" / "cachegate.example.toml").read_text()
    assert f"{figure} a message and {part} a content part" in example
