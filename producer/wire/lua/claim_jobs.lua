-- A worker claims up to `want` due jobs no worker holds, and starts their attempts (jobs.claim_jobs).
-- KEYS: queue.
-- ARGV: now (ms), lease (ms), most jobs to claim.
-- Returns job id, payload, try, start code (1 run, 2 batch cancelled) per claimed job, then the number of
-- jobs dropped for having nothing to run (start_many's 0: dequeued here).
--
-- A lease is taken with SET NX: a due job whose lease is still alive belongs to a worker whose renewal is
-- late, and is left to it. A leased job moves in the queue to now + lease, so a claim never reads past
-- the jobs other workers hold. A claim that finds the request still running (start_many's second value)
-- took it from a worker that died with it, and counts that in the job's try counter.

-- @include start_many.lua
-- @include job_keys.lua

local now, lease, want = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local picked, starts, dropped, offset = {}, {}, 0, 0
-- Due: scored before the end of this millisecond. A submit scores its requests at its enqueue millisecond
-- plus a fraction that only orders them (validate.queue_order): due from that millisecond on, not from
-- the next (a claim in the same millisecond found nothing, and a burst worker stopped with work queued).
local due = '(' .. string.format('%.17g', now + 1)
while #picked < want do
  local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', due, 'LIMIT', offset, want - #picked)
  if #ids == 0 then break end
  local gone, leased = {}, {}
  for _, jid in ipairs(ids) do
    local bid, idx, att = split_job_id(jid)
    local payload = redis.call('GET', JOB_KEY .. jid)
    if not payload or not bid then
      gone[#gone + 1] = jid  -- its job key is gone (finished, cancelled) or the id is not a batchq job's
    elseif redis.call('SET', IN_PROGRESS_KEY .. jid, '1', 'NX', 'PX', lease) then
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
      try = 1 + redis.call('INCR', RETRY_KEY .. jid)
    end
    out[#out + 1], out[#out + 2], out[#out + 3], out[#out + 4] = jid, p[2], try, codes[i]
  end
end
drop_jobs(KEYS[1], drop)
out[#out + 1] = #drop
return out
