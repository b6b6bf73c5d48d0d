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
from arq.constants import in_progress_key_prefix, job_key_prefix
from redis.asyncio import Redis

from producer.wire import keys
from producer.wire.contract import BatchStatus, ErrorInfo, Result
from producer.wire.lua import LuaScript, done

CHUNK = 500
DONE_FIELDS = ("completed", "failed", "cancelled")
CANCEL_FLAG = "cancel_requested"


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


# KEYS: meta, results, running, chat, attempts, requests. ARGV: index, result json, counter, prompt_tokens,
# completion_tokens, now, fallback ttl, cached prompt tokens, 1 if answered from the result cache, attempt,
# request payload to keep for a retry ('' for none), finish reason, tokens to add to `tokens_generated`.
#
# Only the request's current attempt (attempts hash, absent: 0) may write, once: a late result of an attempt
# a retry superseded is refused (and leaves the running set alone: the current attempt may be running), and
# so is a second result of the same attempt (which takes a duplicate run's running mark out). A retry took
# the older attempt's result out of the counters when it claimed the new attempt (producer/client/retry.py),
# so the counters count each request by its current attempt: queued + running + completed + failed +
# cancelled == total at every moment. `timed_out` and `length` count the completed results that ended on
# their timeout_s or max_new_tokens. `tokens_generated` is a rate counter (tokens the workers generated,
# reported while requests run; a result adds what was not reported yet): it never goes down.
# The batch's own result_ttl_s (set at submit) wins over the caller's fallback.
_WRITE_RESULT = LuaScript("""
local idx, attempt = ARGV[1], tonumber(ARGV[10])
if attempt ~= tonumber(redis.call('HGET', KEYS[5], idx) or '0') then return 0 end
local old = redis.call('HGET', KEYS[2], idx)
if old and (attempt == 0 or attempt <= (tonumber(cjson.decode(old).attempt) or 0)) then
  redis.call('SREM', KEYS[3], idx)
  return 0
end
if attempt > 0 then redis.call('HINCRBY', KEYS[1], 'retrying', -1) end
redis.call('HSET', KEYS[2], idx, ARGV[2])
if ARGV[11] ~= '' then redis.call('HSET', KEYS[6], idx, ARGV[11]) elseif attempt > 0 then
  redis.call('HDEL', KEYS[6], idx)
end
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
if ARGV[12] == 'timeout' then redis.call('HINCRBY', KEYS[1], 'timed_out', 1)
elseif ARGV[12] == 'length' then redis.call('HINCRBY', KEYS[1], 'length', 1) end
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[5])
if ARGV[8] ~= '0' then redis.call('HINCRBY', KEYS[1], 'cached_prompt_tokens', ARGV[8]) end
if ARGV[9] ~= '0' then redis.call('HINCRBY', KEYS[1], 'from_result_cache', 1) end
if ARGV[13] ~= '0' then redis.call('HINCRBY', KEYS[1], 'tokens_generated', ARGV[13]) end
redis.call('SREM', KEYS[3], idx)
local m = redis.call('HMGET', KEYS[1], 'total', 'completed', 'failed', 'cancelled', 'finished_at',
                     'result_ttl_s')
local ttl = tonumber(m[6]) or tonumber(ARGV[7])
local total = tonumber(m[1])
local done = (tonumber(m[2]) or 0) + (tonumber(m[3]) or 0) + (tonumber(m[4]) or 0)
if total == nil or (done >= total and not m[5]) then
  if total ~= nil then redis.call('HSET', KEYS[1], 'finished_at', ARGV[6]) end
  for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], ttl) end
end
return 1
""")

# KEYS: meta, results, running, attempts. ARGV: index, attempt. A worker starts running a request's attempt:
# returns 0 when there is nothing to run (that attempt has its result, or a retry superseded it), else 1,
# or 2 when its batch is cancelled; the index joins the running set (1 and 2) in the same call, so a
# request is never counted as running and finished at once.
_START = LuaScript("""
local idx, attempt = ARGV[1], tonumber(ARGV[2])
if attempt ~= tonumber(redis.call('HGET', KEYS[4], idx) or '0') then return 0 end
local old = redis.call('HGET', KEYS[2], idx)
if old and (attempt == 0 or attempt <= (tonumber(cjson.decode(old).attempt) or 0)) then return 0 end
redis.call('SADD', KEYS[3], idx)
if redis.call('HGET', KEYS[1], 'cancel_requested') == '1' then return 2 end
return 1
""")

RETRYABLE = frozenset({"error", "cancelled", "timeout"})  # finish reasons `producer retry` can select

# KEYS: queue, running. ARGV: job ids then indices (n each). Removes jobs no worker holds yet and
# returns {index, payload} pairs so the caller can write their "cancelled" results.
_DEQUEUE = LuaScript(
    """
local n = #ARGV / 2
local out = {}
for i = 1, n do
  local jid, idx = ARGV[i], ARGV[n + i]
  if redis.call('ZSCORE', KEYS[1], jid) and redis.call('EXISTS', '"""
    + in_progress_key_prefix
    + """' .. jid) == 0
     and redis.call('SISMEMBER', KEYS[2], idx) == 0 then
    local payload = redis.call('GET', '"""
    + job_key_prefix
    + """' .. jid)
    redis.call('ZREM', KEYS[1], jid)
    redis.call('DEL', '"""
    + job_key_prefix
    + """' .. jid)
    out[#out + 1] = idx
    out[#out + 1] = payload or ''
  end
end
return out
"""
)


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
    args = [
        str(result.index),
        result.to_json(),
        counter_for(result.finish_reason),
        result.usage.prompt_tokens,
        result.usage.completion_tokens,
        repr(time.time()),
        ttl_s,
        result.usage.prompt_tokens_details.cached_tokens,
        int(result.cached),
        result.attempt,
        request if request is not None and result.finish_reason in RETRYABLE else b"",
        result.finish_reason,
        max(0, generated),
    ]
    return bool(await _WRITE_RESULT(redis, batch_keys(batch_id), args))


START_NOTHING, START_RUN, START_CANCELLED = 0, 1, 2


async def start_attempt(redis: Redis, batch_id: str, index: int, attempt: int = 0) -> int:
    """A worker takes attempt `attempt` of a request: START_NOTHING when that attempt has its result or a
    retry superseded it (drop the job), else the request is marked running and the answer is START_RUN,
    or START_CANCELLED when its batch was cancelled (store a cancelled result)."""
    ks = [
        keys.batch_meta(batch_id),
        keys.batch_results(batch_id),
        keys.batch_running(batch_id),
        keys.batch_attempts(batch_id),
    ]
    return int(await _START(redis, ks, [str(index), attempt]))


async def add_generated(redis: Redis, tokens_by_batch: dict[str, int]) -> None:
    """Add tokens generated by running requests to their batches' `tokens_generated` rate counters."""
    async with redis.pipeline(transaction=False) as pipe:
        for batch_id, n in tokens_by_batch.items():
            if n > 0:
                pipe.hincrby(keys.batch_meta(batch_id), "tokens_generated", n)
        await pipe.execute()


async def is_cancelled(redis: Redis, batch_id: str) -> bool:
    return _str(await done(redis.hget(keys.batch_meta(batch_id), CANCEL_FLAG) or b"0")) == "1"


def _status(batch_id: str, meta: dict[Any, Any], running: int) -> BatchStatus:
    m = {_str(k): v for k, v in meta.items()}
    total = _int(m.get("total"))
    retrying = _int(m.get("retrying"))
    done = sum(_int(m.get(f)) for f in DONE_FIELDS)
    if done >= total:
        state = "cancelled" if _str(m.get(CANCEL_FLAG, b"0")) == "1" else "completed"
    else:
        state = "running" if done or running or retrying else "queued"
    finished = m.get("finished_at")
    return BatchStatus(
        batch_id=batch_id,
        state=state,
        total=total,
        queued=max(0, total - done - running),
        running=running,
        completed=_int(m.get("completed")),
        failed=_int(m.get("failed")),
        cancelled=_int(m.get("cancelled")),
        timed_out=_int(m.get("timed_out")),
        length=_int(m.get("length")),
        prompt_tokens=_int(m.get("prompt_tokens")),
        completion_tokens=_int(m.get("completion_tokens")),
        tokens_generated=_int(m.get("tokens_generated")),
        cached_prompt_tokens=_int(m.get("cached_prompt_tokens")),
        from_result_cache=_int(m.get("from_result_cache")),
        retrying=retrying,
        created_at=float(m.get("created_at") or 0.0),
        finished_at=float(finished) if finished else None,
        queue=_str(m["queue"]) if m.get("queue") else None,
        model=_str(m["model"]) if m.get("model") else None,
    )


async def get_status(redis: Redis, batch_id: str) -> BatchStatus:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hgetall(keys.batch_meta(batch_id))
        pipe.scard(keys.batch_running(batch_id))
        meta, running = await pipe.execute()
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


async def get_meta(redis: Redis, batch_id: str) -> dict[str, str]:
    meta = await done(redis.hgetall(keys.batch_meta(batch_id)))
    if not meta:
        raise BatchNotFound(batch_id)
    return {_str(k): _str(v) for k, v in meta.items()}
