"""cachegate's own errors, in the OpenAI error shape, converted at one boundary.

Upstream errors are never converted: they are relayed verbatim. Only what cachegate itself decides
(bad input, strict rejections) and what it observes of the transport (unreachable, timeout) is.
"""

from __future__ import annotations

import orjson


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


def bad_request(
    message: str, code: str = "invalid_request", param: str | None = None
) -> ProxyError:
    return ProxyError(400, message, code=code, param=param)


def too_large(limit: int) -> ProxyError:
    return ProxyError(
        413,
        f"Request body is larger than cachegate's limit of {limit} bytes (server.max_body_bytes).",
        code="request_too_large",
    )


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
