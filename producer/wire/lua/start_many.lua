-- start_many(entries): a worker starts running requests' attempts. Included by start_attempt.lua (one)
-- and claim_jobs.lua (the worker's bulk claim); not run alone.
--
-- entries: {k, index, attempt} each, k the batch's keys (store.batch_keys).
-- Returns two tables. First, per entry: 0 when there is nothing to run (that attempt has its result, or a
-- retry superseded it), else 1, or 2 when its batch is cancelled. Second, per started entry: whether its
-- index was in the running set already: a worker took it before and died with it (a hand-back takes the
-- index out), which is what counts as a failed try.
-- The indices join their running sets in the same call, so a request is never counted as running and
-- finished at once.

local function start_many(entries)
  local groups, order, out = {}, {}, {}
  for i, e in ipairs(entries) do
    local k, idx, attempt = e[1], e[2], e[3]
    local g = groups[k[1]]
    if not g then
      g = {k = k, sadd = {}, at = {}, retried = redis.call('EXISTS', k[5]) == 1,
           cancelled = redis.call('HGET', k[1], 'cancel_requested') == '1'}
      groups[k[1]] = g
      order[#order + 1] = k[1]
    end
    local current = 0
    if g.retried then current = tonumber(redis.call('HGET', k[5], idx) or '0') end
    local code = 0
    if attempt == current then
      if attempt == 0 then
        if redis.call('HEXISTS', k[2], idx) == 0 then code = 1 end
      else
        local old = redis.call('HGET', k[2], idx)
        if not (old and attempt <= (tonumber(cjson.decode(old).attempt) or 0)) then code = 1 end
      end
    end
    if code == 1 then
      g.sadd[#g.sadd + 1] = idx
      g.at[#g.at + 1] = i
      if g.cancelled then code = 2 end
    end
    out[i] = code
  end
  local again = {}
  for _, meta in ipairs(order) do
    local g = groups[meta]
    for j = 1, #g.sadd, 4000 do
      local last = math.min(j + 3999, #g.sadd)
      local was = redis.call('SMISMEMBER', g.k[3], unpack(g.sadd, j, last))
      for n = 1, #was do again[g.at[j + n - 1]] = was[n] == 1 end
      redis.call('SADD', g.k[3], unpack(g.sadd, j, last))
    end
  end
  return out, again
end
