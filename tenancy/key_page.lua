-- One page of a tenant's API keys, oldest first, read atomically (see tenancy/layout.py).
-- KEYS[1] tenant record, KEYS[2] its key-id set, KEYS[3] its key ids scored by creation time (sorted set)
-- ARGV[1] prefix of its API key records ("<T>key:"), ARGV[2] the key id to start after ("" = the oldest),
-- ARGV[3] page size
-- Returns -1 if the tenant does not exist, -2 if ARGV[2] is not one of its keys, else
-- {more (1 when keys follow the page, else 0), key record JSON, ...}.
-- Order: creation time, then key id (the sorted set's order), a total order, so a page that starts
-- after a key's position returns every key that exists throughout a listing exactly once.
-- Like tenant_delete.lua, the key records are named from ARGV[1], not declared in KEYS; they carry the
-- tenant's hash tag, so on Redis Cluster they are in the slot of the declared keys.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return -1
end
if redis.call('ZCARD', KEYS[3]) ~= redis.call('SCARD', KEYS[2]) then
  -- keys issued before the sorted set existed: indexed once, by the creation time in their record
  -- (an id without a record gets time 0 and is skipped below, so the counts match from now on)
  for _, key_id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    if not redis.call('ZSCORE', KEYS[3], key_id) then
      local raw = redis.call('GET', ARGV[1] .. key_id)
      local created = 0
      if raw then
        created = tonumber(cjson.decode(raw).created_at) or 0
      end
      redis.call('ZADD', KEYS[3], created, key_id)
    end
  end
end
local start = 0
if ARGV[2] ~= '' then
  local rank = redis.call('ZRANK', KEYS[3], ARGV[2])
  if not rank then
    return -2
  end
  start = rank + 1
end
local limit = tonumber(ARGV[3])
local out = {0}
while #out - 1 < limit do
  local ids = redis.call('ZRANGE', KEYS[3], start, start + limit - #out)
  if #ids == 0 then
    break
  end
  start = start + #ids
  local names = {}
  for i, key_id in ipairs(ids) do
    names[i] = ARGV[1] .. key_id
  end
  for _, raw in ipairs(redis.call('MGET', unpack(names))) do
    if raw then
      out[#out + 1] = raw
    end
  end
end
if #redis.call('ZRANGE', KEYS[3], start, start) > 0 then
  out[1] = 1
end
return out
