-- A batch's meta and running count, read at one moment (store.get_status).
-- KEYS: meta, running set.
-- ARGV: none.
-- Returns {HGETALL of the meta, SCARD of the running set}.
--
-- A script, not a MULTI: Redis refuses every command of a MULTI once it is at maxmemory, where a status
-- is most wanted (a submit that Redis cut short), but runs a script that only reads (a script without
-- flags is refused only a write, in Redis 6 and 7 alike).

return {redis.call('HGETALL', KEYS[1]), redis.call('SCARD', KEYS[2])}
