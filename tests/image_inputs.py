"""Images for the tests of image lines (producer and worker): small real ones made with Pillow, and PNG
headers that claim a size without the pixels behind it (what a decompression bomb looks like at open)."""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import zlib
from typing import Any

from PIL import Image


def png(width: int = 4, height: int = 3, color: str = "red") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return buf.getvalue()


def jpeg(width: int = 8, height: int = 8, color: str = "blue") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "JPEG")
    return buf.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header says width x height, with one row of pixel data behind it: a few dozen bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))  # fmt: skip


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def chat(rid: str, *parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """batchq's chat line with one user message of these parts."""
    return {"id": rid, "messages": [{"role": "user", "content": list(parts)}], **fields}


def openai_chat(cid: str, *parts: dict[str, Any], **body: Any) -> dict[str, Any]:
    """An OpenAI Batch line to /v1/chat/completions with one user message of these parts."""
    messages = [{"role": "user", "content": list(parts)}]
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": messages, "max_tokens": 4, **body}}  # fmt: skip
