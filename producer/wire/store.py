"""Batch state in Redis: results, counters, running set, status, cancellation, listing.

The worker calls `start_attempt`, `write_result` and `is_cancelled`; the producer reads with `get_status` /
`iter_results`, cancels with `cancel_batch` and retries with producer/client/retry.py. The counters change
only in the Lua scripts that store a result or claim a retry, and count each request by its current
attempt, so at every moment queued + running + completed + failed + cancelled == total.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from arq.constants import in_progress_key_prefix, job_key_prefix, retry_key_prefix
from redis.asyncio import Redis

from producer.wire import keys
from producer.wire.lua import LuaScript, LuaValue, done
from producer.wire.results import BatchState, BatchStatus, ErrorInfo, Result

CHUNK = 500
DONE_FIELDS = ("completed", "failed", "cancelled")
CANCEL_FLAG = "cancel_requested"
# The meta field of an unfinished submit: how many requests it has put into Redis (as jobs or results).
# Submit creates it at 0, adds what each chunk writes and deletes it once every request is in
# (producer/client/enqueue.py, enqueue_spool); BatchStatus.enqueued.
ENQUEUED = "enqueued"
EXCERPTS_PER_FIELD = 500  # input excerpts per field of keys.batch_inputs (get_excerpts)


class BatchNotFound(LookupError):
    def __init__(self, batch_id: str) -> None:
        super().__init__(f"unknown batch id {batch_id!r} (never submitted, or its results expired)")
        self.batch_id = batch_id


def counter_for(finish_reason: str) -> str:
    if finish_reason == "error":
        return "failed"
    if finish_reason == "cancelled":
        return "cancelled"
    return "completed"


# The meta fields that count completed results by finish reason (BatchStatus.eos ... repetition). A retry
# takes a result out of its reason's counter (producer/client/retry.py; of these, only `timeout` can be
# retried).
REASON_COUNTERS = {
    "eos": "eos",
    "stop": "stop",
    "timeout": "timed_out",
    "length": "length",
    "repetition": "repetition",
}

WRITE_FIELDS = 12  # the values write_many takes per result (write_values; lua/write_many.lua)
RETRYABLE = frozenset({"error", "cancelled", "timeout"})  # finish reasons `producer retry` can select

# The scripts, in lua/ (each file's head gives its KEYS and ARGV). write_many.lua and start_many.lua are Lua
# functions that the worker's bulk claim and finish (producer/wire/jobs.py) share with the single calls here.
WRITE_MANY_CONSTANTS: dict[str, LuaValue] = {"REASON_COUNTERS": REASON_COUNTERS}
_WRITE_RESULT = LuaScript.load("write_result.lua", **WRITE_MANY_CONSTANTS)
_START = LuaScript.load("start_attempt.lua")
_DEQUEUE = LuaScript.load(
    "dequeue.lua", JOB_KEY=job_key_prefix, IN_PROGRESS_KEY=in_progress_key_prefix, RETRY_KEY=retry_key_prefix
)
_READ_STATUS = LuaScript.load("read_status.lua")  # a script, not a MULTI: see the file


def _str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _int(v: Any) -> int:
    return int(v) if v not in (None, b"", "") else 0


def batch_keys(batch_id: str) -> list[str]:
    """The keys of a batch's state that expire together once it has finished."""
    return [
        keys.batch_meta(batch_id),
        keys.batch_results(batch_id),
        keys.batch_running(batch_id),
        keys.batch_chat(batch_id),
        keys.batch_attempts(batch_id),
        keys.batch_requests(batch_id),
        keys.batch_digests(batch_id),
        keys.batch_inputs(batch_id),
    ]


async def write_result(
    redis: Redis,
    batch_id: str,
    result: Result,
    *,
    ttl_s: int = keys.DEFAULT_RESULT_TTL_S,
    request: bytes | None = None,
    generated: int = 0,
) -> bool:
    """Store `result` once per attempt (`result.attempt`) and update the batch counters atomically.

    Returns True if this call stored it, False if this attempt's result already existed or a retry has
    superseded the attempt. `request`: the request's queue payload, kept when the result is one a retry
    can select (RETRYABLE), so that `producer retry` can enqueue it again. `generated`: tokens the worker
    generated for it and has not yet added to the batch's `tokens_generated` rate counter.
    """
    args = [repr(time.time()), ttl_s, *write_values(result, request, generated)]
    return bool(await _WRITE_RESULT(redis, batch_keys(batch_id), args))


def write_values(result: Result, request: bytes | None = None, generated: int = 0) -> list[bytes | str | int]:
    """write_many's WRITE_FIELDS values for `result` (see write_result)."""
    usage = result.usage
    details = usage.completion_tokens_details
    return [
        str(result.index),
        result.to_json(),
        counter_for(result.finish_reason),
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.prompt_tokens_details.cached_tokens,
        int(result.cached),
        result.attempt,
        request if request is not None and result.finish_reason in RETRYABLE else b"",
        result.finish_reason,
        max(0, generated),
        details.reasoning_tokens if details is not None else 0,
    ]


START_NOTHING, START_RUN, START_CANCELLED = 0, 1, 2


async def start_attempt(redis: Redis, batch_id: str, index: int, attempt: int = 0) -> int:
    """A worker takes attempt `attempt` of a request: START_NOTHING when that attempt has its result or a
    retry superseded it (drop the job), else the request is marked running and the answer is START_RUN,
    or START_CANCELLED when its batch was cancelled (store a cancelled result)."""
    return int(await _START(redis, batch_keys(batch_id), [str(index), attempt]))


async def add_generated(redis: Redis, tokens_by_batch: dict[str, int]) -> None:
    """Add tokens generated by running requests to their batches' `tokens_generated` rate counters."""
    async with redis.pipeline(transaction=False) as pipe:
        for batch_id, n in tokens_by_batch.items():
            if n > 0:
                pipe.hincrby(keys.batch_meta(batch_id), "tokens_generated", n)
        await pipe.execute()


async def is_cancelled(redis: Redis, batch_id: str) -> bool:
    return _str(await done(redis.hget(keys.batch_meta(batch_id), CANCEL_FLAG) or b"0")) == "1"


def batch_state(total: int, done: int, running: int, retrying: int, cancelled: int) -> BatchState:
    """A batch's state, from its counts alone (each request counted by its current attempt):

    - queued: no request has started or finished (none running, none done, none being retried);
    - running: some request has no result yet (queued or running), and one has started or finished;
    - cancelled: every request has a result, and at least one of them is `cancelled`;
    - completed: every request has a result and none is `cancelled` (failed ones included: they are
      counted in `failed`, as OpenAI's completed batches count theirs).

    So the state moves with the counts: a cancelled batch whose cancelled requests `producer retry`
    re-enqueued is running again, and completed once they all have answers; a batch that still holds
    cancelled results stays cancelled whatever else is retried. The cancel flag does not decide it (a
    cancel that came after every request had started, and stopped none, leaves a completed batch)."""
    if done < total:
        return "running" if done or running or retrying else "queued"
    return "cancelled" if cancelled else "completed"


def _status(batch_id: str, meta: dict[Any, Any], running: int) -> BatchStatus:
    m = {_str(k): v for k, v in meta.items()}
    total = _int(m.get("total"))
    retrying = _int(m.get("retrying"))
    done = sum(_int(m.get(f)) for f in DONE_FIELDS)
    cancelled = _int(m.get("cancelled"))
    finished = m.get("finished_at")
    enqueued = m.get(ENQUEUED)  # absent: the submit finished (or the batch predates the field)
    return BatchStatus(
        batch_id=batch_id,
        state=batch_state(total, done, running, retrying, cancelled),
        total=total,
        queued=max(0, total - done - running),
        running=running,
        completed=_int(m.get("completed")),
        failed=_int(m.get("failed")),
        cancelled=cancelled,
        eos=_int(m.get("eos")),
        stop=_int(m.get("stop")),
        timed_out=_int(m.get("timed_out")),
        length=_int(m.get("length")),
        repetition=_int(m.get("repetition")),
        prompt_tokens=_int(m.get("prompt_tokens")),
        completion_tokens=_int(m.get("completion_tokens")),
        tokens_generated=_int(m.get("tokens_generated")),
        cached_prompt_tokens=_int(m.get("cached_prompt_tokens")),
        reasoning_tokens=_int(m.get("reasoning_tokens")),
        from_result_cache=_int(m.get("from_result_cache")),
        retrying=retrying,
        created_at=float(m.get("created_at") or 0.0),
        finished_at=float(finished) if finished else None,
        queue=_str(m["queue"]) if m.get("queue") else None,
        model=_str(m["model"]) if m.get("model") else None,
        enqueued=None if enqueued is None else min(_int(enqueued), total),
    )


async def get_status(redis: Redis, batch_id: str) -> BatchStatus:
    flat, running = await _READ_STATUS(redis, [keys.batch_meta(batch_id), keys.batch_running(batch_id)], [])
    meta = dict(zip(flat[::2], flat[1::2], strict=True))
    if not meta or (b"total" not in meta and "total" not in meta):
        raise BatchNotFound(batch_id)
    return _status(batch_id, meta, int(running))


async def iter_results(
    redis: Redis, batch_id: str, *, chunk: int = CHUNK, superseded: bool = False
) -> AsyncIterator[tuple[Result, bool]]:
    """Yield (result, was_chat) in input order, the results the batch counts: requests without a result
    yet are skipped, and so is the result of an attempt a retry has superseded while the new attempt runs
    (`superseded=True` yields those too)."""
    total = (await get_status(redis, batch_id)).total
    chat_bits = await done(redis.get(keys.batch_chat(batch_id))) or b""
    attempts = {} if superseded else await current_attempts(redis, batch_id)
    for start in range(0, total, chunk):
        idx = list(range(start, min(start + chunk, total)))
        raws = await done(redis.hmget(keys.batch_results(batch_id), [str(i) for i in idx]))
        for i, raw in zip(idx, raws, strict=True):
            if raw is None:
                continue
            result = Result.from_json(raw)
            if result.attempt < attempts.get(i, 0):
                continue
            byte = i // 8
            chat = byte < len(chat_bits) and bool(chat_bits[byte] & (0x80 >> (i % 8)))
            yield result, chat


async def current_attempts(redis: Redis, batch_id: str) -> dict[int, int]:
    """Request index -> its current attempt, for the requests `producer retry` re-enqueued (others: 0)."""
    raw = await done(redis.hgetall(keys.batch_attempts(batch_id)))
    return {int(k): int(v) for k, v in raw.items()}


async def cancel_batch(redis: Redis, batch_id: str, *, chunk: int = CHUNK) -> int:
    """Cancel a batch: drop its still-queued jobs and record a "cancelled" result for each.

    Requests a worker already holds are left to the worker, which polls `is_cancelled` while they run.
    Returns the number of queued requests cancelled here.
    """
    status = await get_status(redis, batch_id)
    if status.finished_at is not None:
        return 0
    meta = keys.batch_meta(batch_id)
    await done(redis.hset(meta, CANCEL_FLAG, "1"))
    queue = status.queue or keys.DEFAULT_QUEUE
    attempts = await current_attempts(redis, batch_id)
    cancelled = 0
    for start in range(0, status.total, chunk):
        idx = range(start, min(start + chunk, status.total))
        args = [keys.job_id(batch_id, i, attempts.get(i, 0)) for i in idx] + [str(i) for i in idx]
        out = await _DEQUEUE(redis, [queue, keys.batch_running(batch_id)], args)
        for k in range(0, len(out), 2):
            index, payload = int(out[k]), out[k + 1]
            req: dict[str, Any] = orjson.loads(payload)["a"][0] if payload else {}
            result = Result(
                id=req.get("id", str(index)),
                index=index,
                finish_reason="cancelled",
                error=ErrorInfo(type="cancelled", message="batch cancelled before this request started"),
                metadata=req.get("metadata"),
                attempt=attempts.get(index, 0),
            )
            cancelled += await write_result(
                redis, batch_id, result, request=orjson.dumps(req) if req else None
            )
    return cancelled


async def list_batches(redis: Redis, *, limit: int = 50) -> list[BatchStatus]:
    """The newest `limit` batches; batches whose keys expired are dropped from the index on the way."""
    ids = [_str(b) for b in await done(redis.zrevrange(keys.BATCHES, 0, limit - 1))]
    out = []
    for batch_id in ids:
        try:
            out.append(await get_status(redis, batch_id))
        except BatchNotFound:
            await done(redis.zrem(keys.BATCHES, batch_id))
    return out


async def all_statuses(redis: Redis, *, chunk: int = CHUNK) -> AsyncIterator[BatchStatus]:
    """Every batch in the index, oldest first, read in pipelined chunks; a batch whose keys expired is
    skipped. A batch's meta and running set are read one after the other, not at one moment: a request
    that ends in between may be counted as queued instead of running, but queued + running (its
    `pending`) is exact as of the meta's read."""
    ids = [_str(b) for b in await done(redis.zrange(keys.BATCHES, 0, -1))]
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        async with redis.pipeline(transaction=False) as pipe:
            for batch_id in part:
                pipe.hgetall(keys.batch_meta(batch_id))
                pipe.scard(keys.batch_running(batch_id))
            read = await pipe.execute()
        for batch_id, meta, running in zip(part, read[::2], read[1::2], strict=True):
            if meta and (b"total" in meta or "total" in meta):
                yield _status(batch_id, meta, int(running))


async def owned_batches(
    redis: Redis, *, owner: str | None, queue: str, limit: int = 100, scan: int = 1000
) -> list[BatchStatus]:
    """The newest `limit` batches on `queue` whose meta names `owner` (None: every batch on the queue),
    looked for among the newest `scan` batches."""
    ids = [_str(b) for b in await done(redis.zrevrange(keys.BATCHES, 0, scan - 1))]
    async with redis.pipeline(transaction=False) as pipe:
        for batch_id in ids:
            pipe.hmget(keys.batch_meta(batch_id), ["owner", "queue"])
        metas = await pipe.execute()
    out = []
    for batch_id, (who, q) in zip(ids, metas, strict=True):
        if q is None or _str(q) != queue or (owner is not None and (who is None or _str(who) != owner)):
            continue
        try:
            out.append(await get_status(redis, batch_id))
        except BatchNotFound:
            continue
        if len(out) >= limit:
            break
    return out


async def get_excerpts(redis: Redis, batch_id: str, indices: list[int]) -> dict[int, str]:
    """Input excerpts of requests (keys.batch_inputs: field n holds a JSON list of the excerpts of requests
    n * EXCERPTS_PER_FIELD onwards), by index; a request without one is left out."""
    fields = sorted({i // EXCERPTS_PER_FIELD for i in indices})
    if not fields:
        return {}
    raws = await done(redis.hmget(keys.batch_inputs(batch_id), [str(f) for f in fields]))
    lists = {f: orjson.loads(r) for f, r in zip(fields, raws, strict=True) if r is not None}
    out = {}
    for i in indices:
        texts = lists.get(i // EXCERPTS_PER_FIELD)
        text = (
            texts[i % EXCERPTS_PER_FIELD]
            if texts is not None and i % EXCERPTS_PER_FIELD < len(texts)
            else None
        )
        if text is not None:
            out[i] = text
    return out


async def get_meta(redis: Redis, batch_id: str) -> dict[str, str]:
    meta = await done(redis.hgetall(keys.batch_meta(batch_id)))
    if not meta:
        raise BatchNotFound(batch_id)
    return {_str(k): _str(v) for k, v in meta.items()}
