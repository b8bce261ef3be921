-- Release one concurrency slot: remove its id from each of its slot sets (see tenancy/concurrency.py).
-- An empty set is deleted by Redis; a set that is gone (tenant deleted, lease ended) is left gone.
-- KEYS[i] slot set i; ARGV[1] the slot id
-- Returns how many sets still held it.
local removed = 0
for i = 1, #KEYS do
  removed = removed + redis.call('ZREM', KEYS[i], ARGV[1])
end
return removed
