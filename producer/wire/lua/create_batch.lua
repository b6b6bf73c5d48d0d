-- Submit creates a batch once (enqueue.create_batch).
-- KEYS: meta, batches index, content digests.
-- ARGV: total, created_at, batch id, content digest, the requests' digests (DIGEST_BYTES each, in index
-- order), then the meta's field/value pairs.
-- Returns {0} when it created the batch, else {the total already recorded, its content digest ('' for a
-- batch that predates digests)}: a resubmission, which the caller checks against the input.

local existing = redis.call('HMGET', KEYS[1], 'total', 'digest')
if existing[1] then return {tonumber(existing[1]), existing[2] or ''} end
redis.call('HSET', KEYS[1], 'total', ARGV[1], 'created_at', ARGV[2], 'digest', ARGV[4], unpack(ARGV, 6))
redis.call('SET', KEYS[3], ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
return {0}
