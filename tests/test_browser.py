"""Web pages in the user's browser cannot spend the user's key through cachegate."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from proxy.browser import BrowserGuard, host_of_header, is_loopback_name
from proxy.simulator import RunningSimulator, SimConfig, run_simulator

HELLO = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "LOCALHOST",
        "localhost.",
        "app.localhost",
        "127.0.0.1",
        "127.8.9.10",
        "::1",
        "[::1]",
    ],
)
def test_loopback_names(host: str) -> None:
    assert is_loopback_name(host)


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "localhost.evil.example",
        "127.0.0.1.nip.io",
        "0.0.0.0",
        "10.0.0.1",
        "",
        "[::2]",
        "::ffff:8.8.8.8",
    ],
)
def test_other_names(host: str) -> None:
    assert not is_loopback_name(host)


@pytest.mark.parametrize(
    ("value", "host"),
    [
        ("127.0.0.1:8787", "127.0.0.1"),
        ("localhost", "localhost"),
        ("[::1]:8787", "[::1]"),
        ("[::1]", "[::1]"),
        ("evil.example:80", "evil.example"),
    ],
)
def test_host_of_header(value: str, host: str) -> None:
    assert host_of_header(value) == host


def _refusal(guard: BrowserGuard, **headers: str) -> str | None:
    err = guard.refusal([(k.encode(), v.encode()) for k, v in headers.items()])
    return None if err is None else err.code


def test_guard_refuses_foreign_pages_and_rebound_names() -> None:
    guard = BrowserGuard("127.0.0.1", ["https://Chat.Example.com/"])
    assert _refusal(guard, host="127.0.0.1:8787") is None  # an SDK: no Origin
    assert _refusal(guard, host="localhost:8787", origin="http://localhost:3000") is None
    assert _refusal(guard, host="127.0.0.1:8787", origin="http://[::1]:5173") is None
    assert _refusal(guard, host="127.0.0.1", origin="https://chat.example.com") is None  # listed
    assert _refusal(guard, host="127.0.0.1", origin="https://evil.example") == "forbidden_origin"
    assert _refusal(guard, host="127.0.0.1", origin="null") == "forbidden_origin"
    assert _refusal(guard, host="127.0.0.1", origin="file://") == "forbidden_origin"
    assert _refusal(guard, host="rebind.evil.example:8787") == "forbidden_host"
    assert _refusal(guard, host="127.0.0.1:8787") is None  # judged once, remembered
    assert _refusal(guard, host="rebind.evil.example:8787") == "forbidden_host"  # still refused
    # a request without Host (HTTP/1.0) is not judged by it
    assert _refusal(guard) is None


def test_bound_to_all_addresses_other_names_are_fine_but_pages_are_not() -> None:
    guard = BrowserGuard("0.0.0.0")  # a container: clients reach it by the service's name
    assert _refusal(guard, host="cachegate:8787") is None
    assert _refusal(guard, host="cachegate:8787", origin="https://evil.example") == (
        "forbidden_origin"
    )


# --- end to end, over loopback ------------------------------------------------------------------


@pytest.fixture
def sim() -> Iterator[RunningSimulator]:
    with run_simulator(SimConfig(chunk_ms=1)) as running:
        yield running


def test_a_page_cannot_spend_the_key_and_a_rebound_name_cannot_read(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(sim.api_base, environ={"OPENAI_API_KEY": "sk-users-own-key"})
    url = proxy.url + "/v1/chat/completions"
    # What a page's fetch() sends without a preflight: text/plain, an Origin, no Authorization.
    page = httpx.post(
        url,
        content=json.dumps(HELLO),
        headers={"content-type": "text/plain", "origin": "https://evil.example"},
    )
    assert page.status_code == 403
    assert page.json()["error"]["code"] == "forbidden_origin"
    rebound = httpx.get(proxy.url + "/v1/models", headers={"host": "rebind.evil.example:8787"})
    assert rebound.status_code == 403
    assert rebound.json()["error"]["code"] == "forbidden_host"
    metrics = httpx.get(proxy.url + "/metrics", headers={"host": "rebind.evil.example"})
    assert metrics.status_code == 403
    assert sim.sim.requests == []  # nothing reached the provider with the user's key

    # the same requests from the machine itself go through
    ok = httpx.post(url, json=HELLO, headers={"origin": "http://localhost:8787"})
    assert ok.status_code == 200
    assert httpx.get(proxy.url + "/v1/models").status_code == 200
    assert len(sim.sim.requests) == 2
    assert sim.sim.requests[0].headers["authorization"] == "Bearer sk-users-own-key"
    proxy.settle()
    refused = {"route": "chat", "model": "other", "status": "403"}
    assert proxy.metric("cachegate_requests_total", refused) == 1
    refused["route"] = "passthrough"
    assert proxy.metric("cachegate_requests_total", refused) == 1


def test_allowed_origins_lets_a_listed_page_through(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    proxy = proxy_factory(
        sim.api_base, {"server": {"allowed_origins": "https://chat.example.com, https://b.test"}}
    )
    url = proxy.url + "/v1/chat/completions"
    assert httpx.post(url, json=HELLO, headers={"origin": "https://chat.example.com"}).is_success
    assert httpx.post(url, json=HELLO, headers={"origin": "https://b.test"}).is_success
    other = httpx.post(url, json=HELLO, headers={"origin": "https://c.test"})
    assert other.status_code == 403
