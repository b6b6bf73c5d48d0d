-- `producer retry` claims new attempts of finished requests and enqueues them (retry.retry_batch).
-- KEYS: queue, then the batch's keys (store.batch_keys: meta, results, running, chat, attempts, requests, ...).
-- ARGV: queue score, then per request: index, the attempt its stored result has, job id, job payload.
-- Returns the number of requests claimed and enqueued.
--
-- Claims attempt + 1 where the request's current attempt is still that one and its result is stored (not
-- already retried), takes that result out of the counters and token totals (the request is queued again:
-- counted by its current attempt), enqueues the job, and puts the batch back to running: no finished_at,
-- no cancel flag, no expiry. The old result stays stored until the new attempt's replaces it
-- (store.iter_results skips it). `tokens_generated` is a rate counter of work done and keeps what the old
-- attempt generated.

-- arq's job key prefix (arq.constants.job_key_prefix)
local JOB_KEY = 'arq:job:'

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
    redis.call('SET', JOB_KEY .. ARGV[i + 2], ARGV[i + 3])
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
