"""The benchmark harness keeps working: a quick run produces every figure, and streams relayed by
cachegate under load are byte-identical to the same streams fetched directly (timings not asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=55,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(60)
def test_every_headline_figure_is_a_finite_number(results: dict) -> None:
    figures = results["figures"]
    for arm in ("direct", "bare", "cachegate"):
        for key in (
            "latency_c1_p50_ms",
            "latency_c1_p99_ms",
            "rps_c1",
            "rps_c8",
            "rps_c32",
            "rps_c128",
            "stream_c1_ttfb_p50_ms",
            "streams_sustained",
            "hangup_mid_stream_p50_s",
            "hangup_before_first_token_p50_s",
            "agent_large_p50_ms",
        ):
            assert f"{arm}.{key}" in figures, f"{arm}.{key} missing"
    for key in (
        "added_latency_c1_p50_ms",
        "added_latency_c1_p99_ms",
        "added_stream_c1_ttfb_p50_ms",
        "added_stream_c20_ttfb_p50_ms",
        "added_stream_c20_gap_p99_ms",
        "added_stream_c20_gap_max_ms",
        "cpu_ms_per_request_c32",
        "cpu_us_per_event",
        "rss_idle_mib",
        "rss_peak_mib",
        "rss_per_stream_kib",
        "agent_added_large_p50_ms",
    ):
        assert f"cachegate.{key}" in figures, key
    # RSS per stream is None where the smoke's few streams grew nothing to see (it read 0, and
    # the target "met"); every other figure is a number
    unseen = {k for k, v in figures.items() if v is None}
    assert unseen <= {"bare.rss_per_stream_kib", "cachegate.rss_per_stream_kib"}, unseen
    assert all(
        figures[k] is None or figures[k] > 0 for k in unseen | {"cachegate.rss_per_stream_kib"}
    )
    bad = {k: v for k, v in figures.items() if v is not None and not math.isfinite(float(v))}
    assert not bad, f"non-finite figures: {bad}"
    assert figures["cachegate.rps_c32"] > 0
    assert results["meta"]["load_tool"] in ("wrk", "asyncio raw-socket closed loop")
    # how the log's secret scan ran: a figure that changes with it says which
    from proxy.redact import _multi_scan

    one_pass = results["meta"]["machine"]["secret_scan"].startswith("one pass (hyperscan ")
    assert one_pass == (_multi_scan() is not None)
    assert set(results["targets"]) >= {"added p50 c=1 <= 0.7 ms", "RSS per stream <= 64 KiB"}


@pytest.mark.timeout(60)
def test_streams_relayed_under_load_are_byte_identical(results: dict) -> None:
    digests = results["digests"]
    assert len(digests["direct_no_usage"]) == 1, "the mock's stream must be the same every time"
    assert digests["cachegate_no_usage_streams"] >= 20
    assert digests["cachegate_no_usage_identical"] is True
    assert digests["cachegate_with_usage_identical"] is True
    assert results["figures"]["cachegate.stream_c20_lost_events"] == 0


@pytest.mark.timeout(60)
def test_mode_c_cpu_is_measured_against_history_and_appended_bytes(results: dict) -> None:
    cpu = results["agent"]["cachegate_cpu"]
    assert cpu["by_history_quarter"], "no per-request CPU rows"
    assert math.isfinite(cpu["ms_per_100kb_history"])
    for sweep in cpu["fork_sweeps"].values():
        assert all(math.isfinite(v) and v > 0 for v in sweep["by_appended_kb"].values())
    for key in ("moving_mark_large_ms", "timed_system_large_ms", "appending_large_ms"):
        assert math.isfinite(cpu[key]) and cpu[key] > 0, key


def test_the_micro_benchmarks_measure_every_part(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import micro

    results = micro.main(["--scale", "0.02"])
    assert set(results) == {"strip", "writer", "inference"}
    for part, figures in results.items():
        assert figures, part
        assert all(math.isfinite(v) and v > 0 for v in figures.values()), (part, figures)
    printed = capsys.readouterr().out
    assert "us per event" in printed and "ms per inference" in printed
    with pytest.raises(SystemExit):
        micro.main(["nothing"])


@pytest.mark.parametrize("arm", ["cachegate", "bare"])
def test_the_sustain_probe_times_every_stream(arm: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A few streams: each one's send, arrival at the mock and first event are matched up."""
    from bench import sustain_probe

    out = sustain_probe.main(["--arm", arm, "--streams", "6", "--warm", ""])
    assert out["arm"] == arm and out["streams"] + out["failed"] == 6 and out["streams"] >= 1
    # The mock's first token comes 100 ms after the request, by uvloop's timers: whole
    # milliseconds, counted from the loop's clock as its iteration began, so up to a millisecond
    # early (99.86 ms seen).
    assert 0 <= out["late"] <= 6 and out["direct_ttfb_p50_ms"] >= 99
    assert len(out["ttfb_ms_by_tenth"]) == len(out["arrival_offset_ms_by_tenth"]) >= 1
    assert all(t >= 99 for t in out["ttfb_ms_by_tenth"])
    assert "streams late" in capsys.readouterr().out


def test_the_responses_benchmark_measures_both_arms(capsys: pytest.CaptureFixture[str]) -> None:
    """A few Responses and chat streams through cachegate and one direct: every figure printed,
    and every Responses stream's tokens counted (the run fails otherwise)."""
    from bench import responses

    assert responses.main(["--events", "200", "--rounds", "2"]) == 0
    printed = capsys.readouterr().out
    for arm in ("direct (Responses)", "cachegate, Responses", "cachegate, chat"):
        line = next(row for row in printed.splitlines() if row.startswith(arm))
        figures = [float(x) for x in line[len(arm) :].split()]
        assert figures and all(math.isfinite(x) and x > 0 for x in figures), line
    assert "every stream's tokens counted" in printed


def test_the_responses_agent_benchmark_measures_each_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A short Codex-style session over the Responses API: a row of figures for each tenth of
    it, and its log one delta-coded request line a turn (the run fails otherwise)."""
    from bench import responses

    assert responses.main(["--agent-rounds", "19"]) == 0  # (its answers short by default)
    printed = capsys.readouterr().out
    rows = [row.split() for row in printed.splitlines() if row[:1].isdigit() and "-" in row[:8]]
    assert len(rows) == 10, printed
    for row in rows:
        figures = [float(x) for x in row[1:]]
        assert len(figures) == 3 and all(math.isfinite(x) and x > 0 for x in figures[::2]), row
    assert "logged: 21 request lines" in printed
