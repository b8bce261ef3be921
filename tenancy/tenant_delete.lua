-- Delete a tenant and every key it owns, atomically (see tenancy/layout.py).
-- KEYS[1] tenant record, KEYS[2] its key-id set, KEYS[3] the tenant index, KEYS[4..] usage, buckets
-- and its slot set
-- ARGV[1] prefix of API key records ("<P>key:"), ARGV[2] tenant id, ARGV[3] (optional) prefix of its
-- keys' slot sets ("<P>slots:<id>:key:")
-- Returns 0 if the tenant did not exist (nothing deleted but a stray index entry), else 1.
-- The API key records (and their slot sets) are named from ARGV[1] (ARGV[3]) and the key-id set, not
-- declared in KEYS: atomic on one Redis (what radixgate uses), not portable to Redis Cluster as it stands.
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[2])  -- an index entry without its record goes too
  return 0
end
for _, key_id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  redis.call('DEL', ARGV[1] .. key_id)
  if ARGV[3] then
    redis.call('DEL', ARGV[3] .. key_id)
  end
end
redis.call('SREM', KEYS[3], ARGV[2])
for i = 1, #KEYS do
  if i ~= 3 then
    redis.call('DEL', KEYS[i])
  end
end
return 1
