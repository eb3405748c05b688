"""cachegate's own errors, in the OpenAI error shape, converted at one boundary.

Upstream errors are never converted: they are relayed verbatim. Only what cachegate itself decides
(bad input, strict rejections) and what it observes of the transport (unreachable, timeout) is.
"""

from __future__ import annotations

import email.utils
from collections.abc import Mapping
from typing import Any, Final

import orjson


def http_date() -> bytes:
    """Now, as HTTP's ``Date`` field gives it (RFC 9110 6.6.1: an origin server with a clock
    sends one). uvicorn's own is off, so that a relayed answer carries the upstream's alone;
    the answers cachegate makes itself (its errors, ``/healthz``, ``/metrics``) carry this."""
    return email.utils.formatdate(usegmt=True).encode()


class ProxyError(Exception):
    """An error cachegate answers itself, with an HTTP status and an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        # A refusal of a request whose body the client is still sending (a 413 before its end):
        # the rest is read and dropped before the connection closes (``relay.send_error``)
        self.unread = False

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )


# nginx's "client closed request": the status an exchange is recorded with when its client left
# before any answer was sent (none was; 0 is no HTTP status, and the client's leaving is no error
# of the server's)
CLIENT_CLOSED = 499


def client_closed(message: str) -> ProxyError:
    """The client hung up while sending its request."""
    return ProxyError(CLIENT_CLOSED, message, code="client_closed")


# Where the HTTP server says it refused a request's body (malformed chunked framing, say) after
# the app began answering it: a list in the request's scope, the 400's message put in it
# (``proxy.serving``).
REFUSED_BODY = "cachegate.refused_body"


def body_cut(scope: Mapping[str, Any] | None, message: str) -> ProxyError:
    """The request's body ended before it was whole: the client hung up (``client_closed``), or
    the HTTP server refused the rest of it and answered 400 ``invalid_http`` itself, which the
    exchange is then recorded with (it was counted a 499 and a client disconnect)."""
    refused = scope.get(REFUSED_BODY) if scope is not None else None
    if refused and isinstance(refused[0], str):
        return ProxyError(400, refused[0], code="invalid_http")
    return client_closed(message)


def bad_request(
    message: str, code: str = "invalid_request", param: str | None = None
) -> ProxyError:
    return ProxyError(400, message, code=code, param=param)


def too_large(limit: int, unread: bool = False) -> ProxyError:
    """A 413; ``unread``: the client is still sending the body (see ``ProxyError.unread``)."""
    err = ProxyError(
        413,
        f"Request body is larger than cachegate's limit of {limit} bytes (server.max_body_bytes).",
        code="request_too_large",
    )
    err.unread = unread
    return err


def upstream_unreachable(detail: str) -> ProxyError:
    return ProxyError(
        502,
        f"cachegate could not reach the upstream provider: {detail}",
        type="upstream_error",
        code="upstream_unreachable",
    )


def upstream_invalid(detail: str) -> ProxyError:
    return ProxyError(
        502,
        f"The upstream provider's answer could not be read as HTTP: {detail}",
        type="upstream_error",
        code="upstream_invalid_answer",
    )


def upstream_timeout(detail: str) -> ProxyError:
    return ProxyError(
        504,
        f"The upstream provider did not answer in time: {detail}",
        type="upstream_error",
        code="upstream_timeout",
    )


def upstream_busy(detail: str) -> ProxyError:
    """No upstream connection became free in time: cachegate's own limit, not the provider."""
    return ProxyError(
        503,
        f"cachegate had no free upstream connection: {detail}; raise upstream.max_connections"
        " or send fewer requests at once",
        type="server_error",
        code="upstream_connections_busy",
    )


# What the log says of a stream whose answer cachegate's stop cut after it began (``relay``);
# ``report`` reads it, and ``shutting_down``'s message, as the stop's, not an error
STOPPED_CUT: Final = "cut: cachegate stopped before the response was complete"
SHUTTING_DOWN: Final = (
    "cachegate is shutting down and stopped this request before the upstream answered; "
    "send it again once cachegate is back."
)


def shutting_down() -> ProxyError:
    """A request cachegate's shutdown cut before any of its answer was sent."""
    return ProxyError(
        503,
        SHUTTING_DOWN,
        type="server_error",
        code="server_shutting_down",
    )


def websocket_unsupported() -> ProxyError:
    """A WebSocket handshake (the Realtime API, Responses over WebSocket): not relayed. A 426,
    on which Codex CLI goes on over HTTP at once (on a 501 it tried five times more first, a
    "Reconnecting… 1/5" each time: it takes only a 426 for "use HTTP")."""
    return ProxyError(
        426,
        "cachegate does not relay WebSocket connections: a client with an HTTP transport "
        "(Responses over HTTP, as Codex CLI falls back to) goes on through cachegate; the "
        "Realtime API needs the provider directly.",
        code="websocket_not_supported",
    )
