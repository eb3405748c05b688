"""A real Prometheus scrapes a cachegate serving a scripted session against the simulator; every
PromQL expression of every dashboard must parse and return data through Prometheus' HTTP API.

Needs Debian's ``prometheus`` package (the ``prometheus`` binary on PATH; ``.ci/run`` installs it).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config import settings_from_mapping
from proxy.serving import ServerThread
from proxy.simulator.app import run_simulator

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
# What Grafana would put in place of the dashboard variables.
SUBSTITUTIONS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "5m", "$model": ".*"}
# Long enough that the simulated provider caches a prefix (it caches whole blocks of tokens).
SYSTEM = "You are a careful coding agent. " + " ".join(f"rule{i} applies." for i in range(1500))
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL with the variables substituted) for every target."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for variable, value in SUBSTITUTIONS.items():
                    expr = expr.replace(variable, value)
                out.append((path.name, panel["title"], expr))
    return out


def run_session(base_url: str) -> None:
    """A short agent session: streamed turns over a growing history, a tool round-trip, a
    history with a dangling tool call (repaired), a strict rejection and two upstream faults."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Read setup.py and tell me what it does."},
    ]
    headers = {"X-Session-Id": "live-metrics", "Authorization": "Bearer sk-test"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
        for turn in range(3):
            body = {"model": "gpt-4o", "messages": messages, "tools": TOOLS, "stream": True}
            with client.stream("POST", "/chat/completions", json=body) as response:
                assert response.status_code == 200
                response.read()
            messages = [
                *messages,
                {"role": "assistant", "content": f"Turn {turn} done."},
                {"role": "user", "content": f"Continue with step {turn + 1}."},
            ]
        dangling = [
            *messages,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "setup.py"}'},
                    }
                ],
            },
            {"role": "user", "content": "Never mind, summarize instead."},
        ]
        body = {"model": "gpt-4o", "messages": dangling, "tools": TOOLS}
        repaired = client.post("/chat/completions", json=body)
        assert repaired.status_code == 200
        assert repaired.headers["x-cachegate-repairs"] != "0"
        rejected = client.post("/chat/completions", json=body, headers={"X-Cachegate-Strict": "1"})
        assert rejected.status_code == 400
        body = {"model": "gpt-4o-mini", "messages": messages}
        failed = client.post("/chat/completions", json=body, headers={"X-Sim-Fault": "500"})
        assert failed.status_code == 500
        with (
            client.stream(
                "POST",
                "/chat/completions",
                json={**body, "stream": True},
                headers={"X-Sim-Fault": "reset"},
            ) as response,
            pytest.raises(httpx.HTTPError),
        ):
            response.read()
        assert client.get("/models").status_code == 200


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """Start ``prometheus`` on a free loopback port; yields its URL and a target setter."""
    binary = shutil.which("prometheus")
    assert binary is not None, "the prometheus binary is needed: apt-get install prometheus"
    port = free_port()
    config = tmp_path / "prometheus.yml"
    log = (tmp_path / "prometheus.log").open("wb")
    process: subprocess.Popen[bytes] | None = None

    def start(target: str) -> None:
        nonlocal process
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: cachegate\n    static_configs:\n"
            f'      - targets: ["{target}"]\n',
            encoding="utf-8",
        )
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    try:
        yield f"http://127.0.0.1:{port}", start
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


def query(client: httpx.Client, expr: str, at: float | None = None) -> dict[str, Any]:
    """``expr`` evaluated now, or at ``at`` (a Unix time: queries compared with one another are
    evaluated at one instant, their rates' windows alike)."""
    params: dict[str, Any] = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    response = client.get("/api/v1/query", params=params)
    payload: dict[str, Any] = response.json()
    assert response.status_code == 200 and payload["status"] == "success", (expr, payload)
    return payload["data"]


def wait_for_restart_scrape(client: httpx.Client, timeout_s: float = 20.0) -> None:
    """Wait until Prometheus has scraped the restarted server's evictions counter at 0. A
    counter that restarts and passes its old value before its first scrape reads to Prometheus
    as one that went on counting (3, then 4: one eviction, not four); no query can tell, so
    the test makes its evictions after that scrape, as a restarted server's come, spread out
    over time (a CI run under load once scraped the new server only after all four)."""
    deadline = time.monotonic() + timeout_s
    expr = 'cachegate_session_evictions_total{reason="count"}'
    while True:
        result = query(client, expr)["result"]
        if result and float(result[0]["value"][1]) == 0:
            return
        assert time.monotonic() < deadline, "Prometheus did not scrape the restarted server"
        time.sleep(0.1)


def wait_for_scrapes(client: httpx.Client, n: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = query(client, 'count_over_time(up{job="cachegate"}[1m])')["result"]
            if result and float(result[0]["value"][1]) >= n:
                return
        except httpx.TransportError:
            pass  # Prometheus is still starting
        assert time.monotonic() < deadline, f"Prometheus did not scrape cachegate {n} times"
        time.sleep(0.25)


@contextlib.contextmanager
def scraped_cachegate(
    tmp_path: Path, prometheus: tuple[str, Any]
) -> Iterator[tuple[ServerThread, httpx.Client]]:
    """A cachegate in front of the simulator, scraped by ``prometheus`` (seen once at zero),
    and a client of Prometheus' HTTP API."""
    prometheus_url, start_prometheus = prometheus
    with run_simulator() as sim:
        settings = settings_from_mapping(
            {"upstream": {"base_url": sim.api_base}, "logging": {"dir": str(tmp_path / "logs")}}
        )
        app = create_app(settings, registry=CollectorRegistry(), environ={})
        with ServerThread(app) as server, httpx.Client(base_url=prometheus_url) as prom:
            start_prometheus(f"127.0.0.1:{server.port}")
            wait_for_scrapes(prom, 1)
            yield server, prom


def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    tmp_path: Path, prometheus: tuple[str, Any]
) -> None:
    prometheus_url, start_prometheus = prometheus
    with run_simulator() as sim:
        settings = settings_from_mapping(
            {"upstream": {"base_url": sim.api_base}, "logging": {"dir": str(tmp_path / "logs")}}
        )
        registry = CollectorRegistry()
        app = create_app(settings, registry=registry, environ={})
        assert any(f.name.startswith("cachegate_") for f in registry.collect()), (
            "create_app registers no cachegate metrics: wire proxy.metrics into the app"
        )
        with ServerThread(app) as server, httpx.Client(base_url=prometheus_url) as prom:
            start_prometheus(f"127.0.0.1:{server.port}")
            # Counters are seen at zero first, so the session's traffic shows up as increases.
            wait_for_scrapes(prom, 1)
            run_session(server.url + "/v1")
            wait_for_scrapes(prom, 4)
            up = query(prom, 'up{job="cachegate"}')["result"]
            assert [r["value"][1] for r in up] == ["1"]

            queries = dashboard_queries()
            assert len(queries) >= 30
            # No series, or only NaN (a ratio or quantile over nothing), leaves a panel blank.
            empty = [
                (name, title, expr)
                for name, title, expr in queries
                if all(r["value"][1] == "NaN" for r in query(prom, expr)["result"])
            ]
            assert not empty, "dashboard queries that returned no data:\n" + "\n".join(
                f"  {name} / {title}: {expr}" for name, title, expr in empty
            )


def test_a_responses_api_client_fills_its_models_request_and_latency_panels(
    tmp_path: Path, prometheus: tuple[str, Any], sdk: Any
) -> None:
    """A client that speaks the Responses API only (Codex CLI): its requests were counted as
    passthrough ones of the model "other", so the request rate, error ratio, request duration
    and proxy overhead panels showed nothing of a model whose tokens and cost they did show.
    With the model selected, each of those panels now has its requests (from its second: the
    model's first Responses API request creates the route's series, scraped before the next)."""
    with scraped_cachegate(tmp_path, prometheus) as (server, prom):
        client = sdk(server.url + "/v1", default_headers={"session_id": "codex-live"})
        items: list[Any] = [{"role": "user", "content": "Read setup.py"}]
        for turn, stream in enumerate((False, False, True, False)):
            answer = client.responses.create(model="gpt-5", input=items, stream=stream)
            if stream:
                list(answer)
            if turn == 0:
                wait_for_scrapes(prom, 3)
        wait_for_scrapes(prom, 6)
        panels = {
            title: expr.replace('model=~".*"', 'model=~"gpt-5"')
            for _, title, expr in dashboard_queries()
            if any(
                name in expr
                for name in (
                    "cachegate_requests_total",
                    "cachegate_request_duration_seconds",
                    "cachegate_proxy_overhead_seconds",
                )
            )
        }
        assert len(panels) >= 3
        blank = [
            title
            for title, expr in panels.items()
            if all(r["value"][1] == "NaN" for r in query(prom, expr)["result"])
        ]
        assert not blank, blank


def test_a_bar_panel_counts_each_event_once_across_a_restart(
    tmp_path: Path, prometheus: tuple[str, Any]
) -> None:
    """The bars of forgotten sessions (as of lost log lines), queried as Grafana does, one
    point an interval: ``increase`` over ``$__interval`` lost what happened between one bar's
    last scrape and the next one's first (6.24 of 7 here), and the counter less its value an
    interval before lost what a restart reset (8 of 18 in a review). Over the interval and one
    scrape more, every event is in a bar, a restart's too; Prometheus extrapolates each bar to
    its ends, so they may read high: by a third at most for 3 s bars of 1 s scrapes, a tenth
    for 10 s bars (where the restart and what follows it fall in one bar)."""
    prometheus_url, start_prometheus = prometheus
    expr = next(
        target["expr"]
        for path in sorted(DASHBOARDS.glob("*.json"))
        for panel in json.loads(path.read_text(encoding="utf-8"))["panels"]
        for target in panel.get("targets", [])
        if "cachegate_session_evictions_total" in target["expr"]
        and "[$__range]" not in target["expr"]
    )
    port = free_port()
    with run_simulator() as sim, httpx.Client(base_url=prometheus_url) as prom:
        settings = settings_from_mapping(
            {
                "upstream": {"base_url": sim.api_base},
                "logging": {"dir": str(tmp_path / "logs")},
                "sessions": {"max_sessions": 1},
            }
        )
        began = 0.0
        for run, sessions in enumerate((4, 5)):  # 3 evictions, a restart, 4 more: 7
            app = create_app(settings, registry=CollectorRegistry(), environ={})
            with ServerThread(app, port=port) as server:
                if run == 0:
                    start_prometheus(f"127.0.0.1:{port}")
                    wait_for_scrapes(prom, 5)
                    began = time.time()
                else:  # a reset Prometheus never scraped is one it cannot see: 3, then 4
                    wait_for_restart_scrape(prom)
                with httpx.Client(base_url=server.url + "/v1", timeout=30) as client:
                    for n in range(sessions):  # each new session forgets the one before
                        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}
                        headers = {"X-Session-Id": f"bars-{run}-{n}"}
                        assert client.post("/chat/completions", json=body, headers=headers)
                        time.sleep(0.45 if run == 0 else 0.15)
                time.sleep(2.5)  # (scraped after the last one)
        ended = time.time()
        for step in (3, 10):  # (Grafana's $__rate_interval: the step and one scrape)
            response = prom.get(
                "/api/v1/query_range",
                params={
                    "query": expr.replace("$__rate_interval", f"{step + 1}s"),
                    "start": began - step,
                    "end": ended + step,
                    "step": step,
                },
            )
            result = response.json()["data"]["result"]
            counts = {r["metric"]["reason"]: [float(v) for _, v in r["values"]] for r in result}
            assert 7 <= sum(counts["count"]) <= 7 * (step + 1) / step + 0.01, (step, counts)
            assert sum(counts["idle"]) == sum(counts["memory"]) == 0


def test_a_redirect_the_client_follows_is_no_error_in_the_error_ratio(
    tmp_path: Path, prometheus: tuple[str, Any]
) -> None:
    """A client whose base URL ends in a slash (``/v1/chat/completions/``): the upstream's 307,
    relayed, then the 200 the client gets following it. Every request succeeded, but the error
    ratio panel counted each redirect as an error (~50%); it counts 4xx and 5xx only."""
    with scraped_cachegate(tmp_path, prometheus) as (server, prom):
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=server.url + "/v1", follow_redirects=True) as client:
            for turn in range(5):
                answer = client.post("/chat/completions/", json=body)
                assert answer.status_code == 200
                assert [r.status_code for r in answer.history] == [307]
                if turn == 0:  # (the 307s' series is made by the first: seen, then counted)
                    wait_for_scrapes(prom, 3)
            failed = client.post("/chat/completions", json=body, headers={"X-Sim-Fault": "500"})
            assert failed.status_code == 500
        wait_for_scrapes(prom, 6)
        (expr,) = [e for _, title, e in dashboard_queries() if title == "Error ratio"]
        at = time.time()  # (one instant for the queries compared: a rate's window moves)
        (result,) = query(prom, expr, at)["result"]
        rate = "sum(rate(cachegate_requests_total{%s}[1m]))"
        redirects = query(prom, rate % 'status="307"', at)["result"]
        assert float(redirects[0]["value"][1]) > 0  # (the redirects are in the window)
        ratio = (rate % 'status="500"') + " / " + (rate % "")
        (failures,) = query(prom, ratio, at)["result"]
        # the 500 alone (the same sums in another order: equal but for rounding)
        assert abs(float(result["value"][1]) - float(failures["value"][1])) < 1e-9
