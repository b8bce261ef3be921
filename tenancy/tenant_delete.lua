-- Delete a tenant and every key it owns, atomically (see tenancy/layout.py).
-- KEYS[1] tenant record, KEYS[2] its key-id set, KEYS[3] the tenant index, KEYS[4..] usage, buckets, its
-- slot set, the set of model ids its quotas named (ARGV[4] names it too), its budgets and its billing
-- index (ARGV[6] names it too)
-- ARGV[1] prefix of API key records ("<P>key:"), ARGV[2] tenant id, ARGV[3] prefix of the tenant's scoped
-- buckets ("<P>bucket:<id>:"), ARGV[4] the set of model ids its quotas have named, ARGV[5] prefix of its
-- keys' slot sets ("<P>slots:<id>:key:"), ARGV[6] its billing index: a sorted set of its day-usage and
-- budget spend keys
-- Returns 0 if the tenant did not exist (nothing deleted but a stray index entry), else 1.
-- The API key records, the keys' buckets and slot sets and the models' buckets are named from ARGV and the
-- sets, not declared in KEYS: atomic on one Redis (what radixgate uses), not portable to Redis Cluster as
-- it stands.
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[2])  -- an index entry without its record goes too
  return 0
end
for _, key_id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  redis.call('DEL', ARGV[1] .. key_id, ARGV[3] .. 'key:' .. key_id .. ':requests',
    ARGV[3] .. 'key:' .. key_id .. ':tokens', ARGV[5] .. key_id)
end
for _, key in ipairs(redis.call('ZRANGE', ARGV[6], 0, -1)) do
  redis.call('DEL', key)
end
for _, model in ipairs(redis.call('SMEMBERS', ARGV[4])) do
  redis.call('DEL', ARGV[3] .. 'model:' .. model .. ':requests', ARGV[3] .. 'model:' .. model .. ':tokens')
end
redis.call('SREM', KEYS[3], ARGV[2])
for i = 1, #KEYS do
  if i ~= 3 then
    redis.call('DEL', KEYS[i])
  end
end
return 1
