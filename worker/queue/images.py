"""A worker's side of images (the wire's: producer/wire/images.py): the bytes of the images its claimed
requests show, had before their engine requests are built (adapter.engine_request).

Images submit stored are read from Redis, STORED_PER_CALL a call, so that no one reply holds a batch's worth
of images and the event loop runs between calls; each distinct image once per claim, however many requests
show it. http(s) URLs are fetched only where the worker is told to (setting image_urls), each in a thread,
with a timeout and a byte limit. An image that cannot be had ends its request alone, with an ImageError.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Iterable

from redis.asyncio import Redis

from producer.wire import keys
from producer.wire.images import is_web_url, ref_digest
from producer.wire.lua import done
from producer.wire.request_params import ImagePart, Request
from worker.config import WorkerConfig

STORED_PER_CALL = 8  # images per MGET: up to 8 x 20 MiB in one reply
IMAGE_NOT_FOUND = "image_not_found"
IMAGE_FETCH_FAILED = "image_fetch_failed"
IMAGE_URL_REFUSED = "image_url_refused"
IMAGES_UNSUPPORTED = "images_unsupported"


class ImageError(ValueError):
    """An image a request shows that cannot be had: the request ends alone with this error type."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


Images = dict[str, bytes | ImageError]  # an image part's url -> its bytes, or why there are none


def image_urls(req: Request) -> list[str]:
    """The urls of the request's image parts, in order."""
    return [
        part.image_url.url
        for m in req.messages or ()
        if not isinstance(m.content, str)
        for part in m.content
        if isinstance(part, ImagePart)
    ]


class ImageSource:
    """Where a worker's images come from: its Redis, and the web where it is told to fetch them."""

    def __init__(self, redis: Redis, cfg: WorkerConfig) -> None:
        self.redis = redis
        self.cfg = cfg

    async def stored(self, urls: Iterable[str]) -> Images:
        """The bytes of the stored images these references name (an ImageError for one that is gone)."""
        refs = sorted({u for u in urls if ref_digest(u) is not None})
        out: Images = {}
        for start in range(0, len(refs), STORED_PER_CALL):
            chunk = refs[start : start + STORED_PER_CALL]
            raws = await done(self.redis.mget([keys.image(ref_digest(u) or "") for u in chunk]))
            for url, raw in zip(chunk, raws, strict=True):
                out[url] = raw if raw is not None else _not_found(url)
        return out

    async def fetched(self, urls: Iterable[str]) -> Images:
        """The bytes of these http(s) URLs, fetched side by side; each one that fails is an ImageError."""
        web = sorted({u for u in urls if is_web_url(u)})
        if not self.cfg.image_urls:
            refused = ImageError(
                IMAGE_URL_REFUSED,
                "this worker does not fetch http(s) image URLs (worker setting image_urls = false); give "
                "the image as a data: URL or a file:// path",
            )
            return dict.fromkeys(web, refused)
        got = await asyncio.gather(*(asyncio.to_thread(self._download, u) for u in web))
        return dict(zip(web, got, strict=True))

    def _download(self, url: str) -> bytes | ImageError:
        limit, timeout = self.cfg.image_fetch_max_bytes, self.cfg.image_fetch_timeout_s
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:  # an http(s) URL: is_web_url
                data: bytes = r.read(limit + 1)
        except urllib.error.HTTPError as e:
            return ImageError(IMAGE_FETCH_FAILED, f"fetching {url[:200]}: HTTP {e.code} {e.reason}")
        except (OSError, ValueError) as e:  # URLError, timeouts, refused connections, malformed URLs
            reason = getattr(e, "reason", None) or e
            return ImageError(IMAGE_FETCH_FAILED, f"fetching {url[:200]}: {reason}")
        if len(data) > limit:
            return ImageError(
                IMAGE_FETCH_FAILED, f"{url[:200]} is more than {limit:,} bytes (image_fetch_max_bytes)"
            )
        return data


def _not_found(url: str) -> ImageError:
    return ImageError(
        IMAGE_NOT_FOUND,
        f"image {url.removeprefix('batchq-image://')} is not in Redis: it expired (images are kept for their "
        "batch's result TTL from its submit) or was never stored; submit the batch again",
    )
