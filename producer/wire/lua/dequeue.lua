-- Cancelling a batch: take out the jobs no worker holds yet (store.cancel_batch).
-- KEYS: queue, the batch's running set.
-- ARGV: job ids, then their indices (n each).
-- Returns {index, payload} pairs of the jobs removed ('' for a payload already gone), so the caller can
-- write their "cancelled" results.

-- arq's key prefixes (arq.constants)
local JOB_KEY = 'arq:job:'
local IN_PROGRESS_KEY = 'arq:in-progress:'
local RETRY_KEY = 'arq:retry:'

local n = #ARGV / 2
local out = {}
for i = 1, n do
  local jid, idx = ARGV[i], ARGV[n + i]
  if redis.call('ZSCORE', KEYS[1], jid) and redis.call('EXISTS', IN_PROGRESS_KEY .. jid) == 0
     and redis.call('SISMEMBER', KEYS[2], idx) == 0 then
    local payload = redis.call('GET', JOB_KEY .. jid)
    redis.call('ZREM', KEYS[1], jid)
    redis.call('DEL', JOB_KEY .. jid, RETRY_KEY .. jid)
    out[#out + 1] = idx
    out[#out + 1] = payload or ''
  end
end
return out
