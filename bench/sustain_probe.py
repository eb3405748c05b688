"""Where a concurrent stream's time to first event goes: the client's send, the request's arrival
at the mock upstream, the first event at the client.

    python -m bench.sustain_probe [--arm cachegate|bare] [--streams 1000] [--warm 100,300]

One proxy (pinned to CPU 0) and the mock (CPU 1) as ``bench.run`` starts them. Warm-up fan-outs at
the ``--warm`` sizes (direct, then through the proxy: they leave the proxy's pool with idle
connections, as the sustain phase's lower levels do), then ``--streams`` streams direct (their
median time to first event is the baseline) and as many through the proxy. The mock records when
each request arrived (``/__bench/disconnects``); ``time.perf_counter`` and ``time.monotonic`` are
the same clock on Linux, so the three instants of a stream compare across processes.

Printed: how many streams were late (first event more than 200 ms after the direct median, the
sustain phase's rule) and, for on-time and late streams, the time from the client's send to the
mock's arrival (the proxy's work before forwarding, and its connect) and from the mock's arrival
to the first event at the client (the mock's 100 ms, then the proxy's relay); then, in arrival
order at the mock, the median arrival offset and time to first event of each tenth.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from bench import procs
from bench.run import HOST, Arm, fan

LATE_S = 0.2  # ten times the mock's chunk interval, as in bench.run


def _get(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=30) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"p50 {1000 * ordered[len(ordered) // 2]:.0f} / max {1000 * ordered[-1]:.0f} ms"


async def _probe(arm: Arm, mock_port: int, streams: int, warm: list[int]) -> dict[str, Any]:
    direct = Arm("direct", mock_port)
    for n in warm:
        await fan(direct, n, f"warm-direct-{n}")
        await fan(arm, n, f"warm-{arm.name}-{n}")
    base_runs = await fan(direct, streams, "direct")
    direct_ttfb = [r.ttfb_s for r in base_runs if r.ttfb_s is not None]
    if not direct_ttfb:
        raise RuntimeError("no direct stream got an event: is the mock running?")
    baseline = statistics.median(direct_ttfb)
    _get(mock_port, "/__bench/reset")
    results = await fan(arm, streams, "probe")
    arrivals = _get(mock_port, "/__bench/disconnects")["arrivals"]
    rows = []  # (sent, sent -> arrival, arrival -> first event, time to first event)
    for i, r in enumerate(results):
        arrived = arrivals.get(f"probe-{i}")
        if not r.event_times or r.ttfb_s is None or arrived is None:
            continue
        first = r.event_times[0]
        sent = first - r.ttfb_s
        rows.append((sent, arrived - sent, first - arrived, r.ttfb_s))
    if not rows:
        raise RuntimeError("no stream reached the mock")
    start = min(row[0] for row in rows)
    late = [row for row in rows if row[3] > baseline + LATE_S]
    on_time = [row for row in rows if row[3] <= baseline + LATE_S]
    by_arrival = sorted(rows, key=lambda row: row[0] + row[1])
    tenth = -(-len(by_arrival) // 10)  # at most ten groups
    groups = [by_arrival[k : k + tenth] for k in range(0, len(by_arrival), tenth)]
    return {
        "arm": arm.name,
        "streams": len(rows),
        "failed": len(results) - len(rows),  # no event, or never reached the mock
        "direct_ttfb_p50_ms": 1000 * baseline,
        "late": len(late),
        "groups": {
            name: {
                "send_to_arrival": _summary([row[1] for row in part]),
                "arrival_to_first_event": _summary([row[2] for row in part]),
                "ttfb": _summary([row[3] for row in part]),
            }
            for name, part in (("on time", on_time), ("late", late))
        },
        "arrival_offset_ms_by_tenth": [
            round(1000 * statistics.median([row[0] + row[1] - start for row in g])) for g in groups
        ],
        "ttfb_ms_by_tenth": [
            round(1000 * statistics.median([row[3] for row in g])) for g in groups
        ],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.sustain_probe", description=__doc__)
    parser.add_argument("--arm", choices=("cachegate", "bare"), default="cachegate")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--warm", default="100,300", help="warm-up fan-out sizes, comma-separated")
    ns = parser.parse_args(argv)
    procs.stop_on_sigterm()
    warm = [int(n) for n in ns.warm.split(",") if n.strip()]
    work = Path(tempfile.mkdtemp(prefix="cachegate-probe-"))
    env = procs.bench_env()
    mock_port, proxy_port = procs.free_port(), procs.free_port()
    upstream = f"http://{HOST}:{mock_port}/v1"
    if ns.arm == "cachegate":
        argv_ = ["-m", "proxy.cli", "serve", "--log-dir", str(work / "logs")]
        ready = "/healthz"
    else:
        argv_ = ["-m", "bench.passthrough"]
        ready = "/v1/models"
    started: list[procs.Server] = []
    try:
        mock = procs.start(
            "mock",
            [sys.executable, "-m", "bench.mock_upstream", "--port", str(mock_port)],
            port=mock_port,
            cpu=1,
            log_dir=work,
            env=env,
        )
        started.append(mock)
        server = procs.start(
            ns.arm,
            [sys.executable, *argv_, "--port", str(proxy_port), "--upstream", upstream],
            port=proxy_port,
            cpu=0,
            log_dir=work,
            env=env,
        )
        started.append(server)
        mock.wait_ready("/healthz", 30)
        server.wait_ready(ready, 60)
        out = asyncio.run(_probe(Arm(ns.arm, proxy_port, server), mock_port, ns.streams, warm))
    finally:
        for process in reversed(started):
            with contextlib.suppress(Exception):
                process.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"{out['arm']}: {out['late']} of {out['streams']} streams late "
        f"(direct's median first event {out['direct_ttfb_p50_ms']:.0f} ms; "
        f"{out['failed']} failed, not counted)"
    )
    for name, g in out["groups"].items():
        print(
            f"  {name:7s}  send -> mock {g['send_to_arrival']}  |  mock -> first event "
            f"{g['arrival_to_first_event']}  |  first event {g['ttfb']}"
        )
    print(
        f"  by arrival at the mock, each tenth: arrived at {out['arrival_offset_ms_by_tenth']} ms"
    )
    print(f"  {'':35s}first event after {out['ttfb_ms_by_tenth']} ms")
    return out


if __name__ == "__main__":
    main()
