"""Micro-benchmarks of single parts, for the figures a change's commit message quotes.

``python -m bench.micro [strip] [writer] [inference] [--scale 1.0]`` prints, per part:

- ``strip``: a 66-event stream (OpenAI's null usages, the usage event, ``[DONE]``) through
  ``UsageEventStripper.feed``, read one event at a time, in cuts of 50–400 bytes, in 1,400-byte
  and 16 KiB reads, and whole: µs per event;
- ``writer``: the event log writer's CPU per line, 4,000 lines in batches of 1,000 over 10, 64,
  300 and 1,000 sessions whose files exist (a later turn);
- ``inference``: an id-less request of 402 messages against 1,000 sessions that open the same
  way: ms per inference.

Timings, not instruction counts: compare two commits on the same machine, alternately.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

import orjson

from proxy.eventlog import EventLogWriter
from proxy.sessions import MemorySessionStore
from proxy.strip import UsageEventStripper


def _best(fn: Callable[[], Any], number: int, repeat: int = 3) -> float:
    """Seconds per call, best of ``repeat`` rounds of ``number`` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def _stream() -> tuple[list[bytes], bytes]:
    def event(i: int) -> bytes:
        chunk = {
            "id": "chatcmpl-x",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "gpt-4o-mini",
            "choices": [{"index": 0, "delta": {"content": f"w{i} " * 20}, "finish_reason": None}],
            "usage": None,
        }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    events = [event(i) for i in range(64)]
    events.append(
        b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n'
    )
    events.append(b"data: [DONE]\n\n")
    return events, b"".join(events)


def strip(scale: float) -> dict[str, float]:
    events, stream = _stream()
    rnd = random.Random(1)

    def cuts(size: int | None) -> list[bytes]:
        out, at = [], 0
        while at < len(stream):
            n = size or rnd.randint(50, 400)
            out.append(stream[at : at + n])
            at += n
        return out

    readings = {
        "one event per read": events,
        "cuts of 50-400 bytes": cuts(None),
        "1400-byte reads": cuts(1400),
        "16 KiB reads": cuts(16384),
        "whole stream in one read": [stream],
    }
    out: dict[str, float] = {}
    for label, chunks in readings.items():

        def run(chunks: list[bytes] = chunks) -> None:
            stripper = UsageEventStripper()
            for chunk in chunks:
                stripper.feed(chunk)
            stripper.flush()

        out[label] = 1e6 * _best(run, max(1, int(200 * scale))) / len(events)
    return out


def writer(scale: float) -> dict[str, float]:
    out: dict[str, float] = {}
    lines = max(100, int(4000 * scale))
    for sessions in (10, 64, 300, 1000):
        with tempfile.TemporaryDirectory(prefix="cachegate-micro-") as log_dir:
            out[f"{sessions} sessions"] = _writer_cpu_per_line(log_dir, sessions, lines)
    return out


def _writer_cpu_per_line(log_dir: str, sessions: int, lines: int) -> float:
    w = EventLogWriter(log_dir)
    w.start()
    try:

        def event(i: int) -> dict[str, Any]:
            content = "hello " * 20
            return {"type": "request", "exchange": i, "appended": [{"content": content}]}

        for s in range(sessions):
            w.emit(f"s{s}", event(0))
        w.flush()
        t0 = time.process_time()
        for i in range(lines):
            w.emit(f"s{i % sessions}", event(i))
            if i % 1000 == 999:
                w.flush()
        w.flush()
        return 1e6 * (time.process_time() - t0) / lines
    finally:
        w.close()


def inference(scale: float) -> dict[str, float]:
    store = MemorySessionStore(max_sessions=100_000)
    system = {"role": "system", "content": "You are a coding agent. " * 200}
    opening = {"role": "user", "content": "Fix the failing test in the repo."}
    sessions = max(10, int(1000 * scale))

    def history(tag: str, turns: int) -> list[dict[str, Any]]:
        messages = [dict(system), dict(opening)]
        for i in range(turns):
            messages.append({"role": "assistant", "content": f"{tag} step {i} " + "x" * 200})
            messages.append({"role": "user", "content": f"{tag} result {i} " + "y" * 800})
        return messages

    for s in range(sessions):
        store.index(store.create(f"explicit-{s}", 0.0), history(f"s{s}", 200))
    request = orjson.loads(orjson.dumps(history("fresh", 200)))  # parsed apart, as a request is
    return {f"{sessions} sessions of 402 messages": 1e3 * _best(lambda: store.infer(request), 5)}


PARTS: dict[str, tuple[Callable[[float], dict[str, float]], str]] = {
    "strip": (strip, "us per event"),
    "writer": (writer, "us of CPU per line"),
    "inference": (inference, "ms per inference"),
}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description="micro-benchmarks of single parts")
    parser.add_argument("parts", nargs="*", help=f"any of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the default counts")
    ns = parser.parse_args(argv)
    unknown = [part for part in ns.parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    results: dict[str, dict[str, float]] = {}
    for part in ns.parts or list(PARTS):
        fn, unit = PARTS[part]
        results[part] = fn(ns.scale)
        for label, value in results[part].items():
            print(f"{part:10s} {label:34s} {value:9.2f} {unit}")
    return results


if __name__ == "__main__":
    main()
