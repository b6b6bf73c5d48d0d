"""Images in chat requests, on the wire: how a queued request refers to an image that submit stored.

A user gives an image as OpenAI's image_url content part: a data: URL, a file:// path (relative to the
JSONL file's folder), or an http(s) URL where the queue's workers fetch them (worker setting image_urls).
Submit validates each image (producer/client/images.py), stores its bytes once in Redis under
keys.image(sha256 of the bytes) and rewrites the part into a reference:

    {"type": "image_url", "image_url": {"url": "batchq-image://sha256:<64 lower-case hex digits>"}}

("detail", "auto" where given, is dropped: the model sees each image at its processor's resolution). An http(s) URL goes to the queue as written. A
worker reads the referenced bytes back before its engine sees the request (worker/queue/images.py). The
reference names the image by its content, so one photo asked four questions is stored once, and the result
cache keys an image request by its images: the reference is part of the keyed messages. A request with an
http(s) image is never cached: what a URL serves can change.

Pure Python: importing this module must never import torch or Pillow.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

IMAGE_REF_PREFIX = "batchq-image://sha256:"
WEB_PREFIXES = ("http://", "https://")
_DIGEST = re.compile(r"[0-9a-f]{64}")


def image_ref(digest: str) -> str:
    """The url of an image part that refers to the stored image of this sha256 (hex)."""
    return IMAGE_REF_PREFIX + digest


def ref_digest(url: str) -> str | None:
    """The sha256 (hex) an image reference names; None for any other url."""
    if not url.startswith(IMAGE_REF_PREFIX):
        return None
    digest = url[len(IMAGE_REF_PREFIX) :]
    return digest if _DIGEST.fullmatch(digest) else None


def is_web_url(url: str) -> bool:
    return url[:8].lower().startswith(WEB_PREFIXES)


def image_parts(messages: Sequence[Mapping[str, Any]]) -> Iterator[tuple[int, int, str]]:
    """(message index, part index, url) of every image part of `messages` (dicts: a queued request's JSON,
    or ChatMessage.model_dump), in the order the parts appear across the messages."""
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    yield i, j, part["image_url"]["url"]


def has_web_images(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(is_web_url(url) for _, _, url in image_parts(messages))
