-- A worker takes one attempt of a request (store.start_attempt).
-- KEYS: the batch's keys (store.batch_keys).
-- ARGV: index, attempt.
-- Returns 0 (nothing to run), 1 (run; the index joined the running set) or 2 (its batch is cancelled).

-- @include start_many.lua

return start_many({{KEYS, ARGV[1], tonumber(ARGV[2])}})[1]
