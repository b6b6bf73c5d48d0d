-- A worker renews the leases it holds (jobs.renew_leases): each job's lease key and its place in the
-- queue move to now + lease.
-- KEYS: queue.
-- ARGV: now (ms), lease (ms), then job ids.
-- Returns the number of jobs renewed.

-- arq's lease key prefix (arq.constants.in_progress_key_prefix)
local IN_PROGRESS_KEY = 'arq:in-progress:'

local now, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 3, #ARGV do
  redis.call('SET', IN_PROGRESS_KEY .. ARGV[i], '1', 'PX', lease)
  redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[i])
end
return #ARGV - 2
