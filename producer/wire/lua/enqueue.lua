-- Submit enqueues a chunk of consecutive requests as arq jobs (enqueue.enqueue_spool).
-- KEYS: queue, results hash, chat bitmap, batch meta.
-- ARGV: job id prefix ("<batch id>:"), first index, enqueue time (ms), kinds (one byte per job: c chat,
-- p prompt, e embeddings), orders (3 hex digits of validate.queue_order per job), fresh ("1" when this
-- submit created the batch), then one payload per job for consecutive indices.
-- Returns the number of jobs written (a resubmission skips those already there).
--
-- One argument per job: redis-py packs each argument in Python, and five per job cost more than the
-- script. A fresh batch has no results and no job keys but those this submit wrote (a chunk's indices are
-- its own), so one MSETNX writes the chunk's jobs; should it find a key after all (another submit of the
-- same batch id racing this one), it writes nothing and the checked path runs. The checked path, always
-- taken when resubmitting, skips a job whose result exists, whose arq result exists, or whose job key
-- exists. Scores are enqueue ms + order / ORDER_LEVELS: exact in a double until 2039, printed with %.17g
-- so that Redis parses back the same double. The jobs written are added to the meta's ENQUEUED count
-- while the batch has one (an unfinished submit's: see enqueue_spool).

-- arq's key prefixes (arq.constants), the meta field of an unfinished submit's count (store.ENQUEUED),
-- and the orders a millisecond of queue score holds (validate.ORDER_LEVELS)
local JOB_KEY = 'arq:job:'
local RESULT_KEY = 'arq:result:'
local ENQUEUED = 'enqueued'
local ORDER_LEVELS = 4096

local prefix, first, et = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local kinds, orders, n = ARGV[4], ARGV[5], #ARGV - 6
local members, bits, scores = {}, {}, {}
local function score(j)
  local o = string.sub(orders, 3 * j + 1, 3 * j + 3)
  local s = scores[o]
  if not s then
    s = string.format('%.17g', et + tonumber(o, 16) / ORDER_LEVELS)
    scores[o] = s
  end
  return s
end
for j = 0, n - 1 do
  if string.byte(kinds, j + 1) == 99 then
    local m = #bits
    bits[m + 1], bits[m + 2], bits[m + 3], bits[m + 4] = 'SET', 'u1', first + j, 1
  end
end
-- unpack() stops at Lua's C stack (8000 values): BITFIELD and ZADD take 4000 arguments at a time.
for i = 1, #bits, 4000 do redis.call('BITFIELD', KEYS[3], unpack(bits, i, math.min(i + 3999, #bits))) end
local written = false
if ARGV[6] == '1' and n <= 3000 then
  local kv = {}
  for j = 0, n - 1 do
    local jid = prefix .. (first + j)
    kv[2 * j + 1], kv[2 * j + 2] = JOB_KEY .. jid, ARGV[j + 7]
    members[2 * j + 1], members[2 * j + 2] = score(j), jid
  end
  written = redis.call('MSETNX', unpack(kv)) == 1
  if not written then members = {} end
end
if not written then
  for j = 0, n - 1 do
    local idx = first + j
    local jid = prefix .. idx
    if redis.call('HEXISTS', KEYS[2], idx) == 0 and redis.call('EXISTS', RESULT_KEY .. jid) == 0
       and redis.call('SET', JOB_KEY .. jid, ARGV[j + 7], 'NX') then
      local m = #members
      members[m + 1], members[m + 2] = score(j), jid
    end
  end
end
for i = 1, #members, 4000 do redis.call('ZADD', KEYS[1], unpack(members, i, math.min(i + 3999, #members))) end
if #members > 0 and redis.call('HEXISTS', KEYS[4], ENQUEUED) == 1 then
  redis.call('HINCRBY', KEYS[4], ENQUEUED, #members / 2)
end
return #members / 2
