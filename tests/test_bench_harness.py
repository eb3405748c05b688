"""The benchmark's own parts over real sockets: the mock upstream answers every mode on keep-alive
connections and notes hang-ups; the stream client reads a chunked SSE answer however the bytes
are split, timestamps each event and digests the de-chunked body."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import re
import time

import orjson
import pytest

from bench import client
from bench.mock_upstream import MockProtocol, MockUpstream, StreamShape, stream_events

pytestmark = pytest.mark.timeout(30)

SHAPE = StreamShape(first_token_ms=20.0, deltas=5, interval_ms=5.0)


async def _mock() -> tuple[asyncio.Server, MockUpstream, int]:
    app = MockUpstream(SHAPE)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: MockProtocol(app), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, app, port


def _body(stream: bool, user: str, usage: bool = False) -> bytes:
    body: dict[str, object] = {"model": "m", "user": user, "messages": []}
    if stream:
        body["stream"] = True
    if usage:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def test_mock_streams_the_canned_events_on_schedule_and_answers_on_the_same_connection() -> None:
    async def run() -> None:
        server, app, port = await _mock()
        async with server:
            expected = b"".join(stream_events(SHAPE.deltas, False))
            res = await client.stream(
                "127.0.0.1", port, client.build_request("h", port, "/v1/x", _body(True, "s1"))
            )
            assert res.error is None and res.status == 200
            assert res.events == SHAPE.deltas + 2  # deltas, the finish chunk, [DONE]
            assert res.digest == hashlib.sha256(expected).hexdigest()
            assert res.ttfb_s is not None and res.ttfb_s >= SHAPE.first_token_ms / 1000 * 0.9
            # deltas keep the interval: the last delta comes (deltas-1) intervals after the first
            # token, counted from the request's send (the first event's arrival, a late wake-up
            # of the client on a loaded machine, shortened a span measured from it)
            sent = res.event_times[0] - res.ttfb_s
            last = res.event_times[SHAPE.deltas - 1] - sent
            schedule = SHAPE.first_token_ms + (SHAPE.deltas - 1) * SHAPE.interval_ms
            assert last >= schedule / 1000 * 0.9
            with_usage = await client.stream(
                "127.0.0.1",
                port,
                client.build_request("h", port, "/v1/x", _body(True, "s2", usage=True)),
            )
            assert with_usage.events == SHAPE.deltas + 3
            asked = b"".join(stream_events(SHAPE.deltas, True))
            assert with_usage.digest == hashlib.sha256(asked).hexdigest()
            # mode A twice on one keep-alive connection, then a GET on it
            conn = client.Connection("127.0.0.1", port)
            for _ in range(2):
                status, body, _ = await conn.post(
                    client.build_request("h", port, "/v1/x", _body(False, "a"))
                )
                assert status == 200 and body == app.completion
            status, body, _ = await conn.post(b"GET /v1/models HTTP/1.1\r\nhost: h\r\n\r\n")
            assert status == 200 and b"gpt-4o-mini" in body
            conn.close()
            await asyncio.sleep(0.05)  # the mock's side closes too, before the loop ends
            assert app.requests == 4
            assert set(app.arrivals) == {"s1", "s2"}
            assert app.disconnects == {}  # both streams ended before their clients closed

    asyncio.run(run())


def test_mock_answers_a_pipelined_burst_in_order() -> None:
    """Requests sent back to back on one connection, a stream among them, are answered one after
    the other in the order sent (a long burst too: no recursion per queued request)."""

    async def run() -> None:
        server, app, port = await _mock()
        async with server:
            plain = client.build_request("h", port, "/v1/x", _body(False, "p"))
            stream = client.build_request("h", port, "/v1/x", _body(True, "piped"))
            get = b"GET /healthz HTTP/1.1\r\nhost: h\r\n\r\n"
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(plain + stream + get + plain * 1500)
            answers = []
            for _ in range(1503):
                status, headers = await client._read_head(reader)
                answers.append((status, await client._read_body(reader, headers)))
            writer.close()
            await writer.wait_closed()
            await asyncio.sleep(0.05)
            assert all(status == 200 for status, _ in answers)
            assert answers[0][1] == app.completion
            assert answers[1][1] == b"".join(stream_events(SHAPE.deltas, False))
            assert b"gpt-4o-mini" in answers[2][1]
            assert all(body == app.completion for _, body in answers[3:])
            assert app.requests == 1502

    asyncio.run(run())


def test_mock_notes_when_an_unfinished_stream_is_hung_up() -> None:
    async def run() -> None:
        server, app, port = await _mock()
        async with server:
            res = await client.stream(
                "127.0.0.1",
                port,
                client.build_request("h", port, "/v1/x", _body(True, "gone")),
                hang_up_after_events=2,
            )
            assert res.events >= 2 and res.hung_up_at is not None
            for _ in range(100):
                if "gone" in app.disconnects:
                    break
                await asyncio.sleep(0.01)
            assert app.disconnects["gone"] >= res.hung_up_at
            await asyncio.sleep(0.05)

    asyncio.run(run())


async def _fetch_pieces(pieces: list[bytes]) -> client.StreamResult:
    """Serve one answer written in ``pieces`` (separate reads on the client's side), then close;
    return what the client made of it."""
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.001)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            done.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        res = await client.stream("127.0.0.1", port, b"GET / HTTP/1.1\r\n\r\n")
        await done.wait()
    return res


def _chunked(body: bytes, rnd: random.Random) -> bytes:
    out = b""
    pos = 0
    while pos < len(body):
        size = rnd.randint(1, 40)
        out += b"%x\r\n%s\r\n" % (len(body[pos : pos + size]), body[pos : pos + size])
        pos += size
    return out + b"0\r\n\r\n"


def _split(data: bytes, rnd: random.Random) -> list[bytes]:
    """``data`` cut at up to 30 random places."""
    cuts = sorted(rnd.sample(range(1, len(data)), k=min(len(data) - 1, rnd.randint(1, 30))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@pytest.mark.parametrize("seed", range(6))
def test_client_reads_a_chunked_stream_split_anywhere(seed: int) -> None:
    rnd = random.Random(seed)
    body = b"".join(stream_events(8, True))
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    wire = head + _chunked(body, rnd)

    async def run() -> None:
        res = await _fetch_pieces(_split(wire, rnd))
        assert res.error is None, res.error
        assert res.status == 200
        assert res.events == body.count(b"\n\n")
        assert res.digest == hashlib.sha256(body).hexdigest()
        assert len(res.event_times) == res.events

    asyncio.run(run())


def test_client_reports_a_stream_cut_short() -> None:
    async def run() -> None:
        wire = (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            b'10\r\ndata: {"a":1}\n\n\r\n'  # one whole chunk, then the connection ends
        )
        res = await _fetch_pieces([wire])
        assert res.events == 1
        assert res.error == "IncompleteReadError"

    asyncio.run(run())


def test_mock_streams_usage_as_openai_does() -> None:
    """Asked for usage, every chunk has a null usage before its padding (as OpenAI writes it)
    and a usage-only chunk precedes [DONE]; without, neither: what a relay that asks on the
    client's behalf must take out."""
    plain, asked = stream_events(4, False), stream_events(4, True)
    assert len(asked) == len(plain) + 1
    assert all(re.search(rb'}],"obfuscation":"\w+"}\n\n$', e) for e in plain[:-1])
    assert b"usage" not in b"".join(plain)
    assert all(re.search(rb'}],"usage":null,"obfuscation":"\w+"}\n\n$', e) for e in asked[:-2])
    assert b'"choices":[],"usage":{' in asked[-2] and asked[-1] == plain[-1] == b"data: [DONE]\n\n"
    assert [e.replace(b',"usage":null', b"") for e in asked[:-2]] == plain[:-1]


def test_a_marked_agent_session_moves_its_cache_mark_to_the_newest_message() -> None:
    """Mode C's moving-mark session: the same history as an unmarked one, the newest message
    marked, so no body continues the bytes of the one before."""
    import orjson

    from bench import agent

    plain = list(agent.session(5, rounds=6))
    marked = list(agent.session(5, rounds=6, marked=True))
    previous = b""
    for a, b in zip(plain, marked, strict=True):
        messages = orjson.loads(b.body)["messages"]
        marks = [m.pop("cache_control", None) for m in messages]
        assert marks == [None] * (len(messages) - 1) + [{"type": "ephemeral"}]
        assert orjson.loads(a.body)["messages"] == messages
        assert previous == b"" or not b.body.startswith(previous[: -len(b"]}")])
        previous = b.body


def test_a_timed_agent_session_opens_with_a_later_time_each_turn() -> None:
    """Mode C's session with the time in its system prompt: the same history as a plain one
    but for the time, a minute later each turn, so no body opens with the bytes of the one
    before (nor is filed with it, without a session id)."""
    import orjson

    from bench import agent
    from proxy import bodymemo

    plain = list(agent.session(5, rounds=6))
    timed = list(agent.session(5, rounds=6, timed=True))
    times, keys = [], set()
    for a, b in zip(plain, timed, strict=True):
        messages = orjson.loads(b.body)["messages"]
        first, _, rest = messages[0]["content"].partition("\n")
        messages[0]["content"] = rest
        assert orjson.loads(a.body)["messages"] == messages
        times.append(first)
        keys.add(bodymemo.memo_key(b.body, None))
    assert times == [f"It is 09:{m:02d}." for m in range(1, 8)]
    assert len(keys) == len(timed)


def test_the_sub_agent_benchmark_measures_every_round(capsys: pytest.CaptureFixture[str]) -> None:
    """A few sub-agents for a few rounds: each round's figures are produced and printed."""
    from bench import subagents

    rows = subagents.main(["--agents", "3", "--rounds", "3", "--output-kb", "4"])
    assert [row["round"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["cpu_ms_per_request"] > 0 and row["estimated_mb"] >= 0
        assert row["history_kb"] > 18  # the ~18 KB system prompt and what each round appended
    judged, answered = (int(x) for x in rows[-1]["judged"].split("/"))
    assert (judged, answered) == (3, 3)  # each agent's third turn, with its second
    assert "estimated" in capsys.readouterr().out


def test_wrk_throughput_counts_only_answers_of_2xx() -> None:
    """wrk's "N requests" holds the answers other than 2xx: a proxy answering every request
    with a 400 read as 7,482 requests/s (the built-in generator counts 200s only)."""
    from bench.run import parse_wrk

    report = (
        "Running 1s test @ http://127.0.0.1:1/v1/chat/completions\n"
        "  1 threads and 32 connections\n"
        "  8230 requests in 1.10s, 2.1MB read\n"
        "  Non-2xx or 3xx responses: 8000\n"
        "  Socket errors: connect 0, read 1, write 0, timeout 2\n"
    )
    assert parse_wrk(report) == (230, 8003, 1.1)
    assert parse_wrk("  500 requests in 250.00ms, 1MB read\n") == (500, 0, 0.25)


def test_the_targets_are_judged_without_a_concurrency_32_run() -> None:
    """``--concurrency 1,8``: the targets needed concurrency 32's figure and raised after the
    whole run, before the results were written."""
    from bench.run import QUICK, targets

    fan = f"c{QUICK.fanout}"
    figures: dict[str, float | None] = {
        "cachegate.added_latency_c1_p50_ms": 0.4,
        "cachegate.added_latency_c1_p99_ms": 1.2,
        "cachegate.agent_added_large_p50_ms": 1.0,
        f"cachegate.added_stream_{fan}_ttfb_p50_ms": 5.0,
        f"cachegate.stream_{fan}_lost_events": 0,
        "cachegate.streams_sustained": 40,
        "cachegate.rss_per_stream_kib": None,  # (too few streams to see growth)
        "cachegate.rps_c1": 2000.0,
        "bare.rps_c1": 4000.0,
    }
    judged = targets({"figures": figures}, QUICK)
    assert not any("c=32" in name for name in judged)
    assert judged["RSS per stream <= 64 KiB"]["met"] is False  # unmeasured is not met


def test_a_run_of_some_phases_prints_their_figures_and_refuses_an_unknown_one() -> None:
    """``--phases throughput`` printed nothing but its load generator (the figures, the ratio
    the README quotes, only in the JSON file); a misspelt phase measured nothing and exited 0."""
    from bench.run import main, partial_report

    results = {
        "memory": {"cachegate": {"per_stream_kib": 41.5}},
        "throughput": {
            "tool": "wrk",
            "bare": {"c32": {"rps": 10000.0, "cpu_ms_per_request": 0.08}},
            "cachegate": {"c32": {"rps": 4000.0, "cpu_ms_per_request": 0.2, "samples": [1, 2]}},
        },
    }
    shown = partial_report(results, {"throughput", "sustain"}, ["bare", "cachegate"])
    assert "cachegate.c32.rps: 4000" in shown and "samples" not in shown
    assert "cachegate/bare requests/s c32: 40.0%" in shown
    assert "cachegate RSS per concurrent stream: 41.5 KiB" in shown
    with pytest.raises(SystemExit) as refused:
        main(["--phases", "latency", "--out", "/nonexistent-dir/r.json"])
    assert refused.value.code == 2
    with pytest.raises(SystemExit) as refused:  # (a directory: found out after the run)
        main(["--phases", "throughput", "--out", "/tmp"])
    assert refused.value.code == 2


def test_no_stream_compared_is_no_failed_identity() -> None:
    """A run of phases that relay no stream recorded every identity as ``false``, as if the
    bytes had differed."""
    from bench.run import digest_check

    checked = digest_check({"direct": {}, "cachegate": {}})
    assert checked["cachegate_no_usage_identical"] is None
    differed = digest_check({"direct": {"no_usage": ["a"]}, "cachegate": {"no_usage": ["b"]}})
    assert differed["cachegate_no_usage_identical"] is False


def test_a_sigterm_to_the_runner_stops_it_as_ctrl_c_does() -> None:
    """Python runs no ``finally`` on a SIGTERM: the runner's servers were left listening (their
    parent gone) and its working directory behind."""
    import os
    import signal
    import time

    from bench import procs

    previous = signal.getsignal(signal.SIGTERM)
    try:
        procs.stop_on_sigterm()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # (the handler runs here, and raises)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_next_arm_waits_until_the_proxies_core_is_quiet() -> None:
    """An arm's load starts only once the arm before it has stopped using the proxies' core:
    LiteLLM works on for about a millisecond after each of its answers (its callbacks), and
    seconds after a burst, which was charged to the next arm's figures."""
    from bench import run

    class Busy:
        """A server still at work for ``busy_s``: CPU at half a core, then none."""

        def __init__(self, busy_s: float) -> None:
            self.until = time.monotonic() + busy_s
            self.start = time.monotonic()

        def cpu(self) -> float:
            return (min(time.monotonic(), self.until) - self.start) / 2

    for busy_s in (0.0, 0.3):
        arms = [run.Arm("direct", 1), run.Arm("busy", 2, Busy(busy_s))]  # type: ignore[arg-type]
        t0 = time.monotonic()
        asyncio.run(run.quiet(arms, 0.02, timeout_s=5.0))
        waited = time.monotonic() - t0
        assert busy_s <= waited < busy_s + 0.5, (busy_s, waited)
    # however long an arm works on, the run goes on after the timeout
    arms = [run.Arm("busy", 2, Busy(60.0))]  # type: ignore[arg-type]
    t0 = time.monotonic()
    asyncio.run(run.quiet(arms, 0.02, timeout_s=0.3))
    assert 0.3 <= time.monotonic() - t0 < 1.0
