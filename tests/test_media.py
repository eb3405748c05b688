"""An image's tokens from its size: the headers of PNG, GIF, WebP and JPEG images read from their
base64, and the tile rule applied to them."""

from __future__ import annotations

import base64
import random
import struct
import zlib
from typing import Any

import pytest

from proxy.media import image_size, image_tokens, tile_tokens


def png(width: int, height: int, noisy_rows: int = 0) -> bytes:
    """A real PNG (what a browser agent's screenshot is), noise in its first rows so that its
    bytes are not all alike."""
    rng = random.Random(width * 7919 + height)
    rows = []
    for y in range(height):
        pixels = rng.randbytes(width * 3) if y < noisy_rows else bytes(width * 3)
        rows.append(b"\x00" + pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + chunk(b"IEND", b"")
    )


def gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00\x00\x00" + b";"


def jpeg(width: int, height: int, app1: int = 16, marker: int = 0xC0) -> bytes:
    """A JPEG's header: SOI, an APP0, an APP1 of ``app1`` bytes (EXIF, a thumbnail), a frame."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    exif = b"\xff\xe1" + struct.pack(">H", app1 + 2) + bytes(app1)
    frame = bytes([0xFF, marker]) + struct.pack(">HBHHB", 17, 8, height, width, 3) + bytes(9)
    return b"\xff\xd8" + app0 + exif + frame + b"\xff\xda" + bytes(64)


def webp_vp8x(width: int, height: int) -> bytes:
    body = b"VP8X" + struct.pack("<I", 10) + b"\x00\x00\x00\x00"
    body += (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return b"RIFF" + struct.pack("<I", len(body) + 4) + b"WEBP" + body


def webp_lossless(width: int, height: int) -> bytes:
    bits = (width - 1) | ((height - 1) << 14)
    body = b"VP8L" + struct.pack("<I", 5) + b"\x2f" + struct.pack("<I", bits) + bytes(8)
    return b"RIFF" + struct.pack("<I", len(body) + 4) + b"WEBP" + body


def webp_lossy(width: int, height: int) -> bytes:
    frame = b"\x00\x00\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", width, height)
    body = b"VP8 " + struct.pack("<I", len(frame)) + frame + bytes(8)
    return b"RIFF" + struct.pack("<I", len(body) + 4) + b"WEBP" + body


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def url_part(data: bytes, kind: str = "png", **image: Any) -> dict[str, Any]:
    return {
        "type": "image_url",
        "image_url": {"url": f"data:image/{kind};base64,{b64(data)}", **image},
    }


@pytest.mark.parametrize(
    "data",
    [
        png(1280, 800, noisy_rows=2),
        gif(1280, 800),
        jpeg(1280, 800),
        jpeg(1280, 800, marker=0xC2),  # progressive
        jpeg(1280, 800, app1=20_000),  # a frame past the first bytes decoded
        webp_vp8x(1280, 800),
        webp_lossless(1280, 800),
        webp_lossy(1280, 800),
    ],
    ids=["png", "gif", "jpeg", "jpeg-progressive", "jpeg-exif", "webp-x", "webp-l", "webp"],
)
def test_the_size_is_read_from_each_formats_first_bytes(data: bytes) -> None:
    assert image_size(b64(data)) == (1280, 800)
    assert image_tokens(url_part(data)) == 1105


@pytest.mark.parametrize(
    ("width", "height", "tokens"),
    [
        (1280, 800, 1105),  # scaled to 1229 x 768: 3 x 2 tiles
        (320, 200, 255),  # one tile, not scaled up
        (512, 512, 255),
        (513, 512, 425),
        (1024, 1024, 765),  # OpenAI's own examples: 768 x 768, 4 tiles
        (2048, 4096, 1105),  # 1024 x 2048, then 768 x 1536: 6 tiles
        (4000, 3000, 765),
        (1, 1, 255),
    ],
)
def test_the_tile_rule(width: int, height: int, tokens: int) -> None:
    assert tile_tokens(width, height) == tokens


def test_each_shape_of_an_image_part_and_what_has_no_size() -> None:
    data = png(320, 200)
    assert image_tokens(url_part(data)) == 255
    assert image_tokens(url_part(data, detail="low")) == 85
    assert image_tokens(url_part(data, detail="auto")) == 255
    # the Responses API's part, and Anthropic's
    responses = {"type": "input_image", "image_url": f"data:image/png;base64,{b64(data)}"}
    assert image_tokens(responses) == 255
    claude = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64(data)},
    }
    assert image_tokens(claude) == 255
    # no size to read: by URL, another format, cut or false headers, not an image
    for part in (
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}},
        url_part(b"BM" + bytes(64), "bmp"),
        url_part(data[:20]),
        url_part(jpeg(1280, 800)[:30]),
        url_part(b"\x89PNG\r\n\x1a\n" + bytes(8) + b"IHDR" + bytes(8)),  # 0 x 0
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@not base64"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,ñññññ"}},
        {"type": "input_audio", "input_audio": {"data": b64(data), "format": "wav"}},
        {"type": "text", "text": "data:image/png;base64," + b64(data)},
        {"type": "image_url", "image_url": None},
        "an image",
    ):
        assert image_tokens(part) is None, part


def test_base64_wrapped_in_lines_or_url_safe_is_read() -> None:
    """MIME's 76-column lines (CRLF), a leading space, the URL-safe alphabet: the estimate fell
    back to 1,600 tokens for a screenshot it could size."""
    data = png(1280, 800, noisy_rows=2)
    plain = b64(data)
    wrapped = "\r\n".join(plain[i : i + 76] for i in range(0, len(plain), 76))
    urlsafe = base64.urlsafe_b64encode(data).decode()
    for text in (wrapped, " " + plain, urlsafe):
        assert image_size(text) == (1280, 800)


def test_a_jpeg_walk_gives_up_past_64_markers() -> None:
    """Fill bytes or restart markers by the thousand before a frame (no camera writes them):
    each image's walk took ~10 ms of the event loop, a request of a hundred such stalled every
    other for a second. Real files reach their frame within twenty markers."""
    restarts = b"\xff\xd8" + b"\xff\xd0" * 64 + jpeg(1280, 800)[2:]
    fill = b"\xff\xd8" + b"\xff" * 70 + jpeg(1280, 800)[2:]
    assert image_size(b64(restarts)) is None and image_size(b64(fill)) is None
    near = b"\xff\xd8" + b"\xff\xd0" * 40 + jpeg(1280, 800)[2:]
    assert image_size(b64(near)) == (1280, 800)
