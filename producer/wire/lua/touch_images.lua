-- Submit stores each image of a batch once (producer/client/images.py store_images): this script keeps the
-- images already stored for as long as the batch needs them, and says which are missing.
-- KEYS: image keys (keys.image).
-- ARGV: the TTL in seconds the batch needs its images for.
-- Returns the 1-based positions in KEYS of the images not stored, for the caller to SET NX.

local ttl = tonumber(ARGV[1])
local missing = {}
for i, key in ipairs(KEYS) do
  local left = redis.call('TTL', key)
  if left == -2 then
    missing[#missing + 1] = i
  elseif left >= 0 and left < ttl then
    -- never shortened: another batch that shows the same image may need it for longer
    redis.call('EXPIRE', key, ttl)
  end
end
return missing
