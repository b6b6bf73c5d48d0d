"""Images on input lines, at submit (the wire's side: producer/wire/images.py).

Pass 1 (validate.py) hands every chat request with an image part to ImageChecks.take: each image is read (a
base64 data: URL, or a file:// path inside the JSONL file's folder), checked (it decodes, within the
limits, and the queue's model takes images), kept once per content in an ImageSpool, and its part rewritten
into a reference to it. Pass 2 (submit.py) stores the spooled images in Redis with store_images before the
first job that refers to them exists. http(s) URLs pass as written, only to a queue whose workers fetch them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote

from redis.asyncio import Redis

from producer.client.jsonl import LineError
from producer.wire import keys
from producer.wire.images import IMAGE_REF_PREFIX, image_parts, image_ref, is_web_url, ref_digest
from producer.wire.lua import LuaScript
from producer.wire.workers import QueueServing

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # OpenAI's limit per image
# Also the decompression-bomb guard: a few KB of PNG can claim a gigapixel, so the header's size is
# checked before a pixel is decoded.
MAX_IMAGE_PIXELS = 50_000_000
MAX_IMAGES_PER_REQUEST = 8
STORE_BYTES = 16 * 1024 * 1024  # image bytes per pipeline of SETs in store_images
TOUCH_KEYS = 1000  # images per call of touch_images.lua
_TOUCH = LuaScript.load("touch_images.lua")
_DATA, _FILE = "data:", "file://"


@dataclass(frozen=True)
class ImageLimits:
    """What one image, and one request, may hold (producer submit's --max-image-mb, --max-image-pixels,
    --max-images-per-request)."""

    bytes: int = MAX_IMAGE_BYTES
    pixels: int = MAX_IMAGE_PIXELS
    per_request: int = MAX_IMAGES_PER_REQUEST


class ImageSpool:
    """The distinct images of a submit, by sha256, in a temporary file from pass 1 to pass 2. Without a file
    it only tells images apart (an upload's check keeps none)."""

    def __init__(self, file: IO[bytes] | None = None) -> None:
        self.file = file
        self.at: dict[str, tuple[int, int]] = {}  # digest -> (offset, length) in the file

    def __len__(self) -> int:
        return len(self.at)

    def add(self, digest: str, data: bytes) -> None:
        if digest in self.at:
            return
        offset = 0
        if self.file is not None:
            offset = self.file.seek(0, os.SEEK_END)
            self.file.write(data)
        self.at[digest] = (offset, len(data))

    def get(self, digest: str) -> bytes:
        assert self.file is not None, "an image spool without a file keeps no bytes"
        offset, length = self.at[digest]
        self.file.seek(offset)
        return self.file.read(length)


class _Refused(ValueError):
    """Why an image part cannot run: the reason its line's error gives."""


@dataclass
class ImageChecks:
    """What submit checks image parts against and where it keeps their images. `folder`: where file://
    paths resolve (the JSONL file's; None: a stream without one, where they are refused). `takes_images`,
    `fetch_urls`: what the queue's workers last published (QueueServing.images, image_urls)."""

    limits: ImageLimits = field(default_factory=ImageLimits)
    folder: Path | None = None
    takes_images: bool | None = None
    model: str | None = None  # the model serving the queue, named where it takes no images
    fetch_urls: bool = False
    spool: ImageSpool = field(default_factory=ImageSpool)
    # digest -> why that image is refused (None: it is fine); an image given again is not decoded again
    _verdicts: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def for_queue(
        cls, serving: QueueServing | None, limits: ImageLimits | None = None, folder: Path | None = None
    ) -> ImageChecks:
        """The checks of a queue's image lines, by what serves it (None: no worker ever said)."""
        checks = cls(limits=limits or ImageLimits(), folder=folder)
        if serving is not None:
            checks.takes_images, checks.model = serving.images, serving.model
            checks.fetch_urls = serving.image_urls
        return checks

    def take(self, rec: dict[str, Any], line_no: int, at: str) -> list[LineError]:
        """Check a chat request's images and rewrite its record's messages to refer to them (as
        ChatMessage.model_dump writes them on the worker, so both sides compute one result-cache key);
        every problem found, by field path (`at`: where the request's fields sit, "body." on an OpenAI
        line), and the record untouched when there is one."""
        uid = rec["id"]
        messages: list[dict[str, Any]] = rec["messages"]
        errors: list[LineError] = []
        found: list[tuple[str, bytes]] = []
        count = 0
        out = []
        for i, m in enumerate(messages):
            content = m["content"]
            canonical = {k: v for k, v in m.items() if v is not None}
            out.append(canonical)
            if not isinstance(content, list):
                continue
            if all(p["type"] == "text" for p in content):  # as the wire joins a text-only message
                canonical["content"] = "\n".join(p["text"] for p in content)
                continue
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(content):
                if part["type"] == "text":
                    parts.append({"type": "text", "text": part["text"]})
                    continue
                count += 1
                path = f"{at}messages.{i}.content.{j}.image_url.url"
                if self.takes_images is False:
                    reason = f"the model {self.model!r} serving this queue takes no images (text only)"
                    return [LineError(line_no, path, reason, uid)]
                try:
                    parts.append({"type": "image_url", "image_url": {"url": self._image(part, found)}})
                except _Refused as e:
                    errors.append(LineError(line_no, path, str(e), uid))
            canonical["content"] = parts
        if count > self.limits.per_request:
            reason = f"{count} images in one request, more than the limit of {self.limits.per_request}"
            errors.insert(0, LineError(line_no, f"{at}messages", reason, uid))
        if errors:
            return errors
        for digest, data in found:
            self.spool.add(digest, data)
        rec["messages"] = out
        return []

    def _image(self, part: dict[str, Any], found: list[tuple[str, bytes]]) -> str:
        """The url an image part goes to the queue with; its image's bytes appended to `found`."""
        url: str = part["image_url"]["url"]
        if is_web_url(url):
            if not self.fetch_urls:
                raise _Refused(
                    "http(s) image URLs are not fetched by this queue's workers (worker setting "
                    "image_urls = false, or no worker has said); give the image as a data: URL or a file:// "
                    "path"
                )
            return url
        if url.startswith(_DATA):
            data = _data_url(url)
        elif url.startswith(_FILE):
            data = self._file(url)
        elif url.startswith(IMAGE_REF_PREFIX):
            raise _Refused("batchq-image:// references are written by submit, not read from input")
        else:
            scheme = url.partition(":")[0] if ":" in url else url[:20]
            raise _Refused(
                f"unsupported image URL {scheme!r}: give a data: URL (data:image/png;base64,...), a file:// "
                "path or an http(s) URL"
            )
        digest = hashlib.sha256(data).hexdigest()
        if digest not in self._verdicts:
            self._verdicts[digest] = image_problem(data, self.limits)
        problem = self._verdicts[digest]
        if problem is not None:
            raise _Refused(problem)
        found.append((digest, data))
        return image_ref(digest)

    def _file(self, url: str) -> bytes:
        """The bytes of a file:// image: a path relative to the JSONL file's folder (or absolute), which
        must lie inside that folder once symlinks and `..` are resolved."""
        if self.folder is None:
            raise _Refused(
                "file:// images need the JSONL file's folder, and this input has none (an upload, or a "
                "stream): give the image as a data: URL"
            )
        folder = self.folder.resolve()
        written = unquote(url[len(_FILE) :])
        try:
            target = (folder / written).resolve()
        except (OSError, ValueError) as e:  # a NUL byte, a symlink loop
            raise _Refused(f"{written!r} is not a path that resolves ({e})") from None
        if not target.is_relative_to(folder):
            raise _Refused(f"{written!r} resolves to {target}, outside the JSONL file's folder {folder}")
        try:
            with target.open("rb") as f:
                return f.read(self.limits.bytes + 1)  # one byte over says "too big" without reading it all
        except FileNotFoundError:
            raise _Refused(f"no such file: {target}") from None
        except OSError as e:
            raise _Refused(f"cannot read {target}: {e.strerror or e}") from None


def _data_url(url: str) -> bytes:
    """The bytes of a base64 data: URL of an image type (data:image/png;base64,...)."""
    head, comma, payload = url.partition(",")
    media = head[len(_DATA) :].split(";")
    if not comma or media[-1].lower() != "base64":
        raise _Refused("a data: URL must be base64 (data:image/png;base64,...)")
    if not media[0].lower().startswith("image/"):
        raise _Refused(
            f"a data: URL of type {media[0] or 'text/plain'!r}, not an image type (image/png, ...)"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _Refused(f"invalid base64 in the data: URL ({e})") from None


def image_problem(data: bytes, limits: ImageLimits) -> str | None:
    """Why these bytes are not an image the model can be shown (None: they are): over the byte limit, not
    decodable by Pillow, or more pixels than the limit (checked from the header, before decoding)."""
    from PIL import Image, UnidentifiedImageError  # here: a submit without images never loads Pillow

    if len(data) > limits.bytes + 1:
        return f"the image is {len(data):,} bytes, over the limit of {limits.bytes:,} bytes"
    if len(data) > limits.bytes:  # (a file is read to one byte past the limit: its size is not known)
        return f"the image is over the limit of {limits.bytes:,} bytes"
    try:
        # Pillow warns of a size past its own bomb limit: the pixel limit below refuses it with a reason.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                width, height = im.size
                if width * height > limits.pixels:
                    return (
                        f"the image is {width}x{height} = {width * height:,} pixels, over the limit of "
                        f"{limits.pixels:,} pixels"
                    )
                im.load()
    except Image.DecompressionBombError:
        return f"the image has more pixels than the limit of {limits.pixels:,} (a decompression bomb?)"
    except UnidentifiedImageError:
        return "not a decodable image (cannot identify image file)"
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError) as e:  # what Pillow's decoders raise
        return f"not a decodable image ({e})"
    return None


async def store_images(redis: Redis, spool: ImageSpool, ttl_s: int) -> int:
    """Store the spooled images, once each: an image already stored is only kept for at least `ttl_s` more
    (never shortened); the others are written (SET NX), STORE_BYTES per pipeline. Returns how many were
    written."""
    digests = list(spool.at)
    written = 0
    for start in range(0, len(digests), TOUCH_KEYS):
        chunk = digests[start : start + TOUCH_KEYS]
        missing = [chunk[i - 1] for i in await _TOUCH(redis, [keys.image(d) for d in chunk], [ttl_s])]
        batch: list[tuple[str, bytes]] = []
        size = 0
        for digest in missing:
            data = spool.get(digest)
            batch.append((keys.image(digest), data))
            size += len(data)
            if size >= STORE_BYTES:
                written += await _set(redis, batch, ttl_s)
                batch, size = [], 0
        written += await _set(redis, batch, ttl_s)
    return written


async def _set(redis: Redis, batch: list[tuple[str, bytes]], ttl_s: int) -> int:
    if not batch:
        return 0
    async with redis.pipeline(transaction=False) as pipe:
        for key, data in batch:
            pipe.set(key, data, nx=True, ex=ttl_s)
        stored = await pipe.execute()
    # another submit stored one meanwhile, perhaps for less time than this batch needs it
    raced = [key for (key, _), ok in zip(batch, stored, strict=True) if not ok]
    if raced:
        await _TOUCH(redis, raced, [ttl_s])
    return sum(1 for ok in stored if ok)


async def keep_images(redis: Redis, request: dict[str, Any], ttl_s: int) -> bool:
    """Keep the stored images a queued request refers to for at least `ttl_s` more (a retry runs it
    again); False where one of them has expired (the request cannot run again without it)."""
    digests = [d for _, _, url in image_parts(request.get("messages") or []) if (d := ref_digest(url))]
    if not digests:
        return True
    return not await _TOUCH(redis, [keys.image(d) for d in digests], [ttl_s])
