"""Requests a web page in the user's browser makes to cachegate, refused.

cachegate adds the user's API key to requests that carry none, so any page open in a browser on
the same machine could spend it: a page can send a "simple" cross-origin POST (``text/plain``)
without the browser asking first, and a page whose name an attacker re-points at 127.0.0.1 (DNS
rebinding) can read the answers too. Two checks, on the request's headers alone:

- ``Origin``, which browsers add to cross-origin requests and to every POST: a page that is not
  on this machine (a loopback name or address), and not listed in ``server.allowed_origins``, is
  refused. Agents and SDKs send no ``Origin``.
- ``Host``, when cachegate listens on a loopback address only: a name that is not a loopback one
  (``localhost``, ``*.localhost``, ``127.x.x.x``, ``::1``) is a rebound name and is refused. Bound
  to another address (a container's ``0.0.0.0``), clients use names of their own and the check is
  off.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from proxy.errors import ProxyError


def is_loopback_name(host: str) -> bool:
    """``localhost``, a name under ``.localhost`` (RFC 6761), or a loopback IPv4/IPv6 address;
    ``host`` without a port, IPv6 with or without brackets."""
    host = host.strip().lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of_header(value: str) -> str:
    """The host part of a ``Host`` header (``name``, ``name:port``, ``[v6]:port``)."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        return value[: end + 1] if end >= 0 else value
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def normalize_origin(origin: str) -> str:
    """``scheme://host[:port]`` lower-cased, without a trailing slash: how browsers write it."""
    return origin.strip().rstrip("/").lower()


class BrowserGuard:
    """Decides, from a request's headers, whether it comes from a web page it must refuse."""

    __slots__ = ("_hosts", "allowed", "check_host")

    def __init__(self, bind_host: str, allowed_origins: Iterable[str] = ()) -> None:
        self.allowed = frozenset(normalize_origin(o) for o in allowed_origins if o.strip())
        self.check_host = is_loopback_name(bind_host)
        # Host headers judged loopback: every request of a client carries the same one, and
        # this check runs before each. Bounded: a client cycling names cannot grow it.
        self._hosts: set[bytes] = set()

    def refusal(self, headers: Iterable[tuple[bytes, bytes]]) -> ProxyError | None:
        """None for a request to serve; else the error to answer (403)."""
        origin: bytes | None = None
        host: bytes | None = None
        for name, value in headers:
            if name == b"origin":
                origin = value
            elif name == b"host":
                host = value
        if origin is not None:
            text = origin.decode("latin-1")
            if not self._origin_allowed(text):
                return ProxyError(
                    403,
                    f"Requests from web pages are refused: origin {text!r} is not on this machine "
                    "and not in server.allowed_origins (cachegate would add your API key to them).",
                    code="forbidden_origin",
                )
        if self.check_host and host is not None and host not in self._hosts:
            text = host.decode("latin-1")
            if is_loopback_name(host_of_header(text)):
                if len(self._hosts) < 64:
                    self._hosts.add(host)
            else:
                return ProxyError(
                    403,
                    f"Host {text!r} is not a loopback name: cachegate listens on this machine only "
                    "and refuses other names (a page's name re-pointed at 127.0.0.1). Use "
                    "http://127.0.0.1:PORT or http://localhost:PORT.",
                    code="forbidden_host",
                )
        return None

    def _origin_allowed(self, origin: str) -> bool:
        normal = normalize_origin(origin)
        if normal in self.allowed:
            return True
        if normal == "null":  # a sandboxed frame or a local file: not a page to trust
            return False
        parts = urlsplit(normal)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False
        return is_loopback_name(parts.hostname)
