"""The observers' log lines as written: meta first, refused lines, retries, divergences."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from proxy.assemble import AssembledResponse
from proxy.cache import CacheState
from proxy.compaction import estimate_tokens
from proxy.config import settings_from_mapping
from proxy.eventlog import EventLogWriter, read_events, replay, replay_requests
from proxy.metrics import Metrics, MetricsObserver
from proxy.observers import (
    AccountingObserver,
    EventLogObserver,
    _Baseline,
    _cached_before,
    _carries_answer,
    _longer_lived,
    _random_id,
    _tokens_before,
)
from proxy.pipeline import Exchange
from proxy.prefix import Divergence, fingerprint
from proxy.sessions import CONVERSATIONS_KEPT, MemorySessionStore
from proxy.usage import Usage

Message = dict[str, Any]


class Lines:
    """A writer that keeps what it is given; ``refuse`` lists the exchange ids whose request
    lines it refuses, as a full queue would."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.events: list[dict[str, Any]] = []
        self.refuse = refuse
        self.broken: dict[str, None] = {}  # as the real writer's: sessions that lost a line
        self.weights: list[int] = []  # each request line's, as given

    def emit(
        self,
        session_id: str,
        event: dict[str, Any],
        first_in_file: bool = False,
        secrets: tuple[str, ...] = (),
        weight: int = 0,
    ) -> bool:
        if event["type"] == "request" and event["exchange"] in self.refuse:
            return False
        self.events.append(event)
        if event["type"] == "request":
            self.weights.append(weight)
        return True


def exchange(eid: int, messages: list[Message], session: str = "s1") -> Exchange:
    ex = Exchange("chat", "POST", "chat/completions", 0.0, 0.0, exchange_id=eid, model="gpt-4o")
    ex.session_id, ex.body = session, {"model": "gpt-4o", "messages": messages}
    return ex


def msgs(*texts: str) -> list[Message]:
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)
    ]


def test_a_refused_request_line_is_never_the_base_of_a_later_one() -> None:
    store = MemorySessionStore()
    store.create("s1", 0.0).meta_written = True
    lines = Lines(refuse=(1,))
    log = EventLogObserver(settings_from_mapping({}), store, lines)  # type: ignore[arg-type]
    first = msgs("a", "b", "c")
    log.on_request(exchange(1, first))  # refused: not in the log
    second = [*first, *msgs("d", "e")[:1]]
    log.on_request(exchange(2, second))
    assert [e["exchange"] for e in lines.events] == [2]
    assert lines.events[0]["base_exchange"] is None
    assert dict(replay(lines.events)) == {2: second}


def test_a_request_line_weighs_the_share_of_the_body_it_holds() -> None:
    """The writer's queue is bounded by the bytes of request bodies its lines hold
    (``eventlog.MAX_QUEUE_BYTES``): a first turn's line holds its whole history, a later turn's
    only what it appended."""
    store = MemorySessionStore()
    store.create("s1", 0.0).meta_written = True
    lines = Lines()
    log = EventLogObserver(settings_from_mapping({}), store, lines)  # type: ignore[arg-type]
    first = msgs("a" * 1000, "b" * 1000, "c" * 1000)
    turn = exchange(1, first)
    turn.request_bytes = 300_000
    log.on_request(turn)
    second = [*first, {"role": "assistant", "content": "d"}]
    turn = exchange(2, second)
    turn.request_bytes = 300_100
    log.on_request(turn)
    # a turn that appends a 2 MB tool output to a long history weighs the output, not its
    # share of the messages (1/60th: under the bound's notice, 80 MB of such lines went in)
    output = {"role": "tool", "tool_call_id": "c1", "content": "x" * 2_000_000}
    call = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    third = [*second, {"role": "assistant", "content": None, "tool_calls": [call]}, output]
    turn = exchange(3, third)
    turn.request_bytes = 2_300_400
    log.on_request(turn)
    assert [len(e["appended"]) for e in lines.events] == [3, 1, 2]
    assert lines.weights[0] == 300_000
    assert lines.weights[1] < 100
    assert 2_000_000 < lines.weights[2] < 2_000_100


def test_a_line_the_writer_lost_is_no_base_and_the_next_is_written_whole(tmp_path: Path) -> None:
    """Accepted by emit, then lost by the writer (the file could not be written): the next
    request line must not be coded against it, or replay would lose every later one."""
    writer = EventLogWriter(tmp_path)
    writer.start()
    store = MemorySessionStore()
    store.create("s1", 0.0).meta_written = True
    log = EventLogObserver(settings_from_mapping({}), store, writer)
    blocker = tmp_path / "s1.jsonl"
    blocker.mkdir()  # the session's file cannot be opened: its lines are lost
    first = msgs("a", "b", "c")
    log.on_request(exchange(1, first))
    assert writer.flush()
    blocker.rmdir()
    second = [*first, {"role": "assistant", "content": "d"}]
    log.on_request(exchange(2, second))
    third = [*second, {"role": "user", "content": "e"}]
    log.on_request(exchange(3, third))
    assert writer.close()
    lost, *events = read_events(tmp_path / "s1.jsonl").events
    assert (lost["type"], lost["lines"]) == ("lines_lost", 1)  # the file says it has a hole
    assert [(e["exchange"], e["base_exchange"], e["base"]) for e in events] == [
        (2, None, 0),
        (3, 2, 4),
    ]
    assert dict(replay(events)) == {2: second, 3: third}


def test_a_meta_line_the_writer_refused_is_tried_again() -> None:
    class Refusing(Lines):
        def __init__(self) -> None:
            super().__init__()
            self.refused_meta = 0

        def emit(
            self, session_id: str, event: dict[str, Any], first_in_file: bool = False, **kw: Any
        ) -> bool:
            if event["type"] == "session_meta" and not self.refused_meta:
                self.refused_meta += 1  # a full queue, once
                return False
            return super().emit(session_id, event, first_in_file, **kw)

    store = MemorySessionStore()
    store.create("s1", 0.0)
    lines = Refusing()
    log = EventLogObserver(settings_from_mapping({}), store, lines)  # type: ignore[arg-type]
    log.on_request(exchange(1, msgs("a")))
    log.on_request(exchange(2, msgs("a", "b", "c")))
    log.on_request(exchange(3, msgs("a", "b", "c", "d", "e")))
    kinds = [e["type"] for e in lines.events]
    # emitted again with the next event, and only once it was taken (the real writer writes a
    # meta line only as a file's first: this retry helps when the refused burst took it all)
    assert kinds == ["request", "session_meta", "request", "request"]


def test_a_meta_line_refused_with_its_request_goes_with_the_response(tmp_path: Path) -> None:
    """A burst past the writer's queue refused a new session's meta line and its request line;
    the meta line was offered again only with a later request, so a session of one exchange had
    a file that did not say it was cachegate's log; and each refusal of the meta line was
    counted as a line lost, where the file reports only the lost request line."""
    losses: list[str] = []
    writer = EventLogWriter(tmp_path, max_queue=2, on_loss=losses.append)  # not started yet
    for i in range(4):  # new sessions' meta lines: up to twice the bound
        assert writer.emit(f"o{i}", {"type": "session_meta", "session": f"o{i}"}, True)
    store = MemorySessionStore()
    store.create("s1", 0.0)
    log = EventLogObserver(settings_from_mapping({}), store, writer)
    ex = exchange(1, msgs("a"))
    log.on_request(ex)  # its meta line and its request line refused
    assert losses == ["queue_full"]  # the request line: the meta line is offered again
    writer.start()
    assert writer.flush()
    ex.status = 200
    log.on_response(ex)
    assert writer.close()
    events = read_events(tmp_path / "s1.jsonl").events
    assert [e["type"] for e in events] == ["session_meta", "lines_lost", "response"]
    assert (events[1]["lines"], events[1]["requests"]) == (1, 1)
    assert losses == ["queue_full"]


def test_a_retried_exchange_is_a_base_only_as_it_was_last_sent() -> None:
    """A request refused for its length and re-sent compacted is logged twice under one id;
    replay takes the latest, so a later line may only be coded against that one."""
    store = MemorySessionStore()
    store.create("s1", 0.0).meta_written = True
    lines = Lines()
    log = EventLogObserver(settings_from_mapping({}), store, lines)  # type: ignore[arg-type]
    original = msgs("m0", "m1", "m2", "m3", "m4", "m5")
    log.on_request(exchange(1, original))
    compacted = [original[0], {"role": "user", "content": "SUMMARY"}, original[4], original[5]]
    log.on_retry(exchange(1, compacted))
    later = [*original[:3], {"role": "user", "content": "edited"}]
    log.on_request(exchange(2, later))
    assert dict(replay(lines.events)) == {1: compacted, 2: later}


def test_a_new_session_compacted_at_once_still_starts_with_its_meta_line(tmp_path: Path) -> None:
    """The compaction is noted before the request: the meta line must still come first."""
    writer = EventLogWriter(tmp_path)
    writer.start()
    store = MemorySessionStore()
    store.create("s1", 0.0)
    log = EventLogObserver(settings_from_mapping({}), store, writer)
    ex = exchange(1, msgs("a", "b", "c"))
    comp = SimpleNamespace(
        start=0,
        covered=2,
        message={"role": "user", "content": "S"},
        tokens_before=9,
        tokens_after=3,
        prefix_digest="ab" * 16,
        opening="0:" + "cd" * 16,
    )
    log.on_compaction(ex, comp, "model")
    log.on_request(ex)
    assert writer.close()
    kinds = [e["type"] for e in read_events(tmp_path / "s1.jsonl").events]
    assert kinds == ["session_meta", "compacted", "request"]


def test_a_divergence_goes_in_the_response_line_not_the_request_transforms() -> None:
    """Accounting notes where the prefix changed for the response's line; a request line
    written after it (observers of one batch) still shows only the request's own transforms."""
    from prometheus_client import CollectorRegistry

    settings = settings_from_mapping({})
    store = MemorySessionStore()
    state = store.create("s1", 0.0)
    state.meta_written = True
    lines = Lines()
    accounting = AccountingObserver(settings, store, Metrics(CollectorRegistry(), ()))
    log = EventLogObserver(settings, store, lines)  # type: ignore[arg-type]
    usage = Usage(5000, 10, 0, 0, True)
    first = exchange(1, [{"role": "system", "content": "rules v1"}, *msgs("go")])
    first.usage, first.status = usage, 200
    accounting.on_response(first)
    second = exchange(2, [{"role": "system", "content": "rules v2"}, *msgs("go")])
    second.usage, second.status = usage, 200
    accounting.on_response(second)
    log.on_request(second)
    log.on_response(second)
    request, response = lines.events
    assert request["transforms"] == {}
    assert response["divergence"]["location"] == "system"
    assert isinstance(state.extra["cache"], CacheState)


def test_an_exchange_in_flight_completes_its_accounting_after_its_session_is_forgotten() -> None:
    """The memory budget may forget a session while one of its requests is still streaming (other
    sessions' requests arrived meanwhile): that exchange's cost, cache figures and log lines are
    still written, against the state it was served with, and not against a new session that
    took the same id since."""
    from prometheus_client import CollectorRegistry

    settings = settings_from_mapping({})
    store = MemorySessionStore(max_bytes=1024 * 1024)
    served = store.create("s1", 0.0)
    store.weigh(served, 200_000)
    lines = Lines()
    metrics = Metrics(CollectorRegistry(), ())
    accounting = AccountingObserver(settings, store, metrics)
    log = EventLogObserver(settings, store, lines)  # type: ignore[arg-type]
    ex = exchange(7, msgs("a long task"))
    ex.session = served
    ex.usage, ex.status = Usage(5000, 10, 0, 0, True), 200
    store.weigh(store.create("other", 1.0), 300_000)  # over the budget: s1 is forgotten
    assert store.get("s1") is None
    again = store.create("s1", 2.0)  # and the same id comes back meanwhile

    log.on_request(ex)
    accounting.on_response(ex)
    log.on_response(ex)
    assert [e["type"] for e in lines.events] == ["session_meta", "request", "response"]
    assert ex.cost is not None and ex.cost["actual"] > 0
    assert "baselines" in served.extra and served.recent  # the state it was served with
    assert again.extra == {} and again.recent == [] and not again.meta_written


def test_a_model_without_prices_is_said_once_not_silently_costed_at_zero(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from prometheus_client import CollectorRegistry

    store = MemorySessionStore()
    store.create("s1", 0.0)
    accounting = AccountingObserver(
        settings_from_mapping({}), store, Metrics(CollectorRegistry(), ())
    )
    with caplog.at_level(logging.INFO, logger="proxy.observers"):
        key = "Qw3rTy9uIoP4aSdF6gHjK2lZxC8vBnM1"  # a client's own key, of no known pattern
        models = [
            "my-local-model",
            "my-local-model",
            "gpt-4o",
            "x\x1b[31m\nFORGED\x9b\x7f",
            f"pasted-{key}",
        ]
        for i, model in enumerate(models):
            ex = exchange(i + 1, msgs(f"task {i}"))
            ex.upstream_headers = [(b"authorization", f"Bearer {key}".encode())]
            ex.model = model
            ex.usage, ex.status = Usage(5000, 10, 0, 0, True), 200
            accounting.on_response(ex)
    said = [r.getMessage() for r in caplog.records if "has no prices" in r.getMessage()]
    assert said == [
        "model 'my-local-model' has no prices (the configured entry '*'): its cost counts as $0; "
        'set price_input and price_output in [models."my-local-model"] of the config file',
        # a client's name, shown escaped (as TOML reads it): no control character reaches the
        # operator's terminal
        "model 'x\\x1b[31m\\nFORGED\\x9b\\x7f' has no prices (the configured entry '*'): its"
        " cost counts as $0; set price_input and price_output in"
        ' [models."x\\u001b[31m\\u000aFORGED\\u009b\\u007f"] of the config file',
        # the client's own key, in the name it sent: not shown
        "model 'pasted-[REDACTED]' has no prices (the configured entry '*'): its cost counts"
        ' as $0; set price_input and price_output in [models."pasted-[REDACTED]"] of the'
        " config file",
    ]


def test_a_long_model_name_is_said_clipped_its_key_redacted_and_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client's model name is redacted on the event loop before it is said: one of 100 KB
    ("token=token=…") held the loop 14 s; a key at the clip is redacted whole first."""
    import time

    from prometheus_client import CollectorRegistry

    store = MemorySessionStore()
    store.create("s1", 0.0)
    accounting = AccountingObserver(
        settings_from_mapping({}), store, Metrics(CollectorRegistry(), ())
    )
    key = "sk-proj-" + "Ab3" * 12
    name = "m " + "x" * 190 + key + " token=" * 17_000
    ex = exchange(1, msgs("task"))
    ex.model = name
    ex.usage, ex.status = Usage(5000, 10, 0, 0, True), 200
    began = time.process_time()
    with caplog.at_level(logging.INFO, logger="proxy.observers"):
        accounting.on_response(ex)
    assert time.process_time() - began < 1.0
    said = [r.getMessage() for r in caplog.records if "has no prices" in r.getMessage()]
    assert len(said) == 1 and len(said[0]) < 800
    assert "…" in said[0] and "sk-proj-Ab3" not in said[0] and "Ab3Ab3" not in said[0]


def test_models_without_prices_are_said_once_each_and_not_without_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client cycling through 300 model names: a line for each, again for each once the
    terms cache (256 names) was full."""
    from prometheus_client import CollectorRegistry

    from proxy.observers import _UNPRICED_SAID

    store = MemorySessionStore()
    store.create("s1", 0.0)
    accounting = AccountingObserver(
        settings_from_mapping({}), store, Metrics(CollectorRegistry(), ())
    )
    with caplog.at_level(logging.INFO, logger="proxy.observers"):
        for i, model in enumerate([f"local-{n}" for n in range(300)] * 2):
            ex = exchange(i + 1, msgs(f"task {i}"))
            ex.model = model
            ex.usage, ex.status = Usage(5000, 10, 0, 0, True), 200
            accounting.on_response(ex)
    said = [r.getMessage() for r in caplog.records if "no prices" in r.getMessage()]
    assert len(said) == _UNPRICED_SAID + 1
    assert len({line.split("'")[1] for line in said[:-1]}) == _UNPRICED_SAID
    assert said[-1].startswith(f"more than {_UNPRICED_SAID} models have no prices")


def test_long_model_names_are_not_kept_by_the_accounting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model name is the client's, as long as its body: the accounting's terms by model and
    its no-prices notes keep none longer than 256 characters (they kept up to 256 and 64 names
    of any length, past the session's own memory budget, which its requests count in)."""
    from prometheus_client import CollectorRegistry

    store = MemorySessionStore()
    store.create("s1", 0.0)
    accounting = AccountingObserver(
        settings_from_mapping({}), store, Metrics(CollectorRegistry(), ())
    )
    with caplog.at_level(logging.INFO, logger="proxy.observers"):
        for i in range(30):
            ex = exchange(i + 1, msgs(f"task {i}"))
            ex.model = f"local-{i}-" + "x" * 300_000
            ex.usage, ex.status = Usage(5000, 10, 0, 0, True), 200
            accounting.on_response(ex)
            assert ex.cost is not None and ex.cost["actual"] == 0  # (accounted all the same)
    kept = [*accounting._terms, *accounting._unpriced_said]
    assert all(len(name or "") <= 256 for name in kept), [len(n or "") for n in kept]
    said = [r.getMessage() for r in caplog.records if "has no prices" in r.getMessage()]
    assert len(said) == 30  # each said once, as before


def test_a_key_sent_as_a_model_name_is_not_shown_on_stderr(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The no-prices line quotes the model name a client sent: a key pasted there (or the
    operator's own) is redacted there as in the session log."""
    from prometheus_client import CollectorRegistry

    store = MemorySessionStore()
    store.create("s1", 0.0)
    operator_key = "srvKEY0123456789abcdefSERVER"
    accounting = AccountingObserver(
        settings_from_mapping({}), store, Metrics(CollectorRegistry(), ()), [operator_key]
    )
    client_key = "sk-proj-Zq7TxClientKey9f8e7d6c5b4a3Zq7TxClientKey9"
    with caplog.at_level(logging.INFO, logger="proxy.observers"):
        for i, model in enumerate([client_key, f"m-{operator_key}"]):
            ex = exchange(i + 1, msgs(f"task {i}"))
            ex.model = model
            ex.usage, ex.status = Usage(5000, 10, 0, 0, True), 200
            accounting.on_response(ex)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert said.count("has no prices") == 2
    assert client_key[:12] not in said and operator_key not in said
    assert "[REDACTED]" in said


def test_request_lines_carry_the_parameters_and_the_tools_when_they_change() -> None:
    """What was forwarded, resendable from the log: the other parameters on every line, the
    tools (often tens of KB, the same every turn) on the lines where they changed, a refused
    line's change on the next written one."""
    settings = settings_from_mapping({})
    store = MemorySessionStore()
    store.create("s1", 0.0)
    lines = Lines(refuse=(4,))
    log = EventLogObserver(settings, store, lines)  # type: ignore[arg-type]
    tools = [{"type": "function", "function": {"name": "read", "parameters": {}}}]
    other = [{"type": "function", "function": {"name": "write", "parameters": {}}}]
    history: list[Message] = []
    for eid, turn_tools in enumerate([tools, tools, list(tools), other, other, None], start=1):
        history = [*history, {"role": "user", "content": f"turn {eid}"}]
        ex = exchange(eid, history)
        assert ex.body is not None
        ex.body = {**ex.body, "temperature": 0.2, "stream_options": {"include_usage": True}}
        if turn_tools is not None:
            ex.body["tools"] = turn_tools
        log.on_request(ex)
    requests = [e for e in lines.events if e["type"] == "request"]
    assert [e["exchange"] for e in requests] == [1, 2, 3, 5, 6]  # 4 was refused
    assert all(
        e["params"] == {"temperature": 0.2, "stream_options": {"include_usage": True}}
        for e in requests
    )
    assert [e.get("tools", "-") for e in requests] == [tools, "-", "-", other, None]


def test_conversations_with_other_tools_name_the_line_that_carried_theirs() -> None:
    """A main agent and a sub-agent with other tools under one session: each line carried its
    tools in full (tens of KB every turn); a line now names the earlier line that has them, and
    replay gives every request its own."""
    settings = settings_from_mapping({})
    store = MemorySessionStore()
    store.create("s1", 0.0)
    lines = Lines()
    log = EventLogObserver(settings, store, lines)  # type: ignore[arg-type]
    main_tools = [{"type": "function", "function": {"name": "edit", "parameters": {}}}]
    sub_tools = [{"type": "function", "function": {"name": "grep", "parameters": {}}}]
    sent = []
    for eid, (who, tools) in enumerate(
        [("main", main_tools), ("sub", sub_tools), ("main", main_tools), ("sub", list(sub_tools))],
        start=1,
    ):
        ex = exchange(eid, msgs(f"{who} turn {eid}"))
        assert ex.body is not None
        ex.body = {**ex.body, "tools": tools}
        log.on_request(ex)
        sent.append(ex.body)
    requests = [e for e in lines.events if e["type"] == "request"]
    assert [(e.get("tools") is not None, e.get("tools_ref")) for e in requests] == [
        (True, None),
        (True, None),
        (False, 1),
        (False, 2),
    ]
    replayed = replay_requests(lines.events)
    assert [r["tools"] for r in replayed] == [b["tools"] for b in sent]


class _Accounting:
    """An AccountingObserver on one session, fed exchanges with the usage a provider reported."""

    def __init__(self, models: dict[str, Any] | None = None) -> None:
        from prometheus_client import CollectorRegistry

        self.store = MemorySessionStore()
        self.state = self.store.create("s1", 0.0)
        self.metrics = Metrics(CollectorRegistry(), ())
        models = {"gpt-4o": {"cache_ttl_s": 3600}} if models is None else models
        settings = settings_from_mapping({"models": models})
        self.observer = AccountingObserver(settings, self.store, self.metrics)
        self.eid = 0
        # the usage holds a cache-write field (OpenRouter's ``cache_write_tokens``, for every
        # model it serves)
        self.write_field = False

    def send(
        self,
        messages: list[Message],
        prompt: int,
        read: int,
        status: int = 200,
        answer: str | Message | None = None,
    ) -> Exchange:
        self.eid += 1
        ex = exchange(self.eid, messages)
        if answer is not None:
            said = {"role": "assistant", "content": answer} if isinstance(answer, str) else answer
            ex.assembled = AssembledResponse(said)
        return self._answered(ex, prompt, read, status)

    def send_body(
        self,
        body: dict[str, Any],
        prompt: int,
        read: int = 0,
        at: float | None = None,
        waited: float = 0.0,
    ) -> Exchange:
        self.eid += 1
        ex = exchange(self.eid, body["messages"])
        ex.body = body
        ex.upstream_wait_s = waited  # (on the provider before it went out: a summary call)
        if isinstance(body.get("model"), str):
            ex.model = body["model"]  # (as the pipeline reads it)
        return self._answered(ex, prompt, read, 200, at)

    def _answered(
        self, ex: Exchange, prompt: int, read: int, status: int, at: float | None = None
    ) -> Exchange:
        ex.session, ex.started_at = self.state, float(self.eid) if at is None else at
        ex.t0 = ex.started_at  # (requests sent at one time went out together: sub-agents)
        ex.usage = Usage(prompt, 10, read, 0, True, self.write_field)
        ex.status = status
        self.observer.on_response(ex)
        return ex


def _system(text: str) -> Message:
    return {"role": "system", "content": text}


def test_the_tokens_before_an_edit_count_no_media() -> None:
    """Where an edit lies in the previous prompt's tokens (a lost prefix is told by it): a
    screenshot before it counts nothing (its tokens depend on its size and the model: the
    figure is a lower bound, where the check was dropped for any image)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    system = _system("agent " * 400)
    history = [
        system,
        {"role": "user", "content": [image, {"type": "text", "text": "what is on screen?"}]},
        *msgs("output " * 800, "ok", "more " * 800),
    ]
    old = fingerprint({"model": "m", "messages": history})
    edited = [*history[:4], {"role": "user", "content": "less"}]
    new = fingerprint({"model": "m", "messages": edited})
    edit = Divergence("messages", 4, "user", "content", "", "")
    whole = estimate_tokens(history)
    text_before = estimate_tokens([system, *history[2:4]])
    assert _tokens_before(old, new, edit, 10_000) == 10_000 * text_before // whole
    params = Divergence("params", None, None, "model", "", "")
    assert _tokens_before(old, new, params, 10_000) == 0


def test_the_tokens_before_an_edit_count_the_text_before_it_in_its_message() -> None:
    """A line added at the end of a long system prompt (the date there, "Be brief."): the
    prompt before it was the provider's to read. Counted as nothing, a provider that had lost
    the prefix was taken to have lost it to the edit (the whole prompt charged as its waste)."""
    system = "Follow the rules. " * 2_000
    history = [_system(system), {"role": "user", "content": "hi"}]
    old = fingerprint({"model": "m", "messages": history})
    new = fingerprint({"model": "m", "messages": [_system(system + " Be brief."), history[1]]})
    edit = Divergence("system", 0, "system", "content", "", "")
    before = _tokens_before(old, new, edit, 10_000)
    assert 9_500 < before <= 10_000
    # an edit in its middle: about half of it
    middle = system[: len(system) // 2] + "Or not. " + system[len(system) // 2 :]
    new = fingerprint({"model": "m", "messages": [_system(middle), history[1]]})
    assert 4_500 < _tokens_before(old, new, edit, 10_000) < 5_500


@pytest.mark.parametrize("write_field", [False, True])
def test_an_edit_after_the_provider_lost_the_prefix_is_not_charged_the_loss(
    write_field: bool,
) -> None:
    """A late tool output edited in a turn that read nothing of the ~13,000 unchanged tokens
    before it: the provider had lost the prefix (evicted it), the edit is not its cause. Behind
    OpenRouter, whose usage has a ``cache_write_tokens`` for every model, the edit was charged
    the whole prompt as a ``prefix_rewrite``."""
    acc = _Accounting()
    acc.write_field = write_field
    history = [_system("Follow the rules. " * 3_000), *msgs("read data.csv", "reading", "x" * 9)]
    acc.send(history, 20_000, 0)
    history = [*history, *msgs("done", "next")]
    acc.send(history, 20_100, 19_968)
    edited = [*history[:3], {"role": "user", "content": "y" * 9}, *history[4:], *msgs("ok", "go")]
    ex = acc.send(edited, 20_200, 0)
    assert ex.divergence is not None and ex.cache is not None
    assert (ex.cache["cause"], ex.cache["location"]) == ("unexplained", None), ex.cache


def test_a_history_trimmed_at_its_start_is_still_its_conversation() -> None:
    """Agents drop their oldest turns when the window fills: the messages move up, and a
    comparison by position took the request for another conversation and hid a 9,000-token
    miss. What was trimmed could not be read: its share of the previous prompt is not
    expected."""
    acc = _Accounting()
    history = [_system("agent"), *msgs("one", "a1", "two", "a2", "three", "a3", "four")]
    acc.send(history, 9000, 0)
    trimmed = [history[0], *history[3:], *msgs("a4", "five")]
    ex = acc.send(trimmed, 9000, 0)
    assert ex.cache is not None and ex.divergence is not None
    expected = 9000 - 9000 * estimate_tokens(history[1:3]) // estimate_tokens(history)
    assert (ex.cache["expected"], ex.cache["waste"], ex.cache["cause"]) == (
        expected,
        expected,
        "prefix_rewrite",
    )


def test_a_rewind_wastes_only_what_the_branch_still_holds_an_edit_all_it_holds() -> None:
    """The client goes back two turns and asks something else: the turns it abandoned were
    charged as waste. An edit in place, followed by what the previous request sent, still
    costs all after it; so does a timestamp put in every message."""
    acc = _Accounting()
    history = [_system("agent"), *msgs("one", "a1", "two", "a2", "three")]
    acc.send(history, 9000, 0)
    branch = [*history[:3], *msgs("something else entirely " * 20)]
    ex = acc.send(branch, 9000, 0)
    assert ex.cache is not None and ex.divergence is not None
    assert ex.cache["expected"] == 9000 - 9000 * estimate_tokens(history[3:]) // estimate_tokens(
        history
    )
    for edited in (
        [*history[:2], {"role": "assistant", "content": "a1, edited"}, *history[3:]],
        [history[0], *msgs("[1 min ago] one", "a1", "[1 min ago] two", "a2", "[0 min ago] three")],
    ):
        acc = _Accounting()
        acc.send(history, 9000, 0)
        ex = acc.send([*edited, *msgs("a3", "four")], 9100, 0)
        assert ex.cache is not None
        assert (ex.cache["expected"], ex.cache["waste"]) == (9000, 9000)


def test_a_rewrite_is_compared_with_its_own_conversation_not_the_latest_of_equals() -> None:
    """The main agent's turn, a sub-agent with the same parameters and tools, then the main
    agent with its system prompt rewritten: both earlier requests share as much with it (up to
    the system prompt); the sub-agent's is the later one, but the rewrite is the main agent's."""
    acc = _Accounting()
    main = [_system("main agent"), *msgs("fix the bug")]
    acc.send(main, 10_000, 0)
    acc.send([_system("sub agent"), *msgs("find the file")], 3_000, 0)
    rewritten = [_system("main agent, rewritten"), *main[1:], *msgs("done?", "go on")[1:]]
    ex = acc.send(rewritten, 10_100, 0)
    assert ex.cache is not None and ex.divergence is not None
    assert ex.divergence["location"] == "system"
    assert (ex.cache["expected"], ex.cache["waste"]) == (10_000, 10_000)


def _jobs(n: int) -> list[str]:
    """``n`` sub-agents' tasks, each in other words (not told apart by a number alone, which
    reads as a volatile token)."""
    verbs = ["search", "parse", "review", "deploy", "document", "profile", "refactor", "triage"]
    things = ["code", "tests", "docs", "config", "schema", "build"]
    return [f"{verb} the {thing}" for thing in things for verb in verbs][:n]


def test_a_fan_out_of_one_shot_sub_agents_does_not_evict_the_main_agents_conversation() -> None:
    """More one-request sub-agents after two main-agent turns than a session keeps
    conversations: the least recently seen, the main agent's, was forgotten, and its next
    turn's rewrite read as a new conversation (no waste, no divergence)."""
    acc = _Accounting()
    main = [_system("main agent"), *msgs("fix the bug")]
    acc.send(main, 10_000, 0)
    main = [*main, *msgs("looking", "go on")]
    acc.send(main, 10_100, 10_000)
    jobs = _jobs(CONVERSATIONS_KEPT)
    for job in [*jobs, "summarize it all"]:
        acc.send([_system(f"You {job}."), *msgs(f"Please {job}.")], 3_000, 0)
    rewritten = [_system("main agent\nCurrent time: 2026-12-02T10:00:00Z"), *main[1:]]
    ex = acc.send(rewritten, 10_100, 0)
    assert ex.divergence is not None and ex.divergence["location"] == "system"
    assert ex.cache is not None and (ex.cache["expected"], ex.cache["waste"]) == (10_100, 10_100)


def test_the_live_branch_after_a_rewind_is_not_forgotten_as_a_one_shot() -> None:
    """After a rewind the new branch is the live one: seen once, it was forgotten first when
    sub-agents fanned out, and its next turn read as a rewrite of the abandoned branch."""
    acc = _Accounting()
    main = [_system("main agent"), *msgs("fix the bug")]
    for turn in range(3):
        acc.send(main, 10_000 + 100 * turn, 0)
        main = [*main, *msgs(f"reply {turn}", f"go on {turn}")]
    branch = [*main[:3], *msgs("Actually, a different question.")]
    acc.send(branch, 10_000, 0)
    jobs = _jobs(CONVERSATIONS_KEPT - 1)  # with both branches: one more
    for job in jobs:
        acc.send([_system(f"You {job}."), *msgs(f"Please {job}.")], 3_000, 0)
    ex = acc.send([*branch, *msgs("reply", "and then?")], 10_200, 10_000)
    assert ex.divergence is None
    assert ex.cache is not None and ex.cache["waste"] == 0


def test_real_shapes_of_rewrites_are_charged_only_for_what_was_sent_and_is_still_held() -> None:
    """Prompt counts as the estimate gives them (a tokenizer of 4 bytes a token): a sub-agent
    forked once from the main history, then the main agent going on, was charged the
    sub-agent's task; a rewind to several new messages all the turns it abandoned; a tool
    output cut to a stub, with a new one appended, the new one."""

    def tokens(messages: list[Message]) -> int:
        return estimate_tokens(messages)

    def big(fill: str) -> str:
        return fill * 8000

    main = [_system("main agent"), *msgs("fix the bug", "looking " + big("a"), "go on " + big("b"))]
    # a one-shot sub-agent forked from the main history, then the main agent goes on
    acc = _Accounting()
    acc.send(main, tokens(main), 0)
    fork = [*main, *msgs("SUB-AGENT TASK " + big("c"))]
    acc.send(fork, tokens(fork), tokens(main))
    went_on = [*main, {"role": "assistant", "content": "ran it"}, *msgs("result " + big("d"))]
    ex = acc.send(went_on, tokens(went_on), tokens(main))
    assert ex.cache is not None and ex.cache["waste"] == 0
    assert abs(ex.cache["expected"] - tokens(main)) < 50
    # a rewind to after the first answer, with more new messages than it abandons
    acc = _Accounting()
    acc.send(main, tokens(main), 0)
    rewound = [*main[:3], *msgs("file 1 " + big("e"), "noted", "file 2 " + big("f"), "ok", "and?")]
    ex = acc.send(rewound, tokens(rewound), tokens(main[:3]))
    assert ex.cache is not None and ex.cache["waste"] == 0
    assert abs(ex.cache["expected"] - tokens(main[:3])) < 50
    # an old tool output cut to a stub, a new one appended: the new one was never sent
    acc = _Accounting()
    acc.send(main, tokens(main), 0)
    stubbed = [*main[:2], {"role": "assistant", "content": "[output trimmed]"}, main[3]]
    stubbed += msgs("reply", "new output " + big("g"))[1:]
    ex = acc.send(stubbed, tokens(stubbed), 0)
    assert ex.cache is not None
    assert abs(ex.cache["expected"] - tokens([*main[:2], main[3]])) < 50


def test_sub_agents_fanned_out_from_the_first_turn_do_not_evict_the_main_agent() -> None:
    """As many sub-agents spawned from the main agent's first turn as a session keeps
    conversations: its conversation, seen once too, was the least recently seen one-shot,
    forgotten first; its rewrite went unreported."""
    acc = _Accounting()
    main = [_system("main agent"), *msgs("explore the repo")]
    acc.send(main, 10_000, 0)
    jobs = _jobs(CONVERSATIONS_KEPT)
    for job in jobs:
        acc.send([_system(f"You {job}."), *msgs(f"Please {job}.")], 3_000, 0)
    rewritten = [_system("main agent\nCurrent time: 2026-12-02T10:00:00Z"), *main[1:]]
    ex = acc.send([*rewritten, *msgs("found", "go on")], 10_100, 0)
    assert ex.divergence is not None and ex.divergence["location"] == "system"
    assert ex.cache is not None and ex.cache["waste"] == 10_000


def test_a_title_request_answered_first_does_not_leave_the_main_agent_unprotected() -> None:
    """A title request (or Claude Code's start-up probe), answered before the main agent's
    first turn, was the session's first conversation, the one never forgotten; the main
    agent's, seen once, went first when its first turn fanned out 32 one-shot sub-agents, and
    its next turn's miss (the time in its prompt changed) was never counted: expected 0."""
    acc = _Accounting()
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    acc.send_body(
        {"model": "gpt-4o", "messages": [_system("Write a title."), *msgs("fix the bug")]}, 60
    )
    main = [_system("main agent, 10:00"), *msgs("explore the repo")]
    acc.send_body({"model": "gpt-4o", "messages": main, "tools": tools}, 10_000)
    for job in _jobs(CONVERSATIONS_KEPT):
        body = {"model": "gpt-4o", "messages": [_system(f"You {job}."), *msgs(f"Please {job}.")]}
        acc.send_body({**body, "tools": tools}, 3_000)
    rewritten = [_system("main agent, 10:01"), *main[1:], *msgs("found", "go on")]
    ex = acc.send_body({"model": "gpt-4o", "messages": rewritten, "tools": tools}, 10_100)
    assert ex.divergence is not None and ex.divergence["location"] == "system"
    assert ex.cache is not None and ex.cache["waste"] == ex.cache["expected"] > 9_000, ex.cache


@pytest.mark.parametrize("noted", [True, False])
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_each_sub_agent_fanned_out_together_is_accounted_against_the_history_they_share(
    order: tuple[int, int, int], noted: bool
) -> None:
    """The main agent's turn was read; then three sub-agents go out together, each with that
    history and its own task, and each misses the whole of it. Only the first answered was
    compared with the main turn: the others were compared with it, a sibling still unread when
    they went out, and showed no waste (the session's waste 2 x 4,400 too low), whichever
    order the answers came in. (Not ``noted``: the others still in flight, their request
    observers not run yet, as while a compaction's summary call holds them.)"""
    acc = _Accounting()
    main = [_system("main agent"), *msgs("explore the repo", "I will fan out.")]
    acc.send(main, 4_400, 0)  # sent at 1.0, read at once
    subs = [[*main, *msgs(f"Sub-agent task: {job}.")] for job in _jobs(3)]
    sent: list[Exchange] = []
    for k, history in enumerate(subs):
        ex = exchange(10 + k, history)
        ex.session, ex.started_at, ex.t0 = acc.state, 5.0, 5.0  # out together
        ex.ttfb_s = 0.3 + 0.2 * k  # none read before the others went out
        if noted:
            acc.observer.on_request(ex)
        sent.append(ex)
    for answered, k in enumerate(order):  # answered in this order, each missing the history
        ex = sent[k]
        acc.state.requests = 0 if noted else len(order) - answered - 1  # (the others in flight)
        ex.usage, ex.status = Usage(4_600, 10, 0, 0, True), 200
        acc.observer.on_response(ex)
    for ex in sent:
        assert ex.cache is not None and ex.divergence is None
        assert (ex.cache["expected"], ex.cache["waste"]) == (4_400, 4_400), ex.exchange_id
    # and the next turn of one of them, sent once its own was read, goes on from its own
    acc.eid = 10  # (sent at 11.0)
    ex = acc.send([*subs[1], *msgs("found it", "go on")[:1]], 4_700, 4_600)
    assert ex.divergence is None and ex.cache is not None
    assert (ex.cache["expected"], ex.cache["waste"]) == (4_600, 0)


@pytest.mark.parametrize("siblings", [2, 3, 4])
def test_the_first_sub_agent_sent_and_the_last_answered_is_charged_its_expiry(
    siblings: int,
) -> None:
    """Sub-agents fanned out past the TTL, 0.2 s apart, the first sent answered last (the
    longest job), missing the expired history; each later one read once the first's prompt
    was read. With two, the first's miss read as ``unexplained``: its idle time was measured
    from a sibling that started after it (a negative time). With three or more, it was not
    counted at all: compared with a sibling answered first, whose own baseline was another
    sibling unread when it went out, it had no request read before it."""
    acc = _Accounting({"gpt-4o": {"cache_ttl_s": 10}})
    main = [_system("main agent"), *msgs("explore the repo", "I will fan out.")]
    acc.send(main, 4_400, 0)  # sent at 1.0, read at once
    subs = [[*main, *msgs(f"Sub-agent task: {job}.")] for job in _jobs(siblings)]
    sent: list[Exchange] = []
    for k, history in enumerate(subs):
        ex = exchange(10 + k, history)
        ex.session, ex.started_at = acc.state, 13.0 + 0.2 * k  # 12 s idle: past the TTL
        ex.t0 = ex.started_at
        ex.ttfb_s = 5.0 if k == 0 else 0.1  # the first sent: read last; the others at once
        acc.observer.on_request(ex)
        sent.append(ex)
    for k in [*range(1, siblings), 0]:  # the first sent, answered last
        ex = sent[k]
        read = 0 if k == 0 else 4_400  # (the provider wrote the history for the first)
        ex.usage, ex.status = Usage(4_600, 10, read, 0, True), 200
        acc.observer.on_response(ex)
    first = sent[0].cache
    assert first is not None and sent[0].divergence is None
    assert (first["expected"], first["waste"], first["cause"]) == (4_400, 4_400, "ttl_expired")
    for ex in sent[1:]:
        assert ex.cache is not None and ex.cache["waste"] == 0


def test_a_fan_out_after_a_turn_made_beside_a_background_request_goes_on_from_that_turn() -> None:
    """The main agent's turn was accounted while a background sub-agent was in flight (so it
    kept the turn before it as its ``earlier``); then a fan-out past the TTL, whose first
    answered sends its next turn before the others are answered. The others were compared
    with the main agent's turn before the last (its ``earlier``, which the chain kept in place
    of the last), their waste a quarter too low. The chain keeps the nearest first."""
    acc = _Accounting({"gpt-4o": {"cache_ttl_s": 10}})

    def sent(eid: int, history: list[Message], at: float, ttfb: float) -> Exchange:
        ex = exchange(eid, history)
        ex.session, ex.started_at, ex.t0, ex.ttfb_s = acc.state, at, at, ttfb
        acc.observer.on_request(ex)
        return ex

    def answered(ex: Exchange, prompt: int, read: int) -> dict[str, Any]:
        ex.usage, ex.status = Usage(prompt, 10, read, 0, True), 200
        acc.observer.on_response(ex)
        assert ex.cache is not None
        return ex.cache

    first = [_system("main agent " * 50), *msgs("explore the repo", "I will fan out.")]
    answered(sent(1, first, 1.0, 0.1), 4_400, 0)
    background = sent(2, [*first, *msgs("Sub-agent task: background watch.")], 2.0, 30.0)
    main = [*first, *msgs("results are in", "now I fan out again")]
    answered(sent(3, main, 5.0, 0.1), 6_000, 4_400)  # accounted while the background runs
    answered(background, 4_500, 4_400)
    subs = [[*main, *msgs(f"Sub-agent task: {job}.")] for job in _jobs(3)]
    slow, slower, quick = (
        sent(10 + k, subs[k], 20.0 + 0.2 * k, (5.0, 3.0, 0.1)[k]) for k in (0, 1, 2)
    )
    answered(quick, 6_100, 0)
    answered(sent(13, [*subs[2], *msgs("done step one", "continue")], 21.0, 0.1), 6_200, 6_100)
    for ex in (slower, slow):
        cache_ = answered(ex, 6_100, 0)
        assert (cache_["expected"], cache_["waste"], cache_["cause"]) == (
            6_000,
            6_000,
            "ttl_expired",
        )


def test_a_long_session_of_fan_outs_holds_a_bounded_chain_of_earlier_turns() -> None:
    """Each baseline's ``earlier`` chain ends at the first turn read before the oldest request
    still unanswered went out, and goes ``_EARLIER_KEPT`` back at most: a session of many
    fan-out rounds, one request always in flight, does not hold every old body."""
    import gc

    from proxy.observers import _EARLIER_KEPT, _Baseline

    acc = _Accounting({"gpt-4o": {"cache_ttl_s": 10}})
    history = [_system("main agent"), *msgs("explore", "fanning out")]
    pending: Exchange | None = None
    for turn in range(200):
        at = 10.0 * turn
        for k in range(3):  # each round's sub-agents: one answered in the next round
            ex = exchange(1000 * turn + k, [*history, *msgs(f"Sub-agent task {turn}-{k}.")])
            ex.session, ex.started_at, ex.t0, ex.ttfb_s = acc.state, at + k, at + k, 0.5
            acc.observer.on_request(ex)
            if k == 0:
                if pending is not None:
                    pending.usage, pending.status = Usage(4_000, 10, 0, 0, True), 200
                    acc.observer.on_response(pending)
                pending = ex
                continue
            ex.usage, ex.status = Usage(4_000, 10, 3_900, 0, True), 200
            acc.observer.on_response(ex)
        history = [*history, *msgs(f"round {turn} done", "next")]
    depths = []
    for baseline in acc.state.extra["baselines"]:
        depth, node = 0, baseline.earlier
        while node is not None:
            depth, node = depth + 1, node.earlier
        depths.append(depth)
    assert max(depths) <= _EARLIER_KEPT
    gc.collect()
    alive = sum(1 for o in gc.get_objects() if type(o) is _Baseline)
    assert alive < 32 * (_EARLIER_KEPT + 1)  # (not one a turn: 600 made)


def test_eight_interleaved_conversations_are_each_compared_with_their_own() -> None:
    acc = _Accounting()
    tasks = ["search", "parse", "review", "deploy", "document", "profile", "refactor", "triage"]
    histories = {t: [_system(f"You {t}."), *msgs(f"Please {t} it.")] for t in tasks}
    for turn in range(3):
        for t in tasks:
            ex = acc.send(histories[t], 5_000 + 100 * turn, 5_000 if turn else 0)
            assert ex.divergence is None, (turn, t)
            assert ex.cache is not None
            assert ex.cache["waste"] == 0
            assert ex.cache["expected"] == (5_000 + 100 * (turn - 1) if turn else 0), (turn, t)
            histories[t] = [*histories[t], *msgs("reply", f"more {turn}")[:1]]


def test_a_rewrite_refused_then_retried_is_one_rewrite() -> None:
    acc = _Accounting()
    history = [_system("agent"), *msgs("go")]
    acc.send(history, 5_000, 0)
    rewritten = [_system("agent, at 10:01"), *history[1:]]
    for _ in range(3):
        acc.send(rewritten, 0, 0, status=429)
    ex = acc.send(rewritten, 5_000, 0)
    assert ex.cache is not None and ex.cache["cause"] == "prefix_rewrite"
    registry = acc.metrics
    assert registry.prefix_rewrites.child("system")[0] == 1


def test_conversations_that_open_alike_keep_their_own_baselines() -> None:
    """Two agents (or a conversation and its fork) with the same system prompt and the same
    boilerplate first message, then their own: each next turn is compared with its own
    conversation's previous one. The later one used to take the earlier one's place, so the
    first agent's next turn was charged the other's messages as a rewrite."""
    acc = _Accounting()
    boilerplate = {
        "role": "user",
        "content": "<environment_context>cwd: /repo</environment_context>",
    }
    a = [_system("agent"), boilerplate, *msgs("A: fix the bug")]
    b = [_system("agent"), boilerplate, *msgs("B: read this long log")]
    acc.send(a, 2_900, 0)
    first_b = acc.send(b, 9_900, 2_816)  # shares the opening with A: that much is read
    assert first_b.cache is not None and first_b.divergence is not None  # against A: a rewrite
    for turn in range(2):
        a = [*a, *msgs(f"a reply {turn}", f"A: go on {turn}")]
        ex = acc.send(a, 3_000 + 100 * turn, 2_816 + 100 * turn)
        assert ex.divergence is None, turn
        assert ex.cache is not None and ex.cache["waste"] == 0, turn
        b = [*b, *msgs(f"b reply {turn}", f"B: go on {turn}")]
        ex = acc.send(b, 10_000 + 100 * turn, 9_900 + 100 * turn)
        assert ex.divergence is None, turn
        assert ex.cache is not None and ex.cache["waste"] == 0, turn
    assert acc.metrics.prefix_rewrites.child("messages")[0] == 1  # B's first request only


@pytest.mark.parametrize("agents", [2, 4])
def test_agents_that_open_alike_under_their_own_prompts_go_on_each_with_its_own(
    agents: int,
) -> None:
    """Instances of an agent whose prompts differ only in the working directory, all given the
    same task, in one inferred session: the second's first request took the first's place (its
    messages carry the first's on, under a rewritten prompt), so each one's next turn was
    compared with another's and charged as a system rewrite (with three or more, the third took
    the second's place, which counted two turns). The first turns alike are still read as
    rewrites (the same shape as a first message resent under an edited prompt)."""
    acc = _Accounting()
    prompt = "You are a coding agent. " * 40 + "Working directory: /home/u/{}"
    names = ["alpha", "beta", "gamma", "delta"][:agents]
    histories = {n: [_system(prompt.format(n)), *msgs("fix the failing tests")] for n in names}
    for n in names:
        acc.send(histories[n], 2_015, 0)
    for turn in range(2):
        for n in names:
            histories[n] = [*histories[n], *msgs(f"{n} ran the tests {turn}", f"{n} out {turn}")]
            ex = acc.send(histories[n], 2_200 + 100 * turn, 0)  # a miss, nothing rewritten
            assert ex.divergence is None, (n, turn)
            assert ex.cache is not None and ex.cache["cause"] == "unexplained", (n, turn)
    # the first requests of all but the first only
    assert acc.metrics.prefix_rewrites.child("system")[0] == agents - 1


def _main_turn_and_answer(acc: _Accounting) -> tuple[list[Message], Message]:
    """A main agent's turn of 9,000 tokens, sent, and the answer that hands off to a sub-agent."""
    main = [_system("You are the main coding agent. " * 60), *msgs("fix the bug", "looked")]
    main = [*main, *msgs("go on")]
    acc.send(main, 9_000, 0)
    return main, {"role": "assistant", "content": "I'll ask a sub-agent to search for it."}


def test_a_sub_agent_under_its_own_prompt_given_the_history_leaves_the_main_agents_turn() -> None:
    """A sub-agent under its own system prompt, given a copy of the main agent's history and its
    last answer, took the main agent's place (its messages carry the main agent's on, under a
    rewritten prompt): the main agent's next turn was then compared with the sub-agent's, read
    as a rewrite of its system prompt, and on a miss charged only the tools' share (the
    system prompt differed from the first token on)."""
    acc = _Accounting()
    main, answer = _main_turn_and_answer(acc)
    sub = [_system("You search a repository. " * 40), *main[1:], answer, *msgs("find foo()")]
    first_sub = acc.send(sub, 8_500, 0)
    assert first_sub.divergence is not None  # (its own prompt: nothing of it could be read)
    for turn in range(3):
        sub = [*sub, *msgs(f"searched {turn}", f"result {turn}")]
        ex = acc.send(sub, 8_600 + 100 * turn, 8_500)
        assert ex.divergence is None, turn
    rewrites = acc.metrics.prefix_rewrites.child("system")[0]
    later = [*main, answer, *msgs("the sub-agent found it in foo.py")]
    ex = acc.send(later, 9_200, 0)  # a miss with nothing rewritten (an expiry, say)
    assert ex.divergence is None
    assert ex.cache is not None and ex.cache["expected"] == 9_000
    assert ex.cache["waste"] == 9_000 and ex.cache["cause"] == "unexplained"
    assert acc.metrics.prefix_rewrites.child("system")[0] == rewrites


def test_an_agent_back_in_its_act_mode_is_compared_with_its_last_act_turn() -> None:
    """Cline's plan and act modes have two system prompts: back in act mode, the agent's turn
    was compared with its plan-mode turn (a system rewrite, the tools' share expected), where
    the provider may still hold the act prompt's prefix."""
    acc = _Accounting()
    act, plan = _system("ACT MODE. You edit files. " * 50), _system("PLAN MODE. You plan. " * 50)
    history = msgs("fix the bug")
    acc.send([act, *history], 6_000, 0)
    history = [*history, *msgs("editing", "tests fail")]
    acc.send([act, *history], 6_200, 6_000)
    history = [*history, *msgs("let me plan", "plan it first")]
    switched = acc.send([plan, *history], 6_300, 0)
    assert switched.divergence is not None and switched.divergence["location"] == "system"
    history = [*history, *msgs("here is a plan", "good, go")]
    acc.send([plan, *history], 6_500, 6_300)
    history = [*history, *msgs("switching", "act now")]
    back = acc.send([act, *history], 6_700, 4_000)
    assert back.divergence is None
    assert back.cache is not None and back.cache["expected"] == 6_200
    assert back.cache["waste"] == 2_200 and back.cache["cause"] == "unexplained"


def test_sessions_do_not_hold_their_last_answers_text() -> None:
    """Each conversation kept its last answer's whole text (up to 32 MiB) to know its next turn
    by it, outside the memory estimate that ``sessions.max_memory_mb`` bounds: 100 sessions of
    4 MB answers held ~430 MB of RSS under a budget of 50 MiB. A digest does the same work."""
    import gc
    import tracemalloc

    held = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(8):
            acc = _Accounting()
            acc.send(
                [_system("agent"), *msgs(f"task {i}")], 9_000, 0, answer=f"{i} " + "x" * 1_000_000
            )
            held.append(acc)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 2_000_000, kept  # (8 MB of answers before)
    # the answer is still known by its text
    acc = held[0]
    history = [
        _system("agent"),
        *msgs("task 0"),
        {"role": "assistant", "content": "0 " + "x" * 1_000_000},
    ]
    assert _carries_answer(acc.state.extra["baselines"][0], {"messages": history})


def test_a_system_prompt_that_changes_every_turn_does_not_crowd_out_other_conversations() -> None:
    """An agent that puts its open files in its system prompt changes the prompt every turn,
    not by the time alone: each turn was kept beside the one before (as a sub-agent under its
    own prompt is), and its stale copies filled the baselines and forgot the others'."""
    acc = _Accounting()
    sub = [_system("You are a sub-agent that reads logs. " * 40), *msgs("read the log")]
    acc.send(sub, 3_000, 0)
    sub = [*sub, *msgs("read it", "now the next one")]
    acc.send(sub, 3_100, 3_000)
    history = msgs("fix the bug")
    for turn in range(CONVERSATIONS_KEPT + 4):
        prompt = _system("You are a coding agent. " * 50 + f"Open files: src/f{turn}.py")
        ex = acc.send([prompt, *history], 9_000 + 100 * turn, 0)
        if turn:
            assert ex.divergence is not None and ex.divergence["location"] == "system"
        history = [*history, *msgs(f"edited f{turn}", f"go on {turn}")]
    # (the sub-agent's; the agent's first two turns, kept as a main agent may wait on one of
    # them, and its latest two: not a copy a turn)
    assert len(acc.state.extra["baselines"]) <= 5
    sub = [*sub, *msgs("read that too", "and the last")]
    ex = acc.send(sub, 3_200, 3_100)
    assert ex.divergence is None
    assert ex.cache is not None and (ex.cache["expected"], ex.cache["waste"]) == (3_100, 0)


def test_a_main_agent_back_from_its_sub_agent_is_not_forgotten_for_the_sub_agents_prompt() -> None:
    """A sub-agent under its own prompt that changes every turn: its turns forget the stale
    copies they leave, but not the main agent's conversation once the main agent went on."""
    acc = _Accounting()
    main, answer = _main_turn_and_answer(acc)
    sub = [*main[1:], answer, *msgs("find foo()")]
    acc.send([_system("Sub-agent. Open files: a.py"), *sub], 8_500, 0)
    main = [*main, answer, *msgs("meanwhile, read b.py")]
    ex = acc.send(main, 9_200, 9_000)  # the main agent goes on
    assert ex.divergence is None
    sub = [*sub, *msgs("searched", "result")]
    acc.send([_system("Sub-agent. Open files: a.py, b.py"), *sub], 8_600, 0)
    main = [*main, *msgs("read it", "now fix it")]
    ex = acc.send(main, 9_400, 9_200)
    assert ex.divergence is None
    assert ex.cache is not None and ex.cache["expected"] == 9_200


def test_a_main_agent_waiting_for_a_sub_agent_whose_prompt_changes_keeps_its_turn() -> None:
    """The usual blocking sub-agent call: the main agent waits while its sub-agent, under a
    prompt of its own that changes every turn, works on. The main agent's turn was taken for a
    stale copy of an agent changing its prompt, and forgotten: its next turn read as a system
    rewrite of the sub-agent's, with the wrong share expected."""
    acc = _Accounting()
    main, answer = _main_turn_and_answer(acc)
    sub = [*main[1:], answer, *msgs("find foo()")]
    for turn in range(4):
        prompt = _system("You search a repository. " * 40 + f"Open files: f{turn}.py")
        acc.send([prompt, *sub], 8_500 + 100 * turn, 0)
        sub = [*sub, *msgs(f"searched {turn}", f"result {turn}")]
    back = [*main, answer, *msgs("the sub-agent found it in foo.py")]
    ex = acc.send(back, 9_200, 9_000)
    assert ex.divergence is None
    assert ex.cache is not None and (ex.cache["expected"], ex.cache["waste"]) == (9_000, 0)
    # a long sub-agent, and a main agent that is not the session's first conversation (a title
    # request came first): kept past CONVERSATIONS_KEPT of the sub-agent's turns
    acc = _Accounting()
    acc.send([_system("Write a title."), *msgs("fix the bug")], 50, 0)
    acc.send(main, 9_000, 0)
    sub = [*main[1:], answer, *msgs("find foo()")]
    for turn in range(CONVERSATIONS_KEPT + 8):
        prompt = _system("You search a repository. " * 40 + f"Open files: f{turn}.py")
        acc.send([prompt, *sub], 8_500 + 10 * turn, 0)
        sub = [*sub, *msgs(f"searched {turn}", f"result {turn}")]
    ex = acc.send(back, 9_200, 9_000)
    assert ex.divergence is None
    assert ex.cache is not None and ex.cache["expected"] == 9_000


def test_tools_with_their_properties_reordered_are_logged_again_for_replay() -> None:
    """Equal to Python, other to a provider: a replay of the line must send them as they were
    sent (the order of a schema's properties is the order of the function's parameters)."""
    settings = settings_from_mapping({})
    store = MemorySessionStore()
    store.create("s1", 0.0)
    lines = Lines()
    log = EventLogObserver(settings, store, lines)  # type: ignore[arg-type]
    props = {"path": {"type": "string"}, "n": {"type": "integer"}}
    first = [
        {"type": "function", "function": {"name": "read", "parameters": {"properties": props}}}
    ]
    flipped = dict(reversed(list(props.items())))
    second = [
        {"type": "function", "function": {"name": "read", "parameters": {"properties": flipped}}}
    ]
    assert first == second
    history: list[Message] = []
    for eid, tools in enumerate([first, second], start=1):
        history = [*history, {"role": "user", "content": f"turn {eid}"}]
        ex = exchange(eid, history)
        assert ex.body is not None
        ex.body = {**ex.body, "tools": tools}
        log.on_request(ex)
    replayed = replay_requests(lines.events)
    assert [list(r["tools"][0]["function"]["parameters"]["properties"]) for r in replayed] == [
        ["path", "n"],
        ["n", "path"],
    ]


def test_a_system_prompt_with_the_time_does_not_crowd_out_other_conversations() -> None:
    """Each turn of the main agent changes a timestamp in its system prompt: that is a rewrite
    of its conversation, which takes its place, not a branch kept beside it (such turns used
    to fill the baselines and forget the sub-agent's)."""
    acc = _Accounting()
    sub_prompt = "You are a sub-agent that searches the repository. Answer with file paths only."
    main_prompt = "You are the main coding agent. Fix what the user asks, then run the tests."
    sub = [_system(sub_prompt), *msgs("find the file")]
    acc.send(sub, 3_000, 0)
    main_history = msgs("fix the bug")
    for turn in range(CONVERSATIONS_KEPT + 2):
        main_history = [*main_history, *msgs(f"reply {turn}", f"go on {turn}")]
        stamped = _system(f"{main_prompt} Current time: 10:{turn:02d}.")
        ex = acc.send([stamped, *main_history], 10_000, 9_000)
        if turn:
            assert ex.divergence is not None and ex.divergence["volatile"]
    sub = [*sub, *msgs("found it", "now read it")]
    ex = acc.send(sub, 3_100, 3_000)
    assert ex.divergence is None
    assert ex.cache is not None and (ex.cache["expected"], ex.cache["waste"]) == (3_000, 0)
    assert len(acc.state.extra["baselines"]) == 2


def test_two_agents_under_one_timed_system_prompt_are_each_compared_with_their_own() -> None:
    """Two agents under one session id and one system prompt with the time in it: each turn
    was compared with whichever agent sent last (the time makes each system prompt a volatile
    rewrite of the other's), so the second agent's first request was charged the first's
    prompt as waste, and each agent's real loss was the other's size."""
    acc = _Accounting()
    prompt = "You are a coding agent. Current time: 2026-12-02T10:{:02d}:00Z."
    a, b = msgs("task A " + "long " * 100), msgs("task B")
    tick = 0
    for turn in range(3):
        tick += 1
        ex_a = acc.send([_system(prompt.format(tick)), *a], 8_000 + 100 * turn, 0)
        tick += 1
        ex_b = acc.send([_system(prompt.format(tick)), *b], 2_000 + 100 * turn, 0)
        assert ex_a.cache is not None and ex_b.cache is not None
        if turn == 0:  # B's first request: another conversation, nothing expected of it
            assert ex_b.divergence is None and ex_b.cache["expected"] == 0
        else:  # each misses its own previous prompt (the time in the system prompt)
            assert ex_a.divergence is not None and ex_a.divergence["volatile"]
            # (its previous prompt, less the share of the system prompt that changed: the
            # minutes of a short prompt, a few dozen tokens at these synthetic counts; the
            # other agent's previous prompt is 6,000 tokens away)
            assert ex_a.cache["expected"] == ex_a.cache["waste"]
            assert 0 < 7_900 + 100 * turn - ex_a.cache["expected"] < 50
            assert ex_b.cache["expected"] == ex_b.cache["waste"]
            assert 0 < 1_900 + 100 * turn - ex_b.cache["expected"] < 50
        a, b = [*a, *msgs(f"a{turn}", f"more A {turn}")], [*b, *msgs(f"b{turn}", f"more B {turn}")]


def test_an_agent_that_edits_its_task_after_another_agent_that_opened_alike_is_judged_on_its_own() -> (
    None
):
    """Two agents under one session id, one prompt, the same boilerplate first message (an
    environment block) and the same first answer: A edits its own task right after B's turn.
    Both earlier turns share the opening alone with the edit, and the tie went to the latest,
    B's: the edit was compared with B's task (``old`` was B's text), its expected read was the
    opening's and its 1,800-token waste was 0. The one that holds the rest of A's messages is
    A's own."""
    acc = _Accounting()
    system = _system("You are a coding agent. " + "Rules. " * 100)
    opening = msgs("<environment_details> cwd /repo " + "file " * 300, "Ready.")
    a = [*opening, *msgs("A task: port the parser " + "in detail " * 200, "Ported.")]
    b = [*opening, *msgs("B task: write the docs " + "of each flag " * 200, "Written.")]
    acc.send([system, *a], 9_000, 0)
    acc.send([system, *b], 9_000, 1_500)
    a += msgs("A more: and the tests " + "case " * 150, "Tested.")
    acc.send([system, *a], 10_000, 8_900)
    b += msgs("B more: and the man page " + "flag " * 150, "Done.")
    acc.send([system, *b], 10_000, 8_900)
    edited = [*a[:2], {"role": "user", "content": "A task EDITED: port it " + "in detail " * 200}]
    ex = acc.send([system, *edited, *a[3:], *msgs("A next")], 10_050, 1_500)
    assert ex.divergence is not None
    assert ex.divergence["index"] == 3 and ex.divergence["old"].startswith("A task: port")
    assert ex.cache is not None and 9_900 < ex.cache["expected"] <= 10_000  # (A's own, less
    # the edited message's share)
    assert (ex.cache["cause"], ex.cache["location"]) == ("prefix_rewrite", "messages[3].content")
    assert ex.cache["waste"] == ex.cache["expected"] - 1_500


def test_two_agents_that_both_answered_ok_are_not_one_conversation() -> None:
    """The same two agents, each history holding one answer alike ("ok"): B's turn after the
    time changed was compared with A's (the shared "ok" made it of A's conversation) and its
    own task blamed as rewritten, where the time in the prompt was the cause."""
    acc = _Accounting()
    prompt = "You are a coding agent. Current time: 2026-12-02T10:{:02d}:00Z."
    a = msgs("task A: fix the parser " + "in detail " * 40, "ok", "go on with A")
    b = msgs("task B: write the docs " + "of each flag " * 40, "ok", "go on with B")
    acc.send([_system(prompt.format(0)), *a], 8_000, 0)
    acc.send([_system(prompt.format(0)), *b], 6_000, 0)
    acc.send([_system(prompt.format(1)), *a, *msgs("a1", "more A")], 8_100, 0)
    ex = acc.send([_system(prompt.format(1)), *b, *msgs("b1", "more B")], 6_100, 0)
    assert ex.divergence is not None
    assert (ex.divergence["location"], ex.divergence["volatile"]) == ("system", True)
    assert ex.cache is not None and ex.cache["expected"] == ex.cache["waste"]
    assert 0 < 6_000 - ex.cache["expected"] < 60  # (less the minutes' share of its prompt)


def test_a_history_trimmed_to_open_as_a_one_shot_did_is_still_its_own_conversation() -> None:
    """A sliding window drops an agent's oldest messages and its history now opens with
    "continue", as a one-shot request of the session did earlier (under the prompt's previous
    time): it was compared with that one (no waste, the time blamed) and its real loss hidden.
    The conversation that holds more of its messages is its own."""
    acc = _Accounting()
    prompt = "You are a coding agent. " + "Rules. " * 50 + "Current time: 10:{:02d}."
    acc.send([_system(prompt.format(0)), *msgs("continue")], 1_500, 0)
    history = msgs(
        "task: port the parser " + "in detail " * 200,
        "plan " * 300,
        "continue",
        "step one " * 300,
        "and the tests",
    )
    acc.send([_system(prompt.format(1)), *history], 20_000, 0)
    history += msgs("tests " * 300, "go on")
    acc.send([_system(prompt.format(1)), *history], 21_000, 19_000)
    trimmed = history[2:] + msgs("more " * 300, "next")
    ex = acc.send([_system(prompt.format(1)), *trimmed], 14_000, 1_200)
    assert ex.divergence is not None and ex.divergence["location"] == "messages"
    assert ex.cache is not None and ex.cache["cause"] == "prefix_rewrite"
    assert ex.cache["waste"] > 10_000


def test_a_longer_prefix_an_earlier_turn_cached_counts_only_while_the_provider_holds_it() -> None:
    """Claude: the turn before a request marked only its system prompt (1,000 tokens cached),
    the one before that its whole history (5,000, at 0 s, 10 messages): within the TTL a
    request can read 5,000 (an edit loses them); past it, or 20 messages past them (Claude
    looks back ~20 blocks from a breakpoint), only what the last turn cached."""
    baseline = _Baseline(fingerprint({"messages": []}), {}, 5_100, "claude", 10.0, 10.0)
    baseline.cached, baseline.held = 1_000, (5_000, 0.0, 10)
    assert _cached_before(baseline, 200.0, 300.0, 12) == 5_000
    assert _cached_before(baseline, 301.0, 300.0, 12) == 1_000
    # ...and only within Claude's look back (~20 blocks) from the request's end
    assert _cached_before(baseline, 200.0, 300.0, 30) == 5_000
    assert _cached_before(baseline, 200.0, 300.0, 31) == 1_000
    baseline.cached = None  # (unknown for the last turn: the held prefix still counts)
    assert _cached_before(baseline, 200.0, 300.0, 12) == 5_000


def test_a_first_turn_sent_again_with_the_time_in_it_twice_is_a_rewrite() -> None:
    """The time in the system prompt and in the only message (an agent's environment details):
    sent again a minute later, nothing could be read, and the miss is waste; taken for another
    conversation, it was hidden."""
    acc = _Accounting()
    prompt = "You are a coding agent. Current time: 2026-12-02T10:{:02d}:00Z."
    task = "<environment_details>Time: 2026-12-02T10:{:02d}:00Z</environment_details> Fix it."
    acc.send([_system(prompt.format(1)), *msgs(task.format(1))], 8_400, 0)
    ex = acc.send([_system(prompt.format(2)), *msgs(task.format(2))], 8_400, 0)
    assert ex.divergence is not None and ex.divergence["location"] == "system"
    assert ex.divergence["volatile"]
    assert ex.cache is not None and ex.cache["waste"] == ex.cache["expected"]
    # (all but the share of the message its new time changed: a few characters)
    assert 8_400 * 0.95 < ex.cache["expected"] <= 8_400


def test_a_screenshot_taken_out_of_a_message_drops_the_image_not_its_text() -> None:
    """Browser agents keep the last screenshots and strip older images from their messages: by
    bytes the base64 was all of the message, so its text counted as dropped too, and most of
    the waste after it was hidden. A low-detail image weighs OpenAI's 85 tokens; one whose size
    is read what the tile rule bills for it (it weighed 1,600 whatever its size: a small one,
    255 tokens, took ~1,350 tokens the provider should still have read out of the expected
    read, and hid that much waste); one whose size is not read, 1,600."""
    import base64

    from tests.test_media import png

    unread = "data:image/png;base64," + "iVBORw0KGgo" * 15_000  # ~165 KB, no size in it
    small, large = (
        "data:image/png;base64," + base64.b64encode(png(w, h, 4)).decode()
        for w, h in ((320, 200), (1280, 800))
    )
    text = "The page shows the login form. " * 500  # ~4,000 tokens by the estimate
    for image, detail, image_tokens in (
        (unread, "high", 1600),
        (unread, "low", 85),
        (small, "auto", 255),
        (large, "auto", 1105),
    ):
        acc = _Accounting()
        shot = {"type": "image_url", "image_url": {"url": image, "detail": detail}}
        first = {"role": "user", "content": [{"type": "text", "text": text}, shot]}
        history = [_system("browser agent"), first, *msgs("clicked", "next")]
        whole = estimate_tokens(history)
        acc.send(history, whole, 0)
        stripped = {"role": "user", "content": [{"type": "text", "text": text}]}
        ex = acc.send([history[0], stripped, *history[2:], *msgs("typed", "go on")], whole, 0)
        assert ex.cache is not None and ex.divergence is not None
        assert ex.divergence["location"] == "messages"
        # all of the previous prompt but the image (and a few bytes around it) was still sent
        assert whole - image_tokens - 20 <= ex.cache["expected"] <= whole - image_tokens + 20
        assert ex.cache["waste"] == ex.cache["expected"]


def test_a_summary_call_without_cache_fields_after_one_with_them_counts_as_a_read_of_0() -> None:
    """A main model that reports no cache fields (vLLM) and a summarizer that leaves them out
    of a miss (Gemini): `sessions list` counts the second summary call as a read of 0 after the
    first had them; the metric left it out (33% where the session read 17%)."""
    from prometheus_client import CollectorRegistry

    acc = _Accounting()
    registry = CollectorRegistry()
    acc.observer.metrics = Metrics(registry, ())
    main = [_system("agent " * 2000), *msgs("fix the bug")]
    summaries = [None, Usage(2_000, 40, 1_000, 0, True), Usage(1_000, 40, 0, 0, False)]
    for n, summary in enumerate(summaries, 1):
        ex = exchange(n, [*main, *msgs(*(["more"] * (2 * n)))])
        ex.session, ex.started_at, ex.status = acc.state, float(n), 200
        ex.usage = Usage(1_000, 10, 0, 0, False)
        if summary is not None:
            ex.summary_model, ex.summary_usage = "gpt-4o", summary
        acc.observer.on_response(ex)
    name = "cachegate_cache_reported_prompt_tokens_total"
    assert registry.get_sample_value(name, {"model": "other"}) == 3_000


def test_a_call_id_that_is_a_list_carries_no_answer_on_and_raises_nothing() -> None:
    """``"id": ["call_Xy7…"]`` in the assistant message after an edited first message (with
    ``pairing.repair = false`` nothing mends it): the check whether it carries the previous
    answer on hashed the list, and the accounting failed on that turn and every later one."""
    from proxy.observers import _Answer, _carries_answer

    call_id = "call_Xy7Kq2Lm9Np4Rt6Vb1Zc3Hd5"
    baseline: Any = SimpleNamespace(
        answer=_Answer(0, b"", frozenset({call_id})), fp=SimpleNamespace(messages=[1, 2])
    )
    call = {"id": [call_id], "type": "function", "function": {"name": "f", "arguments": "{}"}}
    odd = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert _carries_answer(baseline, {"messages": [_system("s"), *msgs("edited"), odd]}) is False
    fine = {**odd, "tool_calls": [{**call, "id": call_id}]}
    assert _carries_answer(baseline, {"messages": [_system("s"), *msgs("edited"), fine]}) is True


def test_the_hit_ratios_denominator_counts_every_answer_sessions_list_counts() -> None:
    """Gemini's OpenAI endpoint leaves its cache fields out of a miss. `sessions list` counts
    every answer of a session after its answers have had them, a miss of a new conversation's
    first request too, and a compaction's summary call; the metrics counted only misses with an
    expected read: 73.6% on the panels where the session read 62.8%."""
    from prometheus_client import CollectorRegistry

    acc = _Accounting()
    registry = CollectorRegistry()
    acc.observer.metrics = metrics = Metrics(registry, ())  # (a summary call's, the accounting's)
    metrics_observer = MetricsObserver(metrics)
    main = [_system("agent " * 2000), *msgs("fix the bug")]
    answers = [
        (main, 10_000, 0, True),
        ([*main, *msgs("looked", "go on")], 12_000, 8_000, True),
        (msgs("a title for this chat"), 5_000, 0, False),  # another conversation's first
        ([*main, *msgs("looked", "go on", "done", "next")], 14_000, 0, False),
    ]
    for n, (messages, prompt, read, reported) in enumerate(answers, 1):
        ex = exchange(n, messages)
        ex.session, ex.started_at, ex.status = acc.state, float(n), 200
        ex.usage = Usage(prompt, 10, read, 0, reported)
        if n == 4:  # compacted: its summary call's answer had no cache fields either
            ex.summary_model, ex.summary_usage = "gpt-4o", Usage(3_000, 40, 0, 0, False)
        acc.observer.on_response(ex)
        metrics_observer.on_response(ex)
    name = "cachegate_cache_reported_prompt_tokens_total"  # ("other": no model configured)
    assert registry.get_sample_value(name, {"model": "other"}) == 44_000


def test_a_part_whose_type_is_a_list_is_no_image_and_breaks_no_accounting() -> None:
    """``{"type": ["image_url"]}`` in an edited message: the media check hashed the list
    (TypeError) and the exchange went unaccounted."""
    acc = _Accounting()
    odd = {"type": ["image_url"], "image_url": {"url": "data:image/png;base64,AAAA"}}
    first = {"role": "user", "content": [{"type": "text", "text": "look " * 2000}, odd]}
    history = [_system("browser agent"), first, *msgs("clicked", "next")]
    whole = estimate_tokens(history)
    acc.send(history, whole, 0)
    edited = {"role": "user", "content": [{"type": "text", "text": "look " * 1999}, odd]}
    ex = acc.send([history[0], edited, *history[2:], *msgs("typed", "go on")], whole, 0)
    assert ex.cache is not None and ex.cache["cause"] == "prefix_rewrite"


def test_an_edit_in_place_after_the_first_turn_was_sent_again_is_still_a_rewrite() -> None:
    """A session that sent its opening request again (a warm-up, a token-count probe, a run
    replayed from its start), went on, then cleared an old tool output: the edit was compared
    with that opening request, which the edited history carries whole, and its miss went
    unseen (no divergence, no waste, for the rest of the session)."""
    acc = _Accounting()
    opening = [_system("coding agent " * 300), {"role": "user", "content": "fix the tests"}]
    history = list(opening)
    prompt = 5_000
    for i in range(3):
        history += msgs(f"call {i}", "output " * 400 + str(i))
        acc.send(history, prompt, prompt - 500)
        prompt += 800
    acc.send(opening, 5_000, 4_900)  # (the opening request again)
    for i in range(3, 5):
        history += msgs(f"call {i}", "output " * 400 + str(i))
        acc.send(history, prompt, prompt - 500)
        prompt += 800
    edited = [*history[:3], {**history[3], "content": "[cleared]"}, *history[4:]]
    ex = acc.send(edited, prompt - 700, 5_000)
    assert ex.cache is not None and ex.divergence is not None
    assert (ex.cache["cause"], ex.cache["location"]) == ("prefix_rewrite", "messages[3].content")
    assert ex.cache["expected"] > 6_500 and ex.cache["waste"] == ex.cache["expected"] - 5_000


def test_two_agents_sent_alike_whose_calls_end_on_the_same_output_keep_their_own_turns() -> None:
    """Two sub-agents fanned out alike, the same first answer (two parallel calls, ids a local
    server counts), their outputs differing but in the last: the second's turn, which keeps
    the first's last message after the change, was taken for an edit in place of the first's
    history; the first's next turn was then compared with the second's, and its real miss
    (2,000 tokens) went unseen."""
    acc = _Accounting()
    opening = [_system("coding agent " * 300), {"role": "user", "content": "fix the tests"}]
    calls = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call_{n}", "type": "function", "function": {"name": f, "arguments": "{}"}}
            for n, f in ((1, "run_tests"), (2, "git_status"))
        ],
    }

    def outputs(first: str) -> list[Message]:
        return [
            {"role": "tool", "tool_call_id": "call_1", "content": first * 200},
            {"role": "tool", "tool_call_id": "call_2", "content": "nothing to commit"},
        ]

    acc.send(list(opening), 5_000, 0, answer=calls)  # (the first agent)
    acc.send(list(opening), 5_000, 4_900, answer=calls)  # (the second, sent alike)
    first = [*opening, calls, *outputs("A: 3 failed ")]
    second = [*opening, calls, *outputs("B: 5 failed ")]
    acc.send(first, 6_000, 4_900, answer="A fixes")
    ex = acc.send(second, 6_000, 4_900, answer="B fixes")
    assert ex.divergence is None  # (its own next turn, not an edit of the first's)
    more = [{"role": "assistant", "content": "A fixes"}, {"role": "user", "content": "ran"}]
    ex = acc.send([*first, *more], 6_600, 4_000)
    assert ex.cache is not None and ex.divergence is None
    assert (ex.cache["expected"], ex.cache["waste"]) == (6_000, 2_000)


def test_openais_24_hour_retention_is_the_ttl_of_a_request_that_asks_for_it() -> None:
    """``prompt_cache_retention: "24h"``: after 25 minutes idle the date in the system prompt
    changed; the miss was blamed on the TTL and the timestamp never named."""
    history = msgs("fix the bug", "looked", "go on")  # (gpt-4o: kept an hour in the settings)
    for retention, cause in (("24h", "prefix_rewrite"), (None, "ttl_expired")):
        acc = _Accounting()
        params = {"model": "gpt-4o", "prompt_cache_retention": retention}
        day_one = {**params, "messages": [_system("Current date: 2026-12-01"), *history]}
        acc.send_body(day_one, 9_000, 0, at=0.0)
        later = [_system("Current date: 2026-12-02"), *history, *msgs("done", "next")]
        ex = acc.send_body({**params, "messages": later}, 9_100, 0, at=2 * 3600.0)
        assert ex.cache is not None and ex.cache["cause"] == cause


def test_the_retention_is_the_one_the_request_that_wrote_the_prefix_asked_for() -> None:
    """OpenAI keeps a prefix as long as the request that wrote it asked: a turn asking for
    24 hours after two hours idle behind one that did not found its prefix expired (it was
    named ``unexplained``), and a turn asking for nothing behind one that asked for a day still
    had the prefix its rewrite lost (it was named ``ttl_expired``)."""
    history = msgs("fix the bug", "looked", "go on")
    for first, then, cause in (("24h", None, "prefix_rewrite"), (None, "24h", "ttl_expired")):
        acc = _Accounting()
        day_one = [_system("Current date: 2026-12-01"), *history]
        sent = {"model": "gpt-4o", "prompt_cache_retention": first, "messages": day_one}
        acc.send_body(sent, 9_000, 0, at=0.0)
        later = [_system("Current date: 2026-12-02"), *history, *msgs("done", "next")]
        body = {"model": "gpt-4o", "prompt_cache_retention": then, "messages": later}
        ex = acc.send_body(body, 9_100, 0, at=2 * 3600.0)
        assert ex.cache is not None and ex.cache["cause"] == cause, (first, then)
    # the same pause without the rewrite: the expiry of entries kept an hour
    acc = _Accounting()
    acc.send_body({"model": "gpt-4o", "messages": history}, 9_000, 0, at=0.0)
    body = {"model": "gpt-4o", "prompt_cache_retention": "24h", "messages": [*history, *msgs("a")]}
    ex = acc.send_body(body, 9_100, 0, at=2 * 3600.0)
    assert ex.cache is not None and ex.cache["cause"] == "ttl_expired"


def _last_marked(messages: list[Message]) -> list[Message]:
    """``messages`` with a Claude cache breakpoint on the last, as Claude Code marks them."""
    *rest, last = messages
    part = {"type": "text", "text": last["content"], "cache_control": {"type": "ephemeral"}}
    return [*rest, {**last, "content": [part]}]


def test_idle_time_runs_from_when_a_request_went_out_not_from_when_it_came() -> None:
    """A compacted request waited on its summary call (a minute) before it went to the
    provider, whose cache life of its prefix starts then: the next turn's idle time counted
    that minute too, and its rewrite (an edited system prompt) was blamed on an expiry."""
    history = msgs("fix the bug", "looked", "go on")
    acc = _Accounting({"gpt-4o": {"cache_ttl_s": 100}})
    first = {"model": "gpt-4o", "messages": [_system("agent, 12:00"), *history]}
    acc.send_body(first, 9_000, 0, at=0.0, waited=60.0)  # (went out at 60)
    later = [_system("agent, 12:02"), *history, *msgs("done", "next")]
    ex = acc.send_body({"model": "gpt-4o", "messages": later}, 9_100, 0, at=130.0)
    assert ex.cache is not None and ex.cache["cause"] == "prefix_rewrite"
    # the same 130 s after one that went out at once: past the TTL
    acc = _Accounting({"gpt-4o": {"cache_ttl_s": 100}})
    acc.send_body(first, 9_000, 0, at=0.0)
    ex = acc.send_body({"model": "gpt-4o", "messages": later}, 9_100, 0, at=130.0)
    assert ex.cache is not None and ex.cache["cause"] == "ttl_expired"


def test_a_request_the_provider_refused_renews_no_prefix_when_its_client_left() -> None:
    """Refused as too long, then left by its client while it was compacted for the retry: no
    usage and a 499, so it was taken as a request the provider had read (a client gone
    mid-answer), and its prefixes' cache life renewed. The next turn's expiry was then
    ``unexplained``."""
    history = msgs("fix the bug", "looked", "go on")
    for unread, cause in ((True, "ttl_expired"), (False, "unexplained")):
        acc = _Accounting({"gpt-4o": {"cache_ttl_s": 100}})
        first = {"model": "gpt-4o", "messages": [_system("agent"), *history]}
        acc.send_body(first, 9_000, 0, at=0.0)
        acc.eid += 1
        left = exchange(acc.eid, [_system("agent"), *history, *msgs("x" * 9_000, "go")])
        left.session, left.started_at, left.t0 = acc.state, 90.0, 90.0
        left.status, left.unread = 499, unread
        acc.observer.on_response(left)
        later = {"model": "gpt-4o", "messages": [_system("agent"), *history, *msgs("a", "b")]}
        ex = acc.send_body(later, 9_100, 0, at=150.0)
        assert ex.cache is not None and ex.cache["cause"] == cause, unread


def test_a_miss_after_openais_five_minutes_with_nothing_rewritten_is_an_expiry() -> None:
    """The built-in TTL of OpenAI's models is the top of their documented 5 to 10 minutes: a miss
    after 7 idle minutes was ``unexplained``. Past 5 minutes it is ``ttl_expired`` when nothing
    else explains it; a TTL set in the config is taken as it is; Claude's 5 minutes are one
    figure."""
    history = msgs("fix the bug", "looked", "go on")
    for models, model, cause in (
        ({}, "gpt-4o", "ttl_expired"),  # the built-in entry: 600 s
        ({}, "gpt-5-mini", "ttl_expired"),  # no entry: OpenAI's default by name
        ({"gpt-4o": {"cache_ttl_s": 900}}, "gpt-4o", "unexplained"),
        ({}, "claude-sonnet-4", "ttl_expired"),  # (past its 300 s outright)
    ):
        acc = _Accounting(models)
        first = [_system("agent"), *history]
        later = [_system("agent"), *history, *msgs("done", "next")]
        if model.startswith("claude"):  # (it caches what a request marks: each its last)
            first, later = _last_marked(first), _last_marked(later)
        acc.send_body({"model": model, "messages": first}, 9_000, 0, at=0.0)
        ex = acc.send_body({"model": model, "messages": later}, 9_100, 0, at=7 * 60.0)
        assert ex.cache is not None and ex.cache["waste"] == 9_000, model
        assert ex.cache["cause"] == cause, (models, model)
    # four minutes idle: nothing explains it, whatever the model
    acc = _Accounting({})
    acc.send_body({"model": "gpt-4o", "messages": [_system("agent"), *history]}, 9_000, 0, at=0.0)
    later = {"model": "gpt-4o", "messages": [_system("agent"), *history, *msgs("done", "next")]}
    ex = acc.send_body(later, 9_100, 0, at=4 * 60.0)
    assert ex.cache is not None and ex.cache["cause"] == "unexplained"


def test_a_models_dialect_gives_its_providers_cache_ttl_under_any_name() -> None:
    """A DeepSeek model under a name of the user's, ``dialect = "deepseek"``: its cache keeps
    an idle prefix for hours, yet the TTL was the 300 s of an unknown name, so an edit after
    five idle minutes was blamed on an expiry; Claude's 300 s likewise under another name. (An
    unknown name's entry gives a cached price: a model not known to cache is judged only once
    its session has read the cache.)"""
    history = msgs("fix the bug", "looked", "go on")
    for dialect, model, cause in (
        ("deepseek", "my-ds", "prefix_rewrite"),
        ("openai", "my-ds", "ttl_expired"),  # (no dialect: an unknown name's 300 s)
    ):
        acc = _Accounting({model: {"dialect": dialect, "price_cached_input": 0.1}})
        first = [_system("Current date: 2026-12-01"), *history]
        acc.send_body({"model": model, "messages": first}, 9_000, 0, at=0.0)
        later = [_system("Current date: 2026-12-02"), *history, *msgs("done", "next")]
        ex = acc.send_body({"model": model, "messages": later}, 9_100, 0, at=310.0)
        assert ex.cache is not None and ex.cache["cause"] == cause, dialect


@pytest.mark.parametrize("sub_prompt", ["its own", "the main agent's"])
def test_a_rewrite_of_an_hours_prefix_is_seen_past_a_sub_agent_that_kept_the_tools_warm(
    sub_prompt: str,
) -> None:
    """Claude: the system prompt marked for an hour, the latest message for five minutes. A
    sub-agent with the same tools ran during the main agent's ten-minute pause; the main agent
    came back with the date in its prompt changed. The idle time was read off the tools the
    sub-agent kept warm (under five minutes): no split, and the miss was all ttl_expired. A
    sub-agent under the main agent's own prompt kept that warm too: the expired history was
    all charged to the rewrite."""
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    hour = {"type": "ephemeral", "ttl": "1h"}

    def body(system: str, messages: list[Message]) -> dict[str, Any]:
        part = {"type": "text", "text": system, "cache_control": hour}
        *rest, last = messages
        marked = {
            **last,
            "content": [
                {"type": "text", "text": last["content"], "cache_control": {"type": "ephemeral"}}
            ],
        }
        return {
            "model": "claude-sonnet-4",
            "tools": tools,
            "messages": [{"role": "system", "content": [part]}, *rest, marked],
        }

    rules = " Follow the style guide." * 300
    history = msgs("fix the bug " * 300, "looked " * 300, "go on " * 300)
    acc = _Accounting({})
    acc.send_body(body("Date: 2026-12-01." + rules, history), 9_000, 0, at=0.0)
    later = [*history, *msgs("done", "next")]
    acc.send_body(body("Date: 2026-12-01." + rules, later), 9_100, 8_900, at=100.0)
    sub_system = "You are a sub-agent." if sub_prompt == "its own" else "Date: 2026-12-01." + rules
    acc.send_body(body(sub_system, msgs("read the docs")), 1_500, 0, at=400.0)
    ex = acc.send_body(
        body("Date: 2026-12-02." + rules, [*later, *msgs("ok", "more")]), 9_200, 0, at=700.0
    )
    assert ex.cache is not None
    assert (ex.cache["cause"], ex.cache["location"]) == ("prefix_rewrite", "system")
    assert ex.cache["expired"] > ex.cache["waste"] > 0  # (the history the larger part)
    assert ex.cache["waste"] + ex.cache["expired"] == ex.cache["expected"]


def test_a_new_chat_that_opens_alike_under_its_own_prompt_is_no_rewrite() -> None:
    """Chat clients without a session id that all open with "hi" share an inferred session: a
    new chat under its own system prompt was read as a rewrite of the other chat's prompt and
    its whole prompt charged as waste (a first turn no provider could have served)."""
    acc = _Accounting({})
    coding = [_system("You are a coding agent. " * 50), *msgs("hi", "Hello! What shall we fix?")]
    acc.send_body({"model": "gpt-4o", "messages": [*coding, *msgs("the tests")]}, 2_400, 0)
    travel = [_system("You plan trips. " * 50), *msgs("hi")]
    ex = acc.send_body({"model": "gpt-4o", "messages": travel}, 2_500, 0)
    assert ex.divergence is None
    assert ex.cache is not None and (ex.cache["expected"], ex.cache["waste"]) == (0, 0)
    # the coding chat's next turn is still compared with its own
    later = [*coding, *msgs("the tests", "On it.", "and the docs")]
    ex = acc.send_body({"model": "gpt-4o", "messages": later}, 2_600, 0)
    assert ex.divergence is None and ex.cache is not None and ex.cache["expected"] == 2_400
    # under a prompt with the time in it, a first answer regenerated a few turns on, or a new
    # chat opening alike, is the provider's to serve but for the time: a rewrite
    acc = _Accounting({})
    dated = "Current time: 2026-12-04T10:{:02d}:00Z. " + "You are a helpful assistant. " * 40
    chat = [_system(dated.format(1)), *msgs("hi", "Hello! How can I help?", "tell me a joke")]
    acc.send_body({"model": "gpt-4o", "messages": chat}, 2_900, 0)
    again = [_system(dated.format(7)), *msgs("hi")]
    ex = acc.send_body({"model": "gpt-4o", "messages": again}, 2_850, 0)
    assert ex.divergence is not None and ex.divergence["volatile_kind"] == "timestamp"
    assert ex.cache is not None and ex.cache["cause"] == "prefix_rewrite"
    # ...but not an agent with a role system message of its own after a dated one: another
    # conversation, nothing of it to be read but the shared base
    acc = _Accounting({})
    base, stamp = "You are one of a team of agents. " * 20, "Current time: 10:{:02d}."
    role_a, role_b = "Review the database layer. " * 100, "Write the release notes. " * 50
    team_a = [_system(base), _system(stamp.format(1)), _system(role_a)]
    acc.send([*team_a, *msgs("Begin.", "Reviewed X.", "Continue.")], 3_000, 0)
    ex = acc.send(
        [_system(base), _system(stamp.format(3)), _system(role_b), *msgs("Begin.")], 1_500, 0
    )
    assert ex.divergence is None and ex.cache is not None and ex.cache["expected"] == 0
    # the same first turn resent with the time changed in its prompt is still a rewrite
    acc = _Accounting({})
    timed = "You are a coding agent. Current time: 10:{:02d}. " + "Be careful. " * 50
    acc.send_body({"model": "gpt-4o", "messages": [_system(timed.format(1)), *msgs("hi")]}, 900, 0)
    ex = acc.send_body(
        {"model": "gpt-4o", "messages": [_system(timed.format(2)), *msgs("hi")]}, 900, 0
    )
    assert ex.divergence is not None and ex.divergence["location"] == "system"


def test_under_a_timed_prompt_an_agents_turn_is_compared_with_its_own_not_the_latest() -> None:
    """The time in the system prompt: every earlier request shares the parameters and tools
    alone with a new one, and the latest was taken, another chat's first request that opened
    alike: the agent's next turn expected that one's prompt, not its own previous one's."""
    acc = _Accounting()
    prompt = "Current time: 2026-12-04T10:{:02d}:00Z. " + "You are a helpful assistant. " * 40
    a = msgs("hi", "Hello! How can I help?", "tell me a joke")
    acc.send([_system(prompt.format(2)), *a], 2_900, 0)
    acc.send([_system(prompt.format(3)), *msgs("hi")], 1_000, 0)  # another chat, opening alike
    later = [*a, *msgs("Why did the chicken...", "another one")]
    ex = acc.send([_system(prompt.format(4)), *later], 3_100, 0)
    assert ex.cache is not None and 0 < 2_900 - ex.cache["expected"] < 29  # (the minutes')
    assert ex.divergence is not None and ex.divergence["volatile_kind"] == "timestamp"


def test_the_first_message_edited_at_the_second_turn_is_still_its_conversation() -> None:
    """An agent moves its environment details out of the first message on the second turn: no
    message was left that both requests share, the turn was taken for another conversation,
    and the ~8,000 tokens of the pasted text processed again were no waste. It carries the
    first answer on, where that one's next turn would; an answer two conversations gave alike,
    or a short one, names neither."""
    paste = "def handler(event):\n    return event\n" * 400
    answer = "The handler returns its event unchanged, so nothing breaks here. " * 4
    acc = _Accounting()
    first = [_system("agent"), *msgs("<env>cwd=/repo, time=10:00</env>\n" + paste)]
    acc.send(first, 8_300, 0, answer=answer)
    edited = [_system("agent"), *msgs(paste, answer, "Fix it.")]
    ex = acc.send(edited, 8_350, 1_152)
    assert ex.divergence is not None and ex.divergence["location"] == "messages"
    assert ex.cache is not None and ex.cache["cause"] == "prefix_rewrite"
    assert ex.cache["waste"] > 6_000
    # another agent's first request, under the same prompt: still another conversation
    other = acc.send([_system("agent"), *msgs("Write the release notes.")], 900, 0)
    assert other.divergence is None and other.cache is not None and other.cache["expected"] == 0
    # a first answer that is a tool call, with a short random id (Mistral's nine characters)
    call = {"id": "D681PevKs", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    said = {"role": "assistant", "content": None, "tool_calls": [call]}
    acc = _Accounting()
    acc.send(first, 8_300, 0, answer=said)
    result = {"role": "tool", "tool_call_id": "D681PevKs", "content": "ok"}
    ex = acc.send([_system("agent"), *msgs(paste), said, result], 8_350, 1_152)
    assert ex.cache is not None and ex.cache["cause"] == "prefix_rewrite"
    for given in ("I'll look into it and report back.", answer):
        acc = _Accounting()
        acc.send([_system("agent"), *msgs("Research topic kappa. " * 50)], 3_000, 0, answer=given)
        acc.send([_system("agent"), *msgs("Research topic beta. " * 50)], 3_000, 0, answer=given)
        later = acc.send([_system("agent"), *msgs("Research topic gamma.", given, "go")], 3_100, 0)
        assert later.divergence is None and later.cache is not None
        assert later.cache["expected"] == 0  # another conversation: nothing expected


@pytest.mark.parametrize(
    ("call_id", "name", "random"),
    [
        ("call_0eRNSqxG0QoQZ4cFRcXUQpGH", "read", True),  # OpenAI
        ("toolu_01A09q90qw90lq917835lq9", "read", True),  # Anthropic
        ("D681PevKs", "read", True),  # Mistral
        ("abcDEFghi", "read", True),  # Mistral, no digit
        ("call_k3j9x2ab", "read", True),  # Ollama
        ("chatcmpl-tool-3f2a9b41", "read", True),  # vLLM
        ("functions.read:0", "read", False),  # Kimi: a name and a counter
        ("functions.s3_list:0", "s3_list", False),
        ("function-call-1", "read", False),
        ("call_0", "read", False),
    ],
)
def test_only_ids_that_look_random_name_a_conversation(
    call_id: str, name: str, random: bool
) -> None:
    """Kimi's ids restart in every conversation: two conversations' first calls share them."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}
    assert _random_id(call) is random


def test_look_alike_conversations_do_not_replace_each_other() -> None:
    """Agents that share a system prompt and an opening, with their own tools, or workers whose
    tasks differ by a number only: each keeps its own baseline. And a fork that repeats a
    short message ("continue") of the original is still a fork."""
    acc = _Accounting()
    opening = [_system("You are a careful agent working in the repository."), *msgs("start")]
    tools_a = [{"type": "function", "function": {"name": "read", "parameters": {}}}]
    tools_b = [{"type": "function", "function": {"name": "write", "parameters": {}}}]
    a, b = list(opening), list(opening)
    for turn in range(3):
        a = [*a, *msgs(f"a {turn}", f"reader goes on {turn}")]
        b = [*b, *msgs(f"b {turn}", f"writer goes on {turn}")]
        for history, tools in ((a, tools_a), (b, tools_b)):
            ex = acc.send_body({"model": "gpt-4o", "messages": history, "tools": tools}, 5_000)
            if turn:
                assert ex.divergence is None, (turn, tools[0]["function"]["name"])
    shards = {n: [_system("worker"), *msgs(f"Process shard {n} of 8.")] for n in (1, 2)}
    for turn in range(3):
        for n in (1, 2):
            shards[n] = [*shards[n], *msgs(f"done part {turn}", f"next part of {n}")]
            ex = acc.send(shards[n], 4_000, 0)
            if turn:
                assert ex.divergence is None, (turn, n)


def test_a_fork_that_repeats_a_short_message_is_still_a_fork() -> None:
    acc = _Accounting()
    base = [_system("agent"), *msgs("task", "a1", "continue", "a2", "continue")]
    acc.send(base, 5_000, 0)
    fork = [*base[:4], *msgs("a2, edited", "more")]
    acc.send(fork, 5_000, 0)
    assert len(acc.state.extra["baselines"]) == 2
    ex = acc.send([*base, *msgs("a3", "and on")], 5_100, 5_000)
    assert ex.divergence is None


def test_the_no_prices_hint_names_the_table_the_model_matched(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A tagged local model matched its configured entry (its window for compaction): the hint
    named a new table of the full name, which starts from "*" and lost that window."""
    from prometheus_client import CollectorRegistry

    store = MemorySessionStore()
    store.create("s1", 0.0)
    settings = settings_from_mapping({"models": {"qwen2.5-coder": {"context_window": 8192}}})
    accounting = AccountingObserver(settings, store, Metrics(CollectorRegistry(), ()))
    with caplog.at_level(logging.INFO, logger="proxy.observers"):
        ex = exchange(1, msgs("task"))
        ex.model = "qwen2.5-coder:7b"
        ex.usage, ex.status = Usage(5000, 10, 0, 0, True), 200
        accounting.on_response(ex)
    said = [r.getMessage() for r in caplog.records if "has no prices" in r.getMessage()]
    assert said == [
        "model 'qwen2.5-coder:7b' has no prices (the configured entry 'qwen2.5-coder'): its cost"
        ' counts as $0; set price_input and price_output in [models."qwen2.5-coder"] of the'
        " config file"
    ]


def test_a_session_keeps_a_bounded_number_of_conversations_however_its_requests_repeat() -> None:
    """Every turn sent twice as it is (a dropped stream resent): the list of requests to compare
    with grew by one a turn, and the work per request with it (14 ms at turn 400)."""
    from prometheus_client import CollectorRegistry

    store = MemorySessionStore()
    store.create("s1", 0.0)
    accounting = AccountingObserver(
        settings_from_mapping({}), store, Metrics(CollectorRegistry(), ())
    )
    history = msgs("task")
    for i in range(1, 41):
        history = [*history, {"role": "assistant", "content": f"step {i}"}]
        history = [*history, {"role": "user", "content": f"go on {i}"}]
        for attempt in range(2):
            ex = exchange(2 * i + attempt, list(history))
            ex.usage, ex.status = Usage(1000 + i, 10, 900, 0, True), 200
            accounting.on_response(ex)
    state = store.get("s1")
    assert state is not None and len(state.extra["baselines"]) <= CONVERSATIONS_KEPT


def test_a_model_that_caches_nothing_is_priced_by_its_table_and_no_read_is_expected() -> None:
    """gpt-4o-2024-05-13, given the table the README shows: its prices, and no turn's miss
    counted as waste (that snapshot caches nothing)."""
    from prometheus_client import CollectorRegistry

    table = {
        "price_input": 5.0,
        "price_cached_input": 5.0,
        "price_output": 15.0,
        "cache_min_tokens": 1073741824,
    }
    settings = settings_from_mapping({"models": {"gpt-4o-2024-05-13": table}})
    store = MemorySessionStore()
    state = store.create("s1", 0.0)
    accounting = AccountingObserver(settings, store, Metrics(CollectorRegistry(), ()))
    history = msgs("a task " * 2000)
    for eid in (1, 2):
        ex = exchange(eid, history)
        ex.model = ex.body["model"] = "gpt-4o-2024-05-13"
        ex.session, ex.started_at = state, float(eid)
        ex.usage, ex.status = Usage(1_000_000, 1_000_000, 0, 0, True), 200
        accounting.on_response(ex)
        history = [*history, {"role": "assistant", "content": "done"}, *msgs("more")]
    assert ex.cost is not None and ex.cost["actual"] == pytest.approx(5.0 + 15.0)
    assert ex.cache is not None and ex.cache["waste"] == 0


def test_a_summary_counted_when_it_was_done_is_not_counted_again_and_hides_no_other() -> None:
    """An exchange went out with a summary the metrics counted when it was done (no request
    waited for it), then made one of its own (the provider refused the history as too long):
    one flag for the whole exchange left the second out of the metrics."""
    from prometheus_client import CollectorRegistry

    from proxy.compactor import Compactor

    settings = settings_from_mapping(
        {"models": {"gpt-4o": {"price_input": 1.0, "price_output": 2.0}}}
    )
    store = MemorySessionStore()
    store.create("s1", 0.0)
    accounting = AccountingObserver(settings, store, Metrics(CollectorRegistry(), ("gpt-4o",)))
    first = {"usage": {"prompt_tokens": 3000, "completion_tokens": 10}}
    second = {"usage": {"prompt_tokens": 5000, "completion_tokens": 20}}
    accounting.on_summary_usage(exchange(1, msgs("t")), "gpt-4o", Usage(3000, 10, 0, 0, False))
    ex = exchange(2, msgs("task"))
    ex.usage, ex.status = Usage(100, 1, 0, 0, False), 200
    Compactor._count_summary(ex, "gpt-4o", first, metered=True)
    Compactor._count_summary(ex, "gpt-4o", second)
    accounting.on_response(ex)

    metrics = accounting.metrics
    assert ex.cost is not None
    assert ex.cost["actual"] == pytest.approx((3000 + 5000 + 100 + 2 * (10 + 20 + 1)) / 1e6)
    assert metrics.cost.child("gpt-4o", "actual")[0] == pytest.approx(ex.cost["actual"])
    assert metrics.tokens.child("gpt-4o", "prompt")[0] == 3000 + 5000  # (the summaries alone)


@pytest.mark.parametrize("marked", [False, True])
def test_results_a_repair_keeps_are_held_and_those_it_drops_are_not(marked: bool) -> None:
    """What a trim's accounting counts as still sent: an orphaned result kept as a user message
    is, one dropped is not, also where the repair moved its ``cache_control`` mark (its action
    then says so, and the dropped result was counted as held)."""
    from proxy.observers import _repaired_away
    from proxy.pairing import repair_messages
    from proxy.prefix import message_digest

    text: Any = "output of the call"
    if marked:
        text = [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]
    orphan = {"role": "tool", "tool_call_id": "call_gone", "content": text}
    messages = [{"role": "system", "content": "Be brief."}, orphan, {"role": "user", "content": "Go on."}]  # fmt: skip
    for policy, held in (("downgrade", True), ("drop", False)):
        result = repair_messages(messages, orphan_policy=policy)  # type: ignore[arg-type]
        ex = Exchange("chat", "POST", "chat/completions", 0.0, 0.0)
        ex.client_body, ex.body = {"messages": messages}, {"messages": result.messages}
        ex.repairs = [{"index": r.index, "action": r.action} for r in result.repairs]
        assert ex.repairs, policy
        # (the system message a moved mark changed is still sent: held)
        assert (message_digest(orphan) in _repaired_away(ex)) is held, (policy, ex.repairs)


def test_an_hour_long_breakpoints_share_weighs_an_image_by_its_estimate() -> None:
    """The share of the prompt an hour's breakpoint covers, which the expired rest is split
    from: a screenshot in the marked part counted its base64 (a 1 MB data URL outweighed the
    whole conversation after it)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 400_000}}
    hour = {"type": "ephemeral", "ttl": "1h"}
    body = {
        "messages": [
            {"role": "user", "content": [image, {"type": "text", "text": "what is on it?"}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "ok", "cache_control": hour}],
            },
            *msgs("a " * 20_000, "b " * 20_000),
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}}
                ],
            },
        ]
    }
    found = _longer_lived(body, 300.0, 20_000, None)
    assert found is not None and found[0] == 3600.0
    assert found[1] < 20_000 * 0.2  # (the image ~1,600 of ~21,600 estimated tokens)


def test_turns_sent_twice_by_siblings_do_not_crowd_out_a_lagging_sub_agents_own() -> None:
    """Sub-agents under one session, each sending every turn twice (a client's re-send after a
    hang-up or a failure mid-stream), and one that lags: each re-sent turn left its first copy
    behind as a conversation when the turn after it went on, 32 were soon full of them, and
    the lagging sub-agent's own was forgotten: its next turn was compared with a sibling's, a
    rewrite of the task the client never made."""
    acc = _Accounting({})
    system = _system("You are a sub-agent. " * 50)

    def history(agent: int, turns: int) -> list[Message]:
        task = f"Sub-agent {agent}: look into module {agent}. " * 20
        return [system, *msgs(task, *[f"step {t} of {agent} " * 30 for t in range(turns * 2)])]

    acc.send_body({"model": "gpt-4o", "messages": history(0, 0)}, 3_000, 0, at=0.0)
    for turn in range(6):
        for agent in range(1, 8):
            body = {"model": "gpt-4o", "messages": history(agent, turn)}
            for _ in range(2):  # sent twice
                acc.send_body(body, 3_000 + 100 * turn, 0, at=1.0 + turn)
    ex = acc.send_body({"model": "gpt-4o", "messages": history(0, 1)}, 3_200, 2_900, at=9.0)
    assert ex.divergence is None  # compared with its own first turn
    assert ex.cache is not None and ex.cache["expected"] == 3_000


def test_sub_agents_sent_alike_keep_their_shared_turn_past_older_one_shots() -> None:
    """Eight sub-agents send the same first request together, then each goes its own way, in a
    session that had 28 one-shot requests before: the shared turn, left behind once the first
    sibling went on, was forgotten before the older one-shots, and the others' next turns were
    compared with a sibling's (a rewrite of the task they never made)."""
    for one_shots_after in (False, True):  # (title requests come in all the time)
        acc = _Accounting({})
        system = _system("You are a sub-agent. " * 50)
        main = {"model": "gpt-4o", "messages": [system, *msgs("main task " * 40)]}
        acc.send_body(main, 3_000, at=0.0)

        def one_shots(count: int, at: float, acc: _Accounting = acc) -> None:
            for k in range(count):
                title = [_system(f"title {k}"), *msgs("hi")]
                acc.send_body({"model": "gpt-4o", "messages": title}, 50, at=at + k / 100)

        one_shots(0 if one_shots_after else 28, 1.0)
        shared = [system, *msgs("Fan-out: look into the modules. " * 40)]
        for _ in range(8):  # (sent together)
            acc.send_body({"model": "gpt-4o", "messages": shared}, 3_100, at=10.0)
        for turn in range(3):
            for agent in range(8):
                own = [*msgs(*(f"agent {agent} turn {t}: " * 30 for t in range(2 * turn + 2)))]
                body = {"model": "gpt-4o", "messages": [*shared, *own[1:]]}
                at = 20.0 + 10 * turn + agent
                ex = acc.send_body(body, 3_200 + 100 * turn, 3_000, at=at)
                assert ex.divergence is None, (one_shots_after, turn, agent)
                assert ex.cache is not None and ex.cache["expected"] > 3_000  # (compared)
                if one_shots_after and turn == 0 and agent == 0:
                    one_shots(31, at + 0.1)


def test_first_turns_re_sent_and_gone_on_are_forgotten_before_a_live_first_turn() -> None:
    """Fifteen sub-agents each re-sent their first turn (a retry after a hang-up) and went on;
    then a new sub-agent's first turn: it was forgotten before those stale copies, and its next
    turn was compared with another sub-agent's (a system prompt "rewritten")."""
    acc = _Accounting({})
    main = [_system("You are the main agent. " * 50), *msgs("main task " * 40)]
    acc.send_body({"model": "gpt-4o", "messages": main}, 3_000)
    for k in range(15):
        first = [_system(f"sub-agent {k}. " * 50), *msgs(f"task {k} " * 40)]
        acc.send_body({"model": "gpt-4o", "messages": first}, 3_000)
        acc.send_body({"model": "gpt-4o", "messages": first}, 3_000, 3_000)
        went_on = [*first, {"role": "assistant", "content": f"ok {k}"}, *msgs("go")]
        acc.send_body({"model": "gpt-4o", "messages": went_on}, 3_100, 3_000)
    x = [_system("sub-agent X. " * 50), *msgs("task X " * 40)]
    acc.send_body({"model": "gpt-4o", "messages": x}, 3_000)
    y = [_system("sub-agent Y. " * 50), *msgs("task Y " * 40)]
    acc.send_body({"model": "gpt-4o", "messages": y}, 3_000)
    later = [*x, {"role": "assistant", "content": "ok X"}, *msgs("go")]
    ex = acc.send_body({"model": "gpt-4o", "messages": later}, 3_100, 0)
    assert ex.divergence is None  # its own first turn, not another sub-agent's
    assert ex.cache is not None and ex.cache["expected"] == 3_000


def test_a_pair_of_sub_agents_sent_together_is_no_re_send() -> None:
    """Two sub-agents send the same first request together and one goes on; title requests
    come; the other goes on: its shared turn was forgotten as a client's re-send before any
    one-shot, and its turn compared with its sibling's. A re-send comes after the answer."""
    acc = _Accounting({})
    system = _system("You are a sub-agent. " * 50)
    acc.send_body({"model": "gpt-4o", "messages": [system, *msgs("main " * 40)]}, 3_000, at=0.0)
    shared = [system, *msgs("Fan-out: look into the modules. " * 40)]
    for _ in range(2):
        acc.send_body({"model": "gpt-4o", "messages": shared}, 3_100, at=10.0)

    def went_on(agent: int, at: float) -> Exchange:
        own = [*shared, {"role": "assistant", "content": f"agent {agent} " * 30}, *msgs("go")]
        return acc.send_body({"model": "gpt-4o", "messages": own}, 3_300, 3_000, at=at)

    went_on(0, 20.0)
    for k in range(40):
        title = [_system(f"title {k}"), *msgs("hi")]
        acc.send_body({"model": "gpt-4o", "messages": title}, 50, at=21.0 + k / 100)
    ex = went_on(1, 30.0)
    assert ex.divergence is None and ex.cache is not None and ex.cache["expected"] > 3_000


def test_a_basic_credential_s_user_name_is_no_key_unless_it_is_one() -> None:
    """Basic's user and password are the client's keys as an upstream quotes them decoded;
    but a user name alone (``developer``) was taken out of every line, the ``developer`` role
    and the words of the conversation with it. The user alone counts where the password is
    empty (a key given as the user, ``-u KEY:``) or it looks like a key."""
    import base64

    from proxy.observers import client_keys

    def keys(credential: bytes) -> tuple[str, ...]:
        return client_keys([(b"authorization", b"Basic " + base64.b64encode(credential))])

    assert "developer" not in keys(b"developer:S3cr3tPassw0rd!")
    assert {"developer:S3cr3tPassw0rd!", "S3cr3tPassw0rd!"} <= set(
        keys(b"developer:S3cr3tPassw0rd!")
    )
    assert "sk_live_abcdef0123456789XYZ" in keys(b"sk_live_abcdef0123456789XYZ:")
    assert "Zk8Lm3Nq7Rs2Tv6Wx0Yz4Ab9" in keys(b"Zk8Lm3Nq7Rs2Tv6Wx0Yz4Ab9:x-oauth-basic")
    keys(b"\xff\xfe" * 8)  # (no failure on odd values: not UTF-8, no colon)
    assert base64.b64encode(b"no colon at all").decode() in keys(b"no colon at all")


def test_a_responses_answer_is_carried_on_after_its_reasoning_items_not_by_an_output() -> None:
    """A reasoning model's answer comes back as ``[reasoning, message]`` or ``[reasoning,
    function_call…]`` items: the next turn carries it on past the reasoning item. An output
    item that answers one of its calls (a ``previous_response_id`` chain sends only those) is
    no part of it."""
    from proxy.observers import _Answer, _carries_answer, _text_digest

    text = "The handler returns the wrong status for a missing file; " * 5
    call_id = "call_Xy7Kq2Lm9Np4Rt6Vb1Zc3Hd5"
    baseline: Any = SimpleNamespace(
        answer=_Answer(len(text), _text_digest(text), frozenset({call_id})),
        fp=SimpleNamespace(messages=[1, 2]),
    )
    opening = [_system("s"), {"role": "user", "content": "fix it"}]
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"}
    said = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    call = {"type": "function_call", "call_id": call_id, "name": "sh", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": call_id, "output": "ok"}
    assert _carries_answer(baseline, {"messages": [*opening, reasoning, said]})
    assert _carries_answer(baseline, {"messages": [*opening, reasoning, call, output]})
    assert not _carries_answer(baseline, {"messages": [*opening, output]})
    other = {**said, "content": [{"type": "output_text", "text": text + "!"}]}
    assert not _carries_answer(baseline, {"messages": [*opening, reasoning, other]})


def test_a_claude_turn_that_stops_before_the_last_breakpoint_expects_an_entry_within_it() -> None:
    """Claude: a turn sent again shorter than the one before it (a regenerated first answer
    after a longer turn), ending before that one's last breakpoint. What it could read is an
    entry within it, here the system prompt that one marked: all its prompt was expected, and
    the rest called ``unexplained``."""
    acc = _Accounting({})
    system = {
        "role": "system",
        "content": [
            {"type": "text", "text": "agent " * 6000, "cache_control": {"type": "ephemeral"}}
        ],
    }
    first = [system, *msgs("fix the bug " * 1000)]
    longer = _last_marked([*first, *msgs("looked", "go on " * 1000)])

    def send(messages: list[Message], prompt: int, read: int, write: int, at: float) -> Exchange:
        acc.eid += 1
        ex = exchange(acc.eid, messages)
        ex.body = {"model": "claude-sonnet-4", "messages": messages}
        ex.model, ex.session, ex.started_at = "claude-sonnet-4", acc.state, at
        ex.t0 = at
        ex.usage, ex.status = Usage(prompt, 10, read, write, True, True, True), 200
        acc.observer.on_response(ex)
        return ex

    send(longer, 12_000, 0, 12_000, 0.0)
    ex = send(_last_marked(first), 9_000, 6_000, 3_000, 10.0)
    assert ex.cache is not None and ex.cache["waste"] == 0, ex.cache
    assert 6_000 <= ex.cache["expected"] < 9_000  # (the system prompt's share, by estimate)


@pytest.mark.parametrize("writes", [True, False])
def test_a_claude_turn_after_a_fork_one_message_on_expects_the_entry_the_fork_read(
    writes: bool,
) -> None:
    """The main agent's turn after a sub-agent forked from its history one message on, which
    read the main agent's last entry: that entry is what the turn could read, and reading none
    of it is a waste of all of it. Through a gateway that reports the reads alone (OpenRouter
    without ``cache_write_tokens``) the fork's read was not kept, and only its system prompt's
    share was expected: the waste under-reported by half."""
    acc = _Accounting({})
    model = "anthropic/claude-sonnet-4"
    system = {
        "role": "system",
        "content": [
            {"type": "text", "text": "agent " * 4000, "cache_control": {"type": "ephemeral"}}
        ],
    }

    def send(messages: list[Message], prompt: int, read: int, at: float) -> Exchange:
        acc.eid += 1
        ex = exchange(acc.eid, messages)
        ex.body = {"model": model, "messages": _last_marked(messages)}
        ex.model, ex.session, ex.started_at = model, acc.state, at
        ex.t0 = at
        wrote = prompt - read if writes else 0
        ex.usage, ex.status = Usage(prompt, 10, read, wrote, True, writes, False), 200
        acc.observer.on_response(ex)
        return ex

    history = [system, *msgs("fix the bug " * 2000)]
    send(history, 12_000, 0, 0.0)
    turn = [*history, *msgs("looked " * 300, "tool output " * 2000)]
    send([*turn, *msgs("Sub-agent task: " * 300)], 20_000, 12_000, 5.0)
    ex = send(turn, 18_000, 0, 10.0)
    assert ex.cache is not None
    assert (ex.cache["expected"], ex.cache["waste"]) == (12_000, 12_000), ex.cache


@pytest.mark.parametrize("calls", [24, 2])
@pytest.mark.parametrize("system_marked", [True, False])
def test_a_claude_turn_past_the_look_back_of_the_last_entry_is_not_the_providers_miss(
    calls: int, system_marked: bool
) -> None:
    """Claude finds an entry only within ~20 content blocks before one of a request's
    breakpoints. A turn of 24 parallel tool calls and their results, only its latest message
    marked, cannot reach the entry the turn before wrote: what it missed (beyond the system
    prompt's entry, where that is marked) was never in reach, `not_requested`, not the
    `unexplained` eviction it was called. Two calls are within reach: that miss is the
    provider's."""
    from prometheus_client import CollectorRegistry

    acc = _Accounting({})
    registry = CollectorRegistry()
    acc.observer.metrics = Metrics(registry, ())
    model = "claude-sonnet-4-5"
    mark = {"type": "ephemeral"}
    system: Message = {"role": "system", "content": "agent " * 5000}
    if system_marked:
        system = {
            "role": "system",
            "content": [{"type": "text", "text": "agent " * 5000, "cache_control": mark}],
        }

    def send(messages: list[Message], prompt: int, read: int, write: int, at: float) -> Exchange:
        acc.eid += 1
        ex = exchange(acc.eid, messages)
        ex.body = {"model": model, "messages": messages}
        ex.model, ex.session, ex.started_at = model, acc.state, at
        ex.t0 = at
        ex.usage, ex.status = Usage(prompt, 10, read, write, True, True, True), 200
        acc.observer.on_response(ex)
        return ex

    task = msgs("fix the bug " * 500)
    first = [system, *_last_marked(task)]
    send(first, 13_000, 0, 13_000, 0.0)
    ids = [f"toolu_{i:02d}" for i in range(calls)]
    turn: list[Message] = [
        *task,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": i, "type": "function", "function": {"name": "read", "arguments": "{}"}}
                for i in ids
            ],
        },
        *({"role": "tool", "tool_call_id": i, "content": "x " * 30} for i in ids),
    ]
    read = 10_000 if system_marked else 0
    ex = send([system, *_last_marked(turn)], 16_500, read, 16_500 - read, 30.0)
    assert ex.cache is not None
    shortfall = 13_000 - read
    if calls == 2:  # (within reach: the provider's miss, as before)
        assert (ex.cache["waste"], ex.cache["cause"]) == (shortfall, "unexplained"), ex.cache
        return
    assert ex.cache["cause"] == "not_requested", ex.cache
    assert ex.cache["waste"] + ex.cache.get("not_requested", 0) == shortfall
    wasted = "cachegate_cache_waste_tokens_total"
    assert not registry.get_sample_value(wasted, {"model": "other", "cause": "unexplained"})
    assert registry.get_sample_value(wasted, {"model": "other", "cause": "not_requested"})


def test_a_side_call_on_another_model_after_a_pause_is_its_cold_start_not_the_expiry() -> None:
    """The main agent paused past its TTL; a summary side call on a small model carried its
    prompt and history, then the main agent went on. Both were charged the main agent's
    expiry (ttl_expired twice over: twice the real expiry in the metrics and `sessions cost`);
    the side call's model never held the prefix, idle or not: its miss is params_changed."""
    acc = _Accounting({"gpt-4o": {"cache_ttl_s": 100}, "gpt-4o-mini": {"cache_ttl_s": 100}})
    history = [_system("agent " * 3000), *msgs("fix the bug " * 500)]
    acc.send_body({"model": "gpt-4o", "messages": history}, 9_000, 0, at=0.0)
    history += msgs("looked", "go on")
    acc.send_body({"model": "gpt-4o", "messages": history}, 9_100, 8_960, at=10.0)
    side = acc.send_body({"model": "gpt-4o-mini", "messages": history}, 9_150, 0, at=400.0)
    assert side.cache is not None
    assert (side.cache["cause"], side.cache["location"]) == ("params_changed", "params.model")
    history += msgs("done", "next")
    main = acc.send_body({"model": "gpt-4o", "messages": history}, 9_300, 0, at=410.0)
    assert main.cache is not None and main.cache["cause"] == "ttl_expired", main.cache
    assert main.cache["waste"] >= 9_000


def test_a_gateways_spelling_of_the_same_model_after_a_pause_is_still_the_expiry() -> None:
    """``openai/gpt-4o`` is the model ``gpt-4o`` is, whose cache held the prefix: its miss
    after a pause past the TTL is the expiry's, not a change of model."""
    acc = _Accounting({"gpt-4o": {"cache_ttl_s": 100}})
    history = [_system("agent " * 3000), *msgs("fix the bug " * 500)]
    acc.send_body({"model": "gpt-4o", "messages": history}, 9_000, 0, at=0.0)
    history += msgs("looked", "go on")
    acc.send_body({"model": "gpt-4o", "messages": history}, 9_100, 8_960, at=10.0)
    later = acc.send_body({"model": "openai/gpt-4o", "messages": history}, 9_100, 0, at=400.0)
    assert later.cache is not None and later.cache["cause"] == "ttl_expired", later.cache
