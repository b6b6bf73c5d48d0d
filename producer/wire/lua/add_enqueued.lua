-- Submit counts results it wrote itself (invalid lines, result-cache answers) in an unfinished submit's
-- ENQUEUED count (enqueue.enqueue_spool); nothing once the submit finished (the field is gone).
-- KEYS: batch meta.
-- ARGV: n.
-- Returns nothing.

-- the meta field of an unfinished submit's count (store.ENQUEUED)
local ENQUEUED = 'enqueued'

if redis.call('HEXISTS', KEYS[1], ENQUEUED) == 1 then redis.call('HINCRBY', KEYS[1], ENQUEUED, ARGV[1]) end
