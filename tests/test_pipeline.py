"""The observer seams: ``notify`` and ``notify_each`` never let an observer break the others."""

from __future__ import annotations

import logging

import pytest

from proxy.pipeline import Exchange, notify, notify_each


def _exchange(i: int) -> Exchange:
    return Exchange("chat", "POST", "chat/completions", 0.0, 0.0, exchange_id=i)


class Recording:
    def __init__(self, name: str, seen: list[tuple[str, str, int]]) -> None:
        self.name = name
        self.seen = seen

    def on_request(self, ex: Exchange) -> None:
        self.seen.append((self.name, "request", ex.exchange_id))

    def on_response(self, ex: Exchange) -> None:
        self.seen.append((self.name, "response", ex.exchange_id))


class Failing:
    def on_request(self, ex: Exchange) -> None:
        raise RuntimeError("observer bug")

    def on_response(self, ex: Exchange) -> None:
        raise RuntimeError("observer bug")


class ResponsesOnly:
    def __init__(self, seen: list[tuple[str, str, int]]) -> None:
        self.seen = seen

    def on_response(self, ex: Exchange) -> None:
        self.seen.append(("late", "response", ex.exchange_id))


def test_notify_each_runs_every_observer_over_the_calls_in_order(caplog) -> None:
    """Observer by observer, each over the calls in the order given; a failing observer is
    logged for each of its calls and the observers after it still run; one without a hook is
    skipped for that hook only."""
    seen: list[tuple[str, str, int]] = []
    first, second = Recording("first", seen), Recording("second", seen)
    calls = [(True, _exchange(1)), (True, _exchange(2)), (False, _exchange(1))]
    with caplog.at_level(logging.ERROR, logger="proxy.pipeline"):
        notify_each([first, Failing(), second, ResponsesOnly(seen)], calls)  # type: ignore[list-item]
    assert seen == [
        ("first", "request", 1),
        ("first", "request", 2),
        ("first", "response", 1),
        ("second", "request", 1),
        ("second", "request", 2),
        ("second", "response", 1),
        ("late", "response", 1),
    ]
    failures = [r for r in caplog.records if "Failing" in r.getMessage()]
    assert len(failures) == 3 and all("response is unaffected" in r.getMessage() for r in failures)


@pytest.mark.parametrize("hook", ["on_request", "on_response"])
def test_notify_calls_each_observer_once_and_survives_a_failing_one(hook: str, caplog) -> None:
    seen: list[tuple[str, str, int]] = []
    with caplog.at_level(logging.ERROR, logger="proxy.pipeline"):
        notify([Failing(), Recording("after", seen)], hook, _exchange(7))  # type: ignore[list-item]
    assert seen == [("after", hook.removeprefix("on_"), 7)]
    assert any("Failing" in r.getMessage() for r in caplog.records)


def test_an_observer_failing_on_a_deep_body_is_said_in_one_line(caplog) -> None:
    """A RecursionError's traceback (a body nested deeper than a walk of it takes) was ~1,000
    frames, ~225 KB of cachegate's log per request, which any client could send on every one."""

    class TooDeep:
        def on_response(self, ex: Exchange) -> None:
            def walk(n: int) -> int:
                return walk(n + 1)

            walk(0)

    with caplog.at_level(logging.ERROR, logger="proxy.pipeline"):
        notify([TooDeep()], "on_response", _exchange(3))  # type: ignore[list-item]
    (record,) = [r for r in caplog.records if "TooDeep" in r.getMessage()]
    assert record.exc_info is None
    assert "nested deeper than that walk takes, or a bug" in record.getMessage()
    assert " in walk (" in record.getMessage() and "test_pipeline.py:" in record.getMessage()
    assert len(record.getMessage()) < 400


def test_an_error_page_indented_with_spaces_is_not_cut_inside_the_key_it_echoes() -> None:
    """A 401 page whose first 1,200 bytes end inside the key it names: the bytes were cut there
    before the white space went, the text left was short, and a piece of the key (too short
    for any key's pattern) reached the log."""
    from proxy.pipeline import refusal_text

    key = "azkfHgHQM1YhnuIN3MtiAb3dEf6hIj9kLm2nOp5qRs8t"
    page = b"<html>" + b" " * 1160 + f"Invalid key: {key} </html>".encode()
    assert page.index(key.encode()) < 1200 < page.index(key.encode()) + len(key)
    said = refusal_text(401, page)
    assert said == "upstream answered 401: <html> Invalid key: …"
    assert not any(key[:n] in said for n in range(4, len(key)))


@pytest.mark.parametrize(
    "body",
    [
        b'data: {"error":{"message":"slow down","type":"rate_limit_error"}}\n\n',
        b'event: error\r\ndata: {"error":{"message":"slow down"}}\r\n\r\n',
        b': keep-alive\n\nid: 1\ndata: {"error":{"message":"slow down"}}\n\n',
    ],
)
def test_an_error_sent_as_an_event_stream_is_logged_by_its_message(body: bytes) -> None:
    """A 429 streamed as an event: its log text was the event's raw line, ``upstream answered
    429: data: {"error":{"message":"slow down",…``."""
    from proxy.pipeline import refusal_text

    assert refusal_text(429, body) == "slow down"
    # an event whose data is no JSON: its text, as any body's
    assert refusal_text(503, b"data: overloaded\n\n") == "upstream answered 503: data: overloaded"


def test_a_printed_exchange_never_shows_the_upstream_key() -> None:
    ex = Exchange("chat", "POST", "chat/completions", 0.0, 0.0)
    ex.upstream_headers = [(b"authorization", b"Bearer sk-server-key-0123456789")]
    assert "sk-server-key" not in repr(ex) and "sk-server-key" not in str(ex)
    assert "chat/completions" in repr(ex)  # the rest is still there to debug with


def test_a_logged_refusal_is_cut_outside_a_key_but_keeps_what_it_says() -> None:
    from proxy.pipeline import MAX_ERROR_TEXT, clip_words

    key = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb7cDe0f"
    text = "." * 262 + f" Incorrect API key provided: {key}. See your account."
    cut = clip_words(text, MAX_ERROR_TEXT)
    assert cut == "." * 262 + " Incorrect API key provided: …"
    # a run longer than any key, and text in another script, are cut where the limit falls:
    # the logged error used to be "…" alone
    assert clip_words("x" * 2000, 300) == "x" * 300 + "…"
    assert clip_words("错误" * 400, 300) == ("错误" * 400)[:300] + "…"
    assert clip_words("<html>" + "y" * 2000, 300) == ("<html>" + "y" * 2000)[:300] + "…"
    assert clip_words("short", 300) == "short"
