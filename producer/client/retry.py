"""`producer retry`: enqueue the failed, cancelled or timed-out requests of a batch again, as new attempts.

Each request has an attempt number (keys.batch_attempts; absent: 0). A retry claims attempt n + 1 of a
request whose stored result is attempt n's, in the same Lua script that enqueues the new job, so
concurrent retries of one batch never enqueue a request twice. The new attempt runs under its own job id
(keys.job_id(batch, index, n + 1)); its result replaces the old one when it is written (store.write_result
never counts it again), and a late result of attempt n is refused from then on. The claim takes the old
result out of the counters at once: the request counts as queued (then running) again, and as `retrying`
until its new attempt ends, so the batch is running again and its counts still add up to its total.

The payload comes from keys.batch_requests, where a failed, cancelled or timed-out result keeps its
request; requests rejected at submit (invalid lines) have none and are skipped: they would fail again.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import orjson
from arq.constants import job_key_prefix
from redis.asyncio import Redis

from producer.wire import keys
from producer.wire.lua import LuaScript, done
from producer.wire.store import batch_keys, current_attempts, get_status, iter_results

Selection = Literal["failed", "cancelled", "timed-out"]
FINISH_REASONS: dict[Selection, str] = {"failed": "error", "cancelled": "cancelled", "timed-out": "timeout"}
CHUNK = 500

# KEYS: queue, then store.batch_keys (meta, results, running, chat, attempts, requests). ARGV: queue score,
# then per request: index, the attempt its stored result has, job id, job payload. Claims attempt + 1
# where the request's current attempt is still that one and its result is stored (not already retried),
# takes that result out of the counters and token totals (the request is queued again: counted by its
# current attempt), enqueues the job, and puts the batch back to running: no finished_at, no cancel flag,
# no expiry. The old result stays stored until the new attempt's replaces it (store.iter_results skips it).
# `tokens_generated` is a rate counter of work done and keeps what the old attempt generated.
_RETRY = LuaScript(
    """
local n = 0
for i = 2, #ARGV, 4 do
  local idx, seen = ARGV[i], ARGV[i + 1]
  local old = redis.call('HGET', KEYS[3], idx)
  if (redis.call('HGET', KEYS[6], idx) or '0') == seen and old then
    redis.call('HSET', KEYS[6], idx, tonumber(seen) + 1)
    local o = cjson.decode(old)
    local u = o.usage
    local d, r = u.prompt_tokens_details, u.completion_tokens_details
    local c = 'completed'
    if o.finish_reason == 'error' then c = 'failed' elseif o.finish_reason == 'cancelled' then c = 'cancelled'
    elseif o.finish_reason == 'timeout' then redis.call('HINCRBY', KEYS[2], 'timed_out', -1)
    elseif o.finish_reason == 'length' then redis.call('HINCRBY', KEYS[2], 'length', -1) end
    redis.call('HINCRBY', KEYS[2], c, -1)
    -- Subtract with 0 - n: -(0) prints as "-0", which HINCRBY refuses.
    local out = {prompt_tokens = tonumber(u.prompt_tokens) or 0, completion_tokens = tonumber(u.completion_tokens) or 0,
                 cached_prompt_tokens = type(d) == 'table' and (tonumber(d.cached_tokens) or 0) or 0,
                 reasoning_tokens = type(r) == 'table' and (tonumber(r.reasoning_tokens) or 0) or 0,
                 from_result_cache = o.cached == true and 1 or 0}
    for f, v in pairs(out) do
      if v ~= 0 then redis.call('HINCRBY', KEYS[2], f, 0 - v) end
    end
    redis.call('SET', '"""
    + job_key_prefix
    + """' .. ARGV[i + 2], ARGV[i + 3])
    redis.call('ZADD', KEYS[1], ARGV[1], ARGV[i + 2])
    n = n + 1
  end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[2], 'retrying', n)
  redis.call('HDEL', KEYS[2], 'finished_at', 'cancel_requested')
  for k = 2, #KEYS do redis.call('PERSIST', KEYS[k]) end
end
return n
"""
)


@dataclass
class RetryReport:
    batch_id: str
    selected: int = 0  # results whose finish reason was selected
    enqueued: int = 0  # new attempts enqueued by this call
    in_flight: int = 0  # selected, but already retried and not finished (or claimed by a concurrent retry)
    not_retryable: int = 0  # no request kept (rejected at submit): would fail again

    def to_dict(self) -> dict[str, int | str]:
        return {
            "batch_id": self.batch_id,
            "selected": self.selected,
            "enqueued": self.enqueued,
            "in_flight": self.in_flight,
            "not_retryable": self.not_retryable,
        }


def finish_reasons(selection: Iterable[Selection]) -> frozenset[str]:
    """The finish reasons a selection retries; an empty selection means all three."""
    chosen = list(selection) or list(FINISH_REASONS)
    return frozenset(FINISH_REASONS[s] for s in chosen)


async def retry_batch(redis: Redis, batch_id: str, reasons: frozenset[str]) -> RetryReport:
    """Re-enqueue the requests of `batch_id` whose current result has one of `reasons` (finish reasons)."""
    status = await get_status(redis, batch_id)
    queue = status.queue or keys.DEFAULT_QUEUE
    report = RetryReport(batch_id)
    attempts = await current_attempts(redis, batch_id)
    picked: list[tuple[int, int]] = []  # (index, attempt of its stored result)
    async for result, _chat in iter_results(redis, batch_id, superseded=True):
        if result.finish_reason not in reasons:
            continue
        report.selected += 1
        if attempts.get(result.index, 0) != result.attempt:
            report.in_flight += 1
        else:
            picked.append((result.index, result.attempt))
    ks = [queue, *batch_keys(batch_id)]
    for start in range(0, len(picked), CHUNK):
        part = picked[start : start + CHUNK]
        raws = await done(redis.hmget(keys.batch_requests(batch_id), [str(i) for i, _ in part]))
        now = time.time()
        args: list[bytes | str | int] = [int(now * 1000)]
        for (index, attempt), raw in zip(part, raws, strict=True):
            if raw is None:
                report.not_retryable += 1
                continue
            req = orjson.loads(raw)
            req["attempt"], req["enqueued_at"] = attempt + 1, now
            jid = keys.job_id(batch_id, index, attempt + 1)
            job: dict[str, object] = {
                "t": None,
                "f": keys.JOB_FUNCTION,
                "a": [req],
                "k": {},
                "et": int(now * 1000),
            }
            args += [index, attempt, jid, orjson.dumps(job)]
        if len(args) > 1:
            claimed = int(await _RETRY(redis, ks, args))
            report.enqueued += claimed
            report.in_flight += (len(args) - 1) // 4 - claimed
    return report
