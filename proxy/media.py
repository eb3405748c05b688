"""What an image in a message costs in tokens, from its size (pure).

A provider bills an image by its pixels, not by its base64: OpenAI's GPT-4o family scales a
high-detail image to fit 2048 x 2048, then its shortest side down to 768, and bills 85 tokens
plus 170 for each 512-pixel tile it covers (a 1280 x 800 screenshot: 6 tiles, 1,105 tokens; a
320 x 200 one: 255); ``"detail": "low"`` costs 85 whatever the size. Claude bills about
width x height / 750 (1,366 for 1280 x 800), Gemini 258 a 768-pixel tile (1,032): the tile rule
is the estimate here, for every provider, as cachegate does not know which one bills the
request. Other models price images otherwise (gpt-4o-mini at ~33 times the tokens, the GPT-4.1
minis by 32-pixel patches): the estimate is the GPT-4o family's.

The size is read from the image's first bytes: PNG, GIF, WebP and JPEG headers, of an image
sent inline as base64 (a ``data:`` URL, or Anthropic's ``source.data``). An image given by an
``https://`` URL has no size here: ``image_tokens`` says ``None``.
"""

from __future__ import annotations

import binascii
import math
import re
from collections.abc import Mapping
from typing import Any, Final

LOW_DETAIL_TOKENS: Final = 85
TILE_TOKENS: Final = 170
_FIT: Final = 2048  # the square a high-detail image is scaled to fit in first
_SHORT_SIDE: Final = 768  # then its shortest side, if longer
_TILE: Final = 512

_PNG: Final = b"\x89PNG\r\n\x1a\n"
# JPEG's start-of-frame markers (a frame's height and width follow): not C4, C8 or CC
_SOF: Final = frozenset(
    (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF)
)
_JPEG_READ: Final = (1 << 12, 1 << 16)  # bytes decoded, again with more, to find a frame
_MAX_SIDE: Final = 1 << 16
_URL_SAFE: Final = str.maketrans("-_", "+/")
_BASE64: Final = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_NO_LENGTH: Final = frozenset((0x01, *range(0xD0, 0xD8)))  # JPEG markers without a length
_SEGMENTS: Final = 64  # JPEG markers walked at most before a frame (real files: under 20)


def tile_tokens(width: int, height: int) -> int:
    """A high-detail image's tokens by the GPT-4o family's tile rule (module docstring)."""
    w, h = float(width), float(height)
    if max(w, h) > _FIT:
        scale = _FIT / max(w, h)
        w, h = w * scale, h * scale
    if min(w, h) > _SHORT_SIDE:
        scale = _SHORT_SIDE / min(w, h)
        w, h = w * scale, h * scale
    tiles = math.ceil(w / _TILE) * math.ceil(h / _TILE)
    return LOW_DETAIL_TOKENS + TILE_TOKENS * max(tiles, 1)


def image_tokens(part: Any) -> int | None:
    """The tokens of a message part that is an image: 85 for one sent with ``"detail": "low"``,
    else by its size (``tile_tokens``); ``None`` where the part is no image or its size cannot
    be read (an image by URL, bytes of another format)."""
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    data: Any = None
    start: int | None = None
    if kind == "image_url" or kind == "input_image":
        image = part.get("image_url")
        detail = image.get("detail") if isinstance(image, Mapping) else part.get("detail")
        if detail == "low":
            return LOW_DETAIL_TOKENS
        url = image.get("url") if isinstance(image, Mapping) else image
        data, start = url, _data_url_start(url)
    elif kind == "image":  # Anthropic's shape: {"source": {"type": "base64", "data": ...}}
        source = part.get("source")
        if isinstance(source, Mapping) and source.get("type") == "base64":
            data, start = source.get("data"), 0
    if not isinstance(data, str) or start is None:
        return None
    size = image_size(data, start)
    return None if size is None else tile_tokens(*size)


def _data_url_start(url: Any) -> int | None:
    """Where the base64 text of a ``data:…;base64,`` URL starts, or ``None``."""
    if not isinstance(url, str) or url[:5].lower() != "data:":
        return None
    comma = url.find(",", 0, 256)
    if comma < 0 or not url[:comma].lower().endswith(";base64"):
        return None
    return comma + 1


def _head(b64: str, start: int, count: int) -> bytes:
    """The first ``count`` bytes (or fewer) of the base64 text at ``start``, decoding only what
    they need (an image's megabytes are not copied)."""
    chars = -(-count // 3) * 4
    text = b64[start : start + chars]
    if not text.isascii():
        return b""
    if _BASE64.fullmatch(text) is None:
        # lines wrapped (MIME's 76 columns, CRLF), or the URL-safe alphabet: read again with
        # room for the white space, which is taken out
        text = "".join(b64[start : start + 2 * chars + 64].split())[:chars]
        text = text.translate(_URL_SAFE)
    text = text[: len(text) - len(text) % 4]
    try:
        return binascii.a2b_base64(text)
    except (binascii.Error, ValueError):
        return b""


def image_size(b64: str, start: int = 0) -> tuple[int, int] | None:
    """(width, height) of a PNG, GIF, WebP or JPEG image given as base64 (from ``start`` in
    ``b64``), read from its first bytes; ``None`` for another format, or a header that is cut
    or says nothing sensible."""
    head = _head(b64, start, 32)
    size: tuple[int, int] | None = None
    if head.startswith(_PNG) and head[12:16] == b"IHDR" and len(head) >= 24:
        size = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    elif head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        size = int.from_bytes(head[6:8], "little"), int.from_bytes(head[8:10], "little")
    elif head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        size = _webp_size(head)
    elif head[:2] == b"\xff\xd8":
        for count in _JPEG_READ:
            data = _head(b64, start, count)
            size, more = _jpeg_size(data)
            if size is not None or not more or len(data) < count:
                break
    if size is None or not (0 < size[0] <= _MAX_SIDE and 0 < size[1] <= _MAX_SIDE):
        return None
    return size


def _webp_size(head: bytes) -> tuple[int, int] | None:
    chunk = head[12:16]
    if chunk == b"VP8X" and len(head) >= 30:
        return 1 + int.from_bytes(head[24:27], "little"), 1 + int.from_bytes(head[27:30], "little")
    if chunk == b"VP8L" and len(head) >= 25 and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8 " and len(head) >= 30 and head[23:26] == b"\x9d\x01\x2a":
        width = int.from_bytes(head[26:28], "little") & 0x3FFF
        height = int.from_bytes(head[28:30], "little") & 0x3FFF
        return width, height
    return None


def _jpeg_size(data: bytes) -> tuple[tuple[int, int] | None, bool]:
    """A JPEG's size from its first start-of-frame segment, and whether more bytes could still
    hold it (the walk ran past what was given)."""
    at, end = 2, len(data)
    for _ in range(_SEGMENTS):  # (fill bytes or restart markers by the thousand: given up)
        if at + 4 > end:
            return None, True
        if data[at] != 0xFF:
            return None, False  # not at a marker: not a JPEG this walk understands
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in _NO_LENGTH:
            at += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image, start of scan: no frame before them
            return None, False
        if marker in _SOF:
            if at + 9 > end:
                return None, True
            height = int.from_bytes(data[at + 5 : at + 7], "big")
            width = int.from_bytes(data[at + 7 : at + 9], "big")
            return (width, height), False
        at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return None, False
