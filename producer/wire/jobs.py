"""The worker's side of arq's job format, in bulk: claim many queued jobs in one call, finish many in one.

Producers enqueue one arq job per request (`arq:job:<id>`, the queue zset scored by when it is due) and
arq's own Worker would then spend a dozen round trips on each one (lease under WATCH/MULTI, payload and try
counter, start, result, dequeue). A worker here takes jobs with `claim_jobs` (one Lua call for up to N
jobs) and ends them with `finish_jobs` (one Lua call for every result that is ready), keeping arq's keys
and their meaning:

- lease: `arq:in-progress:<job>` with a TTL of lease_s, renewed by the live worker. The job also moves in
  the queue zset to `now + lease_s` while it is leased (and with every renewal), so a claim never has to
  read past the jobs other workers hold; when a worker dies both lapse together and the job is due again.
- tries: a claim that finds the request still in its batch's running set took it from a worker that died
  with it, and counts that in `arq:retry:<job>` (a job that keeps killing workers fails after max_tries);
  a SIGTERM hand-back takes the request out of the running set, so it costs no try. The first claim
  writes nothing there: most requests never need the key.
- start: the request's attempt is started as store.start_attempt does (nothing to run, run, or its batch
  is cancelled); a job with nothing to run is dequeued inside the claim.
- finish: the results are written by store's write_many (first write per attempt wins, with the batches'
  counters), the jobs' keys are deleted and they leave the queue, and determined answers go into the
  result cache, all in the same call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from arq.constants import in_progress_key_prefix, job_key_prefix, retry_key_prefix
from redis.asyncio import Redis

from producer.wire import keys
from producer.wire.lua import LuaScript, LuaValue
from producer.wire.results import Result
from producer.wire.store import WRITE_FIELDS, WRITE_MANY_CONSTANTS, write_values

# The scripts, in lua/. job_keys.lua (batch keys from a job id, dropping jobs) hard-codes these key
# prefixes; store's write_many.lua and start_many.lua are the single calls' functions, run here in bulk.
_JOB_KEYS: dict[str, LuaValue] = {
    "BATCH_KEY": keys.batch_meta(""),
    "JOB_KEY": job_key_prefix,
    "IN_PROGRESS_KEY": in_progress_key_prefix,
    "RETRY_KEY": retry_key_prefix,
}
_CLAIM = LuaScript.load("claim_jobs.lua", **_JOB_KEYS)
_FINISH = LuaScript.load("finish_jobs.lua", **_JOB_KEYS, **WRITE_MANY_CONSTANTS, WRITE_FIELDS=WRITE_FIELDS)
_RENEW = LuaScript.load("renew_leases.lua", IN_PROGRESS_KEY=in_progress_key_prefix)
_HAND_BACK = LuaScript.load("hand_back.lua", **_JOB_KEYS)


@dataclass(frozen=True, slots=True)
class Claimed:
    job_id: str
    payload: bytes  # the arq job, as submit or retry wrote it
    job_try: int  # this claim's try, 1 the first time
    cancelled: bool  # the request's batch was cancelled: store a cancelled result


async def claim_jobs(redis: Redis, queue: str, n: int, lease_s: float) -> tuple[list[Claimed], int]:
    """Claim up to `n` due jobs no worker holds: (the claimed jobs, how many were dropped as done)."""
    raw = await _CLAIM(redis, [queue], [int(time.time() * 1000), int(lease_s * 1000), n])
    jobs = [
        Claimed(raw[i].decode(), raw[i + 1], int(raw[i + 2]), int(raw[i + 3]) == 2)
        for i in range(0, len(raw) - 1, 4)
    ]
    return jobs, int(raw[-1])


@dataclass(slots=True)
class Finished:
    """One request's end, ready to write: its result (with its attempt), the payload a retry may need,
    tokens not yet added to its batch's rate counter, and its result-cache key where it has one."""

    job_id: str
    batch_id: str
    result: Result
    request: bytes | None = None
    generated: int = 0
    cache_key: str | None = None
    cache_answer: bytes = b""


async def finish_jobs(
    redis: Redis, queue: str, done: list[Finished], *, ttl_s: int, cache_ttl_s: int
) -> list[bool]:
    """Write every result, cache what is cacheable, and dequeue the jobs, in one call: whether each
    result was stored (False: that attempt had its result already, or a retry superseded it)."""
    args: list[bytes | str | int] = [repr(time.time()), ttl_s, max(1, cache_ttl_s)]
    for f in done:
        args += [f.job_id, f.cache_key or "", f.cache_answer, *write_values(f.result, f.request, f.generated)]
    return [bool(x) for x in await _FINISH(redis, [queue], args)]


async def renew_leases(redis: Redis, queue: str, job_ids: list[str], lease_s: float) -> None:
    if job_ids:
        await _RENEW(redis, [queue], [int(time.time() * 1000), int(lease_s * 1000), *job_ids])


async def hand_back(redis: Redis, queue: str, job_ids: list[str]) -> None:
    if job_ids:
        await _HAND_BACK(redis, [queue], [int(time.time() * 1000), *job_ids])


__all__ = ["Claimed", "Finished", "claim_jobs", "finish_jobs", "hand_back", "renew_leases"]
