"""OpenAI Batch objects over batchq batches: create one from an uploaded file, read, list and cancel it,
and finalise it into output and error files.

An API batch and the batchq batch that runs it share one id (`batch_<hex>`), so `producer status` follows
it too. The API's own fields live in keys.api_batch; the batchq batch is submitted, read and cancelled
through BatchqClient, as the CLI does, and its progress is read from it until every request has a result. Then one server instance, under a lock, finalises it: it writes the
output and error files in OpenAI's line shapes (openai_format.py) and records the final status and counts,
after which the object no longer needs the batchq batch (whose results expire sooner).

Servers keep nothing in memory. A submit cut short by a crash is finished by the next instance that reads
the batch (submit is idempotent by batch id); a batch whose completion window passes is expired when it
is next read: its queued requests are cancelled, and what finished is in its files.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any

import orjson
from redis.exceptions import LockError, RedisError

from producer.api.batch_object import BatchRecord, CreateRequest, batch_object, check_endpoint, input_errors
from producer.api.common import ApiError, list_object, not_found, page_ids
from producer.api.files import OUTPUT_PURPOSE, FileRecord, FileStore
from producer.client.batchq_client import BatchqClient
from producer.client.openai_format import is_error_line, openai_line, output_model_and_created
from producer.client.submit import InputError
from producer.wire import keys
from producer.wire.lua import done
from producer.wire.results import BatchStatus
from producer.wire.store import BatchNotFound

log = logging.getLogger("batchq.server")

TERMINAL = ("completed", "failed", "expired", "cancelled")
LOCK_S = 60  # renewed every LOCK_S / 3 while held; a crashed holder's lock lapses after LOCK_S


class BatchStore:
    def __init__(
        self,
        client: BatchqClient,
        files: FileStore,
        *,
        queue: str | None,
        model: str | None,
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        self.client = client
        self.redis = client.redis  # the API's own records (keys.api_batch); batchq's go through the client
        self.files = files
        self.queue = queue
        self.model = model
        self.aliases = dict(aliases or {})
        self._tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Stop resumed submits (their locks are released: another instance finishes them)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def create(self, owner: str, body: Any) -> dict[str, Any]:
        """Create the batch and submit its file's lines to batchq before answering (OpenAI answers while
        validating; here a file of 100,000 lines is enqueued in a few seconds)."""
        req = CreateRequest.parse(body)
        f = await self.files.get(owner, req.input_file_id)
        check_endpoint(req.endpoint, f)
        bid = "batch_" + uuid.uuid4().hex
        now = int(time.time())
        rec = BatchRecord(
            id=bid,
            owner=owner,
            endpoint=req.endpoint,
            input_file_id=f.id,
            completion_window=req.completion_window,
            created_at=now,
            expires_at=now + req.window_s,
            total=f.requests,
            metadata=orjson.dumps(req.metadata).decode() if req.metadata is not None else "",
            output_ttl_s=req.output_ttl_s,
        )
        index = keys.api_owner_batches(owner)
        async with self._held(bid) as mine:
            assert mine, "a fresh batch id is locked by no one"
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(keys.api_batch(bid), mapping=rec.to_hash())
                pipe.expire(keys.api_batch(bid), keys.DEFAULT_FILE_TTL_S)
                pipe.zadd(index, {bid: time.time()})
                pipe.zremrangebyscore(index, "-inf", time.time() - keys.DEFAULT_FILE_TTL_S)
                await pipe.execute()
            await self._submit(rec, f)
        return await self._object(await self._reload(bid))

    async def get(self, owner: str, batch_id: str) -> dict[str, Any]:
        return await self._object(await self._owned(owner, batch_id))

    async def list(self, owner: str, *, after: str | None, limit: int) -> dict[str, Any]:
        index = keys.api_owner_batches(owner)
        ids, has_more = await page_ids(self.redis, index, after=after, limit=limit)
        data = []
        for bid in ids:
            rec = await self._load(bid)
            if rec is None:
                await done(self.redis.zrem(index, bid))  # expired: drop it from the index on the way
            else:
                data.append(await self._object(rec))
        return list_object(data, has_more)

    async def cancel(self, owner: str, batch_id: str) -> dict[str, Any]:
        rec = await self._owned(owner, batch_id)
        status = (await self._object(rec))["status"]
        if status in (*TERMINAL, "finalizing"):
            raise ApiError(
                400, f"batch {batch_id} is {status}: it can no longer be cancelled", code="not_cancellable"
            )
        await done(self.redis.hsetnx(keys.api_batch(batch_id), "cancelling_at", str(int(time.time()))))
        # Written before read, as _submit does the other way round: one of the two sees the other's write.
        if await done(self.redis.hget(keys.api_batch(batch_id), "in_progress_at")):
            await self.client.cancel(batch_id)
        return await self._object(await self._reload(batch_id))

    # ---- the lifecycle ----

    async def _submit(self, rec: BatchRecord, f: FileRecord) -> None:
        """Enqueue the file's lines as the batchq batch `rec.id`; idempotent, so a resumed submit is safe."""
        bid = rec.id
        try:
            with tempfile.TemporaryFile(prefix="batchq-api-") as tmp:
                await self.files.copy_to(f, tmp)
                tmp.seek(0)
                report = await self.client.submit_file(
                    tmp, batch_id=bid, queue=self.queue, model=self.model, model_aliases=self.aliases,
                    offload=True, owner=rec.owner,
                )  # fmt: skip
        except (InputError, LookupError) as e:  # LookupError: the input file was deleted meanwhile
            await self._set(bid, status="failed", failed_at=int(time.time()), errors=input_errors(e))
            return
        # The model the lines ask for (after --model-alias); once the batch ends, the model that ran.
        await self._set(bid, in_progress_at=int(time.time()), model=report.model or "")
        if await done(self.redis.hget(keys.api_batch(bid), "cancelling_at")):
            await self.client.cancel(bid)

    async def _resume(self, bid: str) -> None:
        """Finish a submit that a crashed instance left: nobody holds the lock and nothing marks it done."""
        async with self._held(bid) as mine:
            rec = await self._load(bid) if mine else None
            if rec is None or rec.in_progress_at or rec.status:
                return
            try:
                f = await self.files.get(rec.owner, rec.input_file_id)
            except ApiError:
                gone = LookupError(
                    f"input file {rec.input_file_id} was deleted before the batch was submitted"
                )
                await self._set(bid, status="failed", failed_at=int(time.time()), errors=input_errors(gone))
                return
            await self._submit(rec, f)

    async def _object(self, rec: BatchRecord) -> dict[str, Any]:
        """The batch as OpenAI shows it, moving it on where reading shows it should: resuming an interrupted
        submit, expiring it, finalising it."""
        if rec.status in TERMINAL:
            return batch_object(rec, rec.status)
        if not rec.in_progress_at:
            if not await done(self.redis.exists(keys.api_batch_lock(rec.id))):
                self._spawn(self._resume(rec.id))
            return batch_object(rec, "cancelling" if rec.cancelling_at else "validating")
        try:
            st = await self.client.status(rec.id)
        except BatchNotFound:
            return await self._finalize(rec, None)
        if st.done < st.total and not rec.expiring_at and time.time() >= rec.expires_at:
            await done(self.redis.hsetnx(keys.api_batch(rec.id), "expiring_at", str(int(time.time()))))
            await self.client.cancel(rec.id)
            return await self._object(await self._reload(rec.id))
        if st.done >= st.total:
            return await self._finalize(rec, st)
        status = "finalizing" if rec.expiring_at else "cancelling" if rec.cancelling_at else "in_progress"
        return batch_object(rec, status, st)

    async def _finalize(self, rec: BatchRecord, st: BatchStatus | None) -> dict[str, Any]:
        """Write the output and error files and the final status, once, whichever instance gets there."""
        async with self._held(rec.id) as mine:
            fresh = await self._load(rec.id) if mine else None
            if fresh is None:  # another instance is finalising it now
                return batch_object(rec, "finalizing", st)
            if fresh.status in TERMINAL:
                return batch_object(fresh, fresh.status)
            now = int(time.time())
            await done(self.redis.hsetnx(keys.api_batch(rec.id), "finalizing_at", str(now)))
            if st is None:
                gone = LookupError("the batch's results expired before it was read to the end")
                await self._set(rec.id, status="failed", failed_at=now, errors=input_errors(gone))
            else:
                out_id, err_id, ran = await self._write_files(fresh)
                status = (
                    "cancelled" if fresh.cancelling_at else "expired" if fresh.expiring_at else "completed"
                )
                await self._set(
                    rec.id,
                    status=status,
                    **{f"{status}_at": now},
                    output_file_id=out_id,
                    error_file_id=err_id,
                    model=ran or fresh.model,
                    total=st.total,
                    completed=st.completed,
                    failed=st.failed,
                    prompt_tokens=st.prompt_tokens,
                    completion_tokens=st.completion_tokens,
                    cached_tokens=st.cached_prompt_tokens,
                    reasoning_tokens=st.reasoning_tokens,
                )
            final = await self._load(rec.id)
            assert final is not None
            return batch_object(final, final.status)

    async def _write_files(self, rec: BatchRecord) -> tuple[str, str, str]:
        """The output file (answers) and error file (failed and cancelled requests); "" for an empty one;
        and the model that answered ("" when none did)."""
        model, created = output_model_and_created(await self.client.batch_meta(rec.id))
        hexid = rec.id.removeprefix("batch_")
        ttl = rec.output_ttl_s or keys.DEFAULT_FILE_TTL_S
        out, err = (
            self.files.writer(
                rec.owner, file_id=f"file-{hexid}-{kind}", filename=f"{rec.id}_{kind}.jsonl",
                purpose=OUTPUT_PURPOSE, ttl_s=ttl,
            )
            for kind in ("output", "errors")
        )  # fmt: skip
        await out.start()
        await err.start()
        expired = bool(rec.expiring_at)
        ran = ""
        async for result, chat in self.client.results_with_kind(rec.id):
            ran = ran or result.model or ""
            line = openai_line(
                result, chat=chat, batch_id=rec.id, model=model, created=created, expired=expired
            )
            await (err if is_error_line(result) else out).write(line + b"\n")
        out_id = (await out.commit()).id if out.record.bytes else ""
        err_id = (await err.commit()).id if err.record.bytes else ""
        return out_id, err_id, ran

    # ---- Redis helpers ----

    async def _load(self, batch_id: str) -> BatchRecord | None:
        raw = await done(self.redis.hgetall(keys.api_batch(batch_id)))
        return BatchRecord.from_hash(raw) if raw else None

    async def _reload(self, batch_id: str) -> BatchRecord:
        rec = await self._load(batch_id)
        if rec is None:  # expired or removed under us
            raise not_found("Batch", batch_id)
        return rec

    async def _owned(self, owner: str, batch_id: str) -> BatchRecord:
        rec = await self._load(batch_id) if len(batch_id) <= 128 else None
        if rec is None or not rec.owned_by(owner):
            raise not_found("Batch", batch_id)
        return rec

    async def _set(self, batch_id: str, **fields: Any) -> None:
        await done(self.redis.hset(keys.api_batch(batch_id), mapping=fields))

    @asynccontextmanager
    async def _held(self, batch_id: str) -> AsyncIterator[bool]:
        """The batch's lock, renewed while held; yields False (at once) when another instance holds it."""
        lock = self.redis.lock(keys.api_batch_lock(batch_id), timeout=LOCK_S)
        if not await lock.acquire(blocking=False):
            yield False
            return

        async def renew() -> None:
            while True:
                await asyncio.sleep(LOCK_S / 3)
                with suppress(LockError, RedisError):  # a Redis blip: try again at the next turn
                    await lock.extend(LOCK_S, replace_ttl=True)

        renewing = asyncio.ensure_future(renew())
        try:
            yield True
        finally:
            renewing.cancel()
            with suppress(LockError, RedisError):
                await lock.release()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(_log_failure)
        task.add_done_callback(self._tasks.discard)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("resuming a batch's submit failed (the next read retries): %r", task.exception())
