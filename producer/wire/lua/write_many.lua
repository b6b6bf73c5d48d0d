-- write_many(entries, now, fallback_ttl): store results, once per attempt, with their batches' counters.
-- Included by write_result.lua (one result) and finish_jobs.lua (the worker's bulk finish); not run alone.
--
-- entries: {k, a} each. k: the batch's keys (store.batch_keys: meta, results, running, chat, attempts,
-- requests, digests, inputs). a: the WRITE_FIELDS values of store.write_values: index, result json,
-- counter, prompt_tokens, completion_tokens, cached prompt tokens, 1 if answered from the result cache,
-- attempt, request payload to keep for a retry ('' for none), finish reason, tokens to add to
-- `tokens_generated`, reasoning tokens (of completion_tokens). now: the finish time to record (s).
-- fallback_ttl: the keys' expiry for a batch that names none.
-- Returns 1 (stored) or 0 per entry, in order.
--
-- Only the request's current attempt (attempts hash, absent: 0) may write, once: a late result of an
-- attempt a retry superseded is refused (and leaves the running set alone: the current attempt may be
-- running), and so is a second result of the same attempt (which takes a duplicate run's running mark
-- out). A retry took the older attempt's result out of the counters when it claimed the new attempt
-- (retry.lua), so the counters count each request by its current attempt: queued + running + completed +
-- failed + cancelled == total at every moment. `eos`, `stop`, `timed_out`, `length` and `repetition` count
-- the completed results by finish reason (REASON_COUNTERS). `tokens_generated` is a rate counter (tokens
-- the workers generated, reported while requests run; a result adds what was not reported yet): it never
-- goes down.
-- Counter increments and running-set removals are summed per batch and applied once per call; a batch
-- whose last result this is gets its finished_at and its keys' expiry (its own result_ttl_s, set at
-- submit, wins over the caller's fallback).

-- finish reason -> the meta field counting it (store.REASON_COUNTERS)
local REASON_COUNTERS = {eos = 'eos', stop = 'stop', timeout = 'timed_out', length = 'length', repetition = 'repetition'}

local function write_many(entries, now, fallback_ttl)
  local groups, order, out = {}, {}, {}
  for i, e in ipairs(entries) do
    local k, a = e[1], e[2]
    local g = groups[k[1]]
    if not g then
      g = {k = k, c = {}, srem = {}, retried = redis.call('EXISTS', k[5]) == 1}
      groups[k[1]] = g
      order[#order + 1] = k[1]
    end
    local idx, attempt = a[1], tonumber(a[8])
    local current = 0
    if g.retried then current = tonumber(redis.call('HGET', k[5], idx) or '0') end
    local written = 0
    if attempt == current then
      if attempt == 0 then
        written = redis.call('HSETNX', k[2], idx, a[2])
      else
        local old = redis.call('HGET', k[2], idx)
        if not (old and attempt <= (tonumber(cjson.decode(old).attempt) or 0)) then
          redis.call('HSET', k[2], idx, a[2])
          g.c.retrying = (g.c.retrying or 0) - 1
          written = 1
        end
      end
      g.srem[#g.srem + 1] = idx
    end
    if written == 1 then
      if a[9] ~= '' then redis.call('HSET', k[6], idx, a[9]) elseif attempt > 0 then redis.call('HDEL', k[6], idx) end
      local c = g.c
      c[a[3]] = (c[a[3]] or 0) + 1
      local r = REASON_COUNTERS[a[10]]
      if r then c[r] = (c[r] or 0) + 1 end
      c.prompt_tokens = (c.prompt_tokens or 0) + tonumber(a[4])
      c.completion_tokens = (c.completion_tokens or 0) + tonumber(a[5])
      c.cached_prompt_tokens = (c.cached_prompt_tokens or 0) + tonumber(a[6])
      c.from_result_cache = (c.from_result_cache or 0) + tonumber(a[7])
      c.tokens_generated = (c.tokens_generated or 0) + tonumber(a[11])
      c.reasoning_tokens = (c.reasoning_tokens or 0) + tonumber(a[12])
    end
    out[i] = written
  end
  for _, meta in ipairs(order) do
    local g = groups[meta]
    local k = g.k
    for f, n in pairs(g.c) do
      if n ~= 0 then redis.call('HINCRBY', meta, f, n) end
    end
    for j = 1, #g.srem, 4000 do redis.call('SREM', k[3], unpack(g.srem, j, math.min(j + 3999, #g.srem))) end
    local m = redis.call('HMGET', meta, 'total', 'completed', 'failed', 'cancelled', 'finished_at', 'result_ttl_s')
    local ttl = tonumber(m[6]) or tonumber(fallback_ttl)
    local total = tonumber(m[1])
    local done = (tonumber(m[2]) or 0) + (tonumber(m[3]) or 0) + (tonumber(m[4]) or 0)
    if total == nil or (done >= total and not m[5]) then
      if total ~= nil then redis.call('HSET', meta, 'finished_at', now) end
      for i = 1, #k do redis.call('EXPIRE', k[i], ttl) end
    end
  end
  return out
end
