-- Store one result once per attempt, with its batch's counters (store.write_result).
-- KEYS: the batch's keys (store.batch_keys).
-- ARGV: now (s), fallback ttl (s), then write_many's WRITE_FIELDS values for the result.
-- Returns 1 when this call stored it, else 0 (that attempt had its result, or a retry superseded it).

-- @include write_many.lua

local a = {}
for i = 3, #ARGV do a[i - 2] = ARGV[i] end
return write_many({{KEYS, a}}, ARGV[1], ARGV[2])[1]
