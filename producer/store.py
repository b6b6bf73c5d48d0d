"""Batch state in Redis: results, counters, running set, status, cancellation, listing.

The worker calls `write_result`, `mark_running` and `is_cancelled`; the producer reads
with `get_status` / `iter_results` and cancels with `cancel_batch`. Counters change only in the same Lua
script that stores a result, so they always equal the results stored.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from arq.constants import in_progress_key_prefix, job_key_prefix
from redis.asyncio import Redis

from producer import keys
from producer.contract import BatchStatus, ErrorInfo, Result
from producer.lua import LuaScript, done

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
# request payload to keep for a retry ('' for none).
#
# Only the request's current attempt (attempts hash, absent: 0) may write, once: a late result of an attempt
# a retry superseded is refused, and so is a second result of the same attempt. A newer attempt replaces the
# stored result of an older one, taking the old result out of the counters and token totals as it adds its
# own, so the counters stay the sum of the stored results. `retrying` counts claimed attempts not yet written.
# The batch's own result_ttl_s (set at submit) wins over the caller's fallback.
_WRITE_RESULT = LuaScript("""
local idx, attempt = ARGV[1], tonumber(ARGV[10])
if attempt ~= tonumber(redis.call('HGET', KEYS[5], idx) or '0') then return 0 end
local old = redis.call('HGET', KEYS[2], idx)
if old then
  local o = cjson.decode(old)
  if attempt <= (tonumber(o.attempt) or 0) then return 0 end
  local c = 'completed'
  if o.finish_reason == 'error' then c = 'failed' elseif o.finish_reason == 'cancelled' then c = 'cancelled' end
  local u = o.usage
  local d = u.prompt_tokens_details
  -- Subtract with 0 - n: -(0) prints as "-0", which HINCRBY refuses.
  local out = {prompt_tokens = tonumber(u.prompt_tokens) or 0, completion_tokens = tonumber(u.completion_tokens) or 0,
               cached_prompt_tokens = type(d) == 'table' and (tonumber(d.cached_tokens) or 0) or 0,
               from_result_cache = o.cached == true and 1 or 0}
  out[c] = 1
  for f, n in pairs(out) do
    if n ~= 0 then redis.call('HINCRBY', KEYS[1], f, 0 - n) end
  end
end
if attempt > 0 then redis.call('HINCRBY', KEYS[1], 'retrying', -1) end
redis.call('HSET', KEYS[2], idx, ARGV[2])
if ARGV[11] ~= '' then redis.call('HSET', KEYS[6], idx, ARGV[11]) elseif attempt > 0 then
  redis.call('HDEL', KEYS[6], idx)
end
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[5])
if ARGV[8] ~= '0' then redis.call('HINCRBY', KEYS[1], 'cached_prompt_tokens', ARGV[8]) end
if ARGV[9] ~= '0' then redis.call('HINCRBY', KEYS[1], 'from_result_cache', 1) end
redis.call('SREM', KEYS[3], idx)
local m = redis.call('HMGET', KEYS[1], 'total', 'completed', 'failed', 'cancelled', 'finished_at',
                     'result_ttl_s', 'retrying')
local ttl = tonumber(m[6]) or tonumber(ARGV[7])
local total = tonumber(m[1])
local done = (tonumber(m[2]) or 0) + (tonumber(m[3]) or 0) + (tonumber(m[4]) or 0) - (tonumber(m[7]) or 0)
if total == nil or (done >= total and not m[5]) then
  if total ~= nil then redis.call('HSET', KEYS[1], 'finished_at', ARGV[6]) end
  for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], ttl) end
end
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
    ]


async def write_result(
    redis: Redis,
    batch_id: str,
    result: Result,
    *,
    ttl_s: int = keys.DEFAULT_RESULT_TTL_S,
    request: bytes | None = None,
) -> bool:
    """Store `result` once per attempt (`result.attempt`) and update the batch counters atomically.

    Returns True if this call stored it, False if this attempt's result already existed or a retry has
    superseded the attempt. `request`: the request's queue payload, kept when the result is one a retry
    can select (RETRYABLE), so that `producer retry` can enqueue it again.
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
    ]
    return bool(await _WRITE_RESULT(redis, batch_keys(batch_id), args))


async def has_result(redis: Redis, batch_id: str, index: int, attempt: int = 0) -> bool:
    """True when attempt `attempt` of the request has nothing left to do: its result is stored, or a retry
    has superseded it (a worker then drops the job without running it)."""
    results = keys.batch_results(batch_id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hget(keys.batch_attempts(batch_id), str(index))
        if attempt:
            pipe.hget(results, str(index))
        else:
            pipe.hexists(results, str(index))
        current, stored = await pipe.execute()
    if _int(current) != attempt:
        return True
    if not attempt:
        return bool(stored)
    return stored is not None and Result.from_json(stored).attempt >= attempt


async def mark_running(redis: Redis, batch_id: str, index: int) -> None:
    await done(redis.sadd(keys.batch_running(batch_id), str(index)))


async def is_cancelled(redis: Redis, batch_id: str) -> bool:
    return _str(await done(redis.hget(keys.batch_meta(batch_id), CANCEL_FLAG) or b"0")) == "1"


def _status(batch_id: str, meta: dict[Any, Any], running: int) -> BatchStatus:
    m = {_str(k): v for k, v in meta.items()}
    total = _int(m.get("total"))
    retrying = _int(m.get("retrying"))
    done = sum(_int(m.get(f)) for f in DONE_FIELDS) - retrying
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
        prompt_tokens=_int(m.get("prompt_tokens")),
        completion_tokens=_int(m.get("completion_tokens")),
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
    redis: Redis, batch_id: str, *, chunk: int = CHUNK
) -> AsyncIterator[tuple[Result, bool]]:
    """Yield (result, was_chat) in input order; requests without a result yet are skipped."""
    total = (await get_status(redis, batch_id)).total
    chat_bits = await done(redis.get(keys.batch_chat(batch_id))) or b""
    for start in range(0, total, chunk):
        idx = list(range(start, min(start + chunk, total)))
        raws = await done(redis.hmget(keys.batch_results(batch_id), [str(i) for i in idx]))
        for i, raw in zip(idx, raws, strict=True):
            if raw is not None:
                byte = i // 8
                chat = byte < len(chat_bits) and bool(chat_bits[byte] & (0x80 >> (i % 8)))
                yield Result.from_json(raw), chat


async def cancel_batch(redis: Redis, batch_id: str, *, chunk: int = CHUNK) -> int:
    """Cancel a batch: drop its still-queued jobs and record a "cancelled" result for each.

    Requests a worker already holds are left to the worker, which polls `is_cancelled` between steps.
    Returns the number of queued requests cancelled here.
    """
    status = await get_status(redis, batch_id)
    if status.finished_at is not None:
        return 0
    meta = keys.batch_meta(batch_id)
    await done(redis.hset(meta, CANCEL_FLAG, "1"))
    queue = status.queue or keys.DEFAULT_QUEUE
    attempts = {int(k): int(v) for k, v in (await done(redis.hgetall(keys.batch_attempts(batch_id)))).items()}
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
