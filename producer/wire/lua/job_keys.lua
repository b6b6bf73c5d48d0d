-- Job ids and their keys: batch_keys(bid), split_job_id(jid), drop_jobs(queue, jids). Included by
-- claim_jobs.lua, finish_jobs.lua and hand_back.lua; not run alone.
--
-- batch_keys(bid): a batch's keys, as store.batch_keys names them: meta, results, running, chat, attempts,
-- requests, digests, inputs.
-- split_job_id(jid): batch id, index (a string) and attempt of a job id (`<batch>:<index>` or
-- `<batch>:<index>.<attempt>`, keys.job_id); nil batch id for an id that is not a batchq job's.
-- drop_jobs(queue, jids): delete the jobs' keys (job, lease, try counter) and take them out of the queue.

-- keys.batch_meta(''), and arq's key prefixes (arq.constants)
local BATCH_KEY = 'batchq:batch:'
local JOB_KEY = 'arq:job:'
local IN_PROGRESS_KEY = 'arq:in-progress:'
local RETRY_KEY = 'arq:retry:'

local known_batches = {}
local function batch_keys(bid)
  local k = known_batches[bid]
  if not k then
    local m = BATCH_KEY .. bid
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
      dels[#dels + 1] = JOB_KEY .. jid
      dels[#dels + 1] = IN_PROGRESS_KEY .. jid
      dels[#dels + 1] = RETRY_KEY .. jid
    end
    redis.call('DEL', unpack(dels))
    redis.call('ZREM', queue, unpack(jids, j, last))
  end
end
