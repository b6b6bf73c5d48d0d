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
from producer.wire.lua import LuaScript
from producer.wire.results import Result
from producer.wire.store import START_MANY, WRITE_FIELDS, WRITE_MANY, write_values

# Batch keys from a job id (`<batch>:<index>` or `<batch>:<index>.<attempt>`, keys.job_id), as batch_keys
# names them: meta, results, running, chat, attempts, requests, digests, inputs.
_BATCH_KEYS = (
    """
local known_batches = {}
local function batch_keys(bid)
  local k = known_batches[bid]
  if not k then
    local m = '"""
    + keys.batch_meta("")
    + """' .. bid
    k = {m, m .. ':results', m .. ':running', m .. ':chat', m .. ':attempts', m .. ':requests', m .. ':digests',
         m .. ':inputs'}
    known_batches[bid] = k
  end
  return k
end
local function split_job_id(jid)
  local bid, idx, att = string.match(jid, '^(.*):(%d+)%.?(%d*)$')
  return bid, idx, tonumber(att) or 0
end
local function drop_jobs(queue, jids)
  for j = 1, #jids, 1000 do
    local last, dels = math.min(j + 999, #jids), {}
    for i = j, last do
      local jid = jids[i]
      dels[#dels + 1] = '"""
    + job_key_prefix
    + """' .. jid
      dels[#dels + 1] = '"""
    + in_progress_key_prefix
    + """' .. jid
      dels[#dels + 1] = '"""
    + retry_key_prefix
    + """' .. jid
    end
    redis.call('DEL', unpack(dels))
    redis.call('ZREM', queue, unpack(jids, j, last))
  end
end
"""
)

# KEYS: queue. ARGV: now ms, lease ms, most jobs to claim. Returns job id, payload, try, start code
# (1 run, 2 batch cancelled) per claimed job, then the number of jobs dropped for having nothing to run.
# A lease is taken with SET NX: a due job whose lease is still alive belongs to a worker whose renewal is
# late, and is left to it.
_CLAIM = LuaScript(
    START_MANY
    + _BATCH_KEYS
    + """
local now, lease, want = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local picked, starts, dropped, offset = {}, {}, 0, 0
while #picked < want do
  local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', offset, want - #picked)
  if #ids == 0 then break end
  local gone, leased = {}, {}
  for _, jid in ipairs(ids) do
    local bid, idx, att = split_job_id(jid)
    local payload = redis.call('GET', '"""
    + job_key_prefix
    + """' .. jid)
    if not payload or not bid then
      gone[#gone + 1] = jid  -- its job key is gone (finished, cancelled) or the id is not a batchq job's
    elseif redis.call('SET', '"""
    + in_progress_key_prefix
    + """' .. jid, '1', 'NX', 'PX', lease) then
      picked[#picked + 1] = {jid, payload}
      starts[#starts + 1] = {batch_keys(bid), idx, att}
      leased[#leased + 1] = now + lease
      leased[#leased + 1] = jid
    else
      offset = offset + 1
    end
  end
  if #gone > 0 then redis.call('ZREM', KEYS[1], unpack(gone)) end
  if #leased > 0 then redis.call('ZADD', KEYS[1], 'XX', unpack(leased)) end
end
local codes, again = start_many(starts)
local out, drop = {}, {}
for i, p in ipairs(picked) do
  local jid = p[1]
  if codes[i] == 0 then
    drop[#drop + 1] = jid
  else
    local try = 1
    if again[i] then
      try = 1 + redis.call('INCR', '"""
    + retry_key_prefix
    + """' .. jid)
    end
    out[#out + 1], out[#out + 2], out[#out + 3], out[#out + 4] = jid, p[2], try, codes[i]
  end
end
drop_jobs(KEYS[1], drop)
out[#out + 1] = #drop
return out
"""
)

# KEYS: queue. ARGV: now (s), fallback ttl, result-cache ttl, then per result: job id, cache key ('' for
# none), cached answer, then write_many's values. Returns 1 (written) or 0 per result, in order.
_FINISH = LuaScript(
    WRITE_MANY
    + _BATCH_KEYS
    + """
local per = 3 + """
    + str(WRITE_FIELDS)
    + """
local entries, jids = {}, {}
for i = 4, #ARGV, per do
  local jid = ARGV[i]
  local bid = split_job_id(jid)
  local a = {}
  for j = 1, """
    + str(WRITE_FIELDS)
    + """ do a[j] = ARGV[i + 2 + j] end
  entries[#entries + 1] = {batch_keys(bid), a}
  jids[#jids + 1] = jid
  if ARGV[i + 1] ~= '' then redis.call('SET', ARGV[i + 1], ARGV[i + 2], 'EX', ARGV[3]) end
end
local out = write_many(entries, ARGV[1], ARGV[2])
drop_jobs(KEYS[1], jids)
return out
"""
)

# KEYS: queue. ARGV: now ms, lease ms, job ids. Renews the leases this worker holds.
_RENEW = LuaScript(
    """
local now, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 3, #ARGV do
  redis.call('SET', '"""
    + in_progress_key_prefix
    + """' .. ARGV[i], '1', 'PX', lease)
  redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[i])
end
return #ARGV - 2
"""
)

# KEYS: queue. ARGV: now ms, then job ids. SIGTERM hand-back: the jobs are due again at once, their leases
# released, their requests no longer running (so the next claim counts no failed try).
_HAND_BACK = LuaScript(
    _BATCH_KEYS
    + """
for i = 2, #ARGV do
  local jid = ARGV[i]
  local bid, idx = split_job_id(jid)
  redis.call('DEL', '"""
    + in_progress_key_prefix
    + """' .. jid)
  redis.call('ZADD', KEYS[1], 'XX', tonumber(ARGV[1]), jid)
  if bid then redis.call('SREM', batch_keys(bid)[3], idx) end
end
return #ARGV - 1
"""
)


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
