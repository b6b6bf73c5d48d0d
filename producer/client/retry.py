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

from producer.client.images import keep_images
from producer.wire import keys
from producer.wire.lua import LuaScript, done
from producer.wire.store import batch_keys, current_attempts, get_status, iter_results

Selection = Literal["failed", "cancelled", "timed-out"]
FINISH_REASONS: dict[Selection, str] = {"failed": "error", "cancelled": "cancelled", "timed-out": "timeout"}
CHUNK = 500

# Claims attempt n + 1 and enqueues its job, for many requests in one call: see producer/wire/lua/retry.lua.
_RETRY = LuaScript.load("retry.lua", JOB_KEY=job_key_prefix)


@dataclass
class RetryReport:
    batch_id: str
    selected: int = 0  # results whose finish reason was selected
    enqueued: int = 0  # new attempts enqueued by this call
    in_flight: int = 0  # selected, but already retried and not finished (or claimed by a concurrent retry)
    not_retryable: int = 0  # no request kept (rejected at submit), or its images expired: would fail again

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
    stored_ttl = await done(redis.hget(keys.batch_meta(batch_id), "result_ttl_s"))
    ttl = int(stored_ttl) if stored_ttl else keys.DEFAULT_RESULT_TTL_S  # what its images are kept for again
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
            if not await keep_images(redis, req, ttl):  # its stored images expired: it would fail again
                report.not_retryable += 1
                continue
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
