"""Files of the HTTP API, in Redis: uploaded batch input files, and the output and error files of batches.

An upload is validated line by line exactly as `producer submit` validates (submit.validate_to_spool, in a
thread) and refused whole, with line numbers, when a line is bad; its images are checked as submit checks
them against the server's queue (an upload has no folder: file:// images are refused), and stored only when
a batch runs the file. A file's content is never held in memory
whole: the multipart parser spools the upload to a temporary file, which goes to Redis in blocks of
BLOCK_BYTES (keys.api_file_content); a download streams the blocks back one at a time. The file's hash
(keys.api_file) is written last, so a file exists only once all of it is stored.
"""

from __future__ import annotations

import asyncio
import hmac
import io
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import IO, TYPE_CHECKING, Any

from redis.asyncio import Redis

from producer.api.common import ApiError, list_object, not_found, page_ids
from producer.client.images import ImageChecks
from producer.client.live_workers import queue_serving
from producer.client.submit import SubmitChecks, SubmitReport, validate_to_spool
from producer.wire import keys
from producer.wire.lua import done

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

BLOCK_BYTES = 1 << 20
INPUT_PURPOSE, OUTPUT_PURPOSE = "batch", "batch_output"


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


@dataclass
class FileRecord:
    id: str
    owner: str  # auth.owner_id of the key that created it
    filename: str
    purpose: str
    created_at: int
    expires_at: int
    bytes: int = 0
    blocks: int = 0
    requests: int = 0  # an input file's request lines
    chat_requests: int = 0  # of them, chat requests (the rest are completions and embeddings)
    embedding_requests: int = 0  # of them, embeddings requests

    def to_object(self) -> dict[str, Any]:
        """OpenAI's File object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> FileRecord:
        h = {_s(k): _s(v) for k, v in raw.items()}

        def n(name: str) -> int:
            return int(h.get(name) or 0)

        return cls(
            h["id"], h["owner"], h["filename"], h["purpose"], n("created_at"), n("expires_at"),
            bytes=n("bytes"), blocks=n("blocks"), requests=n("requests"), chat_requests=n("chat_requests"),
            embedding_requests=n("embedding_requests"),
        )  # fmt: skip


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class _KindCounter(io.BytesIO):
    """A spool for validate_to_spool that keeps nothing: it counts the valid requests by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.chat = 0
        self.embeddings = 0
        self.requests = 0

    def write(self, data: ReadableBuffer, /) -> int:
        view = memoryview(data)
        head = view[:2].tobytes()
        if head[:1] == b"R":
            self.requests += 1
            self.chat += head == b"Rc"
            self.embeddings += head == b"Re"
        return len(view)


def _invalid_message(report: SubmitReport) -> str:
    lines = [f"{report.invalid} invalid line(s); the file was not stored:"]
    lines += [f"  {e}" for e in report.errors]
    if report.invalid > len(report.errors):
        lines.append(f"  ... and {report.invalid - len(report.errors)} more")
    return "\n".join(lines)


class FileWriter:
    """Writes one file's content to Redis in blocks, then its hash: the file exists from commit() on."""

    def __init__(self, redis: Redis, record: FileRecord) -> None:
        self.redis = redis
        self.record = record
        self._buf = bytearray()
        self._ttl = max(1, record.expires_at - int(time.time()))

    async def start(self) -> FileWriter:
        await done(self.redis.delete(keys.api_file_content(self.record.id)))  # a retry after a crash
        return self

    async def write(self, data: bytes) -> None:
        self._buf += data
        self.record.bytes += len(data)
        if len(self._buf) >= BLOCK_BYTES:
            await self._flush()

    async def _flush(self) -> None:
        content = keys.api_file_content(self.record.id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.rpush(content, bytes(self._buf))
            pipe.expire(content, self._ttl)  # an upload cut short leaves nothing for long
            await pipe.execute()
        self.record.blocks += 1
        self._buf.clear()

    async def commit(self) -> FileRecord:
        if self._buf:
            await self._flush()
        r = self.record
        index = keys.api_owner_files(r.owner)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.api_file(r.id), mapping=asdict(r))
            pipe.expire(keys.api_file(r.id), self._ttl)
            pipe.expire(keys.api_file_content(r.id), self._ttl)
            pipe.zadd(index, {r.id: time.time()})
            pipe.zremrangebyscore(index, "-inf", time.time() - keys.DEFAULT_FILE_TTL_S)  # long expired
            await pipe.execute()
        return r


class FileStore:
    def __init__(self, redis: Redis, queue: str | None = None) -> None:
        self.redis = redis
        self.queue = queue  # the server's queue, whose workers say whether they take images

    def writer(self, owner: str, *, file_id: str, filename: str, purpose: str, ttl_s: int) -> FileWriter:
        now = int(time.time())
        rec = FileRecord(file_id, owner, filename, purpose, created_at=now, expires_at=now + ttl_s)
        return FileWriter(self.redis, rec)

    async def upload(self, owner: str, *, filename: str, stream: IO[bytes], ttl_s: int) -> FileRecord:
        """Validate every line of a batch input file, then store it. Raises ApiError (400) naming the bad
        lines; nothing is stored then."""
        report = SubmitReport(batch_id="upload")  # the records are counted, never kept
        counter = _KindCounter()
        checks = SubmitChecks(images=ImageChecks.for_queue(await queue_serving(self.redis, self.queue)))
        await asyncio.to_thread(
            validate_to_spool, stream, counter, report, defaults=None, model=None, checks=checks
        )
        if report.invalid:
            raise ApiError(400, _invalid_message(report), param="file", code="invalid_file")
        if report.total == 0:
            raise ApiError(400, "the file holds no request lines", param="file", code="empty_file")
        writer = await self.writer(
            owner, file_id=new_file_id(), filename=filename, purpose=INPUT_PURPOSE, ttl_s=ttl_s
        ).start()
        writer.record.requests, writer.record.chat_requests = counter.requests, counter.chat
        writer.record.embedding_requests = counter.embeddings
        stream.seek(0)
        while block := await asyncio.to_thread(stream.read, BLOCK_BYTES):
            await writer.write(block)
        return await writer.commit()

    async def get(self, owner: str, file_id: str) -> FileRecord:
        """The caller's file; 404 for a file that does not exist or that another key owns."""
        raw = await done(self.redis.hgetall(keys.api_file(file_id)))
        if not raw:
            raise not_found("File", file_id)
        rec = FileRecord.from_hash(raw)
        if not hmac.compare_digest(rec.owner, owner):
            raise not_found("File", file_id)
        return rec

    async def blocks(self, rec: FileRecord) -> AsyncIterator[bytes]:
        """The file's content, one stored block at a time. A file deleted or expired midway raises, so a
        download is never silently cut short."""
        content = keys.api_file_content(rec.id)
        for i in range(rec.blocks):
            block = await done(self.redis.lindex(content, i))
            if block is None:
                raise LookupError(f"file {rec.id} was deleted while it was read")
            yield block if isinstance(block, bytes) else block.encode()

    async def copy_to(self, rec: FileRecord, out: IO[bytes]) -> None:
        async for block in self.blocks(rec):
            await asyncio.to_thread(out.write, block)

    async def delete(self, owner: str, file_id: str) -> dict[str, Any]:
        rec = await self.get(owner, file_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.api_file(rec.id), keys.api_file_content(rec.id))
            pipe.zrem(keys.api_owner_files(owner), rec.id)
            await pipe.execute()
        return {"id": rec.id, "object": "file", "deleted": True}

    async def list(self, owner: str, *, after: str | None, limit: int) -> dict[str, Any]:
        index = keys.api_owner_files(owner)
        ids, has_more = await page_ids(self.redis, index, after=after, limit=limit)
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.hgetall(keys.api_file(file_id))
            raws = await pipe.execute()
        gone = [i for i, raw in zip(ids, raws, strict=True) if not raw]
        if gone:  # expired: drop them from the index on the way
            await done(self.redis.zrem(index, *gone))
        return list_object([FileRecord.from_hash(raw).to_object() for raw in raws if raw], has_more)
