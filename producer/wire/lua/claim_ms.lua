-- A submit's enqueue millisecond, from Redis's clock and strictly after the last one handed out on this
-- queue (enqueue.enqueue_spool). Requests of a batch are ordered by fractions of that millisecond
-- (validate.queue_order), so two batches enqueued within one millisecond, or by producers whose clocks
-- disagree, would otherwise interleave.
-- KEYS: the queue's clock (keys.queue_clock).
-- ARGV: none.
-- Returns the millisecond (an integer).

local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
if ms <= last then ms = last + 1 end
redis.call('SET', KEYS[1], ms)
return ms
