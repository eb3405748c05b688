"""Instructions per request, counted by valgrind's callgrind: repeatable where timings are not.

    python -m bench.instructions                 # mode A through cachegate and the bare pass-through
    python -m bench.instructions --mode b        # a 66-event stream per request, a new session each
    python -m bench.instructions --config X.toml # cachegate with a configuration (e.g. logging off)

The server runs under callgrind twice, for a small and a larger number of requests after the same
warm-up, and the difference divided by the extra requests is the figure: start-up, imports and
warm-up cancel out. Counts are user-space instructions of every thread (the log writer's
included), not time: system calls and cache misses are not in them. Counts move far less than
timings, but not by nothing: one day, cachegate's mode A count for the same code was 627k-730k
across copies of the tree, and on another the same commit counted 606k and 677k in two runs in
one copy (cause unconfirmed). Compare commits by alternating several runs of each in one copy. Needs valgrind (Debian's ``valgrind``);
the mock upstream and the client run natively. Mode B streams pace their events as the mock does
(100 ms to the first, 20 ms apart) and four run at a time, so events arrive one by one as they
would, even with the server slowed down ~50x.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import client, procs
from bench.run import HOST, PATH, body_a, body_b

ROOT = Path(__file__).resolve().parent.parent


async def _load(port: int, mode: str, count: int, connections: int) -> None:
    """``count`` requests over ``connections`` keep-alive connections, each answer read whole."""
    ids = itertools.count()
    plain = client.build_request(HOST, port, PATH, body_a())

    async def worker(n: int) -> None:
        conn = client.Connection(HOST, port)
        for _ in range(n):
            if mode == "a":
                payload = plain
            else:
                body = body_b(f"cg-{os.getpid()}-{next(ids)}")
                payload = client.build_request(HOST, port, PATH, body)
            status, _, _ = await conn.post(payload)
            if status != 200:
                raise RuntimeError(f"unexpected status {status}")
        conn.close()

    per = count // connections
    await asyncio.gather(*(worker(per) for _ in range(connections)))


def _count(argv: list[str], port: int, mode: str, warm: int, count: int, conns: int) -> int:
    """Total instructions of one callgrind run of the server ``argv`` serving ``count`` requests
    after ``warm`` requests."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv]
        log = open(Path(tmp) / "server.log", "wb")  # noqa: SIM115 - the child's for its lifetime
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=procs.bench_env()
        )
        server = procs.Server("counted", port, proc, Path(tmp) / "server.log")
        try:
            server.wait_ready("/v1/models", 300)
            asyncio.run(_load(port, mode, warm, conns))
            asyncio.run(_load(port, mode, count, conns))
            time.sleep(1)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
            log.close()
        match = re.search(r"^(?:summary|totals):\s*(\d+)", out.read_text(), re.MULTILINE)
        if match is None:
            raise RuntimeError("callgrind wrote no total")
        return int(match.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    parser.add_argument("--mode", choices=("a", "b"), default="a")
    parser.add_argument("--config", default=None, help="a cachegate configuration file")
    parser.add_argument("--skip-bare", action="store_true", help="cachegate only")
    ns = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    small, large, warm, conns = (400, 1200, 200, 8) if ns.mode == "a" else (16, 48, 8, 4)
    # The interpreter itself, not a wrapper script: valgrind must see the server's instructions.
    python = os.path.realpath(sys.executable)
    procs.stop_on_sigterm()
    work = Path(tempfile.mkdtemp(prefix="cachegate-instr-"))
    mock_port = procs.free_port()
    mock = procs.start(
        "mock",
        [sys.executable, "-m", "bench.mock_upstream", "--port", str(mock_port)],
        port=mock_port,
        cpu=None,
        log_dir=work,
        env=procs.bench_env(),
    )
    upstream = f"http://{HOST}:{mock_port}/v1"
    arms: list[tuple[str, list[str]]] = []
    if not ns.skip_bare:
        bare = ["-m", "bench.passthrough", "--upstream", upstream, "--transport", "native"]
        arms.append(("bare", bare))
    serve = ["-m", "proxy.cli", "serve", "--upstream", upstream, "--log-dir", str(work / "logs")]
    if ns.config:
        serve += ["--config", os.path.abspath(ns.config)]
    arms.append(("cachegate", serve))
    try:
        mock.wait_ready("/healthz", 20)
        unit = "request" if ns.mode == "a" else "66-event stream"
        for name, args in arms:
            totals = []
            for n in (small, large):
                port = procs.free_port()
                totals.append(
                    _count([python, *args, "--port", str(port)], port, ns.mode, warm, n, conns)
                )
            per = (totals[1] - totals[0]) / (large - small)
            print(f"{name}: {per:,.0f} instructions per {unit} (mode {ns.mode.upper()})")
    finally:
        mock.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
