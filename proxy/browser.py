"""Requests a web page in the user's browser makes to cachegate, refused.

cachegate adds the user's API key to requests that carry none, so any page open in a browser on
the same machine could spend it: a page can send a "simple" cross-origin POST (``text/plain``)
without the browser asking first, and a page whose name an attacker re-points at 127.0.0.1 (DNS
rebinding) can read the answers too. Three checks, on the request's headers alone:

- ``Origin``, which browsers add to cross-origin requests and to every POST: a page that is not
  on this machine (a loopback name or address), and not listed in ``server.allowed_origins``, is
  refused. Agents and SDKs send no ``Origin``.
- ``Sec-Fetch-Site``, which browsers add to every request: ``same-origin`` without an ``Origin``
  (a page's same-origin read) by a ``Host`` that is not this machine's comes from a page at a
  rebound name, since cachegate serves no pages. Refused whatever the address cachegate listens
  on (a container's ``0.0.0.0`` published on the host's loopback included).
- ``Host``, when cachegate listens on a loopback address only: a rebound page names its own
  host. Accepted: loopback names (``localhost``, ``*.localhost``, ``127.x.x.x``, ``::1``), the
  names containers use for the host (``host.docker.internal``, ``gateway.docker.internal``,
  ``host.containers.internal``) and those listed in ``server.allowed_hosts``; any other is
  refused, whatever the browser. Listening beyond the machine (``0.0.0.0`` in a container),
  clients use names of their own, but a name in public DNS (a dotted one) can still be a
  rebound page's: browsers send no ``Sec-Fetch-Site`` to a plain-``http`` name, so a rebound
  page's same-origin GET carried nothing else to tell it by, and read the answer. Such a name
  is refused there too unless listed; an address, a name without a dot (a compose service's),
  this machine's name and private-use names (``.local``, ``.internal``, ``.lan``,
  ``.home.arpa``, ``.localdomain``, ``.svc``), which no page on the web can be at, are accepted.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from proxy.errors import ProxyError

# Names containers use for the host they run on: a page cannot make a browser use them as its
# own name (they are not in public DNS), so they are no rebinding risk.
CONTAINER_HOST_NAMES = frozenset(
    {"host.docker.internal", "gateway.docker.internal", "host.containers.internal"}
)
# Names no page on the web can be at (not in public DNS: mDNS, ICANN's private-use TLD, RFC 8375)
PRIVATE_SUFFIXES = (
    ".local",  # (Kubernetes' .svc.cluster.local too)
    ".internal",
    ".lan",
    ".home.arpa",
    ".localdomain",
    ".localhost",
    ".svc",  # Kubernetes' <service>.<namespace>.svc
)
_DEFAULT_PORTS = {"http": ":80", "https": ":443"}
_MEMO_LIMIT = 64  # verdicts remembered: a client sends the same Host (and Origin) every time


def _shown(entry: str) -> str:
    """A setting's entry as an error says it: without the ``user:password@`` a URL pasted in
    its place may carry (``display_url``: no scheme, an ``@`` or ``/`` in the password too)."""
    from proxy.config import display_url  # (config reads this module's checks)

    shown = entry.strip()
    if "@" not in shown:
        return shown
    hidden = display_url(shown)
    return f"{hidden or '…'} (its user info hidden)" if hidden != shown else shown


def is_loopback_name(host: str) -> bool:
    """``localhost`` (and Debian's ``localhost6``, ``ip6-localhost``), a name under
    ``.localhost`` (RFC 6761), or a loopback IPv4/IPv6 address (also IPv4-mapped); ``host``
    without a port, IPv6 with or without brackets."""
    host = host.strip().lower().rstrip(".")
    if host in ("localhost", "localhost6", "ip6-localhost") or host.endswith(".localhost"):
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    address = parse_address(host)
    if address is None:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def parse_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` (no brackets) as an IP address, also in the short forms the socket layer binds
    and connects to as written (``127.1`` and ``0x7f000001`` are 127.0.0.1, ``0`` is 0.0.0.0:
    cachegate bound to one warned it listened beyond the machine and let any Host header in);
    None for a name."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        if not text or text.strip(".0123456789abcdefx"):
            return None
        try:
            return ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None


def binds_loopback(host: str) -> bool:
    """Whether cachegate bound to ``host`` listens on this machine alone: a loopback name or
    address (``is_loopback_name``), or a name that resolves to loopback addresses only (the
    machine's own name, which Debian's ``/etc/hosts`` maps to 127.0.1.1). Bound by such a name,
    cachegate took itself to listen beyond the machine and let any ``Host`` in."""
    if is_loopback_name(host):
        return True
    name = host.strip()
    if not name or name in ("0.0.0.0", "::", "[::]", "*"):
        return False
    try:
        found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    addresses = {str(info[4][0]).partition("%")[0] for info in found}
    return bool(addresses) and all(is_loopback_name(a) for a in addresses)


def host_of_header(value: str) -> str:
    """The host part of a ``Host`` header (``name``, ``name:port``, ``[v6]:port``)."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        return value[: end + 1] if end >= 0 else value
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def normalize_origin(origin: str) -> str:
    """``scheme://host[:port]`` lower-cased, without a trailing slash or the scheme's default
    port: how browsers write it."""
    scheme, sep, rest = origin.strip().lower().partition("://")
    origin = scheme + sep + rest.rstrip("/")  # (Electron's "file://" keeps its "://")
    default = _DEFAULT_PORTS.get(scheme)
    if default and origin.endswith(default):
        origin = origin[: -len(default)]
    return origin


def check_origin_entry(entry: str) -> str | None:
    """Why an ``allowed_origins`` entry is refused, or None: ``scheme://host[:port]``, or
    ``scheme://*`` for every origin of a scheme other than http and https
    (``vscode-webview://*``; ``https://*`` would allow every web page)."""
    scheme, sep, rest = entry.strip().lower().partition("://")
    if not sep or not scheme or not rest or "/" in rest.rstrip("/"):
        return f"{_shown(entry)!r} is not an origin: write scheme://host[:port] or scheme://*"
    host = rest.rstrip("/")
    if scheme == "null":  # (what an Origin of "null" would be read as: any page can send it)
        return (
            f"{_shown(entry)!r}: the origin null (local files, sandboxed frames) cannot be "
            "allowed: any web page can send it"
        )
    if host == "*":
        if scheme in ("http", "https"):
            return f"{_shown(entry)!r} would allow every web page: list the pages' origins"
        return None
    if "*" in host:  # "https://*.example.com", "http://localhost:*": no wildcard but the whole
        return f"{_shown(entry)!r}: a wildcard stands only for a whole origin (scheme://*)"
    if "@" in host:  # (a browser's Origin never has a user name: it could never match)
        return f"{_shown(entry)!r} is not an origin: an origin has no user name (user@)"
    if host.startswith("["):
        inside, closed, port = host.partition("]")
        name = inside + closed
    else:
        name, colon, digits = host.partition(":")
        port = colon + digits
    if _HOST_NAME.fullmatch(name) is None or port[:1] not in ("", ":"):
        # (a query, a fragment, no host, a space, an unclosed bracket: never a browser's Origin)
        return f"{_shown(entry)!r} is not an origin: write scheme://host[:port] or scheme://*"
    if port:
        digits = port[1:]
        if not (
            digits.isascii()
            and digits.isdigit()
            and not digits.startswith("0")  # (a browser says 8443, never 08443)
            and int(digits) <= 65535
        ):
            return f"{_shown(entry)!r}: the port must be a number from 1 to 65535"
    return None


_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?\.?|\[[0-9a-f:.]+\]", re.IGNORECASE)


def check_host_entry(entry: str) -> str | None:
    """Why an ``allowed_hosts`` entry can never match, or None: a bare name or address, no
    scheme or port (``proxy.lan``, ``[fd00::1]``)."""
    if _HOST_NAME.fullmatch(entry.strip()) is None:
        if _HOST_NAME.fullmatch(f"[{entry.strip()}]") is not None:  # (as Host headers write it)
            return f"{_shown(entry)!r}: write an IPv6 address in brackets, [{_shown(entry)}]"
        return f"{_shown(entry)!r} is not a host name: write the name alone, without scheme or port"
    return None


class BrowserGuard:
    """Decides, from a request's headers, whether it comes from a web page it must refuse."""

    __slots__ = ("_hosts", "_origins", "allowed", "allowed_hosts", "check_host", "schemes")

    def __init__(
        self,
        bind_host: str,
        allowed_origins: Iterable[str] = (),
        allowed_hosts: Iterable[str] = (),
    ) -> None:
        entries = {normalize_origin(o) for o in allowed_origins if o.strip()}
        self.schemes = frozenset(e[: -len("://*")] for e in entries if e.endswith("://*"))
        self.allowed = frozenset(e for e in entries if not e.endswith("://*"))
        self.allowed_hosts = CONTAINER_HOST_NAMES | {
            h.strip().lower().rstrip(".") for h in allowed_hosts if h.strip()
        }
        self.check_host = binds_loopback(bind_host)
        if self.check_host and not is_loopback_name(bind_host):  # its own name, by which it
            self.allowed_hosts |= {bind_host.strip().lower().rstrip(".")}  # is reached
        elif not self.check_host:  # (beyond the machine: by its own name and the one bound)
            own = {socket.gethostname(), bind_host}
            self.allowed_hosts |= {n.strip().lower().rstrip(".") for n in own if n.strip()}
        # Verdicts of headers seen (allowed ones only, bounded): the check then costs a lookup.
        self._hosts: set[str] = set()
        self._origins: set[str] = set()

    def refusal(self, headers: Mapping[str, str], keyless: bool = False) -> ProxyError | None:
        """None for a request to serve; else the error to answer (403). ``headers``: names in
        lower case, as ``proxy.chat.header_map`` gives them. ``keyless``: a request of
        cachegate's own (``/metrics``, ``/healthz``), to which no key is added: listening beyond
        the machine, a Prometheus scraping it by a name of its own is not refused."""
        origin = headers.get("origin")
        if origin is not None:
            if origin not in self._origins:
                if not self._origin_allowed(origin):
                    return ProxyError(
                        403,
                        f"Requests from web pages are refused: origin {origin!r} is not on this "
                        "machine and not in server.allowed_origins (cachegate would add your API "
                        "key to them).",
                        code="forbidden_origin",
                    )
                if len(self._origins) < _MEMO_LIMIT:
                    self._origins.add(origin)
        elif headers.get("sec-fetch-site") == "same-origin" and not self._host_ok(
            headers.get("host")
        ):
            # A browser's request from a page at the very address it asks, by a name that is
            # not this machine's: cachegate serves no pages, so the page is a rebound name
            # (its same-origin reads carry no Origin). A dev server's proxy forwarding its
            # page's same-origin request keeps a loopback Host and passes; requests from other
            # sites without an Origin (Electron's net.fetch, a no-cors GET) cannot read a
            # rebound answer and pass too.
            return ProxyError(
                403,
                "Requests from web pages are refused: a page's request to its own address by "
                "a name that is not this machine's (a page's name re-pointed at this machine).",
                code="forbidden_origin",
            )
        host = headers.get("host")
        if host is not None and host not in self._hosts:
            if self.check_host and not self._host_ok(host):
                return ProxyError(
                    403,
                    f"Host {host!r} is not a loopback name: cachegate listens on this machine only "
                    "and refuses other names (a page's name re-pointed at 127.0.0.1). Use "
                    "http://127.0.0.1:PORT or http://localhost:PORT, or list the name in "
                    "server.allowed_hosts.",
                    code="forbidden_host",
                )
            if not self.check_host and not keyless and not self._unrebindable(host):
                return ProxyError(
                    403,
                    f"Host {host!r} is a dotted name, which may be in public DNS, where a web "
                    "page can re-point its own name at this machine (DNS rebinding) and read "
                    "answers made with your key: list it in server.allowed_hosts if clients "
                    "reach cachegate by it (an address, a name without a dot, this machine's "
                    "name and names under .local, .internal, .lan, .home.arpa, .localdomain "
                    "and .svc are accepted).",
                    code="forbidden_host",
                )
            if len(self._hosts) < _MEMO_LIMIT and (self.check_host or not keyless):
                self._hosts.add(host)
        return None

    def _unrebindable(self, host: str) -> bool:
        """Listening beyond the machine: a ``Host`` no web page can be at (``_host_ok``'s, an
        address, a name without a dot, a private-use name), or a listed one."""
        if self._host_ok(host):
            return True
        if "," in host:
            return False
        name = host_of_header(host).lower().rstrip(".")
        if name.startswith("[") or parse_address(name) is not None:
            return True
        return "." not in name or name.endswith(PRIVATE_SUFFIXES)

    def _host_ok(self, host: str | None) -> bool:
        """A loopback name, a container's name for the host, or a listed one (no Host: none to
        judge)."""
        if host is None:
            return True
        if "," in host:  # given twice (combined): one request has one Host
            return False
        name = host_of_header(host)
        return is_loopback_name(name) or name.lower().rstrip(".") in self.allowed_hosts

    def _origin_allowed(self, origin: str) -> bool:
        if "," in origin:  # given twice (combined), or a list: no browser sends either
            return False
        normal = normalize_origin(origin)
        scheme, sep, _ = normal.partition("://")
        if not sep:  # "null" (a sandboxed frame or a local file; any page can send it): no page
            return False  # to trust, whatever is allowed ("null://*" read it as a scheme's)
        if normal in self.allowed or scheme in self.schemes:
            return True
        try:
            parts = urlsplit(normal)
            hostname = parts.hostname
        except ValueError:  # "http://[::1" and the like: no page has such an origin
            return False
        if parts.scheme not in ("http", "https") or not hostname:
            return False
        return is_loopback_name(hostname)
