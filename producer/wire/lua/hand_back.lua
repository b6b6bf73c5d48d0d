-- SIGTERM hand-back (jobs.hand_back): the jobs are due again at once, their leases released, their
-- requests no longer running (so the next claim counts no failed try).
-- KEYS: queue.
-- ARGV: now (ms), then job ids.
-- Returns the number of jobs handed back.

-- @include job_keys.lua

for i = 2, #ARGV do
  local jid = ARGV[i]
  local bid, idx = split_job_id(jid)
  redis.call('DEL', IN_PROGRESS_KEY .. jid)
  redis.call('ZADD', KEYS[1], 'XX', tonumber(ARGV[1]), jid)
  if bid then redis.call('SREM', batch_keys(bid)[3], idx) end
end
return #ARGV - 1
