-- A worker writes every result that is ready, caches what is cacheable and dequeues the jobs, in one call
-- (jobs.finish_jobs).
-- KEYS: queue.
-- ARGV: now (s), fallback ttl (s), result-cache ttl (s), then per result: job id, result-cache key ('' for
-- none), cached answer, then write_many's WRITE_FIELDS values.
-- Returns 1 (written) or 0 per result, in order (write_many's).

-- @include write_many.lua
-- @include job_keys.lua

-- the values write_many takes per result (store.WRITE_FIELDS)
local WRITE_FIELDS = 12

local per = 3 + WRITE_FIELDS
local entries, jids = {}, {}
for i = 4, #ARGV, per do
  local jid = ARGV[i]
  local bid = split_job_id(jid)
  local a = {}
  for j = 1, WRITE_FIELDS do a[j] = ARGV[i + 2 + j] end
  entries[#entries + 1] = {batch_keys(bid), a}
  jids[#jids + 1] = jid
  if ARGV[i + 1] ~= '' then redis.call('SET', ARGV[i + 1], ARGV[i + 2], 'EX', ARGV[3]) end
end
local out = write_many(entries, ARGV[1], ARGV[2])
drop_jobs(KEYS[1], jids)
return out
