"""The benchmark, one command: ``python -m bench.run [--quick] [--litellm] [--out FILE]``.

Starts the mock upstream, a bare pass-through on cachegate's stack, cachegate (``cachegate serve``,
default config, one worker, a temporary log dir: repair, accounting, event log and metrics all on) and,
with ``--litellm``, LiteLLM proxy from its own venv; pins the proxies to CPU 0 and everything else
(mock, load generators, this process) to CPU 1; then measures every arm in the same run, interleaved,
and prints a table (values, cachegate/direct and cachegate/LiteLLM ratios) and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from bench import agent, client, mock_upstream, procs

LITELLM_VERSION = "1.106.12"
VENV = Path(__file__).resolve().parent / ".venv-litellm"
# Optional, for --profile: python -m venv --system-site-packages bench/.venv-tools; pip install py-spy
TOOLS_VENV = Path(__file__).resolve().parent / ".venv-tools"
MODEL = "gpt-4o-mini"
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Plan:
    """How much of each measurement to run."""

    first_token_ms: float
    deltas: int
    interval_ms: float
    latency_rounds: int
    latency_per_round: int
    load_concurrency: tuple[int, ...]
    load_seconds: float
    load_rounds: int
    stream_rounds: int
    fanout: int
    fanout_rounds: int
    sustain: tuple[int, ...]
    hangups: int
    agent_sessions: int
    agent_rounds: int
    fork_sizes: tuple[int, ...]
    forks_per_size: int


FULL = Plan(
    100,
    64,
    20,
    15,
    100,
    (1, 8, 32, 128),
    5.0,
    2,
    12,
    100,
    3,
    (100, 300, 1000),
    5,
    2,
    200,
    (1000, 10000, 100000),
    8,
)
QUICK = Plan(
    50, 16, 10, 3, 20, (1, 8, 32, 128), 0.3, 1, 2, 20, 1, (20, 40), 2, 1, 12, (1000, 20000), 2
)


# ---------------------------------------------------------------------------------------------
# statistics


def pct(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(p / 100.0 * len(ordered)) - 1))
    return ordered[k]


def ms(seconds: float) -> float:
    return seconds * 1000.0


# ---------------------------------------------------------------------------------------------
# arms


@dataclass
class Arm:
    """Where one arm's requests go; ``server`` is the proxy process (None for direct)."""

    name: str
    port: int
    server: procs.Server | None = None

    def cpu(self) -> float:
        return self.server.cpu() if self.server is not None else 0.0


def body_a(user: str = "bench-a") -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "user": user,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant. " * 8},
                {"role": "user", "content": "Summarise the benefits of a transparent proxy. " * 4},
            ],
        }
    )


def body_b(user: str, include_usage: bool = False) -> bytes:
    body: dict[str, Any] = {"model": MODEL, "stream": True, "user": user}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    body["messages"] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a short poem about byte-identical relays."},
    ]
    return orjson.dumps(body)


PATH = "/v1/chat/completions"

# The proxies' core is quiet when they used less than this share of it over QUIET_LOAD_S.
QUIET_SHARE = 0.1
QUIET_LOAD_S = 0.05


async def quiet(arms: list[Arm], window_s: float, timeout_s: float = 30.0) -> None:
    """Wait until the proxies, which share one core, have run for less than ``QUIET_SHARE`` of
    ``window_s`` in a row (or ``timeout_s`` has passed), before an arm's load or burst of
    streams: what the arm before it still does after its last answer (LiteLLM: ~1 ms of CPU
    after each of its answers, its callbacks, so seconds after a burst of a hundred streams)
    is not charged to the next arm's figures. Not before each request of the concurrency-1
    phase: a pause of milliseconds before each costs every arm the core's wake-up (p50 +0.2 ms
    for both pass-throughs here), where its back-to-back requests keep it awake."""
    servers = [a.server for a in arms if a.server is not None]
    if not servers:
        return
    deadline = time.monotonic() + timeout_s
    before = sum(s.cpu() for s in servers)
    while True:
        await asyncio.sleep(window_s)
        now = sum(s.cpu() for s in servers)
        if now - before <= QUIET_SHARE * window_s or time.monotonic() >= deadline:
            return
        before = now


def payload(arm: Arm, body: bytes) -> bytes:
    return client.build_request(HOST, arm.port, PATH, body)


# ---------------------------------------------------------------------------------------------
# measurements


async def latency_c1(arms: list[Arm], plan: Plan) -> dict[str, Any]:
    """Mode A at concurrency 1, arms alternating request by request; median of per-round medians."""
    conns = {a.name: client.Connection(HOST, a.port) for a in arms}
    payloads = {a.name: payload(a, body_a()) for a in arms}
    rounds: dict[str, list[tuple[float, float]]] = {a.name: [] for a in arms}
    for r in range(plan.latency_rounds):
        samples: dict[str, list[float]] = {a.name: [] for a in arms}
        order = arms[r % len(arms) :] + arms[: r % len(arms)]
        for _ in range(plan.latency_per_round):
            for a in order:
                status, _, elapsed = await conns[a.name].post(payloads[a.name])
                if status != 200:
                    raise RuntimeError(f"{a.name}: mode A answered {status}")
                samples[a.name].append(elapsed)
        for a in arms:
            rounds[a.name].append((statistics.median(samples[a.name]), pct(samples[a.name], 99)))
    for c in conns.values():
        c.close()
    out: dict[str, Any] = {}
    direct = rounds["direct"]
    for a in arms:
        mine = rounds[a.name]
        out[a.name] = {
            "p50_ms": ms(statistics.median(m for m, _ in mine)),
            "p99_ms": ms(statistics.median(p for _, p in mine)),
        }
        if a.name != "direct":
            out[a.name]["added_p50_ms"] = ms(
                statistics.median(m - d for (m, _), (d, _) in zip(mine, direct, strict=True))
            )
            out[a.name]["added_p99_ms"] = ms(
                statistics.median(p - d for (_, p), (_, d) in zip(mine, direct, strict=True))
            )
    return out


WRK_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench"
local f = io.open("{path}", "rb")
wrk.body = f:read("*a")
f:close()
"""


def run_wrk(arm: Arm, script: Path, concurrency: int, seconds: float) -> tuple[int, int, float]:
    """One wrk run: (requests completed, errors, seconds)."""
    threads = 1 if concurrency < 64 else 2
    proc = subprocess.run(
        [
            "wrk",
            f"-t{threads}",
            f"-c{concurrency}",
            f"-d{max(1, round(seconds))}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
            f"http://{HOST}:{arm.port}{PATH}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return parse_wrk(proc.stdout)


def parse_wrk(text: str) -> tuple[int, int, float]:
    """wrk's report: (answers of 2xx, errors, seconds)."""
    m = re.search(r"(\d+) requests in ([\d.]+)(m?s)", text)
    if m is None:
        raise RuntimeError(f"wrk output not understood: {text}")
    seconds_run = float(m.group(2)) / (1000.0 if m.group(3) == "ms" else 1.0)
    errors = refused = 0
    e = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    if e:
        refused = int(e.group(1))
        errors += refused
    s = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    if s:
        errors += sum(int(x) for x in s.groups())
    # (wrk's count of requests holds the answers other than 2xx: those are no throughput, as
    # the built-in generator counts only 200s)
    return int(m.group(1)) - refused, errors, seconds_run


async def throughput(
    arms: list[Arm], plan: Plan, mock: procs.Server, workdir: Path
) -> dict[str, Any]:
    """Mode A requests/s at each concurrency, arms interleaved; proxy CPU per request."""
    # wrk only takes whole seconds; sub-second smoke runs use the built-in generator.
    use_wrk = shutil.which("wrk") is not None and plan.load_seconds >= 1
    script = workdir / "post.lua"
    body_path = workdir / "body_a.json"
    body_path.write_bytes(body_a())
    script.write_text(WRK_LUA.format(path=body_path))
    out: dict[str, Any] = {"tool": "wrk" if use_wrk else "asyncio raw-socket closed loop"}
    for conc in plan.load_concurrency:
        per: dict[str, list[tuple[float, float, int, float]]] = {a.name: [] for a in arms}
        for r in range(plan.load_rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for a in order:
                await quiet(arms, QUIET_LOAD_S)
                cpu0, mock0 = a.cpu(), mock.cpu()
                if use_wrk:
                    done, errors, secs = await asyncio.to_thread(
                        run_wrk, a, script, conc, plan.load_seconds
                    )
                else:
                    res = await client.closed_loop(
                        HOST, a.port, payload(a, body_a()), conc, plan.load_seconds
                    )
                    done, errors, secs = res.requests, res.errors, res.seconds
                cpu = a.cpu() - cpu0
                per[a.name].append(
                    (done / secs, cpu / max(done, 1), errors, (mock.cpu() - mock0) / secs)
                )
        for a in arms:
            rows = per[a.name]
            out.setdefault(a.name, {})[f"c{conc}"] = {
                "rps": statistics.median(x[0] for x in rows),
                "cpu_ms_per_request": ms(statistics.median(x[1] for x in rows)),
                "errors": sum(x[2] for x in rows),
                "mock_cpu_util": max(x[3] for x in rows),
            }
    return out


def stream_stats(
    results: list[client.StreamResult],
    expected_events: int,
    plan: Plan,
    ttfb_baseline_s: float | None = None,
) -> dict[str, Any]:
    """Counts and percentiles of a set of streams. A stall is a gap over 10x the chunk interval; a
    late start is a first event more than that after ``ttfb_baseline_s`` (direct's p50 at the same
    concurrency; the mock's own first-token delay when not given)."""
    ttfb = [r.ttfb_s for r in results if r.ttfb_s is not None]
    gaps = [g for r in results for g in r.gaps()]
    stall = 10 * plan.interval_ms / 1000.0
    base = plan.first_token_ms / 1000.0 if ttfb_baseline_s is None else ttfb_baseline_s
    return {
        "late_starts": sum(1 for r in results if r.ttfb_s is None or r.ttfb_s > base + stall),
        "streams": len(results),
        "errors": sum(1 for r in results if r.error or r.status != 200),
        "events": sum(r.events for r in results),
        "lost_events": sum(max(0, expected_events - r.events) for r in results),
        "stalls": sum(1 for g in gaps if g > stall),
        "ttfb_p50_ms": ms(pct(ttfb, 50)),
        "ttfb_p99_ms": ms(pct(ttfb, 99)),
        "gap_p50_ms": ms(pct(gaps, 50)),
        "gap_p99_ms": ms(pct(gaps, 99)),
        "gap_max_ms": ms(max(gaps)) if gaps else math.nan,
    }


async def fan(arm: Arm, n: int, tag: str, include_usage: bool = False) -> list[client.StreamResult]:
    return list(
        await asyncio.gather(
            *(
                client.stream(HOST, arm.port, payload(arm, body_b(f"{tag}-{i}", include_usage)))
                for i in range(n)
            )
        )
    )


def add_deltas(out: dict[str, Any], arms: list[Arm], keys: Sequence[str]) -> None:
    for a in arms:
        if a.name == "direct":
            continue
        for k in keys:
            out[a.name][f"added_{k}"] = out[a.name][k] - out["direct"][k]


async def streams(
    arms: list[Arm], plan: Plan, digests: dict[str, dict[str, list[str]]]
) -> dict[str, Any]:
    """Mode B: one stream at a time (interleaved rounds), then ``fanout`` concurrent streams."""
    expected = plan.deltas + 2
    single: dict[str, list[client.StreamResult]] = {a.name: [] for a in arms}
    for r in range(plan.stream_rounds):
        for a in arms[r % len(arms) :] + arms[: r % len(arms)]:
            single[a.name].append(await client.stream(HOST, a.port, payload(a, body_b(f"s1-{r}"))))
    # The client asking for usage itself: the usage event must pass through untouched.
    for a in arms:
        res = await client.stream(HOST, a.port, payload(a, body_b("s1-usage", True)))
        digests[a.name].setdefault("with_usage", []).append(res.digest)
    many: dict[str, list[client.StreamResult]] = {a.name: [] for a in arms}
    cpu: dict[str, float] = {a.name: 0.0 for a in arms}
    for r in range(plan.fanout_rounds):
        for a in arms[r % len(arms) :] + arms[: r % len(arms)]:
            await quiet(arms, QUIET_LOAD_S)
            c0 = a.cpu()
            many[a.name].extend(await fan(a, plan.fanout, f"fan-{r}"))
            cpu[a.name] += a.cpu() - c0
    out: dict[str, Any] = {"expected_events_per_stream": expected, "c1": {}, f"c{plan.fanout}": {}}
    for a in arms:
        out["c1"][a.name] = stream_stats(single[a.name], expected, plan)
        stats = stream_stats(many[a.name], expected, plan)
        if a.server is not None:
            stats["cpu_us_per_event"] = 1e6 * cpu[a.name] / max(1, stats["events"])
            stats["cpu_ms_per_stream"] = ms(cpu[a.name] / max(1, stats["streams"]))
        out[f"c{plan.fanout}"][a.name] = stats
        digests[a.name].setdefault("no_usage", []).extend(
            r.digest for r in single[a.name] + many[a.name] if not r.error
        )
    keys = ("ttfb_p50_ms", "ttfb_p99_ms", "gap_p50_ms", "gap_p99_ms", "gap_max_ms")
    add_deltas(out["c1"], arms, keys)
    add_deltas(out[f"c{plan.fanout}"], arms, keys)
    return out


async def sustain(
    arms: list[Arm], plan: Plan, digests: dict[str, dict[str, list[str]]], mock: procs.Server
) -> dict[str, Any]:
    """Concurrent streams at each level: sustained means no lost event, no error, no gap over 10x
    the chunk interval and no first event later than that past direct's; RSS per stream."""
    expected = plan.deltas + 2
    out: dict[str, Any] = {}
    direct_ttfb: dict[int, float] = {}  # the direct arm runs first
    for a in arms:
        out[a.name] = {"levels": {}, "sustained": 0}
        if a.server is not None:  # (RSS per stream: the top level's peak over this)
            out[a.name]["start_rss_kib"] = a.server.rss()
    for n in plan.sustain:  # each level for every arm, direct first (its baseline), then the next
        for a in arms:
            await quiet(arms, QUIET_LOAD_S)
            base_rss = a.server.rss() if a.server is not None else 0
            peak = base_rss
            done = asyncio.Event()

            async def sample(
                srv: procs.Server | None = a.server, done: asyncio.Event = done
            ) -> None:
                nonlocal peak
                while not done.is_set() and srv is not None:
                    peak = max(peak, srv.rss())
                    await asyncio.sleep(0.02)

            sampler = asyncio.get_running_loop().create_task(sample())
            m0, t0 = mock.cpu(), time.perf_counter()
            results = await fan(a, n, f"sus-{n}")
            mock_util = (mock.cpu() - m0) / (time.perf_counter() - t0)
            done.set()
            await sampler
            baseline = direct_ttfb.get(n) if a.name != "direct" else None
            stats = stream_stats(results, expected, plan, baseline)
            if a.name == "direct":
                direct_ttfb[n] = stats["ttfb_p50_ms"] / 1000.0
            stats["mock_cpu_util"] = mock_util
            ok = not (stats["lost_events"] or stats["stalls"] or stats["errors"])
            ok = ok and not stats["late_starts"]
            stats["sustained"] = ok
            if a.server is not None:
                stats["rss_growth_kib"] = peak - base_rss
                stats["rss_during_kib"] = peak
            out[a.name]["levels"][str(n)] = stats
            if ok:
                out[a.name]["sustained"] = max(out[a.name]["sustained"], n)
            digests[a.name].setdefault("no_usage", []).extend(
                r.digest for r in results if not r.error
            )
    return out


async def hangups(arms: list[Arm], plan: Plan, mock_port: int) -> dict[str, Any]:
    """Seconds from a client hanging up to the upstream handler seeing ``http.disconnect``."""
    out: dict[str, Any] = {}
    for a in arms:
        await quiet(arms, QUIET_LOAD_S)
        trials: dict[str, list[client.StreamResult]] = {"mid_stream": [], "before_first_token": []}
        for i in range(plan.hangups):
            trials["mid_stream"].append(
                await client.stream(
                    HOST, a.port, payload(a, body_b(f"hupm-{a.name}-{i}")), hang_up_after_events=5
                )
            )
            trials["before_first_token"].append(
                await client.stream(
                    HOST,
                    a.port,
                    payload(a, body_b(f"hupf-{a.name}-{i}")),
                    hang_up_after_s=plan.first_token_ms / 2000.0,
                )
            )
        deadline = time.monotonic() + 5.0
        seen: dict[str, float] = {}
        names = {f"hup{k[0]}-{a.name}-{i}" for k in ("m", "f") for i in range(plan.hangups)}
        while time.monotonic() < deadline:
            conn = client.Connection(HOST, mock_port)
            await conn._open()
            assert conn._writer is not None and conn._reader is not None
            conn._writer.write(b"GET /__bench/disconnects HTTP/1.1\r\nhost: x\r\n\r\n")
            _, headers = await client._read_head(conn._reader)
            state = orjson.loads(await client._read_body(conn._reader, headers))
            conn.close()
            seen = state["disconnects"]
            if names <= set(seen):
                break
            await asyncio.sleep(0.1)
        out[a.name] = {}
        for kind, results in trials.items():
            tag = "hupm" if kind == "mid_stream" else "hupf"
            lags = [
                seen[f"{tag}-{a.name}-{i}"] - r.hung_up_at
                for i, r in enumerate(results)
                if r.hung_up_at is not None and f"{tag}-{a.name}-{i}" in seen
            ]
            out[a.name][kind] = {
                "p50_s": statistics.median(lags) if lags else math.inf,
                "max_s": max(lags) if lags else math.inf,
                "unseen": len(results) - len(lags),
            }
    return out


async def agent_sessions(arms: list[Arm], plan: Plan) -> dict[str, Any]:
    """Mode C: growing sessions, arms interleaved turn by turn; cachegate CPU per request."""
    conns = {a.name: client.Connection(HOST, a.port) for a in arms}
    lat: dict[str, list[tuple[int, float]]] = {a.name: [] for a in arms}  # (history bytes, s)
    cpu_rows: list[tuple[int, int, float]] = []  # (history bytes, appended bytes, cpu s)
    bare_rows: list[tuple[int, float]] = []  # the bare pass-through's (history bytes, cpu s)
    forks: dict[str, list[tuple[int, int, int, float]]] = {}  # (history, size, appended, cpu)
    cg = next(a for a in arms if a.name == "cachegate")
    bare = next((a for a in arms if a.name == "bare"), None)
    max_size = 0

    async def send(a: Arm, body: bytes) -> float:
        status, resp, elapsed = await conns[a.name].post(payload(a, body))
        if status != 200:
            raise RuntimeError(f"{a.name}: mode C answered {status}: {resp[:300]!r}")
        return elapsed

    async def sweep(label: str, base: bytes) -> None:
        rows = forks.setdefault(label, [])
        for k in range(plan.forks_per_size):
            for size in plan.fork_sizes:
                body = agent.fork(base, k * 1000 + size, size)
                c0 = cg.cpu()
                await send(cg, body)
                await asyncio.sleep(0.005)  # let the log writer thread take its share
                rows.append((len(base), size, len(body) - len(base), cg.cpu() - c0))

    checkpoint = max(2, plan.agent_rounds // 6)
    for s in range(plan.agent_sessions):
        last = b""
        for turn in agent.session(1000 + s, rounds=plan.agent_rounds):
            last = turn.body
            max_size = max(max_size, len(turn.body))
            order = arms[turn.index % len(arms) :] + arms[: turn.index % len(arms)]
            for a in order:
                c0 = a.cpu()
                elapsed = await send(a, turn.body)
                if a is cg:
                    await asyncio.sleep(0.005)
                    cpu_rows.append((len(turn.body), turn.appended_bytes, cg.cpu() - c0))
                elif a is bare:
                    await asyncio.sleep(0.005)
                    bare_rows.append((len(turn.body), a.cpu() - c0))
                lat[a.name].append((len(turn.body), elapsed))
            if s == 0 and turn.index == checkpoint:
                await sweep("small_history", turn.body)
        if s == 0:
            await sweep("large_history", last)

    async def alone(turns: Any) -> list[tuple[int, float]]:
        """Through cachegate alone: (body bytes, cachegate's CPU s) per turn."""
        rows = []
        for turn in turns:
            c0 = cg.cpu()
            await send(cg, turn.body)
            await asyncio.sleep(0.005)
            rows.append((len(turn.body), cg.cpu() - c0))
        return rows

    # A client that moves a cache_control mark to its newest message each turn (its bodies never
    # continue the bytes of the one before), and one whose system prompt opens with the time, a
    # minute later each turn (no body opens as the one before did, and none is continued).
    marked_rows = await alone(agent.session(2000, rounds=plan.agent_rounds, marked=True))
    timed_rows = await alone(agent.session(3000, rounds=plan.agent_rounds, timed=True))
    for c in conns.values():
        c.close()
    large = 0.8 * max_size
    out: dict[str, Any] = {"max_body_bytes": max_size, "large_end_from_bytes": int(large)}
    direct_large = [t for size, t in lat["direct"] if size >= large]
    for a in arms:
        mine = [t for size, t in lat[a.name] if size >= large]
        out[a.name] = {
            "large_p50_ms": ms(statistics.median(mine)),
            "large_p99_ms": ms(pct(mine, 99)),
        }
        if a.name != "direct":
            out[a.name]["added_large_p50_ms"] = ms(
                statistics.median(mine) - statistics.median(direct_large)
            )
    # CPU per request in quarters of the history size, at the ~3 KB appended by a normal turn.
    quarters = []
    for q in range(4):
        lo, hi = q * max_size / 4, (q + 1) * max_size / 4
        rows = [r for r in cpu_rows if lo <= r[0] < hi or (q == 3 and r[0] == max_size)]
        if rows:
            quarters.append(
                {
                    "history_kb": round(statistics.mean(r[0] for r in rows) / 1000, 1),
                    "appended_kb": round(statistics.mean(r[1] for r in rows) / 1000, 2),
                    "cpu_ms_median": ms(statistics.median(r[2] for r in rows)),
                    "requests": len(rows),
                }
            )

    def slope_of(rows: list[tuple[float, float]]) -> float:
        xs = [r[0] / 1e5 for r in rows]
        return (
            statistics.linear_regression(xs, [ms(r[1]) for r in rows]).slope
            if len(set(xs)) > 1
            else math.nan
        )

    slope = slope_of([(r[0], r[2]) for r in cpu_rows])
    # Relaying the bytes (socket reads and writes, the HTTP layers) grows with the body for any
    # proxy: the bare pass-through's slope is that floor; cachegate's own work is the difference.
    bare_slope = slope_of([(float(h), c) for h, c in bare_rows]) if bare_rows else math.nan
    sweeps: dict[str, Any] = {}
    for label, frows in forks.items():
        sweeps[label] = {
            "history_kb": round(frows[0][0] / 1000, 1),
            "by_appended_kb": {
                str(round(size / 1000, 1)): ms(
                    statistics.median(r[3] for r in frows if r[1] == size)
                )
                for size in plan.fork_sizes
            },
        }
    marked_large = [c for size, c in marked_rows if size >= large]
    timed_end = 0.8 * max((size for size, _ in timed_rows), default=0)  # (its own sizes)
    timed_large = [c for size, c in timed_rows if size >= timed_end]
    plain_large = [r[2] for r in cpu_rows if r[0] >= large]
    out["cachegate_cpu"] = {
        "moving_mark_large_ms": ms(statistics.median(marked_large)) if marked_large else None,
        "timed_system_large_ms": ms(statistics.median(timed_large)) if timed_large else None,
        "appending_large_ms": ms(statistics.median(plain_large)) if plain_large else None,
        "by_history_quarter": quarters,
        "ms_per_100kb_history": slope,
        "bare_ms_per_100kb_history": bare_slope,
        "pipeline_ms_per_100kb_history": slope - bare_slope,
        "fork_sweeps": sweeps,
    }
    return out


# ---------------------------------------------------------------------------------------------
# processes


def litellm_config(path: Path, mock_port: int) -> None:
    path.write_text(
        f"""model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: http://{HOST}:{mock_port}/v1
      api_key: sk-bench
litellm_settings:
  callbacks: []
  success_callback: []
  failure_callback: []
  num_retries: 0
  request_timeout: 600
  drop_params: true
general_settings:
  dangerously_permit_weak_or_unset_master_key: true
"""
    )


def install_litellm() -> str | None:
    """Create ``bench/.venv-litellm`` with LiteLLM proxy; None when ready, else why not."""
    exe = VENV / "bin" / "litellm"
    if exe.exists():
        return None
    try:
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, capture_output=True)
        subprocess.run(
            [str(VENV / "bin" / "pip"), "install", "-q", f"litellm[proxy]=={LITELLM_VERSION}"],
            check=True,
            capture_output=True,
            text=True,
            timeout=1200,
        )
    except subprocess.CalledProcessError as exc:
        return f"pip install failed: {(exc.stderr or '')[-800:]}"
    except subprocess.TimeoutExpired:
        return "pip install took over 20 minutes"
    return None if exe.exists() else "litellm executable missing after install"


@dataclass
class Fleet:
    mock: procs.Server
    arms: list[Arm]
    servers: list[procs.Server]
    notes: list[str]


def start_fleet(
    plan: Plan, workdir: Path, want_litellm: bool, profile: str | None, httpx_arm: bool
) -> Fleet:
    env = procs.bench_env()
    py = procs.python()
    servers: list[procs.Server] = []
    notes: list[str] = []
    mock_port = procs.free_port()
    mock = procs.start(
        "mock",
        [py, "-m", "bench.mock_upstream", "--port", str(mock_port),
         "--first-token-ms", str(plan.first_token_ms), "--deltas", str(plan.deltas),
         "--interval-ms", str(plan.interval_ms)],
        port=mock_port, cpu=1, log_dir=workdir, env=env,
    )  # fmt: skip
    servers.append(mock)
    upstream = f"http://{HOST}:{mock_port}/v1"
    cg_port, bare_port = procs.free_port(), procs.free_port()
    wrapper = None
    if profile:
        candidates = [TOOLS_VENV / "bin" / "py-spy", VENV / "bin" / "py-spy"]
        spy = shutil.which("py-spy") or str(next((c for c in candidates if c.exists()), "py-spy"))
        wrapper = [spy, "record", "-r", "250", "-F", "-f", "raw", "-o", profile, "--nonblocking"]
    cg = procs.start(
        "cachegate",
        [py, "-m", "proxy.cli", "serve", "--port", str(cg_port), "--upstream", upstream,
         "--log-dir", str(workdir / "cachegate-logs")],
        port=cg_port, cpu=0, log_dir=workdir, env=env, wrapper=wrapper,
    )  # fmt: skip
    bare = procs.start(
        "bare",
        [py, "-m", "bench.passthrough", "--port", str(bare_port), "--upstream", upstream,
         "--transport", "native"],
        port=bare_port, cpu=0, log_dir=workdir, env=env,
    )  # fmt: skip
    servers += [cg, bare]
    arms = [Arm("direct", mock_port), Arm("bare", bare_port, bare), Arm("cachegate", cg_port, cg)]
    if httpx_arm:  # the same bare pass-through on httpx's own pool (httpcore), for comparison
        hx_port = procs.free_port()
        hx = procs.start(
            "bare_httpx",
            [py, "-m", "bench.passthrough", "--port", str(hx_port),
             "--upstream", upstream, "--transport", "httpx"],
            port=hx_port, cpu=0, log_dir=workdir, env=env,
        )  # fmt: skip
        servers.append(hx)
        arms.append(Arm("bare_httpx", hx_port, hx))
    ll: procs.Server | None = None
    if want_litellm:
        why = install_litellm()
        if why is None:
            cfg = workdir / "litellm.yaml"
            litellm_config(cfg, mock_port)
            ll_port = procs.free_port()
            ll_env = dict(env, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR")
            ll = procs.start(
                "litellm",
                [str(VENV / "bin" / "litellm"), "--config", str(cfg), "--host", HOST,
                 "--port", str(ll_port), "--num_workers", "1"],
                port=ll_port, cpu=0, log_dir=workdir, env=ll_env,
            )  # fmt: skip
            servers.append(ll)
            arms.append(Arm("litellm", ll_port, ll))
        else:
            notes.append(f"LiteLLM arm skipped: {why}")
    try:
        mock.wait_ready("/healthz", 20)
        cg.wait_ready("/healthz", 30)
        bare.wait_ready("/v1/models", 20)
        for extra in servers[3:]:
            if extra.name == "bare_httpx":
                extra.wait_ready("/v1/models", 20)
        if ll is not None:
            ll.wait_ready("/health/liveliness", 180)
    except Exception:
        for s in servers:
            s.stop()
        raise
    return Fleet(mock, arms, servers, notes)


# ---------------------------------------------------------------------------------------------
# report


def digest_check(digests: dict[str, dict[str, list[str]]]) -> dict[str, Any]:
    """Every proxied stream's digest against the direct one (same request shape)."""
    out: dict[str, Any] = {}
    for kind in ("no_usage", "with_usage"):
        reference = set(digests["direct"].get(kind, []))
        out[f"direct_{kind}"] = sorted(reference)
        for arm, kinds in digests.items():
            if arm == "direct":
                continue
            got = kinds.get(kind, [])
            out[f"{arm}_{kind}_streams"] = len(got)
            # (None where no stream was compared: a run of phases that relay none)
            out[f"{arm}_{kind}_identical"] = (
                None
                if not got and not reference
                else len(reference) == 1 and bool(got) and all(d in reference for d in got)
            )
    return out


def flatten(results: dict[str, Any], plan: Plan, arm_names: list[str]) -> dict[str, float]:
    """The headline figures, one flat key each."""
    f: dict[str, float] = {}
    lat, tp, st, sus, hup, ag = (
        results[k] for k in ("latency_c1", "throughput", "streams", "sustain", "hangup", "agent")
    )
    fan = f"c{plan.fanout}"
    for arm in arm_names:
        f[f"{arm}.latency_c1_p50_ms"] = lat[arm]["p50_ms"]
        f[f"{arm}.latency_c1_p99_ms"] = lat[arm]["p99_ms"]
        for c in plan.load_concurrency:
            f[f"{arm}.rps_c{c}"] = tp[arm][f"c{c}"]["rps"]
        for scope in ("c1", fan):
            s = st[scope][arm]
            for k in (
                "ttfb_p50_ms",
                "ttfb_p99_ms",
                "gap_p50_ms",
                "gap_p99_ms",
                "gap_max_ms",
                "lost_events",
            ):
                f[f"{arm}.stream_{scope}_{k}"] = s[k]
        f[f"{arm}.streams_sustained"] = sus[arm]["sustained"]
        for kind in ("mid_stream", "before_first_token"):
            f[f"{arm}.hangup_{kind}_p50_s"] = hup[arm][kind]["p50_s"]
        f[f"{arm}.agent_large_p50_ms"] = ag[arm]["large_p50_ms"]
        if arm == "direct":
            continue
        f[f"{arm}.added_latency_c1_p50_ms"] = lat[arm]["added_p50_ms"]
        f[f"{arm}.added_latency_c1_p99_ms"] = lat[arm]["added_p99_ms"]
        for scope in ("c1", fan):
            for k in ("ttfb_p50_ms", "ttfb_p99_ms", "gap_p50_ms", "gap_p99_ms", "gap_max_ms"):
                f[f"{arm}.added_stream_{scope}_{k}"] = st[scope][arm][f"added_{k}"]
        f[f"{arm}.agent_added_large_p50_ms"] = ag[arm]["added_large_p50_ms"]
        for c in plan.load_concurrency:
            f[f"{arm}.cpu_ms_per_request_c{c}"] = tp[arm][f"c{c}"]["cpu_ms_per_request"]
        f[f"{arm}.cpu_us_per_event"] = st[fan][arm]["cpu_us_per_event"]
        mem = results["memory"][arm]
        f[f"{arm}.rss_idle_mib"] = mem["idle_kib"] / 1024
        f[f"{arm}.rss_peak_mib"] = mem["peak_kib"] / 1024
        f[f"{arm}.rss_per_stream_kib"] = mem["per_stream_kib"]
    cpu = ag["cachegate_cpu"]
    f["cachegate.agent_cpu_ms_per_100kb_history"] = cpu["ms_per_100kb_history"]
    f["bare.agent_cpu_ms_per_100kb_history"] = cpu.get("bare_ms_per_100kb_history", math.nan)
    for label, sweep in cpu["fork_sweeps"].items():
        for kb, value in sweep["by_appended_kb"].items():
            f[f"cachegate.agent_cpu_ms_{label}_appended_{kb}kb"] = value
    return f


def table(results: dict[str, Any], plan: Plan, arm_names: list[str]) -> str:
    f = results["figures"]
    proxies = [a for a in arm_names if a != "direct"]
    names = {"bare_httpx": "bare+httpx"}
    cols = ["direct", *(names.get(p, p) for p in proxies), "cg/direct", "cg/litellm"]
    fan = f"c{plan.fanout}"
    # (the full plan's sessions reach ~600 KB; a smoke run's, a tenth of that)
    large = "~600 KB" if plan is FULL else f"largest of {plan.agent_rounds} rounds"
    rows: list[tuple[str, str, bool]] = [  # label, key suffix, is_added (no direct value)
        ("latency c=1 p50 (ms)", "latency_c1_p50_ms", False),
        ("latency c=1 p99 (ms)", "latency_c1_p99_ms", False),
        ("added latency c=1 p50 (ms)", "added_latency_c1_p50_ms", True),
        ("added latency c=1 p99 (ms)", "added_latency_c1_p99_ms", True),
        *((f"requests/s c={c}", f"rps_c{c}", False) for c in plan.load_concurrency),
        *(
            (f"proxy CPU/request c={c} (ms)", f"cpu_ms_per_request_c{c}", True)
            for c in plan.load_concurrency
        ),
        ("stream TTFB 1 stream p50 (ms)", "stream_c1_ttfb_p50_ms", False),
        ("added TTFB 1 stream p50 (ms)", "added_stream_c1_ttfb_p50_ms", True),
        (
            # (the nearest-rank p99 of fewer than 100 samples is their largest)
            "added TTFB 1 stream p99 (ms)"
            if plan.stream_rounds >= 100
            else f"added TTFB 1 stream max of {plan.stream_rounds} (ms)",
            "added_stream_c1_ttfb_p99_ms",
            True,
        ),
        (f"stream TTFB {plan.fanout} streams p50 (ms)", f"stream_{fan}_ttfb_p50_ms", False),
        (f"added TTFB {plan.fanout} streams p50 (ms)", f"added_stream_{fan}_ttfb_p50_ms", True),
        (f"added TTFB {plan.fanout} streams p99 (ms)", f"added_stream_{fan}_ttfb_p99_ms", True),
        (f"added gap {plan.fanout} streams p50 (ms)", f"added_stream_{fan}_gap_p50_ms", True),
        (f"added gap {plan.fanout} streams p99 (ms)", f"added_stream_{fan}_gap_p99_ms", True),
        (f"added gap {plan.fanout} streams max (ms)", f"added_stream_{fan}_gap_max_ms", True),
        (f"lost events {plan.fanout} streams", f"stream_{fan}_lost_events", False),
        ("max concurrent streams sustained", "streams_sustained", False),
        ("proxy CPU/relayed event (us)", "cpu_us_per_event", True),
        ("RSS idle (MiB)", "rss_idle_mib", True),
        ("RSS peak (MiB)", "rss_peak_mib", True),
        ("RSS per concurrent stream (KiB)", "rss_per_stream_kib", True),
        ("hang-up mid-stream → upstream closed p50 (s)", "hangup_mid_stream_p50_s", False),
        (
            "hang-up before 1st token → upstream closed p50 (s)",
            "hangup_before_first_token_p50_s",
            False,
        ),
        (f"mode C {large} p50 (ms)", "agent_large_p50_ms", False),
        (f"mode C {large} added p50 (ms)", "agent_added_large_p50_ms", True),
    ]

    def fmt(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, bool):
            return str(v)
        if isinstance(v, float) and not math.isfinite(v):
            return "n/a"
        if isinstance(v, int):  # (a count: 1000 / 300, not 300.0)
            return str(v)
        if isinstance(v, float):
            av = abs(v)
            return f"{v:.0f}" if av >= 1000 else f"{v:.3g}" if av < 1 else f"{v:.1f}"
        return str(v)

    lines = []
    header = f"{'figure':52}" + "".join(f"{c:>12}" for c in cols)
    lines.append(header)
    lines.append("-" * len(header))
    for label, key, added in rows:
        vals = {a: f.get(f"{a}.{key}") for a in arm_names}
        if added:
            vals["direct"] = None
        cg = vals.get("cachegate")
        d, ll = vals.get("direct"), vals.get("litellm")
        r1 = cg / d if isinstance(cg, int | float) and isinstance(d, int | float) and d else None
        r2 = cg / ll if isinstance(cg, int | float) and isinstance(ll, int | float) and ll else None
        cells = [fmt(vals.get(a)) for a in ["direct", *proxies]]
        cells += [f"{r1:.2f}" if r1 is not None else "—", f"{r2:.2f}" if r2 is not None else "—"]
        lines.append(f"{label:52}" + "".join(f"{c:>12}" for c in cells))
    cpu = results["agent"]["cachegate_cpu"]
    lines.append("")
    lines.append(
        "cachegate CPU per mode-C request (ms), by history size (each turn appends ~3 KB):"
    )
    for q in cpu["by_history_quarter"]:
        lines.append(
            f"  history {q['history_kb']:>7} KB  appended {q['appended_kb']:>5} KB  "
            f"cpu {q['cpu_ms_median']:.2f} ms  (n={q['requests']})"
        )
    lines.append(
        f"  slope: {cpu['ms_per_100kb_history']:.3f} ms CPU per 100 KB of history "
        f"(bare pass-through: {cpu.get('bare_ms_per_100kb_history', math.nan):.3f}; "
        f"cachegate's pipeline: {cpu.get('pipeline_ms_per_100kb_history', math.nan):.3f})"
    )
    for label, sweep in cpu["fork_sweeps"].items():
        parts = ", ".join(f"+{kb} KB → {v:.2f} ms" for kb, v in sweep["by_appended_kb"].items())
        lines.append(f"  {label} ({sweep['history_kb']} KB): {parts}")
    if cpu.get("moving_mark_large_ms") is not None:
        lines.append(
            f"  a cache_control mark moved to the newest message each turn, at the large end: "
            f"{cpu['moving_mark_large_ms']:.2f} ms (appending: {cpu['appending_large_ms']:.2f})"
        )
    if cpu.get("timed_system_large_ms") is not None:
        lines.append(
            f"  the time in the system prompt, a minute later each turn, at the large end: "
            f"{cpu['timed_system_large_ms']:.2f} ms"
        )
    dg = results["digests"]
    lines.append("")
    for arm in proxies:
        lines.append(
            f"stream byte identity {arm}: without usage {dg.get(f'{arm}_no_usage_identical')} "
            f"({dg.get(f'{arm}_no_usage_streams')} streams), client-requested usage "
            f"{dg.get(f'{arm}_with_usage_identical')}"
        )
    return "\n".join(lines)


def targets(results: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Issue 9's targets: value, target, met."""
    f = results["figures"]
    fan = f"c{plan.fanout}"
    t: dict[str, Any] = {}

    def check(
        name: str, value: float | None, target: float, op: Callable[[float, float], bool]
    ) -> None:
        t[name] = {"value": value, "target": target, "met": value is not None and op(value, target)}

    le, ge = (lambda a, b: a <= b), (lambda a, b: a >= b)
    check("added p50 c=1 <= 0.7 ms", f["cachegate.added_latency_c1_p50_ms"], 0.7, le)
    check("added p99 c=1 <= 3 ms", f["cachegate.added_latency_c1_p99_ms"], 3.0, le)
    check("mode C added p50 <= 3 ms", f["cachegate.agent_added_large_p50_ms"], 3.0, le)
    c32 = f.get("cachegate.rps_c32")
    if c32 is not None and "litellm.rps_c32" in f:
        check("rps c=32 >= 5x LiteLLM", c32 / f["litellm.rps_c32"], 5.0, ge)
    if c32 is not None and f.get("bare.rps_c32"):  # (a run without concurrency 32: no figure)
        check("rps c=32 >= 60% of bare pass-through", c32 / f["bare.rps_c32"], 0.6, ge)
    check(
        f"added TTFB {plan.fanout} streams p50 <= 15 ms",
        f[f"cachegate.added_stream_{fan}_ttfb_p50_ms"],
        15.0,
        le,
    )
    check(
        f"lost events {plan.fanout} streams == 0", f[f"cachegate.stream_{fan}_lost_events"], 0, le
    )
    check("streams sustained >= 1000", f["cachegate.streams_sustained"], 1000, ge)
    check("RSS per stream <= 64 KiB", f["cachegate.rss_per_stream_kib"], 64.0, le)
    # Throughput at concurrency 1 as the load tool measures it (a closed loop of one connection):
    # it includes the work cachegate does after each answer, as the concurrency-32 figure does.
    c1 = f.get("cachegate.rps_c1")
    if c1 and c32 is not None:
        check("rps c=32 >= rps c=1 (issue 2)", c32 / c1, 1.0, ge)
    return t


async def measure(fleet: Fleet, plan: Plan, workdir: Path, phases: set[str]) -> dict[str, Any]:
    arms = fleet.arms
    results: dict[str, Any] = {"memory": {}}
    for a in arms:
        if a.server is not None:
            results["memory"][a.name] = {"idle_kib": a.server.rss()}
    # Warm-up: connections, imports, caches.
    for a in arms:
        conn = client.Connection(HOST, a.port)
        for _ in range(20):
            await conn.post(payload(a, body_a()))
        conn.close()
        await client.stream(HOST, a.port, payload(a, body_b("warm")))
    digests: dict[str, dict[str, list[str]]] = {a.name: {} for a in arms}
    timings: dict[str, float] = {}
    mock_cpu: dict[str, float] = {}

    async def phase(name: str, coro: Any) -> None:
        if name not in phases:
            coro.close()
            return
        t0, m0 = time.perf_counter(), fleet.mock.cpu()
        results[name] = await coro
        timings[name] = time.perf_counter() - t0
        mock_cpu[name] = (fleet.mock.cpu() - m0) / timings[name]
        print(f"  {name}: {timings[name]:.1f}s", file=sys.stderr, flush=True)

    await phase("latency_c1", latency_c1(arms, plan))
    await phase("throughput", throughput(arms, plan, fleet.mock, workdir))
    await phase("sustain", sustain(arms, plan, digests, fleet.mock))
    await phase("streams", streams(arms, plan, digests))
    await phase("hangup", hangups(arms, plan, fleet.mock.port))
    await phase("agent", agent_sessions(arms, plan))
    for a in arms:
        if a.server is None:
            continue
        mem = results["memory"][a.name]
        mem["peak_kib"] = procs.peak_rss_kib(a.server.pid)
        mem["end_kib"] = a.server.rss()
        if "sustain" in results:
            top = str(max(plan.sustain))
            level = results["sustain"][a.name]["levels"][top]
            # The top level's peak over the process as the phase found it, per stream: from
            # the level's own start, what the lower levels had left allocated (and Python's
            # allocator keeps) was counted as nothing, and a quick run read 0; from the
            # warmed-up process, the throughput phase's connections were counted as streams'.
            # None when nothing grew (too few streams to see).
            grown = level["rss_during_kib"] - results["sustain"][a.name]["start_rss_kib"]
            mem["per_stream_kib"] = grown / int(top) if grown > 0 else None
        mem["cpu_total_s"] = a.server.cpu()
    results["digests"] = digest_check(digests)
    results["phase_seconds"] = timings
    results["mock_cpu_util_by_phase"] = mock_cpu
    return results


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": sys.version.split()[0],
        "pinned": procs.HAVE_TASKSET,
        "kernel": os.uname().release,
        # how the log writer's secret scan runs here (cachegate runs on this interpreter)
        "secret_scan": _secret_scan(),
    }


def _secret_scan() -> str:
    """``one pass (hyperscan X)`` when proxy/redact.py's one-pass scan can be built, else ``one
    scan at a time``."""
    from proxy.redact import _multi_scan

    if _multi_scan() is None:
        return "one scan at a time"
    try:
        version = importlib.metadata.version("hyperscan")
    except importlib.metadata.PackageNotFoundError:  # (importable without its metadata)
        version = "?"
    return f"one pass (hyperscan {version})"


def summarise_profile(path: Path, top: int = 25) -> dict[str, list[tuple[str, float]]]:
    """py-spy's collapsed stacks → the frames with the most self and inclusive samples (percent)."""
    self_n: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        leaf = frames[-1]
        self_n[leaf] = self_n.get(leaf, 0) + n
        for frame in set(frames):
            incl[frame] = incl.get(frame, 0) + n

    def pick(d: dict[str, int]) -> list[tuple[str, float]]:
        return [
            (k, round(100.0 * v / total, 1))
            for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]
        ]

    return {"samples": [("total", float(total))], "self": pick(self_n), "inclusive": pick(incl)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: seconds, small counts")
    parser.add_argument("--litellm", action="store_true", help="add the LiteLLM proxy arm")
    parser.add_argument("--out", default="bench-results.json", help="JSON results file")
    parser.add_argument(
        "--phases",
        default="latency_c1,throughput,sustain,streams,hangup,agent",
        help="comma-separated subset (for profiling)",
    )
    parser.add_argument("--profile", default=None, help="record cachegate with py-spy to this file")
    parser.add_argument(
        "--httpx-pool",
        action="store_true",
        help="add a bare pass-through on httpx's own connection pool (httpcore) for comparison",
    )
    parser.add_argument(
        "--concurrency",
        default=None,
        help="comma-separated load concurrencies (default 1,8,32,128)",
    )
    ns = parser.parse_args(argv)
    phases = {p.strip() for p in ns.phases.split(",") if p.strip()}
    unknown = phases - set(PHASES)
    if unknown or not phases:
        parser.error(
            f"--phases: unknown {', '.join(sorted(unknown)) or 'empty list'};"
            f" choose from {','.join(PHASES)}"
        )
    out_path = Path(ns.out)
    if not out_path.resolve().parent.is_dir():  # (found out after the run, its results lost)
        parser.error(f"--out: no directory {out_path.resolve().parent}")
    if out_path.is_dir():
        parser.error(f"--out: {out_path} is a directory; give a file's name")
    procs.stop_on_sigterm()
    plan = QUICK if ns.quick else FULL
    if ns.concurrency:
        plan = dataclasses.replace(
            plan, load_concurrency=tuple(int(c) for c in ns.concurrency.split(","))
        )
    if procs.HAVE_TASKSET:
        os.sched_setaffinity(0, {1})
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    workdir = Path(tempfile.mkdtemp(prefix="cachegate-bench-"))
    print(f"bench: workdir {workdir}", file=sys.stderr, flush=True)
    fleet: Fleet | None = None
    interrupted = False
    try:
        fleet = start_fleet(plan, workdir, ns.litellm, ns.profile, ns.httpx_pool)
        results = asyncio.run(measure(fleet, plan, workdir, phases))
    except KeyboardInterrupt:
        print("bench: interrupted; no results written", file=sys.stderr)
        interrupted = True
        return 130
    except Exception as exc:
        # (a server that died mid-run: said with its log's end, its workdir kept to read)
        print(f"bench: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        for s in fleet.servers if fleet is not None else ():
            if s.popen.poll() is not None:
                print(
                    f"bench: {s.name} exited ({s.popen.returncode}); the end of its log:\n"
                    f"{s.log_tail()}",
                    file=sys.stderr,
                )
        print(f"bench: its servers' logs are kept in {workdir}", file=sys.stderr)
        return 1
    finally:
        for s in fleet.servers if fleet is not None else ():
            s.stop()
        if interrupted:  # (once its servers are stopped: cachegate writes its logs as it stops)
            shutil.rmtree(workdir, ignore_errors=True)
    arm_names = [a.name for a in fleet.arms]
    results["meta"] = {
        "command": "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": ns.quick,
        "plan": plan.__dict__,
        "machine": machine(),
        "arms": arm_names,
        "load_tool": results.get("throughput", {}).get("tool"),
        "litellm_version": LITELLM_VERSION if "litellm" in arm_names else None,
        "notes": fleet.notes,
        "mode_b_event_bytes": [len(e) for e in mock_upstream.stream_events(2, True)],
        "mode_a_response_bytes": len(mock_upstream.completion_body()),
    }
    if phases >= set(PHASES):
        results["figures"] = flatten(results, plan, arm_names)
        results["targets"] = targets(results, plan)
        print(table(results, plan, arm_names))
        print("\ntargets (issue 9):")
        for name, t in results["targets"].items():
            value = t["value"]
            if value is None:
                print(f"  {'—':6s} {name}: not measured in this run")
                continue
            shown = f"{value:.3g}" if isinstance(value, float) else value
            print(f"  {'MET   ' if t['met'] else 'MISSED'} {name}: {shown}")
    else:  # (a subset: each phase's own figures, as the JSON file has them)
        print(partial_report(results, phases, arm_names))
    if ns.profile:
        with contextlib.suppress(OSError):
            results["profile"] = summarise_profile(Path(ns.profile))
    for note in fleet.notes:
        print(f"note: {note}")
    print(f"load generator: {results['meta']['load_tool']}; pinned: {procs.HAVE_TASKSET}")
    out_path.write_text(json.dumps(results, indent=2, default=str))
    print(f"results: {out_path}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


PHASES: Final = ("latency_c1", "throughput", "sustain", "streams", "hangup", "agent")


def partial_report(results: dict[str, Any], phases: set[str], arm_names: list[str]) -> str:
    """The figures of a run of some phases (``--phases``): each phase's numbers as the JSON
    file has them (lists of samples left out), and cachegate's ratio to the bare pass-through
    where both ran (requests/s, the issue's 60% at concurrency 32)."""
    lines: list[str] = []
    for phase in PHASES:
        if phase not in phases or phase not in results:
            continue
        lines.append(f"{phase}:")
        lines += (f"  {path}: {_shown(value)}" for path, value in _leaves(results[phase]))
    throughput = results.get("throughput", {})
    if "cachegate" in throughput and "bare" in throughput:
        for level, figures in throughput["cachegate"].items():
            bare = throughput["bare"].get(level, {}).get("rps")
            if bare:
                lines.append(f"  cachegate/bare requests/s {level}: {figures['rps'] / bare:.1%}")
    if "sustain" in phases:
        for arm in arm_names:
            per = results.get("memory", {}).get(arm, {}).get("per_stream_kib")
            if per is not None:
                lines.append(f"  {arm} RSS per concurrent stream: {per:.1f} KiB")
    return "\n".join(lines)


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}" if path else str(key))
    elif not isinstance(value, list):  # (samples: in the JSON file)
        yield path, value


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
