"""Web pages in the user's browser cannot spend the user's key through cachegate."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from proxy.browser import BrowserGuard, binds_loopback, host_of_header, is_loopback_name
from proxy.config import ConfigError, settings_from_mapping
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
        "127.1",  # (short forms the socket layer binds as 127.0.0.1: --host 127.1)
        "127.0.1",
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
        "10.1",
        "...",
        "127.1.evil.example",
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
    err = guard.refusal({k.replace("_", "-"): v for k, v in headers.items()})
    return None if err is None else err.code


def test_guard_refuses_foreign_pages_and_rebound_names() -> None:
    guard = BrowserGuard("127.0.0.1", ["https://Chat.Example.com:443/"])
    assert _refusal(guard, host="127.0.0.1:8787") is None  # an SDK: no Origin
    assert _refusal(guard, host="localhost:8787", origin="http://localhost:3000") is None
    assert _refusal(guard, host="127.0.0.1:8787", origin="http://[::1]:5173") is None
    assert _refusal(guard, host="127.0.0.1", origin="https://chat.example.com") is None  # listed
    assert _refusal(guard, host="127.0.0.1", origin="https://evil.example") == "forbidden_origin"
    assert _refusal(guard, host="127.0.0.1", origin="null") == "forbidden_origin"
    assert _refusal(guard, host="127.0.0.1", origin="file://") == "forbidden_origin"
    assert _refusal(guard, host="127.0.0.1", origin="vscode-webview://1f2e") == "forbidden_origin"
    for malformed in ("http://[::1", "http://[zz]:80", "http://"):  # no page has these
        assert _refusal(guard, host="127.0.0.1", origin=malformed) == "forbidden_origin"
    # Electron's pages from files say "file://": allowed when listed (its "://" was lost)
    electron = BrowserGuard("127.0.0.1", ["file://*"])
    assert _refusal(electron, host="127.0.0.1", origin="file://") is None
    # "null" stays refused whatever a configuration lists (one made past the config's check)
    trusting = BrowserGuard("127.0.0.1", ["null://*", "null"])
    assert _refusal(trusting, host="127.0.0.1", origin="null") == "forbidden_origin"
    assert _refusal(guard, host="rebind.evil.example:8787") == "forbidden_host"
    assert _refusal(guard, host="0.0.0.0:8787") == "forbidden_host"
    # a request without Host (HTTP/1.0) is not judged by it
    assert _refusal(guard) is None


def test_verdicts_are_remembered_for_allowed_headers_only() -> None:
    guard = BrowserGuard("127.0.0.1")
    for _ in range(3):
        assert _refusal(guard, host="127.0.0.1:8787", origin="http://localhost:3000") is None
        assert _refusal(guard, host="evil.example", origin="https://evil.example") is not None
    assert guard._hosts == {"127.0.0.1:8787"}
    assert guard._origins == {"http://localhost:3000"}
    for i in range(200):  # a client cycling names does not grow them past their bound
        _refusal(guard, host=f"127.0.0.{i % 250}:8787")
    assert len(guard._hosts) == 64


def test_a_rebound_pages_same_origin_reads_are_refused_on_any_bind() -> None:
    guard = BrowserGuard("0.0.0.0")  # a container published on 127.0.0.1: no Host check
    same = {"sec_fetch_site": "same-origin"}
    # a rebound page's fetch() of its own (new) address: a same-origin GET carries no Origin
    assert _refusal(guard, host="evil.example:8787", **same, sec_fetch_mode="cors") == (
        "forbidden_origin"
    )
    # ... nor may it load cachegate in a frame of its own origin and read it
    assert _refusal(guard, host="evil.example:8787", **same, sec_fetch_mode="navigate") == (
        "forbidden_origin"
    )
    # a dev server's proxy forwards its page's same-origin request with a loopback Host
    assert _refusal(guard, host="localhost:5173", **same, sec_fetch_mode="cors") is None
    # Electron's net.fetch from an app's main process: cross-site, no Origin; it cannot be a
    # rebound page reading an answer (a page's cross-site read always carries an Origin)
    assert (
        _refusal(guard, host="127.0.0.1:8787", sec_fetch_site="cross-site", sec_fetch_mode="cors")
        is None
    )
    # typed in the address bar, or a link followed from another page: served
    assert _refusal(guard, host="127.0.0.1:8787", sec_fetch_site="none") is None
    assert _refusal(guard, host="x", sec_fetch_site="cross-site", sec_fetch_mode="navigate") is None


def test_listed_names_containers_and_schemes() -> None:
    guard = BrowserGuard("::1", ["vscode-webview://*", "app://studio"], ["proxy.lan"])
    assert _refusal(guard, host="[::1]:8787") is None
    assert _refusal(guard, host="localhost6:8787") is None
    assert _refusal(guard, host="[::ffff:127.0.0.1]:8787") is None
    assert _refusal(guard, host="host.docker.internal:8787") is None  # a container's agent
    assert _refusal(guard, host="host.containers.internal:8787") is None
    assert _refusal(guard, host="Proxy.LAN.:8787") is None
    assert _refusal(guard, host="other.lan:8787") == "forbidden_host"
    assert _refusal(guard, host="[::1]", origin="vscode-webview://9a8b-7c6d") is None
    assert _refusal(guard, host="[::1]", origin="app://studio") is None
    assert _refusal(guard, host="[::1]", origin="app://other") == "forbidden_origin"


def test_bound_to_all_addresses_other_names_are_fine_but_pages_are_not() -> None:
    guard = BrowserGuard("0.0.0.0", allowed_hosts=["gateway.corp.example"])
    # a container: clients reach it by the service's name, an address, a private-use name
    for host in (
        "cachegate:8787",
        "172.18.0.3:8787",
        "[fd00::3]:8787",
        "devbox.local:8787",
        "cachegate.internal",
        "nas.home.arpa:8787",
        "cachegate.agents.svc:8787",  # (Kubernetes)
        "cachegate.agents.svc.cluster.local:8787",
        "gateway.corp.example:8787",  # (listed)
        "host.docker.internal:8787",
        "localhost:8787",
    ):
        assert _refusal(guard, host=host) is None, host
    assert _refusal(guard, host="cachegate:8787", origin="https://evil.example") == (
        "forbidden_origin"
    )
    # A name in public DNS is a page's to re-point at this machine: browsers send no
    # Sec-Fetch-Site to a plain-http name, so a rebound page's same-origin GET carries no
    # header but its Host (it read, with the user's key, what cachegate answered)
    for host in ("rebind.attacker.example:8787", "evil.example", "a.b.c.d.e.com:80"):
        assert _refusal(guard, host=host) == "forbidden_host", host
    assert _refusal(guard, host="cachegate:8787, evil.example") == "forbidden_host"


@pytest.mark.parametrize(
    "entry",
    [
        "chat.example.com",
        "https://",
        "https://a.example/path",
        "null",
        "null://*",  # (an Origin of "null" read as a scheme's: every page could send it)
        "NULL://x",
        "*",
        "https://*",
        "HTTP://*",
        "https://*.example.com",
        "http://localhost:*",
        "http://localhost:port",
        # (a browser's Origin has no user name, nor a port past 65535: never matched, every
        # page of the origin meant got a 403)
        "https://user@x.example",
        "https://x.example:99999",
        "https://x.example:0",
        "https://x.example:８４４３",
        "https://x.example:08443",  # (a browser says 8443)
        # (no host, a query, a fragment, a space, a stray character: never an Origin either)
        "https://:8080",
        "https:///",
        "https://a.example?x=1",
        "https://a.example#f",
        "https://[::1",
        "https://exa mple.com",
        "https://a.example;b",
        "https://[::1]8080",
    ],
)
def test_an_allowed_origin_that_can_never_match_or_allows_every_page_is_a_config_error(
    entry: str,
) -> None:
    with pytest.raises(ConfigError, match=r"server\.allowed_origins"):
        settings_from_mapping({"server": {"allowed_origins": f"https://ok.example, {entry}"}})


@pytest.mark.parametrize("entry", ["name:8080", "http://name", "fd00::1", "a b", "-a"])
def test_an_allowed_host_that_can_never_match_is_a_config_error(entry: str) -> None:
    with pytest.raises(ConfigError, match=r"server\.allowed_hosts") as refused:
        settings_from_mapping({"server": {"allowed_hosts": f"proxy.lan, {entry}"}})
    if entry == "fd00::1":  # (the name alone was asked of it, which it is)
        assert str(refused.value).endswith("write an IPv6 address in brackets, [fd00::1]")
    fine = "proxy.lan, [fd00::1], box., proj_svc_1"  # compose v1 names have underscores
    settings_from_mapping({"server": {"allowed_hosts": fine}})
    origins = "https://a.example:8443, http://[::1]:5173, vscode-webview://*"
    settings_from_mapping({"server": {"allowed_origins": origins}})


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
    refused["route"] = "passthrough"  # the rebound /v1/models, and /metrics (counted as any)
    assert proxy.metric("cachegate_requests_total", refused) == 2


def test_an_origin_or_host_given_twice_is_refused_whichever_comes_first(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """Repeated fields are read combined (``a, b``): the guard parsed the first of them and let
    a foreign second one through."""
    import socket
    from urllib.parse import urlsplit

    proxy = proxy_factory(sim.api_base)
    address = urlsplit(proxy.url)
    body = json.dumps(HELLO).encode()

    def status(headers: list[tuple[str, str]]) -> bytes:
        """The status of a request sent as written (HTTP clients refuse a second Host)."""
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers)
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{lines}\r\n"
        )
        with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
            sock.sendall(head.encode() + body)
            return sock.recv(64).split(b" ")[1]

    loopback = ("host", "127.0.0.1")
    assert status([loopback]) == b"200"
    for name, good, bad in (
        ("origin", "http://localhost:3000", "https://evil.example"),
        ("host", "127.0.0.1", "evil.example"),
    ):
        for pair in ((good, bad), (bad, good)):
            extra = [] if name == "host" else [loopback]
            assert status([*extra, (name, pair[0]), (name, pair[1])]) == b"403", (name, pair)
    assert len(sim.sim.requests) == 1


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


def test_in_a_container_a_rebound_pages_read_is_refused_and_the_service_name_served(
    sim: RunningSimulator, proxy_factory: Any
) -> None:
    """docker-compose: cachegate listens on 0.0.0.0 (published on the host's 127.0.0.1); a
    rebound page's same-origin read is refused, with a browser's Fetch Metadata or without
    (none is sent to a plain-http name), Prometheus's scrape by the service's name is not."""
    proxy = proxy_factory(sim.api_base, {"server": {"host": "0.0.0.0"}})
    read = httpx.get(
        proxy.base_url + "/models",
        headers={
            "host": "rebind.evil.example:8787",
            "sec-fetch-site": "same-origin",
            "sec-fetch-mode": "cors",
        },
    )
    assert read.status_code == 403
    assert read.json()["error"]["code"] == "forbidden_origin"
    bare = httpx.get(  # (what Firefox or Safari sends for a rebound page's fetch("/v1/models"))
        proxy.base_url + "/models",
        headers={"host": "rebind.evil.example:8787", "referer": "http://rebind.evil.example:8787/"},
    )
    assert bare.status_code == 403 and bare.json()["error"]["code"] == "forbidden_host"
    assert sim.sim.requests == []
    scrape = httpx.get(proxy.url + "/metrics", headers={"host": "cachegate:8787"})
    assert scrape.status_code == 200
    # a Prometheus elsewhere scraping it by a name in DNS: no key is added there, not refused
    for path in ("/metrics", "/healthz"):
        far = httpx.get(proxy.url + path, headers={"host": "devbox.corp.example:8787"})
        assert far.status_code == 200, path
    assert (
        httpx.get(proxy.base_url + "/models", headers={"host": "devbox.corp.example"}).status_code
        == 403
    )
    models = httpx.get(proxy.base_url + "/models", headers={"host": "cachegate:8787"})
    assert models.status_code == 200


def test_bound_by_a_name_of_this_machine_the_host_is_still_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--host vm``, a name /etc/hosts maps to 127.0.0.1 (Debian maps the machine's own name
    to 127.0.1.1): cachegate listened on loopback alone, took itself to listen beyond the
    machine, and let a rebound name's Host in (its key added to the page's requests)."""
    import socket

    real = socket.getaddrinfo
    names = {"vm": ["127.0.1.1"], "lan-box": ["192.168.1.20"], "both": ["127.0.0.1", "10.0.0.2"]}

    def resolve(host: str, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        if host in names:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in names[host]]
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert binds_loopback("vm") and binds_loopback("127.0.0.1") and binds_loopback("localhost")
    assert not binds_loopback("lan-box") and not binds_loopback("both")
    assert not binds_loopback("0.0.0.0") and not binds_loopback("no-such-name.invalid")
    guard = BrowserGuard("vm")
    refused = guard.refusal({"host": "rebound.evil.example:8787"})
    assert refused is not None and refused.code == "forbidden_host"
    assert guard.refusal({"host": "vm:8787"}) is None  # reached by the name it was bound by
    assert guard.refusal({"host": "127.0.0.1:8787"}) is None
    # bound beyond the machine, a dotted name is still a page's to rebind: refused unless listed
    lan = BrowserGuard("lan-box")
    refused = lan.refusal({"host": "rebound.evil.example"})
    assert refused is not None and refused.code == "forbidden_host"
    assert (
        lan.refusal({"host": "lan-box:8787"}) is None and lan.refusal({"host": "lan-box"}) is None
    )
