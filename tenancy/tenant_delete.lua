-- Delete a tenant and every key it owns in its slot, atomically (see tenancy/layout.py).
-- KEYS[1] tenant record, KEYS[2] its key-id set, KEYS[3..] usage, buckets, its slot set, the set of model
-- ids its quotas named (ARGV[3] names it too), its budgets and its billing index (ARGV[5] names it too)
-- ARGV[1] prefix of its API key records ("<T>key:"), ARGV[2] prefix of its scoped buckets
-- ("<T>bucket:"), ARGV[3] the set of model ids its quotas have named, ARGV[4] prefix of its keys' slot sets
-- ("<T>slots:key:"), ARGV[5] its billing index: a sorted set of its day-usage and budget spend keys
-- Returns {} if the tenant did not exist, else {epoch of the deleted record, its key ids...}: the caller
-- then removes the index entry of that epoch and the key ids' owner entries (other slots).
-- Keys named from ARGV and the sets are not declared in KEYS; each starts with the tenant's hash tag, so
-- on Redis Cluster they are in the slot of the declared ones.
local raw = redis.call('GET', KEYS[1])
if not raw then
  return {}
end
local out = {cjson.decode(raw).epoch or ''}
for _, key_id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  out[#out + 1] = key_id
  redis.call('DEL', ARGV[1] .. key_id, ARGV[2] .. 'key:' .. key_id .. ':requests',
    ARGV[2] .. 'key:' .. key_id .. ':tokens', ARGV[4] .. key_id)
end
for _, key in ipairs(redis.call('ZRANGE', ARGV[5], 0, -1)) do
  redis.call('DEL', key)
end
for _, model in ipairs(redis.call('SMEMBERS', ARGV[3])) do
  redis.call('DEL', ARGV[2] .. 'model:' .. model .. ':requests', ARGV[2] .. 'model:' .. model .. ':tokens')
end
for i = 1, #KEYS do
  redis.call('DEL', KEYS[i])
end
return out
